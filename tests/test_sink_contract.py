"""The sink contract (issue 11): the behaviours of relay/sink.h written once, run against
every sink through its driver program (`DRIVER URL [options] GROUP...`, the output
tests/sink_driver.py parses) and a small adapter that knows the broker: where a row is
routed, which destinations are unroutable, missing or refuse messages, what arrived, how to
make the broker apply flow control, and how the sink words its reasons.

Sinks (the `sink` fixture): rabbitmq (sinks/rabbitmq, tests/c/sink_amqp_test.c, the
harness's RabbitMQ). Another sink adds an adapter class and its name to SINKS.

What is *not* here (tests/test_sink_amqp.py): how a row becomes an AMQP message (properties,
the headers_json → field table parser), channel closes and reopening, the passive exchange
check's cache and timeouts, heartbeats, broker-initiated closes, cluster URL lists and
failover, the check command's texts."""
import os
import re
import secrets
import threading
import time

import pytest

from conftest import wait_for
from sink_driver import Background, Proxy, drive, mid, payload

SINKS = ["rabbitmq"]


# ---------------------------------------------------------------------------- sinks
class RabbitSink:
    """RabbitMQ: a direct exchange bound to a queue (the good destination), a second queue
    on the default exchange, an exchange without bindings; all deleted afterwards."""

    def __init__(self, services, build):
        self.services = services
        self.binary = build / "tests" / "sink_amqp_test"
        if not self.binary.exists():
            pytest.fail(f"{self.binary} not built (make test-programs)", pytrace=False)
        h = secrets.token_hex(4)
        self.tag = secrets.token_hex(4)
        self.url = services.amqp_url
        self.ex, self.q, self.q2 = f"t.{h}.ex", f"t.{h}.q", f"t.{h}.q2"
        self.lonely = f"t.{h}.lonely"
        self.queues = [self.q, self.q2]
        self.proxies = []
        c = services.amqp_connect()
        ch = c.channel()
        ch.exchange_declare(self.ex, "direct", durable=True)
        ch.exchange_declare(self.lonely, "direct", durable=True)
        ch.queue_declare(self.q, durable=True)
        ch.queue_declare(self.q2, durable=True)
        ch.queue_bind(self.q, self.ex, "rk")
        c.close()
        self.good = f"{self.ex},rk"             # routed to self.q
        self.good2 = f"-,{self.q2}"             # another destination, routed to self.q2
        self.peer_text = "broker 127.0.0.1:{port} vhost /"
        self.blocked_text = "broker blocked publishing"
        self.confirm_timeout_text = "no publisher confirm for delivery tag"
        self.nack_reason = "nacked by the broker (basic.nack)"

    # --- destinations
    def unroutable(self):
        """Destinations that exist but route nowhere, with the RETURNED reason of each."""
        return [(f"{self.lonely},nowhere",
                 f"unroutable: NO_ROUTE exchange={self.lonely} routing_key=nowhere"),
                (f"{self.ex},nobody-binds-this",
                 f"unroutable: NO_ROUTE exchange={self.ex} routing_key=nobody-binds-this")]

    def missing(self):
        """A destination that does not exist, and the reason of its refusal."""
        name = f"{self.ex}.missing"
        return (f"{name},k", f"exchange '{name}' not found in vhost '/' "
                             "(404, checked with a passive exchange.declare)")

    def nacking(self):
        """A destination that accepts one message and nacks the rest."""
        q = f"{self.q}.full"
        self.queues.append(q)
        c = self.services.amqp_connect()
        c.channel().queue_declare(q, durable=True,
                                  arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
        c.close()
        return f"-,{q}", q

    def delivered(self, dest_queue):
        """(message_id, body) of every message that reached a destination's queue."""
        out = []
        c = self.services.amqp_connect()
        try:
            ch = c.channel()
            while True:
                method, props, body = ch.basic_get(dest_queue, auto_ack=True)
                if method is None:
                    return out
                out.append((props.message_id, body))
        finally:
            c.close()

    def depth(self, dest_queue):
        c = self.services.amqp_connect()
        try:
            return c.channel().queue_declare(dest_queue, passive=True).method.message_count
        finally:
            c.close()

    # --- the broker
    def proxy(self):
        p = Proxy(self.services.amqp_port)
        self.proxies.append(p)
        return p

    def block_after(self, n_bytes, workdir):
        """Makes the broker apply flow control (connection.blocked) to a driver about to
        start, once its connection has received n_bytes; the handle's release() lifts it at
        once (a rabbitmqctl call takes 5-14 s on a loaded 2-core machine). Returns once
        armed."""
        return RabbitAlarm(self.services, n_bytes, workdir)

    # --- the driver
    def run(self, *args, url=None, timeout=120):
        return drive(self.binary, url or self.url, "--tag", self.tag, *args, timeout=timeout)

    def background(self, *args, url=None):
        return Background(self.binary, url or self.url, "--tag", self.tag, *args)

    def cleanup(self):
        for p in self.proxies:
            p.close()
        try:
            c = self.services.amqp_connect()
            ch = c.channel()
            for q in self.queues:
                ch.queue_delete(q)
            ch.exchange_delete(self.ex)
            ch.exchange_delete(self.lonely)
            c.close()
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass


class RabbitAlarm:
    """One `rabbitmqctl eval` inside the broker: once a connection named sink_amqp_test (the
    driver's) has received n_bytes it raises the memory alarm (the broker then blocks
    publishing connections: connection.blocked), and clears it once the file `release`
    exists, or at the deadline. The CLI's start-up, the slow part, is over when the broker
    writes `ready`: the constructor waits for that."""

    def __init__(self, services, n_bytes, workdir, deadline_s=120):
        self.services = services
        ready, self.release_file = str(workdir / "alarm.ready"), str(workdir / "alarm.release")
        expr = (
            'ok = file:write_file("%s", <<"ready">>), '
            'N = <<"sink_amqp_test">>, After = %d, Release = "%s", '
            'Deadline = erlang:monotonic_time(millisecond) + %d, '
            'Late = fun() -> erlang:monotonic_time(millisecond) > Deadline end, '
            'Recv = fun() -> [O || P <- rabbit_networking:connections(), '
            '  {ok, O} <- [case catch rabbit_networking:connection_info(P, '
            '                [client_properties, recv_oct]) of '
            '    [{client_properties, CP}, {recv_oct, O1}] when is_list(CP) -> '
            '      case lists:keyfind(<<"connection_name">>, 1, CP) of '
            '        {_, longstr, N} -> {ok, O1}; _ -> no end; '
            '    _ -> no end]] end, '
            'Sent = fun S() -> case lists:any(fun(X) -> X >= After end, Recv()) of '
            '  true -> true; false -> case Late() of true -> false; '
            '                        false -> timer:sleep(3), S() end end end, '
            'Raised = Sent(), '
            'Raised andalso vm_memory_monitor:set_vm_memory_high_watermark(0.0000001), '
            'Held = fun H() -> case filelib:is_file(Release) orelse Late() of '
            '  true -> ok; false -> timer:sleep(5), H() end end, '
            'Raised andalso Held(), '
            'vm_memory_monitor:set_vm_memory_high_watermark(0.4), '
            'Raised.' % (ready, n_bytes, self.release_file, deadline_s * 1000))
        self._p = None

        def run():
            self._p = services.rabbitmqctl("eval", expr, timeout=deadline_s + 60)
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        wait_for(lambda: os.path.exists(ready) or not self._thread.is_alive(), 60,
                 interval=0.02, desc="the broker-side alarm to be armed")
        assert os.path.exists(ready), f"rabbitmqctl eval failed: {self._p}"

    def release(self):
        """Clears the alarm (also when it was never raised); True if it had been raised.
        Never raises: it runs in a test's finally."""
        with open(self.release_file, "w"):
            pass
        self._thread.join(30)
        if self._p is None or self._p.returncode != 0:   # the eval is stuck or failed
            self.services.rabbitmqctl("set_vm_memory_high_watermark", "0.4")
            print(f"rabbitmqctl eval: {self._p}")
            return False
        return self._p.stdout.strip() == "true"


@pytest.fixture(params=SINKS)
def sink(request, services, build):
    s = {"rabbitmq": RabbitSink}[request.param](services, build)
    try:
        yield s
    finally:
        s.cleanup()


def ids_in(sink, queue):
    return sorted(m for m, _ in sink.delivered(queue))


# ---------------------------------------------------------------------------- outcomes
def test_publish_with_confirms_acks_and_delivers_each_body_once(sink):
    """Every row is confirmed (ACK, exactly one result each) and arrives once with its body
    intact: empty, 64 bytes, 300 kB, NUL bytes included, to two destinations."""
    r = sink.run(f"{sink.good},20", f"{sink.good},3,nohdr,size=0",
                 f"{sink.good},2,size=300000", f"{sink.good2},2,size=5")
    assert r.rc == 0, r
    assert r.summary["acked"] == 27 and r.summary["total"] == 27, r
    assert all(r.results[i] == [("ACK", "")] for i in range(27)), r
    assert r.states[0][0] == "UP", r
    got = dict(sink.delivered(sink.q))
    got2 = dict(sink.delivered(sink.q2))
    assert sorted(got) == sorted(mid(sink.tag, i) for i in range(25))
    assert sorted(got2) == [mid(sink.tag, 25), mid(sink.tag, 26)]
    got.update(got2)
    for i in range(27):
        size = 64 if i < 20 else 0 if i < 23 else 300000 if i < 25 else 5
        assert got[mid(sink.tag, i)] == payload(i, size), f"message {i}: body differs"
    assert b"\x00" in got[mid(sink.tag, 0)]   # the body really carries NUL bytes


def test_unroutable_row_is_returned_as_a_failure(sink):
    """A row the broker cannot route (mandatory) comes back RETURNED with the reason, once;
    the rows around it are confirmed."""
    (u1, why1), (u2, why2) = sink.unroutable()
    r = sink.run(f"{sink.good},3", f"{u1},2", f"{u2},1", f"{sink.good},3")
    assert r.rc == 0, r
    for i in (0, 1, 2, 6, 7, 8):
        assert r.results[i] == [("ACK", "")], r
    for i, why in {3: why1, 4: why1, 5: why2}.items():
        assert r.results[i] == [("RETURNED", why)], r
    assert r.summary["returned"] == 3, r
    assert sink.depth(sink.q) == 6


def test_broker_nack_is_a_failed_attempt(sink):
    dest, queue = sink.nacking()
    r = sink.run("--window", "1", f"{dest},4")
    assert r.rc == 0, r
    assert r.results[0] == [("ACK", "")], r
    for i in (1, 2, 3):
        assert r.results[i] == [("NACKED", sink.nack_reason)], r
    assert sink.depth(queue) == 1


def test_missing_destination_refused_without_disturbing_the_rest(sink):
    """Rows to a missing destination interleaved with 400 good rows of two destinations
    (window 150): each bad row is REFUSED before anything is sent (it waits, EWAIT, while
    its destination is checked), the connection never goes down, and every good row lands
    exactly once."""
    missing, why = sink.missing()
    groups, good, good2, bad = [], [], [], []
    i = 0
    for _ in range(40):
        groups += [f"{sink.good},5", f"{missing},1", f"{sink.good2},5"]
        good += range(i, i + 5)
        bad.append(i + 5)
        good2 += range(i + 6, i + 11)
        i += 11
    r = sink.run("--window", "150", *groups)
    assert r.rc == 0, r
    assert [s for s, _ in r.states] == ["UP"], r          # nothing closed: no DOWN
    for b in bad:
        assert r.results[b] == [("REFUSED", why)], r
    for g in good + good2:
        assert r.results[g] == [("ACK", "")], r
    assert r.summary["refused"] == 40 and r.summary["acked"] == 400, r
    assert r.summary["lost"] == 0 and r.summary["rejected"] == 0, r
    assert r.summary["ewait"] >= 2, r                     # rows waited for the checks
    assert r.summary["max_in_flight"] >= 100, r           # the window was used meanwhile
    assert ids_in(sink, sink.q) == sorted(mid(sink.tag, i) for i in good)     # exactly once
    assert ids_in(sink, sink.q2) == sorted(mid(sink.tag, i) for i in good2)


def test_window_bounds_in_flight(sink):
    r = sink.run("--window", "10", f"{sink.good},1000")
    assert r.rc == 0, r
    assert r.summary["acked"] == 1000, r
    assert r.summary["max_in_flight"] == 10, r
    assert r.summary["in_flight"] == 0, r
    assert sink.depth(sink.q) == 1000


# ---------------------------------------------------------------------------- failures
def test_connection_loss_reports_unconfirmed_lost_then_reconnects(sink):
    """The connection is cut with a full window unconfirmed: exactly those come back LOST
    (not the row's fault; the driver publishes them again), the sink goes DOWN naming the
    broker, reconnects, and every row arrives."""
    p = sink.proxy()
    bg = sink.background("--window", "50", "--rate", "400", f"{sink.good},800", url=p.url())
    try:
        wait_for(lambda: bg.count(r"^result \d+ ACK") >= 50, 60, desc="first acks")
        p.hold()
        # the window fills up: 50 unconfirmed, nothing settles
        time.sleep(1.0)
        n = bg.count(r"^result ")
        time.sleep(0.3)
        assert bg.count(r"^result ") == n
        p.cut()
        p.hold(False)
        r = bg.finish(120)
    finally:
        bg.kill()
    assert r.rc == 0, r
    assert r.summary["acked"] == 800, r
    assert r.summary["lost"] == 50, r
    assert r.summary["max_in_flight"] == 50, r
    downs = [t for s, t in r.states if s == "DOWN"]
    assert len(downs) == 1 and downs[0].startswith(sink.peer_text.format(port=p.port) + ": "), r
    assert [s for s, _ in r.states] == ["UP", "DOWN", "UP"], r
    assert all(r.final(i) == "ACK" for i in range(800))
    # at least once: the LOST rows were published again (they may arrive twice)
    assert set(ids_in(sink, sink.q)) == {mid(sink.tag, i) for i in range(800)}


def test_confirm_timeout_gives_back_lost(sink):
    """No confirm within confirm_timeout: the connection is given up, what was in flight
    comes back LOST, and the sink reconnects."""
    p = sink.proxy()
    bg = sink.background("--window", "20", "--rate", "200", "--confirm-timeout", "1000",
                         f"{sink.good},300", url=p.url())
    try:
        wait_for(lambda: bg.count(r"^result \d+ ACK") >= 20, 60, desc="first acks")
        p.hold()
        wait_for(lambda: bg.count(r"^state DOWN") >= 1, 20, desc="confirm timeout")
        p.hold(False)
        r = bg.finish(120)
    finally:
        bg.kill()
    assert r.rc == 0, r
    assert r.summary["acked"] == 300, r
    assert r.summary["lost"] == 20, r
    downs = [t for s, t in r.states if s == "DOWN"]
    assert len(downs) == 1 and sink.confirm_timeout_text in downs[0], r
    assert "within 1000 ms" in downs[0], r
    assert [s for s, _ in r.states] == ["UP", "DOWN", "UP"], r


def test_unreachable_broker_backs_off_then_recovers(sink):
    p = sink.proxy()
    bg = sink.background("--rate", "100", f"{sink.good},300", url=p.url())
    try:
        wait_for(lambda: bg.count(r"^result \d+ ACK") >= 20, 60, desc="first acks")
        p.refuse = True
        p.cut()
        a0 = p.accepted
        time.sleep(3.0)
        attempts = p.accepted - a0
        p.refuse = False
        r = bg.finish(120)
    finally:
        bg.kill()
    assert r.rc == 0, r
    assert r.summary["acked"] == 300, r
    # back-off 100 ms doubling (jittered): a handful of attempts in 3 s, not a spin
    assert 2 <= attempts <= 8, attempts
    downs = [t for s, t in r.states if s == "DOWN"]
    assert len(downs) >= 3, r
    assert [s for s, _ in r.states][-1] == "UP"


def test_full_socket_buffer_never_blocks_the_loop(sink):
    """The broker stops reading: publish() must answer SINK_EAGAIN instead of blocking, the
    loop keeps ticking, and on_writable resumes."""
    p = sink.proxy()
    bg = sink.background("--ticks", f"{sink.good},160,size=262144", url=p.url())
    try:
        wait_for(lambda: bg.count(r"^state UP") >= 1, 60, desc="connected")
        p.stall = True
        time.sleep(0.5)
        t0 = bg.count(r"^tick ")
        time.sleep(2.0)
        ticks = bg.count(r"^tick ") - t0
        p.stall = False
        r = bg.finish(180)
    finally:
        bg.kill()
    assert ticks >= 5, f"event loop blocked: {ticks} ticks in 2 s"
    assert r.rc == 0, r
    assert r.summary["acked"] == 160, r
    assert r.summary["eagain"] >= 1, r
    assert r.summary["downs"] == 0, r


def test_large_messages_go_out_in_pieces_without_blocking_the_loop(sink):
    """Rows of 48 MiB (far over a socket's send buffer) between small ones, through a proxy
    that drains the socket at a network's pace (64 MiB/s) rather than loopback's: each row
    is written as the socket drains, so the loop keeps its 100 ms tick (no two ticks 200 ms
    apart; a sink writing such a row at once holds the loop until the peer has read all of
    it). Every row is confirmed once and arrives whole, byte for byte, in publish order: the
    frames of one message never mix with another's."""
    big = 48 << 20
    sizes = [64] * 3 + [big] + [64] * 3 + [big] + [64] * 3
    groups = [f"{sink.good},3", f"{sink.good},1,size={big}", f"{sink.good},3",
              f"{sink.good},1,size={big}", f"{sink.good},3"]
    p = sink.proxy()
    p.pace = 64 << 20   # ~1.5 s for the two big rows: enough 100 ms ticks to judge the loop
    r = sink.run("--ticks", "--confirm-timeout", "60000", *groups, url=p.url(), timeout=300)
    assert r.rc == 0, r
    n = len(sizes)
    assert r.summary["acked"] == n and r.summary["total"] == n and r.summary["lost"] == 0, r
    got = sink.delivered(sink.q)
    assert [m for m, _ in got] == [mid(sink.tag, i) for i in range(n)]
    for i, (_, body) in enumerate(got):
        assert len(body) == sizes[i] and body == payload(i, sizes[i]), f"message {i}: body differs"
    ticks = [float(line.split()[1]) for line in r.lines if line.startswith("tick ")]
    assert len(ticks) >= 3, r
    gaps = sorted((b - a for a, b in zip(ticks, ticks[1:])), reverse=True)
    print(f"{len(ticks)} ticks, longest gaps {[round(g, 3) for g in gaps[:3]]}")
    assert gaps[0] < 0.2, f"event loop held: longest gap between 100 ms ticks {gaps[:5]}"


def test_flow_control_pauses_publishing(sink, tmp_path):
    """The broker applies flow control (connection.blocked): the sink reports BLOCKED and
    publishes nothing new until it is lifted (only what was on the wire may still be
    confirmed), then UP, and every row is confirmed."""
    # 400 rows at 100/s; the broker applies flow control from inside once some 20 of them
    # (64-byte bodies, each with its frames) reached it, so it lands while the driver
    # publishes however slow the CLI is (an alarm set after the fact, 5-14 s a rabbitmqctl
    # call on the loaded 2-core test machine, needed 2000 rows: 22 s a run)
    n = 400
    alarm = sink.block_after(100 * 64, tmp_path)
    bg = sink.background("--rate", "100", f"{sink.good},{n}")
    raised = False
    try:
        wait_for(lambda: bg.count(r"^state BLOCKED") >= 1 or bg.p.poll() is not None, 60,
                 desc="BLOCKED state")
        n1 = bg.count(r"^result ")
        time.sleep(1.5)
        n2 = bg.count(r"^result ")
        print(f"BLOCKED after {n1} results; {n2 - n1} more in the 1.5 s after it")
        assert n2 - n1 <= 10, (n1, n2)
        assert bg.p.poll() is None
    finally:
        raised = alarm.release()
    try:
        r = bg.finish(120)
    finally:
        bg.kill()
    assert raised, "the broker never applied flow control"
    assert r.rc == 0, r
    assert r.summary["acked"] == n, r
    assert r.summary["queued_while_blocked"] == 0, r
    seq = [s for s, _ in r.states]
    b = seq.index("BLOCKED")
    assert "UP" in seq[b + 1:], r
    assert any(sink.blocked_text in t for s, t in r.states if s == "BLOCKED"), r
    # between BLOCKED and the following UP, at most a handful of late confirms
    i_b = r.lines.index(next(line for line in r.lines if line.startswith("state BLOCKED")))
    i_u = next(j for j in range(i_b + 1, len(r.lines)) if r.lines[j].startswith("state UP"))
    assert sum(1 for line in r.lines[i_b:i_u] if line.startswith("result ")) <= 10, r


def test_destroy_inside_a_callback_ends_every_callback(sink):
    """destroy() from inside on_result: no callback of any kind follows (the driver exits 3
    if one does; sanitizers and valgrind catch the rest)."""
    r = sink.run("--destroy-after", "5", f"{sink.good},200")
    assert r.rc == 0, r
    assert r.summary["acked"] == 5, r
    assert re.search(r"^destroying in_flight=\d+$", r.out, re.M), r
