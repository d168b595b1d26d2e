"""SQL Server without a SQL Server (issue 10): every statement liboutbox and the relay send
through ODBC, captured in every SQL Server code path, parsed as T-SQL and checked.

A recording ODBC driver (tests/odbcrec/recdrv.c, compiled here and registered with
unixODBC through an odbcinst.ini in a temporary directory) reports SQL_DBMS_NAME
"Microsoft SQL Server", so liboutbox and the ODBC source take their T-SQL paths; it logs
every SQLExecDirect text with the bound parameters' types and sizes and answers with
plausible results. The paths driven:
  liboutbox   send of 1; a small and a large message in one transaction; a batch in one
              statement; a batch over SQL Server's 2,100-parameter limit (three
              statements under a savepoint); that batch failing in its second statement
              (rollback to the savepoint); a send outside a transaction (no statement);
  the relay   init (twice), check, stats, dead list / retry / purge (all and by id),
              connect, lead (acquire, renew), claim (unfenced, fenced by the leader's
              epoch, competing), settle for every outcome (sent in
              both on_sent modes, retry, dead, unclaim), retention cleanup, stats —
              through the source driver (tests/c/source_contract.c --backend odbc) — and
              init, check, stats and dead list through the outbox-relay binary; plus the
              script `outbox-relay schema --dialect sqlserver` prints for sqlcmd.
Every statement (and the dynamic SQL inside it) must parse with sqlfluff's tsql dialect
(Debian's python3 sqlfluff; see tests/tsql_check.py), and the rules hold: no range or
update locks on the producer path, parameter types and sizes fixed whatever the data,
QUOTED_IDENTIFIER (and the other options filtered indexes need) set before filtered
indexes are created or written, statistics and the lease reset never waiting for
producers, READPAST only where it is legal under READ_COMMITTED_SNAPSHOT, an idempotent
dead-letter move. test_checker_finds_broken_statements shows each rule failing on a
broken statement.

The relay's own locking on SQL Server (READ_COMMITTED_SNAPSHOT off), which Babelfish cannot
show since it ignores table hints, has rules of its own (tsql_check.py, "relay locking
rules"): membership and per-key probes that never wait, the leader fence held to the
commit, OUTPUT INTO a table variable, no UPDATE or DELETE over 4,000 rows; each is shown
failing on the statement it was written against. A deadlock victim (1205) is driven through
the recorder's injected failures.

What this does not show: that SQL Server executes the statements as intended. The same
statements execute on Babelfish for PostgreSQL in tests/test_lib_odbc.py,
tests/test_source_contract.py and tests/test_odbcsrc.py, and on a real SQL Server when
OUTBOX_TEST_MSSQL names one.
"""
import json
import os
import re
import shutil
import subprocess
import uuid

import pytest

import tsql_check as tc
from conftest import ROOT, run_prog, wait_for
from source_driver import SLOW, Driver

REC_SRC = ROOT / "tests" / "odbcrec" / "recdrv.c"
CONN = "Driver={OutboxRecorder};Database=app;"
TABLE = "outbox.messages"
QT, QD = "[outbox].[messages]", "[outbox].[messages_dead]"

# Leadership is a lease row (<table>_lease), never sp_getapplock @LockOwner = 'Session'
# (msodbcsql's connection resiliency silently drops a session lock): test_no_session_applock
# enforces that on every captured statement.
ENFORCE_NO_SESSION_APPLOCK = True

# the SET options a session needs before it creates or writes a table with filtered indexes
FILTERED_INDEX_OPTIONS = ["SET QUOTED_IDENTIFIER ON", "SET ANSI_NULLS ON", "SET ANSI_PADDING ON",
                          "SET ANSI_WARNINGS ON", "SET ARITHABORT ON",
                          "SET CONCAT_NULL_YIELDS_NULL ON", "SET NUMERIC_ROUNDABORT OFF"]


# ---------------------------------------------------------------------------- capture
class Capture:
    """The recorder's log, attributed to the operation (label) that produced it."""

    def __init__(self, build, tmp):
        self.build = build
        self.tmp = tmp
        self.log = tmp / "statements.jsonl"
        self.ops = {}          # label -> [records]
        self.producer = set()  # labels of liboutbox operations
        self.scripts = {}      # label -> text of a script (outbox-relay schema)
        self.env = dict(os.environ, ODBCSYSINI=str(tmp), OUTBOX_REC_LOG=str(self.log),
                        OUTBOX_TEST_TABLE=TABLE)
        self.env.pop("ODBCINSTINI", None)
        self.env.pop("ODBCINI", None)
        self._seen = 0

    def _take(self):
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        new = [json.loads(x) for x in lines[self._seen:]]
        self._seen = len(lines)
        return new

    def record(self, label, producer=False):
        self._take()   # anything earlier belongs to no label
        cap = self

        class _Op:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                cap.ops.setdefault(label, []).extend(cap._take())
                if producer:
                    cap.producer.add(label)
                return False
        return _Op()

    def execs(self, label=None):
        labels = [label] if label else list(self.ops)
        return [(lb, r) for lb in labels for r in self.ops.get(lb, []) if r["ev"] == "exec"]

    # --- liboutbox through tests/c/lib_send_test.c
    def lib(self, label, case, *args, want_exit=0, **env):
        with self.record(label, producer=True):
            e = dict(self.env, **env)
            p = run_prog([self.build / "tests" / "lib_send_test", "odbc", CONN, "app", case,
                          *args], env=e)
        assert p.returncode == want_exit, f"{label}: exit {p.returncode}\n{p.stdout}{p.stderr}"
        return p

    # --- the relay binary
    def relay(self, label, *args, want_exit=0):
        with self.record(label):
            p = run_prog([self.build / "outbox-relay", *args], env=self.env)
        assert p.returncode == want_exit, f"{label}: exit {p.returncode}\n{p.stdout}{p.stderr}"
        return p


