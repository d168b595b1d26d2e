"""The ODBC source (sources/odbc) driven through build/tests/odbcsrc_test
(tests/c/odbcsrc_test.c): the asynchronous source with its worker thread on a
real libev loop, plus the synchronous admin calls.

Every test runs against PostgreSQL through psqlODBC (the harness's server).
The same tests run against SQL Server (T-SQL dialect) when OUTBOX_TEST_MSSQL
holds an ODBC connection string to a SQL Server database; otherwise that half
is reported SKIPPED."""
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
        self.qd = '"outbox"."messages_dead"'
        self.c = pgdb.connect()

    def q(self, sql, params=()):
        return self.c.execute(sql, params).fetchall()

    def x(self, sql, params=()):
        self.c.execute(sql, params)

    def insert(self, n=1, routing_key="rk", partition_key=None, payload=b"p", headers=None,
               exchange="ex", message_type=None, content_type=None, correlation_id=None):
        ids = []
        for _ in range(n):
            mid = str(uuid.uuid4())
            r = self.q(f"INSERT INTO {self.qt} (message_id, exchange, routing_key, partition_key,"
                       " message_type, content_type, correlation_id, headers, payload)"
                       " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
                       (mid, exchange, routing_key, partition_key, message_type, content_type,
                        correlation_id, headers, payload))
            ids.append(r[0][0])
        return ids

    def row(self, rid):
        r = self.q(f"SELECT attempts, lease_owner, lease_token, lease_until > now(), last_error,"
                   f" sent_at IS NOT NULL, available_at > now() FROM {self.qt} WHERE id = %s",
                   (rid,))
        if not r:
            return None
        a, o, t, lu, le, s, av = r[0]
        return {"attempts": a, "owner": o, "token": t, "leased": lu, "last_error": le,
                "sent": s, "delayed": av}

    def dead(self, rid):
        r = self.q(f"SELECT attempts, reason FROM {self.qd} WHERE id = %s", (rid,))
        return r[0] if r else None

    def put_dead(self, rid, reason):
        """A row already in the dead-letter table under id rid."""
        self.x(f"INSERT INTO {self.qd} (id, message_id, routing_key, payload, reason)"
               f" VALUES (%s, gen_random_uuid(), 'old', '\\x00', %s)", (rid, reason))

    def set_lease(self, rid, token, seconds):
        self.x(f"UPDATE {self.qt} SET lease_owner = 'old', lease_token = %s,"
               f" lease_until = now() + %s * interval '1 second' WHERE id = %s",
               (token, seconds, rid))

    def age_sent(self, rid, seconds):
        self.x(f"UPDATE {self.qt} SET sent_at = now() - %s * interval '1 second' WHERE id = %s",
               (seconds, rid))

    def hold_table_lock(self, seconds):
        """Locks the outbox table ACCESS EXCLUSIVE in another session for `seconds`."""
        c = self.pgdb.connect(autocommit=False)
        c.execute(f"LOCK TABLE {self.qt} IN ACCESS EXCLUSIVE MODE")

        def release():
            time.sleep(seconds)
            c.commit()
        t = threading.Thread(target=release, daemon=True)
        t.start()
        return t

    def lock_rows(self, ids):
        """Row locks on `ids` held by another open transaction; returns release()."""
        c = self.pgdb.connect(autocommit=False)
        got = c.execute(f"SELECT id FROM {self.qt} WHERE id = ANY(%s) FOR UPDATE",
                        (list(ids),)).fetchall()
        assert sorted(r[0] for r in got) == sorted(ids), got
        return c.rollback

    def relay_sessions(self):
        return [r[0] for r in self.q("SELECT pid FROM pg_stat_activity WHERE datname ="
                                     " current_database() AND pid <> pg_backend_pid()"
                                     " AND backend_type = 'client backend'")]

    def blocked_sessions(self):
        """Sessions of this database waiting for a lock (e.g. on hold_table_lock's)."""
        return [r[0] for r in self.q("SELECT pid FROM pg_stat_activity WHERE datname ="
                                     " current_database() AND pid <> pg_backend_pid()"
                                     " AND wait_event_type = 'Lock'")]

    def leader_session(self):
        # pg_locks is cluster-wide: only this test's database
        r = self.q("SELECT l.pid FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
                   " WHERE l.locktype = 'advisory' AND l.granted"
                   " AND d.datname = current_database()")
        return r[0][0] if r else None

    def kill(self, pid):
        self.x("SELECT pg_terminate_backend(%s)", (pid,))

    def debug_locks(self):
        return (self.q("SELECT l.pid, l.objid, l.granted FROM pg_locks l JOIN pg_database d"
                       " ON d.oid = l.database WHERE l.locktype = 'advisory'"
                       " AND d.datname = current_database()"),
                self.q("SELECT pid, state, query FROM pg_stat_activity WHERE datname ="
                       " current_database()"))

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

    def q(self, sql):
        return self.helper.sql(sql)

    def x(self, sql):
        self.helper.sql(sql)

    @staticmethod
    def lit(v):
        if v is None:
            return "NULL"
        return "N'" + str(v).replace("'", "''") + "'"

    def insert(self, n=1, routing_key="rk", partition_key=None, payload=b"p", headers=None,
               exchange="ex", message_type=None, content_type=None, correlation_id=None):
        ids = []
        for _ in range(n):
            r = self.q(f"SET NOCOUNT ON; INSERT INTO {self.qt} (message_id, exchange, routing_key,"
                       " partition_key, message_type, content_type, correlation_id, headers,"
                       f" payload) OUTPUT inserted.id VALUES (NEWID(), {self.lit(exchange)},"
                       f" {self.lit(routing_key)}, {self.lit(partition_key)},"
                       f" {self.lit(message_type)}, {self.lit(content_type)},"
                       f" {self.lit(correlation_id)}, {self.lit(headers)},"
                       f" 0x{payload.hex()})")
            ids.append(int(r[0][0]))
        return ids

    def row(self, rid):
        r = self.q("SELECT attempts, lease_owner, lease_token, CASE WHEN lease_until >"
                   " SYSUTCDATETIME() THEN 1 ELSE 0 END, last_error, CASE WHEN sent_at IS NULL"
                   " THEN 0 ELSE 1 END, CASE WHEN available_at > SYSUTCDATETIME() THEN 1 ELSE 0"
                   f" END FROM {self.qt} WHERE id = {int(rid)}")
        if not r:
            return None
        a, o, t, lu, le, s, av = r[0]
        return {"attempts": int(a), "owner": o, "token": int(t) if t is not None else None,
                "leased": lu == "1", "last_error": le, "sent": s == "1", "delayed": av == "1"}

    def dead(self, rid):
        r = self.q(f"SELECT attempts, reason FROM {self.qd} WHERE id = {int(rid)}")
        return (int(r[0][0]), r[0][1]) if r else None

    def put_dead(self, rid, reason):
        self.x(f"INSERT INTO {self.qd} (id, message_id, routing_key, payload, reason)"
               f" VALUES ({int(rid)}, NEWID(), N'old', 0x00, {self.lit(reason)})")

    def set_lease(self, rid, token, seconds):
        self.x(f"UPDATE {self.qt} SET lease_owner = N'old', lease_token = {int(token)},"
               f" lease_until = DATEADD(second, {int(seconds)}, SYSUTCDATETIME())"
               f" WHERE id = {int(rid)}")

    def age_sent(self, rid, seconds):
        self.x(f"UPDATE {self.qt} SET sent_at = DATEADD(second, -{int(seconds)},"
               f" SYSUTCDATETIME()) WHERE id = {int(rid)}")

    def hold_table_lock(self, seconds):
        locker = Driver(self.binary, self.conn, self.database, table=self.table,
                        valgrind=False)
        locker.send("sql " + (f"BEGIN TRAN; SELECT TOP 0 * FROM {self.qt} WITH (TABLOCKX,"
                              f" HOLDLOCK); WAITFOR DELAY '00:00:{int(seconds):02d}'; COMMIT")
                    .encode().hex())

        def finish():
            try:
                locker.expect(r"^SQLDONE ", seconds + 30)
            finally:
                locker.close()
        t = threading.Thread(target=finish, daemon=True)
        t.start()
        time.sleep(0.5)
        return t

    def lock_rows(self, ids):
        """Row locks (UPDLOCK, the kind the claim's READPAST skips) on `ids`, held by an open
        transaction on another session; returns release()."""
        locker = Driver(self.binary, self.conn, self.database, table=self.table,
                        valgrind=False)
        try:
            got = locker.sql(f"BEGIN TRAN; SELECT id FROM {self.qt} WITH (UPDLOCK, ROWLOCK)"
                             f" WHERE id IN ({', '.join(str(int(i)) for i in ids)})")
            assert sorted(int(r[0]) for r in got) == sorted(ids), got
            assert locker.sql("SELECT @@TRANCOUNT") == [["1"]], "the transaction must stay open"
        except BaseException:
            locker.close()
            raise

        def release():
            try:
                locker.sql("ROLLBACK")
            finally:
                locker.close()
        return release

    def relay_sessions(self):
        return [int(r[0]) for r in self.q("SELECT session_id FROM sys.dm_exec_sessions WHERE"
                                          " database_id = DB_ID() AND session_id <> @@SPID"
                                          " AND is_user_process = 1")]

    def blocked_sessions(self):
        return [int(r[0]) for r in self.q("SELECT session_id FROM sys.dm_exec_requests WHERE"
                                          " database_id = DB_ID() AND session_id <> @@SPID"
                                          " AND blocking_session_id <> 0")]

    def leader_session(self):
        r = self.q("SELECT request_session_id FROM sys.dm_tran_locks WHERE resource_type ="
                   " 'APPLICATION' AND request_status = 'GRANT'"
                   " AND resource_database_id = DB_ID()")
        return int(r[0][0]) if r else None

    def kill(self, spid):
        self.x(f"KILL {int(spid)}")

    def cleanup(self):
        try:
            self.x(f"DROP TABLE IF EXISTS {self.qd}; DROP TABLE IF EXISTS {self.qt}")
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


