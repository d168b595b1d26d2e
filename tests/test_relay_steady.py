"""Steady load (issue 21): what the relay costs the user's database while rows keep coming
one commit at a time, each commit waking it (NOTIFY).

Claims coalesce: one claim at a time per outbox, the wake-ups that come while it runs ask
together for one follow-up, and after a claim that found less than it asked for the next
woken claim waits until claim_delay after it, so that it carries the rows committed
meanwhile instead of one or two each."""
import threading
import time
import uuid

from conftest import wait_for
from relay_util import LiveConsumer, Relay, amqp_channel, declare, free_port, write_config
from test_relay import init_schema


def claims(relay):
    return relay.metric("outbox_relay_claims_total"), relay.metric(
        "outbox_relay_claimed_rows_total")


def settles(relay):
    return relay.metric("outbox_relay_settle_latency_seconds_count")


def produce(db, q, rate, seconds, stop):
    """One row per transaction at `rate` a second for `seconds` (each commit NOTIFYs);
    returns the number of rows committed."""
    n = 0
    with db.connect() as c:
        t0 = time.monotonic()
        while not stop.is_set():
            due = t0 + n / rate
            if due > t0 + seconds or time.monotonic() > t0 + seconds:
                break       # a slow machine commits fewer rows, not for longer
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            c.execute("INSERT INTO outbox.messages (message_id, exchange, routing_key, "
                      "partition_key, headers, payload) VALUES (gen_random_uuid(), '', %s, "
                      "%s, jsonb_build_object('seq', %s::text), 'x')",
                      (q, f"k{n % 50}", n))
            n += 1
    return n


def start(relay_bin, tmp_path, services, pgdb, **ob):
    port = free_port()
    cfg = write_config(tmp_path / "r.ini", services, pgdb,
                       relay={"name": "steady", "http_listen": f"127.0.0.1:{port}"},
                       poll_interval="5s", **ob)
    init_schema(relay_bin, cfg)
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    wait_for(lambda: claims(r)[0] is not None and claims(r)[0] >= 1, 20,
             desc="first claim", ignore=(OSError,))
    return r


def test_claims_coalesce_under_a_stream_of_commits(services, pgdb, relay_bin, tmp_path):
    """400 single-row commits a second for 4 s: about 1,600 wake-ups on each of the two
    connections. With claim_delay = 20ms the relay claims at most once per 20 ms while rows
    keep coming (at most ~200 claims, each carrying several rows), and every row arrives."""
    q = f"qsteady-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r = start(relay_bin, tmp_path, services, pgdb, claim_delay="20ms")
    stop = threading.Event()
    try:
        cons = LiveConsumer(services, q)
        c0, rows0 = claims(r)
        t0 = time.monotonic()
        n = produce(pgdb, q, 400, 4.0, stop)
        rate = n / (time.monotonic() - t0)
        assert cons.wait_distinct(n, 30), f"{len(cons.seen)} of {n} arrived"
        secs = time.monotonic() - t0
        c1, rows1 = claims(r)
        cons.stop(idle=0)
        nclaims, nrows = c1 - c0, rows1 - rows0
        assert nrows == n, (nrows, n)
        # one claim per 20 ms at most while rows come, plus the few that polls, the last
        # rows and timer slack add; without coalescing it is one per commit or so
        assert nclaims <= secs / 0.020 + 20, (nclaims, nrows, secs)
        # and the claims carry the rows that came meanwhile: at least half of the rate's
        # rows per 20 ms on average (when the machine managed a rate where that is > 1)
        if rate >= 200:
            assert nrows / nclaims >= rate * 0.020 / 2, (nclaims, nrows, rate)
    finally:
        stop.set()
        r.assert_clean_exit(r.stop())
        conn.close()


