/*
 * drain.c — the per-outbox relay core: the wiring between a source (two
 * database connections), a sink (one broker connection), timers and the
 * ledger (relay/ledger.c), which owns every row's life and its invariants.
 *
 * Two database connections per outbox, each running one request at a time:
 * `main` holds leadership and runs claims and nothing else, so that no slower statement
 * ever runs in front of a claim; `settler` applies outcomes and runs the backlog and
 * table-health reads and retention. Claims and settles overlap, so the publish window stays
 * full while the database commits. kick() starts whatever each can run next;
 * pump() publishes what the ledger allows while the sink takes it.
 *
 * Time: lease deadlines and confirm latencies use the monotonic clock. A row
 * is never published past its claim's deadline: the time the claim was sent,
 * plus the lease, minus a safety margin (lease / 5, at most 10 s).
 */
#include "relay/drain.h"

#include <ev.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "lib/outbox_util.h"
#include "relay/budget.h"
#include "relay/ledger.h"
#include "relay/log.h"
#include "relay/sink.h"
#include "relay/source.h"

#define DRAIN_MARGIN_MAX 10.0   /* seconds kept between a lease deadline and its expiry */
#define STATS_BUSY_S     5.0    /* backlog and oldest-pending refresh while rows move */
#define STATS_IDLE_S     30.0   /* ... and while nothing happened since the last one */
#define SETTLE_GATHER_S  0.02   /* a settle of fewer than batch_size outcomes waits this long
                                   after the previous one (see settle_gathering) */

/* One database connection (a source instance) and its request state. */
typedef struct sconn {
    struct drain *d;
    const char   *role;          /* "main" or "settler", for logs */
    source       *src;
    bool          up;
    bool          busy;          /* a request is outstanding */
    enum src_req  busy_req;
    ev_tstamp     req_started;
    bool          holding;       /* no request until hold_timer fires */
    int64_t       fail_delay_ms; /* back-off after a failed request while the connection stays up */
    ev_timer      hold_timer;
    log_limit     down_log;      /* its failures, rate-limited (relay/log.h) */
} sconn;

/* The most ids of rows already held that a claim is told it may pass over
   (src_claim_args.held): under a steady stream those are a few dozen (published, waiting
   for a confirm or a mark); with more held, the claim looks at the rest itself. */
#define CLAIM_HELD_MAX 64

struct drain {
    struct ev_loop   *loop;
    const cfg        *c;
    const cfg_outbox *ob;
    const source_ops *sops;
    sconn             main;      /* leadership, claims */
    sconn             settler;   /* settles, stats, table health, retention */
    const sink_ops   *kops;
    sink             *snk;
    ledger           *led;       /* every row held, from claim to settled */
    rbudget          *budget;    /* the process's rows in memory, shared by every drain */
    rb_member         rb;        /* this drain's part of it */
    char              owner[200];    /* this instance: "<relay name>/<random hex>" */
    char              conn_name[200];

    int       sink_state;
    log_limit sink_log;          /* broker connection failures, rate-limited (relay/log.h) */
    const char *broker_addrs[SINK_MAX_ADDRESSES]; /* borrowed from the config, for the metrics */
    long      last_broker;       /* the address connected last (failover count), -1 none */
    double    nack_logged_at;    /* monotonic: the last nack_reopen logged at WARN */
    unsigned  nack_quiet;        /* nack_reopens logged at debug since */
    bool      leader;            /* we hold the leadership lease (leader mode) */
    int64_t   epoch;             /* its epoch (fencing token), 0 when not leader */
    double    leader_until;      /* monotonic: we may act as leader until then */
    double    lead_sent;         /* monotonic time the outstanding lead request was sent */
    size_t    claim_asked;
    int64_t   claim_held[CLAIM_HELD_MAX];   /* the running claim's src_claim_args.held */
    int64_t   claim_token;       /* the running claim's lease token */
    /* the tokens of claims that failed without an answer (src_claim_args.lost), oldest
       first, each kept until (monotonic) its lease would have run out: as many as claims
       fail within one lease. A failure that is not a lost answer (a server error rolls the
       claim back, a claim never sent) is kept too, harmlessly. */
    int64_t  *lost;              /* owned */
    double   *lost_until;        /* owned */
    size_t    n_lost, lost_cap;
    size_t    claim_bytes;       /* the running claim's byte limit (reserved), 0: none */
    double    claim_sent;        /* monotonic time the outstanding claim was sent */
    double    claim_deadline;    /* monotonic: rows of the running claim publish before this */
    double    claim_ended;       /* monotonic: when the last claim's answer came */
    bool      claim_short;       /* it brought fewer rows than asked: the backlog is drained */
    size_t    row_bytes;         /* the mean size of the rows the last claim brought, 0: none */
    double    settle_ended;      /* monotonic: when the last settle's answer came */

    bool      want_claim;        /* wake-up, poll tick or a full previous claim */
    bool      active;            /* rows claimed or settled, or a wake-up, since the last stats */
    bool      due_asked;         /* a wake-up or a settle since: ask when rows fall due */
    double    stats_at;          /* monotonic time of the last stats result, 0: none yet */
    double    stats_age;         /* the oldest pending row's age it reported */
    uint64_t  token_state;       /* splitmix64 state for lease tokens, seeded by getrandom */
    bool      lead_due;
    bool      cleanup_due;
    int64_t   cleanup_backoff_ms; /* retention failing: the wait before its next try; 0: not */
    log_limit cleanup_log;       /* a failing retention: logged once per episode */
    log_limit req_log[METRICS_DB_REQUESTS]; /* the other requests' failures, by kind */
    bool      stats_due;
    bool      health_due;
    bool      horizon_held;      /* a held-back xmin horizon was reported (WARN), not ended */
    bool      horizon_blind_logged; /* "cannot see other sessions" was logged */
    char      horizon_holder[200];  /* who held it, for the "ended" line ... */
    char      horizon_warned[240];  /* ... and its holder_key then */
    char      holder_key[240];   /* the horizon's holder at the last read: who, and its xmin ... */
    double    holder_since;      /* ... and since when (monotonic) it has held that xmin */
    double    poll_delay;        /* adaptive: grows while claims come back empty */
    double    due_at;            /* monotonic: when the first pending row not claimable at
                                    the last stats becomes so (the poll wakes by then); 0 none */
    char      other_mode[256];   /* a live relay of the other mode keeps this one from
                                    claiming (reported at WARN): its owner; "": none */

    bool      stopping;
    bool      resigned;          /* stopping: leadership or membership handed over (lease 0) */
    bool      settle_gives_back; /* the settle in flight gives rows back to the table */
    bool      given_back;        /* one did since the last claim (src_claim_args.given_back) */
    bool      stop_reported;
    void    (*on_stopped)(void *ud);
    void     *stop_ud;

    ev_timer  poll_timer;
    ev_timer  lead_timer;
    ev_timer  deadline_timer;    /* fires at leader_until: the leadership lapses then */
    ev_timer  cleanup_timer;
    ev_timer  cleanup_retry;     /* one shot: a failed retention tries again after back-off */
    ev_timer  stats_timer;
    ev_timer  health_timer;      /* every health_interval: the table's health */
    ev_timer  coalesce_timer;    /* a woken claim waits for it (claim_delay after a short one) */
    ev_timer  expire_timer;      /* nothing can be published: fires at the first buffered
                                    row's deadline, to give it back and free its bytes */
    ev_idle   kick_idle;         /* runs kick() once the current callback chain is done */

    ob_metrics m;
};

static void kick(drain *d);
static void pump(drain *d);
static void arm_poll(drain *d);
static bool lead_valid(drain *d);
static bool ob_health_on(const drain *d);

/* ---------- small helpers ---------- */

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t random_seed(void)
{
    uint64_t t = 0;
    if (getrandom(&t, sizeof t, 0) != (ssize_t)sizeof t) {
        /* getrandom on Linux >= 3.17 does not fail for 8 bytes; fall back anyway */
        t = (uint64_t)(mono_now() * 1e9) * 1000003u ^ (uint64_t)(uintptr_t)&t;
    }
    return t;
}

/* A lease token: unique per claim and instance (a 63-bit splitmix64 sequence from a
   random seed), never 0. No system call per claim: an idle relay claims often. */
static int64_t new_token(drain *d)
{
    uint64_t t = 0;
    while (t == 0) {
        t = outbox_util_splitmix64(&d->token_state) & INT64_MAX;
    }
    return (int64_t)t;
}

/* Does each commit to the outbox wake us (LISTEN/NOTIFY up on the claiming connection)? */
static bool notified(const drain *d)
{
    return d->sops->notifies != NULL && d->main.up && d->sops->notifies(d->main.src);
}

/* The poll interval in force now (poll_interval, or auto's value for this connection). */
static double poll_s(const drain *d)
{
    return (double)cfg_poll_interval_ms(d->ob, notified(d)) / 1000.0;
}