def wait_blocked_in_flight(backend, d, sessions, what):
    """Waits until one of `sessions` (the source's) is blocked on a lock, then asserts that
    the driver has not reported the request `what` done: it is still under way, stuck on the
    lock. Returns the blocked sessions."""
    from conftest import wait_for
    blocked = wait_for(lambda: [p for p in backend.blocked_sessions() if p in sessions],
                       timeout=15 * SLOW, desc=f"the source's {what} to block on the table lock")
    while True:   # every line the driver printed so far, kept for later expect() calls
        try:
            line = d.q.get_nowait()
        except queue.Empty:
            break
        if line is None:
            raise AssertionError("driver exited; output:\n" + "\n".join(d.seen[-40:]))
        d.seen.append(line)
        d.pending.append(line)
    done = [line for line in d.pending if line.startswith(f"DONE {what} ")]
    assert not done, f"the {what} finished although its session is blocked: {done}"
    return blocked


# ---------------------------------------------------------------------------- tests
def test_connect_up_and_check(backend, drivers):
    d = init_schema(backend, drivers)
    assert d.admin("check")["rc"] == "0"
    d.send("start")
    st = d.up()
    print("state:", st)
    done, _ = d.request("stats", "stats")
    assert done["ok"] == "0" and done["backlog"] == "0" and done["dead"] == "0", done


