/*
 * sql_tsql.c — the relay's T-SQL (SQL Server) statements, in one place. The ODBC
 * source (sources/odbc/odbcsrc_db.c) runs them with `?` parameters; {T}, {D} and
 * {L} stand for the quoted outbox, dead-letter and lease tables. Each statement
 * opens by declaring its parameters (`DECLARE @name type = ?`), in the order of
 * the parameter table beside it, from which the source binds them by name. The
 * DDL is lib/schema.c's (outbox_ddl), shared with liboutbox; PostgreSQL lives in
 * sources/sql_pg.c.
 *
 * How they read and lock, with READ_COMMITTED_SNAPSHOT off (SQL Server's default,
 * where a plain read takes shared locks and waits for writers) as well as on:
 *   - rows to lease are read WITH (ROWLOCK, READPAST, UPDLOCK): a locking read that
 *     skips rows another transaction holds (a producer's uncommitted insert, another
 *     relay's claim);
 *   - the competing claim's membership count and its per-key head and gap probes
 *     read WITH (NOLOCK): they never wait. Membership is only a preference; in the
 *     probes a producer's uncommitted row (or a row another relay is claiming)
 *     counts as its key's holder, so that key waits a cycle while the statement
 *     never waits behind an application's open transaction;
 *   - a statement fenced by the leadership epoch reads the leader row WITH (UPDLOCK,
 *     HOLDLOCK) and so holds it to its commit: a takeover (whose lead reads the row
 *     WITH (XLOCK, HOLDLOCK)) waits for a claim in flight instead of resetting the
 *     leases around it; a competing claim holds it too (HOLDLOCK), see there;
 *   - no transaction waits on the client: the relay's sessions run with autocommit on
 *     and every request is one batch that is its own transaction: BEGIN TRANSACTION ...
 *     COMMIT TRANSACTION inside the batch, before the result set, which reads only
 *     variables and table variables. A relay frozen (SIGSTOP, a paused
 *     container) after sending a request holds no lock once the server has run it; with
 *     implicit transactions the leader row stayed locked until the client's COMMIT, and a
 *     takeover waited for as long as the freeze lasted. The session runs with XACT_ABORT
 *     ON: an error rolls the batch's transaction back (the source still ends any
 *     transaction an error left open, see odbcsrc_db.c);
 *   - statistics, the lease reset of a takeover and retention read WITH (READPAST,
 *     READCOMMITTEDLOCK): rows a producer has not committed carry no lease and are
 *     never sent, so skipping them is exact (or, for statistics, good enough);
 *   - a claim's UPDATE repeats the claimable conditions on the rows it writes: redundant
 *     on SQL Server (the rows are held WITH UPDLOCK since they were read), and what keeps
 *     two claims disjoint where reads are snapshots and locks are taken only by the write
 *     (Babelfish: the second claim waits for the first, then re-checks the row);
 *   - no statement touches more than SQL_TSQL_MAX_ROWS rows of a table (lock
 *     escalation); DML writes its OUTPUT INTO a table variable, then selects from it
 *     (OUTPUT without INTO fails on a table with a trigger, Msg 334), and converts
 *     only there.
 * These forms run on Babelfish for PostgreSQL too (the tests' T-SQL engine), which
 * refuses UPDATE through a CTE, CONVERT inside OUTPUT, UPDATE ... FROM ... LEFT JOIN
 * with OUTPUT and OUTPUT naming a joined table in DELETE.
 */
#include "sources/sql_tsql.h"
#include "lib/outbox_schema.h"

