/*
 * amqpcfg.c — the rabbitmq sink's own settings (amqpcfg.h): its URLs, parsed
 * strictly with a reason for every refusal, and the checks only it understands
 * (TLS files need amqps://, a client certificate needs its key).
 *
 * Why not rabbitmq-c's amqp_parse_url: tried on the cases below, it reads
 * "amqp://::1/x" as host localhost port 1, accepts port 0, a host with a space
 * in it and "amqp://" alone (localhost), and says only "bad URL" when it does
 * refuse. Debian's rabbitmq-c 0.11 also refuses every percent-encoded byte above
 * %7F, so a user or vhost named in UTF-8 ("v%C3%A9") cannot be written, cuts a
 * name at %00 silently ("a%00b" is user "a"), and takes the scheme in lower case
 * only. An operator gets a wrong broker or no reason; this parser refuses each
 * of those with one, or accepts them (tests/c/cfg_test.c lists them).
 */
#include "sinks/rabbitmq/amqpcfg.h"
#include "sinks/sinks.h"

#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Percent-decodes [p, p+n) into a new string (caller owns it).
 * NULL with *why set on bad encoding or out of memory. */
static char *pct_decode(const char *p, size_t n, const char **why)
{
    char *out = malloc(n + 1);
    size_t o = 0;

    if (!out) {
        *why = "out of memory";
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '%') {
            int hi = i + 2 < n ? hexval((unsigned char)p[i + 1]) : -1;
            int lo = i + 2 < n ? hexval((unsigned char)p[i + 2]) : -1;
            if (hi < 0 || lo < 0) {
                *why = "bad percent-encoding (expected %XX with two hex digits)";
                free(out);
                return NULL;
            }
            if (hi == 0 && lo == 0) {
                *why = "percent-encoded NUL byte";
                free(out);
                return NULL;
            }
            out[o++] = (char)(hi * 16 + lo);
            i += 2;
        } else {
            out[o++] = p[i];
        }
    }
    out[o] = '\0';
    return out;
}