def build_driver(tmp):
    so = tmp / "librecdrv.so"
    cc = os.environ.get("CC") or shutil.which("cc") or "gcc"
    cflags = subprocess.run(["pkg-config", "--cflags", "odbc"], capture_output=True,
                            text=True).stdout.split()
    r = subprocess.run([cc, "-std=c11", "-D_GNU_SOURCE", "-shared", "-fPIC", "-O1", "-g",
                        "-fvisibility=hidden", "-Wl,-Bsymbolic", "-Wall", "-Wextra", "-Wshadow",
                        "-Wformat=2", "-Wstrict-prototypes", "-Wmissing-prototypes", "-Werror",
                        *cflags, "-o", str(so), str(REC_SRC), "-lpthread"],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"building the recording driver failed:\n{r.stderr}"
    (tmp / "odbcinst.ini").write_text(f"[OutboxRecorder]\nDescription=outbox-relay tests: "
                                      f"recording driver\nDriver={so}\nUsageCount=1\n")
    (tmp / "odbc.ini").write_text("")
    return so


@pytest.fixture(scope="module")
def cap(build, tmp_path_factory):
    for prog in ("tests/lib_send_test", "tests/source_contract", "outbox-relay"):
        if not (build / prog).exists():
            pytest.fail(f"{build / prog} not built (make test-programs)", pytrace=False)
    tmp = tmp_path_factory.mktemp("tsql")
    build_driver(tmp)
    c = Capture(build, tmp)

    # ---- liboutbox (the producer path)
    rows = "params/11"   # the recorder answers "rows inserted" = bound parameters / 11
    c.lib("lib: send of 1", "send_commit", str(uuid.uuid4()), OUTBOX_REC_INT=rows)
    c.lib("lib: send, small and large data", "send_sizes", str(uuid.uuid4()),
          str(uuid.uuid4()), OUTBOX_REC_INT=rows)
    c.lib("lib: batch of 150 (one statement)", "batch", "150", "commit", OUTBOX_REC_INT=rows)
    c.lib("lib: batch of 400 (over 2,100 parameters)", "batch", "400", "commit",
          OUTBOX_REC_INT=rows)
    # after a failure liboutbox reads XACT_STATE() and @@TRANCOUNT: the recorder answers 1
    # and 1 (the transaction is intact), so the failure is a plain OUTBOX_EDB (with 0 and 0
    # it would be OUTBOX_ETXNLOST: tests/test_lib_odbc.py shows that on a T-SQL engine)
    c.lib("lib: batch of 400 failing in its second statement", "batch", "400", "commit",
          "boom", OUTBOX_REC_INT="1", OUTBOX_REC_FAIL="sp_executesql", OUTBOX_REC_FAIL_NTH="2")
    c.lib("lib: send outside a transaction", "no_txn", str(uuid.uuid4()))

    # ---- the relay: the ODBC source through its driver program
    saved = dict(os.environ)
    os.environ.update({k: c.env[k] for k in ("ODBCSYSINI", "OUTBOX_REC_LOG")})
    os.environ.pop("ODBCINSTINI", None)
    try:
        binary = build / "tests" / "source_contract"
        d = Driver(binary, "odbc", CONN, "app", table=TABLE)
        try:
            for label, cmd in [("relay: init", "init"), ("relay: init again", "init"),
                               ("relay: check", "check"), ("relay: stats (admin)", "stats"),
                               ("relay: dead retry (all)", "dead-retry"),
                               ("relay: dead retry 1 2", "dead-retry 1 2"),
                               ("relay: dead purge (all)", "dead-purge"),
                               ("relay: dead purge 3", "dead-purge 3"),
                               ("relay: dead list", "dead-list")]:
                with c.record(label):
                    r, _ = d.admin(cmd)
                assert r["rc"] == 0, (label, r)
            with c.record("relay: connect"):
                d.start_up()
            with c.record("relay: lead (acquire)"):
                done, _ = d.request("lead relay-a/0001 0 30000")
            assert done["leader"] == "1" and done["newly"] == "1", done
            with c.record("relay: lead (renew)"):
                done, _ = d.request(f"lead relay-a/0001 {done['epoch']} 30000")
            assert done["leader"] == "1" and done["newly"] == "0", done
            with c.record("relay: claim (leader, fenced by epoch)"):
                done, rows_ = d.claim(500, 7, owner="relay-a", epoch=int(done["epoch"]))
            assert done["ok"] == 0, done
            with c.record("relay: claim (competing)"):
                done, _ = d.claim(500, 6, owner="relay-a", competing=True)
            assert done["ok"] == 0, done
            with c.record("relay: claim"):
                done, rows_ = d.claim(500, 7, owner="relay-a")
            assert done["ok"] == 0 and len(rows_) == 1, done
            for label, outcome in [("relay: settle sent (on_sent=mark)", (1, 7, "S", 0)),
                                   ("relay: settle retry", (1, 7, "R", 5000, "nack: 'x'")),
                                   ("relay: settle dead", (1, 7, "D", 0, "unroutable")),
                                   ("relay: settle unclaim", (1, 7, "U", 0)),
                                   ("relay: settle every outcome at once",
                                    [(1, 7, "S", 0), (2, 7, "R", 10, "r"), (3, 7, "D", 0, "d"),
                                     (4, 7, "U", 0)])]:
                outs = outcome if isinstance(outcome, list) else [outcome]
                with c.record(label):
                    done = d.settle(*outs)
                assert done["ok"] == 0, (label, done)
            with c.record("relay: retention cleanup"):
                done, _ = d.request("cleanup 604800000 1000")
            assert done["ok"] == 0, done
            with c.record("relay: stats"):
                done, _ = d.request("stats")
            assert done["ok"] == 0, done
            with c.record("relay: settle of 9,000 outcomes"):
                done = d.settle(*[(i, 7, "S", 0) for i in range(1, 9001)])
            assert done["ok"] == 0, done
        finally:
            d.close()
        os.environ["OUTBOX_REC_COMPAT"] = "120"
        d = Driver(binary, "odbc", CONN, "app", table=TABLE)
        try:
            with c.record("relay: check at compatibility level 120"):
                r, _ = d.admin("check")
            c.compat_refused = r
        finally:
            d.close()
            del os.environ["OUTBOX_REC_COMPAT"]
        d = Driver(binary, "odbc", CONN, "app", "--on-sent", "delete", table=TABLE)
        try:
            with c.record("relay: connect (on_sent=delete)"):
                d.start_up()
            with c.record("relay: settle sent (on_sent=delete)"):
                done = d.settle((1, 7, "S", 0))
            assert done["ok"] == 0, done
        finally:
            d.close()
    finally:
        os.environ.clear()
        os.environ.update(saved)

    # ---- the relay binary's admin commands, and the script for sqlcmd
    ini = c.tmp / "relay.ini"
    ini.write_text("[sink.main]\nurl = amqp://guest:guest@127.0.0.1:5672/%2f\n\n"
                   "[outbox.orders]\nsource = sqlserver\n"
                   f"conninfo = \"{CONN}\"\ndatabase = app\ntable = {TABLE}\n")
    c.relay("relay CLI: init", "init", "-c", ini)
    c.relay("relay CLI: stats", "stats", "-c", ini)
    c.relay("relay CLI: dead list", "dead", "-c", ini, "list")
    p = c.relay("relay CLI: schema", "schema", "--dialect", "sqlserver", "--table", TABLE)
    c.scripts["outbox-relay schema --dialect sqlserver"] = p.stdout
    return c


# ---------------------------------------------------------------------------- helpers
def batches(cap):
    """Every batch sent, with its dynamic SQL, as (label, where, sql, record)."""
    out = []

    def add(label, where, sql, rec, depth=0):
        out.append((label, where, sql, rec))
        if depth < 4:
            for k, dyn in enumerate(tc.dynamic_sql(sql)):
                add(label, f"{where} → dynamic SQL #{k + 1} ({dyn.kind})", dyn.sql, rec,
                    depth + 1)

    for label, rec in cap.execs():
        add(label, f"statement {rec['seq']}", rec["sql"], rec)
    for label, text in cap.scripts.items():
        for k, b in enumerate(split_go(text)):
            add(label, f"batch {k + 1}", b, None)
    return out


def split_go(script):
    """sqlcmd's batches: text between lines that hold only GO."""
    parts, cur = [], []
    for line in script.splitlines():
        if line.strip().upper() == "GO":
            parts.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    if "\n".join(cur).strip():
        parts.append("\n".join(cur))
    return [p for p in parts if p.strip()]


_PARSED = {}


def parsed(sql):
    if sql not in _PARSED:
        _PARSED[sql] = tc.parse(tc.number_params(sql)[0])
    return _PARSED[sql]


def norm_ws(s):
    return re.sub(r"\s+", " ", s).strip().upper()


def filtered_index(sql):
    return re.search(r"\bCREATE\s+(UNIQUE\s+)?(NONCLUSTERED\s+)?INDEX\b[^;]*\bWHERE\b", sql,
                     re.I | re.S) is not None


# ---------------------------------------------------------------------------- tests
def test_every_path_was_driven(cap):
    """Each operation sent what it should; the large batch stayed under 2,100 parameters
    per statement; the send outside a transaction sent nothing."""
    report = []
    for label, recs in cap.ops.items():
        n = sum(1 for r in recs if r["ev"] == "exec")
        report.append(f"{n:3d}  {label}")
    print("statements captured per operation:\n" + "\n".join(report))
    empty = [lb for lb, recs in cap.ops.items()
             if not any(r["ev"] == "exec" for r in recs)
             and lb not in ("lib: send outside a transaction", "relay CLI: schema")]
    assert not empty, f"operations that sent no statement: {empty}"
    assert not cap.execs("lib: send outside a transaction"), \
        "a send outside a transaction must send nothing"
    big = [r for _, r in cap.execs("lib: batch of 400 (over 2,100 parameters)")
           if r["params"]]
    assert len(big) == 3 and sum(len(r["params"]) for r in big) == 400 * 11, \
        [len(r["params"]) for r in big]
    assert "SAVE TRANSACTION" in cap.execs("lib: batch of 400 (over 2,100 parameters)")[0][1]["sql"]
    failed = [r["sql"] for _, r in cap.execs("lib: batch of 400 failing in its second statement")]
    assert any("ROLLBACK TRANSACTION outbox_send_batch" in s for s in failed), \
        "the failing batch must roll back to its savepoint"
    for label in ("relay: init", "relay: init again"):
        sqls = [r["sql"] for _, r in cap.execs(label)]
        assert sum(filtered_index(s) for s in sqls) == 4, (label, len(sqls))   # pending, failing, sent, per-key


def test_every_statement_parses_as_tsql(cap):
    """Every batch, its dynamic SQL and sp_executesql's declarations, with sqlfluff (tsql)."""
    failures = []
    seen = set()
    all_batches = batches(cap)
    for label, where, sql, rec in all_batches:
        if sql in seen:
            continue
        seen.add(sql)
        p = parsed(sql)
        if p.errors:
            failures.append(f"{label}, {where}: does not parse as T-SQL:\n  "
                            + "\n  ".join(p.errors[:5]) + f"\n  --- statement ---\n{sql[:1500]}")
        for dyn in tc.dynamic_sql(sql):
            if dyn.decl:
                d = tc.parse(f"DECLARE {dyn.decl};")
                if d.errors:
                    failures.append(f"{label}, {where}: sp_executesql declaration does not "
                                    f"parse: {d.errors[:3]}\n{dyn.decl[:500]}")
    print(f"{len(seen)} distinct batches (of {len(all_batches)}) parsed as T-SQL")
    assert not failures, "\n\n".join(failures)


def test_producer_path_takes_no_range_or_update_locks(cap):
    """liboutbox: no HOLDLOCK / SERIALIZABLE / UPDLOCK / XLOCK / table locks, no raised
    isolation level, no IGNORE_DUP_KEY: concurrent producers never wait for each other."""
    problems = []
    n = 0
    for label, where, sql, rec in batches(cap):
        if label not in cap.producer:
            continue
        n += 1
        for msg in tc.hint_problems(parsed(sql), producer=True) + \
                tc.isolation_problems(sql, producer=True):
            problems.append(f"{label}, {where}: {msg}")
        if re.search(r"\b(HOLDLOCK|SERIALIZABLE|UPDLOCK|XLOCK|TABLOCKX?)\b",
                     " ".join(tc.words(sql))):
            problems.append(f"{label}, {where}: names a range/update/table lock hint")
    assert n > 0
    assert not problems, "\n".join(problems)


def test_table_hints_are_legal_everywhere(cap):
    """No conflicting hints; READPAST only with UPDLOCK, XLOCK or READCOMMITTEDLOCK (legal
    under READ_COMMITTED_SNAPSHOT, Azure SQL's default); no IGNORE_DUP_KEY anywhere."""
    problems = []
    for label, where, sql, rec in batches(cap):
        for msg in tc.hint_problems(parsed(sql), producer=False) + \
                tc.isolation_problems(sql, producer=False):
            problems.append(f"{label}, {where}: {msg}")
    assert not problems, "\n".join(problems)


def test_parameter_types_and_sizes_do_not_depend_on_the_data(cap):
    """Every binding is nvarchar(255|4000|max), varbinary(max), a UUID's char(36) or a
    number (never text/ntext/image); the same statement always has the same bindings, also
    for a message with 255-character texts, 9,000-character headers and a 100 kB payload;
    sp_executesql declares exactly the types bound."""
    problems = []
    sigs = {}
    for label, rec in cap.execs():
        for msg in tc.param_problems(rec["params"]):
            problems.append(f"{label}, statement {rec['seq']}: {msg}")
        sigs.setdefault(rec["sql"], set()).add(tc.signature(rec["params"]))
        for dyn in tc.dynamic_sql(rec["sql"]):
            if dyn.kind == "sp_executesql" and dyn.decl:
                for msg in tc.decl_problems(dyn.decl, rec["params"]):
                    problems.append(f"{label}, statement {rec['seq']}: {msg}")
    for sql, s in sigs.items():
        if len(s) > 1:
            problems.append(f"one statement bound {len(s)} ways: {sql[:200]}")
    sizes = [r for _, r in cap.execs("lib: send, small and large data")]
    assert len(sizes) == 2, "two sends"
    small, large = sizes
    lens = [p["len"] for p in large["params"]]
    assert lens[1] == 255 * 2 and lens[7] > 9000 * 2 and lens[8] == 100000, lens
    if small["sql"] != large["sql"]:
        problems.append("a small and a large message were sent as different statements")
    for k, (a, b) in enumerate(zip(small["params"], large["params"]), 1):
        if tc.signature([a]) != tc.signature([b]):
            problems.append(f"parameter {k}: bound as {tc.signature([a])[0]} for a small "
                            f"message, {tc.signature([b])[0]} for a large one")
    assert not problems, "\n".join(problems)


def session_options_done(sql):
    """The filtered-index options (in order) a batch sets, as a set."""
    text = norm_ws(" ".join(t.text for t in tc.scan(sql) if t.kind not in ("cmt",)))
    return {o for o in FILTERED_INDEX_OPTIONS if o in text}


def test_quoted_identifier_before_filtered_indexes(cap):
    """On every connection (and in the sqlcmd script) QUOTED_IDENTIFIER and the other
    options filtered indexes need are set in an earlier batch than any CREATE INDEX ...
    WHERE; every write to the outbox runs with them set."""
    problems = []
    n_idx = 0
    conn_opts = {}
    for label, rec in cap.execs():
        key = (rec["pid"], rec["conn"])
        have = conn_opts.setdefault(key, set())
        sql = rec["sql"]
        if filtered_index(sql):
            n_idx += 1
            missing = [o for o in FILTERED_INDEX_OPTIONS if o not in have]
            if missing:
                problems.append(f"{label}, statement {rec['seq']}: a filtered index is created "
                                f"before {missing} on this connection")
        writes = re.search(r"\b(INSERT\s+INTO|UPDATE|DELETE)\b[^;]*" + re.escape(QT), sql,
                           re.I | re.S)
        inner = [dyn.sql for dyn in tc.dynamic_sql(sql)]
        if writes or any(QT in x for x in inner):
            local = set(have)
            for x in inner:
                local |= session_options_done(x)
            missing = [o for o in FILTERED_INDEX_OPTIONS if o not in local]
            if missing:
                problems.append(f"{label}, statement {rec['seq']}: writes {QT} without "
                                f"{missing} set")
        have |= session_options_done(sql)
    assert n_idx >= 6, n_idx
    for name, text in cap.scripts.items():
        assert text.startswith("SET QUOTED_IDENTIFIER ON;\nSET ANSI_NULLS ON;"), text[:200]
        have = set()
        for k, b in enumerate(split_go(text)):
            if filtered_index(b):
                missing = [o for o in FILTERED_INDEX_OPTIONS if o not in have]
                if missing:
                    problems.append(f"{name}, batch {k + 1}: filtered index before {missing}")
            have |= session_options_done(b)
    assert not problems, "\n".join(problems)


def test_relay_sessions_set_their_options_first(cap):
    """The relay sets what its statements need on every connection before anything else:
    the filtered-index options, XACT_ABORT ON, READ COMMITTED."""
    problems = []
    first = {}
    for label, rec in cap.execs():
        if label in cap.producer:
            continue
        first.setdefault((rec["pid"], rec["conn"]), (label, rec))
    assert len(first) >= 10, len(first)
    for (pid, conn), (label, rec) in first.items():
        text = norm_ws(rec["sql"])
        need = FILTERED_INDEX_OPTIONS + ["SET XACT_ABORT ON",
                                         "SET TRANSACTION ISOLATION LEVEL READ COMMITTED",
                                         "SET DEADLOCK_PRIORITY LOW"]
        missing = [o for o in need if o not in text]
        if missing:
            problems.append(f"{label}: the first statement of connection {pid}/{conn} does "
                            f"not set {missing}: {rec['sql'][:120]}")
    assert not problems, "\n".join(problems)


def test_statistics_and_lease_reset_never_wait_for_producers(cap):
    """stats reads every table WITH (READPAST, ...); the lease reset of a new leader and the
    retention cleanup skip locked rows too."""
    problems = []

    def check(label, pred, what):
        stmts = [r["sql"] for _, r in cap.execs(label) if pred(r["sql"])]
        if not stmts:
            problems.append(f"{label}: no {what} statement captured")
        for sql in stmts:
            p = parsed(sql)
            refs = len(re.findall(re.escape(QT) + "|" + re.escape(QD), sql))
            with_rp = sum(1 for hs in p.hints if "READPAST" in hs)
            if with_rp < refs:
                problems.append(f"{label}: {what} reads {refs} outbox tables, only "
                                f"{with_rp} WITH (READPAST ...): {sql[:300]}")

    for label in ("relay: stats", "relay: stats (admin)", "relay CLI: stats"):
        check(label, lambda s: "COUNT_BIG" in s, "statistics")
    check("relay: lead (acquire)", lambda s: ("UPDATE " + QT.upper() + " WITH") in s.upper(),
          "lease reset")
    check("relay: retention cleanup", lambda s: "DELETE TOP" in s.upper(), "cleanup")
    assert not problems, "\n".join(problems)


def test_dead_letter_move_is_idempotent(cap):
    """Rows reach the dead table only by an INSERT that follows a DELETE of the same ids from
    it in the same batch (a retried move replaces, never trips the primary key); never by
    OUTPUT INTO the dead table directly. dead retry never re-inserts an id twice."""
    problems = []
    n = 0
    for label, where, sql, rec in batches(cap):
        if label not in ("relay: settle dead", "relay: settle every outcome at once",
                         "relay: settle sent (on_sent=delete)"):
            continue
        p = parsed(sql)
        deleted_dead = False
        for kind, raw in p.statements:
            r = norm_ws(raw)
            if kind == "delete_statement" and QD.upper() in r:
                deleted_dead = True
            if kind == "insert_statement" and r.startswith(f"INSERT INTO {QD.upper()}"):
                n += 1
                if not deleted_dead:
                    problems.append(f"{label}: INSERT INTO {QD} without first removing the "
                                    f"ids already there")
            if re.search(r"\bOUTPUT\b.*\bINTO\s+" + re.escape(QD.upper()), r):
                problems.append(f"{label}: OUTPUT ... INTO {QD} fails when the id is there")
    assert n >= 3, n
    for _, rec in cap.execs("relay: dead retry 1 2"):
        if "IDENTITY_INSERT" in rec["sql"]:
            assert re.search(r"NOT EXISTS \(SELECT 1 FROM " + re.escape(QT) + r" o WHERE o\.id "
                             r"= d\.id", rec["sql"]), "dead retry must skip ids already back"
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not ENFORCE_NO_SESSION_APPLOCK,
                    reason="PENDING: leadership still uses sp_getapplock @LockOwner = 'Session' "
                           "until the lease row lands; set ENFORCE_NO_SESSION_APPLOCK = True then")
