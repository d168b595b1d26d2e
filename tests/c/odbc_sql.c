/*
 * odbc_sql.c — a minimal ODBC client for the tests: the Python side has no
 * T-SQL client, so tests/test_relay_sqlserver.py reads and writes the outbox on
 * SQL Server (or Babelfish) through this program and the same driver the
 * relay uses.
 *
 *   odbc_sql [--timeout S] CONNSTR
 *
 * One connection, autocommit on. Each line on stdin is one batch, hex-encoded
 * (so it may hold newlines); for every row of every result set it prints
 *   ROW <col> <col> ...
 * where a column is "-" for NULL, "~" for an empty value, the hex of the text
 * (UTF-8 with FreeTDS's ClientCharset=UTF-8) or "x" + the hex of the bytes of
 * a binary column; then
 *   DONE rc=0 rows=<rows printed>      or      DONE rc=1 error=<diagnostics>
 * Every statement is bounded by SQL_ATTR_QUERY_TIMEOUT (default 60 s) and the
 * login by SQL_ATTR_LOGIN_TIMEOUT (10 s). EOF ends the program (exit 0; 2
 * when the connection could not be made).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sql.h>
#include <sqlext.h>

/* Prints the diagnostics of h on one line (newlines as spaces). */
static void print_diag(SQLSMALLINT type, SQLHANDLE h)
{
    SQLCHAR state[6], text[1024];
    SQLINTEGER native;
    SQLSMALLINT len;
    for (SQLSMALLINT i = 1;
         SQL_SUCCEEDED(SQLGetDiagRec(type, h, i, state, &native, text, sizeof text, &len));
         i++) {
        for (char *p = (char *)text; *p; p++)
            if (*p == '\n' || *p == '\r')
                *p = ' ';
        printf("%s[%s] %ld %s", i > 1 ? "; " : "", state, (long)native, text);
    }
}

static int is_binary(SQLSMALLINT t)
{
    return t == SQL_BINARY || t == SQL_VARBINARY || t == SQL_LONGVARBINARY;
}

/* Prints one column of the current row; returns 0, or -1 on a driver error. */
static int print_col(SQLHSTMT st, SQLUSMALLINT col, int binary)
{
    static unsigned char buf[65536];
    SQLSMALLINT ctype = binary ? SQL_C_BINARY : SQL_C_CHAR;
    size_t room = binary ? sizeof buf : sizeof buf - 1;   /* SQL_C_CHAR ends in NUL */
    int first = 1;
    for (;;) {
        SQLLEN ind = 0;
        SQLRETURN r = SQLGetData(st, col, ctype, buf, sizeof buf, &ind);
        if (r == SQL_NO_DATA)
            break;
        if (!SQL_SUCCEEDED(r))
            return -1;
        if (ind == SQL_NULL_DATA) {
            fputs(" -", stdout);
            return 0;
        }
        size_t n = ind == SQL_NO_TOTAL || (size_t)ind > room ? room : (size_t)ind;
        if (first) {
            fputs(binary ? " x" : " ", stdout);
            if (n == 0 && r == SQL_SUCCESS && !binary) {
                fputs("~", stdout);
                return 0;
            }
            first = 0;
        }
        for (size_t i = 0; i < n; i++)
            printf("%02x", buf[i]);
        if (r == SQL_SUCCESS)
            break;   /* SQL_SUCCESS_WITH_INFO: truncated, more follows */
    }
    if (first)
        fputs(binary ? " x" : " ~", stdout);
    return 0;
}

