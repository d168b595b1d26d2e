/*
 * odbc.c — liboutbox over ODBC. SQL Server gets T-SQL; PostgreSQL through
 * psqlODBC gets INSERT ... ON CONFLICT DO NOTHING. The caller's transaction
 * (autocommit off) is used as it is: this file never calls SQLEndTran and
 * never changes connection attributes or the session's SET options.
 *
 * Duplicates on SQL Server. A duplicate message_id must come back as
 * OUTBOX_DUPLICATE with the caller's transaction intact, and concurrent
 * producers must never wait for each other's transactions unless they write
 * the same message_id. Two ways were weighed:
 *   - a unique index WITH (IGNORE_DUP_KEY = ON) and @@ROWCOUNT: rejected.
 *     To ignore duplicates SQL Server takes RangeS-U key-range locks on that
 *     index for every INSERT, at any isolation level (also READ COMMITTED
 *     SNAPSHOT), so producers inserting neighbouring (random) UUIDs block and
 *     deadlock each other: the serialization this code must not cause. It would
 *     also turn every other writer's duplicate into a silent warning.
 *   - TRY/CATCH on 2601/2627: chosen. The INSERT skips ids already committed
 *     (NOT EXISTS, a plain READCOMMITTEDLOCK probe: a shared key lock held for
 *     the duration of the read only, no range locks; it waits only for an
 *     uncommitted row with the same message_id, which the INSERT would wait for
 *     anyway) and a unique violation of the message_id constraint that races
 *     past the probe is caught and the INSERT re-run (each re-run sees the row
 *     that caused it). Under XACT_ABORT ON a caught error would still doom the
 *     caller's transaction, so the batch runs inside sp_executesql with
 *     SET XACT_ABORT OFF: SQL Server restores every SET option changed in a
 *     dynamic batch when it returns, so the caller's settings are untouched.
 *     The same dynamic batch sets the options DML on a table with filtered
 *     indexes needs (QUOTED_IDENTIFIER, ANSI_NULLS, ...), restored likewise.
 * No UPDLOCK, HOLDLOCK or SERIALIZABLE read is ever issued on this path
 * (tests/test_tsql_capture.py checks every statement).
 *
 * Parameters are bound with sizes that depend only on the column, never on the
 * data (nvarchar(255) for the short texts, nvarchar(max) for the headers,
 * varbinary(max) for the payload, char(36) for the UUID): one plan per batch
 * size, not one per length mix.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sql.h>
#include <sqlext.h>

#include "outbox.h"
#include "outbox_internal.h"
#include "outbox_odbc.h"
#include "outbox_pgsql.h"

#define OD_TEXTS       7     /* exchange .. headers, bound as UTF-16 */
#define PG_COLS        OUTBOX_PG_INSERT_COLS
/* psqlODBC numbers parameters with a signed short: at most 32767 */
#define PG_CHUNK_ROWS  (32767 / PG_COLS)
#define MS_COLS        11
#define MS_MAX_PARAMS  2000  /* SQL Server allows 2100 per request; keep a margin */
#define MS_CHUNK_ROWS  (MS_MAX_PARAMS / MS_COLS)
#define SHORT_CHARS    255   /* nvarchar(255): exchange .. correlation_id */
#define LEN_MAX        0     /* column size 0: nvarchar(max) / varbinary(max)
                                (SQL_SS_LENGTH_UNLIMITED of msodbcsql) */
/* FreeTDS's driver (libtdsodbc) takes a SQL_VARBINARY / SQL_WVARCHAR parameter's column
   size as the most it sends (0: an empty payload) and never sends more than a
   non-(max) type holds (8,000 bytes, 4,000 characters): silently cut. It sends
   varbinary(max) / nvarchar(max) (TDS 7.2 and later) for SQL_LONGVARBINARY /
   SQL_WLONGVARCHAR, which msodbcsql would send as the legacy image / ntext instead. So
   the (max) parameters are bound per driver (od_call.lob), each with a size that does
   not depend on the data. */
#define FREETDS_LOB_SIZE 1073741823
#define SAVEPOINT      "outbox_send_batch"

typedef struct od_row {
    SQLWCHAR  *w[OD_TEXTS];   /* owned; NULL = SQL NULL */
    SQLLEN     wind[OD_TEXTS];
    SQLULEN    wchars[OD_TEXTS];
    SQLLEN     id_ind;
    SQLLEN     pay_ind;
    SQLBIGINT  delay;         /* PostgreSQL: milliseconds */
    SQLINTEGER dmin, dms;     /* SQL Server: DATEADD's int limit */
    SQLLEN     num_ind;
} od_row;

