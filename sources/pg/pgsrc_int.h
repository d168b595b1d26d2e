/*
 * pgsrc_int.h — internals shared by the PostgreSQL source's files:
 * connection parameters and result parsing (the SQL is sources/sql_pg.c's).
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
#include "sources/sql_pg.h"

#define PGSRC_APP_NAME "outbox-relay"

/* Connection keywords for PQconnect*Params(expand_dbname = 1). keys/vals need
 * PGSRC_MAX_PARAMS slots; tmo is scratch space for the timeout value. The
 * strings point into ob (conninfo and password are secrets: never log). */
#define PGSRC_MAX_PARAMS 12
void pgsrc_conn_params(const cfg_outbox *ob, const char **keys, const char **vals,
                       char tmo[24]);

/* A conninfo naming several hosts, connected from another host than the first (libpq's
 * asynchronous connect never leaves a host that does not answer; see pgsrc.c).
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

/* The oldest server the relay's statements run on: plan_cache_mode (the claims' custom
 * plans) and WITH ... AS MATERIALIZED came with PostgreSQL 12. */
#define PGSRC_MIN_SERVER_VERSION 120000

/* Whether a server of version_num (server_version_num, as PQserverVersion gives it; 0 when
 * unknown) can run the relay: 0 yes; -1 no, with one line in msg naming the server's
 * version and the one required. */
int pgsrc_server_version_ok(int version_num, char *msg, size_t msglen);

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
