/*
 * odbcsrc_health.c — the outbox table's health on SQL Server (SRC_REQ_HEALTH), on the
 * source's worker thread: the claims of the same connection wait for it, so each of its
 * statements runs under a short query timeout, and the expensive one (ghost records, which
 * reads index pages) only every HEALTH_SLOW_EVERY reads.
 *
 * Parts (sources/sql_tsql.c says what each reads and the permission it needs):
 *   pages      rows, used and reserved pages (VIEW DATABASE STATE);
 *   rows       rows only, from the catalog: when pages cannot be read;
 *   ghosts     ghost records (VIEW DATABASE STATE), every HEALTH_SLOW_EVERY reads;
 *   versioning whether the database keeps row versions (any login);
 *   versions   when it does: the version store's size and the oldest transaction
 *              reading or making versions (VIEW SERVER STATE).
 * A part that fails (a permission the login lacks, a view the server does not have:
 * Babelfish has none of these DMVs) is left out of the metrics, logged once at WARN with
 * the server's error and what it needs, and tried again every HEALTH_SLOW_EVERY reads; a
 * table-health read never fails the drain. Only a lost connection fails the request.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "relay/log.h"
#include "sources/odbc/odbcsrc_health.h"

#define HEALTH_SLOW_EVERY 20       /* ghost records, and parts that failed: every 20th read */
#define ODBCSRC_HEALTH_TIMEOUT_MS 5000

enum { HP_PAGES = 1u << 0, HP_ROWS = 1u << 1, HP_GHOSTS = 1u << 2, HP_VERSIONING = 1u << 3,
       HP_VERSIONS = 1u << 4 };

static const struct {
    unsigned    bit;
    const char *what;    /* for log lines */
    const char *needs;   /* what the login needs, and what is left out without it */
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
    { HP_VERSIONS, "the version store and its oldest transaction "
      "(sys.dm_tran_version_store_space_usage, sys.dm_tran_active_snapshot_database_transactions)",
      "VIEW SERVER STATE (VIEW SERVER PERFORMANCE STATE on SQL Server 2022 and later); "
      "outbox_relay_version_store_bytes and xmin_horizon_age_seconds are left out and a "
      "transaction holding the version store is not reported" },
};

void odbcsrc_health_init(odbcsrc_health *hs, const char *outbox)
{
    memset(hs, 0, sizeof *hs);
    snprintf(hs->outbox, sizeof hs->outbox, "%s", outbox ? outbox : "");
    hs->ghosts = -1;
}

static size_t part_of(unsigned bit)
{
    size_t i = 0;
    while (i + 1 < sizeof parts / sizeof parts[0] && parts[i].bit != bit)
        i++;
    return i;
}

/* Whether to try part bit on this read: always, unless it failed last time (then on slow
   reads only). */
static bool due(const odbcsrc_health *hs, unsigned bit, bool slow)
{
    return slow || !(hs->failed & bit);
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
    log_ev(LOG_WARN, &(log_fields){ .event = "table_health_unavailable", .outbox = hs->outbox,
                                    .error = db->err },
           "outbox=%s: table health: cannot read %s: %s; it needs %s (tried again every %d "
           "reads; the relay drains as before)", hs->outbox, parts[k].what, db->err,
           parts[k].needs, HEALTH_SLOW_EVERY);
}

