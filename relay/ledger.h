/*
 * ledger.h — the life of every row one drain holds, from claim to settled.
 *
 * The ledger is pure bookkeeping: no database or broker I/O (it only logs),
 * no clock of its own (callers pass `now`, a monotonic time in seconds), no
 * libev. relay/drain.c wires it to a
 * source, a sink and timers; tests/c/ledger_test.c drives it through scripted
 * and seeded random event orders against a fake database and a fake broker.
 *
 * A row's states (led_state):
 *
 *   claim ──► BUFFERED ──publish──► INFLIGHT ──ack──► OUTCOME(SENT) ─┐
 *               ▲  │ (refused,        │ refused / nack / return       │
 *               │  │  expired, stop)  ▼                               ▼
 *               │  └──────────► OUTCOME(RETRY|DEAD|UNCLAIM) ──► SETTLING ──► freed
 *               └─── lost (connection or channel) ◄┘                  │  ▲
 *                                                                     ▼  │ claim returns
 *                                       (a claim is running) LINGER ─────┘
 *
 * OUTCOME: decided, waiting for the next settle request; SETTLING: in the
 * outstanding settle; LINGER: settled while a claim was running — kept until
 * that claim returns, because the claim may have read the table before the
 * settle committed (it may have re-leased the row, or claimed later rows of a
 * failed row's key). A row's payload is freed as soon as its outcome is known, and a
 * large one already once the sink has written it (ledger_written).
 *
 * See ledger.c for the invariants, checked by ledger_check().
 */
#ifndef RELAY_LEDGER_H
#define RELAY_LEDGER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "relay/row.h"
#include "relay/sink.h"
#include "relay/source.h"

typedef struct ledger ledger;
typedef struct led_entry led_entry;

enum led_state { LED_BUFFERED = 1, LED_INFLIGHT, LED_OUTCOME, LED_SETTLING, LED_LINGER };

/* Why a row failed before or without being in flight (ledger_refused). */
enum led_refusal {
    LED_REFUSED = 1,    /* the broker would refuse it now (missing exchange): an attempt */
    LED_UNPUBLISHABLE   /* can never be published (malformed, too large): dead-letter now */
};

typedef struct ledger_cfg {
    const char *outbox;         /* for log lines (borrowed) */
    int         max_attempts;   /* failed attempts before a row is dead-lettered */
    int64_t     backoff_ms;     /* first retry delay, doubled per attempt */
    int64_t     backoff_max_ms;
    bool        strict;         /* at most one message in flight per partition key */
    double      cautious_s;     /* after a refusal towards a destination, keys publish
                                   one at a time there for this long (0: 30 s) */
} ledger_cfg;

typedef struct ledger_stats {
    uint64_t relayed;       /* SENT outcomes settled */
    uint64_t failed;        /* failed attempts: returned + nacked + rejected + refused */
    uint64_t returned, nacked, rejected, refused;
    uint64_t dead;          /* dead-letter outcomes decided */
    uint64_t given_back;    /* in flight when a connection or channel was lost */
    uint64_t republished;   /* of those, published again from the ledger (lease kept) */
    uint64_t released;      /* in-flight rows whose payload was freed once written */
    uint64_t expired;       /* buffered past their lease deadline: given back unpublished */
    uint64_t overtaken;     /* a later row of a key was (or may have been: its confirm was lost)
                               accepted while an earlier one was refused */
    uint64_t lease_lost;    /* settled outcomes whose token no longer matched */
    uint64_t readopted;     /* rows a claim leased again while we held them */
} ledger_stats;

/* NULL when out of memory. cfg is copied (cfg->outbox stays borrowed). */
ledger *ledger_new(const ledger_cfg *lc);
/* Frees everything, rows included. */
void    ledger_free(ledger *l);

/* --- claims: at most one runs at a time --- */
void    ledger_claim_started(ledger *l);
/* The claim returned rows[0..n) in id order, leased until `deadline` (the
 * caller's monotonic view: send time + lease - margin). Takes ownership of each
 * row (not of the array). Rows already held adopt the new token; rows of a key
 * blocked behind an earlier failed row are given back. */
