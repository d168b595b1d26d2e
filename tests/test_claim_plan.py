"""The claim's cost does not depend on the planner's statistics being fresh. A large
backlog written at once into an outbox whose statistics still describe it as empty, or
as holding only sent rows (autovacuum has not analyzed it since), must still be claimed
by walking the pending rows in id order up to the batch's limit: never by reading every
pending row and sorting them, which for 150,000 rows cost 0.1-0.4 s a claim on a quiet
server and, on a loaded one, more than the query timeout.

The plans checked are the relay's own: auto_explain (loaded for the scratch database's
sessions only) writes the executed plan of every statement the relay runs, with its
row counts, into the server's log."""
import json
import uuid

import psycopg
import pytest

from relay_util import Relay, amqp_channel, consume, declare, write_config
from test_relay import init_schema

BACKLOG = 150_000
BATCH = 500
# a claim may read a few batches' worth of rows (rows skipped as leased or waiting); the
# stale plans read the whole backlog
MAX_ROWS_READ = 10 * BATCH


def rows_read(node):
    """(node type, relation, rows read) of every scan of a relation under node: the rows
    it returned plus those its filter removed, over all its loops."""
    out = []
    loops = node.get("Actual Loops", 1)
    if "Relation Name" in node:
        read = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
                + node.get("Rows Removed by Index Recheck", 0)) * loops
        out.append((node["Node Type"], node["Relation Name"], read))
    for child in node.get("Plans", []):
        out += rows_read(child)
    return out


def sorts_of(node, table):
    """The sorts under node whose input reads `table`, with the rows they sorted."""
    out = []
    if node.get("Node Type") in ("Sort", "Incremental Sort"):
        below = [r for c in node.get("Plans", []) for r in rows_read(c) if r[1] == table]
        if below:
            out.append((node.get("Sort Key"), node["Plans"][0].get("Actual Rows", 0)
                        * node["Plans"][0].get("Actual Loops", 1)))
    for child in node.get("Plans", []):
        out += sorts_of(child, table)
    return out


def logged_plans(text, marker):
    """The auto_explain JSON plans in a server log excerpt whose query text holds marker."""
    dec = json.JSONDecoder()
    plans, pos = [], 0
    while True:
        pos = text.find("plan:\n", pos)
        if pos < 0:
            return plans
        start = text.find("{", pos)
        try:
            obj, end = dec.raw_decode(text, start)
        except ValueError:
            pos += 6
            continue
        pos = end
        if marker in obj.get("Query Text", ""):
            plans.append(obj)


def drained_claim_plans(services, pgdb, relay_bin, tmp_path, table, q, conn, ch, cfg,
                        before=None):
    """Runs the relay (after it started, `before()` if given) until it delivered 4 batches
    (a few claims' worth is enough: every claim of the backlog plans alike), with
    auto_explain on for the database (turned off after); returns the executed plans of its
    claims (at least 4)."""
    log_from = services.pg_log.stat().st_size
    r = Relay(relay_bin, cfg, tmp_path / "r.log")
    try:
        if before is not None:
            before()
        assert len(consume(ch, q, 4 * BATCH, timeout=120)) == 4 * BATCH
    finally:
        r.assert_clean_exit(r.stop())
        ch.queue_delete(q)
        conn.close()
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f"ALTER DATABASE \"{pgdb.name}\" RESET ALL")
    text = server_log_since(services, log_from)
    claims = [p for p in logged_plans(text, "FOR UPDATE SKIP LOCKED") if table in p["Query Text"]]
    assert len(claims) >= 4, f"{len(claims)} claim plans in the server log"
    return claims


CASES = [
    ("leader", "analyzed-empty"),
    # the statistics saw no pending row: the planner believes pending_idx holds about one
    # row and prefers walking it to find a key's rows (the leader's first failed row of
    # each key, the competing claim's per-key head and gap), which then reads the rows
    # ahead of the key's for every lookup
    ("leader", "analyzed-all-sent"),
    ("competing", "analyzed-empty"),
    ("competing", "analyzed-all-sent"),
]


