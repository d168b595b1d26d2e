/*
 * drain.h — the relay core: one drain per [outbox.*] section moves committed
 * rows from its source to its own sink connection. It never names a database
 * or a broker; it drives source_ops and sink_ops on the shared libev loop.
 *
 * Rules it keeps (README.md, "Running the relay"), through the ledger (relay/ledger.c, where the
 * invariants are written down and checked):
 *  - a row is settled SENT only after the sink's ACK, by id and lease token;
 *  - rows of one partition key reach the broker in id order; several may be in
 *    flight at once towards one destination (ordering = strict: one); a failed
 *    row holds back the later rows of its key until its outcome has committed;
 *    other keys keep flowing;
 *  - no row is published past its lease deadline;
 *  - memory is bounded by publish_window + 2 x batch_size rows, not by the backlog,
 *    and every drain of the process shares max_rows_in_memory (relay/budget.h).
 */
#ifndef RELAY_DRAIN_H
#define RELAY_DRAIN_H

#include <stdbool.h>
#include "config/cfg.h"
#include "relay/budget.h"
#include "relay/metrics.h"

struct ev_loop;
typedef struct drain drain;

/* Creates the drain and its source and sink (not started); it takes part in budget
   (which must outlive it). NULL + err on failure. */
drain *drain_new(struct ev_loop *loop, const cfg *c, const cfg_outbox *ob, rbudget *budget,
                 char *err, size_t errlen);
void   drain_start(drain *d);
/* Graceful stop: no more claims, give back unpublished rows, wait for in-flight
   confirms and settle them. on_stopped(ud) runs once when nothing is left. */
void   drain_stop(drain *d, void (*on_stopped)(void *ud), void *ud);
void   drain_free(drain *d);     /* immediate: closes connections */
bool   drain_ready(const drain *d);
ob_metrics *drain_metrics(drain *d);

#endif
