/*
 * amqpsink.c — the RabbitMQ sink (relay/sink.h) on rabbitmq-c 0.11 and libev:
 * the loop side. The connect itself runs off the loop (amqpconnect.c), the
 * exchange checks on their own channel (amqpxcheck.c), the socket's options and
 * the sends that do not wait are amqpwire.c's; they share the sink's state
 * through amqpsink.h.
 *
 * One connection, one channel in confirm mode. Publishes are pipelined over
 * publish_window; acks/nacks/returns/channel.close are read from the loop with
 * amqp_simple_wait_frame_noblock(zero timeout) whenever the socket is readable
 * and on a periodic tick (heartbeats, confirm timeout).
 *
 * Bounded blocking:
 *  - connect/TLS handshake/login/channel.open/confirm.select never run on the
 *    loop: each attempt runs on a worker thread (amqpconnect.h), each step
 *    bounded by connect_timeout; destroy() abandons a running attempt without
 *    waiting for it more than briefly.
 *  - publish: rabbitmq-c's send waits without a deadline when the socket
 *    buffer is full, so nothing is sent before the free space in the socket
 *    send buffer (SIOCOUTQ vs SO_SNDBUF) is known to hold it. A message up to
 *    AMQPSINK_STREAM_MIN goes out whole (amqp_basic_publish) once its encoded
 *    size fits, else publish() says SINK_EAGAIN. A larger one is written in
 *    frames as the socket drains (stream_pump): its method and header frames
 *    and whatever body frames fit now in publish(), the rest from the write
 *    watcher, at most AMQPSINK_PUMP_BYTES per loop callback, each frame only
 *    when the socket has room for all of it. Its body is never copied: the
 *    frames point into the row's payload (rabbitmq-c stages one frame at a
 *    time in its frame_max buffer), which the caller keeps until on_result;
 *    the kernel holds at most the send buffer of it. While it is being
 *    written nothing else is published on the channel (SINK_EAGAIN, then
 *    on_writable), so its frames stay contiguous there; between two of its
 *    frames the loop reads acks, answers the broker and rabbitmq-c sends its
 *    heartbeats. TCP_USER_TIMEOUT (= confirm_timeout, lifted while the broker
 *    blocks the connection) bounds how long the kernel keeps unacknowledged
 *    data before the socket errors, and a message whose frames the socket
 *    stopped taking fails the connection after confirm_timeout.
 *  - destroy: connection.close with a short rpc timeout.
 *
 * Every in-flight message lives in a ring indexed by delivery tag. Results
 * are delivered only from loop callbacks, never from inside publish(). A
 * callback may call publish() or destroy(): every path re-checks s->dying
 * after a callback and the outermost loop callback frees a destroyed sink.
 *
 * Destination checks: before the first publish to a named exchange, publish()
 * answers SINK_EWAIT while a passive exchange.declare on a second channel asks
 * the broker whether it exists (amqpxcheck.c), so that a missing exchange
 * refuses its rows instead of closing the publishing channel.
 */
#include "sinks/rabbitmq/amqpsink.h"
#include "relay/sink.h"
#include "sinks/sinks.h"
#include "sinks/rabbitmq/amqpcfg.h"
#include "sinks/rabbitmq/amqpconnect.h"
#include "sinks/rabbitmq/json.h"

#include <amqp.h>
#include <errno.h>
#include <ev.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lib/outbox_util.h"

#define AMQPSINK_BACKOFF_MIN 100           /* ms */
#define AMQPSINK_DRAIN_MAX   4096          /* frames per readable event before yielding */
#define AMQPSINK_DRAIN_BYTES (1024 * 1024) /* body bytes read per readable event before yielding */
#define AMQPSINK_STREAM_MIN  (256 * 1024)  /* larger messages are written as the socket drains */
#define AMQPSINK_PUMP_BYTES  (1024 * 1024) /* message bytes written in one turn of the loop */

/* The peer in an ident, without the word "broker": on_state's peer (a log field). */
static const char *ident_peer(const char *ident)
{
    return strncmp(ident, "broker ", 7) == 0 ? ident + 7 : ident;
}

/* ------------------------------------------------------------ ring / state */

static ring_msg *slot(sink *s, uint64_t tag)
{
    return &s->ring[tag & s->ring_mask];
}

static ring_msg *find_live(sink *s, uint64_t tag)
{
    ring_msg *e;

    if (tag < s->tail_tag || tag >= s->next_tag)
        return NULL;
    e = slot(s, tag);
    return (e->live && e->tag == tag) ? e : NULL;
}

static void advance_tail(sink *s)
{
    while (s->tail_tag < s->next_tag && !find_live(s, s->tail_tag))
        s->tail_tag++;
}

static enum sink_state cur_state(const sink *s)
{
    if (s->conn == NULL || !s->chan_ok || s->broken)
        return SINK_DOWN;
    return s->blocked ? SINK_BLOCKED : SINK_UP;
}

/* ------------------------------------- telling the relay; failure and reconnect */

/* Each helper that calls back returns false when destroy() was called from
 * the callback: the caller must then return at once without touching s. */
static OUTBOX_MUST_CHECK bool emit_state(sink *s, const char *msg)
{
    enum sink_state st = cur_state(s);

    s->reported = st;
    s->cbs.on_state(s->cbs.ud, st, ident_peer(s->ident), msg);
    return !s->dying;
}

static OUTBOX_MUST_CHECK bool report_result(sink *s, uint64_t tag, enum sink_outcome outcome,
                                            const char *reason)
{
    ring_msg *e = slot(s, tag);
    void *ud = e->msg_ud;
    char *ret = e->ret_reason; /* freed after the callback */
    bool alive;

    /* Does the channel work? An ack (returned or not) says so; nacks in a row,
     * and no ack, say it may not (nack_check). */
    if (outcome == SINK_NACKED) {
        if (s->nack_run++ == 0 && s->conf.nack_reopen_ms > 0) {
            /* look again when nack_reopen is over, also if no nack comes then */
            s->nack_since = ev_now(s->loop);
            ev_timer_stop(s->loop, &s->nackt);
            ev_timer_set(&s->nackt, (double)s->conf.nack_reopen_ms / 1000. + 0.001, 0.);
            ev_timer_start(s->loop, &s->nackt);
        }
    } else if (outcome == SINK_ACK) {
        s->nack_run = 0;
        ev_timer_stop(s->loop, &s->nackt);
        if (s->pch == PCH_DRAIN) { /* it does after all: publish on it again */
            s->pch = PCH_OPEN;
            s->want_writable = true;
        }
    }

    if (outcome == SINK_ACK && e->returned) {
        outcome = SINK_RETURNED;
        reason = ret ? ret : "unroutable (basic.return)";
    } else if (outcome == SINK_ACK) {
        reason = NULL;
    }
    if (s->st.active && s->st.tag == tag) {
        /* An answer for a message not yet written whole: only a torn-down
         * channel or connection gets here (they stop the stream first), or a
         * broker answering what it cannot have. Its body is the caller's from
         * now on: stop writing it, and the connection cannot go on mid-message. */
        s->st.active = false;
        amqpsink_mark_broken(s, "an answer for a message still being sent",
                             AMQP_STATUS_UNEXPECTED_STATE);
    }
    e->live = false;
    e->returned = false;
    e->ret_reason = NULL;
    e->r = NULL;
    s->inflight--;
    advance_tail(s);
    s->cbs.on_result(s->cbs.ud, ud, outcome, reason);
    alive = !s->dying;
    free(ret);
    return alive;
}

