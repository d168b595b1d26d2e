/*
 * cfg_secret.c — the values that may carry secrets: ${NAME} expanded from the
 * environment in any value, and the contents of a *_file key's file. Each reports a
 * problem through the loader naming the variable or the path, never what it holds.
 */
#include "config/cfg.h"
#include "config/cfg_loader.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SECRET_FILE_MAX 65536

/* ------------------------------------------------------------------ */
/* ${ENV} expansion                                                    */
/* ------------------------------------------------------------------ */

/* Returns a malloc'd copy of raw with ${NAME} replaced by the environment
 * variable and $$ by $, or NULL after reporting the problem. */
char *cfg_expand_env(cfg_loader *L, const char *sec, const char *key, const char *raw)
{
    size_t cap = strlen(raw) + 1, o = 0;
    char *out = malloc(cap);
    const char *p = raw;

    if (!out) {
        cfg_lerr(L, sec, key, "out of memory");
        return NULL;
    }
    while (*p) {
        const char *add = p;
        size_t addlen = 1;
        char name[256];

        if (*p == '$') {
            if (p[1] == '$') {
                addlen = 1;
                p += 2;
            } else if (p[1] == '{') {
                const char *close = strchr(p + 2, '}');
                size_t nlen;

                if (!close) {
                    cfg_lerr(L, sec, key,
                             "expected ${NAME} with a closing }, got an unterminated ${");
                    goto fail;
                }
                nlen = (size_t)(close - (p + 2));
                if (nlen == 0 || nlen >= sizeof name ||
                    !(isalpha((unsigned char)p[2]) || p[2] == '_')) {
                    cfg_lerr(
                        L, sec, key,
                        "expected ${NAME} with NAME matching [A-Za-z_][A-Za-z0-9_]*, got a bad variable name");
                    goto fail;
                }
                for (size_t i = 0; i < nlen; i++) {
                    if (!isalnum((unsigned char)p[2 + i]) && p[2 + i] != '_') {
                        cfg_lerr(
                            L, sec, key,
                            "expected ${NAME} with NAME matching [A-Za-z_][A-Za-z0-9_]*, got a bad variable name");
                        goto fail;
                    }
                }
                memcpy(name, p + 2, nlen);
                name[nlen] = '\0';
                add = getenv(name);
                if (!add) {
                    cfg_lerr(
                        L, sec, key,
                        "expected environment variable %s to be set (from ${%s}), got it unset",
                        name, name);
                    goto fail;
                }
                addlen = strlen(add);
                p = close + 1;
            } else {
                cfg_lerr(
                    L, sec, key,
                    "expected ${NAME} or $$ after '$', got a lone '$' (write $$ for a literal $)");
                goto fail;
            }
        } else {
            p++;
        }
        if (o + addlen + 1 > cap) {
            size_t ncap = (o + addlen + 1) * 2;
            char *n = realloc(out, ncap);
            if (!n) {
                cfg_lerr(L, sec, key, "out of memory");
                goto fail;
            }
            out = n;
            cap = ncap;
        }
        memcpy(out + o, add, addlen);
        o += addlen;
    }
    out[o] = '\0';
    return out;

fail:
    free(out);
    return NULL;
}

/* ------------------------------------------------------------------ */
/* secret files                                                        */
/* ------------------------------------------------------------------ */

/* Reads a secret file; trims one trailing newline (\n or \r\n).
 * Returns a malloc'd string, or NULL after reporting (path only, never content). */
char *cfg_read_secret_file(cfg_loader *L, const char *sec, const char *key, const char *path)
{
    char qb[300], *buf = NULL;
    size_t len = 0;
    int fd = -1;
    struct stat st;

    fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        cfg_lerr(L, sec, key, "expected a readable file, got %s (%s)",
                 cfg_quote(path, qb, sizeof qb), strerror(errno));
        goto fail;
    }
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        cfg_lerr(L, sec, key, "expected a readable regular file, got %s (not a regular file)",
                 cfg_quote(path, qb, sizeof qb));
        goto fail;
    }
    if (!(buf = malloc(SECRET_FILE_MAX + 1))) {
        cfg_lerr(L, sec, key, "out of memory");
        goto fail;
    }
    for (;;) {
        ssize_t r = read(fd, buf + len, SECRET_FILE_MAX + 1 - len);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            cfg_lerr(L, sec, key, "expected a readable file, got %s (%s)",
                     cfg_quote(path, qb, sizeof qb), strerror(errno));
            goto fail;
        }
        if (r == 0)
            break;
        len += (size_t)r;
        if (len > SECRET_FILE_MAX) {
            cfg_lerr(L, sec, key, "expected a file of at most %d bytes, got %s (too large)",
                     SECRET_FILE_MAX, cfg_quote(path, qb, sizeof qb));
            goto fail;
        }
    }
    close(fd);
    fd = -1;
    if (len > 0 && buf[len - 1] == '\n') {
        len--;
        if (len > 0 && buf[len - 1] == '\r')
            len--;
    }
    buf[len] = '\0';
    if (memchr(buf, '\0', len) || memchr(buf, '\n', len)) {
        cfg_lerr(
            L, sec, key,
            "expected a file holding one line of text, got %s (contains NUL bytes or several lines)",
            cfg_quote(path, qb, sizeof qb));
        goto fail;
    }
    return buf;

fail:
    if (fd >= 0)
        close(fd);
    if (buf) {
        explicit_bzero(buf, SECRET_FILE_MAX + 1);
        free(buf);
    }
    return NULL;
}