typedef struct od_lob {      /* how the (max) parameters are bound (see LEN_MAX) */
    SQLSMALLINT text_type, bin_type;
    SQLULEN     size;
} od_lob;

typedef struct od_call {
    SQLHDBC             c;
    const outbox_queue *q;
    int                 mssql;
    od_lob              lob;
    outbox_error       *err;
} od_call;

static const unsigned char empty_byte[1] = { 0 };

/* Text goes to and comes from the driver as UTF-16 (SQL_C_WCHAR), converted by
   lib/util.c (iconv). */
_Static_assert(sizeof(SQLWCHAR) == sizeof(uint16_t), "SQLWCHAR is a UTF-16 unit");

/* ----------------------------------------------------------- diagnostics */

/* SQL Server: XACT_STATE() and @@TRANCOUNT of the session, read after a failed
 * statement (the query reads no table, so it starts no implicit transaction).
 * 0 on success. */
static int od_txn_state(const od_call *cl, long *xact_state, long *trancount)
{
    SQLHSTMT st = SQL_NULL_HSTMT;
    SQLINTEGER xs = 0, tc = 0;
    SQLLEN i1 = 0, i2 = 0;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_STMT, cl->c, &st)))
        return -1;
    SQLRETURN r = SQLExecDirect(st, (SQLCHAR *)(uintptr_t)"SELECT XACT_STATE(), @@TRANCOUNT",
                                SQL_NTS);
    if (SQL_SUCCEEDED(r))
        r = SQLFetch(st);
    if (SQL_SUCCEEDED(r))
        r = SQLGetData(st, 1, SQL_C_SLONG, &xs, 0, &i1);
    if (SQL_SUCCEEDED(r))
        r = SQLGetData(st, 2, SQL_C_SLONG, &tc, 0, &i2);
    SQLFreeHandle(SQL_HANDLE_STMT, st);
    if (!SQL_SUCCEEDED(r) || i1 == SQL_NULL_DATA || i2 == SQL_NULL_DATA)
        return -1;
    *xact_state = xs;
    *trancount = tc;
    return 0;
}

/* Maps the diagnostics of handle h to a status code and message.
 *
 * SQL Server: after a failed statement the caller's transaction may be gone
 * although the error is an ordinary one. A deadlock victim (1205), an error under
 * the caller's XACT_ABORT ON, or an error in a trigger (triggers run with
 * XACT_ABORT ON) rolls the whole transaction back or dooms it (XACT_STATE() -1:
 * only a rollback is allowed); with autocommit off (IMPLICIT_TRANSACTIONS ON) the
 * caller's next statement would silently start a new transaction and commit
 * whatever follows on its own. So after any failed statement the session is asked
 * (od_txn_state): doomed (-1) or no transaction (0) is OUTBOX_ETXNLOST. No
 * transaction after a failure can also mean that the failing statement was the
 * first of the transaction and never started it; nothing else was lost then, and
 * rolling back and retrying is still the right answer. */
