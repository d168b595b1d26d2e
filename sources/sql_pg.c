/*
 * sql_pg.c — the relay's PostgreSQL statements and the literals their values
 * travel in, for the libpq and the psqlODBC paths alike (see sql_pg.h).
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "lib/outbox_pgsql.h"
#include "lib/outbox_schema.h"
#include "sources/sql_pg.h"
#include "sources/sources.h"

void sql_pg_names_init(const cfg_outbox *ob, sql_pg_names *n)
{
    outbox_table_name t;
    memset(&t, 0, sizeof t);
    /* the parts were validated by the config loader; copy bounded */
    snprintf(t.schema, sizeof t.schema, "%s", ob->schema_part);
    snprintf(t.table, sizeof t.table, "%s", ob->table_part);
    snprintf(t.dead, sizeof t.dead, "%s", ob->dead_part);
    outbox_qualified(OUTBOX_DIALECT_POSTGRES, &t, OUTBOX_TABLE_OUTBOX, n->table, sizeof n->table);
    outbox_qualified(OUTBOX_DIALECT_POSTGRES, &t, OUTBOX_TABLE_DEAD, n->dead, sizeof n->dead);
    outbox_qualified(OUTBOX_DIALECT_POSTGRES, &t, OUTBOX_TABLE_LEASE, n->lease, sizeof n->lease);
    outbox_pg_delayed_index(&t, n->delayed, sizeof n->delayed);
    snprintf(n->notify, sizeof n->notify, "%s.%s", ob->schema_part, ob->table_part);
}

/* ------------------------------------------------------------ array literals */

void sql_pg_array_elem(outbox_util_buf *b, const char *s, size_t maxlen)
{
    size_t n = strlen(s), i = 0;
    outbox_util_buf_put(b, "\"", 1);
    while (i < n) {
        size_t l = outbox_util_utf8_seq(s + i, n - i, NULL);
        if (l == 0) {
            if (i + 1 > maxlen)
                break;
            outbox_util_buf_put(b, "\xef\xbf\xbd", 3);   /* U+FFFD, as the JSON of T-SQL */
            i++;
            continue;
        }
        if (i + l > maxlen)
            break;
        if (l == 1 && (s[i] == '"' || s[i] == '\\'))
            outbox_util_buf_put(b, "\\", 1);
        outbox_util_buf_put(b, s + i, l);
        i += l;
    }
    outbox_util_buf_put(b, "\"", 1);
}

#define SQL_PG_REASON_MAX 2000  /* bytes of a reason kept in last_error / dead reason */

int sql_pg_settle_arrays(const src_outcome *v, size_t n, outbox_util_buf out[5])
{
    int oom = 0;
    memset(out, 0, 5 * sizeof *out);
    for (int k = 0; k < 5; k++)
        outbox_util_buf_put(&out[k], "{", 1);
    for (size_t i = 0; i < n; i++) {
        const char *sep = i ? "," : "";
        outbox_util_buf_printf(&out[0], "%s%" PRId64, sep, v[i].id);
        outbox_util_buf_printf(&out[1], "%s%" PRId64, sep, v[i].lease_token);
        outbox_util_buf_printf(&out[2], "%s%d", sep, v[i].kind);
        outbox_util_buf_printf(&out[3], "%s%" PRId64, sep, v[i].backoff_ms > 0 ? v[i].backoff_ms : 0);
        outbox_util_buf_puts(&out[4], sep);
        if (v[i].reason)
            sql_pg_array_elem(&out[4], v[i].reason, SQL_PG_REASON_MAX);
        else
            outbox_util_buf_puts(&out[4], "NULL");
    }
    for (int k = 0; k < 5; k++) {
        outbox_util_buf_put(&out[k], "}", 1);
        oom |= out[k].failed;
    }
    if (oom) {
        for (int k = 0; k < 5; k++)
            outbox_util_buf_free(&out[k]);
        return -1;
    }
    return 0;
}

int sql_pg_id_array(const int64_t *ids, size_t n, char **out)
{
    outbox_util_buf b = {0};
    *out = NULL;
    if (!ids || n == 0)
        return 0;
    outbox_util_buf_put(&b, "{", 1);
    for (size_t i = 0; i < n; i++)
        outbox_util_buf_printf(&b, "%s%" PRId64, i ? "," : "", ids[i]);
    outbox_util_buf_put(&b, "}", 1);
    if (b.failed) {
        outbox_util_buf_free(&b);
        return -1;
    }
    *out = b.p;  /* ownership to the caller */
    return 0;
}

/* ------------------------------------------------------------ SQL */

static char *fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
static char *fmt(const char *f, ...)
{
    va_list ap;
    char *s = NULL;
    va_start(ap, f);
    int rc = vasprintf(&s, f, ap);
    va_end(ap);
    return rc < 0 ? NULL : s;
}

/* Leader mode and competing mode exclude each other on one outbox: a relay of one mode
 * claims nothing while a relay of the other holds the outbox (SQL_PG_LIVE_MEMBER,
 * SQL_PG_LIVE_LEADER; the one already running keeps it). Mixed, a leader would take a
 * key's later rows while a competing relay holds its earlier ones. A competing relay kept
 * out keeps its member row as it is (live until it would have expired): its row leases,
 * taken with it, never outlive it, so a leader never claims while they are live. */
#define SQL_PG_LIVE_MEMBER(L)                                                              \
    "(SELECT min(x.owner) FROM " L " x WHERE left(x.name, 7) = 'member:' "                 \
    "AND x.expires_at > now())"
#define SQL_PG_LIVE_LEADER(L)                                                              \
    "(SELECT x.owner FROM " L " x WHERE x.name = 'leader' AND x.expires_at > now())"

/* The two checks above read a statement's snapshot, blind to a lead or a competing claim
 * running at the same moment: both could succeed, and a claim of the new leader that began
 * before the competing claim committed could take later rows of the keys it holds. So the
 * two serialize on the leader row: the competing claim reads it FOR KEY SHARE (ldr), which
 * waits for a lead in flight and then returns the row as that lead left it, and the lead's
 * write of the row takes the lock that conflicts with it (FOR UPDATE's: a key column is
 * among those it sets, name). A lead after a competing claim commits later than it; its
 * claims, later still, see the claim's member row and take nothing. The row must exist for
 * this (init makes it): a competing claim that finds none makes one (expired, owner ''),
 * which holds a lead off as well until the claim commits; if a lead made it meanwhile,
 * the claim takes nothing that time. */
#define SQL_PG_LDR(L)                                                                      \
    "ldr AS MATERIALIZED (SELECT x.owner, x.expires_at FROM " L " x "                      \
    "WHERE x.name = 'leader' FOR KEY SHARE), "                                             \
    "ldr_new AS (INSERT INTO " L " (name, owner, epoch, expires_at) "                      \
    "SELECT 'leader', '', 0, 'epoch'::timestamptz WHERE NOT EXISTS (SELECT 1 FROM ldr) "   \
    "ON CONFLICT (name) DO NOTHING RETURNING 1)"
