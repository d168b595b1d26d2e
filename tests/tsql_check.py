"""T-SQL checks for tests/test_tsql_capture.py: parse captured statements with sqlfluff
(dialect tsql, Debian's python3 package) and the rules liboutbox and the relay must keep on
SQL Server (issue 10).

Parsing. Every statement is parsed as sent, with three preparations, none of which hides a
syntax error:
  * ODBC parameter markers `?` become @P1, @P2, ... (what msodbcsql sends the server);
  * dynamic SQL is parsed too: the first argument of EXEC sp_executesql and the string of
    EXEC(N'...') are parsed as batches of their own (recursively), and the @params
    declaration of sp_executesql as a DECLARE; sqlfluff 1.4 has no grammar for the
    EXEC(N'...') form, so for the enclosing batch it is spelt EXEC sp_executesql N'...',
    which T-SQL treats alike;
  * long comma-separated runs of items that repeat with a short period once parameter
    numbers and integer literals are blanked (the rows of a VALUES list, the ? of an
    argument list, the 11 declarations per row of sp_executesql's @params) are shortened to
    their first two periods before parsing: such a list parses alike with 2 or 2,000
    items, and sqlfluff needs minutes for a 181-row VALUES list. An item that breaks the
    repetition is never dropped.
A statement "parses" when sqlfluff reports no violation and the tree holds no unparsable
segment.
"""
import hashlib
import json
import os
import pathlib
import re
import tempfile
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------- scanner


@dataclass
class Tok:
    kind: str   # str, id, cmt, ws, word, num, var, param, punct
    text: str


_WORD = re.compile(r"[A-Za-z_#][A-Za-z0-9_#$]*")
_NUM = re.compile(r"[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?")
_VAR = re.compile(r"@@?[A-Za-z0-9_#$]+")


def scan(sql):
    """T-SQL tokens (strings, [ids], "ids", comments kept whole)."""
    out, i, n = [], 0, len(sql)
    while i < n:
        c = sql[i]
        if c in "Nn" and i + 1 < n and sql[i + 1] == "'" or c == "'":
            j = i + (2 if c != "'" else 1)
            while True:
                k = sql.find("'", j)
                if k < 0:
                    raise ValueError(f"unterminated string literal at {i}")
                if k + 1 < n and sql[k + 1] == "'":
                    j = k + 2
                    continue
                break
            out.append(Tok("str", sql[i:k + 1]))
            i = k + 1
        elif c == "[":
            j = i + 1
            while True:
                k = sql.find("]", j)
                if k < 0:
                    raise ValueError(f"unterminated [identifier] at {i}")
                if k + 1 < n and sql[k + 1] == "]":
                    j = k + 2
                    continue
                break
            out.append(Tok("id", sql[i:k + 1]))
            i = k + 1
        elif c == '"':
            k = sql.find('"', i + 1)
            if k < 0:
                raise ValueError(f"unterminated quoted identifier at {i}")
            out.append(Tok("id", sql[i:k + 1]))
            i = k + 1
        elif sql.startswith("--", i):
            k = sql.find("\n", i)
            k = n if k < 0 else k
            out.append(Tok("cmt", sql[i:k]))
            i = k
        elif sql.startswith("/*", i):
            k = sql.find("*/", i + 2)
            if k < 0:
                raise ValueError(f"unterminated comment at {i}")
            out.append(Tok("cmt", sql[i:k + 2]))
            i = k + 2
        elif c.isspace():
            j = i
            while j < n and sql[j].isspace():
                j += 1
            out.append(Tok("ws", sql[i:j]))
            i = j
        elif c == "?":
            out.append(Tok("param", "?"))
            i += 1
        elif c == "@":
            m = _VAR.match(sql, i)
            if not m:
                out.append(Tok("punct", c))
                i += 1
            else:
                out.append(Tok("var", m.group(0)))
                i = m.end()
        elif c.isdigit():
            m = _NUM.match(sql, i)
            out.append(Tok("num", m.group(0)))
            i = m.end()
        else:
            m = _WORD.match(sql, i)
            if m:
                out.append(Tok("word", m.group(0)))
                i = m.end()
            else:
                out.append(Tok("punct", c))
                i += 1
    return out


