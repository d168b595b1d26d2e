/* outbox_odbc.h — liboutbox over ODBC (SQL Server; PostgreSQL via psqlODBC).
 * The dialect is chosen from SQL_DBMS_NAME. The connection must have
 * autocommit off (the caller's transaction). See outbox.h for the rules. */
#ifndef OUTBOX_ODBC_H
#define OUTBOX_ODBC_H
#include <sql.h>
#include "outbox.h"
#ifdef __cplusplus
extern "C" {
#endif

int outbox_odbc_send(SQLHDBC c, const outbox_queue *q, const outbox_message *m,
                     outbox_error *err);
int outbox_odbc_send_batch(SQLHDBC c, const outbox_queue *q, const outbox_message *m,
                           size_t n, size_t *inserted, outbox_error *err);

#ifdef __cplusplus
}
#endif
#endif
