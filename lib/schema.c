/*
 * schema.c — identifier validation, table-name parsing and the outbox DDL
 * for PostgreSQL and SQL Server (see outbox_schema.h for the table).
 */
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "outbox.h"            /* OUTBOX_MAX_IDENT (public) */
#include "outbox_schema.h"
#include "outbox_util.h"      /* buffers; nothing of outbox.c's internals */

int outbox_ident_valid(const char *s)
{
    if (!s || !s[0])
        return 0;
    size_t i;
    for (i = 0; s[i]; i++) {
        char c = s[i];
        int alpha = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
        int digit = c >= '0' && c <= '9';
        if (!(alpha || (digit && i > 0)))
            return 0;
        if (i >= OUTBOX_MAX_IDENT)
            return 0;
    }
    return 1;
}

static void say(char *err, size_t errlen, const char *msg)
{
    if (err && errlen)
        snprintf(err, errlen, "%s", msg);
}

/* Validates one part [p, p+len) named what ("schema"/"table"); 0 or -1 with err. */
static int check_part(const char *spec, const char *p, size_t len, const char *what,
                      char *err, size_t errlen)
{
    char msg[160];
    if (len == 0) {
        snprintf(msg, sizeof msg, "invalid outbox table name: empty %s part", what);
        say(err, errlen, msg);
        return -1;
    }
    if (len > OUTBOX_MAX_IDENT) {
        snprintf(msg, sizeof msg,
                 "invalid outbox table name: %s part is %zu bytes, at most %d", what, len,
                 OUTBOX_MAX_IDENT);
        say(err, errlen, msg);
        return -1;
    }
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)p[i];
        int alpha = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
        int digit = c >= '0' && c <= '9';
        if (alpha || (digit && i > 0))
            continue;
        if (digit)
            snprintf(msg, sizeof msg,
                     "invalid outbox table name: %s part starts with a digit", what);
        else if (c >= 0x21 && c < 0x7f)
            snprintf(msg, sizeof msg,
                     "invalid outbox table name: character '%c' at byte %zu (allowed: "
                     "[A-Za-z_][A-Za-z0-9_]*, schema.table)", c, (size_t)(p - spec) + i);
        else
            snprintf(msg, sizeof msg,
                     "invalid outbox table name: byte 0x%02x at byte %zu (allowed: "
                     "[A-Za-z_][A-Za-z0-9_]*, schema.table)", c, (size_t)(p - spec) + i);
        say(err, errlen, msg);
        return -1;
    }
    return 0;
}

int outbox_table_parse(const char *spec, outbox_table_name *out, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!out) {
        say(err, errlen, "outbox_table_parse: NULL output");
        return -1;
    }
    memset(out, 0, sizeof *out);
    if (!spec || !spec[0]) {
        strcpy(out->schema, OUTBOX_DEFAULT_SCHEMA);
        strcpy(out->table, OUTBOX_DEFAULT_TABLE);
        outbox_derived_name(out->table, "dead", out->dead);
        return 0;
    }
    size_t len = strlen(spec);
    const char *dot = memchr(spec, '.', len);
    if (dot && memchr(dot + 1, '.', len - (size_t)(dot + 1 - spec))) {
        say(err, errlen,
            "invalid outbox table name: more than two parts (expected schema.table or table)");
        return -1;
    }
    const char *sp, *tp;
    size_t sl, tl;
    if (dot) {
        sp = spec;
        sl = (size_t)(dot - spec);
        tp = dot + 1;
        tl = len - sl - 1;
        if (check_part(spec, sp, sl, "schema", err, errlen) != 0)
            return -1;
    } else {
        sp = OUTBOX_DEFAULT_SCHEMA;
        sl = strlen(sp);
        tp = spec;
        tl = len;
    }
    if (check_part(spec, tp, tl, "table", err, errlen) != 0)
        return -1;
    memcpy(out->schema, sp, sl);
    out->schema[sl] = '\0';
    memcpy(out->table, tp, tl);
    out->table[tl] = '\0';
    outbox_derived_name(out->table, "dead", out->dead);
    return 0;
}

/* the suffix of the index of the delayed rows (index_desc), which the relay checks for */
#define OUTBOX_DELAYED_IDX "delayed_idx"

void outbox_qualified(outbox_dialect d, const outbox_table_name *t, outbox_table_kind which,
                      char *out, size_t outlen)
{
    char lease[64];
    if (!out || !outlen)
        return;
    const char *tab = t->table;
    if (which == OUTBOX_TABLE_DEAD) {
        tab = t->dead;
    } else if (which == OUTBOX_TABLE_LEASE) {
        outbox_derived_name(t->table, "lease", lease);
        tab = lease;
    }
    if (d == OUTBOX_DIALECT_SQLSERVER)
        snprintf(out, outlen, "[%s].[%s]", t->schema, tab);
    else
        snprintf(out, outlen, "\"%s\".\"%s\"", t->schema, tab);
}

