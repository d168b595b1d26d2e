/*
 * pgsrc_version_test.c — cmocka unit test of the PostgreSQL source's server version
 * rule (pgsrc_server_version_ok): `outbox-relay check` refuses a server older than
 * PostgreSQL 12 with one line. The test servers are newer, so the refusing side is
 * tested here on the numbers PQserverVersion gives; tests/test_pg_version.py runs it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "sources/pg/pgsrc_int.h"

static void accepts_12_and_newer(void **state)
{
    (void)state;
    const int ok[] = { 120000, 120022, 130000, 150004, 160001, 170000 };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        char msg[256] = "untouched";
        assert_int_equal(pgsrc_server_version_ok(ok[i], msg, sizeof msg), 0);
        assert_string_equal(msg, "untouched");
    }
}

static void refuses_older_with_one_line(void **state)
{
    (void)state;
    const struct { int num; const char *shown; } old[] = {
        { 119999, "PostgreSQL 11.9999 (server_version_num 119999)" },
        { 110022, "PostgreSQL 11.22 (server_version_num 110022)" },
        { 100000, "PostgreSQL 10.0 (server_version_num 100000)" },
        { 90624, "PostgreSQL 9.6.24 (server_version_num 90624)" },
        { 0, "PostgreSQL of unknown version (server_version_num 0)" },
    };
    for (size_t i = 0; i < sizeof old / sizeof old[0]; i++) {
        char msg[256] = "";
        assert_int_equal(pgsrc_server_version_ok(old[i].num, msg, sizeof msg), -1);
        assert_non_null(strstr(msg, old[i].shown));
        assert_non_null(strstr(msg, "needs PostgreSQL 12 or newer"));
        assert_null(strchr(msg, '\n'));
    }
}

static void a_short_buffer_stays_terminated(void **state)
{
    (void)state;
    char msg[16];
    memset(msg, 'x', sizeof msg);
    assert_int_equal(pgsrc_server_version_ok(110022, msg, sizeof msg), -1);
    assert_int_equal(strlen(msg), sizeof msg - 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(accepts_12_and_newer),
        cmocka_unit_test(refuses_older_with_one_line),
        cmocka_unit_test(a_short_buffer_stays_terminated),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    printf("%zu test(s) run\n", sizeof tests / sizeof tests[0]);
    return rc;
}
