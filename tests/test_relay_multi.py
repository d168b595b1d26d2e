"""Several relays on one outbox: leadership as a fenced lease, takeover when the
leader freezes or dies, and per-key order in competing mode — real PostgreSQL and RabbitMQ,
2 or 3 relay processes.

The oracle, on the consumer side: nothing lost, per-key order of first arrivals, every copy
with one message_id, duplicates bounded by 2 x publish_window per fault. On the database side an
audit trigger records every mark (sent_at set) with the lease owner the row carried: a
frozen leader must mark nothing after it wakes, and no relay marks a row it did not hold."""
import os
import signal
import time
import uuid

import pytest

from conftest import wait_for
from relay_util import (amqp_channel, check_against_db, consume, declare, delivery_report,
                        free_port, psql_rows,
                        run_producer, wait_log_at, write_config, Relay)
from test_relay import init_schema

LEASE = 3.0
POLL = 1.0
WINDOW = 100   # publish_window of every relay here: the duplicate bounds are multiples of it


def audit_setup(pgdb):
    """Records each mark with the owner that held the row's lease, and whether that lease was
    still live when the mark COMMITTED: a deferred constraint trigger runs at commit, after
    every statement of the mark's transaction (comparing with now(), the transaction's start,
    would let a mark that committed after its lease lapsed pass). Each claim (a new lease
    token) is recorded the same way, at its commit: a mark that committed after its lease
    lapsed is stale if another owner had claimed the row by then."""
    pgdb.psql("""
        CREATE TABLE outbox.mark_audit (id bigint, owner text, lease_live boolean,
                                        at timestamptz DEFAULT clock_timestamp(),
                                        lease_until timestamptz);
        CREATE TABLE outbox.claim_audit (id bigint, owner text,
                                         at timestamptz DEFAULT clock_timestamp());
        CREATE FUNCTION outbox.audit_mark() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF OLD.sent_at IS NULL AND NEW.sent_at IS NOT NULL THEN
                INSERT INTO outbox.mark_audit (id, owner, lease_live, lease_until)
                VALUES (OLD.id, OLD.lease_owner, OLD.lease_until >= clock_timestamp(),
                        OLD.lease_until);
            ELSIF NEW.lease_owner IS NOT NULL
                  AND NEW.lease_token IS DISTINCT FROM OLD.lease_token THEN
                INSERT INTO outbox.claim_audit (id, owner) VALUES (NEW.id, NEW.lease_owner);
            END IF;
            RETURN NULL;
        END $$;
        CREATE CONSTRAINT TRIGGER mark_audit AFTER UPDATE ON outbox.messages
            DEFERRABLE INITIALLY DEFERRED
            FOR EACH ROW EXECUTE FUNCTION outbox.audit_mark();
    """)


def stale_marks(pgdb):
    """Marks committed after their lease lapsed AND after another owner claimed the row."""
    return psql_rows(pgdb, """
        SELECT m.id, m.owner, m.at, c.owner, c.at FROM outbox.mark_audit m
        JOIN outbox.claim_audit c ON c.id = m.id AND c.owner <> m.owner AND c.at < m.at
        WHERE NOT m.lease_live""")


def marks(pgdb, since=None):
    sql = "SELECT id, owner, lease_live, extract(epoch from at) FROM outbox.mark_audit"
    return psql_rows(pgdb, sql)


def relay(relay_bin, tmp_path, services, pgdb, name, sink=None, relay_keys=None, **kw):
    port = free_port()
    kw.setdefault("lease", f"{LEASE:g}s")
    kw.setdefault("poll_interval", f"{POLL:g}s")
    kw.setdefault("batch_size", "100")
    cfg = write_config(tmp_path / f"{name}.ini", services, pgdb,
                       relay=dict({"name": name, "http_listen": f"127.0.0.1:{port}"},
                                  **(relay_keys or {})),
                       sink=dict({"publish_window": str(WINDOW)}, **(sink or {})), **kw)
    return Relay(relay_bin, cfg, tmp_path / f"{name}.log", http_port=port), cfg


