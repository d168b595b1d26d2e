/*
 * pgsrc_admin.c — the PostgreSQL source, admin side (check, init, stats,
 * dead list/retry/purge). Synchronous for the caller, but every wait is a
 * poll() bounded by the outbox's connect/query timeouts, so a silent network
 * cannot hang a command. Each call opens and closes its own connection.
 * Errors are one line without the outbox name (the caller prefixes
 * "[outbox.NAME]"); several problems are joined with "; ".
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <libpq-fe.h>
#include "lib/outbox_schema.h"
#include "sources/pg/pgsrc_int.h"

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void errf(const cfg_outbox *ob, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void errf(const cfg_outbox *ob, char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    size_t used;
    (void)ob;  /* the caller names the outbox section */
    if (!err || !errlen)
        return;
    used = strlen(err);
    if (used && used + 3 < errlen) {  /* several problems: one line, "; " between */
        memcpy(err + used, "; ", 3);
        used += 2;
    }
    if (used + 1 >= errlen)
        return;
    va_start(ap, fmt);
    vsnprintf(err + used, errlen - used, fmt, ap);
    va_end(ap);
}

static void quiet_notice(void *arg, const char *message)
{
    (void)arg;
    (void)message;
}

/* Waits until the socket is ready for events, or the deadline. 1 ready, 0 timeout, -1 error. */
static int wait_sock(PGconn *c, short events, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - now_ms();
        if (left <= 0)
            return 0;
        struct pollfd p = {.fd = PQsocket(c), .events = events, .revents = 0};
        if (p.fd < 0)
            return -1;
        int rc = poll(&p, 1, left > 1000000 ? 1000000 : (int)left);
        if (rc > 0)
            return 1;
        if (rc == 0)
            continue;
        if (errno != EINTR)
            return -1;
    }
}

static int64_t query_bound(const cfg_outbox *ob)
{
    int64_t q = ob->query_timeout_ms > 0 ? ob->query_timeout_ms : 30000;
    int64_t slack = ob->connect_timeout_ms > 1000 ? ob->connect_timeout_ms : 1000;
    return q + slack;
}

/* Runs one statement. Returns its result (COMMAND_OK or TUPLES_OK; caller
 * PQclears) or NULL with a message in msg. */
static PGresult *adm_exec_st(PGconn *c, const cfg_outbox *ob, const char *sql, int n,
                             const char *const *vals, char *msg, size_t msglen,
                             char sqlstate[6])
{
    PGresult *keep = NULL, *r;
    int64_t deadline = now_ms() + query_bound(ob);
    msg[0] = '\0';
    if (sqlstate)
        sqlstate[0] = '\0';
    if (!PQsendQueryParams(c, sql, n, NULL, vals, NULL, NULL, 0)) {
        pgsrc_oneline(PQerrorMessage(c), msg, msglen);
        return NULL;
    }
    for (;;) {
        int fl = PQflush(c);
        if (fl < 0)
            goto broken;
        while (fl == 0 && !PQisBusy(c)) {
            r = PQgetResult(c);
            if (!r)
                goto done;
            ExecStatusType st = PQresultStatus(r);
            bool bad = st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK;
            if (!keep || (bad && PQresultStatus(keep) != PGRES_FATAL_ERROR)) {
                PQclear(keep);
                keep = r;
            } else {
                PQclear(r);
            }
        }
        int w = wait_sock(c, fl ? POLLIN | POLLOUT : POLLIN, deadline);
        if (w == 0) {
            snprintf(msg, msglen, "no answer from the server within %" PRId64 " ms",
                     query_bound(ob));
            PQclear(keep);
            return NULL;  /* the caller closes the connection */
        }
        if (w < 0 || !PQconsumeInput(c))
            goto broken;
    }
done:
    if (!keep) {
        snprintf(msg, msglen, "no result");
        return NULL;
    }
    if (PQresultStatus(keep) != PGRES_COMMAND_OK && PQresultStatus(keep) != PGRES_TUPLES_OK) {
        const char *st = PQresultErrorField(keep, PG_DIAG_SQLSTATE);
        if (sqlstate && st)
            snprintf(sqlstate, 6, "%.5s", st);
        pgsrc_oneline(PQresultErrorMessage(keep), msg, msglen);
        PQclear(keep);
        return NULL;
    }
    return keep;
broken:
    pgsrc_oneline(PQerrorMessage(c), msg, msglen);
    if (!msg[0])
        snprintf(msg, msglen, "connection lost");
    PQclear(keep);
    return NULL;
}