/* Every live message gets outcome (in tag order), then the tag counter resets. */
static OUTBOX_MUST_CHECK bool fail_all(sink *s, enum sink_outcome outcome, const char *reason)
{
    uint64_t end = s->next_tag;

    for (uint64_t t = s->tail_tag; t < end; t++) {
        if (find_live(s, t) && !report_result(s, t, outcome, reason))
            return false;
    }
    s->next_tag = s->tail_tag = 1;
    return true;
}

/* True when the broker has been silent for a heartbeat interval or more.
 * amqp_basic_publish() then checks for a missed heartbeat itself and, in
 * rabbitmq-c 0.11, waits in poll() without a deadline: never call it then. */
static bool broker_silent(const sink *s)
{
    return s->hb > 0 && ev_time() - s->last_rx >= (double)s->hb;
}

static bool maybe_writable(sink *s)
{
    if (s->ck_resolved && cur_state(s) != SINK_DOWN) {
        /* Exchange checks answered: rows held back with SINK_EWAIT may go now
         * (or be refused). One call for every answer read since the last one.
         * want_writable stays: a row waiting for window room still hears of
         * it (a second call at worst, which is harmless). */
        s->ck_resolved = false;
        s->cbs.on_writable(s->cbs.ud);
        return !s->dying;
    }
    if (!s->want_writable || cur_state(s) == SINK_DOWN || broker_silent(s) || s->pch != PCH_OPEN ||
        s->st.active)
        return true;
    if (s->inflight >= (size_t)s->cfg.publish_window || s->next_tag - s->tail_tag > s->ring_mask)
        return true;
    if (ev_is_active(&s->wio) || ev_is_active(&s->wretry))
        return true; /* waiting for socket space */
    s->want_writable = false;
    s->cbs.on_writable(s->cbs.ud);
    return !s->dying;
}

/* An attempt failed or the connection was lost at address cur: the next
 * attempt goes to the next address of the list (the same one when there is
 * only one). Within a round of the list it follows at the shortest delay;
 * after a round in which every address failed, after the back-off, which then
 * doubles up to reconnect_max (with one address: after every failure, as
 * before lists existed). */
static void schedule_reconnect(sink *s)
{
    int64_t base = AMQPSINK_BACKOFF_MIN;

    s->cur = (s->cur + 1) % s->conf.n_brokers;
    if (++s->round_fails >= s->conf.n_brokers) {
        s->round_fails = 0;
        base = s->backoff_ms;
        s->backoff_ms = outbox_util_backoff_next(s->backoff_ms, AMQPSINK_BACKOFF_MIN,
                                                 s->cfg.reconnect_max_ms);
    }
    ev_timer_stop(s->loop, &s->retry);
    ev_timer_set(&s->retry, (double)outbox_util_jitter(base, &s->rnd) / 1000., 0.);
    ev_timer_start(s->loop, &s->retry);
}

/* "; next: broker ADDR" when the list has another address to try, else "". */
static void next_note(const sink *s, char *buf, size_t len)
{
    if (s->conf.n_brokers > 1)
        snprintf(buf, len, "; next: broker %s",
                 s->conf.brokers[(s->cur + 1) % s->conf.n_brokers].addr);
    else if (len > 0)
        buf[0] = '\0';
}

/* Tears the connection down: on_state(DOWN), every in-flight → LOST, reconnect
 * later (to the next address of a list: failover). */
bool amqpsink_conn_fail(sink *s, const char *why)
{
    char reason[700], next[340];

    next_note(s, next, sizeof next);
    snprintf(reason, sizeof reason, "%s: %s%s", s->ident, why, next);
    ev_io_stop(s->loop, &s->rio);
    ev_io_stop(s->loop, &s->wio);
    ev_timer_stop(s->loop, &s->wretry);
    ev_timer_stop(s->loop, &s->tick);
    ev_timer_stop(s->loop, &s->failt);
    ev_timer_stop(s->loop, &s->nackt);
    s->st.active = false; /* its message is LOST below with the rest */
    if (s->conn != NULL) {
        amqp_destroy_connection(s->conn);
        s->conn = NULL;
    }
    s->chan_ok = false;
    s->pch = PCH_OPEN;
    s->nack_run = 0;
    s->connected = -1;
    s->blocked = false;
    s->broken = false;
    s->ret_stage = RET_NONE;
    /* The exchange cache belongs to the connection. Rows held back with
     * SINK_EWAIT hear on_writable once connected again (want_writable). */
    if (s->xq_len > 0 || s->ck_cur != NULL || s->ck_resolved)
        s->want_writable = true;
    s->ck_resolved = false;
    amqpsink_xcheck_reset(s);
    if (!emit_state(s, reason))
        return false;
    if (!fail_all(s, SINK_LOST, reason))
        return false;
    schedule_reconnect(s);
    return true;
}

/* A send failed: the connection may be mid-frame. Fail it from the loop (the
 * caller may be publish(), which must not call back). */
void amqpsink_mark_broken(sink *s, const char *what, int rc)
{
    if (s->broken)
        return;
    s->broken = true;
    snprintf(s->broken_why, sizeof s->broken_why, "%s: %s", what, amqp_error_string2(rc));
    ev_timer_set(&s->failt, 0., 0.);
    ev_timer_start(s->loop, &s->failt);
}

static OUTBOX_MUST_CHECK bool read_frames(sink *s);
static void nack_check(sink *s);
static bool pch_kick(sink *s);
static OUTBOX_MUST_CHECK bool pch_timeout(sink *s);

static void sink_free(sink *s);
static void stream_pump(sink *s);

/* ------------------------------------------------------------ loop callbacks */

#define ENTER(s) ((s)->depth++)
#define LEAVE(s)                             \
    do {                                     \
        if (--(s)->depth == 0 && (s)->dying) \
            sink_free(s);                    \
    } while (0)

/* A connect attempt failed (reason in words, without the peer). */
static void connect_failed(sink *s, const char *err)
{
    char msg[1500], next[340];

    next_note(s, next, sizeof next);
    snprintf(msg, sizeof msg, "%s: %s%s", s->ident, err, next);
    if (emit_state(s, msg))
        schedule_reconnect(s);
}

/* Back-off over: start a connection attempt on a worker thread. */
static void retry_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    sink *s = w->data;
    char err[300];

    (void)loop;
    (void)revents;
    if (s->job != NULL || s->conn != NULL)
        return;
    ENTER(s);
    s->ch = 1;
    amqpsink_ident(s->ident, sizeof s->ident, &s->conf, s->cur); /* this attempt's peer */
    if (amqpsink_job_start(s->loop, &s->jobw, &s->cfg, s->cur, s->conn_name, s->ch, &s->job, err,
                           sizeof err) < 0)
        connect_failed(s, err);
    LEAVE(s);
}

