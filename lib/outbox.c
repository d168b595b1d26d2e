/*
 * outbox.c — queue handles, status strings, UUIDs and the input validation
 * shared by the libpq and ODBC paths.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <unistd.h>

#include "outbox.h"
#include "outbox_internal.h"
#include "outbox_schema.h"

/* ----------------------------------------------------------------- errors */

void outbox_i_err_clear(outbox_error *err)
{
    if (!err)
        return;
    err->code = OUTBOX_OK;
    err->sqlstate[0] = '\0';
    err->message[0] = '\0';
}

int outbox_i_sent(outbox_error *err, const outbox_i_msg *v, size_t n, size_t total, int batch,
                  const char *table)
{
    if (total >= n)
        return OUTBOX_OK;
    if (batch)
        return outbox_i_err(err, OUTBOX_DUPLICATE, NULL,
                            "%zu of %zu messages had a message_id already in %s (or repeated "
                            "in the batch); the others were written", n - total, n, table);
    return outbox_i_err(err, OUTBOX_DUPLICATE, NULL,
                        "message_id %s is already in %s; nothing written, transaction intact",
                        v[0].message_id, table);
}

int outbox_i_err(outbox_error *err, int code, const char *sqlstate, const char *fmt, ...)
{
    if (!err)
        return code;
    err->code = code;
    err->sqlstate[0] = '\0';
    if (sqlstate) {
        size_t i;
        for (i = 0; i < 5 && sqlstate[i]; i++)
            err->sqlstate[i] = sqlstate[i];
        err->sqlstate[i] = '\0';
    }
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    if (n < 0)
        err->message[0] = '\0';
    /* one line: control characters become spaces, runs collapse, trailing trimmed */
    char *w = err->message;
    int prev_space = 0;
    for (const char *r = err->message; *r; r++) {
        unsigned char ch = (unsigned char)*r;
        if (ch < 0x20 || ch == 0x7f) {
            if (!prev_space)
                *w++ = ' ';
            prev_space = 1;
            continue;
        }
        prev_space = (ch == ' ');
        *w++ = (char)ch;
    }
    *w = '\0';
    while (w > err->message && w[-1] == ' ')
        *--w = '\0';
    /* never end in the middle of a UTF-8 sequence after truncation */
    size_t len = strlen(err->message);
    long bad;
    while (len > 0 && (bad = outbox_util_utf8_check(err->message, len)) >= 0)
        err->message[len = (size_t)bad] = '\0';
    return code;
}

const char *outbox_strerror(int code)
{
    switch (code) {
    case OUTBOX_OK:        return "success";
    case OUTBOX_DUPLICATE: return "duplicate message_id (already in the outbox)";
    case OUTBOX_EINVAL:    return "invalid argument";
    case OUTBOX_ENOTXN:    return "not inside an open, healthy transaction";
    case OUTBOX_EDBNAME:   return "connected database differs from the queue's database";
    case OUTBOX_ENOSCHEMA: return "outbox table missing (run outbox-relay init)";
    case OUTBOX_EDB:       return "database error";
    case OUTBOX_ENOMEM:    return "out of memory";
    case OUTBOX_ETXNLOST:  return "the transaction was rolled back or doomed by the server";
    default:               return "unknown status code";
    }
}

/* ------------------------------------------------------------ trace context */

/* W3C Trace Context (level 1), the headers a producer passes on so a consumer's
   span links to the producer's: the relay forwards them as AMQP headers. */

static int lowhex(const char *s, size_t n, int *all_zero)
{
    *all_zero = 1;
    for (size_t i = 0; i < n; i++) {
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
        if (s[i] != '0')
            *all_zero = 0;
    }
    return 1;
}

/* version "-" trace-id(32) "-" parent-id(16) "-" flags(2), lower-case hex; version ff,
   an all-zero trace-id or parent-id are invalid; a later version may append "-..." */
int outbox_i_traceparent_valid(const char *s)
{
    int zero, z2;
    size_t n = strlen(s);
    if (n < 55 || !lowhex(s, 2, &zero) || (s[0] == 'f' && s[1] == 'f') || s[2] != '-' ||
        !lowhex(s + 3, 32, &zero) || zero || s[35] != '-' || !lowhex(s + 36, 16, &z2) || z2 ||
        s[52] != '-' || !lowhex(s + 53, 2, &zero))
        return 0;
    if (s[0] == '0' && s[1] == '0')
        return n == 55;
    return n == 55 || s[55] == '-';
}

