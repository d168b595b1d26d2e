/*
 * sql_tsql.c — the relay's T-SQL (SQL Server) statements, in one place. The ODBC
 * source (sources/odbc/odbcsrc_db.c) runs them with `?` parameters; {T}, {D} and
 * {L} stand for the quoted outbox, dead-letter and lease tables. How each reads
 * and locks (READPAST, UPDLOCK, READCOMMITTEDLOCK) is explained at the top of
 * odbcsrc_db.c. The DDL is lib/schema.c's (outbox_ddl), shared with liboutbox;
 * PostgreSQL lives in sources/sql_pg.c.
 *
 * NOT RUN HERE: no SQL Server runs on the machines this project is tested on.
 * tests/test_source_contract.py and tests/test_tsql_capture.py run these
 * statements when OUTBOX_TEST_MSSQL names a server.
 */
#include "sources/sql_tsql.h"
#include "lib/outbox_schema.h"

/* Leadership. Parameters: owner, lease ms, epoch held (0 none). Result: our epoch
   (0: not leader), the holder before, its epoch, row leases released. */
const char sql_tsql_lead[] =
    "SET NOCOUNT ON; "
    "DECLARE @owner nvarchar(255) = ?, @lease int = ?, @mine bigint = ?; "
    "DECLARE @now datetime2 = SYSUTCDATETIME(), @cur_owner nvarchar(255), @cur_epoch bigint, "
    "@got bigint = 0, @reset int = 0; "
    "SELECT @cur_owner = owner, @cur_epoch = epoch FROM {L} WITH (UPDLOCK, HOLDLOCK) "
    "WHERE name = N'leader'; "
    "IF @cur_owner IS NULL "
    "BEGIN "
    "INSERT INTO {L} (name, owner, epoch, expires_at) "
    "VALUES (N'leader', @owner, 1, DATEADD(millisecond, @lease, @now)); "
    "SET @got = 1; "
    "END "
    "ELSE "
    "UPDATE {L} SET @got = CASE WHEN owner = @owner AND epoch = @mine THEN epoch "
    "ELSE epoch + 1 END, owner = @owner, "
    "epoch = CASE WHEN owner = @owner AND epoch = @mine THEN epoch ELSE epoch + 1 END, "
    "expires_at = DATEADD(millisecond, @lease, @now) "
    "WHERE name = N'leader' AND ((owner = @owner AND epoch = @mine) OR expires_at < @now); "
    "IF @got <> 0 AND @got <> @mine "
    "BEGIN "
    "UPDATE {T} WITH (READPAST, READCOMMITTEDLOCK) SET lease_owner = NULL, lease_token = NULL, "
    "lease_until = NULL WHERE sent_at IS NULL AND lease_token IS NOT NULL; "
    "SET @reset = @@ROWCOUNT; "
    "END "
    "SELECT @got, COALESCE(@cur_owner, N''), COALESCE(@cur_epoch, 0), @reset";

/* Claim. Parameters: limit, epoch, owner, epoch, owner, token, lease ms. */
const char sql_tsql_claim[] =
    "SET NOCOUNT ON; "
    "WITH c AS (SELECT TOP (?) m.* FROM {T} m WITH (ROWLOCK, READPAST, UPDLOCK) "
    "WHERE m.sent_at IS NULL AND m.available_at <= SYSUTCDATETIME() "
    "AND (m.lease_until IS NULL OR m.lease_until < SYSUTCDATETIME()) "
    "AND (m.partition_key IS NULL OR NOT EXISTS (SELECT 1 FROM {T} p "
    "WHERE p.partition_key = m.partition_key AND p.sent_at IS NULL AND p.attempts > 0 "
    "AND p.id < m.id)) "
    "AND (? = 0 OR EXISTS (SELECT 1 FROM {L} f WHERE f.name = N'leader' AND f.owner = ? "
    "AND f.epoch = ? AND f.expires_at > SYSUTCDATETIME())) ORDER BY m.id) "
    "UPDATE c SET lease_owner = ?, lease_token = ?, "
    "lease_until = DATEADD(millisecond, ?, SYSUTCDATETIME()) "
    "OUTPUT inserted.id, LOWER(CONVERT(nvarchar(36), inserted.message_id)), inserted.exchange, "
    "inserted.routing_key, inserted.partition_key, inserted.message_type, inserted.content_type, "
    "inserted.correlation_id, inserted.headers, inserted.payload, inserted.attempts, "
    "DATEDIFF_BIG(microsecond, CONVERT(datetime2, '1970-01-01'), inserted.created_at), "
    "DATEDIFF_BIG(microsecond, inserted.created_at, SYSUTCDATETIME())";

