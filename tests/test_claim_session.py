"""The claiming session does nothing but lead and claim: the table's statistics and health
are read on the settling session. While the xmin horizon is held back those reads count
pending rows through an index that keeps an entry for every row marked since the last
vacuum (tens to hundreds of ms each), and a claim that a commit asks for meanwhile would
wait behind them: every message committed during such a read would arrive late."""
import re

from relay_util import Relay
from test_claim_floor import prepare, trickle
from test_claim_plan import server_log_since

# a statement run, in the server's log: its session's pid
STMT = r" \[(\d+)\] .* (?:statement|execute [^:]*): "
CLAIM = re.compile(STMT + r"WITH RECURSIVE f\(partition_key")
STATS = re.compile(STMT + r"SELECT p\.n, greatest\(")
HEALTH = re.compile(STMT + r"SELECT s\.n_dead_tup, ")


def test_stats_and_health_never_run_on_the_claiming_session(services, pgdb, relay_bin,
                                                            tmp_path):
    q, conn, cfg, port = prepare(relay_bin, tmp_path, services, pgdb, claim_delay="0",
                                 health_interval="1s")
    with pgdb.connect() as c:
        c.execute(f"ALTER DATABASE \"{pgdb.name}\" SET log_min_duration_statement = 0")
    log_from = services.pg_log.stat().st_size
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    try:
        trickle(services, pgdb, q, 40, 0.1)   # 4 s: several health reads, stats after claims
    finally:
        r.assert_clean_exit(r.stop())
        conn.close()
        with pgdb.connect() as c:
            c.execute(f"ALTER DATABASE \"{pgdb.name}\" RESET log_min_duration_statement")
    text = server_log_since(services, log_from)
    pids = {name: {m.group(1) for m in map(rx.search, text.splitlines()) if m}
            for name, rx in (("claim", CLAIM), ("stats", STATS), ("health", HEALTH))}
    assert pids["claim"] and pids["stats"] and pids["health"], pids
    assert not pids["claim"] & (pids["stats"] | pids["health"]), pids
