"""Table health (issue 21): /metrics shows the outbox table's dead tuples, size, last
autovacuum and how long the database's xmin horizon has been held back; a WARN at the
default level names whoever holds it (pid, application_name, state, how long) once per
episode, and an INFO line says when it ended."""
import re
import threading
import time
import uuid

import psycopg
import pytest

from conftest import wait_for
from relay_util import (Relay, amqp_channel, consume, declare, free_port, insert_rows,
                        log_lines_at, wait_log_at, write_config)
from test_relay import init_schema


def metric(relay, name):
    return relay.metric(f"outbox_relay_{name}")


def test_held_horizon_is_measured_and_its_holder_named(services, pgdb, relay_bin, tmp_path):
    q = f"qhealth-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    port = free_port()
    cfg = write_config(tmp_path / "r.ini", services, pgdb,
                       relay={"name": "health", "http_listen": f"127.0.0.1:{port}"},
                       health_interval="200ms", horizon_warn="2s", retention="1h")
    init_schema(relay_bin, cfg)
    app = f"nightly-report-{uuid.uuid4().hex[:4]}"
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    reader = None
    try:
        wait_for(lambda: (metric(r, "table_size_bytes") or -1) > 0, 20,
                 desc="table health in /metrics", ignore=(OSError,))
        assert 0 <= metric(r, "xmin_horizon_age_seconds") < 2
        assert metric(r, "table_last_autovacuum_timestamp_seconds") >= 0
        # a report in REPEATABLE READ: its snapshot holds the horizon from its first query
        reader = psycopg.connect(services.pg_dsn(pgdb.name) + f" application_name={app}")
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM outbox.messages")
        pid = reader.info.backend_pid
        # rows relayed meanwhile: each mark leaves a dead row version vacuum cannot remove
        insert_rows(pgdb, 300, 10, routing_key=q)
        assert len(consume(ch, q, 300, timeout=30)) == 300
        line = wait_log_at(r, r"xmin horizon has been held back", levels=("WARN",), timeout=20)
        assert f"pid {pid}" in line and app in line and "idle in transaction" in line, line
        wait_for(lambda: metric(r, "xmin_horizon_age_seconds") >= 2, 10, desc="horizon age")
        wait_for(lambda: metric(r, "table_dead_tuples") >= 300, 20,
                 desc=f"dead tuples counted: {metric(r, 'table_dead_tuples')}")
        assert metric(r, "xmin_horizon_age_xids") >= 1
        # once per episode, however long it lasts
        wait_for(lambda: metric(r, "xmin_horizon_age_seconds") >= 3.5, 10, desc="held on")
        assert len(log_lines_at(r.text(), r"xmin horizon has been held back", ("WARN",))) == 1
        reader.rollback()
        reader.close()
        reader = None
        wait_log_at(r, r"xmin horizon is no longer held back", levels=("INFO",), timeout=10)
        wait_for(lambda: metric(r, "xmin_horizon_age_seconds") < 2, 10, desc="released")
        text = r.metrics()
        for name in ("table_dead_tuples", "table_live_tuples", "table_size_bytes",
                     "table_last_autovacuum_timestamp_seconds", "xmin_horizon_age_seconds",
                     "xmin_horizon_age_xids"):
            assert re.search(rf"^# TYPE outbox_relay_{name} gauge$", text, re.M), name
    finally:
        if reader is not None:
            reader.close()
        r.assert_clean_exit(r.stop())
        conn.close()
    assert "cannot see other roles' transactions" not in r.text()   # a superuser sees all