def first_order(got, keys):
    """Per-key order of first arrivals (producer: message i has key i mod keys)."""
    last, seen, breaks = {}, set(), []
    for props, _, _ in got:
        seq = int(props.headers["seq"])
        if seq in seen:
            continue
        seen.add(seq)
        k = seq % keys
        if last.get(k, -1) > seq:
            breaks.append((k, seq, last[k]))
        last[k] = max(seq, last.get(k, -1))
    return breaks


@pytest.mark.parametrize("fault", ["sigstop", "kill9"])
def test_leader_frozen_or_killed_is_replaced(services, pgdb, relay_bin, build, tmp_path, fault):
    n, keys = 6000, 20
    q = f"qm-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    a, cfg = relay(relay_bin, tmp_path, services, pgdb, "ra")
    init_schema(relay_bin, cfg)
    audit_setup(pgdb)
    a.wait_log("became the active relay")
    b, _ = relay(relay_bin, tmp_path, services, pgdb, "rb")
    b.wait_log("standing by")
    run_producer(build, pgdb.dsn, pgdb.name, count=n, keys=keys, routing_key=q, size=64,
                 batch=1000)
    got = consume(ch, q, 800, timeout=30)
    assert len(got) >= 800
    t0 = time.monotonic()
    if fault == "sigstop":
        os.kill(a.proc.pid, signal.SIGSTOP)
    else:
        a.kill9()
    b.wait_log("became the active relay", timeout=20)
    took = time.monotonic() - t0
    if fault == "sigstop":
        # frozen for lease + 5 s in all, then woken: it must find itself fenced
        time.sleep(max(0.0, LEASE + 5 - (time.monotonic() - t0)))
        t_wake = time.time()
        os.kill(a.proc.pid, signal.SIGCONT)
        wait_log_at(a, "lost leadership", timeout=15)   # fenced: a WARN
    got += consume(ch, q, n - len(got), timeout=90, idle=2.0)
    audit = marks(pgdb)
    text_b = b.text()
    for r in (a, b):
        r.stop_clean()   # the woken leader must still run (not crash); kill9'd: not checked
    conn.close()
    dups, copies = delivery_report(got, n, keys)    # lost 0, per-key order, one message_id
    check_against_db(got, pgdb)
    print(f"{fault}: standby active {took:.2f} s after the fault (lease {LEASE:g} s, poll "
          f"{POLL:g} s); {dups} duplicates; {len(audit)} marks")
    assert took <= LEASE + 2 * POLL + 1.0, "the standby took over too late"
    assert dups <= 2 * WINDOW, "duplicates above 2 x publish_window for one fault"
    assert "standing by" in text_b
    ids = [int(r[0]) for r in audit]
    assert len(ids) == len(set(ids)) == n, "every row marked exactly once"
    if fault == "sigstop":
        late = [r for r in audit if r[1].startswith("ra/") and float(r[3]) >= t_wake]
        assert late == [], f"the old leader marked rows after it woke: {late[:5]}"


