/*
 * keyset.h — a small open-addressing map from partition key (string) to an
 * int64 value, used by the drain core for "key has a message in flight" and
 * "key is blocked behind a failed row". Keys are copied; the set owns them.
 */
#ifndef RELAY_KEYSET_H
#define RELAY_KEYSET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct keyset_slot { char *key; uint64_t hash; int64_t value; } keyset_slot;
typedef struct keyset {
    keyset_slot *slots;
    size_t       cap;    /* power of two, or 0 */
    size_t       used;   /* live keys */
    size_t       tombs;  /* deleted slots */
} keyset;

/* Marks a deleted slot; iterate slots skipping NULL and keyset_tomb keys. */
extern char keyset_tomb[1];

/* 0 ok, -1 out of memory. Replaces the value if the key exists. */
int   keyset_put(keyset *s, const char *key, int64_t value);
/* true and *value (may be NULL) if present. */
bool  keyset_get(const keyset *s, const char *key, int64_t *value);
void  keyset_del(keyset *s, const char *key);
void  keyset_clear(keyset *s);   /* frees everything; the set is reusable */
size_t keyset_size(const keyset *s);

#endif