def test_database_mismatch_goes_down_naming_both(backend, drivers):
    init_schema(backend, drivers)
    wrong = backend.database + "_other"
    d = drivers(database=wrong)
    d.send("start")
    st = d.state()
    assert st["_"][1] == "DOWN", st
    want = (f'connected database "{backend.database}" differs from configured database'
            f' "{wrong}"')
    assert st["msg"] == want, st
    # no draining: requests fail
    done, rows = d.claim(10, 1)
    assert done["ok"] == "-1" and not rows, done
    chk = d.admin("check")
    assert chk["rc"] == "-1" and want in chk["err"], chk


def test_missing_table_goes_down_with_init_hint(backend, drivers):
    d = drivers()
    d.send("start")
    st = d.state()
    assert st["_"][1] == "DOWN", st
    assert "not exist" in st["msg"] and "run outbox-relay init" in st["msg"], st
    assert backend.qt in st["msg"], st
    # init from another session: the source comes UP by itself (reconnect back-off); a
    # reconnect that ran while init was half done may report the other table first
    assert drivers().admin("init")["rc"] == "0"
    for _ in range(3):
        st = d.state(timeout=20)
        if st["_"][1] == "UP":
            break
        assert "run outbox-relay init" in st["msg"], st
    assert st["_"][1] == "UP", st