@pytest.mark.parametrize("mode,stats", CASES)
def test_claim_walks_pending_rows_in_order_under_stale_statistics(
        services, pgdb, relay_bin, tmp_path, mode, stats):
    table, qt, q, conn, ch, cfg = relay_table(services, pgdb, relay_bin, tmp_path, "stale",
                                              batch_size=str(BATCH), mode=mode)
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f"ALTER TABLE {qt} SET (autovacuum_enabled = off)")
        if stats == "analyzed-all-sent":
            # the steady state: what the statistics saw was sent (and later cleaned up)
            db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload, sent_at) "
                       "SELECT 'none', 'k' || (g % 100), '\\x00', now() "
                       "FROM generate_series(1, 10000) g")
        db.execute(f"ANALYZE {qt}")
        if stats == "analyzed-all-sent":
            db.execute(f"DELETE FROM {qt}")
        with db.transaction():   # the bulk load, in one transaction
            db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                       "SELECT %s, 'k' || (g %% 100), convert_to(repeat('x', 100), 'UTF8') "
                       "FROM generate_series(1, %s) g", (q, BACKLOG))
        # nothing has analyzed the table since: the planner still has the old picture
        n_analyzed = db.execute(
            "SELECT coalesce(n_mod_since_analyze, 0) FROM pg_stat_user_tables "
            "WHERE relid = %s::regclass", (qt,)).fetchone()[0]
        auto_explain_on(db, pgdb.name)
    assert n_analyzed >= BACKLOG
    claims = drained_claim_plans(services, pgdb, relay_bin, tmp_path, table, q, conn, ch, cfg)
    for p in claims:
        assert_bounded(p["Plan"], table)
    # The same claim as a generic plan (made once for every execution, without the
    # parameters' values), made now, with the statistics still stale, in a session set up
    # as the relay's: nothing in it may depend on the statistics either.
    with psycopg.connect(pgdb.dsn) as db:
        for k, v in RELAY_SESSION:
            db.execute(f"SET {k} = '{v}'")
        db.execute("PREPARE claim AS " + claims[0]["Query Text"])
        lease = "30000"   # a live membership in competing mode
        # held: as many ids as the relay passes at most (none of them a row here)
        held = "'{" + ",".join(str(-i) for i in range(1, 65)) + "}'"
        # lost: tokens of claims that failed without an answer (none of them leased a row)
        lost = "'{" + ",".join(str(-i) for i in range(1, 17)) + "}'"
        plan = db.execute(f"EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) EXECUTE claim({BATCH}, "
                          f"'plan-probe', 1, {lease}, 0, 0, true, 0, 0, {held}, {lost}, 0)"
                          ).fetchone()[0][0]
        generic = db.execute("SELECT generic_plans FROM pg_prepared_statements "
                             "WHERE name = 'claim'").fetchone()[0]
        db.rollback()
    assert generic >= 1
    assert plan["Plan"]["Actual Rows"] > 0, json.dumps(plan, indent=1)
    assert_bounded(plan["Plan"], table)


def relay_table(services, pgdb, relay_bin, tmp_path, prefix, **cfg):
    """A fresh outbox table (init applied), its queue and the relay's config: (table, its
    quoted name, queue, connection, channel, config path)."""
    tag = uuid.uuid4().hex[:8]
    table = f"{prefix}_{tag}"
    q = f"q{prefix}-{tag}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    path = write_config(tmp_path / "r.ini", services, pgdb, table=f"outbox.{table}", **cfg)
    init_schema(relay_bin, path)
    return table, f'"outbox"."{table}"', q, conn, ch, path


def server_log_since(services, offset):
    """The PostgreSQL server log from byte offset on."""
    with open(services.pg_log, errors="replace") as f:
        f.seek(offset)
        return f.read()


def auto_explain_on(db, name):
    """The executed plan of every statement of database `name`'s new sessions, logged."""
    db.execute(f"ALTER DATABASE \"{name}\" SET session_preload_libraries = 'auto_explain'")
    for k, v in (("auto_explain.log_min_duration", "0"), ("auto_explain.log_analyze", "on"),
                 ("auto_explain.log_timing", "off"), ("auto_explain.log_format", "json"),
                 ("auto_explain.log_buffers", "on"),
                 ("auto_explain.log_nested_statements", "on"),
                 ("log_min_messages", "log")):
        db.execute(f"ALTER DATABASE \"{name}\" SET {k} = '{v}'")


