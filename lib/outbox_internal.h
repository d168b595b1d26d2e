/*
 * outbox_internal.h — helpers shared by lib/outbox.c, lib/pg.c and lib/odbc.c
 * (not installed). Every symbol is prefixed outbox_i_ and hidden from the
 * shared library's dynamic symbol table.
 */
#ifndef OUTBOX_INTERNAL_H
#define OUTBOX_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include "outbox.h"
#include "outbox_schema.h"
#include "outbox_util.h"   /* OUTBOX_HIDDEN, buffers, UTF-8, JSON */

/* ~100 years: a larger delay is surely a unit mistake. */
#define OUTBOX_MAX_DELAY_MS 3155760000000ULL
/* Largest database name accepted by outbox_queue_new (bytes). */
#define OUTBOX_MAX_DBNAME 1024
/* Upper bound on messages in one batch call (keeps size arithmetic safe). */
#define OUTBOX_MAX_BATCH 10000000u

struct outbox_queue {
    char             *database;      /* owned */
    outbox_table_name name;
    char              pg_table[160]; /* "schema"."table" */
    char              ms_table[160]; /* [schema].[table] */
    size_t            max_payload;
};

/* Sets *err (when err != NULL) and returns code. The message is made one
 * line (control characters become spaces) and truncated to fit. */
OUTBOX_HIDDEN int outbox_i_err(outbox_error *err, int code, const char *sqlstate,
                               const char *fmt, ...) OUTBOX_PRINTF(4, 5);
OUTBOX_HIDDEN void outbox_i_err_clear(outbox_error *err);

/* 1 if s is a UUID in 8-4-4-4-12 hex form (either case), else 0. */
OUTBOX_HIDDEN int outbox_i_uuid_valid(const char *s);
/* W3C Trace Context header values: 1 valid, 0 not */
OUTBOX_HIDDEN int outbox_i_traceparent_valid(const char *s);
OUTBOX_HIDDEN int outbox_i_tracestate_valid(const char *s);

/* One validated message, ready to bind. */
typedef struct outbox_i_msg {
    const outbox_message *m;
    char   message_id[37];   /* lower-case canonical */
    char  *headers_json;     /* owned; NULL when the message has no headers */
    int    dup;              /* repeats an earlier message_id of the same batch */
    uint64_t delay_ms;
} outbox_i_msg;

/* Validates q, m[0..n) (n may be 0) and builds the bind-ready array
 * (*out owned by the caller: release with outbox_i_msgs_free). *n_unique
 * gets the number of messages that are not in-batch duplicates. Field names
 * in messages are "routing_key" for a single send (batch == 0) and
 * "messages[i].routing_key" for a batch. */
OUTBOX_HIDDEN int outbox_i_prepare(const outbox_queue *q, const outbox_message *m, size_t n,
                                   int batch, outbox_i_msg **out, size_t *n_unique,
                                   outbox_error *err);
OUTBOX_HIDDEN void outbox_i_msgs_free(outbox_i_msg *v, size_t n);

/* The result of a send that wrote total of its n messages into table (both drivers):
 * OUTBOX_OK, or OUTBOX_DUPLICATE with err saying which message_id (one message) or how
 * many (a batch) were there already. */
OUTBOX_HIDDEN int outbox_i_sent(outbox_error *err, const outbox_i_msg *v, size_t n, size_t total,
                                int batch, const char *table);

/* OUTBOX_OK when db (the connection's database; NULL if unknown) equals the
 * queue's database byte for byte, else OUTBOX_EDBNAME naming both. */
OUTBOX_HIDDEN int outbox_i_check_dbname(const outbox_queue *q, const char *db, outbox_error *err);

/* The nu messages of v[0..n) that are not in-batch duplicates, in order, as a
 * malloc'd array of pointers into v (*out owned by the caller). */
OUTBOX_HIDDEN int outbox_i_unique(outbox_i_msg *v, size_t n, size_t nu, outbox_i_msg ***out,
                                  outbox_error *err);

#endif
