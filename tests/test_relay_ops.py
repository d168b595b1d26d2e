"""What an operator sees when the broker or the database is wrong (required: "every failure an
operator must act on ... is logged at the default level, naming the peer and the reason; the
event loop never blocks on a connect, so probes always answer"), and TLS with a client
certificate. Real servers only: the harness's PostgreSQL and RabbitMQ (with an extra TLS
listener added at run time), a TCP listener that accepts and never answers, a port where
nothing listens."""
import http.client
import json
import os
import re
import secrets
import time
import uuid

import pytest

from conftest import run_prog, wait_for
from relay_util import (ANY_LEVEL, BlackholeProxy, BrokerTlsListener, Relay, SilentListener,
                        amqp_channel, consume, declare, free_port, insert_rows, log_events,
                        log_lines_at, make_pki, wait_log_at, write_config)

SLOW = 4 if os.environ.get("OUTBOX_VALGRIND") == "1" else \
    2 if "build-" in os.environ.get("OUTBOX_BUILD", "") else 1   # valgrind / sanitizer builds
PROBE_MAX_S = 0.2 * SLOW   # every probe answers within this while the broker hangs (a loop
#                            blocked on the broker would take its connect_timeout, 1 s)


def cli(relay_bin, *args, timeout=60):
    return run_prog([relay_bin, *map(str, args)], timeout=timeout)


def init(relay_bin, cfg):
    r = cli(relay_bin, "init", "-c", cfg)
    assert r.returncode == 0, r.stdout + r.stderr


def config(tmp_path, services, db, name, *, sink=None, relay=None, **outbox):
    """A relay at the default log level (info: write_config leaves log_level out), fast
    broker reconnects."""
    relay_keys = {"name": name}
    relay_keys.update(relay or {})
    sink_keys = {"connect_timeout": "2s", "reconnect_max": "300ms"}
    sink_keys.update(sink or {})
    return write_config(tmp_path / f"{name}.ini", services, db, relay=relay_keys, sink=sink_keys,
                        **outbox)


def timed_get(port, path):
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request("GET", path)
        resp = c.getresponse()
        body = resp.read().decode("utf-8", "replace")
    finally:
        c.close()
    return resp.status, body, time.monotonic() - t0


def metric(body, name, outbox="main"):
    m = re.search(rf'^{name}{{outbox="{outbox}"}} (\S+)$', body, re.M)
    return float(m.group(1)) if m else None


def check_line(relay_bin, cfg):
    """`check`'s one line about [sink.main], without the "FILE: [sink.main] " prefix."""
    r = cli(relay_bin, "check", "-c", cfg)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    got = [ln for ln in r.stderr.splitlines() if "[sink.main]" in ln]
    assert len(got) == 1, r.stderr
    return got[0].split("[sink.main] ", 1)[1]


