/*
 * odbcsrc_db.c — one blocking ODBC session of the ODBC source, running the
 * statements of sources/sql_tsql.c (SQL Server) and sources/sql_pg.c
 * (PostgreSQL through psqlODBC: the libpq source's very text, its $n markers
 * turned into `?`).
 *
 * Table names come only from validated identifier parts and are quoted by
 * outbox_qualified(); every value travels as a parameter. Text travels as
 * UTF-16 (SQL_C_WCHAR) both ways and is converted to/from UTF-8 by lib/util.c
 * (iconv), which is lossless with msodbcsql, FreeTDS and the psqlODBC Unicode
 * driver alike.
 * Every statement carries SQL_ATTR_QUERY_TIMEOUT; the login carries
 * SQL_ATTR_LOGIN_TIMEOUT. Text parameters are bound with sizes that depend on
 * the column only (nvarchar(255) or nvarchar(max)), never on the data, so SQL
 * Server caches one plan per statement.
 *
 * The T-SQL statements, how they read and lock on SQL Server (with
 * READ_COMMITTED_SNAPSHOT off or on) and their parameter tables are in
 * sources/sql_tsql.c; each is bound from its table by name (odbcsrc_stmt.c holds
 * the statement mechanics: binding, execution, results, chunked readers).
 * A failed request is rolled back only while the server still holds its
 * transaction (see rollback()).
 * Every session starts with the SET options the tables need (see
 * odbcsrc_db_open).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include "lib/outbox_util.h"
#include "sources/odbc/odbcsrc_int.h"
#include "sources/sql_pg.h"
#include "sources/sql_tsql.h"

/* Drivers may call setlocale() while connecting and disconnecting (psqlODBC does),
 * which is not thread-safe: with two connections per outbox, each on its own worker
 * thread, concurrent connects read freed locale strings (found by valgrind). Those
 * calls are serialized across the process; a connect is bounded by the login timeout,
 * so one dead server delays other outboxes' connects by at most that, never the loop. */
static pthread_mutex_t driver_setup_lock = PTHREAD_MUTEX_INITIALIZER;

_Static_assert(SRC_SENT == 0 && SRC_RETRY == 1 && SRC_DEAD == 2 && SRC_UNCLAIM == 3,
               "the settle SQL below spells the outcome kinds as numbers");

#define REASON_MAX 2000   /* bytes of a reason kept (cut on a character boundary) */

/* ------------------------------------------------------------ config copy */

int odbcsrc_conf_init(odbcsrc_conf *c, const cfg_outbox *oc)
{
    memset(c, 0, sizeof *c);
    c->conninfo = strdup(oc->conninfo ? oc->conninfo : "");
    c->database = strdup(oc->database ? oc->database : "");
    if (oc->password)
        c->password = strdup(oc->password);
    if (!c->conninfo || !c->database || (oc->password && !c->password)) {
        odbcsrc_conf_clear(c);
        return -1;
    }
    snprintf(c->tn.schema, sizeof c->tn.schema, "%s", oc->schema_part);
    snprintf(c->tn.table, sizeof c->tn.table, "%s", oc->table_part);
    snprintf(c->tn.dead, sizeof c->tn.dead, "%s", oc->dead_part);
    sql_pg_names_init(oc, &c->pgn);
    c->on_sent = oc->on_sent;
    c->query_timeout_ms = oc->query_timeout_ms;
    c->connect_timeout_ms = oc->connect_timeout_ms;
    c->reconnect_max_ms = oc->reconnect_max_ms;
    c->batch_size = oc->batch_size;
    c->cleanup_batch = oc->cleanup_batch;
    return 0;
}

void odbcsrc_conf_clear(odbcsrc_conf *c)
{
    if (c->password) {
        explicit_bzero(c->password, strlen(c->password));
        free(c->password);
    }
    if (c->conninfo) {
        explicit_bzero(c->conninfo, strlen(c->conninfo));
        free(c->conninfo);
    }
    free(c->database);
    memset(c, 0, sizeof *c);
}

/* ------------------------------------------------------------ session */

static bool is_tsql(const odbcsrc_db *db)
{
    return db->dialect == OUTBOX_DIALECT_SQLSERVER;
}

/* T-SQL: the session options every relay connection sets itself, whatever the
 * driver's defaults (msodbcsql and FreeTDS differ; sqlcmd-like defaults would
 * break DML on the filtered indexes with Msg 1934):
 *   - outbox_tsql_session_options: QUOTED_IDENTIFIER, ANSI_NULLS and the other
 *     options tables with filtered indexes need;
 *   - XACT_ABORT ON: any error (also a query timeout) rolls the request's whole
 *     transaction back, never half of a settle;
 *   - READ COMMITTED: the level READPAST needs and every statement here assumes. */
static int session_tsql(odbcsrc_db *db)
{
    outbox_util_buf b = {0};
    SQLHSTMT h = SQL_NULL_HSTMT;
    int rc = -1;
    if (outbox_util_buf_puts(&b, outbox_tsql_session_options) < 0 ||
        outbox_util_buf_puts(&b, SQL_TSQL_SESSION_TAIL) < 0) {
        ost_err(db, "session options: out of memory");
        goto done;
    }
    if (ost_run(db, "setting the session options", b.p, NULL, &h) < 0)
        goto done;
    rc = ost_drain(db, h, "setting the session options");
done:
    ost_free(db, h);
    free(b.p);
    return rc;
}