/* A live leader as ldr read it (NULL: none) */
#define SQL_PG_LDR_LIVE "(SELECT l.owner FROM ldr l WHERE l.expires_at > now())"

/* Takes or renews the leadership lease: $1 owner, $2 the epoch we hold (0 none),
 * $3 lease ms. The row is taken only when it is ours (same owner and epoch:
 * a renewal) or expired in database time, and only while no relay in competing mode
 * is a live member; a takeover increments the epoch (the fencing token) and releases
 * every row lease left by earlier holders (r): the leases its snapshot shows, each only as
 * it was there. A lead that waited for a competing claim in flight (SQL_PG_LDR) decides
 * from a snapshot taken before that claim committed, so it may still take the lease; the
 * rows that claim leased were updated since, READ COMMITTED checks r's conditions again on
 * the row as the claim left it, and the subquery o, which reads the statement's snapshot,
 * finds the lease there different: the claim's leases stay (released, they were claimed
 * and published again beside the claim's copies). A subquery (a primary-key lookup for
 * each leased row), not a join: the plan of a join under stale statistics made a takeover
 * over 150,000 pending rows outlast the query timeout. While a member is live, our own
 * row (a lead and a competing claim ran at the same moment; or a resign, lease 0) expires
 * now (rel), so that the competing relays go on at once. Setting name (unchanged) makes
 * the write of the row wait for a competing claim in flight (SQL_PG_LDR).
 * Returns: our epoch (NULL: not leader), the holder (NULL: none, or the row a competing
 * claim made) and epoch before, the
 * number of row leases released, a live member (competing mode) that kept us out. */
char *sql_pg_lead(const sql_pg_names *n)
{
    return fmt(
        "WITH cur AS (SELECT nullif(owner, '') AS owner, epoch FROM %2$s "
        "WHERE name = 'leader'), "
        "mem AS (SELECT " SQL_PG_LIVE_MEMBER("%2$s") " AS owner), "
        "up AS (INSERT INTO %2$s AS l (name, owner, epoch, expires_at) "
        "SELECT 'leader', $1::text, 1, now() + $3::float8 * interval '1 millisecond' "
        "FROM mem WHERE mem.owner IS NULL "
        "ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name, owner = EXCLUDED.owner, "
        "epoch = CASE WHEN l.owner = EXCLUDED.owner AND l.epoch = $2::bigint THEN l.epoch "
        "ELSE l.epoch + 1 END, expires_at = EXCLUDED.expires_at "
        "WHERE (l.owner = EXCLUDED.owner AND l.epoch = $2::bigint) OR l.expires_at < now() "
        "RETURNING l.epoch), "
        "rel AS (UPDATE %2$s l SET expires_at = least(l.expires_at, now()) FROM mem "
        "WHERE mem.owner IS NOT NULL AND l.name = 'leader' AND l.owner = $1::text "
        "AND l.epoch = $2::bigint RETURNING 1), "
        "r AS (UPDATE %1$s m SET lease_owner = NULL, lease_token = NULL, lease_until = NULL "
        "WHERE m.sent_at IS NULL AND m.lease_token IS NOT NULL "
        "AND (SELECT ROW(o.lease_owner, o.lease_token, o.lease_until) FROM %1$s o "
        "WHERE o.id = m.id) IS NOT DISTINCT FROM ROW(m.lease_owner, m.lease_token, m.lease_until) "
        "AND EXISTS (SELECT 1 FROM up WHERE up.epoch <> $2::bigint) RETURNING 1) "
        "SELECT (SELECT epoch FROM up), (SELECT owner FROM cur), (SELECT epoch FROM cur), "
        "(SELECT count(*) FROM r), (SELECT owner FROM mem)",
        n->table, n->lease);
}

/*
 * Competing mode spreads partition keys over the live instances. Each claim
 * renews this instance's member row in the lease table (name 'member:<owner>',
 * expires_at = now() + lease; a lease of 0 withdraws it, NULL leaves it as it is),
 * reusing an expired member row when it has none, so the table stays as small as the
 * largest set of instances ever alive at once (no DELETE privilege needed). The claim then
 * takes keyed rows only of the keys that hash to this instance's rank among the
 * live members (owners in sort order). Membership is only a preference: the
 * per-key gap filter of the claim still keeps a key with whichever instance
 * holds its unsettled rows, so order holds while members come and go.
 */
/* CTEs me, own, reuse, ins, mem. L: the lease table; OWNER: text; LEASE_MS: float8 */
#define SQL_PG_MEMBERSHIP(L, OWNER, LEASE_MS)                                              \
    "me AS (SELECT x.owner, 'member:' || x.owner AS name, "                                \
    "now() + x.ms * interval '1 millisecond' AS until "                                    \
    "FROM (SELECT " OWNER " AS owner, " LEASE_MS " AS ms) x), "                            \
    "own AS (UPDATE " L " l SET expires_at = me.until FROM me WHERE l.name = me.name "     \
    "AND me.until IS NOT NULL RETURNING 1), "                                              \
    "reuse AS (UPDATE " L " l SET name = me.name, owner = me.owner, epoch = 0, "           \
    "expires_at = me.until FROM me, (SELECT o.name FROM " L " o "                          \
    "WHERE left(o.name, 7) = 'member:' AND o.expires_at < now() "                          \
    "AND NOT EXISTS (SELECT 1 FROM " L " x, me WHERE x.name = me.name) "                   \
    "ORDER BY o.name LIMIT 1 FOR UPDATE SKIP LOCKED) o "                                   \
    "WHERE l.name = o.name AND me.until > now() RETURNING 1), "                            \
    "ins AS (INSERT INTO " L " (name, owner, epoch, expires_at) "                          \
    "SELECT me.name, me.owner, 0, me.until FROM me WHERE me.until > now() "                \
    "AND NOT EXISTS (SELECT 1 FROM " L " x WHERE x.name = me.name) "                       \
    "AND NOT EXISTS (SELECT 1 FROM reuse) ON CONFLICT (name) DO NOTHING RETURNING 1), "    \
    "mem AS (SELECT count(*)::int + 1 AS n, "                                              \
    "(count(*) FILTER (WHERE l.owner < me.owner))::int AS r FROM " L " l, me "             \
    "WHERE left(l.name, 7) = 'member:' AND l.owner <> me.owner AND l.expires_at > now())"

/* Row M (an alias) is ours to take under the membership above: no key, or its
   key hashes to our rank. */
#define SQL_PG_MY_KEY(M)                                                                   \
    "(" M ".partition_key IS NULL OR mod(hashtext(" M ".partition_key) & 2147483647, "     \
    "(SELECT n FROM mem)) = (SELECT r FROM mem))"

