"""The relay's command line, probes and logs: `check`, `init`, `schema`, `stats`,
`dead`, `--help`/`--version`, exit codes; /healthz, /readyz, /metrics of a running relay; JSON
logs without secrets; log_file reopened on SIGHUP; SIGTERM/SIGINT handling. Everything runs
the real binary against the harness's PostgreSQL and RabbitMQ."""
import http.client
import json
import os
import pathlib
import re
import secrets
import signal
import time
import uuid

import pytest

from conftest import run_prog, wait_for
from relay_util import (Relay, amqp_channel, assert_log_at, consume, declare, free_port,
                        psql_rows, run_producer, wait_log_at, write_config)

ROOT = pathlib.Path(__file__).resolve().parent.parent
BAD = sorted((ROOT / "config" / "bad").glob("*.ini"))
SLOW = 4 if os.environ.get("OUTBOX_VALGRIND") == "1" else 1   # valgrind slows everything down

# "FILE[:LINE]: [SECTION] KEY: message" or "FILE[:LINE]: [SECTION]: message" (as in test_config.py)
LINE_RE = re.compile(r"^(?P<file>.+?)(?::(?P<line>\d+))?: \[(?P<sec>[^\]]*)\](?: (?P<key>[a-z_]+))?: (?P<msg>.+)$")
LEAD_RE = re.compile(r"^\[(?P<sec>[^\]]*)\](?: (?P<key>[a-z_]+))?: ")


def header(path, name):
    for line in path.read_text().splitlines():
        if line.startswith(f"; {name}: "):
            return line[len(f"; {name}: "):]
    return None


def cli(relay_bin, *args, timeout=60, **kw):
    """Runs `outbox-relay ARGS...` (under valgrind when OUTBOX_VALGRIND=1)."""
    env = dict(os.environ)
    env.pop("OUTBOX_RELAY_TEST_UNSET", None)
    env.update(kw.pop("env", {}))
    return run_prog([relay_bin, *map(str, args)], timeout=timeout, env=env, **kw)


def lines(text):
    return [ln for ln in text.splitlines() if ln.strip()]


