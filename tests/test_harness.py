"""The harness itself works: real PostgreSQL, real RabbitMQ, psqlODBC, helpers."""
import ctypes
import ctypes.util
import subprocess

import pika
import psycopg
import pytest

from conftest import run_prog, tail, wait_for


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


def test_pgdb_is_fresh_and_dropped(services):
    # a database made by the fixture must be gone after teardown: emulate the fixture cycle
    import secrets

    from conftest import PgDb
    name = "t_probe_" + secrets.token_hex(4)
    with services.pg_connect() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    db = PgDb(services, name)
    c = db.connect()
    assert c.execute("select count(*) from pg_tables where schemaname = 'public'").fetchone() == (0,)
    db.close_all()
    assert c.closed
    with services.pg_connect() as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        assert admin.execute("select count(*) from pg_database where datname = %s",
                             (name,)).fetchone() == (0,)


def test_psql_helper(pgdb):
    r = pgdb.psql("select 40 + 2", args=("-At",))
    assert r.stdout.strip() == "42"
    with pytest.raises(subprocess.CalledProcessError):
        pgdb.psql("select * from no_such_table")


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


def test_odbc_dsn_connects_through_psqlodbc(pgdb):
    dbms, catalog = _odbc_connect_and_catalog(pgdb.odbc)
    assert dbms == "PostgreSQL"
    assert catalog == pgdb.name


def test_odbc_wrong_database_fails(services):
    with pytest.raises(AssertionError, match="SQLDriverConnect failed"):
        _odbc_connect_and_catalog(services.odbc_dsn("t_does_not_exist"))


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
