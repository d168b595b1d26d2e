"""More conditions production meets (issue 23, continued from test_relay_production.py): the
broker's vhost deleted under the relay, a reload whose new broker or database cannot be
reached, `log_file` that cannot be reopened. For each, while the cause lasts: nothing lost,
nothing marked sent that the broker did not confirm, nothing dead-lettered for a cause that is
not the message's, no spinning (the relay's CPU time over the fault window, from /proc), a
WARN/ERROR naming the cause at the default log level; and the relay recovers on its own once
the cause goes away.

Each test uses its own database, queue, vhost or user and relay name."""
import secrets
import time

import pika
import psycopg

from conftest import wait_for
from relay_util import check_against_db, consume, order_report, proc_cpu_seconds
from test_relay_faults import Case, relayed, wait_relayed
from test_relay_production import SPIN, dead_rows, sent_count, warn_lines


def marked_seqs(pgdb):
    with psycopg.connect(pgdb.dsn, autocommit=True) as c:
        return {int(s) for (s,) in c.execute(
            "select headers->>'seq' from outbox.messages where sent_at is not null")}


def vhost_channel(services, vhost):
    """A pika connection + channel to `vhost` as the harness's guest user."""
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=services.amqp_port, virtual_host=vhost, heartbeat=0,
        blocked_connection_timeout=30))
    return conn, conn.channel()


def ctl(services, *args):
    p = services.rabbitmqctl(*args)
    assert p.returncode == 0, f"rabbitmqctl {' '.join(args)}: {p.stdout}{p.stderr}"


def make_vhost(services, vhost, user, queue):
    """The vhost, the guest user's permissions on it, the queue, and only then the relay user's
    permissions: the relay cannot publish before its queue exists (such rows would come back
    unroutable and count as failed attempts)."""
    ctl(services, "add_vhost", vhost)
    ctl(services, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    conn, ch = vhost_channel(services, vhost)
    try:
        ch.queue_declare(queue=queue, durable=True)
    finally:
        conn.close()
    ctl(services, "set_permissions", "-p", vhost, user, ".*", ".*", ".*")


def test_broker_vhost_deleted_mid_run(services, pgdb, relay_bin, build, tmp_path):
    """The relay's vhost is deleted mid-run (`rabbitmqctl delete_vhost`): the broker closes
    the relay's connection and refuses every new one ("vhost ... not found"). Nothing may be
    marked or dead-lettered meanwhile, the relay must not spin and must say why; once the
    vhost is back (permissions and queue with it) it resumes by itself. The messages the
    deleted vhost held are gone with it (the operator's doing); every row not marked sent
    when the vhost went arrives in the new queue, in order per key."""
    n, first, keys = 20000, 2000, 100
    tag = secrets.token_hex(4)
    vhost, user, pw = f"vh-{tag}", f"relay-vh-{tag}", secrets.token_hex(8)
    ctl(services, "add_user", user, pw)
    c = Case(services, pgdb, relay_bin, build, tmp_path, "vhostdel", declare_queue=False,
             reconnect_max="1s",
             sink={"url": f"amqp://{user}:{pw}@127.0.0.1:{services.amqp_port}/{vhost}",
                   "reconnect_max": "1s"})
    deleted = False
    r = None
    try:
        make_vhost(services, vhost, user, c.q)
        c.produce(first, keys, size=256, batch=1000)
        r = c.start()
        r.wait_log("became the active relay")
        wait_relayed(r, first)
        ctl(services, "delete_vhost", vhost)
        deleted = True
        wait_for(lambda: warn_lines(r.text(), "sink=main: down:")
                 and r.metric("outbox_relay_sink_up") == 0, 30, interval=0.1,
                 desc="the relay's broker connection down")
        c.produce(n - first, keys, size=256, batch=1000, start=first)
        time.sleep(1.0)
        at = relayed(r)
        before = marked_seqs(pgdb)
        cpu0, t0 = proc_cpu_seconds(r.proc.pid), time.monotonic()
        time.sleep(6.0)
        cpu = proc_cpu_seconds(r.proc.pid) - cpu0
        span = time.monotonic() - t0
        sent1 = sent_count(pgdb)
        dead_during = dead_rows(pgdb)
        make_vhost(services, vhost, user, c.q)
        deleted = False
        t_back = time.monotonic()
        c.wait_all_sent(n, timeout=90)
        recovered = time.monotonic() - t_back
        text = r.text()
        dead_total = r.metric("outbox_relay_dead_total")
    finally:
        if r is not None:
            r.stop_clean()
        services.rabbitmqctl("delete_user", user)
    try:
        conn, ch = vhost_channel(services, vhost)
        try:
            depth = ch.queue_declare(queue=c.q, passive=True).method.message_count
            got = consume(ch, c.q, depth, timeout=60, idle=0.3)
        finally:
            conn.close()
    finally:
        services.rabbitmqctl("delete_vhost", vhost)
    assert not deleted
    check_against_db(got, pgdb)
    expected = set(range(n)) - before
    dups, _ = order_report(got, expected, lambda s: s % keys)
    causes = [m for m in warn_lines(text, "sink=main: down:") if vhost in m]
    print(f"vhost deleted at {at:.0f} relayed ({len(before)} marked): {sent1 - len(before)} "
          f"marks and {dead_during} dead rows during {span:.1f} s; relay CPU {cpu:.2f} s over "
          f"it; all {n} sent {recovered:.1f} s after the vhost was back; {len(got)} deliveries "
          f"of {len(expected)} rows unsent when it went, {dups} duplicates; logged: "
          f"{causes[:2]}")
    assert at < n
    assert sent1 == len(before), "rows were marked sent while the vhost did not exist"
    assert dead_during == 0 and dead_total == 0, "rows dead-lettered for a deleted vhost"
    assert cpu < SPIN * span, f"the relay used {cpu:.2f} s of CPU in {span:.1f} s: spinning"
    assert any("not found" in m.lower() or "not_allowed" in m.lower() for m in causes), (
        "no WARN/ERROR names the missing vhost: " + str(warn_lines(text, "sink=main")[:5]))
    # one lost connection: at most the unconfirmed messages are published again
    assert dups <= c.window, f"{dups} duplicates > window {c.window} (one lost connection)"
