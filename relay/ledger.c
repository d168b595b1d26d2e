/*
 * ledger.c — the life of every row one drain holds (see ledger.h for the states).
 *
 * Structures (all owned by the ledger):
 *  - every entry is in exactly one global list, the one of its state:
 *    buffered | parked (BUFFERED, waiting for the sink's destination check) |
 *    inflight | pending (OUTCOME) | settling | linger;
 *  - an id table (int64 id -> entry, open addressing with backward-shift
 *    deletion: no tombstones, and it shrinks when emptied);
 *  - per partition key a keyq with three id-ordered lists: `wait` (its BUFFERED
 *    rows), `out` (published: in flight, or acknowledged and awaiting the
 *    settle), `failed` (outcomes other than SENT, until settled and no claim
 *    that may predate the settle is running). A key with no entries is freed;
 *  - a min-heap by id of the rows that may be published now: each keyless
 *    buffered row, and for each key the head of its wait list when allowed.
 *
 * INVARIANTS (ledger_check verifies I1-I7 after every operation in the tests;
 * I5 is checked at the moment of publishing and counted):
 *  I1 every entry is in the global list of its state, and the id table maps
 *     its id to it and holds nothing else.
 *  I2 BUFFERED and INFLIGHT entries own their row; decided ones hold none
 *     (memory per row is freed as soon as the outcome is known). An in-flight
 *     row whose payload is held apart (ROW_APART_MIN bytes or more) lets go of
 *     it once the sink has written it whole (ledger_written): nothing reads it
 *     again unless the row is republished, and such a row is given back instead
 *     (I5). Only its headers then count in `bytes`: the byte budget bounds what
 *     is buffered and being written, publish_window what is in flight.
 *  I3 a SENT outcome exists only for a row the sink acknowledged; the settle
 *     carries the lease token the ledger holds for it now (tokens are adopted
 *     when a claim leases a held row again), so a row is marked sent only
 *     after its confirm and only by the relay holding its lease.
 *  I4 per key: `wait` holds exactly its BUFFERED rows in increasing id, `out`
 *     its in-flight and acknowledged rows, `failed` its other outcomes in
 *     increasing id; n_inflight counts the in-flight ones, which all go to one
 *     destination (exchange + routing key); ordering=strict: at most one.
 *  I5 a row is published only when every earlier row of its key that this
 *     ledger holds is published and not refused: it is the head of `wait` and
 *     no failed row of its key has a lower id. A failed row keeps its key's
 *     later rows back until its outcome (retry, dead letter) has committed —
 *     rows still buffered are given back, later claims of them too — so no
 *     later row reaches the broker before a dead-letter transaction commits.
 *     After a connection or channel loss, unconfirmed rows go back to `wait`
 *     in id order and are republished before anything later of their key;
 *     one whose payload was let go is given back to the table instead (like a
 *     row in flight under a lapsed leadership), which holds its key's later
 *     rows back as a failed row does, so the next claim brings it and them
 *     again in id order, with the payload read anew under the new lease.
 *  I6 the heap holds exactly the publishable rows (I5 and I4's destination
 *     rule), ordered by id.
 *  I7 memory follows work in flight: entries are freed once settled, keys once
 *     empty, and the id table shrinks; nothing is kept per settled row.
 *
 * The one case pipelining cannot make safe (the broker refuses row N while a
 * later row of its key, already in flight, is accepted) is detected and counted
 * (stats.overtaken) and logged; after a refusal towards a destination, keys go
 * one at a time there for cautious_s. ordering=strict rules it out.
 */
#include "relay/ledger.h"

#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/outbox_util.h"
#include "relay/log.h"
#include "relay/sink.h"

#define LED_CAUTIOUS_DEFAULT 30.0
#define LED_NCAUTIOUS        32
#define PTAB_MIN             64

enum { GL_BUFFERED, GL_PARKED, GL_INFLIGHT, GL_PENDING, GL_SETTLING, GL_LINGER, GL_N };
enum { KL_NONE, KL_WAIT, KL_OUT, KL_FAILED };

typedef struct link { led_entry *prev, *next; } link;
typedef struct elist { led_entry *head, *tail; size_t n; } elist;

typedef struct keyq {
    char      *key;          /* owned */
    uint64_t   hash;
    elist      wait, out, failed;
    size_t     n_inflight;
    uint64_t   dest;         /* destination of the in-flight rows (n_inflight > 0) */
    led_entry *heaped;       /* its row in the heap, or NULL */
} keyq;

struct led_entry {
    int64_t    id;
    int64_t    token;
    double     deadline;
    double     published_at;
    row       *r;            /* owned while BUFFERED / INFLIGHT */
    keyq      *k;            /* NULL: no partition key */
    link       ln[2];        /* [0] key list, [1] global list */
    uint64_t   dest;
    char      *reason;       /* owned: RETRY / DEAD */
    int64_t    backoff_ms;
    int        attempts;     /* the row's attempts when it was claimed */
    size_t     hix;          /* heap index + 1; 0 when not in the heap */
    uint8_t    state;        /* enum led_state; 0 while being created */
    uint8_t    kind;         /* enum src_outcome_kind, once decided */
    uint8_t    klist, glist;
    bool       parked, old, resettle, acked, overtook;
    bool       ahead;        /* in flight when an earlier row of its key was refused */
    bool       released;     /* in flight, its payload let go once written (I2) */
};

typedef struct pslot { uint64_t h; void *p; } pslot;
typedef struct ptab { pslot *s; size_t cap, used; } ptab;

