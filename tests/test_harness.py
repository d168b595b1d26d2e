"""The harness itself works: real PostgreSQL, real RabbitMQ, psqlODBC, helpers."""
import ctypes
import ctypes.util
import subprocess

import pika
import psycopg
import pytest

from conftest import run_prog, tail, wait_for


@pytest.mark.build_independent
def test_pg_select_and_pg_stat_statements(pgdb, services):
    with pgdb.connect() as c:
        assert c.execute("select 1").fetchone() == (1,)
        assert c.execute("select current_database()").fetchone() == (pgdb.name,)
        assert c.execute("show shared_preload_libraries").fetchone()[0] == "pg_stat_statements"
        assert int(c.execute("show max_connections").fetchone()[0]) >= 200
        c.execute("create extension pg_stat_statements")
        c.execute("select count(*) from pg_stat_statements")
    # the private server listens on loopback only, on its own port
    with services.pg_connect() as c:
        assert c.execute("show listen_addresses").fetchone()[0] == "127.0.0.1"
        assert int(c.execute("show port").fetchone()[0]) == services.pg_port != 5432


_INNER_PGDB_TESTS = r"""
import json
import os
import time

OUT = os.environ["PGDB_PROBE_OUT"]
seen = {}


def record(name, value):
    seen[name] = value
    with open(OUT, "w") as f:
        json.dump({k: v for k, v in seen.items() if not k.startswith("_")}, f)


def test_a_fresh_database(pgdb, pgdb2):
    record("a2", pgdb2.name)
    record("a", pgdb.name)
    assert pgdb2.name != pgdb.name
    assert pgdb2.connect().execute("select count(*) from pg_tables where schemaname"
                                   " = 'public'").fetchone() == (0,)
    c = pgdb.connect()
    assert c.execute("select current_database()").fetchone() == (pgdb.name,)
    assert c.execute("select count(*) from pg_class c join pg_namespace n"
                     " on n.oid = c.relnamespace where n.nspname not in"
                     " ('pg_catalog', 'information_schema', 'pg_toast')").fetchone() == (0,)
    c.execute("create table left_behind (x int)")
    tx = pgdb.connect(autocommit=False)      # left inside an open transaction
    tx.execute("select * from left_behind for update")
    seen["_conns"] = [c, tx]


def test_b_fails_with_connections_open(pgdb):
    record("b", pgdb.name)
    c = pgdb.connect()
    assert c.execute("select count(*) from pg_tables where tablename = 'left_behind'"
                     ).fetchone() == (0,), "a database left over from test_a"
    c.execute("select pg_sleep(0)")
    seen["_conns"].append(c)
    raise AssertionError("deliberate failure: teardown must still drop the database")


def test_c_after_teardown(services):
    assert len(seen["_conns"]) == 3   # pgdb2's connection is checked by the DROP below
    assert all(c.closed for c in seen["_conns"]), "pgdb left psycopg connections open"
    with services.pg_connect() as admin:
        left = admin.execute("select datname from pg_database where datname = any(%s)",
                             ([seen["a"], seen["a2"], seen["b"]],)).fetchall()
    assert left == [], f"databases not dropped: {left}"
    # the databases made ahead for later tests: dropped at the end of the session
    import conftest
    if conftest._DB_POOL is not None:
        pool = conftest._DB_POOL
        deadline = time.monotonic() + 60
        while len(pool._ready) < pool.SIZE and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(OUT + ".pool", "w") as f:
            json.dump(list(pool._ready), f)
"""