/* The claim: $1 limit, $2 owner, $3 token, $4 lease ms, $5 epoch.
 * Leader mode (epoch > 0): fenced on the leadership lease; a key's rows wait
 * behind an earlier row of the key that failed (attempts > 0) or is not due yet.
 * Competing mode: a row of a key is taken only when every earlier pending row
 * of its key is ours already (live lease) or locked by this very claim — so
 * another instance's claim running now (it holds those rows' locks: SKIP
 * LOCKED) or done (they carry its live lease) keeps the key: at any moment one
 * instance holds the unsettled rows of a key. Per key this costs one index
 * scan to the first row that is neither (the "gap"). Keys whose first pending
 * row another instance holds, or that wait behind a failed row, are skipped
 * before the LIMIT so they do not crowd out free keys. The claim also renews
 * this instance's membership and takes only keys that hash to it among the live
 * members (sources/sql_pg.h; $4 = 0 withdraws the membership). */
/* A claimed row's size for the byte limit: what src_row_bytes counts of the row the
   claim returns (its payload, its headers as text). octet_length of a bytea reads the
   stored length, without fetching a large payload. */
#define SQL_PG_ROW_BYTES(M)                                                                \
    "(coalesce(octet_length(" M ".payload), 0)::bigint + "                                 \
    "coalesce(octet_length(" M ".headers::text), 0))"

/* A payload larger than $8 bytes ($8 = 0: none is), which the sink could never publish:
   the claim leaves it in the database and returns its size instead (the last column), so
   the relay dead-letters the row without reading it. Such a row counts for its headers
   only in the byte limit. */
#define SQL_PG_WITHHELD(M) "($8::bigint > 0 AND octet_length(" M ".payload) > $8::bigint)"
#define SQL_PG_CLAIMED_BYTES(M)                                                            \
    "(CASE WHEN " SQL_PG_WITHHELD(M) " THEN coalesce(octet_length(" M ".headers::text), 0) " \
    "ELSE " SQL_PG_ROW_BYTES(M) " END)"

/* The byte limit of sql_pg_claim_bytes over the candidates C (id, sz), as a CTE `b`:
   a prefix in id order whose running sum stays within $6 ($6 = 0: no limit), and the
   first row whatever its size when $7. A prefix, never rows after one left out: a
   key's rows stay in order. */
#define SQL_PG_BYTE_PREFIX(C)                                                              \
    "b AS (SELECT z.id FROM (SELECT " C ".id, sum(" C ".sz) OVER w AS run, "               \
    "row_number() OVER w AS rn FROM " C " WINDOW w AS (ORDER BY " C ".id "                 \
    "ROWS UNBOUNDED PRECEDING)) z "                                                        \
    "WHERE $6::bigint = 0 OR z.run <= $6::bigint OR (z.rn = 1 AND $7::boolean)) "

/* Row M is due: its available_at has come, or it was not delayed when written (an
   available_at not later than its created_at). The second part counts a row written in a
   transaction that began after the claim's and committed before the claim read the table:
   the claim sees it, and by the claim's now() alone it would not be due yet, while the
   claims' hold (SQL_PG_NOT_DUE_BEFORE) knows only the rows delayed when written and would
   let its key's later rows go first. */
#define SQL_PG_DUE(M) "(" M ".available_at <= now() OR " M ".available_at <= " M ".created_at)"

/* A CTE `w` (id, tid): the pending rows of table T in id order, found one at a time by
   walking pending_idx ("the first pending id after the last one"), only when GUARD (an
   uncorrelated condition) holds. Rows are made as they are read: a claim that takes the
   first rows stops the walk there (LIMIT over a nested loop on w, which keeps w's
   order), whatever the size of the backlog.
   Each comes with where the walk found it (its ctid), by which the claim then fetches and
   locks it (c0): a fetch by ctid has no other plan, where a lookup by id alone may be
   planned on key_idx, whose second column is the id, reading that whole index for every
   row taken. A plan made on a table init had just made (empty, never analyzed) did so,
   and the relay keeps its plan until the table is analyzed: after a bulk load of
   150,000 rows, 850 buffers a row and 1.4-1.9 s a claim of 500, against 25 and 50 ms.
   A row changed since the walk read it is locked in its latest version and checked
   again (EvalPlanQual), as through an index.
   Why a walk and not ORDER BY id LIMIT n over the pending rows: the planner chooses
   between walking pending_idx and reading every pending row then sorting them by the
   number of pending rows it believes there are. Its statistics lag behind a backlog
   written at once (a bulk load, a catch-up after an outage): until the table is
   analyzed again it believes a few rows, prefers the read-and-sort, and each claim then
   reads and sorts the whole backlog (150,000 rows: 0.1-0.4 s a claim, more than the
   query timeout on a loaded server). Each step of the walk asks for one row, which
   the planner can never believe to be fewer than there are: the ordered index scan
   with its LIMIT 1 is then its cheapest plan, stale statistics or not.
   The walk starts at $12: the floor $9, or past it while a transaction that wrote many
   rows is still open (see SQL_PG_NONE_PASSED_OVER and the PostgreSQL source). The floor is
   a lower bound below which no row is pending or can become pending
   (sql_pg_floor_probe; 0: the table's start): pending_idx keeps an entry for every
   row marked since the table was last vacuumed, at the low end of the index, and with the
   xmin horizon held back none of them can go; a walk from the start crosses them all. The
   bound is read through a subquery so that the planner estimates the claim alike whatever
   its value: otherwise each value plans better than the generic plan, and where the
   relay sets nothing on its session (psqlODBC), plan_cache_mode = auto would plan the
   claim at every execution again (it keeps a generic plan only when that costs no more
   than the plans made with the values).
   The walk passes over the ids in $10 (SQL_PG_HELD) within its index scans: rows the relay
   holds under a live lease of its own, which the claim would not take. Under a steady
   stream they are most of the pending rows (published, waiting for their confirm or their
   mark), and each step of the walk and each candidate's lookup costs an index descent
   and a row lock attempt: 27 steps for 7 rows taken, seen.
   Each step also passes over the rows not due yet (available_at ahead: scheduled by their
   producer, or backing off) within its index scan, as a filter on the row: a claim takes
   none of them, and 300,000 messages scheduled an hour ahead below the ready rows cost a
   walk of a step each, 2.2 s a claim (past query_timeout: nothing was claimed any more);
   filtered, 53 ms. A row falling due is found by the next claim, which walks from the floor
   (no row below it is pending).
   TAKE is the rest of what the claim asks of a row before it locks it: its key is not held
   back (behind a failed row or one not due; in competing mode also: the key hashes to this
   relay and its first pending row is no other relay's). In the relay's own sessions
   (SQL_PG_CLAIM_WALK, see claim) it is a filter within the walk's index scans too, so that
   a key held back costs each claim a look at each of its rows and their key, not a step of
   the walk and a candidate's lookups each: 300,000 rows of a hot key waiting behind its
   failed first row made every claim run past a query_timeout of 1 s, and the other keys'
   rows waited with them. Elsewhere TAKE is "true" and c0 asks it of each candidate. */
