/*
 * odbcsrc_stmt.c — the ODBC statement mechanics of the ODBC source: diagnostics
 * into one error line, parameters (bound from a T-SQL statement's table by name,
 * or in a PostgreSQL statement's $n order), execution with the query timeout,
 * results, rows, and one chunked reader of long text and binary columns. What
 * each request binds and reads is odbcsrc_db.c's.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include "lib/outbox_util.h"
#include "sources/odbc/odbcsrc_int.h"

/* Text travels as SQL_C_WCHAR: UTF-16 units, converted by lib/util.c (iconv). */
_Static_assert(sizeof(SQLWCHAR) == sizeof(uint16_t), "SQLWCHAR is a UTF-16 unit");

/* ------------------------------------------------------------ errors */

static void oneline_cat(char *dst, size_t cap, const char *src)
{
    size_t j = strlen(dst);
    int space = 0;
    for (const char *p = src; *p && j + 1 < cap; p++) {
        if (*p == '\n' || *p == '\r' || *p == '\t') {
            space = 1;
            continue;
        }
        if (space && j > 0 && dst[j - 1] != ' ' && j + 2 < cap)
            dst[j++] = ' ';
        space = 0;
        dst[j++] = *p;
    }
    while (j > 0 && dst[j - 1] == ' ')
        j--;
    dst[j] = '\0';
}

void ost_err(odbcsrc_db *db, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(db->err, sizeof db->err, fmt, ap);
    va_end(ap);
}

static bool conn_state(const char *st)
{
    return strncmp(st, "08", 2) == 0 || strcmp(st, "HYT01") == 0 ||
           strncmp(st, "57P0", 4) == 0;  /* PostgreSQL: admin/crash shutdown */
}

/* Fills db->err with "what: [STATE] message; ..." from the handle's
 * diagnostics and sets db->lost on a connection-class error. */
void ost_diag(odbcsrc_db *db, SQLSMALLINT type, SQLHANDLE h, const char *what)
{
    snprintf(db->err, sizeof db->err, "%s", what);
    db->native = 0;
    bool any = false;
    for (SQLSMALLINT rec = 1; rec <= 3; rec++) {
        SQLCHAR state[6] = "", msg[512] = "";
        SQLINTEGER native = 0;
        SQLSMALLINT ml = 0;
        SQLRETURN rc = SQLGetDiagRec(type, h, rec, state, &native, msg, sizeof msg, &ml);
        if (!SQL_SUCCEEDED(rc))
            break;
        char part[600];
        snprintf(part, sizeof part, "%s[%s] %s", any ? "; " : ": ", (char *)state, (char *)msg);
        oneline_cat(db->err, sizeof db->err, part);
        if (!any)
            db->native = (long)native;
        if (conn_state((char *)state))
            db->lost = true;
        any = true;
    }
    if (!any)
        oneline_cat(db->err, sizeof db->err, ": (no diagnostics)");
    if (db->connected && db->dbc != SQL_NULL_HDBC && !db->lost) {
        SQLUINTEGER dead = SQL_CD_FALSE;
        if (SQL_SUCCEEDED(SQLGetConnectAttr(db->dbc, SQL_ATTR_CONNECTION_DEAD, &dead, 0, NULL)) &&
            dead == SQL_CD_TRUE)
            db->lost = true;
    }
}

/* ------------------------------------------------------------ statements */

/* The next parameter of ps, cleared, with its types set. */
static param *p_next(params *ps, SQLSMALLINT ctype, SQLSMALLINT stype)
{
    param *p = &ps->p[ps->n++];
    memset(p, 0, sizeof *p);
    p->ctype = ctype;
    p->stype = stype;
    return p;
}

void ost_p_i64(params *ps, int64_t v)
{
    p_next(ps, SQL_C_SBIGINT, SQL_BIGINT)->i64 = v;
}

void ost_p_i32(params *ps, int64_t v)
{
    p_next(ps, SQL_C_SLONG, SQL_INTEGER)->i32 =
        (SQLINTEGER)(v > INT32_MAX ? INT32_MAX : v < INT32_MIN ? INT32_MIN : v);
}