static int od_fail(const od_call *cl, SQLSMALLINT type, SQLHANDLE h, const char *what)
{
    SQLCHAR state[6] = "", first_state[6] = "";
    SQLCHAR text[600], first_text[600] = "";
    SQLINTEGER native = 0, first_native = 0;
    SQLSMALLINT len;
    int noschema = 0, notxn = 0, notopen = 0;
    for (SQLSMALLINT i = 1; i <= 20; i++) {
        SQLRETURN r = SQLGetDiagRec(type, h, i, state, &native, text, sizeof text, &len);
        if (!SQL_SUCCEEDED(r))
            break;
        if (i == 1) {
            memcpy(first_state, state, sizeof state);
            snprintf((char *)first_text, sizeof first_text, "%s", (char *)text);
            first_native = native;
        }
        const char *s = (const char *)state;
        /* a missing table: 208 on SQL Server; Babelfish (PostgreSQL under T-SQL) says
           33557097 with PostgreSQL's text */
        if (strcmp(s, "42S02") == 0 || strcmp(s, "42P01") == 0 || strcmp(s, "3F000") == 0 ||
            (cl->mssql && (native == 208 ||
                           (native == 33557097 && strstr((char *)text, "relation \"") &&
                            strstr((char *)text, "\" does not exist")))))
            noschema = 1;
        if (strcmp(s, "25P02") == 0 || (cl->mssql && (native == 51000 || native == 3930)))
            notxn = 1;
        if (strcmp(s, "08003") == 0)   /* never connected, or disconnected */
            notopen = 1;
    }
    const char *st = (const char *)first_state;
    const char *tx = first_text[0] ? (const char *)first_text : "no diagnostic record";
    const char *table = cl->mssql ? cl->q->ms_table : cl->q->pg_table;
    if (notopen)
        return outbox_i_err(cl->err, OUTBOX_ENOTXN, st,
                            "not inside an open transaction: the connection is not open (%s); "
                            "nothing written", tx);
    if (notxn)
        return outbox_i_err(cl->err, OUTBOX_ENOTXN, st,
                            "the transaction is aborted or doomed: roll it back (server: %s)",
                            tx);
    if (noschema)
        return outbox_i_err(cl->err, OUTBOX_ENOSCHEMA, st,
                            "outbox table %s does not exist: run outbox-relay init "
                            "(server: %s)", table, tx);
    long xs = 1, tc = 1;
    if (cl->mssql && type == SQL_HANDLE_STMT)
        (void)SQLFreeStmt((SQLHSTMT)h, SQL_CLOSE);  /* best effort: results still pending
                                                       would keep the connection busy */
    if (cl->mssql && type == SQL_HANDLE_STMT && od_txn_state(cl, &xs, &tc) == 0 &&
        (xs == -1 || xs == 0 || tc == 0))
        return outbox_i_err(cl->err, OUTBOX_ETXNLOST, st,
                            "%s %s failed and the server %s the transaction (XACT_STATE() %ld, "
                            "@@TRANCOUNT %ld): roll back and retry the whole transaction "
                            "(native %ld: %s)", what, table,
                            xs == -1 ? "doomed" : "rolled back", xs, tc, (long)first_native, tx);
    return outbox_i_err(cl->err, OUTBOX_EDB, st, "%s %s failed: SQLSTATE %s (native %ld): %s",
                        what, table, st[0] ? st : "-----", (long)first_native, tx);
}

/* Runs one statement without parameters on a fresh handle. */
static int od_exec(const od_call *cl, const char *sql, const char *what)
{
    SQLHSTMT st = SQL_NULL_HSTMT;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_STMT, cl->c, &st)))
        return od_fail(cl, SQL_HANDLE_DBC, cl->c, "allocating a statement for");
    SQLRETURN r = SQLExecDirect(st, (SQLCHAR *)(uintptr_t)sql, SQL_NTS);
    int rc = OUTBOX_OK;
    if (!SQL_SUCCEEDED(r) && r != SQL_NO_DATA)
        rc = od_fail(cl, SQL_HANDLE_STMT, st, what);
    while (rc == OUTBOX_OK) {
        r = SQLMoreResults(st);
        if (r == SQL_NO_DATA)
            break;
        if (!SQL_SUCCEEDED(r))
            rc = od_fail(cl, SQL_HANDLE_STMT, st, what);
    }
    SQLFreeHandle(SQL_HANDLE_STMT, st);
    return rc;
}

/* ----------------------------------------------------------------- checks */

static int od_dbname(const od_call *cl, char *out, size_t outlen)
{
    SQLWCHAR w[512];
    char a[512];
    SQLINTEGER len = 0;
    out[0] = '\0';
    /* The ANSI attribute is trusted only when it is plain ASCII: drivers differ in
       how they encode it (psqlODBC's W variant returns bytes, not UTF-16). */
    SQLRETURN r = SQLGetConnectAttr(cl->c, SQL_ATTR_CURRENT_CATALOG, a, (SQLINTEGER)sizeof a,
                                    &len);
    if (SQL_SUCCEEDED(r) && len > 0 && (size_t)len < sizeof a) {
        int ascii = 1;
        a[len] = '\0';
        for (SQLINTEGER i = 0; i < len; i++)
            if ((unsigned char)a[i] >= 0x80 || a[i] == '\0')
                ascii = 0;
        if (ascii && strlen(a) < outlen) {
            memcpy(out, a, strlen(a) + 1);
            return OUTBOX_OK;
        }
    }
    /* fallback: ask the server */
    SQLHSTMT st = SQL_NULL_HSTMT;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_STMT, cl->c, &st)))
        return od_fail(cl, SQL_HANDLE_DBC, cl->c, "allocating a statement for");
    const char *sql = cl->mssql ? "SELECT DB_NAME()" : "SELECT current_database()";
    SQLLEN ind = 0;
    int rc = OUTBOX_OK;
    r = SQLExecDirect(st, (SQLCHAR *)(uintptr_t)sql, SQL_NTS);
    if (SQL_SUCCEEDED(r))
        r = SQLFetch(st);
    if (SQL_SUCCEEDED(r))
        r = SQLGetData(st, 1, SQL_C_WCHAR, w, sizeof w - sizeof w[0], &ind);
    if (!SQL_SUCCEEDED(r))
        rc = od_fail(cl, SQL_HANDLE_STMT, st, "reading the database name of");
    else if (ind > 0) {
        size_t n = (size_t)ind / sizeof w[0], k = 0, keep;
        outbox_util_buf b = { 0 };
        if (n > sizeof w / sizeof w[0] - 1)
            n = sizeof w / sizeof w[0] - 1;   /* truncated by the driver */
        while (k < n && w[k])
            k++;
        if (outbox_util_utf16_to_utf8(&b, w, k) != 0) {
            rc = outbox_i_err(cl->err, OUTBOX_ENOMEM, NULL,
                              "out of memory reading the database name");
        } else {
            /* the longest whole-character prefix that fits */
            keep = b.len < outlen ? b.len : outlen - 1;
            while (keep > 0 && keep < b.len && ((unsigned char)b.p[keep] & 0xC0u) == 0x80u)
                keep--;
            memcpy(out, b.p, keep);
            out[keep] = '\0';
        }
        outbox_util_buf_free(&b);
    }
    SQLFreeHandle(SQL_HANDLE_STMT, st);
    return rc;
}

