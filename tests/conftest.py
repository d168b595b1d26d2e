"""pytest harness for outbox-relay: private PostgreSQL 15 + RabbitMQ, scratch databases, helpers.

Fixtures (the contract other tests rely on):
  services  (session)  private servers started by scripts/services.sh; see class Services
                       (PostgreSQL, RabbitMQ and Babelfish, the T-SQL engine)
  pgdb      (function) a fresh empty database t_<hex>, dropped afterwards; see class PgDb
  pgdb2     (function) a second one, for tests that need two databases
  build     (session)  pathlib.Path of the build dir (env OUTBOX_BUILD, default <repo>/build)
  relay_bin (session)  build / "outbox-relay"
  amqp      (function) a pika BlockingConnection to the private broker, closed afterwards
Helpers importable with `from conftest import ...`:
  run_prog(argv, **kw)      run a program (timeout, valgrind when OUTBOX_VALGRIND=1)
  prog_argv(argv)           argv wrapped in valgrind when OUTBOX_VALGRIND=1 (for Popen)
  wait_for(pred, timeout)   poll pred until truthy, instead of sleeping
  tail(path, n)             last n lines of a file
  tsql_target(services)     (ODBC string, engine) of the T-SQL server the SQL Server tests use
Run from the repo root: /usr/bin/python3 -m pytest tests   (or: make test)
"""
import os
import pathlib
import re
import secrets
import shlex
import subprocess
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES_SH = ROOT / "scripts" / "services.sh"

VALGRIND_ARGS = ["valgrind", "-q", "--error-exitcode=99", "--leak-check=full",
                 "--errors-for-leak-kinds=definite", "--track-fds=no",
                 f"--suppressions={ROOT / 'tests' / 'valgrind.supp'}"]

# Sanitizer defaults for every program spawned by the tests (callers may override).
os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:strict_string_checks=1:"
                      "detect_stack_use_after_return=1:check_initialization_order=1")
os.environ.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
if (ROOT / "tests" / "lsan.supp").exists():  # optional: third-party leaks we cannot fix
    os.environ.setdefault("LSAN_OPTIONS", f"suppressions={ROOT / 'tests' / 'lsan.supp'}:"
                          "print_suppressions=0")


# ---------------------------------------------------------------------------- helpers
def valgrind_enabled():
    return os.environ.get("OUTBOX_VALGRIND", "") not in ("", "0")


def prog_argv(argv, valgrind=True):
    """argv as it should be executed: under valgrind when OUTBOX_VALGRIND=1."""
    argv = [str(a) for a in argv]
    if valgrind and valgrind_enabled():
        return VALGRIND_ARGS + argv
    return argv


def run_prog(argv, timeout=120, valgrind=True, **kw):
    """Run a program and return CompletedProcess with text stdout/stderr.

    Under OUTBOX_VALGRIND=1 it runs under valgrind (exit code 99 on errors or definite
    leaks) and the timeout is multiplied by 4. Extra keyword arguments go to
    subprocess.run (input=, env=, cwd=, check=...). A timeout raises
    subprocess.TimeoutExpired (the child is killed)."""
    argv = prog_argv(argv, valgrind)
    if valgrind and valgrind_enabled() and timeout is not None:
        timeout *= 4
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("text", True)
    if "input" not in kw:
        kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run(argv, timeout=timeout, **kw)


def wait_for(predicate, timeout, interval=0.05, desc=None, ignore=()):
    """Poll predicate() until it returns something truthy; return that value.

    Exceptions of the types in `ignore` count as "not yet". On timeout raises
    AssertionError naming desc (or the predicate) and the last ignored exception."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            v = predicate()
            if v:
                return v
        except ignore as e:  # noqa: PERF203
            last_exc = e
        if time.monotonic() >= deadline:
            what = desc or getattr(predicate, "__name__", repr(predicate))
            extra = f" (last error: {last_exc!r})" if last_exc is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
        time.sleep(interval)


def tail(path, n=50):
    """The last n lines of a file ('' when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-n:])


