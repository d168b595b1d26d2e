/*
 * odbcsrc_test.c — drives the ODBC source (sources/odbc) on a libev loop for
 * tests/test_odbcsrc.py. Reads one command per line on stdin, prints one
 * result line per event on stdout (text fields hex-encoded, "-" = NULL).
 *
 *   odbcsrc_test --conn ODBC-STRING --database NAME [--table S.T]
 *                [--on-sent mark|delete] [--query-timeout MS]
 *                [--connect-timeout MS] [--reconnect-max MS] [--password PW]
 *
 * Commands:
 *   start | lead NAME | claim MAX LEASE_MS TOKEN OWNER | stats
 *   settle ID,TOKEN,KIND,BACKOFF_MS,REASON_HEX ...   (REASON_HEX "-" = NULL)
 *   cleanup RETENTION_MS LIMIT | drain BATCH LEASE_MS TOKEN OWNER
 *   ticks | destroy | quit
 *   start2 | claim2          the second source (--table2 S.T): STATE2 / DONE2 lines
 *   admin check|init|stats|dead_list|dead_retry [ID...]|dead_purge [ID...]
 *   sql HEX      run SQL on the driver's own autocommit ODBC session (test setup
 *                for dialects without a Python client): SQLROW HEX... / SQLDONE
 * Output:
 *   STATE UP|DOWN msg=HEX
 *   DONE <req> ok=0|-1 ticks=N ms=N [fields] err=HEX
 *   ROW id=.. token=.. attempts=.. created_us=.. mid=HEX ex=HEX rk=HEX pk=HEX
 *       type=HEX ct=HEX corr=HEX hdr=HEX payload=HEX
 *   TICKS n | DESTROYED ms=N | DRAINED n=N ids=1,2,3 | ADMIN <cmd> rc=N ... err=HEX
 *
 * A 50 ms ev_timer runs on the same loop the whole time: the "ticks" of a
 * DONE line tell how often the loop ran while the request was in flight.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <ev.h>
#include <sql.h>
#include <sqlext.h>
#include "config/cfg.h"
#include "lib/outbox_schema.h"
#include "lib/outbox_util.h"
#include "relay/row.h"
#include "relay/source.h"
#include "sources/sources.h"

static struct ev_loop *g_loop;
static source *g_src;
static cfg_outbox g_oc;
/* a second source in the same process (--table2): start2 / claim2 */
static source *g_src2;
static cfg_outbox g_oc2;
static long g_req2_ticks;
static int64_t g_req2_t0;
static long g_ticks;
static long g_req_ticks;
static int64_t g_req_t0;
static ev_timer g_tick;
static ev_io g_stdin;
static char g_line[1 << 20];
static size_t g_line_len;

/* drain mode */
static int g_draining;
static size_t g_drain_batch;
static int64_t g_drain_lease, g_drain_token;
static char g_drain_owner[128];
static int64_t *g_drained;
static size_t g_n_drained, g_cap_drained;

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void put_hex(const char *key, const void *p, size_t n, int isnull)
{
    const unsigned char *b = p;
    printf(" %s=", key);
    if (isnull) {
        putchar('-');
        return;
    }
    if (n == 0)
        putchar('~');  /* empty */
    for (size_t i = 0; i < n; i++)
        printf("%02x", b[i]);
}

static void put_str(const char *key, const char *s)
{
    put_hex(key, s, s ? strlen(s) : 0, s == NULL);
}

