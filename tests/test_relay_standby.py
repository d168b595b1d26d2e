"""A hot-standby failover under the relay, with a multi-host conninfo
(`host=127.0.0.1,127.0.0.1 port=P1,P2 target_session_attrs=read-write`).

Each test starts its own pair of private PostgreSQL servers from the Debian binaries the
harness uses: a primary (initdb) and a streaming hot standby of it (pg_basebackup -R), on
free ports, in a directory under the harness's services directory that is removed at the
end, pass or fail. The broker is the harness's.

- test_failover_mid_drain: the primary dies (immediate shutdown: SIGQUIT to its
  postmaster) mid-drain and the standby is promoted a few seconds later, what a failover
  does. While no server accepts writes the relay must not spin, must say why at WARN/ERROR,
  must mark and dead-letter nothing; after the promotion it must find the promoted server
  by itself (the conninfo's last host, now the read-write one) and drain the rest:
  nothing lost, whole bodies and properties as in the database, every row marked on the
  promoted server delivered, and duplicates within what the failover can cost: the rows in
  flight and confirmed but not yet marked (at most 2 x publish_window, as after a relay
  crash). Replication is synchronous, as in a failover set-up that promises not to lose
  commits, and marks commit durably: every mark the old primary acknowledged is on the
  promoted server (the test counts the marks the relay saw acknowledged, once the old
  primary is gone, against the rows the standby holds marked: none may be missing; when
  marks committed without waiting for their WAL flush, 180-1,740 were). A third node in
  the conninfo is down throughout.
- test_first_host_is_a_standby: the relay starts while the conninfo's first host is the
  standby: every session (and `outbox-relay init`) must land on the read-write server.
- test_failover_from_a_frozen_primary: the primary stops answering instead of dying (its
  processes stopped), and the standby is promoted: the relay, and `outbox-relay check`,
  must get past the silent first host.
"""
import os
import pathlib
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time

import psycopg
import pytest

from conftest import wait_for
from relay_util import (PG_BIN, check_against_db, delivery_report, log_lines_at,
                        proc_cpu_seconds, wait_log_at)
from test_relay_faults import Case, recovery_counts, relayed, wait_relayed

# CPU seconds a waiting relay may use per second of fault (as tests/test_relay_production.py)
SPIN = 0.1
DB = "app"


def _free_ports(n):
    """n distinct ports free on 127.0.0.1 now, outside the ephemeral range (as
    scripts/services.sh picks its own: a server port there could collide with a client's)."""
    got = []
    while len(got) < n:
        p = random.randint(30000, 31999)
        if p in got:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
        got.append(p)
    return got


