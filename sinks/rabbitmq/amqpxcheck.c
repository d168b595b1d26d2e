/*
 * amqpxcheck.c — the RabbitMQ sink's exchange checks, on the event loop.
 *
 * A publish to an exchange that does not exist makes the broker close the
 * publishing channel (404), and every unconfirmed message on it is lost with
 * it. So before the first publish to a named exchange (not "" and not amq.*,
 * which the broker itself defines), publish() answers SINK_EWAIT and asks the
 * broker with a passive exchange.declare on a second channel of the same
 * connection (the "check channel", the highest channel number), without
 * waiting: the replies arrive through the sink's frame handler like acks. The
 * answers are cached per connection (AMQPSINK_XOK_TTL, AMQPSINK_XMISSING_TTL);
 * a row to a missing exchange then gets SINK_EREFUSED and nothing else is
 * disturbed. A 404 closes the check channel instead; it is reopened
 * asynchronously before the next check. One check is in flight at a time;
 * names wait in a bounded FIFO.
 *
 * An exchange seen to exist is trusted for AMQPSINK_XOK_TTL seconds: should it
 * be deleted meanwhile, the publishing channel's 404 still settles the culprit
 * (REJECTED) and the rest (LOST), and marks it missing here. A missing (or
 * refused) one is remembered only briefly, so a retried row learns soon that
 * someone created it, while a burst of rows to it costs one round trip, not
 * one each.
 */
#include "sinks/rabbitmq/amqpsink.h"
#include "lib/outbox_util.h"

#include <amqp.h>
#include <ev.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define AMQPSINK_XOK_TTL      30.0 /* s */
#define AMQPSINK_XMISSING_TTL 1.0  /* s */
#define AMQPSINK_XQUEUE_MAX   1024 /* names waiting for a check; past it SINK_EAGAIN */
#define AMQPSINK_XCACHE_MAX   2048 /* cached names (memory bound: names are <= 255 bytes) */

/* ------------------------------------------------------------ exchange cache */

static bool x_is_pending(const xent *x)
{
    return x->state == X_QUEUED || x->state == X_CHECKING;
}

static size_t x_bucket(const char *name)
{
    return (size_t)(outbox_util_fnv1a64_str(name) % AMQPSINK_XBUCKETS);
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
    xent *x;

    if (s->xcount >= AMQPSINK_XCACHE_MAX)
        x_sweep(s, false);
    if (s->xcount >= AMQPSINK_XCACHE_MAX)
        x_sweep(s, true); /* pending names are at most AMQPSINK_XQUEUE_MAX + 1 */
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

static void x_set(sink *s, xent *x, enum xstate state, const char *why)
{
    x->state = state;
    x->expires = ev_now(s->loop) + (state == X_EXISTS ? AMQPSINK_XOK_TTL : AMQPSINK_XMISSING_TTL);
    free(x->why);
    x->why = why != NULL ? strdup(why) : NULL; /* NULL: a generic reason later */
}

void amqpsink_xcheck_reset(sink *s)
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

/* ------------------------------------------------------------ exchange checks */

/* The default exchange and amq.* are the broker's own (a client cannot declare
 * amq.* names): they are published without a check. */
static bool x_unchecked(const sink *s, const char *ex)
{
    return ex[0] == '\0' || strncmp(ex, "amq.", 4) == 0 || s->ck_ch == 0;
}

/* The check channel is the highest channel number the connection allows; the
 * publishing channel cycles below it. 0 (no checks: a row goes straight out,
 * and a 404 only costs a channel) when the broker allows a single channel. */
amqp_channel_t amqpsink_xcheck_channel(amqp_connection_state_t conn)
{
    amqp_channel_t max = amqpsink_channel_max(conn);

    return max < 2 ? 0 : max;
}

/* Sends the check channel's next step, if it has one and the socket has room
 * for it (else the tick tries again; rabbitmq-c's send would wait without a
 * deadline): channel.open while closed, else the passive exchange.declare of
 * the first waiting name. Never waits for the answer and never calls back. */
void amqpsink_xcheck_kick(sink *s)
{
    if (s->conn == NULL || s->broken || s->ck_ch == 0 || s->xq_head == NULL ||
        s->ck_state == CK_OPENING || s->ck_state == CK_BUSY)
        return;
    if (!amqpsink_sock_room(s, AMQPSINK_CHECK_BYTES))
        return;
    s->ck_sent_at = ev_now(s->loop);
    if (s->ck_state == CK_CLOSED) {
        s->ck_state = CK_OPENING;
        amqpsink_open_channel(s, s->ck_ch, "exchange check");
    } else {
        amqp_exchange_declare_t m;
        xent *x = s->xq_head;

        s->xq_head = x->qnext;
        if (s->xq_head == NULL)
            s->xq_tail = NULL;
        s->xq_len--;
        x->qnext = NULL;
        x->state = X_CHECKING;
        s->ck_cur = x;
        memset(&m, 0, sizeof m);
        m.exchange = amqpsink_bytes(x->name);
        m.type = amqp_empty_bytes;
        m.passive = 1; /* only asks; never creates or changes anything */
        m.arguments = amqp_empty_table;
        s->ck_state = CK_BUSY;
        amqpsink_send_nowait(s, s->ck_ch, AMQP_EXCHANGE_DECLARE_METHOD, &m, "exchange check");
    }
}

/* A check (or the check channel's open) without an answer within
 * confirm_timeout: the connection is dead or the broker stuck, as with a
 * missing confirm. The clock stops while the broker blocks the connection (it
 * may stop reading from it). Returns false when the sink was destroyed. */
bool amqpsink_xcheck_timeout(sink *s)
{
    ev_tstamp since;
    char why[500];

    if (s->conn == NULL || s->cfg.confirm_timeout_ms <= 0 || s->blocked ||
        (s->ck_state != CK_OPENING && s->ck_state != CK_BUSY))
        return true;
    since = s->ck_sent_at > s->unblocked_at ? s->ck_sent_at : s->unblocked_at;
    if (ev_now(s->loop) - since <= (double)s->cfg.confirm_timeout_ms / 1000.)
        return true;
    if (s->ck_state == CK_BUSY && s->ck_cur != NULL)
        snprintf(why, sizeof why,
                 "no answer to the passive exchange.declare of exchange '%s' "
                 "(checking channel %u) within %lld ms",
                 s->ck_cur->name, (unsigned)s->ck_ch, (long long)s->cfg.confirm_timeout_ms);
    else
        snprintf(why, sizeof why,
                 "no answer to channel.open of the exchange checking channel %u "
                 "within %lld ms",
                 (unsigned)s->ck_ch, (long long)s->cfg.confirm_timeout_ms);
    return amqpsink_conn_fail(s, why);
}

/* Whether a row to exchange ex may be published now: SINK_QUEUED (go on),
 * SINK_EWAIT (its check is pending), SINK_EREFUSED (err says why) or
 * SINK_EAGAIN (too many names waiting: a pending check answers, then
 * on_writable). Never calls back. */
int amqpsink_xcheck_dest(sink *s, const char *ex, char *err, size_t errlen)
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
        return SINK_QUEUED; /* out of memory: unchecked; a 404 still costs only a channel */
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
    amqpsink_xcheck_kick(s);
    return SINK_EWAIT;
}

