/*
 * cfg.c — loads and validates the relay's ini file (contract in cfg.h, keys in README.md).
 *
 * Parse → validate → return: nothing here touches live state. iniparser only
 * splits the file into "section:key" → raw string; every value is parsed here
 * strictly (iniparser's own getters are lax). Each key is described once in a
 * table (name, type, default, bounds), which drives parsing, defaults and the
 * unknown-key check. Before that, the file's lines are read once more for what
 * iniparser would merge, cut or drop without a word (a section or key given
 * twice, a line continuation, a cut value: cfg_lines.c). All problems are
 * collected, one line each, then cfg_load fails. Secrets (url, conninfo,
 * password_file contents) are never echoed.
 *
 * Here: the error lines, the registry of backends, the key tables, applying them to
 * a section, the sections themselves, cfg_load and the comparison for a reload. The
 * value types are cfg_value.c's, ${NAME} and secret files cfg_secret.c's.
 */
#include "config/cfg.h"
#include "config/cfg_loader.h"
#include "outbox_schema.h"
#include "outbox_util.h"

#include <ctype.h>
#include <errno.h>
#include <iniparser.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define MS_S CFG_MS_S
#define MS_M CFG_MS_M
#define MS_H CFG_MS_H
#define MS_D CFG_MS_D

#define NAME_MAX_LEN 63

/* ------------------------------------------------------------------ */
/* error lines                                                         */
/* ------------------------------------------------------------------ */

static void errs_add(cfg_errors *e, char *line)
{
    char **n;

    if (!e) {
        free(line);
        return;
    }
    n = realloc(e->lines, (e->n + 1) * sizeof *n);
    if (!n) {
        free(line);
        return;
    }
    e->lines = n;
    e->lines[e->n++] = line; /* errs owns the line now */
}

void cfg_errors_clear(cfg_errors *e)
{
    if (!e)
        return;
    for (size_t i = 0; i < e->n; i++)
        free(e->lines[i]);
    free(e->lines);
    e->lines = NULL;
    e->n = 0;
}

/* One line: "FILE: [SECTION] KEY: message" (key NULL: "FILE: [SECTION]: message";
 * section NULL: "FILE: message"). */
void cfg_lerr(cfg_loader *L, const char *sec, const char *key, const char *fmt, ...)
{
    char msg[1024], *line = NULL;
    va_list ap;
    int n;

    L->nerr++;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (sec && key)
        n = asprintf(&line, "%s: [%s] %s: %s", L->file, sec, key, msg);
    else if (sec)
        n = asprintf(&line, "%s: [%s]: %s", L->file, sec, msg);
    else
        n = asprintf(&line, "%s: %s", L->file, msg);
    if (n < 0)
        return;
    errs_add(L->errs, line);
}

/* One line: "FILE:LINE: message" (the message names section and key itself). */
void cfg_lerr_line(cfg_loader *L, int lineno, const char *fmt, ...)
{
    char msg[1024], *line = NULL;
    va_list ap;

    L->nerr++;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (asprintf(&line, "%s:%d: %s", L->file, lineno, msg) < 0)
        return;
    errs_add(L->errs, line);
}

/* ------------------------------------------------------------------ */
/* backends                                                            */
/* ------------------------------------------------------------------ */

static const cfg_backend *backends[CFG_MAX_BACKENDS];
static size_t n_backends;

int cfg_register(const cfg_backend *b)
{
    if ((b->conf_size > 0 && b->conf_equal == NULL) || (b->n_keys > 0 && b->conf_size == 0))
        return -1; /* a reload could not compare its settings; its keys would have no home */
    for (size_t i = 0; i < n_backends; i++) {
        if (backends[i] == b)
            return 0;
        if (backends[i]->kind == b->kind && strcasecmp(backends[i]->name, b->name) == 0)
            return -1;
    }
    if (n_backends == CFG_MAX_BACKENDS)
        return -1;
    backends[n_backends++] = b;
    return 0;
}

const cfg_backend *cfg_backend_find(enum cfg_backend_kind kind, const char *name)
{
    for (size_t i = 0; i < n_backends; i++)
        if (backends[i]->kind == kind && (name == NULL || strcasecmp(backends[i]->name, name) == 0))
            return backends[i];
    return NULL; /* name NULL: the first of that kind (the default) */
}

struct cfg_report {
    cfg_loader *L;
    const char *sec;
};

void cfg_report_error(cfg_report *r, const char *key, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    cfg_lerr(r->L, r->sec, key, "%s", msg);
}

/* ------------------------------------------------------------------ */
/* the key tables                                                      */
/* ------------------------------------------------------------------ */

static const char *const log_level_names[] = { "error", "warn", "info", "debug", NULL };
static const int log_level_vals[] = { CFG_LOG_ERROR, CFG_LOG_WARN, CFG_LOG_INFO, CFG_LOG_DEBUG };
static const char *const log_format_names[] = { "text", "json", NULL };
static const int log_format_vals[] = { CFG_LOG_TEXT, CFG_LOG_JSON };
static const char *const on_sent_names[] = { "mark", "delete", NULL };
static const int on_sent_vals[] = { CFG_ON_SENT_MARK, CFG_ON_SENT_DELETE };
static const char *const mode_names[] = { "leader", "competing", NULL };
static const int mode_vals[] = { CFG_MODE_LEADER, CFG_MODE_COMPETING };
static const char *const ordering_names[] = { "pipelined", "strict", NULL };
static const int ordering_vals[] = { CFG_ORDER_PIPELINED, CFG_ORDER_STRICT };

