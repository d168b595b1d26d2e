/*
 * util.c — strict UTF-8, UTF-8 <-> UTF-16 (iconv), growable buffers, JSON
 * string escaping, capped exponential back-off and its jitter, FNV-1a,
 * splitmix64 and xorshift64, shared by liboutbox and outbox-relay (see
 * outbox_util.h for who may call what).
 */
#include "outbox_util.h"

#include <errno.h>
#include <iconv.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ UTF-8 */

size_t outbox_util_utf8_seq(const char *str, size_t n, uint32_t *cp)
{
    const unsigned char *s = (const unsigned char *)str;
    if (n == 0)
        return 0;
    unsigned char c = s[0];
    if (c < 0x80) {
        if (cp)
            *cp = c;
        return 1;
    }
    size_t len;
    uint32_t v, min;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        v = c & 0x1Fu;
        min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        v = c & 0x0Fu;
        min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        v = c & 0x07u;
        min = 0x10000;
    } else {
        return 0; /* continuation byte, C0/C1 (always overlong), F5..FF */
    }
    if (len > n)
        return 0; /* cut short */
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0u) != 0x80u)
            return 0;
        v = (v << 6) | (s[i] & 0x3Fu);
    }
    if (v < min || v > 0x10FFFFu || (v >= 0xD800u && v <= 0xDFFFu))
        return 0;
    if (cp)
        *cp = v;
    return len;
}

long outbox_util_utf8_check(const char *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        size_t l = outbox_util_utf8_seq(s + i, len - i, NULL);
        if (l == 0)
            return (long)i;
        i += l;
    }
    return -1;
}

/* ---------------------------------------------------------------- buffers */

