"""What only the RabbitMQ sink (sinks/rabbitmq) does, against the private broker.

Belongs here: how a row becomes an AMQP message (properties, the headers_json → field table
parser, EPERM for what can never be published), channel closes (a missing amq.* exchange,
an exchange deleted after its check) and nack-only channels reopened, the passive exchange
check (its cache, never blocking the loop, its timeout), heartbeats, broker-initiated
closes, cluster URL lists and failover, the check command's texts, amqp_probe.
Does not belong here: the behaviours of relay/sink.h every sink must have (ACK, RETURNED,
NACKED, REFUSED outcomes, LOST on connection loss or confirm timeout, flow control, the
window, back-off, EAGAIN, destroy inside a callback): tests/test_sink_contract.py runs
those against every sink, this one included.

tests/c/sink_amqp_test.c drives the sink (see its header comment for the message
generator); pika inspects what reached the broker. pika's own decoding of 'l'
(int64) and 'd' (double) table values is wrong (unsigned / truncated), so header
tables are decoded here, with the AMQP type letter kept.
"""
import re
import secrets
import struct
import time

import pika
import pika.data
import pytest

import sink_driver
from conftest import run_prog, wait_for
from relay_util import BrokerCloser
from sink_driver import Proxy, Run, mid

GOOD_S = 'h\u00e9llo \U0001F600 "q" \\ / \n'


# ---------------------------------------------------------------- helpers
def driver(build):
    return build / "tests" / "sink_amqp_test"


def drive(services, build, *args, timeout=120):
    return sink_driver.drive(driver(build), services.amqp_url, *args, timeout=timeout)


def Background(services, build, *args):  # noqa: N802 - reads like the class it makes
    """sink_amqp_test running in the background (sink_driver.Background)."""
    return sink_driver.Background(driver(build), services.amqp_url, *args)


def _decode_value(encoded, offset):
    """Correct AMQP 0-9-1 (RabbitMQ) field decoding; returns ((kind, value), offset)."""
    kind = encoded[offset:offset + 1].decode()
    offset += 1
    if kind == "S":
        n = struct.unpack_from(">I", encoded, offset)[0]
        offset += 4
        return ("S", encoded[offset:offset + n].decode("utf-8")), offset + n
    if kind == "l":
        return ("l", struct.unpack_from(">q", encoded, offset)[0]), offset + 8
    if kind == "d":
        return ("d", struct.unpack_from(">d", encoded, offset)[0]), offset + 8
    if kind == "t":
        return ("t", encoded[offset] != 0), offset + 1
    if kind == "V":
        return ("V", None), offset
    raise AssertionError(f"unexpected AMQP field type {kind!r}")


class TypedHeaders:
    """While active, pika decodes header tables into {key: (kind, value)}."""

    def __enter__(self):
        self._orig = pika.data.decode_value
        pika.data.decode_value = _decode_value
        return self

    def __exit__(self, *exc):
        pika.data.decode_value = self._orig


def expected_headers(i):
    return {"s": ("S", GOOD_S), "raw": ("S", "\u00e9"), "i": ("l", -42),
            "big": ("l", 9007199254740993), "d": ("d", 1.5), "e": ("d", -2.5e-3),
            "t": ("t", True), "f": ("t", False), "n": ("V", None), "empty": ("S", ""),
            "idx": ("l", i)}


@pytest.fixture
def names(services):
    """A direct exchange `ex` bound to a durable queue `q` with key `rk`, plus an
    exchange `lonely` without bindings; all deleted afterwards."""
    h = secrets.token_hex(4)
    n = type("Names", (), {})()
    n.tag = secrets.token_hex(4)
    n.ex, n.q, n.rk, n.lonely = f"t.{h}.ex", f"t.{h}.q", "rk", f"t.{h}.lonely"
    n.extra_queues = []
    c = services.amqp_connect()
    ch = c.channel()
    ch.exchange_declare(n.ex, "direct", durable=True)
    ch.exchange_declare(n.lonely, "direct", durable=True)
    ch.queue_declare(n.q, durable=True)
    ch.queue_bind(n.q, n.ex, n.rk)
    c.close()
    yield n
    try:
        c = services.amqp_connect()
        ch = c.channel()
        for q in [n.q, *n.extra_queues]:
            ch.queue_delete(q)
        ch.exchange_delete(n.ex)
        ch.exchange_delete(n.lonely)
        c.close()
    except Exception:  # noqa: BLE001 - best effort cleanup
        pass


def get_all(services, queue, limit=100000):
    """Every message in queue as (properties, body), acknowledged."""
    out = []
    c = services.amqp_connect()
    try:
        ch = c.channel()
        with TypedHeaders():
            while len(out) < limit:
                method, props, body = ch.basic_get(queue, auto_ack=True)
                if method is None:
                    break
                out.append((props, body))
    finally:
        c.close()
    return out


