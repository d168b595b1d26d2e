/*
 * source_contract.c — drives any outbox source through relay/source.h's ops
 * table, for tests/test_source_contract.py: the same commands and the same
 * output whatever the backend, so each behaviour of the interface is written
 * once and run against every source.
 *
 *   source_contract --backend postgres|odbc [options]
 *     postgres: sources/pg (libpq); odbc: sources/odbc (psqlODBC or msodbcsql;
 *     the dialect follows the connected DBMS). The ops come from the source
 *     registered under that name with config/, as in the relay.
 * options: --conninfo S --database D --table S.T --on-sent mark|delete
 *          --password P --name N --query-timeout MS --connect-timeout MS
 *          --reconnect-max MS
 *          --table2 S.T   a second source of the same backend on the same loop,
 *                         on another table (same connection settings)
 *
 * Commands, one per line on stdin; "2 " before a command addresses the second
 * source, and every line that source's command or callbacks print starts with
 * "2 " too (dead-list rows excepted):
 *   start | stop (destroy the source; prints STOPPED ms=N)
 *   lead OWNER [EPOCH [LEASE_MS]]
 *   claim MAX LEASE_MS TOKEN OWNER [EPOCH [competing]] [bytes=N [whole]] [maxpay=N]
 *         [held=ID,ID...] [lost=TOKEN,TOKEN...]
 *               bytes=N: the claim's byte limit (src_claim_args.max_bytes), whole:
 *               its first row whatever its size (first_whole); maxpay=N: payloads
 *               larger than N bytes stay in the database (max_payload; the row prints
 *               "withheld":SIZE); held: the ids the claim may pass over (held, at most
 *               64); lost: tokens of claims that failed without an answer (lost, at
 *               most 16)
 *   caps        prints CAPS claims_bytes=0|1 (the source honours a byte limit)
 *   drain BATCH LEASE_MS TOKEN OWNER    claim until a claim returns nothing
 *   settle ID:TOKEN:KIND:BACKOFF_MS[:REASON_HEX] ...  (KIND S sent, R retry,
 *                                       D dead, U unclaim; no REASON_HEX: NULL)
 *   cleanup RETENTION_MS LIMIT [OWNER EPOCH]
 *   stats
 *   admin check | init | stats | dead-list | dead-retry [ID...] | dead-purge [ID...]
 * and for the process (no prefix):
 *   quit | ticks
 *   sql HEX     runs the SQL text HEX (hex of its UTF-8) on the driver's own
 *               autocommit session, opened on first use from --conninfo through
 *               the backend's client (libpq, or ODBC through SQLExecDirectW): test
 *               setup where the test has no client of its own (SQL Server). It
 *               blocks the loop while it runs.
 * Output lines (TEXT: '\' and newlines escaped as \\ and \n):
 *   READY <ops name> | STATE UP | STATE DOWN TEXT | WAKE <unix us> | ACCEPT <rc>
 *   ROW {json}            (each claimed row, before its DONE claim line)
 *   DONE <req> ok=N ms=N ticks=N [fields] [error=TEXT]
 *   DRAINED n=N ids=1,2,3 [error=TEXT]
 *   TICKS n | STOPPED ms=N
 *   ADMIN <cmd> rc=N [fields] [error=TEXT]   (dead-list rows come before it)
 *   SQLROW COL...         each row of each result: a column is the hex of its
 *                         text, ~ when empty, - when NULL
 *   SQLDONE rc=N rows=N [error=TEXT]   rows: rows returned plus rows affected
 *   ERR <text>            (a malformed command)
 * A 50 ms timer runs on the loop the whole time: "ticks" tells how often the
 * loop ran while a request was outstanding.
 */
#include <ev.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <libpq-fe.h>
#include <sql.h>
#include <sqlext.h>
#include "config/cfg.h"
#include "lib/outbox_schema.h"
#include "lib/outbox_util.h"
#include "relay/row.h"
#include "relay/source.h"
#include "sources/sources.h"

typedef struct app app;

/* one source on the loop, and the request it has outstanding */
typedef struct slot {
    app *a;
    const char *tag;       /* printed before each of its lines: "" or "2 " */
    cfg_outbox ob;
    source *src;
    long req_ticks;
    int64_t req_t0;
    /* drain */
    int draining;
    src_claim_args drain;
    char drain_owner[256];
    int64_t *drained;
    size_t n_drained, cap_drained;
} slot;

struct app {
    struct ev_loop *loop;
    const source_ops *ops;
    slot s[2];
    size_t n_slots;
    ev_io in;
    ev_timer tick;
    long ticks;
    char buf[1 << 20];
    size_t len;
    /* the `sql` session: one of these, by backend */
    PGconn *pg;
    SQLHENV env;
    SQLHDBC dbc;
};

