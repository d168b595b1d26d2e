/*
 * lib_send_test.c — drives liboutbox against a real database, one case per
 * run, for tests/test_lib_pg.py and tests/test_lib_odbc.py.
 *
 *   lib_send_test BACKEND CONNSTR QUEUE_DB CASE [ARG...]
 *
 * BACKEND is "pg" (libpq conninfo) or "odbc" (ODBC connection string; the
 * dialect follows SQL_DBMS_NAME). The queue's table comes from env
 * OUTBOX_TEST_TABLE (default outbox.messages). Every case prints
 * "rc=<code> sqlstate=<s> inserted=<n> message=<text>" for each library call
 * and exits 0 when the library returned what the case expects, 1 otherwise,
 * 2 when the test setup itself failed. The database state is checked by
 * pytest afterwards.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>
#include <sql.h>
#include <sqlext.h>

#include "outbox.h"
#include "outbox_odbc.h"
#include "outbox_pg.h"
#include "outbox_schema.h"

typedef struct be {
    int      odbc;
    int      mssql;
    PGconn  *pg;
    SQLHENV  env;
    SQLHDBC  dbc;
} be;

static void odbc_diag(SQLSMALLINT type, SQLHANDLE h, const char *what)
{
    SQLCHAR state[6], text[1024];
    SQLINTEGER native;
    SQLSMALLINT len;
    for (SQLSMALLINT i = 1;
         SQL_SUCCEEDED(SQLGetDiagRec(type, h, i, state, &native, text, sizeof text, &len));
         i++)
        fprintf(stderr, "%s: [%s] %ld %s\n", what, state, (long)native, text);
}

static int be_connect(be *b, const char *kind, const char *conn)
{
    memset(b, 0, sizeof *b);
    if (strcmp(kind, "pg") == 0) {
        b->pg = PQconnectdb(conn);
        if (PQstatus(b->pg) != CONNECTION_OK) {
            fprintf(stderr, "connect: %s", PQerrorMessage(b->pg));
            return -1;
        }
        return 0;
    }
    if (strcmp(kind, "odbc") != 0) {
        fprintf(stderr, "unknown backend %s\n", kind);
        return -1;
    }
    b->odbc = 1;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_ENV, SQL_NULL_HANDLE, &b->env)) ||
        !SQL_SUCCEEDED(SQLSetEnvAttr(b->env, SQL_ATTR_ODBC_VERSION, (SQLPOINTER)SQL_OV_ODBC3,
                                     0)) ||
        !SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_DBC, b->env, &b->dbc))) {
        fprintf(stderr, "odbc: cannot allocate handles\n");
        return -1;
    }
    SQLSetConnectAttr(b->dbc, SQL_ATTR_LOGIN_TIMEOUT, (SQLPOINTER)(intptr_t)10, 0);
    SQLRETURN r = SQLDriverConnect(b->dbc, NULL, (SQLCHAR *)(uintptr_t)conn, SQL_NTS, NULL, 0,
                                   NULL, SQL_DRIVER_NOPROMPT);
    if (!SQL_SUCCEEDED(r)) {
        odbc_diag(SQL_HANDLE_DBC, b->dbc, "connect");
        SQLFreeHandle(SQL_HANDLE_DBC, b->dbc);
        b->dbc = NULL;
        return -1;
    }
    char name[64] = "";
    SQLSMALLINT nl = 0;
    SQLGetInfo(b->dbc, SQL_DBMS_NAME, name, sizeof name, &nl);
    b->mssql = strstr(name, "SQL Server") != NULL;
    return 0;
}

static void be_close(be *b)
{
    if (b->pg)
        PQfinish(b->pg);
    if (b->dbc) {
        SQLDisconnect(b->dbc);
        SQLFreeHandle(SQL_HANDLE_DBC, b->dbc);
    }
    if (b->env)
        SQLFreeHandle(SQL_HANDLE_ENV, b->env);
}

static int be_autocommit(be *b, int on)
{
    if (!b->odbc)
        return 0;
    SQLRETURN r = SQLSetConnectAttr(b->dbc, SQL_ATTR_AUTOCOMMIT,
                                    (SQLPOINTER)(uintptr_t)(on ? SQL_AUTOCOMMIT_ON
                                                               : SQL_AUTOCOMMIT_OFF), 0);
    if (!SQL_SUCCEEDED(r)) {
        odbc_diag(SQL_HANDLE_DBC, b->dbc, "autocommit");
        return -1;
    }
    return 0;
}

/* Runs sql; returns 0 on success, -1 on a database error (printed). */
static int be_exec(be *b, const char *sql)
{
    if (!b->odbc) {
        PGresult *r = PQexec(b->pg, sql);
        ExecStatusType st = PQresultStatus(r);
        int ok = st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
        if (!ok)
            fprintf(stderr, "exec %s: %s", sql, PQresultErrorMessage(r));
        PQclear(r);
        return ok ? 0 : -1;
    }
    SQLHSTMT st;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_STMT, b->dbc, &st)))
        return -1;
    SQLRETURN r = SQLExecDirect(st, (SQLCHAR *)(uintptr_t)sql, SQL_NTS);
    int ok = SQL_SUCCEEDED(r) || r == SQL_NO_DATA;
    if (!ok)
        odbc_diag(SQL_HANDLE_STMT, st, sql);
    while (ok && SQL_SUCCEEDED(SQLMoreResults(st)))
        ;
    SQLFreeHandle(SQL_HANDLE_STMT, st);
    return ok ? 0 : -1;
}

