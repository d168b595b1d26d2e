/*
 * sources.h — the sources this relay is built with. Each implements relay/'s
 * source_ops and registers with config/ (a cfg_backend: its `source =` name,
 * what its conninfo holds, the checks only it understands). The program calls
 * sources_register() once before loading a configuration; relay/ then reaches a
 * source only through cfg_outbox.source->ops (relay/source.h: source_ops_of).
 */
#ifndef SOURCES_SOURCES_H
#define SOURCES_SOURCES_H

#include <stddef.h>
#include "config/cfg.h"
#include "relay/source.h"

/* Registers every source with config/. 0, or -1 when the registry is full. */
int sources_register(void);

/* sources/pg: PostgreSQL through libpq */
extern const source_ops pgsrc_ops;
void pgsrc_finish_cfg(cfg_outbox *o, cfg_report *r);
void pgsrc_peer(const char *conninfo, const char *database, char *buf, size_t len);

/* sources/odbc: SQL Server (and PostgreSQL through psqlODBC) through unixODBC */
extern const source_ops odbcsrc_ops;
void odbcsrc_finish_cfg(cfg_outbox *o, cfg_report *r);
void odbcsrc_peer(const char *conninfo, const char *database, char *buf, size_t len);

#endif