/* "ID,ID,..." (at most max of them) into out; returns how many. */
static size_t id_list(const char *p, int64_t *out, size_t max)
{
    size_t n = 0;
    while (n < max) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p)
            break;
        out[n++] = v;
        p = end + (*end == ',');
    }
    return n;
}

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t realtime_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void put_text(const char *s)
{
    for (; s && *s; s++) {
        if (*s == '\\')
            fputs("\\\\", stdout);
        else if (*s == '\n')
            fputs("\\n", stdout);
        else if (*s == '\r')
            fputs("\\r", stdout);
        else
            putchar(*s);
    }
}

/* " HEX", " ~" (empty) or " -" (NULL): one column of an SQLROW line */
static void put_col(const void *p, size_t n, int isnull)
{
    const unsigned char *b = p;
    putchar(' ');
    if (isnull) {
        putchar('-');
        return;
    }
    if (n == 0)
        putchar('~');
    for (size_t i = 0; i < n; i++)
        printf("%02x", b[i]);
}

static void json_str(const char *s, size_t n)
{
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static void json_opt(const char *key, const char *v)
{
    printf(",\"%s\":", key);
    if (v)
        json_str(v, strlen(v));
    else
        fputs("null", stdout);
}

static const char *req_name(int req)
{
    switch (req) {
    case SRC_REQ_LEAD: return "lead";
    case SRC_REQ_CLAIM: return "claim";
    case SRC_REQ_SETTLE: return "settle";
    case SRC_REQ_CLEANUP: return "cleanup";
    case SRC_REQ_STATS: return "stats";
    default: return "?";
    }
}

static void begin_req(slot *s)
{
    s->req_ticks = s->a->ticks;
    s->req_t0 = mono_ms();
}

static void on_state(void *ud, enum src_state state, const char *msg)
{
    const slot *s = ud;
    fputs(s->tag, stdout);
    if (state == SRC_UP) {
        printf("STATE UP\n");
    } else {
        printf("STATE DOWN ");
        put_text(msg ? msg : "");
        putchar('\n');
    }
    fflush(stdout);
}

static void on_wake(void *ud)
{
    const slot *s = ud;
    printf("%sWAKE %" PRId64 "\n", s->tag, realtime_us());
    fflush(stdout);
}

static void print_row(const slot *s, const row *w)
{
    printf("%sROW {\"id\":%" PRId64 ",\"token\":%" PRId64 ",\"attempts\":%d,"
           "\"created_us\":%" PRId64, s->tag, w->id, w->lease_token, w->attempts,
           w->created_at_us);
    json_opt("message_id", w->message_id);
    json_opt("exchange", w->exchange);
    json_opt("routing_key", w->routing_key);
    json_opt("partition_key", w->partition_key);
    json_opt("message_type", w->message_type);
    json_opt("content_type", w->content_type);
    json_opt("correlation_id", w->correlation_id);
    json_opt("headers", w->headers_json);
    if (w->payload_withheld > 0)
        printf(",\"withheld\":%zu", w->payload_withheld);
    fputs(",\"payload_hex\":\"", stdout);
    for (size_t k = 0; k < w->payload_len; k++)
        printf("%02x", w->payload[k]);
    fputs("\"}\n", stdout);
}

static void drain_next(slot *s);

static void drain_done(slot *s, const src_result *r)
{
    int more = 0;
    if (r->ok == 0) {
        for (size_t i = 0; i < r->n_rows; i++) {
            if (s->n_drained == s->cap_drained) {
                s->cap_drained = s->cap_drained ? s->cap_drained * 2 : 256;
                s->drained = realloc(s->drained, s->cap_drained * sizeof *s->drained);
                if (!s->drained)
                    abort();
            }
            s->drained[s->n_drained++] = r->rows[i]->id;
        }
        more = r->n_rows > 0;
    }
    for (size_t i = 0; i < r->n_rows; i++)
        row_free(r->rows[i]);
    free(r->rows);
    if (more) {
        drain_next(s);
        return;
    }
    s->draining = 0;
    printf("%sDRAINED n=%zu ids=", s->tag, s->n_drained);
    for (size_t i = 0; i < s->n_drained; i++)
        printf("%s%" PRId64, i ? "," : "", s->drained[i]);
    if (r->ok != 0) {
        fputs(" error=", stdout);
        put_text(r->error ? r->error : "(null)");
    }
    putchar('\n');
    fflush(stdout);
}

static void on_done(void *ud, const src_result *r)
{
    slot *s = ud;
    if (s->draining && r->req == SRC_REQ_CLAIM) {
        drain_done(s, r);
        return;
    }
    if (r->req == SRC_REQ_CLAIM) {
        for (size_t i = 0; i < r->n_rows; i++) {
            print_row(s, r->rows[i]);
            row_free(r->rows[i]);  /* the callee owns the rows */
        }
        free(r->rows);
    }
    printf("%sDONE %s ok=%d ms=%" PRId64 " ticks=%ld", s->tag, req_name(r->req), r->ok,
           mono_ms() - s->req_t0, s->a->ticks - s->req_ticks);
    switch (r->req) {
    case SRC_REQ_LEAD:
        printf(" leader=%d newly=%d epoch=%lld held=%lld reset=%lld holder=%s member=%s",
               r->leader, r->newly_leader, (long long)r->epoch, (long long)r->holder_epoch,
               (long long)r->n_reset, r->holder ? r->holder : "-",
               r->member ? r->member : "-");
        break;
    case SRC_REQ_CLAIM:
        printf(" n=%zu", r->n_rows);
        break;
    case SRC_REQ_SETTLE:
        printf(" applied=%zu", r->n_applied);
        break;
    case SRC_REQ_CLEANUP:
        printf(" deleted=%zu", r->n_deleted);
        break;
    case SRC_REQ_STATS:
        printf(" backlog=%" PRId64 " oldest=%.3f dead=%" PRId64 " sent_kept=%" PRId64
               " leader=%s", r->stats.backlog, r->stats.oldest_pending_s, r->stats.dead,
               r->stats.sent_kept, r->stats.leader[0] ? r->stats.leader : "-");
        break;
    default:
        break;
    }
    if (r->ok != 0) {
        fputs(" error=", stdout);
        put_text(r->error ? r->error : "(null)");
    }
    putchar('\n');
    fflush(stdout);
}

static void drain_next(slot *s)
{
    int rc = s->a->ops->claim(s->src, &s->drain);
    if (rc != 0) {
        s->draining = 0;
        printf("%sDRAINED n=%zu ids= error=claim refused (%d)\n", s->tag, s->n_drained, rc);
        fflush(stdout);
    }
}

static int unhex(const char *h, char **out)
{
    size_t n = strlen(h);
    char *s;
    if (n % 2)
        return -1;
    s = malloc(n / 2 + 1);
    if (!s)
        return -1;
    for (size_t i = 0; i < n / 2; i++) {
        unsigned v;
        if (sscanf(h + 2 * i, "%2x", &v) != 1) {
            free(s);
            return -1;
        }
        s[i] = (char)v;
    }
    s[n / 2] = '\0';
    *out = s;
    return 0;
}

static void cmd_settle(slot *s, char *args)
{
    enum { MAXO = 10000 };
    static src_outcome v[MAXO];
    static char *reasons[MAXO];
    size_t n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(args, " ", &save); tok; tok = strtok_r(NULL, " ", &save)) {
        static char rhex[1 << 16];
        char kind = 0;
        src_outcome *o = &v[n];
        if (n == MAXO) {
            printf("%sERR too many outcomes\n", s->tag);
            goto out;
        }
        memset(o, 0, sizeof *o);
        reasons[n] = NULL;
        rhex[0] = '\0';
        int k = sscanf(tok, "%" SCNd64 ":%" SCNd64 ":%c:%" SCNd64 ":%65535s", &o->id,
                       &o->lease_token, &kind, &o->backoff_ms, rhex);
        if (k < 4 || !strchr("SRDU", kind)) {
            printf("%sERR bad outcome %s\n", s->tag, tok);
            goto out;
        }
        o->kind = kind == 'S' ? SRC_SENT : kind == 'R' ? SRC_RETRY : kind == 'D' ? SRC_DEAD
                                                                                 : SRC_UNCLAIM;
        if (k == 5 && unhex(rhex, &reasons[n]) < 0) {
            printf("%sERR bad reason hex\n", s->tag);
            goto out;
        }
        o->reason = reasons[n];
        n++;
    }
    begin_req(s);
    printf("%sACCEPT %d\n", s->tag, s->a->ops->settle(s->src, v, n));
    /* the source copied what it needs (relay/source.h): clobber ours to prove it */
    for (size_t i = 0; i < n; i++) {
        if (reasons[i])
            memset(reasons[i], 'X', strlen(reasons[i]));
        v[i].id = -1;
        v[i].lease_token = -1;
        v[i].kind = SRC_DEAD;
    }
out:
    for (size_t i = 0; i < n; i++)
        free(reasons[i]);
}