/* Competing-mode claim (see sql_pg_claim). Parameters: owner, lease ms, limit, token. */
const char sql_tsql_claim_competing[] =
    "SET NOCOUNT ON; "
    "DECLARE @owner nvarchar(255) = ?; "
    "DECLARE @lease_ms int = ?; "
    /* membership (see sources/sql_pg.h): renew ours, else reuse an expired member
       row, else insert one; a lease of 0 withdraws it */
    "DECLARE @me nvarchar(255) = N'member:' + @owner; "
    "DECLARE @until datetime2 = DATEADD(millisecond, @lease_ms, SYSUTCDATETIME()); "
    "UPDATE {L} SET expires_at = @until WHERE name = @me; "
    "IF @@ROWCOUNT = 0 AND @lease_ms > 0 BEGIN "
    "UPDATE {L} SET name = @me, owner = @owner, epoch = 0, expires_at = @until "
    "WHERE name = (SELECT TOP (1) x.name FROM {L} x WITH (ROWLOCK, READPAST, UPDLOCK) "
    "WHERE LEFT(x.name, 7) = N'member:' AND x.expires_at < SYSUTCDATETIME() ORDER BY x.name); "
    "IF @@ROWCOUNT = 0 INSERT INTO {L} (name, owner, epoch, expires_at) "
    "VALUES (@me, @owner, 0, @until); "
    "END; "
    "DECLARE @n int, @r int; "
    "SELECT @n = COUNT(*) + 1, @r = ISNULL(SUM(CASE WHEN owner < @owner THEN 1 ELSE 0 END), 0) "
    "FROM {L} WHERE LEFT(name, 7) = N'member:' AND owner <> @owner "
    "AND expires_at > SYSUTCDATETIME(); "
    "DECLARE @c0 TABLE (id bigint PRIMARY KEY, partition_key nvarchar(255)); "
    "INSERT INTO @c0 (id, partition_key) SELECT TOP (?) m.id, m.partition_key "
    "FROM {T} m WITH (ROWLOCK, READPAST, UPDLOCK) "
    "WHERE m.sent_at IS NULL AND m.available_at <= SYSUTCDATETIME() "
    "AND (m.lease_until IS NULL OR m.lease_until < SYSUTCDATETIME()) "
    "AND (m.partition_key IS NULL OR (CHECKSUM(m.partition_key) & 2147483647) % @n = @r) "
    "AND (m.partition_key IS NULL OR NOT EXISTS (SELECT 1 FROM (SELECT TOP (1) h.id, "
    "h.lease_owner, h.lease_until, h.available_at FROM {T} h WITH (READCOMMITTEDLOCK) "
    "WHERE h.partition_key = m.partition_key AND h.sent_at IS NULL ORDER BY h.id) hd "
    "WHERE hd.id < m.id AND ((hd.lease_until >= SYSUTCDATETIME() AND hd.lease_owner <> @owner) "
    "OR hd.available_at > SYSUTCDATETIME()))) ORDER BY m.id; "
    "DECLARE @g TABLE (partition_key nvarchar(255) PRIMARY KEY, gap bigint); "
    "INSERT INTO @g (partition_key, gap) SELECT k.partition_key, (SELECT TOP (1) p.id "
    "FROM {T} p WITH (READCOMMITTEDLOCK) WHERE p.partition_key = k.partition_key "
    "AND p.sent_at IS NULL AND (p.lease_owner IS NULL OR p.lease_owner <> @owner "
    "OR p.lease_until IS NULL OR p.lease_until < SYSUTCDATETIME()) "
    "AND p.id NOT IN (SELECT id FROM @c0) ORDER BY p.id) "
    "FROM (SELECT DISTINCT partition_key FROM @c0 WHERE partition_key IS NOT NULL) k; "
    "UPDATE m SET lease_owner = @owner, lease_token = ?, "
    "lease_until = @until "
    "OUTPUT inserted.id, LOWER(CONVERT(nvarchar(36), inserted.message_id)), inserted.exchange, "
    "inserted.routing_key, inserted.partition_key, inserted.message_type, inserted.content_type, "
    "inserted.correlation_id, inserted.headers, inserted.payload, inserted.attempts, "
    "DATEDIFF_BIG(microsecond, CONVERT(datetime2, '1970-01-01'), inserted.created_at), "
    "DATEDIFF_BIG(microsecond, inserted.created_at, SYSUTCDATETIME()) "
    "FROM {T} m JOIN @c0 c ON m.id = c.id LEFT JOIN @g g ON g.partition_key = c.partition_key "
    "WHERE c.partition_key IS NULL OR g.gap IS NULL OR c.id < g.gap";