def unquote(lit):
    """The value of a '...' or N'...' literal."""
    body = lit[2:-1] if lit[0] in "Nn" else lit[1:-1]
    return body.replace("''", "'")


def number_params(sql):
    """`?` markers → @P1, @P2, ... (outside strings, identifiers and comments)."""
    n = 0
    parts = []
    for t in scan(sql):
        if t.kind == "param":
            n += 1
            parts.append(f"@P{n}")
        else:
            parts.append(t.text)
    return "".join(parts), n


def words(sql):
    """Upper-cased keywords/identifiers outside strings and comments."""
    return [t.text.upper() for t in scan(sql) if t.kind == "word"]


# ---------------------------------------------------------------------------- dynamic SQL


@dataclass
class Dyn:
    kind: str        # "sp_executesql" | "exec"
    sql: str         # the dynamic batch
    decl: str = ""   # sp_executesql's @params ("" when none)


def _sig(toks):
    return [t for t in toks if t.kind not in ("ws", "cmt")]


def dynamic_sql(sql):
    """The dynamic batches of sql: EXEC sp_executesql N'...'[, N'decl'] and EXEC(N'...')."""
    toks = _sig(scan(sql))
    found = []
    for i, t in enumerate(toks):
        if t.kind != "word" or t.text.upper() not in ("EXEC", "EXECUTE"):
            continue
        nxt = toks[i + 1:i + 6]
        if len(nxt) >= 2 and nxt[0].kind == "word" and \
                nxt[0].text.lower() in ("sp_executesql", "sys.sp_executesql") and \
                nxt[1].kind == "str":
            decl = ""
            if len(nxt) >= 4 and nxt[2].text == "," and nxt[3].kind == "str":
                decl = unquote(nxt[3].text)
            found.append(Dyn("sp_executesql", unquote(nxt[1].text), decl))
        elif len(nxt) >= 3 and nxt[0].text == "(" and nxt[1].kind == "str" and \
                nxt[2].text == ")":
            found.append(Dyn("exec", unquote(nxt[1].text)))
    return found


def spell_exec_string(sql):
    """EXEC(N'...') → EXEC sp_executesql N'...' (sqlfluff 1.4 lacks the former)."""
    toks = scan(sql)
    out = []
    i = 0
    while i < len(toks):
        t = toks[i]
        if t.kind == "word" and t.text.upper() in ("EXEC", "EXECUTE"):
            j = i + 1
            while j < len(toks) and toks[j].kind in ("ws", "cmt"):
                j += 1
            if j + 2 < len(toks) and toks[j].text == "(" and toks[j + 1].kind == "str" \
                    and toks[j + 2].text == ")":
                out.append(f"{t.text} sp_executesql {toks[j + 1].text}")
                i = j + 3
                continue
        out.append(t.text)
        i += 1
    return "".join(out)


# ---------------------------------------------------------------------------- shortening

_BLANK = re.compile(r"(@[A-Za-z_]+)[0-9]+|\b[0-9]+\b")


def _shape(toks):
    return re.sub(_BLANK, lambda m: (m.group(1) or "") + "#",
                  "".join(t.text for t in toks if t.kind not in ("ws", "cmt")))


def shorten_lists(sql, min_items=8, keep=2, max_period=16):
    """Shortens long runs of comma-separated items that repeat with a period of 1 to
    max_period items (identical shapes: parameter numbers and integers blanked) to `keep`
    periods. Runs shorter than min_items items are left alone."""
    toks = scan(sql)
    drop = [False] * len(toks)
    stack = [[0, [0]]]  # [group start, item starts]

    def close(group, end):
        starts = group[1] + [end]
        items = [(starts[k], starts[k + 1]) for k in range(len(starts) - 1)]
        shapes = [_shape(toks[a:b]) for a, b in items]
        k = 0
        while k < len(items):
            best = None  # (items covered, period)
            for per in range(1, max_period + 1):
                reps = 1
                while k + (reps + 1) * per <= len(items) and \
                        shapes[k + reps * per:k + (reps + 1) * per] == shapes[k:k + per]:
                    reps += 1
                if reps > keep and reps * per >= min_items and \
                        (best is None or reps * per > best[0]):
                    best = (reps * per, per)
            if best is None:
                k += 1
                continue
            covered, per = best
            # keep the first `keep` periods; the comma after the run stays with the next item
            for a, b in items[k + keep * per:k + covered]:
                for x in range(a, b):
                    drop[x] = True
            k += covered

    for idx, t in enumerate(toks):
        if t.text == "(":
            stack.append([idx + 1, [idx + 1]])
        elif t.text == ")" and len(stack) > 1:
            close(stack.pop(), idx)
        elif t.text == ",":
            stack[-1][1].append(idx)  # the comma starts the next item
    while stack:
        close(stack.pop(), len(toks))
    return "".join(t.text for t, d in zip(toks, drop) if not d)


