/*
 * recdrv.c — a recording ODBC driver for tests/test_tsql_capture.py.
 *
 * It stands in for SQL Server where none can run: registered with unixODBC
 * through an odbcinst.ini in a temporary directory (ODBCSYSINI), it reports
 * SQL_DBMS_NAME "Microsoft SQL Server", accepts every statement, writes every
 * SQLExecDirect / SQLPrepare+SQLExecute text with the bound parameters' C
 * type, SQL type, column size and data length as one JSON line to the file
 * named by OUTBOX_REC_LOG, and answers with plausible results:
 *
 *   - a statement whose text contains SELECT, OUTPUT or EXEC returns one
 *     result set of OUTBOX_REC_ROWS rows (default 1) with 16 columns; any
 *     other statement returns no result set and a row count of 1;
 *   - integer columns read as OUTBOX_REC_INT (default 1; "params/K": the
 *     number of bound parameters divided by K, e.g. the rows of an INSERT of
 *     K parameters per row), doubles as 1.5, column 2 as text as a UUID,
 *     other text as "x", binary as "p";
 *   - the current catalog is the Database= of the connection string;
 *   - a statement naming compatibility_level reads its integers as
 *     OUTBOX_REC_COMPAT (default 130: a database the relay accepts).
 *
 * OUTBOX_REC_FAIL=SUBSTR and OUTBOX_REC_FAIL_NTH=N (default 1; "N+": the Nth
 * and every later one) make the Nth execution whose text contains SUBSTR fail
 * with SQLSTATE OUTBOX_REC_FAIL_STATE (default 42000) and native error
 * OUTBOX_REC_FAIL_NATIVE (default 50000), to drive the callers' error paths.
 *
 * Built by the test itself (cc -shared); it links nothing but libc. Driver
 * functions never call each other through their exported names: inside a
 * process that also loaded the driver manager those names resolve to the
 * manager's functions.
 */
#include <ctype.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <sql.h>
#include <sqlext.h>

#define EXPORT __attribute__((visibility("default")))
#define NCOLS 16

typedef struct diag {
    int  set;
    char state[6];
    long native;
    char msg[256];
} diag;

typedef struct renv {
    int  odbc_ver;
    diag d;
} renv;

typedef struct rdbc {
    renv *env;
    int   id;
    int   connected;
    SQLULEN autocommit;
    char  db[256];
    diag  d;
} rdbc;

typedef struct rparam {
    int         bound;
    SQLSMALLINT io, ctype, stype, digits;
    SQLULEN     size;
    SQLPOINTER  val;
    SQLLEN      buflen;
    SQLLEN     *ind;
} rparam;

typedef struct rstmt {
    rdbc   *dbc;
    char   *sql;        /* prepared text (SQLPrepare) */
    rparam *p;
    int     np;         /* allocated entries */
    int     has_rs;
    int     nparams;    /* bound at the last execution */
    int     compat;     /* the statement reads compatibility_level */
    long    rows_left;
    int     on_row;
    int     col_read[NCOLS + 1];
    diag    d;
    char    desc[4];    /* distinct addresses for the implicit descriptors */
} rstmt;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int next_conn = 1;
static long exec_seq;
static long fail_seen;

/* ------------------------------------------------------------ log */

typedef struct sbuf {
    char  *p;
    size_t len, cap;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (!b->p && !(b->p = malloc(b->cap = 1024)))
        abort();
    while (b->len + n + 1 > b->cap) {
        b->cap *= 2;
        if (!(b->p = realloc(b->p, b->cap)))
            abort();
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0)
        sb_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

static void sb_json(sbuf *b, const char *s, size_t n)
{
    sb_put(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char e[2] = { '\\', (char)c };
            sb_put(b, e, 2);
        } else if (c < 0x20 || c == 0x7f) {
            sb_printf(b, "\\u%04x", c);
        } else {
            sb_put(b, (const char *)&c, 1);
        }
    }
    sb_put(b, "\"", 1);
}

