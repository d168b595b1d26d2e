"""SIGHUP reloads the configuration (issue 12; PgBouncer's RELOAD).

The new file goes through the same loader as `check`. A bad one is refused with `check`'s own
error lines at ERROR and the running configuration goes on. A good one is applied outbox by
outbox: unchanged outboxes keep their drain and connections; removed ones stop gracefully
(in-flight confirms settled, leases released) and vanish from /metrics; added ones start;
changed ones (a key of the outbox or of its sink) stop gracefully and start again on the new
settings. log_level/log_format apply at once. A SIGHUP during a reload is applied after it;
SIGTERM during one still stops cleanly.

Real PostgreSQL + RabbitMQ; relays at the default log level; failures checked at WARN/ERROR."""
import re
import signal
import subprocess
import time
import uuid

from conftest import wait_for
from relay_util import (LiveConsumer, Relay, amqp_channel, broker_connections, consume,
                        declare, free_port, insert_rows, log_events, log_lines_at,
                        order_report, wait_log_at, write_config)
from test_relay import init_schema

KEYS = 20
INFO = ("INFO",)


def key_of(seq):
    return seq % KEYS


def _outbox(db, **kw):
    ob = {"source": "postgres", "conninfo": db.dsn, "database": db.name,
          "table": "outbox.messages", "sink": "main", "batch_size": "200",
          "poll_interval": "200ms", "lease": "10s", "query_timeout": "60s",
          "max_attempts": "3", "retry_backoff": "200ms", "retry_backoff_max": "1s",
          "reconnect_max": "1s"}
    ob.update(kw)
    return ob


def _relay_pids(db):
    """Backend pids of the relay's sessions on db (application_name outbox-relay)."""
    with db.services.pg_connect() as admin:
        return sorted(r[0] for r in admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s"
            " AND application_name = 'outbox-relay'", (db.name,)).fetchall())


def _waiting_on_lock(db, locker_pid):
    with db.services.pg_connect() as admin:
        return [r[0] for r in admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> %s"
            " AND wait_event_type = 'Lock'", (db.name, locker_pid)).fetchall()]


NAME = f"reload-{uuid.uuid4().hex[:8]}"   # the relays' name: broker connections are
                                           # "outbox-relay <name>/<outbox>"


def _conn_name(outbox):
    return f"outbox-relay {NAME}/{outbox}"


def _config(path, services, db, *, relay=None, **kw):
    """relay_util.write_config with this module's relay name."""
    return write_config(path, services, db, relay=dict({"name": NAME}, **(relay or {})), **kw)


def _hup(r):
    r.proc.send_signal(signal.SIGHUP)


def _reloaded(r, count=1, timeout=30):
    """The count-th INFO summary line of an applied reload."""
    return wait_log_at(r, r"^SIGHUP: .*: configuration reloaded: ", INFO, timeout, count)


def _complete(r, count, timeout=60):
    return wait_log_at(r, r"^SIGHUP: reload complete", INFO, timeout, count)


def _metric(r, name, labels=""):
    m = re.search(rf"^{name}{labels} (\S+)$", r.metrics(), re.M)
    return float(m.group(1)) if m else None


def _pending(db, table="outbox.messages"):
    with db.connect() as c:
        return c.execute(f"SELECT count(*) FILTER (WHERE sent_at IS NULL), count(*) FROM {table}"
                         ).fetchone()


def _start(relay_bin, cfg, tmp_path, port, names):
    r = Relay(relay_bin, cfg, tmp_path / "relay.log", http_port=port)
    try:
        for name in names:
            r.wait_log(f"outbox={name}: became the active relay", timeout=60)
    except BaseException:
        r.stop(signal.SIGKILL)
        raise
    return r


