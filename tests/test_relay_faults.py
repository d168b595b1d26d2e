"""Fault tests of `outbox-relay run` (required: "Survives: broker restart, database restart,
dropped connections, broker flow control, slow consumers; reconnects with capped back-off;
never loses a row").

Every test checks that EVERY message arrives (by the producer's `seq` header), that
duplicates are bounded and always carry the same message_id, and that first deliveries keep
per-key order (the producer gives message i the partition key i mod keys).

Each test uses its own database, queue and relay name (the relay's broker connection is named
"outbox-relay <name>/main", its database sessions have application_name 'outbox-relay' in
the test's own database), so faults are aimed at this test's relay only, except the server
restarts and the memory alarm, which are kept short.
"""
import re
import time
import uuid

import psycopg
import pytest

from conftest import wait_for
from relay_util import (BlackholeProxy, BrokerCloser, LostAnswerProxy, Relay, amqp_channel, check_against_db, consume,
                        declare, delivery_report, free_port, log_events, log_lines_at, order_report, pg_ctl, proc_cpu_seconds,
                        queue_depth, run_producer, services_start, wait_log_at, write_config)
from test_relay import init_schema

DB_ERRORS = (psycopg.Error, OSError)


class Case:
    """One fault scenario: a queue, an outbox schema, a relay config (not yet running)."""

    def __init__(self, services, pgdb, relay_bin, build, tmp_path, tag, *, sink=None,
                 relay=None, declare_queue=True, qargs=None, **ob):
        uid = uuid.uuid4().hex[:8]
        self.services, self.pgdb, self.relay_bin, self.build = services, pgdb, relay_bin, build
        self.tmp = tmp_path
        self.q = f"qf-{tag}-{uid}"
        self.name = f"flt-{tag}-{uid}"
        self.port = free_port()
        rk = dict(relay or {}, name=self.name, http_listen=f"127.0.0.1:{self.port}")
        self.cfg = write_config(tmp_path / f"{tag}.ini", services, pgdb, relay=rk, sink=sink, **ob)
        # the duplicate bounds use the window and batch this relay was given (read back from
        # the file it runs with, not a default assumed here)
        self.window = int(ini_value(self.cfg, "sink.main", "publish_window"))
        self.batch = int(ini_value(self.cfg, "outbox.main", "batch_size"))
        if declare_queue:
            conn, ch = amqp_channel(services)
            declare(ch, "", self.q, self.q, **(qargs or {}))
            conn.close()
        init_schema(relay_bin, self.cfg)
        self.n_relays = 0

    def produce(self, count, keys, **kw):
        kw.setdefault("routing_key", self.q)
        return run_producer(self.build, self.pgdb.dsn, self.pgdb.name, count=count, keys=keys,
                            **kw)

    def start(self):
        self.n_relays += 1
        return Relay(self.relay_bin, self.cfg, self.tmp / f"relay{self.n_relays}.log",
                     http_port=self.port)

    def db_counts(self):
        """(rows, unsent rows), on a fresh connection (the server may have restarted)."""
        with psycopg.connect(self.pgdb.dsn, autocommit=True) as c:
            return c.execute("select count(*), count(*) filter (where sent_at is null) "
                             "from outbox.messages").fetchone()

    def wait_all_sent(self, total, timeout=60):
        def done():
            n, unsent = self.db_counts()
            return n == total and unsent == 0
        t0 = time.monotonic()
        wait_for(done, timeout, interval=0.2, ignore=DB_ERRORS,
                 desc=f"all {total} rows marked sent")
        return time.monotonic() - t0

    def collect_depth(self):
        """Messages in the test's queue now."""
        return queue_depth(self.services, self.q)

    def collect(self, timeout=60):
        """Everything in the queue (after the drain): [(props, body, t)], each delivery
        checked whole (body and properties) against its outbox row."""
        depth = queue_depth(self.services, self.q)
        conn, ch = amqp_channel(self.services)
        try:
            got = consume(ch, self.q, depth, timeout=timeout, idle=0.3)
        finally:
            conn.close()
        assert len(got) == depth, f"queue held {depth}, consumed {len(got)}"
        check_against_db(got, self.pgdb)
        return got


# The relays here run at the default log level (info). What relay/log.c's log_fail/log_ok
# promise there: the first failure of a connection (and any new reason) at WARN/ERROR,
# repeats of the same reason at debug (counted), and one INFO line when it is back,
# "... after N failure(s)". Progress lines ("connected", "became the active relay") are INFO.
INFO = ("INFO",)
RECOVERED = r" after (\d+) failures?$"


def ini_value(path, section, key):
    """A key's value in one section of an ini file the test wrote."""
    sec = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            sec = line.strip("[]")
        elif sec == section and "=" in line and line.split("=", 1)[0].strip() == key:
            return line.split("=", 1)[1].strip()
    raise AssertionError(f"{key} not in [{section}] of {path}")


def recovery_counts(text, pattern):
    """N of each INFO recovery line matching pattern + ' after N failure(s)'."""
    return [int(re.search(RECOVERED, m).group(1))
            for m in log_lines_at(text, pattern + r".*" + RECOVERED, INFO)]


