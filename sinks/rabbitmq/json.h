/*
 * json.h — an outbox row's headers_json, read with jansson: a flat JSON
 * object whose values are strings, numbers, true, false or null, turned into
 * an AMQP field table (string → longstr 'S', integer → int64 'l', other
 * number → double 'd', true/false → boolean 't', null → void 'V'), in the
 * object's order. \u0000 is kept inside string values.
 * An integer outside int64 makes every number of that row a double 'd'
 * (jansson reads a document's integers either all as integers or all as
 * reals), so such a row is still published, as before jansson.
 * Nested objects/arrays, a top level that is not an object, invalid UTF-8,
 * lone surrogates, duplicate keys, \u0000 in a key, keys longer than 255
 * bytes, numbers outside double's range and trailing garbage are rejected:
 * such a row can never be published.
 */
#ifndef AMQPSINK_JSON_H
#define AMQPSINK_JSON_H

#include <stddef.h>
#include <amqp.h>

#include "lib/outbox_util.h"

/* Parses len bytes of json into *out. On success returns 0 and *mem owns
 * every byte out points into (free(*mem) when done; NULL for "{}").
 * On failure returns -1 with a one-line reason in err (jansson's text, with
 * the offset); nothing to free. */
OUTBOX_MUST_CHECK int amqpsink_json_headers(const char *json, size_t len, amqp_table_t *out,
                                            void **mem, char *err, size_t errlen);

#endif
