"""Large rows in flight (issue 22's rate): once the sink has written a row of 64 KiB or more
whole, the relay lets go of its payload, so that [relay] max_bytes_in_memory bounds what is
buffered and being written, and publish_window what is in flight. A row whose payload was let
go and whose confirm is lost with the broker connection is given back to the table and
claimed again (its payload read anew, under a new lease), never published from memory.

Checked here against the real servers: the bytes in flight pass the byte budget while the
bytes the relay holds and its peak RSS stay within it; broker connections closed mid-drain
lose nothing, every delivery is byte-identical to its row, first deliveries keep per-key
order and duplicates stay within publish_window per close, on the PostgreSQL source and on
the ODBC source (psqlODBC)."""
import time
import uuid

import pytest

from conftest import wait_for
from relay_util import (BrokerCloser, amqp_channel, check_against_db, close_quietly, consume,
                        declare, insert_rows, log_lines_at, memory_unmeasurable, order_report,
                        proc_status_kb, queue_depth)
from test_relay_bytes import MIB, _relay, _sent, _Snapshots, _stop


class SlowConfirmProxy:
    """A TCP proxy to the broker that forwards the relay's bytes at once and the broker's
    (confirms, heartbeats) `delay` seconds late, in order: every confirm takes at least that
    long, as under a loaded broker's disk cycle, whatever the machine's speed."""

    def __init__(self, target_port, delay):
        import collections
        import socket
        import threading
        self.delay, self.target_port, self.closed = delay, target_port, False
        self._socket, self._threading = socket, threading
        self._late = collections.deque()
        self._cv = threading.Condition()
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(8)
        self.port = self.lsock.getsockname()[1]
        self.socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.lsock.accept()
                s = self._socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                s.settimeout(None)
            except OSError:
                return
            self.socks += [c, s]
            t = self._threading.Thread
            t(target=self._forward, args=(c, s), daemon=True).start()
            t(target=self._read_late, args=(s, c), daemon=True).start()
            t(target=self._send_late, daemon=True).start()

    def _forward(self, a, b):
        try:
            while not self.closed:
                data = a.recv(1 << 20)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        close_quietly(a, b)

    def _read_late(self, a, b):
        try:
            while not self.closed:
                data = a.recv(1 << 16)
                with self._cv:
                    self._late.append((time.monotonic() + self.delay, b, data))
                    self._cv.notify()
                if not data:
                    return
        except OSError:
            with self._cv:
                self._late.append((time.monotonic(), b, b""))
                self._cv.notify()

    def _send_late(self):
        while not self.closed:
            with self._cv:
                while not self._late and not self.closed:
                    self._cv.wait(0.5)
                if self.closed:
                    return
                due, b, data = self._late[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                self._late.popleft()
            try:
                if not data:
                    close_quietly(b)
                    return
                b.sendall(data)
            except OSError:
                return

    def close(self):
        self.closed = True
        with self._cv:
            self._cv.notify_all()
        close_quietly(self.lsock, *self.socks)


def test_bytes_in_flight_pass_the_budget_while_memory_stays_within_it(services, pgdb,
                                                                       relay_bin, tmp_path):
    """300 rows of 512 KiB (150 MiB) over 4 keys, max_bytes_in_memory = 4M, the default
    publish_window (1000), every confirm 300 ms late (a proxy holds the broker's answers).
    The rows in flight (sampled with the bytes held, from the same /metrics answer) reach
    more than the budget in payload bytes: before payloads were let go once written, the
    budget bounded them too (at most 8 rows, about 27 rows a second at that latency). The
    bytes the relay holds never pass the budget, every row is delivered once, in order per
    key, byte for byte, and the peak RSS (plain build) stays within

      VmHWM <= RSS before the backlog + 4 MiB (the budget) + 2 MiB (a claim's answer, at
               most half the budget) + 8 MiB (allocator slack, libpq's input buffer)"""
    why = memory_unmeasurable(relay_bin)
    n, size, budget = 300, 512 << 10, 4 * MIB
    q = f"qinfl-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    proxy = SlowConfirmProxy(services.amqp_port, 0.3)
    r = _relay(services, pgdb, relay_bin, tmp_path, "infl", relay={"max_bytes_in_memory": "4M"},
               sink={"url": f"amqp://guest:guest@127.0.0.1:{proxy.port}/%2f",
                     "heartbeat": "30s"})
    try:
        r.wait_log(r"became the active relay", timeout=30)
        wait_for(lambda: r.metric("outbox_relay_bytes_in_memory_limit", None) == budget, 10,
                 desc="the byte limit in the metrics")
        base = None if why else proc_status_kb(r.proc.pid, "VmHWM")
        snaps = _Snapshots(r, ['outbox_relay_in_flight{outbox="main"}',
                               "outbox_relay_bytes_in_memory"])
        try:
            insert_rows(pgdb, n, 4, routing_key=q, size=size)
            t0 = time.monotonic()
            wait_for(lambda: _sent(pgdb) == n, 240, interval=0.2, desc="every row marked sent")
            took = time.monotonic() - t0
        finally:
            got_snaps = snaps.stop()
        hwm = None if why else proc_status_kb(r.proc.pid, "VmHWM")
        relayed = r.metric("outbox_relay_relayed_total")
        got = consume(ch, q, n, timeout=120, idle=0.3)
    finally:
        conn.close()
        _stop(r)
        proxy.close()
    dups, _ = order_report(got, range(n), lambda s: s % 4)
    check_against_db(got, pgdb)
    inflight = max(s[0] for s in got_snaps)
    held = max(s[1] for s in got_snaps)
    print(f"{n} rows of {size >> 10} KiB drained in {took:.1f}s ({n * size / MIB / took:.0f} "
          f"MiB/s); in flight at most {inflight:.0f} rows ({inflight * size / MIB:.1f} MiB); "
          f"bytes held at most {held / MIB:.2f} MiB of {budget / MIB:.0f} "
          f"({len(got_snaps)} samples); duplicates {dups}; " +
          (f"RSS not measured ({why})" if why else
           f"VmHWM {base / 1024:.1f} MiB before, {hwm / 1024:.1f} MiB after"))
    assert relayed == n and dups == 0
    assert held <= budget, f"bytes held {held:.0f} > {budget}"
    assert inflight * size > 2 * budget, \
        f"at most {inflight:.0f} rows in flight: the byte budget still bounds them"
    if not why:
        bound = base + (4 + 2 + 8) * 1024
        assert hwm <= bound, f"peak RSS {hwm / 1024:.1f} MiB > {bound / 1024:.1f} MiB"


def _closed_mid_drain(services, pgdb, relay_bin, tmp_path, tag, n=400, keys=8, small=(),
                      close_after=40 * MIB, **ob):
    """n rows of 512 KiB over `keys` keys (the seqs in `small`: 100 bytes, their payload kept
    until the confirm); the relay's broker connection is closed from inside the broker 3
    times, each after close_after bytes received on it. Returns the deliveries."""
    size, window = 512 << 10, 1000
    small = set(small)
    name = f"bytes-{tag}"
    q = f"qlost-{tag}-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    conn.close()
    r = _relay(services, pgdb, relay_bin, tmp_path, tag, reconnect_max="1s", **ob)
    try:
        r.wait_log(r"became the active relay", timeout=60)
        closer = BrokerCloser(services, f"outbox-relay {name}/main", 3, close_after,
                              str(tmp_path / f"{tag}.closer"), "fault test")
        insert_rows(pgdb, n, keys, routing_key=q, size=size, bad=small, bad_size=100)
        closes = closer.wait()
        wait_for(lambda: _sent(pgdb) == n, 240, interval=0.2, desc="every row marked sent")
        text = r.text()
        lost = r.metric("outbox_relay_retried_unconfirmed_total")
        relayed = r.metric("outbox_relay_relayed_total")
    finally:
        _stop(r)
    depth = queue_depth(services, q)
    conn, ch = amqp_channel(services)
    try:
        got = consume(ch, q, depth, timeout=120, idle=0.3)
    finally:
        conn.close()
    assert len(got) == depth, f"queue held {depth}, consumed {len(got)}"
    check_against_db(got, pgdb)      # every delivery byte-identical to its row
    dups, _ = order_report(got, range(n), lambda s: s % keys)
    print(f"{tag}: connection closed {len(closes)}x (bytes received when closed: {closes}); "
          f"{len(got)} deliveries of {n} rows, {dups} duplicates; confirms lost "
          f"{lost:.0f}; relayed {relayed:.0f}")
    assert len(closes) == 3, f"the broker closed the relay's connection {len(closes)}x, not 3x"
    assert sum(closes) < (n - len(small)) * size, f"faults should happen mid-drain: {closes}"
    assert lost > 0, "no confirm was lost: the closes missed the rows in flight"
    assert dups <= len(closes) * window
    assert not log_lines_at(text, r"out of turn|order_violation"), text[-3000:]
    return got


def test_large_rows_lost_with_the_connection_come_back_whole(services, pgdb, relay_bin,
                                                             tmp_path):
    """PostgreSQL source: large rows whose payload the relay let go once written, lost with
    the broker connection, are given back and claimed again; nothing is lost, every
    delivery is its row byte for byte, per-key order holds."""
    _closed_mid_drain(services, pgdb, relay_bin, tmp_path, "lostpg")


def test_large_rows_lost_with_the_connection_come_back_whole_odbc(services, pgdb, relay_bin,
                                                                  tmp_path):
    """The same through the ODBC source (psqlODBC): its claims bring the payloads again."""
    if not getattr(pgdb, "odbc", None):
        pytest.skip("no psqlODBC connection string for this database")
    _closed_mid_drain(services, pgdb, relay_bin, tmp_path, "lostodbc", source="sqlserver",
                      conninfo=pgdb.odbc, poll_interval="200ms")


def test_small_rows_behind_a_large_one_of_their_key_keep_its_order(services, pgdb, relay_bin,
                                                                   tmp_path):
    """Each key's rows go large, small, small, large...: a large row's payload is let go once
    written, the small rows behind it (published while it waits for its confirm) keep theirs.
    Lost with the connection, the large row is given back, and the small ones behind it with
    it, not republished ahead of it from memory: first deliveries keep per-key order."""
    n, keys = 600, 6
    small = [s for s in range(n) if (s // keys) % 3 != 0]
    _closed_mid_drain(services, pgdb, relay_bin, tmp_path, "lostmix", n=n, keys=keys,
                      small=small, close_after=20 * MIB)