/* Starts the caller's transaction: BEGIN (libpq) or autocommit off (ODBC). */
static int be_begin(be *b)
{
    return b->odbc ? be_autocommit(b, 0) : be_exec(b, "BEGIN");
}

static int be_end(be *b, int commit)
{
    if (!b->odbc)
        return be_exec(b, commit ? "COMMIT" : "ROLLBACK");
    SQLRETURN r = SQLEndTran(SQL_HANDLE_DBC, b->dbc, commit ? SQL_COMMIT : SQL_ROLLBACK);
    if (!SQL_SUCCEEDED(r)) {
        odbc_diag(SQL_HANDLE_DBC, b->dbc, commit ? "commit" : "rollback");
        return -1;
    }
    return 0;
}

static int report(int rc, const outbox_error *e, size_t inserted)
{
    printf("rc=%d code=%d sqlstate=%s inserted=%zu message=%s\n", rc, e->code, e->sqlstate,
           inserted, e->message);
    fflush(stdout);
    return rc;
}

static int be_send(be *b, const outbox_queue *q, const outbox_message *m)
{
    outbox_error e;
    memset(&e, 0x5a, sizeof e); /* the library must overwrite it */
    int rc = b->odbc ? outbox_odbc_send(b->dbc, q, m, &e) : outbox_pg_send(b->pg, q, m, &e);
    return report(rc, &e, 0);
}

static int be_batch(be *b, const outbox_queue *q, const outbox_message *m, size_t n,
                    size_t *ins)
{
    outbox_error e;
    memset(&e, 0x5a, sizeof e);
    size_t inserted = 12345;
    int rc = b->odbc ? outbox_odbc_send_batch(b->dbc, q, m, n, &inserted, &e)
                     : outbox_pg_send_batch(b->pg, q, m, n, &inserted, &e);
    if (ins)
        *ins = inserted;
    return report(rc, &e, inserted);
}

/* ------------------------------------------------------------- messages */

static const unsigned char PAYLOAD[] = { 0x00, 'h', 'i', 0x00, 0x00, 0xff, 0xfe, '\n',
                                         0x7f, 0x80, 0x00, 'z' };
static const outbox_header HEADERS[] = {
    { "trace-id", "abc-123" },
    { "quote", "a\"b\\c/d" },
    { "ctl", "line1\nline2\t\x01\x1f end" },
    { "\xc3\xbcn\xc3\xafk", "\xc3\xa7\xc3\xb8\x64\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x98\x80" },
    { "empty", "" },
    { "traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" },
    { "tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE" },
};

static outbox_message full_message(const char *id)
{
    outbox_message m;
    memset(&m, 0, sizeof m);
    m.exchange = "ex.orders";
    m.routing_key = "orders.created";
    m.payload = PAYLOAD;
    m.payload_len = sizeof PAYLOAD;
    m.message_id = id;
    m.partition_key = "order-42";
    m.message_type = "OrderCreated";
    m.content_type = "application/octet-stream";
    m.correlation_id = "corr-\xc3\xa9";
    m.headers = HEADERS;
    m.n_headers = sizeof HEADERS / sizeof HEADERS[0];
    m.delay_ms = 60000;
    return m;
}

static outbox_message simple_message(const char *id)
{
    outbox_message m;
    memset(&m, 0, sizeof m);
    m.routing_key = "rk";
    m.payload = "x";
    m.payload_len = 1;
    m.message_id = id;
    return m;
}