/* The worker is done: take its connection (or its reason) on the loop. */
static void jobw_cb(struct ev_loop *loop, ev_async *w, int revents)
{
    sink *s = w->data;
    amqp_connection_state_t conn = NULL;
    char err[AMQPSINK_ERR_MAX];

    (void)loop;
    (void)revents;
    if (s->job == NULL || !amqpsink_job_take(s->job, &conn, err, sizeof err))
        return;
    s->job = NULL; /* conn: ownership to the sink */
    ev_async_stop(s->loop, &s->jobw);

    ENTER(s);
    if (conn == NULL) {
        connect_failed(s, err[0] ? err : "connection failed");
        goto out;
    }
    s->conn = conn;
    s->backoff_ms = AMQPSINK_BACKOFF_MIN;
    s->round_fails = 0;
    s->chan_ok = true;
    s->pch = PCH_OPEN;
    s->nack_run = 0;
    s->blocked = false;
    s->broken = false;
    s->next_tag = s->tail_tag = 1;
    s->ret_stage = RET_NONE;
    memset(&s->st, 0, sizeof s->st);
    amqpsink_xcheck_reset(s);
    s->ck_ch = amqpsink_xcheck_channel(s->conn);
    amqpsink_set_sock_opts(s);
    s->hb = amqp_get_heartbeat(s->conn);
    s->last_rx = ev_time();
    if (s->hb > 0 && s->hb / 4.0 < s->tick.repeat)
        s->tick.repeat = s->hb / 4.0;
    ev_io_set(&s->rio, amqp_get_sockfd(s->conn), EV_READ);
    ev_io_start(s->loop, &s->rio);
    ev_io_set(&s->wio, amqp_get_sockfd(s->conn), EV_WRITE);
    ev_timer_again(s->loop, &s->tick);
    {
        char msg[700];
        long was = s->last_up;

        s->connected = (long)s->cur;
        s->last_up = (long)s->cur;
        if (was >= 0 && was != (long)s->cur)
            snprintf(msg, sizeof msg, "%s, failed over from broker %s", s->ident,
                     s->conf.brokers[was].addr);
        else
            snprintf(msg, sizeof msg, "%s", s->ident);
        if (!emit_state(s, msg))
            goto out;
    }
    /* Frames may have been queued during the synchronous handshake. */
    if (!read_frames(s))
        goto out;
    (void)maybe_writable(s);
out:
    LEAVE(s);
}

static void rio_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    sink *s = w->data;

    (void)loop;
    (void)revents;
    ENTER(s);
    s->last_rx = ev_time();
    if (s->conn != NULL && read_frames(s))
        (void)maybe_writable(s);
    LEAVE(s);
}

static void tick_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    sink *s = w->data;

    (void)revents;
    ENTER(s);
    if (s->conn == NULL)
        goto out;
    if (!read_frames(s) || s->conn == NULL)
        goto out;
    /* rabbitmq-c checks missed heartbeats only in calls with a deadline in
     * the future, never with our zero timeout: watch the socket ourselves.
     * Any data (heartbeat frames included) wakes rio_cb. */
    if (s->hb > 0 && ev_time() - s->last_rx > 2.0 * s->hb) {
        char why[120];

        snprintf(why, sizeof why, "heartbeat timeout: nothing from the broker for %.1f s",
                 ev_time() - s->last_rx);
        (void)amqpsink_conn_fail(s, why);
        goto out;
    }
    advance_tail(s);
    /* While the broker blocks the connection (memory or disk alarm) it may hold
     * confirms back for as long as the alarm lasts: that is flow control, not a
     * dead connection, so the confirm clock only runs while unblocked. */
    if (s->cfg.confirm_timeout_ms > 0 && s->inflight > 0 && !s->blocked) {
        ring_msg *e = find_live(s, s->tail_tag);
        ev_tstamp since = e == NULL                           ? 0
                          : e->published_at > s->unblocked_at ? e->published_at
                                                              : s->unblocked_at;

        if (e != NULL && s->st.active && e->tag == s->st.tag) {
            /* still being written: its confirm clock starts when it is whole;
             * meanwhile the socket must keep taking its frames */
            since = s->st.progress_at > s->unblocked_at ? s->st.progress_at : s->unblocked_at;
            if (ev_now(loop) - since > (double)s->cfg.confirm_timeout_ms / 1000.) {
                char why[300];

                snprintf(why, sizeof why,
                         "sending delivery tag %llu: the socket took none of its frames for "
                         "%lld ms (%zu of %zu body bytes written)",
                         (unsigned long long)e->tag, (long long)s->cfg.confirm_timeout_ms,
                         s->st.off, s->st.len);
                (void)amqpsink_conn_fail(s, why);
                goto out;
            }
        } else if (e != NULL && ev_now(loop) - since > (double)s->cfg.confirm_timeout_ms / 1000.) {
            char why[200];

            snprintf(why, sizeof why, "no publisher confirm for delivery tag %llu within %lld ms",
                     (unsigned long long)e->tag, (long long)s->cfg.confirm_timeout_ms);
            (void)amqpsink_conn_fail(s, why);
            goto out;
        }
    }
    if (!amqpsink_xcheck_timeout(s) || s->conn == NULL)
        goto out;
    if (!pch_timeout(s) || s->conn == NULL)
        goto out;
    nack_check(s);                       /* only nacks for long enough, also when no more come */
    if (!pch_kick(s) || s->conn == NULL) /* a reopen held back for socket room */
        goto out;
    amqpsink_xcheck_kick(s); /* a check held back for socket room */
    (void)maybe_writable(s);
out:
    LEAVE(s);
}

static void failt_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    sink *s = w->data;
    char why[200];

    (void)loop;
    (void)revents;
    ENTER(s);
    if (s->conn != NULL && s->broken) {
        snprintf(why, sizeof why, "%s", s->broken_why);
        (void)amqpsink_conn_fail(s, why);
    }
    LEAVE(s);
}

/* nack_reopen is over since the first nack of a run: reopen now if it still holds. */
static void nackt_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    sink *s = w->data;

    (void)loop;
    (void)revents;
    ENTER(s);
    if (s->conn != NULL) {
        nack_check(s);
        (void)pch_kick(s);
    }
    LEAVE(s);
}

/* The message stream_pump has just written whole: its payload is the caller's again
 * (on_written). False when the sink was destroyed meanwhile. */
static bool notify_written(sink *s)
{
    void *ud = s->st.written_ud;

    s->st.written_ud = NULL;
    if (ud == NULL || s->cbs.on_written == NULL)
        return true;
    s->cbs.on_written(s->cbs.ud, ud);
    return !s->dying;
}

static void wio_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    sink *s = w->data;

    (void)revents;
    ENTER(s);
    ev_io_stop(loop, &s->wio);
    if (s->conn == NULL) {
        /* gone meanwhile */
    } else if (!amqpsink_sock_room(s, s->want_bytes)) {
        /* writable but not enough for the message: look again shortly
         * (EV_WRITE is level-triggered; re-arming now would spin). A broker
         * blocking the connection reads nothing until it unblocks. */
        ev_timer_set(&s->wretry, s->blocked ? 0.05 : 0.005, 0.);
        ev_timer_start(loop, &s->wretry);
    } else if (s->st.active) {
        stream_pump(s);
        if (!s->st.active && notify_written(s)) /* written whole: the relay may publish again */
            (void)maybe_writable(s);
    } else {
        (void)maybe_writable(s);
    }
    LEAVE(s);
}

static void wretry_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    sink *s = w->data;

    (void)revents;
    if (s->conn != NULL)
        ev_io_start(loop, &s->wio);
}

/* ------------------------------------------------------------ channel reopen */

/* The next publishing channel number: they cycle below the check channel. */
static amqp_channel_t next_channel(const sink *s)
{
    /* the check channel is the highest */
    int max = s->ck_ch != 0 ? s->ck_ch - 1 : amqpsink_channel_max(s->conn);

    return (amqp_channel_t)(s->ch >= max ? 1 : s->ch + 1);
}

static OUTBOX_MUST_CHECK bool emit_event(sink *s, enum sink_event ev, const char *msg)
{
    if (s->cbs.on_event != NULL) {
        s->cbs.on_event(s->cbs.ud, ev, msg);
        return !s->dying;
    }
    return true;
}