static void cmd_admin(slot *s, char *args)
{
    const source_ops *ops = s->a->ops;
    char err[8192] = "";
    int rc = -1;
    size_t affected = 0;
    int64_t ids[256];
    size_t n_ids = 0;
    char *save = NULL;
    char *cmd = strtok_r(args, " ", &save);
    if (!cmd) {
        printf("%sERR usage: admin CMD [ids]\n", s->tag);
        return;
    }
    for (char *t = strtok_r(NULL, " ", &save); t && n_ids < 256; t = strtok_r(NULL, " ", &save))
        ids[n_ids++] = strtoll(t, NULL, 10);
    if (!strcmp(cmd, "check")) {
        rc = ops->check(&s->ob, err, sizeof err);
        printf("%sADMIN check rc=%d", s->tag, rc);
    } else if (!strcmp(cmd, "init")) {
        rc = ops->init(&s->ob, err, sizeof err);
        printf("%sADMIN init rc=%d", s->tag, rc);
    } else if (!strcmp(cmd, "stats")) {
        src_stats st;
        memset(&st, 0, sizeof st);
        rc = ops->stats_sync(&s->ob, &st, err, sizeof err);
        printf("%sADMIN stats rc=%d backlog=%" PRId64 " oldest=%.3f dead=%" PRId64
               " sent_kept=%" PRId64, s->tag, rc, st.backlog, st.oldest_pending_s, st.dead,
               st.sent_kept);
    } else if (!strcmp(cmd, "dead-list")) {
        rc = ops->dead_list(&s->ob, stdout, err, sizeof err);
        fflush(stdout);
        printf("%sADMIN dead-list rc=%d", s->tag, rc);
    } else if (!strcmp(cmd, "dead-retry") || !strcmp(cmd, "dead-purge")) {
        if (cmd[5] == 'r')
            rc = ops->dead_retry(&s->ob, n_ids ? ids : NULL, n_ids, &affected, err, sizeof err);
        else
            rc = ops->dead_purge(&s->ob, n_ids ? ids : NULL, n_ids, &affected, err, sizeof err);
        printf("%sADMIN %s rc=%d affected=%zu", s->tag, cmd, rc, affected);
    } else {
        printf("%sERR unknown admin command %s\n", s->tag, cmd);
        return;
    }
    if (err[0]) {
        fputs(" error=", stdout);
        put_text(err);
    }
    putchar('\n');
}

