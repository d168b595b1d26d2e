"""Helpers for the relay's integration tests: config files, a relay process
wrapper (optionally under valgrind), the liboutbox producer and an AMQP consumer."""
import collections
import os
import random
import re
import signal
import socket
import subprocess
import time
import urllib.request

import pika

VALGRIND = os.environ.get("OUTBOX_VALGRIND") == "1"


def _ephemeral_ports():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


_HANDED_OUT = collections.deque(maxlen=64)


def free_port():
    """A port nothing listens on, for a server a test starts: drawn from 30000-32767, below
    the kernel's ephemeral range (32768-60999 by default) and above services.sh's ports
    (20000-29999). A port bind(0) hands out is an ephemeral one: any outgoing connection may
    take it before the test's server binds it (seen: a relay's http_listen refused with
    EADDRINUSE while the other build's tests ran beside it). With OUTBOX_TEST_SHARE=K/N
    (the CI runs of both builds at the same time) each run draws from its own slice of that
    range: a port one run found free is not taken by the other before its server binds it
    (seen once in a 9-port window: http_listen refused). A port handed out lately by this
    process is not handed out again (a test's second server started before its first)."""
    lo, hi = 30000, 32767
    elo, ehi = _ephemeral_ports()
    if not (hi < elo or lo > ehi):
        lo = hi + 1                      # the range overlaps the ephemeral one: bind(0)
    from conftest import ci_share
    share = ci_share()
    if share and lo <= hi:
        k, n = share
        size = (hi - lo + 1) // n
        lo, hi = lo + k * size, lo + (k + 1) * size - 1
    for _ in range(200 if lo <= hi else 0):
        p = random.randint(lo, hi)
        if p in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
            _HANDED_OUT.append(p)
            return p
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected_payload(prefix, i, size):
    head = f"{prefix}|{i}|".encode()
    body = bytearray(head)
    for j in range(len(head), size):
        body.append((i + j) % 256)
    return bytes(body)