/* Does the source stop its claims at a byte limit (src_claim_args.max_bytes)? */
static bool claims_bytes(const drain *d)
{
    return d->sops->claims_bytes != NULL && d->sops->claims_bytes(d->main.src);
}

static void schedule_kick(drain *d)
{
    if (!ev_is_active(&d->kick_idle))
        ev_idle_start(d->loop, &d->kick_idle);
}

/* Rows this drain holds in memory for the budget: buffered and in flight, and what a
   running claim asked for (the budget is taken before the rows arrive). */
static size_t rows_held(const drain *d)
{
    size_t n = ledger_n_inflight(d->led) + ledger_n_buffered(d->led);
    if (d->main.busy && d->main.busy_req == SRC_REQ_CLAIM)
        n += d->claim_asked;
    return n;
}

/* Their bytes (payload + headers), a running claim's byte limit included. */
static size_t bytes_held(const drain *d)
{
    size_t n = ledger_bytes(d->led);
    if (d->main.busy && d->main.busy_req == SRC_REQ_CLAIM)
        n += d->claim_bytes;
    return n;
}

/* Copies the ledger's counters into the metrics the HTTP endpoint renders, and what the
   drain holds into the row budget. */
static void sync_metrics(drain *d)
{
    rbudget_hold(d->budget, &d->rb, rows_held(d), bytes_held(d));
    const ledger_stats *st = ledger_get_stats(d->led);
    d->m.relayed = st->relayed;
    d->m.failed = st->failed;
    d->m.returned = st->returned;
    d->m.nacked = st->nacked;
    d->m.rejected = st->rejected;
    d->m.refused = st->refused;
    d->m.dead = st->dead;
    d->m.retried_unconfirmed = st->given_back;
    d->m.overtaken = st->overtaken;
    d->m.expired = st->expired;
    d->m.lease_lost = st->lease_lost;
    d->m.in_flight = ledger_n_inflight(d->led);
    d->m.buffered = ledger_n_buffered(d->led);
    d->m.held_bytes = ledger_bytes(d->led);
    d->m.unmarked = ledger_n_unsettled_sent(d->led);
}

/* ---------- sink callbacks ---------- */

/* The reason in a sink's message without the peer it starts with ("broker <peer>: "):
   the peer is a field of its own. msg itself when it does not name the peer first. */
static const char *sink_reason(const char *msg, const char *peer)
{
    const char *p = msg != NULL && peer != NULL && *peer != '\0' ? strstr(msg, peer) : NULL;
    size_t n = peer != NULL ? strlen(peer) : 0;
    return p != NULL && strncmp(p + n, ": ", 2) == 0 ? p + n + 2 : msg;
}

static void sink_on_state(void *ud, enum sink_state state, const char *peer, const char *msg)
{
    drain *d = ud;
    int was = d->sink_state;
    d->sink_state = state;
    d->m.sink_up = state != SINK_DOWN;
    d->m.sink_blocked = state == SINK_BLOCKED;
    d->m.broker = d->kops->broker != NULL ? d->kops->broker(d->snk) : -1;
    if (d->m.broker >= 0) {
        if (d->last_broker >= 0 && d->last_broker != d->m.broker)
            d->m.failovers++;
        d->last_broker = d->m.broker;
    }
    if (state == SINK_UP) {
        if (was == SINK_BLOCKED)
            log_ev(LOG_INFO, &(log_fields){ .event = "broker_unblocked", .outbox = d->ob->name,
                                            .sink = d->ob->sink_name, .peer = peer },
                   "outbox=%s sink=%s: broker unblocked, publishing resumes",
                   d->ob->name, d->ob->sink_name);
        else
            log_ok(&d->sink_log, LOG_INFO,
                   &(log_fields){ .event = "broker_connected", .outbox = d->ob->name,
                                  .sink = d->ob->sink_name, .peer = peer },
                   "outbox=%s sink=%s: connected (%s)", d->ob->name,
                   d->ob->sink_name, msg ? msg : "?");
        d->want_claim = true;
        pump(d);
    } else if (state == SINK_BLOCKED) {
        log_ev(LOG_WARN, &(log_fields){ .event = "broker_blocked", .outbox = d->ob->name,
                                        .sink = d->ob->sink_name, .peer = peer,
                                        .error = sink_reason(msg, peer) },
               "outbox=%s sink=%s: broker blocked the connection (%s); publishing paused",
               d->ob->name, d->ob->sink_name, msg ? msg : "resource alarm");
    } else {
        /* Buffered rows stay held (their leases run on; rows past their deadline are
           given back then: expire_idle). Unconfirmed ones come back as SINK_LOST and
           are published again, in id order per key, once the sink is up. */
        log_fail(&d->sink_log, LOG_WARN,
                 &(log_fields){ .event = "broker_unavailable", .outbox = d->ob->name,
                                .sink = d->ob->sink_name, .peer = peer,
                                .error = sink_reason(msg, peer) },
                 "outbox=%s sink=%s: down: %s",
                 d->ob->name, d->ob->sink_name, msg ? msg : "?");
    }
    schedule_kick(d);
}

/* Only the nack_reopen event exists. The channel is reopened each time; the log
   says so at WARN at most once a minute (a full reject-publish queue, which also
   nacks everything, may reopen it every nack_reopen), with the count in between. */
static void sink_on_event(void *ud, enum sink_event event, const char *msg)
{
    drain *d = ud;
    double now = mono_now();

    if (event != SINK_EV_NACK_REOPEN)
        return;
    d->m.nack_reopens++;
    log_fields f = { .event = "nack_reopen", .outbox = d->ob->name, .sink = d->ob->sink_name,
                     .error = msg };
    if (d->nack_logged_at == 0 || now - d->nack_logged_at >= LOG_REPEAT_INTERVAL) {
        if (d->nack_quiet > 0)
            log_ev(LOG_WARN, &f, "outbox=%s sink=%s: %s (%u more reopen%s in %.0f s)",
                   d->ob->name, d->ob->sink_name, msg ? msg : "?", d->nack_quiet,
                   d->nack_quiet == 1 ? "" : "s", now - d->nack_logged_at);
        else
            log_ev(LOG_WARN, &f, "outbox=%s sink=%s: %s", d->ob->name, d->ob->sink_name,
                   msg ? msg : "?");
        d->nack_logged_at = now;
        d->nack_quiet = 0;
    } else {
        d->nack_quiet++;
        log_ev(LOG_DEBUG, &f, "outbox=%s sink=%s: %s", d->ob->name, d->ob->sink_name,
               msg ? msg : "?");
    }
}

static void sink_on_result(void *ud, void *msg_ud, enum sink_outcome outcome, const char *reason)
{
    drain *d = ud;
    led_entry *e = msg_ud;
    double now = mono_now();
    if (outcome == SINK_ACK) {
        histogram_observe(&d->m.confirm_latency, now - ledger_published_at(e));
        const row *r = ledger_row(e);
        if (r->age_us >= 0)
            histogram_observe(&d->m.e2e_latency, now - r->origin_mono);
    }
    ledger_result(d->led, e, outcome, reason, now);
    pump(d);
    schedule_kick(d);
}

/* A large row's body is written whole: its payload is let go (ledger_written), and the
   bytes it frees let the next claim start. */
static void sink_on_written(void *ud, void *msg_ud)
{
    drain *d = ud;
    ledger_written(d->led, msg_ud);
    sync_metrics(d);
    schedule_kick(d);
}

static void sink_on_writable(void *ud)
{
    drain *d = ud;
    ledger_unpark(d->led);   /* a destination check may have finished */
    pump(d);
    schedule_kick(d);
}

/* Nothing can be published now (the sink is down or blocked, the leadership lapsed):
   buffered rows past their deadline are given back all the same, so that their rows and
   bytes go back to the process's budget for the other outboxes; the timer fires at the
   next deadline. */
static void expire_idle(drain *d)
{
    ledger_expire(d->led, mono_now());
    ev_timer_stop(d->loop, &d->expire_timer);
    double first = ledger_first_deadline(d->led);
    if (first > 0 && !d->stopping) {
        double in = first - mono_now();
        ev_timer_set(&d->expire_timer, (in > 0 ? in : 0) + 0.001, 0.);
        ev_timer_start(d->loop, &d->expire_timer);
    }
}