#define DUR_MAX (3650LL * MS_D)
#define ENUM(n) n##_names, n##_vals

/* A key a line, its columns aligned as a table (left to the hand, not the formatter). */
/* clang-format off */
#define R(f) offsetof(cfg_relay, f)
static const cfg_key relay_keys[] = {
    { "name",             CFG_KT_NAME,   CFG_KF_EMPTY_NULL, NULL, 0, 0, NULL, NULL, R(name),
      "a relay name of 1..128 printable characters without spaces" },
    { "log_level",        CFG_KT_ENUM,   0, "info", 0, 0, ENUM(log_level), R(log_level), NULL },
    { "log_format",       CFG_KT_ENUM,   0, "text", 0, 0, ENUM(log_format), R(log_format), NULL },
    { "log_file",         CFG_KT_STR,    CFG_KF_EMPTY_NULL, "", 0, 0, NULL, NULL, R(log_file), "a file path" },
    { "http_listen",      CFG_KT_LISTEN, CFG_KF_EMPTY_NULL, "127.0.0.1:9187", 0, 0, NULL, NULL, R(http_listen), NULL },
    { "shutdown_timeout", CFG_KT_DUR,    0, "10s", 0, 24 * MS_H, NULL, NULL, R(shutdown_timeout_ms), NULL },
    { "max_rows_in_memory", CFG_KT_INT,  CFG_KF_AUTO, "auto", 1, 10000000, NULL, NULL,
      R(max_rows_in_memory), NULL },
    { "max_bytes_in_memory", CFG_KT_SIZE, 0, "64M", 1024LL * 1024,
      64LL * 1024 * 1024 * 1024, NULL, NULL, R(max_bytes_in_memory), NULL },
};
#undef R

#define S(f) offsetof(cfg_sink, f)
static const cfg_key sink_keys[] = {
    { "type",             CFG_KT_BACKEND, 0, NULL, CFG_BACKEND_SINK, 0, NULL, NULL, S(type), NULL },
    { "url",              CFG_KT_STR,  CFG_KF_SECRET | CFG_KF_NONEMPTY | CFG_KF_EXPECT_BACKENDS, NULL,
      CFG_BACKEND_SINK, 0, NULL, NULL, S(url), "a URL" },
    { "password_file",    CFG_KT_SECRET_FILE, CFG_KF_EMPTY_NULL, "", 0, 0, NULL, NULL, S(password), NULL },
    { "publish_window",   CFG_KT_INT,  0, "1000", 1, 65535, NULL, NULL, S(publish_window), NULL },
    { "confirm_timeout",  CFG_KT_DUR,  0, "30s", 10, 24 * MS_H, NULL, NULL, S(confirm_timeout_ms), NULL },
    { "connect_timeout",  CFG_KT_DUR,  0, "5s", 100, MS_H, NULL, NULL, S(connect_timeout_ms), NULL },
    { "reconnect_max",    CFG_KT_DUR,  0, "30s", 10, MS_D, NULL, NULL, S(reconnect_max_ms), NULL },
    { "max_message_size", CFG_KT_SIZE, 0, "128M", 1, 512LL * 1024 * 1024, NULL, NULL, S(max_message_size), NULL },
    { "confirms",         CFG_KT_BOOL, CFG_KF_MUST_TRUE, "true", 0, 0, NULL, NULL, S(confirms),
      "true (publisher confirms are required: a sink without confirms could lose messages)" },
};
#undef S