# ---------------------------------------------------------------------------- parsing

_LINTER = None


def _linter():
    global _LINTER
    if _LINTER is None:
        from sqlfluff.core import FluffConfig, Linter
        # raw templater: the text is SQL as sent, not a jinja template
        _LINTER = Linter(config=FluffConfig(overrides={"dialect": "tsql", "templater": "raw"}))
    return _LINTER


def _cache_dir():
    """Parse results are a function of the text, sqlfluff's version and this file: the
    plain, ASan and UBSan runs of the suite parse the same statements, once."""
    import sqlfluff
    key = hashlib.sha256((sqlfluff.__version__ + "\0").encode()
                         + pathlib.Path(__file__).read_bytes()).hexdigest()[:16]
    d = pathlib.Path(os.environ.get("OUTBOX_TSQL_CACHE") or
                     pathlib.Path(tempfile.gettempdir()) / "outbox-tsql-parse") / key
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass
class Parsed:
    sql: str                      # the text given to sqlfluff
    errors: list = field(default_factory=list)
    hints: list = field(default_factory=list)   # [[HINT, ...], ...] per WITH (...) table hint
    statements: list = field(default_factory=list)  # [(type, raw), ...] in order


# Valid T-SQL that sqlfluff's tsql grammar does not know (checked against Microsoft's
# reference instead): `SET LOCK_TIMEOUT n` (init bounds its lock waits with it).
_SQLFLUFF_GAPS = re.compile(r"^\s*SET\s+LOCK_TIMEOUT\s+-?\d+\s*;?\s*$", re.I)
# `SET DEADLOCK_PRIORITY LOW | NORMAL | HIGH | n` (the relay's sessions) is spelt as another
# SET option of the same shape before parsing; its own syntax is checked by this pattern.
_DEADLOCK_PRIORITY = re.compile(r"\bSET\s+DEADLOCK_PRIORITY\s+(LOW|NORMAL|HIGH|-?\d+)\b", re.I)


def parse(sql):
    """Parses one batch; returns Parsed (errors empty when it parses)."""
    if _SQLFLUFF_GAPS.match(sql):
        return Parsed(sql, [], [], [("set_statement", sql.strip())])
    text = shorten_lists(spell_exec_string(_DEADLOCK_PRIORITY.sub("SET NOCOUNT ON", sql)))
    f = _cache_dir() / (hashlib.sha256(text.encode()).hexdigest() + ".json")
    try:
        d = json.loads(f.read_text())
        return Parsed(text, d["errors"], d["hints"], [tuple(x) for x in d["statements"]])
    except (OSError, ValueError, KeyError):
        pass
    p = _parse(text)
    tmp = f.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"errors": p.errors, "hints": p.hints,
                               "statements": p.statements}))
    os.replace(tmp, f)
    return p


def _parse(text):
    res = _linter().parse_string(text)
    p = Parsed(text)
    for v in res.violations:
        p.errors.append(v.desc() if hasattr(v, "desc") else str(v))
    tree = res.tree
    if tree is None:
        p.errors.append("no parse tree")
        return p
    for seg in tree.recursive_crawl("unparsable"):
        p.errors.append(f"unparsable: {seg.raw[:200]!r}")
    for seg in tree.recursive_crawl("post_table_expression"):
        hs = [h.raw.upper() for h in seg.recursive_crawl("query_hint_segment")]
        if hs:
            p.hints.append(hs)
    for st in tree.recursive_crawl("statement"):
        kids = [c for c in st.segments if not c.is_type("whitespace", "newline", "indent",
                                                         "dedent")]
        if kids:
            p.statements.append((kids[0].get_type(), st.raw))
    return p