def write_config(path, services, db, *, outboxes=None, relay=None, sink=None, sinks=None,
                 **outbox):
    """Writes a relay ini for one outbox named 'main' (or `outboxes`: name -> dict), with
    [sink.main] (keys in `sink`) and, after it, the sections of `sinks` (name -> dict).
    log_level is not written, so the relay runs at its default level (info, config/cfg.c):
    what an operator sees. A test that needs debug lines passes relay={"log_level": "debug"}
    and says why."""
    relay_keys = {"name": "relay-test", "http_listen": "", "shutdown_timeout": "10s"}
    relay_keys.update(relay or {})
    sink_keys = {"url": services.amqp_url, "publish_window": "1000", "heartbeat": "10s",
                 "confirm_timeout": "10s", "reconnect_max": "1s"}
    sink_keys.update(sink or {})
    if outboxes is None:
        ob = {"source": "postgres", "conninfo": db.dsn, "database": db.name,
              "table": "outbox.messages", "sink": "main", "batch_size": "500",
              "poll_interval": "1s", "lease": "5s", "max_attempts": "3",
              "retry_backoff": "200ms", "retry_backoff_max": "1s", "reconnect_max": "1s"}
        ob.update(outbox)
        outboxes = {"main": ob}
    def kv(k, v):
        v = str(v)
        if ";" in v or "#" in v:  # ODBC strings: quote so ';' is not a comment
            v = '"' + v + '"'
        return f"{k} = {v}"
    lines = ["[relay]"] + [kv(k, v) for k, v in relay_keys.items()]
    lines += ["", "[sink.main]"] + [kv(k, v) for k, v in sink_keys.items()]
    for name, keys in (sinks or {}).items():
        lines += ["", f"[sink.{name}]"] + [kv(k, v) for k, v in keys.items()]
    for name, keys in outboxes.items():
        lines += ["", f"[outbox.{name}]"] + [kv(k, v) for k, v in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# every relay process started, in order: conftest's reap_relays kills those a test left
# running (one that failed before it stopped them), so that none outlives its test
STARTED = []


class Relay:
    """An `outbox-relay run` process whose stderr goes to a log file."""

    def __init__(self, relay_bin, config, log_path, http_port=None, env=None):
        """env: variables added to the relay's environment."""
        self.config = config
        self.log_path = log_path
        self.http_port = http_port
        argv = [str(relay_bin), "run", "-c", str(config)]
        if VALGRIND:
            supp = os.path.join(os.path.dirname(os.path.abspath(__file__)), "valgrind.supp")
            argv = ["valgrind", "--error-exitcode=99", "--leak-check=full",
                    "--errors-for-leak-kinds=definite", "--track-fds=no", "-q",
                    f"--suppressions={supp}"] + argv
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **(env or {})))
        STARTED.append(self.proc)

    def text(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_log(self, pattern, timeout=20):
        """Waits for pattern at ANY level: for progress lines ("became the active relay").
        A failure the operator must see is checked with wait_log_at / assert_log_at."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if rx.search(self.text()):
                return True
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"log never matched {pattern!r}; log:\n{self.text()[-4000:]}")

    def metrics(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name, outbox="main"):
        """A per-outbox metric's value; outbox=None: a process-wide one (no labels). The
        relay renders every metric for every outbox from its start, so a metric missing from
        an answer (renamed, dropped, a wrong label) fails the test: never read as 0."""
        labels = "" if outbox is None else f'{{outbox="{outbox}"}}'
        text = self.metrics()
        m = re.search(rf'^{name}{labels} (\S+)$', text, re.M)
        assert m, f"metric {name}{labels} missing from /metrics:\n{text[:3000]}"
        return float(m.group(1))

    def stop(self, sig=signal.SIGTERM, timeout=30):
        """Signals the relay (unless it already exited) and waits; returns its exit status
        (also when it had exited before: a negative status is the signal that ended it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        return rc

    def kill9(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        self.killed = True

    killed = False

    def assert_clean_exit(self, rc):
        text = self.text()
        assert rc == 0, f"relay exited {rc}; log:\n{text[-4000:]}"
        assert "ERROR: AddressSanitizer" not in text and "runtime error:" not in text, text[-4000:]

    def stop_clean(self, sig=signal.SIGTERM, timeout=30):
        """Stops a relay that must still be running and asserts it exited 0 on that signal.
        One that had already exited (crashed after being woken from SIGSTOP, or exited on its
        own after being fenced) fails with its exit status, whatever that was; a relay the
        test killed itself (kill9) is not checked."""
        if self.killed:
            return None
        before = self.proc.poll()
        rc = self.stop(sig, timeout)
        assert before is None, (f"the relay had already exited (status {before}) before the "
                                f"test stopped it; log:\n{self.text()[-4000:]}")
        self.assert_clean_exit(rc)
        return rc


def run_producer(build, dsn, database, *, count, keys=10, exchange="", routing_key="q",
                 size=64, batch=100, prefix="msg", start=0, odbc=False, table="outbox.messages"):
    argv = [str(build / "examples" / "producer"), "--dsn", dsn, "--database", database,
            "--table", table, "--count", str(count), "--keys", str(keys), "--exchange", exchange,
            "--routing-key", routing_key, "--size", str(size), "--batch", str(batch),
            "--prefix", prefix, "--start", str(start)]
    if odbc:
        argv.append("--odbc")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


def amqp_channel(services):
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=services.amqp_port, heartbeat=0, blocked_connection_timeout=30))
    return conn, conn.channel()


def declare(ch, exchange, queue, routing_key, bind=True, **qargs):
    if exchange:
        ch.exchange_declare(exchange=exchange, exchange_type="direct", durable=True)
    ch.queue_declare(queue=queue, durable=True, arguments=qargs or None)
    ch.queue_purge(queue=queue)
    if bind and exchange:
        ch.queue_bind(queue=queue, exchange=exchange, routing_key=routing_key)


ACK_EVERY = 200   # consume(): messages taken per acknowledgement (one ack each: 2.5 x slower)


def consume(ch, queue, count, timeout=60, idle=0.0):
    """Reads messages until `count` arrived (or `timeout`), then keeps listening `idle` more
    seconds so that extra copies (duplicates) would be seen too. Returns [(props, body, t)].
    The messages taken are acked together (`multiple`: every ACK_EVERY, whenever the queue
    is idle, and before returning); deliveries prefetched but not taken are requeued when
    the consumer is cancelled, so a later consume() sees them."""
    got = []
    deadline = time.monotonic() + timeout
    reached = None
    last, pending = None, 0     # the last delivery taken and not acked yet; how many
    ch.basic_qos(prefetch_count=2000)
    for method, props, body in ch.consume(queue, auto_ack=False, inactivity_timeout=0.1):
        now = time.monotonic()
        if method is not None:
            got.append((props, body, now))
            last, pending = method.delivery_tag, pending + 1
        if pending and (pending >= ACK_EVERY or method is None):
            ch.basic_ack(last, multiple=True)   # every delivery up to `last`: all taken
            pending = 0
        if reached is None and len(got) >= count:
            reached = now
        if reached is not None and now - reached >= idle:
            break
        if now > deadline:
            break
    if pending:
        ch.basic_ack(last, multiple=True)
    ch.cancel()  # nacks (requeues) what was delivered but not taken
    return got


def psql_rows(db, sql, params=()):
    with db.connect() as c:
        return c.execute(sql, params).fetchall()


# ---------------------------------------------------------------------------- fault-test helpers
# (added for tests/test_relay_faults.py)
PG_BIN = "/usr/lib/postgresql/15/bin"


def proc_cpu_seconds(pid):
    """utime + stime of a process in seconds, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2:].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status_kb(pid, key):
    """A '<key>: N kB' line of /proc/PID/status (VmHWM, VmRSS, ...) in kB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)



# CPU seconds a waiting relay may use per second of a fault (a spinning loop uses ~1.0; an
# idle relay that retries with back-off and polls uses well under 0.01 on a quiet machine)
SPIN = 0.1


def dead_rows(pgdb):
    """Rows in the dead-letter table."""
    import psycopg
    with psycopg.connect(pgdb.dsn, autocommit=True) as c:
        return c.execute("select count(*) from outbox.messages_dead").fetchone()[0]


def sent_count(pgdb):
    """Outbox rows marked sent."""
    import psycopg
    with psycopg.connect(pgdb.dsn, autocommit=True) as c:
        return c.execute("select count(*) from outbox.messages where sent_at is not null"
                         ).fetchone()[0]


