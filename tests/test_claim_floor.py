"""The claims' floor: a claim walks the pending rows from a lower bound below which no row is
pending or can become pending, so that its cost does not grow with the rows marked since
the table was last vacuumed (all of them, while a long transaction holds the xmin horizon
back: each marked row leaves an entry in the pending rows' index that vacuum cannot take).

The floor is moved by a probe the relay runs before a claim a few times a second: it may
only pass a row once no producer that could still commit a row below it is running (the
table's ROW EXCLUSIVE lock holders, which an INSERT takes before it draws its id). These
tests check both sides on a real server: the cost while the horizon is held, and that a
producer's row committed late (after rows with higher ids were claimed and published) is
claimed at once and before its key's later rows."""
import re
import threading
import time
import uuid

import pytest
from conftest import wait_for
from relay_util import LiveConsumer, Relay, amqp_channel, declare, free_port, write_config
from test_claim_plan import server_log_since
from test_relay import init_schema

# the start of each mode's claim statement, as pg_stat_statements keeps it
CLAIM_SQL = {"leader": "WITH RECURSIVE f(partition_key%", "competing": "WITH RECURSIVE ldr AS%"}


def prepare(relay_bin, tmp_path, services, pgdb, poll_interval="5s", **ob):
    """A queue for the test and the relay's config (schema made): (queue, the broker
    connection that declared it, config path, http port)."""
    q = f"qfloor-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    port = free_port()
    cfg = write_config(tmp_path / "r.ini", services, pgdb,
                       relay={"name": "floor", "http_listen": f"127.0.0.1:{port}"},
                       poll_interval=poll_interval, **ob)
    init_schema(relay_bin, cfg)
    return q, conn, cfg, port


def insert(c, q, key, seq):
    return c.execute("INSERT INTO outbox.messages (message_id, routing_key, partition_key, "
                     "headers, payload) VALUES (gen_random_uuid(), %s, %s, "
                     "jsonb_build_object('seq', %s::text), 'x') RETURNING id",
                     (q, key, seq)).fetchone()[0]


def streamer(pgdb, q, stop, pause):
    """A thread (not started) that commits a row at a time over 5 keys, `pause` seconds
    apart, until `stop` is set."""
    def stream():
        with pgdb.connect() as c:
            i = 1
            while not stop.is_set():
                insert(c, q, f"k{i % 5}", i)
                i += 1
                time.sleep(pause)
    return threading.Thread(target=stream, daemon=True)


def trickle(services, pgdb, q, n, pause):
    """n rows over 3 keys, one commit each `pause` seconds apart, all taken from the queue."""
    cons = LiveConsumer(services, q)
    with pgdb.connect() as c:
        for i in range(n):
            insert(c, q, f"k{i % 3}", i)
            time.sleep(pause)
    assert cons.wait_distinct(n, 30), f"{len(cons.seen)} of {n} arrived"
    cons.stop(idle=0)


def statement_stats(c, like):
    """(buffers read or hit, calls) of the statements like `like` in this database since
    the reset."""
    return c.execute(
        "SELECT coalesce(sum(s.shared_blks_hit + s.shared_blks_read), 0), "
        "coalesce(sum(s.calls), 0) FROM pg_stat_statements s JOIN pg_database d "
        "ON d.oid = s.dbid WHERE d.datname = current_database() AND s.query LIKE %s",
        (like,)).fetchone()


def claim_stats(c, mode):
    """(buffers read or hit, calls) of the relay's claims in this database since the reset."""
    return statement_stats(c, CLAIM_SQL[mode])


