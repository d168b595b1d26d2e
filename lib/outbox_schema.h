/*
 * outbox_schema.h — identifier validation and DDL, shared by liboutbox and
 * outbox-relay (internal: not installed).
 *
 * The outbox table, its dead-letter twin <table>_dead and the lease table
 * <table>_lease are described once, in lib/schema.c (outbox_columns_desc: each
 * column with its type and default in both dialects, the tables it is in, and
 * whether producers write it); both dialects' DDL is generated from there.
 * `outbox-relay schema --dialect postgres|sqlserver` prints it.
 *
 * PostgreSQL also gets a statement-level AFTER INSERT trigger that runs
 * pg_notify('outbox_relay', '<schema>.<table>') so relays wake on commit.
 */
#ifndef OUTBOX_SCHEMA_H
#define OUTBOX_SCHEMA_H

#include <stddef.h>

#define OUTBOX_NOTIFY_CHANNEL "outbox_relay"
#define OUTBOX_DEFAULT_SCHEMA "outbox"
#define OUTBOX_DEFAULT_TABLE  "messages"

/* The columns a producer writes, the same in the outbox and its dead-letter table (in
   the order of the DDL): the dead-letter moves of both dialects copy these. A literal for
   the statements built at compile time; it must equal outbox_producer_columns(),
   which lists them from lib/schema.c's description of the table (lib_unit_test checks). */
#define OUTBOX_PRODUCER_COLS "message_id, exchange, routing_key, partition_key, message_type, " \
                             "content_type, correlation_id, headers, payload, created_at"

/* The producer columns of lib/schema.c's description of the table, ", "-separated
   (malloc'd; NULL: out of memory). */
char *outbox_producer_columns(void);

/* init waits at most this long for a lock (lock_timeout / SET LOCK_TIMEOUT): an object
 * that must be created on a table in use never queues long behind a producer
 * transaction, with every later producer queued behind it. */
#define OUTBOX_INIT_LOCK_TIMEOUT_MS 3000

typedef enum { OUTBOX_DIALECT_POSTGRES = 0, OUTBOX_DIALECT_SQLSERVER = 1 } outbox_dialect;

typedef struct outbox_table_name {
    char schema[64];   /* validated [A-Za-z_][A-Za-z0-9_]{0,62} */
    char table[64];
    char dead[64];     /* dead-letter table, same schema: <table>_dead (shortened with a hash if needed) */
} outbox_table_name;

/* 1 if s is a valid identifier part ([A-Za-z_][A-Za-z0-9_]*, 1..63 bytes). */
int outbox_ident_valid(const char *s);

/* Parses "schema.table" or "table" (schema defaults to "outbox"; NULL or "" means
 * outbox.messages). Returns 0, or -1 with a one-line reason in err. */
int outbox_table_parse(const char *spec, outbox_table_name *out, char *err, size_t errlen);

/* Which of the outbox's tables outbox_qualified() names. */
typedef enum outbox_table_kind {
    OUTBOX_TABLE_OUTBOX = 0,   /* the outbox table itself */
    OUTBOX_TABLE_DEAD   = 1,   /* its dead-letter table, <table>_dead */
    OUTBOX_TABLE_LEASE  = 2    /* the relay's leadership lease table, <table>_lease */
} outbox_table_kind;

/* Writes the quoted qualified name of one of the outbox's tables: "schema"."name"
 * (PostgreSQL) or [schema].[name] (SQL Server). The one place those names are made. */
void outbox_qualified(outbox_dialect d, const outbox_table_name *t, outbox_table_kind which,
                      char *out, size_t outlen);

/* The quoted qualified name of the outbox's index of its delayed rows on PostgreSQL,
 * "schema"."<table>_delayed_idx", for the relay's check that it exists. */
void outbox_pg_delayed_index(const outbox_table_name *t, char *out, size_t outlen);

/* Derived object names (indexes, trigger, function, constraints): <table>_<suffix>,
 * shortened deterministically (prefix + 8 hex digits of a hash) to stay within 63 bytes. */
void outbox_derived_name(const char *table, const char *suffix, char out[64]);

/* The T-SQL SET options the outbox's objects need (QUOTED_IDENTIFIER, ANSI_NULLS,
 * ... for the filtered indexes), as one batch of one SET statement per option, with no
 * trailing separator: the one place they are written. The SQL Server DDL starts with
 * it; the relay's ODBC sessions run it on connect; liboutbox's INSERT batch (lib/odbc.c)
 * sets it inside its dynamic SQL, where the server restores the caller's options after. */
extern const char *const outbox_tsql_session_options;

/* The DDL as a NULL-terminated, malloc'd array of malloc'd statements (no
 * trailing separator), each idempotent: an object that exists is skipped without
 * a lock on the outbox table (PostgreSQL: each statement is a DO block that checks
 * the catalog first and raises NOTICE "outbox: creating <what>" before creating). Returns NULL on out-of-memory. */
char **outbox_ddl(outbox_dialect d, const outbox_table_name *t);
void   outbox_ddl_free(char **stmts);

/* Prints the DDL for people and tools: statements end with ";" (PostgreSQL)
 * or are separated by "GO" lines (SQL Server). Returns malloc'd text or NULL. */
char  *outbox_ddl_script(outbox_dialect d, const outbox_table_name *t);

#endif
