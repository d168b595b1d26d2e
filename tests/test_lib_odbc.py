"""liboutbox through ODBC.

1. Every test of tests/test_lib_pg.py again, through unixODBC + psqlODBC ("PostgreSQL
   Unicode"): the `backend` fixture below makes lib_send_test call outbox_odbc_send*
   (autocommit off = the caller's transaction; the "outside a transaction" case is
   autocommit on).
2. The T-SQL path (FreeTDS's ODBC driver) against the harness's Babelfish, or against a real
   SQL Server when env OUTBOX_TEST_MSSQL holds an ODBC connection string to a database the
   test may create tables in (conftest.tsql_target).
"""
import os
import secrets
import uuid

import pytest

from conftest import run_prog, tsql_target
from test_lib_pg import *  # noqa: F401,F403 - the same cases, re-run through ODBC
from test_lib_pg import T, Result, conn_str, rows, run_case, send_bin


@pytest.fixture
def backend():
    return "odbc"


# ---------------------------------------------------------------------------- ODBC only
def test_parameter_sizes_do_not_follow_the_data(odb, build, backend):
    """Parameters are bound with fixed sizes (nvarchar(255), nvarchar(max), varbinary(max))
    whatever the data: a small and a large message (255-byte texts, 9,000-character
    headers, 100 kB payload) in one transaction both arrive intact."""
    small, large = str(uuid.uuid4()), str(uuid.uuid4())
    r = run_case(build, backend, conn_str(backend, odb), odb.name, "send_sizes", small, large)
    assert [c["rc"] for c in r.calls] == [0, 0], r
    got = {str(m): (rk, len(hv or ""), len(bytes(p)))
           for m, rk, hv, p in rows(odb, f"SELECT message_id, routing_key, headers->>'big', "
                                         f"payload FROM {T}")}
    assert got[small] == ("rk", 0, 1), got
    assert got[large] == ("k" * 255, 9000, 100000), got


def test_plain_sql_producer_gets_a_message_id(odb):
    """Producers writing plain SQL need not invent a message_id: the column defaults to a
    random UUID."""
    with odb.connect() as c:
        (mid,) = c.execute(f"INSERT INTO {T} (routing_key, payload) VALUES ('rk', 'x') "
                           "RETURNING message_id").fetchone()
    assert uuid.UUID(str(mid)).version == 4


# ---------------------------------------------------------------------------- SQL Server
class Mssql:
    def __init__(self, build, conn, engine):
        self.build = build
        self.conn = conn
        self.engine = engine
        self.table = "outbox_t" + secrets.token_hex(3) + ".messages"
        self.db = None

    def run(self, case, *args, table=None, expect_exit=0):
        env = dict(os.environ, OUTBOX_TEST_TABLE=table or self.table)
        proc = run_prog([send_bin(self.build), "odbc", self.conn, self.db or "-", case, *args],
                        env=env)
        r = Result(proc)
        assert proc.returncode == expect_exit, r
        return r

    def value(self, sql):
        r = self.run("sql", sql)
        return r.values.get("value")

    @property
    def qt(self):
        s, t = self.table.split(".")
        return f"[{s}].[{t}]"


@pytest.fixture
def mssql(build, services):
    m = Mssql(build, *tsql_target(services))
    m.db = m.value("SELECT DB_NAME()")
    assert m.db, "cannot read DB_NAME()"
    m.run("ddl")
    m.run("ddl")  # idempotent
    m.value("IF OBJECT_ID(N'dbo.side_work', N'U') IS NULL CREATE TABLE dbo.side_work (x int); "
            "DELETE FROM dbo.side_work; SELECT 1")
    try:
        yield m
    finally:
        s, t = m.table.split(".")
        m.value(f"DROP TABLE IF EXISTS [{s}].[{t}]; DROP TABLE IF EXISTS [{s}].[{t}_dead]; "
                f"DROP TABLE IF EXISTS [{s}].[{t}_lease]; DROP SCHEMA IF EXISTS [{s}]; SELECT 1")


def ms_count(m):
    return int(m.value(f"SELECT COUNT(*) FROM {m.qt}"))