# ------------------------------------------------------------------------------------------
def test_bad_file_keeps_the_running_configuration(services, pgdb, relay_bin, tmp_path):
    q = f"qrl-bad-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    port = free_port()
    path = tmp_path / "relay.ini"

    def cfg(**kw):
        relay = {"http_listen": f"127.0.0.1:{port}"}
        relay.update(kw.pop("relay", {}))
        return _config(path, services, pgdb, relay=relay,
                            outboxes={"alpha": _outbox(pgdb, **kw)})

    cfg()
    init_schema(relay_bin, path)
    cons = LiveConsumer(services, q)
    r = _start(relay_bin, path, tmp_path, port, ["alpha"])
    try:
        assert insert_rows(pgdb, 500, KEYS, routing_key=q) == 500
        assert cons.wait_distinct(500, 60), f"{len(cons.seen)}/500 arrived"
        pids = _relay_pids(pgdb)
        assert len(pids) == 2, pids
        broker = broker_connections(services, _conn_name("alpha"))
        assert len(broker) == 1, broker

        # two problems in one file: `check` names both, and so does the refused reload
        cfg(batch_size="abc", relay={"colour": "blue"})
        chk = subprocess.run([str(relay_bin), "check", "-c", str(path)], capture_output=True,
                             text=True, timeout=60)
        assert chk.returncode == 2, chk
        problems = chk.stderr.strip().splitlines()
        assert len(problems) == 2 and any("batch_size" in p for p in problems) \
            and any("colour" in p for p in problems), problems
        _hup(r)
        for p in problems:
            msg = wait_log_at(r, re.escape(f"SIGHUP: {p}; keeping the running configuration"),
                              ("ERROR",), timeout=30)
            print("refused:", msg)
        # a file that is not there at all
        path.rename(tmp_path / "moved.ini")
        _hup(r)
        print("refused:", wait_log_at(r, rf"SIGHUP: {re.escape(str(path))}: cannot open: No such "
                                         r"file or directory; keeping the running configuration",
                                      ("ERROR",), timeout=30))
        (tmp_path / "moved.ini").rename(path)

        # the old configuration still drains, on the same connections
        assert insert_rows(pgdb, 500, KEYS, start=500, routing_key=q) == 500
        assert cons.wait_distinct(1000, 60), f"{len(cons.seen)}/1000 arrived after the bad file"
        assert _relay_pids(pgdb) == pids
        assert broker_connections(services, _conn_name("alpha")) == broker
        assert _metric(r, "outbox_relay_config_reloads_total", '{result="error"}') == 2
        assert _metric(r, "outbox_relay_config_reloads_total", '{result="ok"}') == 0
        assert _metric(r, "outbox_relay_config_last_reload_successful") == 0
        t_start = _metric(r, "outbox_relay_config_last_reload_success_timestamp_seconds")
        assert abs(t_start - time.time()) < 300, t_start

        # the file fixed: applied, nothing to restart
        cfg()
        _hup(r)
        line = _reloaded(r, 1)
        assert "0 outbox(es) added, 0 removed, 0 restarted, 1 unchanged" in line, line
        _complete(r, 1)
        assert _metric(r, "outbox_relay_config_last_reload_successful") == 1
        assert _metric(r, "outbox_relay_config_reloads_total", '{result="ok"}') == 1
        assert _metric(r, "outbox_relay_config_last_reload_success_timestamp_seconds") > t_start
        assert _relay_pids(pgdb) == pids
        assert not log_lines_at(r.text(), r"outbox=alpha: stopping", INFO)
    finally:
        got = cons.stop(idle=0.5)
        rc = r.stop()
        conn.close()
    r.assert_clean_exit(rc)
    dups, _ = order_report(got, range(1000), key_of)
    assert dups == 0