# ---------------------------------------------------------------------------- the loop
def test_probes_answer_while_broker_hangs(services, pgdb, relay_bin, tmp_path):
    """The broker's port accepts TCP and then says nothing: connect + login run on a worker
    thread, so /healthz and /metrics answer at once throughout, the relay keeps trying, and
    the database side keeps working (the backlog gauge follows rows inserted meanwhile)."""
    hole = SilentListener()
    port = free_port()
    cfg = config(tmp_path, services, pgdb, "hang",
                 relay={"http_listen": f"127.0.0.1:{port}"},
                 sink={"url": f"amqp://guest:guest@127.0.0.1:{hole.port}/%2f",
                       "connect_timeout": "1s", "reconnect_max": "200ms"})
    init(relay_bin, cfg)
    r = Relay(relay_bin, cfg, tmp_path / "hang.log", http_port=port)
    lat, worst, n_rows = [], (0.0, ""), 25
    try:
        wait_for(lambda: timed_get(port, "/healthz")[0] == 200, 20 * SLOW, desc="/healthz",
                 ignore=(OSError, http.client.HTTPException))
        insert_rows(pgdb, n_rows, 5)
        backlog_seen = None
        t_end = time.monotonic() + 10
        while time.monotonic() < t_end:
            for path in ("/healthz", "/metrics"):
                st, body, dt = timed_get(port, path)
                assert st in (200, 503), (path, st)
                lat.append(dt)
                if dt > worst[0]:
                    worst = (dt, path)
                if path == "/metrics":
                    backlog_seen = metric(body, "outbox_relay_backlog")
            time.sleep(0.03)
        assert worst[0] < PROBE_MAX_S, \
            f"a probe took {worst[0] * 1e3:.0f} ms ({worst[1]}): the loop blocked on the broker"
        # the database side was not held up: the stats query ran and saw the new rows
        if backlog_seen != n_rows:
            backlog_seen = wait_for(
                lambda: metric(timed_get(port, "/metrics")[1], "outbox_relay_backlog") == n_rows,
                15 * SLOW, desc=f"outbox_relay_backlog {n_rows}")
        attempts = hole.n_accepted
        # stopping while a connect attempt hangs: the attempt is cancelled, nothing waits
        # longer than connect_timeout (1 s) for it
        t_stop = time.monotonic()
        rc = r.stop()
        stop_took = time.monotonic() - t_stop
        text = r.text()
    finally:
        if r.proc.poll() is None:
            r.stop()
        hole.close()
    lat.sort()
    print(f"{len(lat)} probes over 10 s while the broker hung: median {lat[len(lat) // 2] * 1e3:.1f} "
          f"ms, max {worst[0] * 1e3:.1f} ms ({worst[1]}); {attempts} connections to the hung broker; "
          f"SIGTERM took {stop_took:.2f}s")
    r.assert_clean_exit(rc)
    assert stop_took < 5 * SLOW, f"SIGTERM took {stop_took:.1f}s with a connect attempt hanging"
    assert attempts >= 3, f"only {attempts} connection attempts in 10 s"
    warn = log_lines_at(text, rf"sink=main: down: broker 127\.0\.0\.1:{hole.port} vhost /: "
                              r"login: timeout after 1 s")
    assert warn, text[-3000:]


def test_idle_http_clients_cannot_use_up_the_descriptors(services, pgdb, relay_bin, tmp_path):
    """Idle TCP clients on http_listen (a port scanner, a stuck scraper) with the relay's
    descriptor limit nearly reached: accept() fails with EMFILE while the listening socket
    stays readable. The relay closes its oldest HTTP client to make room (and never holds more
    than 64), so /metrics still answers, and the failure is logged once, not at every turn of
    the loop (which spun, logging 300,000 lines a second)."""
    import resource
    import socket
    if os.environ.get("OUTBOX_VALGRIND") == "1":
        pytest.skip("valgrind keeps descriptors of its own under the process's limit")
    port = free_port()
    cfg = config(tmp_path, services, pgdb, "fds", relay={"http_listen": f"127.0.0.1:{port}"})
    init(relay_bin, cfg)
    r = Relay(relay_bin, cfg, tmp_path / "fds.log", http_port=port)
    socks = []
    try:
        wait_for(lambda: timed_get(port, "/healthz")[0] == 200, 20 * SLOW, desc="/healthz",
                 ignore=(OSError, http.client.HTTPException))
        n_fds = len(os.listdir(f"/proc/{r.proc.pid}/fd"))
        hard = resource.prlimit(r.proc.pid, resource.RLIMIT_NOFILE)[1]
        resource.prlimit(r.proc.pid, resource.RLIMIT_NOFILE, (n_fds + 16, hard))
        for _ in range(300):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
            except OSError:
                pass
        time.sleep(1)
        st, body, dt = timed_get(port, "/metrics")
        assert st == 200 and metric(body, "outbox_relay_source_up") == 1, (st, dt)
        assert len(os.listdir(f"/proc/{r.proc.pid}/fd")) <= n_fds + 16
        lines = [(lvl, m) for lvl, m in log_events(r.text()) if "http: accept" in m]
        assert lines and lines[0][0] == "WARN" and "closing the oldest client" in lines[0][1], \
            lines[:5]
        assert len(lines) <= 2, f"{len(lines)} lines: {lines[:5]}"
    finally:
        for so in socks:
            so.close()
        r.stop_clean()


