/*
 * main.c — outbox-relay: the daemon (`run`) and its admin commands.
 * Only this file exits the process.
 */
#include <errno.h>
#include <ev.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config/cfg.h"
#include "outbox.h"
#include "outbox_schema.h"
#include "outbox_util.h"
#include "relay/drainset.h"
#include "relay/http.h"
#include "relay/log.h"
#include "relay/looptime.h"
#include "relay/metrics.h"
#include "relay/sink.h"
#include "relay/source.h"
#include "sinks/sinks.h"       /* the composition root: the one place naming the backends */
#include "sources/sources.h"

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
    dset           *set;         /* the drains and the configurations they run on */
    int             signals;
    int             exit_code;
    bool            hup_pending; /* a SIGHUP came while a reload was still in progress */
    ev_signal       sigterm, sigint, sighup, sigusr1, sigusr2;
    ev_timer        shutdown_timer;
    http_server    *http;
    relay_metrics   rm;
    looptime        lt;          /* times each turn of the loop into rm.loop */
} relay_state;

static double wall_now(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return 0;
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void on_all_stopped(void *ud)
{
    relay_state *st = ud;
    log_ev(LOG_INFO, &(log_fields){ .event = "exiting" }, "all outboxes drained; exiting");
    ev_break(st->loop, EVBREAK_ALL);
}

static void shutdown_timeout_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)revents; (void)w;
    log_ev(LOG_WARN, &(log_fields){ .event = "shutdown_timeout" },
           "shutdown_timeout reached with messages still unconfirmed; their leases "
           "are left to expire and they will be published again (same message_id)");
    ev_break(loop, EVBREAK_ALL);
}

static void stop_signal_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)revents;
    relay_state *st = w->data;
    if (++st->signals > 1) {
        log_ev(LOG_WARN, &(log_fields){ .event = "forced_exit" }, "second signal: exiting at once");
        st->exit_code = 1;
        ev_break(loop, EVBREAK_ALL);
        return;
    }
    int64_t timeout_ms = dset_cfg(st->set)->relay.shutdown_timeout_ms;
    log_ev(LOG_INFO, &(log_fields){ .event = "stopping" },
           "signal %d: stopping (shutdown_timeout %" PRId64 " ms)", w->signum, timeout_ms);
    ev_timer_init(&st->shutdown_timer, shutdown_timeout_cb, (double)timeout_ms / 1000.0, 0.);
    st->shutdown_timer.data = st;
    ev_timer_start(loop, &st->shutdown_timer);
    dset_stop(st->set, on_all_stopped, st);
}

static void reload_failed(relay_state *st)
{
    st->rm.reloads_failed++;
    st->rm.last_reload_ok = 0;
}

/* Can the relay write to log_file? Checked before a reload switches to it. */
static int log_file_writable(const char *path, char *err, size_t errlen)
{
    int fd;
    do {
        fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY, 0640);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        snprintf(err, errlen, "%s", strerror(errno));
        return -1;
    }
    (void)close(fd);
    return 0;
}

/* Could this user write to log_file, without creating it (check): the file, or where it
   would be made. -1 with errno set when not. */
static int log_file_may_write(const char *path)
{
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        errno = EISDIR;
        return -1;
    }
    if (access(path, W_OK) == 0)
        return 0;
    if (errno != ENOENT)
        return -1;
    char *dir = strdup(path);
    if (dir == NULL)
        return -1;
    char *slash = strrchr(dir, '/');
    const char *d = slash == NULL ? "." : slash == dir ? "/" : (*slash = '\0', dir);
    int rc = access(d, W_OK | X_OK);
    int e = errno;
    free(dir);
    errno = e;
    return rc;
}

/* Keys that take effect only at start: the file's value is reported and the running
   one kept, so every drain goes on with one identity and the probes stay where they are.
   Returns -1 (out of memory) or 0. */