int odbcsrc_db_open(odbcsrc_db *db, const odbcsrc_conf *conf, int txn)
{
    SQLRETURN rc;
    outbox_util_buf cs = {0};
    odbcsrc_cur_fn fn = db->cur_fn;
    void *ud = db->cur_ud;
    memset(db, 0, sizeof *db);
    db->cur_fn = fn;
    db->cur_ud = ud;
    db->conf = conf;
    db->env = SQL_NULL_HENV;
    db->dbc = SQL_NULL_HDBC;

    rc = SQLAllocHandle(SQL_HANDLE_ENV, SQL_NULL_HANDLE, &db->env);
    if (!SQL_SUCCEEDED(rc)) {
        ost_err(db, "ODBC: cannot allocate an environment handle");
        db->env = SQL_NULL_HENV;
        goto fail;
    }
    rc = SQLSetEnvAttr(db->env, SQL_ATTR_ODBC_VERSION, (SQLPOINTER)SQL_OV_ODBC3, 0);
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_ENV, db->env, "ODBC: setting ODBC version 3");
        goto fail;
    }
    rc = SQLAllocHandle(SQL_HANDLE_DBC, db->env, &db->dbc);
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_ENV, db->env, "ODBC: allocating a connection handle");
        db->dbc = SQL_NULL_HDBC;
        goto fail;
    }
    int64_t ls = (conf->connect_timeout_ms + 999) / 1000;
    if (ls < 1)
        ls = 1;
    rc = SQLSetConnectAttr(db->dbc, SQL_ATTR_LOGIN_TIMEOUT, (SQLPOINTER)(uintptr_t)ls, 0);
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_DBC, db->dbc, "ODBC: setting the login timeout");
        goto fail;
    }
    /* optional: not every driver implements it (psqlODBC does not) */
    (void)SQLSetConnectAttr(db->dbc, SQL_ATTR_CONNECTION_TIMEOUT, (SQLPOINTER)(uintptr_t)ls, 0);

    /* The connection string; it may carry secrets: never logged. */
    if (outbox_util_buf_puts(&cs, conf->conninfo) < 0)
        goto oom;
    if (conf->password) {
        if (cs.len && cs.p[cs.len - 1] != ';' && outbox_util_buf_puts(&cs, ";") < 0)
            goto oom;
        if (outbox_util_buf_puts(&cs, "PWD={") < 0)
            goto oom;
        for (const char *p = conf->password; *p; p++)
            if (outbox_util_buf_put(&cs, p, 1) < 0 || (*p == '}' && outbox_util_buf_put(&cs, "}", 1) < 0))
                goto oom;
        if (outbox_util_buf_puts(&cs, "}") < 0)
            goto oom;
    }
    pthread_mutex_lock(&driver_setup_lock);
    rc = SQLDriverConnect(db->dbc, NULL, (SQLCHAR *)cs.p, SQL_NTS, NULL, 0, NULL,
                          SQL_DRIVER_NOPROMPT);
    pthread_mutex_unlock(&driver_setup_lock);
    explicit_bzero(cs.p, cs.cap);
    free(cs.p);
    cs.p = NULL;
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_DBC, db->dbc, "connect");
        goto fail;
    }
    db->connected = true;
    SQLCHAR dbms[128] = "";
    SQLSMALLINT dl = 0;
    rc = SQLGetInfo(db->dbc, SQL_DBMS_NAME, dbms, sizeof dbms, &dl);
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_DBC, db->dbc, "SQLGetInfo(SQL_DBMS_NAME)");
        goto fail;
    }
    SQLCHAR drv[128] = "";
    rc = SQLGetInfo(db->dbc, SQL_DRIVER_NAME, drv, sizeof drv, &dl);
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_DBC, db->dbc, "SQLGetInfo(SQL_DRIVER_NAME)");
        goto fail;
    }
    db->freetds = strstr((char *)drv, "tdsodbc") != NULL;
    if (strstr((char *)dbms, "SQL Server"))
        db->dialect = OUTBOX_DIALECT_SQLSERVER;
    else if (strstr((char *)dbms, "PostgreSQL"))
        db->dialect = OUTBOX_DIALECT_POSTGRES;
    else {
        ost_err(db, "unsupported DBMS \"%s\" (expected Microsoft SQL Server or PostgreSQL)",
                (char *)dbms);
        goto fail;
    }
    db->autocommit = txn == ODBCSRC_TXN_AUTO || (txn == ODBCSRC_TXN_RELAY && is_tsql(db));
    rc = SQLSetConnectAttr(db->dbc, SQL_ATTR_AUTOCOMMIT,
                           (SQLPOINTER)(uintptr_t)(db->autocommit ? SQL_AUTOCOMMIT_ON
                                                                  : SQL_AUTOCOMMIT_OFF), 0);
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_DBC, db->dbc, "setting autocommit");
        goto fail;
    }
    outbox_qualified((outbox_dialect)db->dialect, &conf->tn, OUTBOX_TABLE_OUTBOX, db->qt,
                     sizeof db->qt);
    outbox_qualified((outbox_dialect)db->dialect, &conf->tn, OUTBOX_TABLE_DEAD, db->qd,
                     sizeof db->qd);
    outbox_qualified((outbox_dialect)db->dialect, &conf->tn, OUTBOX_TABLE_LEASE, db->ql,
                     sizeof db->ql);
    if (is_tsql(db) && session_tsql(db) < 0)
        goto fail;
    return 0;
oom:
    ost_err(db, "connect: out of memory");
fail:
    if (cs.p) {
        explicit_bzero(cs.p, cs.cap);
        free(cs.p);
    }
    odbcsrc_db_close(db);
    return -1;
}

void odbcsrc_db_close(odbcsrc_db *db)
{
    if (db->dbc != SQL_NULL_HDBC) {
        if (db->connected) {
            if (!db->autocommit)
                (void)SQLEndTran(SQL_HANDLE_DBC, db->dbc, SQL_ROLLBACK);
            pthread_mutex_lock(&driver_setup_lock);
            (void)SQLDisconnect(db->dbc);
            pthread_mutex_unlock(&driver_setup_lock);
        }
        SQLFreeHandle(SQL_HANDLE_DBC, db->dbc);
    }
    if (db->env != SQL_NULL_HENV)
        SQLFreeHandle(SQL_HANDLE_ENV, db->env);
    db->dbc = SQL_NULL_HDBC;
    db->env = SQL_NULL_HENV;
    db->connected = false;
}

/* Rolls back the transaction when one is open. On SQL Server the server may have
 * ended it already (XACT_ABORT after an error, a deadlock victim): a ROLLBACK then
 * fails ("ROLLBACK can only be used in transaction blocks" on Babelfish), so T-SQL
 * asks @@TRANCOUNT first (a SELECT that reads no table starts no implicit
 * transaction). Not every error ends the transaction (SQL Server leaves it open after
 * a statement that fails to compile, e.g. a table dropped since the batch was cached):
 * with autocommit on, one statement asks and rolls back on the server, so that the
 * next request starts outside any transaction. The error that led here stays in
 * db->err. */
