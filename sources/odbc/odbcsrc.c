/*
 * odbcsrc.c — the ODBC source (SQL Server; PostgreSQL through psqlODBC).
 *
 * ODBC on Linux blocks and has no async notification, so each source owns
 * one worker thread that owns the ODBC session and runs the blocking calls.
 * The loop thread hands it one request at a time (mutex + condvar); the
 * worker queues results and state changes and wakes the loop with
 * ev_async_send; the loop-side ev_async callback delivers them in order
 * through cbs->on_state / cbs->on_done. No on_wake: SQL Server is polled.
 *
 * ODBC handles live only in the worker; the one exception is SQLCancel of
 * the statement in progress, issued by destroy() under the mutex (the worker
 * unregisters a statement under the same mutex before freeing it).
 *
 * The async watcher does not keep the loop alive by itself (ev_unref); an
 * outstanding request does (ev_ref until its on_done ran).
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ev.h>
#include "lib/outbox_util.h"
#include "sources/odbc/odbcsrc_int.h"
#include "sources/odbc/odbcsrc_health.h"

#define BACKOFF_MIN_MS 100

typedef struct odbc_req {
    enum src_req kind;
    size_t  max_rows;      /* CLAIM */
    int64_t lease_ms;      /* CLAIM, LEAD */
    int64_t token;
    char   *owner;         /* CLAIM, LEAD, CLEANUP */
    int64_t epoch;         /* LEAD: held; CLAIM, CLEANUP: fence (0 none) */
    bool    competing;     /* CLAIM */
    size_t  max_bytes;     /* CLAIM: 0 none */
    bool    first_whole;   /* CLAIM */
    size_t  max_payload;   /* CLAIM: 0 none */
    int64_t *lost;         /* CLAIM: a copy of src_claim_args.lost */
    size_t  n_lost;
    src_outcome *outcomes; /* SETTLE: a copy (reasons owned) */
    size_t  n_outcomes;
    int64_t retention_ms;  /* CLEANUP */
    size_t  limit;
} odbc_req;

enum { EVT_STATE = 1, EVT_DONE };

typedef struct odbc_event {
    struct odbc_event *next;
    int         type;
    int         state;     /* EVT_STATE */
    char       *msg;       /* state message / error text (owned) */
    src_result  res;       /* EVT_DONE; rows owned until delivered */
} odbc_event;

struct source {
    struct ev_loop *loop;
    src_cbs         cbs;
    odbcsrc_conf    conf;
    ev_async        async;

    pthread_mutex_t mu;
    pthread_cond_t  cv;
    pthread_t       thr;
    bool            thr_started;
    /* under mu */
    bool            stop;
    bool            has_req;
    odbc_req        req;
    SQLHSTMT        cur;          /* statement in progress (for SQLCancel) */
    odbc_event     *head, *tail;  /* worker → loop */

    /* loop thread only */
    bool            up;
    bool            outstanding;  /* a request awaits its on_done (loop ref held) */
    bool            dispatching;
    bool            destroyed;

    odbcsrc_health  health;       /* the worker's, between table-health reads */
};

/* ------------------------------------------------------------ helpers */

static void req_clear(odbc_req *r)
{
    free(r->owner);
    free(r->lost);
    for (size_t i = 0; i < r->n_outcomes; i++)
        free((char *)r->outcomes[i].reason);
    free(r->outcomes);
    memset(r, 0, sizeof *r);
}

static void event_free(odbc_event *e)
{
    if (!e)
        return;
    for (size_t i = 0; i < e->res.n_rows; i++)
        row_free(e->res.rows[i]);
    free(e->res.rows);
    free(e->msg);
    free(e);
}

/* Queues e (mu held); ownership moves to the queue. */
static void push_locked(source *s, odbc_event *e)
{
    e->next = NULL;
    if (s->tail)
        s->tail->next = e;
    else
        s->head = e;
    s->tail = e;
}

/* An event allocation that does not give up: a lost completion would leave
 * the core waiting forever. */
static odbc_event *event_new(int type)
{
    odbc_event *e;
    while (!(e = calloc(1, sizeof *e))) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    e->type = type;
    return e;
}

static odbc_event *done_event(enum src_req req, int ok, const char *err)
{
    odbc_event *e = event_new(EVT_DONE);
    e->res.req = req;
    e->res.ok = ok;
    if (err)
        e->msg = strdup(err);  /* NULL on OOM: the callback then sees "" */
    return e;
}