# ---------------------------------------------------------------------------- services
class Services:
    """The private servers. Attributes: pg_host, pg_port, pg_user, amqp_port, amqp_url,
    rabbit_node, pg_log, rabbit_log, env (the exports of services.sh env)."""

    def __init__(self, env):
        self.env = env
        self.dir = pathlib.Path(env["OUTBOX_SERVICES_DIR"])
        self.pg_host = env["OUTBOX_PG_HOST"]
        self.pg_port = int(env["OUTBOX_PG_PORT"])
        self.pg_user = env["OUTBOX_PG_USER"]
        self.pg_log = pathlib.Path(env["OUTBOX_PG_LOG"])
        self.amqp_port = int(env["OUTBOX_AMQP_PORT"])
        self.amqp_url = env["OUTBOX_AMQP_URL"]
        self.amqp_host = "127.0.0.1"
        self.rabbit_node = env["OUTBOX_RABBIT_NODE"]
        self.rabbit_log = pathlib.Path(env["OUTBOX_RABBIT_LOG"])
        self._rabbit_home = env["OUTBOX_RABBIT_HOME"]
        self._rabbitmqctl = env["OUTBOX_RABBITMQCTL"]
        self._epmd_port = env["ERL_EPMD_PORT"]
        self.babelfish_odbc = env["OUTBOX_BABELFISH_ODBC"]
        self.babelfish_log = pathlib.Path(env["OUTBOX_BABELFISH_LOG"])

    def pg_dsn(self, dbname="postgres"):
        """libpq conninfo for dbname."""
        return (f"host={self.pg_host} port={self.pg_port} user={self.pg_user} "
                f"dbname={dbname} connect_timeout=10")

    def odbc_dsn(self, dbname="postgres"):
        """psqlODBC connection string for dbname."""
        return (f"Driver={{PostgreSQL Unicode}};Server={self.pg_host};Port={self.pg_port};"
                f"Database={dbname};Uid={self.pg_user};Pwd=x;")

    def pg_connect(self, dbname="postgres", autocommit=True):
        import psycopg
        return psycopg.connect(self.pg_dsn(dbname), autocommit=autocommit)

    def psql(self, dbname, sql=None, args=(), timeout=60, check=True):
        """Run psql (ON_ERROR_STOP) with sql on stdin; returns CompletedProcess."""
        argv = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", self.pg_host,
                "-p", str(self.pg_port), "-U", self.pg_user, "-d", dbname, *args]
        return subprocess.run(argv, input=sql or "", capture_output=True, text=True,
                              timeout=timeout, check=check)

    def rabbitmqctl(self, *args, timeout=60, check=False):
        """rabbitmqctl against the private node → CompletedProcess (text)."""
        env = dict(os.environ, HOME=self._rabbit_home, ERL_EPMD_PORT=self._epmd_port,
                   RABBITMQ_USE_LONGNAME="false")
        return subprocess.run([self._rabbitmqctl, "-n", self.rabbit_node, *map(str, args)],
                              env=env, capture_output=True, text=True, timeout=timeout,
                              check=check, stdin=subprocess.DEVNULL)

    def add_broker_user(self, user, password, vhost="/"):
        """`rabbitmqctl add_user USER PASSWORD` and `set_permissions -p VHOST USER .* .* .*`
        in one rabbitmqctl (eval of the same two calls inside the broker): each rabbitmqctl
        starts an Erlang VM, seconds on a loaded machine. → CompletedProcess; exit 0 when
        both succeeded (a failing one fails the eval's match)."""
        for v in (user, password, vhost):
            assert re.fullmatch(r"[A-Za-z0-9_./-]+", v), f"not a plain name: {v!r}"
        b = lambda v: f'<<"{v}">>'  # noqa: E731
        expr = (f"ok = rabbit_auth_backend_internal:add_user({b(user)}, {b(password)}, "
                f"{b('outbox-tests')}), "
                f"ok = rabbit_auth_backend_internal:set_permissions({b(user)}, {b(vhost)}, "
                f"{b('.*')}, {b('.*')}, {b('.*')}, {b('outbox-tests')}).")
        return self.rabbitmqctl("eval", expr)

    def rabbitmqctl_later(self, *args, timeout=120):
        """rabbitmqctl started in the background, for a cleanup no test waits on (deleting a
        test's broker user or vhost): each rabbitmqctl starts an Erlang VM, seconds on a
        loaded machine. Its exit status is not looked at (as for the cleanups it replaces);
        the end of the session waits for it (at most timeout seconds, then kills it)."""
        env = dict(os.environ, HOME=self._rabbit_home, ERL_EPMD_PORT=self._epmd_port,
                   RABBITMQ_USE_LONGNAME="false")
        p = subprocess.Popen([self._rabbitmqctl, "-n", self.rabbit_node, *map(str, args)],
                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        _LATER.append((p, time.monotonic() + timeout))
        return p

    def amqp_params(self):
        import pika
        p = pika.URLParameters(self.amqp_url)
        p.socket_timeout = 10
        p.blocked_connection_timeout = 30
        return p

    def amqp_connect(self):
        import pika
        return pika.BlockingConnection(self.amqp_params())


def tsql_target(services):
    """(ODBC connection string, engine) of the T-SQL server the SQL Server tests run on.

    A real SQL Server when OUTBOX_TEST_MSSQL holds an ODBC connection string to one of its
    databases (engine "sqlserver"); otherwise the harness's private Babelfish, database
    outbox_test (engine "babelfish"). Babelfish speaks T-SQL over TDS but reads with
    PostgreSQL's snapshots and ignores table hints: tests that can only pass on SQL Server's
    locking say so and check engine."""
    item = _CURRENT_ITEM[0]
    if item is not None and not item.get_closest_marker("tsql"):
        raise RuntimeError(f"{item.nodeid} reaches the T-SQL engine: mark it "
                           "@pytest.mark.tsql (or add its fixture to conftest.TSQL_FIXTURES)")
    conn = os.environ.get("OUTBOX_TEST_MSSQL", "")
    if conn:
        return conn, "sqlserver"
    return services.babelfish_odbc, "babelfish"


def _services_env():
    r = subprocess.run([str(SERVICES_SH), "env"], capture_output=True, text=True, timeout=60,
                       check=True)
    env = {}
    for line in r.stdout.splitlines():
        if line.startswith("export "):
            k, _, v = line[len("export "):].partition("=")
            env[k] = shlex.split(v)[0] if v else ""
    return env


_SERVICES = None
_LATER = []   # (Popen, deadline) of Services.rabbitmqctl_later


def _wait_later():
    """Waits for the background cleanups (killing one past its deadline)."""
    while _LATER:
        p, deadline = _LATER.pop()
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="session")
def services():
    global _SERVICES
    r = subprocess.run([str(SERVICES_SH), "start"], capture_output=True, text=True,
                       timeout=900, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        pytest.fail(f"scripts/services.sh start failed (exit {r.returncode}):\n"
                    f"{r.stdout}\n{r.stderr}", pytrace=False)
    _SERVICES = Services(_services_env())
    return _SERVICES


# ---------------------------------------------------------------------------- databases
class PgDb:
    """A scratch database. Attributes: name, dsn (libpq), odbc (ODBC string)."""

    def __init__(self, services, name):
        self.services = services
        self.name = name
        self.dsn = services.pg_dsn(name)
        self.odbc = services.odbc_dsn(name)
        self._conns = []

    def connect(self, autocommit=True):
        """A psycopg connection (autocommit by default), closed at teardown."""
        c = self.services.pg_connect(self.name, autocommit=autocommit)
        self._conns.append(c)
        return c

    def psql(self, sql=None, args=(), **kw):
        return self.services.psql(self.name, sql, args, **kw)

    def close_all(self):
        for c in self._conns:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self._conns.clear()


class _DbPool:
    """Empty databases t_<hex> made ahead of use by a background thread: CREATE DATABASE
    copies template1 and takes 0.3-0.5 s on a quiet machine (0.9 s on a loaded 2-core one),
    which some 350 tests (pgdb, pgdb2, the contract suite's PostgreSQL backends) would
    otherwise wait for in their setup. A database taken from the pool is exactly what the
    test would have created itself (never connected to, made from template1 moments
    earlier); the thread makes the next one while the test runs (its servers mostly idle,
    waiting). At most SIZE wait ready; when none is ready and none is being made, or the
    server refuses (restarting, a test made it read-only...), take() returns None and the
    caller creates its own as before. OUTBOX_TEST_DB_POOL=0 turns the pool off. The
    databases left at the end of the session are dropped (pytest_sessionfinish)."""

    SIZE = 2

    def __init__(self, services):
        self._services = services
        self._ready = []
        self._making = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="pgdb-pool", daemon=True)
        self._thread.start()

    def _run(self):
        failures = 0
        while True:
            with self._cv:
                while not self._closed and len(self._ready) >= self.SIZE:
                    self._cv.wait()
                if self._closed:
                    return
                self._making = True
            name = "t_" + secrets.token_hex(6)
            try:
                with self._services.pg_connect() as admin:
                    admin.execute(f'CREATE DATABASE "{name}"')
            except Exception:  # noqa: BLE001 - the server may be down or refusing for a test
                name = None
            with self._cv:
                self._making = False
                if name is not None:
                    failures = 0
                    self._ready.append(name)
                else:
                    failures += 1
                self._cv.notify_all()
                if name is None and not self._closed:   # back off: 0.2 s doubling to 3.2 s
                    self._cv.wait(0.1 * 2 ** min(failures, 5))

    def take(self, timeout=5.0):
        """A ready database's name, waiting up to timeout for one being made; else None."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._ready and self._making and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            if not self._ready:
                return None
            name = self._ready.pop(0)
            self._cv.notify_all()
            return name

    def close(self):
        """Stops the thread and drops the databases nobody took. Never raises."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(30)
        with self._cv:
            names, self._ready = self._ready, []
        for name in names:
            try:
                with self._services.pg_connect() as admin:
                    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            except Exception:  # noqa: BLE001 - best effort at the end of the session
                pass