/* Runs one batch and prints its rows and the DONE line. */
static void run(SQLHDBC dbc, const char *sql, long timeout)
{
    SQLHSTMT st = SQL_NULL_HSTMT;
    long rows = 0;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_STMT, dbc, &st))) {
        printf("DONE rc=1 error=");
        print_diag(SQL_HANDLE_DBC, dbc);
        printf("\n");
        return;
    }
    SQLSetStmtAttr(st, SQL_ATTR_QUERY_TIMEOUT, (SQLPOINTER)(SQLULEN)timeout, 0);
    SQLRETURN r = SQLExecDirect(st, (SQLCHAR *)(uintptr_t)sql, SQL_NTS);
    int failed = !SQL_SUCCEEDED(r) && r != SQL_NO_DATA;
    while (!failed) {
        SQLSMALLINT ncols = 0;
        if (!SQL_SUCCEEDED(SQLNumResultCols(st, &ncols))) {
            failed = 1;
            break;
        }
        if (ncols > 0) {
            SQLSMALLINT types[256];
            if (ncols > 256)
                ncols = 256;
            for (SQLUSMALLINT c = 1; c <= (SQLUSMALLINT)ncols; c++) {
                SQLCHAR name[128];
                SQLSMALLINT nlen, dtype, digits, nullable;
                SQLULEN size;
                if (!SQL_SUCCEEDED(SQLDescribeCol(st, c, name, sizeof name, &nlen, &dtype,
                                                  &size, &digits, &nullable)))
                    dtype = SQL_VARCHAR;
                types[c - 1] = dtype;
            }
            while ((r = SQLFetch(st)) != SQL_NO_DATA) {
                if (!SQL_SUCCEEDED(r)) {
                    failed = 1;
                    break;
                }
                fputs("ROW", stdout);
                for (SQLUSMALLINT c = 1; c <= (SQLUSMALLINT)ncols && !failed; c++)
                    if (print_col(st, c, is_binary(types[c - 1])) != 0)
                        failed = 1;
                fputs("\n", stdout);
                rows++;
            }
        }
        if (failed)
            break;
        r = SQLMoreResults(st);
        if (r == SQL_NO_DATA)
            break;
        if (!SQL_SUCCEEDED(r))
            failed = 1;
    }
    if (failed) {
        printf("DONE rc=1 error=");
        print_diag(SQL_HANDLE_STMT, st);
        printf("\n");
    } else {
        printf("DONE rc=0 rows=%ld\n", rows);
    }
    SQLFreeHandle(SQL_HANDLE_STMT, st);
}

static int unhex(char *s)
{
    size_t n = strcspn(s, "\r\n");
    if (n % 2)
        return -1;
    for (size_t i = 0; i < n / 2; i++) {
        unsigned v;
        if (sscanf(s + 2 * i, "%2x", &v) != 1)
            return -1;
        s[i] = (char)v;
    }
    s[n / 2] = '\0';
    return 0;
}

int main(int argc, char **argv)
{
    long timeout = 60;
    int a = 1;
    if (argc == 4 && strcmp(argv[1], "--timeout") == 0) {
        char *end;
        timeout = strtol(argv[2], &end, 10);
        if (*end || timeout < 1)
            return 2;
        a = 3;
    }
    if (argc != a + 1) {
        fprintf(stderr, "usage: odbc_sql [--timeout S] CONNSTR  (hex-encoded batches on stdin)\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    SQLHENV env = SQL_NULL_HENV;
    SQLHDBC dbc = SQL_NULL_HDBC;
    int rc = 2;
    if (!SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_ENV, SQL_NULL_HANDLE, &env)) ||
        !SQL_SUCCEEDED(SQLSetEnvAttr(env, SQL_ATTR_ODBC_VERSION, (SQLPOINTER)SQL_OV_ODBC3, 0)) ||
        !SQL_SUCCEEDED(SQLAllocHandle(SQL_HANDLE_DBC, env, &dbc))) {
        fprintf(stderr, "odbc_sql: ODBC allocation failed\n");
        goto out;
    }
    SQLSetConnectAttr(dbc, SQL_ATTR_LOGIN_TIMEOUT, (SQLPOINTER)10, 0);
    if (!SQL_SUCCEEDED(SQLDriverConnect(dbc, NULL, (SQLCHAR *)argv[a], SQL_NTS, NULL, 0, NULL,
                                        SQL_DRIVER_NOPROMPT))) {
        printf("CONNECT rc=1 error=");
        print_diag(SQL_HANDLE_DBC, dbc);
        printf("\n");
        goto out;
    }
    printf("CONNECT rc=0\n");
    size_t cap = 0;
    char *line = NULL;
    while (getline(&line, &cap, stdin) > 0) {
        if (unhex(line) != 0) {
            printf("DONE rc=1 error=input is not hex\n");
            continue;
        }
        run(dbc, line, timeout);
    }
    free(line);
    rc = 0;
    SQLDisconnect(dbc);
out:
    if (dbc != SQL_NULL_HDBC)
        SQLFreeHandle(SQL_HANDLE_DBC, dbc);
    if (env != SQL_NULL_HENV)
        SQLFreeHandle(SQL_HANDLE_ENV, env);
    return rc;
}
