"""A RabbitMQ cluster (issue 12): the sink's url lists every node, the relay connects to one
and fails over to the next when it is lost, with a quorum queue.

The harness starts a private 3-node cluster on this machine from Debian's rabbitmq-server:
distinct node names, AMQP and distribution ports, one Erlang cookie (a private HOME) and one
private epmd port (ERL_EPMD_PORT), like scripts/services.sh starts its single node. Nodes
2 and 3 join node 1 at their first boot (classic_config peer discovery). The cluster is torn
down after the module, also when a test fails (kill -9 of every node, then its epmd).

The oracle is the one of tests/test_relay_faults.py: every row arrives (lost 0), the first
delivery of each message keeps per-key order in queue order, each copy carries one
message_id, duplicates stay within publish_window for the one fault."""
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time

import pika
import psycopg
import pytest

from conftest import tail, wait_for
from relay_util import (Relay, consume, delivery_report, free_port, log_lines_at, run_producer,
                        write_config)
from test_relay import init_schema

RMQ_LIBBIN = "/usr/lib/rabbitmq/bin"   # Debian's /usr/sbin wrappers would su to rabbitmq
RMQ_SERVER = f"{RMQ_LIBBIN}/rabbitmq-server"
RMQ_CTL = f"{RMQ_LIBBIN}/rabbitmqctl"
NODES = 3
BOOT_TIMEOUT = 150        # s per boot phase; a node boots in ~10 s on a quiet 2-core machine

def _free_ports(n):
    """n distinct free ports (bound and released; a clash is caught by the node's boot)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def amqp_ready(port):
    """TCP connect + AMQP protocol header → a connection.start method frame."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            s.sendall(b"AMQP\x00\x00\x09\x01")
            b = s.recv(7)
        return len(b) >= 1 and b[0] == 1
    except OSError:
        return False


