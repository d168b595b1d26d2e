/*
 * drain.c — the per-outbox relay core. See drain.h for the rules it keeps.
 *
 * Life of a row: CLAIM (leased with a random token) → buffer (id order) →
 * publish when no earlier message of its partition key is in flight → the
 * sink's result → an outcome (SENT / RETRY / DEAD / UNCLAIM) queued in
 * `pending` → one SETTLE request applies all pending outcomes, fenced by token.
 *
 * Two database connections per outbox, each running one request at a time:
 * `main` holds leadership and runs claims, retention and stats; `settler`
 * applies outcomes. Claims and settles overlap, so the publish window stays
 * full while the database commits. kick() starts whatever each can run next.
 */
#include "relay/drain.h"

#include <ev.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "relay/keyset.h"
#include "relay/log.h"
#include "relay/sink.h"
#include "relay/source.h"

typedef struct entry {
    struct entry *prev, *next;   /* buffer list or in-flight list */
    struct drain *d;
    row          *r;             /* owned */
    bool          old;           /* published before the source last went down */
    ev_tstamp     published_at;
} entry;

typedef struct elist { entry *head, *tail; size_t n; } elist;

typedef struct outcome {
    src_outcome o;               /* o.reason owned (malloc'd) or NULL */
    char       *block_key;       /* owned: key blocked by this outcome until it is settled */
} outcome;

typedef struct outcomes { outcome *v; size_t n, cap; } outcomes;

/* One database connection (a source instance) and its request state. */
typedef struct sconn {
    struct drain *d;
    const char   *role;          /* "main" or "settler", for logs */
    source       *src;
    bool          up;
    bool          busy;          /* a request is outstanding */
    int           busy_req;
    ev_tstamp     req_started;
    bool          holding;       /* no request until hold_timer fires */
    double        fail_delay;    /* back-off after a failed request while the connection stays up */
    ev_timer      hold_timer;
    char          last_down[256];/* last reason given for being down */
} sconn;

struct drain {
    struct ev_loop   *loop;
    const cfg        *c;
    const cfg_outbox *ob;
    const source_ops *sops;
    sconn             main;      /* leadership, claims, retention, stats */
    sconn             settler;   /* settles */
    const sink_ops   *kops;
    sink             *snk;
    char              lock_name[200];
    char              conn_name[200];

    int       sink_state;
    bool      leader;
    size_t    claim_asked;

    bool      want_claim;        /* wake-up, poll tick or a full previous claim */
    bool      lead_due;
    bool      cleanup_due;
    bool      stats_due;
    double    poll_delay;        /* adaptive: grows while claims come back empty */

    bool      stopping;
    bool      stop_reported;
    void    (*on_stopped)(void *ud);
    void     *stop_ud;

    elist     buffer;            /* claimed, not yet published, id order */
    elist     inflight;          /* published, awaiting the sink's result */
    size_t    n_old_inflight;
    keyset    busy_keys;         /* partition key -> id of its in-flight message */
    keyset    blocked;           /* partition key -> id of a failed row not yet settled */
    keyset    unblock_later;     /* settled while a claim was running: unblock after it */
    keyset    held;              /* id -> entry (as intptr_t) of every buffered/in-flight row,
                                    or HELD_OUTCOME until the row's outcome is settled */
    outcomes  resettle;          /* outcomes re-issued under a newer token after the running settle */
    outcomes  recent;            /* settled while a claim was running: kept until it returns */
    outcomes  pending;           /* not yet sent to the source */
    outcomes  settling;          /* in the outstanding SETTLE request */
    bool      oom_warned;

    ev_timer  poll_timer;
    ev_timer  lead_timer;
    ev_timer  cleanup_timer;
    ev_timer  stats_timer;
    ev_idle   kick_idle;         /* runs kick() once the current callback chain is done */

    ob_metrics m;
};

static void kick(drain *d);
static void pump(drain *d);

/* ---------- small helpers ---------- */

static void elist_push(elist *l, entry *e)
{
    e->prev = l->tail;
    e->next = NULL;
    if (l->tail)
        l->tail->next = e;
    else
        l->head = e;
    l->tail = e;
    l->n++;
}

static void elist_remove(elist *l, entry *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        l->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        l->tail = e->prev;
    e->prev = e->next = NULL;
    l->n--;
}

static void id_key(int64_t id, char out[24])
{
    snprintf(out, 24, "%" PRId64, id);
}

#define HELD_OUTCOME (-1)   /* `held` value: the row's outcome is pending or being settled */

/* Frees an entry; its id is forgotten unless an outcome now stands for it. */
static void entry_free(entry *e)
{
    if (e == NULL)
        return;
    char k[24];
    int64_t v;
    id_key(e->r->id, k);
    if (keyset_get(&e->d->held, k, &v) && v == (int64_t)(intptr_t)e)
        keyset_del(&e->d->held, k);
    row_free(e->r);
    free(e);
}

static int64_t new_token(void)
{
    uint64_t t = 0;
    while (t == 0) {
        if (getrandom(&t, sizeof t, 0) != (ssize_t)sizeof t) {
            /* getrandom on Linux ≥ 3.17 does not fail for 8 bytes; fall back anyway */
            t = (uint64_t)ev_time() * 1000003u ^ (uint64_t)(uintptr_t)&t;
        }
        t &= INT64_MAX;
    }
    return (int64_t)t;
}

