/* metrics.c — Prometheus text exposition (format 0.0.4). */
#include "relay/metrics.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/outbox_util.h"
#include "relay/source.h"

const double metrics_bucket_bounds[METRICS_NBUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300,
    0 /* +Inf */
};

const double loop_bucket_bounds[METRICS_NBUCKETS] = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
    5, 10, 0 /* +Inf */
};

void histogram_observe_in(histogram *h, const double *bounds, double seconds)
{
    size_t i = 0;
    while (i < METRICS_NBUCKETS - 1 && seconds > bounds[i])
        i++;
    h->buckets[i]++;
    h->count++;
    h->sum += seconds;
}

void histogram_observe(histogram *h, double seconds)
{
    histogram_observe_in(h, metrics_bucket_bounds, seconds);
}

/* One histogram without labels. */
static void hist_plain(outbox_util_buf *b, const char *name, const char *help,
                       const histogram *h, const double *bounds)
{
    outbox_util_buf_printf(b, "# HELP outbox_relay_%s %s\n# TYPE outbox_relay_%s histogram\n",
                           name, help, name);
    uint64_t cum = 0;
    for (size_t k = 0; k < METRICS_NBUCKETS; k++) {
        cum += h->buckets[k];
        if (k == METRICS_NBUCKETS - 1)
            outbox_util_buf_printf(b, "outbox_relay_%s_bucket{le=\"+Inf\"} %llu\n", name,
                                   (unsigned long long)cum);
        else
            outbox_util_buf_printf(b, "outbox_relay_%s_bucket{le=\"%g\"} %llu\n", name,
                                   bounds[k], (unsigned long long)cum);
    }
    outbox_util_buf_printf(b, "outbox_relay_%s_sum %.6f\noutbox_relay_%s_count %llu\n", name,
                           h->sum, name, (unsigned long long)h->count);
}

/* The request label of outbox_relay_database_errors_total, in enum src_req's order. */
static const char *const db_request_names[METRICS_DB_REQUESTS] = {
    "lead", "claim", "settle", "retention", "stats", "health"
};

static void counter(outbox_util_buf *b, ob_metrics *const *m, size_t n, const char *name,
                    const char *help, size_t off)
{
    outbox_util_buf_printf(b, "# HELP outbox_relay_%s %s\n# TYPE outbox_relay_%s counter\n", name, help, name);
    for (size_t i = 0; i < n; i++) {
        uint64_t v;
        memcpy(&v, (const char *)m[i] + off, sizeof v);
        outbox_util_buf_printf(b, "outbox_relay_%s{outbox=\"%s\"} %llu\n", name, m[i]->outbox,
                (unsigned long long)v);
    }
}

static void gauge_int(outbox_util_buf *b, ob_metrics *const *m, size_t n, const char *name,
                      const char *help, size_t off, int is_int)
{
    outbox_util_buf_printf(b, "# HELP outbox_relay_%s %s\n# TYPE outbox_relay_%s gauge\n", name, help, name);
    for (size_t i = 0; i < n; i++) {
        long long v;
        if (is_int) {
            int x;
            memcpy(&x, (const char *)m[i] + off, sizeof x);
            v = x;
        } else {
            int64_t x;
            memcpy(&x, (const char *)m[i] + off, sizeof x);
            v = x;
        }
        outbox_util_buf_printf(b, "outbox_relay_%s{outbox=\"%s\"} %lld\n", name, m[i]->outbox, v);
    }
}

/* The table health gauges, for the outboxes whose source reads them: each one only for
   the outboxes whose source gives it (health_have; 0 is the PostgreSQL set). */
