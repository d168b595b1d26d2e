/*
 * cfg_value.c — the configuration's value types: the strict parsers of integers,
 * durations, sizes and booleans, the checks of names and listen addresses, and how a
 * value is written back into an error line (quoted, or as a duration or a size).
 * Nothing here reads the file or reports: the loader (cfg.c) does.
 */
#include "config/cfg.h"
#include "config/cfg_loader.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ------------------------------------------------------------------ */
/* strict scalar parsers                                               */
/* ------------------------------------------------------------------ */

/* Leading digits only: no sign, no whitespace, no hex/octal/exponent. */
static int parse_digits(const char *s, const char **end, int64_t *out)
{
    char *e;
    long long v;

    if (!s || !isdigit((unsigned char)s[0]))
        return -1;
    errno = 0;
    v = strtoll(s, &e, 10);
    if (errno == ERANGE || e == s)
        return -1;
    *end = e;
    *out = (int64_t)v;
    return 0;
}

int cfg_parse_duration_ms(const char *s, int64_t *out)
{
    const char *end;
    int64_t v, mult;

    if (parse_digits(s, &end, &v) < 0)
        return -1;
    if (*end == '\0' || strcmp(end, "s") == 0)
        mult = CFG_MS_S;
    else if (strcmp(end, "ms") == 0)
        mult = 1;
    else if (strcmp(end, "m") == 0)
        mult = CFG_MS_M;
    else if (strcmp(end, "h") == 0)
        mult = CFG_MS_H;
    else if (strcmp(end, "d") == 0)
        mult = CFG_MS_D;
    else
        return -1;
    if (v > INT64_MAX / mult)
        return -1;
    *out = v * mult;
    return 0;
}

int cfg_parse_int(const char *s, int64_t min, int64_t max, int64_t *out)
{
    char *e;
    long long v;
    const char *d;

    if (!s)
        return -1;
    d = (s[0] == '-') ? s + 1 : s;
    if (!isdigit((unsigned char)d[0]))
        return -1;
    errno = 0;
    v = strtoll(s, &e, 10);
    if (errno == ERANGE || e == s || *e != '\0')
        return -1;
    if ((int64_t)v < min || (int64_t)v > max)
        return -1;
    *out = (int64_t)v;
    return 0;
}

int cfg_parse_bool(const char *s, bool *out)
{
    static const char *const yes[] = { "true", "yes", "on", "1" };
    static const char *const no[] = { "false", "no", "off", "0" };

    if (!s)
        return -1;
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *out = true;
            return 0;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *out = false;
            return 0;
        }
    }
    return -1;
}

int cfg_parse_size(const char *s, size_t *out)
{
    const char *end;
    int64_t v;
    uint64_t mult;

    if (parse_digits(s, &end, &v) < 0)
        return -1;
    if (*end == '\0')
        mult = 1;
    else if (end[1] != '\0')
        return -1;
    else if (*end == 'k' || *end == 'K')
        mult = 1024ULL;
    else if (*end == 'm' || *end == 'M')
        mult = 1024ULL * 1024;
    else if (*end == 'g' || *end == 'G')
        mult = 1024ULL * 1024 * 1024;
    else
        return -1;
    if ((uint64_t)v > (uint64_t)SIZE_MAX / mult)
        return -1;
    *out = (size_t)((uint64_t)v * mult);
    return 0;
}

const char *cfg_log_level_name(int level)
{
    switch (level) {
    case CFG_LOG_ERROR:
        return "error";
    case CFG_LOG_WARN:
        return "warn";
    case CFG_LOG_INFO:
        return "info";
    case CFG_LOG_DEBUG:
        return "debug";
    default:
        return "unknown";
    }
}

bool cfg_host_char_ok(int c)
{
    return isalnum(c) || c == '.' || c == '-' || c == '_';
}

void cfg_free_secret(char *s)
{
    if (s) {
        explicit_bzero(s, strlen(s));
        free(s);
    }
}

/* Quotes a value for an error line: "..." with control characters escaped,
 * long values shortened. Never call it on a secret. */
const char *cfg_quote(const char *v, char *buf, size_t len)
{
    size_t o = 0;

    if (len < 16) {
        if (len)
            buf[0] = '\0';
        return buf;
    }
    buf[o++] = '"';
    for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
        if (o + 8 >= len) {
            memcpy(buf + o, "...", 3);
            o += 3;
            break;
        }
        if (*p == '"' || *p == '\\') {
            buf[o++] = '\\';
            buf[o++] = (char)*p;
        } else if (*p < 0x20 || *p == 0x7f) {
            o += (size_t)snprintf(buf + o, len - o, "\\x%02x", *p);
        } else {
            buf[o++] = (char)*p;
        }
    }
    buf[o++] = '"';
    buf[o] = '\0';
    return buf;
}

void cfg_fmt_duration(int64_t ms, char *buf, size_t len)
{
    if (ms != 0 && ms % CFG_MS_D == 0)
        snprintf(buf, len, "%lldd", (long long)(ms / CFG_MS_D));
    else if (ms != 0 && ms % CFG_MS_H == 0)
        snprintf(buf, len, "%lldh", (long long)(ms / CFG_MS_H));
    else if (ms != 0 && ms % CFG_MS_M == 0)
        snprintf(buf, len, "%lldm", (long long)(ms / CFG_MS_M));
    else if (ms % CFG_MS_S == 0)
        snprintf(buf, len, "%llds", (long long)(ms / CFG_MS_S));
    else
        snprintf(buf, len, "%lldms", (long long)ms);
}

void cfg_fmt_size(uint64_t v, char *buf, size_t len)
{
    if (v != 0 && v % (1024ULL * 1024 * 1024) == 0)
        snprintf(buf, len, "%lluG", (unsigned long long)(v >> 30));
    else if (v != 0 && v % (1024ULL * 1024) == 0)
        snprintf(buf, len, "%lluM", (unsigned long long)(v >> 20));
    else if (v != 0 && v % 1024ULL == 0)
        snprintf(buf, len, "%lluk", (unsigned long long)(v >> 10));
    else
        snprintf(buf, len, "%llu", (unsigned long long)v);
}

bool cfg_name_ok(const char *v)
{
    size_t n = strlen(v);

    if (n == 0 || n > 128)
        return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)v[i] <= 0x20 || (unsigned char)v[i] >= 0x7f)
            return false;
    return true;
}

/* host:port, [v6]:port; port 1..65535. */
bool cfg_listen_ok(const char *v)
{
    const char *colon, *host_end;
    int64_t port;

    if (v[0] == '[') {
        const char *close = strchr(v, ']');
        if (!close || close == v + 1 || close[1] != ':')
            return false;
        for (const char *c = v + 1; c < close; c++)
            if (!isxdigit((unsigned char)*c) && *c != ':' && *c != '.')
                return false;
        colon = close + 1;
        host_end = close;
    } else {
        colon = strrchr(v, ':');
        if (!colon || colon == v)
            return false;
        for (const char *c = v; c < colon; c++)
            if (!cfg_host_char_ok((unsigned char)*c))
                return false;
        host_end = colon;
    }
    (void)host_end;
    if (!isdigit((unsigned char)colon[1]))
        return false;
    return cfg_parse_int(colon + 1, 1, 65535, &port) == 0;
}