/* The publishing channel was closed by a 404 naming ex (deleted after its
 * check said it exists): remember it missing, so the rows given back LOST are
 * refused when retried instead of closing the channel again. */
void amqpsink_xcheck_missing(sink *s, const char *ex, const char *text)
{
    xent *x;
    char why[1100];

    if (x_unchecked(s, ex))
        return;
    x = x_find(s, ex);
    if (x != NULL && x_is_pending(x))
        return; /* its check answers soon */
    if (x == NULL && (x = x_add(s, ex)) == NULL)
        return;
    snprintf(why, sizeof why,
             "exchange '%s' not found in vhost '%s' (404, the broker closed "
             "the publishing channel: %s)",
             ex, s->conf.vhost, text);
    x_set(s, x, X_MISSING, why);
}

/* A frame on the check channel: the answer to channel.open or to a check. */
bool amqpsink_xcheck_frame(sink *s, const amqp_frame_t *f)
{
    if (f->frame_type != AMQP_FRAME_METHOD)
        return true;
    switch (f->payload.method.id) {
    case AMQP_CHANNEL_OPEN_OK_METHOD:
        if (s->ck_state == CK_OPENING) {
            s->ck_state = CK_IDLE;
            amqpsink_xcheck_kick(s);
        }
        return true;
    case AMQP_EXCHANGE_DECLARE_OK_METHOD:
        if (s->ck_state == CK_BUSY && s->ck_cur != NULL) {
            x_set(s, s->ck_cur, X_EXISTS, NULL);
            s->ck_cur = NULL;
            s->ck_state = CK_IDLE;
            s->ck_resolved = true;
            amqpsink_xcheck_kick(s);
        }
        return true;
    case AMQP_CHANNEL_CLOSE_METHOD: {
        const amqp_channel_close_t *m = f->payload.method.decoded;
        char text[512], why[1100];
        int rc;

        snprintf(text, sizeof text, "%.*s", (int)m->reply_text.len,
                 (const char *)m->reply_text.bytes);
        rc = amqpsink_close_ok(s, s->ck_ch);
        if (rc != AMQP_STATUS_OK) {
            snprintf(why, sizeof why,
                     "exchange checking channel %u closed by the broker: %u %s; "
                     "channel.close-ok: %s",
                     (unsigned)s->ck_ch, (unsigned)m->reply_code, text, amqp_error_string2(rc));
            return amqpsink_conn_fail(s, why);
        }
        if (s->ck_state != CK_BUSY || s->ck_cur == NULL) {
            /* Not the answer to a check (channel.open refused?): nothing to
             * learn, and reopening could repeat it forever. */
            snprintf(why, sizeof why, "exchange checking channel %u closed by the broker: %u %s",
                     (unsigned)s->ck_ch, (unsigned)m->reply_code, text);
            return amqpsink_conn_fail(s, why);
        }
        if (m->reply_code == AMQP_NOT_FOUND)
            snprintf(why, sizeof why,
                     "exchange '%s' not found in vhost '%s' (404, checked with "
                     "a passive exchange.declare)",
                     s->ck_cur->name, s->conf.vhost);
        else
            snprintf(why, sizeof why,
                     "exchange '%s' in vhost '%s' refused by the broker: %u %s "
                     "(checked with a passive exchange.declare)",
                     s->ck_cur->name, s->conf.vhost, (unsigned)m->reply_code, text);
        x_set(s, s->ck_cur, m->reply_code == AMQP_NOT_FOUND ? X_MISSING : X_REFUSED, why);
        s->ck_cur = NULL;
        s->ck_state = CK_CLOSED; /* close-ok sent: ck_kick reopens it for the next check */
        s->ck_resolved = true;
        amqpsink_xcheck_kick(s);
        return true;
    }
    default:
        return true;
    }
}
