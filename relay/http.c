/* http.c — see http.h. Non-blocking sockets, everything on the loop. */
#include "relay/http.h"

#include <errno.h>
#include <stdbool.h>
#include <ev.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "relay/log.h"

#define HTTP_MAX_REQ 4096
#define HTTP_DEADLINE 5.0
/* Clients served at once: past it the oldest is closed for the newest (a scraper or a probe
   is served; idle connections, a port scanner's, cannot take every descriptor the relay's
   own connections need). */
#define HTTP_MAX_CLIENTS 64
/* accept() failing for a reason of the process or the system (out of descriptors, of
   memory): the listening socket stays readable, so accepting pauses this long instead of
   trying again at every turn of the loop. */
#define HTTP_ACCEPT_PAUSE 1.0

typedef struct http_client {
    struct http_client *next;
    struct http_server *srv;
    int      fd;
    ev_io    io;
    ev_timer timer;
    char     req[HTTP_MAX_REQ];
    size_t   req_len;
    char    *resp;          /* owned */
    size_t   resp_len, resp_off;
} http_client;

struct http_server {
    struct ev_loop *loop;
    int             fd;
    ev_io           accept_io;
    ev_timer        accept_pause;   /* accept() failed: accept_io stopped until it fires */
    log_limit       accept_log;
    bool            paused;         /* accepting paused since the last accept */
    http_handlers   h;
    http_client    *clients;        /* newest first */
    size_t          n_clients;
};

static void client_close(http_client *c)
{
    http_server *s = c->srv;
    ev_io_stop(s->loop, &c->io);
    ev_timer_stop(s->loop, &c->timer);
    close(c->fd);
    for (http_client **pp = &s->clients; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            s->n_clients--;
            break;
        }
    free(c->resp);
    free(c);
}

static void set_response(http_client *c, int code, const char *reason, const char *ctype,
                         const char *body, size_t body_len)
{
    char head[256];
    int n = snprintf(head, sizeof head,
                     "HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n\r\n", code, reason, ctype, body_len);
    c->resp = malloc((size_t)n + body_len);
    if (c->resp == NULL) {
        c->resp_len = 0;
        return;
    }
    memcpy(c->resp, head, (size_t)n);
    memcpy(c->resp + n, body, body_len);
    c->resp_len = (size_t)n + body_len;
    c->resp_off = 0;
}

static void handle_request(http_client *c)
{
    http_server *s = c->srv;
    char method[8] = "", path[128] = "";
    if (sscanf(c->req, "%7s %127s", method, path) != 2) {
        set_response(c, 400, "Bad Request", "text/plain", "bad request\n", 12);
        return;
    }
    char *q = strchr(path, '?');
    if (q)
        *q = '\0';
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
        set_response(c, 405, "Method Not Allowed", "text/plain", "method not allowed\n", 19);
        return;
    }
    if (strcmp(path, "/metrics") == 0) {
        size_t len = 0;
        char *body = s->h.metrics(s->h.ud, &len);
        if (body == NULL) {
            set_response(c, 500, "Internal Server Error", "text/plain", "out of memory\n", 14);
            return;
        }
        set_response(c, 200, "OK", "text/plain; version=0.0.4", body, len);
        free(body);
    } else if (strcmp(path, "/healthz") == 0) {
        set_response(c, 200, "OK", "text/plain", "ok\n", 3);
    } else if (strcmp(path, "/readyz") == 0) {
        if (s->h.ready(s->h.ud))
            set_response(c, 200, "OK", "text/plain", "ready\n", 6);
        else
            set_response(c, 503, "Service Unavailable", "text/plain", "not ready\n", 10);
    } else {
        set_response(c, 404, "Not Found", "text/plain", "not found\n", 10);
    }
}

static void client_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    http_client *c = w->data;
    if (revents & EV_READ) {
        ssize_t n = read(c->fd, c->req + c->req_len, sizeof c->req - 1 - c->req_len);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        if (n <= 0) {
            client_close(c);
            return;
        }
        c->req_len += (size_t)n;
        c->req[c->req_len] = '\0';
        if (strstr(c->req, "\r\n\r\n") == NULL && strstr(c->req, "\n\n") == NULL) {
            if (c->req_len >= sizeof c->req - 1)
                client_close(c);
            return;
        }
        handle_request(c);
        if (c->resp == NULL) {
            client_close(c);
            return;
        }
        ev_io_stop(loop, &c->io);
        ev_io_set(&c->io, c->fd, EV_WRITE);
        ev_io_start(loop, &c->io);
        return;
    }
    if (revents & EV_WRITE) {
        ssize_t n = write(c->fd, c->resp + c->resp_off, c->resp_len - c->resp_off);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        if (n <= 0) {
            client_close(c);
            return;
        }
        c->resp_off += (size_t)n;
        if (c->resp_off == c->resp_len)
            client_close(c);
    }
}

