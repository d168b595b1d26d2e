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
static PGresult *adm_exec(PGconn *c, const cfg_outbox *ob, const char *sql, int n,
                          const char *const *vals, char *msg, size_t msglen)
{
    PGresult *keep = NULL, *r;
    int64_t deadline = now_ms() + query_bound(ob);
    msg[0] = '\0';
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

static int adm_cmd(PGconn *c, const cfg_outbox *ob, const char *sql, char *msg, size_t msglen)
{
    PGresult *r = adm_exec(c, ob, sql, 0, NULL, msg, msglen);
    if (!r)
        return -1;
    PQclear(r);
    return 0;
}

/* Connects (bounded by connect_timeout), verifies the database name byte for
 * byte and sets statement_timeout. NULL with err filled on failure. */
static PGconn *adm_connect(const cfg_outbox *ob, char *err, size_t errlen)
{
    const char *keys[PGSRC_MAX_PARAMS], *vals[PGSRC_MAX_PARAMS];
    char tmo[24], msg[512], sql[96];
    int64_t ct = ob->connect_timeout_ms > 0 ? ob->connect_timeout_ms : 5000;
    int64_t deadline = now_ms() + ct;
    PGconn *c;

    if (!ob->conninfo || !ob->database) {
        errf(ob, err, errlen, "conninfo and database are required");
        return NULL;
    }
    pgsrc_conn_params(ob, keys, vals, tmo);
    c = PQconnectStartParams(keys, vals, 1);
    if (!c) {
        errf(ob, err, errlen, "cannot connect: out of memory");
        return NULL;
    }
    PQsetNoticeProcessor(c, quiet_notice, NULL);
    PostgresPollingStatusType st = PGRES_POLLING_WRITING;
    while (PQstatus(c) != CONNECTION_BAD && st != PGRES_POLLING_OK && st != PGRES_POLLING_FAILED) {
        int w = wait_sock(c, st == PGRES_POLLING_READING ? POLLIN : POLLOUT, deadline);
        if (w == 0) {
            errf(ob, err, errlen, "cannot connect: timed out after %" PRId64 " ms", ct);
            goto fail;
        }
        if (w < 0)
            break;
        st = PQconnectPoll(c);
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
    snprintf(sql, sizeof sql, "SET statement_timeout = %" PRId64,
             ob->query_timeout_ms > 0 ? ob->query_timeout_ms : 30000);
    if (adm_cmd(c, ob, sql, msg, sizeof msg) < 0) {
        errf(ob, err, errlen, "%s", msg);
        goto fail;
    }
    return c;
fail:
    PQfinish(c);
    return NULL;
}

/* Schema presence: sets t_ok and d_ok. 0 or -1 (err filled). */
static int adm_schema(PGconn *c, const cfg_outbox *ob, const pgsrc_names *n, bool *t_ok,
                      bool *d_ok, char *err, size_t errlen)
{
    char msg[512];
    const char *vals[2] = {n->table, n->dead};
    PGresult *r = adm_exec(c, ob, "SELECT to_regclass($1::text) IS NOT NULL, "
                           "to_regclass($2::text) IS NOT NULL", 2, vals, msg, sizeof msg);
    if (!r) {
        errf(ob, err, errlen, "schema check failed: %s", msg);
        return -1;
    }
    *t_ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    *d_ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 1), "t") == 0;
    PQclear(r);
    return 0;
}

int pgsrc_check(const cfg_outbox *ob, char *err, size_t errlen)
{
    pgsrc_names n;
    bool t_ok = false, d_ok = false;
    if (err && errlen)
        err[0] = '\0';
    PGconn *c = adm_connect(ob, err, errlen);
    if (!c)
        return -1;
    pgsrc_names_init(ob, &n);
    int rc = adm_schema(c, ob, &n, &t_ok, &d_ok, err, errlen);
    PQfinish(c);
    if (rc < 0)
        return -1;
    if (!t_ok)
        errf(ob, err, errlen, "outbox table %s missing in database \"%s\": run outbox-relay init",
             n.table, ob->database);
    if (!d_ok)
        errf(ob, err, errlen, "dead-letter table %s missing in database \"%s\": run outbox-relay init",
             n.dead, ob->database);
    return t_ok && d_ok ? 0 : -1;
}

int pgsrc_init(const cfg_outbox *ob, char *err, size_t errlen)
{
    outbox_table_name t;
    char msg[512];
    char **ddl = NULL;
    PGconn *c = NULL;
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
    /* all or nothing: PostgreSQL DDL is transactional */
    if (adm_cmd(c, ob, "BEGIN", msg, sizeof msg) < 0) {
        errf(ob, err, errlen, "%s", msg);
        goto fail;
    }
    for (size_t i = 0; ddl[i]; i++) {
        if (adm_cmd(c, ob, ddl[i], msg, sizeof msg) < 0) {
            errf(ob, err, errlen, "statement %zu failed: %s", i + 1, msg);
            goto fail;  /* closing the connection rolls back */
        }
    }
    if (adm_cmd(c, ob, "COMMIT", msg, sizeof msg) < 0) {
        errf(ob, err, errlen, "commit failed: %s", msg);
        goto fail;
    }
    PQfinish(c);
    outbox_ddl_free(ddl);
    return 0;
fail:
    if (c)
        PQfinish(c);
    outbox_ddl_free(ddl);
    return -1;
}

