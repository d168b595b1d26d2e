"""`make install` (headers, liboutbox.a, liboutbox.so, outbox.pc, outbox-relay, the man
pages outbox-relay(1) and outbox-relay.ini(5)) into a staging directory, and README.md's C
example built against the staged files with pkg-config and run against a fresh database: keeps
the README's example true. Also: the default `make` target builds what ships and nothing that
needs a test-only package (cmocka), `make test`/`make bench` build every test program, and the
man pages lint clean and document every command and every configuration key."""
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from conftest import run_prog
from relay_util import psql_rows, write_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
PREFIX = "/usr/local"


def make_vars(build):
    """BUILD (and the SANITIZER that build dir belongs to) for make, so that install never
    rebuilds the tested build with other flags."""
    out = []
    if os.environ.get("OUTBOX_BUILD"):
        out.append(f"BUILD={os.environ['OUTBOX_BUILD']}")
    m = re.fullmatch(r"build-(address|undefined|address\+undefined)", build.name)
    if m:
        out.append(f"SANITIZER={m.group(1)}")
    return out


def san_flags(build):
    m = re.fullmatch(r"build-(address|undefined|address\+undefined)", build.name)
    if not m:
        return []
    return [f"-fsanitize={m.group(1).replace('+', ',')}", "-fno-omit-frame-pointer"]