#define O(f) offsetof(cfg_outbox, f)
static const cfg_key outbox_keys[] = {
    { "source",            CFG_KT_BACKEND, 0, NULL, CFG_BACKEND_SOURCE, 0, NULL, NULL, O(source), NULL },
    { "conninfo",          CFG_KT_STR,  CFG_KF_REQUIRED | CFG_KF_SECRET | CFG_KF_NONEMPTY | CFG_KF_EXPECT_BACKENDS, NULL,
      CFG_BACKEND_SOURCE, 0, NULL, NULL, O(conninfo), "a connection string" },
    { "password_file",     CFG_KT_SECRET_FILE, CFG_KF_EMPTY_NULL, "", 0, 0, NULL, NULL, O(password), NULL },
    { "database",          CFG_KT_STR,  CFG_KF_REQUIRED | CFG_KF_NONEMPTY, NULL, 0, 0, NULL, NULL, O(database),
      "the database name the connection must be in" },
    { "table",             CFG_KT_STR,  CFG_KF_NONEMPTY, "outbox.messages", 0, 0, NULL, NULL, O(table),
      "schema.table" },
    { "sink",              CFG_KT_STR,  CFG_KF_NONEMPTY, "main", 0, 0, NULL, NULL, O(sink_name),
      "the NAME of a [sink.NAME] section" },
    { "batch_size",        CFG_KT_INT,  0, "500", 1, 100000, NULL, NULL, O(batch_size), NULL },
    { "poll_interval",     CFG_KT_DUR,  CFG_KF_AUTO, "auto", 10, MS_D, NULL, NULL, O(poll_interval_ms),
      NULL },
    { "lease",             CFG_KT_DUR,  0, "30s", MS_S, MS_D, NULL, NULL, O(lease_ms), NULL },
    { "max_attempts",      CFG_KT_INT,  0, "10", 1, 1000000, NULL, NULL, O(max_attempts), NULL },
    { "retry_backoff",     CFG_KT_DUR,  0, "1s", 10, MS_D, NULL, NULL, O(retry_backoff_ms), NULL },
    { "retry_backoff_max", CFG_KT_DUR,  0, "5m", 10, 30 * MS_D, NULL, NULL, O(retry_backoff_max_ms), NULL },
    { "on_sent",           CFG_KT_ENUM, 0, "mark", 0, 0, ENUM(on_sent), O(on_sent), NULL },
    { "retention",         CFG_KT_DUR,  0, "7d", 0, DUR_MAX, NULL, NULL, O(retention_ms), NULL },
    { "cleanup_batch",     CFG_KT_INT,  0, "1000", 1, 100000, NULL, NULL, O(cleanup_batch), NULL },
    { "cleanup_interval",  CFG_KT_DUR,  0, "10s", 10, MS_D, NULL, NULL, O(cleanup_interval_ms), NULL },
    { "claim_delay",       CFG_KT_DUR,  0, "5ms", 0, MS_S, NULL, NULL, O(claim_delay_ms), NULL },
    { "health_interval",   CFG_KT_DUR,  0, "15s", 0, MS_D, NULL, NULL, O(health_interval_ms), NULL },
    { "horizon_warn",      CFG_KT_DUR,  0, "5m", MS_S, 30 * MS_D, NULL, NULL, O(horizon_warn_ms), NULL },
    { "mode",              CFG_KT_ENUM, 0, "leader", 0, 0, ENUM(mode), O(mode), NULL },
    { "ordering",          CFG_KT_ENUM, 0, "pipelined", 0, 0, ENUM(ordering), O(ordering), NULL },
    { "query_timeout",     CFG_KT_DUR,  0, "30s", 10, 24 * MS_H, NULL, NULL, O(query_timeout_ms), NULL },
    { "connect_timeout",   CFG_KT_DUR,  0, "5s", 100, MS_H, NULL, NULL, O(connect_timeout_ms), NULL },
    { "reconnect_max",     CFG_KT_DUR,  0, "30s", 10, MS_D, NULL, NULL, O(reconnect_max_ms), NULL },
};
#undef O

#define NKEYS(t) (sizeof(t) / sizeof((t)[0]))
/* clang-format on */

/* ------------------------------------------------------------------ */
/* generic value parsing                                               */
/* ------------------------------------------------------------------ */

static void expect_text(const cfg_key *k, char *buf, size_t len)
{
    char a[32], b[32];
    size_t o = 0;

    if (k->flags & CFG_KF_EXPECT_BACKENDS) {
        /* "a libpq conninfo or an ODBC connection string": each text once */
        for (size_t i = 0; i < n_backends && o < len; i++) {
            const char *t = backends[i]->expect;
            bool dup = false;
            if (backends[i]->kind != (enum cfg_backend_kind)k->min || t == NULL)
                continue;
            for (size_t j = 0; j < i && !dup; j++)
                dup = backends[j]->kind == (enum cfg_backend_kind)k->min &&
                      backends[j]->expect != NULL && strcmp(backends[j]->expect, t) == 0;
            if (!dup)
                o += (size_t)snprintf(buf + o, len - o, "%s%s", o ? " or " : "", t);
        }
        if (o == 0)
            snprintf(buf, len, "%s", k->expect);
        return;
    }
    snprintf(buf, len, "a value");
    switch (k->type) { /* no default: -Wswitch names a key type added without its text */
    case CFG_KT_ENUM:
        o += (size_t)snprintf(buf + o, len - o, "one of ");
        for (size_t i = 0; k->names[i] && o < len; i++)
            o += (size_t)snprintf(buf + o, len - o, "%s%s", i ? " | " : "", k->names[i]);
        break;
    case CFG_KT_BACKEND: {
        bool first = true;
        o += (size_t)snprintf(buf + o, len - o, "one of ");
        for (size_t i = 0; i < n_backends && o < len; i++) {
            if (backends[i]->kind != (enum cfg_backend_kind)k->min)
                continue;
            o += (size_t)snprintf(buf + o, len - o, "%s%s", first ? "" : " | ", backends[i]->name);
            first = false;
        }
        break;
    }
    case CFG_KT_INT:
        snprintf(buf, len, "%san integer %lld..%lld", (k->flags & CFG_KF_AUTO) ? "auto or " : "",
                 (long long)k->min, (long long)k->max);
        break;
    case CFG_KT_DUR:
        cfg_fmt_duration(k->min, a, sizeof a);
        cfg_fmt_duration(k->max, b, sizeof b);
        snprintf(buf, len, "%sa duration like 250ms, 30s, 5m, 2h or 7d, %s%s..%s",
                 (k->flags & CFG_KF_AUTO) ? "auto or " : "",
                 (k->flags & CFG_KF_WHOLE_SEC) ? "in whole seconds, " : "", a, b);
        break;
    case CFG_KT_SIZE:
        cfg_fmt_size((uint64_t)k->min, a, sizeof a);
        cfg_fmt_size((uint64_t)k->max, b, sizeof b);
        snprintf(buf, len, "a size like 1024, 64k, 16M or 1G, %s..%s", a, b);
        break;
    case CFG_KT_BOOL:
        snprintf(buf, len, "%s",
                 (k->flags & CFG_KF_MUST_TRUE) ? k->expect
                                               : "true | false (or yes | no, on | off, 1 | 0)");
        break;
    case CFG_KT_LISTEN:
        snprintf(buf, len,
                 "host:port with a port 1..65535 (IPv6 as [addr]:port), or empty to disable");
        break;
    case CFG_KT_SECRET_FILE:
        snprintf(buf, len, "a readable file");
        break;
    case CFG_KT_STR:
    case CFG_KT_NAME:
        snprintf(buf, len, "%s", k->expect ? k->expect : "a value");
        break;
    }
}