class PgPair:
    """A private primary and, once make_standby() ran, a streaming hot standby of it.
    Attributes: ports {"primary": P1, "standby": P2} (the standby keeps its port when
    promoted), dir. close() stops both and removes their directory."""

    def __init__(self, services, template):
        """template: an initdb'd data directory (the module's fixture), copied as the
        primary's (initdb is the slow part of a new server)."""
        self.dir = pathlib.Path(services.dir) / f"standby-{secrets.token_hex(4)}"
        self.dir.mkdir()
        self._chown(self.dir)
        p1, p2 = _free_ports(2)
        self.ports = {"primary": p1, "standby": p2}
        self.started = []
        subprocess.run(["cp", "-a", str(template), str(self.data("primary"))], check=True,
                       timeout=60)
        with open(self.data("primary") / "postgresql.conf", "a") as f:
            f.write(f"port = {p1}\n")
        self.start("primary")
        with self.connect("primary") as c:
            c.execute(f'CREATE DATABASE "{DB}"')

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def _chown(path):
        if os.geteuid() == 0:
            shutil.chown(path, "postgres", "postgres")

    def _pg(self, *argv, timeout=60):
        """A PostgreSQL program as the postgres user (when root, like services.sh)."""
        _as_postgres(*argv, cwd=self.dir, timeout=timeout)

    def data(self, which):
        return self.dir / which

    def log(self, which):
        return self.dir / f"{which}.log"

    def start(self, which):
        self._pg(f"{PG_BIN}/pg_ctl", "-D", self.data(which), "-l", self.log(which), "-w",
                 "-t", "60", "start", timeout=90)
        self.started.append(which)

    def dsn(self, which, db=DB):
        return (f"host=127.0.0.1 port={self.ports[which]} user=postgres dbname={db} "
                f"connect_timeout=5")

    def connect(self, which, db="postgres"):
        return psycopg.connect(self.dsn(which, db), autocommit=True)

    def multi_host(self, order, db=DB):
        """The conninfo naming the servers in `order` ("primary", "standby", or "down": a
        port where nothing listens, a node that is down), read-write sessions only."""
        if "down" in order and "down" not in self.ports:
            self.ports["down"] = _free_ports(1)[0]
        ports = ",".join(str(self.ports[w]) for w in order)
        hosts = ",".join("127.0.0.1" for _ in order)
        return (f"host={hosts} port={ports} user=postgres dbname={db} "
                f"target_session_attrs=read-write connect_timeout=5")

    def postmaster_pid(self, which):
        return int((self.data(which) / "postmaster.pid").read_text().split("\n", 1)[0])

    # ------------------------------------------------------------------ the pair
    def make_standby(self, synchronous=False):
        """pg_basebackup -R of the primary, started as a hot standby streaming from it; with
        synchronous, the primary then waits for the standby's flush at every commit."""
        self._pg(f"{PG_BIN}/pg_basebackup", "-h", "127.0.0.1", "-p", self.ports["primary"],
                 "-U", "postgres", "-D", self.data("standby"), "-R", "-X", "stream",
                 "-c", "fast", timeout=120)
        with open(self.data("standby") / "postgresql.conf", "a") as f:
            f.write(f"port = {self.ports['standby']}\n")
        (self.data("standby") / "postmaster.pid").unlink(missing_ok=True)
        self.start("standby")
        with self.connect("standby") as c:
            assert c.execute("select pg_is_in_recovery()").fetchone()[0]
        with self.connect("primary") as c:
            if synchronous:   # after the base backup: the promoted standby must not wait
                c.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                c.execute("select pg_reload_conf()")
            want = "sync" if synchronous else "async"
            wait_for(lambda: c.execute(
                "select count(*) from pg_stat_replication where state = 'streaming' "
                "and sync_state = %s", (want,)).fetchone()[0] == 1, 60, interval=0.1,
                desc=f"the standby streaming ({want})")

    def wait_caught_up(self, timeout=60):
        """Until the standby has replayed everything the primary wrote so far."""
        with self.connect("primary") as p:
            lsn = p.execute("select pg_current_wal_lsn()").fetchone()[0]
        with self.connect("standby") as s:
            wait_for(lambda: s.execute("select pg_last_wal_replay_lsn() >= %s::pg_lsn",
                                       (str(lsn),)).fetchone()[0], timeout, interval=0.05,
                     desc="the standby caught up")

    def kill_primary(self):
        """Immediate shutdown of the primary (what pg_ctl -m immediate sends: SIGQUIT to
        the postmaster, no checkpoint, clients cut); returns once it is gone."""
        pid = self.postmaster_pid("primary")
        os.kill(pid, signal.SIGQUIT)
        wait_for(lambda: not _alive(pid), 30, interval=0.02, desc="the primary gone")
        self.started.remove("primary")

    def freeze_primary(self):
        """The primary's machine stops answering (a frozen VM, a network partition): its
        postmaster and every process it started get SIGSTOP. The kernel still accepts TCP
        connections on its port (the listen backlog); nothing ever answers on them."""
        pm = self.postmaster_pid("primary")
        self.frozen = [pm] + _children(pm)
        for pid in self.frozen:
            os.kill(pid, signal.SIGSTOP)

    frozen = ()

    def promote(self):
        self._pg(f"{PG_BIN}/pg_ctl", "-D", self.data("standby"), "-w", "-t", "60", "promote",
                 timeout=90)
        with self.connect("standby") as c:
            assert not c.execute("select pg_is_in_recovery()").fetchone()[0]

    def relay_sessions(self, which):
        """The relay's sessions on a server that have lasted over a second (libpq's check
        of a read-only server opens a session and closes it at once: not counted)."""
        with self.connect(which) as c:
            return c.execute("select count(*) from pg_stat_activity where application_name = "
                             "'outbox-relay' and datname = %s "
                             "and backend_start < now() - interval '1 second'",
                             (DB,)).fetchone()[0]

    def close(self):
        """Immediate shutdown of whatever still runs (SIGQUIT, SIGKILL after 20 s), then
        the pair's directory is removed."""
        pids = []
        if self.frozen:     # a stopped process takes the SIGQUIT once it runs again
            os.kill(self.frozen[0], signal.SIGQUIT)
            for pid in self.frozen:
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
            self.frozen = ()
        for which in self.started:
            try:
                pid = self.postmaster_pid(which)
                os.kill(pid, signal.SIGQUIT)
                pids.append(pid)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 20
        for pid in pids:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.started.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self):
        return "\n".join(f"--- {w} log:\n" + (self.log(w).read_text(errors="replace")[-3000:]
                                               if self.log(w).exists() else "(none)")
                         for w in ("primary", "standby"))