def test_no_session_applock(cap):
    """Leadership must not rest on a session-owned application lock (connection resiliency
    reconnects silently and drops it)."""
    bad = [(label, where) for label, where, sql, rec in batches(cap)
           if "SP_GETAPPLOCK" in tc.words(sql)
           and re.search(r"@LockOwner\s*=\s*N?'Session'", sql, re.I)]
    assert not bad, bad


def test_every_sqlcmd_call_passes_dash_I():
    """sqlcmd runs with QUOTED_IDENTIFIER OFF unless given -I (then the filtered indexes
    fail with Msg 1934): every sqlcmd command line in deploy/, scripts/ and the READMEs
    passes it."""
    calls, bad = 0, []
    files = [p for d in ("deploy", "scripts") for p in sorted((ROOT / d).rglob("*"))
             if p.is_file()] + sorted(ROOT.glob("*.md")) + sorted(ROOT.glob("*/README.md"))
    for f in files:
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            # a command: sqlcmd (or a path ending in it) followed by an option or piped into
            for m in re.finditer(r"(?:\|\s*)?\S*\bsqlcmd\b(?=\s+-|\s*$|\s*[,;)`\"])", line):
                piped = m.group(0).lstrip().startswith("|")
                rest = line[m.end():]
                if not (piped or rest.lstrip().startswith("-")):
                    continue
                calls += 1
                if not re.search(r"(^|\s)-I(\s|$|[,;)`\"])", rest):
                    bad.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert calls >= 3, calls
    assert not bad, "sqlcmd without -I:\n" + "\n".join(bad)