def init(relay_bin, cfg):
    r = cli(relay_bin, "init", "-c", cfg)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def http_get(port, path, method="GET", timeout=5):
    """(status, headers dict (lower-case names), body text)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path)
        resp = c.getresponse()
        body = resp.read().decode("utf-8", "replace")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        c.close()


def http_status(port, path):
    return http_get(port, path)[0]


def wait_http_up(relay, timeout=20):
    def up():
        if relay.proc.poll() is not None:
            raise AssertionError(f"relay exited {relay.proc.returncode}:\n{relay.text()[-3000:]}")
        return http_status(relay.http_port, "/healthz") == 200
    wait_for(up, timeout, desc="/healthz", ignore=(OSError, http.client.HTTPException))


def insert_dead(db, id_, reason="unroutable: 312 NO_ROUTE", table="outbox.messages_dead",
                routing_key="q", attempts=10):
    with db.connect() as c:
        mid = c.execute(
            f"insert into {table} (id, message_id, exchange, routing_key, partition_key, payload, "
            "attempts, reason) values (%s, gen_random_uuid(), '', %s, 'k', %s, %s, %s) "
            "returning message_id::text",
            (id_, routing_key, f"dead-{id_}".encode(), attempts, reason)).fetchone()[0]
    return mid


def relay_with_http(relay_bin, tmp_path, services, db, name="r1", relay=None, **kw):
    port = free_port()
    relay_keys = {"name": name, "http_listen": f"127.0.0.1:{port}"}
    relay_keys.update(relay or {})
    cfg = write_config(tmp_path / f"{name}.ini", services, db, relay=relay_keys, **kw)
    return cfg, port


# ============================================================================ 1. check
@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_check_bad_file_one_line(relay_bin, path):
    expect = header(path, "expect")
    assert expect, f"{path.name}: no '; expect:' header"
    r = cli(relay_bin, "check", "-c", path)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "", r.stdout
    err = r.stderr.splitlines()
    assert len(err) == 1, f"expected exactly one line on stderr, got {err}"
    secret = header(path, "secret")
    assert not secret or secret not in r.stderr
    if expect.startswith(":"):   # a problem of the file's lines: "FILE" + expect starts the line
        assert err[0].startswith(f"{path}{expect}"), f"\n got:  {err[0]}\n want: {path}{expect}"
        return
    lead = LEAD_RE.match(expect)
    assert lead, expect
    m = LINE_RE.match(err[0])
    assert m, f"line does not name file and section: {err[0]!r}"
    assert m["file"] == str(path), err[0]
    assert m["sec"] == lead["sec"], err[0]
    assert m["key"] == lead["key"], err[0]
    assert expect in err[0], f"\n got:  {err[0]}\n want: {expect}"


def test_check_missing_file(relay_bin, tmp_path):
    p = tmp_path / "nope.ini"
    r = cli(relay_bin, "check", "-c", p)
    assert r.returncode == 2
    assert lines(r.stderr) == [f"{p}: cannot open: No such file or directory"]


def test_check_good_config_ok(services, pgdb, relay_bin, tmp_path):
    cfg = write_config(tmp_path / "good.ini", services, pgdb)
    init(relay_bin, cfg)
    r = cli(relay_bin, "check", "-c", cfg)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""
    out = lines(r.stdout)
    assert len(out) == 1 and "OK" in out[0] and str(cfg) in out[0], out
    assert "1 outbox" in out[0] and "1 sink" in out[0], out


def test_check_log_file_that_cannot_be_opened(services, pgdb, relay_bin, tmp_path):
    """`run` would log to stderr instead of log_file (ERROR log_open_failed): `check` warns
    (it may run as another user than the service: not an error), and creates nothing; a
    log_file it may create passes quietly."""
    for bad, why in ((tmp_path / "no-such-dir" / "relay.log", "No such file or directory"),
                     (tmp_path, "Is a directory")):
        cfg = write_config(tmp_path / "bad.ini", services, pgdb, relay={"log_file": str(bad)})
        init(relay_bin, cfg)
        r = cli(relay_bin, "check", "-c", cfg)
        assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
        err = lines(r.stderr)
        assert err == [f'{cfg}: [relay] WARNING: log_file: this user cannot open "{bad}" for '
                       f'writing: {why} (outbox-relay run logs to stderr if its user cannot '
                       'either)'], err
    ok = write_config(tmp_path / "ok.ini", services, pgdb,
                      relay={"log_file": str(tmp_path / "relay.log")})
    r = cli(relay_bin, "check", "-c", ok)
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert not (tmp_path / "relay.log").exists(), "check created log_file"


def test_check_wrong_broker_password(services, pgdb, relay_bin, tmp_path):
    cfg = write_config(tmp_path / "good.ini", services, pgdb)
    init(relay_bin, cfg)
    pw = "Wr0ng-" + secrets.token_hex(6)
    bad = write_config(tmp_path / "badpw.ini", services, pgdb,
                       sink={"url": f"amqp://guest:{pw}@127.0.0.1:{services.amqp_port}/%2f"})
    r = cli(relay_bin, "check", "-c", bad)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    err = lines(r.stderr)
    assert len(err) == 1, err
    assert err[0].startswith(f"{bad}: [sink.main] "), err[0]
    assert re.search(r"ACCESS_REFUSED|login|auth", err[0], re.I), err[0]
    assert pw not in r.stdout + r.stderr
    assert "OK" not in r.stdout

    # the same wrong password through password_file: the file's content is secret too
    pwf = tmp_path / "amqp-pw"
    pwf.write_text(pw + "\n")
    bad2 = write_config(tmp_path / "badpw2.ini", services, pgdb,
                        sink={"password_file": str(pwf)})
    r = cli(relay_bin, "check", "-c", bad2)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    err = lines(r.stderr)
    assert len(err) == 1 and "[sink.main]" in err[0], err
    assert pw not in r.stdout + r.stderr


def test_check_missing_table(services, pgdb, relay_bin, tmp_path):
    cfg = write_config(tmp_path / "noinit.ini", services, pgdb)
    r = cli(relay_bin, "check", "-c", cfg)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    err = lines(r.stderr)
    assert len(err) == 1, err
    assert err[0].startswith(f"{cfg}: [outbox.main] "), err[0]
    assert "outbox-relay init" in err[0] and "messages" in err[0], err[0]
    assert pgdb.name in err[0]


def test_check_missing_lease_table(services, pgdb, relay_bin, tmp_path):
    """The leadership lease table (also the competing relays' membership) is part of the
    schema: without it check fails, and run reports the source down, each saying to run init
    (check passed, and run said ready while it could never lead)."""
    cfg = write_config(tmp_path / "nolease.ini", services, pgdb)
    init(relay_bin, cfg)
    pgdb.psql("DROP TABLE outbox.messages_lease")
    r = cli(relay_bin, "check", "-c", cfg)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    err = lines(r.stderr)
    assert len(err) == 1 and err[0].startswith(f"{cfg}: [outbox.main] "), err
    assert 'leadership lease table "outbox"."messages_lease" missing' in err[0], err[0]
    assert "run outbox-relay init" in err[0], err[0]
    relay = Relay(relay_bin, cfg, tmp_path / "nolease.log")
    try:
        assert wait_log_at(relay, r"leadership lease table \S+ missing: run outbox-relay init")
    finally:
        relay.stop_clean()


def test_check_unreachable_database_hides_conninfo(services, pgdb, relay_bin, tmp_path):
    secret = "s3cr3t-" + secrets.token_hex(4)
    dsn = f"host=127.0.0.1 port={free_port()} user=postgres dbname={pgdb.name} " \
          f"password={secret} connect_timeout=3"
    cfg = write_config(tmp_path / "down.ini", services, pgdb, conninfo=dsn)
    r = cli(relay_bin, "check", "-c", cfg)
    assert r.returncode == 1
    err = lines(r.stderr)
    assert len(err) == 1 and err[0].startswith(f"{cfg}: [outbox.main] "), err
    assert secret not in r.stdout + r.stderr


# ============================================================================ 2. init, schema
def _schema_snapshot(db, schema="outbox"):
    rels = psql_rows(db, "select c.relname, c.relkind from pg_class c join pg_namespace n "
                         "on n.oid = c.relnamespace where n.nspname = %s order by 1", (schema,))
    trg = psql_rows(db, "select t.tgname, c.relname from pg_trigger t join pg_class c on "
                        "c.oid = t.tgrelid join pg_namespace n on n.oid = c.relnamespace "
                        "where n.nspname = %s and not t.tgisinternal order by 1", (schema,))
    idx = psql_rows(db, "select indexname, tablename, indexdef from pg_indexes "
                        "where schemaname = %s order by 1", (schema,))
    return rels, trg, idx


def test_init_twice_is_idempotent(services, pgdb, relay_bin, tmp_path):
    cfg = write_config(tmp_path / "init.ini", services, pgdb)
    r1 = init(relay_bin, cfg)
    assert "outbox.main" in r1.stdout and pgdb.name in r1.stdout, r1.stdout
    snap1 = _schema_snapshot(pgdb)
    # a row in between: a second init must keep data
    run_producer(pathlib.Path(relay_bin).parent, pgdb.dsn, pgdb.name, count=3, keys=1)
    r2 = init(relay_bin, cfg)
    assert r2.stderr == ""
    snap2 = _schema_snapshot(pgdb)
    assert snap1 == snap2, "second init changed the schema"
    rels, trg, idx = snap2
    tables = [n for n, k in rels if k == "r"]
    assert tables == ["messages", "messages_dead", "messages_lease"], rels
    assert len(trg) == 1 and trg[0][1] == "messages", trg
    names = {n for n, _, _ in idx}
    for want in ("messages_pkey", "messages_message_id_key", "messages_pending_idx",
                 "messages_failing_idx", "messages_sent_idx", "messages_dead_pkey",
                 "messages_dead_dead_at_idx", "messages_key_idx", "messages_lease_pkey"):
        assert want in names, (want, names)
    assert psql_rows(pgdb, "select count(*) from outbox.messages")[0][0] == 3
    fn = psql_rows(pgdb, "select count(*) from pg_proc p join pg_namespace n on "
                         "n.oid = p.pronamespace where n.nspname = 'outbox'")[0][0]
    assert fn == 1


def test_init_custom_table_and_two_outboxes(services, pgdb, relay_bin, tmp_path):
    base = {"source": "postgres", "conninfo": pgdb.dsn, "database": pgdb.name, "sink": "main"}
    cfg = write_config(tmp_path / "two.ini", services, pgdb, outboxes={
        "orders": dict(base, table="billing.orders_out"),
        "jobs": dict(base, table="jobs_out")})
    r = init(relay_bin, cfg)
    assert len(lines(r.stdout)) == 2, r.stdout
    init(relay_bin, cfg)
    got = {(s, t) for s, t in psql_rows(
        pgdb, "select table_schema, table_name from information_schema.tables "
              "where table_schema in ('billing', 'outbox')")}
    assert got == {("billing", "orders_out"), ("billing", "orders_out_dead"),
                   ("billing", "orders_out_lease"), ("outbox", "jobs_out"),
                   ("outbox", "jobs_out_dead"), ("outbox", "jobs_out_lease")}, got
    r = cli(relay_bin, "check", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert "2 outbox" in r.stdout


def test_init_unreachable_database_fails(services, pgdb, relay_bin, tmp_path):
    dsn = f"host=127.0.0.1 port={free_port()} user=postgres dbname={pgdb.name} connect_timeout=3"
    cfg = write_config(tmp_path / "down.ini", services, pgdb, conninfo=dsn)
    r = cli(relay_bin, "init", "-c", cfg)
    assert r.returncode == 1
    err = lines(r.stderr)
    assert len(err) == 1 and "[outbox.main]" in err[0] and "init failed" in err[0], err


def test_schema_postgres_default_and_custom(relay_bin, pgdb):
    r = cli(relay_bin, "schema", "--dialect", "postgres")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for frag in ('CREATE SCHEMA IF NOT EXISTS "outbox"',
                 'CREATE TABLE IF NOT EXISTS "outbox"."messages" (',
                 'CREATE TABLE IF NOT EXISTS "outbox"."messages_dead" (',
                 "message_id     uuid NOT NULL", "payload        bytea NOT NULL",
                 "headers        jsonb NULL", "sent_at        timestamptz NULL",
                 "pg_notify('outbox_relay', 'outbox.messages')", "CREATE TRIGGER"):
        assert frag in out, frag
    r2 = cli(relay_bin, "schema", "--dialect", "postgres", "--table", "outbox.messages")
    assert r2.returncode == 0 and r2.stdout == out

    r = cli(relay_bin, "schema", "--table", "Billing.Events_1", "--dialect", "postgres")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert 'CREATE TABLE IF NOT EXISTS "Billing"."Events_1" (' in out
    assert 'CREATE TABLE IF NOT EXISTS "Billing"."Events_1_dead" (' in out
    assert "pg_notify('outbox_relay', 'Billing.Events_1')" in out
    assert '"outbox"' not in out
    # the printed script is valid SQL, twice (idempotent), and creates what it says
    pgdb.psql(out)
    pgdb.psql(out)
    got = {t for (t,) in psql_rows(pgdb, "select table_name from information_schema.tables "
                                         "where table_schema = 'Billing'")}
    assert got == {"Events_1", "Events_1_dead", "Events_1_lease"}


def test_schema_sqlserver(relay_bin):
    r = cli(relay_bin, "schema", "--dialect", "sqlserver", "--table", "app.outbox_msgs")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for frag in ("IF SCHEMA_ID(N'app') IS NULL EXEC(N'CREATE SCHEMA [app]')",
                 "CREATE TABLE [app].[outbox_msgs] (", "CREATE TABLE [app].[outbox_msgs_dead] (",
                 "bigint IDENTITY(1,1)", "uniqueidentifier", "varbinary(max)", "datetime2",
                 "SYSUTCDATETIME()"):
        assert frag in out, frag
    assert re.search(r"^GO$", out, re.M), "T-SQL batches are separated by GO lines"
    assert '"' not in out.replace("\\\"", ""), "no PostgreSQL quoting in T-SQL"
    assert "jsonb" not in out and "bytea" not in out


@pytest.mark.parametrize("args,want", [
    (["--dialect", "oracle"], r"--dialect must be postgres or sqlserver"),
    ([], r"--dialect must be postgres or sqlserver"),
    (["--dialect", "postgres", "--table", "a;drop"], r"--table: invalid outbox table name.*';'"),
    (["--dialect", "sqlserver", "--table", "a.b.c"], r"--table: invalid outbox table name.*more than two parts"),
    (["--dialect", "postgres", "--table", 'x"."y'], r"--table: invalid outbox table name"),
    (["--dialect", "postgres", "--table", "1abc"], r"--table: invalid outbox table name.*digit"),
    (["--dialect", "postgres", "extra"], r"unexpected argument"),
], ids=["oracle", "no-dialect", "semicolon", "three-parts", "quote", "digit", "extra-arg"])
def test_schema_bad_input(relay_bin, args, want):
    r = cli(relay_bin, "schema", *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    err = lines(r.stderr)
    assert len(err) == 1, err
    assert err[0].startswith("outbox-relay schema: "), err[0]
    assert re.search(want, err[0]), err[0]


# ============================================================================ 3. stats, dead
def parse_stats(text):
    out = lines(text)
    assert out and out[0].split() == ["OUTBOX", "TABLE", "BACKLOG", "OLDEST_PENDING_S", "DEAD",
                                      "SENT_KEPT"], out
    rows = {}
    for ln in out[1:]:
        f = ln.split()
        assert len(f) == 6, ln
        rows[f[0]] = {"table": f[1], "backlog": int(f[2]), "oldest": float(f[3]),
                      "dead": int(f[4]), "sent_kept": int(f[5])}
    return rows


def test_stats_counts(services, pgdb, relay_bin, build, tmp_path):
    base = {"source": "postgres", "conninfo": pgdb.dsn, "database": pgdb.name, "sink": "main"}
    cfg = write_config(tmp_path / "stats.ini", services, pgdb, outboxes={
        "main": dict(base, table="outbox.messages"),
        "other": dict(base, table="outbox.other")})
    init(relay_bin, cfg)
    r = cli(relay_bin, "stats", "-c", cfg)
    assert r.returncode == 0, r.stderr
    s = parse_stats(r.stdout)
    assert s == {"main": {"table": "outbox.messages", "backlog": 0, "oldest": 0.0, "dead": 0,
                          "sent_kept": 0},
                 "other": {"table": "outbox.other", "backlog": 0, "oldest": 0.0, "dead": 0,
                           "sent_kept": 0}}, s

    run_producer(build, pgdb.dsn, pgdb.name, count=37, keys=3)
    run_producer(build, pgdb.dsn, pgdb.name, count=5, keys=0, table="outbox.other")
    with pgdb.connect() as c:
        ids = [i for (i,) in c.execute("select id from outbox.messages order by id").fetchall()]
        c.execute("update outbox.messages set sent_at = now() where id = any(%s)", (ids[:7],))
        c.execute("update outbox.messages set created_at = now() - interval '1 hour', "
                  "available_at = now() - interval '1 hour' where id = %s", (ids[10],))
        # scheduled an hour ahead: not waiting yet, counted in neither column
        c.execute("update outbox.messages set created_at = now() - interval '2 hours', "
                  "available_at = now() + interval '1 hour' where id = %s", (ids[11],))
    for i in range(3):
        insert_dead(pgdb, 5000 + i)
    insert_dead(pgdb, 6000, table="outbox.other_dead")
    insert_dead(pgdb, 6001, table="outbox.other_dead")

    r = cli(relay_bin, "stats", "-c", cfg)
    assert r.returncode == 0, r.stderr
    s = parse_stats(r.stdout)
    m, o = s["main"], s["other"]
    assert (m["backlog"], m["dead"], m["sent_kept"]) == (29, 3, 7), s
    assert 3590 <= m["oldest"] <= 3700, s
    assert (o["backlog"], o["dead"], o["sent_kept"]) == (5, 2, 0), s
    assert 0 <= o["oldest"] < 120, s


def test_stats_database_down_fails(services, pgdb, relay_bin, tmp_path):
    dsn = f"host=127.0.0.1 port={free_port()} user=postgres dbname={pgdb.name} connect_timeout=3"
    cfg = write_config(tmp_path / "down.ini", services, pgdb, conninfo=dsn)
    r = cli(relay_bin, "stats", "-c", cfg)
    assert r.returncode == 1
    assert any("[outbox.main]" in ln for ln in lines(r.stderr)), r.stderr


@pytest.fixture
def dead_setup(services, pgdb, relay_bin, tmp_path):
    base = {"source": "postgres", "conninfo": pgdb.dsn, "database": pgdb.name, "sink": "main"}
    cfg = write_config(tmp_path / "dead.ini", services, pgdb, outboxes={
        "main": dict(base, table="outbox.messages"),
        "other": dict(base, table="outbox.other")})
    init(relay_bin, cfg)
    mids = {1001: insert_dead(pgdb, 1001, reason="unroutable: NO_ROUTE"),
            1002: insert_dead(pgdb, 1002, reason="line one\nline\ttwo\r\\end", attempts=3),
            1003: insert_dead(pgdb, 1003, reason="malformed headers")}
    mids[2001] = insert_dead(pgdb, 2001, reason="too big", table="outbox.other_dead")
    return cfg, mids


def _dead_sections(text):
    """`dead list` output → {outbox: [fields, ...]}."""
    out, cur = {}, None
    for ln in text.splitlines():
        m = re.match(r"^# outbox\.(\S+) \((\S+)\)$", ln)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        assert cur is not None, f"row before a section header: {ln!r}"
        f = ln.split("\t")
        assert len(f) == 7, f"expected 7 tab-separated fields: {ln!r}"
        out[cur].append(f)
    return out


def test_dead_list(dead_setup, relay_bin):
    cfg, mids = dead_setup
    r = cli(relay_bin, "dead", "-c", cfg, "list")
    assert r.returncode == 0, r.stderr
    secs = _dead_sections(r.stdout)
    assert set(secs) == {"main", "other"}
    main = {int(f[0]): f for f in secs["main"]}
    assert set(main) == {1001, 1002, 1003}
    # id, message_id, exchange, routing_key, attempts, dead_at, reason
    f = main[1002]
    assert f[1] == mids[1002] and f[2] == "" and f[3] == "q" and f[4] == "3", f
    assert re.match(r"^\d{4}-\d\d-\d\d", f[5]), f
    assert f[6] == "line one\\nline\\ttwo\\r\\\\end", "escaped: one line per row"
    assert [int(x[0]) for x in secs["other"]] == [2001]

    r = cli(relay_bin, "dead", "list", "-c", cfg, "--outbox", "other")  # options after the verb
    assert r.returncode == 0, r.stderr
    secs = _dead_sections(r.stdout)
    assert list(secs) == ["other"] and secs["other"][0][6] == "too big"


def test_dead_retry_and_purge(dead_setup, relay_bin, pgdb):
    cfg, mids = dead_setup

    def dead_ids(table="outbox.messages_dead"):
        return sorted(i for (i,) in psql_rows(pgdb, f"select id from {table}"))

    r = cli(relay_bin, "dead", "-c", cfg, "retry", "--outbox", "main", "1002")
    assert r.returncode == 0, r.stderr
    assert "outbox.main: 1 dead row(s) moved back to outbox.messages" in r.stdout, r.stdout
    assert dead_ids() == [1001, 1003]
    back = psql_rows(pgdb, "select id, message_id::text, attempts, sent_at, lease_token, "
                           "routing_key, payload from outbox.messages")
    assert len(back) == 1, back
    assert back[0][:6] == (1002, mids[1002], 0, None, None, "q"), back
    assert bytes(back[0][6]) == b"dead-1002"

    # an id that matches no dead row (mistyped) fails the command, the others are done; an
    # id given twice counts once
    r = cli(relay_bin, "dead", "-c", cfg, "purge", "-o", "main", "1001", "99999", "1001")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "outbox.main: 1 dead row(s) purged" in r.stdout, r.stdout
    assert "dead purge: 1 of the 2 ids given matched no dead row" in r.stderr, r.stderr
    assert dead_ids() == [1003]
    assert dead_ids("outbox.other_dead") == [2001]

    # without ids: every row, of every outbox
    r = cli(relay_bin, "dead", "-c", cfg, "purge", "--outbox", "main")
    assert r.returncode == 0 and "1 dead row(s) purged" in r.stdout, r.stdout + r.stderr
    assert dead_ids() == [] and dead_ids("outbox.other_dead") == [2001]
    r = cli(relay_bin, "dead", "-c", cfg, "retry")
    assert r.returncode == 0, r.stderr
    assert "outbox.main: 0 dead row(s)" in r.stdout and "outbox.other: 1 dead row(s)" in r.stdout
    assert dead_ids("outbox.other_dead") == []
    assert psql_rows(pgdb, "select id, message_id::text from outbox.other") == [(2001, mids[2001])]


@pytest.mark.parametrize("args,rc,want", [
    (["frobnicate"], 2, r'unknown action "frobnicate"'),
    ([], 2, r"expected list, retry or purge"),
    (["list", "5"], 2, r"list: takes no ids"),
    (["retry", "abc"], 2, r'"abc" is not a row id'),
    (["purge", "0"], 2, r'"0" is not a row id'),
    (["purge", "-o", "nope"], 1, r"no \[outbox\.nope\] section"),
], ids=["unknown-action", "no-action", "list-ids", "bad-id", "zero-id", "unknown-outbox"])
def test_dead_bad_usage(dead_setup, relay_bin, pgdb, args, rc, want):
    cfg, _ = dead_setup
    r = cli(relay_bin, "dead", "-c", cfg, *args)
    assert r.returncode == rc, (r.returncode, r.stdout, r.stderr)
    assert re.search(want, r.stderr), r.stderr
    assert psql_rows(pgdb, "select count(*) from outbox.messages_dead")[0][0] == 3, "nothing changed"


def test_dead_without_config(relay_bin):
    r = cli(relay_bin, "dead", "list")
    assert r.returncode == 2
    assert "missing -c FILE" in r.stderr


# ============================================================================ 4. usage
COMMANDS = ("run", "check", "schema", "init", "stats", "dead")


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help(relay_bin, flag):
    r = cli(relay_bin, flag)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    for c in COMMANDS:
        assert re.search(rf"^\s+{c}\b", r.stdout, re.M), f"--help does not list {c}"
    for w in ("--help", "--version", "-c FILE", "--dialect", "list|retry|purge"):
        assert w in r.stdout, w


def test_command_help_option(relay_bin):
    r = cli(relay_bin, "check", "--help")
    assert r.returncode == 0 and "usage:" in r.stdout


def test_version(relay_bin):
    want = re.search(r"^VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    for flag in ("--version", "-V"):
        r = cli(relay_bin, flag)
        assert r.returncode == 0, r.stderr
        assert r.stdout == f"outbox-relay {want}\n", r.stdout


@pytest.mark.parametrize("args,want", [
    (["frobnicate"], r'unknown command "frobnicate"'),
    (["frobnicate", "-c", "x.ini"], r'unknown command "frobnicate"'),
    ([], r"usage:"),
    (["run"], r"missing -c FILE"),
    (["check"], r"missing -c FILE"),
    (["init"], r"missing -c FILE"),
    (["stats"], r"missing -c FILE"),
    (["run", "-c"], r"requires an argument|usage:"),
    (["run", "-x"], r"invalid option|usage:"),
    (["run", "-c", "a.ini", "extra"], r'unexpected argument "extra"'),
], ids=["unknown", "unknown-with-c", "nothing", "run", "check", "init", "stats",
        "c-no-arg", "bad-option", "extra"])
def test_usage_errors(relay_bin, args, want):
    r = cli(relay_bin, *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    assert re.search(want, r.stderr), r.stderr


def test_run_bad_config_exits_2(relay_bin):
    path = ROOT / "config" / "bad" / "bad_mode.ini"
    r = cli(relay_bin, "run", "-c", path, timeout=30)
    assert r.returncode == 2
    assert len(lines(r.stderr)) == 1 and "[outbox.orders] mode" in r.stderr


# ============================================================================ 5. HTTP
METRIC_RE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
    r'(?:\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*)?\})?'
    r' (?P<value>[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+|NaN|Inf|\+Inf|-Inf))$')
TYPE_RE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$")
HELP_RE = re.compile(r"^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .*$")


def parse_metrics(text):
    """Strict-enough Prometheus text format 0.0.4 parser → (types, samples) where samples is
    a list of (name, {label: value}, float)."""
    assert text.endswith("\n"), "exposition must end with a newline"
    types, samples = {}, []
    for ln in text.split("\n")[:-1]:
        if ln.startswith("#"):
            m = TYPE_RE.match(ln)
            if m:
                assert m.group(1) not in types, f"TYPE twice for {m.group(1)}"
                types[m.group(1)] = m.group(2)
            else:
                assert HELP_RE.match(ln) or ln.startswith("# "), f"bad comment line {ln!r}"
            continue
        m = METRIC_RE.match(ln)
        assert m, f"not a Prometheus sample line: {ln!r}"
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m["labels"] or ""))
        samples.append((m["name"], labels, float(m["value"].replace("Inf", "inf"))))
    # every sample belongs to a declared family
    for name, _, _ in samples:
        fam = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or (fam in types and types[fam] == "histogram"), \
            f"sample {name} without a TYPE line"
    return types, samples


def sample(samples, name, **labels):
    vals = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert len(vals) == 1, f"{name}{labels}: {len(vals)} samples"
    return vals[0]


def test_http_probes_and_metrics(services, pgdb, relay_bin, build, tmp_path):
    q = f"qhttp-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    cfg, port = relay_with_http(relay_bin, tmp_path, services, pgdb)
    init(relay_bin, cfg)
    insert_dead(pgdb, 900001)
    insert_dead(pgdb, 900002)
    r = Relay(relay_bin, cfg, tmp_path / "r1.log", http_port=port)
    try:
        wait_http_up(r)
        wait_for(lambda: http_status(port, "/readyz") == 200, 20, desc="/readyz 200",
                 ignore=(OSError,))
        st, hdr, body = http_get(port, "/healthz")
        assert st == 200
        st, hdr, body = http_get(port, "/metrics")
        assert st == 200 and hdr["content-type"].startswith("text/plain"), hdr
        assert "version=0.0.4" in hdr["content-type"]
        assert int(hdr["content-length"]) == len(body.encode())
        types, s = parse_metrics(body)
        for fam, typ in (("outbox_relay_relayed_total", "counter"),
                         ("outbox_relay_backlog", "gauge"),
                         ("outbox_relay_oldest_pending_age_seconds", "gauge"),
                         ("outbox_relay_dead_rows", "gauge"),
                         ("outbox_relay_confirm_latency_seconds", "histogram"),
                         ("outbox_relay_source_up", "gauge"),
                         ("outbox_relay_sink_up", "gauge"),
                         ("outbox_relay_leader", "gauge")):
            assert types.get(fam) == typ, (fam, types.get(fam))
        assert sample(s, "outbox_relay_relayed_total", outbox="main") == 0
        assert sample(s, "outbox_relay_source_up", outbox="main") == 1
        assert sample(s, "outbox_relay_sink_up", outbox="main") == 1
        wait_for(lambda: r.metric("outbox_relay_leader") == 1, 10, desc="leader gauge")

        # a row due for 100 s that another relay holds (its lease an hour long): backlog 1 and
        # its age; a row its producer scheduled an hour ahead is not waiting yet and counts
        # in neither
        with pgdb.connect() as c:
            c.execute("insert into outbox.messages (message_id, routing_key, payload, created_at, "
                      "available_at, lease_owner, lease_token, lease_until) values "
                      "(gen_random_uuid(), %s, 'later', now() - interval '100 seconds', "
                      "now() - interval '100 seconds', 'other', 1, now() + interval '1 hour')",
                      (q,))
            c.execute("insert into outbox.messages (message_id, routing_key, payload, created_at, "
                      "available_at) values (gen_random_uuid(), %s, 'scheduled', "
                      "now() - interval '1000 seconds', now() + interval '1 hour')", (q,))
        n = 250
        run_producer(build, pgdb.dsn, pgdb.name, count=n, keys=10, routing_key=q)
        got = consume(ch, q, n, timeout=60, idle=0.5)
        assert len(got) == n
        wait_for(lambda: r.metric("outbox_relay_relayed_total") == n, 15,
                 desc=f"relayed_total == {n}")
        # gauges come from the periodic stats query
        wait_for(lambda: r.metric("outbox_relay_backlog") == 1
                 and r.metric("outbox_relay_dead_rows") == 2, 15, desc="backlog 1, dead_rows 2")
        types, s = parse_metrics(r.metrics())
        assert sample(s, "outbox_relay_relayed_total", outbox="main") == n
        age = sample(s, "outbox_relay_oldest_pending_age_seconds", outbox="main")
        assert 100 <= age < 200, age
        # the confirm latency histogram: cumulative buckets, +Inf == count == messages confirmed
        buckets = [(lab["le"], v) for nm, lab, v in s
                   if nm == "outbox_relay_confirm_latency_seconds_bucket" and lab["outbox"] == "main"]
        assert len(buckets) >= 5 and buckets[-1][0] == "+Inf", buckets
        les = [float(le.replace("+Inf", "inf")) for le, _ in buckets]
        assert les == sorted(les)
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), "buckets must be cumulative"
        assert counts[-1] == sample(s, "outbox_relay_confirm_latency_seconds_count", outbox="main") == n
        assert sample(s, "outbox_relay_confirm_latency_seconds_sum", outbox="main") > 0

        for path in ("/", "/metricsx", "/healthz/x", "/favicon.ico"):
            assert http_status(port, path) == 404, path
        assert http_status(port, "/metrics?x=1") == 200
        assert http_get(port, "/metrics", method="POST")[0] == 405
    finally:
        rc = r.stop()
        conn.close()
    r.assert_clean_exit(rc)


@pytest.mark.parametrize("wrong", ["name_mismatch", "missing_database"])
def test_readyz_503_when_database_wrong(services, pgdb, relay_bin, tmp_path, wrong):
    good = write_config(tmp_path / "good.ini", services, pgdb)
    init(relay_bin, good)
    if wrong == "name_mismatch":
        kw = {"database": pgdb.name + "_other"}
    else:
        missing = pgdb.name + "_nx"
        kw = {"conninfo": pgdb.dsn.replace(f"dbname={pgdb.name}", f"dbname={missing}"),
              "database": missing}
    cfg, port = relay_with_http(relay_bin, tmp_path, services, pgdb, **kw)
    r = Relay(relay_bin, cfg, tmp_path / "r1.log", http_port=port)
    try:
        wait_http_up(r)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            assert http_status(port, "/readyz") == 503, "relay became ready with a wrong database"
            assert http_status(port, "/healthz") == 200
            time.sleep(0.2)
        _, s = parse_metrics(r.metrics())
        assert sample(s, "outbox_relay_source_up", outbox="main") == 0
        assert sample(s, "outbox_relay_relayed_total", outbox="main") == 0
    finally:
        rc = r.stop()
    r.assert_clean_exit(rc)


def test_http_listen_port_in_use(services, pgdb, relay_bin, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        cfg = write_config(tmp_path / "busy.ini", services, pgdb,
                           relay={"http_listen": f"127.0.0.1:{port}"})
        r = cli(relay_bin, "run", "-c", cfg, timeout=30)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert re.search(rf"http_listen .*{port}.*(in use|Address)", r.stderr), r.stderr


# ============================================================================ 6. logs
@pytest.fixture
def broker_user(services):
    """A broker user with a distinctive password (guest:guest would hide a leak)."""
    user = "cli_" + secrets.token_hex(4)
    pw = "Br0ker-s3cr3t-" + secrets.token_hex(6)
    r = services.add_broker_user(user, pw)
    assert r.returncode == 0, r.stdout + r.stderr
    yield user, pw
    services.rabbitmqctl_later("delete_user", user)


TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def assert_json_lines(text, forbidden):
    out = text.splitlines()
    assert out, "no log output"
    levels = set()
    for ln in out:
        try:
            obj = json.loads(ln)
        except ValueError:
            raise AssertionError(f"not a JSON line: {ln!r}") from None
        assert isinstance(obj, dict), ln
        assert {"ts", "level", "msg"} <= set(obj), ln
        assert TS_RE.match(obj["ts"]), ln
        assert obj["level"] in ("error", "warn", "info", "debug"), ln
        assert isinstance(obj["msg"], str) and obj["msg"], ln
        levels.add(obj["level"])
    for s in forbidden:
        assert s not in text, f"secret {s!r} appears in the log"
    return levels


def test_json_logs_without_secrets(services, pgdb, relay_bin, build, tmp_path, broker_user):
    user, bpw = broker_user
    dbpw = "s3cr3t-value-" + secrets.token_hex(4)
    q = f"qjson-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    url = f"amqp://{user}:{bpw}@127.0.0.1:{services.amqp_port}/%2f"
    # debug: secrets must stay out of every line, the debug ones included
    cfg = write_config(tmp_path / "json.ini", services, pgdb,
                       relay={"log_format": "json", "log_level": "debug"}, sink={"url": url},
                       conninfo=pgdb.dsn + f" password={dbpw}")
    init(relay_bin, cfg)
    r = cli(relay_bin, "check", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert bpw not in r.stdout + r.stderr and dbpw not in r.stdout + r.stderr

    relay = Relay(relay_bin, cfg, tmp_path / "json.log")
    try:
        relay.wait_log("became the active relay")
        run_producer(build, pgdb.dsn, pgdb.name, count=20, keys=2, routing_key=q)
        assert len(consume(ch, q, 20, timeout=30)) == 20
        # a failing publish logs too (no exchange → channel closed by the broker)
        with pgdb.connect() as c:
            c.execute("insert into outbox.messages (message_id, exchange, routing_key, payload) "
                      "values (gen_random_uuid(), 'no-such-exchange-x', 'k', 'x')")
        wait_log_at(relay, "no-such-exchange-x|NOT_FOUND|404", timeout=20)
    finally:
        rc = relay.stop()
        conn.close()
    relay.assert_clean_exit(rc)
    levels = assert_json_lines(relay.text(), [bpw, dbpw])
    assert {"info", "warn"} <= levels, levels

    # connection failures (wrong broker password, database down) are logged without secrets
    wrong = "Wr0ng-s3cr3t-" + secrets.token_hex(4)
    dsn = f"host=127.0.0.1 port={free_port()} user=postgres dbname={pgdb.name} " \
          f"password={dbpw} connect_timeout=2"
    cfg2 = write_config(tmp_path / "json2.ini", services, pgdb,   # debug: as above
                        relay={"log_format": "json", "log_level": "debug"},
                        sink={"url": f"amqp://{user}:{wrong}@127.0.0.1:{services.amqp_port}/%2f"},
                        conninfo=dsn)
    relay = Relay(relay_bin, cfg2, tmp_path / "json2.log")
    try:
        wait_log_at(relay, r"sink=main: down: .*login refused \(ACCESS_REFUSED", timeout=20)
        wait_log_at(relay, r"database unavailable \(main connection\): 127\.0\.0\.1:\d+/",
                    timeout=20)
    finally:
        rc = relay.stop()
    relay.assert_clean_exit(rc)
    levels = assert_json_lines(relay.text(), [wrong, dbpw, bpw])
    assert levels & {"warn", "error"}



def json_objs(relay):
    """Every line of a relay's JSON log, parsed (a line that is not JSON fails here)."""
    return [json.loads(ln) for ln in relay.text().splitlines()]


def wait_json(relay, pred, desc, timeout=20):
    """The first JSON log line (a dict) for which pred holds, waiting for it."""
    def find():
        try:
            objs = json_objs(relay)
        except ValueError:   # a line being written: read again
            return None
        return next((o for o in objs if pred(o)), None)
    try:
        return wait_for(find, timeout * SLOW, desc=desc)
    except AssertionError:
        raise AssertionError(f"no JSON line with {desc}; log:\n{relay.text()[-4000:]}") from None


def test_json_log_fields(services, pgdb, relay_bin, tmp_path):
    """JSON lines carry fields besides "msg" (README, Observability): a poison row that is
    dead-lettered names event, outbox, id, message_id, partition_key and error; a failed
    attempt is event "retry"; a broker or a database that is down names event, peer and
    error. Values are escaped (quote, backslash, control characters in a partition key),
    empty fields are left out, and every line is one JSON object."""
    key = 'k"q\\b\t\x01 caf\u00e9'
    cfg = write_config(tmp_path / "fields.ini", services, pgdb, relay={"log_format": "json"})
    init(relay_bin, cfg)
    relay = Relay(relay_bin, cfg, tmp_path / "fields.log")
    try:
        wait_json(relay, lambda o: o.get("event") == "became_leader", "event became_leader")
        with pgdb.connect() as c:
            # nested headers (not a flat JSON object): unpublishable, dead-lettered at once
            poison_id, poison_mid = c.execute(
                "insert into outbox.messages (exchange, routing_key, partition_key, headers, "
                "payload) values ('', 'q', %s, %s, 'x') returning id, message_id::text",
                (key, '{"a": {"b": 1}}')).fetchone()
            # a missing exchange: a failed attempt, retried (max_attempts = 3)
            retry_id, retry_mid = c.execute(
                "insert into outbox.messages (exchange, routing_key, payload) values "
                "('no-such-exchange-fields', 'k', 'x') returning id, message_id::text").fetchone()
        dead = wait_json(relay, lambda o: o.get("event") == "dead_lettered"
                         and o.get("id") == poison_id, f"event dead_lettered, id {poison_id}")
        retry = wait_json(relay, lambda o: o.get("event") == "retry" and o.get("id") == retry_id,
                          f"event retry, id {retry_id}")
    finally:
        rc = relay.stop()
    relay.assert_clean_exit(rc)
    print(json.dumps(dead), json.dumps(retry), sep="\n")
    assert dead["level"] == "error"
    assert dead["outbox"] == "main" and dead["message_id"] == poison_mid, dead
    assert dead["partition_key"] == key, dead
    assert re.search(r"header", dead["error"]) and dead["error"] in dead["msg"], dead
    assert f"id={poison_id} message_id={poison_mid}: dead-lettered: " in dead["msg"], dead
    assert retry["level"] == "warn" and retry["message_id"] == retry_mid, retry
    assert "partition_key" not in retry, "an empty field is left out: " + json.dumps(retry)
    assert re.search(r"no-such-exchange-fields|NOT_FOUND|404", retry["error"]), retry
    objs = json_objs(relay)
    assert_json_lines(relay.text(), [])
    events = {o.get("event") for o in objs}
    assert {"starting", "broker_connected", "database_connected", "became_leader", "retry",
            "dead_lettered", "stopping", "drained", "stopped"} <= events, events
    connected = next(o for o in objs if o.get("event") == "broker_connected")
    assert connected["peer"].endswith(f":{services.amqp_port} vhost /"), connected
    assert connected["outbox"] == "main" and connected["sink"] == "main", connected
    db = next(o for o in objs if o.get("event") == "database_connected")
    assert re.fullmatch(rf".+:\d+/{re.escape(pgdb.name)}", db["peer"]), db
    for o in objs:
        for k, v in o.items():
            assert v not in ("", None), f"empty field {k!r} in {o}"

    # a broker and a database that are down: event, peer and the reason
    bport, dport = free_port(), free_port()
    cfg2 = write_config(tmp_path / "fields2.ini", services, pgdb, relay={"log_format": "json"},
                        sink={"url": f"amqp://guest:guest@127.0.0.1:{bport}/%2f"},
                        conninfo=f"host=127.0.0.1 port={dport} user=postgres "
                                 f"dbname={pgdb.name} connect_timeout=2")
    relay = Relay(relay_bin, cfg2, tmp_path / "fields2.log")
    try:
        broker = wait_json(relay, lambda o: o.get("event") == "broker_unavailable",
                           "event broker_unavailable")
        dbdown = wait_json(relay, lambda o: o.get("event") == "database_unavailable",
                           "event database_unavailable")
    finally:
        rc = relay.stop()
    relay.assert_clean_exit(rc)
    print(json.dumps(broker), json.dumps(dbdown), sep="\n")
    assert broker["level"] in ("warn", "error") and broker["outbox"] == "main", broker
    assert broker["peer"] == f"127.0.0.1:{bport} vhost /", broker
    assert re.search(r"connection refused", broker["error"]), broker
    assert not broker["error"].startswith("broker "), "the peer is a field: " + broker["error"]
    assert dbdown["level"] in ("warn", "error") and dbdown["outbox"] == "main", dbdown
    assert dbdown["peer"] == f"127.0.0.1:{dport}/{pgdb.name}", dbdown
    assert dbdown["error"] and dbdown["error"] in dbdown["msg"], dbdown
    assert_json_lines(relay.text(), [])


def test_readme_lists_every_log_event():
    """Every event name the daemon's sources log (`.event = "..."`, relay/log.h) is in the
    README's event table, and the table names no event the sources do not log."""
    used = set()
    for f in [*ROOT.glob("relay/*.c"), *ROOT.glob("sources/**/*.c"), *ROOT.glob("sinks/**/*.c")]:
        for m in re.finditer(r"\.event\s*=\s*([^,}]+)", f.read_text()):
            used |= set(re.findall(r'"([a-z_]+)"', m.group(1)))
    assert {"dead_lettered", "retry", "broker_unavailable", "database_unavailable"} <= used, used
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("### Structured logs"):readme.index("### TLS to RabbitMQ")]
    table = table[table.index("| event | level |"):]
    listed = {name for row in table.splitlines() if row.startswith("| `")
              for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert used == listed, f"logged, not in README: {used - listed}; " \
                           f"in README, not logged: {listed - used}"

def test_text_log_format(services, pgdb, relay_bin, tmp_path):
    """Text lines "TS LEVEL msg"; log_level = info hides debug lines. Nothing listens where
    the broker should be, so the relay repeats one failure: the first at WARN, the repeats
    at DEBUG (relay/log.c). At info only the WARN shows; at debug (the control) the repeats
    do too, so the "no DEBUG at info" check cannot pass for want of debug lines."""
    sink = {"url": f"amqp://guest:guest@127.0.0.1:{free_port()}/%2f", "reconnect_max": "200ms"}
    texts = {}
    for level in ("info", "debug"):
        cfg = write_config(tmp_path / f"text-{level}.ini", services, pgdb,
                           relay={"log_level": level}, sink=sink)
        if level == "info":
            init(relay_bin, cfg)
        relay = Relay(relay_bin, cfg, tmp_path / f"text-{level}.log")
        try:
            relay.wait_log("became the active relay")
            wait_log_at(relay, r"sink=main: down: .*connection refused")
            time.sleep(1.5)   # several more refusals, 200 ms apart
        finally:
            rc = relay.stop()
        relay.assert_clean_exit(rc)
        texts[level] = relay.text()
    for ln in texts["info"].splitlines():
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (ERROR|WARN|INFO) \S", ln), ln
    assert "DEBUG" not in texts["info"], "log_level = info must hide debug lines"
    repeats = [ln for ln in texts["debug"].splitlines()
               if re.match(r"^\S+Z DEBUG .*sink=main: down: ", ln)]
    assert len(repeats) >= 2, "control: at debug the repeated refusals show:\n" + texts["debug"]


def test_log_file_reopened_on_sighup(services, pgdb, relay_bin, build, tmp_path):
    q = f"qhup-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    logf = tmp_path / "relay.log"
    cfg = write_config(tmp_path / "hup.ini", services, pgdb, relay={"log_file": str(logf)})
    init(relay_bin, cfg)
    relay = Relay(relay_bin, cfg, tmp_path / "stderr.log")
    try:
        wait_for(lambda: "became the active relay" in logf.read_text(), 20,
                 desc="startup lines in log_file", ignore=(FileNotFoundError,))
        rotated = tmp_path / "relay.log.1"
        os.rename(logf, rotated)
        relay.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: log reopened" in logf.read_text(), 10,
                 desc="fresh log file", ignore=(FileNotFoundError,))
        old_size = rotated.stat().st_size
        run_producer(build, pgdb.dsn, pgdb.name, count=10, keys=1, routing_key=q)
        assert len(consume(ch, q, 10, timeout=30)) == 10
        time.sleep(0.3)
        # a second rotation works too
        logf2 = tmp_path / "relay.log.2"
        os.rename(logf, logf2)
        relay.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: log reopened" in logf.read_text(), 10,
                 desc="second fresh log file", ignore=(FileNotFoundError,))
    finally:
        rc = relay.stop()
        conn.close()
    relay.assert_clean_exit(rc)
    assert rotated.stat().st_size == old_size, "lines went to the renamed file after SIGHUP"
    assert "became the active relay" in rotated.read_text()
    assert "outbox-relay stopped" in logf.read_text()
    assert "outbox-relay stopped" not in logf2.read_text() + rotated.read_text()
    assert logf.stat().st_mode & 0o777 == 0o640
    assert relay.text().strip() == "", "nothing on stderr when log_file is set: " + relay.text()


