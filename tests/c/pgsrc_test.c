/*
 * pgsrc_test.c — drives the PostgreSQL source (pgsrc_ops) on a real libev
 * loop, for tests/test_pgsrc.py.
 *
 *   pgsrc_test [options]                    interactive: commands on stdin, events on stdout
 *   pgsrc_test [options] admin CMD [ids..]  one admin call: check | init | stats |
 *                                           dead-list | dead-retry | dead-purge
 * options: --conninfo S --database D --table S.T --on-sent mark|delete --password P
 *          --name N --query-timeout MS --connect-timeout MS --reconnect-max MS
 *
 * Interactive commands (one per line):
 *   start | stop (destroy the source) | quit | echo TEXT
 *   lead NAME | claim MAX LEASE_MS TOKEN OWNER | cleanup RETENTION_MS LIMIT | stats
 *   settle ID:TOKEN:KIND:BACKOFF_MS[:REASON_HEX] ...   (KIND: S sent, R retry, D dead, U unclaim)
 * Output lines:
 *   STATE UP | STATE DOWN <msg> | WAKE <unix µs> | ACCEPT <rc> | ECHO <text>
 *   ROW {json} (before DONE claim) | DONE <req> ok=<n> ... [error=<text>]
 */
#include <ev.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "lib/outbox_schema.h"
#include "relay/row.h"
#include "relay/source.h"
#include "sources/sources.h"

typedef struct app {
    struct ev_loop *loop;
    cfg_outbox ob;
    source *src;
    ev_io in;
    char buf[1 << 16];
    size_t len;
} app;

static int64_t realtime_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
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

static void on_state(void *ud, int state, const char *msg)
{
    (void)ud;
    if (state == SRC_UP)
        printf("STATE UP\n");
    else
        printf("STATE DOWN %s\n", msg ? msg : "");
    fflush(stdout);
}

static void on_wake(void *ud)
{
    (void)ud;
    printf("WAKE %" PRId64 "\n", realtime_us());
    fflush(stdout);
}

static void on_done(void *ud, const src_result *r)
{
    (void)ud;
    if (r->req == SRC_REQ_CLAIM) {
        for (size_t i = 0; i < r->n_rows; i++) {
            const row *w = r->rows[i];
            printf("ROW {\"id\":%" PRId64 ",\"token\":%" PRId64 ",\"attempts\":%d,"
                   "\"created_us\":%" PRId64 ",\"message_id\":\"%s\"",
                   w->id, w->lease_token, w->attempts, w->created_at_us, w->message_id);
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
            row_free(r->rows[i]);  /* the callee owns the rows */
        }
        free(r->rows);
    }
    printf("DONE %s ok=%d", req_name(r->req), r->ok);
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
    if (r->ok != 0)
        printf(" error=%s", r->error ? r->error : "(null)");
    printf("\n");
    fflush(stdout);
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
    src_outcome v[256];
    char *reasons[256];
    size_t n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(args, " ", &save); tok && n < 256; tok = strtok_r(NULL, " ", &save)) {
        char kind = 0, rhex[4096] = "";
        src_outcome *o = &v[n];
        memset(o, 0, sizeof *o);
        reasons[n] = NULL;
        int k = sscanf(tok, "%" SCNd64 ":%" SCNd64 ":%c:%" SCNd64 ":%4095s", &o->id,
                       &o->lease_token, &kind, &o->backoff_ms, rhex);
        if (k < 4) {
            printf("ERR bad outcome %s\n", tok);
            goto out;
        }
        o->kind = kind == 'S' ? SRC_SENT : kind == 'R' ? SRC_RETRY : kind == 'D' ? SRC_DEAD : SRC_UNCLAIM;
        if (k == 5 && unhex(rhex, &reasons[n]) < 0) {
            printf("ERR bad reason hex\n");
            goto out;
        }
        o->reason = reasons[n];
        n++;
    }
    printf("ACCEPT %d\n", pgsrc_ops.settle(a->src, v, n));
    /* the source copied what it needs: clobber ours to prove it */
    for (size_t i = 0; i < n; i++) {
        if (reasons[i])
            memset(reasons[i], 'X', strlen(reasons[i]));
        v[i].id = -1;
        v[i].lease_token = -1;
    }
out:
    for (size_t i = 0; i < n; i++)
        free(reasons[i]);
}