@pytest.mark.parametrize("mode", ["leader", "competing"])
def test_claims_do_not_cross_the_rows_marked_while_the_horizon_is_held(
        services, pgdb, relay_bin, tmp_path, mode):
    """20,000 rows of 7 keys drained while a REPEATABLE READ transaction holds the horizon:
    each marked row keeps its entry in the pending rows' index and in the keys' index. The
    claims after it, one per commit, read a few dozen buffers each, not every one of those
    entries and their rows: not from the table's first row (about 20,000 buffers a claim),
    and in competing mode, where a claim looks up each key's earlier pending rows, not from
    the key's first entry either (about 3,000 buffers a key)."""
    q, conn, cfg, port = prepare(relay_bin, tmp_path, services, pgdb, claim_delay="0",
                                 mode=mode)
    with pgdb.connect() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    holder = pgdb.connect(autocommit=False)
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM outbox.messages").fetchone()   # its snapshot
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    try:
        cons = LiveConsumer(services, q)
        n = 20_000
        with pgdb.connect() as c:
            c.execute("INSERT INTO outbox.messages (message_id, routing_key, partition_key, "
                      "headers, payload) SELECT gen_random_uuid(), %s, 'k' || (g %% 7), "
                      "jsonb_build_object('seq', g::text), 'x' FROM generate_series(1, %s) g",
                      (q, n))
            assert cons.wait_distinct(n, 120), f"{len(cons.seen)} of {n} arrived"
            wait_for(lambda: c.execute("SELECT count(*) FROM outbox.messages "
                                       "WHERE sent_at IS NULL").fetchone()[0] == 0, 60,
                     desc="every row marked")
            c.execute("SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database "
                      "WHERE datname = current_database()), 0)")
            for i in range(60):
                insert(c, q, f"k{i % 7}", n + 1 + i)
                time.sleep(0.03)
            assert cons.wait_distinct(n + 60, 30), f"{len(cons.seen)} of {n + 60} arrived"
            hits, calls = claim_stats(c, mode)
            # the horizon was held throughout: the index entries were all there
            dead = c.execute("SELECT n_dead_tup FROM pg_stat_user_tables "
                             "WHERE relid = 'outbox.messages'::regclass").fetchone()[0]
        cons.stop(idle=0)
    finally:
        holder.rollback()
        holder.close()
        r.assert_clean_exit(r.stop())
        conn.close()
    assert dead >= n, f"{dead} dead rows: the horizon was not held"
    assert calls >= 10, f"{calls} claims"
    print(f"{mode} claims: {hits / calls:.0f} buffers a claim over {calls} claims, "
          f"{dead} dead rows")
    assert hits / calls < 500, f"{hits / calls:.0f} buffers a claim over {calls} claims"


@pytest.mark.parametrize("mode", ["leader", "competing"])
def test_a_row_committed_late_is_claimed_at_once_and_before_its_keys_later_rows(
        services, pgdb, relay_bin, tmp_path, mode):
    """A producer's transaction draws an id and stays open for 3 s while other rows are
    committed, claimed and published (the floor moves meanwhile: the claims' logged
    parameters show it). When it commits, its row is claimed within a claim or two, not
    left below the floor, and before the row of its key committed right after it. In
    competing mode the claim's lookups of a key's earlier rows start at the floor too."""
    q, conn, cfg, port = prepare(relay_bin, tmp_path, services, pgdb, mode=mode)
    with pgdb.connect() as c:
        c.execute(f"ALTER DATABASE \"{pgdb.name}\" SET log_min_duration_statement = 0")
    log_from = services.pg_log.stat().st_size
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    late = pgdb.connect(autocommit=False)
    stream_stop, taker_stop = threading.Event(), threading.Event()
    arrived = []                                   # (seq, time taken from the queue)

    def take():
        c2, ch2 = amqp_channel(services)
        for method, props, _body in ch2.consume(q, auto_ack=True, inactivity_timeout=0.05):
            if method is not None:
                arrived.append((int(props.headers["seq"]), time.monotonic()))
            elif taker_stop.is_set():
                break
        ch2.cancel()
        c2.close()

    taker = threading.Thread(target=take, daemon=True)
    stream = streamer(pgdb, q, stream_stop, 0.01)
    taker.start()
    try:
        late_id = insert(late, q, "late", 0)            # drawn now, committed in 3 s
        stream.start()
        time.sleep(3)
        late.commit()
        t_commit = time.monotonic()
        with pgdb.connect() as c:
            after_id = insert(c, q, "late", 1_000_000)
        time.sleep(2)
        stream_stop.set()
        stream.join(10)
        with pgdb.connect() as c:
            wait_for(lambda: c.execute("SELECT count(*) FROM outbox.messages "
                                       "WHERE sent_at IS NULL").fetchone()[0] == 0, 30,
                     desc="every row marked")
            total = c.execute("SELECT count(*) FROM outbox.messages").fetchone()[0]
        wait_for(lambda: len(arrived) >= total, 30, desc="every row taken from the queue")
    finally:
        stream_stop.set()
        taker_stop.set()
        taker.join(10)
        late.rollback()
        late.close()
        r.assert_clean_exit(r.stop())
        conn.close()
        with pgdb.connect() as c:
            c.execute(f"ALTER DATABASE \"{pgdb.name}\" RESET log_min_duration_statement")
    seqs = [s for s, _ in arrived]
    assert len(set(seqs)) == total, f"{len(set(seqs))} of {total} rows arrived"
    assert seqs.index(0) < seqs.index(1_000_000), "the late row came after its key's next row"
    at = dict(reversed(arrived))
    assert at[0] - t_commit < 1.0, f"the late row arrived {at[0] - t_commit:.2f} s after commit"
    assert late_id < after_id
    # the floor moved while rows streamed (else this test shows nothing)
    text = server_log_since(services, log_from)
    floors = [int(m) for m in re.findall(r"parameters: \$1 = '\d+', .*?\$9 = '(\d+)'", text)]
    assert floors and max(floors) > late_id, f"floors {sorted(set(floors))[-5:]}"
    # the probe that moves it is prepared once per session and then executed by its name,
    # not parsed and planned anew before every claim it precedes
    probe = r"SELECT \(SELECT p\.id FROM \S+ p WHERE p\.sent_at IS NULL AND p\.id >= "
    named = re.findall(r"execute outbox_relay_floor: " + probe, text)
    unnamed = re.findall(r"execute <unnamed>: " + probe, text)
    assert len(named) >= 3 and not unnamed, f"{len(named)} named, {len(unnamed)} unnamed probes"