/* list-member *( OWS "," OWS list-member ), at most 32 members and 512 bytes;
   key: lcalpha 0*255(lcalpha / DIGIT / "_" / "-" / "*" / "/"), or tenant "@" system;
   value: 0*255 printable ASCII but "," and "=", not ending in a space, at least 1. */
static int ts_keychar(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '*' || c == '/';
}

int outbox_i_tracestate_valid(const char *s)
{
    size_t n = strlen(s), members = 0;
    if (n > 512)
        return 0;
    const char *p = s, *end = s + n;
    for (;;) {
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        if (p == end)                          /* empty members are allowed, then ignored */
            break;
        if (*p == ',') {
            p++;
            continue;
        }
        const char *k = p;
        while (p < end && *p != '=')
            p++;
        if (p == end || p == k)
            return 0;
        const char *at = memchr(k, '@', (size_t)(p - k));
        size_t klen = (size_t)(p - k);
        if (at) {                              /* tenant@system: 1..241 "@" 1..14 */
            size_t t = (size_t)(at - k), sys = klen - t - 1;
            if (t < 1 || t > 241 || sys < 1 || sys > 14 || !(at[1] >= 'a' && at[1] <= 'z') ||
                !((k[0] >= 'a' && k[0] <= 'z') || (k[0] >= '0' && k[0] <= '9')))
                return 0;
            for (const char *c = k; c < p; c++)
                if (c != at && !ts_keychar(*c))
                    return 0;
        } else {
            if (klen > 256 || !(k[0] >= 'a' && k[0] <= 'z'))
                return 0;
            for (const char *c = k; c < p; c++)
                if (!ts_keychar(*c))
                    return 0;
        }
        const char *v = ++p;
        while (p < end && *p != ',')
            p++;
        const char *ve = p;
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
            ve--;                              /* OWS before the next "," */
        if (ve == v || ve - v > 256)
            return 0;
        for (const char *c = v; c < ve; c++)
            if (*c < 0x20 || *c > 0x7e || *c == ',' || *c == '=')
                return 0;
        if (++members > 32)
            return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------ UUIDs */

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int outbox_i_uuid_valid(const char *s)
{
    if (!s)
        return 0;
    for (size_t i = 0; i < 36; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (s[i] != '-')
                return 0;
        } else if (hexval(s[i]) < 0) {
            return 0; /* also catches a NUL before 36 characters */
        }
    }
    return s[36] == '\0';
}

static int fill_random(unsigned char *p, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom(p + got, n - got, 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        got += (size_t)r;
    }
    if (got == n)
        return 0;
    /* kernels without getrandom(2): /dev/urandom */
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    got = 0;
    while (got < n) {
        ssize_t r = read(fd, p + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    return got == n ? 0 : -1;
}

int outbox_uuid_generate(char out[37])
{
    static const char hex[] = "0123456789abcdef";
    unsigned char r[16];
    if (!out)
        return OUTBOX_EINVAL;
    if (fill_random(r, sizeof r) != 0) {
        out[0] = '\0';
        return OUTBOX_EINVAL;
    }
    r[6] = (unsigned char)((r[6] & 0x0Fu) | 0x40u); /* version 4 */
    r[8] = (unsigned char)((r[8] & 0x3Fu) | 0x80u); /* RFC 4122 variant */
    char *w = out;
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10)
            *w++ = '-';
        *w++ = hex[r[i] >> 4];
        *w++ = hex[r[i] & 15];
    }
    *w = '\0';
    return OUTBOX_OK;
}

/* ----------------------------------------------------------------- queues */

int outbox_queue_new(outbox_queue **q, const char *database, const char *table,
                     outbox_error *err)
{
    outbox_queue_options o = { database, table, 0 };
    return outbox_queue_new_opts(q, &o, err);
}

int outbox_queue_new_opts(outbox_queue **q, const outbox_queue_options *opts,
                          outbox_error *err)
{
    outbox_i_err_clear(err);
    if (!q)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "q: NULL result pointer");
    *q = NULL;
    if (!opts)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "opts: NULL");
    if (!opts->database || !opts->database[0])
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "database: required (NULL or empty)");
    size_t dlen = strlen(opts->database);
    if (dlen > OUTBOX_MAX_DBNAME)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "database: %zu bytes, at most %d",
                            dlen, OUTBOX_MAX_DBNAME);
    long bad = outbox_util_utf8_check(opts->database, dlen);
    if (bad >= 0)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL,
                            "database: not valid UTF-8 (byte %ld)", bad);

    outbox_table_name tn;
    char why[200];
    if (outbox_table_parse(opts->table, &tn, why, sizeof why) != 0)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "table: %s", why);

    outbox_queue *n = calloc(1, sizeof *n);
    if (!n)
        return outbox_i_err(err, OUTBOX_ENOMEM, NULL, "out of memory creating the queue");
    n->database = strdup(opts->database);
    if (!n->database) {
        free(n);
        return outbox_i_err(err, OUTBOX_ENOMEM, NULL, "out of memory creating the queue");
    }
    n->name = tn;
    outbox_qualified(OUTBOX_DIALECT_POSTGRES, &tn, OUTBOX_TABLE_OUTBOX, n->pg_table, sizeof n->pg_table);
    outbox_qualified(OUTBOX_DIALECT_SQLSERVER, &tn, OUTBOX_TABLE_OUTBOX, n->ms_table, sizeof n->ms_table);
    n->max_payload = opts->max_payload ? opts->max_payload : OUTBOX_DEFAULT_MAX_PAYLOAD;
    *q = n; /* ownership passes to the caller: outbox_queue_free */
    return OUTBOX_OK;
}