static void health(outbox_util_buf *b, ob_metrics *const *m, size_t n)
{
    static const struct { const char *name, *help; size_t off; int dbl; unsigned bit; } g[] = {
        { "table_dead_tuples", "Dead row versions in the outbox table (the database's estimate): "
          "what vacuum has not removed yet. SQL Server: ghost records and version ghost "
          "records at the leaf level of the table's indexes (sampled, read in every 10th round "
          "of health reads): what the ghost cleanup has not removed yet.",
          offsetof(ob_metrics, table_dead_tuples), 0, SRC_H_DEAD },
        { "table_live_tuples", "Live rows in the outbox table (the database's estimate), pending "
          "and kept for retention; -1 unknown.", offsetof(ob_metrics, table_live_tuples), 0,
          SRC_H_LIVE },
        { "table_size_bytes", "The outbox table's size with its indexes and TOAST (SQL Server: "
          "reserved pages of the table, its indexes and LOB data).",
          offsetof(ob_metrics, table_size_bytes), 0, SRC_H_SIZE },
        { "table_used_bytes", "SQL Server: used pages of the outbox table, its indexes and LOB "
          "data, in bytes (compare with the rows: pages that stay while rows go are ghosts or "
          "empty space).", offsetof(ob_metrics, table_used_bytes), 0, SRC_H_USED },
        { "table_last_autovacuum_timestamp_seconds", "Unix time of the outbox table's last "
          "autovacuum; 0 never (PostgreSQL).", offsetof(ob_metrics, last_autovacuum_ts), 1,
          SRC_H_VACUUM },
        { "xmin_horizon_age_seconds", "How long the holder of the database's xmin horizon (the "
          "oldest transaction's snapshot or transaction ID, a prepared transaction or a "
          "replication slot, whose xmin vacuum may not pass to remove the outbox's dead rows) "
          "has held it: from its transaction's start, else (a slot, a walsender, a role "
          "without pg_read_all_stats) from when the relay first saw it; 0 none; -1 no "
          "table-health read yet. SQL Server, with "
          "READ_COMMITTED_SNAPSHOT or SNAPSHOT isolation on: how long the instance's oldest "
          "transaction reading or making row versions (which holds the version store and "
          "the ghost records it may read) has been open; 0 none.",
          offsetof(ob_metrics, horizon_age_s), 1, SRC_H_HORIZON_S },
        { "xmin_horizon_age_xids", "Age in transaction IDs of the database's xmin horizon "
          "(sessions, prepared transactions and replication slots); 0 none; -1 no table-health "
          "read yet (PostgreSQL).",
          offsetof(ob_metrics, horizon_xids), 0, SRC_H_HORIZON_XIDS },
        { "version_store_bytes", "SQL Server, with READ_COMMITTED_SNAPSHOT or SNAPSHOT "
          "isolation on: the version store's size for the outbox's database (in tempdb).",
          offsetof(ob_metrics, version_store_bytes), 0, SRC_H_VSTORE },
    };
    for (size_t k = 0; k < sizeof g / sizeof g[0]; k++) {
        bool head = false;
        for (size_t i = 0; i < n; i++) {
            unsigned have = m[i]->health_have ? m[i]->health_have : SRC_H_POSTGRES;
            if (!m[i]->health_seen || !(have & g[k].bit))
                continue;
            if (!head) {
                head = true;
                outbox_util_buf_printf(b, "# HELP outbox_relay_%s %s\n# TYPE outbox_relay_%s "
                                       "gauge\n", g[k].name, g[k].help, g[k].name);
            }
            const char *p = (const char *)m[i] + g[k].off;
            if (g[k].dbl) {
                double v;
                memcpy(&v, p, sizeof v);
                outbox_util_buf_printf(b, "outbox_relay_%s{outbox=\"%s\"} %.3f\n", g[k].name,
                                       m[i]->outbox, v);
            } else {
                int64_t v;
                memcpy(&v, p, sizeof v);
                outbox_util_buf_printf(b, "outbox_relay_%s{outbox=\"%s\"} %lld\n", g[k].name,
                                       m[i]->outbox, (long long)v);
            }
        }
    }
}

