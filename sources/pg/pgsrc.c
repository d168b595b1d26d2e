/*
 * pgsrc.c — the PostgreSQL source, daemon side: libpq's asynchronous API on
 * the libev loop (connect with PQconnectPoll, queries with PQsendQueryParams,
 * results via PQconsumeInput/PQisBusy/PQgetResult, LISTEN/NOTIFY wake-ups).
 *
 * One connection per source, one state per connection:
 *   IDLE → (start) → BACKOFF → CONNECTING → SETUP → UP
 * and back to BACKOFF on any failure (capped exponential back-off, jitter).
 * SETUP runs, in order: database-name check (PQdb, no round trip),
 * session settings (statement_timeout, server-side TCP keepalives), fencing
 * (our previous session, if the server still has it, is terminated), schema
 * check (to_regclass), LISTEN. Through a pooler (PgBouncer: the backend pid
 * the connection announced is not pg_backend_pid()) the session steps are
 * skipped — under transaction pooling they would land on a shared server
 * connection — and so is LISTEN (logged once at WARN): polling finds new rows.
 * Correctness never depends on the session: leadership and row leases are rows.
 *
 * At most one query is in flight: either a SETUP step or the core's one
 * outstanding request. Every callback into the core may destroy the source;
 * cb_* return false then and the caller returns at once without touching it.
 */
#include <errno.h>
#include <ev.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <libpq-fe.h>
#include "lib/outbox_schema.h"
#include "lib/outbox_util.h"
#include "relay/log.h"
#include "relay/row.h"
#include "relay/source.h"
#include "sources/pg/pgsrc_int.h"

#define BACKOFF_MIN_MS 100

enum phase { PH_IDLE = 0, PH_BACKOFF, PH_CONNECTING, PH_SETUP, PH_UP };
enum qop { Q_NONE = 0, Q_SET_TIMEOUT, Q_FENCE, Q_CHECK_SCHEMA, Q_LISTEN, Q_REQ_PREPARE, Q_REQ,
           Q_REQ_LISTEN, Q_FLOOR_PREPARE, Q_REQ_FLOOR, Q_LOAD };

/* While claims keep finding rows the claiming session does not need each commit's
   notification, and each costs its backend a wake-up and a read of the queue (~30 us, one
   per message at steady load). A claim that carries at least QUIET_ROWS rows makes the
   next claim UNLISTEN first; while not listening, every claim's answer wakes the drain
   itself (it claims again claim_delay later, as a notification would have made it), and
   the second claim in a row that finds nothing makes the next one LISTEN first: that
   claim then takes whatever was committed before the LISTEN, and the notifications do the
   rest. (One empty claim is common in a stream of a few rows per claim_delay; after it the
   next claim comes claim_delay later as it would have, without a LISTEN and an UNLISTEN.) */
#define QUIET_ROWS 4
#define QUIET_EMPTY 2
/* The claims' parameters ($1..$12 of sql_pg_claim_sliced); $9 is the floor, $12 where the
   walk starts (the floor, or past it: see claim_answered). */
#define CLAIM_NPARAMS 12
#define CLAIM_FLOOR 8
#define CLAIM_START 11
/* Past the rows of a transaction still open. A claim's walk from the floor steps over the
   index entries of every row written by a transaction that has not ended, which it cannot
   see yet: with 1,000,000 rows of a bulk load open, each claim and each floor probe stepped
   over all of them, and every other producer's message waited 0.44 s. When a claim from
   the floor took PASS_MIN_S or more and found all it could (fewer rows than asked for,
   within half the byte limit, and not an empty answer that a first row over the limit may
   have cut) while the last probe saw a lock holder of the one before still there, the
   next claims start past the ids drawn before it (the newest probe's sequence value), for
   PASS_SHARE times as long as it took (between PASS_MIN_T_S and PASS_MAX_T_S); then one
   walks from the floor again, and a timer wakes the drain for it.
   So does the first claim after any sign of a change below: a probe that saw every lock
   holder of the one before ended (the open transaction among them), rows given back to
   the table (src_claim_args.given_back), a claim that failed, lost claims to take back.
   Such a claim takes no row of a key that has a pending row it passed over
   (SQL_PG_NONE_PASSED_OVER), so a key's rows still go in id order; a row below the start
   waits for the next claim from the floor. */
#define PASS_MIN_S 0.02
#define PASS_SHARE 20.0
#define PASS_MIN_T_S 1.0
#define PASS_MAX_T_S 10.0
/* At most one INFO line about it this often. */
#define PASS_LOG_S 600.0
/* The floor probe (sql_pg_floor_probe) runs before a claim at most this often. The floor
   trails the pending rows by about three probes (it moves past ids only once the next
   probes saw their producers ended), and each claim's walk crosses the entries of the rows
   marked since: with the xmin horizon held back none of them goes, and at 0.25 s the claims
   took twice as long as at 0.05 s (0.75 and 0.41 ms at 1,000 rows a second); the prepared
   probe costs about 0.2 ms (1 ms with the horizon held) a time. The first
   probe FLOOR_FULL_S after the last one that did looks for the lowest pending row from the
   table's start, which finds a row written below the floor with an explicit id
   (outbox-relay dead retry keeps the ids). That probe crosses the pending rows' index
   entries of every row marked since the last vacuum (all of them while the xmin horizon is
   held back: over 100 ms seen), and the claim waits behind it, so the next one comes no
   sooner than FLOOR_FULL_SHARE times as long as it took after it began, nor later than
   FLOOR_FULL_MAX_S: such probes take at most 1/FLOOR_FULL_SHARE of the session's time
   (until they take over 60 ms), and a claim waits behind a slow one rarely enough to leave
   the 99th percentile of the latency alone. */
#define FLOOR_PROBE_S 0.1
#define FLOOR_FULL_S 5.0
#define FLOOR_FULL_SHARE 1000.0
#define FLOOR_FULL_MAX_S 60.0
enum { LS_OFF = 0, LS_ON, LS_QUIET };

/* One floor probe's answer (sql_pg_floor_probe). */
typedef struct floor_probe {
    int64_t m, lv;            /* lowest pending id (m_none: none), the sequence's last value */
    bool    m_none, ended;    /* ended: every lock holder of the probe before had ended */
    char   *w;                /* the lock holders (text[]), NULL none */
} floor_probe;

/* The requests' statements are prepared once per session, at their first use (not
   through a pooler, whose server sessions are shared; not during setup, which must not
   wait for a lock on the outbox table): parsed, rewritten and planned once, a generic
   plan (plan_cache_mode = force_generic_plan, with sequential scans off: see
   Q_SET_TIMEOUT). The floor probe, which goes before a claim, is prepared alike
   (Q_FLOOR_PREPARE). */
enum { ST_LEAD = 0, ST_CLAIM, ST_CLAIM_COMPETING, ST_SETTLE, ST_SETTLE_SENT, ST_CLEANUP,
       ST_STATS, ST_HEALTH, ST_FLOOR, ST_COUNT };
static const char *const st_name[ST_COUNT] = {
    "outbox_relay_lead", "outbox_relay_claim", "outbox_relay_claim_competing",
    "outbox_relay_settle", "outbox_relay_settle_sent", "outbox_relay_cleanup",
    "outbox_relay_stats", "outbox_relay_health", "outbox_relay_floor",
};

struct source {
    struct ev_loop *loop;
    src_cbs   cbs;
    /* configuration (copies; conninfo and password are secrets: never logged) */
    cfg_outbox cfg;          /* scalar fields; the string pointers below are ours */
    char     *conninfo, *password, *database, *name;
    sql_pg_names names;
    char     *sql_lead, *sql_settle, *sql_settle_sent;
    /* the claims in their forms (sql_pg_claim_sliced): for the relay's own session
       (walk; competing: with or without the table's index of the delayed rows) and for
       a pooled one (plain); and the two for this session, set by the schema check before
       any statement is sent */
    char       *sql_leader_walk, *sql_leader_plain;
    char       *sql_competing_idx, *sql_competing_noidx, *sql_competing_plain;
    const char *sql_claim, *sql_claim_competing;
    char     *sql_cleanup, *sql_stats, *sql_health, *sql_slices;
    bool      prepared[ST_COUNT]; /* this session has the statement prepared */
    int       prep_st;        /* Q_REQ_PREPARE: the statement, then run with these: */
    int       prep_n, prep_fmt;
    char     *prep_vals[CLAIM_NPARAMS];   /* as many as the claims have, the most of any request */

    PGconn   *conn;
    int       phase;          /* enum phase */
    ev_io     io;
    bool      io_on;
    ev_timer  deadline;       /* connect timeout, or the query in flight's client-side bound */
    ev_timer  retry;          /* back-off before the next connect */
    ev_timer  defer;          /* completes a request from the loop without a query */
    int64_t   backoff_ms;
    uint64_t  rng;
    bool      flushing;       /* PQflush had more to send */
    char      notice[256];    /* last notice/async error from the server, for DOWN messages */

    int       qop;            /* enum qop: what the query in flight is */
    PGresult *qres;           /* its result so far (the first error wins) */

    int       req;            /* enum src_req outstanding, 0 none */
    bool      req_deferred;
    src_result dres;          /* the deferred result */
    int64_t   claim_token;    /* the outstanding claim's token, copied into its rows */
    pgsrc_rows crows;         /* the running claim's rows so far (pgsrc_rows.c) */
    char      derr[512];