static int unhex(const char *h, char **out)
{
    size_t n = strlen(h);
    *out = NULL;
    if (strcmp(h, "-") == 0)
        return 0;
    if (n % 2)
        return -1;
    char *s = malloc(n / 2 + 1);
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

static const char *req_name(int r)
{
    switch (r) {
    case SRC_REQ_LEAD: return "lead";
    case SRC_REQ_CLAIM: return "claim";
    case SRC_REQ_SETTLE: return "settle";
    case SRC_REQ_CLEANUP: return "cleanup";
    case SRC_REQ_STATS: return "stats";
    default: return "?";
    }
}

static void on_state(void *ud, int state, const char *msg)
{
    printf("STATE%s %s", ud ? "2" : "", state == SRC_UP ? "UP" : "DOWN");
    put_str("msg", msg);
    putchar('\n');
    fflush(stdout);
}

static void on_wake(void *ud)
{
    (void)ud;
}

static void drain_next(void);

static void on_done(void *ud, const src_result *r)
{
    if (ud) {
        printf("DONE2 %s ok=%d ticks=%ld ms=%" PRId64 " n=%zu\n", req_name(r->req), r->ok,
               g_ticks - g_req2_ticks, mono_ms() - g_req2_t0, r->n_rows);
        for (size_t i = 0; i < r->n_rows; i++)
            row_free(r->rows[i]);
        free(r->rows);
        fflush(stdout);
        return;
    }
    if (g_draining && r->req == SRC_REQ_CLAIM) {
        if (r->ok == 0) {
            for (size_t i = 0; i < r->n_rows; i++) {
                if (g_n_drained == g_cap_drained) {
                    g_cap_drained = g_cap_drained ? g_cap_drained * 2 : 256;
                    g_drained = realloc(g_drained, g_cap_drained * sizeof *g_drained);
                    if (!g_drained)
                        abort();
                }
                g_drained[g_n_drained++] = r->rows[i]->id;
                row_free(r->rows[i]);
            }
            free(r->rows);
            if (r->n_rows > 0) {
                drain_next();
                return;
            }
        } else {
            printf("DRAINERR");
            put_str("err", r->error);
            putchar('\n');
        }
        g_draining = 0;
        printf("DRAINED n=%zu ids=", g_n_drained);
        for (size_t i = 0; i < g_n_drained; i++)
            printf("%s%" PRId64, i ? "," : "", g_drained[i]);
        putchar('\n');
        fflush(stdout);
        return;
    }
    printf("DONE %s ok=%d ticks=%ld ms=%" PRId64, req_name(r->req), r->ok,
           g_ticks - g_req_ticks, mono_ms() - g_req_t0);
    switch (r->req) {
    case SRC_REQ_LEAD:
        printf(" leader=%d newly=%d epoch=%lld held=%lld reset=%lld holder=%s", r->leader,
               r->newly_leader, (long long)r->epoch, (long long)r->holder_epoch,
               (long long)r->n_reset, r->holder ? r->holder : "-");
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
        printf(" backlog=%" PRId64 " oldest=%.3f dead=%" PRId64 " sent_kept=%" PRId64,
               r->stats.backlog, r->stats.oldest_pending_s, r->stats.dead, r->stats.sent_kept);
        break;
    default:
        break;
    }
    put_str("err", r->error);
    putchar('\n');
    if (r->req == SRC_REQ_CLAIM) {
        for (size_t i = 0; i < r->n_rows; i++) {
            const row *w = r->rows[i];
            printf("ROW id=%" PRId64 " token=%" PRId64 " attempts=%d created_us=%" PRId64,
                   w->id, w->lease_token, w->attempts, w->created_at_us);
            put_str("mid", w->message_id);
            put_str("ex", w->exchange);
            put_str("rk", w->routing_key);
            put_str("pk", w->partition_key);
            put_str("type", w->message_type);
            put_str("ct", w->content_type);
            put_str("corr", w->correlation_id);
            put_str("hdr", w->headers_json);
            put_hex("payload", w->payload, w->payload_len, 0);
            putchar('\n');
            row_free(r->rows[i]);  /* ownership came with the result */
        }
        free(r->rows);
    }
    fflush(stdout);
}

static void begin_req(void)
{
    g_req_ticks = g_ticks;
    g_req_t0 = mono_ms();
}

static void drain_next(void)
{
    src_claim_args a = { .max_rows = g_drain_batch, .lease_ms = g_drain_lease,
                         .lease_token = g_drain_token, .owner = g_drain_owner };
    if (odbcsrc_ops.claim(g_src, &a) != 0) {
        printf("DRAINERR submit\n");
        g_draining = 0;
    }
}

static void tick_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)w;
    (void)revents;
    g_ticks++;
}