/* Publishes what the ledger allows while the sink accepts it. */
static void pump(drain *d)
{
    if (d->sink_state != SINK_UP || d->stopping ||
        (d->ob->mode == CFG_MODE_LEADER && !lead_valid(d))) {
        expire_idle(d);
        sync_metrics(d);
        return;
    }
    ev_timer_stop(d->loop, &d->expire_timer);    /* ledger_next gives them back */
    double now = mono_now();
    size_t window = (size_t)d->ob->sink->publish_window;
    led_entry *e;
    /* publish_window bounds the messages in flight (unconfirmed), as the broker's own
       clients count it. Confirmed rows whose mark has not committed yet take no slot of
       it: the broker confirms a disk cycle's worth at once, often the whole window, and
       the window refills while their mark runs. They are bounded too, so that what a
       fault makes the next relay republish (in flight + confirmed unmarked) stays within
       2 x publish_window. */
    while (ledger_n_inflight(d->led) < window &&
           ledger_n_inflight(d->led) + ledger_n_unsettled_sent(d->led) < 2 * window &&
           (e = ledger_next(d->led, now)) != NULL) {
        char err[400] = "";
        int rc = d->kops->publish(d->snk, ledger_row(e), e, err, sizeof err);
        if (rc == SINK_EAGAIN)
            break;
        if (rc == SINK_QUEUED) {
            ledger_published(d->led, e, now);
            /* written whole already: a large payload need not stay (on_written else) */
            if (d->kops->writing != NULL && d->kops->writing(d->snk) != e)
                ledger_written(d->led, e);
        }
        else if (rc == SINK_EWAIT)
            ledger_wait(d->led, e);
        else if (rc == SINK_EREFUSED)
            ledger_refused(d->led, e, LED_REFUSED, err, now);
        else
            ledger_refused(d->led, e, LED_UNPUBLISHABLE, err, now);
    }
    sync_metrics(d);
}

/* ---------- source callbacks ---------- */

/* Logs a connection state change, naming the peer (host:port/database): repeats
   of one failure are rate-limited with a count (log_fail), and the recovery says
   after how many failures. */
static void log_conn_state(sconn *c, int state, const char *msg)
{
    drain *d = c->d;
    char peer[300];
    source_peer(d->ob, peer, sizeof peer);
    log_fields f = { .event = "database_connected", .outbox = d->ob->name, .peer = peer };
    if (state == SRC_UP) {
        if (c == &d->main)
            log_ok(&c->down_log, LOG_INFO, &f, "outbox=%s: database connected (%s, table %s)",
                   d->ob->name, peer, d->ob->table);
        else if (c->down_log.failures > 0)
            log_ok(&c->down_log, LOG_INFO, &f,
                   "outbox=%s: %s connection to the database %s restored",
                   d->ob->name, c->role, peer);
        return;
    }
    f.event = "database_unavailable";
    f.error = msg;
    log_fail(&c->down_log, c->up ? LOG_WARN : LOG_ERROR, &f,
             "outbox=%s: database unavailable (%s connection): %s: %s", d->ob->name, c->role,
             peer, msg ? msg : "?");
}

static void conn_up(sconn *c)
{
    c->up = true;
    c->holding = false;
    c->fail_delay_ms = 0;
    ev_timer_stop(c->d->loop, &c->hold_timer);
}

static void main_on_state(void *ud, enum src_state state, const char *msg)
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
        /* Leadership is a lease row, not this session: it stays ours until its
           deadline unless a renewal says otherwise. Buffered rows keep their own
           lease deadlines; in-flight ones are settled by the other connection. */
        c->up = false;
        d->m.source_up = 0;
    }
    schedule_kick(d);
}

static void settler_on_state(void *ud, enum src_state state, const char *msg)
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
    if (d->other_mode[0] != '\0' && d->ob->mode == CFG_MODE_COMPETING)
        return;     /* kept out by a leader: each claim would take nothing, and then ask the
                       stats; the poll finds out when the leader is gone */
    d->want_claim = true;
    d->active = true;
    d->due_asked = true;
    schedule_kick(d);
}

/* The next poll, after poll_delay, or when a row falls due if that is sooner: the empty
   claims before it double poll_delay, and without this bound the poll after the one just
   before the row fell due came up to half a second late. */
static void arm_poll(drain *d)
{
    double delay = d->poll_delay;
    if (d->due_at > 0) {
        double left = d->due_at - mono_now();
        if (left <= 0) {
            /* passed: the claim that ran after it looked. Had it nothing to take (the row
               that fell due waits behind another of its key, or another relay's key),
               the stats are asked again for the next row to fall due */
            d->due_at = 0;
            d->due_asked = true;
        }
        else if (left < delay)
            delay = left;
    }
    ev_timer_stop(d->loop, &d->poll_timer);
    ev_timer_set(&d->poll_timer, delay, 0.);
    ev_timer_start(d->loop, &d->poll_timer);
}

/* The failed claims' tokens whose leases may still be live, for the next claim. */
static size_t claims_lost(drain *d, double now)
{
    size_t k = 0;
    while (k < d->n_lost && d->lost_until[k] <= now)
        k++;
    if (k > 0) {
        memmove(d->lost, d->lost + k, (d->n_lost - k) * sizeof d->lost[0]);
        memmove(d->lost_until, d->lost_until + k, (d->n_lost - k) * sizeof d->lost_until[0]);
        d->n_lost -= k;
    }
    return d->n_lost;
}

/* The running claim failed without an answer: it may have committed all the same (the
   answer lost with the connection; a timeout the server did not act on), leasing rows this
   relay never got under its token until the lease runs out. Later claims take them back
   (src_claim_args.lost), so that no later row of their keys goes first. */
static void claim_lost(drain *d)
{
    (void)claims_lost(d, mono_now());
    if (d->n_lost == d->lost_cap) {
        size_t cap = d->lost_cap ? 2 * d->lost_cap : 8;
        int64_t *t = realloc(d->lost, cap * sizeof *t);
        if (t != NULL)
            d->lost = t;
        double *u = t != NULL ? realloc(d->lost_until, cap * sizeof *u) : NULL;
        if (u != NULL)
            d->lost_until = u;
        if (t == NULL || u == NULL) {
            /* no memory to spare: the oldest goes (its rows come back when its lease ends,
               after later rows of their keys, as before the relay kept them) */
            if (d->n_lost == 0)
                return;
            memmove(d->lost, d->lost + 1, (d->n_lost - 1) * sizeof d->lost[0]);
            memmove(d->lost_until, d->lost_until + 1, (d->n_lost - 1) * sizeof d->lost_until[0]);
            d->n_lost--;
        } else
            d->lost_cap = cap;
    }
    d->lost[d->n_lost] = d->claim_token;
    /* its lease ends at most lease after its commit, which came before the failure was
       known, or not at all (a server cancels a statement it timed out, and rolls back one
       whose connection it lost before its commit) */
    d->lost_until[d->n_lost] = mono_now() + d->ob->lease_ms / 1000.0 + 1.0;
    d->n_lost++;
}

static void on_claimed(drain *d, const src_result *res)
{
    double max_poll = poll_s(d), min_poll = max_poll < 0.05 ? max_poll : 0.05;
    d->m.claims++;
    histogram_observe(&d->m.claim_latency, ev_now(d->loop) - d->main.req_started);
    if (res->ok != 0) {
        ledger_claim_failed(d->led);
        claim_lost(d);
        d->want_claim = true;
        return;
    }
    d->m.claimed_rows += res->n_rows;
    d->claim_ended = mono_now();
    if (res->n_rows > 0)
        d->active = true;
    /* cut by its byte limit (another row as large as its largest would not have fitted):
       more rows may wait, as after a full claim */
    size_t got = 0, largest = 0;
    for (size_t i = 0; i < res->n_rows; i++) {
        size_t b = src_row_bytes(res->rows[i]);
        got += b;
        largest = b > largest ? b : largest;
    }
    bool cut = d->claim_bytes > 0 && res->n_rows > 0 && got + largest > d->claim_bytes;
    d->claim_short = res->n_rows < d->claim_asked && !cut;
    if (res->n_rows > 0)
        d->row_bytes = got / res->n_rows > 0 ? got / res->n_rows : 1;
    for (size_t i = 0; i < res->n_rows; i++)    /* for the end-to-end latency */
        res->rows[i]->origin_mono = d->claim_sent - (double)res->rows[i]->age_us / 1e6;
    ledger_claimed(d->led, res->rows, res->n_rows, d->claim_deadline);   /* takes the rows */
    free(res->rows);
    if (d->ob->mode == CFG_MODE_LEADER && !d->leader)
        /* leased under a leadership that lapsed while the claim ran (its answer came after
           the lease's local deadline; no lead request can run meanwhile, it shares the
           claim's connection): whoever leads next, this relay too, releases those
           leases, so the rows are forgotten as lose_leadership forgot the others, never
           published under a lease that is gone nor passed over by a later claim as held */
        ledger_drop_buffered(d->led);
    if (d->stopping)
        ledger_giveback_buffered(d->led);
    if (res->n_rows >= d->claim_asked || cut) {
        d->want_claim = true;
        d->poll_delay = min_poll;
    } else {
        /* want_claim stays as the claim's own run left it: set by a wake-up (a commit,
           a settle, a poll) that came while the claim ran — those wake-ups together ask
           for one follow-up claim — and clear otherwise */
        d->poll_delay = res->n_rows > 0 ? min_poll : d->poll_delay * 2;
        if (d->poll_delay > max_poll)
            d->poll_delay = max_poll;
        if (d->poll_delay < min_poll)
            d->poll_delay = min_poll;
        arm_poll(d);
        if (res->n_rows == 0 && d->due_asked && notified(d)) {
            /* woken, yet nothing to take: rows that are delayed, backing off or leased
               elsewhere fall due later; the stats say when, so the poll wakes then and
               not up to poll_interval late */
            d->due_asked = false;
            d->stats_due = true;
        }
    }
    pump(d);
}