# ---------------------------------------------------------------------------- rules

# table hints that take locks a producer must never take on the outbox (range locks,
# held update/exclusive locks, table or page locks)
PRODUCER_FORBIDDEN_HINTS = {"HOLDLOCK", "SERIALIZABLE", "REPEATABLEREAD", "UPDLOCK", "XLOCK",
                            "TABLOCK", "TABLOCKX", "PAGLOCK"}
# one hint per group and table (SQL Server's rule; error 1047 otherwise)
HINT_GROUPS = [{"PAGLOCK", "NOLOCK", "READCOMMITTEDLOCK", "ROWLOCK", "TABLOCK", "TABLOCKX"},
               {"HOLDLOCK", "NOLOCK", "READCOMMITTED", "REPEATABLEREAD", "SERIALIZABLE"}]
# READPAST is refused under READ_COMMITTED_SNAPSHOT unless the read takes locks
READPAST_PARTNERS = {"UPDLOCK", "XLOCK", "READCOMMITTEDLOCK"}

# ODBC SQL types (sqlext.h)
SQL_CHAR, SQL_VARCHAR, SQL_LONGVARCHAR = 1, 12, -1
SQL_WCHAR, SQL_WVARCHAR, SQL_WLONGVARCHAR = -8, -9, -10
SQL_BINARY, SQL_VARBINARY, SQL_LONGVARBINARY = -2, -3, -4
SQL_INTEGER, SQL_BIGINT, SQL_SMALLINT, SQL_GUID = 4, -5, 5, -11
FIXED_SIZE_OK = {
    SQL_WVARCHAR: {255, 4000, 0},   # nvarchar(255), nvarchar(4000), nvarchar(max)
    SQL_VARBINARY: {0},             # varbinary(max)
    SQL_CHAR: {36},                 # a UUID as text
    SQL_GUID: {0, 16, 36},
}
NUMERIC = {SQL_INTEGER, SQL_BIGINT, SQL_SMALLINT}
LEGACY_LOB = {SQL_LONGVARCHAR: "text", SQL_WLONGVARCHAR: "ntext", SQL_LONGVARBINARY: "image"}
MAX_PARAMS = 2100


def hint_problems(parsed, producer):
    """Table-hint rules of one parsed batch; a list of messages."""
    out = []
    for hs in parsed.hints:
        s = set(hs)
        if producer and s & PRODUCER_FORBIDDEN_HINTS:
            out.append(f"producer path takes {sorted(s & PRODUCER_FORBIDDEN_HINTS)} locks "
                       f"(WITH ({', '.join(hs)})): concurrent producers would serialize")
        for g in HINT_GROUPS:
            if len(s & g) > 1:
                out.append(f"conflicting table hints {sorted(s & g)} (SQL Server error 1047)")
        if "READPAST" in s and not s & READPAST_PARTNERS:
            out.append(f"WITH ({', '.join(hs)}): READPAST without UPDLOCK, XLOCK or "
                       "READCOMMITTEDLOCK fails under READ_COMMITTED_SNAPSHOT (error 650)")
    return out


def isolation_problems(sql, producer):
    """A producer never raises its isolation level (range locks)."""
    w = " ".join(words(sql))
    if producer and re.search(r"ISOLATION LEVEL (SERIALIZABLE|REPEATABLE READ|SNAPSHOT)", w):
        return ["producer path raises the transaction isolation level"]
    if "IGNORE_DUP_KEY" in w:
        return ["IGNORE_DUP_KEY takes key-range locks on every INSERT"]
    return []


def param_problems(params):
    """Parameter binding rules for one execution; a list of messages."""
    out = []
    if len(params) > MAX_PARAMS - 2:
        out.append(f"{len(params)} parameters: over SQL Server's limit of {MAX_PARAMS} "
                   "(less the 2 of sp_executesql)")
    for p in params:
        if p is None:
            out.append("a parameter number was skipped")
            continue
        st, size = p["stype"], p["size"]
        if st in LEGACY_LOB:
            out.append(f"parameter {p['n']}: bound as {LEGACY_LOB[st]} (SQL type {st}); "
                       "use SQL_WVARCHAR / SQL_VARBINARY with column size 0 for (max)")
        elif st in NUMERIC:
            pass
        elif st in FIXED_SIZE_OK:
            if size not in FIXED_SIZE_OK[st]:
                out.append(f"parameter {p['n']}: SQL type {st} with column size {size}: "
                           f"not one of the fixed sizes {sorted(FIXED_SIZE_OK[st])}")
        else:
            out.append(f"parameter {p['n']}: unexpected SQL type {st}")
    return out


