"""liboutbox called the wrong way, through its C API, on a real PostgreSQL (issue 23): NULL
connection, queue, message or error; n = 0; a NULL or oversized key or body; invalid UTF-8 in
a header; no transaction open (autocommit); a failed transaction; the connection in another
database; libpq pipeline mode; a connection that never came up, one the server ended
mid-transaction, one it ended mid-send (a 4 MiB message, and a batch of 20,000 spanning
several statements, whose INSERT waits on the server behind another transaction's row with
the same message_id until a third session terminates it: EDB, nothing reported written);
an ODBC handle never connected or disconnected; one queue used from eight
threads at once. Each call returns the code lib/outbox.h documents for it, never crashes
(build/tests/lib_misuse runs under the sanitizers and valgrind like every test program) and
never writes a row: every call expected to fail writes routing key "misuse", and none is
in the table afterwards (the threads' 400 committed rows are all there).

Runs through libpq, through ODBC on PostgreSQL (psqlODBC with Protocol=7.4-0, which leaves a
failed transaction aborted the way libpq does) and through ODBC on the T-SQL engine."""
import os

import pytest

import test_lib_odbc
from conftest import run_prog
from test_lib_pg import apply_ddl

mssql = test_lib_odbc.mssql   # the T-SQL fixture (a table of its own), used by name

OK, EINVAL, ENOTXN, EDBNAME, EDB = 0, -1, -2, -3, -5

# the server ended the session while the INSERT waited: its FATAL message, or the closed
# socket when that message was not read before the connection went (libpq, psqlODBC), or
# FreeTDS's word for the closed socket
LOST = ("terminating connection", "server closed the connection", "Unexpected EOF")
COMMON = {   # case -> (code, text the message must contain)
    "null_queue": (EINVAL, "q: NULL queue"),
    "null_message": (EINVAL, "m: NULL"),
    "batch_null_messages": (EINVAL, "messages: NULL"),
    "batch_n0": (OK, ""),
    "batch_n0_null": (OK, ""),
    "null_err_invalid": (EINVAL, ""),
    "routing_key_null": (EINVAL, "routing_key"),
    "payload_null": (EINVAL, "payload"),
    "payload_over_max": (OK, ""),
    "payload_over_max_17": (EINVAL, "payload: 17 bytes, larger than the limit of 16 bytes"),
    "partition_key_long": (EINVAL, "partition_key"),
    "header_value_utf8": (EINVAL, "headers[1].value: not valid UTF-8"),
    "header_key_utf8": (EINVAL, "headers[0].key: not valid UTF-8"),
    "headers_null": (EINVAL, "headers"),
    "usable_after_einval": (OK, ""),
    "null_err_valid": (OK, ""),
    "autocommit": (ENOTXN, "not inside"),
    "autocommit_batch": (ENOTXN, "not inside"),
    "after_failed_statement": (ENOTXN, "abort"),
    "wrong_database": (EDBNAME, "compared byte for byte"),
}
PER_BACKEND = {
    "pg": {
        "null_conn": (EINVAL, "c: NULL connection"),
        "pipeline_mode": (EINVAL, "pipeline mode"),
        "bad_connection": (ENOTXN, "the connection is bad"),
        "connection_lost": (EDB, "server closed the connection"),
        "connection_lost_again": (ENOTXN, "the connection is bad"),
        "lost_mid_send": (EDB, LOST),
        "lost_mid_send_batch": (EDB, LOST),
    },
    "odbc": {
        "null_conn": (EINVAL, "c: NULL connection handle"),
        "never_connected": (ENOTXN, "not open"),
        "disconnected": (ENOTXN, "not open"),
        "lost_mid_send": (EDB, LOST),
        "lost_mid_send_batch": (EDB, LOST),
    },
}
# T-SQL: a failed statement (SELECT 1/0, XACT_ABORT off) leaves the transaction open and
# usable, so the send after it succeeds (and is rolled back with the transaction)
PER_BACKEND["tsql"] = dict(PER_BACKEND["odbc"], after_failed_statement=(OK, ""))


@pytest.fixture
def two_dbs(pgdb, pgdb2, build):
    apply_ddl(build, pgdb)
    apply_ddl(build, pgdb2)
    return pgdb, pgdb2


