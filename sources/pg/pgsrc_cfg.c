/*
 * pgsrc_cfg.c — what only the PostgreSQL source understands of an outbox's
 * settings (registered with config/ as the "postgres" backend, source.c): the
 * conninfo must be one libpq can parse, and the peer its log lines name.
 *
 * The peer is host:port/database through PQconninfoParse, with libpq's
 * environment defaults (PGHOST, PGPORT) and built-in ones (the Unix socket
 * directory, 5432); nothing secret (no user, no password). The database is
 * always the configured one (the relay refuses any other). Also the libpq
 * connection keywords every connection of the source uses.
 */
#include "sources/pg/pgsrc_int.h"

#include <inttypes.h>

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

/* ------------------------------------------------------------ connection */

void pgsrc_conn_params(const cfg_outbox *ob, const char **keys, const char **vals,
                       char tmo[24])
{
    size_t i = 0;
    int64_t s = (ob->connect_timeout_ms + 999) / 1000;
    if (s < 2)
        s = 2;  /* libpq's minimum */
    snprintf(tmo, 24, "%" PRId64, s);
    /* Keywords before "dbname" are defaults the conninfo may override; those
     * after it are ours (last one wins with expand_dbname). */
    keys[i] = "application_name"; vals[i++] = PGSRC_APP_NAME;
    keys[i] = "connect_timeout";  vals[i++] = tmo;
    keys[i] = "keepalives";       vals[i++] = "1";
    keys[i] = "keepalives_idle";  vals[i++] = "30";
    keys[i] = "keepalives_interval"; vals[i++] = "10";
    keys[i] = "keepalives_count"; vals[i++] = "3";
    keys[i] = "dbname";           vals[i++] = ob->conninfo ? ob->conninfo : "";
    if (ob->password && ob->password[0]) {
        keys[i] = "password";     vals[i++] = ob->password;
    }
    keys[i] = "client_encoding";  vals[i++] = "UTF8";
    keys[i] = NULL;               vals[i] = NULL;
}

void pgsrc_oneline(const char *msg, char *out, size_t outlen)
{
    size_t j = 0;
    int space = 0;
    if (!outlen)
        return;
    if (!msg)
        msg = "";
    for (const char *p = msg; *p && j + 1 < outlen; p++) {
        char c = *p;
        if (c == '\n' || c == '\r' || c == '\t') {
            space = 1;
            continue;
        }
        if (space && j > 0 && j + 2 < outlen) {
            out[j++] = ' ';
        }
        space = 0;
        out[j++] = c;
    }
    while (j > 0 && (out[j - 1] == ' '))
        j--;
    out[j] = '\0';
}