/* A channel that got only nacks for nack_reopen (at least AMQPSINK_NACK_REOPEN_MIN,
 * no ack) is reopened: RabbitMQ 3.10 nacks every publish of a channel that
 * first published to a quorum queue while its leader's node was down, until
 * that node returns, while a channel opened after the new leader was elected
 * works. Here it only stops publishing on it (PCH_DRAIN); pch_kick does the
 * rest. The nacks themselves stay failed attempts: the broker refused those
 * messages, and a queue that is full (reject-publish) nacks the same way. */
static void nack_check(sink *s)
{
    ev_tstamp now = ev_now(s->loop);

    if (s->conf.nack_reopen_ms <= 0 || s->conn == NULL || !s->chan_ok || s->broken ||
        s->pch != PCH_OPEN || s->nack_run < AMQPSINK_NACK_REOPEN_MIN ||
        now - s->nack_since < (double)s->conf.nack_reopen_ms / 1000.)
        return;
    snprintf(s->nack_why, sizeof s->nack_why, "channel %u got only nacks (%u in %.1f s, no ack)",
             (unsigned)s->ch, s->nack_run, now - s->nack_since);
    s->pch = PCH_DRAIN;
}

/* Moves the publishing channel's reopen on as far as it can go now, without
 * waiting for the broker: PCH_DRAIN → once nothing is in flight, channel.close
 * and the next channel number; PCH_WANT_OPEN → channel.open; PCH_WANT_SELECT →
 * confirm.select; each when the socket has room for it (else the tick tries
 * again: rabbitmq-c's send would wait without a deadline). The answers come
 * through handle_frame (on_reopen_frame). A failed send fails the connection
 * from the loop. Returns false when the sink was destroyed from a callback. */
static bool pch_kick(sink *s)
{
    int rc;

    if (s->conn == NULL || s->broken || s->pch == PCH_OPEN || s->pch == PCH_OPENING ||
        s->pch == PCH_SELECTING || !amqpsink_sock_room(s, AMQPSINK_CHECK_BYTES))
        return true;
    if (s->pch == PCH_DRAIN) {
        amqp_channel_close_t m;
        amqp_channel_t old = s->ch;
        char msg[700];

        if (s->inflight > 0)
            return true; /* their nacks (or acks) come first */
        memset(&m, 0, sizeof m);
        m.reply_code = AMQP_REPLY_SUCCESS;
        m.reply_text = amqpsink_bytes("outbox-relay: reopening a channel that got only nacks");
        rc = amqp_send_method(s->conn, old, AMQP_CHANNEL_CLOSE_METHOD, &m);
        if (rc != AMQP_STATUS_OK) {
            amqpsink_mark_broken(s, "channel.close", rc);
            return true;
        }
        /* the close-ok (and anything else) on the old number is ignored from now */
        s->ch = next_channel(s);
        s->next_tag = s->tail_tag = 1;
        s->nack_run = 0;
        s->pch = PCH_WANT_OPEN;
        snprintf(msg, sizeof msg, "%s: %s: reopening it as channel %u", s->ident, s->nack_why,
                 (unsigned)s->ch);
        if (!emit_event(s, SINK_EV_NACK_REOPEN, msg))
            return false;
        if (s->conn == NULL || !amqpsink_sock_room(s, AMQPSINK_CHECK_BYTES))
            return true;
    }
    s->pch_sent_at = ev_now(s->loop);
    if (s->pch == PCH_WANT_OPEN) {
        s->pch = PCH_OPENING;
        amqpsink_open_channel(s, s->ch, "channel.open");
    } else { /* PCH_WANT_SELECT */
        amqp_confirm_select_t m;

        memset(&m, 0, sizeof m); /* nowait = 0: confirm.select-ok answers */
        s->pch = PCH_SELECTING;
        amqpsink_send_nowait(s, s->ch, AMQP_CONFIRM_SELECT_METHOD, &m, "confirm.select");
    }
    return true;
}

/* channel.open or confirm.select without an answer within connect_timeout (the
 * bound the blocking reopen had; the clock stops while the broker blocks the
 * connection). Returns false when the sink was destroyed. */
static OUTBOX_MUST_CHECK bool pch_timeout(sink *s)
{
    ev_tstamp since;
    char why[300];

    if (s->conn == NULL || s->blocked || (s->pch != PCH_OPENING && s->pch != PCH_SELECTING))
        return true;
    since = s->pch_sent_at > s->unblocked_at ? s->pch_sent_at : s->unblocked_at;
    if (ev_now(s->loop) - since <= (double)s->cfg.connect_timeout_ms / 1000.)
        return true;
    snprintf(why, sizeof why,
             "reopening the publishing channel: no answer to %s of channel %u "
             "within %lld ms",
             s->pch == PCH_OPENING ? "channel.open" : "confirm.select", (unsigned)s->ch,
             (long long)s->cfg.connect_timeout_ms);
    return amqpsink_conn_fail(s, why);
}

/* A frame on the publishing channel's new number while it is being opened. */
static OUTBOX_MUST_CHECK bool on_reopen_frame(sink *s, const amqp_frame_t *f)
{
    if (f->frame_type != AMQP_FRAME_METHOD)
        return true;
    switch (f->payload.method.id) {
    case AMQP_CHANNEL_OPEN_OK_METHOD:
        if (s->pch == PCH_OPENING) {
            s->pch = PCH_WANT_SELECT;
            return pch_kick(s);
        }
        return true;
    case AMQP_CONFIRM_SELECT_OK_METHOD:
        if (s->pch != PCH_SELECTING)
            return true;
        s->pch = PCH_OPEN;
        s->nack_run = 0;
        s->next_tag = s->tail_tag = 1;
        if (!s->chan_ok) { /* closed by the broker: DOWN until now */
            char st[400];

            s->chan_ok = true;
            snprintf(st, sizeof st, "channel %u reopened on %s", (unsigned)s->ch, s->ident);
            return emit_state(s, st);
        }
        s->want_writable = true; /* rows held back with SINK_EAGAIN: on_writable */
        return true;
    case AMQP_CHANNEL_CLOSE_METHOD: {
        const amqp_channel_close_t *m = f->payload.method.decoded;
        char why[700];

        (void)amqpsink_close_ok(s, s->ch);
        snprintf(why, sizeof why,
                 "reopening the publishing channel: the broker closed channel "
                 "%u: %u %.*s",
                 (unsigned)s->ch, (unsigned)m->reply_code, (int)m->reply_text.len,
                 (const char *)m->reply_text.bytes);
        return amqpsink_conn_fail(s, why);
    }
    default:
        return true;
    }
}

/* ------------------------------------------------------------ frame handling */

static OUTBOX_MUST_CHECK bool on_ack(sink *s, uint64_t tag, bool multiple,
                                     enum sink_outcome outcome, const char *reason)
{
    if (multiple) {
        uint64_t end = s->next_tag;

        if (tag == 0 || tag >= end)
            tag = end - 1;
        for (uint64_t t = s->tail_tag; t <= tag; t++) {
            if (find_live(s, t) && !report_result(s, t, outcome, reason))
                return false;
        }
        return true;
    }
    if (find_live(s, tag))
        return report_result(s, tag, outcome, reason);
    return true; /* unknown tag: stale or duplicate, ignore */
}

