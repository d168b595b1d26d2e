"""Integration tests of `outbox-relay run` against the private PostgreSQL and RabbitMQ
(issue: the relay). Each test gets a fresh database, its own queue names and its own relay."""
import datetime
import random
import re
import signal
import subprocess
import time
import uuid

import pytest

from conftest import wait_for
from relay_util import (Relay, amqp_channel, assert_log_at, consume, declare, expected_payload,
                        free_port, psql_rows, run_producer, wait_log_at, write_config)


def init_schema(relay_bin, cfg_path):
    p = subprocess.run([str(relay_bin), "init", "-c", str(cfg_path)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr + p.stdout
    return p


def start_relay(relay_bin, tmp_path, services, pgdb, name="r1", http=True, **kw):
    port = free_port() if http else None
    relay = kw.pop("relay", {})
    sink = kw.pop("sink", {})
    if "publish_window" in kw:
        sink["publish_window"] = kw.pop("publish_window")
    relay.setdefault("name", name)
    if http:
        relay["http_listen"] = f"127.0.0.1:{port}"
    cfg = write_config(tmp_path / f"{name}.ini", services, pgdb, relay=relay, sink=sink, **kw)
    return Relay(relay_bin, cfg, tmp_path / f"{name}.log", http_port=port), cfg


def check_per_key_order(got, keys=100):
    """The producer gives message i the partition key i mod keys, in id order."""
    last = {}
    for props, body, _ in got:
        seq = int(props.headers["seq"])
        part = seq % keys
        assert last.get(part, -1) < seq, f"key {part}: seq {seq} arrived after {last[part]}"
        last[part] = seq


@pytest.mark.parametrize("on_sent", ["mark", "delete"])
def test_10k_messages_100_keys(services, pgdb, relay_bin, build, tmp_path, on_sent):
    q = f"q10k-{on_sent}-{uuid.uuid4().hex[:6]}"
    ex = f"ex-{q}"
    conn, ch = amqp_channel(services)
    declare(ch, ex, q, "rk")
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb, on_sent=on_sent)
    init_schema(relay_bin, cfg)
    # producer commits while the relay runs: 10,000 messages over 100 keys, 300 bytes each
    run_producer(build, pgdb.dsn, pgdb.name, count=10000, keys=100, exchange=ex,
                 routing_key="rk", size=300, batch=250)
    got = consume(ch, q, 10000, timeout=120, idle=1.0)
    rc = r.stop()
    r.assert_clean_exit(rc)
    conn.close()

    assert len(got) == 10000, f"got {len(got)} messages"
    ids = [p.message_id for p, _, _ in got]
    assert len(set(ids)) == 10000, "duplicates delivered"
    seen = set()
    for props, body, _ in got:
        seq = int(props.headers["seq"])
        assert seq not in seen
        seen.add(seq)
        assert body == expected_payload("msg", seq, 300)
        assert props.correlation_id == f"corr-{seq}"
        assert props.type == "test.event"
        assert props.content_type == "application/octet-stream"
        assert props.delivery_mode == 2
        assert props.headers == {"seq": str(seq), "origin": "producer"}
        assert isinstance(props.timestamp, int) and abs(props.timestamp - time.time()) < 600
    check_per_key_order(got)

    if on_sent == "mark":
        rows = psql_rows(pgdb, "select message_id::text, headers->>'seq', sent_at is not null, "
                               "floor(extract(epoch from created_at))::bigint from outbox.messages")
        assert len(rows) == 10000
        assert all(sent for _, _, sent, _ in rows), "some rows not marked sent"
        by_seq = {int(seq): (mid, ts) for mid, seq, _, ts in rows}
        for props, _, _ in got:
            mid, ts = by_seq[int(props.headers["seq"])]
            assert props.message_id == mid
            assert props.timestamp == ts
    else:
        assert psql_rows(pgdb, "select count(*) from outbox.messages")[0][0] == 0


def test_trace_context_reaches_the_consumer(services, pgdb, relay_bin, build, tmp_path):
    """W3C trace context written by the producer (liboutbox headers traceparent/tracestate)
    arrives as AMQP string headers of the same names, unchanged, so a consumer's span can
    link to the producer's (the convention of OpenTelemetry's RabbitMQ instrumentation and
    MassTransit)."""
    q = f"qtr-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb)
    init_schema(relay_bin, cfg)
    p = subprocess.run([str(build / "examples" / "producer"), "--dsn", pgdb.dsn, "--database",
                        pgdb.name, "--count", "50", "--keys", "5", "--routing-key", q, "--trace"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = consume(ch, q, 50, timeout=30)
    r.assert_clean_exit(r.stop())
    conn.close()
    assert len(got) == 50
    for props, _, _ in got:
        seq = int(props.headers["seq"])
        assert props.headers["traceparent"] == f"00-{seq + 1:032x}-{seq + 1:016x}-01"
        assert props.headers["tracestate"] == f"producer={seq}"
        assert set(props.headers) == {"seq", "origin", "traceparent", "tracestate"}


def test_retention_removes_marked_rows(services, pgdb, relay_bin, build, tmp_path):
    q = f"qret-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb, retention="2s",
                         cleanup_interval="500ms", cleanup_batch="100")
    init_schema(relay_bin, cfg)
    run_producer(build, pgdb.dsn, pgdb.name, count=500, keys=5, exchange="", routing_key=q)
    got = consume(ch, q, 500, timeout=60)
    assert len(got) == 500
    t_sent = time.monotonic()
    # rows are kept (marked) for a while: a marked row is there until retention removes it
    # (a slow run, e.g. under valgrind, may see some removed already, but never all of them
    # before their marks were seen)
    n_marked = 0
    while time.monotonic() < t_sent + 30:
        unsent, n_marked = psql_rows(pgdb, "select count(*) filter (where sent_at is null), "
                                           "count(*) filter (where sent_at is not null) "
                                           "from outbox.messages")[0]
        if unsent == 0 or n_marked > 0:
            break
        time.sleep(0.05)
    assert n_marked > 0, "no marked row was ever seen: rows vanished unmarked, or marks never came"
    # ... and removed on schedule, in bounded batches
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if psql_rows(pgdb, "select count(*) from outbox.messages")[0][0] == 0:
            break
        time.sleep(0.1)
    left = psql_rows(pgdb, "select count(*) from outbox.messages")[0][0]
    elapsed = time.monotonic() - t_sent
    r.assert_clean_exit(r.stop())
    conn.close()
    assert left == 0, f"{left} marked rows still there after {elapsed:.1f}s"
    print(f"retention 2s: marked rows gone {elapsed:.2f}s after delivery")


def _next_body(gen, since, limit=10):
    """The body of the next message from consumer gen, which must come within limit
    seconds of since (monotonic)."""
    while True:
        method, _, body = next(gen)
        if method is not None:
            return body
        assert time.monotonic() - since < limit, "the message never arrived"


def _latency(ch, q, pgdb, n=9):
    """Commits n single-row inserts (autocommit) while already consuming; returns the
    commit -> delivery latencies in seconds. The commits are 0.25-0.45 s apart (seeded
    jitter), so they do not fall into step with the adaptive poll's schedule."""
    lat = []
    rnd = random.Random(7)
    gen = ch.consume(q, auto_ack=True, inactivity_timeout=0.005)
    with pgdb.connect() as c:
        for i in range(n):
            time.sleep(rnd.uniform(0.25, 0.45))  # the relay is idle between messages
            c.execute("insert into outbox.messages (message_id, routing_key, payload) "
                      "values (gen_random_uuid(), %s, %s)", (q, f"lat{i}".encode()))
            t_commit = time.monotonic()
            _next_body(gen, t_commit)
            lat.append(time.monotonic() - t_commit)
    ch.cancel()
    return lat


def test_notify_latency_and_poll_fallback(services, pgdb, relay_bin, build, tmp_path):
    q = f"qlat-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb, poll_interval="1s")
    init_schema(relay_bin, cfg)
    r.wait_log("database connected")
    r.wait_log("became the active relay")
    time.sleep(2.5)  # let the adaptive poll reach its ceiling: only NOTIFY can be fast now
    lat = sorted(_latency(ch, q, pgdb))
    med_notify = lat[len(lat) // 2]
    print(f"NOTIFY wake-up: commit -> consumer latency median {med_notify*1000:.1f} ms, max "
          f"{lat[-1]*1000:.1f} ms")
    assert med_notify < 0.050, f"median latency {med_notify*1000:.1f} ms through NOTIFY"

    # notifications unavailable: drop the trigger; polling must still deliver within poll_interval
    with pgdb.connect() as c:
        trig = c.execute("select tgname from pg_trigger where tgrelid = 'outbox.messages'::regclass "
                         "and not tgisinternal").fetchall()
        for (name,) in trig:
            c.execute(f'drop trigger "{name}" on outbox.messages')
    time.sleep(2.5)
    lat = sorted(_latency(ch, q, pgdb))
    med = lat[len(lat) // 2]
    print(f"polling only (poll_interval 1s): latency median {med*1000:.0f} ms, max {lat[-1]*1000:.0f} ms")
    assert lat[-1] < 1.0 + 0.25, f"max latency {lat[-1]:.2f}s exceeds poll_interval"
    # the control, same spacing of commits: polling alone (the adaptive poll restarts at
    # 50 ms after each row and doubles) gives tens to hundreds of ms, so the 50 ms bound
    # above alone would barely tell NOTIFY from polling; NOTIFY must be several times
    # faster than polling measured here
    assert med_notify * 3 < med, (f"NOTIFY median {med_notify*1000:.1f} ms is not clearly "
                                  f"below polling alone ({med*1000:.1f} ms)")
    r.assert_clean_exit(r.stop())
    conn.close()


def first_delivery(ch, q, pgdb, *rows):
    """Commits rows ((partition_key, payload, attempts, seconds ahead) each) in one
    transaction to queue q; returns the body delivered first and its seconds after the
    commit."""
    gen = ch.consume(q, auto_ack=True, inactivity_timeout=0.005)
    with pgdb.connect() as c:
        for key, payload, attempts, ahead in rows:
            c.execute("insert into outbox.messages (routing_key, partition_key, payload, "
                      "attempts, available_at) values (%s, %s, %s, %s, "
                      "now() + %s * interval '1 second')",
                      (q, key, payload.encode(), attempts, ahead))
        t_commit = time.monotonic()
    body = _next_body(gen, t_commit, 15)
    took = time.monotonic() - t_commit
    ch.cancel()
    return body, took


def test_poll_interval_auto_polls_rarely_when_notified_and_wakes_when_rows_fall_due(
        services, pgdb, pgdb2, relay_bin, build, tmp_path):
    """poll_interval = auto: while LISTEN/NOTIFY wakes the relay its idle poll is a safety
    net every 5 s (fifty idle outboxes cost next to nothing); a row delayed by the producer
    is still published as soon as it falls due, not up to a poll interval later; without
    NOTIFY (the ODBC source) the idle poll is every second."""
    q = f"qauto-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb, poll_interval="auto")
    init_schema(relay_bin, cfg)
    # no NOTIFY reaches the ODBC source: auto polls every second there. It idles on a
    # database of its own at the same time, so that both idle periods pass once
    r2, cfg2 = start_relay(relay_bin, tmp_path, services, pgdb2, name="r2", source="sqlserver",
                           conninfo=pgdb2.odbc, poll_interval="auto")
    init_schema(relay_bin, cfg2)
    r.wait_log("became the active relay")
    r2.wait_log("became the active relay")
    t0 = time.monotonic()

    def claims(relay):
        return relay.metric("outbox_relay_claims_total"), time.monotonic()

    def sleep_until(t):
        time.sleep(max(0.0, t - time.monotonic()))
    # each adaptive poll backs off to its ceiling (3 s without NOTIFY, 8 s with it), then
    # its claims are counted over 6 s each (with NOTIFY: one or two of a poll every 5 s;
    # three need a poll every 3 s or more often, six one every second)
    sleep_until(t0 + 3)
    c2, s2 = claims(r2)
    sleep_until(t0 + 8)
    c1, s1 = claims(r)
    sleep_until(s2 + 6)
    n2 = claims(r2)[0] - c2
    sleep_until(s1 + 6)
    n = claims(r)[0] - c1
    r2.assert_clean_exit(r2.stop())
    print(f"idle claims: {n} in 6 s with NOTIFY, {n2} in 6 s without")
    assert 1 <= n <= 2, f"{n} claims in 6 s of idling with NOTIFY up (auto: one per 5 s)"
    assert 4 <= n2 <= 8, f"{n2} claims in 6 s of idling without NOTIFY (auto: one per second)"
    # a delayed row: NOTIFY at commit finds it not yet due; the relay asks when it falls
    # due and looks again then (the adaptive poll alone would find it at 3.15 s)
    body, lat = first_delivery(ch, q, pgdb, (None, "late", 0, 2))
    assert body == b"late"
    assert 1.9 <= lat < 2.4, f"a row due 2 s after its commit arrived after {lat:.2f} s"
    r.assert_clean_exit(r.stop())
    conn.close()


@pytest.mark.parametrize("mode", ["leader", "competing"])
def test_delayed_rows_are_published_when_they_fall_due(services, pgdb, relay_bin, tmp_path,
                                                       mode):
    """A row written 1.5 s ahead is published as it falls due, in both modes: woken by its
    commit and finding nothing, the relay asks when the first row falls due, and its polls
    (each empty one waiting twice as long as the last) wake by then at the latest. Before,
    the poll after the last one ahead of the due time came up to 0.9 s late."""
    q = f"qdue-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb, mode=mode)
    init_schema(relay_bin, cfg)
    r.wait_log("became the active relay" if mode == "leader" else "database connected")
    late = []
    for i in range(3):
        _, took = first_delivery(ch, q, pgdb, (None, "late", 0, 1.5))
        late.append(took - 1.5)
        time.sleep(0.4 * i)     # the next row falls due at another point of the poll cycle
    r.assert_clean_exit(r.stop())
    conn.close()
    print(f"{mode}: published {', '.join(f'{x * 1000:.0f}' for x in late)} ms after due")
    assert all(-0.05 < x < 0.3 for x in late), late


def test_a_due_row_that_cannot_be_taken_does_not_hide_the_next(services, pgdb, relay_bin,
                                                                tmp_path):
    """The first row to fall due waits behind a row of its key that backs off, so the poll
    at its due time takes nothing; the relay then asks when the next row falls due (another
    key's, a second later) instead of waiting a whole poll interval. Before, that row was
    published up to poll_interval late."""
    q = f"qdue-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb, poll_interval="3s")
    init_schema(relay_bin, cfg)
    r.wait_log("became the active relay")
    time.sleep(4)       # idle: the poll's delay has grown to poll_interval
    body, took = first_delivery(ch, q, pgdb, ("k", "backing off", 1, 3600),
                                ("k", "held", 0, 1.5), ("j", "next", 0, 2.5))
    late = took - 2.5
    r.assert_clean_exit(r.stop())
    conn.close()
    assert body == b"next"
    assert -0.05 < late < 0.3, f"published {late:.2f} s after it fell due"


def _failing_row_setup(services, pgdb, relay_bin, build, tmp_path, bad_exchange, q, **kw):
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb, max_attempts="3",
                         retry_backoff="300ms", retry_backoff_max="1s", **kw)
    init_schema(relay_bin, cfg)
    # key-0 row 0 goes to the bad exchange; then key-0 rows 1..4 and key-1.. rows go to the queue
    run_producer(build, pgdb.dsn, pgdb.name, count=1, keys=1, exchange=bad_exchange,
                 routing_key="nowhere", start=0, prefix="bad")
    run_producer(build, pgdb.dsn, pgdb.name, count=5, keys=1, routing_key=q, start=1, prefix="k0")
    run_producer(build, pgdb.dsn, pgdb.name, count=20, keys=0, routing_key=q, start=100,
                 prefix="free")
    return conn, ch, r, cfg


def _assert_failing_row_outcome(ch, q, pgdb, r, reason_rx):
    got = consume(ch, q, 25, timeout=30)
    bodies = [b for _, b, _ in got]
    assert len(got) == 25, f"got {len(got)}"
    dead = psql_rows(pgdb, "select id, attempts, reason, dead_at from outbox.messages_dead")
    assert len(dead) == 1, dead
    assert dead[0][1] >= 3 or "3 attempts" in dead[0][2]
    assert re.search(reason_rx, dead[0][2]), dead[0][2]
    # the unpublishable row was never marked sent
    assert psql_rows(pgdb, "select count(*) from outbox.messages where id = %s", (dead[0][0],))[0][0] == 0
    # later rows of its key waited: they arrived after every free row, and after the dead-lettering
    t_of = {b: t for _, b, t in got}
    k0 = [t for b, t in t_of.items() if b.startswith(b"k0|")]
    free = [t for b, t in t_of.items() if b.startswith(b"free|")]
    assert len(k0) == 5 and len(free) == 20
    assert max(free) < min(k0), "other keys should flow while key-0 waits"
    # a confirmed row's mark follows its delivery (marks gather for a few ms)
    wait_for(lambda: psql_rows(pgdb, "select count(*) from outbox.messages where payload like "
                                     "'k0|%%' and sent_at is null")[0][0] == 0, 10,
             desc="key-0 rows marked")
    k0_sent = psql_rows(pgdb, "select min(sent_at) from outbox.messages where payload like 'k0|%%'")[0][0]
    assert k0_sent >= dead[0][3], "key-0 rows were sent before the failing row was dead-lettered"
    # per-key order of the waiting rows held
    seqs = [int(b.split(b"|")[1]) for b in bodies if b.startswith(b"k0|")]
    assert seqs == sorted(seqs)
    # the operator sees it at the default level: each failed attempt at WARN, the
    # dead-lettering (a row leaves the outbox undelivered) at ERROR, with the reason
    assert_log_at(r, r"id=%d message_id=\S+: attempt 1/3 failed: " % dead[0][0])
    line = assert_log_at(r, r"id=%d message_id=\S+: dead-lettered: " % dead[0][0],
                         levels=("ERROR",))
    assert re.search(reason_rx, line), line
    return dead[0][0]


def test_unroutable_dead_letter_and_retry(services, pgdb, relay_bin, build, tmp_path):
    q = f"qunr-{uuid.uuid4().hex[:6]}"
    bad = f"unbound-{q}"
    c0, ch0 = amqp_channel(services)
    ch0.exchange_declare(exchange=bad, exchange_type="direct", durable=True)  # no binding
    c0.close()
    conn, ch, r, cfg = _failing_row_setup(services, pgdb, relay_bin, build, tmp_path, bad, q)
    _assert_failing_row_outcome(ch, q, pgdb, r, r"unroutable|NO_ROUTE")
    assert r.metric("outbox_relay_returned_total") >= 3
    # a binding appears; `dead retry` sends it once
    ch.queue_bind(queue=q, exchange=bad, routing_key="nowhere")
    p = subprocess.run([str(relay_bin), "dead", "-c", str(cfg), "retry"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "1 dead row(s) moved back" in p.stdout
    got = consume(ch, q, 1, timeout=15, idle=1.0)
    assert len(got) == 1 and got[0][1].startswith(b"bad|0|")
    assert psql_rows(pgdb, "select count(*) from outbox.messages_dead")[0][0] == 0
    r.assert_clean_exit(r.stop())
    conn.close()


def test_missing_exchange_refused_without_closing_the_channel(services, pgdb, relay_bin, build,
                                                             tmp_path):
    q = f"qmis-{uuid.uuid4().hex[:6]}"
    conn, ch, r, cfg = _failing_row_setup(services, pgdb, relay_bin, build, tmp_path,
                                          f"missing-{q}", q)
    _assert_failing_row_outcome(ch, q, pgdb, r, r"404|NOT_FOUND|not found")
    # learned with a passive exchange.declare on a separate channel: each attempt is refused
    # before publishing, and the publishing channel is never closed under the other rows
    assert r.metric("outbox_relay_refused_total") >= 3
    assert r.metric("outbox_relay_rejected_total") == 0
    assert "channel" not in "".join(l for l in r.text().splitlines() if "sink=main: down" in l)
    # and the relay goes on publishing
    run_producer(build, pgdb.dsn, pgdb.name, count=50, keys=5, routing_key=q, start=1000,
                 prefix="after")
    got = consume(ch, q, 50, timeout=20)
    assert len(got) == 50
    r.assert_clean_exit(r.stop())
    conn.close()


def test_rows_counting_attempts_at_the_limits(services, pgdb, relay_bin, build, tmp_path):
    """Rows written by hand with `attempts` at the int column's limits: one at 2147483647 that
    cannot be published is dead-lettered at its first failure (its count stays at the limit:
    one more would overflow, in the relay's count or in the settle's, and a settle that fails
    holds back the marks of every row in it, forever), one at -2147483648 is published like
    any other, one at -2147483648 that cannot be published counts from 0 and is dead-lettered
    after max_attempts (not retried some 2^31 times), and the other keys' rows flow and are
    all marked."""
    q = f"qlim-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    cfg = write_config(tmp_path / "lim.ini", services, pgdb, max_attempts="3",
                       retry_backoff="200ms", retry_backoff_max="400ms")
    init_schema(relay_bin, cfg)
    run_producer(build, pgdb.dsn, pgdb.name, count=60, keys=4, routing_key=q, prefix="good")
    with pgdb.connect() as c:
        c.execute("INSERT INTO outbox.messages (exchange, routing_key, partition_key, payload, "
                  f"attempts) VALUES ('missing-{q}', 'nowhere', 'lim', 'bad|0', 2147483647), "
                  f"('', '{q}', 'lim', 'low|1', -2147483648), "
                  f"('missing-{q}', 'nowhere', 'neg', 'bad|2', -2147483648)")
    r = Relay(relay_bin, cfg, tmp_path / "lim.log")
    try:
        got = consume(ch, q, 61, timeout=30, idle=1.0)
        wait_for(lambda: psql_rows(pgdb, "select count(*) from outbox.messages "
                                         "where sent_at is null")[0][0] == 0, 20,
                 desc="every publishable row marked, the other one dead-lettered")
        dead = psql_rows(pgdb, "select attempts, reason from outbox.messages_dead "
                               "order by attempts")
    finally:
        rc = r.stop()
        conn.close()
    assert len(got) == 61, f"got {len(got)}"
    assert [a for a, _ in dead] == [3, 2147483647], dead
    assert "after 3 attempts" in dead[0][1] and "after 2147483647 attempts" in dead[1][1], dead
    assert "out of range" not in r.text(), r.text()[-3000:]
    r.assert_clean_exit(rc)


def test_database_name_mismatch(services, pgdb, relay_bin, build, tmp_path):
    q = f"qdb-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    good_cfg = write_config(tmp_path / "good.ini", services, pgdb)
    init_schema(relay_bin, good_cfg)
    run_producer(build, pgdb.dsn, pgdb.name, count=10, keys=2, routing_key=q)
    wrong = pgdb.name.upper()
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb, database=wrong)
    # refusing to drain is a failure the operator must see: WARN/ERROR naming both names
    wait_log_at(r, r"database unavailable .*(" + re.escape(pgdb.name) + r".*" +
                re.escape(wrong) + "|" + re.escape(wrong) + r".*" + re.escape(pgdb.name) + ")")
    time.sleep(1.5)
    assert consume(ch, q, 1, timeout=1) == []
    assert psql_rows(pgdb, "select count(*) from outbox.messages where sent_at is null")[0][0] == 10
    r.assert_clean_exit(r.stop())
    p = subprocess.run([str(relay_bin), "check", "-c", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0
    assert pgdb.name in p.stderr and wrong in p.stderr, p.stderr
    p = subprocess.run([str(relay_bin), "check", "-c", str(good_cfg)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    conn.close()


def test_sigterm_mid_drain_no_duplicates(services, pgdb, relay_bin, build, tmp_path):
    q = f"qterm-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    n = 20000
    cfg = write_config(tmp_path / "term.ini", services, pgdb, relay={"shutdown_timeout": "5s"})
    init_schema(relay_bin, cfg)
    run_producer(build, pgdb.dsn, pgdb.name, count=n, keys=50, routing_key=q, size=256,
                 batch=1000)
    r = Relay(relay_bin, cfg, tmp_path / "term1.log")
    r.wait_log("became the active relay")
    # SIGTERM once the drain is under way: some rows confirmed and marked, not all of them
    probe = pgdb.connect()

    def sent():
        return probe.execute("select count(*) from outbox.messages"
                             " where sent_at is not null").fetchone()[0]
    under_way = wait_for(sent, timeout=30, desc="the relay to mark its first rows sent")
    assert under_way < n, (f"the whole backlog ({n} rows) was drained before the test could"
                           " send SIGTERM: the test needs a larger backlog")
    t0 = time.monotonic()
    rc = r.stop(signal.SIGTERM, timeout=30)
    took = time.monotonic() - t0
    r.assert_clean_exit(rc)
    assert took < 5 + 1.0, f"took {took:.1f}s to stop"
    sent_first = sent()
    leased = psql_rows(pgdb, "select count(*) from outbox.messages where lease_token is not null")[0][0]
    print(f"SIGTERM when {under_way} rows were marked: {sent_first} sent, stopped in "
          f"{took:.2f}s, {leased} leases left")
    assert 0 < sent_first < n, "stop should happen mid-drain"
    assert leased == 0, "leases should be released on a clean stop"
    r2 = Relay(relay_bin, cfg, tmp_path / "term2.log")
    got = consume(ch, q, n, timeout=120, idle=1.5)
    r2.assert_clean_exit(r2.stop())
    ids = [p.message_id for p, _, _ in got]
    assert len(ids) == n, f"got {len(ids)}"
    assert len(set(ids)) == n, f"{len(ids) - len(set(ids))} duplicates after restart"
    conn.close()


def test_leader_failover(services, pgdb, relay_bin, build, tmp_path):
    q = f"qlead-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    a, cfg_a = start_relay(relay_bin, tmp_path, services, pgdb, name="ra", lease="3s",
                           publish_window="50", batch_size="50")
    init_schema(relay_bin, cfg_a)
    a.wait_log("became the active relay")
    b, _ = start_relay(relay_bin, tmp_path, services, pgdb, name="rb", lease="3s",
                       publish_window="50", batch_size="50")
    b.wait_log("database connected")
    run_producer(build, pgdb.dsn, pgdb.name, count=3000, keys=20, routing_key=q, size=64)
    first = consume(ch, q, 500, timeout=30)
    assert len(first) >= 500
    assert b.metric("outbox_relay_relayed_total") == 0, "standby must not publish"
    assert "became the active relay" not in b.text()
    a.kill9()
    t_kill = time.monotonic()
    b.wait_log("became the active relay", timeout=10)
    took = time.monotonic() - t_kill
    print(f"failover: standby active {took:.2f}s after kill -9 (lease 3s)")
    assert took <= 3 + 1.0
    # until every seq arrived (not 3000 deliveries: `first` holds some of them, so that count
    # may never come), then 1 s more for late copies
    rest = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        need = 3000 - len({int(p.headers["seq"]) for p, _, _ in first + rest})
        if need <= 0:
            break
        rest += consume(ch, q, need, timeout=deadline - time.monotonic())
    rest += consume(ch, q, 0, idle=1.0)
    got = first + rest
    seqs = {}
    for props, body, _ in got:
        seqs.setdefault(int(props.headers["seq"]), 0)
        seqs[int(props.headers["seq"])] += 1
    assert set(seqs) == set(range(3000)), "messages lost"
    # per-key order holds across the failover (duplicates may repeat a suffix, never reorder
    # the first deliveries)
    last = {}
    firsts = set()
    for props, body, _ in got:
        seq = int(props.headers["seq"])
        if seq in firsts:
            continue
        firsts.add(seq)
        k = seq % 20
        assert last.get(k, -1) < seq, f"key {k}: {seq} after {last[k]}"
        last[k] = seq
    dups = sum(v - 1 for v in seqs.values())
    print(f"failover duplicates: {dups} (bounded by the window, same message_id)")
    assert dups <= 2 * 50   # 2 x publish_window
    b.assert_clean_exit(b.stop())
    conn.close()


def test_competing_three_relays(services, pgdb, relay_bin, build, tmp_path):
    q = f"qcomp-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    cfg0 = write_config(tmp_path / "c0.ini", services, pgdb, mode="competing")
    init_schema(relay_bin, cfg0)
    run_producer(build, pgdb.dsn, pgdb.name, count=6000, keys=0, routing_key=q, size=64,
                 batch=1000)
    relays = [start_relay(relay_bin, tmp_path, services, pgdb, name=f"rc{i}", mode="competing",
                          batch_size="100", publish_window="200")[0] for i in range(3)]
    got = consume(ch, q, 6000, timeout=90, idle=1.5)
    counts = [rl.metric("outbox_relay_relayed_total") for rl in relays]
    for rl in relays:
        rl.assert_clean_exit(rl.stop())
    ids = [p.message_id for p, _, _ in got]
    assert len(ids) == 6000 and len(set(ids)) == 6000, f"{len(ids)} delivered, {len(set(ids))} unique"
    print(f"competing: relayed per relay {counts}")
    assert sum(counts) == 6000
    assert sum(1 for c in counts if c > 0) >= 2, "the work should be shared"
    conn.close()


def test_odbc_source_drains_through_psqlodbc(services, pgdb, relay_bin, build, tmp_path):
    q = f"qodbc-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb, source="sqlserver",
                         conninfo=pgdb.odbc, poll_interval="500ms")
    init_schema(relay_bin, cfg)
    run_producer(build, pgdb.odbc, pgdb.name, count=10000, keys=100, routing_key=q, size=300,
                 batch=250, odbc=True)
    got = consume(ch, q, 10000, timeout=180, idle=1.0)
    r.assert_clean_exit(r.stop())
    conn.close()
    assert len(got) == 10000
    assert len({p.message_id for p, _, _ in got}) == 10000
    rows = psql_rows(pgdb, "select message_id::text, headers->>'seq', sent_at is not null, "
                           "floor(extract(epoch from created_at))::bigint from outbox.messages")
    assert len(rows) == 10000 and all(s for _, _, s, _ in rows)
    by_seq = {int(seq): (mid, ts) for mid, seq, _, ts in rows}
    for props, body, _ in got:
        seq = int(props.headers["seq"])
        assert body == expected_payload("msg", seq, 300)
        assert props.message_id == by_seq[seq][0]
        assert props.timestamp == by_seq[seq][1]
        assert props.correlation_id == f"corr-{seq}" and props.type == "test.event"
        assert props.headers == {"seq": str(seq), "origin": "producer"}
    check_per_key_order(got)


def test_a_competing_relay_on_a_table_without_a_leader_row_publishes_its_backlog_at_once(
        services, pgdb, relay_bin, tmp_path):
    """A table made by an earlier version has no leader row in its lease table, which every
    competing claim locks (so that a lead running at the same moment waits for it): the
    first claim makes the row, which holds a lead off as the row does, and takes the rows.
    Taking nothing that time, it published them at its next poll, 2 s after it connected."""
    q = f"qnolead-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r, cfg = start_relay(relay_bin, tmp_path, services, pgdb, mode="competing",
                         poll_interval="auto")
    init_schema(relay_bin, cfg)
    r.wait_log("database connected")
    r.assert_clean_exit(r.stop())
    with pgdb.connect() as c:
        c.execute("DELETE FROM outbox.messages_lease")
        for i in range(5):
            c.execute("INSERT INTO outbox.messages (routing_key, partition_key, payload) "
                      "VALUES (%s, %s, %s)", (q, f"k{i}", b"x"))
    r, _ = start_relay(relay_bin, tmp_path, services, pgdb, mode="competing",
                       poll_interval="auto")
    got = consume(ch, q, 5, timeout=30)
    t_end = time.time()
    took = t_end - log_time(r, "database connected")     # the relay's own start aside
    r.assert_clean_exit(r.stop())
    conn.close()
    with pgdb.connect() as c:
        row = c.execute("SELECT owner FROM outbox.messages_lease WHERE name = 'leader'").fetchone()
    print(f"backlog published {took * 1000:.0f} ms after the relay connected")
    assert len(got) == 5 and row == ("",), (got, row)
    assert took < 1, took


def log_time(relay, text):
    """The wall-clock time (seconds since the epoch) of the relay's first log line holding
    text: its lines start with an ISO 8601 UTC timestamp."""
    m = re.search(r"^(\S+Z) .*" + re.escape(text), relay.text(), re.M)
    assert m, f"no log line with {text!r}"
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()
