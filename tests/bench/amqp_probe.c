/*
 * amqp_probe.c — the broker's ceiling, the yardstick for the relay's throughput.
 *
 *   amqp_probe URL QUEUE COUNT WINDOW SIZE
 *
 * Publishes COUNT persistent messages of SIZE bytes to QUEUE (through the
 * default exchange; the caller declares the queue durable) on one channel in
 * confirm mode, `mandatory`, keeping at most WINDOW unconfirmed, with plain
 * blocking rabbitmq-c. Each message carries what the relay's carry: a 36-byte
 * message-id and a timestamp. Prints
 *   probe msgs=N secs=S rate=R t0=T0 t1=T1 blocked=B lat_med_ms=L lat_mean_ms=M
 * where L and M are the median and mean of each message's publish-to-confirm
 * time, S and R run from the first publish to the last confirm and T0, T1 are
 * those instants on CLOCK_MONOTONIC (the bench times the probe and the relay
 * alike from the broker's queue with queue_watch; R is the probe's own view).
 * B is the seconds the broker held the connection blocked (a memory or disk
 * alarm; the probe declares the connection.blocked capability like the relay,
 * stops publishing meanwhile and says so on stderr): a figure with B > 0 is
 * disturbed. Exit 1 on any failure (nack, return, broker error, 30 s without
 * a confirm while not blocked).
 */
#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <amqp_ssl_socket.h>
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

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return (x > y) - (x < y);
}

/* Client properties declaring the capabilities the relay declares (rabbitmq-c's defaults
 * leave out connection.blocked, so a blocked probe would only see a timeout). */
static amqp_table_entry_t caps_entries[3];
static amqp_table_entry_t prop_entries[1];

static amqp_table_t client_properties(void)
{
    amqp_table_t t;
    const char *const names[3] = { "connection.blocked", "publisher_confirms", "basic.nack" };

    for (int i = 0; i < 3; i++) {
        caps_entries[i].key = amqp_cstring_bytes(names[i]);
        caps_entries[i].value.kind = AMQP_FIELD_KIND_BOOLEAN;
        caps_entries[i].value.value.boolean = 1;
    }
    prop_entries[0].key = amqp_cstring_bytes("capabilities");
    prop_entries[0].value.kind = AMQP_FIELD_KIND_TABLE;
    prop_entries[0].value.value.table.num_entries = 3;
    prop_entries[0].value.value.table.entries = caps_entries;
    t.num_entries = 1;
    t.entries = prop_entries;
    return t;
}

static int reply_ok(amqp_rpc_reply_t r, const char *what)
{
    if (r.reply_type == AMQP_RESPONSE_NORMAL)
        return 1;
    if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION)
        fprintf(stderr, "amqp_probe: %s: %s\n", what, amqp_error_string2(r.library_error));
    else
        fprintf(stderr, "amqp_probe: %s: broker error (method 0x%08x)\n", what,
                (unsigned)r.reply.id);
    return 0;
}

