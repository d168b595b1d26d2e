"""liboutbox on a real PostgreSQL, through libpq.

Each case runs build/tests/lib_send_test (so OUTBOX_VALGRIND=1 and sanitizer builds cover
the library) and the database state is then checked with psycopg. tests/test_lib_odbc.py
imports these tests and runs them again through ODBC/psqlODBC by overriding `backend`.
"""
import datetime
import os
import secrets
import uuid

import pytest

from conftest import run_prog

T = '"outbox"."messages"'

PAYLOAD = bytes([0x00, ord('h'), ord('i'), 0x00, 0x00, 0xff, 0xfe, ord('\n'),
                 0x7f, 0x80, 0x00, ord('z')])
HEADERS = {
    "trace-id": "abc-123",
    "quote": 'a"b\\c/d',
    "ctl": "line1\nline2\t\x01\x1f end",
    "ünïk": "çødé ✓ 😀",
    "empty": "",
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "tracestate": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
}

INVALID = {  # sub-case → the text the error message must contain
    "routing_key_null": "routing_key",
    "routing_key_long": "routing_key",
    "routing_key_utf8": "routing_key",
    "exchange_long": "exchange",
    "exchange_utf8": "exchange",
    "partition_key_long": "partition_key",
    "partition_key_utf8": "partition_key",
    "message_type_long": "message_type",
    "message_type_utf8": "message_type",
    "content_type_long": "content_type",
    "content_type_utf8": "content_type",
    "correlation_id_long": "correlation_id",
    "correlation_id_utf8": "correlation_id",
    "message_id_bad": "message_id",
    "message_id_braces": "message_id",
    "message_id_long": "message_id",
    "payload_null": "payload",
    "payload_too_big": "payload: 257 bytes, larger than the limit of 256 bytes",
    "payload_over_default": "payload: 134217729 bytes, larger than the limit of 134217728 bytes "
                            "(the queue's max_payload",
    "headers_null": "headers",
    "header_key_null": "headers[1].key",
    "header_key_empty": "headers[0].key",
    "header_key_long": "headers[0].key",
    "header_key_utf8": "headers[0].key",
    "header_value_null": "headers[0].value",
    "header_value_utf8": "headers[0].value",
    "header_key_dup": "headers[2].key",
    "traceparent_bad": "headers[1].value: traceparent value is not in W3C",
    "tracestate_bad": "headers[0].value: tracestate value is not in W3C",
    "trace_key_case": "headers[0].key: \"TraceParent\": trace context keys are read in lower case",
    "delay_too_big": "delay_ms",
    "batch_second_bad": "messages[1].routing_key",
}


# ---------------------------------------------------------------------------- plumbing
@pytest.fixture
def backend():
    """Which path lib_send_test drives: "pg" (libpq) here, "odbc" in test_lib_odbc.py."""
    return "pg"


def conn_str(backend, db, extra=""):
    return (db.dsn if backend == "pg" else db.odbc + extra)


def send_bin(build):
    p = build / "tests" / "lib_send_test"
    if not p.exists():
        pytest.fail(f"{p} is not built (make test-programs)", pytrace=False)
    return p


class Result:
    def __init__(self, proc):
        self.proc = proc
        self.calls = []   # one dict per library call: rc, code, sqlstate, inserted, message
        self.values = {}
        for line in proc.stdout.splitlines():
            if line.startswith("rc="):
                head, _, msg = line.partition(" message=")
                d = dict(kv.split("=", 1) for kv in head.split())
                d = {k: (v if k == "sqlstate" else int(v)) for k, v in d.items()}
                d["message"] = msg
                self.calls.append(d)
            elif "=" in line:
                k, _, v = line.partition("=")
                self.values[k] = v

    def __repr__(self):
        return (f"exit {self.proc.returncode}\nstdout:\n{self.proc.stdout}\n"
                f"stderr:\n{self.proc.stderr}")


# psqlODBC's own errors under valgrind (inside its SQLDisconnect) are suppressed by
# tests/valgrind.supp, which the harness passes to every valgrind run (run_prog).
def run_case(build, backend, conn, qdb, case, *args, table=None, expect_exit=0):
    env = dict(os.environ)
    if table:
        env["OUTBOX_TEST_TABLE"] = table
    proc = run_prog([send_bin(build), backend, conn, qdb, case, *args], env=env)
    r = Result(proc)
    assert proc.returncode == expect_exit, r
    return r


def apply_ddl(build, db, table="outbox.messages"):
    unit = build / "tests" / "lib_unit_test"
    r = run_prog([unit, "--print-ddl", "postgres", table], valgrind=False)
    assert r.returncode == 0, r.stderr
    db.psql(r.stdout)


@pytest.fixture
def odb(pgdb, build):
    """pgdb with the outbox schema and a side table for the caller's own work."""
    apply_ddl(build, pgdb)
    c = pgdb.connect()
    c.execute("CREATE TABLE side_work (x int)")
    return pgdb


def rows(db, sql, *params):
    with db.connect() as c:
        return c.execute(sql, params or None).fetchall()


