"""What only the ODBC source (sources/odbc) does, driven through build/tests/source_contract
--backend odbc (tests/c/source_contract.c, tests/source_driver.py).

Belongs here: how the ODBC source reports a failing connection (an unchanged DOWN reason
once; the libpq source reports every attempt, tests/test_pgsrc.py).
Does not belong here: any behaviour of relay/source.h that every source must have (claim,
settle, leadership, competing mode, stats, retention, dead letters, timeouts, connection
loss, the database-name check, a stalled source not stalling another in the same process):
tests/test_source_contract.py runs those against every source, this one through psqlODBC
and FreeTDS. T-SQL text checks: tests/test_tsql_capture.py.

Every test runs against PostgreSQL through psqlODBC (the harness's server) and against a
T-SQL engine through FreeTDS: the harness's Babelfish for PostgreSQL, or a real SQL Server
when OUTBOX_TEST_MSSQL holds an ODBC connection string to one of its databases (the
contract suite's adapters and their engine differences: tests/test_source_contract.py,
MssqlSide)."""
import pytest

from test_source_contract import drivers, side_of  # noqa: F401 (drivers: the contract's fixture)


@pytest.fixture(params=["odbc-postgres", "sqlserver"])
def src(request, build):
    yield from side_of(request, build)


def test_unchanged_down_reason_is_reported_once(src, drivers):
    """The ODBC source retries a failing connection with back-off (100 ms doubling, here
    capped at 500 ms) but reports DOWN again only when the reason changes (the libpq source
    reports every attempt: tests/test_pgsrc.py)."""
    r, _ = drivers().admin("init")
    assert r["rc"] == 0, r
    wrong = src.database + "_other"
    d = drivers(database=wrong)
    d.start()
    msg = d.down()
    assert f'configured database "{wrong}"' in msg, msg
    d.absent(r"^STATE ", 2.5)   # about six attempts meanwhile
