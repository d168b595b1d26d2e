/*
 * json.c — strict flat-object JSON → AMQP field table (see json.h).
 */
#include "sinks/rabbitmq/json.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct jp {
    const char *s;
    size_t      len;
    size_t      pos;
    char       *buf;      /* decoded string bytes (arena) */
    size_t      used;
    char       *err;
    size_t      errlen;
} jp;

static int jp_fail(jp *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int jp_fail(jp *p, const char *fmt, ...)
{
    char    what[160];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(p->err, p->errlen, "headers_json: %s at offset %zu", what, p->pos);
    return -1;
}

static void jp_ws(jp *p)
{
    while (p->pos < p->len) {
        char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        p->pos++;
    }
}

static int jp_hex4(jp *p, unsigned *out)
{
    unsigned v = 0;

    if (p->len - p->pos < 4)
        return jp_fail(p, "truncated \\u escape");
    for (int i = 0; i < 4; i++) {
        char c = p->s[p->pos++];
        v <<= 4;
        if (c >= '0' && c <= '9')      v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return jp_fail(p, "bad hex digit in \\u escape");
    }
    *out = v;
    return 0;
}

static void jp_put_utf8(jp *p, unsigned cp)
{
    char *o = p->buf + p->used;

    if (cp < 0x80) {
        o[0] = (char)cp;
        p->used += 1;
    } else if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        p->used += 2;
    } else if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        p->used += 3;
    } else {
        o[0] = (char)(0xF0 | (cp >> 18));
        o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[3] = (char)(0x80 | (cp & 0x3F));
        p->used += 4;
    }
}