struct ledger {
    ledger_cfg    cfg;
    double        now;
    elist         gl[GL_N];
    ptab          ids;
    ptab          keys;
    led_entry   **heap;
    size_t        heap_n, heap_cap;
    src_outcome  *sv;         /* the outstanding settle's outcomes */
    size_t        sv_cap;
    bool          claim_running;
    size_t        n_old;
    size_t        n_unsettled_sent;   /* SENT outcomes not yet committed (OUTCOME, SETTLING) */
    size_t        bytes;              /* src_row_bytes of the rows held (BUFFERED, INFLIGHT) */
    uint64_t      order_violations;   /* I5 broken at publish time: must stay 0 */
    struct { uint64_t dest; double until; } cautious[LED_NCAUTIOUS];
    ledger_stats  st;
    bool          oom_warned;
};

/* ------------------------------------------------------------ lists */

static void lpush(elist *l, led_entry *e, int w)
{
    e->ln[w].prev = l->tail;
    e->ln[w].next = NULL;
    if (l->tail)
        l->tail->ln[w].next = e;
    else
        l->head = e;
    l->tail = e;
    l->n++;
}

static void lremove(elist *l, led_entry *e, int w)
{
    if (e->ln[w].prev)
        e->ln[w].prev->ln[w].next = e->ln[w].next;
    else
        l->head = e->ln[w].next;
    if (e->ln[w].next)
        e->ln[w].next->ln[w].prev = e->ln[w].prev;
    else
        l->tail = e->ln[w].prev;
    e->ln[w].prev = e->ln[w].next = NULL;
    l->n--;
}

/* Inserts e into an id-ordered key list (searching from the tail: rows
 * usually arrive in id order). */
static void linsert_sorted(elist *l, led_entry *e)
{
    led_entry *after = l->tail;
    while (after != NULL && after->id > e->id)
        after = after->ln[0].prev;
    if (after == NULL) {
        e->ln[0].prev = NULL;
        e->ln[0].next = l->head;
        if (l->head)
            l->head->ln[0].prev = e;
        else
            l->tail = e;
        l->head = e;
    } else {
        e->ln[0].prev = after;
        e->ln[0].next = after->ln[0].next;
        if (after->ln[0].next)
            after->ln[0].next->ln[0].prev = e;
        else
            l->tail = e;
        after->ln[0].next = e;
    }
    l->n++;
}

static elist *klist_of(keyq *k, int which)
{
    return which == KL_WAIT ? &k->wait : which == KL_OUT ? &k->out : &k->failed;
}

static void kmove(led_entry *e, int to)
{
    keyq *k = e->k;
    if (k == NULL) {
        e->klist = KL_NONE;
        return;
    }
    if (e->klist != KL_NONE)
        lremove(klist_of(k, e->klist), e, 0);
    e->klist = (uint8_t)to;
    if (to == KL_OUT)
        lpush(&k->out, e, 0);
    else if (to != KL_NONE)
        linsert_sorted(klist_of(k, to), e);
}

static void gmove(ledger *l, led_entry *e, int to)
{
    if (e->glist < GL_N && e->state != 0)
        lremove(&l->gl[e->glist], e, 1);
    e->glist = (uint8_t)to;
    if (to < GL_N)
        lpush(&l->gl[to], e, 1);
}

/* ------------------------------------------------------------ hash tables */

static uint64_t str_hash(const char *s)
{
    return outbox_util_mix64(outbox_util_fnv1a64_str(s));
}

static int ptab_resize(ptab *t, size_t cap)
{
    pslot *ns = calloc(cap, sizeof *ns);
    if (ns == NULL)
        return -1;
    for (size_t i = 0; i < t->cap; i++) {
        if (t->s[i].p == NULL)
            continue;
        size_t j = t->s[i].h & (cap - 1);
        while (ns[j].p != NULL)
            j = (j + 1) & (cap - 1);
        ns[j] = t->s[i];
    }
    free(t->s);
    t->s = ns;
    t->cap = cap;
    return 0;
}

/* Finds the pointer stored under h for which eq(p, k) holds. */
static void *ptab_get(const ptab *t, uint64_t h, bool (*eq)(const void *p, const void *k),
                      const void *k)
{
    if (t->cap == 0)
        return NULL;
    for (size_t i = h & (t->cap - 1);; i = (i + 1) & (t->cap - 1)) {
        if (t->s[i].p == NULL)
            return NULL;
        if (t->s[i].h == h && eq(t->s[i].p, k))
            return t->s[i].p;
    }
}

/* Adds p (not present yet). 0, or -1 out of memory. Load stays at most 1/2. */
static int ptab_put(ptab *t, uint64_t h, void *p)
{
    if ((t->used + 1) * 2 > t->cap && ptab_resize(t, t->cap ? t->cap * 2 : PTAB_MIN) != 0)
        return -1;
    size_t i = h & (t->cap - 1);
    while (t->s[i].p != NULL)
        i = (i + 1) & (t->cap - 1);
    t->s[i].h = h;
    t->s[i].p = p;
    t->used++;
    return 0;
}

/* Removes the slot holding p (backward-shift deletion: no tombstones). */
static void ptab_del(ptab *t, uint64_t h, const void *p)
{
    if (t->cap == 0)
        return;
    size_t mask = t->cap - 1, i = h & mask;
    while (t->s[i].p != p) {
        if (t->s[i].p == NULL)
            return;
        i = (i + 1) & mask;
    }
    for (size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        if (t->s[j].p == NULL)
            break;
        size_t home = t->s[j].h & mask;
        /* move s[j] back to the hole at i when its home is not in (i, j] */
        bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            t->s[i] = t->s[j];
            i = j;
        }
    }
    t->s[i].p = NULL;
    t->s[i].h = 0;
    t->used--;
    if (t->cap > PTAB_MIN && t->used * 8 < t->cap)
        (void)ptab_resize(t, t->cap / 2);   /* on failure it simply stays larger */
}

static bool id_eq(const void *p, const void *k)
{
    return ((const led_entry *)p)->id == *(const int64_t *)k;
}

static bool key_eq(const void *p, const void *k)
{
    return strcmp(((const keyq *)p)->key, (const char *)k) == 0;
}

