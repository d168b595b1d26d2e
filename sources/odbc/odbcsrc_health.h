/*
 * odbcsrc_health.h — the outbox table's health on SQL Server, read by the ODBC
 * source's worker thread (sources/odbc/odbcsrc_health.c; the statements are
 * sources/sql_tsql.c's sql_tsql_health_*).
 */
#ifndef ODBCSRC_HEALTH_H
#define ODBCSRC_HEALTH_H

#include <stdint.h>
#include "relay/source.h"
#include "sources/odbc/odbcsrc_int.h"

/* What one source remembers between reads; used by its worker thread only. */
typedef struct odbcsrc_health {
    char     outbox[128];     /* the outbox's name, for log lines */
    uint64_t reads;           /* health reads so far */
    unsigned failed;          /* parts whose last attempt failed (retried on slow reads) */
    unsigned warned;          /* parts whose failure was logged (once each) */
    int64_t  ghosts;          /* the last ghost record count read; -1 none yet */
    char     holder_name[256], holder_state[64], holder_xsn[24];  /* the last holder's */
} odbcsrc_health;

void odbcsrc_health_init(odbcsrc_health *hs, const char *outbox);
/* Reads what db's server and the relay's login allow into out (out->have says what);
   a part that cannot be read is left out and logged once at WARN. 0, or -1 with db->err
   when the connection is lost. Blocks, each statement bounded by the query timeout (at
   most ODBCSRC_HEALTH_TIMEOUT_MS). */
int  odbcsrc_health_read(odbcsrc_health *hs, odbcsrc_db *db, src_health *out);

#endif