static void hist(outbox_util_buf *b, ob_metrics *const *m, size_t n, const char *name, const char *help,
                 size_t off)
{
    outbox_util_buf_printf(b, "# HELP outbox_relay_%s %s\n# TYPE outbox_relay_%s histogram\n", name, help, name);
    for (size_t i = 0; i < n; i++) {
        const histogram *h = (const histogram *)((const char *)m[i] + off);
        uint64_t cum = 0;
        for (size_t k = 0; k < METRICS_NBUCKETS; k++) {
            cum += h->buckets[k];
            if (k == METRICS_NBUCKETS - 1)
                outbox_util_buf_printf(b, "outbox_relay_%s_bucket{outbox=\"%s\",le=\"+Inf\"} %llu\n", name,
                        m[i]->outbox, (unsigned long long)cum);
            else
                outbox_util_buf_printf(b, "outbox_relay_%s_bucket{outbox=\"%s\",le=\"%g\"} %llu\n", name,
                        m[i]->outbox, metrics_bucket_bounds[k], (unsigned long long)cum);
        }
        outbox_util_buf_printf(b, "outbox_relay_%s_sum{outbox=\"%s\"} %.6f\n", name, m[i]->outbox, h->sum);
        outbox_util_buf_printf(b, "outbox_relay_%s_count{outbox=\"%s\"} %llu\n", name, m[i]->outbox,
                (unsigned long long)h->count);
    }
}

#define OFF(f) offsetof(ob_metrics, f)

