/*
 * drainset.c — the drains of a running relay, and reload by difference
 * (drainset.h). Entries move RUNNING → STOPPING → STOPPED → freed; a changed
 * outbox's new drain waits (WAITING) until its predecessor is freed, so the
 * two never hold rows of one outbox at once. Entries are freed and successors
 * started from the `reap` timer, never inside a drain's own callback.
 */
#include "relay/drainset.h"

#include <ev.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "relay/drain.h"
#include "relay/log.h"

/* A configuration and the number of holders (the set, and each entry made from it). */
typedef struct cfgref {
    cfg     *c;
    unsigned refs;
} cfgref;

enum { E_RUNNING, E_STOPPING, E_STOPPED, E_WAITING };

typedef struct dentry {
    struct dset      *set;
    drain            *d;
    cfgref           *ref;        /* the configuration d was made from (one reference) */
    const cfg_outbox *ob;         /* points into ref->c */
    int               state;
    struct dentry    *next_gen;   /* WAITING: started once this entry is freed */
    struct dentry    *prev_gen;   /* the entry this one waits for */
    ev_timer          force;      /* stopping after a reload: freed anyway when it fires */
} dentry;

struct dset {
    struct ev_loop *loop;
    cfgref         *cur;          /* installed last (one reference) */
    dentry        **v;
    size_t          n, cap;
    bool            stopping;     /* dset_stop ran */
    bool            stop_reported;
    bool            was_busy;     /* an apply left drains stopping or waiting */
    void          (*on_stopped)(void *ud);
    void           *stop_ud;
    void          (*on_idle)(void *ud);
    void           *idle_ud;
    int64_t         connect_timeout_max;
    rbudget         budget;       /* rows in memory, shared by every drain */
    ev_timer        reap;         /* frees stopped entries, starts their successors */
};

static void cfgref_release(cfgref *r)
{
    if (r != NULL && --r->refs == 0) {
        cfg_free(r->c);
        free(r);
    }
}

static void schedule_reap(dset *s)
{
    if (!ev_is_active(&s->reap)) {
        ev_timer_set(&s->reap, 0., 0.);
        ev_timer_start(s->loop, &s->reap);
    }
}

static void entry_free(dentry *e)
{
    ev_timer_stop(e->set->loop, &e->force);
    drain_free(e->d);
    cfgref_release(e->ref);
    free(e);
}

/* drain_stop's callback: runs inside the drain's own callback chain, so only mark. */
static void entry_stopped(void *ud)
{
    dentry *e = ud;
    if (e->state == E_STOPPING) {
        e->state = E_STOPPED;
        ev_timer_stop(e->set->loop, &e->force);
        schedule_reap(e->set);
    }
}

static void force_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    dentry *e = w->data;
    if (e->state != E_STOPPING)
        return;
    ob_metrics *m = drain_metrics(e->d);
    log_ev(LOG_WARN, &(log_fields){ .event = "stop_forced", .outbox = e->ob->name },
           "outbox=%s: not drained within shutdown_timeout after the reload; closing "
           "its connections: %llu message(s) still unconfirmed keep their lease until it "
           "expires and are published again (same message_id)", e->ob->name,
           (unsigned long long)(m->in_flight + m->unmarked));
    e->state = E_STOPPED;
    schedule_reap(e->set);
}

/* Graceful stop of a running entry; after a reload bounded by timeout_s (< 0: none). */
static void entry_retire(dentry *e, double timeout_s)
{
    e->state = E_STOPPING;
    if (timeout_s >= 0) {
        ev_timer_set(&e->force, timeout_s, 0.);
        ev_timer_start(e->set->loop, &e->force);
    }
    drain_stop(e->d, entry_stopped, e);
}