static int parse_ids(char *rest, int64_t **ids, size_t *n)
{
    *ids = NULL;
    *n = 0;
    for (char *tok = strtok(rest, " "); tok; tok = strtok(NULL, " ")) {
        int64_t *p = realloc(*ids, (*n + 1) * sizeof *p);
        if (!p)
            return -1;
        *ids = p;
        (*ids)[(*n)++] = strtoll(tok, NULL, 10);
    }
    return 0;
}

static void admin(char *args)
{
    char err[2048] = "";
    char *cmd = strtok(args, " ");
    char *rest = strtok(NULL, "");
    int rc = -1;
    if (!cmd)
        return;
    if (strcmp(cmd, "check") == 0) {
        rc = odbcsrc_ops.check(&g_oc, err, sizeof err);
        printf("ADMIN check rc=%d", rc);
    } else if (strcmp(cmd, "init") == 0) {
        rc = odbcsrc_ops.init(&g_oc, err, sizeof err);
        printf("ADMIN init rc=%d", rc);
    } else if (strcmp(cmd, "stats") == 0) {
        src_stats st;
        memset(&st, 0, sizeof st);
        rc = odbcsrc_ops.stats_sync(&g_oc, &st, err, sizeof err);
        printf("ADMIN stats rc=%d backlog=%" PRId64 " oldest=%.3f dead=%" PRId64
               " sent_kept=%" PRId64, rc, st.backlog, st.oldest_pending_s, st.dead, st.sent_kept);
    } else if (strcmp(cmd, "dead_list") == 0) {
        rc = odbcsrc_ops.dead_list(&g_oc, stdout, err, sizeof err);
        printf("ADMIN dead_list rc=%d", rc);
    } else if (strcmp(cmd, "dead_retry") == 0 || strcmp(cmd, "dead_purge") == 0) {
        int64_t *ids = NULL;
        size_t n = 0, affected = 0;
        char empty[1] = "";
        if (parse_ids(rest ? rest : empty, &ids, &n) < 0)
            abort();
        if (cmd[5] == 'r')
            rc = odbcsrc_ops.dead_retry(&g_oc, ids, n, &affected, err, sizeof err);
        else
            rc = odbcsrc_ops.dead_purge(&g_oc, ids, n, &affected, err, sizeof err);
        printf("ADMIN %s rc=%d affected=%zu", cmd, rc, affected);
        free(ids);
    } else {
        printf("ADMIN %s rc=-1 unknown", cmd);
    }
    put_str("err", err);
    putchar('\n');
}

/* ---- raw SQL for test setup (its own session; blocks the loop: tests only) */
static SQLHENV g_aenv = SQL_NULL_HENV;
static SQLHDBC g_adbc = SQL_NULL_HDBC;

static void sql_err(SQLSMALLINT type, SQLHANDLE h, char *out, size_t len)
{
    SQLCHAR st[6] = "", msg[512] = "";
    SQLINTEGER nat = 0;
    SQLSMALLINT ml = 0;
    if (SQL_SUCCEEDED(SQLGetDiagRec(type, h, 1, st, &nat, msg, sizeof msg, &ml)))
        snprintf(out, len, "[%s] %s", (char *)st, (char *)msg);
    else
        snprintf(out, len, "error without diagnostics");
}

