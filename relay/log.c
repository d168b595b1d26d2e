/*
 * log.c — one line per event, text or JSON, to stderr or log_file (log.h).
 *
 *   text: 2026-11-21T12:00:00.123Z INFO message
 *   json: {"ts":"2026-11-21T12:00:00.123Z","level":"info","msg":"message"[,"event":...]}
 *
 * Process state owned by the daemon's main. A mutex serialises writers (the
 * loop thread and ODBC worker threads); each line is built in one static
 * buffer under it (no allocation) and goes out in one write(2). Control
 * characters are escaped so one event is always one line; in JSON, invalid
 * UTF-8 becomes U+FFFD, so every line is valid JSON.
 */
#include "relay/log.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lib/outbox_util.h"

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static int   log_level_cur = CFG_LOG_INFO;
static int   log_format_cur = CFG_LOG_TEXT;
static int   log_fd = STDERR_FILENO;
static bool  log_echo;            /* also to stderr: a failed reopen of log_file */
static char *log_path;            /* owned here; NULL: stderr */

static int open_log(const char *path)
{
    int fd;

    do {
        fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY, 0640);
    } while (fd < 0 && errno == EINTR);
    return fd;
}

static void write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return;   /* nowhere left to report a failing log */
        }
        p += w;
        n -= (size_t)w;
    }
}

void log_setup(int level, int format, const char *file)
{
    int fd = -1, saved_errno = 0;
    char *path = NULL;

    if (file && *file) {
        fd = open_log(file);
        saved_errno = errno;
        if (fd >= 0 && !(path = strdup(file))) {
            close(fd);
            fd = -1;
            saved_errno = ENOMEM;
        }
    }
    pthread_mutex_lock(&log_mu);
    log_level_cur = level;
    log_format_cur = format;
    if (log_fd != STDERR_FILENO)
        close(log_fd);
    free(log_path);
    log_fd = fd >= 0 ? fd : STDERR_FILENO;
    log_path = path;   /* the logger owns it */
    pthread_mutex_unlock(&log_mu);
    if (file && *file && fd < 0)
        log_ev(CFG_LOG_ERROR, &(log_fields){ .event = "log_open_failed",
                                             .error = strerror(saved_errno) },
               "log_file: cannot open \"%s\": %s; logging to stderr", file,
               strerror(saved_errno));
}

int log_reopen(void)
{
    char *path = NULL;
    int fd, old, err;

    pthread_mutex_lock(&log_mu);
    if (log_path && !(path = strdup(log_path))) {
        pthread_mutex_unlock(&log_mu);
        return -1;
    }
    pthread_mutex_unlock(&log_mu);
    if (!path)
        return 0;   /* stderr: nothing to reopen */
    fd = open_log(path);
    err = errno;
    if (fd < 0) {
        /* The old file may be gone (rotated away, its directory removed): the
           line goes to stderr as well, where the service manager collects it. */
        pthread_mutex_lock(&log_mu);
        log_echo = true;
        pthread_mutex_unlock(&log_mu);
        log_ev(CFG_LOG_ERROR, &(log_fields){ .event = "log_reopen_failed", .error = strerror(err) },
               "log_file: cannot reopen \"%s\": %s; keeping the old file", path, strerror(err));
        pthread_mutex_lock(&log_mu);
        log_echo = false;
        pthread_mutex_unlock(&log_mu);
        free(path);
        return -1;
    }
    free(path);
    pthread_mutex_lock(&log_mu);
    old = log_fd;
    log_fd = fd;
    pthread_mutex_unlock(&log_mu);
    if (old != STDERR_FILENO)
        close(old);
    return 0;
}

int log_enabled(int level)
{
    int cur;

    pthread_mutex_lock(&log_mu);
    cur = log_level_cur;
    pthread_mutex_unlock(&log_mu);
    return level <= cur;
}

/* Room for a line: its head, its message part (LOG_LINE_MAX from the line's
 * start), every field (LOG_FIELD_MAX each) with its key, "..." after each cut
 * part and the closing. */
#define LOG_BUF_MAX (LOG_LINE_MAX + 16 + 8 * (LOG_FIELD_MAX + 64))