void outbox_queue_free(outbox_queue *q)
{
    if (!q)
        return;
    free(q->database);
    free(q);
}

const char *outbox_queue_database(const outbox_queue *q) { return q ? q->database : NULL; }
const char *outbox_queue_schema(const outbox_queue *q) { return q ? q->name.schema : NULL; }
const char *outbox_queue_table(const outbox_queue *q) { return q ? q->name.table : NULL; }
size_t outbox_queue_max_payload(const outbox_queue *q) { return q ? q->max_payload : 0; }

/* ------------------------------------------------------------- validation */

typedef struct fld {
    char name[96];
} fld;

static const char *fname(fld *f, int batch, size_t i, const char *field)
{
    if (batch)
        snprintf(f->name, sizeof f->name, "messages[%zu].%s", i, field);
    else
        snprintf(f->name, sizeof f->name, "%s", field);
    return f->name;
}

static const char *hname(fld *f, int batch, size_t i, size_t h, const char *part)
{
    if (batch)
        snprintf(f->name, sizeof f->name, "messages[%zu].headers[%zu].%s", i, h, part);
    else
        snprintf(f->name, sizeof f->name, "headers[%zu].%s", h, part);
    return f->name;
}

/* Checks an optional short string: NULL ok (unless required), <= 255 bytes, UTF-8. */
static int check_short(const char *v, int required, const char *name, outbox_error *err)
{
    if (!v) {
        if (required)
            return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: required (NULL)", name);
        return OUTBOX_OK;
    }
    size_t len = strnlen(v, OUTBOX_MAX_SHORTSTR + 1);
    if (len > OUTBOX_MAX_SHORTSTR)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: longer than %d bytes", name,
                            OUTBOX_MAX_SHORTSTR);
    long bad = outbox_util_utf8_check(v, len);
    if (bad >= 0)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: not valid UTF-8 (byte %ld)", name,
                            bad);
    return OUTBOX_OK;
}

/* traceparent / tracestate headers must be what consumers' tracing reads: the
   lower-case key (AMQP header names are case-sensitive) and the W3C form. */
static int check_trace_header(const outbox_header *hd, int batch, size_t i, size_t h,
                              outbox_error *err)
{
    fld f;
    static const char *const keys[] = { "traceparent", "tracestate" };
    for (int t = 0; t < 2; t++) {
        if (strcasecmp(hd->key, keys[t]) != 0)
            continue;
        if (strcmp(hd->key, keys[t]) != 0)
            return outbox_i_err(err, OUTBOX_EINVAL, NULL,
                                "%s: \"%s\": trace context keys are read in lower case "
                                "(\"%s\")", hname(&f, batch, i, h, "key"), hd->key, keys[t]);
        static const char *const forms[] = {
            "00-<32 hex trace-id>-<16 hex parent-id>-<2 hex flags>, lower case, ids not all zero",
            "key=value list, at most 32 members and 512 bytes",
        };
        if (!(t == 0 ? outbox_i_traceparent_valid(hd->value)
                     : outbox_i_tracestate_valid(hd->value)))
            return outbox_i_err(err, OUTBOX_EINVAL, NULL,
                                "%s: %s value is not in W3C Trace Context form (%s)",
                                hname(&f, batch, i, h, "value"), keys[t], forms[t]);
        return OUTBOX_OK;
    }
    return OUTBOX_OK;
}