# ------------------------------------------------------------------------------------------
def test_log_level_and_format_change_at_once(services, pgdb, relay_bin, tmp_path):
    """Marked rows are deleted by retention (retention 0, every 200 ms), which logs
    "retention removed N rows" at DEBUG: hidden at info, shown after a reload to debug, in
    JSON after one to log_format = json, hidden again at warn."""
    q = f"qrl-log-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    port = free_port()
    path = tmp_path / "relay.ini"

    def cfg(**relay):
        relay["http_listen"] = f"127.0.0.1:{port}"
        return _config(path, services, pgdb, relay=relay, outboxes={
            "alpha": _outbox(pgdb, retention="0s", cleanup_interval="200ms")})

    def batch(start):
        assert insert_rows(pgdb, 100, KEYS, start=start, routing_key=q) == 100
        assert cons.wait_distinct(start + 100, 60)
        wait_for(lambda: _pending(pgdb) == (0, 0), 30, desc="retention to delete every row")
        time.sleep(0.5)   # a cleanup tick or two more

    cfg()
    init_schema(relay_bin, path)
    cons = LiveConsumer(services, q)
    r = _start(relay_bin, path, tmp_path, port, ["alpha"])
    try:
        batch(0)
        assert not [e for e in log_events(r.text()) if e[0] == "DEBUG"], r.text()

        cfg(log_level="debug")
        _hup(r)
        line = _reloaded(r, 1)
        assert "1 unchanged; log_level info -> debug" in line, line
        batch(100)
        assert log_lines_at(r.text(), r"outbox=alpha: retention removed \d+ rows", ("DEBUG",))

        cfg(log_level="debug", log_format="json")
        _hup(r)
        wait_for(lambda: any(ln.startswith('{"') and "configuration reloaded" in ln
                             for ln in r.text().splitlines()), 30, desc="a JSON summary line")
        mark = len(r.text())
        batch(200)
        tail = r.text()[mark:]
        assert any(ln.startswith('{"') and '"level":"debug"' in ln and "retention removed" in ln
                   for ln in tail.splitlines()), tail

        cfg(log_level="warn")
        _hup(r)
        wait_for(lambda: _metric(r, "outbox_relay_config_reloads_total", '{result="ok"}') == 3,
                 30, desc="the third reload", ignore=(OSError,))
        mark = len(r.text())
        batch(300)
        tail = r.text()[mark:]
        assert "retention removed" not in tail and " INFO " not in tail, tail
        assert _metric(r, "outbox_relay_config_reloads_total", '{result="error"}') == 0
    finally:
        got = cons.stop(idle=0.2)
        rc = r.stop()
        conn.close()
    r.assert_clean_exit(rc)
    order_report(got, range(400), key_of)


# ------------------------------------------------------------------------------------------
def test_outbox_added_on_sighup_drains(services, pgdb, pgdb2, relay_bin, tmp_path):
    qa, qb = f"qrl-adda-{uuid.uuid4().hex[:6]}", f"qrl-addb-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", qa, qa)
    declare(ch, "", qb, qb)
    port = free_port()
    path = tmp_path / "relay.ini"
    both = {"alpha": _outbox(pgdb), "beta": _outbox(pgdb2)}
    _config(path, services, pgdb, relay={"http_listen": f"127.0.0.1:{port}"},
                 outboxes=both)
    init_schema(relay_bin, path)
    _config(path, services, pgdb, relay={"http_listen": f"127.0.0.1:{port}"},
                 outboxes={"alpha": both["alpha"]})
    insert_rows(pgdb2, 1000, KEYS, routing_key=qb, prefix="b")   # waiting for beta
    ca, cb = LiveConsumer(services, qa), LiveConsumer(services, qb)
    r = _start(relay_bin, path, tmp_path, port, ["alpha"])
    try:
        insert_rows(pgdb, 500, KEYS, routing_key=qa)
        assert ca.wait_distinct(500, 60)
        assert _pending(pgdb2) == (1000, 1000)
        assert 'outbox="beta"' not in r.metrics()
        pids = _relay_pids(pgdb)

        _config(path, services, pgdb, relay={"http_listen": f"127.0.0.1:{port}"},
                     outboxes=both)
        _hup(r)
        line = _reloaded(r, 1)
        assert "1 outbox(es) added (beta), 0 removed, 0 restarted, 1 unchanged" in line, line
        _complete(r, 1)
        r.wait_log("outbox=beta: became the active relay", timeout=60)
        assert cb.wait_distinct(1000, 60), f"beta: {len(cb.seen)}/1000"
        insert_rows(pgdb2, 1000, KEYS, start=1000, routing_key=qb, prefix="b")
        insert_rows(pgdb, 500, KEYS, start=500, routing_key=qa)
        assert cb.wait_distinct(2000, 60), f"beta: {len(cb.seen)}/2000"
        assert ca.wait_distinct(1000, 60), f"alpha: {len(ca.seen)}/1000"
        wait_for(lambda: r.metric("outbox_relay_relayed_total", "beta") == 2000, 30,
                 desc="beta's relayed_total", ignore=(OSError,))
        assert _relay_pids(pgdb) == pids, "the unchanged outbox reconnected"
        assert len(_relay_pids(pgdb2)) == 2
    finally:
        got_a, got_b = ca.stop(idle=0.5), cb.stop(idle=0.2)
        rc = r.stop()
        conn.close()
    r.assert_clean_exit(rc)
    assert order_report(got_a, range(1000), key_of)[0] == 0
    assert order_report(got_b, range(2000), key_of)[0] == 0