#define SQL_PG_HELD(P) P ".id <> ALL (coalesce($10::bigint[], '{}'))"
#define SQL_PG_WALK(T, GUARD, TAKE)                                                        \
    "w(id, tid) AS ((SELECT p.id, p.ctid FROM " T " p WHERE p.sent_at IS NULL "            \
    "AND p.id >= (SELECT $12::bigint) AND " SQL_PG_HELD("p") " AND " SQL_PG_DUE("p") " "    \
    "AND " TAKE " AND " GUARD " ORDER BY p.id LIMIT 1) "                                   \
    "UNION ALL SELECT s.id, s.tid FROM w, LATERAL (SELECT p.id, p.ctid AS tid FROM " T " p " \
    "WHERE p.sent_at IS NULL AND p.id > w.id AND " SQL_PG_HELD("p") " "                    \
    "AND " SQL_PG_DUE("p") " AND " TAKE " ORDER BY p.id LIMIT 1) s)"

/* Row M was leased by one of this relay's claims that failed without an answer ($11, the
   tokens of src_claim_args.lost): such a claim may have committed, and the relay never got
   its rows. A claim takes them as if their lease had ended (SQL_PG_CLAIMABLE), and the
   competing claim's per-key check counts them as not ours. */
#define SQL_PG_LOST(M) M ".lease_token = ANY (coalesce($11::bigint[], '{}'))"
#define SQL_PG_CLAIMABLE(M)                                                                \
    "(" M ".lease_until IS NULL OR " M ".lease_until < now() OR " SQL_PG_LOST(M) ")"

#define SQL_PG_STR_(x) #x
#define SQL_PG_STR(x) SQL_PG_STR_(x)
/* sql_pg_claim_sliced: a payload over SQL_PG_SLICE_BYTES (and within $8) is left out of the
   answer like one over $8, its size in the last column, and counts whole in the byte limit:
   the relay reads it afterwards in slices (sql_pg_payload_slices). */
#define SQL_PG_LEFT_OUT(M)                                                                 \
    "(" SQL_PG_WITHHELD(M) " OR octet_length(" M ".payload) > "                            \
    SQL_PG_STR(SQL_PG_SLICE_BYTES) ")"

/* The lookups by key below read a key's pending rows through key_idx or failing_idx,
   both on (partition_key, id): each asks for the first row in (partition_key, id) order
   within a range of that order, which only those indexes deliver without reading and
   sorting rows. The ordinary form (partition_key = k ... ORDER BY id) would let the
   planner walk pending_idx in id order and filter on the key instead, and when the
   statistics were taken while no row was pending it believes that index to hold about
   one row, which it prefers (reading it looks sequential), whatever the backlog: every
   lookup then reads the pending rows ahead of the key's. A sort, in these forms, is what
   the alternatives cost, and the relay's sessions rule sorts out where a plan without
   one exists (enable_sort off, see the PostgreSQL source's session setup): the index
   path is then the plan, whatever the statistics say. */

/* A recursive CTE `f` (partition_key, first_failed): each key's first failed pending row
   (attempts > 0), in key order, found one key at a time through failing_idx ("the first
   failed row of the next key after this one"): as many index probes as keys with a
   failed row, plus one. */
#define SQL_PG_FAILED_KEYS(T)                                                              \
    "f(partition_key, first_failed) AS ((SELECT p.partition_key, p.id FROM " T " p "      \
    "WHERE p.sent_at IS NULL AND p.attempts > 0 AND p.partition_key IS NOT NULL "          \
    "ORDER BY p.partition_key, p.id LIMIT 1) UNION ALL SELECT q.partition_key, q.id "      \
    "FROM f, LATERAL (SELECT p.partition_key, p.id FROM " T " p WHERE p.sent_at IS NULL "  \
    "AND p.attempts > 0 AND p.partition_key > f.partition_key "                            \
    "ORDER BY p.partition_key, p.id LIMIT 1) q)"

/* Row P (an alias) is a pending row of key K before id ID: the range of
   (partition_key, id) from (K, the claims' floor $9) up to (K, ID), which key_idx reads
   from there and ends at ID. It starts at the floor, not at the key's first entry: no row
   below the floor is pending, and key_idx keeps an entry for each of the key's rows marked
   since the last vacuum, below the floor (all of them while the xmin horizon is held back;
   a lookup from the key's first entry crosses them all). The last conditions repeat the
   range's ends for a session where sorts are allowed (through a pooler, or through
   psqlODBC, the relay sets nothing on its session): there a plan on pending_idx reads the
   pending rows between the floor and ID, no more (as the form key = K did). The failed
   keys' lookup has no such bound: there, with statistics that saw nothing pending, each of
   its steps may read the pending rows. */
#define SQL_PG_KEY_BEFORE(P, K, ID)                                                        \
    "(" P ".partition_key, " P ".id) >= (" K ", (SELECT $9::bigint)) "                     \
    "AND (" P ".partition_key, " P ".id) < (" K ", " ID ") "                               \
    "AND " P ".sent_at IS NULL AND " P ".id >= (SELECT $9::bigint) AND " P ".id < " ID

/* A pending row of key K before id ID that is not due (available_at ahead: delayed by its
   producer, or backing off): a subquery that returns one when there is one, read from
   delayed_idx, on (partition_key, available_at, id) over the pending rows whose
   available_at is later than their created_at (written delayed, or delayed since: a
   back-off, a retried dead letter), and only from there: the order asked for (key, then
   available_at, from now on) is that index's alone, so no plan but the index's avoids a
   sort, which the relay's sessions rule out (see the PostgreSQL source's session setup),
   stale statistics or not; the id's bound is checked in the index (an index-only
   scan). In a subquery of its own: EXISTS drops the ORDER BY and LIMIT of the
   query it is given, and with them what rules the other plans out.
   Under a steady stream no row is delayed and that index is empty: the lookup is a
   descent into an index of a page, where a look at the key's first pending row (key_idx,
   then the row) and a read of the key's rows in flight cost more than the rest of the
   claim per row. A row not delayed when written is due (SQL_PG_DUE): it need not be
   in that index. On a table made before delayed_idx (init creates it), the lookup gives
   the same answer, reading the key's pending rows. */
#define SQL_PG_NOT_DUE_BEFORE(T, K, ID)                                                    \
    "(SELECT 1 FROM (SELECT h.id FROM " T " h "                                            \
    "WHERE (h.partition_key, h.available_at) > (" K ", now()) "                            \
    "AND (h.partition_key, h.available_at) <= (" K ", 'infinity') AND h.sent_at IS NULL "  \
    "AND h.available_at > h.created_at AND h.id >= (SELECT $9::bigint) AND h.id < " ID " " \
    "ORDER BY h.partition_key, h.available_at LIMIT 1) hd)"

/* A claim whose walk starts past the floor ($12 > $9, see SQL_PG_WALK) passes over the
   rows between them, and in leader mode nothing else would keep a key's later row from
   going before one of them: row A may be taken only when its key has no pending row in
   [$9, $12) but those this relay holds under a live lease (published or being published,
   in order). A look into key_idx over that range, for the rows of keys that have any there;
   none at all when the walk starts at the floor. In competing mode the gap (g) would drop
   such a row too, but only after the LIMIT: a hot key's rows would crowd the others out. */
