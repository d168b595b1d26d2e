/*
 * odbcsrc_cfg.c — what only the ODBC source understands of an outbox's settings
 * (registered with config/ as the "sqlserver" and "odbc" backends, source.c):
 * ODBC connection string attributes, the password_file rule, and the peer its
 * log lines name: Server / Servername / Host / Address and Port of the string
 * ("Server=tcp:db,1433"), or its DSN. Nothing secret is ever copied out.
 */
#include "sources/odbc/odbcsrc_int.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

/* The value of attribute key in an ODBC connection string, copied into out
 * ({braced} values unbraced); false when absent. */
static bool odbc_attr(const char *cs, const char *key, char *out, size_t outlen)
{
    size_t      kl = strlen(key);
    const char *p = cs;

    while (*p != '\0') {
        const char *v = NULL;

        while (*p == ' ' || *p == ';')
            p++;
        if (strncasecmp(p, key, kl) == 0) {
            const char *e = p + kl;

            while (*e == ' ')
                e++;
            if (*e == '=')
                v = e + 1;
        }
        while (*p != '\0' && *p != ';') {
            if (*p == '{') {
                p++;
                while (*p != '\0' && !(*p == '}' && p[1] != '}'))
                    p += (*p == '}' ? 2 : 1);
                if (*p != '\0')
                    p++;
            } else {
                p++;
            }
        }
        if (v != NULL) {
            size_t n;

            while (*v == ' ')
                v++;
            if (*v == '{') {
                v++;
                n = (size_t)(p - v);
                if (n > 0 && v[n - 1] == '}')
                    n--;
            } else {
                n = (size_t)(p - v);
                while (n > 0 && v[n - 1] == ' ')
                    n--;
            }
            if (n >= outlen)
                n = outlen - 1;
            memcpy(out, v, n);
            out[n] = '\0';
            return true;
        }
    }
    return false;
}

void odbcsrc_peer(const char *cs, const char *db, char *buf, size_t len)
{
    static const char *const hostkeys[] = { "Server", "Servername", "Host", "Address", "Addr" };
    char host[256] = "", port[32] = "";
    bool found = false;

    for (size_t i = 0; i < sizeof hostkeys / sizeof hostkeys[0] && !found; i++)
        found = odbc_attr(cs, hostkeys[i], host, sizeof host) && host[0] != '\0';
    if (!found) {
        if (odbc_attr(cs, "DSN", host, sizeof host) && host[0] != '\0')
            snprintf(buf, len, "DSN %s/%s", host, db);
        else
            snprintf(buf, len, "?/%s", db);
        return;
    }
    /* SQL Server: [tcp:]host[\instance][,port] */
    if (strncasecmp(host, "tcp:", 4) == 0)
        memmove(host, host + 4, strlen(host + 4) + 1);
    char *comma = strchr(host, ',');
    if (comma != NULL) {
        snprintf(port, sizeof port, "%s", comma + 1);
        *comma = '\0';
    } else {
        (void)odbc_attr(cs, "Port", port, sizeof port);
    }
    if (port[0] != '\0')
        snprintf(buf, len, "%s:%s/%s", host, port, db);
    else
        snprintf(buf, len, "%s/%s", host, db);
}

void odbcsrc_finish_cfg(cfg_outbox *o, cfg_report *r)
{
    char v[2];   /* only whether PWD= is there */

    /* ODBC keeps the first PWD=: a password_file appended after one would be ignored */
    if (o->conninfo && o->password && odbc_attr(o->conninfo, "PWD", v, sizeof v))
        cfg_report_error(r, "password_file",
                         "expected either password_file or PWD= in conninfo, not both");
    /* SQL Server escalates a statement's row locks to a table lock at 5,000 locks on
       one table, which READPAST does not skip: a claim or retention batch that large
       would stop every producer on the outbox */
    if (o->source && strcmp(o->source->name, "sqlserver") == 0) {
        if (o->batch_size > SQL_TSQL_MAX_ROWS)
            cfg_report_error(r, "batch_size", "expected at most %d for source = sqlserver "
                             "(a claim of more rows could escalate to a table lock and block "
                             "every producer), got %d", SQL_TSQL_MAX_ROWS, o->batch_size);
        if (o->cleanup_batch > SQL_TSQL_MAX_ROWS)
            cfg_report_error(r, "cleanup_batch", "expected at most %d for source = sqlserver "
                             "(a retention batch of more rows could escalate to a table lock "
                             "and block every producer), got %d", SQL_TSQL_MAX_ROWS,
                             o->cleanup_batch);
    }
}
