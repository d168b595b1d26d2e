"""Per-key order, pipelining and bounded memory of the drain (issue 7), checked on real
PostgreSQL + RabbitMQ with a consumer-side oracle (issue 13: tests that can fail).

Rows are inserted server-side (relay_util.insert_rows: one INSERT ... SELECT generate_series,
ids in seq order); row `seq` has partition key "key-<seq mod keys>" and carries its seq in
the `seq` header. The oracle (relay_util.order_report) checks, for EVERY key, that first
deliveries keep id order, that no expected row is lost, that nothing unexpected arrived and
that copies keep their message_id. Relays run at the default log level (info).

What each test proves (the drain before the ledger rewrite fails the oversized poison rows,
the missing exchange, the pipelined hot key and the memory test):
  test_poison_rows_never_overtaken       returned (unroutable) or oversized rows among good rows
                                         of the same keys: none overtaken; each later row of the
                                         key arrives only after the poison row's dead-letter commit
  test_missing_exchange_rows_cost_only_their_channel
                                         rows to a missing exchange: good rows republished at most
                                         once per channel close (none without closes), order kept
  test_hot_key_in_flight                 one key: several messages in flight (pipelined), exactly
                                         one (strict)
  test_memory_bounded_by_in_flight       peak RSS after 200k more rows ~ peak after 20k
  test_hot_keys_broker_connection_closed mid-drain connection closes with 4 hot keys: order and
                                         duplicates <= window x closes
"""
import re
import time
import uuid

import psycopg
import pytest

from conftest import wait_for
from relay_util import (BrokerCloser, LiveConsumer, MetricSampler, Relay, amqp_channel,
                        broker_publish_channel_errors, consume, declare,
                        free_port, insert_rows, memory_unmeasurable, order_report, proc_status_kb,
                        queue_depth, relay_channel_closes, relay_sink_reconnects, log_lines_at,
                        wait_log_at, write_config)
from test_relay import init_schema

DB_ERRORS = (psycopg.Error, OSError)


@pytest.fixture
def broker_names(services):
    """Queues and exchanges a test declared: deleted at teardown, also when the test failed,
    so that no undrained queue is left holding the broker's memory."""
    names = {"queues": [], "exchanges": []}
    yield names
    try:
        conn, _ = amqp_channel(services)
    except Exception:  # noqa: BLE001 - best effort
        return
    try:
        for kind, names_ in (("queue", names["queues"]), ("exchange", names["exchanges"])):
            for name in names_:
                try:   # one channel each: a failed delete closes its channel
                    ch = conn.channel()
                    if kind == "queue":
                        ch.queue_delete(name)
                    else:
                        ch.exchange_delete(name)
                    ch.close()
                except Exception:  # noqa: BLE001
                    pass
    finally:
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass


