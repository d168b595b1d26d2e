/*
 * outbox_schema.h — identifier validation and DDL, shared by liboutbox and
 * outbox-relay (internal: not installed).
 *
 * The outbox table (PostgreSQL types; SQL Server in brackets):
 *   id             bigint identity PK            [bigint IDENTITY(1,1)]
 *   message_id     uuid NOT NULL UNIQUE          [uniqueidentifier]
 *                  DEFAULT gen_random_uuid()     [DEFAULT NEWID()]
 *   exchange       text NOT NULL DEFAULT ''      [nvarchar(255)]
 *   routing_key    text NOT NULL                 [nvarchar(255)]
 *   partition_key  text NULL                     [nvarchar(255)]
 *   message_type   text NULL                     [nvarchar(255)]
 *   content_type   text NULL                     [nvarchar(255)]
 *   correlation_id text NULL                     [nvarchar(255)]
 *   headers        jsonb NULL                    [nvarchar(max)]  flat JSON object
 *   payload        bytea NOT NULL                [varbinary(max)]
 *   created_at     timestamptz DEFAULT now()     [datetime2 DEFAULT sysutcdatetime()]
 *   available_at   timestamptz DEFAULT now()     [datetime2 DEFAULT sysutcdatetime()]
 * relay-owned columns:
 *   attempts       integer NOT NULL DEFAULT 0    failed publish attempts so far
 *   lease_owner    text NULL                     relay name holding the lease (for people)
 *   lease_token    bigint NULL                   random per claim; settles must match it (fencing)
 *   lease_until    timestamptz NULL              lease expiry; claimable again after it
 *   last_error     text NULL                     reason of the last failed attempt
 *   sent_at        timestamptz NULL              set when the broker confirmed (on_sent = mark)
 *
 * Dead-letter table <table>_dead: id (the original id, PK), message_id, the
 * producer columns, attempts, reason text NOT NULL, dead_at DEFAULT now().
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

/* init waits at most this long for a lock (lock_timeout / SET LOCK_TIMEOUT): an object
 * that must be created on a table in use never queues long behind a producer
 * transaction, with every later producer queued behind it. */
/* The columns a producer writes, the same in the outbox and its dead-letter table (in
   the order of the DDL): the dead-letter moves of both dialects copy these. */
#define OUTBOX_PRODUCER_COLS "message_id, exchange, routing_key, partition_key, message_type, " \
                             "content_type, correlation_id, headers, payload, created_at"

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

/* Writes the quoted qualified name: "schema"."table" (PostgreSQL) or
 * [schema].[table] (SQL Server); dead != 0 names the dead-letter table. */
void outbox_qualified(outbox_dialect d, const outbox_table_name *t, int dead,
                      char *out, size_t outlen);

/* Derived object names (indexes, trigger, function, constraints): <table>_<suffix>,
 * shortened deterministically (prefix + 8 hex digits of a hash) to stay within 63 bytes. */
void outbox_derived_name(const char *table, const char *suffix, char out[64]);

/* The T-SQL SET options the outbox's objects need (QUOTED_IDENTIFIER, ANSI_NULLS,
 * ... for the filtered indexes), as one batch of one SET statement per option. The
 * SQL Server DDL starts with it; the relay's ODBC sessions run it on connect. */
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
