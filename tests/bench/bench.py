#!/usr/bin/python3
"""make bench — the relay's throughput beside the broker's own ceiling, measured in one run.

For each round: the C probe (tests/bench/amqp_probe.c) publishes N persistent 256-byte
messages with confirms over the same window to the same kind of queue (classic, durable);
then N committed 256-byte rows (1000 partition keys) are drained by `outbox-relay run` and
timed until every row is marked sent. Rounds alternate probe and relay; medians and their
ratio are printed, with the relay's peak RSS and CPU time. PostgreSQL runs with fsync on
for the measurement (the test cluster normally runs with fsync off).

Environment: BENCH_ROWS (100000), BENCH_WINDOW (1000), BENCH_BATCH (500), BENCH_ROUNDS (3),
BENCH_KEYS (1000; 0 = no partition key), BENCH_ON_SENT (mark | delete), OUTBOX_BUILD.
"""
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import pika
import psycopg

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("OUTBOX_BUILD", ROOT / "build"))
N = int(os.environ.get("BENCH_ROWS", 100000))
WINDOW = int(os.environ.get("BENCH_WINDOW", 1000))
BATCH = int(os.environ.get("BENCH_BATCH", 500))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
KEYS = int(os.environ.get("BENCH_KEYS", 1000))
ON_SENT = os.environ.get("BENCH_ON_SENT", "mark")
SIZE = 256
QUEUE = "outbox-bench"
DB = "outbox_bench"


def services():
    subprocess.run([str(ROOT / "scripts/services.sh"), "start"], check=True)
    out = subprocess.run([str(ROOT / "scripts/services.sh"), "env"], check=True,
                         capture_output=True, text=True).stdout
    env = dict(re.findall(r"^export (\w+)=['\"]?([^'\"\n]*)['\"]?$", out, re.M))
    return env


def pg(env, db):
    return psycopg.connect(host="127.0.0.1", port=int(env["OUTBOX_PG_PORT"]), user="postgres",
                           dbname=db, autocommit=True)


def amqp(env):
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", int(env["OUTBOX_AMQP_PORT"])))
    return c, c.channel()


def reset_queue(ch):
    ch.queue_declare(QUEUE, durable=True)
    ch.queue_purge(QUEUE)


def proc_stats(pid):
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1])
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / tick
    return rss, cpu


def cpu_of(names):
    """Total CPU seconds (user+sys, incl. reaped children) of processes whose comm is in names."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                data = f.read()
        except OSError:
            continue
        comm = data[data.index("(") + 1:data.rindex(")")]
        if comm in names:
            fields = data.rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / tick
    return total


BROKER = {"beam.smp", "erl_child_setup", "inet_gethost"}
DATABASE = {"postgres"}


class CpuMeter:
    def __enter__(self):
        self.t0 = time.monotonic()
        self.b0, self.d0 = cpu_of(BROKER), cpu_of(DATABASE)
        return self

    def __exit__(self, *exc):
        secs = time.monotonic() - self.t0
        self.broker = (cpu_of(BROKER) - self.b0) / secs
        self.db = (cpu_of(DATABASE) - self.d0) / secs
        return False


def probe(env):
    p = subprocess.run([str(BUILD / "tests/amqp_probe"), env["OUTBOX_AMQP_URL"], QUEUE, str(N),
                        str(WINDOW), str(SIZE)], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"probe failed: {p.stderr}")
    return float(re.search(r"rate=([\d.]+)", p.stdout).group(1))


def fill(conn):
    conn.execute("truncate outbox.messages")
    key = f"'k' || (g %% {KEYS})" if KEYS else "NULL"  # %% : psycopg placeholder escape
    conn.execute(f"""insert into outbox.messages (message_id, routing_key, partition_key, payload)
                    select gen_random_uuid(), %s, {key},
                           convert_to(rpad(g::text || '|', {SIZE}, 'x'), 'UTF8')
                    from generate_series(1, {N}) g""", (QUEUE,))
    conn.execute("vacuum analyze outbox.messages")


def relay_round(env, cfg, conn):
    t0 = time.monotonic()
    log = open(cfg.with_suffix(".log"), "w")
    p = subprocess.Popen([str(BUILD / "outbox-relay"), "run", "-c", str(cfg)], stderr=log)
    try:
        while True:
            time.sleep(0.05)
            if p.poll() is not None:
                sys.exit(f"relay exited early; see {cfg.with_suffix('.log')}")
            # cheap (pending index) so the measurement does not load the database
            left = conn.execute("select exists (select 1 from outbox.messages "
                                "where sent_at is null)").fetchone()[0]
            if not left:
                break
            if time.monotonic() - t0 > 600:
                sys.exit("relay did not drain within 600 s")
        secs = time.monotonic() - t0
        rss, cpu = proc_stats(p.pid)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        log.close()
    return N / secs, secs, rss, cpu


def main():
    for f in ("outbox-relay", "tests/amqp_probe"):
        if not (BUILD / f).exists():
            sys.exit(f"{BUILD / f} missing: run make first")
    env = services()
    with pg(env, "postgres") as c:
        c.execute(f"drop database if exists {DB}")
        c.execute(f"create database {DB}")
        c.execute("alter system set fsync = on")
        c.execute("alter system set full_page_writes = on")
        c.execute("select pg_reload_conf()")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    cfg = tmp / "bench.ini"
    cfg.write_text(f"""[relay]
