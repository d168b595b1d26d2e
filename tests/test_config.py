"""Configuration: the invalid-file corpus in config/bad/, the example file and the
documented defaults in config/README.md, all through `cfg_test --load FILE` (which prints
one line per error and exits 1, or a normalized dump and exits 0) and the cmocka unit tests
in tests/c/cfg_test.c. No servers needed."""
import os
import pathlib
import re

import pytest

from conftest import run_prog

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config"
BAD = sorted((CONFIG / "bad").glob("*.ini"))
EXAMPLE = CONFIG / "relay.example.ini"
README = CONFIG / "README.md"

# "FILE: [SECTION] KEY: message" or "FILE: [SECTION]: message"; problems found on one line of
# the file say which: "FILE:LINE: [SECTION] KEY: message"
LINE_RE = re.compile(r"^(?P<file>.+?)(?::(?P<line>\d+))?: \[(?P<sec>[^\]]*)\](?: (?P<key>[a-z_]+))?: (?P<msg>.+)$")
LEAD_RE = re.compile(r"^\[(?P<sec>[^\]]*)\](?: (?P<key>[a-z_]+))?: ")


@pytest.fixture(scope="session")
def cfg_test(build):
    exe = build / "tests" / "cfg_test"
    if not exe.exists():
        pytest.fail(f"{exe} not built (run make test-programs)")
    return exe


def clean_env():
    env = dict(os.environ)
    env.pop("OUTBOX_RELAY_TEST_UNSET", None)
    return env


def load(cfg_test, path, **kw):
    return run_prog([cfg_test, "--load", path], timeout=60, env=kw.pop("env", clean_env()), **kw)


def parse_dump(text):
    """Dump → {section: {key: value}}."""
    out, sec = {}, None
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            sec = line[1:-1]
            out[sec] = {}
        else:
            k, sep, v = line.partition(" = ")
            assert sep and sec is not None, f"bad dump line {line!r}"
            out[sec][k] = v
    return out


def header(path, name):
    for line in path.read_text().splitlines():
        if line.startswith(f"; {name}: "):
            return line[len(f"; {name}: "):]
    return None


def test_unit_tests(cfg_test):
    """The cmocka suite: scalar parsers, AMQP URLs, whole files, ${ENV}, password_file, log, row."""
    r = run_prog([cfg_test], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_corpus_is_big_enough():
    assert len(BAD) >= 20, [p.name for p in BAD]


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_file(cfg_test, path):
    """One error line per file. The '; expect:' header is either "[section] key: ..." (a value
    problem, matched inside the line) or starts with ':' ("FILE" + header begins the line: a
    problem of the file's lines, e.g. ':12: [outbox.orders] batch_size given twice ...')."""
    expect = header(path, "expect")
    assert expect, f"{path.name}: no '; expect:' header"

    r = load(cfg_test, path)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stderr == "", r.stderr   # sanitizer/valgrind reports land here
    lines = r.stdout.splitlines()
    assert len(lines) == 1, f"expected exactly one error line, got {lines}"
    line = lines[0]
    secret = header(path, "secret")
    if secret:
        assert secret not in line
    if expect.startswith(":"):
        assert line.startswith(f"{path}{expect}"), f"\n got:  {line}\n want: {path}{expect}"
        return
    lead = LEAD_RE.match(expect)
    assert lead, f"{path.name}: the expect header must start with [section] key:, [section]: or :"
    m = LINE_RE.match(line)
    assert m, f"error line does not name file and section: {line!r}"
    assert m["file"] == str(path), line
    assert m["sec"] == lead["sec"], line
    assert m["key"] == lead["key"], line
    if m["key"] is None:
        # only section-level problems may omit the key
        assert re.search(r"unknown section|bad section name|missing section", m["msg"]), line
    else:
        assert "expected" in m["msg"], line
    assert expect in line, f"\n got:  {line}\n want: {expect}"


def test_missing_file_is_one_line(cfg_test, tmp_path):
    p = tmp_path / "nope.ini"
    r = load(cfg_test, p)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [f"{p}: cannot open: No such file or directory"]


def test_directory_is_one_line(cfg_test, tmp_path):
    r = load(cfg_test, tmp_path)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [f"{tmp_path}: cannot open: Is a directory"]


def test_syntax_error_is_one_line_without_content(cfg_test, tmp_path):
    p = tmp_path / "syntax.ini"
    p.write_text("[relay]\nlog_level = info\nthis has no equals sign hunter2\n")
    r = load(cfg_test, p)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{p}: line 3: cannot parse")
    assert "hunter2" not in r.stdout + r.stderr


def test_all_problems_reported(cfg_test, tmp_path):
    """Errors are collected: one line per problem, in a stable order."""
    p = tmp_path / "two.ini"
    p.write_text("[relay]\nlog_level = loud\n[sink.main]\n"
                 "[outbox.orders]\nconninfo = host=127.0.0.1 dbname=app\ndatabase = app\nmode = boss\n")
    r = load(cfg_test, p)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"{p}: [relay] log_level: expected one of error")
    assert lines[1].startswith(f"{p}: [outbox.orders] mode: expected one of leader")


