"""The RabbitMQ sink writes at most about 1 MiB of messages in one turn of the event loop
(issue 22: large messages never hold the loop).

A relay holding many large rows publishes them from one callback (the drain publishes
while the sink accepts). Before, the sink accepted them for as long as its socket took
them, and the socket drains as fast as the broker reads: 61 rows of 512 KiB (30 MiB) went
out in one callback of the big-message bench and held the loop 140 ms, with no confirm
read and no claim started meanwhile. Now one turn of the loop writes about 1 MiB, whichever
messages it belongs to, and publish() says SINK_EAGAIN until a later turn (on_writable).

tests/c/sink_amqp_test.c counts the payload bytes publish() accepted in each turn of its
loop (max_burst in its summary); every message must still be confirmed and arrive whole."""
import secrets

import pytest

from test_sink_amqp import drive, get_all

KIB = 1024
TURN_BYTES = 1024 * KIB     # AMQPSINK_PUMP_BYTES


@pytest.fixture
def queue(services):
    """A durable queue of its own (the default exchange routes to it), deleted afterwards."""
    q = f"t.{secrets.token_hex(4)}.turns"
    c = services.amqp_connect()
    c.channel().queue_declare(q, durable=True)
    c.close()
    yield q
    c = services.amqp_connect()
    c.channel().queue_delete(q)
    c.close()


def test_one_turn_of_the_loop_writes_about_one_mebibyte(services, build, queue):
    n, size = 48, 512 * KIB
    r = drive(services, build, "--tag", secrets.token_hex(4), f"-,{queue},{n},size={size}")
    assert r.rc == 0, r
    assert r.summary["acked"] == n, r
    # a turn starts a message while it has written less than TURN_BYTES: at most one
    # message past them
    assert r.summary["max_burst"] <= TURN_BYTES + size, \
        f"{r.summary['max_burst']} payload bytes accepted in one turn of the loop\n{r}"
    msgs = get_all(services, queue)
    assert len(msgs) == n
    assert all(len(body) == size for _, body in msgs)
