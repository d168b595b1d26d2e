"""deploy/grants-postgres.sql gives least privilege (deploy/README.md), checked on a real server:
the producer role may only INSERT; the relay role may read/update/delete the outbox, insert
into it (dead retry) and select/insert/delete dead rows — and nothing else."""
import secrets
import subprocess
import time

import psycopg
import pytest
from psycopg import errors

from conftest import ROOT, run_prog

GRANTS = ROOT / "deploy" / "grants-postgres.sql"
T = "outbox.messages"
DEAD = "outbox.messages_dead"


@pytest.fixture
def granted(pgdb, services, relay_bin):
    """pgdb with the outbox schema (from `outbox-relay schema`) and the grants applied;
    yields connect(role) → autocommit psycopg connection logged in as a member of that role."""
    # a missing binary or a broken `schema` command is a failure, never a skip: the
    # services fixture has already made sure the server is there
    if not relay_bin.exists():
        pytest.fail(f"{relay_bin} is not built (make)", pytrace=False)
    r = run_prog([relay_bin, "schema", "--dialect", "postgres"], timeout=30, valgrind=False)
    if r.returncode != 0 or "CREATE TABLE" not in r.stdout:
        pytest.fail(f"`outbox-relay schema --dialect postgres` failed (exit {r.returncode}): "
                    f"{r.stderr.strip()[:300]}\nstdout: {r.stdout.strip()[:300]}",
                    pytrace=False)
    pgdb.psql(r.stdout)
    # twice: the grants file is idempotent
    for _ in range(2):
        pgdb.psql(None, args=("-f", str(GRANTS)))

    class Granted:
        """granted(group) → autocommit connection as a fresh login in group;
        granted.login(group) → the login's name; granted.conninfo(user) → libpq conninfo."""
        def __init__(self):
            self.logins, self.conns = [], []

        def login(self, group):
            user = f"{group}_{secrets.token_hex(4)}"
            with services.pg_connect() as admin:
                admin.execute(f'CREATE ROLE "{user}" LOGIN IN ROLE "{group}"')
            self.logins.append(user)
            return user

        def conninfo(self, user):
            return (f"host={services.pg_host} port={services.pg_port} user={user} "
                    f"dbname={pgdb.name} connect_timeout=10")

        def __call__(self, group):
            c = psycopg.connect(self.conninfo(self.login(group)), autocommit=True)
            self.conns.append(c)
            return c

    g = Granted()
    try:
        yield g
    finally:
        for c in g.conns:
            c.close()
        pgdb.close_all()
        with services.pg_connect() as admin:
            for u in g.logins:
                admin.execute(f'DROP ROLE IF EXISTS "{u}"')


def _insert(c, key="k1"):
    # ON CONFLICT without a conflict target: naming (message_id) would need SELECT on it
    return c.execute(f"INSERT INTO {T} (message_id, routing_key, partition_key, payload) "
                     "VALUES (gen_random_uuid(), 'rk', %s, '\\x0001'::bytea) "
                     "ON CONFLICT DO NOTHING", (key,)).rowcount


def _denied(c, sql, params=None):
    with pytest.raises(errors.InsufficientPrivilege):
        c.execute(sql, params)


