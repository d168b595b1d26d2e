/*
 * odbcsrc_health.h — the outbox table's health on SQL Server, read by the ODBC
 * source's worker thread (sources/odbc/odbcsrc_health.c; the statements are
 * sources/sql_tsql.c's sql_tsql_health_*).
 */
#ifndef ODBCSRC_HEALTH_H
#define ODBCSRC_HEALTH_H

#include <stdbool.h>
#include <stdint.h>
#include "relay/source.h"
#include "sources/odbc/odbcsrc_int.h"

/* What one source remembers between reads; used by its worker thread only. Each read
   runs one part (one statement) and reports every value last read (have says which). */
typedef struct odbcsrc_health {
    char     outbox[128];     /* the outbox's name, for log lines */
    int64_t  timeout_ms;      /* each statement's query timeout */
    uint64_t round;           /* rounds of parts begun */
    int      step;            /* the next part of this round */
    bool     pages_now;       /* this round read the pages (no fallback to the rows) */
    bool     versioning;      /* the database keeps row versions (as last read) */
    unsigned failed;          /* parts whose last attempt failed (retried in slow rounds) */
    unsigned warned;          /* parts whose failure was logged (once each) */
    unsigned have;            /* SRC_H_* of the values below */
    int64_t  live, used, size, ghosts, vstore;
    bool     holder;          /* a transaction held the version store at the last read */
    int      holder_sid;
    double   holder_age_s, holder_seen;  /* its age then, and when (monotonic seconds) */
    char     holder_name[256], holder_state[64], holder_xsn[24];
} odbcsrc_health;

/* lease_ms: the outbox's lease, which bounds how long a statement may keep a renewal
   waiting (see the .c); query_timeout_ms: the outbox's query timeout. */
void odbcsrc_health_init(odbcsrc_health *hs, const char *outbox, int64_t lease_ms,
                         int64_t query_timeout_ms);
/* Reads the next part of what db's server and the relay's login allow, and gives every
   value last read in out (out->have says which); a part that cannot be read is left out
   and logged once at WARN. 0, or -1 with db->err when the connection is lost. Blocks for
   one statement, bounded by hs->timeout_ms (at most 5 s). */
int  odbcsrc_health_read(odbcsrc_health *hs, odbcsrc_db *db, src_health *out);

#endif