static int rollback(odbcsrc_db *db)
{
    char saved[sizeof db->err];
    long native = db->native;
    int rc = 0;
    memcpy(saved, db->err, sizeof saved);
    if (db->autocommit) {
        if (is_tsql(db)) {
            SQLHSTMT h = SQL_NULL_HSTMT;
            if (ost_run(db, "rollback", SQL_TSQL_ROLLBACK_OPEN, NULL, &h) < 0 ||
                ost_drain(db, h, "rollback") < 0)
                rc = -1;
            ost_free(db, h);
        }
        goto out;
    }
    if (is_tsql(db)) {
        int64_t open = 1;
        if (ost_one_row_ints(db, "rollback: reading @@TRANCOUNT",
                             "SELECT CAST(@@TRANCOUNT AS bigint)", NULL, &open, 1) < 0)
            rc = -1;
        else if (open == 0)
            goto out;
    }
    if (rc == 0 && !SQL_SUCCEEDED(SQLEndTran(SQL_HANDLE_DBC, db->dbc, SQL_ROLLBACK))) {
        ost_diag(db, SQL_HANDLE_DBC, db->dbc, "rollback");
        rc = -1;
    }
out:
    if (saved[0]) {
        memcpy(db->err, saved, sizeof saved);
        db->native = native;
    }
    return rc;
}

int odbcsrc_db_end(odbcsrc_db *db, bool commit)
{
    if (!commit)
        return rollback(db);
    if (db->autocommit)
        return 0;  /* every statement (T-SQL: every request's batch) committed itself */
    SQLRETURN rc = SQLEndTran(SQL_HANDLE_DBC, db->dbc, SQL_COMMIT);
    if (!SQL_SUCCEEDED(rc)) {
        ost_diag(db, SQL_HANDLE_DBC, db->dbc, "commit");
        return -1;
    }
    return 0;
}

/* T-SQL: OPENJSON (settle, dead retry and purge) needs compatibility level 130. A
 * database left at 110 or 120 after a server upgrade would run check and claims, then
 * fail every settle: refused here, by check and by run alike. Babelfish for PostgreSQL
 * reports 120 for every database while it runs OPENJSON: it is recognized by
 * @@VERSION and let through. */
static int compat_check(odbcsrc_db *db)
{
    SQLHSTMT h = SQL_NULL_HSTMT;
    outbox_util_buf ver = {0};
    int64_t level = 0;
    bool vnull = false;
    int rc = -1;
    if (ost_run(db, "reading the server version", sql_tsql_version.text, NULL, &h) < 0)
        goto done;
    if (ost_result(db, h, "reading the server version") != 0 ||
        ost_fetch(db, h, "reading the server version") != 1) {
        if (!db->err[0])
            ost_err(db, "reading the server version: no result");
        goto done;
    }
    if (ost_get_text(db, h, 1, &ver, &vnull) < 0 ||
        ost_drain(db, h, "reading the server version") < 0)
        goto done;
    db->babelfish = !vnull && ver.p && strstr(ver.p, "Babelfish") != NULL;
    if (db->babelfish) {
        rc = 0;
        goto done;
    }
    if (ost_one_row_ints(db, "reading the compatibility level", sql_tsql_compat.text, NULL,
                         &level, 1) < 0)
        goto done;
    if (level < SQL_TSQL_MIN_COMPAT) {
        ost_err(db, "database \"%s\" is at compatibility level %" PRId64 "; the relay needs %d "
                "or higher (OPENJSON): ALTER DATABASE [%s] SET COMPATIBILITY_LEVEL = %d",
                db->conf->database, level, SQL_TSQL_MIN_COMPAT, db->conf->database,
                SQL_TSQL_MIN_COMPAT);
        goto done;
    }
    rc = 0;
done:
    ost_free(db, h);
    outbox_util_buf_free(&ver);
    return rc;
}

/* The connected database's name as UTF-8 into out. SQL_ATTR_CURRENT_CATALOG
 * is free (no round trip) but its narrow form is only trustworthy for plain
 * ASCII (drivers differ in how they convert, and the wide form is broken in
 * psqlODBC 13); anything else is asked from the server as UTF-16. */
static int current_db(odbcsrc_db *db, outbox_util_buf *out)
{
    SQLCHAR a[256];
    SQLINTEGER len = 0;
    SQLRETURN rc = SQLGetConnectAttr(db->dbc, SQL_ATTR_CURRENT_CATALOG, a, sizeof a - 1, &len);
    if (rc == SQL_SUCCESS && len > 0 && (size_t)len < sizeof a) {
        bool plain = true;
        a[len] = '\0';
        for (SQLINTEGER i = 0; i < len; i++)
            if (a[i] < 0x20 || a[i] > 0x7e || a[i] == '?')
                plain = false;
        if (plain) {
            outbox_util_buf_reset(out);
            return outbox_util_buf_put(out, a, (size_t)len);
        }
    }
    /* fallback: ask the server */
    SQLHSTMT h = SQL_NULL_HSTMT;
    const char *q = is_tsql(db) ? SQL_TSQL_CURRENT_DATABASE : SQL_PG_CURRENT_DATABASE;
    int r = -1;
    bool isnull = false;
    if (ost_run(db, "reading the database name", q, NULL, &h) < 0)
        return -1;
    if (ost_result(db, h, "reading the database name") != 0 ||
        ost_fetch(db, h, "reading the database name") != 1)
        goto done;
    if (ost_get_text(db, h, 1, out, &isnull) < 0)
        goto done;
    r = 0;
done:
    ost_free(db, h);
    return r;
}