typedef struct lbuf {
    char   b[LOG_BUF_MAX];
    size_t n;
    size_t lim;    /* the part being written ends here at most */
    bool   full;   /* it did not fit: it is cut */
} lbuf;

static lbuf log_line;                  /* under log_mu */
static char log_text[LOG_LINE_MAX];    /* the formatted message, under log_mu */

/* Escaped text, all or nothing: a chunk never splits an escape or a character. */
static void put(lbuf *l, const char *s, size_t n)
{
    if (l->full || l->n + n > l->lim) {
        l->full = true;
        return;
    }
    memcpy(l->b + l->n, s, n);
    l->n += n;
}

/* Structure (keys, quotes, "..."): LOG_BUF_MAX has room for it past every limit. */
static void put_raw(lbuf *l, const char *s, size_t n)
{
    if (l->n + n > sizeof l->b)
        return;   /* cannot happen (LOG_BUF_MAX) */
    memcpy(l->b + l->n, s, n);
    l->n += n;
}

/* The escape of byte c in a text line (\n \r \t, other control characters and
 * DEL as \xXX), or NULL when it stands for itself. */
static const char *text_esc(unsigned char c, char esc[8])
{
    switch (c) {
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    default:    break;
    }
    if (c >= 0x20 && c != 0x7f)
        return NULL;
    snprintf(esc, 8, "\\x%02x", c);
    return esc;
}

/* Appends msg escaped: JSON string rules (json; DEL too) or C-like escapes (text). */
static void put_escaped(lbuf *l, const char *msg, bool json)
{
    const char *p = msg;
    size_t left = strlen(msg);

    while (left > 0 && !l->full) {
        unsigned char c = (unsigned char)*p;
        char esc[8];
        const char *e;
        size_t u = outbox_util_utf8_seq(p, left, NULL);

        if (json)
            e = c == 0x7f ? "\\u007f" : outbox_util_json_esc(c, esc);
        else
            e = text_esc(c, esc);
        if (e == NULL && u == 0) {   /* invalid UTF-8: keep the line valid */
            if (json)
                e = "\\ufffd";
            else {
                snprintf(esc, sizeof esc, "\\x%02x", c);
                e = esc;
            }
        }
        if (e != NULL) {
            put(l, e, strlen(e));
            p++;
            left--;
            continue;
        }
        put(l, p, u);
        p += u;
        left -= u;
    }
}

/* Appends s escaped, the line ending at lim bytes at most; a cut part ends with "...". */
static void put_part(lbuf *l, const char *s, size_t lim, bool json)
{
    l->lim = lim;
    l->full = false;
    put_escaped(l, s, json);
    if (l->full)
        put_raw(l, "...", 3);
    l->full = false;
}

/* ,"key":"value" for a value that is set; the value is cut at LOG_FIELD_MAX bytes. */
static void put_field(lbuf *l, const char *key, const char *val)
{
    if (val == NULL || *val == '\0')
        return;
    put_raw(l, ",\"", 2);
    put_raw(l, key, strlen(key));
    put_raw(l, "\":\"", 3);
    put_part(l, val, l->n + LOG_FIELD_MAX, true);
    put_raw(l, "\"", 1);
}

static void put_fields(lbuf *l, const log_fields *f)
{
    char id[32];
    int  n;

    put_field(l, "event", f->event);
    put_field(l, "outbox", f->outbox);
    put_field(l, "sink", f->sink);
    if (f->id != 0) {
        n = snprintf(id, sizeof id, ",\"id\":%" PRId64, f->id);
        if (n > 0 && (size_t)n < sizeof id)
            put_raw(l, id, (size_t)n);
    }
    put_field(l, "message_id", f->message_id);
    put_field(l, "partition_key", f->partition_key);
    put_field(l, "peer", f->peer);
    put_field(l, "error", f->error);
}