int outbox_util_buf_reserve(outbox_util_buf *b, size_t extra)
{
    if (b->failed)
        return -1;
    if (extra > SIZE_MAX - b->len - 1) {
        b->failed = 1;
        return -1;
    }
    size_t need = b->len + extra + 1;
    if (need <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need) {
        if (cap > SIZE_MAX / 2) {
            cap = need;
            break;
        }
        cap *= 2;
    }
    char *p = realloc(b->p, cap);
    if (!p) {
        b->failed = 1;
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

int outbox_util_buf_put(outbox_util_buf *b, const void *p, size_t n)
{
    if (outbox_util_buf_reserve(b, n) != 0)
        return -1;
    if (n)
        memcpy(b->p + b->len, p, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

int outbox_util_buf_puts(outbox_util_buf *b, const char *s)
{
    return outbox_util_buf_put(b, s, strlen(s));
}

int outbox_util_buf_printf(outbox_util_buf *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    if (b->failed)
        return -1;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->failed = 1;
        return -1;
    }
    if ((size_t)n < sizeof tmp)
        return outbox_util_buf_put(b, tmp, (size_t)n);
    if (outbox_util_buf_reserve(b, (size_t)n) != 0)
        return -1;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 0;
}

void outbox_util_buf_reset(outbox_util_buf *b)
{
    b->len = 0;
    b->failed = 0;
    if (b->p)
        b->p[0] = '\0';
}

void outbox_util_buf_free(outbox_util_buf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
    b->failed = 0;
}

/* ----------------------------------------------------------------- UTF-16 */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define UTF16_HOST "UTF-16BE"
#else
#define UTF16_HOST "UTF-16LE"
#endif

/* Converts *in (inleft bytes) into *out (outleft bytes) with cd. Input iconv
 * refuses (EILSEQ) or finds cut short at the end (EINVAL) is replaced: the
 * `unit` bytes at *in are skipped and rep (replen bytes) written instead.
 * 0, or -1 (no room: cannot happen with the callers' sizes). */
static int iconv_replacing(iconv_t cd, char **in, size_t inleft, char **out, size_t *outleft,
                           size_t unit, const void *rep, size_t replen)
{
    while (inleft > 0) {
        if (iconv(cd, in, &inleft, out, outleft) != (size_t)-1)
            return 0;
        if ((errno != EILSEQ && errno != EINVAL) || *outleft < replen || inleft < unit)
            return -1;
        memcpy(*out, rep, replen);
        *out += replen;
        *outleft -= replen;
        *in += unit;
        inleft -= unit;
    }
    return 0;
}

uint16_t *outbox_util_utf16_from_utf8(const char *s, size_t len, size_t *units)
{
    static const uint16_t fffd = 0xFFFD;
    /* a byte never makes more than one unit (4-byte sequences make two) */
    if (len > SIZE_MAX / sizeof(uint16_t) - 1)
        return NULL;
    uint16_t *w = malloc((len + 1) * sizeof *w);
    if (!w)
        return NULL;
    iconv_t cd = iconv_open(UTF16_HOST, "UTF-8");
    if (cd == (iconv_t)-1) {
        free(w);
        return NULL;
    }
    char *in = (char *)(uintptr_t)s; /* iconv's prototype lacks the const */
    char *out = (char *)w;
    size_t outleft = len * sizeof *w;
    int rc = iconv_replacing(cd, &in, len, &out, &outleft, 1, &fffd, sizeof fffd);
    iconv_close(cd);
    if (rc < 0) {
        free(w);
        return NULL;
    }
    *units = (size_t)(out - (char *)w) / sizeof *w;
    w[*units] = 0;
    return w; /* caller frees */
}

int outbox_util_utf16_to_utf8(outbox_util_buf *b, const uint16_t *w, size_t n)
{
    /* a unit never makes more than three bytes (a pair makes four) */
    if (n > SIZE_MAX / 3) {
        b->failed = 1;
        return -1;
    }
    if (outbox_util_buf_reserve(b, n * 3) != 0)
        return -1;
    iconv_t cd = iconv_open("UTF-8", UTF16_HOST);
    if (cd == (iconv_t)-1) {
        b->failed = 1;
        return -1;
    }
    char *in = (char *)(uintptr_t)w;
    char *out = b->p + b->len;
    size_t outleft = n * 3;
    int rc = iconv_replacing(cd, &in, n * sizeof *w, &out, &outleft, sizeof *w, "\xEF\xBF\xBD", 3);
    iconv_close(cd);
    if (rc < 0) {
        b->failed = 1;
        return -1;
    }
    b->len = (size_t)(out - b->p);
    b->p[b->len] = '\0';
    return 0;
}

/* ------------------------------------------------------------------- JSON */

const char *outbox_util_json_esc(unsigned char c, char esc[7])
{
    static const char hex[] = "0123456789abcdef";
    switch (c) {
    case '"':
        return "\\\"";
    case '\\':
        return "\\\\";
    case '\n':
        return "\\n";
    case '\r':
        return "\\r";
    case '\t':
        return "\\t";
    case '\b':
        return "\\b";
    case '\f':
        return "\\f";
    default:
        break;
    }
    if (c >= 0x20)
        return NULL;
    esc[0] = '\\';
    esc[1] = 'u';
    esc[2] = '0';
    esc[3] = '0';
    esc[4] = hex[c >> 4];
    esc[5] = hex[c & 15];
    esc[6] = '\0';
    return esc;
}

int outbox_util_json_string(outbox_util_buf *b, const char *s, size_t maxlen)
{
    size_t n = strlen(s), i = 0;
    outbox_util_buf_put(b, "\"", 1);
    while (i < n) {
        char u[7];
        const char *esc = NULL;
        size_t l = outbox_util_utf8_seq(s + i, n - i, NULL);
        if (l == 0)
            l = 1;
        if (l > maxlen - i)
            break;
        if (l == 1 && (esc = outbox_util_json_esc((unsigned char)s[i], u)) != NULL)
            outbox_util_buf_puts(b, esc);
        else if (l == 1 && (unsigned char)s[i] >= 0x80)
            outbox_util_buf_put(b, "\xEF\xBF\xBD", 3); /* not UTF-8: U+FFFD */
        else
            outbox_util_buf_put(b, s + i, l);
        i += l;
    }
    return outbox_util_buf_put(b, "\"", 1);
}

/* --------------------------------------------------------------- back-off */

int64_t outbox_util_backoff_next(int64_t cur_ms, int64_t min_ms, int64_t max_ms)
{
    int64_t d = cur_ms <= 0 ? min_ms : cur_ms > max_ms / 2 ? max_ms : cur_ms * 2;
    return d < min_ms ? min_ms : d;
}

int64_t outbox_util_backoff_nth(int64_t first_ms, int64_t max_ms, int n)
{
    int64_t d = first_ms < max_ms ? first_ms : max_ms;
    for (int i = 1; i < n && d > 0 && d < max_ms; i++)
        d = d > max_ms / 2 ? max_ms : d * 2;
    return d;
}

int64_t outbox_util_jitter(int64_t step_ms, uint64_t *rng)
{
    int64_t half, span;

    if (step_ms <= 1)
        return step_ms < 0 ? 0 : step_ms;
    half = step_ms / 2;
    span = step_ms - half; /* >= 1: the result stays below step_ms */
    return half + (int64_t)(outbox_util_xorshift64(rng) % (uint64_t)span);
}

/* ---------------------------------------------------------------- hashing */

uint64_t outbox_util_fnv1a64(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;

    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

uint64_t outbox_util_fnv1a64_str(const char *s)
{
    return outbox_util_fnv1a64(OUTBOX_UTIL_FNV64_INIT, s, strlen(s));
}

/* --------------------------------------------------------- random numbers */

uint64_t outbox_util_mix64(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

uint64_t outbox_util_splitmix64(uint64_t *state)
{
    return outbox_util_mix64(*state += 0x9e3779b97f4a7c15ULL);
}

uint64_t outbox_util_xorshift64(uint64_t *state)
{
    uint64_t x = *state;

    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    return x;
}

uint64_t outbox_util_seed(const void *p)
{
    uint64_t s = ((uint64_t)time(NULL) << 20) ^ (uint64_t)getpid() ^ (uint64_t)(uintptr_t)p;

    return s != 0 ? s : 0x9e3779b97f4a7c15ULL;
}

/* ---------------------------------------------------------------- strings */

bool outbox_util_str_eq(const char *a, const char *b)
{
    if (a == NULL || b == NULL)
        return a == b;
    return strcmp(a, b) == 0;
}