int main(int argc, char **argv)
{
    struct amqp_connection_info ci;
    amqp_connection_state_t     conn = NULL;
    amqp_socket_t              *sock;
    amqp_basic_properties_t     props;
    amqp_bytes_t                body, queue;
    struct timeval              tmo = { 30, 0 };
    char                       *url = NULL;
    unsigned char              *payload = NULL;
    double                     *sent_at = NULL, *lat = NULL;   /* per message: publish time, confirm latency */
    long                        count, window;
    size_t                      size;
    long                        published = 0, confirmed = 0;
    amqp_table_t                cprops;
    double                      t0, secs, blocked_at = 0, blocked_secs = 0;
    int                         blocked = 0;
    char                        msgid[48];
    int                         rc = 1;

    if (argc != 6) {
        fprintf(stderr, "usage: %s URL QUEUE COUNT WINDOW SIZE\n", argv[0]);
        return 1;
    }
    count = strtol(argv[3], NULL, 10);
    window = strtol(argv[4], NULL, 10);
    size = strtoull(argv[5], NULL, 10);
    if (count < 1 || window < 1) {
        fprintf(stderr, "amqp_probe: COUNT and WINDOW must be positive\n");
        return 1;
    }
    url = strdup(argv[1]);   /* amqp_parse_url points into it */
    payload = malloc(size ? size : 1);
    sent_at = malloc((size_t)count * sizeof *sent_at);
    lat = malloc((size_t)count * sizeof *lat);
    if (url == NULL || payload == NULL || sent_at == NULL || lat == NULL)
        goto out;
    for (size_t i = 0; i < size; i++)
        payload[i] = (unsigned char)('a' + i % 26);
    amqp_default_connection_info(&ci);
    if (amqp_parse_url(url, &ci) != AMQP_STATUS_OK) {
        fprintf(stderr, "amqp_probe: bad URL\n");
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
        fprintf(stderr, "amqp_probe: cannot connect to %s:%d\n", ci.host, ci.port);
        goto out;
    }
    cprops = client_properties();
    if (!reply_ok(amqp_login_with_properties(conn, ci.vhost, 0, 131072, 0, &cprops,
                                             AMQP_SASL_METHOD_PLAIN, ci.user, ci.password),
                  "login"))
        goto out;
    amqp_channel_open(conn, 1);
    if (!reply_ok(amqp_get_rpc_reply(conn), "channel.open"))
        goto out;
    amqp_confirm_select(conn, 1);
    if (!reply_ok(amqp_get_rpc_reply(conn), "confirm.select"))
        goto out;

    memset(&props, 0, sizeof props);
    props._flags = AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_MESSAGE_ID_FLAG |
                   AMQP_BASIC_TIMESTAMP_FLAG;
    props.delivery_mode = AMQP_DELIVERY_PERSISTENT;
    props.timestamp = (uint64_t)time(NULL);
    body.bytes = payload;
    body.len = size;
    queue = amqp_cstring_bytes(argv[2]);

    t0 = now();
    while (confirmed < count) {
        amqp_frame_t f;
        int          r;

        while (!blocked && published < count && published - confirmed < window) {
            snprintf(msgid, sizeof msgid, "00000000-0000-4000-8000-%012ld", published + 1);
            props.message_id = amqp_cstring_bytes(msgid);
            r = amqp_basic_publish(conn, 1, amqp_empty_bytes, queue, 1, 0, &props, body);
            if (r != AMQP_STATUS_OK) {
                fprintf(stderr, "amqp_probe: publish: %s\n", amqp_error_string2(r));
                goto out;
            }
            sent_at[published++] = now();
        }
        r = amqp_simple_wait_frame_noblock(conn, &f, &tmo);
        if (r == AMQP_STATUS_TIMEOUT && blocked)
            continue;   /* the alarm may last; the caller bounds the whole run */
        if (r != AMQP_STATUS_OK) {
            fprintf(stderr, "amqp_probe: waiting for confirms: %s\n", amqp_error_string2(r));
            goto out;
        }
        if (f.frame_type != AMQP_FRAME_METHOD)
            continue;
        if (f.payload.method.id == AMQP_BASIC_ACK_METHOD) {
            const amqp_basic_ack_t *a = f.payload.method.decoded;
            long                    upto = a->multiple ? (long)a->delivery_tag : confirmed + 1;
            double                  t = now();

            if (upto > published)
                upto = published;
            for (; confirmed < upto; confirmed++)
                lat[confirmed] = t - sent_at[confirmed];
        } else if (f.payload.method.id == AMQP_BASIC_NACK_METHOD) {
            fprintf(stderr, "amqp_probe: basic.nack\n");
            goto out;
        } else if (f.payload.method.id == AMQP_BASIC_RETURN_METHOD) {
            fprintf(stderr, "amqp_probe: basic.return: queue %s missing?\n", argv[2]);
            goto out;
        } else if (f.payload.method.id == AMQP_CONNECTION_BLOCKED_METHOD) {
            const amqp_connection_blocked_t *b = f.payload.method.decoded;

            if (!blocked) {
                blocked = 1;
                blocked_at = now();
                fprintf(stderr, "amqp_probe: the broker blocked the connection (%.*s)\n",
                        (int)b->reason.len, (const char *)b->reason.bytes);
            }
        } else if (f.payload.method.id == AMQP_CONNECTION_UNBLOCKED_METHOD) {
            if (blocked) {
                blocked = 0;
                blocked_secs += now() - blocked_at;
                fprintf(stderr, "amqp_probe: the broker unblocked the connection\n");
            }
        } else if (f.payload.method.id == AMQP_CHANNEL_CLOSE_METHOD ||
                   f.payload.method.id == AMQP_CONNECTION_CLOSE_METHOD) {
            fprintf(stderr, "amqp_probe: broker closed the channel/connection\n");
            goto out;
        }
        amqp_maybe_release_buffers(conn);
    }
    secs = now() - t0;
    double lat_sum = 0;
    for (long i = 0; i < count; i++)
        lat_sum += lat[i];
    qsort(lat, (size_t)count, sizeof *lat, cmp_double);
    printf("probe msgs=%ld secs=%.3f rate=%.0f t0=%.6f t1=%.6f blocked=%.3f lat_med_ms=%.1f "
           "lat_mean_ms=%.1f\n", count, secs, secs > 0 ? (double)count / secs : 0., t0,
           t0 + secs, blocked_secs, lat[count / 2] * 1000., lat_sum / (double)count * 1000.);
    rc = 0;
out:
    if (conn != NULL) {
        if (rc == 0)
            (void)amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
        amqp_destroy_connection(conn);
    }
    free(payload);
    free(sent_at);
    free(lat);
    free(url);
    return rc;
}
