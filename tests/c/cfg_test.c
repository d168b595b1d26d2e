/*
 * cfg_test.c — unit tests for config/cfg.c, relay/log.c and relay/row.c (cmocka).
 *
 *   cfg_test                 run the unit tests
 *   cfg_test --load FILE     load FILE: print each error line to stdout and exit 1,
 *                            or print a normalized dump of the config and exit 0
 *                            (driven by tests/test_config.py)
 *   cfg_test --diff OLD NEW  what a reload from OLD to NEW does to each outbox: one line
 *                            "NAME: unchanged|changed|added|removed" (cfg_outbox_equal)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config/cfg.h"
#include "relay/log.h"
#include "sinks/rabbitmq/amqpcfg.h"
#include "sinks/sinks.h"
#include "sources/sources.h"
#include "relay/row.h"

/* ------------------------------------------------------------------ */
/* --load: the normalized dump                                         */
/* ------------------------------------------------------------------ */

static const char *b2s(bool b) { return b ? "true" : "false"; }
static const char *s2s(const char *s) { return s ? s : ""; }
static const char *secret(const char *s) { return s ? "<secret>" : ""; }

static void dump(const cfg *c)
{
    static const char *const fmts[] = { "text", "json" };
    static const char *const sent[] = { "mark", "delete" };
    static const char *const modes[] = { "leader", "competing" };
    static const char *const orderings[] = { "pipelined", "strict" };

    printf("[relay]\n");
    printf("name = %s\n", s2s(c->relay.name));
    printf("log_level = %s\n", cfg_log_level_name(c->relay.log_level));
    printf("log_format = %s\n", fmts[c->relay.log_format]);
    printf("log_file = %s\n", s2s(c->relay.log_file));
    printf("http_listen = %s\n", s2s(c->relay.http_listen));
    printf("shutdown_timeout = %lldms\n", (long long)c->relay.shutdown_timeout_ms);
    if (c->relay.max_rows_in_memory == 0)
        printf("max_rows_in_memory = auto\n");
    else
        printf("max_rows_in_memory = %d\n", c->relay.max_rows_in_memory);
    printf("max_bytes_in_memory = %zu\n", c->relay.max_bytes_in_memory);
    for (size_t i = 0; i < c->n_sinks; i++) {
        const cfg_sink *s = &c->sinks[i];
        const amqpsink_conf *a = amqpsink_conf_of(s);
        printf("[sink.%s]\n", s->name);
        printf("type = %s\n", s->type->name);
        printf("url = %s\n", secret(s->url));
        printf("password_file = %s\n", secret(s->password));
        printf("publish_window = %d\n", s->publish_window);
        printf("heartbeat = %lldms\n", (long long)a->heartbeat_ms);
        printf("confirm_timeout = %lldms\n", (long long)s->confirm_timeout_ms);
        printf("connect_timeout = %lldms\n", (long long)s->connect_timeout_ms);
        printf("reconnect_max = %lldms\n", (long long)s->reconnect_max_ms);
        printf("max_message_size = %zu\n", s->max_message_size);
        printf("confirms = %s\n", b2s(s->confirms));
        printf("mandatory = %s\n", b2s(a->mandatory));
        printf("tls_ca_file = %s\n", s2s(a->tls_ca_file));
        printf("tls_verify = %s\n", b2s(a->tls_verify));
        printf("tls_cert = %s\n", s2s(a->tls_cert));
        printf("tls_key = %s\n", s2s(a->tls_key));
        printf("nack_reopen = %lldms\n", (long long)a->nack_reopen_ms);
        printf("url.host = %s\n", s2s(a->host));
        printf("url.port = %d\n", a->port);
        printf("url.user = %s\n", s2s(a->user));
        printf("url.pass = %s\n", secret(a->pass));
        printf("url.vhost = %s\n", s2s(a->vhost));
        printf("url.tls = %s\n", b2s(a->tls));
        printf("url.brokers = ");
        for (size_t k = 0; k < a->n_brokers; k++)
            printf("%s%s", k ? "," : "", a->brokers[k].addr);
        printf("\n");
    }
    for (size_t i = 0; i < c->n_outboxes; i++) {
        const cfg_outbox *o = &c->outboxes[i];
        printf("[outbox.%s]\n", o->name);
        printf("source = %s\n", o->source->name);
        printf("conninfo = %s\n", secret(o->conninfo));
        printf("password_file = %s\n", secret(o->password));
        printf("database = %s\n", s2s(o->database));
        printf("table = %s\n", s2s(o->table));
        printf("sink = %s\n", s2s(o->sink_name));
        printf("batch_size = %d\n", o->batch_size);
        if (o->poll_interval_ms == 0)
            printf("poll_interval = auto\n");
        else
            printf("poll_interval = %lldms\n", (long long)o->poll_interval_ms);
        printf("lease = %lldms\n", (long long)o->lease_ms);
        printf("max_attempts = %d\n", o->max_attempts);
        printf("retry_backoff = %lldms\n", (long long)o->retry_backoff_ms);
        printf("retry_backoff_max = %lldms\n", (long long)o->retry_backoff_max_ms);
        printf("on_sent = %s\n", sent[o->on_sent]);
        printf("retention = %lldms\n", (long long)o->retention_ms);
        printf("cleanup_batch = %d\n", o->cleanup_batch);
        printf("cleanup_interval = %lldms\n", (long long)o->cleanup_interval_ms);
        printf("claim_delay = %lldms\n", (long long)o->claim_delay_ms);
        printf("health_interval = %lldms\n", (long long)o->health_interval_ms);
        printf("horizon_warn = %lldms\n", (long long)o->horizon_warn_ms);
        printf("mode = %s\n", modes[o->mode]);
        printf("ordering = %s\n", orderings[o->ordering]);
        printf("query_timeout = %lldms\n", (long long)o->query_timeout_ms);
        printf("connect_timeout = %lldms\n", (long long)o->connect_timeout_ms);
        printf("reconnect_max = %lldms\n", (long long)o->reconnect_max_ms);
        printf("table.schema = %s\n", o->schema_part);
        printf("table.table = %s\n", o->table_part);
        printf("table.dead = %s\n", o->dead_part);
        printf("sink.resolved = %s\n", o->sink ? o->sink->name : "");
    }
}

static int load_mode(const char *path)
{
    cfg *c = NULL;
    cfg_errors e = { 0 };

    if (cfg_load(path, &c, &e) < 0) {
        for (size_t i = 0; i < e.n; i++)
            printf("%s\n", e.lines[i]);
        cfg_errors_clear(&e);
        return 1;
    }
    dump(c);
    cfg_free(c);
    return 0;
}