/* A text parameter of the declared size class (never the data's length). */
void ost_p_text(params *ps, const char *s, SQLULEN size)
{
    param *p = p_next(ps, SQL_C_WCHAR, SQL_WVARCHAR);
    size_t units = 0;
    p->w = outbox_util_utf16_from_utf8(s, strlen(s), &units);
    if (!p->w) {
        ps->oom = 1;
        return;
    }
    p->ind = (SQLLEN)(units * sizeof(SQLWCHAR));
    p->colsize = size;
}

/* A NULL text parameter. */
void ost_p_null(params *ps)
{
    p_next(ps, SQL_C_WCHAR, SQL_WVARCHAR)->ind = SQL_NULL_DATA;
}

void ost_p_free(params *ps)
{
    for (int i = 0; i < ps->n; i++)
        free(ps->p[i].w);
    ps->n = 0;
}

static void cur_set(odbcsrc_db *db, SQLHSTMT h)
{
    if (db->cur_fn)
        db->cur_fn(db->cur_ud, h);
}

void ost_free(odbcsrc_db *db, SQLHSTMT h)
{
    if (h == SQL_NULL_HSTMT)
        return;
    cur_set(db, SQL_NULL_HSTMT);
    SQLFreeHandle(SQL_HANDLE_STMT, h);
}

/* Allocates a statement, binds ps, executes sql. 0 with *out (free with
 * ost_free), or -1 with db->err set. ps stays owned by the caller. */
int ost_run(odbcsrc_db *db, const char *what, const char *sql, params *ps, SQLHSTMT *out)
{
    SQLHSTMT h = SQL_NULL_HSTMT;
    SQLRETURN rc;
    *out = SQL_NULL_HSTMT;
    if (ps && ps->oom) {
        ost_err(db, "%s: out of memory", what);
        return -1;
    }
    rc = SQLAllocHandle(SQL_HANDLE_STMT, db->dbc, &h);
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_DBC, db->dbc, what);
        return -1;
    }
    int64_t qs = ((db->timeout_ms > 0 ? db->timeout_ms : db->conf->query_timeout_ms) + 999) / 1000;
    if (qs < 1)
        qs = 1;
    rc = SQLSetStmtAttr(h, SQL_ATTR_QUERY_TIMEOUT, (SQLPOINTER)(uintptr_t)qs, 0);
    if (!SQL_SUCCEEDED(rc))
        goto fail;
    (void)SQLSetStmtAttr(h, SQL_ATTR_NOSCAN, (SQLPOINTER)SQL_NOSCAN_ON, 0);  /* optional */
    for (int i = 0; ps && i < ps->n; i++) {
        param *p = &ps->p[i];
        SQLPOINTER v = p->ctype == SQL_C_SBIGINT ? (SQLPOINTER)&p->i64
                     : p->ctype == SQL_C_SLONG ? (SQLPOINTER)&p->i32 : (SQLPOINTER)p->w;
        SQLLEN blen = p->ctype == SQL_C_WCHAR && p->w ? p->ind + (SQLLEN)sizeof(SQLWCHAR) : 0;
        SQLSMALLINT stype = p->stype;
        SQLULEN colsize = p->colsize;
        /* nvarchar(max) is column size 0 (msodbcsql's SQL_SS_LENGTH_UNLIMITED). FreeTDS
           takes that as "send nothing" and never sends more than 4,000 characters of a
           SQL_WVARCHAR: a settle's JSON would arrive cut. It sends nvarchar(max) for
           SQL_WLONGVARCHAR (which msodbcsql would send as the legacy ntext instead). */
        if (db->freetds && stype == SQL_WVARCHAR && colsize == 0) {
            stype = SQL_WLONGVARCHAR;
            colsize = 1073741823;
        }
        rc = SQLBindParameter(h, (SQLUSMALLINT)(i + 1), SQL_PARAM_INPUT, p->ctype, stype,
                              colsize, 0, v, blen, p->ctype == SQL_C_WCHAR ? &p->ind : NULL);
        if (!SQL_SUCCEEDED(rc))
            goto fail;
    }
    cur_set(db, h);
    rc = SQLExecDirect(h, (SQLCHAR *)(uintptr_t)sql, SQL_NTS);
    if (!SQL_SUCCEEDED(rc) && rc != SQL_NO_DATA)
        goto fail;
    db->nodata = rc == SQL_NO_DATA;  /* no result at all: no cursor to read */
    *out = h;
    return 0;
