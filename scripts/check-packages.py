#!/usr/bin/env python3
"""scripts/check-packages.py — is scripts/packages.txt the whole truth?

Answers, on a machine where the tests have run (so everything they use is installed), the
question "would a fresh Debian 12 machine that installs scripts/packages.txt and nothing else
have everything the build and the tests use?":

1. What a fresh machine gets: apt's own resolver is asked, against an empty system that holds
   only Debian's Essential and Priority: required packages (a status file of those, the
   minimal base every Debian 12 machine and container has), what
   `apt-get install --no-install-recommends <packages.txt>` would install
   (`apt-get --simulate`, nothing is installed or changed). That set plus the base is the
   closure.
2. What the tests use: every executable named in tests/*.py, tests/bench/*.py and the
   scripts they run (scripts/*.sh, .ci/run), every third-party Python module they import,
   every shared library of the built programs (ldd), and every absolute path under /usr
   they name.
3. Each of those is traced to the Debian package that installed it here (dpkg -S); one that
   belongs to a package outside the closure, or to no package, is a failure naming it.

Exit 0: every item is covered; 1: something is not (each named); 2: the check itself could
not run (no build/, apt failed, ...). Options: --packages FILE (default scripts/packages.txt),
--build DIR (default build), -v (every item and its package).
"""
import argparse
import ast
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# directories the tests run programs from besides PATH
EXTRA_BIN = ["/usr/lib/postgresql/15/bin", "/usr/lib/rabbitmq/bin", "/usr/sbin", "/sbin"]
# programs started by name in ways the scan below cannot see (inside rabbitmqctl's own
# scripts, through ODBC's driver manager, by pytest's entry point)
ALWAYS = ["python3", "rabbitmq-server", "rabbitmqctl", "epmd", "pg_ctl", "initdb", "postgres",
          "psql", "pg_isready", "pgbouncer", "tsql", "odbcinst", "valgrind", "openssl",
          "sqlfluff", "yamllint", "shellcheck", "systemd-analyze", "promtool", "mandoc", "man",
          "cc", "make", "pkg-config", "ldd", "readelf", "nm", "ar", "runuser", "timeout"]
# files that the tests load through a configuration rather than by a path in their source
ALWAYS_FILES = ["/usr/lib/x86_64-linux-gnu/odbc/psqlodbcw.so",
                "/usr/lib/x86_64-linux-gnu/odbc/libtdsodbc.so",
                "/usr/share/postgresql/15/extension/pgcrypto.control"]


def die(msg):
    print(f"check-packages: {msg}", file=sys.stderr)
    sys.exit(2)


def run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, **kw)


def read_list(path):
    pkgs = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                pkgs.append(line.split()[0])
    return pkgs


def status_paragraphs():
    with open("/var/lib/dpkg/status", encoding="utf-8", errors="replace") as f:
        return [p for p in f.read().split("\n\n") if p.strip()]


def field(par, name):
    m = re.search(rf"^{name}: (.*)$", par, re.M)
    return m.group(1).strip() if m else ""


def closure(pkgs):
    """base (Essential or Priority: required, with what they depend on as installed here)
    + what apt would install on such a base."""
    installed, provides = {}, {}
    for par in status_paragraphs():
        if "install ok installed" not in field(par, "Status"):
            continue
        name = field(par, "Package")
        installed[name] = par
        for pv in field(par, "Provides").split(","):
            if pv.strip():
                provides.setdefault(pv.split()[0].split(":")[0], name)
    todo = [n for n, par in installed.items()
            if field(par, "Essential") == "yes" or field(par, "Priority") == "required"]
    base = set()
    while todo:
        n = todo.pop()
        if n in base:
            continue
        base.add(n)
        deps = field(installed[n], "Pre-Depends") + "," + field(installed[n], "Depends")
        for alts in deps.split(","):
            for alt in alts.split("|"):
                d = alt.strip().split(" ")[0].split(":")[0]
                d = d if d in installed else provides.get(d)
                if d:
                    todo.append(d)
                    break
    base_pars = [installed[n] for n in sorted(base)]
    with tempfile.TemporaryDirectory() as d:
        status = os.path.join(d, "status")
        with open(status, "w") as f:
            f.write("\n\n".join(base_pars) + "\n")
        p = run(["apt-get", "install", "--simulate", "--no-install-recommends", "-q",
                 "-o", f"Dir::State::status={status}", "-o", "APT::Get::Show-Versions=0",
                 *pkgs])
    if p.returncode != 0:
        die(f"apt-get --simulate failed (run apt-get update first?):\n{p.stdout}{p.stderr}")
    inst = set(re.findall(r"^Inst (\S+)", p.stdout, re.M))
    # architecture-qualified names (libfoo:amd64) as dpkg -S prints them
    return base, {x.split(":")[0] for x in inst}


def owner(path):
    """The Debian package that installed path (following symlinks), or None."""
    cands = [path]
    real = os.path.realpath(path)
    if real != path:
        cands.append(real)
    # /bin, /lib are symlinks to /usr/... on Debian 12 (merged /usr); dpkg knows either name
    for c in list(cands):
        for a, b in (("/usr/bin/", "/bin/"), ("/usr/lib/", "/lib/"), ("/usr/sbin/", "/sbin/")):
            if c.startswith(a):
                cands.append(b + c[len(a):])
            elif c.startswith(b):
                cands.append(a + c[len(b):])
    for c in cands:
        p = run(["dpkg", "-S", c])
        if p.returncode == 0:
            for line in p.stdout.splitlines():
                pkgs, _, f = line.partition(": ")
                if f.strip() == c and not pkgs.startswith("diversion by"):
                    return [x.strip().split(":")[0] for x in pkgs.split(",")]
    return None


