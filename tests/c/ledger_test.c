/*
 * ledger_test.c — the drain core's ledger (relay/ledger.c) without servers.
 *
 * Scripted cases pin single behaviours; the randomized suite drives the ledger
 * the way relay/drain.c does, against a fake database (leases with tokens and
 * deadlines, claims that skip keys behind a failed row, settles fenced by
 * token, each committing at a random moment while outstanding) and a fake
 * broker (one channel: publishes are processed in order, confirms come in
 * order, a connection loss drops the unprocessed suffix, a channel close
 * processes up to its culprit; it takes a message only once its body is
 * written whole). Large rows (ROW_APART_MIN or more) are written at once or
 * over many steps, as the RabbitMQ sink streams them (nothing else published
 * meanwhile), and on_written (ledger_written) comes when the last frame is out,
 * also again for a message written already; in every third run the sink names
 * no message being written and payloads stay until the result. Faults,
 * refusals, destination checks, lease expiry (ledger_next and ledger_expire),
 * leadership loss and graceful stops are interleaved at random, every event is
 * followed by ledger_check(), and the oracle checks end to end:
 *   - a row is marked sent only after the broker confirmed it, under the token
 *     the database holds for it (the fake database rejects anything else);
 *   - per key, first occurrences in the queue are in id order, except where
 *     the ledger counted an overtaking refusal (never under ordering=strict);
 *   - no row is published while an earlier row of its key was refused and its
 *     retry or dead letter has not committed;
 *   - every duplicate in the queue is explained by a connection or channel loss
 *     the row was unconfirmed for; nothing is lost: at the end every row is
 *     sent or dead-lettered and the ledger is empty;
 *   - memory stays bounded by the window and batch size; a payload the sink
 *     still reads is there and holds what the row held (read while written:
 *     a payload let go too early reads freed memory under ASan), one written
 *     whole stops counting in ledger_bytes, and lost with the connection its
 *     row is given back, never published from memory; bytes held come back
 *     to 0 once idle.
 *
 *   ledger_test                 scripted cases + LEDGER_SEEDS (default 600) random runs
 *   LEDGER_SEED=N ledger_test   one random run, verbose on failure (reproduce a failure)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "relay/ledger.h"
#include "relay/log.h"
#include "relay/sink.h"

/* ------------------------------------------------------------ helpers */

static const char *const DESTS[] = { "q.a", "q.b", "missing" };

/* A payload of this size is held apart from its row (row_release_payload frees it). */
static const char BIG[ROW_APART_MIN];

static row *mkrow_sized(int64_t id, int64_t token, const char *key, int dest, int attempts,
                        bool big);

static row *mkrow(int64_t id, int64_t token, const char *key, int dest, int attempts)
{
    return mkrow_sized(id, token, key, dest, attempts, false);
}

/* The byte every payload byte of a simulated large row holds: what the sink reads of it
   is checked against it (a payload let go and read again reads freed memory: ASan). */
static unsigned char pattern_of(int64_t id)
{
    return (unsigned char)(id * 7 + 1);
}

static unsigned char sim_big[ROW_APART_MIN + 4096];

static row *mkrow_full(int64_t id, int64_t token, const char *key, int dest, int attempts,
                       size_t big, const char *headers)
{
    char mid[37];
    snprintf(mid, sizeof mid, "00000000-0000-4000-8000-%012llx", (unsigned long long)id);
    const char *ex = dest == 2 ? "nope" : "";
    const char *rk = DESTS[dest];
    if (big > 0)
        memset(sim_big, pattern_of(id), big);
    row_fields f = {
        .id = id, .lease_token = token, .created_at_us = 1, .attempts = attempts,
        .message_id = { mid, 36 }, .exchange = { ex, strlen(ex) },
        .routing_key = { rk, strlen(rk) },
        .partition_key = { key, key ? strlen(key) : 0 },
        .headers_json = { headers, headers ? strlen(headers) : 0 },
        .payload = { big > 0 ? (const char *)sim_big : "p", big > 0 ? big : 1 },
    };
    assert_true(big <= sizeof sim_big);
    row *r = row_new(&f);
    assert_non_null(r);
    return r;
}

static row *mkrow_sized(int64_t id, int64_t token, const char *key, int dest, int attempts,
                        bool big)
{
    char mid[37];
    snprintf(mid, sizeof mid, "00000000-0000-4000-8000-%012llx", (unsigned long long)id);
    const char *ex = dest == 2 ? "nope" : "";
    const char *rk = DESTS[dest];
    row_fields f = {
        .id = id, .lease_token = token, .created_at_us = 1, .attempts = attempts,
        .message_id = { mid, 36 }, .exchange = { ex, strlen(ex) },
        .routing_key = { rk, strlen(rk) },
        .partition_key = { key, key ? strlen(key) : 0 },
        .payload = { big ? BIG : "p", big ? sizeof BIG : 1 },
    };
    row *r = row_new(&f);
    assert_non_null(r);
    return r;
}

static void check(const ledger *l)
{
    char err[300];
    if (ledger_check(l, err, sizeof err) != 0)
        fail_msg("ledger_check: %s", err);
}

static ledger *mk(bool strict, int max_attempts)
{
    ledger_cfg c = { .outbox = "t", .max_attempts = max_attempts, .backoff_ms = 10,
                     .backoff_max_ms = 100, .strict = strict, .cautious_s = 5 };
    ledger *l = ledger_new(&c);
    assert_non_null(l);
    return l;
}

static void claim(ledger *l, row **rows, size_t n, double deadline)
{
    ledger_claim_started(l);
    ledger_claimed(l, rows, n, deadline);
    check(l);
}

/* Publishes everything the ledger allows; returns how many (up to max), entries in out[]. */
static size_t publish_all(ledger *l, double now, led_entry **out, size_t max)
{
    size_t n = 0;
    led_entry *e;
    while (n < max && (e = ledger_next(l, now)) != NULL) {
        ledger_published(l, e, now);
        out[n++] = e;
        check(l);
    }
    return n;
}

static size_t settle_all(ledger *l, src_outcome *copy, size_t max)
{
    const src_outcome *v;
    size_t n = ledger_settle_begin(l, &v);
    assert_true(n <= max);
    if (n > 0)
        memcpy(copy, v, n * sizeof *v);
    check(l);
    ledger_settle_done(l, true, n);
    check(l);
    return n;
}

/* ------------------------------------------------------------ scripted */

/* A hot key is pipelined: the whole window goes out before the first confirm. */
static void test_hot_key_pipelined(void **state)
{
    (void)state;
    ledger *l = mk(false, 3);
    row *rows[10];
    for (int i = 0; i < 10; i++)
        rows[i] = mkrow(i + 1, 7, "k", 0, 0);
    claim(l, rows, 10, 100);
    led_entry *out[16];
    assert_int_equal(publish_all(l, 1, out, 8), 8);
    for (int i = 0; i < 8; i++)
        assert_int_equal(ledger_id(out[i]), i + 1);
    assert_int_equal(ledger_n_inflight(l), 8);
    ledger_free(l);
}