char *metrics_render(const relay_metrics *r, ob_metrics *const *m, size_t n, size_t *len)
{
    outbox_util_buf b = { 0 };
    outbox_util_buf_printf(&b, "# HELP outbox_relay_build_info The running relay's version (always 1).\n"
                "# TYPE outbox_relay_build_info gauge\n"
                "outbox_relay_build_info{version=\"%s\"} 1\n", OUTBOX_VERSION);
    outbox_util_buf_printf(&b, "# HELP outbox_relay_config_reloads_total Configuration reloads (SIGHUP): ok = applied, error = refused, the running configuration kept.\n"
                "# TYPE outbox_relay_config_reloads_total counter\n"
                "outbox_relay_config_reloads_total{result=\"ok\"} %llu\n"
                "outbox_relay_config_reloads_total{result=\"error\"} %llu\n",
            (unsigned long long)r->reloads_ok, (unsigned long long)r->reloads_failed);
    outbox_util_buf_printf(&b, "# HELP outbox_relay_config_last_reload_successful 1 when the last configuration reload was applied (or none was tried), 0 when it was refused.\n"
                "# TYPE outbox_relay_config_last_reload_successful gauge\n"
                "outbox_relay_config_last_reload_successful %d\n"
                "# HELP outbox_relay_config_last_reload_success_timestamp_seconds Unix time the running configuration was loaded (at start or by the last applied reload).\n"
                "# TYPE outbox_relay_config_last_reload_success_timestamp_seconds gauge\n"
                "outbox_relay_config_last_reload_success_timestamp_seconds %.3f\n",
            r->last_reload_ok ? 1 : 0, r->last_reload_success_ts);
    outbox_util_buf_printf(&b, "# HELP outbox_relay_rows_in_memory Rows every outbox of the process holds (claimed and buffered, in flight, or asked for by a running claim).\n"
                "# TYPE outbox_relay_rows_in_memory gauge\n"
                "outbox_relay_rows_in_memory %zu\n"
                "# HELP outbox_relay_rows_in_memory_limit The process-wide limit on those rows (max_rows_in_memory).\n"
                "# TYPE outbox_relay_rows_in_memory_limit gauge\n"
                "outbox_relay_rows_in_memory_limit %zu\n",
            r->rows_in_memory, r->rows_in_memory_limit);
    outbox_util_buf_printf(&b, "# HELP outbox_relay_bytes_in_memory Payload and header bytes of those rows (a running claim counts the bytes it asked for; a row in flight whose payload of 64 KiB or more was written to the broker counts its headers only).\n"
                "# TYPE outbox_relay_bytes_in_memory gauge\n"
                "outbox_relay_bytes_in_memory %zu\n"
                "# HELP outbox_relay_bytes_in_memory_limit The process-wide limit on those bytes (max_bytes_in_memory).\n"
                "# TYPE outbox_relay_bytes_in_memory_limit gauge\n"
                "outbox_relay_bytes_in_memory_limit %zu\n",
            r->bytes_in_memory, r->bytes_in_memory_limit);
    hist_plain(&b, "loop_turn_seconds", "Turns of the event loop (every callback it runs between "
               "waking and waiting again), in wall time: a long one kept probes and every outbox "
               "waiting.", &r->loop.turn, loop_bucket_bounds);
    hist_plain(&b, "loop_turn_cpu_seconds", "The same turns in the loop thread's CPU time "
               "(what the relay itself spent, little inflated by other load on the machine).",
               &r->loop.turn_cpu, loop_bucket_bounds);
    outbox_util_buf_printf(&b, "# HELP outbox_relay_loop_blocked_total Turns of the event loop longer than 1 s of wall time (each logged as loop_blocked, at most once a minute).\n"
                "# TYPE outbox_relay_loop_blocked_total counter\n"
                "outbox_relay_loop_blocked_total %llu\n", (unsigned long long)r->loop.blocked);
    counter(&b, m, n, "relayed_total", "Messages confirmed by the broker and settled as sent.", OFF(relayed));
    counter(&b, m, n, "failed_total", "Failed publish attempts (returned, nacked or rejected).", OFF(failed));
    counter(&b, m, n, "returned_total", "Messages returned as unroutable (mandatory).", OFF(returned));
    counter(&b, m, n, "nacked_total", "Messages nacked by the broker.", OFF(nacked));
    counter(&b, m, n, "rejected_total", "Messages that made the broker close the channel.", OFF(rejected));
    counter(&b, m, n, "dead_total", "Rows moved to the dead-letter table by this process.", OFF(dead));
    counter(&b, m, n, "refused_total", "Rows refused before publishing (their exchange does not exist).", OFF(refused));
    counter(&b, m, n, "retried_unconfirmed_total", "In-flight messages whose confirm was lost with a connection or channel: published again, not lost.", OFF(retried_unconfirmed));
    counter(&b, m, n, "overtaken_total", "Later messages of a partition key accepted while an earlier one was refused (per-key order broken; ordering = strict rules it out).", OFF(overtaken));
    counter(&b, m, n, "expired_total", "Buffered rows given back unpublished because their lease deadline passed.", OFF(expired));
    counter(&b, m, n, "claims_total", "Claim queries run.", OFF(claims));
    counter(&b, m, n, "claimed_rows_total", "Rows leased by claims.", OFF(claimed_rows));
    counter(&b, m, n, "lease_lost_total", "Outcomes not applied because the lease had moved on.", OFF(lease_lost));
    outbox_util_buf_printf(&b, "# HELP outbox_relay_database_errors_total Database requests that "
                "failed, by request: lead (leadership), claim, settle (marks, retries, dead "
                "letters), retention, stats (backlog), health (table health). A failed connection "
                "counts once, for the request it failed.\n"
                "# TYPE outbox_relay_database_errors_total counter\n");
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < METRICS_DB_REQUESTS; k++)
            outbox_util_buf_printf(&b, "outbox_relay_database_errors_total{outbox=\"%s\","
                                   "request=\"%s\"} %llu\n", m[i]->outbox, db_request_names[k],
                                   (unsigned long long)m[i]->db_errors[k]);
    gauge_int(&b, m, n, "backlog", "Pending rows (sent_at IS NULL) at the last stats query, a row not due yet (available_at: delayed, or backing off) only once due; -1 unknown.", OFF(backlog), 0);
    outbox_util_buf_printf(&b, "# HELP outbox_relay_oldest_pending_age_seconds Age of the oldest pending row counted in the backlog (a delayed row from when it fell due).\n"
                "# TYPE outbox_relay_oldest_pending_age_seconds gauge\n");
    for (size_t i = 0; i < n; i++)
        outbox_util_buf_printf(&b, "outbox_relay_oldest_pending_age_seconds{outbox=\"%s\"} %.3f\n", m[i]->outbox,
                m[i]->oldest_pending_s);
    gauge_int(&b, m, n, "dead_rows", "Rows in the dead-letter table at the last stats query.", OFF(dead_rows), 0);
    gauge_int(&b, m, n, "source_up", "1 when the database connection is up and verified.", OFF(source_up), 1);
    gauge_int(&b, m, n, "sink_up", "1 when the broker connection is up.", OFF(sink_up), 1);
    gauge_int(&b, m, n, "sink_blocked", "1 while the broker has blocked the connection.", OFF(sink_blocked), 1);
    outbox_util_buf_printf(&b, "# HELP outbox_relay_broker_connected 1 for the broker address (of the sink's url "
                "list) the outbox's connection is up to, 0 for the others.\n"
                "# TYPE outbox_relay_broker_connected gauge\n");
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < m[i]->n_brokers; k++)
            outbox_util_buf_printf(&b, "outbox_relay_broker_connected{outbox=\"%s\",broker=\"%s\"} %d\n",
                    m[i]->outbox, m[i]->brokers[k], m[i]->broker == (long)k);
    counter(&b, m, n, "broker_failovers_total", "Broker connections made to another address of the sink's url list than the one before (failover).", OFF(failovers));
    counter(&b, m, n, "nack_reopens_total", "Publishing channels reopened because they got only nacks for nack_reopen (a quorum queue's channel stuck after a leader's node went down).", OFF(nack_reopens));
    gauge_int(&b, m, n, "leader", "1 when this relay is the active one for the outbox.", OFF(leader), 1);
    gauge_int(&b, m, n, "mode_conflict", "1 while a relay of the other mode (leader or competing) holds the outbox, so this relay claims nothing: every relay of an outbox must have the same mode.", OFF(mode_conflict), 1);
    gauge_int(&b, m, n, "leader_epoch", "Leadership epoch (fencing token) this relay holds; 0 none.", OFF(epoch), 0);
    counter(&b, m, n, "takeovers_total", "Times this relay became the active one.", OFF(takeovers));
    counter(&b, m, n, "fenced_total", "Times this relay lost leadership (a newer epoch, or its lease ran out) and stopped publishing.", OFF(fenced));
    outbox_util_buf_printf(&b, "# HELP outbox_relay_in_flight Published messages awaiting a confirm.\n"
                "# TYPE outbox_relay_in_flight gauge\n");
    for (size_t i = 0; i < n; i++)
        outbox_util_buf_printf(&b, "outbox_relay_in_flight{outbox=\"%s\"} %llu\n", m[i]->outbox,
                (unsigned long long)m[i]->in_flight);
    outbox_util_buf_printf(&b, "# HELP outbox_relay_confirmed_unmarked Confirmed messages whose mark has not committed yet (with those in flight, at most 2 x publish_window).\n"
                "# TYPE outbox_relay_confirmed_unmarked gauge\n");
    for (size_t i = 0; i < n; i++)
        outbox_util_buf_printf(&b, "outbox_relay_confirmed_unmarked{outbox=\"%s\"} %llu\n", m[i]->outbox,
                (unsigned long long)m[i]->unmarked);
    outbox_util_buf_printf(&b, "# HELP outbox_relay_buffered Claimed rows waiting to be published.\n"
                "# TYPE outbox_relay_buffered gauge\n");
    for (size_t i = 0; i < n; i++)
        outbox_util_buf_printf(&b, "outbox_relay_buffered{outbox=\"%s\"} %llu\n", m[i]->outbox,
                (unsigned long long)m[i]->buffered);
    outbox_util_buf_printf(&b, "# HELP outbox_relay_held_bytes Payload and header bytes of the outbox's buffered and in-flight rows (a payload of 64 KiB or more stops counting once written to the broker).\n"
                "# TYPE outbox_relay_held_bytes gauge\n");
    for (size_t i = 0; i < n; i++)
        outbox_util_buf_printf(&b, "outbox_relay_held_bytes{outbox=\"%s\"} %llu\n", m[i]->outbox,
                (unsigned long long)m[i]->held_bytes);
    health(&b, m, n);
    hist(&b, m, n, "confirm_latency_seconds", "Publish to broker confirm.", OFF(confirm_latency));
    hist(&b, m, n, "claim_latency_seconds", "Claim query round trip.", OFF(claim_latency));
    hist(&b, m, n, "settle_latency_seconds", "Settle (mark, retry, dead letter) round trip, commit included.", OFF(settle_latency));
    hist(&b, m, n, "end_to_end_latency_seconds", "Row created_at (producer's transaction) to broker confirm: the row's age when claimed, in the database's clock, plus our time from claim to confirm.", OFF(e2e_latency));
    if (b.failed) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}