static PGresult *adm_exec(PGconn *c, const cfg_outbox *ob, const char *sql, int n,
                          const char *const *vals, char *msg, size_t msglen)
{
    return adm_exec_st(c, ob, sql, n, vals, msg, msglen, NULL);
}

static int adm_cmd(PGconn *c, const cfg_outbox *ob, const char *sql, char *msg, size_t msglen)
{
    PGresult *r = adm_exec(c, ob, sql, 0, NULL, msg, msglen);
    if (!r)
        return -1;
    PQclear(r);
    return 0;
}

/* What adm_connect learnt about the path to the server. */
typedef struct adm_path {
    int  client_pid;   /* the backend pid the connection announced (BackendKeyData) */
    int  server_pid;   /* pg_backend_pid() of the server session that answered */
    bool pooled;       /* they differ: a pooler (PgBouncer, ...) speaks for the server */
} adm_path;

/* Starts a connect whose host lists begin at host `first` (a conninfo naming several
   hosts) and polls it until it is up, fails, or connect_timeout passes. NULL only when out
   of memory; *timed_out says the deadline passed, and at then names the host that kept it
   waiting (empty with a single host) while *next says where the next attempt starts;
   *n_hosts is how many hosts the conninfo names. */
static PGconn *adm_connect_from(const cfg_outbox *ob, int first, int64_t ct, int *n_hosts,
                                bool *timed_out, int *next, char *at, size_t atlen)
{
    const char *keys[PGSRC_MAX_PARAMS + PGSRC_HOST_PARAMS];
    const char *vals[PGSRC_MAX_PARAMS + PGSRC_HOST_PARAMS];
    char tmo[24], *rot[PGSRC_HOST_PARAMS] = {NULL, NULL, NULL};
    int64_t deadline = now_ms() + ct;
    PGconn *c = NULL;

    *timed_out = false;
    *next = first;
    at[0] = '\0';
    pgsrc_conn_params(ob, keys, vals, tmo);
    *n_hosts = pgsrc_hosts_rotate(ob->conninfo, first, keys, vals, rot);
    if (*n_hosts >= 0)
        c = PQconnectStartParams(keys, vals, 1);
    for (int j = 0; j < PGSRC_HOST_PARAMS; j++)
        free(rot[j]);
    if (!c)
        return NULL;
    PQsetNoticeProcessor(c, quiet_notice, NULL);
    PostgresPollingStatusType st = PGRES_POLLING_WRITING;
    while (PQstatus(c) != CONNECTION_BAD && st != PGRES_POLLING_OK && st != PGRES_POLLING_FAILED) {
        int w = wait_sock(c, st == PGRES_POLLING_READING ? POLLIN : POLLOUT, deadline);
        if (w == 0) {
            *timed_out = true;
            *next = pgsrc_hosts_after_silent(ob->conninfo, c, first, at, atlen);
            return c;
        }
        if (w < 0)
            break;
        st = PQconnectPoll(c);
    }
    return c;
}

/* Connects (bounded by connect_timeout), verifies the database name byte for
 * byte and sets statement_timeout for the session — unless a pooler sits in
 * between (the backend pid the connection announced is not the server's): a
 * session setting would then land on a pooled server connection, be lost for
 * us and leak to its next client; every wait here is bounded on our side
 * anyway. NULL with err filled on failure; path (may be NULL) says which. */