static void outcomes_free(outcomes *o)
{
    for (size_t i = 0; i < o->n; i++) {
        free((char *)o->v[i].o.reason);
        free(o->v[i].block_key);
    }
    free(o->v);
    *o = (outcomes){ 0 };
}

/* Queues an outcome for r. reason is copied. block_key (may be NULL) is copied. */
static void add_outcome(drain *d, const row *r, int kind, int64_t backoff_ms,
                        const char *reason, const char *block_key)
{
    outcomes *p = &d->pending;
    if (p->n == p->cap) {
        size_t ncap = p->cap ? p->cap * 2 : 64;
        outcome *nv = realloc(p->v, ncap * sizeof *nv);
        if (nv == NULL)
            goto oom;
        p->v = nv;
        p->cap = ncap;
    }
    outcome *o = &p->v[p->n];
    *o = (outcome){ .o = { .id = r->id, .lease_token = r->lease_token, .kind = kind,
                           .backoff_ms = backoff_ms } };
    if (reason != NULL && (o->o.reason = strdup(reason)) == NULL)
        goto oom;
    if (block_key != NULL && (o->block_key = strdup(block_key)) == NULL) {
        free((char *)o->o.reason);
        goto oom;
    }
    p->n++;
    char k[24];
    id_key(r->id, k);
    if (keyset_put(&d->held, k, HELD_OUTCOME) != 0)
        log_msg(LOG_ERROR, "outbox=%s: out of memory tracking id=%" PRId64, d->ob->name, r->id);
    return;
oom:
    /* The row keeps its lease; it becomes claimable again when the lease expires. */
    if (!d->oom_warned)
        log_msg(LOG_ERROR, "outbox=%s: out of memory recording the outcome of id=%" PRId64
                "; its lease will expire instead", d->ob->name, r->id);
    d->oom_warned = true;
}

static outcome *find_outcome(outcomes *o, int64_t id)
{
    for (size_t i = 0; i < o->n; i++)
        if (o->v[i].o.id == id)
            return &o->v[i];
    return NULL;
}

/* A claim leased again a row whose outcome is not settled yet (its lease had
   expired): the outcome must apply under the new token; the row is not published
   again. Returns false when out of memory. */
static bool adopt_outcome_token(drain *d, const row *r)
{
    outcome *o = find_outcome(&d->pending, r->id);
    if (o != NULL) {
        o->o.lease_token = r->lease_token;
        return true;
    }
    /* Settled while this claim ran: the claim could only lease the row again if the
       settle found the token already changed, i.e. did not apply. Issue it again. */
    o = find_outcome(&d->recent, r->id);
    if (o != NULL) {
        outcomes *p = &d->pending;
        if (p->n == p->cap) {
            size_t ncap = p->cap ? p->cap * 2 : 64;
            outcome *nv = realloc(p->v, ncap * sizeof *nv);
            if (nv == NULL)
                return false;
            p->v = nv;
            p->cap = ncap;
        }
        p->v[p->n] = (outcome){ .o = o->o };
        p->v[p->n].o.lease_token = r->lease_token;
        p->v[p->n].o.reason = o->o.reason;   /* moves */
        o->o.reason = NULL;
        p->n++;
        return true;
    }
    o = find_outcome(&d->settling, r->id);
    if (o == NULL)
        return false;
    outcomes *rs = &d->resettle;
    if (rs->n == rs->cap) {
        size_t ncap = rs->cap ? rs->cap * 2 : 16;
        outcome *nv = realloc(rs->v, ncap * sizeof *nv);
        if (nv == NULL)
            return false;
        rs->v = nv;
        rs->cap = ncap;
    }
    outcome *n = &rs->v[rs->n];
    *n = (outcome){ .o = o->o };
    n->o.lease_token = r->lease_token;
    n->o.reason = NULL;
    if (o->o.reason != NULL && (n->o.reason = strdup(o->o.reason)) == NULL)
        return false;
    if (o->block_key != NULL && (n->block_key = strdup(o->block_key)) == NULL) {
        free((char *)n->o.reason);
        return false;
    }
    rs->n++;
    return true;
}

static void schedule_kick(drain *d)
{
    if (!ev_is_active(&d->kick_idle))
        ev_idle_start(d->loop, &d->kick_idle);
}

/* Blocks key until the outcome that failed row id is settled, and gives back
   every buffered later row of the same key so nothing overtakes it. */
static void block_key(drain *d, const char *key, int64_t id)
{
    if (key == NULL)
        return;
    if (keyset_put(&d->blocked, key, id) != 0)
        log_msg(LOG_ERROR, "outbox=%s: out of memory blocking key", d->ob->name);
    for (entry *e = d->buffer.head, *next; e != NULL; e = next) {
        next = e->next;
        if (e->r->partition_key != NULL && strcmp(e->r->partition_key, key) == 0) {
            elist_remove(&d->buffer, e);
            add_outcome(d, e->r, SRC_UNCLAIM, 0, NULL, NULL);
            entry_free(e);
        }
    }
}