/* ordering=strict: one in flight per key, the next after its confirm. */
static void test_strict_one_in_flight(void **state)
{
    (void)state;
    ledger *l = mk(true, 3);
    row *rows[4] = { mkrow(1, 1, "k", 0, 0), mkrow(2, 1, "k", 0, 0), mkrow(3, 1, "j", 0, 0),
                     mkrow(4, 1, NULL, 0, 0) };
    claim(l, rows, 4, 100);
    led_entry *out[8];
    assert_int_equal(publish_all(l, 1, out, 8), 3);   /* 1 (k), 3 (j), 4 (no key) */
    assert_int_equal(ledger_id(out[0]), 1);
    ledger_result(l, out[0], SINK_ACK, NULL, 1);
    check(l);
    assert_int_equal(publish_all(l, 1, out, 8), 1);
    assert_int_equal(ledger_id(out[0]), 2);
    ledger_free(l);
}

/* Rows of one key towards another destination wait until the key's in-flight ones finish. */
static void test_one_destination_at_a_time(void **state)
{
    (void)state;
    ledger *l = mk(false, 3);
    row *rows[3] = { mkrow(1, 1, "k", 0, 0), mkrow(2, 1, "k", 0, 0), mkrow(3, 1, "k", 1, 0) };
    claim(l, rows, 3, 100);
    led_entry *out[8];
    assert_int_equal(publish_all(l, 1, out, 8), 2);
    ledger_result(l, out[0], SINK_ACK, NULL, 1);
    check(l);
    assert_null(ledger_next(l, 1));
    ledger_result(l, out[1], SINK_ACK, NULL, 1);
    check(l);
    assert_int_equal(publish_all(l, 1, out, 8), 1);
    assert_int_equal(ledger_id(out[0]), 3);
    ledger_free(l);
}

/* A refused row holds its key: later buffered rows go back, a later accepted
 * one is counted as overtaking, and claims of later rows are given back until
 * the failure has settled and no claim that may predate it is running. */
static void test_refusal_blocks_key_until_settled(void **state)
{
    (void)state;
    ledger *l = mk(false, 1);      /* first failure dead-letters */
    row *rows[4] = { mkrow(1, 1, "k", 0, 0), mkrow(2, 1, "k", 0, 0), mkrow(3, 1, "k", 0, 0),
                     mkrow(4, 1, "other", 0, 0) };
    claim(l, rows, 4, 100);
    led_entry *out[8];
    assert_int_equal(publish_all(l, 1, out, 2), 2);    /* 1 and 2 in flight, 3 buffered */
    ledger_result(l, out[0], SINK_RETURNED, "unroutable", 1);
    check(l);
    assert_int_equal(ledger_get_stats(l)->dead, 1);
    ledger_result(l, out[1], SINK_ACK, NULL, 1);        /* 2 overtook 1 */
    check(l);
    assert_int_equal(ledger_get_stats(l)->overtaken, 1);
    /* 3 was given back; only 4 (another key) may go */
    assert_int_equal(publish_all(l, 1, out, 8), 1);
    assert_int_equal(ledger_id(out[0]), 4);
    /* settle starts; a claim running meanwhile returns row 3 again: given back */
    const src_outcome *v;
    size_t n = ledger_settle_begin(l, &v);
    bool dead_seen = false, unclaim3 = false;
    for (size_t i = 0; i < n; i++) {
        dead_seen |= v[i].id == 1 && v[i].kind == SRC_DEAD;
        unclaim3 |= v[i].id == 3 && v[i].kind == SRC_UNCLAIM;
    }
    assert_true(dead_seen && unclaim3);
    ledger_claim_started(l);
    ledger_settle_done(l, true, n);      /* committed while the claim runs: key stays blocked */
    check(l);
    row *again[1] = { mkrow(3, 2, "k", 0, 0) };
    ledger_claimed(l, again, 1, 100);
    check(l);
    assert_null(ledger_next(l, 1));
    src_outcome copy[16];
    assert_int_equal(settle_all(l, copy, 16), 1);     /* the UNCLAIM of 3 under token 2 */
    assert_int_equal(copy[0].lease_token, 2);
    /* now unblocked: a claim returns 3 and it is published */
    row *third[1] = { mkrow(3, 3, "k", 0, 0) };
    claim(l, third, 1, 100);
    assert_int_equal(publish_all(l, 1, out, 8), 1);
    assert_int_equal(ledger_id(out[0]), 3);
    ledger_free(l);
}

/* A channel close: the culprit fails, the others come back and are republished
 * in id order before anything later of their key; the culprit's later rows go back. */
static void test_channel_close_republishes_in_order(void **state)
{
    (void)state;
    ledger *l = mk(false, 5);
    row *rows[6] = { mkrow(1, 1, "a", 0, 0), mkrow(2, 1, "b", 0, 0), mkrow(3, 1, "a", 0, 0),
                     mkrow(4, 1, "b", 0, 0), mkrow(5, 1, "a", 0, 0), mkrow(6, 1, "b", 0, 0) };
    claim(l, rows, 6, 100);
    led_entry *out[8];
    assert_int_equal(publish_all(l, 1, out, 4), 4);    /* 1..4 in flight */
    ledger_result(l, out[1], SINK_REJECTED, "404", 1);  /* culprit 2 (key b) */
    check(l);
    for (int i = 0; i < 4; i++)
        if (i != 1) {
            ledger_result(l, out[i], SINK_LOST, "closed", 1);
            check(l);
        }
    led_entry *again[8];
    size_t n = publish_all(l, 1, again, 8);
    assert_int_equal(n, 3);              /* 1, 3, 5 (key a); b's 4 and 6 were given back */
    assert_int_equal(ledger_id(again[0]), 1);
    assert_int_equal(ledger_id(again[1]), 3);
    assert_int_equal(ledger_id(again[2]), 5);
    assert_int_equal(ledger_get_stats(l)->republished, 2);
    ledger_free(l);
}

static int released;
static void *released_owner;
static void count_release(void *owner)
{
    released++;
    released_owner = owner;
}

/* A large row's payload is let go once the sink has written it: only its headers count
 * then. Lost with the connection, it is given back to the table (its payload is gone),
 * and so are the later rows of its key; an earlier row of its key that kept its payload is
 * republished from memory. A small row keeps its payload. */
