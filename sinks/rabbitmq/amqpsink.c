/*
 * amqpsink.c — the RabbitMQ sink (relay/sink.h) on rabbitmq-c 0.11 and libev.
 *
 * One connection, one channel in confirm mode. Publishes are pipelined over
 * publish_window; acks/nacks/returns/channel.close are read from the loop with
 * amqp_simple_wait_frame_noblock(zero timeout) whenever the socket is readable
 * and on a periodic tick (heartbeats, confirm timeout).
 *
 * Bounded blocking:
 *  - connect/TLS handshake/login/channel.open/confirm.select never run on the
 *    loop: each attempt runs on its own worker thread (struct cjob), each step
 *    bounded by connect_timeout (socket open timeout, handshake timeout, rpc
 *    timeout; DNS is not bounded). The worker owns the new connection until it
 *    hands it back through an ev_async; from then on only the loop touches it.
 *    destroy() cancels a running attempt: it shuts the worker's socket down
 *    (once the TCP connection exists) and waits for the worker at most
 *    connect_timeout; a worker still running after that cleans up after itself.
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
#include "sinks/sinks.h"
#include "sinks/rabbitmq/amqpcfg.h"
#include "sinks/rabbitmq/json.h"

#include <amqp.h>
#include <amqp_ssl_socket.h>
#include <amqp_tcp_socket.h>
#include <arpa/inet.h>
#include <errno.h>
#include <ev.h>
#include <linux/sockios.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <openssl/x509_vfy.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "lib/outbox_util.h"

#ifndef OUTBOX_VERSION
#define OUTBOX_VERSION "dev"
#endif

#define AMQPSINK_FRAME_MAX     32768   /* asked at login; rabbitmq-c keeps buffers of this size per
                                          connection and channel (131072 cost fifty outboxes
                                          3 MiB), and larger bodies are split in frames */
#define AMQPSINK_SNDBUF        (4 * 1024 * 1024)
#define AMQPSINK_BACKOFF_MIN   100    /* ms */
#define AMQPSINK_DRAIN_MAX     4096   /* frames per readable event before yielding */
#define AMQPSINK_CLOSE_TIMEOUT 2000   /* ms, destroy()'s connection.close */
#define AMQPSINK_CANCEL_WAIT_MS 20    /* destroy() waits this long for an abandoned connect
                                         attempt (a handshake ends at once once its socket
                                         is shut down; a TCP connect or a name lookup may not,
                                         and is left to end on its own) */
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

/* The publishing channel, while the connection is up. It is reopened without
 * waiting on the loop: after the broker closed it (chan_ok false: the sink is
 * DOWN meanwhile), or when it got only nacks for nack_reopen (the sink stays
 * UP; publish() says SINK_EAGAIN until it is open again). */
enum pchstate {
    PCH_OPEN = 0,   /* in confirm mode: publish */
    PCH_DRAIN,      /* only nacks lately: nothing new is published; once every message
                       in flight is answered, the channel is closed and reopened */
    PCH_WANT_OPEN,  /* channel.open not sent yet (waiting for room in the socket) */
    PCH_OPENING,    /* channel.open sent on ch */
    PCH_WANT_SELECT,/* channel.open-ok came; confirm.select not sent yet (socket room) */
    PCH_SELECTING   /* confirm.select sent on ch */
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

/* One connection attempt on a worker thread. Shared by the sink and the
 * worker (refs). mu guards refs, done, abandoned, fd, conn and err; the
 * inputs are written before the thread starts and only read by it. */
typedef struct cjob {
    pthread_mutex_t mu;
    pthread_cond_t  cv;            /* signalled when done */
    int             refs;          /* 2 while both hold it; the last one frees it */
    bool            done;          /* the worker has finished: conn/err are set */
    bool            abandoned;     /* the sink is gone: the worker cleans up */
    int             fd;            /* the socket while the handshake runs, else -1 */
    ev_async       *wake;          /* the sink's watcher (valid until abandoned) */
    struct ev_loop *loop;
    /* inputs: the worker's own copies */
    cfg_sink        cfg;           /* name owned; backend_conf = &conf */
    amqp_sink_conf  conf;          /* strings owned; host and port: this attempt's address */
    char           *conn_name;
    amqp_channel_t  ch;
    /* outputs */
    amqp_connection_state_t conn;  /* owned by the job until taken */
    char            err[700];
} cjob;

struct sink {
    struct ev_loop *loop;
    cfg_sink        cfg;          /* copy: name owned, no url or password; backend_conf = &conf */
    amqp_sink_conf  conf;         /* deep copy (owned) */
    char           *conn_name;    /* owned */
    char            ident[300];   /* "broker host:port vhost V" for messages */
    cjob           *job;          /* the connection attempt in progress, or NULL */
    ev_async        jobw;         /* its hand-off */
    sink_cbs        cbs;

    amqp_connection_state_t conn; /* NULL when down */
    amqp_channel_t  ch;
    bool            chan_ok;
    int             pch;          /* enum pchstate */
    ev_tstamp       pch_sent_at;  /* when channel.open / confirm.select was sent */
    uint32_t        nack_run;     /* messages nacked in a row on this channel (no ack since) */
    ev_tstamp       nack_since;   /* when the first of them was nacked */
    char            nack_why[200];/* why the channel is being reopened (PCH_DRAIN) */