static int keep_restart_only(const cfg *old, cfg *nc)
{
    const char *path = nc->path;
    if (!outbox_util_str_eq(old->relay.name, nc->relay.name)) {
        char *keep = strdup(old->relay.name);
        if (keep == NULL)
            return -1;
        log_ev(LOG_WARN, &(log_fields){ .event = "config_restart_needed" },
               "SIGHUP: %s: [relay] name: changed to \"%s\", which takes effect "
               "only after a restart; keeping \"%s\"", path, nc->relay.name, old->relay.name);
        free(nc->relay.name);
        nc->relay.name = keep;
    }
    if (!outbox_util_str_eq(old->relay.http_listen, nc->relay.http_listen)) {
        char *keep = NULL;
        if (old->relay.http_listen != NULL && (keep = strdup(old->relay.http_listen)) == NULL)
            return -1;
        log_ev(LOG_WARN, &(log_fields){ .event = "config_restart_needed" },
               "SIGHUP: %s: [relay] http_listen: changed to \"%s\", which takes "
               "effect only after a restart; keeping \"%s\"", path,
               nc->relay.http_listen ? nc->relay.http_listen : "",
               old->relay.http_listen ? old->relay.http_listen : "");
        free(nc->relay.http_listen);
        nc->relay.http_listen = keep;
    }
    return 0;
}

/* SIGHUP: parse → validate → swap, never half-applied. The new file goes through the same
   loader as `check` and `run`; on any problem the running configuration stays, every
   problem is logged at ERROR and nothing changes. */
static void reload(relay_state *st)
{
    const cfg *old = dset_cfg(st->set);
    char *path = strdup(old->path);   /* old may be freed by dset_apply */
    cfg *nc = NULL;
    char *log_file = NULL;
    char err[600] = "";
    if (path == NULL) {
        log_ev(LOG_ERROR, &(log_fields){ .event = "config_reload_failed" },
               "SIGHUP: out of memory; keeping the running configuration");
        goto refused;
    }
    cfg_errors errs = { 0 };
    if (cfg_load(path, &nc, &errs) != 0) {
        /* the lines `check` prints, each already naming the file */
        for (size_t i = 0; i < errs.n; i++)
            log_ev(LOG_ERROR, &(log_fields){ .event = "config_reload_failed" },
                   "SIGHUP: %s; keeping the running configuration", errs.lines[i]);
        if (errs.n == 0)
            log_ev(LOG_ERROR, &(log_fields){ .event = "config_reload_failed" },
                   "SIGHUP: %s: invalid configuration; keeping the running "
                   "configuration", path);
        cfg_errors_clear(&errs);
        goto refused;
    }
    cfg_errors_clear(&errs);
    if (nc->relay.log_file != NULL && !outbox_util_str_eq(nc->relay.log_file, old->relay.log_file) &&
        log_file_writable(nc->relay.log_file, err, sizeof err) != 0) {
        log_ev(LOG_ERROR, &(log_fields){ .event = "config_reload_failed" },
               "SIGHUP: %s: [relay] log_file: cannot open \"%s\": %s; keeping the "
               "running configuration", path, nc->relay.log_file, err);
        goto refused;
    }
    if (keep_restart_only(old, nc) != 0 ||
        (nc->relay.log_file != NULL && (log_file = strdup(nc->relay.log_file)) == NULL)) {
        log_ev(LOG_ERROR, &(log_fields){ .event = "config_reload_failed" },
               "SIGHUP: %s: out of memory; keeping the running configuration", path);
        goto refused;
    }
    char levels[80];
    snprintf(levels, sizeof levels, "log_level %s%s%s", cfg_log_level_name(old->relay.log_level),
             old->relay.log_level != nc->relay.log_level ? " -> " : "",
             old->relay.log_level != nc->relay.log_level
             ? cfg_log_level_name(nc->relay.log_level) : "");
    bool log_changed = old->relay.log_level != nc->relay.log_level ||
                       old->relay.log_format != nc->relay.log_format ||
                       !outbox_util_str_eq(old->relay.log_file, nc->relay.log_file);
    int level = nc->relay.log_level, format = nc->relay.log_format;
    dset_diff df;
    int applied = dset_apply(st->set, nc, &df, err, sizeof err);   /* takes nc */
    nc = NULL;
    if (applied != 0) {
        log_ev(LOG_ERROR, &(log_fields){ .event = "config_reload_failed" },
               "SIGHUP: %s: %s; keeping the running configuration", path, err);
        goto refused;
    }
    /* old is gone from here on */
    if (log_changed)
        log_setup(level, format, log_file);
    free(log_file);
    st->rm.reloads_ok++;
    st->rm.last_reload_ok = 1;
    st->rm.last_reload_success_ts = wall_now();
    log_ev(LOG_INFO, &(log_fields){ .event = "config_reloaded" },
           "SIGHUP: %s: configuration reloaded: %zu outbox(es) added%s%s%s, %zu "
            "removed%s%s%s, %zu restarted%s%s%s, %zu unchanged; %s", path,
            df.added, df.added ? " (" : "", df.added_names, df.added ? ")" : "",
            df.removed, df.removed ? " (" : "", df.removed_names, df.removed ? ")" : "",
            df.restarted, df.restarted ? " (" : "", df.restarted_names, df.restarted ? ")" : "",
            df.unchanged, levels);
    if (dset_busy(st->set) == 0)
        log_ev(LOG_INFO, &(log_fields){ .event = "config_reload_complete" },
               "SIGHUP: reload complete: every outbox runs the new configuration");
    free(path);
    return;
refused:   /* nothing changed */
    cfg_free(nc);
    free(log_file);
    free(path);
    reload_failed(st);
}