class FaultWindow:
    """What a relay does while a fault holds (the production fault tests). `hold()` lets
    what was in flight when the fault began settle or fail (`settle` s), then observes the
    relay for `seconds`: `at`, rows relayed at the start (its relayed_total counter);
    `sent0`/`sent1`, rows marked sent at both ends; `cpu`, the relay process's CPU seconds
    over the window, and `span` its length; `dead`, dead-letter rows at its end; each of
    `probes` (name -> callable) is read at both ends into `ends[name]` = (first, last).
    `begin()`/`end()` do the same for a window the test times itself. Once the test has
    removed the cause, `recover(wait)` times `wait()` (`recovered` s; what it returned in
    `took`) and keeps the relay's log (`text`) and its dead_total metric (`dead_total`)."""

    def __init__(self, relay, pgdb, probes=None):
        self.relay, self.pgdb, self.probes = relay, pgdb, dict(probes or {})
        self.ends = {}

    def begin(self, settle=1.0, since=None):
        time.sleep(settle)
        self.at = self.relay.metric("outbox_relay_relayed_total") or 0
        self.ends = {name: (read(),) for name, read in self.probes.items()}
        self.sent0 = sent_count(self.pgdb)
        self.cpu0 = proc_cpu_seconds(self.relay.proc.pid)
        self.t0 = time.monotonic() if since is None else since
        return self

    def end(self):
        self.cpu = proc_cpu_seconds(self.relay.proc.pid) - self.cpu0
        self.span = time.monotonic() - self.t0
        self.sent1 = sent_count(self.pgdb)
        self.dead = dead_rows(self.pgdb)
        for name, read in self.probes.items():
            self.ends[name] += (read(),)
        return self

    def hold(self, seconds=6.0, settle=1.0):
        self.begin(settle)
        time.sleep(seconds)   # the measure is the CPU used over a span: it has to pass
        return self.end()

    def recover(self, wait):
        t_back = time.monotonic()
        self.took = wait()
        self.recovered = time.monotonic() - t_back
        self.text = self.relay.text()
        self.dead_total = self.relay.metric("outbox_relay_dead_total")
        return self

    def summary(self):
        return (f"{self.sent1 - self.sent0} marks and {self.dead} dead rows during "
                f"{self.span:.1f} s; relay CPU {self.cpu:.2f} s over it")

    def assert_quiet(self, marked, dead):
        """Nothing marked sent and nothing dead-lettered while the fault held (`marked`,
        `dead`: the messages), and no spinning: under SPIN CPU seconds a second."""
        assert self.sent1 == self.sent0, marked
        assert self.dead == 0 and self.dead_total == 0, dead
        assert self.cpu < SPIN * self.span, (
            f"the relay used {self.cpu:.2f} s of CPU in {self.span:.1f} s: spinning")

def pg_ctl(services, *args, timeout=90):
    """pg_ctl on the private cluster (as the postgres user when root, like services.sh)."""
    argv = [f"{PG_BIN}/pg_ctl", "-D", str(services.dir / "pg"), *map(str, args)]
    if os.geteuid() == 0:
        argv = ["runuser", "-u", "postgres", "--"] + argv
    return subprocess.run(argv, cwd=str(services.dir), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def services_start():
    """scripts/services.sh start (idempotent): brings both servers back if a test stopped one."""
    sh = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "services.sh")
    return subprocess.run([sh, "start"], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def broker_connections(services, connection_name):
    """Erlang pids of the broker connections whose client property connection_name matches."""
    p = services.rabbitmqctl("list_connections", "-q", "--no-table-headers", "pid",
                             "client_properties")
    pids = []
    for line in p.stdout.splitlines():
        pid, _, props = line.partition("\t")
        if f'{{"connection_name","{connection_name}"}}' in props:
            pids.append(pid.strip())
    return pids


class BrokerCloser:
    """Closes the broker connection named connection_name `times` times, each one once that
    connection has received `after_bytes` bytes from the relay (publishes), from inside the
    broker: one `rabbitmqctl eval` started in a background thread watches the connections
    every few milliseconds, so a close lands mid-drain however slow the CLI is on a loaded
    machine (a CLI call per close takes 0.4 s on a quiet machine and several seconds on a
    busy one, by which time a fast relay may have drained everything). Each new connection
    of that name is closed once. The constructor returns once the watch runs (the broker
    writes ready_file, a path it can write). wait() -> [bytes the connection had received
    when closed] (shorter than `times` when the deadline passed first)."""

    def __init__(self, services, connection_name, times, after_bytes, ready_file,
                 reason="test", deadline_s=120):
        import threading
        name = connection_name.replace("\\", "\\\\").replace('"', '\\"')
        expr = (
            'ok = file:write_file("%s", <<"ready">>), '
            'N = <<"%s">>, Times = %d, After = %d, '
            'Deadline = erlang:monotonic_time(millisecond) + %d, '
            'Named = fun() -> [P || P <- rabbit_networking:connections(), '
            '  case catch rabbit_networking:connection_info(P, [client_properties]) of '
            '  [{client_properties, CP}] when is_list(CP) -> '
            '    lists:keyfind(<<"connection_name">>, 1, CP) =:= '
            '    {<<"connection_name">>, longstr, N}; _ -> false end] end, '
            'Loop = fun L(Seen, Acc) -> '
            '  case length(Acc) >= Times orelse erlang:monotonic_time(millisecond) > Deadline of '
            '  true -> lists:reverse(Acc); '
            '  false -> '
            '    Big = [{P, O} || P <- Named(), not lists:member(P, Seen), '
            '           [{recv_oct, O}] <- [catch rabbit_networking:connection_info(P, [recv_oct])], '
            '           O >= After], '
            '    case Big of '
            '    [{P1, O1} | _] -> rabbit_networking:close_connection(P1, "%s"), '
            '                      L([P1 | Seen], [O1 | Acc]); '
            '    [] -> timer:sleep(3), L(Seen, Acc) '
            '    end '
            '  end '
            'end, '
            'Loop([], []).' % (ready_file, name, times, after_bytes, deadline_s * 1000, reason))
        self.result = None
        self._p = None

        def run():
            self._p = services.rabbitmqctl("eval", expr, timeout=deadline_s + 60)
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        # watching once the broker wrote ready_file (the CLI's start-up is the slow part)
        deadline = time.monotonic() + 60
        while not os.path.exists(ready_file):
            assert self._thread.is_alive() or self._p is None or self._p.returncode == 0, \
                f"rabbitmqctl eval failed: {self._p.stdout}{self._p.stderr}"
            assert time.monotonic() < deadline, "the broker-side closer did not start in 60 s"
            time.sleep(0.02)

    def wait(self, timeout=200):
        self._thread.join(timeout)
        assert self._p is not None, "rabbitmqctl eval did not return"
        assert self._p.returncode == 0, self._p.stdout + self._p.stderr
        return [int(x) for x in re.findall(r"\d+", self._p.stdout)]


def queue_depth(services, queue):
    """Messages ready in a queue (passive declare on a short-lived connection)."""
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=services.amqp_port, heartbeat=0, blocked_connection_timeout=30))
    try:
        return conn.channel().queue_declare(queue=queue, passive=True).method.message_count
    finally:
        conn.close()


