/*
 * source.c — registers the sources this relay is built with (sources.h).
 * The first one registered is the default of `source =`.
 */
#include "sources/sources.h"

static const cfg_backend backends[] = {
    { .kind = CFG_BACKEND_SOURCE, .name = "postgres", .expect = "a libpq conninfo",
      .finish_outbox = pgsrc_finish_cfg, .ops = &pgsrc_ops },
    { .kind = CFG_BACKEND_SOURCE, .name = "sqlserver",
      .expect = "an ODBC connection string",
      .finish_outbox = odbcsrc_finish_cfg, .ops = &odbcsrc_ops },
    /* the same source under its driver's name (psqlODBC against PostgreSQL, say) */
    { .kind = CFG_BACKEND_SOURCE, .name = "odbc", .expect = "an ODBC connection string",
      .finish_outbox = odbcsrc_finish_cfg, .ops = &odbcsrc_ops },
};

int sources_register(void)
{
    for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
        if (cfg_register(&backends[i]) != 0)
            return -1;
    return 0;
}
