/*
 * sinks.h — the sinks this relay is built with. Each implements relay/'s
 * sink_ops and registers with config/ (a cfg_backend: its `type =` name, its
 * default url, the checks only it understands). The program calls
 * sinks_register() once before loading a configuration; relay/ then reaches a
 * sink only through cfg_sink.type->ops (relay/sink.h: sink_ops_of).
 */
#ifndef SINKS_SINKS_H
#define SINKS_SINKS_H

#include "config/cfg.h"
#include "relay/sink.h"

/* Registers every sink with config/. 0, or -1 when the registry is full. */
int sinks_register(void);

/* sinks/rabbitmq: its ops and registration (keys: mandatory, heartbeat, tls_*, nack_reopen) */
extern const sink_ops amqpsink_ops;
extern const cfg_backend amqpsink_backend;

#endif