static void test_written_payload_released(void **state)
{
    (void)state;
    ledger *l = mk(false, 5);
    row *rows[4] = { mkrow(1, 1, "a", 0, 0), mkrow_sized(2, 1, "a", 0, 0, true),
                     mkrow(3, 1, "a", 0, 0), mkrow_sized(4, 1, "b", 0, 0, true) };
    claim(l, rows, 4, 100);
    size_t all = ledger_bytes(l);
    assert_true(all >= 2 * ROW_APART_MIN);
    led_entry *out[8];
    assert_int_equal(publish_all(l, 1, out, 8), 4);
    ledger_written(l, out[0]);            /* small: kept */
    check(l);
    assert_int_equal(ledger_bytes(l), all);
    ledger_written(l, out[1]);
    ledger_written(l, out[3]);
    check(l);
    assert_int_equal(ledger_bytes(l), all - 2 * ROW_APART_MIN);
    assert_null(ledger_row(out[1])->payload);
    assert_int_equal(ledger_row(out[1])->payload_len, ROW_APART_MIN);  /* still its size */
    assert_int_equal(ledger_get_stats(l)->released, 2);
    ledger_written(l, out[1]);            /* twice: nothing more */
    assert_int_equal(ledger_get_stats(l)->released, 2);
    for (int i = 0; i < 4; i++) {
        ledger_result(l, out[i], SINK_LOST, "connection lost", 2);
        check(l);
    }
    led_entry *again[8];
    assert_int_equal(publish_all(l, 2, again, 8), 1);   /* only 1: 2, 3 and 4 go back */
    assert_int_equal(ledger_id(again[0]), 1);
    assert_int_equal(ledger_get_stats(l)->republished, 1);
    src_outcome v[8];
    assert_int_equal(settle_all(l, v, 8), 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(v[i].kind, SRC_UNCLAIM);
        assert_true(v[i].id >= 2);
    }
    ledger_claim_failed(l);
    /* a payload in a buffer the row holds (row_fields.payload_owner) is let go once written
       whatever its size, an empty one too: then the row holds none, and lost with the
       connection it is given back like the large ones, never republished without it */
    released = 0;
    row_fields f = { .id = 9, .lease_token = 3, .created_at_us = 1,
                     .message_id = { "00000000-0000-4000-8000-000000000009", 36 },
                     .exchange = { "", 0 }, .routing_key = { "q.a", 3 }, .payload = { "", 0 },
                     .payload_owner = &released, .payload_release = count_release };
    row *empty[1] = { row_new(&f) };
    assert_non_null(empty[0]);
    claim(l, empty, 1, 100);
    led_entry *e = ledger_next(l, 3);
    assert_non_null(e);
    assert_int_equal(ledger_id(e), 9);
    ledger_published(l, e, 3);
    ledger_written(l, e);
    check(l);
    assert_int_equal(released, 1);
    assert_int_equal(ledger_get_stats(l)->released, 3);
    ledger_result(l, e, SINK_LOST, "connection lost", 3);
    check(l);
    assert_null(ledger_next(l, 3));       /* given back, not republished */
    assert_int_equal(ledger_get_stats(l)->republished, 1);
    ledger_free(l);
}

/* A claim leases again a row whose settle is running: its outcome goes again
 * under the new token; a buffered row adopts the new token and deadline. */
static void test_readopted_rows(void **state)
{
    (void)state;
    ledger *l = mk(false, 3);
    row *rows[2] = { mkrow(1, 10, NULL, 0, 0), mkrow(2, 10, NULL, 0, 0) };
    claim(l, rows, 2, 100);
    led_entry *out[4] = { NULL };
    assert_int_equal(publish_all(l, 1, out, 1), 1);
    ledger_result(l, out[0], SINK_ACK, NULL, 1);
    const src_outcome *v;
    assert_int_equal(ledger_settle_begin(l, &v), 1);
    row *again[2] = { mkrow(1, 20, NULL, 0, 0), mkrow(2, 20, NULL, 0, 0) };
    claim(l, again, 2, 200);
    ledger_settle_done(l, true, 0);       /* token 10 no longer matched */
    check(l);
    src_outcome copy[4];
    assert_int_equal(settle_all(l, copy, 4), 1);
    assert_int_equal(copy[0].id, 1);
    assert_int_equal(copy[0].lease_token, 20);
    assert_int_equal(copy[0].kind, SRC_SENT);
    led_entry *e = ledger_next(l, 150);   /* deadline moved to 200 with the new lease */
    assert_non_null(e);
    assert_int_equal(ledger_row(e)->lease_token, 20);
    ledger_free(l);
}

/* Rows past their deadline are never published: they go back unpublished. */
static void test_deadline_gives_back(void **state)
{
    (void)state;
    ledger *l = mk(false, 3);
    row *rows[3] = { mkrow(1, 1, "k", 0, 0), mkrow(2, 1, "k", 0, 0), mkrow(3, 1, NULL, 0, 0) };
    claim(l, rows, 3, 10);
    assert_null(ledger_next(l, 10.5));
    check(l);
    assert_int_equal(ledger_get_stats(l)->expired, 2);   /* 1 and 3; 2 cascaded behind 1 */
    assert_int_equal(ledger_n_pending(l), 3);
    src_outcome copy[4];
    assert_int_equal(settle_all(l, copy, 4), 3);
    for (int i = 0; i < 3; i++)
        assert_int_equal(copy[i].kind, SRC_UNCLAIM);
    assert_int_equal(ledger_n_held(l), 0);
    ledger_free(l);
}

/* Nothing can be published (the sink is down): ledger_expire gives back every buffered row
   past its deadline all the same, parked ones and rows queued behind an in-flight row of
   their key included, releases their bytes, and leaves the rows of a later claim. */
static void test_expire_without_publishing(void **state)
{
    (void)state;
    ledger *l = mk(true, 3);                      /* strict: 2 waits behind 1 */
    row *rows[4] = { mkrow(1, 1, "k", 0, 0), mkrow(2, 1, "k", 0, 0), mkrow(3, 1, NULL, 1, 0),
                     mkrow(4, 1, "j", 0, 0) };
    claim(l, rows, 4, 10);
    led_entry *e = ledger_next(l, 1);
    assert_int_equal(ledger_id(e), 1);
    ledger_published(l, e, 1);                    /* 1 in flight, 2 behind it */
    e = ledger_next(l, 1);
    assert_int_equal(ledger_id(e), 3);
    ledger_wait(l, e);                            /* 3 parked (its destination checked) */
    check(l);
    row *later[1] = { mkrow(5, 2, NULL, 0, 0) };
    claim(l, later, 1, 20);
    assert_true(ledger_first_deadline(l) == 10);
    size_t before = ledger_bytes(l);
    assert_int_equal(ledger_expire(l, 9), 0);
    assert_int_equal(ledger_expire(l, 10.5), 3);  /* 2, 3 and 4; 1 is in flight */
    check(l);
    assert_int_equal(ledger_n_buffered(l), 1);
    assert_int_equal(ledger_n_inflight(l), 1);
    assert_int_equal(ledger_bytes(l), before - 3 * src_row_bytes(later[0]));
    assert_true(ledger_first_deadline(l) == 20);
    assert_int_equal(ledger_get_stats(l)->expired, 3);
    src_outcome copy[8];
    assert_int_equal(settle_all(l, copy, 8), 3);
    for (int i = 0; i < 3; i++)
        assert_int_equal(copy[i].kind, SRC_UNCLAIM);
    assert_int_equal(ledger_expire(l, 30), 1);
    assert_true(ledger_first_deadline(l) == 0);
    ledger_free(l);
}

