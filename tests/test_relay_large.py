"""A large message never blocks the relay's event loop while it is loaded or sent (issue 22).

One 64 MiB row is published through the relay while a separate process asks /healthz every
~10 ms. The PostgreSQL source reads such a payload in slices of 1 MiB after the claim, each
copied in its own turn of the loop; the sink writes the message in frames as the socket
drains, going back to the loop in between. So every probe made while the row is loaded, sent
and confirmed is answered quickly, and the body reaches a consumer byte for byte (sha256 of
the delivered body against sha256(payload) of the row in PostgreSQL).

The relay reaches the broker through a small counting proxy, so that the test knows when the
message's bytes start to flow: the load is timed from the insert's commit until then, the
send from then until the row is marked sent. The relay's own account of its loop backs the
probes: no turn from the insert to the mark took 25 ms of the loop thread's CPU time."""
import hashlib
import os
import re
import socket
import threading
import subprocess
import sys
import time
import urllib.request
import uuid

from conftest import wait_for
from relay_util import (Relay, amqp_channel, consume, declare, free_port, memory_unmeasurable,
                        psql_rows, write_config)

BIG = 64 * 1024 * 1024

# Every probe must be answered within this. /healthz of an idle relay answers in well under
# a millisecond; the loop blocked for a whole 64 MiB send took up to 181 ms here, and the
# write of one pass of the socket buffer (at most 1 MiB of frames) a few ms. 100 ms leaves
# room for a shared 2-core machine (and a sanitizer build) without hiding a loop that
# waits for the kernel to drain tens of MiB.
PROBE_BOUND = 0.100

# The relay times each turn of its event loop (outbox_relay_loop_turn_cpu_seconds: the loop
# thread's CPU time from waking to waiting again, which load on the machine hardly inflates,
# unlike a probe's wait). Loaded whole, the 64 MiB row took one or two turns of 25-40 ms of
# CPU (89-113 ms of wall time on the loaded 2-core machine: libpq read the bytes, then built
# the result at once), and probes still often answered within PROBE_BOUND; in slices of 1 MiB
# the longest turn takes 5-10 ms of CPU, in sanitizer builds too. So no turn from the insert
# to the mark may take more than this bucket bound of the histogram.
LOOP_CPU_BOUND = 0.025

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