/* ---- sql: the driver's own session, through the backend's client ---- */

/* libpq: every result of the (possibly multi-statement) text */
static int sql_pg(app *a, const char *conninfo, const char *text, long *rows, char *err,
                  size_t errlen)
{
    if (a->pg && PQstatus(a->pg) != CONNECTION_OK) {
        PQfinish(a->pg);
        a->pg = NULL;
    }
    if (!a->pg) {
        a->pg = PQconnectdb(conninfo);
        if (!a->pg || PQstatus(a->pg) != CONNECTION_OK) {
            snprintf(err, errlen, "%s", a->pg ? PQerrorMessage(a->pg) : "out of memory");
            PQfinish(a->pg);
            a->pg = NULL;
            return -1;
        }
    }
    if (!PQsendQuery(a->pg, text)) {
        snprintf(err, errlen, "%s", PQerrorMessage(a->pg));
        return -1;
    }
    int rc = 0;
    PGresult *r;
    while ((r = PQgetResult(a->pg)) != NULL) {   /* read every result, even after an error */
        ExecStatusType st = PQresultStatus(r);
        if (st == PGRES_TUPLES_OK) {
            for (int i = 0; i < PQntuples(r); i++) {
                fputs("SQLROW", stdout);
                for (int c = 0; c < PQnfields(r); c++)
                    put_col(PQgetvalue(r, i, c), (size_t)PQgetlength(r, i, c),
                            PQgetisnull(r, i, c));
                putchar('\n');
            }
            *rows += PQntuples(r);
        } else if (st == PGRES_COMMAND_OK) {
            *rows += strtol(PQcmdTuples(r), NULL, 10);
        } else if (rc == 0) {
            snprintf(err, errlen, "%s", PQresultErrorMessage(r));
            rc = -1;
        }
        PQclear(r);
    }
    return rc;
}

static void odbc_err(SQLSMALLINT type, SQLHANDLE h, char *out, size_t len)
{
    SQLCHAR st[6] = "", msg[512] = "";
    SQLINTEGER nat = 0;
    SQLSMALLINT ml = 0;
    if (SQL_SUCCEEDED(SQLGetDiagRec(type, h, 1, st, &nat, msg, sizeof msg, &ml)))
        snprintf(out, len, "[%s] %s", (char *)st, (char *)msg);
    else
        snprintf(out, len, "error without diagnostics");
}