/* Memory follows rows in flight: a long run leaves no keys, ids or table growth behind. */
static void test_memory_follows_work_in_flight(void **state)
{
    (void)state;
    ledger *l = mk(false, 3);
    int64_t id = 1;
    led_entry *out[64];
    src_outcome copy[128];
    /* a row's size for the byte budget (payload + headers text) is taken once, when the
       row is made: what the ledger adds when it takes a row is what it gives back, even
       if the headers' text is no longer what it was (here cut to nothing) */
    {
        const char *hdr = "{\"seq\": \"1\", \"origin\": \"sql\"}";
        row_fields f = {
            .id = 1, .lease_token = 1, .created_at_us = 1, .message_id = { "00000000-0000-4000-8000-000000000001", 36 },
            .exchange = { "", 0 }, .routing_key = { "q.a", 3 }, .headers_json = { hdr, strlen(hdr) },
            .payload = { "payload", 7 },
        };
        row *rows[2] = { row_new(&f), NULL };
        f.id = 2;
        f.headers_json.p = NULL;   /* none: the payload alone */
        rows[1] = row_new(&f);
        assert_non_null(rows[0]);
        assert_non_null(rows[1]);
        assert_int_equal(src_row_bytes(rows[0]), 7 + strlen(hdr));
        assert_int_equal(src_row_bytes(rows[1]), 7);
        char *text = (char *)rows[0]->headers_json;
        claim(l, rows, 2, 1e9);
        assert_int_equal(ledger_bytes(l), 14 + strlen(hdr));
        text[0] = '\0';
        ledger_giveback_buffered(l);
        assert_int_equal(ledger_bytes(l), 0);
        check(l);
        settle_all(l, copy, 128);   /* the rows given back are released */
        assert_int_equal(ledger_n_held(l), 0);
    }
    /* a row that holds its payload's buffer (a large payload is not copied: row.h) reads it
       where it is, counts it like a copied one, and frees it once, when the ledger lets the
       row go */
    {
        static char big[256 * 1024];
        memset(big, 'b', sizeof big - 1);
        released = 0;
        row_fields f = {
            .id = 3, .lease_token = 2, .created_at_us = 1, .message_id = { "00000000-0000-4000-8000-000000000003", 36 },
            .exchange = { "", 0 }, .routing_key = { "q.a", 3 }, .payload = { big, sizeof big - 1 },
            .payload_owner = big, .payload_release = count_release,
        };
        row *rows[1] = { row_new(&f) };
        assert_non_null(rows[0]);
        assert_ptr_equal(rows[0]->payload, big);
        assert_int_equal(rows[0]->payload_len, sizeof big - 1);
        assert_int_equal(src_row_bytes(rows[0]), sizeof big - 1);
        claim(l, rows, 1, 1e9);
        assert_int_equal(ledger_bytes(l), sizeof big - 1);
        ledger_giveback_buffered(l);
        settle_all(l, copy, 128);
        assert_int_equal(ledger_n_held(l), 0);
        assert_int_equal(released, 1);
        assert_ptr_equal(released_owner, big);
    }
    for (int round = 0; round < 2000; round++) {
        row *rows[50];
        for (int i = 0; i < 50; i++, id++) {
            char key[32];
            snprintf(key, sizeof key, "key-%lld", (long long)(id % 977));
            rows[i] = mkrow(id, round + 1, key, 0, 0);
        }
        ledger_claim_started(l);
        ledger_claimed(l, rows, 50, 1e9);
        size_t n = publish_all(l, 1, out, 64);
        for (size_t i = 0; i < n; i++)
            ledger_result(l, out[i], SINK_ACK, NULL, 1);
        settle_all(l, copy, 128);
        assert_true(ledger_n_held(l) <= 100);
    }
    check(l);
    assert_int_equal(ledger_n_held(l), 0);
    assert_int_equal(ledger_n_keys(l), 0);
    assert_int_equal(ledger_get_stats(l)->relayed, 100000);
    ledger_free(l);
}

/* ------------------------------------------------------------ randomized */

static uint64_t rng_s;
static long trace_id = -1;   /* LEDGER_TRACE=ID: print the simulation's events for one row */
#define TRACE(id, ...) do { if ((long)(id) == trace_id) { fprintf(stderr, "trace id=%ld: ", (long)(id)); \
                            fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } } while (0)
static uint64_t rnd(void)
{
    rng_s ^= rng_s << 13;
    rng_s ^= rng_s >> 7;
    rng_s ^= rng_s << 17;
    return rng_s;
}
static bool chance(int per_mille) { return (int)(rnd() % 1000) < per_mille; }
static int pick(int n) { return (int)(rnd() % (uint64_t)n); }

/* What the seeded runs went through, summed (printed at the end: a run that never let a
   payload go, or never lost one so, would test nothing of it). */
static struct {
    uint64_t released, lost_released, refused_released, streamed, rewritten, stops, expired,
             lapses_released, held_passed, late_claims;
} cover;

#define SIM_ROWS   160
#define SIM_KEYS   5
#define SIM_WINDOW 8
#define SIM_BATCH  6
#define SIM_LEASE  6.0
#define SIM_MARGIN 1.0
#define SIM_MAXATT 3
#define SIM_HELD   16         /* the most ids a claim is told it may pass over */

enum { R_PENDING, R_SENT, R_DEAD };
enum { F_OK, F_POISON, F_FLAKY, F_MISSING };

typedef struct dbrow {
    int     key;          /* -1: none */
    int     dest;
    int     fate;
    int     state;
    int     attempts;
    int64_t token;        /* 0: no lease */
    double  lease_until;
    double  available_at;
    bool    acked_ever;
    bool    refused_latest;   /* the broker refused its latest publish */
    int     refusals;         /* every refusal, blame for a channel close included */
    bool    hidden_refusal;   /* refused by the broker, but the connection died before
                                 the ledger heard of it (nobody can count what follows) */
    long    given_back;   /* the step a settle gave it back (released its lease), 0: never */
    int     enqueued;     /* copies in the queue */
    int     allowance;    /* copies explained by losses it was unconfirmed for */
} dbrow;

/* A message on the channel. written: its body is out whole (the broker can take it); a
   large one may be written over many steps (the sink's stream), nothing else is published
   meanwhile, and on_written (ledger_written) comes when its last frame is out. */
typedef struct bmsg { led_entry *e; int64_t id; bool processed, refused, written, big; } bmsg;