_DB_POOL = None
_DB_POOL_LOCK = threading.Lock()


def _pooled_database(services):
    """A database of the pool (started at the first use), or None."""
    global _DB_POOL
    if os.environ.get("OUTBOX_TEST_DB_POOL", "1") == "0":
        return None
    with _DB_POOL_LOCK:
        if _DB_POOL is None:
            _DB_POOL = _DbPool(services)
    return _DB_POOL.take()


def pytest_sessionfinish(session, exitstatus):
    if _DB_POOL is not None:
        _DB_POOL.close()
    _wait_later()


def scratch_database(services):
    """Generator behind pgdb/pgdb2: creates t_<hex> (or takes one the pool made ahead),
    yields its PgDb, then closes the connections made through it and drops it (also killing
    sessions left on it)."""
    name = _pooled_database(services)
    if name is None:
        name = "t_" + secrets.token_hex(6)
        with services.pg_connect() as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
    db = PgDb(services, name)
    try:
        yield db
    finally:
        db.close_all()
        with services.pg_connect() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pgdb(services):
    yield from scratch_database(services)


@pytest.fixture
def pgdb2(services):
    """A second scratch database like pgdb, for tests that need two."""
    yield from scratch_database(services)


# ---------------------------------------------------------------------------- build, broker
@pytest.fixture(scope="session")
def build():
    return pathlib.Path(os.environ.get("OUTBOX_BUILD") or ROOT / "build").resolve()


