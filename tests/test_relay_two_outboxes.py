"""Two outboxes in one `outbox-relay run` process ("one relay may drain several"):
two [outbox.*] sections on two PostgreSQL databases, each with its own table and queue, both
with partition keys, one shared sink.

Both drain completely (per-key order, nothing lost) and /metrics carries both outbox labels.
Then one database is stalled — another session holds ACCESS EXCLUSIVE on its outbox table in
an open transaction, which blocks every query the relay sends there — while rows are added
to both: the other outbox must keep draining meanwhile, and once the lock is released the
stalled outbox catches up, order held, nothing lost."""
import time
import uuid

from conftest import wait_for
from relay_util import (LiveConsumer, Relay, amqp_channel, declare, free_port, insert_rows,
                        order_report, write_config)
from test_relay import init_schema

KEYS = 20


def key_of(seq):
    return seq % KEYS


class _InTransaction:
    """Lets relay_util.insert_rows (which takes a PgDb) insert on an open transaction:
    connect() hands out that connection, and leaving the `with` neither commits nor closes."""

    def __init__(self, conn):
        self.conn = conn

    def connect(self):
        return self

    def __enter__(self):
        return self.conn

    def __exit__(self, *exc):
        return False


def _outbox(db, name):
    return {"source": "postgres", "conninfo": db.dsn, "database": db.name,
            "table": "outbox.messages", "sink": "main", "batch_size": "200",
            "poll_interval": "200ms", "lease": "30s", "query_timeout": "60s",
            "max_attempts": "3", "retry_backoff": "200ms", "retry_backoff_max": "1s",
            "reconnect_max": "1s"}


def _relay_sessions_waiting_on_lock(db, locker_pid):
    """pids of sessions on db (the relay's) waiting for a lock, other than the locker."""
    with db.services.pg_connect() as admin:
        return [r[0] for r in admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> %s"
            " AND wait_event_type = 'Lock'", (db.name, locker_pid)).fetchall()]


