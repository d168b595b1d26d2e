"""The relay's newer paths in one short run, cheap enough for `make valgrind-test`: a
multi-host conninfo whose first host is silent, payloads over the 1 MiB slice size, and
the event loop timing its own turns.

The conninfo names first a port that accepts TCP connections and never answers (a frozen
server), then the harness's PostgreSQL. `outbox-relay init` and the relay's sessions must
both get past the silent host: each connect gives up on it after connect_timeout, and the
next attempt starts with the host after it. Rows over 1 MiB are read after their claim in
1 MiB slices into a buffer of the payload's size: they must reach the broker byte for byte
beside the small rows around them. /metrics counts the loop's turns on both clocks.

Under OUTBOX_VALGRIND=1 `init` and the relay run under valgrind, whose errors and definite
leaks fail the test (exit status 99)."""
import hashlib
import os
import re
import uuid

from conftest import run_prog
from relay_util import (Relay, SilentListener, amqp_channel, consume, declare, free_port,
                        log_lines_at, psql_rows, write_config)

MIB = 1 << 20


def test_silent_first_host_and_rows_over_the_slice_size(services, pgdb, relay_bin, tmp_path):
    q = f"qsil-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    silent = SilentListener()
    port = free_port()
    dsn = (f"host=127.0.0.1,127.0.0.1 port={silent.port},{services.pg_port} "
           f"user={services.pg_user} dbname={pgdb.name} connect_timeout=10")
    cfg = write_config(tmp_path / "silent.ini", services, pgdb, conninfo=dsn,
                       connect_timeout="2s", relay={"http_listen": f"127.0.0.1:{port}"},
                       sink={"confirm_timeout": "30s"})
    r = None
    try:
        p = run_prog([relay_bin, "init", "-c", cfg], timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        assert silent.n_accepted >= 1, "init never tried the silent first host"
        # small rows around payloads of 1 MiB + 1 byte (two slices) and 3.5 MiB (four)
        sizes = [100, MIB + 1, 200, 3 * MIB + MIB // 2, 300]
        bodies = {str(uuid.uuid4()): os.urandom(n) for n in sizes}
        with pgdb.connect() as c:
            for mid, body in bodies.items():
                c.execute("INSERT INTO outbox.messages (message_id, exchange, routing_key, "
                          "content_type, payload) VALUES (%s, '', %s, "
                          "'application/octet-stream', %s)", (mid, q, body))
        r = Relay(relay_bin, cfg, tmp_path / "silent.log", http_port=port)
        got = consume(ch, q, len(bodies), timeout=120)
        r.wait_log(r"became the active relay", timeout=30)
        metrics = r.metrics()
        r.stop_clean()
    finally:
        if r is not None and r.proc.poll() is None:
            r.stop()
        silent.close()
        conn.close()
    text = r.text()
    assert len(got) == len(bodies), f"{len(got)} of {len(bodies)} delivered; log:\n{text[-3000:]}"
    for props, body, _ in got:
        want = bodies.get(props.message_id)
        assert want is not None, f"unknown message-id {props.message_id}"
        assert hashlib.sha256(body).digest() == hashlib.sha256(want).digest(), \
            f"{props.message_id}: {len(body)} bytes delivered, {len(want)} in the row"
    assert sorted(p.message_id for p, _, _ in got) == sorted(bodies)
    # every row marked sent
    (unsent,) = psql_rows(pgdb, "SELECT count(*) FROM outbox.messages WHERE sent_at IS NULL")[0]
    assert unsent == 0
    # the relay's own connects met the silent host, gave up on it and moved on
    timed_out = log_lines_at(text, r"connect timed out after \d+ ms at 127\.0\.0\.1:"
                                   rf"{silent.port}; the next attempt starts with the host")
    assert timed_out, f"no connect time-out at the silent host logged:\n{text[-3000:]}"
    # the loop timed its turns, on both clocks, as many of each
    counts = {name: int(v) for name, v in re.findall(
        r"^(outbox_relay_loop_turn(?:_cpu)?_seconds)_count (\d+)$", metrics, re.M)}
    assert set(counts) == {"outbox_relay_loop_turn_seconds",
                           "outbox_relay_loop_turn_cpu_seconds"}, metrics[:3000]
    assert counts["outbox_relay_loop_turn_seconds"] > 0
    assert counts["outbox_relay_loop_turn_seconds"] == counts["outbox_relay_loop_turn_cpu_seconds"]