# ---------------------------------------------------------------------------- relay locking
# SQL Server's locking (READ_COMMITTED_SNAPSHOT off) cannot be shown on Babelfish, which ignores
# table hints: these rules (tests/tsql_check.py, "relay locking rules") hold on every relay
# statement captured, and test_relay_rules_fail_on_the_old_statements shows each failing on
# the statement it was written against.
QL = "[outbox].[messages_lease]"
RELAY_CLAIMS = ("relay: claim (leader, fenced by epoch)", "relay: claim (competing)",
                "relay: claim")


def relay_batches(cap):
    return [(label, where, sql) for label, where, sql, rec in batches(cap)
            if rec is not None and label not in cap.producer]


def test_relay_statements_keep_the_locking_rules(cap):
    """Competing claims read membership without locks and by a sargable predicate; claims
    read the outbox only WITH (READPAST, UPDLOCK) or WITH (NOLOCK), never waiting for a
    producer; a fenced statement holds the leader row to its commit; OUTPUT always goes INTO
    a table variable, unconverted; no UPDATE or DELETE of the outbox or dead table is
    unbounded (lock escalation)."""
    problems = []
    for label, where, sql in relay_batches(cap):
        found = tc.lease_table_problems(sql, QL) + tc.fence_problems(sql, QL) + \
            tc.lead_problems(sql, QL) + \
            tc.output_problems(sql) + tc.escalation_problems(sql, [QT, QD])
        if label in RELAY_CLAIMS:
            found += tc.probe_problems(sql, QT) + tc.first_failed_problems(sql, QT)
        if label == "relay: claim (competing)":
            found += tc.mode_problems(sql, QL, QT)
        problems += [f"{label}, {where}: {m}" for m in found]
    for label, rec in cap.execs():
        if label not in cap.producer:
            problems += [f"{label}, statement {rec['seq']}: {m}" for m in
                         tc.fence_txn_problems(rec["sql"], rec["autocommit"] == 1, QL)]
    assert not problems, "\n".join(problems)
    fenced = [r["sql"] for _, r in cap.execs("relay: claim (leader, fenced by epoch)")
              if "N'leader'" in r["sql"]]
    assert fenced, "the fenced claim was not captured"


