/*
 * sql_test.c — sources/sql_pg.c without a server: the `$n` → `?` conversion the
 * psqlODBC path runs every PostgreSQL statement through (markers inside quoted
 * literals and identifiers stay, a parameter used twice is bound twice, too many
 * markers are refused), that every statement numbers its parameters within what
 * its callers bind, and the array literals the values travel in; and that every
 * T-SQL statement of sources/sql_tsql.c declares its parameters exactly as its
 * parameter table says (one `DECLARE @name type = ?` per marker, in the table's
 * order, of the table's type and size). The statements' behaviour on a server is
 * tests/test_source_contract.py's (libpq, psqlODBC, Babelfish or SQL Server).
 * tests/test_unit_relay.py runs it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "sources/sql_pg.h"
#include "sources/sql_tsql.h"

static void t_qmarks(void **state)
{
    (void)state;
    int order[8];
    size_t n = 0;
    char *s = sql_pg_qmarks("SELECT $2::text, '$1 it''s', \"a$1\", $1, $2, $10 FROM t", order, 8, &n);
    assert_non_null(s);
    assert_string_equal(s, "SELECT ?::text, '$1 it''s', \"a$1\", ?, ?, ? FROM t");
    assert_int_equal(n, 4);
    assert_int_equal(order[0], 2);
    assert_int_equal(order[1], 1);
    assert_int_equal(order[2], 2);
    assert_int_equal(order[3], 10);
    free(s);
    /* no marker; a lone $ and $0 are no markers */
    s = sql_pg_qmarks("SELECT 1, $ , $0", order, 8, &n);
    assert_non_null(s);
    assert_string_equal(s, "SELECT 1, $ , $0");
    assert_int_equal(n, 0);
    free(s);
    /* more markers than room: refused */
    assert_null(sql_pg_qmarks("$1 $1 $1", order, 2, &n));
}

/* Every marker of a statement is within 1..nparams, and each of them is used. */
static void check_stmt(char *sql, int nparams)
{
    int order[64], seen[16] = {0};
    size_t n = 0;
    assert_non_null(sql);
    char *q = sql_pg_qmarks(sql, order, 64, &n);
    assert_non_null(q);
    for (size_t i = 0; i < n; i++) {
        assert_in_range(order[i], 1, nparams);
        seen[order[i]] = 1;
    }
    for (int k = 1; k <= nparams; k++)
        if (!seen[k])
            fail_msg("$%d unused in: %s", k, sql);
    assert_null(strchr(q, '$'));   /* no dollar quoting in these statements */
    free(q);
    free(sql);
}

static void t_statements(void **state)
{
    (void)state;
    cfg_outbox ob;
    sql_pg_names n;
    memset(&ob, 0, sizeof ob);
    snprintf(ob.schema_part, sizeof ob.schema_part, "app");
    snprintf(ob.table_part, sizeof ob.table_part, "outbox");
    snprintf(ob.dead_part, sizeof ob.dead_part, "outbox_dead");
    sql_pg_names_init(&ob, &n);
    assert_string_equal(n.table, "\"app\".\"outbox\"");
    assert_string_equal(n.dead, "\"app\".\"outbox_dead\"");
    assert_string_equal(n.lease, "\"app\".\"outbox_lease\"");
    check_stmt(sql_pg_lead(&n), 3);
    for (int form = 0; form <= (SQL_PG_CLAIM_WALK | SQL_PG_CLAIM_DELAYED_IDX); form++) {
        check_stmt(sql_pg_claim_bytes(&n, false, form), 12);
        check_stmt(sql_pg_claim_bytes(&n, true, form), 12);
        check_stmt(sql_pg_claim_sliced(&n, false, form), 12);
        check_stmt(sql_pg_claim_sliced(&n, true, form), 12);
    }
    check_stmt(sql_pg_floor_probe(&n), 3);
    for (int on_sent = 0; on_sent < 2; on_sent++) {
        check_stmt(sql_pg_settle_sent(&n, on_sent), 2);
        check_stmt(sql_pg_settle(&n, on_sent), 5);
    }
    check_stmt(sql_pg_cleanup(&n), 4);
    check_stmt(sql_pg_stats(&n, false), 0);
    check_stmt(sql_pg_stats(&n, true), 0);
    check_stmt(sql_pg_dead_list(&n), 0);
    check_stmt(sql_pg_dead_retry(&n), 1);
    check_stmt(sql_pg_dead_purge(&n), 1);
    check_stmt(sql_pg_tables_exist(), 4);
}