class Setup:
    """A queue name, a relay config at the default log level with metrics on a free port, the
    outbox schema applied. The relay is not started."""

    def __init__(self, services, pgdb, relay_bin, tmp_path, tag, broker_names, *, sink=None,
                 **ob):
        uid = uuid.uuid4().hex[:8]
        self.services, self.pgdb, self.relay_bin, self.tmp = services, pgdb, relay_bin, tmp_path
        self.uid = uid
        self.q = f"qo-{tag}-{uid}"
        broker_names["queues"].append(self.q)
        self.broker_names = broker_names
        self.name = f"ord-{tag}-{uid}"
        self.port = free_port()
        self.window = int((sink or {}).get("publish_window", 1000))
        self.on_sent = ob.get("on_sent", "mark")
        relay = {"name": self.name, "http_listen": f"127.0.0.1:{self.port}"}   # default level
        self.cfg = write_config(tmp_path / f"{tag}.ini", services, pgdb, relay=relay, sink=sink,
                                **ob)
        init_schema(relay_bin, self.cfg)
        self.n_relays = 0

    def start(self):
        self.n_relays += 1
        return Relay(self.relay_bin, self.cfg, self.tmp / f"relay{self.n_relays}.log",
                     http_port=self.port)

    def counts(self):
        """(outbox rows, unsent outbox rows, dead rows) on a fresh connection."""
        with psycopg.connect(self.pgdb.dsn, autocommit=True) as c:
            return c.execute(
                "select (select count(*) from outbox.messages), "
                "(select count(*) from outbox.messages where sent_at is null), "
                "(select count(*) from outbox.messages_dead)").fetchone()

    def wait_settled(self, n_good, n_dead, timeout):
        """Until every good row is marked sent (or deleted) and every bad row is in the dead
        table."""
        left = 0 if self.on_sent == "delete" else n_good

        def done():
            # cheap while polling (the pending rows' partial index, the small dead table);
            # the whole table is counted once at the end
            with psycopg.connect(self.pgdb.dsn, autocommit=True) as c:
                unsent, dead = c.execute(
                    "select (select count(*) from outbox.messages where sent_at is null), "
                    "(select count(*) from outbox.messages_dead)").fetchone()
            return unsent == 0 and dead == n_dead
        t0 = time.monotonic()
        wait_for(done, timeout, interval=0.2, ignore=DB_ERRORS,
                 desc=f"{n_good} rows sent and {n_dead} dead")
        took = time.monotonic() - t0
        rows, unsent, dead = self.counts()
        assert (rows, unsent, dead) == (left, 0, n_dead), \
            f"outbox rows, unsent, dead: {(rows, unsent, dead)}, expected {(left, 0, n_dead)}"
        return took

    @staticmethod
    def dead_logged(text):
        """Ids of the rows whose dead-lettering the relay logged at WARN/ERROR."""
        return {int(re.search(r"id=(\d+) message_id=", m).group(1))
                for m in log_lines_at(text, r"id=\d+ message_id=\S+: dead-lettered: ")}

    def dead_rows(self):
        """{seq: (attempts, reason)} of the dead-letter table."""
        with psycopg.connect(self.pgdb.dsn, autocommit=True) as c:
            rows = c.execute("select (headers->>'seq')::bigint, attempts, reason "
                             "from outbox.messages_dead").fetchall()
        return {s: (a, r) for s, a, r in rows}

    def collect(self, timeout=60):
        """Everything in the queue after the drain, in queue order."""
        depth = queue_depth(self.services, self.q)
        conn, ch = amqp_channel(self.services)
        try:
            got = consume(ch, self.q, depth, timeout=timeout, idle=0.3)
        finally:
            conn.close()
        assert len(got) == depth, f"queue held {depth}, consumed {len(got)}"
        return got


def stop_clean(r):
    r.assert_clean_exit(r.stop())


def key_mod(keys):
    return lambda seq: seq % keys


def rows_of_key(keys, k, positions):
    """The seqs of key k's rows at the given positions within the key (0 = its first row)."""
    return [p * keys + k for p in positions]


# ---------------------------------------------------------------------------- 1
def poison_seqs(keys, per_key):
    """A few poison rows in EVERY key, at positions that differ per key; key 0 has two
    adjacent ones, key 1 starts with one, key 2 ends with one."""
    bad = set()
    for k in range(keys):
        pos = {5 + k, 40 + (k * 7) % 20, 75 + (k * 3) % 20}
        if k == 0:
            pos.add(6)
        if k == 1:
            pos.add(0)
        if k == 2:
            pos.add(per_key - 1)
        bad.update(rows_of_key(keys, k, sorted(pos)))
    return bad


POISON = {
    # kind: (relay settings, insert_rows arguments for the bad rows, dead reason regex)
    "returned": ({}, {"bad_routing_key": "nobody"}, r"unroutable|NO_ROUTE|312"),
    "oversized": ({"max_message_size": "1k"}, {"bad_size": 4096},
                  r"max_message_size|too large|larger than"),
}


