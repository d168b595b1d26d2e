"""deploy/grants-sqlserver.sql on a T-SQL engine (Babelfish here, a real SQL Server with
OUTBOX_TEST_MSSQL): the file runs (twice: idempotent), the producer role can insert and
nothing else, the relay role can do what the relay does and cannot insert into the outbox.

The file names [outbox].[messages], [outbox].[messages_dead] and [outbox].[messages_lease];
as it tells its readers, the names are replaced here for a table of this test's own. Roles
are per database and shared; logins are made per test and dropped after it.

Babelfish refuses database permissions (GRANT VIEW DATABASE STATE: "not currently
supported"; the file grants none: the relay's table-health reads of dynamic management
views are optional, and the file shows those grants as comments) and
object ALTER permissions (outbox_admin's GRANT ALTER, for `dead retry`): that statement's
refusal is asserted there, and every other statement must succeed."""
import os
import re
import secrets
import subprocess
import uuid

import pytest

from conftest import ROOT, run_prog, tsql_target

GRANTS = ROOT / "deploy" / "grants-sqlserver.sql"


def batches(text):
    """The batches of a sqlcmd script: the text between lines holding only GO."""
    out, cur = [], []
    for line in text.splitlines():
        if line.strip().upper() == "GO":
            out.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    out.append("\n".join(cur))
    return [b for b in out if re.sub(r"--[^\n]*", "", b).strip()]


class Tsql:
    def __init__(self, build, conn, table):
        self.build, self.conn, self.table = build, conn, table

    def run(self, sql, conn=None, check=True):
        """(ok, first value or error text) of sql through lib_send_test's sql case."""
        p = run_prog([self.build / "tests" / "lib_send_test", "odbc", conn or self.conn, "-",
                      "sql", sql], env=dict(os.environ, OUTBOX_TEST_TABLE=self.table))
        value = None
        for line in p.stdout.splitlines():
            if line.startswith("value="):
                value = line[len("value="):]
        if check:
            assert p.returncode == 0, f"{sql[:300]}\n{p.stdout}{p.stderr}"
        return p.returncode == 0, value if p.returncode == 0 else p.stderr

    def as_login(self, login, password):
        return re.sub(r"UID=[^;]*;PWD=[^;]*", f"UID={login};PWD={password}", self.conn,
                      flags=re.I)


@pytest.fixture
def tsql_granted(services, build, relay_bin):
    conn, engine = tsql_target(services)
    schema = "gr_" + secrets.token_hex(3)
    t = Tsql(build, conn, f"{schema}.messages")
    t.engine = engine
    t.schema = schema
    t.qt, t.qd, t.ql = (f"[{schema}].[messages]", f"[{schema}].[messages_dead]",
                        f"[{schema}].[messages_lease]")
    t.db = t.run("SELECT DB_NAME()")[1]
    p = run_prog([build / "tests" / "lib_send_test", "odbc", conn, "-", "ddl"],
                 env=dict(os.environ, OUTBOX_TEST_TABLE=t.table))
    assert p.returncode == 0, p.stdout + p.stderr
    text = GRANTS.read_text().replace("[outbox].[messages", f"[{schema}].[messages")
    for _ in range(2):
        for b in batches(text):
            # each statement of the batch on its own (every one is a line of its own)
            for stmt in [x for x in b.splitlines() if x.strip() and not x.startswith("--")]:
                ok, why = t.run(stmt + "\nSELECT 1", check=False)
                if engine == "babelfish" and stmt.startswith("GRANT ALTER "):
                    # Babelfish refuses object ALTER permissions ("'GRANT PERMISSION ALTER'
                    # is not currently supported"): outbox_admin's `dead retry` cannot be
                    # granted there; SQL Server takes it
                    assert not ok and "not currently supported" in why, why
                    continue
                assert ok, f"{stmt}\n{why}"
    t.logins = []

    def login(role):
        name = f"{role}_{secrets.token_hex(3)}"
        password = "Pw-" + secrets.token_hex(8)
        t.run(f"CREATE LOGIN [{name}] WITH PASSWORD = N'{password}'; SELECT 1")
        t.run(f"CREATE USER [{name}] FOR LOGIN [{name}]; ALTER ROLE [{role}] ADD MEMBER "
              f"[{name}]; SELECT 1")
        t.logins.append(name)
        return name, password, t.as_login(name, password)
    t.login = login
    try:
        yield t
    finally:
        for name in t.logins:
            t.run(f"DROP USER IF EXISTS [{name}]; SELECT 1", check=False)
            t.run(f"DROP LOGIN [{name}]; SELECT 1", check=False)
        t.run(f"DROP TABLE IF EXISTS {t.qt}; DROP TABLE IF EXISTS {t.qd}; "
              f"DROP TABLE IF EXISTS {t.ql}; DROP SCHEMA IF EXISTS [{schema}]; SELECT 1",
              check=False)


