/*
 * amqpsink.h — the RabbitMQ sink's state on the event loop, shared by the
 * files that run there: amqpsink.c (the connection, the publishing channel and
 * its reopen, the ring of messages in flight, frames, publish), amqpxcheck.c
 * (the exchange checks: their cache and their channel) and amqpwire.c (the
 * socket's options and room, the sends that do not wait for their answer).
 * Nothing here blocks; the work off the loop is amqpconnect.h's.
 */
#ifndef SINKS_RABBITMQ_AMQPSINK_H
#define SINKS_RABBITMQ_AMQPSINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <amqp.h>
#include <ev.h>

#include "relay/sink.h"
#include "sinks/rabbitmq/amqpcfg.h"
#include "sinks/rabbitmq/amqpconnect.h"

#define AMQPSINK_XBUCKETS    256 /* hash buckets of the exchange cache */
#define AMQPSINK_CHECK_BYTES 512 /* socket room wanted for one check's or reopen's frame */

/* What the cache knows about one exchange. */
enum xstate {
    X_QUEUED = 0, /* waiting in the check FIFO */
    X_CHECKING,   /* its passive exchange.declare is in flight */
    X_EXISTS,     /* declare-ok: publish */
    X_MISSING,    /* 404: SINK_EREFUSED until expires */
    X_REFUSED     /* another channel error (e.g. 403): SINK_EREFUSED until expires */
};

typedef struct xent {
    struct xent *next;  /* hash chain */
    struct xent *qnext; /* check FIFO (X_QUEUED only) */
    ev_tstamp expires;  /* X_EXISTS / X_MISSING / X_REFUSED */
    enum xstate state;
    char *why; /* owned; the refusal for X_MISSING / X_REFUSED */
    char name[];
} xent;

/* The check channel, one per connection. */
enum ckstate {
    CK_CLOSED = 0, /* not open (never, or closed by the broker's 404) */
    CK_OPENING,    /* channel.open sent */
    CK_IDLE,       /* open, nothing in flight */
    CK_BUSY        /* exchange.declare (passive) of ck_cur in flight */
};

/* The publishing channel, while the connection is up. It is reopened without
 * waiting on the loop: after the broker closed it (chan_ok false: the sink is
 * DOWN meanwhile), or when it got only nacks for nack_reopen (the sink stays
 * UP; publish() says SINK_EAGAIN until it is open again). */
enum pchstate {
    PCH_OPEN = 0,    /* in confirm mode: publish */
    PCH_DRAIN,       /* only nacks lately: nothing new is published; once every message
                       in flight is answered, the channel is closed and reopened */
    PCH_WANT_OPEN,   /* channel.open not sent yet (waiting for room in the socket) */
    PCH_OPENING,     /* channel.open sent on ch */
    PCH_WANT_SELECT, /* channel.open-ok came; confirm.select not sent yet (socket room) */
    PCH_SELECTING    /* confirm.select sent on ch */
};

/* A basic.return read from the publishing channel: its method, then its
 * content header (which names the message), then body frames to skip. */
enum ret_stage {
    RET_NONE = 0,    /* no basic.return in progress */
    RET_WANT_HEADER, /* basic.return seen: its content header names the message */
    RET_SKIP_BODY    /* header seen: ret_left body bytes follow, unused */
};

/* A published message waiting for its confirm, in the ring (by delivery tag). */
typedef struct ring_msg {
    const row *r; /* borrowed: the caller keeps it valid until on_result */
    void *msg_ud;
    uint64_t tag;
    ev_tstamp published_at;
    bool live;
    bool returned;
    char *ret_reason; /* owned; set by basic.return */
} ring_msg;

/* A message written in frames as the socket drains (amqpsink.c, stream_pump):
 * its method and header frames went out in publish(); its body frames follow,
 * each whole (rabbitmq-c's amqp_send_frame), so the connection is always at a
 * frame boundary between two calls and another channel's frames or a heartbeat
 * may go in between. Nothing else is published on the channel meanwhile: the
 * frames of one publish stay contiguous there. */
