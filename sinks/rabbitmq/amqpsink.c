/*
 * amqpsink.c — the RabbitMQ sink (relay/sink.h) on rabbitmq-c 0.11 and libev.
 *
 * One connection, one channel in confirm mode. Publishes are pipelined over
 * publish_window; acks/nacks/returns/channel.close are read from the loop with
 * amqp_simple_wait_frame_noblock(zero timeout) whenever the socket is readable
 * and on a periodic tick (heartbeats, confirm timeout).
 *
 * Bounded blocking:
 *  - connect/login/channel.open/confirm.select: each bounded by connect_timeout
 *    (socket open timeout, handshake timeout, rpc timeout). DNS is not bounded.
 *  - publish: rabbitmq-c's send waits without a deadline when the socket
 *    buffer is full, so publish() first checks the free space in the socket
 *    send buffer (SIOCOUTQ vs SO_SNDBUF) and says SINK_EAGAIN when the encoded
 *    message might not fit. A message larger than the whole buffer is only
 *    written into an empty buffer; TCP_USER_TIMEOUT (= confirm_timeout, lifted
 *    while the broker blocks the connection) bounds how long the kernel keeps
 *    unacknowledged data before the socket errors.
 *  - destroy: connection.close with a short rpc timeout.
 *
 * Every in-flight message lives in a ring indexed by delivery tag. Results
 * are delivered only from loop callbacks, never from inside publish(). A
 * callback may call publish() or destroy(): every path re-checks s->dying
 * after a callback and the outermost loop callback frees a destroyed sink.
 *
 * Destination checks: a publish to an exchange that does not exist makes the
 * broker close the publishing channel (404), and every unconfirmed message on
 * it is lost with it. So before the first publish to a named exchange (not ""
 * and not amq.*, which the broker itself defines), publish() answers
 * SINK_EWAIT and asks the broker with a passive exchange.declare on a second
 * channel of the same connection (the "check channel", the highest channel
 * number), without waiting: the replies arrive through handle_frame like
 * acks. The answers are cached per connection (AMQPSINK_XOK_TTL,
 * AMQPSINK_XMISSING_TTL); a row to a missing exchange then gets SINK_EREFUSED
 * and nothing else is disturbed. A 404 closes the check channel instead; it
 * is reopened asynchronously before the next check. One check is in flight at
 * a time; names wait in a bounded FIFO.
 */
#include "relay/sink.h"
#include "sinks/rabbitmq/json.h"

#include <amqp.h>
#include <amqp_ssl_socket.h>
#include <amqp_tcp_socket.h>
#include <errno.h>
#include <ev.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#ifndef OUTBOX_VERSION
#define OUTBOX_VERSION "dev"
#endif

#define AMQPSINK_FRAME_MAX     131072
#define AMQPSINK_SNDBUF        (4 * 1024 * 1024)
#define AMQPSINK_BACKOFF_MIN   0.1
#define AMQPSINK_DRAIN_MAX     4096   /* frames per readable event before yielding */
#define AMQPSINK_CLOSE_TIMEOUT 2000   /* ms, destroy()'s connection.close */
#define AMQPSINK_SYS_CA        "/etc/ssl/certs/ca-certificates.crt"

/* Exchange checks. An exchange seen to exist is trusted for AMQPSINK_XOK_TTL
 * seconds: should it be deleted meanwhile, the publishing channel's 404 still
 * settles the culprit (REJECTED) and the rest (LOST), and marks it missing
 * here. A missing (or refused) one is remembered only briefly, so a retried row
 * learns soon that someone created it, while a burst of rows to it costs one
 * round trip, not one each. */
#define AMQPSINK_XOK_TTL       30.0   /* s */
#define AMQPSINK_XMISSING_TTL  1.0    /* s */
#define AMQPSINK_XQUEUE_MAX    1024   /* names waiting for a check; past it SINK_EAGAIN */
#define AMQPSINK_XCACHE_MAX    2048   /* cached names (memory bound: names are <= 255 bytes) */
#define AMQPSINK_XBUCKETS      256    /* hash buckets of the cache */
#define AMQPSINK_CHECK_BYTES   512    /* socket room wanted for one check's frame */

/* What the cache knows about one exchange. */
enum xstate {
    X_QUEUED = 0,   /* waiting in the check FIFO */
    X_CHECKING,     /* its passive exchange.declare is in flight */
    X_EXISTS,       /* declare-ok: publish */
    X_MISSING,      /* 404: SINK_EREFUSED until expires */
    X_REFUSED       /* another channel error (e.g. 403): SINK_EREFUSED until expires */
};

typedef struct xent {
    struct xent *next;       /* hash chain */
    struct xent *qnext;      /* check FIFO (X_QUEUED only) */
    ev_tstamp    expires;    /* X_EXISTS / X_MISSING / X_REFUSED */
    int          state;      /* enum xstate */
    char        *why;        /* owned; the refusal for X_MISSING / X_REFUSED */
    char         name[];
} xent;

/* The check channel, one per connection. */
enum ckstate {
    CK_CLOSED = 0,  /* not open (never, or closed by the broker's 404) */
    CK_OPENING,     /* channel.open sent */
    CK_IDLE,        /* open, nothing in flight */
    CK_BUSY         /* exchange.declare (passive) of ck_cur in flight */
};

typedef struct entry {
    const row    *r;           /* borrowed: the caller keeps it valid until on_result */
    void         *msg_ud;
    uint64_t      tag;
    ev_tstamp     published_at;
    bool          live;
    bool          returned;
    char         *ret_reason;  /* owned; set by basic.return */
} entry;

struct sink {
    struct ev_loop *loop;
    cfg_sink        cfg;          /* deep copy of the strings we use (owned) */
    char           *conn_name;    /* owned */
    char            ident[300];   /* "host:port vhost '/'" for messages */
    sink_cbs        cbs;

    amqp_connection_state_t conn; /* NULL when down */
    amqp_channel_t  ch;
    bool            chan_ok;
    bool            blocked;
    ev_tstamp       unblocked_at;  /* confirms are not awaited while blocked: clock restarts here */
    bool            broken;       /* publish hit a socket error: failing soon */
    char            broken_why[200];
    int             reported;     /* last state given to on_state, -1 none */
    size_t          sndcap;       /* usable socket send buffer bytes */
    int             hb;           /* negotiated heartbeat, seconds (0: off) */
    ev_tstamp       last_rx;      /* last time the socket had data for us */

    entry          *ring;         /* owned, ring_mask + 1 slots */
    uint64_t        ring_mask;
    uint64_t        next_tag;     /* next delivery tag on this channel */
    uint64_t        tail_tag;     /* no live entry below this tag */
    size_t          inflight;
    bool            want_writable;
    size_t          want_bytes;

    /* basic.return in progress: method seen, header/body frames follow */
    int             ret_stage;    /* 0 none, 1 want header, 2 skipping body */
    uint64_t        ret_left;
    char            ret_reason[700];

    ev_io           rio, wio;
    ev_timer        tick, retry, wretry, failt;
    double          backoff;
    uint64_t        rnd;