    char      prev_pid[16];   /* our previous session on the server: pid and backend_start */
    char      prev_start[64];
    char      holder[256];    /* the leadership holder named by the last lead answer */
    char      member[256];    /* the live member (competing mode) named by it */
    char      h_kind[24], h_name[128], h_state[64], h_xmin[24];  /* the last health answer's */
    bool      pooled;         /* a pooler answers for the server (see Q_SET_TIMEOUT) */
    int       listen;         /* LS_*: this session's LISTEN (QUIET_ROWS) */
    bool      unlisten_next, listen_next;   /* the next claim sends UNLISTEN / LISTEN first */
    int       quiet_empty;    /* LS_QUIET: claims in a row that found nothing */
    char     *lq_vals[CLAIM_NPARAMS];     /* Q_REQ_LISTEN, Q_REQ_FLOOR: the claim's values */
    bool      index_warned;   /* the missing index of the delayed rows was logged */
    const char *lq_sql;
    /* The claims' floor (sql_pg_floor_probe): their walk starts there. Per session. */
    char     *sql_floor;
    int64_t   floor_id;       /* the claims' $9: 0 the table's start */
    bool      floor_off;      /* the probe cannot run on this session: no floor */
    bool      floor_warned;   /* said once per process why there is no floor */
    double    floor_due;      /* ev_now() of the next probe */
    double    floor_full_due; /* ev_now() of the next probe from the table's start */
    double    floor_full_at;  /* ev_now() when the one outstanding began (0: none is) */
    char      floor_from[24]; /* the outstanding probe's $1 */
    unsigned  fp_n;           /* probes answered on this session */
    floor_probe fp[4];        /* the last four answered, probe k at k % 4 */
    /* Claims that start past the floor (CLAIM_START, PASS_*): from pass_from (0: none)
       until pass_until. */
    int64_t   pass_from;
    double    pass_until;
    ev_timer  pass_end;       /* wakes the drain at pass_until after a claim that passed */
    double    pass_logged;    /* ev_now() of the last INFO line about it (0: none) */
    double    claim_sent;     /* the claim in flight: ev_now() it was sent, how long its
                                 statement took (its payloads read in slices apart), */
    double    claim_took;
    bool      claim_full;     /* whether it walks from the floor, */
    int64_t   claim_lv;       /* the newest probe's sequence value then (-1: none), */
    size_t    claim_max_rows, claim_max_bytes, claim_n_lost;   /* and its limits */
    bool      claim_whole;
    int       server_pid;     /* pg_backend_pid() seen at setup */

    /* A conninfo naming several hosts: the one the next connect starts with (0: the
       first, as libpq would). Moved past a host that let a connect time out. */
    int       host_first;

    int       cb_depth;
    bool      destroyed;
};

/* ------------------------------------------------------------ helpers */

static void prep_clear(source *s);
static void floor_reset(source *s);
static const char *claim_start(source *s, char buf[24]);
static void claim_answered(source *s, const src_result *res);
static void floor_done(source *s, PGresult *r);
static void floor_prepared(source *s, PGresult *r);

static void lq_clear(source *s);

static void src_free(source *s)
{
    pgsrc_rows_free(&s->crows);
    lq_clear(s);
    free(s->conninfo);
    if (s->password) {
        explicit_bzero(s->password, strlen(s->password));
        free(s->password);
    }
    free(s->database);
    free(s->name);
    free(s->sql_lead);
    free(s->sql_leader_walk);
    free(s->sql_leader_plain);
    free(s->sql_settle);
    free(s->sql_settle_sent);
    free(s->sql_cleanup);
    free(s->sql_stats);
    free(s->sql_health);
    free(s->sql_slices);
    free(s->sql_floor);
    for (size_t i = 0; i < sizeof s->fp / sizeof s->fp[0]; i++)
        free(s->fp[i].w);
    prep_clear(s);
    free(s->sql_competing_idx);
    free(s->sql_competing_noidx);
    free(s->sql_competing_plain);
    free(s);
}

static bool after_cb(source *s)
{
    if (!s->destroyed)
        return true;
    if (s->cb_depth == 0)
        src_free(s);
    return false;
}

static bool cb_state(source *s, int st, const char *msg)
{
    if (!s->cbs.on_state)
        return true;
    s->cb_depth++;
    s->cbs.on_state(s->cbs.ud, st, msg);
    s->cb_depth--;
    return after_cb(s);
}

static bool cb_wake(source *s)
{
    if (!s->cbs.on_wake)
        return true;
    s->cb_depth++;
    s->cbs.on_wake(s->cbs.ud);
    s->cb_depth--;
    return after_cb(s);
}

/* Ownership of res->rows passes to the callee. */
static bool cb_done(source *s, const src_result *res)
{
    if (!s->cbs.on_done) {
        for (size_t i = 0; i < res->n_rows; i++)
            row_free(res->rows[i]);
        free(res->rows);
        return true;
    }
    s->cb_depth++;
    s->cbs.on_done(s->cbs.ud, res);
    s->cb_depth--;
    return after_cb(s);
}

static void notice_cb(void *arg, const char *message)
{
    source *s = arg;
    pgsrc_oneline(message, s->notice, sizeof s->notice);
}

static void io_watch(source *s, int fd, int events)
{
    if (s->io_on && s->io.fd == fd && (s->io.events & (EV_READ | EV_WRITE)) == events)
        return;
    if (s->io_on)
        ev_io_stop(s->loop, &s->io);
    ev_io_set(&s->io, fd, events);
    ev_io_start(s->loop, &s->io);
    s->io_on = true;
}

static void io_off(source *s)
{
    if (s->io_on) {
        ev_io_stop(s->loop, &s->io);
        s->io_on = false;
    }
}

static void deadline_set(source *s, int64_t ms)
{
    ev_timer_stop(s->loop, &s->deadline);
    ev_timer_set(&s->deadline, (double)ms / 1000.0, 0.);
    ev_timer_start(s->loop, &s->deadline);
}

/* Closes the connection and forgets everything tied to the session. */
static void conn_close(source *s)
{
    io_off(s);
    ev_timer_stop(s->loop, &s->deadline);
    if (s->qres) {
        PQclear(s->qres);
        s->qres = NULL;
    }
    pgsrc_rows_free(&s->crows);
    s->qop = Q_NONE;
    s->flushing = false;
    if (s->conn) {
        PQfinish(s->conn);
        s->conn = NULL;
    }
}

static void schedule_reconnect(source *s)
{
    int64_t max = s->cfg.reconnect_max_ms > 0 ? s->cfg.reconnect_max_ms : 30000;
    int64_t d = outbox_util_jitter(s->backoff_ms < max ? s->backoff_ms : max, &s->rng);
    s->backoff_ms = outbox_util_backoff_next(s->backoff_ms, BACKOFF_MIN_MS, max);
    s->phase = PH_BACKOFF;
    ev_timer_stop(s->loop, &s->retry);
    ev_timer_set(&s->retry, (double)d / 1000.0, 0.);
    ev_timer_start(s->loop, &s->retry);
}

/* The connection is gone or unusable: fail the outstanding request first
 * (so the core can forget it), then report DOWN, then reconnect later. */
static void conn_fail(source *s, const char *msg)
{
    int req = s->req;
    conn_close(s);
    schedule_reconnect(s);
    if (req) {
        src_result res;
        memset(&res, 0, sizeof res);
        s->req = 0;
        s->req_deferred = false;
        ev_timer_stop(s->loop, &s->defer);
        res.req = req;
        res.ok = -1;
        res.error = msg;
        if (!cb_done(s, &res))
            return;
    }
    cb_state(s, SRC_DOWN, msg);
}

static void conn_lost(source *s, const char *what)
{
    /* room for libpq's message about every host of a multi-host conninfo: the reason
       of the last one tried comes last ("session is read-only") */
    char one[2048], msg[2400];
    pgsrc_oneline(s->conn ? PQerrorMessage(s->conn) : "", one, sizeof one);
    if (s->notice[0] && !strstr(one, s->notice))
        snprintf(msg, sizeof msg, "%s: %s%s%s", what, s->notice, one[0] ? "; " : "", one);
    else
        snprintf(msg, sizeof msg, "%s: %s", what, one[0] ? one : "connection closed");
    conn_fail(s, msg);
}

/* ------------------------------------------------------------ queries */

static int q_flush(source *s)
{
    int rc = PQflush(s->conn);
    if (rc < 0)
        return -1;
    s->flushing = rc == 1;
    io_watch(s, PQsocket(s->conn), s->flushing ? EV_READ | EV_WRITE : EV_READ);
    return 0;
}

/* Sends one statement; the result arrives through io_cb → q_done. 0 or -1
 * (connection unusable: the caller handles it). */
/* A claim's rows are read one at a time (PGRES_SINGLE_TUPLE) and turned into rows as they
   come: libpq never holds the whole result beside the rows built from it, so a claim of
   many large rows costs their size once, not twice. So are the slices of a payload read
   after its claim (pgsrc_rows.c). Called right after such a statement was sent, whichever
   way (text or prepared); any other statement is read whole. Should libpq refuse (it
   cannot, right after a send), the result is read whole: correct, only larger. */
static void claim_row_by_row(source *s, const char *sql)
{
    if (sql == s->sql_claim || sql == s->sql_claim_competing || sql == s->sql_slices)
        (void)PQsetSingleRowMode(s->conn);
}

static int q_send(source *s, int op, const char *sql, int n, const char *const *vals,
                  int result_format)
{
    if (!PQsendQueryParams(s->conn, sql, n, NULL, vals, NULL, NULL, result_format))
        return -1;
    claim_row_by_row(s, sql);
    s->qop = op;
    if (q_flush(s) < 0)
        return -1;
    /* bounded on our side too: a silent network would otherwise hang forever */
    int64_t slack = s->cfg.connect_timeout_ms > 1000 ? s->cfg.connect_timeout_ms : 1000;
    deadline_set(s, s->cfg.query_timeout_ms + slack);
    return 0;
}

static void setup_fail(source *s, const char *msg)
{
    conn_fail(s, msg);
}

