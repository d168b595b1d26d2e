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
#include "lib/outbox_util.h"
#include "sources/sql_pg.h"
#include "sources/sql_tsql.h"
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
    int     batch_size;      /* checked against SQL_TSQL_MAX_ROWS once the dialect is known */
    int     cleanup_batch;
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
    bool     babelfish;       /* T-SQL answered by Babelfish for PostgreSQL (@@VERSION) */
    long     native;          /* the native error number of the last error (1205: deadlock) */
    int      dialect;         /* OUTBOX_DIALECT_* */
    bool     freetds;         /* the driver is FreeTDS's libtdsodbc (see ost_run) */
    bool     autocommit;      /* autocommit on: the client never commits */
    int64_t  lock_timeout_ms; /* the session's SET LOCK_TIMEOUT (0: never set) */
    int64_t  timeout_ms;      /* > 0: the query timeout instead of the conf's (warm-up) */
    char     qt[160];         /* quoted outbox table */
    char     qd[160];         /* quoted dead-letter table */
    char     ql[160];         /* quoted leadership lease table */
    char     err[1024];       /* the last error, one line */
    odbcsrc_cur_fn cur_fn;    /* may be NULL */
    void    *cur_ud;
} odbcsrc_db;

/* How a session's transactions end (odbcsrc_db_open). */
enum odbcsrc_txn {
    ODBCSRC_TXN_CLIENT = 0,  /* autocommit off: the caller ends each with odbcsrc_db_end */
    ODBCSRC_TXN_AUTO   = 1,  /* autocommit on */
    /* the relay's requests: on SQL Server autocommit on, and every request's batch is its
       own transaction (sources/sql_tsql.c), so none waits on the client; on PostgreSQL
       as ODBCSRC_TXN_CLIENT */
    ODBCSRC_TXN_RELAY  = 2,
};

/* Connects (login timeout from the conf), transactions as asked (enum odbcsrc_txn),
 * detects the dialect. 0, or -1 with db->err set (the session is then closed). */
int  odbcsrc_db_open(odbcsrc_db *db, const odbcsrc_conf *conf, int txn);
void odbcsrc_db_close(odbcsrc_db *db);
/* Verifies the database name and (tables) that both tables exist. 0, or -1
 * with db->err (mismatch, missing table: "run outbox-relay init"). */
int  odbcsrc_db_verify(odbcsrc_db *db, bool tables);
/* Babelfish, the relay's session: runs each claim and the settle once, touching no row,
 * so that the session's first real ones do not pay their compilation (see the .c). 0,
 * or -1 with db->err. Does nothing elsewhere. */
int  odbcsrc_db_warm(odbcsrc_db *db);
/* Ends the transaction (commit or rollback). With autocommit on a commit does nothing
 * and a rollback ends only a transaction an error left open. 0 or -1. */
int  odbcsrc_db_end(odbcsrc_db *db, bool commit);

/* Statements (each inside the current transaction; the caller ends it). */
/* Takes or renews the leadership lease row (see relay/source.h): *epoch gets
 * ours (0: not leader), *held the holder's before, *holder its owner (NUL-
 * terminated into holder[hlen], "" when none), *reset the row leases released, member
 * a live member (competing mode) that kept us out ("" none; member[hlen] too). */
int  odbcsrc_db_lead(odbcsrc_db *db, const char *owner, int64_t epoch, int64_t lease_ms,
                     int64_t *got, int64_t *held, int64_t *reset, char *holder, char *member,
                     size_t hlen);
/* rows: malloc'd array of rows (ownership to the caller), sorted by id.
 * epoch > 0: fenced on the leadership lease; competing: from each key's head.
 * max_bytes > 0: the prefix in id order whose payload + headers bytes stay within it,
 * and the first row whatever its size when first_whole (src_claim_args). */
int  odbcsrc_db_claim(odbcsrc_db *db, size_t max_rows, size_t max_bytes, bool first_whole,
                      size_t max_payload, int64_t lease_ms, int64_t token, const char *owner, int64_t epoch,
                      bool competing, const int64_t *lost, size_t n_lost, row ***rows,
                      size_t *n_rows);
/* Settles the outcomes v[0..n) in one statement; *applied the rows it changed. */
int  odbcsrc_db_settle(odbcsrc_db *db, const src_outcome *v, size_t n, size_t *applied);
int  odbcsrc_db_cleanup(odbcsrc_db *db, int64_t retention_ms, size_t limit, const char *owner,
                        int64_t epoch, size_t *deleted);
int  odbcsrc_db_stats(odbcsrc_db *db, src_stats *out, bool full);
int  odbcsrc_db_init(odbcsrc_db *db);
int  odbcsrc_db_dead_list(odbcsrc_db *db, FILE *out);
int  odbcsrc_db_dead_move(odbcsrc_db *db, bool retry, const int64_t *ids, size_t n_ids,
                          size_t *affected);

/* ------------------------------------------------ statement mechanics (odbcsrc_stmt.c) */