def test_mssql_send_commit_stores_every_field(mssql):
    mid = str(uuid.uuid4())
    r = mssql.run("send_commit", mid)
    assert r.calls[0]["rc"] == 0, r
    assert ms_count(mssql) == 1
    assert mssql.value(f"SELECT LOWER(CONVERT(varchar(36), message_id)) FROM {mssql.qt}") == mid
    # compared in the server: CONVERT(varchar(max), payload, 2) gives the hex text on SQL
    # Server and '' on Babelfish
    assert mssql.value(f"SELECT CASE WHEN payload = 0x00686900" "00FFFE0A" "7F80007A "
                       f"THEN 1 ELSE 0 END FROM {mssql.qt}") == "1"
    quote = mssql.value(f"SELECT JSON_VALUE(headers, '$.quote') FROM {mssql.qt}")
    if mssql.engine == "babelfish":
        # Babelfish's JSON_VALUE returns a string value still JSON-escaped (SQL Server
        # unescapes it): the stored JSON holds the value, escaped once
        assert quote == 'a\\"b\\\\c/d', quote
    else:
        assert quote == 'a"b\\c/d', quote
    assert mssql.value(f"SELECT routing_key FROM {mssql.qt}") == "orders.created"
    # each text in its own column: liboutbox binds a row's texts by position, and the
    # columns of one type (nvarchar(255)) would take each other's values silently
    assert mssql.value(f"SELECT exchange + N'|' + partition_key + N'|' + message_type + N'|' "
                       f"+ content_type FROM {mssql.qt}") == \
        "ex.orders|order-42|OrderCreated|application/octet-stream"
    assert mssql.value(f"SELECT CASE WHEN correlation_id = N'corr-' + NCHAR(233) THEN 1 "
                       f"ELSE 0 END FROM {mssql.qt}") == "1"
    delay = int(mssql.value(f"SELECT DATEDIFF(second, created_at, available_at) FROM {mssql.qt}"))
    assert 59 <= delay <= 61


def test_mssql_send_rollback_leaves_nothing(mssql):
    mssql.run("send_rollback", str(uuid.uuid4()))
    assert ms_count(mssql) == 0


def test_mssql_outside_transaction_is_enotxn(mssql):
    r = mssql.run("no_txn", str(uuid.uuid4()))
    assert [c["rc"] for c in r.calls] == [-2, -2], r
    assert ms_count(mssql) == 0


def test_mssql_transaction_lost_before_the_send(mssql):
    """The caller's own statement failed under its XACT_ABORT ON, in an earlier batch. A
    doomed transaction does not outlive its batch: the server rolled it back when that
    batch ended (SQL Server error 3998; Babelfish says the same), so at the send there is
    no transaction, and with autocommit off the send's statement silently starts a new
    one. liboutbox cannot tell that from a transaction whose first statement is the send
    (both have @@TRANCOUNT 0); the caller has the error of its own statement. Until this
    test ran on a T-SQL engine it expected OUTBOX_ENOTXN here, which no SQL Server can
    give: the check for a doomed transaction at the start of the send only sees one doomed
    within the same batch. What holds: the send succeeds in the new transaction, the
    caller's rollback (what it does on its own error) leaves nothing written, and its work
    before the failure is gone."""
    r = mssql.run("aborted_txn", str(uuid.uuid4()))
    assert r.calls[0]["rc"] == 0, r
    if mssql.engine == "babelfish":
        # Babelfish runs the statement after that rollback outside any transaction
        # although the session asked for implicit transactions: the message is committed
        # on its own and the caller's rollback finds no transaction. SQL Server starts a
        # new implicit transaction, which the caller's rollback discards.
        assert ms_count(mssql) == 1
    else:
        assert ms_count(mssql) == 0
    assert mssql.value("SELECT COUNT(*) FROM dbo.side_work WHERE x = 12") == "0"


def test_mssql_database_name_mismatch_is_edbname(mssql):
    wrong = mssql.db.swapcase()
    r = run_prog([send_bin(mssql.build), "odbc", mssql.conn, wrong, "dbname",
                  str(uuid.uuid4())],
                 env=dict(os.environ, OUTBOX_TEST_TABLE=mssql.table))
    res = Result(r)
    assert r.returncode == 0, res
    assert [c["rc"] for c in res.calls] == [-3, -3], res
    assert mssql.db in res.calls[0]["message"] and wrong in res.calls[0]["message"]
    assert ms_count(mssql) == 0


def test_mssql_duplicate_keeps_the_transaction(mssql):
    r = mssql.run("duplicate", str(uuid.uuid4()))
    assert [c["rc"] for c in r.calls] == [0, 1], r
    assert ms_count(mssql) == 1
    assert mssql.value("SELECT COUNT(*) FROM dbo.side_work") == "2"


def test_mssql_batch_duplicates(mssql):
    a, b, existing = (str(uuid.uuid4()) for _ in range(3))
    mssql.run("send_commit", existing)
    r = mssql.run("batch_dup", a, b, existing)
    assert r.calls[0]["rc"] == 1 and r.calls[0]["inserted"] == 2, r
    assert ms_count(mssql) == 3


