/*
 * peer.h — names the database an outbox connects to, for log lines:
 * "127.0.0.1:5432/app" (host:port/database), without anything secret from the
 * connection string (no user, no password).
 *
 *   char peer[300];
 *   peer_of_outbox(ob, peer, sizeof peer);
 */
#ifndef RELAY_PEER_H
#define RELAY_PEER_H

#include <stddef.h>
#include "config/cfg.h"

/* Always writes a string (at worst "?/database"). */
void peer_of_outbox(const cfg_outbox *ob, char *buf, size_t len);

#endif