#define SQL_PG_NONE_PASSED_OVER(T, A)                                                      \
    "((SELECT $12::bigint) <= (SELECT $9::bigint) OR NOT EXISTS (SELECT 1 FROM "           \
    "(SELECT h.id FROM " T " h "                                                           \
    "WHERE " SQL_PG_KEY_BEFORE("h", A ".partition_key", "(SELECT $12::bigint)") " "        \
    "AND NOT coalesce(h.lease_owner = $2::text "                                           \
    "AND h.lease_until >= now() AND NOT " SQL_PG_LOST("h") ", false) "                     \
    "ORDER BY h.partition_key, h.id LIMIT 1) hp))"

/* What a claim asks of row A (an alias of table T) before it locks it, beside its lease
   (TAKE, see SQL_PG_WALK). Leader mode: its key has no earlier failed row (the CTE f) nor
   one not due. Competing mode: its key hashes to this relay, and the key's first pending
   row, when it comes before this one, is neither another relay's (live lease) nor not
   due; NOT_DUE, a condition asked first (CASE makes sure of it), says that an earlier row
   of the key is not due. Both: no pending row of the key that the walk started past
   (SQL_PG_NONE_PASSED_OVER). */
#define SQL_PG_LEADER_TAKE(T, A)                                                           \
    "(" A ".partition_key IS NULL OR (NOT EXISTS (SELECT 1 FROM f "                        \
    "WHERE f.partition_key = " A ".partition_key AND f.first_failed < " A ".id) "          \
    "AND NOT EXISTS " SQL_PG_NOT_DUE_BEFORE(T, A ".partition_key", A ".id") " "            \
    "AND " SQL_PG_NONE_PASSED_OVER(T, A) "))"
#define SQL_PG_COMPETING_TAKE(T, A, NOT_DUE)                                               \
    "(" SQL_PG_MY_KEY(A) " AND (" A ".partition_key IS NULL OR CASE WHEN " NOT_DUE " "     \
    "THEN false ELSE NOT EXISTS (SELECT 1 FROM (SELECT h.available_at, h.created_at, "     \
    "h.lease_owner, h.lease_until FROM " T " h "                                           \
    "WHERE " SQL_PG_KEY_BEFORE("h", A ".partition_key", A ".id") " "                       \
    "ORDER BY h.partition_key, h.id LIMIT 1) hd "                                          \
    "WHERE (hd.lease_until >= now() AND hd.lease_owner IS DISTINCT FROM $2::text) "        \
    "OR NOT " SQL_PG_DUE("hd") ") AND " SQL_PG_NONE_PASSED_OVER(T, A) " END))"

