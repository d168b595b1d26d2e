/*
 * pgsrc_rows.c — the PostgreSQL source's claimed rows: a claim's binary-format answer,
 * read one row at a time (single-row mode), turned into the core's rows as it arrives
 * and handed over whole, in id order, when the claim is done.
 *
 * A payload over SQL_PG_SLICE_BYTES does not come with its claim (sql_pg_claim_sliced):
 * its row gets a buffer of the payload's size, which the source then fills from a second
 * statement (sql_pg_payload_slices) one slice at a time as the slices arrive. libpq builds
 * a whole result at once when a message's last byte arrives, and reads whatever the
 * socket holds into a buffer as large as the largest message: a 64 MiB row read whole held
 * the loop for tens of milliseconds at a time, and for the session's life kept an input
 * buffer of its size. In slices, each turn of the loop copies at most a few MiB.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <libpq-fe.h>
#include "relay/row.h"
#include "sources/pg/pgsrc_int.h"

static int64_t be64(const char *p)
{
    const unsigned char *u = (const unsigned char *)p;
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | u[i];
    return (int64_t)v;
}

static int32_t be32(const char *p)
{
    const unsigned char *u = (const unsigned char *)p;
    return (int32_t)(((uint32_t)u[0] << 24) | ((uint32_t)u[1] << 16) | ((uint32_t)u[2] << 8) |
                     u[3]);
}

static row_field bfield(const PGresult *r, int i, int c)
{
    row_field f = { NULL, 0 };
    if (!PQgetisnull(r, i, c)) {
        f.p = PQgetvalue(r, i, c);
        f.len = (size_t)PQgetlength(r, i, c);
    }
    return f;
}

static int row_cmp(const void *a, const void *b)
{
    const row *x = *(row *const *)a, *y = *(row *const *)b;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* A payload at least this large is not copied out of its result: the row keeps the
   result (one row in single-row mode) and points into it. Below it, the copy is cheaper
   than the result's own overhead kept per row. */
#define PGSRC_KEEP_RESULT_MIN (64 * 1024)

static void result_release(void *r)
{
    PQclear(r);
}

/* Room for one more payload to load. 0 or -1. */
static int load_reserve(pgsrc_rows *c)
{
    if (c->n_loads < c->cap_loads)
        return 0;
    size_t nc = c->cap_loads ? c->cap_loads * 2 : 4;
    pgsrc_load *nl = realloc(c->loads, nc * sizeof *nl);
    if (!nl)
        return -1;
    c->loads = nl;
    c->cap_loads = nc;
    return 0;
}

int pgsrc_rows_decode(pgsrc_rows *c, const PGresult *r, int64_t token, PGresult **own, char *err,
                      size_t errlen)
{
    int n = PQntuples(r);
    if (PQnfields(r) != 14) {
        snprintf(err, errlen, "claim: unexpected result shape (%d columns)", PQnfields(r));
        return -1;
    }
    if (n == 0)
        return 0;
    if (c->n + (size_t)n > c->cap) {
        size_t nc = c->cap ? c->cap * 2 : 64;
        while (nc < c->n + (size_t)n)
            nc *= 2;
        row **nr = realloc(c->rows, nc * sizeof *nr);
        if (!nr) {
            snprintf(err, errlen, "claim: out of memory");
            return -1;
        }
        c->rows = nr;
        c->cap = nc;
    }
    for (int i = 0; i < n; i++) {
        row_fields f;
        char uuid[37];
        memset(&f, 0, sizeof f);
        if (PQgetisnull(r, i, 0) || PQgetlength(r, i, 0) != 8 || PQgetisnull(r, i, 1) ||
            PQgetlength(r, i, 1) != 16 || PQgetisnull(r, i, 10) || PQgetlength(r, i, 10) != 4 ||
            PQgetisnull(r, i, 11) || PQgetlength(r, i, 11) != 8 ||
            (PQgetisnull(r, i, 13) ? PQgetisnull(r, i, 9)
                                   : !PQgetisnull(r, i, 9) || PQgetlength(r, i, 13) != 8)) {
            snprintf(err, errlen, "claim: unexpected column encoding in row %zu", c->n);
            return -1;
        }
        const unsigned char *u = (const unsigned char *)PQgetvalue(r, i, 1);
        snprintf(uuid, sizeof uuid,
                 "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                 u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
                 u[15]);
        f.id = be64(PQgetvalue(r, i, 0));
        f.lease_token = token;
        f.message_id.p = uuid;
        f.message_id.len = 36;
        f.exchange = bfield(r, i, 2);
        f.routing_key = bfield(r, i, 3);
        f.partition_key = bfield(r, i, 4);
        f.message_type = bfield(r, i, 5);
        f.content_type = bfield(r, i, 6);
        f.correlation_id = bfield(r, i, 7);
        f.headers_json = bfield(r, i, 8);
        f.payload = bfield(r, i, 9);
        unsigned char *buf = NULL;
        if (!PQgetisnull(r, i, 13)) { /* left in the database: its size only */
            int64_t left = be64(PQgetvalue(r, i, 13));
            size_t size = left > 0 ? (size_t)left : 1;
            if (c->max_payload > 0 && size > c->max_payload) {
                f.payload_withheld = size; /* never published: dead-lettered by its size */
            } else {
                /* loaded afterwards, in slices, into a buffer the row holds */
                if (load_reserve(c) < 0 || (buf = malloc(size + 1)) == NULL) {
                    snprintf(err, errlen,
                             "claim: out of memory for the %zu-byte payload of "
                             "row %" PRId64,
                             size, f.id);
                    return -1;
                }
                buf[size] = '\0';
                f.payload.p = (const char *)buf;
                f.payload.len = size;
                f.payload_owner = buf;
                f.payload_release = free;
            }
        }
        if (buf == NULL && own != NULL && *own == r && n == 1 &&
            f.payload.len >= PGSRC_KEEP_RESULT_MIN) {
            f.payload_owner = *own; /* row_new takes it when it succeeds */
            f.payload_release = result_release;
        }
        f.attempts = be32(PQgetvalue(r, i, 10));
        f.created_at_us = be64(PQgetvalue(r, i, 11));
        f.age_us = PQgetisnull(r, i, 12) ? -1 : be64(PQgetvalue(r, i, 12));
        row *w = row_new(&f);
        if (!w) {
            free(buf);
            snprintf(err, errlen, "claim: out of memory building row %" PRId64, f.id);
            return -1;
        }
        c->rows[c->n++] = w;
        if (buf != NULL)
            c->loads[c->n_loads++] = (pgsrc_load){ .id = f.id, .buf = buf, .size = f.payload.len };
        else if (f.payload_owner != NULL)
            *own = NULL;
    }
    return 0;
}