def test_claim_order_lease_and_bytes(backend, drivers):
    init_schema(backend, drivers)
    payload = b"\x00\x01binary\x00\xff\xfe" + bytes(range(256)) * 300   # 76 KiB, NULs
    text = "ключ-é-漢字-😀"
    ids = backend.insert(1, routing_key=text, partition_key="pk-ü", payload=payload,
                         headers='{"h": "wert-ß"}', exchange="", message_type="t.v1",
                         content_type="application/octet-stream", correlation_id="c-1")
    ids += backend.insert(4, payload=b"")
    d = drivers()
    d.send("start")
    d.up()
    done, rows = d.claim(3, 4242, owner="relay-a")
    assert done["ok"] == "0" and done["n"] == "3", done
    assert [int(r["id"]) for r in rows] == ids[:3]
    r0 = rows[0]
    assert r0["payload"] == payload
    assert r0["rk"] == text and r0["pk"] == "pk-ü"
    assert r0["ex"] == "" and r0["type"] == "t.v1" and r0["corr"] == "c-1"
    assert r0["ct"] == "application/octet-stream"
    assert "wert-ß" in r0["hdr"]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
                        r0["mid"]), r0["mid"]
    assert int(r0["token"]) == 4242 and int(r0["attempts"]) == 0
    assert abs(int(r0["created_us"]) / 1e6 - time.time()) < 300, r0["created_us"]
    assert rows[1]["payload"] == b"" and rows[1]["pk"] is None and rows[1]["hdr"] is None
    for rid in ids[:3]:
        st = backend.row(rid)
        assert st["owner"] == "relay-a" and st["token"] == 4242 and st["leased"], st
    assert backend.row(ids[3])["token"] is None
    done, rows = d.claim(10, 4243)
    assert [int(r["id"]) for r in rows] == ids[3:]
    done, rows = d.claim(10, 4244)
    assert done["ok"] == "0" and rows == []


def test_concurrent_claims_are_disjoint(backend, drivers):
    init_schema(backend, drivers)
    ids = backend.insert(200)
    a, b = drivers(), drivers()
    for d in (a, b):
        d.send("start")
        d.up()
    a.send("drain 7 60000 1 relay-a")
    b.send("drain 7 60000 2 relay-b")
    got = []
    for d in (a, b):
        line = d.expect(r"^DRAINED ", 120)
        m = re.search(r"ids=([\d,]*)", line)
        got.append([int(x) for x in m.group(1).split(",") if x])
    print(f"relay-a claimed {len(got[0])} rows, relay-b {len(got[1])}")
    assert not set(got[0]) & set(got[1])
    assert sorted(got[0] + got[1]) == ids


def test_claim_skips_rows_locked_by_another_transaction(backend, drivers):
    init_schema(backend, drivers)
    ids = backend.insert(4)
    release = backend.lock_rows(ids[:2])
    try:
        d = drivers()
        d.send("start")
        d.up()
        done, rows = d.claim(10, 7)
        assert done["ok"] == "0", done
        assert [int(r["id"]) for r in rows] == ids[2:], \
            "SKIP LOCKED / READPAST must pass the locked rows"
    finally:
        release()
    done, rows = d.claim(10, 8)
    assert [int(r["id"]) for r in rows] == ids[:2]


def test_settle_reasons_not_utf8_control_characters_and_too_long(backend, drivers):
    """A reason travels as JSON text bound as UTF-16: a byte that is not UTF-8 becomes
    U+FFFD (the rest is kept), control characters arrive as they were, and a reason
    longer than 2000 bytes is cut on a character boundary."""
    init_schema(backend, drivers)
    retry, dead = backend.insert(2, partition_key=None)
    d = drivers()
    d.send("start")
    d.up()
    done, rows = d.claim(2, 100)
    assert [int(r["id"]) for r in rows] == [retry, dead]
    long = "a" + "\u00e9" * 1000                       # 2001 bytes of UTF-8
    done = d.settle((retry, 100, 1, 60000, b"bad \xff\xc3 \xed\xa0\x80 \"q\"\\ \x01\b\f\t\n end"),
                    (dead, 100, 2, 0, long))
    assert done["ok"] == "0" and done["applied"] == "2", done
    assert backend.row(retry)["last_error"] == \
        "bad \ufffd\ufffd \ufffd\ufffd\ufffd \"q\"\\ \x01\b\f\t\n end"
    assert backend.dead(dead) == (1, long[:1000])        # "a" and 999 whole characters


