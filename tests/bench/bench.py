#!/usr/bin/python3
"""make bench — the relay's throughput beside the broker's own ceiling, measured in one run.

What it measures (every figure printed is a median over BENCH_ROUNDS rounds, min-max beside):

1. Key skew. For each partition-key count in BENCH_KEYS and each round: N committed 256-byte
   rows are written (server-side generate_series), then the broker ceiling is measured with
   amqp_probe (plain rabbitmq-c: persistent, mandatory, message-id + timestamp, confirms, the
   same window, the same classic durable queue), then the relay drains the rows. Probe and
   relay alternate (probe, relay, probe, relay, ...), scenarios interleave within a round.
   Both sides are timed the same way, by queue_watch on its own connection: a passive
   queue.declare every BENCH_POLL_MS ms gives the queue depth; the rate is the messages
   enqueued between the first poll that saw a message and the first poll that saw all N,
   divided by the time between those polls. Publisher start-up and the final confirms are
   outside that window on both sides alike. Separately, the relay's end-to-end figure runs
   from the relay process's start to the last row marked sent (max(sent_at), database clock;
   with on_sent = delete, to when the bench saw the table empty).
   The relay/ceiling ratio is printed against its target (PASS/BELOW — a verdict only; the
   exit status is never affected by it).
2. What bounds each relay run: CPU seconds (user+sys from /proc) of the broker (the process
   tree of the private RabbitMQ node), PostgreSQL (the postmaster's tree, including exited
   backends) and the relay, the rest of the machine (other load), the relay's confirm latency
   (median and mean from its outbox_relay_confirm_latency_seconds histogram) and window fill
   (outbox_relay_in_flight sampled every 100 ms from /metrics while the queue fills), peak RSS
   (VmHWM just before SIGTERM) and duplicates (queue depth after the relay exited minus rows).
3. A backlog of BENCH_BACKLOG_ROWS rows drained by a relay with default settings (only
   conninfo, database, sink url and http_listen set): drain time, rows/s, peak RSS vs 16 MiB.
4. Competing: BENCH_ROWS rows drained by one relay and by two relays (mode = competing, both
   sides), alternating per round; the two/one ratio against the target >= 1.
7. Big messages: BENCH_BIG_ROWS rows of BENCH_BIG_SIZE bytes (2,000 x 512 KiB = 1 GiB) drained
   by a relay with default settings (max_bytes_in_memory 64M: the relay holds about 128 of
   them buffered or being written at once; one written to the broker keeps only its headers
   until its confirm), beside the broker's ceiling for the same message size measured by the
   probe in the same run (window 1000), BENCH_BIG_ROUNDS rounds of probe then relay: rate in
   msg/s and MiB/s, the relay/ceiling ratio (target >= 0.8) and the relay's peak RSS
   (target <= 128 MiB). After each relay run, pg_read_probe reads the same rows on one
   session (payloads in binary, batches of the relay's mean claim, nothing else running):
   PostgreSQL's own read ceiling. The summary then gives the CPU each message cost the
   broker, PostgreSQL, the relay and the bench's consumer, and the rate the machine's cores
   allow at those costs, with the relay's own share at zero and at the lowest costs measured
   in the run: what bounds the figure. `make bench BENCH=big` (or BENCH=big in the
   environment) runs only this; BENCH_BIG_ROWS=0 skips it.
5. Many outboxes: one relay with BENCH_MANY outboxes (default settings, one sink) spread over
   BENCH_MANY_DBS databases, BENCH_MANY_ROWS rows in each table: the time until every table
   is drained, then the relay's idle CPU over BENCH_MANY_IDLE_S seconds (user+sys, all
   threads, from /proc/<pid>/task/*/schedstat) against <= 0.2% of a core, PostgreSQL's CPU
   meanwhile (the idle polls' cost on the server side), and peak RSS against <= 30 MiB.

6. Steady load: a producer process (`bench.py --steady-producer`, 8 connections)
   offers BENCH_STEADY_RATE single-row transactions a second over BENCH_STEADY_KEYS keys
   (each commit NOTIFYs the relay) and takes the time each COMMIT returned; a relay with
   default settings but `retention` drains them; a consumer takes the receive time of each
   message-id: commit->consume latency, lost and duplicated messages. Beside it, the naive
   dual write (INSERT, COMMIT, publish persistent + mandatory, wait for the confirm) at
   BENCH_STEADY_DUAL_RATE a second, timed from its COMMIT to its consumer the same way.
   Phases: warm-up, clean, held (a REPEATABLE READ reader holds the xmin horizon), recovery.
   Printed per window: offered and delivered rate, p50/p99 of both, PostgreSQL CPU per
   message of the relay's sessions (/proc/<pid>/stat of the backends whose application_name
   is outbox-relay), the relay's own CPU per message, rows per claim, claims per second,
   the table's dead and live tuples, its size with indexes, the backlog; then each phase
   against its target. Before it, the floor any claim pays on this machine: the backend CPU
   of a prepared empty statement's round trip and of a notification delivered to an idle
   listener, each at 1,000 a second; after it, what a claim costs against a trivial
   statement sent alike: one that takes nothing (its plan started and ended), and one that
   takes a row, as it commits (waiting for the WAL flush) and as it would without waiting.
   BENCH_ONLY=steady runs it alone; BENCH_STEADY=short is the quick version (5 + 60 + 40 +
   20 s, 10 s windows; full: 10 + 300 + 120 + 60 s, 30 s windows), BENCH_STEADY=off skips it.

Before each timed run the bench waits (at most 3 s) until the broker and PostgreSQL are idle,
so a checkpoint or a purge does not land in the next measurement. A run is flagged
"disturbed" in the summary when the relay lost a connection, the broker blocked it (memory or
disk alarm), the queue stopwatch failed or the run hit its timeout; the summary also notes
when other processes loaded the machine or the shared PostgreSQL during the runs.

PostgreSQL runs with fsync and full_page_writes on for the measurement (the test cluster
normally runs with them off) and is restored afterwards. Nothing is left running.

Environment (defaults in brackets):
  BENCH_ROWS [100000]          rows per key-skew and competing run
  BENCH_ROUNDS [3]             rounds (each: probe + relay per scenario, one + two competing)
  BENCH_KEYS [1,4,100,1000]    partition-key counts; 0 = rows without a key; empty skips
  BENCH_WINDOW [1000]          publish_window of probe and relay (key-skew and competing runs)
  BENCH_BATCH [500]            relay batch_size (key-skew and competing runs)
  BENCH_ON_SENT [mark]         mark | delete
  BENCH_ORDERING []            relay `ordering` key if set (pipelined | strict); else default
  BENCH_BACKLOG_ROWS [1000000] backlog size; 0 skips the backlog
  BENCH_BACKLOG_KEYS [1000]    partition keys of the backlog rows
  BENCH_COMPETING_KEYS [100]   partition keys of the competing runs; -1 skips them
  BENCH_MANY [50]              outboxes in the many-outboxes run; 0 skips it
  BENCH_MANY_DBS [5]           databases they are spread over
  BENCH_MANY_ROWS [1000]       rows per outbox table (20 keys)
  BENCH_MANY_IDLE_S [30]       seconds of idle CPU measured
  BENCH_BIG_ROWS [2000]        big-message run: rows; 0 skips it
  BENCH_BIG_SIZE [524288]      ... bytes per row
  BENCH_BIG_ROUNDS [1]         ... rounds (probe, relay)
  BENCH [all]                  big: only the big-message run
  BENCH_POLL_MS [5]            queue-depth poll interval
  BENCH_TIMEOUT [600]          seconds a key-skew/competing relay run may take; a run cut
                               short is reported as partial (rows sent / elapsed)
  BENCH_BACKLOG_TIMEOUT [1800] the same for the backlog
  OUTBOX_BUILD [build]         where outbox-relay and tests/amqp_probe, tests/queue_watch are
  BENCH_STEADY [full]          full | short | off: the steady-load run (6.)
  BENCH_STEADY_RATE [1000]     its offered rate, transactions (one row each) a second
  BENCH_STEADY_KEYS [1000]     partition keys
  BENCH_STEADY_BODY [200]      body bytes
  BENCH_STEADY_DUAL_RATE [50]  the dual write's rate beside it
  BENCH_STEADY_RETENTION [30s] the relay's retention
  BENCH_STEADY_OUTBOX []       more `key = value` lines for its [outbox] section, `;`-separated
                               (e.g. "claim_delay = 0")
  BENCH_ONLY []                steady: only the steady-load run
Quick check while developing: BENCH_ROWS=5000 BENCH_ROUNDS=1 BENCH_BACKLOG_ROWS=20000;
the steady run alone, short: BENCH_ONLY=steady BENCH_STEADY=short make bench.
"""
import os
import pathlib
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pika
import psycopg

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("OUTBOX_BUILD", ROOT / "build"))


def env_int(name, default):
    v = os.environ.get(name, "").strip()
    try:
        return int(v) if v else default
    except ValueError:
        sys.exit(f"bench: {name} must be an integer, got {v!r}")


N = env_int("BENCH_ROWS", 100000)
ROUNDS = env_int("BENCH_ROUNDS", 3)
KEYS = [int(k) for k in os.environ.get("BENCH_KEYS", "1,4,100,1000").replace(" ", "").split(",")
        if k != ""]
WINDOW = env_int("BENCH_WINDOW", 1000)
BATCH = env_int("BENCH_BATCH", 500)
ON_SENT = os.environ.get("BENCH_ON_SENT", "mark")
ORDERING = os.environ.get("BENCH_ORDERING", "").strip()
BACKLOG = env_int("BENCH_BACKLOG_ROWS", 1000000)
BACKLOG_KEYS = env_int("BENCH_BACKLOG_KEYS", 1000)
COMPETING_KEYS = env_int("BENCH_COMPETING_KEYS", 100)
POLL_MS = env_int("BENCH_POLL_MS", 5)
BIG_ROWS = env_int("BENCH_BIG_ROWS", 2000)
BIG_SIZE = env_int("BENCH_BIG_SIZE", 512 * 1024)
BIG_ROUNDS = max(1, env_int("BENCH_BIG_ROUNDS", 1))
BIG_RSS_TARGET_KIB = 128 * 1024
BIG_RATIO_TARGET = 0.8
BIG_BUDGET_MIB = 64          # max_bytes_in_memory's default: what holds the rows in flight
ONLY = os.environ.get("BENCH", "").strip()
if ONLY not in ("", "all", "big"):
    sys.exit(f"bench: BENCH must be big (only the big-message run) or empty, got {ONLY!r}")
MANY = env_int("BENCH_MANY", 50)
MANY_DBS = max(1, env_int("BENCH_MANY_DBS", 5))
MANY_ROWS = env_int("BENCH_MANY_ROWS", 1000)
MANY_IDLE_S = env_int("BENCH_MANY_IDLE_S", 30)
MANY_CPU_TARGET = 0.002          # of one core, idle (issue 12)
MANY_RSS_TARGET_KIB = 30 * 1024
TIMEOUT = env_int("BENCH_TIMEOUT", 600)
BACKLOG_TIMEOUT = env_int("BENCH_BACKLOG_TIMEOUT", 1800)
if ONLY == "big":        # only the big-message run
    KEYS, COMPETING_KEYS, BACKLOG, MANY = [], -1, 0, 0
SIZE = 256
QUEUE = "outbox-bench"
DB = "outbox_bench"
NCPU = os.cpu_count() or 1
TICK = os.sysconf("SC_CLK_TCK")
RSS_TARGET_KIB = 16 * 1024
# relay/ceiling targets per partition-key count (issue 7); a count between two entries gets
# the lower entry's target, 0 (no key) the many-keys one
TARGETS = {1: 0.5, 4: 0.7, 100: 0.85, 1000: 0.85}

CHILDREN = []   # every process we start, for the last-resort cleanup


class BenchError(Exception):
    pass


# ------------------------------------------------------------------ small helpers
def target_for(keys):
    if keys == 0:
        return TARGETS[max(TARGETS)]
    below = [k for k in TARGETS if k <= keys]
    return TARGETS[max(below)] if below else None


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rng(xs, fmt="{:.0f}"):
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return ""
    return "[" + fmt.format(min(xs)) + "-" + fmt.format(max(xs)) + "]"


def f0(x):
    return "-" if x is None else f"{x:.0f}"