/* Gives every buffered row back to the table. */
static void unclaim_buffer(drain *d)
{
    entry *e;
    while ((e = d->buffer.head) != NULL) {
        elist_remove(&d->buffer, e);
        add_outcome(d, e->r, SRC_UNCLAIM, 0, NULL, NULL);
        entry_free(e);
    }
}

static int64_t backoff_for(const cfg_outbox *ob, int attempts)
{
    int64_t b = ob->retry_backoff_ms;
    for (int i = 1; i < attempts && b < ob->retry_backoff_max_ms; i++)
        b *= 2;
    return b > ob->retry_backoff_max_ms ? ob->retry_backoff_max_ms : b;
}

/* A failed attempt of r: retry with back-off, or dead-letter after max_attempts. */
static void row_failed(drain *d, const row *r, const char *reason)
{
    int attempts = r->attempts + 1;
    char why[600];
    if (attempts >= d->ob->max_attempts) {
        snprintf(why, sizeof why, "%s (after %d attempts)", reason, attempts);
        log_msg(LOG_ERROR, "outbox=%s id=%" PRId64 " message_id=%s: dead-lettered: %s",
                d->ob->name, r->id, r->message_id, why);
        add_outcome(d, r, SRC_DEAD, 0, why, r->partition_key);
        d->m.dead++;
    } else {
        int64_t b = backoff_for(d->ob, attempts);
        log_msg(LOG_WARN, "outbox=%s id=%" PRId64 " message_id=%s: attempt %d/%d failed: %s; "
                "retry in %" PRId64 " ms", d->ob->name, r->id, r->message_id, attempts,
                d->ob->max_attempts, reason, b);
        add_outcome(d, r, SRC_RETRY, b, reason, r->partition_key);
    }
    block_key(d, r->partition_key, r->id);
}

/* ---------- sink callbacks ---------- */

static void sink_on_state(void *ud, int state, const char *msg)
{
    drain *d = ud;
    int was = d->sink_state;
    d->sink_state = state;
    d->m.sink_up = state != SINK_DOWN;
    d->m.sink_blocked = state == SINK_BLOCKED;
    if (state == SINK_UP) {
        if (was == SINK_BLOCKED)
            log_msg(LOG_INFO, "outbox=%s sink=%s: broker unblocked, publishing resumes",
                    d->ob->name, d->ob->sink_name);
        else
            log_msg(LOG_INFO, "outbox=%s sink=%s: connected", d->ob->name, d->ob->sink_name);
        d->want_claim = true;
        pump(d);
    } else if (state == SINK_BLOCKED) {
        log_msg(LOG_WARN, "outbox=%s sink=%s: broker blocked the connection (%s); publishing paused",
                d->ob->name, d->ob->sink_name, msg ? msg : "resource alarm");
    } else {
        log_msg(was == SINK_DOWN ? LOG_DEBUG : LOG_WARN, "outbox=%s sink=%s: down: %s",
                d->ob->name, d->ob->sink_name, msg ? msg : "?");
        unclaim_buffer(d);
    }
    schedule_kick(d);
}

static void sink_on_result(void *ud, void *msg_ud, int outcome_kind, const char *reason)
{
    drain *d = ud;
    entry *e = msg_ud;
    row *r = e->r;
    elist_remove(&d->inflight, e);
    d->m.in_flight = d->inflight.n;
    if (e->old && d->n_old_inflight > 0)
        d->n_old_inflight--;
    if (r->partition_key != NULL) {
        int64_t v;
        if (keyset_get(&d->busy_keys, r->partition_key, &v) && v == r->id)
            keyset_del(&d->busy_keys, r->partition_key);
    }
    switch (outcome_kind) {
    case SINK_ACK:
        histogram_observe(&d->m.confirm_latency, ev_now(d->loop) - e->published_at);
        add_outcome(d, r, SRC_SENT, 0, NULL, NULL);
        break;
    case SINK_RETURNED:
        d->m.returned++;
        d->m.failed++;
        row_failed(d, r, reason ? reason : "returned by the broker (unroutable)");
        break;
    case SINK_NACKED:
        d->m.nacked++;
        d->m.failed++;
        row_failed(d, r, reason ? reason : "nacked by the broker");
        break;
    case SINK_REJECTED:
        d->m.rejected++;
        d->m.failed++;
        row_failed(d, r, reason ? reason : "rejected by the broker");
        break;
    default: /* SINK_LOST: not the message's fault */
        d->m.lost++;
        add_outcome(d, r, SRC_UNCLAIM, 0, NULL, r->partition_key);
        block_key(d, r->partition_key, r->id);
        break;
    }
    entry_free(e);
    pump(d);
    schedule_kick(d);
}

static void sink_on_writable(void *ud)
{
    drain *d = ud;
    pump(d);
    schedule_kick(d);
}