static void log_line(sbuf *b)
{
    const char *path = getenv("OUTBOX_REC_LOG");
    sb_put(b, "\n", 1);
    if (path && *path) {
        pthread_mutex_lock(&mu);
        int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
        if (fd >= 0) {
            size_t off = 0;
            while (off < b->len) {
                ssize_t w = write(fd, b->p + off, b->len - off);
                if (w <= 0)
                    break;
                off += (size_t)w;
            }
            close(fd);
        }
        pthread_mutex_unlock(&mu);
    }
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

static void log_event(const rdbc *c, const char *ev, const char *extra)
{
    sbuf b = { 0 };
    sb_printf(&b, "{\"pid\":%ld,\"conn\":%d,\"ev\":\"%s\"%s}", (long)getpid(), c ? c->id : 0,
              ev, extra ? extra : "");
    log_line(&b);
}

/* ------------------------------------------------------------ diagnostics */

static void diag_set(diag *d, const char *state, long native, const char *msg)
{
    d->set = 1;
    snprintf(d->state, sizeof d->state, "%s", state);
    d->native = native;
    snprintf(d->msg, sizeof d->msg, "%s", msg);
}

static diag *handle_diag(SQLSMALLINT type, SQLHANDLE h)
{
    if (!h)
        return NULL;
    switch (type) {
    case SQL_HANDLE_ENV: return &((renv *)h)->d;
    case SQL_HANDLE_DBC: return &((rdbc *)h)->d;
    case SQL_HANDLE_STMT: return &((rstmt *)h)->d;
    default: return NULL;
    }
}

EXPORT SQLRETURN SQL_API SQLGetDiagRec(SQLSMALLINT type, SQLHANDLE h, SQLSMALLINT rec,
                                       SQLCHAR *state, SQLINTEGER *native, SQLCHAR *msg,
                                       SQLSMALLINT buflen, SQLSMALLINT *textlen)
{
    diag *d = handle_diag(type, h);
    if (!d || !d->set || rec != 1)
        return SQL_NO_DATA;
    if (state)
        memcpy(state, d->state, 6);
    if (native)
        *native = (SQLINTEGER)d->native;
    if (msg && buflen > 0)
        snprintf((char *)msg, (size_t)buflen, "%s", d->msg);
    if (textlen)
        *textlen = (SQLSMALLINT)strlen(d->msg);
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLGetDiagField(SQLSMALLINT type, SQLHANDLE h, SQLSMALLINT rec,
                                         SQLSMALLINT field, SQLPOINTER info, SQLSMALLINT buflen,
                                         SQLSMALLINT *len)
{
    diag *d = handle_diag(type, h);
    (void)buflen;
    (void)len;
    if (rec == 0 && field == SQL_DIAG_NUMBER) {
        if (info)
            *(SQLINTEGER *)info = d && d->set ? 1 : 0;
        return SQL_SUCCESS;
    }
    return SQL_NO_DATA;
}

/* ------------------------------------------------------------ handles */

static SQLRETURN alloc_handle(SQLSMALLINT type, SQLHANDLE in, SQLHANDLE *out)
{
    switch (type) {
    case SQL_HANDLE_ENV: {
        renv *e = calloc(1, sizeof *e);
        if (!e)
            return SQL_ERROR;
        e->odbc_ver = SQL_OV_ODBC3;
        *out = e;
        return SQL_SUCCESS;
    }
    case SQL_HANDLE_DBC: {
        rdbc *c = calloc(1, sizeof *c);
        if (!c)
            return SQL_ERROR;
        c->env = in;
        c->autocommit = SQL_AUTOCOMMIT_ON;
        pthread_mutex_lock(&mu);
        c->id = next_conn++;
        pthread_mutex_unlock(&mu);
        *out = c;
        return SQL_SUCCESS;
    }
    case SQL_HANDLE_STMT: {
        rstmt *s = calloc(1, sizeof *s);
        if (!s)
            return SQL_ERROR;
        s->dbc = in;
        *out = s;
        return SQL_SUCCESS;
    }
    default:
        return SQL_ERROR;
    }
}

EXPORT SQLRETURN SQL_API SQLAllocHandle(SQLSMALLINT type, SQLHANDLE in, SQLHANDLE *out)
{
    return alloc_handle(type, in, out);
}

static void stmt_reset_results(rstmt *s)
{
    s->has_rs = 0;
    s->rows_left = 0;
    s->on_row = 0;
    memset(s->col_read, 0, sizeof s->col_read);
}

EXPORT SQLRETURN SQL_API SQLFreeHandle(SQLSMALLINT type, SQLHANDLE h)
{
    if (!h)
        return SQL_INVALID_HANDLE;
    if (type == SQL_HANDLE_STMT) {
        rstmt *s = h;
        free(s->sql);
        free(s->p);
    }
    free(h);
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLFreeStmt(SQLHSTMT h, SQLUSMALLINT option)
{
    rstmt *s = h;
    if (option == SQL_CLOSE)
        stmt_reset_results(s);
    else if (option == SQL_RESET_PARAMS && s->p)
        memset(s->p, 0, (size_t)s->np * sizeof *s->p);
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLSetEnvAttr(SQLHENV h, SQLINTEGER attr, SQLPOINTER v, SQLINTEGER len)
{
    (void)len;
    if (attr == SQL_ATTR_ODBC_VERSION)
        ((renv *)h)->odbc_ver = (int)(intptr_t)v;
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLGetEnvAttr(SQLHENV h, SQLINTEGER attr, SQLPOINTER v, SQLINTEGER len,
                                       SQLINTEGER *outlen)
{
    (void)len;
    (void)outlen;
    if (attr == SQL_ATTR_ODBC_VERSION && v)
        *(SQLINTEGER *)v = ((renv *)h)->odbc_ver;
    return SQL_SUCCESS;
}

/* ------------------------------------------------------------ connection */

/* Database=... of a connection string (case-insensitive key, optional braces). */
static void conn_db(const char *cs, size_t n, char *out, size_t outlen)
{
    out[0] = '\0';
    size_t i = 0;
    while (i < n) {
        size_t k = i;
        while (k < n && cs[k] != '=' && cs[k] != ';')
            k++;
        if (k >= n || cs[k] == ';') {
            i = k + 1;
            continue;
        }
        size_t vs = k + 1, ve;
        if (vs < n && cs[vs] == '{') {
            vs++;
            ve = vs;
            while (ve < n && cs[ve] != '}')
                ve++;
        } else {
            ve = vs;
            while (ve < n && cs[ve] != ';')
                ve++;
        }
        size_t kl = k - i;
        while (kl > 0 && cs[i] == ' ') {
            i++;
            kl--;
        }
        if (kl == 8 && strncasecmp(cs + i, "database", 8) == 0) {
            size_t l = ve - vs < outlen - 1 ? ve - vs : outlen - 1;
            memcpy(out, cs + vs, l);
            out[l] = '\0';
        }
        i = ve + (ve < n && cs[ve] == '}' ? 1 : 0);
        while (i < n && cs[i] != ';')
            i++;
        i++;
    }
}

EXPORT SQLRETURN SQL_API SQLDriverConnect(SQLHDBC h, SQLHWND win, SQLCHAR *in, SQLSMALLINT inlen,
                                          SQLCHAR *out, SQLSMALLINT outmax, SQLSMALLINT *outlen,
                                          SQLUSMALLINT completion)
{
    rdbc *c = h;
    (void)win;
    (void)completion;
    size_t n = inlen == SQL_NTS ? strlen((const char *)in) : (size_t)inlen;
    conn_db((const char *)in, n, c->db, sizeof c->db);
    c->connected = 1;
    if (out && outmax > 0) {
        size_t l = n < (size_t)outmax - 1 ? n : (size_t)outmax - 1;
        memcpy(out, in, l);
        out[l] = '\0';
    }
    if (outlen)
        *outlen = (SQLSMALLINT)n;
    sbuf b = { 0 };
    sb_printf(&b, "{\"pid\":%ld,\"conn\":%d,\"ev\":\"connect\",\"db\":", (long)getpid(), c->id);
    sb_json(&b, c->db, strlen(c->db));
    sb_put(&b, "}", 1);
    log_line(&b);
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLConnect(SQLHDBC h, SQLCHAR *dsn, SQLSMALLINT dl, SQLCHAR *uid,
                                    SQLSMALLINT ul, SQLCHAR *pwd, SQLSMALLINT pl)
{
    rdbc *c = h;
    (void)dsn; (void)dl; (void)uid; (void)ul; (void)pwd; (void)pl;
    c->connected = 1;
    snprintf(c->db, sizeof c->db, "master");
    log_event(c, "connect", NULL);
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLDisconnect(SQLHDBC h)
{
    rdbc *c = h;
    c->connected = 0;
    log_event(c, "disconnect", NULL);
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLSetConnectAttr(SQLHDBC h, SQLINTEGER attr, SQLPOINTER v,
                                           SQLINTEGER len)
{
    rdbc *c = h;
    (void)len;
    if (attr == SQL_ATTR_AUTOCOMMIT) {
        c->autocommit = (SQLULEN)(uintptr_t)v;
        char extra[64];
        snprintf(extra, sizeof extra, ",\"autocommit\":%lu", (unsigned long)c->autocommit);
        log_event(c, "autocommit", extra);
    }
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLGetConnectAttr(SQLHDBC h, SQLINTEGER attr, SQLPOINTER v,
                                           SQLINTEGER buflen, SQLINTEGER *outlen)
{
    rdbc *c = h;
    switch (attr) {
    case SQL_ATTR_AUTOCOMMIT:
        if (v)
            *(SQLULEN *)v = c->autocommit;
        return SQL_SUCCESS;
    case SQL_ATTR_CURRENT_CATALOG:
        if (v && buflen > 0)
            snprintf(v, (size_t)buflen, "%s", c->db);
        if (outlen)
            *outlen = (SQLINTEGER)strlen(c->db);
        return SQL_SUCCESS;
    case SQL_ATTR_CONNECTION_DEAD:
        if (v)
            *(SQLUINTEGER *)v = SQL_CD_FALSE;
        return SQL_SUCCESS;
    default:
        if (v)
            *(SQLUINTEGER *)v = 0;
        return SQL_SUCCESS;
    }
}

static SQLRETURN put_str(SQLPOINTER v, SQLSMALLINT buflen, SQLSMALLINT *len, const char *s)
{
    if (v && buflen > 0)
        snprintf(v, (size_t)buflen, "%s", s);
    if (len)
        *len = (SQLSMALLINT)strlen(s);
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLGetInfo(SQLHDBC h, SQLUSMALLINT type, SQLPOINTER v, SQLSMALLINT buflen,
                                    SQLSMALLINT *len)
{
    (void)h;
    const char *dbms = getenv("OUTBOX_REC_DBMS");
    switch (type) {
    case SQL_DBMS_NAME:
        return put_str(v, buflen, len, dbms && *dbms ? dbms : "Microsoft SQL Server");
    case SQL_DBMS_VER:
        return put_str(v, buflen, len, "16.00.1000");
    case SQL_DRIVER_NAME:
        return put_str(v, buflen, len, "librecdrv.so");
    case SQL_DRIVER_VER:
        return put_str(v, buflen, len, "01.00.0000");
    case SQL_DRIVER_ODBC_VER:
        return put_str(v, buflen, len, "03.80");
    case SQL_CURSOR_COMMIT_BEHAVIOR:
    case SQL_CURSOR_ROLLBACK_BEHAVIOR:
        if (v)
            *(SQLUSMALLINT *)v = SQL_CB_PRESERVE;
        return SQL_SUCCESS;
    case SQL_TXN_CAPABLE:
        if (v)
            *(SQLUSMALLINT *)v = SQL_TC_ALL;
        return SQL_SUCCESS;
    case SQL_MAX_CONCURRENT_ACTIVITIES:
    case SQL_MAX_DRIVER_CONNECTIONS:
        if (v)
            *(SQLUSMALLINT *)v = 0;
        return SQL_SUCCESS;
    case SQL_GETDATA_EXTENSIONS:
        if (v)
            *(SQLUINTEGER *)v = SQL_GD_ANY_COLUMN | SQL_GD_ANY_ORDER;
        return SQL_SUCCESS;
    default:
        if (v && buflen >= 4)
            memset(v, 0, 4);
        if (len)
            *len = 0;
        return SQL_SUCCESS;
    }
}

EXPORT SQLRETURN SQL_API SQLEndTran(SQLSMALLINT type, SQLHANDLE h, SQLSMALLINT op)
{
    char extra[32];
    snprintf(extra, sizeof extra, ",\"commit\":%d", op == SQL_COMMIT);
    log_event(type == SQL_HANDLE_DBC ? h : NULL, "endtran", extra);
    return SQL_SUCCESS;
}

/* ------------------------------------------------------------ statements */

EXPORT SQLRETURN SQL_API SQLSetStmtAttr(SQLHSTMT h, SQLINTEGER attr, SQLPOINTER v, SQLINTEGER len)
{
    (void)h; (void)attr; (void)v; (void)len;
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLGetStmtAttr(SQLHSTMT h, SQLINTEGER attr, SQLPOINTER v,
                                        SQLINTEGER buflen, SQLINTEGER *outlen)
{
    rstmt *s = h;
    (void)buflen;
    if (outlen)
        *outlen = sizeof(SQLPOINTER);
    if (!v)
        return SQL_SUCCESS;
    switch (attr) {
    case SQL_ATTR_APP_ROW_DESC:   *(SQLPOINTER *)v = &s->desc[0]; break;
    case SQL_ATTR_APP_PARAM_DESC: *(SQLPOINTER *)v = &s->desc[1]; break;
    case SQL_ATTR_IMP_ROW_DESC:   *(SQLPOINTER *)v = &s->desc[2]; break;
    case SQL_ATTR_IMP_PARAM_DESC: *(SQLPOINTER *)v = &s->desc[3]; break;
    default:                      *(SQLULEN *)v = 0; break;
    }
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLBindParameter(SQLHSTMT h, SQLUSMALLINT n, SQLSMALLINT io,
                                          SQLSMALLINT ctype, SQLSMALLINT stype, SQLULEN size,
                                          SQLSMALLINT digits, SQLPOINTER val, SQLLEN buflen,
                                          SQLLEN *ind)
{
    rstmt *s = h;
    if (n == 0) {
        diag_set(&s->d, "07009", 0, "recorder: parameter number 0");
        return SQL_ERROR;
    }
    if (n > s->np) {
        int np = n > 2 * s->np ? n : 2 * s->np;
        rparam *p = realloc(s->p, (size_t)np * sizeof *p);
        if (!p)
            return SQL_ERROR;
        memset(p + s->np, 0, (size_t)(np - s->np) * sizeof *p);
        s->p = p;
        s->np = np;
    }
    rparam *p = &s->p[n - 1];
    p->bound = 1;
    p->io = io;
    p->ctype = ctype;
    p->stype = stype;
    p->size = size;
    p->digits = digits;
    p->val = val;
    p->buflen = buflen;
    p->ind = ind;
    return SQL_SUCCESS;
}

/* Case-insensitive substring test. */
static int has_word(const char *sql, const char *w)
{
    size_t n = strlen(w);
    for (const char *p = sql; *p; p++)
        if (strncasecmp(p, w, n) == 0)
            return 1;
    return 0;
}

static SQLRETURN execute(rstmt *s, const char *sql)
{
    stmt_reset_results(s);
    s->d.set = 0;
    long seq;
    pthread_mutex_lock(&mu);
    seq = ++exec_seq;
    pthread_mutex_unlock(&mu);

    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    sbuf b = { 0 };
    sb_printf(&b, "{\"pid\":%ld,\"conn\":%d,\"ev\":\"exec\",\"seq\":%ld,\"autocommit\":%lu,"
              "\"ms\":%lld,\"sql\":", (long)getpid(), s->dbc ? s->dbc->id : 0, seq,
              (unsigned long)(s->dbc ? s->dbc->autocommit : 0),
              (long long)now.tv_sec * 1000 + now.tv_nsec / 1000000);
    sb_json(&b, sql, strlen(sql));
    sb_put(&b, ",\"params\":[", 11);
    int last = 0;
    for (int i = 0; i < s->np; i++)
        if (s->p[i].bound)
            last = i + 1;
    for (int i = 0; i < last; i++) {
        const rparam *p = &s->p[i];
        long len = p->ind ? (long)*p->ind : (long)p->buflen;
        if (!p->bound)
            sb_printf(&b, "%s null", i ? "," : "");
        else
            sb_printf(&b, "%s{\"n\":%d,\"ctype\":%d,\"stype\":%d,\"size\":%lu,\"digits\":%d,"
                      "\"len\":%ld}", i ? "," : "", i + 1, p->ctype, p->stype,
                      (unsigned long)p->size, p->digits, len);
    }
    sb_put(&b, "]}", 2);
    log_line(&b);
    s->nparams = last;

    const char *fail = getenv("OUTBOX_REC_FAIL");
    if (fail && *fail && strstr(sql, fail)) {
        const char *nth = getenv("OUTBOX_REC_FAIL_NTH");
        long want = nth && *nth ? atol(nth) : 1;
        int onwards = nth && *nth && nth[strlen(nth) - 1] == '+';
        const char *st = getenv("OUTBOX_REC_FAIL_STATE"), *nat = getenv("OUTBOX_REC_FAIL_NATIVE");
        long seen;
        pthread_mutex_lock(&mu);
        seen = ++fail_seen;
        pthread_mutex_unlock(&mu);
        if (seen == want || (onwards && seen > want)) {
            diag_set(&s->d, st && *st ? st : "42000", nat && *nat ? atol(nat) : 50000,
                     "[recorder] injected failure");
            log_event(s->dbc, "failed", NULL);
            return SQL_ERROR;
        }
    }
    s->compat = strstr(sql, "compatibility_level") != NULL;
    if (has_word(sql, "SELECT") || has_word(sql, "OUTPUT") || has_word(sql, "EXEC")) {
        const char *rows = getenv("OUTBOX_REC_ROWS");
        s->has_rs = 1;
        s->rows_left = rows && *rows ? atol(rows) : 1;
    }
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLExecDirect(SQLHSTMT h, SQLCHAR *sql, SQLINTEGER len)
{
    rstmt *s = h;
    size_t n = len == SQL_NTS ? strlen((const char *)sql) : (size_t)len;
    char *t = malloc(n + 1);
    if (!t)
        return SQL_ERROR;
    memcpy(t, sql, n);
    t[n] = '\0';
    SQLRETURN r = execute(s, t);
    free(t);
    return r;
}

EXPORT SQLRETURN SQL_API SQLPrepare(SQLHSTMT h, SQLCHAR *sql, SQLINTEGER len)
{
    rstmt *s = h;
    size_t n = len == SQL_NTS ? strlen((const char *)sql) : (size_t)len;
    free(s->sql);
    if (!(s->sql = malloc(n + 1)))
        return SQL_ERROR;
    memcpy(s->sql, sql, n);
    s->sql[n] = '\0';
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLExecute(SQLHSTMT h)
{
    rstmt *s = h;
    if (!s->sql) {
        diag_set(&s->d, "HY010", 0, "[recorder] SQLExecute without SQLPrepare");
        return SQL_ERROR;
    }
    return execute(s, s->sql);
}

EXPORT SQLRETURN SQL_API SQLNumResultCols(SQLHSTMT h, SQLSMALLINT *n)
{
    rstmt *s = h;
    if (n)
        *n = s->has_rs ? NCOLS : 0;
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLRowCount(SQLHSTMT h, SQLLEN *n)
{
    (void)h;
    if (n)
        *n = 1;
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLFetch(SQLHSTMT h)
{
    rstmt *s = h;
    if (!s->has_rs || s->rows_left <= 0)
        return SQL_NO_DATA;
    s->rows_left--;
    s->on_row++;
    memset(s->col_read, 0, sizeof s->col_read);
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLMoreResults(SQLHSTMT h)
{
    stmt_reset_results(h);
    return SQL_NO_DATA;
}

EXPORT SQLRETURN SQL_API SQLCloseCursor(SQLHSTMT h)
{
    stmt_reset_results(h);
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLCancel(SQLHSTMT h)
{
    (void)h;
    return SQL_SUCCESS;
}

EXPORT SQLRETURN SQL_API SQLGetData(SQLHSTMT h, SQLUSMALLINT col, SQLSMALLINT ctype,
                                    SQLPOINTER v, SQLLEN buflen, SQLLEN *ind)
{
    rstmt *s = h;
    if (!s->has_rs || s->on_row == 0 || col < 1 || col > NCOLS) {
        diag_set(&s->d, "07009", 0, "[recorder] invalid column or no row");
        return SQL_ERROR;
    }
    if (s->col_read[col])
        return SQL_NO_DATA;
    s->col_read[col] = 1;
    const char *iv = getenv("OUTBOX_REC_INT");
    long long num = 1;
    if (iv && strncmp(iv, "params/", 7) == 0)
        num = atoll(iv + 7) > 0 ? s->nparams / atoll(iv + 7) : 0;
    else if (iv && *iv)
        num = atoll(iv);
    if (s->compat) {   /* the database's compatibility level: OUTBOX_REC_COMPAT, else 130 */
        const char *cv = getenv("OUTBOX_REC_COMPAT");
        num = cv && *cv ? atoll(cv) : 130;
    }
    const char *text = col == 2 ? "00000000-0000-4000-8000-00000000000" : "x";
    char tbuf[64];
    if (col == 2) {
        snprintf(tbuf, sizeof tbuf, "%s%d", text, s->on_row % 10);
        text = tbuf;
    }
    switch (ctype) {
    case SQL_C_SBIGINT:
        *(SQLBIGINT *)v = num;
        if (ind)
            *ind = sizeof(SQLBIGINT);
        return SQL_SUCCESS;
    case SQL_C_SLONG:
    case SQL_C_LONG:
        *(SQLINTEGER *)v = (SQLINTEGER)num;
        if (ind)
            *ind = sizeof(SQLINTEGER);
        return SQL_SUCCESS;
    case SQL_C_DOUBLE:
        *(double *)v = 1.5;
        if (ind)
            *ind = sizeof(double);
        return SQL_SUCCESS;
    case SQL_C_WCHAR: {
        size_t n = strlen(text);
        SQLWCHAR *w = v;
        size_t room = buflen > 0 ? (size_t)buflen / sizeof(SQLWCHAR) : 0;
        if (room == 0)
            return SQL_ERROR;
        size_t k = n < room - 1 ? n : room - 1;
        for (size_t i = 0; i < k; i++)
            w[i] = (SQLWCHAR)(unsigned char)text[i];
        w[k] = 0;
        if (ind)
            *ind = (SQLLEN)(n * sizeof(SQLWCHAR));
        return SQL_SUCCESS;
    }
    case SQL_C_CHAR:
        if (buflen > 0)
            snprintf(v, (size_t)buflen, "%s", col == 2 ? text : "1");
        if (ind)
            *ind = (SQLLEN)strlen(col == 2 ? text : "1");
        return SQL_SUCCESS;
    case SQL_C_BINARY:
        if (buflen > 0)
            *(char *)v = 'p';
        if (ind)
            *ind = 1;
        return SQL_SUCCESS;
    default:
        diag_set(&s->d, "HYC00", 0, "[recorder] unsupported C type");
        return SQL_ERROR;
    }
}
