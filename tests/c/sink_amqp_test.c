/*
 * sink_amqp_test.c — drives the RabbitMQ sink (amqpsink_ops) against a real
 * broker; tests/test_sink_amqp.py runs it and inspects the broker with pika.
 *
 *   sink_amqp_test URL [options] GROUP...
 *   sink_amqp_test json TEXT          parse TEXT as headers_json, print the table
 *
 * GROUP = EXCHANGE,ROUTING_KEY,COUNT[,FLAG...]; messages are numbered from 0 in
 * group order. FLAGs: size=N (payload bytes, default 64), big (payload one byte
 * over --max-size), hdr=K (headers_json = bad_headers[K]), nohdr (NULL headers,
 * NULL correlation/type/content-type), bighdr=N (headers_json {"big": "xx..."} with N
 * x's: headers larger than a frame on a small message).
 * Options: --window N, --max-size N, --confirm-timeout MS, --heartbeat MS,
 *   --tag HEX8 (message-id prefix), --rate N (messages/s, 0 = unlimited),
 *   --timeout S (give up: exit 2), --no-retry (LOST is final), --ticks (print
 *   "tick T" every 100 ms: shows the loop never blocks), --destroy-after N
 *   (destroy the sink inside the Nth on_result; any later callback is an error),
 *   --retry-refused MS (a REFUSED row is published again MS ms later, as the relay
 *   retries a failed attempt; default: REFUSED is final), --nack-reopen MS (the
 *   sink's nack_reopen; default 0: off), --reconnect-max MS (default 2000),
 *   --no-check (skip the check that connects to every address first).
 * URL may be a comma-separated list of URLs (config/cfg.c parses it as the relay
 * does): the sink fails over between them.
 *
 * Every message i: message_id TAG-0000-4000-8000-<i as 12 hex>, correlation_id
 * corr-<i>, type type.<i%3>, content_type application/x-test, created_at
 * (1700000000+i) s + 123456 us, headers GOOD_HEADERS with "idx":i, payload
 * byte j = (i*7 + j*13) & 0xff (NULs included). A LOST result is retried (as
 * the relay would) unless --no-retry. As the relay does, the driver lets a
 * payload go (row_release_payload: one of ROW_APART_MIN bytes or more is freed)
 * once the sink no longer reads it: when publish() queued it and writing() does
 * not name it, or at on_written; a LOST row whose payload was let go is made
 * anew before it is published again (the relay claims it again). The driver
 * checks on_written's contract: only for a message writing() named when
 * publish() queued it, at most once, before its result, never after destroy,
 * and before an ACK of such a message (a broker confirms only what it got whole). A SINK_EWAIT row (its exchange is being
 * checked) is set aside and put back at the front of the queue by the next
 * on_writable; the rows behind it go on meanwhile. Output, one line each, flushed:
 *   state UP|DOWN|BLOCKED <msg>
 *   event NACK_REOPEN <msg>
 *   result <i> ACK|RETURNED|NACKED|REJECTED|LOST|EPERM|REFUSED <reason>
 *   ewait <i>                     (publish said SINK_EWAIT; the row waits)
 *   summary total=.. acked=.. returned=.. nacked=.. rejected=.. lost=.. eperm=..
 *           refused=.. ewait=.. max_in_flight=.. ups=.. downs=.. blocked=..
 *           queued_while_blocked=.. in_flight=.. eagain=.. max_burst=.. written=..
 *           remade=.. secs=..
 *   (max_burst: the most payload bytes publish() queued in one turn of the loop)
 * Exit 0 when every message got a final result, 2 on timeout, 1 on usage errors.
 */
#include "relay/row.h"
#include "relay/sink.h"
#include "sinks/rabbitmq/amqpcfg.h"
#include "sinks/sinks.h"
#include "sinks/rabbitmq/json.h"

