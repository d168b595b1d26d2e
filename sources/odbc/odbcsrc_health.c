/*
 * odbcsrc_health.c — the outbox table's health on SQL Server (SRC_REQ_HEALTH), on the
 * source's worker thread. The claims and the leadership renewals of the same connection
 * wait while it runs, so each read runs one part, one statement under a query timeout of
 * at most 5 s (and a sixth of the lease), and reports the values of the other parts as
 * last read: a round of parts
 * takes three reads (five in a slow round). On Babelfish the first run of each statement
 * in a session takes about a second; all of them in one request held a lease renewal back
 * for five.
 *
 * Parts, in the order of a round (sources/sql_tsql.c says what each reads and the
 * permission it needs):
 *   pages      rows, used and reserved pages (VIEW DATABASE STATE);
 *   rows       rows only, from the catalog: when pages cannot be read;
 *   ghosts     ghost records (VIEW DATABASE STATE): it reads index pages, so only in slow
 *              rounds (the first, then every HEALTH_SLOW_EVERY-th);
 *   versioning whether the database keeps row versions (any login);
 *   versions   when it does: the version store's size and the oldest transaction
 *              reading or making versions (VIEW SERVER STATE).
 * A part that fails (a permission the login lacks, a view the server does not have:
 * Babelfish has none of these DMVs) is left out of the metrics, logged once at WARN with
 * the server's error and what it needs, and tried again in slow rounds; a table-health read
 * never fails the drain. Only a lost connection fails the request.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "relay/log.h"
#include "sources/odbc/odbcsrc_health.h"

#define HEALTH_SLOW_EVERY         10 /* ghost records, and parts that failed: every 10th round */
#define ODBCSRC_HEALTH_TIMEOUT_MS 5000

enum {
    HP_PAGES = 1u << 0,
    HP_ROWS = 1u << 1,
    HP_GHOSTS = 1u << 2,
    HP_VERSIONING = 1u << 3,
    HP_VERSIONS = 1u << 4
};

static const struct {
    unsigned bit;
    const char *what;  /* for log lines */
    const char *needs; /* what the login needs, and what is left out without it */
} parts[] = {
    { HP_PAGES, "rows and pages (sys.dm_db_partition_stats)",
      "VIEW DATABASE STATE (VIEW DATABASE PERFORMANCE STATE on SQL Server 2022 and later); "
      "outbox_relay_table_size_bytes and table_used_bytes are left out, the rows come from "
      "sys.partitions" },
    { HP_ROWS, "rows (sys.partitions)",
      "SELECT on the outbox table; outbox_relay_table_live_tuples is left out" },
    { HP_GHOSTS, "ghost records (sys.dm_db_index_physical_stats)",
      "VIEW DATABASE STATE (VIEW DATABASE PERFORMANCE STATE on SQL Server 2022 and later); "
      "outbox_relay_table_dead_tuples is left out" },
    { HP_VERSIONING, "the database's row versioning options (sys.databases)",
      "nothing more than a login; the version store is not watched" },
    { HP_VERSIONS,
      "the version store and its oldest transaction "
      "(sys.dm_tran_version_store_space_usage, sys.dm_tran_active_snapshot_database_transactions)",
      "VIEW SERVER STATE (VIEW SERVER PERFORMANCE STATE on SQL Server 2022 and later); "
      "outbox_relay_version_store_bytes and xmin_horizon_age_seconds are left out and a "
      "transaction holding the version store is not reported" },
};

/* A statement's query timeout: at most 5 s, the outbox's query timeout, and a sixth of
   the lease. A renewal, due at a third of the lease, must succeed before four fifths of it
   have passed (relay/drain.c): a health statement in its way leaves it most of that. */
