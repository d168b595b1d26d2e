/*
 * queue_watch.c — the bench's stopwatch: times a queue's fill from the broker's side.
 *
 *   queue_watch URL QUEUE TARGET INTERVAL_MS
 *
 * On its own connection, polls QUEUE's depth every INTERVAL_MS milliseconds with a passive
 * queue.declare (declare-ok carries the number of messages enqueued; nobody consumes during
 * a bench, so that is every message the broker has taken so far). Publisher and clock are
 * thereby decoupled: the broker ceiling (amqp_probe) and the relay are timed by the same
 * program in the same way, from the first message enqueued to the TARGET-th.
 *
 * Output, one line each, flushed at once; T is CLOCK_MONOTONIC in seconds (the clock of
 * Python's time.monotonic() on Linux), taken when the declare-ok arrived:
 *   ready T DEPTH              connected; the caller may start publishing now
 *   first T DEPTH              the first poll that saw DEPTH > the depth at ready
 *   last T DEPTH POLLS         the first poll that saw DEPTH >= TARGET; then exit 0
 * Exit 1 on any failure (queue missing, connection lost). Runs until TARGET is reached or it
 * is killed; the caller bounds it.
 */
#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <amqp_ssl_socket.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int reply_ok(amqp_rpc_reply_t r, const char *what)
{
    if (r.reply_type == AMQP_RESPONSE_NORMAL)
        return 1;
    if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION)
        fprintf(stderr, "queue_watch: %s: %s\n", what, amqp_error_string2(r.library_error));
    else
        fprintf(stderr, "queue_watch: %s: broker error (method 0x%08x)\n", what,
                (unsigned)r.reply.id);
    return 0;
}

/* Passive declare: the queue's depth, or -1 (message already printed). */
static long depth_of(amqp_connection_state_t conn, amqp_bytes_t queue)
{
    amqp_queue_declare_ok_t *ok;

    ok = amqp_queue_declare(conn, 1, queue, 1 /* passive */, 0, 0, 0, amqp_empty_table);
    if (ok == NULL) {
        (void)reply_ok(amqp_get_rpc_reply(conn), "queue.declare (passive)");
        return -1;
    }
    amqp_maybe_release_buffers(conn);
    return (long)ok->message_count;
}

int main(int argc, char **argv)
{
    struct amqp_connection_info ci;
    amqp_connection_state_t     conn = NULL;
    amqp_socket_t              *sock;
    amqp_bytes_t                queue;
    struct timeval              tmo = { 30, 0 };
    struct timespec             next;
    char                       *url = NULL;
    long                        target, interval_ms, base, d, polls = 0;
    int                         seen_first = 0, rc = 1;

    if (argc != 5) {
        fprintf(stderr, "usage: %s URL QUEUE TARGET INTERVAL_MS\n", argv[0]);
        return 1;
    }
    target = strtol(argv[3], NULL, 10);
    interval_ms = strtol(argv[4], NULL, 10);
    if (target < 1 || interval_ms < 0 || interval_ms > 10000) {
        fprintf(stderr, "queue_watch: TARGET must be positive, INTERVAL_MS 0..10000\n");
        return 1;
    }
    url = strdup(argv[1]);   /* amqp_parse_url points into it */
    if (url == NULL)
        goto out;
    amqp_default_connection_info(&ci);
    if (amqp_parse_url(url, &ci) != AMQP_STATUS_OK) {
        fprintf(stderr, "queue_watch: bad URL\n");
        goto out;
    }
    conn = amqp_new_connection();
    if (conn == NULL)
        goto out;
    sock = ci.ssl ? amqp_ssl_socket_new(conn) : amqp_tcp_socket_new(conn);
    if (sock == NULL)
        goto out;
    if (amqp_set_rpc_timeout(conn, &tmo) != AMQP_STATUS_OK ||
        amqp_socket_open_noblock(sock, ci.host, ci.port, &tmo) != AMQP_STATUS_OK) {
        fprintf(stderr, "queue_watch: cannot connect to %s:%d\n", ci.host, ci.port);
        goto out;
    }
    if (!reply_ok(amqp_login(conn, ci.vhost, 0, 131072, 0, AMQP_SASL_METHOD_PLAIN, ci.user,
                             ci.password), "login"))
        goto out;
    amqp_channel_open(conn, 1);
    if (!reply_ok(amqp_get_rpc_reply(conn), "channel.open"))
        goto out;
    queue = amqp_cstring_bytes(argv[2]);
    if ((base = depth_of(conn, queue)) < 0)
        goto out;
    printf("ready %.6f %ld\n", now(), base);
    fflush(stdout);

    clock_gettime(CLOCK_MONOTONIC, &next);
    for (;;) {
        double t;

        next.tv_nsec += interval_ms * 1000000L;
        while (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec++;
        }
        /* absolute deadlines: a slow reply does not stretch the cadence */
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL) == EINTR)
            ;
        if ((d = depth_of(conn, queue)) < 0)
            goto out;
        t = now();
        polls++;
        if (!seen_first && d > base) {
            printf("first %.6f %ld\n", t, d);
            fflush(stdout);
            seen_first = 1;
        }
        if (d >= target) {
            printf("last %.6f %ld %ld\n", t, d, polls);
            fflush(stdout);
            break;
        }
        if (t > (double)next.tv_sec + (double)next.tv_nsec / 1e9 + (double)interval_ms / 1e3)
            clock_gettime(CLOCK_MONOTONIC, &next);   /* fell behind: do not burst */
    }
    rc = 0;
out:
    if (conn != NULL) {
        if (rc == 0)
            (void)amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
        amqp_destroy_connection(conn);
    }
    free(url);
    return rc;
}