static void sql_cmd(const char *hex)
{
    char err[1024] = "";
    char *sql = NULL;
    SQLHSTMT h = SQL_NULL_HSTMT;
    long rows = 0;
    int rc = -1;
    if (unhex(hex, &sql) < 0 || !sql) {
        printf("SQLDONE rc=-1 rows=0 err=-\n");
        return;
    }
    if (g_adbc == SQL_NULL_HDBC) {
        char cs[4096];
        snprintf(cs, sizeof cs, "%s", g_oc.conninfo);
        if (SQLAllocHandle(SQL_HANDLE_ENV, SQL_NULL_HANDLE, &g_aenv) != SQL_SUCCESS ||
            SQLSetEnvAttr(g_aenv, SQL_ATTR_ODBC_VERSION, (SQLPOINTER)SQL_OV_ODBC3, 0) != SQL_SUCCESS ||
            SQLAllocHandle(SQL_HANDLE_DBC, g_aenv, &g_adbc) != SQL_SUCCESS) {
            snprintf(err, sizeof err, "alloc");
            goto done;
        }
        if (!SQL_SUCCEEDED(SQLDriverConnect(g_adbc, NULL, (SQLCHAR *)cs, SQL_NTS, NULL, 0, NULL,
                                            SQL_DRIVER_NOPROMPT))) {
            sql_err(SQL_HANDLE_DBC, g_adbc, err, sizeof err);
            SQLFreeHandle(SQL_HANDLE_DBC, g_adbc);
            g_adbc = SQL_NULL_HDBC;
            goto done;
        }
    }
    if (SQLAllocHandle(SQL_HANDLE_STMT, g_adbc, &h) != SQL_SUCCESS) {
        sql_err(SQL_HANDLE_DBC, g_adbc, err, sizeof err);
        goto done;
    }
    /* as UTF-16: the narrow API would pass non-ASCII through the C locale */
    size_t nw = 0;
    SQLWCHAR *wsql = outbox_util_utf16_from_utf8(sql, strlen(sql), &nw);
    if (!wsql)
        abort();
    SQLRETURN r = SQLExecDirectW(h, wsql, SQL_NTS);
    free(wsql);
    if (!SQL_SUCCEEDED(r) && r != SQL_NO_DATA) {
        sql_err(SQL_HANDLE_STMT, h, err, sizeof err);
        goto done;
    }
    for (;;) {
        SQLSMALLINT nc = 0;
        SQLLEN rc2 = 0;
        if (!SQL_SUCCEEDED(SQLNumResultCols(h, &nc))) {
            sql_err(SQL_HANDLE_STMT, h, err, sizeof err);
            goto done;
        }
        if (nc == 0 && SQL_SUCCEEDED(SQLRowCount(h, &rc2)) && rc2 > 0)
            rows += rc2;
        while (nc > 0 && (r = SQLFetch(h)) != SQL_NO_DATA) {
            if (!SQL_SUCCEEDED(r)) {
                sql_err(SQL_HANDLE_STMT, h, err, sizeof err);
                goto done;
            }
            printf("SQLROW");
            for (SQLSMALLINT c = 1; c <= nc; c++) {
                SQLWCHAR wv[8192];
                outbox_util_buf v = { 0 };
                size_t n = 0;
                SQLLEN ind = 0;
                r = SQLGetData(h, (SQLUSMALLINT)c, SQL_C_WCHAR, wv, sizeof wv, &ind);
                if (!SQL_SUCCEEDED(r)) {
                    sql_err(SQL_HANDLE_STMT, h, err, sizeof err);
                    goto done;
                }
                while (ind != SQL_NULL_DATA && n < sizeof wv / sizeof wv[0] && wv[n])
                    n++;
                if (outbox_util_utf16_to_utf8(&v, wv, n) < 0)   /* -> UTF-8 */
                    abort();
                put_hex("c", v.p, v.len, ind == SQL_NULL_DATA);
                outbox_util_buf_free(&v);
            }
            putchar('\n');
            rows++;
        }
        r = SQLMoreResults(h);
        if (r == SQL_NO_DATA)
            break;
        if (!SQL_SUCCEEDED(r)) {
            sql_err(SQL_HANDLE_STMT, h, err, sizeof err);
            goto done;
        }
    }
    rc = 0;
done:
    if (h != SQL_NULL_HSTMT)
        SQLFreeHandle(SQL_HANDLE_STMT, h);
    printf("SQLDONE rc=%d rows=%ld", rc, rows);
    put_str("err", err);
    putchar('\n');
    free(sql);
}