def relayed(r):
    return r.metric("outbox_relay_relayed_total") or 0


def wait_relayed(r, n, timeout=30):
    return wait_for(lambda: relayed(r) >= n, timeout, interval=0.01, ignore=(OSError,),
                    desc=f"{n} messages relayed")


def terminate_relay_backends(services, dbname):
    """pg_terminate_backend on the relay's sessions in dbname; returns how many."""
    with services.pg_connect() as c:
        return c.execute("select count(*) filter (where pg_terminate_backend(pid)) "
                         "from pg_stat_activity where application_name = 'outbox-relay' "
                         "and datname = %s and pid <> pg_backend_pid()", (dbname,)).fetchone()[0]


def relay_backends(services, dbname):
    with services.pg_connect() as c:
        return c.execute("select count(*) from pg_stat_activity where application_name = "
                         "'outbox-relay' and datname = %s", (dbname,)).fetchone()[0]


def stop_clean(r):
    r.stop_clean()


# ---------------------------------------------------------------------------- 1
def test_db_backends_terminated_mid_drain(services, pgdb, relay_bin, build, tmp_path):
    n, keys = 20000, 100
    # window 200 (not 1000): the duplicate bound, 2 x window x faults (in flight + confirmed
    # unmarked, when a fault costs the lease), is then 1200 of 20000 rows;
    # 100 keys keep today's one-per-key drain as fast as with 1000
    c = Case(services, pgdb, relay_bin, build, tmp_path, "dbkill", reconnect_max="1s",
             sink={"publish_window": "200"})
    c.produce(n, keys, size=256, batch=1000)
    r = c.start()
    kills = []
    try:
        r.wait_log("became the active relay")
        assert relay_backends(services, pgdb.name) >= 2, "the relay's sessions not found"
        for thr in (2000, 7000, 12000):
            wait_relayed(r, thr)
            at = relayed(r)
            k = terminate_relay_backends(services, pgdb.name)
            kills.append((at, k))
            assert k >= 1, "no relay backend to terminate"
            # wait until it is back before the next fault
            wait_log_at(r, r"database connected", INFO, count=len(kills) + 1)
        took = c.wait_all_sent(n)
        text = r.text()
        # every kill is a new failure after a recovery: a WARN again (not rate-limited away)
        n_lost_logs = len(log_lines_at(text, r"database unavailable \((?:main|settler) "
                                             r"connection\)"))
        n_conn = len(log_lines_at(text, r"database connected", INFO))
        recovered = recovery_counts(text, r"database connected")
        lost = r.metric("outbox_relay_retried_unconfirmed_total")
        lease_lost = r.metric("outbox_relay_lease_lost_total")
    finally:
        stop_clean(r)
    got = c.collect()
    dups, copies = delivery_report(got, n, keys)
    worst = max(copies.values()) - 1
    print(f"db backends terminated 3x (relayed at kill, sessions killed: {kills}); "
          f"drained {took:.1f}s after the last kill; {dups} duplicates (most copies {worst + 1}); "
          f"'database unavailable' logged {n_lost_logs}x, 'database connected' {n_conn}x; "
          f"lease_lost_total {lease_lost}, lost_total {lost}")
    assert all(at < n for at, _ in kills), "faults should happen mid-drain"
    assert n_lost_logs >= 3 and n_conn >= 4, text[-3000:]
    assert len(recovered) >= 3 and all(k >= 1 for k in recovered), \
        f"each reconnect must say after how many failures: {recovered}\n{text[-3000:]}"
    assert dups <= len(kills) * 2 * c.window, \
        f"{dups} duplicates > 2 x window {c.window} x {len(kills)} faults"
    assert worst <= len(kills), f"a row was published {worst + 1} times with {len(kills)} faults"


# ---------------------------------------------------------------------------- 2
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_restart_mid_drain(services, pgdb, relay_bin, build, tmp_path, mode):
    """A restart mid-drain: clean (fast), or a crash (immediate: no checkpoint, the server
    recovers from its WAL at start). Either way no mark the server acknowledged is lost,
    so only the rows in flight and those confirmed but not yet marked come again."""
    n, keys = 20000, 100
    c = Case(services, pgdb, relay_bin, build, tmp_path, "pgrestart", reconnect_max="1s",
             sink={"publish_window": "200"})   # duplicate bound: window x 1 fault
    c.produce(n, keys, size=256, batch=1000)
    r = c.start()
    try:
        r.wait_log("became the active relay")
        wait_relayed(r, 5000)
        at = relayed(r)
        t0 = time.monotonic()
        p = pg_ctl(services, "-l", services.pg_log, "-m", mode, "-w", "-t", "60", "restart")
        restart_s = time.monotonic() - t0
        assert p.returncode == 0, p.stdout + p.stderr
        took = c.wait_all_sent(n)
        text = r.text()
        lease_lost = r.metric("outbox_relay_lease_lost_total")
    finally:
        try:
            stop_clean(r)
        finally:
            if pg_ctl(services, "status").returncode != 0:
                services_start()
    got = c.collect()
    dups, copies = delivery_report(got, n, keys)
    print(f"postgres restart ({mode}) at {at:.0f} relayed (restart took {restart_s:.2f}s): all {n} "
          f"arrived {took:.1f}s later, {dups} duplicates, lease_lost_total {lease_lost}")
    assert at < n, "restart should happen mid-drain"
    assert log_lines_at(text, r"database unavailable"), text[-3000:]
    assert len(log_lines_at(text, "database connected", INFO)) >= 2, text[-3000:]
    assert recovery_counts(text, r"database connected"), \
        "the reconnect after the restart must say after how many failures: " + text[-3000:]
    assert dups <= 2 * c.window, f"{dups} duplicates > 2 x window {c.window} x 1 fault"
    assert max(copies.values()) <= 2, "a row was published more than once more for one fault"


