/*
 * budget.c — the process-wide row budget of the drains (budget.h).
 *
 * A waiting member stays counted as busy after it is woken, until it asks
 * again (rbudget_avail, then rbudget_hold or rbudget_wait) or gives up
 * (rbudget_unwait): otherwise a releasing drain, seeing one busy member fewer,
 * could take the released rows back before the woken one runs.
 */
#include "relay/budget.h"

#include <stdint.h>

static bool is_busy(const rb_member *m)
{
    return m->held > 0 || m->held_bytes > 0 || m->waiting;
}

static void set_member(rbudget *b, rb_member *m, size_t held, size_t held_bytes, bool waiting)
{
    bool was = is_busy(m);
    b->used = b->used - m->held + held;
    b->used_bytes = b->used_bytes - m->held_bytes + held_bytes;
    b->n_waiting = b->n_waiting - (m->waiting ? 1 : 0) + (waiting ? 1 : 0);
    m->held = held;
    m->held_bytes = held_bytes;
    m->waiting = waiting;
    bool now = is_busy(m);
    if (now && !was)
        b->n_busy++;
    else if (was && !now)
        b->n_busy--;
}

static void wake_waiting(rbudget *b)
{
    if (b->n_waiting == 0)
        return;
    for (rb_member *m = b->head; m != NULL; m = m->next)
        if (m->waiting && m->wake != NULL)
            m->wake(m->ud);    /* schedules its drain's next look: never re-enters */
}

/* The whole turn is free again: wake those refused it. */
static void whole_free(rbudget *b)
{
    b->whole = NULL;
    for (rb_member *m = b->head; m != NULL; m = m->next) {
        if (!m->whole_wait)
            continue;
        m->whole_wait = false;
        if (m->wake != NULL)
            m->wake(m->ud);
    }
}

/* m's turn ends once its claim was answered and the process is within the limit, or
   once m holds nothing (also a claim never sent) */
static void whole_check(rbudget *b, rb_member *m)
{
    if (b->whole != m)
        return;
    if (m->held_bytes == 0 ||
        (!m->whole_claiming && (b->limit_bytes == 0 || b->used_bytes <= b->limit_bytes))) {
        m->whole_claiming = false;
        whole_free(b);
    }
}

void rbudget_init(rbudget *b, size_t limit)
{
    *b = (rbudget){ .limit = limit };
}

void rbudget_set_limit(rbudget *b, size_t limit)
{
    b->limit = limit;
    wake_waiting(b);
}

void rbudget_set_byte_limit(rbudget *b, size_t limit_bytes)
{
    b->limit_bytes = limit_bytes;
    wake_waiting(b);
}

void rbudget_join(rbudget *b, rb_member *m, void (*wake)(void *ud), void *ud)
{
    *m = (rb_member){ .next = b->head, .wake = wake, .ud = ud };
    if (b->head != NULL)
        b->head->prev = m;
    b->head = m;
}

void rbudget_leave(rbudget *b, rb_member *m)
{
    bool released = m->held > 0 || m->held_bytes > 0;
    set_member(b, m, 0, 0, false);
    m->whole_wait = m->whole_claiming = false;
    if (b->whole == m)
        whole_free(b);
    if (m->prev != NULL)
        m->prev->next = m->next;
    else
        b->head = m->next;
    if (m->next != NULL)
        m->next->prev = m->prev;
    m->prev = m->next = NULL;
    if (released)
        wake_waiting(b);
}

/* m's equal part of limit among the outboxes that hold something (m asking counts); at
   least 1: with more drains than units, one each, and the sum may pass the limit */
static size_t share_of(const rbudget *b, const rb_member *m, size_t limit)
{
    if (limit == 0)
        return SIZE_MAX;
    size_t busy = b->n_busy + (is_busy(m) ? 0 : 1);
    size_t share = limit / busy;
    return share > 0 ? share : 1;
}