void outbox_pg_delayed_index(const outbox_table_name *t, char *out, size_t outlen)
{
    char idx[64];
    if (!out || !outlen)
        return;
    outbox_derived_name(t->table, OUTBOX_DELAYED_IDX, idx);
    snprintf(out, outlen, "\"%s\".\"%s\"", t->schema, idx);
}

static uint32_t fnv1a(const char *a, const char *b)
{
    uint32_t h = 2166136261u;
    for (const char *p = a; *p; p++)
        h = (h ^ (unsigned char)*p) * 16777619u;
    h = (h ^ (unsigned char)'_') * 16777619u;
    for (const char *p = b; *p; p++)
        h = (h ^ (unsigned char)*p) * 16777619u;
    return h;
}

void outbox_derived_name(const char *table, const char *suffix, char out[64])
{
    size_t tl = strlen(table), sl = strlen(suffix);
    if (tl + 1 + sl <= OUTBOX_MAX_IDENT) {
        memcpy(out, table, tl);
        out[tl] = '_';
        memcpy(out + tl + 1, suffix, sl + 1);
        return;
    }
    if (sl > 40)
        sl = 40; /* our suffixes are short; never let one eat the whole name */
    size_t keep = OUTBOX_MAX_IDENT - (1 + 8 + 1 + sl);
    if (keep > tl)
        keep = tl;
    snprintf(out, 64, "%.*s_%08x_%.*s", (int)keep, table, (unsigned)fnv1a(table, suffix),
             (int)sl, suffix);
}

/* ------------------------------------------------------------------- DDL */

/* The one description of the outbox table, its dead-letter twin and the lease table:
 * each column once, with its type and default in each dialect ([0] PostgreSQL, [1] SQL
 * Server, as outbox_dialect), the tables it is in, and whether a producer writes it.
 * Both dialects' CREATE TABLE statements are generated from it (col_lines), and
 * OUTBOX_PRODUCER_COLS must list its C_PRODUCER columns in this order (lib_unit_test
 * checks that through outbox_producer_columns). */
enum {
    C_OUTBOX   = 1,     /* in the outbox table */
    C_DEAD     = 2,     /* in the dead-letter table */
    C_NULL     = 4,     /* nullable */
    C_PRODUCER = 8,     /* written by producers, copied by the dead-letter moves */
    C_IDENTITY = 16,    /* the outbox's identity (the dead table keeps the original ids) */
    C_DEF_OUT  = 32     /* the default applies in the outbox table only */
};

typedef struct column {
    const char *name;
    const char *type[2];
    const char *def[2];    /* NULL: no default */
    unsigned    flags;
} column;

#define TS_NOW { "now()", "SYSUTCDATETIME()" }
static const column outbox_columns_desc[] = {
    { "id",             { "bigint", "bigint" },                  { 0 }, C_OUTBOX | C_DEAD | C_IDENTITY },
    { "message_id",     { "uuid", "uniqueidentifier" },          { "gen_random_uuid()", "NEWID()" },
      C_OUTBOX | C_DEAD | C_PRODUCER | C_DEF_OUT },
    { "exchange",       { "text", "nvarchar(255)" },             { "''", "N''" },
      C_OUTBOX | C_DEAD | C_PRODUCER },
    { "routing_key",    { "text", "nvarchar(255)" },             { 0 }, C_OUTBOX | C_DEAD | C_PRODUCER },
    { "partition_key",  { "text", "nvarchar(255)" },             { 0 }, C_OUTBOX | C_DEAD | C_PRODUCER | C_NULL },
    { "message_type",   { "text", "nvarchar(255)" },             { 0 }, C_OUTBOX | C_DEAD | C_PRODUCER | C_NULL },
    { "content_type",   { "text", "nvarchar(255)" },             { 0 }, C_OUTBOX | C_DEAD | C_PRODUCER | C_NULL },
    { "correlation_id", { "text", "nvarchar(255)" },             { 0 }, C_OUTBOX | C_DEAD | C_PRODUCER | C_NULL },
    { "headers",        { "jsonb", "nvarchar(max)" },            { 0 }, C_OUTBOX | C_DEAD | C_PRODUCER | C_NULL },
    { "payload",        { "bytea", "varbinary(max)" },           { 0 }, C_OUTBOX | C_DEAD | C_PRODUCER },
    { "created_at",     { "timestamptz", "datetime2" },          TS_NOW, C_OUTBOX | C_DEAD | C_PRODUCER },
    { "available_at",   { "timestamptz", "datetime2" },          TS_NOW, C_OUTBOX | C_DEAD },
    { "attempts",       { "integer", "int" },                    { "0", "0" }, C_OUTBOX | C_DEAD },
    { "lease_owner",    { "text", "nvarchar(255)" },             { 0 }, C_OUTBOX | C_NULL },
    { "lease_token",    { "bigint", "bigint" },                  { 0 }, C_OUTBOX | C_NULL },
    { "lease_until",    { "timestamptz", "datetime2" },          { 0 }, C_OUTBOX | C_NULL },
    { "last_error",     { "text", "nvarchar(max)" },             { 0 }, C_OUTBOX | C_NULL },
    { "sent_at",        { "timestamptz", "datetime2" },          { 0 }, C_OUTBOX | C_NULL },
    { "reason",         { "text", "nvarchar(max)" },             { 0 }, C_DEAD },
    { "dead_at",        { "timestamptz", "datetime2" },          TS_NOW, C_DEAD },
};

