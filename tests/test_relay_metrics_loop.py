"""The relay times each turn of its own event loop (issue 22): /metrics carries the turns'
wall time (outbox_relay_loop_turn_seconds) and the loop thread's CPU time
(outbox_relay_loop_turn_cpu_seconds), and a turn over 1 s of wall time is counted
(outbox_relay_loop_blocked_total) and logged at WARN (loop_blocked), at most once a minute.

To block the loop for real, the relay's stderr is a pipe of one page that the test stops
reading: SIGUSR2 makes the relay log a line (signal_ignored) until the pipe is full and the
log's write(2) waits, inside a turn of the loop, until the test reads again. /healthz stops
answering meanwhile. The turn is long in wall time, not in CPU time: the thread slept in
write(2)."""
import fcntl
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request

from conftest import wait_for
from relay_util import free_port, write_config
from test_relay import init_schema

BLOCK = 1.5  # seconds the test holds the relay's log pipe full


def hist(text, name):
    """{le: cumulative count} of an unlabelled histogram (le +Inf as inf), and its count."""
    got = {float(le): int(v) for le, v in
           re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\d+)$', text, re.M)}
    count = re.search(rf"^{name}_count (\d+)$", text, re.M)
    assert got and count, f"{name} missing from /metrics:\n{text[:3000]}"
    assert got[float("inf")] == int(count.group(1))
    les = sorted(got)
    assert all(got[a] <= got[b] for a, b in zip(les, les[1:])), f"{name}: not cumulative: {got}"
    return got


def blocked_total(text):
    m = re.search(r"^outbox_relay_loop_blocked_total (\d+)$", text, re.M)
    assert m, f"outbox_relay_loop_blocked_total missing from /metrics:\n{text[:3000]}"
    return int(m.group(1))


class PipeReader:
    """Reads the relay's stderr while `gate` is set; cleared, the pipe fills up."""

    def __init__(self, fd):
        self.fd, self.buf, self.gate = fd, bytearray(), threading.Event()
        self.lock = threading.Lock()
        self.gate.set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            self.gate.wait()
            data = os.read(self.fd, 65536)
            if not data:
                return
            with self.lock:
                self.buf += data

    def text(self):
        with self.lock:
            return self.buf.decode(errors="replace")


def test_loop_turns_timed_and_a_blocked_loop_logged(services, pgdb, relay_bin, tmp_path):
    port = free_port()
    cfg = write_config(tmp_path / "loop.ini", services, pgdb,
                       relay={"name": "loop", "http_listen": f"127.0.0.1:{port}"})
    init_schema(relay_bin, cfg)
    proc = subprocess.Popen([str(relay_bin), "run", "-c", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, bufsize=0)
    fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    reader = PipeReader(proc.stdout.fileno())

    def get(path, timeout=5):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.read().decode()

    def healthz_answers(timeout):
        try:
            get("/healthz", timeout)
            return True
        except OSError:
            return False

    def block_the_loop():
        """Fills the log pipe until the loop waits in write(2); holds it BLOCK s; reads on."""
        reader.gate.clear()
        sent = 0

        def blocked():
            nonlocal sent
            for _ in range(20):
                proc.send_signal(signal.SIGUSR2)
                sent += 1
                time.sleep(0.005)
            return not healthz_answers(0.3)
        wait_for(blocked, 60, interval=0, desc="/healthz stops answering (the log pipe full)")
        t0 = time.monotonic()
        time.sleep(BLOCK)   # the condition under test: the loop is held this long
        reader.gate.set()
        wait_for(lambda: healthz_answers(5), 30, desc="/healthz answers again")
        return sent, time.monotonic() - t0

    try:
        wait_for(lambda: healthz_answers(5), 30, desc="/healthz")
        first = get("/metrics")
        n0 = hist(first, "outbox_relay_loop_turn_seconds")[float("inf")]
        assert blocked_total(first) == 0
        # an idle relay's loop still turns (timers, probes): the count moves on
        wait_for(lambda: hist(get("/metrics"), "outbox_relay_loop_turn_seconds")[float("inf")]
                 > n0 + 2, 30, desc="loop turns counted")

        sent, held = block_the_loop()
        text = get("/metrics")
        wall, cpu = (hist(text, "outbox_relay_loop_turn_seconds"),
                     hist(text, "outbox_relay_loop_turn_cpu_seconds"))
        assert wall[float("inf")] == cpu[float("inf")], "each turn is timed on both clocks"
        assert blocked_total(text) == 1, text
        assert wall[float("inf")] - wall[1.0] == 1, f"one turn over 1 s of wall time: {wall}"
        # the thread waited in write(2): that turn took little CPU time
        assert cpu[float("inf")] - cpu[1.0] == 0, f"no turn over 1 s of CPU: {cpu}"
        line = wait_for(lambda: re.search(
            r"WARN the event loop was blocked (\d+) ms \((\d+) ms of CPU\): probes and other "
            r"outboxes waited\n", reader.text()), 10, desc="the loop_blocked line")
        ms, cpu_ms = int(line.group(1)), int(line.group(2))
        print(f"{sent} SIGUSR2 filled the pipe; held {held:.2f} s; logged: blocked {ms} ms, "
              f"{cpu_ms} ms of CPU")
        # blocked from before the test began to hold the pipe until after it read again
        assert BLOCK * 1000 <= ms <= (held + 3) * 1000 and cpu_ms < 250, line.group(0)

        # a second long turn within the minute is counted, not logged
        block_the_loop()
        wait_for(lambda: blocked_total(get("/metrics")) == 2, 10, desc="the second long turn")
        # a line logged after it: whatever the relay wrote before it has been read by then
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "configuration reloaded" in reader.text(), 30,
                 desc="the reload's line")
        lines = re.findall(r".*event loop was blocked.*", reader.text())
        assert len(lines) == 1, lines
    finally:
        reader.gate.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        reader.thread.join(10)
    out = reader.text()
    assert rc == 0, out[-4000:]
    assert "ERROR: AddressSanitizer" not in out and "runtime error:" not in out, out[-4000:]
