/*
 * log_test.c — relay/log.c: rate-limited failure logging (log_fail_at /
 * log_ok_at with a fake monotonic clock) and the JSON encoding of a line's
 * fields (log_ev), read back from a log file. tests/test_relay_ops.py runs it;
 * with LOG_TEST_JSON_OUT=FILE every JSON line it read is also appended to FILE,
 * so that test parses each one with a real JSON parser.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "relay/log.h"

static char path[64];

static int setup(void **state)
{
    int fd;

    (void)state;
    snprintf(path, sizeof path, "/tmp/outbox-log-test-XXXXXX");
    fd = mkstemp(path);
    if (fd < 0)
        return -1;
    close(fd);
    log_setup(CFG_LOG_INFO, CFG_LOG_TEXT, path);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    log_setup(CFG_LOG_INFO, CFG_LOG_TEXT, NULL);
    unlink(path);
    return 0;
}

#define JSON_TS_PREFIX "{\"ts\":\"2026-01-01T00:00:00.000Z\","   /* its length, that is */

/* The log's lines so far, without timestamps, joined by '|': text "WARN msg",
 * JSON lines from "level" on ("\"level\":\"warn\",\"msg\":...}"). */
static char *lines(void)
{
    static char out[65536];
    static char ln[32768];
    FILE       *f = fopen(path, "r");
    const char *keep = getenv("LOG_TEST_JSON_OUT");

    out[0] = '\0';
    assert_non_null(f);
    while (fgets(ln, sizeof ln, f) != NULL) {
        char *rest;

        assert_non_null(strchr(ln, '\n'));   /* one whole line, no longer than ln */
        if (ln[0] == '{') {
            assert_true(strlen(ln) > strlen(JSON_TS_PREFIX));
            assert_memory_equal(ln, "{\"ts\":\"", 7);
            assert_memory_equal(ln + strlen(JSON_TS_PREFIX) - 2, "\",", 2);
            rest = ln + strlen(JSON_TS_PREFIX);
            if (keep != NULL) {
                FILE *k = fopen(keep, "a");

                assert_non_null(k);
                assert_true(fputs(ln, k) >= 0);
                assert_int_equal(fclose(k), 0);
            }
        } else {
            rest = strchr(ln, ' ');   /* after the timestamp */
            rest = rest ? rest + 1 : ln;
        }
        ln[strcspn(ln, "\n")] = '\0';
        if (out[0] != '\0')
            strncat(out, "|", sizeof out - strlen(out) - 1);
        strncat(out, rest, sizeof out - strlen(out) - 1);
    }
    fclose(f);
    if (truncate(path, 0) != 0)
        fail_msg("truncate %s", path);
    return out;
}

static void test_first_failure_then_rate_limited(void **state)
{
    log_limit ll;

    (void)state;
    memset(&ll, 0, sizeof ll);
    log_fail_at(&ll, 100.0, LOG_WARN, NULL, "broker b: login refused");
    assert_string_equal(lines(), "WARN broker b: login refused");
    /* identical repeats within the interval: not at WARN (debug is off) */
    for (int i = 1; i <= 11; i++)
        log_fail_at(&ll, 100.0 + 5.0 * i, LOG_WARN, NULL, "broker b: login refused");
    assert_string_equal(lines(), "");
    /* the interval is over: once more at WARN, with the count */
    log_fail_at(&ll, 100.0 + LOG_REPEAT_INTERVAL, LOG_WARN, NULL, "broker b: login refused");
    assert_string_equal(lines(), "WARN broker b: login refused (repeated 12 times in 60 s)");
    /* a different reason is news: at once */
    log_fail_at(&ll, 161.0, LOG_WARN, NULL, "broker b: connection refused");
    assert_string_equal(lines(), "WARN broker b: connection refused");
    /* recovery counts every failed attempt */
    log_ok_at(&ll, 162.0, LOG_INFO, NULL, "broker b connected");
    assert_string_equal(lines(), "INFO broker b connected after 14 failures");
    /* and starts afresh */
    log_ok_at(&ll, 163.0, LOG_INFO, NULL, "broker b connected");
    assert_string_equal(lines(), "INFO broker b connected");
    log_fail_at(&ll, 164.0, LOG_ERROR, NULL, "broker b: login refused");
    assert_string_equal(lines(), "ERROR broker b: login refused");
    log_ok_at(&ll, 165.0, LOG_INFO, NULL, "broker b connected");
    assert_string_equal(lines(), "INFO broker b connected after 1 failure");
}