#include <amqp.h>
#include <ev.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GOOD_HEADERS_FMT                                                                   \
    "{ \"s\" : \"h\\u00e9llo \\ud83d\\ude00 \\\"q\\\" \\\\ \\/ \\n\", \"raw\":\"\xc3\xa9\", " \
    "\"i\": -42, \"big\": 9007199254740993, \"d\": 1.5, \"e\": -2.5e-3, "                  \
    "\"t\": true, \"f\": false, \"n\": null, \"empty\": \"\", \"idx\": %d }"

static const char *const bad_headers[] = {
    "{\"a\":{\"nested\":1}}",
    "{\"a\":[1,2]}",
    "[1,2]",
    "{\"a\":1} x",
    "{\"a\":\"\\ud800\"}",
    "{\"a\":1,\"a\":2}",
    "{\"a\":01}",
    "{\"a\":\"\xff\"}",
    "{\"a\":tru}",
    "",
};
#define N_BAD (sizeof bad_headers / sizeof bad_headers[0])

typedef struct msg {
    int        idx;
    row       *r;         /* owned */
    int        streamed;  /* writing() named it when publish() queued it: on_written due */
    int        written;   /* on_written came */
    /* what the row is made of, to make it anew (make_msg_row) */
    const char *tag;
    char       ex[256], rk[256];
    size_t     size, bighdr;
    int        nohdr;
    int        state;     /* 0 pending, 1 in flight, 2 done, 3 waiting (EWAIT),
                             4 refused, published again at retry_at */
    double     retry_at;
    char       hdr[512];
} msg;

typedef struct drv {
    struct ev_loop *loop;
    const sink_ops *ops;
    sink           *s;
    msg            *msgs;
    int             n;
    int            *pending;   /* FIFO of indexes to publish */
    int             phead, ptail, pcap;
    int             done;
    int             retry_lost;
    double          rate, tokens;
    enum sink_state sink_state;
    size_t          max_in_flight;
    size_t          max_burst;      /* most payload bytes queued by one turn of the loop */
    unsigned        burst_iter;     /* the turn (ev_iteration) burst counts for */
    size_t          burst;
    int             c_ack, c_ret, c_nack, c_rej, c_lost, c_eperm, ups, downs, blocks;
    int             queued_while_blocked;
    ev_timer        rate_t, timeout_t;
    int             timed_out;
    int             pumping;
    int             destroy_after;   /* destroy the sink inside the Nth on_result */
    int             n_results;
    int             destroyed;
    int             eagain;
    ev_timer        tick_t;
    int            *waiting;         /* rows set aside by SINK_EWAIT, until on_writable */
    int            *scratch;         /* n + 1: rebuilding pending */
    int             n_waiting;
    int             c_refused, c_ewait;
    int             c_written;       /* on_written calls */
    int             c_remade;        /* LOST rows made anew: their payload was let go */
    double          retry_refused;   /* s; 0: REFUSED is final */
    ev_timer        refused_t;
} drv;

static row *make_msg_row(const msg *m);

/* No default: -Wswitch names an outcome or state added to relay/sink.h and not here. */
static const char *outcome_name(enum sink_outcome o)
{
    switch (o) {
    case SINK_ACK:      return "ACK";
    case SINK_RETURNED: return "RETURNED";
    case SINK_NACKED:   return "NACKED";
    case SINK_REJECTED: return "REJECTED";
    case SINK_LOST:     return "LOST";
    }
    return "?";
}

static const char *state_name(enum sink_state st)
{
    switch (st) {
    case SINK_UP:      return "UP";
    case SINK_BLOCKED: return "BLOCKED";
    case SINK_DOWN:    return "DOWN";
    }
    return "?";
}

static void finish_check(drv *d)
{
    if (d->done == d->n)
        ev_break(d->loop, EVBREAK_ALL);
}