static void setup_step(source *s, int op)
{
    char sql[768], pid[24];
    const char *vals[4];
    int rc = 0;
    switch (op) {
    case Q_SET_TIMEOUT:
        /* Session settings, only when the server session is ours: the backend pid the
           connection announced (BackendKeyData) is the server's. A pooler (PgBouncer)
           announces its own: a setting would then land on a pooled server connection,
           be lost for us at the next transaction and leak to that connection's next
           client. Correctness never depends on them (every query is bounded on our
           side too). Server-side keepalives: a vanished relay's session goes away in
           about a minute instead of the kernel's two hours. Prepared statements planned
           once (a generic plan, plan_cache_mode = force_generic_plan): planning a claim
           of a few rows cost twice its execution (0.47 ms against 0.21 under steady
           load), and the claims' plans are the same with or without the values (their
           every lookup is an index probe or an ordered index walk). Left to PostgreSQL
           (auto: the first five executions planned with their values, then the generic
           plan if it is estimated to cost no more than their average), the choice
           turned on estimates a few percent apart: a claim whose walk also filters out
           the rows of keys held back was planned again at every execution (1.26 ms of
           planning a claim under steady load). A generic plan is kept until the table's
           statistics or definition change, so it must not follow the statistics of a
           nearly empty table, where reading the table is the cheapest way to find any
           row (one made at 5 rows found the claimed rows by reading the table, and kept
           doing so as it grew: 1.6 s per claim at 15,000 rows). No sequential scan where
           an index answers (enable_seqscan off): every row the relay's statements read,
           they reach through an index whatever the statistics say. No sort where
           a plan without one exists (enable_sort off, and from PostgreSQL 13 on
           enable_incremental_sort, which enable_sort leaves on): the claims' lookups by
           key are written so that only one index answers each without a sort (on
           (partition_key, id), or delayed_idx for the claims' look for rows not due),
           which the planner would otherwise not always prefer when the statistics
           were taken while no row was pending (it then believes pending_idx holds about
           one row, and walks it), nor, for delayed_idx, when they saw many keys and the
           backlog is one key's (key_idx, ordered by key, then sorted a little at a time:
           a read of the key's rows per candidate, 0.7 s a claim of 500 rows); the relay's
           other statements sort only what no index orders. No JIT: compiling costs more
           than any of these statements runs, and a plan with an unavoidable sort costs
           enough, with sorts ruled out, to have it compiled at every execution (2 s
           seen). */
        snprintf(pid, sizeof pid, "%d", PQbackendPID(s->conn));
        vals[0] = pid;
        snprintf(sql, sizeof sql, "SELECT pg_backend_pid(), CASE WHEN pg_backend_pid() = $1::int "
                 "THEN concat(set_config('statement_timeout', '%" PRId64 "', false), "
                 "set_config('tcp_keepalives_idle', '30', false), "
                 "set_config('tcp_keepalives_interval', '10', false), "
                 "set_config('tcp_keepalives_count', '3', false), "
                 "set_config('plan_cache_mode', 'force_generic_plan', false), "
                 "set_config('enable_seqscan', 'off', false), "
                 "set_config('enable_sort', 'off', false), "
                 "CASE WHEN current_setting('server_version_num')::int >= 130000 "
                 "THEN set_config('enable_incremental_sort', 'off', false) END, "
                 "set_config('jit', 'off', false)) END",
                 s->cfg.query_timeout_ms);
        rc = q_send(s, op, sql, 1, vals, 0);
        break;
    case Q_FENCE:
        /* Our previous session may still exist on the server (a connection that went
           silent rather than closed): end it, identified by pid and start time so an
           unrelated backend reusing the pid is never touched. Then remember this one. */
        /* Through a pooler, never: "our previous session" is a pooled server
           connection that other clients use (the guard on $3 checks it server-side). */
        vals[0] = s->prev_pid[0] ? s->prev_pid : NULL;
        vals[1] = s->prev_start[0] ? s->prev_start : NULL;
        snprintf(pid, sizeof pid, "%d", PQbackendPID(s->conn));
        vals[2] = pid;
        rc = q_send(s, op,
                    "SELECT (SELECT count(pg_terminate_backend(a.pid)) FROM pg_stat_activity a "
                    "WHERE a.pid = $1::int AND a.backend_start = $2::timestamptz "
                    "AND a.pid <> pg_backend_pid() AND pg_backend_pid() = $3::int), "
                    "pg_backend_pid(), "
                    "(SELECT backend_start::text FROM pg_stat_activity WHERE pid = pg_backend_pid())",
                    3, vals, 0);
        break;
    case Q_CHECK_SCHEMA: {
        char *q = sql_pg_tables_exist();
        vals[0] = s->names.table;
        vals[1] = s->names.dead;
        vals[2] = s->names.lease;
        vals[3] = s->names.delayed;
        rc = q ? q_send(s, op, q, 4, vals, 0) : -1;
        free(q);
        break;
    }
    case Q_LISTEN:
        rc = q_send(s, op, "LISTEN " OUTBOX_NOTIFY_CHANNEL, 0, NULL, 0);
        break;
    default:
        break;
    }
    if (rc < 0)
        conn_lost(s, "connection lost");
}

static const char *result_error(const PGresult *r, char *buf, size_t len)
{
    if (!r) {
        snprintf(buf, len, "no result");
        return buf;
    }
    pgsrc_oneline(PQresultErrorMessage(r), buf, len);
    if (!buf[0])
        snprintf(buf, len, "%s", PQresStatus(PQresultStatus(r)));
    return buf;
}

static bool result_ok(const PGresult *r)
{
    if (!r)
        return false;
    ExecStatusType st = PQresultStatus(r);
    return st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
}

/* ------------------------------------------------------------ table health */

static void copy_field(const PGresult *r, int col, char *buf, size_t len)
{
    snprintf(buf, len, "%s", PQgetisnull(r, 0, col) ? "" : PQgetvalue(r, 0, col));
}

/* The row of sql_pg_health (text format) into h; its strings point into s. */
static int parse_health(source *s, const PGresult *r, src_health *h)
{
    if (PQntuples(r) != 1 || PQnfields(r) != 12)
        return -1;
    h->dead_tuples = PQgetisnull(r, 0, 0) ? -1 : strtoll(PQgetvalue(r, 0, 0), NULL, 10);
    h->live_tuples = PQgetisnull(r, 0, 1) ? -1 : strtoll(PQgetvalue(r, 0, 1), NULL, 10);
    h->size_bytes = PQgetisnull(r, 0, 2) ? -1 : strtoll(PQgetvalue(r, 0, 2), NULL, 10);
    h->last_autovacuum = PQgetisnull(r, 0, 3) ? -1 : strtod(PQgetvalue(r, 0, 3), NULL);
    h->horizon_known = !PQgetisnull(r, 0, 4) && PQgetvalue(r, 0, 4)[0] == 't';
    if (PQgetisnull(r, 0, 5))
        return 0;                               /* nothing holds an xmin */
    copy_field(r, 5, s->h_kind, sizeof s->h_kind);
    copy_field(r, 7, s->h_name, sizeof s->h_name);
    copy_field(r, 8, s->h_state, sizeof s->h_state);
    copy_field(r, 11, s->h_xmin, sizeof s->h_xmin);
    h->holder_kind = s->h_kind;
    h->holder_name = s->h_name;
    h->holder_state = s->h_state;
    h->holder_xmin = s->h_xmin;
    h->holder_pid = PQgetisnull(r, 0, 6) ? 0 : atoi(PQgetvalue(r, 0, 6));
    h->holder_age_s = PQgetisnull(r, 0, 9) ? -1 : strtod(PQgetvalue(r, 0, 9), NULL);
    h->horizon_xids = PQgetisnull(r, 0, 10) ? 0 : strtoll(PQgetvalue(r, 0, 10), NULL, 10);
    return 0;
}

/* ------------------------------------------------------------ request completion */

