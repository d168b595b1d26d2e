/*
 * producer.c — writes messages into the outbox through liboutbox, the way an
 * application would: BEGIN; ...its own work...; outbox_pg_send_batch(); COMMIT.
 * Used by the README demo, the integration tests and the benchmark.
 *
 *   producer [--odbc] --dsn DSN --database DB [--table S.T] [--count N]
 *            [--keys K] [--exchange X] [--routing-key R] [--size BYTES]
 *            [--batch B] [--prefix P] [--start I] [--trace] [--json]
 *
 * Message i (I <= i < I+N): partition_key "key-<i mod K>" (none when K = 0),
 * message_type "test.event", content_type "application/octet-stream",
 * correlation_id "corr-<i>", headers {"seq": "<i>", "origin": "producer"},
 * payload "<prefix>|<i>|" followed by bytes (i + j) mod 256 — NULs included —
 * up to BYTES (at least the text part): the tests check every byte of it.
 * With --json the payload is instead a JSON object a person can read,
 * {"event":"<prefix>","seq":<i>,"key":"key-<i mod K>","text":"message <i> of
 * <prefix>"} (no "key" when K = 0), message_type "<prefix>", content_type
 * "application/json", and BYTES is ignored. With --trace each message also carries
 * the W3C trace context an application would take from its current span:
 * "traceparent" 00-<trace-id i+1, 32 hex>-<parent-id i+1, 16 hex>-01 and
 * "tracestate" "producer=<i>"; the relay forwards both as AMQP headers.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>
#include <sql.h>
#include <sqlext.h>

#include "outbox.h"
#include "outbox_odbc.h"
#include "outbox_pg.h"

typedef struct opts {
    const char *dsn, *database, *table, *exchange, *routing_key, *prefix;
    long count, keys, size, batch, start;
    int odbc, trace, json;
} opts;

typedef struct msgbuf {
    outbox_message m;
    outbox_header  h[4];
    char key[32], corr[32], seq[32], tp[64], ts[40];
    unsigned char *payload;
} msgbuf;

/* The payload buffer holds BYTES + PAYLOAD_SLACK bytes: room for the text part of a binary
 * payload and for a whole --json payload (the prefix is limited to fit). */
#define PAYLOAD_SLACK 256
#define PREFIX_MAX 64

/* A prefix goes into the JSON payload as is: no quote, backslash or control character. */
static int json_plain(const char *s)
{
    for (; *s != '\0'; s++)
        if ((unsigned char)*s < 0x20 || *s == '"' || *s == '\\')
            return 0;
    return 1;
}

static size_t fill_json(const opts *o, long i, msgbuf *b)
{
    char key[48] = "";
    if (o->keys)
        snprintf(key, sizeof key, "\"key\":\"%s\",", b->key);
    int n = snprintf((char *)b->payload, (size_t)o->size + PAYLOAD_SLACK,
                     "{\"event\":\"%s\",\"seq\":%ld,%s\"text\":\"message %ld of %s\"}",
                     o->prefix, i, key, i, o->prefix);
    return n > 0 ? (size_t)n : 0;
}

static void fill(const opts *o, long i, msgbuf *b)
{
    memset(&b->m, 0, sizeof b->m);
    snprintf(b->key, sizeof b->key, "key-%ld", o->keys ? i % o->keys : 0);
    size_t len;
    if (o->json) {
        len = fill_json(o, i, b);
    } else {
        int n = snprintf((char *)b->payload, (size_t)o->size + PAYLOAD_SLACK, "%s|%ld|", o->prefix, i);
        len = n > 0 ? (size_t)n : 0;
        for (size_t j = len; j < (size_t)o->size; j++)
            b->payload[j] = (unsigned char)((i + (long)j) % 256);
        if ((size_t)o->size > len)
            len = (size_t)o->size;
    }
    snprintf(b->corr, sizeof b->corr, "corr-%ld", i);
    snprintf(b->seq, sizeof b->seq, "%ld", i);
    b->h[0] = (outbox_header){ "seq", b->seq };
    b->h[1] = (outbox_header){ "origin", "producer" };
    b->m.exchange = o->exchange;
    b->m.routing_key = o->routing_key;
    b->m.payload = b->payload;
    b->m.payload_len = len;
    b->m.partition_key = o->keys ? b->key : NULL;
    b->m.message_type = o->json ? o->prefix : "test.event";
    b->m.content_type = o->json ? "application/json" : "application/octet-stream";
    b->m.correlation_id = b->corr;
    b->m.headers = b->h;
    b->m.n_headers = 2;
    if (o->trace) {
        snprintf(b->tp, sizeof b->tp, "00-%032lx-%016lx-01", i + 1, i + 1);
        snprintf(b->ts, sizeof b->ts, "producer=%ld", i);
        b->h[2] = (outbox_header){ "traceparent", b->tp };
        b->h[3] = (outbox_header){ "tracestate", b->ts };
        b->m.n_headers = 4;
    }
}