def signature(params):
    return tuple((p["ctype"], p["stype"], p["size"], p["digits"]) if p else None
                 for p in params)


_DECL = re.compile(r"@([A-Za-z_][A-Za-z0-9_]*)\s+([A-Za-z]+(?:\s*\([^)]*\))?)")
DECL_FOR = {  # declared sp_executesql type → the ODBC binding it needs
    "uniqueidentifier": {(SQL_CHAR, 36), (SQL_GUID, 16), (SQL_GUID, 36)},
    "nvarchar(255)": {(SQL_WVARCHAR, 255)},
    "nvarchar(4000)": {(SQL_WVARCHAR, 4000)},
    "nvarchar(max)": {(SQL_WVARCHAR, 0)},
    "varbinary(max)": {(SQL_VARBINARY, 0)},
    "int": {(SQL_INTEGER, 0)},
    "bigint": {(SQL_BIGINT, 0)},
}


def decl_problems(decl, params):
    """sp_executesql's declared types against the ODBC bindings passed to them."""
    out = []
    types = [re.sub(r"\s+", "", t.lower()) for _, t in _DECL.findall(decl)]
    if len(types) != len(params):
        return [f"sp_executesql declares {len(types)} parameters but {len(params)} are bound"]
    for k, (t, p) in enumerate(zip(types, params), 1):
        want = DECL_FOR.get(t)
        if want is None:
            out.append(f"declared parameter {k}: type {t} is not a fixed-size type")
        elif p is None or (p["stype"], p["size"] if p["stype"] not in NUMERIC else 0) \
                not in want:
            out.append(f"parameter {k} is declared {t} but bound as SQL type "
                       f"{p and p['stype']} size {p and p['size']}")
    return out


# ---------------------------------------------------------------------------- relay locking rules
# The relay's own statements (sources/sql_tsql.c) on SQL Server with READ_COMMITTED_SNAPSHOT
# off, where a plain read takes shared locks and waits for writers. What Babelfish cannot show
# (it ignores table hints and reads MVCC snapshots) is checked on the text here. Each rule
# takes a batch's text (markers as sent or numbered) and returns a list of problems.

ESCALATION_ROWS = 4000   # SQL Server escalates at 5,000 locks on one table per statement


def _norm(sql):
    return re.sub(r"\s+", " ", "".join(t.text for t in scan(sql) if t.kind != "cmt")).upper()


def _segments(sql):
    """The batch split into statements at `;` (outside strings): good enough for the
    relay's own text, which ends every statement with one."""
    out, cur = [], []
    for t in scan(sql):
        if t.text == ";":
            out.append("".join(cur))
            cur = []
        else:
            cur.append(t.text)
    out.append("".join(cur))
    return [s for s in out if s.strip()]


def lease_table_problems(sql, ql):
    """Competing claims must not wait for each other on the lease table: the membership
    count reads it WITH (NOLOCK) (a plain read waits for every other relay's renewal, held
    to its commit: they deadlock), and no predicate wraps `name` in a function (LEFT(name, 7)
    is a scan of every row instead of a seek on the primary key)."""
    out = []
    n = _norm(sql)
    q = re.escape(ql.upper())
    if re.search(r"\bLEFT\s*\(\s*(\w+\.)?NAME\s*,", n):
        out.append("LEFT(name, n) on the lease table is not sargable: use name LIKE N'prefix%'")
    for m in re.finditer(r"SELECT @\w+ = COUNT\(\*\)[^;]*?FROM " + q + r"(?: (?:AS )?(?!WITH\b|WHERE\b)\w+)?"
                         r"(?: WITH \(([^)]*)\))?", n):
        if "NOLOCK" not in (m.group(1) or ""):
            out.append("the membership count reads the lease table with shared locks: two "
                       "claims that renewed their own member row wait for each other (1205)")
    return out


