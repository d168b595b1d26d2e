"""What only the ODBC source (sources/odbc) does, driven through build/tests/odbcsrc_test
(tests/c/odbcsrc_test.c): its worker threads on a real libev loop and the ODBC driver
manager under them.

Belongs here: how the ODBC source reports a failing connection (an unchanged DOWN reason
once). The Driver class is also what tests/test_tsql_capture.py drives the recording
driver with.
Does not belong here: any behaviour of relay/source.h that every source must have (claim,
settle, leadership, competing mode, stats, retention, dead letters, timeouts, connection
loss, the database-name check, a stalled source not stalling another in the same process):
tests/test_source_contract.py runs those against every
source, this one through psqlODBC and (OUTBOX_TEST_MSSQL) SQL Server. T-SQL text checks:
tests/test_tsql_capture.py.

Every test runs against PostgreSQL through psqlODBC (the harness's server), and against
SQL Server when OUTBOX_TEST_MSSQL holds an ODBC connection string to a SQL Server database;
otherwise that half is reported SKIPPED."""
import os
import queue
import re
import secrets
import subprocess
import threading
import time
import uuid

import pytest

from conftest import prog_argv, valgrind_enabled

SLOW = 4 if valgrind_enabled() else 1
MSSQL = os.environ.get("OUTBOX_TEST_MSSQL", "")
MSSQL_SKIP = "OUTBOX_TEST_MSSQL not set: SQL Server path untested here"
def driver_argv(argv, valgrind):
    """prog_argv(); psqlODBC's own errors are suppressed by tests/valgrind.supp."""
    return prog_argv(argv, valgrind)


HEXKEYS = {"msg", "err", "mid", "ex", "rk", "pk", "type", "ct", "corr", "hdr", "payload", "c"}


def unhex(v):
    if v == "-":
        return None
    if v == "~":
        return b""
    return bytes.fromhex(v)


def parse(line):
    """'DONE claim ok=0 n=2 err=-' → {'_': ['DONE', 'claim'], 'ok': '0', ...}; hex keys decoded
    (bytes for payload, str for the rest, None for NULL)."""
    out = {"_": []}
    for tok in line.split(" "):
        k, eq, v = tok.partition("=")
        if not eq:
            out["_"].append(tok)
            continue
        if k in HEXKEYS:
            b = unhex(v)
            v = b if (k == "payload" or b is None) else b.decode("utf-8")
        if k == "c":
            out.setdefault("cols", []).append(v)
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------- driver
class Driver:
    """One odbcsrc_test process: commands on stdin, event lines on stdout."""

    def __init__(self, binary, conn, database, *opts, table=None, valgrind=True):
        argv = [binary, "--conn", conn, "--database", database, "--reconnect-max", "500",
                *opts]
        if table:
            argv += ["--table", table]
        self.proc = subprocess.Popen(driver_argv(argv, valgrind), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.q = queue.Queue()
        self.seen = []
        self.pending = []
        threading.Thread(target=self._reader, daemon=True).start()
        self.expect(r"^READY$", 30)

    def _reader(self):
        for line in self.proc.stdout:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _take(self, rx):
        for i, line in enumerate(self.pending):
            if rx.search(line):
                del self.pending[i]
                return line
        return None

    def expect(self, pattern, timeout=15):
        """The next line matching pattern (earlier non-matching lines stay pending)."""
        rx = re.compile(pattern)
        line = self._take(rx)
        if line is not None:
            return line
        deadline = time.monotonic() + timeout * SLOW
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; output:\n"
                                     + "\n".join(self.seen[-40:]))
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"driver exited waiting for {pattern!r}; output:\n"
                                     + "\n".join(self.seen[-40:]) + "\nstderr:\n"
                                     + self.proc.stderr.read())
            self.seen.append(line)
            if rx.search(line):
                return line
            self.pending.append(line)

    def state(self, timeout=15):
        return parse(self.expect(r"^STATE ", timeout))

    def up(self, timeout=20):
        st = self.state(timeout)
        assert st["_"][1] == "UP", st
        return st

    def request(self, cmd, kind, timeout=20):
        """Sends a request; returns (done dict, rows list)."""
        self.send(cmd)
        assert self.expect(r"^SUBMIT ", timeout) == "SUBMIT rc=0"
        done = parse(self.expect(rf"^DONE {kind} ", timeout))
        rows = []
        if kind == "claim":
            for _ in range(int(done.get("n", 0))):
                rows.append(parse(self.expect(r"^ROW ", 5)))
        return done, rows

    def claim(self, n, token, owner="relay-a", lease_ms=30000):
        done, rows = self.request(f"claim {n} {lease_ms} {token} {owner}", "claim")
        return done, rows

    def settle(self, *outcomes):
        """outcomes: (id, token, kind, backoff_ms, reason or None)."""
        parts = []
        for i, t, k, b, r in outcomes:
            r = r.encode() if isinstance(r, str) else r   # bytes: not necessarily UTF-8
            parts.append(f"{i},{t},{k},{b},{r.hex() if r else '-'}")
        done, _ = self.request("settle " + " ".join(parts), "settle")
        return done

    def admin(self, cmd, timeout=30):
        self.send("admin " + cmd)
        return parse(self.expect(r"^ADMIN ", timeout))

    def sql(self, text, timeout=30):
        """Runs SQL on the driver's own session; returns rows (lists of str/None)."""
        self.send("sql " + text.encode().hex())
        rows = []
        while True:
            line = self.expect(r"^SQL(ROW|DONE) ", timeout)
            d = parse(line)
            if d["_"][0] == "SQLDONE":
                assert d["rc"] == "0", f"sql failed: {d['err']}\n{text}"
                return rows
            rows.append(d.get("cols", []))

    def close(self, timeout=60):
        if self.proc.poll() is None:
            try:
                self.send("quit")
            except (BrokenPipeError, ValueError):
                pass
        try:
            rc = self.proc.wait(timeout=timeout * SLOW)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("odbcsrc_test did not exit after quit")
        err = self.proc.stderr.read()
        assert rc == 0, f"odbcsrc_test exit {rc}; stderr:\n{err}"
        return err


