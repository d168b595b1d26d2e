/*
 * main.c — outbox-relay: the daemon (`run`) and its admin commands.
 * Only this file exits the process.
 */
#include <errno.h>
#include <ev.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/cfg.h"
#include "outbox.h"
#include "outbox_schema.h"
#include "relay/drain.h"
#include "relay/http.h"
#include "relay/log.h"
#include "relay/metrics.h"
#include "relay/sink.h"
#include "relay/source.h"

#define EXIT_USAGE 2

static void usage(FILE *f)
{
    fputs("usage: outbox-relay COMMAND [options]\n"
          "\n"
          "  run    -c FILE                 drain every [outbox.*] of FILE to its sink\n"
          "  check  -c FILE                 validate FILE, connect to every database and broker,\n"
          "                                 verify database names and schema\n"
          "  schema --dialect postgres|sqlserver [--table SCHEMA.TABLE]\n"
          "                                 print the DDL (default table outbox.messages)\n"
          "  init   -c FILE                 apply the DDL for every outbox (idempotent)\n"
          "  stats  -c FILE                 backlog, oldest pending age, dead rows per outbox\n"
          "  dead   -c FILE list|retry|purge [--outbox NAME] [ID...]\n"
          "                                 inspect, re-send or delete dead-lettered rows\n"
          "  --help, --version\n"
          "\n"
          "Exit status: 0 ok, 1 failure, 2 usage or configuration error.\n"
          "Manual pages: man outbox-relay (commands, signals, files) and\n"
          "man 5 outbox-relay.ini (every configuration key and its default).\n", f);
}

static cfg *load_config(const char *path)
{
    if (path == NULL) {
        fprintf(stderr, "outbox-relay: missing -c FILE\n");
        return NULL;
    }
    cfg *c = NULL;
    cfg_errors errs = { 0 };
    if (cfg_load(path, &c, &errs) != 0) {
        for (size_t i = 0; i < errs.n; i++)
            fprintf(stderr, "%s\n", errs.lines[i]);
        if (errs.n == 0)
            fprintf(stderr, "%s: invalid configuration\n", path);
        cfg_errors_clear(&errs);
        return NULL;
    }
    cfg_errors_clear(&errs);
    return c;
}

/* ---------- run ---------- */

typedef struct relay_state {
    struct ev_loop *loop;
    cfg            *c;
    drain         **drains;
    size_t          n;
    size_t          stopped;
    int             signals;
    int             exit_code;
    ev_signal       sigterm, sigint, sighup;
    ev_timer        shutdown_timer;
    http_server    *http;
} relay_state;

static void on_drain_stopped(void *ud)
{
    relay_state *st = ud;
    if (++st->stopped == st->n) {
        log_msg(LOG_INFO, "all outboxes drained; exiting");
        ev_break(st->loop, EVBREAK_ALL);
    }
}

static void shutdown_timeout_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)revents;
    relay_state *st = w->data;
    log_msg(LOG_WARN, "shutdown_timeout reached with messages still unconfirmed; their leases "
            "are left to expire and they will be published again (same message_id)");
    ev_break(loop, EVBREAK_ALL);
    (void)st;
}

static void stop_signal_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)revents;
    relay_state *st = w->data;
    if (++st->signals > 1) {
        log_msg(LOG_WARN, "second signal: exiting at once");
        st->exit_code = 1;
        ev_break(loop, EVBREAK_ALL);
        return;
    }
    log_msg(LOG_INFO, "signal %d: stopping (shutdown_timeout %" PRId64 " ms)", w->signum,
            st->c->relay.shutdown_timeout_ms);
    ev_timer_init(&st->shutdown_timer, shutdown_timeout_cb,
                  st->c->relay.shutdown_timeout_ms / 1000.0, 0.);
    st->shutdown_timer.data = st;
    ev_timer_start(loop, &st->shutdown_timer);
    for (size_t i = 0; i < st->n; i++)
        drain_stop(st->drains[i], on_drain_stopped, st);
}

static void hup_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)loop; (void)w; (void)revents;
    if (log_reopen() != 0)
        log_msg(LOG_ERROR, "SIGHUP: could not reopen the log file");
    else
        log_msg(LOG_INFO, "SIGHUP: log reopened");
}

static char *metrics_cb(void *ud, size_t *len)
{
    relay_state *st = ud;
    ob_metrics **m = calloc(st->n ? st->n : 1, sizeof *m);
    if (m == NULL)
        return NULL;
    for (size_t i = 0; i < st->n; i++)
        m[i] = drain_metrics(st->drains[i]);
    char *body = metrics_render(m, st->n, len);
    free(m);
    return body;
}

static bool ready_cb(void *ud)
{
    relay_state *st = ud;
    for (size_t i = 0; i < st->n; i++)
        if (!drain_ready(st->drains[i]))
            return false;
    return !st->signals;
}