@pytest.mark.parametrize("mode", ["leader", "competing"])
def test_a_claim_whose_answer_is_lost_keeps_key_order(services, pgdb, relay_bin, build,
                                                      tmp_path, mode):
    """The claiming connection breaks after a claim reached the server and before its answer
    came back (a network fault, a failover): the server runs the claim and commits it,
    leasing 100 rows the relay never got. The relay's next claims take them back by that
    claim's token, so no later row of their keys is published before them, and they do not
    wait for their lease (20 s) to run out."""
    stmt = b"outbox_relay_claim" + (b"_competing" if mode == "competing" else b"")
    proxy = LostAnswerProxy(services.pg_port, stmt, after=3)
    n, keys = 3000, 30
    dsn = (f"host=127.0.0.1 port={proxy.port} user={services.pg_user} dbname={pgdb.name} "
           "connect_timeout=10")
    c = Case(services, pgdb, relay_bin, build, tmp_path, f"lost{mode[0]}", conninfo=dsn,
             mode=mode, batch_size="100", lease="20s", reconnect_max="1s")
    c.produce(n, keys, size=64, batch=1000)
    r = c.start()
    try:
        took = c.wait_all_sent(n, timeout=15)
        text = r.text()
    finally:
        try:
            stop_clean(r)
        finally:
            proxy.close()
    got = c.collect()
    dups, copies = delivery_report(got, n, keys)      # first deliveries in key order
    print(f"lost claim answer ({mode}): all {n} sent {took:.1f} s after, {dups} duplicates")
    assert proxy.swallowed == 1, "no claim's answer was lost: the test shows nothing"
    assert log_lines_at(text, r"database unavailable|connection"), text[-3000:]
    assert dups == 0, f"{dups} duplicates: the lost claim's rows were never published before"


# ---------------------------------------------------------------------------- 3
def test_broker_connections_closed_mid_drain(services, pgdb, relay_bin, build, tmp_path):
    n, keys = 30000, 100
    c = Case(services, pgdb, relay_bin, build, tmp_path, "amqpclose", reconnect_max="1s",
             sink={"publish_window": "100"}, batch_size="100")
    c.produce(n, keys, size=256, batch=1000)
    conn_name = f"outbox-relay {c.name}/main"
    # only this relay's connections (another session uses the same broker), each closed from
    # inside the broker after ~2,000 publishes (>= 256 bytes each): mid-drain however loaded
    # the machine is
    closer = BrokerCloser(services, conn_name, 3, 2000 * 400, str(tmp_path / "closer.ready"),
                          "fault test")
    r = c.start()
    try:
        t0 = time.monotonic()
        closes = closer.wait()
        wait_log_at(r, r"sink=main: connected", INFO, count=len(closes) + 1)
        took = c.wait_all_sent(n)
        t_all = time.monotonic() - t0
        text = r.text()
        lost = r.metric("outbox_relay_retried_unconfirmed_total")
    finally:
        stop_clean(r)
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    downs = log_lines_at(text, r"sink=main: down: ")   # WARN/ERROR only
    recovered = recovery_counts(text, r"sink=main: connected")
    print(f"broker connection closed {len(closes)}x (bytes received on each connection when "
          f"closed: {closes}); drained in {t_all:.1f}s, {took:.1f}s after the last; {dups} "
          f"duplicates; lost_total {lost}; first down line: {downs[0] if downs else None!r}")
    assert len(closes) == 3, f"the broker closed the relay's connection {len(closes)}x, not 3x"
    assert sum(closes) < n * 256, f"faults should happen mid-drain: {closes}"
    assert len(downs) >= 3, f"each close must be a WARN: {downs}\n{text[-3000:]}"
    assert len(recovered) >= 3, f"each reconnect must say after how many failures: {recovered}"
    assert dups <= len(closes) * c.window