# ------------------------------------------------------------------------------------------
def test_outbox_removed_stops_gracefully(services, pgdb, pgdb2, relay_bin, tmp_path):
    """beta is removed mid-drain: it settles what it had in flight and gives back the rest;
    every row that reached the broker is marked and no other (so none is published again),
    later rows stay pending, its metrics, sessions and broker connection are gone. beta's
    marks are made slow (a trigger sleeps 0.3 s once per marking transaction), so the reload
    surely finds confirmed rows whose mark has not committed: the stop must wait for it."""
    qa, qb = f"qrl-rma-{uuid.uuid4().hex[:6]}", f"qrl-rmb-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", qa, qa)
    declare(ch, "", qb, qb)
    port = free_port()
    path = tmp_path / "relay.ini"
    both = {"alpha": _outbox(pgdb), "beta": _outbox(pgdb2, batch_size="500")}
    _config(path, services, pgdb, relay={"http_listen": f"127.0.0.1:{port}"},
                 outboxes=both)
    init_schema(relay_bin, path)
    pgdb2.psql("""
        CREATE FUNCTION outbox.slow_mark() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF current_setting('test.slept', true) IS DISTINCT FROM 'y' THEN
                PERFORM set_config('test.slept', 'y', true);
                PERFORM pg_sleep(0.3);
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER slow_mark BEFORE UPDATE ON outbox.messages FOR EACH ROW
            WHEN (OLD.sent_at IS NULL AND NEW.sent_at IS NOT NULL)
            EXECUTE FUNCTION outbox.slow_mark();""")
    ca, cb = LiveConsumer(services, qa), LiveConsumer(services, qb)
    r = _start(relay_bin, path, tmp_path, port, ["alpha", "beta"])
    n_b = 20000
    try:
        insert_rows(pgdb, 500, KEYS, routing_key=qa)
        assert ca.wait_distinct(500, 60)
        pids_a = _relay_pids(pgdb)
        insert_rows(pgdb2, n_b, KEYS, routing_key=qb, prefix="b")
        assert cb.wait_distinct(2000, 60), f"beta: {len(cb.seen)}/2000"
        wait_for(lambda: r.metric("outbox_relay_confirmed_unmarked", "beta") > 0, 10,
                 interval=0.01, desc="confirmed rows of beta waiting for their mark")

        _config(path, services, pgdb, relay={"http_listen": f"127.0.0.1:{port}"},
                     outboxes={"alpha": both["alpha"]})
        _hup(r)
        line = _reloaded(r, 1)
        assert "0 outbox(es) added, 1 removed (beta), 0 restarted, 1 unchanged" in line, line
        r.wait_log("outbox=beta: drained and settled", timeout=60)
        stopping = re.search(r"outbox=beta: stopping: .*", r.text()).group(0)
        _complete(r, 1)
        assert r.metric("outbox_relay_relayed_total", "alpha") == 500
        wait_for(lambda: 'outbox="beta"' not in r.metrics(), 10,
                 desc="beta's series to leave /metrics", ignore=(OSError,))
        assert 'outbox="alpha"' in r.metrics()
        wait_for(lambda: _relay_pids(pgdb2) == [], 10, desc="beta's database sessions to close")
        assert broker_connections(services, _conn_name("beta")) == []

        # nothing more of beta is drained
        pending, total = _pending(pgdb2)
        assert 0 < pending < n_b, (pending, total)
        insert_rows(pgdb2, 100, KEYS, start=n_b, routing_key=qb, prefix="b")
        time.sleep(2.0)   # ten poll intervals of the removed outbox
        assert _pending(pgdb2) == (pending + 100, n_b + 100)
        with pgdb2.connect() as c:
            leased = c.execute("SELECT count(*) FROM outbox.messages WHERE sent_at IS NULL"
                               " AND lease_token IS NOT NULL").fetchone()[0]
            marked = {int(s) for (s,) in c.execute(
                "SELECT headers->>'seq' FROM outbox.messages WHERE sent_at IS NOT NULL")}
        assert leased == 0, f"{leased} rows of the removed outbox still leased"

        # alpha went on untouched
        insert_rows(pgdb, 500, KEYS, start=500, routing_key=qa)
        assert ca.wait_distinct(1000, 60)
        assert _relay_pids(pgdb) == pids_a
    finally:
        got_a, got_b = ca.stop(idle=0.5), cb.stop(idle=1.0)
        rc = r.stop()
        conn.close()
    r.assert_clean_exit(rc)
    assert order_report(got_a, range(1000), key_of)[0] == 0
    # every row the broker got was marked (in flight at the reload: confirmed and settled),
    # and every marked row reached the broker: nothing lost, nothing to publish twice
    dups, copies = order_report(got_b, marked, key_of)
    assert dups == 0
    print(f"beta removed after {len(marked)} of {n_b} rows ({stopping}); {pending} left "
          f"pending, unleased")


