/*
 * amqpcfg.h — the rabbitmq sink's own settings: its keys, its URLs and the
 * checks only it understands: amqpsink_backend (sinks/sinks.h), registered
 * with config/ as the "rabbitmq" sink by sinks/sink.c. config/ allocates an
 * amqpsink_conf for each [sink.NAME] of this type (cfg_sink.backend_conf),
 * applies this sink's keys to it, and amqpsink_finish_cfg completes it.
 */
#ifndef SINKS_RABBITMQ_AMQPCFG_H
#define SINKS_RABBITMQ_AMQPCFG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "config/cfg.h"
#include "lib/outbox_util.h"

/* One broker address of a sink's url (a list names the nodes of one cluster). */
typedef struct amqpsink_broker {
    char *host; /* decoded; an IPv6 address without brackets */
    int port;
    char *addr; /* "host:port" ("[v6]:port") for logs and metrics */
} amqpsink_broker;

#define AMQPSINK_MAX_BROKERS     16 /* URLs in one sink's url list */
#define AMQPSINK_NACK_REOPEN_MIN 3  /* nacks in a row (no ack) before nack_reopen may apply */

typedef struct amqpsink_conf {
    /* the parsed url, filled by amqpsink_finish_cfg (password_file applied); with a list,
       host/port are those of the first URL and user/pass/vhost/tls are common to all
       (a list that differs is refused) */
    char *host;
    int port;
    amqpsink_broker *brokers; /* every address of url, in list order; n_brokers >= 1 once loaded */
    size_t n_brokers;
    char *user;
    char *pass;  /* secret: never log */
    char *vhost; /* decoded */
    bool tls;    /* amqps */
    /* this sink's keys */
    bool mandatory;         /* default true; false is refused (unroutable would be lost) */
    int64_t heartbeat_ms;   /* default 30s; 0 disables */
    char *tls_ca_file;      /* tls_ca_file key, NULL: system default */
    bool tls_verify;        /* tls_verify, default true */
    char *tls_cert;         /* tls_cert key: client certificate (PEM) for amqps, NULL: none */
    char *tls_key;          /* tls_key key: its private key (PEM), NULL: none */
    int64_t nack_reopen_ms; /* reopen a publishing channel that got only nacks for this long
                                   (at least AMQPSINK_NACK_REOPEN_MIN, no ack); 0: never; default 1s */
    uint64_t files_digest;  /* digest of the files read when connecting (TLS files): a
                                   reload sees one replaced at the same path */
} amqpsink_conf;

/* The settings of a rabbitmq sink (NULL in a cfg_sink filled by hand without them). */
static inline const amqpsink_conf *amqpsink_conf_of(const cfg_sink *s)
{
    return (const amqpsink_conf *)s->backend_conf;
}

/* Parses an AMQP URL into host/port/user/pass/vhost/tls. */
OUTBOX_MUST_CHECK int amqpsink_url_parse(const char *url, amqpsink_conf *s, char *err,
                                         size_t errlen);
/* Parses url: one AMQP URL or a comma-separated list of them (spaces around the commas
 * allowed) naming the nodes of one cluster: the same scheme, user, password and vhost,
 * distinct addresses, at most AMQPSINK_MAX_BROKERS. Fills host/port/user/pass/vhost/tls (those
 * of the first URL) and brokers/n_brokers (each address in order). Returns 0; -1 when
 * the only URL is invalid (err: why, as amqpsink_url_parse); -2 when a list is (err: why,
 * naming the URL by its position). The value is a secret: err never quotes it. On error s
 * is unchanged. */
OUTBOX_MUST_CHECK int amqpsink_urls_parse(const char *list, amqpsink_conf *s, char *err,
                                          size_t errlen);
/* Frees a conf's brokers array (and sets it to NULL, 0). */
void amqpsink_brokers_free(amqpsink_conf *s);
/* Frees every string a conf holds (the backend's conf_free) and zeroes it. */
void amqpsink_conf_clear(amqpsink_conf *s);

/* The backend's finish_sink: parses url (errors name no secret), applies password_file,
   checks the TLS keys against the scheme. */
void amqpsink_finish_cfg(cfg_sink *s, cfg_report *r);

#endif
