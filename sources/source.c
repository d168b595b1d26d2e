/*
 * source.c — picks the source implementation for an outbox.
 */
#include "relay/source.h"

const source_ops *source_ops_for(const cfg_outbox *ob)
{
    if (!ob)
        return NULL;
    switch (ob->source) {
    case CFG_SOURCE_POSTGRES:
        return &pgsrc_ops;
    case CFG_SOURCE_SQLSERVER:
        return &odbcsrc_ops;
    default:
        return NULL;
    }
}