static led_entry *id_find(const ledger *l, int64_t id)
{
    return ptab_get(&l->ids, outbox_util_mix64((uint64_t)id), id_eq, &id);
}

/* ------------------------------------------------------------ heap */

static void heap_set(ledger *l, size_t i, led_entry *e)
{
    l->heap[i] = e;
    e->hix = i + 1;
}

static void heap_up(ledger *l, size_t i)
{
    led_entry *e = l->heap[i];
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (l->heap[p]->id <= e->id)
            break;
        heap_set(l, i, l->heap[p]);
        i = p;
    }
    heap_set(l, i, e);
}

static void heap_down(ledger *l, size_t i)
{
    led_entry *e = l->heap[i];
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= l->heap_n)
            break;
        if (c + 1 < l->heap_n && l->heap[c + 1]->id < l->heap[c]->id)
            c++;
        if (l->heap[c]->id >= e->id)
            break;
        heap_set(l, i, l->heap[c]);
        i = c;
    }
    heap_set(l, i, e);
}

static int heap_push(ledger *l, led_entry *e)
{
    if (l->heap_n == l->heap_cap) {
        size_t ncap = l->heap_cap ? l->heap_cap * 2 : 64;
        led_entry **nh = realloc(l->heap, ncap * sizeof *nh);
        if (nh == NULL)
            return -1;
        l->heap = nh;
        l->heap_cap = ncap;
    }
    l->heap_n++;
    heap_set(l, l->heap_n - 1, e);
    heap_up(l, l->heap_n - 1);
    if (e->k != NULL)
        e->k->heaped = e;
    return 0;
}

static void heap_remove(ledger *l, led_entry *e)
{
    if (e->hix == 0)
        return;
    size_t i = e->hix - 1;
    e->hix = 0;
    if (e->k != NULL && e->k->heaped == e)
        e->k->heaped = NULL;
    l->heap_n--;
    if (i == l->heap_n)
        return;
    heap_set(l, i, l->heap[l->heap_n]);
    heap_up(l, i);
    heap_down(l, l->heap[i]->hix - 1);
}

/* ------------------------------------------------------------ destinations */

static uint64_t dest_hash(const row *r)
{
    uint64_t h = str_hash(r->exchange) * 31 + str_hash(r->routing_key);
    return h ? h : 1;
}

static bool dest_cautious(const ledger *l, uint64_t dest)
{
    for (size_t i = 0; i < LED_NCAUTIOUS; i++)
        if (l->cautious[i].dest == dest && l->cautious[i].until > l->now)
            return true;
    return false;
}

static void dest_mark_cautious(ledger *l, uint64_t dest)
{
    size_t pick = 0;
    for (size_t i = 0; i < LED_NCAUTIOUS; i++) {
        if (l->cautious[i].dest == dest) {
            pick = i;
            break;
        }
        if (l->cautious[i].until < l->cautious[pick].until)
            pick = i;   /* the oldest (or an expired) slot */
    }
    l->cautious[pick].dest = dest;
    l->cautious[pick].until = l->now + l->cfg.cautious_s;
}

/* ------------------------------------------------------------ keys */

static keyq *key_get(ledger *l, const char *key)
{
    uint64_t h = str_hash(key);
    keyq *k = ptab_get(&l->keys, h, key_eq, key);
    if (k != NULL)
        return k;
    k = calloc(1, sizeof *k);
    if (k == NULL || (k->key = strdup(key)) == NULL) {
        free(k);
        return NULL;
    }
    k->hash = h;
    if (ptab_put(&l->keys, h, k) != 0) {
        free(k->key);
        free(k);
        return NULL;
    }
    return k;
}

static void key_release(ledger *l, keyq *k)
{
    if (k == NULL || k->wait.n || k->out.n || k->failed.n || k->heaped)
        return;
    ptab_del(&l->keys, k->hash, k);
    free(k->key);
    free(k);
}

/* May the head of k's wait list be published now? (I5, I4's destination rule) */
static bool key_ready(const ledger *l, const keyq *k, bool with_caution)
{
    const led_entry *w = k->wait.head;
    if (w == NULL || w->parked)
        return false;
    if (k->failed.head != NULL && k->failed.head->id < w->id)
        return false;
    if (k->n_inflight > 0) {
        if (l->cfg.strict || w->dest != k->dest)
            return false;
        if (with_caution && dest_cautious(l, w->dest))
            return false;
    }
    return true;
}

/* Makes the heap agree with the entry's (or its key's) state. */
static void refresh(ledger *l, led_entry *e)
{
    keyq *k = e->k;
    if (k == NULL) {
        bool ok = e->state == LED_BUFFERED && !e->parked;
        if (!ok)
            heap_remove(l, e);
        else if (e->hix == 0 && heap_push(l, e) != 0)
            l->oom_warned = true;   /* retried at the next refresh */
        return;
    }
    bool ok = key_ready(l, k, true);
    if (k->heaped != NULL && (!ok || k->heaped != k->wait.head))
        heap_remove(l, k->heaped);
    if (ok && k->heaped == NULL && heap_push(l, k->wait.head) != 0)
        l->oom_warned = true;
}

/* ------------------------------------------------------------ entries */

static bool unsettled_sent(const led_entry *e)
{
    return e->kind == SRC_SENT && e->acked &&
           (e->state == LED_OUTCOME || e->state == LED_SETTLING);
}