static const column lease_columns_desc[] = {
    { "name",       { "text", "nvarchar(255)" },    { 0 }, C_OUTBOX },
    { "owner",      { "text", "nvarchar(255)" },    { 0 }, C_OUTBOX },
    { "epoch",      { "bigint", "bigint" },         { 0 }, C_OUTBOX },
    { "expires_at", { "timestamptz", "datetime2" }, { 0 }, C_OUTBOX },
};
#undef TS_NOW

/* The partial indexes: on the dead-letter table or the outbox, the same keys and filter
 * in both dialects. On SQL Server the pending index also carries (INCLUDE) every column
 * the claims and the statistics filter on, so that reading pending rows never needs the
 * clustered index: without them the optimizer may find a clustered scan cheaper than a
 * lookup per row, and a scan that takes shared or update locks on every row of the table
 * is what the claim's READPAST and the statistics' row locks are meant to avoid. Not on
 * PostgreSQL: a column in any index makes an UPDATE of it non-HOT, and the claim updates
 * lease_until and lease_token. That index has its own name on SQL Server (ms_suffix): a
 * table made before it had the columns gets the new index first, then loses the old one
 * (ms_ddl), and the two must be able to exist side by side meanwhile. */
static const struct {
    const char *suffix;
    bool        dead;
    const char *keys, *filter;
    const char *ms_suffix;    /* NULL: suffix; "": none on SQL Server */
    const char *ms_include;   /* NULL: none */
} index_desc[] = {
    { "pending_idx", false, "(id)", "sent_at IS NULL", "pending_cover_idx",
      "(available_at, lease_until, lease_token, partition_key, created_at)" },
    { "failing_idx", false, "(partition_key, id)", "sent_at IS NULL AND attempts > 0", 0, 0 },
    { "sent_idx",    false, "(sent_at)", "sent_at IS NOT NULL", 0, 0 },
    { "dead_at_idx", true,  "(dead_at)", NULL, 0, 0 },
    /* competing claims find a key's first pending row through this index */
    { "key_idx",     false, "(partition_key, id)", "sent_at IS NULL", 0, 0 },
    /* the pending rows delayed when written (or backing off): the claims hold a key's
       later rows behind one not due yet, and find them through this index, empty while no
       message is delayed. PostgreSQL only: a filtered index on SQL Server cannot compare
       two columns. */
    { OUTBOX_DELAYED_IDX, false, "(partition_key, available_at, id)",
      "sent_at IS NULL AND available_at > created_at", "", 0 },
};

char *outbox_producer_columns(void)
{
    outbox_util_buf b = { 0 };
    for (size_t i = 0; i < sizeof outbox_columns_desc / sizeof *outbox_columns_desc; i++)
        if (outbox_columns_desc[i].flags & C_PRODUCER)
            outbox_util_buf_printf(&b, "%s%s", b.len ? ", " : "", outbox_columns_desc[i].name);
    if (b.failed) {
        outbox_util_buf_free(&b);
        return NULL;
    }
    return b.p;
}

/* The column lines of one table (which: C_OUTBOX or C_DEAD) in dialect d, each ending in
 * ",\n"; a SQL Server default is a named constraint <table>_<column>_df. */
static void col_lines(outbox_util_buf *b, outbox_dialect d, const column *cols, size_t n,
                      unsigned which, const char *table_raw)
{
    for (size_t i = 0; i < n; i++) {
        const column *c = &cols[i];
        if (!(c->flags & which))
            continue;
        outbox_util_buf_printf(b, "    %-14s %s", c->name, c->type[d]);
        if ((c->flags & C_IDENTITY) && which == C_OUTBOX)
            outbox_util_buf_puts(b, d == OUTBOX_DIALECT_SQLSERVER ? " IDENTITY(1,1)"
                                                                 : " GENERATED BY DEFAULT AS IDENTITY");
        outbox_util_buf_puts(b, (c->flags & C_NULL) ? " NULL" : " NOT NULL");
        if (c->def[d] && (!(c->flags & C_DEF_OUT) || which == C_OUTBOX)) {
            if (d == OUTBOX_DIALECT_SQLSERVER) {
                char suffix[64], df[64];
                snprintf(suffix, sizeof suffix, "%s_df", c->name);
                outbox_derived_name(table_raw, suffix, df);
                outbox_util_buf_printf(b, " CONSTRAINT [%s]", df);
            }
            outbox_util_buf_printf(b, " DEFAULT %s", c->def[d]);
        }
        outbox_util_buf_puts(b, ",\n");
    }
}

#define NCOLS(a) (sizeof (a) / sizeof *(a))

/* The head of a CREATE TABLE in dialect d and its column lines; the caller appends the
 * table's constraints and the closing parenthesis. */