@pytest.fixture(scope="session")
def relay_bin(build):
    return build / "outbox-relay"


@pytest.fixture
def amqp(services):
    conn = services.amqp_connect()
    try:
        yield conn
    finally:
        if conn.is_open:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - the broker may have been restarted by the test
                pass


# ---------------------------------------------------------------------------- memory alarm
class MemoryAlarm:
    """The broker's memory alarm (the broker then blocks publishing connections:
    connection.blocked), raised and cleared at once: one `rabbitmqctl eval` inside the
    broker, started in the background with the fixture, watches two files. A rabbitmqctl
    call per change starts an Erlang VM each time (seconds; 5-14 s on a loaded 2-core
    machine). raise_() and clear() return once the broker changed its watermark; the alarm
    is cleared at teardown whatever happened (the eval also clears it at its deadline)."""

    def __init__(self, services, workdir, deadline_s=600):
        import threading
        self.services = services
        f = {k: str(workdir / f"alarm.{k}") for k in ("ready", "raise", "raised", "clear",
                                                       "cleared")}
        self._f = f
        expr = (
            'ok = file:write_file("%(ready)s", <<"ready">>), '
            'Deadline = erlang:monotonic_time(millisecond) + %(ms)d, '
            'Wait = fun W(Fs) -> case lists:any(fun filelib:is_file/1, Fs) orelse '
            '  erlang:monotonic_time(millisecond) > Deadline of '
            '  true -> ok; false -> timer:sleep(5), W(Fs) end end, '
            'Wait(["%(raise)s", "%(clear)s"]), '
            'case filelib:is_file("%(raise)s") andalso not filelib:is_file("%(clear)s") of '
            '  true -> vm_memory_monitor:set_vm_memory_high_watermark(0.0000001), '
            '          ok = file:write_file("%(raised)s", <<"raised">>), '
            '          Wait(["%(clear)s"]); '
            '  false -> ok end, '
            'vm_memory_monitor:set_vm_memory_high_watermark(0.4), '
            'ok = file:write_file("%(cleared)s", <<"cleared">>), '
            'done.' % dict(f, ms=deadline_s * 1000))
        self._p = None

        def run():
            self._p = services.rabbitmqctl("eval", expr, timeout=deadline_s + 60)
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def _touch_and_wait(self, mark, done, what):
        pathlib.Path(self._f[mark]).touch()
        wait_for(lambda: os.path.exists(self._f[done]) or not self._thread.is_alive(), 120,
                 interval=0.01, desc=what)
        assert os.path.exists(self._f[done]), f"{what}: rabbitmqctl eval ended: {self._p}"

    def raise_(self):
        wait_for(lambda: os.path.exists(self._f["ready"]) or not self._thread.is_alive(), 120,
                 interval=0.02, desc="rabbitmqctl eval to start")
        assert os.path.exists(self._f["ready"]), f"rabbitmqctl eval failed: {self._p}"
        self._touch_and_wait("raise", "raised", "the memory alarm raised")

    def clear(self):
        self._touch_and_wait("clear", "cleared", "the memory alarm cleared")

    def close(self):
        """Never raises: it runs at teardown."""
        pathlib.Path(self._f["clear"]).touch()
        self._thread.join(60)
        if self._p is None or self._p.returncode != 0 or \
                not os.path.exists(self._f["cleared"]):
            self.services.rabbitmqctl("set_vm_memory_high_watermark", "0.4")