typedef struct sim {
    ledger *l;
    bool    strict, verbose;
    double  t;
    dbrow   rows[SIM_ROWS + 1];
    int     n_rows;
    int64_t next_token;
    /* claim */
    int     claim;            /* 0 none, 1 started, 2 executed */
    double  claim_deadline;
    row    *claim_rows[SIM_BATCH];
    size_t  claim_n, claim_max;
    long    claim_started;    /* the step it started */
    double  claim_t;          /* and when */
    int64_t held[SIM_HELD];   /* ledger_held_ids at the claim's start: it passes over them */
    size_t  held_n;
    /* settle */
    int     settle;           /* 0 none, 1 started, 2 executed */
    src_outcome sv[4 * (SIM_WINDOW + 2 * SIM_BATCH) + 8];
    size_t  sn, s_applied;
    /* broker */
    bmsg    ch[SIM_WINDOW * 4];
    size_t  ch_n;
    bool    sink_up, main_up, missing_cached;
    bool    streams;          /* the sink names the message it is writing (sink_ops.writing):
                                 payloads are let go once written; else held until the result */
    int64_t writing;          /* id of the message being written (a stream), 0: none */
    bool    stopping;         /* a graceful stop is draining: no claims, no publishes */
    uint64_t released;        /* large payloads the ledger must have let go */
    const bmsg *lost;         /* broker_fail: the messages it is failing, one by one */
    size_t  lost_n;
    int     max_seen[SIM_KEYS];
    int     order[SIM_KEYS][SIM_ROWS];    /* first enqueues per key, in queue order */
    int     order_n[SIM_KEYS];
    int     inversions;
    bool    refusals;
    long    steps;
} sim;

#define SIM_FAIL(s, ...) do { fprintf(stderr, "seed step %ld t=%.2f: ", (s)->steps, (s)->t); \
                              fail_msg(__VA_ARGS__); } while (0)

static void sim_check(sim *s)
{
    char err[300];
    if (ledger_check(s->l, err, sizeof err) != 0)
        SIM_FAIL(s, "ledger_check: %s", err);
    size_t lim = SIM_WINDOW + 2 * SIM_BATCH;
    if (ledger_n_buffered(s->l) + ledger_n_inflight(s->l) > lim)
        SIM_FAIL(s, "memory: %zu rows held beyond window + 2 x batch",
                 ledger_n_buffered(s->l) + ledger_n_inflight(s->l));
    if (ledger_n_held(s->l) > 2 * lim + SIM_BATCH)
        SIM_FAIL(s, "memory: %zu entries held", ledger_n_held(s->l));
    /* bytes: what the rows held count now (ledger_check sums them); a payload let go no
       longer counts, so they stay within the rows buffered plus the large ones in flight,
       and an underflow would show as more */
    size_t big_inflight = 0;
    for (size_t i = 0; i < s->ch_n; i++)
        big_inflight += s->ch[i].big && (!s->ch[i].written || !s->streams);
    for (size_t i = 0; i < s->lost_n; i++)
        big_inflight += s->lost[i].big && (!s->lost[i].written || !s->streams);
    size_t bound = (ledger_n_buffered(s->l) + big_inflight) * (ROW_APART_MIN + 4096) +
                   ledger_n_inflight(s->l) * 64;
    if (ledger_bytes(s->l) > bound)
        SIM_FAIL(s, "bytes: %zu held, at most %zu expected (%zu buffered, %zu in flight, "
                 "%zu of them large and not written)", ledger_bytes(s->l), bound,
                 ledger_n_buffered(s->l), ledger_n_inflight(s->l), big_inflight);
    if (s->streams && ledger_get_stats(s->l)->released != s->released)
        SIM_FAIL(s, "%llu payloads let go, %llu written whole",
                 (unsigned long long)ledger_get_stats(s->l)->released,
                 (unsigned long long)s->released);
}

/* The sink reads a message's payload while it writes it: it must be there, whole. */
static void sink_reads(sim *s, const bmsg *m)
{
    const row *r = ledger_row(m->e);
    if (r == NULL || r->id != m->id)
        SIM_FAIL(s, "id=%lld: the sink's message has no row", (long long)m->id);
    if (r->payload == NULL || r->payload_released)
        SIM_FAIL(s, "id=%lld: payload let go while the sink still reads it", (long long)m->id);
    if (!m->big)
        return;
    unsigned char want = pattern_of(m->id);
    size_t n = r->payload_len;
    if (n < ROW_APART_MIN || r->payload[0] != want || r->payload[n / 2] != want ||
        r->payload[n - 1] != want)
        SIM_FAIL(s, "id=%lld: payload not what the row holds", (long long)m->id);
}

static bool db_claimable(sim *s, int id)
{
    dbrow *r = &s->rows[id];
    if (r->state != R_PENDING || r->available_at > s->t || (r->token && r->lease_until >= s->t))
        return false;
    if (r->key >= 0)
        for (int j = 1; j < id; j++)
            if (s->rows[j].key == r->key && s->rows[j].state == R_PENDING && s->rows[j].attempts > 0)
                return false;
    return true;
}

static bool claim_passes_over(sim *s, int id)
{
    for (size_t i = 0; i < s->held_n; i++) {
        if (s->held[i] != id)
            continue;
        /* a row the ledger says it holds under a live lease of ours is one the claim would
           not take, unless the ledger gave it back since (a settle released it while the
           claim ran: the ledger then keeps its key's later rows from this claim back) or
           its lease ran out (beyond the margin a real claim's timeout keeps within) */
        if (db_claimable(s, id) && s->rows[id].given_back < s->claim_started &&
            s->t < s->claim_t + SIM_MARGIN)
            SIM_FAIL(s, "id=%d: held (ledger_held_ids) but claimable", id);
        cover.held_passed++;
        return true;
    }
    return false;
}

static void claim_exec(sim *s)
{
    int64_t tok = ++s->next_token;
    s->claim_n = 0;
    for (int id = 1; id <= s->n_rows && s->claim_n < s->claim_max; id++) {
        if (claim_passes_over(s, id) || !db_claimable(s, id))
            continue;
        dbrow *r = &s->rows[id];
        r->token = tok;
        r->lease_until = s->t + SIM_LEASE;
        TRACE(id, "t=%.2f claimed token %lld attempts %d", s->t, (long long)tok, r->attempts);
        char key[8];
        snprintf(key, sizeof key, "k%d", r->key);
        s->claim_rows[s->claim_n++] =
            mkrow_full(id, tok, r->key >= 0 ? key : NULL, r->dest, r->attempts,
                       id % 8 == 3 || id % 8 == 6 ? ROW_APART_MIN + (size_t)(id % 5) * 1000 : 0,
                       id % 3 == 0 ? "{\"h\": \"v\"}" : NULL);
    }
    s->claim = 2;
}

static void settle_exec(sim *s)
{
    s->s_applied = 0;
    for (size_t i = 0; i < s->sn; i++) {
        const src_outcome *o = &s->sv[i];
        dbrow *r = &s->rows[o->id];
        TRACE(o->id, "t=%.2f settle kind %d token %lld (db token %lld state %d)", s->t, o->kind,
              (long long)o->lease_token, (long long)r->token, r->state);
        if (r->state != R_PENDING || r->token != o->lease_token)
            continue;
        s->s_applied++;
        r->token = 0;
        if (o->kind != SRC_SENT)
            r->given_back = s->steps;
        switch (o->kind) {
        case SRC_SENT:
            if (!r->acked_ever)
                SIM_FAIL(s, "id=%lld marked sent without a confirm", (long long)o->id);
            r->state = R_SENT;
            break;
        case SRC_RETRY:
            r->attempts++;
            r->available_at = s->t + (double)o->backoff_ms / 100.0;
            break;
        case SRC_DEAD:
            r->state = R_DEAD;
            break;
        default:
            break;
        }
    }
    s->settle = 2;
}

