/*
 * sink.h — what the relay core needs from a message broker. The core never
 * names RabbitMQ: it talks to this ops table. Everything runs on the loop
 * thread; no call blocks without a bound.
 *
 * Each outbox owns its own sink instance (its own broker connection), so a
 * channel closed by one outbox's bad message never disturbs another outbox.
 */
#ifndef RELAY_SINK_H
#define RELAY_SINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "config/cfg.h"
#include "relay/row.h"

struct ev_loop;
typedef struct sink sink;

enum sink_state {
    SINK_DOWN = 0,      /* not connected (connecting / backing off) */
    SINK_UP,            /* connected, channel open in confirm mode: publish */
    SINK_BLOCKED        /* connected but the broker sent connection.blocked: do not publish */
};

/* Final result of one accepted publish; delivered exactly once per accepted
 * message, on the loop, never from inside sink_ops.publish. */
enum sink_outcome {
    SINK_ACK = 0,       /* broker confirmed and it was routed: success */
    SINK_RETURNED,      /* basic.return (unroutable, mandatory): a failed attempt */
    SINK_NACKED,        /* basic.nack: a failed attempt */
    SINK_REJECTED,      /* the channel was closed because of this message (404 no exchange,
                           403, 406...): a failed attempt */
    SINK_LOST           /* connection/channel lost or confirm timeout while in flight: not the
                           message's fault; give it back without counting an attempt */
};

/* Events worth a log line and a counter that change no state (on_event). */
enum sink_event {
    SINK_EV_NACK_REOPEN = 0   /* the publishing channel got only nacks for a while
                                 (nack_reopen): it is reopened; the sink stays UP */
};

typedef struct sink_cbs {
    void *ud;
    /* peer: the broker this is about, for logs ("127.0.0.1:5672 vhost /"); msg says what
       happened and names the peer first ("broker <peer>: <reason>"). Both valid during
       the callback only. */
    void (*on_state)(void *ud, enum sink_state state, const char *peer, const char *msg);
    /* msg names the peer and the reason. May be NULL. */
    void (*on_event)(void *ud, enum sink_event event, const char *msg);
    /* reason: valid during the callback; NULL for SINK_ACK */
    void (*on_result)(void *ud, void *msg_ud, enum sink_outcome outcome, const char *reason);
    /* Room again after publish returned SINK_EAGAIN (window/socket space freed). */
    void (*on_writable)(void *ud);
    /* The message publish() accepted while its body was still being written (writing()
       named it then) is now written whole: the sink reads its payload no more (the row's
       other fields it may still read until on_result). Not called when the message's
       writing stopped short (its on_result, SINK_LOST, follows). Never from inside
       publish. May be NULL. */
    void (*on_written)(void *ud, void *msg_ud);
} sink_cbs;

/* publish() return values */
#define SINK_QUEUED    0    /* accepted: on_result follows exactly once */
#define SINK_EAGAIN    1    /* not now (window full, socket full, blocked, down): retry after
                               on_writable / on_state(SINK_UP); nothing was sent */
#define SINK_EPERM    (-1)  /* this row can never be published (malformed headers, too large);
                               reason in err: dead-letter it. Nothing was sent. */
#define SINK_EWAIT     2    /* this row's destination is being checked (e.g. whether its
                               exchange exists); nothing was sent. Other rows may be
                               published now; retry this one after on_writable. */
#define SINK_EREFUSED (-2)  /* the broker would refuse this row now (e.g. its exchange does
                               not exist): a failed attempt, reason in err. Nothing was
                               sent, and no other message was disturbed. */

typedef struct sink_ops {
    const char *name;   /* "rabbitmq" */
    /* conn_name: shown in the broker's management UI ("outbox-relay <relay>/<outbox>"). */
    int  (*create)(struct ev_loop *loop, const cfg_sink *cfg, const char *conn_name,
                   const sink_cbs *cbs, sink **out, char *err, size_t errlen);
    /* Closes the connection. Outstanding messages get no callback. */
    void (*destroy)(sink *s);
    void (*start)(sink *s);            /* begin connecting */
    /* row stays owned by the caller and must stay valid until on_result; its payload
       only until the body is written: when publish returns SINK_QUEUED and writing()
       does not name msg_ud, at once; else at on_written. */
    int  (*publish)(sink *s, const row *r, void *msg_ud, char *err, size_t errlen);
    /* The msg_ud of the accepted message whose body the sink is still writing (it still
       reads that row's payload), NULL when none. NULL op: the sink reads every payload
       until on_result. */
    void *(*writing)(const sink *s);
    size_t (*in_flight)(const sink *s);
    /* Admin: blocking login + confirm.select + close, bounded by timeouts, to every
       address of the configuration. On failure err holds one line per problem
       ('\n'-separated); on success it may hold a note for the OK line ("" if none). */
    int  (*check)(const cfg_sink *cfg, char *err, size_t errlen);
    /* Before the process exits, after every sink is destroyed: waits (at most
       timeout_ms) for background work the implementation still runs, such as a
       connection attempt on a worker thread, to end. NULL: nothing to wait for. */
    void (*quiesce)(int64_t timeout_ms);
    /* The addresses the configuration names (a cluster's nodes, in the order it tries
       them), for metrics: at most max into out (borrowed from cfg); returns how many.
       NULL: none named. */
    size_t (*addresses)(const cfg_sink *cfg, const char **out, size_t max);
    /* Which of those addresses the connection is up to: its index, -1 when down. */
    long (*broker)(const sink *s);
} sink_ops;

#define SINK_MAX_ADDRESSES 16   /* addresses of one sink the metrics show */

/* The ops of a sink's implementation (registered by sinks/, found by config/). */
static inline const sink_ops *sink_ops_of(const cfg_sink *sc)
{
    return (const sink_ops *)sc->type->ops;
}

#endif
