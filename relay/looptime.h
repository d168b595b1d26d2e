/*
 * looptime.h — the event loop times its own turns.
 *
 * A turn is the loop's work between waking (its poll returned) and going back to wait:
 * every callback it runs in between. Two watchers mark it: an ev_check, run first after
 * the poll, and an ev_prepare, run last before the next poll. Each turn is timed in wall
 * time (CLOCK_MONOTONIC) and in the loop thread's CPU time (CLOCK_THREAD_CPUTIME_ID,
 * which other load on the machine inflates far less than wall time), into the histograms
 * of a loop_metrics (relay/metrics.h). A turn longer than LOOPTIME_WARN_S of wall time
 * is logged at WARN (event loop_blocked), at most once per LOOPTIME_WARN_EVERY_S; the
 * turns not logged are counted on the next line.
 *
 * Cost per turn: two watchers, two reads of the monotonic clock (no system call) and one of
 * the thread's CPU clock (a system call): a turn's CPU time runs from the end of the turn
 * before, since the thread spends next to none asleep in the poll. Loop thread only.
 *
 *   looptime lt;
 *   looptime_start(&lt, loop, &rm.loop);
 *   ev_run(loop, 0);
 *   looptime_stop(&lt);
 */
#ifndef RELAY_LOOPTIME_H
#define RELAY_LOOPTIME_H

#include <ev.h>
#include <stdbool.h>

#include "relay/metrics.h"

#define LOOPTIME_WARN_S       1.0  /* wall seconds: a turn this long is logged at WARN */
#define LOOPTIME_WARN_EVERY_S 60.0 /* at most one such line per this many seconds */

typedef struct looptime {
    struct ev_loop *loop;
    ev_check check;
    ev_prepare prepare;
    loop_metrics *out;      /* borrowed: where the turns are counted */
    bool in_turn;           /* a check ran and its prepare has not yet */
    double wall0;           /* monotonic time the turn began */
    double cpu0;            /* thread CPU seconds when the last turn ended; -1 unknown */
    double warned_at;       /* monotonic time of the last WARN, 0: none yet */
    unsigned long unlogged; /* long turns since then not logged */
    double unlogged_max;    /* the longest of them, wall seconds */
} looptime;

/* Starts timing the turns of loop into out (which outlives lt's watchers). */
void looptime_start(looptime *lt, struct ev_loop *loop, loop_metrics *out);
/* Stops the watchers; a turn in progress is not counted. */
void looptime_stop(looptime *lt);

#endif