/* ----------------------------------------------------------- invalid input */

typedef struct inv {
    const char *name;   /* sub-case */
    const char *field;  /* text the message must contain */
} inv;

static char long_str[300];
static char bad_utf8[][8] = {
    "\xc0\xaf",         /* overlong '/' */
    "\xed\xa0\x80",     /* surrogate U+D800 */
    "\xf4\x90\x80\x80", /* above U+10FFFF */
    "\xff",
    "a\x80",            /* lone continuation */
    "\xe2\x82",         /* truncated */
};

/* Fills m for sub-case name; returns the expected field text or NULL if unknown. */
static const char *make_invalid(const char *name, outbox_message *m, outbox_header *hs,
                                size_t *max_payload)
{
    memset(long_str, 'a', 256);
    long_str[256] = '\0';
    *m = simple_message(NULL);
    *max_payload = 0;
#define CASE(n) if (strcmp(name, n) == 0)
    CASE("routing_key_null") { m->routing_key = NULL; return "routing_key"; }
    CASE("routing_key_long") { m->routing_key = long_str; return "routing_key"; }
    CASE("routing_key_utf8") { m->routing_key = bad_utf8[0]; return "routing_key"; }
    CASE("exchange_long") { m->exchange = long_str; return "exchange"; }
    CASE("exchange_utf8") { m->exchange = bad_utf8[1]; return "exchange"; }
    CASE("partition_key_long") { m->partition_key = long_str; return "partition_key"; }
    CASE("partition_key_utf8") { m->partition_key = bad_utf8[2]; return "partition_key"; }
    CASE("message_type_long") { m->message_type = long_str; return "message_type"; }
    CASE("message_type_utf8") { m->message_type = bad_utf8[3]; return "message_type"; }
    CASE("content_type_long") { m->content_type = long_str; return "content_type"; }
    CASE("content_type_utf8") { m->content_type = bad_utf8[4]; return "content_type"; }
    CASE("correlation_id_long") { m->correlation_id = long_str; return "correlation_id"; }
    CASE("correlation_id_utf8") { m->correlation_id = bad_utf8[5]; return "correlation_id"; }
    CASE("message_id_bad") { m->message_id = "not-a-uuid"; return "message_id"; }
    CASE("message_id_braces") {
        m->message_id = "{6f1c3c9e-3b9a-4d4e-9d7b-1b2a3c4d5e6f}"; return "message_id"; }
    CASE("message_id_long") {
        m->message_id = "6f1c3c9e-3b9a-4d4e-9d7b-1b2a3c4d5e6f0"; return "message_id"; }
    CASE("payload_null") { m->payload = NULL; m->payload_len = 5; return "payload"; }
    CASE("payload_too_big") {
        m->payload = long_str; m->payload_len = 257; *max_payload = 256;
        return "payload: 257 bytes, larger than the limit of 256 bytes"; }
    CASE("payload_over_default") {
        /* the default limit (the relay's default max_message_size), checked before a
           byte of the payload is read: the buffer is far shorter than its stated length */
        m->payload = long_str; m->payload_len = (size_t)OUTBOX_DEFAULT_MAX_PAYLOAD + 1;
        return "payload: 134217729 bytes, larger than the limit of 134217728 bytes "
               "(the queue's max_payload"; }
    CASE("headers_null") { m->headers = NULL; m->n_headers = 2; return "headers"; }
    CASE("header_key_null") {
        hs[0].key = "ok"; hs[0].value = "v"; hs[1].key = NULL; hs[1].value = "v";
        m->headers = hs; m->n_headers = 2; return "headers[1].key"; }
    CASE("header_key_empty") {
        hs[0].key = ""; hs[0].value = "v"; m->headers = hs; m->n_headers = 1;
        return "headers[0].key"; }
    CASE("header_key_long") {
        hs[0].key = long_str; hs[0].value = "v"; m->headers = hs; m->n_headers = 1;
        return "headers[0].key"; }
    CASE("header_key_utf8") {
        hs[0].key = bad_utf8[0]; hs[0].value = "v"; m->headers = hs; m->n_headers = 1;
        return "headers[0].key"; }
    CASE("header_value_null") {
        hs[0].key = "k"; hs[0].value = NULL; m->headers = hs; m->n_headers = 1;
        return "headers[0].value"; }
    CASE("header_value_utf8") {
        hs[0].key = "k"; hs[0].value = bad_utf8[1]; m->headers = hs; m->n_headers = 1;
        return "headers[0].value"; }
    CASE("header_key_dup") {
        hs[0].key = "k"; hs[0].value = "1"; hs[1].key = "j"; hs[1].value = "2";
        hs[2].key = "k"; hs[2].value = "3"; m->headers = hs; m->n_headers = 3;
        return "headers[2].key"; }
    CASE("traceparent_bad") {
        hs[0].key = "k"; hs[0].value = "1";
        hs[1].key = "traceparent"; hs[1].value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7";
        m->headers = hs; m->n_headers = 2; return "headers[1].value: traceparent value is not in W3C"; }
    CASE("tracestate_bad") {
        hs[0].key = "tracestate"; hs[0].value = "Rojo=1";
        m->headers = hs; m->n_headers = 1; return "headers[0].value: tracestate value is not in W3C"; }
    CASE("trace_key_case") {
        hs[0].key = "TraceParent"; hs[0].value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        m->headers = hs; m->n_headers = 1; return "lower case"; }
    CASE("delay_too_big") { m->delay_ms = 4000000000000ULL; return "delay_ms"; }
    CASE("batch_second_bad") { return "messages[1].routing_key"; }
#undef CASE
    return NULL;
}