/* A list of brokers tried in turn fails with one text per address: each is news
 * once, then a repeat, although it differs from the text just before it. */
static void test_rotating_reasons_are_repeats(void **state)
{
    static const char *const texts[3] = { "broker a:1: connection refused; next: broker b:2",
                                          "broker b:2: connection refused; next: broker c:3",
                                          "broker c:3: connection refused; next: broker a:1" };
    log_limit ll;

    (void)state;
    memset(&ll, 0, sizeof ll);
    for (int i = 0; i < 3; i++)
        log_fail_at(&ll, 100.0 + i, LOG_WARN, NULL, texts[i]);
    assert_string_equal(lines(), "WARN broker a:1: connection refused; next: broker b:2|"
                                 "WARN broker b:2: connection refused; next: broker c:3|"
                                 "WARN broker c:3: connection refused; next: broker a:1");
    for (int round = 1; round <= 10; round++)
        for (int i = 0; i < 3; i++)
            log_fail_at(&ll, 100.0 + 3 * round + i, LOG_WARN, NULL, texts[i]);
    assert_string_equal(lines(), "");
    /* each at level again once its own interval is over, with its count */
    log_fail_at(&ll, 160.0, LOG_WARN, NULL, texts[0]);
    assert_string_equal(lines(), "WARN broker a:1: connection refused; next: broker b:2 "
                                 "(repeated 11 times in 60 s)");
    /* more different texts than remembered: the oldest is forgotten, not a newer one */
    for (int i = 0; i < LOG_LIMIT_SEEN; i++) {
        char t[64];

        snprintf(t, sizeof t, "other reason %d", i);
        log_fail_at(&ll, 161.0 + i, LOG_WARN, NULL, t);
    }
    (void)lines();
    log_fail_at(&ll, 170.0, LOG_WARN, NULL, "other reason 7");
    assert_string_equal(lines(), "");
    log_ok_at(&ll, 171.0, LOG_INFO, NULL, "connected");
    assert_string_equal(lines(), "INFO connected after 43 failures");
    /* a success forgets them all */
    log_fail_at(&ll, 172.0, LOG_WARN, NULL, texts[1]);
    assert_string_equal(lines(), "WARN broker b:2: connection refused; next: broker c:3");
}

static void test_repeats_at_debug(void **state)
{
    log_limit ll;

    (void)state;
    memset(&ll, 0, sizeof ll);
    log_setup(CFG_LOG_DEBUG, CFG_LOG_TEXT, path);
    log_fail(&ll, LOG_WARN, NULL, "db %s: %s", "h:1/d", "down");
    log_fail(&ll, LOG_WARN, NULL, "db %s: %s", "h:1/d", "down");
    assert_string_equal(lines(), "WARN db h:1/d: down|DEBUG db h:1/d: down");
    log_ok(&ll, LOG_INFO, NULL, "db %s up", "h:1/d");
    assert_string_equal(lines(), "INFO db h:1/d up after 2 failures");
    log_setup(CFG_LOG_INFO, CFG_LOG_TEXT, path);
}

/* ------------------------------------------------------------ fields (log_ev) */

/* A dead letter with every field: text lines stay the message alone; JSON lines
 * carry each field, escaped: quotes, backslashes, control characters, DEL and
 * invalid UTF-8 (each bad byte becomes U+FFFD) in values and in the message. */
