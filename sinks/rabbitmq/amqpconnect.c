/*
 * amqpconnect.c — the RabbitMQ sink's work off the event loop (amqpconnect.h).
 *
 * connect/TLS handshake/login/channel.open/confirm.select never run on the
 * loop: each attempt runs on its own worker thread (struct amqpsink_job), each
 * step bounded by connect_timeout (socket open timeout, handshake timeout, rpc
 * timeout; DNS is not bounded). The worker owns the new connection until it
 * hands it back through an ev_async; from then on only the loop touches it.
 * Abandoning an attempt (the sink is destroyed) shuts the worker's socket down
 * (once the TCP connection exists) and waits for the worker only briefly; a
 * worker still running after that cleans up after itself. `check` runs the
 * same blocking connect on the caller's thread, once per address.
 *
 * A failure is reported in words: rabbitmq-c's status codes lose the errno of
 * a refused TCP connect and OpenSSL's reasons, so the TLS callbacks below keep
 * what the handshake met (per thread) and a refused connect is probed again.
 */
#include "sinks/rabbitmq/amqpconnect.h"
#include "sinks/rabbitmq/amqpcfg.h"
#include "lib/outbox_util.h"

#include <amqp.h>
#include <amqp_ssl_socket.h>
#include <amqp_tcp_socket.h>
#include <arpa/inet.h>
#include <errno.h>
#include <ev.h>
#include <linux/sockios.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <openssl/x509_vfy.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
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

#define AMQPSINK_CLOSE_TIMEOUT 2000 /* ms, destroy()'s connection.close */
#define AMQPSINK_CANCEL_WAIT_MS \
    20 /* destroy() waits this long for an abandoned connect
                                         attempt (a handshake ends at once once its socket
                                         is shut down; a TCP connect or a name lookup may not,
                                         and is left to end on its own) */
#define AMQPSINK_SYS_CA "/etc/ssl/certs/ca-certificates.crt"

/* One connection attempt on a worker thread. Shared by the sink and the
 * worker (refs). mu guards refs, done, abandoned, fd, conn and err; the
 * inputs are written before the thread starts and only read by it. */
struct amqpsink_job {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* signalled when done */
    int refs;          /* 2 while both hold it; the last one frees it */
    bool done;         /* the worker has finished: conn/err are set */
    bool abandoned;    /* the sink is gone: the worker cleans up */
    int fd;            /* the socket while the handshake runs, else -1 */
    ev_async *wake;    /* the sink's watcher (valid until abandoned) */
    struct ev_loop *loop;
    /* inputs: the worker's own copies */
    cfg_sink cfg;       /* name owned; backend_conf = &conf */
    amqpsink_conf conf; /* strings owned; host and port: this attempt's address */
    char *conn_name;
    amqp_channel_t ch;
    /* outputs */
    amqp_connection_state_t conn; /* owned by the job until taken */
    char err[AMQPSINK_ERR_MAX];
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
            snprintf(buf, len, "%s: unexpected broker method 0x%08x", what, (unsigned)r.reply.id);
        }
        break;
    default:
        snprintf(buf, len, "%s: unknown reply type", what);
        break;
    }
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

static int heartbeat_s(const amqpsink_conf *c)
{
    int64_t s;

    if (c->heartbeat_ms <= 0)
        return 0;
    s = (c->heartbeat_ms + 999) / 1000;
    return s > 65535 ? 65535 : (int)s;
}

void amqpsink_ident(char *buf, size_t len, const amqpsink_conf *c, size_t i)
{
    if (i < c->n_brokers)
        snprintf(buf, len, "broker %s vhost %s", c->brokers[i].addr, c->vhost ? c->vhost : "?");
    else
        snprintf(buf, len, "broker %s:%d vhost %s", c->host ? c->host : "?", c->port,
                 c->vhost ? c->vhost : "?");
}

/* ------------------------------------------------------------ client properties */

/* Builds the client-properties table in caller storage (no allocation). */
struct props_storage {
    amqp_table_entry_t caps[5];
    amqp_table_entry_t top[4];
};