def test_two_outboxes_drain_independently_and_survive_a_stalled_database(
        services, pgdb, pgdb2, relay_bin, tmp_path):
    qa, qb = f"q2a-{uuid.uuid4().hex[:6]}", f"q2b-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", qa, qa)
    declare(ch, "", qb, qb)
    port = free_port()
    cfg = write_config(tmp_path / "two.ini", services, pgdb,
                       relay={"http_listen": f"127.0.0.1:{port}"},
                       sink={"publish_window": "500"},
                       outboxes={"alpha": _outbox(pgdb, "alpha"), "beta": _outbox(pgdb2, "beta")})
    init_schema(relay_bin, cfg)          # both databases
    for db in (pgdb, pgdb2):
        with db.connect() as c:
            assert c.execute("SELECT to_regclass('outbox.messages') IS NOT NULL").fetchone() \
                == (True,), f"init did not create the table in {db.name}"

    ca, cb = LiveConsumer(services, qa), LiveConsumer(services, qb)
    r = Relay(relay_bin, cfg, tmp_path / "relay.log", http_port=port)
    locker = None
    try:
        for name in ("alpha", "beta"):
            r.wait_log(f"outbox={name}: became the active relay")

        # ---- phase 1: both drain completely
        n1 = 3000
        assert insert_rows(pgdb, n1, KEYS, routing_key=qa, prefix="a") == n1
        assert insert_rows(pgdb2, n1, KEYS, routing_key=qb, prefix="b") == n1
        assert ca.wait_distinct(n1, 60), f"alpha: {len(ca.seen)}/{n1} arrived"
        assert cb.wait_distinct(n1, 60), f"beta: {len(cb.seen)}/{n1} arrived"
        for name in ("alpha", "beta"):
            wait_for(lambda: r.metric("outbox_relay_relayed_total", name) == n1, timeout=30,
                     desc=f'outbox_relay_relayed_total{{outbox="{name}"}} == {n1}',
                     ignore=(OSError,))
        metrics = r.metrics()
        for name in ("alpha", "beta"):
            assert f'outbox_relay_source_up{{outbox="{name}"}} 1' in metrics, metrics
            assert f'outbox_relay_leader{{outbox="{name}"}} 1' in metrics, metrics

        # ---- phase 2: alpha's database stalls while rows are added to both
        # A committed backlog for alpha, then at once the table lock (so it may well hit
        # alpha mid-drain), and more alpha rows inside the locking transaction.
        n2a_committed, n2a_locked = 1000, 1000
        insert_rows(pgdb, n2a_committed, KEYS, start=n1, routing_key=qa, prefix="a")
        locker = pgdb.connect(autocommit=False)
        locker_pid = locker.execute("SELECT pg_backend_pid()").fetchone()[0]
        locker.execute("LOCK TABLE outbox.messages IN ACCESS EXCLUSIVE MODE")
        t_locked = time.monotonic()
        insert_rows(_InTransaction(locker), n2a_locked, KEYS, start=n1 + n2a_committed,
                    routing_key=qa, prefix="a")
        # the stall is real: the relay's session on alpha's database waits for the lock
        # (its poll timer or the NOTIFY of the committed backlog sends it there)
        wait_for(lambda: _relay_sessions_waiting_on_lock(pgdb, locker_pid), timeout=15,
                 desc="the relay's alpha session to block on the table lock")
        alpha_before = len(ca.seen)

        # beta keeps draining meanwhile, batch after batch
        n2b_batches, n2b = 4, 500
        for i in range(n2b_batches):
            start = n1 + i * n2b
            insert_rows(pgdb2, n2b, KEYS, start=start, routing_key=qb, prefix="b")
            assert cb.wait_distinct(start + n2b, 30), \
                (f"beta stalled with alpha: {len(cb.seen)}/{start + n2b} arrived "
                 f"{time.monotonic() - t_locked:.1f} s into alpha's stall")
        wait_for(lambda: r.metric("outbox_relay_relayed_total", "beta")
                 == n1 + n2b_batches * n2b, timeout=30,
                 desc="beta's marks to commit during alpha's stall", ignore=(OSError,))
        # ... while alpha was stalled the whole time
        assert _relay_sessions_waiting_on_lock(pgdb, locker_pid), \
            "alpha's session stopped waiting for the lock before it was released"
        stalled_for = time.monotonic() - t_locked
        relayed_alpha = r.metric("outbox_relay_relayed_total", "alpha")
        assert r.proc.poll() is None, r.text()[-3000:]
        print(f"alpha stalled {stalled_for:.1f} s: beta relayed {n2b_batches * n2b} rows "
              f"meanwhile; alpha had {alpha_before - n1} of its {n2a_committed} committed "
              f"rows through before the lock ({relayed_alpha:.0f} marked)")

        # ---- release: alpha catches up
        locker.commit()
        locker = None
        n_a = n1 + n2a_committed + n2a_locked
        n_b = n1 + n2b_batches * n2b
        assert ca.wait_distinct(n_a, 90), f"alpha after the stall: {len(ca.seen)}/{n_a}"
        for name, n in (("alpha", n_a), ("beta", n_b)):
            wait_for(lambda: r.metric("outbox_relay_relayed_total", name) == n, timeout=60,
                     desc=f'outbox_relay_relayed_total{{outbox="{name}"}} == {n}',
                     ignore=(OSError,))
        for db, n in ((pgdb, n_a), (pgdb2, n_b)):
            with db.connect() as c:
                assert c.execute("SELECT count(*) FILTER (WHERE sent_at IS NULL), count(*)"
                                 " FROM outbox.messages").fetchone() == (0, n), db.name
    finally:
        if locker is not None:
            locker.rollback()
        got_a, got_b = ca.stop(idle=1.0), cb.stop(idle=0.2)
        rc = r.stop()
        conn.close()
    r.assert_clean_exit(rc)
    assert not ca.errors and not cb.errors, (ca.errors, cb.errors)
    dups_a, _ = order_report(got_a, range(n_a), key_of)
    dups_b, _ = order_report(got_b, range(n_b), key_of)
    text = r.text()
    print(f"alpha: {n_a} rows, {dups_a} duplicates; beta: {n_b} rows, {dups_b} duplicates")
    # the lock outlived neither the lease (30 s) nor query_timeout (60 s): nothing was
    # republished, nothing was given up
    assert dups_a == 0 and dups_b == 0, text[-3000:]
    assert "lost leadership" not in text, text[-3000:]