static char *claim(const sql_pg_names *n, bool competing, bool sliced, int form)
{
    static const char ret_sized[] =
        "RETURNING m.id, m.message_id, m.exchange, m.routing_key, m.partition_key, "
        "m.message_type, m.content_type, m.correlation_id, m.headers::text, "
        "CASE WHEN " SQL_PG_WITHHELD("m") " THEN NULL ELSE m.payload END, "
        "m.attempts, (extract(epoch from m.created_at) * 1000000)::bigint, "
        "(extract(epoch from now() - m.created_at) * 1000000)::bigint, "
        "CASE WHEN " SQL_PG_WITHHELD("m") " THEN octet_length(m.payload)::bigint END";
    static const char ret_sliced[] =
        "RETURNING m.id, m.message_id, m.exchange, m.routing_key, m.partition_key, "
        "m.message_type, m.content_type, m.correlation_id, m.headers::text, "
        "CASE WHEN " SQL_PG_LEFT_OUT("m") " THEN NULL ELSE m.payload END, "
        "m.attempts, (extract(epoch from m.created_at) * 1000000)::bigint, "
        "(extract(epoch from now() - m.created_at) * 1000000)::bigint, "
        "CASE WHEN " SQL_PG_LEFT_OUT("m") " THEN octet_length(m.payload)::bigint END";
    const char *ret = sliced ? ret_sliced : ret_sized;
    /* The candidates carry their size (SZ), and the rows leased are their prefix within
       the byte limit (the CTE b). */
#define SZ ", " SQL_PG_CLAIMED_BYTES("m") " AS sz"
    /* TAKE goes into the walk (SQL_PG_CLAIM_WALK: the relay's own sessions, where sorts
       are ruled out and each step of the walk is an ordered index scan, whatever the
       statistics), or else is asked of each candidate the walk brings (c0). Where sorts
       are allowed (through a pooler, through psqlODBC), a step of the walk may be planned
       as a read of every pending row, then a sort, when the statistics lag behind (a
       backlog written at once): TAKE there would look up the key of every pending row at
       every step (two competing relays through PgBouncer, 6,000 rows: nothing claimed
       before the leases ran out).
       In the walk, competing mode asks first whether an earlier row of the key is not due
       (SQL_PG_NOT_DUE_BEFORE), from the index of the delayed rows
       (SQL_PG_CLAIM_DELAYED_IDX: the table has it), a page under a steady stream: it
       answers at once for each row held behind one (300,000 rows of a key behind its
       scheduled first row: 0.39 s a claim, against more than 1 s for the look at the key's
       first pending row alone). Without that index (a table made by an earlier version)
       the question would read and sort the key's pending rows for every row walked; the
       look at the key's first pending row answers it alone then. */
    bool walk = (form & SQL_PG_CLAIM_WALK) != 0;
    char *take, *sql = NULL;
    if (!competing)
        take = walk ? fmt(SQL_PG_LEADER_TAKE("%1$s", "p"), n->table)
                    : fmt(SQL_PG_LEADER_TAKE("%1$s", "m"), n->table);
    else if (!walk)
        take = fmt(SQL_PG_COMPETING_TAKE("%1$s", "m", "false"), n->table);
    else if (form & SQL_PG_CLAIM_DELAYED_IDX)
        take = fmt("(" SQL_PG_CLAIMABLE("p") " AND "
                   SQL_PG_COMPETING_TAKE("%1$s", "p", "EXISTS " SQL_PG_NOT_DUE_BEFORE(
                       "%1$s", "p.partition_key", "p.id")) ")", n->table);
    else
        take = fmt("(" SQL_PG_CLAIMABLE("p") " AND "
                   SQL_PG_COMPETING_TAKE("%1$s", "p", "false") ")", n->table);
    if (!take)
        return NULL;
    const char *walk_take = walk ? take : "true", *c0_take = walk ? "true" : take;
    if (!competing)
        /* The claim commits durably, as marks do: a claim a crashed server forgot leaves
           the relay holding rows whose leases are gone; they are claimed and published
           again beside the relay's copies (a whole batch seen after an immediate restart),
           more duplicates than the rows in flight and awaiting their mark.
           Each key's first failed pending row, once per claim (f, SQL_PG_FAILED_KEYS):
           looked up per candidate row instead, the planner may scan pending_idx below the
           row for every candidate, and under a held xmin horizon that index keeps an entry
           for every row marked since: a claim then costs candidates x marked rows (9 s
           seen).
           The candidates are found by walking pending_idx in id order (w, SQL_PG_WALK),
           each pending row looked at in turn until $1 of them can be taken: see there.
           A key's rows also wait behind any of its pending rows that is not due
           (SQL_PG_NOT_DUE_BEFORE, before the LIMIT, so that such keys do not crowd out the
           others): without it a row its producer delayed was overtaken by the later rows of
           its key. */
        sql = fmt(
            "WITH RECURSIVE " SQL_PG_FAILED_KEYS("%1$s") ", "
            SQL_PG_WALK("%1$s", "($5::bigint = 0 OR EXISTS (SELECT 1 FROM %2$s ld "
                        "WHERE ld.name = 'leader' AND ld.owner = $2::text "
                        "AND ld.epoch = $5::bigint AND ld.expires_at > now() "
                        "AND " SQL_PG_LIVE_MEMBER("%2$s") " IS NULL))", "%4$s") ", "
            "c0 AS (SELECT x.id, x.partition_key, x.sz FROM w, LATERAL (SELECT m.id, "
            "m.partition_key" SZ " FROM %1$s m "
            "WHERE m.ctid = w.tid AND m.id = w.id AND m.sent_at IS NULL AND " SQL_PG_DUE("m") " "
            "AND " SQL_PG_CLAIMABLE("m") " AND %5$s "
            "FOR UPDATE SKIP LOCKED) x LIMIT $1::bigint), "
            SQL_PG_BYTE_PREFIX("c0")
            "UPDATE %1$s m SET lease_owner = $2::text, lease_token = $3::bigint, "
            "lease_until = now() + $4::float8 * interval '1 millisecond' "
            "FROM b WHERE m.id = b.id %3$s",
            n->table, n->lease, ret, walk_take, c0_take);
    else
        sql = fmt(
        "WITH RECURSIVE " SQL_PG_LDR("%3$s") ", "
        SQL_PG_MEMBERSHIP("%3$s", "$2::text", "(CASE WHEN $4::float8 = 0 "
                          "OR " SQL_PG_LDR_LIVE " IS NULL THEN $4::float8 END)") ", "
        SQL_PG_WALK("%1$s", "($5::bigint >= 0 AND (EXISTS (SELECT 1 FROM ldr) "
                    "OR EXISTS (SELECT 1 FROM ldr_new)) AND " SQL_PG_LDR_LIVE " IS NULL)",
                    "%4$s")
        ", "
        "c0 AS (SELECT x.id, x.partition_key, x.sz FROM w, LATERAL (SELECT m.id, "
        "m.partition_key" SZ " FROM %1$s m WHERE m.ctid = w.tid AND m.id = w.id "
        "AND m.sent_at IS NULL "
        "AND " SQL_PG_DUE("m") " AND " SQL_PG_CLAIMABLE("m") " AND %5$s "
        "FOR UPDATE SKIP LOCKED) x LIMIT $1::bigint), "
        /* per key, the first pending row that is neither ours (live lease) nor locked by
           this claim: nothing of the key at or after it may be taken now. Only one below
           the key's last row in c0 matters (one after it holds back nothing c0 took): the
           lookup reads the key's rows below that one (SQL_PG_KEY_BEFORE). */
        "k AS (SELECT partition_key, max(id) AS last FROM c0 WHERE partition_key IS NOT NULL "
        "GROUP BY partition_key), "
        "g AS MATERIALIZED (SELECT k.partition_key, (SELECT p.id FROM %1$s p "
        "WHERE " SQL_PG_KEY_BEFORE("p", "k.partition_key", "k.last") " "
        "AND NOT coalesce(p.lease_owner = $2::text AND p.lease_until >= now() "
        "AND NOT " SQL_PG_LOST("p") ", false) "
        "AND p.id NOT IN (SELECT id FROM c0) ORDER BY p.partition_key, p.id LIMIT 1) AS gap "
        "FROM k), "
        "c AS (SELECT c0.id, c0.sz FROM c0 LEFT JOIN g ON g.partition_key = c0.partition_key "
        "WHERE c0.partition_key IS NULL OR g.gap IS NULL OR c0.id < g.gap), "
        SQL_PG_BYTE_PREFIX("c")
        "UPDATE %1$s m SET lease_owner = $2::text, lease_token = $3::bigint, "
        "lease_until = now() + $4::float8 * interval '1 millisecond' "
        "FROM b WHERE m.id = b.id %2$s",
        n->table, ret, n->lease, walk_take, c0_take);
    free(take);
    return sql;
#undef SZ
}

char *sql_pg_claim_bytes(const sql_pg_names *n, bool competing, int form)
{
    return claim(n, competing, false, form);
}

char *sql_pg_claim_sliced(const sql_pg_names *n, bool competing, int form)
{
    return claim(n, competing, true, form);
}

/* The floor probe (see sql_pg.h): $1 the floor in use, $2 the lock holders the previous probe
   saw (text[] of virtualtransaction, NULL: none), $3 the table's quoted name. The lowest
   pending id is looked for from the floor in use: no row below it is pending. The floor is
   read through a subquery, as in the claim's walk (SQL_PG_WALK), so that the planner
   estimates the probe alike whatever its value and the prepared probe keeps its generic
   plan. */
char *sql_pg_floor_probe(const sql_pg_names *n)
{
    return fmt("SELECT (SELECT p.id FROM %s p WHERE p.sent_at IS NULL "
               "AND p.id >= (SELECT $1::bigint) "
               "ORDER BY p.id LIMIT 1), pg_sequence_last_value(q.seq), "
               "(SELECT s.seqcache FROM pg_catalog.pg_sequence s WHERE s.seqrelid = q.seq), "
               "(SELECT array_agg(l.virtualtransaction)::text FROM pg_catalog.pg_locks l "
               "WHERE l.locktype = 'relation' AND l.relation = $3::regclass "
               "AND l.mode = 'RowExclusiveLock' AND l.granted), "
               "NOT EXISTS (SELECT 1 FROM pg_catalog.pg_locks l WHERE l.locktype = 'relation' "
               "AND l.relation = $3::regclass AND l.virtualtransaction = ANY ($2::text[])) "
               "FROM (SELECT pg_catalog.pg_get_serial_sequence($3::text, 'id')::regclass AS seq) q",
               n->table);
}

/* The payload is read whole once (the concatenation makes an in-memory copy of it: a
   substring of a compressed value would decompress it again for every slice), then
   returned from that copy in order, one row per slice. */
char *sql_pg_payload_slices(const sql_pg_names *n)
{
    return fmt("SELECT g.o, substring(p.v from g.o for $2::int) "
               "FROM (SELECT m.payload || '\\x'::bytea AS v FROM %s m "
               "WHERE m.id = $1::bigint AND m.lease_token = $3::bigint OFFSET 0) p, "
               "LATERAL generate_series(1, octet_length(p.v), $2::int) AS g(o)",
               n->table);
}