int odbcsrc_db_verify(odbcsrc_db *db, bool tables)
{
    outbox_util_buf name = {0};
    int rc = -1;
    if (current_db(db, &name) < 0)
        goto done;
    if (strcmp(name.p ? name.p : "", db->conf->database) != 0) {
        ost_err(db, "connected database \"%s\" differs from configured database \"%s\"",
                name.p ? name.p : "", db->conf->database);
        goto done;
    }
    if (!tables) {
        rc = 0;
        goto done;
    }
    if (is_tsql(db) && compat_check(db) < 0)
        goto done;
    /* source = odbc found SQL Server: the limits source = sqlserver has at load (config/) */
    if (is_tsql(db) && (db->conf->batch_size > SQL_TSQL_MAX_ROWS ||
                        db->conf->cleanup_batch > SQL_TSQL_MAX_ROWS)) {
        bool b = db->conf->batch_size > SQL_TSQL_MAX_ROWS;
        ost_err(db, "%s = %d: at most %d on SQL Server (a statement over more rows could "
                "escalate to a table lock and block every producer)",
                b ? "batch_size" : "cleanup_batch",
                b ? db->conf->batch_size : db->conf->cleanup_batch, SQL_TSQL_MAX_ROWS);
        goto done;
    }
    params ps = {0};
    int64_t v[4] = {0, 0, 0, 1};
    int r = -1;
    char *sql;
    if (is_tsql(db)) {
        const ost_val tv[] = { TV_S("outbox", db->qt), TV_S("dead", db->qd),
                               TV_S("lease", db->ql) };
        sql = ost_tsql(db, &sql_tsql_tables_exist, tv, 3, &ps);
    } else {
        char qi[160];   /* v[3], not reported here: the libpq source and its check do */
        outbox_pg_delayed_index(&db->conf->tn, qi, sizeof qi);
        const pgv pv[4] = { PV_S(db->qt), PV_S(db->qd), PV_S(db->ql), PV_S(qi) };
        sql = ost_pg_stmt(db, sql_pg_tables_exist(), pv, 4, &ps);
    }
    if (sql)
        r = ost_one_row_ints(db, "checking the outbox tables", sql, &ps, v, is_tsql(db) ? 3 : 4);
    free(sql);
    ost_p_free(&ps);
    (void)odbcsrc_db_end(db, false);
    if (r < 0)
        goto done;
    if (!v[0] || !v[1]) {
        ost_err(db, "%s%s%s%s%s %s not exist in database \"%s\": run outbox-relay init",
                v[0] ? "" : "table ", v[0] ? "" : db->qt, (!v[0] && !v[1]) ? " and " : "",
                v[1] ? "" : "dead-letter table ", v[1] ? "" : db->qd,
                (!v[0] && !v[1]) ? "do" : "does", db->conf->database);
        goto done;
    }
    if (!v[2]) {
        ost_err(db, "leadership lease table %s does not exist in database \"%s\": run "
                "outbox-relay init", db->ql, db->conf->database);
        goto done;
    }
    rc = 0;
done:
    free(name.p);
    return rc;
}

/* ------------------------------------------------------------ relay statements */

/* A statement without parameters or result (T-SQL session and transaction control). */
static int exec_plain(odbcsrc_db *db, const char *what, const char *sql)
{
    SQLHSTMT h = SQL_NULL_HSTMT;
    int rc = ost_run(db, what, sql, NULL, &h) < 0 ? -1 : ost_drain(db, h, what);
    ost_free(db, h);
    return rc;
}

/* T-SQL, the relay's session: no statement waits for a lock longer than a third of the
 * leadership lease (the interval at which a leader renews and a standby asks again), so a
 * holder that does not let go (a statement stuck on the server) never stalls a standby's
 * lead, or anything after it, for longer: the statement fails with a lock timeout (1222),
 * its transaction is rolled back (XACT_ABORT) and the next attempt comes at the next
 * renewal. SET LOCK_TIMEOUT takes a constant and stays for the session: sent again only
 * when the lease changes. */
static int lock_timeout(odbcsrc_db *db, int64_t lease_ms)
{
    int64_t want = lease_ms / 3;
    char sql[48];
    if (want < 100)
        want = 100;
    if (want > INT32_MAX)
        want = INT32_MAX;
    if (want == db->lock_timeout_ms)
        return 0;
    snprintf(sql, sizeof sql, "SET LOCK_TIMEOUT %" PRId64, want);
    if (exec_plain(db, "lead: setting the lock timeout", sql) < 0)
        return -1;
    db->lock_timeout_ms = want;
    return 0;
}

/* Leadership as a lease row (sql_pg_lead / sql_tsql_lead: the same rules and the same
 * result columns): our epoch (0 or NULL: not leader), the holder before and its epoch,
 * the row leases released by a takeover, a live member (competing mode) that kept us out. */
int odbcsrc_db_lead(odbcsrc_db *db, const char *owner, int64_t epoch, int64_t lease_ms,
                    int64_t *got, int64_t *held, int64_t *reset, char *holder, char *member,
                    size_t hlen)
{
    params ps = {0};
    SQLHSTMT h = SQL_NULL_HSTMT;
    outbox_util_buf who = {0}, mem = {0};
    bool isnull = false, mnull = false;
    int rc = -1;
    char *sql = NULL;
    const char *me = owner ? owner : "";
    *got = *held = *reset = 0;
    if (hlen)
        holder[0] = member[0] = '\0';
    if (is_tsql(db) && db->autocommit && lock_timeout(db, lease_ms) < 0)
        goto done;
    if (is_tsql(db)) {
        const ost_val v[] = { TV_S("owner", me), TV_I("lease", lease_ms), TV_I("mine", epoch) };
        sql = ost_tsql(db, &sql_tsql_lead, v, 3, &ps);
    } else {
        const pgv v[3] = { PV_S(me), PV_I(epoch), PV_I(lease_ms) };
        sql = ost_pg_stmt(db, sql_pg_lead(&db->conf->pgn), v, 3, &ps);
    }
    if (!sql)
        goto done;
    if (ost_run(db, "lead", sql, &ps, &h) < 0)
        goto done;
    int r = ost_result(db, h, "lead");
    if (r != 0) {
        if (r > 0)
            ost_err(db, "lead: no result");
        goto done;
    }
    r = ost_fetch(db, h, "lead");
    if (r <= 0) {
        if (r == 0)
            ost_err(db, "lead: no result row");
        goto done;
    }
    if (ost_get_i64(db, h, 1, got, NULL) < 0 || ost_get_text(db, h, 2, &who, &isnull) < 0 ||
        ost_get_i64(db, h, 3, held, NULL) < 0 || ost_get_i64(db, h, 4, reset, NULL) < 0 ||
        ost_get_text(db, h, 5, &mem, &mnull) < 0)
        goto done;
    if (hlen && who.p && !isnull)
        snprintf(holder, hlen, "%s", who.p);
    if (hlen && mem.p && !mnull)
        snprintf(member, hlen, "%s", mem.p);
    if (ost_drain(db, h, "lead") < 0)
        goto done;
    rc = 0;
done:
    ost_free(db, h);
    ost_p_free(&ps);
    free(who.p);
    free(mem.p);
    free(sql);
    return rc;
}

static int row_cmp(const void *a, const void *b)
{
    const row *x = *(row *const *)a, *y = *(row *const *)b;
    return x->id < y->id ? -1 : x->id > y->id;
}