/* Publishes buffered rows while the sink accepts them, one in flight per key. */
static void pump(drain *d)
{
    if (d->sink_state != SINK_UP || d->stopping)
        return;
    for (entry *e = d->buffer.head, *next; e != NULL; e = next) {
        next = e->next;
        const char *key = e->r->partition_key;
        if (key != NULL && keyset_get(&d->busy_keys, key, NULL))
            continue;
        char err[300] = "";
        int rc = d->kops->publish(d->snk, e->r, e, err, sizeof err);
        if (rc == SINK_EAGAIN)
            break;
        elist_remove(&d->buffer, e);
        if (rc == SINK_QUEUED) {
            e->published_at = ev_now(d->loop);
            elist_push(&d->inflight, e);
            d->m.in_flight = d->inflight.n;
            if (key != NULL && keyset_put(&d->busy_keys, key, e->r->id) != 0)
                log_msg(LOG_ERROR, "outbox=%s: out of memory tracking key", d->ob->name);
        } else {
            /* can never be published: dead-letter now, later rows of its key go on */
            char why[400];
            snprintf(why, sizeof why, "unpublishable: %s", err[0] ? err : "rejected by the sink");
            log_msg(LOG_ERROR, "outbox=%s id=%" PRId64 " message_id=%s: dead-lettered: %s",
                    d->ob->name, e->r->id, e->r->message_id, why);
            add_outcome(d, e->r, SRC_DEAD, 0, why, key);
            d->m.dead++;
            d->m.failed++;
            if (key != NULL && keyset_put(&d->blocked, key, e->r->id) != 0)
                log_msg(LOG_ERROR, "outbox=%s: out of memory blocking key", d->ob->name);
            entry_free(e);
        }
    }
}

/* ---------- source callbacks ---------- */

/* Logs a connection state change; the source reports every failed reconnect,
   so a repeated reason is logged once, then at debug level. */
static void log_conn_state(sconn *c, int state, const char *msg)
{
    drain *d = c->d;
    if (state == SRC_UP) {
        c->last_down[0] = '\0';
        if (c == &d->main)
            log_msg(LOG_INFO, "outbox=%s: database connected (database \"%s\", table %s)",
                    d->ob->name, d->ob->database, d->ob->table);
        return;
    }
    const char *why = msg ? msg : "?";
    bool repeat = !c->up && strcmp(c->last_down, why) == 0;
    log_msg(repeat ? LOG_DEBUG : c->up ? LOG_WARN : LOG_ERROR,
            "outbox=%s: database unavailable (%s connection): %s", d->ob->name, c->role, why);
    snprintf(c->last_down, sizeof c->last_down, "%s", why);
}

static void conn_up(sconn *c)
{
    c->up = true;
    c->holding = false;
    c->fail_delay = 0;
    ev_timer_stop(c->d->loop, &c->hold_timer);
}

static void main_on_state(void *ud, int state, const char *msg)
{
    sconn *c = ud;
    drain *d = c->d;
    log_conn_state(c, state, msg);
    if (state == SRC_UP) {
        conn_up(c);
        d->m.source_up = d->settler.up;
        d->want_claim = true;
        d->lead_due = true;
        d->stats_due = true;
    } else {
        c->up = false;
        d->m.source_up = 0;
        if (d->leader)
            log_msg(LOG_WARN, "outbox=%s: leadership lost with the database session", d->ob->name);
        d->leader = false;
        d->m.leader = 0;
        /* Buffered rows cannot be given back now; their leases expire or a new
           leader resets them. In-flight ones are settled by the other connection
           (the token fences them), and no new claim runs before they finish. */
        entry *e;
        while ((e = d->buffer.head) != NULL) {
            elist_remove(&d->buffer, e);
            entry_free(e);
        }
        for (e = d->inflight.head; e != NULL; e = e->next)
            if (!e->old) {
                e->old = true;
                d->n_old_inflight++;
            }
    }
    schedule_kick(d);
}

static void settler_on_state(void *ud, int state, const char *msg)
{
    sconn *c = ud;
    drain *d = c->d;
    log_conn_state(c, state, msg);
    if (state == SRC_UP) {
        conn_up(c);
        d->m.source_up = d->main.up;
    } else {
        c->up = false;
        d->m.source_up = 0;
    }
    schedule_kick(d);
}

static void src_on_wake(void *ud)
{
    drain *d = ((sconn *)ud)->d;
    d->want_claim = true;
    schedule_kick(d);
}

static void arm_poll(drain *d)
{
    ev_timer_stop(d->loop, &d->poll_timer);
    ev_timer_set(&d->poll_timer, d->poll_delay, 0.);
    ev_timer_start(d->loop, &d->poll_timer);
}

/* Unblocks keys whose failed row was settled while a claim was running. */
static void unblock_deferred(drain *d)
{
    keyset *u = &d->unblock_later;
    for (size_t i = 0; i < u->cap; i++) {
        const keyset_slot *sl = &u->slots[i];
        int64_t v;
        if (sl->key == NULL || sl->key == keyset_tomb ||
            !keyset_get(&d->blocked, sl->key, &v) || v != sl->value)
            continue;
        keyset_del(&d->blocked, sl->key);
    }
    keyset_clear(u);
}

/* The claim that ran while `recent` outcomes were settled has returned (its rows
   re-issued any of them that it leased again): forget the others' ids. */
static void forget_recent(drain *d)
{
    for (size_t i = 0; i < d->recent.n; i++) {
        int64_t id = d->recent.v[i].o.id, hv;
        char k[24];
        id_key(id, k);
        if (find_outcome(&d->pending, id) == NULL && find_outcome(&d->settling, id) == NULL &&
            keyset_get(&d->held, k, &hv) && hv == HELD_OUTCOME)
            keyset_del(&d->held, k);
    }
    outcomes_free(&d->recent);
}