# ============================================================================ 7. signals
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_signal_while_idle_exits_0(services, pgdb, relay_bin, tmp_path, sig):
    cfg = write_config(tmp_path / "idle.ini", services, pgdb, relay={"shutdown_timeout": "30s"})
    init(relay_bin, cfg)
    relay = Relay(relay_bin, cfg, tmp_path / "idle.log")
    relay.wait_log("became the active relay")
    time.sleep(0.3)
    t0 = time.monotonic()
    rc = relay.stop(sig, timeout=30)
    took = time.monotonic() - t0
    relay.assert_clean_exit(rc)
    assert took < 2.0 * SLOW, \
        f"idle relay took {took:.2f}s to stop"
    assert "outbox-relay stopped" in relay.text()


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_second_signal_exits_at_once(services, pgdb, relay_bin, build, tmp_path, second):
    """The first SIGTERM waits for in-flight work (here a settle stuck behind a table lock);
    a second signal exits at once, non-zero, long before shutdown_timeout."""
    q = f"qsig-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    n = 3000
    cfg, port = relay_with_http(relay_bin, tmp_path, services, pgdb,
                                relay={"shutdown_timeout": "30s"},
                                sink={"publish_window": "1"}, batch_size="20",
                                query_timeout="60s", lease="5s")
    init(relay_bin, cfg)
    run_producer(build, pgdb.dsn, pgdb.name, count=n, keys=10, routing_key=q)
    relay = Relay(relay_bin, cfg, tmp_path / "sig.log", http_port=port)
    locker = pgdb.connect(autocommit=False)
    try:
        wait_for(lambda: psql_rows(pgdb, "select count(*) from outbox.messages "
                                         "where sent_at is not null")[0][0] >= 50, 30,
                 desc="drain under way")
        # the database stalls: settles and claims block (SHARE conflicts with row updates)
        locker.execute("lock table outbox.messages in share mode")
        time.sleep(1.0)
        sent_before = psql_rows(pgdb, "select count(*) from outbox.messages "
                                      "where sent_at is not null")[0][0]
        assert sent_before < n, "the drain finished before the database stalled"
        relay.proc.send_signal(signal.SIGTERM)
        relay.wait_log("stopping", timeout=5)
        time.sleep(2.0)
        assert relay.proc.poll() is None, \
            "the relay exited while a settle was still outstanding:\n" + relay.text()[-3000:]
        assert http_status(port, "/readyz") == 503, "a stopping relay must not be ready"
        assert http_status(port, "/healthz") == 200
        t0 = time.monotonic()
        relay.proc.send_signal(second)
        try:
            rc = relay.proc.wait(timeout=5 * SLOW)
        except Exception:  # noqa: BLE001
            rc = None
        took = time.monotonic() - t0
    finally:
        locker.rollback()
        if relay.proc.poll() is None:
            relay.kill9()
        else:
            relay.log.close()
    text = relay.text()
    assert rc is not None, f"still running {5 * SLOW} s after the second signal:\n{text[-3000:]}"
    assert rc not in (0, -second, 128 + second), f"exit code {rc}: expected a non-zero exit"
    assert rc > 0, f"killed by signal {-rc}, not a clean non-zero exit"
    assert took < 3.0 * SLOW, f"second signal: exited after {took:.1f}s"
    assert_log_at(relay, r"second signal: exiting at once")   # WARN: confirms are given up
    assert "ERROR: AddressSanitizer" not in text and "runtime error:" not in text, text[-4000:]

    # nothing was lost: a new relay publishes the rest once the old leases expired (at the
    # default window and batch: the window of 1 above only keeps the first relay's drain
    # slow enough to be stalled mid-way, and one row at a time the rest took ~30 s)
    cfg2, _ = relay_with_http(relay_bin, tmp_path, services, pgdb, name="r2",
                              query_timeout="60s", lease="5s")
    relay2 = Relay(relay_bin, cfg2, tmp_path / "sig2.log")
    try:
        wait_for(lambda: psql_rows(pgdb, "select count(*) from outbox.messages "
                                         "where sent_at is null")[0][0] == 0, 120,
                 desc="every row sent after restart")
        got = consume(ch, q, n, timeout=60, idle=0.5)
    finally:
        rc2 = relay2.stop()
        conn.close()
    relay2.assert_clean_exit(rc2)
    seqs = {int(p.headers["seq"]) for p, _, _ in got}
    assert seqs == set(range(n)), f"{n - len(seqs)} messages missing"