/* one column of the current row, as UTF-8 text, read in pieces; -1 with err */
static int odbc_col(SQLHSTMT h, SQLUSMALLINT c, outbox_util_buf *utf16, int *isnull, char *err,
                    size_t errlen)
{
    SQLWCHAR w[4096];
    *isnull = 0;
    outbox_util_buf_reset(utf16);
    for (;;) {
        SQLLEN ind = 0;
        SQLRETURN r = SQLGetData(h, c, SQL_C_WCHAR, w, sizeof w, &ind);
        if (r == SQL_NO_DATA)
            return 0;                 /* every piece read */
        if (!SQL_SUCCEEDED(r)) {
            odbc_err(SQL_HANDLE_STMT, h, err, errlen);
            return -1;
        }
        if (ind == SQL_NULL_DATA) {
            *isnull = 1;
            return 0;
        }
        /* a piece fills the buffer but its terminator when more follows */
        size_t units = ind == SQL_NO_TOTAL || (size_t)ind >= sizeof w
                           ? sizeof w / sizeof w[0] - 1 : (size_t)ind / sizeof w[0];
        outbox_util_buf_put(utf16, w, units * sizeof w[0]);
        if (r == SQL_SUCCESS)
            return 0;
    }
}

/* ODBC: every result set of the text, sent as UTF-16 (the narrow API would pass
 * non-ASCII through the C locale), columns read back as UTF-16 */
static int sql_odbc(app *a, const char *conninfo, const char *text, long *rows, char *err,
                    size_t errlen)
{
    SQLHSTMT h = SQL_NULL_HSTMT;
    outbox_util_buf utf16 = { 0 }, utf8 = { 0 };
    int rc = -1;
    if (a->dbc == SQL_NULL_HDBC) {
        if (a->env == SQL_NULL_HENV &&
            (SQLAllocHandle(SQL_HANDLE_ENV, SQL_NULL_HANDLE, &a->env) != SQL_SUCCESS ||
             SQLSetEnvAttr(a->env, SQL_ATTR_ODBC_VERSION, (SQLPOINTER)SQL_OV_ODBC3, 0)
                 != SQL_SUCCESS)) {
            snprintf(err, errlen, "cannot allocate an ODBC environment");
            return -1;
        }
        if (SQLAllocHandle(SQL_HANDLE_DBC, a->env, &a->dbc) != SQL_SUCCESS) {
            snprintf(err, errlen, "cannot allocate an ODBC connection");
            a->dbc = SQL_NULL_HDBC;
            return -1;
        }
        if (!SQL_SUCCEEDED(SQLDriverConnect(a->dbc, NULL, (SQLCHAR *)(uintptr_t)conninfo,
                                            SQL_NTS, NULL, 0, NULL, SQL_DRIVER_NOPROMPT))) {
            odbc_err(SQL_HANDLE_DBC, a->dbc, err, errlen);
            SQLFreeHandle(SQL_HANDLE_DBC, a->dbc);
            a->dbc = SQL_NULL_HDBC;
            return -1;
        }
    }
    if (SQLAllocHandle(SQL_HANDLE_STMT, a->dbc, &h) != SQL_SUCCESS) {
        odbc_err(SQL_HANDLE_DBC, a->dbc, err, errlen);
        return -1;
    }
    size_t nw = 0;
    SQLWCHAR *wsql = outbox_util_utf16_from_utf8(text, strlen(text), &nw);
    if (!wsql)
        abort();
    SQLRETURN r = SQLExecDirectW(h, wsql, SQL_NTS);
    free(wsql);
    if (!SQL_SUCCEEDED(r) && r != SQL_NO_DATA) {
        odbc_err(SQL_HANDLE_STMT, h, err, errlen);
        goto done;
    }
    for (;;) {
        SQLSMALLINT nc = 0;
        SQLLEN affected = 0;
        if (!SQL_SUCCEEDED(SQLNumResultCols(h, &nc))) {
            odbc_err(SQL_HANDLE_STMT, h, err, errlen);
            goto done;
        }
        if (nc == 0 && SQL_SUCCEEDED(SQLRowCount(h, &affected)) && affected > 0)
            *rows += affected;
        while (nc > 0 && (r = SQLFetch(h)) != SQL_NO_DATA) {
            if (!SQL_SUCCEEDED(r)) {
                odbc_err(SQL_HANDLE_STMT, h, err, errlen);
                goto done;
            }
            fputs("SQLROW", stdout);
            for (SQLSMALLINT c = 1; c <= nc; c++) {
                int isnull;
                if (odbc_col(h, (SQLUSMALLINT)c, &utf16, &isnull, err, errlen) < 0) {
                    putchar('\n');
                    goto done;
                }
                outbox_util_buf_reset(&utf8);
                if (outbox_util_utf16_to_utf8(&utf8, (const uint16_t *)(const void *)utf16.p,
                                              utf16.len / sizeof(SQLWCHAR)) < 0 ||
                    utf16.failed)
                    abort();
                put_col(utf8.p, utf8.len, isnull);
            }
            putchar('\n');
            (*rows)++;
        }
        r = SQLMoreResults(h);
        if (r == SQL_NO_DATA)
            break;
        if (!SQL_SUCCEEDED(r)) {
            odbc_err(SQL_HANDLE_STMT, h, err, errlen);
            goto done;
        }
    }
    rc = 0;
done:
    SQLFreeHandle(SQL_HANDLE_STMT, h);
    outbox_util_buf_free(&utf16);
    outbox_util_buf_free(&utf8);
    return rc;
}