static int case_invalid(be *b, const char *qdb, const char *table, const char *sub)
{
    outbox_message m;
    outbox_header hs[4];
    size_t maxp;
    const char *want = make_invalid(sub, &m, hs, &maxp);
    if (!want) {
        fprintf(stderr, "unknown invalid sub-case %s\n", sub);
        return 2;
    }
    outbox_queue_options o = { qdb, table, maxp };
    outbox_queue *q;
    outbox_error e;
    if (outbox_queue_new_opts(&q, &o, &e) != OUTBOX_OK) {
        fprintf(stderr, "queue: %s\n", e.message);
        return 2;
    }
    int status = 1;
    if (be_begin(b) != 0)
        goto out;
    int rc;
    if (strcmp(sub, "batch_second_bad") == 0) {
        outbox_message v[3] = { simple_message(NULL), simple_message(NULL),
                                simple_message(NULL) };
        v[1].routing_key = NULL;
        size_t ins;
        rc = be_batch(b, q, v, 3, &ins);
    } else {
        rc = be_send(b, q, &m);
        /* the same message inside a batch names its index */
        outbox_message v[2] = { simple_message(NULL), m };
        size_t ins;
        int rc2 = be_batch(b, q, v, 2, &ins);
        if (rc2 != OUTBOX_EINVAL)
            rc = rc2;
    }
    if (be_end(b, 1) != 0)
        goto out;
    status = rc == OUTBOX_EINVAL ? 0 : 1;
    printf("want=%s\n", want);
out:
    outbox_queue_free(q);
    return status;
}

/* ----------------------------------------------------------------- cases */

static int expect(int got, int want, const char *what)
{
    if (got == want)
        return 0;
    fprintf(stderr, "FAIL %s: got %d (%s), want %d (%s)\n", what, got, outbox_strerror(got),
            want, outbox_strerror(want));
    return 1;
}

