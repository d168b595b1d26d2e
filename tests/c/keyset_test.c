/* keyset_test.c — unit tests for relay/keyset.c (cmocka). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <cmocka.h>

#include "relay/keyset.h"

static void test_put_get_del(void **state)
{
    (void)state;
    keyset s = { 0 };
    int64_t v = 0;
    assert_false(keyset_get(&s, "a", &v));
    assert_int_equal(keyset_put(&s, "a", 1), 0);
    assert_int_equal(keyset_put(&s, "b", 2), 0);
    assert_true(keyset_get(&s, "a", &v));
    assert_int_equal(v, 1);
    assert_int_equal(keyset_put(&s, "a", 7), 0);   /* replace */
    assert_true(keyset_get(&s, "a", &v));
    assert_int_equal(v, 7);
    assert_int_equal(keyset_size(&s), 2);
    keyset_del(&s, "a");
    assert_false(keyset_get(&s, "a", NULL));
    assert_true(keyset_get(&s, "b", NULL));
    keyset_del(&s, "missing");
    assert_int_equal(keyset_size(&s), 1);
    keyset_clear(&s);
    assert_int_equal(keyset_size(&s), 0);
    assert_false(keyset_get(&s, "b", NULL));
}

/* Many keys, interleaved deletes: growth and tombstones keep every live key findable. */
static void test_many_with_tombstones(void **state)
{
    (void)state;
    keyset s = { 0 };
    char k[32];
    for (int i = 0; i < 5000; i++) {
        snprintf(k, sizeof k, "key-%d", i);
        assert_int_equal(keyset_put(&s, k, i), 0);
        if (i % 3 == 0) {
            snprintf(k, sizeof k, "key-%d", i / 2);
            keyset_del(&s, k);
        }
    }
    size_t live = 0;
    for (int i = 0; i < 5000; i++) {
        snprintf(k, sizeof k, "key-%d", i);
        int64_t v;
        if (keyset_get(&s, k, &v)) {
            assert_int_equal(v, i);
            live++;
        }
    }
    assert_int_equal(live, keyset_size(&s));
    size_t slots = 0;
    for (size_t i = 0; i < s.cap; i++)
        if (s.slots[i].key != NULL && s.slots[i].key != keyset_tomb)
            slots++;
    assert_int_equal(slots, live);
    keyset_clear(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_put_get_del),
        cmocka_unit_test(test_many_with_tombstones),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