static int diff_mode(const char *old_path, const char *new_path)
{
    cfg *a = NULL, *b = NULL;
    cfg_errors e = { 0 };
    int rc = 1;

    if (cfg_load(old_path, &a, &e) < 0 || cfg_load(new_path, &b, &e) < 0) {
        for (size_t i = 0; i < e.n; i++)
            printf("%s\n", e.lines[i]);
        goto out;
    }
    for (size_t i = 0; i < b->n_outboxes; i++) {
        const cfg_outbox *nb = &b->outboxes[i], *ob = NULL;
        for (size_t j = 0; j < a->n_outboxes; j++)
            if (strcmp(a->outboxes[j].name, nb->name) == 0)
                ob = &a->outboxes[j];
        printf("%s: %s\n", nb->name, ob == NULL ? "added" : cfg_outbox_equal(ob, nb) ? "unchanged"
               : "changed");
    }
    for (size_t j = 0; j < a->n_outboxes; j++) {
        bool found = false;
        for (size_t i = 0; i < b->n_outboxes; i++)
            found = found || strcmp(a->outboxes[j].name, b->outboxes[i].name) == 0;
        if (!found)
            printf("%s: removed\n", a->outboxes[j].name);
    }
    rc = 0;
out:
    cfg_errors_clear(&e);
    cfg_free(a);
    cfg_free(b);
    return rc;
}

/* ------------------------------------------------------------------ */
/* helpers                                                             */
/* ------------------------------------------------------------------ */

static char tmpdir[64];

static char *tmp_write(const char *name, const char *text)
{
    char *path = NULL;
    FILE *f;

    assert_true(asprintf(&path, "%s/%s", tmpdir, name) > 0);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
    return path;   /* caller frees */
}

static void rm_rf_tmp(void)
{
    char cmd[128];

    if (tmpdir[0]) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0)
            fprintf(stderr, "cannot remove %s\n", tmpdir);
    }
}

/* Loads text as a file; returns the cfg (or NULL with e filled). */
static cfg *load_text(const char *text, cfg_errors *e, char **pathp)
{
    cfg *c = NULL;
    char *path = tmp_write("t.ini", text);

    cfg_load(path, &c, e);
    if (pathp)
        *pathp = path;
    else
        free(path);
    return c;
}

static void print_errs(const cfg_errors *e)
{
    for (size_t i = 0; i < e->n; i++)
        print_message("  err: %s\n", e->lines[i]);
}

/* ------------------------------------------------------------------ */
/* scalar parsers                                                      */
/* ------------------------------------------------------------------ */

static void t_duration(void **st)
{
    int64_t v;
    static const struct { const char *s; int64_t ms; } ok[] = {
        { "250ms", 250 }, { "1s", 1000 }, { "5m", 300000 }, { "2h", 7200000 },
        { "7d", 604800000 }, { "10", 10000 }, { "0", 0 }, { "0ms", 0 },
        { "010", 10000 },             /* decimal, never octal */
        { "106751991167d", 106751991167LL * 86400000LL },
    };
    static const char *const bad[] = {
        "", "1e3", " 5s", "5 s", "5s ", "-1s", "+5s", "5S", "5sec", "1.5s", "0x10", "s",
        "ms", "5ms5", "106751991168d", "99999999999999999999", "9223372036854775807s", "5d ",
    };
    (void)st;
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        v = -1;
        assert_int_equal(cfg_parse_duration_ms(ok[i].s, &v), 0);
        assert_true(v == ok[i].ms);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        v = 4242;
        if (cfg_parse_duration_ms(bad[i], &v) == 0)
            fail_msg("duration \"%s\" accepted as %lld", bad[i], (long long)v);
        assert_true(v == 4242);   /* untouched on error */
    }
    assert_int_equal(cfg_parse_duration_ms(NULL, &v), -1);
}

static void t_int(void **st)
{
    int64_t v;
    (void)st;

    assert_int_equal(cfg_parse_int("010", 0, 100, &v), 0);
    assert_true(v == 10);
    assert_int_equal(cfg_parse_int("-5", -10, 10, &v), 0);
    assert_true(v == -5);
    assert_int_equal(cfg_parse_int("0", 0, 0, &v), 0);
    assert_int_equal(cfg_parse_int("9223372036854775807", 0, INT64_MAX, &v), 0);
    assert_true(v == INT64_MAX);
    assert_int_equal(cfg_parse_int("-9223372036854775808", INT64_MIN, 0, &v), 0);
    assert_true(v == INT64_MIN);
    static const char *const bad[] = {
        "", "abc", "10abc", "010abc", " 1", "1 ", "+1", "0x10", "1e3", "1.0", "-", "--1", "- 1",
        "9223372036854775808", "-9223372036854775809", "99999999999999999999999",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        v = 4242;
        if (cfg_parse_int(bad[i], INT64_MIN, INT64_MAX, &v) == 0)
            fail_msg("int \"%s\" accepted as %lld", bad[i], (long long)v);
        assert_true(v == 4242);
    }
    /* bounds */
    assert_int_equal(cfg_parse_int("0", 1, 10, &v), -1);
    assert_int_equal(cfg_parse_int("11", 1, 10, &v), -1);
    assert_int_equal(cfg_parse_int("-1", 0, 10, &v), -1);
    assert_int_equal(cfg_parse_int("10", 1, 10, &v), 0);
    assert_int_equal(cfg_parse_int(NULL, 1, 10, &v), -1);
}

static void t_bool(void **st)
{
    bool b;
    static const char *const t[] = { "true", "yes", "on", "1", "TRUE", "Yes", "ON" };
    static const char *const f[] = { "false", "no", "off", "0", "False", "NO", "Off" };
    static const char *const bad[] = { "", "2", "tru", "y", "n", " true", "true ", "enable", "t", "f", "01" };
    (void)st;
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        b = false;
        assert_int_equal(cfg_parse_bool(t[i], &b), 0);
        assert_true(b);
    }
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        b = true;
        assert_int_equal(cfg_parse_bool(f[i], &b), 0);
        assert_false(b);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (cfg_parse_bool(bad[i], &b) == 0)
            fail_msg("bool \"%s\" accepted", bad[i]);
    assert_int_equal(cfg_parse_bool(NULL, &b), -1);
}

static void t_size(void **st)
{
    size_t v;
    (void)st;
    assert_int_equal(cfg_parse_size("1024", &v), 0);
    assert_true(v == 1024);
    assert_int_equal(cfg_parse_size("64k", &v), 0);
    assert_true(v == 65536);
    assert_int_equal(cfg_parse_size("64K", &v), 0);
    assert_true(v == 65536);
    assert_int_equal(cfg_parse_size("16M", &v), 0);
    assert_true(v == 16u * 1024 * 1024);
    assert_int_equal(cfg_parse_size("1G", &v), 0);
    assert_true(v == 1024u * 1024 * 1024);
    assert_int_equal(cfg_parse_size("0", &v), 0);
    assert_true(v == 0);
    assert_int_equal(cfg_parse_size("010", &v), 0);
    assert_true(v == 10);
    static const char *const bad[] = {
        "", "1T", "1kb", "1KB", "-1", "1.5M", " 1k", "1 k", "1k ", "k", "0x10", "1e3",
        "99999999999999999999", "17179869184G", "+1",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        v = 4242;
        if (cfg_parse_size(bad[i], &v) == 0)
            fail_msg("size \"%s\" accepted as %zu", bad[i], v);
        assert_true(v == 4242);
    }
}

