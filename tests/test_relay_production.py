"""Conditions production meets that are not crashes: the database turning read-only, the
broker's disk alarm, permissions revoked mid-run. For each, while the cause lasts: nothing
lost, nothing marked sent that the broker did not confirm, nothing dead-lettered for a cause
that is not the message's, no spinning (the relay's CPU time over the fault window is
measured), a WARN/ERROR naming the cause; and the relay recovers on its own once the cause
goes away (no restart, no signal).

Each test uses its own database, queue and relay name (tests/test_relay_faults.py's Case)."""
import time

import psycopg

from conftest import wait_for
from relay_util import (SPIN, FaultWindow, check_against_db, dead_rows, delivery_report,
                        log_events)
from test_relay_faults import Case, terminate_relay_backends, wait_relayed


def warn_lines(text, needle):
    return [f"{lvl} {msg}" for lvl, msg in log_events(text)
            if lvl in ("WARN", "ERROR") and needle in msg]


def test_database_goes_read_only_mid_drain(services, pgdb, relay_bin, build, tmp_path):
    """default_transaction_read_only = on for the database, and the relay's sessions
    terminated (what a switch-over to a read-only node does): every claim and mark fails
    with SQLSTATE 25006. Nothing may be marked or dead-lettered meanwhile, the relay must not
    spin, must say why, and must resume by itself once the database is writable again (its
    sessions opened while read-only keep that default: it has to notice)."""
    n, keys, window = 20000, 100, 200
    c = Case(services, pgdb, relay_bin, build, tmp_path, "readonly", reconnect_max="1s",
             sink={"publish_window": str(window)})
    c.produce(n, keys, size=256, batch=1000)
    r = c.start()
    admin = services.pg_connect()
    read_only = False
    try:
        r.wait_log("became the active relay")
        wait_relayed(r, 3000)
        admin.execute(f'ALTER DATABASE "{pgdb.name}" SET default_transaction_read_only = on')
        read_only = True
        assert terminate_relay_backends(services, pgdb.name) >= 1
        # the relay reconnects into read-only sessions; marks in flight before settle or fail
        wait_for(lambda: warn_lines(r.text(), "read-only"), 20, interval=0.1,
                 desc="a WARN/ERROR naming the read-only database")
        w = FaultWindow(r, pgdb).hold()
        admin.execute(f'ALTER DATABASE "{pgdb.name}" RESET default_transaction_read_only')
        read_only = False
        w.recover(lambda: c.wait_all_sent(n, timeout=90))
    finally:
        if read_only:
            admin.execute(f'ALTER DATABASE "{pgdb.name}" RESET default_transaction_read_only')
        admin.close()
        r.stop_clean()
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    check_against_db(got, pgdb)
    causes = warn_lines(w.text, "read-only")
    print(f"read-only database at {w.at:.0f} relayed: {w.summary()} (read-only); all {n} sent "
          f"{w.recovered:.1f} s after it was writable again ({w.took:.1f} s); {dups} "
          f"duplicates; first cause logged: {causes[:1]}")
    assert w.at < n, "the database should turn read-only mid-drain"
    w.assert_quiet("rows were marked sent while the database was read-only",
                   "rows dead-lettered for a read-only database")
    assert causes, "no WARN/ERROR names the read-only database"
    assert dups <= 2 * window, f"{dups} duplicates > 2 x window {window}"


def test_broker_disk_alarm_mid_drain(services, pgdb, relay_bin, build, tmp_path):
    """RabbitMQ's disk alarm (free disk under disk_free_limit) blocks every publishing
    connection: the relay must pause (nothing published, nothing marked), not spin, say the
    broker blocked it and why, and resume when the alarm clears."""
    n, keys = 5000, 50
    c = Case(services, pgdb, relay_bin, build, tmp_path, "diskalarm", reconnect_max="1s")
    r = c.start()
    alarm = False
    try:
        r.wait_log("became the active relay")
        r.wait_log("sink=main: connected")
        p = services.rabbitmqctl("set_disk_free_limit", "100000GB")
        assert p.returncode == 0, p.stdout + p.stderr
        alarm = True
        c.produce(n, keys, size=128, batch=1000)
        wait_for(lambda: r.metric("outbox_relay_sink_blocked") == 1, 30,
                 desc="outbox_relay_sink_blocked 1")
        w = FaultWindow(r, pgdb, probes={"depth": c.collect_depth}).hold(5.0)
        p = services.rabbitmqctl("set_disk_free_limit", "50MB")
        assert p.returncode == 0, p.stdout + p.stderr
        alarm = False
        w.recover(lambda: c.wait_all_sent(n, timeout=60))
    finally:
        if alarm:
            services.rabbitmqctl("set_disk_free_limit", "50MB")
        r.stop_clean()
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    check_against_db(got, pgdb)
    causes = warn_lines(w.text, "broker blocked the connection")
    depth0, depth1 = w.ends["depth"]
    print(f"disk alarm: {depth1 - depth0} published and {w.summary()} (blocked, at "
          f"{w.sent0} sent); all {n} sent {w.recovered:.1f} s after the alarm cleared; {dups} "
          f"duplicates; logged: {causes[:1]}")
    assert depth1 == depth0, "published while the broker blocked"
    assert w.sent0 < n, "the alarm should hold rows back"
    w.assert_quiet("marked while the broker blocked", "rows dead-lettered for a disk alarm")
    assert causes and "disk" in causes[0], f"the WARN must name the disk alarm: {causes}"
    assert dups == 0


