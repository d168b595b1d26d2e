/*
 * lib_misuse.c — liboutbox called the wrong way, against a real database, for
 * tests/test_lib_misuse.py.
 *
 *   lib_misuse pg   CONNINFO QUEUE_DB OTHER_CONNINFO
 *   lib_misuse odbc CONNSTR  QUEUE_DB OTHER_CONNSTR
 *
 * OTHER_* reaches a database other than QUEUE_DB; the queue's table comes from
 * env OUTBOX_TEST_TABLE (default outbox.messages). Every case prints one line
 * "case=<name> rc=<code> sqlstate=<s> inserted=<n> message=<text>" per library
 * call; pytest compares each code with the documented one and counts the rows
 * afterwards. Every message written by a call expected to fail carries routing
 * key "misuse"; the concurrent case writes "threads" rows and commits them. Exit
 * 0 when every case ran, 2 when the setup itself failed.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>
#include <sql.h>
#include <sqlext.h>

#include "outbox.h"
#include "outbox_odbc.h"
#include "outbox_pg.h"

#define THREADS      8
#define PER_THREAD   50

static const char *queue_db;
static int odbc;

static void report(const char *name, int rc, const outbox_error *e, size_t inserted)
{
    printf("case=%s rc=%d sqlstate=%s inserted=%zu message=%s\n", name, rc,
           e && e->sqlstate[0] ? e->sqlstate : "-", inserted, e ? e->message : "");
    fflush(stdout);
}

static outbox_message msg(const char *rk)
{
    static const char body[] = "misuse";
    return (outbox_message){ .routing_key = rk, .payload = body, .payload_len = sizeof body - 1,
                             .partition_key = "k" };
}

/* ---------------------------------------------------------------- connections */
typedef struct conn {
    PGconn *pg;
    SQLHENV env;
    SQLHDBC dbc;
} conn;

static int conn_open(conn *c, const char *s)
{
    memset(c, 0, sizeof *c);
    if (!odbc) {
        c->pg = PQconnectdb(s);
        if (PQstatus(c->pg) != CONNECTION_OK) {
            fprintf(stderr, "connect: %s", PQerrorMessage(c->pg));
            return -1;
        }
        return 0;
    }
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_ENV, SQL_NULL_HANDLE, &c->env)) ||
        !SQL_SUCCEEDED(SQLSetEnvAttr(c->env, SQL_ATTR_ODBC_VERSION, (SQLPOINTER)SQL_OV_ODBC3, 0)) ||
        !SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_DBC, c->env, &c->dbc)))
        return -1;
    if (!SQL_SUCCEEDED(SQLSetConnectAttr(c->dbc, SQL_ATTR_LOGIN_TIMEOUT,
                                         (SQLPOINTER)(intptr_t)10, 0)))
        return -1;
    if (!SQL_SUCCEEDED(SQLDriverConnect(c->dbc, NULL, (SQLCHAR *)(uintptr_t)s, SQL_NTS, NULL, 0,
                                        NULL, SQL_DRIVER_NOPROMPT))) {
        fprintf(stderr, "connect failed\n");
        return -1;
    }
    return 0;
}

static void conn_close(conn *c)
{
    if (c->pg)
        PQfinish(c->pg);
    if (c->dbc) {
        (void)SQLDisconnect(c->dbc);
        (void)SQLFreeHandle(SQL_HANDLE_DBC, c->dbc);
    }
    if (c->env)
        (void)SQLFreeHandle(SQL_HANDLE_ENV, c->env);
    memset(c, 0, sizeof *c);
}

static int exec_sql(conn *c, const char *sql)
{
    if (!odbc) {
        PGresult *r = PQexec(c->pg, sql);
        int ok = PQresultStatus(r) == PGRES_COMMAND_OK || PQresultStatus(r) == PGRES_TUPLES_OK;
        PQclear(r);
        return ok ? 0 : -1;
    }
    SQLHSTMT st;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_STMT, c->dbc, &st)))
        return -1;
    SQLRETURN r = SQLExecDirect(st, (SQLCHAR *)(uintptr_t)sql, SQL_NTS);
    int ok = SQL_SUCCEEDED(r) || r == SQL_NO_DATA;
    (void)SQLFreeHandle(SQL_HANDLE_STMT, st);
    return ok ? 0 : -1;
}

/* The caller's transaction: BEGIN (libpq) or autocommit off (ODBC). */
static int begin(conn *c)
{
    if (!odbc)
        return exec_sql(c, "BEGIN");
    return SQL_SUCCEEDED(SQLSetConnectAttr(c->dbc, SQL_ATTR_AUTOCOMMIT,
                                           (SQLPOINTER)(uintptr_t)SQL_AUTOCOMMIT_OFF, 0)) ? 0 : -1;
}