static void entry_free(ledger *l, led_entry *e)
{
    keyq *k = e->k;
    heap_remove(l, e);
    if (e->state != 0)
        lremove(&l->gl[e->glist], e, 1);
    if (k != NULL && e->klist != KL_NONE)
        lremove(klist_of(k, e->klist), e, 0);
    ptab_del(&l->ids, outbox_util_mix64((uint64_t)e->id), e);
    if (unsettled_sent(e))
        l->n_unsettled_sent--;
    if (e->state == LED_INFLIGHT) {
        if (k != NULL)
            k->n_inflight--;
        if (e->old)
            l->n_old--;
    }
    if (e->r != NULL)
        l->bytes -= src_row_bytes(e->r);
    row_free(e->r);
    free(e->reason);
    free(e);
    if (k != NULL) {
        if (k->wait.head != NULL)
            refresh(l, k->wait.head);
        key_release(l, k);
    }
}

static void set_state(ledger *l, led_entry *e, enum led_state state, int glist)
{
    bool was = unsettled_sent(e);
    gmove(l, e, glist);
    e->state = (uint8_t)state;
    if (unsettled_sent(e) && !was)
        l->n_unsettled_sent++;
    else if (was && !unsettled_sent(e))
        l->n_unsettled_sent--;
}

/* Decides e's outcome (e is new, BUFFERED, or INFLIGHT with its counters
 * already updated). A non-SENT outcome blocks e's key: its later buffered
 * rows are given back too (I5). */
static void decide(ledger *l, led_entry *e, enum src_outcome_kind kind, int64_t backoff_ms,
                   const char *reason)
{
    heap_remove(l, e);
    e->kind = (uint8_t)kind;
    e->backoff_ms = backoff_ms;
    free(e->reason);
    e->reason = NULL;
    if (reason != NULL && (e->reason = strdup(reason)) == NULL && !l->oom_warned) {
        log_ev(LOG_ERROR, &(log_fields){ .event = "out_of_memory", .outbox = l->cfg.outbox,
                                         .id = e->id },
               "outbox=%s id=%" PRId64 ": out of memory keeping the failure reason",
               l->cfg.outbox, e->id);
        l->oom_warned = true;
    }
    if (e->r != NULL)
        l->bytes -= src_row_bytes(e->r);
    row_free(e->r);
    e->r = NULL;
    e->parked = false;
    set_state(l, e, LED_OUTCOME, GL_PENDING);
    keyq *k = e->k;
    if (k == NULL)
        return;
    kmove(e, kind == SRC_SENT ? KL_OUT : KL_FAILED);
    if (kind == SRC_SENT)
        return;
    /* later buffered rows of the key go back to the table (wait is id-ordered) */
    while (k->wait.tail != NULL && k->wait.tail->id > e->id)
        decide(l, k->wait.tail, SRC_UNCLAIM, 0, NULL);
    if (k->wait.head != NULL)
        refresh(l, k->wait.head);
    else if (k->heaped != NULL)
        heap_remove(l, k->heaped);
}

/* Later rows of e's key that the broker accepted while e was refused. */
static void note_overtaken(ledger *l, led_entry *later, const led_entry *earlier, bool maybe)
{
    char ids[40] = "";
    if (later->overtook)
        return;
    later->overtook = true;
    l->st.overtaken++;
    if (earlier != NULL)
        snprintf(ids, sizeof ids, " id=%" PRId64, earlier->id);
    log_ev(LOG_WARN, &(log_fields){ .event = "overtaken", .outbox = l->cfg.outbox,
                                    .id = later->id, .partition_key = later->k->key,
                                    .message_id = later->r ? later->r->message_id : NULL },
           "outbox=%s partition_key=%s: id=%" PRId64 " %s while an earlier row of "
           "its key%s was refused; that row goes after it (ordering = strict rules this out)",
           l->cfg.outbox, later->k->key, later->id,
            maybe ? "may have reached the broker (its confirm was lost with the connection)"
                  : "was accepted by the broker", ids);
}

/* A failed attempt of e (its row still attached): retry with back-off, or dead-letter. */
static void attempt_failed(ledger *l, led_entry *e, const char *reason)
{
    /* a count outside 0..INT_MAX - 1 (a row written by hand) is taken as its nearest bound:
       INT_MAX + 1 would be negative, and the row retried forever instead of dead-lettered
       (the settles count alike: sql_pg.c and sql_tsql.c, ATTEMPT_NEXT) */
    int prior = e->r->attempts < 0 ? 0 : e->r->attempts;
    int attempts = prior == INT_MAX ? INT_MAX : prior + 1;
    char why[700];
    l->st.failed++;
    if (attempts >= l->cfg.max_attempts) {
        snprintf(why, sizeof why, "%s (after %d attempts)", reason, attempts);
        log_ev(LOG_ERROR, &(log_fields){ .event = "dead_lettered", .outbox = l->cfg.outbox,
                                         .id = e->id, .message_id = e->r->message_id,
                                         .partition_key = e->r->partition_key, .error = why },
               "outbox=%s id=%" PRId64 " message_id=%s: dead-lettered: %s",
               l->cfg.outbox, e->id, e->r->message_id, why);
        l->st.dead++;
        decide(l, e, SRC_DEAD, 0, why);
    } else {
        int64_t b = outbox_util_backoff_nth(l->cfg.backoff_ms, l->cfg.backoff_max_ms, attempts);
        log_ev(LOG_WARN, &(log_fields){ .event = "retry", .outbox = l->cfg.outbox, .id = e->id,
                                        .message_id = e->r->message_id,
                                        .partition_key = e->r->partition_key, .error = reason },
               "outbox=%s id=%" PRId64 " message_id=%s: attempt %d/%d failed: %s; "
               "retry in %" PRId64 " ms", l->cfg.outbox, e->id, e->r->message_id, attempts,
                l->cfg.max_attempts, reason, b);
        decide(l, e, SRC_RETRY, b, reason);
    }
    if (e->k != NULL)
        for (led_entry *o = e->k->out.head; o != NULL; o = o->ln[0].next) {
            if (o->id < e->id)
                continue;
            if (o->acked)
                note_overtaken(l, o, e, false);
            else
                o->ahead = true;   /* if accepted it overtakes e; if lost it goes back */
        }
}

