"""The relay behind PgBouncer in transaction pooling (required: no session state is needed for
correctness) — a private pgbouncer (Debian's package) in front of the private PostgreSQL,
real relay processes, real RabbitMQ.

- one relay drains through it: nothing lost, per-key order, no duplicates; the relay leaves
  no session state on the pooled server connections (no LISTEN, no session settings) and
  says once at WARN that new rows are found by polling;
- two relays in leader mode: exactly one publishes; the leader frozen (SIGSTOP) or killed
  (kill -9) is replaced within lease + 2 x poll_interval; lost 0, duplicates <= 2 x publish_window,
  per-key order, no mark by a frozen leader after it wakes (audit trigger);
- two competing relays with 50 keys: 0 per-key order breaks;
- `check` names the mode and warns (exit 0) when LISTEN/NOTIFY cannot reach the connection.

The helpers of tests/test_relay_multi.py (relay(), audit_setup(), marks(), first_order())
are imported, not copied: these tests are the same scenarios with another conninfo."""
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

import psycopg
import pytest

from conftest import tail, wait_for
from relay_util import (ANY_LEVEL, LiveConsumer, amqp_channel, consume, declare,
                        delivery_report, free_port, insert_rows, log_lines_at, order_report,
                        run_producer, wait_log_at, write_config, Relay)
from test_relay import init_schema
from test_relay_multi import LEASE, POLL, audit_setup, first_order, marks, relay

POOL_SIZE = 4   # small on purpose: client connections share server connections