def delivery_report(got, count, keys, start=0):
    """Checks deliveries of producer messages start..start+count-1: every one arrived, each
    seq always carried the same message_id, first deliveries keep per-key (seq mod keys)
    order. Returns (duplicates, {seq: n_copies})."""
    ids = {}
    copies = {}
    last = {}
    for props, body, _ in got:
        seq = int(props.headers["seq"])
        assert body.split(b"|", 2)[1] == str(seq).encode(), f"seq {seq}: body {body[:40]!r}"
        ids.setdefault(seq, set()).add(props.message_id)
        copies[seq] = copies.get(seq, 0) + 1
        if copies[seq] > 1:
            continue
        if keys:
            k = seq % keys
            assert last.get(k, -1) < seq, f"key {k}: seq {seq} first arrived after {last[k]}"
            last[k] = seq
    missing = sorted(set(range(start, start + count)) - set(copies))
    assert not missing, f"{len(missing)} messages lost, e.g. {missing[:10]}"
    extra = sorted(set(copies) - set(range(start, start + count)))
    assert not extra, f"unexpected seqs {extra[:10]}"
    multi = {s: v for s, v in ids.items() if len(v) > 1}
    assert not multi, f"duplicates with different message_ids: {list(multi.items())[:3]}"
    return len(got) - len(copies), copies


def close_quietly(*socks):
    """Closes each socket, ignoring errors (one already closed or reset)."""
    for x in socks:
        try:
            x.close()
        except OSError:
            pass


class _TcpProxy:
    """A TCP proxy 127.0.0.1:port -> 127.0.0.1:target_port: each connection accepted gets its
    own connection to the target and a thread running self._pump(entry), entry being
    [client, server, state dict]. close() ends everything. A subclass sets its own
    attributes before calling __init__ (the accepting thread starts there)."""

    def __init__(self, target_port, port=0):
        import threading
        self._threading = threading
        self.target_port = target_port
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", port))   # port 0: any free port
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.conns = []          # [client, server, {"dead": bool}]
        self.n_accepted = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            try:
                s = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                s.settimeout(None)
            except OSError:
                c.close()
                continue
            entry = [c, s, {"dead": False}]
            with self.lock:
                self.conns.append(entry)
                self.n_accepted += 1
            self._threading.Thread(target=self._pump, args=(entry,), daemon=True).start()

    def close(self):
        self.closed = True
        close_quietly(self.lsock)
        with self.lock:
            for c, s, _ in self.conns:
                close_quietly(c, s)
            self.conns.clear()