/* The broker processes the oldest unprocessed message of the channel. */
static bool broker_process(sim *s)
{
    for (size_t i = 0; i < s->ch_n; i++) {
        bmsg *m = &s->ch[i];
        if (m->processed)
            continue;
        if (!m->written)
            return false;          /* its body is still being written: the broker waits */
        m->processed = true;
        dbrow *r = &s->rows[m->id];
        TRACE(m->id, "t=%.2f processed", s->t);
        if (r->fate == F_POISON || (r->fate == F_FLAKY && r->attempts == 0 && !r->acked_ever)) {
            m->refused = true;
            return true;
        }
        r->enqueued++;
        if (r->enqueued > 1 + r->allowance)
            SIM_FAIL(s, "id=%lld enqueued %d times, %d explained", (long long)m->id, r->enqueued,
                     r->allowance);
        if (r->key >= 0 && r->enqueued == 1) {
            s->order[r->key][s->order_n[r->key]++] = (int)m->id;
            if (m->id < s->max_seen[r->key]) {
                s->inversions++;
                if (s->verbose)
                    fprintf(stderr, "inversion: key k%d id=%lld enqueued after id=%d (t=%.2f)\n",
                            r->key, (long long)m->id, s->max_seen[r->key], s->t);
            }
            else
                s->max_seen[r->key] = (int)m->id;
        }
        return true;
    }
    return false;
}

static void ch_remove(sim *s, size_t i)
{
    memmove(&s->ch[i], &s->ch[i + 1], (s->ch_n - i - 1) * sizeof s->ch[0]);
    s->ch_n--;
}

/* Confirms come in publish order. */
static void broker_confirm(sim *s)
{
    if (s->ch_n == 0 || !s->ch[0].processed)
        return;
    bmsg m = s->ch[0];
    ch_remove(s, 0);
    TRACE(m.id, "t=%.2f confirm refused=%d", s->t, m.refused);
    dbrow *r = &s->rows[m.id];
    if (m.refused) {
        cover.refused_released += s->streams && m.big && m.written;
        r->refused_latest = true;
        r->refusals++;
        s->refusals = true;
        ledger_result(s->l, m.e, chance(500) ? SINK_RETURNED : SINK_NACKED, "refused", s->t);
    } else {
        r->acked_ever = true;
        ledger_result(s->l, m.e, SINK_ACK, NULL, s->t);
    }
}

/* Connection loss (culprit < 0) or channel close caused by the culprit message. */
static void broker_fail(sim *s, int culprit)
{
    if (culprit >= 0) {
        for (int i = 0; i < culprit; i++)
            if (!s->ch[i].processed)
                (void)broker_process(s);
    }
    s->sink_up = false;
    s->writing = 0;                    /* its writing stopped short: no on_written */
    bmsg copy[SIM_WINDOW * 4];
    size_t n = s->ch_n;
    memcpy(copy, s->ch, n * sizeof copy[0]);
    s->ch_n = 0;
    s->lost = copy;
    s->lost_n = n;
    if (culprit >= 0) {
        s->rows[copy[culprit].id].refused_latest = true;
        s->rows[copy[culprit].id].refusals++;
        s->refusals = true;
        ledger_result(s->l, copy[culprit].e, SINK_REJECTED, "404", s->t);
        sim_check(s);
    }
    for (size_t i = 0; i < n; i++) {
        if ((int)i == culprit)
            continue;
        if (copy[i].processed && !copy[i].refused)
            s->rows[copy[i].id].allowance++;    /* in the queue, unconfirmed: may go again */
        if (copy[i].processed && copy[i].refused)
            s->rows[copy[i].id].hidden_refusal = true;
        TRACE(copy[i].id, "t=%.2f lost (processed %d)", s->t, copy[i].processed);
        uint64_t republished = ledger_get_stats(s->l)->republished;
        ledger_result(s->l, copy[i].e, SINK_LOST, "connection lost", s->t);
        if (s->streams && copy[i].big && copy[i].written) {
            /* its payload was let go: given back to the table, never published from memory */
            cover.lost_released++;
            if (ledger_get_stats(s->l)->republished != republished)
                SIM_FAIL(s, "id=%lld: republished after its payload was let go",
                         (long long)copy[i].id);
        }
        sim_check(s);
    }
    s->lost = NULL;
    s->lost_n = 0;
}

static void sim_publish(sim *s, double now)
{
    if (!s->sink_up || s->stopping || s->writing != 0)
        return;                    /* a message being written: SINK_EAGAIN until written */
    led_entry *e;
    while ((e = ledger_next(s->l, now)) != NULL) {
        const row *r = ledger_row(e);
        dbrow *d = &s->rows[r->id];
        if (s->ch_n >= SIM_WINDOW || chance(30))
            break;                                          /* SINK_EAGAIN */
        if (d->dest == 2 && !s->missing_cached) {
            s->missing_cached = true;                       /* the check will say: missing */
            ledger_wait(s->l, e);
        } else if (d->dest == 2) {
            d->refused_latest = true;
            d->refusals++;
            s->refusals = true;
            ledger_refused(s->l, e, LED_REFUSED, "exchange 'nope' not found", now);
        } else if (chance(20)) {
            ledger_wait(s->l, e);                           /* destination being checked */
        } else {
            /* the oracle: no earlier row of its key refused and not yet committed */
            if (d->key >= 0)
                for (int j = 1; j < (int)r->id; j++)
                    if (s->rows[j].key == d->key && s->rows[j].state == R_PENDING &&
                        s->rows[j].refused_latest)
                        SIM_FAIL(s, "id=%lld published while the earlier id=%d of its key "
                                 "was refused and not settled", (long long)r->id, j);
            if (d->token != r->lease_token)
                SIM_FAIL(s, "id=%lld published without holding its lease", (long long)r->id);
            d->refused_latest = false;
            TRACE(r->id, "t=%.2f published token %lld", now, (long long)r->lease_token);
            bmsg m = { .e = e, .id = r->id, .big = r->payload_len >= ROW_APART_MIN };
            sink_reads(s, &m);
            ledger_published(s->l, e, now);
            s->ch[s->ch_n++] = m;
            bmsg *mp = &s->ch[s->ch_n - 1];
            if (s->streams && mp->big && chance(600)) {
                s->writing = mp->id;           /* the rest of its body as the socket drains */
                sim_check(s);
                break;
            }
            mp->written = true;
            if (s->streams) {
                /* written whole in publish: the drain lets its payload go at once */
                s->released += mp->big;
                ledger_written(s->l, e);
            }
        }
        sim_check(s);
    }
}