@pytest.mark.parametrize("ordering", ["pipelined", "strict"])
@pytest.mark.parametrize("kind", ["returned", "oversized"])
def test_poison_rows_never_overtaken(services, pgdb, relay_bin, tmp_path, broker_names, kind,
                                     ordering):
    """20 keys x 100 rows to an exchange whose queue is bound to 'good'; 3-4 rows of EVERY key
    are poison: 'returned' rows go to routing key 'nobody' (mandatory -> basic.return) and are
    dead-lettered after max_attempts = 2; 'oversized' rows exceed the sink's max_message_size
    and are dead-lettered without a publish. For every key: order of first deliveries,
    nothing lost, no duplicates, exactly the poison rows dead with a reason; and when a later
    row of a key FIRST reaches the consumer, every earlier poison row of its key is already in
    the dead table (its dead-letter transaction committed). That check is one-sided: a row
    seen before the commit proves it reached the broker before the commit."""
    keys, per_key = 20, 100
    n = keys * per_key
    bad = poison_seqs(keys, per_key)
    good = set(range(n)) - bad
    sink_keys, bad_args, reason_rx = POISON[kind]
    s = Setup(services, pgdb, relay_bin, tmp_path, f"poison-{kind[:3]}-{ordering[:3]}",
              broker_names,
              sink=sink_keys, max_attempts="2", retry_backoff="50ms", retry_backoff_max="100ms",
              ordering=ordering)
    ex = f"ex-{s.q}"
    broker_names["exchanges"].append(ex)
    conn, ch = amqp_channel(services)
    declare(ch, ex, s.q, "good")
    conn.close()
    bad_by_key = {}
    for b in sorted(bad):
        bad_by_key.setdefault(b % keys, []).append(b)
    known_dead = set()
    overtaken = []   # (seq that arrived, its key's poison seqs not yet in the dead table)
    n_checks = [0]
    checker = services.pg_connect(pgdb.name)   # autocommit; used by the consumer thread only

    def on_first(seq):
        pending = [b for b in bad_by_key.get(seq % keys, ()) if b < seq and b not in known_dead]
        if not pending:
            return
        n_checks[0] += 1
        found = {r[0] for r in checker.execute(
            "select (headers->>'seq')::bigint from outbox.messages_dead "
            "where (headers->>'seq')::bigint = any(%s)", (pending,)).fetchall()}
        known_dead.update(found)
        missing = sorted(set(pending) - found)
        if missing:
            overtaken.append((seq, missing))

    insert_rows(pgdb, n, keys, exchange=ex, routing_key="good", bad=bad, size=128, **bad_args)
    consumer = LiveConsumer(services, s.q, on_first=on_first)
    r = s.start()
    t0 = time.monotonic()
    try:
        took = s.wait_settled(len(good), len(bad), timeout=90)
        consumer.wait_distinct(len(good), timeout=30)
        got = consumer.stop(idle=0.5)
        returned = r.metric("outbox_relay_returned_total")
        counted_overtaken = r.metric("outbox_relay_overtaken_total")   # None: no such metric
        text = r.text()
    finally:
        consumer.stop(idle=0)
        stop_clean(r)
        checker.close()
    wall = time.monotonic() - t0
    dead = s.dead_rows()
    assert not consumer.errors, (f"consumer errors (did another test close every broker "
                                 f"connection?): {consumer.errors[:3]}")
    reconnects = relay_sink_reconnects(text)
    print(f"{kind} poison, ordering={ordering}: {len(good)} good + {len(bad)} poison rows over "
          f"{keys} keys settled in {took:.1f}s ({wall:.1f}s with the consumer); returned_total "
          f"{returned}; overtaken_total {counted_overtaken}; broker reconnects {reconnects}; "
          f"{n_checks[0]} dead-table checks at first "
          f"arrivals, later rows that arrived before their key's poison row was dead: "
          f"{len(overtaken)} {overtaken[:5]}")
    assert not overtaken, (
        f"{len(overtaken)} later rows reached the consumer before an earlier poison row of "
        f"their key was in the dead table (seq, poison seqs not yet dead): {overtaken[:8]}")
    dups, _ = order_report(got, good, key_mod(keys))
    assert not counted_overtaken, f"the relay counted {counted_overtaken} overtaken messages"
    assert n_checks[0] >= len(bad_by_key), "the dead-table check never ran"
    assert set(dead) == bad, (f"dead rows differ from the poison rows: missing "
                              f"{sorted(bad - set(dead))[:10]}, "
                              f"extra {sorted(set(dead) - bad)[:10]}")
    no_reason = [sq for sq, (_, why) in dead.items() if not re.search(reason_rx, why)]
    assert not no_reason, (f"dead rows without a reason matching {reason_rx!r}: "
                           f"{[(q, dead[q]) for q in no_reason[:3]]}")
    # no fault is injected: the relay has no reason to reconnect, and without a lost
    # connection or channel nothing may be published twice
    assert reconnects == 0, f"the relay reconnected to the broker {reconnects}x without a fault"
    assert dups == 0, f"{dups} duplicates without a fault"
    if kind == "returned":
        assert returned is not None and returned >= len(bad)
    assert len(s.dead_logged(text)) == len(bad), \
        "each dead-lettered row should be logged at WARN/ERROR at the default log level"