# ---------------------------------------------------------------------------- 4
def test_broker_restart_mid_drain(services, pgdb, relay_bin, build, tmp_path):
    n, keys = 20000, 100
    # debug: the back-off is measured between reconnect attempts, and at info the repeats
    # of one reason are only counted (checked below: WARN once per reason, INFO recovery)
    c = Case(services, pgdb, relay_bin, build, tmp_path, "amqprestart", reconnect_max="1s",
             relay={"log_level": "debug"})
    c.produce(n, keys, size=256, batch=1000)
    r = c.start()
    app_stopped = False
    try:
        r.wait_log("became the active relay")
        wait_relayed(r, 5000)
        at = relayed(r)
        t_stop = time.monotonic()
        p = services.rabbitmqctl("stop_app")
        app_stopped = True
        assert p.returncode == 0, p.stdout + p.stderr
        time.sleep(2.0)   # the relay retries against a closed port meanwhile
        p = services.rabbitmqctl("start_app")
        app_stopped = False
        assert p.returncode == 0, p.stdout + p.stderr
        outage = time.monotonic() - t_stop
        took = c.wait_all_sent(n)
        # Under a sanitizer the relay may have drained everything before stop_app took
        # effect; it must still reconnect once the broker is back.
        wait_log_at(r, r"sink=main: connected", INFO, timeout=30, count=2)
        text = r.text()
        lost = r.metric("outbox_relay_retried_unconfirmed_total")
    finally:
        try:
            if app_stopped:
                services.rabbitmqctl("start_app")
        finally:
            stop_clean(r)
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    downs = re.findall(r"^.*sink=main: down: .*$", text, re.M)
    stamps = [time.mktime(time.strptime(d[:19], "%Y-%m-%dT%H:%M:%S")) + float(d[19:23])
              for d in downs]
    gaps = [round(b - a, 2) for a, b in zip(stamps, stamps[1:])]
    print(f"broker stop_app/start_app at {at:.0f} relayed (outage {outage:.1f}s): all {n} "
          f"arrived {took:.1f}s after start_app, {dups} duplicates, lost_total {lost}; "
          f"{len(downs)} 'down' lines, seconds between reconnect attempts {gaps}; first/last:\n  "
          + "\n  ".join(downs[:1] + downs[-1:]))
    assert at < n
    # capped back-off: from 100 ms doubling to reconnect_max = 1 s, a few attempts, not a spin
    assert 2 <= len(downs) <= 25, "\n".join(downs)
    assert max(gaps) < 1.0 + 0.5, f"back-off exceeds reconnect_max: {gaps}"
    assert len(log_lines_at(text, r"sink=main: connected", INFO)) >= 2
    # what an operator at the default level (info) sees: the outage at WARN, each reason once
    # (the repeats at DEBUG), and the recovery at INFO counting every failed attempt
    warns = log_lines_at(text, r"sink=main: down: ")
    assert warns and len(warns) == len(set(warns)) < len(downs), \
        f"repeats of one reason must not be WARN again: {warns}"
    pending, recoveries = 0, []
    for lvl, msg in log_events(text):
        if "sink=main: down: " in msg:
            pending += 1
        elif "sink=main: connected" in msg:
            assert lvl == "INFO", (lvl, msg)
            m = re.search(RECOVERED, msg)
            assert (int(m.group(1)) if m else 0) == pending, \
                f"{pending} failures before {msg!r}"
            recoveries.append(pending)
            pending = 0
    assert max(recoveries) >= 2, f"the recovery line must count the failed attempts: {recoveries}"
    assert dups <= c.window


# ---------------------------------------------------------------------------- 5
def test_connection_blocked_pauses_publishing(services, pgdb, relay_bin, build, tmp_path,
                                              memory_alarm):
    n, keys = 2000, 20
    c = Case(services, pgdb, relay_bin, build, tmp_path, "blocked")
    r = c.start()
    try:
        r.wait_log("became the active relay")
        r.wait_log("sink=main: connected")
        assert r.metric("outbox_relay_sink_blocked") == 0
        memory_alarm.raise_()
        c.produce(n, keys, size=128, batch=500)
        wait_for(lambda: r.metric("outbox_relay_sink_blocked") == 1, 10, ignore=(OSError,),
                 desc="outbox_relay_sink_blocked 1")
        time.sleep(2.0)
        depth = queue_depth(services, c.q)
        unsent = c.db_counts()[1]
        blocked_gauge = r.metric("outbox_relay_sink_blocked")
        in_flight = r.metric("outbox_relay_in_flight")
        assert depth == 0, f"{depth} messages reached the queue while the broker was blocked"
        assert unsent == n
        assert blocked_gauge == 1
        memory_alarm.clear()
        took = c.wait_all_sent(n, timeout=30)
        text = r.text()
        blocked_after = r.metric("outbox_relay_sink_blocked")
    finally:
        try:
            memory_alarm.close()
        finally:
            stop_clean(r)
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    print(f"connection.blocked: 0 of {n} delivered while blocked (gauge 1, {in_flight:.0f} in "
          f"flight); all arrived {took:.1f}s after the alarm cleared, {dups} duplicates")
    assert log_lines_at(text, r"sink=main: broker blocked the connection"), text[-3000:]
    assert log_lines_at(text, r"sink=main: broker unblocked, publishing resumes", INFO), \
        text[-3000:]
    assert blocked_after == 0
    assert dups == 0