def test_health_of_a_table_whose_name_needs_quoting(services, pgdb, relay_bin, tmp_path):
    """The table's name reaches the health query as a value, not pasted into its text: a
    mixed-case schema and table (each part quoted) are read like any other, and the health
    read never fails."""
    q = f"qhealthq-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    port = free_port()
    cfg = write_config(tmp_path / "r.ini", services, pgdb,
                       relay={"name": "healthq", "http_listen": f"127.0.0.1:{port}"},
                       table="Billing.OrdersOut", health_interval="200ms", retention="1h")
    init_schema(relay_bin, cfg)
    insert_rows(pgdb, 50, 5, routing_key=q, table='"Billing"."OrdersOut"')
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    try:
        assert len(consume(ch, q, 50, timeout=30)) == 50
        wait_for(lambda: (metric(r, "table_size_bytes") or -1) > 0, 20,
                 desc="table health in /metrics", ignore=(OSError,))
        with psycopg.connect(services.pg_dsn(pgdb.name), autocommit=True) as c:
            # a message is marked after its confirm, so the last marks may follow the
            # deliveries: the size is read once every row is marked
            wait_for(lambda: c.execute("""SELECT count(*) FROM "Billing"."OrdersOut"
                                          WHERE sent_at IS NOT NULL""").fetchone()[0] == 50,
                     20, desc="every row marked sent")
            size = c.execute("""SELECT pg_total_relation_size('"Billing"."OrdersOut"')""").fetchone()[0]
        # the same relation's size, not another table's
        wait_for(lambda: metric(r, "table_size_bytes") == size, 10,
                 desc=f"size {metric(r, 'table_size_bytes')} vs {size}", ignore=(OSError,))
        assert log_lines_at(r.text(), r"table health") == []
    finally:
        r.assert_clean_exit(r.stop())
        conn.close()


def watched(services, pgdb, relay_bin, tmp_path, warn="2s"):
    """A relay reading the table's health every 200 ms, warning past `warn`, and a side
    table for the holders to write (a transaction that wrote the outbox has NOTIFYed, and
    such a transaction cannot be prepared)."""
    port = free_port()
    cfg = write_config(tmp_path / "r.ini", services, pgdb,
                       relay={"name": "health", "http_listen": f"127.0.0.1:{port}"},
                       health_interval="200ms", horizon_warn=warn, retention="1h")
    init_schema(relay_bin, cfg)
    with pgdb.connect() as c:
        c.execute("CREATE TABLE side (x int)")
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    wait_for(lambda: (metric(r, "table_size_bytes") or -1) > 0, 20,
             desc="table health in /metrics", ignore=(OSError,))
    return r


def held_lines(r):
    return log_lines_at(r.text(), r"xmin horizon has been held back", ("WARN",))


def test_a_transaction_that_wrote_and_waits_is_named(services, pgdb, relay_bin, tmp_path):
    """READ COMMITTED, one INSERT, then nothing (the forgotten COMMIT): between statements the
    session holds no snapshot (backend_xmin is NULL), but its transaction ID holds the
    horizon back all the same, and it is named like a snapshot."""
    app = f"forgot-commit-{uuid.uuid4().hex[:4]}"
    r = watched(services, pgdb, relay_bin, tmp_path)
    w = None
    try:
        w = psycopg.connect(pgdb.dsn + f" application_name={app}")
        w.execute("INSERT INTO side VALUES (1)")
        line = wait_log_at(r, r"xmin horizon has been held back", levels=("WARN",), timeout=20)
        assert f"pid {w.info.backend_pid}" in line and app in line, line
        assert "idle in transaction" in line and "end that transaction" in line, line
        assert metric(r, "xmin_horizon_age_seconds") >= 2
        w.rollback()
        wait_log_at(r, r"xmin horizon is no longer held back", levels=("INFO",), timeout=10)
    finally:
        if w is not None:
            w.close()
        r.assert_clean_exit(r.stop())