/* The settle of a batch whose outcomes are all SENT (the usual case): $1 ids, $2 their
 * lease tokens. One plain UPDATE (or DELETE) instead of the general statement below,
 * which unpacks five arrays and runs four data-modifying CTEs even when three of them
 * have nothing to do: PostgreSQL spends about a quarter less on it, and the settle's
 * time is what confirmed rows wait in the publish window. Returns the rows applied.
 * A mark commits durably (the server's synchronous_commit), as the claims do: a
 * mark a server forgot in a crash, or that a standby promoted with synchronous
 * replication never received, would make its row published once more after the relay
 * had dropped it, a duplicate beyond the rows in flight and awaiting their mark. */
char *sql_pg_settle_sent(const sql_pg_names *n, int on_sent)
{
    if (on_sent == CFG_ON_SENT_DELETE)
        return fmt("WITH s AS (DELETE FROM %s m "
                   "USING unnest($1::bigint[], $2::bigint[]) "
                   "AS u(id, token) WHERE m.id = u.id AND m.lease_token = u.token RETURNING 1) "
                   "SELECT count(*) FROM s", n->table);
    return fmt("WITH s AS (UPDATE %s m SET sent_at = now(), "
               "lease_owner = NULL, "
               "lease_token = NULL, lease_until = NULL FROM unnest($1::bigint[], $2::bigint[]) "
               "AS u(id, token) WHERE m.id = u.id AND m.lease_token = u.token RETURNING 1) "
               "SELECT count(*) FROM s", n->table);
}

/* A row's attempts after one more failed (A: its count now): a count outside 0..2^31 - 2
   (written by hand) is taken as its nearest bound, so the sum never overflows the column
   (an error would fail the whole settle, every row in it, again and again), as the
   ledger counts (ledger.c, attempt_failed). */
#define SQL_PG_ATTEMPT_NEXT(A) "(least(greatest(" A ", 0), 2147483646) + 1)"

char *sql_pg_settle(const sql_pg_names *n, int on_sent)
{
    char sent[512];
    if (on_sent == CFG_ON_SENT_DELETE)
        snprintf(sent, sizeof sent,
                 "DELETE FROM %s m USING u WHERE u.kind = %d AND m.id = u.id "
                 "AND m.lease_token = u.token RETURNING m.id",
                 n->table, SRC_SENT);
    else
        snprintf(sent, sizeof sent,
                 "UPDATE %s m SET sent_at = now(), lease_owner = NULL, lease_token = NULL, "
                 "lease_until = NULL FROM u WHERE u.kind = %d AND m.id = u.id "
                 "AND m.lease_token = u.token RETURNING m.id",
                 n->table, SRC_SENT);
    return fmt(
        "WITH u AS (SELECT DISTINCT ON (id) id, token, kind, backoff, reason "
        "FROM unnest($1::bigint[], $2::bigint[], $3::int[], $4::bigint[], $5::text[]) "
        "AS x(id, token, kind, backoff, reason) ORDER BY id), "
        "s AS (%2$s), "
        "r AS (UPDATE %1$s m SET attempts = " SQL_PG_ATTEMPT_NEXT("m.attempts") ", "
        "last_error = u.reason, "
        "available_at = now() + u.backoff::float8 * interval '1 millisecond', "
        "lease_owner = NULL, lease_token = NULL, lease_until = NULL "
        "FROM u WHERE u.kind = %4$d AND m.id = u.id AND m.lease_token = u.token RETURNING m.id), "
        "x AS (UPDATE %1$s m SET lease_owner = NULL, lease_token = NULL, lease_until = NULL "
        "FROM u WHERE u.kind = %6$d AND m.id = u.id AND m.lease_token = u.token RETURNING m.id), "
        "d AS (DELETE FROM %1$s m USING u WHERE u.kind = %5$d AND m.id = u.id "
        "AND m.lease_token = u.token "
        "RETURNING m.id, m.message_id, m.exchange, m.routing_key, m.partition_key, "
        "m.message_type, m.content_type, m.correlation_id, m.headers, m.payload, m.created_at, "
        "m.available_at, m.attempts, u.reason), "
        "i AS (INSERT INTO %3$s (id, " OUTBOX_PRODUCER_COLS ", available_at, attempts, reason) "
        "SELECT id, " OUTBOX_PRODUCER_COLS ", available_at, " SQL_PG_ATTEMPT_NEXT("attempts") ", "
        "coalesce(reason, 'dead-lettered') FROM d "
        "ON CONFLICT (id) DO UPDATE SET message_id = EXCLUDED.message_id, "
        "exchange = EXCLUDED.exchange, routing_key = EXCLUDED.routing_key, "
        "partition_key = EXCLUDED.partition_key, message_type = EXCLUDED.message_type, "
        "content_type = EXCLUDED.content_type, correlation_id = EXCLUDED.correlation_id, "
        "headers = EXCLUDED.headers, payload = EXCLUDED.payload, "
        "created_at = EXCLUDED.created_at, available_at = EXCLUDED.available_at, attempts = EXCLUDED.attempts, "
        "reason = EXCLUDED.reason, dead_at = now() RETURNING 1) "
        "SELECT (SELECT count(*) FROM s) + (SELECT count(*) FROM r) + (SELECT count(*) FROM x) "
        "+ (SELECT count(*) FROM i)",
        n->table, sent, n->dead, SRC_RETRY, SRC_DEAD, SRC_UNCLAIM);
}

/* $1 retention ms, $2 limit, $3 owner, $4 epoch (> 0: fenced on the leadership lease).
 * The oldest marked rows, up to the limit, through the sent-at index; then each of them by
 * its primary key. The ids go through an array, not `id IN (subquery)`: the planner joins
 * such a subquery like a table, and once a batch is more than a few thousandths of the
 * table it hashes the batch and reads the whole table to match it (1,000,000 marked rows,
 * a batch of 10,000: every statement read the million rows, 0.4 s each instead of 0.03,
 * and retention took 47 s instead of 7). An array is probed in the primary key whatever
 * its size. */
char *sql_pg_cleanup(const sql_pg_names *n)
{
    return fmt(
        "DELETE FROM %1$s WHERE id = ANY (ARRAY(SELECT id FROM %1$s WHERE sent_at IS NOT NULL "
        "AND sent_at < now() - $1::float8 * interval '1 millisecond' "
        "AND ($4::bigint = 0 OR EXISTS (SELECT 1 FROM %2$s f WHERE f.name = 'leader' "
        "AND f.owner = $3::text AND f.epoch = $4::bigint AND f.expires_at > now())) "
        "ORDER BY sent_at LIMIT $2::bigint))",
        n->table, n->lease);
}

/* Backlog, age of the oldest pending row, dead rows, with `full` the marked rows kept
 * for retention (-1 without: counting them reads every retained row — millions with a
 * week of retention — too much for the relay's periodic refresh; `outbox-relay stats`
 * counts them), and the seconds until the first pending row that cannot be claimed now
 * (delayed, backing off, leased) can be (NULL: none), and the relay holding the
 * leadership lease (NULL: none; a relay in competing mode waits while there is one). One
 * scan of the pending rows.
 * A row not due yet (delayed by its producer, or backing off after a failure) is not
 * waiting yet: it counts in neither the backlog nor the age, and once due its age counts
 * from when it fell due (scheduled messages must not look like a stuck outbox; the rows of
 * a key held behind a failing row are due, and age). */