class PgBouncer:
    """A private pgbouncer on a free port, pool_mode as given, trusting the private
    PostgreSQL's postgres user. Runs as the postgres OS user when we are root (pgbouncer
    refuses to run as root)."""

    def __init__(self, services, pool_mode="transaction"):
        exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.path.exists(exe):
            pytest.fail("pgbouncer is not installed (apt-get install pgbouncer; it is in "
                        "scripts/packages.txt)", pytrace=False)
        self.services = services
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="outbox-pgbouncer-"))
        self.port = free_port()
        self.log_path = self.dir / "pgbouncer.log"
        (self.dir / "userlist.txt").write_text(f'"{services.pg_user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(f"""[databases]
* = host={services.pg_host} port={services.pg_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir}/userlist.txt
pool_mode = {pool_mode}
default_pool_size = {POOL_SIZE}
max_client_conn = 200
logfile = {self.log_path}
""")
        argv = [exe, str(self.dir / "pgbouncer.ini")]
        as_user = {}
        if os.geteuid() == 0:     # pgbouncer refuses to run as root
            shutil.chown(self.dir, "postgres")
            for p in self.dir.iterdir():
                shutil.chown(p, "postgres")
            # the process itself as postgres (not under runuser, which on a signal waits 2 s
            # before it kills its child: stop() would take 2 s every test)
            as_user = dict(user="postgres", group="postgres", extra_groups=[])
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, **as_user)

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"pgbouncer exited {self.proc.returncode}: "
                                     f"{self.proc.stderr.read()!r} {tail(self.log_path)}")
            with psycopg.connect(self.dsn("postgres"), autocommit=True) as c:
                return c.execute("SELECT 1").fetchone()
        wait_for(up, 20, interval=0.1, desc="pgbouncer to accept connections",
                 ignore=(psycopg.OperationalError,))

    def dsn(self, dbname):
        return (f"host=127.0.0.1 port={self.port} user={self.services.pg_user} "
                f"dbname={dbname} connect_timeout=10")

    def server_sessions(self, dbname):
        """Holds every server connection of the pool (POOL_SIZE client transactions at
        once) and returns, for each, (backend pid, statement_timeout, listening channels)."""
        conns, out = [], []
        try:
            for _ in range(POOL_SIZE):
                c = psycopg.connect(self.dsn(dbname), autocommit=False)
                conns.append(c)
                out.append(c.execute("SELECT pg_backend_pid(), current_setting('statement_timeout'), "
                                     "array(SELECT pg_listening_channels())").fetchone())
        finally:
            for c in conns:
                c.close()
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def pgb(services, request):
    b = PgBouncer(services)
    try:
        yield b
    finally:
        print(f"--- pgbouncer log {b.log_path} (shown when the test fails):\n"
              f"{tail(b.log_path, 40)}")
        b.stop()


def check(relay_bin, cfg):
    return subprocess.run([str(relay_bin), "check", "-c", str(cfg)], capture_output=True,
                          text=True, timeout=60)


NO_LISTEN = "LISTEN/NOTIFY does not reach this connection (transaction pooling?)"


# ---------------------------------------------------------------------------- one relay
def test_one_relay_drains_through_transaction_pooling(services, pgdb, pgb, relay_bin, tmp_path):
    n, keys = 3000, 10
    q = f"qpgb-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    conn.close()
    port = free_port()
    cfg = write_config(tmp_path / "r.ini", services, pgdb, conninfo=pgb.dsn(pgdb.name),
                       relay={"http_listen": f"127.0.0.1:{port}"},
                       poll_interval="500ms", batch_size="200")
    init_schema(relay_bin, cfg)          # init through the pooler, too
    consumer = LiveConsumer(services, q)
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    try:
        r.wait_log("became the active relay")
        for start in range(0, n, 1000):  # while it runs: polling has to find them
            insert_rows(pgdb, 1000, keys, start=start, routing_key=q)
            time.sleep(0.3)
        assert consumer.wait_distinct(n, 60), f"only {len(consumer.seen)} of {n} arrived"
        sessions = pgb.server_sessions(pgdb.name)
    finally:
        got = consumer.stop()
        rc = r.stop()
    r.assert_clean_exit(rc)
    dups, _ = order_report(got, range(n), lambda s: s % keys)
    text = r.text()
    print(f"through pgbouncer (transaction pooling): {n} rows, {dups} duplicates; server "
          f"sessions {sessions}")
    assert dups == 0
    # no session state left on the pool's server connections: no LISTEN (its notifications
    # would go to whichever client uses that connection next), no session settings
    with psycopg.connect(services.pg_dsn(pgdb.name)) as c:
        default_timeout = c.execute("SHOW statement_timeout").fetchone()[0]
    leaked = [s for s in sessions if s[2] or s[1] != default_timeout]
    assert not leaked, f"session state left on pooled server connections: {leaked}"
    warns = log_lines_at(text, re.escape(NO_LISTEN), levels=("WARN",))
    assert len(warns) == 1 == len(log_lines_at(text, re.escape(NO_LISTEN), ANY_LEVEL)), \
        f"expected one WARN line, got {warns}"
    assert "polling every poll_interval (0.5s)" in warns[0]


# ---------------------------------------------------------------------------- leader mode
@pytest.mark.parametrize("fault", ["sigstop", "kill9"])
def test_leader_failover_through_transaction_pooling(services, pgdb, pgb, relay_bin, build,
                                                     tmp_path, fault):
    n, keys, window = 6000, 20, 100
    q = f"qpgb-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    dsn = pgb.dsn(pgdb.name)
    a, cfg = relay(relay_bin, tmp_path, services, pgdb, "ra", conninfo=dsn)
    init_schema(relay_bin, cfg)
    audit_setup(pgdb)
    a.wait_log("became the active relay")
    b, _ = relay(relay_bin, tmp_path, services, pgdb, "rb", conninfo=dsn)
    b.wait_log("standing by")
    # the producer (liboutbox) writes through the pooler too
    run_producer(build, dsn, pgdb.name, count=n, keys=keys, routing_key=q, size=64, batch=1000)
    got = consume(ch, q, 800, timeout=30)
    assert len(got) >= 800
    # exactly one publishes
    assert (a.metric("outbox_relay_leader"), b.metric("outbox_relay_leader")) == (1, 0)
    assert (b.metric("outbox_relay_relayed_total") or 0) == 0, "the standby published"
    t0 = time.monotonic()
    if fault == "sigstop":
        os.kill(a.proc.pid, signal.SIGSTOP)
    else:
        a.kill9()
    b.wait_log("became the active relay", timeout=20)
    took = time.monotonic() - t0
    if fault == "sigstop":
        time.sleep(max(0.0, LEASE + 5 - (time.monotonic() - t0)))
        t_wake = time.time()
        os.kill(a.proc.pid, signal.SIGCONT)
        wait_log_at(a, "lost leadership", timeout=15)   # fenced: a WARN
    got += consume(ch, q, n - len(got), timeout=90, idle=2.0)
    audit = marks(pgdb)
    for r in (a, b):
        if r.proc.poll() is None:
            r.assert_clean_exit(r.stop())
    conn.close()
    dups, _ = delivery_report(got, n, keys)    # lost 0, per-key order, one message_id
    print(f"pgbouncer, {fault}: standby active {took:.2f} s after the fault (lease {LEASE:g} s, "
          f"poll {POLL:g} s); {dups} duplicates; {len(audit)} marks")
    assert took <= LEASE + 2 * POLL + 1.0, "the standby took over too late"
    assert dups <= 2 * window, "duplicates above 2 x publish_window for one fault"
    ids = [int(r[0]) for r in audit]
    assert len(ids) == len(set(ids)) == n, "every row marked exactly once"
    if fault == "sigstop":
        late = [r for r in audit if r[1].startswith("ra/") and float(r[3]) >= t_wake]
        assert late == [], f"the old leader marked rows after it woke: {late[:5]}"


# ---------------------------------------------------------------------------- competing mode
def test_competing_two_relays_keep_per_key_order_through_pooling(services, pgdb, pgb, relay_bin,
                                                                 build, tmp_path):
    n, keys = 6000, 50
    q = f"qpgb-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    dsn = pgb.dsn(pgdb.name)
    relays = []
    for i in range(2):
        r, cfg = relay(relay_bin, tmp_path, services, pgdb, f"rc{i}", mode="competing",
                       conninfo=dsn)
        if i == 0:
            init_schema(relay_bin, cfg)
            audit_setup(pgdb)
        relays.append(r)
    for r in relays:
        r.wait_log("database connected")
    run_producer(build, dsn, pgdb.name, count=n, keys=keys, routing_key=q, size=64, batch=1000)
    got = consume(ch, q, n, timeout=120, idle=2.0)
    counts = [r.metric("outbox_relay_relayed_total") for r in relays]
    audit = marks(pgdb)
    for r in relays:
        r.assert_clean_exit(r.stop())
    conn.close()
    breaks = first_order(got, keys)
    dups, _ = delivery_report(got, n, 0)       # lost 0, one message_id per seq
    print(f"pgbouncer, competing x2, 50 keys: relayed {counts}, {dups} duplicates, "
          f"{len(breaks)} per-key order breaks")
    assert breaks == [], f"per-key order broken: {breaks[:8]}"
    assert dups == 0
    ids = [int(r[0]) for r in audit]
    assert len(ids) == len(set(ids)) == n, "every row marked exactly once"


# ---------------------------------------------------------------------------- check
def test_check_names_the_mode_and_warns_when_listen_cannot_work(services, pgdb, pgb, relay_bin,
                                                                tmp_path):
    direct = write_config(tmp_path / "direct.ini", services, pgdb, lease="7s")
    init_schema(relay_bin, direct)
    p = check(relay_bin, direct)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[outbox.main] mode leader" in p.stdout and "lease 7s" in p.stdout, p.stdout
    assert "WARNING" not in p.stdout + p.stderr, p.stdout + p.stderr

    competing = write_config(tmp_path / "competing.ini", services, pgdb, mode="competing")
    p = check(relay_bin, competing)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[outbox.main] mode competing" in p.stdout, p.stdout
    assert "WARNING" not in p.stdout + p.stderr, p.stdout + p.stderr

    pooled = write_config(tmp_path / "pooled.ini", services, pgdb, conninfo=pgb.dsn(pgdb.name),
                          poll_interval="2s")
    p = check(relay_bin, pooled)
    print(p.stdout + p.stderr)
    assert p.returncode == 0, "a warning is not a failure: " + p.stdout + p.stderr
    assert "mode leader" in p.stdout
    assert re.search(r"\[outbox\.main\] WARNING: " + re.escape(NO_LISTEN) +
                     r": new rows are found by polling every poll_interval \(2s\)", p.stderr), \
        p.stderr
    assert ": OK (" in p.stdout