static void reap_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    dset *s = w->data;
    size_t k = 0;
    for (size_t i = 0; i < s->n; i++) {
        dentry *e = s->v[i];
        if (e->state != E_STOPPED) {
            s->v[k++] = e;
            continue;
        }
        dentry *next = e->next_gen;
        if (next != NULL) {
            next->prev_gen = NULL;
            if (!s->stopping) {
                next->state = E_RUNNING;
                drain_start(next->d);
            } else {
                next->state = E_STOPPED;   /* never started; freed by the next reap */
                schedule_reap(s);
            }
        }
        entry_free(e);
    }
    s->n = k;
    if (s->stopping) {
        if (s->n == 0 && !s->stop_reported) {
            s->stop_reported = true;
            if (s->on_stopped != NULL)
                s->on_stopped(s->stop_ud);   /* last: it may end the loop */
        }
        return;
    }
    if (s->was_busy && dset_busy(s) == 0) {
        s->was_busy = false;
        if (s->on_idle != NULL)
            s->on_idle(s->idle_ud);          /* last: it may call dset_apply */
    }
}

dset *dset_new(struct ev_loop *loop)
{
    dset *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    s->loop = loop;
    rbudget_init(&s->budget, 0);   /* set by each apply */
    ev_timer_init(&s->reap, reap_cb, 0., 0.);
    s->reap.data = s;
    return s;
}

static dentry *find_running(dset *s, const char *name)
{
    for (size_t i = 0; i < s->n; i++)
        if (s->v[i]->state == E_RUNNING && strcmp(s->v[i]->ob->name, name) == 0)
            return s->v[i];
    return NULL;
}

/* Appends name (at most 63 bytes: cfg.c) to a comma-separated list; once the list
   is nearly full it ends with ", ..." instead. */
static void add_name(char *list, size_t size, const char *name)
{
    size_t len = strlen(list);
    if (len + 2 + strlen(name) + 6 > size) {
        if (len + 6 <= size && (len < 5 || strcmp(list + len - 5, ", ...") != 0))
            snprintf(list + len, size - len, ", ...");
        return;
    }
    snprintf(list + len, size - len, "%s%s", len ? ", " : "", name);
}

int dset_apply(dset *s, cfg *c, dset_diff *df, char *err, size_t errlen)
{
    dset_diff local;
    if (df == NULL)
        df = &local;
    memset(df, 0, sizeof *df);
    if (s->stopping || dset_busy(s) > 0) {
        snprintf(err, errlen, "%s", s->stopping ? "the relay is stopping"
                 : "the previous reload is still in progress");
        cfg_free(c);
        return -1;
    }
    size_t no = c->n_outboxes;
    cfgref *ref = calloc(1, sizeof *ref);
    dentry **fresh = calloc(no ? no : 1, sizeof *fresh);   /* new entries, by outbox */
    dentry **match = calloc(no ? no : 1, sizeof *match);   /* the running entry of its name */
    dentry **nv = NULL;
    if (ref == NULL || fresh == NULL || match == NULL) {
        snprintf(err, errlen, "out of memory");
        free(ref);
        ref = NULL;
        cfg_free(c);
        goto fail;
    }
    ref->c = c;
    ref->refs = 1;   /* this function's, handed to s->cur on success */
    if (s->n + no > s->cap) {
        size_t cap = s->n + no;
        nv = realloc(s->v, cap * sizeof *nv);
        if (nv == NULL) {
            snprintf(err, errlen, "out of memory");
            goto fail;
        }
        s->v = nv;
        s->cap = cap;
    }
    for (size_t i = 0; i < no; i++) {
        const cfg_outbox *ob = &c->outboxes[i];
        match[i] = find_running(s, ob->name);
        if (match[i] != NULL && cfg_outbox_equal(match[i]->ob, ob))
            continue;
        dentry *e = calloc(1, sizeof *e);
        if (e == NULL) {
            snprintf(err, errlen, "outbox=%s: out of memory", ob->name);
            goto fail;
        }
        e->d = drain_new(s->loop, c, ob, &s->budget, err, errlen);
        if (e->d == NULL) {
            free(e);
            goto fail;
        }
        e->set = s;
        e->ob = ob;
        e->ref = ref;
        ref->refs++;
        ev_timer_init(&e->force, force_cb, 0., 0.);
        e->force.data = e;
        fresh[i] = e;
    }

    /* commit: nothing below fails */
    rbudget_set_limit(&s->budget, cfg_max_rows_in_memory(c));
    rbudget_set_byte_limit(&s->budget, c->relay.max_bytes_in_memory);
    double timeout_s = (double)c->relay.shutdown_timeout_ms / 1000.0;
    for (size_t j = 0; j < s->n; j++) {
        dentry *e = s->v[j];
        bool kept = false;
        for (size_t i = 0; i < no && !kept; i++)
            kept = match[i] == e;
        if (!kept && e->state == E_RUNNING) {
            df->removed++;
            add_name(df->removed_names, sizeof df->removed_names, e->ob->name);
            entry_retire(e, timeout_s);
        }
    }
    for (size_t i = 0; i < no; i++) {
        dentry *e = fresh[i];
        if (e == NULL) {
            df->unchanged++;
            continue;
        }
        if (match[i] != NULL) {
            df->restarted++;
            add_name(df->restarted_names, sizeof df->restarted_names, e->ob->name);
            e->state = E_WAITING;
            e->prev_gen = match[i];
            match[i]->next_gen = e;
            entry_retire(match[i], timeout_s);
        } else {
            df->added++;
            add_name(df->added_names, sizeof df->added_names, e->ob->name);
            e->state = E_RUNNING;
            drain_start(e->d);
        }
        s->v[s->n++] = e;   /* room reserved above */
    }
    for (size_t i = 0; i < c->n_sinks; i++)
        if (c->sinks[i].connect_timeout_ms > s->connect_timeout_max)
            s->connect_timeout_max = c->sinks[i].connect_timeout_ms;
    cfgref_release(s->cur);
    s->cur = ref;
    s->was_busy = dset_busy(s) > 0;
    free(fresh);
    free(match);
    return 0;

fail:
    for (size_t i = 0; fresh != NULL && i < no; i++)
        if (fresh[i] != NULL)
            entry_free(fresh[i]);   /* never started: nothing to settle */
    cfgref_release(ref);   /* the last reference: frees c */
    free(fresh);
    free(match);
    return -1;
}