@pytest.fixture
def memory_alarm(services, tmp_path):
    """A MemoryAlarm of the private broker: .raise_() and .clear(), each at once."""
    alarm = MemoryAlarm(services, tmp_path)
    try:
        yield alarm
    finally:
        alarm.close()


# ---------------------------------------------------------------------------- relays left
@pytest.fixture(autouse=True)
def reap_relays():
    """Kills the relay processes a test started and left running: a test that fails before
    it stops its relays must not leave them retrying against services for the rest of the
    run (seen: two competing relays of a failed test ran on for 38 minutes)."""
    import relay_util
    mark = len(relay_util.STARTED)
    yield
    for p in relay_util.STARTED[mark:]:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    del relay_util.STARTED[mark:]


# ---------------------------------------------------------------------------- shared tests
def ci_share():
    """OUTBOX_TEST_SHARE=K/N as (K, N): this is run K of the N that one CI run makes at the
    same time; None when unset. ValueError when it is not K/N with K < N."""
    share = os.environ.get("OUTBOX_TEST_SHARE", "")
    if not share:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", share)
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"OUTBOX_TEST_SHARE={share!r}: want K/N with K < N")
    return int(m.group(1)), int(m.group(2))


def ci_parts(n):
    """OUTBOX_TEST_PARTS=M: the CI run's N runs are its builds' runs, M for each build (1 when
    unset). ValueError when M does not divide N."""
    parts = os.environ.get("OUTBOX_TEST_PARTS", "1")
    if not re.fullmatch(r"[1-9]\d*", parts) or n % int(parts):
        raise ValueError(f"OUTBOX_TEST_PARTS={parts!r}: want a number that divides {n}")
    return int(parts)


# The fixtures that reach the T-SQL engine (tsql_target); a test using one of them, or
# parametrized with the backend "sqlserver", is marked tsql at collection. A test that calls
# tsql_target itself carries the marker (tsql_target refuses to run in a test without it).
TSQL_FIXTURES = frozenset({"mssql", "tsql", "tsql_granted"})

# Each test's seconds in an earlier run (tests/durations.txt: "seconds node-id" a line, the
# tests of a second or more, written by scripts/test-durations.py), to deal the tests out in
# balance; a test not listed counts DEFAULT_SECONDS.
DURATIONS = ROOT / "tests" / "durations.txt"
DEFAULT_SECONDS = 0.1


def _durations():
    try:
        lines = DURATIONS.read_text().splitlines()
    except FileNotFoundError:
        return {}
    return {nodeid: float(sec) for sec, _, nodeid in
            (line.partition(" ") for line in lines if line.strip() and not line.startswith("#"))}