# ---------------------------------------------------------------------------- 6
def overtakers(got, keys):
    """Rows whose first arrival came before that of an earlier row of their key."""
    firsts, seen = {}, set()
    for props, _, _ in got:
        seq = int(props.headers["seq"])
        if seq not in seen:
            seen.add(seq)
            firsts.setdefault(seq % keys, []).append(seq)
    n = 0
    for order in firsts.values():
        low = None
        for seq in reversed(order):
            if low is not None and seq > low:
                n += 1
            low = seq if low is None or seq < low else low
    return n


@pytest.mark.parametrize("ordering", ["strict", "pipelined"])
def test_nacks_from_full_queue_are_retried(services, pgdb, relay_bin, build, tmp_path, ordering):
    """A reject-publish queue refuses some messages and accepts later ones as it frees space:
    the one case pipelining cannot make safe by itself. ordering=strict keeps per-key order;
    pipelined must count (and log) every row that overtook an earlier refused row of its key."""
    n, keys = 1500, 50
    c = Case(services, pgdb, relay_bin, build, tmp_path, "nack", max_attempts="1000",
             ordering=ordering, retry_backoff="200ms", retry_backoff_max="1s",
             qargs={"x-max-length": 100, "x-overflow": "reject-publish"})
    c.produce(n, keys, size=64, batch=500)
    r = c.start()
    got = []
    conn, ch = amqp_channel(services)
    try:
        r.wait_log("became the active relay")
        deadline = time.monotonic() + 50
        # a slow, bursty consumer: 100 messages every 0.4 s, so that some retries (200 ms
        # later) find the queue still full and back off further (the relay refills it within
        # milliseconds of a burst)
        while len(got) < n and time.monotonic() < deadline:
            for _ in range(100):
                method, props, body = ch.basic_get(c.q, auto_ack=True)
                if method is None:
                    break
                got.append((props, body, time.monotonic()))
            time.sleep(0.4)
        took_consume = len(got)
        c.wait_all_sent(n, timeout=10)
        time.sleep(0.5)
        while True:   # anything left (duplicates)
            method, props, body = ch.basic_get(c.q, auto_ack=True)
            if method is None:
                break
            got.append((props, body, time.monotonic()))
        nacked = r.metric("outbox_relay_nacked_total")
        dead = r.metric("outbox_relay_dead_total")
        overtaken = r.metric("outbox_relay_overtaken_total")
        text = r.text()
    finally:
        conn.close()
        stop_clean(r)
    check_against_db(got, pgdb)
    if ordering == "strict":
        dups, _ = delivery_report(got, n, keys)
        assert overtaken == 0
    else:
        seen = overtakers(got, keys)
        print(f"pipelined: {seen} rows overtook an earlier refused row of their key; the relay "
              f"counted {overtaken:.0f}")
        assert seen <= overtaken, "an overtaking was not counted"
        if seen:
            assert log_lines_at(text, r"partition_key=\S+: id=\d+ (was accepted|may have "
                                      r"reached)"), "overtaking must be logged at WARN"
        dups, _ = order_report(got, range(n), lambda s: None)   # lost 0, one message_id each
    retries = [re.search(r"attempt (\d+)/1000 failed: [^;]*; retry in (\d+) ms", m).groups()
               for m in log_lines_at(text, r"attempt \d+/1000 failed: [^;]*; retry in \d+ ms")]
    max_attempt = max((int(a) for a, _ in retries), default=0)
    backoffs = sorted({int(b) for _, b in retries})
    print(f"nacks: {took_consume}/{n} consumed in bursts, nacked_total {nacked:.0f}, dead "
          f"{dead:.0f}, highest attempt {max_attempt}, back-offs seen {backoffs} ms, "
          f"{dups} duplicates")
    assert nacked > 0
    assert dead == 0
    assert retries and min(backoffs) == 200 and max(backoffs) <= 1000
    assert max_attempt >= 2, "some rows should have been nacked more than once"
    assert dups <= c.window