def test_every_line_problem_reported_alone(cfg_test, tmp_path):
    """Problems of the file's lines (duplicates, cut values) are all reported, each with its
    line, and only they: values are validated once the file reads as it is written."""
    p = tmp_path / "lines.ini"
    p.write_text("[relay]\nlog_level = loud\n"                      # 1-2: a bad value, not reported yet
                 "[sink.main]\nurl = amqp://a/\nURL = amqp://b/\n"  # 3-5
                 "[outbox.orders]\nconninfo = host=h\ndatabase = app\n"   # 6-8
                 "[RELAY]\nname = relay#1\n")                     # 9-10
    r = load(cfg_test, p)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        f"{p}:5: [sink.main] url given twice (first at line 4)",
        f"{p}:9: section [relay] given twice (first at line 1)",
        (f"{p}:10: [relay] name: expected the value in quotes because it contains '#' (an unquoted ';' "
         "or '#' starts a comment and would cut the value), got an unquoted value"),
    ]


def test_same_key_in_different_sections_is_fine(cfg_test, tmp_path):
    p = tmp_path / "ok.ini"
    p.write_text("[sink.a]\nurl = amqp://a/\nheartbeat = 10s\n[sink.b]\nurl = amqp://b/\nheartbeat = 10s\n"
                 "[outbox.x]\nconninfo = host=h\ndatabase = d\nsink = a\n"
                 "[outbox.y]\nconninfo = host=h\ndatabase = d\nsink = b\n")
    r = load(cfg_test, p)
    assert r.returncode == 0, r.stdout


# ----------------------------------------------------------------- documented defaults
DUR_RE = re.compile(r"^(\d+)(ms|s|m|h|d)?$")
DUR_MS = {"ms": 1, "s": 1000, "m": 60000, "h": 3600000, "d": 86400000, None: 1000}
SIZE_RE = re.compile(r"^(\d+)([kKmMgG])?$")
SIZE_MUL = {"k": 1024, "m": 1 << 20, "g": 1 << 30, None: 1}

# keys whose dump value is not the documented literal
NOT_LITERAL = {("relay", "name"), ("sink", "url"), ("outbox", "conninfo")}


def readme_keys():
    """[(section kind, key, default)] from the README's key table."""
    rows = []
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] in ("relay", "sink", "outbox"):
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def normalize_default(value):
    """README default → the cfg_test dump's canonical form (None: not comparable)."""
    if value == "(empty)":
        return ""
    if value.startswith("("):
        return None
    v = value.strip("`")
    m = DUR_RE.match(v)
    if m and (m[2] or False):
        return f"{int(m[1]) * DUR_MS[m[2]]}ms"
    m = SIZE_RE.match(v)
    if m and m[2]:
        return str(int(m[1]) * SIZE_MUL[m[2].lower()])
    return v


def kind(section):
    return section.split(".", 1)[0]


def check_defaults(dump, skip=()):
    rows = readme_keys()
    assert len(rows) >= 35, rows
    for sec, values in dump.items():
        documented = {k for s, k, _ in rows if s == kind(sec)}
        dumped = {k for k in values if "." not in k}   # url.host etc. are derived fields
        assert dumped == documented, (sec, dumped ^ documented)
    for sec, values in dump.items():
        for s, key, default in rows:
            if s != kind(sec) or (s, key) in NOT_LITERAL or key in skip:
                continue
            want = normalize_default(default)
            if want is None:
                continue
            # a duration documented without unit would be seconds; README always has units
            got = values[key]
            if re.fullmatch(r"\d+ms", got) and not want.endswith("ms"):
                pytest.fail(f"[{sec}] {key}: README default {default!r} is not a duration")
            assert got == want, f"[{sec}] {key}: loaded {got!r}, README says {default!r}"