static void test_json_fields(void **state)
{
    (void)state;
    log_fields f = {
        .event = "dead_lettered", .outbox = "orders", .sink = "main", .id = 42,
        .message_id = "0b7f5f4e-6a52-4a0e-9d38-3c2b1b2b9b01",
        .partition_key = "k\"q\\b\n\r\t\b\f\x01\x1f\x7f caf\xc3\xa9 \xff\xc3 \xed\xa0\x80 end",
        .peer = "127.0.0.1:5672 vhost /",
        .error = "NOT_FOUND - no exchange 'x\"y'",
    };

    log_ev(LOG_ERROR, &f, "outbox=%s id=%d: dead-lettered: %s", "orders", 42, "why\x02");
    assert_string_equal(lines(), "ERROR outbox=orders id=42: dead-lettered: why\\x02");

    log_setup(CFG_LOG_INFO, CFG_LOG_JSON, path);
    log_ev(LOG_ERROR, &f, "outbox=%s id=%d: dead-lettered: %s", "orders", 42, "why\x02");
    assert_string_equal(lines(),
        "\"level\":\"error\",\"msg\":\"outbox=orders id=42: dead-lettered: why\\u0002\","
        "\"event\":\"dead_lettered\",\"outbox\":\"orders\",\"sink\":\"main\",\"id\":42,"
        "\"message_id\":\"0b7f5f4e-6a52-4a0e-9d38-3c2b1b2b9b01\","
        "\"partition_key\":\"k\\\"q\\\\b\\n\\r\\t\\b\\f\\u0001\\u001f\\u007f caf\xc3\xa9 "
        "\\ufffd\\ufffd \\ufffd\\ufffd\\ufffd end\","
        "\"peer\":\"127.0.0.1:5672 vhost /\","
        "\"error\":\"NOT_FOUND - no exchange 'x\\\"y'\"}");
    log_setup(CFG_LOG_INFO, CFG_LOG_TEXT, path);
}

/* Empty and absent fields are left out; no fields at all is the old line. */
static void test_json_fields_omitted(void **state)
{
    (void)state;
    log_setup(CFG_LOG_INFO, CFG_LOG_JSON, path);
    log_ev(LOG_WARN, &(log_fields){ .event = "retry", .outbox = "o", .partition_key = "",
                                    .message_id = NULL, .id = 0 }, "m");
    log_ev(LOG_INFO, NULL, "plain %d", 1);
    log_msg(LOG_INFO, "plain %d", 2);
    log_ev(LOG_INFO, &(log_fields){ 0 }, "plain %d", 3);
    log_ev(LOG_DEBUG, &(log_fields){ .event = "hidden" }, "below the level");
    assert_string_equal(lines(),
        "\"level\":\"warn\",\"msg\":\"m\",\"event\":\"retry\",\"outbox\":\"o\"}|"
        "\"level\":\"info\",\"msg\":\"plain 1\"}|"
        "\"level\":\"info\",\"msg\":\"plain 2\"}|"
        "\"level\":\"info\",\"msg\":\"plain 3\"}");
    /* a negative id is still an id (only 0 means none) */
    log_ev(LOG_INFO, &(log_fields){ .id = -7 }, "n");
    assert_string_equal(lines(), "\"level\":\"info\",\"msg\":\"n\",\"id\":-7}");
    log_setup(CFG_LOG_INFO, CFG_LOG_TEXT, path);
}