def test_leader_database_path_cut_stops_publishing(services, pgdb, relay_bin, build, tmp_path,
                                                   memory_alarm):
    """The leader cannot reach the database (its connections hang): it must stop publishing
    before its lease runs out, and the standby takes over. Checked on the broker: the leader
    holds hundreds of claimed rows it has not published (batch_size 1000, publish_window 10,
    and the broker blocks publishing: memory alarm) when its path is cut; the alarm is cleared
    only after its lease expired (database time) while the standby is frozen, so what then
    reaches the queue was published by the old leader: at most the messages it had in flight
    (sent before the block, waiting in its connection), never its held rows."""
    from relay_util import BlackholeProxy
    n, keys, window_a = 4000, 20, 10
    q = f"qm-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    proxy = BlackholeProxy(services.pg_port)
    a = b = None
    try:
        dsn_a = pgdb.dsn.replace(f"port={services.pg_port}", f"port={proxy.port}")
        # its database path still cut when it is stopped at the end, the leader waits out
        # its shutdown_timeout on the hung requests: 2 s, not the 10 s of the others
        a, cfg = relay(relay_bin, tmp_path, services, pgdb, "ra", conninfo=dsn_a,
                       query_timeout="20s", batch_size="1000",
                       sink={"publish_window": str(window_a)},
                       relay_keys={"shutdown_timeout": "2s"})
        init_schema(relay_bin, cfg)
        a.wait_log("became the active relay")
        a.wait_log("sink=main: connected")
        b, _ = relay(relay_bin, tmp_path, services, pgdb, "rb")
        b.wait_log("standing by")
        memory_alarm.raise_()
        run_producer(build, pgdb.dsn, pgdb.name, count=n, keys=keys, routing_key=q, size=64,
                     batch=1000)
        # the broker tells a connection it is blocked once it publishes
        wait_for(lambda: a.metric("outbox_relay_sink_blocked") == 1, 15,
                 desc="the leader's broker connection blocked")

        def held():
            return int(psql_rows(pgdb, "SELECT count(*) FROM outbox.messages WHERE sent_at IS "
                                       "NULL AND lease_owner LIKE 'ra/%%'")[0][0])
        wait_for(lambda: held() >= 500, 20, interval=0.1, desc="the leader holding claimed rows")
        os.kill(b.proc.pid, signal.SIGSTOP)     # no standby publishes until checked
        in_flight = a.metric("outbox_relay_in_flight")
        proxy.blackhole()
        t0 = time.monotonic()
        n_held = held()
        # the leader's lease, in database time, as seconds from now
        left = float(psql_rows(pgdb, "SELECT extract(epoch FROM expires_at - clock_timestamp()) "
                                     "FROM outbox.messages_lease WHERE owner LIKE 'ra/%%'")[0][0])
        t_expiry = t0 + left
        wait_log_at(a, "lost leadership", timeout=LEASE + 5)   # fenced: a WARN
        stopped = time.monotonic() - t0
        time.sleep(max(0.0, t_expiry + 0.5 - time.monotonic()))
        memory_alarm.clear()
        # the old leader would publish its held rows now, were it allowed
        early = consume(ch, q, n, timeout=3.0)
        os.kill(b.proc.pid, signal.SIGCONT)
        b.wait_log("became the active relay", timeout=20)
        took = time.monotonic() - t0
        got = early + consume(ch, q, n, timeout=90, idle=2.0)
        for r in (a, b):
            r.stop_clean()   # the fenced leader must still run and exit 0
    finally:
        memory_alarm.close()
        for r in (a, b):
            if r is not None and r.proc.poll() is None:
                os.kill(r.proc.pid, signal.SIGCONT)
                r.stop()
        proxy.close()
    conn.close()
    dups, _ = delivery_report(got, n, keys)
    check_against_db(got, pgdb)
    print(f"database path cut: the leader held {n_held} claimed rows ({in_flight:.0f} in "
          f"flight, window {window_a}); its lease expired {left:.2f} s after the cut (database "
          f"time); it stopped publishing {stopped:.2f} s after the cut; {len(early)} messages "
          f"reached the queue after its lease expired; the standby was active after "
          f"{took:.2f} s; {dups} duplicates")
    assert n_held >= 500
    assert stopped < left, "the cut-off leader must stop before its lease runs out"
    assert len(early) <= in_flight <= window_a, (
        f"{len(early)} messages reached the queue after the old leader's lease expired (it "
        f"had {in_flight:.0f} in flight): it published held rows past its lease")
    assert dups <= 2 * WINDOW   # a fenced leader: 2 x publish_window