int amqpsink_url_parse(const char *url, amqpsink_conf *s, char *err, size_t errlen)
{
    char *user = NULL, *pass = NULL, *host = NULL, *vhost = NULL;
    const char *why = NULL, *p, *auth_end, *at, *hp, *port_s = NULL;
    size_t alen, hlen, port_len = 0;
    int port;
    bool tls;

    if (!url || !*url) {
        why = "empty URL";
        goto fail;
    }
    for (p = url; *p; p++) {
        if ((unsigned char)*p <= 0x20 || (unsigned char)*p == 0x7f) {
            why = "contains whitespace or control characters";
            goto fail;
        }
    }
    if (strncasecmp(url, "amqps://", 8) == 0) {
        tls = true;
        port = 5671;
        p = url + 8;
    } else if (strncasecmp(url, "amqp://", 7) == 0) {
        tls = false;
        port = 5672;
        p = url + 7;
    } else {
        why = "unsupported scheme";
        goto fail;
    }

    alen = strcspn(p, "/?#");
    auth_end = p + alen;
    if (*auth_end == '?' || (*auth_end == '/' && strchr(auth_end, '?'))) {
        why = "query parameters are not supported (use the sink's keys)";
        goto fail;
    }
    if (strchr(p, '#')) {
        why = "fragments are not supported";
        goto fail;
    }

    /* user info */
    at = memchr(p, '@', alen);
    if (at) {
        const char *colon;
        size_t ulen = (size_t)(at - p);

        if (memchr(at + 1, '@', (size_t)(auth_end - at - 1))) {
            why = "unencoded '@' in the user info (percent-encode it as %40)";
            goto fail;
        }
        colon = memchr(p, ':', ulen);
        if (colon) {
            if (!(user = pct_decode(p, (size_t)(colon - p), &why)))
                goto fail;
            if (!(pass = pct_decode(colon + 1, (size_t)(at - colon - 1), &why)))
                goto fail;
        } else if (!(user = pct_decode(p, ulen, &why))) {
            goto fail;
        }
        if (!*user) {
            why = "empty user name";
            goto fail;
        }
        hp = at + 1;
    } else {
        hp = p;
    }
    hlen = (size_t)(auth_end - hp);

    /* host[:port] */
    if (hlen > 0 && hp[0] == '[') {
        const char *close = memchr(hp, ']', hlen);
        if (!close) {
            why = "unterminated [IPv6] address";
            goto fail;
        }
        if (close == hp + 1) {
            why = "missing host";
            goto fail;
        }
        for (const char *c = hp + 1; c < close; c++) {
            if (!isxdigit((unsigned char)*c) && *c != ':' && *c != '.') {
                why = "bad character in [IPv6] address";
                goto fail;
            }
        }
        if (!memchr(hp + 1, ':', (size_t)(close - hp - 1))) {
            why = "bracketed host is not an IPv6 address";
            goto fail;
        }
        if (!(host = strndup(hp + 1, (size_t)(close - hp - 1)))) {
            why = "out of memory";
            goto fail;
        }
        if (close + 1 < auth_end) {
            if (close[1] != ':') {
                why = "unexpected characters after ]";
                goto fail;
            }
            port_s = close + 2;
            port_len = (size_t)(auth_end - port_s);
        }
    } else {
        const char *colon = memchr(hp, ':', hlen);
        size_t nlen = colon ? (size_t)(colon - hp) : hlen;

        if (colon && memchr(colon + 1, ':', (size_t)(auth_end - colon - 1))) {
            why = "IPv6 addresses must be written in brackets, e.g. [::1]";
            goto fail;
        }
        if (nlen == 0) {
            why = "missing host";
            goto fail;
        }
        for (size_t i = 0; i < nlen; i++) {
            if (!cfg_host_char_ok((unsigned char)hp[i])) {
                why = "bad character in host name";
                goto fail;
            }
        }
        if (!(host = strndup(hp, nlen))) {
            why = "out of memory";
            goto fail;
        }
        if (colon) {
            port_s = colon + 1;
            port_len = (size_t)(auth_end - port_s);
        }
    }
    if (port_s) {
        int64_t v;
        char buf[8];

        if (port_len == 0 || port_len >= sizeof buf) {
            why = "bad port (expected 1..65535)";
            goto fail;
        }
        memcpy(buf, port_s, port_len);
        buf[port_len] = '\0';
        if (!isdigit((unsigned char)buf[0]) || cfg_parse_int(buf, 1, 65535, &v) < 0) {
            why = "bad port (expected 1..65535)";
            goto fail;
        }
        port = (int)v;
    }

    /* vhost: one path segment, percent-decoded; none or empty means "/" */
    if (*auth_end == '/') {
        const char *path = auth_end + 1;
        if (strchr(path, '/')) {
            why = "the vhost must be a single path segment (encode '/' as %2f)";
            goto fail;
        }
        if (!(vhost = pct_decode(path, strlen(path), &why)))
            goto fail;
        if (!*vhost) {
            free(vhost);
            vhost = NULL;
        }
    }
    if (!vhost && !(vhost = strdup("/"))) {
        why = "out of memory";
        goto fail;
    }
    if (!user && !(user = strdup("guest"))) {
        why = "out of memory";
        goto fail;
    }
    if (!pass && !(pass = strdup("guest"))) {
        why = "out of memory";
        goto fail;
    }

    /* success: the sink takes ownership of the new strings */
    free(s->host);
    free(s->user);
    free(s->pass);
    free(s->vhost);
    s->host = host;
    s->user = user;
    s->pass = pass;
    s->vhost = vhost;
    s->port = port;
    s->tls = tls;
    return 0;

fail:
    free(user);
    free(pass);
    free(host);
    free(vhost);
    if (err && errlen)
        snprintf(err, errlen, "%s", why ? why : "invalid URL");
    return -1;
}

/* "host:port", IPv6 in brackets; NULL when out of memory. */
static char *broker_addr(const char *host, int port)
{
    char *a = NULL;

    if (asprintf(&a, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port) < 0)
        return NULL;
    return a;
}

static bool same_secret(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned char d = (unsigned char)(la != lb);

    /* no early exit on the first difference: the comparison's time says nothing */
    for (size_t i = 0; i < la && i < lb; i++)
        d |= (unsigned char)(a[i] ^ b[i]);
    return d == 0;
}