# ---------------------------------------------------------------------------- 7
def test_poison_row_does_not_spin(services, pgdb, relay_bin, build, tmp_path):
    c = Case(services, pgdb, relay_bin, build, tmp_path, "poison", max_attempts="1000",
             retry_backoff="200ms", retry_backoff_max="1s")
    missing = f"missing-{c.q}"
    # seq 0: key-0, to an exchange that does not exist (the broker closes the channel: 404)
    c.produce(1, 1, exchange=missing, routing_key="nowhere", prefix="bad", start=0)
    r = c.start()
    conn, ch = amqp_channel(services)
    try:
        wait_log_at(r, r"id=1 message_id=\S+: attempt 1/1000 failed")
        # other keys: seq 1..300 over key-0..key-9; key-0 ones wait behind the poison row
        c.produce(300, 10, start=1)
        want = [s for s in range(1, 301) if s % 10 != 0]
        got = consume(ch, c.q, len(want), timeout=30, idle=0.5)
        seqs = sorted(int(p.headers["seq"]) for p, _, _ in got)
        # every other-key row arrived, in id order within EVERY key (first arrivals), and
        # none of key-0 (held behind the poison row)
        order_report(got, want, lambda s: s % 10)
        # now only the poison row is left retrying: measure the relay over 5 s
        pid = r.proc.pid

        def poison_attempts():
            # the row's own attempt count: whether the broker closed a channel (rejected) or
            # the sink found the exchange missing before publishing (refused), it is counted
            return int(c.pgdb.psql("select attempts from outbox.messages where id = 1",
                                   args=["-At"]).stdout.strip())
        att0 = poison_attempts()
        cpu0, t0 = proc_cpu_seconds(pid), time.monotonic()
        time.sleep(5.0)
        cpu = proc_cpu_seconds(pid) - cpu0
        wall = time.monotonic() - t0
        attempts_5s = poison_attempts() - att0
        row = c.pgdb.psql("select attempts, left(coalesce(last_error, ''), 120) "
                          "from outbox.messages where id = 1", args=["-At"]).stdout.strip()
        held = consume(ch, c.q, 1, timeout=0.5)
    finally:
        conn.close()
        stop_clean(r)
    print(f"poison row: relay CPU {cpu:.3f}s over {wall:.1f}s wall, {attempts_5s:.0f} attempts "
          f"in that window; row (attempts|last_error): {row}; "
          f"{len(set(seqs))} other-key rows delivered, key-0 rows held back")
    assert cpu < 0.5, f"relay used {cpu:.2f}s CPU in {wall:.1f}s with one poison row"
    assert 2 <= attempts_5s <= 15, "the poison row should be retried with capped back-off"
    assert held == [], "key-0 rows must wait behind the failing row"
    assert not any(s % 10 == 0 for s in seqs)


# ---------------------------------------------------------------------------- 8
# (memory: tests/test_drain_order.py::test_memory_bounded_by_in_flight measures growth per row
# drained over 20k -> 220k rows; the old 50k-row "peak < 40 MB" check here could not see it)


# ---------------------------------------------------------------------------- 9
def test_kill9_mid_drain_and_restart(services, pgdb, relay_bin, build, tmp_path):
    n, keys = 20000, 100
    c = Case(services, pgdb, relay_bin, build, tmp_path, "kill9", lease="5s")
    c.produce(n, keys, size=256, batch=1000)
    r = c.start()
    try:
        r.wait_log("became the active relay")
        wait_relayed(r, 6000)
    finally:
        r.kill9()
    sent_at_kill = c.db_counts()
    leased = c.pgdb.psql("select count(*) from outbox.messages where lease_token is not null "
                         "and sent_at is null", args=["-At"]).stdout.strip()
    t0 = time.monotonic()
    r2 = c.start()
    try:
        r2.wait_log("became the active relay")
        c.wait_all_sent(n)
        took = time.monotonic() - t0
    finally:
        stop_clean(r2)
    got = c.collect()
    dups, copies = delivery_report(got, n, keys)
    print(f"kill -9 with {sent_at_kill[0] - sent_at_kill[1]} of {n} marked sent and {leased} rows "
          f"leased: the restarted relay finished in {took:.1f}s; {dups} duplicates (bound "
          f"2 x window {c.window} x 1 fault), all with their original message_id")
    assert sent_at_kill[1] > 0, "kill should happen mid-drain"
    # in flight + confirmed but unmarked stay within 2 x publish_window (drain.c pump);
    # rows claimed and buffered but never published are no duplicates
    assert dups <= 2 * c.window, f"{dups} duplicates > 2 x window {c.window} x 1 fault"



# ---------------------------------------------------------------------------- 9b
def test_stalled_marks_bound_what_is_republished(services, pgdb, relay_bin, build, tmp_path):
    """Marks that cannot commit (a trigger on the mark waits for a lock the test holds): the
    relay goes on publishing while confirmed rows wait for their mark (publish_window counts
    the messages in flight only), and stops once in flight + confirmed unmarked reach
    2 x publish_window. After kill -9 the next relay publishes exactly those again: the
    duplicates of the fault stay within 2 x publish_window."""
    n, keys, window = 1000, 10, 50
    c = Case(services, pgdb, relay_bin, build, tmp_path, "stallmark", lease="3s",
             sink={"publish_window": str(window)})
    pgdb.psql("create function outbox.hold_mark() returns trigger language plpgsql as "
              "$$begin perform pg_advisory_xact_lock(4242); return new; end$$; "
              "create trigger hold_mark before update on outbox.messages for each row "
              "when (old.sent_at is null and new.sent_at is not null) "
              "execute function outbox.hold_mark()")
    holder = psycopg.connect(pgdb.dsn, autocommit=True)
    holder.execute("select pg_advisory_lock(4242)")
    c.produce(n, keys, size=64, batch=500)
    r = c.start()
    try:
        r.wait_log("became the active relay")
        wait_for(lambda: queue_depth(services, c.q) >= 2 * window, 20, interval=0.05,
                 desc=f"{2 * window} messages published while the marks wait")
        time.sleep(1.0)   # time to publish more, were it allowed
        depth = queue_depth(services, c.q)
        in_flight = r.metric("outbox_relay_in_flight")
        unmarked = r.metric("outbox_relay_confirmed_unmarked")
    finally:
        r.kill9()
    # the killed relay's sessions go too (a crash takes its connections along), before the
    # held mark may run
    wait_for(lambda: terminate_relay_backends(services, pgdb.name) == 0
             and relay_backends(services, pgdb.name) == 0, 10, desc="the relay's sessions gone")
    holder.close()
    _, unsent = c.db_counts()
    r2 = c.start()
    try:
        c.wait_all_sent(n)
    finally:
        stop_clean(r2)
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    print(f"marks held: {depth} messages published ({in_flight:.0f} in flight, {unmarked:.0f} "
          f"confirmed awaiting their mark), window {window}; {unsent} rows unsent at the kill; "
          f"{dups} duplicates after kill -9")
    assert depth == 2 * window, f"{depth} published while the marks waited, bound 2 x {window}"
    assert in_flight == 0 and unmarked == 2 * window
    assert unsent == n, "no mark may have committed"
    assert dups == 2 * window