int pgsrc_stats_sync(const cfg_outbox *ob, src_stats *out, char *err, size_t errlen)
{
    pgsrc_names n;
    char msg[512];
    char *sql = NULL;
    PGresult *r = NULL;
    int rc = -1;
    if (err && errlen)
        err[0] = '\0';
    memset(out, 0, sizeof *out);
    PGconn *c = adm_connect(ob, err, errlen);
    if (!c)
        return -1;
    pgsrc_names_init(ob, &n);
    sql = pgsrc_sql_stats(&n);
    if (!sql) {
        errf(ob, err, errlen, "out of memory");
        goto out;
    }
    r = adm_exec(c, ob, sql, 0, NULL, msg, sizeof msg);
    if (!r) {
        errf(ob, err, errlen, "%s", msg);
        goto out;
    }
    if (pgsrc_parse_stats(r, out) < 0) {
        errf(ob, err, errlen, "unexpected stats result");
        goto out;
    }
    rc = 0;
out:
    PQclear(r);
    free(sql);
    PQfinish(c);
    return rc;
}

/* Prints a text field for a tab-separated line: \t \n \r \\ escaped. */
static void put_field(FILE *out, const char *s)
{
    for (; *s; s++) {
        switch (*s) {
        case '\t': fputs("\\t", out); break;
        case '\n': fputs("\\n", out); break;
        case '\r': fputs("\\r", out); break;
        case '\\': fputs("\\\\", out); break;
        default: fputc(*s, out); break;
        }
    }
}

int pgsrc_dead_list(const cfg_outbox *ob, FILE *out, char *err, size_t errlen)
{
    pgsrc_names n;
    char msg[512];
    char *sql = NULL;
    PGresult *r = NULL;
    int rc = -1;
    if (err && errlen)
        err[0] = '\0';
    PGconn *c = adm_connect(ob, err, errlen);
    if (!c)
        return -1;
    pgsrc_names_init(ob, &n);
    sql = pgsrc_sql_dead_list(&n);
    if (!sql) {
        errf(ob, err, errlen, "out of memory");
        goto out;
    }
    r = adm_exec(c, ob, sql, 0, NULL, msg, sizeof msg);
    if (!r) {
        errf(ob, err, errlen, "%s", msg);
        goto out;
    }
    /* id, message_id, exchange, routing_key, attempts, dead_at, reason */
    for (int i = 0; i < PQntuples(r); i++) {
        for (int f = 0; f < 7; f++) {
            if (f)
                fputc('\t', out);
            put_field(out, PQgetisnull(r, i, f) ? "" : PQgetvalue(r, i, f));
        }
        fputc('\n', out);
    }
    if (fflush(out) != 0) {
        errf(ob, err, errlen, "write failed: %s", strerror(errno));
        goto out;
    }
    rc = 0;
out:
    PQclear(r);
    free(sql);
    PQfinish(c);
    return rc;
}

typedef char *(*sql_fn)(const pgsrc_names *n);

static int dead_modify(const cfg_outbox *ob, sql_fn make, const int64_t *ids,
                       size_t n_ids, size_t *affected, char *err, size_t errlen)
{
    pgsrc_names n;
    char msg[512];
    char *sql = NULL, *arr = NULL;
    PGresult *r = NULL;
    PGconn *c = NULL;
    int rc = -1;
    if (err && errlen)
        err[0] = '\0';
    if (affected)
        *affected = 0;
    pgsrc_names_init(ob, &n);
    sql = make(&n);
    if (!sql || pgsrc_id_array(ids, n_ids, &arr) < 0) {
        errf(ob, err, errlen, "out of memory");
        goto out;
    }
    c = adm_connect(ob, err, errlen);
    if (!c)
        goto out;
    const char *vals[1] = {arr};  /* NULL: all rows */
    r = adm_exec(c, ob, sql, 1, vals, msg, sizeof msg);
    if (!r) {
        errf(ob, err, errlen, "%s", msg);
        goto out;
    }
    if (affected)
        *affected = (size_t)strtoull(PQcmdTuples(r), NULL, 10);
    rc = 0;
out:
    PQclear(r);
    free(sql);
    free(arr);
    if (c)
        PQfinish(c);
    return rc;
}

int pgsrc_dead_retry(const cfg_outbox *ob, const int64_t *ids, size_t n_ids,
                     size_t *affected, char *err, size_t errlen)
{
    return dead_modify(ob, pgsrc_sql_dead_retry, ids, n_ids, affected, err, errlen);
}

int pgsrc_dead_purge(const cfg_outbox *ob, const int64_t *ids, size_t n_ids,
                     size_t *affected, char *err, size_t errlen)
{
    return dead_modify(ob, pgsrc_sql_dead_purge, ids, n_ids, affected, err, errlen);
}