/* ------------------------------------------------------------------ binds */

static void rows_free(od_row *rows, size_t n)
{
    if (!rows)
        return;
    for (size_t i = 0; i < n; i++)
        for (int k = 0; k < OD_TEXTS; k++)
            free(rows[i].w[k]);
    free(rows);
}

static od_row *rows_make(outbox_i_msg *const *u, size_t nu)
{
    od_row *rows = calloc(nu, sizeof *rows);
    if (!rows)
        return NULL;
    for (size_t i = 0; i < nu; i++) {
        const outbox_message *m = u[i]->m;
        const char *t[OD_TEXTS] = { m->exchange ? m->exchange : "", m->routing_key,
                                    m->partition_key, m->message_type, m->content_type,
                                    m->correlation_id, u[i]->headers_json };
        od_row *r = &rows[i];
        for (int k = 0; k < OD_TEXTS; k++) {
            if (!t[k]) {
                r->wind[k] = SQL_NULL_DATA;
                continue;
            }
            size_t units = 0;
            r->w[k] = outbox_util_utf16_from_utf8(t[k], strlen(t[k]), &units);  /* valid UTF-8 */
            if (!r->w[k]) {
                rows_free(rows, nu);
                return NULL;
            }
            r->wind[k] = (SQLLEN)(units * sizeof(SQLWCHAR));
            r->wchars[k] = units;
        }
        r->id_ind = 36;
        r->pay_ind = (SQLLEN)m->payload_len;
        r->delay = (SQLBIGINT)u[i]->delay_ms;
        r->dmin = (SQLINTEGER)(u[i]->delay_ms / 60000u);
        r->dms = (SQLINTEGER)(u[i]->delay_ms % 60000u);
        r->num_ind = 0;
    }
    return rows; /* caller frees with rows_free */
}

/* Text k of a row: nvarchar(255), or nvarchar(max) for the headers (k == 6),
 * whatever the data's length (SQL_NULL_DATA binds the same type). */
static SQLRETURN bind_text(SQLHSTMT st, SQLUSMALLINT p, od_row *r, int k, const od_lob *lob)
{
    int big = k == OD_TEXTS - 1;
    return SQLBindParameter(st, p, SQL_PARAM_INPUT, SQL_C_WCHAR,
                            big ? lob->text_type : SQL_WVARCHAR, big ? lob->size : SHORT_CHARS,
                            0, r->w[k], r->w[k] ? r->wind[k] : 0, &r->wind[k]);
}