def test_producer_may_only_insert(granted, pgdb):
    p = granted("outbox_producer")
    assert _insert(p) == 1                      # also fires the NOTIFY trigger
    # liboutbox's existence check works without any read privilege
    assert p.execute(f"SELECT to_regclass('{T}') IS NOT NULL").fetchone() == (True,)
    # inside a transaction too (the way liboutbox is used)
    with p.transaction():
        assert _insert(p, "k2") == 1
    mid = "6f1c6f0e-0000-4000-8000-000000000001"
    ins = (f"INSERT INTO {T} (message_id, routing_key, payload) VALUES (%s, 'rk', '\\x00') "
           "ON CONFLICT DO NOTHING")
    assert p.execute(ins, (mid,)).rowcount == 1
    assert p.execute(ins, (mid,)).rowcount == 0  # duplicate detected, no error, no read right
    _denied(p, f"SELECT * FROM {T}")
    _denied(p, f"SELECT count(*) FROM {T}")
    _denied(p, f"UPDATE {T} SET attempts = 1")
    _denied(p, f"DELETE FROM {T}")
    _denied(p, f"TRUNCATE {T}")
    _denied(p, f"SELECT * FROM {DEAD}")
    _denied(p, f"INSERT INTO {DEAD} (id, message_id, routing_key, payload, reason) "
               "VALUES (1, gen_random_uuid(), 'rk', '\\x00', 'x')")
    _denied(p, "CREATE TABLE outbox.evil (x int)")
    with pytest.raises(errors.InsufficientPrivilege):
        p.execute(f"DROP TABLE {T}")
    # nothing the producer did above changed anything but the two inserts
    with pgdb.connect() as su:
        assert su.execute(f"SELECT count(*), max(attempts) FROM {T}").fetchone() == (3, 0)


def test_relay_may_drain_settle_and_dead_letter(granted, pgdb):
    p = granted("outbox_producer")
    r = granted("outbox_relay")
    for k in ("a", "b", "c"):
        _insert(p, k)
    r.execute("LISTEN outbox_relay")
    # leadership: the lease row is taken and renewed with INSERT ... ON CONFLICT DO UPDATE
    for _ in range(2):
        r.execute("INSERT INTO outbox.messages_lease AS l (name, owner, epoch, expires_at) "
                  "VALUES ('leader', 'relay-1', 1, now() + interval '3 seconds') "
                  "ON CONFLICT (name) DO UPDATE SET expires_at = EXCLUDED.expires_at "
                  "WHERE l.owner = EXCLUDED.owner")
    p_denied = granted("outbox_producer")
    _denied(p_denied, "SELECT 1 FROM outbox.messages_lease")
    with r.transaction():
        ids = [row[0] for row in r.execute(
            f"SELECT id FROM {T} WHERE sent_at IS NULL ORDER BY id LIMIT 10 "
            "FOR UPDATE SKIP LOCKED")]
        assert len(ids) == 3
        r.execute(f"UPDATE {T} SET lease_owner = 'relay-1', lease_token = 7, "
                  "lease_until = now() + interval '30 seconds' WHERE id = ANY(%s)", (ids,))
    # mark sent, dead-letter one, delete one
    r.execute(f"UPDATE {T} SET sent_at = now(), lease_owner = NULL WHERE id = %s", (ids[0],))
    with r.transaction():
        r.execute(f"INSERT INTO {DEAD} (id, message_id, exchange, routing_key, partition_key, "
                  "message_type, content_type, correlation_id, headers, payload, created_at, "
                  "available_at, attempts, reason) "
                  "SELECT id, message_id, exchange, routing_key, partition_key, message_type, "
                  "content_type, correlation_id, headers, payload, created_at, available_at, "
                  f"attempts, 'unroutable' FROM {T} WHERE id = %s "
                  # the form the relay's settle statement uses
                  "ON CONFLICT (id) DO UPDATE SET reason = EXCLUDED.reason, dead_at = now()",
                  (ids[1],))
        assert r.execute(f"DELETE FROM {T} WHERE id = %s", (ids[1],)).rowcount == 1
    assert r.execute(f"DELETE FROM {T} WHERE id = %s", (ids[2],)).rowcount == 1
    # dead list / retry / purge
    assert r.execute(f"SELECT id, reason FROM {DEAD}").fetchall() == [(ids[1], "unroutable")]
    with r.transaction():
        # `dead retry` keeps the original id
        r.execute(f"INSERT INTO {T} (id, message_id, exchange, routing_key, partition_key, "
                  "payload) OVERRIDING SYSTEM VALUE SELECT id, message_id, exchange, routing_key, "
                  f"partition_key, payload FROM {DEAD} WHERE id = %s", (ids[1],))
        assert r.execute(f"DELETE FROM {DEAD} WHERE id = %s", (ids[1],)).rowcount == 1
    assert r.execute(f"SELECT count(*) FROM {T} WHERE sent_at IS NULL").fetchone() == (1,)
    # but no more than that
    _denied(r, f"TRUNCATE {T}")
    _denied(r, f"TRUNCATE {DEAD}")
    _denied(r, "CREATE TABLE outbox.evil (x int)")
    with pytest.raises(errors.InsufficientPrivilege):
        r.execute(f"DROP TABLE {DEAD}")
    with pytest.raises(errors.InsufficientPrivilege):
        r.execute(f"ALTER TABLE {T} ADD COLUMN evil int")


