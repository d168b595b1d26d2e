"""The Python side of the sink driver programs (tests/c/sink_amqp_test.c for sinks/rabbitmq):
`DRIVER URL [options] GROUP...` publishes numbered messages through relay/sink.h's ops and
prints one line per event (state, result, summary; see the driver's header comment).
Generic over the sink: used by tests/test_sink_contract.py (every sink) and
tests/test_sink_amqp.py (RabbitMQ only). Proxy is a TCP proxy for fault injection."""
import re
import select
import socket
import subprocess
import threading
import time

from conftest import prog_argv, run_prog, wait_for


class Run:
    """Parsed output of one sink_amqp_test run."""

    def __init__(self, rc, out, err=""):
        self.rc, self.out, self.err = rc, out, err
        self.results = {}      # idx -> [(outcome, reason), ...] in order
        self.states = []       # (state, text)
        self.summary = {}
        self.lines = out.splitlines()
        for line in self.lines:
            if line.startswith("result "):
                _, idx, outcome, *rest = line.split(" ", 3)
                self.results.setdefault(int(idx), []).append((outcome, rest[0] if rest else ""))
            elif line.startswith("state "):
                _, st, *rest = line.split(" ", 2)
                self.states.append((st, rest[0] if rest else ""))
            elif line.startswith("summary "):
                for kv in line.split()[1:]:
                    k, _, v = kv.partition("=")
                    self.summary[k] = float(v) if "." in v else int(v)

    def final(self, idx):
        return self.results[idx][-1][0]

    def __repr__(self):
        return f"rc={self.rc}\nstdout:\n{self.out[-4000:]}\nstderr:\n{self.err[-4000:]}"


def drive(binary, url, *args, timeout=120):
    """Runs the driver to the end; returns its Run."""
    r = run_prog([binary, url, *args], timeout=timeout)
    return Run(r.returncode, r.stdout, r.stderr)


class Background:
    """A sink driver running in the background; lines collected by a thread."""

    def __init__(self, binary, url, *args):
        self.p = subprocess.Popen(prog_argv([binary, url, *args]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  stdin=subprocess.DEVNULL)
        self.lines = []
        self.err = ""
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()
        self._te = threading.Thread(target=self._read_err, daemon=True)
        self._te.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))

    def _read_err(self):
        self.err = self.p.stderr.read()

    def count(self, pattern):
        rx = re.compile(pattern)
        return sum(1 for line in list(self.lines) if rx.search(line))

    def finish(self, timeout):
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self._t.join(10)
        self._te.join(10)
        return Run(self.p.returncode, "\n".join(self.lines) + "\n", self.err)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def payload(i, size):
    """Message i's body as the driver builds it: byte j = (i*7 + j*13) & 0xff (period 256)."""
    block = bytes(((i * 7 + j * 13) & 0xFF) for j in range(256))
    return (block * (size // 256 + 1))[:size]


def mid(tag, i):
    return f"{tag}-0000-4000-8000-{i:012x}"


class Proxy:
    """A TCP proxy to the broker for fault injection (like PgBouncer's drop_traffic or
    Odyssey's evil_proxy): hold() stops forwarding broker→client bytes (acks, heartbeats
    pile up unread), cut() closes every proxied connection, refuse=True closes new
    connections at once (broker "down")."""

    def __init__(self, port):
        self.upstream = ("127.0.0.1", port)
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self.holding = False
        self.stall = False      # stop reading what the client sends
        self.refuse = False
        self.pace = 0           # > 0: client->broker bytes a second at most (a network's pace)
        self.accepted = 0
        self._cut = False
        self._stop = False
        self._pairs = []
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def url(self):
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2f"

    def hold(self, on=True):
        self.holding = on

    def cut(self):
        self._cut = True
        wait_for(lambda: not self._cut, 10, desc="proxy cut")

    def close(self):
        self._stop = True
        self._t.join(10)
        self.lsock.close()

    def _close_pair(self, pair):
        for s in pair:
            try:
                s.close()
            except OSError:
                pass
        if pair in self._pairs:
            self._pairs.remove(pair)

    def _run(self):
        while not self._stop:
            if self._cut:
                for pair in list(self._pairs):
                    self._close_pair(pair)
                self._cut = False
            rl = [self.lsock]
            if not self.stall:
                rl += [c for c, _ in self._pairs]
            if not self.holding:
                rl += [u for _, u in self._pairs]
            try:
                ready, _, _ = select.select(rl, [], [], 0.02)
            except (OSError, ValueError):
                continue
            for s in ready:
                if s is self.lsock:
                    c, _ = self.lsock.accept()
                    self.accepted += 1
                    if self.refuse:
                        c.close()
                        continue
                    try:
                        u = socket.create_connection(self.upstream, timeout=5)
                    except OSError:
                        c.close()
                        continue
                    self._pairs.append((c, u))
                    continue
                pair = next((p for p in self._pairs if s in p), None)
                if pair is None:
                    continue
                other = pair[1] if s is pair[0] else pair[0]
                try:
                    data = s.recv(262144)
                    if not data:
                        raise OSError("eof")
                    other.sendall(data)
                    if self.pace > 0 and s is pair[0]:
                        time.sleep(len(data) / self.pace)
                except OSError:
                    self._close_pair(pair)
