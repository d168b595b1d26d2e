"""The Debian packages (`make deb`, deploy/debian/): outbox-relay, liboutbox1 and liboutbox-dev
are built, lintian clean, installed on this machine with `apt-get install ./build/*.deb` and
used as a Debian user would: the relay's version, its man pages, pkg-config, the library's
symbols file, README's app.c built against the installed library, `outbox-relay check` with
the shipped relay.ini pointed at the test servers, `systemd-analyze verify` on the installed
unit. Then, with the service configured and running, an upgrade to a newer version built
with the Makefile's VERSION bumped, `apt-get remove`, `dpkg -r` and `dpkg --purge`, which
must leave nothing behind but the system user.

systemd is not PID 1 on the CI machine: a stand-in systemctl (SYSTEMCTL below) runs the
installed unit's commands as its user, and apt-get runs where /run/systemd/system exists
(a private mount namespace), so that the maintainer scripts start, restart and stop the
service as they would under systemd.

The packages go into the real system, so this runs once per CI run: in the plain build's run
only. scripts/test.sh runs the plain and the sanitizer builds at the same time; both
installing and removing the same packages would fight over dpkg's lock and over the files.
"""
import grp
import json
import os
import pathlib
import pwd
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time

import pytest

from conftest import scratch_database, wait_for
from test_install import readme_app, run_app_and_check

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("outbox-relay", "liboutbox1", "liboutbox-dev")
RELAY = pathlib.Path("/usr/bin/outbox-relay")
CONF = pathlib.Path("/etc/outbox-relay/relay.ini")
UNIT = pathlib.Path("/lib/systemd/system/outbox-relay.service")
USER = "outbox-relay"
# where a package's files and its traces (dpkg's database, systemd's enablement) live
SCAN_ROOTS = ("/etc", "/usr", "/var")
# /var/cache/man: man-db's cache of formatted pages, filled by whoever reads a page (here
# systemd-analyze verify, which reads the pages Documentation= names) and cleaned by man-db's
# daily job; not the package's files. The fixture removes what this test put there.
MAN_CACHE = "/var/cache/man"
SCAN_SKIP = ("/var/tmp", MAN_CACHE)
LOCK_WAIT = 600          # other jobs on the machine may hold dpkg's lock this long

