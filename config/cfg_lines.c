/*
 * cfg_lines.c — the file's lines read once more, as iniparser reads them, for what
 * iniparser would merge, cut or drop without a word (cfg_scan_lines below lists each
 * case). cfg_load runs it before it trusts the dictionary.
 */
#include "config/cfg.h"
#include "config/cfg_loader.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Names already seen (lower-cased, as iniparser stores them) and the line of each. */
typedef struct seen_list {
    char **name;
    int *line;
    size_t n, cap;
} seen_list;

/* Returns the line where name was first seen, or 0 after recording it (-1: out of memory). */
static int seen_add(seen_list *l, const char *name, int lineno)
{
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->name[i], name) == 0)
            return l->line[i];
    if (l->n == l->cap) {
        size_t ncap = l->cap ? l->cap * 2 : 16;
        char **nn = realloc(l->name, ncap * sizeof *nn);
        int *nl;

        if (!nn)
            return -1;
        l->name = nn;
        if (!(nl = realloc(l->line, ncap * sizeof *nl)))
            return -1;
        l->line = nl;
        l->cap = ncap;
    }
    if (!(l->name[l->n] = strdup(name)))
        return -1;
    l->line[l->n++] = lineno;
    return 0;
}

static void seen_clear(seen_list *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->name[i]);
    l->n = 0;
}

static void seen_free(seen_list *l)
{
    seen_clear(l);
    free(l->name);
    free(l->line);
    l->name = NULL;
    l->line = NULL;
    l->cap = 0;
}

static bool ini_space(int c)
{
    return isspace((unsigned char)c) != 0;
}

/* Copies [p, p+n) trimmed and lower-cased (as iniparser does with section and key names). */
static void ini_name(const char *p, size_t n, char *out, size_t outlen)
{
    size_t o = 0;

    while (n > 0 && ini_space(p[0])) {
        p++;
        n--;
    }
    while (n > 0 && ini_space(p[n - 1]))
        n--;
    for (size_t i = 0; i < n && o + 1 < outlen; i++)
        out[o++] = (char)tolower((unsigned char)p[i]);
    out[o] = '\0';
}

/* Reads the file line by line, as iniparser does, and reports what iniparser would
 * take differently from how it reads (values are never echoed: they may be secrets):
 *   - a section given twice ([Outbox.A] and [outbox.a] included): iniparser merges them;
 *   - a key given twice in one section: the last one silently wins;
 *   - an empty section name "[]": iniparser files the following keys under the
 *     previous section (or under a mangled name);
 *   - text after the ']' of a section header: dropped;
 *   - a line ending in '\': iniparser joins the next line onto it, so a comment
 *     ending in '\' swallows the key below it;
 *   - a quoted value without its closing quote, or with text after it: cut;
 *   - an unquoted ';' or '#' with no whitespace before it: iniparser ends the value
 *     there (ODBC strings: Driver={...};Server=db).
 * Returns the number of problems found; 0 means the dictionary says what the file says. */
int cfg_scan_lines(cfg_loader *L)
{
    char section[1100] = "", *line = NULL;
    size_t cap = 0;
    int lineno = 0, before = L->nerr;
    bool continued = false;
    seen_list secs = { 0 }, keys = { 0 };
    FILE *f = fopen(L->file, "r");

    if (!f) {
        cfg_lerr(L, NULL, NULL, "cannot open: %s", strerror(errno));
        return 1;
    }
    while (getline(&line, &cap, f) > 0) {
        char *p = line, *eq, *v, *cut, key[1100];
        size_t n = strlen(line);
        bool was_continued = continued;
        int first;

        lineno++;
        while (n > 0 && ini_space(line[n - 1]))
            line[--n] = '\0';
        continued = n > 0 && line[n - 1] == '\\';
        if (was_continued)
            continue; /* already reported with the line that ended in '\' */
        if (continued) {
            cfg_lerr_line(L, lineno,
                          "line ends with '\\', expected one line per entry (iniparser would join "
                          "line %d onto this one; line continuation is not supported)",
                          lineno + 1);
            continue;
        }
        while (ini_space(*p))
            p++;
        n = strlen(p);
        if (*p == ';' || *p == '#' || *p == '\0')
            continue;
        if (p[0] == '[' && p[n - 1] == ']') { /* iniparser's test for a section header */
            char *close = strchr(p, ']');
            const char *after = close + 1;

            ini_name(p + 1, (size_t)(close - p - 1), section, sizeof section);
            seen_clear(&keys);
            while (ini_space(*after))
                after++;
            if (*after) {
                cfg_lerr_line(
                    L, lineno,
                    "[%s]: expected nothing after the ']' of a section header, got more text "
                    "(iniparser would ignore it)",
                    section);
                continue;
            }
            if (!section[0]) {
                cfg_lerr_line(
                    L, lineno,
                    "empty section name [], expected [relay], [sink.NAME] or [outbox.NAME]");
                continue;
            }
            if ((first = seen_add(&secs, section, lineno)) < 0)
                goto oom;
            if (first > 0)
                cfg_lerr_line(L, lineno, "section [%s] given twice (first at line %d)", section,
                              first);
            continue;
        }
        if (!(eq = strchr(p, '=')))
            continue; /* iniparser refuses it: not reached */
        ini_name(p, (size_t)(eq - p), key, sizeof key);
        if (!key[0])
            continue; /* likewise */
        if ((first = seen_add(&keys, key, lineno)) < 0)
            goto oom;
        if (first > 0) {
            cfg_lerr_line(L, lineno, "[%s] %s given twice (first at line %d)", section, key, first);
            continue;
        }
        v = eq + 1;
        while (ini_space(*v))
            v++;
        if (*v == '"' || *v == '\'') {
            char *close = strchr(v + 1, *v);
            const char *after;

            if (!close) {
                cfg_lerr_line(
                    L, lineno,
                    "[%s] %s: expected a closing %c at the end of the quoted value, got none",
                    section, key, *v);
                continue;
            }
            /* like after an unquoted value, a comment needs whitespace before it */
            after = close + 1;
            while (ini_space(*after))
                after++;
            if (*after && (after == close + 1 || (*after != ';' && *after != '#')))
                cfg_lerr_line(
                    L, lineno,
                    "[%s] %s: expected only whitespace and a ; comment after the closing %c "
                    "of the value, got more text (iniparser would cut the value at the quote)",
                    section, key, *v);
            continue;
        }
        cut = v + strcspn(v, ";#");
        if (*cut && cut > v && !ini_space(cut[-1])) {
            cfg_lerr_line(
                L, lineno,
                "[%s] %s: expected the value in quotes because it contains '%c' (an unquoted "
                "';' or '#' starts a comment and would cut the value), got an unquoted value",
                section, key, *cut);
        }
    }
    if (ferror(f))
        cfg_lerr(L, NULL, NULL, "cannot read: %s", strerror(errno));
    free(line);
    fclose(f);
    seen_free(&secs);
    seen_free(&keys);
    return L->nerr - before;

oom:
    cfg_lerr(L, NULL, NULL, "out of memory");
    free(line);
    fclose(f);
    seen_free(&secs);
    seen_free(&keys);
    return L->nerr - before;
}
