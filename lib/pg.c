/*
 * pg.c — liboutbox over libpq: one INSERT ... ON CONFLICT DO NOTHING per
 * call (several in one pipeline when a batch exceeds libpq's parameter
 * limit), inside the caller's transaction, exactly one attempt. The INSERT is
 * outbox_pg_insert_sql's (lib/pgsql.c), shared with the psqlODBC path.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>

#include "outbox.h"
#include "outbox_internal.h"
#include "outbox_pg.h"
#include "outbox_pgsql.h"

#define PG_COLS        OUTBOX_PG_INSERT_COLS
#define PG_MAX_PARAMS  65535
#define PG_CHUNK_ROWS  (PG_MAX_PARAMS / PG_COLS)
/* how long a non-blocking caller's connection may take to flush the pipeline */
#define PG_FLUSH_TIMEOUT_MS 60000

typedef struct pg_params {
    const char **values;  /* owned array; strings borrowed from messages */
    int         *lengths; /* owned */
    int         *formats; /* owned */
    char        *delays;  /* owned: 24 bytes per message */
} pg_params;

static void params_free(pg_params *p)
{
    free(p->values);
    free(p->lengths);
    free(p->formats);
    free(p->delays);
}

/* Maps a failed result to a status code and message. */
static int pg_fail(const PGresult *res, PGconn *c, const outbox_queue *q, outbox_error *err)
{
    const char *state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    const char *text = res ? PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY) : NULL;
    if (!text || !text[0])
        text = res ? PQresultErrorMessage(res) : NULL;
    if (!text || !text[0])
        text = PQerrorMessage(c);
    if (!text || !text[0])
        text = "no error text";
    if (state && (strcmp(state, "42P01") == 0 || strcmp(state, "3F000") == 0))
        return outbox_i_err(err, OUTBOX_ENOSCHEMA, state,
                            "outbox table %s does not exist: run outbox-relay init "
                            "(server: %s)", q->pg_table, text);
    if (state && strcmp(state, "25P02") == 0)
        return outbox_i_err(err, OUTBOX_ENOTXN, state,
                            "the transaction is aborted: roll it back (server: %s)", text);
    if (state && state[0])
        return outbox_i_err(err, OUTBOX_EDB, state, "INSERT into %s failed: SQLSTATE %s: %s",
                            q->pg_table, state, text);
    return outbox_i_err(err, OUTBOX_EDB, NULL, "INSERT into %s failed: %s", q->pg_table,
                        text);
}

static int fill_params(pg_params *p, outbox_i_msg *const *u, size_t nu)
{
    size_t np = nu * PG_COLS;
    p->values = calloc(np, sizeof *p->values);
    p->lengths = calloc(np, sizeof *p->lengths);
    p->formats = calloc(np, sizeof *p->formats);
    p->delays = calloc(nu, 24);
    if (!p->values || !p->lengths || !p->formats || !p->delays)
        return -1;
    for (size_t i = 0; i < nu; i++) {
        const outbox_i_msg *v = u[i];
        const outbox_message *m = v->m;
        const char **val = p->values + i * PG_COLS;
        int *len = p->lengths + i * PG_COLS;
        int *fmt = p->formats + i * PG_COLS;
        char *d = p->delays + i * 24;
        snprintf(d, 24, "%" PRIu64, v->delay_ms);
        val[0] = v->message_id;
        val[1] = m->exchange ? m->exchange : "";
        val[2] = m->routing_key;
        val[3] = m->partition_key;
        val[4] = m->message_type;
        val[5] = m->content_type;
        val[6] = m->correlation_id;
        val[7] = v->headers_json;
        val[8] = m->payload_len ? (const char *)m->payload : "";
        val[9] = d;
        fmt[8] = 1; /* binary: NUL bytes intact */
        len[8] = (int)m->payload_len;
    }
    return 0;
}

/* Non-blocking callers: push the whole pipeline out, bounded in time. */
static int flush_all(PGconn *c)
{
    int waited = 0;
    for (;;) {
        int f = PQflush(c);
        if (f == 0)
            return 0;
        if (f < 0 || waited >= PG_FLUSH_TIMEOUT_MS)
            return -1;
        struct pollfd pfd = { .fd = PQsocket(c), .events = POLLOUT | POLLIN };
        int r = poll(&pfd, 1, 100);
        if (r < 0 && errno != EINTR)
            return -1;
        waited += 100;
        if (r > 0 && (pfd.revents & POLLIN) && !PQconsumeInput(c))
            return -1;
    }
}

