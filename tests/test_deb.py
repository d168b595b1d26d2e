"""The Debian packages (`make deb`, deploy/debian/): outbox-relay, liboutbox1 and liboutbox-dev
are built, lintian clean, installed on this machine with `apt-get install ./build/*.deb` and
used as a Debian user would: the relay's version, its man pages, pkg-config, README's app.c
built against the installed library, `outbox-relay check` with the shipped relay.ini pointed
at the test servers, `systemd-analyze verify` on the installed unit. Then `dpkg -r` and
`dpkg --purge` must leave nothing behind but the system user.

The packages go into the real system, so this runs once per CI run: in the plain build's run
only. scripts/test.sh runs the plain and the sanitizer builds at the same time; both
installing and removing the same packages would fight over dpkg's lock and over the files.
"""
import grp
import os
import pathlib
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import time

import pytest

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
def installed(debs):
    """The packages installed with apt-get; the paths naming outbox that were there before.
    Purged again at the end, whatever happened."""
    purge_all()      # left over by an interrupted run
    before = traces()
    rel = [f"./{p.relative_to(ROOT)}" for p in debs]      # ./build/*.deb
    r = run(["apt-get", "install", "-y", "-o", f"DPkg::Lock::Timeout={LOCK_WAIT}", *rel],
            timeout=LOCK_WAIT + 300, cwd=ROOT)
    try:
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        for p in PACKAGES:
            assert status(p) == "install ok installed", (p, status(p))
        yield before
    finally:
        purge_all()
        for p in pathlib.Path(MAN_CACHE).glob("cat*/outbox-relay*"):
            p.unlink()


def test_lintian_clean(debs):
    """No error, warning, info or pedantic tag, on the source package or the binaries; overrides in deploy/debian/*.lintian-overrides
    each carry their reason."""
    exe = shutil.which("lintian")
    assert exe, "lintian not installed (scripts/packages.txt lists it)"
    dsc = sorted((ROOT / "build" / "deb").glob("outbox-relay_*.dsc"))
    assert len(dsc) == 1, "make deb built no source package"
    r = run([exe, "--info", "--pedantic", "--fail-on", "error,warning,info,pedantic", *dsc, *debs],
            timeout=600)
    tags = [ln for ln in r.stdout.splitlines() if re.match(r"[EWIPX]: ", ln)]
    assert r.returncode == 0 and not tags, r.stdout + r.stderr
    for f in (ROOT / "deploy" / "debian").glob("*.lintian-overrides"):
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() and not line.startswith("#"):
                assert i > 0 and lines[i - 1].startswith("#"), f"{f.name}: {line} has no reason"


def test_one_version_everywhere(installed, debs):
    """The Makefile's VERSION is the packages' version, the installed relay's, outbox.pc's,
    the man pages' and the packaged changelog's."""
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
    for h in ("outbox.h", "outbox_pg.h", "outbox_odbc.h"):
        assert (pathlib.Path("/usr/include") / h).read_bytes() == (ROOT / "lib" / h).read_bytes()
    r = run(["pkg-config", "--variable=libdir", "outbox"])
    assert r.stdout.strip() == str(libdir), r.stdout + r.stderr
    owners = run(["dpkg", "-S", str(libdir / "liboutbox.so.1"), str(libdir / "liboutbox.a"),
                  str(RELAY)]).stdout
    for pkg in PACKAGES:     # Multi-Arch: same packages are named with their architecture
        assert re.search(rf"^{pkg}(:\S+)?: ", owners, re.M), (pkg, owners)


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
    return shlex.split(m[1])


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


def test_shipped_config_keeps_the_service_down_until_configured(installed, services, pgdb,
                                                               tmp_path):
    """Installed, relay.ini has no setting: `check` refuses it and the unit's ExecCondition
    fails (systemd skips the service, without failing it); configured, both pass."""
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


def test_remove_then_purge_leave_nothing_behind(installed):
    """Last: `dpkg -r` keeps only the conffile (and the enablement state, masked); `dpkg
    --purge` removes that too. What stays is the system user: files it owned elsewhere must
    not pass to a later user of its uid."""
    before = installed
    r = dpkg("-r", *PACKAGES)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in PACKAGES:
        assert status(p) != "install ok installed", (p, status(p))
    assert status("outbox-relay") == "deinstall ok config-files"
    assert not RELAY.exists() and not UNIT.exists()
    assert CONF.is_file(), "dpkg -r removed the conffile"
    left = traces() - before
    assert all(p.startswith(("/etc/outbox-relay", "/etc/systemd/", "/var/lib/systemd/",
                             "/var/lib/dpkg/info/")) for p in left), sorted(left)

    r = dpkg("--purge", *PACKAGES)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in PACKAGES:
        assert not known(p), (p, status(p))
    assert traces() == before, sorted(traces() ^ before)
    pwd.getpwnam(USER)     # the user stays, as policy allows