def test_a_prepared_transaction_is_named(services, pgdb, relay_bin, tmp_path):
    """A prepared transaction holds its transaction ID, and the horizon, until COMMIT or
    ROLLBACK PREPARED, with no session left: it is named by its gid and owner."""
    with pgdb.connect() as c:
        if int(c.execute("SHOW max_prepared_transactions").fetchone()[0]) == 0:
            pytest.skip("max_prepared_transactions = 0 on this server (services.sh sets 10)")
    gid = f"pay-{uuid.uuid4().hex[:6]}"
    r = watched(services, pgdb, relay_bin, tmp_path)
    prepared = False
    try:
        with psycopg.connect(pgdb.dsn, autocommit=True) as p:
            p.execute("BEGIN")
            p.execute("INSERT INTO side VALUES (1)")
            p.execute(f"PREPARE TRANSACTION '{gid}'")
            prepared = True
        line = wait_log_at(r, r"xmin horizon has been held back", levels=("WARN",), timeout=20)
        assert f'prepared transaction "{gid}"' in line and "ROLLBACK PREPARED" in line, line
        with pgdb.connect() as c:
            c.execute(f"ROLLBACK PREPARED '{gid}'")
        prepared = False
        wait_log_at(r, r"xmin horizon is no longer held back", levels=("INFO",), timeout=10)
    finally:
        if prepared:    # it would hold the whole cluster's horizon for every later test
            with pgdb.connect() as c:
                c.execute(f"ROLLBACK PREPARED '{gid}'")
        r.assert_clean_exit(r.stop())


def test_a_session_whose_snapshot_moves_on_is_not_reported(services, pgdb, relay_bin, tmp_path):
    """A READ COMMITTED transaction open for a long time but running statement after statement
    takes a new snapshot for each: it never holds the horizon longer than one statement, and
    the relay does not time it from the transaction's start (a walsender whose xmin follows
    its standby's feedback is the same case)."""
    r = watched(services, pgdb, relay_bin, tmp_path, warn="2s")
    stop = threading.Event()

    def commits():      # transaction IDs go on, so each new snapshot's xmin is newer
        with pgdb.connect() as c:
            while not stop.is_set():
                c.execute("INSERT INTO side VALUES (1)")
                time.sleep(0.05)
    t = threading.Thread(target=commits, daemon=True)
    t.start()
    s = None
    try:
        s = psycopg.connect(pgdb.dsn + " application_name=busy-reader")
        t0 = time.monotonic()
        seen = set()
        while time.monotonic() - t0 < 6:
            seen.add(s.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text, "
                               "pg_sleep(0.3)").fetchone()[0])
        assert len(seen) >= 5, f"the snapshots did not move on: {seen}"
        assert held_lines(r) == [], held_lines(r)
        assert metric(r, "xmin_horizon_age_seconds") < 2
    finally:
        stop.set()
        t.join(10)
        if s is not None:
            s.close()
        r.assert_clean_exit(r.stop())


def test_when_the_oldest_holder_ends_the_next_one_is_named(services, pgdb, relay_bin, tmp_path):
    """Two reports in REPEATABLE READ, both past horizon_warn; the older ends first: the relay
    says it let go, naming it, and names the younger one, still holding; when that ends too,
    the release line names it, not the first."""
    r = watched(services, pgdb, relay_bin, tmp_path)
    readers = []
    try:
        for app in ("older-report", "younger-report"):
            c = psycopg.connect(pgdb.dsn + f" application_name={app}")
            c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            c.execute("SELECT 1")
            with pgdb.connect() as w:      # so that the younger's snapshot is newer
                w.execute("INSERT INTO side VALUES (1)")
            readers.append(c)
        older, younger = (c.info.backend_pid for c in readers)
        line = wait_log_at(r, r"xmin horizon has been held back", levels=("WARN",), timeout=20)
        assert f"pid {older}" in line, line
        time.sleep(2.5)                     # the younger is past horizon_warn too
        readers[0].rollback()
        released = wait_log_at(r, r"xmin horizon is no longer held back", levels=("INFO",))
        assert f"by pid {older}" in released and f"now pid {younger}" in released, released
        line = wait_log_at(r, r"xmin horizon has been held back", levels=("WARN",), count=2)
        assert f"pid {younger}" in line and "younger-report" in line, line
        readers[1].rollback()
        released = wait_log_at(r, r"xmin horizon is no longer held back", levels=("INFO",),
                               count=2)
        assert f"by pid {younger}" in released, released
        assert len(held_lines(r)) == 2
    finally:
        for c in readers:
            c.close()
        r.assert_clean_exit(r.stop())