def count(db, table=T):
    return rows(db, f"SELECT count(*) FROM {table}")[0][0]


# ---------------------------------------------------------------------------- cases
def test_send_commit_stores_every_field(odb, build, backend):
    mid = str(uuid.uuid4())
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "send_commit", mid)
    assert r.calls[0]["rc"] == 0 and r.calls[0]["code"] == 0, r
    (row,) = rows(odb, f"SELECT message_id, exchange, routing_key, partition_key, message_type,"
                       f" content_type, correlation_id, headers, payload, created_at,"
                       f" available_at, now(), attempts, sent_at, lease_token FROM {T}")
    (m_id, exch, rk, pk, mt, ct, corr, headers, payload, created, avail, now, attempts,
     sent, token) = row
    assert str(m_id) == mid
    assert (exch, rk, pk, mt, ct, corr) == ("ex.orders", "orders.created", "order-42",
                                            "OrderCreated", "application/octet-stream", "corr-é")
    assert headers == HEADERS
    assert bytes(payload) == PAYLOAD  # embedded NUL bytes intact
    delay = (avail - created).total_seconds()
    assert 59.0 <= delay <= 61.0, delay
    assert abs((avail - (now + datetime.timedelta(seconds=60))).total_seconds()) < 30
    assert attempts == 0 and sent is None and token is None


def test_send_generated_id_and_empty_payload(odb, build, backend):
    run_case(build, backend, conn_str(backend, odb), odb.name, "send_generated_id")
    (row,) = rows(odb, f"SELECT message_id, payload, headers, exchange, partition_key,"
                       f" available_at - created_at FROM {T}")
    assert uuid.UUID(str(row[0])).version == 4
    assert bytes(row[1]) == b"" and row[2] is None and row[3] == "" and row[4] is None
    assert abs(row[5].total_seconds()) < 1


def test_send_rollback_leaves_nothing(odb, build, backend):
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "send_rollback",
                 str(uuid.uuid4()))
    assert r.calls[0]["rc"] == 0
    assert count(odb) == 0


def test_outside_transaction_is_enotxn(odb, build, backend):
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "no_txn", str(uuid.uuid4()))
    assert [c["rc"] for c in r.calls] == [-2, -2], r
    assert "transaction" in r.calls[0]["message"] or "autocommit" in r.calls[0]["message"]
    assert count(odb) == 0


def test_aborted_transaction_is_enotxn(odb, build, backend):
    # psqlODBC rolls back failed statements by itself unless Protocol=7.4-0 (do nothing),
    # which is what leaves the transaction aborted the way libpq does.
    conn = conn_str(backend, odb, "Protocol=7.4-0;")
    r = run_case(build, backend, conn, odb.name, "aborted_txn", str(uuid.uuid4()))
    assert r.calls[0]["rc"] == -2, r
    assert "abort" in r.calls[0]["message"]
    assert count(odb) == 0


@pytest.fixture
def mixed_case_db(services, build):
    """A database named T_<hex> (mixed case) with the outbox schema."""
    name = "T_" + secrets.token_hex(5)
    with services.pg_connect() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    from conftest import PgDb
    db = PgDb(services, name)
    try:
        apply_ddl(build, db)
        yield db
    finally:
        db.close_all()
        with services.pg_connect() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_database_name_differing_in_case_is_edbname(mixed_case_db, build, backend):
    db = mixed_case_db
    wrong = db.name.lower()
    r = run_case(build, backend, conn_str(backend, db), wrong, "dbname", str(uuid.uuid4()))
    assert [c["rc"] for c in r.calls] == [-3, -3], r
    for c in r.calls:
        assert f'"{db.name}"' in c["message"] and f'"{wrong}"' in c["message"], c
    assert count(db) == 0
    # and the right name works on the same database
    run_case(build, backend, conn_str(backend, db), db.name, "send_commit", str(uuid.uuid4()))
    assert count(db) == 1


def test_duplicate_keeps_the_transaction(odb, build, backend):
    mid = str(uuid.uuid4())
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "duplicate", mid)
    assert [c["rc"] for c in r.calls] == [0, 1], r
    assert mid in r.calls[1]["message"]
    assert rows(odb, f"SELECT message_id::text FROM {T}") == [(mid,)]
    assert rows(odb, "SELECT x FROM side_work ORDER BY x") == [(1,), (2,)]


def test_batch_duplicates_inside_and_existing(odb, build, backend):
    a, b, existing = (str(uuid.uuid4()) for _ in range(3))
    run_case(build, backend, conn_str(backend, odb), odb.name, "send_commit", existing)
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "batch_dup", a, b, existing)
    assert r.calls[0]["rc"] == 1 and r.calls[0]["inserted"] == 2, r
    got = {x for (x,) in rows(odb, f"SELECT message_id::text FROM {T}")}
    assert got == {a, b, existing}
    assert rows(odb, "SELECT x FROM side_work ORDER BY x") == [(3,), (4,)]