/* ------------------------------------------------------------------ */
/* AMQP URLs                                                           */
/* ------------------------------------------------------------------ */


static void t_amqp_url_ok(void **st)
{
    amqpsink_conf s;
    char err[200];
    (void)st;

    memset(&s, 0, sizeof s);
    assert_int_equal(amqpsink_url_parse("amqp://guest:guest@127.0.0.1:5672/%2f", &s, err, sizeof err), 0);
    assert_string_equal(s.host, "127.0.0.1");
    assert_int_equal(s.port, 5672);
    assert_string_equal(s.user, "guest");
    assert_string_equal(s.pass, "guest");
    assert_string_equal(s.vhost, "/");
    assert_false(s.tls);

    /* re-parse into the same sink: old strings freed (valgrind/ASan check it) */
    assert_int_equal(amqpsink_url_parse("amqps://broker.example.com", &s, err, sizeof err), 0);
    assert_string_equal(s.host, "broker.example.com");
    assert_int_equal(s.port, 5671);
    assert_true(s.tls);
    assert_string_equal(s.user, "guest");
    assert_string_equal(s.pass, "guest");
    assert_string_equal(s.vhost, "/");

    assert_int_equal(amqpsink_url_parse("AMQPS://h:1234/", &s, err, sizeof err), 0);
    assert_int_equal(s.port, 1234);
    assert_true(s.tls);
    assert_string_equal(s.vhost, "/");   /* empty path segment → "/" */

    assert_int_equal(amqpsink_url_parse("amqp://us%40er:p%3Ass%2Fw%25rd@h/my%20vhost", &s, err, sizeof err), 0);
    assert_string_equal(s.user, "us@er");
    assert_string_equal(s.pass, "p:ss/w%rd");
    assert_string_equal(s.vhost, "my vhost");
    assert_int_equal(s.port, 5672);

    assert_int_equal(amqpsink_url_parse("amqp://u:a:b@h/a%2Fb", &s, err, sizeof err), 0);
    assert_string_equal(s.pass, "a:b");
    assert_string_equal(s.vhost, "a/b");

    assert_int_equal(amqpsink_url_parse("amqp://alice@h", &s, err, sizeof err), 0);
    assert_string_equal(s.user, "alice");
    assert_string_equal(s.pass, "guest");

    assert_int_equal(amqpsink_url_parse("amqp://u:@h/v", &s, err, sizeof err), 0);
    assert_string_equal(s.pass, "");
    assert_string_equal(s.vhost, "v");

    assert_int_equal(amqpsink_url_parse("amqp://[::1]:5673/prod", &s, err, sizeof err), 0);
    assert_string_equal(s.host, "::1");
    assert_int_equal(s.port, 5673);
    assert_string_equal(s.vhost, "prod");

    assert_int_equal(amqpsink_url_parse("amqps://u:p@[fe80::1:2]", &s, err, sizeof err), 0);
    assert_string_equal(s.host, "fe80::1:2");
    assert_int_equal(s.port, 5671);

    /* percent-encoded UTF-8 in the user and the vhost (rabbitmq-c's amqp_parse_url
       refuses any %XX above %7F, and cuts a name at %00 without a word: see amqpcfg.c) */
    assert_int_equal(amqpsink_url_parse("amqp://us%C3%A9r:p@h/v%C3%A9", &s, err, sizeof err), 0);
    assert_string_equal(s.user, "us\xc3\xa9r");
    assert_string_equal(s.vhost, "v\xc3\xa9");
    amqpsink_conf_clear(&s);
}

static void t_amqp_url_bad(void **st)
{
    static const struct { const char *url, *why; } bad[] = {
        { "http://h/", "unsupported scheme" },
        { "amqp:/h", "unsupported scheme" },
        { "", "empty" },
        { "amqp://", "missing host" },
        { "amqp:///vh", "missing host" },
        { "amqp://u:p@/vh", "missing host" },
        { "amqp://h:0", "bad port" },
        { "amqp://h:65536", "bad port" },
        { "amqp://h:abc", "bad port" },
        { "amqp://h:", "bad port" },
        { "amqp://h:-1", "bad port" },
        { "amqp://h:+1", "bad port" },
        { "amqp://::1/", "brackets" },
        { "amqp://[::1", "unterminated" },
        { "amqp://[::1]x", "after ]" },
        { "amqp://[1.2.3.4]/", "not an IPv6" },
        { "amqp://h/a/b", "single path segment" },
        { "amqp://h?heartbeat=10", "query" },
        { "amqp://h/v?x=1", "query" },
        { "amqp://h/v#frag", "fragment" },
        { "amqp://u:p@x@h", "%40" },
        { "amqp://u:p%zz@h", "percent-encoding" },
        { "amqp://u:p%2@h", "percent-encoding" },
        { "amqp://h/%", "percent-encoding" },
        { "amqp://u:p%00@h", "NUL" },
        { "amqp://:p@h", "empty user" },
        { "amqp://h st/", "whitespace" },
        { "amqp://h/\tv", "whitespace" },
        { "amqp://h%41/", "bad character" },
    };
    amqpsink_conf s;
    char err[200];
    (void)st;

    memset(&s, 0, sizeof s);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        if (amqpsink_url_parse(bad[i].url, &s, err, sizeof err) == 0)
            fail_msg("URL \"%s\" accepted", bad[i].url);
        if (!strstr(err, bad[i].why))
            fail_msg("URL \"%s\": reason \"%s\" lacks \"%s\"", bad[i].url, err, bad[i].why);
        assert_null(s.host);   /* untouched on error */
    }
    assert_int_equal(amqpsink_url_parse(NULL, &s, err, sizeof err), -1);
}

static void t_amqp_url_list_ok(void **st)
{
    amqpsink_conf s;
    char err[400];
    (void)st;

    memset(&s, 0, sizeof s);
    /* one URL: one address, as before lists */
    assert_int_equal(amqpsink_urls_parse("amqps://u:p@[::1]/v", &s, err, sizeof err), 0);
    assert_int_equal(s.n_brokers, 1);
    assert_string_equal(s.brokers[0].host, "::1");
    assert_int_equal(s.brokers[0].port, 5671);
    assert_string_equal(s.brokers[0].addr, "[::1]:5671");

    /* a list: every address in order, spaces around the commas; the rest is common */
    assert_int_equal(amqpsink_urls_parse("amqp://relay:pw@n1:5672/prod , amqp://relay:pw@n2/prod,"
                                         "\tamqp://relay:pw@[fe80::2]:5673/prod", &s, err,
                                         sizeof err), 0);
    assert_int_equal(s.n_brokers, 3);
    assert_string_equal(s.brokers[0].addr, "n1:5672");
    assert_string_equal(s.brokers[1].addr, "n2:5672");
    assert_string_equal(s.brokers[2].addr, "[fe80::2]:5673");
    assert_string_equal(s.brokers[2].host, "fe80::2");
    assert_int_equal(s.brokers[2].port, 5673);
    assert_string_equal(s.host, "n1");   /* the first URL's */
    assert_int_equal(s.port, 5672);
    assert_string_equal(s.user, "relay");
    assert_string_equal(s.pass, "pw");
    assert_string_equal(s.vhost, "prod");
    assert_false(s.tls);

    /* defaults apply per URL: guest:guest, "/" and the scheme's port */
    assert_int_equal(amqpsink_urls_parse("amqps://a,amqps://b:5671/%2f", &s, err, sizeof err), 0);
    assert_int_equal(s.n_brokers, 2);
    assert_string_equal(s.brokers[1].addr, "b:5671");
    assert_true(s.tls);

    /* the same host on other ports is another node (one machine, one cluster) */
    assert_int_equal(amqpsink_urls_parse("amqp://h:1,amqp://h:2,amqp://h:3,amqp://h:4,amqp://h:5,"
                                         "amqp://h:6,amqp://h:7,amqp://h:8,amqp://h:9,amqp://h:10,"
                                         "amqp://h:11,amqp://h:12,amqp://h:13,amqp://h:14,"
                                         "amqp://h:15,amqp://h:16", &s, err, sizeof err), 0);
    assert_int_equal(s.n_brokers, AMQPSINK_MAX_BROKERS);
    amqpsink_conf_clear(&s);
}