@pytest.mark.parametrize("freeze", [False, True])
def test_competing_three_relays_keep_per_key_order(services, pgdb, relay_bin, build, tmp_path,
                                                   freeze, request):
    n, keys = 9000, 50
    alarm = request.getfixturevalue("memory_alarm") if freeze else None
    q = f"qm-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    relays = []
    for i in range(3):
        r, cfg = relay(relay_bin, tmp_path, services, pgdb, f"rc{i}", mode="competing")
        if i == 0:
            init_schema(relay_bin, cfg)
            audit_setup(pgdb)
        relays.append(r)
    for r in relays:
        r.wait_log("database connected")
    held = []
    if freeze:
        # the broker blocks publishing (memory alarm) so that the relays hold claimed rows
        # instead of draining 9000 rows in a second: the frozen one is then sure to hold some
        alarm.raise_()
    try:
        run_producer(build, pgdb.dsn, pgdb.name, count=n, keys=keys, routing_key=q, size=64,
                     batch=1000)
        got = [] if freeze else consume(ch, q, 1500, timeout=30)
        if freeze:
            def leased():
                rows = psql_rows(pgdb, "SELECT split_part(lease_owner, '/', 1), count(*) FROM "
                                       "outbox.messages WHERE sent_at IS NULL AND lease_owner "
                                       "IS NOT NULL GROUP BY 1")
                return {o: int(c) for o, c in rows}
            wait_for(lambda: len(leased()) == 3, 30, interval=0.1,
                     desc="every relay holding leased rows")
            # freeze the relay holding the most rows past its lease: the others take its
            # keys over
            by_owner = leased()
            bi = int(max(by_owner, key=by_owner.get)[2:])
            busy = relays[bi]
            os.kill(busy.proc.pid, signal.SIGSTOP)
            # what it holds, frozen: leased and unsent rows (their keys are its keys now)
            held = psql_rows(pgdb, "SELECT id, partition_key FROM outbox.messages WHERE "
                                   "sent_at IS NULL AND lease_owner LIKE %s", (f"rc{bi}/%",))
            alarm.clear()
            time.sleep(LEASE + 2)
            os.kill(busy.proc.pid, signal.SIGCONT)
    finally:
        if alarm is not None:
            alarm.close()
    got += consume(ch, q, n - len(got), timeout=120, idle=2.0)
    counts = [r.metric("outbox_relay_relayed_total") for r in relays]
    audit = marks(pgdb)
    for r in relays:
        r.stop_clean()   # the frozen one too: woken, it must still run and exit 0
    conn.close()
    breaks = first_order(got, keys)
    if breaks:
        k0 = sorted((int(r[0]), r[1], r[2], float(r[3])) for r in audit if (int(r[0]) - 1) % keys == breaks[0][0])
        print("audit of the key:", k0[:8])
        print("arrivals of the key:", [(int(p.headers["seq"]), round(t, 3)) for p, _, t in got
                                      if int(p.headers["seq"]) % keys == breaks[0][0]][:8])
        for r in relays:
            print(r.log_path, [l for l in r.text().splitlines() if "WARN" in l or "given back" in l][:10])
    dups, _ = delivery_report(got, n, 0)       # lost 0, one message_id per seq
    check_against_db(got, pgdb)
    print(f"competing x3, 50 keys{', one frozen past its lease' if freeze else ''}: relayed "
          f"{counts}, {dups} duplicates, {len(breaks)} per-key order breaks")
    assert breaks == [], f"per-key order broken: {breaks[:8]}"
    assert dups <= (2 * WINDOW if freeze else 0)   # a frozen relay: 2 x publish_window
    ids = [int(r[0]) for r in audit]
    assert len(ids) == len(set(ids)) == n, "every row marked exactly once"
    lapsed = [r for r in audit if r[2] is not True]
    stale = stale_marks(pgdb)
    print(f"{len(lapsed)} marks committed after their lease lapsed (the row not claimed by "
          f"another meanwhile: fenced by its token, harmless), {len(stale)} stale")
    assert stale == [], f"marks committed after another relay had claimed the row: {stale[:5]}"
    # without a freeze nothing holds a confirm back past a lease; with one, only what was in
    # flight when the broker blocked (each relay's window)
    assert len(lapsed) <= (3 * WINDOW if freeze else 0), \
        f"{len(lapsed)} marks committed after their lease had lapsed: {lapsed[:5]}"
    if freeze:
        # the frozen relay held rows, and the others took them (and so its keys) over
        assert held, "the frozen relay held no rows: the freeze tested nothing"
        by = {int(r[0]): r[1] for r in audit}
        kept = [i for i, _ in held if str(by.get(int(i), "")).startswith(f"rc{bi}/")]
        assert kept == [], f"rows the frozen relay held were marked by it after waking: {kept[:5]}"
        print(f"frozen relay rc{bi} held {len(held)} rows of "
              f"{len({k for _, k in held})} keys; the others marked all of them")
    if not freeze:
        # keys spread over the members: none of the three sits idle (evenly: n/3 each)
        assert min(counts) >= n // 10, f"keys did not spread over the relays: {counts}"