static size_t sim_claim_size(sim *s)
{
    size_t lim = SIM_WINDOW + 2 * SIM_BATCH;
    size_t used = ledger_n_inflight(s->l) + ledger_n_buffered(s->l);
    if (used >= lim || ledger_n_outcomes(s->l) >= lim)
        return 0;
    size_t room = lim - used;
    return room < SIM_BATCH ? room : SIM_BATCH;
}

static bool sim_done(sim *s)
{
    if (s->n_rows < SIM_ROWS || ledger_n_held(s->l) != 0 || s->claim || s->settle)
        return false;
    for (int i = 1; i <= s->n_rows; i++)
        if (s->rows[i].state == R_PENDING)
            return false;
    return true;
}

/* One step: an event chosen at random; faults only while `faults`. */
static void sim_step(sim *s, bool faults)
{
    s->steps++;
    int ev = pick(112);
    if (ev < 8) {
        s->t += (double)pick(100) / 100.0;
    } else if (ev < 14) {
        for (int k = pick(6); k > 0 && s->n_rows < SIM_ROWS; k--) {
            dbrow *r = &s->rows[++s->n_rows];
            memset(r, 0, sizeof *r);
            r->key = chance(150) ? -1 : pick(SIM_KEYS);
            r->dest = chance(200) ? 1 : 0;
            int f = pick(1000);
            r->fate = f < 15 ? F_POISON : f < 45 ? F_FLAKY : f < 55 ? F_MISSING : F_OK;
            if (r->fate == F_MISSING)
                r->dest = 2;
        }
    } else if (ev < 24) {
        if (s->claim == 0 && s->main_up && !s->stopping && ledger_n_old(s->l) == 0 &&
            (s->claim_max = sim_claim_size(s)) > 0) {
            s->claim = 1;
            s->claim_deadline = s->t + SIM_LEASE - SIM_MARGIN;
            s->claim_started = s->steps;
            s->claim_t = s->t;
            s->held_n = ledger_held_ids(s->l, s->t, s->held, SIM_HELD);
            ledger_claim_started(s->l);
        } else if (s->claim == 1) {
            claim_exec(s);
        } else if (s->claim == 2) {
            s->claim = 0;
            ledger_claimed(s->l, s->claim_rows, s->claim_n, s->claim_deadline);
            if (s->stopping) {
                sim_check(s);
                ledger_giveback_buffered(s->l);   /* the drain's on_claimed while stopping */
            }
        }
    } else if (ev < 40) {
        sim_publish(s, s->t);
    } else if (ev < 55) {
        (void)broker_process(s);
    } else if (ev < 70) {
        broker_confirm(s);
    } else if (ev < 84) {
        if (s->settle == 0) {
            const src_outcome *v;
            s->sn = ledger_settle_begin(s->l, &v);
            if (s->sn > sizeof s->sv / sizeof s->sv[0])
                SIM_FAIL(s, "settle of %zu outcomes", s->sn);
            if (s->sn > 0)
                memcpy(s->sv, v, s->sn * sizeof *v);
            s->settle = s->sn ? 1 : 0;
        } else if (s->settle == 1) {
            settle_exec(s);
        } else {
            s->settle = 0;
            ledger_settle_done(s->l, true, s->s_applied);
        }
    } else if (ev < 87) {
        ledger_unpark(s->l);
        if (chance(300))
            s->missing_cached = false;
    } else if (ev < 90) {
        if (!s->sink_up)
            s->sink_up = true;
        else if (faults && chance(300))
            broker_fail(s, -1);
    } else if (ev < 92) {
        size_t u = 0;
        while (u < s->ch_n && s->ch[u].processed)
            u++;
        if (faults && s->sink_up && u < s->ch_n && chance(400))
            broker_fail(s, (int)u + pick((int)(s->ch_n - u)));   /* an unprocessed culprit */
    } else if (ev < 95) {
        if (faults && s->settle && chance(200)) {
            if (s->settle == 1 || chance(500)) {
                if (s->settle == 1 && chance(500))
                    settle_exec(s);            /* committed, but the answer was lost */
                s->settle = 0;
                ledger_settle_done(s->l, false, 0);
            }
        }
        if (faults && s->claim == 1 && chance(200)) {
            s->claim = 0;                     /* a statement error: rolled back */
            ledger_claim_failed(s->l);
        }
    } else if (ev < 97) {
        if (faults && s->main_up && chance(150)) {
            /* the claiming session (and leadership) is lost */
            s->main_up = false;
            bool late = s->claim == 2 && chance(500);
            if (s->claim && !late) {
                if (s->claim == 2)            /* leased, but the answer was lost */
                    for (size_t i = 0; i < s->claim_n; i++) {
                        /* a row whose confirmed outcome was still unsettled (its lease
                           had expired) is now leased by nobody we know: it will be
                           published again — at-least-once, explained */
                        s->rows[s->claim_rows[i]->id].allowance++;
                        row_free(s->claim_rows[i]);
                    }
                s->claim = 0;
                ledger_claim_failed(s->l);
            }
            for (size_t i = 0; i < s->ch_n; i++)
                cover.lapses_released += s->streams && s->ch[i].big && s->ch[i].written;
            ledger_drop_buffered(s->l);
            if (late) {
                /* the lease's local deadline passed while the claim ran, and its answer
                   comes after the lapse: the drain forgets its rows too (on_claimed) */
                s->claim = 0;
                for (size_t i = 0; i < s->claim_n; i++)
                    s->rows[s->claim_rows[i]->id].allowance++;
                ledger_claimed(s->l, s->claim_rows, s->claim_n, s->claim_deadline);
                ledger_drop_buffered(s->l);
                cover.late_claims++;
            }
        } else if (!s->main_up && ledger_n_old(s->l) == 0 && ledger_n_pending(s->l) == 0 &&
                   s->settle == 0) {
            s->main_up = true;             /* leadership again: stale leases reset */
            for (int i = 1; i <= s->n_rows; i++)
                if (s->rows[i].state == R_PENDING)
                    s->rows[i].token = 0;
        }
    } else if (ev >= 100 && ev < 105) {
        /* the sink writes more of the message it is streaming: it reads its payload; its
           last frame out, on_written */
        for (size_t i = 0; i < s->ch_n && s->writing != 0; i++) {
            bmsg *m = &s->ch[i];
            if (m->id != s->writing)
                continue;
            sink_reads(s, m);
            cover.streamed++;
            if (chance(400)) {
                m->written = true;
                s->writing = 0;
                s->released += m->big;
                TRACE(m->id, "t=%.2f written whole", s->t);
                ledger_written(s->l, m->e);
            }
        }
    } else if (ev >= 105 && ev < 107) {
        /* on_written again for a message written already (it must change nothing), or
           for one whose result came: nothing reads a payload let go */
        if (s->streams && s->ch_n > 0) {
            bmsg *m = &s->ch[pick((int)s->ch_n)];
            if (m->written) {
                cover.rewritten++;
                ledger_written(s->l, m->e);
            }
        }
    } else if (ev >= 107 && ev < 109) {
        /* nothing can be published (the sink down, a lapse, a stop): the drain gives back
           what is past its deadline all the same */
        if (!s->sink_up || s->stopping || !s->main_up || chance(300))
            cover.expired += ledger_expire(s->l, s->t);
    } else if (ev >= 109 && ev < 111) {
        if (faults && !s->stopping && chance(100)) {
            s->stopping = true;             /* a graceful stop (or a reload of the outbox) */
            cover.stops++;
            ledger_giveback_buffered(s->l);
        } else if (s->stopping && ledger_n_inflight(s->l) == 0 && ledger_n_buffered(s->l) == 0 &&
                   ledger_n_pending(s->l) == 0 && s->settle == 0 && s->claim == 0) {
            s->stopping = false;            /* drained and settled: the next relay starts */
        }
    } else {
        s->t += 0.05;
    }
    sim_check(s);
}