def probe_problems(sql, qt):
    """A claim's reads of the outbox either skip locked rows (READPAST with UPDLOCK) or take
    no lock (NOLOCK): a READCOMMITTEDLOCK read (or a plain one under locking read committed)
    of another key's rows waits for a producer's open transaction while the claim holds its
    own locks, and every other relay queues behind it."""
    out = []
    n = _norm(sql)
    q = re.escape(qt.upper())
    for m in re.finditer(r"FROM " + q + r"(?: (?:AS )?(?!WITH\b)(\w+))?(?: WITH \(([^)]*)\))?",
                         n):
        alias, hints = m.group(1) or "", m.group(2) or ""
        if alias in ("WHERE", "JOIN", "ORDER", "GROUP"):
            alias = ""
        hs = {h.strip() for h in hints.split(",")}
        if "READPAST" in hs or "NOLOCK" in hs:
            continue
        out.append(f"claim reads the outbox{' as ' + alias if alias else ''} "
                   f"{'WITH (' + hints + ')' if hints else 'without a hint'}: it waits for any "
                   "producer's open transaction on the rows it reads")
    return out


def first_failed_problems(sql, qt):
    """The leader claim holds a key's rows behind its first failed pending row: that row's id
    per key is computed once per claim (an aggregate over the failed rows, joined by key),
    not looked up once per candidate row (a correlated NOT EXISTS over the outbox with
    attempts > 0 and id below the candidate's: every candidate probes its key's rows)."""
    n = _norm(sql)
    q = re.escape(qt.upper())
    if re.search(r"NOT EXISTS \(SELECT 1 FROM " + q + r" (\w+)(?: WITH \([^)]*\))? WHERE "
                 r"[^;]*?\b\1\.ATTEMPTS > 0 AND \1\.ID < \w+\.ID\)", n):
        return ["each key's first failed row is looked up once per candidate row: compute it "
                "once per key (MIN(id) of the failed rows, grouped by key) and join"]
    return []


# A fence: a read of the leader row that checks it is this relay's (owner, then epoch). A
# read that only asks whether some relay leads (a competing claim's) fences nothing.
FENCE_READ = r"FROM {} (\w+)(?: WITH \(([^)]*)\))? WHERE \1\.NAME = N'LEADER' AND \1\.OWNER = "


def fence_problems(sql, ql):
    """A statement fenced by the leadership epoch holds the leader row it read to its
    commit (HOLDLOCK / REPEATABLEREAD / SERIALIZABLE): otherwise a takeover can reset the
    leases between the check and the commit, and the claim's rows stay leased to the old
    leader while the new one publishes the key's later rows."""
    out = []
    n = _norm(sql)
    q = re.escape(ql.upper())
    for m in re.finditer(FENCE_READ.format(q), n):
        hs = {h.strip() for h in (m.group(2) or "").split(",")}
        if not hs & {"HOLDLOCK", "REPEATABLEREAD", "SERIALIZABLE"}:
            out.append("the leader fence is read and released at once (no HOLDLOCK or "
                       "REPEATABLEREAD): a takeover does not wait for this statement")
    return out


def fence_txn_problems(sql, autocommit, ql):
    """A batch that reads the leader row to hold it (HOLDLOCK) ends its transaction inside
    the batch: the session runs with autocommit on (under implicit transactions the row
    stays locked until the client's COMMIT, a round trip later, and a relay frozen in
    between blocks every takeover for as long as it is frozen), every BEGIN TRANSACTION has
    its COMMIT in the same batch, and without one the fence is part of the statement that
    writes (an IF that checks it is a statement of its own under autocommit: the row is
    released before the write)."""
    n = _norm(sql)
    q = re.escape(ql.upper())
    held = [m for m in re.finditer(FENCE_READ.format(q), n) if "HOLDLOCK" in (m.group(2) or "")]
    if not held:
        return []
    out = []
    if not autocommit:
        out.append("the leader row is held under implicit transactions (autocommit off): it "
                   "stays locked until the client's COMMIT, and a relay frozen before it "
                   "blocks every takeover")
    begins = len(re.findall(r"\bBEGIN TRAN(?:SACTION)?\b", n))
    commits = len(re.findall(r"\bCOMMIT(?: TRAN(?:SACTION)?)?\b", n))
    if begins != commits:
        out.append(f"{begins} BEGIN TRANSACTION and {commits} COMMIT in the batch: a "
                   "transaction holding the leader row outlives the batch")
    if begins == 0 and re.search(r"\bIF\b(?:(?!;).)*?FROM " + q + r" \w+ WITH \([^)]*HOLDLOCK",
                                 n):
        out.append("the leader fence is checked by an IF before the write, outside any "
                   "transaction of the batch: under autocommit the row is released before "
                   "the write")
    return out