static void sql_close(void)
{
    if (g_adbc != SQL_NULL_HDBC) {
        SQLDisconnect(g_adbc);
        SQLFreeHandle(SQL_HANDLE_DBC, g_adbc);
    }
    if (g_aenv != SQL_NULL_HENV)
        SQLFreeHandle(SQL_HANDLE_ENV, g_aenv);
    g_adbc = SQL_NULL_HDBC;
    g_aenv = SQL_NULL_HENV;
}

static void quit(void)
{
    if (g_src)
        odbcsrc_ops.destroy(g_src);
    g_src = NULL;
    if (g_src2)
        odbcsrc_ops.destroy(g_src2);
    g_src2 = NULL;
    ev_io_stop(g_loop, &g_stdin);
    ev_timer_stop(g_loop, &g_tick);
    ev_break(g_loop, EVBREAK_ALL);
}

static void command(char *line)
{
    char *cmd = strtok(line, " ");
    if (!cmd)
        return;
    if (strcmp(cmd, "start") == 0) {
        odbcsrc_ops.start(g_src);
    } else if (strcmp(cmd, "start2") == 0 && g_src2) {
        odbcsrc_ops.start(g_src2);
    } else if (strcmp(cmd, "claim2") == 0 && g_src2) {
        src_claim_args a = { .max_rows = 100, .lease_ms = 30000, .lease_token = 99,
                             .owner = "second" };
        g_req2_ticks = g_ticks;
        g_req2_t0 = mono_ms();
        printf("SUBMIT2 rc=%d\n", odbcsrc_ops.claim(g_src2, &a));
    } else if (strcmp(cmd, "lead") == 0) {
        /* lead OWNER [EPOCH [LEASE_MS]] */
        char *name = strtok(NULL, " "), *ep = strtok(NULL, " "), *ls = strtok(NULL, " ");
        src_lead_args la = { .owner = name ? name : "outbox",
                             .epoch = ep ? strtoll(ep, NULL, 10) : 0,
                             .lease_ms = ls ? strtoll(ls, NULL, 10) : 30000 };
        begin_req();
        printf("SUBMIT rc=%d\n", odbcsrc_ops.lead(g_src, &la));
    } else if (strcmp(cmd, "claim") == 0) {
        src_claim_args a = { 0 };
        char *mx = strtok(NULL, " "), *ls = strtok(NULL, " "), *tk = strtok(NULL, " "),
             *ow = strtok(NULL, " "), *ep = strtok(NULL, " "), *md = strtok(NULL, " ");
        if (!mx || !ls || !tk || !ow) {
            printf("BADCMD\n");
            return;
        }
        a.epoch = ep ? strtoll(ep, NULL, 10) : 0;
        a.competing = md && strcmp(md, "competing") == 0;
        a.max_rows = strtoull(mx, NULL, 10);
        a.lease_ms = strtoll(ls, NULL, 10);
        a.lease_token = strtoll(tk, NULL, 10);
        a.owner = ow;
        begin_req();
        printf("SUBMIT rc=%d\n", odbcsrc_ops.claim(g_src, &a));
    } else if (strcmp(cmd, "drain") == 0) {
        char *b = strtok(NULL, " "), *ls = strtok(NULL, " "), *tk = strtok(NULL, " "),
             *ow = strtok(NULL, " ");
        if (!b || !ls || !tk || !ow) {
            printf("BADCMD\n");
            return;
        }
        g_drain_batch = strtoull(b, NULL, 10);
        g_drain_lease = strtoll(ls, NULL, 10);
        g_drain_token = strtoll(tk, NULL, 10);
        snprintf(g_drain_owner, sizeof g_drain_owner, "%s", ow);
        g_n_drained = 0;
        g_draining = 1;
        drain_next();
    } else if (strcmp(cmd, "settle") == 0) {
        src_outcome v[512];
        char *reasons[512];
        size_t n = 0;
        for (char *tok = strtok(NULL, " "); tok && n < 512; tok = strtok(NULL, " ")) {
            char rh[4096] = "-";
            long long id = 0, token = 0, bo = 0;
            int kind = 0;
            if (sscanf(tok, "%lld,%lld,%d,%lld,%4095s", &id, &token, &kind, &bo, rh) < 4 ||
                unhex(rh, &reasons[n]) < 0) {
                printf("BADCMD\n");
                return;
            }
            v[n].id = id;
            v[n].lease_token = token;
            v[n].kind = kind;
            v[n].backoff_ms = bo;
            v[n].reason = reasons[n];
            n++;
        }
        begin_req();
        int rc = odbcsrc_ops.settle(g_src, v, n);
        for (size_t i = 0; i < n; i++)
            free(reasons[i]);  /* the source copied the outcomes */
        printf("SUBMIT rc=%d\n", rc);
    } else if (strcmp(cmd, "cleanup") == 0) {
        char *r = strtok(NULL, " "), *l = strtok(NULL, " ");
        src_cleanup_args ca = { .retention_ms = r ? strtoll(r, NULL, 10) : 0,
                                .limit = l ? strtoull(l, NULL, 10) : 1000, .owner = "" };
        begin_req();
        printf("SUBMIT rc=%d\n", odbcsrc_ops.cleanup(g_src, &ca));
    } else if (strcmp(cmd, "stats") == 0) {
        begin_req();
        printf("SUBMIT rc=%d\n", odbcsrc_ops.stats(g_src));
    } else if (strcmp(cmd, "ticks") == 0) {
        printf("TICKS %ld\n", g_ticks);
    } else if (strcmp(cmd, "destroy") == 0) {
        int64_t t0 = mono_ms();
        odbcsrc_ops.destroy(g_src);
        g_src = NULL;
        printf("DESTROYED ms=%" PRId64 "\n", mono_ms() - t0);
    } else if (strcmp(cmd, "admin") == 0) {
        char *rest = strtok(NULL, "");
        char empty[1] = "";
        admin(rest ? rest : empty);
    } else if (strcmp(cmd, "sql") == 0) {
        char *hex = strtok(NULL, " ");
        sql_cmd(hex ? hex : "-");
    } else if (strcmp(cmd, "quit") == 0) {
        quit();
    } else {
        printf("BADCMD %s\n", cmd);
    }
    fflush(stdout);
}