# ---------------------------------------------------------------------------- 2
def test_missing_exchange_rows_cost_only_their_channel(services, pgdb, relay_bin, tmp_path,
                                                       broker_names):
    """20 keys x 100 rows to the queue (default exchange); 2 rows in each of keys 0-4 go to an
    exchange that does not exist (today a publish there makes the broker close the channel).
    Channel closes are counted by the broker (its log names the missing exchange and
    basic.publish) and by the relay's log. For every key: order of first deliveries, nothing
    lost; the bad rows dead with a 404 reason; duplicates of good rows <= window x closes
    (none when the publishing channel was never closed) and no good row published more than
    once more per close."""
    keys, per_key, window = 20, 100, 100
    n = keys * per_key
    bad = set()
    for k in range(5):
        bad.update(rows_of_key(keys, k, [10 + 7 * k, 60 + 5 * k]))
    good = set(range(n)) - bad
    s = Setup(services, pgdb, relay_bin, tmp_path, "noexch", broker_names,
              sink={"publish_window": str(window)},
              batch_size="200", max_attempts="2", retry_backoff="50ms", retry_backoff_max="100ms")
    missing = f"nx-{s.uid}"   # never declared
    conn, ch = amqp_channel(services)
    declare(ch, "", s.q, s.q)
    conn.close()
    insert_rows(pgdb, n, keys, routing_key=s.q, bad=bad, bad_exchange=missing,
                bad_routing_key="x", size=128)
    r = s.start()
    try:
        took = s.wait_settled(len(good), len(bad), timeout=90)
        text = r.text()
        rejected = r.metric("outbox_relay_rejected_total")
        counted_overtaken = r.metric("outbox_relay_overtaken_total")   # None: no such metric
    finally:
        stop_clean(r)
    time.sleep(0.3)   # the broker's log is written asynchronously
    # the faults are the broker's channel closes, counted in the broker's own log (not the
    # relay's: a relay that closed or reconnected on its own must not widen its own bound)
    closes_broker = broker_publish_channel_errors(services, missing)
    closes_log = relay_channel_closes(text)   # may include closes of a checking channel
    reconnects = relay_sink_reconnects(text)   # each publishing channel reopen counts as one
    assert closes_broker is not None, f"the broker's log {services.rabbit_log} is unreadable"
    closes = closes_broker
    got = s.collect()
    dead = s.dead_rows()
    print(f"{len(bad)} rows to a missing exchange among {len(good)} good rows, window {window}: "
          f"settled in {took:.1f}s; publishing channel closed {closes_broker}x (broker log), "
          f"{closes_log}x (relay log), {reconnects} broker reconnects, rejected_total "
          f"{rejected}, overtaken_total {counted_overtaken}; {len(got)} deliveries of "
          f"{len(good)} good rows")
    dups, copies = order_report(got, good, key_mod(keys))
    worst = max(copies.values()) - 1
    print(f"{dups} duplicates, most copies of one row {worst + 1}")
    assert set(dead) == bad, (f"dead rows differ from the bad rows: missing "
                              f"{sorted(bad - set(dead))[:10]}, "
                              f"extra {sorted(set(dead) - bad)[:10]}")
    no_reason = [sq for sq, (_, why) in dead.items()
                 if not re.search(r"404|NOT_FOUND|no exchange|does not exist|not found", why)]
    assert not no_reason, f"dead rows without a 404 reason: {[(q, dead[q]) for q in no_reason[:3]]}"
    assert reconnects <= closes, (f"{reconnects} broker reconnects or channel reopens after "
                                  f"{closes} channel closes by the broker")
    if closes == 0:
        assert dups == 0, f"{dups} duplicates although the publishing channel was never closed"
    assert dups <= window * closes, f"{dups} duplicates > window {window} x {closes} channel closes"
    assert worst <= closes, (f"a good row was published {worst + 1} times with {closes} channel "
                             f"closes (at most once more per close)")
    assert len(s.dead_logged(text)) == len(bad), \
        "each dead-lettered row should be logged at WARN/ERROR at the default log level"