static void pump(drv *d)
{
    if (d->pumping || d->destroyed)
        return;
    d->pumping = 1;
    while (d->phead != d->ptail) {
        msg  *m = &d->msgs[d->pending[d->phead % d->pcap]];
        char  err[512];
        int   rc;
        size_t inf;

        if (d->rate > 0 && d->tokens < 1)
            break;
        err[0] = '\0';
        rc = d->ops->publish(d->s, m->r, m, err, sizeof err);
        if (rc == SINK_EAGAIN) {
            d->eagain++;
            break;
        }
        d->phead++;
        if (d->rate > 0)
            d->tokens -= 1;
        if (rc == SINK_EPERM) {
            m->state = 2;
            d->c_eperm++;
            d->done++;
            printf("result %d EPERM %s\n", m->idx, err);
            continue;
        }
        if (rc == SINK_EWAIT) {
            /* its exchange is being checked: the next rows go on */
            m->state = 3;
            d->c_ewait++;
            d->waiting[d->n_waiting++] = m->idx;
            printf("ewait %d\n", m->idx);
            continue;
        }
        if (rc == SINK_EREFUSED) {
            d->c_refused++;
            printf("result %d REFUSED %s\n", m->idx, err);
            if (d->retry_refused > 0) {
                m->state = 4;
                m->retry_at = ev_now(d->loop) + d->retry_refused;
            } else {
                m->state = 2;
                d->done++;
            }
            continue;
        }
        if (rc != SINK_QUEUED) {
            printf("error: publish returned %d\n", rc);
            exit(3);
        }
        m->state = 1;
        m->written = 0;
        m->streamed = d->ops->writing != NULL && d->ops->writing(d->s) == m;
        if (d->ops->writing != NULL && !m->streamed) {
            void *w = d->ops->writing(d->s);

            if (w != NULL) {
                printf("error: writing() names message %d after %d was queued\n",
                       ((msg *)w)->idx, m->idx);
                exit(3);
            }
            /* written whole in publish(): the relay lets its payload go at once */
            (void)row_release_payload(m->r);
        }
        if (ev_iteration(d->loop) != d->burst_iter) {
            d->burst_iter = ev_iteration(d->loop);
            d->burst = 0;
        }
        d->burst += m->r->payload_len;   /* payload_len stays when the payload is let go */
        if (d->burst > d->max_burst)
            d->max_burst = d->burst;
        if (d->sink_state == SINK_BLOCKED)
            d->queued_while_blocked++;
        inf = d->ops->in_flight(d->s);
        if (inf > d->max_in_flight)
            d->max_in_flight = inf;
    }
    d->pumping = 0;
    finish_check(d);
}

static void on_state(void *ud, enum sink_state st, const char *peer, const char *text)
{
    drv *d = ud;

    if (d->destroyed) {
        printf("error: on_state after destroy\n");
        exit(3);
    }
    /* relay/sink.h: the peer is given, and the message names it */
    if (peer == NULL || peer[0] == '\0' || text == NULL || strstr(text, peer) == NULL) {
        printf("error: on_state peer \"%s\" not named in \"%s\"\n", peer ? peer : "(null)",
               text ? text : "(null)");
        exit(3);
    }
    d->sink_state = st;
    if (st == SINK_UP) d->ups++;
    else if (st == SINK_DOWN) d->downs++;
    else d->blocks++;
    printf("state %s %s\n", state_name(st), text ? text : "");
    if (st == SINK_UP)
        pump(d);
}

static void on_event(void *ud, enum sink_event ev, const char *text)
{
    drv *d = ud;

    if (d->destroyed) {
        printf("error: on_event after destroy\n");
        exit(3);
    }
    printf("event %s %s\n", ev == SINK_EV_NACK_REOPEN ? "NACK_REOPEN" : "?", text ? text : "");
}