static void req_complete(source *s, PGresult *r)
{
    src_result res;
    char err[512];
    bool table_gone = false, read_only = false;
    memset(&res, 0, sizeof res);
    res.req = s->req;
    res.ok = 0;
    if (!result_ok(r)) {
        const char *st = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
        res.ok = -1;
        res.error = result_error(r, err, sizeof err);
        table_gone = st && strcmp(st, "42P01") == 0;  /* undefined_table */
        read_only = st && strcmp(st, "25006") == 0;   /* read_only_sql_transaction */
    } else {
        switch (s->req) {
        case SRC_REQ_LEAD:
            if (PQntuples(r) != 1 || PQnfields(r) != 5) {
                res.ok = -1;
                res.error = "lead: unexpected result";
                break;
            }
            res.leader = !PQgetisnull(r, 0, 0);
            if (res.leader)
                res.epoch = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
            if (!PQgetisnull(r, 0, 1)) {
                snprintf(s->holder, sizeof s->holder, "%s", PQgetvalue(r, 0, 1));
                res.holder = s->holder;
                res.holder_epoch = strtoll(PQgetvalue(r, 0, 2), NULL, 10);
            }
            res.newly_leader = res.leader && (res.holder == NULL ||
                                              res.holder_epoch != res.epoch);
            res.n_reset = strtoll(PQgetvalue(r, 0, 3), NULL, 10);
            if (!PQgetisnull(r, 0, 4)) {
                snprintf(s->member, sizeof s->member, "%s", PQgetvalue(r, 0, 4));
                res.member = s->member;
            }
            break;
        case SRC_REQ_CLAIM:
            /* the rows were read (claim_read) */
            if (s->crows.err[0] != '\0') {
                snprintf(err, sizeof err, "%s", s->crows.err);
                res.ok = -1;
                res.error = err;
            } else {
                pgsrc_rows_take(&s->crows, &res.rows, &res.n_rows);  /* ownership to the callee */
            }
            break;
        case SRC_REQ_SETTLE:
            if (PQntuples(r) == 1 && !PQgetisnull(r, 0, 0))
                res.n_applied = (size_t)strtoull(PQgetvalue(r, 0, 0), NULL, 10);
            break;
        case SRC_REQ_CLEANUP:
            res.n_deleted = (size_t)strtoull(PQcmdTuples(r), NULL, 10);
            break;
        case SRC_REQ_STATS:
            if (pgsrc_parse_stats(r, &res.stats) < 0) {
                res.ok = -1;
                res.error = "stats: unexpected result";
            }
            break;
        case SRC_REQ_HEALTH:
            if (parse_health(s, r, &res.health) < 0) {
                res.ok = -1;
                res.error = "table health: unexpected result";
            }
            break;
        default:
            break;
        }
    }
    pgsrc_rows_free(&s->crows);      /* a failed claim's rows so far (the statement rolled back) */
    bool wake = false;
    if (res.req == SRC_REQ_CLAIM) {
        claim_answered(s, &res);
        /* QUIET_ROWS: listen only while claims come back empty */
        if (s->listen == LS_ON && res.ok == 0 && res.n_rows >= QUIET_ROWS)
            s->unlisten_next = true;
        else if (s->listen == LS_QUIET && (res.ok != 0 || res.n_rows == 0)) {
            if (++s->quiet_empty >= QUIET_EMPTY || res.ok != 0)
                s->listen_next = true;
        } else if (s->listen == LS_QUIET)
            s->quiet_empty = 0;
        wake = s->listen == LS_QUIET;
    }
    s->req = 0;
    s->req_deferred = false;
    if (!cb_done(s, &res))
        return;
    if (wake && s->phase == PH_UP && s->listen == LS_QUIET && !cb_wake(s))
        return;
    if (table_gone && s->conn) {
        char msg[400];
        snprintf(msg, sizeof msg, "outbox table %s missing: run outbox-relay init", s->names.table);
        conn_fail(s, msg);
    } else if (read_only && s->conn) {
        /* a session opened read-only stays so (default_transaction_read_only, a standby,
           a switch-over): only a new connection finds the writable server again */
        conn_fail(s, "the database is read-only (SQLSTATE 25006): reconnecting until it "
                     "accepts writes");
    }
}

static void warn_no_listen(source *s);
static void set_up(source *s);
static void prep_done(source *s, PGresult *r);
static void listen_done(source *s, PGresult *r);

/* A claim's statement (Q_REQ), or the reading of one of its payloads (Q_LOAD), is done
   and succeeded: the last rows are decoded, or the payload checked whole, and the next
   payload the claim left in the database is asked for, its slices read as they come
   (io_process). True while one is being read; false when the claim is complete (or
   failed: crows.err). */
static bool claim_read(source *s, int op, const PGresult *r)
{
    char err[256], id[24], len[24], tok[24];
    int64_t next;
    int rc;
    if (s->crows.err[0] != '\0')
        rc = 0;
    else if (op == Q_REQ)       /* rows, unless libpq refused single-row mode */
        rc = pgsrc_rows_decode(&s->crows, r, s->claim_token, NULL, err, sizeof err);
    else                        /* likewise slices */
        rc = pgsrc_rows_slice(&s->crows, r, err, sizeof err) < 0
                 ? -1 : pgsrc_rows_load_end(&s->crows, err, sizeof err);
    if (rc < 0)
        snprintf(s->crows.err, sizeof s->crows.err, "%s", err);
    if (s->crows.err[0] != '\0' || !pgsrc_rows_load_next(&s->crows, &next))
        return false;
    snprintf(id, sizeof id, "%" PRId64, next);
    snprintf(len, sizeof len, "%d", SQL_PG_SLICE_BYTES);
    snprintf(tok, sizeof tok, "%" PRId64, s->claim_token);
    const char *vals[3] = { id, len, tok };
    if (q_send(s, Q_LOAD, s->sql_slices, 3, vals, 1) == 0)
        return true;
    char one[200];
    pgsrc_oneline(PQerrorMessage(s->conn), one, sizeof one);
    snprintf(s->crows.err, sizeof s->crows.err, "payload of row %" PRId64 ": %s", next,
             one[0] ? one : "send failed");
    s->qop = Q_NONE;        /* the connection's failure is noticed at its next use */
    ev_timer_stop(s->loop, &s->deadline);
    return false;
}

/* The query in flight has returned all its results. */
static void q_done(source *s)
{
    PGresult *r = s->qres;
    int op = s->qop;
    char err[512];
    s->qres = NULL;
    s->qop = Q_NONE;
    ev_timer_stop(s->loop, &s->deadline);

    if (op == Q_REQ || op == Q_LOAD) {
        if (op == Q_REQ && s->req == SRC_REQ_CLAIM) {
            ev_now_update(s->loop);    /* the statement's own time, before any payload read */
            s->claim_took = ev_now(s->loop) - s->claim_sent;
        }
        if (s->req == SRC_REQ_CLAIM && result_ok(r) && claim_read(s, op, r)) {
            PQclear(r);
            return;         /* a payload is being read */
        }
        req_complete(s, r);
        PQclear(r);
        return;
    }
    if (op == Q_REQ_PREPARE) {
        prep_done(s, r);
        return;
    }
    if (op == Q_REQ_LISTEN) {
        listen_done(s, r);
        return;
    }
    if (op == Q_FLOOR_PREPARE) {
        floor_prepared(s, r);
        return;
    }
    if (op == Q_REQ_FLOOR) {
        floor_done(s, r);
        return;
    }
    if (!result_ok(r)) {
        char msg[600];
        snprintf(msg, sizeof msg, "connection setup failed: %s", result_error(r, err, sizeof err));
        PQclear(r);
        setup_fail(s, msg);
        return;
    }
    switch (op) {
    case Q_SET_TIMEOUT:
        s->server_pid = PQntuples(r) == 1 ? atoi(PQgetvalue(r, 0, 0)) : 0;
        s->pooled = s->server_pid != PQbackendPID(s->conn);
        PQclear(r);
        setup_step(s, Q_FENCE);
        return;
    case Q_FENCE:
        s->prev_pid[0] = s->prev_start[0] = '\0';
        /* through a pooler the server session is shared: never a fencing target */
        if (!s->pooled && PQntuples(r) == 1 && !PQgetisnull(r, 0, 2)) {
            snprintf(s->prev_pid, sizeof s->prev_pid, "%s", PQgetvalue(r, 0, 1));
            snprintf(s->prev_start, sizeof s->prev_start, "%s", PQgetvalue(r, 0, 2));
        }
        PQclear(r);
        setup_step(s, Q_CHECK_SCHEMA);
        return;
    case Q_CHECK_SCHEMA: {
        bool t_ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 0), "1") == 0;
        bool d_ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 1), "1") == 0;
        bool l_ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 2), "1") == 0;
        bool i_ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 3), "1") == 0;
        PQclear(r);
        if (!t_ok || !d_ok || !l_ok) {
            char msg[400];
            snprintf(msg, sizeof msg, "%s table %s missing: run outbox-relay init",
                     !t_ok ? "outbox" : !d_ok ? "dead-letter" : "leadership lease",
                     !t_ok ? s->names.table : !d_ok ? s->names.dead : s->names.lease);
            setup_fail(s, msg);
            return;
        }
        /* through a pooler the session sets nothing (sorts allowed): the plain forms */
        s->sql_claim = s->pooled ? s->sql_leader_plain : s->sql_leader_walk;
        s->sql_claim_competing = s->pooled ? s->sql_competing_plain
                                 : i_ok    ? s->sql_competing_idx
                                           : s->sql_competing_noidx;
        if (!i_ok && !s->index_warned && s->cbs.on_wake) {
            /* once per source: the claiming connection's, where the claims run */
            s->index_warned = true;
            log_ev(LOG_WARN, &(log_fields){ .event = "delayed_index_missing", .outbox = s->name },
                   "outbox=%s: index %s missing (a table made by an earlier version): the "
                   "claims read each key's rows the long way to keep delayed rows in order, "
                   "which costs more; run outbox-relay init (on a large table, first CREATE "
                   "INDEX CONCURRENTLY as outbox-relay schema prints it)", s->name,
                   s->names.delayed);
        }
        if (s->pooled) {
            /* LISTEN cannot work through transaction pooling, and a LISTEN left on a
               pooled server connection sends our notifications to unrelated clients:
               none, and polling finds new rows */
            warn_no_listen(s);
            set_up(s);
            return;
        }
        if (!s->cbs.on_wake) {
            /* nobody to wake (the settling connection): every commit's notification
               would cost this session's backend a wake-up and a read of the queue
               (~30 us each, one per message at steady load) for nothing */
            set_up(s);
            return;
        }
        setup_step(s, Q_LISTEN);
        return;
    }
    case Q_LISTEN:
        PQclear(r);
        s->listen = LS_ON;
        set_up(s);
        return;
    default:
        PQclear(r);
        return;
    }
}

/* Logs once per outbox and process (both connections of an outbox see the same). */
static void warn_no_listen(source *s)
{
    static char warned[32][65];
    static size_t n_warned;
    for (size_t i = 0; i < n_warned; i++)
        if (strncmp(warned[i], s->name, sizeof warned[i] - 1) == 0)
            return;
    if (n_warned < sizeof warned / sizeof warned[0])
        snprintf(warned[n_warned++], sizeof warned[0], "%s", s->name);
    char peer[300];   /* the peer as the relay's other lines name it */
    pgsrc_peer(s->conninfo, s->database, peer, sizeof peer);
    log_ev(LOG_WARN, &(log_fields){ .event = "notify_unavailable", .outbox = s->name,
                                    .peer = peer },
           "outbox=%s: LISTEN/NOTIFY does not reach this connection (transaction "
           "pooling?): the database connection goes through a pooler (server backend pid %d, "
           "announced %d), so the relay does not LISTEN; new rows are found by polling every "
           "poll_interval (%gs)", s->name, s->server_pid, PQbackendPID(s->conn),
           (double)cfg_poll_interval_ms(&s->cfg, false) / 1000.0);
}