static OUTBOX_MUST_CHECK bool on_return_header(sink *s, const amqp_frame_t *f)
{
    const amqp_basic_properties_t *p = f->payload.properties.decoded;

    s->ret_left = f->payload.properties.body_size;
    s->ret_stage = s->ret_left > 0 ? RET_SKIP_BODY : RET_NONE;
    if (p == NULL || !(p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG))
        return true;
    for (uint64_t t = s->tail_tag; t < s->next_tag; t++) {
        ring_msg *e = find_live(s, t);

        if (e != NULL && !e->returned && strlen(e->r->message_id) == p->message_id.len &&
            memcmp(e->r->message_id, p->message_id.bytes, p->message_id.len) == 0) {
            e->returned = true;
            free(e->ret_reason);
            e->ret_reason = strdup(s->ret_reason); /* NULL: generic reason later */
            break;
        }
    }
    return true;
}

/* Is the message's exchange named (quoted) in the broker's reply text? */
static bool names_exchange(const ring_msg *e, const char *text)
{
    char q[300];

    if (e->r->exchange[0] == '\0')
        return strstr(text, "default exchange") != NULL;
    snprintf(q, sizeof q, "'%s'", e->r->exchange);
    return strstr(text, q) != NULL;
}

static OUTBOX_MUST_CHECK bool on_channel_close(sink *s, unsigned code, const char *text)
{
    char msg[700];
    uint64_t culprit = 0;
    unsigned long long size = 0;
    const char *sz;
    int rc;

    snprintf(msg, sizeof msg, "channel %u closed by the broker: %u %s", (unsigned)s->ch, code,
             text);
    /* The broker discards the rest of a message being written: no more of its
     * frames after the close-ok (its result follows with the others). */
    s->st.active = false;
    rc = amqpsink_close_ok(s, s->ch);
    s->chan_ok = false;
    s->ret_stage = RET_NONE;
    if (rc != AMQP_STATUS_OK) {
        char why[800];

        snprintf(why, sizeof why, "%s; channel.close-ok: %s", msg, amqp_error_string2(rc));
        return amqpsink_conn_fail(s, why);
    }
    {
        char st[1100];

        snprintf(st, sizeof st, "%s: %s", s->ident, msg);
        if (!emit_state(s, st))
            return false;
    }
    /* The culprit: the first unconfirmed message to the exchange the reply
     * names, or whose size the reply names (406 message size), else the oldest. */
    sz = strstr(text, "message size ");
    if (sz != NULL)
        size = strtoull(sz + 13, NULL, 10);
    for (uint64_t t = s->tail_tag; t < s->next_tag && culprit == 0; t++) {
        ring_msg *e = find_live(s, t);

        if (e != NULL && names_exchange(e, text)) {
            culprit = t;
            if (code == AMQP_NOT_FOUND)
                amqpsink_xcheck_missing(s, e->r->exchange, text);
        } else if (e != NULL && sz != NULL && e->r->payload_len == size) {
            culprit = t;
        }
    }
    advance_tail(s);
    if (culprit == 0 && find_live(s, s->tail_tag))
        culprit = s->tail_tag;
    if (culprit != 0) {
        char reason[800];

        snprintf(reason, sizeof reason, "%u %s", code, text);
        if (!report_result(s, culprit, SINK_REJECTED, reason))
            return false;
    }
    if (!fail_all(s, SINK_LOST, msg))
        return false;
    if (s->conn == NULL)
        return true;
    /* Reopen on the next channel number, without waiting here: DOWN until
     * confirm.select-ok (on_reopen_frame), bounded by connect_timeout. */
    s->ch = next_channel(s);
    s->next_tag = s->tail_tag = 1;
    s->pch = PCH_WANT_OPEN;
    return pch_kick(s);
}

static OUTBOX_MUST_CHECK bool handle_frame(sink *s, const amqp_frame_t *f)
{
    if (f->channel == 0) {
        if (f->frame_type != AMQP_FRAME_METHOD)
            return true;
        switch (f->payload.method.id) {
        case AMQP_CONNECTION_CLOSE_METHOD: {
            const amqp_connection_close_t *m = f->payload.method.decoded;
            amqp_connection_close_ok_t ok;
            char why[600];

            snprintf(why, sizeof why, "broker closed the connection: %u %.*s",
                     (unsigned)m->reply_code, (int)m->reply_text.len,
                     (const char *)m->reply_text.bytes);
            memset(&ok, 0, sizeof ok);
            (void)amqp_send_method(s->conn, 0, AMQP_CONNECTION_CLOSE_OK_METHOD, &ok);
            return amqpsink_conn_fail(s, why);
        }
        case AMQP_CONNECTION_BLOCKED_METHOD: {
            const amqp_connection_blocked_t *m = f->payload.method.decoded;
            char why[400];

            s->blocked = true;
            amqpsink_set_user_timeout(s, false);
            snprintf(why, sizeof why, "%s: broker blocked publishing: %.*s", s->ident,
                     (int)m->reason.len, (const char *)m->reason.bytes);
            return emit_state(s, why);
        }
        case AMQP_CONNECTION_UNBLOCKED_METHOD: {
            char why[400];

            s->blocked = false;
            amqpsink_set_user_timeout(s, true);
            s->unblocked_at = ev_now(s->loop);
            snprintf(why, sizeof why, "%s: broker unblocked publishing", s->ident);
            return emit_state(s, why);
        }
        default:
            return true;
        }
    }
    if (s->ck_ch != 0 && f->channel == s->ck_ch)
        return amqpsink_xcheck_frame(s, f);
    if (f->channel != s->ch)
        return true; /* leftovers of a closed channel */
    if (s->pch == PCH_OPENING || s->pch == PCH_SELECTING || s->pch == PCH_WANT_SELECT)
        return on_reopen_frame(s, f);
    if (!s->chan_ok)
        return true;
    switch (f->frame_type) {
    case AMQP_FRAME_METHOD:
        switch (f->payload.method.id) {
        case AMQP_BASIC_ACK_METHOD: {
            const amqp_basic_ack_t *m = f->payload.method.decoded;
            return on_ack(s, m->delivery_tag, m->multiple != 0, SINK_ACK, NULL);
        }
        case AMQP_BASIC_NACK_METHOD: {
            const amqp_basic_nack_t *m = f->payload.method.decoded;

            if (!on_ack(s, m->delivery_tag, m->multiple != 0, SINK_NACKED,
                        "nacked by the broker (basic.nack)"))
                return false;
            nack_check(s);
            return pch_kick(s); /* a channel draining for its reopen: its last answer? */
        }
        case AMQP_BASIC_RETURN_METHOD: {
            const amqp_basic_return_t *m = f->payload.method.decoded;

            snprintf(s->ret_reason, sizeof s->ret_reason,
                     "unroutable: %.*s exchange=%.*s routing_key=%.*s", (int)m->reply_text.len,
                     (const char *)m->reply_text.bytes, (int)m->exchange.len,
                     (const char *)m->exchange.bytes, (int)m->routing_key.len,
                     (const char *)m->routing_key.bytes);
            s->ret_stage = RET_WANT_HEADER;
            return true;
        }
        case AMQP_CHANNEL_CLOSE_METHOD: {
            const amqp_channel_close_t *m = f->payload.method.decoded;
            char text[512];

            snprintf(text, sizeof text, "%.*s", (int)m->reply_text.len,
                     (const char *)m->reply_text.bytes);
            return on_channel_close(s, m->reply_code, text);
        }
        default:
            return true;
        }
    case AMQP_FRAME_HEADER:
        if (s->ret_stage == RET_WANT_HEADER)
            return on_return_header(s, f);
        return true;
    case AMQP_FRAME_BODY:
        if (s->ret_stage == RET_SKIP_BODY) {
            size_t n = f->payload.body_fragment.len;

            s->ret_left = n >= s->ret_left ? 0 : s->ret_left - n;
            if (s->ret_left == 0)
                s->ret_stage = RET_NONE;
        }
        return true;
    default:
        return true;
    }
}