def ms(x):
    return "-" if x is None else f"{x * 1000:.0f} ms"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def stop(p, grace=30):
    """SIGTERM, wait, SIGKILL: the process is gone when this returns."""
    if p is None or p.poll() is not None:
        return
    try:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def spawn(args, **kw):
    p = subprocess.Popen(args, **kw)
    CHILDREN.append(p)
    return p


# ------------------------------------------------------------------ CPU accounting
def scan_proc():
    """pid -> (ppid, own user+sys ticks, reaped children's user+sys ticks)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                data = f.read()
        except OSError:
            continue
        fields = data.rsplit(")", 1)[1].split()
        out[int(pid)] = (int(fields[1]), int(fields[11]) + int(fields[12]),
                         int(fields[13]) + int(fields[14]))
    return out


def tree_ticks(procs, root):
    """CPU ticks of root and its descendants, including the ones they reaped (a PostgreSQL
    backend that exited during the run is in the postmaster's cutime)."""
    if root is None or root not in procs:
        return 0
    kids = {}
    for pid, (ppid, _, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += procs[pid][1] + procs[pid][2]
        todo.extend(kids.get(pid, ()))
    return total


def machine_ticks():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest is already in user)
    return sum(v[:8]) - v[3] - v[4]


def pid_ticks(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return 0


def task_cpu_s(pid):
    """CPU seconds (ns precision) of every thread of pid, from /proc/<pid>/task/*/schedstat."""
    total = 0
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                pass
    except OSError:
        return 0.0
    return total / 1e9


def vm_hwm_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class Snapshot:
    """CPU seconds so far of the broker, PostgreSQL, the bench's own tree and the machine."""

    def __init__(self, svc, relay_pids=()):
        procs = scan_proc()
        self.t = time.monotonic()
        self.broker = tree_ticks(procs, svc.rabbit_pid()) / TICK
        self.pg = tree_ticks(procs, svc.postmaster_pid()) / TICK
        self.mine = tree_ticks(procs, os.getpid()) / TICK
        self.machine = machine_ticks() / TICK
        self.relays = sum(pid_ticks(p) for p in relay_pids) / TICK


def usage(a, b, relay_secs=0.0, side_secs=0.0):
    """Cores used between snapshots a and b. relay_secs: CPU of the measured relay(s);
    side_secs: CPU of the probe (reaped, so already inside b.mine)."""
    secs = max(b.t - a.t, 1e-9)
    mine = b.mine - a.mine
    tools = max(mine - relay_secs - side_secs, 0.0)
    other = (b.machine - a.machine) - (b.broker - a.broker) - (b.pg - a.pg) - mine
    return {
        "secs": secs,
        "broker": (b.broker - a.broker) / secs,
        "pg": (b.pg - a.pg) / secs,
        "relay": relay_secs / secs,
        "probe": side_secs / secs,
        "tools": tools / secs,
        "other": max(other, 0.0) / secs,
        "machine": (b.machine - a.machine) / secs,
        "broker_s": b.broker - a.broker,
        "pg_s": b.pg - a.pg,
        "relay_s": relay_secs,
    }


# ------------------------------------------------------------------ services
class Services:
    def __init__(self):
        subprocess.run([str(ROOT / "scripts/services.sh"), "start"], check=True,
                       stdout=subprocess.DEVNULL)
        out = subprocess.run([str(ROOT / "scripts/services.sh"), "env"], check=True,
                             capture_output=True, text=True).stdout
        self.env = dict(re.findall(r"^export (\w+)=['\"]?([^'\"\n]*)['\"]?$", out, re.M))
        self.dir = pathlib.Path(self.env.get("OUTBOX_SERVICES_DIR", ROOT / ".services"))
        self.pg_port = int(self.env["OUTBOX_PG_PORT"])
        self.amqp_port = int(self.env["OUTBOX_AMQP_PORT"])
        self.amqp_url = self.env["OUTBOX_AMQP_URL"]

    @staticmethod
    def _first_int(path):
        try:
            m = re.match(r"\s*(\d+)", path.read_text())
            return int(m.group(1)) if m else None
        except OSError:
            return None

    def postmaster_pid(self):
        return self._first_int(self.dir / "pg/postmaster.pid")

    def rabbit_pid(self):
        return self._first_int(self.dir / "rabbitmq/rabbitmq.pid")

    def pg(self, db):
        return psycopg.connect(host="127.0.0.1", port=self.pg_port, user="postgres",
                               dbname=db, autocommit=True)

    def conninfo(self):
        return f"host=127.0.0.1 port={self.pg_port} dbname={DB} user=postgres"


class Broker:
    """The bench's own AMQP connection: declare, purge, depth."""

    def __init__(self, svc):
        self.svc = svc
        self._open()

    def _open(self):
        self.conn = pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", self.svc.amqp_port, heartbeat=0, blocked_connection_timeout=None))
        self.ch = self.conn.channel()

    def _call(self, fn):
        try:
            return fn()
        except (pika.exceptions.AMQPError, OSError):
            self._open()   # idle for minutes while a backlog drains: reconnect once
            return fn()

    def reset(self):
        def go():
            self.ch.queue_declare(QUEUE, durable=True)
            self.ch.queue_purge(QUEUE)
        self._call(go)

    def depth(self):
        return self._call(lambda: self.ch.queue_declare(
            QUEUE, durable=True, passive=True).method.message_count)

    def delete(self):
        self._call(lambda: self.ch.queue_delete(QUEUE))

    def close(self):
        try:
            self.conn.close()
        except Exception:
            pass


def other_xacts(conn):
    """Transactions PostgreSQL has counted for other databases (a noise indicator: the test
    cluster may be shared; pg_stat_database lags by up to about a second)."""
    n = conn.execute("select coalesce(sum(xact_commit + xact_rollback), 0) from "
                     "pg_stat_database where datname is distinct from %s", (DB,)).fetchone()[0]
    return int(n)


def settle(svc, quiet=0.25, longest=3.0):
    """Wait (at most `longest` s) until broker + PostgreSQL use under `quiet` cores over 250 ms:
    a checkpoint, a purge or the last run's fsyncs should not land in the next measurement."""
    end = time.monotonic() + longest
    while True:
        a = Snapshot(svc)
        time.sleep(0.25)
        b = Snapshot(svc)
        if ((b.broker - a.broker) + (b.pg - a.pg)) / (b.t - a.t) < quiet or \
                time.monotonic() > end:
            return


# ------------------------------------------------------------------ the queue stopwatch
class Watcher:
    """queue_watch in the background; see tests/bench/queue_watch.c."""

    def __init__(self, svc, target):
        self.target = target
        self.lines = {}
        self.error = None
        self.p = spawn([str(BUILD / "tests/queue_watch"), svc.amqp_url, QUEUE, str(target),
                        str(POLL_MS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = self.p.stdout.readline().split()
        if not first or first[0] != "ready":
            err = self.p.stderr.read()
            stop(self.p)
            raise BenchError(f"queue_watch did not start: {err.strip()}")
        self.lines["ready"] = first
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.p.stdout:
            parts = line.split()
            if parts:
                self.lines[parts[0]] = parts
        self.done.set()

    def result(self, wait, fallback_depth=None):
        """(rate, t_first, t_last, full): the queue-timed rate. If the target was not reached
        within `wait` s, the rate up to now from `fallback_depth` (a partial figure)."""
        self.done.wait(wait)
        t_now = time.monotonic()
        exited = self.p.poll()
        stop(self.p, grace=2)
        first, last = self.lines.get("first"), self.lines.get("last")
        if exited not in (None, 0):
            self.error = (f"queue_watch failed (status {exited}): "
                          f"{self.p.stderr.read().strip()}")
        if first is None:
            return None, None, None, False
        t1, d1 = float(first[1]), int(first[2])
        if last is not None:
            t2, d2 = float(last[1]), int(last[2])
            full = True
        else:
            t2, d2, full = t_now, fallback_depth, False
            if d2 is None:
                return None, t1, None, False
        if t2 - t1 < 0.001:
            return None, t1, t2, full
        return (d2 - d1) / (t2 - t1), t1, t2, full


# ------------------------------------------------------------------ relay metrics
METRIC_RE = re.compile(r'^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)\s*$')
LABEL_RE = re.compile(r'(\w+)="([^"]*)"')


def scrape(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return None
    out = {}
    for line in text.splitlines():
        m = METRIC_RE.match(line)
        if not m:
            continue
        labels = dict(LABEL_RE.findall(m.group(2) or ""))
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((labels, v))
    return out


def msum(metrics, name):
    return sum(v for _, v in metrics.get(name, ())) if metrics else 0.0


def hist_buckets(metrics, name):
    """{le: cumulative count} summed over label sets."""
    b = {}
    for labels, v in (metrics or {}).get(name + "_bucket", ()):
        le = float("inf") if labels.get("le") == "+Inf" else float(labels.get("le", "nan"))
        b[le] = b.get(le, 0) + v
    return b


def hist_quantile(buckets, q):
    """Linear interpolation inside the bucket (Prometheus histogram_quantile)."""
    if not buckets:
        return None
    les = sorted(buckets)
    total = buckets[les[-1]]
    if total <= 0:
        return None
    rank, prev_le, prev_c = q * total, 0.0, 0.0
    for le in les:
        c = buckets[le]
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1)
        prev_le, prev_c = le, c
    return None


class Sampler(threading.Thread):
    """Scrapes a relay's /metrics every 100 ms: in-flight, blocked, relayed."""

    def __init__(self, port):
        super().__init__(daemon=True)
        self.port = port
        self.samples = []   # (t, in_flight, blocked, relayed, buffered, unmarked, held bytes;
                            #  None: absent)
        self.halt = threading.Event()
        self.relayed = 0.0

    def run(self):
        while not self.halt.wait(0.1):
            m = scrape(self.port)
            if m is None:
                continue
            self.relayed = msum(m, "outbox_relay_relayed_total")
            self.samples.append((time.monotonic(), msum(m, "outbox_relay_in_flight"),
                                 msum(m, "outbox_relay_sink_blocked"), self.relayed,
                                 msum(m, "outbox_relay_buffered")
                                 if "outbox_relay_buffered" in m else None,
                                 msum(m, "outbox_relay_confirmed_unmarked")
                                 if "outbox_relay_confirmed_unmarked" in m else None,
                                 msum(m, "outbox_relay_held_bytes")
                                 if "outbox_relay_held_bytes" in m else None))

    def mean_of(self, col, t1, t2):
        """Mean of a sampled gauge while the queue filled (t1..t2); None if never sampled."""
        xs = [s[col] for s in self.samples if t1 is None or t2 is None or t1 <= s[0] <= t2]
        if not xs:
            xs = [s[col] for s in self.samples]
        xs = [x for x in xs if x is not None]
        return statistics.mean(xs) if xs else None

    def mean_in_flight(self, t1, t2):
        return self.mean_of(1, t1, t2)

    def mean_buffered(self, t1, t2):
        return self.mean_of(4, t1, t2)

    def mean_unmarked(self, t1, t2):
        return self.mean_of(5, t1, t2)

    def mean_held(self, t1, t2):
        return self.mean_of(6, t1, t2)

    def blocked_seen(self):
        return any(s[2] > 0 for s in self.samples)


# ------------------------------------------------------------------ rows and configs
def fill(conn, n, keys, size=SIZE):
    t0 = time.monotonic()
    conn.execute("truncate outbox.messages, outbox.messages_dead")
    key = f"'k' || (g %% {keys})" if keys else "NULL"   # %% : psycopg placeholder escape
    conn.execute(f"""insert into outbox.messages (message_id, routing_key, partition_key, payload)
                    select gen_random_uuid(), %s, {key},
                           convert_to(rpad(g::text || '|', {size}, 'x'), 'UTF8')
                    from generate_series(1, {n}) g""", (QUEUE,))
    conn.execute("vacuum analyze outbox.messages")
    conn.execute("checkpoint")
    return time.monotonic() - t0


def write_cfg(path, svc, port, name=None, mode=None, defaults=False):
    lines = ["[relay]", f"http_listen = 127.0.0.1:{port}"]
    if not defaults:
        lines += [f"name = {name}", "log_level = warn"]
    lines += ["[sink.main]", f"url = {svc.amqp_url}"]
    if not defaults:
        lines += [f"publish_window = {WINDOW}"]
    lines += ["[outbox.bench]", f"conninfo = {svc.conninfo()}", f"database = {DB}"]
    if not defaults:
        lines += [f"batch_size = {BATCH}", "poll_interval = 1s", f"on_sent = {ON_SENT}"]
        if mode:
            lines.append(f"mode = {mode}")
        if ORDERING:
            lines.append(f"ordering = {ORDERING}")
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------ one probe run
def tool_run(svc, conn, argv, on_fail=lambda: None):
    """Runs one of the bench's own tools (argv) to its end: its stdout, and the cores each
    process used meanwhile (usage(), the tool's own CPU as the side). on_fail runs before a
    BenchError for a tool that failed or outran TIMEOUT."""
    name = pathlib.Path(argv[0]).name
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    x0 = other_xacts(conn)
    a = Snapshot(svc)
    try:
        p = subprocess.run([str(x) for x in argv], capture_output=True, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        on_fail()
        raise BenchError(f"{name} did not finish within {TIMEOUT} s")
    b = Snapshot(svc)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    x1 = other_xacts(conn)
    if p.returncode != 0:
        on_fail()
        raise BenchError(f"{name} failed: {p.stderr.strip()}")
    side = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    u = usage(a, b, side_secs=side)
    u["pg_other_tps"] = (x1 - x0) / u["secs"]
    return p.stdout, u


def probe_run(svc, broker, conn, n, size=SIZE):
    broker.reset()
    settle(svc)
    w = Watcher(svc, n)
    out, u = tool_run(svc, conn, [BUILD / "tests/amqp_probe", svc.amqp_url, QUEUE, n, WINDOW,
                                  size], on_fail=lambda: stop(w.p))
    rate, t1, t2, full = w.result(10)
    if not full:
        raise BenchError(f"probe: {w.error or 'the queue never held every message'}")
    own = float(re.search(r"rate=([\d.]+)", out).group(1))
    m = re.search(r"blocked=([\d.]+)", out)
    blocked = float(m.group(1)) if m else 0.0
    m = re.search(r"lat_mean_ms=([\d.]+)", out)
    lat_mean = float(m.group(1)) / 1000 if m else None
    return {"rate": rate, "own": own, "cpu": u, "blocked": blocked > 0, "blocked_s": blocked,
            "lat_mean": lat_mean}


def pgread_run(svc, conn, batch_bytes):
    """PostgreSQL's own ceiling for the big-message run: pg_read_probe reads the rows (their
    payloads in binary, in id order, batches of batch_bytes) on one session, nothing else
    running. The relay's claims carry the same payloads, one claim at a time."""
    settle(svc)
    out, u = tool_run(svc, conn, [BUILD / "tests/pg_read_probe", svc.conninfo(),
                                  "outbox.messages", int(batch_bytes)])
    rows = int(re.search(r"rows=(\d+)", out).group(1))
    return {"rate": float(re.search(r"rate=([\d.]+)", out).group(1)), "cpu": u,
            "rows": rows, "batches": int(re.search(r"batches=(\d+)", out).group(1)),
            "pg_ms": 1000 * u["pg_s"] / rows if rows else None}


# ------------------------------------------------------------------ one relay run
def relay_run(svc, broker, conn, n, cfgs, timeout, windows):
    """Start one relay per config at once; wait until every row is marked sent."""
    broker.reset()
    settle(svc)
    w = Watcher(svc, n)
    relays, samplers, logs = [], [], []
    x0 = other_xacts(conn)
    a = Snapshot(svc)
    t_wall0, t0 = time.time(), time.monotonic()
    done_at, partial = None, False
    try:
        for cfg, port in cfgs:
            log = open(cfg.with_suffix(".log"), "w")
            logs.append(log)
            relays.append(spawn([str(BUILD / "outbox-relay"), "run", "-c", str(cfg)],
                                stdout=subprocess.DEVNULL, stderr=log))
            s = Sampler(port)
            s.start()
            samplers.append(s)
        last_db = 0.0
        pending_sql = ("select exists (select 1 from outbox.messages where sent_at is null)"
                       if ON_SENT == "mark" else "select exists (select 1 from outbox.messages)")
        while True:
            time.sleep(0.02)
            for p, (cfg, _) in zip(relays, cfgs):
                if p.poll() is not None:
                    tail = cfg.with_suffix(".log").read_text()[-2000:]
                    raise BenchError(f"relay exited early (status {p.returncode}); "
                                     f"log {cfg.with_suffix('.log')}:\n{tail}")
            now = time.monotonic()
            # the metrics say when to ask; the database has the last word (cheap: pending index)
            if sum(s.relayed for s in samplers) >= n or now - last_db > 0.5:
                last_db = now
                if not conn.execute(pending_sql).fetchone()[0]:
                    done_at = time.monotonic()
                    break
            if now - t0 > timeout:
                partial = True
                done_at = now
                break
        pids = [p.pid for p in relays]
        b = Snapshot(svc, pids)
        relay_cpu = sum(pid_ticks(pid) for pid in pids) / TICK
        # the relay's own database sessions (all opened after snapshot a): what its SQL costs
        sessions = conn.execute("select pid from pg_stat_activity where datname = %s and "
                                "backend_type = 'client backend' and pid <> pg_backend_pid()",
                                (DB,)).fetchall()
        session_cpu = sum(pid_ticks(pid) for (pid,) in sessions) / TICK
        rss = [vm_hwm_kib(pid) for pid in pids]
        finals = [scrape(port) for _, port in cfgs]
    finally:
        for s in samplers:
            s.halt.set()
        for p in relays:
            stop(p)
        for log in logs:
            log.close()
    u = usage(a, b, relay_secs=relay_cpu)
    u["sessions"] = session_cpu / u["secs"]
    u["pg_other_tps"] = (other_xacts(conn) - x0) / (time.monotonic() - t0)

    if ON_SENT == "mark":
        sent, last_sent = conn.execute(
            "select count(*), extract(epoch from max(sent_at)) from outbox.messages "
            "where sent_at is not null").fetchone()
        e2e = (float(last_sent) - t_wall0) if last_sent is not None and not partial else None
    else:
        sent = n - conn.execute("select count(*) from outbox.messages").fetchone()[0]
        e2e = None
    if e2e is None:
        e2e = done_at - t0
    depth = broker.depth()
    rate, t1, t2, full = w.result(5 if not partial else 0, fallback_depth=depth)

    buckets = {}
    for m in finals:
        for le, c in hist_buckets(m, "outbox_relay_confirm_latency_seconds").items():
            buckets[le] = buckets.get(le, 0) + c
    lat_sum = sum(msum(m, "outbox_relay_confirm_latency_seconds_sum") for m in finals)
    lat_cnt = sum(msum(m, "outbox_relay_confirm_latency_seconds_count") for m in finals)
    claims = sum(msum(m, "outbox_relay_claims_total") for m in finals)
    claim_sum = sum(msum(m, "outbox_relay_claim_latency_seconds_sum") for m in finals)
    settles = sum(msum(m, "outbox_relay_settle_latency_seconds_count") for m in finals)
    settle_sum = sum(msum(m, "outbox_relay_settle_latency_seconds_sum") for m in finals)
    failed = sum(msum(m, "outbox_relay_failed_total") for m in finals)
    # a lost connection's in-flight messages (lost_total, later retried_unconfirmed_total)
    lost = sum(msum(m, "outbox_relay_lost_total") +
               msum(m, "outbox_relay_retried_unconfirmed_total") for m in finals)
    expired = sum(msum(m, "outbox_relay_expired_total") for m in finals)
    overtaken = sum(msum(m, "outbox_relay_overtaken_total") for m in finals)
    buffered = [s.mean_buffered(t1, t2) for s in samplers]
    buffered = sum(buffered) if buffered and all(x is not None for x in buffered) else None
    held = [s.mean_held(t1, t2) for s in samplers]
    held = sum(held) if held and all(x is not None for x in held) else None
    unmarked = [s.mean_unmarked(t1, t2) for s in samplers]
    unmarked = sum(unmarked) if unmarked and all(x is not None for x in unmarked) else None
    in_flight = [s.mean_in_flight(t1, t2) for s in samplers]
    fill_frac = (sum(x for x in in_flight if x is not None) / sum(windows)
                 if all(x is not None for x in in_flight) and in_flight else None)
    lat_mean = lat_sum / lat_cnt if lat_cnt else None
    return {
        "rate": rate,                        # queue-timed, like the probe
        "e2e": e2e, "e2e_rate": (sent / e2e) if e2e else None,
        "startup": (t1 - t0) if t1 else None,
        "sent": sent, "partial": partial,
        "unclocked": None if full else (w.error or "the queue never held every row"),
        "depth": depth, "dups": depth - sent,
        "cpu": u, "rss": max((r for r in rss if r is not None), default=None),
        "lat_med": hist_quantile(buckets, 0.5), "lat_mean": lat_mean,
        "in_flight": sum(x for x in in_flight if x is not None) if in_flight else None,
        "fill": fill_frac,
        "little": (sum(x for x in in_flight if x is not None) / lat_mean)
                  if lat_mean and in_flight else None,
        "claims": claims, "claim_mean": claim_sum / claims if claims else None,
        "settles": settles, "settle_mean": settle_sum / settles if settles else None,
        "unmarked": unmarked,
        "unmarked_frac": unmarked / sum(windows) if unmarked is not None and windows else None,
        "failed": failed, "lost": lost, "blocked": any(s.blocked_seen() for s in samplers),
        "expired": expired, "overtaken": overtaken, "buffered": buffered, "held": held,
    }


# ------------------------------------------------------------------ reporting
def cores_line(u, who="relay"):
    parts = [f"broker {u['broker']:.2f}", f"PostgreSQL {u['pg']:.2f}"]
    if who == "relay":
        parts[-1] += f" (the relay's sessions {u['sessions']:.2f})"
        parts.append(f"relay {u['relay']:.2f}")
    else:
        parts.append(f"probe {u['probe']:.2f}")
    parts.append(f"bench tools {u['tools']:.2f}")
    parts.append(f"other load {u['other']:.2f}")
    s = ", ".join(parts) + f" of {NCPU} cores"
    if u.get("pg_other_tps", 0) >= 5:
        s += f"; PostgreSQL also served {u['pg_other_tps']:.0f} tx/s for other databases"
    return s


def big_bound(rl, mib):
    """What bounds the big-message relay runs: the rows in flight (publish_window caps them;
    a row's payload stops counting against the byte budget once written, so the budget,
    max_bytes_in_memory's default 64 MiB, caps what is buffered and being written), the
    confirm latency, the claims (each brings a share of the budget), and the cores."""
    infl = med(r["in_flight"] for r in rl if r["in_flight"] is not None)
    buf = med(r["buffered"] for r in rl if r["buffered"] is not None)
    held = med(r.get("held") for r in rl if r.get("held") is not None)
    lat = med(r["lat_mean"] for r in rl if r["lat_mean"])
    claims = med(r["claims"] for r in rl if r["claims"])
    cmean = med(r["claim_mean"] for r in rl if r["claim_mean"])
    little = med(r["little"] for r in rl if r["little"])
    cpu = rl[len(rl) // 2]["cpu"]
    parts = []
    if infl is not None:
        parts.append(f"in flight {infl:.0f} rows ({infl * mib:.0f} MiB written, their "
                     f"payloads no longer held)")
    if buf is not None:
        parts.append(f"{buf:.0f} claimed rows buffered")
    if held is not None:
        parts.append(f"bytes held {held / 2**20:.0f} MiB ({held / 2**20 / BIG_BUDGET_MIB:.0%} "
                     f"of the {BIG_BUDGET_MIB} MiB byte budget)")
    if lat is not None:
        parts.append(f"confirm latency mean {ms(lat)}")
    if little is not None:
        parts.append(f"in flight / latency {little:.0f} msg/s")
    if claims:
        parts.append(f"{claims:.0f} claims (mean {ms(cmean)}, "
                     f"{BIG_ROWS / claims:.0f} rows each)")
    return "; ".join(parts) + f" | cores: {cores_line(cpu)}"


def big_cpu_bound(rl, pr, gr):
    """The machine's bound on the big-message run: the CPU each message costs the broker,
    PostgreSQL, the relay and the bench's consumer, measured in the relay's runs, against the
    cores there are; and the same with the lowest costs measured in this run (the broker's in
    the ceiling run, PostgreSQL's in its own read): no relay that reads the payloads out of
    PostgreSQL and publishes them through this broker on these cores goes faster."""
    def per(runs, key, n):
        return med(r["cpu"][key] * r["cpu"]["secs"] / n for r in runs if r["cpu"]["secs"])
    n = BIG_ROWS
    b, g, rel = per(rl, "broker", n), per(rl, "pg", n), per(rl, "relay", n)
    t = per(rl, "tools", n)
    bc = per(pr, "broker", n)
    gc = med(x["pg_ms"] / 1000 for x in gr if x["pg_ms"])
    mp = med(p["rate"] for p in pr)
    rgr = med(x["rate"] for x in gr)
    if None in (b, g, rel, t, bc, gc) or not mp:
        return "CPU per message: -"
    now_ = b + g + rel + t
    low = min(b, bc) + min(g, gc) + rel + t
    zero = b + g + t
    return (f"CPU per message: broker {b * 1e3:.2f} ms (in the ceiling run {bc * 1e3:.2f}), "
            f"PostgreSQL {g * 1e3:.2f} ms (in its own read {gc * 1e3:.2f}), relay {rel * 1e3:.2f}"
            f" ms, bench consumer {t * 1e3:.2f} ms: {NCPU} cores allow at most "
            f"{NCPU / now_:.0f} msg/s at the relay run's costs ({NCPU / now_ / mp:.2f} of the "
            f"ceiling), {NCPU / zero:.0f} ({NCPU / zero / mp:.2f}) if the relay itself cost "
            f"nothing, {NCPU / low:.0f} ({NCPU / low / mp:.2f}) at the lowest costs measured; "
            f"PostgreSQL's own "
            f"read on one session {f0(rgr)} msg/s ({rgr / mp:.2f} of the ceiling)")


def relay_detail(r):
    fill_ = "-" if r["fill"] is None else f"{r['fill']:.0%}"
    rss = f"{r['rss'] / 1024:.1f} MiB" if r["rss"] else "-"
    buf = "" if r["buffered"] is None else f", {r['buffered']:.0f} claimed rows buffered"
    if r.get("unmarked") is not None:
        buf = (f", {r['unmarked']:.0f} confirmed awaiting their mark "
               f"({r['unmarked_frac']:.0%} of window)" + buf)
    s = (f"      e2e {r['e2e']:.2f} s ({f0(r['e2e_rate'])} msg/s, {r['startup'] or 0:.2f} s to "
         f"first enqueue) | cores: {cores_line(r['cpu'])}\n"
         f"      confirm latency median ~{ms(r['lat_med'])} mean {ms(r['lat_mean'])}; in flight "
         f"{f0(r['in_flight'])} ({fill_} of window){buf} -> in-flight/latency "
         f"{f0(r['little'])} msg/s; claims {r['claims']:.0f} (mean {ms(r['claim_mean'])}); "
         f"settles {r['settles']:.0f} (mean {ms(r['settle_mean'])}); peak RSS {rss}; duplicates {r['dups']}")
    if r["failed"]:
        s += f"; failed attempts {r['failed']:.0f}"
    if r["expired"]:
        s += f"; {r['expired']:.0f} buffered rows expired unpublished"
    if r["overtaken"]:
        s += f"; {r['overtaken']:.0f} overtaken"
    if r["lost"]:
        s += f"; {r['lost']:.0f} in-flight messages given back after a lost connection"
    if r["blocked"]:
        s += "; broker BLOCKED the connection (memory/disk alarm)"
    if r["partial"]:
        s += f"\n      PARTIAL: stopped after {r['e2e']:.0f} s with {r['sent']} of the rows sent"
    if r["unclocked"]:
        s += f"\n      queue stopwatch: {r['unclocked']}"
    return s


def bound(runs, keys=None, window=WINDOW, ratio=None):
    """One line: what bounds the relay's figure, from the medians of its runs' figures."""
    if not runs:
        return "-"
    b = med(r["cpu"]["broker"] for r in runs)
    p = med(r["cpu"]["pg"] for r in runs)
    ps = med(r["cpu"]["sessions"] for r in runs)
    rl = med(r["cpu"]["relay"] for r in runs)
    o = med(r["cpu"]["other"] + r["cpu"]["tools"] for r in runs)
    mach = med(r["cpu"]["machine"] for r in runs)
    fill_ = med(r["fill"] for r in runs)
    unm = med(r["unmarked_frac"] for r in runs)
    stl = med(r["settle_mean"] for r in runs)
    inf = med(r["in_flight"] for r in runs)
    buf = med(r["buffered"] for r in runs)
    lat = med(r["lat_med"] for r in runs)
    head = (f"broker CPU {b:.2f}, PostgreSQL {p:.2f} (relay's sessions {ps:.2f}), relay {rl:.2f}, "
            f"rest {o:.2f} = {mach:.2f} of {NCPU} cores; window "
            f"{'-' if fill_ is None else f'{fill_:.0%}'} full, confirm median {ms(lat)}")
    top = max((("the broker", b), ("PostgreSQL", p), ("the relay", rl), ("other load", o)),
              key=lambda x: x[1])[0]
    if top == "PostgreSQL" and ps is not None and ps < 0.5 * p:
        top = f"PostgreSQL, of which the relay's sessions only {ps:.2f}"
    saturated = mach >= 0.9 * NCPU
    if ratio is not None and ratio >= 0.95:
        why = f"the broker: the relay runs at its ceiling (ratio {ratio:.2f})"
        if saturated:
            why += f", on a saturated machine (mostly {top})"
    elif rl >= 0.85:
        why = "the relay's own CPU (one event loop, near a full core)"
    elif fill_ is not None and fill_ >= 0.85:
        why = "the window: full, so rate = window / confirm latency"
        why += (f", and a saturated machine (mostly {top}) stretches that latency" if saturated
                else ", the broker's confirm latency")
    elif fill_ is not None and unm is not None and fill_ + unm >= 1.8:
        why = (f"the marks: {fill_:.0%} of the window in flight + {unm:.0%} confirmed and "
               f"awaiting their mark (settle round trip {ms(stl)}) = {fill_ + unm:.0%}, near "
               "the 200% that bounds what a fault republishes; rate = in flight / confirm "
               "latency")
    elif fill_ is not None:
        if keys and inf is not None and keys < window and inf <= keys * 1.05:
            why = (f"the relay: about one message in flight per key ({inf:.0f} in flight for "
                   f"{keys} key{'s' if keys != 1 else ''}), so rate = keys / confirm latency")
        elif buf is not None and buf < 0.1 * window:
            why = (f"the relay's claims: the window is only {fill_:.0%} full and the claim "
                   f"buffer nearly empty ({buf:.0f} rows): claiming does not keep up")
        elif buf is not None:
            why = (f"the relay: the window is only {fill_:.0%} full although {buf:.0f} claimed "
                   "rows wait (held back by per-key or publish gating)")
        else:
            why = (f"the relay: it keeps the window only {fill_:.0%} full (claim or settle "
                   "gaps, per-key limits)")
        if saturated:
            why += f"; the machine is saturated too (mostly {top})"
    elif saturated:
        why = f"CPU: the machine is saturated (mostly {top})"
    else:
        why = "unknown (no metrics)"
    return f"{head} -> bound by {why}"


def disturbed(runs):
    """Runs whose figure something outside the relay's normal path may have bent."""
    n = sum(1 for r in runs if r.get("partial") or r.get("unclocked") or r.get("lost") or
            r.get("blocked"))
    return f" ({n} run{'s' if n != 1 else ''} disturbed: see above)" if n else ""


def verdict(ratio, tgt):
    if ratio is None or tgt is None:
        return "-"
    return "PASS" if ratio >= tgt else "BELOW"


def version_line():
    try:
        v = subprocess.run([str(BUILD / "outbox-relay"), "--version"], capture_output=True,
                           text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        v = "outbox-relay ?"
    try:
        e = dict(os.environ, GIT_OPTIONAL_LOCKS="0")
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, env=e).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               env=e).stdout.strip()
        v += f", commit {head}{' + local changes' if dirty else ''}"
    except OSError:
        pass
    return v


# ------------------------------------------------------------------ many outboxes
def many_run(svc, broker, tmp):
    """One relay, MANY outboxes over MANY_DBS databases (default settings): drain, idle, RSS."""
    dbs = [f"{DB}_many{i}" for i in range(MANY_DBS)]
    tables = [(dbs[i % MANY_DBS], f"outbox.m{i // MANY_DBS}") for i in range(MANY)]
    port = free_port()
    lines = ["[relay]", f"http_listen = 127.0.0.1:{port}", "[sink.main]", f"url = {svc.amqp_url}"]
    for i, (db, table) in enumerate(tables):
        lines += [f"[outbox.o{i}]", f"conninfo = host=127.0.0.1 port={svc.pg_port} dbname={db} "
                  "user=postgres", f"database = {db}", f"table = {table}"]
    cfg = tmp / "many.ini"
    cfg.write_text("\n".join(lines) + "\n")
    with svc.pg("postgres") as c:
        for db in dbs:
            c.execute(f"drop database if exists {db} with (force)")
            c.execute(f"create database {db}")
    try:
        subprocess.run([str(BUILD / "outbox-relay"), "init", "-c", str(cfg)], check=True,
                       stdout=subprocess.DEVNULL)
        conns = {db: svc.pg(db) for db in dbs}
        for db, table in tables:
            conns[db].execute(f"""insert into {table} (routing_key, partition_key, payload)
                select %s, 'k' || (g %% 20), convert_to(rpad(g::text || '|', {SIZE}, 'x'), 'UTF8')
                from generate_series(1, {MANY_ROWS}) g""", (QUEUE,))
        for c in conns.values():
            c.execute("checkpoint")
        broker.reset()
        log = open(tmp / "many.log", "w")
        t0 = time.monotonic()
        p = spawn([str(BUILD / "outbox-relay"), "run", "-c", str(cfg)], stdout=log,
                  stderr=subprocess.STDOUT)
        deadline = t0 + TIMEOUT
        pending = None
        while time.monotonic() < deadline:
            pending = sum(conns[db].execute(f"select count(*) from {table} where sent_at is null")
                          .fetchone()[0] for db, table in tables)
            if pending == 0 or p.poll() is not None:
                break
            time.sleep(0.2)
        drained = time.monotonic() - t0
        if pending != 0:
            raise BenchError(f"many outboxes: {pending} rows still pending after {drained:.0f} s"
                             f" (relay log: {tmp / 'many.log'})")
        time.sleep(5)          # the claims that found nothing back off to poll_interval
        a_relay, a = task_cpu_s(p.pid), Snapshot(svc)
        time.sleep(MANY_IDLE_S)
        b_relay, b = task_cpu_s(p.pid), Snapshot(svc)
        secs = b.t - a.t
        rss = vm_hwm_kib(p.pid)
        rc = stop(p)
        log.close()
        broker.reset()
        for c in conns.values():
            c.close()
        return {"outboxes": MANY, "dbs": MANY_DBS, "rows": MANY * MANY_ROWS, "drained": drained,
                "idle_cpu": (b_relay - a_relay) / secs, "idle_pg": (b.pg - a.pg) / secs,
                "idle_other": max((b.machine - a.machine) - (b.broker - a.broker) - (b.pg - a.pg)
                                  - (b_relay - a_relay), 0.0) / secs,
                "rss": rss, "rc": rc}
    finally:
        with svc.pg("postgres") as c:
            for db in dbs:
                c.execute(f"drop database if exists {db} with (force)")


# ------------------------------------------------------------------ main
def main():
    for f in ("outbox-relay", "tests/amqp_probe", "tests/queue_watch"):
        if not (BUILD / f).exists():
            sys.exit(f"{BUILD / f} missing: run make bench (it builds the bench tools)")
    if ON_SENT not in ("mark", "delete"):
        sys.exit("BENCH_ON_SENT must be mark or delete")
    svc = Services()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    started = time.monotonic()
    with svc.pg("postgres") as c:
        c.execute(f"drop database if exists {DB} with (force)")
        c.execute(f"create database {DB}")
        c.execute("alter system set fsync = on")
        c.execute("alter system set full_page_writes = on")
        c.execute("select pg_reload_conf()")
    conn = broker = None
    ok = False
    results = {k: {"probe": [], "relay": []} for k in KEYS}
    backlog = many = None
    big = {"probe": [], "relay": [], "pgread": []}
    competing = {"one": [], "two": []}
    try:
        init_cfg = write_cfg(tmp / "init.ini", svc, free_port(), name="bench-init")
        subprocess.run([str(BUILD / "outbox-relay"), "init", "-c", str(init_cfg)], check=True,
                       stdout=subprocess.DEVNULL)
        conn = svc.pg(DB)
        broker = Broker(svc)
        print(f"bench: {version_line()}")
        print(f"bench: {N} rows x {SIZE} B per run, window {WINDOW}, batch {BATCH}, "
              f"on_sent = {ON_SENT}{', ordering = ' + ORDERING if ORDERING else ''}, "
              f"keys {','.join(map(str, KEYS)) or 'none'}, {ROUNDS} rounds; "
              f"backlog {BACKLOG} rows; "
              f"big messages {BIG_ROWS} x {BIG_SIZE} B; "
              f"competing {'off' if COMPETING_KEYS < 0 else f'{COMPETING_KEYS} keys'}; "
              f"queue polled every {POLL_MS} ms; {NCPU} cores; PostgreSQL fsync on")
        a = Snapshot(svc)
        time.sleep(1)
        b = Snapshot(svc)
        secs = b.t - a.t
        print(f"bench: before start, the machine was busy {(b.machine - a.machine) / secs:.2f} "
              f"of {NCPU} cores (broker {(b.broker - a.broker) / secs:.2f}, PostgreSQL "
              f"{(b.pg - a.pg) / secs:.2f})")
        print("bench: rates are queue-timed (first to last message enqueued, same stopwatch for "
              "probe and relay); e2e = relay start to last row marked sent")
        sys.stdout.flush()

        # ---- key skew: per round, per scenario: fill, probe, relay
        for rnd in range(ROUNDS):
            for keys in KEYS:
                port = free_port()
                cfg = write_cfg(tmp / f"k{keys}.ini", svc, port, name="bench")
                fill(conn, N, keys)
                pr = probe_run(svc, broker, conn, N)
                results[keys]["probe"].append(pr)
                rr = relay_run(svc, broker, conn, N, [(cfg, port)], TIMEOUT, [WINDOW])
                results[keys]["relay"].append(rr)
                ratio = rr["rate"] / pr["rate"] if rr["rate"] and pr["rate"] else None
                print(f"  round {rnd + 1}, {keys or 'no'} key{'s' if keys != 1 else ''}: "
                      f"ceiling {f0(pr['rate'])} msg/s (probe's own {pr['own']:.0f}, "
                      f"confirm latency mean {ms(pr['lat_mean'])}; "
                      f"{cores_line(pr['cpu'], 'probe')}"
                      f"{'; broker BLOCKED it %.1f s' % pr['blocked_s'] if pr['blocked'] else ''}"
                      f") | relay {f0(rr['rate'])} msg/s"
                      f"{' PARTIAL' if rr['partial'] else ''} | ratio "
                      f"{'-' if ratio is None else f'{ratio:.2f}'}")
                print(relay_detail(rr))
                sys.stdout.flush()

        # ---- competing: one relay vs two, alternating
        if COMPETING_KEYS >= 0:
            for rnd in range(ROUNDS):
                for label, count in (("one", 1), ("two", 2)):
                    fill(conn, N, COMPETING_KEYS)
                    cfgs = []
                    for i in range(count):
                        port = free_port()
                        cfgs.append((write_cfg(tmp / f"comp{i}.ini", svc, port,
                                               name=f"bench-{'ab'[i]}", mode="competing"), port))
                    r = relay_run(svc, broker, conn, N, cfgs, TIMEOUT, [WINDOW] * count)
                    competing[label].append(r)
                    print(f"  round {rnd + 1}, competing, {label} relay{'s' if count > 1 else ''}"
                          f" ({COMPETING_KEYS} keys): {f0(r['rate'])} msg/s"
                          f"{' PARTIAL' if r['partial'] else ''}")
                    print(relay_detail(r))
                    sys.stdout.flush()

        # ---- backlog with default settings
        if BACKLOG > 0:
            secs = fill(conn, BACKLOG, BACKLOG_KEYS)
            print(f"  backlog: {BACKLOG} rows ({BACKLOG_KEYS} keys) written in {secs:.1f} s "
                  "(generate_series, vacuum analyze, checkpoint)")
            port = free_port()
            cfg = write_cfg(tmp / "backlog.ini", svc, port, defaults=True)
            backlog = relay_run(svc, broker, conn, BACKLOG, [(cfg, port)],
                                BACKLOG_TIMEOUT, [1000])
            print(f"  backlog, default settings: {f0(backlog['rate'])} msg/s queue-timed")
            print(relay_detail(backlog))
            broker.reset()
            conn.execute("truncate outbox.messages, outbox.messages_dead")
            sys.stdout.flush()

        # ---- big messages: probe and relay with default settings, same size
        if BIG_ROWS > 0:
            for rnd in range(BIG_ROUNDS):
                secs = fill(conn, BIG_ROWS, 100, BIG_SIZE)
                print(f"  big messages, round {rnd + 1}: {BIG_ROWS} rows of {BIG_SIZE >> 10} KiB "
                      f"({BIG_ROWS * BIG_SIZE / 2**20:.0f} MiB, 100 keys) written in {secs:.1f} s")
                pr = probe_run(svc, broker, conn, BIG_ROWS, BIG_SIZE)
                big["probe"].append(pr)
                port = free_port()
                cfg = write_cfg(tmp / "big.ini", svc, port, defaults=True)
                rr = relay_run(svc, broker, conn, BIG_ROWS, [(cfg, port)], BACKLOG_TIMEOUT,
                               [1000])
                big["relay"].append(rr)
                # PostgreSQL's own read of the same rows, in batches of the relay's claims
                per_claim = BIG_ROWS / rr["claims"] if rr["claims"] else 32
                gr = pgread_run(svc, conn, max(per_claim, 1) * BIG_SIZE)
                big["pgread"].append(gr)
                ratio = rr["rate"] / pr["rate"] if rr["rate"] and pr["rate"] else None
                print(f"  big messages, round {rnd + 1}: ceiling {f0(pr['rate'])} msg/s "
                      f"({f0(pr['rate'] * BIG_SIZE / 2**20)} MiB/s; {cores_line(pr['cpu'], 'probe')})"
                      f" | relay {f0(rr['rate'])} msg/s ({f0((rr['rate'] or 0) * BIG_SIZE / 2**20)}"
                      f" MiB/s){' PARTIAL' if rr['partial'] else ''} | ratio "
                      f"{'-' if ratio is None else f'{ratio:.2f}'} | relay peak RSS "
                      f"{(rr['rss'] or 0) / 1024:.1f} MiB")
                print(relay_detail(rr))
                print(f"      PostgreSQL read ceiling {f0(gr['rate'])} msg/s (the same rows read "
                      f"on one session, {gr['batches']} batches of {BIG_ROWS / gr['batches']:.0f}"
                      f" rows, payloads in binary; {cores_line(gr['cpu'], 'probe')}); relay / "
                      f"PostgreSQL read {rr['rate'] / gr['rate']:.2f}" if rr["rate"] and gr["rate"]
                      else "      PostgreSQL read ceiling: -")
                broker.reset()
                conn.execute("truncate outbox.messages, outbox.messages_dead")
                sys.stdout.flush()

        # ---- many outboxes in one process
        if MANY > 0:
            many = many_run(svc, broker, tmp)
            print(f"  many outboxes: {many['outboxes']} over {many['dbs']} databases, "
                  f"{many['rows']} rows drained in {many['drained']:.1f} s; idle: relay "
                  f"{many['idle_cpu'] * 100:.3f}% of a core, PostgreSQL "
                  f"{many['idle_pg'] * 100:.2f}%; peak RSS {(many['rss'] or 0) / 1024:.1f} MiB")
            sys.stdout.flush()
        ok = True
    finally:
        for p in CHILDREN:
            stop(p, grace=10)
        if broker is not None:
            try:
                broker.delete()
            except Exception:
                pass
            broker.close()
        if conn is not None:
            conn.close()
        with svc.pg("postgres") as c:
            c.execute(f"drop database if exists {DB} with (force)")
            c.execute("alter system reset fsync")
            c.execute("alter system reset full_page_writes")
            c.execute("select pg_reload_conf()")
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"bench: configs and relay logs kept in {tmp}", file=sys.stderr)

    # ---- summary
    print()
    print(f"summary: medians over {ROUNDS} round{'s' if ROUNDS != 1 else ''} [min-max]; "
          f"{N} rows per run, window {WINDOW}; {NCPU} cores shared by broker, PostgreSQL and relay;"
          f" took {time.monotonic() - started:.0f} s")
    hdr = (f"  {'keys':>5}  {'relay msg/s':>20}  {'ceiling msg/s':>20}  {'ratio':>5}  "
           f"{'target':>6}  {'verdict':>7}  {'relay e2e msg/s':>20}  {'dups':>4}")
    if KEYS:
        print(hdr)
    for keys in KEYS:
        rl, pr = results[keys]["relay"], results[keys]["probe"]
        mr, mp = med(r["rate"] for r in rl), med(p["rate"] for p in pr)
        ratio = mr / mp if mr and mp else None
        tgt = target_for(keys)
        part = disturbed(rl + pr)
        print(f"  {keys or 'none':>5}  {f0(mr) + ' ' + rng([r['rate'] for r in rl]):>20}  "
              f"{f0(mp) + ' ' + rng([p['rate'] for p in pr]):>20}  "
              f"{'-' if ratio is None else f'{ratio:.2f}':>5}  "
              f"{'-' if tgt is None else f'>={tgt:.2f}':>6}  {verdict(ratio, tgt):>7}  "
              f"{f0(med(r['e2e_rate'] for r in rl)) + ' ' + rng([r['e2e_rate'] for r in rl]):>20}"
              f"  {sum(r['dups'] for r in rl):>4}{part}")
    if KEYS:
        print("  what bounds it:")
    for keys in KEYS:
        pcpu = med(p["cpu"]["broker"] for p in results[keys]["probe"])
        mr = med(r["rate"] for r in results[keys]["relay"])
        mp = med(p["rate"] for p in results[keys]["probe"])
        ratio = mr / mp if mr and mp else None
        plat = med(p["lat_mean"] for p in results[keys]["probe"])
        rlat = med(r["lat_mean"] for r in results[keys]["relay"])
        print(f"    {keys or 'no'} key{'s' if keys != 1 else ''}: "
              f"{bound(results[keys]['relay'], keys, ratio=ratio)}; ceiling run: broker CPU "
              f"{'-' if pcpu is None else f'{pcpu:.2f}'} of {NCPU} cores, confirm latency "
              f"mean {ms(plat)} against the relay's {ms(rlat)}")
    if COMPETING_KEYS >= 0:
        one = med(r["rate"] for r in competing["one"])
        two = med(r["rate"] for r in competing["two"])
        ratio = two / one if one and two else None
        print(f"  competing ({COMPETING_KEYS} keys, mode = competing): one relay "
              f"{(f0(one) + ' ' + rng([r['rate'] for r in competing['one']])).strip()} msg/s, "
              f"two relays {(f0(two) + ' ' + rng([r['rate'] for r in competing['two']])).strip()}"
              f" msg/s, ratio two/one "
              f"{'-' if ratio is None else f'{ratio:.2f}'} (target >= 1.00: "
              f"{verdict(ratio, 1.0)}); e2e one {f0(med(r['e2e_rate'] for r in competing['one']))}"
              f", two {f0(med(r['e2e_rate'] for r in competing['two']))} msg/s; duplicates "
              f"{sum(r['dups'] for r in competing['one'] + competing['two'])}"
              f"{disturbed(competing['one'] + competing['two'])}")
        print(f"    one: {bound(competing['one'], COMPETING_KEYS)}")
        print(f"    two: {bound(competing['two'], COMPETING_KEYS, 2 * WINDOW)}")
    if many is not None:
        cpu_ok = many["idle_cpu"] <= MANY_CPU_TARGET
        rss_ok = many["rss"] is not None and many["rss"] <= MANY_RSS_TARGET_KIB
        print(f"  many outboxes ({many['outboxes']} over {many['dbs']} databases, default settings)"
              f": {many['rows']} rows drained in {many['drained']:.1f} s; idle CPU of the relay "
              f"{many['idle_cpu'] * 100:.3f}% of a core (target <= {MANY_CPU_TARGET * 100:.1f}%: "
              f"{'PASS' if cpu_ok else 'ABOVE'}), PostgreSQL meanwhile "
              f"{many['idle_pg'] * 100:.2f}% (the idle polls and LISTEN sessions); peak RSS "
              f"{(many['rss'] or 0) / 1024:.1f} MiB (target <= {MANY_RSS_TARGET_KIB // 1024} MiB: "
              f"{'PASS' if rss_ok else 'ABOVE'}); {2 * many['outboxes']} database connections "
              f"(two per outbox){'; other load %.2f cores: noisy' % many['idle_other'] if many['idle_other'] > 0.2 else ''}")
    if backlog is not None:
        rss = backlog["rss"]
        print(f"  backlog {BACKLOG} rows ({BACKLOG_KEYS} keys), default settings: drained in "
              f"{backlog['e2e']:.1f} s = {f0(backlog['e2e_rate'])} rows/s end to end "
              f"({f0(backlog['rate'])} msg/s queue-timed)"
              f"{' PARTIAL' if backlog['partial'] else ''}; relay peak RSS "
              f"{rss / 1024 if rss else 0:.1f} MiB (target <= {RSS_TARGET_KIB // 1024} MiB: "
              f"{'PASS' if rss and rss <= RSS_TARGET_KIB else 'ABOVE'}); duplicates "
              f"{backlog['dups']}{disturbed([backlog])}")
        print(f"    {bound([backlog], BACKLOG_KEYS, 1000)}")
    if big["relay"]:
        rl, pr = big["relay"], big["probe"]
        mr, mp = med(r["rate"] for r in rl), med(p["rate"] for p in pr)
        ratio = mr / mp if mr and mp else None
        rss = max((r["rss"] for r in rl if r["rss"]), default=None)
        mib = BIG_SIZE / 2**20
        print(f"  big messages ({BIG_ROWS} x {BIG_SIZE >> 10} KiB, default settings, "
              f"{len(rl)} round{'s' if len(rl) != 1 else ''}): relay "
              f"{(f0(mr) + ' ' + rng([r['rate'] for r in rl])).strip()} msg/s "
              f"({f0((mr or 0) * mib)} MiB/s), ceiling "
              f"{(f0(mp) + ' ' + rng([p['rate'] for p in pr])).strip()} msg/s "
              f"({f0((mp or 0) * mib)} MiB/s), ratio {'-' if ratio is None else f'{ratio:.2f}'} "
              f"(target >= {BIG_RATIO_TARGET}: {verdict(ratio, BIG_RATIO_TARGET)}); relay peak RSS "
              f"{(rss or 0) / 1024:.1f} MiB (target <= {BIG_RSS_TARGET_KIB // 1024} MiB: "
              f"{'PASS' if rss and rss <= BIG_RSS_TARGET_KIB else 'ABOVE'}); duplicates "
              f"{sum(r['dups'] for r in rl)}{disturbed(rl + pr)}")
        print(f"    {big_bound(rl, mib)}")
        print(f"    {big_cpu_bound(rl, pr, big['pgread'])}")
    runs = [r for k in KEYS for r in results[k]["relay"] + results[k]["probe"]]
    runs += competing["one"] + competing["two"] + ([backlog] if backlog else [])
    runs += big["relay"] + big["probe"]
    noise = med(r["cpu"]["other"] for r in runs)
    pg_noise = med(r["cpu"].get("pg_other_tps", 0) for r in runs)
    if (noise is not None and noise > 0.2) or (pg_noise is not None and pg_noise >= 5):
        pg_part = (f" and PostgreSQL served {pg_noise:.0f} tx/s for other databases"
                   if pg_noise and pg_noise >= 5 else "")
        print(f"  NOTE: other processes used a median {noise or 0:.2f} cores during the runs"
              f"{pg_part}: these figures are noisy; rerun on a quiet machine")
    print("  (targets are verdicts to read, not failures: the exit status only reports errors)")


# ------------------------------------------------------------------ steady load (issue 21)
STEADY = os.environ.get("BENCH_STEADY", "full").strip()      # full | short | off
STEADY_RATE = env_int("BENCH_STEADY_RATE", 1000)
STEADY_KEYS = env_int("BENCH_STEADY_KEYS", 1000)
STEADY_BODY = env_int("BENCH_STEADY_BODY", 200)
STEADY_DUAL_RATE = env_int("BENCH_STEADY_DUAL_RATE", 50)
STEADY_RETENTION = os.environ.get("BENCH_STEADY_RETENTION", "30s")
STEADY_EXTRA = [kv for kv in os.environ.get("BENCH_STEADY_OUTBOX", "").split(";") if kv.strip()]
STEADY_QUEUE = "outbox-steady"
DUAL_QUEUE = "outbox-steady-dual"
# phases (seconds): warm-up, clean, held horizon, recovery; report window
STEADY_PHASES = {"full": (10, 300, 120, 60, 30), "short": (5, 60, 40, 20, 10)}


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class SteadyConsumer(threading.Thread):
    """Consumes the relay's and the dual writer's queues (one connection, auto-ack): the
    receive time of each relayed message by message-id (duplicates counted), and for the
    dual write's the commit->consume latency (its body starts with the Unix time its COMMIT
    returned)."""

    def __init__(self, svc):
        super().__init__(daemon=True)
        self.svc = svc
        self.ids, self.dual = {}, []        # message-id -> t_recv; [(t_recv, latency s)]
        self.dups = 0
        self.error = None
        self.ready = threading.Event()
        self.halt = threading.Event()

    @staticmethod
    def _lat(body, now):
        try:
            return now - float(body[:body.index(b":")])
        except ValueError:
            return None

    def run(self):
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", self.svc.amqp_port, heartbeat=0))
            ch = conn.channel()
            for q in (STEADY_QUEUE, DUAL_QUEUE):
                ch.queue_declare(q, durable=True)
                ch.queue_purge(q)
            ch.basic_qos(prefetch_count=2000)

            def on_relay(_ch, _m, props, _body):
                if props.message_id in self.ids:
                    self.dups += 1
                else:
                    self.ids[props.message_id] = time.time()

            def on_dual(_ch, _m, _props, body):
                now = time.time()
                lat = self._lat(body, now)
                if lat is not None:
                    self.dual.append((now, lat))

            ch.basic_consume(STEADY_QUEUE, on_relay, auto_ack=True)
            ch.basic_consume(DUAL_QUEUE, on_dual, auto_ack=True)
            self.ready.set()
            while not self.halt.is_set():
                conn.process_data_events(time_limit=0.2)
            conn.close()
        except Exception as e:  # noqa: BLE001 - reported by the bench
            self.error = e
            self.ready.set()


class DualWriter(threading.Thread):
    """The naive dual write, for comparison: INSERT into the application's own table,
    COMMIT, then publish (persistent, mandatory) and wait for the broker's confirm, at
    STEADY_DUAL_RATE a second; the body carries the time its COMMIT returned."""

    def __init__(self, svc):
        super().__init__(daemon=True)
        self.svc = svc
        self.halt = threading.Event()
        self.sent = 0
        self.error = None

    def run(self):
        try:
            db = psycopg.connect(host="127.0.0.1", port=self.svc.pg_port, user="postgres",
                                 dbname=DB, application_name="bench-dual-write")
            db.execute("create table if not exists bench_dual (id bigserial primary key, "
                       "body bytea not null)")
            db.commit()
            conn = pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", self.svc.amqp_port, heartbeat=0))
            ch = conn.channel()
            ch.confirm_delivery()
            props = pika.BasicProperties(delivery_mode=2)
            pad = b"x" * max(STEADY_BODY - 20, 0)
            t0 = time.monotonic()
            while not self.halt.is_set():
                due = t0 + self.sent / STEADY_DUAL_RATE
                d = due - time.monotonic()
                if d > 0:
                    time.sleep(d)
                db.execute("insert into bench_dual (body) values (%s)", (pad,))
                db.commit()
                body = f"{time.time():.6f}:".encode() + pad
                ch.basic_publish("", DUAL_QUEUE, body, props, mandatory=True)
                self.sent += 1
            conn.close()
            db.close()
        except Exception as e:  # noqa: BLE001
            self.error = e


def steady_producer(argv):
    """bench.py --steady-producer CONNINFO RATE SECONDS KEYS BODY OUT: the producer process
    of the steady run. 8 connections (threads) write one row per transaction, paced to RATE
    a second in total (a slot late is written at once: the lag shows as a lower rate), and
    take the time each COMMIT returned; at the end OUT gets "message-id unix-time" lines."""
    conninfo, rate, secs, keys, body, out = argv
    rate, secs, keys, body = float(rate), float(secs), int(keys), int(body)
    lock, slot, done = threading.Lock(), [0], []
    pad = "x" * max(body - 2, 0)
    t0 = time.monotonic()

    def worker():
        import random
        import uuid
        db = psycopg.connect(conninfo + " application_name=bench-producer")
        mine = []
        while True:
            with lock:
                k = slot[0]
                slot[0] += 1
            due = t0 + k / rate
            if due > t0 + secs or time.monotonic() > t0 + secs:
                break
            d = due - time.monotonic()
            if d > 0:
                time.sleep(d)
            mid = str(uuid.uuid4())
            db.execute("insert into outbox.messages (message_id, routing_key, partition_key, "
                       "payload) values (%s, %s, %s, convert_to(%s, 'UTF8'))",
                       (mid, STEADY_QUEUE, f"k{random.randrange(keys)}", pad))
            db.commit()
            mine.append((mid, time.time()))
        db.close()
        with lock:
            done.extend(mine)

    ts = [threading.Thread(target=worker) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    with open(out, "w") as f:
        for mid, t in done:
            f.write(f"{mid} {t:.6f}\n")
    print(f"committed {len(done)}")


def relay_backend_ticks(conn, seen):
    """CPU ticks (user+sys) of the relay's backends (application_name outbox-relay in the
    bench database), accumulated per pid in `seen` (a backend that ended keeps its last)."""
    pids = [r[0] for r in conn.execute(
        "select pid from pg_stat_activity where datname = %s and application_name = "
        "'outbox-relay'", (DB,))]
    for p in pids:
        t = pid_ticks(p)
        if t:
            seen[p] = t
    return sum(seen.values())


# what a statement of the relay's sessions is, from its text (pg_stat_statements)
STMT_KINDS = (
    ("claim", re.compile(r"SET lease_owner = \$2::text, lease_token = \$3")),
    ("mark", re.compile(r"SET sent_at = now\(\)|DELETE FROM \S+ m USING unnest")),
    ("settle (general)", re.compile(r"unnest\(\$1::bigint\[\], \$2::bigint\[\], \$3")),
    ("retention", re.compile(r"sent_at IS NOT NULL AND sent_at <")),
    ("lead", re.compile(r"name = 'leader'\), up AS")),
    ("stats", re.compile(r"min\(created_at\) AS oldest")),
    ("health", re.compile(r"pg_stat_user_tables s")),
    ("floor", re.compile(r"pg_sequence_last_value")),
    ("listen", re.compile(r"^\s*(UN)?LISTEN", re.I)),
    ("setup", re.compile(r"statement_timeout|plan_cache_mode|to_regclass|pg_backend_pid",
                         re.I)),
)


def stmt_kind(q):
    for name, rx in STMT_KINDS:
        if rx.search(q):
            return name
    return None


def steady_statements(conn):
    """pg_stat_statements of the bench database since its last reset, the relay's
    statements grouped by kind: calls, rows, execution and planning ms (wall time inside
    the server: a statement's share of the sessions' CPU, lock waits included), and the
    longest execution in ms (a stall shows there, not in the means)."""
    try:
        rows = conn.execute(
            "select s.query, s.calls, s.rows, s.total_exec_time, s.total_plan_time, "
            "s.max_exec_time "
            "from pg_stat_statements s join pg_database d on d.oid = s.dbid "
            "where d.datname = %s", (DB,)).fetchall()
    except psycopg.Error:
        return None
    out = {}
    for q, calls, nrows, ex, pl, mx in rows:
        k = stmt_kind(q)
        if k is None:
            continue
        o = out.setdefault(k, [0, 0, 0.0, 0.0, 0.0])
        o[0] += calls
        o[1] += nrows
        o[2] += ex
        o[3] += pl or 0.0
        o[4] = max(o[4], mx or 0.0)
    return out


def steady_sample(conn, port, seen, relay_pid):
    row = conn.execute(
        "select n_dead_tup, n_live_tup, pg_total_relation_size(relid), n_tup_ins, n_tup_del, "
        "(select count(*) from pg_stat_activity where backend_xmin is not null "
        " and application_name = 'bench-report'), vacuum_count + autovacuum_count "
        "from pg_stat_user_tables where relid = 'outbox.messages'::regclass").fetchone()
    m = scrape(port) or {}
    return {
        "t": time.time(), "dead": row[0], "live": row[1], "size": row[2], "ins": row[3],
        "del": row[4], "vacuums": row[6],
        "pg_ticks": relay_backend_ticks(conn, seen), "relay_ticks": pid_ticks(relay_pid),
        "claims": msum(m, "outbox_relay_claims_total"),
        "claimed": msum(m, "outbox_relay_claimed_rows_total"),
        "settles": msum(m, "outbox_relay_settle_latency_seconds_count"),
        "backlog": msum(m, "outbox_relay_backlog"),
    }


def steady_stmt_reset(conn):
    """Resets pg_stat_statements (the clean phase's statements are read at its end);
    returns the time, or False when the extension is not there."""
    try:
        conn.execute("select pg_stat_statements_reset()")
        return time.time()
    except psycopg.Error:
        return False


def steady_run(svc, tmp):
    """A fixed offered rate from pgbench (a separate process: one single-row transaction per
    message, each NOTIFYing), the relay with default settings but retention, the dual write
    beside it, then a REPEATABLE READ reader holding the xmin horizon, then recovery."""
    warm, clean, held, recover, win = STEADY_PHASES[STEADY]
    total = warm + clean + held + recover
    conn = svc.pg(DB)
    conn.execute("truncate outbox.messages, outbox.messages_dead")
    conn.execute("vacuum analyze outbox.messages")
    commits = tmp / "steady-commits.txt"
    port = free_port()
    cfg = tmp / "steady.ini"
    cfg.write_text("\n".join([
        "[relay]", f"http_listen = 127.0.0.1:{port}", "name = bench-steady",
        "[sink.main]", f"url = {svc.amqp_url}",
        "[outbox.bench]", f"conninfo = {svc.conninfo()}", f"database = {DB}",
        f"retention = {STEADY_RETENTION}", *STEADY_EXTRA]) + "\n")
    cons = SteadyConsumer(svc)
    cons.start()
    cons.ready.wait(20)
    if cons.error:
        raise BenchError(f"steady consumer: {cons.error}")
    log = open(tmp / "steady-relay.log", "w")
    relay = spawn([str(BUILD / "outbox-relay"), "run", "-c", str(cfg)], stdout=log,
                  stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while scrape(port) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    settle(svc)
    bench = spawn([sys.executable, str(pathlib.Path(__file__).resolve()), "--steady-producer",
                   svc.conninfo(), str(STEADY_RATE), str(total), str(STEADY_KEYS),
                   str(STEADY_BODY), str(commits)], stdout=subprocess.PIPE,
                  stderr=subprocess.STDOUT, text=True)
    dual = DualWriter(svc)
    dual.start()
    t_start = time.time()
    bounds = {"warm": t_start, "clean": t_start + warm, "held": t_start + warm + clean,
              "recover": t_start + warm + clean + held, "end": t_start + total}
    seen, samples, reader = {}, [], None
    stmts_reset, stmts, held_reset, held_stmts = None, None, None, None
    a = Snapshot(svc, [relay.pid])
    try:
        while time.time() < bounds["end"]:
            now = time.time()
            if reader is None and bounds["held"] <= now < bounds["recover"]:
                reader = psycopg.connect(host="127.0.0.1", port=svc.pg_port, user="postgres",
                                         dbname=DB, application_name="bench-report")
                reader.execute("begin isolation level repeatable read")
                reader.execute("select count(*) from outbox.messages")
            if reader is not None and now >= bounds["recover"]:
                reader.rollback()
                reader.close()
                reader = None
            if stmts_reset is None and now >= bounds["clean"]:
                stmts_reset = steady_stmt_reset(conn)
            if stmts is None and stmts_reset and now >= bounds["held"]:
                stmts = (steady_statements(conn), now - stmts_reset)
                held_reset = steady_stmt_reset(conn)
            if held_stmts is None and held_reset and now >= bounds["recover"]:
                held_stmts = (steady_statements(conn), now - held_reset)
            samples.append(steady_sample(conn, port, seen, relay.pid))
            nxt = samples[-1]["t"] + min(5, win)
            time.sleep(max(0.0, min(nxt, bounds["end"]) - time.time()))
            if relay.poll() is not None:
                raise BenchError(f"the relay exited ({relay.returncode}); log in {tmp}")
        samples.append(steady_sample(conn, port, seen, relay.pid))
        out, _ = bench.communicate(timeout=60)
        b = Snapshot(svc, [relay.pid])
        dual.halt.set()
        dual.join(30)
        m = re.search(r"committed (\d+)", out or "")
        processed = int(m.group(1)) if m else None
        if processed is None:
            raise BenchError(f"the producer failed: {(out or '').strip()[-2000:]}")
        deadline = time.monotonic() + 60
        while processed and len(cons.ids) < processed and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if reader is not None:
            reader.close()
        stop(bench, grace=5)
        dual.halt.set()
        stop(relay, grace=30)
        log.close()
        cons.halt.set()
        cons.join(10)
        conn.close()
    relayed = []
    lost = 0
    with open(commits) as f:
        for line in f:
            mid, t = line.split()
            got = cons.ids.get(mid)
            if got is None:
                lost += 1
            else:
                relayed.append((got, got - float(t)))
    u = usage(a, b, relay_secs=b.relays - a.relays)
    u["sessions"] = (samples[-1]["pg_ticks"] - samples[0]["pg_ticks"]) / TICK / u["secs"]
    return {"samples": samples, "relay": relayed, "dual": cons.dual, "dups": cons.dups,
            "stmts": stmts, "held_stmts": held_stmts,
            "processed": processed, "lost": lost, "bounds": bounds, "win": win,
            "cpu": u, "producer": out, "dual_error": dual.error}


def backend_pid(c):
    return c.execute("select pg_backend_pid()").fetchone()[0]


def backend_cpu(pid, n, rate, step):
    """The CPU seconds backend `pid` spends per step(i), for i in 0..n-1 called `rate` times
    a second (a wake-up each, as a claim per commit would be)."""
    c0, t0 = pid_ticks(pid), time.monotonic()
    for i in range(n):
        d = t0 + i / rate - time.monotonic()
        if d > 0:
            time.sleep(d)
        step(i)
    return (pid_ticks(pid) - c0) / TICK / n


def steady_floor(svc, n=5000, rate=1000.0):
    """What any claim costs PostgreSQL on this machine before its own work, measured on the
    bench database before the steady run: the CPU a backend spends on one round trip of a
    prepared empty statement, and on one notification delivered to an idle listener, each
    at `rate` a second."""
    with svc.pg(DB) as a, svc.pg(DB) as lis, svc.pg(DB) as b:
        rt = backend_cpu(backend_pid(a), n, rate, lambda i: a.execute("select 1", prepare=True))
        lis.execute("listen bench_floor")

        def notify(i):
            b.execute("notify bench_floor")
            if i % 50 == 0:
                lis.pgconn.consume_input()
                while lis.pgconn.notifies() is not None:
                    pass
        nt = backend_cpu(backend_pid(lis), n, rate, notify)
    return {"round_trip": rt, "notify": nt}


def steady_claim_cost(svc, n=3000, rate=1000.0):
    """What a claim costs PostgreSQL beyond a trivial statement, all prepared and sent alike
    (EXECUTE, the generic plan, the relay's session settings), at `rate` a second: one that
    takes nothing (the start and end of its plan), and one that takes a row of its own
    (rows written for it after the run), as its commit waits for the WAL flush and as it would
    without waiting. The leader-mode claim's text comes from pg_stat_statements after the
    run. None when it is not there."""
    with svc.pg(DB) as c:
        texts = [q for (q,) in c.execute("select query from pg_stat_statements "
                                         "where dbid = (select oid from pg_database "
                                         "where datname = current_database())")
                 if stmt_kind(q) == "claim" and "member:" not in q]
    if not texts:
        return None
    with svc.pg(DB) as c:
        for k, v in (("enable_sort", "off"), ("enable_seqscan", "off"), ("jit", "off"),
                     ("plan_cache_mode", "force_generic_plan")):
            c.execute(f"set {k} = '{v}'")
        c.execute("prepare nothing as select 1")
        c.execute("prepare claim as " + texts[0])
        # rows for the claims that take one, each claim's walk starting at the next
        first = c.execute(
            "with i as (insert into outbox.messages (routing_key, partition_key, payload) "
            "select 'bench-probe', 'probe-' || (g %% 1000), convert_to(repeat('x', 200), "
            "'UTF8') from generate_series(1, %s) g returning id) select min(id) from i",
            (2 * (n + 20),)).fetchone()[0]
        at = [first]

        def take(i):
            got = c.execute(f"execute claim(1, 'bench-probe', 1, 60000, 0, 0, false, 0, "
                            f"{int(at[0])}, NULL, NULL)").fetchall()
            if len(got) != 1:
                raise BenchError(f"the one-row claim took {len(got)} rows")
            at[0] = got[0][0] + 1
        cost = {}
        for name, step in (("trivial", lambda i: c.execute("execute nothing")),
                           ("claim", lambda i: c.execute(
                               "execute claim(0, 'bench-probe', 1, 1000, 0, 0, false, 0, "
                               "0, NULL, NULL)")),
                           ("one", take), ("one_nowait", take)):
            if name == "one_nowait":
                c.execute("set synchronous_commit = off")
            for i in range(20):
                step(i)
            cost[name] = backend_cpu(backend_pid(c), n, rate, step)
    return cost


def steady_report(r):
    S, B, win = r["samples"], r["bounds"], r["win"]
    tick_us = 1e6 / TICK

    def phase(t):
        for name in ("recover", "held", "clean", "warm"):
            if t >= B[name]:
                return name
        return "warm"

    def at(t):
        """the sample closest to t"""
        return min(S, key=lambda s: abs(s["t"] - t))

    def lat(xs, t1, t2):
        v = [l for (t, l) in xs if t1 <= t < t2]
        return v

    def block(t1, t2):
        s1, s2 = at(t1), at(t2)
        dt = max(s2["t"] - s1["t"], 1e-9)
        got = len(lat(r["relay"], t1, t2))
        rl, dl = lat(r["relay"], t1, t2), lat(r["dual"], t1, t2)
        claims = (s2["claims"] or 0) - (s1["claims"] or 0)
        claimed = (s2["claimed"] or 0) - (s1["claimed"] or 0)
        return {
            "offered": (s2["ins"] - s1["ins"]) / dt, "delivered": got / (t2 - t1),
            "p50": pct(rl, 0.5), "p99": pct(rl, 0.99), "d50": pct(dl, 0.5), "d99": pct(dl, 0.99),
            "pg_us": (s2["pg_ticks"] - s1["pg_ticks"]) * tick_us / got if got else None,
            "relay_us": (s2["relay_ticks"] - s1["relay_ticks"]) * tick_us / got if got else None,
            "per_claim": claimed / claims if claims else None, "claims_s": claims / dt,
            "settles_s": ((s2["settles"] or 0) - (s1["settles"] or 0)) / dt,
            "deleted_s": (s2["del"] - s1["del"]) / dt,
            "dead": s2["dead"], "live": s2["live"], "size": s2["size"],
            "backlog": max((s["backlog"] or 0) for s in S if t1 <= s["t"] <= t2 + 0.5)
            if any(t1 <= s["t"] <= t2 + 0.5 for s in S) else None,
        }

    def ms_(x):
        return "-" if x is None else f"{x * 1000:.1f}"

    def n0(x):
        return "-" if x is None else f"{x:.0f}"

    def n1(x):
        return "-" if x is None else f"{x:.1f}"

    print(f"  steady load ({STEADY}): a producer process offering {STEADY_RATE} single-row "
          f"transactions/s (8 connections) over "
          f"{STEADY_KEYS} keys, {STEADY_BODY}-byte bodies, relay defaults + retention = "
          f"{STEADY_RETENTION}{'; ' + '; '.join(STEADY_EXTRA) if STEADY_EXTRA else ''}; dual "
          f"write {STEADY_DUAL_RATE}/s beside it; REPEATABLE READ reader during 'held'")
    print(f"    {'t (s)':>7} {'phase':>7} {'offered':>8} {'deliv.':>7} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'dual p50':>8} {'dual p99':>8} {'PG us/msg':>9} {'relay us':>8} "
          f"{'rows/claim':>10} {'claims/s':>8} {'deleted/s':>9} {'dead tup':>9} {'live':>7} "
          f"{'MiB':>6} {'backlog':>7}")
    t = B["warm"]
    while t + win <= B["end"] + 0.5:
        x = block(t, t + win)
        print(f"    {t - B['warm']:>7.0f} {phase(t):>7} {x['offered']:>8.0f} "
              f"{x['delivered']:>7.0f} {ms_(x['p50']):>7} {ms_(x['p99']):>7} "
              f"{ms_(x['d50']):>8} {ms_(x['d99']):>8} "
              f"{n0(x['pg_us']):>9} {n0(x['relay_us']):>8} {n1(x['per_claim']):>10} "
              f"{x['claims_s']:>8.0f} {x['deleted_s']:>9.0f} {x['dead']:>9} {x['live']:>7} "
              f"{x['size'] / 1048576:>6.1f} "
              f"{n0(x['backlog']):>7}")
        t += win
    first_min = min(60, (B["held"] - B["clean"]) / 3)
    c = block(B["clean"], B["held"])
    c1 = block(B["clean"], B["clean"] + first_min)
    c2 = block(B["held"] - first_min, B["held"])
    h = block(B["held"], B["recover"])
    rc = block(B["recover"], B["end"])
    # The table's flatness once the retention window has filled: at the start of the clean
    # phase the table is nearly empty and then fills with the retained sent rows for the
    # first `retention`, which says nothing about growth. The reference is the first
    # sample after the first vacuum of the table that followed the first retention delete
    # in the clean phase (then the table holds a retention window of rows and the space
    # of the deleted ones is reusable); without such a vacuum, the first sample one
    # cleanup interval (10 s) after retention began deleting.
    cs = [x for x in S if B["clean"] <= x["t"] <= B["held"] + 0.5]
    del0 = cs[0]["del"] if cs else 0
    t_del = next((x["t"] for x in cs if x["del"] > del0), None)
    ref, why = None, "retention deleted nothing in the clean phase"
    if t_del is not None:
        vac0 = next(x["vacuums"] for x in cs if x["t"] >= t_del)
        ref = next((x for x in cs if x["t"] > t_del and x["vacuums"] > vac0), None)
        why = "after the first retention delete and the vacuum that followed"
        if ref is None:
            ref = next((x for x in cs if x["t"] >= t_del + 10), None)
            why = ("10 s after the first retention delete (no vacuum followed it in the "
                   "clean phase)")
    size0 = ref["size"] if ref is not None else None
    t_ref = ref["t"] - B["warm"] if ref is not None else None

    def ratio(a, b):
        return None if a is None or not b else a / b

    def v(x, tgt, le=True):
        if x is None:
            return "-"
        return f"{x:.2f} ({'PASS' if (x <= tgt if le else x >= tgt) else 'BELOW'} target "\
               f"{'<=' if le else '>='} {tgt})"
    print(f"    clean phase: delivered {c['delivered']:.0f} of {c['offered']:.0f} msg/s offered;"
          f" p50 {ms_(c['p50'])} ms, p99 {ms_(c['p99'])} ms; dual write p50 {ms_(c['d50'])} ms,"
          f" p99 {ms_(c['d99'])} ms; {c['per_claim'] or 0:.1f} rows per claim, "
          f"{c['claims_s']:.0f} claims/s, {c['settles_s']:.0f} settles/s; retention deleted "
          f"{c['deleted_s']:.0f} rows/s (on the settling connection, beside the claims)")
    print(f"      PostgreSQL CPU for the relay's sessions: "
          f"{n0(c['pg_us'])} us per message (target <= 100); relay process "
          f"{n0(c['relay_us'])} us per message")
    if r.get("stmts") and r["stmts"][0] is not None:
        st, secs = r["stmts"]
        got = c["delivered"] * secs
        print(f"      the relay's statements in the clean phase (pg_stat_statements, server "
              f"time incl. planning, per delivered message; {secs:.0f} s):")
        for k, (calls, nrows, ex, pl, mx) in sorted(st.items(),
                                                    key=lambda kv: -kv[1][2] - kv[1][3]):
            print(f"        {k:>16}: {calls / secs:8.1f}/s, {nrows / calls if calls else 0:7.1f} "
                  f"result rows each, exec {ex / calls if calls else 0:6.3f} ms + plan "
                  f"{pl / calls if calls else 0:6.3f} ms each (longest {mx:.1f} ms), "
                  f"{(ex + pl) * 1000 / got if got else 0:6.1f} us/msg")
        tot = sum(ex + pl for (_, _, ex, pl, _) in st.values())
        print(f"        {'all statements':>16}: {tot * 1000 / got if got else 0:6.1f} us/msg "
              f"(the rest of the sessions' CPU: protocol, commits, NOTIFY delivery)")
    print(f"      p99 last {first_min:.0f} s / first {first_min:.0f} s: "
          f"{ms_(c2['p99'])} / {ms_(c1['p99'])} ms = {v(ratio(c2['p99'], c1['p99']), 1.5)}")
    print(f"      relay / dual write: p50 {v(ratio(c['p50'], c['d50']), 2)}, "
          f"p99 {v(ratio(c['p99'], c['d99']), 2)}")
    fl = r.get("floor")
    if fl:
        rt, nt = fl["round_trip"] * 1e6, fl["notify"] * 1e6
        print(f"      floor on this machine (measured before the run, {1000:.0f}/s each): a "
              f"statement's round trip costs a PostgreSQL backend {rt:.0f} us of CPU, a "
              f"notification delivered {nt:.0f} us; a claim at every commit (claim_delay = 0, "
              f"what the latency target needs) costs at least {rt + nt:.0f} us a message before "
              f"its own work, and the cost target leaves {100 - rt - nt:.0f} us for the "
              f"claim's work, the mark and retention")
    ec = r.get("claim_cost")
    if ec:
        one = ec["one"] * 1e6
        print(f"      a claim (measured after the run, {1000:.0f}/s) costs a backend "
              f"{ec['claim'] * 1e6:.0f} us of CPU when it takes nothing (its plan started and "
              f"ended; a trivial statement sent alike {ec['trivial'] * 1e6:.0f} us), "
              f"{one:.0f} us when it takes a row ({ec['one_nowait'] * 1e6:.0f} us if its commit "
              f"did not wait for the WAL flush)")
        if fl:
            print(f"      so a claim at every commit costs at least {one + nt:.0f} us a message "
                  f"with its notification, before the mark (target <= 100)")
    start0 = at(B["clean"])["size"]
    if size0:
        print(f"      table + indexes {start0 / 1048576:.1f} MiB at the start of the clean phase "
              f"(empty: the retention window then fills), {size0 / 1048576:.1f} MiB at "
              f"t = {t_ref:.0f} s ({why}), {c['size'] / 1048576:.1f} MiB at its end "
              f"(flat, end / t = {t_ref:.0f} s: {v(c['size'] / size0, 1.25)});"
              f" dead tuples at its end {c['dead']}")
    else:
        print(f"      table + indexes {start0 / 1048576:.1f} MiB at the start of the clean phase, "
              f"{c['size'] / 1048576:.1f} MiB at its end (flat: - : {why});"
              f" dead tuples at its end {c['dead']}")
    print(f"    held horizon ({B['recover'] - B['held']:.0f} s): delivered {h['delivered']:.0f} of "
          f"{h['offered']:.0f} msg/s ({v(ratio(h['delivered'], h['offered']), 0.9, le=False)});"
          f" p50 {ms_(h['p50'])} ms, p99 {ms_(h['p99'])} ms; dual write p99 {ms_(h['d99'])} ms;"
          f" PostgreSQL {n0(h['pg_us'])} us/msg;"
          f" dead tuples {h['dead']}, {h['size'] / 1048576:.1f} MiB, backlog up to "
          f"{n0(h['backlog'])}")
    if r.get("held_stmts") and r["held_stmts"][0] is not None:
        st, secs = r["held_stmts"]
        print("      the relay's statements with the horizon held: " + "; ".join(
            f"{k} {calls / secs:.1f}/s, exec {ex / calls if calls else 0:.2f} ms (longest "
            f"{mx:.1f} ms)" for k, (calls, _, ex, _, mx) in sorted(
                st.items(), key=lambda kv: -kv[1][4]) if calls))
    print(f"    recovery ({B['end'] - B['recover']:.0f} s): delivered {rc['delivered']:.0f} msg/s, "
          f"p99 {ms_(rc['p99'])} ms, dead tuples {rc['dead']}, {rc['size'] / 1048576:.1f} MiB")
    u = r["cpu"]
    print(f"    whole run: lost {r['lost']}, duplicates {r['dups']} of {r['processed']} committed;"
          f" cores: {cores_line(u)}")
    if r["dual_error"]:
        print(f"    dual write failed: {r['dual_error']}")
    if u["other"] > 0.2:
        print(f"    NOTE: other processes used {u['other']:.2f} cores: noisy figures")


def steady_main():
    for f in ("outbox-relay",):
        if not (BUILD / f).exists():
            sys.exit(f"{BUILD / f} missing: run make bench (it builds the bench tools)")
    if STEADY not in STEADY_PHASES:
        sys.exit("BENCH_STEADY must be full, short or off")
    svc = Services()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="outbox-steady-"))
    with svc.pg("postgres") as c:
        c.execute(f"drop database if exists {DB} with (force)")
        c.execute(f"create database {DB}")
        c.execute("alter system set fsync = on")
        c.execute("alter system set full_page_writes = on")
        c.execute("select pg_reload_conf()")
    with svc.pg(DB) as c:
        try:   # the statement breakdown (services.sh preloads pg_stat_statements)
            c.execute("create extension if not exists pg_stat_statements")
            c.execute("alter system set pg_stat_statements.track_planning = on")
            c.execute("select pg_reload_conf()")
        except psycopg.Error as e:
            print(f"bench: no statement breakdown: {str(e).strip()}")
    ok = False
    try:
        init_cfg = write_cfg(tmp / "init.ini", svc, free_port(), name="bench-init")
        subprocess.run([str(BUILD / "outbox-relay"), "init", "-c", str(init_cfg)], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"bench: {version_line()}")
        floor = steady_floor(svc)
        r = steady_run(svc, tmp)
        r["floor"] = floor
        try:
            r["claim_cost"] = steady_claim_cost(svc)
        except (psycopg.Error, BenchError) as e:
            print(f"bench: no claim-cost figures: {str(e).strip()}")
        steady_report(r)
        ok = True
    finally:
        for p in CHILDREN:
            stop(p, grace=10)
        with svc.pg("postgres") as c:
            c.execute(f"drop database if exists {DB} with (force)")
            c.execute("alter system reset fsync")
            c.execute("alter system reset full_page_writes")
            c.execute("alter system reset pg_stat_statements.track_planning")
            c.execute("select pg_reload_conf()")
        try:
            b = Broker(svc)
            for q in (STEADY_QUEUE, DUAL_QUEUE):
                b.ch.queue_delete(q)
            b.close()
        except Exception:  # noqa: BLE001 - best effort
            pass
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"bench: steady run's config and relay log kept in {tmp}", file=sys.stderr)


def on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__" and sys.argv[1:2] == ["--steady-producer"]:
    steady_producer(sys.argv[2:])
    sys.exit(0)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    try:
        # BENCH_ONLY=steady: the steady-load run alone; BENCH=big: the big-message run
        # alone; otherwise the steady run follows the rest unless BENCH_STEADY=off
        if os.environ.get("BENCH_ONLY", "").strip() != "steady":
            main()
        if STEADY != "off" and ONLY != "big":
            steady_main()
    except BenchError as e:
        sys.exit(f"bench: {e}")
    except KeyboardInterrupt:
        sys.exit("bench: interrupted")
    finally:
        for child in CHILDREN:
            stop(child, grace=5)