@pytest.fixture(scope="module")
def staged(build, tmp_path_factory):
    """DESTDIR with a fresh `make install PREFIX=/usr/local`; returns (destdir, prefix dir)."""
    dest = tmp_path_factory.mktemp("destdir")
    r = subprocess.run(["make", "-C", str(ROOT), *make_vars(build), f"PREFIX={PREFIX}",
                        f"DESTDIR={dest}", "install"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return dest, dest / PREFIX.lstrip("/")


def test_installed_files(staged, build):
    dest, pre = staged
    for h in ("outbox.h", "outbox_pg.h", "outbox_odbc.h"):
        p = pre / "include" / h
        assert p.is_file(), p
        assert p.read_bytes() == (ROOT / "lib" / h).read_bytes(), f"{h} differs from lib/{h}"
        assert p.stat().st_mode & 0o777 == 0o644
    # internal headers stay internal
    assert not (pre / "include" / "outbox_schema.h").exists()
    assert not (pre / "include" / "outbox_internal.h").exists()

    lib = pre / "lib"
    assert (lib / "liboutbox.a").is_file()
    ar = subprocess.run(["ar", "t", str(lib / "liboutbox.a")], capture_output=True, text=True)
    assert ar.returncode == 0 and ar.stdout.strip(), ar.stderr
    so = lib / "liboutbox.so"
    so1 = lib / "liboutbox.so.1"
    assert so.is_symlink() and os.readlink(so) == "liboutbox.so.1", "liboutbox.so → .so.1"
    assert so1.exists(), so1
    real = so.resolve()
    assert real.parent == lib.resolve() and real.is_file() and not real.is_symlink(), real
    d = subprocess.run(["readelf", "-d", str(real)], capture_output=True, text=True)
    assert d.returncode == 0, d.stderr
    assert re.search(r"\(SONAME\)\s+Library soname: \[liboutbox\.so\.1\]", d.stdout), d.stdout
    assert re.search(r"\(NEEDED\)\s+Shared library: \[libpq\.so\.5\]", d.stdout), d.stdout
    syms = subprocess.run(["nm", "-D", "--defined-only", str(real)], capture_output=True, text=True)
    for fn in ("outbox_queue_new", "outbox_queue_free", "outbox_pg_send", "outbox_pg_send_batch",
               "outbox_odbc_send", "outbox_odbc_send_batch", "outbox_strerror"):
        assert re.search(rf"\bT {fn}$", syms.stdout, re.M), f"{fn} not exported"

    pc = lib / "pkgconfig" / "outbox.pc"
    text = pc.read_text()
    assert re.search(rf"^prefix={re.escape(PREFIX)}$", text, re.M), text
    version = re.search(r"^VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert re.search(rf"^Version: {re.escape(version)}$", text, re.M), text
    header = (pre / "include" / "outbox.h").read_text()
    assert f'#define OUTBOX_VERSION_STRING "{version}"' in header, "outbox.h's version is not VERSION"

    for sec, page in (("man1", "outbox-relay.1"), ("man5", "outbox-relay.ini.5")):
        p = pre / "share" / "man" / sec / page
        assert p.is_file(), f"{p} not installed"
        assert p.stat().st_mode & 0o777 == 0o644, oct(p.stat().st_mode)

    relay = pre / "bin" / "outbox-relay"
    assert relay.is_file() and os.access(relay, os.X_OK)
    r = run_prog([relay, "--version"], timeout=30)
    assert r.returncode == 0 and r.stdout == f"outbox-relay {version}\n", r.stdout + r.stderr
    # nothing outside PREFIX
    assert sorted(p.name for p in dest.iterdir()) == ["usr"]


def relocated_pc(staged, tmp_path):
    """A copy of the installed outbox.pc whose prefix points into DESTDIR. (Neither
    PKG_CONFIG_SYSROOT_DIR nor --define-variable=prefix=... works here: both rewrite libpq's
    paths too, and libpq lives outside DESTDIR.)"""
    dest, pre = staged
    pcdir = tmp_path / "pkgconfig"
    pcdir.mkdir()
    text = (pre / "lib" / "pkgconfig" / "outbox.pc").read_text()
    text = re.sub(r"^prefix=.*$", f"prefix={pre}", text, flags=re.M)
    (pcdir / "outbox.pc").write_text(text)
    return pcdir


def pkg_config(pcdir, *args):
    env = dict(os.environ, PKG_CONFIG_PATH=str(pcdir))
    r = subprocess.run(["pkg-config", *args], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def readme_app():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"```c\n(/\* app\.c.*?)```", text, re.S)
    assert m, "README.md has no ```c block starting with /* app.c"
    src = m.group(1)
    body = re.search(r'const char \*body = "((?:[^"\\]|\\.)*)";', src)
    assert body, "the example's payload literal"
    payload = re.sub(r"\\(.)", r"\1", body.group(1)).encode()
    assert payload == b'{"order":42,"total":"19.90"}'
    assert "build with" in text.lower() or "cc app.c" in text
    return src, payload


def test_pkg_config_flags(staged, tmp_path):
    dest, pre = staged
    pcdir = relocated_pc(staged, tmp_path)
    flags = pkg_config(pcdir, "--cflags", "--libs", "outbox")
    assert f"-I{pre}/include" in flags and f"-L{pre}/lib" in flags and "-loutbox" in flags, flags
    # outbox_pg.h includes <libpq-fe.h>: the cflags must find it
    assert any(f.startswith("-I") and (pathlib.Path(f[2:]) / "libpq-fe.h").exists()
               for f in flags), flags


@pytest.fixture
def app_db(services, pgdb, staged, tmp_path):
    """A fresh database with the schema created by the *installed* outbox-relay init."""
    dest, pre = staged
    cfg = write_config(tmp_path / "app.ini", services, pgdb)
    r = run_prog([pre / "bin" / "outbox-relay", "init", "-c", cfg], timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return pgdb


def compile_app(argv, tmp_path):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, f"{' '.join(map(str, argv))}\n{r.stderr}"


def run_app_and_check(exe, db, payload, env=None):
    r = run_prog([exe, db.dsn], timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == "order and message committed\n", r.stdout
    rows = psql_rows(db, "select exchange, routing_key, partition_key, message_type, "
                         "content_type, correlation_id, headers, payload, message_id::text, "
                         "sent_at, attempts from outbox.messages")
    assert len(rows) == 1, rows
    ex, rk, pk, mt, ct, corr, headers, body, mid, sent, attempts = rows[0]
    assert (ex, rk, pk, mt, ct, corr) == ("", "orders", "order-42", "order.created",
                                          "application/json", None)
    assert headers == {"tenant": "acme"}, headers
    assert bytes(body) == payload
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", mid), mid
    assert sent is None and attempts == 0


def test_readme_example_exact_command(staged, app_db, tmp_path, build):
    """Exactly the README's build line: cc app.c $(pkg-config --cflags --libs outbox)."""
    dest, pre = staged
    src, payload = readme_app()
    (tmp_path / "app.c").write_text(src)
    pcdir = relocated_pc(staged, tmp_path)
    flags = pkg_config(pcdir, "--cflags", "--libs", "outbox")
    compile_app(["cc", "app.c", *flags, *san_flags(build), "-o", "app"], tmp_path)
    env = dict(os.environ, LD_LIBRARY_PATH=str(pre / "lib"))
    run_app_and_check(tmp_path / "app", app_db, payload, env=env)


def test_readme_example_shared(staged, app_db, tmp_path, build):
    """The README example linked against the staged liboutbox.so with strict warnings, run with
    LD_LIBRARY_PATH pointing at the staged lib dir."""
    dest, pre = staged
    src, payload = readme_app()
    (tmp_path / "app.c").write_text(src)
    pcdir = relocated_pc(staged, tmp_path)
    flags = pkg_config(pcdir, "--cflags", "--libs", "outbox", "libpq")
    compile_app(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "app.c", *flags,
                 *san_flags(build), "-o", "app"], tmp_path)
    env = dict(os.environ, LD_LIBRARY_PATH=str(pre / "lib"))
    ldd = subprocess.run(["ldd", str(tmp_path / "app")], capture_output=True, text=True, env=env)
    m = re.search(r"liboutbox\.so\.1 => (\S+)", ldd.stdout)
    assert m, ldd.stdout
    assert pathlib.Path(m.group(1)).resolve().parent == (pre / "lib").resolve(), ldd.stdout
    run_app_and_check(tmp_path / "app", app_db, payload, env=env)


def test_readme_example_static(staged, app_db, tmp_path, build):
    """The README example linked against the staged liboutbox.a (libpq/libodbc shared)."""
    dest, pre = staged
    src, payload = readme_app()
    (tmp_path / "app.c").write_text(src)
    pcdir = relocated_pc(staged, tmp_path)
    cflags = pkg_config(pcdir, "--cflags", "outbox")
    deps = pkg_config(pcdir, "--libs", "libpq", "odbc")
    compile_app(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "app.c", *cflags,
                 str(pre / "lib" / "liboutbox.a"), *deps, *san_flags(build), "-o", "app_static"],
                tmp_path)
    ldd = subprocess.run(["ldd", str(tmp_path / "app_static")], capture_output=True, text=True)
    assert "liboutbox" not in ldd.stdout, ldd.stdout
    run_app_and_check(tmp_path / "app_static", app_db, payload)


def test_install_honours_prefix(build, tmp_path):
    """Another PREFIX puts the files there and outbox.pc says so."""
    dest = tmp_path / "stage"
    prefix = "/opt/outbox"
    r = subprocess.run(["make", "-C", str(ROOT), *make_vars(build), f"PREFIX={prefix}",
                        f"DESTDIR={dest}", "install"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    pre = dest / prefix.lstrip("/")
    assert (pre / "bin" / "outbox-relay").is_file()
    assert (pre / "include" / "outbox.h").is_file()
    assert (pre / "lib" / "liboutbox.a").is_file()
    assert (pre / "share" / "man" / "man1" / "outbox-relay.1").is_file()
    assert (pre / "share" / "man" / "man5" / "outbox-relay.ini.5").is_file()
    text = (pre / "lib" / "pkgconfig" / "outbox.pc").read_text()
    assert re.search(rf"^prefix={re.escape(prefix)}$", text, re.M), \
        f"outbox.pc installed under {prefix} says:\n{text}"
    shutil.rmtree(dest)


# ---------------------------------------------------------------------------- what `make` builds
TEST_PROGRAMS = sorted(p.stem for p in (ROOT / "tests" / "c").glob("*.c"))
BENCH_PROGRAMS = sorted(p.stem for p in (ROOT / "tests" / "bench").glob("*.c"))
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.c"))
MAN_PAGES = {"outbox-relay.1": "man1", "outbox-relay.ini.5": "man5"}


def make_env():
    """The environment for a make of our own: nothing inherited from an enclosing `make test`
    (its MAKEFLAGS carry SANITIZER=... and a jobserver) or from the caller's CFLAGS."""
    env = dict(os.environ)
    for k in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "BUILD", "SANITIZER",
              "CFLAGS", "LDFLAGS", "CPATH", "C_INCLUDE_PATH", "LIBRARY_PATH"):
        env.pop(k, None)
    return env


def make(*args, timeout=900):
    return subprocess.run(["make", "-C", str(ROOT), *args], capture_output=True, text=True,
                          timeout=timeout, env=make_env())


def dry_run(build_dir, *targets):
    """The commands `make -n TARGETS` would run for an empty build directory."""
    r = make("-n", f"BUILD={build_dir}", *targets, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


@pytest.mark.build_independent
def test_default_target_needs_no_test_package(tmp_path):
    """`make` and `make all` build the library, the relay, outbox.pc, the man pages and the
    examples, and no test program: those need libcmocka-dev, a test-only package."""
    b = tmp_path / "b"
    for targets in ((), ("all",)):
        out = dry_run(b, *targets)
        for bad in ("tests/c/", "tests/bench/", "cmocka", f"{b}/tests/"):
            lines = [ln for ln in out.splitlines() if bad in ln]
            assert not lines, (f"`make {' '.join(targets)}` builds test programs ({bad!r}):\n"
                               + "\n".join(lines)[:3000])
        assert re.search(rf"^ar rcs {re.escape(str(b))}/liboutbox\.a ", out, re.M), out[-3000:]
        for o in ("liboutbox.so.1.0.0", "outbox-relay", *(f"examples/{e}" for e in EXAMPLES)):
            assert re.search(rf" -o {re.escape(str(b))}/{re.escape(o)}(\s|$)", out, re.M), \
                f"`make {' '.join(targets)}` does not build {o}"
        for o in ("outbox.pc", *(f"man/{m}" for m in MAN_PAGES)):
            assert f"> {b}/{o}" in out, f"`make {' '.join(targets)}` does not build {o}"


@pytest.mark.build_independent
def test_test_and_bench_targets_build_every_test_program(tmp_path):
    """`make test` builds every program the tests run (tests/c/*, tests/bench/*: the AMQP
    tests use amqp_probe); `make bench` builds the bench tools. (tests/odbcrec/recdrv.c is
    compiled by tests/test_tsql_capture.py itself.) Dry runs: nothing is executed."""
    b = tmp_path / "b"
    want = {"test": TEST_PROGRAMS + BENCH_PROGRAMS, "bench": BENCH_PROGRAMS}
    assert "cfg_test" in want["test"] and "amqp_probe" in want["bench"], want
    for target, progs in want.items():
        out = dry_run(b, target)
        for prog in progs:
            assert re.search(rf" -o {re.escape(str(b))}/tests/{prog}\s", out), \
                f"`make {target}` does not build tests/{prog}"
    assert re.search(r"-m pytest", dry_run(b, "test"))


def poisoned_cmocka(tmp_path):
    """A directory that, put first on the include and library paths, makes cmocka unusable
    the way a machine without libcmocka-dev would: <cmocka.h> fails to compile and -lcmocka
    fails to link."""
    d = tmp_path / "no-cmocka"
    d.mkdir()
    (d / "cmocka.h").write_text("#error cmocka.h: libcmocka-dev is not installed on this machine\n")
    (d / "libcmocka.so").write_text("INPUT(-lcmocka-is-not-installed)\n")
    (d / "libcmocka.a").write_text("not an archive\n")
    # the poison works: a cmocka program cannot be built with it
    src = tmp_path / "uses_cmocka.c"
    src.write_text("#include <stdarg.h>\n#include <stddef.h>\n#include <stdint.h>\n"
                   "#include <setjmp.h>\n#include <cmocka.h>\nint main(void) { return 0; }\n")
    cc = os.environ.get("CC") or "cc"
    r = subprocess.run([cc, f"-I{d}", str(src), "-o", str(tmp_path / "a.out")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "libcmocka-dev is not installed" in r.stderr, r.stderr
    (tmp_path / "nolink.c").write_text("int main(void) { return 0; }\n")
    r = subprocess.run([cc, str(tmp_path / "nolink.c"), f"-L{d}", "-lcmocka", "-o",
                        str(tmp_path / "a.out")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, "linking -lcmocka should fail with the poisoned library path"
    return d


@pytest.mark.build_independent
def test_default_build_without_cmocka(tmp_path):
    """A real `make` into a fresh build directory with cmocka made unusable succeeds and
    produces everything that ships; building a test program the same way fails on cmocka."""
    nocm = poisoned_cmocka(tmp_path)
    b = tmp_path / "b"
    flags = [f"BUILD={b}", f"CFLAGS=-I{nocm}", f"LDFLAGS=-L{nocm}"]
    r = make("-j2", *flags)
    assert r.returncode == 0, ("`make` fails without cmocka:\n" + r.stdout[-3000:]
                               + r.stderr[-3000:])
    for f in ("liboutbox.a", "liboutbox.so.1.0.0", "outbox-relay", "outbox.pc",
              *(f"examples/{e}" for e in EXAMPLES), *(f"man/{m}" for m in MAN_PAGES)):
        assert (b / f).is_file(), f"`make` did not build {f}"
    assert not (b / "tests").exists(), sorted(p.name for p in (b / "tests").iterdir())
    rv = run_prog([b / "outbox-relay", "--version"], timeout=30, valgrind=False)
    assert rv.returncode == 0 and rv.stdout.startswith("outbox-relay "), rv.stdout + rv.stderr
    # the same flags do stop a test program: the poison is real, not bypassed
    r = make(*flags, f"{b}/tests/cfg_test", timeout=300)
    assert r.returncode != 0 and "libcmocka-dev is not installed" in r.stdout + r.stderr, \
        r.stdout[-2000:] + r.stderr[-2000:]


# ---------------------------------------------------------------------------- man pages
def man_env():
    return dict(os.environ, LC_ALL="C.UTF-8", MANWIDTH="80", MANPAGER="cat", PAGER="cat")


def lint_page(path):
    """Every complaint of man --warnings, groff -ww and mandoc -T lint about one page."""
    problems = []
    r = subprocess.run(["man", "--warnings", "-l", str(path)], capture_output=True, text=True,
                       timeout=60, env=man_env())
    if r.returncode != 0 or r.stderr.strip():
        problems.append(f"man --warnings -l: exit {r.returncode}: {r.stderr.strip()}")
    if "NAME" not in r.stdout:
        problems.append(f"man -l rendered no NAME section:\n{r.stdout[:500]}")
    r = subprocess.run(["groff", "-man", "-ww", "-z", str(path)], capture_output=True,
                       text=True, timeout=60, env=man_env())
    if r.returncode != 0 or r.stderr.strip():
        problems.append(f"groff -man -ww: exit {r.returncode}: {r.stderr.strip()}")
    mandoc = shutil.which("mandoc")
    assert mandoc, "mandoc not installed (scripts/packages.txt lists it)"
    r = subprocess.run([mandoc, "-T", "lint", "-W", "warning", str(path)], capture_output=True,
                       text=True, timeout=60, env=man_env())
    if r.returncode != 0 or (r.stdout + r.stderr).strip():
        problems.append(f"mandoc -T lint: exit {r.returncode}: {(r.stdout + r.stderr).strip()}")
    return problems


@pytest.mark.parametrize("page", sorted(MAN_PAGES))
def test_installed_man_page_renders_without_warnings(staged, page):
    dest, pre = staged
    path = pre / "share" / "man" / MAN_PAGES[page] / page
    assert path.is_file(), f"{path} not installed"
    problems = lint_page(path)
    assert not problems, f"{path}:\n" + "\n".join(problems)
    text = path.read_text()
    version = re.search(r"^VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "@VERSION@" not in text
    assert re.search(rf'^\.TH \S+ \S+ \S+ "outbox-relay {re.escape(version)}"', text, re.M), \
        text.splitlines()[:6]
    # `man 5 outbox-relay.ini` / `man outbox-relay` find the installed pages
    name, sec = page.rsplit(".", 1)
    r = subprocess.run(["man", "-M", str(pre / "share" / "man"), "-w", sec, name],
                       capture_output=True, text=True, timeout=60, env=man_env())
    assert r.returncode == 0 and pathlib.Path(r.stdout.strip()) == path, r.stdout + r.stderr


def roff_plain(s):
    """Roff source text → plain text (font changes and the escapes used in man/ removed)."""
    s = re.sub(r"\\f[BIRP]", "", s)
    return (s.replace("\\-", "-").replace("\\&", "").replace("\\(dq", '"')
            .replace("\\(aq", "'").replace("\\(em", "-"))


def man_sections(text):
    """{.SH title: body} of a man(7) source."""
    parts = re.split(r'^\.SH +"?([^"\n]+)"?\n', text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def cfg_c_keys():
    """{section kind: {key: (flags, default or None)}} from the key tables: what the loader
    accepts. config/cfg.c has the relay, sink and outbox tables; each sink or source adds
    the keys only it has (a `static const cfg_key ..._keys[]` table under sinks/ or
    sources/, registered with its cfg_backend)."""
    def entries(table, defines):
        keys = {}
        for key, flags, default in re.findall(
                r'\{\s*"(\w+)",\s*CFG_KT_\w+,\s*([^,]+?),\s*(NULL|"[^"]*"|\w+)\s*,', table):
            if default == "NULL":
                default = None
            elif default.startswith('"'):
                default = default[1:-1]
            else:
                default = defines[default]
            keys[key] = (flags, default)
        assert len(keys) == table.count('{ "'), f"unparsed entries in {table[:80]!r}"
        return keys

    src = (ROOT / "config" / "cfg.c").read_text()
    defines = dict(re.findall(r'^#define\s+(\w+)\s+"([^"]*)"', src, re.M))
    out = {}
    for kind in ("relay", "sink", "outbox"):
        m = re.search(rf"static const cfg_key {kind}_keys\[\] = \{{(.*?)\n\}};", src, re.S)
        assert m, f"config/cfg.c: no {kind}_keys table"
        out[kind] = entries(m.group(1), defines)
    for kind, folder in (("sink", "sinks"), ("outbox", "sources")):
        first, url = None, None
        for path in sorted((ROOT / folder).rglob("*.c")):
            text = path.read_text()
            for m in re.finditer(r"static const cfg_key \w+\[\] = \{(.*?)\n\};", text, re.S):
                for key, v in entries(m.group(1), defines).items():
                    assert key not in out[kind], f"{path}: [{kind}] {key} defined twice"
                    out[kind][key] = v
            url = url or (re.findall(r'\.url_default = "([^"]*)"', text) or [None])[0]
        # defaults a backend supplies: the first registered is the default of type / source
        # (the first entry of sources/source.c, of sinks/sink.c), a sink's url its url_default
        reg = (ROOT / folder / ("sink.c" if folder == "sinks" else "source.c")).read_text()
        if folder == "sources":
            first = re.search(r'\.name = "(\w+)"', reg).group(1)
            out[kind]["source"] = (out[kind]["source"][0], first)
        else:
            be = re.search(r"backends\[\] = \{ &(\w+)", reg).group(1)
            text = "".join(p.read_text() for p in (ROOT / folder).rglob("*.c"))
            m = re.search(rf"const cfg_backend {be} = \{{(.*?)\n\}};", text, re.S)
            first = re.search(r'\.name = "(\w+)"', m.group(1)).group(1)
            out[kind]["type"] = (out[kind]["type"][0], first)
            out[kind]["url"] = (out[kind]["url"][0], url)
    return out


def readme_defaults():
    """{section kind: {key: default cell}} from config/README.md's key table."""
    out = {}
    for line in (ROOT / "config" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] in ("relay", "sink", "outbox"):
            out.setdefault(cells[0], {})[cells[1]] = cells[2]
    return out


def man_ini_keys():
    """{section kind: {key: "Default: ..." / "Required (no default)" line, plain text}} from
    man/outbox-relay.ini.5, whose keys are `.TP` / `.B key` / that line."""
    secs = man_sections((ROOT / "man" / "outbox-relay.ini.5").read_text())
    out = {}
    for kind, title in (("relay", "SECTION [relay]"), ("sink", "SECTION [sink.NAME]"),
                        ("outbox", "SECTION [outbox.NAME]")):
        assert title in secs, f"outbox-relay.ini(5) has no section {title!r}: {list(secs)}"
        body = secs[title]
        tags = re.findall(r"^\.TP\n(.*)$", body, re.M)
        entries = {}
        for tag in tags:
            m = re.fullmatch(r"\.B (\w+)", tag)
            assert m, f"{title}: a .TP tag that is not `.B key`: {tag!r}"
        for key, line in re.findall(r"^\.TP\n\.B (\w+)\n(.*)$", body, re.M):
            assert key not in entries, f"{title}: {key} documented twice"
            entries[key] = roff_plain(line).strip()
        out[kind] = entries
    return out


@pytest.mark.build_independent
def test_man_ini_documents_every_key_with_its_default():
    """outbox-relay.ini(5) has exactly the keys config/cfg.c accepts, section by section, each
    with the default the loader applies and config/README.md states."""
    code, readme, man = cfg_c_keys(), readme_defaults(), man_ini_keys()
    assert sum(len(v) for v in code.values()) >= 35, code
    for kind in code:
        assert set(man[kind]) == set(code[kind]), \
            (f"[{kind}] keys: missing from the man page {sorted(set(code[kind]) - set(man[kind]))}, "
             f"not accepted by cfg.c {sorted(set(man[kind]) - set(code[kind]))}")
        assert set(readme[kind]) == set(code[kind]), (kind, set(readme[kind]) ^ set(code[kind]))
        for key, (flags, default) in code[kind].items():
            line, doc = man[kind][key], readme[kind][key]
            where = f"outbox-relay.ini(5) [{kind}] {key}"
            if "KF_REQUIRED" in flags:
                assert line == "Required (no default)", f"{where}: {line!r}"
                assert doc == "(required)", f"config/README.md [{kind}] {key}: {doc!r}"
                continue
            assert line.startswith("Default: "), f"{where}: first line {line!r}"
            said = line[len("Default: "):]
            if default is None:          # computed at load time (relay name)
                assert doc == f"({said})", f"{where}: {said!r}, config/README.md {doc!r}"
            elif default == "":
                assert said == "empty" and doc == "(empty)", f"{where}: {said!r} / {doc!r}"
            else:
                assert said == default, f"{where}: {said!r}, config/cfg.c says {default!r}"
                assert doc == f"`{default}`", f"config/README.md [{kind}] {key}: {doc!r}"


def test_man_relay_documents_commands_options_and_exit_status(relay_bin):
    text = (ROOT / "man" / "outbox-relay.1").read_text()
    secs = man_sections(text)
    for title in ("NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "OPTIONS", "EXIT STATUS",
                  "SIGNALS", "FILES", "ENVIRONMENT", "EXAMPLES", "SEE ALSO"):
        assert title in secs, f"outbox-relay(1) has no {title} section: {list(secs)}"
    r = run_prog([relay_bin, "--help"], timeout=30)
    assert r.returncode == 0, r.stderr
    commands = re.findall(r"^  ([a-z]+)\s", r.stdout, re.M)
    assert {"run", "check", "schema", "init", "stats", "dead"} <= set(commands), r.stdout
    tags = [roff_plain(t) for t in re.findall(r"^\.TP\n(.*)$", secs["COMMANDS"], re.M)]
    for c in commands:
        assert any(re.match(rf"\.BR? {c}\b", t) for t in tags), f"COMMANDS lacks {c}: {tags}"
    for action in ("list", "retry", "purge"):
        assert any(re.match(rf'\.BR? "?dead {action}\b', t) for t in tags), (action, tags)
    options = roff_plain(secs["OPTIONS"])
    for opt in ("-c", "--config", "-o", "--outbox", "--dialect", "--table", "-h", "--help",
                "-V", "--version"):
        assert re.search(rf"(^|[\s\"]){re.escape(opt)}([\s=\"]|$)", options, re.M), \
            f"OPTIONS lacks {opt}"
    codes = re.findall(r"^\.TP\n\.B (\d+)$", secs["EXIT STATUS"], re.M)
    assert codes == ["0", "1", "2"], codes
    signals = roff_plain(secs["SIGNALS"])
    for sig in ("SIGTERM", "SIGINT", "SIGHUP"):
        assert sig in signals, f"SIGNALS lacks {sig}"
    assert "outbox-relay.ini (5)" in roff_plain(secs["SEE ALSO"])


def test_help_points_to_the_installed_man_pages(relay_bin):
    """--help names documentation that `make install` installs, not a file of the source
    tree."""
    r = run_prog([relay_bin, "--help"], timeout=30)
    assert r.returncode == 0, r.stderr
    assert "config/README.md" not in r.stdout, r.stdout
    assert re.search(r"\bman outbox-relay\b", r.stdout), r.stdout
    assert re.search(r"\bman 5 outbox-relay\.ini\b", r.stdout), r.stdout
    assert (ROOT / "man" / "outbox-relay.ini.5").is_file()
    assert (ROOT / "man" / "outbox-relay.1").is_file()


def man_example_configs():
    """The ini files shown in the EXAMPLES sections of both pages."""
    out = []
    for page in MAN_PAGES:
        secs = man_sections((ROOT / "man" / page).read_text())
        for block in re.findall(r"^\.EX\n(.*?)^\.EE$", secs.get("EXAMPLES", ""), re.M | re.S):
            if block.lstrip().startswith("["):
                out.append((page, roff_plain(block)))
    return out


def test_man_example_configurations_load(build, tmp_path):
    """Every configuration shown in the man pages loads (cfg_test --load), with the password
    files it names replaced by real files and the variables it uses set."""
    cfg_test = build / "tests" / "cfg_test"
    if not cfg_test.exists():
        pytest.fail(f"{cfg_test} not built (make test)")
    examples = man_example_configs()
    assert {p for p, _ in examples} == set(MAN_PAGES), examples
    env = dict(os.environ)
    for i, (page, text) in enumerate(examples):
        for var in re.findall(r"\$\{(\w+)\}", text):
            env[var] = "secret"
        secret = tmp_path / f"pw{i}"
        secret.write_text("secret\n")
        text = re.sub(r"^(password_file = )\S+$", rf"\g<1>{secret}", text, flags=re.M)
        ini = tmp_path / f"example{i}.ini"
        ini.write_text(text)
        r = run_prog([cfg_test, "--load", ini], timeout=60, env=env)
        assert r.returncode == 0, f"{page} example:\n{text}\n{r.stdout}{r.stderr}"


def test_shared_library_exports_exactly_the_installed_api(build):
    """liboutbox.so exports the functions the installed headers declare and nothing else
    (lib/liboutbox.map), and deploy/debian/liboutbox1.symbols lists exactly those: a helper
    leaking into the ABI, or an API function missing from the map, fails here."""
    declared = set()
    for h in ("outbox.h", "outbox_pg.h", "outbox_odbc.h"):
        text = re.sub(r"/\*.*?\*/", "", (ROOT / "lib" / h).read_text(), flags=re.S)
        declared |= set(re.findall(r"\b(outbox_\w+)\s*\(", text))
    nm = subprocess.run(["nm", "-D", "--defined-only", str(build / "liboutbox.so.1")],
                        capture_output=True, text=True, check=True)
    exported = {ln.split()[-1] for ln in nm.stdout.splitlines() if " T " in ln}
    assert exported == declared, (sorted(exported - declared), sorted(declared - exported))
    symbols = set(re.findall(r"^ (\w+)@Base", (ROOT / "deploy/debian/liboutbox1.symbols")
                             .read_text(), flags=re.M))
    assert symbols == declared, (sorted(symbols - declared), sorted(declared - symbols))
