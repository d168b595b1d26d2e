"""Many outboxes in one `outbox-relay run` process (issue 12): 50 outbox tables across 5
PostgreSQL databases (10 tables each), one sink. Every outbox drains completely, in per-key
order, and /metrics carries all 50. Rows written after an idle period are found again (each
outbox keeps its LISTEN and its poll). The idle CPU and peak RSS of such a process are
figures, not assertions: `make bench` measures and prints them."""
import contextlib
import time
import uuid

from conftest import scratch_database, wait_for
from relay_util import Relay, amqp_channel, consume, declare, free_port, insert_rows, write_config
from test_relay import init_schema

DBS, TABLES, KEYS, ROWS = 5, 10, 7, 60


def _outbox(db, table):
    return {"source": "postgres", "conninfo": db.dsn, "database": db.name, "table": table,
            "sink": "main", "batch_size": "100", "poll_interval": "1s", "lease": "30s",
            "max_attempts": "3", "retry_backoff": "200ms", "retry_backoff_max": "1s",
            "reconnect_max": "1s"}


def test_fifty_outboxes_in_one_process(services, relay_bin, tmp_path):
    q = f"q50-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    relay = None
    with contextlib.ExitStack() as stack:
        dbs = [stack.enter_context(contextlib.contextmanager(scratch_database)(services))
               for _ in range(DBS)]
        stack.callback(conn.close)
        outboxes = {f"d{d}_m{t}": _outbox(db, f"outbox.m{t}")
                    for d, db in enumerate(dbs) for t in range(TABLES)}
        port = free_port()
        cfg = write_config(tmp_path / "many.ini", services, dbs[0], outboxes=outboxes,
                           relay={"name": "many", "log_level": "info",
                                  "http_listen": f"127.0.0.1:{port}"},
                           sink={"publish_window": "200"})
        init_schema(relay_bin, cfg)
        relay = Relay(relay_bin, cfg, tmp_path / "many.log", http_port=port)
        stack.callback(lambda: relay.proc.poll() is None and relay.stop())
        wait_for(lambda: relay.text().count("database connected") >= len(outboxes), 60,
                 desc="every outbox connected")

        def write(round_):
            for d, db in enumerate(dbs):
                for t in range(TABLES):
                    insert_rows(db, ROWS, KEYS, start=round_ * ROWS, routing_key=q,
                                prefix=f"d{d}m{t}", table=f"outbox.m{t}")

        def check(got, round_):
            last, seen = {}, {}
            for props, body, _ in got:
                ob, seq = body.split(b"|")[0].decode(), int(props.headers["seq"])
                seen.setdefault(ob, set()).add(seq)
                k = (ob, seq % KEYS)
                assert last.get(k, -1) < seq, f"{ob} key {seq % KEYS}: {seq} after {last[k]}"
                last[k] = seq
            want = set(range(round_ * ROWS, (round_ + 1) * ROWS))
            short = {ob: len(want - s) for ob, s in seen.items() if want - s}
            assert len(seen) == len(outboxes), f"only {len(seen)} outboxes delivered"
            assert not short, f"rows missing per outbox: {short}"
            assert len(got) == len(outboxes) * ROWS, "duplicates"

        write(0)
        check(consume(ch, q, len(outboxes) * ROWS, timeout=60, idle=1.0), 0)
        # idle a while (adaptive polls back off), then every outbox wakes for new rows
        time.sleep(3)
        write(1)
        check(consume(ch, q, len(outboxes) * ROWS, timeout=60, idle=1.0), 1)
        text = relay.metrics()
        for name in outboxes:
            assert f'outbox_relay_relayed_total{{outbox="{name}"}} {2 * ROWS}' in text, name
        relay.assert_clean_exit(relay.stop())
