"""A large message never blocks the relay's event loop (issue 22, the RabbitMQ sink's part).

One 64 MiB row is published through the relay while a separate process asks /healthz every
~10 ms. The sink writes such a message in frames as the socket drains, going back to the loop
in between, so every probe is answered quickly throughout; the body reaches a consumer byte
for byte (sha256 of the delivered body against sha256(payload) of the row in PostgreSQL)."""
import hashlib
import os
import subprocess
import sys
import time
import urllib.request
import uuid

from conftest import wait_for
from relay_util import Relay, amqp_channel, consume, declare, free_port, psql_rows, write_config

BIG = 64 * 1024 * 1024

# Every probe must be answered within this. /healthz of an idle relay answers in well under
# a millisecond; the loop blocked for a whole 64 MiB send took up to 181 ms here, and the
# write of one pass of the socket buffer (at most 1 MiB of frames) a few ms. 100 ms leaves
# room for a shared 2-core machine (and a sanitizer build) without hiding a loop that
# waits for the kernel to drain tens of MiB.
PROBE_BOUND = 0.100

# The prober runs in its own process so that the test's consumer (pika, same interpreter)
# can never delay a probe by holding the GIL. One line per probe: start (monotonic), latency,
# HTTP status (0: no answer).
PROBER = r"""
import http.client, sys, time
port, out, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3]
import os
with open(out, "w", buffering=1) as f:
    while not os.path.exists(stop):
        t0 = time.monotonic()
        st = 0
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/healthz")
            r = c.getresponse()
            r.read()
            st = r.status
            c.close()
        except OSError:
            pass
        dt = time.monotonic() - t0
        f.write(f"{t0:.6f} {dt:.6f} {st}\n")
        time.sleep(max(0.0, 0.010 - dt))
"""


def test_64mib_message_delivered_while_healthz_answers(services, pgdb, relay_bin, tmp_path):
    q = f"qbig-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    port = free_port()
    cfg = write_config(tmp_path / "big.ini", services, pgdb,
                       relay={"name": "big", "http_listen": f"127.0.0.1:{port}"},
                       sink={"confirm_timeout": "30s"})
    p = subprocess.run([str(relay_bin), "init", "-c", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr + p.stdout
    relay = Relay(relay_bin, cfg, tmp_path / "big.log", http_port=port)
    probes_path, stop_path = tmp_path / "probes.txt", tmp_path / "probes.stop"
    prober = None
    try:
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz",
                                                timeout=5).status == 200, 30,
                 desc="/healthz", ignore=(OSError,))
        prober = subprocess.Popen([sys.executable, "-c", PROBER, str(port), str(probes_path),
                                   str(stop_path)])
        wait_for(lambda: probes_path.exists() and probes_path.stat().st_size > 0, 10,
                 desc="first probe")
        body = os.urandom(BIG)
        mid = str(uuid.uuid4())
        t_insert = time.monotonic()
        with pgdb.connect() as c:
            c.execute("INSERT INTO outbox.messages (message_id, exchange, routing_key, "
                      "content_type, payload) VALUES (%s, '', %s, 'application/octet-stream', "
                      "%s)", (mid, q, body))
        # Settled: the broker confirmed it and the relay marked the row.
        wait_for(lambda: psql_rows(pgdb, "SELECT sent_at IS NOT NULL FROM outbox.messages "
                                         "WHERE message_id = %s", (mid,))[0][0], 180,
                 interval=0.2, desc="the 64 MiB row confirmed and marked sent")
        t_sent = time.monotonic()
        time.sleep(0.3)
    finally:
        stop_path.write_text("")
        if prober is not None:
            try:
                prober.wait(timeout=10)
            except subprocess.TimeoutExpired:
                prober.kill()
                prober.wait()
    probes = []
    for line in probes_path.read_text().splitlines():
        t0, dt, st = line.split()
        probes.append((float(t0), float(dt), int(st)))
    during = [pr for pr in probes if t_insert <= pr[0] <= t_sent]
    worst = max(probes, key=lambda pr: pr[1])
    print(f"64 MiB row: settled {t_sent - t_insert:.2f}s after the insert; {len(probes)} "
          f"probes ({len(during)} in that time), slowest {worst[1] * 1000:.1f} ms at "
          f"+{worst[0] - t_insert:.2f}s")

    got = consume(ch, q, 1, timeout=120, idle=0.5)
    conn.close()
    rc = relay.stop()
    relay.assert_clean_exit(rc)

    assert len(got) == 1, f"{len(got)} deliveries"
    props, delivered, _ = got[0]
    assert props.message_id == mid
    assert len(delivered) == BIG
    (row_sha,) = psql_rows(pgdb, "SELECT encode(sha256(payload), 'hex') FROM outbox.messages "
                                 "WHERE message_id = %s", (mid,))[0]
    assert hashlib.sha256(delivered).hexdigest() == row_sha == hashlib.sha256(body).hexdigest()

    # The probes covered the whole send (one every ~10 ms), and each was answered in time.
    assert len(during) >= max(3, int((t_sent - t_insert) / 0.010 * 0.3)), \
        f"{len(during)} probes in {t_sent - t_insert:.2f}s"
    assert all(st == 200 for _, _, st in probes), [pr for pr in probes if pr[2] != 200][:5]
    slow = [f"+{t0 - t_insert:.2f}s: {dt * 1000:.0f} ms" for t0, dt, _ in probes
            if dt >= PROBE_BOUND]
    assert not slow, f"/healthz answered in {PROBE_BOUND * 1000:.0f} ms or more: {slow[:10]}"