# A generic plan of the claim made while the table is nearly empty must not find the
# claimed rows for its UPDATE (nor, on an empty table, each walked row) by reading the
# table: the relay's claims run on such plans, kept as the table grows until the
# statistics change. The relay's sessions rule sequential scans out (enable_seqscan off).
@pytest.mark.parametrize("mode", ["leader", "competing"])
def test_claim_generic_plan_made_on_a_nearly_empty_table_scans_no_table(
        services, pgdb, relay_bin, tmp_path, mode):
    table, qt, q, conn, ch, cfg = relay_table(services, pgdb, relay_bin, tmp_path, "tiny",
                                              mode=mode)
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f"ALTER TABLE {qt} SET (autovacuum_enabled = off)")
        db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                   "SELECT %s, 'k' || g, '\\x00' FROM generate_series(1, 5) g", (q,))
        db.execute(f"ANALYZE {qt}")
        auto_explain_on(db, pgdb.name)
    log_from = services.pg_log.stat().st_size
    r = Relay(relay_bin, cfg, tmp_path / "r.log")
    try:
        assert len(consume(ch, q, 5, timeout=60)) == 5
    finally:
        r.assert_clean_exit(r.stop())
        ch.queue_delete(q)
        conn.close()
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f"ALTER DATABASE \"{pgdb.name}\" RESET ALL")
        db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                   "SELECT %s, 'k' || g, '\\x00' FROM generate_series(1, 5) g", (q,))
    text = server_log_since(services, log_from)
    claims = [p for p in logged_plans(text, "FOR UPDATE SKIP LOCKED") if table in p["Query Text"]]
    assert claims, "no claim plan in the server log"
    with psycopg.connect(pgdb.dsn) as db:
        for k, v in RELAY_SESSION:
            db.execute(f"SET {k} = '{v}'")
        db.execute("PREPARE claim AS " + claims[0]["Query Text"])
        plan = db.execute(f"EXPLAIN (FORMAT JSON) EXECUTE claim({BATCH}, 'plan-probe', 1, "
                          "30000, 0, 0, true, 0, 0, NULL, NULL, 0)").fetchone()[0][0]["Plan"]
        db.rollback()

    def seq_scans(node):
        own = [node.get("Alias")] if (node.get("Node Type") == "Seq Scan"
                                      and node.get("Relation Name") == table) else []
        return own + [a for c in node.get("Plans", []) for a in seq_scans(c)]
    assert not seq_scans(plan), f"{seq_scans(plan)}\n{json.dumps(plan, indent=1)}"


# what the relay sets on its PostgreSQL sessions that the planner reads
RELAY_SESSION = (("enable_sort", "off"), ("enable_incremental_sort", "off"),
                 ("enable_seqscan", "off"), ("jit", "off"),
                 ("plan_cache_mode", "force_generic_plan"))


def is_generic(plan, owner):
    """True when an executed claim plan was made without the parameters' values: a plan
    made with them holds the relay's owner name ($2) as a constant wherever it compares
    it (the leadership's fence, the membership), a generic plan names the parameter."""
    text = json.dumps(plan["Plan"])
    const = "'" + owner.replace("'", "''") + "'::text"
    assert const in text or "$2" in text, json.dumps(plan, indent=1)
    return const not in text