# ------------------------------------------------------------------------------------------
def test_sink_changes_restart_only_their_outboxes(services, pgdb, pgdb2, relay_bin, tmp_path):
    """Two sinks: alpha on main, beta on second, both mid-drain. publish_window of main
    changes: alpha reconnects gracefully, beta keeps its connections. Then second's url
    changes (same broker, written differently): beta reconnects, alpha keeps its own.
    Every row arrives once, in order per key."""
    qa, qb = f"qrl-ska-{uuid.uuid4().hex[:6]}", f"qrl-skb-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", qa, qa)
    declare(ch, "", qb, qb)
    port = free_port()
    path = tmp_path / "relay.ini"
    url2 = f"amqp://guest:guest@127.0.0.1:{services.amqp_port}/%2f"
    second = {"url": url2, "publish_window": "300", "heartbeat": "10s",
              "confirm_timeout": "10s", "reconnect_max": "1s"}
    obs = {"alpha": _outbox(pgdb), "beta": _outbox(pgdb2, sink="second")}

    def cfg(window, url):
        return _config(path, services, pgdb, relay={"http_listen": f"127.0.0.1:{port}"},
                            sink={"publish_window": window}, sinks={"second": dict(second, url=url)},
                            outboxes=obs)

    cfg("1000", url2)
    init_schema(relay_bin, path)
    ca, cb = LiveConsumer(services, qa), LiveConsumer(services, qb)
    r = _start(relay_bin, path, tmp_path, port, ["alpha", "beta"])
    n = 12000
    try:
        insert_rows(pgdb, n, KEYS, routing_key=qa)
        insert_rows(pgdb2, n, KEYS, routing_key=qb, prefix="b")
        assert ca.wait_distinct(500, 60) and cb.wait_distinct(500, 60)
        pids_a, pids_b = _relay_pids(pgdb), _relay_pids(pgdb2)
        brk_a = broker_connections(services, _conn_name("alpha"))
        brk_b = broker_connections(services, _conn_name("beta"))
        assert len(brk_a) == 1 and len(brk_b) == 1, (brk_a, brk_b)

        # 1. [sink.main] publish_window: alpha restarts, beta does not
        cfg("100", url2)
        _hup(r)
        line = _reloaded(r, 1)
        assert "0 outbox(es) added, 0 removed, 1 restarted (alpha), 1 unchanged" in line, line
        _complete(r, 1)
        r.wait_log(r"outbox=alpha: drained and settled")
        wait_for(lambda: len(re.findall(r"outbox=alpha sink=main: connected", r.text())) == 2,
                 30, desc="alpha's new broker connection")
        new_a = broker_connections(services, _conn_name("alpha"))
        assert len(new_a) == 1 and new_a != brk_a, (brk_a, new_a)
        assert broker_connections(services, _conn_name("beta")) == brk_b
        assert _relay_pids(pgdb2) == pids_b, "beta (unchanged) reconnected to its database"
        assert _relay_pids(pgdb) != pids_a
        assert len(re.findall(r"outbox=beta sink=second: connected", r.text())) == 1

        # 2. [sink.second] url: beta restarts, alpha does not
        pids_a = wait_for(lambda: len(_relay_pids(pgdb)) == 2 and _relay_pids(pgdb), 30,
                          desc="alpha's two new database sessions")
        cfg("100", f"amqp://guest:guest@127.0.0.1:{services.amqp_port}")
        _hup(r)
        line = _reloaded(r, 2)
        assert "0 outbox(es) added, 0 removed, 1 restarted (beta), 1 unchanged" in line, line
        _complete(r, 2)
        wait_for(lambda: len(re.findall(r"outbox=beta sink=second: connected", r.text())) == 2,
                 30, desc="beta's new broker connection")
        assert broker_connections(services, _conn_name("alpha")) == new_a
        assert _relay_pids(pgdb) == pids_a, "alpha (unchanged) reconnected to its database"

        assert ca.wait_distinct(n, 120), f"alpha: {len(ca.seen)}/{n}"
        assert cb.wait_distinct(n, 120), f"beta: {len(cb.seen)}/{n}"
        for db in (pgdb, pgdb2):
            wait_for(lambda: _pending(db) == (0, n), 30, desc=f"every row of {db.name} marked")
    finally:
        got_a, got_b = ca.stop(idle=1.0), cb.stop(idle=0.2)
        rc = r.stop()
        conn.close()
    r.assert_clean_exit(rc)
    dups_a, _ = order_report(got_a, range(n), key_of)
    dups_b, _ = order_report(got_b, range(n), key_of)
    assert dups_a == 0 and dups_b == 0, (dups_a, dups_b)
    assert not log_lines_at(r.text(), r".", ("WARN", "ERROR")), r.text()[-3000:]