def _children(ppid):
    """Pids of the processes whose parent is ppid."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == ppid:
            out.append(int(d))
    return out


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _as_postgres(*argv, cwd, timeout=120):
    argv = [str(a) for a in argv]
    if os.geteuid() == 0:
        argv = ["runuser", "-u", "postgres", "--"] + argv
    p = subprocess.run(argv, cwd=str(cwd), capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"{argv} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"


@pytest.fixture(scope="module")
def template(services):
    """An initdb'd, configured data directory (no port yet) that each test's primary is
    copied from; removed after the module's tests."""
    top = pathlib.Path(services.dir) / f"standby-template-{secrets.token_hex(4)}"
    top.mkdir()
    try:
        if os.geteuid() == 0:
            shutil.chown(top, "postgres", "postgres")
        data = top / "data"
        _as_postgres(f"{PG_BIN}/initdb", "-D", data, "-U", "postgres", "--auth=trust",
                     "-E", "UTF8", "--locale=C.UTF-8", cwd=top)
        with open(data / "postgresql.conf", "a") as f:
            f.write("""
# --- tests/test_relay_standby.py ---
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_connections = 40
shared_buffers = 16MB
fsync = off
full_page_writes = off
wal_keep_size = 256MB
log_min_messages = warning
""")
        yield data
    finally:
        shutil.rmtree(top, ignore_errors=True)


class PairDb:
    """What tests/test_relay_faults.py's Case and relay_util's checks use of a database
    (name, dsn, connect): here the multi-host conninfo, so that the test's own reads, the
    producer and `outbox-relay init` all reach whichever server is read-write now."""

    def __init__(self, dsn):
        self.name = DB
        self.dsn = dsn

    def connect(self, autocommit=True):
        return psycopg.connect(self.dsn, autocommit=autocommit)