static void sim_run(uint64_t seed, bool strict, bool verbose)
{
    sim *s = calloc(1, sizeof *s);
    assert_non_null(s);
    rng_s = seed * 2654435761u + 1;
    s->strict = strict;
    s->verbose = verbose;
    s->l = mk(strict, SIM_MAXATT);
    s->sink_up = s->main_up = true;
    s->streams = seed % 3 != 1;
    for (int i = 0; i < SIM_KEYS; i++)
        s->max_seen[i] = 0;
    for (int i = 0; i < 1500; i++)
        sim_step(s, true);
    /* quiet phase: everything must end sent or dead-lettered */
    for (int i = 0; i < 200000 && !sim_done(s); i++) {
        if (!s->sink_up)
            s->sink_up = true;
        sim_step(s, false);
        if (i % 50 == 0)
            ledger_unpark(s->l);
    }
    if (!sim_done(s)) {
        int pending = 0;
        for (int i = 1; i <= s->n_rows; i++)
            pending += s->rows[i].state == R_PENDING;
        SIM_FAIL(s, "seed %llu: did not converge: %d rows pending, %zu held, claim %d settle %d",
                 (unsigned long long)seed, pending, ledger_n_held(s->l), s->claim, s->settle);
    }
    if (ledger_bytes(s->l) != 0 || ledger_n_held(s->l) != 0)
        SIM_FAIL(s, "seed %llu: idle, yet %zu bytes and %zu rows held", (unsigned long long)seed,
                 ledger_bytes(s->l), ledger_n_held(s->l));
    for (int i = 1; i <= s->n_rows; i++) {
        dbrow *r = &s->rows[i];
        bool must_die = r->fate == F_POISON || r->fate == F_MISSING;
        bool may_die = must_die || r->refusals >= SIM_MAXATT;
        if ((r->state == R_DEAD && !may_die) || (r->state != R_DEAD && must_die))
            SIM_FAIL(s, "seed %llu: id=%d fate %d ended in state %d", (unsigned long long)seed,
                     i, r->fate, r->state);
        if (r->state == R_SENT && r->enqueued < 1)
            SIM_FAIL(s, "seed %llu: id=%d marked sent, never enqueued", (unsigned long long)seed, i);
    }
    /* rows that reached the queue ahead of an earlier row of their key */
    int overtakers = 0;
    for (int k = 0; k < SIM_KEYS; k++) {
        for (int i = 0; i < s->order_n[k]; i++) {
            bool over = false, hidden = false;
            for (int j = i + 1; j < s->order_n[k]; j++)
                if (s->order[k][j] < s->order[k][i]) {
                    over = true;
                    hidden |= s->rows[s->order[k][j]].hidden_refusal;
                }
            overtakers += over && !hidden;
        }
    }
    uint64_t overtaken = ledger_get_stats(s->l)->overtaken;
    if ((uint64_t)overtakers > overtaken || (strict && s->inversions > 0))
        SIM_FAIL(s, "seed %llu: %d rows overtook an earlier row of their key (%d inversions), "
                 "%llu counted as overtaken%s", (unsigned long long)seed, overtakers,
                 s->inversions, (unsigned long long)overtaken, strict ? " (strict)" : "");
    cover.released += ledger_get_stats(s->l)->released;
    ledger_free(s->l);
    free(s);
}

static void test_randomized(void **state)
{
    (void)state;
    const char *one = getenv("LEDGER_SEED");
    if (one != NULL) {
        uint64_t seed = strtoull(one, NULL, 10);
        sim_run(seed, seed % 4 == 0, true);
        printf("seed %llu ok\n", (unsigned long long)seed);
        return;
    }
    const char *ns = getenv("LEDGER_SEEDS");
    int n = ns ? atoi(ns) : 600;
    for (int i = 1; i <= n; i++) {
        /* a failing seed is named by fail_msg's output via the step counter; print it first */
        fprintf(stderr, "%s", "");
        uint64_t seed = (uint64_t)i;
        printf("\rseed %d", i);
        fflush(stdout);
        sim_run(seed, seed % 4 == 0, false);
    }
    printf("\n%d seeded runs ok (every 4th with ordering=strict)\n", n);
    printf("large payloads let go once written: %llu (%llu of them lost with the connection "
           "and given back, %llu nacked or returned, %llu in flight at a leadership lapse), "
           "%llu stream steps, %llu "
           "repeated on_written, %llu graceful stops, %llu rows expired unpublished, %llu held rows "
           "a claim passed over, %llu claims answered after a leadership lapse\n",
           (unsigned long long)cover.released, (unsigned long long)cover.lost_released,
           (unsigned long long)cover.refused_released,
           (unsigned long long)cover.lapses_released, (unsigned long long)cover.streamed,
           (unsigned long long)cover.rewritten, (unsigned long long)cover.stops,
           (unsigned long long)cover.expired, (unsigned long long)cover.held_passed,
           (unsigned long long)cover.late_claims);
}

int main(void)
{
    /* the ledger's log lines are noise here, except when reproducing one seed */
    if (getenv("LEDGER_TRACE") != NULL)
        trace_id = atol(getenv("LEDGER_TRACE"));
    if (getenv("LEDGER_SEED") != NULL)
        log_setup(LOG_DEBUG, CFG_LOG_TEXT, NULL);
    else
        log_setup(LOG_ERROR, CFG_LOG_TEXT, "/dev/null");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hot_key_pipelined),
        cmocka_unit_test(test_strict_one_in_flight),
        cmocka_unit_test(test_one_destination_at_a_time),
        cmocka_unit_test(test_refusal_blocks_key_until_settled),
        cmocka_unit_test(test_channel_close_republishes_in_order),
        cmocka_unit_test(test_written_payload_released),
        cmocka_unit_test(test_readopted_rows),
        cmocka_unit_test(test_deadline_gives_back),
        cmocka_unit_test(test_expire_without_publishing),
        cmocka_unit_test(test_memory_follows_work_in_flight),
        cmocka_unit_test(test_randomized),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