# ---------------------------------------------------------------------------- backends
class PgBackend:
    """PostgreSQL through psqlODBC; test-side SQL through psycopg."""
    dialect = "postgres"

    def __init__(self, pgdb, services):
        self.pgdb = pgdb
        self.services = services
        self.conn = pgdb.odbc
        self.database = pgdb.name
        self.table = "outbox.messages"
        self.qt = '"outbox"."messages"'
        self.c = pgdb.connect()

    def insert(self, n=1):
        return [self.c.execute(f"INSERT INTO {self.qt} (message_id, routing_key, payload)"
                               " VALUES (%s, 'rk', 'p') RETURNING id",
                               (str(uuid.uuid4()),)).fetchone()[0] for _ in range(n)]

    def cleanup(self):
        pass


class MssqlBackend:
    """SQL Server through the ODBC string in OUTBOX_TEST_MSSQL; test-side SQL through the
    driver's own session (`sql` command). One fresh table per test."""
    dialect = "sqlserver"

    def __init__(self, binary):
        self.binary = binary
        self.conn = MSSQL
        self.tab = "t" + secrets.token_hex(5)
        self.table = "outbox." + self.tab
        self.qt = f"[outbox].[{self.tab}]"
        self.qd = f"[outbox].[{self.tab}_dead]"
        self.helper = Driver(binary, self.conn, "x", table=self.table, valgrind=False)
        self.database = self.helper.sql("SELECT DB_NAME()")[0][0]

    def x(self, sql):
        self.helper.sql(sql)

    def insert(self, n=1):
        return [int(self.helper.sql(f"SET NOCOUNT ON; INSERT INTO {self.qt} (routing_key,"
                                    " payload) OUTPUT inserted.id VALUES (N'rk', 0x70)")[0][0])
                for _ in range(n)]

    def cleanup(self):
        try:
            self.x(f"DROP TABLE IF EXISTS {self.qd}; DROP TABLE IF EXISTS {self.qt};"
                   f" DROP TABLE IF EXISTS [outbox].[{self.tab}_lease]")
        finally:
            self.helper.close()


@pytest.fixture(params=["postgres", "sqlserver"])
def backend(request, build):
    binary = build / "tests" / "odbcsrc_test"
    if not binary.exists():
        pytest.fail(f"{binary} not built (make test-programs)")
    if request.param == "sqlserver":
        if not MSSQL:
            pytest.skip(MSSQL_SKIP)
        b = MssqlBackend(binary)
    else:
        pgdb = request.getfixturevalue("pgdb")
        b = PgBackend(pgdb, request.getfixturevalue("services"))
    b.binary = binary
    try:
        yield b
    finally:
        b.cleanup()


@pytest.fixture
def drivers(backend):
    """Factory of drivers against the backend; all closed (and checked) at teardown."""
    made = []

    def make(*opts, database=None, table=None):
        d = Driver(backend.binary, backend.conn, database or backend.database, *opts,
                   table=table or backend.table)
        made.append(d)
        return d
    yield make
    errors = []
    for d in made:
        try:
            d.close()
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


def init_schema(backend, drivers):
    d = drivers()
    r = d.admin("init")
    assert r["rc"] == "0", r
    r = d.admin("init")  # idempotent
    assert r["rc"] == "0", r
    return d


# ---------------------------------------------------------------------------- tests
def test_unchanged_down_reason_is_reported_once(backend, drivers):
    """The ODBC source retries a failing connection with back-off (100 ms doubling, here
    capped at 500 ms) but reports DOWN again only when the reason changes (the libpq source
    reports every attempt: tests/test_pgsrc.py)."""
    init_schema(backend, drivers)
    wrong = backend.database + "_other"
    d = drivers(database=wrong)
    d.send("start")
    st = d.state()
    assert st["_"][1] == "DOWN" and f'configured database "{wrong}"' in st["msg"], st
    try:   # about six attempts meanwhile
        again = d.expect(r"^STATE ", 2.5)
    except AssertionError:
        again = None
    assert again is None, f"unchanged DOWN reported again: {again}"