#define MAX_PARAMS 48  /* the most any statement binds: the competing claim on PostgreSQL (36
                          markers: psqlODBC binds each $n where it occurs) */
#define P_SHORT 255    /* nvarchar(255): names, owners */
#define P_MAX   0      /* nvarchar(max) (column size 0: SQL_SS_LENGTH_UNLIMITED) */

typedef struct param {
    SQLSMALLINT ctype, stype;
    SQLULEN     colsize;
    int64_t     i64;
    SQLINTEGER  i32;
    SQLWCHAR   *w;       /* owned */
    SQLLEN      ind;
} param;

typedef struct params {
    param p[MAX_PARAMS];
    int   n;
    int   oom;
} params;

/* A value for a T-SQL statement's parameter, given by the parameter's name. */
typedef struct ost_val {
    const char *name;
    bool        text;
    int64_t     i;
    const char *s;
} ost_val;
#define TV_I(n, x) ((ost_val){ .name = (n), .i = (x) })
#define TV_S(n, x) ((ost_val){ .name = (n), .text = true, .s = (x) })

/* One value of a PostgreSQL statement's $n parameter. */
typedef struct pgv {
    enum { PV_INT, PV_TEXT, PV_NULL } t;
    int64_t     i;
    const char *s;
    SQLULEN     size;      /* PV_TEXT: P_SHORT or P_MAX */
} pgv;
#define PV_I(x)   ((pgv){ .t = PV_INT, .i = (x) })
#define PV_S(x)   ((pgv){ .t = PV_TEXT, .s = (x), .size = P_SHORT })
#define PV_BIG(x) ((pgv){ .t = PV_TEXT, .s = (x), .size = P_MAX })
#define PV_NUL    ((pgv){ .t = PV_NULL })

void ost_err(odbcsrc_db *db, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* db->err = "what: [STATE] message; ..." from h's diagnostics; db->native the first
 * record's native error; db->lost on a connection-class error. */
void ost_diag(odbcsrc_db *db, SQLSMALLINT type, SQLHANDLE h, const char *what);
void ost_p_i64(params *ps, int64_t v);
void ost_p_i32(params *ps, int64_t v);
void ost_p_text(params *ps, const char *s, SQLULEN size);
void ost_p_null(params *ps);
void ost_p_free(params *ps);
/* Binds st's parameters from its table, each from the value named like it. */
int  ost_tsql_bind(odbcsrc_db *db, const sql_tsql_stmt *st, const ost_val *v, size_t nv,
                   params *ps);
/* Both: st's text with the tables filled in (malloc'd) and ps bound. NULL with db->err. */
char *ost_tsql(odbcsrc_db *db, const sql_tsql_stmt *st, const ost_val *v, size_t nv,
               params *ps);
/* A sources/sql_pg.c statement (text owned and freed here) with `?` markers; ps
 * gets v[n - 1] for each $n in marker order. NULL with db->err. */
char *ost_pg_stmt(odbcsrc_db *db, char *text, const pgv *v, int nv, params *ps);
/* tmpl with {T}, {D}, {L} replaced by the quoted tables (malloc'd), NULL on OOM. */
char *ost_sql_for(odbcsrc_db *db, const char *tmpl);
/* Allocates a statement, binds ps, executes sql (query timeout set). 0 with *out
 * (free with ost_free), or -1 with db->err. */
int  ost_run(odbcsrc_db *db, const char *what, const char *sql, params *ps, SQLHSTMT *out);
void ost_free(odbcsrc_db *db, SQLHSTMT h);
/* Advances to the first result set with columns: 0, 1 (none), -1 error. */
int  ost_result(odbcsrc_db *db, SQLHSTMT h, const char *what);
/* Consumes the remaining results (later statements' errors surface here). */
int  ost_drain(odbcsrc_db *db, SQLHSTMT h, const char *what);
/* 1 row, 0 end, -1 error. */
int  ost_fetch(odbcsrc_db *db, SQLHSTMT h, const char *what);
int  ost_get_i64(odbcsrc_db *db, SQLHSTMT h, int col, int64_t *v, bool *isnull);
int  ost_get_f64(odbcsrc_db *db, SQLHSTMT h, int col, double *v, bool *isnull);
/* Long columns, read in chunks: text as UTF-8, binary as is (out reset first). */
int  ost_get_text(odbcsrc_db *db, SQLHSTMT h, int col, outbox_util_buf *out, bool *isnull);
int  ost_get_bin(odbcsrc_db *db, SQLHSTMT h, int col, outbox_util_buf *out, bool *isnull);
/* Runs a statement returning one row of integers; reads n of them. */
int  ost_one_row_ints(odbcsrc_db *db, const char *what, const char *sql, params *ps,
                      int64_t *v, int n);
/* Runs a statement without a result set; *count gets SQLRowCount (>= 0). */
int  ost_exec_count(odbcsrc_db *db, const char *what, const char *sql, params *ps,
                    size_t *count);

#endif