static void set_up(source *s)
{
    s->phase = PH_UP;
    s->backoff_ms = BACKOFF_MIN_MS;
    s->notice[0] = '\0';
    cb_state(s, SRC_UP, NULL);
}

/* ------------------------------------------------------------ connection I/O */

static void on_connected(source *s)
{
    ev_timer_stop(s->loop, &s->deadline);
    const char *db = PQdb(s->conn);
    if (!db || strcmp(db, s->database) != 0) {
        char msg[400];
        snprintf(msg, sizeof msg, "connected database \"%s\" differs from configured database \"%s\"",
                 db ? db : "", s->database);
        setup_fail(s, msg);
        return;
    }
    if (PQsetnonblocking(s->conn, 1) != 0) {
        conn_lost(s, "cannot make the connection non-blocking");
        return;
    }
    s->phase = PH_SETUP;
    s->notice[0] = '\0';
    memset(s->prepared, 0, sizeof s->prepared);
    s->listen = LS_OFF;
    s->unlisten_next = s->listen_next = false;
    floor_reset(s);
    setup_step(s, Q_SET_TIMEOUT);
}

/* Watches the connecting socket afresh. With several hosts in the conninfo, libpq closes a
   host's socket when that host fails (refused, or read-only under target_session_attrs) and
   opens the next host's, which usually gets the same descriptor number: the kernel has
   dropped the closed one from the loop's epoll set, and libev only registers a descriptor
   again when told it may be new (ev_io_set), so a watcher kept "as it was" would never
   fire and the connect would hang until its deadline, at every attempt. */
static void io_watch_new(source *s, int fd, int events)
{
    io_off(s);
    io_watch(s, fd, events);
}

static void connect_poll(source *s)
{
    switch (PQconnectPoll(s->conn)) {
    case PGRES_POLLING_READING:
        io_watch_new(s, PQsocket(s->conn), EV_READ);
        return;
    case PGRES_POLLING_WRITING:
        io_watch_new(s, PQsocket(s->conn), EV_WRITE);
        return;
    case PGRES_POLLING_OK:
        on_connected(s);
        return;
    default:
        conn_lost(s, "connect failed");
        return;
    }
}

static void conn_start(source *s)
{
    const char *keys[PGSRC_MAX_PARAMS + PGSRC_HOST_PARAMS];
    const char *vals[PGSRC_MAX_PARAMS + PGSRC_HOST_PARAMS];
    char tmo[24], *rot[PGSRC_HOST_PARAMS] = {NULL, NULL, NULL};
    pgsrc_conn_params(&s->cfg, keys, vals, tmo);
    s->notice[0] = '\0';
    if (pgsrc_hosts_rotate(s->conninfo, s->host_first, keys, vals, rot) < 0)
        s->conn = NULL;
    else
        s->conn = PQconnectStartParams(keys, vals, 1);
    for (int j = 0; j < PGSRC_HOST_PARAMS; j++)
        free(rot[j]);
    if (!s->conn) {
        conn_fail(s, "connect failed: out of memory");
        return;
    }
    PQsetNoticeProcessor(s->conn, notice_cb, s);
    if (PQstatus(s->conn) == CONNECTION_BAD || PQsocket(s->conn) < 0) {
        conn_lost(s, "connect failed");
        return;
    }
    s->phase = PH_CONNECTING;
    deadline_set(s, s->cfg.connect_timeout_ms > 0 ? s->cfg.connect_timeout_ms : 5000);
    io_watch(s, PQsocket(s->conn), EV_WRITE);  /* as if PQconnectPoll said WRITING */
}

/* Watcher callbacks hold the source (cb_depth) so that a destroy from a
 * callback into the core frees it only when the watcher returns. */
static void hold(source *s)
{
    s->cb_depth++;
}

static void release(source *s)
{
    s->cb_depth--;
    after_cb(s);
}

static void io_process(source *s, int revents)
{
    if (s->phase == PH_CONNECTING) {
        connect_poll(s);
        return;
    }
    if (!s->conn)
        return;
    if ((revents & EV_READ) && !PQconsumeInput(s->conn)) {
        conn_lost(s, "connection lost");
        return;
    }
    if (s->flushing && q_flush(s) < 0) {
        conn_lost(s, "connection lost");
        return;
    }
    /* results of the query in flight */
    while (s->qop != Q_NONE && !PQisBusy(s->conn)) {
        PGresult *r = PQgetResult(s->conn);
        if (!r) {
            q_done(s);  /* may call back, destroy, fail, or send the next query */
            if (s->destroyed || !s->conn)
                return;
            continue;
        }
        if (PQresultStatus(r) == PGRES_SINGLE_TUPLE) {
            /* one row of the claim: built now; the result freed at once, or kept by the row
               when its payload is large (no second copy of it) */
            char err[256];
            PGresult *own = r;
            if (s->qop == Q_REQ && s->req == SRC_REQ_CLAIM && s->crows.err[0] == '\0' &&
                pgsrc_rows_decode(&s->crows, r, s->claim_token, &own, err, sizeof err) < 0)
                snprintf(s->crows.err, sizeof s->crows.err, "%s", err);
            else if (s->qop == Q_LOAD && s->crows.err[0] == '\0' &&
                     pgsrc_rows_slice(&s->crows, r, err, sizeof err) < 0)
                snprintf(s->crows.err, sizeof s->crows.err, "%s", err);
            PQclear(own);
            continue;
        }
        if (!s->qres) {
            s->qres = r;
        } else if (result_ok(s->qres) && !result_ok(r)) {
            PQclear(s->qres);
            s->qres = r;
        } else {
            PQclear(r);
        }
    }
    if (PQstatus(s->conn) == CONNECTION_BAD) {
        conn_lost(s, "connection lost");
        return;
    }
    /* notifications: the channel is shared by every outbox in the database */
    bool wake = false;
    PGnotify *n;
    while ((n = PQnotifies(s->conn)) != NULL) {
        if (strcmp(n->relname, OUTBOX_NOTIFY_CHANNEL) == 0 && n->extra &&
            strcmp(n->extra, s->names.notify) == 0)
            wake = true;
        PQfreemem(n);
    }
    if (wake && s->phase == PH_UP)
        cb_wake(s);
}

static void io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    source *s = w->data;
    (void)loop;
    hold(s);
    io_process(s, revents);
    release(s);
}

static void deadline_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    source *s = w->data;
    char msg[600], at[400];
    (void)loop;
    (void)revents;
    hold(s);
    if (s->phase == PH_CONNECTING) {
        s->host_first = pgsrc_hosts_after_silent(s->conninfo, s->conn, s->host_first, at,
                                                 sizeof at);
        snprintf(msg, sizeof msg, "connect timed out after %" PRId64 " ms%s",
                 s->cfg.connect_timeout_ms, at);
        conn_fail(s, msg);
    } else if (s->qop != Q_NONE) {
        snprintf(msg, sizeof msg, "no answer from the server within %" PRId64 " ms",
                 s->cfg.query_timeout_ms);
        conn_fail(s, msg);
    }
    release(s);
}

static void retry_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    source *s = w->data;
    (void)loop;
    (void)revents;
    hold(s);
    if (s->phase == PH_BACKOFF)
        conn_start(s);
    release(s);
}

/* Claims stopped passing over rows (PASS_*): a row below where they started (one its
   producer committed while they passed, whose notification woke a claim that passed over
   it) is claimed now, not at the next poll. */
static void pass_end_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    source *s = w->data;
    (void)loop;
    (void)revents;
    if (s->phase == PH_UP)
        (void)cb_wake(s);
}

static void defer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    source *s = w->data;
    src_result res;
    (void)loop;
    (void)revents;
    if (!s->req || !s->req_deferred)
        return;
    res = s->dres;
    res.req = s->req;
    res.error = res.ok ? s->derr : NULL;
    s->req = 0;
    s->req_deferred = false;
    hold(s);
    if (cb_done(s, &res) && s->conn && s->phase >= PH_SETUP &&
        PQstatus(s->conn) == CONNECTION_BAD)
        conn_lost(s, "connection lost");
    release(s);
}

/* ------------------------------------------------------------ ops: lifecycle */

static char *dupstr(const char *p)
{
    return p ? strdup(p) : NULL;
}

