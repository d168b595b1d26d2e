/*
 * metrics.h — per-outbox counters and gauges, rendered in Prometheus text
 * format. Written and read only on the loop thread.
 */
#ifndef RELAY_METRICS_H
#define RELAY_METRICS_H

#include <stddef.h>
#include <stdint.h>

#define METRICS_NBUCKETS 17
extern const double metrics_bucket_bounds[METRICS_NBUCKETS]; /* seconds; last = +Inf */

/* The event loop's turns take from microseconds to, when something blocks it, seconds. */
extern const double loop_bucket_bounds[METRICS_NBUCKETS];    /* seconds; last = +Inf */

typedef struct histogram {
    uint64_t buckets[METRICS_NBUCKETS]; /* non-cumulative counts */
    uint64_t count;
    double   sum;
} histogram;

/* The event loop's own turns (relay/looptime.h): from waking to waiting again. */
typedef struct loop_metrics {
    histogram turn;          /* wall seconds (loop_bucket_bounds) */
    histogram turn_cpu;      /* the loop thread's CPU seconds over the same turns */
    uint64_t  blocked;       /* turns longer than the WARN threshold (wall) */
} loop_metrics;

#define METRICS_DB_REQUESTS 6

typedef struct ob_metrics {
    const char *outbox;      /* borrowed from the config */
    const char *sink;
    uint64_t relayed;        /* confirmed and settled as sent */
    uint64_t failed;         /* failed attempts (returned + nacked + rejected) */
    uint64_t returned;       /* unroutable (basic.return) */
    uint64_t nacked;
    uint64_t rejected;       /* channel closed because of the message */
    uint64_t dead;           /* moved to the dead-letter table by this process */
    uint64_t refused;        /* refused before publishing (exchange missing): failed attempts */
    uint64_t retried_unconfirmed; /* in flight when a connection or channel was lost: sent again */
    uint64_t overtaken;      /* later rows of a key accepted while an earlier one was refused */
    uint64_t expired;        /* buffered rows given back unpublished: lease deadline passed */
    uint64_t claims;
    uint64_t claimed_rows;
    uint64_t lease_lost;     /* settles whose token no longer matched */
    /* database requests that failed, by kind: enum src_req's order (relay/source.h) less
       one; metrics.c names them */
    uint64_t db_errors[METRICS_DB_REQUESTS];
    int64_t  backlog;        /* from the last stats query; -1 unknown */
    double   oldest_pending_s;
    int64_t  dead_rows;
    int      source_up, sink_up, sink_blocked, leader;
    int      mode_conflict;  /* a relay of the other mode holds the outbox: we claim nothing */
    int64_t  epoch;          /* leadership epoch held (leader mode), 0 none */
    uint64_t takeovers;      /* times this process became the leader */
    uint64_t fenced;         /* times it lost leadership (fenced, or its lease ran out) */
    int      standby_logged; /* "standing by" was logged at INFO once */
    uint64_t in_flight;
    uint64_t buffered;
    uint64_t held_bytes;     /* payload + header bytes of its buffered and in-flight rows */
    uint64_t unmarked;       /* confirmed, mark not committed yet (counts against the window) */
    const char *const *brokers; /* borrowed: each address of the sink's url list ("host:port") */
    size_t   n_brokers;
    long     broker;         /* index of the address the broker connection is up to, -1 down */
    uint64_t failovers;      /* broker connections made to another address than the one before */
    uint64_t nack_reopens;   /* publishing channels reopened because they got only nacks */
    /* the outbox table's health (every health_interval; sources that read it) */
    int      health_seen;        /* 1: the source reads them, the gauges below are rendered
                                    (-1 each until the first read) */
    int64_t  table_dead_tuples;
    int64_t  table_live_tuples;
    int64_t  table_size_bytes;   /* table + indexes + TOAST */
    double   last_autovacuum_ts; /* Unix time; 0 never */
    double   horizon_age_s;      /* how long the xmin horizon's holder has held it; -1 unknown */
    int64_t  horizon_xids;       /* the horizon's age in transaction IDs; -1 unknown */
    int64_t  table_used_bytes;   /* SQL Server: used pages in bytes */
    int64_t  version_store_bytes; /* SQL Server: the version store's size for the database */
    unsigned health_have;        /* the gauges the source gives (SRC_H_*); 0: PostgreSQL's */
    histogram confirm_latency;
    histogram claim_latency;
    histogram settle_latency;
    histogram e2e_latency;       /* row created_at -> broker confirm (database clock at claim) */
} ob_metrics;

/* Process-wide: configuration reloads (SIGHUP). */
typedef struct relay_metrics {
    uint64_t reloads_ok;             /* reloads applied */
    uint64_t reloads_failed;         /* reloads refused: the running configuration was kept */
    int      last_reload_ok;         /* 1: the last reload was applied (or none was tried) */
    double   last_reload_success_ts; /* Unix time the running configuration was loaded */
    size_t   rows_in_memory;         /* rows every outbox holds (relay/budget.h) */
    size_t   rows_in_memory_limit;   /* max_rows_in_memory in force */
    size_t   bytes_in_memory;        /* their payload + header bytes */
    size_t   bytes_in_memory_limit;  /* max_bytes_in_memory in force */
    loop_metrics loop;               /* the event loop's turns */
} relay_metrics;

void histogram_observe(histogram *h, double seconds);                 /* metrics_bucket_bounds */
void histogram_observe_in(histogram *h, const double *bounds, double seconds);

/* Appends the exposition text for the process (r) and all outboxes to a malloc'd
   buffer. NULL on OOM. */
char *metrics_render(const relay_metrics *r, ob_metrics *const *m, size_t n, size_t *len);

#endif