static int end(conn *c, int commit)
{
    if (!odbc)
        return exec_sql(c, commit ? "COMMIT" : "ROLLBACK");
    if (!SQL_SUCCEEDED(SQLEndTran(SQL_HANDLE_DBC, c->dbc, commit ? SQL_COMMIT : SQL_ROLLBACK)))
        return -1;
    return SQL_SUCCEEDED(SQLSetConnectAttr(c->dbc, SQL_ATTR_AUTOCOMMIT,
                                           (SQLPOINTER)(uintptr_t)SQL_AUTOCOMMIT_ON, 0)) ? 0 : -1;
}

static int send1(conn *c, const outbox_queue *q, const outbox_message *m, outbox_error *e)
{
    return odbc ? outbox_odbc_send(c ? c->dbc : SQL_NULL_HDBC, q, m, e)
                : outbox_pg_send(c ? c->pg : NULL, q, m, e);
}

static int sendn(conn *c, const outbox_queue *q, const outbox_message *m, size_t n,
                 size_t *ins, outbox_error *e)
{
    return odbc ? outbox_odbc_send_batch(c ? c->dbc : SQL_NULL_HDBC, q, m, n, ins, e)
                : outbox_pg_send_batch(c ? c->pg : NULL, q, m, n, ins, e);
}

/* ---------------------------------------------------------------- threads */
typedef struct worker {
    const char         *connstr;
    const outbox_queue *q;
    int                 ok, failed;
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    conn c;
    char body[32];

    if (conn_open(&c, w->connstr) != 0) {
        w->failed = PER_THREAD;
        conn_close(&c);
        return NULL;
    }
    for (int i = 0; i < PER_THREAD; i++) {
        outbox_error e;
        outbox_message m = msg("threads");
        int n = snprintf(body, sizeof body, "t%d", i);
        m.payload = body;
        m.payload_len = (size_t)n;
        if (begin(&c) != 0) {
            w->failed++;
            continue;
        }
        int rc = send1(&c, w->q, &m, &e);
        if (end(&c, rc == OUTBOX_OK) != 0 || rc != OUTBOX_OK)
            w->failed++;
        else
            w->ok++;
    }
    conn_close(&c);
    return NULL;
}