void odbcsrc_health_init(odbcsrc_health *hs, const char *outbox, int64_t lease_ms,
                         int64_t query_timeout_ms)
{
    memset(hs, 0, sizeof *hs);
    snprintf(hs->outbox, sizeof hs->outbox, "%s", outbox ? outbox : "");
    hs->timeout_ms = ODBCSRC_HEALTH_TIMEOUT_MS;
    if (query_timeout_ms > 0 && query_timeout_ms < hs->timeout_ms)
        hs->timeout_ms = query_timeout_ms;
    if (lease_ms / 6 < hs->timeout_ms)
        hs->timeout_ms = lease_ms / 6 > 1000 ? lease_ms / 6 : 1000;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static size_t part_of(unsigned bit)
{
    size_t i = 0;
    while (i + 1 < sizeof parts / sizeof parts[0] && parts[i].bit != bit)
        i++;
    return i;
}

/* Bookkeeping after part bit ran (rc 0 ok, -1 failed with db->err). */
static void ran(odbcsrc_health *hs, const odbcsrc_db *db, unsigned bit, int rc)
{
    const size_t k = part_of(bit);
    if (rc == 0) {
        if (hs->failed & bit)
            log_ev(LOG_INFO, &(log_fields){ .event = "table_health", .outbox = hs->outbox },
                   "outbox=%s: table health: %s readable now", hs->outbox, parts[k].what);
        hs->failed &= ~bit;
        return;
    }
    hs->failed |= bit;
    if (hs->warned & bit)
        return;
    hs->warned |= bit;
    log_ev(LOG_WARN,
           &(log_fields){
               .event = "table_health_unavailable", .outbox = hs->outbox, .error = db->err },
           "outbox=%s: table health: cannot read %s: %s; it needs %s (tried again every %d "
           "rounds of reads; the relay drains as before)",
           hs->outbox, parts[k].what, db->err, parts[k].needs, HEALTH_SLOW_EVERY);
}

/* Fetches the first row of h's first result set: 0, or -1 with db->err (none, or an
   error). */
static int first_row(odbcsrc_db *db, SQLHSTMT h, const char *what)
{
    int r = ost_result(db, h, what);
    if (r == 0) {
        r = ost_fetch(db, h, what);
        if (r > 0)
            return 0;
    }
    if (r >= 0)
        ost_err(db, "%s: no result", what);
    return -1;
}

/* A statement taking the quoted outbox table as @table, reading n integers of one row. */
static int table_ints(odbcsrc_db *db, const sql_tsql_stmt *st, const char *what, int64_t *v, int n,
                      bool *isnull)
{
    params ps = { 0 };
    const ost_val tv[] = { TV_S("table", db->qt) };
    char *sql = ost_tsql(db, st, tv, 1, &ps);
    int rc = -1;
    if (sql) {
        SQLHSTMT h = SQL_NULL_HSTMT;
        if (ost_run(db, what, sql, &ps, &h) == 0) {
            int r = first_row(db, h, what);
            if (r == 0) {
                rc = 0;
                for (int i = 0; i < n && rc == 0; i++)
                    rc = ost_get_i64(db, h, i + 1, &v[i], isnull);
                if (rc == 0)
                    rc = ost_drain(db, h, what);
            }
            ost_free(db, h);
        }
    }
    free(sql);
    ost_p_free(&ps);
    return rc;
}

/* The version store and its oldest transaction into hs. */
static int versions(odbcsrc_health *hs, odbcsrc_db *db)
{
    static const char what[] = "table health: version store";
    char *sql = ost_sql_for(db, sql_tsql_health_versions.text);
    SQLHSTMT h = SQL_NULL_HSTMT;
    outbox_util_buf t = { 0 };
    int rc = -1;
    if (!sql) {
        ost_err(db, "%s: out of memory", what);
        return -1;
    }
    if (ost_run(db, what, sql, NULL, &h) < 0)
        goto done;
    if (first_row(db, h, what) < 0)
        goto done;
    int64_t bytes = 0, sid = 0, secs = 0, snap = 0, xsn = 0;
    bool none = false, isnull = false;
    if (ost_get_i64(db, h, 1, &bytes, NULL) < 0 || ost_get_i64(db, h, 2, &sid, &none) < 0 ||
        ost_get_i64(db, h, 3, &secs, NULL) < 0 || ost_get_i64(db, h, 4, &snap, NULL) < 0 ||
        ost_get_i64(db, h, 5, &xsn, NULL) < 0 || ost_get_text(db, h, 6, &t, &isnull) < 0)
        goto done;
    if (ost_drain(db, h, what) < 0)
        goto done;
    hs->vstore = bytes;
    hs->holder = !none;
    if (!none) {
        snprintf(hs->holder_name, sizeof hs->holder_name, "%s", !isnull && t.p ? t.p : "");
        snprintf(hs->holder_state, sizeof hs->holder_state, "%s",
                 snap ? "SNAPSHOT isolation" : "READ_COMMITTED_SNAPSHOT or writing versions");
        snprintf(hs->holder_xsn, sizeof hs->holder_xsn, "%" PRId64, xsn);
        hs->holder_sid = (int)sid;
        hs->holder_age_s = (double)secs;
        hs->holder_seen = mono_s();
    }
    rc = 0;
done:
    outbox_util_buf_free(&t);
    ost_free(db, h);
    free(sql);
    return rc;
}

enum { S_PAGES, S_ROWS, S_GHOSTS, S_VERSIONING, S_VERSIONS, S_COUNT };

/* Whether step applies in this round (slow: a slow round). */
static bool applies(const odbcsrc_health *hs, int step, bool slow)
{
    switch (step) {
    case S_PAGES:
        return slow || !(hs->failed & HP_PAGES);
    case S_ROWS:
        return !hs->pages_now && (slow || !(hs->failed & HP_ROWS));
    case S_GHOSTS:
        return slow;
    case S_VERSIONING:
        return slow || !(hs->failed & HP_VERSIONING);
    case S_VERSIONS:
        return hs->versioning && (slow || !(hs->failed & HP_VERSIONS));
    default:
        return false;
    }
}

/* Runs step: 0 (its values into hs), -1 failed (db->err). */
static int run_step(odbcsrc_health *hs, odbcsrc_db *db, int step)
{
    int64_t v[3];
    bool isnull = false;
    int rc;
    switch (step) {
    case S_PAGES:
        rc = table_ints(db, &sql_tsql_health_pages, "table health: pages", v, 3, NULL);
        ran(hs, db, HP_PAGES, rc);
        hs->have &= ~(SRC_H_USED | SRC_H_SIZE);
        if (rc == 0) {
            hs->live = v[0];
            hs->used = v[1] * 8192;
            hs->size = v[2] * 8192;
            hs->have |= SRC_H_LIVE | SRC_H_USED | SRC_H_SIZE;
            hs->pages_now = true;
        }
        return rc;
    case S_ROWS:
        rc = table_ints(db, &sql_tsql_health_rows, "table health: rows", v, 1, NULL);
        ran(hs, db, HP_ROWS, rc);
        hs->have &= ~SRC_H_LIVE;
        if (rc == 0) {
            hs->live = v[0];
            hs->have |= SRC_H_LIVE;
        }
        return rc;
    case S_GHOSTS:
        rc = table_ints(db, &sql_tsql_health_ghosts, "table health: ghost records", v, 1, &isnull);
        ran(hs, db, HP_GHOSTS, rc);
        hs->have &= ~SRC_H_DEAD;
        if (rc == 0 && !isnull) {
            hs->ghosts = v[0];
            hs->have |= SRC_H_DEAD;
        }
        return rc;
    case S_VERSIONING: {
        char *sql = ost_sql_for(db, sql_tsql_health_versioning.text);
        if (!sql) {
            ost_err(db, "table health: out of memory");
            rc = -1;
        } else {
            rc = ost_one_row_ints(db, "table health: row versioning", sql, NULL, v, 1);
            free(sql);
        }
        ran(hs, db, HP_VERSIONING, rc);
        hs->versioning = rc == 0 && v[0] != 0;
        if (!hs->versioning) {
            hs->have &= ~(SRC_H_VSTORE | SRC_H_HORIZON_S);
            hs->holder = false;
        }
        return rc;
    }
    case S_VERSIONS:
        rc = versions(hs, db);
        ran(hs, db, HP_VERSIONS, rc);
        hs->have &= ~(SRC_H_VSTORE | SRC_H_HORIZON_S);
        if (rc == 0)
            hs->have |= SRC_H_VSTORE | SRC_H_HORIZON_S;
        else
            hs->holder = false;
        return rc;
    default:
        return 0;
    }
}

int odbcsrc_health_read(odbcsrc_health *hs, odbcsrc_db *db, src_health *out)
{
    const int64_t saved_timeout = db->timeout_ms;

    memset(out, 0, sizeof *out);
    out->horizon_xids = -1;
    out->last_autovacuum = -1;
    out->horizon_known = true; /* what the login cannot see is left out, not "unknown" */
    if (db->dialect != OUTBOX_DIALECT_SQLSERVER) {
        out->have = SRC_H_NONE; /* PostgreSQL through ODBC: its health is libpq's */
        return 0;
    }
    /* Babelfish: a query timeout breaks the session (and a statement's first run in a
       session takes about a second), so only the 5 s bound there */
    db->timeout_ms = hs->timeout_ms;
    if (db->babelfish) {
        db->timeout_ms = ODBCSRC_HEALTH_TIMEOUT_MS;
        if (db->conf->query_timeout_ms > 0 && db->conf->query_timeout_ms < db->timeout_ms)
            db->timeout_ms = db->conf->query_timeout_ms;
    }
    /* the next step that applies, beginning a new round at the end of one (a round
       always has one: the rows, or failing that the versioning options) */
    for (int tries = 0; tries <= 2 * S_COUNT; tries++) {
        if (hs->step >= S_COUNT) {
            hs->step = 0;
            hs->round++;
            hs->pages_now = false;
        }
        const bool slow = hs->round % HEALTH_SLOW_EVERY == 0;
        const int step = hs->step++;
        if (!applies(hs, step, slow))
            continue;
        if (run_step(hs, db, step) < 0 && db->lost) {
            db->timeout_ms = saved_timeout;
            return -1;
        }
        break;
    }
    db->timeout_ms = saved_timeout;
    db->err[0] = '\0';

    out->have = hs->have ? hs->have : SRC_H_NONE;
    out->live_tuples = hs->have & SRC_H_LIVE ? hs->live : -1;
    out->used_bytes = hs->have & SRC_H_USED ? hs->used : -1;
    out->size_bytes = hs->have & SRC_H_SIZE ? hs->size : -1;
    out->dead_tuples = hs->have & SRC_H_DEAD ? hs->ghosts : -1;
    out->version_store_bytes = hs->have & SRC_H_VSTORE ? hs->vstore : -1;
    if (hs->holder && (hs->have & SRC_H_HORIZON_S)) {
        out->holder_kind = "snapshot transaction";
        out->holder_versions = true;
        out->holder_pid = hs->holder_sid;
        out->holder_name = hs->holder_name;
        out->holder_state = hs->holder_state;
        out->holder_age_s = hs->holder_age_s + (mono_s() - hs->holder_seen);
        out->holder_xmin = hs->holder_xsn;
    }
    return 0;
}
