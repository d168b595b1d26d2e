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
 *
 * Commands, one per line on stdin:
 *   start | stop (destroy the source; prints STOPPED ms=N) | quit | ticks
 *   lead OWNER [EPOCH [LEASE_MS]]
 *   claim MAX LEASE_MS TOKEN OWNER [EPOCH [competing]]
 *   drain BATCH LEASE_MS TOKEN OWNER    claim until a claim returns nothing
 *   settle ID:TOKEN:KIND:BACKOFF_MS[:REASON_HEX] ...  (KIND S sent, R retry,
 *                                       D dead, U unclaim; no REASON_HEX: NULL)
 *   cleanup RETENTION_MS LIMIT [OWNER EPOCH]
 *   stats
 *   admin check | init | stats | dead-list | dead-retry [ID...] | dead-purge [ID...]
 * Output lines (TEXT: '\' and newlines escaped as \\ and \n):
 *   READY <ops name> | STATE UP | STATE DOWN TEXT | WAKE <unix us> | ACCEPT <rc>
 *   ROW {json}            (each claimed row, before its DONE claim line)
 *   DONE <req> ok=N ms=N ticks=N [fields] [error=TEXT]
 *   DRAINED n=N ids=1,2,3 [error=TEXT]
 *   TICKS n | STOPPED ms=N
 *   ADMIN <cmd> rc=N [fields] [error=TEXT]   (dead-list rows come before it)
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
#include "config/cfg.h"
#include "lib/outbox_schema.h"
#include "relay/row.h"
#include "relay/source.h"
#include "sources/sources.h"

typedef struct app {
    struct ev_loop *loop;
    cfg_outbox ob;
    const source_ops *ops;
    source *src;
    ev_io in;
    ev_timer tick;
    long ticks, req_ticks;
    int64_t req_t0;
    char buf[1 << 20];
    size_t len;
    /* drain */
    int draining;
    src_claim_args drain;
    char drain_owner[256];
    int64_t *drained;
    size_t n_drained, cap_drained;
} app;

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

static void begin_req(app *a)
{
    a->req_ticks = a->ticks;
    a->req_t0 = mono_ms();
}

static void on_state(void *ud, int state, const char *msg)
{
    (void)ud;
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
    (void)ud;
    printf("WAKE %" PRId64 "\n", realtime_us());
    fflush(stdout);
}

static void print_row(const row *w)
{
    printf("ROW {\"id\":%" PRId64 ",\"token\":%" PRId64 ",\"attempts\":%d,"
           "\"created_us\":%" PRId64, w->id, w->lease_token, w->attempts, w->created_at_us);
    json_opt("message_id", w->message_id);
    json_opt("exchange", w->exchange);
    json_opt("routing_key", w->routing_key);
    json_opt("partition_key", w->partition_key);
    json_opt("message_type", w->message_type);
    json_opt("content_type", w->content_type);
    json_opt("correlation_id", w->correlation_id);
    json_opt("headers", w->headers_json);
    fputs(",\"payload_hex\":\"", stdout);
    for (size_t k = 0; k < w->payload_len; k++)
        printf("%02x", w->payload[k]);
    fputs("\"}\n", stdout);
}

static void drain_next(app *a);

static void drain_done(app *a, const src_result *r)
{
    int more = 0;
    if (r->ok == 0) {
        for (size_t i = 0; i < r->n_rows; i++) {
            if (a->n_drained == a->cap_drained) {
                a->cap_drained = a->cap_drained ? a->cap_drained * 2 : 256;
                a->drained = realloc(a->drained, a->cap_drained * sizeof *a->drained);
                if (!a->drained)
                    abort();
            }
            a->drained[a->n_drained++] = r->rows[i]->id;
        }
        more = r->n_rows > 0;
    }
    for (size_t i = 0; i < r->n_rows; i++)
        row_free(r->rows[i]);
    free(r->rows);
    if (more) {
        drain_next(a);
        return;
    }
    a->draining = 0;
    printf("DRAINED n=%zu ids=", a->n_drained);
    for (size_t i = 0; i < a->n_drained; i++)
        printf("%s%" PRId64, i ? "," : "", a->drained[i]);
    if (r->ok != 0) {
        fputs(" error=", stdout);
        put_text(r->error ? r->error : "(null)");
    }
    putchar('\n');
    fflush(stdout);
}

static void on_done(void *ud, const src_result *r)
{
    app *a = ud;
    if (a->draining && r->req == SRC_REQ_CLAIM) {
        drain_done(a, r);
        return;
    }
    if (r->req == SRC_REQ_CLAIM) {
        for (size_t i = 0; i < r->n_rows; i++) {
            print_row(r->rows[i]);
            row_free(r->rows[i]);  /* the callee owns the rows */
        }
        free(r->rows);
    }
    printf("DONE %s ok=%d ms=%" PRId64 " ticks=%ld", req_name(r->req), r->ok,
           mono_ms() - a->req_t0, a->ticks - a->req_ticks);
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
    if (r->ok != 0) {
        fputs(" error=", stdout);
        put_text(r->error ? r->error : "(null)");
    }
    putchar('\n');
    fflush(stdout);
}

static void drain_next(app *a)
{
    int rc = a->ops->claim(a->src, &a->drain);
    if (rc != 0) {
        a->draining = 0;
        printf("DRAINED n=%zu ids= error=claim refused (%d)\n", a->n_drained, rc);
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

static void cmd_settle(app *a, char *args)
{
    enum { MAXO = 1024 };
    static src_outcome v[MAXO];
    static char *reasons[MAXO];
    size_t n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(args, " ", &save); tok; tok = strtok_r(NULL, " ", &save)) {
        static char rhex[1 << 16];
        char kind = 0;
        src_outcome *o = &v[n];
        if (n == MAXO) {
            printf("ERR too many outcomes\n");
            goto out;
        }
        memset(o, 0, sizeof *o);
        reasons[n] = NULL;
        rhex[0] = '\0';
        int k = sscanf(tok, "%" SCNd64 ":%" SCNd64 ":%c:%" SCNd64 ":%65535s", &o->id,
                       &o->lease_token, &kind, &o->backoff_ms, rhex);
        if (k < 4 || !strchr("SRDU", kind)) {
            printf("ERR bad outcome %s\n", tok);
            goto out;
        }
        o->kind = kind == 'S' ? SRC_SENT : kind == 'R' ? SRC_RETRY : kind == 'D' ? SRC_DEAD
                                                                                 : SRC_UNCLAIM;
        if (k == 5 && unhex(rhex, &reasons[n]) < 0) {
            printf("ERR bad reason hex\n");
            goto out;
        }
        o->reason = reasons[n];
        n++;
    }
    begin_req(a);
    printf("ACCEPT %d\n", a->ops->settle(a->src, v, n));
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

static void cmd_admin(app *a, char *args)
{
    char err[8192] = "";
    int rc = -1;
    size_t affected = 0;
    int64_t ids[256];
    size_t n_ids = 0;
    char *save = NULL;
    char *cmd = strtok_r(args, " ", &save);
    if (!cmd) {
        printf("ERR usage: admin CMD [ids]\n");
        return;
    }
    for (char *t = strtok_r(NULL, " ", &save); t && n_ids < 256; t = strtok_r(NULL, " ", &save))
        ids[n_ids++] = strtoll(t, NULL, 10);
    if (!strcmp(cmd, "check")) {
        rc = a->ops->check(&a->ob, err, sizeof err);
        printf("ADMIN check rc=%d", rc);
    } else if (!strcmp(cmd, "init")) {
        rc = a->ops->init(&a->ob, err, sizeof err);
        printf("ADMIN init rc=%d", rc);
    } else if (!strcmp(cmd, "stats")) {
        src_stats st;
        memset(&st, 0, sizeof st);
        rc = a->ops->stats_sync(&a->ob, &st, err, sizeof err);
        printf("ADMIN stats rc=%d backlog=%" PRId64 " oldest=%.3f dead=%" PRId64
               " sent_kept=%" PRId64, rc, st.backlog, st.oldest_pending_s, st.dead, st.sent_kept);
    } else if (!strcmp(cmd, "dead-list")) {
        rc = a->ops->dead_list(&a->ob, stdout, err, sizeof err);
        fflush(stdout);
        printf("ADMIN dead-list rc=%d", rc);
    } else if (!strcmp(cmd, "dead-retry") || !strcmp(cmd, "dead-purge")) {
        if (cmd[5] == 'r')
            rc = a->ops->dead_retry(&a->ob, n_ids ? ids : NULL, n_ids, &affected, err, sizeof err);
        else
            rc = a->ops->dead_purge(&a->ob, n_ids ? ids : NULL, n_ids, &affected, err, sizeof err);
        printf("ADMIN %s rc=%d affected=%zu", cmd, rc, affected);
    } else {
        printf("ERR unknown admin command %s\n", cmd);
        return;
    }
    if (err[0]) {
        fputs(" error=", stdout);
        put_text(err);
    }
    putchar('\n');
}

static void quit(app *a)
{
    if (a->src)
        a->ops->destroy(a->src);
    a->src = NULL;
    ev_io_stop(a->loop, &a->in);
    ev_timer_stop(a->loop, &a->tick);
    ev_break(a->loop, EVBREAK_ALL);
}

static void command(app *a, char *line)
{
    char *arg = strchr(line, ' ');
    if (arg)
        *arg++ = '\0';
    else
        arg = line + strlen(line);
    if (!strcmp(line, "quit")) {
        quit(a);
    } else if (!strcmp(line, "ticks")) {
        printf("TICKS %ld\n", a->ticks);
    } else if (!strcmp(line, "admin")) {
        cmd_admin(a, arg);
    } else if (!a->src) {
        printf("ERR no source\n");
    } else if (!strcmp(line, "start")) {
        a->ops->start(a->src);
        printf("ACCEPT 0\n");
    } else if (!strcmp(line, "stop")) {
        int64_t t0 = mono_ms();
        a->ops->destroy(a->src);
        a->src = NULL;
        printf("STOPPED ms=%" PRId64 "\n", mono_ms() - t0);
    } else if (!strcmp(line, "lead")) {
        src_lead_args la = { 0 };
        char owner[256];
        long long ep = 0, lease = 30000;
        if (sscanf(arg, "%255s %lld %lld", owner, &ep, &lease) < 1) {
            printf("ERR usage: lead OWNER [EPOCH [LEASE_MS]]\n");
        } else {
            la.owner = owner;
            la.epoch = ep;
            la.lease_ms = lease;
            begin_req(a);
            printf("ACCEPT %d\n", a->ops->lead(a->src, &la));
            memset(owner, 'X', sizeof owner - 1);  /* not kept by the source */
        }
    } else if (!strcmp(line, "claim")) {
        src_claim_args c = { 0 };
        char owner[256], mode[16] = "";
        long long mx, lease, token, ep = 0;
        if (sscanf(arg, "%lld %lld %lld %255s %lld %15s", &mx, &lease, &token, owner, &ep,
                   mode) < 4) {
            printf("ERR usage: claim MAX LEASE_MS TOKEN OWNER [EPOCH [competing]]\n");
        } else {
            c.max_rows = (size_t)mx;
            c.lease_ms = lease;
            c.lease_token = token;
            c.owner = owner;
            c.epoch = ep;
            c.competing = strcmp(mode, "competing") == 0;
            begin_req(a);
            printf("ACCEPT %d\n", a->ops->claim(a->src, &c));
            memset(owner, 'X', sizeof owner - 1);  /* not kept by the source */
        }
    } else if (!strcmp(line, "drain")) {
        long long b, lease, token;
        if (sscanf(arg, "%lld %lld %lld %255s", &b, &lease, &token, a->drain_owner) < 4) {
            printf("ERR usage: drain BATCH LEASE_MS TOKEN OWNER\n");
        } else {
            memset(&a->drain, 0, sizeof a->drain);
            a->drain.max_rows = (size_t)b;
            a->drain.lease_ms = lease;
            a->drain.lease_token = token;
            a->drain.owner = a->drain_owner;
            a->n_drained = 0;
            a->draining = 1;
            printf("ACCEPT 0\n");
            drain_next(a);
        }
    } else if (!strcmp(line, "settle")) {
        cmd_settle(a, arg);
    } else if (!strcmp(line, "cleanup")) {
        long long ret, lim, ep = 0;
        char owner[256] = "";
        if (sscanf(arg, "%lld %lld %255s %lld", &ret, &lim, owner, &ep) < 2) {
            printf("ERR usage: cleanup RETENTION_MS LIMIT [OWNER EPOCH]\n");
        } else {
            src_cleanup_args ca = { .retention_ms = ret, .limit = (size_t)lim, .owner = owner,
                                    .epoch = ep };
            begin_req(a);
            printf("ACCEPT %d\n", a->ops->cleanup(a->src, &ca));
        }
    } else if (!strcmp(line, "stats")) {
        begin_req(a);
        printf("ACCEPT %d\n", a->ops->stats(a->src));
    } else {
        printf("ERR unknown command %s\n", line);
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

int main(int argc, char **argv)
{
    static app a;
    const char *table = "outbox.messages", *backend = NULL;
    outbox_table_name tn;
    char err[512];
    int i;

    setvbuf(stdout, NULL, _IOLBF, 0);
    a.ob.name = (char *)"test";
    a.ob.query_timeout_ms = 30000;
    a.ob.connect_timeout_ms = 5000;
    a.ob.reconnect_max_ms = 1000;
    a.ob.on_sent = CFG_ON_SENT_MARK;
    a.ob.lease_ms = 30000;
    a.ob.batch_size = 500;
    for (i = 1; i + 1 < argc && !strncmp(argv[i], "--", 2); i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--backend")) backend = v;
        else if (!strcmp(k, "--conninfo")) a.ob.conninfo = (char *)v;
        else if (!strcmp(k, "--database")) a.ob.database = (char *)v;
        else if (!strcmp(k, "--table")) table = v;
        else if (!strcmp(k, "--password")) a.ob.password = (char *)v;
        else if (!strcmp(k, "--name")) a.ob.name = (char *)v;
        else if (!strcmp(k, "--on-sent")) a.ob.on_sent = !strcmp(v, "delete") ? CFG_ON_SENT_DELETE : CFG_ON_SENT_MARK;
        else if (!strcmp(k, "--query-timeout")) a.ob.query_timeout_ms = strtoll(v, NULL, 10);
        else if (!strcmp(k, "--connect-timeout")) a.ob.connect_timeout_ms = strtoll(v, NULL, 10);
        else if (!strcmp(k, "--reconnect-max")) a.ob.reconnect_max_ms = strtoll(v, NULL, 10);
        else {
            fprintf(stderr, "unknown option %s\n", k);
            return 2;
        }
    }
    if (i != argc || !backend || !a.ob.conninfo || !a.ob.database) {
        fprintf(stderr, "usage: source_contract --backend postgres|odbc --conninfo S "
                        "--database D [options]\n");
        return 2;
    }
    if (sources_register() != 0) {
        fprintf(stderr, "cannot register the sources\n");
        return 2;
    }
    /* odbc: the ODBC source; its dialect follows the connected DBMS */
    a.ob.source = cfg_backend_find(CFG_BACKEND_SOURCE, backend);
    if (a.ob.source == NULL) {
        fprintf(stderr, "unknown backend %s\n", backend);
        return 2;
    }
    if (outbox_table_parse(table, &tn, err, sizeof err) < 0) {
        fprintf(stderr, "table: %s\n", err);
        return 2;
    }
    a.ob.table = (char *)table;
    memcpy(a.ob.schema_part, tn.schema, sizeof tn.schema);
    memcpy(a.ob.table_part, tn.table, sizeof tn.table);
    memcpy(a.ob.dead_part, tn.dead, sizeof tn.dead);
    a.ops = source_ops_of(&a.ob);
    if (!a.ops) {
        fprintf(stderr, "no source ops for backend %s\n", backend);
        return 2;
    }

    a.loop = ev_default_loop(EVFLAG_AUTO);
    if (!a.loop) {
        fprintf(stderr, "no event loop\n");
        return 1;
    }
    src_cbs cbs = {.ud = &a, .on_state = on_state, .on_wake = on_wake, .on_done = on_done};
    if (a.ops->create(a.loop, &a.ob, &cbs, &a.src, err, sizeof err) < 0) {
        fprintf(stderr, "create: %s\n", err);
        return 1;
    }
    ev_timer_init(&a.tick, tick_cb, 0.05, 0.05);
    a.tick.data = &a;
    ev_timer_start(a.loop, &a.tick);
    ev_io_init(&a.in, stdin_cb, 0, EV_READ);
    a.in.data = &a;
    ev_io_start(a.loop, &a.in);
    printf("READY %s\n", a.ops->name);
    fflush(stdout);
    ev_run(a.loop, 0);
    if (a.src)
        a.ops->destroy(a.src);
    free(a.drained);
    ev_loop_destroy(a.loop);
    return 0;
}