def _calls(stdout):
    calls, threads = {}, None
    for line in stdout.splitlines():
        if line.startswith("case="):
            head, _, msg = line.partition(" message=")
            d = dict(kv.split("=", 1) for kv in head.split())
            calls[d["case"]] = (int(d["rc"]), d["sqlstate"], int(d["inserted"]), msg)
        elif line.startswith("threads="):
            threads = dict((k, int(v)) for k, v in (kv.split("=") for kv in line.split()))
    return calls, threads


def _run(build, backend, cs, qdb, other_cs, table=None):
    prog = build / "tests" / "lib_misuse"
    assert prog.exists(), f"{prog} is not built (make test-programs)"
    env = dict(os.environ)
    if table:
        env["OUTBOX_TEST_TABLE"] = table
    p = run_prog([prog, "pg" if backend == "pg" else "odbc", cs, qdb, other_cs], timeout=120,
                 env=env)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    calls, threads = _calls(p.stdout)
    want = dict(COMMON, **PER_BACKEND[backend])
    wrong = []
    for case, (code, text) in sorted(want.items()):
        if case not in calls:
            wrong.append((case, "not run"))
            continue
        rc, sqlstate, inserted, msg = calls[case]
        texts = text if isinstance(text, tuple) else (text,)
        if rc != code or not any(t in msg for t in texts) or inserted != 0:
            wrong.append((case, f"rc {rc} (want {code}), inserted {inserted}, sqlstate "
                                f"{sqlstate}: {msg}"))
    extra = sorted(set(calls) - set(want))
    return calls, threads, wrong, extra


@pytest.mark.tsql
def test_misuse_on_tsql_returns_the_documented_code_and_writes_nothing(mssql, build):
    """The same calls through FreeTDS's ODBC driver on the T-SQL engine (Babelfish, or SQL
    Server with OUTBOX_TEST_MSSQL); the other database is master."""
    other_cs = mssql.conn.rstrip(";") + ";Database=master"
    calls, threads, wrong, extra = _run(build, "tsql", mssql.conn, mssql.db, other_cs,
                                        table=mssql.table)
    rows = {rk: int(mssql.value(f"SELECT COUNT(*) FROM {mssql.qt} WHERE routing_key = "
                                f"'{rk}'")) for rk in ("threads", "misuse")}
    rows["total"] = int(mssql.value(f"SELECT COUNT(*) FROM {mssql.qt}"))
    print(f"tsql ({mssql.engine}): {len(calls)} misuse calls, {len(wrong)} not as documented; "
          f"threads {threads}; rows {rows}")
    assert not wrong, "calls not returning the documented code:\n" + "\n".join(
        f"  {c}: {w}" for c, w in wrong)
    assert not extra, f"cases without an expectation: {extra}"
    assert threads == {"threads": 8, "ok": 400, "failed": 0}, threads
    assert rows == {"threads": 400, "misuse": 0, "total": 400}, \
        f"rows written by misuse calls: {rows}"


@pytest.mark.parametrize("backend", ["pg", "odbc"])
def test_misuse_returns_the_documented_code_and_writes_nothing(two_dbs, build, backend):
    db, other = two_dbs
    if backend == "pg":
        cs, other_cs = db.dsn, other.dsn
    else:
        cs, other_cs = db.odbc + "Protocol=7.4-0;", other.odbc + "Protocol=7.4-0;"
    calls, threads, wrong, extra = _run(build, backend, cs, db.name, other_cs)
    with db.connect() as c:
        rows = dict(c.execute("SELECT routing_key, count(*) FROM outbox.messages GROUP BY 1"
                              ).fetchall())
    with other.connect() as c:
        other_rows = c.execute("SELECT count(*) FROM outbox.messages").fetchone()[0]
    print(f"{backend}: {len(calls)} misuse calls, {len(wrong)} not as documented; threads "
          f"{threads}; rows {rows}, in the other database {other_rows}")
    assert not wrong, "calls not returning the documented code:\n" + "\n".join(
        f"  {c}: {w}" for c, w in wrong)
    assert not extra, f"cases without an expectation: {extra}"
    assert threads == {"threads": 8, "ok": 400, "failed": 0}, threads
    assert rows == {"threads": 400}, f"rows written by misuse calls: {rows}"
    assert other_rows == 0