bool pgsrc_rows_load_next(const pgsrc_rows *c, int64_t *id)
{
    if (c->i_load >= c->n_loads)
        return false;
    *id = c->loads[c->i_load].id;
    return true;
}

int pgsrc_rows_slice(pgsrc_rows *c, const PGresult *r, char *err, size_t errlen)
{
    if (c->i_load >= c->n_loads || PQnfields(r) != 2) {
        snprintf(err, errlen, "payload slices: unexpected result shape");
        return -1;
    }
    pgsrc_load *l = &c->loads[c->i_load];
    for (int i = 0, n = PQntuples(r); i < n; i++) {
        size_t len = (size_t)PQgetlength(r, i, 1);
        if (PQgetisnull(r, i, 0) || PQgetlength(r, i, 0) != 4 || PQgetisnull(r, i, 1) ||
            (size_t)be32(PQgetvalue(r, i, 0)) != l->got + 1 || len > l->size - l->got) {
            snprintf(err, errlen,
                     "payload of row %" PRId64 ": unexpected slice after %zu of "
                     "%zu bytes",
                     l->id, l->got, l->size);
            return -1;
        }
        memcpy(l->buf + l->got, PQgetvalue(r, i, 1), len);
        l->got += len;
    }
    return 0;
}

int pgsrc_rows_load_end(pgsrc_rows *c, char *err, size_t errlen)
{
    if (c->i_load >= c->n_loads)
        return 0;
    const pgsrc_load *l = &c->loads[c->i_load++];
    if (l->got != l->size) {
        snprintf(err, errlen,
                 "payload of row %" PRId64 ": %zu of %zu bytes read (the row is "
                 "gone or no longer leased to this claim)",
                 l->id, l->got, l->size);
        return -1;
    }
    return 0;
}

void pgsrc_rows_free(pgsrc_rows *c)
{
    for (size_t i = 0; i < c->n; i++)
        row_free(c->rows[i]); /* with the buffers of the payloads loaded into */
    free(c->rows);
    free(c->loads);
    c->rows = NULL;
    c->loads = NULL;
    c->n = c->cap = c->n_loads = c->cap_loads = c->i_load = 0;
    c->err[0] = '\0';
}

void pgsrc_rows_take(pgsrc_rows *c, row ***rows, size_t *n)
{
    /* RETURNING order is not id order */
    if (c->n > 1)
        qsort(c->rows, c->n, sizeof *c->rows, row_cmp);
    *rows = c->rows;
    *n = c->n;
    c->rows = NULL;
    c->n = c->cap = 0;
    pgsrc_rows_free(c);
}