/* Settle: head + (mark | delete) + tail. Parameter: the outcomes as JSON
   (odbcsrc_outcomes_json). Result: rows applied. */
const char sql_tsql_settle_head[] =
    "SET NOCOUNT ON; SET XACT_ABORT ON; "
    "DECLARE @o TABLE (id bigint NOT NULL PRIMARY KEY, token bigint NOT NULL, kind int NOT NULL, "
    "backoff_ms bigint NULL, reason nvarchar(max) NULL); "
    /* reasons are cut to REASON_MAX (2000) bytes: within JSON_VALUE's 4000 characters */
    "INSERT INTO @o (id, token, kind, backoff_ms, reason) "
    "SELECT CAST(JSON_VALUE(j.value, '$.id') AS bigint), "
    "CAST(JSON_VALUE(j.value, '$.token') AS bigint), CAST(JSON_VALUE(j.value, '$.kind') AS int), "
    "CAST(JSON_VALUE(j.value, '$.backoff_ms') AS bigint), JSON_VALUE(j.value, '$.reason') "
    "FROM OPENJSON(?) AS j; "
    "DECLARE @n bigint = 0; ";

const char sql_tsql_settle_mark[] =
    "UPDATE m SET sent_at = SYSUTCDATETIME(), lease_owner = NULL, lease_token = NULL, "
    "lease_until = NULL FROM {T} m JOIN @o o ON m.id = o.id AND m.lease_token = o.token "
    "WHERE o.kind = 0; SET @n = @n + @@ROWCOUNT; ";

const char sql_tsql_settle_delete[] =
    "DELETE m FROM {T} m JOIN @o o ON m.id = o.id AND m.lease_token = o.token "
    "WHERE o.kind = 0; SET @n = @n + @@ROWCOUNT; ";

const char sql_tsql_settle_tail[] =
    "UPDATE m SET attempts = m.attempts + 1, last_error = o.reason, "
    "available_at = DATEADD(millisecond, CAST(o.backoff_ms AS int), SYSUTCDATETIME()), "
    "lease_owner = NULL, lease_token = NULL, lease_until = NULL "
    "FROM {T} m JOIN @o o ON m.id = o.id AND m.lease_token = o.token WHERE o.kind = 1; "
    "SET @n = @n + @@ROWCOUNT; "
    "UPDATE m SET lease_owner = NULL, lease_token = NULL, lease_until = NULL "
    "FROM {T} m JOIN @o o ON m.id = o.id AND m.lease_token = o.token WHERE o.kind = 3; "
    "SET @n = @n + @@ROWCOUNT; "
    /* The dead-letter move, idempotent: a row already in the dead table under this
       id (a move retried after its commit acknowledgement was lost, a row put back
       by hand) is replaced, as ON CONFLICT DO UPDATE does on PostgreSQL, instead of
       failing the whole settle with a primary-key violation forever. */
    "DECLARE @d TABLE (id bigint NOT NULL PRIMARY KEY, message_id uniqueidentifier NOT NULL, "
    "exchange nvarchar(255) NOT NULL, routing_key nvarchar(255) NOT NULL, "
    "partition_key nvarchar(255) NULL, message_type nvarchar(255) NULL, "
    "content_type nvarchar(255) NULL, correlation_id nvarchar(255) NULL, "
    "headers nvarchar(max) NULL, payload varbinary(max) NOT NULL, created_at datetime2 NOT NULL, "
    "attempts int NOT NULL, reason nvarchar(max) NOT NULL); "
    "DELETE m OUTPUT deleted.id, deleted.message_id, deleted.exchange, deleted.routing_key, "
    "deleted.partition_key, deleted.message_type, deleted.content_type, deleted.correlation_id, "
    "deleted.headers, deleted.payload, deleted.created_at, deleted.attempts + 1, "
    "COALESCE(o.reason, N'dead-lettered') "
    "INTO @d (id, " OUTBOX_PRODUCER_COLS ", attempts, reason) "
    "FROM {T} m JOIN @o o ON m.id = o.id AND m.lease_token = o.token WHERE o.kind = 2; "
    "SET @n = @n + @@ROWCOUNT; "
    "DELETE x FROM {D} x JOIN @d d ON d.id = x.id; "
    "INSERT INTO {D} (id, " OUTBOX_PRODUCER_COLS ", attempts, reason) "
    "SELECT id, " OUTBOX_PRODUCER_COLS ", attempts, reason FROM @d; "
    "SELECT @n";

