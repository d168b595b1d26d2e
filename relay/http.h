/*
 * http.h — a tiny HTTP/1.0 server on the loop for /metrics, /healthz, /readyz.
 * One request per connection, 4 KiB request limit, 5 s deadline per client, 64 clients at
 * once (a new one closes the oldest; so does one that finds the descriptors used up).
 */
#ifndef RELAY_HTTP_H
#define RELAY_HTTP_H

#include <stdbool.h>
#include <stddef.h>

struct ev_loop;
typedef struct http_server http_server;

typedef struct http_handlers {
    void *ud;
    /* Returns a malloc'd body (caller frees) for /metrics, or NULL on OOM. */
    char *(*metrics)(void *ud, size_t *len);
    bool  (*ready)(void *ud);
} http_handlers;

/* listen: "host:port" ("[::1]:9187" for IPv6). NULL + err on failure. */
http_server *http_start(struct ev_loop *loop, const char *listen, const http_handlers *h,
                        char *err, size_t errlen);
void http_stop(http_server *s);

#endif