static void on_settled(drain *d, const src_result *res)
{
    d->settle_ended = mono_now();
    if (res->ok == 0)
        histogram_observe(&d->m.settle_latency, ev_now(d->loop) - d->settler.req_started);
    ledger_settle_done(d->led, res->ok == 0, res->n_applied);
    if (res->ok == 0) {
        /* what committed may make rows claimable that nothing announces (a key behind a
           retried or dead-lettered row, rows given back): look again now rather than at
           the next poll, which may be poll_interval away */
        d->want_claim = true;
        d->active = true;
        d->due_asked = true;
    }
    pump(d);     /* marks committed: the window has room again */
}

/* Time kept between a lease's deadline and its expiry: lease / 5, at most 10 s. */
static double lease_margin(const drain *d)
{
    double lease = d->ob->lease_ms / 1000.0, margin = lease / 5;
    return margin > DRAIN_MARGIN_MAX ? DRAIN_MARGIN_MAX : margin;
}

/* We are not the leader any more (fenced by a newer epoch, or our lease ran out
   before it was renewed): publish nothing more, forget buffered rows (their
   leases were or will be reset by the new leader), stand by. */
static void lose_leadership(drain *d, const char *why)
{
    log_ev(LOG_WARN, &(log_fields){ .event = "lost_leadership", .outbox = d->ob->name,
                                    .error = why },
           "outbox=%s: lost leadership (epoch %" PRId64 "): %s; publishing stopped, "
           "standing by", d->ob->name, d->epoch, why);
    d->leader = false;
    d->epoch = 0;
    d->m.leader = 0;
    d->m.epoch = 0;
    d->m.fenced++;
    d->lead_due = true;
    ledger_drop_buffered(d->led);
    sync_metrics(d);
}

/* Leader mode: may we act as the leader right now (our lease's local deadline)? */
static bool lead_valid(drain *d)
{
    if (!d->leader)
        return false;
    if (mono_now() < d->leader_until)
        return true;
    lose_leadership(d, "its lease ran out before a renewal succeeded (database unreachable "
                    "or slow, or this process was paused)");
    return false;
}

/* Leader mode and competing mode exclude each other on one outbox (the sources'
   lead and claim statements see to it): a relay of one mode claims nothing while a relay
   of the other is live. Logged once per episode, at WARN: relays of one outbox configured
   with different modes is a mistake an operator must fix. who: that relay, NULL none. */
static void report_other_mode(drain *d, const char *who)
{
    bool competing = d->ob->mode == CFG_MODE_COMPETING;
    if (who == NULL || who[0] == '\0') {
        if (d->other_mode[0] != '\0')
            log_ev(LOG_INFO, &(log_fields){ .event = "mode_conflict_ended",
                                            .outbox = d->ob->name },
                   "outbox=%s: relay %s (%s mode) no longer holds this outbox", d->ob->name,
                   d->other_mode, competing ? "leader" : "competing");
        d->other_mode[0] = '\0';
        d->m.mode_conflict = 0;
        return;
    }
    bool known = d->other_mode[0] != '\0';
    snprintf(d->other_mode, sizeof d->other_mode, "%s", who);
    d->m.mode_conflict = 1;
    if (known)
        return;     /* once per episode, whichever relay of that mode is named */
    log_ev(LOG_WARN, &(log_fields){ .event = "mode_conflict", .outbox = d->ob->name },
           "outbox=%s: relay %s runs this outbox in %s mode; this relay (mode = %s) claims "
           "nothing until that relay stops or its lease expires: every relay of an outbox "
           "must have the same mode", d->ob->name, who, competing ? "leader" : "competing",
           competing ? "competing" : "leader");
}

static void on_lead(drain *d, const src_result *res)
{
    if (d->resigned) {
        if (res->leader)
            log_ev(LOG_INFO, &(log_fields){ .event = "handed_over", .outbox = d->ob->name },
                   "outbox=%s: leadership handed over (epoch %" PRId64 ")",
                   d->ob->name, res->epoch);
        d->leader = false;
        d->m.leader = 0;
        return;
    }
    report_other_mode(d, res->leader ? NULL : res->member);
    if (res->leader) {
        d->leader_until = d->lead_sent + d->ob->lease_ms / 1000.0 - lease_margin(d);
        /* without a renewal by then, stand by at that moment (not at the next tick) */
        ev_timer_stop(d->loop, &d->deadline_timer);
        ev_timer_set(&d->deadline_timer, d->leader_until - mono_now() + 0.001, 0.);
        ev_timer_start(d->loop, &d->deadline_timer);
        if (!d->leader) {
            bool other = res->holder != NULL && strcmp(res->holder, d->owner) != 0;
            log_ev(LOG_INFO, &(log_fields){ .event = other ? "took_over" : "became_leader",
                                            .outbox = d->ob->name },
                   "outbox=%s: became the active relay (epoch %" PRId64 "%s%s)%s",
                   d->ob->name, res->epoch, other ? ", taking over from " : "",
                    other ? res->holder : "",
                    res->n_reset > 0 ? "; leases left by a previous one released" : "");
            d->m.takeovers++;
            d->want_claim = true;
        }
        d->leader = true;
        d->epoch = res->epoch;
        d->m.leader = 1;
        d->m.epoch = res->epoch;
        return;
    }
    if (d->leader) {
        char why[400];
        if (res->member != NULL)
            snprintf(why, sizeof why, "relay %s runs this outbox in competing mode",
                     res->member);
        else
            snprintf(why, sizeof why, "now epoch %" PRId64 " held by %s", res->holder_epoch,
                     res->holder ? res->holder : "?");
        lose_leadership(d, why);
    } else if (res->member != NULL) {
        /* reported above */
    } else if (!d->stopping) {
        log_ev(d->m.standby_logged ? LOG_DEBUG : LOG_INFO,
               &(log_fields){ .event = "standing_by", .outbox = d->ob->name },
               "outbox=%s: standing by: epoch %" PRId64 " held by %s", d->ob->name,
                res->holder_epoch, res->holder ? res->holder : "?");
        d->m.standby_logged = 1;
    }
}

/* A request failed but the connection may still be up (permissions, timeouts,
   a dropped table): wait before its next one, 100 ms doubling to 5 s. */
static void hold_after_failure(sconn *c)
{
    c->fail_delay_ms = outbox_util_backoff_next(c->fail_delay_ms, 100, 5000);
    c->holding = true;
    ev_timer_stop(c->d->loop, &c->hold_timer);
    ev_timer_set(&c->hold_timer, (double)c->fail_delay_ms / 1000., 0.);
    ev_timer_start(c->d->loop, &c->hold_timer);
}

/* The table's health: into the metrics, and the xmin horizon's holder watched. Held
   past horizon_warn, it is logged at WARN once, naming it, until it lets go (INFO). */
