/*
 * budget.h — the rows every drain of one process holds in memory, within
 * [relay] max_rows_in_memory, and their bytes (payload + headers, src_row_bytes),
 * within [relay] max_bytes_in_memory.
 *
 * A drain holds at most publish_window + 2 x batch_size rows of its own
 * (claimed and buffered, or in flight). With many outboxes in one process that
 * alone lets memory grow with the number of outboxes; the budget caps the sum.
 * A drain asks before each claim (rbudget_avail) and reports what it holds
 * after every change (rbudget_hold), a running claim's requested rows
 * included, so the sum never exceeds the limit.
 *
 * Bytes are budgeted the same way, next to the rows: a claim asks the database
 * for no more bytes than the drain may take (rbudget_claim_bytes), and reports
 * the bytes asked for while it runs. Its first row comes whatever its size when
 * the drain holds nothing (a row larger than the whole budget goes through,
 * alone), so the bytes held may pass the limit by that one row — one such claim
 * in the whole process at a time (the "whole" turn): a drain that holds nothing
 * while another has the turn claims within what is left, and is woken when the
 * turn is free again. The turn is given back once the claim's answer has come and
 * the process holds no more than the limit, or the drain holds nothing.
 *
 * Fair shares: a drain may hold at most limit / (the drains that hold rows or
 * wait for room), in rows and in bytes. One busy outbox among idle ones gets all of it; fifty busy
 * ones get a fiftieth each. A drain refused room waits and is woken (its wake
 * callback, from the releasing drain's call) once rows are released.
 * Everything runs on the loop thread.
 */
#ifndef RELAY_BUDGET_H
#define RELAY_BUDGET_H

#include <stdbool.h>
#include <stddef.h>

typedef struct rb_member {
    struct rb_member *prev, *next;
    size_t held;          /* rows held, or asked for by a running claim */
    size_t held_bytes;    /* their bytes, or the bytes a running claim asked for */
    bool   waiting;       /* refused room: woken when rows are released */
    bool   whole_wait;    /* refused the whole turn: woken when it is free */
    bool   whole_claiming;    /* has the turn, its claim not answered yet */
    void (*wake)(void *ud);
    void  *ud;
} rb_member;

typedef struct rbudget {
    size_t     limit;     /* 0: no process-wide limit */
    size_t     used;      /* the members' held rows */
    size_t     limit_bytes;   /* 0: no process-wide byte limit */
    size_t     used_bytes;    /* the members' held bytes */
    size_t     n_busy;    /* members holding rows or waiting */
    size_t     n_waiting;
    rb_member *whole;     /* the member whose claim's first row may come whatever its
                             size (one at a time), NULL: none */
    rb_member *head;
} rbudget;

void   rbudget_init(rbudget *b, size_t limit);
void   rbudget_set_limit(rbudget *b, size_t limit);   /* a reload; wakes the waiting */
void   rbudget_set_byte_limit(rbudget *b, size_t limit_bytes);   /* likewise */
void   rbudget_join(rbudget *b, rb_member *m, void (*wake)(void *ud), void *ud);
void   rbudget_leave(rbudget *b, rb_member *m);       /* releases what m held */

/* What m may hold in all now (its fair share, within what the others leave):
   SIZE_MAX without a limit. */
size_t rbudget_share(const rbudget *b, const rb_member *m);
/* How many more rows m may take now (0: none). */
size_t rbudget_avail(const rbudget *b, const rb_member *m);
/* m could not take the rows it needs: it counts as busy (the others' shares
   shrink) and is woken once rows are released. */
void   rbudget_wait(rbudget *b, rb_member *m);
/* m no longer needs rows (it stopped asking). */
void   rbudget_unwait(rbudget *b, rb_member *m);
/* m now holds n rows of `bytes` bytes. */
void   rbudget_hold(rbudget *b, rb_member *m, size_t n, size_t bytes);
/* What m may hold in bytes in all now (its fair share): SIZE_MAX without a limit. */
size_t rbudget_share_bytes(const rbudget *b, const rb_member *m);
/* How many more bytes m may take now (0: none); SIZE_MAX without a limit. */
size_t rbudget_avail_bytes(const rbudget *b, const rb_member *m);

/* The rows a drain may claim now: it holds `used` of its own bound `own`
   (publish_window + 2 x batch_size) and claims whole batches while it holds
   rows (a claim costs about the same for 100 rows as for 500), up to half its
   fair share at a time when that share is smaller than `own`. 0: not now —
   when the budget is why, m waits for a wake-up (rbudget_wait). A drain that
   claims reports the rows asked for with rbudget_hold before the claim runs. */
size_t rbudget_claim_size(rbudget *b, rb_member *m, size_t used, size_t own, size_t batch);

/* The bytes a claim of m may ask for now, m holding `held` bytes: up to half its
   fair share at a time (the rest publishes while the claim runs), within what is left;
   while m holds rows, only once a quarter of its share is free (a claim of a few rows
   costs the database about as much as one of many; asking again only at half a share
   free kept at most half of it in flight while the claim ran). 0: not now, and m waits
   for a wake-up (rbudget_wait). SIZE_MAX: no byte limit. *first_whole says whether the
   claim's first row may come whatever its size: only when m holds nothing, so a row
   larger than the budget goes through alone, and
   only for one member of the process at a time (m takes the turn; refused, m is woken
   when it is free). */
size_t rbudget_claim_bytes(rbudget *b, rb_member *m, size_t held, bool *first_whole);
/* m's claim was answered (rows or a failure) and m has reported what it holds
   (rbudget_hold): a turn it had ends unless the process holds more than the limit,
   then once it does not, or once m holds nothing. */
void   rbudget_claim_done(rbudget *b, rb_member *m);

#endif