# ---------------------------------------------------------------------------- 5b
def test_blocked_longer_than_confirm_timeout(services, pgdb, relay_bin, build, tmp_path,
                                             memory_alarm):
    """A block outlasting confirm_timeout: messages the broker took before blocking stay
    unconfirmed while blocked; the relay should wait (paused), not tear the connection down
    every confirm_timeout and republish."""
    n, keys = 500, 20
    c = Case(services, pgdb, relay_bin, build, tmp_path, "blocklong",
             sink={"confirm_timeout": "3s"})   # > the time a loaded broker takes to say blocked
    r = c.start()
    try:
        r.wait_log("became the active relay")
        r.wait_log("sink=main: connected")
        memory_alarm.raise_()
        c.produce(n, keys, size=128, batch=500)
        wait_for(lambda: r.metric("outbox_relay_sink_blocked") == 1, 10, ignore=(OSError,),
                 desc="outbox_relay_sink_blocked 1")
        in_flight = r.metric("outbox_relay_in_flight")
        time.sleep(7.5)   # 2.5 x confirm_timeout
        blocked_gauge = r.metric("outbox_relay_sink_blocked")
        memory_alarm.clear()
        took = c.wait_all_sent(n, timeout=30)
        text = r.text()
        lost = r.metric("outbox_relay_retried_unconfirmed_total")
    finally:
        try:
            memory_alarm.close()
        finally:
            stop_clean(r)
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    downs = re.findall(r"^.*sink=main: down: .*$", text, re.M)
    print(f"blocked 7.5 s with confirm_timeout 3s: {in_flight:.0f} in flight at the block, gauge "
          f"after 7.5 s {blocked_gauge:.0f}, lost_total {lost:.0f}, {len(downs)} reconnects, all "
          f"arrived {took:.1f}s after the alarm cleared, {dups} duplicates"
          + ("".join("\n  " + d for d in downs[:3])))
    assert downs == [], "the relay tore down a blocked connection"
    assert blocked_gauge == 1
    assert dups == 0


# ---------------------------------------------------------------------------- 1b
def test_notify_wakeups_after_db_reconnect(services, pgdb, relay_bin, build, tmp_path):
    """After its sessions were terminated the relay must LISTEN again. The poll alone would
    deliver too (it backs off from 50 ms after each claim that found rows, up to
    poll_interval), so the test waits until the poll has backed off to gaps of >= 1.5 s
    between claims (claims_total: the 1.6 s one), writes the rows right after a poll's
    claim, and requires them delivered before half the poll's next gap (which doubles): only
    a NOTIFY wakes the relay that early."""
    from relay_util import insert_rows
    c = Case(services, pgdb, relay_bin, build, tmp_path, "relisten", poll_interval="30s",
             reconnect_max="1s")
    r = c.start()
    conn, ch = amqp_channel(services)
    seen = []

    def claims():
        return r.metric("outbox_relay_claims_total")

    def after_a_long_gap(min_gap=1.5, timeout=40):
        """Waits for a claim that came >= min_gap after the one before it (a poll that has
        backed off); returns (its time, that gap)."""
        deadline = time.monotonic() + timeout
        last_n, last_t = claims(), time.monotonic()
        while time.monotonic() < deadline:
            n = claims()
            now = time.monotonic()
            if n != last_n:
                gap = now - last_t
                last_n, last_t = n, now
                if gap >= min_gap:
                    return now, gap
            time.sleep(0.01)
        raise AssertionError(f"the poll never backed off to {min_gap} s gaps")

    try:
        r.wait_log("became the active relay")
        for i in range(2):
            assert terminate_relay_backends(services, pgdb.name) >= 1
            # leadership is a lease row and survives the sessions: wait for the reconnect
            wait_log_at(r, r"database unavailable \(main connection\)", count=i + 1)
            wait_log_at(r, r"database connected", INFO, count=i + 2)
            # one row first, so the poll restarts at 50 ms and backs off from there (seconds,
            # not poll_interval's 30 s)
            insert_rows(pgdb, 1, 0, start=100 + i, routing_key=c.q)
            assert len(consume(ch, c.q, 1, timeout=40)) == 1
            t_claim, gap = after_a_long_gap()
            insert_rows(pgdb, 10, 2, start=10 * i, routing_key=c.q)   # commits: NOTIFY
            got = consume(ch, c.q, 10, timeout=2 * gap + 5)
            assert len(got) == 10, f"round {i}: {len(got)} of 10 arrived"
            arrived = got[-1][2] - t_claim
            seen.append((round(gap, 2), round(arrived, 2)))
            delivery_report(got, 10, 2, start=10 * i)
            check_against_db(got, pgdb)
            assert arrived < gap, (
                f"round {i}: rows written right after a poll arrived {arrived:.2f} s after it, "
                f"not before the poll's next gap ({2 * gap:.1f} s; the last was {gap:.1f} s): "
                "the wake-up came from polling, not NOTIFY (LISTEN lost on reconnect)")
    finally:
        conn.close()
        stop_clean(r)
    print(f"NOTIFY after reconnect: (poll gap before the write, s; claim -> all arrived, s): "
          f"{seen}")