# ---------------------------------------------------------------------------- 3
@pytest.mark.parametrize("ordering,count", [("pipelined", 20000), ("strict", 3000)])
def test_hot_key_in_flight(services, pgdb, relay_bin, tmp_path, broker_names, ordering, count):
    """One partition key: outbox_relay_in_flight sampled from /metrics while the relay drains.
    pipelined: more than one message of the key in flight at some point (a hot key is bounded
    by the window, not by one confirm round trip); strict: never more than one. Both: order,
    nothing lost, no duplicates. The queue is transient so confirms need no disk write."""
    s = Setup(services, pgdb, relay_bin, tmp_path, f"hot-{ordering}", broker_names,
              ordering=ordering)
    conn, ch = amqp_channel(services)
    ch.queue_declare(queue=s.q, durable=False)   # no fsync per confirm: a shorter run
    conn.close()
    r = s.start()
    sampler = MetricSampler(r, "outbox_relay_in_flight")
    try:
        # the rows come once the sampler reads /metrics: on a loaded machine its first read
        # could otherwise come after a short drain has ended
        wait_for(lambda: sampler.samples, 30, interval=0.01, desc="a first in_flight sample")
        insert_rows(pgdb, count, 1, routing_key=s.q, size=128)
        took = s.wait_settled(count, 0, timeout=120)
    finally:
        samples = sampler.stop()
        text = r.text()
        stop_clean(r)
    got = s.collect()
    dups, _ = order_report(got, range(count), key_mod(1))
    busy = [v for v in samples if v > 0]
    mx = max(samples, default=0)
    print(f"ordering={ordering}: {count} rows of one key drained in {took:.1f}s; "
          f"{len(samples)} in_flight samples, {len(busy)} non-zero, max {mx:.0f}, "
          f"mean of non-zero {sum(busy) / max(1, len(busy)):.1f}; {dups} duplicates")
    reconnects = relay_sink_reconnects(text)
    assert reconnects == 0, f"the relay reconnected to the broker {reconnects}x without a fault"
    assert dups == 0, f"{dups} duplicates without a fault"
    assert busy, "the sampler never saw a message in flight (drain not observed)"
    if ordering == "strict":
        assert mx <= 1, f"strict ordering: {mx:.0f} messages of one key in flight at once"
    else:
        assert mx > 1, (f"one hot key never had more than {mx:.0f} message in flight "
                        f"({len(samples)} samples over {took:.1f}s): no per-key pipelining")