static void on_result(void *ud, void *msg_ud, enum sink_outcome outcome, const char *reason)
{
    drv *d = ud;
    msg *m = msg_ud;

    if (d->destroyed) {
        printf("error: on_result after destroy\n");
        exit(3);
    }
    if (m->state != 1) {
        printf("error: result for message %d in state %d\n", m->idx, m->state);
        exit(3);
    }
    if (outcome == SINK_ACK && reason != NULL) {
        printf("error: ACK with a reason\n");
        exit(3);
    }
    if (outcome == SINK_ACK && m->streamed && !m->written) {
        printf("error: message %d confirmed before on_written\n", m->idx);
        exit(3);
    }
    printf("result %d %s %s\n", m->idx, outcome_name(outcome), reason ? reason : "");
    switch (outcome) {
    case SINK_ACK:      d->c_ack++;  break;
    case SINK_RETURNED: d->c_ret++;  break;
    case SINK_NACKED:   d->c_nack++; break;
    case SINK_REJECTED: d->c_rej++;  break;
    case SINK_LOST:     d->c_lost++; break;
    default: break;
    }
    if (outcome == SINK_LOST && d->retry_lost) {
        m->state = 0;
        if (m->r->payload_released) {
            /* its payload was let go: the relay gives such a row back and claims it again */
            row *again = make_msg_row(m);

            if (again == NULL) {
                printf("error: out of memory making row %d again\n", m->idx);
                exit(3);
            }
            row_free(m->r);
            m->r = again;
            d->c_remade++;
        }
        d->pending[d->ptail++ % d->pcap] = m->idx;
    } else {
        m->state = 2;
        d->done++;
    }
    if (++d->n_results == d->destroy_after) {
        /* destroy from inside the callback: no further callbacks may follow */
        printf("destroying in_flight=%zu\n", d->ops->in_flight(d->s));
        d->ops->destroy(d->s);
        d->s = NULL;
        d->destroyed = 1;
        ev_timer_stop(d->loop, &d->timeout_t);
        ev_timer_set(&d->timeout_t, 0.5, 0.);   /* run on a little: nothing may arrive */
        ev_timer_start(d->loop, &d->timeout_t);
        return;
    }
    pump(d);
}

static void on_written(void *ud, void *msg_ud)
{
    drv *d = ud;
    msg *m = msg_ud;

    if (d->destroyed) {
        printf("error: on_written after destroy\n");
        exit(3);
    }
    if (m->state != 1 || !m->streamed || m->written) {
        printf("error: on_written for message %d (state %d, named by writing() %d, "
               "written already %d)\n", m->idx, m->state, m->streamed, m->written);
        exit(3);
    }
    m->written = 1;
    d->c_written++;
    (void)row_release_payload(m->r);   /* the sink reads it no more */
}

static void tick_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)w;
    (void)revents;
    printf("tick %.3f\n", ev_time());
}

static void on_writable(void *ud)
{
    drv *d = ud;

    if (d->destroyed) {
        printf("error: on_writable after destroy\n");
        exit(3);
    }
    /* rows held back by SINK_EWAIT go back to the front of the queue, in
     * order (older rows first, as the relay retries them) */
    if (d->n_waiting > 0) {
        int k = 0;

        for (int w = 0; w < d->n_waiting; w++) {
            d->msgs[d->waiting[w]].state = 0;
            d->scratch[k++] = d->waiting[w];
        }
        for (int p = d->phead; p != d->ptail; p++)
            d->scratch[k++] = d->pending[p % d->pcap];
        memcpy(d->pending, d->scratch, (size_t)k * sizeof *d->pending);
        d->phead = 0;
        d->ptail = k;
        d->n_waiting = 0;
    }
    pump(d);
}

static void refused_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    drv *d = w->data;

    (void)revents;
    if (d->destroyed)
        return;
    for (int i = 0; i < d->n; i++) {
        msg *m = &d->msgs[i];

        if (m->state == 4 && ev_now(loop) >= m->retry_at) {
            m->state = 0;
            d->pending[d->ptail++ % d->pcap] = i;
        }
    }
    pump(d);
}