static void t_amqp_url_list_bad(void **st)
{
    static const struct { const char *url, *why; int rc; } bad[] = {
        { "amqp://a,", "URL 2 of 2 is empty (a comma with no URL after it)", -2 },
        { ",amqp://a", "URL 1 of 2 is empty (a comma with no URL before it)", -2 },
        { "amqp://a, ,amqp://b", "URL 2 of 3 is empty", -2 },
        { "amqp://a,,amqp://b", "URL 2 of 3 is empty", -2 },
        { "amqp://a,http://b", "URL 2 of 2: unsupported scheme; URLs are separated by commas: "
                               "a comma inside one is written %2C", -2 },
        { "amqp://u:pa,ss@a/", "URL 1 of 2: bad port (expected 1..65535); URLs are separated", -2 },
        { "amqp://a,amqp://b:0", "URL 2 of 2: bad port (expected 1..65535)", -2 },
        { "amqp://a,amqps://b", "URL 2 of 2 is amqps:// and URL 1 amqp://", -2 },
        { "amqp://u:p@a,amqp://u:q@b", "URL 2 of 2 has another user or password than URL 1", -2 },
        { "amqp://u:p@a,amqp://b", "URL 2 of 2 has another user or password", -2 },
        { "amqp://u:p@a,amqp://v:p@b", "URL 2 of 2 has another user or password", -2 },
        { "amqp://a/x,amqp://b/y", "URL 2 of 2 names another vhost than URL 1", -2 },
        { "amqp://a/%2f,amqp://b/x", "URL 2 of 2 names another vhost", -2 },
        { "amqp://a:5672,amqp://b,amqp://A", "URL 3 of 3 repeats the address of URL 1 (a:5672)", -2 },
        { "amqp://a:1,amqp://a:2,amqp://a:3,amqp://a:4,amqp://a:5,amqp://a:6,amqp://a:7,"
          "amqp://a:8,amqp://a:9,amqp://a:10,amqp://a:11,amqp://a:12,amqp://a:13,amqp://a:14,"
          "amqp://a:15,amqp://a:16,amqp://a:17", "17 URLs, at most 16", -2 },
        /* a single URL keeps its own words */
        { "http://a", "unsupported scheme", -1 },
        { "", "empty", -1 },
    };
    amqpsink_conf s;
    char err[400];
    (void)st;

    memset(&s, 0, sizeof s);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc;

        err[0] = '\0';
        rc = amqpsink_urls_parse(bad[i].url, &s, err, sizeof err);
        if (rc != bad[i].rc)
            fail_msg("URL list \"%s\": returned %d, not %d (%s)", bad[i].url, rc, bad[i].rc, err);
        if (!strstr(err, bad[i].why))
            fail_msg("URL list \"%s\": reason \"%s\" lacks \"%s\"", bad[i].url, err, bad[i].why);
        if (strstr(err, "pa,ss") || strstr(err, "u:q"))
            fail_msg("URL list \"%s\": the reason quotes the secret: %s", bad[i].url, err);
        assert_null(s.host);   /* untouched on error */
        assert_null(s.brokers);
    }
}

/* ------------------------------------------------------------------ */
/* whole files                                                         */
/* ------------------------------------------------------------------ */

static void t_load_defaults(void **st)
{
    cfg_errors e = { 0 };
    char host[300], expect_name[400];
    cfg *c;
    (void)st;

    c = load_text("[sink.main]\n"
                  "[outbox.Orders]\n"
                  "conninfo = host=127.0.0.1 dbname=app user=postgres\n"
                  "database = app\n", &e, NULL);
    print_errs(&e);
    assert_non_null(c);
    assert_int_equal(e.n, 0);

    assert_int_equal(gethostname(host, sizeof host), 0);
    snprintf(expect_name, sizeof expect_name, "%s:%ld", host, (long)getpid());
    assert_string_equal(c->relay.name, expect_name);
    assert_int_equal(c->relay.log_level, CFG_LOG_INFO);
    assert_int_equal(c->relay.log_format, CFG_LOG_TEXT);
    assert_null(c->relay.log_file);
    assert_string_equal(c->relay.http_listen, "127.0.0.1:9187");
    assert_true(c->relay.shutdown_timeout_ms == 10000);
    assert_int_equal(c->relay.max_rows_in_memory, 0);   /* auto */
    assert_int_equal(cfg_max_rows_in_memory(c), 10000);

    assert_int_equal(c->n_sinks, 1);
    const cfg_sink *s = &c->sinks[0];
    const amqpsink_conf *a = amqpsink_conf_of(s);
    assert_string_equal(s->name, "main");
    assert_string_equal(s->type->name, "rabbitmq");
    assert_string_equal(s->url, "amqp://guest:guest@127.0.0.1:5672/%2f");
    assert_null(s->password);
    assert_string_equal(a->host, "127.0.0.1");
    assert_int_equal(a->port, 5672);
    assert_string_equal(a->user, "guest");
    assert_string_equal(a->pass, "guest");
    assert_string_equal(a->vhost, "/");
    assert_false(a->tls);
    assert_null(a->tls_ca_file);
    assert_true(a->tls_verify);
    assert_int_equal(s->publish_window, 1000);
    assert_true(a->heartbeat_ms == 30000);
    assert_true(s->confirm_timeout_ms == 30000);
    assert_true(s->connect_timeout_ms == 5000);
    assert_true(s->reconnect_max_ms == 30000);
    assert_true(s->max_message_size == 128u * 1024 * 1024);
    assert_true(s->confirms);
    assert_true(a->mandatory);
    assert_int_equal(a->n_brokers, 1);
    assert_string_equal(a->brokers[0].host, "127.0.0.1");
    assert_int_equal(a->brokers[0].port, 5672);
    assert_string_equal(a->brokers[0].addr, "127.0.0.1:5672");
    assert_true(a->nack_reopen_ms == 1000);

    assert_int_equal(c->n_outboxes, 1);
    const cfg_outbox *o = &c->outboxes[0];
    assert_string_equal(o->name, "orders");   /* iniparser lower-cases section names */
    assert_string_equal(o->source->name, "postgres");
    assert_string_equal(o->conninfo, "host=127.0.0.1 dbname=app user=postgres");
    assert_null(o->password);
    assert_string_equal(o->database, "app");
    assert_string_equal(o->table, "outbox.messages");
    assert_string_equal(o->schema_part, "outbox");
    assert_string_equal(o->table_part, "messages");
    assert_string_equal(o->dead_part, "messages_dead");
    assert_string_equal(o->sink_name, "main");
    assert_ptr_equal(o->sink, &c->sinks[0]);
    assert_int_equal(o->batch_size, 500);
    assert_true(o->poll_interval_ms == 0);   /* auto */
    assert_true(cfg_poll_interval_ms(o, true) == 5000);
    assert_true(cfg_poll_interval_ms(o, false) == 1000);
    assert_true(o->lease_ms == 30000);
    assert_int_equal(o->max_attempts, 10);
    assert_true(o->retry_backoff_ms == 1000);
    assert_true(o->retry_backoff_max_ms == 300000);
    assert_int_equal(o->on_sent, CFG_ON_SENT_MARK);
    assert_true(o->retention_ms == 7LL * 86400000);
    assert_int_equal(o->cleanup_batch, 1000);
    assert_true(o->cleanup_interval_ms == 10000);
    assert_int_equal(o->mode, CFG_MODE_LEADER);
    assert_true(o->query_timeout_ms == 30000);
    assert_true(o->connect_timeout_ms == 5000);
    assert_true(o->reconnect_max_ms == 30000);
    cfg_free(c);
}