/* ------------------------------------------------------------ public */

ledger *ledger_new(const ledger_cfg *lc)
{
    ledger *l = calloc(1, sizeof *l);
    if (l == NULL)
        return NULL;
    l->cfg = *lc;
    if (l->cfg.cautious_s <= 0)
        l->cfg.cautious_s = LED_CAUTIOUS_DEFAULT;
    if (l->cfg.max_attempts < 1)
        l->cfg.max_attempts = 1;
    if (l->cfg.outbox == NULL)
        l->cfg.outbox = "?";
    return l;
}

void ledger_free(ledger *l)
{
    if (l == NULL)
        return;
    for (int g = 0; g < GL_N; g++) {
        led_entry *e;
        while ((e = l->gl[g].head) != NULL)
            entry_free(l, e);
    }
    free(l->ids.s);
    free(l->keys.s);
    free(l->heap);
    free(l->sv);
    free(l);
}

void ledger_claim_started(ledger *l)
{
    l->claim_running = true;
}

/* The running claim is over: rows settled meanwhile can be forgotten. */
static void claim_over(ledger *l)
{
    led_entry *e;
    l->claim_running = false;
    while ((e = l->gl[GL_LINGER].head) != NULL)
        entry_free(l, e);
}

static void adopt(ledger *l, led_entry *e, const row *r, double deadline)
{
    l->st.readopted++;
    e->token = r->lease_token;
    if (e->state >= LED_OUTCOME && e->kind == SRC_RETRY && r->attempts > e->attempts) {
        /* a settle reported as failed had committed the retry after all: the
           attempt is counted already, so just give the row back */
        e->kind = SRC_UNCLAIM;
        e->backoff_ms = 0;
    }
    switch (e->state) {
    case LED_BUFFERED:
    case LED_INFLIGHT:
        e->deadline = deadline;
        if (e->r != NULL)
            e->r->lease_token = r->lease_token;
        break;
    case LED_SETTLING:
        e->resettle = true;     /* the running settle carries the old token */
        break;
    case LED_LINGER:
        set_state(l, e, LED_OUTCOME, GL_PENDING);   /* its settle did not apply: again */
        break;
    default:
        break;
    }
}

void ledger_claimed(ledger *l, row **rows, size_t n, double deadline)
{
    for (size_t i = 0; i < n; i++) {
        row *r = rows[i];
        led_entry *e = id_find(l, r->id);
        if (e != NULL) {
            adopt(l, e, r, deadline);
            row_free(r);
            continue;
        }
        keyq *k = NULL;
        e = calloc(1, sizeof *e);
        if (e != NULL && r->partition_key != NULL && (k = key_get(l, r->partition_key)) == NULL) {
            free(e);
            e = NULL;
        }
        if (e == NULL || ptab_put(&l->ids, outbox_util_mix64((uint64_t)r->id), e) != 0) {
            /* the row keeps its lease and becomes claimable again when it expires */
            if (!l->oom_warned)
                log_ev(LOG_ERROR, &(log_fields){ .event = "out_of_memory",
                                                 .outbox = l->cfg.outbox, .id = r->id,
                                                 .message_id = r->message_id,
                                                 .partition_key = r->partition_key },
                       "outbox=%s id=%" PRId64 ": out of memory holding a claimed "
                       "row; its lease will expire instead", l->cfg.outbox, r->id);
            l->oom_warned = true;
            free(e);
            key_release(l, k);
            row_free(r);
            continue;
        }
        e->id = r->id;
        e->attempts = r->attempts;
        e->token = r->lease_token;
        e->deadline = deadline;
        e->r = r;
        l->bytes += src_row_bytes(r);
        e->k = k;
        e->dest = dest_hash(r);
        e->glist = GL_N;
        if (k != NULL && k->failed.head != NULL && k->failed.head->id < e->id) {
            /* behind a failed row of its key that may not have committed yet */
            decide(l, e, SRC_UNCLAIM, 0, NULL);
            continue;
        }
        set_state(l, e, LED_BUFFERED, GL_BUFFERED);
        kmove(e, KL_WAIT);
        refresh(l, e);
    }
    claim_over(l);
}

void ledger_claim_failed(ledger *l)
{
    claim_over(l);
}

/* Rows whose lease may be gone or going are left out: past their deadline, and any
   outcome but SENT (its settle gives the row back). Rows leased under a leadership or
   claiming session since lost (whose leases a new leader releases) are never held while a
   claim starts: the drain claims only once those in flight are through (ledger_n_old), and
   forgets the rows of a claim answered after its leadership lapsed. A row given
   back while the claim runs is not taken by it then, and its key's later rows that it
   takes are given back (the key's failed list): the next claim brings them in order. */
size_t ledger_held_ids(const ledger *l, double now, int64_t *out, size_t max)
{
    /* the oldest first: a claim's walk meets the lowest ids first */
    static const int lists[] = { GL_SETTLING, GL_PENDING, GL_INFLIGHT, GL_PARKED, GL_BUFFERED };
    size_t n = 0;
    for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
        for (const led_entry *e = l->gl[lists[i]].head; e != NULL && n < max; e = e->ln[1].next) {
            if (e->deadline > now && (e->state < LED_OUTCOME || e->kind == SRC_SENT))
                out[n++] = e->id;
        }
    }
    return n;
}

static void log_expired(ledger *l, size_t expired)
{
    if (expired == 0)
        return;
    l->st.expired += expired;
    log_ev(LOG_INFO, &(log_fields){ .event = "lease_expired", .outbox = l->cfg.outbox },
           "outbox=%s: %zu buffered rows given back unpublished: their lease "
           "ran out before the broker took them", l->cfg.outbox, expired);
}

