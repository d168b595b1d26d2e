"""Many outboxes in one `outbox-relay run` process (issue 12): 50 outbox tables across 5
PostgreSQL databases (10 tables each), one sink. Every outbox drains completely, in per-key
order, and /metrics carries all 50. Rows written after an idle period are found again (each
outbox keeps its LISTEN and its poll). The idle CPU and peak RSS of such a process are
figures, not assertions: `make bench` measures and prints them."""
import contextlib
import time
import uuid

from conftest import scratch_database, wait_for
from relay_util import (MetricSampler, Relay, amqp_channel, consume, declare, free_port,
                        insert_rows, write_config)
from test_relay import init_schema

DBS, TABLES, KEYS, ROWS = 5, 10, 7, 60


def _outbox(db, table):
    return {"source": "postgres", "conninfo": db.dsn, "database": db.name, "table": table,
            "sink": "main", "batch_size": "100", "poll_interval": "1s", "lease": "30s",
            "max_attempts": "3", "retry_backoff": "200ms", "retry_backoff_max": "1s",
            "reconnect_max": "1s"}


def _per_outbox(got, keys, start, count):
    """Deliveries by outbox (the body's prefix): checks per-key order within each outbox;
    returns ({outbox: seqs seen}, {outbox: how many of start..start+count-1 are missing})."""
    last, seen = {}, {}
    for props, body, _ in got:
        ob, seq = body.split(b"|")[0].decode(), int(props.headers["seq"])
        seen.setdefault(ob, set()).add(seq)
        k = (ob, seq % keys)
        assert last.get(k, -1) < seq, f"{ob} key {seq % keys}: {seq} after {last[k]}"
        last[k] = seq
    want = set(range(start, start + count))
    return seen, {ob: len(want - s) for ob, s in seen.items() if want - s}


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
            seen, short = _per_outbox(got, KEYS, round_ * ROWS, ROWS)
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


def test_rows_in_memory_shared_by_outboxes(services, relay_bin, tmp_path):
    """max_rows_in_memory caps the rows all outboxes hold at once (claimed and buffered, or in
    flight), below what each would hold alone (publish_window + 2 x batch_size = 400 here):
    six busy outboxes never hold more than 240 rows together (outbox_relay_rows_in_memory,
    sampled while they drain), each drains completely and in per-key order. Then one busy
    outbox among five idle ones gets more than an equal sixth of the budget: shares go to the
    outboxes that hold rows."""
    limit, n, keys = 240, 1500, 5
    q = f"qmem-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    with contextlib.ExitStack() as stack:
        dbs = [stack.enter_context(contextlib.contextmanager(scratch_database)(services))
               for _ in range(2)]
        stack.callback(conn.close)
        outboxes = {f"d{d}_m{t}": _outbox(db, f"outbox.m{t}")
                    for d, db in enumerate(dbs) for t in range(3)}
        port = free_port()
        cfg = write_config(tmp_path / "mem.ini", services, dbs[0], outboxes=outboxes,
                           relay={"name": "mem", "http_listen": f"127.0.0.1:{port}",
                                  "max_rows_in_memory": str(limit)},
                           sink={"publish_window": "200"})
        init_schema(relay_bin, cfg)
        relay = Relay(relay_bin, cfg, tmp_path / "mem.log", http_port=port)
        stack.callback(lambda: relay.proc.poll() is None and relay.stop())
        wait_for(lambda: relay.text().count("database connected") >= len(outboxes), 60,
                 desc="every outbox connected")
        assert relay.metric("outbox_relay_rows_in_memory_limit", None) == limit

        def delivered(got, which, start, count):
            seen, short = _per_outbox(got, keys, start, count)
            assert set(seen) == set(which), f"outboxes delivered: {sorted(seen)}"
            assert not short, f"rows missing per outbox: {short}"

        sampler = MetricSampler(relay, "outbox_relay_rows_in_memory", outbox=None)
        try:
            wait_for(lambda: sampler.samples, 30, interval=0.01, desc="a first sample")
            for d, db in enumerate(dbs):
                for t in range(3):
                    insert_rows(db, n, keys, routing_key=q, prefix=f"d{d}m{t}",
                                table=f"outbox.m{t}")
            got = consume(ch, q, len(outboxes) * n, timeout=120, idle=1.0)
        finally:
            all_busy = sampler.stop()
        delivered(got, [f"d{d}m{t}" for d in range(2) for t in range(3)], 0, n)
        print(f"six busy outboxes: rows in memory max {max(all_busy):.0f} of {limit} "
              f"({len(all_busy)} samples)")
        assert max(all_busy) <= limit, f"rows in memory {max(all_busy):.0f} > {limit}"
        assert max(all_busy) > limit / 2, "the budget was never used: was anything drained?"

        sampler = MetricSampler(relay, "outbox_relay_rows_in_memory", outbox=None)
        try:
            wait_for(lambda: sampler.samples, 30, interval=0.01, desc="a first sample")
            insert_rows(dbs[0], 4 * n, keys, start=n, routing_key=q, prefix="d0m0",
                        table="outbox.m0")
            got = consume(ch, q, 4 * n, timeout=120, idle=1.0)
        finally:
            one_busy = sampler.stop()
        delivered(got, ["d0m0"], n, 4 * n)
        print(f"one busy outbox: rows in memory max {max(one_busy):.0f} of {limit}")
        assert max(one_busy) <= limit
        assert max(one_busy) > limit / len(outboxes), \
            f"one busy outbox held at most {max(one_busy):.0f} rows: an equal sixth, not the budget"
        relay.assert_clean_exit(relay.stop())