/* A certificate rotated in place (same path, new content) is a change for a reload: the
   sink reconnects and reads it, instead of going on with the old one until a failure. */
static void t_reload_sees_rotated_tls_file(void **st)
{
    cfg_errors e = { 0 };
    char *ca, *ini;
    cfg *a, *b, *c2;
    (void)st;

    ca = tmp_write("ca.pem", "-----BEGIN CERTIFICATE-----\nold\n-----END CERTIFICATE-----\n");
    assert_true(asprintf(&ini, "[sink.main]\nurl = amqps://h/v\ntls_ca_file = %s\n"
                         "[outbox.o]\nconninfo = dbname=x\ndatabase = x\n", ca) > 0);
    a = load_text(ini, &e, NULL);
    print_errs(&e);
    assert_non_null(a);
    b = load_text(ini, &e, NULL);
    assert_non_null(b);
    assert_true(cfg_sink_equal(&a->sinks[0], &b->sinks[0]));     /* nothing changed */
    free(tmp_write("ca.pem", "-----BEGIN CERTIFICATE-----\nnew\n-----END CERTIFICATE-----\n"));
    c2 = load_text(ini, &e, NULL);
    assert_non_null(c2);
    assert_false(cfg_sink_equal(&a->sinks[0], &c2->sinks[0]));   /* same path, new file */
    assert_false(cfg_outbox_equal(&a->outboxes[0], &c2->outboxes[0]));   /* its outbox too */
    cfg_free(a);
    cfg_free(b);
    cfg_free(c2);
    free(ini);
    free(ca);
}

/* config/ and a backend's own settings, without RabbitMQ: a sink registered here keeps
   its keys in its own struct (backend_conf), which config/ allocates, frees through the
   backend and compares on reload through it. Runs last: the registration stays. */
typedef struct fake_conf {
    int   depth;
    char *path;
    int   derived;      /* set by finish_sink */
} fake_conf;

static int fake_frees;

static void fake_free(void *conf)
{
    free(((fake_conf *)conf)->path);
    fake_frees++;
}

static bool fake_equal(const void *va, const void *vb)
{
    const fake_conf *a = va, *b = vb;
    return a->depth == b->depth && a->derived == b->derived &&
           (a->path == NULL ? b->path == NULL : b->path != NULL && strcmp(a->path, b->path) == 0);
}

static void fake_finish(cfg_sink *s, cfg_report *r)
{
    fake_conf *f = s->backend_conf;

    f->derived = f->depth * 10;
    if (f->depth == 7)
        cfg_report_error(r, "fake_depth", "expected anything but 7, got 7");
}

static void t_backend_settings(void **st)
{
    static const cfg_key keys[] = {
        { "fake_depth", CFG_KT_INT, 0, "3", 1, 9, NULL, NULL, offsetof(fake_conf, depth), NULL },
        { "fake_path",  CFG_KT_STR, CFG_KF_EMPTY_NULL, "", 0, 0, NULL, NULL,
          offsetof(fake_conf, path), "a path" },
    };
    static const cfg_backend fake = {
        .kind = CFG_BACKEND_SINK, .name = "fake", .conf_size = sizeof(fake_conf),
        .keys = keys, .n_keys = 2, .finish_sink = fake_finish, .conf_free = fake_free,
        .conf_equal = fake_equal,
    };
    static const cfg_backend no_equal = {
        .kind = CFG_BACKEND_SINK, .name = "no_equal", .conf_size = sizeof(fake_conf),
    };
    static const cfg_backend no_home = {
        .kind = CFG_BACKEND_SINK, .name = "no_home", .keys = keys, .n_keys = 2,
    };
    static const char base[] = "[sink.main]\ntype = fake\nurl = x://y\n%s"
                               "[outbox.o]\nconninfo = dbname=x\ndatabase = x\n";
    cfg_errors e = { 0 };
    char *ini = NULL;
    cfg *a, *b, *c2;
    (void)st;

    assert_int_equal(cfg_register(&no_equal), -1);   /* a reload could not compare it */
    assert_int_equal(cfg_register(&no_home), -1);    /* keys without settings to hold them */
    assert_int_equal(cfg_register(&fake), 0);

    assert_true(asprintf(&ini, base, "fake_depth = 5\nfake_path = /p\n") > 0);
    a = load_text(ini, &e, NULL);
    print_errs(&e);
    assert_non_null(a);
    const fake_conf *f = a->sinks[0].backend_conf;
    assert_ptr_equal(a->sinks[0].type, &fake);
    assert_int_equal(f->depth, 5);
    assert_string_equal(f->path, "/p");
    assert_int_equal(f->derived, 50);
    b = load_text(ini, &e, NULL);
    assert_non_null(b);
    assert_true(cfg_sink_equal(&a->sinks[0], &b->sinks[0]));
    assert_true(cfg_outbox_equal(&a->outboxes[0], &b->outboxes[0]));
    free(ini);
    assert_true(asprintf(&ini, base, "fake_depth = 6\nfake_path = /p\n") > 0);
    c2 = load_text(ini, &e, NULL);
    assert_non_null(c2);
    assert_false(cfg_sink_equal(&a->sinks[0], &c2->sinks[0]));   /* through fake_equal */
    assert_false(cfg_outbox_equal(&a->outboxes[0], &c2->outboxes[0]));
    fake_frees = 0;
    cfg_free(a);
    cfg_free(b);
    cfg_free(c2);
    assert_int_equal(fake_frees, 3);
    free(ini);

    /* its keys are its own: defaults, its finish's errors, and unknown to another sink */
    assert_true(asprintf(&ini, base, "fake_depth = 7\n[sink.r]\nfake_path = /p\n") > 0);
    a = load_text(ini, &e, NULL);
    assert_null(a);
    assert_int_equal(e.n, 2);
    assert_non_null(strstr(e.lines[0], "[sink.main] fake_depth: expected anything but 7, got 7"));
    assert_non_null(strstr(e.lines[1],
                           "[sink.r] fake_path: unknown key, expected one of type, url"));
    cfg_errors_clear(&e);
    free(ini);
    assert_true(asprintf(&ini, base, "") > 0);
    a = load_text(ini, &e, NULL);
    print_errs(&e);
    assert_non_null(a);
    f = a->sinks[0].backend_conf;
    assert_int_equal(f->depth, 3);
    assert_null(f->path);
    cfg_free(a);
    free(ini);
}

