"""The end-to-end latency histogram (issue 12): from a row's created_at (the producer's
transaction) to the broker's confirm, measured as the row's age when claimed in the
database's own clock plus the relay's monotonic time from claim to confirm, so neither the
relay's wall clock nor clock skew between the hosts enters it."""
import re
import uuid

from conftest import wait_for
from relay_util import (Relay, amqp_channel, consume, declare, free_port, insert_rows,
                        write_config)
from test_relay import init_schema


def buckets(text, name):
    return {le: float(v) for le, v in re.findall(
        rf'^{name}_bucket{{outbox="main",le="([^"]+)"}} (\S+)$', text, re.M)}


def test_end_to_end_latency_uses_the_database_clock(services, pgdb, relay_bin, tmp_path):
    q = f"qe2e-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    port = free_port()
    cfg = write_config(tmp_path / "r.ini", services, pgdb,
                       relay={"name": "e2e", "http_listen": f"127.0.0.1:{port}"})
    init_schema(relay_bin, cfg)
    # 50 rows that the database says were created 20 s ago (a producer whose transaction
    # took that long, or a relay that was down), then 50 fresh ones once those are through
    insert_rows(pgdb, 50, 5, routing_key=q)
    pgdb.connect().execute("UPDATE outbox.messages SET created_at = now() - interval '20 seconds'")
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    try:
        assert len(consume(ch, q, 50, timeout=30)) == 50
        name = "outbox_relay_end_to_end_latency_seconds"
        wait_for(lambda: buckets(r.metrics(), name).get("+Inf") == 50, 10, desc="50 observed",
                 ignore=(OSError,))
        b = buckets(r.metrics(), name)
        assert b["10"] == 0 and b["30"] == 50, b      # 20 s and a little: all in (10, 30]
        insert_rows(pgdb, 50, 5, start=50, routing_key=q)
        assert len(consume(ch, q, 50, timeout=30)) == 50
        wait_for(lambda: buckets(r.metrics(), name).get("+Inf") == 100, 10, desc="100 observed")
        b = buckets(r.metrics(), name)
        assert b["2.5"] == 50 and b["10"] == 50 and b["30"] == 100, b   # fresh ones: fast
        text = r.metrics()
        assert f"# TYPE {name} histogram" in text
        s = float(re.search(rf'^{name}_sum{{outbox="main"}} (\S+)$', text, re.M).group(1))
        assert 50 * 20 <= s < 50 * 20 + 50 * 5 + 50 * 2.5, s
    finally:
        r.assert_clean_exit(r.stop())
        conn.close()