SYSTEMCTL = r'''#!/usr/bin/python3
# systemctl for tests/test_deb.py, which the package's maintainer scripts reach through
# deb-systemd-invoke while /run/systemd/system exists (the test mounts it in a private mount
# namespace): systemd is not PID 1 on the test machine. It runs outbox-relay.service as the
# unit file says (ExecCondition=, ExecStart=, User=, Group=, SIGTERM and TimeoutStopSec= to
# stop) and records every call, with the installed relay's version at that moment, in
# STATE/calls.jsonl. What systemctl does on the file system alone (presets, is-enabled) is
# left to systemd's own systemctl (--root=/); other units and verbs are recorded only.
import json, os, pathlib, shlex, signal, subprocess, sys, time

STATE = pathlib.Path(@STATE@)
UNIT = "outbox-relay.service"
UNIT_FILE = pathlib.Path("/lib/systemd/system") / UNIT
PIDFILE, EXITFILE, LOG = STATE / "main.pid", STATE / "main.exit", STATE / "relay.log"


def unit():
    keys = {}
    for line in UNIT_FILE.read_text().splitlines():
        k, sep, v = line.partition("=")
        if sep and not line.startswith("#"):
            keys.setdefault(k.strip(), v.strip().replace("$$", "$"))   # systemd's "$$"
    return keys


def main_pid():
    try:
        pid = int(PIDFILE.read_text())
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    return None if stat.rsplit(")", 1)[1].split()[0] in "ZX" else pid


def relay_version():
    try:
        return subprocess.run(["/usr/bin/outbox-relay", "--version"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except OSError:
        return None


def as_user(u):
    return {"user": u["User"], "group": u["Group"], "extra_groups": []}


def start(rec):
    u = unit()
    cond = subprocess.run(shlex.split(u["ExecCondition"]), timeout=30, **as_user(u))
    rec["condition"] = cond.returncode
    if 1 <= cond.returncode <= 254:
        return 0                                   # skipped, not failed
    if cond.returncode:
        return 1
    EXITFILE.unlink(missing_ok=True)
    with open(LOG, "ab") as log:
        subprocess.Popen([sys.executable, __file__, "--supervise"], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 30
    while main_pid() is None and not EXITFILE.exists():
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.05)
    rec["started"] = main_pid()
    return 0


def supervise():
    u = unit()
    p = subprocess.Popen(shlex.split(u["ExecStart"]), stdin=subprocess.DEVNULL, cwd="/",
                         env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
                         **as_user(u))
    publish(PIDFILE, p.pid)
    rc = p.wait()
    publish(EXITFILE, rc)
    PIDFILE.unlink(missing_ok=True)


def publish(path, n):
    """Writes N to PATH whole: a reader polling for the file never sees it empty."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(n))
    os.replace(tmp, path)


def stop(rec):
    pid = main_pid()
    if pid is None:
        return 0
    rec["stopped"] = pid
    os.kill(pid, signal.SIGTERM)
    timeout = float(unit().get("TimeoutStopSec", "90").rstrip("s"))
    deadline = time.monotonic() + timeout
    while not EXITFILE.exists():
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            rec["killed"] = True
            deadline += 30
        time.sleep(0.05)
    rec["exit"] = int(EXITFILE.read_text())
    return 0


def real_systemctl(argv):
    """systemd's own systemctl for what it does on the file system alone (--root=/):
    deb-systemd-helper's presets, and whether a unit is enabled."""
    exe = next(p for p in ("/usr/bin/systemctl", "/bin/systemctl") if os.path.exists(p))
    if not any(a.startswith("--root") for a in argv):
        argv = ["--root=/", *argv]
    return subprocess.run([exe, *argv], timeout=60).returncode


def main(argv):
    if argv == ["--supervise"]:
        return supervise()
    words = [a for a in argv if not a.startswith("-")]
    verb, units = (words[0] if words else None), words[1:]
    ours = [x if x.endswith(".service") else x + ".service" for x in units] == [UNIT]
    rec = {"argv": argv, "verb": verb, "ours": ours, "version": relay_version(),
           "active_before": main_pid()}
    rc = 0
    if any(a.startswith("--root") for a in argv) or verb == "is-enabled":
        sys.stdout.flush()
        rc = real_systemctl(argv)
    elif ours and verb == "is-active":
        rc = 0 if main_pid() else 3
        if "--quiet" not in argv:
            print("active" if rc == 0 else "inactive")
    elif ours and verb == "start":
        rc = 0 if main_pid() else start(rec)
    elif ours and verb == "stop":
        rc = stop(rec)
    elif ours and verb == "restart":
        stop(rec)
        rc = start(rec)
    rec["rc"] = rc
    with open(STATE / "calls.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rc


sys.exit(main(sys.argv[1:]))
'''


class Systemd:
    """What systemd would do for the package on this machine, where it is not PID 1: the
    stand-in systemctl above (in `dir`, first on PATH), its record of calls, and apt-get and
    dpkg run in a private mount namespace where /run/systemd/system exists, so that the
    maintainer scripts take their systemd branch (the machine's own /run is not touched)."""

    def __init__(self, state):
        self.state = state
        self.dir = state / "bin"
        self.dir.mkdir()
        exe = self.dir / "systemctl"
        exe.write_text(SYSTEMCTL.replace("@STATE@", repr(str(state))))
        exe.chmod(0o755)

    def env(self):
        return dict(clean_env(), PATH=f"{self.dir}:{os.environ['PATH']}")

    def ctl(self, *args):
        r = run([self.dir / "systemctl", *args], timeout=120, env=self.env())
        assert r.returncode == 0, (args, r.returncode, r.stdout + r.stderr, self.log())
        return r

    def calls(self):
        f = self.state / "calls.jsonl"
        lines = f.read_text().splitlines() if f.exists() else []
        return [json.loads(ln) for ln in lines]

    def ours(self, since=0):
        """The calls about outbox-relay.service that act on it, after the first `since`."""
        return [c for c in self.calls()[since:]
                if c["ours"] and c["verb"] in ("start", "stop", "restart")]

    def main_pid(self):
        try:
            pid = int((self.state / "main.pid").read_text())
            st = pathlib.Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            return None
        return None if st.rsplit(")", 1)[1].split()[0] in "ZX" else pid

    def log(self):
        f = self.state / "relay.log"
        return f.read_text(errors="replace")[-4000:] if f.exists() else ""

    def apt_get(self, *args):
        """apt-get ARGS as the package manager runs on a systemd machine (apt gives dpkg a
        PATH of its own, DPkg::Path: the stand-in goes first there too). A container's
        /usr/sbin/policy-rc.d (Docker's denies every service action, exit 101) is replaced
        by one allowing them, in the namespace only."""
        script = ("mount -t tmpfs -o size=1m,mode=0755 tmpfs /run/systemd && "
                  "mkdir /run/systemd/system && "
                  "{ ! [ -e /usr/sbin/policy-rc.d ] || "
                  "mount --bind /bin/true /usr/sbin/policy-rc.d; } && "
                  "exec \"$@\"")
        return run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                    "apt-get", "-y", "-o", f"DPkg::Lock::Timeout={LOCK_WAIT}",
                    "-o", f"DPkg::Path={self.dir}:/usr/sbin:/usr/bin:/sbin:/bin", *args],
                   timeout=LOCK_WAIT + 300, cwd=ROOT, env=self.env())


