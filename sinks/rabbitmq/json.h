/*
 * json.h — strict parser for an outbox row's headers_json: a flat JSON
 * object whose values are strings, numbers, true, false or null, turned into
 * an AMQP field table (string → longstr 'S', integer → int64 'l', other
 * number → double 'd', true/false → boolean 't', null → void 'V').
 * Nested objects/arrays, invalid UTF-8, lone surrogates, duplicate keys,
 * keys longer than 255 bytes and trailing garbage are rejected: such a row
 * can never be published.
 */
#ifndef AMQPSINK_JSON_H
#define AMQPSINK_JSON_H

#include <stddef.h>
#include <amqp.h>

/* Parses len bytes of json into *out. On success returns 0 and *mem owns
 * every byte out points into (free(*mem) when done; NULL for "{}").
 * On failure returns -1 with a one-line reason in err; nothing to free. */
int amqpsink_json_headers(const char *json, size_t len, amqp_table_t *out,
                          void **mem, char *err, size_t errlen);

#endif