#define P_BIGINT(n) { n, SQL_C_SBIGINT, SQL_BIGINT, 0 }
#define P_INT(n)    { n, SQL_C_SLONG, SQL_INTEGER, 0 }
#define P_NAME(n)   { n, SQL_C_WCHAR, SQL_WVARCHAR, 255 }   /* nvarchar(255) */
#define P_TEXT(n)   { n, SQL_C_WCHAR, SQL_WVARCHAR, 0 }     /* nvarchar(max) */
#define NP(a) (sizeof(a) / sizeof((a)[0]))
#define STMT(var, text, params) \
    const sql_tsql_stmt var = { #var, text, params, NP(params) }
#define STMT0(var, text) const sql_tsql_stmt var = { #var, text, NULL, 0 }

/* A payload larger than @max_payload bytes (0: none is), which the sink could never
   publish: the claim leaves it in the database and returns its size instead (the last
   column), so the relay dead-letters the row without reading it (the server keeps its
   copy in @c; none crosses the wire). */
#define WITHHELD(M) "(@max_payload > 0 AND DATALENGTH(" M ".payload) > @max_payload)"

/* The leased rows' columns, from a table variable @c (converted here, not in OUTPUT). */
#define CLAIMED_TABLE \
    "DECLARE @c TABLE (id bigint NOT NULL PRIMARY KEY, message_id uniqueidentifier NOT NULL, " \
    "exchange nvarchar(255) NOT NULL, routing_key nvarchar(255) NOT NULL, " \
    "partition_key nvarchar(255) NULL, message_type nvarchar(255) NULL, " \
    "content_type nvarchar(255) NULL, correlation_id nvarchar(255) NULL, " \
    "headers nvarchar(max) NULL, payload varbinary(max) NOT NULL, attempts int NOT NULL, " \
    "created_at datetime2 NOT NULL); "
#define CLAIMED_OUTPUT \
    "OUTPUT inserted.id, inserted.message_id, inserted.exchange, inserted.routing_key, " \
    "inserted.partition_key, inserted.message_type, inserted.content_type, " \
    "inserted.correlation_id, inserted.headers, inserted.payload, inserted.attempts, " \
    "inserted.created_at INTO @c "
#define CLAIMED_SELECT \
    "SELECT id, LOWER(CONVERT(nvarchar(36), message_id)), exchange, routing_key, " \
    "partition_key, message_type, content_type, correlation_id, headers, " \
    "CASE WHEN " WITHHELD("c") " THEN NULL ELSE c.payload END, attempts, " \
    "DATEDIFF_BIG(microsecond, CONVERT(datetime2, '1970-01-01'), created_at), " \
    "DATEDIFF_BIG(microsecond, created_at, SYSUTCDATETIME()), " \
    "CASE WHEN " WITHHELD("c") " THEN CAST(DATALENGTH(c.payload) AS bigint) END " \
    "FROM @c c ORDER BY id"
/* A leased row's size for a claim's byte limit, an upper bound of what the relay counts
   of it once read (its payload plus its headers as UTF-8 text) that is exact when the
   headers are ASCII, as JSON headers usually are. The headers are nvarchar (UTF-16 on
   SQL Server): text of code points 1-127 only is as many UTF-8 bytes as characters
   (LEN of the text plus one character, so that trailing spaces count); other text at
   most 3/2 of its DATALENGTH, rounded up (a UTF-16 code unit is 1-3 UTF-8 bytes, a
   surrogate pair 4), which still bounds it where DATALENGTH counts UTF-8 (Babelfish).
   The range in the pattern compares code points only under a binary collation. */
#define ROW_BYTES(M) \
    "(CAST(COALESCE(DATALENGTH(" M ".payload), 0) AS bigint) + CASE " \
    "WHEN " M ".headers IS NULL THEN CAST(0 AS bigint) " \
    "WHEN " M ".headers COLLATE Latin1_General_BIN2 " \
    "LIKE N'%[^' + NCHAR(1) + N'-' + NCHAR(127) + N']%' " \
    "THEN (CAST(DATALENGTH(" M ".headers) AS bigint) * 3 + 1) / 2 " \
    "ELSE CAST(LEN(" M ".headers + N'.') AS bigint) - 1 END)"
/* What the byte limit counts of a row: its size, less a payload it leaves out */
#define CLAIMED_BYTES(M) \
    "(" ROW_BYTES(M) " - CASE WHEN " WITHHELD(M) " " \
    "THEN CAST(DATALENGTH(" M ".payload) AS bigint) ELSE CAST(0 AS bigint) END)"
/* Of candidates z (id, run: the running sum of their sizes in id order, rn: their
   rank), those within the byte limit: a prefix whose sum stays within @max_bytes
   (0: no limit), and the first whatever its size when @first_whole. */
#define WITHIN_BYTES(Z) \
    "(@max_bytes = 0 OR " Z ".run <= @max_bytes OR (" Z ".rn = 1 AND @first_whole = 1))"
#define RUN_OVER(C) \
    "SUM(" C ".sz) OVER (ORDER BY " C ".id ROWS UNBOUNDED PRECEDING) AS run, " \
    "ROW_NUMBER() OVER (ORDER BY " C ".id) AS rn"

/* A batch's own transaction (the session runs with autocommit on): see the top. */
#define TXN_BEGIN "BEGIN TRANSACTION; "
#define TXN_COMMIT "COMMIT TRANSACTION; "

#define S_(x) #x
#define S(x) S_(x)
#define MAX_ROWS S(SQL_TSQL_MAX_ROWS)

/* Leader mode and competing mode exclude each other on one outbox, as on PostgreSQL
   (sources/sql_pg.c, SQL_PG_LIVE_MEMBER): a live member row (competing mode) keeps the
   leadership from being taken or renewed (our own leader row then expires at once), a live
   leadership keeps a competing relay from claiming and from renewing its member row. */
#define LIVE_MEMBER                                                                        \
    "(SELECT MIN(x.owner) FROM {L} x WITH (NOLOCK) WHERE x.name LIKE N'member:%' "           \
    "AND x.expires_at > SYSUTCDATETIME())"
#define LIVE_LEADER                                                                        \
    "(SELECT x.owner FROM {L} x WITH (NOLOCK) WHERE x.name = N'leader' "                   \
    "AND x.expires_at > SYSUTCDATETIME())"

/* Leadership. Result: our epoch (0: not leader), the holder before ('' none, or the row
   init made), its epoch, row leases released (in batches: lock escalation), a live member
   that kept us out ('' none). The leader row is read WITH (XLOCK): a competing claim in
   flight holds it (S, to its commit), so the members are read only once that claim has
   committed and its member row is found; with UPDLOCK (compatible with S) the lead read
   them first, took over once the claim committed and reset the leases it had just taken. */
static const char lead_text[] =
    "SET NOCOUNT ON; "
    "DECLARE @owner nvarchar(255) = ?, @lease int = ?, @mine bigint = ?; "
    "DECLARE @now datetime2 = SYSUTCDATETIME(), @cur_owner nvarchar(255), @cur_epoch bigint, "
    "@got bigint = 0, @reset int = 0, @k int = " MAX_ROWS ", @member nvarchar(255); "
    TXN_BEGIN
    "SELECT @cur_owner = owner, @cur_epoch = epoch FROM {L} WITH (XLOCK, HOLDLOCK) "
    "WHERE name = N'leader'; "
    "SET @member = " LIVE_MEMBER "; "
    "IF @member IS NOT NULL "
    "BEGIN "
    "SET @got = 0; "
    "UPDATE {L} SET expires_at = @now WHERE name = N'leader' AND owner = @owner "
    "AND epoch = @mine AND expires_at > @now; "
    "END "
    "ELSE IF @cur_owner IS NULL "
    "BEGIN "
    "INSERT INTO {L} (name, owner, epoch, expires_at) "
    "VALUES (N'leader', @owner, 1, DATEADD(millisecond, @lease, @now)); "
    "SET @got = 1; "
    "END "
    "ELSE "
    "BEGIN "
    "DECLARE @e TABLE (epoch bigint NOT NULL); "
    "UPDATE {L} SET owner = @owner, "
    "epoch = CASE WHEN owner = @owner AND epoch = @mine THEN epoch ELSE epoch + 1 END, "
    "expires_at = DATEADD(millisecond, @lease, @now) OUTPUT inserted.epoch INTO @e (epoch) "
    "WHERE name = N'leader' AND ((owner = @owner AND epoch = @mine) OR expires_at < @now); "
    "SELECT @got = COALESCE(MAX(epoch), 0) FROM @e; "
    "END "
    "IF @got <> 0 AND @got <> @mine "
    "BEGIN "
    "WHILE @k = " MAX_ROWS " "
    "BEGIN "
    "UPDATE {T} WITH (READPAST, READCOMMITTEDLOCK) SET lease_owner = NULL, lease_token = NULL, "
    "lease_until = NULL WHERE id IN (SELECT TOP (" MAX_ROWS ") r.id FROM {T} r "
    "WITH (READPAST, READCOMMITTEDLOCK) WHERE r.sent_at IS NULL AND r.lease_token IS NOT NULL); "
    "SET @k = @@ROWCOUNT; "
    "SET @reset = @reset + @k; "
    "END "
    "END "
    TXN_COMMIT
    "SELECT @got, COALESCE(@cur_owner, N''), COALESCE(@cur_epoch, 0), @reset, "
    "COALESCE(@member, N'')";
static const sql_tsql_param lead_p[] = { P_NAME("owner"), P_INT("lease"), P_BIGINT("mine") };
STMT(sql_tsql_lead, lead_text, lead_p);

/* Row P (a prefix: "m." or "") may be taken: no live lease, or one of this relay's claims
   that failed without an answer leased it (@lost: their tokens, ",t1,t2,", from
   src_claim_args.lost; such a claim may have committed, and the relay never got its rows). */
#define CLAIMABLE(P)                                                                       \
    "(" P "lease_until IS NULL OR " P "lease_until < SYSUTCDATETIME() OR CHARINDEX(N',' + "  \
    "CAST(" P "lease_token AS nvarchar(20)) + N',', @lost) > 0)"

/* Claim (leader or unfenced): @epoch 0 is unfenced, else the leader row must be ours
   and is held to the batch's commit (a takeover's lead waits for the claim in flight). At
   most @limit rows, the prefix of them in id order within the byte limit (WITHIN_BYTES).
   A key waits behind its first failed pending row: those rows' first id per key is
   computed once per claim (@f, from the small filtered failing_idx) and joined by key;
   looked up per candidate row instead, every candidate cost a probe of its key's rows.
   It also waits behind its first pending row that is not due (delayed by its producer):
   a candidate whose key's first pending row is one is left out before the TOP, as in the
   competing claim, and one further on, behind the key's rows in flight, ends the key's
   candidates after it (@g: per key of the batch, its first such row up to its last
   candidate). Without it a delayed row was overtaken by the later rows of its key.
   The candidates go through a table variable (@c0), read WITH (UPDLOCK) and so held to
   the UPDATE; one level of derived tables per step keeps the batch quick to compile on
   Babelfish, where a batch is compiled once per session and the nested form took seconds. */
static const char claim_text[] =
    "SET NOCOUNT ON; "
    "DECLARE @limit int = ?, @epoch bigint = ?, @owner nvarchar(255) = ?, @token bigint = ?, "
    "@lease_ms int = ?, @max_bytes bigint = ?, @first_whole int = ?, @max_payload bigint = ?, "
    "@lost nvarchar(max) = ?; "
    "DECLARE @f TABLE (partition_key nvarchar(255) NOT NULL PRIMARY KEY, "
    "first_failed bigint NOT NULL); "
    "DECLARE @c0 TABLE (id bigint NOT NULL PRIMARY KEY, partition_key nvarchar(255) NULL, "
    "sz bigint NOT NULL); "
    "DECLARE @g TABLE (partition_key nvarchar(255) PRIMARY KEY, gap bigint); "
    CLAIMED_TABLE
    TXN_BEGIN
    /* one instant for every "is it due" of the batch: read in each statement, a row falling
       due between the candidates' read and @g's would be neither taken nor a gap */
    "DECLARE @now datetime2 = SYSUTCDATETIME(); "
    "IF @epoch = 0 OR (EXISTS (SELECT 1 FROM {L} f WITH (UPDLOCK, HOLDLOCK, ROWLOCK) "
    "WHERE f.name = N'leader' AND f.owner = @owner AND f.epoch = @epoch "
    "AND f.expires_at > SYSUTCDATETIME()) AND " LIVE_MEMBER " IS NULL) "
    "BEGIN "
    "INSERT INTO @f (partition_key, first_failed) SELECT p.partition_key, MIN(p.id) "
    "FROM {T} p WITH (NOLOCK) WHERE p.sent_at IS NULL AND p.attempts > 0 "
    "AND p.partition_key IS NOT NULL GROUP BY p.partition_key; "
    "INSERT INTO @c0 (id, partition_key, sz) SELECT TOP (@limit) m.id, m.partition_key, "
    CLAIMED_BYTES("m") " "
    "FROM {T} m WITH (ROWLOCK, READPAST, UPDLOCK) "
    "WHERE m.sent_at IS NULL AND m.available_at <= @now AND " CLAIMABLE("m.") " "
    "AND NOT EXISTS (SELECT 1 FROM @f k WHERE k.partition_key = m.partition_key "
    "AND k.first_failed < m.id) "
    "AND (m.partition_key IS NULL OR NOT EXISTS (SELECT 1 FROM (SELECT TOP (1) h.id, "
    "h.available_at FROM {T} h WITH (NOLOCK) WHERE h.partition_key = m.partition_key "
    "AND h.sent_at IS NULL ORDER BY h.id) hd "
    "WHERE hd.id < m.id AND hd.available_at > @now)) ORDER BY m.id; "
    "INSERT INTO @g (partition_key, gap) SELECT k.partition_key, (SELECT TOP (1) p.id "
    "FROM {T} p WITH (NOLOCK) WHERE p.partition_key = k.partition_key "
    "AND p.sent_at IS NULL AND p.available_at > @now AND p.id < k.last "
    "ORDER BY p.id) FROM (SELECT partition_key, MAX(id) AS last FROM @c0 "
    "WHERE partition_key IS NOT NULL GROUP BY partition_key) k; "
    "DELETE c FROM @c0 c JOIN @g g ON g.partition_key = c.partition_key WHERE c.id > g.gap; "
    "DELETE FROM @c0 WHERE id NOT IN (SELECT z.id FROM (SELECT c.id, " RUN_OVER("c") " "
    "FROM @c0 c) z WHERE " WITHIN_BYTES("z") "); "
    "UPDATE {T} WITH (ROWLOCK) SET lease_owner = @owner, lease_token = @token, "
    "lease_until = DATEADD(millisecond, @lease_ms, SYSUTCDATETIME()) "
    CLAIMED_OUTPUT
    "WHERE sent_at IS NULL AND " CLAIMABLE("") " AND id IN (SELECT id FROM @c0); "
    "END "
    TXN_COMMIT
    CLAIMED_SELECT;
static const sql_tsql_param claim_p[] = { P_INT("limit"), P_BIGINT("epoch"), P_NAME("owner"),
                                          P_BIGINT("token"), P_INT("lease_ms"),
                                          P_BIGINT("max_bytes"), P_INT("first_whole"),
                                          P_BIGINT("max_payload"), P_TEXT("lost") };
STMT(sql_tsql_claim, claim_text, claim_p);

/* Competing-mode claim (see sql_pg_claim), within the byte limit as the claim above. */
static const char claim_competing_text[] =
    "SET NOCOUNT ON; "
    "DECLARE @owner nvarchar(255) = ?, @lease_ms int = ?, @limit int = ?, @token bigint = ?, "
    "@max_bytes bigint = ?, @first_whole int = ?, @max_payload bigint = ?, "
    "@lost nvarchar(max) = ?; "
    /* membership (see sources/sql_pg.h): renew ours, else reuse an expired member
       row, else insert one; a lease of 0 withdraws it, a live leadership (@kept) leaves
       it as it is and the claim takes nothing. By primary key only (the
       name LIKE a constant prefix is a seek). Each statement commits on its own, before
       the claim's transaction: no member row stays locked while the claim runs. */
    "DECLARE @kept int = 0; "
    /* the leader row, made by init; made here on a table of an earlier version (another
       relay making it at the same moment: the primary key refuses one, which is fine) */
    "IF NOT EXISTS (SELECT 1 FROM {L} WITH (NOLOCK) WHERE name = N'leader') "
    "BEGIN TRY INSERT INTO {L} (name, owner, epoch, expires_at) "
    "VALUES (N'leader', N'', 0, '19700101'); END TRY BEGIN CATCH SET @kept = 0; END CATCH; "
    "IF @lease_ms > 0 AND " LIVE_LEADER " IS NOT NULL SELECT @kept = 1, @limit = 0; "
    "DECLARE @me nvarchar(255) = N'member:' + @owner; "
    "DECLARE @until datetime2 = DATEADD(millisecond, @lease_ms, SYSUTCDATETIME()); "
    "UPDATE {L} SET expires_at = @until WHERE name = @me AND @kept = 0; "
    "IF @@ROWCOUNT = 0 AND @lease_ms > 0 AND @kept = 0 BEGIN "
    "UPDATE {L} SET name = @me, owner = @owner, epoch = 0, expires_at = @until "
    "WHERE name = (SELECT TOP (1) x.name FROM {L} x WITH (ROWLOCK, READPAST, UPDLOCK) "
    "WHERE x.name LIKE N'member:%' AND x.expires_at < SYSUTCDATETIME() ORDER BY x.name); "
    "IF @@ROWCOUNT = 0 INSERT INTO {L} (name, owner, epoch, expires_at) "
    "VALUES (@me, @owner, 0, @until); "
    "END; "
    /* the other members, read without locks: never waits for another relay's renewal */
    "DECLARE @n int, @r int; "
    "SELECT @n = COUNT(*) + 1, @r = ISNULL(SUM(CASE WHEN owner < @owner THEN 1 ELSE 0 END), 0) "
    "FROM {L} WITH (NOLOCK) WHERE name LIKE N'member:%' AND owner <> @owner "
    "AND expires_at > SYSUTCDATETIME(); "
    "DECLARE @c0 TABLE (id bigint PRIMARY KEY, partition_key nvarchar(255), sz bigint NOT NULL); "
    CLAIMED_TABLE
    /* the candidates stay held (UPDLOCK) from their read to the UPDATE. First the leader
       row, read again WITH (HOLDLOCK) and so held to the commit: a lead in flight (it holds
       the row WITH (XLOCK)) is waited for and then seen, and a lead after this read waits
       for this claim's commit, then finds our member row (committed above) and does not
       lead. Read only WITH (NOLOCK) above, a lead and this claim could both go on at the
       same moment, and a claim of the new leader take later rows of the keys this one
       takes. */
    TXN_BEGIN
    "IF @lease_ms > 0 AND EXISTS (SELECT 1 FROM {L} x WITH (HOLDLOCK, ROWLOCK) "
    "WHERE x.name = N'leader' AND x.expires_at > SYSUTCDATETIME()) SET @limit = 0; "
    "INSERT INTO @c0 (id, partition_key, sz) SELECT TOP (@limit) m.id, m.partition_key, "
    CLAIMED_BYTES("m") " "
    "FROM {T} m WITH (ROWLOCK, READPAST, UPDLOCK) "
    "WHERE m.sent_at IS NULL AND m.available_at <= SYSUTCDATETIME() AND " CLAIMABLE("m.") " "
    "AND (m.partition_key IS NULL OR (CHECKSUM(m.partition_key) & 2147483647) % @n = @r) "
    "AND (m.partition_key IS NULL OR NOT EXISTS (SELECT 1 FROM (SELECT TOP (1) h.id, "
    "h.lease_owner, h.lease_until, h.available_at FROM {T} h WITH (NOLOCK) "
    "WHERE h.partition_key = m.partition_key AND h.sent_at IS NULL ORDER BY h.id) hd "
    "WHERE hd.id < m.id AND ((hd.lease_until >= SYSUTCDATETIME() AND hd.lease_owner <> @owner) "
    "OR hd.available_at > SYSUTCDATETIME()))) ORDER BY m.id; "
    /* each key's first pending row that is not ours (a producer's uncommitted row
       too): the claimed rows of that key after it wait */
    "DECLARE @g TABLE (partition_key nvarchar(255) PRIMARY KEY, gap bigint); "
    "INSERT INTO @g (partition_key, gap) SELECT k.partition_key, (SELECT TOP (1) p.id "
    "FROM {T} p WITH (NOLOCK) WHERE p.partition_key = k.partition_key "
    "AND p.sent_at IS NULL AND (p.lease_owner IS NULL OR p.lease_owner <> @owner "
    "OR " CLAIMABLE("p.") ") "
    "AND p.id NOT IN (SELECT id FROM @c0) ORDER BY p.id) "
    "FROM (SELECT DISTINCT partition_key FROM @c0 WHERE partition_key IS NOT NULL) k; "
    "DELETE c FROM @c0 c JOIN @g g ON g.partition_key = c.partition_key WHERE c.id > g.gap; "
    /* then the byte limit, over what is left: a prefix in id order */
    "DELETE FROM @c0 WHERE id NOT IN (SELECT z.id FROM (SELECT c.id, " RUN_OVER("c") " "
    "FROM @c0 c) z WHERE " WITHIN_BYTES("z") "); "
    "UPDATE {T} WITH (ROWLOCK) SET lease_owner = @owner, lease_token = @token, "
    "lease_until = @until "
    CLAIMED_OUTPUT
    "WHERE sent_at IS NULL AND " CLAIMABLE("") " AND id IN (SELECT id FROM @c0); "
    TXN_COMMIT
    CLAIMED_SELECT;
static const sql_tsql_param claim_competing_p[] = { P_NAME("owner"), P_INT("lease_ms"),
                                                    P_INT("limit"), P_BIGINT("token"),
                                                    P_BIGINT("max_bytes"),
                                                    P_INT("first_whole"),
                                                    P_BIGINT("max_payload"), P_TEXT("lost") };
STMT(sql_tsql_claim_competing, claim_competing_text, claim_competing_p);

/* Settle: head + (mark | delete) + tail, for at most SQL_TSQL_MAX_ROWS outcomes, in the
   batch's own transaction (the source splits larger settles, nested in one transaction
   it opens itself: see odbcsrc_db_settle). Parameter: the outcomes as
   JSON (odbcsrc_outcomes_json). Result: rows applied. */
static const char settle_head_text[] =
    "SET NOCOUNT ON; SET XACT_ABORT ON; "
    "DECLARE @outcomes nvarchar(max) = ?; "
    "DECLARE @o TABLE (id bigint NOT NULL PRIMARY KEY, token bigint NOT NULL, kind int NOT NULL, "
    "backoff_ms bigint NULL, reason nvarchar(max) NULL); "
    /* reasons are cut to REASON_MAX (2000) bytes: within JSON_VALUE's 4000 characters */
    "INSERT INTO @o (id, token, kind, backoff_ms, reason) "
    "SELECT CAST(JSON_VALUE(j.value, '$.id') AS bigint), "
    "CAST(JSON_VALUE(j.value, '$.token') AS bigint), CAST(JSON_VALUE(j.value, '$.kind') AS int), "
    "CAST(JSON_VALUE(j.value, '$.backoff_ms') AS bigint), JSON_VALUE(j.value, '$.reason') "
    "FROM OPENJSON(@outcomes) AS j; "
    "DECLARE @n bigint = 0; "
    TXN_BEGIN;
static const sql_tsql_param settle_head_p[] = { P_TEXT("outcomes") };
STMT(sql_tsql_settle_head, settle_head_text, settle_head_p);

STMT0(sql_tsql_settle_mark,
    "UPDATE m SET sent_at = SYSUTCDATETIME(), lease_owner = NULL, lease_token = NULL, "
    "lease_until = NULL FROM {T} m JOIN @o o ON m.id = o.id AND m.lease_token = o.token "
    "WHERE o.kind = 0; SET @n = @n + @@ROWCOUNT; ");

STMT0(sql_tsql_settle_delete,
    "DELETE m FROM {T} m JOIN @o o ON m.id = o.id AND m.lease_token = o.token "
    "WHERE o.kind = 0; SET @n = @n + @@ROWCOUNT; ");

/* A row's attempts after one more failed (A: its count now): a count outside 0..2^31 - 2
   (written by hand) is taken as its nearest bound, so the sum never overflows int (the
   error would roll back the whole settle, every row in it, again and again), as the ledger
   counts (ledger.c, attempt_failed). */
#define SQL_TSQL_ATTEMPT_NEXT(A)                                                           \
    "(CASE WHEN " A " < 0 THEN 1 WHEN " A " >= 2147483647 THEN 2147483647 ELSE " A " + 1 END)"

STMT0(sql_tsql_settle_tail,
    "UPDATE m SET attempts = " SQL_TSQL_ATTEMPT_NEXT("m.attempts") ", last_error = o.reason, "
    /* DATEADD takes an int: the back-off (up to retry_backoff_max, 30 days) in minutes,
       then the rest in milliseconds, as liboutbox's delay */
    "available_at = DATEADD(millisecond, CAST(o.backoff_ms % 60000 AS int), "
    "DATEADD(minute, CAST(o.backoff_ms / 60000 AS int), SYSUTCDATETIME())), "
    "lease_owner = NULL, lease_token = NULL, lease_until = NULL "
    "FROM {T} m JOIN @o o ON m.id = o.id AND m.lease_token = o.token WHERE o.kind = 1; "
    "SET @n = @n + @@ROWCOUNT; "
    "UPDATE m SET lease_owner = NULL, lease_token = NULL, lease_until = NULL "
    "FROM {T} m JOIN @o o ON m.id = o.id AND m.lease_token = o.token WHERE o.kind = 3; "
    "SET @n = @n + @@ROWCOUNT; "
    /* The dead-letter move, idempotent: a row already in the dead table under this
       id (a move retried after its commit acknowledgement was lost, a row put back
       by hand) is replaced, as ON CONFLICT DO UPDATE does on PostgreSQL, instead of
       failing the whole settle with a primary-key violation forever. OUTPUT names
       only the deleted row; the reason joins in afterwards. */
    "DECLARE @d TABLE (id bigint NOT NULL PRIMARY KEY, message_id uniqueidentifier NOT NULL, "
    "exchange nvarchar(255) NOT NULL, routing_key nvarchar(255) NOT NULL, "
    "partition_key nvarchar(255) NULL, message_type nvarchar(255) NULL, "
    "content_type nvarchar(255) NULL, correlation_id nvarchar(255) NULL, "
    "headers nvarchar(max) NULL, payload varbinary(max) NOT NULL, created_at datetime2 NOT NULL, "
    "attempts int NOT NULL); "
    "DELETE m OUTPUT deleted.id, deleted.message_id, deleted.exchange, deleted.routing_key, "
    "deleted.partition_key, deleted.message_type, deleted.content_type, deleted.correlation_id, "
    "deleted.headers, deleted.payload, deleted.created_at, deleted.attempts "
    "INTO @d (id, " OUTBOX_PRODUCER_COLS ", attempts) "
    "FROM {T} m WHERE EXISTS (SELECT 1 FROM @o o WHERE o.id = m.id AND o.token = m.lease_token "
    "AND o.kind = 2); "
    "SET @n = @n + @@ROWCOUNT; "
    "DELETE x FROM {D} x JOIN @d d ON d.id = x.id; "
    "INSERT INTO {D} (id, " OUTBOX_PRODUCER_COLS ", attempts, reason) "
    "SELECT d.id, d.message_id, d.exchange, d.routing_key, d.partition_key, d.message_type, "
    "d.content_type, d.correlation_id, d.headers, d.payload, d.created_at, "
    SQL_TSQL_ATTEMPT_NEXT("d.attempts") ", "
    "COALESCE(o.reason, N'dead-lettered') FROM @d d JOIN @o o ON o.id = d.id; "
    TXN_COMMIT
    "SELECT @n");

/* Retention: at most @limit rows (the configuration keeps it within
   SQL_TSQL_MAX_ROWS; the relay repeats while a batch was full). Result: rows deleted. */
static const char cleanup_text[] =
    "SET NOCOUNT ON; "
    "DECLARE @limit int = ?, @keep_ms int = ?, @keep_s int = ?, @epoch bigint = ?, "
    "@owner nvarchar(255) = ?; "
    "DECLARE @deleted bigint = 0; "
    TXN_BEGIN
    "IF @epoch = 0 OR EXISTS (SELECT 1 FROM {L} f WITH (UPDLOCK, HOLDLOCK, ROWLOCK) "
    "WHERE f.name = N'leader' AND f.owner = @owner AND f.epoch = @epoch "
    "AND f.expires_at > SYSUTCDATETIME()) "
    "BEGIN "
    "DELETE TOP (@limit) FROM {T} WITH (READPAST, READCOMMITTEDLOCK) "
    "WHERE sent_at IS NOT NULL AND sent_at < "
    "DATEADD(millisecond, -@keep_ms, DATEADD(second, -@keep_s, SYSUTCDATETIME())); "
    "SET @deleted = @@ROWCOUNT; "
    "END "
    TXN_COMMIT
    "SELECT @deleted";
static const sql_tsql_param cleanup_p[] = { P_INT("limit"), P_INT("keep_ms"), P_INT("keep_s"),
                                            P_BIGINT("epoch"), P_NAME("owner") };
STMT(sql_tsql_cleanup, cleanup_text, cleanup_p);

/* Statistics (never waits for producers): backlog, oldest pending (s), dead rows, then
   sql_tsql_stats_kept or -1. A row not due yet (delayed by its producer, or backing off)
   counts in neither, and once due its age counts from then, as on PostgreSQL
   (sources/sql_pg.c, STATS_HEAD); the columns read are in pending_cover_idx. */
STMT0(sql_tsql_stats,
    "SELECT (SELECT COUNT_BIG(*) FROM {T} WITH (READPAST, READCOMMITTEDLOCK) "
    "WHERE sent_at IS NULL AND available_at <= SYSUTCDATETIME()), "
    "CAST(COALESCE((SELECT DATEDIFF_BIG(microsecond, MIN(CASE WHEN available_at > created_at "
    "THEN available_at ELSE created_at END), SYSUTCDATETIME()) "
    "FROM {T} WITH (READPAST, READCOMMITTEDLOCK) WHERE sent_at IS NULL "
    "AND available_at <= SYSUTCDATETIME()), 0) AS float) / 1e6, "
    "(SELECT COUNT_BIG(*) FROM {D} WITH (READPAST, READCOMMITTEDLOCK)), ");

/* Appended to the statistics: the relay holding the leadership lease (NULL: none; a relay
   in competing mode waits while there is one). */
STMT0(sql_tsql_stats_leader, ", " LIVE_LEADER);

STMT0(sql_tsql_stats_kept,
    "(SELECT COUNT_BIG(*) FROM {T} WITH (READPAST, READCOMMITTEDLOCK) "
    "WHERE sent_at IS NOT NULL)");

/* -> id, message_id, exchange, routing_key, attempts, dead_at (ISO 8601 UTC), reason.
   (Babelfish writes style 126 with a space for the T: the REPLACE makes both alike.) */
STMT0(sql_tsql_dead_list,
    "SELECT id, LOWER(CONVERT(nvarchar(36), message_id)), exchange, routing_key, attempts, "
    "REPLACE(CONVERT(nvarchar(23), dead_at, 126), N' ', N'T') + N'Z', reason FROM {D} "
    "ORDER BY id");

/* Dead letters back to the outbox, in batches of SQL_TSQL_MAX_ROWS ids (idempotent,
   never fails forever: see odbcsrc_db.c). Parameters: all (1/0), the ids as a JSON
   array. Result: rows moved. */
static const char dead_retry_text[] =
    "SET NOCOUNT ON; SET XACT_ABORT ON; "
    "DECLARE @all int = ?, @list nvarchar(max) = ?; "
    "DECLARE @ids TABLE (id bigint NOT NULL PRIMARY KEY); "
    "DECLARE @moved bigint = 0, @from bigint = -9223372036854775807 - 1, @k int = " MAX_ROWS "; "
    "WHILE @k = " MAX_ROWS " "
    "BEGIN "
    "DELETE FROM @ids; "
    "INSERT INTO @ids (id) SELECT TOP (" MAX_ROWS ") d.id FROM {D} d WITH (UPDLOCK, ROWLOCK) "
    "WHERE d.id > @from AND (@all = 1 OR d.id IN (SELECT CAST(j.value AS bigint) "
    "FROM OPENJSON(@list) AS j)) ORDER BY d.id; "
    "SET @k = @@ROWCOUNT; "
    "IF @k = 0 BREAK; "
    "SELECT @from = MAX(id) FROM @ids; "
    "SET IDENTITY_INSERT {T} ON; "
    "INSERT INTO {T} (id, " OUTBOX_PRODUCER_COLS ", available_at, attempts) "
    "SELECT d.id, d.message_id, d.exchange, d.routing_key, d.partition_key, d.message_type, "
    "d.content_type, d.correlation_id, d.headers, d.payload, d.created_at, SYSUTCDATETIME(), 0 "
    "FROM {D} d JOIN @ids i ON i.id = d.id "
    "WHERE NOT EXISTS (SELECT 1 FROM {T} o WHERE o.id = d.id OR o.message_id = d.message_id); "
    "SET IDENTITY_INSERT {T} OFF; "
    "DELETE d FROM {D} d JOIN @ids i ON i.id = d.id "
    "WHERE EXISTS (SELECT 1 FROM {T} o WHERE o.id = d.id AND o.message_id = d.message_id); "
    "SET @moved = @moved + @@ROWCOUNT; "
    "END "
    "SELECT @moved";
static const sql_tsql_param dead_move_p[] = { P_INT("all"), P_TEXT("list") };
STMT(sql_tsql_dead_retry, dead_retry_text, dead_move_p);

/* Result: rows deleted, in batches of SQL_TSQL_MAX_ROWS. */
static const char dead_purge_text[] =
    "SET NOCOUNT ON; "
    "DECLARE @all int = ?, @list nvarchar(max) = ?; "
    "DECLARE @purged bigint = 0, @k int = " MAX_ROWS "; "
    "WHILE @k = " MAX_ROWS " "
    "BEGIN "
    "DELETE TOP (" MAX_ROWS ") FROM {D} WHERE @all = 1 "
    "OR id IN (SELECT CAST(j.value AS bigint) FROM OPENJSON(@list) AS j); "
    "SET @k = @@ROWCOUNT; "
    "SET @purged = @purged + @k; "
    "END "
    "SELECT @purged";
STMT(sql_tsql_dead_purge, dead_purge_text, dead_move_p);

/* -> 1/0 each: the outbox, dead-letter and leadership lease table exists. */
static const char tables_exist_text[] =
    "DECLARE @outbox nvarchar(255) = ?, @dead nvarchar(255) = ?, @lease nvarchar(255) = ?; "
    "SELECT CASE WHEN OBJECT_ID(@outbox, N'U') IS NULL THEN 0 ELSE 1 END, "
    "CASE WHEN OBJECT_ID(@dead, N'U') IS NULL THEN 0 ELSE 1 END, "
    "CASE WHEN OBJECT_ID(@lease, N'U') IS NULL THEN 0 ELSE 1 END";
static const sql_tsql_param tables_exist_p[] = { P_NAME("outbox"), P_NAME("dead"),
                                                 P_NAME("lease") };
STMT(sql_tsql_tables_exist, tables_exist_text, tables_exist_p);

/* -> the server's @@VERSION (Babelfish for PostgreSQL names itself there). */
STMT0(sql_tsql_version, "SELECT CAST(@@VERSION AS nvarchar(4000))");

/* -> the database's compatibility level (asked only of SQL Server: on Babelfish a first
   catalog view read of a session takes about a second). */
STMT0(sql_tsql_compat,
    "SELECT CAST(compatibility_level AS int) FROM sys.databases WHERE name = DB_NAME()");

/* ------------------------------------------------------------ table health
   The outbox table's health on SQL Server (sources/odbc/odbcsrc_health.c runs one of these
   every health_interval), each part a statement of its own so that one the relay's login
   may not read, or a server without that view, leaves the others working:
     - rows and pages from sys.dm_db_partition_stats (VIEW DATABASE STATE; VIEW DATABASE
       PERFORMANCE STATE on SQL Server 2022 and later): rows of the heap or clustered
       index, used and reserved 8 KiB pages of the table with its indexes and LOB data.
       Without it, the rows alone from sys.partitions (metadata, readable with SELECT on
       the table: an estimate, -1 where the engine does not know yet);
     - ghost records (rows deleted, or moved out of an index by an update of its key, that
       the ghost cleanup task has not removed yet) and version ghost records (kept for a
       transaction that reads row versions), leaf level of every index, from
       sys.dm_db_index_physical_stats in SAMPLED mode (VIEW DATABASE STATE): it reads the
       index pages (all of them below 10,000 pages, a 1% sample above), so the source runs
       it only in every 10th round of reads. The object id is checked first: the function given
       a NULL object id reports every table of the database;
     - whether the database keeps row versions (READ_COMMITTED_SNAPSHOT or SNAPSHOT
       isolation: sys.databases, readable for the current database by any login) and, when
       it does, the version store's size for this database
       (sys.dm_tran_version_store_space_usage) and the oldest transaction that reads or
       makes row versions (sys.dm_tran_active_snapshot_database_transactions, with its
       session's program_name from sys.dm_exec_sessions): while it runs, the versions and
       the ghost records it may still read stay. Both views need VIEW SERVER STATE (VIEW
       SERVER PERFORMANCE STATE on 2022 and later); the version store in tempdb is shared by
       every database of the instance, so the oldest transaction is the instance's. */

/* -> rows (heap or clustered index), used pages, reserved pages. */
static const char health_pages_text[] =
    "DECLARE @table nvarchar(255) = ?; "
    "SELECT CAST(COALESCE(SUM(CASE WHEN p.index_id IN (0, 1) THEN p.row_count END), 0) AS bigint), "
    "CAST(COALESCE(SUM(p.used_page_count), 0) AS bigint), "
    "CAST(COALESCE(SUM(p.reserved_page_count), 0) AS bigint) "
    "FROM sys.dm_db_partition_stats p WHERE p.object_id = OBJECT_ID(@table)";
static const sql_tsql_param health_table_p[] = { P_NAME("table") };
STMT(sql_tsql_health_pages, health_pages_text, health_table_p);

/* -> rows (heap or clustered index), from the catalog: the fallback of the above. */
static const char health_rows_text[] =
    "DECLARE @table nvarchar(255) = ?; "
    "SELECT CAST(CASE WHEN COUNT(*) = 0 OR MIN(p.rows) < 0 THEN -1 ELSE SUM(p.rows) END "
    "AS bigint) FROM sys.partitions p "
    "WHERE p.object_id = OBJECT_ID(@table) AND p.index_id IN (0, 1)";
STMT(sql_tsql_health_rows, health_rows_text, health_table_p);

/* -> ghost records + version ghost records at the leaf level of every index (NULL: the
   table is not there). */
static const char health_ghosts_text[] =
    "SET NOCOUNT ON; "
    "DECLARE @table nvarchar(255) = ?; "
    "DECLARE @id int = OBJECT_ID(@table), @ghosts bigint = NULL; "
    "IF @id IS NOT NULL "
    "SELECT @ghosts = CAST(COALESCE(SUM(s.ghost_record_count + "
    "COALESCE(s.version_ghost_record_count, 0)), 0) AS bigint) "
    "FROM sys.dm_db_index_physical_stats(DB_ID(), @id, NULL, NULL, 'SAMPLED') s "
    "WHERE s.index_level = 0; "
    "SELECT @ghosts";
STMT(sql_tsql_health_ghosts, health_ghosts_text, health_table_p);

/* -> 1 when the database keeps row versions (READ_COMMITTED_SNAPSHOT on, or SNAPSHOT
   isolation on or changing), else 0. */
STMT0(sql_tsql_health_versioning,
    "SELECT CASE WHEN d.is_read_committed_snapshot_on = 1 OR d.snapshot_isolation_state <> 0 "
    "THEN 1 ELSE 0 END FROM sys.databases d WHERE d.database_id = DB_ID()");

/* -> the version store's bytes for this database; the oldest transaction that reads or
   makes row versions, other than this session (NULLs: none): its session id, seconds
   open, 1 under SNAPSHOT isolation (0: a READ_COMMITTED_SNAPSHOT statement or a writer
   of versions), transaction sequence number, its session's program_name. */
STMT0(sql_tsql_health_versions,
    "SELECT v.kb * 1024, t.session_id, t.elapsed_time_seconds, CAST(t.is_snapshot AS int), "
    "t.transaction_sequence_num, s.program_name "
    "FROM (SELECT CAST(COALESCE(SUM(u.reserved_space_kb), 0) AS bigint) AS kb "
    "FROM sys.dm_tran_version_store_space_usage u WHERE u.database_id = DB_ID()) v "
    "OUTER APPLY (SELECT TOP (1) a.session_id, CAST(a.elapsed_time_seconds AS bigint) "
    "AS elapsed_time_seconds, a.is_snapshot, a.transaction_sequence_num "
    "FROM sys.dm_tran_active_snapshot_database_transactions a WHERE a.session_id <> @@SPID "
    "ORDER BY a.elapsed_time_seconds DESC, a.transaction_sequence_num) t "
    "LEFT JOIN sys.dm_exec_sessions s ON s.session_id = t.session_id");

const sql_tsql_stmt *const sql_tsql_all[] = {
    &sql_tsql_lead, &sql_tsql_claim, &sql_tsql_claim_competing, &sql_tsql_settle_head,
    &sql_tsql_settle_mark, &sql_tsql_settle_delete, &sql_tsql_settle_tail, &sql_tsql_cleanup,
    &sql_tsql_stats, &sql_tsql_stats_leader, &sql_tsql_stats_kept, &sql_tsql_dead_list,
    &sql_tsql_dead_retry, &sql_tsql_dead_purge, &sql_tsql_tables_exist, &sql_tsql_version,
    &sql_tsql_compat, &sql_tsql_health_pages, &sql_tsql_health_rows, &sql_tsql_health_ghosts,
    &sql_tsql_health_versioning, &sql_tsql_health_versions, NULL
};
