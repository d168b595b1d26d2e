"""`make install` (SPEC §3: headers, liboutbox.a, liboutbox.so, outbox.pc, outbox-relay) into a
staging directory, and README.md's C example built against the staged files with pkg-config
and run against a fresh database: keeps the README's example true."""
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
    text = (pre / "lib" / "pkgconfig" / "outbox.pc").read_text()
    assert re.search(rf"^prefix={re.escape(prefix)}$", text, re.M), \
        f"outbox.pc installed under {prefix} says:\n{text}"
    shutil.rmtree(dest)