static void cmd_sql(app *a, const char *hex)
{
    char err[2048] = "";
    char *text = NULL;
    long rows = 0;
    int rc = -1;
    if (unhex(hex, &text) < 0) {
        printf("ERR usage: sql HEX\n");
        return;
    }
    if (a->ops == &pgsrc_ops)
        rc = sql_pg(a, a->s[0].ob.conninfo, text, &rows, err, sizeof err);
    else if (a->ops == &odbcsrc_ops)
        rc = sql_odbc(a, a->s[0].ob.conninfo, text, &rows, err, sizeof err);
    else
        snprintf(err, sizeof err, "no sql client for the %s source", a->ops->name);
    free(text);
    printf("SQLDONE rc=%d rows=%ld", rc, rows);
    if (err[0]) {
        fputs(" error=", stdout);
        put_text(err);
    }
    putchar('\n');
}

static void sql_close(app *a)
{
    PQfinish(a->pg);
    a->pg = NULL;
    if (a->dbc != SQL_NULL_HDBC) {
        SQLDisconnect(a->dbc);
        SQLFreeHandle(SQL_HANDLE_DBC, a->dbc);
        a->dbc = SQL_NULL_HDBC;
    }
    if (a->env != SQL_NULL_HENV)
        SQLFreeHandle(SQL_HANDLE_ENV, a->env);
    a->env = SQL_NULL_HENV;
}

/* ---- commands ---- */

static void quit(app *a)
{
    for (size_t i = 0; i < a->n_slots; i++) {
        if (a->s[i].src)
            a->ops->destroy(a->s[i].src);
        a->s[i].src = NULL;
    }
    ev_io_stop(a->loop, &a->in);
    ev_timer_stop(a->loop, &a->tick);
    ev_break(a->loop, EVBREAK_ALL);
}

