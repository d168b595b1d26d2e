/*
 * lib_unit_test.c — cmocka unit tests for liboutbox internals: UUIDs, table-name
 * parsing, derived names, queue handles, error messages (UTF-8 and JSON escaping
 * are lib/util.c's: tests/c/util_test.c). Also a DDL printer for tests/test_schema.py:
 *
 *   lib_unit_test                                   run the unit tests
 *   lib_unit_test --print-ddl postgres|sqlserver [schema.table]
 *   lib_unit_test --parse SPEC                      prints schema/table/dead or the error
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/outbox_internal.h"
#include "outbox.h"
#include "outbox_schema.h"
#include "lib/outbox_pgsql.h"

/* ------------------------------------------------------------------ UUIDs */

static void uuid_format(void **state)
{
    (void)state;
    char a[37], b[37];
    for (int i = 0; i < 100; i++) {
        assert_int_equal(outbox_uuid_generate(a), OUTBOX_OK);
        assert_int_equal(strlen(a), 36);
        assert_true(outbox_i_uuid_valid(a));
        assert_int_equal(a[14], '4');                  /* version 4 */
        assert_non_null(strchr("89ab", a[19]));        /* RFC 4122 variant */
        for (int k = 0; k < 36; k++)
            assert_true(a[k] == '-' || (a[k] >= '0' && a[k] <= '9') ||
                        (a[k] >= 'a' && a[k] <= 'f'));
    }
    assert_int_equal(outbox_uuid_generate(b), OUTBOX_OK);
    assert_string_not_equal(a, b);

    assert_true(outbox_i_uuid_valid("00000000-0000-0000-0000-000000000000"));
    assert_true(outbox_i_uuid_valid("6F1C3C9E-3B9A-4D4E-9D7B-1B2A3C4D5E6F"));
    assert_false(outbox_i_uuid_valid(NULL));
    assert_false(outbox_i_uuid_valid(""));
    assert_false(outbox_i_uuid_valid("6f1c3c9e3b9a4d4e9d7b1b2a3c4d5e6f"));
    assert_false(outbox_i_uuid_valid("{6f1c3c9e-3b9a-4d4e-9d7b-1b2a3c4d5e6f}"));
    assert_false(outbox_i_uuid_valid("6f1c3c9e-3b9a-4d4e-9d7b-1b2a3c4d5e6"));
    assert_false(outbox_i_uuid_valid("6f1c3c9e-3b9a-4d4e-9d7b-1b2a3c4d5e6f "));
    assert_false(outbox_i_uuid_valid("6f1c3c9e-3b9a-4d4e-9d7b_1b2a3c4d5e6f"));
    assert_false(outbox_i_uuid_valid("6g1c3c9e-3b9a-4d4e-9d7b-1b2a3c4d5e6f"));
}

/* ------------------------------------------------------------ trace context */