    /* Exchange checks (see the top of the file). All of it belongs to the
     * connection: conn_fail() forgets it. */
    xent           *xb[AMQPSINK_XBUCKETS];  /* the cache, chained */
    size_t          xcount;
    xent           *xq_head, *xq_tail;      /* names waiting for a check */
    size_t          xq_len;
    amqp_channel_t  ck_ch;        /* the check channel; 0: none (channel_max < 2) */
    int             ck_state;     /* enum ckstate */
    xent           *ck_cur;       /* the exchange being checked (CK_BUSY) */
    ev_tstamp       ck_sent_at;   /* when the pending channel.open / declare was sent */
    bool            ck_resolved;  /* a check answered: on_writable is due */

    int             depth;        /* nesting of loop callbacks into this sink */
    bool            dying;        /* destroy() called inside a callback */
};

/* ------------------------------------------------------------------ utils */

static void fmt_reply(amqp_rpc_reply_t r, const char *what, char *buf, size_t len)
{
    switch (r.reply_type) {
    case AMQP_RESPONSE_NORMAL:
        snprintf(buf, len, "%s: ok", what);
        break;
    case AMQP_RESPONSE_NONE:
        snprintf(buf, len, "%s: no reply", what);
        break;
    case AMQP_RESPONSE_LIBRARY_EXCEPTION:
        snprintf(buf, len, "%s: %s", what, amqp_error_string2(r.library_error));
        break;
    case AMQP_RESPONSE_SERVER_EXCEPTION:
        if (r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
            const amqp_connection_close_t *m = r.reply.decoded;
            snprintf(buf, len, "%s: broker closed the connection: %u %.*s", what,
                     (unsigned)m->reply_code, (int)m->reply_text.len,
                     (const char *)m->reply_text.bytes);
        } else if (r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
            const amqp_channel_close_t *m = r.reply.decoded;
            snprintf(buf, len, "%s: broker closed the channel: %u %.*s", what,
                     (unsigned)m->reply_code, (int)m->reply_text.len,
                     (const char *)m->reply_text.bytes);
        } else {
            snprintf(buf, len, "%s: unexpected broker method 0x%08x", what,
                     (unsigned)r.reply.id);
        }
        break;
    default:
        snprintf(buf, len, "%s: unknown reply type", what);
        break;
    }
}

static amqp_bytes_t cbytes(const char *s)
{
    amqp_bytes_t b;

    b.len = strlen(s);
    b.bytes = (void *)(uintptr_t)s;   /* rabbitmq-c never writes through it */
    return b;
}

static struct timeval tv_ms(int64_t ms)
{
    struct timeval tv;

    if (ms < 1)
        ms = 1;
    tv.tv_sec = (time_t)(ms / 1000);
    tv.tv_usec = (suseconds_t)((ms % 1000) * 1000);
    return tv;
}

static int heartbeat_s(const cfg_sink *c)
{
    int64_t s;

    if (c->heartbeat_ms <= 0)
        return 0;
    s = (c->heartbeat_ms + 999) / 1000;
    return s > 65535 ? 65535 : (int)s;
}

static void set_ident(char *buf, size_t len, const cfg_sink *c)
{
    snprintf(buf, len, "%s:%d vhost '%s'", c->host ? c->host : "?", c->port,
             c->vhost ? c->vhost : "?");
}

/* ------------------------------------------------------------ connecting */

/* Builds the client-properties table in caller storage (no allocation). */
struct props_storage {
    amqp_table_entry_t caps[5];
    amqp_table_entry_t top[4];
};

static amqp_table_t client_props(struct props_storage *ps, const char *conn_name)
{
    static const char *const capnames[5] = {
        "publisher_confirms", "basic.nack", "connection.blocked",
        "consumer_cancel_notify", "authentication_failure_close"
    };
    amqp_table_t t;

    for (int i = 0; i < 5; i++) {
        ps->caps[i].key = cbytes(capnames[i]);
        ps->caps[i].value.kind = AMQP_FIELD_KIND_BOOLEAN;
        ps->caps[i].value.value.boolean = 1;
    }
    ps->top[0].key = cbytes("capabilities");
    ps->top[0].value.kind = AMQP_FIELD_KIND_TABLE;
    ps->top[0].value.value.table.num_entries = 5;
    ps->top[0].value.value.table.entries = ps->caps;
    ps->top[1].key = cbytes("connection_name");
    ps->top[1].value.kind = AMQP_FIELD_KIND_UTF8;
    ps->top[1].value.value.bytes = cbytes(conn_name ? conn_name : "outbox-relay");
    ps->top[2].key = cbytes("product");
    ps->top[2].value.kind = AMQP_FIELD_KIND_UTF8;
    ps->top[2].value.value.bytes = cbytes("outbox-relay");
    ps->top[3].key = cbytes("version");
    ps->top[3].value.kind = AMQP_FIELD_KIND_UTF8;
    ps->top[3].value.value.bytes = cbytes(OUTBOX_VERSION);
    t.num_entries = 4;
    t.entries = ps->top;
    return t;
}

/* Blocking connect + login + channel.open(ch) + confirm.select, each step
 * bounded by connect_timeout. Returns 0 and *out, or -1 with err. */
static int conn_open(const cfg_sink *c, const char *conn_name, amqp_channel_t ch,
                     amqp_connection_state_t *out, char *err, size_t errlen)
{
    amqp_connection_state_t conn;
    amqp_socket_t          *sock;
    struct timeval          tv = tv_ms(c->connect_timeout_ms);
    struct props_storage    ps;
    amqp_table_t            props;
    amqp_rpc_reply_t        r;
    int                     rc;

    *out = NULL;
    conn = amqp_new_connection();
    if (conn == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (c->tls) {
        const char *ca = c->tls_ca_file;

        sock = amqp_ssl_socket_new(conn);   /* owned by conn */
        if (sock == NULL) {
            snprintf(err, errlen, "cannot create a TLS socket");
            goto fail;
        }
        if (ca == NULL && c->tls_verify && access(AMQPSINK_SYS_CA, R_OK) == 0)
            ca = AMQPSINK_SYS_CA;
        if (ca != NULL && (rc = amqp_ssl_socket_set_cacert(sock, ca)) != AMQP_STATUS_OK) {
            snprintf(err, errlen, "tls_ca_file %s: %s", ca, amqp_error_string2(rc));
            goto fail;
        }
        amqp_ssl_socket_set_verify_peer(sock, c->tls_verify ? 1 : 0);
        amqp_ssl_socket_set_verify_hostname(sock, c->tls_verify ? 1 : 0);
    } else {
        sock = amqp_tcp_socket_new(conn);   /* owned by conn */
        if (sock == NULL) {
            snprintf(err, errlen, "cannot create a socket");
            goto fail;
        }
    }
    if ((rc = amqp_set_handshake_timeout(conn, &tv)) != AMQP_STATUS_OK ||
        (rc = amqp_set_rpc_timeout(conn, &tv)) != AMQP_STATUS_OK) {
        snprintf(err, errlen, "setting timeouts: %s", amqp_error_string2(rc));
        goto fail;
    }
    rc = amqp_socket_open_noblock(sock, c->host, c->port, &tv);
    if (rc != AMQP_STATUS_OK) {
        snprintf(err, errlen, "connect: %s", amqp_error_string2(rc));
        goto fail;
    }
    props = client_props(&ps, conn_name);
    r = amqp_login_with_properties(conn, c->vhost, 0, AMQPSINK_FRAME_MAX, heartbeat_s(c),
                                   &props, AMQP_SASL_METHOD_PLAIN, c->user, c->pass);
    if (r.reply_type != AMQP_RESPONSE_NORMAL) {
        fmt_reply(r, "login", err, errlen);
        goto fail;
    }
    amqp_channel_open(conn, ch);
    r = amqp_get_rpc_reply(conn);
    if (r.reply_type != AMQP_RESPONSE_NORMAL) {
        fmt_reply(r, "channel.open", err, errlen);
        goto fail;
    }
    amqp_confirm_select(conn, ch);
    r = amqp_get_rpc_reply(conn);
    if (r.reply_type != AMQP_RESPONSE_NORMAL) {
        fmt_reply(r, "confirm.select", err, errlen);
        goto fail;
    }
    *out = conn;   /* ownership to the caller */
    return 0;
fail:
    amqp_destroy_connection(conn);
    return -1;
}

/* Sends connection.close and waits for close-ok, bounded; then frees conn. */
static void conn_close(amqp_connection_state_t conn, bool polite)
{
    if (conn == NULL)
        return;
    if (polite) {
        struct timeval tv = tv_ms(AMQPSINK_CLOSE_TIMEOUT);
        int            fd = amqp_get_sockfd(conn);
        int            queued = 0;
        int            sndbuf = 0;
        socklen_t      sl = sizeof sndbuf;

        /* Skip the courtesy when the send buffer is nearly full: the close
         * frame's send would wait without a deadline. */
        if (fd >= 0 && ioctl(fd, SIOCOUTQ, &queued) == 0 &&
            getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &sl) == 0 &&
            queued + 4096 < sndbuf / 2 &&
            amqp_set_rpc_timeout(conn, &tv) == AMQP_STATUS_OK)
            (void)amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
    }
    amqp_destroy_connection(conn);
}