class RabbitCluster:
    """A private cluster of `n` rabbitmq-server nodes under `base`. nodes[i]: name, amqp
    (port), dist (port), dir; url(i), urls(); pid(i), kill9(i), alive(i); ctl(i, *args)."""

    def __init__(self, base, n=NODES):
        self.base = base
        self.base.mkdir(parents=True, exist_ok=True)
        ports = _free_ports(2 * n + 1)
        self.epmd = ports[0]
        tag = secrets.token_hex(3)
        self.nodes = [{"name": f"outbox-cl{tag}-{i + 1}@localhost", "amqp": ports[1 + 2 * i],
                       "dist": ports[2 + 2 * i], "dir": base / f"node{i + 1}"}
                      for i in range(n)]
        self.home = base / "home"   # the cookie, shared by the nodes and rabbitmqctl
        self.home.mkdir(exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(20).upper())
        cookie.chmod(0o400)
        self.procs = {}

    def env(self, i):
        nd, d = self.nodes[i], self.nodes[i]["dir"]
        return dict(os.environ, HOME=str(self.home), RABBITMQ_NODENAME=nd["name"],
                    RABBITMQ_NODE_IP_ADDRESS="127.0.0.1", RABBITMQ_NODE_PORT=str(nd["amqp"]),
                    RABBITMQ_DIST_PORT=str(nd["dist"]), ERL_EPMD_PORT=str(self.epmd),
                    ERL_EPMD_ADDRESS="127.0.0.1", RABBITMQ_USE_LONGNAME="false",
                    RABBITMQ_CONF_ENV_FILE=str(d / "rabbitmq-env.conf"),
                    RABBITMQ_CONFIG_FILE=str(d / "rabbitmq.conf"),
                    RABBITMQ_ADVANCED_CONFIG_FILE=str(d / "advanced.config"),
                    RABBITMQ_ENABLED_PLUGINS_FILE=str(d / "enabled_plugins"),
                    RABBITMQ_MNESIA_BASE=str(d / "mnesia"), RABBITMQ_LOG_BASE=str(d / "log"),
                    RABBITMQ_LOGS=str(d / "rabbit.log"), RABBITMQ_PID_FILE=str(d / "pid"),
                    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface "
                                                        "{127,0,0,1}")

    def _configure(self, i):
        d = self.nodes[i]["dir"]
        (d / "mnesia").mkdir(parents=True, exist_ok=True)
        (d / "log").mkdir(exist_ok=True)
        (d / "rabbitmq-env.conf").write_text("")
        (d / "enabled_plugins").write_text("[].")
        (d / "advanced.config").write_text("[].")
        lines = [f"listeners.tcp.1 = 127.0.0.1:{self.nodes[i]['amqp']}",
                 "loopback_users.guest = true", "disk_free_limit.absolute = 50MB",
                 "log.file.level = info", "log.console = false",
                 "cluster_formation.peer_discovery_backend = classic_config"]
        lines += [f"cluster_formation.classic_config.nodes.{j + 1} = {nd['name']}"
                  for j, nd in enumerate(self.nodes)]
        (d / "rabbitmq.conf").write_text("\n".join(lines) + "\n")

    def start(self, i):
        self._configure(i)
        d = self.nodes[i]["dir"]
        with open(d / "console.log", "ab") as out:
            self.procs[i] = subprocess.Popen([RMQ_SERVER], env=self.env(i), cwd=str(d),
                                             stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)

    def ctl(self, i, *args, timeout=90):
        return subprocess.run([RMQ_CTL, "-n", self.nodes[i]["name"], *map(str, args)],
                              env=self.env(i), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def url(self, i):
        return f"amqp://guest:guest@127.0.0.1:{self.nodes[i]['amqp']}/%2f"

    def pid(self, i):
        """The node's Erlang VM (its pid file), or None when it is not running: a pid file
        left by a killed node may name a reused pid, so the process must be ours (its
        command line carries this cluster's private HOME)."""
        try:
            pid = int((self.nodes[i]["dir"] / "pid").read_text().strip())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, ValueError):
            return None
        return pid if str(self.home).encode() in args else None

    def alive(self, i):
        p = self.procs.get(i)
        return p is not None and p.poll() is None

    def wait_ready(self, idx, timeout=BOOT_TIMEOUT):
        def ready():
            for i in idx:
                if not self.alive(i):
                    raise AssertionError(f"node {self.nodes[i]['name']} exited while booting:\n"
                                         + self.logs(i))
            return all(amqp_ready(self.nodes[i]["amqp"]) for i in idx) and \
                all(self.pid(i) for i in idx)
        wait_for(ready, timeout, interval=0.2, desc=f"nodes {[i + 1 for i in idx]} to boot")

    def running_nodes(self):
        r = self.ctl(0, "cluster_status", "--formatter", "json")
        if r.returncode != 0:
            return []
        try:
            return json.loads(r.stdout).get("running_nodes", [])
        except ValueError:
            return []

    def form(self):
        """Boots node 1, then nodes 2 and 3 (which join it), and checks all three run as one
        cluster; a node that booted alone joins with join_cluster."""
        self.start(0)
        self.wait_ready([0])
        for i in range(1, len(self.nodes)):
            self.start(i)
        self.wait_ready(range(1, len(self.nodes)))
        names = [nd["name"] for nd in self.nodes]
        running = self.running_nodes()
        if sorted(running) == sorted(names):
            return   # formed at boot (each rabbitmqctl call is an Erlang VM start: seconds)
        for i in range(1, len(self.nodes)):
            if names[i] not in running:   # peer discovery lost a race: join by hand
                for args in (("stop_app",), ("join_cluster", names[0]), ("start_app",)):
                    r = self.ctl(i, *args)
                    assert r.returncode == 0, f"{names[i]} {args}: {r.stdout}{r.stderr}"
        wait_for(lambda: sorted(self.running_nodes()) == sorted(names), 60, interval=0.5,
                 desc="a cluster of three running nodes")

    def kill9(self, i):
        pid = self.pid(i)
        assert pid, f"no pid file for {self.nodes[i]['name']}"
        os.kill(pid, signal.SIGKILL)

    def logs(self, i, n=40):
        d = self.nodes[i]["dir"]
        return f"--- {d / 'rabbit.log'}\n{tail(d / 'rabbit.log', n)}\n" \
               f"--- {d / 'console.log'}\n{tail(d / 'console.log', n)}"

    def teardown(self):
        """kill -9 every node (a throwaway cluster: no graceful stop needed), then the private
        epmd, then the files. Never raises."""
        for i, p in self.procs.items():
            pid = self.pid(i)
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if p.poll() is None:   # the rabbitmq-server script and its children
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if pid:
                deadline = time.monotonic() + 30
                while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                    time.sleep(0.05)
        env = dict(os.environ, ERL_EPMD_PORT=str(self.epmd), ERL_EPMD_ADDRESS="127.0.0.1")
        try:
            subprocess.run(["epmd", "-kill"], env=env, capture_output=True, timeout=10,
                           stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # a missing RabbitMQ fails here like every other missing tool (scripts/packages.txt
    # installs rabbitmq-server): never a silent skip
    assert os.access(RMQ_SERVER, os.X_OK) and os.access(RMQ_CTL, os.X_OK), \
        f"{RMQ_SERVER} / {RMQ_CTL} missing: install rabbitmq-server (scripts/packages.txt)"
    c = RabbitCluster(tmp_path_factory.mktemp("rabbit-cluster"))
    try:
        t0 = time.monotonic()
        c.form()
        print(f"3-node cluster formed in {time.monotonic() - t0:.1f}s: "
              f"{[(nd['name'], nd['amqp']) for nd in c.nodes]}")
        yield c
    finally:
        c.teardown()


def node_channel(cluster, i):
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=cluster.nodes[i]["amqp"], heartbeat=0,
        blocked_connection_timeout=30, socket_timeout=10))
    return conn, conn.channel()