name = bench
log_level = warn
http_listen =
[sink.main]
url = {env['OUTBOX_AMQP_URL']}
publish_window = {WINDOW}
[outbox.bench]
source = postgres
conninfo = host=127.0.0.1 port={env['OUTBOX_PG_PORT']} dbname={DB} user=postgres
database = {DB}
batch_size = {BATCH}
poll_interval = 1s
on_sent = {ON_SENT}
""")
    subprocess.run([str(BUILD / "outbox-relay"), "init", "-c", str(cfg)], check=True,
                   stdout=subprocess.DEVNULL)
    conn = pg(env, DB)
    ac, ch = amqp(env)
    probes, relays = [], []
    print(f"bench: {N} rows x {SIZE} B, window {WINDOW}, batch {BATCH}, "
          f"{KEYS or 'no'} partition keys, on_sent = {ON_SENT}, {ROUNDS} rounds (probe, relay alternating)")
    try:
        for r in range(ROUNDS):
            reset_queue(ch)
            with CpuMeter() as pm:
                pr = probe(env)
            probes.append(pr)
            reset_queue(ch)
            fill(conn)
            with CpuMeter() as rm:
                rate, secs, rss, cpu = relay_round(env, cfg, conn)
            relays.append((rate, secs, rss, cpu))
            depth = ch.queue_declare(QUEUE, durable=True, passive=True).method.message_count
            print(f"  round {r + 1}: broker ceiling {pr:8.0f} msg/s (broker {pm.broker:.2f} cores) | "
                  f"relay {rate:8.0f} msg/s ({secs:.2f} s, {depth} in queue; cores used: "
                  f"broker {rm.broker:.2f}, PostgreSQL {rm.db:.2f}, relay {cpu / secs:.2f}; "
                  f"relay peak RSS {rss / 1024:.1f} MiB)")
            if depth < N:
                sys.exit(f"only {depth} of {N} messages reached the queue")
        reset_queue(ch)
    finally:
        ac.close()
        conn.close()
        with pg(env, "postgres") as c:
            c.execute(f"drop database if exists {DB}")
            c.execute("alter system reset fsync")
            c.execute("alter system reset full_page_writes")
            c.execute("select pg_reload_conf()")
    mp = statistics.median(probes)
    mr = statistics.median(r[0] for r in relays)
    rss = max(r[2] for r in relays)
    print(f"median: broker ceiling {mp:.0f} msg/s, relay {mr:.0f} msg/s, "
          f"ratio {mr / mp:.2f}, relay peak RSS {rss / 1024:.1f} MiB "
          f"({os.cpu_count()} cores shared by broker, PostgreSQL and relay)")


if __name__ == "__main__":
    main()