/* Reads and handles every frame available now. Returns false when the sink
 * was destroyed from a callback; s->conn is NULL afterwards when the
 * connection failed. */
static OUTBOX_MUST_CHECK bool read_frames(sink *s)
{
    struct timeval zero = { 0, 0 };
    int n = 0;
    size_t bytes = 0;

    while (s->conn != NULL) {
        amqp_frame_t f;
        int rc;

        /* yield to the loop after many frames, or a large returned body's
         * worth (its frames stay in the connection's pools until released) */
        if (n++ == AMQPSINK_DRAIN_MAX || bytes >= AMQPSINK_DRAIN_BYTES) {
            ev_feed_event(s->loop, &s->rio, EV_READ);
            break;
        }
        rc = amqp_simple_wait_frame_noblock(s->conn, &f, &zero);
        if (rc == AMQP_STATUS_TIMEOUT)
            break;
        if (rc != AMQP_STATUS_OK)
            return amqpsink_conn_fail(s, amqp_error_string2(rc));
        if (f.frame_type == AMQP_FRAME_BODY)
            bytes += f.payload.body_fragment.len;
        if (!handle_frame(s, &f))
            return false;
    }
    /* Decoded frames live in the connection's pools until released; queued
     * frames (from a synchronous rpc) must survive until handled. */
    if (s->conn != NULL && !amqp_frames_enqueued(s->conn))
        amqp_maybe_release_buffers(s->conn);
    return true;
}

/* ------------------------------------------------ ops: the sink's lifecycle */

static void sink_free(sink *s)
{
    amqpsink_job_cancel(s->job);
    s->job = NULL;
    ev_async_stop(s->loop, &s->jobw);
    ev_io_stop(s->loop, &s->rio);
    ev_io_stop(s->loop, &s->wio);
    ev_timer_stop(s->loop, &s->tick);
    ev_timer_stop(s->loop, &s->retry);
    ev_timer_stop(s->loop, &s->wretry);
    ev_timer_stop(s->loop, &s->failt);
    ev_timer_stop(s->loop, &s->nackt);
    /* mid-message: no connection.close handshake behind half a message */
    amqpsink_conn_close(s->conn, !s->broken && !s->st.active);
    s->conn = NULL;
    amqpsink_xcheck_reset(s);
    if (s->ring != NULL) {
        for (uint64_t i = 0; i <= s->ring_mask; i++)
            free(s->ring[i].ret_reason);
        free(s->ring);
    }
    amqpsink_cfg_free(&s->cfg, &s->conf);
    free(s->conn_name);
    free(s);
}

static int amqpsink_create(struct ev_loop *loop, const cfg_sink *sc, const char *conn_name,
                           const sink_cbs *cbs, sink **out, char *err, size_t errlen)
{
    const amqpsink_conf *ac = amqpsink_conf_of(sc);
    sink *s;
    uint64_t cap = 1;

    *out = NULL;
    if (ac != NULL && (!sc->confirms || !ac->mandatory)) {
        snprintf(err, errlen, "sink %s: publisher confirms and mandatory are required",
                 sc->name ? sc->name : "?");
        return -1;
    }
    if (ac == NULL || sc->publish_window < 1 || sc->publish_window > 65535 || ac->host == NULL ||
        ac->user == NULL || ac->pass == NULL || ac->vhost == NULL) {
        snprintf(err, errlen, "sink %s: incomplete configuration", sc->name ? sc->name : "?");
        return -1;
    }
    s = calloc(1, sizeof *s);
    if (s == NULL)
        goto oom;
    s->loop = loop;
    s->cbs = *cbs;
    s->reported = -1;
    ev_async_init(&s->jobw, jobw_cb); /* before any goto oom: sink_free stops it */
    s->jobw.data = s;
    if (amqpsink_cfg_dup(&s->cfg, &s->conf, sc) <
            0 || /* url/password not kept: they may carry the password */
        amqpsink_dupstr(&s->conn_name, conn_name) < 0)
        goto oom;
    if (s->cfg.reconnect_max_ms < 100)
        s->cfg.reconnect_max_ms = 100;
    while (cap < 2 * (uint64_t)sc->publish_window)
        cap <<= 1;
    s->ring = calloc(cap, sizeof *s->ring);
    if (s->ring == NULL)
        goto oom;
    s->ring_mask = cap - 1;
    s->next_tag = s->tail_tag = 1;
    s->backoff_ms = AMQPSINK_BACKOFF_MIN;
    s->rnd = outbox_util_seed(s);
    s->cur = 0;
    s->connected = s->last_up = -1;
    amqpsink_ident(s->ident, sizeof s->ident, &s->conf, 0);

    ev_io_init(&s->rio, rio_cb, 0, EV_READ);
    ev_io_init(&s->wio, wio_cb, 0, EV_WRITE);
    {
        double t = 1.0;

        if (ac->heartbeat_ms > 0 && (double)ac->heartbeat_ms / 4000. < t)
            t = (double)ac->heartbeat_ms / 4000.;
        if (sc->confirm_timeout_ms > 0 && (double)sc->confirm_timeout_ms / 4000. < t)
            t = (double)sc->confirm_timeout_ms / 4000.;
        if (t < 0.05)
            t = 0.05;
        ev_init(&s->tick, tick_cb);
        s->tick.repeat = t;
    }
    ev_timer_init(&s->retry, retry_cb, 0., 0.);
    ev_timer_init(&s->wretry, wretry_cb, 0., 0.);
    ev_timer_init(&s->failt, failt_cb, 0., 0.);
    ev_timer_init(&s->nackt, nackt_cb, 0., 0.);
    s->rio.data = s->wio.data = s->tick.data = s->retry.data = s->wretry.data = s->failt.data =
        s->nackt.data = s;
    *out = s; /* ownership to the caller: amqpsink_destroy */
    return 0;
oom:
    snprintf(err, errlen, "sink %s: out of memory", sc->name ? sc->name : "?");
    if (s != NULL)
        sink_free(s);
    return -1;
}

static void amqpsink_destroy(sink *s)
{
    if (s == NULL)
        return;
    if (s->depth > 0) {
        /* Called from one of our callbacks: stop everything now, free when
         * the callback chain unwinds. No further callbacks. */
        s->dying = true;
        ev_async_stop(s->loop, &s->jobw);
        ev_io_stop(s->loop, &s->rio);
        ev_io_stop(s->loop, &s->wio);
        ev_timer_stop(s->loop, &s->tick);
        ev_timer_stop(s->loop, &s->retry);
        ev_timer_stop(s->loop, &s->wretry);
        ev_timer_stop(s->loop, &s->failt);
        ev_timer_stop(s->loop, &s->nackt);
        return;
    }
    sink_free(s);
}

static void amqpsink_start(sink *s)
{
    if (s->conn != NULL || s->job != NULL || ev_is_active(&s->retry))
        return;
    ev_timer_set(&s->retry, 0., 0.);
    ev_timer_start(s->loop, &s->retry);
}

static size_t amqpsink_in_flight(const sink *s)
{
    return s->inflight;
}

/* ------------------------ publish: the ring, frames written as the socket drains */

static int too_long(const char *what, const char *v, char *err, size_t errlen)
{
    if (v != NULL && strlen(v) > 255) {
        snprintf(err, errlen, "%s is %zu bytes; AMQP allows at most 255", what, strlen(v));
        return 1;
    }
    return 0;
}