def test_update_on_the_outbox_revoked_mid_run(services, pgdb, relay_bin, build, tmp_path):
    """The relay's role (least privilege, deploy/grants-postgres.sql) loses UPDATE on the
    outbox mid-drain: every claim and mark fails with 42501. Nothing may be marked or
    dead-lettered, no spinning, a WARN/ERROR naming the denied permission; GRANT back and the
    relay resumes by itself."""
    import secrets
    from conftest import ROOT
    n, keys, window = 20000, 100, 200
    c = Case(services, pgdb, relay_bin, build, tmp_path, "revoke", reconnect_max="1s",
             sink={"publish_window": str(window)})
    pgdb.psql(None, args=("-f", str(ROOT / "deploy" / "grants-postgres.sql")))
    user = f"outbox_relay_{secrets.token_hex(4)}"
    admin = services.pg_connect()
    admin.execute(f'CREATE ROLE "{user}" LOGIN IN ROLE outbox_relay')
    conninfo = (f"host={services.pg_host} port={services.pg_port} user={user} "
                f"dbname={pgdb.name}")
    c.cfg.write_text(c.cfg.read_text().replace(f"conninfo = {pgdb.dsn}",
                                               f"conninfo = {conninfo}"))
    assert f"user={user}" in c.cfg.read_text()
    c.produce(n, keys, size=256, batch=1000)
    r = c.start()
    tab = psycopg.connect(pgdb.dsn, autocommit=True)   # the grants are the database's own
    revoked = False
    try:
        r.wait_log("became the active relay")
        wait_relayed(r, 3000)
        tab.execute("REVOKE UPDATE ON outbox.messages FROM outbox_relay")
        revoked = True
        wait_for(lambda: warn_lines(r.text(), "permission denied"), 20, interval=0.1,
                 desc="a WARN/ERROR naming the denied permission")
        w = FaultWindow(r, pgdb).hold()
        tab.execute("GRANT UPDATE ON outbox.messages TO outbox_relay")
        revoked = False
        w.recover(lambda: c.wait_all_sent(n, timeout=90))
    finally:
        if revoked:
            tab.execute("GRANT UPDATE ON outbox.messages TO outbox_relay")
        r.stop_clean()
        tab.close()
        admin.execute(f'DROP OWNED BY "{user}"')
        admin.execute(f'DROP ROLE "{user}"')
        admin.close()
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    check_against_db(got, pgdb)
    causes = warn_lines(w.text, "permission denied")
    print(f"UPDATE revoked at {w.at:.0f} relayed: {w.summary()}; all {n} sent "
          f"{w.recovered:.1f} s after the GRANT; {dups} duplicates; logged: {causes[:1]}")
    assert w.at < n
    w.assert_quiet("rows were marked sent without UPDATE on the outbox",
                   "rows dead-lettered for a revoked grant")
    assert causes and "messages" in causes[0], f"the WARN must name the table: {causes}"
    assert dups <= 2 * window, f"{dups} duplicates > 2 x window {window}"


