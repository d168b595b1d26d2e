/*
 * drainset.h — the drains of a running relay and the configurations they run
 * on. dset_apply() installs a configuration: the first one starts a drain per
 * [outbox.*]; a later one (SIGHUP) is compared with what runs, outbox by
 * outbox, and only the differences are acted on:
 *
 *   unchanged (every key of the outbox and of its sink equal)  the drain goes on untouched
 *   removed                                                   graceful drain_stop, then freed
 *   changed (the outbox or its sink)                          graceful stop of the old drain;
 *                                                             the new one starts once it is gone
 *   added                                                     a new drain starts at once
 *
 * Every drain_new happens before anything is touched, so a failure changes
 * nothing. A drain keeps pointers into the configuration it was made from
 * (its cfg_outbox, its sink, the names its metrics carry), so each
 * configuration is reference-counted: the set and every drain made from it
 * hold a reference, and it is freed with the last one. A drain stopping after
 * a reload that has not settled within the new shutdown_timeout is freed
 * anyway (its unconfirmed rows keep their lease until it expires, as on
 * SIGTERM). Everything runs on the loop thread.
 */
#ifndef RELAY_DRAINSET_H
#define RELAY_DRAINSET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "config/cfg.h"
#include "relay/budget.h"
#include "relay/metrics.h"

struct ev_loop;
typedef struct dset dset;

#define DSET_NAMES 400   /* bytes of each list of outbox names in a dset_diff */

/* What dset_apply did: counts and comma-separated outbox names (cut with "..."). */
typedef struct dset_diff {
    size_t added, removed, restarted, unchanged;
    char   added_names[DSET_NAMES], removed_names[DSET_NAMES], restarted_names[DSET_NAMES];
} dset_diff;

dset *dset_new(struct ev_loop *loop);   /* NULL on out of memory */

/* Installs c: takes ownership of it, also on failure. Refused (-1, err) while
   dset_busy() or once dset_stop ran; on any failure nothing changed. */
int dset_apply(dset *s, cfg *c, dset_diff *diff, char *err, size_t errlen);

/* The configuration installed last (owned by the set; valid until the next apply). */
const cfg *dset_cfg(const dset *s);

/* Drains of the last apply still stopping or waiting for their predecessor: 0 once
   every outbox runs the configuration installed last. */
size_t dset_busy(const dset *s);

/* on_idle(ud) runs, from the loop, each time dset_busy() drops to 0 after an apply. */
void dset_on_idle(dset *s, void (*on_idle)(void *ud), void *ud);

/* Graceful stop of every drain (also those stopping after a reload; those waiting
   for their predecessor never start). on_stopped(ud) runs once, from the loop,
   when every drain is stopped and freed. */
void dset_stop(dset *s, void (*on_stopped)(void *ud), void *ud);

/* The metrics of the drains that run or are stopping (at most max); the pointers
   stay valid until the loop runs again. */
size_t dset_metrics(dset *s, ob_metrics **out, size_t max);
size_t dset_count(const dset *s);     /* an upper bound for dset_metrics */
const rbudget *dset_budget(const dset *s);   /* the drains' row budget */
bool   dset_ready(const dset *s);     /* every running drain is connected */

/* The largest sink connect_timeout of every configuration installed (for
   sink_ops.quiesce at exit). */
int64_t dset_connect_timeout_max(const dset *s);

void dset_free(dset *s);   /* immediate: frees every drain and configuration */

#endif