typedef struct stream_msg {
    bool active;
    uint64_t tag;          /* its delivery tag: the ring slot */
    const uint8_t *body;   /* borrowed: the row's payload, valid until on_result */
    size_t len, off;       /* body bytes in all, and written so far */
    ev_tstamp progress_at; /* when the socket last took a frame of it */
    void *written_ud;      /* its msg_ud once written whole outside publish(): on_written */
} stream_msg;

struct sink {
    struct ev_loop *loop;
    cfg_sink cfg;       /* copy: name owned, no url or password; backend_conf = &conf */
    amqpsink_conf conf; /* deep copy (owned) */
    char *conn_name;    /* owned */
    char ident[300];    /* "broker host:port vhost V" for messages */
    amqpsink_job *job;  /* the connection attempt in progress, or NULL */
    ev_async jobw;      /* its hand-off */
    sink_cbs cbs;

    amqp_connection_state_t conn; /* NULL when down */
    amqp_channel_t ch;
    bool chan_ok;
    enum pchstate pch;
    ev_tstamp pch_sent_at; /* when channel.open / confirm.select was sent */
    uint32_t nack_run;     /* messages nacked in a row on this channel (no ack since) */
    ev_tstamp nack_since;  /* when the first of them was nacked */
    char nack_why[200];    /* why the channel is being reopened (PCH_DRAIN) */

    /* Broker addresses (conf.brokers, at least one). cur is the one connected, or
     * tried next; a failed attempt or a lost connection moves it on, and the
     * back-off grows once per round in which every address failed. */
    size_t cur;
    size_t round_fails; /* failed attempts in the current round */
    long connected;     /* index connected now, -1 none */
    long last_up;       /* index of the last connection made, -1 none */
    bool blocked;
    ev_tstamp unblocked_at; /* confirms are not awaited while blocked: clock restarts here */
    bool broken;            /* publish hit a socket error: failing soon */
    char broken_why[200];
    int reported;      /* last state given to on_state, -1 none */
    size_t sndcap;     /* usable socket send buffer bytes */
    int hb;            /* negotiated heartbeat, seconds (0: off) */
    ev_tstamp last_rx; /* last time the socket had data for us */

    ring_msg *ring; /* owned, ring_mask + 1 slots */
    uint64_t ring_mask;
    uint64_t next_tag; /* next delivery tag on this channel */
    uint64_t tail_tag; /* no live message below this tag */
    size_t inflight;
    bool want_writable;
    size_t want_bytes;

    stream_msg st;       /* the large message being written, if any */
    unsigned burst_iter; /* the loop's turn (ev_iteration) burst_bytes counts for */
    size_t burst_bytes;  /* message bytes written in that turn (AMQPSINK_PUMP_BYTES) */

    /* basic.return in progress: method seen, header/body frames follow */
    enum ret_stage ret_stage;
    uint64_t ret_left;
    char ret_reason[700];

    ev_io rio, wio;
    ev_timer tick, retry, wretry, failt;
    ev_timer nackt; /* nack_reopen after the first nack of a run */
    int64_t backoff_ms;
    uint64_t rnd; /* xorshift64 state of the reconnect jitter */

    /* Exchange checks (see the top of amqpxcheck.c). All of it belongs to the
     * connection: amqpsink_conn_fail() forgets it. */
    xent *xb[AMQPSINK_XBUCKETS]; /* the cache, chained */
    size_t xcount;
    xent *xq_head, *xq_tail; /* names waiting for a check */
    size_t xq_len;
    amqp_channel_t ck_ch; /* the check channel; 0: none (channel_max < 2) */
    enum ckstate ck_state;
    xent *ck_cur;         /* the exchange being checked (CK_BUSY) */
    ev_tstamp ck_sent_at; /* when the pending channel.open / declare was sent */
    bool ck_resolved;     /* a check answered: on_writable is due */