static row_field fld(const outbox_util_buf *b, bool isnull)
{
    row_field f;
    f.p = isnull ? NULL : (b->p ? b->p : "");
    f.len = isnull ? 0 : b->len;
    return f;
}

int odbcsrc_db_claim(odbcsrc_db *db, size_t max_rows, size_t max_bytes, bool first_whole,
                     size_t max_payload, int64_t lease_ms, int64_t token, const char *owner, int64_t epoch,
                     bool competing, const int64_t *lost, size_t n_lost, row ***rows_out,
                     size_t *n_out)
{
    enum { NTXT = 8 };
    outbox_util_buf txt[NTXT], pay = {0}, lt = {0};
    bool tnull[NTXT], pnull = false;
    row **rows = NULL;
    size_t n = 0, cap = 0;
    SQLHSTMT h = SQL_NULL_HSTMT;
    params ps = {0};
    char *sql = NULL;
    int rc = -1;

    memset(txt, 0, sizeof txt);
    *rows_out = NULL;
    *n_out = 0;
    const char *me = owner ? owner : "";
    /* the byte limit (0: none); beyond bigint it is no limit either */
    const int64_t bytes = max_bytes > (size_t)INT64_MAX ? 0 : (int64_t)max_bytes;
    /* a payload larger than this stays in the database (0: none does) */
    const int64_t maxpay = max_payload > (size_t)INT64_MAX ? 0 : (int64_t)max_payload;
    /* the tokens of the relay's claims that failed without an answer
       (src_claim_args.lost): T-SQL ",t1,t2," (matched by CHARINDEX), PostgreSQL an array */
    if (is_tsql(db)) {
        outbox_util_buf_put(&lt, ",", 1);
        for (size_t i = 0; i < n_lost; i++)
            outbox_util_buf_printf(&lt, "%" PRId64 ",", lost[i]);
    } else if (n_lost > 0) {
        outbox_util_buf_put(&lt, "{", 1);
        for (size_t i = 0; i < n_lost; i++)
            outbox_util_buf_printf(&lt, "%s%" PRId64, i ? "," : "", lost[i]);
        outbox_util_buf_put(&lt, "}", 1);
    }
    if (lt.failed) {
        ost_err(db, "claim: out of memory");
        goto done;
    }
    if (is_tsql(db)) {
        const sql_tsql_stmt *st = competing ? &sql_tsql_claim_competing : &sql_tsql_claim;
        const int64_t limit = (int64_t)(max_rows > INT32_MAX ? INT32_MAX : max_rows);
        /* competing: no leadership fence, hence no epoch (last) */
        const ost_val v[] = { TV_I("limit", limit), TV_S("owner", me), TV_I("token", token),
                              TV_I("lease_ms", lease_ms), TV_I("max_bytes", bytes),
                              TV_I("first_whole", first_whole ? 1 : 0),
                              TV_I("max_payload", maxpay), TV_S("lost", lt.p),
                              TV_I("epoch", epoch) };
        const size_t nv = sizeof v / sizeof v[0];
        sql = ost_tsql(db, st, v, competing ? nv - 1 : nv, &ps);
    } else {
        /* the walk from the table's start ($9 = $12 = 0): this path keeps no floor, nor
           passes over the rows it holds ($10 NULL) */
        const pgv v[12] = { PV_I((int64_t)max_rows), PV_S(me), PV_I(token), PV_I(lease_ms),
                            PV_I(competing ? 0 : epoch), PV_I(bytes),
                            PV_S(first_whole ? "true" : "false"), PV_I(maxpay), PV_I(0), PV_NUL,
                            lt.p ? PV_BIG(lt.p) : PV_NUL, PV_I(0) };
        /* psqlODBC's session sets nothing (sorts allowed): the plain form */
        sql = ost_pg_stmt(db, sql_pg_claim_bytes(&db->conf->pgn, competing, 0), v, 12, &ps);
    }
    if (!sql)
        goto done;
    if (ost_run(db, "claim", sql, &ps, &h) < 0)
        goto done;
    int r = ost_result(db, h, "claim");
    if (r < 0)
        goto done;
    while (r == 0) {
        int f = ost_fetch(db, h, "claim");
        if (f < 0)
            goto done;
        if (f == 0)
            break;
        row_fields rf;
        int64_t attempts = 0, withheld = 0;
        bool age_null = false, whole = false;
        memset(&rf, 0, sizeof rf);
        if (ost_get_i64(db, h, 1, &rf.id, NULL) < 0)
            goto done;
        for (int i = 0; i < NTXT; i++)
            if (ost_get_text(db, h, 2 + i, &txt[i], &tnull[i]) < 0)
                goto done;
        if (ost_get_bin(db, h, 10, &pay, &pnull) < 0 ||
            ost_get_i64(db, h, 11, &attempts, NULL) < 0 ||
            ost_get_i64(db, h, 12, &rf.created_at_us, NULL) < 0 ||
            ost_get_i64(db, h, 13, &rf.age_us, &age_null) < 0 ||
            ost_get_i64(db, h, 14, &withheld, &whole) < 0)
            goto done;
        if (age_null)
            rf.age_us = -1;
        rf.lease_token = token;
        rf.attempts = (int)attempts;
        rf.message_id = fld(&txt[0], tnull[0]);
        rf.exchange = fld(&txt[1], tnull[1]);
        rf.routing_key = fld(&txt[2], tnull[2]);
        rf.partition_key = fld(&txt[3], tnull[3]);
        rf.message_type = fld(&txt[4], tnull[4]);
        rf.content_type = fld(&txt[5], tnull[5]);
        rf.correlation_id = fld(&txt[6], tnull[6]);
        rf.headers_json = fld(&txt[7], tnull[7]);
        rf.payload.p = pay.p ? pay.p : "";
        rf.payload.len = pnull ? 0 : pay.len;
        if (!whole) {    /* NULL when sent whole; else left in the database, its size only */
            rf.payload.p = NULL;
            rf.payload.len = 0;
            rf.payload_withheld = withheld > 0 ? (size_t)withheld : 1;
        }
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 16;
            row **nr = realloc(rows, nc * sizeof *nr);
            if (!nr) {
                ost_err(db, "claim: out of memory");
                goto done;
            }
            rows = nr;
            cap = nc;
        }
        rows[n] = row_new(&rf);
        if (!rows[n]) {
            ost_err(db, "claim: row %" PRId64 ": out of memory or a malformed message_id", rf.id);
            goto done;
        }
        n++;
    }
    if (r == 0 && ost_drain(db, h, "claim") < 0)
        goto done;
    if (n > 1)
        qsort(rows, n, sizeof *rows, row_cmp);
    *rows_out = rows;  /* ownership to the caller */
    *n_out = n;
    rows = NULL;
    n = 0;
    rc = 0;