# ---------------------------------------------------------------------------- broker failures
@pytest.fixture
def broker_user(services):
    user = "ops_" + secrets.token_hex(4)
    pw = "Ops-s3cr3t-" + secrets.token_hex(6)
    r = services.add_broker_user(user, pw)
    assert r.returncode == 0, r.stdout + r.stderr
    yield user, pw
    services.rabbitmqctl_later("delete_user", user)


def test_wrong_broker_password_logged_then_recovery(services, pgdb, relay_bin, tmp_path,
                                                    broker_user):
    """Login refused: one WARN naming broker and reason (the same words `check` prints), the
    repeats not at WARN again; once the password is right, one INFO saying after how many
    failures."""
    user, pw = broker_user
    wrong = "Wr0ng-" + secrets.token_hex(6)
    port = services.amqp_port
    cfg = config(tmp_path, services, pgdb, "pw",
                 sink={"url": f"amqp://{user}:{wrong}@127.0.0.1:{port}/%2f"})
    init(relay_bin, cfg)
    r = Relay(relay_bin, cfg, tmp_path / "pw.log")
    try:
        t0 = time.monotonic()
        line = wait_log_at(r, r"sink=main: down: ", timeout=10 * SLOW)
        took = time.monotonic() - t0
        said = check_line(relay_bin, cfg)
        assert re.fullmatch(rf"broker 127\.0\.0\.1:{port} vhost /: login refused "
                            r"\(ACCESS_REFUSED.*", said), said
        assert line.endswith(said), (line, said)
        time.sleep(3)   # reconnect_max 300 ms: several more refusals meanwhile
        r2 = services.rabbitmqctl("change_password", user, wrong)
        assert r2.returncode == 0, r2.stdout + r2.stderr
        ok = wait_log_at(r, r"sink=main: connected", levels=("INFO",), timeout=20 * SLOW)
        text = r.text()
    finally:
        rc = r.stop()
    r.assert_clean_exit(rc)
    print(f"first WARN after {took:.1f}s: {line!r}\nrecovery: {ok!r}")
    assert took < 10 * SLOW
    assert wrong not in text and pw not in text
    warns = log_lines_at(text, r"login refused")
    assert len(warns) == 1, f"repeats must be rate-limited: {warns}"
    m = re.search(rf"connected \(broker 127\.0\.0\.1:{port} vhost /\) after (\d+) failures", ok)
    assert m and int(m.group(1)) >= 3, ok


def test_nothing_listening_logged_then_recovery(services, pgdb, relay_bin, tmp_path):
    port = free_port()
    cfg = config(tmp_path, services, pgdb, "refused",
                 sink={"url": f"amqp://guest:guest@127.0.0.1:{port}/%2f"})
    init(relay_bin, cfg)
    r = Relay(relay_bin, cfg, tmp_path / "refused.log")
    proxy = None
    try:
        line = wait_log_at(r, r"sink=main: down: ", timeout=10 * SLOW)
        said = check_line(relay_bin, cfg)
        assert said == f"broker 127.0.0.1:{port} vhost /: connect: connection refused", said
        assert line.endswith(said), (line, said)
        time.sleep(1)
        proxy = BlackholeProxy(services.amqp_port, port=port)   # now something listens
        ok = wait_log_at(r, r"sink=main: connected", levels=("INFO",), timeout=20 * SLOW)
        text = r.text()
    finally:
        rc = r.stop()
        if proxy is not None:
            proxy.close()
    r.assert_clean_exit(rc)
    assert len(log_lines_at(text, "connection refused")) == 1, text[-3000:]
    assert re.search(rf"connected \(broker 127\.0\.0\.1:{port} vhost /\) after \d+ failures", ok), ok