def test_competing_stopping_hands_keys_over_at_once(services, pgdb, relay_bin, build, tmp_path):
    """SIGTERM in competing mode: the relay settles, then withdraws its membership, so its
    keys move to the other relay at once instead of after the lease (30 s here)."""
    q = f"qm-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    a, cfg = relay(relay_bin, tmp_path, services, pgdb, "ca", mode="competing", lease="30s")
    init_schema(relay_bin, cfg)
    b, _ = relay(relay_bin, tmp_path, services, pgdb, "cb", mode="competing", lease="30s")
    run_producer(build, pgdb.dsn, pgdb.name, count=400, keys=20, routing_key=q, size=64)
    got = consume(ch, q, 400, timeout=30, idle=1.0)
    live = psql_rows(pgdb, "SELECT owner FROM outbox.messages_lease WHERE left(name, 7) = 'member:' "
                           "AND expires_at > now() ORDER BY owner")
    assert len(live) == 2, live
    a.assert_clean_exit(a.stop())
    t0 = time.monotonic()
    run_producer(build, pgdb.dsn, pgdb.name, count=400, keys=20, routing_key=q, size=64,
                 start=400)
    got += consume(ch, q, 400, timeout=30)
    took = time.monotonic() - t0
    got += consume(ch, q, 1, timeout=1.0)     # duplicates, if any
    b.assert_clean_exit(b.stop())
    conn.close()
    dups, _ = delivery_report(got, 800, 20)
    check_against_db(got, pgdb)
    print(f"competing hand-over: the other relay drained every key {took:.2f} s after SIGTERM "
          "(lease 30 s)")
    assert took < 10, "the other relay waited for the stopped relay's lease to run out"
    assert dups == 0


def test_leader_stopping_hands_over_at_once(services, pgdb, relay_bin, build, tmp_path):
    """SIGTERM: the leader settles, then expires its own lease, so a standby takes over at its
    next try instead of waiting for the lease to run out (rolling restarts stay short)."""
    q = f"qm-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    a, cfg = relay(relay_bin, tmp_path, services, pgdb, "ra", lease="30s")
    init_schema(relay_bin, cfg)
    a.wait_log("became the active relay")
    b, _ = relay(relay_bin, tmp_path, services, pgdb, "rb", lease="30s")
    b.wait_log("standing by")
    run_producer(build, pgdb.dsn, pgdb.name, count=500, keys=5, routing_key=q, size=64)
    got = consume(ch, q, 200, timeout=30)
    t0 = time.monotonic()
    a.assert_clean_exit(a.stop())
    b.wait_log("became the active relay", timeout=20)
    took = time.monotonic() - t0
    got += consume(ch, q, 500 - len(got), timeout=30, idle=1.0)
    b.assert_clean_exit(b.stop())
    conn.close()
    dups, _ = delivery_report(got, 500, 5)
    check_against_db(got, pgdb)
    print(f"graceful hand-over: standby active {took:.2f} s after SIGTERM (lease 30 s)")
    assert "leadership handed over" in a.text()
    assert took < 5, "the standby waited for the lease to run out"
    assert dups == 0