static void rate_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    drv *d = w->data;

    (void)loop;
    (void)revents;
    if (d->destroyed)
        return;
    d->tokens += d->rate / 100.;
    if (d->tokens > d->rate / 10. + 1)
        d->tokens = d->rate / 10. + 1;
    pump(d);
}

static void timeout_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    drv *d = w->data;

    (void)revents;
    if (!d->destroyed)
        d->timed_out = 1;
    ev_break(loop, EVBREAK_ALL);
}

static row *make_row(int i, const char *tag, const char *ex, const char *rk, size_t size,
                     const char *hdr, int nohdr)
{
    row_fields     f;
    char           mid[40], corr[32], type[32];
    unsigned char *pl;
    row           *r;

    memset(&f, 0, sizeof f);
    snprintf(mid, sizeof mid, "%.8s-0000-4000-8000-%012x", tag, (unsigned)i);
    snprintf(corr, sizeof corr, "corr-%d", i);
    snprintf(type, sizeof type, "type.%d", i % 3);
    pl = malloc(size ? size : 1);
    if (pl == NULL)
        return NULL;
    for (size_t j = 0; j < size; j++)
        pl[j] = (unsigned char)(((size_t)i * 7 + j * 13) & 0xff);
    f.id = i;
    f.lease_token = 1;
    f.created_at_us = (int64_t)(1700000000 + i) * 1000000 + 123456;
    f.message_id = (row_field){ mid, strlen(mid) };
    f.exchange = (row_field){ ex, strlen(ex) };
    f.routing_key = (row_field){ rk, strlen(rk) };
    if (!nohdr) {
        f.message_type = (row_field){ type, strlen(type) };
        f.content_type = (row_field){ "application/x-test", 18 };
        f.correlation_id = (row_field){ corr, strlen(corr) };
        f.headers_json = (row_field){ hdr, strlen(hdr) };
    }
    f.payload = (row_field){ (const char *)pl, size };
    r = row_new(&f);
    free(pl);
    return r;
}

/* Message m's row, made from what the command line said of it. */
static row *make_msg_row(const msg *m)
{
    row *r;
    char *h;

    if (m->bighdr == 0)
        return make_row(m->idx, m->tag, m->ex, m->rk, m->size, m->hdr, m->nohdr);
    h = malloc(m->bighdr + 16);     /* row_new copies it */
    if (h == NULL)
        return NULL;
    memcpy(h, "{\"big\": \"", 9);
    memset(h + 9, 'x', m->bighdr);
    memcpy(h + 9 + m->bighdr, "\"}", 3);
    r = make_row(m->idx, m->tag, m->ex, m->rk, m->size, h, m->nohdr);
    free(h);
    return r;
}

static int json_mode(const char *text)
{
    amqp_table_t t;
    void        *mem;
    char         err[256];

    if (amqpsink_json_headers(text, strlen(text), &t, &mem, err, sizeof err) < 0) {
        printf("error %s\n", err);
        return 0;
    }
    printf("ok %d\n", t.num_entries);
    for (int i = 0; i < t.num_entries; i++) {
        const amqp_field_value_t *v = &t.entries[i].value;

        printf("key ");
        for (size_t k = 0; k < t.entries[i].key.len; k++)
            printf("%02x", ((unsigned char *)t.entries[i].key.bytes)[k]);
        switch (v->kind) {
        case AMQP_FIELD_KIND_UTF8:
            printf(" S ");
            for (size_t k = 0; k < v->value.bytes.len; k++)
                printf("%02x", ((unsigned char *)v->value.bytes.bytes)[k]);
            break;
        case AMQP_FIELD_KIND_I64:     printf(" l %" PRId64, v->value.i64); break;
        case AMQP_FIELD_KIND_F64:     printf(" d %.17g", v->value.f64); break;
        case AMQP_FIELD_KIND_BOOLEAN: printf(" t %d", v->value.boolean); break;
        case AMQP_FIELD_KIND_VOID:    printf(" V"); break;
        default:                      printf(" ?"); break;
        }
        printf("\n");
    }
    free(mem);
    return 0;
}

