/*
 * sql_pg.h — the relay's PostgreSQL statements, in one place for both paths that
 * speak PostgreSQL: the libpq source (sources/pg) and the ODBC source on psqlODBC
 * (sources/odbc). Every statement is written once, with $n parameters; the libpq
 * path sends it as is (PQsendQueryParams, every value as text), the ODBC path runs
 * it through sql_pg_qmarks() and binds the values in the order it reports. Values
 * always travel as parameters, as text in PostgreSQL's input syntax (arrays as
 * "{...}" literals built here), so both paths send the same bytes.
 *
 * Table names come only from the validated identifier parts of the outbox's
 * `table` (cfg_outbox) and are always quoted. The DDL is lib/schema.c's
 * (outbox_ddl), shared with liboutbox; T-SQL lives in sources/sql_tsql.c.
 *
 * Result columns, which both paths read by position, are documented at each
 * builder. Every builder returns malloc'd text (NULL: out of memory).
 */
#ifndef OUTBOX_SOURCES_SQL_PG_H
#define OUTBOX_SOURCES_SQL_PG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "config/cfg.h"
#include "lib/outbox_util.h"
#include "relay/source.h"

/* Quoted names derived from the validated parts of ob->table. */
typedef struct sql_pg_names {
    char table[160];    /* "schema"."table" */
    char dead[160];     /* "schema"."table_dead" */
    char lease[160];    /* "schema"."table_lease": leadership lease row */
    char delayed[160];  /* "schema"."table_delayed_idx": the index of the delayed rows */
    char notify[132];   /* NOTIFY payload: schema.table (as configured parts) */
} sql_pg_names;

void sql_pg_names_init(const cfg_outbox *ob, sql_pg_names *n);

/* Leadership: $1 owner, $2 epoch held (0 none), $3 lease ms.
   -> our epoch (NULL: not leader), holder before, its epoch, row leases released, a live
   member of competing mode that kept us out (NULL: none). */
char *sql_pg_lead(const sql_pg_names *n);
/* The claim, within a byte limit: $1 limit, $2 owner, $3 token, $4 lease ms, $5 epoch
   (leader mode; 0: unfenced), $6 max bytes (0: no limit), $7
   first row whatever its size (boolean): the rows leased are the prefix, in id order,
   whose payload + headers text bytes (src_row_bytes) sum to at most $6, or that first
   row alone (src_claim_args.max_bytes, first_whole); $8 the largest payload returned
   (0: no limit): a larger one is left in the database, its column NULL and the last
   column its size (else NULL), and the row counts for its headers only within $6
   (src_claim_args.max_payload); $9 where its walk starts (see sql_pg_floor_probe); $10 ids
   it passes over (bigint[], NULL: none): rows the relay holds under a live lease of its own
   (src_claim_args.held), which it would not take anyway; $11 the tokens of the relay's
   claims that failed without an answer (bigint[], NULL: none; src_claim_args.lost): rows
   leased under them are taken as if their lease had ended; $12 where its walk starts, $9
   or above: the claim then passes over the rows in [$9, $12), and takes no row of a key
   that has a pending row there but those the relay holds under a live lease of its own.
   -> id, message_id, exchange, routing_key, partition_key, message_type, content_type,
      correlation_id, headers (text), payload, attempts, created_at (µs since the epoch),
      age (µs), and the size of a payload left out (else NULL).
   form: SQL_PG_CLAIM_WALK for a session that rules sorts out (the relay's own, see the
   PostgreSQL source's session setup): the rows of keys held back are passed over within
   the walk's index scans; with SQL_PG_CLAIM_DELAYED_IDX too when the table has its index
   of the delayed rows (n->delayed; tables made by earlier versions may lack it), which
   the competing claim then asks first. 0 elsewhere (through a pooler, psqlODBC). */
#define SQL_PG_CLAIM_WALK        1
#define SQL_PG_CLAIM_DELAYED_IDX 2
char *sql_pg_claim_bytes(const sql_pg_names *n, bool competing, int form);
/* Payloads over this many bytes are read in slices of this size (sql_pg_claim_sliced,
   sql_pg_payload_slices). */
#define SQL_PG_SLICE_BYTES 1048576
/* The claim of sql_pg_claim_bytes, except that a payload over SQL_PG_SLICE_BYTES (and
   within $8) is left out of the answer too: its column NULL and the last column its size,
   as for one over $8. Same parameters, same result columns, same byte limit (such a row
   counts whole). */