static void on_health(drain *d, const src_health *h)
{
    double now = mono_now(), warn_s = (double)d->ob->horizon_warn_ms / 1000.0;
    double age = -1;
    char who[200] = "";
    /* SQL Server: the holder is the oldest transaction reading or making row versions */
    bool versions = h->holder_kind != NULL && h->holder_versions;

    d->m.health_seen = 1;
    d->m.table_dead_tuples = h->dead_tuples;
    d->m.table_live_tuples = h->live_tuples;
    d->m.table_size_bytes = h->size_bytes;
    d->m.last_autovacuum_ts = h->last_autovacuum;
    d->m.horizon_xids = h->horizon_xids;
    d->m.table_used_bytes = h->used_bytes;
    d->m.version_store_bytes = h->version_store_bytes;
    d->m.health_have = h->have;
    if (h->holder_kind == NULL) {
        age = 0;    /* the last holder stays known: seen again with the same xmin (a session
                       between statements holds none), it has held it since then */
    } else {
        /* Since when the holder has held this very xmin: what the database says when this
           relay first sees it hold it (a transaction's or a prepared transaction's start; a
           READ COMMITTED statement's start), else from that first sight (a slot; a
           walsender, whose xmin is its standby's feedback; a role that may not see when
           other roles' transactions began): a holder whose xmin moved on (the walsender's
           next feedback) has held the new one since then. */
        bool session = strcmp(h->holder_kind, "session") == 0 || versions;
        const char *name = h->holder_name ? h->holder_name : "";
        const char *state = h->holder_state ? h->holder_state : "";
        const char *xmin = h->holder_xmin ? h->holder_xmin : "";
        char key[sizeof d->holder_key];
        snprintf(key, sizeof key, "%s/%d/%s/%s", h->holder_kind, h->holder_pid,
                 session ? "" : name, xmin);
        if (strcmp(key, d->holder_key) != 0) {
            d->holder_since = h->holder_age_s >= 0 ? now - h->holder_age_s : now;
            snprintf(d->holder_key, sizeof d->holder_key, "%s", key);
        }
        age = now - d->holder_since;
        if (versions)
            snprintf(who, sizeof who, "session %d (program_name \"%s\", %s)", h->holder_pid,
                     name, state);
        else if (strcmp(h->holder_kind, "replication slot") == 0)
            snprintf(who, sizeof who, "replication slot \"%s\" (%s, xmin %s)", name, state,
                     xmin[0] ? xmin : "?");
        else if (strcmp(h->holder_kind, "prepared transaction") == 0)
            snprintf(who, sizeof who, "prepared transaction \"%s\" (%s, transaction %s)", name,
                     state, xmin[0] ? xmin : "?");
        else if (state[0])
            snprintf(who, sizeof who, "pid %d (application_name \"%s\", state \"%s\")",
                     h->holder_pid, name, state);
        else
            snprintf(who, sizeof who, "pid %d (application_name \"%s\")", h->holder_pid, name);
    }
    if (!h->horizon_known && !d->horizon_blind_logged) {
        d->horizon_blind_logged = true;
        log_ev(LOG_WARN, &(log_fields){ .event = "xmin_horizon_unknown", .outbox = d->ob->name },
               "outbox=%s: table health: the relay's database role cannot see when other "
               "roles' transactions began, nor their state or walsenders: a transaction "
               "holding back the vacuum of %s is timed from when the relay first sees it, and "
               "a standby's feedback goes unnoticed; grant it pg_read_all_stats (or "
               "pg_monitor)", d->ob->name, d->ob->table);
    }
    d->m.horizon_age_s = age;
    bool over = age >= warn_s && who[0] != '\0';
    if (d->horizon_held && (!over || strcmp(d->holder_key, d->horizon_warned) != 0)) {
        /* it let go, or another holder (held long enough too: its WARN follows) */
        d->horizon_held = false;
        log_ev(LOG_INFO, &(log_fields){ .event = "xmin_horizon_released", .outbox = d->ob->name,
                                        .error = d->horizon_holder },
               "outbox=%s: the database's %s is no longer held back by %s (now %s); "
               "%" PRId64 " dead rows in %s", d->ob->name,
               versions || (h->have & SRC_H_VSTORE) ? "version store" : "xmin horizon",
               d->horizon_holder, who[0] ? who : "nothing holds it", h->dead_tuples,
               d->ob->table);
    }
    if (over && !d->horizon_held) {
        d->horizon_held = true;
        snprintf(d->horizon_holder, sizeof d->horizon_holder, "%s", who);
        snprintf(d->horizon_warned, sizeof d->horizon_warned, "%s", d->holder_key);
        if (versions) {
            log_ev(LOG_WARN, &(log_fields){ .event = "xmin_horizon_held",
                                            .outbox = d->ob->name, .error = who },
                   "outbox=%s: a transaction has held the version store for %.0f s: %s; "
                   "SQL Server keeps every row version and ghost record it may read, so "
                   "ghost records of %s (%" PRId64 " at the last count, %" PRId64 " rows "
                   "now) and the version store (%" PRId64 " bytes) grow and claims slow "
                   "down; end that transaction", d->ob->name, age, who, d->ob->table,
                   h->dead_tuples, h->live_tuples, h->version_store_bytes);
        } else {
            const char *act =
                strcmp(h->holder_kind, "replication slot") == 0
                    ? "advance or drop the slot (or its standby's feedback)"
                : strcmp(h->holder_kind, "prepared transaction") == 0
                    ? "COMMIT PREPARED or ROLLBACK PREPARED it"
                    : "end that transaction";
            log_ev(LOG_WARN, &(log_fields){ .event = "xmin_horizon_held",
                                            .outbox = d->ob->name, .error = who },
                   "outbox=%s: the database's xmin horizon has been held back for %.0f s "
                   "(%" PRId64 " transactions) by %s: vacuum cannot remove dead rows of %s "
                   "(%" PRId64 " dead, %" PRId64 " live now), so the table and its indexes "
                   "grow while it lasts; %s", d->ob->name, age, h->horizon_xids, who,
                   d->ob->table, h->dead_tuples, h->live_tuples, act);
        }
    }
}

/* Retention that fails (a role without DELETE, a lock timeout, a lost lease) tries again
   after a back-off of its own, 1 s doubling up to cleanup_interval (at most 60 s), instead
   of waiting for the next cleanup_interval tick, which may be hours away; the ticks go on
   meanwhile (a tick while a retry waits starts the pass at once). The failure is logged
   once per episode at WARN (an identical repeat at debug, again at WARN after a minute
   with its count), and its end at INFO with the number of failed passes. */
#define CLEANUP_RETRY_FIRST_MS 1000
#define CLEANUP_RETRY_MAX_MS   60000

static void cleanup_failed(drain *d, const char *why)
{
    int64_t cap = d->ob->cleanup_interval_ms < CLEANUP_RETRY_MAX_MS ? d->ob->cleanup_interval_ms
                                                                    : CLEANUP_RETRY_MAX_MS;
    int64_t first = cap < CLEANUP_RETRY_FIRST_MS ? cap : CLEANUP_RETRY_FIRST_MS;
    d->cleanup_backoff_ms = outbox_util_backoff_next(d->cleanup_backoff_ms, first, cap);
    log_fail(&d->cleanup_log, LOG_WARN,
             &(log_fields){ .event = "database_error", .outbox = d->ob->name, .error = why },
             "outbox=%s: retention failed: %s; marked rows stay until it succeeds (retried "
             "with back-off up to %.0f s)", d->ob->name, why ? why : "unknown error",
             (double)cap / 1000.0);
    if (d->stopping)
        return;
    ev_timer_stop(d->loop, &d->cleanup_retry);
    ev_timer_set(&d->cleanup_retry, (double)d->cleanup_backoff_ms / 1000.0, 0.);
    ev_timer_start(d->loop, &d->cleanup_retry);
}

static void cleanup_ok(drain *d)
{
    if (d->cleanup_backoff_ms == 0)
        return;
    d->cleanup_backoff_ms = 0;
    ev_timer_stop(d->loop, &d->cleanup_retry);
    log_ok(&d->cleanup_log, LOG_INFO, &(log_fields){ .event = "retention", .outbox = d->ob->name },
           "outbox=%s: retention resumed", d->ob->name);
}

_Static_assert(SRC_REQ_HEALTH == METRICS_DB_REQUESTS && SRC_REQ_LEAD == 1,
               "ob_metrics.db_errors is indexed by enum src_req less one");

/* A failed request is counted by kind and logged at WARN, saying what it holds back; an
   identical failure again is logged once a minute with its count (relay/log.h), and the
   first success after failures at INFO. Retention logs its own (cleanup_failed). */
static void request_logged(drain *d, const src_result *res)
{
    static const char *const what[METRICS_DB_REQUESTS] = {
        "leadership renewal", "claim", "settle", "retention", "backlog read",
        "table health read"
    };
    static const char *const then[METRICS_DB_REQUESTS] = {
        "; the lease runs out unless a renewal succeeds in time",
        "; retried with back-off",
        "; its outcomes are kept and retried with back-off: until it succeeds, rows the "
        "broker confirmed are not marked sent",
        "", "; the backlog gauges keep their last values", "; the table's gauges keep their "
        "last values"
    };
    if (res->req < SRC_REQ_LEAD || res->req > SRC_REQ_HEALTH)
        return;
    size_t k = (size_t)res->req - 1;
    log_fields f = { .event = "database_error", .outbox = d->ob->name, .error = res->error };
    if (res->ok != 0) {
        d->m.db_errors[k]++;
        if (res->req != SRC_REQ_CLEANUP)
            log_fail(&d->req_log[k], LOG_WARN, &f, "outbox=%s: %s failed: %s%s", d->ob->name,
                     what[k], res->error ? res->error : "unknown error", then[k]);
    } else if (d->req_log[k].failures > 0) {
        f.error = NULL;
        log_ok(&d->req_log[k], LOG_INFO, &f, "outbox=%s: %s succeeded again", d->ob->name,
               what[k]);
    }
}