static void post_state_locked(source *s, int state, const char *msg)
{
    odbc_event *e = event_new(EVT_STATE);
    e->state = state;
    e->msg = strdup(msg ? msg : "");
    push_locked(s, e);
    ev_async_send(s->loop, &s->async);
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Cancel hook of the worker's session. */
static void cur_hook(void *ud, SQLHSTMT h)
{
    source *s = ud;
    pthread_mutex_lock(&s->mu);
    s->cur = h;
    pthread_mutex_unlock(&s->mu);
}

/* ------------------------------------------------------------ worker */

typedef struct wstate {
    odbcsrc_db db;
    char       holder[256]; /* the leadership holder named by the last lead answer */
    char       member[256]; /* the live member (competing mode) named by it */
    odbcsrc_health *health; /* the source's */
} wstate;

/* One attempt of a request, in its own transaction. Returns the completion event. */
static odbc_event *execute_once(wstate *w, const odbc_req *r)
{
    odbcsrc_db *db = &w->db;
    odbc_event *e = done_event(r->kind, 0, NULL);
    int rc = 0;
    db->err[0] = '\0';
    db->native = 0;
    db->lost = false;
    switch (r->kind) {
    case SRC_REQ_LEAD: {
        int64_t got = 0, held = 0, reset = 0;
        rc = odbcsrc_db_lead(db, r->owner, r->epoch, r->lease_ms, &got, &held, &reset,
                             w->holder, w->member, sizeof w->holder);
        if (rc == 0) {
            e->res.leader = got > 0;
            e->res.epoch = got;
            e->res.holder_epoch = held;
            e->res.holder = w->holder[0] ? w->holder : NULL;
            e->res.newly_leader = got > 0 && got != r->epoch;
            e->res.n_reset = reset;
            e->res.member = w->member[0] ? w->member : NULL;
        }
        break;
    }
    case SRC_REQ_CLAIM:
        rc = odbcsrc_db_claim(db, r->max_rows, r->max_bytes, r->first_whole, r->max_payload,
                              r->lease_ms,
                              r->token, r->owner, r->epoch, r->competing, r->lost, r->n_lost,
                              &e->res.rows, &e->res.n_rows);
        break;
    case SRC_REQ_SETTLE:
        rc = odbcsrc_db_settle(db, r->outcomes, r->n_outcomes, &e->res.n_applied);
        break;
    case SRC_REQ_CLEANUP:
        rc = odbcsrc_db_cleanup(db, r->retention_ms, r->limit, r->owner, r->epoch,
                                &e->res.n_deleted);
        break;
    case SRC_REQ_STATS:
        rc = odbcsrc_db_stats(db, &e->res.stats, false);
        break;
    case SRC_REQ_HEALTH:
        rc = odbcsrc_health_read(w->health, db, &e->res.health);
        break;
    }
    if (rc == 0)
        rc = odbcsrc_db_end(db, true);
    if (rc < 0) {
        if (!db->lost)
            (void)odbcsrc_db_end(db, false);
        for (size_t i = 0; i < e->res.n_rows; i++)
            row_free(e->res.rows[i]);
        free(e->res.rows);
        e->res.rows = NULL;
        e->res.n_rows = 0;
        e->res.n_applied = 0;
        e->res.leader = false;
        e->res.newly_leader = false;
        e->res.ok = -1;
        e->msg = strdup(db->err[0] ? db->err : "request failed");
    }
    return e;
}

/* A request chosen as a deadlock victim (SQL Server error 1205; the relay's
 * sessions run at DEADLOCK_PRIORITY LOW, so the application's transaction wins) is
 * run again, at most this many times in all: the server rolled its transaction
 * back, and every request is safe to repeat (claims lease under a token, settles
 * apply only where that token still holds). Only the last failure is reported, once;
 * nothing is dead-lettered for it. Between attempts the worker waits, jittered and
 * doubling from DEADLOCK_BACKOFF_MS (the transactions that won get to finish instead
 * of meeting the same request again at once), and gives up as soon as the source is
 * being destroyed. */
#define DEADLOCK_ATTEMPTS 3
#define DEADLOCK_BACKOFF_MS 200

/* Waits on s->cv (mu held) for at most ms milliseconds (a signal ends it sooner). */
static void wait_locked(source *s, int64_t ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    (void)pthread_cond_timedwait(&s->cv, &s->mu, &ts);
}

/* Waits ms unless the source is stopping (then at once): false when it is. */
static bool pause_unless_stopping(source *s, int64_t ms)
{
    int64_t deadline = now_ms() + ms;
    pthread_mutex_lock(&s->mu);
    while (!s->stop) {
        int64_t left = deadline - now_ms();
        if (left <= 0)
            break;
        wait_locked(s, left);
    }
    bool go_on = !s->stop;
    pthread_mutex_unlock(&s->mu);
    return go_on;
}

static odbc_event *execute(source *s, wstate *w, const odbc_req *r, uint64_t *rng)
{
    odbc_event *e = execute_once(w, r);
    int64_t backoff = DEADLOCK_BACKOFF_MS;
    for (int attempt = 1; e->res.ok != 0 && !w->db.lost && w->db.native == SQL_TSQL_DEADLOCK &&
                          attempt < DEADLOCK_ATTEMPTS; attempt++) {
        if (!pause_unless_stopping(s, outbox_util_jitter(backoff, rng)))
            break;  /* stopping: the last failure stands */
        backoff *= 2;
        event_free(e);
        e = execute_once(w, r);
    }
    return e;
}

static void *worker_main(void *arg)
{
    source *s = arg;
    wstate w;
    int64_t backoff = BACKOFF_MIN_MS;
    uint64_t rng = outbox_util_seed(s);
    int reported = -1;          /* last state posted */
    char last[sizeof w.db.err] = "";

    memset(&w, 0, sizeof w);
    w.db.cur_fn = cur_hook;
    w.health = &s->health;
    w.db.cur_ud = s;
    w.db.dbc = SQL_NULL_HDBC;
    w.db.env = SQL_NULL_HENV;

    pthread_mutex_lock(&s->mu);
    while (!s->stop) {
        if (!w.db.connected) {
            pthread_mutex_unlock(&s->mu);
            int rc = odbcsrc_db_open(&w.db, &s->conf, ODBCSRC_TXN_RELAY);
            if (rc == 0 && (odbcsrc_db_verify(&w.db, true) < 0 || odbcsrc_db_warm(&w.db) < 0)) {
                rc = -1;
                odbcsrc_db_close(&w.db);
            }
            pthread_mutex_lock(&s->mu);
            if (s->stop)
                break;
            if (rc == 0) {
                backoff = BACKOFF_MIN_MS;
                last[0] = '\0';
                reported = SRC_UP;
                post_state_locked(s, SRC_UP, "connected");
                continue;
            }
            if (reported != SRC_DOWN || strcmp(last, w.db.err) != 0) {
                snprintf(last, sizeof last, "%s", w.db.err);
                reported = SRC_DOWN;
                post_state_locked(s, SRC_DOWN, last);
            }
            /* jittered, as every reconnect of the relay: relays that lost the same
               server do not all come back at once */
            int64_t deadline = now_ms() + outbox_util_jitter(backoff, &rng);
            backoff = outbox_util_backoff_next(backoff, BACKOFF_MIN_MS, s->conf.reconnect_max_ms);
            while (!s->stop) {
                if (s->has_req) {
                    char msg[sizeof last + 32];
                    snprintf(msg, sizeof msg, "not connected: %s", last);
                    push_locked(s, done_event(s->req.kind, -1, msg));
                    req_clear(&s->req);
                    s->has_req = false;
                    ev_async_send(s->loop, &s->async);
                    continue;
                }
                int64_t left = deadline - now_ms();
                if (left <= 0)
                    break;
                wait_locked(s, left);
            }
            continue;
        }
        if (!s->has_req) {
            pthread_cond_wait(&s->cv, &s->mu);
            continue;
        }
        odbc_req r = s->req;  /* ownership moves to this thread */
        memset(&s->req, 0, sizeof s->req);
        s->has_req = false;
        pthread_mutex_unlock(&s->mu);

        odbc_event *e = execute(s, &w, &r, &rng);
        req_clear(&r);
        bool lost = w.db.lost;
        char why[sizeof last];
        if (lost) {
            snprintf(why, sizeof why, "connection lost: %.990s", w.db.err);
            odbcsrc_db_close(&w.db);
            backoff = BACKOFF_MIN_MS;
        }
        pthread_mutex_lock(&s->mu);
        push_locked(s, e);
        ev_async_send(s->loop, &s->async);
        if (lost) {
            snprintf(last, sizeof last, "%s", why);
            reported = SRC_DOWN;
            post_state_locked(s, SRC_DOWN, why);
        }
    }
    pthread_mutex_unlock(&s->mu);
    odbcsrc_db_close(&w.db);
    return NULL;
}

/* ------------------------------------------------------------ loop side */

static void on_async(struct ev_loop *loop, ev_async *aw, int revents)
{
    source *s = aw->data;
    (void)loop;
    (void)revents;
    pthread_mutex_lock(&s->mu);
    odbc_event *list = s->head;
    s->head = s->tail = NULL;
    pthread_mutex_unlock(&s->mu);

    s->dispatching = true;
    while (list) {
        odbc_event *e = list;
        list = e->next;
        if (s->destroyed) {
            event_free(e);
            continue;
        }
        if (e->type == EVT_STATE) {
            s->up = e->state == SRC_UP;
            if (s->cbs.on_state)
                s->cbs.on_state(s->cbs.ud, e->state, e->msg ? e->msg : "");
        } else {
            if (s->outstanding) {
                s->outstanding = false;
                ev_unref(s->loop);
            }
            e->res.error = e->msg ? e->msg : (e->res.ok ? "request failed" : NULL);
            if (s->cbs.on_done) {
                s->cbs.on_done(s->cbs.ud, &e->res);
                e->res.rows = NULL;  /* rows now belong to the callee */
                e->res.n_rows = 0;
            }
        }
        event_free(e);
    }
    s->dispatching = false;
    if (s->destroyed)
        free(s);
}

static int odbcsrc_create(struct ev_loop *loop, const cfg_outbox *oc, const src_cbs *cbs,
                          source **out, char *err, size_t errlen)
{
    source *s = calloc(1, sizeof *s);
    pthread_condattr_t ca;
    *out = NULL;
    if (!s)
        goto oom;
    if (odbcsrc_conf_init(&s->conf, oc) < 0) {
        free(s);
        goto oom;
    }
    if (pthread_condattr_init(&ca) != 0) {
        odbcsrc_conf_clear(&s->conf);
        free(s);
        goto oom;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (pthread_cond_init(&s->cv, &ca) != 0) {
        pthread_condattr_destroy(&ca);
        odbcsrc_conf_clear(&s->conf);
        free(s);
        goto oom;
    }
    pthread_condattr_destroy(&ca);
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        pthread_cond_destroy(&s->cv);
        odbcsrc_conf_clear(&s->conf);
        free(s);
        goto oom;
    }
    s->loop = loop;
    s->cbs = *cbs;
    odbcsrc_health_init(&s->health, oc->name, oc->lease_ms, oc->query_timeout_ms);
    s->cur = SQL_NULL_HSTMT;
    ev_async_init(&s->async, on_async);
    s->async.data = s;
    ev_async_start(loop, &s->async);
    ev_unref(loop);  /* only an outstanding request keeps the loop alive */
    *out = s;  /* ownership to the caller: odbcsrc_destroy */
    return 0;
oom:
    snprintf(err, errlen, "odbc source: out of memory");
    return -1;
}

static void odbcsrc_start(source *s)
{
    if (s->thr_started)
        return;
    if (pthread_create(&s->thr, NULL, worker_main, s) != 0) {
        odbc_event *e = event_new(EVT_STATE);
        e->state = SRC_DOWN;
        e->msg = strdup("cannot start the ODBC worker thread");
        pthread_mutex_lock(&s->mu);
        push_locked(s, e);
        pthread_mutex_unlock(&s->mu);
        ev_async_send(s->loop, &s->async);
        return;
    }
    s->thr_started = true;
}

static void odbcsrc_destroy(source *s)
{
    if (!s || s->destroyed)
        return;
    if (s->thr_started) {
        pthread_mutex_lock(&s->mu);
        s->stop = true;
        if (s->cur != SQL_NULL_HSTMT)
            (void)SQLCancel(s->cur);  /* bounded: the query timeout bounds the rest */
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->thr, NULL);
        s->thr_started = false;
    }
    if (!s->outstanding)
        ev_ref(s->loop);  /* balance the ev_unref of create before stopping */
    s->outstanding = false;
    ev_async_stop(s->loop, &s->async);
    while (s->head) {
        odbc_event *e = s->head;
        s->head = e->next;
        event_free(e);
    }
    s->tail = NULL;
    req_clear(&s->req);
    odbcsrc_conf_clear(&s->conf);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    if (s->dispatching) {
        s->destroyed = true;  /* on_async frees s when the callback returns */
        return;
    }
    free(s);
}

