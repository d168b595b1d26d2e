/*
 * sql_tsql.h — the relay's T-SQL statements (sources/sql_tsql.c): text with `?`
 * parameters and {T}/{D}/{L} table placeholders, run by the ODBC source.
 *
 * Each statement declares its parameters once, in a table next to its text: the
 * text opens with `DECLARE @name type = ?, ...` in the table's order, and the ODBC
 * source binds from the table by name (sources/odbc/odbcsrc_stmt.c), so a call
 * site never depends on the markers' order. tests/c/sql_test.c checks that every
 * statement's markers and declarations match its table.
 */
#ifndef OUTBOX_SOURCES_SQL_TSQL_H
#define OUTBOX_SOURCES_SQL_TSQL_H

#include <stddef.h>
#include <sql.h>
#include <sqlext.h>

/* One parameter: its name in the text (without @), ODBC C type, SQL type and
   column size (text: 255 for nvarchar(255), 0 for nvarchar(max); numbers: 0). */
typedef struct sql_tsql_param {
    const char *name;
    SQLSMALLINT ctype;
    SQLSMALLINT stype;
    SQLULEN     size;
} sql_tsql_param;

typedef struct sql_tsql_stmt {
    const char           *name;      /* for error lines and tests */
    const char           *text;
    const sql_tsql_param *params;    /* in marker order */
    size_t                n_params;
} sql_tsql_stmt;

extern const sql_tsql_stmt sql_tsql_lead;
extern const sql_tsql_stmt sql_tsql_claim;
extern const sql_tsql_stmt sql_tsql_claim_competing;
extern const sql_tsql_stmt sql_tsql_settle_head;
extern const sql_tsql_stmt sql_tsql_settle_mark;
extern const sql_tsql_stmt sql_tsql_settle_delete;
extern const sql_tsql_stmt sql_tsql_settle_tail;
extern const sql_tsql_stmt sql_tsql_cleanup;
extern const sql_tsql_stmt sql_tsql_stats;
extern const sql_tsql_stmt sql_tsql_stats_kept;
extern const sql_tsql_stmt sql_tsql_stats_leader;
extern const sql_tsql_stmt sql_tsql_dead_list;
extern const sql_tsql_stmt sql_tsql_dead_retry;
extern const sql_tsql_stmt sql_tsql_dead_purge;
extern const sql_tsql_stmt sql_tsql_tables_exist;
extern const sql_tsql_stmt sql_tsql_version;
extern const sql_tsql_stmt sql_tsql_compat;
/* the table's health (sources/odbc/odbcsrc_health.c) */
extern const sql_tsql_stmt sql_tsql_health_pages;
extern const sql_tsql_stmt sql_tsql_health_rows;
extern const sql_tsql_stmt sql_tsql_health_ghosts;
extern const sql_tsql_stmt sql_tsql_health_versioning;
extern const sql_tsql_stmt sql_tsql_health_versions;
/* Every statement above, NULL-terminated (for tests). */
extern const sql_tsql_stmt *const sql_tsql_all[];

/* The most rows one statement touches on SQL Server: below the 5,000 locks on one
   table at which SQL Server escalates a statement's row locks to a table lock (which
   READPAST does not skip: every producer and every other relay would wait). Settles
   are split into statements of at most this many outcomes, the lease reset and the
   dead-letter moves loop in batches of it, and the configuration refuses a larger
   batch_size or cleanup_batch for a `source = sqlserver` outbox. */
#define SQL_TSQL_MAX_ROWS 4000
/* OPENJSON (settle, dead retry and purge) needs the database's compatibility level
   at 130 or higher. */
#define SQL_TSQL_MIN_COMPAT 130

/* The connected database's name. */
#define SQL_TSQL_CURRENT_DATABASE "SELECT DB_NAME()"
/* Appended to outbox_tsql_session_options by every relay session (see odbcsrc_db.c):
   the relay, not the application, is chosen as the victim of a deadlock. */
#define SQL_TSQL_SESSION_TAIL \
    ";\nSET XACT_ABORT ON;\nSET TRANSACTION ISOLATION LEVEL READ COMMITTED;" \
    "\nSET DEADLOCK_PRIORITY LOW;"
/* Ends a transaction an error left open, and only then (never a ROLLBACK outside one). */
#define SQL_TSQL_ROLLBACK_OPEN "IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION"
/* SQL Server's native error number of a deadlock victim. */
#define SQL_TSQL_DEADLOCK 1205
/* A lock wait over the session's LOCK_TIMEOUT: SQL Server's error number, and Babelfish
   for PostgreSQL's. The statement (with XACT_ABORT ON, its transaction) ends; the session
   stays usable. */
#define SQL_TSQL_LOCK_TIMEOUT 1222
#define SQL_TSQL_LOCK_TIMEOUT_BBF 33557097

#endif