static int pgsrc_create(struct ev_loop *loop, const cfg_outbox *ob, const src_cbs *cbs,
                        source **out, char *err, size_t errlen)
{
    source *s;
    *out = NULL;
    if (!ob->database || !ob->conninfo) {
        snprintf(err, errlen, "conninfo and database are required");
        return -1;
    }
    s = calloc(1, sizeof *s);
    if (!s)
        goto oom;
    s->loop = loop;
    s->cbs = *cbs;
    s->cfg = *ob;
    s->conninfo = dupstr(ob->conninfo);
    s->password = dupstr(ob->password);
    s->database = dupstr(ob->database);
    s->name = dupstr(ob->name ? ob->name : "");
    if (!s->conninfo || !s->database || !s->name || (ob->password && !s->password))
        goto oom;
    /* the copy's string pointers are ours (or unused) */
    s->cfg.conninfo = s->conninfo;
    s->cfg.password = s->password;
    s->cfg.database = s->database;
    s->cfg.name = s->name;
    s->cfg.table = NULL;
    s->cfg.sink_name = NULL;
    s->cfg.sink = NULL;
    if (s->cfg.query_timeout_ms <= 0)
        s->cfg.query_timeout_ms = 30000;
    if (s->cfg.connect_timeout_ms <= 0)
        s->cfg.connect_timeout_ms = 5000;
    if (s->cfg.reconnect_max_ms < BACKOFF_MIN_MS)
        s->cfg.reconnect_max_ms = 30000;
    sql_pg_names_init(ob, &s->names);
    s->sql_lead = sql_pg_lead(&s->names);
    s->sql_leader_walk = sql_pg_claim_sliced(&s->names, false, SQL_PG_CLAIM_WALK);
    s->sql_leader_plain = sql_pg_claim_sliced(&s->names, false, 0);
    s->sql_competing_idx = sql_pg_claim_sliced(&s->names, true,
                                               SQL_PG_CLAIM_WALK | SQL_PG_CLAIM_DELAYED_IDX);
    s->sql_competing_noidx = sql_pg_claim_sliced(&s->names, true, SQL_PG_CLAIM_WALK);
    s->sql_competing_plain = sql_pg_claim_sliced(&s->names, true, 0);
    s->sql_claim = s->sql_leader_walk;
    s->sql_claim_competing = s->sql_competing_idx;
    s->sql_settle = sql_pg_settle(&s->names, ob->on_sent);
    s->sql_settle_sent = sql_pg_settle_sent(&s->names, ob->on_sent);
    s->sql_cleanup = sql_pg_cleanup(&s->names);
    s->sql_stats = sql_pg_stats(&s->names, false);
    s->sql_health = sql_pg_health();
    s->sql_slices = sql_pg_payload_slices(&s->names);
    s->sql_floor = sql_pg_floor_probe(&s->names);
    if (!s->sql_slices || !s->sql_lead || !s->sql_leader_walk || !s->sql_leader_plain ||
        !s->sql_competing_idx || !s->sql_competing_noidx || !s->sql_competing_plain ||
        !s->sql_settle ||
        !s->sql_settle_sent || !s->sql_cleanup || !s->sql_stats || !s->sql_health ||
        !s->sql_floor)
        goto oom;
    s->backoff_ms = BACKOFF_MIN_MS;
    s->rng = outbox_util_seed(s);
    ev_io_init(&s->io, io_cb, -1, EV_READ);
    s->io.data = s;
    ev_timer_init(&s->deadline, deadline_cb, 1., 0.);
    s->deadline.data = s;
    ev_timer_init(&s->retry, retry_cb, 0., 0.);
    s->retry.data = s;
    ev_timer_init(&s->defer, defer_cb, 0., 0.);
    s->defer.data = s;
    ev_timer_init(&s->pass_end, pass_end_cb, 0., 0.);
    s->pass_end.data = s;
    s->phase = PH_IDLE;
    *out = s;  /* ownership to the caller: pgsrc_destroy */
    return 0;
oom:
    snprintf(err, errlen, "out of memory");
    if (s)
        src_free(s);
    return -1;
}

static void pgsrc_destroy(source *s)
{
    if (!s || s->destroyed)
        return;
    conn_close(s);
    ev_timer_stop(s->loop, &s->retry);
    ev_timer_stop(s->loop, &s->defer);
    ev_timer_stop(s->loop, &s->pass_end);
    s->req = 0;
    s->destroyed = true;
    if (s->cb_depth == 0)
        src_free(s);
}

static void pgsrc_start(source *s)
{
    if (s->phase != PH_IDLE)
        return;
    s->phase = PH_BACKOFF;
    ev_timer_stop(s->loop, &s->retry);
    ev_timer_set(&s->retry, 0., 0.);  /* connect from the loop, never inside start() */
    ev_timer_start(s->loop, &s->retry);
}

/* ------------------------------------------------------------ ops: requests */

/* Completes the request from the loop without a query. */
static void req_defer(source *s, int ok, const char *err)
{
    memset(&s->dres, 0, sizeof s->dres);
    s->dres.ok = ok;
    snprintf(s->derr, sizeof s->derr, "%s", err ? err : "");
    s->req_deferred = true;
    ev_timer_stop(s->loop, &s->defer);
    ev_timer_set(&s->defer, 0., 0.);
    ev_timer_start(s->loop, &s->defer);
}

/* Common entry: 0 when the request is accepted and must be sent now, 1 when it
 * was accepted and will complete by itself (deferred failure), -1 when refused
 * (another request outstanding: no callback follows). */
static int req_begin(source *s, int req)
{
    if (s->destroyed || s->req)
        return -1;
    s->req = req;
    s->req_deferred = false;
    if (s->phase != PH_UP || !s->conn) {
        req_defer(s, -1, "not connected");
        return 1;
    }
    return 0;
}

/* The statements in st_name's order. */
static const char *st_sql(const source *s, int i)
{
    const char *v[ST_COUNT] = { s->sql_lead, s->sql_claim, s->sql_claim_competing,
                                s->sql_settle, s->sql_settle_sent, s->sql_cleanup,
                                s->sql_stats, s->sql_health, s->sql_floor };
    return v[i];
}

static void prep_clear(source *s)
{
    for (int i = 0; i < s->prep_n; i++) {
        free(s->prep_vals[i]);
        s->prep_vals[i] = NULL;
    }
    s->prep_n = 0;
}

static void q_deadline(source *s)
{
    int64_t slack = s->cfg.connect_timeout_ms > 1000 ? s->cfg.connect_timeout_ms : 1000;
    deadline_set(s, s->cfg.query_timeout_ms + slack);
}

/* Prepares statement i (n parameters) on this session; op completes it. */
static int send_prepare(source *s, int op, int i, int n)
{
    if (!PQsendPrepare(s->conn, st_name[i], st_sql(s, i), n, NULL))
        return -1;
    s->qop = op;
    if (q_flush(s) < 0)
        return -1;
    q_deadline(s);
    return 0;
}

static int send_prepared(source *s, int op, int i, int n, const char *const *vals, int fmt)
{
    if (!PQsendQueryPrepared(s->conn, st_name[i], n, vals, NULL, NULL, fmt))
        return -1;
    claim_row_by_row(s, st_sql(s, i));
    s->qop = op;
    if (q_flush(s) < 0)
        return -1;
    q_deadline(s);
    return 0;
}

/* Sends a request's statement by its name when this session has it prepared; at its
   first use, prepares it first (Q_REQ_PREPARE, with copies of the values); through a
   pooler, as text every time. */
static int req_query(source *s, const char *sql, int n, const char *const *vals, int fmt)
{
    int i = 0;
    while (i < ST_COUNT && st_sql(s, i) != sql)
        i++;
    if (s->pooled || i == ST_COUNT || n > (int)(sizeof s->prep_vals / sizeof s->prep_vals[0]))
        return q_send(s, Q_REQ, sql, n, vals, fmt);
    if (s->prepared[i])
        return send_prepared(s, Q_REQ, i, n, vals, fmt);
    prep_clear(s);
    for (int k = 0; k < n; k++) {
        if (vals[k] != NULL && (s->prep_vals[k] = dupstr(vals[k])) == NULL) {
            s->prep_n = k;
            prep_clear(s);
            return q_send(s, Q_REQ, sql, n, vals, fmt);    /* no memory to spare: as text */
        }
    }
    s->prep_n = n;
    s->prep_st = i;
    s->prep_fmt = fmt;
    return send_prepare(s, Q_REQ_PREPARE, i, n);
}

/* The statement of the request in flight is prepared (or failed: then so does the
   request, with the server's error, as if it had run). */
static void prep_done(source *s, PGresult *r)
{
    if (!result_ok(r)) {
        prep_clear(s);
        req_complete(s, r);
        PQclear(r);
        return;
    }
    PQclear(r);
    s->prepared[s->prep_st] = true;
    int rc = send_prepared(s, Q_REQ, s->prep_st, s->prep_n,
                           (const char *const *)s->prep_vals, s->prep_fmt);
    prep_clear(s);
    if (rc < 0) {
        char one[256];
        pgsrc_oneline(PQerrorMessage(s->conn), one, sizeof one);
        req_defer(s, -1, one[0] ? one : "send failed");
        s->qop = Q_NONE;
        ev_timer_stop(s->loop, &s->deadline);
    }
}

static int req_send(source *s, const char *sql, int n, const char *const *vals, int fmt)
{
    if (req_query(s, sql, n, vals, fmt) < 0) {
        char one[256];
        pgsrc_oneline(PQerrorMessage(s->conn), one, sizeof one);
        req_defer(s, -1, one[0] ? one : "send failed");  /* defer_cb then notices the bad connection */
        s->qop = Q_NONE;
        ev_timer_stop(s->loop, &s->deadline);
    }
    return 0;
}

static void lq_clear(source *s)
{
    for (size_t i = 0; i < sizeof s->lq_vals / sizeof s->lq_vals[0]; i++) {
        free(s->lq_vals[i]);
        s->lq_vals[i] = NULL;
    }
    s->lq_sql = NULL;
}

/* A statement that goes first on the claim's session (the floor probe, UNLISTEN or LISTEN)
   keeps copies of the claim's values meanwhile. */
static int lq_stash(source *s, const char *sql, const char *const vals[CLAIM_NPARAMS])
{
    lq_clear(s);
    for (int k = 0; k < CLAIM_NPARAMS; k++) {
        if (vals[k] != NULL && (s->lq_vals[k] = dupstr(vals[k])) == NULL) {
            lq_clear(s);
            return -1;
        }
    }
    s->lq_sql = sql;
    return 0;
}

static void lq_send_failed(source *s)
{
    char one[256];
    lq_clear(s);
    pgsrc_oneline(PQerrorMessage(s->conn), one, sizeof one);
    req_defer(s, -1, one[0] ? one : "send failed");
    s->qop = Q_NONE;
    ev_timer_stop(s->loop, &s->deadline);
}