def outbox_statement_calls(db):
    return rows(db, "SELECT coalesce(sum(calls), 0)::int FROM pg_stat_statements"
                    " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    " AND query ILIKE '%\"outbox\".\"messages\"%'")[0][0]


def test_batch_of_1000_is_one_statement_and_commits(odb, build, backend):
    with odb.connect() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        c.execute("SELECT pg_stat_statements_reset()")
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "batch", "1000", "commit")
    assert r.calls[0]["rc"] == 0 and r.calls[0]["inserted"] == 1000, r
    assert outbox_statement_calls(odb) == 1
    assert count(odb) == 1000
    bodies = {bytes(p) for (p,) in rows(odb, f"SELECT payload FROM {T}")}
    assert bodies == {f"msg-{i}".encode() for i in range(1000)}


def test_batch_of_1000_rolls_back_whole(odb, build, backend):
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "batch", "1000", "rollback")
    assert r.calls[0]["inserted"] == 1000, r
    assert count(odb) == 0


def test_batch_beyond_the_parameter_limit(odb, build, backend):
    # 7000 messages x 10 parameters > 65535: several statements, still one call
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "batch", "7000", "commit")
    assert r.calls[0]["rc"] == 0 and r.calls[0]["inserted"] == 7000, r
    assert count(odb) == 7000
    ids = [i for (i,) in rows(odb, f"SELECT convert_from(payload, 'UTF8') FROM {T} ORDER BY id")]
    assert ids == [f"msg-{i}" for i in range(7000)]  # id order = batch order


def test_big_batch_failing_late_writes_nothing(odb, build, backend):
    with odb.connect() as c:
        c.execute("""CREATE FUNCTION boom_late() RETURNS trigger LANGUAGE plpgsql AS $$
                     BEGIN
                       IF NEW.routing_key = 'boom' THEN
                         RAISE EXCEPTION 'late boom' USING ERRCODE = 'P0998';
                       END IF;
                       RETURN NEW;
                     END $$""")
        c.execute(f"CREATE TRIGGER boom_late BEFORE INSERT ON {T} "
                  "FOR EACH ROW EXECUTE FUNCTION boom_late()")
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "batch", "7000", "commit",
                 "boom")
    assert r.calls[0]["rc"] == -5 and r.calls[0]["sqlstate"] == "P0998", r
    assert r.calls[0]["inserted"] == 0
    assert count(odb) == 0


@pytest.mark.parametrize("sub", sorted(INVALID))
def test_invalid_input_is_einval_naming_the_field(odb, build, backend, sub):
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "invalid", sub)
    want = INVALID[sub]
    assert r.calls, r
    for c in r.calls:
        assert c["rc"] == -1 and c["code"] == -1, r
        assert want in c["message"], (want, c["message"])
        assert "\n" not in c["message"]
    if sub != "batch_second_bad":
        # the batch variant names the message's index
        assert r.calls[1]["message"].startswith("messages[1]."), r
    assert count(odb) == 0


@pytest.mark.parametrize("table", ["outbox.nosuch", "nosuchschema.messages"])
def test_missing_table_is_enoschema(odb, build, backend, table):
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "noschema", table=table)
    c = r.calls[0]
    assert c["rc"] == -4, r
    assert "does not exist" in c["message"] and "outbox-relay init" in c["message"]
    assert c["sqlstate"] in ("42P01", "3F000"), c


@pytest.mark.parametrize("case", ["server_error", "server_error_batch"])
def test_server_error_is_edb_with_sqlstate_and_runs_once(odb, build, backend, case):
    with odb.connect() as c:
        c.execute("CREATE SEQUENCE outbox.err_counter")
        c.execute("""CREATE FUNCTION outbox.boom() RETURNS trigger LANGUAGE plpgsql AS $$
                     BEGIN
                       PERFORM nextval('outbox.err_counter');
                       RAISE EXCEPTION 'boom from trigger' USING ERRCODE = 'P0999';
                     END $$""")
        c.execute(f"CREATE TRIGGER boom BEFORE INSERT ON {T} "
                  "FOR EACH ROW EXECUTE FUNCTION outbox.boom()")
    r = run_case(build, backend, conn_str(backend, odb), odb.name, case)
    c = r.calls[0]
    assert c["rc"] == -5 and c["sqlstate"] == "P0999", r
    assert "boom from trigger" in c["message"]
    assert rows(odb, "SELECT last_value, is_called FROM outbox.err_counter") == [(1, True)]
    assert count(odb) == 0


@pytest.mark.parametrize("path", ["pg", "odbc"])
def test_payload_over_the_default_limit_is_refused_on_both_paths(odb, build, path):
    """With the default limit (the relay's default max_message_size, 128 MiB) a larger payload
    is OUTBOX_EINVAL naming the field, its size and the limit, on libpq and on ODBC, before a
    byte of it is read (the buffer behind it is far shorter than its stated length) and
    before anything reaches the table."""
    r = run_case(build, path, conn_str(path, odb), odb.name, "invalid", "payload_over_default")
    assert r.calls, r
    for c in r.calls:
        assert c["rc"] == -1 and c["code"] == -1, r
        assert INVALID["payload_over_default"] in c["message"], c["message"]
    assert count(odb) == 0