static void src_on_done(void *ud, const src_result *res)
{
    sconn *c = ud;
    drain *d = c->d;
    c->busy = false;
    /* a backlog or table-health read that fails (a table without statistics yet, a role
       that may not read them, a timeout) leaves the metrics as they were and is tried again
       at its next turn: it must not hold back the settles that share its connection; a
       failed retention pass backs off on its own (cleanup_failed) and must not either;
       nor does their success end a settle's back-off */
    bool read = res->req == SRC_REQ_HEALTH || res->req == SRC_REQ_CLEANUP ||
                res->req == SRC_REQ_STATS;
    if (res->ok != 0 && !read)
        hold_after_failure(c);
    else if (res->ok == 0 && !read)
        c->fail_delay_ms = 0;
    switch (res->req) {
    case SRC_REQ_LEAD:
        if (res->ok == 0)
            on_lead(d, res);
        break;
    case SRC_REQ_CLAIM:
        on_claimed(d, res);
        sync_metrics(d);                          /* what it holds now, then: */
        rbudget_claim_done(d->budget, &d->rb);    /* a whole turn may end */
        break;
    case SRC_REQ_SETTLE:
        d->given_back = d->given_back || d->settle_gives_back;   /* (src_claim_args) */
        d->settle_gives_back = false;
        on_settled(d, res);
        break;
    case SRC_REQ_CLEANUP:
        if (res->ok != 0) {
            cleanup_failed(d, res->error);
            break;
        }
        cleanup_ok(d);
        if (res->n_deleted > 0)
            log_ev(LOG_DEBUG, &(log_fields){ .event = "retention", .outbox = d->ob->name },
                   "outbox=%s: retention removed %zu rows", d->ob->name, res->n_deleted);
        if (res->n_deleted >= (size_t)d->ob->cleanup_batch)
            d->cleanup_due = true;      /* more to do: continue after other work */
        break;
    case SRC_REQ_HEALTH:
        if (res->ok == 0)
            on_health(d, &res->health);
        break;
    case SRC_REQ_STATS:
        if (res->ok == 0) {
            d->m.backlog = res->stats.backlog;
            d->m.oldest_pending_s = res->stats.oldest_pending_s;
            d->m.dead_rows = res->stats.dead;
            d->stats_at = mono_now();
            d->stats_age = res->stats.oldest_pending_s;
            if (d->ob->mode == CFG_MODE_COMPETING && !d->stopping)
                report_other_mode(d, res->stats.leader);
            double due = res->stats.next_due_s;
            d->due_at = 0;
            if (due >= 0 && notified(d)) {
                d->due_at = mono_now() + due + 0.005;
                if (ev_is_active(&d->poll_timer) &&
                    ev_timer_remaining(d->loop, &d->poll_timer) > due + 0.01)
                    arm_poll(d);
            }
        }
        break;
    default:
        break;
    }
    request_logged(d, res);
    schedule_kick(d);
}

/* ---------- scheduling ---------- */

static bool may_drain(drain *d)
{
    return d->ob->mode == CFG_MODE_COMPETING || lead_valid(d);
}

/* Rows to claim now. A claim costs about the same round trip for 100 rows as for
   500, so claims are whole batches, issued while up to two batches beyond the
   window are still buffered: the window stays full while the database answers.
   Memory stays bounded by publish_window + 2 * batch_size rows per outbox, and by
   max_rows_in_memory for the process (rbudget_claim_size), and in bytes by
   max_bytes_in_memory (claim_bytes). */
static size_t claim_bytes(drain *d, bool *first_whole);

static size_t claim_size(drain *d)
{
    size_t batch = (size_t)d->ob->batch_size;
    size_t limit = (size_t)d->ob->sink->publish_window + 2 * batch;
    if (ledger_n_outcomes(d->led) >= limit) {
        rbudget_unwait(d->budget, &d->rb);
        return 0;    /* outcomes waiting for the database count too: memory stays bounded */
    }
    size_t used = ledger_n_inflight(d->led) + ledger_n_buffered(d->led);
    size_t n = rbudget_claim_size(d->budget, &d->rb, used, limit, batch);
    bool whole = false;
    size_t bytes = n > 0 ? claim_bytes(d, &whole) : 0;
    if (bytes == 0)
        return 0;
    if (bytes != SIZE_MAX && !claims_bytes(d)) {
        /* the source cannot stop at a byte limit: as many rows as fit at the largest
           one the sink publishes, a single one when the drain holds nothing */
        size_t fit = bytes / d->ob->sink->max_message_size;
        if (fit == 0 && !whole) {
            rbudget_wait(d->budget, &d->rb);
            return 0;
        }
        n = fit == 0 ? 1 : n < fit ? n : fit;
    } else if (bytes != SIZE_MAX && d->row_bytes > 0) {
        /* rows of the size the last claim brought: the claim stops at its byte limit
           anyway, but it locks every row it asks for before it sums their sizes (500
           rows locked to lease 64 of 512 KiB: 11.6 ms of execution instead of 2.2). One
           more than fit, so that a claim cut by its bytes says so; rows smaller than
           those fill the claim in rows, and the next one follows at once, sized anew. */
        size_t fit = bytes / d->row_bytes + 1;
        n = n < fit ? n : fit;
    }
    return n;
}

/* The bytes a claim may ask for now (SIZE_MAX: no limit; 0: not now, the drain waits
   for bytes to be released), and whether its first row comes whatever its size (the
   drain holds no rows: a row larger than the budget goes through alone). */
static size_t claim_bytes(drain *d, bool *first_whole)
{
    return rbudget_claim_bytes(d->budget, &d->rb, ledger_bytes(d->led), first_whole);
}

/* Under steady load the broker confirms a few messages at a time, and a settle per
   confirm batch costs the database a statement and a commit for a row or two. Marks of
   confirmed rows are not on any message's way (the consumer has it already): a settle of
   fewer than batch_size outcomes waits until SETTLE_GATHER_S after the previous settle's
   answer, and takes what was confirmed meanwhile with it (a retry or a dead letter
   among them waits as long: far less than any retry_backoff). A full batch and a stopping
   drain settle at once. True while that wait runs (the coalesce timer kicks again). */
static void arm_coalesce(drain *d, double left)
{
    if (ev_is_active(&d->coalesce_timer)) {
        if (ev_timer_remaining(d->loop, &d->coalesce_timer) <= left)
            return;
        ev_timer_stop(d->loop, &d->coalesce_timer);
    }
    ev_timer_set(&d->coalesce_timer, left, 0.);
    ev_timer_start(d->loop, &d->coalesce_timer);
}

static bool settle_gathering(drain *d)
{
    if (d->stopping || ledger_n_pending(d->led) >= (size_t)d->ob->batch_size)
        return false;
    double left = d->settle_ended + SETTLE_GATHER_S - mono_now();
    if (left <= 0)
        return false;
    arm_coalesce(d, left);
    return true;
}

static bool start_settle(drain *d)
{
    const src_outcome *v;
    size_t n = ledger_settle_begin(d->led, &v);
    if (n == 0)
        return false;
    d->settle_gives_back = false;
    for (size_t i = 0; i < n && !d->settle_gives_back; i++)
        d->settle_gives_back = v[i].kind == SRC_UNCLAIM || v[i].kind == SRC_RETRY;
    sconn *c = &d->settler;
    c->busy = true;
    c->busy_req = SRC_REQ_SETTLE;
    c->req_started = ev_now(d->loop);
    if (d->sops->settle(c->src, v, n) != 0) {   /* copies v */
        c->busy = false;
        ledger_settle_done(d->led, false, 0);
        return false;
    }
    return true;
}

static bool main_request(drain *d, enum src_req req);

/* The table's statistics and health are read on the settling connection too, between
   settles and before retention (which can run pass after pass in a catch-up): with the
   xmin horizon held back they take tens of ms (they count pending rows through an index
   that keeps an entry for every row marked since the last vacuum: 170 ms seen), and a
   claim that a commit asks for meanwhile would wait for them. A mark waits for them
   instead, as it does for a retention pass: a row confirmed then keeps its place in the
   publish window that much longer. */
static bool start_read(drain *d, enum src_req req)
{
    sconn *c = &d->settler;
    c->busy = true;
    c->busy_req = req;
    c->req_started = ev_now(d->loop);
    int rc = req == SRC_REQ_STATS ? d->sops->stats(c->src) : d->sops->health(c->src);
    if (rc != 0)
        c->busy = false;
    return rc == 0;
}

/* Retention runs on the settling connection, between settles, never on the claiming one:
   a batch of cleanup_batch deletes takes 10-40 ms (every index entry of every row), and a
   claim that a commit asks for meanwhile would wait for it. The settles it delays are
   marks of rows already confirmed (and bounded: 2 x publish_window with those in flight);
   the two never touch the same rows (marked ones against leased ones). */
