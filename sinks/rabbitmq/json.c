/*
 * json.c — an outbox row's headers_json → AMQP field table (see json.h).
 * jansson parses and checks the JSON (syntax, UTF-8, escapes, duplicate keys,
 * numbers); this file only maps a flat object's values onto AMQP field kinds.
 */
#include "sinks/rabbitmq/json.h"

#include <jansson.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A duplicate key is an error (jansson would otherwise keep the last one);
 * \u0000 is allowed inside string values (jansson refuses it in keys); any
 * top-level value is read so that a non-object is named by its type below. */
#define HDR_LOAD_FLAGS (JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL | JSON_DECODE_ANY)

#define HDR_KEY_MAX 255   /* AMQP field names are shortstr */

static const char *type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:  return "an object";
    case JSON_ARRAY:   return "an array";
    case JSON_STRING:  return "a string";
    case JSON_INTEGER:
    case JSON_REAL:    return "a number";
    case JSON_TRUE:    return "true";
    case JSON_FALSE:   return "false";
    case JSON_NULL:    return "null";
    }
    return "a value";
}

/* key (valid UTF-8: jansson checked it) as a JSON string in ASCII, cut to
 * fit out with "..." appended: safe to log whatever the key holds. */
static void key_text(const char *key, size_t klen, char *out, size_t outlen)
{
    json_t *s = json_stringn_nocheck(key, klen);
    char   *text = s != NULL ? json_dumps(s, JSON_ENCODE_ANY | JSON_ENSURE_ASCII) : NULL;

    json_decref(s);
    if (text == NULL)
        snprintf(out, outlen, "(out of memory)");
    else if (strlen(text) < outlen)
        snprintf(out, outlen, "%s", text);
    else   /* ASCII, so any cut is clean */
        snprintf(out, outlen, "%.*s...", (int)(outlen - 4), text);
    free(text);
}

int amqpsink_json_headers(const char *json, size_t len, amqp_table_t *out,
                          void **mem, char *err, size_t errlen)
{
    json_error_t        je;
    json_t             *root, *v;
    const char         *key;
    size_t              klen, n, bytes = 0, i = 0;
    amqp_table_entry_t *ents;
    char               *block = NULL, *buf;
    char                ktext[80];

    out->num_entries = 0;
    out->entries = NULL;
    *mem = NULL;
    root = json_loadb(json, len, HDR_LOAD_FLAGS, &je);
    if (root == NULL && json_error_code(&je) == json_error_numeric_overflow)
        /* An integer outside int64, which AMQP cannot carry as one: the row is
         * read again with every number as a double (see json.h). A real
         * outside double's range fails again, and is reported. */
        root = json_loadb(json, len, HDR_LOAD_FLAGS | JSON_DECODE_INT_AS_REAL, &je);
    if (root == NULL) {
        snprintf(err, errlen, "headers_json: %s%s at offset %d",
                 json_error_code(&je) == json_error_invalid_utf8 ? "invalid UTF-8: " : "",
                 je.text, je.position);
        return -1;
    }
    if (!json_is_object(root)) {
        snprintf(err, errlen, "headers_json: expected a JSON object, got %s", type_name(root));
        goto fail;
    }

    /* First pass: check every entry and size the block. */
    n = json_object_size(root);
    if (n > INT_MAX || n > (SIZE_MAX - len) / sizeof *ents) {
        snprintf(err, errlen, "headers_json: too many keys (%zu)", n);
        goto fail;
    }
    json_object_keylen_foreach(root, key, klen, v) {
        if (klen > HDR_KEY_MAX) {
            key_text(key, klen, ktext, sizeof ktext);
            snprintf(err, errlen, "headers_json: key %s is %zu bytes, longer than 255 bytes",
                     ktext, klen);
            goto fail;
        }
        if (json_is_object(v) || json_is_array(v)) {
            key_text(key, klen, ktext, sizeof ktext);
            snprintf(err, errlen,
                     "headers_json: nested %s not allowed (headers must be a flat object): key %s",
                     json_is_object(v) ? "object" : "array", ktext);
            goto fail;
        }
        bytes += klen;
        if (json_is_string(v))
            bytes += json_string_length(v);
    }
    if (n == 0) {
        json_decref(root);
        return 0;
    }
    /* Decoded text is never longer than its JSON spelling: bytes <= len. */
    block = malloc(n * sizeof *ents + bytes);
    if (block == NULL) {
        snprintf(err, errlen, "headers_json: out of memory");
        goto fail;
    }
    ents = (amqp_table_entry_t *)(void *)block;
    buf = block + n * sizeof *ents;

    /* Second pass: copy keys and strings out of jansson's tree, in the
     * object's order (jansson keeps insertion order). */
    json_object_keylen_foreach(root, key, klen, v) {
        amqp_table_entry_t *e = &ents[i++];

        memcpy(buf, key, klen);
        e->key.bytes = buf;
        e->key.len = klen;
        buf += klen;
        switch (json_typeof(v)) {
        case JSON_STRING:
            e->value.kind = AMQP_FIELD_KIND_UTF8;
            e->value.value.bytes.len = json_string_length(v);
            memcpy(buf, json_string_value(v), e->value.value.bytes.len);
            e->value.value.bytes.bytes = buf;
            buf += e->value.value.bytes.len;
            break;
        case JSON_INTEGER:
            e->value.kind = AMQP_FIELD_KIND_I64;
            e->value.value.i64 = (int64_t)json_integer_value(v);
            break;
        case JSON_REAL:
            e->value.kind = AMQP_FIELD_KIND_F64;
            e->value.value.f64 = json_real_value(v);
            break;
        case JSON_TRUE:
        case JSON_FALSE:
            e->value.kind = AMQP_FIELD_KIND_BOOLEAN;
            e->value.value.boolean = json_is_true(v);
            break;
        case JSON_NULL:
        case JSON_OBJECT:   /* refused in the first pass */
        case JSON_ARRAY:
            e->value.kind = AMQP_FIELD_KIND_VOID;
            break;
        }
    }
    json_decref(root);
    out->num_entries = (int)n;
    out->entries = ents;
    *mem = block;   /* ownership to the caller */
    return 0;
fail:
    json_decref(root);
    free(block);
    return -1;
}
