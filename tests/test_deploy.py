"""Shipped files that work as written (deploy/README.md).

- Every relay ini the project ships — config/*.ini (not config/bad/), deploy/**/*.ini and the
  relay.ini embedded in a ConfigMap of deploy/*.yaml, all found by glob — loads through the
  config-only validation (`cfg_test --load`), with ${...} placeholders filled with dummy values
  and the files it names (password_file, tls_ca_file, ...) created in a tmp dir.
- The ones that can (PostgreSQL outboxes and plain-AMQP sinks) also pass `outbox-relay init`
  and `outbox-relay check` against the private PostgreSQL and RabbitMQ, with host, port,
  credentials and database substituted.
- Real tools: yamllint on deploy/*.yaml, shellcheck on every shell script (and on the inline
  scripts of compose.yaml), systemd-analyze verify on the unit; the Dockerfile's COPY sources
  exist and its HEALTHCHECK script works against a real relay.
- compose.yaml, k8s-sidecar.yaml and outbox-relay.service agree with the ini they ship.
"""
import fnmatch
import http.server
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import threading

import pytest
import yaml

from conftest import prog_argv, run_prog, wait_for
from relay_util import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config"
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s-sidecar.yaml"
UNIT = DEPLOY / "outbox-relay.service"
HEALTHCHECK = DEPLOY / "healthcheck.sh"
YAMLLINT_CONF = DEPLOY / ".yamllint"
SKIP_DIRS = {".git", ".services", "__pycache__", ".pytest_cache", "node_modules"}


def tool(name):
    exe = shutil.which(name)
    if not exe:
        pytest.fail(f"{name} not installed (it is in scripts/packages.txt: apt-get install it)")
    return exe


