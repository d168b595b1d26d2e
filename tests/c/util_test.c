/*
 * util_test.c — cmocka unit tests for lib/util.c (outbox_util.h): strict
 * UTF-8, UTF-8 <-> UTF-16 through iconv (also against a decoder written here
 * from outbox_util_utf8_seq, on seeded random input), buffers, JSON escaping,
 * back-off and its jitter, FNV-1a, splitmix64/xorshift64, str_eq.
 * tests/test_unit_relay.py runs it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/outbox_util.h"

#define RANDOM_RUNS 20000

static uint64_t rng = 0x9e3779b97f4a7c15u;

static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

/* ------------------------------------------------------------------ UTF-8 */

static void utf8_valid(void **state)
{
    (void)state;
    static const char *const ok[] = {
        "", "plain ascii", "\x7f", "\xc2\x80", "\xdf\xbf", "\xe0\xa0\x80", "\xed\x9f\xbf",
        "\xee\x80\x80", "\xef\xbf\xbf", "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf",
        "caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x98\x80",
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        assert_int_equal(outbox_util_utf8_check(ok[i], strlen(ok[i])), -1);
    /* an embedded NUL is a valid code point when a length is given */
    assert_int_equal(outbox_util_utf8_check("a\0b", 3), -1);
}

static void utf8_invalid(void **state)
{
    (void)state;
    static const struct { const char *s; long at; } bad[] = {
        { "\x80", 0 },                 /* lone continuation */
        { "ab\xbf", 2 },
        { "\xc0\xaf", 0 },             /* overlong '/' */
        { "\xc1\xbf", 0 },             /* overlong */
        { "\xe0\x80\xaf", 0 },         /* overlong 3-byte */
        { "\xe0\x9f\xbf", 0 },         /* overlong 3-byte (U+07FF) */
        { "\xf0\x80\x80\xaf", 0 },     /* overlong 4-byte */
        { "\xf0\x8f\xbf\xbf", 0 },     /* overlong 4-byte (U+FFFF) */
        { "\xed\xa0\x80", 0 },         /* U+D800 */
        { "\xed\xbf\xbf", 0 },         /* U+DFFF */
        { "x\xed\xa0\x80\xed\xb0\x80", 1 }, /* CESU-8 surrogate pair */
        { "\xf4\x90\x80\x80", 0 },     /* U+110000 */
        { "\xf5\x80\x80\x80", 0 },
        { "\xfe", 0 }, { "\xff", 0 },
        { "\xc3", 0 },                 /* truncated */
        { "ok\xe2\x82", 2 },           /* truncated */
        { "\xf0\x9f\x98", 0 },         /* truncated */
        { "\xc3\x28", 0 },             /* bad continuation */
        { "\xe2\x28\xa1", 0 },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        long got = outbox_util_utf8_check(bad[i].s, strlen(bad[i].s));
        if (got != bad[i].at)
            fail_msg("case %zu: got %ld want %ld", i, got, bad[i].at);
    }
}

static void utf8_seq_decodes(void **state)
{
    (void)state;
    static const struct { const char *s; size_t len; uint32_t cp; } v[] = {
        { "\x00", 1, 0 }, { "\x7f", 1, 0x7f }, { "\xc2\x80", 2, 0x80 },
        { "\xdf\xbf", 2, 0x7ff }, { "\xe0\xa0\x80", 3, 0x800 }, { "\xed\x9f\xbf", 3, 0xd7ff },
        { "\xee\x80\x80", 3, 0xe000 }, { "\xef\xbf\xbd", 3, 0xfffd },
        { "\xef\xbf\xbf", 3, 0xffff }, { "\xf0\x90\x80\x80", 4, 0x10000 },
        { "\xf0\x9f\x98\x80", 4, 0x1f600 }, { "\xf4\x8f\xbf\xbf", 4, 0x10ffff },
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        uint32_t cp = 0xdeadbeef;
        assert_int_equal(outbox_util_utf8_seq(v[i].s, v[i].len, &cp), v[i].len);
        assert_int_equal(cp, v[i].cp);
        /* followed by more bytes: the same sequence */
        char two[8];
        memcpy(two, v[i].s, v[i].len);
        two[v[i].len] = 'z';
        assert_int_equal(outbox_util_utf8_seq(two, v[i].len + 1, NULL), v[i].len);
        /* fewer bytes available than the sequence needs: none */
        for (size_t n = 0; n < v[i].len; n++)
            assert_int_equal(outbox_util_utf8_seq(v[i].s, n, &cp), 0);
    }
    assert_int_equal(outbox_util_utf8_seq("", 0, NULL), 0);
    assert_int_equal(outbox_util_utf8_seq("\xed\xa0\x80", 3, NULL), 0);     /* surrogate */
    assert_int_equal(outbox_util_utf8_seq("\xc0\x80", 2, NULL), 0);         /* overlong NUL */
    assert_int_equal(outbox_util_utf8_seq("\xf4\x90\x80\x80", 4, NULL), 0); /* > U+10FFFF */
    assert_int_equal(outbox_util_utf8_seq("\xe2\x82\x41", 3, NULL), 0);     /* bad continuation */
}

/* ----------------------------------------------------------------- UTF-16 */

/* The reference: each valid sequence its code point, each other byte U+FFFD. */
static size_t ref_to_utf16(const char *s, size_t len, uint16_t *w)
{
    size_t j = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp = 0xFFFD;
        size_t l = outbox_util_utf8_seq(s + i, len - i, &cp);
        i += l ? l : 1;
        if (!l)
            cp = 0xFFFD;
        if (cp >= 0x10000) {
            w[j++] = (uint16_t)(0xD800 + ((cp - 0x10000) >> 10));
            w[j++] = (uint16_t)(0xDC00 + ((cp - 0x10000) & 0x3FF));
        } else {
            w[j++] = (uint16_t)cp;
        }
    }
    return j;
}