static void on_claimed(drain *d, const src_result *res)
{
    double min_poll = d->ob->poll_interval_ms / 1000.0;
    if (min_poll > 0.05)
        min_poll = 0.05;
    d->m.claims++;
    if (res->ok != 0) {
        unblock_deferred(d);
        forget_recent(d);
    }
    histogram_observe(&d->m.claim_latency, ev_now(d->loop) - d->main.req_started);
    if (res->ok != 0) {
        d->want_claim = true;
        return;
    }
    d->m.claimed_rows += res->n_rows;
    for (size_t i = 0; i < res->n_rows; i++) {
        row *r = res->rows[i];
        /* A row we still hold whose lease expired meanwhile (a long broker block, say)
           was leased again by this claim: keep the one copy, under the new token. */
        char k[24];
        int64_t held;
        id_key(r->id, k);
        if (keyset_get(&d->held, k, &held)) {
            if (held != HELD_OUTCOME)
                ((entry *)(intptr_t)held)->r->lease_token = r->lease_token;
            else if (!adopt_outcome_token(d, r))
                log_msg(LOG_WARN, "outbox=%s id=%" PRId64 ": could not adopt a renewed lease; "
                        "the row may be published again", d->ob->name, r->id);
            row_free(r);
            continue;
        }
        int64_t fid;
        if (d->stopping || (r->partition_key != NULL &&
                            keyset_get(&d->blocked, r->partition_key, &fid) && fid < r->id)) {
            add_outcome(d, r, SRC_UNCLAIM, 0, NULL, NULL);
            row_free(r);
            continue;
        }
        entry *e = calloc(1, sizeof *e);
        if (e == NULL || keyset_put(&d->held, k, (int64_t)(intptr_t)e) != 0) {
            free(e);
            add_outcome(d, r, SRC_UNCLAIM, 0, NULL, NULL);
            row_free(r);
            continue;
        }
        e->d = d;
        e->r = r;     /* takes ownership */
        elist_push(&d->buffer, e);
    }
    free(res->rows);
    unblock_deferred(d);
    forget_recent(d);
    if (res->n_rows >= d->claim_asked) {
        d->want_claim = true;
        d->poll_delay = min_poll;
    } else {
        d->want_claim = false;
        d->poll_delay = res->n_rows > 0 ? min_poll : d->poll_delay * 2;
        if (d->poll_delay > d->ob->poll_interval_ms / 1000.0)
            d->poll_delay = d->ob->poll_interval_ms / 1000.0;
        if (d->poll_delay < min_poll)
            d->poll_delay = min_poll;
        arm_poll(d);
    }
    pump(d);
}

static void on_settled(drain *d, const src_result *res)
{
    outcomes *s = &d->settling;
    if (res->ok != 0) {
        /* put them back in front of anything newer and try again later */
        outcomes merged = *s;
        *s = (outcomes){ 0 };
        for (size_t i = 0; i < d->pending.n; i++) {
            if (merged.n == merged.cap) {
                size_t ncap = merged.cap ? merged.cap * 2 : 64;
                outcome *nv = realloc(merged.v, ncap * sizeof *nv);
                if (nv == NULL) {
                    /* give up on the older ones: their leases expire */
                    for (size_t k = i; k < d->pending.n; k++) {
                        free((char *)d->pending.v[k].o.reason);
                        free(d->pending.v[k].block_key);
                    }
                    break;
                }
                merged.v = nv;
                merged.cap = ncap;
            }
            merged.v[merged.n++] = d->pending.v[i];
        }
        free(d->pending.v);
        d->pending = merged;
        /* outcomes re-leased meanwhile: retry them under their newer token */
        for (size_t i = 0; i < d->resettle.n; i++) {
            outcome *o = find_outcome(&d->pending, d->resettle.v[i].o.id);
            if (o != NULL)
                o->o.lease_token = d->resettle.v[i].o.lease_token;
        }
        outcomes_free(&d->resettle);
        return;
    }
    /* A claim running now may have read the table before this settle committed
       (two connections): its rows of these keys are filtered first, then unblocked. */
    bool claim_running = d->main.busy && d->main.busy_req == SRC_REQ_CLAIM;
    size_t n_sent = 0;
    for (size_t i = 0; i < s->n; i++) {
        char ik[24];
        int64_t hv;
        id_key(s->v[i].o.id, ik);
        if (find_outcome(&d->resettle, s->v[i].o.id) != NULL)
            continue;   /* goes again under its newer token (and is counted then) */
        if (s->v[i].o.kind == SRC_SENT)
            n_sent++;
        /* with a claim running the id stays held until its rows were checked */
        if (!claim_running && keyset_get(&d->held, ik, &hv) && hv == HELD_OUTCOME)
            keyset_del(&d->held, ik);
        const char *k = s->v[i].block_key;
        int64_t v;
        if (k == NULL || !keyset_get(&d->blocked, k, &v) || v != s->v[i].o.id)
            continue;
        if (!claim_running)
            keyset_del(&d->blocked, k);
        else if (keyset_put(&d->unblock_later, k, v) != 0)
            log_msg(LOG_ERROR, "outbox=%s: out of memory tracking key", d->ob->name);
    }
    d->m.relayed += n_sent;
    if (res->n_applied + d->resettle.n < s->n) {
        size_t lost = s->n - res->n_applied - d->resettle.n;
        d->m.lease_lost += lost;
        log_msg(LOG_WARN, "outbox=%s: %zu of %zu outcomes not applied: the lease moved on "
                "(another relay took the rows over, or a lost connection had already "
                "applied them)", d->ob->name, lost, s->n);
    }
    if (claim_running) {
        /* keep them (ids still held) until the running claim returns */
        for (size_t i = 0; i < s->n; i++) {
            outcomes *rc = &d->recent;
            if (find_outcome(&d->resettle, s->v[i].o.id) != NULL)
                continue;
            if (rc->n == rc->cap) {
                size_t ncap = rc->cap ? rc->cap * 2 : 64;
                outcome *nv = realloc(rc->v, ncap * sizeof *nv);
                if (nv == NULL)
                    break;
                rc->v = nv;
                rc->cap = ncap;
            }
            rc->v[rc->n++] = (outcome){ .o = s->v[i].o };   /* reason moves */
            s->v[i].o.reason = NULL;
        }
    }
    outcomes_free(s);
    /* outcomes whose rows were leased again while this settle ran go once more */
    for (size_t i = 0; i < d->resettle.n; i++) {
        outcomes *p = &d->pending;
        if (p->n == p->cap) {
            size_t ncap = p->cap ? p->cap * 2 : 64;
            outcome *nv = realloc(p->v, ncap * sizeof *nv);
            if (nv == NULL) {
                free((char *)d->resettle.v[i].o.reason);
                free(d->resettle.v[i].block_key);
                continue;
            }
            p->v = nv;
            p->cap = ncap;
        }
        p->v[p->n++] = d->resettle.v[i];
    }
    free(d->resettle.v);
    d->resettle = (outcomes){ 0 };
}