/* Every drain of the last reload stopped (and its successor started). */
static void on_reload_done(void *ud)
{
    relay_state *st = ud;
    log_ev(LOG_INFO, &(log_fields){ .event = "config_reload_complete" },
           "SIGHUP: reload complete: every outbox runs the new configuration");
    if (st->hup_pending && !st->signals) {
        st->hup_pending = false;
        log_ev(LOG_INFO, &(log_fields){ .event = "config_reload_deferred" },
               "SIGHUP: applying the signal received during the reload");
        reload(st);
    }
}

/* Reopens log_file (a rotation moved it away); `sig` names the signal that asked. */
static void reopen_log(const char *sig)
{
    if (log_reopen() != 0)
        log_ev(LOG_ERROR, &(log_fields){ .event = "log_reopen_failed" },
               "%s: could not reopen the log file", sig);
    else
        log_ev(LOG_INFO, &(log_fields){ .event = "log_reopened" }, "%s: log reopened", sig);
}

static void hup_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)loop; (void)revents;
    relay_state *st = w->data;
    reopen_log("SIGHUP");
    if (st->signals) {
        log_ev(LOG_INFO, &(log_fields){ .event = "config_reload_skipped" },
               "SIGHUP: stopping; the configuration is not reloaded");
        return;
    }
    size_t busy = dset_busy(st->set);
    if (busy > 0) {
        /* one reload at a time: this one reads the file once the last has settled */
        st->hup_pending = true;
        log_ev(LOG_INFO, &(log_fields){ .event = "config_reload_deferred" },
               "SIGHUP: the previous reload is still in progress (%zu outbox(es) "
               "stopping or waiting); %s will be read again once it is complete", busy,
               dset_cfg(st->set)->path);
        return;
    }
    reload(st);
}

/* SIGUSR1 reopens log_file and does nothing else (what logrotate's postrotate sends to
   daemons that reopen their log on it): the configuration is not read again. */
static void usr1_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)loop; (void)w; (void)revents;
    reopen_log("SIGUSR1");
}

/* SIGUSR2 means nothing here; a stray one must not end the relay (its default action). */
static void usr2_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)loop; (void)w; (void)revents;
    log_ev(LOG_WARN, &(log_fields){ .event = "signal_ignored" },
           "SIGUSR2: ignored (SIGHUP reopens the log file and reloads the configuration, "
           "SIGUSR1 only reopens the log file)");
}

/* SIG_IGN for the signals the loop handles while it does not (before it starts watching
   them and after it stops): their default action would end the process. */
static void ignore_user_signals(void)
{
    if (signal(SIGUSR1, SIG_IGN) == SIG_ERR || signal(SIGUSR2, SIG_IGN) == SIG_ERR)
        log_ev(LOG_WARN, &(log_fields){ .event = "signal_ignored" },
               "cannot ignore SIGUSR1/SIGUSR2: %s", strerror(errno));
}