/* Binds one row's parameters, numbered from p. */
static SQLRETURN bind_row(SQLHSTMT st, SQLUSMALLINT p, od_row *r, const outbox_i_msg *v,
                          const od_call *cl)
{
    int mssql = cl->mssql;
    const outbox_message *m = v->m;
    SQLRETURN rc = SQLBindParameter(st, p++, SQL_PARAM_INPUT, SQL_C_CHAR, SQL_CHAR, 36, 0,
                                    (SQLPOINTER)(uintptr_t)v->message_id, 37, &r->id_ind);
    for (int k = 0; k < OD_TEXTS && SQL_SUCCEEDED(rc); k++)
        rc = bind_text(st, p++, r, k, &cl->lob);
    if (!SQL_SUCCEEDED(rc))
        return rc;
    /* varbinary(max): SQL_VARBINARY with column size 0, never SQL_LONGVARBINARY (image),
       except on FreeTDS (see LEN_MAX) */
    const void *pay = m->payload_len ? m->payload : empty_byte;
    rc = SQLBindParameter(st, p++, SQL_PARAM_INPUT, SQL_C_BINARY, cl->lob.bin_type,
                          cl->lob.size, 0, (SQLPOINTER)(uintptr_t)pay, r->pay_ind, &r->pay_ind);
    if (!SQL_SUCCEEDED(rc))
        return rc;
    if (mssql) {
        rc = SQLBindParameter(st, p++, SQL_PARAM_INPUT, SQL_C_SLONG, SQL_INTEGER, 0, 0,
                              &r->dmin, 0, &r->num_ind);
        if (SQL_SUCCEEDED(rc))
            rc = SQLBindParameter(st, p++, SQL_PARAM_INPUT, SQL_C_SLONG, SQL_INTEGER, 0, 0,
                                  &r->dms, 0, &r->num_ind);
        return rc;
    }
    return SQLBindParameter(st, p, SQL_PARAM_INPUT, SQL_C_SBIGINT, SQL_BIGINT, 0, 0,
                            &r->delay, 0, &r->num_ind);
}

/* Binds rows [0, nrows) of rows/u as parameters 1.. of st. Last row first: drivers
 * that grow their binding array to the highest number seen (psqlODBC) then allocate
 * once instead of once per parameter. */
static SQLRETURN bind_rows(SQLHSTMT st, od_row *rows, outbox_i_msg *const *u, size_t nrows,
                           const od_call *cl)
{
    size_t cols = cl->mssql ? MS_COLS : PG_COLS;
    for (size_t i = nrows; i-- > 0;) {
        SQLRETURN rc = bind_row(st, (SQLUSMALLINT)(i * cols + 1), &rows[i], u[i], cl);
        if (!SQL_SUCCEEDED(rc))
            return rc;
    }
    return SQL_SUCCESS;
}

/* ------------------------------------------------------------------- SQL */

static const char *const columns =
    "(message_id, exchange, routing_key, partition_key, message_type, content_type, "
    "correlation_id, headers, payload, available_at)";

/* The PostgreSQL INSERT of lib/pgsql.c (the libpq path's), its $n turned into `?`;
   the markers come in parameter order, so the rows bind as they are. */
static char *sql_pg(const outbox_queue *q, size_t rows)
{
    char *text = outbox_pg_insert_sql(q->pg_table, rows);
    size_t n = 0, max = rows * PG_COLS;
    int *order = text ? malloc((max ? max : 1) * sizeof *order) : NULL;
    char *sql = order ? outbox_sql_qmarks(text, order, max, &n) : NULL;
    if (sql && n != max) {      /* the text and PG_COLS disagree: a defect here */
        free(sql);
        sql = NULL;
    }
    for (size_t i = 0; sql && i < n; i++)
        if (order[i] != (int)i + 1) {
            free(sql);
            sql = NULL;
        }
    free(order);
    free(text);
    return sql; /* caller frees; NULL: out of memory */
}

/* Appends s as the body of a T-SQL N'...' literal (quotes doubled). */
static void put_nliteral(outbox_util_buf *b, const char *s)
{
    for (const char *q; (q = strchr(s, '\'')) != NULL; s = q + 1) {
        outbox_util_buf_put(b, s, (size_t)(q - s + 1));
        outbox_util_buf_put(b, "'", 1);
    }
    outbox_util_buf_puts(b, s);
}

/* The T-SQL of one chunk of `rows` messages: EXEC sp_executesql of the batch
 * below (see the top of this file for why), with the ODBC parameters passed on
 * as @m1, @x1, ... of the declared, fixed types. */