def mode_problems(sql, ql, qt):
    """A competing claim reads the leader row with a lock held to its commit (HOLDLOCK),
    inside the transaction that takes its rows and before it reads them: a lead (which
    writes that row) in flight is then waited for and seen, and a later lead waits for the
    claim. Read without a lock, or before the transaction, a lead and the claim can both go
    on at the same moment, and the new leader's claims take later rows of the keys the
    competing claim holds."""
    n = _norm(sql)
    q, t = re.escape(ql.upper()), re.escape(qt.upper())
    take = re.search(r"FROM " + t + r" \w+ WITH \((?=[^)]*UPDLOCK)[^)]*\)", n)
    if not take:
        return []
    begin = [m.end() for m in re.finditer(r"\bBEGIN TRAN(?:SACTION)?\b", n[:take.start()])]
    held = [m for m in re.finditer(r"FROM " + q + r" (\w+) WITH \(([^)]*)\) WHERE \1\.NAME = "
                                   r"N'LEADER'", n[:take.start()])
            if "HOLDLOCK" in m.group(2) and begin and m.start() > begin[-1]
            and not re.search(r"\bCOMMIT\b", n[m.end():take.start()])]
    if held:
        return []
    return ["the competing claim does not hold the leader row (HOLDLOCK, inside the "
            "transaction that takes its rows): a lead running at the same moment is not "
            "waited for, and both modes claim"]


def lead_problems(sql, ql):
    """The lead reads the leader row WITH (XLOCK, HOLDLOCK) before it reads the members: a
    competing claim in flight holds that row (S) to its commit, so the lead reads the
    members only once that claim's member row is there. With UPDLOCK (compatible with S) it
    read them first, found none, took over once the claim committed and reset the leases
    the claim had just taken."""
    n = _norm(sql)
    q = re.escape(ql.upper())
    out = []
    for m in re.finditer(r"SELECT @\w+ = OWNER, @\w+ = EPOCH FROM " + q +
                         r"(?: \w+)? WITH \(([^)]*)\) WHERE (?:\w+\.)?NAME = N'LEADER'", n):
        hs = {h.strip() for h in m.group(1).split(",")}
        if not {"XLOCK", "HOLDLOCK"} <= hs:
            out.append("the lead reads the leader row without XLOCK, HOLDLOCK: a competing "
                       "claim in flight does not hold it off, and it takes over behind it")
    return out


def output_problems(sql):
    """OUTPUT always INTO a table variable (without INTO the statement fails on a table
    with any trigger, Msg 334), and nothing converted inside it."""
    out = []
    n = _norm(sql)
    for m in re.finditer(r"\bOUTPUT\b(.*?)(?:\bINTO\b\s+(\S+)|\bFROM\b|\bWHERE\b|\bVALUES\b|"
                         r"\bSELECT\b|;|$)", n):
        cols, into = m.group(1), m.group(2)
        if not into or not into.startswith("@"):
            out.append("OUTPUT without INTO a table variable: fails with Msg 334 as soon as "
                       "the table has a trigger")
        if re.search(r"\b(CONVERT|CAST)\s*\(", cols):
            out.append("CONVERT/CAST inside OUTPUT: convert when selecting from the table "
                       "variable")
    return out


# The ids of derived tables over a TOP (n): `SELECT z.id FROM (SELECT t.id, <columns> FROM (`
# repeated, the columns holding at most one level of parentheses (SUM(t.sz) OVER (...)); a
# filter over the TOP's rows (a claim's byte limit) keeps its bound.
_DERIVED = r"(?:SELECT \w+\.ID(?:, (?:[^(),]|\([^()]*\))+)* FROM \()+"