def test_relays_of_both_modes_on_one_outbox_run_one_mode_at_a_time(services, pgdb, relay_bin,
                                                                   build, tmp_path):
    """One relay configured in leader mode among relays in competing mode (or the reverse):
    the mode already running keeps the outbox, the newcomer claims nothing and says why at
    WARN, and takes over once the others stop. Mixed, a leader took a key's later rows while
    a competing relay held its earlier ones."""
    q = f"qm-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    ca, cfg = relay(relay_bin, tmp_path, services, pgdb, "ca", mode="competing", lease="30s")
    init_schema(relay_bin, cfg)
    audit_setup(pgdb)
    run_producer(build, pgdb.dsn, pgdb.name, count=300, keys=10, routing_key=q, size=64)
    got = consume(ch, q, 300, timeout=30)
    la, _ = relay(relay_bin, tmp_path, services, pgdb, "la", lease="30s")
    msg = wait_log_at(la, r"runs this outbox in competing mode")
    assert "ca/" in msg and "mode = leader" in msg, msg
    assert la.metric("outbox_relay_mode_conflict") == 1
    run_producer(build, pgdb.dsn, pgdb.name, count=300, keys=10, routing_key=q, size=64,
                 start=300)
    got += consume(ch, q, 300, timeout=30)
    # the competing relay stops (it withdraws): the leader-mode relay takes the outbox
    ca.assert_clean_exit(ca.stop())
    la.wait_log("became the active relay", timeout=20)
    la.wait_log("no longer holds this outbox", timeout=20)
    assert la.metric("outbox_relay_mode_conflict") == 0
    cb, _ = relay(relay_bin, tmp_path, services, pgdb, "cb", mode="competing", lease="30s")
    msg = wait_log_at(cb, r"runs this outbox in leader mode")
    assert "la/" in msg and "mode = competing" in msg, msg
    assert cb.metric("outbox_relay_mode_conflict") == 1
    time.sleep(2)     # its idle poll's delay grows from 50 ms to poll_interval meanwhile
    cb_claims = cb.metric("outbox_relay_claims_total")
    t0 = time.monotonic()
    run_producer(build, pgdb.dsn, pgdb.name, count=300, keys=10, routing_key=q, size=64,
                 start=600, batch=3)
    got += consume(ch, q, 300, timeout=30)
    # kept out, cb claims at its polls only, not at each of the 100 commits' wake-ups
    polls = (time.monotonic() - t0) / POLL
    assert cb.metric("outbox_relay_claims_total") - cb_claims <= polls + 3, polls
    got += consume(ch, q, 1, timeout=1.0)     # duplicates, if any
    claims = psql_rows(pgdb, "SELECT split_part(owner, '/', 1), min(id), max(id), count(*) "
                             "FROM outbox.claim_audit GROUP BY 1 ORDER BY 2")
    la.assert_clean_exit(la.stop())
    cb.assert_clean_exit(cb.stop())
    conn.close()
    dups, _ = delivery_report(got, 900, 10)
    check_against_db(got, pgdb)
    # one mode at a time: the first 600 rows by ca, the last 300 by la, none by cb
    assert [r[0] for r in claims] == ["ca", "la"], claims
    assert int(claims[0][2]) < int(claims[1][1]), claims
    assert dups == 0


def test_a_leader_that_meets_a_live_member_lets_its_lease_go(services, pgdb, relay_bin, build,
                                                            tmp_path):
    """A leader-mode relay finds a live member row of a competing relay (one that joined in
    the same instant as its lead; here written by hand, expiring 8 s later): its renewal
    fails and lets its own lease expire at once, so that no mode waits for it, and once the
    member has gone it leads again at its next try, not a lease later. Before, its own lease
    stayed live and nothing was published until it expired."""
    q = f"qm-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    la, cfg = relay(relay_bin, tmp_path, services, pgdb, "la", lease="12s")
    init_schema(relay_bin, cfg)
    la.wait_log("became the active relay")
    pgdb.psql("INSERT INTO outbox.messages_lease (name, owner, epoch, expires_at) "
              "VALUES ('member:zz', 'zz', 0, now() + interval '8 s')")
    t0 = time.monotonic()
    msg = wait_log_at(la, r"lost leadership", timeout=15)
    assert "relay zz runs this outbox in competing mode" in msg, msg
    live = psql_rows(pgdb, "SELECT count(*) FROM outbox.messages_lease "
                           "WHERE name = 'leader' AND expires_at > now()")
    assert live == [(0,)], "the leader kept its lease live"
    time.sleep(max(0.0, 8.2 - (time.monotonic() - t0)))     # the member has gone
    run_producer(build, pgdb.dsn, pgdb.name, count=10, keys=2, routing_key=q, size=64)
    t1 = time.monotonic()
    got = consume(ch, q, 10, timeout=30)
    took = time.monotonic() - t1
    la.assert_clean_exit(la.stop())
    conn.close()
    assert len(got) == 10
    assert took < 3, f"published {took:.1f} s after they were written (lease 12 s)"