/* Retention. Parameters: limit, retention ms % 1000, retention s, epoch, owner, epoch. */
const char sql_tsql_cleanup[] =
    "DELETE TOP (?) FROM {T} WITH (READPAST, READCOMMITTEDLOCK) "
    "WHERE sent_at IS NOT NULL AND sent_at < "
    "DATEADD(millisecond, -?, DATEADD(second, -?, SYSUTCDATETIME())) "
    "AND (? = 0 OR EXISTS (SELECT 1 FROM {L} f WHERE f.name = N'leader' "
    "AND f.owner = ? AND f.epoch = ? AND f.expires_at > SYSUTCDATETIME()))";

/* Statistics (never waits for producers): backlog, oldest pending (s), dead rows, then
   sql_tsql_stats_kept or -1. */
const char sql_tsql_stats[] =
    "SELECT (SELECT COUNT_BIG(*) FROM {T} WITH (READPAST, READCOMMITTEDLOCK) "
    "WHERE sent_at IS NULL), "
    "CAST(COALESCE((SELECT DATEDIFF_BIG(microsecond, MIN(created_at), SYSUTCDATETIME()) "
    "FROM {T} WITH (READPAST, READCOMMITTEDLOCK) WHERE sent_at IS NULL), 0) AS float) / 1e6, "
    "(SELECT COUNT_BIG(*) FROM {D} WITH (READPAST, READCOMMITTEDLOCK)), ";

const char sql_tsql_stats_kept[] =
    "(SELECT COUNT_BIG(*) FROM {T} WITH (READPAST, READCOMMITTEDLOCK) "
    "WHERE sent_at IS NOT NULL)";

/* -> id, message_id, exchange, routing_key, attempts, dead_at (ISO 8601 UTC), reason */
const char sql_tsql_dead_list[] =
    "SELECT id, LOWER(CONVERT(nvarchar(36), message_id)), exchange, routing_key, attempts, "
    "CONVERT(nvarchar(23), dead_at, 126) + N'Z', reason FROM {D} ORDER BY id";

/* Dead letters back to the outbox (idempotent, never fails forever: see odbcsrc_db.c).
   Parameters: all (1/0), the ids as a JSON array. Result: rows moved. */
const char sql_tsql_dead_retry[] =
    "SET NOCOUNT ON; SET XACT_ABORT ON; "
    "DECLARE @all int = ?; "
    "DECLARE @ids TABLE (id bigint NOT NULL PRIMARY KEY); "
    "INSERT INTO @ids (id) SELECT d.id FROM {D} d WITH (UPDLOCK, ROWLOCK) "
    "WHERE @all = 1 OR d.id IN (SELECT CAST(j.value AS bigint) FROM OPENJSON(?) AS j); "
    "SET IDENTITY_INSERT {T} ON; "
    "INSERT INTO {T} (id, " OUTBOX_PRODUCER_COLS ", available_at, attempts) "
    "SELECT d.id, d.message_id, d.exchange, d.routing_key, d.partition_key, d.message_type, "
    "d.content_type, d.correlation_id, d.headers, d.payload, d.created_at, SYSUTCDATETIME(), 0 "
    "FROM {D} d JOIN @ids i ON i.id = d.id "
    "WHERE NOT EXISTS (SELECT 1 FROM {T} o WHERE o.id = d.id OR o.message_id = d.message_id); "
    "SET IDENTITY_INSERT {T} OFF; "
    "DELETE d FROM {D} d JOIN @ids i ON i.id = d.id "
    "WHERE EXISTS (SELECT 1 FROM {T} o WHERE o.id = d.id AND o.message_id = d.message_id); "
    "SELECT CAST(@@ROWCOUNT AS bigint)";

/* Parameters: all (1/0), the ids as a JSON array. */
const char sql_tsql_dead_purge[] =
    "DELETE FROM {D} WHERE ? = 1 OR id IN (SELECT CAST(j.value AS bigint) FROM OPENJSON(?) AS j)";

/* Parameters: the two tables' names. -> 1/0 each: the table exists. */
const char sql_tsql_tables_exist[] =
    "SELECT CASE WHEN OBJECT_ID(?, N'U') IS NULL THEN 0 ELSE 1 END, "
    "CASE WHEN OBJECT_ID(?, N'U') IS NULL THEN 0 ELSE 1 END";