class LostAnswerProxy(_TcpProxy):
    """A proxy to PostgreSQL that loses the answer of one statement: the `after`-th Bind of
    the prepared statement named `statement` (the extended protocol's Bind message names it)
    goes to the server, which runs it and commits, but its answer never reaches the client,
    whose connection is closed `drop_after` seconds later; the server's side stays open
    meanwhile (the server never notices, as with a network fault between the two). Every
    other connection, and this one until then, forwards both ways. `swallowed`: how many
    answers it lost (0 or 1)."""

    def __init__(self, target_port, statement, after=1, drop_after=0.5):
        self.marker = b"\x00" + statement + b"\x00"
        self.after = after
        self.drop_after = drop_after
        self.binds = 0
        self.swallowed = 0
        super().__init__(target_port)

    def _binds(self, data):
        """The Binds of the statement in data (a message starts 'B', 4 length bytes, the
        portal's name: empty, then the statement's name)."""
        n, i = 0, data.find(self.marker)
        while i >= 0:
            if i >= 5 and data[i - 5:i - 4] == b"B":
                n += 1
            i = data.find(self.marker, i + 1)
        return n

    def _pump(self, entry):
        import select
        c, s, _ = entry
        lost_at = None
        while not self.closed:
            if lost_at is not None and time.monotonic() - lost_at > self.drop_after:
                c.close()             # the client sees its connection end, no answer
                t_end = time.monotonic() + 2
                while not self.closed and time.monotonic() < t_end:
                    try:               # the server's side: read and dropped, then closed
                        r, _, _ = select.select([s], [], [], 0.05)
                        if r and not s.recv(65536):
                            break
                    except (OSError, ValueError):
                        break
                s.close()
                return
            try:
                r, _, _ = select.select([c, s], [], [], 0.05)
            except (OSError, ValueError):
                break
            for sk in r:
                try:
                    data = sk.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    close_quietly(c, s)
                    return
                if sk is s and lost_at is not None:
                    continue          # the lost answer
                if sk is c and lost_at is None:
                    with self.lock:
                        k = self._binds(data)
                        lose = k > 0 and self.binds < self.after <= self.binds + k
                        self.binds += k
                        if lose:
                            self.swallowed += 1
                    if lose:
                        lost_at = time.monotonic()
                try:
                    (s if sk is c else c).sendall(data)
                except OSError:
                    return


class BlackholeProxy(_TcpProxy):
    """A proxy for simulating a silent network partition: blackhole() makes every existing
    connection stop forwarding in both directions while its sockets stay open (no FIN, no
    RST: the peers see silence); connections made afterwards forward normally."""

    def _pump(self, entry):
        import select
        c, s, st = entry
        peer = {c: s, s: c}
        while not self.closed and not st["dead"]:
            try:
                r, _, _ = select.select([c, s], [], [], 0.05)
            except (OSError, ValueError):
                break
            if st["dead"]:
                break
            for sk in r:
                try:
                    data = sk.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    st["dead"] = True
                    close_quietly(c, s)
                    return
                try:
                    peer[sk].sendall(data)
                except OSError:
                    st["dead"] = True
                    return
        # blackholed: keep both sockets open and silent until close()

    def blackhole(self):
        """Freezes every current connection; returns how many."""
        with self.lock:
            live = [e for e in self.conns if not e[2]["dead"]]
            for e in live:
                e[2]["dead"] = True
            return len(live)


# ---------------------------------------------------------------------------- drain-order helpers
# (added for tests/test_drain_order.py; nothing above changed)
def insert_rows(db, count, keys, *, start=0, exchange="", routing_key="q", size=64, prefix="msg",
                bad=(), bad_exchange=None, bad_routing_key=None, bad_size=None,
                table="outbox.messages"):
    """Inserts rows seq start..start+count-1 server-side in ONE statement (INSERT ... SELECT
    generate_series, ids in seq order), shaped like examples/producer.c's messages: partition
    key "key-<seq mod keys>" (none when keys == 0), correlation_id "corr-<seq>", headers
    {"seq": "<seq>", "origin": "sql"}, payload "<prefix>|<seq>|" padded with 'x' to `size`.
    Rows whose seq is in `bad` go to bad_exchange / bad_routing_key (default: the good ones)
    with payload prefix "bad", padded to bad_size (default: size). Returns the number of rows
    inserted."""
    bad = sorted(set(int(s) for s in bad))
    bx = exchange if bad_exchange is None else bad_exchange
    brk = routing_key if bad_routing_key is None else bad_routing_key
    key_sql = "'key-' || (g %% %(keys)s::bigint)" if keys else "NULL"
    sql = f"""
        INSERT INTO {table} (message_id, exchange, routing_key, partition_key, message_type,
                             content_type, correlation_id, headers, payload)
        SELECT gen_random_uuid(),
               CASE WHEN b THEN %(bx)s::text ELSE %(ex)s::text END,
               CASE WHEN b THEN %(brk)s::text ELSE %(rk)s::text END,
               {key_sql}, 'test.event', 'application/octet-stream', 'corr-' || g,
               jsonb_build_object('seq', g::text, 'origin', 'sql'),
               convert_to(rpad(head, greatest(CASE WHEN b THEN %(bsize)s::int
                                                   ELSE %(size)s::int END, length(head)), 'x'),
                          'UTF8')
        FROM (SELECT g, b, CASE WHEN b THEN 'bad' ELSE %(prefix)s::text END || '|' || g || '|'
                              AS head
              FROM (SELECT g, g = ANY(%(bad)s::bigint[]) AS b
                    FROM generate_series(%(start)s::bigint, %(end)s::bigint) AS g) s0) s
        ORDER BY g"""
    params = {"keys": keys, "bx": bx, "ex": exchange, "brk": brk, "rk": routing_key,
              "prefix": prefix, "size": size, "bsize": size if bad_size is None else bad_size,
              "bad": bad, "start": start,
              "end": start + count - 1}
    with db.connect() as c:
        return c.execute(sql, params).rowcount