/* A request failed but the connection may still be up (permissions, timeouts,
   a dropped table): wait before its next one, 100 ms doubling to 5 s. */
static void hold_after_failure(sconn *c)
{
    c->fail_delay = c->fail_delay > 0 ? c->fail_delay * 2 : 0.1;
    if (c->fail_delay > 5.0)
        c->fail_delay = 5.0;
    c->holding = true;
    ev_timer_stop(c->d->loop, &c->hold_timer);
    ev_timer_set(&c->hold_timer, c->fail_delay, 0.);
    ev_timer_start(c->d->loop, &c->hold_timer);
}

static void src_on_done(void *ud, const src_result *res)
{
    sconn *c = ud;
    drain *d = c->d;
    c->busy = false;
    if (res->ok != 0)
        hold_after_failure(c);
    else
        c->fail_delay = 0;
    switch (res->req) {
    case SRC_REQ_LEAD:
        if (res->ok == 0) {
            if (res->leader && !d->leader)
                log_msg(LOG_INFO, "outbox=%s: became the active relay%s", d->ob->name,
                        res->newly_leader ? "; leases left by a previous one released" : "");
            else if (!res->leader && d->m.leader == 0 && d->lead_due == false)
                log_msg(LOG_DEBUG, "outbox=%s: standing by", d->ob->name);
            d->leader = res->leader;
            d->m.leader = res->leader;
            if (d->leader)
                d->want_claim = true;
        }
        break;
    case SRC_REQ_CLAIM:
        on_claimed(d, res);
        break;
    case SRC_REQ_SETTLE:
        on_settled(d, res);
        break;
    case SRC_REQ_CLEANUP:
        if (res->ok == 0 && res->n_deleted > 0)
            log_msg(LOG_DEBUG, "outbox=%s: retention removed %zu rows", d->ob->name, res->n_deleted);
        if (res->ok == 0 && res->n_deleted >= (size_t)d->ob->cleanup_batch)
            d->cleanup_due = true;      /* more to do: continue after other work */
        break;
    case SRC_REQ_STATS:
        if (res->ok == 0) {
            d->m.backlog = res->stats.backlog;
            d->m.oldest_pending_s = res->stats.oldest_pending_s;
            d->m.dead_rows = res->stats.dead;
        }
        break;
    default:
        break;
    }
    if (res->ok != 0 && res->error != NULL)
        log_msg(LOG_WARN, "outbox=%s: database request failed: %s", d->ob->name, res->error);
    schedule_kick(d);
}

/* ---------- scheduling ---------- */

static bool may_drain(const drain *d)
{
    return d->ob->mode == CFG_MODE_COMPETING || d->leader;
}

/* Rows to claim now. A claim costs about the same round trip for 100 rows as for
   500, so claims are whole batches, issued while up to two batches beyond the
   window are still buffered: the window stays full while the database answers.
   Memory stays bounded by publish_window + 2 * batch_size rows. */
static size_t claim_size(const drain *d)
{
    size_t batch = (size_t)d->ob->batch_size;
    size_t limit = (size_t)d->ob->sink->publish_window + 2 * batch;
    size_t used = d->inflight.n + d->buffer.n;
    if (used >= limit)
        return 0;
    size_t room = limit - used;
    if (used > 0 && room < batch)
        return 0;    /* wait for a whole batch */
    return room < batch ? room : batch;
}