fail:
    ost_diag(db, SQL_HANDLE_STMT, h, what);
    ost_free(db, h);
    return -1;
}

/* Advances to the first result set with columns. 0, 1 (none), -1 error. */
int ost_result(odbcsrc_db *db, SQLHSTMT h, const char *what)
{
    if (db->nodata)
        return 1;
    for (;;) {
        SQLSMALLINT nc = 0;
        SQLRETURN rc = SQLNumResultCols(h, &nc);
        if (!SQL_SUCCEEDED(rc)) {
            ost_diag(db, SQL_HANDLE_STMT, h, what);
            return -1;
        }
        if (nc > 0)
            return 0;
        rc = SQLMoreResults(h);
        if (rc == SQL_NO_DATA)
            return 1;
        if (!SQL_SUCCEEDED(rc)) {
            ost_diag(db, SQL_HANDLE_STMT, h, what);
            return -1;
        }
    }
}

/* Consumes the remaining results (errors of later batch statements surface here). */
int ost_drain(odbcsrc_db *db, SQLHSTMT h, const char *what)
{
    if (db->nodata)
        return 0;
    for (;;) {
        SQLRETURN rc = SQLMoreResults(h);
        if (rc == SQL_NO_DATA)
            return 0;
        if (!SQL_SUCCEEDED(rc)) {
            ost_diag(db, SQL_HANDLE_STMT, h, what);
            return -1;
        }
    }
}

/* Fetches the next row: 1 row, 0 end, -1 error. */
int ost_fetch(odbcsrc_db *db, SQLHSTMT h, const char *what)
{
    SQLRETURN rc = SQLFetch(h);
    if (rc == SQL_NO_DATA)
        return 0;
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_STMT, h, what);
        return -1;
    }
    return 1;
}

/* A fixed-size column (ctype) into buf; a NULL reads as zero, *isnull (may be NULL) says. */
static int get_fixed(odbcsrc_db *db, SQLHSTMT h, int col, SQLSMALLINT ctype, void *buf,
                     SQLLEN size, bool *isnull)
{
    SQLLEN ind = 0;
    SQLRETURN rc = SQLGetData(h, (SQLUSMALLINT)col, ctype, buf, size, &ind);
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_STMT, h, "reading a result column");
        return -1;
    }
    if (isnull)
        *isnull = ind == SQL_NULL_DATA;
    if (ind == SQL_NULL_DATA)
        memset(buf, 0, (size_t)size);
    return 0;
}

int ost_get_i64(odbcsrc_db *db, SQLHSTMT h, int col, int64_t *v, bool *isnull)
{
    return get_fixed(db, h, col, SQL_C_SBIGINT, v, sizeof *v, isnull);
}

int ost_get_f64(odbcsrc_db *db, SQLHSTMT h, int col, double *v, bool *isnull)
{
    return get_fixed(db, h, col, SQL_C_DOUBLE, v, sizeof *v, isnull);
}

/* Reads a column of ctype (SQL_C_WCHAR or SQL_C_BINARY) in chunks, appending its
 * bytes to out (reset first; a character column without its terminators). One call
 * per chunk; the length the driver announces is reserved once. *isnull tells SQL
 * NULL apart from empty. */