def test_settles_are_split_below_lock_escalation(cap):
    """A settle of 9,000 outcomes runs as three statements of at most 4,000 outcomes each."""
    execs = [r for _, r in cap.execs("relay: settle of 9,000 outcomes") if r["params"]]
    assert len(execs) == 3, [len(r["params"]) for r in execs]
    for r in execs:
        n = r["params"][0]["len"] // 2          # UTF-16 bytes → characters of the JSON
        assert n < 4001 * len('{"id":9000,"token":7,"kind":0,"backoff_ms":0,"reason":null},'), n


def test_compatibility_level_is_checked_before_openjson(cap):
    """Every connection that runs OPENJSON read the database's compatibility level first, and
    check refuses a database below 130 with one line naming the level and the fix."""
    problems = []
    checked = set()
    for label, rec in cap.execs():
        if label in cap.producer:
            continue
        key = (rec["pid"], rec["conn"])
        if "compatibility_level" in rec["sql"]:
            checked.add(key)
        if "OPENJSON(" in rec["sql"].upper() and key not in checked and \
                not label.startswith("relay: dead"):
            problems.append(f"{label}: OPENJSON before the compatibility level was read")
    assert not problems, "\n".join(problems)
    r = cap.compat_refused
    assert r["rc"] == -1 and r["error"] == (
        'database "app" is at compatibility level 120; the relay needs 130 or higher '
        '(OPENJSON): ALTER DATABASE [app] SET COMPATIBILITY_LEVEL = 130'), r