static bool start_settle(drain *d)
{
    size_t n = d->pending.n;
    src_outcome *v = malloc(n * sizeof *v);
    if (v == NULL)
        return false;
    for (size_t i = 0; i < n; i++)
        v[i] = d->pending.v[i].o;
    d->settling = d->pending;
    d->pending = (outcomes){ 0 };
    sconn *c = &d->settler;
    c->busy = true;
    c->busy_req = SRC_REQ_SETTLE;
    c->req_started = ev_now(d->loop);
    int rc = d->sops->settle(c->src, v, n);  /* copies v */
    free(v);
    if (rc != 0) {
        c->busy = false;
        d->pending = d->settling;
        d->settling = (outcomes){ 0 };
        return false;
    }
    return true;
}

static void check_stopped(drain *d)
{
    if (!d->stopping || d->stop_reported || d->main.busy || d->settler.busy)
        return;
    if (d->inflight.n == 0 && d->buffer.n == 0 && d->pending.n == 0) {
        d->stop_reported = true;
        log_msg(LOG_INFO, "outbox=%s: drained and settled", d->ob->name);
        if (d->on_stopped)
            d->on_stopped(d->stop_ud);
    }
}

/* Starts a request on the main connection; false if it could not start. */
static bool main_request(drain *d, int req)
{
    sconn *c = &d->main;
    c->busy = true;
    c->busy_req = req;
    c->req_started = ev_now(d->loop);
    int rc = -1;
    switch (req) {
    case SRC_REQ_LEAD:
        rc = d->sops->lead(c->src, d->lock_name);
        break;
    case SRC_REQ_CLAIM: {
        src_claim_args a = {
            .max_rows = claim_size(d),
            .lease_ms = d->ob->lease_ms,
            .lease_token = new_token(),
            .owner = d->c->relay.name,
        };
        d->claim_asked = a.max_rows;
        rc = d->sops->claim(c->src, &a);
        break;
    }
    case SRC_REQ_CLEANUP:
        rc = d->sops->cleanup(c->src, d->ob->retention_ms, (size_t)d->ob->cleanup_batch);
        break;
    case SRC_REQ_STATS:
        rc = d->sops->stats(c->src);
        break;
    default:
        break;
    }
    if (rc != 0)
        c->busy = false;
    return rc == 0;
}

static void kick(drain *d)
{
    sconn *st = &d->settler, *mc = &d->main;
    if (d->pending.n > 0 && st->up && !st->busy && !st->holding)
        start_settle(d);
    if (mc->up && !mc->busy && !mc->holding) {
        bool claim_ok = !d->stopping && may_drain(d) && d->sink_state == SINK_UP &&
                        d->n_old_inflight == 0 && d->want_claim && claim_size(d) > 0;
        if (d->ob->mode == CFG_MODE_LEADER && !d->leader && !d->stopping) {
            /* take over only once our own earlier work is settled */
            if (d->lead_due && d->n_old_inflight == 0 && d->pending.n == 0 && !st->busy) {
                d->lead_due = false;
                (void)main_request(d, SRC_REQ_LEAD);
            }
        } else if (claim_ok) {
            d->want_claim = false;
            if (!main_request(d, SRC_REQ_CLAIM))
                d->want_claim = true;
        }
        if (!mc->busy && d->cleanup_due && may_drain(d) && !d->stopping) {
            d->cleanup_due = false;
            (void)main_request(d, SRC_REQ_CLEANUP);
        }
        if (!mc->busy && d->stats_due && !d->stopping) {
            d->stats_due = false;
            (void)main_request(d, SRC_REQ_STATS);
        }
    }
    check_stopped(d);
}

/* ---------- timers ---------- */

static void kick_idle_cb(struct ev_loop *loop, ev_idle *w, int revents)
{
    (void)revents;
    drain *d = w->data;
    ev_idle_stop(loop, w);
    kick(d);
}

static void hold_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    sconn *c = w->data;
    c->holding = false;
    schedule_kick(c->d);
}

static void poll_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    drain *d = w->data;
    d->want_claim = true;
    schedule_kick(d);
}

static void lead_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    drain *d = w->data;
    if (!d->leader)
        d->lead_due = true;
    schedule_kick(d);
}

static void cleanup_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    drain *d = w->data;
    d->cleanup_due = true;
    schedule_kick(d);
}

static void stats_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    drain *d = w->data;
    d->stats_due = true;
    schedule_kick(d);
}

/* ---------- public ---------- */

