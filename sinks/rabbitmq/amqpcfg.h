/*
 * amqpcfg.h — the rabbitmq sink's own settings: its keys, its URLs and the
 * checks only it understands: amqpsink_backend (sinks/sinks.h), registered
 * with config/ as the "rabbitmq" sink by sinks/sink.c.
 */
#ifndef SINKS_RABBITMQ_AMQPCFG_H
#define SINKS_RABBITMQ_AMQPCFG_H

#include <stddef.h>
#include "config/cfg.h"

/* Parses an AMQP URL into the sink's host/port/user/pass/vhost/tls fields. */
int amqp_url_parse(const char *url, cfg_sink *s, char *err, size_t errlen);
/* Parses url: one AMQP URL or a comma-separated list of them (spaces around the commas
 * allowed) naming the nodes of one cluster: the same scheme, user, password and vhost,
 * distinct addresses, at most CFG_MAX_BROKERS. Fills host/port/user/pass/vhost/tls (those
 * of the first URL) and brokers/n_brokers (each address in order). Returns 0; -1 when
 * the only URL is invalid (err: why, as amqp_url_parse); -2 when a list is (err: why,
 * naming the URL by its position). The value is a secret: err never quotes it. On error s
 * is unchanged. */
int amqp_urls_parse(const char *list, cfg_sink *s, char *err, size_t errlen);

/* The backend's finish_sink: parses url (errors name no secret), applies password_file,
   checks the TLS keys against the scheme. */
void amqpsink_finish_cfg(cfg_sink *s, cfg_report *r);

#endif