static int get_chunked(odbcsrc_db *db, SQLHSTMT h, int col, SQLSMALLINT ctype,
                       outbox_util_buf *out, bool *isnull)
{
    unsigned char chunk[8192];
    const size_t term = ctype == SQL_C_WCHAR ? sizeof(SQLWCHAR) : 0;
    const size_t room = sizeof chunk - term;   /* data bytes a full chunk holds */
    outbox_util_buf_reset(out);
    *isnull = false;
    if (outbox_util_buf_reserve(out, 0) < 0)
        goto oom;
    for (;;) {
        SQLLEN ind = 0;
        SQLRETURN rc = SQLGetData(h, (SQLUSMALLINT)col, ctype, chunk, sizeof chunk, &ind);
        if (rc == SQL_NO_DATA)
            return 0;
        if (!SQL_SUCCEEDED(rc)) {
            ost_diag(db, SQL_HANDLE_STMT, h, ctype == SQL_C_WCHAR ? "reading a text column"
                                                                  : "reading a binary column");
            return -1;
        }
        if (ind == SQL_NULL_DATA) {
            *isnull = true;
            return 0;
        }
        bool more = ind == SQL_NO_TOTAL || (size_t)ind > room;
        size_t got = more ? room : (size_t)ind;
        if (ind != SQL_NO_TOTAL && outbox_util_buf_reserve(out, (size_t)ind) < 0)
            goto oom;  /* the whole remaining length */
        if (outbox_util_buf_put(out, chunk, got) < 0)
            goto oom;
        if (rc == SQL_SUCCESS || !more)
            return 0;  /* the last chunk (an info that was not a truncation) */
    }
oom:
    ost_err(db, "reading a column: out of memory");
    return -1;
}

/* A text column as UTF-8 into out. The UTF-16 units of every chunk are gathered
 * first and converted once: a character outside the BMP whose surrogate pair
 * straddles two chunks stays one character. */
int ost_get_text(odbcsrc_db *db, SQLHSTMT h, int col, outbox_util_buf *out, bool *isnull)
{
    outbox_util_buf w = {0};
    int rc = get_chunked(db, h, col, SQL_C_WCHAR, &w, isnull);
    outbox_util_buf_reset(out);
    if (rc == 0 && (outbox_util_buf_reserve(out, 0) < 0 ||
                    outbox_util_utf16_to_utf8(out, (const uint16_t *)(const void *)w.p,
                                              w.len / sizeof(SQLWCHAR)) < 0)) {
        ost_err(db, "reading a text column: out of memory or invalid UTF-16");
        rc = -1;
    }
    outbox_util_buf_free(&w);
    return rc;
}

/* A binary column into out. */
int ost_get_bin(odbcsrc_db *db, SQLHSTMT h, int col, outbox_util_buf *out, bool *isnull)
{
    return get_chunked(db, h, col, SQL_C_BINARY, out, isnull);
}

/* The SQL text with {T} and {D} replaced by the quoted table names. */
char *ost_sql_for(odbcsrc_db *db, const char *tmpl)
{
    outbox_util_buf b = {0};
    for (const char *p = tmpl; *p;) {
        const char *q = strchr(p, '{');
        if (!q) {
            if (outbox_util_buf_puts(&b, p) < 0)
                goto oom;
            break;
        }
        if (outbox_util_buf_put(&b, p, (size_t)(q - p)) < 0)
            goto oom;
        if (q[1] == 'T' && q[2] == '}') {
            if (outbox_util_buf_puts(&b, db->qt) < 0)
                goto oom;
            p = q + 3;
        } else if (q[1] == 'D' && q[2] == '}') {
            if (outbox_util_buf_puts(&b, db->qd) < 0)
                goto oom;
            p = q + 3;
        } else if (q[1] == 'L' && q[2] == '}') {
            if (outbox_util_buf_puts(&b, db->ql) < 0)
                goto oom;
            p = q + 3;
        } else {
            if (outbox_util_buf_put(&b, q, 1) < 0)
                goto oom;
            p = q + 1;
        }
    }
    return b.p;  /* ownership to the caller */
oom:
    free(b.p);
    ost_err(db, "out of memory");
    return NULL;
}

/* A statement of sources/sql_pg.c (text, owned and freed here) for ODBC: its $n
 * markers become `?`, and ps gets v[n - 1] for each, in marker order. The
 * statement text is the libpq path's, byte for byte. NULL with db->err set. */
char *ost_pg_stmt(odbcsrc_db *db, char *text, const pgv *v, int nv, params *ps)
{
    int order[MAX_PARAMS];
    size_t n = 0;
    char *sql = text ? sql_pg_qmarks(text, order, MAX_PARAMS, &n) : NULL;
    free(text);
    if (!sql) {
        ost_err(db, "out of memory (or a statement with more than %d parameters)", MAX_PARAMS);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        if (order[i] < 1 || order[i] > nv) {
            ost_err(db, "internal error: statement parameter $%d has no value", order[i]);
            free(sql);
            return NULL;
        }
        const pgv *x = &v[order[i] - 1];
        if (x->t == PV_INT)
            ost_p_i64(ps, x->i);
        else if (x->t == PV_NULL)
            ost_p_null(ps);
        else
            ost_p_text(ps, x->s, x->size);
    }
    return sql;
}

