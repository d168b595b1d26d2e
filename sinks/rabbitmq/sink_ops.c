/*
 * sink_ops.c — picks the sink implementation for a configured sink.
 * (Lives here rather than sinks/sink.c: the Makefile builds only sinks/<name>/ files.)
 */
#include "relay/sink.h"

#include <stddef.h>

const sink_ops *sink_ops_for(const cfg_sink *sc)
{
    if (sc == NULL)
        return NULL;
    switch (sc->type) {
    case CFG_SINK_RABBITMQ:
        return &amqpsink_ops;
    default:
        return NULL;
    }
}