@pytest.mark.parametrize("n", ["150", "1000"])  # one chunk; several chunks (2100-param limit)
def test_mssql_batch_commit_and_rollback(mssql, n):
    r = mssql.run("batch", n, "rollback")
    assert r.calls[0]["inserted"] == int(n), r
    assert ms_count(mssql) == 0
    r = mssql.run("batch", n, "commit")
    assert r.calls[0]["rc"] == 0 and r.calls[0]["inserted"] == int(n), r
    assert ms_count(mssql) == int(n)


@pytest.mark.parametrize("sub", ["routing_key_null", "header_key_long", "payload_too_big",
                                 "message_id_bad", "exchange_utf8"])
def test_mssql_invalid_input_is_einval(mssql, sub):
    r = mssql.run("invalid", sub)
    assert all(c["rc"] == -1 for c in r.calls), r
    assert ms_count(mssql) == 0


def test_mssql_missing_table_is_enoschema(mssql):
    r = mssql.run("noschema", table="dbo.outbox_missing_" + secrets.token_hex(3))
    assert r.calls[0]["rc"] == -4, r
    assert "outbox-relay init" in r.calls[0]["message"]


def test_mssql_duplicate_under_xact_abort_keeps_the_transaction(mssql):
    """The caller runs SET XACT_ABORT ON: a duplicate (single and in a batch) is still
    reported as OUTBOX_DUPLICATE, the transaction stays committable and the caller's
    XACT_ABORT setting is unchanged."""
    mid = str(uuid.uuid4())
    r = mssql.run("duplicate_xact_abort", mid)
    assert [c["rc"] for c in r.calls] == [0, 1, 1], r
    assert r.calls[2]["inserted"] == 1, r
    assert ms_count(mssql) == 2
    assert mssql.value("SELECT COUNT(*) FROM dbo.side_work WHERE x IN (5, 6)") == "2"


def test_mssql_parameter_sizes_do_not_follow_the_data(mssql):
    small, large = str(uuid.uuid4()), str(uuid.uuid4())
    r = mssql.run("send_sizes", small, large)
    assert [c["rc"] for c in r.calls] == [0, 0], r
    assert mssql.value(f"SELECT LEN(routing_key) FROM {mssql.qt} WHERE message_id = '{large}'") \
        == "255"
    assert mssql.value(f"SELECT DATALENGTH(payload) FROM {mssql.qt} "
                       f"WHERE message_id = '{large}'") == "100000"
    assert mssql.value(f"SELECT LEN(JSON_VALUE(headers, '$.big')) FROM {mssql.qt} "
                       f"WHERE message_id = '{large}'") is not None


def test_mssql_plain_sql_producer_gets_a_message_id(mssql):
    mid = mssql.value(f"SET NOCOUNT ON; INSERT INTO {mssql.qt} (routing_key, payload) "
                      f"OUTPUT inserted.message_id VALUES (N'rk', 0x00)")
    assert uuid.UUID(mid)


def test_mssql_4000_messages_in_batches_of_100(mssql):
    """4,000 messages in 40 calls of 100, one transaction: every one arrives."""
    r = mssql.run("batches", "4000", "100")
    assert r.values.get("total") == "4000", r
    assert all(c["rc"] == 0 and c["inserted"] == 100 for c in r.calls) and len(r.calls) == 40
    assert ms_count(mssql) == 4000


def test_mssql_batch_needing_a_savepoint_fails_cleanly(mssql):
    """A batch of 400 (three statements: SQL Server's 2,100-parameter limit) runs under a
    savepoint, which needs an open transaction: the first statement of the batch opens one
    with a real read of the outbox (a SELECT that reads no table would not). Its last
    message is refused by the server (a CHECK constraint added here): OUTBOX_EDB, the first
    statements are undone to the savepoint, and the caller's transaction stays usable and
    commits its own work."""
    mssql.value(f"ALTER TABLE {mssql.qt} ADD CONSTRAINT boom_chk CHECK (routing_key <> N'boom'); "
                "SELECT 1")
    if mssql.engine == "babelfish":
        # Babelfish rolls the whole transaction back when an error is raised again from a
        # CATCH block (the send's INSERT re-raises what it does not handle); SQL Server
        # keeps it (XACT_ABORT is off inside the send). liboutbox reads the session's state
        # after the failure and says so: OUTBOX_ETXNLOST, and the caller's work is gone.
        r = mssql.run("batch_savepoint", "400", "lost")
        assert r.calls[0]["rc"] == -7 and r.calls[0]["inserted"] == 0, r
        assert ms_count(mssql) == 0
        assert mssql.value("SELECT COUNT(*) FROM dbo.side_work WHERE x IN (9, 10)") == "0"
    else:
        r = mssql.run("batch_savepoint", "400")
        assert r.calls[0]["rc"] == -5 and r.calls[0]["inserted"] == 0, r
        assert "boom_chk" in r.calls[0]["message"], r
        assert ms_count(mssql) == 0
        assert mssql.value("SELECT COUNT(*) FROM dbo.side_work WHERE x IN (9, 10)") == "2"
    # the savepoint's opener read the outbox: the transaction existed for SAVE TRANSACTION
    # (a batch is never refused for want of one)
    # and without the refused message the same batch commits whole
    r = mssql.run("batch", "400", "commit")
    assert r.calls[0]["rc"] == 0 and r.calls[0]["inserted"] == 400, r
    assert ms_count(mssql) == 400


