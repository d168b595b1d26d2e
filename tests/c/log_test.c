/*
 * log_test.c — relay/log.c's rate-limited failure logging (log_fail_at /
 * log_ok_at with a fake monotonic clock), read back from a log file.
 * tests/test_relay_ops.py runs it.
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

/* The log's lines so far, without timestamps ("WARN msg"), joined by '|'. */
static char *lines(void)
{
    static char out[8192];
    char        ln[2048];
    FILE       *f = fopen(path, "r");

    out[0] = '\0';
    assert_non_null(f);
    while (fgets(ln, sizeof ln, f) != NULL) {
        char *sp = strchr(ln, ' ');   /* after the timestamp */

        ln[strcspn(ln, "\n")] = '\0';
        if (out[0] != '\0')
            strncat(out, "|", sizeof out - strlen(out) - 1);
        strncat(out, sp ? sp + 1 : ln, sizeof out - strlen(out) - 1);
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
    log_fail_at(&ll, 100.0, LOG_WARN, "broker b: login refused");
    assert_string_equal(lines(), "WARN broker b: login refused");
    /* identical repeats within the interval: not at WARN (debug is off) */
    for (int i = 1; i <= 11; i++)
        log_fail_at(&ll, 100.0 + 5.0 * i, LOG_WARN, "broker b: login refused");
    assert_string_equal(lines(), "");
    /* the interval is over: once more at WARN, with the count */
    log_fail_at(&ll, 100.0 + LOG_REPEAT_INTERVAL, LOG_WARN, "broker b: login refused");
    assert_string_equal(lines(), "WARN broker b: login refused (repeated 12 times in 60 s)");
    /* a different reason is news: at once */
    log_fail_at(&ll, 161.0, LOG_WARN, "broker b: connection refused");
    assert_string_equal(lines(), "WARN broker b: connection refused");
    /* recovery counts every failed attempt */
    log_ok_at(&ll, 162.0, LOG_INFO, "broker b connected");
    assert_string_equal(lines(), "INFO broker b connected after 14 failures");
    /* and starts afresh */
    log_ok_at(&ll, 163.0, LOG_INFO, "broker b connected");
    assert_string_equal(lines(), "INFO broker b connected");
    log_fail_at(&ll, 164.0, LOG_ERROR, "broker b: login refused");
    assert_string_equal(lines(), "ERROR broker b: login refused");
    log_ok_at(&ll, 165.0, LOG_INFO, "broker b connected");
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
        log_fail_at(&ll, 100.0 + i, LOG_WARN, texts[i]);
    assert_string_equal(lines(), "WARN broker a:1: connection refused; next: broker b:2|"
                                 "WARN broker b:2: connection refused; next: broker c:3|"
                                 "WARN broker c:3: connection refused; next: broker a:1");
    for (int round = 1; round <= 10; round++)
        for (int i = 0; i < 3; i++)
            log_fail_at(&ll, 100.0 + 3 * round + i, LOG_WARN, texts[i]);
    assert_string_equal(lines(), "");
    /* each at level again once its own interval is over, with its count */
    log_fail_at(&ll, 160.0, LOG_WARN, texts[0]);
    assert_string_equal(lines(), "WARN broker a:1: connection refused; next: broker b:2 "
                                 "(repeated 11 times in 60 s)");
    /* more different texts than remembered: the oldest is forgotten, not a newer one */
    for (int i = 0; i < LOG_LIMIT_SEEN; i++) {
        char t[64];

        snprintf(t, sizeof t, "other reason %d", i);
        log_fail_at(&ll, 161.0 + i, LOG_WARN, t);
    }
    (void)lines();
    log_fail_at(&ll, 170.0, LOG_WARN, "other reason 7");
    assert_string_equal(lines(), "");
    log_ok_at(&ll, 171.0, LOG_INFO, "connected");
    assert_string_equal(lines(), "INFO connected after 43 failures");
    /* a success forgets them all */
    log_fail_at(&ll, 172.0, LOG_WARN, texts[1]);
    assert_string_equal(lines(), "WARN broker b:2: connection refused; next: broker c:3");
}

static void test_repeats_at_debug(void **state)
{
    log_limit ll;

    (void)state;
    memset(&ll, 0, sizeof ll);
    log_setup(CFG_LOG_DEBUG, CFG_LOG_TEXT, path);
    log_fail(&ll, LOG_WARN, "db %s: %s", "h:1/d", "down");
    log_fail(&ll, LOG_WARN, "db %s: %s", "h:1/d", "down");
    assert_string_equal(lines(), "WARN db h:1/d: down|DEBUG db h:1/d: down");
    log_ok(&ll, LOG_INFO, "db %s up", "h:1/d");
    assert_string_equal(lines(), "INFO db h:1/d up after 2 failures");
    log_setup(CFG_LOG_INFO, CFG_LOG_TEXT, path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_failure_then_rate_limited),
        cmocka_unit_test(test_rotating_reasons_are_repeats),
        cmocka_unit_test(test_repeats_at_debug),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