/* Length of the valid UTF-8 sequence at s (n bytes available), 0 if invalid. */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    size_t        need;
    unsigned      cp;

    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) { need = 2; cp = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) { need = 3; cp = c & 0x0F; }
    else if (c >= 0xF0 && c <= 0xF4) { need = 4; cp = c & 0x07; }
    else return 0;
    if (n < need) return 0;
    for (size_t i = 1; i < need; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((need == 3 && cp < 0x800) || (need == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
        return 0;   /* overlong / out of range */
    if (cp >= 0xD800 && cp <= 0xDFFF)
        return 0;   /* encoded surrogate */
    return need;
}

/* Parses a JSON string at p->pos (which is at '"'); decoded bytes go to the arena. */
static int jp_string(jp *p, amqp_bytes_t *out)
{
    size_t start;

    p->pos++;   /* opening quote */
    start = p->used;
    for (;;) {
        unsigned char c;

        if (p->pos >= p->len)
            return jp_fail(p, "unterminated string");
        c = (unsigned char)p->s[p->pos];
        if (c == '"') {
            p->pos++;
            break;
        }
        if (c < 0x20)
            return jp_fail(p, "control character in string");
        if (c == '\\') {
            char e;

            if (++p->pos >= p->len)
                return jp_fail(p, "unterminated escape");
            e = p->s[p->pos++];
            switch (e) {
            case '"':  p->buf[p->used++] = '"';  break;
            case '\\': p->buf[p->used++] = '\\'; break;
            case '/':  p->buf[p->used++] = '/';  break;
            case 'b':  p->buf[p->used++] = '\b'; break;
            case 'f':  p->buf[p->used++] = '\f'; break;
            case 'n':  p->buf[p->used++] = '\n'; break;
            case 'r':  p->buf[p->used++] = '\r'; break;
            case 't':  p->buf[p->used++] = '\t'; break;
            case 'u': {
                unsigned cp, lo;

                if (jp_hex4(p, &cp) < 0)
                    return -1;
                if (cp >= 0xDC00 && cp <= 0xDFFF)
                    return jp_fail(p, "lone low surrogate");
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    if (p->len - p->pos < 6 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u')
                        return jp_fail(p, "high surrogate without low surrogate");
                    p->pos += 2;
                    if (jp_hex4(p, &lo) < 0)
                        return -1;
                    if (lo < 0xDC00 || lo > 0xDFFF)
                        return jp_fail(p, "high surrogate without low surrogate");
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                }
                jp_put_utf8(p, cp);
                break;
            }
            default:
                p->pos--;
                return jp_fail(p, "bad escape \\%c", e);
            }
            continue;
        }
        {
            size_t n = utf8_seq((const unsigned char *)p->s + p->pos, p->len - p->pos);
            if (n == 0)
                return jp_fail(p, "invalid UTF-8");
            memcpy(p->buf + p->used, p->s + p->pos, n);
            p->used += n;
            p->pos += n;
        }
    }
    out->bytes = p->buf + start;
    out->len = p->used - start;
    return 0;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

static int jp_number(jp *p, amqp_field_value_t *v)
{
    size_t start = p->pos;
    bool   integral = true;
    char   tmp[64];
    char  *heap = NULL, *txt, *end;
    size_t n;

    if (p->s[p->pos] == '-')
        p->pos++;
    if (p->pos >= p->len || !is_digit(p->s[p->pos]))
        return jp_fail(p, "bad number");
    if (p->s[p->pos] == '0') {
        p->pos++;
    } else {
        while (p->pos < p->len && is_digit(p->s[p->pos]))
            p->pos++;
    }
    if (p->pos < p->len && p->s[p->pos] == '.') {
        integral = false;
        p->pos++;
        if (p->pos >= p->len || !is_digit(p->s[p->pos]))
            return jp_fail(p, "bad number");
        while (p->pos < p->len && is_digit(p->s[p->pos]))
            p->pos++;
    }
    if (p->pos < p->len && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
        integral = false;
        p->pos++;
        if (p->pos < p->len && (p->s[p->pos] == '+' || p->s[p->pos] == '-'))
            p->pos++;
        if (p->pos >= p->len || !is_digit(p->s[p->pos]))
            return jp_fail(p, "bad number");
        while (p->pos < p->len && is_digit(p->s[p->pos]))
            p->pos++;
    }
    n = p->pos - start;
    if (n < sizeof tmp) {
        txt = tmp;
    } else {
        heap = malloc(n + 1);
        if (heap == NULL)
            return jp_fail(p, "out of memory");
        txt = heap;   /* freed below */
    }
    memcpy(txt, p->s + start, n);
    txt[n] = '\0';
    if (integral) {
        long long ll;

        errno = 0;
        ll = strtoll(txt, &end, 10);
        if (errno == 0 && *end == '\0') {
            v->kind = AMQP_FIELD_KIND_I64;
            v->value.i64 = (int64_t)ll;
            free(heap);
            return 0;
        }
        /* out of int64 range: carried as a double */
    }
    errno = 0;
    v->value.f64 = strtod(txt, &end);
    free(heap);
    if (*end != '\0' || !isfinite(v->value.f64))
        return jp_fail(p, "number out of range");
    v->kind = AMQP_FIELD_KIND_F64;
    return 0;
}

static int jp_word(jp *p, const char *w)
{
    size_t n = strlen(w);

    if (p->len - p->pos < n || memcmp(p->s + p->pos, w, n) != 0)
        return -1;
    p->pos += n;
    return 0;
}

static int jp_value(jp *p, amqp_field_value_t *v)
{
    char c;

    if (p->pos >= p->len)
        return jp_fail(p, "expected a value");
    c = p->s[p->pos];
    switch (c) {
    case '"':
        v->kind = AMQP_FIELD_KIND_UTF8;
        return jp_string(p, &v->value.bytes);
    case 't':
        if (jp_word(p, "true") < 0)
            break;
        v->kind = AMQP_FIELD_KIND_BOOLEAN;
        v->value.boolean = 1;
        return 0;
    case 'f':
        if (jp_word(p, "false") < 0)
            break;
        v->kind = AMQP_FIELD_KIND_BOOLEAN;
        v->value.boolean = 0;
        return 0;
    case 'n':
        if (jp_word(p, "null") < 0)
            break;
        v->kind = AMQP_FIELD_KIND_VOID;
        return 0;
    case '{':
    case '[':
        return jp_fail(p, "nested %s not allowed (headers must be a flat object)",
                       c == '{' ? "object" : "array");
    default:
        if (c == '-' || is_digit(c))
            return jp_number(p, v);
        break;
    }
    return jp_fail(p, "unexpected character '%c'", c);
}

int amqpsink_json_headers(const char *json, size_t len, amqp_table_t *out,
                          void **mem, char *err, size_t errlen)
{
    jp                   p = { .s = json, .len = len, .err = err, .errlen = errlen };
    size_t               cap, n = 0;
    amqp_table_entry_t  *ents;
    char                *block;

    out->num_entries = 0;
    out->entries = NULL;
    *mem = NULL;
    /* Each entry takes at least 5 bytes of text ("":0,), decoded strings are
     * never longer than their JSON spelling: one block bounds both. */
    cap = len / 4 + 1;
    if (cap > SIZE_MAX / sizeof *ents - len - 1) {
        snprintf(err, errlen, "headers_json: too large");
        return -1;
    }
    block = malloc(cap * sizeof *ents + len + 1);
    if (block == NULL) {
        snprintf(err, errlen, "headers_json: out of memory");
        return -1;
    }
    ents = (amqp_table_entry_t *)(void *)block;
    p.buf = block + cap * sizeof *ents;

    jp_ws(&p);
    if (p.pos >= p.len || p.s[p.pos] != '{') {
        jp_fail(&p, "expected a JSON object");
        goto fail;
    }
    p.pos++;
    jp_ws(&p);
    if (p.pos < p.len && p.s[p.pos] == '}') {
        p.pos++;
    } else {
        for (;;) {
            amqp_table_entry_t *e;

            jp_ws(&p);
            if (p.pos >= p.len || p.s[p.pos] != '"') {
                jp_fail(&p, "expected a string key");
                goto fail;
            }
            if (n == cap) {   /* cannot happen given the bound above */
                jp_fail(&p, "too many keys");
                goto fail;
            }
            e = &ents[n];
            if (jp_string(&p, &e->key) < 0)
                goto fail;
            if (e->key.len > 255) {
                jp_fail(&p, "key longer than 255 bytes");
                goto fail;
            }
            for (size_t i = 0; i < n; i++) {
                if (ents[i].key.len == e->key.len &&
                    memcmp(ents[i].key.bytes, e->key.bytes, e->key.len) == 0) {
                    jp_fail(&p, "duplicate key \"%.*s\"", (int)(e->key.len > 60 ? 60 : e->key.len),
                            (const char *)e->key.bytes);
                    goto fail;
                }
            }
            jp_ws(&p);
            if (p.pos >= p.len || p.s[p.pos] != ':') {
                jp_fail(&p, "expected ':'");
                goto fail;
            }
            p.pos++;
            jp_ws(&p);
            if (jp_value(&p, &e->value) < 0)
                goto fail;
            n++;
            jp_ws(&p);
            if (p.pos < p.len && p.s[p.pos] == ',') {
                p.pos++;
                continue;
            }
            if (p.pos < p.len && p.s[p.pos] == '}') {
                p.pos++;
                break;
            }
            jp_fail(&p, "expected ',' or '}'");
            goto fail;
        }
    }
    jp_ws(&p);
    if (p.pos != p.len) {
        jp_fail(&p, "trailing garbage after the object");
        goto fail;
    }
    if (n == 0) {
        free(block);
        return 0;
    }
    out->num_entries = (int)n;
    out->entries = ents;
    *mem = block;   /* ownership to the caller */
    return 0;
fail:
    free(block);
    return -1;
}
