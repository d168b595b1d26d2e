/*
 * sink.c — registers the sinks this relay is built with (sinks.h). The first
 * one registered is the default of `type =`.
 */
#include "sinks/sinks.h"

#include "sinks/rabbitmq/amqpurl.h"

static const cfg_backend backends[] = {
    { .kind = CFG_BACKEND_SINK, .name = "rabbitmq",
      .url_default = "amqp://guest:guest@127.0.0.1:5672/%2f",
      .finish_sink = amqpsink_finish_cfg, .ops = &amqpsink_ops },
};

int sinks_register(void)
{
    for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
        if (cfg_register(&backends[i]) != 0)
            return -1;
    return 0;
}