/* The rate limiter passes the fields on, to the repeat and to the recovery. */
static void test_json_limit_fields(void **state)
{
    log_limit ll;
    log_fields f = { .event = "broker_unavailable", .outbox = "o", .peer = "h:1",
                     .error = "refused" };
    log_fields ok = { .event = "broker_connected", .outbox = "o", .peer = "h:1" };

    (void)state;
    memset(&ll, 0, sizeof ll);
    log_setup(CFG_LOG_INFO, CFG_LOG_JSON, path);
    log_fail_at(&ll, 10.0, LOG_WARN, &f, "down: refused");
    log_fail_at(&ll, 20.0, LOG_WARN, &f, "down: refused");   /* at debug: not shown */
    log_fail_at(&ll, 10.0 + LOG_REPEAT_INTERVAL, LOG_WARN, &f, "down: refused");
    log_ok_at(&ll, 80.0, LOG_INFO, &ok, "connected");
    assert_string_equal(lines(),
        "\"level\":\"warn\",\"msg\":\"down: refused\",\"event\":\"broker_unavailable\","
        "\"outbox\":\"o\",\"peer\":\"h:1\",\"error\":\"refused\"}|"
        "\"level\":\"warn\",\"msg\":\"down: refused (repeated 2 times in 60 s)\","
        "\"event\":\"broker_unavailable\",\"outbox\":\"o\",\"peer\":\"h:1\",\"error\":\"refused\"}|"
        "\"level\":\"info\",\"msg\":\"connected after 3 failures\",\"event\":\"broker_connected\","
        "\"outbox\":\"o\",\"peer\":\"h:1\"}");
    log_fail(&ll, LOG_WARN, &f, "down: %s", "refused");
    log_ok(&ll, LOG_INFO, &ok, "%s", "connected");
    assert_string_equal(lines(),
        "\"level\":\"warn\",\"msg\":\"down: refused\",\"event\":\"broker_unavailable\","
        "\"outbox\":\"o\",\"peer\":\"h:1\",\"error\":\"refused\"}|"
        "\"level\":\"info\",\"msg\":\"connected after 1 failure\",\"event\":\"broker_connected\","
        "\"outbox\":\"o\",\"peer\":\"h:1\"}");
    log_setup(CFG_LOG_INFO, CFG_LOG_TEXT, path);
}

static bool ends_with(const char *s, const char *tail)
{
    size_t n = strlen(s), t = strlen(tail);
    return n >= t && memcmp(s + n - t, tail, t) == 0;
}

/* Values too long for a line are cut (ending in "...") without breaking an
 * escape or a UTF-8 sequence, and the line stays one valid JSON object that
 * still carries every field. */
static void test_json_long_values(void **state)
{
    static char big[20000];
    char       *got, *p;

    (void)state;
    /* 'é' (2 bytes) and '"' (escaped: 2 bytes) so a cut could fall inside either */
    for (size_t i = 0; i + 3 < sizeof big; i += 3)
        memcpy(big + i, i % 2 ? "\xc3\xa9\"" : "\"\xc3\xa9", 3);
    big[sizeof big - 1] = '\0';
    log_setup(CFG_LOG_INFO, CFG_LOG_JSON, path);
    log_ev(LOG_WARN, &(log_fields){ .event = "retry", .error = big, .peer = "p" }, "%s", big);
    got = lines();
    assert_true(strncmp(got, "\"level\":\"warn\",\"msg\":\"", 22) == 0);
    p = strstr(got, "...\",\"event\":\"retry\",\"peer\":\"p\",\"error\":\"");
    assert_non_null(p);
    assert_true(ends_with(got, "...\"}"));
    /* the cut falls between whole characters: "\"" or "é" before the "..." */
    assert_true(p[-1] == '"' || p[-1] == '\xa9');
    if (p[-1] == '"')
        assert_int_equal(p[-2], '\\');
    assert_true(strlen(got) < 16384);

    /* text lines: cut as before */
    log_setup(CFG_LOG_INFO, CFG_LOG_TEXT, path);
    log_ev(LOG_WARN, &(log_fields){ .event = "retry", .error = big }, "%s", big);
    got = lines();
    assert_true(strncmp(got, "WARN \"", 6) == 0);
    assert_true(ends_with(got, "..."));
    assert_true(strlen(got) < 8192 + 16);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_failure_then_rate_limited),
        cmocka_unit_test(test_rotating_reasons_are_repeats),
        cmocka_unit_test(test_repeats_at_debug),
        cmocka_unit_test(test_json_fields),
        cmocka_unit_test(test_json_fields_omitted),
        cmocka_unit_test(test_json_limit_fields),
        cmocka_unit_test(test_json_long_values),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
