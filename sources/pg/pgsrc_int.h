/*
 * pgsrc_int.h — internals shared by the PostgreSQL source's files:
 * connection parameters, SQL text, array literals (sources/pg only).
 */
#ifndef PGSRC_INT_H
#define PGSRC_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <libpq-fe.h>
#include "config/cfg.h"
#include "lib/outbox_util.h"
#include "relay/source.h"
#include "sources/sources.h"

#define PGSRC_APP_NAME "outbox-relay"

/* Quoted names derived from the validated parts of ob->table. */
typedef struct pgsrc_names {
    char table[160];    /* "schema"."table" */
    char dead[160];     /* "schema"."table_dead" */
    char lease[160];    /* "schema"."table_lease": leadership lease row */
    char notify[132];   /* NOTIFY payload: schema.table (as configured parts) */
} pgsrc_names;

void pgsrc_names_init(const cfg_outbox *ob, pgsrc_names *n);

/* Connection keywords for PQconnect*Params(expand_dbname = 1). keys/vals need
 * PGSRC_MAX_PARAMS slots; tmo is scratch space for the timeout value. The
 * strings point into ob (conninfo and password are secrets: never log). */
#define PGSRC_MAX_PARAMS 12
void pgsrc_conn_params(const cfg_outbox *ob, const char **keys, const char **vals,
                       char tmo[24]);

/* Copies a libpq message into out as one line (newlines folded, trailing
 * whitespace trimmed). */
void pgsrc_oneline(const char *msg, char *out, size_t outlen);

/* Appends s as a double-quoted array element: " and \ escaped, invalid UTF-8
 * bytes replaced by '?', at most maxlen bytes of s (cut on a character boundary). */
void pgsrc_array_elem(outbox_util_buf *b, const char *s, size_t maxlen);

/* Settle arrays as PostgreSQL array literals: ids, tokens, kinds, backoffs,
 * reasons. Returns 0, or -1 on out-of-memory (all five freed). */
int  pgsrc_settle_arrays(const src_outcome *v, size_t n, outbox_util_buf out[5]);
/* "{1,2,3}" or NULL (meaning SQL NULL = all) when n == 0; malloc'd in *out. */
int  pgsrc_id_array(const int64_t *ids, size_t n, char **out);

/* The SQL text of each statement, malloc'd (NULL on out-of-memory). */
char *pgsrc_sql_lead(const pgsrc_names *n);
char *pgsrc_sql_claim(const pgsrc_names *n, bool competing);
char *pgsrc_sql_settle(const pgsrc_names *n, int on_sent);
char *pgsrc_sql_settle_sent(const pgsrc_names *n, int on_sent);
char *pgsrc_sql_cleanup(const pgsrc_names *n);
char *pgsrc_sql_stats(const pgsrc_names *n, bool full);
char *pgsrc_sql_dead_list(const pgsrc_names *n);
char *pgsrc_sql_dead_retry(const pgsrc_names *n);
char *pgsrc_sql_dead_purge(const pgsrc_names *n);

/* Stats row (text format: 4 columns) into out; 0 or -1. */
int pgsrc_parse_stats(const PGresult *r, src_stats *out);

/* Admin side (pgsrc_admin.c): synchronous, bounded by the outbox's timeouts. */
int pgsrc_check(const cfg_outbox *ob, char *err, size_t errlen);
int pgsrc_init(const cfg_outbox *ob, char *err, size_t errlen);
int pgsrc_stats_sync(const cfg_outbox *ob, src_stats *out, char *err, size_t errlen);
int pgsrc_dead_list(const cfg_outbox *ob, FILE *out, char *err, size_t errlen);
int pgsrc_dead_retry(const cfg_outbox *ob, const int64_t *ids, size_t n_ids,
                     size_t *affected, char *err, size_t errlen);
int pgsrc_dead_purge(const cfg_outbox *ob, const int64_t *ids, size_t n_ids,
                     size_t *affected, char *err, size_t errlen);

#endif