    int depth;  /* nesting of loop callbacks into this sink */
    bool dying; /* destroy() called inside a callback */
};

/* amqpsink.c, for amqpxcheck.c */

/* A send failed: the connection may be mid-frame. Fails it from the loop soon
 * (the caller may be publish(), which must not call back). */
void amqpsink_mark_broken(sink *s, const char *what, int rc);
/* Tears the connection down: on_state(DOWN), every message in flight LOST,
 * reconnect later (to the next address of a list). False when the sink was
 * destroyed from a callback: the caller returns at once without touching s. */
bool amqpsink_conn_fail(sink *s, const char *why);

/* amqpwire.c: the socket and the sends that do not wait */

/* A new connection's socket options: a large send buffer (sndcap: what it holds) and
 * TCP_USER_TIMEOUT = confirm_timeout. Best effort. */
void amqpsink_set_sock_opts(sink *s);
/* TCP_USER_TIMEOUT lifted (on false: while the broker blocks the connection it stops
 * reading on purpose) or restored. */
void amqpsink_set_user_timeout(sink *s, bool on);
/* Whether the socket's send buffer has room for need more bytes (an empty one
 * always has: TCP_USER_TIMEOUT bounds it). */
OUTBOX_MUST_CHECK bool amqpsink_sock_room(sink *s, size_t need);
/* The highest channel number the connection allows (its channel_max; 0, no limit,
 * counts as 65535). */
amqp_channel_t amqpsink_channel_max(amqp_connection_state_t conn);
/* rabbitmq-c's send may read from the socket (its heartbeat check): frames it queued
 * then would never wake the read watcher. Call after each send: feeds it when some wait. */
void amqpsink_wake_reader(sink *s);
/* Sends method id (m: its decoded struct) on channel ch without waiting for the
 * answer, which comes through the frame handler (channel.open, confirm.select, a
 * passive exchange.declare). A failed send marks the connection broken, what naming
 * the step; never calls back. The caller checks for socket room first. */
void amqpsink_send_nowait(sink *s, amqp_channel_t ch, amqp_method_number_t id, void *m,
                          const char *what);
/* channel.open of ch, sent as amqpsink_send_nowait does. */
void amqpsink_open_channel(sink *s, amqp_channel_t ch, const char *what);
/* Answers the broker's channel.close of ch: rabbitmq-c's status of the close-ok. */
int amqpsink_close_ok(sink *s, amqp_channel_t ch);

/* amqpxcheck.c: the exchange checks (see the top of amqpxcheck.c) */

/* The check channel of a new connection: its highest channel number, or 0 (no
 * checks) when the broker allows a single channel. */
amqp_channel_t amqpsink_xcheck_channel(amqp_connection_state_t conn);
/* Forgets every answer and every pending check (the connection is gone). */
void amqpsink_xcheck_reset(sink *s);
/* Whether a row to exchange ex may be published now: SINK_QUEUED (go on),
 * SINK_EWAIT (its check is pending), SINK_EREFUSED (err says why) or
 * SINK_EAGAIN (too many names waiting). Never calls back. */
OUTBOX_MUST_CHECK int amqpsink_xcheck_dest(sink *s, const char *ex, char *err, size_t errlen);
/* Sends the check channel's next step when it has one and the socket has room. */
void amqpsink_xcheck_kick(sink *s);
/* Fails the connection when a check went unanswered for confirm_timeout.
 * False when the sink was destroyed. */
OUTBOX_MUST_CHECK bool amqpsink_xcheck_timeout(sink *s);
/* A frame on the check channel. False when the sink was destroyed. */
OUTBOX_MUST_CHECK bool amqpsink_xcheck_frame(sink *s, const amqp_frame_t *f);
/* The publishing channel was closed by a 404 naming ex: remember it missing. */
void amqpsink_xcheck_missing(sink *s, const char *ex, const char *text);

#endif