def queue_depth(services, queue):
    c = services.amqp_connect()
    try:
        return c.channel().queue_declare(queue, passive=True).method.message_count
    finally:
        c.close()


# ---------------------------------------------------------------- headers_json parser
def parse_json(build, text):
    r = run_prog([driver(build), "json", text], timeout=30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    if lines[0].startswith("error "):
        return lines[0][6:]
    out = {}
    for line in lines[1:]:
        _, key, kind, *val = line.split(" ")
        key = bytes.fromhex(key).decode("utf-8")
        if kind == "S":
            out[key] = ("S", bytes.fromhex(val[0]) if val else b"")
        elif kind == "l":
            out[key] = ("l", int(val[0]))
        elif kind == "d":
            out[key] = ("d", float(val[0]))
        elif kind == "t":
            out[key] = ("t", val[0] == "1")
        else:
            out[key] = (kind, None)
    assert len(out) == int(lines[0].split()[1])
    return out


def test_json_headers_types_and_escapes(build):
    got = parse_json(build, ' { "a" : "x\\u0000y\\t\\"\\\\\\/\\b\\f\\n\\r", "b":-0, "c":1e2,'
                            '"d":-9223372036854775808, "e":9223372036854775807, "f":0.25,'
                            '"g":true, "h":false, "i":null, "\\ud83d\\ude00":"\\u00e9\\u20ac",'
                            ' "raw":"\u00e9\u20ac\U0001F600", "":"" } ')
    assert got == {
        "a": ("S", b'x\x00y\t"\\/\b\f\n\r'),
        "b": ("l", 0),
        "c": ("d", 100.0),
        "d": ("l", -9223372036854775808),
        "e": ("l", 9223372036854775807),
        "f": ("d", 0.25),
        "g": ("t", True),
        "h": ("t", False),
        "i": ("V", None),
        "\U0001F600": ("S", "\u00e9\u20ac".encode()),
        "raw": ("S", "\u00e9\u20ac\U0001F600".encode()),
        "": ("S", b""),
    }
    # AMQP headers keep the JSON object's order
    assert list(got) == ["a", "b", "c", "d", "e", "f", "g", "h", "i", "\U0001F600", "raw", ""]
    assert parse_json(build, "{}") == {}
    assert parse_json(build, " {\n}\t") == {}


def test_json_headers_integer_outside_int64(build):
    """An integer outside int64 is published as a double, as before jansson; jansson reads a
    document's integers either all as integers or all as reals, so then every number of that
    row is a double (a row without one keeps its integers: see the test above)."""
    got = parse_json(build, '{"big":9223372036854775808, "neg":-9223372036854775809,'
                            ' "small":5, "zero":-0, "s":"7", "f":0.5}')
    assert got == {"big": ("d", 9223372036854775808.0), "neg": ("d", -9223372036854775808.0),
                   "small": ("d", 5.0), "zero": ("d", 0.0), "s": ("S", b"7"), "f": ("d", 0.5)}
    # a real outside double's range is still refused, also next to such an integer
    for text in ('{"a":1e999}', '{"big":99999999999999999999, "a":-1e999}'):
        assert "real number overflow" in parse_json(build, text)


# The reasons are jansson's own texts (with the offset), except where this sink decides:
# the top level's type, nesting, key length, invalid UTF-8 (named before jansson's text).
@pytest.mark.parametrize("text,why", [
    ('{"a":{"b":1}}', 'nested object not allowed (headers must be a flat object): key "a"'),
    ('{"a":[1]}', 'nested array not allowed (headers must be a flat object): key "a"'),
    ('{"a\\n":[1]}', 'key "a\\n"'),   # the key as JSON: no raw control character in a log line
    ('{"a":' + '[' * 5000 + ']' * 5000 + '}', "maximum parsing depth reached"),
    ('[1]', "expected a JSON object, got an array"),
    ('"x"', "expected a JSON object, got a string"),
    ('null', "expected a JSON object, got null"),
    ('', "unexpected token near end of file"),
    ('{"a":1} x', "end of file expected near 'x'"),
    ('{"a":1}}', "end of file expected"),
    ('{"a":1,}', "string or '}' expected"),
    ('{"a" 1}', "':' expected"),
    ('{"a":1 "b":2}', "'}' expected"),
    ('{"a":"\\ud800"}', "invalid Unicode '\\uD800'"),
    ('{"a":"\\udc00"}', "invalid Unicode '\\uDC00'"),
    ('{"a":"\\ud800\\u0041"}', "invalid Unicode"),
    ('{"a":"\\x"}', "invalid escape"),
    ('{"a":"\\u12g4"}', "invalid escape"),
    ('{"a":"x', "premature end of input"),
    ('{"a":"\t"}', "control character 0x9"),
    ('{"a":01}', "invalid token"),
    ('{"a":1.}', "invalid token"),
    ('{"a":-}', "invalid token"),
    ('{"a":1e}', "invalid token"),
    ('{"a":1e999}', "real number overflow"),
    ('{"a":tru}', "invalid token"),
    ('{"a":nul}', "invalid token"),
    ('{"a":1,"a":2}', "duplicate object key"),
    ('{"a\\u0000b":1}', "NUL byte in object key not supported"),   # accepted before jansson
    ('{' + '"' + "k" * 256 + '":1}', "is 256 bytes, longer than 255 bytes"),
    ('{' + '"' + "k" * 256 + '":{}}', "longer than 255 bytes"),
])
def test_json_headers_rejects(build, text, why):
    got = parse_json(build, text)
    assert isinstance(got, str), got
    assert got.startswith("headers_json: ") and why in got, got


def parse_json_bytes(build, raw):
    """parse_json() for raw bytes (not necessarily UTF-8): they reach the driver's argv
    unchanged because subprocess encodes str arguments with os.fsencode (surrogateescape),
    the inverse of os.fsdecode. No NUL bytes (argv cannot carry them)."""
    import os
    assert b"\0" not in raw
    text = os.fsdecode(raw)
    assert os.fsencode(text) == raw, "argv would not carry these bytes unchanged"
    return parse_json(build, text)


@pytest.mark.parametrize("bad", [
    pytest.param(b"\xc0\xaf", id="overlong-2-byte-slash"),
    pytest.param(b"\xc1\xbf", id="overlong-2-byte-c1"),
    pytest.param(b"\xe0\x80\xaf", id="overlong-3-byte-slash"),
    pytest.param(b"\xe0\x9f\xbf", id="overlong-3-byte-u07ff"),
    pytest.param(b"\xf0\x80\x80\xaf", id="overlong-4-byte-slash"),
    pytest.param(b"\xf0\x8f\xbf\xbf", id="overlong-4-byte-uffff"),
    pytest.param(b"\x80", id="lone-continuation-80"),
    pytest.param(b"\xbf", id="lone-continuation-bf"),
    pytest.param(b"a\x80b", id="continuation-between-ascii"),
    pytest.param(b"\xc3\xa9\xa9", id="extra-continuation-after-e-acute"),
    pytest.param(b"\xed\xa0\x80", id="surrogate-ud800"),
    pytest.param(b"\xed\xbf\xbf", id="surrogate-udfff"),
    pytest.param(b"\xed\xa0\xbd\xed\xb8\x80", id="surrogate-pair-cesu8"),
    pytest.param(b"\xc3", id="truncated-2-byte"),
    pytest.param(b"\xe2\x82", id="truncated-3-byte"),
    pytest.param(b"\xf0\x9f\x98", id="truncated-4-byte"),
    pytest.param(b"\xe2\x82x", id="truncated-3-byte-before-ascii"),
    pytest.param(b"\xf4\x90\x80\x80", id="above-u10ffff"),
    pytest.param(b"\xf5\x80\x80\x80", id="byte-f5"),
    pytest.param(b"\xf8\x88\x80\x80\x80", id="byte-f8-5-byte-form"),
    pytest.param(b"\xfe", id="byte-fe"),
    pytest.param(b"\xff", id="byte-ff"),
    pytest.param(None, id="valid-multibyte-accepted"),
])
def test_json_headers_rejects_invalid_utf8(build, bad):
    if bad is None:
        # the control: valid multi-byte UTF-8 at the edges of each sequence length (U+0080,
        # U+07FF, U+0800, U+D7FF, U+E000, U+FFFF, U+10000, U+10FFFF) is kept byte for byte
        good = "\u0080\u00e9\u07ff\u0800\u20ac\ud7ff\ue000\uffff\U00010000\U0001F600\U0010FFFF"
        enc = good.encode()
        assert parse_json_bytes(build, b'{"' + enc + b'":"' + enc + b'"}') == {good: ("S", enc)}
        return
    # in a value, in a key, and at the very end of the input (no closing quote)
    for raw in (b'{"a":"x' + bad + b'y"}', b'{"k' + bad + b'":1}', b'{"a":"' + bad):
        got = parse_json_bytes(build, raw)
        assert isinstance(got, str), f"{raw!r} accepted as {got!r}"
        assert "invalid UTF-8" in got, (raw, got)


# ---------------------------------------------------------------- publishing
def test_publish_properties(services, build, names):
    """How a row becomes an AMQP message: persistent, message-id, timestamp, correlation
    id, type, content type, the headers as a field table; NULL fields left out. (ACK and
    the bodies arriving intact: tests/test_sink_contract.py.)"""
    r = drive(services, build, "--tag", names.tag,
              f"{names.ex},{names.rk},20", f"{names.ex},{names.rk},3,nohdr,size=0",
              f"{names.ex},{names.rk},2,size=300000", f"-,{names.q},2,size=5")
    assert r.rc == 0, r
    assert r.summary["acked"] == 27, r
    assert r.states[0][0] == "UP" and "vhost /" in r.states[0][1]
    assert "guest:" not in r.out and "guest@" not in r.out

    msgs = get_all(services, names.q)
    assert len(msgs) == 27
    by_id = {p.message_id: p for p, _ in msgs}
    for i in range(27):
        p = by_id[mid(names.tag, i)]
        assert p.delivery_mode == 2
        assert p.timestamp == 1700000000 + i
        if 20 <= i < 23:
            assert p.headers is None and p.correlation_id is None
            assert p.type is None and p.content_type is None
        else:
            assert p.correlation_id == f"corr-{i}"
            assert p.type == f"type.{i % 3}"
            assert p.content_type == "application/x-test"
            assert p.headers == expected_headers(i)


def test_missing_exchange_rejects_only_the_culprit(services, build, names):
    """When the broker does close the publishing channel (404): the culprit is REJECTED,
    the unconfirmed rest LOST. A named exchange is checked before its first publish (see
    the tests below), so this takes an amq.* name: those are the broker's own and are
    published unchecked, and a missing one still closes the channel."""
    missing = f"amq.{names.ex}.missing"
    r = drive(services, build, "--tag", names.tag, f"{names.ex},{names.rk},5",
              f"{missing},x,1", f"{names.ex},{names.rk},5", f"{missing},y,1",
              f"{names.ex},{names.rk},2")
    assert r.rc == 0, r
    for culprit in (5, 11):
        outcome, reason = r.results[culprit][-1]
        assert outcome == "REJECTED", r
        assert reason.startswith("404 NOT_FOUND") and f"'{missing}'" in reason, r
        assert all(o in ("LOST", "REJECTED") for o, _ in r.results[culprit]), r
        assert r.results[culprit].count(("REJECTED", reason)) == 1, r
    others = [i for i in range(14) if i not in (5, 11)]
    for i in others:
        assert r.final(i) == "ACK", r
        assert all(o in ("ACK", "LOST") for o, _ in r.results[i]), r
    assert r.summary["rejected"] == 2 and r.summary["acked"] == 12, r
    # the channel was reopened (channel 2, then 3) and reported UP again
    ups = [t for s, t in r.states if s == "UP"]
    assert any("channel 2 reopened" in t for t in ups), r
    downs = [t for s, t in r.states if s == "DOWN"]
    assert downs and all("404 NOT_FOUND" in t for t in downs), r
    # LOST messages were republished: at-least-once, every id arrived
    ids = {p.message_id for p, _ in get_all(services, names.q)}
    assert ids == {mid(names.tag, i) for i in others}


def declare_queue(services, names, q):
    names.extra_queues.append(q)
    c = services.amqp_connect()
    c.channel().queue_declare(q, durable=True)
    c.close()


def refused_404(exchange):
    return (f"exchange '{exchange}' not found in vhost '/' "
            "(404, checked with a passive exchange.declare)")


def test_refused_exchange_accepted_once_created(services, build, names):
    """A refusal is cached about a second only: the row retried 1.5 s later (after the
    exchange was created) is checked again and published."""
    late = f"{names.ex}.late"
    bg = Background(services, build, "--tag", names.tag, "--retry-refused", "1500",
                    f"{late},{names.rk},1", f"{names.ex},{names.rk},1")
    try:
        wait_for(lambda: bg.count(r"^result 0 REFUSED") >= 1 or bg.p.poll() is not None,
                 60, desc="the first refusal")
        c = services.amqp_connect()
        ch = c.channel()
        ch.exchange_declare(late, "direct", durable=True)
        ch.queue_bind(names.q, late, names.rk)
        c.close()
        r = bg.finish(60)
    finally:
        bg.kill()
        c = services.amqp_connect()
        c.channel().exchange_delete(late)
        c.close()
    assert r.rc == 0, r
    assert r.results[0][0] == ("REFUSED", refused_404(late)), r
    assert r.results[0][-1] == ("ACK", ""), r
    # only refusals before it (more than one only if the declare above took > 1.5 s)
    assert all(o == "REFUSED" for o, _ in r.results[0][:-1]), r
    assert r.results[1] == [("ACK", "")], r
    assert [s for s, _ in r.states] == ["UP"], r
    ids = [p.message_id for p, _ in get_all(services, names.q)]
    assert sorted(ids) == [mid(names.tag, 0), mid(names.tag, 1)]


def test_exchange_check_never_blocks_the_loop(services, build, names, proxy):
    """The broker's answers are held back (proxy) while an exchange is being checked: the
    loop keeps ticking and the rows wait (SINK_EWAIT); once the answers arrive, the rows to
    the existing exchange are published and those to the missing one refused."""
    missing = f"{names.ex}.missing"
    q2 = f"{names.q}.2"
    declare_queue(services, names, q2)
    bg = drive_bg(build, proxy.url(), "--tag", names.tag, "--ticks", "--rate", "10",
                  f"-,{q2},20", f"{names.ex},{names.rk},5", f"{missing},x,2", f"-,{q2},5")
    try:
        wait_for(lambda: bg.count(r"^result \d+ ACK") >= 1, 60, desc="first ack")
        proxy.hold()
        # at 10 rows/s the checked rows (20..26) come about 2 s after the start
        wait_for(lambda: bg.count(r"^ewait 2[0-6]$") >= 7, 60, desc="rows waiting for checks")
        t0 = bg.count(r"^tick ")
        time.sleep(2.0)
        ticks = bg.count(r"^tick ") - t0
        held = bg.count(r"^result (2[0-6]) ")
        proxy.hold(False)
        r = bg.finish(120)
    finally:
        bg.kill()
    assert ticks >= 5, f"event loop blocked: {ticks} ticks in 2 s"
    assert held == 0, r            # no answer yet: nothing settled or refused them
    assert r.rc == 0, r
    for i in list(range(20)) + list(range(20, 25)) + list(range(27, 32)):
        assert r.results[i] == [("ACK", "")], r
    for i in (25, 26):
        assert r.results[i] == [("REFUSED", refused_404(missing))], r
    assert r.summary["ewait"] >= 7, r
    assert [s for s, _ in r.states] == ["UP"], r


def test_exchange_check_without_answer_fails_the_connection(services, build, names, proxy):
    """No answer to a check within confirm_timeout (nothing else in flight): the connection
    is failed with a reason naming the check, reconnected, and the row checked again."""
    bg = drive_bg(build, proxy.url(), "--tag", names.tag, "--confirm-timeout", "1000",
                  "--rate", "1", f"{names.lonely},nowhere,1", f"{names.ex},{names.rk},3")
    try:
        wait_for(lambda: bg.count(r"^result 0 RETURNED") >= 1, 60, desc="first result")
        # row 0 is settled (its check opened the checking channel); row 1 comes 1 s later
        # and its check is the only thing in flight: hold back every answer
        proxy.hold()
        wait_for(lambda: bg.count(r"^state DOWN") >= 1, 20, desc="check timeout")
        proxy.hold(False)
        r = bg.finish(120)
    finally:
        bg.kill()
    assert r.rc == 0, r
    downs = [t for s, t in r.states if s == "DOWN"]
    assert len(downs) == 1, r
    assert re.search(f"no answer to the passive exchange.declare of exchange '{names.ex}' "
                     r"\(checking channel \d+\) within 1000 ms$", downs[0]), r
    assert [s for s, _ in r.states] == ["UP", "DOWN", "UP"], r
    assert r.results[0] == [("RETURNED", f"unroutable: NO_ROUTE exchange={names.lonely} "
                                         "routing_key=nowhere")], r
    assert all(r.results[i] == [("ACK", "")] for i in (1, 2, 3)), r   # nothing was LOST


def test_exchange_deleted_after_check_closes_the_channel_once(services, build, names):
    """An exchange checked (cached as existing) and then deleted: the next publish to it
    closes the publishing channel as before (its culprit REJECTED, the unconfirmed rest
    LOST), and the sink marks it missing, so later rows to it are REFUSED instead of
    closing the channel again; the other rows keep flowing."""
    doomed = f"{names.ex}.doomed"
    q2 = f"{names.q}.2"
    declare_queue(services, names, q2)
    c = services.amqp_connect()
    ch = c.channel()
    ch.exchange_declare(doomed, "direct", durable=True)
    ch.queue_bind(names.q, doomed, "d")
    c.close()
    groups = []
    for _ in range(300):
        groups += [f"{doomed},d,1", f"-,{q2},1"]     # even: doomed, odd: default exchange
    bg = Background(services, build, "--tag", names.tag, "--rate", "100", "--window", "100",
                    *groups)      # about 6 s of publishing around the deletion
    try:
        wait_for(lambda: bg.count(r"^result \d+ ACK") >= 20 or bg.p.poll() is not None,
                 60, desc="first acks")
        assert bg.p.poll() is None, "driver finished before the deletion"
        c = services.amqp_connect()
        c.channel().exchange_delete(doomed)
        c.close()
        r = bg.finish(120)
    finally:
        bg.kill()
        c = services.amqp_connect()
        c.channel().exchange_delete(doomed)
        c.close()
    assert r.rc == 0, r
    downs = [t for s, t in r.states if s == "DOWN"]
    assert len(downs) == 1, r                            # one channel close, not one per row
    assert f"404 NOT_FOUND - no exchange '{doomed}'" in downs[0], r
    assert [s for s, _ in r.states] == ["UP", "DOWN", "UP"], r
    rejected = [i for i, res in r.results.items() for o, _ in res if o == "REJECTED"]
    assert len(rejected) == 1 and rejected[0] % 2 == 0, r
    culprit = rejected[0]
    assert r.results[culprit] == [("REJECTED",
                                   f"404 NOT_FOUND - no exchange '{doomed}' in vhost '/'")], r
    refused = {i: res[-1][1] for i, res in r.results.items() if res[-1][0] == "REFUSED"}
    assert refused and all(i % 2 == 0 for i in refused), r
    assert all(f"exchange '{doomed}' not found in vhost '/' (404, " in x
               for x in refused.values()), r
    # the first ones learned it from the channel close, later ones from a new check
    assert any("the broker closed the publishing channel" in x for x in refused.values()), r
    for i in range(600):
        if i % 2 == 1:
            assert r.final(i) == "ACK", r
        elif i > culprit:          # published after the deletion: refused, never a 2nd close
            assert r.final(i) == "REFUSED", r
        elif i < culprit:          # before it: routed, or in flight at the close (LOST, retried)
            assert r.final(i) in ("ACK", "REFUSED"), r
    assert any(r.final(i) == "ACK" for i in range(0, culprit, 2)), r
    # LOST rows were republished: at least once each
    assert {p.message_id for p, _ in get_all(services, q2)} == \
        {mid(names.tag, i) for i in range(1, 600, 2)}


def test_permanent_failures_are_eperm(services, build, names):
    groups = [f"{names.ex},{names.rk},1"]
    groups += [f"{names.ex},{names.rk},1,hdr={k}" for k in range(10)]
    groups += [f"{names.ex},{names.rk},1,big", f"{names.ex},{names.rk},1,size=1000"]
    r = drive(services, build, "--tag", names.tag, "--max-size", "1000", *groups)
    assert r.rc == 0, r
    assert r.results[0] == [("ACK", "")] and r.results[12] == [("ACK", "")], r
    # jansson's texts but for the first three and "invalid UTF-8" (see json.c)
    whys = ["nested object", "nested array", "expected a JSON object, got an array",
            "end of file expected", "invalid Unicode", "duplicate object key", "invalid token",
            "invalid UTF-8", "invalid token", "unexpected token near end of file"]
    for k, why in enumerate(whys):
        (outcome, reason), = r.results[1 + k]
        assert outcome == "EPERM" and reason.startswith("headers_json: ") and why in reason, r
    (outcome, reason), = r.results[11]
    assert outcome == "EPERM" and "1001 bytes" in reason and "max_message_size 1000" in reason
    assert queue_depth(services, names.q) == 2


def test_headers_larger_than_a_frame_refused_before_anything_is_sent(services, build, names):
    """A small message whose headers do not fit one frame (40,000 bytes of header text on a
    100-byte payload) is refused (EPERM) before any of its frames is sent: the broker never
    sees half a publish, so the connection stays up and the 50 messages after it are all
    confirmed, none lost or published twice."""
    groups = [f"{names.ex},{names.rk},1,size=100,bighdr=40000", f"{names.ex},{names.rk},50"]
    r = drive(services, build, "--tag", names.tag, *groups)
    assert r.rc == 0, r
    (outcome, reason), = r.results[0]
    assert outcome == "EPERM" and "too large for one frame" in reason, r
    for i in range(1, 51):
        assert r.results[i] == [("ACK", "")], (i, r.results[i])
    assert [s for s, _ in r.states] == ["UP"], r.states
    assert queue_depth(services, names.q) == 50


# ---------------------------------------------------------------- failures
@pytest.fixture
def proxy(services):
    p = Proxy(services.amqp_port)
    yield p
    p.close()


def drive_bg(build, url, *args):
    return sink_driver.Background(driver(build), url, *args)


def test_connection_killed_by_broker_reconnects(services, build, names, tmp_path):
    # the broker closes the driver's connection from inside (one `rabbitmqctl eval`, armed
    # before the driver starts) once ~1000 of the 4500 rows reached it, so the kill lands
    # mid-flight however slow the CLI is on a loaded machine (5-14 s a call on the 2-core
    # test machine: a kill after the fact needed 200 rows/s, 23 s a run)
    closer = BrokerCloser(services, "sink_amqp_test", 1, 1000 * 16384,
                          str(tmp_path / "closer.ready"), "test kill")
    bg = Background(services, build, "--tag", names.tag, "--window", "200", "--rate", "1500",
                    f"{names.ex},{names.rk},4500,size=16384")
    try:
        closes = closer.wait()
        assert len(closes) == 1, f"the broker closed the driver's connection {len(closes)} times"
        assert closes[0] < 4500 * 16384, "driver finished before the kill"
        r = bg.finish(240)
    finally:
        bg.kill()
    assert r.rc == 0, r
    assert r.summary["acked"] == 4500, r
    downs = [t for s, t in r.states if s == "DOWN"]
    assert any("broker closed the connection: 320 CONNECTION_FORCED - test kill" in t
               for t in downs), r
    assert [s for s, _ in r.states].count("UP") >= 2, r
    # whatever was in flight came back LOST (not the message's fault) and was retried
    lost = [reason for res in r.results.values() for o, reason in res if o == "LOST"]
    assert all("320 CONNECTION_FORCED" in x for x in lost), r
    assert r.summary["lost"] == len(lost)
    assert all(r.final(i) == "ACK" for i in range(4500))
    assert queue_depth(services, names.q) >= 4500


def test_heartbeat_timeout_reconnects(services, build, names, proxy):
    bg = drive_bg(build, proxy.url(), "--tag", names.tag, "--heartbeat", "1000",
                  "--rate", "50", f"{names.ex},{names.rk},150")
    try:
        wait_for(lambda: bg.count(r"^result \d+ ACK") >= 10, 60, desc="first acks")
        proxy.hold()
        wait_for(lambda: bg.count(r"^state DOWN") >= 1, 20, desc="heartbeat timeout")
        proxy.hold(False)
        r = bg.finish(120)
    finally:
        bg.kill()
    assert r.rc == 0, r
    assert r.summary["acked"] == 150, r
    downs = [t for s, t in r.states if s == "DOWN"]
    assert len(downs) == 1 and "heartbeat timeout" in downs[0], r


def test_check_errors_name_host_vhost_not_password(services, build):
    port = services.amqp_port
    bad = f"amqp://guest:Sekr1tPw@127.0.0.1:{port}/%2f"
    r = run_prog([driver(build), bad, "x,y,1"], timeout=60)
    assert r.returncode == 1
    assert f"check failed: broker 127.0.0.1:{port} vhost /: login refused (ACCESS_REFUSED" \
        in r.stdout, r.stdout
    assert "403" in r.stdout or "ACCESS_REFUSED" in r.stdout, r.stdout
    assert "Sekr1tPw" not in r.stdout + r.stderr

    r = run_prog([driver(build), f"amqp://guest:guest@127.0.0.1:{port}/no-such-vhost",
                  "x,y,1"], timeout=60)
    assert r.returncode == 1
    assert f"broker 127.0.0.1:{port} vhost no-such-vhost: login:" in r.stdout, r.stdout

    t0 = time.monotonic()
    r = run_prog([driver(build), "amqp://guest:guest@127.0.0.1:1/%2f", "x,y,1"], timeout=60)
    assert r.returncode == 1
    assert "check failed: broker 127.0.0.1:1 vhost /: connect: connection refused" in r.stdout, \
        r.stdout
    assert time.monotonic() - t0 < 30


def test_amqp_probe(services, build):
    q = "t." + secrets.token_hex(4) + ".probe"
    c = services.amqp_connect()
    c.channel().queue_declare(q, durable=True)
    c.close()
    try:
        r = run_prog([build / "tests" / "amqp_probe", services.amqp_url, q, "2000", "200",
                      "512"], timeout=120)
        assert r.returncode == 0, r.stderr
        m = re.match(r"probe msgs=2000 secs=([0-9.]+) rate=([0-9]+) ", r.stdout)
        assert m, r.stdout
        assert float(m.group(2)) > 0
        assert queue_depth(services, q) == 2000
        # a missing queue is an error, not a fast number
        r = run_prog([build / "tests" / "amqp_probe", services.amqp_url, q + ".nope", "10",
                      "5", "10"], timeout=60)
        assert r.returncode == 1 and "basic.return" in r.stderr
    finally:
        c = services.amqp_connect()
        c.channel().queue_delete(q)
        c.close()


# ---------------------------------------------------------------------------- url lists
def test_check_names_every_unreachable_address_of_a_list(services, build):
    """check connects to every node of a cluster list: one line per node it cannot reach,
    naming it (not the password); all reachable → a note naming them."""
    port = services.amqp_port
    good = f"amqp://guest:guest@127.0.0.1:{port}/%2f"
    dead = "amqp://guest:guest@127.0.0.1:1/%2f"
    r = run_prog([driver(build), f"{dead},{good}, amqp://guest:guest@127.0.0.1:2/%2f", "x,y,1"],
                 timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "check failed: broker 127.0.0.1:1 vhost /: connect: connection refused\n" \
           "broker 127.0.0.1:2 vhost /: connect: connection refused" in r.stdout, r.stdout
    assert f"127.0.0.1:{port}" not in r.stdout, r.stdout
    p1, p2 = Proxy(port), Proxy(port)
    try:
        r = run_prog([driver(build), f"{p1.url()},{p2.url()}", "x,y,0"], timeout=60)
    finally:
        p1.close()
        p2.close()
    assert r.returncode == 0, r.stdout + r.stderr
    assert (f"check ok: every broker of the cluster list answers (127.0.0.1:{p1.port}, "
            f"127.0.0.1:{p2.port})") in r.stdout, r.stdout


def test_url_list_skips_an_address_that_refuses(services, build, names):
    """The first address refuses: the next one is tried at once (no back-off within a
    round), the failure names the address and the next one."""
    good = services.amqp_url
    t0 = time.monotonic()
    r = run_prog([driver(build), f"amqp://guest:guest@127.0.0.1:1/%2f,{good}", "--no-check",
                  "--tag", names.tag, f"{names.ex},{names.rk},50"], timeout=60)
    took = time.monotonic() - t0
    run = Run(r.returncode, r.stdout, r.stderr)
    assert run.rc == 0, run
    assert run.summary["acked"] == 50, run
    assert run.states[0] == ("DOWN", "broker 127.0.0.1:1 vhost /: connect: connection refused; "
                                     f"next: broker 127.0.0.1:{services.amqp_port}"), run
    assert run.states[1] == ("UP", f"broker 127.0.0.1:{services.amqp_port} vhost /"), run
    assert took < 20, took


def test_failover_to_the_next_address_mid_flight(services, build, names):
    """Two addresses (proxies to the same broker). The connection to the first is cut and
    it refuses from then on: the sink goes to the second at once, says which it left and
    which it reached, and what was in flight comes back LOST (retried), never lost."""
    a, b = Proxy(services.amqp_port), Proxy(services.amqp_port)
    try:
        bg = drive_bg(build, f"{a.url()}, {b.url()}", "--tag", names.tag, "--window", "50",
                      "--rate", "400", f"{names.ex},{names.rk},800")
        try:
            wait_for(lambda: bg.count(r"^result \d+ ACK") >= 50, 60, desc="first acks")
            a.hold()   # acks pile up unread: the window fills
            time.sleep(0.5)
            a.refuse = True
            a.cut()
            r = bg.finish(120)
        finally:
            bg.kill()
    finally:
        a.close()
        b.close()
    assert r.rc == 0, r
    assert r.summary["acked"] == 800, r
    assert r.summary["lost"] >= 1, r
    assert [s for s, _ in r.states] == ["UP", "DOWN", "UP"], r
    assert r.states[0][1] == f"broker 127.0.0.1:{a.port} vhost /", r
    assert r.states[1][1].startswith(f"broker 127.0.0.1:{a.port} vhost /: "), r
    assert r.states[1][1].endswith(f"; next: broker 127.0.0.1:{b.port}"), r
    assert r.states[2][1] == (f"broker 127.0.0.1:{b.port} vhost /, failed over from broker "
                              f"127.0.0.1:{a.port}"), r
    assert all(r.final(i) == "ACK" for i in range(800))
    assert {p.message_id for p, _ in get_all(services, names.q)} == \
        {mid(names.tag, i) for i in range(800)}


def test_nack_only_channel_is_reopened(services, build, names):
    """A channel that gets only nacks (here: a full reject-publish queue) for nack_reopen is
    closed and a new one opened on the same connection: an event, never a DOWN, nothing
    LOST; the nacks stay NACKED. Once the queue has room, the new channel's publishes are
    acked."""
    q = f"{names.q}.full"
    names.extra_queues.append(q)
    c = services.amqp_connect()
    ch = c.channel()
    ch.queue_declare(q, durable=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.basic_publish("", q, b"filler")   # full from the start: every publish is nacked
    c.close()
    bg = Background(services, build, "--tag", names.tag, "--nack-reopen", "300", "--rate", "40",
                    "--window", "5", f"-,{q},120")
    try:
        wait_for(lambda: bg.count(r"^event NACK_REOPEN") >= 2 or bg.p.poll() is not None, 60,
                 desc="two reopens")
        c = services.amqp_connect()
        c.channel().queue_purge(q)   # room again: the next publish is acked, then full
        c.close()
        r = bg.finish(120)
    finally:
        bg.kill()
    assert r.rc == 0, r
    events = [ln for ln in r.lines if ln.startswith("event ")]
    assert len(events) >= 2, r
    m = re.match(r"event NACK_REOPEN broker 127\.0\.0\.1:\d+ vhost /: channel (\d+) got only "
                 r"nacks \((\d+) in ([0-9.]+) s, no ack\): reopening it as channel (\d+)$",
                 events[0])
    assert m, events[0]
    assert int(m.group(4)) == int(m.group(1)) + 1 and int(m.group(2)) >= 3, events[0]
    assert float(m.group(3)) >= 0.3, events[0]
    # the connection never went down, nothing was given back
    assert [s for s, _ in r.states] == ["UP"], r
    assert r.summary["lost"] == 0, r
    assert r.summary["acked"] >= 1 and r.summary["nacked"] >= 6, r
    assert r.summary["acked"] + r.summary["nacked"] == 120, r
    assert all(r.final(i) in ("ACK", "NACKED") for i in range(120)), r
    # the first ack came on a reopened channel, after the purge
    assert min(i for i in range(120) if r.final(i) == "ACK") > 5, r
