/*
 * sql_tsql.h — the relay's T-SQL statements (sources/sql_tsql.c): text with `?`
 * parameters and {T}/{D}/{L} table placeholders, run by the ODBC source.
 */
#ifndef OUTBOX_SOURCES_SQL_TSQL_H
#define OUTBOX_SOURCES_SQL_TSQL_H

extern const char sql_tsql_lead[];
extern const char sql_tsql_claim[];
extern const char sql_tsql_claim_competing[];
extern const char sql_tsql_settle_head[];
extern const char sql_tsql_settle_mark[];
extern const char sql_tsql_settle_delete[];
extern const char sql_tsql_settle_tail[];
extern const char sql_tsql_cleanup[];
extern const char sql_tsql_stats[];
extern const char sql_tsql_stats_kept[];
extern const char sql_tsql_dead_list[];
extern const char sql_tsql_dead_retry[];
extern const char sql_tsql_dead_purge[];
extern const char sql_tsql_tables_exist[];

/* The connected database's name. */
#define SQL_TSQL_CURRENT_DATABASE "SELECT DB_NAME()"
/* Appended to outbox_tsql_session_options by every relay session (see odbcsrc_db.c). */
#define SQL_TSQL_SESSION_TAIL \
    ";\nSET XACT_ABORT ON;\nSET TRANSACTION ISOLATION LEVEL READ COMMITTED;"

#endif
