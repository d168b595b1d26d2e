/*
 * pgsrc_cfg.c — what only the PostgreSQL source understands of an outbox's
 * settings (registered with config/ as the "postgres" backend, source.c): the
 * conninfo must be one libpq can parse, and the peer its log lines name.
 *
 * The peer is host:port/database through PQconninfoParse, with libpq's
 * environment defaults (PGHOST, PGPORT) and built-in ones (the Unix socket
 * directory, 5432); nothing secret (no user, no password). The database is
 * always the configured one (the relay refuses any other).
 */
#include "sources/pg/pgsrc_int.h"

#include <stdlib.h>
#include <string.h>

#define PEER_PG_SOCKET_DIR "/var/run/postgresql"   /* Debian's libpq default */

static const char *nz(const char *s)
{
    return s != NULL && *s != '\0' ? s : NULL;
}

void pgsrc_peer(const char *conninfo, const char *db, char *buf, size_t len)
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

void pgsrc_finish_cfg(cfg_outbox *o, cfg_report *r)
{
    char *perr = NULL;
    PQconninfoOption *opts;

    if (o->conninfo == NULL)
        return;   /* already reported */
    opts = PQconninfoParse(o->conninfo, &perr);
    if (opts == NULL)   /* libpq's message may quote the string: never echo it */
        cfg_report_error(r, "conninfo", "expected a libpq conninfo (key=value ... or "
                         "postgresql:// URI), got <secret> (libpq cannot parse it)");
    PQconninfoFree(opts);
    PQfreemem(perr);
}