def sources(patterns):
    out = []
    for pat in patterns:
        out += sorted(glob.glob(os.path.join(ROOT, pat)))
    return out


# used when present, never required (the bench labels its report with the commit via git)
OPTIONAL = {"git"}


def find_exe(name):
    if name == "python3":   # the tests run Debian's (PYTHON=/usr/bin/python3), not a PATH one
        return "/usr/bin/python3"
    p = shutil.which(name)
    if p:
        return p
    for d in EXTRA_BIN:
        c = os.path.join(d, name)
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def used_executables():
    """Executables named in the tests' Python (as the first word of an argv list or through
    shutil.which) and in the shell scripts (any word that is an installed program)."""
    names = set(ALWAYS)
    py_rx = [re.compile(r'\[\s*"([A-Za-z][\w.+-]*)"\s*,'), re.compile(r'which\("([^"]+)"\)'),
             re.compile(r'"(?:/usr)?/(?:s?bin|lib/postgresql/15/bin|lib/rabbitmq/bin)/([\w.+-]+)"')]
    for f in sources(["tests/*.py", "tests/bench/*.py", "scripts/*.py"]):
        text = open(f, encoding="utf-8").read()
        for rx in py_rx:
            names.update(rx.findall(text))
    for f in sources(["scripts/*.sh", ".ci/run", "tests/**/*.sh"]):
        text = open(f, encoding="utf-8").read()
        text = re.sub(r"(?m)^\s*#.*", "", text)
        text = re.sub(r'"(?:[^"$\\]|\\.|\$(?!\())*"', '""', text)   # messages, not commands
        # words in command position: at a line's start, after | ; & ( $( ! and the keywords
        # that start a command list, or after a wrapper that runs its arguments
        names.update(re.findall(
            r"(?:^|[|;&(!]|\$\(|\b(?:then|do|else|exec|timeout(?: -k \S+)? \S+|runuser .*? --))"
            r"\s*([a-z][\w.+-]*)\b(?!=)", text, re.M))
    found = {}
    for n in sorted(names - OPTIONAL):
        p = find_exe(n)
        if p:
            found[n] = p
    missing_always = [n for n in ALWAYS if n not in found]
    return found, missing_always


def used_modules():
    """Third-party Python modules imported by the tests (not the standard library, not the
    tests' own modules)."""
    local = {os.path.splitext(os.path.basename(f))[0]
             for f in sources(["tests/*.py", "tests/bench/*.py", "scripts/*.py"])}
    mods = set()
    for f in sources(["tests/*.py", "tests/bench/*.py", "scripts/*.py"]):
        tree = ast.parse(open(f, encoding="utf-8").read(), f)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods.add(node.module.split(".")[0])
    mods.add("pytest")
    return sorted(m for m in mods if m not in sys.stdlib_module_names and m not in local)


def module_file(mod):
    p = run(["/usr/bin/python3", "-c",
             f"import {mod}, sys; sys.stdout.write({mod}.__file__ or '')"])
    return p.stdout.strip() if p.returncode == 0 and p.stdout.strip() else None


def shared_libs(build):
    libs = set()
    progs = [os.path.join(build, "outbox-relay"), os.path.join(build, "examples", "producer")]
    progs += glob.glob(os.path.join(build, "tests", "*"))
    progs += glob.glob(os.path.join(build, "liboutbox.so.*"))
    progs += ALWAYS_FILES[:2]
    for prog in progs:
        if not (os.path.isfile(prog) and os.access(prog, os.R_OK)):
            continue
        p = run(["ldd", prog])
        libs.update(re.findall(r"=> (/\S+)", p.stdout))
    return sorted(libs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packages", default=os.path.join(ROOT, "scripts", "packages.txt"))
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.build, "outbox-relay")):
        die(f"{a.build}/outbox-relay is missing: run `make test-programs all` first")
    pkgs = read_list(a.packages)
    base, inst = closure(pkgs)
    have = base | inst
    print(f"check-packages: {len(pkgs)} listed packages; a fresh Debian 12 would install "
          f"{len(inst)} packages on a base of {len(base)}")

    problems, checked = [], 0

    def check(kind, name, path):
        nonlocal checked
        checked += 1
        if path is None:
            problems.append(f"{kind} {name}: not found on this machine (not installed?)")
            return
        o = owner(path)
        if o is None:
            problems.append(f"{kind} {name}: {path} belongs to no Debian package")
        elif not set(o) & have:
            problems.append(f"{kind} {name}: {path} comes from {', '.join(o)}, which "
                            f"{os.path.relpath(a.packages, ROOT)} does not bring in")
        elif a.verbose:
            print(f"  ok {kind} {name}: {path} ({', '.join(o)})")

    exes, missing = used_executables()
    for n in missing:
        check("program", n, None)
    for n, p in exes.items():
        check("program", n, p)
    for m in used_modules():
        check("python module", m, module_file(m))
    for lib in shared_libs(a.build):
        check("library", os.path.basename(lib), lib)
    for f in ALWAYS_FILES:
        check("file", f, f if os.path.exists(f) else None)
    for f in sources(["tests/*.py", "tests/bench/*.py"]):
        for path in set(re.findall(r'"(/usr/(?:lib|share|bin|sbin)/[^"\s{}]+)"',
                                   open(f, encoding="utf-8").read())):
            check("path", path, path if os.path.exists(path) else None)

    for p in problems:
        print(f"check-packages: MISSING {p}")
    print(f"check-packages: {checked} items checked, {len(problems)} not covered by "
          f"{os.path.relpath(a.packages, ROOT)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