/* Parses one value (already expanded) into base+k->off. Reports and returns -1 on error. */
static int apply_value(cfg_loader *L, const char *sec, const cfg_key *k, const char *v, void *base)
{
    char *field = (char *)base + k->off;
    char exp[512], qb[200];
    int64_t i64;
    size_t sz;
    bool b;

    expect_text(k, exp, sizeof exp);
#define BAD()                                                                                  \
    do {                                                                                       \
        if (k->flags & CFG_KF_SECRET)                                                          \
            cfg_lerr(L, sec, k->key, "expected %s, got <secret>", exp);                        \
        else                                                                                   \
            cfg_lerr(L, sec, k->key, "expected %s, got %s", exp, cfg_quote(v, qb, sizeof qb)); \
        return -1;                                                                             \
    } while (0)

    if (*v == '\0' && (k->flags & CFG_KF_NONEMPTY)) {
        cfg_lerr(L, sec, k->key, "expected %s, got an empty value", exp);
        return -1;
    }

    switch (k->type) {
    case CFG_KT_STR:
    case CFG_KT_NAME:
    case CFG_KT_LISTEN: {
        char **dst = (char **)(void *)field;
        char *copy;

        if (*v == '\0' && (k->flags & CFG_KF_EMPTY_NULL)) {
            free(*dst);
            *dst = NULL;
            return 0;
        }
        if (k->type == CFG_KT_NAME && !cfg_name_ok(v))
            BAD();
        if (k->type == CFG_KT_LISTEN && !cfg_listen_ok(v))
            BAD();
        if (k->flags & CFG_KF_READABLE) {
            if (access(v, R_OK) < 0) {
                cfg_lerr(L, sec, k->key, "expected %s, got %s (%s)", exp,
                         cfg_quote(v, qb, sizeof qb), strerror(errno));
                return -1;
            }
        }
        if (!(copy = strdup(v))) {
            cfg_lerr(L, sec, k->key, "out of memory");
            return -1;
        }
        if (k->flags & CFG_KF_SECRET)
            cfg_free_secret(*dst);
        else
            free(*dst);
        *dst = copy; /* the cfg owns it */
        return 0;
    }
    case CFG_KT_SECRET_FILE: {
        char **dst = (char **)(void *)field;
        char *content;

        if (*v == '\0') {
            cfg_free_secret(*dst);
            *dst = NULL;
            return 0;
        }
        if (!(content = cfg_read_secret_file(L, sec, k->key, v)))
            return -1;
        cfg_free_secret(*dst);
        *dst = content;
        return 0;
    }
    case CFG_KT_ENUM:
        for (size_t i = 0; k->names[i]; i++) {
            if (strcasecmp(v, k->names[i]) == 0) {
                *(int *)(void *)field = k->vals[i];
                return 0;
            }
        }
        BAD();
    case CFG_KT_BACKEND: {
        const cfg_backend *be = cfg_backend_find((enum cfg_backend_kind)k->min, v);
        if (be == NULL)
            BAD();
        *(const cfg_backend **)(void *)field = be;
        return 0;
    }
    case CFG_KT_INT:
        if ((k->flags & CFG_KF_AUTO) && strcasecmp(v, "auto") == 0) {
            *(int *)(void *)field = 0;
            return 0;
        }
        if (cfg_parse_int(v, k->min, k->max, &i64) < 0)
            BAD();
        *(int *)(void *)field = (int)i64;
        return 0;
    case CFG_KT_DUR:
        if ((k->flags & CFG_KF_AUTO) && strcasecmp(v, "auto") == 0) {
            *(int64_t *)(void *)field = 0;
            return 0;
        }
        if (cfg_parse_duration_ms(v, &i64) < 0 || i64 < k->min || i64 > k->max)
            BAD();
        if ((k->flags & CFG_KF_WHOLE_SEC) && i64 % MS_S != 0)
            BAD();
        *(int64_t *)(void *)field = i64;
        return 0;
    case CFG_KT_SIZE:
        if (cfg_parse_size(v, &sz) < 0 || (uint64_t)sz < (uint64_t)k->min ||
            (uint64_t)sz > (uint64_t)k->max)
            BAD();
        *(size_t *)(void *)field = sz;
        return 0;
    case CFG_KT_BOOL:
        if (cfg_parse_bool(v, &b) < 0)
            BAD();
        if ((k->flags & CFG_KF_MUST_TRUE) && !b)
            BAD();
        *(bool *)(void *)field = b;
        return 0;
    } /* no default: -Wswitch names a key type added without its parser */
#undef BAD
    cfg_lerr(L, sec, k->key, "internal error: unknown key type");
    return -1;
}