static void create_table(outbox_util_buf *b, outbox_dialect d, const char *qname,
                         const column *cols, size_t n, unsigned which, const char *raw)
{
    if (d == OUTBOX_DIALECT_SQLSERVER)
        outbox_util_buf_printf(b, "IF OBJECT_ID(N'%s', N'U') IS NULL\nCREATE TABLE %s (\n",
                               qname, qname);
    else
        outbox_util_buf_printf(b, "CREATE TABLE IF NOT EXISTS %s (\n", qname);
    col_lines(b, d, cols, n, which, raw);
}

typedef struct names {
    char tab[160], dead[160];     /* qualified */
    char s[64], t[64], d[64];     /* raw: schema, table, dead-letter table */
    char pkey[64], uniq[64], hdrchk[64];
    char fn[64], trg[64], dpkey[64];
    char lease[160], lease_raw[64], lpkey[64];
} names;

static void make_names(outbox_dialect d, const outbox_table_name *t, names *n)
{
    outbox_qualified(d, t, OUTBOX_TABLE_OUTBOX, n->tab, sizeof n->tab);
    outbox_qualified(d, t, OUTBOX_TABLE_DEAD, n->dead, sizeof n->dead);
    outbox_qualified(d, t, OUTBOX_TABLE_LEASE, n->lease, sizeof n->lease);
    snprintf(n->s, sizeof n->s, "%s", t->schema);
    snprintf(n->t, sizeof n->t, "%s", t->table);
    snprintf(n->d, sizeof n->d, "%s", t->dead);
    outbox_derived_name(t->table, "pkey", n->pkey);
    outbox_derived_name(t->table, "message_id_key", n->uniq);
    outbox_derived_name(t->table, "headers_check", n->hdrchk);
    outbox_derived_name(t->table, "notify", n->fn);
    outbox_derived_name(t->table, "notify_trg", n->trg);
    outbox_derived_name(t->dead, "pkey", n->dpkey);
    /* leadership lease row(s): <table>_lease (its raw name for its constraint's) */
    outbox_derived_name(t->table, "lease", n->lease_raw);
    outbox_derived_name(n->lease_raw, "pkey", n->lpkey);
}

typedef struct list {
    char **v;
    size_t n, cap;
    int failed;
} list;