/* ---------------------------------------------------------------- cases */
int main(int argc, char **argv)
{
    if (argc != 5 || (strcmp(argv[1], "pg") != 0 && strcmp(argv[1], "odbc") != 0)) {
        fprintf(stderr, "usage: %s pg|odbc CONNSTR QUEUE_DB OTHER_CONNSTR\n", argv[0]);
        return 2;
    }
    odbc = strcmp(argv[1], "odbc") == 0;
    queue_db = argv[3];
    const char *cs = argv[2], *other_cs = argv[4];
    outbox_error e;
    outbox_queue *q = NULL, *small = NULL;
    const char *table = getenv("OUTBOX_TEST_TABLE");   /* NULL: outbox.messages */
    outbox_queue_options so = { .database = queue_db, .table = table, .max_payload = 16 };
    if (outbox_queue_new(&q, queue_db, table, &e) != OUTBOX_OK ||
        outbox_queue_new_opts(&small, &so, &e) != OUTBOX_OK) {
        fprintf(stderr, "queue: %s\n", e.message);
        return 2;
    }
    int status = 2;
    conn c;
    if (conn_open(&c, cs) != 0)
        goto out;
    outbox_message m = msg("misuse");
    size_t ins = 0;
    int rc;

    /* NULL arguments, inside an open transaction */
    if (begin(&c) != 0)
        goto out;
    report("null_conn", send1(NULL, q, &m, &e), &e, 0);
    report("null_queue", send1(&c, NULL, &m, &e), &e, 0);
    report("null_message", send1(&c, q, NULL, &e), &e, 0);
    ins = 99;
    rc = sendn(&c, q, NULL, 1, &ins, &e);
    report("batch_null_messages", rc, &e, ins);
    ins = 99;
    rc = sendn(&c, q, &m, 0, &ins, &e);
    report("batch_n0", rc, &e, ins);
    ins = 99;
    rc = sendn(&c, q, NULL, 0, &ins, &e);
    report("batch_n0_null", rc, &e, ins);
    {
        outbox_message bad = m;
        bad.routing_key = NULL;
        report("null_err_invalid", send1(&c, q, &bad, NULL), NULL, 0);
    }
    {
        outbox_message bad = m;
        bad.routing_key = NULL;
        report("routing_key_null", send1(&c, q, &bad, &e), &e, 0);
        bad = m;
        bad.payload = NULL;
        report("payload_null", send1(&c, q, &bad, &e), &e, 0);
        report("payload_over_max", send1(&c, small, &m, &e), &e, 0);   /* 6 <= 16: fits */
        static const char big[17] = "0123456789abcdef";
        bad = m;
        bad.payload = big;
        bad.payload_len = sizeof big;
        report("payload_over_max_17", send1(&c, small, &bad, &e), &e, 0);
        char longkey[300];
        memset(longkey, 'k', sizeof longkey - 1);
        longkey[sizeof longkey - 1] = '\0';
        bad = m;
        bad.partition_key = longkey;
        report("partition_key_long", send1(&c, q, &bad, &e), &e, 0);
        outbox_header h[] = { { "ok", "fine" }, { "bad", "\xc3\x28 not UTF-8" } };
        bad = m;
        bad.headers = h;
        bad.n_headers = 2;
        report("header_value_utf8", send1(&c, q, &bad, &e), &e, 0);
        outbox_header hk[] = { { "\xff\xfe", "v" } };
        bad.headers = hk;
        bad.n_headers = 1;
        report("header_key_utf8", send1(&c, q, &bad, &e), &e, 0);
        bad = m;
        bad.headers = NULL;
        bad.n_headers = 1;
        report("headers_null", send1(&c, q, &bad, &e), &e, 0);
    }
    /* every failed call above left the transaction usable: this row is rolled back */
    report("usable_after_einval", send1(&c, q, &m, &e), &e, 0);
    report("null_err_valid", send1(&c, q, &m, NULL), NULL, 0);
    if (end(&c, 0) != 0)
        goto out;

    /* no transaction open (autocommit) */
    report("autocommit", send1(&c, q, &m, &e), &e, 0);
    ins = 99;
    rc = sendn(&c, q, &m, 1, &ins, &e);
    report("autocommit_batch", rc, &e, ins);

    /* the transaction failed (PostgreSQL: aborted until rolled back) */
    if (begin(&c) != 0)
        goto out;
    (void)exec_sql(&c, "SELECT 1/0");
    report("after_failed_statement", send1(&c, q, &m, &e), &e, 0);
    if (end(&c, 0) != 0)
        goto out;

    /* the connection is to another database than the queue's */
    {
        conn o;
        if (conn_open(&o, other_cs) != 0 || begin(&o) != 0) {
            conn_close(&o);
            goto out;
        }
        report("wrong_database", send1(&o, q, &m, &e), &e, 0);
        (void)end(&o, 0);
        conn_close(&o);
    }

    if (!odbc) {
        /* libpq pipeline mode */
        if (begin(&c) != 0 || !PQenterPipelineMode(c.pg))
            goto out;
        report("pipeline_mode", send1(&c, q, &m, &e), &e, 0);
        if (!PQexitPipelineMode(c.pg))
            goto out;
        if (end(&c, 0) != 0)
            goto out;
        /* a connection that never came up */
        conn b = { .pg = PQconnectdb("host=127.0.0.1 port=1 connect_timeout=5") };
        report("bad_connection", send1(&b, q, &m, &e), &e, 0);
        conn_close(&b);
        /* the session ends (terminated by the server) inside the caller's transaction */
        if (begin(&c) != 0)
            goto out;
        conn k;
        char sql[96];
        int killed = conn_open(&k, cs) == 0;
        snprintf(sql, sizeof sql, "SELECT pg_terminate_backend(%d)", PQbackendPID(c.pg));
        killed = killed && exec_sql(&k, sql) == 0;
        conn_close(&k);
        if (!killed)
            goto out;
        report("connection_lost", send1(&c, q, &m, &e), &e, 0);
        report("connection_lost_again", send1(&c, q, &m, &e), &e, 0);
    } else {
        /* a handle allocated but never connected, and one disconnected */
        conn d = { 0 };
        if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_ENV, SQL_NULL_HANDLE, &d.env)) ||
            !SQL_SUCCEEDED(SQLSetEnvAttr(d.env, SQL_ATTR_ODBC_VERSION,
                                         (SQLPOINTER)SQL_OV_ODBC3, 0)) ||
            !SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_DBC, d.env, &d.dbc))) {
            conn_close(&d);
            goto out;
        }
        report("never_connected", send1(&d, q, &m, &e), &e, 0);
        conn_close(&d);
        conn x;
        if (conn_open(&x, cs) != 0 || begin(&x) != 0) {
            conn_close(&x);
            goto out;
        }
        (void)SQLEndTran(SQL_HANDLE_DBC, x.dbc, SQL_ROLLBACK);
        if (!SQL_SUCCEEDED(SQLDisconnect(x.dbc))) {
            conn_close(&x);
            goto out;
        }
        report("disconnected", send1(&x, q, &m, &e), &e, 0);
        conn_close(&x);
    }
    conn_close(&c);

    /* one queue from many threads at once, each with its own connection */
    worker w[THREADS];
    pthread_t t[THREADS];
    int started = 0, ok = 0, failed = 0;
    for (int i = 0; i < THREADS; i++) {
        w[i] = (worker){ .connstr = cs, .q = q };
        if (pthread_create(&t[i], NULL, work, &w[i]) != 0)
            break;
        started++;
    }
    for (int i = 0; i < started; i++) {
        (void)pthread_join(t[i], NULL);
        ok += w[i].ok;
        failed += w[i].failed;
    }
    printf("threads=%d ok=%d failed=%d\n", started, ok, failed);
    status = started == THREADS ? 0 : 2;
out:
    conn_close(&c);   /* closed already when every case ran: a no-op then */
    outbox_queue_free(q);
    outbox_queue_free(small);
    if (status != 0)
        fprintf(stderr, "setup failed\n");
    return status;
}