static char *sql_ms(const outbox_queue *q, size_t rows)
{
    char uniq[64];
    outbox_util_buf in = { 0 }, b = { 0 };
    outbox_derived_name(q->name.table, "message_id_key", uniq);

    outbox_util_buf_printf(&in,
        "SET NOCOUNT ON;\n"
        "SET XACT_ABORT OFF;\n"
        "%s;\n"
        "IF XACT_STATE() = -1 THROW 51000, N'outbox: the transaction is doomed: roll it back', "
        "1;\n"
        "DECLARE @n bigint = -1;\n"
        "DECLARE @tries int = 0;\n"
        "WHILE @n < 0\n"
        "BEGIN\n"
        "    BEGIN TRY\n"
        "        INSERT INTO %s %s\n"
        "        SELECT v.m, v.x, v.r, v.k, v.t, v.c, v.o, v.h, v.b, "
        "DATEADD(millisecond, v.ds, DATEADD(minute, v.dm, SYSUTCDATETIME()))\n"
        "        FROM (VALUES ", outbox_tsql_session_options, q->ms_table, columns);
    for (size_t r = 1; r <= rows; r++)
        outbox_util_buf_printf(&in, "%s(%zu, @m%zu, @x%zu, @r%zu, @k%zu, @t%zu, @c%zu, @o%zu, "
                            "@h%zu, @b%zu, @dm%zu, @ds%zu)", r > 1 ? ", " : "", r, r, r, r, r,
                            r, r, r, r, r, r, r);
    outbox_util_buf_printf(&in,
        ") AS v(rn, m, x, r, k, t, c, o, h, b, dm, ds)\n"
        "        WHERE NOT EXISTS (SELECT 1 FROM %s AS e WITH (READCOMMITTEDLOCK) "
        "WHERE e.message_id = v.m)\n"
        "        ORDER BY v.rn;\n"
        "        SET @n = @@ROWCOUNT;\n"
        "    END TRY\n"
        "    BEGIN CATCH\n"
        "        SET @tries = @tries + 1;\n"
        "        IF ERROR_NUMBER() NOT IN (2601, 2627) OR CHARINDEX(N'%s', ERROR_MESSAGE()) = 0 "
        "OR XACT_STATE() = -1 OR @tries > %zu THROW;\n"
        "    END CATCH;\n"
        "END;\n"
        "SELECT @n AS inserted;", q->ms_table, uniq, rows);

    outbox_util_buf_puts(&b, "EXEC sp_executesql N'");
    if (!in.failed)
        put_nliteral(&b, in.p);
    outbox_util_buf_puts(&b, "', N'");
    for (size_t r = 1; r <= rows; r++)
        outbox_util_buf_printf(&b, "%s@m%zu uniqueidentifier, @x%zu nvarchar(255), "
                            "@r%zu nvarchar(255), @k%zu nvarchar(255), @t%zu nvarchar(255), "
                            "@c%zu nvarchar(255), @o%zu nvarchar(255), @h%zu nvarchar(max), "
                            "@b%zu varbinary(max), @dm%zu int, @ds%zu int", r > 1 ? ", " : "",
                            r, r, r, r, r, r, r, r, r, r, r);
    outbox_util_buf_puts(&b, "'");
    for (size_t i = 0; i < rows * MS_COLS; i++)
        outbox_util_buf_puts(&b, i % MS_COLS ? ", ?" : ",\n    ?");
    outbox_util_buf_puts(&b, ";");
    int failed = in.failed;
    outbox_util_buf_free(&in);
    if (failed || b.failed) {
        outbox_util_buf_free(&b);
        return NULL;
    }
    return b.p; /* caller frees */
}