def test_settle_outcomes_and_fencing(backend, drivers):
    init_schema(backend, drivers)
    ids = backend.insert(5, partition_key=None)
    pk_ids = backend.insert(2, partition_key="order-1")   # retry of the first holds back the second
    d = drivers()
    d.send("start")
    d.up()
    done, rows = d.claim(5, 100)
    assert [int(r["id"]) for r in rows] == ids
    sent, retry, dead, unclaim, stale = ids
    done = d.settle((sent, 100, 0, 0, None), (retry, 100, 1, 60000, "nack: \"boom\"\n\u00e9"),
                    (dead, 100, 2, 0, "unroutable ✗"), (unclaim, 100, 3, 0, None),
                    (stale, 999, 0, 0, None))
    assert done["ok"] == "0" and done["applied"] == "4", done
    s = backend.row(sent)
    assert s["sent"] and s["token"] is None and s["owner"] is None
    r = backend.row(retry)
    assert r["attempts"] == 1 and r["last_error"] == "nack: \"boom\"\n\u00e9" and r["delayed"]
    assert r["token"] is None and not r["sent"]
    assert backend.row(dead) is None
    assert backend.dead(dead) == (1, "unroutable ✗")
    u = backend.row(unclaim)
    assert u["attempts"] == 0 and u["token"] is None and not u["sent"]
    st = backend.row(stale)
    assert st["token"] == 100 and not st["sent"], "a stale token must not settle (fencing)"
    # the same settle again: nothing matches any more
    done = d.settle((sent, 100, 0, 0, None), (retry, 100, 1, 1, "x"))
    assert done["applied"] == "0", done

    # partition hold-back: a failing row holds back later rows of its key only
    done, rows = d.claim(10, 200)
    assert sorted(int(x["id"]) for x in rows) == sorted([unclaim] + pk_ids)
    d.settle((pk_ids[0], 200, 1, 60000, "fail"), (pk_ids[1], 200, 3, 0, None),
             (unclaim, 200, 3, 0, None))
    done, rows = d.claim(10, 201)
    assert [int(x["id"]) for x in rows] == [unclaim], "order-1 #2 must wait for #1"

    # stats, async and admin
    done, _ = d.request("stats", "stats")
    # the relay's periodic refresh does not count the retained marked rows (-1): that
    # reads every one of them; the admin `stats` does
    assert done["dead"] == "1" and done["sent_kept"] == "-1", done
    assert int(done["backlog"]) == 5, done
    adm = d.admin("stats")
    assert adm["rc"] == "0" and adm["dead"] == "1" and adm["sent_kept"] == "1", adm

    # dead letters: list, retry (same id, attempts reset), purge
    d.send("admin dead_list")
    line = d.expect(rf"^{dead}\t", 30)
    f = line.split("\t")
    assert f[3] == "rk" and f[4] == "1" and f[6] == "unroutable ✗", f
    assert d.expect(r"^ADMIN dead_list ").startswith("ADMIN dead_list rc=0")
    adm = d.admin(f"dead_retry {dead}")
    assert adm["rc"] == "0" and adm["affected"] == "1", adm
    assert backend.dead(dead) is None
    assert backend.row(dead)["attempts"] == 0
    done, rows = d.claim(10, 300)
    assert dead in [int(x["id"]) for x in rows]
    d.settle((dead, 300, 2, 0, "again"))
    adm = d.admin("dead_purge")
    assert adm["rc"] == "0" and adm["affected"] == "1", adm