void    ledger_claimed(ledger *l, row **rows, size_t n, double deadline);
void    ledger_claim_failed(ledger *l);
/* Up to max ids, into out, of the rows held under a lease that is ours and still live at
 * `now` (src_claim_args.held): buffered, in flight, or confirmed and waiting for their
 * mark. Returns how many. */
size_t  ledger_held_ids(const ledger *l, double now, int64_t *out, size_t max);

/* --- publishing --- */
/* The next row to publish (lowest id among those allowed now), or NULL. Rows
 * whose deadline has passed are given back on the way. The entry stays next
 * until one of published / wait / refused is called for it. */
led_entry  *ledger_next(ledger *l, double now);
/* Gives back (UNCLAIM) every buffered row, parked ones included, whose deadline has
 * passed, whether or not anything can be published now (the sink down, leadership
 * lapsed): their bytes and rows are released. Returns how many were given back. */
size_t      ledger_expire(ledger *l, double now);
/* The earliest deadline of the buffered rows (monotonic), 0 when none is buffered. */
double      ledger_first_deadline(const ledger *l);
const row  *ledger_row(const led_entry *e);
int64_t     ledger_id(const led_entry *e);
double      ledger_published_at(const led_entry *e);
void    ledger_published(ledger *l, led_entry *e, double now);
/* The sink has written the in-flight row whole and reads its payload no more: a payload
 * held apart from the row (ROW_APART_MIN bytes or more) is freed and stops counting in
 * ledger_bytes. When such a row is lost (SINK_LOST) it is given back to the table instead
 * of being republished from memory. */
void    ledger_written(ledger *l, led_entry *e);
/* The sink is checking the row's destination: set it (and its key) aside
 * until ledger_unpark(). */
void    ledger_wait(ledger *l, led_entry *e);
void    ledger_unpark(ledger *l);
/* The sink refused the row before sending it; reason is copied. */
void    ledger_refused(ledger *l, led_entry *e, enum led_refusal why, const char *reason,
                       double now);
/* The sink's final result for an in-flight row. */
void    ledger_result(ledger *l, led_entry *e, enum sink_outcome sink_outcome, const char *reason,
                      double now);

/* --- settles: at most one runs at a time --- */
/* Moves every decided outcome into the settle; *v (owned by the ledger, valid
 * until ledger_settle_done) gets them. Returns their number (0: nothing to do). */
size_t  ledger_settle_begin(ledger *l, const src_outcome **v);
/* ok: the settle committed; n_applied outcomes still matched their token. */
void    ledger_settle_done(ledger *l, bool ok, size_t n_applied);

/* --- whole-ledger events --- */
/* Stop: every buffered row is given back (UNCLAIM). */
void    ledger_giveback_buffered(ledger *l);
/* Leadership or the claiming session is gone: forget buffered rows without an
 * outcome (their leases expire or a new leader resets them); in-flight rows are
 * marked old: when lost they are given back instead of republished. */
void    ledger_drop_buffered(ledger *l);

/* --- counts --- */
size_t  ledger_n_buffered(const ledger *l);   /* rows held unpublished (incl. waiting) */
size_t  ledger_n_inflight(const ledger *l);
size_t  ledger_bytes(const ledger *l);        /* src_row_bytes of the BUFFERED and INFLIGHT rows */
size_t  ledger_n_old(const ledger *l);        /* in flight since before ledger_drop_buffered */
size_t  ledger_n_pending(const ledger *l);    /* outcomes waiting for a settle */
size_t  ledger_n_outcomes(const ledger *l);   /* OUTCOME + SETTLING + LINGER */
size_t  ledger_n_held(const ledger *l);       /* every entry */
size_t  ledger_n_keys(const ledger *l);
/* Confirmed rows whose SENT mark has not committed yet: published but not marked. */
size_t  ledger_n_unsettled_sent(const ledger *l);
const ledger_stats *ledger_get_stats(const ledger *l);

/* Checks every invariant of ledger.c; 0, or -1 with the first violation in err. */
int     ledger_check(const ledger *l, char *err, size_t errlen);

#endif