static void t_load_values(void **st)
{
    cfg_errors e = { 0 };
    cfg *c;
    (void)st;

    c = load_text("; a comment\n"
                  "[relay]\n"
                  "name = relay-7\n"
                  "log_level = DEBUG\n"
                  "log_format = json\n"
                  "log_file = /tmp/x.log\n"
                  "http_listen =\n"
                  "shutdown_timeout = 250ms\n"
                  "max_rows_in_memory = 50000\n"
                  "[sink.bus]\n"
                  "url = \"amqps://app:pw%3Bx@[::1]:5999/prod\" ; quoted\n"
                  "publish_window = 65535\n"
                  "heartbeat = 0\n"
                  "max_message_size = 64k\n"
                  "tls_verify = off\n"
                  "[outbox.a]\n"
                  "source = odbc\n"
                  "conninfo = Driver={PostgreSQL Unicode} ;Server=127.0.0.1\n"
                  "database = App\n"
                  "table = \"Sales.Outbox_1\"\n"
                  "sink = bus\n"
                  "batch_size = 100000\n"
                  "on_sent = delete\n"
                  "retention = 0\n"
                  "mode = competing\n"
                  "retry_backoff = 2s\n"
                  "retry_backoff_max = 2s\n"
                  "poll_interval = 250ms\n"
                  "[outbox.b]\n"
                  "poll_interval = AUTO\n"
                  "source = sqlserver\n"
                  "conninfo = \"Driver={x};Pwd=a;b\"\n"
                  "database = b\n"
                  "table = only_table\n"
                  "sink = bus\n", &e, NULL);
    print_errs(&e);
    assert_non_null(c);
    assert_string_equal(c->relay.name, "relay-7");
    assert_int_equal(c->relay.log_level, CFG_LOG_DEBUG);
    assert_int_equal(c->relay.log_format, CFG_LOG_JSON);
    assert_string_equal(c->relay.log_file, "/tmp/x.log");
    assert_null(c->relay.http_listen);
    assert_true(c->relay.shutdown_timeout_ms == 250);
    assert_int_equal(cfg_max_rows_in_memory(c), 50000);       /* as set, even below an outbox's */
    c->relay.max_rows_in_memory = 0;                          /* auto: the largest outbox's own */
    assert_int_equal(cfg_max_rows_in_memory(c), 65535 + 2 * 100000);
    assert_int_equal(c->n_sinks, 1);
    assert_string_equal(c->sinks[0].name, "bus");
    const amqpsink_conf *bus = amqpsink_conf_of(&c->sinks[0]);
    assert_string_equal(bus->host, "::1");
    assert_int_equal(bus->port, 5999);
    assert_string_equal(bus->user, "app");
    assert_string_equal(bus->pass, "pw;x");
    assert_string_equal(bus->vhost, "prod");
    assert_true(bus->tls);
    assert_int_equal(c->sinks[0].publish_window, 65535);
    assert_true(bus->heartbeat_ms == 0);
    assert_true(c->sinks[0].max_message_size == 65536);
    assert_false(bus->tls_verify);
    assert_int_equal(c->n_outboxes, 2);
    const cfg_outbox *a = &c->outboxes[0], *b = &c->outboxes[1];
    assert_true(a->poll_interval_ms == 250 && cfg_poll_interval_ms(a, true) == 250);
    assert_true(b->poll_interval_ms == 0 && cfg_poll_interval_ms(b, false) == 1000);
    assert_string_equal(a->name, "a");
    assert_string_equal(a->source->name, "odbc");
    assert_ptr_equal(a->source->ops, cfg_backend_find(CFG_BACKEND_SOURCE, "sqlserver")->ops);
    /* "value ;text" is a value and a comment */
    assert_string_equal(a->conninfo, "Driver={PostgreSQL Unicode}");
    assert_string_equal(a->database, "App");   /* values keep their case */
    assert_string_equal(a->schema_part, "Sales");
    assert_string_equal(a->table_part, "Outbox_1");
    assert_ptr_equal(a->sink, &c->sinks[0]);
    assert_int_equal(a->batch_size, 100000);
    assert_int_equal(a->on_sent, CFG_ON_SENT_DELETE);
    assert_true(a->retention_ms == 0);
    assert_int_equal(a->mode, CFG_MODE_COMPETING);
    assert_string_equal(b->conninfo, "Driver={x};Pwd=a;b");
    assert_string_equal(b->source->name, "sqlserver");
    assert_string_equal(b->schema_part, "outbox");
    assert_string_equal(b->table_part, "only_table");
    cfg_free(c);
}

static void t_env_and_secret_files(void **st)
{
    cfg_errors e = { 0 };
    char *pw = tmp_write("pw", "s3cr3t\n");
    char *pw2 = tmp_write("pw2", "db-pass\r\n");
    char *text = NULL;
    cfg *c;
    (void)st;

    assert_int_equal(setenv("CFGT_HOST", "10.1.2.3", 1), 0);
    assert_int_equal(setenv("CFGT_DB", "appdb", 1), 0);
    assert_int_equal(setenv("CFGT_URLPASS", "from-env", 1), 0);
    assert_true(asprintf(&text,
                         "[sink.main]\n"
                         "url = amqp://u:${CFGT_URLPASS}@${CFGT_HOST}/v\n"
                         "[sink.pf]\n"
                         "url = amqp://u:old@h/\n"
                         "password_file = %s\n"
                         "[outbox.o]\n"
                         "conninfo = host=${CFGT_HOST} dbname=${CFGT_DB} password=$$x\n"
                         "database = ${CFGT_DB}\n"
                         "password_file = %s\n", pw, pw2) > 0);
    c = load_text(text, &e, NULL);
    print_errs(&e);
    assert_non_null(c);
    assert_string_equal(amqpsink_conf_of(&c->sinks[0])->host, "10.1.2.3");
    assert_string_equal(amqpsink_conf_of(&c->sinks[0])->pass, "from-env");
    assert_null(c->sinks[0].password);
    assert_string_equal(amqpsink_conf_of(&c->sinks[1])->user, "u");
    /* password_file overrides the URL */
    assert_string_equal(amqpsink_conf_of(&c->sinks[1])->pass, "s3cr3t");
    assert_string_equal(c->sinks[1].password, "s3cr3t");   /* one trailing newline trimmed */
    assert_string_equal(c->outboxes[0].conninfo, "host=10.1.2.3 dbname=appdb password=$x");
    assert_string_equal(c->outboxes[0].database, "appdb");
    assert_string_equal(c->outboxes[0].password, "db-pass");
    cfg_free(c);
    free(text);
    free(pw);
    free(pw2);
}