led_entry *ledger_next(ledger *l, double now)
{
    size_t expired = 0;
    l->now = now;
    while (l->heap_n > 0) {
        led_entry *e = l->heap[0];
        if (e->deadline > now)
            break;
        /* its lease may be someone else's by now: never publish it (issue: fencing) */
        expired++;
        decide(l, e, SRC_UNCLAIM, 0, NULL);
    }
    log_expired(l, expired);
    return l->heap_n > 0 ? l->heap[0] : NULL;
}

size_t ledger_expire(ledger *l, double now)
{
    size_t before = ledger_n_buffered(l);
    l->now = now;
    for (int g = GL_BUFFERED; g <= GL_PARKED; g++) {
        led_entry *e = l->gl[g].head;
        while (e != NULL) {
            if (e->deadline > now) {
                e = e->ln[1].next;
                continue;
            }
            decide(l, e, SRC_UNCLAIM, 0, NULL);
            e = l->gl[g].head;     /* giving a row back may give back others of its key */
        }
    }
    size_t expired = before - ledger_n_buffered(l);    /* those cascaded included */
    log_expired(l, expired);
    return expired;
}

double ledger_first_deadline(const ledger *l)
{
    double first = 0;
    for (int g = GL_BUFFERED; g <= GL_PARKED; g++)
        for (const led_entry *e = l->gl[g].head; e != NULL; e = e->ln[1].next)
            if (first == 0 || e->deadline < first)
                first = e->deadline;
    return first;
}

const row *ledger_row(const led_entry *e)
{
    return e->r;
}

int64_t ledger_id(const led_entry *e)
{
    return e->id;
}

double ledger_published_at(const led_entry *e)
{
    return e->published_at;
}

void ledger_published(ledger *l, led_entry *e, double now)
{
    keyq *k = e->k;
    l->now = now;
    /* I5 at the moment it matters */
    if (e->state != LED_BUFFERED || e->parked ||
        (k != NULL && (k->wait.head != e ||
                       (k->failed.head != NULL && k->failed.head->id < e->id) ||
                       (k->n_inflight > 0 && (l->cfg.strict || k->dest != e->dest))))) {
        l->order_violations++;
        log_ev(LOG_ERROR, &(log_fields){ .event = "order_violation", .outbox = l->cfg.outbox,
                                         .id = e->id, .partition_key = k ? k->key : NULL,
                                         .message_id = e->r ? e->r->message_id : NULL },
               "outbox=%s id=%" PRId64 ": published out of turn (a bug)",
               l->cfg.outbox, e->id);
    }
    heap_remove(l, e);
    e->published_at = now;
    set_state(l, e, LED_INFLIGHT, GL_INFLIGHT);
    if (k != NULL) {
        kmove(e, KL_OUT);
        k->n_inflight++;
        k->dest = e->dest;
        refresh(l, e);
    }
}

void ledger_written(ledger *l, led_entry *e)
{
    if (e->state != LED_INFLIGHT || e->released || e->r == NULL)
        return;
    size_t before = src_row_bytes(e->r);
    (void)row_release_payload(e->r);
    if (!e->r->payload_released)
        return;    /* part of the row's block: it stays (an empty one let go frees 0 bytes) */
    e->released = true;
    l->st.released++;
    l->bytes -= before - src_row_bytes(e->r);
}

void ledger_wait(ledger *l, led_entry *e)
{
    if (e->state != LED_BUFFERED || e->parked)
        return;
    e->parked = true;
    gmove(l, e, GL_PARKED);
    refresh(l, e);
}

void ledger_unpark(ledger *l)
{
    led_entry *e;
    while ((e = l->gl[GL_PARKED].head) != NULL) {
        e->parked = false;
        gmove(l, e, GL_BUFFERED);
        refresh(l, e);
    }
}

void ledger_refused(ledger *l, led_entry *e, enum led_refusal why, const char *reason, double now)
{
    l->now = now;
    if (e->state != LED_BUFFERED)
        return;
    if (why == LED_UNPUBLISHABLE) {
        char msg[700];
        snprintf(msg, sizeof msg, "unpublishable: %s", reason && reason[0] ? reason
                 : "rejected by the sink");
        log_ev(LOG_ERROR, &(log_fields){ .event = "dead_lettered", .outbox = l->cfg.outbox,
                                         .id = e->id, .message_id = e->r->message_id,
                                         .partition_key = e->r->partition_key, .error = msg },
               "outbox=%s id=%" PRId64 " message_id=%s: dead-lettered: %s",
               l->cfg.outbox, e->id, e->r->message_id, msg);
        l->st.dead++;
        l->st.failed++;
        decide(l, e, SRC_DEAD, 0, msg);
        return;
    }
    l->st.refused++;
    attempt_failed(l, e, reason && reason[0] ? reason : "refused by the broker");
}

void ledger_result(ledger *l, led_entry *e, enum sink_outcome outcome, const char *reason,
                   double now)
{
    keyq *k = e->k;
    l->now = now;
    if (e->state != LED_INFLIGHT)
        return;
    if (k != NULL)
        k->n_inflight--;
    if (e->old)
        l->n_old--;
    switch (outcome) {
    case SINK_ACK:
        e->acked = true;
        if (e->ahead)
            note_overtaken(l, e, NULL, false);
        decide(l, e, SRC_SENT, 0, NULL);
        break;
    case SINK_RETURNED:
    case SINK_NACKED:
    case SINK_REJECTED:
        if (outcome == SINK_RETURNED)
            l->st.returned++;
        else if (outcome == SINK_NACKED)
            l->st.nacked++;
        else
            l->st.rejected++;
        /* refused while later messages may be accepted: go one at a time there for a
           while (a channel close drops everything after its culprit: no caution) */
        if (outcome != SINK_REJECTED)
            dest_mark_cautious(l, e->dest);
        attempt_failed(l, e, reason ? reason
                       : outcome == SINK_RETURNED ? "returned by the broker (unroutable)"
                       : outcome == SINK_NACKED ? "nacked by the broker"
                       : "rejected by the broker");
        break;
    default: /* SINK_LOST: not the row's fault */
        l->st.given_back++;
        if (e->ahead)
            note_overtaken(l, e, NULL, true);
        if (e->old || e->ahead || e->released ||
            (k != NULL && k->failed.head != NULL && k->failed.head->id < e->id)) {
            /* republishing it would put it ahead of an earlier row of its key that is
               not through yet, or its payload is no longer held: give it back, the
               table's order takes over */
            decide(l, e, SRC_UNCLAIM, 0, NULL);
        } else {
            /* keep the lease and publish it again, in id order within its key */
            l->st.republished++;
            set_state(l, e, LED_BUFFERED, GL_BUFFERED);
            kmove(e, KL_WAIT);
        }
        break;
    }
    if (k != NULL && k->wait.head != NULL)
        refresh(l, k->wait.head);
    else if (k == NULL)
        refresh(l, e);
}

