/*
 * pgsrc_hosts.c — a conninfo naming several hosts: where the next connect starts.
 *
 * A conninfo may name several hosts (host=a,b port=5432,5433, or a URI's a:5432,b:5433)
 * for libpq to try in turn, e.g. with target_session_attrs=read-write after a failover.
 * libpq moves on by itself from a host that refuses or does not qualify, but it bounds
 * each host by connect_timeout only in its blocking connect: an asynchronous connect
 * like the relay's stays on a host that accepts the TCP connection and never answers (a
 * frozen machine, a partition) until the relay's own deadline, and the next attempt would
 * start with that host again, never reaching the others. So when a connect times out, the
 * next one starts with the host after the silent one: its lists are passed rotated,
 * overriding the conninfo's (keywords after "dbname" win).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <libpq-fe.h>
#include "sources/pg/pgsrc_int.h"

/* Items of a comma-separated libpq list (NULL or "": 0). */
static int list_len(const char *v)
{
    int n = 1;
    if (v == NULL || *v == '\0')
        return 0;
    for (; *v; v++)
        n += *v == ',';
    return n;
}

/* Item i of the list v, into out ("" when absent). */
static void list_item(const char *v, int i, char *out, size_t outlen)
{
    out[0] = '\0';
    for (int k = 0; v != NULL && k < i; k++) {
        v = strchr(v, ',');
        if (v != NULL)
            v++;
    }
    if (v != NULL)
        snprintf(out, outlen, "%.*s", (int)strcspn(v, ","), v);
}

/* The list v of n > first items, starting at item first (malloc'ed; NULL: no memory). */
static char *list_rotated(const char *v, int first)
{
    const char *p = v;
    size_t len = strlen(v), tail;
    char *out = malloc(len + 2);
    if (out == NULL)
        return NULL;
    for (int k = 0; k < first; k++)
        p = strchr(p, ',') + 1;
    tail = strlen(p);
    memcpy(out, p, tail);
    if (p != v) {
        out[tail] = ',';
        memcpy(out + tail + 1, v, (size_t)(p - v) - 1);
        out[len] = '\0';
    } else {
        out[tail] = '\0';
    }
    return out;
}

/* The conninfo's host, hostaddr and port lists, and how many hosts they name. */
typedef struct {
    PQconninfoOption *opts;
    const char *host, *hostaddr, *port;
    int n;
} host_list;

static void hosts_parse(const char *conninfo, host_list *h)
{
    memset(h, 0, sizeof *h);
    h->opts = PQconninfoParse(conninfo, NULL);
    for (PQconninfoOption *o = h->opts; o != NULL && o->keyword != NULL; o++) {
        if (strcmp(o->keyword, "host") == 0)
            h->host = o->val;
        else if (strcmp(o->keyword, "hostaddr") == 0)
            h->hostaddr = o->val;
        else if (strcmp(o->keyword, "port") == 0)
            h->port = o->val;
    }
    h->n = list_len(h->host) > 0 ? list_len(h->host) : list_len(h->hostaddr);
}

/* Which of the hosts (0..n-1) the connection is trying now (PQhost gives the host, or
   the hostaddr when no host is named; PQport the port): -1 when none matches. */
static int hosts_index(const host_list *h, const PGconn *c)
{
    const char *name = PQhost(c), *port = PQport(c);
    char item[256], pitem[64];
    int n_ports = list_len(h->port);
    for (int i = 0; name != NULL && i < h->n; i++) {
        list_item(h->host, i, item, sizeof item);
        if (item[0] == '\0')
            list_item(h->hostaddr, i, item, sizeof item);
        list_item(h->port, n_ports == h->n ? i : 0, pitem, sizeof pitem);
        if (strcmp(item, name) == 0 &&
            (pitem[0] == '\0' || (port != NULL && strcmp(pitem, port) == 0)))
            return i;
    }
    return -1;
}

int pgsrc_hosts_rotate(const char *conninfo, int first, const char **keys, const char **vals,
                       char *rot[PGSRC_HOST_PARAMS])
{
    static const char *const kw[PGSRC_HOST_PARAMS] = { "host", "hostaddr", "port" };
    host_list h;
    size_t i = 0;
    int rc;
    hosts_parse(conninfo, &h);
    rc = h.n;
    if (h.n < 2 || first % h.n == 0) {
        PQconninfoFree(h.opts);
        return rc;
    }
    const char *lists[PGSRC_HOST_PARAMS] = { h.host, h.hostaddr, h.port };
    while (keys[i] != NULL)
        i++;
    for (int j = 0; j < PGSRC_HOST_PARAMS; j++) {
        if (list_len(lists[j]) != h.n)
            continue; /* absent, or one port for every host */
        rot[j] = list_rotated(lists[j], first % h.n);
        if (rot[j] == NULL) {
            rc = -1;
            break;
        }
        keys[i] = kw[j];
        vals[i++] = rot[j];
    }
    keys[i] = NULL;
    vals[i] = NULL;
    PQconninfoFree(h.opts);
    return rc;
}

int pgsrc_hosts_after_silent(const char *conninfo, const PGconn *c, int first, char *at,
                             size_t atlen)
{
    host_list h;
    at[0] = '\0';
    hosts_parse(conninfo, &h);
    if (h.n >= 2 && c != NULL) {
        int k = hosts_index(&h, c);
        const char *name = PQhost(c), *port = PQport(c);
        /* not found (cannot happen with libpq's own lists): one host on, at least */
        first = ((k >= 0 ? k : first) + 1) % h.n;
        snprintf(at, atlen, " at %s:%s; the next attempt starts with the host after it",
                 name ? name : "?", port && port[0] ? port : "default port");
    }
    PQconninfoFree(h.opts);
    return first;
}