static int send_pipeline(PGconn *c, const outbox_queue *q, const pg_params *p, size_t nu,
                         size_t *total, outbox_error *err)
{
    int rc = OUTBOX_OK;
    if (!PQenterPipelineMode(c))
        return outbox_i_err(err, OUTBOX_EDB, NULL, "cannot enter pipeline mode: %s",
                            PQerrorMessage(c));
    for (size_t from = 0; from < nu; from += PG_CHUNK_ROWS) {
        size_t rows = nu - from < PG_CHUNK_ROWS ? nu - from : PG_CHUNK_ROWS;
        char *sql = outbox_pg_insert_sql(q->pg_table, rows);
        if (!sql) {
            rc = outbox_i_err(err, OUTBOX_ENOMEM, NULL, "out of memory building the INSERT");
            break;
        }
        size_t k = from * PG_COLS;
        int ok = PQsendQueryParams(c, sql, (int)(rows * PG_COLS), NULL, p->values + k,
                                   p->lengths + k, p->formats + k, 0);
        free(sql);
        if (!ok) {
            rc = outbox_i_err(err, OUTBOX_EDB, NULL, "sending the INSERT failed: %s",
                              PQerrorMessage(c));
            break;
        }
    }
    if (!PQpipelineSync(c) || flush_all(c) != 0) {
        if (rc == OUTBOX_OK)
            rc = outbox_i_err(err, OUTBOX_EDB, NULL, "sending the pipeline failed: %s",
                              PQerrorMessage(c));
        PQexitPipelineMode(c);
        return rc;
    }
    int nulls = 0;
    for (;;) {
        PGresult *r = PQgetResult(c);
        if (!r) {
            if (++nulls >= 2 || PQstatus(c) != CONNECTION_OK)
                break;
            continue;
        }
        nulls = 0;
        ExecStatusType st = PQresultStatus(r);
        if (st == PGRES_PIPELINE_SYNC) {
            PQclear(r);
            break;
        }
        if (st == PGRES_COMMAND_OK) {
            *total += (size_t)strtoull(PQcmdTuples(r), NULL, 10);
        } else if (st != PGRES_PIPELINE_ABORTED && rc == OUTBOX_OK) {
            rc = pg_fail(r, c, q, err);
        }
        PQclear(r);
    }
    if (!PQexitPipelineMode(c) && rc == OUTBOX_OK)
        rc = outbox_i_err(err, OUTBOX_EDB, NULL, "cannot leave pipeline mode: %s",
                          PQerrorMessage(c));
    return rc;
}

static int pg_send(PGconn *c, const outbox_queue *q, const outbox_message *m, size_t n,
                   int batch, size_t *inserted, outbox_error *err)
{
    outbox_i_msg *v = NULL;
    outbox_i_msg **u = NULL;
    pg_params p = { 0 };
    char *sql = NULL;
    size_t nu = 0, total = 0;
    int rc;

    outbox_i_err_clear(err);
    if (inserted)
        *inserted = 0;
    if (!c)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "c: NULL connection");
    rc = outbox_i_prepare(q, m, n, batch, &v, &nu, err);
    if (rc != OUTBOX_OK)
        return rc;

    if (PQpipelineStatus(c) != PQ_PIPELINE_OFF) {
        rc = outbox_i_err(err, OUTBOX_EINVAL, NULL, "c: connection is in pipeline mode");
        goto fail;
    }
    PGTransactionStatusType ts = PQtransactionStatus(c);
    if (ts != PQTRANS_INTRANS) {
        const char *why = ts == PQTRANS_IDLE     ? "no transaction is open (BEGIN first)"
                        : ts == PQTRANS_INERROR  ? "the transaction is aborted (roll it back)"
                        : ts == PQTRANS_ACTIVE   ? "a command is in progress on the connection"
                                                 : "the connection is bad";
        rc = outbox_i_err(err, OUTBOX_ENOTXN, NULL, "not inside an open transaction: %s; "
                          "nothing written", why);
        goto fail;
    }
    rc = outbox_i_check_dbname(q, PQdb(c), err);
    if (rc != OUTBOX_OK)
        goto fail;
    if (nu == 0)
        goto done;
    rc = outbox_i_unique(v, n, nu, &u, err);
    if (rc != OUTBOX_OK)
        goto fail;
    if (fill_params(&p, u, nu) != 0) {
        rc = outbox_i_err(err, OUTBOX_ENOMEM, NULL, "out of memory (%zu messages)", n);
        goto fail;
    }

    if (nu <= PG_CHUNK_ROWS) {
        sql = outbox_pg_insert_sql(q->pg_table, nu);
        if (!sql) {
            rc = outbox_i_err(err, OUTBOX_ENOMEM, NULL, "out of memory building the INSERT");
            goto fail;
        }
        PGresult *res = PQexecParams(c, sql, (int)(nu * PG_COLS), NULL, p.values, p.lengths,
                                     p.formats, 0);
        if (PQresultStatus(res) != PGRES_COMMAND_OK) {
            rc = pg_fail(res, c, q, err);
            PQclear(res);
            goto fail;
        }
        total = (size_t)strtoull(PQcmdTuples(res), NULL, 10);
        PQclear(res);
    } else {
        rc = send_pipeline(c, q, &p, nu, &total, err);
        if (rc != OUTBOX_OK)
            goto fail;
    }

done:
    if (inserted)
        *inserted = total;
    rc = outbox_i_sent(err, v, n, total, batch, q->pg_table);
fail:
    free(sql);
    params_free(&p);
    free(u);
    outbox_i_msgs_free(v, n);
    return rc;
}

int outbox_pg_send(PGconn *c, const outbox_queue *q, const outbox_message *m,
                   outbox_error *err)
{
    return pg_send(c, q, m, 1, 0, NULL, err);
}

int outbox_pg_send_batch(PGconn *c, const outbox_queue *q, const outbox_message *m,
                         size_t n, size_t *inserted, outbox_error *err)
{
    return pg_send(c, q, m, n, 1, inserted, err);
}