/* The stashed claim's next statement: its UNLISTEN or LISTEN (QUIET_ROWS), else the claim
   itself, with the floor and its start as they are now (binary results: payloads as they
   are). */
static void lq_next(source *s)
{
    if (s->unlisten_next || s->listen_next) {
        if (q_send(s, Q_REQ_LISTEN, s->listen_next ? "LISTEN " OUTBOX_NOTIFY_CHANNEL
                                                  : "UNLISTEN " OUTBOX_NOTIFY_CHANNEL,
                   0, NULL, 0) < 0)
            lq_send_failed(s);
        return;
    }
    const char *sql = s->lq_sql;
    char *v[CLAIM_NPARAMS];
    char fl[24], st[24];
    const char *cv[CLAIM_NPARAMS];
    memcpy(v, s->lq_vals, sizeof v);
    memset(s->lq_vals, 0, sizeof s->lq_vals);
    s->lq_sql = NULL;
    snprintf(fl, sizeof fl, "%" PRId64, s->floor_id);
    const char *start = claim_start(s, st);
    for (int k = 0; k < CLAIM_NPARAMS; k++)
        cv[k] = k == CLAIM_FLOOR ? fl : k == CLAIM_START ? start : v[k];
    (void)req_send(s, sql, CLAIM_NPARAMS, cv, 1);
    for (int k = 0; k < CLAIM_NPARAMS; k++)
        free(v[k]);
}

/* The claim's UNLISTEN or LISTEN is done (or failed: then so does the claim, and the next
   claim tries again). */
static void listen_done(source *s, PGresult *r)
{
    if (!result_ok(r)) {
        lq_clear(s);
        req_complete(s, r);
        PQclear(r);
        return;
    }
    PQclear(r);
    if (s->listen_next)
        s->listen = LS_ON;
    else
        s->listen = LS_QUIET;
    s->quiet_empty = 0;
    s->listen_next = s->unlisten_next = false;
    lq_next(s);
}

/* ---------- the claims' floor (sql_pg_floor_probe) */

static void floor_reset(source *s)
{
    s->floor_id = 0;
    s->pass_from = 0;
    s->floor_off = false;
    s->floor_due = s->floor_full_due = s->floor_full_at = 0;
    s->fp_n = 0;
    for (size_t i = 0; i < sizeof s->fp / sizeof s->fp[0]; i++) {
        free(s->fp[i].w);
        s->fp[i].w = NULL;
    }
}

static bool floor_probe_due(source *s)
{
    return !s->floor_off && ev_now(s->loop) >= s->floor_due;
}

/* The probe's values: where it looks from (s->floor_from), the lock holders the previous
   probe saw, the table. */
static void floor_vals(source *s, const char *vals[3])
{
    vals[0] = s->floor_from[0] ? s->floor_from : NULL;
    vals[1] = s->fp_n > 0 ? s->fp[(s->fp_n - 1) % 4].w : NULL;
    vals[2] = s->names.table;
}

/* Sends the probe by its name when this session has it prepared; at its first use, prepares
   it first (floor_prepared sends it then); through a pooler, as text every time. */
static int floor_query(source *s)
{
    const char *vals[3];
    floor_vals(s, vals);
    if (s->pooled)
        return q_send(s, Q_REQ_FLOOR, s->sql_floor, 3, vals, 0);
    if (s->prepared[ST_FLOOR])
        return send_prepared(s, Q_REQ_FLOOR, ST_FLOOR, 3, vals, 0);
    return send_prepare(s, Q_FLOOR_PREPARE, ST_FLOOR, 3);
}

/* The probe is prepared (or failed: then so does the probe, with the server's error). */
static void floor_prepared(source *s, PGresult *r)
{
    if (!result_ok(r)) {
        floor_done(s, r);
        return;
    }
    PQclear(r);
    s->prepared[ST_FLOOR] = true;
    const char *vals[3];
    floor_vals(s, vals);
    if (send_prepared(s, Q_REQ_FLOOR, ST_FLOOR, 3, vals, 0) < 0)
        lq_send_failed(s);
}

/* Sends the next probe. Its lowest pending id moves the floor only when the probe before saw
   every lock holder of the one before it ended (floor_done); when it did not (a transaction
   still open, as a bulk load is), the probe does not look for it ($1 NULL: an index scan
   with a NULL bound reads nothing), since that look crosses the open transaction's rows. */
static void floor_send(source *s)
{
    double now = ev_now(s->loop);
    bool look = s->fp_n == 0 || s->fp[(s->fp_n - 1) % 4].ended;
    bool full = look && now >= s->floor_full_due;
    if (look)
        snprintf(s->floor_from, sizeof s->floor_from, "%" PRId64, full ? 0 : s->floor_id);
    else
        s->floor_from[0] = '\0';
    s->floor_due = now + FLOOR_PROBE_S;
    if (full)
        s->floor_full_due = now + FLOOR_FULL_S;
    if (floor_query(s) < 0)
        lq_send_failed(s);
    else if (full) {
        ev_now_update(s->loop);    /* timed from its sending, not from this loop turn's start */
        s->floor_full_at = ev_now(s->loop);
    }
}

/* No floor on this session (the claims walk from the table's start, as they are correct to):
   said once per process at WARN, as an operator can give the relay what it needs. */
static void floor_off(source *s, const char *why)
{
    s->floor_off = true;
    s->floor_id = 0;
    if (!s->floor_warned) {
        s->floor_warned = true;
        log_ev(LOG_WARN, &(log_fields){ .event = "claim_floor_unavailable", .outbox = s->name },
               "outbox=%s: claims start from the table's first row, so their cost grows with "
               "the rows marked since the last vacuum: %s", s->name, why);
    }
}

/* Probe k answered. Once probe k-1 saw every lock holder of probe k-2 ended, the floor is
   min(m_k, lv_(k-3) + 1) (see sql_pg_floor_probe); the claim then goes on. */
static void floor_done(source *s, PGresult *r)
{
    char err[300];
    if (s->floor_full_at > 0) {
        double took = ev_now(s->loop) - s->floor_full_at;
        double wait = took * FLOOR_FULL_SHARE < FLOOR_FULL_S ? FLOOR_FULL_S : took * FLOOR_FULL_SHARE;
        s->floor_full_due = s->floor_full_at + (wait > FLOOR_FULL_MAX_S ? FLOOR_FULL_MAX_S : wait);
        s->floor_full_at = 0;
    }
    if (!result_ok(r) || PQntuples(r) != 1 || PQnfields(r) != 5) {
        char why[400];
        snprintf(why, sizeof why, "the floor probe failed (%s)",
                 result_ok(r) ? "unexpected result" : result_error(r, err, sizeof err));
        floor_off(s, why);
    } else if (PQgetisnull(r, 0, 2) || strcmp(PQgetvalue(r, 0, 2), "1") != 0) {
        floor_off(s, PQgetisnull(r, 0, 2)
                         ? "the id column has no sequence"
                         : "the id sequence caches more than one value per session, so ids "
                           "need not follow the order they were drawn in");
    } else {
        unsigned k = s->fp_n++;
        floor_probe *p = &s->fp[k % 4];
        free(p->w);
        p->m_none = PQgetisnull(r, 0, 0);
        p->m = p->m_none ? 0 : strtoll(PQgetvalue(r, 0, 0), NULL, 10);
        p->lv = PQgetisnull(r, 0, 1) ? 0 : strtoll(PQgetvalue(r, 0, 1), NULL, 10);
        p->w = PQgetisnull(r, 0, 3) ? NULL : dupstr(PQgetvalue(r, 0, 3));
        p->ended = strcmp(PQgetvalue(r, 0, 4), "t") == 0;
        if (p->ended)
            s->pass_until = 0;    /* what was open has ended: its rows are to be seen */
        if (!PQgetisnull(r, 0, 3) && p->w == NULL) {
            floor_reset(s);      /* out of memory: start over, without a floor meanwhile */
        } else if (k >= 3 && s->fp[(k - 1) % 4].ended) {
            int64_t f = s->fp[(k - 3) % 4].lv + 1;
            s->floor_id = !p->m_none && p->m < f ? p->m : f;
        }
    }
    PQclear(r);
    lq_next(s);
}

/* The claim about to be sent: where its walk starts ($12, into buf), the floor or past it
   (PASS_*), noted with its sending for claim_answered. */
static const char *claim_start(source *s, char buf[24])
{
    ev_now_update(s->loop);
    double now = ev_now(s->loop);
    bool pass = s->pass_from > s->floor_id && now < s->pass_until &&
                s->pass_until - now <= PASS_MAX_T_S && s->claim_n_lost == 0;
    s->claim_full = !pass;
    s->claim_sent = now;
    s->claim_took = 0;
    s->claim_lv = s->fp_n > 0 && !s->floor_off ? s->fp[(s->fp_n - 1) % 4].lv : -1;
    snprintf(buf, 24, "%" PRId64, pass ? s->pass_from : s->floor_id);
    return buf;
}

/* A claim answered: a slow one from the floor that found all it could lets the next ones
   start past the ids drawn before it was sent (PASS_*); any other claim from the floor, or
   a failed one, ends that. */