done:
    for (size_t i = 0; i < n; i++)
        row_free(rows[i]);
    free(rows);
    ost_free(db, h);
    ost_p_free(&ps);
    free(sql);
    for (int i = 0; i < NTXT; i++)
        free(txt[i].p);
    free(pay.p);
    outbox_util_buf_free(&lt);
    return rc;
}

static char *odbcsrc_outcomes_json(const src_outcome *v, size_t n);

/* T-SQL: at most SQL_TSQL_MAX_ROWS outcomes as JSON, in one statement. */
static int settle_tsql(odbcsrc_db *db, const src_outcome *v, size_t n, int64_t *cnt)
{
    params ps = {0};
    outbox_util_buf t = {0};
    char *sql = NULL, *json = odbcsrc_outcomes_json(v, n);
    int rc = -1;
    bool del = db->conf->on_sent == CFG_ON_SENT_DELETE;
    if (!json || outbox_util_buf_puts(&t, sql_tsql_settle_head.text) < 0 ||
        outbox_util_buf_puts(&t, del ? sql_tsql_settle_delete.text
                                     : sql_tsql_settle_mark.text) < 0 ||
        outbox_util_buf_puts(&t, sql_tsql_settle_tail.text) < 0) {
        ost_err(db, "settle: out of memory");
        goto done;
    }
    const ost_val pv[] = { TV_S("outcomes", json) };
    if (ost_tsql_bind(db, &sql_tsql_settle_head, pv, 1, &ps) < 0 ||
        !(sql = ost_sql_for(db, t.p)))
        goto done;
    rc = ost_one_row_ints(db, "settle", sql, &ps, cnt, 1);
done:
    ost_p_free(&ps);
    free(sql);
    free(t.p);
    free(json);
    return rc;
}

/* Settles outcomes: T-SQL in statements of at most SQL_TSQL_MAX_ROWS outcomes each
 * (lock escalation), all in one transaction: each batch is its own transaction, and a
 * settle of more outcomes than that nests them in one opened here (the locks it holds
 * between them are those of its own leased rows, never the leader row); PostgreSQL in
 * one statement with the arrays of the libpq path (and its plain statement when they are
 * all SENT). */
int odbcsrc_db_settle(odbcsrc_db *db, const src_outcome *v, size_t n, size_t *applied)
{
    params ps = {0};
    outbox_util_buf arr[5];
    bool have_arr = false;
    char *sql = NULL;
    int64_t cnt = 0;
    int rc = -1;
    *applied = 0;
    if (is_tsql(db)) {
        size_t total = 0;
        bool outer = db->autocommit && n > SQL_TSQL_MAX_ROWS;
        if (outer && exec_plain(db, "settle", "BEGIN TRANSACTION") < 0)
            return -1;
        for (size_t at = 0; at < n; at += SQL_TSQL_MAX_ROWS) {
            size_t k = n - at < SQL_TSQL_MAX_ROWS ? n - at : SQL_TSQL_MAX_ROWS;
            cnt = 0;
            if (settle_tsql(db, v + at, k, &cnt) < 0)
                return -1;
            total += cnt > 0 ? (size_t)cnt : 0;
        }
        if (outer && exec_plain(db, "settle", "COMMIT TRANSACTION") < 0)
            return -1;
        *applied = total;
        return 0;
    }
    bool all_sent = true;
    if (sql_pg_settle_arrays(v, n, arr) < 0) {
        ost_err(db, "settle: out of memory");
        goto done;
    }
    have_arr = true;
    for (size_t i = 0; i < n; i++)
        all_sent = all_sent && v[i].kind == SRC_SENT;
    const pgv pv[5] = { PV_BIG(arr[0].p), PV_BIG(arr[1].p), PV_BIG(arr[2].p),
                        PV_BIG(arr[3].p), PV_BIG(arr[4].p) };
    int on_sent = db->conf->on_sent;
    sql = all_sent ? ost_pg_stmt(db, sql_pg_settle_sent(&db->conf->pgn, on_sent), pv, 2, &ps)
                   : ost_pg_stmt(db, sql_pg_settle(&db->conf->pgn, on_sent), pv, 5, &ps);
    if (!sql)
        goto done;
    rc = ost_one_row_ints(db, "settle", sql, &ps, &cnt, 1);
    if (rc == 0)
        *applied = cnt > 0 ? (size_t)cnt : 0;
done:
    ost_p_free(&ps);
    free(sql);
    for (int k = 0; have_arr && k < 5; k++)
        outbox_util_buf_free(&arr[k]);
    return rc;
}

int odbcsrc_db_cleanup(odbcsrc_db *db, int64_t retention_ms, size_t limit, const char *owner,
                       int64_t epoch, size_t *deleted)
{
    params ps = {0};
    char *sql;
    const char *me = owner ? owner : "";
    int rc = -1;
    if (retention_ms < 0)
        retention_ms = 0;
    if (is_tsql(db)) {
        const ost_val v[] = { TV_I("limit", (int64_t)(limit > INT32_MAX ? INT32_MAX : limit)),
                              TV_I("keep_ms", retention_ms % 1000),
                              TV_I("keep_s", retention_ms / 1000), TV_I("epoch", epoch),
                              TV_S("owner", me) };
        int64_t n = 0;
        sql = ost_tsql(db, &sql_tsql_cleanup, v, 5, &ps);
        if (sql && (rc = ost_one_row_ints(db, "cleanup", sql, &ps, &n, 1)) == 0)
            *deleted = n > 0 ? (size_t)n : 0;
    } else {
        const pgv v[4] = { PV_I(retention_ms), PV_I((int64_t)limit), PV_S(me), PV_I(epoch) };
        sql = ost_pg_stmt(db, sql_pg_cleanup(&db->conf->pgn), v, 4, &ps);
        if (sql)
            rc = ost_exec_count(db, "cleanup", sql, &ps, deleted);
    }
    ost_p_free(&ps);
    free(sql);
    return rc;
}