def order_report(got, expected, key_of):
    """The consumer-side oracle for rows with arbitrary expected seqs (e.g. some rows were
    dead-lettered and never arrive). got: [(props, body, t)] in queue order; expected: the
    seqs that must arrive; key_of(seq): their partition key (None: no order constraint).
    Asserts: first occurrences keep id (= seq) order within EVERY key; every expected seq
    arrived (lost 0); nothing unexpected arrived; each seq always carried one message_id.
    Returns (duplicates, {seq: copies})."""
    expected = set(expected)
    ids, copies, last, inversions = {}, {}, {}, []
    for props, body, _ in got:
        seq = int(props.headers["seq"])
        assert body.split(b"|", 2)[1] == str(seq).encode(), f"seq {seq}: body {body[:40]!r}"
        ids.setdefault(seq, set()).add(props.message_id)
        copies[seq] = copies.get(seq, 0) + 1
        if copies[seq] > 1:
            continue
        k = key_of(seq)
        if k is None:
            continue
        if last.get(k, -1) > seq:
            inversions.append((k, seq, last[k]))
        last[k] = max(seq, last.get(k, -1))
    assert not inversions, (f"{len(inversions)} per-key order inversions (key, seq, first "
                            f"arrived after seq): {inversions[:8]}")
    missing = sorted(expected - set(copies))
    assert not missing, f"{len(missing)} messages lost, e.g. {missing[:10]}"
    extra = sorted(set(copies) - expected)
    assert not extra, (f"{len(extra)} unexpected seqs arrived (dead-lettered rows?), "
                       f"e.g. {extra[:10]}")
    multi = {s: v for s, v in ids.items() if len(v) > 1}
    assert not multi, f"duplicates with different message_ids: {list(multi.items())[:3]}"
    return len(got) - len(copies), copies


class LiveConsumer:
    """Consumes a queue on its own connection in a background thread while the relay drains,
    so the list is in queue order and `on_first(seq)` runs when a seq FIRST arrives (before
    the next delivery is taken). Exceptions in on_first are collected in .errors."""

    def __init__(self, services, queue, on_first=None, prefetch=500):
        import threading
        self.services, self.queue = services, queue
        self.on_first, self.prefetch = on_first, prefetch
        self.got = []
        self.seen = set()
        self.errors = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(20):
            raise AssertionError(f"consumer on {queue} did not start: {self.errors}")

    def _run(self):
        try:
            conn, ch = amqp_channel(self.services)
        except Exception as e:  # noqa: BLE001 - reported through .errors
            self.errors.append(e)
            self._ready.set()
            return
        try:
            ch.basic_qos(prefetch_count=self.prefetch)
            gen = ch.consume(self.queue, auto_ack=False, inactivity_timeout=0.05)
            self._ready.set()
            for method, props, body in gen:
                if method is not None:
                    seq = int(props.headers["seq"])
                    if seq not in self.seen:
                        self.seen.add(seq)
                        if self.on_first is not None:
                            try:
                                self.on_first(seq)
                            except Exception as e:  # noqa: BLE001
                                self.errors.append(e)
                    with self._lock:
                        self.got.append((props, body, time.monotonic()))
                    ch.basic_ack(method.delivery_tag)
                if self._stop.is_set():
                    break
            ch.cancel()
        except Exception as e:  # noqa: BLE001
            self.errors.append(e)
        finally:
            self._ready.set()
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass

    def count(self):
        with self._lock:
            return len(self.got)

    def wait_distinct(self, n, timeout):
        """Waits until n distinct seqs arrived; returns whether they did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._thread.is_alive():
            if len(self.seen) >= n:
                return True
            time.sleep(0.05)
        return len(self.seen) >= n

    def stop(self, idle=0.5):
        """Keeps listening `idle` more seconds (to see late duplicates), then stops; returns
        the deliveries [(props, body, t)] in arrival order."""
        time.sleep(idle)
        self._stop.set()
        self._thread.join(30)
        with self._lock:
            return list(self.got)


class MetricSampler:
    """Samples one per-outbox metric of a Relay's /metrics in a background thread every
    `interval` seconds until stop(); .samples holds the values read."""

    def __init__(self, relay, name, interval=0.005, outbox="main"):
        import threading
        self.relay, self.name, self.interval, self.outbox = relay, name, interval, outbox
        self.samples = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                v = self.relay.metric(self.name, self.outbox)
                if v is not None:
                    self.samples.append(v)
            except OSError:
                self.errors += 1
            self._stop.wait(self.interval)

    def stop(self):
        self._stop.set()
        self._thread.join(30)
        return self.samples


def broker_publish_channel_errors(services, exchange):
    """How many times the broker closed a channel because a basic.publish named the missing
    `exchange` (counted in the broker's own log; passive exchange.declare checks are not
    counted), or None when the broker's log cannot be read. Use a unique exchange name."""
    needle = ("operation basic.publish caused a channel exception not_found: "
              f"no exchange '{exchange}'")
    try:
        with open(services.rabbit_log, errors="replace") as f:
            return sum(1 for line in f if needle in line)
    except OSError:
        return None


def relay_sink_reconnects(text, sink="main"):
    """How often a relay log says its sink connected, minus the first time: broker connection
    losses (and, in some versions, channel reopens). A test that expects no duplicates allows
    window x this many, so a connection closed from outside (another test on the shared
    broker closing every connection) does not fail it spuriously."""
    return max(0, len(re.findall(rf"sink={re.escape(sink)}: connected", text)) - 1)


