#!/usr/bin/env bash
# One command, on a fresh Debian 12 machine (as root): install what is missing, start the
# private PostgreSQL and RabbitMQ, build, create database "app" with its outbox, run the relay
# with config/demo.ini, write 10 messages through liboutbox (examples/producer.c) and show
# what arrived in RabbitMQ. The relay is stopped at the end; the services keep running
# (scripts/services.sh stop stops them).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/services.sh start
eval "$(scripts/services.sh env)"
echo "== building"
make -j2 all >/dev/null

PSQL=(psql -X -q -h 127.0.0.1 -p "$OUTBOX_PG_PORT" -U postgres)
if [ -z "$("${PSQL[@]}" -d postgres -tAc "select 1 from pg_database where datname = 'app'")" ]; then
    "${PSQL[@]}" -d postgres -c "create database app"
fi
echo "== outbox-relay init"
build/outbox-relay init -c config/demo.ini

echo "== a queue for the demo messages (default exchange, routing key = queue name)"
/usr/bin/python3 - "$OUTBOX_AMQP_PORT" <<'PY'
import sys, pika
c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", int(sys.argv[1])))
ch = c.channel()
ch.queue_declare("outbox-demo", durable=True)
ch.queue_purge("outbox-demo")
c.close()
PY

echo "== starting the relay (log: .services/demo-relay.log)"
build/outbox-relay run -c config/demo.ini 2> .services/demo-relay.log &
RELAY=$!
trap 'kill -TERM $RELAY 2>/dev/null || true; wait $RELAY 2>/dev/null || true' EXIT

echo "== the application: 10 JSON messages over 3 partition keys, one transaction"
build/examples/producer --dsn "host=127.0.0.1 port=$OUTBOX_PG_PORT dbname=app user=postgres" \
    --database app --count 10 --keys 3 --routing-key outbox-demo --batch 10 --prefix order.created --json

echo "== what arrived in RabbitMQ"
/usr/bin/python3 scripts/demo_consume.py "$OUTBOX_AMQP_PORT" outbox-demo 10

echo "== outbox-relay stats"
build/outbox-relay stats -c config/demo.ini
echo "== metrics (excerpt)"
/usr/bin/python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9187/metrics", timeout=5).read().decode())' \
    | grep -E '^outbox_relay_(relayed_total|backlog|in_flight)' || true

kill -TERM $RELAY
wait $RELAY
trap - EXIT
echo "== relay stopped cleanly; its log:"
cat .services/demo-relay.log