static bool start_cleanup(drain *d)
{
    sconn *c = &d->settler;
    src_cleanup_args a = { .retention_ms = d->ob->retention_ms,
                           .limit = (size_t)d->ob->cleanup_batch, .owner = d->owner,
                           .epoch = d->ob->mode == CFG_MODE_LEADER ? d->epoch : 0 };
    c->busy = true;
    c->busy_req = SRC_REQ_CLEANUP;
    c->req_started = ev_now(d->loop);
    if (d->sops->cleanup(c->src, &a) != 0) {
        c->busy = false;
        return false;
    }
    return true;
}

static void check_stopped(drain *d)
{
    if (!d->stopping || d->stop_reported || d->main.busy || d->settler.busy)
        return;
    if (ledger_n_inflight(d->led) == 0 && ledger_n_buffered(d->led) == 0 &&
        ledger_n_pending(d->led) == 0) {
        /* hand leadership over at once: renew it with a lease of 0 (expired now), so a
           standby takes over at its next try instead of waiting for the lease to run out;
           in competing mode withdraw the membership the same way (a claim of nothing with
           a lease of 0), so our keys move to the other instances at once */
        bool competing = d->ob->mode == CFG_MODE_COMPETING;
        if ((d->leader || competing) && !d->resigned && d->main.up && !d->main.holding) {
            d->resigned = true;
            if (main_request(d, competing ? SRC_REQ_CLAIM : SRC_REQ_LEAD))
                return;
        }
        d->stop_reported = true;
        log_ev(LOG_INFO, &(log_fields){ .event = "drained", .outbox = d->ob->name },
               "outbox=%s: drained and settled", d->ob->name);
        if (d->on_stopped)
            d->on_stopped(d->stop_ud);
    }
}

/* Starts a request on the main connection; false if it could not start. */
static bool main_request(drain *d, enum src_req req)
{
    sconn *c = &d->main;
    c->busy = true;
    c->busy_req = req;
    c->req_started = ev_now(d->loop);
    int rc = -1;
    switch (req) {
    case SRC_REQ_LEAD: {
        src_lead_args a = { .owner = d->owner, .epoch = d->epoch,
                            .lease_ms = d->resigned ? 0 : d->ob->lease_ms };
        d->lead_sent = mono_now();
        rc = d->sops->lead(c->src, &a);
        break;
    }
    case SRC_REQ_CLAIM: {
        d->claim_sent = mono_now();
        d->claim_deadline = d->claim_sent + d->ob->lease_ms / 1000.0 - lease_margin(d);
        bool whole = false;
        size_t rows = d->resigned ? 0 : claim_size(d);
        size_t bytes = rows > 0 ? claim_bytes(d, &whole) : 0;
        if (bytes == SIZE_MAX)
            bytes = 0;       /* no byte limit */
        src_claim_args a = {
            .max_rows = rows,
            .max_bytes = claims_bytes(d) ? bytes : 0,
            .first_whole = whole,
            .max_payload = d->ob->sink->max_message_size,
            .lease_ms = d->resigned ? 0 : d->ob->lease_ms,
            .lease_token = d->claim_token = new_token(d),
            .owner = d->owner,
            .epoch = d->ob->mode == CFG_MODE_LEADER ? d->epoch : 0,
            .competing = d->ob->mode == CFG_MODE_COMPETING,
            .held = d->claim_held,
            .n_held = ledger_held_ids(d->led, d->claim_sent, d->claim_held, CLAIM_HELD_MAX),
            .lost = d->lost,
            .n_lost = claims_lost(d, d->claim_sent),
            .given_back = d->given_back,
        };
        d->given_back = false;
        d->claim_asked = a.max_rows;
        d->claim_bytes = bytes;
        ledger_claim_started(d->led);
        rc = d->sops->claim(c->src, &a);
        if (rc != 0) {
            ledger_claim_failed(d->led);
            rbudget_claim_done(d->budget, &d->rb);
        } else
            rbudget_hold(d->budget, &d->rb, rows_held(d), bytes_held(d));   /* asked for */
        break;
    }
    default:
        break;
    }
    if (rc != 0)
        c->busy = false;
    return rc == 0;
}

/* Under a steady stream of commits every one wakes the relay (NOTIFY), and a claim per
   wake-up would carry a row or two each: the claiming session busy most of the time and
   the database's CPU spent per claim, not per row. After a claim that found fewer rows
   than it asked for (nothing is waiting beyond what it took), the next claim that a
   wake-up asks for therefore waits until claim_delay after that claim's answer, and takes
   the rows committed meanwhile together. A full claim (a backlog) is followed at once,
   and after a quiet spell the first wake-up claims at once: a row waits at most
   claim_delay more, and only while rows keep coming. True while that wait runs (the
   timer then kicks again). */
static bool claim_coalescing(drain *d)
{
    double delay = (double)d->ob->claim_delay_ms / 1000.0;
    if (!d->claim_short || delay <= 0 || !d->want_claim)
        return false;
    double left = d->claim_ended + delay - mono_now();
    if (left <= 0)
        return false;
    arm_coalesce(d, left);
    return true;
}

static void kick(drain *d)
{
    sconn *st = &d->settler, *mc = &d->main;
    /* After a failed settle the reads due go first: a settle that fails again and again
       (a permission, a full disk) must not keep the backlog gauges and the table's health
       at their last values, which the alerts on a stuck outbox read. Stopping, no read
       starts: the settles go on. */
    if (ledger_n_pending(d->led) > 0 && st->up && !st->busy && !st->holding &&
        !settle_gathering(d) &&
        (st->fail_delay_ms == 0 || d->stopping || !(d->stats_due || d->health_due)))
        start_settle(d);
    if (st->up && !st->busy && !st->holding && d->stats_due && !d->stopping) {
        d->stats_due = false;
        (void)start_read(d, SRC_REQ_STATS);
    }
    if (st->up && !st->busy && !st->holding && d->health_due && !d->stopping &&
        d->sops->health != NULL) {
        d->health_due = false;
        (void)start_read(d, SRC_REQ_HEALTH);
    }
    if (st->up && !st->busy && !st->holding && d->cleanup_due && !d->stopping && may_drain(d)) {
        d->cleanup_due = false;
        (void)start_cleanup(d);
    }
    rbudget_hold(d->budget, &d->rb, rows_held(d), bytes_held(d));    /* a claim may have ended */
    if (mc->up && !mc->busy && !mc->holding) {
        bool may_claim = !d->stopping && may_drain(d) && d->sink_state == SINK_UP &&
                         ledger_n_old(d->led) == 0 && d->want_claim;
        bool claim_ok = may_claim && claim_size(d) > 0 && !claim_coalescing(d);
        if (!may_claim)
            rbudget_unwait(d->budget, &d->rb);
        if (d->ob->mode == CFG_MODE_LEADER && !d->stopping && d->lead_due &&
            (d->leader || (ledger_n_old(d->led) == 0 && ledger_n_pending(d->led) == 0 &&
                           !st->busy))) {
            /* renew first; take over only once our own earlier work is settled */
            d->lead_due = false;
            (void)main_request(d, SRC_REQ_LEAD);
        } else if (claim_ok) {
            d->want_claim = false;
            if (!main_request(d, SRC_REQ_CLAIM))
                d->want_claim = true;
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

static void health_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    drain *d = w->data;
    d->health_due = true;
    schedule_kick(d);
}

static void coalesce_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    schedule_kick(w->data);
}

static void expire_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    pump(w->data);                /* gives back what expired, or publishes again */
    schedule_kick(w->data);       /* settles the rows given back */
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
    /* a standby tries every tick (a cheap statement); the leader renews at lease / 3 */
    double renew = d->ob->lease_ms / 3000.0;
    if (!d->leader || !lead_valid(d) || mono_now() - d->lead_sent >= renew * 0.95)
        d->lead_due = true;
    schedule_kick(d);
}

static void deadline_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    drain *d = w->data;
    if (d->leader && !lead_valid(d))   /* logs and stands by */
        schedule_kick(d);
}

static void cleanup_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    drain *d = w->data;
    d->cleanup_due = true;
    schedule_kick(d);
}

/* Every STATS_BUSY_S; while nothing happened (no rows claimed or settled, no wake-up)
   only every STATS_IDLE_S, the oldest pending row's age running on meanwhile (nothing
   drained it): fifty idle outboxes then cost the database next to nothing. */
static void stats_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    drain *d = w->data;
    double now = mono_now();
    if (!d->active && d->stats_at > 0 && now - d->stats_at < STATS_IDLE_S) {
        if (d->m.backlog > 0)
            d->m.oldest_pending_s = d->stats_age + (now - d->stats_at);
        return;
    }
    d->active = false;
    d->stats_due = true;
    schedule_kick(d);
}

/* ---------- public ---------- */

/* Room, or the whole turn, is free again: claim (a claim refused the turn may have
   come back empty, its first row too large for what was left). */
static void budget_wake(void *ud)
{
    drain *d = ud;
    d->want_claim = true;
    schedule_kick(d);
}