static amqp_table_t client_props(struct props_storage *ps, const char *conn_name)
{
    static const char *const capnames[5] = { "publisher_confirms", "basic.nack",
                                             "connection.blocked", "consumer_cancel_notify",
                                             "authentication_failure_close" };
    amqp_table_t t;

    for (int i = 0; i < 5; i++) {
        ps->caps[i].key = amqpsink_bytes(capnames[i]);
        ps->caps[i].value.kind = AMQP_FIELD_KIND_BOOLEAN;
        ps->caps[i].value.value.boolean = 1;
    }
    ps->top[0].key = amqpsink_bytes("capabilities");
    ps->top[0].value.kind = AMQP_FIELD_KIND_TABLE;
    ps->top[0].value.value.table.num_entries = 5;
    ps->top[0].value.value.table.entries = ps->caps;
    ps->top[1].key = amqpsink_bytes("connection_name");
    ps->top[1].value.kind = AMQP_FIELD_KIND_UTF8;
    ps->top[1].value.value.bytes = amqpsink_bytes(conn_name ? conn_name : "outbox-relay");
    ps->top[2].key = amqpsink_bytes("product");
    ps->top[2].value.kind = AMQP_FIELD_KIND_UTF8;
    ps->top[2].value.value.bytes = amqpsink_bytes("outbox-relay");
    ps->top[3].key = amqpsink_bytes("version");
    ps->top[3].value.kind = AMQP_FIELD_KIND_UTF8;
    ps->top[3].value.value.bytes = amqpsink_bytes(OUTBOX_VERSION);
    t.num_entries = 4;
    t.entries = ps->top;
    return t;
}

/* ------------------------------------------------- failure reasons, in words */

/* The first certificate problem OpenSSL met during this thread's handshake:
 * the verify callback runs on the thread that connects (a worker, or check). */
static _Thread_local int tl_verify_err;
static _Thread_local int tl_verify_depth;
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
    return ok; /* rabbitmq-c checks the verify result after the handshake */
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
    if ((ret & 0xff) == 116) /* TLS 1.3 certificate_required: unnamed in OpenSSL 3.0 */
        desc =
            "certificate required (the broker asked for a client certificate: tls_cert, tls_key)";
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
    return 0; /* none: the handshake goes on without one */
}

/* Appends why TLS failed: the broker's request for a client certificate we do
 * not have, else its alert, else the last OpenSSL error of this thread;
 * clears OpenSSL's error queue. (A broker that only asks for a certificate,
 * without requiring one, and then fails for another reason is reported as
 * asking too: the words stay the same whether its alert was read or not.) */