static void t_arrays(void **state)
{
    (void)state;
    src_outcome v[3] = {
        { .id = 1, .lease_token = 7, .kind = SRC_SENT },
        { .id = 2, .lease_token = 7, .kind = SRC_RETRY, .backoff_ms = 500,
          .reason = "say \"no\" \\ bad \xff end" },
        { .id = 3, .lease_token = 8, .kind = SRC_DEAD, .backoff_ms = -5, .reason = "x" },
    };
    outbox_util_buf a[5];
    assert_int_equal(sql_pg_settle_arrays(v, 3, a), 0);
    assert_string_equal(a[0].p, "{1,2,3}");
    assert_string_equal(a[1].p, "{7,7,8}");
    assert_string_equal(a[2].p, "{0,1,2}");
    assert_string_equal(a[3].p, "{0,500,0}");
    assert_string_equal(a[4].p, "{NULL,\"say \\\"no\\\" \\\\ bad \xef\xbf\xbd end\",\"x\"}");
    for (int k = 0; k < 5; k++)
        outbox_util_buf_free(&a[k]);
    /* cut on a character boundary: "é" is two bytes, 3 bytes of room keep one */
    outbox_util_buf b = {0};
    sql_pg_array_elem(&b, "\xc3\xa9\xc3\xa9", 3);
    assert_string_equal(b.p, "\"\xc3\xa9\"");
    outbox_util_buf_free(&b);
    char *ids = NULL;
    assert_int_equal(sql_pg_id_array(NULL, 0, &ids), 0);
    assert_null(ids);
    int64_t x[2] = { 5, -1 };
    assert_int_equal(sql_pg_id_array(x, 2, &ids), 0);
    assert_string_equal(ids, "{5,-1}");
    free(ids);
}

/* The T-SQL type a parameter table entry binds. */
static const char *tsql_type(const sql_tsql_param *p)
{
    if (p->ctype == SQL_C_SBIGINT && p->stype == SQL_BIGINT)
        return "bigint";
    if (p->ctype == SQL_C_SLONG && p->stype == SQL_INTEGER)
        return "int";
    if (p->ctype == SQL_C_WCHAR && p->stype == SQL_WVARCHAR && p->size == 255)
        return "nvarchar(255)";
    if (p->ctype == SQL_C_WCHAR && p->stype == SQL_WVARCHAR && p->size == 0)
        return "nvarchar(max)";
    return NULL;
}

/* Checks one statement against its table: 0, or -1 with why[] filled. */
static int tsql_check(const sql_tsql_stmt *st, char *why, size_t wl)
{
    size_t k = 0;
    for (const char *p = st->text; *p; p++) {
        if (*p == '\'') {                       /* skip string literals ('' inside) */
            for (p++; *p && !(*p == '\'' && p[1] != '\''); p += (*p == '\'' ? 2 : 1))
                ;
            if (!*p)
                break;
            continue;
        }
        if (*p == '[') {                        /* and [identifiers] */
            while (*p && *p != ']')
                p++;
            if (!*p)
                break;
            continue;
        }
        if (*p != '?')
            continue;
        if (k >= st->n_params) {
            snprintf(why, wl, "%s: marker %zu has no entry in its parameter table (%zu)",
                     st->name, k + 1, st->n_params);
            return -1;
        }
        const sql_tsql_param *t = &st->params[k];
        const char *type = tsql_type(t);
        char want[160];
        snprintf(want, sizeof want, "@%s %s = ?", t->name, type ? type : "(unknown type)");
        size_t wlen = strlen(want);
        if (!type || (size_t)(p - st->text) + 1 < wlen ||
            strncmp(p + 1 - wlen, want, wlen) != 0) {
            snprintf(why, wl, "%s: marker %zu is not declared as \"%s\" (its table's entry)",
                     st->name, k + 1, want);
            return -1;
        }
        k++;
    }
    if (k != st->n_params) {
        snprintf(why, wl, "%s: %zu markers, %zu entries in its parameter table", st->name, k,
                 st->n_params);
        return -1;
    }
    return 0;
}

static void t_tsql_parameter_tables(void **state)
{
    (void)state;
    char why[256];
    size_t n = 0;
    for (const sql_tsql_stmt *const *st = sql_tsql_all; *st; st++, n++)
        if (tsql_check(*st, why, sizeof why) < 0)
            fail_msg("%s", why);
    assert_true(n >= 15);
    assert_int_equal(sql_tsql_claim.n_params, 9);
    /* the check is not vacuous: epoch and token swapped in the claim's table, a
       table one entry short, a size that differs from the declaration */
    sql_tsql_param swapped[9];
    memcpy(swapped, sql_tsql_claim.params, sizeof swapped);
    sql_tsql_param x = swapped[1];
    swapped[1] = swapped[3];
    swapped[3] = x;
    assert_string_equal(swapped[3].name, "epoch");
    sql_tsql_stmt bad = sql_tsql_claim;
    bad.params = swapped;
    assert_int_equal(tsql_check(&bad, why, sizeof why), -1);
    assert_non_null(strstr(why, "marker 2"));
    bad = sql_tsql_claim;
    bad.n_params = 8;
    assert_int_equal(tsql_check(&bad, why, sizeof why), -1);
    memcpy(swapped, sql_tsql_claim.params, sizeof swapped);
    swapped[2].size = 0;   /* owner as nvarchar(max): declared nvarchar(255) */
    bad.params = swapped;
    bad.n_params = 9;
    assert_int_equal(tsql_check(&bad, why, sizeof why), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_qmarks),
        cmocka_unit_test(t_statements),
        cmocka_unit_test(t_arrays),
        cmocka_unit_test(t_tsql_parameter_tables),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
