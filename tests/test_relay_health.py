"""Table health (issue 21): /metrics shows the outbox table's dead tuples, size, last
autovacuum and how long the database's xmin horizon has been held back; a WARN at the
default level names whoever holds it (pid, application_name, state, how long) once per
episode, and an INFO line says when it ended."""
import re
import uuid

import psycopg

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