def test_grants_file_requires_the_tables(pgdb):
    # applied before the schema exists it fails loudly instead of granting nothing
    with pytest.raises(subprocess.CalledProcessError) as e:
        pgdb.psql(None, args=("-f", str(GRANTS)))
    assert "outbox" in e.value.stderr


def test_relay_daemon_works_with_least_privilege(granted, services, pgdb, relay_bin, amqp,
                                                 tmp_path):
    """The real relay, logged in as a member of outbox_relay only, drains, marks,
    dead-letters and runs its admin commands: the grants are enough."""
    import uuid

    from conftest import wait_for
    from relay_util import Relay, write_config

    p = granted("outbox_producer")
    relay_user = granted.login("outbox_relay")
    q = f"grants-{uuid.uuid4().hex[:8]}"
    ch = amqp.channel()
    ch.queue_declare(q, durable=True)
    for i in range(3):
        p.execute(f"INSERT INTO {T} (message_id, routing_key, partition_key, payload) "
                  "VALUES (gen_random_uuid(), %s, %s, %s)", (q, f"k{i}", f"ok-{i}".encode()))
    p.execute(f"INSERT INTO {T} (message_id, routing_key, partition_key, payload) "
              "VALUES (gen_random_uuid(), %s, 'bad', 'unroutable')", (q + "-nowhere",))
    cfg = write_config(tmp_path / "relay.ini", services, pgdb,
                       conninfo=granted.conninfo(relay_user), max_attempts="1",
                       retry_backoff="100ms", poll_interval="200ms")
    r = Relay(relay_bin, cfg, tmp_path / "relay.log")
    try:
        with pgdb.connect() as su:
            wait_for(lambda: su.execute(
                f"SELECT (SELECT count(*) FROM {T} WHERE sent_at IS NOT NULL), "
                f"(SELECT count(*) FROM {DEAD})").fetchone() == (3, 1),
                timeout=30, desc=f"3 rows marked sent and 1 dead-lettered; log:\n{r.text()[-3000:]}")
        bodies = sorted(ch.basic_get(q, auto_ack=True)[2] for _ in range(3))
        assert bodies == [b"ok-0", b"ok-1", b"ok-2"]
    finally:
        rc = r.stop()
    log = r.text()
    assert "permission denied" not in log, log[-3000:]
    r.assert_clean_exit(rc)
    for argv in (["stats", "-c", cfg], ["dead", "-c", cfg, "list"]):
        res = run_prog([relay_bin, *argv], timeout=60)
        assert res.returncode == 0, (argv, res.stdout, res.stderr)
    res = run_prog([relay_bin, "dead", "-c", cfg, "purge"], timeout=60)
    assert res.returncode == 0, res.stderr
    with pgdb.connect() as su:
        assert su.execute(f"SELECT count(*) FROM {DEAD}").fetchone() == (0,)


def test_liboutbox_sends_as_insert_only_role(granted, pgdb, build):
    """liboutbox's duplicate detection must not need any read privilege."""
    from relay_util import run_producer
    user = granted.login("outbox_producer")
    run_producer(build, granted.conninfo(user), pgdb.name, count=5, keys=2)
    with pgdb.connect() as su:
        assert su.execute(f"SELECT count(*) FROM {T}").fetchone() == (5,)