# ---------------------------------------------------------------------------- 4
def test_memory_bounded_by_in_flight(services, pgdb, relay_bin, tmp_path, broker_names):
    """Peak RSS (VmHWM) of one relay process after draining 20k rows, and after 200k more:
    memory is bounded by rows buffered and in flight, not by rows drained. The queue is not
    durable and capped (drop-head) so the broker stays fast and small; delivery itself is
    checked by the other tests, here the database says every row was confirmed and marked."""
    why = memory_unmeasurable(relay_bin)
    if why:
        pytest.skip(f"memory is not measurable in this build: {why}")
    keys, n1, n2 = 1000, 20000, 200000
    # the relay's commits skip the WAL flush wait (test speed only; memory is what is measured)
    s = Setup(services, pgdb, relay_bin, tmp_path, "mem", broker_names,
              conninfo=pgdb.dsn + " options='-c synchronous_commit=off'")
    conn, ch = amqp_channel(services)
    ch.queue_declare(queue=s.q, durable=False, arguments={"x-max-length": 5000})
    conn.close()
    insert_rows(pgdb, n1, keys, routing_key=s.q, size=256)
    r = s.start()
    try:
        took1 = s.wait_settled(n1, 0, timeout=120)
        hwm1 = proc_status_kb(r.proc.pid, "VmHWM")
        insert_rows(pgdb, n2, keys, start=n1, routing_key=s.q, size=256)
        took2 = s.wait_settled(n1 + n2, 0, timeout=300)
        hwm2 = proc_status_kb(r.proc.pid, "VmHWM")
        rss2 = proc_status_kb(r.proc.pid, "VmRSS")
        relayed = r.metric("outbox_relay_relayed_total")
    finally:
        stop_clean(r)
        print(f"VmHWM after {n1} rows {hwm1 / 1024:.1f} MiB ({took1:.1f}s); after {n2} more "
          f"{hwm2 / 1024:.1f} MiB ({took2:.1f}s), growth {(hwm2 - hwm1) / 1024:.2f} MiB; "
          f"RSS at end {rss2 / 1024:.1f} MiB; relayed_total {relayed}")
    assert relayed == n1 + n2
    assert hwm2 - hwm1 <= 3 * 1024, (f"peak RSS grew {(hwm2 - hwm1) / 1024:.1f} MiB "
                                     f"({hwm1 / 1024:.1f} -> {hwm2 / 1024:.1f} MiB) while draining "
                                     f"{n2} more rows: memory grows with rows drained")


# ---------------------------------------------------------------------------- 5
def test_hot_keys_broker_connection_closed(services, pgdb, relay_bin, tmp_path, broker_names):
    """4 hot keys (several messages of each in flight once pipelined), window 100; the broker
    closes the relay's connection three times mid-drain. For every key: order of first
    deliveries, nothing lost; duplicates <= window x closes, and no row published more than
    once more per close."""
    n, keys, window = 24000, 4, 100
    s = Setup(services, pgdb, relay_bin, tmp_path, "hotclose", broker_names,
              sink={"publish_window": str(window)},
              batch_size="100", reconnect_max="1s")
    conn, ch = amqp_channel(services)
    ch.queue_declare(queue=s.q, durable=False)   # no fsync per confirm: a shorter run
    conn.close()
    insert_rows(pgdb, n, keys, routing_key=s.q, size=128)
    conn_name = f"outbox-relay {s.name}/main"
    # each connection is closed after ~1,000 publishes (>= 128 bytes each), from inside the
    # broker, so the closes land mid-drain however loaded the machine is
    closer = BrokerCloser(services, conn_name, 3, 1000 * 300, str(tmp_path / "closer.ready"),
                          "drain order test")
    r = s.start()
    try:
        closes = closer.wait()
        wait_log_at(r, r"sink=main: connected", ("INFO",), timeout=30,
                    count=len(closes) + 1)   # reconnected after the last close
        took = s.wait_settled(n, 0, timeout=120)
        text = r.text()
    finally:
        stop_clean(r)
    got = s.collect()
    dups, copies = order_report(got, range(n), key_mod(keys))
    worst = max(copies.values()) - 1
    downs = log_lines_at(text, r"sink=main: down: ")   # each close: a WARN at the default level
    # the faults are the closes the broker made (its own count, not the relay's reconnects:
    # a relay reconnecting on its own must not widen its own bound)
    faults = len(closes)
    reconnects = relay_sink_reconnects(text)
    print(f"{keys} hot keys, window {window}: broker connection closed {len(closes)}x "
          f"(bytes received on each connection when closed: {closes}); drained {took:.1f}s "
          f"after the last; {dups} duplicates, most copies of one row {worst + 1}; "
          f"{len(downs)} 'down' lines")
    assert len(closes) == 3, f"the broker closed the relay's connection {len(closes)}x, not 3x"
    # every publish carries its 128-byte body: fewer bytes than n bodies means rows were left
    assert sum(closes) < n * 128, f"the closes should happen mid-drain: {closes}"
    assert len(downs) >= len(closes), f"{len(closes)} closes, WARN lines: {downs}"
    assert reconnects == faults, f"{reconnects} reconnects after {faults} closes by the broker"
    assert dups <= window * faults, f"{dups} duplicates > window {window} x {faults} closes"
    assert worst <= faults, f"a row was published {worst + 1} times with {faults} closes"