drain *drain_new(struct ev_loop *loop, const cfg *c, const cfg_outbox *ob, rbudget *budget,
                 char *err, size_t errlen)
{
    drain *d = calloc(1, sizeof *d);
    if (d == NULL) {
        snprintf(err, errlen, "outbox=%s: out of memory", ob->name);
        return NULL;
    }
    d->loop = loop;
    d->c = c;
    d->ob = ob;
    d->budget = budget;
    d->sink_state = SINK_DOWN;
    d->poll_delay = (double)cfg_poll_interval_ms(ob, false) / 1000.0;
    d->token_state = random_seed();
    d->m.outbox = ob->name;
    d->m.sink = ob->sink_name;
    d->m.backlog = -1;
    d->m.brokers = d->broker_addrs;
    d->m.broker = -1;
    d->last_broker = -1;
    snprintf(d->owner, sizeof d->owner, "%s/%08x", c->relay.name,
             (unsigned)((uint64_t)new_token(d) >> 20));
    snprintf(d->conn_name, sizeof d->conn_name, "outbox-relay %s/%s", c->relay.name, ob->name);

    ledger_cfg lc = { .outbox = ob->name, .max_attempts = ob->max_attempts,
                      .backoff_ms = ob->retry_backoff_ms,
                      .backoff_max_ms = ob->retry_backoff_max_ms,
                      .strict = ob->ordering == CFG_ORDER_STRICT };
    d->led = ledger_new(&lc);
    if (d->led == NULL) {
        snprintf(err, errlen, "outbox=%s: out of memory", ob->name);
        free(d);
        return NULL;
    }
    d->sops = source_ops_of(ob);
    d->kops = sink_ops_of(ob->sink);
    if (d->sops == NULL || d->kops == NULL) {
        snprintf(err, errlen, "outbox=%s: no source or sink implementation", ob->name);
        ledger_free(d->led);
        free(d);
        return NULL;
    }
    if (d->kops->addresses != NULL)
        d->m.n_brokers = d->kops->addresses(ob->sink, d->broker_addrs, SINK_MAX_ADDRESSES);
    char e2[512] = "";
    sconn *conns[2] = { &d->main, &d->settler };
    for (int i = 0; i < 2; i++) {
        sconn *sc = conns[i];
        sc->d = d;
        sc->role = i == 0 ? "main" : "settler";
        ev_timer_init(&sc->hold_timer, hold_cb, 0.1, 0.);
        sc->hold_timer.data = sc;
        /* only the claiming connection is woken by commits (LISTEN): the settling one
           would double every notification's cost in the database and wake nothing new */
        src_cbs scb = { .ud = sc, .on_state = i == 0 ? main_on_state : settler_on_state,
                        .on_wake = i == 0 ? src_on_wake : NULL, .on_done = src_on_done };
        if (d->sops->create(loop, ob, &scb, &sc->src, e2, sizeof e2) != 0) {
            snprintf(err, errlen, "outbox=%s: %s", ob->name, e2);
            if (i == 1)
                d->sops->destroy(d->main.src);
            ledger_free(d->led);
            free(d);
            return NULL;
        }
    }
    sink_cbs kcb = { .ud = d, .on_state = sink_on_state, .on_event = sink_on_event,
                     .on_result = sink_on_result, .on_writable = sink_on_writable,
                     .on_written = sink_on_written };
    if (d->kops->create(loop, ob->sink, d->conn_name, &kcb, &d->snk, e2, sizeof e2) != 0) {
        snprintf(err, errlen, "outbox=%s sink=%s: %s", ob->name, ob->sink_name, e2);
        d->sops->destroy(d->main.src);
        d->sops->destroy(d->settler.src);
        ledger_free(d->led);
        free(d);
        return NULL;
    }
    ev_timer_init(&d->poll_timer, poll_cb, d->poll_delay, 0.);
    d->poll_timer.data = d;
    /* ticks at a third of the lease, at most 1 s: the leader renews at lease / 3, a
       standby tries every tick, so a frozen leader is replaced within about lease + 1 s
       and a stopping one (which expires its own lease) within about a second */
    double li = ob->lease_ms / 3000.0;
    li = li < 0.1 ? 0.1 : li > 1 ? 1 : li;
    ev_timer_init(&d->lead_timer, lead_cb, li, li);
    d->lead_timer.data = d;
    ev_timer_init(&d->deadline_timer, deadline_cb, 1., 0.);
    d->deadline_timer.data = d;
    double ci = ob->cleanup_interval_ms / 1000.0;
    ev_timer_init(&d->cleanup_timer, cleanup_cb, ci, ci);
    d->cleanup_timer.data = d;
    ev_timer_init(&d->cleanup_retry, cleanup_cb, 1., 0.);   /* cleanup_failed sets it */
    d->cleanup_retry.data = d;
    ev_timer_init(&d->stats_timer, stats_cb, STATS_BUSY_S, STATS_BUSY_S);
    d->stats_timer.data = d;
    double hi = ob->health_interval_ms / 1000.0;
    ev_timer_init(&d->health_timer, health_cb, hi, hi);
    if (ob_health_on(d)) {
        d->m.health_seen = 1;
        d->m.table_dead_tuples = d->m.table_live_tuples = d->m.table_size_bytes = -1;
        d->m.horizon_xids = -1;
        d->m.last_autovacuum_ts = d->m.horizon_age_s = -1;
    }
    d->health_timer.data = d;
    ev_timer_init(&d->coalesce_timer, coalesce_cb, 0.001, 0.);   /* claims and settles */
    d->coalesce_timer.data = d;
    ev_timer_init(&d->expire_timer, expire_cb, 1., 0.);
    d->expire_timer.data = d;
    ev_idle_init(&d->kick_idle, kick_idle_cb);
    /* above the sockets' and timers' priority: an idle watcher of the default priority
       runs only in a turn of the loop with no other event pending, and while large rows
       are written out (the socket's write watcher ready at every turn) there is none: the
       next claim waited until every buffered row was out, and the window ran dry while it
       ran (512 KiB rows: 100-200 ms between a claim's answer and the next claim) */
    ev_set_priority(&d->kick_idle, EV_MAXPRI);
    d->kick_idle.data = d;
    rbudget_join(budget, &d->rb, budget_wake, d);
    return d;
}

/* The table's health is read when the source can and health_interval is not 0. */
static bool ob_health_on(const drain *d)
{
    return d->sops->health != NULL && d->ob->health_interval_ms > 0;
}

void drain_start(drain *d)
{
    if (d->ob->mode == CFG_MODE_LEADER)
        ev_timer_start(d->loop, &d->lead_timer);
    ev_timer_start(d->loop, &d->cleanup_timer);
    ev_timer_start(d->loop, &d->stats_timer);
    if (ob_health_on(d)) {
        d->health_due = true;            /* once at start, then every health_interval */
        ev_timer_start(d->loop, &d->health_timer);
    }
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
    log_ev(LOG_INFO, &(log_fields){ .event = "stopping", .outbox = d->ob->name },
           "outbox=%s: stopping: %zu in flight, %zu buffered rows given back",
           d->ob->name, ledger_n_inflight(d->led), ledger_n_buffered(d->led));
    ledger_giveback_buffered(d->led);
    sync_metrics(d);
    ev_timer_stop(d->loop, &d->poll_timer);
    ev_timer_stop(d->loop, &d->lead_timer);
    ev_timer_stop(d->loop, &d->deadline_timer);
    ev_timer_stop(d->loop, &d->cleanup_timer);
    ev_timer_stop(d->loop, &d->cleanup_retry);
    ev_timer_stop(d->loop, &d->stats_timer);
    ev_timer_stop(d->loop, &d->health_timer);
    ev_timer_stop(d->loop, &d->coalesce_timer);
    ev_timer_stop(d->loop, &d->expire_timer);
    schedule_kick(d);
}

void drain_free(drain *d)
{
    if (d == NULL)
        return;
    ev_timer_stop(d->loop, &d->poll_timer);
    ev_timer_stop(d->loop, &d->lead_timer);
    ev_timer_stop(d->loop, &d->deadline_timer);
    ev_timer_stop(d->loop, &d->cleanup_timer);
    ev_timer_stop(d->loop, &d->cleanup_retry);
    ev_timer_stop(d->loop, &d->stats_timer);
    ev_timer_stop(d->loop, &d->coalesce_timer);
    ev_timer_stop(d->loop, &d->expire_timer);
    ev_timer_stop(d->loop, &d->health_timer);
    ev_timer_stop(d->loop, &d->main.hold_timer);
    ev_timer_stop(d->loop, &d->settler.hold_timer);
    ev_idle_stop(d->loop, &d->kick_idle);
    rbudget_leave(d->budget, &d->rb);
    d->kops->destroy(d->snk);
    d->sops->destroy(d->main.src);
    d->sops->destroy(d->settler.src);
    ledger_free(d->led);
    free(d->lost);
    free(d->lost_until);
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