static int cmd_run(const char *path)
{
    cfg *c = load_config(path);
    if (c == NULL)
        return EXIT_USAGE;
    log_setup(c->relay.log_level, c->relay.log_format, c->relay.log_file);
    signal(SIGPIPE, SIG_IGN);

    relay_state st = { .exit_code = 0 };
    st.c = c;
    st.loop = ev_default_loop(EVFLAG_AUTO);
    if (st.loop == NULL) {
        log_msg(LOG_ERROR, "libev: cannot initialise the loop");
        cfg_free(c);
        return 1;
    }
    st.drains = calloc(c->n_outboxes, sizeof *st.drains);
    if (st.drains == NULL) {
        log_msg(LOG_ERROR, "out of memory");
        cfg_free(c);
        return 1;
    }
    for (size_t i = 0; i < c->n_outboxes; i++) {
        char err[600] = "";
        st.drains[i] = drain_new(st.loop, c, &c->outboxes[i], err, sizeof err);
        if (st.drains[i] == NULL) {
            log_msg(LOG_ERROR, "%s", err);
            st.exit_code = 1;
            goto out;
        }
        st.n++;
    }
    if (c->relay.http_listen != NULL) {
        char err[300] = "";
        http_handlers h = { .ud = &st, .metrics = metrics_cb, .ready = ready_cb };
        st.http = http_start(st.loop, c->relay.http_listen, &h, err, sizeof err);
        if (st.http == NULL) {
            log_msg(LOG_ERROR, "%s", err);
            st.exit_code = 1;
            goto out;
        }
    }
    ev_signal_init(&st.sigterm, stop_signal_cb, SIGTERM);
    ev_signal_init(&st.sigint, stop_signal_cb, SIGINT);
    ev_signal_init(&st.sighup, hup_cb, SIGHUP);
    st.sigterm.data = st.sigint.data = st.sighup.data = &st;
    ev_signal_start(st.loop, &st.sigterm);
    ev_signal_start(st.loop, &st.sigint);
    ev_signal_start(st.loop, &st.sighup);

    log_msg(LOG_INFO, "outbox-relay %s starting as \"%s\": %zu outbox(es)%s%s", OUTBOX_VERSION,
            c->relay.name, c->n_outboxes, c->relay.http_listen ? ", http on " : "",
            c->relay.http_listen ? c->relay.http_listen : "");
    for (size_t i = 0; i < st.n; i++)
        drain_start(st.drains[i]);
    ev_run(st.loop, 0);
    log_msg(LOG_INFO, "outbox-relay stopped");
out:
    http_stop(st.http);
    for (size_t i = 0; i < st.n; i++)
        drain_free(st.drains[i]);
    free(st.drains);
    /* a broker connection attempt still running on a worker thread ends first */
    for (size_t i = 0; i < c->n_sinks; i++) {
        const sink_ops *so = sink_ops_for(&c->sinks[i]);
        if (so != NULL && so->quiesce != NULL)
            so->quiesce(c->sinks[i].connect_timeout_ms + 1000);
    }
    ev_signal_stop(st.loop, &st.sigterm);
    ev_signal_stop(st.loop, &st.sigint);
    ev_signal_stop(st.loop, &st.sighup);
    ev_timer_stop(st.loop, &st.shutdown_timer);
    ev_loop_destroy(st.loop);
    cfg_free(c);
    return st.exit_code;
}

/* ---------- admin commands ---------- */

static int cmd_check(const char *path)
{
    cfg *c = load_config(path);
    if (c == NULL)
        return EXIT_USAGE;
    int problems = 0;
    for (size_t i = 0; i < c->n_outboxes; i++) {
        const cfg_outbox *ob = &c->outboxes[i];
        char err[1024] = "";
        if (source_ops_for(ob)->check(ob, err, sizeof err) != 0) {
            fprintf(stderr, "%s: [outbox.%s] %s\n", path, ob->name, err);
            problems++;
        } else if (err[0]) {
            /* warnings only (e.g. LISTEN/NOTIFY cannot reach the connection): exit 0 */
            fprintf(stderr, "%s: [outbox.%s] %s\n", path, ob->name, err);
        }
    }
    char (*notes)[1024] = calloc(c->n_sinks ? c->n_sinks : 1, sizeof *notes);
    if (notes == NULL) {
        fprintf(stderr, "%s: out of memory\n", path);
        cfg_free(c);
        return 1;
    }
    for (size_t i = 0; i < c->n_sinks; i++) {
        const cfg_sink *sk = &c->sinks[i];
        char err[4096] = "";
        if (sink_ops_for(sk)->check(sk, err, sizeof err) != 0) {
            /* one line per problem: a cluster list may have several */
            for (char *ln = err, *nl; ln != NULL; ln = nl) {
                if ((nl = strchr(ln, '\n')) != NULL)
                    *nl++ = '\0';
                fprintf(stderr, "%s: [sink.%s] %s\n", path, sk->name, ln);
                problems++;
            }
        } else {
            snprintf(notes[i], sizeof notes[i], "%s", err);
        }
    }
    if (problems == 0) {
        /* one line; it names the mode of each outbox */
        printf("%s: OK (%zu outbox(es), %zu sink(s))", path, c->n_outboxes, c->n_sinks);
        for (size_t i = 0; i < c->n_outboxes; i++) {
            const cfg_outbox *ob = &c->outboxes[i];
            if (ob->mode == CFG_MODE_COMPETING)
                printf("; [outbox.%s] mode competing (every relay claims, one relay at a time "
                       "per partition key, row lease %gs)", ob->name, (double)ob->lease_ms / 1000.0);
            else
                printf("; [outbox.%s] mode leader (one active relay, the others stand by, "
                       "lease %gs in %s_lease)", ob->name, (double)ob->lease_ms / 1000.0, ob->table);
        }
        for (size_t i = 0; i < c->n_sinks; i++) {
            if (notes[i][0] != '\0')
                printf("; [sink.%s] %s", c->sinks[i].name, notes[i]);
        }
        putchar('\n');
    }
    free(notes);
    cfg_free(c);
    return problems ? 1 : 0;
}