static PGconn *adm_connect_path(const cfg_outbox *ob, adm_path *path, char *err, size_t errlen)
{
    char msg[2048], qt[24], bpid[24], at[400];   /* msg: libpq's text for every host */
    int64_t ct = ob->connect_timeout_ms > 0 ? ob->connect_timeout_ms : 5000;
    PGconn *c;
    bool timed_out;
    int first = 0, next, n_hosts, tries = 0;

    if (!ob->conninfo || !ob->database) {
        errf(ob, err, errlen, "conninfo and database are required");
        return NULL;
    }
    /* libpq leaves a host that refuses or does not qualify by itself, not one that never
       answers: each host gets a turn at the head of the list, connect_timeout apiece */
    for (;;) {
        c = adm_connect_from(ob, first, ct, &n_hosts, &timed_out, &next, at, sizeof at);
        if (!c) {
            errf(ob, err, errlen, "cannot connect: out of memory");
            return NULL;
        }
        if (!timed_out)
            break;
        if (++tries >= n_hosts) {
            if (n_hosts > 1)
                errf(ob, err, errlen, "cannot connect: timed out after %" PRId64 " ms with "
                     "each of its %d hosts tried first", ct, n_hosts);
            else
                errf(ob, err, errlen, "cannot connect: timed out after %" PRId64 " ms", ct);
            goto fail;
        }
        PQfinish(c);
        first = next;
    }
    if (PQstatus(c) != CONNECTION_OK) {
        pgsrc_oneline(PQerrorMessage(c), msg, sizeof msg);
        errf(ob, err, errlen, "cannot connect: %s", msg[0] ? msg : "connection failed");
        goto fail;
    }
    const char *db = PQdb(c);
    if (!db || strcmp(db, ob->database) != 0) {
        errf(ob, err, errlen, "connected database \"%s\" differs from configured database \"%s\"",
             db ? db : "", ob->database);
        goto fail;
    }
    if (PQsetnonblocking(c, 1) != 0) {
        errf(ob, err, errlen, "cannot make the connection non-blocking");
        goto fail;
    }
    snprintf(qt, sizeof qt, "%" PRId64, ob->query_timeout_ms > 0 ? ob->query_timeout_ms : 30000);
    snprintf(bpid, sizeof bpid, "%d", PQbackendPID(c));
    const char *pv[2] = {bpid, qt};
    PGresult *r = adm_exec(c, ob, "SELECT pg_backend_pid(), CASE WHEN pg_backend_pid() = $1::int "
                           "THEN set_config('statement_timeout', $2::text, false) END", 2, pv,
                           msg, sizeof msg);
    if (!r) {
        errf(ob, err, errlen, "%s", msg);
        goto fail;
    }
    if (path) {
        path->client_pid = PQbackendPID(c);
        path->server_pid = PQntuples(r) == 1 ? atoi(PQgetvalue(r, 0, 0)) : 0;
        path->pooled = path->server_pid != path->client_pid;
    }
    PQclear(r);
    return c;
fail:
    PQfinish(c);
    return NULL;
}

static PGconn *adm_connect(const cfg_outbox *ob, char *err, size_t errlen)
{
    return adm_connect_path(ob, NULL, err, errlen);
}

/* Schema presence: sets t_ok, d_ok, l_ok (the lease table) and i_ok (the index of the
   delayed rows). 0 or -1 (err filled). */
static int adm_schema(PGconn *c, const cfg_outbox *ob, const sql_pg_names *n, bool *t_ok,
                      bool *d_ok, bool *l_ok, bool *i_ok, char *err, size_t errlen)
{
    char msg[512];
    const char *vals[4] = {n->table, n->dead, n->lease, n->delayed};
    char *sql = sql_pg_tables_exist();
    PGresult *r = sql ? adm_exec(c, ob, sql, 4, vals, msg, sizeof msg) : NULL;
    if (!sql)
        snprintf(msg, sizeof msg, "out of memory");
    free(sql);
    if (!r) {
        errf(ob, err, errlen, "schema check failed: %s", msg);
        return -1;
    }
    *t_ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 0), "1") == 0;
    *d_ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 1), "1") == 0;
    *l_ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 2), "1") == 0;
    *i_ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 3), "1") == 0;
    PQclear(r);
    return 0;
}

/* Does a notification reach this connection? LISTEN on a private channel here,
 * NOTIFY it from a second connection, wait up to 1 s: 1 it arrived, 0 it did not,
 * -1 could not tell (msg says why). Through PgBouncer's transaction pooling the
 * LISTEN stays on whichever server connection ran it, and the notification goes
 * there (PgBouncer drops it: "got packet 'A' from server when not linked"). */