/* what m may still take: what its share leaves, within what the limit leaves */
static size_t avail_of(size_t limit, size_t used, size_t held, size_t share)
{
    if (limit == 0)
        return SIZE_MAX;
    size_t mine = share > held ? share - held : 0;
    size_t left = limit > used ? limit - used : 0;
    return mine < left ? mine : left;
}

size_t rbudget_share(const rbudget *b, const rb_member *m)
{
    return share_of(b, m, b->limit);
}

size_t rbudget_avail(const rbudget *b, const rb_member *m)
{
    size_t share = rbudget_share(b, m);
    size_t avail = avail_of(b->limit, b->used, m->held, share);
    if (avail == 0 && b->limit != 0 && b->used >= b->limit && m->held == 0 && share == 1)
        return 1;        /* the one-row floor of a share */
    return avail;
}

void rbudget_wait(rbudget *b, rb_member *m)
{
    set_member(b, m, m->held, m->held_bytes, true);
}

void rbudget_unwait(rbudget *b, rb_member *m)
{
    if (m->waiting)
        set_member(b, m, m->held, m->held_bytes, false);
}

void rbudget_hold(rbudget *b, rb_member *m, size_t n, size_t bytes)
{
    bool released = n < m->held || bytes < m->held_bytes;
    bool grew = n > m->held || bytes > m->held_bytes;
    set_member(b, m, n, bytes, grew ? false : m->waiting);
    whole_check(b, m);
    if (b->whole != NULL && b->whole != m)
        whole_check(b, b->whole);     /* the process may be back within the limit */
    if (released)
        wake_waiting(b);
}

void rbudget_claim_done(rbudget *b, rb_member *m)
{
    m->whole_claiming = false;
    whole_check(b, m);
}

size_t rbudget_share_bytes(const rbudget *b, const rb_member *m)
{
    return share_of(b, m, b->limit_bytes);
}

size_t rbudget_avail_bytes(const rbudget *b, const rb_member *m)
{
    return avail_of(b->limit_bytes, b->used_bytes, m->held_bytes, rbudget_share_bytes(b, m));
}

size_t rbudget_claim_bytes(rbudget *b, rb_member *m, size_t held, bool *first_whole)
{
    *first_whole = held == 0;
    if (b->limit_bytes == 0)
        return SIZE_MAX;
    size_t share = rbudget_share_bytes(b, m);
    size_t avail = rbudget_avail_bytes(b, m);
    size_t chunk = share / 2 > 0 ? share / 2 : 1;
    size_t quarter = share / 4 > 0 ? share / 4 : 1;
    if (held == 0 && avail > 0) {
        if (b->whole == NULL || b->whole == m) {
            b->whole = m;                       /* its first row comes whatever its size */
            m->whole_claiming = true;
            m->whole_wait = false;
        } else {
            *first_whole = false;               /* another's turn: within what is left */
            m->whole_wait = true;
        }
        return avail < chunk ? avail : chunk;
    }
    *first_whole = false;
    if (held > 0 && avail >= quarter)
        return avail < chunk ? avail : chunk;
    /* holding rows with less than a quarter of its share free (claim again once a good
       part of it is published), or nothing free at all: wait until bytes are released */
    rbudget_wait(b, m);
    return 0;
}

size_t rbudget_claim_size(rbudget *b, rb_member *m, size_t used, size_t own, size_t batch)
{
    if (used >= own) {
        rbudget_unwait(b, m);
        return 0;
    }
    size_t room = own - used;
    size_t share = rbudget_share(b, m);
    size_t avail = rbudget_avail(b, m);
    if (share < own && batch > share / 2)
        batch = share / 2 > 0 ? share / 2 : 1;
    bool budgeted = avail < room;
    if (budgeted)
        room = avail;
    if (room == 0 || (used > 0 && room < batch)) {   /* wait for a whole batch */
        if (budgeted)
            rbudget_wait(b, m);
        else
            rbudget_unwait(b, m);
        return 0;
    }
    return room < batch ? room : batch;
}