def test_a_deadlock_victim_is_retried_and_reported_once(build, tmp_path):
    """A request chosen as the deadlock victim (1205, SQLSTATE 40001: the server rolled its
    transaction back) is run again: a claim failing once succeeds on its second attempt; a
    settle failing every time is tried three times and reported once, as a failed request
    (nothing is dead-lettered: the settle's outcomes are not changed). Neither rolls back a
    transaction the server no longer holds (the rollback is conditional on @@TRANCOUNT)."""
    build_driver(tmp_path)
    log = tmp_path / "statements.jsonl"
    saved = dict(os.environ)
    os.environ.update(ODBCSYSINI=str(tmp_path), OUTBOX_REC_LOG=str(log),
                      OUTBOX_REC_FAIL_STATE="40001", OUTBOX_REC_FAIL_NATIVE="1205")
    os.environ.pop("ODBCINSTINI", None)
    try:
        os.environ.update(OUTBOX_REC_FAIL="@lease_ms int = ?", OUTBOX_REC_FAIL_NTH="1")
        d = Driver(build / "tests" / "source_contract", "odbc", CONN, "app", table=TABLE)
        try:
            d.start_up()
            done, rows = d.claim(10, 7, owner="relay-a")
            assert done["ok"] == 0 and len(rows) == 1, done
        finally:
            d.close()
        claims = [json.loads(x)["sql"] for x in log.read_text().splitlines()
                  if '"exec"' in x and "@lease_ms int = ?" in x]
        assert len(claims) == 2, len(claims)
        os.environ.update(OUTBOX_REC_FAIL="@outcomes nvarchar(max) = ?", OUTBOX_REC_FAIL_NTH="1+")
        d = Driver(build / "tests" / "source_contract", "odbc", CONN, "app", table=TABLE)
        try:
            d.start_up()
            log.write_text("")
            done = d.settle((1, 7, "D", 0, "poison"))
            assert done["ok"] == -1 and "injected failure" in done["error"], done
            d.absent(r"^DONE", 0.5)
        finally:
            d.close()
        recs = [json.loads(x) for x in log.read_text().splitlines()]
        settles = [r for r in recs if r["ev"] == "exec" and "@outcomes" in r["sql"]]
        assert len(settles) == 3, len(settles)
        # backed off between attempts (jittered from 200 ms, doubling): no spinning
        gaps = [b["ms"] - a["ms"] for a, b in zip(settles, settles[1:])]
        assert gaps[0] >= 95 and gaps[1] >= 195, gaps
        # the relay's session runs with autocommit on: the client never ends a transaction
        # itself, and after each failure one statement rolls back only a transaction the
        # server still holds
        assert not [r for r in recs if r["ev"] == "endtran"]
        rollbacks = [r["sql"] for r in recs if r["ev"] == "exec" and "ROLLBACK" in r["sql"].upper()]
        assert rollbacks == ["IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION"] * 3, rollbacks
        # a source destroyed while it backs off stops at once, without another attempt
        os.environ.update(OUTBOX_REC_FAIL="@lease_ms int = ?", OUTBOX_REC_FAIL_NTH="1+")
        d = Driver(build / "tests" / "source_contract", "odbc", CONN, "app", table=TABLE)
        try:
            d.start_up()
            log.write_text("")
            d.submit("claim 10 30000 7 relay-a")
            wait_for(lambda: "@lease_ms int = ?" in log.read_text(), timeout=10,
                     desc="the first claim attempt")
            ms = d.stop()
            n = sum(1 for x in log.read_text().splitlines() if "@lease_ms int = ?" in x)
        finally:
            d.close()
        print(f"destroy during the deadlock back-off took {ms} ms after {n} attempt(s)")
        assert n <= 2 and ms < 150 * SLOW, (n, ms)
    finally:
        os.environ.clear()
        os.environ.update(saved)