drain *drain_new(struct ev_loop *loop, const cfg *c, const cfg_outbox *ob, char *err, size_t errlen)
{
    drain *d = calloc(1, sizeof *d);
    if (d == NULL) {
        snprintf(err, errlen, "outbox=%s: out of memory", ob->name);
        return NULL;
    }
    d->loop = loop;
    d->c = c;
    d->ob = ob;
    d->sink_state = SINK_DOWN;
    d->poll_delay = ob->poll_interval_ms / 1000.0;
    d->m.outbox = ob->name;
    d->m.sink = ob->sink_name;
    d->m.backlog = -1;
    snprintf(d->lock_name, sizeof d->lock_name, "outbox-relay:%s.%s", ob->schema_part, ob->table_part);
    snprintf(d->conn_name, sizeof d->conn_name, "outbox-relay %s/%s", c->relay.name, ob->name);

    d->sops = source_ops_for(ob);
    d->kops = sink_ops_for(ob->sink);
    if (d->sops == NULL || d->kops == NULL) {
        snprintf(err, errlen, "outbox=%s: no source or sink implementation", ob->name);
        free(d);
        return NULL;
    }
    char e2[512] = "";
    sconn *conns[2] = { &d->main, &d->settler };
    for (int i = 0; i < 2; i++) {
        sconn *sc = conns[i];
        sc->d = d;
        sc->role = i == 0 ? "main" : "settler";
        ev_timer_init(&sc->hold_timer, hold_cb, 0.1, 0.);
        sc->hold_timer.data = sc;
        src_cbs scb = { .ud = sc, .on_state = i == 0 ? main_on_state : settler_on_state,
                        .on_wake = src_on_wake, .on_done = src_on_done };
        if (d->sops->create(loop, ob, &scb, &sc->src, e2, sizeof e2) != 0) {
            snprintf(err, errlen, "outbox=%s: %s", ob->name, e2);
            if (i == 1)
                d->sops->destroy(d->main.src);
            free(d);
            return NULL;
        }
    }
    sink_cbs kcb = { .ud = d, .on_state = sink_on_state, .on_result = sink_on_result,
                     .on_writable = sink_on_writable };
    if (d->kops->create(loop, ob->sink, d->conn_name, &kcb, &d->snk, e2, sizeof e2) != 0) {
        snprintf(err, errlen, "outbox=%s sink=%s: %s", ob->name, ob->sink_name, e2);
        d->sops->destroy(d->main.src);
        d->sops->destroy(d->settler.src);
        free(d);
        return NULL;
    }
    ev_timer_init(&d->poll_timer, poll_cb, d->poll_delay, 0.);
    d->poll_timer.data = d;
    ev_timer_init(&d->lead_timer, lead_cb, 1., 1.);
    d->lead_timer.data = d;
    double ci = ob->cleanup_interval_ms / 1000.0;
    ev_timer_init(&d->cleanup_timer, cleanup_cb, ci, ci);
    d->cleanup_timer.data = d;
    ev_timer_init(&d->stats_timer, stats_cb, 5., 5.);
    d->stats_timer.data = d;
    ev_idle_init(&d->kick_idle, kick_idle_cb);
    d->kick_idle.data = d;
    return d;
}

void drain_start(drain *d)
{
    if (d->ob->mode == CFG_MODE_LEADER)
        ev_timer_start(d->loop, &d->lead_timer);
    ev_timer_start(d->loop, &d->cleanup_timer);
    ev_timer_start(d->loop, &d->stats_timer);
    arm_poll(d);
    d->sops->start(d->main.src);
    d->sops->start(d->settler.src);
    d->kops->start(d->snk);
}

void drain_stop(drain *d, void (*on_stopped)(void *ud), void *ud)
{
    d->on_stopped = on_stopped;
    d->stop_ud = ud;
    if (d->stopping)
        return;
    d->stopping = true;
    log_msg(LOG_INFO, "outbox=%s: stopping: %zu in flight, %zu buffered rows given back",
            d->ob->name, d->inflight.n, d->buffer.n);
    unclaim_buffer(d);
    ev_timer_stop(d->loop, &d->poll_timer);
    ev_timer_stop(d->loop, &d->lead_timer);
    ev_timer_stop(d->loop, &d->cleanup_timer);
    ev_timer_stop(d->loop, &d->stats_timer);
    schedule_kick(d);
}

void drain_free(drain *d)
{
    if (d == NULL)
        return;
    ev_timer_stop(d->loop, &d->poll_timer);
    ev_timer_stop(d->loop, &d->lead_timer);
    ev_timer_stop(d->loop, &d->cleanup_timer);
    ev_timer_stop(d->loop, &d->stats_timer);
    ev_timer_stop(d->loop, &d->main.hold_timer);
    ev_timer_stop(d->loop, &d->settler.hold_timer);
    ev_idle_stop(d->loop, &d->kick_idle);
    d->kops->destroy(d->snk);
    d->sops->destroy(d->main.src);
    d->sops->destroy(d->settler.src);
    entry *e;
    while ((e = d->buffer.head) != NULL) {
        elist_remove(&d->buffer, e);
        entry_free(e);
    }
    while ((e = d->inflight.head) != NULL) {
        elist_remove(&d->inflight, e);
        entry_free(e);
    }
    outcomes_free(&d->pending);
    outcomes_free(&d->settling);
    outcomes_free(&d->resettle);
    outcomes_free(&d->recent);
    keyset_clear(&d->busy_keys);
    keyset_clear(&d->blocked);
    keyset_clear(&d->unblock_later);
    keyset_clear(&d->held);
    free(d);
}

bool drain_ready(const drain *d)
{
    return d->main.up && d->settler.up && d->sink_state != SINK_DOWN;
}

ob_metrics *drain_metrics(drain *d)
{
    return &d->m;
}