def relay_channel_closes(text):
    """Lines of a relay log that report a channel closed by the broker."""
    return len(re.findall(r"closed by the broker", text))


def memory_unmeasurable(relay_bin):
    """Why the relay's own RSS cannot be measured in this run (sanitizer or valgrind build),
    or None for a plain build."""
    if VALGRIND or os.environ.get("OUTBOX_VALGRIND", "") not in ("", "0"):
        return "valgrind run: RSS is valgrind's, not the relay's"
    p = subprocess.run(["ldd", str(relay_bin)], capture_output=True, text=True, timeout=30)
    for lib in ("libasan", "libubsan", "libtsan"):
        if lib in p.stdout:
            return f"{lib} build: RSS includes the sanitizer's shadow memory"
    return None


# ---------------------------------------------------------------------------- ops helpers
# (added for tests/test_relay_ops.py; nothing above changed)
LOG_TEXT_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (ERROR|WARN|INFO|DEBUG) (.*)$")


def log_events(text):
    """[(LEVEL, message)] of a relay log in either format (relay/log.c: text
    "TS LEVEL msg" or JSON {"ts","level","msg"}); other lines are skipped."""
    import json
    out = []
    for ln in text.splitlines():
        m = LOG_TEXT_RE.match(ln)
        if m:
            out.append((m.group(1), m.group(2)))
            continue
        if ln.startswith("{"):
            try:
                obj = json.loads(ln)
            except ValueError:
                continue
            if isinstance(obj, dict) and "level" in obj and "msg" in obj:
                out.append((str(obj["level"]).upper(), str(obj["msg"])))
    return out


def log_lines_at(text, pattern, levels=("WARN", "ERROR")):
    """Messages matching the regex pattern logged at one of levels (not any level)."""
    rx = re.compile(pattern)
    return [msg for lvl, msg in log_events(text) if lvl in levels and rx.search(msg)]


def wait_log_at(relay, pattern, levels=("WARN", "ERROR"), timeout=20, count=1):
    """Waits until `count` lines matching pattern were logged at one of levels (default WARN
    or ERROR: what an operator sees at the default level) in a Relay's log; returns the
    count-th such message. A match at another level does not count: the failure message
    names the levels seen. Also usable after the relay stopped (it reads the log file)."""
    deadline = time.monotonic() + timeout
    while True:
        text = relay.text()
        got = log_lines_at(text, pattern, levels)
        if len(got) >= count:
            return got[count - 1]
        if time.monotonic() >= deadline or relay.proc.poll() is not None:
            other = [f"{lvl} {msg}" for lvl, msg in log_events(text) if re.search(pattern, msg)]
            raise AssertionError(
                f"{len(got)} of {count} {'/'.join(levels)} line(s) matched {pattern!r} within "
                f"{timeout}s; at any level: {other[:8]}; log:\n{text[-4000:]}")
        time.sleep(0.05)


def assert_log_at(relay, pattern, levels=("WARN", "ERROR"), count=1):
    """wait_log_at without waiting: the log already holds `count` lines matching pattern at
    one of levels (default WARN or ERROR); returns the count-th message."""
    return wait_log_at(relay, pattern, levels, timeout=0, count=count)


ANY_LEVEL = ("ERROR", "WARN", "INFO", "DEBUG")   # for checks that something was NOT logged


class SilentListener:
    """A TCP listener on 127.0.0.1 that accepts every connection and never answers
    (nor closes it): a broker address whose port is open but whose broker is hung.
    n_accepted counts the connections made to it."""

    def __init__(self):
        import threading
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(128)
        self.port = self.lsock.getsockname()[1]
        self.conns = []
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def n_accepted(self):
        with self.lock:
            return len(self.conns)

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            with self.lock:
                self.conns.append(c)

    def close(self):
        self.closed = True
        try:
            self.lsock.close()
        except OSError:
            pass
        with self.lock:
            for c in self.conns:
                try:
                    c.close()
                except OSError:
                    pass
            self.conns.clear()


def make_pki(d):
    """A CA, a server certificate whose only name is the IP SAN 127.0.0.1 (CN is not a host
    name), a client certificate from the same CA, and a second, unrelated CA. Returns a dict
    of PEM paths: ca, server_cert, server_key, client_cert, client_key, other_ca."""
    d.mkdir(parents=True, exist_ok=True)

    def ossl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    for ca in ("ca", "other_ca"):
        ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key",
             "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN=outbox test {ca}")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out",
             f"{who}.csr", "-subj", f"/CN=outbox test {who}")
        ossl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{who}.pem", "-days", "2", "-extfile", f"{who}.ext")
    for p in d.iterdir():
        p.chmod(0o644)   # the broker runs as this user, but keep it simple to read
    return {"ca": d / "ca.pem", "server_cert": d / "server.pem", "server_key": d / "server.key",
            "client_cert": d / "client.pem", "client_key": d / "client.key",
            "other_ca": d / "other_ca.pem"}


