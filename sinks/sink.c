/*
 * sink.c — registers the sinks this relay is built with (sinks.h). The first
 * one registered is the default of `type =`.
 */
#include "sinks/sinks.h"

static const cfg_backend *const backends[] = { &amqpsink_backend };

int sinks_register(void)
{
    for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
        if (cfg_register(backends[i]) != 0)
            return -1;
    return 0;
}