static const cfg_key *find_key(const cfg_key *t, size_t n, const char *key)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(t[i].key, key) == 0)
            return &t[i];
    return NULL;
}

/* The keys a section of kind (CFG_BACKEND_SINK, _SOURCE or, for [relay], _NONE) may
   hold: its table t, and the keys of its backend be; with be NULL (its name is not known
   before its value is expanded, or names nothing) the keys of every backend of the kind. */
static bool key_known(const cfg_key *t, size_t n, enum cfg_backend_kind kind, const cfg_backend *be,
                      const char *key)
{
    if (find_key(t, n, key))
        return true;
    for (size_t i = 0; kind != CFG_BACKEND_NONE && i < n_backends; i++)
        if (backends[i]->kind == kind && (be == NULL || backends[i] == be) &&
            backends[i]->keys != NULL && find_key(backends[i]->keys, backends[i]->n_keys, key))
            return true;
    return false;
}

/* Reports keys of section sec that it may not hold (key_known). */
static void check_unknown_keys(cfg_loader *L, const char *sec, const cfg_key *t, size_t n,
                               enum cfg_backend_kind kind, const char *kind_key)
{
    size_t slen = strlen(sec);
    dictionary *d = L->d;
    const cfg_backend *be = NULL;

    if (kind != CFG_BACKEND_NONE) { /* the section's backend, if its raw value names one */
        char full[512];
        snprintf(full, sizeof full, "%s:%s", sec, kind_key);
        const char *raw = iniparser_getstring(d, full, NULL);
        be = cfg_backend_find(kind, raw);
    }
    for (ssize_t i = 0; i < d->size; i++) {
        const char *k = d->key[i];
        char list[512];
        size_t o = 0;

        if (!k || !d->val[i] || strncmp(k, sec, slen) != 0 || k[slen] != ':')
            continue;
        if (key_known(t, n, kind, be, k + slen + 1))
            continue;
        for (size_t j = 0; j < n && o < sizeof list; j++)
            o += (size_t)snprintf(list + o, sizeof list - o, "%s%s", j ? ", " : "", t[j].key);
        for (size_t j = 0; be != NULL && be->keys != NULL && j < be->n_keys && o < sizeof list; j++)
            o += (size_t)snprintf(list + o, sizeof list - o, ", %s", be->keys[j].key);
        cfg_lerr(L, sec, k + slen + 1, "unknown key, expected one of %s", list);
    }
}

/* Applies every key of the table to base: the file's value (expanded) or the default. */
static void apply_section(cfg_loader *L, const char *sec, const cfg_key *t, size_t n, void *base)
{
    char full[512];

    for (size_t i = 0; i < n; i++) {
        const cfg_key *k = &t[i];
        const char *raw;
        char *v;

        snprintf(full, sizeof full, "%s:%s", sec, k->key);
        raw = iniparser_getstring(L->d, full, NULL);
        if (!raw) {
            if (k->flags & CFG_KF_REQUIRED) {
                char exp[512];
                expect_text(k, exp, sizeof exp);
                cfg_lerr(L, sec, k->key, "expected %s (required), got nothing", exp);
                continue;
            }
            if (k->def)
                apply_value(L, sec, k, k->def, base);
            else if (k->type == CFG_KT_BACKEND && /* the default: the first registered */
                     !(*(const cfg_backend **)(void *)((char *)base + k->off) = cfg_backend_find(
                           (enum cfg_backend_kind)k->min, NULL)))
                cfg_lerr(L, sec, k->key, "no implementation is built in");
            continue;
        }
        if (!(v = cfg_expand_env(L, sec, k->key, raw)))
            continue;
        apply_value(L, sec, k, v, base);
        cfg_free_secret(v);
    }
}

/* The section's backend settings: be->conf_size bytes, zeroed, in *conf, and be's keys
   applied to them. be NULL: its name was reported already. */
static void apply_backend_keys(cfg_loader *L, const char *sec, const cfg_backend *be, void **conf)
{
    if (be == NULL || be->conf_size == 0)
        return;
    if ((*conf = calloc(1, be->conf_size)) == NULL) {
        cfg_lerr(L, sec, NULL, "out of memory");
        return;
    }
    apply_section(L, sec, be->keys, be->n_keys, *conf);
}

/* ------------------------------------------------------------------ */
/* sections                                                            */
/* ------------------------------------------------------------------ */

static bool section_name_ok(const char *n)
{
    size_t len = strlen(n);

    if (len == 0 || len > NAME_MAX_LEN)
        return false;
    for (size_t i = 0; i < len; i++)
        if (!isalnum((unsigned char)n[i]) && n[i] != '_' && n[i] != '-' && n[i] != '.')
            return false;
    return true;
}

static void default_relay_name(cfg_loader *L, cfg_relay *r)
{
    char host[256];

    if (r->name)
        return;
    if (gethostname(host, sizeof host) < 0)
        snprintf(host, sizeof host, "localhost");
    host[sizeof host - 1] = '\0';
    if (asprintf(&r->name, "%s:%ld", host, (long)getpid()) < 0) {
        r->name = NULL;
        cfg_lerr(L, "relay", "name", "out of memory");
    }
}

