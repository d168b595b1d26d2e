/*
 * log.h — one line per event to stderr (or log_file), text or JSON.
 * The logger is process state owned by main (the daemon), not by liboutbox.
 * Never pass secrets (conninfo, URLs with passwords) to it.
 *
 *   log_msg(LOG_INFO, "SIGHUP: log reopened");
 *   log_ev(LOG_WARN, &(log_fields){ .event = "broker_blocked", .outbox = ob, .sink = sk,
 *                                   .peer = peer },
 *          "outbox=%s sink=%s: broker blocked: %s", ob, sk, why);
 *
 * A text line is "TS LEVEL message", whatever the fields. A JSON line is
 * {"ts","level","msg"} followed by each field that is set: "event", "outbox",
 * "sink", "id", "message_id", "partition_key", "peer", "error" (README,
 * Observability, lists the events). Fields cost nothing in text format; no
 * line allocates.
 */
#ifndef RELAY_LOG_H
#define RELAY_LOG_H

#include <stdint.h>
#include "config/cfg.h"

#define LOG_ERROR CFG_LOG_ERROR
#define LOG_WARN  CFG_LOG_WARN
#define LOG_INFO  CFG_LOG_INFO
#define LOG_DEBUG CFG_LOG_DEBUG

#define LOG_LINE_MAX  8192   /* a line's message part; longer is cut and ends with "..." */
#define LOG_FIELD_MAX 1024   /* a JSON field's escaped value; longer is cut the same way */

/* What a line is about. NULL or "" leaves a string field out, 0 the id.
 * Borrowed for the call only. */
typedef struct log_fields {
    const char *event;          /* stable snake_case name of the kind of event */
    const char *outbox;
    const char *sink;
    int64_t     id;             /* outbox row id */
    const char *message_id;
    const char *partition_key;
    const char *peer;           /* "host:port/database", "host:port vhost V" */
    const char *error;          /* the reason, in words (never a secret) */
} log_fields;

void log_setup(int level, int format, const char *file);  /* file NULL: stderr */
int  log_reopen(void);                                    /* SIGHUP; 0 or -1 */
int  log_enabled(int level);
void log_msg(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* log_msg with fields (f NULL: none). */
void log_ev(int level, const log_fields *f, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/*
 * Connection failures, rate-limited: one log_limit per peer connection (a
 * broker or database connection), zeroed by its owner before first use; no
 * allocation, no locking (one thread uses it). f as for log_ev (may be NULL).
 *
 *   log_fail(&ll, LOG_WARN, &f, "outbox=%s sink=%s: down: %s", ob, sk, why);  each failed attempt
 *   log_ok(&ll, LOG_INFO, &f, "outbox=%s sink=%s: connected (%s)", ob, sk, peer);  on success
 *
 * log_fail logs the first failure, and every failure whose text differs from the
 * ones logged since the last success (the last LOG_LIMIT_SEEN different texts: a
 * list of brokers tried in turn fails with one text per address), at level at
 * once. An identical repeat is logged at debug only; once it has repeated for
 * LOG_REPEAT_INTERVAL seconds it goes out at level again with " (repeated N
 * times in T s)". log_ok logs at its level and appends " after N failures" (N
 * counts every failed attempt since the last success); without a preceding
 * failure it logs the message as is, and it forgets the texts seen. The fields go
 * with every line.
 */
#define LOG_REPEAT_INTERVAL 60.0   /* seconds */
#define LOG_LIMIT_SEEN      8

typedef struct log_seen {
    uint64_t hash;                  /* of the text (FNV-1a); 0: free slot */
    double   since;                 /* monotonic time it was logged at level */
    unsigned repeats;               /* identical failures since then */
} log_seen;

typedef struct log_limit {
    log_seen seen[LOG_LIMIT_SEEN];  /* texts logged at level since the last log_ok */
    unsigned failures;              /* failed attempts since the last log_ok */
} log_limit;

void log_fail(log_limit *ll, int level, const log_fields *f, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void log_ok(log_limit *ll, int level, const log_fields *f, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The same, with the monotonic time given (tests). */
void log_fail_at(log_limit *ll, double now, int level, const log_fields *f, const char *msg);
void log_ok_at(log_limit *ll, double now, int level, const log_fields *f, const char *msg);

#endif