    /* Broker addresses (conf.brokers, at least one). cur is the one connected, or
     * tried next; a failed attempt or a lost connection moves it on, and the
     * back-off grows once per round in which every address failed. */
    size_t          cur;
    size_t          round_fails;  /* failed attempts in the current round */
    long            connected;    /* index connected now, -1 none */
    long            last_up;      /* index of the last connection made, -1 none */
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
    ev_timer        nackt;        /* nack_reopen after the first nack of a run */
    int64_t         backoff_ms;
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

static int heartbeat_s(const amqp_sink_conf *c)
{
    int64_t s;

    if (c->heartbeat_ms <= 0)
        return 0;
    s = (c->heartbeat_ms + 999) / 1000;
    return s > 65535 ? 65535 : (int)s;
}

/* The peer, as every message about this sink's connection names it (run and
 * check alike): "broker 127.0.0.1:5672 vhost /"; i: which address of the list. */
static void set_ident(char *buf, size_t len, const amqp_sink_conf *c, size_t i)
{
    if (i < c->n_brokers)
        snprintf(buf, len, "broker %s vhost %s", c->brokers[i].addr,
                 c->vhost ? c->vhost : "?");
    else
        snprintf(buf, len, "broker %s:%d vhost %s", c->host ? c->host : "?", c->port,
                 c->vhost ? c->vhost : "?");
}

/* The peer in an ident, without the word "broker": on_state's peer (a log field). */
static const char *ident_peer(const char *ident)
{
    return strncmp(ident, "broker ", 7) == 0 ? ident + 7 : ident;
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

/* ------------------------------------------------- failure reasons, in words */

/* The first certificate problem OpenSSL met during this thread's handshake:
 * the verify callback runs on the thread that connects (a worker, or check). */
static _Thread_local int  tl_verify_err;
static _Thread_local int  tl_verify_depth;
static _Thread_local char tl_verify_subject[256];

static int verify_cb(int ok, X509_STORE_CTX *x)
{
    if (!ok && tl_verify_err == 0) {
        X509 *cert = X509_STORE_CTX_get_current_cert(x);

        tl_verify_err = X509_STORE_CTX_get_error(x);
        tl_verify_depth = X509_STORE_CTX_get_error_depth(x);
        tl_verify_subject[0] = '\0';
        if (cert != NULL)
            X509_NAME_oneline(X509_get_subject_name(cert), tl_verify_subject,
                              (int)sizeof tl_verify_subject);
    }
    return ok;   /* rabbitmq-c checks the verify result after the handshake */
}

/* The last TLS alert the broker sent during this thread's connect
 * ("certificate required" when it wants a client certificate): rabbitmq-c
 * pops OpenSSL's error queue on a failed read, the alert survives here. */
static _Thread_local char tl_alert[128];

static void info_cb(const SSL *ssl, int where, int ret)
{
    (void)ssl;
    const char *desc;

    /* only alerts read from the broker (SSL_CB_WRITE_ALERT shares the alert bit) */
    if ((where & SSL_CB_READ_ALERT) != SSL_CB_READ_ALERT || tl_alert[0] != '\0')
        return;
    desc = SSL_alert_desc_string_long(ret);
    if ((ret & 0xff) == 116)   /* TLS 1.3 certificate_required: unnamed in OpenSSL 3.0 */
        desc = "certificate required (the broker asked for a client certificate: tls_cert, tls_key)";
    if (desc == NULL || strcmp(desc, "unknown") == 0)
        snprintf(tl_alert, sizeof tl_alert, "%s alert %d from the broker",
                 SSL_alert_type_string_long(ret), ret & 0xff);
    else
        snprintf(tl_alert, sizeof tl_alert, "%s alert from the broker: %s",
                 SSL_alert_type_string_long(ret), desc);
}

/* Whether the broker asked for a client certificate while none is configured.
 * Its alert may never be read: it closes the connection right after, and the
 * reset that follows our next write discards unread data. */
static _Thread_local bool tl_cert_asked;

static int client_cert_cb(SSL *ssl, X509 **x509, EVP_PKEY **pkey)
{
    (void)ssl;
    (void)x509;
    (void)pkey;
    tl_cert_asked = true;
    return 0;   /* none: the handshake goes on without one */
}

/* Appends why TLS failed: the broker's request for a client certificate we do
 * not have, else its alert, else the last OpenSSL error of this thread;
 * clears OpenSSL's error queue. (A broker that only asks for a certificate,
 * without requiring one, and then fails for another reason is reported as
 * asking too: the words stay the same whether its alert was read or not.) */
static void add_ssl_error(char *buf, size_t len)
{
    unsigned long e = ERR_peek_last_error();
    const char   *r;
    size_t        n = strlen(buf);

    if (tl_cert_asked && n < len) {   /* first: the same words whether the alert was read or not */
        snprintf(buf + n, len - n, ": the broker asked for a client certificate and none is "
                 "configured (tls_cert, tls_key)");
    } else if (tl_alert[0] != '\0' && n < len) {
        snprintf(buf + n, len - n, ": %s", tl_alert);
    } else if (e != 0 && n < len) {
        r = ERR_reason_error_string(e);
        if (r != NULL)
            snprintf(buf + n, len - n, ": %s", r);
        else
            snprintf(buf + n, len - n, ": OpenSSL error 0x%lx", e);
    }
    ERR_clear_error();
}

/* An encrypted tls_key would make OpenSSL prompt for its passphrase on the
 * terminal: no prompt, the key fails to load and the error says why. */
static int no_passphrase_cb(char *buf, int size, int rwflag, void *u)
{
    (void)buf;
    (void)size;
    (void)rwflag;
    (void)u;
    return 0;
}

/* rabbitmq-c loses the errno of a failed TCP connect: connect once more,
 * bounded, to say why ("connection refused"). Writes into buf. */
static void probe_connect(const char *host, int port, int64_t timeout_ms, char *buf, size_t len)
{
    struct addrinfo hint, *res = NULL;
    char            portstr[16];
    int             fd = -1, rc, soerr = 0;
    socklen_t       sl = sizeof soerr;

    memset(&hint, 0, sizeof hint);
    hint.ai_family = AF_UNSPEC;
    hint.ai_socktype = SOCK_STREAM;
    snprintf(portstr, sizeof portstr, "%d", port);
    if ((rc = getaddrinfo(host, portstr, &hint, &res)) != 0) {
        snprintf(buf, len, "cannot resolve %s: %s", host, gai_strerror(rc));
        return;
    }
    fd = socket(res->ai_family, res->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, res->ai_protocol);
    if (fd < 0) {
        snprintf(buf, len, "socket: %s", strerror(errno));
        goto out;
    }
    if (connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
        snprintf(buf, len, "a socket error (the port answers now)");
        goto out;
    }
    if (errno == EINPROGRESS) {
        struct pollfd p = { .fd = fd, .events = POLLOUT };

        do {
            rc = poll(&p, 1, (int)(timeout_ms > 60000 ? 60000 : timeout_ms));
        } while (rc < 0 && errno == EINTR);
        if (rc == 0) {
            snprintf(buf, len, "timeout after %g s", (double)timeout_ms / 1000.);
            goto out;
        }
        if (rc < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
            soerr = errno;
        if (soerr == 0) {
            snprintf(buf, len, "a socket error (the port answers now)");
            goto out;
        }
    } else {
        soerr = errno;
    }
    snprintf(buf, len, "%s", strerror(soerr));
    if (buf[0] >= 'A' && buf[0] <= 'Z' && buf[1] >= 'a' && buf[1] <= 'z')
        buf[0] = (char)(buf[0] - 'A' + 'a');   /* "connection refused" */
out:
    if (fd >= 0)
        close(fd);
    freeaddrinfo(res);
}

/* Why a login (or channel.open / confirm.select) failed, in words. */
static void fmt_login_fail(amqp_rpc_reply_t r, const char *what, const cfg_sink *c, char *buf,
                           size_t len)
{
    const amqp_sink_conf *ac = amqp_sink_conf_of(c);
    double t = (double)c->connect_timeout_ms / 1000.;

    if (r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION && r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
        const amqp_connection_close_t *m = r.reply.decoded;
        int n = (int)m->reply_text.len;
        const char *txt = (const char *)m->reply_text.bytes;

        if (m->reply_code == AMQP_ACCESS_REFUSED)
            snprintf(buf, len, "%s refused (%.*s)", what, n, txt);
        else if (m->reply_code == AMQP_NOT_ALLOWED)
            snprintf(buf, len, "%s: vhost not allowed (%.*s)", what, n, txt);
        else
            snprintf(buf, len, "%s: the broker closed the connection: %u %.*s", what,
                     (unsigned)m->reply_code, n, txt);
        return;
    }
    if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION) {
        switch (r.library_error) {
        case AMQP_STATUS_TIMEOUT:
            snprintf(buf, len, "%s: timeout after %g s (the TCP connection is up, the broker "
                     "does not answer)", what, t);
            return;
        case AMQP_STATUS_CONNECTION_CLOSED:
        case AMQP_STATUS_SOCKET_ERROR:
        case AMQP_STATUS_BAD_AMQP_DATA:
        case AMQP_STATUS_UNEXPECTED_STATE:
        case AMQP_STATUS_INCOMPATIBLE_AMQP_VERSION:
            snprintf(buf, len, "%s: %s%s", what, amqp_error_string2(r.library_error),
                     ac->tls ? "" : " (a TLS port? then use amqps://)");
            if (ac->tls)
                add_ssl_error(buf, len);
            return;
        case AMQP_STATUS_SSL_ERROR:
            snprintf(buf, len, "%s: TLS error", what);
            add_ssl_error(buf, len);
            return;
        default:
            break;
        }
    }
    fmt_reply(r, what, buf, len);
}

/* Why opening the socket (TCP connect, and for amqps the TLS handshake) failed. */
static void fmt_open_fail(int rc, const cfg_sink *c, char *buf, size_t len)
{
    const amqp_sink_conf *ac = amqp_sink_conf_of(c);
    char                  why[300];
    double                t = (double)c->connect_timeout_ms / 1000.;

    switch (rc) {
    case AMQP_STATUS_HOSTNAME_RESOLUTION_FAILED:
        snprintf(buf, len, "cannot resolve host name %s", ac->host);
        break;
    case AMQP_STATUS_TIMEOUT:
        snprintf(buf, len, "%s: timeout after %g s", ac->tls ? "connect/TLS handshake" : "connect", t);
        break;
    case AMQP_STATUS_SOCKET_ERROR:
        probe_connect(ac->host, ac->port, c->connect_timeout_ms, why, sizeof why);
        snprintf(buf, len, "connect: %s", why);
        break;
    case AMQP_STATUS_SSL_PEER_VERIFY_FAILED:
        if (tl_verify_err != 0)
            snprintf(buf, len, "TLS: certificate verify failed: %s (depth %d, %s)",
                     X509_verify_cert_error_string(tl_verify_err), tl_verify_depth,
                     tl_verify_subject[0] ? tl_verify_subject : "no subject");
        else
            snprintf(buf, len, "TLS: certificate verify failed: the broker sent no certificate");
        ERR_clear_error();
        break;
    case AMQP_STATUS_SSL_HOSTNAME_VERIFY_FAILED:
        snprintf(buf, len, "TLS: certificate verify failed: the certificate does not name %s", ac->host);
        ERR_clear_error();
        break;
    case AMQP_STATUS_SSL_CONNECTION_FAILED:
    case AMQP_STATUS_SSL_ERROR:
        snprintf(buf, len, "TLS handshake failed");
        add_ssl_error(buf, len);
        break;
    default:
        snprintf(buf, len, "connect: %s", amqp_error_string2(rc));
        if (ac->tls)
            add_ssl_error(buf, len);
        break;
    }
}

static bool is_ip_address(const char *h)
{
    unsigned char a[sizeof(struct in6_addr)];

    return inet_pton(AF_INET, h, a) == 1 || inet_pton(AF_INET6, h, a) == 1;
}

/* TLS settings on a new SSL socket: CA, client certificate, and verification
 * by OpenSSL itself (chain, then the host name or IP address against the
 * certificate's SANs; rabbitmq-c 0.11's own host name check knows DNS names
 * only, so amqps://127.0.0.1 failed even with an IP SAN). */
static int tls_setup(amqp_socket_t *sock, const amqp_sink_conf *c, char *err, size_t errlen)
{
    const char *ca = c->tls_ca_file;
    SSL_CTX    *ctx = amqp_ssl_socket_get_context(sock);
    int         rc;

    if (ctx == NULL) {
        snprintf(err, errlen, "cannot create a TLS context");
        return -1;
    }
    if (ca == NULL && c->tls_verify && access(AMQPSINK_SYS_CA, R_OK) == 0)
        ca = AMQPSINK_SYS_CA;
    if (ca != NULL && (rc = amqp_ssl_socket_set_cacert(sock, ca)) != AMQP_STATUS_OK) {
        snprintf(err, errlen, "tls_ca_file %s: %s", ca, amqp_error_string2(rc));
        add_ssl_error(err, errlen);
        return -1;
    }
    if ((c->tls_cert == NULL) != (c->tls_key == NULL)) {
        snprintf(err, errlen, "%s is set without %s: a client certificate needs both",
                 c->tls_cert ? "tls_cert" : "tls_key", c->tls_cert ? "tls_key" : "tls_cert");
        return -1;
    }
    SSL_CTX_set_default_passwd_cb(ctx, no_passphrase_cb);
    if (c->tls_cert != NULL &&
        (rc = amqp_ssl_socket_set_key(sock, c->tls_cert, c->tls_key)) != AMQP_STATUS_OK) {
        snprintf(err, errlen, "tls_cert %s / tls_key %s (an unencrypted PEM key): %s",
                 c->tls_cert, c->tls_key, amqp_error_string2(rc));
        add_ssl_error(err, errlen);
        return -1;
    }
    amqp_ssl_socket_set_verify_peer(sock, c->tls_verify ? 1 : 0);
    amqp_ssl_socket_set_verify_hostname(sock, 0);   /* OpenSSL checks it, below */
    SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, verify_cb);   /* rabbitmq-c reads the result */
    SSL_CTX_set_info_callback(ctx, info_cb);
    if (c->tls_cert == NULL)
        SSL_CTX_set_client_cert_cb(ctx, client_cert_cb);
    if (c->tls_verify) {
        X509_VERIFY_PARAM *vp = SSL_CTX_get0_param(ctx);
        int                ok;

        if (is_ip_address(c->host)) {
            ok = X509_VERIFY_PARAM_set1_ip_asc(vp, c->host);
        } else {
            X509_VERIFY_PARAM_set_hostflags(vp, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
            ok = X509_VERIFY_PARAM_set1_host(vp, c->host, 0);
        }
        if (ok != 1) {
            snprintf(err, errlen, "cannot set up verification of host %s", c->host);
            add_ssl_error(err, errlen);
            return -1;
        }
    }
    return 0;
}

/* Blocking connect + login + channel.open(ch) + confirm.select, each step
 * bounded by connect_timeout; runs on a worker thread (or in check). If
 * jb is given, the socket is published there while the handshake runs so
 * that destroy() can cut it short. Returns 0 and *out, or -1 with err (the
 * reason in words, without the peer: the caller adds ident). */
static int conn_open(const cfg_sink *c, const char *conn_name, amqp_channel_t ch, cjob *jb,
                     amqp_connection_state_t *out, char *err, size_t errlen)
{
    const amqp_sink_conf   *ac = amqp_sink_conf_of(c);
    amqp_connection_state_t conn;
    amqp_socket_t          *sock;
    struct timeval          tv = tv_ms(c->connect_timeout_ms);
    struct props_storage    ps;
    amqp_table_t            props;
    amqp_rpc_reply_t        r;
    int                     rc;
    bool                    gone = false;

    *out = NULL;
    ERR_clear_error();
    tl_verify_err = 0;
    tl_alert[0] = '\0';
    tl_cert_asked = false;
    conn = amqp_new_connection();
    if (conn == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (ac->tls) {
        sock = amqp_ssl_socket_new(conn);   /* owned by conn */
        if (sock == NULL) {
            snprintf(err, errlen, "cannot create a TLS socket");
            add_ssl_error(err, errlen);
            goto fail;
        }
        if (tls_setup(sock, ac, err, errlen) < 0)
            goto fail;
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
    rc = amqp_socket_open_noblock(sock, ac->host, ac->port, &tv);
    if (rc != AMQP_STATUS_OK) {
        fmt_open_fail(rc, c, err, errlen);
        goto fail;
    }
    if (jb != NULL) {
        pthread_mutex_lock(&jb->mu);
        gone = jb->abandoned;
        if (!gone)
            jb->fd = amqp_get_sockfd(conn);
        pthread_mutex_unlock(&jb->mu);
        if (gone) {
            snprintf(err, errlen, "cancelled");
            goto fail;
        }
    }
    props = client_props(&ps, conn_name);
    r = amqp_login_with_properties(conn, ac->vhost, 0, AMQPSINK_FRAME_MAX, heartbeat_s(ac),
                                   &props, AMQP_SASL_METHOD_PLAIN, ac->user, ac->pass);
    if (r.reply_type != AMQP_RESPONSE_NORMAL) {
        fmt_login_fail(r, "login", c, err, errlen);
        goto fail;
    }
    amqp_channel_open(conn, ch);
    r = amqp_get_rpc_reply(conn);
    if (r.reply_type != AMQP_RESPONSE_NORMAL) {
        fmt_login_fail(r, "channel.open", c, err, errlen);
        goto fail;
    }
    amqp_confirm_select(conn, ch);
    r = amqp_get_rpc_reply(conn);
    if (r.reply_type != AMQP_RESPONSE_NORMAL) {
        fmt_login_fail(r, "confirm.select", c, err, errlen);
        goto fail;
    }
    if (jb != NULL) {
        pthread_mutex_lock(&jb->mu);
        jb->fd = -1;
        pthread_mutex_unlock(&jb->mu);
    }
    *out = conn;   /* ownership to the caller */
    return 0;
fail:
    if (jb != NULL) {
        /* never shut down a descriptor number that destroy below frees for reuse */
        pthread_mutex_lock(&jb->mu);
        jb->fd = -1;
        pthread_mutex_unlock(&jb->mu);
    }
    amqp_destroy_connection(conn);
    ERR_clear_error();
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

/* ------------------------------------------------------------ connect worker */

static void cfg_strings_free(cfg_sink *c, amqp_sink_conf *conf)
{
    free(c->name);
    c->name = NULL;
    c->backend_conf = NULL;
    amqp_sink_conf_clear(conf);
}

static int dupstr(char **dst, const char *src)
{
    *dst = NULL;
    if (src == NULL)
        return 0;
    *dst = strdup(src);
    return *dst ? 0 : -1;
}

/* Deep copy of what a connection needs: the generic settings with the name (url and
 * password are not kept: they may carry the password; conf's pass is the one copy) and
 * the rabbitmq settings, dst->backend_conf pointing at dconf. The broker list too: a
 * conf filled by hand without one (a test driver) gets its host:port as the only
 * address. -1 when out of memory (dst, dconf then hold whatever was copied: free them
 * with cfg_strings_free). */
static int cfg_strings_dup(cfg_sink *dst, amqp_sink_conf *dconf, const cfg_sink *src)
{
    const amqp_sink_conf *sconf = amqp_sink_conf_of(src);
    size_t                n = sconf->n_brokers > 0 ? sconf->n_brokers : 1;

    *dst = *src;
    dst->url = NULL;
    dst->password = NULL;
    dst->name = NULL;
    dst->backend_conf = dconf;
    *dconf = *sconf;
    dconf->host = dconf->user = dconf->pass = dconf->vhost = NULL;
    dconf->tls_ca_file = dconf->tls_cert = dconf->tls_key = NULL;
    dconf->brokers = NULL;
    dconf->n_brokers = 0;
    if (dupstr(&dst->name, src->name) < 0 || dupstr(&dconf->host, sconf->host) < 0 ||
        dupstr(&dconf->user, sconf->user) < 0 || dupstr(&dconf->pass, sconf->pass) < 0 ||
        dupstr(&dconf->vhost, sconf->vhost) < 0 ||
        dupstr(&dconf->tls_ca_file, sconf->tls_ca_file) < 0 ||
        dupstr(&dconf->tls_cert, sconf->tls_cert) < 0 ||
        dupstr(&dconf->tls_key, sconf->tls_key) < 0)
        return -1;
    if ((dconf->brokers = calloc(n, sizeof *dconf->brokers)) == NULL)
        return -1;
    dconf->n_brokers = n;   /* amqp_brokers_free frees what was copied */
    for (size_t i = 0; i < n; i++) {
        amqp_broker *b = &dconf->brokers[i];
        const char  *h = sconf->n_brokers > 0 ? sconf->brokers[i].host : sconf->host;

        b->port = sconf->n_brokers > 0 ? sconf->brokers[i].port : sconf->port;
        if (h == NULL || dupstr(&b->host, h) < 0)
            return -1;
        if (sconf->n_brokers > 0) {
            if (dupstr(&b->addr, sconf->brokers[i].addr) < 0)
                return -1;
        } else if (asprintf(&b->addr, strchr(h, ':') ? "[%s]:%d" : "%s:%d", h, b->port) < 0) {
            b->addr = NULL;
            return -1;
        }
    }
    return 0;
}

static void job_free(cjob *jb)
{
    if (jb->conn != NULL)
        conn_close(jb->conn, true);
    cfg_strings_free(&jb->cfg, &jb->conf);
    free(jb->conn_name);
    pthread_cond_destroy(&jb->cv);
    pthread_mutex_destroy(&jb->mu);
    free(jb);
}

/* Drops one reference; the last one frees the job. Called without jb->mu. */
static void job_release(cjob *jb)
{
    bool last;

    pthread_mutex_lock(&jb->mu);
    last = --jb->refs == 0;
    pthread_mutex_unlock(&jb->mu);
    if (last)
        job_free(jb);
}

/* The realtime-clock moment ms from now, for pthread_cond_timedwait. */
static struct timespec deadline_in(int64_t ms)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += (time_t)(ms / 1000);
    dl.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    return dl;
}

/* Worker threads still running (detached): the process waits for them before it
 * exits (amqpsink_quiesce), so none is cut off holding memory or a socket. */
static pthread_mutex_t workers_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t  workers_cv = PTHREAD_COND_INITIALIZER;
static unsigned        workers_live;

static void workers_add(int d)
{
    pthread_mutex_lock(&workers_mu);
    workers_live = (unsigned)((int)workers_live + d);
    if (workers_live == 0)
        pthread_cond_broadcast(&workers_cv);
    pthread_mutex_unlock(&workers_mu);
}

static void amqpsink_quiesce(int64_t timeout_ms)
{
    struct timespec dl;
    dl = deadline_in(timeout_ms);
    pthread_mutex_lock(&workers_mu);
    while (workers_live > 0)
        if (pthread_cond_timedwait(&workers_cv, &workers_mu, &dl) == ETIMEDOUT)
            break;
    pthread_mutex_unlock(&workers_mu);
}

static void *job_main(void *arg)
{
    cjob                   *jb = arg;
    amqp_connection_state_t conn = NULL;
    char                    err[sizeof jb->err];

    err[0] = '\0';
    if (conn_open(&jb->cfg, jb->conn_name, jb->ch, jb, &conn, err, sizeof err) < 0)
        conn = NULL;
    pthread_mutex_lock(&jb->mu);
    jb->conn = conn;   /* the job owns it until the loop takes it */
    snprintf(jb->err, sizeof jb->err, "%s", err);
    jb->done = true;
    pthread_cond_broadcast(&jb->cv);
    if (!jb->abandoned)
        ev_async_send(jb->loop, jb->wake);   /* under mu: the sink is still there */
    pthread_mutex_unlock(&jb->mu);
    ERR_clear_error();
    job_release(jb);      /* the last reference may close the connection here */
    OPENSSL_thread_stop(); /* this thread's OpenSSL state, freed before the thread ends */
    workers_add(-1);
    return NULL;
}

/* Starts a connection attempt on a worker thread: 0, or -1 with err. */
static int job_start(sink *s, char *err, size_t errlen)
{
    pthread_attr_t attr;
    pthread_t      th;
    sigset_t       all, old;
    cjob          *jb;
    int            rc;

    jb = calloc(1, sizeof *jb);
    if (jb == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (pthread_mutex_init(&jb->mu, NULL) != 0) {
        free(jb);
        snprintf(err, errlen, "cannot create a mutex");
        return -1;
    }
    if (pthread_cond_init(&jb->cv, NULL) != 0) {
        pthread_mutex_destroy(&jb->mu);
        free(jb);
        snprintf(err, errlen, "cannot create a condition variable");
        return -1;
    }
    jb->refs = 2;
    jb->fd = -1;
    jb->loop = s->loop;
    jb->wake = &s->jobw;
    jb->ch = s->ch;
    if (cfg_strings_dup(&jb->cfg, &jb->conf, &s->cfg) < 0 ||
        dupstr(&jb->conn_name, s->conn_name) < 0) {
        job_free(jb);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    /* this attempt's address */
    free(jb->conf.host);
    jb->conf.host = NULL;
    jb->conf.port = s->conf.brokers[s->cur].port;
    if (dupstr(&jb->conf.host, s->conf.brokers[s->cur].host) < 0) {
        job_free(jb);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if ((rc = pthread_attr_init(&attr)) != 0) {
        job_free(jb);
        snprintf(err, errlen, "cannot start a connect thread: %s", strerror(rc));
        return -1;
    }
    (void)pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* active only while a worker runs; started first: a send to a stopped
     * watcher would be forgotten by ev_async_start */
    ev_async_start(s->loop, &s->jobw);
    /* the worker takes no signals: they belong to the loop thread */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    workers_add(1);
    rc = pthread_create(&th, &attr, job_main, jb);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        workers_add(-1);
        ev_async_stop(s->loop, &s->jobw);
        job_free(jb);
        snprintf(err, errlen, "cannot start a connect thread: %s", strerror(rc));
        return -1;
    }
    s->job = jb;
    return 0;
}

/* Abandons the attempt in progress (destroy): cuts its handshake short and
 * waits for the worker at most AMQPSINK_CANCEL_WAIT_MS, so the event loop is
 * never held by a hung attempt (a reload or a stop goes on at once). A worker
 * still busy after that (a TCP connect to a silent peer, a name lookup:
 * bounded by connect_timeout itself) no longer touches the sink (abandoned,
 * under mu) and frees the job and its connection when it ends; the process
 * waits for such workers only at exit (quiesce). */
static void job_cancel(sink *s)
{
    cjob           *jb = s->job;
    struct timespec dl;
    int64_t         ms = AMQPSINK_CANCEL_WAIT_MS;

    if (jb == NULL)
        return;
    s->job = NULL;
    dl = deadline_in(ms);
    pthread_mutex_lock(&jb->mu);
    jb->abandoned = true;
    if (jb->fd >= 0)
        (void)shutdown(jb->fd, SHUT_RDWR);   /* the worker's recv/send fail at once */
    while (!jb->done) {
        if (pthread_cond_timedwait(&jb->cv, &jb->mu, &dl) == ETIMEDOUT)
            break;
    }
    pthread_mutex_unlock(&jb->mu);
    job_release(jb);   /* a finished job's connection is closed with it */
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
    s->cbs.on_state(s->cbs.ud, st, ident_peer(s->ident), msg);
    return !s->dying;
}

static bool settle(sink *s, uint64_t tag, int outcome, const char *reason)
{
    entry *e = slot(s, tag);
    void  *ud = e->msg_ud;
    char  *ret = e->ret_reason;   /* freed after the callback */
    bool   alive;

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
        if (s->pch == PCH_DRAIN) {   /* it does after all: publish on it again */
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
    if (!s->want_writable || cur_state(s) == SINK_DOWN || broker_silent(s) || s->pch != PCH_OPEN)
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

/* An attempt failed or the connection was lost at address cur: the next
 * attempt goes to the next address of the list (the same one when there is
 * only one). Within a round of the list it follows at the shortest delay;
 * after a round in which every address failed, after the back-off, which then
 * doubles up to reconnect_max (with one address: after every failure, as
 * before lists existed). */
static void schedule_reconnect(sink *s)
{
    double d, base = AMQPSINK_BACKOFF_MIN / 1000.;

    s->cur = (s->cur + 1) % s->conf.n_brokers;
    if (++s->round_fails >= s->conf.n_brokers) {
        s->round_fails = 0;
        base = (double)s->backoff_ms / 1000.;
        s->backoff_ms = outbox_util_backoff_next(s->backoff_ms, AMQPSINK_BACKOFF_MIN,
                                                 s->cfg.reconnect_max_ms);
    }
    /* xorshift64 jitter: delay in [base/2, base) */
    s->rnd ^= s->rnd << 13;
    s->rnd ^= s->rnd >> 7;
    s->rnd ^= s->rnd << 17;
    d = base * (0.5 + 0.5 * (double)(s->rnd % 1000000) / 1e6);
    ev_timer_stop(s->loop, &s->retry);
    ev_timer_set(&s->retry, d, 0.);
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
static bool conn_fail(sink *s, const char *why)
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
static void nack_check(sink *s);
static bool pch_kick(sink *s);
static bool pch_timeout(sink *s);
static amqp_channel_t check_channel(amqp_connection_state_t conn);

static void sink_free(sink *s);

/* ------------------------------------------------------------ loop callbacks */

#define ENTER(s) ((s)->depth++)
#define LEAVE(s)                                   \
    do {                                           \
        if (--(s)->depth == 0 && (s)->dying)       \
            sink_free(s);                          \
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
    char  err[300];

    (void)loop;
    (void)revents;
    if (s->job != NULL || s->conn != NULL)
        return;
    ENTER(s);
    s->ch = 1;
    set_ident(s->ident, sizeof s->ident, &s->conf, s->cur);   /* this attempt's peer */
    if (job_start(s, err, sizeof err) < 0)
        connect_failed(s, err);
    LEAVE(s);
}

/* The worker is done: take its connection (or its reason) on the loop. */
static void jobw_cb(struct ev_loop *loop, ev_async *w, int revents)
{
    sink                   *s = w->data;
    cjob                   *jb = s->job;
    amqp_connection_state_t conn;
    char                    err[sizeof jb->err];

    (void)loop;
    (void)revents;
    if (jb == NULL)
        return;
    pthread_mutex_lock(&jb->mu);
    if (!jb->done) {
        pthread_mutex_unlock(&jb->mu);
        return;
    }
    conn = jb->conn;   /* ownership to the sink */
    jb->conn = NULL;
    snprintf(err, sizeof err, "%s", jb->err);
    pthread_mutex_unlock(&jb->mu);
    s->job = NULL;
    ev_async_stop(s->loop, &s->jobw);
    job_release(jb);

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
    s->ret_stage = 0;
    x_clear(s);
    s->ck_ch = check_channel(s->conn);
    set_sock_opts(s);
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
    if (!pch_timeout(s) || s->conn == NULL)
        goto out;
    nack_check(s);   /* only nacks for long enough, also when no more come */
    if (!pch_kick(s) || s->conn == NULL)   /* a reopen held back for socket room */
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
                snprintf(err, errlen, "exchange '%s' refused in vhost '%s'", ex, s->conf.vhost);
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
             "the publishing channel: %s)", ex, s->conf.vhost, text);
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
                     "a passive exchange.declare)", s->ck_cur->name, s->conf.vhost);
        else
            snprintf(why, sizeof why, "exchange '%s' in vhost '%s' refused by the broker: %u %s "
                     "(checked with a passive exchange.declare)", s->ck_cur->name, s->conf.vhost,
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

/* ------------------------------------------------------------ channel reopen */

/* The next publishing channel number: they cycle below the check channel. */
static amqp_channel_t next_channel(const sink *s)
{
    int max = amqp_get_channel_max(s->conn);

    if (max <= 0 || max > 65535)
        max = 65535;
    if (s->ck_ch != 0)
        max = s->ck_ch - 1;   /* the check channel is the highest */
    return (amqp_channel_t)(s->ch >= max ? 1 : s->ch + 1);
}

static bool emit_event(sink *s, int ev, const char *msg)
{
    if (s->cbs.on_event != NULL) {
        s->cbs.on_event(s->cbs.ud, ev, msg);
        return !s->dying;
    }
    return true;
}

/* A channel that got only nacks for nack_reopen (at least AMQP_NACK_REOPEN_MIN,
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
        s->pch != PCH_OPEN || s->nack_run < AMQP_NACK_REOPEN_MIN ||
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
        s->pch == PCH_SELECTING || !sock_room(s, AMQPSINK_CHECK_BYTES))
        return true;
    if (s->pch == PCH_DRAIN) {
        amqp_channel_close_t m;
        amqp_channel_t       old = s->ch;
        char                 msg[700];

        if (s->inflight > 0)
            return true;   /* their nacks (or acks) come first */
        memset(&m, 0, sizeof m);
        m.reply_code = AMQP_REPLY_SUCCESS;
        m.reply_text = cbytes("outbox-relay: reopening a channel that got only nacks");
        rc = amqp_send_method(s->conn, old, AMQP_CHANNEL_CLOSE_METHOD, &m);
        if (rc != AMQP_STATUS_OK) {
            mark_broken(s, "channel.close", rc);
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
        if (s->conn == NULL || !sock_room(s, AMQPSINK_CHECK_BYTES))
            return true;
    }
    if (s->pch == PCH_WANT_OPEN) {
        amqp_channel_open_t m;

        memset(&m, 0, sizeof m);
        m.out_of_band = amqp_empty_bytes;
        rc = amqp_send_method(s->conn, s->ch, AMQP_CHANNEL_OPEN_METHOD, &m);
        s->pch = PCH_OPENING;
    } else {   /* PCH_WANT_SELECT */
        amqp_confirm_select_t m;

        memset(&m, 0, sizeof m);   /* nowait = 0: confirm.select-ok answers */
        rc = amqp_send_method(s->conn, s->ch, AMQP_CONFIRM_SELECT_METHOD, &m);
        s->pch = PCH_SELECTING;
    }
    s->pch_sent_at = ev_now(s->loop);
    if (rc != AMQP_STATUS_OK) {
        mark_broken(s, s->pch == PCH_OPENING ? "channel.open" : "confirm.select", rc);
        return true;
    }
    /* a send may read from the socket (heartbeat check): frames it queued
     * would never wake the read watcher */
    if (amqp_frames_enqueued(s->conn) || amqp_data_in_buffer(s->conn))
        ev_feed_event(s->loop, &s->rio, EV_READ);
    return true;
}

/* channel.open or confirm.select without an answer within connect_timeout (the
 * bound the blocking reopen had; the clock stops while the broker blocks the
 * connection). Returns false when the sink was destroyed. */
static bool pch_timeout(sink *s)
{
    ev_tstamp since;
    char      why[300];

    if (s->conn == NULL || s->blocked || (s->pch != PCH_OPENING && s->pch != PCH_SELECTING))
        return true;
    since = s->pch_sent_at > s->unblocked_at ? s->pch_sent_at : s->unblocked_at;
    if (ev_now(s->loop) - since <= (double)s->cfg.connect_timeout_ms / 1000.)
        return true;
    snprintf(why, sizeof why, "reopening the publishing channel: no answer to %s of channel %u "
             "within %lld ms", s->pch == PCH_OPENING ? "channel.open" : "confirm.select",
             (unsigned)s->ch, (long long)s->cfg.connect_timeout_ms);
    return conn_fail(s, why);
}

/* A frame on the publishing channel's new number while it is being opened. */
static bool on_reopen_frame(sink *s, const amqp_frame_t *f)
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
        if (!s->chan_ok) {   /* closed by the broker: DOWN until now */
            char st[400];

            s->chan_ok = true;
            snprintf(st, sizeof st, "channel %u reopened on %s", (unsigned)s->ch, s->ident);
            return emit_state(s, st);
        }
        s->want_writable = true;   /* rows held back with SINK_EAGAIN: on_writable */
        return true;
    case AMQP_CHANNEL_CLOSE_METHOD: {
        const amqp_channel_close_t *m = f->payload.method.decoded;
        amqp_channel_close_ok_t     ok;
        char                        why[700];

        memset(&ok, 0, sizeof ok);
        (void)amqp_send_method(s->conn, s->ch, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
        snprintf(why, sizeof why, "reopening the publishing channel: the broker closed channel "
                 "%u: %u %.*s", (unsigned)s->ch, (unsigned)m->reply_code, (int)m->reply_text.len,
                 (const char *)m->reply_text.bytes);
        return conn_fail(s, why);
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
    /* Reopen on the next channel number, without waiting here: DOWN until
     * confirm.select-ok (on_reopen_frame), bounded by connect_timeout. */
    s->ch = next_channel(s);
    s->next_tag = s->tail_tag = 1;
    s->pch = PCH_WANT_OPEN;
    return pch_kick(s);
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
    if (f->channel != s->ch)
        return true;   /* leftovers of a closed channel */
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
            return pch_kick(s);   /* a channel draining for its reopen: its last answer? */
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
    job_cancel(s);
    ev_async_stop(s->loop, &s->jobw);
    ev_io_stop(s->loop, &s->rio);
    ev_io_stop(s->loop, &s->wio);
    ev_timer_stop(s->loop, &s->tick);
    ev_timer_stop(s->loop, &s->retry);
    ev_timer_stop(s->loop, &s->wretry);
    ev_timer_stop(s->loop, &s->failt);
    ev_timer_stop(s->loop, &s->nackt);
    conn_close(s->conn, !s->broken);
    s->conn = NULL;
    x_clear(s);
    if (s->ring != NULL) {
        for (uint64_t i = 0; i <= s->ring_mask; i++)
            free(s->ring[i].ret_reason);
        free(s->ring);
    }
    cfg_strings_free(&s->cfg, &s->conf);
    free(s->conn_name);
    free(s);
}

static int amqpsink_create(struct ev_loop *loop, const cfg_sink *sc, const char *conn_name,
                           const sink_cbs *cbs, sink **out, char *err, size_t errlen)
{
    const amqp_sink_conf *ac = amqp_sink_conf_of(sc);
    sink                 *s;
    uint64_t              cap = 1;

    *out = NULL;
    if (ac != NULL && (!sc->confirms || !ac->mandatory)) {
        snprintf(err, errlen, "sink %s: publisher confirms and mandatory are required",
                 sc->name ? sc->name : "?");
        return -1;
    }
    if (ac == NULL || sc->publish_window < 1 || sc->publish_window > 65535 ||
        ac->host == NULL || ac->user == NULL || ac->pass == NULL || ac->vhost == NULL) {
        snprintf(err, errlen, "sink %s: incomplete configuration", sc->name ? sc->name : "?");
        return -1;
    }
    s = calloc(1, sizeof *s);
    if (s == NULL)
        goto oom;
    s->loop = loop;
    s->cbs = *cbs;
    s->reported = -1;
    ev_async_init(&s->jobw, jobw_cb);   /* before any goto oom: sink_free stops it */
    s->jobw.data = s;
    if (cfg_strings_dup(&s->cfg, &s->conf, sc) < 0 ||   /* url/password not kept: they may carry the password */
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
    s->backoff_ms = AMQPSINK_BACKOFF_MIN;
    s->rnd = (uint64_t)(uintptr_t)s ^ ((uint64_t)time(NULL) << 20) ^ (uint64_t)getpid();
    if (s->rnd == 0)
        s->rnd = 88172645463325252ULL;
    s->cur = 0;
    s->connected = s->last_up = -1;
    set_ident(s->ident, sizeof s->ident, &s->conf, 0);

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
    s->rio.data = s->wio.data = s->tick.data = s->retry.data = s->wretry.data =
        s->failt.data = s->nackt.data = s;
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
    if (s->pch != PCH_OPEN) {   /* the channel is being reopened (nack_reopen) */
        s->want_writable = true;
        free(hmem);
        return SINK_EAGAIN;   /* on_writable follows */
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
    if (s->conf.tls)
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

/* Connects to every address of the list in turn (a node that cannot be
 * reached is found now, not at failover). err: one line per address that
 * failed, separated by '\n', each naming its peer; on success with several
 * addresses, a note naming them. */
static int amqpsink_check(const cfg_sink *sc, char *err, size_t errlen)
{
    const amqp_sink_conf   *ac = amqp_sink_conf_of(sc);
    amqp_connection_state_t conn;
    cfg_sink                one;
    amqp_sink_conf          oneconf;
    char                    ident[300], why[800];
    size_t                  n, bad = 0, o = 0;

    if (errlen > 0)
        err[0] = '\0';
    if (ac == NULL) {
        snprintf(err, errlen, "sink %s: incomplete configuration", sc->name ? sc->name : "?");
        return -1;
    }
    n = ac->n_brokers > 0 ? ac->n_brokers : 1;
    set_ident(ident, sizeof ident, ac, 0);
    if (!sc->confirms || !ac->mandatory) {
        snprintf(err, errlen, "%s: publisher confirms and mandatory are required", ident);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        one = *sc;   /* borrowed strings; only host and port change */
        oneconf = *ac;
        one.backend_conf = &oneconf;
        if (ac->n_brokers > 0) {
            oneconf.host = ac->brokers[i].host;
            oneconf.port = ac->brokers[i].port;
        }
        set_ident(ident, sizeof ident, ac, i);
        if (conn_open(&one, "outbox-relay check", 1, NULL, &conn, why, sizeof why) < 0) {
            /* run logs the same words */
            if (o < errlen)
                o += (size_t)snprintf(err + o, errlen - o, "%s%s: %s", bad > 0 ? "\n" : "", ident,
                                      why);
            bad++;
            continue;
        }
        conn_close(conn, true);
    }
    if (bad > 0)
        return -1;
    if (n > 1) {
        o = (size_t)snprintf(err, errlen, "every broker of the cluster list answers (");
        for (size_t i = 0; i < n && o < errlen; i++)
            o += (size_t)snprintf(err + o, errlen - o, "%s%s", i > 0 ? ", " : "",
                                  ac->brokers[i].addr);
        if (o < errlen)
            snprintf(err + o, errlen - o, ")");
    }
    return 0;
}

static size_t amqpsink_addresses(const cfg_sink *sc, const char **out, size_t max)
{
    const amqp_sink_conf *ac = amqp_sink_conf_of(sc);
    size_t                n = 0;

    for (; ac != NULL && n < ac->n_brokers && n < max; n++)
        out[n] = ac->brokers[n].addr;
    return n;
}

static long amqpsink_broker(const sink *s)
{
    return s->connected;
}

const sink_ops amqpsink_ops = {
    .name      = "rabbitmq",
    .create    = amqpsink_create,
    .destroy   = amqpsink_destroy,
    .start     = amqpsink_start,
    .publish   = amqpsink_publish,
    .in_flight = amqpsink_in_flight,
    .check     = amqpsink_check,
    .quiesce   = amqpsink_quiesce,
    .addresses = amqpsink_addresses,
    .broker    = amqpsink_broker,
};