static int run_case(be *b, const outbox_queue *q, const char *name, int argc, char **argv)
{
    const char *arg = argc > 0 ? argv[0] : NULL;
    int fails = 0;

    if (strcmp(name, "send_commit") == 0 || strcmp(name, "send_rollback") == 0) {
        outbox_message m = full_message(arg);
        if (be_begin(b) != 0)
            return 2;
        fails += expect(be_send(b, q, &m), OUTBOX_OK, "send");
        if (be_end(b, strcmp(name, "send_commit") == 0) != 0)
            return 2;
        return fails ? 1 : 0;
    }
    if (strcmp(name, "send_generated_id") == 0) {
        outbox_message m = simple_message(NULL);
        m.payload = NULL;
        m.payload_len = 0; /* empty body */
        if (be_begin(b) != 0)
            return 2;
        fails += expect(be_send(b, q, &m), OUTBOX_OK, "send");
        if (be_end(b, 1) != 0)
            return 2;
        return fails ? 1 : 0;
    }
    if (strcmp(name, "send_sizes") == 0) {
        /* argv: ID1 ID2 — a small and a large message in one transaction: the same
           statement must be sent with the same parameter types and sizes (the
           large one has 255-byte texts, headers over 4000 characters and a
           payload over 8000 bytes) */
        if (argc < 2)
            return 2;
        static char big_text[256], big_value[9001];
        static unsigned char big_payload[100000];
        memset(big_text, 'k', sizeof big_text - 1);
        memset(big_value, 'v', sizeof big_value - 1);
        for (size_t i = 0; i < sizeof big_payload; i++)
            big_payload[i] = (unsigned char)(i * 7);
        outbox_header big_headers[] = { { "big", big_value } };
        outbox_message small = simple_message(argv[0]);
        outbox_message big = simple_message(argv[1]);
        big.exchange = big.routing_key = big.partition_key = big_text;
        big.message_type = big.content_type = big.correlation_id = big_text;
        big.headers = big_headers;
        big.n_headers = 1;
        big.payload = big_payload;
        big.payload_len = sizeof big_payload;
        if (be_begin(b) != 0)
            return 2;
        fails += expect(be_send(b, q, &small), OUTBOX_OK, "small send");
        fails += expect(be_send(b, q, &big), OUTBOX_OK, "large send");
        if (be_end(b, 1) != 0)
            return 2;
        return fails ? 1 : 0;
    }
    if (strcmp(name, "duplicate_xact_abort") == 0) {
        /* argv: ID — SQL Server: a duplicate under the caller's SET XACT_ABORT ON is
           reported and leaves the transaction committable (and XACT_ABORT still on) */
        outbox_message m = simple_message(arg);
        if (!b->mssql) {
            fprintf(stderr, "duplicate_xact_abort: SQL Server only\n");
            return 2;
        }
        if (be_begin(b) != 0 || be_exec(b, "SET XACT_ABORT ON") != 0 ||
            be_exec(b, "INSERT INTO side_work VALUES (5)") != 0)
            return 2;
        fails += expect(be_send(b, q, &m), OUTBOX_OK, "first send");
        fails += expect(be_send(b, q, &m), OUTBOX_DUPLICATE, "second send");
        size_t ins = 0;
        outbox_message v[2] = { simple_message(NULL), m };
        fails += expect(be_batch(b, q, v, 2, &ins), OUTBOX_DUPLICATE, "batch with a duplicate");
        if (ins != 1) {
            fprintf(stderr, "FAIL: batch inserted %zu, want 1\n", ins);
            fails++;
        }
        /* the session's XACT_ABORT must still be on: a failing statement now dooms */
        if (be_exec(b, "IF (@@OPTIONS & 16384) = 0 THROW 50001, N'XACT_ABORT was turned off', 1;"
                       " INSERT INTO side_work VALUES (6)") != 0) {
            fprintf(stderr, "FAIL: the transaction is unusable, or XACT_ABORT was changed\n");
            fails++;
        }
        be_exec(b, "SET XACT_ABORT OFF");
        if (be_end(b, 1) != 0)
            return 1;
        return fails ? 1 : 0;
    }
    if (strcmp(name, "txn_lost") == 0) {
        /* argv: ID ROUTING_KEY [xact_abort] — SQL Server: the send's INSERT fails in a way
           that costs the caller its transaction (the test's trigger on the outbox raises
           or rolls back for that routing key): OUTBOX_ETXNLOST; the caller's earlier
           work (side_work 8) is gone after its rollback */
        if (argc < 2 || !b->mssql)
            return 2;
        outbox_message m = simple_message(argv[0]);
        m.routing_key = argv[1];
        int xa = argc > 2 && strcmp(argv[2], "xact_abort") == 0;
        if (be_begin(b) != 0 || (xa && be_exec(b, "SET XACT_ABORT ON") != 0) ||
            be_exec(b, "INSERT INTO side_work VALUES (8)") != 0)
            return 2;
        fails += expect(be_send(b, q, &m), OUTBOX_ETXNLOST, "send whose INSERT ends the transaction");
        size_t ins = 0;
        outbox_message v[2] = { simple_message(NULL), m };
        v[1].message_id = NULL;
        fails += expect(be_batch(b, q, v, 2, &ins), OUTBOX_ETXNLOST, "batch likewise");
        if (xa)
            be_exec(b, "SET XACT_ABORT OFF");
        be_end(b, 0);
        return fails ? 1 : 0;
    }
    if (strcmp(name, "batch_savepoint") == 0) {
        /* argv: N [lost] — SQL Server: a batch of N messages (several statements under a
           savepoint) whose last message is refused by the server (routing key "boom",
           a CHECK constraint the test adds): OUTBOX_EDB, nothing of the batch stays, the
           caller's transaction stays usable and commits its own work (side_work 9, 10);
           "lost": the engine ended the transaction instead (OUTBOX_ETXNLOST expected) */
        if (argc < 1 || !b->mssql)
            return 2;
        size_t n = strtoul(argv[0], NULL, 10);
        if (n < 2)
            return 2;
        outbox_message *v = calloc(n, sizeof *v);
        if (!v)
            return 2;
        for (size_t i = 0; i < n; i++)
            v[i] = simple_message(NULL);
        v[n - 1].routing_key = "boom";
        size_t ins = 0;
        int rc = 2;
        if (be_begin(b) == 0 && be_exec(b, "INSERT INTO side_work VALUES (9)") == 0) {
            int lost = argc > 1 && strcmp(argv[1], "lost") == 0;
            rc = be_batch(b, q, v, n, &ins);
            fails += expect(rc, lost ? OUTBOX_ETXNLOST : OUTBOX_EDB,
                            "batch refused in its last statement");
            if (ins != 0) {
                fprintf(stderr, "FAIL: inserted %zu after a failed batch, want 0\n", ins);
                fails++;
            }
            if (lost) {
                be_end(b, 0);
            } else {
                if (be_exec(b, "INSERT INTO side_work VALUES (10)") != 0) {
                    fprintf(stderr, "FAIL: the transaction is unusable after the batch failed\n");
                    fails++;
                }
                if (be_end(b, 1) != 0)
                    fails++;
            }
        }
        free(v);
        return rc == 2 ? 2 : fails ? 1 : 0;
    }
    if (strcmp(name, "batches") == 0) {
        /* argv: TOTAL PER — TOTAL messages in calls of PER, one transaction, committed */
        if (argc < 2)
            return 2;
        size_t total = strtoul(argv[0], NULL, 10), per = strtoul(argv[1], NULL, 10);
        if (per == 0 || total == 0)
            return 2;
        outbox_message *v = calloc(per, sizeof *v);
        char (*bodies)[32] = calloc(per, sizeof *bodies);
        if (!v || !bodies) {
            free(v);
            free(bodies);
            return 2;
        }
        if (be_begin(b) != 0) {
            free(v);
            free(bodies);
            return 2;
        }
        size_t sum = 0;
        for (size_t from = 0; from < total && !fails; from += per) {
            size_t k = total - from < per ? total - from : per, ins = 0;
            for (size_t i = 0; i < k; i++) {
                snprintf(bodies[i], sizeof bodies[i], "msg-%zu", from + i);
                v[i] = simple_message(NULL);
                v[i].payload = bodies[i];
                v[i].payload_len = strlen(bodies[i]);
            }
            fails += expect(be_batch(b, q, v, k, &ins), OUTBOX_OK, "batch");
            sum += ins;
        }
        if (be_end(b, 1) != 0)
            fails++;
        printf("total=%zu\n", sum);
        free(v);
        free(bodies);
        return fails ? 1 : 0;
    }
    if (strcmp(name, "no_txn") == 0) {
        outbox_message m = simple_message(arg);
        if (b->odbc && be_autocommit(b, 1) != 0)
            return 2;
        fails += expect(be_send(b, q, &m), OUTBOX_ENOTXN, "send outside a transaction");
        size_t ins;
        fails += expect(be_batch(b, q, &m, 1, &ins), OUTBOX_ENOTXN, "batch outside");
        return fails ? 1 : 0;
    }
    if (strcmp(name, "aborted_txn") == 0) {
        outbox_message m = simple_message(arg);
        if (be_begin(b) != 0)
            return 2;
        if (b->mssql) {
            /* the caller's work, then its statement failing under XACT_ABORT ON: the
               transaction is doomed, and rolled back when that batch ends (see
               test_mssql_transaction_lost_before_the_send: the send then succeeds in a
               new transaction, which the caller rolls back) */
            if (be_exec(b, "INSERT INTO side_work VALUES (12)") != 0)
                return 2;
            if (be_exec(b, "SET XACT_ABORT ON; BEGIN TRY DECLARE @x int = 1/0; "
                           "INSERT INTO side_work VALUES (@x); END TRY "
                           "BEGIN CATCH END CATCH; SET XACT_ABORT OFF;") != 0)
                fprintf(stderr, "(dooming the transaction reported an error)\n");
            be_exec(b, "SET XACT_ABORT OFF");
            fails += expect(be_send(b, q, &m), OUTBOX_OK, "send after the transaction was lost");
            be_end(b, 0);
            return fails ? 1 : 0;
        } else if (be_exec(b, "SELECT 1/0") == 0) {
            fprintf(stderr, "setup: SELECT 1/0 succeeded?\n");
            return 2;
        }
        fails += expect(be_send(b, q, &m), OUTBOX_ENOTXN, "send in an aborted transaction");
        be_end(b, 0);
        return fails ? 1 : 0;
    }
    if (strcmp(name, "dbname") == 0) {
        outbox_message m = simple_message(arg);
        if (be_begin(b) != 0)
            return 2;
        fails += expect(be_send(b, q, &m), OUTBOX_EDBNAME, "send");
        size_t ins;
        fails += expect(be_batch(b, q, &m, 1, &ins), OUTBOX_EDBNAME, "batch");
        if (be_end(b, 1) != 0)
            return 2;
        return fails ? 1 : 0;
    }
    if (strcmp(name, "duplicate") == 0) {
        /* argv: ID; the table side_work(x int) exists */
        outbox_message m = simple_message(arg);
        if (be_begin(b) != 0 || be_exec(b, "INSERT INTO side_work VALUES (1)") != 0)
            return 2;
        fails += expect(be_send(b, q, &m), OUTBOX_OK, "first send");
        fails += expect(be_send(b, q, &m), OUTBOX_DUPLICATE, "second send");
        if (be_exec(b, "INSERT INTO side_work VALUES (2)") != 0) {
            fprintf(stderr, "FAIL: the transaction is unusable after a duplicate\n");
            fails++;
        }
        if (be_end(b, 1) != 0)
            return 1;
        return fails ? 1 : 0;
    }
    if (strcmp(name, "batch_dup") == 0) {
        /* argv: A B EXISTING — batch [A, B, A, EXISTING] → 2 inserted */
        if (argc < 3)
            return 2;
        outbox_message v[4] = { simple_message(argv[0]), simple_message(argv[1]),
                                simple_message(argv[0]), simple_message(argv[2]) };
        size_t ins = 0;
        if (be_begin(b) != 0 || be_exec(b, "INSERT INTO side_work VALUES (3)") != 0)
            return 2;
        fails += expect(be_batch(b, q, v, 4, &ins), OUTBOX_DUPLICATE, "batch");
        if (ins != 2) {
            fprintf(stderr, "FAIL: inserted %zu, want 2\n", ins);
            fails++;
        }
        if (be_exec(b, "INSERT INTO side_work VALUES (4)") != 0)
            fails++;
        if (be_end(b, 1) != 0)
            return 1;
        return fails ? 1 : 0;
    }
    if (strcmp(name, "batch") == 0) {
        /* argv: N commit|rollback [boom] — boom: the last message's routing key is "boom" */
        if (argc < 2)
            return 2;
        size_t n = strtoul(argv[0], NULL, 10);
        int commit = strcmp(argv[1], "commit") == 0;
        int boom = argc > 2 && strcmp(argv[2], "boom") == 0;
        outbox_message *v = calloc(n ? n : 1, sizeof *v);
        char (*bodies)[32] = calloc(n ? n : 1, sizeof *bodies);
        char (*keys)[16] = calloc(n ? n : 1, sizeof *keys);
        if (!v || !bodies || !keys) {
            free(v); free(bodies); free(keys);
            return 2;
        }
        for (size_t i = 0; i < n; i++) {
            snprintf(bodies[i], sizeof bodies[i], "msg-%zu", i);
            snprintf(keys[i], sizeof keys[i], "p%zu", i % 10);
            v[i] = simple_message(NULL);
            v[i].payload = bodies[i];
            v[i].payload_len = strlen(bodies[i]);
            v[i].partition_key = keys[i];
        }
        if (boom && n)
            v[n - 1].routing_key = "boom";
        size_t ins = 0;
        int rc = 2;
        if (be_begin(b) == 0) {
            rc = be_batch(b, q, v, n, &ins);
            if (boom) {
                fails += expect(rc, OUTBOX_EDB, "batch with a failing row");
            } else {
                fails += expect(rc, OUTBOX_OK, "batch");
                if (ins != n) {
                    fprintf(stderr, "FAIL: inserted %zu, want %zu\n", ins, n);
                    fails++;
                }
            }
            if (be_end(b, commit) != 0)
                fails++;
        }
        free(v);
        free(bodies);
        free(keys);
        return rc == 2 ? 2 : fails ? 1 : 0;
    }
    if (strcmp(name, "noschema") == 0) {
        outbox_message m = simple_message(NULL);
        if (be_begin(b) != 0)
            return 2;
        fails += expect(be_send(b, q, &m), OUTBOX_ENOSCHEMA, "send");
        be_end(b, 0);
        return fails ? 1 : 0;
    }
    if (strcmp(name, "server_error") == 0 || strcmp(name, "server_error_batch") == 0) {
        outbox_message v[3] = { simple_message(NULL), simple_message(NULL),
                                simple_message(NULL) };
        size_t ins;
        if (be_begin(b) != 0)
            return 2;
        int rc = strcmp(name, "server_error") == 0 ? be_send(b, q, v) : be_batch(b, q, v, 3,
                                                                                   &ins);
        fails += expect(rc, OUTBOX_EDB, "send");
        be_end(b, 0);
        return fails ? 1 : 0;
    }
    if (strcmp(name, "ddl") == 0) {
        /* applies the DDL for the queue's table through this connection, autocommit */
        outbox_table_name t;
        char why[200];
        if (outbox_table_parse(getenv("OUTBOX_TEST_TABLE"), &t, why, sizeof why) != 0) {
            fprintf(stderr, "%s\n", why);
            return 2;
        }
        char **ddl = outbox_ddl(b->mssql ? OUTBOX_DIALECT_SQLSERVER : OUTBOX_DIALECT_POSTGRES,
                                &t);
        if (!ddl)
            return 2;
        if (b->odbc)
            be_autocommit(b, 1);
        for (char **p = ddl; *p; p++)
            if (be_exec(b, *p) != 0)
                fails++;
        outbox_ddl_free(ddl);
        return fails ? 1 : 0;
    }
    if (strcmp(name, "sql") == 0) {
        /* prints the first column of the first row of argv[0] (autocommit) */
        if (!arg)
            return 2;
        if (!b->odbc) {
            PGresult *r = PQexec(b->pg, arg);
            int ok = PQresultStatus(r) == PGRES_TUPLES_OK || PQresultStatus(r) ==
                     PGRES_COMMAND_OK;
            if (ok && PQntuples(r) > 0)
                printf("value=%s\n", PQgetvalue(r, 0, 0));
            if (!ok)
                fprintf(stderr, "%s", PQresultErrorMessage(r));
            PQclear(r);
            return ok ? 0 : 1;
        }
        be_autocommit(b, 1);
        SQLHSTMT st;
        if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_STMT, b->dbc, &st)))
            return 2;
        int ok = SQL_SUCCEEDED(SQLExecDirect(st, (SQLCHAR *)arg, SQL_NTS));
        if (!ok)
            odbc_diag(SQL_HANDLE_STMT, st, arg);
        else {
            char buf[4096];
            SQLLEN ind;
            do {
                SQLSMALLINT cols = 0;
                SQLNumResultCols(st, &cols);
                if (cols > 0) {
                    if (SQL_SUCCEEDED(SQLFetch(st)) &&
                        SQL_SUCCEEDED(SQLGetData(st, 1, SQL_C_CHAR, buf, sizeof buf, &ind)))
                        printf("value=%s\n", ind == SQL_NULL_DATA ? "NULL" : buf);
                    break;
                }
            } while (SQL_SUCCEEDED(SQLMoreResults(st)));
        }
        SQLFreeHandle(SQL_HANDLE_STMT, st);
        return ok ? 0 : 1;
    }
    fprintf(stderr, "unknown case %s\n", name);
    return 2;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s pg|odbc CONNSTR QUEUE_DB CASE [ARG...]\n", argv[0]);
        return 2;
    }
    const char *table = getenv("OUTBOX_TEST_TABLE");
    be b;
    if (be_connect(&b, argv[1], argv[2]) != 0) {
        be_close(&b);
        return 2;
    }
    int status;
    if (strcmp(argv[4], "invalid") == 0) {
        status = argc > 5 ? case_invalid(&b, argv[3], table, argv[5]) : 2;
    } else {
        outbox_queue *q = NULL;
        outbox_error e;
        if (outbox_queue_new(&q, argv[3], table, &e) != OUTBOX_OK) {
            fprintf(stderr, "queue: %s\n", e.message);
            be_close(&b);
            return 2;
        }
        status = run_case(&b, q, argv[4], argc - 5, argv + 5);
        outbox_queue_free(q);
    }
    be_close(&b);
    return status;
}