class BrokerTlsListener:
    """An extra TLS (amqps) listener on the private RabbitMQ node, added at run time with
    rabbit_networking:start_ssl_listener (no restart, no config change) and removed by
    close(). verify_peer + fail_if_no_peer_cert: clients must present a certificate from
    the CA in pki. Attribute: port."""

    def __init__(self, services, pki):
        self.services = services
        self.port = free_port()
        opts = (f'[{{cacertfile, "{pki["ca"]}"}}, {{certfile, "{pki["server_cert"]}"}}, '
                f'{{keyfile, "{pki["server_key"]}"}}, {{verify, verify_peer}}, '
                f'{{fail_if_no_peer_cert, true}}]')
        expr = (f'{{ok, _}} = application:ensure_all_started(ssl), '
                f'rabbit_networking:start_ssl_listener({{"127.0.0.1", {self.port}}}, {opts}, 1).')
        r = services.rabbitmqctl("eval", expr, timeout=120)
        assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def close(self):
        self.services.rabbitmqctl(
            "eval", f'rabbit_networking:stop_tcp_listener({{"127.0.0.1", {self.port}}}).',
            timeout=120)


# ---------------------------------------------------------------------------- whole-message oracle
def check_against_db(got, db, table="outbox.messages"):
    """Every delivery in got [(props, body, t)] is, byte for byte, a row of the outbox: its
    message_id names a row whose payload is the body, and the AMQP properties are the row's
    (persistent, correlation_id, type, content_type, timestamp = created_at in whole seconds,
    every header of the row's headers JSON as a string header of the same name). Returns the
    number of deliveries checked. A fault that corrupted or mixed up a body past the
    `prefix|seq|` head, or lost a property, fails here."""
    rows = {}
    with db.connect() as c:
        for mid, payload, corr, mtype, ctype, created, headers in c.execute(
                f"SELECT message_id::text, payload, correlation_id, message_type, content_type, "
                f"floor(extract(epoch FROM created_at))::bigint, headers FROM {table}"):
            rows[mid] = (bytes(payload), corr, mtype, ctype, created, headers or {})
    bad = []
    for props, body, _ in got:
        row = rows.get(props.message_id)
        if row is None:
            bad.append((props.message_id, "no such row"))
            continue
        payload, corr, mtype, ctype, created, headers = row
        if body != payload:
            bad.append((props.message_id, f"body {body[:60]!r}... != payload {payload[:60]!r}..."))
        want = {"delivery_mode": 2, "correlation_id": corr, "type": mtype,
                "content_type": ctype, "timestamp": created}
        have = {k: getattr(props, k) for k in want}
        if have != want:
            bad.append((props.message_id, f"properties {have} != row {want}"))
        hdrs = {k: (v.decode() if isinstance(v, bytes) else v)
                for k, v in (props.headers or {}).items()}
        missing = {k: v for k, v in headers.items() if hdrs.get(k) != str(v)}
        if missing:
            bad.append((props.message_id, f"headers {hdrs} lack the row's {missing}"))
    assert not bad, f"{len(bad)} deliveries differ from their outbox row, e.g. {bad[:5]}"
    return len(got)


# ---------------------------------------------------------------------------- T-SQL helpers
# (added for tests/test_relay_sqlserver.py; nothing above changed)
class OdbcSql:
    """One ODBC session (autocommit) to a T-SQL server through build/tests/odbc_sql
    (tests/c/odbc_sql.c): Python has no T-SQL client here, so the tests read and write
    SQL Server (or Babelfish) through the driver the relay uses. run(sql) -> (ok, rows,
    error); a row is a list of str (text columns), bytes (binary columns) or None. Each
    statement is bounded by the program's query timeout; one session is used by one
    thread at a time (a lock serializes callers)."""

    def __init__(self, build, conn, timeout=60):
        import threading
        binary = build / "tests" / "odbc_sql"
        assert binary.exists(), f"{binary} is not built (make test-programs)"
        self._lock = threading.Lock()
        self.proc = subprocess.Popen([str(binary), "--timeout", str(timeout), conn],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        first = self.proc.stdout.readline()
        assert first.startswith("CONNECT rc=0"), \
            f"odbc_sql could not connect: {first.strip()} {self.proc.stderr.read()[-2000:]}"

    @staticmethod
    def _col(c):
        if c == "-":
            return None
        if c == "~":
            return ""
        if c.startswith("x"):
            return bytes.fromhex(c[1:])
        return bytes.fromhex(c).decode("utf-8")

    def run(self, sql):
        with self._lock:
            self.proc.stdin.write(sql.encode().hex() + "\n")
            self.proc.stdin.flush()
            rows = []
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    return False, rows, f"odbc_sql exited: {self.proc.stderr.read()[-2000:]}"
                line = line.rstrip("\n")
                if line.startswith("ROW"):
                    rows.append([self._col(c) for c in line.split()[1:]])
                elif line.startswith("DONE rc=0"):
                    return True, rows, None
                elif line.startswith("DONE rc=1"):
                    return False, rows, line.partition("error=")[2]

    def rows(self, sql):
        """The rows of sql; a failure fails the test, naming the statement."""
        ok, rows, err = self.run(sql)
        assert ok, f"T-SQL failed: {err}\n{sql}"
        return rows

    def value(self, sql):
        """The first column of the first row (None when there is no row)."""
        rows = self.rows(sql)
        return rows[0][0] if rows else None

    def close(self):
        """Ends the session; the program must exit 0 without a sanitizer report."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        err = self.proc.stderr.read()
        assert self.proc.returncode == 0, f"odbc_sql exited {self.proc.returncode}: {err[-4000:]}"
        assert "Sanitizer" not in err and "runtime error" not in err, err[-4000:]
