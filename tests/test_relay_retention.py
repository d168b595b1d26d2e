"""Retention that fails (the relay's role lost DELETE on the outbox) is retried on its own
back-off, not only at the next cleanup_interval tick: once DELETE is granted back, the
marked rows go within seconds. The failure is logged once (WARN) however often it repeats,
and its end once (INFO).

The relay logs at debug here: a repeated failure is logged at debug only, and the test waits
for that line (the first retry, 1 s after the failure) before it grants DELETE back."""
import secrets
import time
import uuid

import psycopg

from conftest import ROOT, wait_for
from relay_util import (ANY_LEVEL, Relay, amqp_channel, consume, declare, insert_rows,
                        log_lines_at, wait_log_at, write_config)
from test_relay import init_schema


def _rows(pgdb):
    with psycopg.connect(pgdb.dsn) as c:
        return c.execute("SELECT count(*), count(*) FILTER (WHERE sent_at IS NOT NULL) "
                         "FROM outbox.messages").fetchone()


def test_failed_retention_backs_off_and_resumes(services, pgdb, relay_bin, tmp_path):
    q = f"qretry-{uuid.uuid4().hex[:6]}"
    conn, ch = amqp_channel(services)
    declare(ch, "", q, q)
    # the tick: the first pass comes at the first tick (interval after the start); a retry
    # that waited for the next one would come interval - 1 s = ~11 s after the GRANT
    interval = 12.0
    cfg = write_config(tmp_path / "r.ini", services, pgdb, retention="1s",
                       cleanup_interval=f"{interval:.0f}s", cleanup_batch="100",
                       relay={"log_level": "debug"})
    init_schema(relay_bin, cfg)
    pgdb.psql(None, args=("-f", str(ROOT / "deploy" / "grants-postgres.sql")))
    user = f"outbox_relay_{secrets.token_hex(4)}"
    admin = psycopg.connect(pgdb.dsn, autocommit=True)
    admin.execute(f'CREATE ROLE "{user}" LOGIN IN ROLE outbox_relay')
    conninfo = (f"host={services.pg_host} port={services.pg_port} user={user} "
                f"dbname={pgdb.name}")
    cfg.write_text(cfg.read_text().replace(f"conninfo = {pgdb.dsn}", f"conninfo = {conninfo}"))
    assert f"user={user}" in cfg.read_text()
    admin.execute("REVOKE DELETE ON outbox.messages FROM outbox_relay")
    revoked = True
    n = 300
    insert_rows(pgdb, n, 5, routing_key=q)
    r = Relay(relay_bin, cfg, tmp_path / "r.log")
    try:
        assert len(consume(ch, q, n, timeout=30)) == n
        wait_for(lambda: _rows(pgdb) == (n, n), 20, desc="every row marked")
        # the first retention pass comes at the first tick and fails
        wait_log_at(r, r"permission denied for table messages", timeout=interval + 20)
        t_fail = time.monotonic()
        # retried 1 s later, still failing: the repeat is logged at debug only
        wait_log_at(r, r"retention failed: .*permission denied for table messages",
                    levels=("DEBUG",), timeout=10)
        assert _rows(pgdb) == (n, n)
        admin.execute("GRANT DELETE ON outbox.messages TO outbox_relay")
        revoked = False
        t_grant = time.monotonic()
        wait_for(lambda: _rows(pgdb)[0] == 0, interval, interval=0.1,
                 desc="marked rows removed after the GRANT")
        resumed = time.monotonic() - t_grant
        # the back-off (1 s doubling: tries 1, 3, 7 and 15 s after the failure) had its next
        # try ~2 s after the GRANT (at most ~4 s when the GRANT came late); the next tick was
        # ~11 s away (9 s when the GRANT came as late as the second retry)
        assert resumed < 7 < interval - 3, f"retention resumed {resumed:.1f} s after the " \
                                           f"GRANT: waited for the tick"
        wait_log_at(r, r"retention resumed", levels=("INFO",), timeout=5)
        text = r.text()
    finally:
        if revoked:
            admin.execute("GRANT DELETE ON outbox.messages TO outbox_relay")
        r.assert_clean_exit(r.stop())
        conn.close()
        admin.execute(f'DROP OWNED BY "{user}"')
        admin.execute(f'DROP ROLE "{user}"')
        admin.close()
    warns = log_lines_at(text, r"permission denied for table messages")
    print(f"retention failed {t_grant - t_fail:.1f} s until the GRANT; rows removed "
          f"{resumed:.1f} s after it (tick: {interval:.0f} s); WARN lines: {len(warns)}")
    assert len(warns) == 1, warns
    assert "retention" in warns[0], warns
    assert len(log_lines_at(text, r"retention resumed", ANY_LEVEL)) == 1
