/* outbox_pg.h — liboutbox over libpq. See outbox.h for the rules. */
#ifndef OUTBOX_PG_H
#define OUTBOX_PG_H
#include <libpq-fe.h>
#include "outbox.h"
#ifdef __cplusplus
extern "C" {
#endif

/* Inserts one message. Returns OUTBOX_OK, OUTBOX_DUPLICATE or a negative code. */
int outbox_pg_send(PGconn *c, const outbox_queue *q, const outbox_message *m,
                   outbox_error *err);

/* Inserts n messages in one round trip. *inserted (may be NULL) receives the
 * number of rows written; when some message_ids already existed the others are
 * still written and OUTBOX_DUPLICATE is returned. Any negative code: nothing
 * was written by this call. */
int outbox_pg_send_batch(PGconn *c, const outbox_queue *q, const outbox_message *m,
                         size_t n, size_t *inserted, outbox_error *err);

#ifdef __cplusplus
}
#endif
#endif