int amqpsink_urls_parse(const char *list, amqpsink_conf *s, char *err, size_t errlen)
{
    amqpsink_conf first, t;
    amqpsink_broker *br = NULL;
    size_t n = 0, total = 1, idx = 0;
    const char *p;
    char why[200], *elem = NULL;
    int rc = -2;
    bool cut = false; /* some element does not start like a URL */

    memset(&first, 0, sizeof first);
    memset(&t, 0, sizeof t);
    if (list == NULL || strchr(list, ',') == NULL) {
        /* one URL: its own words */
        if (amqpsink_url_parse(list, &first, err, errlen) < 0)
            return -1;
        if ((br = calloc(1, sizeof *br)) == NULL || (br[0].host = strdup(first.host)) == NULL ||
            (br[0].addr = broker_addr(first.host, first.port)) == NULL) {
            snprintf(err, errlen, "out of memory");
            rc = -1;
            n = br ? 1 : 0;
            goto fail;
        }
        br[0].port = first.port;
        n = 1;
        goto done;
    }
    for (p = list; *p; p++) {
        total += *p == ',';
        if (p == list || p[-1] == ',') { /* an element that is no URL: a comma inside one? */
            const char *b = p;

            while (*b == ' ' || *b == '\t')
                b++;
            if (*b != ',' && *b != '\0' && strncasecmp(b, "amqp://", 7) != 0 &&
                strncasecmp(b, "amqps://", 8) != 0)
                cut = true;
        }
    }
    if (total > AMQPSINK_MAX_BROKERS) {
        snprintf(err, errlen, "%zu URLs, at most %d", total, AMQPSINK_MAX_BROKERS);
        return -2;
    }
    if ((br = calloc(total, sizeof *br)) == NULL) {
        snprintf(err, errlen, "out of memory");
        return -2;
    }
    for (p = list; idx < total; idx++) {
        const char *e = strchr(p, ','), *b = p;
        size_t len;

        if (e == NULL)
            e = p + strlen(p);
        p = *e ? e + 1 : e;
        while (b < e && (*b == ' ' || *b == '\t'))
            b++;
        len = (size_t)(e - b);
        while (len > 0 && (b[len - 1] == ' ' || b[len - 1] == '\t'))
            len--;
        if (len == 0) {
            snprintf(err, errlen, "URL %zu of %zu is empty (a comma with no URL %s it)", idx + 1,
                     total, idx == 0 ? "before" : "after");
            goto fail;
        }
        free(elem);
        if ((elem = strndup(b, len)) == NULL) {
            snprintf(err, errlen, "out of memory");
            goto fail;
        }
        if (amqpsink_url_parse(elem, &t, why, sizeof why) < 0) {
            snprintf(err, errlen, "URL %zu of %zu: %s%s", idx + 1, total, why,
                     cut ? "; URLs are separated by commas: a comma inside one is written %2C"
                         : "");
            goto fail;
        }
        if (idx == 0) {
            first = t; /* takes the strings */
            memset(&t, 0, sizeof t);
        } else if (t.tls != first.tls) {
            snprintf(err, errlen,
                     "URL %zu of %zu is %s:// and URL 1 %s:// (every URL of the list "
                     "must use the same scheme)",
                     idx + 1, total, t.tls ? "amqps" : "amqp", first.tls ? "amqps" : "amqp");
            goto fail;
        } else if (strcmp(t.user, first.user) != 0 || !same_secret(t.pass, first.pass)) {
            snprintf(
                err, errlen,
                "URL %zu of %zu has another user or password than URL 1 (the nodes "
                "of a cluster share them: write the same in every URL; none means guest:guest)",
                idx + 1, total);
            goto fail;
        } else if (strcmp(t.vhost, first.vhost) != 0) {
            snprintf(err, errlen,
                     "URL %zu of %zu names another vhost than URL 1 (every URL of the "
                     "list must name the same vhost)",
                     idx + 1, total);
            goto fail;
        }
        {
            const char *host = idx == 0 ? first.host : t.host;
            int port = idx == 0 ? first.port : t.port;

            for (size_t j = 0; j < n; j++) {
                if (strcasecmp(br[j].host, host) == 0 && br[j].port == port) {
                    snprintf(err, errlen, "URL %zu of %zu repeats the address of URL %zu (%s)",
                             idx + 1, total, j + 1, br[j].addr);
                    goto fail;
                }
            }
            if ((br[n].host = strdup(host)) == NULL ||
                (br[n].addr = broker_addr(host, port)) == NULL) {
                n++; /* freed below */
                snprintf(err, errlen, "out of memory");
                goto fail;
            }
            br[n++].port = port;
        }
        free(t.host);
        free(t.user);
        cfg_free_secret(t.pass);
        free(t.vhost);
        memset(&t, 0, sizeof t);
    }
done:
    /* success: the sink takes ownership of the new strings */
    free(elem);
    free(s->host);
    free(s->user);
    cfg_free_secret(s->pass);
    free(s->vhost);
    amqpsink_brokers_free(s);
    s->host = first.host;
    s->user = first.user;
    s->pass = first.pass;
    s->vhost = first.vhost;
    s->port = first.port;
    s->tls = first.tls;
    s->brokers = br;
    s->n_brokers = n;
    return 0;
fail:
    free(elem);
    for (size_t j = 0; j < n; j++) {
        free(br[j].host);
        free(br[j].addr);
    }
    free(br);
    free(first.host);
    free(first.user);
    cfg_free_secret(first.pass);
    free(first.vhost);
    free(t.host);
    free(t.user);
    cfg_free_secret(t.pass);
    free(t.vhost);
    return rc;
}

