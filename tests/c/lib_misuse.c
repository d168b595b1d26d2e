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
#include <time.h>

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
static int tsql;   /* ODBC to a T-SQL engine (SQL Server, Babelfish) */

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

/* psqlODBC calls setlocale() while it connects and disconnects, which is not thread-safe:
   the threads below connected at the same time and one read a locale string another had
   freed (AddressSanitizer, in CI). The relay serializes those calls the same way
   (sources/odbc/odbcsrc_db.c); an application must too. */
static pthread_mutex_t driver_setup_lock = PTHREAD_MUTEX_INITIALIZER;

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
    pthread_mutex_lock(&driver_setup_lock);
    SQLRETURN rc = SQLDriverConnect(c->dbc, NULL, (SQLCHAR *)(uintptr_t)s, SQL_NTS, NULL, 0,
                                    NULL, SQL_DRIVER_NOPROMPT);
    pthread_mutex_unlock(&driver_setup_lock);
    if (!SQL_SUCCEEDED(rc)) {
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
        pthread_mutex_lock(&driver_setup_lock);
        (void)SQLDisconnect(c->dbc);
        pthread_mutex_unlock(&driver_setup_lock);
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

/* The first column of the first row of a query: 1 (value in *v), 0 (no row), -1 (error). */
static int query_long(conn *c, const char *sql, long *v)
{
    if (!odbc) {
        PGresult *r = PQexec(c->pg, sql);
        int rc = PQresultStatus(r) != PGRES_TUPLES_OK ? -1 : PQntuples(r) == 0 ? 0 : 1;
        if (rc == 1)
            *v = strtol(PQgetvalue(r, 0, 0), NULL, 10);
        PQclear(r);
        return rc;
    }
    SQLHSTMT st;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_STMT, c->dbc, &st)))
        return -1;
    int rc = -1;
    char buf[32] = "";
    SQLLEN len = 0;
    if (SQL_SUCCEEDED(SQLExecDirect(st, (SQLCHAR *)(uintptr_t)sql, SQL_NTS))) {
        SQLRETURN f = SQLFetch(st);
        if (f == SQL_NO_DATA)
            rc = 0;
        else if (SQL_SUCCEEDED(f) &&
                 SQL_SUCCEEDED(SQLGetData(st, 1, SQL_C_CHAR, buf, sizeof buf, &len)) &&
                 len != SQL_NULL_DATA) {
            *v = strtol(buf, NULL, 10);
            rc = 1;
        }
    }
    (void)SQLFreeHandle(SQL_HANDLE_STMT, st);
    return rc;
}

/* ---------------------------------------------------------------- lost mid-send */
/* The server ends the producer's session while its send is in progress: the INSERT has
 * gone out and waits on the server for a row with the same message_id that another open
 * transaction inserted; a third session sees it waiting and terminates it. */
typedef struct killer {
    const char *connstr;
    long        victim;    /* the producer's backend process id (Babelfish: its spid) */
    int         killed;    /* 1: the victim was seen waiting and terminated */
} killer;

/* Babelfish runs on PostgreSQL: its catalog shows the wait under T-SQL too. */

static void *kill_when_waiting(void *arg)
{
    killer *k = arg;
    conn c;
    char sql[200];
    if (conn_open(&c, k->connstr) != 0) {
        conn_close(&c);
        return NULL;
    }
    snprintf(sql, sizeof sql, "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE "
             "pid = %ld AND wait_event_type = 'Lock'", k->victim);
    for (int i = 0; i < 2500; i++) {   /* 50 s, 20 ms apart (the lock_timeout is 60 s) */
        long waiting = 0;
        if (query_long(&c, sql, &waiting) < 0)
            break;
        if (waiting > 0) {
            long ok = 0;
            if (tsql) {
                snprintf(sql, sizeof sql, "KILL %ld", k->victim);
                k->killed = exec_sql(&c, sql) == 0;
            } else {
                snprintf(sql, sizeof sql, "SELECT CASE WHEN pg_terminate_backend(%ld) THEN 1 "
                         "ELSE 0 END", k->victim);
                k->killed = query_long(&c, sql, &ok) == 1 && ok == 1;
            }
            break;
        }
        nanosleep(&(struct timespec){ .tv_nsec = 20 * 1000 * 1000 }, NULL);
    }
    conn_close(&c);
    return NULL;
}