def test_relay_role_names_who_holds_the_xmin_horizon(granted, services, pgdb, relay_bin, amqp,
                                                     tmp_path):
    """The table health as outbox_relay: pg_read_all_stats (from the grants file) lets it see
    another role's transaction holding the xmin horizon back, and name it at WARN."""
    from relay_util import Relay, wait_log_at, write_config

    app = f"report-{secrets.token_hex(3)}"
    p = psycopg.connect(granted.conninfo(granted.login("outbox_producer")) +
                        f" application_name={app}")
    granted.conns.append(p)
    p.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    p.execute("SELECT 1")
    p.execute(f"INSERT INTO {T} (message_id, routing_key, payload) "
              "VALUES (gen_random_uuid(), 'nowhere', '\\x00')")   # takes an xid as well
    relay_user = granted.login("outbox_relay")
    cfg = write_config(tmp_path / "relay.ini", services, pgdb,
                       conninfo=granted.conninfo(relay_user), health_interval="200ms",
                       horizon_warn="1s")
    r = Relay(relay_bin, cfg, tmp_path / "relay.log")
    try:
        line = wait_log_at(r, r"xmin horizon has been held back", levels=("WARN",), timeout=30)
        assert f"pid {p.info.backend_pid}" in line and app in line, line
    finally:
        p.rollback()
        rc = r.stop()
    log = r.text()
    assert "permission denied" not in log, log[-3000:]
    assert "cannot see other roles' transactions" not in log, log[-3000:]
    r.assert_clean_exit(rc)


def test_relay_without_the_sequence_grant_says_so_once_and_drains(
        granted, services, pgdb, relay_bin, amqp, tmp_path):
    """Without SELECT on the outbox's id sequence the relay cannot keep its claims' floor:
    it says so once (claim_floor_unavailable, naming the refusal) and claims from the first
    row, delivering everything."""
    import uuid

    from conftest import wait_for
    from relay_util import Relay, write_config

    with pgdb.connect() as su:
        su.execute("REVOKE SELECT ON SEQUENCE outbox.messages_id_seq FROM outbox_relay")
    p = granted("outbox_producer")
    relay_user = granted.login("outbox_relay")
    q = f"grants-{uuid.uuid4().hex[:8]}"
    ch = amqp.channel()
    ch.queue_declare(q, durable=True)
    cfg = write_config(tmp_path / "relay.ini", services, pgdb,
                       conninfo=granted.conninfo(relay_user), poll_interval="200ms",
                       claim_delay="0")
    r = Relay(relay_bin, cfg, tmp_path / "relay.log")
    try:
        for i in range(30):
            p.execute(f"INSERT INTO {T} (message_id, routing_key, partition_key, payload) "
                      "VALUES (gen_random_uuid(), %s, %s, 'x')", (q, f"k{i % 3}"))
            time.sleep(0.05)
        with pgdb.connect() as su:
            wait_for(lambda: su.execute(f"SELECT count(*) FROM {T} WHERE sent_at IS NOT NULL")
                     .fetchone()[0] == 30, timeout=30, desc=f"30 rows marked; log:\n{r.text()[-2000:]}")
    finally:
        rc = r.stop()
        with pgdb.connect() as su:
            su.execute("GRANT SELECT ON SEQUENCE outbox.messages_id_seq TO outbox_relay")
    r.assert_clean_exit(rc)
    from relay_util import log_lines_at
    warned = log_lines_at(r.text(), r"claims start from the table's first row", levels=("WARN",))
    assert len(warned) == 1 and "permission denied for sequence" in warned[0], warned
    assert not log_lines_at(r.text(), r"claims start from the table's first row",
                            levels=("INFO", "ERROR"))