def test_a_sequence_caching_several_values_keeps_no_floor(services, pgdb, relay_bin, tmp_path):
    """Ids drawn from a sequence that caches values per session need not follow the order
    they were drawn in, so no floor is safe: the relay says so once and its claims start
    from the first row (they all carry $9 = 0), delivering everything."""
    q, conn, cfg, port = prepare(relay_bin, tmp_path, services, pgdb, claim_delay="0")
    with pgdb.connect() as c:
        c.execute("ALTER SEQUENCE outbox.messages_id_seq CACHE 10")
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    try:
        trickle(services, pgdb, q, 40, 0.03)
    finally:
        r.assert_clean_exit(r.stop())
        conn.close()
    from relay_util import log_lines_at
    warned = log_lines_at(r.text(), r"claims start from the table's first row", levels=("WARN",))
    assert len(warned) == 1 and "caches more than one value" in warned[0], warned
    assert not log_lines_at(r.text(), r"claims start from the table's first row",
                            levels=("INFO", "ERROR"))


# the floor probe, as pg_stat_statements keeps it
PROBE_SQL = "SELECT (SELECT p.id FROM %"
OPEN_ROWS = 300_000
PASSING = r"the next claims start at id \d+"


def open_bulk(pgdb, q):
    """A bulk load of OPEN_ROWS rows over 100 keys of its own, in a transaction left open
    (its connection, to roll back)."""
    bulk = pgdb.connect(autocommit=False)
    bulk.execute("INSERT INTO outbox.messages (message_id, routing_key, partition_key, "
                 "headers, payload) SELECT gen_random_uuid(), %s, 'bulk' || (g %% 100), "
                 "jsonb_build_object('seq', (-g)::text), 'x' FROM generate_series(1, %s) g",
                 (q, OPEN_ROWS))
    return bulk