/* a command for one source */
static void source_command(slot *s, char *line, char *arg)
{
    const source_ops *ops = s->a->ops;
    if (!strcmp(line, "admin")) {
        cmd_admin(s, arg);
    } else if (!s->src) {
        printf("%sERR no source\n", s->tag);
    } else if (!strcmp(line, "start")) {
        ops->start(s->src);
        printf("%sACCEPT 0\n", s->tag);
    } else if (!strcmp(line, "stop")) {
        int64_t t0 = mono_ms();
        ops->destroy(s->src);
        s->src = NULL;
        printf("%sSTOPPED ms=%" PRId64 "\n", s->tag, mono_ms() - t0);
    } else if (!strcmp(line, "lead")) {
        src_lead_args la = { 0 };
        char owner[256];
        long long ep = 0, lease = 30000;
        if (sscanf(arg, "%255s %lld %lld", owner, &ep, &lease) < 1) {
            printf("%sERR usage: lead OWNER [EPOCH [LEASE_MS]]\n", s->tag);
        } else {
            la.owner = owner;
            la.epoch = ep;
            la.lease_ms = lease;
            begin_req(s);
            printf("%sACCEPT %d\n", s->tag, ops->lead(s->src, &la));
            memset(owner, 'X', sizeof owner - 1);  /* not kept by the source */
        }
    } else if (!strcmp(line, "caps")) {
        printf("%sCAPS claims_bytes=%d\n", s->tag,
               s->src != NULL && ops->claims_bytes != NULL && ops->claims_bytes(s->src));
    } else if (!strcmp(line, "claim")) {
        src_claim_args c = { 0 };
        char owner[256], mode[16] = "";
        long long mx, lease, token, ep = 0;
        int64_t held[64], lost[16];
        char *opt = strstr(arg, "lost=");
        if (opt != NULL) {      /* the very last */
            c.n_lost = id_list(opt + 5, lost, sizeof lost / sizeof lost[0]);
            c.lost = lost;
            *opt = '\0';
        }
        opt = strstr(arg, "held=");
        if (opt != NULL) {      /* last but lost */
            c.n_held = id_list(opt + 5, held, sizeof held / sizeof held[0]);
            c.held = held;
            *opt = '\0';
        }
        opt = strstr(arg, "maxpay=");
        if (opt != NULL) {      /* before held and lost */
            c.max_payload = (size_t)strtoull(opt + 7, NULL, 10);
            *opt = '\0';
        }
        opt = strstr(arg, "bytes=");
        if (opt != NULL) {      /* the byte options come last */
            c.max_bytes = (size_t)strtoull(opt + 6, NULL, 10);
            c.first_whole = strstr(opt, " whole") != NULL;
            *opt = '\0';
        }
        if (sscanf(arg, "%lld %lld %lld %255s %lld %15s", &mx, &lease, &token, owner, &ep,
                   mode) < 4) {
            printf("%sERR usage: claim MAX LEASE_MS TOKEN OWNER [EPOCH [competing]]\n", s->tag);
        } else {
            c.max_rows = (size_t)mx;
            c.lease_ms = lease;
            c.lease_token = token;
            c.owner = owner;
            c.epoch = ep;
            c.competing = strcmp(mode, "competing") == 0;
            begin_req(s);
            printf("%sACCEPT %d\n", s->tag, ops->claim(s->src, &c));
            memset(owner, 'X', sizeof owner - 1);  /* not kept by the source */
        }
    } else if (!strcmp(line, "drain")) {
        long long b, lease, token;
        if (sscanf(arg, "%lld %lld %lld %255s", &b, &lease, &token, s->drain_owner) < 4) {
            printf("%sERR usage: drain BATCH LEASE_MS TOKEN OWNER\n", s->tag);
        } else {
            memset(&s->drain, 0, sizeof s->drain);
            s->drain.max_rows = (size_t)b;
            s->drain.lease_ms = lease;
            s->drain.lease_token = token;
            s->drain.owner = s->drain_owner;
            s->n_drained = 0;
            s->draining = 1;
            printf("%sACCEPT 0\n", s->tag);
            drain_next(s);
        }
    } else if (!strcmp(line, "settle")) {
        cmd_settle(s, arg);
    } else if (!strcmp(line, "cleanup")) {
        long long ret, lim, ep = 0;
        char owner[256] = "";
        if (sscanf(arg, "%lld %lld %255s %lld", &ret, &lim, owner, &ep) < 2) {
            printf("%sERR usage: cleanup RETENTION_MS LIMIT [OWNER EPOCH]\n", s->tag);
        } else {
            src_cleanup_args ca = { .retention_ms = ret, .limit = (size_t)lim, .owner = owner,
                                    .epoch = ep };
            begin_req(s);
            printf("%sACCEPT %d\n", s->tag, ops->cleanup(s->src, &ca));
        }
    } else if (!strcmp(line, "stats")) {
        begin_req(s);
        printf("%sACCEPT %d\n", s->tag, ops->stats(s->src));
    } else {
        printf("%sERR unknown command %s\n", s->tag, line);
    }
}

static void command(app *a, char *line)
{
    slot *s = &a->s[0];
    if (!strncmp(line, "2 ", 2)) {
        if (a->n_slots < 2) {
            printf("ERR no second source (--table2)\n");
            fflush(stdout);
            return;
        }
        s = &a->s[1];
        line += 2;
    }
    char *arg = strchr(line, ' ');
    if (arg)
        *arg++ = '\0';
    else
        arg = line + strlen(line);
    if (!strcmp(line, "quit") || !strcmp(line, "ticks") || !strcmp(line, "sql")) {
        if (s != &a->s[0])
            printf("%sERR %s is not a command of one source\n", s->tag, line);
        else if (!strcmp(line, "quit"))
            quit(a);
        else if (!strcmp(line, "ticks"))
            printf("TICKS %ld\n", a->ticks);
        else
            cmd_sql(a, arg);
    } else {
        source_command(s, line, arg);
    }
    fflush(stdout);
}

static void stdin_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    app *a = w->data;
    (void)loop;
    (void)revents;
    ssize_t n = read(0, a->buf + a->len, sizeof a->buf - a->len - 1);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (n <= 0) {  /* EOF: quit */
        quit(a);
        return;
    }
    a->len += (size_t)n;
    a->buf[a->len] = '\0';
    char *start = a->buf, *nl;
    while ((nl = memchr(start, '\n', a->len - (size_t)(start - a->buf))) != NULL) {
        *nl = '\0';
        if (nl > start && nl[-1] == '\r')
            nl[-1] = '\0';
        if (*start)
            command(a, start);
        start = nl + 1;
        if (!ev_is_active(&a->in))
            return;
    }
    a->len -= (size_t)(start - a->buf);
    memmove(a->buf, start, a->len);
}

static void tick_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    app *a = w->data;
    (void)loop;
    (void)revents;
    a->ticks++;
}