def test_sigusr1_reopens_the_log_only_and_sigusr2_is_ignored(services, pgdb, relay_bin, build,
                                                               tmp_path):
    """A `kill -USR1` (logrotate's postrotate for daemons that reopen their log on it) must
    not end the relay: SIGUSR1 reopens log_file and nothing else (no reload: the file on disk
    is not read again), SIGUSR2 is ignored and said so at WARN. The relay keeps relaying."""
    q = f"qusr-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    logf = tmp_path / "relay.log"
    cfg = write_config(tmp_path / "usr.ini", services, pgdb, relay={"log_file": str(logf)})
    init(relay_bin, cfg)
    relay = Relay(relay_bin, cfg, tmp_path / "stderr.log")

    def alive_and(pred):
        rc = relay.proc.poll()
        assert rc is None, f"the relay exited ({rc}) on a signal it should handle"
        return pred()
    try:
        wait_for(lambda: "became the active relay" in logf.read_text(), 20,
                 desc="startup lines in log_file", ignore=(FileNotFoundError,))
        rotated = tmp_path / "relay.log.1"
        os.rename(logf, rotated)
        relay.proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: alive_and(lambda: "SIGUSR1: log reopened" in logf.read_text()), 10,
                 desc="a fresh log file after SIGUSR1", ignore=(FileNotFoundError,))
        old_size = rotated.stat().st_size
        relay.proc.send_signal(signal.SIGUSR2)
        usr2 = wait_for(lambda: alive_and(lambda: [ln for ln in logf.read_text().splitlines()
                                                    if "SIGUSR2" in ln]), 10,
                        desc="a line naming SIGUSR2")
        run_producer(build, pgdb.dsn, pgdb.name, count=10, keys=1, routing_key=q)
        assert len(consume(ch, q, 10, timeout=30)) == 10
        assert relay.proc.poll() is None
    finally:
        rc = relay.stop()
        conn.close()
    relay.assert_clean_exit(rc)
    text = logf.read_text()
    assert rotated.stat().st_size == old_size, "lines went to the renamed file after SIGUSR1"
    assert "configuration reloaded" not in rotated.read_text() + text, \
        "SIGUSR1 or SIGUSR2 reloaded the configuration"
    assert " WARN " in usr2[0] and "ignored" in usr2[0], usr2
    assert "outbox-relay stopped" in text
    assert relay.text().strip() == "", "nothing on stderr when log_file is set: " + relay.text()