def test_broker_permissions_revoked_mid_run(services, pgdb, relay_bin, build, tmp_path):
    """An operator clears the relay's broker permissions (`rabbitmqctl clear_permissions`);
    the broker applies them to new connections and channels, so the relay's connection is then
    closed (as any network blip or broker restart would): it cannot get back in. Nothing may be
    marked or dead-lettered, no spinning, a WARN/ERROR naming the refusal; permissions back
    and it resumes by itself."""
    import secrets
    from relay_util import broker_connections
    n, keys = 20000, 100
    user, pw = f"relay-{secrets.token_hex(4)}", secrets.token_hex(8)
    p = services.add_broker_user(user, pw)
    assert p.returncode == 0, p.stdout + p.stderr
    c = Case(services, pgdb, relay_bin, build, tmp_path, "brokerperm", reconnect_max="1s",
             sink={"url": f"amqp://{user}:{pw}@127.0.0.1:{services.amqp_port}/%2f",
                   "reconnect_max": "1s"})
    first = 2000
    c.produce(first, keys, size=256, batch=1000)
    r = c.start()
    cleared = False
    try:
        r.wait_log("became the active relay")
        wait_relayed(r, first)
        p = services.rabbitmqctl("clear_permissions", "-p", "/", user)
        assert p.returncode == 0, p.stdout + p.stderr
        cleared = True
        for pid in broker_connections(services, f"outbox-relay {c.name}/main"):
            services.rabbitmqctl("close_connection", pid, "test: permissions cleared")
        wait_for(lambda: warn_lines(r.text(), "sink=main: down:")
                 and r.metric("outbox_relay_sink_up") == 0, 30, interval=0.1,
                 desc="the relay's broker connection down")
        # the rest is written while the relay cannot publish (rabbitmqctl takes seconds on a
        # loaded machine: the first rows are long through by now)
        c.produce(n - first, keys, size=256, batch=1000, start=first)
        w = FaultWindow(r, pgdb).hold()
        p = services.rabbitmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        assert p.returncode == 0, p.stdout + p.stderr
        cleared = False
        w.recover(lambda: c.wait_all_sent(n, timeout=90))
    finally:
        if cleared:
            services.rabbitmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        r.stop_clean()
        services.rabbitmqctl_later("delete_user", user)
    got = c.collect()
    dups, _ = delivery_report(got, n, keys)
    check_against_db(got, pgdb)
    causes = [m for m in warn_lines(w.text, "sink=main: down:") if "access" in m.lower()
              or "refused" in m.lower() or "denied" in m.lower()]
    print(f"broker permissions cleared at {w.at:.0f} relayed: {w.summary()}; all {n} sent "
          f"{w.recovered:.1f} s after the permissions came back; {dups} duplicates; "
          f"logged: {causes[:1]}")
    assert w.at < n
    w.assert_quiet("rows were marked sent while the broker refused the relay",
                   "rows dead-lettered for revoked permissions")
    assert causes, "no WARN/ERROR names the broker's refusal: " + str(
        warn_lines(w.text, "sink=main")[:5])
    assert dups <= c.window, f"{dups} duplicates > window {c.window} (one lost connection)"


def test_target_queue_deleted_mid_run(services, pgdb, relay_bin, build, tmp_path):
    """The queue the rows are routed to is deleted mid-run: every publish comes back
    unroutable (mandatory) and is a failed attempt; after max_attempts a row moves to the
    dead-letter table. How many rows dead-letter before someone re-creates the queue?
    Measured here with short back-offs (5 attempts, 100 ms doubling to 400 ms: a row's tries
    span ~1.1 s instead of the defaults' 10 attempts over 1+2+...+256 = 511 s); the rule
    checked: a key's later rows wait behind its failing row, so per key at most one row
    dead-letters per span of tries. Nothing is lost: every row is delivered or dead."""
    import pika
    from relay_util import amqp_channel, consume
    n, first, keys, attempts = 2000, 200, 20, 5
    c = Case(services, pgdb, relay_bin, build, tmp_path, "qdel", max_attempts=str(attempts),
             retry_backoff="100ms", retry_backoff_max="400ms")
    span_s = 0.1 + 0.2 + 0.4 + 0.4           # the waits between the 5 tries
    c.produce(first, keys, size=64)
    r = c.start()
    conn, ch = amqp_channel(services)
    try:
        r.wait_log("became the active relay")
        c.wait_all_sent(first)
        got = consume(ch, c.q, first, timeout=30)
        ch.queue_delete(c.q)
        t_del = time.monotonic()
        c.produce(n - first, keys, size=64, start=first)
        w = FaultWindow(r, pgdb).begin(settle=0.0, since=t_del)
        wait_for(lambda: dead_rows(pgdb) > 0, 30, interval=0.05, desc="a first dead row")
        t_first_dead = time.monotonic() - t_del
        time.sleep(max(0.0, 8.0 - (time.monotonic() - t_del)))
        w.end()
        window_s, dead, cpu = w.span, w.dead, w.cpu
        ch.queue_declare(queue=c.q, durable=True)
        t_back = time.monotonic()
        wait_for(lambda: sum(c.db_counts()) - c.db_counts()[1] + dead_rows(pgdb) >= n
                 and c.db_counts()[1] == 0, 60, interval=0.2, ignore=(psycopg.Error,),
                 desc="every row sent or dead")
        recovered = time.monotonic() - t_back
        text = r.text()
    finally:
        try:
            conn.close()
        except pika.exceptions.AMQPError:
            pass
        r.stop_clean()
    got += c.collect()
    check_against_db(got, pgdb)
    with psycopg.connect(pgdb.dsn, autocommit=True) as dc:
        dead_seqs = sorted(int(x) for (x,) in dc.execute(
            "select headers->>'seq' from outbox.messages_dead"))
        total_dead = len(dead_seqs)
    delivered = {int(p.headers["seq"]) for p, _, _ in got}
    lost = sorted(set(range(n)) - delivered - set(dead_seqs))
    returned = [m for m in warn_lines(text, "") if "unroutable" in m or "NO_ROUTE" in m
                or "returned" in m]
    per_key = max(1, round(window_s / span_s))
    print(f"queue deleted: first row dead-lettered {t_first_dead:.1f} s later (tries span "
          f"{span_s:.1f} s); {dead} rows of {n - first} dead after {window_s:.1f} s "
          f"({keys} keys: {dead / keys:.1f} a key); {total_dead} dead in all; the rest sent "
          f"{recovered:.1f} s after the queue was back; relay CPU {cpu:.2f} s; WARN: "
          f"{returned[:1]}")
    assert not lost, f"{len(lost)} rows neither delivered nor dead: {lost[:10]}"
    assert returned, "no WARN/ERROR says the messages came back unroutable"
    assert t_first_dead >= span_s, "a row dead-lettered before its tries were spent"
    assert dead <= keys * (per_key + 1), (
        f"{dead} rows dead in {window_s:.1f} s: more than one per key per {span_s:.1f} s")
    assert cpu < SPIN * window_s + 0.5, f"the relay used {cpu:.2f} s of CPU: spinning"