/* the outbox table of cfg: S.T parsed into its parts */
static int set_table(cfg_outbox *ob, const char *table)
{
    outbox_table_name tn;
    char err[512];
    if (outbox_table_parse(table, &tn, err, sizeof err) < 0) {
        fprintf(stderr, "table %s: %s\n", table, err);
        return -1;
    }
    ob->table = (char *)(uintptr_t)table;
    memcpy(ob->schema_part, tn.schema, sizeof tn.schema);
    memcpy(ob->table_part, tn.table, sizeof tn.table);
    memcpy(ob->dead_part, tn.dead, sizeof tn.dead);
    return 0;
}

int main(int argc, char **argv)
{
    static app a;
    cfg_outbox *ob = &a.s[0].ob;
    const char *table = "outbox.messages", *table2 = NULL, *backend = NULL;
    char err[512];
    int i;

    setvbuf(stdout, NULL, _IOLBF, 0);
    ob->name = (char *)"test";
    ob->query_timeout_ms = 30000;
    ob->connect_timeout_ms = 5000;
    ob->reconnect_max_ms = 1000;
    ob->on_sent = CFG_ON_SENT_MARK;
    ob->lease_ms = 30000;
    ob->batch_size = 500;
    for (i = 1; i + 1 < argc && !strncmp(argv[i], "--", 2); i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--backend")) backend = v;
        else if (!strcmp(k, "--conninfo")) ob->conninfo = (char *)v;
        else if (!strcmp(k, "--database")) ob->database = (char *)v;
        else if (!strcmp(k, "--table")) table = v;
        else if (!strcmp(k, "--table2")) table2 = v;
        else if (!strcmp(k, "--password")) ob->password = (char *)v;
        else if (!strcmp(k, "--name")) ob->name = (char *)v;
        else if (!strcmp(k, "--on-sent")) ob->on_sent = !strcmp(v, "delete") ? CFG_ON_SENT_DELETE : CFG_ON_SENT_MARK;
        else if (!strcmp(k, "--query-timeout")) ob->query_timeout_ms = strtoll(v, NULL, 10);
        else if (!strcmp(k, "--connect-timeout")) ob->connect_timeout_ms = strtoll(v, NULL, 10);
        else if (!strcmp(k, "--reconnect-max")) ob->reconnect_max_ms = strtoll(v, NULL, 10);
        else {
            fprintf(stderr, "unknown option %s\n", k);
            return 2;
        }
    }
    if (i != argc || !backend || !ob->conninfo || !ob->database) {
        fprintf(stderr, "usage: source_contract --backend postgres|odbc --conninfo S "
                        "--database D [options]\n");
        return 2;
    }
    if (sources_register() != 0) {
        fprintf(stderr, "cannot register the sources\n");
        return 2;
    }
    /* odbc: the ODBC source; its dialect follows the connected DBMS */
    ob->source = cfg_backend_find(CFG_BACKEND_SOURCE, backend);
    if (ob->source == NULL) {
        fprintf(stderr, "unknown backend %s\n", backend);
        return 2;
    }
    if (set_table(ob, table) < 0)
        return 2;
    a.ops = source_ops_of(ob);
    if (!a.ops) {
        fprintf(stderr, "no source ops for backend %s\n", backend);
        return 2;
    }
    a.n_slots = 1;
    if (table2) {
        a.s[1].ob = *ob;    /* the same settings, another table */
        if (set_table(&a.s[1].ob, table2) < 0)
            return 2;
        a.n_slots = 2;
    }

    a.loop = ev_default_loop(EVFLAG_AUTO);
    if (!a.loop) {
        fprintf(stderr, "no event loop\n");
        return 1;
    }
    for (size_t k = 0; k < a.n_slots; k++) {
        slot *s = &a.s[k];
        s->a = &a;
        s->tag = k ? "2 " : "";
        src_cbs cbs = {.ud = s, .on_state = on_state, .on_wake = on_wake, .on_done = on_done};
        if (a.ops->create(a.loop, &s->ob, &cbs, &s->src, err, sizeof err) < 0) {
            fprintf(stderr, "create: %s\n", err);
            if (k)
                a.ops->destroy(a.s[0].src);
            return 1;
        }
    }
    a.env = SQL_NULL_HENV;
    a.dbc = SQL_NULL_HDBC;
    ev_timer_init(&a.tick, tick_cb, 0.05, 0.05);
    a.tick.data = &a;
    ev_timer_start(a.loop, &a.tick);
    ev_io_init(&a.in, stdin_cb, 0, EV_READ);
    a.in.data = &a;
    ev_io_start(a.loop, &a.in);
    printf("READY %s\n", a.ops->name);
    fflush(stdout);
    ev_run(a.loop, 0);
    for (size_t k = 0; k < a.n_slots; k++) {
        if (a.s[k].src)
            a.ops->destroy(a.s[k].src);
        free(a.s[k].drained);
    }
    sql_close(&a);
    ev_loop_destroy(a.loop);
    return 0;
}