def denied(t, conn, sql):
    """sql is refused for want of a permission (SQL Server: 229 '... permission was denied',
    3701 'does not exist or you do not have permission'; Babelfish: PostgreSQL's 'permission
    denied', 'must be owner')."""
    ok, why = t.run(sql + "; SELECT 1", conn=conn, check=False)
    why = why.lower() if isinstance(why, str) else ""
    return not ok and any(k in why for k in ("permission denied", "permission was denied",
                                            "do not have permission", "must be owner"))


def test_producer_inserts_and_nothing_else(tsql_granted, build):
    t = tsql_granted
    _, _, conn = t.login("outbox_producer")
    assert t.run(f"INSERT INTO {t.qt} (routing_key, payload) VALUES (N'rk', 0x00); SELECT 1",
                 conn=conn)[0]
    assert t.run(f"SELECT COUNT(*) FROM {t.qt}")[1] == "1"
    assert denied(t, conn, f"SELECT payload FROM {t.qt}")
    assert denied(t, conn, f"SELECT routing_key FROM {t.qt}")
    assert denied(t, conn, f"UPDATE {t.qt} SET attempts = 1")
    assert denied(t, conn, f"DELETE FROM {t.qt}")
    assert denied(t, conn, f"SELECT COUNT(*) FROM {t.qd}")
    assert denied(t, conn, f"SELECT COUNT(*) FROM {t.ql}")
    # liboutbox's send as the producer
    p = run_prog([build / "tests" / "lib_send_test", "odbc", conn, t.db, "send_commit",
                  str(uuid.uuid4())], env=dict(os.environ, OUTBOX_TEST_TABLE=t.table))
    assert p.returncode == 0, p.stdout + p.stderr
    assert t.run(f"SELECT COUNT(*) FROM {t.qt}")[1] == "2"
    # it may read message_id (its duplicate check), and only that
    assert t.run(f"SELECT COUNT(*) FROM {t.qt} WHERE message_id IS NOT NULL", conn=conn)[1] == "2"


def test_relay_does_what_the_relay_does_and_cannot_insert(tsql_granted, relay_bin, services,
                                                          tmp_path):
    t = tsql_granted
    t.run(f"INSERT INTO {t.qt} (routing_key, payload) VALUES (N'rk', 0x00); SELECT 1")
    _, _, conn = t.login("outbox_relay")
    assert denied(t, conn, f"INSERT INTO {t.qt} (routing_key, payload) VALUES (N'rk', 0x01)")
    assert t.run(f"SELECT COUNT(*) FROM {t.qt}", conn=conn)[1] == "1"
    assert t.run(f"UPDATE {t.qt} SET lease_owner = N'r', lease_token = 1; SELECT 1",
                 conn=conn)[0]
    assert t.run(f"INSERT INTO {t.qd} (id, message_id, routing_key, payload, reason) "
                 f"SELECT id, message_id, routing_key, payload, N'x' FROM {t.qt}; "
                 f"DELETE FROM {t.qt}; SELECT COUNT(*) FROM {t.qd}", conn=conn)[1] == "1"
    assert t.run(f"DELETE FROM {t.qd}; SELECT 1", conn=conn)[0]
    assert t.run(f"INSERT INTO {t.ql} (name, owner, epoch, expires_at) VALUES (N'member:r', "
                 f"N'r', 1, SYSUTCDATETIME()); UPDATE {t.ql} SET epoch = 2; SELECT 1",
                 conn=conn)[0]
    assert denied(t, conn, f"DELETE FROM {t.ql}")
    assert denied(t, conn, f"DROP TABLE {t.qd}")
    # the relay's own commands as that login
    from relay_util import write_config
    cfg = write_config(tmp_path / "r.ini", services, None, outboxes={"main": {
        "source": "sqlserver", "conninfo": conn, "database": t.db,
        "table": f"{t.schema}.messages", "sink": "main"}})
    for args in (["check"], ["stats"], ["dead", "list"]):
        p = subprocess.run([str(relay_bin), *args, "-c", str(cfg)], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, (args, p.stdout + p.stderr)