# ----------------------------------------------------------------------------- shipped inis
def shipped_ini():
    """[(id, text)]: every ini file under config/ (but config/bad/) and deploy/, and every
    *.ini key of a ConfigMap in deploy/*.yaml."""
    out = []
    for p in sorted(CONFIG.rglob("*.ini")):
        if "bad" not in p.relative_to(CONFIG).parts:
            out.append((str(p.relative_to(ROOT)), p.read_text()))
    for p in sorted(DEPLOY.rglob("*.ini")):
        out.append((str(p.relative_to(ROOT)), p.read_text()))
    for p in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(p.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
                for key, text in (doc.get("data") or {}).items():
                    if key.endswith(".ini"):
                        out.append((f"{p.relative_to(ROOT)}:{doc['metadata']['name']}/{key}", text))
    return out


SHIPPED = shipped_ini()
PLACEHOLDER_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
SECTION_RE = re.compile(r"^\s*\[([^\]]*)\]\s*$")
KEY_RE = re.compile(r"^\s*([^=;#\[\s][^=]*?)\s*=(.*)$")
# keys whose value is a file the relay opens, and libpq's file parameters inside a conninfo
FILE_KEY_RE = re.compile(r"^(\s*[A-Za-z_]+_file\s*=\s*)(/[^\s;#\"']+)", re.M)
CONNINFO_FILE_RE = re.compile(r"\b(ssl(?:rootcert|cert|key|crl)=)(/[^\s\"';]+)")


def ini_value(raw):
    """A value as the relay reads it: quotes removed, or cut at a whitespace-led ; or #."""
    v = raw.strip()
    if v[:1] in ("'", '"'):
        end = v.find(v[0], 1)
        return v[1:end]
    m = re.search(r"(^|\s)[;#]", v)
    return (v[:m.start()] if m else v).strip()


def parse_ini(text):
    """{section: {key: value}} with lower-cased names, as the relay sees them."""
    out, sec = {}, None
    for line in text.splitlines():
        if line.strip()[:1] in (";", "#", ""):
            continue
        m = SECTION_RE.match(line)
        if m:
            sec = m[1].strip().lower()
            out.setdefault(sec, {})
            continue
        m = KEY_RE.match(line)
        assert m and sec is not None, f"unexpected line {line!r}"
        out[sec][m[1].strip().lower()] = ini_value(m[2])
    return out


def conninfo_params(conninfo):
    """libpq key=value conninfo → dict (the shipped files use no quoted values)."""
    return dict(kv.split("=", 1) for kv in shlex.split(conninfo))


def ini_files(text):
    """Absolute paths the ini makes the relay (or libpq) open."""
    return [m[2] for m in FILE_KEY_RE.finditer(text)] + [m[2] for m in CONNINFO_FILE_RE.finditer(text)]


def dummy_env(text, real=None):
    """The environment for loading text: each ${NAME} set (real value if given, else a dummy
    that parses where it lands: *_URL an AMQP URL, *_PORT a port)."""
    env = dict(os.environ)
    for name in PLACEHOLDER_RE.findall(text):
        if real and name in real:
            env[name] = real[name]
        elif name.endswith("_URL"):
            env[name] = "amqp://guest:guest@127.0.0.1:5672/%2f"
        elif name.endswith("_PORT"):
            env[name] = "5432"
        else:
            env[name] = f"dummy-{name.lower()}"
    return env


def with_tmp_files(text, root):
    """text with every file path it names moved under root, each file created there."""
    def move(m):
        path = root / m[2].lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text("dummy-secret\n")
        return f"{m[1]}{path}"
    return CONNINFO_FILE_RE.sub(move, FILE_KEY_RE.sub(move, text))


def ids(items):
    return [i for i, _ in items]


@pytest.mark.build_independent
def test_shipped_inis_are_found():
    """The glob finds the files we know of, so a renamed directory cannot empty the tests."""
    found = set(ids(SHIPPED))
    for want in ("config/relay.example.ini", "config/demo.ini", "deploy/relay.compose.ini",
                 "deploy/k8s-sidecar.yaml:orders-outbox-relay/relay.ini"):
        assert want in found, sorted(found)


@pytest.fixture(scope="session")
def cfg_test(build):
    exe = build / "tests" / "cfg_test"
    if not exe.exists():
        pytest.fail(f"{exe} not built (run make test-programs)")
    return exe


@pytest.mark.parametrize("name,text", SHIPPED, ids=ids(SHIPPED))
def test_shipped_ini_loads(cfg_test, tmp_path, name, text):
    p = tmp_path / "relay.ini"
    p.write_text(with_tmp_files(text, tmp_path / "root"))
    r = run_prog([cfg_test, "--load", p], timeout=60, env=dummy_env(text))
    assert r.returncode == 0, f"{name} does not load:\n{r.stdout}{r.stderr}"
    assert r.stderr == ""
    dumped = {line[1:-1] for line in r.stdout.splitlines() if line.startswith("[")}
    assert dumped == set(parse_ini(text)) | {"relay"}, (dumped, sorted(parse_ini(text)))


# ------------------------------------------------------------ the same files, live (local servers)
TLS_SSLMODES = {"require", "verify-ca", "verify-full"}


def live_plan(text):
    """Which sections can run against the private servers (PostgreSQL without TLS, AMQP
    without TLS) → (kept sections, {dropped section: reason})."""
    cfg = parse_ini(text)
    dropped = {}
    for sec, keys in cfg.items():
        if sec.startswith("sink.") and keys.get("url", "").lower().startswith("amqps://"):
            dropped[sec] = "amqps:// (the private RabbitMQ has no TLS listener)"
    for sec, keys in cfg.items():
        if not sec.startswith("outbox."):
            continue
        if keys.get("source", "postgres") != "postgres":
            dropped[sec] = "SQL Server (none can run here)"
        elif conninfo_params(keys["conninfo"]).get("sslmode") in TLS_SSLMODES:
            dropped[sec] = "TLS to PostgreSQL (the private server has none)"
        elif f"sink.{keys.get('sink', 'main')}" in dropped:
            dropped[sec] = "its sink is not checked"
    kept = [s for s in cfg if s not in dropped]
    return kept, dropped


LIVE = [(n, t) for n, t in SHIPPED if any(s.startswith("outbox.") for s in live_plan(t)[0])]


def live_variant(text, services, dbname):
    """The ini with unusable sections removed and every kept connection pointed at the
    private servers: conninfo host/port/user/dbname (+ database =), the sink's URL, no
    password files (the local servers use trust / guest)."""
    kept, _ = live_plan(text)
    out, sec = [], None
    for line in text.splitlines():
        m = SECTION_RE.match(line)
        if m:
            sec = m[1].strip().lower()
        if sec is not None and sec not in kept:
            continue
        k = KEY_RE.match(line) if not m and line.strip()[:1] not in (";", "#") else None
        key = k[1].strip().lower() if k else None
        if sec and sec.startswith("outbox.") and key == "conninfo":
            params = conninfo_params(ini_value(k[2]))
            params.update(host=services.pg_host, port=str(services.pg_port),
                          user=services.pg_user, dbname=dbname)
            params.pop("password", None)
            line = "conninfo = " + " ".join(f"{a}={b}" for a, b in params.items())
        elif sec and sec.startswith("outbox.") and key == "database":
            line = f"database = {dbname}"
        elif sec and sec.startswith("sink.") and key == "url":
            line = f"url = {services.amqp_url}"
        elif key == "password_file" or key == "http_listen":
            line = f"{key} ="
        out.append(line)
    return "\n".join(out) + "\n"


@pytest.mark.build_independent
def test_live_candidates():
    """The files that must be checked against the local servers are."""
    assert {"config/relay.example.ini", "config/demo.ini", "deploy/relay.compose.ini"} <= set(ids(LIVE))


@pytest.mark.parametrize("name,text", LIVE, ids=ids(LIVE))
def test_shipped_ini_checks_against_local_servers(relay_bin, services, pgdb, tmp_path, name, text):
    p = tmp_path / "relay.ini"
    p.write_text(live_variant(text, services, pgdb.name))
    env = dummy_env(text, real=services.env)
    r = run_prog([relay_bin, "init", "-c", p], timeout=120, env=env)
    assert r.returncode == 0, f"init:\n{r.stdout}{r.stderr}\n{p.read_text()}"
    r = run_prog([relay_bin, "check", "-c", p], timeout=120, env=env)
    assert r.returncode == 0, f"check:\n{r.stdout}{r.stderr}\n{p.read_text()}"
    assert f"{p}: OK (" in r.stdout


# ------------------------------------------------------------------------------- real tools
@pytest.mark.build_independent
def test_yamllint():
    files = sorted(DEPLOY.glob("*.yaml")) + sorted(DEPLOY.glob("*.yml"))
    assert len(files) >= 2, files
    r = subprocess.run([tool("yamllint"), "--strict", "-f", "parsable", "-c", str(YAMLLINT_CONF),
                        *map(str, files)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def shell_scripts():
    """Every shell script in the repository: *.sh, and files whose #! names sh/bash/dash."""
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        # build*: build dirs; .services*: the harness's servers (.services-runK for the
        # other runs of scripts/test.sh), which hold Babelfish's own scripts
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and
                             not d.startswith(("build", ".services")))
        for f in sorted(filenames):
            p = pathlib.Path(dirpath) / f
            if p.suffix == ".sh":
                out.append(p)
                continue
            try:
                with open(p, "rb") as fh:
                    head = fh.readline(200)
            except OSError:
                continue
            if re.match(rb"#!\s*(/usr)?/bin/(env\s+)?(ba|da)?sh\b", head):
                out.append(p)
    return out


@pytest.mark.build_independent
def test_shellcheck_scripts():
    scripts = shell_scripts()
    rel = {str(p.relative_to(ROOT)) for p in scripts}
    assert {"scripts/test.sh", "scripts/services.sh", ".ci/run", "deploy/healthcheck.sh"} <= rel, rel
    r = subprocess.run([tool("shellcheck"), "-f", "gcc", *map(str, scripts)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def compose_scripts():
    """[(service, shell, script)] for the inline scripts of compose.yaml ($$ → $)."""
    out = []
    for name, svc in yaml.safe_load(COMPOSE.read_text())["services"].items():
        ep, cmd = svc.get("entrypoint"), svc.get("command")
        if ep and cmd and ep[-1] == "-c":
            out.append((name, "bash" if ep[0].endswith("bash") else "sh", cmd[0].replace("$$", "$")))
        test = (svc.get("healthcheck") or {}).get("test")
        if test and test[0] == "CMD-SHELL":
            out.append((f"{name} healthcheck", "sh", test[1].replace("$$", "$")))
    return out


@pytest.mark.build_independent
def test_shellcheck_compose_inline_scripts(tmp_path):
    scripts = compose_scripts()
    assert len(scripts) >= 4, scripts
    problems = []
    for name, shell, script in scripts:
        p = tmp_path / f"{name.replace(' ', '-')}.sh"
        p.write_text(f"#!/bin/{shell}\n{script}\n")
        # SC2153: the variables come from the service's environment, which shellcheck cannot see
        r = subprocess.run([tool("shellcheck"), "-e", "SC2153", "-f", "gcc", str(p)],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            problems.append(f"compose.yaml service {name}:\n{r.stdout}{r.stderr}")
    assert not problems, "\n".join(problems)


def test_systemd_analyze_verify(tmp_path, relay_bin):
    """systemd-analyze verify wants ExecStart's binary to exist: a copy of the unit points at
    the built one. Warnings (unknown keys, bad values) exit 0, so any output fails too."""
    exe = tool("systemd-analyze")
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/outbox-relay run" in text
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace("/usr/local/bin/outbox-relay", str(relay_bin)))
    r = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, SYSTEMD_COLORS="0", SYSTEMD_PAGER=""))
    assert r.returncode == 0 and (r.stdout + r.stderr).strip() == "", r.stdout + r.stderr


# ------------------------------------------------------------------------------- Dockerfile
def docker_instructions():
    """[(INSTRUCTION, args)] with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not cur and (line.strip().startswith("#") or not line.strip()):
            continue
        if cur and line.strip().startswith("#"):
            continue
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        word, _, args = cur.strip().partition(" ")
        out.append((word.upper(), args.strip()))
        cur = ""
    return out


def final_stage():
    ins = docker_instructions()
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last_from:]


def dockerignore():
    p = DEPLOY / "Dockerfile.dockerignore"
    return [line.strip() for line in p.read_text().splitlines() if line.strip() and not line.startswith("#")]


def ignored(rel):
    """Is rel (or a directory above it) excluded by one of the .dockerignore patterns?"""
    parts = pathlib.PurePosixPath(rel).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in dockerignore():
        pat = pat.lstrip("/")
        for cand in prefixes:
            if fnmatch.fnmatch(cand, pat) or fnmatch.fnmatch(cand, pat.replace("**/", "")):
                return True
    return False


def copies():
    """[(stage index, sources, dest)] of every COPY/ADD without --from (from the build context,
    which is the repository root: docker build -f deploy/Dockerfile .)."""
    out, stage = [], -1
    for word, args in docker_instructions():
        if word == "FROM":
            stage += 1
        if word in ("COPY", "ADD"):
            parts = shlex.split(args)
            if any(a.startswith("--from") for a in parts):
                continue
            parts = [a for a in parts if not a.startswith("--")]
            out.append((stage, parts[:-1], parts[-1]))
    return out


@pytest.mark.build_independent
def test_dockerfile_copies_exist():
    found = copies()
    assert found, "no COPY from the build context?"
    for _, sources, _dest in found:
        for src in sources:
            path = ROOT / src
            assert path.exists(), f"COPY {src}: no such file in the build context (the repository root)"
            if src != ".":
                assert not ignored(src), f"COPY {src}: excluded by Dockerfile.dockerignore"


@pytest.mark.build_independent
def test_dockerfile_healthcheck():
    """The final image has a HEALTHCHECK running a script COPY'd into it, with an interpreter
    the base image has (bash is Essential in Debian), and no curl/wget (purged from the image)."""
    stage = final_stage()
    hc = [args for w, args in stage if w == "HEALTHCHECK"]
    assert len(hc) == 1 and "NONE" not in hc[0].upper(), hc
    cmd = json.loads(hc[0][hc[0].index("CMD") + 3:].strip())
    assert cmd[0] == "/bin/bash", cmd
    last = sum(1 for w, _ in docker_instructions() if w == "FROM") - 1
    dests = {dest: srcs for st, srcs, dest in copies() if st == last}
    assert cmd[1] in dests and dests[cmd[1]] == ["deploy/healthcheck.sh"], (cmd, dests)
    base = [args for w, args in stage if w == "FROM"][0].split()[0]
    assert base.startswith("debian:12"), base
    r = subprocess.run(["dpkg-query", "-W", "-f=${Essential}", "bash"], capture_output=True, text=True)
    assert r.stdout.strip() == "yes", "bash is not Essential: the slim image might lack it"
    code = "\n".join(line for line in HEALTHCHECK.read_text().splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\b(curl|wget)\b", code)
    assert any(w == "RUN" and "purge -y curl" in a for w, a in stage), "the image keeps curl?"


def stage_packages(stage_index):
    """Package names of the apt-get install commands in the Dockerfile's stage (0 = build)."""
    stage, out = -1, []
    for word, args in docker_instructions():
        if word == "FROM":
            stage += 1
        if word == "RUN" and stage == stage_index:
            for cmd in re.split(r"&&", args):
                words = shlex.split(cmd)
                if "apt-get" in words and "install" in words:
                    out += [w for w in words[words.index("install") + 1:]
                            if not w.startswith("-") and "=" not in w]
    return out


def build_packages_txt():
    """scripts/packages.txt's first section (what `make` needs), up to "# Tests only"."""
    text = (ROOT / "scripts" / "packages.txt").read_text().split("# Tests only")[0]
    return [line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.build_independent
def test_build_packages_agree():
    """The build dependencies are listed three times; the lists agree: scripts/packages.txt's
    build section, the Dockerfile's build stage and README's apt-get line."""
    listed = build_packages_txt()
    assert "libjansson-dev" in listed, listed
    assert stage_packages(0) == listed, (stage_packages(0), listed)
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"apt-get install --no-install-recommends ((?:\\\n|[^\n])*)\n", readme)
    assert m, "README: no apt-get install line"
    assert m.group(1).replace("\\\n", " ").split() == listed, m.group(1)


@pytest.mark.build_independent
def test_runtime_stage_has_the_relays_libraries(relay_bin):
    """Every shared library outbox-relay links (readelf NEEDED) comes from a package the
    Dockerfile's runtime stage installs, or one of their dependencies (apt-cache depends),
    or libc6 (in the base image). A sanitizer build's runtimes (libasan, libubsan) are not
    looked for: the image is built without SANITIZER."""
    runtime = stage_packages(sum(1 for w, _ in docker_instructions() if w == "FROM") - 1)
    assert "libjansson4" in runtime, runtime
    have = set(runtime) | {"libc6"}
    # one apt-cache and one dpkg -S for all (each reads its whole database: seconds a call)
    r = subprocess.run(["apt-cache", "depends", *runtime], capture_output=True, text=True,
                       timeout=120)
    have |= set(re.findall(r"^\s*Depends: (\S+)$", r.stdout, re.M))
    d = subprocess.run(["readelf", "-d", str(relay_bin)], capture_output=True, text=True, check=True)
    libs = [lib for lib in re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", d.stdout)
            if not re.match(r"lib(asan|ubsan)\.", lib)]
    assert libs, d.stdout
    r = subprocess.run(["dpkg", "-S", *(f"*/{lib}" for lib in libs)], capture_output=True,
                       text=True, timeout=120)
    owners_of = {}   # library file name -> the packages holding a file of that name
    for line in r.stdout.splitlines():
        pkgs, _, path = line.partition(": ")
        owners_of.setdefault(os.path.basename(path.strip()), set()).update(
            p.strip().split(":")[0] for p in pkgs.split(","))
    for lib in libs:
        owners = owners_of.get(lib, set())
        assert owners & have, f"{lib} (package {owners or '?'}) is not in the runtime stage"


def dockerfile_config_path():
    cmd = json.loads([a for w, a in final_stage() if w == "CMD"][-1])
    return cmd[cmd.index("-c") + 1]


class _Status(http.server.BaseHTTPRequestHandler):
    code = 200

    def do_GET(self):  # noqa: N802 - http.server's API
        self.send_response(self.code if self.path == "/healthz" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


def healthcheck(addr=None, env=None):
    argv = ["bash", str(HEALTHCHECK)] + ([addr] if addr else [])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, **(env or {})))


def test_healthcheck_against_real_relay(relay_bin, services, pgdb, tmp_path):
    """The image's HEALTHCHECK script, run as Docker would, against `outbox-relay run`:
    healthy while it runs (also through OUTBOX_RELAY_HEALTH_ADDR), unhealthy once it is gone."""
    port = free_port()
    text = (CONFIG / "relay.example.ini").read_text()
    ini = live_variant(text, services, pgdb.name).replace("http_listen =", f"http_listen = 127.0.0.1:{port}")
    cfg = tmp_path / "relay.ini"
    cfg.write_text(ini)
    r = run_prog([relay_bin, "init", "-c", cfg], timeout=120)
    assert r.returncode == 0, r.stderr
    addr = f"127.0.0.1:{port}"
    assert healthcheck(addr).returncode == 1   # nothing listens yet
    log = open(tmp_path / "relay.log", "w")
    proc = subprocess.Popen(prog_argv([relay_bin, "run", "-c", cfg]), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: healthcheck(addr).returncode == 0, 30, interval=0.2, desc="healthcheck.sh exit 0")
        r = healthcheck(env={"OUTBOX_RELAY_HEALTH_ADDR": addr})
        assert r.returncode == 0, r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        log.close()
    assert rc == 0, (tmp_path / "relay.log").read_text()[-3000:]
    r = healthcheck(addr)
    assert r.returncode == 1 and "cannot connect" in r.stderr, r.stderr


@pytest.mark.build_independent
def test_healthcheck_refuses_non_200(tmp_path):
    _Status.code = 503
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Status)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        r = healthcheck(f"127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.returncode == 1 and "503" in r.stderr, (r.returncode, r.stderr)


# ------------------------------------------------------------ deploy files agree with their ini
DUR_MS = {"ms": 1, "s": 1000, "m": 60000, "h": 3600000, "d": 86400000}


def dur_ms(v, default_unit="s"):
    m = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", str(v).strip())
    assert m, v
    return int(m[1]) * DUR_MS[m[2] or default_unit]


def tls_consistent(cfg):
    """Within one ini: sslmode=verify-* has its sslrootcert (the image's user has no home, so
    no ~/.postgresql/root.crt); tls_ca_file only with amqps (the loader checks that too)."""
    for sec, keys in cfg.items():
        if sec.startswith("outbox.") and keys.get("source", "postgres") == "postgres":
            params = conninfo_params(keys["conninfo"])
            if params.get("sslmode", "").startswith("verify"):
                assert params.get("sslrootcert"), f"[{sec}] sslmode={params['sslmode']} without sslrootcert"


@pytest.mark.build_independent
def test_k8s_sidecar_matches_its_ini():
    docs = list(yaml.safe_load_all(K8S.read_text()))
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    relay = next(c for c in pod["containers"] if c["name"] == "outbox-relay")
    cfg_path = relay["args"][relay["args"].index("-c") + 1]
    assert cfg_path == dockerfile_config_path()

    # what the mounts put into the container: path → (kind, name, key, content)
    vols = {v["name"]: v for v in pod["volumes"]}
    files = {}
    for m in relay["volumeMounts"]:
        v = vols[m["name"]]
        if "configMap" in v:
            sources = [{"configMap": v["configMap"]}]
        elif "secret" in v:
            sources = [{"secret": dict(v["secret"], name=v["secret"]["secretName"])}]
        else:
            sources = v["projected"]["sources"]
        for src in sources:
            (kind, ref), = src.items()
            kind = {"configMap": "ConfigMap", "secret": "Secret"}[kind]
            doc = next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == ref["name"])
            data = dict(doc.get("data") or {}, **(doc.get("stringData") or {}))
            for it in ref.get("items") or [{"key": k, "path": k} for k in data]:
                assert it["key"] in data, f"{kind} {ref['name']} has no key {it['key']}"
                files[f"{m['mountPath'].rstrip('/')}/{it['path']}"] = (kind, ref["name"], it["key"], data[it["key"]])
    assert cfg_path in files, sorted(files)
    text = files[cfg_path][3]
    cfg = parse_ini(text)
    for path in ini_files(text):
        assert path in files, f"relay.ini names {path}, which no volume mounts (mounted: {sorted(files)})"
        if path.endswith(".crt"):
            assert files[path][0] == "ConfigMap" and "BEGIN CERTIFICATE" in files[path][3], path
    tls_consistent(cfg)
    for sec, keys in cfg.items():
        if sec.startswith("sink."):
            assert keys["url"].startswith("amqps://"), f"[{sec}] in-cluster traffic should be TLS"
            assert keys.get("tls_ca_file"), f"[{sec}] amqps with a private CA needs tls_ca_file"
            assert keys.get("tls_verify", "true") == "true"
        if sec.startswith("outbox."):
            assert conninfo_params(keys["conninfo"]).get("sslmode") == "verify-full", sec

    # probes and metrics on http_listen; grace period covers the shutdown
    host, _, port = cfg["relay"]["http_listen"].rpartition(":")
    assert host == "0.0.0.0", "the kubelet probes the pod IP"
    ports = {p["name"]: p["containerPort"] for p in relay["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert ports[relay[probe]["httpGet"]["port"]] == int(port), probe
    assert relay["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert relay["readinessProbe"]["httpGet"]["path"] == "/readyz"
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == int(port)
    assert pod["terminationGracePeriodSeconds"] * 1000 > dur_ms(cfg["relay"].get("shutdown_timeout", "10s"))
    if relay["securityContext"].get("readOnlyRootFilesystem"):
        assert not cfg["relay"].get("log_file"), "log_file on a read-only root filesystem"
    user = [a for w, a in final_stage() if w == "USER"][-1].split(":")[0]
    assert str(pod["securityContext"]["runAsUser"]) == user


@pytest.mark.build_independent
def test_compose_matches_its_ini():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    relay = services["relay"]
    mounts = [v.split(":") for v in relay["volumes"]]
    src = next(m for m in mounts if m[1] == dockerfile_config_path())
    ini_path = (DEPLOY / src[0]).resolve()
    assert ini_path == DEPLOY / "relay.compose.ini"
    text = ini_path.read_text()
    cfg = parse_ini(text)
    # the relay gets exactly the variables its ini uses (no superuser passwords)
    used = {n for keys in cfg.values() for v in keys.values() for n in PLACEHOLDER_RE.findall(v)}
    assert set(relay["environment"]) == used
    assert not ini_files(text), "compose mounts no secret or CA files"
    tls_consistent(cfg)
    for sec, keys in cfg.items():
        if sec.startswith("sink."):
            m = re.fullmatch(r"(amqps?)://([^:@/]+)(?::[^@/]*)?@([^:/]+):(\d+)/.*", keys["url"])
            assert m, keys["url"]
            scheme, user, host, port = m.groups()
            assert host in services and host in relay["depends_on"]
            rabbit = services[host]
            assert rabbit["environment"]["RABBITMQ_DEFAULT_USER"] == user
            # the rabbitmq service configures no TLS listener: plain amqp on 5672
            assert (scheme, port) == ("amqp", "5672"), "compose's RabbitMQ has no TLS listener"
        if sec.startswith("outbox.") and keys.get("source", "postgres") == "postgres":
            params = conninfo_params(keys["conninfo"])
            assert params["host"] in services and params.get("port", "5432") == "5432"
            assert params.get("sslmode") == "disable", "postgres:15 in compose runs without TLS"
            assert params["user"] in services["postgres-init"]["command"][0]
            assert keys["database"] == params["dbname"] == services[params["host"]]["environment"]["POSTGRES_DB"]
        if sec.startswith("outbox.") and keys.get("source") in ("sqlserver", "odbc"):
            attrs = dict(a.split("=", 1) for a in keys["conninfo"].split(";") if a)
            assert attrs["Driver"] == "{ODBC Driver 18 for SQL Server}"
            assert "msodbcsql18" in DOCKERFILE.read_text()
            server = attrs["Server"].removeprefix("tcp:").split(",")[0]
            assert server in services and f"{server}-init" in relay["depends_on"]
            assert attrs["Uid"] in services["sqlserver-init"]["command"][0]
            assert keys["database"] == attrs["Database"]
    host, _, port = cfg["relay"]["http_listen"].rpartition(":")
    assert host == "0.0.0.0" and any(p.endswith(f":{port}:{port}") for p in relay["ports"])
    # the image's HEALTHCHECK probes 127.0.0.1:9187 unless OUTBOX_RELAY_HEALTH_ADDR says otherwise
    assert port == "9187" or "OUTBOX_RELAY_HEALTH_ADDR" in relay["environment"]
    assert dur_ms(relay["stop_grace_period"]) > dur_ms(cfg["relay"].get("shutdown_timeout", "10s"))


@pytest.mark.build_independent
def test_systemd_unit_matches_the_defaults():
    text = UNIT.read_text()
    exec_start = re.search(r"^ExecStart=(.+)$", text, re.M)[1].split()
    assert exec_start[exec_start.index("-c") + 1] == dockerfile_config_path()
    stop = re.search(r"^TimeoutStopSec=(\S+)$", text, re.M)[1]
    default = parse_ini((CONFIG / "relay.example.ini").read_text())["relay"]["shutdown_timeout"]
    assert dur_ms(stop) > dur_ms(default)