int odbcsrc_db_stats(odbcsrc_db *db, src_stats *out, bool full)
{
    /* T-SQL: never waits for producers (READPAST; see the top of this file). The
       retained marked rows are counted only with `full` (else -1: the relay's periodic
       refresh must not read every retained row; `outbox-relay stats` counts them). */
    SQLHSTMT h = SQL_NULL_HSTMT;
    outbox_util_buf leader = {0};
    char *sql;
    int rc = -1;
    memset(out, 0, sizeof *out);
    out->next_due_s = -1;   /* T-SQL does not say: the core uses it only where NOTIFY wakes it */
    if (is_tsql(db)) {
        outbox_util_buf t = {0};
        outbox_util_buf_puts(&t, sql_tsql_stats.text);
        outbox_util_buf_puts(&t, full ? sql_tsql_stats_kept.text : "CAST(-1 AS bigint)");
        outbox_util_buf_puts(&t, sql_tsql_stats_leader.text);
        sql = t.failed ? NULL : ost_sql_for(db, t.p);
        if (t.failed)
            ost_err(db, "stats: out of memory");
        outbox_util_buf_free(&t);
    } else {
        sql = sql_pg_stats(&db->conf->pgn, full);
        if (!sql)
            ost_err(db, "stats: out of memory");
    }
    if (!sql)
        return -1;
    if (ost_run(db, "stats", sql, NULL, &h) < 0)
        goto done;
    if (ost_result(db, h, "stats") != 0 || ost_fetch(db, h, "stats") != 1) {
        if (!db->err[0] || strncmp(db->err, "stats", 5) != 0)
            ost_err(db, "stats: no result");
        goto done;
    }
    if (ost_get_i64(db, h, 1, &out->backlog, NULL) < 0 ||
        ost_get_f64(db, h, 2, &out->oldest_pending_s, NULL) < 0 ||
        ost_get_i64(db, h, 3, &out->dead, NULL) < 0 ||
        ost_get_i64(db, h, 4, &out->sent_kept, NULL) < 0)
        goto done;
    if (!is_tsql(db)) {
        bool none = false;
        double due = 0;
        if (ost_get_f64(db, h, 5, &due, &none) < 0)
            goto done;
        if (!none)
            out->next_due_s = due < 0 ? 0 : due;
    }
    bool lnull = false;
    if (ost_get_text(db, h, is_tsql(db) ? 5 : 6, &leader, &lnull) < 0)
        goto done;
    if (leader.p && !lnull)
        snprintf(out->leader, sizeof out->leader, "%s", leader.p);
    if (out->oldest_pending_s < 0)
        out->oldest_pending_s = 0;
    rc = 0;
done:
    ost_free(db, h);
    free(leader.p);
    free(sql);
    return rc;
}

/* Babelfish for PostgreSQL compiles a batch the first time a session runs it, and the
 * claims and the settle took seconds there (1.5-16 s each on the loaded 2-core test
 * machine, then 30-70 ms): a leader's first claim outlasted its lease renewal, which
 * waits behind it on the same session, and a 1 s query timeout was never met on a new
 * session. Each is run once here, before the session counts as up, in a form that
 * touches no row (no rows to claim, no membership, no outcomes), under a timeout of its
 * own. It never waits for a lock (LOCK_TIMEOUT 1 ms: a table locked by someone else must
 * not hold the connect back); one that fails is only not warmed. SQL Server compiles in
 * milliseconds and keeps plans across sessions: nothing is run there. */
#define WARM_TIMEOUT_MS 60000

int odbcsrc_db_warm(odbcsrc_db *db)
{
    if (!is_tsql(db) || !db->babelfish || !db->autocommit)
        return 0;
    int64_t cnt = 0;
    int rc = exec_plain(db, "warm-up: lock timeout", "SET LOCK_TIMEOUT 1");
    db->timeout_ms = db->conf->query_timeout_ms > WARM_TIMEOUT_MS ? db->conf->query_timeout_ms
                                                                  : WARM_TIMEOUT_MS;
    for (int step = 0; rc == 0 && step < 3; step++) {
        row **rows = NULL;
        size_t n = 0;
        int r = step < 2 ? odbcsrc_db_claim(db, 0, 0, false, 0, 0, 0, "", 0, step == 1, NULL, 0,
                                            &rows, &n)
                         : settle_tsql(db, NULL, 0, &cnt);
        for (size_t i = 0; i < n; i++)
            row_free(rows[i]);
        free(rows);
        if (r < 0 && (db->lost || rollback(db) < 0))
            rc = -1;
    }
    db->timeout_ms = 0;
    if (rc == 0)
        rc = exec_plain(db, "warm-up: lock timeout", "SET LOCK_TIMEOUT -1");
    db->lock_timeout_ms = 0;   /* the next lead sets its own */
    if (rc == 0)
        db->err[0] = '\0';
    return rc;
}

/* ------------------------------------------------------------ admin statements */

int odbcsrc_db_init(odbcsrc_db *db)
{
    char **stmts = outbox_ddl((outbox_dialect)db->dialect, &db->conf->tn);
    int rc = -1;
    if (!stmts) {
        ost_err(db, "init: out of memory");
        return -1;
    }
    /* never queue for long behind a producer transaction (every later producer would
       queue behind init): a statement that must create something on a table in use
       gives up after OUTBOX_INIT_LOCK_TIMEOUT_MS; objects that exist are skipped */
    char lt[80];
    if (is_tsql(db))
        snprintf(lt, sizeof lt, "SET LOCK_TIMEOUT %d", OUTBOX_INIT_LOCK_TIMEOUT_MS);
    else
        snprintf(lt, sizeof lt, "SET lock_timeout = %d", OUTBOX_INIT_LOCK_TIMEOUT_MS);
    {
        SQLHSTMT h = SQL_NULL_HSTMT;
        if (ost_run(db, "init: lock timeout", lt, NULL, &h) < 0)
            goto done;
        int r = ost_drain(db, h, "init: lock timeout");
        ost_free(db, h);
        if (r < 0)
            goto done;
    }
    for (size_t i = 0; stmts[i]; i++) {
        SQLHSTMT h = SQL_NULL_HSTMT;
        char what[64];
        snprintf(what, sizeof what, "init: DDL statement %zu", i + 1);
        if (ost_run(db, what, stmts[i], NULL, &h) < 0)
            goto done;
        int r = ost_drain(db, h, what);
        ost_free(db, h);
        if (r < 0)
            goto done;
    }
    rc = 0;
done:
    outbox_ddl_free(stmts);
    return rc;
}