/* Executes one chunk; adds the inserted row count to *total. */
static int od_chunk(const od_call *cl, od_row *rows, outbox_i_msg *const *u, size_t nrows,
                    size_t *total)
{
    char *sql = cl->mssql ? sql_ms(cl->q, nrows) : sql_pg(cl->q, nrows);
    if (!sql)
        return outbox_i_err(cl->err, OUTBOX_ENOMEM, NULL, "out of memory building the INSERT");
    SQLHSTMT st = SQL_NULL_HSTMT;
    int rc = OUTBOX_OK;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_STMT, cl->c, &st))) {
        rc = od_fail(cl, SQL_HANDLE_DBC, cl->c, "allocating a statement for");
        st = SQL_NULL_HSTMT;
        goto out;
    }
    if (!SQL_SUCCEEDED(bind_rows(st, rows, u, nrows, cl))) {
        rc = od_fail(cl, SQL_HANDLE_STMT, st, "binding parameters for INSERT into");
        goto out;
    }
    SQLRETURN r = SQLExecDirect(st, (SQLCHAR *)sql, SQL_NTS);
    if (!SQL_SUCCEEDED(r) && r != SQL_NO_DATA) {
        rc = od_fail(cl, SQL_HANDLE_STMT, st, "INSERT into");
        goto out;
    }
    if (!cl->mssql) {
        SQLLEN count = 0;
        if (!SQL_SUCCEEDED(SQLRowCount(st, &count))) {
            rc = od_fail(cl, SQL_HANDLE_STMT, st, "reading the row count of INSERT into");
            goto out;
        }
        *total += count > 0 ? (size_t)count : 0;
        goto out;
    }
    /* T-SQL: skip row counts until the SELECT @@ROWCOUNT result set */
    int got = 0;
    for (;;) {
        SQLSMALLINT cols = 0;
        if (SQL_SUCCEEDED(SQLNumResultCols(st, &cols)) && cols > 0 && !got) {
            SQLBIGINT v = 0;
            SQLLEN ind = 0;
            r = SQLFetch(st);
            if (SQL_SUCCEEDED(r))
                r = SQLGetData(st, 1, SQL_C_SBIGINT, &v, 0, &ind);
            if (!SQL_SUCCEEDED(r)) {
                rc = od_fail(cl, SQL_HANDLE_STMT, st, "reading the row count of INSERT into");
                goto out;
            }
            *total += v > 0 ? (size_t)v : 0;
            got = 1;
        }
        r = SQLMoreResults(st);
        if (r == SQL_NO_DATA)
            break;
        if (!SQL_SUCCEEDED(r)) {
            rc = od_fail(cl, SQL_HANDLE_STMT, st, "INSERT into");
            goto out;
        }
    }
    if (!got)
        rc = outbox_i_err(cl->err, OUTBOX_EDB, NULL,
                          "INSERT into %s returned no row count", cl->q->ms_table);
out:
    if (st != SQL_NULL_HSTMT)
        SQLFreeHandle(SQL_HANDLE_STMT, st);
    free(sql);
    return rc;
}

/* Several chunks: wrapped in a savepoint so that a failure leaves nothing written. */
static int od_chunks(const od_call *cl, od_row *rows, outbox_i_msg *const *u, size_t nu,
                     size_t *total)
{
    size_t per = cl->mssql ? MS_CHUNK_ROWS : PG_CHUNK_ROWS;
    char sql[512];
    int rc;
    if (nu <= per)
        return od_chunk(cl, rows, u, nu, total);
    /* T-SQL: with autocommit off the driver runs IMPLICIT_TRANSACTIONS ON, so no
       transaction exists before the first statement that reads or writes a table,
       and SAVE TRANSACTION needs one. A SELECT that reads no table starts none, and
       the optimizer compiles a read that cannot return a row (TOP (0), a NOT NULL
       column IS NULL) into exactly that: a constant scan. So the opener is a real
       seek on the message_id index for the nil UUID, which no generated id is: it
       reads at most one index key and holds no lock after the read. It names
       message_id only, the one column the producer role may SELECT
       (deploy/grants-sqlserver.sql). */
    if (cl->mssql)
        snprintf(sql, sizeof sql,
                 "IF XACT_STATE() = -1 THROW 51000, N'outbox: the transaction is doomed: "
                 "roll it back', 1;\n"
                 "IF @@TRANCOUNT = 0 BEGIN DECLARE @outbox_t int; "
                 "SELECT TOP (1) @outbox_t = 1 FROM %s "
                 "WHERE message_id = '00000000-0000-0000-0000-000000000000'; END;\n"
                 "SAVE TRANSACTION " SAVEPOINT ";", cl->q->ms_table);
    else
        snprintf(sql, sizeof sql, "SAVEPOINT " SAVEPOINT);
    rc = od_exec(cl, sql, "starting a batch on");
    if (rc != OUTBOX_OK)
        return rc;
    for (size_t from = 0; from < nu && rc == OUTBOX_OK; from += per) {
        size_t n = nu - from < per ? nu - from : per;
        rc = od_chunk(cl, rows + from, u + from, n, total);
    }
    /* on failure undo the earlier chunks; the first error (in cl->err) is what counts */
    outbox_error ignored;
    od_call quiet = *cl;
    quiet.err = &ignored;
    if (rc != OUTBOX_OK) {
        *total = 0;
        od_exec(&quiet, cl->mssql ? "IF XACT_STATE() = 1 ROLLBACK TRANSACTION " SAVEPOINT ";"
                                  : "ROLLBACK TO SAVEPOINT " SAVEPOINT, "undoing a batch on");
    }
    if (!cl->mssql) {
        int r2 = od_exec(rc == OUTBOX_OK ? cl : &quiet, "RELEASE SAVEPOINT " SAVEPOINT,
                         "finishing a batch on");
        if (rc == OUTBOX_OK)
            rc = r2;
    }
    return rc;
}

