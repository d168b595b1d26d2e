"""`outbox-relay run` with `source = sqlserver`, end to end on a T-SQL engine: liboutbox's
ODBC T-SQL path (examples/producer --odbc, transactions of several messages over several
partition keys) -> the relay -> RabbitMQ, with the oracle of the PostgreSQL end-to-end tests
(tests/test_relay.py, test_relay_faults.py, test_relay_multi.py): nothing lost, per-key order
of first arrivals, every copy with one message_id, duplicates within the bound the test set
(none without a fault, 2 x publish_window per relay killed or frozen), and every body and
property checked against the row in the database.

The engine is conftest.tsql_target's: a real SQL Server when OUTBOX_TEST_MSSQL names one,
otherwise the harness's Babelfish (PostgreSQL speaking T-SQL over TDS, through FreeTDS's
ODBC driver). Each test gets a fresh schema and table, created by `outbox-relay init`, and
drops them afterwards. Python has no T-SQL client here: the tests read the database through
build/tests/odbc_sql (relay_util.OdbcSql), the same ODBC driver the relay uses.

Where Babelfish differs from SQL Server, the test that accommodates it says so:
- Babelfish parses table hints (READPAST, UPDLOCK, ROWLOCK, NOLOCK, READCOMMITTEDLOCK) and
  ignores them, and reads are PostgreSQL snapshots: what SQL Server's locking does (claims
  skipping each other's locked rows, blocking, deadlocks, lock escalation) cannot happen
  there. These tests check the outcome (each key held by one relay, each row marked once);
  the locking itself is covered by tests/test_tsql_capture.py's checks of every statement.
- The sampler below reads the outbox while relays claim and settle: on Babelfish one
  statement is one snapshot; on SQL Server (READ_COMMITTED_SNAPSHOT off by default) a plain
  read is not, so there it reads under SNAPSHOT isolation, which the test turns on.
"""
import os
import re
import secrets
import signal
import subprocess
import threading
import time
import uuid

import pytest

from conftest import tsql_target, wait_for
from relay_util import (OdbcSql, Relay, amqp_channel, consume, declare, delivery_report,
                        expected_payload, free_port, order_report, queue_depth, run_producer,
                        wait_log_at, write_config)

LEASE = 5.0          # seconds: a frozen relay is replaced within LEASE + 2 x POLL + 1
POLL = 1.0
WINDOW = 50          # publish_window: the duplicate bound is 2 x WINDOW per fault
BATCH = 100          # batch_size of a claim


class TsqlOutbox:
    """A fresh outbox table [e2e_<hex>].[messages] on the T-SQL engine (created by
    `outbox-relay init` through the first config written for it). Attributes: conn (the
    ODBC connection string), engine ("sqlserver" or "babelfish"), name (DB_NAME(), the
    relay's `database`), table, qt (quoted), sql (an OdbcSql session). `dsn` and `name` let
    relay_util.write_config take it as its db."""

    def __init__(self, build, conn, engine):
        self.build, self.conn, self.engine = build, conn, engine
        self.dsn = conn
        self.sql = OdbcSql(build, conn)
        self.name = self.sql.value("SELECT DB_NAME()")
        assert self.name, "cannot read DB_NAME()"
        self.schema = "e2e_" + secrets.token_hex(4)
        self.table = f"{self.schema}.messages"
        self.qt = f"[{self.schema}].[messages]"

    def q(self, name):
        """[schema].[name] for another object of this test."""
        return f"[{self.schema}].[{name}]"

    def produce(self, count, keys, routing_key, *, start=0, size=64, batch=50, exchange=""):
        """liboutbox's T-SQL path: `count` messages in transactions of `batch`."""
        return run_producer(self.build, self.conn, self.name, count=count, keys=keys,
                            exchange=exchange, routing_key=routing_key, size=size,
                            batch=batch, start=start, odbc=True, table=self.table)

    def counts(self):
        """(rows, unsent rows) of the outbox."""
        n, unsent = self.sql.rows(f"SELECT COUNT(*), SUM(CASE WHEN sent_at IS NULL THEN 1 "
                                  f"ELSE 0 END) FROM {self.qt}")[0]
        return int(n), int(unsent or 0)

    def wait_all_sent(self, total, timeout=60):
        wait_for(lambda: self.counts() == (total, 0), timeout, interval=0.2,
                 desc=f"all {total} rows marked sent")

    def drop(self):
        for obj in ("messages", "messages_dead", "messages_lease", "mark_audit"):
            self.sql.run(f"DROP TABLE IF EXISTS {self.q(obj)}")
        self.sql.run(f"DROP SCHEMA IF EXISTS [{self.schema}]")
        self.sql.close()


