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
import re
import time

import pytest

from source_driver import SLOW
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


def hold_leader_row(src):
    """The leader row locked by another open transaction, as a relay's lead reads it (WITH
    (UPDLOCK, HOLDLOCK)); returns release()."""
    if src.engine == "babelfish":
        # Babelfish ignores the hints: the row lock is taken on the PostgreSQL side, where
        # the lead's UPDATE of the row waits for it
        c = src._babelfish_pg(autocommit=False)
        c.execute(f"SELECT 1 FROM {src.pg_table}_lease WHERE name = 'leader' FOR UPDATE")

        def release():
            try:
                c.rollback()
            finally:
                c.close()
        return release
    _, release = src._locker(f"SELECT owner FROM {src.ql} WITH (UPDLOCK, HOLDLOCK) "
                             f"WHERE name = N'leader'")
    return release


def test_tsql_lead_waits_for_a_held_leader_row_at_most_a_third_of_the_lease(src, drivers):
    """A standby's lead behind a leader row that another transaction holds (a statement
    stuck on the server) gives up after a third of the lease (SET LOCK_TIMEOUT): the lead
    fails with a lock timeout, the source stays UP, and the next lead takes over once the
    row is free. Without it the lead waited for the whole query timeout (30 s here) and, on
    Babelfish, lost its session."""
    if src.name != "sqlserver":
        pytest.skip("T-SQL only: the lock timeout of the relay's SQL Server sessions")
    r, _ = drivers().admin("init")
    assert r["rc"] == 0, r
    d = drivers("--query-timeout", "30000")
    d.start_up()
    done, _ = d.request("lead relay-x 0 600")
    assert done["leader"] == "1", done
    time.sleep(1.0)                 # relay-x's lease ran out: the row is there to take
    release = hold_leader_row(src)
    try:
        done, _ = d.request("lead relay-y 0 3000", timeout=25)
    finally:
        release()
    print(f"lead behind a held leader row: ok={done['ok']} after {done['ms']} ms: "
          f"{done.get('error')}")
    assert done["ok"] == -1 and re.search(r"lock.*time ?out", done["error"], re.I), done
    assert 900 <= int(done["ms"]) < 1000 + 2500 * SLOW, done
    done, _ = d.request("lead relay-y 0 3000")
    assert done["ok"] == 0 and done["leader"] == "1", done
    assert not [x for x in d.seen if x.startswith("STATE DOWN")]