static void claim_answered(source *s, const src_result *res)
{
    if (res->ok != 0) {
        s->pass_from = 0;
        return;
    }
    if (!s->claim_full) {
        double left = s->pass_until - ev_now(s->loop);
        if (!ev_is_active(&s->pass_end) && left > 0 && left <= PASS_MAX_T_S) {
            ev_timer_set(&s->pass_end, left, 0.);
            ev_timer_start(s->loop, &s->pass_end);
        }
        return;
    }
    double now = ev_now(s->loop), took = s->claim_took;
    /* something the floor waits for is still open (the last probe saw a lock holder of the
       one before it still there): else a slow claim (its first, planned then, on a loaded
       server) has nothing to pass over */
    bool open = s->fp_n > 0 && !s->fp[(s->fp_n - 1) % 4].ended;
    bool complete = false;
    if (open && took >= PASS_MIN_S && s->claim_lv >= s->floor_id) {
        size_t bytes = 0;
        for (size_t i = 0; i < res->n_rows; i++)
            bytes += src_row_bytes(res->rows[i]);
        /* (with a byte limit, an empty answer may be a first row over it, unless that row
           would have come whole) */
        complete = res->n_rows < s->claim_max_rows &&
                   (s->claim_max_bytes == 0 ||
                    (bytes <= s->claim_max_bytes / 2 && (res->n_rows > 0 || s->claim_whole)));
    }
    if (!complete) {
        s->pass_from = 0;
        return;
    }
    double t = took * PASS_SHARE;
    t = t < PASS_MIN_T_S ? PASS_MIN_T_S : t > PASS_MAX_T_S ? PASS_MAX_T_S : t;
    s->pass_from = s->claim_lv + 1;
    s->pass_until = s->claim_sent + t;
    if (s->pass_logged == 0 || now - s->pass_logged >= PASS_LOG_S) {
        s->pass_logged = now;
        log_ev(LOG_INFO, &(log_fields){ .event = "claims_pass_over", .outbox = s->name },
               "outbox=%s: a claim took %.0f ms to walk from id %" PRId64 " (rows of a "
               "transaction still open lie across its way); the next claims start at id "
               "%" PRId64 ", and one walks from the floor every %.1f s until it ends",
               s->name, took * 1000.0, s->floor_id, s->pass_from, t);
    }
}

static int pgsrc_lead(source *s, const src_lead_args *a)
{
    int rc = req_begin(s, SRC_REQ_LEAD);
    if (rc)
        return rc < 0 ? -1 : 0;
    char ep[24], lease[24];
    snprintf(ep, sizeof ep, "%" PRId64, a->epoch);
    snprintf(lease, sizeof lease, "%" PRId64, a->lease_ms);
    const char *vals[3] = {a->owner ? a->owner : "", ep, lease};
    return req_send(s, s->sql_lead, 3, vals, 0);
}

static int pgsrc_claim(source *s, const src_claim_args *a)
{
    int rc = req_begin(s, SRC_REQ_CLAIM);
    if (rc)
        return rc < 0 ? -1 : 0;
    char lim[24], tok[24], lease[24], ep[24], bytes[24], maxpay[24];
    snprintf(lim, sizeof lim, "%zu", a->max_rows);
    /* the byte limit as a bigint: "0" (none) when it does not fit */
    snprintf(bytes, sizeof bytes, "%zu", a->max_bytes > INT64_MAX ? 0 : a->max_bytes);
    snprintf(maxpay, sizeof maxpay, "%zu", a->max_payload > INT64_MAX ? 0 : a->max_payload);
    snprintf(tok, sizeof tok, "%" PRId64, a->lease_token);
    snprintf(lease, sizeof lease, "%" PRId64, a->lease_ms);
    snprintf(ep, sizeof ep, "%" PRId64, a->competing ? 0 : a->epoch);
    char fl[24];
    snprintf(fl, sizeof fl, "%" PRId64, s->floor_id);
    char *held = NULL;       /* NULL (none) as well when there is no memory to spare */
    (void)sql_pg_id_array(a->held, a->n_held, &held);
    char *lost = NULL;       /* not a hint: without them the claim may not run */
    if (sql_pg_id_array(a->lost, a->n_lost, &lost) < 0) {
        free(held);
        req_defer(s, -1, "out of memory");
        return 0;
    }
    s->claim_max_rows = a->max_rows;
    s->claim_max_bytes = a->max_bytes;
    s->claim_whole = a->first_whole;
    s->claim_n_lost = a->n_lost;
    if (a->given_back)
        s->pass_until = 0;   /* rows back in the table: this claim walks from the floor */
    char st[24];     /* (set again when a statement goes first: see lq_next) */
    const char *vals[CLAIM_NPARAMS] = {lim, a->owner ? a->owner : "", tok, lease, ep, bytes,
                           a->first_whole ? "true" : "false", maxpay, fl, held, lost,
                           claim_start(s, st)};
    s->claim_token = a->lease_token;
    s->crows.max_payload = a->max_payload > INT64_MAX ? 0 : a->max_payload;
    const char *sql = a->competing ? s->sql_claim_competing : s->sql_claim;
    bool probe = floor_probe_due(s);
    /* binary results: payloads as they are */
    if ((!probe && !s->unlisten_next && !s->listen_next) || lq_stash(s, sql, vals) < 0) {
        rc = req_send(s, sql, CLAIM_NPARAMS, vals, 1);   /* (no memory to spare: alone) */
        free(held);
        free(lost);
        return rc;
    }
    free(held);
    free(lost);
    if (probe)
        floor_send(s);
    else
        lq_next(s);
    return 0;
}

static int pgsrc_settle(source *s, const src_outcome *v, size_t n)
{
    outbox_util_buf arr[5];
    int rc = req_begin(s, SRC_REQ_SETTLE);
    if (rc)
        return rc < 0 ? -1 : 0;
    if (n == 0) {
        req_defer(s, 0, NULL);
        return 0;
    }
    if (sql_pg_settle_arrays(v, n, arr) < 0) {
        req_defer(s, -1, "settle: out of memory");
        return 0;
    }
    bool all_sent = true;
    for (size_t i = 0; i < n && all_sent; i++)
        all_sent = v[i].kind == SRC_SENT;
    const char *vals[5] = {arr[0].p, arr[1].p, arr[2].p, arr[3].p, arr[4].p};
    /* libpq copies the parameters */
    if (all_sent)
        req_send(s, s->sql_settle_sent, 2, vals, 0);
    else
        req_send(s, s->sql_settle, 5, vals, 0);
    for (int k = 0; k < 5; k++)
        outbox_util_buf_free(&arr[k]);
    return 0;
}

static int pgsrc_cleanup(source *s, const src_cleanup_args *a)
{
    int rc = req_begin(s, SRC_REQ_CLEANUP);
    if (rc)
        return rc < 0 ? -1 : 0;
    char ret[24], lim[24], ep[24];
    snprintf(ret, sizeof ret, "%" PRId64, a->retention_ms);
    snprintf(lim, sizeof lim, "%zu", a->limit);
    snprintf(ep, sizeof ep, "%" PRId64, a->epoch);
    const char *vals[4] = {ret, lim, a->owner ? a->owner : "", ep};
    return req_send(s, s->sql_cleanup, 4, vals, 0);
}

static int pgsrc_stats(source *s)
{
    int rc = req_begin(s, SRC_REQ_STATS);
    if (rc)
        return rc < 0 ? -1 : 0;
    return req_send(s, s->sql_stats, 0, NULL, 0);
}

static int pgsrc_health(source *s)
{
    int rc = req_begin(s, SRC_REQ_HEALTH);
    if (rc)
        return rc < 0 ? -1 : 0;
    const char *vals[1] = { s->names.table };   /* quoted: "schema"."table" */
    return req_send(s, s->sql_health, 1, vals, 0);
}

static bool pgsrc_notifies(const source *s)
{
    return s->phase == PH_UP && !s->pooled && s->cbs.on_wake != NULL;
}

/* The claim stops at its byte limit (sql_pg_claim_bytes). */
static bool pgsrc_claims_bytes(const source *s)
{
    (void)s;
    return true;
}

const source_ops pgsrc_ops = {
    .name = "postgres",
    .create = pgsrc_create,
    .destroy = pgsrc_destroy,
    .start = pgsrc_start,
    .lead = pgsrc_lead,
    .claim = pgsrc_claim,
    .settle = pgsrc_settle,
    .cleanup = pgsrc_cleanup,
    .stats = pgsrc_stats,
    .notifies = pgsrc_notifies,
    .claims_bytes = pgsrc_claims_bytes,
    .health = pgsrc_health,
    .peer = pgsrc_peer,
    .check = pgsrc_check,
    .init = pgsrc_init,
    .stats_sync = pgsrc_stats_sync,
    .dead_list = pgsrc_dead_list,
    .dead_retry = pgsrc_dead_retry,
    .dead_purge = pgsrc_dead_purge,
};

int pgsrc_parse_stats(const PGresult *r, src_stats *out)
{
    char *end;
    memset(out, 0, sizeof *out);
    if (PQntuples(r) != 1 || PQnfields(r) != 6)
        return -1;
    for (int c = 0; c < 4; c++)
        if (PQgetisnull(r, 0, c))
            return -1;
    out->backlog = strtoll(PQgetvalue(r, 0, 0), &end, 10);
    if (*end)
        return -1;
    out->oldest_pending_s = strtod(PQgetvalue(r, 0, 1), &end);
    if (*end)
        return -1;
    out->dead = strtoll(PQgetvalue(r, 0, 2), &end, 10);
    if (*end)
        return -1;
    out->sent_kept = strtoll(PQgetvalue(r, 0, 3), &end, 10);
    if (*end)
        return -1;
    out->next_due_s = -1;
    if (!PQgetisnull(r, 0, 4)) {
        out->next_due_s = strtod(PQgetvalue(r, 0, 4), &end);
        if (*end)
            return -1;
        if (out->next_due_s < 0)
            out->next_due_s = 0;
    }
    if (!PQgetisnull(r, 0, 5))
        snprintf(out->leader, sizeof out->leader, "%s", PQgetvalue(r, 0, 5));
    return 0;
}
