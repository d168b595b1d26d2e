"""A claim of large rows asks the database for about the rows its byte limit lets it take
(issue 22).

The claim stops at its byte limit (a running sum of the rows' sizes in id order), but it
locks every row it asks for before it sums them: with batch_size = 500 and rows of 512 KiB,
each claim of the big-message bench locked 500 rows to lease 64 (10 ms of the database's
time in a claim of 12 ms). The relay now asks for one row more than fit at the size of the
rows its previous claim brought; rows smaller than those fill the claim in rows, and the next
one follows at once, sized anew.

The plans checked are the relay's own, from auto_explain, as in tests/test_claim_plan.py:
the candidates the claim looked at (its CTE c0, the rows its LIMIT let through)."""
import uuid

import psycopg

from relay_util import Relay, amqp_channel, consume, insert_rows, write_config
from test_claim_plan import auto_explain_on, logged_plans, server_log_since
from test_relay import init_schema

MIB = 1 << 20


def candidates(node):
    """The rows the claim's CTE c0 returned (the candidates it locked, before the per-key
    checks after its LIMIT), or None."""
    if node.get("Subplan Name") == "CTE c0":
        return node.get("Actual Rows", 0) * node.get("Actual Loops", 1)
    for child in node.get("Plans", []):
        n = candidates(child)
        if n is not None:
            return n
    return None


def test_claim_of_large_rows_asks_for_the_rows_that_fit(services, pgdb, relay_bin, tmp_path):
    n, size = 80, MIB
    tag = uuid.uuid4().hex[:8]
    table = f"fit_{tag}"
    q = f"qfit-{tag}"
    conn, ch = amqp_channel(services)
    ch.queue_declare(queue=q, durable=False)
    # 16M: claims of at most 8 MiB (half of it), 7 rows of 1 MiB and their headers
    cfg = write_config(tmp_path / "r.ini", services, pgdb, table=f"outbox.{table}",
                       relay={"max_bytes_in_memory": "16M"}, batch_size="500")
    init_schema(relay_bin, cfg)
    insert_rows(pgdb, n, 4, routing_key=q, size=size, table=f"outbox.{table}")
    with psycopg.connect(pgdb.dsn, autocommit=True) as db:
        auto_explain_on(db, pgdb.name)
    log_from = services.pg_log.stat().st_size
    r = Relay(relay_bin, cfg, tmp_path / "r.log")
    try:
        got = consume(ch, q, n, timeout=120)
    finally:
        r.assert_clean_exit(r.stop())
        ch.queue_delete(q)
        conn.close()
        with psycopg.connect(pgdb.dsn, autocommit=True) as db:
            db.execute(f"ALTER DATABASE \"{pgdb.name}\" RESET ALL")
    assert len(got) == n
    text = server_log_since(services, log_from)
    claims = [p for p in logged_plans(text, "FOR UPDATE SKIP LOCKED") if table in p["Query Text"]]
    looked = [candidates(p["Plan"]) for p in claims]
    leased = [p["Plan"].get("Actual Rows") for p in claims]
    print(f"{len(claims)} claims: candidates {looked}, leased {leased}")
    assert len(claims) >= 10, f"{len(claims)} claim plans in the server log"
    assert all(c is not None for c in looked), looked
    # the first claim knows no row size yet and asks for a batch; every one after it asks
    # for about what fits (8 MiB of 1 MiB rows: 7, and one more)
    assert max(looked[1:]) <= 9, f"claims looked at {looked} candidate rows (leased {leased})"