@pytest.mark.parametrize("mode", ["leader", "competing"])
def test_claims_pass_over_the_rows_of_a_transaction_still_open(
        services, pgdb, relay_bin, tmp_path, mode):
    """A bulk load of 300,000 rows stays open (one transaction) while other producers commit
    a row at a time. Its rows' index entries lie across each claim's walk from the floor,
    which cannot pass them while the load may still commit, and every claim and floor probe
    stepped over all of them, which it cannot see: about 10,000 buffers and 40 ms each here (at
    1,000,000 rows 0.44 s, and every other producer's message waited that long). Now the
    claims start past them, with one from the floor every second or so, and a probe does not
    look for the lowest pending row while a transaction the one before saw is still open."""
    q, conn, cfg, port = prepare(relay_bin, tmp_path, services, pgdb, mode=mode)
    with pgdb.connect() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    bulk = None
    try:
        r.wait_log("database connected")
        cons = LiveConsumer(services, q)
        bulk = open_bulk(pgdb, q)
        with pgdb.connect() as c:
            # the first claims and probes after it began walk from the floor: a probe sees
            # the load open only two probes after its start (the one before had no lock
            # holder to wait for), and a claim starts past it after one slow claim
            for i in range(10):
                insert(c, q, f"k{i % 5}", i)
                time.sleep(0.05)
            assert cons.wait_distinct(10, 30), f"{len(cons.seen)} of 10 arrived"
            c.execute("SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database "
                      "WHERE datname = current_database()), 0)")
            for i in range(10, 70):
                insert(c, q, f"k{i % 5}", i)
                time.sleep(0.05)
            assert cons.wait_distinct(70, 30), f"{len(cons.seen)} of 70 arrived"
            hits, calls = statement_stats(c, CLAIM_SQL[mode])
            p_hits, p_calls = statement_stats(c, PROBE_SQL)
        cons.stop(idle=0)
    finally:
        if bulk is not None:
            bulk.rollback()
            bulk.close()
        r.assert_clean_exit(r.stop())
        conn.close()
    print(f"{mode}: {hits / max(calls, 1):.0f} buffers a claim over {calls} claims, "
          f"{p_hits / max(p_calls, 1):.0f} a probe over {p_calls} probes")
    assert calls >= 20 and p_calls >= 5, f"{calls} claims, {p_calls} probes"
    assert re.search(PASSING, r.text()), "the relay did not say that its claims pass over rows"
    assert hits / calls < 600, f"{hits / calls:.0f} buffers a claim over {calls} claims"
    assert p_hits / p_calls < 600, f"{p_hits / p_calls:.0f} buffers a probe over {p_calls}"


@pytest.mark.parametrize("mode", ["leader", "competing"])
def test_a_row_the_claims_pass_over_still_goes_before_its_keys_later_rows(
        services, pgdb, relay_bin, tmp_path, mode):
    """A producer's row of key K is written before a bulk load of 300,000 rows and stays
    uncommitted, like the load, while the claims start past both. Then, with nothing else
    being written, it commits, and K's next row is committed right after it, above where
    the claims start. That next row must not go first: a claim that starts past a key's
    pending row takes none of the key's later rows. And both must come within seconds,
    not at the next poll (a minute here): when the claims stop passing over rows, the
    relay claims from the floor at once."""
    q, conn, cfg, port = prepare(relay_bin, tmp_path, services, pgdb, poll_interval="60s",
                                 mode=mode)
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    late = pgdb.connect(autocommit=False)
    bulk = None
    stream_stop = threading.Event()
    stream = streamer(pgdb, q, stream_stop, 0.02)
    try:
        r.wait_log("database connected")
        cons = LiveConsumer(services, q)
        late_id = insert(late, q, "K", 0)
        bulk = open_bulk(pgdb, q)
        stream.start()
        r.wait_log(PASSING, timeout=30)
        stream_stop.set()
        stream.join(10)
        time.sleep(0.2)
        late.commit()
        t_commit = time.monotonic()
        with pgdb.connect() as c:
            next_id = insert(c, q, "K", 1_000_000)
        wait_for(lambda: {0, 1_000_000} <= cons.seen, 30, desc="both rows of K arrived")
        waited = time.monotonic() - t_commit
        got = [int(p.headers["seq"]) for p, _b, _t in cons.stop(idle=0)]
    finally:
        stream_stop.set()
        late.rollback()
        late.close()
        if bulk is not None:
            bulk.rollback()
            bulk.close()
        r.assert_clean_exit(r.stop())
        conn.close()
    start = int(re.findall(r"the next claims start at id (\d+)", r.text())[-1])
    assert late_id < start <= next_id, (late_id, start, next_id)
    assert got.index(0) < got.index(1_000_000), "K's next row went before its first"
    # claims pass over rows for at most 10 s at a time; the poll would come after 60 s
    assert waited < 15, f"K's rows came {waited:.1f} s after the first one's commit"
