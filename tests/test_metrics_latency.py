"""The end-to-end latency histogram (issue 12): from a row's created_at (the producer's
transaction) to the broker's confirm, measured as the row's age when claimed in the
database's own clock plus the relay's monotonic time from claim to confirm, so neither the
relay's wall clock nor clock skew between the hosts enters it.

The relay runs under faketime with its wall clock an hour behind the database's (its monotonic
clock untouched): a relay that took its own wall clock minus created_at would see every row
created an hour in the future; the histogram must still say 20 s for rows the database says
are 20 s old, and well under a second for fresh ones."""
import os
import re
import time
import uuid
from datetime import datetime, timezone

from conftest import wait_for
from relay_util import (Relay, amqp_channel, consume, declare, free_port, insert_rows,
                        write_config)
from test_relay import init_schema


# faketime's library preloaded into the relay itself (the faketime command would stand between
# the test and the relay, and a SIGTERM would end it, not the relay)
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


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
    skew = 3600
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port,
              env={"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"-{skew}",
                   "DONT_FAKE_MONOTONIC": "1",
                   # an AddressSanitizer build: faketime is preloaded before its runtime
                   "ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "")
                   + ":verify_asan_link_order=0"})
    try:
        # the relay's clock really is an hour behind (its log lines are stamped with it)
        r.wait_log("became the active relay")
        stamp = re.search(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.\d{3}Z ", r.text(), re.M).group(1)
        behind = time.time() - datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S").replace(
            tzinfo=timezone.utc).timestamp()
        assert skew - 60 < behind < skew + 60, f"the relay's clock is {behind:.0f} s behind"
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