static void finish_sink(cfg_loader *L, const char *sec, cfg_sink *s)
{
    cfg_report r = { L, sec };

    if (s->type == NULL || (s->type->conf_size > 0 && s->backend_conf == NULL))
        return; /* already reported */
    if (s->url == NULL && s->type->url_default != NULL &&
        (s->url = strdup(s->type->url_default)) == NULL) {
        cfg_lerr(L, sec, "url", "out of memory");
        return;
    }
    if (s->type->finish_sink != NULL)
        s->type->finish_sink(s, &r);
}

static void finish_outbox(cfg_loader *L, const char *sec, cfg_outbox *o)
{
    char qb[300];

    if (o->table) {
        outbox_table_name tn;
        char why[200];

        memset(&tn, 0, sizeof tn);
        why[0] = '\0';
        if (outbox_table_parse(o->table, &tn, why, sizeof why) < 0) {
            cfg_lerr(L, sec, "table",
                     "expected schema.table with each part matching [A-Za-z_][A-Za-z0-9_]* "
                     "(at most 63 bytes), got %s (%s)",
                     cfg_quote(o->table, qb, sizeof qb), why[0] ? why : "invalid");
        } else {
            snprintf(o->schema_part, sizeof o->schema_part, "%s", tn.schema);
            snprintf(o->table_part, sizeof o->table_part, "%s", tn.table);
            snprintf(o->dead_part, sizeof o->dead_part, "%s", tn.dead);
        }
    }
    if (o->retry_backoff_ms > o->retry_backoff_max_ms) {
        char a[32], b[32];
        cfg_fmt_duration(o->retry_backoff_ms, a, sizeof a);
        cfg_fmt_duration(o->retry_backoff_max_ms, b, sizeof b);
        cfg_lerr(L, sec, "retry_backoff_max",
                 "expected a duration of at least retry_backoff (%s), got \"%s\"", a, b);
    }
    if (o->source != NULL && o->source->finish_outbox != NULL &&
        (o->source->conf_size == 0 || o->backend_conf != NULL)) {
        cfg_report r = { L, sec };
        o->source->finish_outbox(o, &r);
    }
}

/* conf is NULL unless be has conf_size (apply_backend_keys). */
static void free_backend_conf(const cfg_backend *be, void *conf)
{
    if (conf != NULL && be->conf_free != NULL)
        be->conf_free(conf);
    free(conf);
}

static void free_sink(cfg_sink *s)
{
    free(s->name);
    cfg_free_secret(s->url);
    cfg_free_secret(s->password);
    free_backend_conf(s->type, s->backend_conf);
}

static void free_outbox(cfg_outbox *o)
{
    free(o->name);
    cfg_free_secret(o->conninfo);
    cfg_free_secret(o->password);
    free(o->database);
    free(o->table);
    free(o->sink_name);
    free_backend_conf(o->source, o->backend_conf);
}

void cfg_free(cfg *c)
{
    if (!c)
        return;
    free(c->path);
    free(c->relay.name);
    free(c->relay.log_file);
    free(c->relay.http_listen);
    for (size_t i = 0; i < c->n_sinks; i++)
        free_sink(&c->sinks[i]);
    free(c->sinks);
    for (size_t i = 0; i < c->n_outboxes; i++)
        free_outbox(&c->outboxes[i]);
    free(c->outboxes);
    free(c);
}

/* iniparser reports syntax errors through a process-wide callback; capture the
 * first message so it can become one error line (cfg_load runs on main's thread). */
static _Thread_local char ini_msg[512];