# ------------------------------------------------------------------------------------------
def _stalled_removal(services, pgdb, pgdb2, relay_bin, tmp_path, port, path, shutdown_timeout):
    """Relay with alpha (pgdb) and beta (pgdb2); alpha's table locked by another session so
    its drain cannot finish a claim; then a reload that removes alpha. Returns (relay,
    locker, configs) with alpha stuck stopping."""
    obs = {"alpha": _outbox(pgdb, lease="30s"), "beta": _outbox(pgdb2),
           "gamma": _outbox(pgdb2, table="outbox.gamma")}
    relay = {"http_listen": f"127.0.0.1:{port}", "shutdown_timeout": shutdown_timeout}
    _config(path, services, pgdb, relay=relay, outboxes=obs)
    init_schema(relay_bin, path)
    _config(path, services, pgdb, relay=relay,
                 outboxes={k: obs[k] for k in ("alpha", "beta")})
    r = _start(relay_bin, path, tmp_path, port, ["alpha", "beta"])
    locker = pgdb.connect(autocommit=False)
    try:
        locker_pid = locker.execute("SELECT pg_backend_pid()").fetchone()[0]
        locker.execute("LOCK TABLE outbox.messages IN ACCESS EXCLUSIVE MODE")
        wait_for(lambda: _waiting_on_lock(pgdb, locker_pid), 15,
                 desc="the relay's alpha session to block on the table lock")
        _config(path, services, pgdb, relay=relay, outboxes={"beta": obs["beta"]})
        _hup(r)
        line = _reloaded(r)
        assert "1 removed (alpha)" in line, line
        r.wait_log("outbox=alpha: stopping")
    except BaseException:
        locker.rollback()
        r.stop(signal.SIGKILL)
        raise
    return r, locker, obs, relay


def test_sighup_during_a_reload_is_applied_after_it(services, pgdb, pgdb2, relay_bin, tmp_path):
    """alpha cannot finish stopping (its claim waits on a table lock); a second SIGHUP
    (adding gamma) waits; after shutdown_timeout alpha is closed anyway (WARN), the first
    reload completes and the second is applied."""
    q = f"qrl-q-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    port = free_port()
    path = tmp_path / "relay.ini"
    r, locker, obs, relay = _stalled_removal(services, pgdb, pgdb2, relay_bin, tmp_path, port,
                                             path, "3s")
    cons = LiveConsumer(services, q)
    try:
        _config(path, services, pgdb, relay=relay,
                     outboxes={k: obs[k] for k in ("beta", "gamma")})
        _hup(r)
        wait_log_at(r, r"SIGHUP: the previous reload is still in progress \(1 outbox\(es\) "
                       r"stopping or waiting\)", INFO)
        _hup(r)   # a third one merges with the second
        assert 'outbox="alpha"' in r.metrics()     # still stopping
        print(wait_log_at(r, r"outbox=alpha: not drained within shutdown_timeout after the "
                             r"reload", ("WARN",), timeout=30))
        _complete(r, 1)
        line = _reloaded(r, 2)
        assert "1 outbox(es) added (gamma), 0 removed, 0 restarted, 1 unchanged" in line, line
        r.wait_log("outbox=gamma: became the active relay", timeout=60)
        insert_rows(pgdb2, 300, KEYS, routing_key=q, table="outbox.gamma")
        assert cons.wait_distinct(300, 60)
        assert 'outbox="alpha"' not in r.metrics()
        time.sleep(0.5)
        assert len(log_lines_at(r.text(), r"configuration reloaded", INFO)) == 2, \
            "the two SIGHUPs during the reload were not merged into one reload"
    finally:
        locker.rollback()
        got = cons.stop(idle=0.2)
        rc = r.stop()
        conn.close()
    r.assert_clean_exit(rc)
    assert order_report(got, range(300), key_of)[0] == 0