def broker_connected(relay):
    """{broker address: 0/1} from outbox_relay_broker_connected."""
    return {m[0]: int(m[1]) for m in re.findall(
        r'^outbox_relay_broker_connected\{outbox="main",broker="([^"]+)"\} (\d+)$',
        relay.metrics(), re.M)}


def relayed(relay):
    return relay.metric("outbox_relay_relayed_total") or 0


def test_kill9_connected_node_mid_drain(cluster, services, pgdb, relay_bin, build, tmp_path):
    """kill -9 the node the relay is connected to (it also leads the quorum queue) mid-drain:
    rows continue through another node within 10 s, lost 0, per-key order holds,
    duplicates <= publish_window."""
    n, keys, window = 12000, 12, 200
    q = f"qq-{secrets.token_hex(4)}"
    addrs = [f"127.0.0.1:{nd['amqp']}" for nd in cluster.nodes]
    http = free_port()
    cfg = write_config(
        tmp_path / "relay.ini", services, pgdb,
        relay={"name": f"cluster-{secrets.token_hex(3)}", "http_listen": f"127.0.0.1:{http}"},
        sink={"url": ", ".join(cluster.url(i) for i in range(NODES)),
              "publish_window": str(window), "reconnect_max": "1s", "connect_timeout": "3s"},
        # nacks from a stuck channel are failed attempts: room for them
        max_attempts="50", retry_backoff="200ms", retry_backoff_max="1s", batch_size="200")
    init_schema(relay_bin, cfg)

    # the quorum queue, declared through node 1: its leader is there (client-local), where
    # the relay connects first
    conn, ch = node_channel(cluster, 0)
    ch.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum"})
    conn.close()
    leader = cluster.ctl(0, "list_queues", "-q", "--no-table-headers", "name", "leader", "members")
    print(f"quorum queue: {leader.stdout.strip()}")

    # check: every node answers, and says so
    r = subprocess.run([str(relay_bin), "check", "-c", str(cfg)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[sink.main] every broker of the cluster list answers (" + ", ".join(addrs) + ")" \
        in r.stdout, r.stdout

    run_producer(build, pgdb.dsn, pgdb.name, count=n, keys=keys, routing_key=q, size=128,
                 batch=1000)
    relay = Relay(relay_bin, cfg, tmp_path / "relay.log", http_port=http)
    killed = None
    try:
        relay.wait_log("became the active relay", timeout=60)
        wait_for(lambda: relayed(relay) >= 1500, 120, interval=0.02, ignore=(OSError,),
                 desc="1500 rows relayed")
        conn_map = broker_connected(relay)
        assert sorted(conn_map) == sorted(addrs), conn_map
        killed = next(i for i, a in enumerate(addrs) if conn_map[a] == 1)
        assert killed == 0, f"the relay should start on the first URL: {conn_map}"
        at = relayed(relay)
        t_kill = time.monotonic()
        cluster.kill9(killed)
        # rows continue through another node: more confirmed than could have been published
        # before the kill (at most publish_window were in flight or waiting for their mark)
        wait_for(lambda: relayed(relay) > at + window, 10, interval=0.02, ignore=(OSError,),
                 desc=f"rows relayed through another node within 10 s of the kill (at {at:.0f})")
        resumed = time.monotonic() - t_kill
        assert at + window < n, "the kill should land mid-drain"

        def all_sent():
            with psycopg.connect(pgdb.dsn, autocommit=True) as c:
                return c.execute("select count(*) filter (where sent_at is null) = 0 "
                                 "from outbox.messages").fetchone()[0]
        wait_for(all_sent, 120, interval=0.2, desc=f"all {n} rows marked sent")
        took = time.monotonic() - t_kill
        conn_map = broker_connected(relay)
        failovers = relay.metric("outbox_relay_broker_failovers_total")
        reopens = relay.metric("outbox_relay_nack_reopens_total")
        nacked = relay.metric("outbox_relay_nacked_total")
        retried = relay.metric("outbox_relay_retried_unconfirmed_total")
        dead = relay.metric("outbox_relay_dead_total")
        text = relay.text()
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- relay log (last 60 lines)\n{tail(relay.log_path, 60)}\n"
                             + "\n".join(cluster.logs(i, 15) for i in range(NODES))) from None
    finally:
        rc = relay.stop()
    relay.assert_clean_exit(rc)

    # everything from a surviving node, in queue order
    alive = next(i for i in range(NODES) if i != killed)
    conn, ch = node_channel(cluster, alive)
    try:
        depth = ch.queue_declare(q, passive=True).method.message_count
        got = consume(ch, q, depth, timeout=120, idle=0.5)
    finally:
        conn.close()
    assert len(got) == depth, f"queue held {depth}, consumed {len(got)}"
    dups, copies = delivery_report(got, n, keys)

    warn = log_lines_at(text, rf"sink=main: down: broker {addrs[killed]} vhost /: .*; next: "
                              rf"broker {addrs[(killed + 1) % NODES]}$")
    reached = log_lines_at(text, rf"sink=main: connected \(broker 127\.0\.0\.1:\d+ vhost /, "
                                 rf"failed over from broker {addrs[killed]}\)", ("INFO",))
    stuck = log_lines_at(text, r"got only nacks")
    print(f"killed node {killed + 1} ({addrs[killed]}) at {at:.0f}/{n} relayed; rows relayed "
          f"through another node {resumed:.2f}s later, all {n} sent {took:.1f}s after the kill; "
          f"{dups} duplicates (window {window}); failovers {failovers}, nack reopens {reopens}, "
          f"nacked {nacked}, retried unconfirmed {retried}, dead {dead}; connected now "
          f"{conn_map}\n  WARN: {warn[:1]}\n  INFO: {reached[:1]}\n  nack-only: {stuck[:2]}")
    assert resumed <= 10
    assert dead == 0
    assert dups <= window, f"{dups} duplicates > publish_window {window} for one fault"
    assert failovers == 1, failovers
    assert conn_map[addrs[killed]] == 0 and sum(conn_map.values()) == 1, conn_map
    assert warn, "the failover must be a WARN naming the node left and the next one:\n" + text[-3000:]
    assert reached, "the connection made must be an INFO naming the node reached:\n" + text[-3000:]

    # check now names the dead node, on its own line, and fails
    r = subprocess.run([str(relay_bin), "check", "-c", str(cfg)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"[sink.main] broker {addrs[killed]} vhost /: connect: connection refused" in r.stderr, \
        r.stderr