void amqpsink_brokers_free(amqpsink_conf *s)
{
    for (size_t i = 0; i < s->n_brokers; i++) {
        free(s->brokers[i].host);
        free(s->brokers[i].addr);
    }
    free(s->brokers);
    s->brokers = NULL;
    s->n_brokers = 0;
}

void amqpsink_conf_clear(amqpsink_conf *s)
{
    free(s->host);
    free(s->user);
    cfg_free_secret(s->pass);
    free(s->vhost);
    amqpsink_brokers_free(s);
    free(s->tls_ca_file);
    free(s->tls_cert);
    free(s->tls_key);
    memset(s, 0, sizeof *s);
}

static void conf_free(void *conf)
{
    amqpsink_conf_clear(conf);
}

/* Reload: the same settings, the contents of the TLS files included (files_digest). */
static bool conf_equal(const void *va, const void *vb)
{
    const amqpsink_conf *a = va, *b = vb;

    if (a->n_brokers != b->n_brokers)
        return false;
    for (size_t i = 0; i < a->n_brokers; i++)
        if (!outbox_util_str_eq(a->brokers[i].host, b->brokers[i].host) ||
            a->brokers[i].port != b->brokers[i].port)
            return false;
    return outbox_util_str_eq(a->host, b->host) && a->port == b->port &&
           outbox_util_str_eq(a->user, b->user) && outbox_util_str_eq(a->pass, b->pass) &&
           outbox_util_str_eq(a->vhost, b->vhost) && a->tls == b->tls &&
           a->mandatory == b->mandatory && a->heartbeat_ms == b->heartbeat_ms &&
           outbox_util_str_eq(a->tls_ca_file, b->tls_ca_file) && a->tls_verify == b->tls_verify &&
           outbox_util_str_eq(a->tls_cert, b->tls_cert) &&
           outbox_util_str_eq(a->tls_key, b->tls_key) && a->nack_reopen_ms == b->nack_reopen_ms &&
           a->files_digest == b->files_digest;
}

/* Folds a file's bytes into *h (FNV-1a 64): certificates are read when a connection is
   made, so a reload compares their contents, not only their paths. -1 (errno) when the
   file cannot be read. */
static OUTBOX_MUST_CHECK int digest_file(const char *path, uint64_t *h)
{
    unsigned char buf[8192];
    size_t n;
    FILE *f = fopen(path, "rb");

    if (f == NULL)
        return -1;
    if (*h == 0)
        *h = OUTBOX_UTIL_FNV64_INIT;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        *h = outbox_util_fnv1a64(*h, buf, n);
    *h = outbox_util_fnv1a64(*h, "\xff", 1); /* where one file ends */
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        errno = EIO;
        return -1;
    }
    return 0;
}

/* The keys only this sink has (registered with config/ in sinks/sink.c), applied to its
   amqpsink_conf. */