def version():
    return re.search(r"^VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def clean_env():
    """No MAKEFLAGS, SANITIZER, BUILD or CFLAGS of an enclosing `make test`: the packages are
    built with dpkg's flags only."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C.UTF-8")
    for k in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "BUILD", "SANITIZER",
              "CFLAGS", "CPPFLAGS", "LDFLAGS", "CPATH", "C_INCLUDE_PATH", "LIBRARY_PATH",
              "OUTBOX_BUILD"):
        env.pop(k, None)
    return env


def run(argv, timeout=120, **kw):
    kw.setdefault("env", clean_env())
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, **kw)


def dpkg(*args):
    """dpkg ARGS, waiting (bounded) while another package manager holds the lock."""
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        r = run(["dpkg", *args], timeout=LOCK_WAIT)
        if r.returncode == 0 or "lock" not in r.stderr or time.monotonic() > deadline:
            return r
        time.sleep(2)


def status(pkg):
    """dpkg's status of pkg ('install ok installed', 'deinstall ok config-files', ...), or
    None when dpkg does not know it (any more)."""
    r = run(["dpkg-query", "-W", "-f", "${Status}", pkg])
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def known(pkg):
    s = status(pkg)
    return s is not None and not s.endswith("not-installed")


def traces():
    """Every path under SCAN_ROOTS whose name mentions outbox: what a package of ours (or
    dpkg and systemd on its behalf) put there."""
    out = set()
    for top in SCAN_ROOTS:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames
                           if os.path.join(dirpath, d) not in SCAN_SKIP]
            for name in dirnames + filenames:
                if "outbox" in name:
                    out.add(os.path.join(dirpath, name))
    return out


def purge_all():
    present = [p for p in PACKAGES if known(p)]
    if present:
        r = dpkg("--purge", *present)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def debs(build):
    """`make deb`, once: the three packages in build/."""
    if re.fullmatch(r"build-(address|undefined|address\+undefined)", build.name):
        pytest.skip(f"the Debian packages are built and installed once per CI run, by the plain "
                    f"build's tests; not by this sanitizer run ({build.name}), which runs at the "
                    f"same time and would fight the plain run over dpkg's lock and the "
                    f"installed files")
    if os.geteuid() != 0:
        pytest.skip("installing packages with apt-get and dpkg needs root")
    r = run(["make", "-C", ROOT, "deb"], timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    v = version()
    found = sorted(p.name for p in (ROOT / "build").glob("*.deb"))
    arch = run(["dpkg", "--print-architecture"]).stdout.strip()
    assert found == sorted(f"{p}_{v}_{arch}.deb" for p in PACKAGES), found
    return [ROOT / "build" / name for name in found]


@pytest.fixture(scope="module")
def systemd(tmp_path_factory):
    return Systemd(tmp_path_factory.mktemp("systemd"))


@pytest.fixture(scope="module")
def installed(debs, systemd):
    """The packages installed with apt-get (as on a systemd machine: through the stand-in);
    the paths naming outbox that were there before. Purged again at the end, whatever
    happened."""
    purge_all()      # left over by an interrupted run
    before = traces()
    rel = [f"./{p.relative_to(ROOT)}" for p in debs]      # ./build/*.deb
    r = systemd.apt_get("install", *rel)
    try:
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        for p in PACKAGES:
            assert status(p) == "install ok installed", (p, status(p))
        yield before
    finally:
        pid = systemd.main_pid()
        if pid:              # a failed test left the service running
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: systemd.main_pid() is None, 60, desc="the service's relay to exit")
        purge_all()
        for p in pathlib.Path(MAN_CACHE).glob("cat*/outbox-relay*"):
            p.unlink()


@pytest.fixture(scope="module")
def newer_debs(debs, tmp_path_factory):
    """(version, packages) of the same tree with the Makefile's VERSION bumped, the one place
    the version is written, built by `make deb` in a copy of the tree: what an upgrade
    installs."""
    old = version()
    new = re.sub(r"(\d+)$", lambda m: str(int(m[1]) + 1), old)
    assert run(["dpkg", "--compare-versions", new, "gt", old]).returncode == 0, (old, new)
    src = tmp_path_factory.mktemp("newer") / "outbox-relay"

    def skip(d, names):      # what `make deb` leaves out of its own copy
        top = pathlib.Path(d) == ROOT
        return [n for n in names if n in ("__pycache__", ".pytest_cache") or
                (top and (n == ".git" or n.startswith(("build", ".services"))))]
    shutil.copytree(ROOT, src, symlinks=True, ignore=skip)
    mk = src / "Makefile"
    text, n = re.subn(r"^(VERSION\s*:=\s*)\S+", rf"\g<1>{new}", mk.read_text(), count=1,
                      flags=re.M)
    assert n == 1
    mk.write_text(text)
    r = run(["make", "-C", src, "deb"], timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    found = sorted((src / "build").glob("*.deb"))
    assert [p.name.split("_")[:2] for p in found] == sorted([p, new] for p in PACKAGES), found
    yield new, found
    shutil.rmtree(src, ignore_errors=True)


@pytest.fixture(scope="module")
def service(installed, systemd, services):
    """The service under the systemctl stand-in, with a database and a queue of its own for
    the messages it relays; its relay is stopped at the end (before the packages are
    purged), then the database and the queue dropped."""
    sd = systemd
    dbs = scratch_database(services)
    sd.db = next(dbs)
    sd.queue = f"deb-{sd.db.name}"
    sd.sent = 0
    with services.amqp_connect() as c:
        c.channel().queue_declare(sd.queue, durable=True)
    try:
        yield sd
    finally:
        pid = sd.main_pid()
        if pid:
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: sd.main_pid() is None, 60, desc="the service's relay to exit")
        with services.amqp_connect() as c:
            c.channel().queue_delete(sd.queue)
        dbs.close()          # drops the database


def deliver(sd, services, text):
    """One message written into the service's outbox; returns once the service's relay has
    marked it sent (the broker confirmed it), and checks that the queue holds every message
    written so far."""
    with sd.db.connect() as c:
        row = c.execute("insert into outbox.messages (message_id, routing_key, payload) "
                        "values (gen_random_uuid(), %s, %s) returning id",
                        (sd.queue, text.encode())).fetchone()[0]
        wait_for(lambda: c.execute("select sent_at is not null from outbox.messages "
                                   "where id = %s", (row,)).fetchone()[0], 60,
                 desc=f"the service to relay {text!r}; its log:\n{sd.log()}")
    sd.sent += 1
    with services.amqp_connect() as c:
        depth = c.channel().queue_declare(sd.queue, passive=True).method.message_count
    assert depth == sd.sent, (depth, sd.sent)


def run_service(sd, services):
    """The service running as an administrator sets it up: relay.ini edited in place to
    point at the test servers, `outbox-relay init`, `systemctl start`; one message relayed."""
    if sd.main_pid() is None:
        CONF.write_text(configured(services, sd.db.name))
        r = run([RELAY, "init", "-c", CONF], timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        sd.ctl("start", "outbox-relay.service")
        assert sd.main_pid(), f"not started: {sd.calls()[-1]}\n{sd.log()}"
    deliver(sd, services, f"running {sd.sent}")


def test_lintian_clean(debs):
    """No error, warning, info, pedantic or experimental tag, on the source package or the
    binaries; overrides in deploy/debian/*.lintian-overrides and
    deploy/debian/source/lintian-overrides each carry their reason."""
    exe = shutil.which("lintian")
    assert exe, "lintian not installed (scripts/packages.txt lists it)"
    dsc = sorted((ROOT / "build" / "deb").glob("outbox-relay_*.dsc"))
    assert len(dsc) == 1, "make deb built no source package"
    # --display-info shows the info tags (--info would only explain each tag); an override that
    # matches nothing any more is itself one: I: unused-override
    r = run([exe, "--display-info", "--pedantic", "--display-experimental",
             "--fail-on", "error,warning,info,pedantic,experimental", *dsc, *debs],
            timeout=600)
    tags = [ln for ln in r.stdout.splitlines() if re.match(r"[EWIPX]: ", ln)]
    assert r.returncode == 0 and not tags, r.stdout + r.stderr
    debian = ROOT / "deploy" / "debian"
    overrides = [*debian.glob("*.lintian-overrides"), debian / "source" / "lintian-overrides"]
    for f in overrides:
        lines = f.read_text().splitlines() if f.exists() else []
        for i, line in enumerate(lines):
            if line.strip() and not line.startswith("#"):
                assert i > 0 and lines[i - 1].startswith("#"), f"{f.name}: {line} has no reason"


def test_one_version_everywhere(installed, debs):
    """The Makefile's VERSION is the packages' version, the installed relay's, outbox.pc's,
    the man pages', the packaged changelog's and the installed outbox.h's
    OUTBOX_VERSION_STRING."""
    v = version()
    for deb in debs:
        r = run(["dpkg-deb", "-f", deb, "Version"])
        assert r.stdout.strip() == v, (deb.name, r.stdout, r.stderr)
    for p in PACKAGES:
        assert run(["dpkg-query", "-W", "-f", "${Version}", p]).stdout == v
    r = run([RELAY, "--version"])
    assert r.returncode == 0 and r.stdout == f"outbox-relay {v}\n", r.stdout + r.stderr
    r = run(["pkg-config", "--modversion", "outbox"])
    assert r.returncode == 0 and r.stdout.strip() == v, r.stdout + r.stderr
    r = run(["zcat", "/usr/share/doc/outbox-relay/changelog.gz"])
    assert r.stdout.startswith(f"outbox-relay ({v}) "), r.stdout[:200]
    r = run(["zcat", "/usr/share/man/man1/outbox-relay.1.gz"])
    assert f'"outbox-relay {v}"' in r.stdout
    define = f'#define OUTBOX_VERSION_STRING "{v}"'
    assert define in pathlib.Path("/usr/include/outbox.h").read_text().splitlines()


def test_man_pages(installed):
    env = dict(clean_env(), MANPAGER="cat", PAGER="cat")
    for args, path in ((["outbox-relay"], "/usr/share/man/man1/outbox-relay.1.gz"),
                       (["5", "outbox-relay.ini"], "/usr/share/man/man5/outbox-relay.ini.5.gz")):
        r = run(["man", "-w", *args], env=env)
        assert r.returncode == 0 and r.stdout.strip() == path, r.stdout + r.stderr
        # -l: formatted from the file, not kept in man's cache of formatted pages
        r = run(["man", "-l", path], env=dict(env, MANWIDTH="80"))
        assert r.returncode == 0 and "NAME" in r.stdout, r.stderr


def test_files_where_debian_wants_them(installed):
    ma = run(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"]).stdout.strip()
    assert ma, "dpkg-architecture"
    libdir = pathlib.Path("/usr/lib") / ma
    for f in ("liboutbox.so.1", "liboutbox.so", "liboutbox.a", "pkgconfig/outbox.pc"):
        assert (libdir / f).exists(), libdir / f
    for h in ("outbox.h", "outbox_pg.h", "outbox_odbc.h"):     # the version: make deb's own
        got, want = ((d / h).read_text().splitlines() for d in (pathlib.Path("/usr/include"),
                                                                 ROOT / "lib"))
        assert ([ln for ln in got if "OUTBOX_VERSION_STRING" not in ln] ==
                [ln for ln in want if "OUTBOX_VERSION_STRING" not in ln]), h
    r = run(["pkg-config", "--variable=libdir", "outbox"])
    assert r.stdout.strip() == str(libdir), r.stdout + r.stderr
    owners = run(["dpkg", "-S", str(libdir / "liboutbox.so.1"), str(libdir / "liboutbox.a"),
                  str(RELAY)]).stdout
    for pkg in PACKAGES:     # Multi-Arch: same packages are named with their architecture
        assert re.search(rf"^{pkg}(:\S+)?: ", owners, re.M), (pkg, owners)


def test_symbols_file_is_the_librarys_abi(installed):
    """liboutbox1's symbols file (deploy/debian/liboutbox1.symbols, which `make deb` also
    holds the built library to) names exactly what the installed liboutbox.so.1 exports, and
    dpkg has it: a package built against liboutbox gets its dependency from it."""
    ma = run(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"]).stdout.strip()
    r = run(["nm", "-D", "--defined-only", f"/usr/lib/{ma}/liboutbox.so.1"])
    assert r.returncode == 0, r.stderr
    exported = {ln.split()[-1] for ln in r.stdout.splitlines() if ln.strip()}
    r = run(["dpkg-query", "--control-show", "liboutbox1", "symbols"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "liboutbox.so.1 liboutbox1 #MINVER#", lines[:1]
    shipped = {ln.split()[0].removesuffix("@Base") for ln in lines if ln.startswith(" ")}
    assert shipped == exported, (sorted(shipped - exported), sorted(exported - shipped))
    tree = (ROOT / "deploy" / "debian" / "liboutbox1.symbols").read_text().splitlines()
    assert {ln.split()[0].removesuffix("@Base") for ln in tree if ln.startswith(" ")} == shipped


def test_system_user_and_conffile(installed):
    """sysusers.d made a system user with no login; relay.ini is a conffile that the service's
    group can read and others cannot (it may hold passwords)."""
    u = pwd.getpwnam(USER)
    assert u.pw_uid < 1000 and u.pw_shell.endswith("nologin"), u
    g = grp.getgrnam(USER)
    assert u.pw_gid == g.gr_gid
    conffiles = run(["dpkg-query", "-W", "-f", "${Conffiles}", "outbox-relay"]).stdout
    assert str(CONF) in conffiles, conffiles
    for path, mode in ((CONF.parent, 0o750), (CONF, 0o640)):
        st = path.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, g.gr_gid, mode), \
            (path, st.st_uid, st.st_gid, oct(st.st_mode))


def unit_lines(text):
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def test_installed_unit(installed):
    """The packaged unit is deploy/outbox-relay.service with the package's paths and an
    ExecCondition; it runs the installed binary as the user the package made; it is enabled;
    systemd-analyze verify (which also looks up the man pages Documentation= names) says
    nothing."""
    text = UNIT.read_text()
    deploy = (ROOT / "deploy" / "outbox-relay.service").read_text()
    want = [ln.replace("/usr/local/bin/", "/usr/bin/") for ln in unit_lines(deploy)
            if not ln.startswith("Documentation=")]
    got = [ln for ln in unit_lines(text)
           if not ln.startswith(("Documentation=", "ExecCondition="))]
    assert got == want, "\n".join(set(got) ^ set(want))
    assert "/usr/local" not in text
    exec_start = re.search(r"^ExecStart=(\S+) run -c (\S+)$", text, re.M)
    assert exec_start and exec_start[1] == str(RELAY) and exec_start[2] == str(CONF), text
    assert re.search(rf"^User={USER}$", text, re.M) and re.search(rf"^Group={USER}$", text, re.M)
    link = pathlib.Path("/etc/systemd/system/multi-user.target.wants/outbox-relay.service")
    assert link.is_symlink() and link.resolve() == UNIT.resolve(), "not enabled"
    exe = shutil.which("systemd-analyze")
    assert exe, "systemd-analyze not installed (package systemd)"
    r = run([exe, "verify", UNIT], env=dict(clean_env(), SYSTEMD_COLORS="0", SYSTEMD_PAGER=""))
    assert r.returncode == 0 and (r.stdout + r.stderr).strip() == "", r.stdout + r.stderr


def exec_condition():
    m = re.search(r"^ExecCondition=(.+)$", UNIT.read_text(), re.M)
    assert m, "the unit has no ExecCondition"
    return shlex.split(m[1].replace("$$", "$"))   # systemd's "$$" is a dollar sign


def configured(services, dbname):
    """The shipped relay.ini with its settings uncommented, the outbox and sink pointed at the
    test servers and the HTTP listener off (the port may be taken)."""
    out = []
    for line in CONF.read_text().splitlines():
        if line.startswith("#"):
            line = line[1:]
        key = re.match(r"(\w+)\s*=", line)
        key = key[1] if key else None
        if key == "conninfo":
            line = f"conninfo = {services.pg_dsn(dbname)}"
        elif key == "database":
            line = f"database = {dbname}"
        elif key == "url":
            line = f"url = {services.amqp_url}"
        elif key == "http_listen":
            line = "http_listen ="
        out.append(line)
    return "\n".join(out) + "\n"


def test_shipped_config_keeps_the_service_down_until_configured(installed, systemd, services,
                                                               pgdb, tmp_path):
    """Installed, relay.ini has no setting: the postinst's start was skipped by the unit's
    ExecCondition (not failed, nothing runs), and `check` refuses the file; configured,
    both pass."""
    starts = systemd.ours()
    assert [c["verb"] for c in starts] == ["start"], systemd.calls()
    assert starts[0]["condition"] == 1 and "started" not in starts[0], starts
    assert starts[0]["rc"] == 0 and systemd.main_pid() is None, starts
    shipped = CONF.read_text()
    settings = [ln for ln in shipped.splitlines() if ln.strip() and ln.lstrip()[0] not in ";#"]
    assert not settings, settings
    example = [ln for ln in (ROOT / "config" / "relay.example.ini").read_text().splitlines()
               if ln.strip() and not ln.lstrip().startswith(";")]
    assert [ln[1:] for ln in shipped.splitlines() if ln.startswith("#")] == example, \
        "relay.ini is not config/relay.example.ini with every setting commented out"
    r = run([RELAY, "check", "-c", CONF])
    assert r.returncode == 2 and "[outbox.NAME]" in r.stderr, r.stdout + r.stderr
    cond = exec_condition()
    assert cond[-1] == str(CONF), cond
    r = run(cond)
    assert r.returncode == 1, (cond, r.returncode, r.stderr)

    ini = tmp_path / "relay.ini"
    ini.write_text(configured(services, pgdb.name))
    r = run([*cond[:-1], ini])
    assert r.returncode == 0, (cond, r.returncode, r.stderr)
    # a relay.ini the service cannot read fails the unit (1-254 would skip it quietly)
    r = run([*cond[:-1], tmp_path / "missing.ini"])
    assert r.returncode == 255, (cond, r.returncode, r.stderr)
    r = run([RELAY, "init", "-c", ini], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr + ini.read_text()
    r = run([RELAY, "check", "-c", ini], timeout=120)
    assert r.returncode == 0 and f"{ini}: OK (" in r.stdout, r.stdout + r.stderr + ini.read_text()


def test_readme_app_against_the_installed_library(installed, services, pgdb, tmp_path):
    """README's app.c, built exactly as README says with the installed outbox.pc, linked to
    the installed liboutbox.so.1, writes its order message."""
    ini = tmp_path / "relay.ini"
    ini.write_text(configured(services, pgdb.name))
    r = run([RELAY, "init", "-c", ini], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    src, payload = readme_app()
    (tmp_path / "app.c").write_text(src)
    r = run(["sh", "-c", "cc app.c $(pkg-config --cflags --libs outbox) -o app"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ldd = run(["ldd", tmp_path / "app"]).stdout
    ma = run(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"]).stdout.strip()
    m = re.search(r"liboutbox\.so\.1 => (\S+)", ldd)
    assert m and pathlib.Path(m[1]).resolve() == pathlib.Path(f"/usr/lib/{ma}/liboutbox.so.1").resolve(), ldd
    run_app_and_check(tmp_path / "app", pgdb, payload, env=clean_env())


def test_upgrade_keeps_the_conffile_and_restarts_the_running_service(service, newer_debs,
                                                                    services):
    """`apt-get install` of a newer version (the Makefile's VERSION bumped) over the
    configured, running service: dpkg keeps the administrator's relay.ini, its owner and
    mode; the new postinst restarts the service once the new files are in place, the old
    relay ending on SIGTERM with exit 0 (its in-flight confirms settled), and the new relay
    runs the new binary and relays. Nothing stops the service before that."""
    new, debs = newer_debs
    run_service(service, services)
    conf, st = CONF.read_bytes(), CONF.stat()
    old_pid = service.main_pid()
    n = len(service.calls())
    r = service.apt_get("install", *debs)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    for p in PACKAGES:
        assert run(["dpkg-query", "-W", "-f", "${Version}", p]).stdout == new, p
    assert run([RELAY, "--version"]).stdout == f"outbox-relay {new}\n"
    header = pathlib.Path("/usr/include/outbox.h").read_text()
    assert f'#define OUTBOX_VERSION_STRING "{new}"' in header
    assert CONF.read_bytes() == conf, "the upgrade replaced the administrator's relay.ini"
    after = CONF.stat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (st.st_uid, st.st_gid, st.st_mode)
    assert not list(CONF.parent.glob("relay.ini.dpkg-*")), list(CONF.parent.iterdir())
    acts = service.ours(n)
    assert [c["verb"] for c in acts] == ["restart"], (acts, r.stdout[-2000:])
    restart = acts[0]
    assert restart["version"] == f"outbox-relay {new}", restart
    assert restart["stopped"] == old_pid and restart["exit"] == 0, (restart, service.log())
    assert not restart.get("killed"), restart
    new_pid = service.main_pid()
    assert new_pid and new_pid != old_pid and restart["started"] == new_pid, restart
    assert os.readlink(f"/proc/{new_pid}/exe") == str(RELAY)      # not "(deleted)"
    deliver(service, services, "after the upgrade")


def test_remove_with_the_service_running_then_purge_leave_nothing_behind(installed, service,
                                                                         services, debs):
    """Last. `apt-get remove outbox-relay` with the service running: the prerm stops it
    while its files are still there (SIGTERM, exit 0), and the conffile stays (and the
    enablement state); `dpkg -r` removes the libraries; `dpkg --purge` removes everything
    else. What stays is the system user: files it owned elsewhere must not pass to a later
    user of its uid."""
    before = installed
    run_service(service, services)
    pid = service.main_pid()
    n = len(service.calls())
    r = service.apt_get("remove", "outbox-relay")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    acts = service.ours(n)
    assert [c["verb"] for c in acts] == ["stop"], (acts, r.stdout[-2000:])
    stop = acts[0]
    assert stop["version"] is not None, "the relay was stopped after its files were removed"
    assert stop["stopped"] == pid and stop["exit"] == 0 and not stop.get("killed"), \
        (stop, service.log())
    assert service.main_pid() is None
    assert status("outbox-relay") == "deinstall ok config-files"
    r = dpkg("-r", "liboutbox-dev", "liboutbox1")
    assert r.returncode == 0, r.stdout + r.stderr
    for p in PACKAGES:
        assert status(p) != "install ok installed", (p, status(p))
    assert not RELAY.exists() and not UNIT.exists()
    assert CONF.is_file(), "removing the package removed the conffile"
    left = traces() - before
    assert all(p.startswith(("/etc/outbox-relay", "/etc/systemd/", "/var/lib/systemd/",
                             "/var/lib/dpkg/info/")) for p in left), sorted(left)

    r = dpkg("--purge", *PACKAGES)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in PACKAGES:
        assert not known(p), (p, status(p))
    assert traces() == before, sorted(traces() ^ before)
    for deb in debs:         # and every file the packages shipped is gone
        r = run(["dpkg-deb", "-c", deb])
        assert r.returncode == 0, r.stderr
        files = [ln.split()[5].removeprefix(".") for ln in r.stdout.splitlines()
                 if not ln.startswith("d")]
        assert files and not [f for f in files if os.path.lexists(f)], (deb.name, files)
    pwd.getpwnam(USER)     # the user stays, as policy allows