static int ini_error_cb(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int ini_error_cb(const char *fmt, ...)
{
    va_list ap;

    if (ini_msg[0])
        return 0;
    va_start(ap, fmt);
    vsnprintf(ini_msg, sizeof ini_msg, fmt, ap);
    va_end(ap);
    return 0;
}

/* Is key (a dictionary key "sec:key") inside one of the dictionary's sections? */
static const char *key_section(dictionary *d, const char *key, size_t *seclen)
{
    const char *best = NULL;
    size_t bestlen = 0;

    for (ssize_t i = 0; i < d->size; i++) {
        const char *s = d->key[i];
        size_t n;

        if (!s || d->val[i])
            continue; /* sections have NULL values */
        n = strlen(s);
        if (n > bestlen && strncmp(key, s, n) == 0 && key[n] == ':') {
            best = s;
            bestlen = n;
        }
    }
    *seclen = bestlen;
    return best;
}

int cfg_load(const char *path, cfg **out, cfg_errors *errs)
{
    cfg_loader L = { path ? path : "(null)", NULL, errs, 0 };
    cfg *c = NULL;
    FILE *f;
    size_t n_sinks = 0, n_outboxes = 0;
    bool bom = false;

    *out = NULL;
    if (!path) {
        cfg_lerr(&L, NULL, NULL, "cannot open: no file given");
        return -1;
    }
    /* iniparser only says "cannot open": check first so the line carries the reason */
    if (!(f = fopen(path, "r"))) {
        cfg_lerr(&L, NULL, NULL, "cannot open: %s", strerror(errno));
        return -1;
    }
    {
        struct stat st;
        unsigned char head[3];
        int is_dir = fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode);

        /* iniparser reads a UTF-8 byte order mark as part of line 1 */
        bom = !is_dir && fread(head, 1, sizeof head, f) == sizeof head &&
              memcmp(head, "\xef\xbb\xbf", 3) == 0;
        fclose(f);
        if (is_dir) {
            cfg_lerr(&L, NULL, NULL, "cannot open: %s", strerror(EISDIR));
            return -1;
        }
    }

    ini_msg[0] = '\0';
    iniparser_set_error_callback(ini_error_cb);
    L.d = iniparser_load(path);
    iniparser_set_error_callback(NULL);
    if (!L.d) {
        const char *lp = strrchr(ini_msg, '(');
        int line = 0;

        /* iniparser's message quotes the offending line (maybe a secret): keep only its number */
        if (bom)
            cfg_lerr(&L, NULL, NULL,
                     "line 1: cannot parse: expected plain text, got a UTF-8 byte order mark "
                     "at the start of the file (save it without BOM)");
        else if (lp && sscanf(lp, "(%d)", &line) == 1 && line > 0)
            cfg_lerr(&L, NULL, NULL,
                     "line %d: cannot parse: expected [section], key = value or a ; comment%s",
                     line,
                     strstr(ini_msg, "too long") ? " (line too long: at most 1024 bytes)" : "");
        else
            cfg_lerr(&L, NULL, NULL, "cannot parse the ini file");
        return -1;
    }

    if (!(c = calloc(1, sizeof *c)) || !(c->path = strdup(path))) {
        cfg_lerr(&L, NULL, NULL, "out of memory");
        goto fail;
    }

    /* the file's lines first: if iniparser merged, cut or dropped anything, the
     * dictionary is not what the file says and validating it would mislead */
    if (cfg_scan_lines(&L) > 0)
        goto fail;

    /* pass 1: classify sections, count, report strays */
    for (ssize_t i = 0; i < L.d->size; i++) {
        const char *k = L.d->key[i];

        if (!k)
            continue;
        if (L.d->val[i]) { /* a key: must be inside a section */
            size_t sl;
            if (!key_section(L.d, k, &sl)) {
                const char *colon = strchr(k, ':');
                cfg_lerr(
                    &L, "", colon ? colon + 1 : k,
                    "key outside any section, expected it under [relay], [sink.NAME] or [outbox.NAME]");
            }
            continue;
        }
        if (strcmp(k, "relay") == 0)
            continue;
        if (strncmp(k, "sink.", 5) == 0 && section_name_ok(k + 5)) {
            n_sinks++;
            continue;
        }
        if (strncmp(k, "outbox.", 7) == 0 && section_name_ok(k + 7)) {
            n_outboxes++;
            continue;
        }
        if (strncmp(k, "sink.", 5) == 0 || strncmp(k, "outbox.", 7) == 0)
            cfg_lerr(&L, k, NULL,
                     "bad section name, expected [sink.NAME] or [outbox.NAME] with NAME of 1..63 "
                     "characters [a-z0-9_.-] (names are case-insensitive)");
        else
            cfg_lerr(&L, k, NULL,
                     "unknown section, expected [relay], [sink.NAME] or [outbox.NAME]");
    }

    if (n_sinks && !(c->sinks = calloc(n_sinks, sizeof *c->sinks))) {
        cfg_lerr(&L, NULL, NULL, "out of memory");
        goto fail;
    }
    if (n_outboxes && !(c->outboxes = calloc(n_outboxes, sizeof *c->outboxes))) {
        cfg_lerr(&L, NULL, NULL, "out of memory");
        goto fail;
    }

    /* pass 2: [relay] (optional; defaults when absent) */
    check_unknown_keys(&L, "relay", relay_keys, NKEYS(relay_keys), CFG_BACKEND_NONE, NULL);
    apply_section(&L, "relay", relay_keys, NKEYS(relay_keys), &c->relay);
    default_relay_name(&L, &c->relay);

    /* pass 3: sinks and outboxes in file order */
    for (ssize_t i = 0; i < L.d->size; i++) {
        const char *k = L.d->key[i];

        if (!k || L.d->val[i])
            continue;
        if (strncmp(k, "sink.", 5) == 0 && section_name_ok(k + 5)) {
            cfg_sink *s = &c->sinks[c->n_sinks++];
            if (!(s->name = strdup(k + 5))) {
                cfg_lerr(&L, k, NULL, "out of memory");
                continue;
            }
            check_unknown_keys(&L, k, sink_keys, NKEYS(sink_keys), CFG_BACKEND_SINK, "type");
            apply_section(&L, k, sink_keys, NKEYS(sink_keys), s);
            apply_backend_keys(&L, k, s->type, &s->backend_conf);
            finish_sink(&L, k, s);
        } else if (strncmp(k, "outbox.", 7) == 0 && section_name_ok(k + 7)) {
            cfg_outbox *o = &c->outboxes[c->n_outboxes++];
            if (!(o->name = strdup(k + 7))) {
                cfg_lerr(&L, k, NULL, "out of memory");
                continue;
            }
            check_unknown_keys(&L, k, outbox_keys, NKEYS(outbox_keys), CFG_BACKEND_SOURCE,
                               "source");
            apply_section(&L, k, outbox_keys, NKEYS(outbox_keys), o);
            apply_backend_keys(&L, k, o->source, &o->backend_conf);
            finish_outbox(&L, k, o);
        }
    }

    /* pass 4: cross-section checks */
    if (c->n_outboxes == 0)
        cfg_lerr(&L, "outbox.NAME", NULL,
                 "missing section, expected at least one [outbox.NAME] section");
    for (size_t i = 0; i < c->n_outboxes; i++) {
        cfg_outbox *o = &c->outboxes[i];
        char sec[80], qb[200];

        if (!o->sink_name)
            continue;
        for (size_t j = 0; j < c->n_sinks; j++)
            if (c->sinks[j].name && strcasecmp(c->sinks[j].name, o->sink_name) == 0)
                o->sink = &c->sinks[j];
        if (!o->sink) {
            snprintf(sec, sizeof sec, "outbox.%s", o->name ? o->name : "");
            cfg_lerr(&L, sec, "sink",
                     "expected the NAME of a [sink.NAME] section, got %s (no [sink.%s] section "
                     "in this file; names are case-insensitive)",
                     cfg_quote(o->sink_name, qb, sizeof qb), o->sink_name);
        }
    }

    if (L.nerr)
        goto fail;
    iniparser_freedict(L.d);
    *out = c; /* the caller owns the cfg */
    return 0;

fail:
    if (L.d)
        iniparser_freedict(L.d);
    cfg_free(c);
    return -1;
}