size_t ledger_settle_begin(ledger *l, const src_outcome **v)
{
    size_t n = l->gl[GL_PENDING].n;
    *v = NULL;
    if (n == 0)
        return 0;
    if (n > l->sv_cap) {
        src_outcome *nv = realloc(l->sv, n * sizeof *nv);
        if (nv == NULL)
            return 0;
        l->sv = nv;
        l->sv_cap = n;
    }
    size_t i = 0;
    led_entry *e;
    while ((e = l->gl[GL_PENDING].head) != NULL) {
        l->sv[i++] = (src_outcome){ .id = e->id, .lease_token = e->token, .kind = e->kind,
                                    .backoff_ms = e->backoff_ms, .reason = e->reason };
        set_state(l, e, LED_SETTLING, GL_SETTLING);
    }
    *v = l->sv;
    return n;
}

void ledger_settle_done(ledger *l, bool ok, size_t n_applied)
{
    size_t n = l->gl[GL_SETTLING].n, again = 0, sent = 0;
    led_entry *e;
    while ((e = l->gl[GL_SETTLING].head) != NULL) {
        if (!ok || e->resettle) {
            again += e->resettle;
            e->resettle = false;
            set_state(l, e, LED_OUTCOME, GL_PENDING);
            continue;
        }
        sent += e->kind == SRC_SENT;
        if (l->claim_running)
            set_state(l, e, LED_LINGER, GL_LINGER);
        else
            entry_free(l, e);
    }
    if (!ok)
        return;
    l->st.relayed += sent;
    if (n_applied + again < n) {
        size_t lost = n - n_applied - again;
        l->st.lease_lost += lost;
        log_ev(LOG_WARN, &(log_fields){ .event = "lease_lost", .outbox = l->cfg.outbox },
               "outbox=%s: %zu of %zu outcomes not applied: the lease moved on "
               "(another relay took the rows over, or a lost connection had already "
               "applied them)", l->cfg.outbox, lost, n);
    }
}

void ledger_giveback_buffered(ledger *l)
{
    led_entry *e;
    while ((e = l->gl[GL_PARKED].head) != NULL || (e = l->gl[GL_BUFFERED].head) != NULL)
        decide(l, e, SRC_UNCLAIM, 0, NULL);
}

void ledger_drop_buffered(ledger *l)
{
    led_entry *e;
    while ((e = l->gl[GL_PARKED].head) != NULL || (e = l->gl[GL_BUFFERED].head) != NULL)
        entry_free(l, e);
    for (e = l->gl[GL_INFLIGHT].head; e != NULL; e = e->ln[1].next)
        if (!e->old) {
            e->old = true;
            l->n_old++;
        }
}

size_t ledger_n_buffered(const ledger *l)
{
    return l->gl[GL_BUFFERED].n + l->gl[GL_PARKED].n;
}

size_t ledger_n_inflight(const ledger *l) { return l->gl[GL_INFLIGHT].n; }
size_t ledger_bytes(const ledger *l) { return l->bytes; }
size_t ledger_n_old(const ledger *l) { return l->n_old; }
size_t ledger_n_pending(const ledger *l) { return l->gl[GL_PENDING].n; }
size_t ledger_n_keys(const ledger *l) { return l->keys.used; }
size_t ledger_n_unsettled_sent(const ledger *l) { return l->n_unsettled_sent; }
const ledger_stats *ledger_get_stats(const ledger *l) { return &l->st; }

size_t ledger_n_outcomes(const ledger *l)
{
    return l->gl[GL_PENDING].n + l->gl[GL_SETTLING].n + l->gl[GL_LINGER].n;
}

size_t ledger_n_held(const ledger *l)
{
    return l->ids.used;
}

/* ------------------------------------------------------------ invariants */

#define FAIL(...) do { snprintf(err, errlen, __VA_ARGS__); return -1; } while (0)

static const int gl_state[GL_N] = { LED_BUFFERED, LED_BUFFERED, LED_INFLIGHT, LED_OUTCOME,
                                    LED_SETTLING, LED_LINGER };