static char *metrics_cb(void *ud, size_t *len)
{
    relay_state *st = ud;
    size_t n = dset_count(st->set);
    ob_metrics **m = calloc(n ? n : 1, sizeof *m);
    if (m == NULL)
        return NULL;
    n = dset_metrics(st->set, m, n);
    st->rm.rows_in_memory = dset_budget(st->set)->used;
    st->rm.rows_in_memory_limit = dset_budget(st->set)->limit;
    st->rm.bytes_in_memory = dset_budget(st->set)->used_bytes;
    st->rm.bytes_in_memory_limit = dset_budget(st->set)->limit_bytes;
    char *body = metrics_render(&st->rm, m, n, len);
    free(m);
    return body;
}

static bool ready_cb(void *ud)
{
    relay_state *st = ud;
    return dset_ready(st->set) && !st->signals;
}

static int cmd_run(const char *path)
{
    cfg *c = load_config(path);
    if (c == NULL)
        return EXIT_USAGE;
    log_setup(c->relay.log_level, c->relay.log_format, c->relay.log_file);
    signal(SIGPIPE, SIG_IGN);
    ignore_user_signals();

    relay_state st = { .exit_code = 0, .rm = { .last_reload_ok = 1 } };
    st.rm.last_reload_success_ts = wall_now();
    st.loop = ev_default_loop(EVFLAG_AUTO);
    if (st.loop == NULL) {
        log_ev(LOG_ERROR, &(log_fields){ .event = "startup_failed" },
               "libev: cannot initialise the loop");
        cfg_free(c);
        return 1;
    }
    st.set = dset_new(st.loop);
    if (st.set == NULL) {
        log_ev(LOG_ERROR, &(log_fields){ .event = "startup_failed" }, "out of memory");
        cfg_free(c);
        ev_loop_destroy(st.loop);
        return 1;
    }
    dset_on_idle(st.set, on_reload_done, &st);
    char err[600] = "";
    if (c->relay.http_listen != NULL) {
        /* bound first: no drain starts (no connection thread either) if the port is taken */
        http_handlers h = { .ud = &st, .metrics = metrics_cb, .ready = ready_cb };
        st.http = http_start(st.loop, c->relay.http_listen, &h, err, sizeof err);
        if (st.http == NULL) {
            log_ev(LOG_ERROR, &(log_fields){ .event = "startup_failed" }, "%s", err);
            st.exit_code = 1;
            cfg_free(c);
            goto out;
        }
    }
    if (dset_apply(st.set, c, NULL, err, sizeof err) != 0) {   /* takes c */
        log_ev(LOG_ERROR, &(log_fields){ .event = "startup_failed" }, "%s", err);
        st.exit_code = 1;
        goto out;
    }
    const cfg *cur = dset_cfg(st.set);
    ev_signal_init(&st.sigterm, stop_signal_cb, SIGTERM);
    ev_signal_init(&st.sigint, stop_signal_cb, SIGINT);
    ev_signal_init(&st.sighup, hup_cb, SIGHUP);
    ev_signal_init(&st.sigusr1, usr1_cb, SIGUSR1);
    ev_signal_init(&st.sigusr2, usr2_cb, SIGUSR2);
    st.sigterm.data = st.sigint.data = st.sighup.data = &st;
    st.sigusr1.data = st.sigusr2.data = &st;
    ev_signal_start(st.loop, &st.sigterm);
    ev_signal_start(st.loop, &st.sigint);
    ev_signal_start(st.loop, &st.sighup);
    ev_signal_start(st.loop, &st.sigusr1);
    ev_signal_start(st.loop, &st.sigusr2);

    log_ev(LOG_INFO, &(log_fields){ .event = "starting" },
           "outbox-relay %s starting as \"%s\": %zu outbox(es)%s%s", OUTBOX_VERSION,
           cur->relay.name, cur->n_outboxes, cur->relay.http_listen ? ", http on " : "",
           cur->relay.http_listen ? cur->relay.http_listen : "");
    looptime_start(&st.lt, st.loop, &st.rm.loop);
    ev_run(st.loop, 0);
    looptime_stop(&st.lt);
    log_ev(LOG_INFO, &(log_fields){ .event = "stopped" }, "outbox-relay stopped");
out:
    http_stop(st.http);
    {
        /* a broker connection attempt still running on a worker thread ends first */
        int64_t quiesce_ms = dset_connect_timeout_max(st.set) + 1000;
        const cfg *last = dset_cfg(st.set);
        const sink_ops *so[CFG_MAX_BACKENDS];   /* each sink implementation once */
        size_t n_so = 0;
        for (size_t i = 0; last != NULL && i < last->n_sinks; i++) {
            const sink_ops *o = sink_ops_of(&last->sinks[i]);
            bool seen = false;
            for (size_t j = 0; j < n_so && !seen; j++)
                seen = so[j] == o;
            if (!seen && n_so < CFG_MAX_BACKENDS)
                so[n_so++] = o;
        }
        dset_free(st.set);   /* every drain and configuration */
        for (size_t j = 0; j < n_so; j++)
            if (so[j]->quiesce != NULL)
                so[j]->quiesce(quiesce_ms);
    }
    ev_signal_stop(st.loop, &st.sigterm);
    ev_signal_stop(st.loop, &st.sigint);
    ev_signal_stop(st.loop, &st.sighup);
    ev_signal_stop(st.loop, &st.sigusr1);   /* back to SIG_DFL: */
    ev_signal_stop(st.loop, &st.sigusr2);
    ignore_user_signals();                  /* ignored again until the process ends */
    ev_timer_stop(st.loop, &st.shutdown_timer);
    ev_loop_destroy(st.loop);
    return st.exit_code;
}

