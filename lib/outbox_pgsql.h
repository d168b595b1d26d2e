/*
 * outbox_pgsql.h — liboutbox's PostgreSQL INSERT, written once for both of its
 * PostgreSQL paths (libpq in lib/pg.c, psqlODBC in lib/odbc.c), and the turn of
 * $n parameters into ODBC's `?` markers, which the relay's psqlODBC path uses too
 * (internal: not installed).
 */
#ifndef OUTBOX_PGSQL_H
#define OUTBOX_PGSQL_H

#include <stddef.h>
#include "outbox_util.h"   /* OUTBOX_HIDDEN */

/* Parameters per message of outbox_pg_insert_sql, in this order: message_id (uuid text),
   exchange, routing_key, partition_key, message_type, content_type, correlation_id,
   headers (JSON text), payload (bytea), delay in milliseconds (bigint). */
#define OUTBOX_PG_INSERT_COLS 10

/* INSERT INTO <pg_table> (...) VALUES (...), ... ON CONFLICT DO NOTHING for `rows`
   messages, parameters $1 .. $(rows * OUTBOX_PG_INSERT_COLS) in message order.
   pg_table is quoted already ("schema"."table"). Returns malloc'd text, or NULL (out of
   memory). */
OUTBOX_HIDDEN char *outbox_pg_insert_sql(const char *pg_table, size_t rows);

/* sql's $n parameters turned into `?` (outside quoted literals and identifiers).
   order[i] gets the number n of the i-th marker (a parameter used twice is bound
   twice); *n_order their count, at most max. Returns malloc'd text, or NULL (out of
   memory, or more than max markers). */
OUTBOX_HIDDEN char *outbox_sql_qmarks(const char *sql, int *order, size_t max,
                                      size_t *n_order);

#endif