def _insert_one(conn, seq, key, q):
    """One row shaped like relay_util.insert_rows' (seq header, 'msg|seq|' body) on an open
    connection, in its current transaction."""
    conn.execute(
        "INSERT INTO outbox.messages (message_id, exchange, routing_key, partition_key, "
        "message_type, content_type, correlation_id, headers, payload) VALUES "
        "(gen_random_uuid(), '', %s, %s, 'test.event', 'application/octet-stream', %s, "
        "jsonb_build_object('seq', %s::text, 'origin', 'sql'), convert_to(%s, 'UTF8'))",
        (q, key, f"corr-{seq}", str(seq), f"msg|{seq}|late"))


def test_low_id_committed_late_is_never_skipped(services, pgdb, relay_bin, build, tmp_path):
    """A producer transaction takes a low id and commits late while later ids of other keys
    are committed and relayed: the late row is invisible until its commit, never skipped after
    it (it is published as soon as it commits), and it does not hold other keys back. Per
    key, a row committed after it (a higher id) arrives after it."""
    from relay_util import amqp_channel, consume, insert_rows, order_report
    c = Case(services, pgdb, relay_bin, build, tmp_path, "lateid", poll_interval="30s")
    r = c.start()
    conn, ch = amqp_channel(services)
    late = psycopg.connect(pgdb.dsn)          # not autocommit: the transaction stays open
    try:
        r.wait_log("became the active relay")
        _insert_one(late, 0, "key-late", c.q)  # id 1, uncommitted
        insert_rows(pgdb, 1000, 10, start=1, routing_key=c.q)   # ids 2.., committed
        got = consume(ch, c.q, 1000, timeout=30, idle=1.0)
        before = {int(p.headers["seq"]) for p, _, _ in got}
        assert before == set(range(1, 1001)), \
            f"other keys held back by the open transaction: {len(before)} of 1000 arrived"
        late.commit()
        t0 = time.monotonic()
        more = consume(ch, c.q, 1, timeout=10)
        took = time.monotonic() - t0
        with psycopg.connect(pgdb.dsn, autocommit=True) as after:
            _insert_one(after, 1001, "key-late", c.q)   # same key, committed after it
        more += consume(ch, c.q, 1, timeout=10, idle=1.0)
        got += more
    finally:
        late.close()
        conn.close()
        r.stop_clean()
    check_against_db(got, pgdb)
    order_report(got, range(1002), lambda s: "late" if s in (0, 1001) else s % 10)
    print(f"a low id committed after 1000 later ids were relayed: published {took:.2f} s "
          f"after its commit (poll 30 s: by NOTIFY)")
    assert [int(p.headers["seq"]) for p, _, _ in more][:1] == [0], \
        "the late row did not arrive first after its commit"
    assert took < 5.0, f"the late row took {took:.1f} s after its commit"
