/*
 * odbcsrc_int.h — internals shared by the ODBC source's files (sources/odbc
 * only): one blocking database session (odbcsrc_db) and the statements the
 * source runs on it, in two dialects (T-SQL, PostgreSQL through psqlODBC).
 *
 * Everything here blocks (bounded by the login / query timeouts) and is
 * called either from the source's worker thread or from the synchronous admin
 * commands; never from the event loop.
 */
#ifndef ODBCSRC_INT_H
#define ODBCSRC_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sql.h>
#include <sqlext.h>
#include "config/cfg.h"
#include "lib/outbox_schema.h"
#include "relay/row.h"
#include "relay/source.h"
#include "sources/sql_pg.h"
#include "sources/sources.h"

/* What a session needs from the configuration (copied: the worker thread
 * must not read the core's cfg, which a reload may free). */
typedef struct odbcsrc_conf {
    char   *conninfo;        /* secret-bearing: never log */
    char   *password;        /* secret or NULL */
    char   *database;
    outbox_table_name tn;
    sql_pg_names pgn;        /* the same names, for the PostgreSQL statements */
    int     on_sent;         /* enum cfg_on_sent */
    int64_t query_timeout_ms;
    int64_t connect_timeout_ms;
    int64_t reconnect_max_ms;
} odbcsrc_conf;

/* Copies the fields of cfg (strings duplicated). 0, or -1 on out-of-memory. */
int  odbcsrc_conf_init(odbcsrc_conf *c, const cfg_outbox *oc);
void odbcsrc_conf_clear(odbcsrc_conf *c);

/* Cancel hook: the session reports the statement it is executing so another
 * thread can SQLCancel it (set to SQL_NULL_HSTMT when done). */
typedef void (*odbcsrc_cur_fn)(void *ud, SQLHSTMT h);

typedef struct odbcsrc_db {
    const odbcsrc_conf *conf;
    SQLHENV  env;
    SQLHDBC  dbc;
    bool     connected;       /* SQLDriverConnect succeeded, not yet disconnected */
    bool     lost;            /* the last error was connection-class */
    bool     nodata;          /* the last execution returned SQL_NO_DATA */
    int      dialect;         /* OUTBOX_DIALECT_* */
    char     qt[160];         /* quoted outbox table */
    char     qd[160];         /* quoted dead-letter table */
    char     ql[160];         /* quoted leadership lease table */
    char     err[1024];       /* the last error, one line */
    odbcsrc_cur_fn cur_fn;    /* may be NULL */
    void    *cur_ud;
} odbcsrc_db;

/* Connects (login timeout from the conf), autocommit as asked, detects the
 * dialect. 0, or -1 with db->err set (the session is then closed). */
int  odbcsrc_db_open(odbcsrc_db *db, const odbcsrc_conf *conf, bool autocommit);
void odbcsrc_db_close(odbcsrc_db *db);
/* Verifies the database name and (tables) that both tables exist. 0, or -1
 * with db->err (mismatch, missing table: "run outbox-relay init"). */
int  odbcsrc_db_verify(odbcsrc_db *db, bool tables);
/* Ends the transaction (commit or rollback). 0 or -1. */
int  odbcsrc_db_end(odbcsrc_db *db, bool commit);

/* Statements (each inside the current transaction; the caller ends it). */
/* Takes or renews the leadership lease row (see relay/source.h): *epoch gets
 * ours (0: not leader), *held the holder's before, *holder its owner (NUL-
 * terminated into holder[hlen], "" when none), *reset the row leases released. */
int  odbcsrc_db_lead(odbcsrc_db *db, const char *owner, int64_t epoch, int64_t lease_ms,
                     int64_t *got, int64_t *held, int64_t *reset, char *holder, size_t hlen);
/* rows: malloc'd array of rows (ownership to the caller), sorted by id.
 * epoch > 0: fenced on the leadership lease; competing: from each key's head. */
int  odbcsrc_db_claim(odbcsrc_db *db, size_t max_rows, int64_t lease_ms, int64_t token,
                      const char *owner, int64_t epoch, bool competing,
                      row ***rows, size_t *n_rows);
/* Settles the outcomes v[0..n) in one statement; *applied the rows it changed. */
int  odbcsrc_db_settle(odbcsrc_db *db, const src_outcome *v, size_t n, size_t *applied);
int  odbcsrc_db_cleanup(odbcsrc_db *db, int64_t retention_ms, size_t limit, const char *owner,
                        int64_t epoch, size_t *deleted);
int  odbcsrc_db_stats(odbcsrc_db *db, src_stats *out, bool full);
int  odbcsrc_db_init(odbcsrc_db *db);
int  odbcsrc_db_dead_list(odbcsrc_db *db, FILE *out);
int  odbcsrc_db_dead_move(odbcsrc_db *db, bool retry, const int64_t *ids, size_t n_ids,
                          size_t *affected);

#endif