char *sql_pg_claim_sliced(const sql_pg_names *n, bool competing, int form);
/* Every claim's $9: its walk over the pending rows starts at this id (0: the table's start).
 *
 * The floor probe finds a start below which no row is pending and none can become pending,
 * so that a claim does not cross the index entries of the rows marked since the last vacuum
 * (all of them while the xmin horizon is held back). Probe k (one statement) returns the
 * lowest pending id m_k from the floor in use, the id sequence's last value lv_k and its cache
 * size, the transactions that hold the table's ROW EXCLUSIVE lock W_k (every producer that
 * drew an id and has not ended: an INSERT takes the lock before it draws its id), and whether
 * all of W_(k-1) have ended. Once probe k-1 saw every transaction of W_(k-2) ended, the floor
 * min(m_k, lv_(k-3) + 1) is safe: a row below it that is not visible to probe k was written by
 * a transaction that took the lock after probe k-2 read the locks, so it drew its id after
 * probe k-3 read the sequence, above lv_(k-3) (a sequence caching one value at a time gives
 * ids in the order they are drawn; with a larger cache the probe keeps no floor). A row
 * inserted with an explicit id below the floor (a dead row retried) is found by a probe whose
 * $1 is 0 (the relay sends one every few seconds): its m is then the lowest pending id. */
char *sql_pg_floor_probe(const sql_pg_names *n);
/* A claimed row's payload in slices: $1 id, $2 slice bytes, $3 the claim's lease token.
   -> one row per slice, in order: its 1-based offset (int), the slice (bytea). No row
   when the row is gone or no longer under that lease. */
char *sql_pg_payload_slices(const sql_pg_names *n);
/* Settle of outcomes that are all SENT: $1 ids, $2 tokens (arrays). -> rows applied. */
char *sql_pg_settle_sent(const sql_pg_names *n, int on_sent);
/* Settle of any outcomes: $1 ids, $2 tokens, $3 kinds, $4 back-offs (ms), $5 reasons
   (arrays, sql_pg_settle_arrays). -> rows applied. */
char *sql_pg_settle(const sql_pg_names *n, int on_sent);
/* Retention: $1 retention ms, $2 limit, $3 owner, $4 epoch. -> command count. */
char *sql_pg_cleanup(const sql_pg_names *n);
/* -> backlog, oldest pending (s), dead rows, marked rows kept (-1 unless full),
      seconds until the first pending row that cannot be claimed now can be (NULL). */
char *sql_pg_stats(const sql_pg_names *n, bool full);
/* The table's health and the holder of the xmin horizon ($1: the table's quoted name, as
   sql_pg_names.table holds it): see sql_pg.c. */
char *sql_pg_health(void);
/* -> id, message_id, exchange, routing_key, attempts, dead_at (ISO 8601 UTC), reason */
char *sql_pg_dead_list(const sql_pg_names *n);
/* $1 ids (array; NULL: all). -> command count. */
char *sql_pg_dead_retry(const sql_pg_names *n);
char *sql_pg_dead_purge(const sql_pg_names *n);
/* $1, $2, $3 the outbox, dead-letter and leadership lease tables' names, $4 the index of
   the delayed rows (sql_pg_names.delayed). -> 1/0 each: it exists. */
char *sql_pg_tables_exist(void);

/* The connected database's name. */
#define SQL_PG_CURRENT_DATABASE "SELECT current_database()"

/* One array element, quoted and escaped, cut at maxlen bytes on a character
   boundary (each invalid UTF-8 byte becomes U+FFFD). */
void sql_pg_array_elem(outbox_util_buf *b, const char *s, size_t maxlen);
/* The five arrays of sql_pg_settle. 0, or -1 (out of memory; nothing to free). */
int  sql_pg_settle_arrays(const src_outcome *v, size_t n, outbox_util_buf out[5]);
/* "{1,2,3}", or NULL (meaning SQL NULL = all) when n == 0; malloc'd in *out. */
int  sql_pg_id_array(const int64_t *ids, size_t n, char **out);

/* A statement's $n parameters turned into ODBC's `?` (outside quoted literals and
   identifiers), for the psqlODBC path. order[i] gets the number n of the i-th marker
   (a parameter used twice is bound twice); *n_order their count, at most max.
   Returns malloc'd text, or NULL (out of memory, or more than max markers). */
char *sql_pg_qmarks(const char *sql, int *order, size_t max, size_t *n_order);

#endif