static void add(list *l, outbox_util_buf *b)
{
    if (b->failed || l->failed) {
        l->failed = 1;
        outbox_util_buf_free(b);
        return;
    }
    if (l->n + 2 > l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        char **v = realloc(l->v, cap * sizeof *v);
        if (!v) {
            l->failed = 1;
            outbox_util_buf_free(b);
            return;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = b->p; /* ownership of the text passes to the list */
    l->v[l->n] = NULL;
    b->p = NULL;
    b->len = b->cap = 0;
}

/* One guarded PostgreSQL statement: ddl runs only when cond (SQL) is true, after a
 * notice "outbox: creating <what>" (init reports these: what it created, or, when a
 * statement fails, which object it could not create). An object that exists already is
 * not touched: no statement that locks the outbox table runs on a live system unless
 * something is missing (CREATE INDEX IF NOT EXISTS would take its lock first). Two
 * inits at once may both find an object missing: the one that loses the race finds it
 * created (duplicate_*, or a catalog unique_violation) and carries on. */
static void pg_guarded(list *l, const char *cond, const char *what, const char *ddl)
{
    outbox_util_buf b = { 0 };
    outbox_util_buf_printf(&b,
        "DO $outbox_init$\n"
        "BEGIN\n"
        "    IF %s THEN\n"
        "        RAISE NOTICE 'outbox: creating %s';\n"
        "        %s;\n"
        "    END IF;\n"
        "EXCEPTION WHEN duplicate_table OR duplicate_object OR duplicate_schema\n"
        "          OR duplicate_function OR unique_violation THEN\n"
        "    NULL;   -- created meanwhile by a concurrent init\n"
        "END\n"
        "$outbox_init$", cond, what, ddl);
    add(l, &b);
}

/* Formats into b (emptied first) for pg_guarded; a failure marks the list failed. */
static const char *fmt(list *l, outbox_util_buf *b, const char *f, ...)
    __attribute__((format(printf, 3, 4)));
static const char *fmt(list *l, outbox_util_buf *b, const char *f, ...)
{
    va_list ap;
    outbox_util_buf_free(b);
    va_start(ap, f);
    int n = vsnprintf(NULL, 0, f, ap);
    va_end(ap);
    char *tmp = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (tmp) {
        va_start(ap, f);
        vsnprintf(tmp, (size_t)n + 1, f, ap);
        va_end(ap);
        outbox_util_buf_put(b, tmp, (size_t)n);
        free(tmp);
    }
    if (!tmp || b->failed || !b->p)
        l->failed = 1;
    return b->p ? b->p : "";
}

/* A statement built with outbox_util_buf_printf, for pg_guarded. */
static const char *built(list *l, const outbox_util_buf *b)
{
    if (b->failed || !b->p)
        l->failed = 1;
    return b->p ? b->p : "";
}

static void pg_index(list *l, const names *n, const char *idx, const char *on, const char *keys,
                     const char *filter)
{
    outbox_util_buf c = { 0 }, w = { 0 }, d = { 0 };
    pg_guarded(l, fmt(l, &c, "to_regclass('\"%s\".\"%s\"') IS NULL", n->s, idx),
               fmt(l, &w, "index \"%s\" on %s", idx, on),
               fmt(l, &d, "CREATE INDEX \"%s\" ON %s %s%s%s", idx, on, keys,
                   filter ? " WHERE " : "", filter ? filter : ""));
    outbox_util_buf_free(&c);
    outbox_util_buf_free(&w);
    outbox_util_buf_free(&d);
}

/* The outbox table's fillfactor (see pg_ddl). */
#define PG_FILLFACTOR "50"

static void pg_ddl(list *l, const names *n)
{
    outbox_util_buf b = { 0 }, c = { 0 }, w = { 0 };

    pg_guarded(l, fmt(l, &c, "NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = '%s')", n->s),
               fmt(l, &w, "schema \"%s\"", n->s), fmt(l, &b, "CREATE SCHEMA IF NOT EXISTS \"%s\"", n->s));
    outbox_util_buf_free(&b);

    create_table(&b, OUTBOX_DIALECT_POSTGRES, n->tab, outbox_columns_desc, NCOLS(outbox_columns_desc),
                 C_OUTBOX, n->t);
    outbox_util_buf_printf(&b,
        "    CONSTRAINT \"%s\" PRIMARY KEY (id),\n"
        "    CONSTRAINT \"%s\" UNIQUE (message_id),\n"
        "    CONSTRAINT \"%s\" CHECK (headers IS NULL OR jsonb_typeof(headers) = 'object')\n"
        /* a queue table: room on each page lets the relay's lease updates be HOT
           (no new index entries), and vacuum keeps up with the churn */
        ") WITH (fillfactor = " PG_FILLFACTOR ", autovacuum_vacuum_scale_factor = 0.02, "
        "autovacuum_analyze_scale_factor = 0.02)", n->pkey, n->uniq, n->hdrchk);
    pg_guarded(l, fmt(l, &c, "to_regclass('%s') IS NULL", n->tab),
               fmt(l, &w, "table %s", n->tab), built(l, &b));
    outbox_util_buf_free(&b);

    /* Tables made with the earlier fillfactor (70) or none get this one: the claim's lease
       update is HOT only while the page has room for a new version of every row on it
       (each row is also rewritten by its mark), and a HOT claim costs PostgreSQL less than
       half of one that writes new index entries. SET (fillfactor) takes a SHARE UPDATE
       EXCLUSIVE lock, which producers' inserts do not wait for; it applies to pages filled
       from then on. A fillfactor chosen by hand is left alone. */
    pg_guarded(l, fmt(l, &c, "EXISTS (SELECT 1 FROM pg_class WHERE oid = '%s'::regclass "
                      "AND NOT coalesce(reloptions, '{}') && ARRAY['fillfactor=" PG_FILLFACTOR "'] "
                      "AND (reloptions IS NULL OR NOT EXISTS (SELECT 1 FROM unnest(reloptions) o "
                      "WHERE o LIKE 'fillfactor=%%' AND o <> 'fillfactor=70')))", n->tab),
               fmt(l, &w, "storage setting fillfactor = " PG_FILLFACTOR " on %s", n->tab),
               fmt(l, &b, "ALTER TABLE %s SET (fillfactor = " PG_FILLFACTOR ")", n->tab));
    outbox_util_buf_free(&b);

    create_table(&b, OUTBOX_DIALECT_POSTGRES, n->dead, outbox_columns_desc, NCOLS(outbox_columns_desc),
                 C_DEAD, n->d);
    outbox_util_buf_printf(&b, "    CONSTRAINT \"%s\" PRIMARY KEY (id)\n)", n->dpkey);
    pg_guarded(l, fmt(l, &c, "to_regclass('%s') IS NULL", n->dead),
               fmt(l, &w, "dead-letter table %s", n->dead), built(l, &b));
    outbox_util_buf_free(&b);

    /* tables made before message_id had a default get it (plain-SQL producers need not
       invent one); skipped when present, so init takes no lock on a current table */
    pg_guarded(l, fmt(l, &c, "NOT EXISTS (SELECT 1 FROM pg_attrdef d JOIN pg_attribute a\n"
                      "                   ON a.attrelid = d.adrelid AND a.attnum = d.adnum\n"
                      "                   WHERE d.adrelid = '%s'::regclass "
                      "AND a.attname = 'message_id')", n->tab),
               fmt(l, &w, "default gen_random_uuid() for %s.message_id", n->tab),
               fmt(l, &b, "ALTER TABLE %s ALTER COLUMN message_id SET DEFAULT gen_random_uuid()",
                   n->tab));
    outbox_util_buf_free(&b);

    for (size_t i = 0; i < NCOLS(index_desc); i++) {
        char idx[64];
        outbox_derived_name(index_desc[i].dead ? n->d : n->t, index_desc[i].suffix, idx);
        pg_index(l, n, idx, index_desc[i].dead ? n->dead : n->tab, index_desc[i].keys,
                 index_desc[i].filter);
    }

    /* the notify function: (re)written only when missing or different (no table lock
       either way, but a current one is left alone) */
    outbox_util_buf body = { 0 };
    outbox_util_buf_printf(&body,
        "\n"
        "BEGIN\n"
        "    PERFORM pg_notify('%s', '%s.%s');\n"
        "    RETURN NULL;\n"
        "END\n", OUTBOX_NOTIFY_CHANNEL, n->s, n->t);
    const char *bp = built(l, &body);
    pg_guarded(l, fmt(l, &c, "NOT EXISTS (SELECT 1 FROM pg_proc p JOIN pg_namespace s "
                      "ON s.oid = p.pronamespace\n"
                      "                   WHERE s.nspname = '%s' AND p.proname = '%s' "
                      "AND p.pronargs = 0 AND p.prosrc = $body$%s$body$)", n->s, n->fn, bp),
               fmt(l, &w, "function \"%s\".\"%s\"()", n->s, n->fn),
               fmt(l, &b, "CREATE OR REPLACE FUNCTION \"%s\".\"%s\"() RETURNS trigger\n"
                   "        LANGUAGE plpgsql AS $outbox$%s$outbox$", n->s, n->fn, bp));
    outbox_util_buf_free(&body);
    outbox_util_buf_free(&b);

    /* leadership: a lease row (owner, epoch = fencing token, expiry in database time) */
    create_table(&b, OUTBOX_DIALECT_POSTGRES, n->lease, lease_columns_desc, NCOLS(lease_columns_desc),
                 C_OUTBOX, n->lease_raw);
    outbox_util_buf_printf(&b, "    CONSTRAINT \"%s\" PRIMARY KEY (name)\n)", n->lpkey);
    pg_guarded(l, fmt(l, &c, "to_regclass('%s') IS NULL", n->lease),
               fmt(l, &w, "lease table %s", n->lease), built(l, &b));
    /* its leader row, expired and owned by nobody (''): a relay in competing mode locks it
       in each claim, which a lead then waits for (the two modes exclude each other) */
    pg_guarded(l, fmt(l, &c, "NOT EXISTS (SELECT 1 FROM %s WHERE name = 'leader')", n->lease),
               fmt(l, &w, "leader row in %s", n->lease),
               fmt(l, &b, "INSERT INTO %s (name, owner, epoch, expires_at) "
                   "VALUES ('leader', '', 0, 'epoch')", n->lease));
    outbox_util_buf_free(&b);

    /* the wake-up trigger: CREATE TRIGGER locks the table against producers, so it runs
       only when the trigger is missing */
    pg_guarded(l, fmt(l, &c, "NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = '%s'::regclass "
                      "AND tgname = '%s' AND NOT tgisinternal)", n->tab, n->trg),
               fmt(l, &w, "trigger \"%s\" on %s", n->trg, n->tab),
               fmt(l, &b, "CREATE TRIGGER \"%s\" AFTER INSERT ON %s\n"
                   "            FOR EACH STATEMENT EXECUTE FUNCTION \"%s\".\"%s\"()",
                   n->trg, n->tab, n->s, n->fn));
    outbox_util_buf_free(&b);
    outbox_util_buf_free(&c);
    outbox_util_buf_free(&w);
}

/* The index of index_desc[i] on SQL Server, created when missing.
 *
 * Missing: looked up by name in sys.indexes first, so that re-running init on a live
 * table takes no lock on it. An index that exists all the same is refused by the
 * CREATE INDEX with "already exists" and that error is caught: SQL Server raises 1913
 * when a concurrent init created it between the lookup and the CREATE; Babelfish (a
 * T-SQL engine on PostgreSQL) raises 2714 every time, since its sys.indexes shows an
 * index under an internal name (<name><table><hash>) and the lookup never finds it
 * there. Any other error is raised again.
 *
 * Online where the edition can build an index without blocking writers to the table
 * (SERVERPROPERTY('EngineEdition') 3: Enterprise, Developer, Evaluation; 5: Azure SQL
 * Database; 8: Azure SQL Managed Instance); elsewhere (Standard, Express; Babelfish
 * says 2) the build is offline and blocks the table's writers while it runs, which
 * init's lock timeout bounds only while waiting for the lock, not during the build. */
static void ms_index(list *l, size_t i, const names *n)
{
    char idx[64];
    const char *on = index_desc[i].dead ? n->dead : n->tab;
    outbox_util_buf b = { 0 }, def = { 0 };
    outbox_derived_name(index_desc[i].dead ? n->d : n->t,
                        index_desc[i].ms_suffix ? index_desc[i].ms_suffix : index_desc[i].suffix,
                        idx);
    outbox_util_buf_printf(&def, "CREATE INDEX [%s] ON %s %s", idx, on, index_desc[i].keys);
    if (index_desc[i].ms_include)
        outbox_util_buf_printf(&def, " INCLUDE %s", index_desc[i].ms_include);
    if (index_desc[i].filter)
        outbox_util_buf_printf(&def, " WHERE %s", index_desc[i].filter);
    const char *d = def.p ? def.p : "";
    outbox_util_buf_printf(&b,
        "IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'%s' "
        "AND object_id = OBJECT_ID(N'%s'))\n"
        "BEGIN\n"
        "    BEGIN TRY\n"
        "        IF CAST(SERVERPROPERTY('EngineEdition') AS int) IN (3, 5, 8)\n"
        "            %s WITH (ONLINE = ON);\n"
        "        ELSE\n"
        "            %s;\n"
        "    END TRY\n"
        "    BEGIN CATCH\n"
        "        IF ERROR_NUMBER() NOT IN (1913, 2714) THROW;\n"
        "    END CATCH\n"
        "END", idx, on, d, d);
    if (def.failed)
        l->failed = 1;
    outbox_util_buf_free(&def);
    add(l, &b);
}

/* A table made before the pending index carried its INCLUDE columns has a narrow index
 * (id) WHERE sent_at IS NULL, made as <table>_pending_idx or under any other name a
 * migration tool gave it; once the covering index exists, the narrow one is dropped (the
 * order keeps the claims on an index throughout). Both are recognized by their shape in
 * sys.index_columns, not by name: the narrow one is the outbox's only index whose one key
 * column is id, that is not the primary key and includes nothing; the covering one has key
 * id and includes created_at. What is dropped is the index found, by the name sys.indexes
 * gives it. Babelfish (a T-SQL engine on PostgreSQL) shows the same shapes but lists an
 * index as <name><table><32 hex digits> while DROP INDEX wants <name>: there the head is
 * taken (a name too long for that pattern, which Babelfish shortens, makes the DROP fail
 * and init say so). DROP INDEX takes a schema-modification lock, bounded by init's lock
 * timeout. */
static void ms_pending_migration(list *l, const names *n)
{
    outbox_util_buf b = { 0 };
    outbox_util_buf_printf(&b,
        "DECLARE @narrow sysname = (SELECT TOP (1) i.name FROM sys.indexes i "
        "WHERE i.object_id = OBJECT_ID(N'%s') "
        "AND i.type = 2 AND i.is_primary_key = 0 AND i.is_unique = 0\n"
        "        AND NOT EXISTS (SELECT 1 FROM sys.index_columns c WHERE c.object_id = i.object_id "
        "AND c.index_id = i.index_id AND (c.is_included_column = 1 OR c.key_ordinal > 1))\n"
        "        AND EXISTS (SELECT 1 FROM sys.index_columns c JOIN sys.columns k "
        "ON k.object_id = c.object_id AND k.column_id = c.column_id WHERE c.object_id = i.object_id "
        "AND c.index_id = i.index_id AND c.key_ordinal = 1 AND k.name = N'id') "
        "ORDER BY i.index_id);\n"
        "IF @narrow IS NOT NULL\n"
        "   AND EXISTS (SELECT 1 FROM sys.indexes i JOIN sys.index_columns c "
        "ON c.object_id = i.object_id AND c.index_id = i.index_id JOIN sys.columns k "
        "ON k.object_id = c.object_id AND k.column_id = c.column_id WHERE i.object_id = OBJECT_ID(N'%s') "
        "AND c.is_included_column = 1 AND k.name = N'created_at')\n"
        "BEGIN\n"
        "    IF @@VERSION LIKE N'%%Babelfish%%' AND LEN(@narrow) > 32 + LEN(N'%s')\n"
        "       AND RIGHT(@narrow, 32) NOT LIKE N'%%[^0-9a-f]%%'\n"
        "       AND SUBSTRING(@narrow, LEN(@narrow) - 31 - LEN(N'%s'), LEN(N'%s')) = N'%s'\n"
        "        SET @narrow = LEFT(@narrow, LEN(@narrow) - 32 - LEN(N'%s'));\n"
        "    DECLARE @drop nvarchar(max) = N'DROP INDEX ' + QUOTENAME(@narrow) + N' ON %s';\n"
        "    EXEC (@drop);\n"
        "END", n->tab, n->tab, n->t, n->t, n->t, n->t, n->t, n->tab);
    add(l, &b);
}

/* The SET options SQL Server requires to create filtered indexes and to change
 * rows of a table that has them (else Msg 1934), one statement per option.
 * QUOTED_IDENTIFIER takes effect when a batch is parsed, so it is set in a
 * batch of its own, before the batches that create the indexes; sqlcmd runs
 * with QUOTED_IDENTIFIER OFF unless given -I, the ODBC drivers with it ON. */
const char *const outbox_tsql_session_options =
    "SET QUOTED_IDENTIFIER ON;\n"
    "SET ANSI_NULLS ON;\n"
    "SET ANSI_PADDING ON;\n"
    "SET ANSI_WARNINGS ON;\n"
    "SET ARITHABORT ON;\n"
    "SET CONCAT_NULL_YIELDS_NULL ON;\n"
    "SET NUMERIC_ROUNDABORT OFF";  /* no trailing separator, like every DDL statement */

static void ms_ddl(list *l, const names *n)
{
    outbox_util_buf b = { 0 };

    outbox_util_buf_puts(&b, outbox_tsql_session_options);
    add(l, &b);

    outbox_util_buf_printf(&b, "IF SCHEMA_ID(N'%s') IS NULL EXEC(N'CREATE SCHEMA [%s]')",
                        n->s, n->s);
    add(l, &b);

    /* The message_id constraint is a plain unique one, not IGNORE_DUP_KEY: that
       option makes every INSERT take key-range locks (see lib/odbc.c). */
    create_table(&b, OUTBOX_DIALECT_SQLSERVER, n->tab, outbox_columns_desc, NCOLS(outbox_columns_desc),
                 C_OUTBOX, n->t);
    outbox_util_buf_printf(&b,
        "    CONSTRAINT [%s] PRIMARY KEY CLUSTERED (id),\n"
        "    CONSTRAINT [%s] UNIQUE (message_id),\n"
        "    CONSTRAINT [%s] CHECK (headers IS NULL OR ISJSON(headers) = 1)\n"
        ")", n->pkey, n->uniq, n->hdrchk);
    add(l, &b);

    create_table(&b, OUTBOX_DIALECT_SQLSERVER, n->dead, outbox_columns_desc, NCOLS(outbox_columns_desc),
                 C_DEAD, n->d);
    outbox_util_buf_printf(&b, "    CONSTRAINT [%s] PRIMARY KEY CLUSTERED (id)\n)", n->dpkey);
    add(l, &b);

    /* tables made before message_id had a default get it */
    char df_mid[64];
    outbox_derived_name(n->t, "message_id_df", df_mid);
    outbox_util_buf_printf(&b,
        "IF NOT EXISTS (SELECT 1 FROM sys.default_constraints "
        "WHERE parent_object_id = OBJECT_ID(N'%s') "
        "AND parent_column_id = COLUMNPROPERTY(OBJECT_ID(N'%s'), N'message_id', 'ColumnId'))\n"
        "    ALTER TABLE %s ADD CONSTRAINT [%s] DEFAULT NEWID() FOR message_id",
        n->tab, n->tab, n->tab, df_mid);
    add(l, &b);

    for (size_t i = 0; i < NCOLS(index_desc); i++)
        if (!index_desc[i].ms_suffix || *index_desc[i].ms_suffix)
            ms_index(l, i, n);
    ms_pending_migration(l, n);
    create_table(&b, OUTBOX_DIALECT_SQLSERVER, n->lease, lease_columns_desc, NCOLS(lease_columns_desc),
                 C_OUTBOX, n->lease_raw);
    outbox_util_buf_printf(&b, "    CONSTRAINT [%s] PRIMARY KEY CLUSTERED (name)\n)", n->lpkey);
    add(l, &b);
    /* its leader row, expired and owned by nobody (''), as on PostgreSQL: a competing claim
       holds it (HOLDLOCK) while it claims; on a missing row that read would lock the key
       range up to the first member row, which every renewal of that member then waits for */
    outbox_util_buf_printf(&b, "IF NOT EXISTS (SELECT 1 FROM %s WHERE name = N'leader')\n"
                           "    INSERT INTO %s (name, owner, epoch, expires_at) "
                           "VALUES (N'leader', N'', 0, '19700101')", n->lease, n->lease);
    add(l, &b);
}

char **outbox_ddl(outbox_dialect d, const outbox_table_name *t)
{
    if (!t)
        return NULL;
    names *n = malloc(sizeof *n);
    if (!n)
        return NULL;
    make_names(d, t, n);
    list l = { 0 };
    if (d == OUTBOX_DIALECT_SQLSERVER)
        ms_ddl(&l, n);
    else
        pg_ddl(&l, n);
    free(n);
    if (l.failed || !l.v) {
        if (l.v)
            outbox_ddl_free(l.v);
        return NULL;
    }
    return l.v; /* ownership passes to the caller: outbox_ddl_free */
}

void outbox_ddl_free(char **stmts)
{
    if (!stmts)
        return;
    for (char **p = stmts; *p; p++)
        free(*p);
    free(stmts);
}

char *outbox_ddl_script(outbox_dialect d, const outbox_table_name *t)
{
    char **v = outbox_ddl(d, t);
    if (!v)
        return NULL;
    outbox_util_buf b = { 0 };
    if (d == OUTBOX_DIALECT_POSTGRES)
        outbox_util_buf_printf(&b, "-- outbox DDL for PostgreSQL: \"%s\".\"%s\"\n", t->schema,
                            t->table);
    for (char **p = v; *p; p++) {
        outbox_util_buf_puts(&b, *p);
        if (d == OUTBOX_DIALECT_SQLSERVER && p == v)  /* after the SET options batch */
            outbox_util_buf_printf(&b, "\n-- outbox DDL for SQL Server: [%s].[%s]. The SET options "
                                "above must be in effect\n-- (sqlcmd: pass -I); init applies "
                                "them itself.", t->schema, t->table);
        outbox_util_buf_puts(&b, d == OUTBOX_DIALECT_SQLSERVER ? "\nGO\n" : ";\n");
    }
    outbox_ddl_free(v);
    if (b.failed) {
        outbox_util_buf_free(&b);
        return NULL;
    }
    return b.p; /* ownership passes to the caller: free() */
}