def test_marks_gather_under_a_stream_of_commits(services, pgdb, relay_bin, tmp_path):
    """The marks of confirmed rows are on no message's way: under the same stream, with
    claims not coalesced at all (claim_delay = 0: a claim, a publish and a confirm for
    nearly every commit), a settle of fewer than batch_size waits 100 ms after the last one
    and takes what was confirmed meanwhile: at most one settle per 100 ms, every row marked."""
    q = f"qsteady-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r = start(relay_bin, tmp_path, services, pgdb, claim_delay="0")
    stop = threading.Event()
    try:
        cons = LiveConsumer(services, q)
        s0 = settles(r)
        t0 = time.monotonic()
        n = produce(pgdb, q, 400, 3.0, stop)
        assert cons.wait_distinct(n, 30), f"{len(cons.seen)} of {n} arrived"
        with pgdb.connect() as c:
            wait_for(lambda: c.execute("SELECT count(*) FROM outbox.messages WHERE sent_at "
                                       "IS NULL").fetchone()[0] == 0, 10, desc="all marked")
        secs = time.monotonic() - t0
        nsettles = settles(r) - s0
        cons.stop(idle=0)
        assert nsettles <= secs / 0.100 + 10, (nsettles, n, secs)
    finally:
        stop.set()
        r.assert_clean_exit(r.stop())
        conn.close()


def test_wakeups_without_rows_cost_one_claim_per_delay(services, pgdb, relay_bin, tmp_path):
    """A NOTIFY storm that brings no rows (3,000 NOTIFYs in about 2 s on the outbox's
    channel): claims that find nothing are followed by a woken claim only claim_delay later,
    so the relay runs at most one claim per 20 ms, not one per NOTIFY."""
    q = f"qsteady-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r = start(relay_bin, tmp_path, services, pgdb, claim_delay="20ms")
    try:
        c0, _ = claims(r)
        t0 = time.monotonic()
        with pgdb.connect() as c:
            for _ in range(3000):
                c.execute("SELECT pg_notify('outbox_relay', 'outbox.messages')")
                time.sleep(0.0005)
        time.sleep(0.3)
        secs = time.monotonic() - t0
        nclaims = claims(r)[0] - c0
        assert nclaims <= secs / 0.020 + 10, (nclaims, secs)
        assert nclaims >= 5, nclaims     # the wake-ups are not ignored either
    finally:
        r.assert_clean_exit(r.stop())
        conn.close()


