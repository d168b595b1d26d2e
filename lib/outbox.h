/*
 * outbox.h — liboutbox: write messages into a transactional outbox table
 * inside the caller's own database transaction.
 *
 * The library never begins, commits, rolls back, closes, reconnects or
 * retries. A rollback after a successful send removes the message too.
 * A queue handle is immutable once created and may be shared between
 * threads; a database connection is used by one thread at a time.
 *
 * Backends: outbox_pg.h (libpq), outbox_odbc.h (ODBC: SQL Server, or
 * PostgreSQL through psqlODBC).
 */
#ifndef OUTBOX_H
#define OUTBOX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* `make install` writes the Makefile's VERSION here. */
#define OUTBOX_VERSION_STRING "0.1.0"

/* Status codes. Positive: success with a remark; negative: nothing written. */
enum {
    OUTBOX_OK        = 0,
    OUTBOX_DUPLICATE = 1,  /* message_id already in the outbox; transaction intact */
    OUTBOX_EINVAL    = -1, /* invalid argument; the message names the field */
    OUTBOX_ENOTXN    = -2, /* connection not inside an open, healthy transaction */
    OUTBOX_EDBNAME   = -3, /* connected database differs from the queue's database */
    OUTBOX_ENOSCHEMA = -4, /* outbox table missing: run `outbox-relay init` */
    OUTBOX_EDB       = -5, /* database error; see sqlstate and message */
    OUTBOX_ENOMEM    = -6, /* out of memory */
    OUTBOX_ETXNLOST  = -7  /* the statement failed and took the transaction with it: the
                              server rolled it back (deadlock victim, XACT_ABORT, a
                              trigger) or doomed it. Everything done in it is lost or must
                              be rolled back: roll back, then retry the whole transaction.
                              sqlstate and message name the server's error. SQL Server.
                              A transaction lost in an earlier statement of the caller's
                              cannot be told from a new one: act on that statement's error. */
};

#define OUTBOX_MAX_IDENT        63        /* bytes per identifier part */
#define OUTBOX_MAX_SHORTSTR     255       /* exchange, routing key, header keys, ... */
/* The largest payload a queue accepts unless told otherwise: the relay's default
 * [sink] max_message_size (RabbitMQ's own default). A larger payload is OUTBOX_EINVAL
 * ("payload: N bytes, larger than the limit of M bytes ..."), refused before anything
 * reaches the table; a relay whose max_message_size is lower dead-letters such a row,
 * so set max_payload (outbox_queue_options) to the relay's max_message_size.
 *
 * Memory per send: the library does not copy the payload; the drivers do. Measured
 * for one 64 MiB payload (examples/producer, peak RSS beyond the caller's own buffer):
 * libpq about 1x the payload (it assembles the whole Bind message in its output buffer
 * before sending), psqlODBC about 2x (it converts the bound bytes into its own buffers).
 * A batch holds every message of the batch at once. */
#define OUTBOX_DEFAULT_MAX_PAYLOAD (128u * 1024u * 1024u) /* RabbitMQ's default max_message_size */

typedef struct outbox_error {
    int  code;          /* one of the codes above */
    char sqlstate[6];   /* five characters and NUL; empty when none */
    char message[512];  /* human-readable, never contains payload bytes */
} outbox_error;

typedef struct outbox_header {
    const char *key;    /* UTF-8, 1..255 bytes, unique within a message */
    const char *value;  /* UTF-8 text, not NULL */
} outbox_header;

typedef struct outbox_message {
    const char *exchange;        /* NULL or "" : the default exchange */
    const char *routing_key;     /* required (may be ""), at most 255 bytes */
    const void *payload;         /* body bytes, may contain NULs; NULL only if payload_len == 0 */
    size_t      payload_len;
    const char *message_id;      /* canonical UUID text, or NULL: a random UUID is generated */
    const char *partition_key;   /* ordering key, or NULL */
    const char *message_type;    /* AMQP type, or NULL */
    const char *content_type;    /* AMQP content-type, or NULL */
    const char *correlation_id;  /* AMQP correlation-id, or NULL */
    const outbox_header *headers;/* n_headers entries, or NULL when n_headers == 0 */
    size_t      n_headers;
    uint64_t    delay_ms;        /* not published before now + delay_ms */
} outbox_message;

typedef struct outbox_queue outbox_queue;

typedef struct outbox_queue_options {
    const char *database;        /* required: compared byte for byte with the connection's */
    const char *table;           /* "schema.table" or "table" (schema "outbox"); NULL: outbox.messages */
    size_t      max_payload;     /* 0: OUTBOX_DEFAULT_MAX_PAYLOAD; the relay's max_message_size */
} outbox_queue_options;

/* Creates an immutable queue handle. On failure *q is NULL and err says why. */
int  outbox_queue_new(outbox_queue **q, const char *database, const char *table,
                      outbox_error *err);
int  outbox_queue_new_opts(outbox_queue **q, const outbox_queue_options *opts,
                           outbox_error *err);
void outbox_queue_free(outbox_queue *q);

/* Accessors (read-only). */
const char *outbox_queue_database(const outbox_queue *q);
const char *outbox_queue_schema(const outbox_queue *q);
const char *outbox_queue_table(const outbox_queue *q);
size_t      outbox_queue_max_payload(const outbox_queue *q);   /* bytes; 0 for NULL */

/* Static description of a status code ("invalid argument", ...). Never NULL. */
const char *outbox_strerror(int code);

/* Writes a canonical lower-case random (version 4) UUID and a NUL into out[37]. */
int  outbox_uuid_generate(char out[37]);

#ifdef __cplusplus
}
#endif
#endif