/* A message goes out: its slot in the ring, under the next delivery tag. */
static ring_msg *ring_add(sink *s, const row *r, void *msg_ud)
{
    ring_msg *e = slot(s, s->next_tag);

    e->r = r;
    e->msg_ud = msg_ud;
    e->tag = s->next_tag++;
    e->published_at = ev_now(s->loop);
    e->live = true;
    e->returned = false;
    free(e->ret_reason);
    e->ret_reason = NULL;
    s->inflight++;
    return e;
}

/* publish() waits for need bytes of room in the socket: on_writable follows. */
static void wait_room(sink *s, size_t need)
{
    s->want_writable = true;
    s->want_bytes = need;
    if (!ev_is_active(&s->wretry))
        ev_io_start(s->loop, &s->wio);
}

/* The socket room one body frame of n bytes needs (with TLS's records). */
static size_t frame_room(const sink *s, size_t n)
{
    size_t need = n + 8;

    return s->conf.tls ? need + need / 64 + 1024 : need;
}

/* The body bytes one frame carries: the negotiated frame_max less the frame's
 * header and end octet. */
static size_t frame_body_max(const sink *s)
{
    int fm = amqp_get_frame_max(s->conn);

    return fm > 4096 ? (size_t)fm - 8 : 4096 - 8;
}

/* The message bytes written in this turn of the loop. One turn writes at most
 * AMQPSINK_PUMP_BYTES, whichever messages they belong to, then lets the loop run:
 * the socket takes what the broker reads, and a relay holding many large rows
 * would otherwise write them all in one callback (32 MiB of 512 KiB rows held the
 * loop 100-200 ms: no confirm read, no claim started meanwhile). */
static size_t burst_used(sink *s)
{
    unsigned it = ev_iteration(s->loop);

    if (it != s->burst_iter) {
        s->burst_iter = it;
        s->burst_bytes = 0;
    }
    return s->burst_bytes;
}

/* Writes body frames of the message in progress while the socket has room for
 * a whole frame, within the turn's AMQPSINK_PUMP_BYTES; then goes back to the
 * loop: the write watcher brings it back (wio_cb). When the last frame is out
 * the message's confirm clock starts. Never calls back (publish() calls it). */
static void stream_pump(sink *s)
{
    stream_msg *m = &s->st;
    size_t fb = frame_body_max(s);

    while (m->active && m->off < m->len) {
        size_t n = m->len - m->off < fb ? m->len - m->off : fb;
        amqp_frame_t f;
        int rc;

        if (burst_used(s) >= AMQPSINK_PUMP_BYTES) { /* enough for one turn: yield */
            s->want_bytes = frame_room(s, n);
            ev_io_start(s->loop, &s->wio);
            return;
        }
        if (!amqpsink_sock_room(s, frame_room(s, n))) {
            /* wait until a useful piece fits, not a single frame: up to half of what
             * the socket takes (its send buffer may be smaller than the piece, as under
             * the stock net.core.wmem_max of 208 KiB: waiting for more room than it has
             * would wait for an empty queue), never less than the frame */
            size_t left = m->len - m->off, one = frame_room(s, n);
            size_t want = frame_room(s, left < AMQPSINK_STREAM_MIN ? left : AMQPSINK_STREAM_MIN);

            if (want > s->sndcap / 2)
                want = s->sndcap / 2;
            s->want_bytes = want > one ? want : one;
            if (!ev_is_active(&s->wretry))
                ev_io_start(s->loop, &s->wio);
            return;
        }
        memset(&f, 0, sizeof f);
        f.frame_type = AMQP_FRAME_BODY;
        f.channel = s->ch;
        f.payload.body_fragment.bytes = (void *)(uintptr_t)(m->body + m->off);
        f.payload.body_fragment.len = n;
        rc = amqp_send_frame(s->conn, &f);
        if (rc != AMQP_STATUS_OK) {
            m->active = false; /* the connection is failed from the loop: LOST */
            amqpsink_mark_broken(s, "publish", rc);
            return;
        }
        m->off += n;
        s->burst_bytes += n;
        m->progress_at = ev_now(s->loop);
    }
    if (m->active) {
        ring_msg *e = find_live(s, m->tag);

        m->active = false;
        if (e != NULL) {
            e->published_at = ev_now(s->loop);
            m->written_ud = e->msg_ud; /* publish() clears it: writing() tells it there */
        }
        s->want_writable = true; /* rows held back meanwhile: on_writable */
    }
}

/* Whether the message's properties (its header frame) fit one frame. Checked before a
 * publish sends anything: rabbitmq-c sends the method frame first and only then fails
 * to encode a header that does not fit, and the broker closes the connection on the
 * half-sent publish that leaves (505 UNEXPECTED_FRAME). Encoded into a scratch buffer
 * of the loop thread, where every publish runs. */
static bool props_fit(const sink *s, const amqp_basic_properties_t *p)
{
    static unsigned char scratch[AMQPSINK_FRAME_MAX];
    size_t fb = frame_body_max(s);
    size_t room = fb < sizeof scratch ? fb : sizeof scratch;

    /* the header frame's payload: class, weight and body size (12 bytes), then these */
    return amqp_encode_properties(AMQP_BASIC_CLASS, (amqp_basic_properties_t *)(uintptr_t)p,
                                  (amqp_bytes_t){ .len = room - 12, .bytes = scratch }) >= 0;
}

/* Publishes a message larger than AMQPSINK_STREAM_MIN: its method and header
 * frames now, its body as the socket drains (stream_pump). head: the socket
 * room the method and header frames may take. */
static int publish_stream(sink *s, const row *r, amqp_basic_properties_t *p, void *msg_ud,
                          size_t head, char *err, size_t errlen)
{
    size_t fb = frame_body_max(s);
    size_t first = r->payload_len < fb ? r->payload_len : fb;
    amqp_basic_publish_t m;
    amqp_frame_t f;
    ring_msg *e;
    int rc;

    if (!amqpsink_sock_room(s, head + frame_room(s, first))) {
        wait_room(s, head + frame_room(s, first));
        return SINK_EAGAIN;
    }
    /* The header frame must fit one frame: checked before anything is sent, so that
     * a refusal leaves the channel as it was. */
    if (!props_fit(s, p)) {
        snprintf(err, errlen, "message properties too large for one frame");
        return SINK_EPERM;
    }

    memset(&m, 0, sizeof m);
    m.exchange = amqpsink_bytes(r->exchange);
    m.routing_key = amqpsink_bytes(r->routing_key);
    m.mandatory = 1;
    rc = amqp_send_method(s->conn, s->ch, AMQP_BASIC_PUBLISH_METHOD, &m);
    if (rc == AMQP_STATUS_OK) {
        memset(&f, 0, sizeof f);
        f.frame_type = AMQP_FRAME_HEADER;
        f.channel = s->ch;
        f.payload.properties.class_id = AMQP_BASIC_CLASS;
        f.payload.properties.body_size = r->payload_len;
        f.payload.properties.decoded = p;
        rc = amqp_send_frame(s->conn, &f);
    }
    if (rc != AMQP_STATUS_OK) {
        /* The connection is broken (maybe mid-message): fail it from the loop. */
        amqpsink_mark_broken(s, "publish", rc);
        return SINK_EAGAIN;
    }
    e = ring_add(s, r, msg_ud);
    s->st.active = true;
    s->st.tag = e->tag;
    s->st.body = (const uint8_t *)r->payload;
    s->st.len = r->payload_len;
    s->st.off = 0;
    s->st.progress_at = ev_now(s->loop);
    s->st.written_ud = NULL;
    stream_pump(s);
    s->st.written_ud = NULL; /* written whole already: the caller asks writing() */
    amqpsink_wake_reader(s);
    return SINK_QUEUED;
}

