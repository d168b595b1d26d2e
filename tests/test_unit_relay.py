"""cmocka tests of the relay core's pure pieces: the ledger (relay/ledger.c), with its
scripted cases and seeded randomized runs against a fake database and a fake broker."""
from conftest import run_prog


def test_ledger(build):
    r = run_prog([str(build / "tests" / "ledger_test")], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "9 test(s) run" in out
    assert "600 seeded runs ok" in out