/* ------------------------------------------------------------ ring / state */

static entry *slot(sink *s, uint64_t tag)
{
    return &s->ring[tag & s->ring_mask];
}

static entry *find_live(sink *s, uint64_t tag)
{
    entry *e;

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

static int cur_state(const sink *s)
{
    if (s->conn == NULL || !s->chan_ok || s->broken)
        return SINK_DOWN;
    return s->blocked ? SINK_BLOCKED : SINK_UP;
}

/* ------------------------------------------------------------ exchange cache */

static bool x_is_pending(const xent *x)
{
    return x->state == X_QUEUED || x->state == X_CHECKING;
}

static size_t x_bucket(const char *name)
{
    uint32_t h = 2166136261u;   /* FNV-1a */

    for (const unsigned char *p = (const unsigned char *)name; *p != '\0'; p++) {
        h ^= *p;
        h *= 16777619u;
    }
    return h % AMQPSINK_XBUCKETS;
}

static xent *x_find(sink *s, const char *name)
{
    for (xent *x = s->xb[x_bucket(name)]; x != NULL; x = x->next) {
        if (strcmp(x->name, name) == 0)
            return x;
    }
    return NULL;
}

/* Drops cached answers (never a pending name: a row waits for it): the
 * expired ones, or every one when all is true. */
static void x_sweep(sink *s, bool all)
{
    ev_tstamp now = ev_now(s->loop);

    for (size_t b = 0; b < AMQPSINK_XBUCKETS; b++) {
        xent **pp = &s->xb[b];

        while (*pp != NULL) {
            xent *x = *pp;

            if (!x_is_pending(x) && (all || now >= x->expires)) {
                *pp = x->next;
                free(x->why);
                free(x);
                s->xcount--;
            } else {
                pp = &x->next;
            }
        }
    }
}

/* A new entry for name, X_QUEUED but not yet in the FIFO; NULL when out of
 * memory. The cache is only an optimisation: when full it forgets answers. */
static xent *x_add(sink *s, const char *name)
{
    size_t len = strlen(name), b;
    xent  *x;

    if (s->xcount >= AMQPSINK_XCACHE_MAX)
        x_sweep(s, false);
    if (s->xcount >= AMQPSINK_XCACHE_MAX)
        x_sweep(s, true);   /* pending names are at most AMQPSINK_XQUEUE_MAX + 1 */
    x = malloc(sizeof *x + len + 1);
    if (x == NULL)
        return NULL;
    memset(x, 0, sizeof *x);
    memcpy(x->name, name, len + 1);
    x->state = X_QUEUED;
    b = x_bucket(name);
    x->next = s->xb[b];
    s->xb[b] = x;
    s->xcount++;
    return x;
}

static void x_set(sink *s, xent *x, int state, const char *why)
{
    x->state = state;
    x->expires = ev_now(s->loop) + (state == X_EXISTS ? AMQPSINK_XOK_TTL : AMQPSINK_XMISSING_TTL);
    free(x->why);
    x->why = why != NULL ? strdup(why) : NULL;   /* NULL: a generic reason later */
}

/* Forgets every answer and every pending check (the connection is gone). */
static void x_clear(sink *s)
{
    for (size_t b = 0; b < AMQPSINK_XBUCKETS; b++) {
        while (s->xb[b] != NULL) {
            xent *x = s->xb[b];

            s->xb[b] = x->next;
            free(x->why);
            free(x);
        }
    }
    s->xcount = 0;
    s->xq_head = s->xq_tail = NULL;
    s->xq_len = 0;
    s->ck_cur = NULL;
    s->ck_state = CK_CLOSED;
    s->ck_ch = 0;
}

/* Each helper that calls back returns false when destroy() was called from
 * the callback: the caller must then return at once without touching s. */
static bool emit_state(sink *s, const char *msg)
{
    int st = cur_state(s);

    s->reported = st;
    s->cbs.on_state(s->cbs.ud, st, msg);
    return !s->dying;
}

static bool settle(sink *s, uint64_t tag, int outcome, const char *reason)
{
    entry *e = slot(s, tag);
    void  *ud = e->msg_ud;
    char  *ret = e->ret_reason;   /* freed after the callback */
    bool   alive;

    if (outcome == SINK_ACK && e->returned) {
        outcome = SINK_RETURNED;
        reason = ret ? ret : "unroutable (basic.return)";
    } else if (outcome == SINK_ACK) {
        reason = NULL;
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

/* Every live entry gets outcome (in tag order), then the tag counter resets. */
static bool fail_all(sink *s, int outcome, const char *reason)
{
    uint64_t end = s->next_tag;

    for (uint64_t t = s->tail_tag; t < end; t++) {
        if (find_live(s, t) && !settle(s, t, outcome, reason))
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
    if (!s->want_writable || cur_state(s) == SINK_DOWN || broker_silent(s))
        return true;
    if (s->inflight >= (size_t)s->cfg.publish_window ||
        s->next_tag - s->tail_tag > s->ring_mask)
        return true;
    if (ev_is_active(&s->wio) || ev_is_active(&s->wretry))
        return true;   /* waiting for socket space */
    s->want_writable = false;
    s->cbs.on_writable(s->cbs.ud);
    return !s->dying;
}

static void schedule_reconnect(sink *s)
{
    double d;

    /* xorshift64 jitter: delay in [backoff/2, backoff) */
    s->rnd ^= s->rnd << 13;
    s->rnd ^= s->rnd >> 7;
    s->rnd ^= s->rnd << 17;
    d = s->backoff * (0.5 + 0.5 * (double)(s->rnd % 1000000) / 1e6);
    ev_timer_stop(s->loop, &s->retry);
    ev_timer_set(&s->retry, d, 0.);
    ev_timer_start(s->loop, &s->retry);
    s->backoff *= 2;
    if (s->backoff > (double)s->cfg.reconnect_max_ms / 1000.)
        s->backoff = (double)s->cfg.reconnect_max_ms / 1000.;
    if (s->backoff < AMQPSINK_BACKOFF_MIN)
        s->backoff = AMQPSINK_BACKOFF_MIN;
}

/* Tears the connection down: on_state(DOWN), every in-flight → LOST, reconnect later. */
static bool conn_fail(sink *s, const char *why)
{
    char reason[512];

    snprintf(reason, sizeof reason, "%s: %s", s->ident, why);
    ev_io_stop(s->loop, &s->rio);
    ev_io_stop(s->loop, &s->wio);
    ev_timer_stop(s->loop, &s->wretry);
    ev_timer_stop(s->loop, &s->tick);
    ev_timer_stop(s->loop, &s->failt);
    if (s->conn != NULL) {
        amqp_destroy_connection(s->conn);
        s->conn = NULL;
    }
    s->chan_ok = false;
    s->blocked = false;
    s->broken = false;
    s->ret_stage = 0;
    /* The exchange cache belongs to the connection. Rows held back with
     * SINK_EWAIT hear on_writable once connected again (want_writable). */
    if (s->xq_len > 0 || s->ck_cur != NULL || s->ck_resolved)
        s->want_writable = true;
    s->ck_resolved = false;
    x_clear(s);
    if (!emit_state(s, reason))
        return false;
    if (!fail_all(s, SINK_LOST, reason))
        return false;
    schedule_reconnect(s);
    return true;
}

/* TCP_USER_TIMEOUT (= confirm_timeout) bounds how long the kernel keeps unacknowledged
 * data, zero-window probes included. While the broker blocks the connection it stops
 * reading from the socket on purpose, so a full pipeline legitimately sits in a zero
 * window: the bound is lifted then (on = false) and restored when unblocked. */
static void set_user_timeout(sink *s, bool on)
{
    int      fd = s->conn ? amqp_get_sockfd(s->conn) : -1;
    unsigned ut = 0;

    if (fd < 0 || s->cfg.confirm_timeout_ms <= 0)
        return;
    if (on)
        ut = s->cfg.confirm_timeout_ms > 3600000 ? 3600000u : (unsigned)s->cfg.confirm_timeout_ms;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ut, sizeof ut);
}

static void set_sock_opts(sink *s)
{
    int       fd = amqp_get_sockfd(s->conn);
    int       v = AMQPSINK_SNDBUF;
    socklen_t sl = sizeof v;

    s->sndcap = 64 * 1024;
    if (fd < 0)
        return;
    /* Best effort: a smaller buffer only means more SINK_EAGAIN. */
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v);
    set_user_timeout(s, true);
    v = 0;
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &sl) == 0 && v > 0)
        s->sndcap = (size_t)v / 2;   /* the kernel doubles the value for bookkeeping */
}

