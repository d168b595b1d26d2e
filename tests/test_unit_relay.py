"""cmocka tests of the relay core's pure pieces: the ledger (relay/ledger.c), with its
scripted cases and seeded randomized runs against a fake database and a fake broker, the
process-wide row budget (relay/budget.c) with simulated drains, and the helpers liboutbox
and the relay share (lib/util.c: UTF-8, UTF-16 through iconv, buffers, JSON, back-off), and
the PostgreSQL statements' parameter conversion and literals (sources/sql_pg.c)."""
from conftest import run_prog


def test_ledger(build):
    r = run_prog([str(build / "tests" / "ledger_test")], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "11 test(s) run" in out
    assert "600 seeded runs ok" in out


def test_row_budget(build):
    r = run_prog([str(build / "tests" / "budget_test")], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "6 test(s) run" in out
    assert "500 seeded runs ok" in out


def test_util(build):
    r = run_prog([str(build / "tests" / "util_test")], timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "17 test(s) run" in out
    assert "20000 random UTF-8/UTF-16 runs ok" in out


def test_sql_pg(build):
    r = run_prog([str(build / "tests" / "sql_test")], timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "4 test(s) run" in out   # sql_pg and the T-SQL parameter tables
