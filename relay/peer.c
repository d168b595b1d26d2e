/*
 * peer.c — host:port/database of an outbox's database, for log lines (peer.h).
 *
 * PostgreSQL: the conninfo (key=value or URI) through PQconninfoParse, with
 * libpq's environment defaults (PGHOST, PGPORT) and built-in ones (the Unix
 * socket directory, 5432). ODBC: the Server / Servername / Host / Address and
 * Port attributes of the connection string ("Server=tcp:db,1433"), or its DSN.
 * The database is always the configured one (the relay refuses any other).
 */
#include "relay/peer.h"

#include <libpq-fe.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define PEER_PG_SOCKET_DIR "/var/run/postgresql"   /* Debian's libpq default */

static const char *nz(const char *s)
{
    return s != NULL && *s != '\0' ? s : NULL;
}

static void pg_peer(const char *conninfo, const char *db, char *buf, size_t len)
{
    PQconninfoOption *opts = PQconninfoParse(conninfo, NULL);   /* NULL: no error text */
    const char       *host = NULL, *hostaddr = NULL, *port = NULL;

    if (opts != NULL) {
        for (PQconninfoOption *o = opts; o->keyword != NULL; o++) {
            if (strcmp(o->keyword, "host") == 0)
                host = nz(o->val);
            else if (strcmp(o->keyword, "hostaddr") == 0)
                hostaddr = nz(o->val);
            else if (strcmp(o->keyword, "port") == 0)
                port = nz(o->val);
        }
    }
    if (host == NULL)
        host = hostaddr;
    if (host == NULL)
        host = nz(getenv("PGHOST"));
    if (port == NULL)
        port = nz(getenv("PGPORT"));
    snprintf(buf, len, "%s:%s/%s", host ? host : PEER_PG_SOCKET_DIR, port ? port : "5432", db);
    PQconninfoFree(opts);
}

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

static void odbc_peer(const char *cs, const char *db, char *buf, size_t len)
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

void peer_of_outbox(const cfg_outbox *ob, char *buf, size_t len)
{
    const char *db = ob->database ? ob->database : "?";

    if (len == 0)
        return;
    if (ob->conninfo == NULL)
        snprintf(buf, len, "?/%s", db);
    else if (ob->source == CFG_SOURCE_POSTGRES)
        pg_peer(ob->conninfo, db, buf, len);
    else
        odbc_peer(ob->conninfo, db, buf, len);
}
