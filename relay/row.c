/*
 * row.c — one claimed outbox row in one allocation (row.h).
 *
 * Layout: [struct row][message_id is inline][strings, each NUL-terminated][payload + NUL];
 * with a payload_owner the payload stays where it is and the block ends after the strings,
 * and a payload of ROW_APART_MIN bytes or more without one gets a buffer of its own (the
 * same single copy), so that it can be freed before the row (row_release_payload).
 */
#include "relay/row.h"

#include <ctype.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Adds a field's size (len + NUL) to *total; -1 on overflow. */
static int add_len(size_t *total, const row_field *f, int always)
{
    size_t need;

    if (!f->p && !always)
        return 0;
    need = (f->p ? f->len : 0) + 1;
    if (need == 0 || *total > SIZE_MAX - need)
        return -1;
    *total += need;
    return 0;
}

/* Copies a field into the block at *cur; returns its start, or NULL for SQL NULL
 * (unless always: then "" for NULL). */
static char *put_field(char **cur, const row_field *f, int always)
{
    char *start = *cur;
    size_t len;

    if (!f->p && !always)
        return NULL;
    len = f->p ? f->len : 0;
    if (len)
        memcpy(start, f->p, len);
    start[len] = '\0';
    *cur = start + len + 1;
    return start;
}

row *row_new(const row_fields *f)
{
    size_t total = sizeof(row);
    row *r;
    char *cur;
    unsigned char *apart = NULL;
    bool own_apart;

    if (!f || !f->message_id.p || f->message_id.len != 36)
        return NULL;
    own_apart = !f->payload_release && f->payload.p && f->payload.len >= ROW_APART_MIN;
    if (add_len(&total, &f->exchange, 1) < 0 || add_len(&total, &f->routing_key, 1) < 0 ||
        add_len(&total, &f->partition_key, 0) < 0 || add_len(&total, &f->message_type, 0) < 0 ||
        add_len(&total, &f->content_type, 0) < 0 || add_len(&total, &f->correlation_id, 0) < 0 ||
        add_len(&total, &f->headers_json, 0) < 0 ||
        (!f->payload_release && !own_apart && add_len(&total, &f->payload, 1) < 0))
        return NULL;
    if (own_apart) {
        if (f->payload.len == SIZE_MAX || !(apart = malloc(f->payload.len + 1)))
            return NULL;
        memcpy(apart, f->payload.p, f->payload.len);
        apart[f->payload.len] = '\0';
    }
    if (!(r = malloc(total))) {
        free(apart);
        return NULL;
    }

    r->id = f->id;
    r->lease_token = f->lease_token;
    r->attempts = f->attempts;
    r->created_at_us = f->created_at_us;
    r->age_us = f->age_us;
    r->origin_mono = 0;
    for (size_t i = 0; i < 36; i++)
        r->message_id[i] = (char)tolower((unsigned char)f->message_id.p[i]);
    r->message_id[36] = '\0';

    cur = (char *)(r + 1);
    r->exchange = put_field(&cur, &f->exchange, 1);
    r->routing_key = put_field(&cur, &f->routing_key, 1);
    r->partition_key = put_field(&cur, &f->partition_key, 0);
    r->message_type = put_field(&cur, &f->message_type, 0);
    r->content_type = put_field(&cur, &f->content_type, 0);
    r->correlation_id = put_field(&cur, &f->correlation_id, 0);
    r->headers_json = put_field(&cur, &f->headers_json, 0);
    r->payload_len = f->payload.p ? f->payload.len : 0;
    r->payload_withheld = f->payload.p ? 0 : f->payload_withheld;
    r->owner = NULL;
    r->release = NULL;
    r->payload_released = 0;
    if (apart) {
        r->payload = apart;
        r->owner = apart;
        r->release = free;
    } else if (f->payload_release) {
        /* takes payload_owner over: the payload is read where it is */
        r->payload = (const unsigned char *)(f->payload.p ? f->payload.p : "");
        r->owner = f->payload_owner;
        r->release = f->payload_release;
    } else {
        r->payload = (const unsigned char *)put_field(&cur, &f->payload, 1);
    }
    r->bytes = r->payload_len + (r->headers_json ? strlen(r->headers_json) : 0);
    return r;   /* the caller owns the row */
}

size_t row_release_payload(row *r)
{
    size_t freed;

    if (!r || !r->release || r->payload_released)
        return 0;
    freed = r->payload_len;
    r->release(r->owner);
    r->release = NULL;
    r->owner = NULL;
    r->payload = NULL;
    r->payload_released = 1;
    r->bytes -= freed;
    return freed;
}

void row_free(row *r)
{
    if (r && r->release)
        r->release(r->owner);
    free(r);
}