/* A statement taking the quoted outbox table as @table, reading n integers of one row. */
static int table_ints(odbcsrc_db *db, const sql_tsql_stmt *st, const char *what, int64_t *v,
                      int n, bool *isnull)
{
    params ps = {0};
    const ost_val tv[] = { TV_S("table", db->qt) };
    char *sql = ost_tsql(db, st, tv, 1, &ps);
    int rc = -1;
    if (sql) {
        SQLHSTMT h = SQL_NULL_HSTMT;
        if (ost_run(db, what, sql, &ps, &h) == 0) {
            int r = ost_result(db, h, what);
            if (r == 0)
                r = ost_fetch(db, h, what);
            if (r == 0)
                ost_err(db, "%s: no result", what);
            else if (r > 0) {
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

/* The version store and its oldest transaction into out. */
static int versions(odbcsrc_health *hs, odbcsrc_db *db, src_health *out)
{
    static const char what[] = "table health: version store";
    char *sql = ost_sql_for(db, sql_tsql_health_versions.text);
    SQLHSTMT h = SQL_NULL_HSTMT;
    outbox_util_buf t = {0};
    int rc = -1;
    if (!sql) {
        ost_err(db, "%s: out of memory", what);
        return -1;
    }
    if (ost_run(db, what, sql, NULL, &h) < 0)
        goto done;
    int r = ost_result(db, h, what);
    if (r == 0)
        r = ost_fetch(db, h, what);
    if (r <= 0) {
        if (r == 0)
            ost_err(db, "%s: no result", what);
        goto done;
    }
    int64_t bytes = 0, sid = 0, secs = 0, snap = 0, xsn = 0;
    bool none = false, isnull = false;
    if (ost_get_i64(db, h, 1, &bytes, NULL) < 0 || ost_get_i64(db, h, 2, &sid, &none) < 0 ||
        ost_get_i64(db, h, 3, &secs, NULL) < 0 || ost_get_i64(db, h, 4, &snap, NULL) < 0 ||
        ost_get_i64(db, h, 5, &xsn, NULL) < 0 || ost_get_text(db, h, 6, &t, &isnull) < 0)
        goto done;
    if (ost_drain(db, h, what) < 0)
        goto done;
    out->version_store_bytes = bytes;
    if (!none) {
        snprintf(hs->holder_name, sizeof hs->holder_name, "%s", !isnull && t.p ? t.p : "");
        snprintf(hs->holder_state, sizeof hs->holder_state, "%s",
                 snap ? "SNAPSHOT isolation" : "READ_COMMITTED_SNAPSHOT or writing versions");
        snprintf(hs->holder_xsn, sizeof hs->holder_xsn, "%" PRId64, xsn);
        out->holder_kind = "snapshot transaction";
        out->holder_pid = (int)sid;
        out->holder_name = hs->holder_name;
        out->holder_state = hs->holder_state;
        out->holder_age_s = (double)secs;
        out->holder_xmin = hs->holder_xsn;
    }
    rc = 0;
done:
    outbox_util_buf_free(&t);
    ost_free(db, h);
    free(sql);
    return rc;
}

int odbcsrc_health_read(odbcsrc_health *hs, odbcsrc_db *db, src_health *out)
{
    const bool slow = hs->reads++ % HEALTH_SLOW_EVERY == 0;
    const int64_t saved_timeout = db->timeout_ms;
    int64_t v[3];
    bool isnull = false;
    int rc;

    memset(out, 0, sizeof *out);
    out->dead_tuples = out->live_tuples = out->size_bytes = out->used_bytes = -1;
    out->version_store_bytes = out->horizon_xids = -1;
    out->last_autovacuum = -1;
    out->horizon_known = true;     /* what the login cannot see is left out, not "unknown" */
    if (db->dialect != OUTBOX_DIALECT_SQLSERVER) {
        out->have = SRC_H_NONE;    /* PostgreSQL through ODBC: its health is libpq's */
        return 0;
    }
    if (db->conf->query_timeout_ms > ODBCSRC_HEALTH_TIMEOUT_MS)
        db->timeout_ms = ODBCSRC_HEALTH_TIMEOUT_MS;

    if (due(hs, HP_PAGES, slow)) {
        rc = table_ints(db, &sql_tsql_health_pages, "table health: pages", v, 3, NULL);
        if (rc < 0 && db->lost)
            goto lost;
        ran(hs, db, HP_PAGES, rc);
        if (rc == 0) {
            out->live_tuples = v[0];
            out->used_bytes = v[1] * 8192;
            out->size_bytes = v[2] * 8192;
            out->have |= SRC_H_LIVE | SRC_H_USED | SRC_H_SIZE;
        }
    }
    if (!(out->have & SRC_H_LIVE) && due(hs, HP_ROWS, slow)) {
        rc = table_ints(db, &sql_tsql_health_rows, "table health: rows", v, 1, NULL);
        if (rc < 0 && db->lost)
            goto lost;
        ran(hs, db, HP_ROWS, rc);
        if (rc == 0) {
            out->live_tuples = v[0];
            out->have |= SRC_H_LIVE;
        }
    }
    if (slow) {
        rc = table_ints(db, &sql_tsql_health_ghosts, "table health: ghost records", v, 1,
                        &isnull);
        if (rc < 0 && db->lost)
            goto lost;
        ran(hs, db, HP_GHOSTS, rc);
        hs->ghosts = rc == 0 && !isnull ? v[0] : -1;
    }
    if (hs->ghosts >= 0 && !(hs->failed & HP_GHOSTS)) {
        out->dead_tuples = hs->ghosts;
        out->have |= SRC_H_DEAD;
    }
    if (due(hs, HP_VERSIONING, slow)) {
        char *sql = ost_sql_for(db, sql_tsql_health_versioning.text);
        if (!sql) {
            ost_err(db, "table health: out of memory");
            rc = -1;
        } else {
            rc = ost_one_row_ints(db, "table health: row versioning", sql, NULL, v, 1);
            free(sql);
        }
        if (rc < 0 && db->lost)
            goto lost;
        ran(hs, db, HP_VERSIONING, rc);
        if (rc == 0 && v[0] != 0 && due(hs, HP_VERSIONS, slow)) {
            rc = versions(hs, db, out);
            if (rc < 0 && db->lost)
                goto lost;
            ran(hs, db, HP_VERSIONS, rc);
            if (rc == 0)
                out->have |= SRC_H_VSTORE | SRC_H_HORIZON_S;
        }
    }
    if (out->have == 0)
        out->have = SRC_H_NONE;
    db->timeout_ms = saved_timeout;
    db->err[0] = '\0';
    return 0;
lost:
    db->timeout_ms = saved_timeout;
    return -1;
}