def test_failover_mid_drain(services, template, relay_bin, build, tmp_path):
    n, keys, window = 15000, 100, 200
    pair = PgPair(services, template)
    r = None
    try:
        # three nodes, as a cluster manager's conninfo names them: one is down throughout
        db = PairDb(pair.multi_host(("primary", "down", "standby")))
        c = Case(services, db, relay_bin, build, tmp_path, "standby", reconnect_max="1s",
                 sink={"publish_window": str(window)})
        c.produce(n, keys, size=256, batch=1000)
        pair.make_standby(synchronous=True)
        pair.wait_caught_up()
        r = c.start()
        r.wait_log("became the active relay")
        wait_relayed(r, 3000)
        pair.kill_primary()
        at = relayed(r)
        # the relay's sessions are gone; every new one finds a refused port and a standby
        cause = wait_log_at(r, r"database unavailable", timeout=20)
        # and then why no server will do: two refuse, the last is read-only (libpq names
        # each host's reason in turn: the last one must not be cut off)
        standby_cause = wait_log_at(r, r"database unavailable.*failed: session is read-only",
                                    timeout=20)
        acked = relayed(r)    # every mark the old primary acknowledged: none can come now
        time.sleep(1.0)
        with pair.connect("standby", DB) as sb:
            marked0 = {m for (m,) in sb.execute(
                "select message_id::text from outbox.messages where sent_at is not null")}
            cpu0, t0 = proc_cpu_seconds(r.proc.pid), time.monotonic()
            time.sleep(4.0)
            cpu = proc_cpu_seconds(r.proc.pid) - cpu0
            span = time.monotonic() - t0
            dead_during = sb.execute("select count(*) from outbox.messages_dead").fetchone()[0]
        sessions_on_standby = pair.relay_sessions("standby")
        pair.promote()
        t_back = time.monotonic()
        took = c.wait_all_sent(n, timeout=90)
        recovered = time.monotonic() - t_back
        sessions_on_promoted = wait_for(lambda: pair.relay_sessions("standby"), 10,
                                        interval=0.1, desc="the relay's sessions there")
        text = r.text()
        dead_total = r.metric("outbox_relay_dead_total")
        r.stop_clean()
        got = c.collect()
        dups, copies = delivery_report(got, n, keys)
        check_against_db(got, db)
    except BaseException:
        print(pair.logs())
        raise
    finally:
        if r is not None and r.proc.poll() is None:
            r.stop()
        pair.close()
    delivered = {p.message_id for p, _, _ in got}
    forgotten = max(0, int(acked) - len(marked0))   # acknowledged marks the promotion lost
    back = recovery_counts(text, r"database connected")
    warns = log_lines_at(text, r"database unavailable")
    print(f"primary killed at {at:.0f} of {n} relayed; {len(marked0)} marked on the standby "
          f"by then ({forgotten} acknowledged marks forgotten); relay CPU {cpu:.2f} s over "
          f"{span:.1f} s without a writable server; all sent {recovered:.1f} s after the "
          f"promotion ({took:.1f} s); {dups} duplicates (window {window}); first cause "
          f"logged: {cause!r}, then {standby_cause!r}; {len(warns)} WARN/ERROR lines "
          f"'database unavailable'; reconnected after {back} failures")
    assert at < n, "the primary should die mid-drain"
    assert len(marked0) < n, "every row was marked before the primary died"
    missing = marked0 - delivered
    assert not missing, f"{len(missing)} rows marked sent that never reached the broker"
    assert dead_during == 0 and dead_total == 0, "rows dead-lettered for a failover"
    assert cpu < SPIN * span, f"the relay used {cpu:.2f} s of CPU in {span:.1f} s: spinning"
    assert sessions_on_standby == 0, "the relay kept a session on the read-only standby"
    assert sessions_on_promoted >= 1, "the relay's sessions are not on the promoted server"
    assert back and all(k >= 1 for k in back), \
        f"no INFO 'database connected ... after N failures' line: {back}"
    assert forgotten == 0, (
        f"{forgotten} marks the old primary acknowledged are not on the promoted server "
        "(synchronous replication): a mark must commit durably")
    assert dups <= 2 * window, f"{dups} duplicates > 2 x window {window} (one fault)"
    assert max(copies.values()) <= 2, "a row was published more than once more for one fault"


def test_first_host_is_a_standby(services, template, relay_bin, build, tmp_path):
    n, keys = 2000, 20
    pair = PgPair(services, template)
    r = None
    try:
        pair.make_standby()
        db = PairDb(pair.multi_host(("standby", "primary")))
        c = Case(services, db, relay_bin, build, tmp_path, "sbfirst", reconnect_max="1s")
        with pair.connect("primary", DB) as p:
            assert p.execute("select to_regclass('outbox.messages') is not null").fetchone()[0], \
                "outbox-relay init did not create the table on the primary"
        r = c.start()
        r.wait_log("became the active relay")
        c.produce(n, keys, size=128, batch=200)
        c.wait_all_sent(n, timeout=60)
        on_primary = wait_for(lambda: pair.relay_sessions("primary"), 10, interval=0.1,
                              desc="the relay's sessions on the primary")
        on_standby = pair.relay_sessions("standby")
        text = r.text()
        r.stop_clean()
        got = c.collect()
        dups, _ = delivery_report(got, n, keys)
        check_against_db(got, db)
    except BaseException:
        print(pair.logs())
        raise
    finally:
        if r is not None and r.proc.poll() is None:
            r.stop()
        pair.close()
    failures = log_lines_at(text, r"database", ("WARN", "ERROR"))
    print(f"standby first in the conninfo: {on_primary} relay sessions on the primary, "
          f"{on_standby} on the standby; {n} rows sent, {dups} duplicates; "
          f"WARN/ERROR about the database: {failures[:3]}")
    assert on_standby == 0, "the relay opened a session on the standby"
    assert on_primary >= 1, "the relay has no session on the primary"
    assert not failures, f"a healthy start logged database failures: {failures[:3]}"
    assert dups == 0