static void command(app *a, char *line)
{
    char *arg = strchr(line, ' ');
    if (arg)
        *arg++ = '\0';
    else
        arg = line + strlen(line);
    if (!strcmp(line, "echo")) {
        printf("ECHO %s\n", arg);
    } else if (!strcmp(line, "quit")) {
        if (a->src)
            pgsrc_ops.destroy(a->src);
        a->src = NULL;
        ev_io_stop(a->loop, &a->in);
        ev_break(a->loop, EVBREAK_ALL);
    } else if (!a->src) {
        printf("ERR no source\n");
    } else if (!strcmp(line, "start")) {
        pgsrc_ops.start(a->src);
        printf("ACCEPT 0\n");
    } else if (!strcmp(line, "stop")) {
        pgsrc_ops.destroy(a->src);
        a->src = NULL;
        printf("STOPPED\n");
    } else if (!strcmp(line, "lead")) {
        /* lead OWNER EPOCH LEASE_MS */
        src_lead_args la = { 0 };
        char owner[256];
        long long ep = 0, lease = 30000;
        if (sscanf(arg, "%255s %lld %lld", owner, &ep, &lease) < 1) {
            printf("ERR usage: lead OWNER [EPOCH [LEASE_MS]]\n");
        } else {
            la.owner = owner;
            la.epoch = ep;
            la.lease_ms = lease;
            printf("ACCEPT %d\n", pgsrc_ops.lead(a->src, &la));
        }
    } else if (!strcmp(line, "claim")) {
        src_claim_args c = { 0 };
        char owner[256], mode[16] = "";
        long long mx, lease, token, ep = 0;
        int got = sscanf(arg, "%lld %lld %lld %255s %lld %15s", &mx, &lease, &token, owner, &ep,
                         mode);
        if (got < 4) {
            printf("ERR usage: claim MAX LEASE_MS TOKEN OWNER [EPOCH [competing]]\n");
        } else {
            c.epoch = ep;
            c.competing = strcmp(mode, "competing") == 0;
            c.max_rows = (size_t)mx;
            c.lease_ms = lease;
            c.lease_token = token;
            c.owner = owner;
            printf("ACCEPT %d\n", pgsrc_ops.claim(a->src, &c));
            memset(owner, 'X', sizeof owner - 1);  /* not kept by the source */
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
            printf("ACCEPT %d\n", pgsrc_ops.cleanup(a->src, &ca));
        }
    } else if (!strcmp(line, "stats")) {
        printf("ACCEPT %d\n", pgsrc_ops.stats(a->src));
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
    if (n < 0 && errno == EINTR)
        return;
    if (n <= 0) {  /* EOF: quit */
        char q[] = "quit";
        command(a, q);
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

static int admin(app *a, int argc, char **argv)
{
    char err[4096] = "";
    int rc = -1;
    size_t affected = 0;
    int64_t ids[64];
    size_t n_ids = 0;
    const char *cmd = argv[0];
    for (int i = 1; i < argc && n_ids < 64; i++)
        ids[n_ids++] = strtoll(argv[i], NULL, 10);
    if (!strcmp(cmd, "check")) {
        rc = pgsrc_ops.check(&a->ob, err, sizeof err);
    } else if (!strcmp(cmd, "init")) {
        rc = pgsrc_ops.init(&a->ob, err, sizeof err);
    } else if (!strcmp(cmd, "stats")) {
        src_stats st;
        rc = pgsrc_ops.stats_sync(&a->ob, &st, err, sizeof err);
        if (rc == 0)
            printf("STATS backlog=%" PRId64 " oldest=%.3f dead=%" PRId64 " sent_kept=%" PRId64 "\n",
                   st.backlog, st.oldest_pending_s, st.dead, st.sent_kept);
    } else if (!strcmp(cmd, "dead-list")) {
        rc = pgsrc_ops.dead_list(&a->ob, stdout, err, sizeof err);
    } else if (!strcmp(cmd, "dead-retry")) {
        rc = pgsrc_ops.dead_retry(&a->ob, n_ids ? ids : NULL, n_ids, &affected, err, sizeof err);
        if (rc == 0)
            printf("AFFECTED %zu\n", affected);
    } else if (!strcmp(cmd, "dead-purge")) {
        rc = pgsrc_ops.dead_purge(&a->ob, n_ids ? ids : NULL, n_ids, &affected, err, sizeof err);
        if (rc == 0)
            printf("AFFECTED %zu\n", affected);
    } else {
        fprintf(stderr, "unknown admin command %s\n", cmd);
        return 2;
    }
    if (rc != 0)
        fprintf(stderr, "%s\n", err);
    return rc == 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
    static app a;
    const char *table = "outbox.messages";
    outbox_table_name tn;
    char terr[256];
    int i;

    a.ob.name = (char *)"test";
    if (sources_register() != 0)
        return 2;
    a.ob.source = cfg_backend_find(CFG_BACKEND_SOURCE, "postgres");
    a.ob.query_timeout_ms = 30000;
    a.ob.connect_timeout_ms = 5000;
    a.ob.reconnect_max_ms = 1000;
    a.ob.on_sent = CFG_ON_SENT_MARK;
    for (i = 1; i + 1 < argc && !strncmp(argv[i], "--", 2); i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--conninfo")) a.ob.conninfo = (char *)v;
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
    if (outbox_table_parse(table, &tn, terr, sizeof terr) < 0) {
        fprintf(stderr, "table: %s\n", terr);
        return 2;
    }
    a.ob.table = (char *)table;
    memcpy(a.ob.schema_part, tn.schema, sizeof tn.schema);
    memcpy(a.ob.table_part, tn.table, sizeof tn.table);
    memcpy(a.ob.dead_part, tn.dead, sizeof tn.dead);

    if (i < argc && !strcmp(argv[i], "admin")) {
        if (i + 1 >= argc) {
            fprintf(stderr, "admin: command missing\n");
            return 2;
        }
        return admin(&a, argc - i - 1, argv + i + 1);
    }

    a.loop = ev_default_loop(EVFLAG_AUTO);
    if (!a.loop) {
        fprintf(stderr, "no event loop\n");
        return 1;
    }
    src_cbs cbs = {.ud = &a, .on_state = on_state, .on_wake = on_wake, .on_done = on_done};
    char err[512];
    if (pgsrc_ops.create(a.loop, &a.ob, &cbs, &a.src, err, sizeof err) < 0) {
        fprintf(stderr, "create: %s\n", err);
        return 1;
    }
    ev_io_init(&a.in, stdin_cb, 0, EV_READ);
    a.in.data = &a;
    ev_io_start(a.loop, &a.in);
    printf("READY\n");
    fflush(stdout);
    ev_run(a.loop, 0);
    if (a.src)
        pgsrc_ops.destroy(a.src);
    ev_loop_destroy(a.loop);
    return 0;
}