static int check_message(const outbox_queue *q, const outbox_message *m, size_t i, int batch,
                         outbox_i_msg *out, outbox_error *err)
{
    fld f;
    int rc;
    out->m = m;
    out->headers_json = NULL;
    out->dup = 0;

    if (!m->routing_key)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: required (NULL)",
                            fname(&f, batch, i, "routing_key"));
    if ((rc = check_short(m->routing_key, 1, fname(&f, batch, i, "routing_key"), err)) ||
        (rc = check_short(m->exchange, 0, fname(&f, batch, i, "exchange"), err)) ||
        (rc = check_short(m->partition_key, 0, fname(&f, batch, i, "partition_key"), err)) ||
        (rc = check_short(m->message_type, 0, fname(&f, batch, i, "message_type"), err)) ||
        (rc = check_short(m->content_type, 0, fname(&f, batch, i, "content_type"), err)) ||
        (rc = check_short(m->correlation_id, 0, fname(&f, batch, i, "correlation_id"), err)))
        return rc;

    if (m->message_id) {
        if (!outbox_i_uuid_valid(m->message_id))
            return outbox_i_err(err, OUTBOX_EINVAL, NULL,
                                "%s: not a canonical UUID (8-4-4-4-12 hex digits)",
                                fname(&f, batch, i, "message_id"));
        for (size_t k = 0; k < 36; k++) {
            char c = m->message_id[k];
            out->message_id[k] = (c >= 'A' && c <= 'F') ? (char)(c - 'A' + 'a') : c;
        }
        out->message_id[36] = '\0';
    } else if (outbox_uuid_generate(out->message_id) != OUTBOX_OK) {
        return outbox_i_err(err, OUTBOX_EINVAL, NULL,
                            "%s: NULL and no random UUID could be generated (getrandom: %s)",
                            fname(&f, batch, i, "message_id"), strerror(errno));
    }

    if (!m->payload && m->payload_len > 0)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: NULL with payload_len %zu",
                            fname(&f, batch, i, "payload"), m->payload_len);
    if (m->payload_len > q->max_payload)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL,
                            "%s: %zu bytes, larger than the limit of %zu bytes (the queue's "
                            "max_payload: the relay dead-letters rows over its max_message_size)",
                            fname(&f, batch, i, "payload"), m->payload_len, q->max_payload);

    if (m->delay_ms > OUTBOX_MAX_DELAY_MS)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL,
                            "%s: %llu ms, more than the limit of %llu ms (~100 years)",
                            fname(&f, batch, i, "delay_ms"), (unsigned long long)m->delay_ms,
                            (unsigned long long)OUTBOX_MAX_DELAY_MS);
    out->delay_ms = m->delay_ms;

    if (m->n_headers > 0 && !m->headers)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: NULL with n_headers %zu",
                            fname(&f, batch, i, "headers"), m->n_headers);
    if (m->n_headers > 0xFFFFu)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: %zu entries, at most 65535",
                            fname(&f, batch, i, "headers"), m->n_headers);
    for (size_t h = 0; h < m->n_headers; h++) {
        const outbox_header *hd = &m->headers[h];
        if (!hd->key || !hd->key[0])
            return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: %s",
                                hname(&f, batch, i, h, "key"), hd->key ? "empty" : "NULL");
        if ((rc = check_short(hd->key, 1, hname(&f, batch, i, h, "key"), err)))
            return rc;
        if (!hd->value)
            return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: NULL",
                                hname(&f, batch, i, h, "value"));
        long bad = outbox_util_utf8_check(hd->value, strlen(hd->value));
        if (bad >= 0)
            return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: not valid UTF-8 (byte %ld)",
                                hname(&f, batch, i, h, "value"), bad);
        if ((rc = check_trace_header(hd, batch, i, h, err)))
            return rc;
        for (size_t k = 0; k < h; k++) {
            if (strcmp(m->headers[k].key, hd->key) == 0)
                return outbox_i_err(err, OUTBOX_EINVAL, NULL,
                                    "%s: duplicate key (same as headers[%zu].key)",
                                    hname(&f, batch, i, h, "key"), k);
        }
    }
    if (m->n_headers > 0) {
        outbox_util_buf b = { 0 };
        outbox_util_buf_put(&b, "{", 1);
        for (size_t h = 0; h < m->n_headers; h++) {
            if (h)
                outbox_util_buf_put(&b, ",", 1);
            outbox_util_json_string(&b, m->headers[h].key, SIZE_MAX);
            outbox_util_buf_put(&b, ":", 1);
            outbox_util_json_string(&b, m->headers[h].value, SIZE_MAX);
        }
        outbox_util_buf_put(&b, "}", 1);
        if (b.failed) {
            outbox_util_buf_free(&b);
            return outbox_i_err(err, OUTBOX_ENOMEM, NULL, "out of memory encoding %s",
                                fname(&f, batch, i, "headers"));
        }
        out->headers_json = b.p; /* ownership passes to out */
    }
    return OUTBOX_OK;
}

