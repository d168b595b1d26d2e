/*
 * dead_line.c — the line format of `dead list`, which every source prints
 * (relay/source.h, source_ops.dead_list).
 */
#include "relay/source.h"

void source_dead_line(FILE *out, const char *const *field, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (i)
            fputc('\t', out);
        for (const char *s = field[i] ? field[i] : ""; *s; s++) {
            switch (*s) {
            case '\t': fputs("\\t", out); break;
            case '\n': fputs("\\n", out); break;
            case '\r': fputs("\\r", out); break;
            case '\\': fputs("\\\\", out); break;
            default:   fputc(*s, out); break;
            }
        }
    }
    fputc('\n', out);
}