static void trace_context(void **state)
{
    (void)state;
    /* the W3C spec's own examples */
    assert_true(outbox_i_traceparent_valid("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
    assert_true(outbox_i_traceparent_valid("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"));
    /* a later version may add fields after a "-" */
    assert_true(outbox_i_traceparent_valid("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz"));
    assert_true(outbox_i_traceparent_valid("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
    assert_false(outbox_i_traceparent_valid(""));
    assert_false(outbox_i_traceparent_valid("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-"));
    assert_false(outbox_i_traceparent_valid("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x"));
    assert_false(outbox_i_traceparent_valid("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
    assert_false(outbox_i_traceparent_valid("00-00000000000000000000000000000000-00f067aa0ba902b7-01"));
    assert_false(outbox_i_traceparent_valid("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"));
    assert_false(outbox_i_traceparent_valid("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"));
    assert_false(outbox_i_traceparent_valid("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01"));
    assert_false(outbox_i_traceparent_valid("00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
    assert_false(outbox_i_traceparent_valid("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g"));
    assert_false(outbox_i_traceparent_valid(" 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));

    assert_true(outbox_i_tracestate_valid("congo=t61rcWkgMzE"));
    assert_true(outbox_i_tracestate_valid("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"));
    assert_true(outbox_i_tracestate_valid("rojo=1 , congo=2 ,, "));
    assert_true(outbox_i_tracestate_valid("fw529a3039@dt=b, 1tenant@vendor=x"));
    assert_true(outbox_i_tracestate_valid(""));
    assert_false(outbox_i_tracestate_valid("Rojo=1"));
    assert_false(outbox_i_tracestate_valid("rojo"));
    assert_false(outbox_i_tracestate_valid("rojo="));
    assert_false(outbox_i_tracestate_valid("=1"));
    assert_false(outbox_i_tracestate_valid("rojo=a=b"));
    assert_false(outbox_i_tracestate_valid("rojo=\x01"));
    assert_false(outbox_i_tracestate_valid("t@Vendor=1"));
    assert_false(outbox_i_tracestate_valid("t@toolongsystemid=1"));
    char many[32 * 6 + 8] = "";
    for (int i = 0; i < 33; i++) {
        char m[8];
        snprintf(m, sizeof m, "%sk%c=1", i ? "," : "", 'a' + i % 26);
        if (strlen(many) + strlen(m) < sizeof many)
            strcat(many, m);
    }
    assert_false(outbox_i_tracestate_valid(many));     /* 33 members */
    char big[600];
    memset(big, 'v', sizeof big);
    memcpy(big, "k=", 2);
    big[sizeof big - 1] = '\0';
    assert_false(outbox_i_tracestate_valid(big));      /* over 512 bytes */
}

/* ------------------------------------------------------------ table names */

static void ident(void **state)
{
    (void)state;
    char s64[65], s63[64];
    memset(s64, 'a', 64); s64[64] = '\0';
    memset(s63, 'a', 63); s63[63] = '\0';
    assert_true(outbox_ident_valid("a"));
    assert_true(outbox_ident_valid("_x9"));
    assert_true(outbox_ident_valid("Messages_2"));
    assert_true(outbox_ident_valid(s63));
    assert_false(outbox_ident_valid(s64));
    assert_false(outbox_ident_valid(NULL));
    assert_false(outbox_ident_valid(""));
    assert_false(outbox_ident_valid("9a"));
    assert_false(outbox_ident_valid("a-b"));
    assert_false(outbox_ident_valid("a b"));
    assert_false(outbox_ident_valid("a;drop"));
    assert_false(outbox_ident_valid("\"x\""));
    assert_false(outbox_ident_valid("a.b"));
    assert_false(outbox_ident_valid("caf\xc3\xa9"));
}

static void table_parse(void **state)
{
    (void)state;
    outbox_table_name t;
    char err[200];
    assert_int_equal(outbox_table_parse(NULL, &t, err, sizeof err), 0);
    assert_string_equal(t.schema, "outbox");
    assert_string_equal(t.table, "messages");
    assert_string_equal(t.dead, "messages_dead");
    assert_int_equal(outbox_table_parse("", &t, err, sizeof err), 0);
    assert_string_equal(t.table, "messages");
    assert_int_equal(outbox_table_parse("jobs", &t, err, sizeof err), 0);
    assert_string_equal(t.schema, "outbox");
    assert_string_equal(t.table, "jobs");
    assert_int_equal(outbox_table_parse("App_1.Out_Box", &t, err, sizeof err), 0);
    assert_string_equal(t.schema, "App_1");
    assert_string_equal(t.table, "Out_Box");
    assert_string_equal(t.dead, "Out_Box_dead");

    char p63[64 + 64 + 2], p64[70];
    memset(p63, 'a', 63); p63[63] = '.'; memset(p63 + 64, 'b', 63); p63[127] = '\0';
    assert_int_equal(outbox_table_parse(p63, &t, err, sizeof err), 0);
    assert_int_equal(strlen(t.dead), 63);
    memset(p64, 'c', 64); p64[64] = '\0';

    static const struct { const char *spec, *why; } bad[] = {
        { "a;drop", "';'" },
        { "\"x\"", "'\"'" },
        { "a.b.c", "more than two parts" },
        { ".t", "empty schema" },
        { "s.", "empty table" },
        { ".", "empty schema" },
        { "a b", "0x20" },
        { "1abc", "digit" },
        { "s.9t", "digit" },
        { "[x]", "'['" },
        { "x\n", "0x0a" },
        { "caf\xc3\xa9", "0xc3" },
        { "a-b", "'-'" },
        { "s.t;", "';'" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        if (outbox_table_parse(bad[i].spec, &t, err, sizeof err) != -1)
            fail_msg("case %zu (%s) accepted", i, bad[i].spec);
        if (!strstr(err, bad[i].why) || strchr(err, '\n'))
            fail_msg("case %zu: reason \"%s\" lacks \"%s\"", i, err, bad[i].why);
    }
    assert_int_equal(outbox_table_parse(p64, &t, err, sizeof err), -1);
    assert_non_null(strstr(err, "64 bytes"));
    char s64[80];
    snprintf(s64, sizeof s64, "%s.t", p64);
    assert_int_equal(outbox_table_parse(s64, &t, err, sizeof err), -1);
    assert_non_null(strstr(err, "schema part is 64 bytes"));
}

static void qualified_and_derived(void **state)
{
    (void)state;
    outbox_table_name t;
    char err[200], out[160], d[64], d2[64];
    assert_int_equal(outbox_table_parse("app.events", &t, err, sizeof err), 0);
    outbox_qualified(OUTBOX_DIALECT_POSTGRES, &t, OUTBOX_TABLE_OUTBOX, out, sizeof out);
    assert_string_equal(out, "\"app\".\"events\"");
    outbox_qualified(OUTBOX_DIALECT_POSTGRES, &t, OUTBOX_TABLE_DEAD, out, sizeof out);
    assert_string_equal(out, "\"app\".\"events_dead\"");
    outbox_qualified(OUTBOX_DIALECT_SQLSERVER, &t, OUTBOX_TABLE_OUTBOX, out, sizeof out);
    assert_string_equal(out, "[app].[events]");
    outbox_qualified(OUTBOX_DIALECT_SQLSERVER, &t, OUTBOX_TABLE_DEAD, out, sizeof out);
    assert_string_equal(out, "[app].[events_dead]");
    outbox_qualified(OUTBOX_DIALECT_POSTGRES, &t, OUTBOX_TABLE_LEASE, out, sizeof out);
    assert_string_equal(out, "\"app\".\"events_lease\"");
    outbox_qualified(OUTBOX_DIALECT_SQLSERVER, &t, OUTBOX_TABLE_LEASE, out, sizeof out);
    assert_string_equal(out, "[app].[events_lease]");

    outbox_derived_name("events", "pending_idx", d);
    assert_string_equal(d, "events_pending_idx");

    char long_t[64];
    memset(long_t, 'x', 63); long_t[63] = '\0';
    outbox_derived_name(long_t, "pending_idx", d);
    assert_int_equal(strlen(d), 63);
    assert_true(outbox_ident_valid(d));
    assert_non_null(strstr(d, "_pending_idx"));
    outbox_derived_name(long_t, "pending_idx", d2);
    assert_string_equal(d, d2);                /* deterministic */
    outbox_derived_name(long_t, "sent_idx", d2);
    assert_string_not_equal(d, d2);            /* distinct per suffix */
    char long_u[64];
    memcpy(long_u, long_t, 64);
    long_u[62] = 'y';                          /* differs only past the kept prefix */
    outbox_derived_name(long_u, "pending_idx", d2);
    assert_string_not_equal(d, d2);            /* the hash tells them apart */
    /* exactly 63 fits unshortened */
    char t51[52];
    memset(t51, 'z', 51); t51[51] = '\0';
    outbox_derived_name(t51, "pending_idx", d);
    assert_int_equal(strlen(d), 63);
    assert_int_equal(strncmp(d, t51, 51), 0);
    assert_string_equal(d + 51, "_pending_idx");
}

static void ddl_shape(void **state)
{
    (void)state;
    outbox_table_name t;
    char err[200];
    assert_int_equal(outbox_table_parse("app.events", &t, err, sizeof err), 0);
    for (int d = 0; d < 2; d++) {
        char **v = outbox_ddl((outbox_dialect)d, &t);
        assert_non_null(v);
        size_t n = 0;
        for (char **p = v; *p; p++, n++) {
            size_t len = strlen(*p);
            assert_true(len > 0);
            assert_true((*p)[len - 1] != ';'); /* no trailing separator */
        }
        assert_true(n >= 5);
        outbox_ddl_free(v);
        char *s = outbox_ddl_script((outbox_dialect)d, &t);
        assert_non_null(s);
        assert_non_null(strstr(s, d ? "\nGO\n" : ";\n"));
        free(s);
    }
    assert_null(outbox_ddl(OUTBOX_DIALECT_POSTGRES, NULL));
    outbox_ddl_free(NULL);
    /* the statements' literal list of producer columns is the description's */
    char *cols = outbox_producer_columns();
    assert_non_null(cols);
    assert_string_equal(cols, OUTBOX_PRODUCER_COLS);
    free(cols);
}

/* ---------------------------------------------------------------- queues */

static void queue_handles(void **state)
{
    (void)state;
    outbox_queue *q = (outbox_queue *)0x1;
    outbox_error e;
    assert_int_equal(outbox_queue_new(&q, "Shop", NULL, &e), OUTBOX_OK);
    assert_int_equal(e.code, OUTBOX_OK);
    assert_string_equal(outbox_queue_database(q), "Shop");
    assert_string_equal(outbox_queue_schema(q), "outbox");
    assert_string_equal(outbox_queue_table(q), "messages");
    outbox_queue_free(q);

    char db[] = "mutable";
    assert_int_equal(outbox_queue_new(&q, db, "s.t", &e), OUTBOX_OK);
    db[0] = 'X'; /* the handle keeps its own copy */
    assert_string_equal(outbox_queue_database(q), "mutable");
    assert_string_equal(outbox_queue_schema(q), "s");
    outbox_queue_free(q);

    q = (outbox_queue *)0x1;
    assert_int_equal(outbox_queue_new(&q, "db", "a;drop", &e), OUTBOX_EINVAL);
    assert_null(q);
    assert_non_null(strstr(e.message, "table"));
    assert_int_equal(outbox_queue_new(&q, NULL, NULL, &e), OUTBOX_EINVAL);
    assert_non_null(strstr(e.message, "database"));
    assert_int_equal(outbox_queue_new(&q, "", NULL, &e), OUTBOX_EINVAL);
    assert_int_equal(outbox_queue_new(&q, "\xff", NULL, &e), OUTBOX_EINVAL);
    assert_int_equal(outbox_queue_new(NULL, "db", NULL, &e), OUTBOX_EINVAL);
    assert_int_equal(outbox_queue_new(&q, "db", NULL, NULL), OUTBOX_OK); /* err optional */
    outbox_queue_free(q);
    outbox_queue_free(NULL);
    assert_null(outbox_queue_database(NULL));
}

static void strerror_codes(void **state)
{
    (void)state;
    int codes[] = { OUTBOX_OK, OUTBOX_DUPLICATE, OUTBOX_EINVAL, OUTBOX_ENOTXN, OUTBOX_EDBNAME,
                    OUTBOX_ENOSCHEMA, OUTBOX_EDB, OUTBOX_ENOMEM, OUTBOX_ETXNLOST };
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        const char *s = outbox_strerror(codes[i]);
        assert_non_null(s);
        assert_string_not_equal(s, outbox_strerror(12345));   /* every code is known */
        for (size_t k = 0; k < i; k++)
            assert_string_not_equal(s, outbox_strerror(codes[k]));
    }
    assert_non_null(outbox_strerror(12345));
}

/* The PostgreSQL INSERT both of liboutbox's PostgreSQL paths send: numbered in message
   order, so the psqlODBC path's markers bind in parameter order. */
static void pg_insert_text(void **state)
{
    (void)state;
    char *sql = outbox_pg_insert_sql("\"s\".\"t\"", 3);
    assert_non_null(sql);
    assert_non_null(strstr(sql, "INSERT INTO \"s\".\"t\" (message_id, "));
    assert_non_null(strstr(sql, "$30::bigint"));
    assert_null(strstr(sql, "$31"));
    assert_non_null(strstr(sql, " ON CONFLICT DO NOTHING"));
    int order[40];
    size_t n = 0;
    char *q = outbox_sql_qmarks(sql, order, 40, &n);
    assert_non_null(q);
    assert_int_equal(n, 3 * OUTBOX_PG_INSERT_COLS);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(order[i], (int)i + 1);
    assert_null(strchr(q, '$'));
    assert_non_null(strstr(q, "'1 millisecond'"));   /* literals untouched */
    assert_null(outbox_sql_qmarks(sql, order, 29, &n));   /* more markers than room */
    free(q);
    free(sql);
}

static void error_one_line(void **state)
{
    (void)state;
    outbox_error e;
    char big[2000];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    big[509] = '\xc3'; /* a 2-byte sequence across the truncation point */
    big[510] = '\xa9';
    assert_int_equal(outbox_i_err(&e, OUTBOX_EDB, "P0999", "x\nline2\r\n\tend %s", big),
                     OUTBOX_EDB);
    assert_int_equal(e.code, OUTBOX_EDB);
    assert_string_equal(e.sqlstate, "P0999");
    assert_null(strchr(e.message, '\n'));
    assert_null(strchr(e.message, '\r'));
    assert_null(strchr(e.message, '\t'));
    assert_int_equal(outbox_util_utf8_check(e.message, strlen(e.message)), -1);
    assert_true(strncmp(e.message, "x line2 end ", 12) == 0);
    outbox_i_err(&e, OUTBOX_EINVAL, "TOOLONGSTATE", "y");
    assert_int_equal(strlen(e.sqlstate), 5);
    outbox_i_err(NULL, OUTBOX_EINVAL, NULL, "no crash");
}

/* --------------------------------------------------------------- printer */

static int print_ddl(const char *dialect, const char *spec)
{
    outbox_table_name t;
    char err[200];
    if (outbox_table_parse(spec, &t, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 2;
    }
    outbox_dialect d;
    if (strcmp(dialect, "postgres") == 0)
        d = OUTBOX_DIALECT_POSTGRES;
    else if (strcmp(dialect, "sqlserver") == 0)
        d = OUTBOX_DIALECT_SQLSERVER;
    else {
        fprintf(stderr, "dialect must be postgres or sqlserver\n");
        return 2;
    }
    char *s = outbox_ddl_script(d, &t);
    if (!s) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    fputs(s, stdout);
    free(s);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 3 && strcmp(argv[1], "--print-ddl") == 0)
        return print_ddl(argv[2], argc > 3 ? argv[3] : NULL);
    if (argc >= 3 && strcmp(argv[1], "--parse") == 0) {
        outbox_table_name t;
        char err[200];
        if (outbox_table_parse(argv[2], &t, err, sizeof err) != 0) {
            printf("error: %s\n", err);
            return 1;
        }
        printf("schema=%s table=%s dead=%s\n", t.schema, t.table, t.dead);
        return 0;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(uuid_format),
        cmocka_unit_test(trace_context),
        cmocka_unit_test(ident),
        cmocka_unit_test(table_parse),
        cmocka_unit_test(qualified_and_derived),
        cmocka_unit_test(ddl_shape),
        cmocka_unit_test(queue_handles),
        cmocka_unit_test(strerror_codes),
        cmocka_unit_test(pg_insert_text),
        cmocka_unit_test(error_one_line),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