static void add_ssl_error(char *buf, size_t len)
{
    unsigned long e = ERR_peek_last_error();
    const char *r;
    size_t n = strlen(buf);

    if (tl_cert_asked && n < len) { /* first: the same words whether the alert was read or not */
        snprintf(buf + n, len - n,
                 ": the broker asked for a client certificate and none is "
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
    char portstr[16];
    int fd = -1, rc, soerr = 0;
    socklen_t sl = sizeof soerr;

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
        buf[0] = (char)(buf[0] - 'A' + 'a'); /* "connection refused" */
out:
    if (fd >= 0)
        close(fd);
    freeaddrinfo(res);
}

/* Why a login (or channel.open / confirm.select) failed, in words. */
static void fmt_login_fail(amqp_rpc_reply_t r, const char *what, const cfg_sink *c, char *buf,
                           size_t len)
{
    const amqpsink_conf *ac = amqpsink_conf_of(c);
    double t = (double)c->connect_timeout_ms / 1000.;

    if (r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION &&
        r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
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
            snprintf(buf, len,
                     "%s: timeout after %g s (the TCP connection is up, the broker "
                     "does not answer)",
                     what, t);
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
    const amqpsink_conf *ac = amqpsink_conf_of(c);
    char why[300];
    double t = (double)c->connect_timeout_ms / 1000.;

    switch (rc) {
    case AMQP_STATUS_HOSTNAME_RESOLUTION_FAILED:
        snprintf(buf, len, "cannot resolve host name %s", ac->host);
        break;
    case AMQP_STATUS_TIMEOUT:
        snprintf(buf, len, "%s: timeout after %g s", ac->tls ? "connect/TLS handshake" : "connect",
                 t);
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
        snprintf(buf, len, "TLS: certificate verify failed: the certificate does not name %s",
                 ac->host);
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

/* ------------------------------------------------------------ connecting */

static bool is_ip_address(const char *h)
{
    unsigned char a[sizeof(struct in6_addr)];

    return inet_pton(AF_INET, h, a) == 1 || inet_pton(AF_INET6, h, a) == 1;
}

/* TLS settings on a new SSL socket: CA, client certificate, and verification
 * by OpenSSL itself (chain, then the host name or IP address against the
 * certificate's SANs; rabbitmq-c 0.11's own host name check knows DNS names
 * only, so amqps://127.0.0.1 failed even with an IP SAN). */
static OUTBOX_MUST_CHECK int tls_setup(amqp_socket_t *sock, const amqpsink_conf *c, char *err,
                                       size_t errlen)
{
    const char *ca = c->tls_ca_file;
    SSL_CTX *ctx = amqp_ssl_socket_get_context(sock);
    int rc;

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
        snprintf(err, errlen, "tls_cert %s / tls_key %s (an unencrypted PEM key): %s", c->tls_cert,
                 c->tls_key, amqp_error_string2(rc));
        add_ssl_error(err, errlen);
        return -1;
    }
    amqp_ssl_socket_set_verify_peer(sock, c->tls_verify ? 1 : 0);
    amqp_ssl_socket_set_verify_hostname(sock, 0);        /* OpenSSL checks it, below */
    SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, verify_cb); /* rabbitmq-c reads the result */
    SSL_CTX_set_info_callback(ctx, info_cb);
    if (c->tls_cert == NULL)
        SSL_CTX_set_client_cert_cb(ctx, client_cert_cb);
    if (c->tls_verify) {
        X509_VERIFY_PARAM *vp = SSL_CTX_get0_param(ctx);
        int ok;

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
static OUTBOX_MUST_CHECK int conn_open(const cfg_sink *c, const char *conn_name, amqp_channel_t ch,
                                       amqpsink_job *jb, amqp_connection_state_t *out, char *err,
                                       size_t errlen)
{
    const amqpsink_conf *ac = amqpsink_conf_of(c);
    amqp_connection_state_t conn;
    amqp_socket_t *sock;
    struct timeval tv = tv_ms(c->connect_timeout_ms);
    struct props_storage ps;
    amqp_table_t props;
    amqp_rpc_reply_t r;
    int rc;
    bool gone = false;

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
        sock = amqp_ssl_socket_new(conn); /* owned by conn */
        if (sock == NULL) {
            snprintf(err, errlen, "cannot create a TLS socket");
            add_ssl_error(err, errlen);
            goto fail;
        }
        if (tls_setup(sock, ac, err, errlen) < 0)
            goto fail;
    } else {
        sock = amqp_tcp_socket_new(conn); /* owned by conn */
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
    r = amqp_login_with_properties(conn, ac->vhost, 0, AMQPSINK_FRAME_MAX, heartbeat_s(ac), &props,
                                   AMQP_SASL_METHOD_PLAIN, ac->user, ac->pass);
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
    *out = conn; /* ownership to the caller */
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

void amqpsink_conn_close(amqp_connection_state_t conn, bool polite)
{
    if (conn == NULL)
        return;
    if (polite) {
        struct timeval tv = tv_ms(AMQPSINK_CLOSE_TIMEOUT);
        int fd = amqp_get_sockfd(conn);
        int queued = 0;
        int sndbuf = 0;
        socklen_t sl = sizeof sndbuf;

        /* Skip the courtesy when the send buffer is nearly full: the close
         * frame's send would wait without a deadline. */
        if (fd >= 0 && ioctl(fd, SIOCOUTQ, &queued) == 0 &&
            getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &sl) == 0 &&
            queued + 4096 < sndbuf / 2 && amqp_set_rpc_timeout(conn, &tv) == AMQP_STATUS_OK)
            (void)amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
    }
    amqp_destroy_connection(conn);
}

/* ------------------------------------------------- the settings a connection needs */

void amqpsink_cfg_free(cfg_sink *c, amqpsink_conf *conf)
{
    free(c->name);
    c->name = NULL;
    c->backend_conf = NULL;
    amqpsink_conf_clear(conf);
}

int amqpsink_dupstr(char **dst, const char *src)
{
    *dst = NULL;
    if (src == NULL)
        return 0;
    *dst = strdup(src);
    return *dst ? 0 : -1;
}

int amqpsink_cfg_dup(cfg_sink *dst, amqpsink_conf *dconf, const cfg_sink *src)
{
    const amqpsink_conf *sconf = amqpsink_conf_of(src);
    size_t n = sconf->n_brokers > 0 ? sconf->n_brokers : 1;

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
    if (amqpsink_dupstr(&dst->name, src->name) < 0 ||
        amqpsink_dupstr(&dconf->host, sconf->host) < 0 ||
        amqpsink_dupstr(&dconf->user, sconf->user) < 0 ||
        amqpsink_dupstr(&dconf->pass, sconf->pass) < 0 ||
        amqpsink_dupstr(&dconf->vhost, sconf->vhost) < 0 ||
        amqpsink_dupstr(&dconf->tls_ca_file, sconf->tls_ca_file) < 0 ||
        amqpsink_dupstr(&dconf->tls_cert, sconf->tls_cert) < 0 ||
        amqpsink_dupstr(&dconf->tls_key, sconf->tls_key) < 0)
        return -1;
    if ((dconf->brokers = calloc(n, sizeof *dconf->brokers)) == NULL)
        return -1;
    dconf->n_brokers = n; /* amqpsink_brokers_free frees what was copied */
    for (size_t i = 0; i < n; i++) {
        amqpsink_broker *b = &dconf->brokers[i];
        const char *h = sconf->n_brokers > 0 ? sconf->brokers[i].host : sconf->host;

        b->port = sconf->n_brokers > 0 ? sconf->brokers[i].port : sconf->port;
        if (h == NULL || amqpsink_dupstr(&b->host, h) < 0)
            return -1;
        if (sconf->n_brokers > 0) {
            if (amqpsink_dupstr(&b->addr, sconf->brokers[i].addr) < 0)
                return -1;
        } else if (asprintf(&b->addr, strchr(h, ':') ? "[%s]:%d" : "%s:%d", h, b->port) < 0) {
            b->addr = NULL;
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ connect worker */

static void job_free(amqpsink_job *jb)
{
    if (jb->conn != NULL)
        amqpsink_conn_close(jb->conn, true);
    amqpsink_cfg_free(&jb->cfg, &jb->conf);
    free(jb->conn_name);
    pthread_cond_destroy(&jb->cv);
    pthread_mutex_destroy(&jb->mu);
    free(jb);
}

/* Drops one reference; the last one frees the job. Called without jb->mu. */
static void job_release(amqpsink_job *jb)
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
static pthread_cond_t workers_cv = PTHREAD_COND_INITIALIZER;
static unsigned workers_live;

static void workers_add(int d)
{
    pthread_mutex_lock(&workers_mu);
    workers_live = (unsigned)((int)workers_live + d);
    if (workers_live == 0)
        pthread_cond_broadcast(&workers_cv);
    pthread_mutex_unlock(&workers_mu);
}

void amqpsink_quiesce(int64_t timeout_ms)
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
    amqpsink_job *jb = arg;
    amqp_connection_state_t conn = NULL;
    char err[sizeof jb->err];

    err[0] = '\0';
    if (conn_open(&jb->cfg, jb->conn_name, jb->ch, jb, &conn, err, sizeof err) < 0)
        conn = NULL;
    pthread_mutex_lock(&jb->mu);
    jb->conn = conn; /* the job owns it until the loop takes it */
    snprintf(jb->err, sizeof jb->err, "%s", err);
    jb->done = true;
    pthread_cond_broadcast(&jb->cv);
    if (!jb->abandoned)
        ev_async_send(jb->loop, jb->wake); /* under mu: the sink is still there */
    pthread_mutex_unlock(&jb->mu);
    ERR_clear_error();
    job_release(jb);       /* the last reference may close the connection here */
    OPENSSL_thread_stop(); /* this thread's OpenSSL state, freed before the thread ends */
    workers_add(-1);
    return NULL;
}

int amqpsink_job_start(struct ev_loop *loop, ev_async *wake, const cfg_sink *c, size_t broker,
                       const char *conn_name, amqp_channel_t ch, amqpsink_job **out, char *err,
                       size_t errlen)
{
    const amqpsink_broker *addr = &amqpsink_conf_of(c)->brokers[broker];
    pthread_attr_t attr;
    pthread_t th;
    sigset_t all, old;
    amqpsink_job *jb;
    int rc;

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
    jb->loop = loop;
    jb->wake = wake;
    jb->ch = ch;
    if (amqpsink_cfg_dup(&jb->cfg, &jb->conf, c) < 0 ||
        amqpsink_dupstr(&jb->conn_name, conn_name) < 0) {
        job_free(jb);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    /* this attempt's address */
    free(jb->conf.host);
    jb->conf.host = NULL;
    jb->conf.port = addr->port;
    if (amqpsink_dupstr(&jb->conf.host, addr->host) < 0) {
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
    ev_async_start(loop, wake);
    /* the worker takes no signals: they belong to the loop thread */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    workers_add(1);
    rc = pthread_create(&th, &attr, job_main, jb);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        workers_add(-1);
        ev_async_stop(loop, wake);
        job_free(jb);
        snprintf(err, errlen, "cannot start a connect thread: %s", strerror(rc));
        return -1;
    }
    *out = jb; /* the caller holds one reference: amqpsink_job_take or _cancel */
    return 0;
}

bool amqpsink_job_take(amqpsink_job *jb, amqp_connection_state_t *conn, char *err, size_t errlen)
{
    pthread_mutex_lock(&jb->mu);
    if (!jb->done) {
        pthread_mutex_unlock(&jb->mu);
        return false;
    }
    *conn = jb->conn; /* ownership to the caller */
    jb->conn = NULL;
    snprintf(err, errlen, "%s", jb->err);
    pthread_mutex_unlock(&jb->mu);
    job_release(jb);
    return true;
}

/* Abandons the attempt in progress (destroy): cuts its handshake short and
 * waits for the worker at most AMQPSINK_CANCEL_WAIT_MS, so the event loop is
 * never held by a hung attempt (a reload or a stop goes on at once). A worker
 * still busy after that (a TCP connect to a silent peer, a name lookup:
 * bounded by connect_timeout itself) no longer touches the sink (abandoned,
 * under mu) and frees the job and its connection when it ends; the process
 * waits for such workers only at exit (quiesce). */
void amqpsink_job_cancel(amqpsink_job *jb)
{
    struct timespec dl;
    int64_t ms = AMQPSINK_CANCEL_WAIT_MS;

    if (jb == NULL)
        return;
    dl = deadline_in(ms);
    pthread_mutex_lock(&jb->mu);
    jb->abandoned = true;
    if (jb->fd >= 0)
        (void)shutdown(jb->fd, SHUT_RDWR); /* the worker's recv/send fail at once */
    while (!jb->done) {
        if (pthread_cond_timedwait(&jb->cv, &jb->mu, &dl) == ETIMEDOUT)
            break;
    }
    pthread_mutex_unlock(&jb->mu);
    job_release(jb); /* a finished job's connection is closed with it */
}

/* ------------------------------------------------------------ check */

/* Connects to every address of the list in turn (a node that cannot be
 * reached is found now, not at failover). err: one line per address that
 * failed, separated by '\n', each naming its peer; on success with several
 * addresses, a note naming them. */
int amqpsink_check(const cfg_sink *sc, char *err, size_t errlen)
{
    const amqpsink_conf *ac = amqpsink_conf_of(sc);
    amqp_connection_state_t conn;
    cfg_sink one;
    amqpsink_conf oneconf;
    char ident[300], why[800];
    size_t n, bad = 0, o = 0;

    if (errlen > 0)
        err[0] = '\0';
    if (ac == NULL) {
        snprintf(err, errlen, "sink %s: incomplete configuration", sc->name ? sc->name : "?");
        return -1;
    }
    n = ac->n_brokers > 0 ? ac->n_brokers : 1;
    amqpsink_ident(ident, sizeof ident, ac, 0);
    if (!sc->confirms || !ac->mandatory) {
        snprintf(err, errlen, "%s: publisher confirms and mandatory are required", ident);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        one = *sc; /* borrowed strings; only host and port change */
        oneconf = *ac;
        one.backend_conf = &oneconf;
        if (ac->n_brokers > 0) {
            oneconf.host = ac->brokers[i].host;
            oneconf.port = ac->brokers[i].port;
        }
        amqpsink_ident(ident, sizeof ident, ac, i);
        if (conn_open(&one, "outbox-relay check", 1, NULL, &conn, why, sizeof why) < 0) {
            /* run logs the same words */
            if (o < errlen)
                o += (size_t)snprintf(err + o, errlen - o, "%s%s: %s", bad > 0 ? "\n" : "", ident,
                                      why);
            bad++;
            continue;
        }
        amqpsink_conn_close(conn, true);
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