@pytest.mark.build_independent
def test_pgdb_is_fresh_and_dropped(services, tmp_path):
    """The real pgdb (and pgdb2) fixture, driven by pytest itself in an inner session: each
    use gets a new empty database; at teardown — also of a failing test — its connections
    are closed and its database is dropped (checked inside the session and from outside)."""
    import json
    import os
    import sys
    import xml.etree.ElementTree as ET

    from conftest import ROOT
    (tmp_path / "test_inner_pgdb.py").write_text(_INNER_PGDB_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    out, junit = tmp_path / "names.json", tmp_path / "junit.xml"
    tests_dir = str(ROOT / "tests")
    env = dict(os.environ, PGDB_PROBE_OUT=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [tests_dir,
                                                        os.environ.get("PYTHONPATH")])))
    for k in ("OUTBOX_TEST_SHARE", "OUTBOX_TEST_PARTS"):   # the inner session runs all three
        env.pop(k, None)
    # -p conftest: the harness's tests/conftest.py, loaded as a plugin (fixtures and all)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p",
                        "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"),
                        "--rootdir", str(tmp_path), f"--junitxml={junit}", "-q", "-ra",
                        str(tmp_path / "test_inner_pgdb.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    summary = r.stdout[r.stdout.find("short test summary info"):] if "short test summary info" \
        in r.stdout else r.stdout[-3000:]
    report = f"inner pytest exit {r.returncode}:\n{summary}\n{r.stderr[-2000:]}"
    outcomes = {}   # test name -> [(failure|error|skipped, message)]
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcomes.setdefault(case.get("name"), []).extend(
            (c.tag, c.get("message", "")) for c in case
            if c.tag in ("failure", "error", "skipped"))
    assert set(outcomes) == {"test_a_fresh_database", "test_b_fails_with_connections_open",
                             "test_c_after_teardown"}, report
    assert outcomes["test_a_fresh_database"] == [], report
    assert outcomes["test_c_after_teardown"] == [], report
    b = outcomes["test_b_fails_with_connections_open"]   # its own failure, no teardown error
    assert len(b) == 1 and b[0][0] == "failure" and "deliberate failure" in b[0][1], report
    names = json.loads(out.read_text())
    assert len(set(names.values())) == 3 and all(n.startswith("t_") for n in names.values()), \
        names
    pooled = []   # the ones the session's pool had made ahead (none with OUTBOX_TEST_DB_POOL=0)
    if os.environ.get("OUTBOX_TEST_DB_POOL", "1") != "0":
        with open(f"{out}.pool") as f:
            pooled = json.load(f)
        assert len(pooled) == 2 and all(n.startswith("t_") for n in pooled), pooled
    # from outside: the databases are gone, and so is every session that was on them
    with services.pg_connect() as admin:
        assert admin.execute("select datname from pg_database where datname = any(%s)",
                             (list(names.values()) + pooled,)).fetchall() == []
        assert admin.execute("select pid, datname from pg_stat_activity"
                             " where datname = any(%s)",
                             (list(names.values()),)).fetchall() == []


@pytest.mark.build_independent
def test_psql_helper(pgdb):
    r = pgdb.psql("select 40 + 2", args=("-At",))
    assert r.stdout.strip() == "42"
    with pytest.raises(subprocess.CalledProcessError):
        pgdb.psql("select * from no_such_table")


@pytest.mark.build_independent
def test_rabbitmq_persistent_publish_with_confirms(amqp, services):
    ch = amqp.channel()
    q = "harness-" + services.rabbit_node.split("@")[0]
    ch.queue_delete(q)
    ch.queue_declare(q, durable=True)
    ch.confirm_delivery()
    # mandatory + confirms: an unroutable publish must raise, a routed one must not
    ch.basic_publish("", q, b"hello \x00 world",
                     pika.BasicProperties(delivery_mode=2, message_id="m-1",
                                          content_type="application/octet-stream"),
                     mandatory=True)
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("", q + "-nowhere", b"x", pika.BasicProperties(delivery_mode=2),
                         mandatory=True)
    method, props, body = ch.basic_get(q, auto_ack=True)
    assert method is not None
    assert body == b"hello \x00 world"
    assert props.delivery_mode == 2 and props.message_id == "m-1"
    assert ch.basic_get(q, auto_ack=True)[0] is None
    ch.queue_delete(q)


@pytest.mark.build_independent
def test_rabbitmqctl_reaches_private_node(services, amqp):
    ch = amqp.channel()
    q = "harness-ctl"
    ch.queue_declare(q, durable=False, auto_delete=False)
    r = services.rabbitmqctl("list_queues", "-q", "--no-table-headers", "name")
    assert r.returncode == 0, r.stderr
    assert q in r.stdout.split()
    ch.queue_delete(q)
    r = services.rabbitmqctl("status", "--formatter", "json")
    assert r.returncode == 0, r.stderr
    assert services.rabbit_node.split("@")[0] in r.stdout


@pytest.mark.build_independent
def test_guest_password_is_checked(services):
    bad = pika.URLParameters(services.amqp_url.replace("guest:guest", "guest:wrong"))
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(bad)


def _odbc_connect_and_catalog(conn_str):
    """Connects through unixODBC with SQLDriverConnect (ctypes) and returns
    (SQL_DBMS_NAME, SQL_ATTR_CURRENT_CATALOG)."""
    lib = ctypes.CDLL(ctypes.util.find_library("odbc") or "libodbc.so.2")
    SQLHANDLE = ctypes.c_void_p
    env, dbc = SQLHANDLE(), SQLHANDLE()

    def ok(rc, what):
        if rc not in (0, 1):  # SQL_SUCCESS, SQL_SUCCESS_WITH_INFO
            state = ctypes.create_string_buffer(6)
            native = ctypes.c_int()
            msg = ctypes.create_string_buffer(1024)
            n = ctypes.c_short()
            h, ht = (dbc, 2) if dbc.value else (env, 1)
            lib.SQLGetDiagRec(ht, h, 1, state, ctypes.byref(native), msg, 1024, ctypes.byref(n))
            raise AssertionError(f"{what} failed rc={rc}: {state.value!r} {msg.value!r}")

    lib.SQLSetEnvAttr.argtypes = [SQLHANDLE, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.SQLAllocHandle.argtypes = [ctypes.c_short, SQLHANDLE, ctypes.POINTER(SQLHANDLE)]
    lib.SQLDriverConnect.argtypes = [SQLHANDLE, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_short,
                                     ctypes.c_char_p, ctypes.c_short,
                                     ctypes.POINTER(ctypes.c_short), ctypes.c_ushort]
    lib.SQLGetInfo.argtypes = [SQLHANDLE, ctypes.c_ushort, ctypes.c_void_p, ctypes.c_short,
                               ctypes.POINTER(ctypes.c_short)]
    lib.SQLGetConnectAttr.argtypes = [SQLHANDLE, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.POINTER(ctypes.c_int)]
    lib.SQLGetDiagRec.argtypes = [ctypes.c_short, SQLHANDLE, ctypes.c_short, ctypes.c_char_p,
                                  ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_short,
                                  ctypes.POINTER(ctypes.c_short)]
    lib.SQLDisconnect.argtypes = [SQLHANDLE]
    lib.SQLFreeHandle.argtypes = [ctypes.c_short, SQLHANDLE]
    ok(lib.SQLAllocHandle(1, None, ctypes.byref(env)), "SQLAllocHandle(ENV)")
    try:
        ok(lib.SQLSetEnvAttr(env, 200, ctypes.c_void_p(3), 0), "SQLSetEnvAttr(ODBC3)")
        ok(lib.SQLAllocHandle(2, env, ctypes.byref(dbc)), "SQLAllocHandle(DBC)")
        out = ctypes.create_string_buffer(1024)
        outlen = ctypes.c_short()
        ok(lib.SQLDriverConnect(dbc, None, conn_str.encode(), -3, out, 1024,
                                ctypes.byref(outlen), 0), "SQLDriverConnect")
        try:
            dbms = ctypes.create_string_buffer(256)
            n = ctypes.c_short()
            ok(lib.SQLGetInfo(dbc, 17, dbms, 256, ctypes.byref(n)), "SQLGetInfo(DBMS_NAME)")
            cat = ctypes.create_string_buffer(256)
            m = ctypes.c_int()
            ok(lib.SQLGetConnectAttr(dbc, 109, cat, 256, ctypes.byref(m)),
               "SQLGetConnectAttr(CURRENT_CATALOG)")
            return dbms.value.decode(), cat.value.decode()
        finally:
            lib.SQLDisconnect(dbc)
    finally:
        if dbc.value:
            lib.SQLFreeHandle(2, dbc)
        lib.SQLFreeHandle(1, env)


@pytest.mark.build_independent
def test_odbc_dsn_connects_through_psqlodbc(pgdb):
    dbms, catalog = _odbc_connect_and_catalog(pgdb.odbc)
    assert dbms == "PostgreSQL"
    assert catalog == pgdb.name


@pytest.mark.build_independent
def test_odbc_wrong_database_fails(services):
    with pytest.raises(AssertionError, match="SQLDriverConnect failed"):
        _odbc_connect_and_catalog(services.odbc_dsn("t_does_not_exist"))


@pytest.mark.parametrize("backend", ["postgres", "odbc"])
def test_source_driver_sql_session(pgdb, build, backend):
    """tests/source_driver.py's `sql` (the driver's own session, through libpq or ODBC: what
    the contract suite's SQL Server adapter runs all its test-side SQL through): every
    result of a multi-statement text, NULL, empty and non-ASCII text, a value longer than
    one read, errors, and one autocommit session kept between calls."""
    from source_driver import Driver, driver_binary
    d = Driver(driver_binary(build), backend, pgdb.dsn if backend == "postgres" else pgdb.odbc,
               pgdb.name)
    try:
        done, rows = d.sql_run("CREATE TABLE t (a int, b text); INSERT INTO t VALUES "
                               "(1, 'ünï€😀'), (2, NULL), (3, ''); SELECT 7, 'x'")
        assert done["rc"] == 0 and rows == [["7", "x"]], (done, rows)
        assert done["rows"] == "4", done    # three inserted, one returned
        with pgdb.connect() as c:           # committed, the text intact
            assert c.execute("SELECT b FROM t ORDER BY a").fetchall() == [("ünï€😀",), (None,),
                                                                           ("",)]
        assert d.sql("SELECT a, b FROM t ORDER BY a") == [["1", "ünï€😀"], ["2", None],
                                                          ["3", ""]]
        long = "ä" + "ab" * 6000
        assert d.sql(f"SELECT '{long}'") == [[long]]
        done, rows = d.sql_run("SELECT * FROM nowhere")
        assert done["rc"] == -1 and "nowhere" in done["error"] and rows == [], done
        d.sql("CREATE TEMP TABLE mine (x int)")
        assert d.sql("SELECT count(*) FROM mine") == [["0"]]   # the same session
    finally:
        d.close()


@pytest.mark.build_independent
def test_run_prog_and_wait_for(tmp_path):
    r = run_prog(["sh", "-c", "echo out; echo err >&2; exit 3"], valgrind=False)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_prog(["sleep", "5"], timeout=0.2, valgrind=False)
    f = tmp_path / "x"
    f.write_text("a\nb\nc\n")
    assert tail(f, 2) == "b\nc"
    assert wait_for(lambda: f.exists() and f.read_text(), timeout=1) == "a\nb\nc\n"
    with pytest.raises(AssertionError, match="timed out after 0.2s waiting for nothing"):
        wait_for(lambda: False, timeout=0.2, desc="nothing")
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise psycopg.OperationalError("not yet")
        return "ok"
    assert wait_for(flaky, timeout=2, ignore=(psycopg.OperationalError,)) == "ok"


class _FakeItem:
    """What conftest's deal reads of a collected test."""

    def __init__(self, nodeid, params=None, fixtures=(), markers=()):
        self.nodeid = nodeid
        if params is not None:
            self.callspec = type("CallSpec", (), {"params": params})()
        self.fixturenames = list(fixtures)
        self.own_markers = [getattr(pytest.mark, m).mark for m in markers]

    def get_closest_marker(self, name):
        return next((m for m in reversed(self.own_markers) if m.name == name), None)

    def add_marker(self, marker):
        self.own_markers.append(marker.mark)


class _FakeConfig:
    def __init__(self):
        self.deselected = []
        self.hook = self

    def pytest_deselected(self, items):
        self.deselected += items


@pytest.mark.build_independent
def test_the_share_deals_each_test_to_one_run_of_each_build(monkeypatch):
    """OUTBOX_TEST_SHARE=K/N, OUTBOX_TEST_PARTS=M: the tests on the T-SQL engine (by the
    backend "sqlserver", by a T-SQL fixture or by their marker) and the build-independent
    ones each run in exactly one of the N runs; every other test runs once in each build
    (the runs M*b .. M*b+M-1), with the other such tests of its file; the runs' loads, by
    tests/durations.txt, are in balance; and a test that reaches the T-SQL engine without
    the marker is refused."""
    import conftest

    def suite():
        items = [_FakeItem(f"test_c.py::t{i}[{b}]", params={"src": b}, fixtures=["src"])
                 for i in range(9) for b in ("postgres", "odbc-postgres", "sqlserver")]
        items += [_FakeItem(f"test_r.py::r{i}", fixtures=["tsql", "services"]) for i in range(4)]
        items += [_FakeItem("test_s.py::m", markers=["tsql"]),
                  _FakeItem("test_g.py::g", fixtures=["granted"]),
                  _FakeItem("test_p.py::p", fixtures=["pgdb"])]
        items += [_FakeItem(f"test_d.py::d{i}", markers=["build_independent"]) for i in range(5)]
        items += [_FakeItem(f"test_m{f}.py::x{i}", fixtures=["pgdb"])
                  for f in range(6) for i in range(3)]
        return items
    ids = {it.nodeid for it in suite()}
    tsql = {f"test_c.py::t{i}[sqlserver]" for i in range(9)}
    tsql |= {f"test_r.py::r{i}" for i in range(4)} | {"test_s.py::m"}
    indep = {f"test_d.py::d{i}" for i in range(5)}
    own = ids - tsql - indep
    seconds = {f"test_m{f}.py::x{i}": 1.0 + f for f in range(6) for i in range(3)}
    seconds.update({t: 3.0 for t in tsql})
    monkeypatch.setattr(conftest, "_durations", lambda: seconds)
    monkeypatch.delenv("OUTBOX_TEST_SHARE", raising=False)
    monkeypatch.delenv("OUTBOX_TEST_PARTS", raising=False)
    items = suite()
    conftest.pytest_collection_modifyitems(_FakeConfig(), items)
    assert {it.nodeid for it in items if it.get_closest_marker("tsql")} == tsql
    assert len(items) == len(ids)
    for n, parts in ((2, 1), (4, 2), (6, 3), (4, 4)):
        ran = []
        for k in range(n):
            monkeypatch.setenv("OUTBOX_TEST_SHARE", f"{k}/{n}")
            monkeypatch.setenv("OUTBOX_TEST_PARTS", str(parts))
            items, config = suite(), _FakeConfig()
            conftest.pytest_collection_modifyitems(config, items)
            ran.append({it.nodeid for it in items})
            assert ran[k] | {it.nodeid for it in config.deselected} == ids
            assert not ran[k] & {it.nodeid for it in config.deselected}
        for t in ids:
            runs = [k for k in range(n) if t in ran[k]]
            if t in own:
                assert [k // parts for k in runs] == list(range(n // parts)), (t, runs)
                assert len({k % parts for k in runs}) == 1, (t, runs)   # the same part
            else:
                assert len(runs) == 1, (t, runs)
        for k in range(n):
            files = {t.split("::")[0] for t in ran[k] & own}
            assert all(f"{f}::x{i}" in ran[k] for f in files if f.startswith("test_m")
                       for i in range(3)), (k, files)
        loads = [sum(seconds.get(t, conftest.DEFAULT_SECONDS) for t in r) for r in ran]
        assert max(loads) - min(loads) <= 6.0, (n, parts, loads)   # the longest file
    monkeypatch.setenv("OUTBOX_TEST_PARTS", "3")
    monkeypatch.setenv("OUTBOX_TEST_SHARE", "0/4")
    with pytest.raises(pytest.UsageError, match="OUTBOX_TEST_PARTS='3': want a number"):
        conftest.pytest_collection_modifyitems(_FakeConfig(), suite())
    monkeypatch.setattr(conftest, "_CURRENT_ITEM", [_FakeItem("test_x.py::x")])
    with pytest.raises(RuntimeError, match="test_x.py::x reaches the T-SQL engine"):
        conftest.tsql_target(None)