@pytest.mark.parametrize("mode", ["leader", "competing"])
def test_claims_are_planned_once_per_session(services, pgdb, relay_bin, tmp_path, mode):
    """Under steady load each claim carries a few rows, and planning the claim cost more
    than running it: the relay's claims run on a plan made once per session (generic), not
    planned again at every execution."""
    table, qt, q, conn, ch, cfg = relay_table(services, pgdb, relay_bin, tmp_path, "once",
                                              mode=mode)
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        auto_explain_on(db, pgdb.name)
    log_from = services.pg_log.stat().st_size
    r = Relay(relay_bin, cfg, tmp_path / "r.log")
    try:
        with psycopg.connect(pgdb.dsn, autocommit=True) as db:
            # one commit at a time, each consumed before the next: a claim (or more) each
            for i in range(12):
                db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                           "VALUES (%s, %s, '\\x00')", (q, f"k{i % 3}"))
                assert len(consume(ch, q, 1, timeout=30)) == 1
    finally:
        r.assert_clean_exit(r.stop())
        ch.queue_delete(q)
        conn.close()
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f"ALTER DATABASE \"{pgdb.name}\" RESET ALL")
        owners = [o for (o,) in db.execute(f'SELECT DISTINCT owner FROM "outbox"."{table}_lease" '
                                           "WHERE owner <> ''")]   # '': init's leader row
    assert len(owners) == 1, owners
    text = server_log_since(services, log_from)
    claims = [p for p in logged_plans(text, "FOR UPDATE SKIP LOCKED") if table in p["Query Text"]]
    assert len(claims) >= 12, f"{len(claims)} claim plans in the server log"
    kinds = "".join("g" if is_generic(p, owners[0]) else "c" for p in claims)
    # the relay asks for the generic plan (plan_cache_mode = force_generic_plan): left to
    # PostgreSQL's choice (auto), the first five were planned with their values, and every
    # later one too whenever the generic plan's estimate came out above their average
    assert "c" not in kinds, f"claims planned with their values: {kinds}"
    for p in claims:
        assert_bounded(p["Plan"], table)
        if mode == "leader":
            assert_hold_reads_nothing(p["Plan"], table)


def test_leader_hold_reads_nothing_for_a_hot_key_under_statistics_of_many_keys(
        services, pgdb, relay_bin, tmp_path):
    """The statistics saw 20,000 rows over 2,000 keys; the backlog is 20,000 rows of one
    key. The leader claim's look for a row not due before each candidate could be answered
    by key_idx (ordered by key, then sorted a little at a time), reading the key's rows
    before the candidate for every candidate: 0.7 s a claim of 500. It must read only
    the (empty) index of the delayed rows."""
    table, qt, q, conn, ch, cfg = relay_table(services, pgdb, relay_bin, tmp_path, "hot",
                                              batch_size=str(BATCH))
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f"ALTER TABLE {qt} SET (autovacuum_enabled = off)")
        db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                   "SELECT 'none', 'k' || (g % 2000), '\\x00' FROM generate_series(1, 20000) g")
        db.execute(f"ANALYZE {qt}")
        db.execute(f"DELETE FROM {qt}")
        db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                   "SELECT %s, 'hot', '\\x01' FROM generate_series(1, 20000) g", (q,))
        auto_explain_on(db, pgdb.name)
    claims = drained_claim_plans(services, pgdb, relay_bin, tmp_path, table, q, conn, ch, cfg)
    for p in claims:
        assert_hold_reads_nothing(p["Plan"], table)


def index_scans(node):
    """(alias, index name, rows read, heap fetches) of every index scan under node."""
    out = []
    if "Index Name" in node:
        loops = node.get("Actual Loops", 1)
        out.append((node.get("Alias"), node["Index Name"],
                    (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * loops,
                    node.get("Heap Fetches", 0)))
    for child in node.get("Plans", []):
        out += index_scans(child)
    return out


def assert_hold_reads_nothing(plan, table):
    """The leader claim holds a key behind a row not due yet (its lookup's alias is h):
    with none delayed, finding that out reads no row, from its index of the delayed rows
    (empty), where a look at each candidate's key (key_idx, the key's first pending row,
    the rows in flight) cost more than the rest of the claim."""
    hold = [s for s in index_scans(plan) if s[0] == "h"]
    assert hold and all(i == f"{table}_delayed_idx" and n == 0 and h == 0
                        for _, i, n, h in hold), \
        f"the hold read: {hold}\n{json.dumps(plan, indent=1)}"


def assert_bounded(plan, table):
    """No scan of table in plan reads more than a few batches, nor is sorted."""
    sorted_ = sorts_of(plan, table)
    assert all(n <= MAX_ROWS_READ for _, n in sorted_), \
        f"a claim sorted the pending rows: {sorted_}\n{json.dumps(plan, indent=1)}"
    scans = [s for s in rows_read(plan) if s[1] == table]
    assert all(n <= MAX_ROWS_READ for _, _, n in scans), \
        f"a claim read the backlog: {scans}\n{json.dumps(plan, indent=1)}"
    seq = [s for s in scans if s[0] == "Seq Scan"]
    assert not seq, f"a claim scanned the table: {seq}\n{json.dumps(plan, indent=1)}"


def ready_rows_flow(pgdb, relay_bin, tmp_path, qt, q, conn, ch, cfg):
    """Writes 100 ready rows of 10 keys above what the table holds, runs the relay and
    checks that all of them are delivered within 30 s."""
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                   "SELECT %s, 'k' || (g %% 10), '\\x01' FROM generate_series(1, 100) g", (q,))
    r = Relay(relay_bin, cfg, tmp_path / "r.log")
    try:
        got = consume(ch, q, 100, timeout=30)
    finally:
        r.assert_clean_exit(r.stop())
        ch.queue_delete(q)
        conn.close()
    assert len(got) == 100, f"{len(got)} of 100 ready rows delivered in 30 s:\n{r.text()[-2000:]}"