static void stdin_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop;
    (void)revents;
    ssize_t n = read(w->fd, g_line + g_line_len, sizeof g_line - 1 - g_line_len);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (n <= 0) {
        quit();
        return;
    }
    g_line_len += (size_t)n;
    for (;;) {
        char *nl = memchr(g_line, '\n', g_line_len);
        if (!nl)
            break;
        *nl = '\0';
        size_t used = (size_t)(nl - g_line) + 1;
        char *copy = strdup(g_line);
        memmove(g_line, nl + 1, g_line_len - used);
        g_line_len -= used;
        if (!copy)
            abort();
        command(copy);
        free(copy);
        if (!g_stdin.active)
            return;
    }
}

int main(int argc, char **argv)
{
    const char *conn = NULL, *database = NULL, *table = "outbox.messages", *password = NULL;
    const char *table2 = NULL;
    int64_t qt = 30000, ct = 5000, rm = 2000;
    int on_sent = CFG_ON_SENT_MARK;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--conn")) conn = v;
        else if (!strcmp(k, "--database")) database = v;
        else if (!strcmp(k, "--table")) table = v;
        else if (!strcmp(k, "--password")) password = v;
        else if (!strcmp(k, "--table2")) table2 = v;
        else if (!strcmp(k, "--on-sent")) on_sent = !strcmp(v, "delete") ? CFG_ON_SENT_DELETE : CFG_ON_SENT_MARK;
        else if (!strcmp(k, "--query-timeout")) qt = strtoll(v, NULL, 10);
        else if (!strcmp(k, "--connect-timeout")) ct = strtoll(v, NULL, 10);
        else if (!strcmp(k, "--reconnect-max")) rm = strtoll(v, NULL, 10);
        else {
            fprintf(stderr, "unknown option %s\n", k);
            return 2;
        }
    }
    if (!conn || !database) {
        fprintf(stderr, "usage: odbcsrc_test --conn STR --database NAME [options]\n");
        return 2;
    }
    outbox_table_name tn;
    char err[512];
    if (outbox_table_parse(table, &tn, err, sizeof err) < 0) {
        fprintf(stderr, "table: %s\n", err);
        return 2;
    }
    memset(&g_oc, 0, sizeof g_oc);
    g_oc.name = (char *)(uintptr_t)"test";
    if (sources_register() != 0)
        return 2;
    g_oc.source = cfg_backend_find(CFG_BACKEND_SOURCE, "sqlserver");
    g_oc.conninfo = (char *)(uintptr_t)conn;
    g_oc.password = (char *)(uintptr_t)password;
    g_oc.database = (char *)(uintptr_t)database;
    g_oc.table = (char *)(uintptr_t)table;
    memcpy(g_oc.schema_part, tn.schema, sizeof tn.schema);
    memcpy(g_oc.table_part, tn.table, sizeof tn.table);
    memcpy(g_oc.dead_part, tn.dead, sizeof tn.dead);
    g_oc.on_sent = on_sent;
    g_oc.query_timeout_ms = qt;
    g_oc.connect_timeout_ms = ct;
    g_oc.reconnect_max_ms = rm;
    g_oc.lease_ms = 30000;
    g_oc.batch_size = 500;

    setvbuf(stdout, NULL, _IOLBF, 0);
    g_loop = ev_default_loop(0);
    src_cbs cbs = {NULL, on_state, on_wake, on_done};
    if (odbcsrc_ops.create(g_loop, &g_oc, &cbs, &g_src, err, sizeof err) != 0) {
        fprintf(stderr, "create: %s\n", err);
        return 1;
    }
    if (table2) {
        src_cbs cbs2 = {(void *)1, on_state, on_wake, on_done};
        g_oc2 = g_oc;
        if (outbox_table_parse(table2, &tn, err, sizeof err) < 0) {
            fprintf(stderr, "table2: %s\n", err);
            return 2;
        }
        memcpy(g_oc2.schema_part, tn.schema, sizeof tn.schema);
        memcpy(g_oc2.table_part, tn.table, sizeof tn.table);
        memcpy(g_oc2.dead_part, tn.dead, sizeof tn.dead);
        if (odbcsrc_ops.create(g_loop, &g_oc2, &cbs2, &g_src2, err, sizeof err) != 0) {
            fprintf(stderr, "create: %s\n", err);
            return 1;
        }
    }
    ev_timer_init(&g_tick, tick_cb, 0.05, 0.05);
    ev_timer_start(g_loop, &g_tick);
    ev_io_init(&g_stdin, stdin_cb, 0, EV_READ);
    ev_io_start(g_loop, &g_stdin);
    printf("READY\n");
    ev_run(g_loop, 0);
    if (g_src)
        odbcsrc_ops.destroy(g_src);
    if (g_src2)
        odbcsrc_ops.destroy(g_src2);
    free(g_drained);
    sql_close();
    ev_loop_destroy(g_loop);
    return 0;
}