def escalation_problems(sql, tables):
    """Every UPDATE or DELETE of the outbox or dead table touches a bounded number of rows:
    by TOP (n) with n at most ESCALATION_ROWS (or a variable the caller bounds), by the ids of
    a table variable, or by key. An unbounded one takes 5,000+ row locks and escalates to a
    table lock that stops every producer."""
    out = []
    names = [t.upper() for t in tables]
    for seg in _segments(sql):
        n = _norm(seg)
        m = re.search(r"\b(UPDATE|DELETE)\b(.*)", n)
        if not m or not any(t in m.group(2) for t in names):
            continue
        body = m.group(2)
        top = re.search(r"^\s*(?:TOP \((\d+|@\w+)\))", body)
        if top:
            if top.group(1).isdigit() and int(top.group(1)) > ESCALATION_ROWS:
                out.append(f"{m.group(1)} TOP ({top.group(1)}): over {ESCALATION_ROWS} rows")
            continue
        if re.search(r"(JOIN|FROM|IN \(SELECT \w+ FROM) @\w+", body) or \
                re.search(r"EXISTS \(SELECT 1 FROM @\w+", body) or \
                re.search(r"\bWHERE (\w+\.)?(NAME|ID) = ", body) or \
                re.search(r"\b(WHERE|AND) (\w+\.)?ID IN \(SELECT TOP \((\d+|@\w+)\)", body) or \
                re.search(r"\b(WHERE|AND) (\w+\.)?ID IN \(" + _DERIVED + r"SELECT TOP "
                          r"\((\d+|@\w+)\)", body):
            continue
        out.append(f"{m.group(1)} without TOP, a table variable of ids or a key: "
                   f"unbounded, escalates to a table lock: {seg.strip()[:160]}")
    return out


# ---------------------------------------------------------------------------- liboutbox and the DDL
# (issue 20: rules for the producer's statements and init's; the relay's have their own)

_NO_ROW = re.compile(r"\bTOP\s*\(\s*0\s*\)|\b(MESSAGE_ID|ID)\s+IS\s+NULL\b")


def opener_problems(sql):
    """A batch that sets a savepoint must have opened its transaction first, under implicit
    transactions by reading a table. A read that cannot return a row (TOP (0), a NOT NULL
    column IS NULL) compiles to a constant scan, which reads no table and starts no
    transaction: SAVE TRANSACTION then fails (error 628)."""
    w = " ".join(words(sql))
    if "SAVE TRANSACTION" not in w:
        return []
    text = " ".join(t.text.upper() for t in scan(sql) if t.kind not in ("cmt", "str"))
    if _NO_ROW.search(text):
        return ["the savepoint's transaction is opened by a read that cannot return a row "
                "(TOP (0) / IS NULL on a NOT NULL column): a constant scan starts no "
                "implicit transaction and SAVE TRANSACTION fails"]
    if not re.search(r"\bSELECT\b.*\bFROM\b", w):
        return ["a savepoint without a read of a table before it to open the transaction"]
    return []


_OUTPUT_END = {"FROM", "WHERE", "VALUES", "SELECT", "DEFAULT", "EXEC", "EXECUTE"}


def output_into_problems(sql):
    """(liboutbox's and init's statements; by tokens, so a procedure parameter's OUTPUT mode
    is no match) OUTPUT without INTO is refused on a table with any enabled trigger (Msg 334):
    every OUTPUT clause must send its rows INTO a table variable (then SELECT them)."""
    toks = [t for t in scan(sql) if t.kind not in ("ws", "cmt")]
    out = []
    for i, t in enumerate(toks):
        if t.kind != "word" or t.text.upper() != "OUTPUT":
            continue
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if nxt is None or nxt.text in (",", ")", ";"):
            continue   # a procedure parameter's OUTPUT mode
        depth = 0
        for u in toks[i + 1:]:
            if u.text == "(":
                depth += 1
            elif u.text == ")":
                depth -= 1
            elif depth == 0 and (u.text == ";" or (u.kind == "word" and
                                                   u.text.upper() in _OUTPUT_END)):
                out.append("OUTPUT without INTO: refused on a table with a trigger (Msg 334)")
                break
            elif depth == 0 and u.kind == "word" and u.text.upper() == "INTO":
                break
        else:
            out.append("OUTPUT without INTO: refused on a table with a trigger (Msg 334)")
    return out