/* Hands r to the worker (ownership moves) or fails it through the loop. */
static int submit(source *s, odbc_req *r)
{
    if (s->outstanding || s->destroyed) {
        req_clear(r);
        return -1;
    }
    s->outstanding = true;
    ev_ref(s->loop);
    pthread_mutex_lock(&s->mu);
    if (!s->up || !s->thr_started) {
        push_locked(s, done_event(r->kind, -1, "not connected"));
        req_clear(r);
    } else {
        s->req = *r;
        memset(r, 0, sizeof *r);
        s->has_req = true;
        pthread_cond_signal(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    ev_async_send(s->loop, &s->async);
    return 0;
}

static int odbcsrc_lead(source *s, const src_lead_args *a)
{
    odbc_req r = {0};
    r.kind = SRC_REQ_LEAD;
    r.epoch = a->epoch;
    r.lease_ms = a->lease_ms;
    r.owner = strdup(a->owner ? a->owner : "");
    if (!r.owner)
        return -1;
    return submit(s, &r);
}

/* Both dialects' claims stop at the byte limit (sql_pg_claim_bytes, sql_tsql_claim). */
static bool odbcsrc_claims_bytes(const source *s)
{
    (void)s;
    return true;
}

static int odbcsrc_claim(source *s, const src_claim_args *a)
{
    odbc_req r = {0};
    r.kind = SRC_REQ_CLAIM;
    r.max_rows = a->max_rows;
    r.lease_ms = a->lease_ms;
    r.token = a->lease_token;
    r.epoch = a->competing ? 0 : a->epoch;
    r.competing = a->competing;
    r.max_bytes = a->max_bytes;
    r.first_whole = a->first_whole;
    r.max_payload = a->max_payload;
    r.owner = strdup(a->owner ? a->owner : "");
    if (!r.owner)
        return -1;
    if (a->n_lost > 0) {
        r.lost = malloc(a->n_lost * sizeof *r.lost);
        if (!r.lost) {
            req_clear(&r);
            return -1;
        }
        memcpy(r.lost, a->lost, a->n_lost * sizeof *r.lost);
        r.n_lost = a->n_lost;
    }
    return submit(s, &r);
}

static int odbcsrc_settle(source *s, const src_outcome *v, size_t n)
{
    odbc_req r = {0};
    r.kind = SRC_REQ_SETTLE;
    r.outcomes = calloc(n ? n : 1, sizeof *r.outcomes);
    if (!r.outcomes)
        return -1;
    for (size_t i = 0; i < n; i++) {
        r.outcomes[i] = v[i];
        r.outcomes[i].reason = NULL;
        r.n_outcomes = i + 1;
        if (v[i].reason && !(r.outcomes[i].reason = strdup(v[i].reason))) {
            req_clear(&r);
            return -1;
        }
    }
    return submit(s, &r);
}

static int odbcsrc_cleanup(source *s, const src_cleanup_args *a)
{
    odbc_req r = {0};
    r.kind = SRC_REQ_CLEANUP;
    r.retention_ms = a->retention_ms;
    r.limit = a->limit;
    r.epoch = a->epoch;
    r.owner = strdup(a->owner ? a->owner : "");
    if (!r.owner)
        return -1;
    return submit(s, &r);
}

static int odbcsrc_stats(source *s)
{
    odbc_req r = {0};
    r.kind = SRC_REQ_STATS;
    return submit(s, &r);
}

static int odbcsrc_health_req(source *s)
{
    odbc_req r = {0};
    r.kind = SRC_REQ_HEALTH;
    return submit(s, &r);
}

/* ------------------------------------------------------------ admin (synchronous) */

/* Opens a session for an admin command and verifies the database (and the
 * tables when asked). 0, or -1 with err set and everything released. */
static int admin_open(const cfg_outbox *oc, odbcsrc_conf *conf, odbcsrc_db *db,
                      bool autocommit, bool tables, char *err, size_t errlen)
{
    memset(db, 0, sizeof *db);
    if (odbcsrc_conf_init(conf, oc) < 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (odbcsrc_db_open(db, conf, autocommit ? ODBCSRC_TXN_AUTO : ODBCSRC_TXN_CLIENT) < 0) {
        snprintf(err, errlen, "%s", db->err);
        odbcsrc_conf_clear(conf);
        return -1;
    }
    if (odbcsrc_db_verify(db, tables) < 0) {
        snprintf(err, errlen, "%s", db->err);
        odbcsrc_db_close(db);
        odbcsrc_conf_clear(conf);
        return -1;
    }
    return 0;
}

static void admin_close(odbcsrc_conf *conf, odbcsrc_db *db)
{
    odbcsrc_db_close(db);
    odbcsrc_conf_clear(conf);
}

static int odbcsrc_check(const cfg_outbox *oc, char *err, size_t errlen)
{
    odbcsrc_conf conf;
    odbcsrc_db db;
    if (admin_open(oc, &conf, &db, false, true, err, errlen) < 0)
        return -1;
    admin_close(&conf, &db);
    return 0;
}

static int odbcsrc_init(const cfg_outbox *oc, char *err, size_t errlen)
{
    odbcsrc_conf conf;
    odbcsrc_db db;
    int rc;
    if (admin_open(oc, &conf, &db, true, false, err, errlen) < 0)
        return -1;
    rc = odbcsrc_db_init(&db);
    if (rc < 0)
        snprintf(err, errlen, "%s", db.err);
    admin_close(&conf, &db);
    return rc;
}

static int odbcsrc_stats_sync(const cfg_outbox *oc, src_stats *out, char *err, size_t errlen)
{
    odbcsrc_conf conf;
    odbcsrc_db db;
    int rc;
    if (admin_open(oc, &conf, &db, false, true, err, errlen) < 0)
        return -1;
    rc = odbcsrc_db_stats(&db, out, true);
    if (rc < 0)
        snprintf(err, errlen, "%s", db.err);
    admin_close(&conf, &db);
    return rc;
}

static int odbcsrc_dead_list(const cfg_outbox *oc, FILE *out, char *err, size_t errlen)
{
    odbcsrc_conf conf;
    odbcsrc_db db;
    int rc;
    if (admin_open(oc, &conf, &db, false, true, err, errlen) < 0)
        return -1;
    rc = odbcsrc_db_dead_list(&db, out);
    if (rc < 0)
        snprintf(err, errlen, "%s", db.err);
    admin_close(&conf, &db);
    return rc;
}

static int dead_move(const cfg_outbox *oc, bool retry, const int64_t *ids, size_t n_ids,
                     size_t *affected, char *err, size_t errlen)
{
    odbcsrc_conf conf;
    odbcsrc_db db;
    int rc;
    *affected = 0;
    if (admin_open(oc, &conf, &db, false, true, err, errlen) < 0)
        return -1;
    rc = odbcsrc_db_dead_move(&db, retry, ids, n_ids, affected);
    if (rc == 0)
        rc = odbcsrc_db_end(&db, true);
    if (rc < 0) {
        snprintf(err, errlen, "%s", db.err);
        *affected = 0;
    }
    admin_close(&conf, &db);
    return rc;
}

static int odbcsrc_dead_retry(const cfg_outbox *oc, const int64_t *ids, size_t n_ids,
                              size_t *affected, char *err, size_t errlen)
{
    return dead_move(oc, true, ids, n_ids, affected, err, errlen);
}

static int odbcsrc_dead_purge(const cfg_outbox *oc, const int64_t *ids, size_t n_ids,
                              size_t *affected, char *err, size_t errlen)
{
    return dead_move(oc, false, ids, n_ids, affected, err, errlen);
}

const source_ops odbcsrc_ops = {
    .name       = "sqlserver",
    .create     = odbcsrc_create,
    .destroy    = odbcsrc_destroy,
    .start      = odbcsrc_start,
    .lead       = odbcsrc_lead,
    .claim      = odbcsrc_claim,
    .claims_bytes = odbcsrc_claims_bytes,
    .settle     = odbcsrc_settle,
    .cleanup    = odbcsrc_cleanup,
    .stats      = odbcsrc_stats,
    .health     = odbcsrc_health_req,
    .peer       = odbcsrc_peer,
    .check      = odbcsrc_check,
    .init       = odbcsrc_init,
    .stats_sync = odbcsrc_stats_sync,
    .dead_list  = odbcsrc_dead_list,
    .dead_retry = odbcsrc_dead_retry,
    .dead_purge = odbcsrc_dead_purge,
};