static void client_timeout_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop; (void)revents;
    client_close(w->data);
}

static void close_oldest(http_server *s)
{
    http_client *oldest = s->clients;
    while (oldest->next != NULL)
        oldest = oldest->next;
    client_close(oldest);
}

static void accept_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)revents;
    http_server *s = w->data;
    bool evicted = false;
    for (;;) {
        int fd = accept4(s->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            int e = errno;
            if (e == EAGAIN || e == EINTR || e == ECONNABORTED)
                return;
            const char *why = strerror(e);
            log_fields f = { .event = "http_error", .error = why };
            if ((e == EMFILE || e == ENFILE) && s->n_clients > 0 && !evicted) {
                /* out of descriptors with clients open: the oldest makes room */
                log_fail(&s->accept_log, LOG_WARN, &f, "http: accept: %s; closing the oldest "
                         "client for each new one", why);
                close_oldest(s);
                evicted = true;
                continue;
            }
            log_fail(&s->accept_log, LOG_WARN, &f, "http: accept: %s; not accepting for %.0f s",
                     why, HTTP_ACCEPT_PAUSE);
            s->paused = true;
            ev_io_stop(loop, &s->accept_io);
            ev_timer_set(&s->accept_pause, HTTP_ACCEPT_PAUSE, 0.);
            ev_timer_start(loop, &s->accept_pause);
            return;
        }
        evicted = false;
        if (s->paused) {
            s->paused = false;
            log_ok(&s->accept_log, LOG_INFO, &(log_fields){ .event = "http_error" },
                   "http: accepting again");
        }
        if (s->n_clients >= HTTP_MAX_CLIENTS)
            close_oldest(s);
        http_client *c = calloc(1, sizeof *c);
        if (c == NULL) {
            close(fd);
            return;
        }
        c->srv = s;
        c->fd = fd;
        c->next = s->clients;
        s->clients = c;
        s->n_clients++;
        ev_io_init(&c->io, client_cb, fd, EV_READ);
        c->io.data = c;
        ev_io_start(loop, &c->io);
        ev_timer_init(&c->timer, client_timeout_cb, HTTP_DEADLINE, 0.);
        c->timer.data = c;
        ev_timer_start(loop, &c->timer);
    }
}

static void accept_pause_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)revents;
    http_server *s = w->data;
    ev_io_start(loop, &s->accept_io);
}

http_server *http_start(struct ev_loop *loop, const char *listen_addr, const http_handlers *h,
                        char *err, size_t errlen)
{
    char host[256];
    const char *colon = strrchr(listen_addr, ':');
    if (colon == NULL || colon == listen_addr || colon[1] == '\0') {
        snprintf(err, errlen, "http_listen \"%s\": expected host:port", listen_addr);
        return NULL;
    }
    size_t hl = (size_t)(colon - listen_addr);
    if (listen_addr[0] == '[' && hl >= 2 && listen_addr[hl - 1] == ']') {
        listen_addr++;
        hl -= 2;
    }
    if (hl >= sizeof host) {
        snprintf(err, errlen, "http_listen: host too long");
        return NULL;
    }
    memcpy(host, listen_addr, hl);
    host[hl] = '\0';

    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                              .ai_flags = AI_PASSIVE | AI_NUMERICSERV };
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(host, colon + 1, &hints, &ai);
    if (rc != 0) {
        snprintf(err, errlen, "http_listen %s: %s", host, gai_strerror(rc));
        return NULL;
    }
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(err, errlen, "http_listen: socket: %s", strerror(errno));
        freeaddrinfo(ai);
        return NULL;
    }
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
        snprintf(err, errlen, "http_listen %s:%s: %s", host, colon + 1, strerror(errno));
        close(fd);
        freeaddrinfo(ai);
        return NULL;
    }
    freeaddrinfo(ai);
    http_server *s = calloc(1, sizeof *s);
    if (s == NULL) {
        snprintf(err, errlen, "http: out of memory");
        close(fd);
        return NULL;
    }
    s->loop = loop;
    s->fd = fd;
    s->h = *h;
    ev_io_init(&s->accept_io, accept_cb, fd, EV_READ);
    s->accept_io.data = s;
    ev_io_start(loop, &s->accept_io);
    ev_timer_init(&s->accept_pause, accept_pause_cb, HTTP_ACCEPT_PAUSE, 0.);
    s->accept_pause.data = s;
    return s;
}

void http_stop(http_server *s)
{
    if (s == NULL)
        return;
    while (s->clients)
        client_close(s->clients);
    ev_io_stop(s->loop, &s->accept_io);
    ev_timer_stop(s->loop, &s->accept_pause);
    close(s->fd);
    free(s);
}