const cfg *dset_cfg(const dset *s)
{
    return s->cur != NULL ? s->cur->c : NULL;
}

size_t dset_busy(const dset *s)
{
    size_t n = 0;
    for (size_t i = 0; i < s->n; i++)
        if (s->v[i]->state != E_RUNNING)
            n++;
    return n;
}

void dset_on_idle(dset *s, void (*on_idle)(void *ud), void *ud)
{
    s->on_idle = on_idle;
    s->idle_ud = ud;
}

void dset_stop(dset *s, void (*on_stopped)(void *ud), void *ud)
{
    s->on_stopped = on_stopped;
    s->stop_ud = ud;
    if (s->stopping)
        return;
    s->stopping = true;
    for (size_t i = 0; i < s->n; i++) {
        dentry *e = s->v[i];
        if (e->state == E_RUNNING) {
            entry_retire(e, -1.);     /* bounded by main's shutdown timer */
        } else if (e->state == E_WAITING) {
            if (e->prev_gen != NULL)
                e->prev_gen->next_gen = NULL;
            e->prev_gen = NULL;
            e->state = E_STOPPED;     /* never started */
        }
    }
    schedule_reap(s);
}

size_t dset_metrics(dset *s, ob_metrics **out, size_t max)
{
    size_t k = 0;
    for (size_t i = 0; i < s->n && k < max; i++)
        if (s->v[i]->state != E_WAITING)
            out[k++] = drain_metrics(s->v[i]->d);
    return k;
}

const rbudget *dset_budget(const dset *s)
{
    return &s->budget;
}

size_t dset_count(const dset *s)
{
    return s->n;
}

bool dset_ready(const dset *s)
{
    for (size_t i = 0; i < s->n; i++)
        if (s->v[i]->state == E_RUNNING && !drain_ready(s->v[i]->d))
            return false;
    return true;
}

int64_t dset_connect_timeout_max(const dset *s)
{
    return s->connect_timeout_max;
}

void dset_free(dset *s)
{
    if (s == NULL)
        return;
    ev_timer_stop(s->loop, &s->reap);
    for (size_t i = 0; i < s->n; i++)
        entry_free(s->v[i]);
    free(s->v);
    cfgref_release(s->cur);
    free(s);
}
