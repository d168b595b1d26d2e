/* looptime.c — times each turn of the event loop (see looptime.h). */
#include "relay/looptime.h"

#include <time.h>

#include "relay/log.h"

static double clock_s(clockid_t id)
{
    struct timespec ts;
    if (clock_gettime(id, &ts) != 0)
        return -1;
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Run first once the loop wakes: the turn begins. Its CPU time is counted from the last
   turn's end (the thread slept in the poll since then, spending next to none), so a turn
   reads the thread's CPU clock, a system call, once. */
static void check_cb(struct ev_loop *loop, ev_check *w, int revents)
{
    (void)loop;
    (void)revents;
    looptime *lt = w->data;
    lt->wall0 = clock_s(CLOCK_MONOTONIC);
    lt->in_turn = lt->wall0 >= 0 && lt->cpu0 >= 0;
}

static void blocked(looptime *lt, double now, double wall, double cpu)
{
    lt->out->blocked++;
    if (lt->warned_at != 0 && now - lt->warned_at < LOOPTIME_WARN_EVERY_S) {
        lt->unlogged++;
        if (wall > lt->unlogged_max)
            lt->unlogged_max = wall;
        return;
    }
    if (lt->unlogged > 0)
        log_ev(LOG_WARN, &(log_fields){ .event = "loop_blocked" },
               "the event loop was blocked %.0f ms (%.0f ms of CPU): probes and other "
               "outboxes waited; %lu more such turn(s) in the last %.0f s, the longest %.0f ms",
               wall * 1000, cpu * 1000, lt->unlogged, now - lt->warned_at, lt->unlogged_max * 1000);
    else
        log_ev(LOG_WARN, &(log_fields){ .event = "loop_blocked" },
               "the event loop was blocked %.0f ms (%.0f ms of CPU): probes and other "
               "outboxes waited",
               wall * 1000, cpu * 1000);
    lt->warned_at = now;
    lt->unlogged = 0;
    lt->unlogged_max = 0;
}

/* Run last before the loop waits again: the turn ends. */
static void prepare_cb(struct ev_loop *loop, ev_prepare *w, int revents)
{
    (void)loop;
    (void)revents;
    looptime *lt = w->data;
    double cpu1 = clock_s(CLOCK_THREAD_CPUTIME_ID), cpu0 = lt->cpu0;
    lt->cpu0 = cpu1;
    if (!lt->in_turn)
        return; /* the first wait, or a clock that failed */
    lt->in_turn = false;
    double wall1 = clock_s(CLOCK_MONOTONIC);
    if (wall1 < 0 || cpu1 < 0)
        return;
    double wall = wall1 - lt->wall0, cpu = cpu1 - cpu0;
    if (wall < 0)
        wall = 0;
    if (cpu < 0)
        cpu = 0;
    histogram_observe_in(&lt->out->turn, loop_bucket_bounds, wall);
    histogram_observe_in(&lt->out->turn_cpu, loop_bucket_bounds, cpu);
    if (wall > LOOPTIME_WARN_S)
        blocked(lt, wall1, wall, cpu);
}

void looptime_start(looptime *lt, struct ev_loop *loop, loop_metrics *out)
{
    *lt = (looptime){ .loop = loop, .out = out, .cpu0 = clock_s(CLOCK_THREAD_CPUTIME_ID) };
    ev_check_init(&lt->check, check_cb);
    ev_prepare_init(&lt->prepare, prepare_cb);
    lt->check.data = lt->prepare.data = lt;
    /* the check before every other callback of the turn, the prepare after them all */
    ev_set_priority(&lt->check, EV_MAXPRI);
    ev_set_priority(&lt->prepare, EV_MINPRI);
    ev_check_start(loop, &lt->check);
    ev_prepare_start(loop, &lt->prepare);
    /* timing the loop does not keep it running */
    ev_unref(loop);
    ev_unref(loop);
}

void looptime_stop(looptime *lt)
{
    if (lt->loop == NULL)
        return;
    ev_ref(lt->loop);
    ev_ref(lt->loop);
    ev_check_stop(lt->loop, &lt->check);
    ev_prepare_stop(lt->loop, &lt->prepare);
    lt->loop = NULL;
}
