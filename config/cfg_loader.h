/*
 * cfg_loader.h — what config/'s files share while one file loads; not for use outside
 * config/ (cfg.h is the configuration's interface).
 *
 * cfg.c drives the load and writes the error lines; cfg_value.c parses and writes back
 * values; cfg_secret.c expands ${NAME} and reads secret files; cfg_lines.c checks the
 * file's lines against what iniparser makes of them.
 */
#ifndef CFG_LOADER_H
#define CFG_LOADER_H

#include "config/cfg.h"

#include <iniparser.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One load: the file, its dictionary (iniparser's "section:key" → raw value), the
   caller's error lines and how many problems were found. */
typedef struct cfg_loader {
    const char *file;
    dictionary *d;
    cfg_errors *errs;
    int nerr;
} cfg_loader;

/* ---- error lines (cfg.c) ---- */
/* One line: "FILE: [SECTION] KEY: message" (key NULL: "FILE: [SECTION]: message";
   section NULL: "FILE: message"). Counts a problem. */
void cfg_lerr(cfg_loader *L, const char *sec, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* One line: "FILE:LINE: message" (the message names section and key itself). */
void cfg_lerr_line(cfg_loader *L, int lineno, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- values (cfg_value.c) ---- */
/* A duration in its largest whole unit ("7d", "5m", "250ms"), for an error line. */
void cfg_fmt_duration(int64_t ms, char *buf, size_t len);
/* A size in its largest whole unit ("64M", "1024"), for an error line. */
void cfg_fmt_size(uint64_t v, char *buf, size_t len);
/* A relay name: 1..128 printable characters without spaces. */
bool cfg_name_ok(const char *v);
/* host:port or [v6]:port, with a port 1..65535. */
bool cfg_listen_ok(const char *v);

/* ---- secrets (cfg_secret.c) ---- */
/* raw with ${NAME} replaced by the environment variable and $$ by $: a malloc'd string
   the caller owns (free it with cfg_free_secret), or NULL after reporting the problem. */
OUTBOX_MUST_CHECK char *cfg_expand_env(cfg_loader *L, const char *sec, const char *key,
                                       const char *raw);
/* The contents of the file at path, one line without its trailing newline: a malloc'd
   string the caller owns (cfg_free_secret), or NULL after reporting (the path only,
   never the contents). */
OUTBOX_MUST_CHECK char *cfg_read_secret_file(cfg_loader *L, const char *sec, const char *key,
                                             const char *path);

/* ---- the file's lines (cfg_lines.c) ---- */
/* Reports what iniparser would take differently from how the file reads; returns the
   number of problems found (0: the dictionary says what the file says). */
int cfg_scan_lines(cfg_loader *L);

#endif