def test_failover_from_a_frozen_primary(services, template, relay_bin, build, tmp_path):
    """The primary stops answering mid-drain (every process of it stopped: connections are
    accepted by the kernel, nothing answers: a frozen VM or a partition looks like this) and
    the standby is promoted. The relay's sessions must give up on the silent server
    (query_timeout), and its reconnects must get past the silent first host to the promoted
    second one: libpq bounds each host by connect_timeout only in its blocking connect, an
    asynchronous connect like the relay's waits on the silent host until the relay's own
    deadline."""
    n, keys, window = 10000, 100, 200
    pair = PgPair(services, template)
    r = None
    try:
        pair.make_standby()
        db = PairDb(pair.multi_host(("primary", "standby")))
        c = Case(services, db, relay_bin, build, tmp_path, "frozen", reconnect_max="1s",
                 connect_timeout="2s", query_timeout="4s",
                 sink={"publish_window": str(window)})
        c.produce(n, keys, size=256, batch=1000)
        pair.wait_caught_up()
        r = c.start()
        r.wait_log("became the active relay")
        wait_relayed(r, 2000)
        pair.freeze_primary()
        at = relayed(r)
        # a blocking client with this conninfo would get past the silent host by itself;
        # the test's own reads go to the standby from here on
        db.dsn = pair.dsn("standby")
        cause = wait_log_at(r, r"database unavailable.*(no answer|timed out)", timeout=30)
        acked = relayed(r)    # every mark the old primary acknowledged: none can come now
        with pair.connect("standby", DB) as sb:
            marked0 = {m for (m,) in sb.execute(
                "select message_id::text from outbox.messages where sent_at is not null")}
        cpu0, t0 = proc_cpu_seconds(r.proc.pid), time.monotonic()
        time.sleep(3.0)
        cpu = proc_cpu_seconds(r.proc.pid) - cpu0
        span = time.monotonic() - t0
        pair.promote()
        t_back = time.monotonic()
        c.wait_all_sent(n, timeout=60)
        recovered = time.monotonic() - t_back
        sessions_on_promoted = wait_for(lambda: pair.relay_sessions("standby"), 10,
                                        interval=0.1, desc="the relay's sessions there")
        # the one-shot commands connect the same way (a blocking loop of their own)
        t_check = time.monotonic()
        chk = subprocess.run([str(relay_bin), "check", "-c", str(c.cfg)], capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
        check_s = time.monotonic() - t_check
        text = r.text()
        dead_total = r.metric("outbox_relay_dead_total")
        r.stop_clean()
        got = c.collect()
        dups, copies = delivery_report(got, n, keys)
        check_against_db(got, db)
    except BaseException:
        print(pair.logs())
        raise
    finally:
        if r is not None and r.proc.poll() is None:
            r.stop()
        pair.close()
    delivered = {p.message_id for p, _, _ in got}
    forgotten = max(0, int(acked) - len(marked0))
    assert chk.returncode == 0, \
        f"outbox-relay check exited {chk.returncode}: {chk.stdout}{chk.stderr}"
    timeouts = log_lines_at(text, r"database unavailable.*timed out")
    print(f"primary frozen at {at:.0f} of {n} relayed; {len(marked0)} marked on the standby "
          f"({forgotten} acknowledged marks forgotten); relay CPU {cpu:.2f} s over {span:.1f} "
          f"s; all sent {recovered:.1f} s after the promotion; {dups} duplicates; first "
          f"cause: {cause!r}; connect time-outs logged: {timeouts[:2]}; outbox-relay check "
          f"took {check_s:.1f} s")
    assert at < n, "the primary should freeze mid-drain"
    assert not marked0 - delivered, "rows marked sent that never reached the broker"
    assert dead_total == 0, "rows dead-lettered for a failover"
    assert cpu < SPIN * span, f"the relay used {cpu:.2f} s of CPU in {span:.1f} s: spinning"
    assert sessions_on_promoted >= 1, "the relay's sessions are not on the promoted server"
    assert recovered < 30, f"{recovered:.1f} s to drain after the promotion"
    assert dups <= 2 * window + forgotten, (
        f"{dups} duplicates > 2 x window {window} + {forgotten} forgotten marks (one fault)")
    assert max(copies.values()) <= 2, "a row was published more than once more for one fault"
