#!/bin/bash
# deploy/healthcheck.sh — the container image's HEALTHCHECK (see deploy/Dockerfile).
#   healthcheck.sh [HOST:PORT]
# GETs /healthz from the relay's http_listen (default: $OUTBOX_RELAY_HEALTH_ADDR, else
# 127.0.0.1:9187) and exits 0 on "200", 1 otherwise, as Docker's HEALTHCHECK expects.
# The runtime image has no curl or wget; bash (Essential in Debian, so in debian:12-slim)
# can open a TCP connection itself through /dev/tcp, which is all one HTTP/1.0 GET needs.
# http_listen = 0.0.0.0:9187 (or 127.0.0.1:9187) in relay.ini are both reachable here.
set -u

addr=${1:-${OUTBOX_RELAY_HEALTH_ADDR:-127.0.0.1:9187}}
host=${addr%:*}
port=${addr##*:}
host=${host#[}      # [::1]:9187 → ::1
host=${host%]}

# (bash's own "connection refused" lines are dropped: the line below says it once)
if ! { exec 3<>"/dev/tcp/$host/$port"; } 2>/dev/null; then
    echo "healthcheck: cannot connect to $addr (is http_listen set in relay.ini?)" >&2
    exit 1
fi
if ! printf 'GET /healthz HTTP/1.0\r\nHost: %s\r\n\r\n' "$addr" >&3; then
    echo "healthcheck: cannot send the request to $addr" >&2
    exit 1
fi
status=
if ! IFS= read -r -t 5 status <&3; then
    echo "healthcheck: no answer from $addr within 5s" >&2
    exit 1
fi
exec 3<&-
status=${status%$'\r'}
case $status in
    "HTTP/1."[01]" 200 "*) exit 0 ;;
esac
echo "healthcheck: $addr/healthz answered \"$status\"" >&2
exit 1