static void *amqpsink_writing(const sink *s)
{
    const ring_msg *e;

    if (!s->st.active)
        return NULL;
    e = &s->ring[s->st.tag & s->ring_mask];
    return e->live && e->tag == s->st.tag ? e->msg_ud : NULL;
}

static int amqpsink_publish(sink *s, const row *r, void *msg_ud, char *err, size_t errlen)
{
    amqp_basic_properties_t p;
    amqp_bytes_t body;
    void *hmem = NULL;
    size_t est, nframes;
    int rc;

    if (r->payload_released) {
        /* the caller let go of it after an earlier publish: nothing to send */
        snprintf(err, errlen, "payload no longer held by the relay");
        return SINK_EREFUSED;
    }
    /* Permanent problems first: the row can never be published. */
    if (r->payload_withheld > 0) {
        /* the claim left a payload over max_message_size in the database */
        if (r->payload_withheld > s->cfg.max_message_size) {
            snprintf(err, errlen, "payload is %zu bytes, larger than max_message_size %zu",
                     r->payload_withheld, s->cfg.max_message_size);
            return SINK_EPERM;
        }
        /* claimed under a smaller max_message_size (before a reload): claimed again */
        snprintf(err, errlen,
                 "payload of %zu bytes was left in the database by a claim "
                 "under a smaller max_message_size",
                 r->payload_withheld);
        return SINK_EREFUSED;
    }
    if (r->payload_len > s->cfg.max_message_size) {
        snprintf(err, errlen, "payload is %zu bytes, larger than max_message_size %zu",
                 r->payload_len, s->cfg.max_message_size);
        return SINK_EPERM;
    }
    if (too_long("exchange", r->exchange, err, errlen) ||
        too_long("routing_key", r->routing_key, err, errlen) ||
        too_long("message_type", r->message_type, err, errlen) ||
        too_long("content_type", r->content_type, err, errlen) ||
        too_long("correlation_id", r->correlation_id, err, errlen))
        return SINK_EPERM;
    memset(&p, 0, sizeof p);
    if (r->headers_json != NULL) {
        if (amqpsink_json_headers(r->headers_json, strlen(r->headers_json), &p.headers, &hmem, err,
                                  errlen) < 0)
            return SINK_EPERM;
        p._flags |= AMQP_BASIC_HEADERS_FLAG;
    }

    if (cur_state(s) != SINK_UP) {
        free(hmem);
        return SINK_EAGAIN; /* on_state(SINK_UP) follows */
    }
    if (s->pch != PCH_OPEN || s->st.active) {
        /* the channel is being reopened (nack_reopen), or a large message is
         * being written on it: its frames must stay contiguous */
        s->want_writable = true;
        free(hmem);
        return SINK_EAGAIN; /* on_writable follows */
    }
    /* Does the exchange exist? Asked before the window: a refusal or a wait
     * needs no room, and the check starts early. */
    rc = amqpsink_xcheck_dest(s, r->exchange, err, errlen);
    if (rc != SINK_QUEUED) {
        free(hmem);
        return rc;
    }
    advance_tail(s);
    if (s->inflight >= (size_t)s->cfg.publish_window || s->next_tag - s->tail_tag > s->ring_mask ||
        broker_silent(s)) {
        s->want_writable = true;
        free(hmem);
        return SINK_EAGAIN;
    }
    if (burst_used(s) >= AMQPSINK_PUMP_BYTES) {
        /* this turn of the loop wrote enough: the next one goes on (wio_cb) */
        wait_room(s, 0);
        free(hmem);
        return SINK_EAGAIN;
    }
    nframes = r->payload_len / (AMQPSINK_FRAME_MAX - 8) + 1;
    est = r->payload_len + 8 * nframes + 1024 + strlen(r->exchange) + strlen(r->routing_key) +
          (r->headers_json ? 2 * strlen(r->headers_json) : 0);
    if (s->conf.tls)
        est += est / 64 + 1024;
    if (est <= AMQPSINK_STREAM_MIN && !amqpsink_sock_room(s, est)) {
        wait_room(s, est);
        free(hmem);
        return SINK_EAGAIN;
    }

    p._flags |= AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_MESSAGE_ID_FLAG |
                AMQP_BASIC_TIMESTAMP_FLAG;
    p.delivery_mode = AMQP_DELIVERY_PERSISTENT;
    p.message_id = amqpsink_bytes(r->message_id);
    p.timestamp = r->created_at_us > 0 ? (uint64_t)(r->created_at_us / 1000000) : 0;
    if (r->correlation_id != NULL) {
        p._flags |= AMQP_BASIC_CORRELATION_ID_FLAG;
        p.correlation_id = amqpsink_bytes(r->correlation_id);
    }
    if (r->message_type != NULL) {
        p._flags |= AMQP_BASIC_TYPE_FLAG;
        p.type = amqpsink_bytes(r->message_type);
    }
    if (r->content_type != NULL) {
        p._flags |= AMQP_BASIC_CONTENT_TYPE_FLAG;
        p.content_type = amqpsink_bytes(r->content_type);
    }
    if (est > AMQPSINK_STREAM_MIN) {
        rc = publish_stream(s, r, &p, msg_ud, est - r->payload_len, err, errlen);
        free(hmem);
        return rc;
    }
    /* Only headers can make the properties larger than a frame (the other fields are
     * short strings, checked above): a row with headers is checked before any frame of
     * it is sent. */
    if (r->headers_json != NULL && !props_fit(s, &p)) {
        free(hmem);
        snprintf(err, errlen, "message properties too large for one frame");
        return SINK_EPERM;
    }
    body.len = r->payload_len;
    body.bytes = (void *)(uintptr_t)r->payload;
    rc = amqp_basic_publish(s->conn, s->ch, amqpsink_bytes(r->exchange),
                            amqpsink_bytes(r->routing_key), 1 /* mandatory */, 0 /* immediate */,
                            &p, body);
    free(hmem);
    if (rc != AMQP_STATUS_OK) {
        /* The connection is broken (maybe mid-message, a method frame sent without
         * its header): fail it from the loop. */
        amqpsink_mark_broken(s, "publish", rc);
        return SINK_EAGAIN;
    }
    (void)ring_add(s, r, msg_ud);
    s->burst_bytes += r->payload_len;
    amqpsink_wake_reader(s); /* basic_publish may read from the socket too */
    return SINK_QUEUED;
}

/* ------------------------------------------------------- ops: what metrics show */

static size_t amqpsink_addresses(const cfg_sink *sc, const char **out, size_t max)
{
    const amqpsink_conf *ac = amqpsink_conf_of(sc);
    size_t n = 0;

    for (; ac != NULL && n < ac->n_brokers && n < max; n++)
        out[n] = ac->brokers[n].addr;
    return n;
}

static long amqpsink_broker_index(const sink *s)
{
    return s->connected;
}

const sink_ops amqpsink_ops = {
    .name = "rabbitmq",
    .create = amqpsink_create,
    .destroy = amqpsink_destroy,
    .start = amqpsink_start,
    .publish = amqpsink_publish,
    .in_flight = amqpsink_in_flight,
    .writing = amqpsink_writing,
    .check = amqpsink_check,
    .quiesce = amqpsink_quiesce,
    .addresses = amqpsink_addresses,
    .broker = amqpsink_broker_index,
};