/* Binds st's parameters into ps from its table (sources/sql_tsql.c), each from the
 * value given under its name: a call site never depends on the order of the
 * markers. -1 with db->err set when a parameter has no value or a value of the
 * other kind, or a value names no parameter (a programming error, said plainly). */
int ost_tsql_bind(odbcsrc_db *db, const sql_tsql_stmt *st, const ost_val *v, size_t nv,
                  params *ps)
{
    bool used[MAX_PARAMS] = { false };
    if (st->n_params > MAX_PARAMS || nv > MAX_PARAMS) {
        ost_err(db, "internal error: %s has more than %d parameters", st->name, MAX_PARAMS);
        return -1;
    }
    for (size_t i = 0; i < st->n_params; i++) {
        const sql_tsql_param *t = &st->params[i];
        const ost_val *x = NULL;
        for (size_t k = 0; k < nv && !x; k++)
            if (strcmp(v[k].name, t->name) == 0) {
                x = &v[k];
                used[k] = true;
            }
        bool text = t->ctype == SQL_C_WCHAR;
        if (!x || x->text != text) {
            ost_err(db, "internal error: %s: parameter @%s %s", st->name, t->name,
                    x ? "given a value of the wrong kind" : "has no value");
            return -1;
        }
        if (text)
            ost_p_text(ps, x->s ? x->s : "", t->size);
        else if (t->ctype == SQL_C_SLONG)
            ost_p_i32(ps, x->i);
        else
            ost_p_i64(ps, x->i);
    }
    for (size_t k = 0; k < nv; k++)
        if (!used[k]) {
            ost_err(db, "internal error: %s has no parameter @%s", st->name, v[k].name);
            return -1;
        }
    return 0;
}

/* st's text with its tables filled in (malloc'd), ps bound from its table; NULL with
 * db->err set. */
char *ost_tsql(odbcsrc_db *db, const sql_tsql_stmt *st, const ost_val *v, size_t nv, params *ps)
{
    return ost_tsql_bind(db, st, v, nv, ps) < 0 ? NULL : ost_sql_for(db, st->text);
}

/* Runs a statement that returns one row of integers; reads n of them. */
int ost_one_row_ints(odbcsrc_db *db, const char *what, const char *sql, params *ps,
                        int64_t *v, int n)
{
    SQLHSTMT h = SQL_NULL_HSTMT;
    int rc = -1;
    if (ost_run(db, what, sql, ps, &h) < 0)
        goto done;
    int r = ost_result(db, h, what);
    if (r != 0) {
        if (r > 0)
            ost_err(db, "%s: no result", what);
        goto done;
    }
    r = ost_fetch(db, h, what);
    if (r <= 0) {
        if (r == 0)
            ost_err(db, "%s: no result row", what);
        goto done;
    }
    for (int i = 0; i < n; i++)
        if (ost_get_i64(db, h, i + 1, &v[i], NULL) < 0)
            goto done;
    if (ost_drain(db, h, what) < 0)
        goto done;
    rc = 0;
done:
    ost_free(db, h);
    return rc;
}

/* Runs a statement without a result set; *count gets SQLRowCount (>= 0). */
int ost_exec_count(odbcsrc_db *db, const char *what, const char *sql, params *ps,
                      size_t *count)
{
    SQLHSTMT h = SQL_NULL_HSTMT;
    int rc = -1;
    if (ost_run(db, what, sql, ps, &h) < 0)
        goto done;
    if (count) {
        SQLLEN n = 0;
        if (!SQL_SUCCEEDED(SQLRowCount(h, &n))) {
            ost_diag(db, SQL_HANDLE_STMT, h, what);
            goto done;
        }
        *count = n > 0 ? (size_t)n : 0;
    }
    if (ost_drain(db, h, what) < 0)
        goto done;
    rc = 0;
done:
    ost_free(db, h);
    return rc;
}