def test_sigterm_during_a_reload_stops_cleanly(services, pgdb, pgdb2, relay_bin, tmp_path):
    port = free_port()
    path = tmp_path / "relay.ini"
    r, locker, obs, relay = _stalled_removal(services, pgdb, pgdb2, relay_bin, tmp_path, port,
                                             path, "30s")
    try:
        r.proc.send_signal(signal.SIGTERM)
        r.wait_log("signal 15: stopping")
        r.wait_log("outbox=beta: drained and settled")
        _hup(r)
        wait_log_at(r, r"SIGHUP: stopping; the configuration is not reloaded", INFO)
        time.sleep(0.5)
        assert r.proc.poll() is None, "exited before alpha (stopping) was settled"
        locker.rollback()
        locker = None
        r.wait_log("outbox=alpha: drained and settled")
        rc = r.proc.wait(timeout=60)
    finally:
        if locker is not None:
            locker.rollback()
        rc = r.stop()
    r.assert_clean_exit(rc)
    text = r.text()
    assert "all outboxes drained; exiting" in text
    assert not log_lines_at(text, r".", ("WARN", "ERROR")), text[-3000:]


# ------------------------------------------------------------------------------------------
def test_reload_while_a_broker_connect_hangs_does_not_block_the_loop(services, pgdb, relay_bin,
                                                                     tmp_path):
    """The sink's url names a listener whose accept queue is full, so the relay's TCP connect
    hangs (on its worker thread) until connect_timeout (20 s). A SIGHUP pointing the sink at
    the real broker stops that drain: the attempt is abandoned, not waited for, so /healthz
    keeps answering at once and the outbox drains on the new url within seconds, not after
    the old attempt's connect_timeout."""
    import socket
    import urllib.request
    q = f"qrl-hang-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(0)                         # one connection fills the accept queue ...
    filler = socket.create_connection(hang.getsockname(), timeout=5)
    port = free_port()
    path = tmp_path / "relay.ini"

    def cfg(url):
        return _config(path, services, pgdb, relay={"http_listen": f"127.0.0.1:{port}"},
                       sink={"url": url, "connect_timeout": "20s"},
                       outboxes={"alpha": _outbox(pgdb)})

    cfg(f"amqp://guest:guest@127.0.0.1:{hang.getsockname()[1]}/%2f")   # ... and SYNs wait
    init_schema(relay_bin, path)
    insert_rows(pgdb, 50, KEYS, routing_key=q)
    r = Relay(relay_bin, path, tmp_path / "relay.log", http_port=port)
    try:
        r.wait_log("outbox=alpha: became the active relay", timeout=60)
        time.sleep(1.0)                    # the connect attempt is under way and hanging
        cfg(services.amqp_url)
        t0 = time.monotonic()
        _hup(r)
        worst = 0.0
        while time.monotonic() - t0 < 3.0:
            t = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=15) as resp:
                resp.read()
            worst = max(worst, time.monotonic() - t)
            time.sleep(0.05)
        got = consume(ch, q, 50, timeout=30, idle=0.5)
        took = time.monotonic() - t0
        print(f"slowest /healthz after the SIGHUP {worst:.2f}s; 50 rows delivered "
              f"{took:.1f}s after it")
        # held by the hung attempt, these would take ~20 s; loaded machines need some slack
        assert worst < 3.0, f"/healthz took {worst:.1f}s: the loop waited for the hung connect"
        assert len({p.message_id for p, _, _ in got}) == 50
        assert took < 12.0, f"the rows arrived {took:.1f}s after the reload"
    finally:
        # the abandoned attempt still waits in connect() (the relay waits for it at exit):
        # with the listener gone its next SYN is refused, instead of timing out at 20 s
        filler.close()
        hang.close()
        rc = r.stop(timeout=60)
        conn.close()
    r.assert_clean_exit(rc)