# The statements as they were before these rules (sources/sql_tsql.c at 9c1a646), abridged
# to the part each rule reads; markers numbered as the server sees them.
OLD = {
    "membership count": (
        "DECLARE @n int, @r int; SELECT @n = COUNT(*) + 1, @r = ISNULL(SUM(CASE WHEN owner < "
        "@owner THEN 1 ELSE 0 END), 0) FROM [outbox].[messages_lease] WHERE LEFT(name, 7) = "
        "N'member:' AND owner <> @owner AND expires_at > SYSUTCDATETIME();", "lease"),
    "head probe": (
        "INSERT INTO @c0 (id, partition_key) SELECT TOP (@P3) m.id, m.partition_key FROM "
        "[outbox].[messages] m WITH (ROWLOCK, READPAST, UPDLOCK) WHERE m.sent_at IS NULL AND "
        "NOT EXISTS (SELECT 1 FROM (SELECT TOP (1) h.id FROM [outbox].[messages] h WITH "
        "(READCOMMITTEDLOCK) WHERE h.partition_key = m.partition_key AND h.sent_at IS NULL "
        "ORDER BY h.id) hd WHERE hd.id < m.id) ORDER BY m.id;", "probe"),
    "leader fence": (
        "WITH c AS (SELECT TOP (@P1) m.* FROM [outbox].[messages] m WITH (ROWLOCK, READPAST, "
        "UPDLOCK) WHERE m.sent_at IS NULL AND (@P2 = 0 OR EXISTS (SELECT 1 FROM "
        "[outbox].[messages_lease] f WHERE f.name = N'leader' AND f.owner = @P3 AND f.epoch = "
        "@P4 AND f.expires_at > SYSUTCDATETIME())) ORDER BY m.id) UPDATE c SET lease_owner = "
        "@P5", "fence"),
    # (the fenced claim as it ran until the relay's sessions ran with autocommit on: under
    # implicit transactions, the fence an IF of its own; autocommit off is the "~" prefix)
    "leader fence held to the client's commit": (
        "~IF @epoch = 0 OR EXISTS (SELECT 1 FROM [outbox].[messages_lease] f WITH (UPDLOCK, "
        "HOLDLOCK, ROWLOCK) WHERE f.name = N'leader' AND f.owner = @owner AND f.epoch = @epoch "
        "AND f.expires_at > SYSUTCDATETIME()) UPDATE [outbox].[messages] WITH (ROWLOCK) SET "
        "lease_owner = @owner OUTPUT inserted.id INTO @c (id) WHERE id IN (SELECT TOP (@limit) "
        "m.id FROM [outbox].[messages] m WITH (ROWLOCK, READPAST, UPDLOCK) ORDER BY m.id); "
        "SELECT id FROM @c ORDER BY id", "fence txn"),
    # (the same statement under autocommit: the IF releases the row before the UPDATE)
    "leader fence checked apart from the write": (
        "IF @epoch = 0 OR EXISTS (SELECT 1 FROM [outbox].[messages_lease] f WITH (UPDLOCK, "
        "HOLDLOCK, ROWLOCK) WHERE f.name = N'leader' AND f.owner = @owner AND f.epoch = @epoch "
        "AND f.expires_at > SYSUTCDATETIME()) UPDATE [outbox].[messages] WITH (ROWLOCK) SET "
        "lease_owner = @owner OUTPUT inserted.id INTO @c (id) WHERE id IN (SELECT TOP (@limit) "
        "m.id FROM [outbox].[messages] m WITH (ROWLOCK, READPAST, UPDLOCK) ORDER BY m.id); "
        "SELECT id FROM @c ORDER BY id", "fence txn"),
    # (the leader claim until the first failed row per key was computed once per claim)
    "first failed row per candidate": (
        "SELECT TOP (@limit) m.id FROM [outbox].[messages] m WITH (ROWLOCK, READPAST, UPDLOCK) "
        "WHERE m.sent_at IS NULL AND (m.partition_key IS NULL OR NOT EXISTS (SELECT 1 FROM "
        "[outbox].[messages] p WITH (NOLOCK) WHERE p.partition_key = m.partition_key AND "
        "p.sent_at IS NULL AND p.attempts > 0 AND p.id < m.id)) ORDER BY m.id", "first failed"),
    # (the competing claim until it held the leader row: read WITH (NOLOCK), before its
    # transaction)
    "leader row read apart from the competing claim": (
        "DECLARE @kept int = 0; IF @lease_ms > 0 AND (SELECT x.owner FROM "
        "[outbox].[messages_lease] x WITH (NOLOCK) WHERE x.name = N'leader' AND x.expires_at > "
        "SYSUTCDATETIME()) IS NOT NULL SELECT @kept = 1, @limit = 0; BEGIN TRANSACTION; "
        "INSERT INTO @c0 (id, partition_key, sz) SELECT TOP (@limit) m.id, m.partition_key, 0 "
        "FROM [outbox].[messages] m WITH (ROWLOCK, READPAST, UPDLOCK) WHERE m.sent_at IS NULL "
        "ORDER BY m.id; COMMIT TRANSACTION;", "mode"),
    # (the lead until it read the leader row WITH (XLOCK): UPDLOCK is compatible with the
    # S lock a competing claim in flight holds)
    "lead beside a competing claim": (
        "BEGIN TRANSACTION; SELECT @cur_owner = owner, @cur_epoch = epoch FROM "
        "[outbox].[messages_lease] WITH (UPDLOCK, HOLDLOCK) WHERE name = N'leader'; "
        "SET @member = (SELECT MIN(x.owner) FROM [outbox].[messages_lease] x WITH (NOLOCK) "
        "WHERE x.name LIKE N'member:%');", "lead"),
    "OUTPUT without INTO": (
        "UPDATE c SET lease_owner = @P5, lease_token = @P6 OUTPUT inserted.id, "
        "LOWER(CONVERT(nvarchar(36), inserted.message_id)), inserted.exchange", "output"),
    "unbounded lease reset": (
        "IF @got <> 0 AND @got <> @mine BEGIN UPDATE [outbox].[messages] WITH (READPAST, "
        "READCOMMITTEDLOCK) SET lease_owner = NULL, lease_token = NULL, lease_until = NULL "
        "WHERE sent_at IS NULL AND lease_token IS NOT NULL; SET @reset = @@ROWCOUNT; END",
        "escalation"),
    "unbounded purge": (
        "DELETE FROM [outbox].[messages_dead] WHERE @P1 = 1 OR id IN (SELECT CAST(j.value AS "
        "bigint) FROM OPENJSON(@P2) AS j)", "escalation"),
}


@pytest.mark.parametrize("case", sorted(OLD))
def test_relay_rules_fail_on_the_old_statements(case):
    sql, rule = OLD[case]
    found = {"lease": lambda: tc.lease_table_problems(sql, QL),
             "probe": lambda: tc.probe_problems(sql, QT),
             "fence": lambda: tc.fence_problems(sql, QL),
             "fence txn": lambda: tc.fence_txn_problems(sql.lstrip("~"),
                                                        not sql.startswith("~"), QL),
             "output": lambda: tc.output_problems(sql),
             "mode": lambda: tc.mode_problems(sql, QL, QT),
             "lead": lambda: tc.lead_problems(sql, QL),
             "first failed": lambda: tc.first_failed_problems(sql, QT),
             "escalation": lambda: tc.escalation_problems(sql, [QT, QD])}[rule]()
    assert found, f"the {rule} rule passes the old statement"
    print("\n".join(found))

def test_producer_batches_open_their_transaction_with_a_real_read(cap):
    """liboutbox's batch over the parameter limit sets a savepoint, which needs an open
    transaction: with implicit transactions only a read of a table opens one, and a read
    that cannot return a row (the earlier SELECT TOP (0) ... WHERE message_id IS NULL) is a
    constant scan that reads none."""
    problems, n = [], 0
    for label, where, sql, rec in batches(cap):
        if label not in cap.producer or "SAVE TRANSACTION" not in sql.upper():
            continue
        n += 1
        problems += [f"{label}, {where}: {m}" for m in tc.opener_problems(sql)]
    assert n >= 2, n
    assert not problems, "\n".join(problems)