static int notify_probe(PGconn *c, const cfg_outbox *ob, char *msg, size_t msglen)
{
    char chan[64], payload[32], sql[96], m2[512] = "";
    PGconn *b = NULL;
    PGresult *r;
    int rc = -1;
    int64_t t0 = now_ms();
    snprintf(chan, sizeof chan, "outbox_relay_probe_%ld_%" PRId64, (long)getpid(), t0 % 1000000);
    snprintf(payload, sizeof payload, "probe-%" PRId64, t0);
    snprintf(sql, sizeof sql, "LISTEN \"%s\"", chan);
    if (adm_cmd(c, ob, sql, msg, msglen) < 0)
        return -1;
    b = adm_connect(ob, m2, sizeof m2);
    if (!b) {
        snprintf(msg, msglen, "second connection: %s", m2);
        goto unlisten;
    }
    const char *v[2] = {chan, payload};
    r = adm_exec(b, ob, "SELECT pg_notify($1::text, $2::text)", 2, v, msg, msglen);
    PQfinish(b);
    if (!r)
        goto unlisten;
    PQclear(r);
    int64_t deadline = now_ms() + 1000;
    rc = 0;
    while (rc == 0) {
        PGnotify *n;
        if (!PQconsumeInput(c)) {
            pgsrc_oneline(PQerrorMessage(c), msg, msglen);
            rc = -1;
            break;
        }
        while ((n = PQnotifies(c)) != NULL) {
            if (strcmp(n->relname, chan) == 0 && n->extra && strcmp(n->extra, payload) == 0)
                rc = 1;
            PQfreemem(n);
        }
        if (rc)
            break;
        int w = wait_sock(c, POLLIN, deadline);
        if (w == 0)
            break;
        if (w < 0) {
            snprintf(msg, msglen, "connection lost while waiting for the notification");
            rc = -1;
        }
    }
unlisten:
    snprintf(sql, sizeof sql, "UNLISTEN \"%s\"", chan);
    (void)adm_cmd(c, ob, sql, m2, sizeof m2);  /* best effort: the channel is ours alone */
    return rc;
}

int pgsrc_server_version_ok(int version_num, char *msg, size_t msglen)
{
    char ver[32];
    if (version_num >= PGSRC_MIN_SERVER_VERSION)
        return 0;
    if (version_num <= 0)
        snprintf(ver, sizeof ver, "of unknown version");
    else if (version_num >= 100000)   /* 10 and newer: major * 10000 + minor */
        snprintf(ver, sizeof ver, "%d.%d", version_num / 10000, version_num % 10000);
    else                              /* 9.6 and older: major, minor, patch */
        snprintf(ver, sizeof ver, "%d.%d.%d", version_num / 10000, version_num / 100 % 100,
                 version_num % 100);
    snprintf(msg, msglen, "the server is PostgreSQL %s (server_version_num %d): outbox-relay "
             "needs PostgreSQL %d or newer (plan_cache_mode, MATERIALIZED CTEs)", ver,
             version_num, PGSRC_MIN_SERVER_VERSION / 10000);
    return -1;
}

int pgsrc_check(const cfg_outbox *ob, char *err, size_t errlen)
{
    sql_pg_names n;
    adm_path path = { 0 };
    bool t_ok = false, d_ok = false, l_ok = false, i_ok = false;
    char msg[512] = "";
    if (err && errlen)
        err[0] = '\0';
    PGconn *c = adm_connect_path(ob, &path, err, errlen);
    if (!c)
        return -1;
    if (pgsrc_server_version_ok(PQserverVersion(c), msg, sizeof msg) < 0) {
        PQfinish(c);
        errf(ob, err, errlen, "%s", msg);
        return -1;
    }
    sql_pg_names_init(ob, &n);
    int rc = adm_schema(c, ob, &n, &t_ok, &d_ok, &l_ok, &i_ok, err, errlen);
    /* through a pooler, no probe: its LISTEN would stay on a shared server connection
       (and its UNLISTEN land on another), and run does not LISTEN there anyway */
    int probe = rc < 0 ? -1 : path.pooled ? 0 : notify_probe(c, ob, msg, sizeof msg);
    PQfinish(c);
    if (rc < 0)
        return -1;
    if (!t_ok)
        errf(ob, err, errlen, "outbox table %s missing in database \"%s\": run outbox-relay init",
             n.table, ob->database);
    if (!d_ok)
        errf(ob, err, errlen, "dead-letter table %s missing in database \"%s\": run outbox-relay init",
             n.dead, ob->database);
    if (!l_ok)
        errf(ob, err, errlen, "leadership lease table %s missing in database \"%s\": run "
             "outbox-relay init", n.lease, ob->database);
    if (!t_ok || !d_ok || !l_ok)
        return -1;
    /* success: err carries warnings, if any (the caller prints them; exit status 0) */
    if (!i_ok && ob->mode == CFG_MODE_LEADER)
        errf(ob, err, errlen, "WARNING: index %s missing (a table made by an earlier version): "
             "the claims read each key's pending rows to keep delayed rows in order, which "
             "costs more; run outbox-relay init (on a large table, first CREATE INDEX "
             "CONCURRENTLY as outbox-relay schema prints it)", n.delayed);
    double poll_s = (double)cfg_poll_interval_ms(ob, false) / 1000.0;
    if (path.pooled)
        errf(ob, err, errlen, "WARNING: LISTEN/NOTIFY does not reach this connection (transaction "
             "pooling?): new rows are found by polling every poll_interval (%gs); the connection "
             "goes through a pooler (server backend pid %d, announced %d) and outbox-relay run "
             "does not LISTEN through one", poll_s, path.server_pid, path.client_pid);
    else if (probe == 0)
        errf(ob, err, errlen, "WARNING: LISTEN/NOTIFY does not reach this connection (transaction "
             "pooling?): new rows are found by polling every poll_interval (%gs)", poll_s);
    else if (probe < 0)
        errf(ob, err, errlen, "WARNING: could not verify that LISTEN/NOTIFY reaches this "
             "connection (%s): new rows may be found only by polling every poll_interval (%gs)",
             msg, poll_s);
    return 0;
}

