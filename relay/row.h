/*
 * row.h — one claimed outbox row, as a source hands it to the core and the
 * core hands it to a sink. A row is one allocation (strings live in the same
 * block; a large payload may instead live in a buffer the row holds, see
 * row_fields.payload_owner): free it with row_free(). Owner: whoever holds the
 * pointer; the claim callback passes ownership to the core.
 */
#ifndef RELAY_ROW_H
#define RELAY_ROW_H

#include <stddef.h>
#include <stdint.h>

typedef struct row {
    int64_t        id;
    int64_t        lease_token;    /* the claim's token; settles must carry it */
    int            attempts;       /* failed attempts before this claim */
    int64_t        created_at_us;  /* unix epoch microseconds (AMQP timestamp = seconds) */
    int64_t        age_us;         /* now() - created_at when claimed, in the database's
                                      clock (no skew with ours); -1 unknown */
    double         origin_mono;    /* core only: our monotonic time of created_at (claim
                                      sent - age; meaningful when age_us >= 0) */
    char           message_id[37]; /* canonical lower-case UUID */
    const char    *exchange;       /* never NULL ("" = default exchange) */
    const char    *routing_key;    /* never NULL */
    const char    *partition_key;  /* NULL when none */
    const char    *message_type;   /* NULL when none */
    const char    *content_type;   /* NULL when none */
    const char    *correlation_id; /* NULL when none */
    const char    *headers_json;   /* NULL when none; a JSON object as stored */
    const unsigned char *payload;  /* payload_len bytes (may contain NULs) */
    size_t         payload_len;
    size_t         bytes;          /* its size for the byte budget: payload_len + the
                                      length of headers_json; set once by row_new */
    void          *owner;          /* what payload points into, when not copied (or NULL) */
    void         (*release)(void *owner);   /* frees owner with the row */
    size_t         payload_withheld; /* > 0: the payload, this many bytes, was larger than
                                        the claim's max_payload and left in the database
                                        (payload is then "", payload_len 0) */
    int            payload_released; /* 1: row_release_payload freed the payload (payload
                                        is NULL, payload_len still its size) */
} row;

/* A payload at least this large is held apart from the row's block (in its own buffer,
   or in what payload_owner names), so that row_release_payload can free it while the
   rest of the row stays where it is. */
#define ROW_APART_MIN (64 * 1024)

/* Field values for row_new(); each string is (ptr, len), ptr NULL = SQL NULL. */
typedef struct row_field { const char *p; size_t len; } row_field;
typedef struct row_fields {
    int64_t   id, lease_token, created_at_us, age_us;
    int       attempts;
    size_t    payload_withheld;   /* see row.payload_withheld; payload NULL then */
    row_field message_id, exchange, routing_key, partition_key, message_type,
              content_type, correlation_id, headers_json, payload;
    /* NULL: the payload is copied like the other fields. Else the payload is not copied:
       payload.p (NUL-terminated after payload.len bytes) lives in payload_owner, which the
       row takes over when row_new succeeds and frees with payload_release in row_free
       (on failure the caller keeps it). For a large payload: one copy fewer. */
    void     *payload_owner;
    void    (*payload_release)(void *owner);
} row_fields;

/* Copies everything into one block (the payload too, unless f->payload_owner). NULL on
 * out-of-memory or a message_id that is not 36 characters. exchange/routing_key NULL
 * become "". */
row *row_new(const row_fields *f);
void row_free(row *r);
/* Frees the payload when it is held apart from the row's block (see ROW_APART_MIN, or
   payload_owner, whatever the payload's size), leaving every other field, payload_len
   included, as it was, and bytes counting the headers only. Returns the bytes freed:
   0 when the payload is part of the block or gone already, and also when it was empty
   (payload_released tells whether it was let go). The row's address does not change. */
size_t row_release_payload(row *r);

#endif
