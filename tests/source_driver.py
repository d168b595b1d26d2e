"""The Python side of build/tests/source_contract (tests/c/source_contract.c): one process
driving one source (two with `table2`) through relay/source.h's ops table, whatever the
backend (`--backend postgres` for sources/pg, `--backend odbc` for sources/odbc), and
running test-side SQL on its own session (`sql`). Used by tests/test_source_contract.py
(every source), tests/test_pgsrc.py (libpq only), tests/test_odbcsrc.py (ODBC only) and
tests/test_tsql_capture.py (the ODBC source against a recording driver)."""
import copy
import json
import queue
import re
import subprocess
import threading
import time

from conftest import prog_argv, valgrind_enabled

SLOW = 4 if valgrind_enabled() else 1


def unescape(text):
    """The driver's TEXT: backslash and newlines escaped."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r"}.get(m.group(1), m.group(1)), text)


def parse_fields(text):
    """'ok=0 ms=3 n=2 error=a b' → {'ok': 0, 'ms': '3', 'n': '2', 'error': 'a b'}."""
    out = {}
    err = None
    if " error=" in " " + text:
        text, _, err = (" " + text).partition(" error=")
    for tok in text.split():
        k, _, v = tok.partition("=")
        out[k] = v
    if "ok" in out:
        out["ok"] = int(out["ok"])
    if "rc" in out:
        out["rc"] = int(out["rc"])
    if err is not None:
        out["error"] = unescape(err)
    return out


class _Output:
    """The lines one driver process prints, read by a thread; shared by the views of the
    process (Driver.second())."""

    def __init__(self, proc):
        self.q = queue.Queue()
        self.seen = []      # every line, for failure messages
        self.pending = []   # read but not yet consumed by expect()
        threading.Thread(target=self._reader, args=(proc,), daemon=True).start()

    def _reader(self, proc):
        for line in proc.stdout:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)


class Driver:
    """One source_contract process: commands on stdin, event lines on stdout. With table2,
    the process drives a second source of the same backend on that table: second() gives
    the view of it (its commands and lines carry the prefix "2 ")."""

    def __init__(self, binary, backend, conninfo, database, *opts, table=None, table2=None,
                 valgrind=True):
        argv = [binary, "--backend", backend, "--conninfo", conninfo, "--database", database,
                "--reconnect-max", "500", *opts]
        if table:
            argv += ["--table", table]
        if table2:
            argv += ["--table2", table2]
        self.proc = subprocess.Popen(prog_argv(argv, valgrind), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.out = _Output(self.proc)
        self.tag = ""        # "2 ": the view of the second source
        self.stderr = ""
        self.ops_name = self.expect(r"^READY (\S+)$", 30).group(1)

    def second(self):
        """The second source of this process (started with table2): the same methods, on
        the same process and its output."""
        view = copy.copy(self)
        view.tag = "2 "
        return view

    @property
    def seen(self):
        return self.out.seen

    @property
    def pending(self):
        return self.out.pending

    @pending.setter
    def pending(self, lines):
        self.out.pending = lines

    def _send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def send(self, line):
        """A command for this source: each line of it prefixed with the source's tag."""
        self._send("\n".join(self.tag + x for x in line.split("\n")))

    def _take(self, rx):
        for i, line in enumerate(self.pending):
            m = rx.search(line)
            if m:
                del self.pending[i]
                return m
        return None

    def _pull(self):
        """Moves every line printed so far into pending (without waiting)."""
        while True:
            try:
                line = self.out.q.get_nowait()
            except queue.Empty:
                return
            if line is None:
                self.out.q.put(None)
                return
            self.seen.append(line)
            self.pending.append(line)

    def expect(self, pattern, timeout=15):
        """The first line of this source matching pattern, which starts with ^ (earlier
        non-matching lines stay pending)."""
        if self.tag:
            assert pattern.startswith("^"), pattern
            pattern = "^" + re.escape(self.tag) + pattern[1:]
        return self._expect(re.compile(pattern), timeout)

    def _expect(self, rx, timeout):
        m = self._take(rx)
        if m:
            return m
        deadline = time.monotonic() + timeout * SLOW
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {rx.pattern!r}; output:\n"
                                     + "\n".join(self.seen[-40:]))
            try:
                line = self.out.q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.out.q.put(None)
                raise AssertionError(f"driver exited waiting for {rx.pattern!r}; output:\n"
                                     + "\n".join(self.seen[-40:]) + "\nstderr:\n"
                                     + self.proc.stderr.read())
            self.seen.append(line)
            m = rx.search(line)
            if m:
                return m
            self.pending.append(line)

    def absent(self, pattern, wait):
        """Asserts no line matching pattern arrives within wait seconds."""
        try:
            m = self.expect(pattern, wait / SLOW)
        except AssertionError:
            return
        raise AssertionError(f"unexpected line {m.string!r}")

    def done_lines(self, req):
        """DONE lines of req printed so far and not consumed."""
        self._pull()
        return [x for x in self.pending if x.startswith(f"{self.tag}DONE {req} ")]

    # --- state
    def start(self):
        self.send("start")
        self.expect(r"^ACCEPT 0$")

    def up(self, timeout=20):
        self.expect(r"^STATE UP$", timeout)

    def down(self, timeout=20):
        """The next STATE line, which must be DOWN; returns its text."""
        m = self.expect(r"^STATE (UP|DOWN ?)(.*)$", timeout)
        assert m.group(1).startswith("DOWN"), m.string
        return unescape(m.group(2))

    def state(self, timeout=20):
        """The next STATE line as ('UP', '') or ('DOWN', text)."""
        m = self.expect(r"^STATE (UP|DOWN ?)(.*)$", timeout)
        return m.group(1).strip(), unescape(m.group(2))

    def start_up(self):
        self.start()
        self.up()

    # --- requests
    def submit(self, cmd, timeout=15):
        self.send(cmd)
        acc = self.expect(r"^(ACCEPT -?\d+|ERR .*)$", timeout)
        assert acc.group(1) == "ACCEPT 0", acc.group(1)

    def finish(self, req, timeout=20):
        """The DONE line of the outstanding req: (fields, rows)."""
        m = self.expect(rf"^DONE {req} (.*)$", timeout)
        rows, keep = [], []
        for line in self.pending:
            if line.startswith(self.tag + "ROW "):
                rows.append(json.loads(line[len(self.tag) + 4:]))
            else:
                keep.append(line)
        self.pending = keep
        return parse_fields(m.group(1)), rows

    def request(self, cmd, timeout=20):
        """Sends a request; returns (fields of its DONE line, rows)."""
        self.submit(cmd, timeout)
        return self.finish(cmd.split()[0], timeout)

    def claim(self, n, token, owner="me", lease_ms=30000, epoch=0, competing=False,
              timeout=20):
        cmd = f"claim {n} {lease_ms} {token} {owner}"
        if epoch or competing:
            cmd += f" {epoch}" + (" competing" if competing else "")
        return self.request(cmd, timeout)

    def settle(self, *outcomes):
        """outcomes: (id, token, kind, backoff_ms[, reason]); kind S/R/D/U; a reason str is
        sent as UTF-8, bytes as they are, None (or absent) as NULL."""
        parts = []
        for o in outcomes:
            i, t, k, b = o[:4]
            r = o[4] if len(o) > 4 else None
            p = f"{i}:{t}:{k}:{b}"
            if r is not None:
                p += ":" + (r if isinstance(r, bytes) else r.encode()).hex()
            parts.append(p)
        done, _ = self.request("settle " + " ".join(parts))
        return done

    def drain(self, batch, lease_ms, token, owner, timeout=120):
        """Claims until a claim returns nothing; returns the ids in claim order."""
        self.submit(f"drain {batch} {lease_ms} {token} {owner}")
        m = self.expect(r"^DRAINED n=(\d+) ids=([\d,]*)(?: error=(.*))?$", timeout)
        assert m.group(3) is None, unescape(m.group(3))
        return [int(x) for x in m.group(2).split(",") if x]

    def admin(self, cmd, timeout=60):
        """An admin call (synchronous in the driver): (fields, lines printed before it)."""
        name = cmd.split()[0]
        mark = len(self.seen)
        self.send("admin " + cmd)
        m = self.expect(rf"^(ADMIN {name} |ERR )(.*)$", timeout)
        assert m.group(1) != "ERR ", m.string
        out = [x for x in self.seen[mark:] if re.match(r"^\d+\t", x)]   # dead-list rows
        self.pending = [x for x in self.pending if x not in out]
        return parse_fields(m.group(2)), out

    # --- test-side SQL, on the driver's own session (one per process)
    def sql_run(self, text, timeout=30):
        """Runs text (one or more statements) through the backend's client; returns (fields
        of SQLDONE: rc, rows, error; the rows of every result, lists of str or None)."""
        self._send("sql " + text.encode().hex())
        rx = re.compile(r"^SQL(ROW|DONE)(?: (.*))?$")
        rows = []
        while True:
            m = self._expect(rx, timeout)
            if m.group(1) == "DONE":
                return parse_fields(m.group(2)), rows
            rows.append([None if c == "-" else "" if c == "~" else bytes.fromhex(c).decode()
                         for c in (m.group(2) or "").split()])

    def sql(self, text, timeout=30):
        """Runs text on the driver's own session; returns its rows. A failure fails the
        test, naming the SQL."""
        done, rows = self.sql_run(text, timeout)
        assert done["rc"] == 0, f"sql failed: {done.get('error')}\n{text}"
        return rows

    def stop(self, timeout=30):
        """Destroys the source; returns how long destroy took (ms)."""
        self.send("stop")
        return int(self.expect(r"^STOPPED ms=(\d+)$", timeout).group(1))

    def close(self, timeout=60):
        assert not self.tag, "close the process through its first source"
        if self.proc.poll() is None:
            try:
                self._send("quit")
            except (BrokenPipeError, OSError, ValueError):
                pass
        try:
            rc = self.proc.wait(timeout=timeout * SLOW)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("driver did not exit on quit")
        self.stderr = self.proc.stderr.read()
        assert rc == 0, f"driver exited {rc} (99 = valgrind errors):\n{self.stderr[-4000:]}"
        assert "AddressSanitizer" not in self.stderr and "runtime error" not in self.stderr, \
            self.stderr[-4000:]


def driver_binary(build):
    import pytest
    p = build / "tests" / "source_contract"
    if not p.exists():
        pytest.fail(f"{p} is not built (make test-programs)", pytrace=False)
    return str(p)


def driver_factory(make_one):
    """A fixture body: yields make(*args) creating drivers via make_one; closes (and
    checks) every one at teardown."""
    made = []

    def make(*args, **kw):
        d = make_one(*args, **kw)
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
