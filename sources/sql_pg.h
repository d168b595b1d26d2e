/*
 * sql_pg.h — PostgreSQL text shared by the libpq source (sources/pg/pgsrc_sql.c,
 * $n parameters, printf'd table names) and the psqlODBC path of the ODBC source
 * (sources/odbc/odbcsrc_db.c, ? parameters, {T}/{L} table names). Each macro
 * takes the table names and parameter markers in the caller's style and uses
 * every parameter marker once, so a `?` caller binds each value once.
 *
 * Competing mode spreads partition keys over the live instances. Each claim
 * renews this instance's member row in the lease table (name 'member:<owner>',
 * expires_at = now() + lease; a lease of 0 withdraws it), reusing an expired
 * member row when it has none, so the table stays as small as the largest set
 * of instances ever alive at once (no DELETE privilege needed). The claim then
 * takes keyed rows only of the keys that hash to this instance's rank among the
 * live members (owners in sort order). Membership is only a preference: the
 * per-key gap filter of the claim still keeps a key with whichever instance
 * holds its unsettled rows, so order holds while members come and go.
 */
#ifndef OUTBOX_SOURCES_SQL_PG_H
#define OUTBOX_SOURCES_SQL_PG_H

/* CTEs me, own, reuse, ins, mem. L: the lease table; OWNER: text; LEASE_MS: float8 */
#define SQL_PG_MEMBERSHIP(L, OWNER, LEASE_MS)                                              \
    "me AS (SELECT x.owner, 'member:' || x.owner AS name, "                                \
    "now() + x.ms * interval '1 millisecond' AS until "                                    \
    "FROM (SELECT " OWNER " AS owner, " LEASE_MS " AS ms) x), "                            \
    "own AS (UPDATE " L " l SET expires_at = me.until FROM me WHERE l.name = me.name "     \
    "RETURNING 1), "                                                                       \
    "reuse AS (UPDATE " L " l SET name = me.name, owner = me.owner, epoch = 0, "           \
    "expires_at = me.until FROM me, (SELECT o.name FROM " L " o "                          \
    "WHERE left(o.name, 7) = 'member:' AND o.expires_at < now() "                          \
    "AND NOT EXISTS (SELECT 1 FROM " L " x, me WHERE x.name = me.name) "                   \
    "ORDER BY o.name LIMIT 1 FOR UPDATE SKIP LOCKED) o "                                   \
    "WHERE l.name = o.name AND me.until > now() RETURNING 1), "                            \
    "ins AS (INSERT INTO " L " (name, owner, epoch, expires_at) "                          \
    "SELECT me.name, me.owner, 0, me.until FROM me WHERE me.until > now() "                \
    "AND NOT EXISTS (SELECT 1 FROM " L " x WHERE x.name = me.name) "                       \
    "AND NOT EXISTS (SELECT 1 FROM reuse) ON CONFLICT (name) DO NOTHING RETURNING 1), "    \
    "mem AS (SELECT count(*)::int + 1 AS n, "                                              \
    "(count(*) FILTER (WHERE l.owner < me.owner))::int AS r FROM " L " l, me "             \
    "WHERE left(l.name, 7) = 'member:' AND l.owner <> me.owner AND l.expires_at > now())"

/* Row M (an alias) is ours to take under the membership above: no key, or its
   key hashes to our rank. */
#define SQL_PG_MY_KEY(M)                                                                   \
    "(" M ".partition_key IS NULL OR mod(hashtext(" M ".partition_key) & 2147483647, "     \
    "(SELECT n FROM mem)) = (SELECT r FROM mem))"

#endif