int main(int argc, char **argv)
{
    drv                         d;
    cfg_sink                    c;
    amqpsink_conf              a;
    sink_cbs                    cbs;
    struct amqp_connection_info ci;
    char                       *urlcopy = NULL;
    const char                 *tag = "0badc0de";
    int                         ticks = 0;
    double                      timeout = 60;
    char                        err[512];
    int                         ai, rc = 1, gstart, list = 0, no_check = 0;
    ev_tstamp                   t0;

    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 3 && strcmp(argv[1], "json") == 0)
        return json_mode(argv[2]);
    if (argc < 3) {
        fprintf(stderr, "usage: %s URL [options] EXCHANGE,RK,COUNT[,FLAG...]...\n", argv[0]);
        return 1;
    }
    memset(&d, 0, sizeof d);
    memset(&c, 0, sizeof c);
    memset(&a, 0, sizeof a);
    d.retry_lost = 1;
    c.name = (char *)"test";
    if (sinks_register() != 0)
        return 1;
    c.type = cfg_backend_find(CFG_BACKEND_SINK, "rabbitmq");
    c.backend_conf = &a;
    c.publish_window = 1000;
    a.heartbeat_ms = 10000;
    c.confirm_timeout_ms = 30000;
    c.connect_timeout_ms = 5000;
    c.reconnect_max_ms = 2000;
    c.max_message_size = 128u << 20;
    c.confirms = a.mandatory = true;
    a.tls_verify = true;

    if (strchr(argv[1], ',') != NULL) {
        /* a cluster list: as the relay's config loader reads it (a owns the strings) */
        list = 1;
        if (amqpsink_urls_parse(argv[1], &a, err, sizeof err) < 0) {
            fprintf(stderr, "bad url list: %s\n", err);
            return 1;
        }
    } else {
        urlcopy = strdup(argv[1]);   /* amqp_parse_url points into it */
        if (urlcopy == NULL)
            return 1;
        amqp_default_connection_info(&ci);
        if (amqp_parse_url(urlcopy, &ci) != AMQP_STATUS_OK) {
            fprintf(stderr, "bad url\n");
            goto out;
        }
        a.host = ci.host;
        a.port = ci.port;
        a.user = ci.user;
        a.pass = ci.password;
        a.vhost = ci.vhost;
        a.tls = ci.ssl;
    }

    for (ai = 2; ai < argc && strncmp(argv[ai], "--", 2) == 0; ai++) {
        const char *o = argv[ai], *v = ai + 1 < argc ? argv[ai + 1] : NULL;

        if (strcmp(o, "--no-retry") == 0) {
            d.retry_lost = 0;
            continue;
        }
        if (strcmp(o, "--ticks") == 0) {
            ticks = 1;
            continue;
        }
        if (strcmp(o, "--no-check") == 0) {
            no_check = 1;
            continue;
        }
        if (v == NULL) {
            fprintf(stderr, "%s needs a value\n", o);
            goto out;
        }
        ai++;
        if (strcmp(o, "--window") == 0)               c.publish_window = atoi(v);
        else if (strcmp(o, "--max-size") == 0)        c.max_message_size = strtoull(v, NULL, 10);
        else if (strcmp(o, "--confirm-timeout") == 0) c.confirm_timeout_ms = atoll(v);
        else if (strcmp(o, "--heartbeat") == 0)       a.heartbeat_ms = atoll(v);
        else if (strcmp(o, "--tag") == 0)             tag = v;
        else if (strcmp(o, "--rate") == 0)            d.rate = atof(v);
        else if (strcmp(o, "--timeout") == 0)         timeout = atof(v);
        else if (strcmp(o, "--destroy-after") == 0)   d.destroy_after = atoi(v);
        else if (strcmp(o, "--retry-refused") == 0)   d.retry_refused = atof(v) / 1000.;
        else if (strcmp(o, "--nack-reopen") == 0)     a.nack_reopen_ms = atoll(v);
        else if (strcmp(o, "--reconnect-max") == 0)   c.reconnect_max_ms = atoll(v);
        else {
            fprintf(stderr, "unknown option %s\n", o);
            goto out;
        }
    }
    gstart = ai;
    /* count messages */
    for (ai = gstart; ai < argc; ai++) {
        char *g = strdup(argv[ai]), *sv = NULL, *ex, *rk, *cnt;

        if (g == NULL) goto out;
        ex = strtok_r(g, ",", &sv);
        rk = strtok_r(NULL, ",", &sv);
        cnt = strtok_r(NULL, ",", &sv);
        if (ex == NULL || rk == NULL || cnt == NULL) {
            fprintf(stderr, "bad group %s\n", argv[ai]);
            free(g);
            goto out;
        }
        d.n += atoi(cnt);
        free(g);
    }
    d.msgs = calloc((size_t)d.n + 1, sizeof *d.msgs);
    d.pcap = d.n * 64 + 16;
    d.pending = calloc((size_t)d.pcap, sizeof *d.pending);
    d.waiting = calloc((size_t)d.n + 1, sizeof *d.waiting);
    d.scratch = calloc((size_t)d.n + 1, sizeof *d.scratch);
    if (d.msgs == NULL || d.pending == NULL || d.waiting == NULL || d.scratch == NULL)
        goto out;
    {
        int i = 0;

        for (ai = gstart; ai < argc; ai++) {
            char  *g = strdup(argv[ai]), *sv = NULL, *ex, *rk, *cnt, *fl;
            size_t size = 64;
            int    big = 0, hdr = -1, nohdr = 0, count;
            size_t bighdr = 0;

            if (g == NULL) goto out;
            ex = strtok_r(g, ",", &sv);
            rk = strtok_r(NULL, ",", &sv);
            cnt = strtok_r(NULL, ",", &sv);
            count = atoi(cnt);
            if (strcmp(ex, "-") == 0) ex = (char *)"";   /* default exchange */
            while ((fl = strtok_r(NULL, ",", &sv)) != NULL) {
                if (strncmp(fl, "size=", 5) == 0) size = strtoull(fl + 5, NULL, 10);
                else if (strcmp(fl, "big") == 0) big = 1;
                else if (strncmp(fl, "hdr=", 4) == 0) hdr = atoi(fl + 4);
                else if (strcmp(fl, "nohdr") == 0) nohdr = 1;
                else if (strncmp(fl, "bighdr=", 7) == 0) bighdr = strtoull(fl + 7, NULL, 10);
            }
            if (big)
                size = c.max_message_size + 1;
            for (int k = 0; k < count; k++, i++) {
                msg *m = &d.msgs[i];

                m->idx = i;
                if (hdr >= 0 && (size_t)hdr < N_BAD)
                    snprintf(m->hdr, sizeof m->hdr, "%s", bad_headers[hdr]);
                else
                    snprintf(m->hdr, sizeof m->hdr, GOOD_HEADERS_FMT, i);
                if (strlen(ex) >= sizeof m->ex || strlen(rk) >= sizeof m->rk) {
                    fprintf(stderr, "exchange or routing key too long for the driver\n");
                    free(g);
                    goto out;
                }
                m->tag = tag;
                snprintf(m->ex, sizeof m->ex, "%s", ex);
                snprintf(m->rk, sizeof m->rk, "%s", rk);
                m->size = size;
                m->bighdr = bighdr;
                m->nohdr = nohdr;
                m->r = make_msg_row(m);
                if (m->r == NULL) {
                    fprintf(stderr, "row_new failed\n");
                    free(g);
                    goto out;
                }
                d.pending[d.ptail++] = i;
            }
            free(g);
        }
    }

    d.loop = ev_loop_new(EVFLAG_AUTO);
    if (d.loop == NULL)
        goto out;
    d.ops = sink_ops_of(&c);
    if (d.ops == NULL || strcmp(d.ops->name, "rabbitmq") != 0) {
        fprintf(stderr, "no rabbitmq sink registered\n");
        goto out;
    }
    if (!no_check) {
        if (d.ops->check(&c, err, sizeof err) != 0) {
            printf("check failed: %s\n", err);
            goto out;
        }
        printf("check ok%s%s\n", err[0] ? ": " : "", err);
    }
    memset(&cbs, 0, sizeof cbs);
    cbs.ud = &d;
    cbs.on_state = on_state;
    cbs.on_event = on_event;
    cbs.on_result = on_result;
    cbs.on_writable = on_writable;
    cbs.on_written = on_written;
    if (d.ops->create(d.loop, &c, "sink_amqp_test", &cbs, &d.s, err, sizeof err) != 0) {
        printf("create failed: %s\n", err);
        goto out;
    }
    d.sink_state = SINK_DOWN;
    ev_timer_init(&d.rate_t, rate_cb, 0.01, 0.01);
    d.rate_t.data = &d;
    if (d.rate > 0)
        ev_timer_start(d.loop, &d.rate_t);
    ev_timer_init(&d.refused_t, refused_cb, 0.05, 0.05);
    d.refused_t.data = &d;
    if (d.retry_refused > 0)
        ev_timer_start(d.loop, &d.refused_t);
    ev_timer_init(&d.tick_t, tick_cb, 0.1, 0.1);
    if (ticks)
        ev_timer_start(d.loop, &d.tick_t);
    ev_timer_init(&d.timeout_t, timeout_cb, timeout, 0.);
    d.timeout_t.data = &d;
    ev_timer_start(d.loop, &d.timeout_t);
    t0 = ev_time();
    d.ops->start(d.s);
    if (d.n > 0)
        ev_run(d.loop, 0);
    printf("summary total=%d acked=%d returned=%d nacked=%d rejected=%d lost=%d eperm=%d "
           "refused=%d ewait=%d "
           "max_in_flight=%zu ups=%d downs=%d blocked=%d queued_while_blocked=%d in_flight=%zu "
           "eagain=%d max_burst=%zu written=%d remade=%d secs=%.3f\n",
           d.n, d.c_ack, d.c_ret, d.c_nack, d.c_rej, d.c_lost, d.c_eperm, d.c_refused,
           d.c_ewait, d.max_in_flight,
           d.ups, d.downs, d.blocks, d.queued_while_blocked,
           d.s ? d.ops->in_flight(d.s) : (size_t)0, d.eagain, d.max_burst, d.c_written,
           d.c_remade, ev_time() - t0);
    rc = d.timed_out ? 2 : 0;
    ev_timer_stop(d.loop, &d.rate_t);
    ev_timer_stop(d.loop, &d.timeout_t);
    ev_timer_stop(d.loop, &d.tick_t);
    ev_timer_stop(d.loop, &d.refused_t);
out:
    if (d.s != NULL)
        d.ops->destroy(d.s);
    if (d.loop != NULL)
        ev_loop_destroy(d.loop);
    if (d.msgs != NULL)
        for (int i = 0; i < d.n; i++)
            row_free(d.msgs[i].r);
    free(d.msgs);
    free(d.pending);
    free(d.waiting);
    free(d.scratch);
    free(urlcopy);
    if (list)
        amqpsink_conf_clear(&a);
    if (d.ops != NULL && d.ops->quiesce != NULL)
        d.ops->quiesce(30000);   /* a connect worker still running ends first */
    return rc;
}