static int run_pg(const opts *o, const outbox_queue *q, msgbuf *bufs, outbox_message *msgs)
{
    PGconn *c = PQconnectdb(o->dsn);
    if (PQstatus(c) != CONNECTION_OK) {
        fprintf(stderr, "producer: connect: %s", PQerrorMessage(c));
        PQfinish(c);
        return 1;
    }
    int rc = 0;
    for (long done = 0; done < o->count && rc == 0;) {
        long n = o->count - done < o->batch ? o->count - done : o->batch;
        for (long k = 0; k < n; k++) {
            fill(o, o->start + done + k, &bufs[k]);
            msgs[k] = bufs[k].m;
        }
        PGresult *r = PQexec(c, "BEGIN");
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            fprintf(stderr, "producer: BEGIN: %s", PQerrorMessage(c));
            PQclear(r);
            rc = 1;
            break;
        }
        PQclear(r);
        size_t ins = 0;
        outbox_error err;
        int s = outbox_pg_send_batch(c, q, msgs, (size_t)n, &ins, &err);
        if (s < 0) {
            fprintf(stderr, "producer: send: %s (%s) %s\n", outbox_strerror(s), err.sqlstate, err.message);
            r = PQexec(c, "ROLLBACK");
            PQclear(r);
            rc = 1;
            break;
        }
        r = PQexec(c, "COMMIT");
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            fprintf(stderr, "producer: COMMIT: %s", PQerrorMessage(c));
            rc = 1;
        }
        PQclear(r);
        done += n;
    }
    PQfinish(c);
    return rc;
}

static void odbc_err(const char *what, SQLSMALLINT type, SQLHANDLE h)
{
    SQLCHAR state[6] = "", msg[512] = "";
    SQLINTEGER native = 0;
    SQLSMALLINT len = 0;
    if (SQL_SUCCEEDED(SQLGetDiagRec(type, h, 1, state, &native, msg, sizeof msg, &len)))
        fprintf(stderr, "producer: %s: %s %s\n", what, state, msg);
    else
        fprintf(stderr, "producer: %s failed\n", what);
}

static int run_odbc(const opts *o, const outbox_queue *q, msgbuf *bufs, outbox_message *msgs)
{
    SQLHENV env = SQL_NULL_HENV;
    SQLHDBC dbc = SQL_NULL_HDBC;
    int rc = 1;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_ENV, SQL_NULL_HANDLE, &env)) ||
        !SQL_SUCCEEDED(SQLSetEnvAttr(env, SQL_ATTR_ODBC_VERSION, (SQLPOINTER)SQL_OV_ODBC3, 0)) ||
        !SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_DBC, env, &dbc))) {
        fprintf(stderr, "producer: ODBC allocation failed\n");
        goto out;
    }
    SQLSetConnectAttr(dbc, SQL_ATTR_LOGIN_TIMEOUT, (SQLPOINTER)10, 0);
    if (!SQL_SUCCEEDED(SQLDriverConnect(dbc, NULL, (SQLCHAR *)o->dsn, SQL_NTS, NULL, 0, NULL,
                                        SQL_DRIVER_NOPROMPT))) {
        odbc_err("connect", SQL_HANDLE_DBC, dbc);
        goto out;
    }
    if (!SQL_SUCCEEDED(SQLSetConnectAttr(dbc, SQL_ATTR_AUTOCOMMIT, (SQLPOINTER)SQL_AUTOCOMMIT_OFF, 0))) {
        odbc_err("autocommit off", SQL_HANDLE_DBC, dbc);
        goto disconnect;
    }
    rc = 0;
    for (long done = 0; done < o->count && rc == 0;) {
        long n = o->count - done < o->batch ? o->count - done : o->batch;
        for (long k = 0; k < n; k++) {
            fill(o, o->start + done + k, &bufs[k]);
            msgs[k] = bufs[k].m;
        }
        size_t ins = 0;
        outbox_error err;
        int s = outbox_odbc_send_batch(dbc, q, msgs, (size_t)n, &ins, &err);
        if (s < 0) {
            fprintf(stderr, "producer: send: %s (%s) %s\n", outbox_strerror(s), err.sqlstate, err.message);
            SQLEndTran(SQL_HANDLE_DBC, dbc, SQL_ROLLBACK);
            rc = 1;
            break;
        }
        if (!SQL_SUCCEEDED(SQLEndTran(SQL_HANDLE_DBC, dbc, SQL_COMMIT))) {
            odbc_err("commit", SQL_HANDLE_DBC, dbc);
            rc = 1;
        }
        done += n;
    }