def test_dead_letter_move_replaces_a_row_already_dead(backend, drivers):
    """A dead-letter move finds the id already in the dead table (a move retried after its
    commit acknowledgement was lost, a row put back by hand): the move still succeeds and
    the dead row is the new one, instead of the settle failing forever."""
    init_schema(backend, drivers)
    (rid,) = backend.insert(1, routing_key="rk-now")
    backend.put_dead(rid, "the earlier move")
    d = drivers()
    d.send("start")
    d.up()
    done, rows = d.claim(10, 61)
    assert [int(r["id"]) for r in rows] == [rid]
    done = d.settle((rid, 61, 2, 0, "the second move"))
    assert done["ok"] == "0" and done["applied"] == "1", done
    assert backend.row(rid) is None
    assert backend.dead(rid) == (1, "the second move")
    # and a dead retry repeated (its first commit acknowledgement lost) is harmless
    assert d.admin(f"dead_retry {rid}")["affected"] == "1"
    again = d.admin(f"dead_retry {rid}")
    assert again["rc"] == "0" and again["affected"] == "0", again
    assert backend.row(rid)["attempts"] == 0


def test_settle_sent_delete_mode(backend, drivers):
    init_schema(backend, drivers)
    ids = backend.insert(2)
    d = drivers("--on-sent", "delete")
    d.send("start")
    d.up()
    d.claim(10, 5)
    done = d.settle((ids[0], 5, 0, 0, None), (ids[1], 6, 0, 0, None))
    assert done["applied"] == "1", done
    assert backend.row(ids[0]) is None
    assert backend.row(ids[1]) is not None


def test_cleanup_deletes_old_marked_rows_bounded(backend, drivers):
    init_schema(backend, drivers)
    ids = backend.insert(4)
    d = drivers()
    d.send("start")
    d.up()
    d.claim(10, 9)
    d.settle(*[(i, 9, 0, 0, None) for i in ids])
    for i in ids[:3]:
        backend.age_sent(i, 7200)
    done, _ = d.request("cleanup 3600000 2", "cleanup")
    assert done["ok"] == "0" and done["deleted"] == "2", done
    done, _ = d.request("cleanup 3600000 2", "cleanup")
    assert done["deleted"] == "1", done
    assert backend.row(ids[3]) is not None


def test_lead_lease_renewal_takeover_and_fencing(backend, drivers):
    """Leadership is a lease row (not a session lock, which msodbcsql's idle reconnection
    would drop silently): renewed with its epoch, taken over once expired with a new epoch
    that releases the old holder's row leases; the old holder is fenced."""
    init_schema(backend, drivers)
    ids = backend.insert(3)
    backend.set_lease(ids[0], 77, 3600)   # a crashed leader's lease
    a, b = drivers(), drivers()
    for d in (a, b):
        d.send("start")
        d.up()
    done, _ = a.request("lead A 0 1500", "lead")
    assert done["ok"] == "0" and done["leader"] == "1" and done["newly"] == "1", done
    e1 = int(done["epoch"])
    assert backend.row(ids[0])["token"] is None, "stale leases reset on acquisition"
    done, _ = b.request("lead B 0 1500", "lead")
    assert done["leader"] == "0" and done["holder"] == "A" and int(done["held"]) == e1, done
    done, _ = a.request(f"lead A {e1} 1500", "lead")
    assert done["leader"] == "1" and done["newly"] == "0" and int(done["epoch"]) == e1, done
    # A stops renewing: B takes over once the lease expired in database time
    for _ in range(100):
        done, _ = b.request("lead B 0 1500", "lead")
        if done["leader"] == "1":
            break
        time.sleep(0.1)
    assert done["leader"] == "1" and done["newly"] == "1", done
    e2 = int(done["epoch"])
    assert e2 == e1 + 1, done
    # the old holder's renewal and claims are fenced
    done, _ = a.request(f"lead A {e1} 1500", "lead")
    assert done["ok"] == "0" and done["leader"] == "0" and done["holder"] == "B", done
    done, rows = a.request(f"claim 5 30000 5 A {e1}", "claim")
    assert done["ok"] == "0" and rows == [], done
    done, rows = b.request(f"claim 5 30000 6 B {e2}", "claim")
    assert sorted(int(r["id"]) for r in rows) == sorted(ids), done