def _reaches_tsql(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "sqlserver" in params.values() or bool(TSQL_FIXTURES & set(item.fixturenames))


def deal(items, k, n, parts, seconds):
    """The tests run K of the N runs of a CI run keeps (the others run elsewhere in it). The N
    runs are the builds' runs, PARTS for each build, run K being part K % PARTS of its build:
      - the tests of the groups build_independent (nothing of the build under test runs in
        them: their result is the same in every build) and tsql (the T-SQL engine's: nearly
        all of Babelfish's CPU goes to parsing each new session's statements, its parser's
        prediction cache being per process and cold at first) each run in one of the N
        runs;
      - every other test runs once in each build, in one of its PARTS runs, with the other
        tests of its file that are not in a group (they may share a module fixture: one
        `make deb`, one RabbitMQ cluster).
    The longest first (seconds(item); a file: its tests' sum), each to the run with the
    fewest seconds so far (ties: the lower number; equal ones in the order of their ids):
    first the builds' own files among the parts, then each group among all N runs. The deal
    depends on the tests only, so every run makes the same one."""
    groups = ("build_independent", "tsql")

    def grouped(it):
        return any(it.get_closest_marker(g) for g in groups)

    def give(units, load, run_of):
        """units: (id, seconds, items); each to the least loaded run of load"""
        for _, sec, its in sorted(units, key=lambda u: (-u[1], u[0])):
            run = min(range(len(load)), key=lambda r: (load[r], r))
            load[run] += sec
            for it in its:
                run_of[id(it)] = run
    run_of = {}
    files = {}
    for it in items:
        if not grouped(it):
            files.setdefault(it.nodeid.split("::")[0], []).append(it)
    load = [0.0] * parts
    give([(f, sum(map(seconds, its)), its) for f, its in files.items()], load, run_of)
    load = [load[r % parts] for r in range(n)]
    for g in groups:
        give([(it.nodeid, seconds(it), [it]) for it in items
              if it.get_closest_marker(g) and id(it) not in run_of], load, run_of)
    return [it for it in items if run_of[id(it)] == (k if grouped(it) else k % parts)]


def pytest_collection_modifyitems(config, items):
    """Marks the T-SQL tests (tsql, see TSQL_FIXTURES). With OUTBOX_TEST_SHARE=K/N
    (scripts/test.sh, when it runs the plain and the sanitizer build at the same time, each
    in OUTBOX_TEST_PARTS runs) keeps the tests that deal() gives to this run and deselects
    the others: each of them runs in another run of the same CI run. Unset: every test
    runs."""
    for it in items:
        if not it.get_closest_marker("tsql") and _reaches_tsql(it):
            it.add_marker(pytest.mark.tsql)
    try:
        kn = ci_share()
        if kn is None:
            return
        parts = ci_parts(kn[1])
    except ValueError as e:
        raise pytest.UsageError(str(e))
    durations = _durations()
    keep = deal(items, *kn, parts, lambda it: durations.get(it.nodeid, DEFAULT_SECONDS))
    kept = {id(it) for it in keep}
    gone = [it for it in items if id(it) not in kept]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = keep


def pytest_report_header(config):
    try:
        kn = ci_share()
        parts = ci_parts(kn[1]) if kn else 1
    except ValueError:
        return None
    if kn:
        return (f"OUTBOX_TEST_SHARE={kn[0]}/{kn[1]}, OUTBOX_TEST_PARTS={parts}: run {kn[0]} of "
                f"the {kn[1]} of this CI run (part {kn[0] % parts} of its build's {parts}); "
                "the deselected tests run in the others")
    return None


# the test being run (tsql_target checks its marker)
_CURRENT_ITEM = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _CURRENT_ITEM[0] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    _CURRENT_ITEM[0] = None


# ---------------------------------------------------------------------------- failure logs
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failing test, attach the tails of the PostgreSQL and RabbitMQ logs."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or _SERVICES is None or "services" not in item.fixturenames:
        return
    logs = [("postgresql log", _SERVICES.pg_log), ("rabbitmq log", _SERVICES.rabbit_log)]
    if re.search(r"sqlserver|mssql|tsql", item.nodeid):
        logs.append(("babelfish log", _SERVICES.babelfish_log))
    for title, path in logs:
        text = tail(path, 50)
        if text:
            rep.sections.append((f"{title} {path} (last 50 lines)", text))
