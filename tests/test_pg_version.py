"""PostgreSQL 12 or newer: `outbox-relay check` refuses an older server with one line.

No server older than 12 runs here (the test servers are PostgreSQL 15), and a server's
version is not something to fake on the wire, so the refusing side is the rule's unit
test (tests/c/pgsrc_version_test.c, on the numbers libpq reports); against the real server
this checks the accepting side: the version libpq sees passes and `check` says OK."""
import subprocess

import psycopg

from conftest import run_prog
from relay_util import write_config
from test_relay import init_schema


def test_version_rule(build):
    r = run_prog([str(build / "tests" / "pgsrc_version_test")], timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "3 test(s) run" in out


def test_check_accepts_the_real_server(services, pgdb, relay_bin, tmp_path):
    with psycopg.connect(pgdb.dsn) as c:
        num = int(c.execute("SHOW server_version_num").fetchone()[0])
    assert num >= 120000
    cfg = write_config(tmp_path / "r.ini", services, pgdb)
    init_schema(relay_bin, cfg)
    p = subprocess.run([str(relay_bin), "check", "-c", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "needs PostgreSQL" not in p.stdout + p.stderr