#define LOST_BATCH    20000      /* more rows than one INSERT takes: several statements */
#define LOST_AT       10000      /* the row that waits: past the first statement's rows */
#define LOST_PAYLOAD  (4u << 20)

/* One send (`batch` 0: a single message of LOST_PAYLOAD bytes; 1: a batch of LOST_BATCH
 * messages) whose session the server ends mid-send; reports it as `name`. Returns 0 when
 * the case ran, -1 when its setup failed. */
static int lost_mid_send(const char *name, const char *cs, const outbox_queue *q, int batch)
{
    static outbox_message many[LOST_BATCH];
    static char id[37];
    outbox_error e;
    conn blocker, victim;
    killer k = { .connstr = cs };
    pthread_t t;
    int rc = -1;
    size_t ins = 99;
    char *big = NULL;

    memset(&blocker, 0, sizeof blocker);
    memset(&victim, 0, sizeof victim);
    if (outbox_uuid_generate(id) != OUTBOX_OK || conn_open(&blocker, cs) != 0 ||
        conn_open(&victim, cs) != 0)
        goto out;
    outbox_message held = msg("misuse");
    held.message_id = id;
    if (begin(&blocker) != 0 || send1(&blocker, q, &held, &e) != OUTBOX_OK)
        goto out;   /* uncommitted: a second row with this id waits for this transaction */
    if (!odbc)
        k.victim = PQbackendPID(victim.pg);
    else if (query_long(&victim, tsql ? "SELECT @@SPID" : "SELECT pg_backend_pid()",
                        &k.victim) != 1)
        goto out;
    /* bounded: should the kill never come, the send fails on the lock wait instead */
    if (exec_sql(&victim, tsql ? "SET LOCK_TIMEOUT 60000" : "SET lock_timeout = '60s'") != 0 ||
        begin(&victim) != 0)
        goto out;
    if (pthread_create(&t, NULL, kill_when_waiting, &k) != 0)
        goto out;
    if (batch) {
        for (size_t i = 0; i < LOST_BATCH; i++)
            many[i] = msg("misuse");
        many[LOST_AT].message_id = id;
        int r = sendn(&victim, q, many, LOST_BATCH, &ins, &e);
        report(name, r, &e, ins);
    } else {
        big = malloc(LOST_PAYLOAD);
        outbox_message m = held;
        if (big) {
            memset(big, 'x', LOST_PAYLOAD);
            m.payload = big;
            m.payload_len = LOST_PAYLOAD;
        }
        report(name, send1(&victim, q, &m, &e), &e, 0);
    }
    (void)pthread_join(t, NULL);
    printf("lost=%s killed=%d\n", name, k.killed);
    rc = k.killed && (batch || big) ? 0 : -1;
out:
    if (blocker.pg || blocker.dbc)
        (void)end(&blocker, 0);
    conn_close(&blocker);
    conn_close(&victim);
    free(big);
    return rc;
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
    if (odbc) {
        char dbms[64] = "";
        SQLSMALLINT len = 0;
        if (!SQL_SUCCEEDED(SQLGetInfo(c.dbc, SQL_DBMS_NAME, dbms, sizeof dbms, &len)))
            goto out;
        tsql = strstr(dbms, "SQL Server") != NULL;
    }
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
        if (lost_mid_send("lost_mid_send", cs, q, 0) != 0 ||
            lost_mid_send("lost_mid_send_batch", cs, q, 1) != 0)
            goto out;
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
        if (lost_mid_send("lost_mid_send", cs, q, 0) != 0 ||
            lost_mid_send("lost_mid_send_batch", cs, q, 1) != 0)
            goto out;
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