static int cmd_schema(int argc, char **argv)
{
    const char *dialect = NULL, *table = NULL;
    static const struct option opts[] = {
        { "dialect", required_argument, NULL, 'd' },
        { "table", required_argument, NULL, 't' },
        { NULL, 0, NULL, 0 },
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "d:t:", opts, NULL)) != -1) {
        if (ch == 'd')
            dialect = optarg;
        else if (ch == 't')
            table = optarg;
        else
            return EXIT_USAGE;
    }
    if (optind != argc) {
        fprintf(stderr, "outbox-relay schema: unexpected argument \"%s\"\n", argv[optind]);
        return EXIT_USAGE;
    }
    outbox_dialect d;
    if (dialect != NULL && strcmp(dialect, "postgres") == 0)
        d = OUTBOX_DIALECT_POSTGRES;
    else if (dialect != NULL && strcmp(dialect, "sqlserver") == 0)
        d = OUTBOX_DIALECT_SQLSERVER;
    else {
        fprintf(stderr, "outbox-relay schema: --dialect must be postgres or sqlserver\n");
        return EXIT_USAGE;
    }
    outbox_table_name t;
    char err[300];
    if (outbox_table_parse(table, &t, err, sizeof err) != 0) {
        fprintf(stderr, "outbox-relay schema: --table: %s\n", err);
        return EXIT_USAGE;
    }
    char *script = outbox_ddl_script(d, &t);
    if (script == NULL) {
        fprintf(stderr, "outbox-relay schema: out of memory\n");
        return 1;
    }
    fputs(script, stdout);
    free(script);
    return fflush(stdout) == 0 ? 0 : 1;
}

static int cmd_init(const char *path)
{
    cfg *c = load_config(path);
    if (c == NULL)
        return EXIT_USAGE;
    int failed = 0;
    for (size_t i = 0; i < c->n_outboxes; i++) {
        const cfg_outbox *ob = &c->outboxes[i];
        char err[1024] = "";
        if (source_ops_for(ob)->init(ob, err, sizeof err) != 0) {
            fprintf(stderr, "%s: [outbox.%s] init failed: %s\n", path, ob->name, err);
            failed++;
        } else {
            /* err may say what was created or skipped */
            printf("outbox.%s: schema for %s ready in database \"%s\"%s%s\n", ob->name,
                   ob->table, ob->database, err[0] ? ": " : "", err);
        }
    }
    cfg_free(c);
    return failed ? 1 : 0;
}

static int cmd_stats(const char *path)
{
    cfg *c = load_config(path);
    if (c == NULL)
        return EXIT_USAGE;
    int failed = 0;
    printf("%-20s %-30s %10s %18s %8s %10s\n", "OUTBOX", "TABLE", "BACKLOG", "OLDEST_PENDING_S",
           "DEAD", "SENT_KEPT");
    for (size_t i = 0; i < c->n_outboxes; i++) {
        const cfg_outbox *ob = &c->outboxes[i];
        src_stats s = { 0 };
        char err[1024] = "";
        if (source_ops_for(ob)->stats_sync(ob, &s, err, sizeof err) != 0) {
            fprintf(stderr, "%s: [outbox.%s] %s\n", path, ob->name, err);
            failed++;
            continue;
        }
        printf("%-20s %-30s %10" PRId64 " %18.3f %8" PRId64 " %10" PRId64 "\n", ob->name, ob->table,
               s.backlog, s.oldest_pending_s, s.dead, s.sent_kept);
    }
    cfg_free(c);
    return failed ? 1 : 0;
}

