"""What only the ODBC source (sources/odbc) does, driven through build/tests/source_contract
--backend odbc (tests/c/source_contract.c, tests/source_driver.py).

Belongs here: how the ODBC source reports a failing connection (an unchanged DOWN reason
once; the libpq source reports every attempt, tests/test_pgsrc.py).
Does not belong here: any behaviour of relay/source.h that every source must have (claim,
settle, leadership, competing mode, stats, retention, dead letters, timeouts, connection
loss, the database-name check, a stalled source not stalling another in the same process):
tests/test_source_contract.py runs those against every source, this one through psqlODBC
and (OUTBOX_TEST_MSSQL) SQL Server. T-SQL text checks: tests/test_tsql_capture.py.

Every test runs against PostgreSQL through psqlODBC (the harness's server), and against
SQL Server when OUTBOX_TEST_MSSQL holds an ODBC connection string to a SQL Server database
(the contract suite's adapters: tests/test_source_contract.py); otherwise that half is
reported SKIPPED."""
import pytest

from source_driver import Driver, driver_binary, driver_factory
from test_source_contract import MSSQL, MSSQL_SKIP, MssqlSide, PgSide


@pytest.fixture(params=["odbc-postgres", "sqlserver"])
def side(request, build):
    if request.param == "sqlserver":
        if not MSSQL:
            pytest.skip(MSSQL_SKIP)
        b = MssqlSide(build)
    else:
        b = PgSide(request.param, request.getfixturevalue("pgdb"))
    try:
        yield b
    finally:
        b.cleanup()


@pytest.fixture
def drivers(side, build):
    """make(*opts, database=): an ODBC source driver against the backend under test."""
    binary = driver_binary(build)

    def one(*opts, database=None):
        return Driver(binary, "odbc", side.conninfo, database or side.database, *opts,
                      table=side.table)
    yield from driver_factory(one)


def test_unchanged_down_reason_is_reported_once(side, drivers):
    """The ODBC source retries a failing connection with back-off (100 ms doubling, here
    capped at 500 ms) but reports DOWN again only when the reason changes (the libpq source
    reports every attempt: tests/test_pgsrc.py)."""
    r, _ = drivers().admin("init")
    assert r["rc"] == 0, r
    wrong = side.database + "_other"
    d = drivers(database=wrong)
    d.start()
    msg = d.down()
    assert f'configured database "{wrong}"' in msg, msg
    d.absent(r"^STATE ", 2.5)   # about six attempts meanwhile
