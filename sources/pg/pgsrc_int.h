/*
 * pgsrc_int.h — internals shared by the PostgreSQL source's files:
 * connection parameters, result parsing and the claimed rows (the SQL is sources/sql_pg.c's).
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
#include "relay/row.h"
#include "relay/source.h"
#include "sources/sources.h"
#include "sources/sql_pg.h"

#define PGSRC_APP_NAME "outbox-relay"

/* Connection keywords for PQconnect*Params(expand_dbname = 1). keys/vals need
 * PGSRC_MAX_PARAMS slots; tmo is scratch space for the timeout value. The
 * strings point into ob (conninfo and password are secrets: never log). */
#define PGSRC_MAX_PARAMS 12
void pgsrc_conn_params(const cfg_outbox *ob, const char **keys, const char **vals,
                       char tmo[24]);

/* A conninfo naming several hosts, connected from another host than the first (libpq's
 * asynchronous connect never leaves a host that does not answer; see pgsrc_hosts.c).
 * pgsrc_hosts_rotate appends to keys/vals (NULL-terminated, room for PGSRC_HOST_PARAMS
 * more) the host, hostaddr and port lists rotated to start at host `first`, copies in rot
 * (NULL-initialized; the caller frees them): the number of hosts, or -1 (no memory).
 * pgsrc_hosts_after_silent: the host after the one c is trying (its index + 1; first + 1
 * when unknown, `first` with a single host), naming it in at (" at HOST:PORT; ..."). */
#define PGSRC_HOST_PARAMS 3
int pgsrc_hosts_rotate(const char *conninfo, int first, const char **keys, const char **vals,
                       char *rot[PGSRC_HOST_PARAMS]);
int pgsrc_hosts_after_silent(const char *conninfo, const PGconn *c, int first, char *at,
                             size_t atlen);

/* Copies a libpq message into out as one line (newlines folded, trailing
 * whitespace trimmed). */
void pgsrc_oneline(const char *msg, char *out, size_t outlen);

/* The stats row (sql_pg_stats, text format) into out; 0 or -1. */
int pgsrc_parse_stats(const PGresult *r, src_stats *out);

/* The oldest server the relay's statements run on: plan_cache_mode (set on the relay's
 * sessions) and WITH ... AS MATERIALIZED came with PostgreSQL 12. */
#define PGSRC_MIN_SERVER_VERSION 120000

/* Whether a server of version_num (server_version_num, as PQserverVersion gives it; 0 when
 * unknown) can run the relay: 0 yes; -1 no, with one line in msg naming the server's
 * version and the one required. */
int pgsrc_server_version_ok(int version_num, char *msg, size_t msglen);

/* A payload the claim left in the database to be read in slices (pgsrc_rows.c). */
typedef struct pgsrc_load {
    int64_t        id;
    unsigned char *buf;       /* the row's payload, size bytes (the row owns it) */
    size_t         size, got;
} pgsrc_load;

/* The rows of the claim being read (pgsrc_rows.c). */
typedef struct pgsrc_rows {
    row        **rows;        /* owned, in arrival order */
    size_t       n, cap;
    char         err[256];    /* the first row that could not be decoded ("": none) */
    size_t       max_payload; /* the claim's: a payload over it is never read (0: none is) */
    pgsrc_load  *loads;       /* the payloads to read after the claim, in arrival order */
    size_t       n_loads, cap_loads, i_load;   /* i_load: the one being read */
} pgsrc_rows;

/* Appends the claimed rows of a binary-format result (one row in single-row mode, or
   none: the final result) to c. 0 or -1 (err set; what was appended stays).
   own: NULL, or the caller's hold on r: a row whose payload is large takes r over (it
   frees it with itself) and sets *own to NULL; the caller PQclears *own. A row whose
   payload the claim left out but within max_payload gets a buffer for it, to be filled
   through pgsrc_rows_slice. */
int pgsrc_rows_decode(pgsrc_rows *c, const PGresult *r, int64_t token, PGresult **own,
                      char *err, size_t errlen);
/* The id of the next row whose payload must be read (sql_pg_payload_slices), or false. */
bool pgsrc_rows_load_next(const pgsrc_rows *c, int64_t *id);
/* Copies the slices of a result of sql_pg_payload_slices (binary format) into that row's
   payload. 0 or -1 (err set). */
int pgsrc_rows_slice(pgsrc_rows *c, const PGresult *r, char *err, size_t errlen);
/* The statement of the payload being read is done: 0 when every byte came, else -1. */
int pgsrc_rows_load_end(pgsrc_rows *c, char *err, size_t errlen);
/* Hands the rows over in id order (ownership to the caller) and empties c. */
void pgsrc_rows_take(pgsrc_rows *c, row ***rows, size_t *n);
/* Frees the rows and forgets the error and the payloads to read. */
void pgsrc_rows_free(pgsrc_rows *c);

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
