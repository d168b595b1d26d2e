"""What only the libpq source (sources/pg) does, driven through build/tests/source_contract
--backend postgres (tests/c/source_contract.c, tests/source_driver.py).

Belongs here: LISTEN/NOTIFY (wake-ups, their filtering, LISTEN again after a reconnect), how
the libpq session identifies itself, and how it reports a failing connection (a DOWN per
failed attempt, DOWN with an init hint when the outbox table vanishes).
Does not belong here: any behaviour of relay/source.h that every source must have (claim,
settle, leadership, competing mode, stats, retention, dead letters, timeouts, connection
loss, the database-name check): tests/test_source_contract.py runs those against every
source, this one included. Pooler behaviour: tests/test_pgbouncer.py."""
import socket
import time
import uuid

import pytest

from conftest import valgrind_enabled
from source_driver import SLOW, Driver, driver_binary, driver_factory

T = "outbox.messages"


@pytest.fixture
def drivers(build):
    """make(db, *opts, database=, conninfo=, table=): a libpq source driver."""
    binary = driver_binary(build)

    def one(db, *opts, database=None, conninfo=None, table=None):
        return Driver(binary, "postgres", conninfo or db.dsn, database or db.name, *opts,
                      table=table or T)
    yield from driver_factory(one)


@pytest.fixture
def schema(drivers, pgdb):
    r, _ = drivers(pgdb).admin("init")
    assert r["rc"] == 0, r
    return pgdb


def insert(conn, n=1, table=T):
    """Inserts n committed rows; returns their ids."""
    return [conn.execute(f"INSERT INTO {table} (message_id, routing_key, payload) VALUES "
                         "(%s, %s, %s) RETURNING id",
                         (str(uuid.uuid4()), f"rk{i}", f"p{i}".encode())).fetchone()[0]
            for i in range(n)]


def relay_pids(conn, dbname):
    return [r[0] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = 'outbox-relay'",
        (dbname,)).fetchall()]


# ---------------------------------------------------------------------------- tests
def test_session_identifies_itself(drivers, schema):
    """One session per source, named application_name = outbox-relay (operators find it in
    pg_stat_activity; tests kill it by that name)."""
    c = schema.connect()
    d = drivers(schema)
    d.start_up()
    st, _ = d.request("stats")
    assert st["ok"] == 0, st
    assert len(relay_pids(c, schema.name)) == 1


def test_notify_wakeup_latency_and_filtering(drivers, schema, capsys):
    r, _ = drivers(schema, table="other.messages").admin("init")
    assert r["rc"] == 0, r
    c = schema.connect()
    d = drivers(schema)
    d.start_up()
    time.sleep(0.2)
    d.pending = [x for x in d.pending if not x.startswith("WAKE")]
    lat = []
    for _ in range(5):
        t0 = time.time()
        insert(c, 1)
        m = d.expect(r"^WAKE (\d+)$", 5)
        lat.append(int(m.group(1)) / 1e6 - t0)
    # another outbox in the same database notifies on the same channel: no wake-up
    insert(c, 3, table="other.messages")
    d.absent(r"^WAKE", 0.5)
    # an uncommitted insert does not wake either; its commit does
    tx = schema.connect(autocommit=False)
    insert(tx, 1)
    d.absent(r"^WAKE", 0.3)
    t0 = time.time()
    tx.commit()
    m = d.expect(r"^WAKE (\d+)$", 5)
    lat.append(int(m.group(1)) / 1e6 - t0)
    with capsys.disabled():
        print("\nNOTIFY wake-up latency (insert+commit → on_wake), ms: "
              + ", ".join(f"{x * 1000:.2f}" for x in lat))
    # the source polls nothing here: without NOTIFY no wake-up would come at all; the median
    # shows it is the notification, a loose max only guards against a stuck loop (machine load)
    limit = 0.05 if not valgrind_enabled() else 0.5
    assert sorted(lat)[len(lat) // 2] < limit, lat
    assert max(lat) < 10 * limit, lat


def test_listen_reestablished_after_the_session_is_killed(drivers, schema):
    """Killed while idle: DOWN, UP by itself, and LISTEN works on the new session."""
    c = schema.connect()
    d = drivers(schema)
    d.start_up()
    c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
              "AND application_name = 'outbox-relay'", (schema.name,))
    assert "terminating connection due to administrator command" in d.down()
    d.up(15)
    d.pending = [x for x in d.pending if not x.startswith("WAKE")]
    insert(c, 1)
    d.expect(r"^WAKE \d+$", 5)


def test_listen_reestablished_after_a_claim_and_a_killed_session(drivers, schema):
    """A session killed after claims (read a row at a time) comes back as a direct session,
    not as one behind a pooler: LISTEN works again. (The claim's row-by-row read once leaked
    into the next session's first setup query, whose answer then read as a pooler's: no
    LISTEN, no prepared statements, no fencing after every reconnect.)"""
    c = schema.connect()
    d = drivers(schema)
    d.start_up()
    insert(c, 3)
    st, rows = d.claim(10, 1)
    assert st["ok"] == 0 and len(rows) == 3, (st, rows)
    c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
              "AND application_name = 'outbox-relay'", (schema.name,))
    d.down()
    d.up(15)
    d.pending = [x for x in d.pending if not x.startswith("WAKE")]
    insert(c, 1)
    d.expect(r"^WAKE \d+$", 5)


def test_every_failed_attempt_reports_down(drivers, schema):
    """The libpq source reports DOWN for each failed attempt, the reason unchanged (the
    ODBC source reports a changed reason only: tests/test_odbcsrc.py): a wrong database
    name, a server that never answers."""
    wrong = schema.name + "x"
    d = drivers(schema, database=wrong)
    d.start()
    want = f'connected database "{schema.name}" differs from configured database "{wrong}"'
    assert d.down() == want
    assert d.down() == want           # retried with back-off
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(8)  # the kernel accepts; nobody ever answers the startup packet
        dsn = schema.dsn.replace(f"port={schema.services.pg_port}",
                                 f"port={ls.getsockname()[1]}")
        d = drivers(schema, "--connect-timeout", "300", conninfo=dsn)
        d.start()
        assert d.down(5 * SLOW) == "connect timed out after 300 ms"
        assert d.down(5 * SLOW) == "connect timed out after 300 ms"   # and retries


def test_table_dropped_while_up_goes_down_with_init_hint(drivers, schema):
    c = schema.connect()
    d = drivers(schema)
    d.start_up()
    c.execute(f"DROP TABLE {T}")
    st, _ = d.claim(10, 1)
    assert st["ok"] == -1 and "does not exist" in st["error"], st
    assert d.down() == 'outbox table "outbox"."messages" missing: run outbox-relay init'