pytestmark = pytest.mark.tsql


@pytest.fixture
def tsql(services, build):
    t = TsqlOutbox(build, *tsql_target(services))
    try:
        yield t
    finally:
        t.drop()


def cli(relay_bin, *args, timeout=60):
    return subprocess.run([str(relay_bin), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def make_relay(relay_bin, tmp_path, services, t, name, *, window=WINDOW, **ob):
    """start() -> a new relay process on t's outbox (`source = sqlserver`; its log NAME-N.log
    for the Nth start), and the config path."""
    port = free_port()
    keys = {"source": "sqlserver", "conninfo": t.conn, "database": t.name, "table": t.table,
            "poll_interval": f"{POLL:g}s", "batch_size": str(BATCH), "lease": f"{LEASE:g}s"}
    keys.update(ob)
    cfg = write_config(tmp_path / f"{name}.ini", services, t,
                       relay={"name": name, "http_listen": f"127.0.0.1:{port}"},
                       sink={"publish_window": str(window)}, **keys)
    starts = []

    def start():
        starts.append(1)
        return Relay(relay_bin, cfg, tmp_path / f"{name}-{len(starts)}.log", http_port=port)
    return start, cfg


def init_outbox(relay_bin, cfg):
    p = cli(relay_bin, "init", "-c", cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def new_queue(services, tag):
    q = f"qs-{tag}-{uuid.uuid4().hex[:8]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    return q, conn, ch


def relayed(r):
    try:
        return r.metric("outbox_relay_relayed_total") or 0
    except OSError:
        return 0


def stop_all(*relays):
    """SIGTERM every relay still running; each must exit 0 (no sanitizer report)."""
    errors = []
    for r in relays:
        if r is not None and r.proc.poll() is None:
            rc = r.stop()
            try:
                r.assert_clean_exit(rc)
            except AssertionError as e:
                errors.append(f"{r.log_path}: {e}")
    assert not errors, "\n".join(errors)


def audit_setup(t):
    """An AFTER UPDATE trigger recording each mark (sent_at set) with the lease owner the row
    carried and whether that lease was live, in database time: no relay may mark a row it
    does not hold, and every row is marked exactly once. (A trigger on the outbox is also
    what an application's audit or replication adds: on SQL Server, OUTPUT without INTO
    fails on such a table, Msg 334, so the relay's claims must not use it.)"""
    t.sql.rows(f"CREATE TABLE {t.q('mark_audit')} (id bigint NOT NULL, owner nvarchar(255) NULL, "
               f"lease_live int NOT NULL, at datetime2 NOT NULL DEFAULT SYSUTCDATETIME())")
    t.sql.rows(f"""CREATE TRIGGER {t.q('mark_audit_trg')} ON {t.qt} AFTER UPDATE AS
BEGIN
    SET NOCOUNT ON;
    INSERT INTO {t.q('mark_audit')} (id, owner, lease_live)
    SELECT d.id, d.lease_owner,
           CASE WHEN d.lease_until >= SYSUTCDATETIME() THEN 1 ELSE 0 END
    FROM deleted d JOIN inserted i ON i.id = d.id
    WHERE d.sent_at IS NULL AND i.sent_at IS NOT NULL;
END""")


def audit_marks(t):
    """[(id, owner, lease_live, seconds since 1970 of the mark)]."""
    # milliseconds as a bigint, divided here: a numeric column computed from a datetime2
    # column broke the FreeTDS session on Babelfish ("Unknown error")
    return [(int(i), o, int(live), int(ms) / 1000.0) for i, o, live, ms in t.sql.rows(
        f"SELECT id, owner, lease_live, DATEDIFF_BIG(millisecond, '1970-01-01', at) "
        f"FROM {t.q('mark_audit')}")]


def db_now(t):
    """The database's clock (UTC), seconds since 1970."""
    return int(t.sql.value("SELECT DATEDIFF_BIG(millisecond, '1970-01-01', SYSUTCDATETIME())")) \
        / 1000.0


class KeyHolderSampler:
    """Reads, every few milliseconds on its own session, which partition keys have unsettled
    rows under a live lease of more than one owner — the competing-mode rule: at any moment
    one relay holds the unsettled rows of a key. .violations collects what was seen,
    .samples counts the reads."""

    def __init__(self, t):
        self.sql = OdbcSql(t.build, t.conn)
        # Babelfish: a statement reads one snapshot (PostgreSQL's READ COMMITTED), so the
        # plain read below sees one moment. SQL Server (READ_COMMITTED_SNAPSHOT off) reads
        # under shared locks row by row, which could pair a row read before a settle with
        # one read after the next claim: read under SNAPSHOT isolation there instead.
        prefix = ""
        if t.engine == "sqlserver":
            self.sql.rows("ALTER DATABASE CURRENT SET ALLOW_SNAPSHOT_ISOLATION ON")
            prefix = "SET TRANSACTION ISOLATION LEVEL SNAPSHOT; "
        self.query = (f"{prefix}SELECT partition_key, COUNT(DISTINCT lease_owner) "
                      f"FROM {t.qt} WHERE sent_at IS NULL AND lease_owner IS NOT NULL "
                      f"AND lease_until > SYSUTCDATETIME() GROUP BY partition_key "
                      f"HAVING COUNT(DISTINCT lease_owner) > 1")
        self.samples = 0
        self.violations = []
        self.errors = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            ok, rows, err = self.sql.run(self.query)
            if not ok:
                self.errors.append(err)
                if len(self.errors) > 20:
                    return
            else:
                self.samples += 1
                self.violations += rows
            self._stop.wait(0.01)

    def stop(self):
        self._stop.set()
        self._thread.join(60)
        self.sql.close()


def check_bodies_and_rows(t, got, size, *, n_rows):
    """Every delivery's body and properties are the producer's, and match its row: the
    message_id, the AMQP timestamp (the row's created_at, whole seconds since 1970, UTC),
    and the row is marked sent. Returns the rows {seq: (message_id, created_s, sent)}."""
    rows = t.sql.rows(
        f"SELECT LOWER(CONVERT(varchar(36), message_id)), JSON_VALUE(headers, '$.seq'), "
        f"CASE WHEN sent_at IS NULL THEN 0 ELSE 1 END, "
        f"DATEDIFF_BIG(second, '1970-01-01', created_at), DATALENGTH(payload), payload "
        f"FROM {t.qt}")
    assert len(rows) == n_rows, f"{len(rows)} rows in the outbox, expected {n_rows}"
    by_seq = {}
    for mid, seq, sent, created, length, payload in rows:
        by_seq[int(seq)] = (mid, int(created), int(sent))
        assert int(length) == len(payload) == size and \
            payload == expected_payload("msg", int(seq), size), \
            f"seq {seq}: the row holds {length} bytes, not the producer's {size}: {payload[:40]!r}"
    unsent = [s for s, (_, _, sent) in by_seq.items() if not sent]
    assert not unsent, f"{len(unsent)} rows not marked sent, e.g. {sorted(unsent)[:10]}"
    for props, body, _ in got:
        seq = int(props.headers["seq"])
        assert body == expected_payload("msg", seq, size), f"seq {seq}: body {body[:40]!r}"
        assert props.correlation_id == f"corr-{seq}"
        assert props.type == "test.event"
        assert props.content_type == "application/octet-stream"
        assert props.delivery_mode == 2
        assert props.headers == {"seq": str(seq), "origin": "producer"}
        mid, created, _ = by_seq[seq]
        assert props.message_id == mid, f"seq {seq}: message_id {props.message_id} != row {mid}"
        assert props.timestamp == created, \
            f"seq {seq}: timestamp {props.timestamp} != the row's created_at {created}"
    return by_seq


def parse_stats(text):
    """`stats` output -> {outbox: (backlog, oldest_s, dead, sent_kept)}."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert lines and lines[0].split() == ["OUTBOX", "TABLE", "BACKLOG", "OLDEST_PENDING_S",
                                          "DEAD", "SENT_KEPT"], text
    out = {}
    for ln in lines[1:]:
        f = ln.split()
        out[f[0]] = (int(f[2]), float(f[3]), int(f[4]), int(f[5]))
    return out


def dead_rows(text):
    """`dead list` output -> {id: [id, message_id, exchange, routing_key, attempts, dead_at,
    reason]}."""
    out = {}
    for ln in text.splitlines():
        if ln.startswith("# outbox.") or not ln.strip():
            continue
        f = ln.split("\t")
        assert len(f) == 7, f"expected 7 tab-separated fields: {ln!r}"
        out[int(f[0])] = f
    return out


# ---------------------------------------------------------------------------- 1. plain drain
def test_sqlserver_drain(services, tsql, relay_bin, build, tmp_path):
    """600 messages over 10 keys, written through liboutbox's T-SQL path in transactions of
    25 while the relay runs: each arrives once, in order per key, with the row's body,
    message_id and timestamp, and every row is marked sent. `init` run again on the live
    table changes nothing."""
    n, keys, size = 600, 10, 200
    q, conn, ch = new_queue(services, "drain")
    start, cfg = make_relay(relay_bin, tmp_path, services, tsql, "sd")
    init_outbox(relay_bin, cfg)
    r = start()
    try:
        r.wait_log("became the active relay", timeout=30)
        t0 = time.monotonic()
        tsql.produce(n, keys, q, size=size, batch=25)
        t_prod = time.monotonic() - t0
        init_outbox(relay_bin, cfg)      # again, on the table in use: succeeds, breaks nothing
        got = consume(ch, q, n, timeout=60, idle=1.0)
        took = time.monotonic() - t0
        tsql.wait_all_sent(n, timeout=30)
    finally:
        stop_all(r)
        conn.close()
    dups, _ = delivery_report(got, n, keys)      # lost 0, per-key order, one message_id
    check_bodies_and_rows(tsql, got, size, n_rows=n)
    print(f"{tsql.engine}: {n} messages produced in {t_prod:.1f} s (liboutbox T-SQL), all "
          f"delivered {took:.1f} s after the first commit; {dups} duplicates")
    assert dups == 0, f"{dups} duplicates without any fault"


# ---------------------------------------------------------------------------- 2. kill -9
def test_sqlserver_kill9_mid_drain(services, tsql, relay_bin, build, tmp_path):
    """kill -9 of the relay mid-drain, then a new relay finishes: nothing lost, per-key order
    of first arrivals, every copy with its original message_id, and duplicates (rows in
    flight or confirmed but not yet marked at the kill) within 2 x publish_window."""
    n, keys, size = 800, 10, 64
    q, conn, ch = new_queue(services, "kill9")
    conn.close()
    start, cfg = make_relay(relay_bin, tmp_path, services, tsql, "sk")
    init_outbox(relay_bin, cfg)
    tsql.produce(n, keys, q, size=size, batch=100)
    r = start()
    r2 = None
    try:
        wait_for(lambda: relayed(r) >= 200, 60, interval=0.01,
                 desc="200 messages relayed before the kill")
    finally:
        r.kill9()
    total, unsent = tsql.counts()
    leased = int(tsql.sql.value(f"SELECT COUNT(*) FROM {tsql.qt} WHERE lease_token IS NOT NULL "
                                f"AND sent_at IS NULL"))
    try:
        t0 = time.monotonic()
        r2 = start()
        tsql.wait_all_sent(n, timeout=90)
        took = time.monotonic() - t0
    finally:
        stop_all(r2)
    depth = queue_depth(services, q)
    conn, ch = amqp_channel(services)
    got = consume(ch, q, depth, timeout=60, idle=0.3)
    conn.close()
    dups, _ = delivery_report(got, n, keys)
    print(f"{tsql.engine}: kill -9 with {total - unsent} of {n} marked sent and {leased} rows "
          f"leased; the next relay finished in {took:.1f} s; {dups} duplicates (bound 2 x "
          f"window {WINDOW})")
    assert unsent > 0, "the kill should happen mid-drain"
    assert dups <= 2 * WINDOW, f"{dups} duplicates > 2 x publish_window {WINDOW} for one fault"


# ---------------------------------------------------------------------------- 3. competing
def test_sqlserver_two_competing_relays(services, tsql, relay_bin, build, tmp_path):
    """Two relays in competing mode drain one outbox: at no sampled moment do two relays
    hold live leases on unsettled rows of one key; first arrivals keep per-key order; no
    duplicates; every row marked exactly once, by the relay holding its live lease; the keys
    spread over both relays."""
    n, keys, size = 800, 20, 64
    q, conn, ch = new_queue(services, "comp")
    # a lease far longer than any claim-to-mark time here, even on a loaded machine: the
    # test is about two live relays, and a lease running out under a relay (then duplicates
    # and marks after it lapsed) is what the kill -9 and takeover tests provoke on purpose
    lease = "20s"
    start_a, cfg = make_relay(relay_bin, tmp_path, services, tsql, "ca", mode="competing",
                              lease=lease)
    start_b, _ = make_relay(relay_bin, tmp_path, services, tsql, "cb", mode="competing",
                            lease=lease)
    init_outbox(relay_bin, cfg)
    audit_setup(tsql)
    a = b = sampler = None
    try:
        a, b = start_a(), start_b()
        for r in (a, b):
            r.wait_log("database connected", timeout=30)
        sampler = KeyHolderSampler(tsql)
        tsql.produce(n, keys, q, size=size, batch=50)
        got = consume(ch, q, n, timeout=90, idle=1.0)
        tsql.wait_all_sent(n, timeout=30)
        counts = [relayed(a), relayed(b)]
    finally:
        if sampler is not None:
            sampler.stop()
        stop_all(a, b)
        conn.close()
    marks = audit_marks(tsql)
    print(f"{tsql.engine}: competing x2, {keys} keys: relayed {counts}; the key-holder "
          f"sampler read {sampler.samples} times, {len(sampler.violations)} keys seen held by "
          f"two relays; {len(marks)} marks")
    assert not sampler.errors, f"the sampler's reads failed: {sampler.errors[:3]}"
    assert sampler.samples >= 10, "the sampler hardly read anything: the check proves nothing"
    assert sampler.violations == [], \
        f"keys held by two relays at once (key, owners): {sampler.violations[:8]}"
    dups, _ = delivery_report(got, n, keys)
    assert dups == 0, f"{dups} duplicates without any fault"
    ids = [m[0] for m in marks]
    assert len(ids) == len(set(ids)) == n, \
        f"every row marked exactly once: {len(ids)} marks, {len(set(ids))} rows of {n}"
    stale = [m for m in marks if m[2] != 1]
    assert stale == [], f"rows marked by a relay whose lease had lapsed: {stale[:5]}"
    owners = {(m[1] or "").split("/")[0] for m in marks}
    assert owners == {"ca", "cb"}, f"marks by owners {owners}"
    assert min(counts) >= n // 10, f"keys did not spread over the two relays: {counts}"


# ---------------------------------------------------------------------------- 4. leader takeover
def test_sqlserver_leader_takeover(services, tsql, relay_bin, build, tmp_path):
    """Two relays in leader mode: one drains, the other stands by. The leader is frozen
    (SIGSTOP) mid-drain past its lease: the standby takes over within lease + 2 x poll + 1 s
    and finishes; the old leader, woken, finds itself fenced (a WARN) and marks nothing
    after it woke. Nothing lost, per-key order, duplicates within 2 x publish_window."""
    n, keys, size = 800, 10, 64
    q, conn, ch = new_queue(services, "lead")
    start_a, cfg = make_relay(relay_bin, tmp_path, services, tsql, "ra")
    start_b, _ = make_relay(relay_bin, tmp_path, services, tsql, "rb")
    init_outbox(relay_bin, cfg)
    audit_setup(tsql)
    a = b = None
    try:
        a = start_a()
        a.wait_log("became the active relay", timeout=30)
        b = start_b()
        b.wait_log("standing by", timeout=30)
        tsql.produce(n, keys, q, size=size, batch=100)
        got = consume(ch, q, 200, timeout=60)
        assert len(got) >= 200, f"only {len(got)} messages before the fault"
        os.kill(a.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        b.wait_log("became the active relay", timeout=30)
        took = time.monotonic() - t0
        # frozen past its lease until the standby publishes in its place, or has nothing left
        # to publish (the leader may have published every row before it froze): waiting on
        # that, not on a fixed time; then woken, it must find itself fenced
        wait_for(lambda: relayed(b) >= WINDOW or tsql.counts()[1] == 0, 30, interval=0.05,
                 desc="the new leader publishing")
        t_wake = db_now(tsql)       # the marks' clock: the database's, not this host's
        os.kill(a.proc.pid, signal.SIGCONT)
        wait_log_at(a, "lost leadership", timeout=20)     # fenced: a WARN
        got += consume(ch, q, n - len(got), timeout=90, idle=2.0)
        tsql.wait_all_sent(n, timeout=30)
        text_b = b.text()
    finally:
        if a is not None and a.proc.poll() is None:
            os.kill(a.proc.pid, signal.SIGCONT)
        stop_all(a, b)
        conn.close()
    marks = audit_marks(tsql)
    dups, _ = delivery_report(got, n, keys)
    print(f"{tsql.engine}: standby active {took:.2f} s after the leader froze (lease {LEASE:g} "
          f"s, poll {POLL:g} s); {dups} duplicates; {len(marks)} marks")
    assert took <= LEASE + 2 * POLL + 1.0, "the standby took over too late"
    assert dups <= 2 * WINDOW, f"{dups} duplicates > 2 x publish_window {WINDOW} for one fault"
    assert "standing by" in text_b
    ids = [m[0] for m in marks]
    assert len(ids) == len(set(ids)) == n, \
        f"every row marked exactly once: {len(ids)} marks, {len(set(ids))} rows of {n}"
    late = [m for m in marks if (m[1] or "").startswith("ra/") and m[3] >= t_wake]
    assert late == [], f"the frozen leader marked rows after it woke: {late[:5]}"
    stale = [m for m in marks if m[2] != 1]
    assert stale == [], f"rows marked by a relay whose lease had lapsed: {stale[:5]}"


# ---------------------------------------------------------------------------- 5. poison rows, CLI
def test_sqlserver_rows_counting_attempts_at_the_limits(services, tsql, relay_bin, build,
                                                       tmp_path):
    """Rows written by hand with `attempts` at int's limits: one at 2147483647 that cannot be
    routed is dead-lettered at its first failure with its count at the limit (one more would
    overflow, in the relay's count or in the settle's, and a settle that fails rolls back the
    marks of every row in it, forever), one at -2147483648 is published like any other, one
    at -2147483648 that cannot be routed counts from 0 and is dead-lettered after
    max_attempts, and the other keys' rows flow and are all marked."""
    q, conn, ch = new_queue(services, "lim")
    nowhere = f"nowhere-{uuid.uuid4().hex[:8]}"
    start, cfg = make_relay(relay_bin, tmp_path, services, tsql, "lim", max_attempts="3",
                            retry_backoff="200ms", retry_backoff_max="400ms")
    init_outbox(relay_bin, cfg)
    tsql.produce(60, 4, q, start=0)
    tsql.produce(2, 4, nowhere, start=60)
    tsql.sql.run(f"UPDATE {tsql.qt} SET attempts = 2147483647 WHERE routing_key = N'{nowhere}' "
                 f"AND JSON_VALUE(headers, '$.seq') = '60'")
    tsql.sql.run(f"UPDATE {tsql.qt} SET attempts = -2147483648 WHERE routing_key = N'{nowhere}' "
                 f"AND JSON_VALUE(headers, '$.seq') = '61'")
    tsql.sql.run(f"UPDATE {tsql.qt} SET attempts = -2147483648 "
                 f"WHERE JSON_VALUE(headers, '$.seq') = '7'")
    r = start()
    try:
        got = consume(ch, q, 60, timeout=60, idle=1.0)
        tsql.wait_all_sent(60, timeout=30)
        wait_for(lambda: len(tsql.sql.rows(f"SELECT id FROM {tsql.q('messages_dead')}")) == 2,
                 30, interval=0.2, desc="both unroutable rows dead-lettered")
        dead = tsql.sql.rows(f"SELECT attempts, reason FROM {tsql.q('messages_dead')} "
                             "ORDER BY attempts")
    finally:
        stop_all(r)
        conn.close()
    assert len(got) == 60, f"got {len(got)}"
    assert [int(a) for a, _ in dead] == [3, 2147483647], dead
    assert "after 3 attempts" in dead[0][1] and "after 2147483647 attempts" in dead[1][1], dead
    assert "out of range" not in r.text() and "overflow" not in r.text(), r.text()[-3000:]


def test_sqlserver_poison_rows_and_cli(services, tsql, relay_bin, build, tmp_path):
    """Two poison rows among good ones: an unroutable message (the broker returns it:
    mandatory) and a row whose headers are a nested JSON object (never publishable). Both
    are dead-lettered with their reason while every other row flows, each key's later rows
    after its poison row. Then the commands on the T-SQL engine: `check`, `stats`,
    `dead list`, `dead retry` (the unroutable one, once a queue exists for it: delivered
    with its message_id) and `dead purge`."""
    keys = 5
    q, conn, ch = new_queue(services, "poison")
    nowhere = f"nowhere-{uuid.uuid4().hex[:8]}"
    start, cfg = make_relay(relay_bin, tmp_path, services, tsql, "sp", max_attempts="2",
                            retry_backoff="200ms", retry_backoff_max="400ms")
    init_outbox(relay_bin, cfg)

    p = cli(relay_bin, "check", "-c", cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(rf"OK .*\[outbox\.main\] mode leader .*{re.escape(tsql.table)}_lease",
                     p.stdout), p.stdout

    # seq 0..99 good; 100 (key-0) unroutable; 101 (key-1) nested headers; 102..199 good
    tsql.produce(100, keys, q, start=0)
    tsql.produce(1, keys, nowhere, start=100)
    tsql.sql.rows(f"INSERT INTO {tsql.qt} (routing_key, partition_key, message_type, "
                  f"correlation_id, headers, payload) VALUES (N'{q}', N'key-1', N'test.event', "
                  f"N'corr-101', N'{{\"seq\":\"101\",\"nested\":{{\"a\":1}}}}', 0x6d73677c3130317c)")
    tsql.produce(98, keys, q, start=102)
    p = cli(relay_bin, "stats", "-c", cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    backlog, oldest, dead, kept = parse_stats(p.stdout)["main"]
    assert (backlog, dead, kept) == (200, 0, 0) and 0 <= oldest < 120, p.stdout

    t0 = time.monotonic()
    r = start()
    try:
        want = [s for s in range(200) if s not in (100, 101)]
        got = consume(ch, q, len(want), timeout=60, idle=1.0)
        wait_for(lambda: int(tsql.sql.value(f"SELECT COUNT(*) FROM {tsql.q('messages_dead')}"))
                 == 2, 30, interval=0.2, desc="both poison rows dead-lettered")
        tsql.wait_all_sent(198, timeout=30)
        wait_log_at(r, r"dead-lettered", levels=("ERROR",), count=2)
    finally:
        stop_all(r)
    t_dead = time.monotonic() - t0
    dups, _ = order_report(got, want, lambda s: s % keys)  # the others flowed, in key order
    assert dups == 0, f"{dups} duplicates without any fault"

    ids = {int(seq): int(i) for i, seq in tsql.sql.rows(
        f"SELECT id, JSON_VALUE(headers, '$.seq') FROM {tsql.q('messages_dead')}")}
    assert set(ids) == {100, 101}, ids
    p = cli(relay_bin, "stats", "-c", cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    assert parse_stats(p.stdout)["main"][0::2] == (0, 2), p.stdout   # backlog 0, dead 2
    assert parse_stats(p.stdout)["main"][3] == 198, p.stdout         # marked rows kept

    p = cli(relay_bin, "dead", "-c", cfg, "list")
    assert p.returncode == 0, p.stdout + p.stderr
    listed = dead_rows(p.stdout)
    assert set(listed) == set(ids.values()), p.stdout
    unroutable, nested = listed[ids[100]], listed[ids[101]]
    assert unroutable[3] == nowhere and unroutable[4] == "2", unroutable
    assert re.search(r"unroutable|returned", unroutable[6]), unroutable
    assert re.search(r"headers", nested[6]) and re.search(r"nested", nested[6]), nested
    mid100 = unroutable[1]

    # retry the unroutable row once it has somewhere to go: it is published again
    declare(ch, "", nowhere, nowhere)
    p = cli(relay_bin, "dead", "-c", cfg, "retry", str(ids[100]))
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"1 dead row(s) moved back to {tsql.table}" in p.stdout, p.stdout
    p = cli(relay_bin, "dead", "-c", cfg, "purge", str(ids[101]))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 dead row(s) purged" in p.stdout, p.stdout
    assert tsql.sql.rows(f"SELECT id FROM {tsql.q('messages_dead')}") == []
    r = start()
    try:
        back = consume(ch, nowhere, 1, timeout=30, idle=0.5)
        tsql.wait_all_sent(199, timeout=30)
    finally:
        stop_all(r)
        conn.close()
    assert len(back) == 1, f"the retried row arrived {len(back)} times"
    assert back[0][0].headers["seq"] == "100", back[0][0]
    assert back[0][0].message_id.lower() == mid100.lower(), (back[0][0].message_id, mid100)
    p = cli(relay_bin, "stats", "-c", cfg)
    assert parse_stats(p.stdout)["main"][0::2] == (0, 0), p.stdout
    print(f"{tsql.engine}: 198 rows drained and 2 poison rows dead-lettered {t_dead:.1f} s after "
          f"the relay started; the retried one delivered to its new queue")


def test_sqlserver_back_off_over_24_days(services, tsql, relay_bin, build, tmp_path):
    """retry_backoff_max takes up to 30 days; DATEADD takes an int, and the back-off in
    milliseconds was cut to 2^31 - 1 (24.86 days) while the WARN said the whole delay: the row
    came back 5 days early. It is added in minutes and milliseconds now."""
    q, conn, ch = new_queue(services, "bo")
    conn.close()
    nowhere = f"nowhere-{uuid.uuid4().hex[:8]}"
    start, cfg = make_relay(relay_bin, tmp_path, services, tsql, "bo", max_attempts="1000",
                            retry_backoff="1d", retry_backoff_max="30d")
    init_outbox(relay_bin, cfg)
    tsql.produce(1, 1, nowhere, start=0)
    tsql.sql.run(f"UPDATE {tsql.qt} SET attempts = 10")
    r = start()
    try:
        wait_for(lambda: int(tsql.sql.value(f"SELECT attempts FROM {tsql.qt}")) == 11, 60,
                 interval=0.2, desc="one failed attempt settled")
        secs = int(tsql.sql.value(f"SELECT DATEDIFF_BIG(second, SYSUTCDATETIME(), available_at) "
                                  f"FROM {tsql.qt}"))
    finally:
        stop_all(r)
    assert 30 * 86400 - 120 < secs <= 30 * 86400, f"due in {secs / 86400:.2f} days, not 30"
    assert wait_log_at(r, r"retry in 2592000000 ms", timeout=1)


def test_sqlserver_source_odbc_keeps_the_row_limit(services, tsql, relay_bin, tmp_path):
    """`source = odbc` reaching SQL Server gets the limits `source = sqlserver` has at load:
    batch_size and cleanup_batch of at most 4,000 (a statement over 5,000 row locks escalates
    to a table lock). They are checked once the dialect is known: `check` fails naming the key,
    where it passed and a claim leased 5,000 rows."""
    for key in ("batch_size", "cleanup_batch"):
        _, cfg = make_relay(relay_bin, tmp_path, services, tsql, f"lim-{key}", source="odbc",
                            **{key: "5000"})
        init_outbox(relay_bin, cfg)
        p = cli(relay_bin, "check", "-c", cfg)
        assert p.returncode == 1, (p.stdout, p.stderr)
        assert f"{key} = 5000: at most 4000 on SQL Server" in p.stderr, p.stderr


def test_sqlserver_missing_lease_table_fails_check_and_run(services, tsql, relay_bin, build,
                                                          tmp_path):
    """On SQL Server init keeps what it created before a failure (a lock timeout), and it
    creates the leadership lease table last: an outbox without it passed `check`, and `run`
    said ready while it could never lead. Now both name the table and say to run init."""
    q, conn, ch = new_queue(services, "nolease")
    conn.close()
    start, cfg = make_relay(relay_bin, tmp_path, services, tsql, "nl")
    init_outbox(relay_bin, cfg)
    tsql.sql.run(f"DROP TABLE {tsql.q('messages_lease')}")
    p = cli(relay_bin, "check", "-c", cfg)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert re.search(r"leadership lease table \S*messages_lease\S* does not exist in database "
                     r".*run outbox-relay init", p.stderr), p.stderr
    r = start()
    try:
        assert wait_log_at(r, r"leadership lease table .* run outbox-relay init", timeout=60)
        assert r.metric("outbox_relay_source_up") == 0
    finally:
        stop_all(r)
    init_outbox(relay_bin, cfg)
    p = cli(relay_bin, "check", "-c", cfg)
    assert p.returncode == 0, (p.stdout, p.stderr)
