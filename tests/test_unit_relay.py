"""cmocka unit tests of the relay core's pure pieces (relay/keyset.c)."""
from conftest import run_prog


def test_keyset(build):
    r = run_prog([str(build / "tests" / "keyset_test")], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 test(s) run" in r.stdout + r.stderr