static int parse_ids(int argc, char **argv, int64_t **ids, size_t *n)
{
    *ids = NULL;
    *n = 0;
    if (argc <= 0)
        return 0;
    *ids = calloc((size_t)argc, sizeof **ids);
    if (*ids == NULL)
        return -1;
    for (int i = 0; i < argc; i++) {
        int64_t v;
        if (cfg_parse_int(argv[i], 1, INT64_MAX, &v) != 0) {
            fprintf(stderr, "outbox-relay dead: \"%s\" is not a row id\n", argv[i]);
            free(*ids);
            *ids = NULL;
            return -1;
        }
        (*ids)[(*n)++] = v;
    }
    return 0;
}

static int cmd_dead(const char *path, const char *only, int argc, char **argv)
{
    if (argc < 1) {
        fprintf(stderr, "outbox-relay dead: expected list, retry or purge\n");
        return EXIT_USAGE;
    }
    const char *verb = argv[0];
    if (strcmp(verb, "list") != 0 && strcmp(verb, "retry") != 0 && strcmp(verb, "purge") != 0) {
        fprintf(stderr, "outbox-relay dead: unknown action \"%s\" (list, retry, purge)\n", verb);
        return EXIT_USAGE;
    }
    int64_t *ids = NULL;
    size_t n_ids = 0;
    if (parse_ids(argc - 1, argv + 1, &ids, &n_ids) != 0)
        return EXIT_USAGE;
    if (strcmp(verb, "list") == 0 && n_ids > 0) {
        fprintf(stderr, "outbox-relay dead list: takes no ids\n");
        free(ids);
        return EXIT_USAGE;
    }
    cfg *c = load_config(path);
    if (c == NULL) {
        free(ids);
        return EXIT_USAGE;
    }
    int failed = 0, matched = 0;
    for (size_t i = 0; i < c->n_outboxes; i++) {
        const cfg_outbox *ob = &c->outboxes[i];
        if (only != NULL && strcmp(only, ob->name) != 0)
            continue;
        matched++;
        const source_ops *ops = source_ops_for(ob);
        char err[1024] = "";
        size_t affected = 0;
        int rc;
        if (strcmp(verb, "list") == 0) {
            printf("# outbox.%s (%s)\n", ob->name, ob->table);
            rc = ops->dead_list(ob, stdout, err, sizeof err);
        } else if (strcmp(verb, "retry") == 0) {
            rc = ops->dead_retry(ob, ids, n_ids, &affected, err, sizeof err);
            if (rc == 0)
                printf("outbox.%s: %zu dead row(s) moved back to %s\n", ob->name, affected, ob->table);
        } else {
            rc = ops->dead_purge(ob, ids, n_ids, &affected, err, sizeof err);
            if (rc == 0)
                printf("outbox.%s: %zu dead row(s) purged\n", ob->name, affected);
        }
        if (rc != 0) {
            fprintf(stderr, "%s: [outbox.%s] dead %s: %s\n", path, ob->name, verb, err);
            failed++;
        }
    }
    if (only != NULL && matched == 0) {
        fprintf(stderr, "%s: no [outbox.%s] section\n", path, only);
        failed++;
    }
    free(ids);
    cfg_free(c);
    return failed ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "-V") == 0) {
        printf("outbox-relay %s\n", OUTBOX_VERSION);
        return 0;
    }
    if (strcmp(cmd, "schema") == 0)
        return cmd_schema(argc - 1, argv + 1);

    const char *path = NULL, *only = NULL;
    static const struct option opts[] = {
        { "config", required_argument, NULL, 'c' },
        { "outbox", required_argument, NULL, 'o' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int ch;
    optind = 2;
    while ((ch = getopt_long(argc, argv, "c:o:h", opts, NULL)) != -1) {
        switch (ch) {
        case 'c': path = optarg; break;
        case 'o': only = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return EXIT_USAGE;
        }
    }
    int rest = argc - optind;
    char **restv = argv + optind;
    if (strcmp(cmd, "dead") == 0) {
        /* getopt permutes: options may follow the action (dead list -c f) */
        return cmd_dead(path, only, rest, restv);
    }
    if (rest != 0) {
        fprintf(stderr, "outbox-relay %s: unexpected argument \"%s\"\n", cmd, restv[0]);
        return EXIT_USAGE;
    }
    if (strcmp(cmd, "run") == 0)
        return cmd_run(path);
    if (strcmp(cmd, "check") == 0)
        return cmd_check(path);
    if (strcmp(cmd, "init") == 0)
        return cmd_init(path);
    if (strcmp(cmd, "stats") == 0)
        return cmd_stats(path);
    fprintf(stderr, "outbox-relay: unknown command \"%s\"\n", cmd);
    usage(stderr);
    return EXIT_USAGE;
}