static void t_env_unset_and_bad_file(void **st)
{
    cfg_errors e = { 0 };
    char *path = NULL;
    cfg *c;
    (void)st;

    unsetenv("CFGT_NOPE");
    c = load_text("[sink.main]\n"
                  "url = amqp://u:${CFGT_NOPE}@h/\n"
                  "password_file = /nonexistent/secret-hunter2\n"
                  "[outbox.o]\n"
                  "conninfo = host=h password=hunter2 ${\n"
                  "database = d$x\n", &e, &path);
    assert_null(c);
    print_errs(&e);
    assert_int_equal(e.n, 4);
    for (size_t i = 0; i < e.n; i++) {
        assert_true(strncmp(e.lines[i], path, strlen(path)) == 0);
        assert_null(strstr(e.lines[i], "hunter2 "));   /* the conninfo never shows */
    }
    assert_non_null(strstr(e.lines[0], "[sink.main] url: "));
    assert_non_null(strstr(e.lines[0], "CFGT_NOPE"));
    assert_non_null(strstr(e.lines[1], "[sink.main] password_file: "));
    assert_non_null(strstr(e.lines[1], "/nonexistent/secret-hunter2"));   /* the path, not content */
    assert_non_null(strstr(e.lines[1], "No such file"));
    assert_non_null(strstr(e.lines[2], "[outbox.o] conninfo: "));
    assert_non_null(strstr(e.lines[2], "unterminated"));
    assert_non_null(strstr(e.lines[3], "[outbox.o] database: "));
    assert_non_null(strstr(e.lines[3], "$$"));
    cfg_errors_clear(&e);
    assert_int_equal(e.n, 0);
    free(path);
}

static void t_secret_file_content_never_echoed(void **st)
{
    cfg_errors e = { 0 };
    char *pw = tmp_write("pw3", "line1-topsecret\nline2\n");
    char *text = NULL;
    cfg *c;
    (void)st;

    assert_true(asprintf(&text, "[sink.main]\npassword_file = %s\n"
                         "url = ftp://u:topsecret@h/\n"
                         "[outbox.o]\nconninfo = topsecret=\ndatabase = d\n", pw) > 0);
    c = load_text(text, &e, NULL);
    assert_null(c);
    print_errs(&e);
    assert_int_equal(e.n, 3);   /* multi-line file, bad URL, conninfo libpq rejects */
    for (size_t i = 0; i < e.n; i++)
        assert_null(strstr(e.lines[i], "topsecret"));
    assert_non_null(strstr(e.lines[0], "password_file"));
    assert_non_null(strstr(e.lines[1], "url: expected an amqp:// or amqps:// URL"));
    assert_non_null(strstr(e.lines[1], "got <secret>"));
    assert_non_null(strstr(e.lines[2], "conninfo"));
    cfg_errors_clear(&e);
    free(text);
    free(pw);
}

static void t_collects_all_errors(void **st)
{
    cfg_errors e = { 0 };
    cfg *c;
    (void)st;

    c = load_text("stray = 1\n"
                  "[relay]\nlog_level = loud\ncolour = blue\n"
                  "[sinks.x]\nk = v\n"
                  "[sink.main]\npublish_window = 0\nconfirms = false\nmandatory = no\n"
                  "[outbox.o]\nbatch_size = 010abc\nretry_backoff = 10s\nretry_backoff_max = 1s\n", &e, NULL);
    assert_null(c);
    print_errs(&e);
    {
        static const char *const want[] = {
            "[] stray: key outside any section",
            "[sinks.x]: unknown section, expected [relay], [sink.NAME] or [outbox.NAME]",
            "[relay] colour: unknown key, expected one of name, log_level,",
            "[relay] log_level: expected one of error | warn | info | debug, got \"loud\"",
            "[sink.main] publish_window: expected an integer 1..65535, got \"0\"",
            ("[sink.main] confirms: expected true (publisher confirms are required: a sink without "
             "confirms could lose messages), got \"false\""),
            "[sink.main] mandatory: expected true",
            "[outbox.o] conninfo: expected a libpq conninfo or an ODBC connection string (required), got nothing",
            "[outbox.o] database: expected the database name the connection must be in (required), got nothing",
            "[outbox.o] batch_size: expected an integer 1..100000, got \"010abc\"",
            "[outbox.o] retry_backoff_max: expected a duration of at least retry_backoff (10s), got \"1s\"",
        };
        assert_int_equal(e.n, sizeof want / sizeof want[0]);
        for (size_t i = 0; i < e.n; i++)
            if (!strstr(e.lines[i], want[i]))
                fail_msg("line %zu: \"%s\" lacks \"%s\"", i, e.lines[i], want[i]);
    }
    cfg_errors_clear(&e);
}

static void t_missing_file_and_syntax(void **st)
{
    cfg_errors e = { 0 };
    cfg *c = NULL;
    char *path = NULL;
    (void)st;

    assert_int_equal(cfg_load("/nonexistent/relay.ini", &c, &e), -1);
    assert_null(c);
    assert_int_equal(e.n, 1);
    assert_string_equal(e.lines[0], "/nonexistent/relay.ini: cannot open: No such file or directory");
    cfg_errors_clear(&e);

    c = load_text("[relay]\nthis line has no equals sign, password hunter2\n", &e, &path);
    assert_null(c);
    print_errs(&e);
    assert_int_equal(e.n, 1);
    assert_true(strncmp(e.lines[0], path, strlen(path)) == 0);
    assert_non_null(strstr(e.lines[0], "line 2"));
    assert_null(strstr(e.lines[0], "hunter2"));
    cfg_errors_clear(&e);
    free(path);
}