#define F(f) offsetof(amqpsink_conf, f)
static const cfg_key amqpsink_keys[] = {
    { "mandatory", CFG_KT_BOOL, CFG_KF_MUST_TRUE, "true", 0, 0, NULL, NULL, F(mandatory),
      "true (mandatory publishing is required: without it an unroutable message would be "
      "acknowledged and lost)" },
    { "heartbeat", CFG_KT_DUR, CFG_KF_WHOLE_SEC, "30s", 0, 65535 * CFG_MS_S, NULL, NULL,
      F(heartbeat_ms), NULL },
    { "tls_ca_file", CFG_KT_STR, CFG_KF_EMPTY_NULL | CFG_KF_READABLE, "", 0, 0, NULL, NULL,
      F(tls_ca_file), "a readable CA bundle file" },
    { "tls_verify", CFG_KT_BOOL, 0, "true", 0, 0, NULL, NULL, F(tls_verify), NULL },
    { "tls_cert", CFG_KT_STR, CFG_KF_EMPTY_NULL | CFG_KF_READABLE, "", 0, 0, NULL, NULL,
      F(tls_cert), "a readable PEM client certificate file" },
    { "tls_key", CFG_KT_STR, CFG_KF_EMPTY_NULL | CFG_KF_READABLE, "", 0, 0, NULL, NULL, F(tls_key),
      "a readable PEM private key file" },
    { "nack_reopen", CFG_KT_DUR, 0, "1s", 0, CFG_MS_H, NULL, NULL, F(nack_reopen_ms), NULL },
};
#undef F

void amqpsink_finish_cfg(cfg_sink *sk, cfg_report *r)
{
    amqpsink_conf *s = sk->backend_conf;
    char why[200];

    if (sk->url == NULL)
        return; /* already reported */
    switch (amqpsink_urls_parse(sk->url, s, why, sizeof why)) {
    case 0:
        break;
    case -1:
        cfg_report_error(r, "url",
                         "expected an amqp:// or amqps:// URL like "
                         "amqp://user:pass@host:5672/vhost, got <secret> (%s)",
                         why);
        return;
    default:
        cfg_report_error(r, "url",
                         "expected a comma-separated list of amqp:// or amqps:// "
                         "URLs naming the nodes of one cluster, like "
                         "amqp://user:pass@node1:5672/vhost, amqp://user:pass@node2:5672/vhost, "
                         "got <secret> (%s)",
                         why);
        return;
    }
    if (sk->password) {
        char *p = strdup(sk->password);
        if (!p) {
            cfg_report_error(r, "password_file", "out of memory");
            return;
        }
        cfg_free_secret(s->pass);
        s->pass = p; /* password_file overrides the URL's password */
    }
    if (s->tls_ca_file && !s->tls) {
        char qb[300];
        cfg_report_error(r, "tls_ca_file",
                         "expected an amqps:// url when tls_ca_file is set, "
                         "got %s with an amqp:// url",
                         cfg_quote(s->tls_ca_file, qb, sizeof qb));
    }
    const char *files[] = { s->tls_ca_file, s->tls_cert, s->tls_key };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
        if (files[i] != NULL && digest_file(files[i], &s->files_digest) < 0)
            cfg_report_error(r,
                             i == 0   ? "tls_ca_file"
                             : i == 1 ? "tls_cert"
                                      : "tls_key",
                             "cannot read the file: %s", strerror(errno));
    if ((s->tls_cert || s->tls_key) && !s->tls)
        cfg_report_error(r, s->tls_cert ? "tls_cert" : "tls_key",
                         "expected an amqps:// url when a client certificate is set, got an "
                         "amqp:// url");
    else if ((s->tls_cert != NULL) != (s->tls_key != NULL))
        cfg_report_error(r, s->tls_cert ? "tls_key" : "tls_cert",
                         "expected both tls_cert and tls_key (a client certificate needs its "
                         "key), got only %s",
                         s->tls_cert ? "tls_cert" : "tls_key");
}

const cfg_backend amqpsink_backend = {
    .kind = CFG_BACKEND_SINK,
    .name = "rabbitmq",
    .expect = "the broker's URL, or a comma-separated list of URLs of one cluster",
    .url_default = "amqp://guest:guest@127.0.0.1:5672/%2f",
    .conf_size = sizeof(amqpsink_conf),
    .keys = amqpsink_keys,
    .n_keys = sizeof amqpsink_keys / sizeof amqpsink_keys[0],
    .finish_sink = amqpsink_finish_cfg,
    .conf_free = conf_free,
    .conf_equal = conf_equal,
    .ops = &amqpsink_ops,
};