# ---------------------------------------------------------------------------- 3b
def test_broker_half_open_connection_mid_drain(services, pgdb, relay_bin, build, tmp_path):
    """The broker connection goes silent (no FIN/RST, like a partition or a dead NAT entry):
    heartbeat/confirm_timeout must detect it and the relay reconnect."""
    n, keys = 20000, 100
    proxy = BlackholeProxy(services.amqp_port)
    r = None
    try:
        c = Case(services, pgdb, relay_bin, build, tmp_path, "amqphalf", reconnect_max="1s",
                 sink={"url": f"amqp://guest:guest@127.0.0.1:{proxy.port}/%2f",
                       "heartbeat": "2s", "confirm_timeout": "2s"})
        c.produce(n, keys, size=256, batch=1000)
        r = c.start()
        r.wait_log("became the active relay")
        wait_relayed(r, 5000)
        at = relayed(r)
        frozen = proxy.blackhole()
        t0 = time.monotonic()
        down = wait_log_at(r, r"sink=main: down: ", timeout=15)
        detect = time.monotonic() - t0
        took = c.wait_all_sent(n)
        text = r.text()
    finally:
        try:
            if r is not None:
                stop_clean(r)
        finally:
            proxy.close()
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    print(f"broker connection silenced at {at:.0f} relayed ({frozen} connection(s)): detected "
          f"after {detect:.1f}s ({down!r}); all {n} arrived {took:.1f}s later, {dups} duplicates")
    assert at < n and detect < 6
    assert recovery_counts(text, r"sink=main: connected"), \
        "the reconnect must say after how many failures: " + text[-3000:]
    assert dups <= c.window


# ---------------------------------------------------------------------------- 2b
def test_db_half_open_connections_mid_drain(services, pgdb, relay_bin, build, tmp_path):
    """The database connections go silent mid-drain (no FIN/RST): query_timeout must detect
    it, the relay reconnect and finish the drain."""
    n, keys = 20000, 100
    proxy = BlackholeProxy(services.pg_port)
    r = None
    try:
        conninfo = (f"host=127.0.0.1 port={proxy.port} user={services.pg_user} "
                    f"dbname={pgdb.name}")
        c = Case(services, pgdb, relay_bin, build, tmp_path, "pghalf", reconnect_max="1s",
                 conninfo=conninfo, query_timeout="2s", connect_timeout="2s")
        c.produce(n, keys, size=256, batch=1000)
        r = c.start()
        r.wait_log("became the active relay")
        wait_relayed(r, 5000)
        at = relayed(r)
        frozen = proxy.blackhole()
        t0 = time.monotonic()
        down = wait_log_at(r, r"database unavailable", timeout=15)
        detect = time.monotonic() - t0
        # the old session still exists on the server (it never saw a FIN) and holds the
        # leader lock: the relay has to get rid of it to lead again
        try:
            wait_log_at(r, r"became the active relay", INFO, timeout=20, count=2)
        except AssertionError:
            with services.pg_connect() as adm:
                holders = adm.execute(
                    "select a.pid, a.state, now() - a.state_change, a.backend_start "
                    "from pg_locks l join pg_stat_activity a using (pid) where "
                    "l.locktype = 'advisory' and l.granted and a.datname = %s",
                    (pgdb.name,)).fetchall()
                sessions = adm.execute("select count(*) from pg_stat_activity where "
                                       "application_name = 'outbox-relay' and datname = %s",
                                       (pgdb.name,)).fetchone()[0]
            print(f"advisory lock holders (pid, state, idle for, started): {holders}; "
                  f"{sessions} relay sessions on the server for one relay process")
            raise
        took = c.wait_all_sent(n, timeout=30)
        text = r.text()
    finally:
        try:
            if r is not None:
                print("relay log tail:\n" + r.text()[-1500:])
                stop_clean(r)
        finally:
            proxy.close()
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    print(f"database connections silenced at {at:.0f} relayed ({frozen} connection(s)): "
          f"detected after {detect:.1f}s ({down!r}); all {n} arrived {took:.1f}s later, "
          f"{dups} duplicates")
    assert at < n and detect < 8
    assert recovery_counts(text, r"database connected"), \
        "the reconnect must say after how many failures: " + text[-3000:]
    assert dups <= 2 * c.window   # confirmed rows whose lease ran out before their mark: twice