@pytest.mark.parametrize("mode", ["leader", "competing"])
def test_scheduled_rows_below_the_ready_ones_do_not_stall_the_claims(services, pgdb, relay_bin,
                                                                     tmp_path, mode):
    """300,000 messages scheduled an hour ahead (liboutbox's delay_ms) below the ready rows:
    the claim's walk took a step for each of them (2.2 s a claim; past a query_timeout of 1 s
    nothing was delivered, every claim cancelled). They are now passed over within the walk's
    index scans (about 50 ms a claim), and the ready rows flow."""
    table, qt, q, conn, ch, cfg = relay_table(services, pgdb, relay_bin, tmp_path, "sched",
                                              mode=mode, query_timeout="1s")
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload, available_at) "
                   "SELECT 'nowhere', 's' || (g % 1000), '\\x00', now() + interval '1 hour' "
                   "FROM generate_series(1, 300000) g")
        db.execute(f"VACUUM ANALYZE {qt}")
    ready_rows_flow(pgdb, relay_bin, tmp_path, qt, q, conn, ch, cfg)


@pytest.mark.parametrize("mode", ["leader", "competing"])
@pytest.mark.parametrize("hold", ["failed", "delayed"])
def test_rows_held_behind_their_keys_first_row_do_not_stall_the_claims(
        services, pgdb, relay_bin, tmp_path, mode, hold):
    """A hot key's first row is backing off after a failure (or was scheduled an hour
    ahead by its producer), and 300,000 later rows of the key wait behind it, below 100
    ready rows of other keys. Each claim looked at every one of the held rows, each with a
    step of its walk and a lookup of its key: 2.7 s a claim in leader mode and 13 s in
    competing mode on a quiet machine, so that past a query_timeout below that nothing was
    delivered, every claim cancelled, although those keys were free. The held rows must be
    passed over within the walk's index scans (0.17 and 0.39 s a claim), and the other
    keys' rows flow. The timeouts sit between the two with room on both sides, so that a
    machine several times slower still tells them apart."""
    timeout = "1500ms" if mode == "leader" else "3s"
    table, qt, q, conn, ch, cfg = relay_table(services, pgdb, relay_bin, tmp_path, "held",
                                              mode=mode, query_timeout=timeout)
    attempts = 1 if hold == "failed" else 0
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload, available_at, "
                   "attempts, last_error) VALUES ('nowhere', 'hot', '\\x00', "
                   "now() + interval '1 hour', %s, 'unroutable')", (attempts,))
        db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                   "SELECT 'nowhere', 'hot', '\\x00' FROM generate_series(1, 300000) g")
        db.execute(f"VACUUM ANALYZE {qt}")
    ready_rows_flow(pgdb, relay_bin, tmp_path, qt, q, conn, ch, cfg)
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        left = db.execute(f"SELECT count(*) FILTER (WHERE partition_key = 'hot'), "
                          f"count(*) FILTER (WHERE lease_owner IS NOT NULL) "
                          f"FROM {qt} WHERE sent_at IS NULL").fetchone()
    assert left == (300001, 0), f"(held rows pending, leased): {left}"