static bool drain(sink *s);
static void ck_kick(sink *s);
static bool check_timeout(sink *s);
static amqp_channel_t check_channel(amqp_connection_state_t conn);

static void sink_free(sink *s);

/* ------------------------------------------------------------ loop callbacks */

#define ENTER(s) ((s)->depth++)
#define LEAVE(s)                                   \
    do {                                           \
        if (--(s)->depth == 0 && (s)->dying)       \
            sink_free(s);                          \
    } while (0)

static void retry_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    sink *s = w->data;
    char  err[512];
    int   rc;

    (void)loop;
    (void)revents;
    ENTER(s);
    s->ch = 1;
    rc = conn_open(&s->cfg, s->conn_name, s->ch, &s->conn, err, sizeof err);
    if (rc < 0) {
        char msg[900];

        snprintf(msg, sizeof msg, "%s: %s", s->ident, err);
        if (emit_state(s, msg))
            schedule_reconnect(s);
        goto out;
    }
    s->backoff = AMQPSINK_BACKOFF_MIN;
    s->chan_ok = true;
    s->blocked = false;
    s->broken = false;
    s->next_tag = s->tail_tag = 1;
    s->ret_stage = 0;
    x_clear(s);
    s->ck_ch = check_channel(s->conn);
    set_sock_opts(s);
    ev_now_update(s->loop);   /* the handshake blocked for a while */
    s->hb = amqp_get_heartbeat(s->conn);
    s->last_rx = ev_time();
    if (s->hb > 0 && s->hb / 4.0 < s->tick.repeat)
        s->tick.repeat = s->hb / 4.0;
    ev_io_set(&s->rio, amqp_get_sockfd(s->conn), EV_READ);
    ev_io_start(s->loop, &s->rio);
    ev_io_set(&s->wio, amqp_get_sockfd(s->conn), EV_WRITE);
    ev_timer_again(s->loop, &s->tick);
    {
        char msg[400];

        snprintf(msg, sizeof msg, "connected to %s", s->ident);
        if (!emit_state(s, msg))
            goto out;
    }
    /* Frames may have been queued during the synchronous handshake. */
    if (!drain(s))
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
    if (s->conn != NULL && drain(s))
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
    if (!drain(s) || s->conn == NULL)
        goto out;
    /* rabbitmq-c checks missed heartbeats only in calls with a deadline in
     * the future, never with our zero timeout: watch the socket ourselves.
     * Any data (heartbeat frames included) wakes rio_cb. */
    if (s->hb > 0 && ev_time() - s->last_rx > 2.0 * s->hb) {
        char why[120];

        snprintf(why, sizeof why, "heartbeat timeout: nothing from the broker for %.1f s",
                 ev_time() - s->last_rx);
        (void)conn_fail(s, why);
        goto out;
    }
    advance_tail(s);
    /* While the broker blocks the connection (memory or disk alarm) it may hold
     * confirms back for as long as the alarm lasts: that is flow control, not a
     * dead connection, so the confirm clock only runs while unblocked. */
    if (s->cfg.confirm_timeout_ms > 0 && s->inflight > 0 && !s->blocked) {
        entry *e = find_live(s, s->tail_tag);
        ev_tstamp since = e == NULL ? 0 : e->published_at > s->unblocked_at ? e->published_at
                                                                           : s->unblocked_at;

        if (e != NULL && ev_now(loop) - since > (double)s->cfg.confirm_timeout_ms / 1000.) {
            char why[200];

            snprintf(why, sizeof why, "no publisher confirm for delivery tag %llu within %lld ms",
                     (unsigned long long)e->tag, (long long)s->cfg.confirm_timeout_ms);
            (void)conn_fail(s, why);
            goto out;
        }
    }
    if (!check_timeout(s) || s->conn == NULL)
        goto out;
    ck_kick(s);   /* a check held back for socket room */
    (void)maybe_writable(s);
out:
    LEAVE(s);
}

static void failt_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    sink *s = w->data;
    char  why[200];

    (void)loop;
    (void)revents;
    ENTER(s);
    if (s->conn != NULL && s->broken) {
        snprintf(why, sizeof why, "%s", s->broken_why);
        (void)conn_fail(s, why);
    }
    LEAVE(s);
}

static bool sock_room(sink *s, size_t need)
{
    int fd, queued = 0;

    if (s->conn == NULL || (fd = amqp_get_sockfd(s->conn)) < 0)
        return true;
    if (ioctl(fd, SIOCOUTQ, &queued) < 0 || queued <= 0)
        return true;   /* empty buffer: always allowed (TCP_USER_TIMEOUT bounds it) */
    return (size_t)queued + need <= s->sndcap;
}