static void vlog(int level, const log_fields *f, const char *fmt, va_list ap)
{
    static const char *const upper[] = { "ERROR", "WARN", "INFO", "DEBUG" };
    static const char *const lower[] = { "error", "warn", "info", "debug" };
    char ts[96];
    struct timespec now;
    struct tm tm;
    lbuf *l = &log_line;
    int saved_errno = errno;

    pthread_mutex_lock(&log_mu);
    if (level > log_level_cur) {
        pthread_mutex_unlock(&log_mu);
        errno = saved_errno;
        return;
    }
    if (level < CFG_LOG_ERROR)
        level = CFG_LOG_ERROR;
    if (level > CFG_LOG_DEBUG)
        level = CFG_LOG_DEBUG;

    vsnprintf(log_text, sizeof log_text, fmt, ap);

    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &tm);
    snprintf(ts, sizeof ts, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
             tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
             (int)((now.tv_nsec / 1000000L) % 1000));

    l->n = 0;
    if (log_format_cur == CFG_LOG_JSON) {
        put_raw(l, "{\"ts\":\"", 7);
        put_raw(l, ts, strlen(ts));
        put_raw(l, "\",\"level\":\"", 11);
        put_raw(l, lower[level], strlen(lower[level]));
        put_raw(l, "\",\"msg\":\"", 9);
        put_part(l, log_text, LOG_LINE_MAX, true);
        put_raw(l, "\"", 1);
        if (f != NULL)
            put_fields(l, f);
        put_raw(l, "}\n", 2);
    } else {
        put_raw(l, ts, strlen(ts));
        put_raw(l, " ", 1);
        put_raw(l, upper[level], strlen(upper[level]));
        put_raw(l, " ", 1);
        put_part(l, log_text, LOG_LINE_MAX, false);
        put_raw(l, "\n", 1);
    }
    write_all(log_fd, l->b, l->n);
    if (log_echo && log_fd != STDERR_FILENO)
        write_all(STDERR_FILENO, l->b, l->n);
    pthread_mutex_unlock(&log_mu);
    errno = saved_errno;
}

void log_msg(int level, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vlog(level, NULL, fmt, ap);
    va_end(ap);
}

void log_ev(int level, const log_fields *f, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vlog(level, f, fmt, ap);
    va_end(ap);
}

/* ------------------------------------------------------------ rate-limited failures */

static double mono_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t text_hash(const char *s)
{
    uint64_t h = outbox_util_fnv1a64_str(s);

    return h != 0 ? h : 1;   /* 0 marks a free slot */
}

void log_fail_at(log_limit *ll, double now, int level, const log_fields *f, const char *msg)
{
    uint64_t  h = text_hash(msg);
    log_seen *e = NULL, *victim = &ll->seen[0];

    ll->failures++;
    for (size_t i = 0; i < LOG_LIMIT_SEEN; i++) {
        log_seen *x = &ll->seen[i];

        if (x->hash == h) {
            e = x;
            break;
        }
        if (victim->hash != 0 && (x->hash == 0 || x->since < victim->since))
            victim = x;   /* a free slot, else the one logged longest ago */
    }
    if (e == NULL) {
        /* a new reason: say it now (the count of the old one is in the next log_ok) */
        log_ev(level, f, "%s", msg);
        victim->hash = h;
        victim->since = now;
        victim->repeats = 0;
        return;
    }
    e->repeats++;
    if (now - e->since >= LOG_REPEAT_INTERVAL) {
        log_ev(level, f, "%s (repeated %u times in %.0f s)", msg, e->repeats, now - e->since);
        e->since = now;
        e->repeats = 0;
        return;
    }
    log_ev(LOG_DEBUG, f, "%s", msg);
}

void log_ok_at(log_limit *ll, double now, int level, const log_fields *f, const char *msg)
{
    (void)now;
    if (ll->failures > 0)
        log_ev(level, f, "%s after %u failure%s", msg, ll->failures, ll->failures == 1 ? "" : "s");
    else
        log_ev(level, f, "%s", msg);
    memset(ll->seen, 0, sizeof ll->seen);
    ll->failures = 0;
}

void log_fail(log_limit *ll, int level, const log_fields *f, const char *fmt, ...)
{
    char    msg[LOG_LINE_MAX];
    va_list ap;
    int     saved_errno = errno;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    log_fail_at(ll, mono_s(), level, f, msg);
    errno = saved_errno;
}

void log_ok(log_limit *ll, int level, const log_fields *f, const char *fmt, ...)
{
    char    msg[LOG_LINE_MAX];
    va_list ap;
    int     saved_errno = errno;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    log_ok_at(ll, mono_s(), level, f, msg);
    errno = saved_errno;
}