def test_producer_and_init_never_output_without_into(cap):
    """No statement of liboutbox or of init sends OUTPUT rows to the client: on a table with
    a trigger SQL Server refuses that (Msg 334)."""
    problems, n = [], 0
    ddl = ("relay: init", "relay: init again", "relay CLI: init", "relay CLI: schema")
    for label, where, sql, rec in batches(cap):
        if label not in cap.producer and label not in ddl:
            continue
        n += 1
        problems += [f"{label}, {where}: {m}" for m in tc.output_into_problems(sql)]
    assert n >= 20, n
    assert not problems, "\n".join(problems)


def test_escalation_rule_reads_through_derived_tables():
    """The claims filter their TOP (n) candidates by the byte limit in derived tables: the
    bound still holds and the rule sees it; the same nesting without a TOP is unbounded."""
    bounded = (
        "UPDATE [outbox].[messages] WITH (ROWLOCK) SET lease_owner = @owner WHERE sent_at IS "
        "NULL AND id IN (SELECT z.id FROM (SELECT t.id, SUM(t.sz) OVER (ORDER BY t.id ROWS "
        "UNBOUNDED PRECEDING) AS run, ROW_NUMBER() OVER (ORDER BY t.id) AS rn FROM (SELECT TOP "
        "(@limit) m.id, DATALENGTH(m.payload) AS sz FROM [outbox].[messages] m WITH (ROWLOCK, "
        "READPAST, UPDLOCK) WHERE m.sent_at IS NULL ORDER BY m.id) t) z WHERE z.run <= "
        "@max_bytes);")
    assert tc.escalation_problems(bounded, [QT, QD]) == []
    unbounded = bounded.replace("SELECT TOP (@limit) m.id", "SELECT m.id").replace(
        " ORDER BY m.id) t)", ") t)")
    found = tc.escalation_problems(unbounded, [QT, QD])
    assert found, "the rule passes an UPDATE over an unbounded derived table"
    print("\n".join(found))


# ---------------------------------------------------------------------------- the checker
BROKEN = {
    "does not parse": ("SELECT id FROM [outbox].[messages] WHERE id = = 1", "parse"),
    "HOLDLOCK on the producer path": (
        "INSERT INTO [outbox].[messages] (message_id) SELECT v.m FROM (VALUES (@P1)) AS v(m) "
        "WHERE NOT EXISTS (SELECT 1 FROM [outbox].[messages] o WITH (UPDLOCK, HOLDLOCK) "
        "WHERE o.message_id = v.m)", "producer"),
    "READPAST alone": ("SELECT COUNT_BIG(*) FROM [outbox].[messages] WITH (READPAST)",
                       "hints"),
    "conflicting hints": ("SELECT 1 FROM [outbox].[messages] WITH (ROWLOCK, READCOMMITTEDLOCK)",
                          "hints"),
    "IGNORE_DUP_KEY": ("CREATE UNIQUE INDEX [u] ON [outbox].[messages] (message_id) "
                       "WITH (IGNORE_DUP_KEY = ON)", "hints"),
}


# liboutbox's and init's rules, each failing on the statement it was written against
BROKEN_LIB = {
    "savepoint opened by a constant scan": (
        "IF XACT_STATE() = -1 THROW 51000, N'outbox: the transaction is doomed: roll it back', "
        "1;\nIF @@TRANCOUNT = 0 BEGIN DECLARE @outbox_t int; SELECT TOP (0) @outbox_t = 1 "
        "FROM [outbox].[messages] WHERE message_id IS NULL; END;\n"
        "SAVE TRANSACTION outbox_send_batch;", tc.opener_problems),
    "OUTPUT to the client": (
        "UPDATE [outbox].[messages] SET lease_owner = N'a' OUTPUT inserted.id "
        "WHERE id = 1", tc.output_into_problems),
}


@pytest.mark.parametrize("case", sorted(BROKEN_LIB))
def test_lib_rules_find_their_broken_statement(case):
    sql, rule = BROKEN_LIB[case]
    assert not tc.parse(sql).errors
    assert rule(sql), f"{case}: the rule does not see it"
    fixed = {"savepoint opened by a constant scan":
             sql.replace("TOP (0)", "TOP (1)").replace(
                 "message_id IS NULL", "message_id = '00000000-0000-0000-0000-000000000000'"),
             "OUTPUT to the client":
             "DECLARE @t TABLE (id bigint); UPDATE [outbox].[messages] SET lease_owner = N'a' "
             "OUTPUT inserted.id INTO @t (id) WHERE id = 1; SELECT id FROM @t"}
    assert not rule(fixed[case]), f"{case}: the rule refuses the fixed form"


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_checker_finds_broken_statements(case):
    """The rules are not vacuous: each finds its broken statement."""
    sql, rule = BROKEN[case]
    p = tc.parse(sql)
    if rule == "parse":
        assert p.errors, "a broken statement parsed"
    elif rule == "producer":
        assert not p.errors, p.errors
        assert tc.hint_problems(p, producer=True)
    else:
        assert not p.errors, p.errors
        assert tc.hint_problems(p, producer=False) + tc.isolation_problems(sql, False)


def test_checker_finds_data_sized_and_legacy_bindings():
    ok = {"n": 1, "ctype": -8, "stype": -9, "size": 255, "digits": 0, "len": 10}
    assert not tc.param_problems([ok])
    assert tc.param_problems([dict(ok, size=5)]), "nvarchar(5): sized by the data"
    assert tc.param_problems([dict(ok, stype=-10, size=5000)]), "ntext"
    assert tc.param_problems([dict(ok, ctype=-2, stype=-4, size=9000)]), "image"
    assert tc.param_problems([dict(ok, n=k) for k in range(1, 2101)]), "2,100 parameters"
    assert tc.decl_problems("@a nvarchar(255)", [dict(ok, size=0)]), "declared 255, bound max"


def test_list_shortening_keeps_what_differs():
    rows = ", ".join(f"({k}, @m{k}, @x{k})" for k in range(1, 30))
    short = tc.shorten_lists(f"SELECT * FROM (VALUES {rows}) AS v(a, b, c)")
    assert short.count("@m") == 3, short   # the first item (after VALUES) and 2 more
    odd = rows.replace("@x17)", "@x17 @oops)")
    assert "@oops" in tc.shorten_lists(f"INSERT INTO t (a, b, c) VALUES {odd};")
    assert tc.parse(tc.shorten_lists(f"SELECT 1 FROM (VALUES {odd}) AS v(a, b, c)")).errors