/* init's notices: "outbox: creating <what>" from each guarded DDL statement that
   found its object missing (lib/schema.c). */
typedef struct init_notes {
    char created[1200];   /* "a, b, c" */
    char last[256];       /* the object being created when a statement failed */
    size_t n;
} init_notes;

static void init_notice(void *arg, const char *message)
{
    init_notes *in = arg;
    const char *p = strstr(message, "outbox: creating ");
    char what[256];
    if (!p)
        return;
    pgsrc_oneline(p + strlen("outbox: creating "), what, sizeof what);
    snprintf(in->last, sizeof in->last, "%s", what);
    size_t used = strlen(in->created);
    if (used + 3 < sizeof in->created)
        snprintf(in->created + used, sizeof in->created - used, "%s%s", used ? ", " : "", what);
    in->n++;
}

int pgsrc_init(const cfg_outbox *ob, char *err, size_t errlen)
{
    outbox_table_name t;
    char msg[512], sql[128], st[6];
    char **ddl = NULL;
    PGconn *c = NULL;
    init_notes in;
    memset(&in, 0, sizeof in);
    if (err && errlen)
        err[0] = '\0';
    memset(&t, 0, sizeof t);
    snprintf(t.schema, sizeof t.schema, "%s", ob->schema_part);
    snprintf(t.table, sizeof t.table, "%s", ob->table_part);
    snprintf(t.dead, sizeof t.dead, "%s", ob->dead_part);
    ddl = outbox_ddl(OUTBOX_DIALECT_POSTGRES, &t);
    if (!ddl) {
        errf(ob, err, errlen, "out of memory");
        return -1;
    }
    c = adm_connect(ob, err, errlen);
    if (!c)
        goto fail;
    PQsetNoticeProcessor(c, init_notice, &in);
    /* all or nothing: PostgreSQL DDL is transactional. Every statement skips an object
       that exists; one that must create something on a table in use waits for its lock
       at most lock_timeout, so init never queues for long behind a producer transaction
       (every later producer would queue behind init). Settings are LOCAL: nothing
       outlives the transaction, even on a pooled server connection. */
    if (adm_cmd(c, ob, "BEGIN", msg, sizeof msg) < 0) {
        errf(ob, err, errlen, "%s", msg);
        goto fail;
    }
    snprintf(sql, sizeof sql, "SELECT set_config('lock_timeout', '%d', true), "
             "set_config('statement_timeout', '%" PRId64 "', true)", OUTBOX_INIT_LOCK_TIMEOUT_MS,
             ob->query_timeout_ms > 0 ? ob->query_timeout_ms : 30000);
    if (adm_cmd(c, ob, sql, msg, sizeof msg) < 0) {
        errf(ob, err, errlen, "%s", msg);
        goto fail;
    }
    for (size_t i = 0; ddl[i]; i++) {
        in.last[0] = '\0';
        PGresult *r = adm_exec_st(c, ob, ddl[i], 0, NULL, msg, sizeof msg, st);
        if (r) {
            PQclear(r);
            continue;
        }
        if (strcmp(st, "55P03") == 0)  /* lock_not_available */
            errf(ob, err, errlen, "could not create %s: its lock was not granted within "
                 "lock_timeout (%d ms): a transaction is using the table (a long producer "
                 "transaction?); nothing was changed; run init again when it is quieter, or "
                 "apply `outbox-relay schema` yourself", in.last[0] ? in.last : "an object",
                 OUTBOX_INIT_LOCK_TIMEOUT_MS);
        else if (in.last[0])
            errf(ob, err, errlen, "could not create %s: %s; nothing was changed", in.last, msg);
        else
            errf(ob, err, errlen, "statement %zu failed: %s; nothing was changed", i + 1, msg);
        goto fail;  /* closing the connection rolls back */
    }
    if (adm_cmd(c, ob, "COMMIT", msg, sizeof msg) < 0) {
        errf(ob, err, errlen, "commit failed: %s", msg);
        goto fail;
    }
    PQfinish(c);
    outbox_ddl_free(ddl);
    /* success: err carries what was done (the caller prints it) */
    if (in.n)
        errf(ob, err, errlen, "created %s", in.created);
    else
        errf(ob, err, errlen, "nothing to change: every object already present");
    return 0;
fail:
    if (c)
        PQfinish(c);
    outbox_ddl_free(ddl);
    return -1;
}