/* The reference the other way: pairs decoded, unpaired surrogates U+FFFD. */
static size_t ref_from_utf16(const uint16_t *w, size_t n, char *out)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = w[i];
        if (cp >= 0xD800 && cp <= 0xDBFF && i + 1 < n && w[i + 1] >= 0xDC00 &&
            w[i + 1] <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (w[i + 1] - 0xDC00u);
            i++;
        } else if (cp >= 0xD800 && cp <= 0xDFFF) {
            cp = 0xFFFD;
        }
        if (cp < 0x80) {
            out[k++] = (char)cp;
        } else if (cp < 0x800) {
            out[k++] = (char)(0xC0 | (cp >> 6));
            out[k++] = (char)(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out[k++] = (char)(0xE0 | (cp >> 12));
            out[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
            out[k++] = (char)(0x80 | (cp & 0x3F));
        } else {
            out[k++] = (char)(0xF0 | (cp >> 18));
            out[k++] = (char)(0x80 | ((cp >> 12) & 0x3F));
            out[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
            out[k++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    return k;
}

static void check_to_utf16(const char *s, size_t len, const uint16_t *want, size_t nwant)
{
    size_t units = 12345;
    uint16_t *w = outbox_util_utf16_from_utf8(s, len, &units);
    assert_non_null(w);
    assert_int_equal(units, nwant);
    assert_memory_equal(w, want, nwant * sizeof *w);
    assert_int_equal(w[units], 0);
    free(w);
}

static void utf16_from_utf8_cases(void **state)
{
    (void)state;
    check_to_utf16("", 0, (const uint16_t[]){ 0 }, 0);
    check_to_utf16("ab", 2, (const uint16_t[]){ 'a', 'b' }, 2);
    check_to_utf16("a\0b", 3, (const uint16_t[]){ 'a', 0, 'b' }, 3);
    check_to_utf16("caf\xc3\xa9", 5, (const uint16_t[]){ 'c', 'a', 'f', 0xE9 }, 4);
    check_to_utf16("\xe2\x9c\x93", 3, (const uint16_t[]){ 0x2713 }, 1);
    check_to_utf16("\xf0\x9f\x98\x80", 4, (const uint16_t[]){ 0xD83D, 0xDE00 }, 2);
    check_to_utf16("\xf4\x8f\xbf\xbf", 4, (const uint16_t[]){ 0xDBFF, 0xDFFF }, 2);
    check_to_utf16("\xef\xbb\xbf" "a", 4, (const uint16_t[]){ 0xFEFF, 'a' }, 2); /* BOM kept */
    /* invalid input: each bad byte one U+FFFD, the rest kept */
    check_to_utf16("a\xff" "b", 3, (const uint16_t[]){ 'a', 0xFFFD, 'b' }, 3);
    check_to_utf16("\xc0\xaf", 2, (const uint16_t[]){ 0xFFFD, 0xFFFD }, 2);
    check_to_utf16("\xed\xa0\x80", 3, (const uint16_t[]){ 0xFFFD, 0xFFFD, 0xFFFD }, 3);
    check_to_utf16("x\xe2\x82", 3, (const uint16_t[]){ 'x', 0xFFFD, 0xFFFD }, 3);
    check_to_utf16("\xe2\x82" "A", 3, (const uint16_t[]){ 0xFFFD, 0xFFFD, 'A' }, 3);
    check_to_utf16("\xf4\x90\x80\x80", 4,
                   (const uint16_t[]){ 0xFFFD, 0xFFFD, 0xFFFD, 0xFFFD }, 4);
}

static void check_to_utf8(const uint16_t *w, size_t n, const char *want, size_t nwant)
{
    outbox_util_buf b = { 0 };
    assert_int_equal(outbox_util_buf_puts(&b, "<"), 0);
    assert_int_equal(outbox_util_utf16_to_utf8(&b, w, n), 0);
    assert_int_equal(b.len, nwant + 1);
    assert_memory_equal(b.p + 1, want, nwant);
    assert_int_equal(b.p[b.len], '\0');
    outbox_util_buf_free(&b);
}

static void utf16_to_utf8_cases(void **state)
{
    (void)state;
    check_to_utf8(NULL, 0, "", 0);
    check_to_utf8((const uint16_t[]){ 'a', 0, 'b' }, 3, "a\0b", 3);
    check_to_utf8((const uint16_t[]){ 0xE9, 0x2713 }, 2, "\xc3\xa9\xe2\x9c\x93", 5);
    check_to_utf8((const uint16_t[]){ 0xD83D, 0xDE00 }, 2, "\xf0\x9f\x98\x80", 4);
    check_to_utf8((const uint16_t[]){ 0xFEFF }, 1, "\xef\xbb\xbf", 3);
    /* unpaired surrogates: U+FFFD each, nothing else lost */
    check_to_utf8((const uint16_t[]){ 'a', 0xD800, 'b' }, 3, "a\xef\xbf\xbd" "b", 5);
    check_to_utf8((const uint16_t[]){ 'a', 0xDC00, 'b' }, 3, "a\xef\xbf\xbd" "b", 5);
    check_to_utf8((const uint16_t[]){ 'a', 0xD800 }, 2, "a\xef\xbf\xbd", 4);
    check_to_utf8((const uint16_t[]){ 0xDE00, 0xD83D }, 2, "\xef\xbf\xbd\xef\xbf\xbd", 6);
    check_to_utf8((const uint16_t[]){ 0xD83D, 0xD83D, 0xDE00 }, 3,
                  "\xef\xbf\xbd\xf0\x9f\x98\x80", 7);
    /* the worst case of output size: three bytes a unit */
    check_to_utf8((const uint16_t[]){ 0xDC00, 0xDC00, 0xFFFF }, 3,
                  "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbf", 9);
}

/* Random bytes (biased towards UTF-8 lead and continuation bytes) and random
 * UTF-16 units (biased towards surrogates): iconv gives what the reference gives. */
static void utf16_random(void **state)
{
    (void)state;
    static const unsigned char pick[] = { 'a', 0x00, 0x7f, 0x80, 0xbf, 0xc0, 0xc2, 0xdf, 0xe0,
                                          0xed, 0xef, 0xf0, 0xf4, 0xf5, 0xff, 0xa0, 0x9f };
    char s[64], back[64 * 4];
    uint16_t want[64], w[64];
    for (int run = 0; run < RANDOM_RUNS; run++) {
        size_t len = rnd() % sizeof s;
        for (size_t i = 0; i < len; i++)
            s[i] = (char)(rnd() % 2 ? pick[rnd() % sizeof pick] : rnd() % 256);
        size_t n = ref_to_utf16(s, len, want), units = 0;
        uint16_t *got = outbox_util_utf16_from_utf8(s, len, &units);
        assert_non_null(got);
        if (units != n || memcmp(got, want, n * sizeof *got) != 0)
            fail_msg("run %d: UTF-8 -> UTF-16 differs from the reference", run);
        free(got);

        size_t nw = rnd() % (sizeof w / sizeof w[0]);
        for (size_t i = 0; i < nw; i++) {
            uint32_t r = rnd() % 4;
            w[i] = (uint16_t)(r == 0 ? 0xD800 + rnd() % 0x400
                            : r == 1 ? 0xDC00 + rnd() % 0x400 : rnd() % 0x10000);
        }
        size_t nb = ref_from_utf16(w, nw, back);
        outbox_util_buf b = { 0 };
        assert_int_equal(outbox_util_utf16_to_utf8(&b, w, nw), 0);
        if (b.len != nb || memcmp(b.p, back, nb) != 0)
            fail_msg("run %d: UTF-16 -> UTF-8 differs from the reference", run);
        /* and valid UTF-8 goes round unchanged */
        assert_int_equal(outbox_util_utf8_check(b.p, b.len), -1);
        got = outbox_util_utf16_from_utf8(b.p, b.len, &units);
        assert_non_null(got);
        outbox_util_buf_reset(&b);
        assert_int_equal(outbox_util_utf16_to_utf8(&b, got, units), 0);
        assert_int_equal(b.len, nb);
        assert_memory_equal(b.p, back, nb);
        free(got);
        outbox_util_buf_free(&b);
    }
}

/* ---------------------------------------------------------------- buffers */

static void buf_growth(void **state)
{
    (void)state;
    outbox_util_buf b = { 0 };
    assert_int_equal(outbox_util_buf_reserve(&b, 0), 0);   /* allocates: p is a string */
    assert_non_null(b.p);
    assert_int_equal(b.len, 0);
    for (int i = 0; i < 5000; i++) {
        char c = (char)('a' + i % 26);
        assert_int_equal(outbox_util_buf_put(&b, &c, 1), 0);
        assert_true(b.cap > b.len);
        assert_int_equal(b.p[b.len], '\0');
    }
    assert_int_equal(b.len, 5000);
    for (int i = 0; i < 5000; i++)
        assert_int_equal(b.p[i], 'a' + i % 26);
    assert_int_equal(outbox_util_buf_put(&b, "x\0y", 3), 0);   /* bytes, not a string */
    assert_memory_equal(b.p + 5000, "x\0y", 4);
    size_t cap = b.cap;
    outbox_util_buf_reset(&b);
    assert_int_equal(b.len, 0);
    assert_int_equal(b.cap, cap);
    assert_string_equal(b.p, "");
    outbox_util_buf_free(&b);
    assert_null(b.p);
    assert_int_equal(b.cap, 0);
}

static void buf_printf(void **state)
{
    (void)state;
    outbox_util_buf b = { 0 };
    char big[1000];
    memset(big, 'q', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    assert_int_equal(outbox_util_buf_printf(&b, "%d-%s", 42, "x"), 0);
    assert_string_equal(b.p, "42-x");
    assert_int_equal(outbox_util_buf_printf(&b, "[%s]", big), 0);   /* past the 256 scratch */
    assert_int_equal(b.len, 4 + 2 + 999);
    assert_int_equal(b.p[5], 'q');
    assert_int_equal(b.p[4 + 999], 'q');
    assert_string_equal(b.p + 4 + 1 + 999, "]");
    assert_int_equal(outbox_util_buf_printf(&b, "%s", ""), 0);
    assert_int_equal(b.len, 4 + 2 + 999);
    outbox_util_buf_free(&b);
}

static void buf_failure_sticks(void **state)
{
    (void)state;
    outbox_util_buf b = { 0 };
    assert_int_equal(outbox_util_buf_puts(&b, "keep"), 0);
    assert_int_equal(outbox_util_buf_reserve(&b, SIZE_MAX - 2), -1);   /* cannot exist */
    assert_true(b.failed);
    assert_int_equal(outbox_util_buf_puts(&b, "more"), -1);
    assert_int_equal(outbox_util_buf_printf(&b, "%d", 1), -1);
    assert_int_equal(outbox_util_json_string(&b, "j", SIZE_MAX), -1);
    assert_string_equal(b.p, "keep");   /* what was there stays a string */
    assert_int_equal(b.len, 4);
    outbox_util_buf_reset(&b);
    assert_false(b.failed);
    assert_int_equal(outbox_util_buf_puts(&b, "again"), 0);
    assert_string_equal(b.p, "again");
    outbox_util_buf_free(&b);
    assert_int_equal(outbox_util_utf16_to_utf8(&b, (const uint16_t[]){ 'a' }, SIZE_MAX / 2),
                     -1);
    assert_true(b.failed);
    outbox_util_buf_free(&b);
}

/* ------------------------------------------------------------------- JSON */

static char *json(const char *s, size_t maxlen)
{
    outbox_util_buf b = { 0 };
    assert_int_equal(outbox_util_json_string(&b, s, maxlen), 0);
    assert_false(b.failed);
    return b.p;
}

static void json_escape(void **state)
{
    (void)state;
    static const struct { const char *in, *out; } v[] = {
        { "", "\"\"" },
        { "abc", "\"abc\"" },
        { "a\"b", "\"a\\\"b\"" },
        { "a\\b", "\"a\\\\b\"" },
        { "/", "\"/\"" },
        { "\n\r\t\b\f", "\"\\n\\r\\t\\b\\f\"" },
        { "\x01\x1f", "\"\\u0001\\u001f\"" },
        { "\x0b\x1b", "\"\\u000b\\u001b\"" },
        { "\x7f", "\"\x7f\"" },
        { "caf\xc3\xa9", "\"caf\xc3\xa9\"" },
        { "\"\"\\\\", "\"\\\"\\\"\\\\\\\\\"" },
        { "\xf0\x9f\x98\x80", "\"\xf0\x9f\x98\x80\"" },
        /* not UTF-8: each bad byte U+FFFD, so the output is valid JSON */
        { "a\xff" "b", "\"a\xef\xbf\xbd" "b\"" },
        { "\xc0\xaf", "\"\xef\xbf\xbd\xef\xbf\xbd\"" },
        { "\xed\xa0\x80", "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"" },
        { "x\xe2\x82", "\"x\xef\xbf\xbd\xef\xbf\xbd\"" },
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        char *got = json(v[i].in, SIZE_MAX);
        assert_string_equal(got, v[i].out);
        free(got);
    }
    char esc[7];
    for (int c = 0; c < 256; c++) {
        const char *e = outbox_util_json_esc((unsigned char)c, esc);
        if (c < 0x20 || c == '"' || c == '\\')
            assert_non_null(e);
        else
            assert_null(e);
    }
}

static void json_maxlen(void **state)
{
    (void)state;
    static const struct { const char *in; size_t max; const char *out; } v[] = {
        { "abcdef", 3, "\"abc\"" },
        { "abc", 0, "\"\"" },
        { "abc", 3, "\"abc\"" },
        { "ab\xc3\xa9", 3, "\"ab\"" },                 /* never half a character */
        { "ab\xc3\xa9", 4, "\"ab\xc3\xa9\"" },
        { "\xf0\x9f\x98\x80z", 3, "\"\"" },
        { "a\n", 2, "\"a\\n\"" },                      /* counts input bytes, not output */
        { "a\xff" "b", 2, "\"a\xef\xbf\xbd\"" },
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        char *got = json(v[i].in, v[i].max);
        assert_string_equal(got, v[i].out);
        free(got);
    }
}

/* --------------------------------------------------------------- back-off */

static void backoff_next(void **state)
{
    (void)state;
    assert_int_equal(outbox_util_backoff_next(0, 100, 30000), 100);
    assert_int_equal(outbox_util_backoff_next(-5, 100, 30000), 100);
    assert_int_equal(outbox_util_backoff_next(100, 100, 30000), 200);
    int64_t d = 100;
    int steps = 0;
    while (d < 30000) {
        int64_t n = outbox_util_backoff_next(d, 100, 30000);
        assert_true(n > d);
        assert_true(n <= 30000);
        d = n;
        steps++;
    }
    assert_int_equal(steps, 9);   /* 100 .. 25600, then the cap */
    assert_int_equal(outbox_util_backoff_next(30000, 100, 30000), 30000);
    assert_int_equal(outbox_util_backoff_next(15001, 100, 30000), 30000);
    assert_int_equal(outbox_util_backoff_next(15000, 100, 30000), 30000);
    assert_int_equal(outbox_util_backoff_next(14999, 100, 30000), 29998);
    assert_int_equal(outbox_util_backoff_next(400, 100, 50), 100);     /* min beats max */
    assert_int_equal(outbox_util_backoff_next(70000, 100, 30000), 30000); /* max lowered */
    assert_int_equal(outbox_util_backoff_next(INT64_MAX - 1, 1, INT64_MAX), INT64_MAX);
    assert_int_equal(outbox_util_backoff_next(INT64_MAX / 2, 1, INT64_MAX), INT64_MAX - 1);
}

static void backoff_nth(void **state)
{
    (void)state;
    assert_int_equal(outbox_util_backoff_nth(1000, 60000, 1), 1000);
    assert_int_equal(outbox_util_backoff_nth(1000, 60000, 0), 1000);
    assert_int_equal(outbox_util_backoff_nth(1000, 60000, 2), 2000);
    assert_int_equal(outbox_util_backoff_nth(1000, 60000, 6), 32000);
    assert_int_equal(outbox_util_backoff_nth(1000, 60000, 7), 60000);
    assert_int_equal(outbox_util_backoff_nth(1000, 60000, 1000000), 60000);
    assert_int_equal(outbox_util_backoff_nth(90000, 60000, 1), 60000);  /* first above cap */
    assert_int_equal(outbox_util_backoff_nth(0, 60000, 10), 0);
    assert_int_equal(outbox_util_backoff_nth(3, INT64_MAX, 200), INT64_MAX);
    /* the same as stepping with backoff_next */
    int64_t d = 250;
    for (int n = 1; n < 40; n++) {
        assert_int_equal(outbox_util_backoff_nth(250, 100000, n), d);
        d = outbox_util_backoff_next(d, 250, 100000);
    }
}

/* The one jitter rule: uniform in [step/2, step), never above the step. */
static void jitter_rule(void **state)
{
    (void)state;
    uint64_t r = 0x2545f4914f6cdd1dULL;
    /* degenerate steps: nothing to spread */
    assert_int_equal(outbox_util_jitter(0, &r), 0);
    assert_int_equal(outbox_util_jitter(-7, &r), 0);
    assert_int_equal(outbox_util_jitter(1, &r), 1);
    for (int i = 0; i < 100; i++)
        assert_int_equal(outbox_util_jitter(2, &r), 1);   /* [1, 2) */
    assert_int_equal(outbox_util_jitter(3, &r) >= 1, 1);
    /* bounds, and both halves of the range are reached, for a few steps */
    static const int64_t steps[] = { 100, 101, 1000, 30000, INT64_MAX };
    for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
        int64_t step = steps[k], lo = INT64_MAX, hi = 0, low_half = 0;
        for (int i = 0; i < 20000; i++) {
            int64_t d = outbox_util_jitter(step, &r);
            assert_true(d >= step / 2);
            assert_true(d < step);
            lo = d < lo ? d : lo;
            hi = d > hi ? d : hi;
            low_half += d < step / 2 + (step - step / 2) / 2;
        }
        /* spread over the range: near both ends, about half below its middle */
        assert_true(lo - step / 2 <= (step - step / 2) / 100);
        assert_true(step - 1 - hi <= (step - step / 2) / 100);
        assert_true(low_half > 9000 && low_half < 11000);
    }
    /* the same state gives the same delays: the rule is the state's, no hidden one */
    uint64_t a = 42, b = 42;
    for (int i = 0; i < 100; i++)
        assert_int_equal(outbox_util_jitter(5000, &a), outbox_util_jitter(5000, &b));
}

/* FNV-1a 64: the published test vectors, and pieces hash like the whole. */
static void fnv1a64_vectors(void **state)
{
    (void)state;
    assert_true(outbox_util_fnv1a64_str("") == 0xcbf29ce484222325ULL);
    assert_true(outbox_util_fnv1a64_str("a") == 0xaf63dc4c8601ec8cULL);
    assert_true(outbox_util_fnv1a64_str("foobar") == 0x85944171f73967e8ULL);
    assert_true(outbox_util_fnv1a64(OUTBOX_UTIL_FNV64_INIT, "foobar", 6) == 0x85944171f73967e8ULL);
    uint64_t h = outbox_util_fnv1a64(OUTBOX_UTIL_FNV64_INIT, "foo", 3);
    assert_true(outbox_util_fnv1a64(h, "bar", 3) == 0x85944171f73967e8ULL);
    assert_true(outbox_util_fnv1a64(h, NULL, 0) == h);
    /* bytes above 0x7f and NUL count as bytes */
    assert_true(outbox_util_fnv1a64(OUTBOX_UTIL_FNV64_INIT, "a\0b", 3) !=
                outbox_util_fnv1a64(OUTBOX_UTIL_FNV64_INIT, "ab", 2));
    assert_true(outbox_util_fnv1a64_str("\xc3\xa9") != outbox_util_fnv1a64_str("\xc3\xa8"));
}

static void prng_sequences(void **state)
{
    (void)state;
    /* splitmix64 from seed 0: the reference implementation's first outputs */
    uint64_t sm = 0;
    assert_true(outbox_util_splitmix64(&sm) == 0xe220a8397b1dcdafULL);
    assert_true(outbox_util_splitmix64(&sm) == 0x6e789e6aa1b965f4ULL);
    assert_true(outbox_util_mix64(0x9e3779b97f4a7c15ULL) == 0xe220a8397b1dcdafULL);
    /* xorshift64 (13, 7, 17) from 1 */
    uint64_t xs = 1;
    assert_true(outbox_util_xorshift64(&xs) == 0x40822041ULL);
    assert_true(outbox_util_xorshift64(&xs) == 0x100041060c011441ULL);
    assert_true(xs == 0x100041060c011441ULL);
    /* seeds are never 0 (xorshift64 would stay at 0) and depend on the address */
    int x, y;
    assert_true(outbox_util_seed(&x) != 0);
    assert_true(outbox_util_seed(NULL) != 0);
    assert_true(outbox_util_seed(&x) != outbox_util_seed(&y));
}

static void str_eq_cases(void **state)
{
    (void)state;
    assert_true(outbox_util_str_eq(NULL, NULL));
    assert_false(outbox_util_str_eq("a", NULL));
    assert_false(outbox_util_str_eq(NULL, "a"));
    assert_false(outbox_util_str_eq(NULL, ""));
    assert_true(outbox_util_str_eq("", ""));
    assert_true(outbox_util_str_eq("abc", "abc"));
    assert_false(outbox_util_str_eq("abc", "abd"));
    assert_false(outbox_util_str_eq("abc", "ab"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(utf8_valid),
        cmocka_unit_test(utf8_invalid),
        cmocka_unit_test(utf8_seq_decodes),
        cmocka_unit_test(utf16_from_utf8_cases),
        cmocka_unit_test(utf16_to_utf8_cases),
        cmocka_unit_test(utf16_random),
        cmocka_unit_test(buf_growth),
        cmocka_unit_test(buf_printf),
        cmocka_unit_test(buf_failure_sticks),
        cmocka_unit_test(json_escape),
        cmocka_unit_test(json_maxlen),
        cmocka_unit_test(backoff_next),
        cmocka_unit_test(backoff_nth),
        cmocka_unit_test(jitter_rule),
        cmocka_unit_test(fnv1a64_vectors),
        cmocka_unit_test(prng_sequences),
        cmocka_unit_test(str_eq_cases),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (rc == 0)
        printf("%d random UTF-8/UTF-16 runs ok\n", RANDOM_RUNS);
    return rc;
}