#define STATS_HEAD                                                                         \
    "SELECT p.n, greatest(coalesce(extract(epoch from now() - p.oldest), 0), 0)::float8, "  \
    "(SELECT count(*) FROM %2$s), %3$s, extract(epoch from p.due - now())::float8, "        \
    SQL_PG_LIVE_LEADER("%4$s") " "                                                        \
    "FROM (SELECT count(*) FILTER (WHERE available_at <= now()) AS n, "                     \
    "min(greatest(created_at, available_at)) FILTER (WHERE available_at <= now()) "         \
    "AS oldest, "                                                                          \
    "min(greatest(available_at, lease_until)) FILTER (WHERE available_at > now() "          \
    "OR lease_until >= now()) AS due FROM %1$s WHERE sent_at IS NULL) p"

char *sql_pg_stats(const sql_pg_names *n, bool full)
{
    char kept[300];
    if (full)
        snprintf(kept, sizeof kept, "(SELECT count(*) FROM %s WHERE sent_at IS NOT NULL)",
                 n->table);
    else
        snprintf(kept, sizeof kept, "-1::bigint");
    return fmt(STATS_HEAD, n->table, n->dead, kept, n->lease);
}

/* The table's health, read every health_interval: dead and live tuples (estimates of the
 * statistics system), table + indexes + TOAST size, last autovacuum (Unix time), whether
 * this role sees when other roles' transactions began, and the holder of the oldest xmin
 * that can hold back the vacuum of this table, the one furthest behind in transaction IDs:
 *  - a session of this database other than this one, through its snapshot (backend_xmin)
 *    or its own transaction ID (backend_xid: a transaction that wrote and stays open, even
 *    one in READ COMMITTED between statements, holds no snapshot but holds the horizon);
 *  - a walsender, whose xmin is a standby's with hot_standby_feedback;
 *  - a prepared transaction of this database (pg_prepared_xacts), which holds its ID until
 *    COMMIT PREPARED or ROLLBACK PREPARED, with no session at all;
 *  - a replication slot's xmin. A logical slot's catalog_xmin holds back only the system
 *    catalogs, not this table, and is left out.
 * Its seconds: how long a session has held its xmin, as far as the database says: since
 * its transaction began, or, running a statement without a transaction ID, since that
 * statement began (in READ COMMITTED each statement takes a new snapshot; in REPEATABLE
 * READ this says less than the truth the first time); how long a prepared transaction has
 * been prepared; -1 where the database does not say (a walsender, whose xmin moves with
 * its standby's feedback; a slot) and NULL where this role may not see it (another role's
 * xact_start and state, without pg_read_all_stats or pg_monitor: the fifth column).
 * The relay then counts from when it first saw the holder keep this very xmin. Other
 * roles' backend_xmin, backend_xid and application_name are visible to every role.
 * $1 is the table's quoted, qualified name (sql_pg_names.table), read as a regclass: the
 * name travels as a value, never pasted into the statement's text. */
char *sql_pg_health(void)
{
    return fmt(
        "SELECT s.n_dead_tup, s.n_live_tup, pg_total_relation_size(s.relid), "
        "coalesce(extract(epoch from s.last_autovacuum)::float8, 0), "
        "pg_has_role('pg_read_all_stats', 'USAGE'), "
        "h.kind, h.pid, h.name, h.state, h.secs, h.xids, h.xmin "
        "FROM pg_stat_user_tables s LEFT JOIN LATERAL (SELECT * FROM ("
        "SELECT 'session'::text AS kind, a.pid, a.application_name AS name, a.state, "
        "CASE WHEN a.backend_type = 'walsender' THEN -1 ELSE greatest(extract(epoch from "
        "now() - CASE WHEN a.backend_xid IS NULL AND a.state = 'active' THEN a.query_start "
        "ELSE a.xact_start END), 0) END::float8 AS secs, "
        "greatest(age(a.backend_xmin), age(a.backend_xid))::bigint AS xids, "
        "(CASE WHEN a.backend_xmin IS NULL OR age(a.backend_xid) > age(a.backend_xmin) "
        "THEN a.backend_xid ELSE a.backend_xmin END)::text AS xmin FROM pg_stat_activity a "
        "WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL) "
        "AND a.pid <> pg_backend_pid() "
        "AND (a.datname = current_database() OR a.backend_type = 'walsender') "
        "UNION ALL SELECT 'prepared transaction', 0, t.gid, 'prepared by ' || t.owner, "
        "greatest(extract(epoch from now() - t.prepared), 0)::float8, "
        "age(t.transaction)::bigint, t.transaction::text FROM pg_prepared_xacts t "
        "WHERE t.database = current_database() "
        "UNION ALL SELECT 'replication slot', 0, r.slot_name::text, "
        "CASE WHEN r.active THEN 'active' ELSE 'inactive' END, -1, age(r.xmin)::bigint, "
        "r.xmin::text FROM pg_replication_slots r WHERE r.xmin IS NOT NULL) x "
        "ORDER BY x.xids DESC, x.secs DESC NULLS LAST LIMIT 1) h ON true "
        "WHERE s.relid = $1::regclass");
}

char *sql_pg_dead_list(const sql_pg_names *n)
{
    return fmt(
        "SELECT id, message_id::text, exchange, routing_key, attempts, "
        "to_char(dead_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), reason "
        "FROM %s ORDER BY id",
        n->dead);
}

char *sql_pg_dead_retry(const sql_pg_names *n)
{
    /* One statement: the delete and the insert commit together. */
    return fmt(
        "WITH d AS (DELETE FROM %2$s WHERE $1::bigint[] IS NULL OR id = ANY($1::bigint[]) "
        "RETURNING id, " OUTBOX_PRODUCER_COLS ") "
        "INSERT INTO %1$s (id, " OUTBOX_PRODUCER_COLS ", available_at, attempts) "
        "OVERRIDING SYSTEM VALUE SELECT id, " OUTBOX_PRODUCER_COLS ", now(), 0 FROM d",
        n->table, n->dead);
}

char *sql_pg_dead_purge(const sql_pg_names *n)
{
    return fmt("DELETE FROM %s WHERE $1::bigint[] IS NULL OR id = ANY($1::bigint[])", n->dead);
}

char *sql_pg_tables_exist(void)
{
    return fmt("SELECT (to_regclass($1::text) IS NOT NULL)::int, "
               "(to_regclass($2::text) IS NOT NULL)::int, "
               "(to_regclass($3::text) IS NOT NULL)::int, "
               "(to_regclass($4::text) IS NOT NULL)::int");
}

/* ------------------------------------------------------------ ODBC markers */

char *sql_pg_qmarks(const char *sql, int *order, size_t max, size_t *n_order)
{
    return outbox_sql_qmarks(sql, order, max, n_order);   /* shared with liboutbox */
}