/* One statement on a connection of its own: connects (adm_connect), runs sql
 * with its n parameters, disconnects. Takes ownership of sql (NULL: building it
 * ran out of memory). The result (caller PQclears: it outlives the
 * connection), or NULL with err filled. */
static PGresult *adm_once(const cfg_outbox *ob, char *sql, int n, const char *const *vals,
                          char *err, size_t errlen)
{
    char msg[512];
    PGresult *r = NULL;
    PGconn *c;
    if (!sql) {
        errf(ob, err, errlen, "out of memory");
        return NULL;
    }
    c = adm_connect(ob, err, errlen);
    if (c) {
        r = adm_exec(c, ob, sql, n, vals, msg, sizeof msg);
        if (!r)
            errf(ob, err, errlen, "%s", msg);
        PQfinish(c);
    }
    free(sql);
    return r;
}

int pgsrc_stats_sync(const cfg_outbox *ob, src_stats *out, char *err, size_t errlen)
{
    sql_pg_names n;
    int rc = -1;
    if (err && errlen)
        err[0] = '\0';
    memset(out, 0, sizeof *out);
    sql_pg_names_init(ob, &n);
    PGresult *r = adm_once(ob, sql_pg_stats(&n, true), 0, NULL, err, errlen);
    if (!r)
        return -1;
    if (pgsrc_parse_stats(r, out) < 0)
        errf(ob, err, errlen, "unexpected stats result");
    else
        rc = 0;
    PQclear(r);
    return rc;
}

int pgsrc_dead_list(const cfg_outbox *ob, FILE *out, char *err, size_t errlen)
{
    sql_pg_names n;
    int rc = -1;
    if (err && errlen)
        err[0] = '\0';
    sql_pg_names_init(ob, &n);
    PGresult *r = adm_once(ob, sql_pg_dead_list(&n), 0, NULL, err, errlen);
    if (!r)
        return -1;
    /* id, message_id, exchange, routing_key, attempts, dead_at, reason */
    for (int i = 0; i < PQntuples(r); i++) {
        const char *f[7];
        for (int k = 0; k < 7; k++)
            f[k] = PQgetisnull(r, i, k) ? NULL : PQgetvalue(r, i, k);
        source_dead_line(out, f, 7);
    }
    if (fflush(out) != 0)
        errf(ob, err, errlen, "write failed: %s", strerror(errno));
    else
        rc = 0;
    PQclear(r);
    return rc;
}

typedef char *(*sql_fn)(const sql_pg_names *n);

static int dead_modify(const cfg_outbox *ob, sql_fn make, const int64_t *ids,
                       size_t n_ids, size_t *affected, char *err, size_t errlen)
{
    sql_pg_names n;
    char *arr = NULL;
    if (err && errlen)
        err[0] = '\0';
    if (affected)
        *affected = 0;
    if (sql_pg_id_array(ids, n_ids, &arr) < 0) {
        errf(ob, err, errlen, "out of memory");
        return -1;
    }
    sql_pg_names_init(ob, &n);
    const char *vals[1] = {arr};  /* NULL: all rows */
    PGresult *r = adm_once(ob, make(&n), 1, vals, err, errlen);
    free(arr);
    if (!r)
        return -1;
    if (affected)
        *affected = (size_t)strtoull(PQcmdTuples(r), NULL, 10);
    PQclear(r);
    return 0;
}

int pgsrc_dead_retry(const cfg_outbox *ob, const int64_t *ids, size_t n_ids,
                     size_t *affected, char *err, size_t errlen)
{
    return dead_modify(ob, sql_pg_dead_retry, ids, n_ids, affected, err, errlen);
}

int pgsrc_dead_purge(const cfg_outbox *ob, const int64_t *ids, size_t n_ids,
                     size_t *affected, char *err, size_t errlen)
{
    return dead_modify(ob, sql_pg_dead_purge, ids, n_ids, affected, err, errlen);
}