/* ------------------------------------------------------------------- send */

static int od_send(SQLHDBC c, const outbox_queue *q, const outbox_message *m, size_t n,
                   int batch, size_t *inserted, outbox_error *err)
{
    outbox_i_msg *v = NULL;
    outbox_i_msg **u = NULL;
    od_row *rows = NULL;
    size_t nu = 0, total = 0;
    int rc;

    outbox_i_err_clear(err);
    if (inserted)
        *inserted = 0;
    if (c == SQL_NULL_HDBC)
        return outbox_i_err(err, OUTBOX_EINVAL, NULL, "c: NULL connection handle");
    rc = outbox_i_prepare(q, m, n, batch, &v, &nu, err);
    if (rc != OUTBOX_OK)
        return rc;

    od_call cl = { c, q, 0, { SQL_WVARCHAR, SQL_VARBINARY, LEN_MAX }, err };
    char dbms[128] = "";
    SQLSMALLINT dlen = 0;
    if (!SQL_SUCCEEDED(SQLGetInfo(c, SQL_DBMS_NAME, dbms, sizeof dbms, &dlen))) {
        rc = od_fail(&cl, SQL_HANDLE_DBC, c, "reading SQL_DBMS_NAME for");
        goto fail;
    }
    if (strstr(dbms, "SQL Server")) {
        char drv[128] = "";
        SQLSMALLINT drvlen = 0;
        cl.mssql = 1;
        if (!SQL_SUCCEEDED(SQLGetInfo(c, SQL_DRIVER_NAME, drv, sizeof drv, &drvlen))) {
            rc = od_fail(&cl, SQL_HANDLE_DBC, c, "reading SQL_DRIVER_NAME for");
            goto fail;
        }
        if (strstr(drv, "tdsodbc"))
            cl.lob = (od_lob){ SQL_WLONGVARCHAR, SQL_LONGVARBINARY, FREETDS_LOB_SIZE };
    } else if (strcmp(dbms, "PostgreSQL") != 0) {
        rc = outbox_i_err(err, OUTBOX_EINVAL, NULL,
                          "c: unsupported DBMS \"%s\" (Microsoft SQL Server or PostgreSQL)",
                          dbms);
        goto fail;
    }

    SQLULEN ac = 0;
    if (!SQL_SUCCEEDED(SQLGetConnectAttr(c, SQL_ATTR_AUTOCOMMIT, &ac, sizeof ac, NULL))) {
        rc = od_fail(&cl, SQL_HANDLE_DBC, c, "reading SQL_ATTR_AUTOCOMMIT for");
        goto fail;
    }
    if ((ac & 0xFFFFFFFFu) != SQL_AUTOCOMMIT_OFF) {
        rc = outbox_i_err(err, OUTBOX_ENOTXN, NULL,
                          "not inside a transaction: autocommit is on (set "
                          "SQL_ATTR_AUTOCOMMIT to SQL_AUTOCOMMIT_OFF); nothing written");
        goto fail;
    }

    char db[OUTBOX_MAX_DBNAME + 1];
    rc = od_dbname(&cl, db, sizeof db);
    if (rc != OUTBOX_OK)
        goto fail;
    rc = outbox_i_check_dbname(q, db, err);
    if (rc != OUTBOX_OK)
        goto fail;
    if (nu == 0)
        goto done;
    rc = outbox_i_unique(v, n, nu, &u, err);
    if (rc != OUTBOX_OK)
        goto fail;
    rows = rows_make(u, nu);
    if (!rows) {
        rc = outbox_i_err(err, OUTBOX_ENOMEM, NULL, "out of memory (%zu messages)", n);
        goto fail;
    }
    rc = od_chunks(&cl, rows, u, nu, &total);
    if (rc != OUTBOX_OK)
        goto fail;

done:
    if (inserted)
        *inserted = total;
    rc = outbox_i_sent(err, v, n, total, batch, cl.mssql ? q->ms_table : q->pg_table);
fail:
    rows_free(rows, nu);
    free(u);
    outbox_i_msgs_free(v, n);
    return rc;
}

int outbox_odbc_send(SQLHDBC c, const outbox_queue *q, const outbox_message *m,
                     outbox_error *err)
{
    return od_send(c, q, m, 1, 0, NULL, err);
}

int outbox_odbc_send_batch(SQLHDBC c, const outbox_queue *q, const outbox_message *m,
                           size_t n, size_t *inserted, outbox_error *err)
{
    return od_send(c, q, m, n, 1, inserted, err);
}