static int check_key(const ledger *l, const keyq *k, char *err, size_t errlen)
{
    size_t inflight = 0;
    int64_t prev = INT64_MIN;
    if (k->wait.n + k->out.n + k->failed.n == 0)
        FAIL("I7: key '%s' is empty but kept", k->key);
    for (const led_entry *e = k->wait.head; e; e = e->ln[0].next) {
        if (e->k != k || e->klist != KL_WAIT || e->state != LED_BUFFERED)
            FAIL("I4: key '%s' wait holds id=%" PRId64 " in state %d", k->key, e->id, e->state);
        if (e->id <= prev)
            FAIL("I4: key '%s' wait not in id order at id=%" PRId64, k->key, e->id);
        prev = e->id;
    }
    for (const led_entry *e = k->out.head; e; e = e->ln[0].next) {
        if (e->k != k || e->klist != KL_OUT)
            FAIL("I4: key '%s' out list corrupt at id=%" PRId64, k->key, e->id);
        if (e->state == LED_INFLIGHT) {
            inflight++;
            if (e->dest != k->dest)
                FAIL("I4: key '%s' has rows in flight to two destinations", k->key);
        } else if (!(e->state >= LED_OUTCOME && e->kind == SRC_SENT && e->acked)) {
            FAIL("I4: key '%s' out holds id=%" PRId64 " state %d kind %d", k->key, e->id,
                 e->state, e->kind);
        }
    }
    prev = INT64_MIN;
    for (const led_entry *e = k->failed.head; e; e = e->ln[0].next) {
        if (e->k != k || e->klist != KL_FAILED || e->state < LED_OUTCOME || e->kind == SRC_SENT)
            FAIL("I4: key '%s' failed holds id=%" PRId64 " state %d", k->key, e->id, e->state);
        if (e->id <= prev)
            FAIL("I4: key '%s' failed not in id order", k->key);
        prev = e->id;
    }
    if (inflight != k->n_inflight)
        FAIL("I4: key '%s' counts %zu in flight, has %zu", k->key, k->n_inflight, inflight);
    if (l->cfg.strict && inflight > 1)
        FAIL("I4: key '%s' has %zu in flight under ordering=strict", k->key, inflight);
    /* I6 (destination caution is advisory and may expire between events: not checked) */
    bool ready = key_ready(l, k, false);
    if (k->heaped != NULL && (k->heaped != k->wait.head || !ready))
        FAIL("I6: key '%s' has id=%" PRId64 " in the heap but may not publish it", k->key,
             k->heaped->id);
    if (k->heaped == NULL && ready && k->n_inflight == 0)
        FAIL("I6: key '%s' may publish id=%" PRId64 " but it is not in the heap", k->key,
             k->wait.head->id);
    return 0;
}

int ledger_check(const ledger *l, char *err, size_t errlen)
{
    size_t total = 0, old = 0, unsettled = 0, bytes = 0;
    if (l->order_violations)
        FAIL("I5: %" PRIu64 " rows were published out of turn", l->order_violations);
    for (int g = 0; g < GL_N; g++) {
        size_t n = 0;
        for (const led_entry *e = l->gl[g].head; e; e = e->ln[1].next) {
            n++;
            if (e->glist != g || e->state != gl_state[g] || e->parked != (g == GL_PARKED))
                FAIL("I1: id=%" PRId64 " in list %d has state %d", e->id, g, e->state);
            if (id_find(l, e->id) != e)
                FAIL("I1: id=%" PRId64 " missing from the id table", e->id);
            bool owns = e->state == LED_BUFFERED || e->state == LED_INFLIGHT;
            if (owns != (e->r != NULL) || (e->r && (e->r->id != e->id || e->r->lease_token != e->token)))
                FAIL("I2: id=%" PRId64 " state %d row %p", e->id, e->state, (void *)e->r);
            if (e->r != NULL && (e->released != (e->r->payload_released != 0) ||
                                 (e->released && e->state != LED_INFLIGHT)))
                FAIL("I2: id=%" PRId64 " state %d holds a row whose payload was let go",
                     e->id, e->state);
            if (e->state >= LED_OUTCOME && e->kind == SRC_SENT && !e->acked)
                FAIL("I3: id=%" PRId64 " has a SENT outcome without a confirm", e->id);
            if ((e->k == NULL) != (e->klist == KL_NONE))
                FAIL("I4: id=%" PRId64 " key list membership", e->id);
            if (e->k == NULL) {
                bool ready = e->state == LED_BUFFERED && !e->parked;
                if (ready != (e->hix != 0))
                    FAIL("I6: keyless id=%" PRId64 " heap membership %zu", e->id, e->hix);
            }
            if (e->state == LED_INFLIGHT && e->old)
                old++;
            unsettled += unsettled_sent(e);
            if (e->r != NULL)
                bytes += src_row_bytes(e->r);
        }
        if (n != l->gl[g].n)
            FAIL("I1: list %d counts %zu, holds %zu", g, l->gl[g].n, n);
        total += n;
    }
    if (total != l->ids.used)
        FAIL("I1: id table holds %zu, lists %zu", l->ids.used, total);
    if (old != l->n_old)
        FAIL("I1: %zu old rows in flight, counted %zu", old, l->n_old);
    if (unsettled != l->n_unsettled_sent)
        FAIL("I1: %zu confirmed rows unsettled, counted %zu", unsettled, l->n_unsettled_sent);
    if (bytes != l->bytes)
        FAIL("I2: rows held have %zu bytes, counted %zu", bytes, l->bytes);
    size_t nkeys = 0;
    for (size_t i = 0; i < l->keys.cap; i++) {
        const keyq *k = l->keys.s[i].p;
        if (k == NULL)
            continue;
        nkeys++;
        if (check_key(l, k, err, errlen) != 0)
            return -1;
    }
    if (nkeys != l->keys.used)
        FAIL("I1: key table counts %zu, holds %zu", l->keys.used, nkeys);
    for (size_t i = 0; i < l->heap_n; i++) {
        const led_entry *e = l->heap[i];
        if (e->hix != i + 1 || e->state != LED_BUFFERED || e->parked)
            FAIL("I6: heap slot %zu holds id=%" PRId64 " state %d", i, e->id, e->state);
        if (i > 0 && l->heap[(i - 1) / 2]->id > e->id)
            FAIL("I6: heap order broken at slot %zu", i);
    }
    if (l->ids.cap > PTAB_MIN && l->ids.used * 8 < l->ids.cap)
        FAIL("I7: id table of %zu slots for %zu rows", l->ids.cap, l->ids.used);
    return 0;
}
