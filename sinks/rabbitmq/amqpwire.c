/*
 * amqpwire.c — the RabbitMQ sink's connection as a socket, on the event loop: the
 * socket's options (its send buffer, TCP_USER_TIMEOUT), whether its send buffer has
 * room, and the methods sent without waiting for their answer (channel.open,
 * confirm.select, a passive exchange.declare; channel.close-ok), which the publishing
 * channel's reopen (amqpsink.c) and the exchange checks (amqpxcheck.c) share.
 * rabbitmq-c's send waits without a deadline when the socket buffer is full: the
 * callers check for room first, and nothing here waits.
 */
#include "sinks/rabbitmq/amqpsink.h"

#include <amqp.h>
#include <ev.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#define AMQPSINK_SNDBUF (4 * 1024 * 1024)

/* ------------------------------------------------------------ socket options */

/* TCP_USER_TIMEOUT (= confirm_timeout) bounds how long the kernel keeps unacknowledged
 * data, zero-window probes included. While the broker blocks the connection it stops
 * reading from the socket on purpose, so a full pipeline legitimately sits in a zero
 * window: the bound is lifted then (on = false) and restored when unblocked. */
void amqpsink_set_user_timeout(sink *s, bool on)
{
    int fd = s->conn ? amqp_get_sockfd(s->conn) : -1;
    unsigned ut = 0;

    if (fd < 0 || s->cfg.confirm_timeout_ms <= 0)
        return;
    if (on)
        ut = s->cfg.confirm_timeout_ms > 3600000 ? 3600000u : (unsigned)s->cfg.confirm_timeout_ms;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ut, sizeof ut);
}

void amqpsink_set_sock_opts(sink *s)
{
    int fd = amqp_get_sockfd(s->conn);
    int v = AMQPSINK_SNDBUF;
    socklen_t sl = sizeof v;

    s->sndcap = 64 * 1024;
    if (fd < 0)
        return;
    /* Best effort: a smaller buffer only means more SINK_EAGAIN. */
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v);
    amqpsink_set_user_timeout(s, true);
    v = 0;
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &sl) == 0 && v > 0)
        s->sndcap = (size_t)v / 2; /* the kernel doubles the value for bookkeeping */
}

bool amqpsink_sock_room(sink *s, size_t need)
{
    int fd, queued = 0;

    if (s->conn == NULL || (fd = amqp_get_sockfd(s->conn)) < 0)
        return true;
    if (ioctl(fd, SIOCOUTQ, &queued) < 0 || queued <= 0)
        return true; /* empty buffer: always allowed (TCP_USER_TIMEOUT bounds it) */
    return (size_t)queued + need <= s->sndcap;
}

/* ----------------------------------------- sends the frame handler answers */

amqp_channel_t amqpsink_channel_max(amqp_connection_state_t conn)
{
    int max = amqp_get_channel_max(conn);

    return (amqp_channel_t)(max <= 0 || max > 65535 ? 65535 : max);
}

void amqpsink_wake_reader(sink *s)
{
    if (s->conn != NULL && (amqp_frames_enqueued(s->conn) || amqp_data_in_buffer(s->conn)))
        ev_feed_event(s->loop, &s->rio, EV_READ);
}

void amqpsink_send_nowait(sink *s, amqp_channel_t ch, amqp_method_number_t id, void *m,
                          const char *what)
{
    int rc = amqp_send_method(s->conn, ch, id, m);

    if (rc != AMQP_STATUS_OK) {
        amqpsink_mark_broken(s, what, rc);
        return;
    }
    amqpsink_wake_reader(s);
}

void amqpsink_open_channel(sink *s, amqp_channel_t ch, const char *what)
{
    amqp_channel_open_t m;

    memset(&m, 0, sizeof m);
    m.out_of_band = amqp_empty_bytes;
    amqpsink_send_nowait(s, ch, AMQP_CHANNEL_OPEN_METHOD, &m, what);
}

int amqpsink_close_ok(sink *s, amqp_channel_t ch)
{
    amqp_channel_close_ok_t ok;

    memset(&ok, 0, sizeof ok);
    return amqp_send_method(s->conn, ch, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
}
