/*
 * outbox_util.h — the small helpers that liboutbox (lib/) and outbox-relay
 * (relay/, sources/, sinks/) share, each written once (lib/util.c):
 *
 *   - strict UTF-8 (RFC 3629): one sequence, a whole string
 *   - UTF-8 <-> UTF-16 in host byte order (ODBC's SQLWCHAR), through iconv
 *   - a growable byte buffer with a sticky failure flag
 *   - JSON string escaping
 *   - capped exponential back-off, and the one jitter rule for reconnects
 *   - hashing (FNV-1a), pseudo-random numbers (splitmix64, xorshift64)
 *   - comparing strings that may be NULL
 *
 * Internal: not installed and not liboutbox's API. Any file of the project may
 * call these; applications must not. Every symbol is prefixed outbox_util_ and
 * hidden from liboutbox.so's dynamic symbol table; the relay and the test
 * programs reach them by linking liboutbox.a. No global state, no logging:
 * every function is safe from any thread.
 */
#ifndef OUTBOX_UTIL_H
#define OUTBOX_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* OUTBOX_MUST_CHECK marks a function whose result must not be dropped: a
 * status that says whether it worked, memory the caller now owns, or a value
 * that is the whole point of the call. GCC warns even through a (void) cast,
 * so a function some caller may rightly ignore does not carry it. */
#if defined(__GNUC__)
#define OUTBOX_HIDDEN       __attribute__((visibility("hidden")))
#define OUTBOX_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define OUTBOX_MUST_CHECK   __attribute__((warn_unused_result))
#else
#define OUTBOX_HIDDEN
#define OUTBOX_PRINTF(a, b)
#define OUTBOX_MUST_CHECK
#endif

/* ------------------------------------------------------------------ UTF-8 */

/* Length (1..4) of the valid UTF-8 sequence at s, n bytes being available, or
 * 0 when there is none (n == 0, a continuation or invalid lead byte, an
 * overlong form, a surrogate, a code point above U+10FFFF, a sequence cut
 * short). *cp (cp may be NULL) gets the code point of a valid sequence. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK size_t outbox_util_utf8_seq(const char *s, size_t n, uint32_t *cp);

/* -1 when s[0..len) is valid UTF-8 (an embedded NUL is), else the byte offset
 * of the first bad sequence. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK long outbox_util_utf8_check(const char *s, size_t len);

/* ---------------------------------------------------------------- buffers */

/* Growable bytes, NUL-terminated when p != NULL. Zero-initialise ({0}) to
 * start. After an allocation failure `failed` stays set and every later append
 * does nothing and returns -1, so a builder may check once at the end. */
typedef struct outbox_util_buf {
    char *p; /* owned */
    size_t len;
    size_t cap;
    int failed;
} outbox_util_buf;

/* Room for extra more bytes and the NUL (allocates even for extra == 0).
 * 0, or -1 with failed set. */
OUTBOX_HIDDEN int outbox_util_buf_reserve(outbox_util_buf *b, size_t extra);
/* Appends n bytes of p / the string s / formatted text: 0, or -1 (failed). */
OUTBOX_HIDDEN int outbox_util_buf_put(outbox_util_buf *b, const void *p, size_t n);
OUTBOX_HIDDEN int outbox_util_buf_puts(outbox_util_buf *b, const char *s);
OUTBOX_HIDDEN int outbox_util_buf_printf(outbox_util_buf *b, const char *fmt, ...)
    OUTBOX_PRINTF(2, 3);
/* Empties b for reuse (keeps its memory, clears failed). */
OUTBOX_HIDDEN void outbox_util_buf_reset(outbox_util_buf *b);
/* Frees the memory; b is empty ({0}) again. */
OUTBOX_HIDDEN void outbox_util_buf_free(outbox_util_buf *b);

/* ----------------------------------------------------------------- UTF-16 */

/* s[0..len) as UTF-16 in host byte order, NUL-terminated and malloc'd
 * (ownership to the caller); *units gets its length without the terminator.
 * Each byte that does not start a valid UTF-8 sequence becomes U+FFFD (input
 * is never refused, nothing valid is lost). NULL when memory (or iconv, which
 * holds UTF-8 and UTF-16 built in) fails. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK uint16_t *outbox_util_utf16_from_utf8(const char *s, size_t len,
                                                                      size_t *units);

/* Appends w[0..n) (host byte order) to b as UTF-8; each unpaired surrogate
 * becomes U+FFFD. A U+0000 unit is copied as a NUL byte. 0, or -1 (failed). */