def test_a_competing_claim_on_a_table_without_the_delayed_index_keeps_its_pace(
        services, pgdb, relay_bin, tmp_path):
    """A table made by an earlier version has no index of the delayed rows. The competing
    claim's walk must not ask for each row it looks at whether an earlier row of its key is
    not due: without that index the question reads and sorts the key's pending rows below
    each row it walks, for every row (one key's backlog: 2.2 s a claim of 500 rows, and four
    times that for 1,000, past a query_timeout of 1 s). The key's first pending row answers
    it alone there (about 0.05 s a claim of 1,000), and the relay says at the default level
    that init would make the index."""
    table, qt, q, conn, ch, cfg = relay_table(services, pgdb, relay_bin, tmp_path, "noidx",
                                              mode="competing", query_timeout="1s",
                                              batch_size="1000")
    n = 20_000
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f'DROP INDEX "outbox"."{table}_delayed_idx"')
        db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                   "SELECT %s, 'hot', '\\x01' FROM generate_series(1, %s) g", (q, n))
        db.execute(f"VACUUM ANALYZE {qt}")
    r = Relay(relay_bin, cfg, tmp_path / "r.log")
    try:
        got = consume(ch, q, n, timeout=60)
    finally:
        r.assert_clean_exit(r.stop())
        ch.queue_delete(q)
        conn.close()
    assert len(got) == n, f"{len(got)} of {n} rows delivered in 60 s:\n{r.text()[-2000:]}"
    assert "missing (a table made by an earlier version)" in r.text(), r.text()
    assert "claim failed" not in r.text(), r.text()


@pytest.mark.parametrize("mode", ["leader", "competing"])
def test_claims_planned_on_a_never_analyzed_table_keep_their_pace_after_a_bulk_load(
        services, pgdb, relay_bin, tmp_path, mode):
    """The relay starts on a table `init` just made, empty and never analyzed, and plans
    its claims there (once per session). A backlog is then written at once, before
    autovacuum (off here: a table with autovacuum off, or a load in the first minute)
    analyzes the table and the plans are made again. The claims on the old plans must walk
    the backlog in id order and fetch each row where the walk found it, not read the table
    or an index for every row they take."""
    table, qt, q, conn, ch, cfg = relay_table(services, pgdb, relay_bin, tmp_path, "fresh",
                                              batch_size=str(BATCH), mode=mode)
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        db.execute(f"ALTER TABLE {qt} SET (autovacuum_enabled = off)")
        never = db.execute("SELECT reltuples < 0 FROM pg_class WHERE oid = %s::regclass",
                           (qt,)).fetchone()[0]
        auto_explain_on(db, pgdb.name)
    assert never, "the table was analyzed"

    def load():
        with psycopg.connect(pgdb.dsn, autocommit=True) as db:
            db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                       "VALUES (%s, 'k0', '\\x00')", (q,))
            assert len(consume(ch, q, 1, timeout=30)) == 1   # claims planned, table empty
            with db.transaction():   # the bulk load, in one transaction
                db.execute(f"INSERT INTO {qt} (routing_key, partition_key, payload) "
                           "SELECT %s, 'k' || (g %% 100), convert_to(repeat('x', 100), 'UTF8') "
                           "FROM generate_series(1, %s) g", (q, BACKLOG))
    plans = drained_claim_plans(services, pgdb, relay_bin, tmp_path, table, q, conn, ch, cfg,
                                before=load)
    claims = [p for p in plans if p["Plan"].get("Actual Rows", 0) >= BATCH // 2]
    assert len(claims) >= 4, f"{len(claims)} claims of the backlog in the server log"
    for p in claims:
        assert_bounded(p["Plan"], table)
        # a row taken costs its walk step, its lookups, its lock and its update: about 25
        # buffers; a lookup by id through key_idx (the plan made on the empty table, whose
        # second column is the id) reads that whole index for every row: 850 here
        top = p["Plan"]
        buffers = top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
        assert buffers <= 100 * top["Actual Rows"], \
            f"{buffers} buffers for {top['Actual Rows']} rows\n{json.dumps(p, indent=1)}"