def test_database_unreachable_logged_with_peer(services, pgdb, relay_bin, tmp_path):
    """Nothing listens where the database should be: an ERROR at the default level naming
    host:port/database and the reason."""
    good = config(tmp_path, services, pgdb, "dbgood")
    init(relay_bin, good)
    port = free_port()
    cfg = config(tmp_path, services, pgdb, "dbdown",
                 conninfo=f"host=127.0.0.1 port={port} user={services.pg_user} "
                          f"dbname={pgdb.name} connect_timeout=2")
    r = Relay(relay_bin, cfg, tmp_path / "dbdown.log")
    try:
        line = wait_log_at(r, r"database unavailable", timeout=10 * SLOW)
        time.sleep(2)
        text = r.text()
    finally:
        rc = r.stop()
    r.assert_clean_exit(rc)
    print(line)
    assert f"127.0.0.1:{port}/{pgdb.name}" in line, line
    assert re.search(r"(?i)connection refused", line), line
    main = [m for m in log_lines_at(text, r"database unavailable \(main connection\)")]
    assert len(main) == 1, f"repeats must be rate-limited: {main}"


# ---------------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def tls(services, tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    lst = BrokerTlsListener(services, pki)
    yield pki, lst.port
    lst.close()


def tls_sink(port, pki, *, cert=True, ca=None, scheme="amqps"):
    keys = {"url": f"{scheme}://guest:guest@127.0.0.1:{port}/%2f"}
    if scheme == "amqps":
        keys["tls_ca_file"] = str(ca or pki["ca"])
    if cert:
        keys["tls_cert"] = str(pki["client_cert"])
        keys["tls_key"] = str(pki["client_key"])
    return keys


def test_tls_client_certificate_and_ip_san(services, pgdb, relay_bin, tmp_path, tls):
    """amqps://127.0.0.1 against a certificate whose only name is the IP SAN 127.0.0.1, with
    a client certificate (the listener has fail_if_no_peer_cert): rows drain."""
    pki, port = tls
    q = f"qtls-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    cfg = config(tmp_path, services, pgdb, "tls", sink=tls_sink(port, pki))
    init(relay_bin, cfg)
    r = cli(relay_bin, "check", "-c", cfg)
    assert r.returncode == 0, r.stdout + r.stderr
    n = 50
    insert_rows(pgdb, n, 5, routing_key=q)
    relay = Relay(relay_bin, cfg, tmp_path / "tls.log")
    try:
        got = consume(ch, q, n, timeout=30 * SLOW)
        text = relay.text()
    finally:
        rc = relay.stop()
        conn.close()
    relay.assert_clean_exit(rc)
    assert len(got) == n, f"{len(got)} of {n} arrived; log:\n{text[-3000:]}"
    assert not log_lines_at(text, r"sink=main: down", ANY_LEVEL), text[-3000:]


@pytest.mark.parametrize("case", ["no_client_cert", "wrong_ca", "plaintext_to_tls_port"])
def test_tls_failures_logged(services, pgdb, relay_bin, tmp_path, tls, case):
    pki, port = tls
    sink, want = {
        "no_client_cert": (tls_sink(port, pki, cert=False),
                           r"certificate required|asked for a client certificate"),
        "wrong_ca": (tls_sink(port, pki, ca=pki["other_ca"]),
                     r"TLS: certificate verify failed: \S"),
        "plaintext_to_tls_port": (tls_sink(port, pki, cert=False, scheme="amqp"),
                                  r"login: .*a TLS port\?"),
    }[case]
    cfg = config(tmp_path, services, pgdb, case, sink=sink)
    init(relay_bin, cfg)
    r = Relay(relay_bin, cfg, tmp_path / f"{case}.log")
    try:
        line = wait_log_at(r, r"sink=main: down: ", timeout=10 * SLOW)
    finally:
        rc = r.stop()
    r.assert_clean_exit(rc)
    said = check_line(relay_bin, cfg)
    assert said.startswith(f"broker 127.0.0.1:{port} vhost /: ") and re.search(want, said), said
    print(f"check: {said}\nrun:   {line}")
    assert line.endswith(said), (line, said)