def test_stalled_database_does_not_block_the_loop(backend, drivers):
    init_schema(backend, drivers)
    backend.insert(3)
    d = drivers()
    d.send("start")
    d.up()
    t = backend.hold_table_lock(3)
    done, rows = d.claim(10, 11)
    t.join(30)
    print(f"claim against a table locked for 3 s: ok={done['ok']} after {done['ms']} ms,"
          f" the 50 ms timer ticked {done['ticks']} times meanwhile")
    assert done["ok"] == "0" and len(rows) == 3, done
    assert int(done["ms"]) >= 2000, done
    assert int(done["ticks"]) >= 30, "the loop must keep running while the worker waits"


def test_stalled_outbox_does_not_stall_another_in_the_same_process(backend, drivers):
    """Two ODBC sources in one process: one blocked on a locked table, the other keeps
    claiming (each source has its own worker; the driver manager must not serialize them)."""
    init_schema(backend, drivers)
    other = backend.table + "_b" if "." in backend.table else "outbox.other"
    assert drivers(table=other).admin("init")["rc"] == "0"
    backend.insert(2)
    d = drivers("--table2", other)
    d.send("start")
    d.up()
    d.send("start2")
    assert parse(d.expect(r"^STATE2 ", 20))["_"][1] == "UP"
    t = backend.hold_table_lock(3)
    d.send("claim 10 30000 21 relay-a")
    d.expect(r"^SUBMIT rc=0")
    time.sleep(0.3)
    d.send("claim2")
    d.expect(r"^SUBMIT2 rc=0")
    done2 = parse(d.expect(r"^DONE2 claim ", 20))
    done = parse(d.expect(r"^DONE claim ", 20))
    print(f"second outbox answered in {done2['ms']} ms while the first waited {done['ms']} ms")
    assert done2["ok"] == "0" and int(done2["ms"]) < 1500, done2
    assert done["ok"] == "0" and int(done["ms"]) >= 2000, done
    t.join(30)
    if backend.dialect == "sqlserver":
        backend.x(f"DROP TABLE IF EXISTS [outbox].[{other.split('.')[1]}_dead];"
                  f" DROP TABLE IF EXISTS [outbox].[{other.split('.')[1]}]")


def test_query_timeout_bounds_a_stalled_query(backend, drivers):
    init_schema(backend, drivers)
    backend.insert(1)
    d = drivers("--query-timeout", "1000")
    d.send("start")
    d.up()
    t = backend.hold_table_lock(4)
    done, rows = d.claim(10, 31)
    print(f"claim with query_timeout=1s against a table locked for 4 s: ok={done['ok']}"
          f" after {done['ms']} ms: {done['err']}")
    assert done["ok"] == "-1" and int(done["ms"]) < 3500, done
    t.join(30)
    # a timeout is not a lost connection: still UP, and the next claim works
    done, rows = d.claim(10, 32)
    assert done["ok"] == "0" and len(rows) == 1, done


def test_destroy_during_a_stalled_query_is_bounded(backend, drivers):
    init_schema(backend, drivers)
    d = drivers("--query-timeout", "20000")
    d.send("start")
    d.up()
    before = set(backend.relay_sessions())
    t = backend.hold_table_lock(6)
    d.send("claim 10 30000 12 relay-a")
    d.expect(r"^SUBMIT rc=0")
    wait_blocked_in_flight(backend, d, before, "claim")
    d.send("destroy")
    ms = int(d.expect(r"^DESTROYED ", 30).split("=")[1])
    print(f"destroy with a query blocked on a lock took {ms} ms (SQLCancel)")
    assert ms < 4000, ms
    t.join(30)


def test_connection_killed_fails_request_and_reconnects(backend, drivers):
    init_schema(backend, drivers)
    backend.insert(2)
    d = drivers()
    d.send("start")
    d.up()
    before = set(backend.relay_sessions())
    t = backend.hold_table_lock(3)
    d.send("claim 10 30000 13 relay-a")
    d.expect(r"^SUBMIT rc=0")
    waiting = wait_blocked_in_flight(backend, d, before, "claim")
    for p in waiting:
        backend.kill(p)
    done = parse(d.expect(r"^DONE claim ", 20))
    assert done["ok"] == "-1", done
    print("outstanding request failed with:", done["err"])
    st = d.state()
    assert st["_"][1] == "DOWN" and "connection lost" in st["msg"], st
    d.up(timeout=20)
    t.join(30)
    done, rows = d.claim(10, 14)
    assert done["ok"] == "0" and len(rows) == 2, done