def test_retention_never_holds_the_claims(services, pgdb, relay_bin, tmp_path):
    """A retention batch that cannot finish (a marked row it must delete is locked by
    another session) does not stop new rows from being claimed and published: retention
    runs beside the claims, not in front of them."""
    q = f"qsteady-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    port = free_port()
    cfg = write_config(tmp_path / "r.ini", services, pgdb,
                       relay={"name": "steady", "http_listen": f"127.0.0.1:{port}"},
                       poll_interval="5s", retention="0", cleanup_interval="1s",
                       query_timeout="60s")
    init_schema(relay_bin, cfg)
    # a row marked an hour ago, held by another session: retention's DELETE waits for it
    locker = pgdb.connect(autocommit=False)
    with pgdb.connect() as c:
        c.execute("INSERT INTO outbox.messages (message_id, routing_key, payload, sent_at) "
                  "VALUES (gen_random_uuid(), %s, 'old', now() - interval '1 hour')", (q,))
    assert locker.execute("SELECT id FROM outbox.messages FOR UPDATE").fetchone() is not None
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    try:
        cons = LiveConsumer(services, q)
        with pgdb.connect() as c:
            waiting = ("SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                       "'outbox-relay' AND wait_event_type = 'Lock' AND query LIKE 'DELETE%'")
            wait_for(lambda: c.execute(waiting).fetchone()[0] == 1, 20,
                     desc="retention waiting on the lock")
            for i in range(20):
                c.execute("INSERT INTO outbox.messages (message_id, routing_key, headers, "
                          "payload) VALUES (gen_random_uuid(), %s, "
                          "jsonb_build_object('seq', %s::text), 'x')", (q, i))
            # claimed and published while retention still waits
            assert cons.wait_distinct(20, 10), f"{len(cons.seen)} of 20 arrived"
            assert c.execute(waiting).fetchone()[0] == 1
        locker.rollback()
        with pgdb.connect() as c:
            wait_for(lambda: c.execute("SELECT count(*) FROM outbox.messages").fetchone()[0]
                     == 0, 20, desc="retention done once the lock is gone")
        cons.stop(idle=0)
    finally:
        locker.rollback()
        r.assert_clean_exit(r.stop())
        conn.close()


def test_only_the_claiming_session_listens(services, pgdb, relay_bin, tmp_path):
    """Every commit's NOTIFY costs each listening session's backend a wake-up and a read of
    the notification queue: only the connection that claims LISTENs, not the one that
    settles (its wake-ups would ask for nothing the claiming one does not)."""
    r = start(relay_bin, tmp_path, services, pgdb)
    try:
        with pgdb.connect() as c:
            def sessions():
                return c.execute("SELECT query FROM pg_stat_activity WHERE datname = %s AND "
                                 "application_name = 'outbox-relay'", (pgdb.name,)).fetchall()
            wait_for(lambda: len(sessions()) == 2, 20, desc=f"two sessions: {sessions()}")
            # the claiming session has run its first claim since its LISTEN; a session
            # that ran nothing after its LISTEN shows it as its last statement
            time.sleep(1.0)
            last = [q for (q,) in sessions()]
            assert not [q for q in last if q.strip().upper().startswith("LISTEN")], last
    finally:
        r.assert_clean_exit(r.stop())


def test_no_listen_while_claims_keep_finding_rows(services, pgdb, relay_bin, tmp_path):
    """While claims carry several rows each, the claiming session UNLISTENs (a notification
    costs its backend a wake-up each) and claims again claim_delay after each answer; the
    first claim that finds nothing LISTENs again, so a lone commit after the stream is
    still announced at once (poll_interval is 5 s here). Every row arrives."""
    with pgdb.connect() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    q = f"qsteady-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    r = start(relay_bin, tmp_path, services, pgdb, claim_delay="20ms")
    stop = threading.Event()

    def calls(stmt):
        with pgdb.connect() as c:
            return c.execute("SELECT coalesce(sum(s.calls), 0) FROM pg_stat_statements s "
                             "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s "
                             "AND s.query = %s", (pgdb.name, stmt)).fetchone()[0]
    try:
        cons = LiveConsumer(services, q)
        listens0 = calls("LISTEN outbox_relay")
        c0, r0 = claims(r)
        n = produce(pgdb, q, 500, 3.0, stop)
        assert cons.wait_distinct(n, 30), f"{len(cons.seen)} of {n} arrived"
        c1, r1 = claims(r)
        # claims of QUIET_ROWS (4) rows or more on average: at least one was, and the claim
        # after it (at the latest the lone commit's below) UNLISTENed first
        busy = (r1 - r0) / max(c1 - c0, 1) >= 4
        # the stream ended: a claim found nothing and the session listens again
        wait_for(lambda: calls("LISTEN outbox_relay") > listens0 or
                 calls("UNLISTEN outbox_relay") == 0, 10, desc="LISTEN again")
        time.sleep(0.5)
        t0 = time.monotonic()
        with pgdb.connect() as c:
            c.execute("INSERT INTO outbox.messages (message_id, exchange, routing_key, headers, "
                      "payload) VALUES (gen_random_uuid(), '', %s, "
                      "jsonb_build_object('seq', %s::text), 'lone')", (q, n))
        assert cons.wait_distinct(n + 1, 10), f"{len(cons.seen)} of {n + 1} arrived"
        assert time.monotonic() - t0 < 2.0, "the lone commit waited for a poll"
        if busy:
            assert calls("UNLISTEN outbox_relay") >= 1, ((c1 - c0), (r1 - r0))
        cons.stop(idle=0)
    finally:
        stop.set()
        r.assert_clean_exit(r.stop())
        conn.close()