# ---------------------------------------------------------------------------- rate limiting
def test_log_limit_unit(build, tmp_path):
    """relay/log.c's log_fail/log_ok with a fake clock, and the JSON encoding of a line's
    fields (tests/c/log_test.c). Every JSON line the program produced must also parse here,
    with a real JSON parser, as one object whose values are all non-empty."""
    out = tmp_path / "json-lines"
    r = run_prog([build / "tests" / "log_test"], timeout=60,
                 env=dict(os.environ, LOG_TEST_JSON_OUT=str(out)))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = out.read_text(encoding="utf-8").splitlines()   # strict: valid UTF-8 only
    assert len(lines) >= 10, lines
    for ln in lines:
        obj = json.loads(ln)
        assert isinstance(obj, dict) and {"ts", "level", "msg"} <= set(obj), ln
        assert all(v not in ("", None) for v in obj.values()), ln


def test_a_settle_failing_again_and_again_shows_in_the_metrics(services, pgdb, relay_bin,
                                                                build, tmp_path):
    """Every settle fails (the database refuses the marks: a full disk, here a trigger that
    raises its error) while claims and publishes succeed: the rows are published and never
    marked. The backlog gauges must still be read (the alerts on a stuck outbox fire on them;
    the settle retried first every time held the reads behind it and left them at 0), the
    failures counted by request, the WARN logged once (not every retry) saying what it holds
    back, and the recovery logged once the database accepts the marks again."""
    from test_relay_faults import Case
    c = Case(services, pgdb, relay_bin, build, tmp_path, "settlefail")
    tab = pgdb.connect()
    tab.autocommit = True
    r = c.start()
    try:
        r.wait_log("became the active relay")
        wait_for(lambda: r.metric("outbox_relay_backlog") == 0, 40, desc="backlog read once")
        tab.execute("""create function outbox.diskfull() returns trigger language plpgsql
            as $$ begin if new.sent_at is not null and old.sent_at is null then
            raise exception using errcode = '53100',
            message = 'could not extend file "base/1/2": No space left on device';
            end if; return new; end $$""")
        tab.execute("create trigger diskfull before update on outbox.messages "
                    "for each row execute function outbox.diskfull()")
        c.produce(100, 10, size=64, batch=100)
        wait_for(lambda: r.metric("outbox_relay_backlog") >= 100
                 and r.metric("outbox_relay_oldest_pending_age_seconds") > 5, 40,
                 desc="the backlog gauges read while every settle fails")
        text = r.metrics()
        m = re.search(r'^outbox_relay_database_errors_total\{outbox="main",request="settle"\} '
                      r'(\d+)$', text, re.M)
        assert m and int(m.group(1)) >= 3, text
        assert r.metric("outbox_relay_relayed_total") == 0
        warns = [msg for lvl, msg in log_events(r.text())
                 if lvl == "WARN" and "settle failed" in msg]
        assert warns and "No space left on device" in warns[0] and \
            "not marked sent" in warns[0], warns
        assert len(warns) == 1, warns   # identical repeats: once a minute with their count
        tab.execute("drop trigger diskfull on outbox.messages")
        c.wait_all_sent(100, timeout=30)
        r.wait_log("settle succeeded again after")
    finally:
        tab.execute("drop trigger if exists diskfull on outbox.messages")
        r.stop_clean()
    got = c.collect()
    assert len({p.message_id for p, _, _ in got}) == 100