/* ------------------------------------------------------------------ */
/* log and row                                                         */
/* ------------------------------------------------------------------ */

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    char *buf;
    size_t n;

    assert_non_null(f);
    buf = calloc(1, 1 << 16);
    assert_non_null(buf);
    n = fread(buf, 1, (1 << 16) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void t_log(void **st)
{
    char *path = NULL, *path2 = NULL, *text;
    (void)st;

    assert_true(asprintf(&path, "%s/relay.log", tmpdir) > 0);
    assert_true(asprintf(&path2, "%s/relay.log.1", tmpdir) > 0);

    log_setup(LOG_INFO, CFG_LOG_TEXT, path);
    assert_true(log_enabled(LOG_WARN));
    assert_false(log_enabled(LOG_DEBUG));
    log_msg(LOG_INFO, "hello %s", "world");
    log_msg(LOG_DEBUG, "not shown");
    log_msg(LOG_ERROR, "two\nlines\x01");
    text = slurp(path);
    print_message("%s", text);
    /* 2026-11-21T12:00:00.123Z INFO hello world */
    assert_int_equal(strlen(text) > 25, 1);
    assert_true(text[4] == '-' && text[10] == 'T' && text[19] == '.' && text[23] == 'Z');
    assert_non_null(strstr(text, "Z INFO hello world\n"));
    assert_null(strstr(text, "not shown"));
    assert_non_null(strstr(text, "Z ERROR two\\nlines\\x01\n"));
    free(text);

    /* rotation: rename, SIGHUP → reopen, next line lands in the new file */
    assert_int_equal(rename(path, path2), 0);
    assert_int_equal(log_reopen(), 0);
    log_msg(LOG_WARN, "after reopen");
    text = slurp(path);
    assert_non_null(strstr(text, "Z WARN after reopen\n"));
    free(text);

    log_setup(LOG_DEBUG, CFG_LOG_JSON, path);
    log_msg(LOG_DEBUG, "q\"b\\s\tn\n\x02 \xc3\xa9 \xff end");
    text = slurp(path);
    print_message("%s", text);
    assert_non_null(strstr(text, "\",\"level\":\"debug\",\"msg\":\"q\\\"b\\\\s\\tn\\n\\u0002 \xc3\xa9 \\ufffd end\"}\n"));
    assert_non_null(strstr(text, "{\"ts\":\"20"));
    free(text);

    /* a huge message is cut, the line stays one valid line */
    {
        char *big = malloc(20000);
        assert_non_null(big);
        memset(big, 'x', 19999);
        big[19999] = '\0';
        log_msg(LOG_INFO, "%s", big);
        free(big);
        text = slurp(path);
        char *last = strstr(text, "\"level\":\"info\"");
        assert_non_null(last);
        assert_non_null(strstr(last, "...\"}\n"));
        free(text);
    }
    log_setup(LOG_INFO, CFG_LOG_TEXT, NULL);   /* back to stderr; closes the file */
    free(path);
    free(path2);
}

static void t_row(void **st)
{
    static const unsigned char payload[] = { 'a', 0, 'b', 0xff };
    row_fields f;
    row *r;
    (void)st;

    memset(&f, 0, sizeof f);
    f.id = 42;
    f.lease_token = 7;
    f.attempts = 3;
    f.created_at_us = 1700000000123456LL;
    f.message_id = (row_field){ "0F8FAD5B-D9CB-469F-A165-70867728950E", 36 };
    f.routing_key = (row_field){ "orders.created+junk", 14 };
    f.partition_key = (row_field){ "cust-1", 6 };
    f.headers_json = (row_field){ "{\"a\":1}", 7 };
    f.payload = (row_field){ (const char *)payload, sizeof payload };
    r = row_new(&f);
    assert_non_null(r);
    assert_true(r->id == 42 && r->lease_token == 7 && r->attempts == 3);
    assert_true(r->created_at_us == 1700000000123456LL);
    assert_string_equal(r->message_id, "0f8fad5b-d9cb-469f-a165-70867728950e");
    assert_string_equal(r->exchange, "");
    assert_string_equal(r->routing_key, "orders.created");
    assert_string_equal(r->partition_key, "cust-1");
    assert_null(r->message_type);
    assert_null(r->content_type);
    assert_null(r->correlation_id);
    assert_string_equal(r->headers_json, "{\"a\":1}");
    assert_int_equal(r->payload_len, 4);
    assert_memory_equal(r->payload, payload, 4);
    assert_int_equal(row_release_payload(r), 0);   /* small: part of the block, kept */
    row_free(r);

    {   /* a payload of ROW_APART_MIN bytes or more is held apart: freed alone */
        unsigned char *big = malloc(ROW_APART_MIN);
        assert_non_null(big);
        for (size_t i = 0; i < ROW_APART_MIN; i++)
            big[i] = (unsigned char)(i * 7);
        f.payload = (row_field){ (const char *)big, ROW_APART_MIN };
        r = row_new(&f);
        assert_non_null(r);
        assert_memory_equal(r->payload, big, ROW_APART_MIN);
        assert_int_equal(r->bytes, ROW_APART_MIN + 7);
        free(big);
        assert_int_equal(row_release_payload(r), ROW_APART_MIN);
        assert_null(r->payload);
        assert_int_equal(r->payload_len, ROW_APART_MIN);  /* still its size */
        assert_int_equal(r->bytes, 7);                    /* its headers */
        assert_string_equal(r->partition_key, "cust-1");
        assert_int_equal(row_release_payload(r), 0);
        row_free(r);
    }

    f.payload = (row_field){ NULL, 0 };
    r = row_new(&f);
    assert_non_null(r);
    assert_non_null(r->payload);
    assert_int_equal(r->payload_len, 0);
    row_free(r);

    f.message_id = (row_field){ "short", 5 };
    assert_null(row_new(&f));
    f.message_id = (row_field){ NULL, 36 };
    assert_null(row_new(&f));
    assert_null(row_new(NULL));
    row_free(NULL);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_duration),
        cmocka_unit_test(t_int),
        cmocka_unit_test(t_bool),
        cmocka_unit_test(t_size),
        cmocka_unit_test(t_amqp_url_ok),
        cmocka_unit_test(t_amqp_url_bad),
        cmocka_unit_test(t_amqp_url_list_ok),
        cmocka_unit_test(t_amqp_url_list_bad),
        cmocka_unit_test(t_load_defaults),
        cmocka_unit_test(t_load_values),
        cmocka_unit_test(t_reload_sees_rotated_tls_file),
        cmocka_unit_test(t_env_and_secret_files),
        cmocka_unit_test(t_env_unset_and_bad_file),
        cmocka_unit_test(t_secret_file_content_never_echoed),
        cmocka_unit_test(t_collects_all_errors),
        cmocka_unit_test(t_missing_file_and_syntax),
        cmocka_unit_test(t_log),
        cmocka_unit_test(t_row),
        cmocka_unit_test(t_backend_settings),   /* last: it registers a sink */
    };
    int rc;

    if (sources_register() != 0 || sinks_register() != 0) {
        fprintf(stderr, "cannot register the sources and sinks\n");
        return 2;
    }
    if (argc == 3 && strcmp(argv[1], "--load") == 0)
        return load_mode(argv[2]);
    if (argc == 4 && strcmp(argv[1], "--diff") == 0)
        return diff_mode(argv[2], argv[3]);
    if (argc != 1) {
        fprintf(stderr, "usage: %s [--load FILE | --diff OLD NEW]\n", argv[0]);
        return 2;
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/cfg_test.XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 2;
    }
    rc = cmocka_run_group_tests(tests, NULL, NULL);
    rm_rf_tmp();
    return rc;
}