disconnect:
    SQLDisconnect(dbc);
out:
    if (dbc != SQL_NULL_HDBC)
        SQLFreeHandle(SQL_HANDLE_DBC, dbc);
    if (env != SQL_NULL_HENV)
        SQLFreeHandle(SQL_HANDLE_ENV, env);
    return rc;
}

int main(int argc, char **argv)
{
    opts o = { .table = "outbox.messages", .exchange = "", .routing_key = "outbox-demo",
               .prefix = "msg", .count = 10, .keys = 3, .size = 0, .batch = 100 };
    static const struct option lo[] = {
        { "dsn", required_argument, NULL, 'd' },  { "database", required_argument, NULL, 'D' },
        { "table", required_argument, NULL, 't' }, { "count", required_argument, NULL, 'n' },
        { "keys", required_argument, NULL, 'k' },  { "exchange", required_argument, NULL, 'x' },
        { "routing-key", required_argument, NULL, 'r' }, { "size", required_argument, NULL, 's' },
        { "batch", required_argument, NULL, 'b' }, { "prefix", required_argument, NULL, 'p' },
        { "start", required_argument, NULL, 'S' }, { "odbc", no_argument, NULL, 'o' },
        { "trace", no_argument, NULL, 'T' }, { "json", no_argument, NULL, 'J' },
        { NULL, 0, NULL, 0 },
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (ch) {
        case 'd': o.dsn = optarg; break;
        case 'D': o.database = optarg; break;
        case 't': o.table = optarg; break;
        case 'n': o.count = atol(optarg); break;
        case 'k': o.keys = atol(optarg); break;
        case 'x': o.exchange = optarg; break;
        case 'r': o.routing_key = optarg; break;
        case 's': o.size = atol(optarg); break;
        case 'b': o.batch = atol(optarg); break;
        case 'p': o.prefix = optarg; break;
        case 'S': o.start = atol(optarg); break;
        case 'o': o.odbc = 1; break;
        case 'T': o.trace = 1; break;
        case 'J': o.json = 1; break;
        default: return 2;
        }
    }
    if (o.dsn == NULL || o.database == NULL || o.count < 0 || o.batch < 1 || o.size < 0 ||
        o.keys < 0 || o.size > 64L * 1024 * 1024 || strlen(o.prefix) > PREFIX_MAX ||
        (o.json && !json_plain(o.prefix))) {
        fprintf(stderr, "usage: producer [--odbc] --dsn DSN --database DB [--table S.T] [--count N] "
                        "[--keys K] [--exchange X] [--routing-key R] [--size BYTES] [--batch B] "
                        "[--prefix P] [--start I] [--trace] [--json]\n"
                        "  (--prefix: at most 64 bytes; with --json no quote, backslash or control character)\n");
        return 2;
    }
    outbox_queue *q = NULL;
    outbox_error err;
    if (outbox_queue_new(&q, o.database, o.table, &err) != OUTBOX_OK) {
        fprintf(stderr, "producer: %s\n", err.message);
        return 1;
    }
    msgbuf *bufs = calloc((size_t)o.batch, sizeof *bufs);
    outbox_message *msgs = calloc((size_t)o.batch, sizeof *msgs);
    int rc = 1;
    if (bufs == NULL || msgs == NULL)
        goto out;
    for (long k = 0; k < o.batch; k++)
        if ((bufs[k].payload = malloc((size_t)o.size + PAYLOAD_SLACK)) == NULL)
            goto out;
    rc = o.odbc ? run_odbc(&o, q, bufs, msgs) : run_pg(&o, q, bufs, msgs);
    if (rc == 0)
        printf("producer: %ld message(s) committed to %s\n", o.count, o.table);
out:
    if (bufs != NULL)
        for (long k = 0; k < o.batch; k++)
            free(bufs[k].payload);
    free(bufs);
    free(msgs);
    outbox_queue_free(q);
    return rc;
}