OUTBOX_HIDDEN int outbox_util_utf16_to_utf8(outbox_util_buf *b, const uint16_t *w, size_t n);

/* ------------------------------------------------------------------- JSON */

/* How byte c is written inside a JSON string: NULL when it stands for itself,
 * else its escape: \" \\ \n \r \t \b \f, and \u00XX for the other control
 * characters below 0x20 (built in esc). DEL and bytes >= 0x80 are not
 * escaped. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK const char *outbox_util_json_esc(unsigned char c, char esc[7]);

/* Appends s as a JSON string literal, quotes included, escaped as above. Each
 * byte that does not start a valid UTF-8 sequence becomes U+FFFD, so the result
 * is always valid JSON. At most maxlen bytes of s are taken (SIZE_MAX: all),
 * cut on a character boundary. 0, or -1 (failed). */
OUTBOX_HIDDEN int outbox_util_json_string(outbox_util_buf *b, const char *s, size_t maxlen);

/* --------------------------------------------------------------- back-off */

/* The delay after a failure that followed a delay of cur_ms: twice cur_ms,
 * capped at max_ms, and never below min_ms (min_ms wins over a smaller max_ms);
 * cur_ms <= 0 (no delay yet) gives min_ms. Never overflows. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK int64_t outbox_util_backoff_next(int64_t cur_ms, int64_t min_ms,
                                                                 int64_t max_ms);

/* The delay before retry n (n >= 1) of a back-off that starts at first_ms and
 * doubles: first_ms * 2^(n-1), capped at max_ms (also when first_ms is larger).
 * Never overflows. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK int64_t outbox_util_backoff_nth(int64_t first_ms, int64_t max_ms,
                                                                int n);

/* The delay to actually wait for a reconnect back-off step of step_ms: drawn
 * uniformly from [step_ms/2, step_ms) with *rng (an xorshift64 state), so that
 * many clients that lost the same server do not all come back at once, while
 * the step (and so the configured ceiling of the back-off) is never exceeded
 * and never undercut by more than half. step_ms <= 1 gives step_ms (0 when
 * negative). Every reconnect of the relay (the database and broker
 * connections) waits by this rule. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK int64_t outbox_util_jitter(int64_t step_ms, uint64_t *rng);

/* ---------------------------------------------------------------- hashing */

/* FNV-1a, 64 bits: h folded with n bytes at p (start from OUTBOX_UTIL_FNV64_INIT;
 * feeding the bytes in pieces gives the hash of the whole). Fast, not keyed:
 * for hash tables, rate-limit slots and change detection, never for secrets. */
#define OUTBOX_UTIL_FNV64_INIT 0xcbf29ce484222325ULL
OUTBOX_HIDDEN OUTBOX_MUST_CHECK uint64_t outbox_util_fnv1a64(uint64_t h, const void *p, size_t n);
/* FNV-1a 64 of the NUL-terminated string s. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK uint64_t outbox_util_fnv1a64_str(const char *s);

/* --------------------------------------------------------- random numbers */

/* Not for secrets (tokens that must be unguessable come from getrandom). */

/* splitmix64: advances *state (any value) and returns its next output. Every
 * seed gives a full-period sequence of distinct 64-bit values. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK uint64_t outbox_util_splitmix64(uint64_t *state);
/* splitmix64's finaliser alone: a bijective mix of x's bits (a hash's last step). */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK uint64_t outbox_util_mix64(uint64_t x);
/* xorshift64 (13, 7, 17): advances *state, which must not be 0, and returns it. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK uint64_t outbox_util_xorshift64(uint64_t *state);
/* A nonzero seed for xorshift64 that differs between processes and between
 * objects of one process: the time, the process id and the address p. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK uint64_t outbox_util_seed(const void *p);

/* ---------------------------------------------------------------- strings */

/* a and b hold the same text, or are both NULL. */
OUTBOX_HIDDEN OUTBOX_MUST_CHECK bool outbox_util_str_eq(const char *a, const char *b);

#endif
