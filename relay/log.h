/*
 * log.h — one line per event to stderr (or log_file), text or JSON.
 * The logger is process state owned by main (the daemon), not by liboutbox.
 * Never pass secrets (conninfo, URLs with passwords) to it.
 *
 *   log_msg(LOG_WARN, "outbox=%s sink=%s: broker blocked: %s", ob, sk, why);
 */
#ifndef RELAY_LOG_H
#define RELAY_LOG_H

#include "config/cfg.h"

#define LOG_ERROR CFG_LOG_ERROR
#define LOG_WARN  CFG_LOG_WARN
#define LOG_INFO  CFG_LOG_INFO
#define LOG_DEBUG CFG_LOG_DEBUG

void log_setup(int level, int format, const char *file);  /* file NULL: stderr */
int  log_reopen(void);                                    /* SIGHUP; 0 or -1 */
int  log_enabled(int level);
void log_msg(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/*
 * Connection failures, rate-limited: one log_limit per peer connection (a
 * broker or database connection), zeroed by its owner before first use; no
 * allocation, no locking (one thread uses it).
 *
 *   log_fail(&ll, LOG_WARN, "outbox=%s sink=%s: down: %s", ob, sk, why);   each failed attempt
 *   log_ok(&ll, LOG_INFO, "outbox=%s sink=%s: connected (%s)", ob, sk, peer);  on success
 *
 * log_fail logs the first failure, and every failure whose text differs from the
 * ones logged since the last success (the last LOG_LIMIT_SEEN different texts: a
 * list of brokers tried in turn fails with one text per address), at level at
 * once. An identical repeat is logged at debug only; once it has repeated for
 * LOG_REPEAT_INTERVAL seconds it goes out at level again with " (repeated N
 * times in T s)". log_ok logs at its level and appends " after N failures" (N
 * counts every failed attempt since the last success); without a preceding
 * failure it logs the message as is, and it forgets the texts seen.
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

void log_fail(log_limit *ll, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void log_ok(log_limit *ll, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The same, with the monotonic time given (tests). */
void log_fail_at(log_limit *ll, double now, int level, const char *msg);
void log_ok_at(log_limit *ll, double now, int level, const char *msg);

#endif
