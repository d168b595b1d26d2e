/*
 * pgsql.c — liboutbox's PostgreSQL INSERT and the $n → ? conversion for ODBC
 * (see outbox_pgsql.h).
 */
#include <stdlib.h>
#include <string.h>

#include "outbox_pgsql.h"

static const char *const pg_columns =
    "(message_id, exchange, routing_key, partition_key, message_type, content_type, "
    "correlation_id, headers, payload, available_at)";

char *outbox_pg_insert_sql(const char *pg_table, size_t rows)
{
    outbox_util_buf b = { 0 };
    outbox_util_buf_printf(&b, "INSERT INTO %s %s VALUES ", pg_table, pg_columns);
    for (size_t r = 0; r < rows; r++) {
        size_t k = r * OUTBOX_PG_INSERT_COLS;
        outbox_util_buf_printf(&b,
            "%s($%zu::uuid, $%zu::text, $%zu::text, $%zu::text, $%zu::text, $%zu::text, "
            "$%zu::text, $%zu::jsonb, $%zu::bytea, now() + ($%zu::bigint * interval "
            "'1 millisecond'))",
            r ? ", " : "", k + 1, k + 2, k + 3, k + 4, k + 5, k + 6, k + 7, k + 8, k + 9,
            k + 10);
    }
    outbox_util_buf_puts(&b, " ON CONFLICT DO NOTHING"); /* no target: INSERT privilege suffices */
    if (b.failed) {
        outbox_util_buf_free(&b);
        return NULL;
    }
    return b.p; /* caller frees */
}

char *outbox_sql_qmarks(const char *sql, int *order, size_t max, size_t *n_order)
{
    size_t len = strlen(sql), k = 0;
    char *out = malloc(len + 1), *o = out;
    char quote = 0;
    if (!out)
        return NULL;
    for (const char *p = sql; *p; ) {
        if (quote) {                  /* inside '...' or "...": doubled quotes stay inside */
            if (*p == quote)
                quote = 0;
            *o++ = *p++;
            continue;
        }
        if (*p == '\'' || *p == '"') {
            quote = *p;
            *o++ = *p++;
            continue;
        }
        if (*p == '$' && p[1] >= '1' && p[1] <= '9') {
            int num = 0;
            p++;
            while (*p >= '0' && *p <= '9' && num < 100000)
                num = num * 10 + (*p++ - '0');
            if (k == max) {
                free(out);
                return NULL;
            }
            order[k++] = num;
            *o++ = '?';
            continue;
        }
        *o++ = *p++;
    }
    *o = '\0';
    *n_order = k;
    return out; /* caller frees */
}