def test_example_loads_with_every_documented_default(cfg_test):
    r = load(cfg_test, EXAMPLE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""
    dump = parse_dump(r.stdout)
    assert set(dump) == {"relay", "sink.main", "outbox.orders"}
    check_defaults(dump, skip={"database"})
    s = dump["sink.main"]
    assert (s["url.host"], s["url.port"], s["url.user"], s["url.vhost"], s["url.tls"]) == \
        ("127.0.0.1", "5672", "guest", "/", "false")
    assert dump["outbox.orders"]["database"] == "app"
    assert dump["outbox.orders"]["sink.resolved"] == "main"


def test_example_sets_every_key():
    """The example is complete: every documented key appears in its section."""
    import configparser
    cp = configparser.ConfigParser(inline_comment_prefixes=(";", "#"), interpolation=None)
    cp.read(EXAMPLE)
    for s, key, _ in readme_keys():
        sec = {"relay": "relay", "sink": "sink.main", "outbox": "outbox.orders"}[s]
        assert cp.has_option(sec, key), f"relay.example.ini lacks [{sec}] {key}"


def test_minimal_file_gets_documented_defaults(cfg_test, tmp_path):
    """Absent keys take exactly the defaults documented in config/README.md."""
    p = tmp_path / "min.ini"
    p.write_text("[sink.main]\n[outbox.orders]\nconninfo = host=127.0.0.1 dbname=app\ndatabase = app\n")
    r = load(cfg_test, p)
    assert r.returncode == 0, r.stdout + r.stderr
    dump = parse_dump(r.stdout)
    check_defaults(dump, skip={"database"})
    assert re.fullmatch(r".+:\d+", dump["relay"]["name"])   # hostname:pid


def test_env_and_password_file_through_load(cfg_test, tmp_path):
    pw = tmp_path / "amqp.pw"
    pw.write_text("s3cret\n")
    p = tmp_path / "env.ini"
    p.write_text("[Sink.Bus]\nurl = amqp://relay:${T_URL_PASS}@${T_HOST}:5673/v\n"
                 f"password_file = {pw}\n"
                 "[outbox.Orders]\nconninfo = host=${T_HOST} dbname=shop\ndatabase = ${T_DB}\nsink = BUS\n")
    env = clean_env()
    env.update(T_URL_PASS="p", T_HOST="10.0.0.9", T_DB="shop")
    r = load(cfg_test, p, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    dump = parse_dump(r.stdout)
    assert set(dump) == {"relay", "sink.bus", "outbox.orders"}   # names are case-insensitive
    assert dump["sink.bus"]["url.host"] == "10.0.0.9"
    assert dump["sink.bus"]["url.port"] == "5673"
    assert dump["sink.bus"]["password_file"] == "<secret>"
    assert dump["outbox.orders"]["database"] == "shop"
    assert dump["outbox.orders"]["sink.resolved"] == "bus"
    assert "s3cret" not in r.stdout and "10.0.0.9 dbname" not in r.stdout


def test_url_list_through_load(cfg_test, tmp_path):
    """A sink's url may list the nodes of one cluster: each address in order, the shared
    user/vhost, password_file applied to all; nothing secret in the dump."""
    pw = tmp_path / "amqp.pw"
    pw.write_text("s3cret\n")
    p = tmp_path / "cluster.ini"
    p.write_text("[sink.main]\n"
                 "url = amqp://relay:x@10.0.0.1/prod, amqp://relay:x@rabbit-2:5673/prod ,"
                 "amqp://relay:x@[fd00::3]/prod\n"
                 f"password_file = {pw}\nnack_reopen = 250ms\n"
                 "[outbox.orders]\nconninfo = host=127.0.0.1 dbname=app\ndatabase = app\n")
    r = load(cfg_test, p)
    assert r.returncode == 0, r.stdout + r.stderr
    s = parse_dump(r.stdout)["sink.main"]
    assert s["url.brokers"] == "10.0.0.1:5672,rabbit-2:5673,[fd00::3]:5672"
    assert (s["url.host"], s["url.port"], s["url.user"], s["url.vhost"]) == \
        ("10.0.0.1", "5672", "relay", "prod")
    assert s["nack_reopen"] == "250ms"
    assert "s3cret" not in r.stdout and "relay:x" not in r.stdout


# ---------------------------------------------------------------------------- reload (SIGHUP)
# A reload keeps an outbox's drain only when nothing it runs on changed (cfg_outbox_equal).
# Each [sink.*] and [outbox.*] key gets another valid value here; a key added to config/cfg.c
# without one fails test_reload_table_covers_every_key, so it cannot be forgotten in the
# comparison either.
RELOAD_BASE = {
    "sink": {"url": "amqps://guest:guest@127.0.0.1:5671/%2f", "tls_ca_file": "{ca}",
             "tls_cert": "{cert}", "tls_key": "{key}"},
    "outbox": {"conninfo": "host=127.0.0.1 dbname=app", "database": "app"},
}
RELOAD_CHANGE = {
    "sink": {
        "url": "amqps://guest:guest@127.0.0.1:5672/%2f",
        "password_file": "{secret}",
        "publish_window": "10", "heartbeat": "5s", "confirm_timeout": "5s",
        "connect_timeout": "2s", "reconnect_max": "5s", "max_message_size": "1M",
        "tls_ca_file": "{ca2}", "tls_verify": "false", "tls_cert": "{cert2}", "tls_key": "{key2}",
        "nack_reopen": "3s",
    },
    "outbox": {
        "source": "sqlserver", "conninfo": "host=127.0.0.1 dbname=app user=other",
        "password_file": "{secret}", "database": "app2", "table": "outbox.other",
        "sink": "second", "batch_size": "7", "poll_interval": "2s", "lease": "9s",
        "max_attempts": "4", "retry_backoff": "2s", "retry_backoff_max": "9m",
        "on_sent": "delete", "retention": "1d", "cleanup_batch": "9", "cleanup_interval": "9s",
        "claim_delay": "9ms", "health_interval": "9s", "horizon_warn": "9m",
        "mode": "competing", "ordering": "strict", "query_timeout": "9s",
        "connect_timeout": "9s", "reconnect_max": "9s",
    },
}
# keys with one accepted value: nothing to change
RELOAD_FIXED = {"sink": {"type", "confirms", "mandatory"}, "outbox": set()}


def _reload_ini(files, sink=None, outbox=None):
    def section(name, keys):
        return [f"[{name}]"] + [f"{k} = {v.format(**files)}" for k, v in keys.items()] + [""]
    text = section("sink.main", dict(RELOAD_BASE["sink"], **(sink or {})))
    text += section("sink.second", RELOAD_BASE["sink"])
    text += section("outbox.orders", dict(RELOAD_BASE["outbox"], **(outbox or {})))
    text += section("outbox.other", dict(RELOAD_BASE["outbox"], table="outbox.x"))
    return "\n".join(text)


def test_reload_table_covers_every_key():
    from test_install import cfg_c_keys
    keys = cfg_c_keys()
    for kind in ("sink", "outbox"):
        covered = set(RELOAD_CHANGE[kind]) | RELOAD_FIXED[kind]
        assert covered == set(keys[kind]), (
            f"[{kind}] keys without a changed value in RELOAD_CHANGE: "
            f"{sorted(set(keys[kind]) - covered)}; not keys: {sorted(covered - set(keys[kind]))}")


def _diff(cfg_test, old, new):
    r = run_prog([cfg_test, "--diff", old, new], timeout=60, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(line.split(": ", 1) for line in r.stdout.splitlines())


@pytest.mark.parametrize("kind,key", [(k, key) for k in ("sink", "outbox")
                                      for key in sorted(RELOAD_CHANGE[k])])
def test_reload_sees_every_key_change(cfg_test, tmp_path, kind, key):
    files = {}
    for name in ("ca", "ca2", "cert", "cert2", "key", "key2", "secret"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text(f"{name}\n")
    old, new = tmp_path / "old.ini", tmp_path / "new.ini"
    old.write_text(_reload_ini(files))
    change = {key: RELOAD_CHANGE[kind][key]}
    if kind == "outbox" and key == "source":
        change["conninfo"] = "Driver={{x}}"    # an ODBC string for sqlserver
    new.write_text(_reload_ini(files, **{kind: change}))
    assert _diff(cfg_test, old, old) == {"orders": "unchanged", "other": "unchanged"}
    # a [sink.main] change restarts orders (on main), not other (on main too: both)
    want = {"orders": "changed", "other": "changed" if kind == "sink" else "unchanged"}
    assert _diff(cfg_test, old, new) == want, new.read_text()


def test_reload_added_and_removed(cfg_test, tmp_path):
    a, b = tmp_path / "a.ini", tmp_path / "b.ini"
    a.write_text("[sink.main]\n[outbox.one]\nconninfo = dbname=d\ndatabase = d\n"
                 "[outbox.two]\nconninfo = dbname=d\ndatabase = d\n")
    b.write_text("[sink.main]\n[outbox.two]\nconninfo = dbname=d\ndatabase = d\n"
                 "[outbox.three]\nconninfo = dbname=d\ndatabase = d\n")
    assert _diff(cfg_test, a, b) == {"two": "unchanged", "three": "added", "one": "removed"}