/* ---------- admin commands ---------- */

static int cmd_check(const char *path)
{
    cfg *c = load_config(path);
    if (c == NULL)
        return EXIT_USAGE;
    int problems = 0;
    if (c->relay.log_file != NULL && log_file_may_write(c->relay.log_file) != 0)
        /* a warning: check may run as another user than the service's, and run logs to
           stderr then (ERROR log_open_failed) */
        fprintf(stderr, "%s: [relay] WARNING: log_file: this user cannot open \"%s\" for "
                "writing: %s (outbox-relay run logs to stderr if its user cannot either)\n",
                path, c->relay.log_file, strerror(errno));
    for (size_t i = 0; i < c->n_outboxes; i++) {
        const cfg_outbox *ob = &c->outboxes[i];
        char err[1024] = "";
        if (source_ops_of(ob)->check(ob, err, sizeof err) != 0) {
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
        if (sink_ops_of(sk)->check(sk, err, sizeof err) != 0) {
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
        if (source_ops_of(ob)->init(ob, err, sizeof err) != 0) {
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
        if (source_ops_of(ob)->stats_sync(ob, &s, err, sizeof err) != 0) {
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
        bool seen = false;   /* an id given twice counts once */
        for (size_t k = 0; k < *n && !seen; k++)
            seen = (*ids)[k] == v;
        if (!seen)
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
    size_t total = 0;   /* rows retried or purged, over the outboxes */
    for (size_t i = 0; i < c->n_outboxes; i++) {
        const cfg_outbox *ob = &c->outboxes[i];
        if (only != NULL && strcmp(only, ob->name) != 0)
            continue;
        matched++;
        const source_ops *ops = source_ops_of(ob);
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
        total += affected;
    }
    if (only != NULL && matched == 0) {
        fprintf(stderr, "%s: no [outbox.%s] section\n", path, only);
        failed++;
    }
    /* a mistyped id must not pass for done */
    if (failed == 0 && n_ids > 0 && total < n_ids) {
        fprintf(stderr, "outbox-relay dead %s: %zu of the %zu ids given matched no dead row "
                "(outbox-relay dead list shows them)\n", verb, n_ids - total, n_ids);
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
    if (sources_register() != 0 || sinks_register() != 0) {
        fprintf(stderr, "outbox-relay: cannot register the built-in sources and sinks\n");
        return 1;
    }

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
