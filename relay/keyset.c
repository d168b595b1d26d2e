/* keyset.c — see keyset.h. Linear probing with tombstones; FNV-1a hashes. */
#include "relay/keyset.h"

#include <stdlib.h>
#include <string.h>

char keyset_tomb[1];
#define TOMB keyset_tomb

static uint64_t ks_hash(const char *k)
{
    uint64_t h = 1469598103934665603ULL;
    for (const unsigned char *p = (const unsigned char *)k; *p; p++) {
        h ^= *p;
        h *= 1099511628211ULL;
    }
    return h;
}

static keyset_slot *ks_find(const keyset *s, const char *key, uint64_t h)
{
    if (s->cap == 0)
        return NULL;
    size_t mask = s->cap - 1;
    for (size_t i = h & mask, n = 0; n < s->cap; i = (i + 1) & mask, n++) {
        keyset_slot *sl = &s->slots[i];
        if (sl->key == NULL)
            return NULL;
        if (sl->key != TOMB && sl->hash == h && strcmp(sl->key, key) == 0)
            return sl;
    }
    return NULL;
}

static int ks_grow(keyset *s)
{
    size_t ncap = s->cap ? s->cap * 2 : 16;
    while ((s->used + 1) * 2 > ncap)
        ncap *= 2;
    keyset_slot *ns = calloc(ncap, sizeof *ns);
    if (ns == NULL)
        return -1;
    for (size_t i = 0; i < s->cap; i++) {
        keyset_slot *sl = &s->slots[i];
        if (sl->key == NULL || sl->key == TOMB)
            continue;
        size_t j = sl->hash & (ncap - 1);
        while (ns[j].key != NULL)
            j = (j + 1) & (ncap - 1);
        ns[j] = *sl;
    }
    free(s->slots);
    s->slots = ns;
    s->cap = ncap;
    s->tombs = 0;
    return 0;
}

int keyset_put(keyset *s, const char *key, int64_t value)
{
    uint64_t h = ks_hash(key);
    keyset_slot *sl = ks_find(s, key, h);
    if (sl != NULL) {
        sl->value = value;
        return 0;
    }
    if ((s->used + s->tombs + 1) * 2 > s->cap && ks_grow(s) != 0)
        return -1;
    char *copy = strdup(key);
    if (copy == NULL)
        return -1;
    size_t mask = s->cap - 1, i = h & mask;
    while (s->slots[i].key != NULL && s->slots[i].key != TOMB)
        i = (i + 1) & mask;
    if (s->slots[i].key == TOMB)
        s->tombs--;
    s->slots[i] = (keyset_slot){ copy, h, value };
    s->used++;
    return 0;
}

bool keyset_get(const keyset *s, const char *key, int64_t *value)
{
    keyset_slot *sl = ks_find(s, key, ks_hash(key));
    if (sl == NULL)
        return false;
    if (value != NULL)
        *value = sl->value;
    return true;
}

void keyset_del(keyset *s, const char *key)
{
    keyset_slot *sl = ks_find(s, key, ks_hash(key));
    if (sl == NULL)
        return;
    free(sl->key);
    sl->key = TOMB;
    s->used--;
    s->tombs++;
}

void keyset_clear(keyset *s)
{
    for (size_t i = 0; i < s->cap; i++)
        if (s->slots[i].key != NULL && s->slots[i].key != TOMB)
            free(s->slots[i].key);
    free(s->slots);
    *s = (keyset){ 0 };
}

size_t keyset_size(const keyset *s)
{
    return s->used;
}