static int cmp_idx(const void *a, const void *b, void *ctx)
{
    const outbox_i_msg *v = ctx;
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    int c = strcmp(v[x].message_id, v[y].message_id);
    if (c)
        return c;
    return x < y ? -1 : x > y;
}

void outbox_i_msgs_free(outbox_i_msg *v, size_t n)
{
    if (!v)
        return;
    for (size_t i = 0; i < n; i++)
        free(v[i].headers_json);
    free(v);
}

int outbox_i_prepare(const outbox_queue *q, const outbox_message *m, size_t n, int batch,
                     outbox_i_msg **out, size_t *n_unique, outbox_error *err)
{
    *out = NULL;
    *n_unique = 0;
    if (!q)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "q: NULL queue");
    if (!m && n > 0)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "%s: NULL", batch ? "messages" : "m");
    if (n > OUTBOX_MAX_BATCH)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "n: %zu messages, at most %u per batch",
                            n, OUTBOX_MAX_BATCH);
    if (n == 0)
        return OUTBOX_OK;
    outbox_i_msg *v = calloc(n, sizeof *v);
    if (!v)
        return outbox_i_err(err, OUTBOX_ENOMEM, NULL, "out of memory (%zu messages)", n);
    for (size_t i = 0; i < n; i++) {
        int rc = check_message(q, &m[i], i, batch, &v[i], err);
        if (rc != OUTBOX_OK) {
            outbox_i_msgs_free(v, n);
            return rc;
        }
    }
    size_t uniq = n;
    if (n > 1) {
        size_t *idx = malloc(n * sizeof *idx);
        if (!idx) {
            outbox_i_msgs_free(v, n);
            return outbox_i_err(err, OUTBOX_ENOMEM, NULL, "out of memory (%zu messages)", n);
        }
        for (size_t i = 0; i < n; i++)
            idx[i] = i;
        qsort_r(idx, n, sizeof *idx, cmp_idx, v);
        for (size_t k = 1; k < n; k++) {
            if (strcmp(v[idx[k]].message_id, v[idx[k - 1]].message_id) == 0) {
                v[idx[k]].dup = 1; /* the later one of the pair (sort is stable by index) */
                uniq--;
            }
        }
        free(idx);
    }
    *out = v; /* ownership passes to the caller: outbox_i_msgs_free */
    *n_unique = uniq;
    return OUTBOX_OK;
}

int outbox_i_check_dbname(const outbox_queue *q, const char *db, outbox_error *err)
{
    if (db != NULL && strcmp(db, q->database) == 0)
        return OUTBOX_OK;
    return outbox_i_err(err, OUTBOX_EDBNAME, NULL,
                        "connected to database \"%s\" but the queue is for database \"%s\" "
                        "(compared byte for byte); nothing written",
                        db ? db : "(unknown)", q->database);
}

int outbox_i_unique(outbox_i_msg *v, size_t n, size_t nu, outbox_i_msg ***out, outbox_error *err)
{
    outbox_i_msg **u = malloc(nu * sizeof *u);
    if (!u)
        return outbox_i_err(err, OUTBOX_ENOMEM, NULL, "out of memory (%zu messages)", n);
    for (size_t i = 0, k = 0; i < n; i++)
        if (!v[i].dup)
            u[k++] = &v[i];
    *out = u;
    return OUTBOX_OK;
}