int64_t cfg_poll_interval_ms(const cfg_outbox *ob, bool notified)
{
    if (ob->poll_interval_ms > 0)
        return ob->poll_interval_ms;
    return notified ? CFG_POLL_NOTIFIED_MS : CFG_POLL_UNNOTIFIED_MS;
}

size_t cfg_max_rows_in_memory(const cfg *c)
{
    if (c->relay.max_rows_in_memory > 0)
        return (size_t)c->relay.max_rows_in_memory;
    size_t rows = CFG_ROWS_IN_MEMORY_AUTO;
    for (size_t i = 0; i < c->n_outboxes; i++) {
        const cfg_outbox *ob = &c->outboxes[i];
        size_t own = (size_t)ob->sink->publish_window + 2 * (size_t)ob->batch_size;
        if (own > rows)
            rows = own;
    }
    return rows;
}

/* ------------------------------------------------------------------ */
/* comparison (reload)                                                 */
/* ------------------------------------------------------------------ */

/* The settings of one backend be (both sections have it). */
static bool backend_conf_equal(const cfg_backend *be, const void *a, const void *b)
{
    if (a == NULL || b == NULL)
        return a == b;
    return be->conf_equal(a, b);
}

bool cfg_sink_equal(const cfg_sink *a, const cfg_sink *b)
{
    if (a == NULL || b == NULL)
        return a == b;
    return outbox_util_str_eq(a->name, b->name) && a->type == b->type &&
           outbox_util_str_eq(a->url, b->url) && outbox_util_str_eq(a->password, b->password) &&
           a->publish_window == b->publish_window &&
           a->confirm_timeout_ms == b->confirm_timeout_ms &&
           a->connect_timeout_ms == b->connect_timeout_ms &&
           a->reconnect_max_ms == b->reconnect_max_ms &&
           a->max_message_size == b->max_message_size && a->confirms == b->confirms &&
           backend_conf_equal(a->type, a->backend_conf, b->backend_conf);
}

bool cfg_outbox_equal(const cfg_outbox *a, const cfg_outbox *b)
{
    if (a == NULL || b == NULL)
        return a == b;
    return outbox_util_str_eq(a->name, b->name) && a->source == b->source &&
           outbox_util_str_eq(a->conninfo, b->conninfo) &&
           outbox_util_str_eq(a->password, b->password) &&
           outbox_util_str_eq(a->database, b->database) && outbox_util_str_eq(a->table, b->table) &&
           strcmp(a->schema_part, b->schema_part) == 0 &&
           strcmp(a->table_part, b->table_part) == 0 && strcmp(a->dead_part, b->dead_part) == 0 &&
           outbox_util_str_eq(a->sink_name, b->sink_name) && cfg_sink_equal(a->sink, b->sink) &&
           a->batch_size == b->batch_size && a->poll_interval_ms == b->poll_interval_ms &&
           a->lease_ms == b->lease_ms && a->max_attempts == b->max_attempts &&
           a->retry_backoff_ms == b->retry_backoff_ms &&
           a->retry_backoff_max_ms == b->retry_backoff_max_ms && a->on_sent == b->on_sent &&
           a->retention_ms == b->retention_ms && a->cleanup_batch == b->cleanup_batch &&
           a->cleanup_interval_ms == b->cleanup_interval_ms && a->mode == b->mode &&
           a->claim_delay_ms == b->claim_delay_ms &&
           a->health_interval_ms == b->health_interval_ms &&
           a->horizon_warn_ms == b->horizon_warn_ms && a->ordering == b->ordering &&
           a->query_timeout_ms == b->query_timeout_ms &&
           a->connect_timeout_ms == b->connect_timeout_ms &&
           a->reconnect_max_ms == b->reconnect_max_ms &&
           backend_conf_equal(a->source, a->backend_conf, b->backend_conf);
}