def test_missing_index_of_the_delayed_rows_is_reported(services, pgdb, relay_bin, tmp_path):
    """A table made by an earlier version lacks the index of the delayed rows: the relay
    works (and keeps delayed rows in order, more slowly), and says so at the default level,
    in `check` (a warning, exit 0) and once when it starts; init creates the index."""
    q = f"qidx-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    cfg = write_config(tmp_path / "r.ini", services, pgdb)
    init(relay_bin, cfg)
    idx = '"outbox"."messages_delayed_idx"'
    with pgdb.connect() as c:
        c.execute(f"DROP INDEX {idx}")
        c.execute("INSERT INTO outbox.messages (routing_key, partition_key, payload) "
                  "VALUES (%s, 'k', '\\x01')", (q,))
        c.commit()
    r = cli(relay_bin, "check", "-c", cfg)
    assert r.returncode == 0, r.stdout + r.stderr
    warn = [ln for ln in lines(r.stderr) if "WARNING" in ln]
    assert len(warn) == 1 and f"index {idx} missing" in warn[0] \
        and "run outbox-relay init" in warn[0], r.stderr
    relay = Relay(relay_bin, cfg, tmp_path / "relay.log")
    try:
        assert len(consume(ch, q, 1, timeout=30)) == 1
        wait_log_at(relay, re.escape(f"index {idx} missing"), levels=("WARN",))
    finally:
        relay.assert_clean_exit(relay.stop())
    assert len(re.findall(re.escape(f"index {idx} missing"), relay.text())) == 1, relay.text()
    r = init(relay_bin, cfg)
    assert "messages_delayed_idx" in r.stdout + r.stderr, r.stdout + r.stderr
    r = cli(relay_bin, "check", "-c", cfg)
    assert r.returncode == 0 and "WARNING" not in r.stderr, r.stdout + r.stderr
    ch.queue_delete(q)
    conn.close()