def _audit_trigger(m):
    """An ordinary trigger on the outbox, as an audit or replication setup adds: it copies
    every inserted id to dbo.outbox_audit. A trigger also changes what SQL Server accepts:
    a statement on the table may not OUTPUT rows to the client without INTO (Msg 334)."""
    s, _ = m.table.split(".")
    m.value("IF OBJECT_ID(N'dbo.outbox_audit', N'U') IS NULL "
            "CREATE TABLE dbo.outbox_audit (id bigint, rk nvarchar(255)); SELECT 1")
    m.value(f"EXEC(N'CREATE TRIGGER [{s}].[messages_audit] ON {m.qt} AFTER INSERT AS "
            "BEGIN SET NOCOUNT ON; "
            "IF EXISTS (SELECT 1 FROM inserted WHERE routing_key = N''raise'') "
            "THROW 50013, N''audit refused the row'', 1; "
            "IF EXISTS (SELECT 1 FROM inserted WHERE routing_key = N''rollback'') "
            "ROLLBACK TRANSACTION; "
            "INSERT INTO dbo.outbox_audit (id, rk) SELECT id, routing_key FROM inserted; END'); "
            "SELECT 1")


def test_mssql_sends_to_a_table_with_a_trigger(mssql):
    """Sends, duplicates and batches work on an outbox with a trigger, and the trigger
    sees every row. (liboutbox's statements OUTPUT nothing; tests/test_tsql_capture.py
    checks that none of them sends OUTPUT without INTO, which SQL Server refuses on a
    table with a trigger and Babelfish accepts.)"""
    _audit_trigger(mssql)
    mssql.value("DELETE FROM dbo.outbox_audit; SELECT 1")
    mid = str(uuid.uuid4())
    r = mssql.run("send_commit", mid)
    assert r.calls[0]["rc"] == 0, r
    r = mssql.run("duplicate", str(uuid.uuid4()))
    assert [c["rc"] for c in r.calls] == [0, 1], r
    r = mssql.run("batch", "400", "commit")
    assert r.calls[0]["rc"] == 0 and r.calls[0]["inserted"] == 400, r
    assert ms_count(mssql) == 402
    assert mssql.value("SELECT COUNT(*) FROM dbo.outbox_audit") == "402"


@pytest.mark.parametrize("how", ["raise", "rollback", "raise-xact_abort"])
def test_mssql_lost_transaction_is_etxnlost(mssql, how):
    """The send's INSERT fails in a way that ends the caller's transaction: a trigger
    raises (SQL Server runs triggers with XACT_ABORT ON: the transaction is doomed, then
    rolled back when the batch ends) or rolls back (3609), also under the caller's own
    XACT_ABORT ON. Reported as OUTBOX_ETXNLOST (-7), not as a plain database error: with
    autocommit off the caller's next statement would silently start a new transaction.
    The caller's earlier work is gone. Babelfish has already rolled back where SQL Server
    dooms (XACT_STATE() 0 where SQL Server says -1): both are OUTBOX_ETXNLOST. A real
    deadlock victim (1205) is not provoked here: it needs two sessions interleaved at the
    lock level, and Babelfish's locks are PostgreSQL's."""
    _audit_trigger(mssql)
    rk, _, xa = how.partition("-")
    r = mssql.run("txn_lost", str(uuid.uuid4()), rk, *( [xa] if xa else []))
    assert [c["rc"] for c in r.calls] == [-7, -7], r
    assert "roll back and retry the whole transaction" in r.calls[0]["message"], r
    assert ms_count(mssql) == 0
    assert mssql.value("SELECT COUNT(*) FROM dbo.side_work WHERE x = 8") == "0"