static void wio_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    sink *s = w->data;

    (void)revents;
    ENTER(s);
    ev_io_stop(loop, &s->wio);
    if (!sock_room(s, s->want_bytes)) {
        /* writable but not enough for the message: look again shortly
         * (EV_WRITE is level-triggered; re-arming now would spin) */
        ev_timer_set(&s->wretry, 0.005, 0.);
        ev_timer_start(loop, &s->wretry);
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

/* ------------------------------------------------------------ exchange checks */

/* A send failed: the connection may be mid-frame. Fail it from the loop (the
 * caller may be publish(), which must not call back). */
static void mark_broken(sink *s, const char *what, int rc)
{
    if (s->broken)
        return;
    s->broken = true;
    snprintf(s->broken_why, sizeof s->broken_why, "%s: %s", what, amqp_error_string2(rc));
    ev_timer_set(&s->failt, 0., 0.);
    ev_timer_start(s->loop, &s->failt);
}

/* The default exchange and amq.* are the broker's own (a client cannot declare
 * amq.* names): they are published without a check. */
static bool x_unchecked(const sink *s, const char *ex)
{
    return ex[0] == '\0' || strncmp(ex, "amq.", 4) == 0 || s->ck_ch == 0;
}

/* The check channel is the highest channel number the connection allows; the
 * publishing channel cycles below it. 0 (no checks: a row goes straight out,
 * and a 404 only costs a channel) when the broker allows a single channel. */
static amqp_channel_t check_channel(amqp_connection_state_t conn)
{
    int max = amqp_get_channel_max(conn);

    if (max <= 0 || max > 65535)
        max = 65535;
    return max < 2 ? 0 : (amqp_channel_t)max;
}

/* Sends the check channel's next step, if it has one and the socket has room
 * for it (else the tick tries again; rabbitmq-c's send would wait without a
 * deadline): channel.open while closed, else the passive exchange.declare of
 * the first waiting name. Never waits for the answer and never calls back. */
static void ck_kick(sink *s)
{
    int rc;

    if (s->conn == NULL || s->broken || s->ck_ch == 0 || s->xq_head == NULL ||
        s->ck_state == CK_OPENING || s->ck_state == CK_BUSY)
        return;
    if (!sock_room(s, AMQPSINK_CHECK_BYTES))
        return;
    if (s->ck_state == CK_CLOSED) {
        amqp_channel_open_t m;

        memset(&m, 0, sizeof m);
        m.out_of_band = amqp_empty_bytes;
        rc = amqp_send_method(s->conn, s->ck_ch, AMQP_CHANNEL_OPEN_METHOD, &m);
        s->ck_state = CK_OPENING;
    } else {
        amqp_exchange_declare_t m;
        xent                   *x = s->xq_head;

        s->xq_head = x->qnext;
        if (s->xq_head == NULL)
            s->xq_tail = NULL;
        s->xq_len--;
        x->qnext = NULL;
        x->state = X_CHECKING;
        s->ck_cur = x;
        memset(&m, 0, sizeof m);
        m.exchange = cbytes(x->name);
        m.type = amqp_empty_bytes;
        m.passive = 1;       /* only asks; never creates or changes anything */
        m.arguments = amqp_empty_table;
        rc = amqp_send_method(s->conn, s->ck_ch, AMQP_EXCHANGE_DECLARE_METHOD, &m);
        s->ck_state = CK_BUSY;
    }
    s->ck_sent_at = ev_now(s->loop);
    if (rc != AMQP_STATUS_OK) {
        mark_broken(s, "exchange check", rc);
        return;
    }
    /* a send may read from the socket (heartbeat check): frames it queued
     * would never wake the read watcher */
    if (amqp_frames_enqueued(s->conn) || amqp_data_in_buffer(s->conn))
        ev_feed_event(s->loop, &s->rio, EV_READ);
}

/* A check (or the check channel's open) without an answer within
 * confirm_timeout: the connection is dead or the broker stuck, as with a
 * missing confirm. The clock stops while the broker blocks the connection (it
 * may stop reading from it). Returns false when the sink was destroyed. */
static bool check_timeout(sink *s)
{
    ev_tstamp since;
    char      why[500];

    if (s->conn == NULL || s->cfg.confirm_timeout_ms <= 0 || s->blocked ||
        (s->ck_state != CK_OPENING && s->ck_state != CK_BUSY))
        return true;
    since = s->ck_sent_at > s->unblocked_at ? s->ck_sent_at : s->unblocked_at;
    if (ev_now(s->loop) - since <= (double)s->cfg.confirm_timeout_ms / 1000.)
        return true;
    if (s->ck_state == CK_BUSY && s->ck_cur != NULL)
        snprintf(why, sizeof why, "no answer to the passive exchange.declare of exchange '%s' "
                 "(checking channel %u) within %lld ms", s->ck_cur->name, (unsigned)s->ck_ch,
                 (long long)s->cfg.confirm_timeout_ms);
    else
        snprintf(why, sizeof why, "no answer to channel.open of the exchange checking channel %u "
                 "within %lld ms", (unsigned)s->ck_ch, (long long)s->cfg.confirm_timeout_ms);
    return conn_fail(s, why);
}

/* Whether a row to exchange ex may be published now: SINK_QUEUED (go on),
 * SINK_EWAIT (its check is pending), SINK_EREFUSED (err says why) or
 * SINK_EAGAIN (too many names waiting: a pending check answers, then
 * on_writable). Never calls back. */
static int dest_check(sink *s, const char *ex, char *err, size_t errlen)
{
    xent *x;

    if (x_unchecked(s, ex))
        return SINK_QUEUED;
    x = x_find(s, ex);
    if (x != NULL) {
        if (x_is_pending(x))
            return SINK_EWAIT;
        if (ev_now(s->loop) < x->expires) {
            if (x->state == X_EXISTS)
                return SINK_QUEUED;
            if (x->why != NULL)
                snprintf(err, errlen, "%s", x->why);
            else
                snprintf(err, errlen, "exchange '%s' refused in vhost '%s'", ex, s->cfg.vhost);
            return SINK_EREFUSED;
        }
        /* expired: ask again */
    }
    if (s->xq_len >= AMQPSINK_XQUEUE_MAX)
        return SINK_EAGAIN;
    if (x == NULL && (x = x_add(s, ex)) == NULL)
        return SINK_QUEUED;   /* out of memory: unchecked; a 404 still costs only a channel */
    x->state = X_QUEUED;
    free(x->why);
    x->why = NULL;
    x->qnext = NULL;
    if (s->xq_tail != NULL)
        s->xq_tail->qnext = x;
    else
        s->xq_head = x;
    s->xq_tail = x;
    s->xq_len++;
    ck_kick(s);
    return SINK_EWAIT;
}

/* The publishing channel was closed by a 404 naming ex (deleted after its
 * check said it exists): remember it missing, so the rows given back LOST are
 * refused when retried instead of closing the channel again. */
static void x_mark_missing(sink *s, const char *ex, const char *text)
{
    xent *x;
    char  why[1100];

    if (x_unchecked(s, ex))
        return;
    x = x_find(s, ex);
    if (x != NULL && x_is_pending(x))
        return;   /* its check answers soon */
    if (x == NULL && (x = x_add(s, ex)) == NULL)
        return;
    snprintf(why, sizeof why, "exchange '%s' not found in vhost '%s' (404, the broker closed "
             "the publishing channel: %s)", ex, s->cfg.vhost, text);
    x_set(s, x, X_MISSING, why);
}

/* A frame on the check channel: the answer to channel.open or to a check. */
static bool on_check_frame(sink *s, const amqp_frame_t *f)
{
    if (f->frame_type != AMQP_FRAME_METHOD)
        return true;
    switch (f->payload.method.id) {
    case AMQP_CHANNEL_OPEN_OK_METHOD:
        if (s->ck_state == CK_OPENING) {
            s->ck_state = CK_IDLE;
            ck_kick(s);
        }
        return true;
    case AMQP_EXCHANGE_DECLARE_OK_METHOD:
        if (s->ck_state == CK_BUSY && s->ck_cur != NULL) {
            x_set(s, s->ck_cur, X_EXISTS, NULL);
            s->ck_cur = NULL;
            s->ck_state = CK_IDLE;
            s->ck_resolved = true;
            ck_kick(s);
        }
        return true;
    case AMQP_CHANNEL_CLOSE_METHOD: {
        const amqp_channel_close_t *m = f->payload.method.decoded;
        amqp_channel_close_ok_t     ok;
        char                        text[512], why[1100];
        int                         rc;

        snprintf(text, sizeof text, "%.*s", (int)m->reply_text.len,
                 (const char *)m->reply_text.bytes);
        memset(&ok, 0, sizeof ok);
        rc = amqp_send_method(s->conn, s->ck_ch, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
        if (rc != AMQP_STATUS_OK) {
            snprintf(why, sizeof why, "exchange checking channel %u closed by the broker: %u %s; "
                     "channel.close-ok: %s", (unsigned)s->ck_ch, (unsigned)m->reply_code, text,
                     amqp_error_string2(rc));
            return conn_fail(s, why);
        }
        if (s->ck_state != CK_BUSY || s->ck_cur == NULL) {
            /* Not the answer to a check (channel.open refused?): nothing to
             * learn, and reopening could repeat it forever. */
            snprintf(why, sizeof why, "exchange checking channel %u closed by the broker: %u %s",
                     (unsigned)s->ck_ch, (unsigned)m->reply_code, text);
            return conn_fail(s, why);
        }
        if (m->reply_code == AMQP_NOT_FOUND)
            snprintf(why, sizeof why, "exchange '%s' not found in vhost '%s' (404, checked with "
                     "a passive exchange.declare)", s->ck_cur->name, s->cfg.vhost);
        else
            snprintf(why, sizeof why, "exchange '%s' in vhost '%s' refused by the broker: %u %s "
                     "(checked with a passive exchange.declare)", s->ck_cur->name, s->cfg.vhost,
                     (unsigned)m->reply_code, text);
        x_set(s, s->ck_cur, m->reply_code == AMQP_NOT_FOUND ? X_MISSING : X_REFUSED, why);
        s->ck_cur = NULL;
        s->ck_state = CK_CLOSED;   /* close-ok sent: ck_kick reopens it for the next check */
        s->ck_resolved = true;
        ck_kick(s);
        return true;
    }
    default:
        return true;
    }
}

/* ------------------------------------------------------------ frame handling */

static bool on_ack(sink *s, uint64_t tag, bool multiple, int outcome, const char *reason)
{
    if (multiple) {
        uint64_t end = s->next_tag;

        if (tag == 0 || tag >= end)
            tag = end - 1;
        for (uint64_t t = s->tail_tag; t <= tag; t++) {
            if (find_live(s, t) && !settle(s, t, outcome, reason))
                return false;
        }
        return true;
    }
    if (find_live(s, tag))
        return settle(s, tag, outcome, reason);
    return true;   /* unknown tag: stale or duplicate, ignore */
}

static bool on_return_header(sink *s, const amqp_frame_t *f)
{
    const amqp_basic_properties_t *p = f->payload.properties.decoded;

    s->ret_left = f->payload.properties.body_size;
    s->ret_stage = s->ret_left > 0 ? 2 : 0;
    if (p == NULL || !(p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG))
        return true;
    for (uint64_t t = s->tail_tag; t < s->next_tag; t++) {
        entry *e = find_live(s, t);

        if (e != NULL && !e->returned && strlen(e->r->message_id) == p->message_id.len &&
            memcmp(e->r->message_id, p->message_id.bytes, p->message_id.len) == 0) {
            e->returned = true;
            free(e->ret_reason);
            e->ret_reason = strdup(s->ret_reason);   /* NULL: generic reason later */
            break;
        }
    }
    return true;
}

/* Is the entry's exchange named (quoted) in the broker's reply text? */
static bool names_exchange(const entry *e, const char *text)
{
    char q[300];

    if (e->r->exchange[0] == '\0')
        return strstr(text, "default exchange") != NULL;
    snprintf(q, sizeof q, "'%s'", e->r->exchange);
    return strstr(text, q) != NULL;
}

static bool on_channel_close(sink *s, unsigned code, const char *text)
{
    char                    msg[700];
    amqp_channel_close_ok_t ok;
    amqp_rpc_reply_t        r;
    uint64_t                culprit = 0;
    unsigned long long      size = 0;
    const char             *sz;
    int                     rc;

    snprintf(msg, sizeof msg, "channel %u closed by the broker: %u %s", (unsigned)s->ch,
             code, text);
    memset(&ok, 0, sizeof ok);
    rc = amqp_send_method(s->conn, s->ch, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
    s->chan_ok = false;
    s->ret_stage = 0;
    if (rc != AMQP_STATUS_OK) {
        char why[800];

        snprintf(why, sizeof why, "%s; channel.close-ok: %s", msg, amqp_error_string2(rc));
        return conn_fail(s, why);
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
        entry *e = find_live(s, t);

        if (e != NULL && names_exchange(e, text)) {
            culprit = t;
            if (code == AMQP_NOT_FOUND)
                x_mark_missing(s, e->r->exchange, text);
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
        if (!settle(s, culprit, SINK_REJECTED, reason))
            return false;
    }
    if (!fail_all(s, SINK_LOST, msg))
        return false;
    if (s->conn == NULL)
        return true;
    /* Reopen on the next channel number. Blocking, bounded by the rpc timeout. */
    {
        int max = amqp_get_channel_max(s->conn);

        if (max <= 0 || max > 65535)
            max = 65535;
        if (s->ck_ch != 0)
            max = s->ck_ch - 1;   /* the check channel is the highest */
        s->ch = (amqp_channel_t)(s->ch >= max ? 1 : s->ch + 1);
    }
    amqp_channel_open(s->conn, s->ch);
    r = amqp_get_rpc_reply(s->conn);
    if (r.reply_type == AMQP_RESPONSE_NORMAL) {
        amqp_confirm_select(s->conn, s->ch);
        r = amqp_get_rpc_reply(s->conn);
    }
    if (r.reply_type != AMQP_RESPONSE_NORMAL) {
        char why[700];

        fmt_reply(r, "reopening the channel", why, sizeof why);
        return conn_fail(s, why);
    }
    s->chan_ok = true;
    s->next_tag = s->tail_tag = 1;
    ev_now_update(s->loop);   /* the reopen blocked for a while */
    {
        char st[400];

        snprintf(st, sizeof st, "channel %u reopened on %s", (unsigned)s->ch, s->ident);
        return emit_state(s, st);
    }
}

static bool handle_frame(sink *s, const amqp_frame_t *f)
{
    if (f->channel == 0) {
        if (f->frame_type != AMQP_FRAME_METHOD)
            return true;
        switch (f->payload.method.id) {
        case AMQP_CONNECTION_CLOSE_METHOD: {
            const amqp_connection_close_t *m = f->payload.method.decoded;
            amqp_connection_close_ok_t     ok;
            char                           why[600];

            snprintf(why, sizeof why, "broker closed the connection: %u %.*s",
                     (unsigned)m->reply_code, (int)m->reply_text.len,
                     (const char *)m->reply_text.bytes);
            memset(&ok, 0, sizeof ok);
            (void)amqp_send_method(s->conn, 0, AMQP_CONNECTION_CLOSE_OK_METHOD, &ok);
            return conn_fail(s, why);
        }
        case AMQP_CONNECTION_BLOCKED_METHOD: {
            const amqp_connection_blocked_t *m = f->payload.method.decoded;
            char                             why[400];

            s->blocked = true;
            set_user_timeout(s, false);
            snprintf(why, sizeof why, "%s: broker blocked publishing: %.*s", s->ident,
                     (int)m->reason.len, (const char *)m->reason.bytes);
            return emit_state(s, why);
        }
        case AMQP_CONNECTION_UNBLOCKED_METHOD: {
            char why[400];

            s->blocked = false;
            set_user_timeout(s, true);
            s->unblocked_at = ev_now(s->loop);
            snprintf(why, sizeof why, "%s: broker unblocked publishing", s->ident);
            return emit_state(s, why);
        }
        default:
            return true;
        }
    }
    if (s->ck_ch != 0 && f->channel == s->ck_ch)
        return on_check_frame(s, f);
    if (f->channel != s->ch || !s->chan_ok)
        return true;   /* leftovers of a closed channel */
    switch (f->frame_type) {
    case AMQP_FRAME_METHOD:
        switch (f->payload.method.id) {
        case AMQP_BASIC_ACK_METHOD: {
            const amqp_basic_ack_t *m = f->payload.method.decoded;
            return on_ack(s, m->delivery_tag, m->multiple != 0, SINK_ACK, NULL);
        }
        case AMQP_BASIC_NACK_METHOD: {
            const amqp_basic_nack_t *m = f->payload.method.decoded;
            return on_ack(s, m->delivery_tag, m->multiple != 0, SINK_NACKED,
                          "nacked by the broker (basic.nack)");
        }
        case AMQP_BASIC_RETURN_METHOD: {
            const amqp_basic_return_t *m = f->payload.method.decoded;

            snprintf(s->ret_reason, sizeof s->ret_reason,
                     "unroutable: %.*s exchange=%.*s routing_key=%.*s",
                     (int)m->reply_text.len, (const char *)m->reply_text.bytes,
                     (int)m->exchange.len, (const char *)m->exchange.bytes,
                     (int)m->routing_key.len, (const char *)m->routing_key.bytes);
            s->ret_stage = 1;
            return true;
        }
        case AMQP_CHANNEL_CLOSE_METHOD: {
            const amqp_channel_close_t *m = f->payload.method.decoded;
            char                        text[512];

            snprintf(text, sizeof text, "%.*s", (int)m->reply_text.len,
                     (const char *)m->reply_text.bytes);
            return on_channel_close(s, m->reply_code, text);
        }
        default:
            return true;
        }
    case AMQP_FRAME_HEADER:
        if (s->ret_stage == 1)
            return on_return_header(s, f);
        return true;
    case AMQP_FRAME_BODY:
        if (s->ret_stage == 2) {
            size_t n = f->payload.body_fragment.len;

            s->ret_left = n >= s->ret_left ? 0 : s->ret_left - n;
            if (s->ret_left == 0)
                s->ret_stage = 0;
        }
        return true;
    default:
        return true;
    }
}

/* Reads and handles every frame available now. Returns false when the sink
 * was destroyed from a callback; s->conn is NULL afterwards when the
 * connection failed. */
static bool drain(sink *s)
{
    struct timeval zero = { 0, 0 };
    int            n = 0;

    while (s->conn != NULL) {
        amqp_frame_t f;
        int          rc;

        if (n++ == AMQPSINK_DRAIN_MAX) {
            ev_feed_event(s->loop, &s->rio, EV_READ);   /* yield to the loop */
            break;
        }
        rc = amqp_simple_wait_frame_noblock(s->conn, &f, &zero);
        if (rc == AMQP_STATUS_TIMEOUT)
            break;
        if (rc != AMQP_STATUS_OK)
            return conn_fail(s, amqp_error_string2(rc));
        if (!handle_frame(s, &f))
            return false;
    }
    /* Decoded frames live in the connection's pools until released; queued
     * frames (from a synchronous rpc) must survive until handled. */
    if (s->conn != NULL && !amqp_frames_enqueued(s->conn))
        amqp_maybe_release_buffers(s->conn);
    return true;
}

/* ------------------------------------------------------------ ops */

static void sink_free(sink *s)
{
    ev_io_stop(s->loop, &s->rio);
    ev_io_stop(s->loop, &s->wio);
    ev_timer_stop(s->loop, &s->tick);
    ev_timer_stop(s->loop, &s->retry);
    ev_timer_stop(s->loop, &s->wretry);
    ev_timer_stop(s->loop, &s->failt);
    conn_close(s->conn, !s->broken);
    s->conn = NULL;
    x_clear(s);
    if (s->ring != NULL) {
        for (uint64_t i = 0; i <= s->ring_mask; i++)
            free(s->ring[i].ret_reason);
        free(s->ring);
    }
    if (s->cfg.pass != NULL) {
        memset(s->cfg.pass, 0, strlen(s->cfg.pass));
        free(s->cfg.pass);
    }
    free(s->cfg.name);
    free(s->cfg.host);
    free(s->cfg.user);
    free(s->cfg.vhost);
    free(s->cfg.tls_ca_file);
    free(s->conn_name);
    free(s);
}

static int dupstr(char **dst, const char *src)
{
    *dst = NULL;
    if (src == NULL)
        return 0;
    *dst = strdup(src);
    return *dst ? 0 : -1;
}

static int amqpsink_create(struct ev_loop *loop, const cfg_sink *sc, const char *conn_name,
                           const sink_cbs *cbs, sink **out, char *err, size_t errlen)
{
    sink    *s;
    uint64_t cap = 1;

    *out = NULL;
    if (!sc->confirms || !sc->mandatory) {
        snprintf(err, errlen, "sink %s: publisher confirms and mandatory are required",
                 sc->name ? sc->name : "?");
        return -1;
    }
    if (sc->publish_window < 1 || sc->publish_window > 65535 || sc->host == NULL ||
        sc->user == NULL || sc->pass == NULL || sc->vhost == NULL) {
        snprintf(err, errlen, "sink %s: incomplete configuration", sc->name ? sc->name : "?");
        return -1;
    }
    s = calloc(1, sizeof *s);
    if (s == NULL)
        goto oom;
    s->loop = loop;
    s->cbs = *cbs;
    s->reported = -1;
    s->cfg = *sc;
    s->cfg.url = NULL;        /* not kept: may carry the password */
    s->cfg.password = NULL;
    s->cfg.name = s->cfg.host = s->cfg.user = s->cfg.pass = s->cfg.vhost = NULL;
    s->cfg.tls_ca_file = NULL;
    if (dupstr(&s->cfg.name, sc->name) < 0 || dupstr(&s->cfg.host, sc->host) < 0 ||
        dupstr(&s->cfg.user, sc->user) < 0 || dupstr(&s->cfg.pass, sc->pass) < 0 ||
        dupstr(&s->cfg.vhost, sc->vhost) < 0 ||
        dupstr(&s->cfg.tls_ca_file, sc->tls_ca_file) < 0 ||
        dupstr(&s->conn_name, conn_name) < 0)
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
    s->backoff = AMQPSINK_BACKOFF_MIN;
    s->rnd = (uint64_t)(uintptr_t)s ^ ((uint64_t)time(NULL) << 20) ^ (uint64_t)getpid();
    if (s->rnd == 0)
        s->rnd = 88172645463325252ULL;
    set_ident(s->ident, sizeof s->ident, sc);

    ev_io_init(&s->rio, rio_cb, 0, EV_READ);
    ev_io_init(&s->wio, wio_cb, 0, EV_WRITE);
    {
        double t = 1.0;

        if (sc->heartbeat_ms > 0 && (double)sc->heartbeat_ms / 4000. < t)
            t = (double)sc->heartbeat_ms / 4000.;
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
    s->rio.data = s->wio.data = s->tick.data = s->retry.data = s->wretry.data =
        s->failt.data = s;
    *out = s;   /* ownership to the caller: amqpsink_destroy */
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
        ev_io_stop(s->loop, &s->rio);
        ev_io_stop(s->loop, &s->wio);
        ev_timer_stop(s->loop, &s->tick);
        ev_timer_stop(s->loop, &s->retry);
        ev_timer_stop(s->loop, &s->wretry);
        ev_timer_stop(s->loop, &s->failt);
        return;
    }
    sink_free(s);
}

static void amqpsink_start(sink *s)
{
    if (s->conn != NULL || ev_is_active(&s->retry))
        return;
    ev_timer_set(&s->retry, 0., 0.);
    ev_timer_start(s->loop, &s->retry);
}

static size_t amqpsink_in_flight(const sink *s)
{
    return s->inflight;
}

static int too_long(const char *what, const char *v, char *err, size_t errlen)
{
    if (v != NULL && strlen(v) > 255) {
        snprintf(err, errlen, "%s is %zu bytes; AMQP allows at most 255", what, strlen(v));
        return 1;
    }
    return 0;
}

static int amqpsink_publish(sink *s, const row *r, void *msg_ud, char *err, size_t errlen)
{
    amqp_basic_properties_t p;
    amqp_bytes_t            body;
    void                   *hmem = NULL;
    size_t                  est, nframes;
    entry                  *e;
    int                     rc;

    /* Permanent problems first: the row can never be published. */
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
        if (amqpsink_json_headers(r->headers_json, strlen(r->headers_json), &p.headers,
                                  &hmem, err, errlen) < 0)
            return SINK_EPERM;
        p._flags |= AMQP_BASIC_HEADERS_FLAG;
    }

    if (cur_state(s) != SINK_UP) {
        free(hmem);
        return SINK_EAGAIN;   /* on_state(SINK_UP) follows */
    }
    /* Does the exchange exist? Asked before the window: a refusal or a wait
     * needs no room, and the check starts early. */
    rc = dest_check(s, r->exchange, err, errlen);
    if (rc != SINK_QUEUED) {
        free(hmem);
        return rc;
    }
    advance_tail(s);
    if (s->inflight >= (size_t)s->cfg.publish_window ||
        s->next_tag - s->tail_tag > s->ring_mask || broker_silent(s)) {
        s->want_writable = true;
        free(hmem);
        return SINK_EAGAIN;
    }
    nframes = r->payload_len / (AMQPSINK_FRAME_MAX - 8) + 1;
    est = r->payload_len + 8 * nframes + 1024 + strlen(r->exchange) + strlen(r->routing_key) +
          (r->headers_json ? 2 * strlen(r->headers_json) : 0);
    if (s->cfg.tls)
        est += est / 64 + 1024;
    if (!sock_room(s, est)) {
        s->want_writable = true;
        s->want_bytes = est;
        if (!ev_is_active(&s->wretry))
            ev_io_start(s->loop, &s->wio);
        free(hmem);
        return SINK_EAGAIN;
    }

    p._flags |= AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_MESSAGE_ID_FLAG |
                AMQP_BASIC_TIMESTAMP_FLAG;
    p.delivery_mode = AMQP_DELIVERY_PERSISTENT;
    p.message_id = cbytes(r->message_id);
    p.timestamp = r->created_at_us > 0 ? (uint64_t)(r->created_at_us / 1000000) : 0;
    if (r->correlation_id != NULL) {
        p._flags |= AMQP_BASIC_CORRELATION_ID_FLAG;
        p.correlation_id = cbytes(r->correlation_id);
    }
    if (r->message_type != NULL) {
        p._flags |= AMQP_BASIC_TYPE_FLAG;
        p.type = cbytes(r->message_type);
    }
    if (r->content_type != NULL) {
        p._flags |= AMQP_BASIC_CONTENT_TYPE_FLAG;
        p.content_type = cbytes(r->content_type);
    }
    body.len = r->payload_len;
    body.bytes = (void *)(uintptr_t)r->payload;
    rc = amqp_basic_publish(s->conn, s->ch, cbytes(r->exchange), cbytes(r->routing_key),
                            1 /* mandatory */, 0 /* immediate */, &p, body);
    free(hmem);
    if (rc != AMQP_STATUS_OK) {
        if (rc == AMQP_STATUS_TABLE_TOO_BIG) {
            snprintf(err, errlen, "message properties too large for one frame");
            /* the encoder failed before anything was sent: nothing to clean up */
            return SINK_EPERM;
        }
        /* The connection is broken (maybe mid-message): fail it from the loop. */
        mark_broken(s, "publish", rc);
        return SINK_EAGAIN;
    }
    e = slot(s, s->next_tag);
    e->r = r;
    e->msg_ud = msg_ud;
    e->tag = s->next_tag++;
    e->published_at = ev_now(s->loop);
    e->live = true;
    e->returned = false;
    free(e->ret_reason);
    e->ret_reason = NULL;
    s->inflight++;
    /* basic_publish may read from the socket (heartbeat check): frames it
     * queued would never wake the read watcher. */
    if (amqp_frames_enqueued(s->conn) || amqp_data_in_buffer(s->conn))
        ev_feed_event(s->loop, &s->rio, EV_READ);
    return SINK_QUEUED;
}

static int amqpsink_check(const cfg_sink *sc, char *err, size_t errlen)
{
    amqp_connection_state_t conn;
    char                    ident[300], why[600];

    set_ident(ident, sizeof ident, sc);
    if (!sc->confirms || !sc->mandatory) {
        snprintf(err, errlen, "rabbitmq %s: publisher confirms and mandatory are required", ident);
        return -1;
    }
    if (conn_open(sc, "outbox-relay check", 1, &conn, why, sizeof why) < 0) {
        snprintf(err, errlen, "rabbitmq %s: %s", ident, why);
        return -1;
    }
    conn_close(conn, true);
    return 0;
}

const sink_ops amqpsink_ops = {
    .name      = "rabbitmq",
    .create    = amqpsink_create,
    .destroy   = amqpsink_destroy,
    .start     = amqpsink_start,
    .publish   = amqpsink_publish,
    .in_flight = amqpsink_in_flight,
    .check     = amqpsink_check,
};