class CountingProxy:
    """127.0.0.1:port -> the broker, recording (monotonic time, bytes so far) for what the
    relay sends. time.monotonic() is the system's CLOCK_MONOTONIC: the prober's clock too."""

    def __init__(self, target_port):
        self.target_port = target_port
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(8)
        self.port = self.lsock.getsockname()[1]
        self.sent = []  # (t, cumulative bytes relay -> broker), every connection together
        self.total = 0
        self.lock = threading.Lock()
        self.socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.lsock.accept()
                s = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                s.settimeout(None)
            except OSError:
                return
            self.socks += [c, s]
            threading.Thread(target=self._pump, args=(c, s, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(s, c, False), daemon=True).start()

    def _pump(self, src, dst, count):
        while True:
            try:
                data = src.recv(1 << 20)
                if not data:
                    break
                dst.sendall(data)
            except OSError:
                break
            if count:
                with self.lock:
                    self.total += len(data)
                    self.sent.append((time.monotonic(), self.total))
        for x in (src, dst):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def first_time_beyond(self, since, nbytes):
        """When the relay had sent nbytes more than it had at `since`, or None."""
        with self.lock:
            base = max([b for t, b in self.sent if t <= since], default=0)
            return next((t for t, b in self.sent if t > since and b - base >= nbytes), None)

    def close(self):
        self.lsock.close()
        for x in self.socks:
            try:
                x.close()
            except OSError:
                pass


def loop_turns(text, name="outbox_relay_loop_turn_cpu_seconds"):
    """{le: cumulative count} of a loop-turn histogram in /metrics text (le +Inf as inf)."""
    got = {float(le): int(v) for le, v in
           re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\d+)$', text, re.M)}
    assert got and float("inf") in got, f"{name} missing from /metrics:\n{text[:3000]}"
    return got


def turns_over(before, after):
    """Per bucket bound le: how many turns between the two readings took longer than le."""
    total = after[float("inf")] - before[float("inf")]
    return {le: total - (after[le] - before[le]) for le in sorted(after)}


def test_64mib_message_delivered_while_healthz_answers(services, pgdb, relay_bin, tmp_path):
    q = f"qbig-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    port = free_port()
    proxy = CountingProxy(services.amqp_port)
    cfg = write_config(tmp_path / "big.ini", services, pgdb,
                       relay={"name": "big", "http_listen": f"127.0.0.1:{port}"},
                       sink={"confirm_timeout": "30s",
                             "url": f"amqp://guest:guest@127.0.0.1:{proxy.port}/%2f"})
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
        cpu_before = loop_turns(relay.metrics())
        wall_before = loop_turns(relay.metrics(), "outbox_relay_loop_turn_seconds")
        t_insert = time.monotonic()
        with pgdb.connect() as c:
            c.execute("INSERT INTO outbox.messages (message_id, exchange, routing_key, "
                      "content_type, payload) VALUES (%s, '', %s, 'application/octet-stream', "
                      "%s)", (mid, q, body))
        t_committed = time.monotonic()
        # Settled: the broker confirmed it and the relay marked the row.
        wait_for(lambda: psql_rows(pgdb, "SELECT sent_at IS NOT NULL FROM outbox.messages "
                                         "WHERE message_id = %s", (mid,))[0][0], 180,
                 interval=0.2, desc="the 64 MiB row confirmed and marked sent")
        t_sent = time.monotonic()
        cpu_over = turns_over(cpu_before, loop_turns(relay.metrics()))
        wall_over = turns_over(wall_before,
                               loop_turns(relay.metrics(), "outbox_relay_loop_turn_seconds"))
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
    # The message's bytes start to flow when the relay has sent 64 KiB more to the broker
    # than before the insert (heartbeats are all it sends otherwise).
    t_flow = proxy.first_time_beyond(t_insert, 64 << 10)
    t_whole = proxy.first_time_beyond(t_insert, BIG)

    got = consume(ch, q, 1, timeout=120, idle=0.5)
    conn.close()
    rc = relay.stop()
    proxy.close()
    relay.assert_clean_exit(rc)

    assert t_flow is not None and t_whole is not None, "the relay never sent the message"
    # A probe [t0, t0 + dt] waited t0 + dt - max(t0, t_flow) of its time while the message
    # was sent: a probe held up by the claim just before and answered as the first bytes
    # flow waited ~0 of it; one held up by the send waited all of that.
    sending = [(t0, t0 + dt - max(t0, t_flow), st) for t0, dt, st in probes
               if t0 + dt >= t_flow and t0 <= t_sent]
    # Likewise for the load: from the insert's commit (the relay is told of the row and
    # claims it) until the first bytes flow to the broker, the relay loads the row.
    loading = [(t0, min(t0 + dt, t_flow) - max(t0, t_committed), st) for t0, dt, st in probes
               if t0 + dt >= t_committed and t0 <= t_flow]
    worst = max(sending, key=lambda pr: pr[1], default=(0, 0, 0))
    worst_load = max(loading, key=lambda pr: pr[1], default=(0, 0, 0))
    print(f"64 MiB row: bytes flowing +{t_flow - t_insert:.2f}s after the insert, all sent "
          f"+{t_whole - t_insert:.2f}s, confirmed and marked +{t_sent - t_insert:.2f}s; "
          f"{len(sending)} probes from the first byte to the mark, longest wait "
          f"{worst[1] * 1000:.1f} ms; while the row was claimed and loaded "
          f"({len(loading)} probes) longest wait {worst_load[1] * 1000:.1f} ms")
    longest = lambda over: next((f"over {le * 1000:g} ms" for le in sorted(over, reverse=True)
                                 if over[le] > 0), "none counted")
    print(f"turns of the loop from the insert to the mark: {cpu_over[0.0001]} over 0.1 ms of "
          f"CPU; longest in CPU time {longest(cpu_over)} ({cpu_over[0.025]} over 25 ms, "
          f"{cpu_over[0.05]} over 50 ms), in wall time {longest(wall_over)} "
          f"({wall_over[0.025]} over 25 ms, {wall_over[0.05]} over 50 ms)")

    assert len(got) == 1, f"{len(got)} deliveries"
    props, delivered, _ = got[0]
    assert props.message_id == mid
    assert len(delivered) == BIG
    (row_sha,) = psql_rows(pgdb, "SELECT encode(sha256(payload), 'hex') FROM outbox.messages "
                                 "WHERE message_id = %s", (mid,))[0]
    assert hashlib.sha256(delivered).hexdigest() == row_sha == hashlib.sha256(body).hexdigest()

    # The probes covered the send and its confirm (one every ~10 ms; at least a third of
    # them even on a loaded machine), and each was answered in time.
    assert len(sending) >= max(3, int((t_sent - t_flow) / 0.010 * 0.3)), \
        f"{len(sending)} probes in {t_sent - t_flow:.2f}s"
    assert all(st == 200 for _, _, st in probes), [pr for pr in probes if pr[2] != 200][:5]
    slow = [f"+{max(t0, t_flow) - t_flow:.2f}s: {w * 1000:.0f} ms" for t0, w, _ in sending
            if w >= PROBE_BOUND]
    assert not slow, (f"while the 64 MiB message was sent and confirmed ({t_sent - t_flow:.2f}s), "
                      f"/healthz answered in {PROBE_BOUND * 1000:.0f} ms or more: {slow[:10]}")

    # The same bound while the row was claimed and loaded from PostgreSQL: its payload comes
    # in slices of 1 MiB, each copied in a turn of the loop, never as one 64 MiB message
    # (which libpq read whole into its input buffer, then copied into a result at once).
    # Timed only in a plain build: a sanitizer's slower copies say nothing about the loop.
    why = memory_unmeasurable(relay_bin)
    if why:
        print(f"the load is not timed: {why}")
        return
    # The loop's own account: no turn from the insert to the mark (the claim, the load in
    # slices, the send, the confirm, the mark) took LOOP_CPU_BOUND of the loop thread's CPU.
    assert cpu_over[LOOP_CPU_BOUND] == 0, (
        f"{cpu_over[LOOP_CPU_BOUND]} turn(s) of the event loop took over "
        f"{LOOP_CPU_BOUND * 1000:.0f} ms of CPU while the 64 MiB row was loaded and sent "
        f"(longest {longest(cpu_over)})")
    # The probes during the load are printed and held to the loop's own blocked bound
    # (1 s) only: on a loaded 2-core machine (CI runs two builds side by side) a probe
    # waited 150-230 ms while the loop's longest turn took under 10 ms of CPU, and with the
    # row loaded whole the probes sometimes stayed under 100 ms; the CPU bound above is
    # what tells the two apart.
    assert len(loading) >= 3, f"{len(loading)} probes while the row was loaded"
    slow = [f"+{max(t0, t_committed) - t_committed:.2f}s: {w * 1000:.0f} ms"
            for t0, w, _ in loading if w >= PROBE_BOUND]
    print(f"probes while the row was loaded ({t_flow - t_committed:.2f}s): {len(loading)}, "
          f"{len(slow)} at {PROBE_BOUND * 1000:.0f} ms or more: {slow[:10]}")
    assert max(w for _, w, _ in loading) < 1.0, (
        f"while the 64 MiB row was claimed and loaded, /healthz waited 1 s or more: {slow}")
