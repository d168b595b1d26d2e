#!/usr/bin/python3
"""Prints what arrived in a queue of the private RabbitMQ (used by scripts/demo.sh)."""
import sys
import time

import pika


def readable(body):
    """The body as text when it is UTF-8 without control characters, else its first bytes."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.isprintable():
        return text
    return f"{body[:24]!r}{'...' if len(body) > 24 else ''} (binary)"


port, queue, want = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
ch = conn.channel()
got = 0
deadline = time.monotonic() + 20
for method, props, body in ch.consume(queue, auto_ack=True, inactivity_timeout=0.2):
    if method is not None:
        got += 1
        print(f"  #{got}: message-id={props.message_id} type={props.type} "
              f"content-type={props.content_type} correlation-id={props.correlation_id} "
              f"headers={props.headers}")
        print(f"      body ({len(body)} bytes): {readable(body)}")
    if got >= want or time.monotonic() > deadline:
        break
ch.cancel()
conn.close()
print(f"{got} of {want} messages arrived in queue {queue!r}")
sys.exit(0 if got >= want else 1)