int odbcsrc_db_dead_list(odbcsrc_db *db, FILE *out)
{
    SQLHSTMT h = SQL_NULL_HSTMT;
    char *sql = is_tsql(db) ? ost_sql_for(db, sql_tsql_dead_list.text)
                            : sql_pg_dead_list(&db->conf->pgn);
    outbox_util_buf t[5];
    int rc = -1;
    memset(t, 0, sizeof t);
    if (!sql) {
        ost_err(db, "dead list: out of memory");
        return -1;
    }
    if (ost_run(db, "dead list", sql, NULL, &h) < 0 || ost_result(db, h, "dead list") < 0)
        goto done;
    for (;;) {
        int f = ost_fetch(db, h, "dead list");
        if (f < 0)
            goto done;
        if (f == 0)
            break;
        int64_t id = 0, attempts = 0;
        bool nul[5];
        if (ost_get_i64(db, h, 1, &id, NULL) < 0 ||
            ost_get_text(db, h, 2, &t[0], &nul[0]) < 0 ||
            ost_get_text(db, h, 3, &t[1], &nul[1]) < 0 ||
            ost_get_text(db, h, 4, &t[2], &nul[2]) < 0 ||
            ost_get_i64(db, h, 5, &attempts, NULL) < 0 ||
            ost_get_text(db, h, 6, &t[3], &nul[3]) < 0 ||
            ost_get_text(db, h, 7, &t[4], &nul[4]) < 0)
            goto done;
        char ids[24], atts[24];
        snprintf(ids, sizeof ids, "%" PRId64, id);
        snprintf(atts, sizeof atts, "%" PRId64, attempts);
        const char *fields[7] = { ids, nul[0] ? NULL : t[0].p, nul[1] ? NULL : t[1].p,
                                  nul[2] ? NULL : t[2].p, atts, nul[3] ? NULL : t[3].p,
                                  nul[4] ? NULL : t[4].p };
        source_dead_line(out, fields, 7);
    }
    rc = 0;
done:
    ost_free(db, h);
    free(sql);
    for (int i = 0; i < 5; i++)
        free(t[i].p);
    return rc;
}

int odbcsrc_db_dead_move(odbcsrc_db *db, bool retry, const int64_t *ids, size_t n_ids,
                         size_t *affected)
{
    /* T-SQL: idempotent and never fails forever (see sql_tsql_dead_retry). Rows already
       back in the outbox under their id (a retry repeated after a lost commit
       acknowledgement) are not inserted again; a dead row whose message_id is pending
       again under another id (the producer re-sent it) stays dead rather than breaking
       the unique key. A dead row is removed only once its id is in the outbox. */
    outbox_util_buf list = {0};
    params ps = {0};
    char *sql = NULL;
    int rc = -1;
    *affected = 0;
    bool all = !ids || n_ids == 0;
    if (is_tsql(db)) {
        if (outbox_util_buf_puts(&list, "[") < 0)
            goto oom;
        for (size_t i = 0; !all && i < n_ids; i++)
            if (outbox_util_buf_printf(&list, "%s%" PRId64, i ? "," : "", ids[i]) < 0)
                goto oom;
        if (outbox_util_buf_puts(&list, "]") < 0)
            goto oom;
        const sql_tsql_stmt *st = retry ? &sql_tsql_dead_retry : &sql_tsql_dead_purge;
        const ost_val v[] = { TV_I("all", all ? 1 : 0), TV_S("list", list.p) };
        sql = ost_tsql(db, st, v, 2, &ps);
    } else {
        char *arr = NULL;
        if (sql_pg_id_array(ids, n_ids, &arr) < 0)
            goto oom;
        list.p = arr;    /* owned by list from here */
        const pgv v[1] = { arr ? PV_BIG(arr) : PV_NUL };
        sql = ost_pg_stmt(db, retry ? sql_pg_dead_retry(&db->conf->pgn)
                                : sql_pg_dead_purge(&db->conf->pgn), v, 1, &ps);
    }
    if (!sql)
        goto done;
    if (is_tsql(db)) {
        int64_t v = 0;
        rc = ost_one_row_ints(db, retry ? "dead retry" : "dead purge", sql, &ps, &v, 1);
        *affected = v > 0 ? (size_t)v : 0;
    } else {
        rc = ost_exec_count(db, retry ? "dead retry" : "dead purge", sql, &ps, affected);
    }
    goto done;
oom:
    ost_err(db, "out of memory");
done:
    ost_p_free(&ps);
    free(sql);
    free(list.p);
    return rc;
}

/* ------------------------------------------------------------ outcomes as JSON */

/* The outcomes as one JSON array for T-SQL's OPENJSON (UTF-8, malloc'd; NULL on
 * out-of-memory): [{"id":1,"token":2,"kind":1,"backoff_ms":500,"reason":"..."},...] */
static char *odbcsrc_outcomes_json(const src_outcome *v, size_t n)
{
    outbox_util_buf b = {0};
    if (outbox_util_buf_put(&b, "[", 1) < 0)
        goto oom;
    for (size_t i = 0; i < n; i++) {
        int64_t bo = v[i].backoff_ms;
        if (bo < 0)
            bo = 0;
        if (outbox_util_buf_printf(&b, "%s{\"id\":%" PRId64 ",\"token\":%" PRId64 ",\"kind\":%d,"
                        "\"backoff_ms\":%" PRId64, i ? "," : "", v[i].id, v[i].lease_token,
                        v[i].kind, bo) < 0)
            goto oom;
        /* a NULL reason is left out (JSON_VALUE of a missing key is NULL): Babelfish
           reads a JSON null as the text "null" */
        if (v[i].reason && (outbox_util_buf_puts(&b, ",\"reason\":") < 0 ||
                            outbox_util_json_string(&b, v[i].reason, REASON_MAX) < 0))
            goto oom;
        if (outbox_util_buf_put(&b, "}", 1) < 0)
            goto oom;
    }
    if (outbox_util_buf_put(&b, "]", 1) < 0)
        goto oom;
    return b.p;  /* ownership to the caller */
oom:
    free(b.p);
    return NULL;
}
