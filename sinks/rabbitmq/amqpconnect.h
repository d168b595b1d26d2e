/*
 * amqpconnect.h — the RabbitMQ sink's work off the event loop (amqpconnect.c):
 * the blocking connect (TCP, TLS setup and the reasons of a failure in words,
 * login, channel.open, confirm.select), the worker thread each connection
 * attempt of a running sink gets, and `check`. The loop side (amqpsink.c)
 * only starts an attempt, takes its result when the worker wakes it, or
 * abandons it.
 */
#ifndef SINKS_RABBITMQ_AMQPCONNECT_H
#define SINKS_RABBITMQ_AMQPCONNECT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <amqp.h>
#include <ev.h>

#include "config/cfg.h"
#include "sinks/rabbitmq/amqpcfg.h"

#define AMQPSINK_FRAME_MAX \
    32768                    /* asked at login; rabbitmq-c keeps buffers of this size per
                                          connection and channel (131072 cost fifty outboxes
                                          3 MiB), and larger bodies are split in frames */
#define AMQPSINK_ERR_MAX 700 /* bytes of a failed attempt's reason */

/* One connection attempt on a worker thread (opaque). */
typedef struct amqpsink_job amqpsink_job;

/* s as AMQP bytes, without a copy (rabbitmq-c never writes through it). */
static inline amqp_bytes_t amqpsink_bytes(const char *s)
{
    amqp_bytes_t b;

    b.len = strlen(s);
    b.bytes = (void *)(uintptr_t)s;
    return b;
}

/* The peer, as every message about a sink's connection names it (run and check
 * alike): "broker 127.0.0.1:5672 vhost /"; i: which address of the list. */
void amqpsink_ident(char *buf, size_t len, const amqpsink_conf *c, size_t i);

/* *dst = a copy of src (NULL stays NULL): 0, or -1 when out of memory. */
OUTBOX_MUST_CHECK int amqpsink_dupstr(char **dst, const char *src);

/* Deep copy of what a connection needs: the generic settings with the name (url and
 * password are not kept: they may carry the password; dconf's pass is the one copy)
 * and the rabbitmq settings, dst->backend_conf pointing at dconf. The broker list
 * too: a conf filled by hand without one (a test driver) gets its host:port as the
 * only address. -1 when out of memory (dst, dconf then hold whatever was copied: free
 * them with amqpsink_cfg_free). */
OUTBOX_MUST_CHECK int amqpsink_cfg_dup(cfg_sink *dst, amqpsink_conf *dconf, const cfg_sink *src);
/* Frees what amqpsink_cfg_dup copied. */
void amqpsink_cfg_free(cfg_sink *c, amqpsink_conf *conf);

/* Starts a connection attempt to address `broker` of c's list on a worker thread
 * (login, channel.open(ch), confirm.select, each bounded by connect_timeout). wake
 * (on loop) is started here and signalled when the attempt is over; the caller
 * then takes the result with amqpsink_job_take. 0 and *out, or -1 with err. */
OUTBOX_MUST_CHECK int amqpsink_job_start(struct ev_loop *loop, ev_async *wake, const cfg_sink *c,
                                         size_t broker, const char *conn_name, amqp_channel_t ch,
                                         amqpsink_job **out, char *err, size_t errlen);
/* When the attempt is over: true, *conn (ownership to the caller; NULL when it
 * failed, err then says why, without the peer) and jb is gone. False while the
 * worker still runs. */
OUTBOX_MUST_CHECK bool amqpsink_job_take(amqpsink_job *jb, amqp_connection_state_t *conn, char *err,
                                         size_t errlen);
/* Abandons an attempt (NULL: none): cuts its handshake short and waits for the
 * worker only briefly; a worker still busy cleans up after itself. jb is gone. */
void amqpsink_job_cancel(amqpsink_job *jb);
/* Waits at most timeout_ms for every worker still running (the process exits). */
void amqpsink_quiesce(int64_t timeout_ms);

/* Sends connection.close (polite) and waits for close-ok, bounded; frees conn. */
void amqpsink_conn_close(amqp_connection_state_t conn, bool polite);

/* The sink's check: connects to every address of the list in turn, blocking. */
OUTBOX_MUST_CHECK int amqpsink_check(const cfg_sink *sc, char *err, size_t errlen);

#endif
