-- Least-privilege roles for outbox-relay on SQL Server (deploy/README.md).
--
-- Run as db_owner in the application database, AFTER the tables exist
-- (`outbox-relay schema --dialect sqlserver` | sqlcmd -I, or `outbox-relay init -c relay.ini`):
--     sqlcmd -C -I -b -S host -d app -U sa -i grants-sqlserver.sql
-- (-I: QUOTED_IDENTIFIER ON; sqlcmd runs with it OFF by default, and the schema's filtered
-- indexes cannot be created, or its table written, without it: Msg 1934.)
-- Idempotent (GRANT is; roles are created only when missing).
--
-- Names used: [outbox].[messages], [outbox].[messages_dead] and [outbox].[messages_lease]
-- (the defaults). For another table (relay.ini `table = S.T`) replace them by [S].[T],
-- [S].[T_dead] and [S].[T_lease] (see
-- `outbox-relay schema --dialect sqlserver --table S.T` for the exact dead-letter name).
--
-- Give logins membership, e.g.:
--     CREATE LOGIN orders_app WITH PASSWORD = N'...';   CREATE USER orders_app FOR LOGIN orders_app;
--     ALTER ROLE outbox_producer ADD MEMBER orders_app;
--     CREATE LOGIN relay WITH PASSWORD = N'...';        CREATE USER relay FOR LOGIN relay;
--     ALTER ROLE outbox_relay ADD MEMBER relay;
--
-- What each needs and why:
--   outbox_producer  INSERT on the outbox. liboutbox also reads message_id (and only that
--                    column): its INSERT skips ids already there (INSERT ... WHERE NOT EXISTS
--                    (SELECT 1 ... WITH (READCOMMITTEDLOCK) WHERE message_id = ...), a plain
--                    read: no range or update locks, concurrent producers never wait for
--                    each other) and a batch over SQL Server's parameter limit opens its
--                    transaction with a seek on message_id (SELECT TOP (1) ... WHERE
--                    message_id = <nil UUID>) before its savepoint. So it gets column-level
--                    SELECT on message_id: it still cannot read payloads, routing keys or
--                    headers, update or delete.
--   outbox_relay     SELECT/UPDATE/DELETE on the outbox (claim: UPDATE ... READPAST, UPDLOCK,
--                    ROWLOCK; mark sent, retry, give back; retention cleanup and
--                    on_sent = delete), no INSERT on it: rows enter the outbox only through
--                    producers (and `dead retry`, outbox_admin below). SELECT/INSERT/DELETE
--                    on the dead-letter table (the dead-letter move deletes a row already
--                    there under the same id, then inserts; `dead list|purge`).
--                    SELECT/INSERT/UPDATE on the lease table: leadership is a lease row
--                    (owner, epoch, expiry) and competing relays keep member rows there,
--                    inserted once and updated afterwards. The compatibility-level check
--                    reads sys.databases for the current database, which every user of it
--                    may read: no grant. Nothing more is needed to drain.
--   table health     optional (the relay reads it every health_interval for /metrics; each
--                    part it may not read is left out of /metrics and logged once at WARN,
--                    event table_health_unavailable, and the drain goes on as before):
--                    - rows: sys.partitions, catalog metadata visible with the SELECT above:
--                      no grant (outbox_relay_table_live_tuples);
--                    - rows, used and reserved pages (sys.dm_db_partition_stats) and ghost
--                      records (sys.dm_db_index_physical_stats, SAMPLED, in every 10th round
--                      of reads): VIEW DATABASE STATE in this database, or on SQL Server 2022
--                      and later the narrower VIEW DATABASE PERFORMANCE STATE
--                      (outbox_relay_table_size_bytes, table_used_bytes, table_dead_tuples);
--                          GRANT VIEW DATABASE PERFORMANCE STATE TO [outbox_relay];  -- 2022+
--                          GRANT VIEW DATABASE STATE TO [outbox_relay];              -- before
--                    - with READ_COMMITTED_SNAPSHOT or SNAPSHOT isolation on, the version store
--                      (sys.dm_tran_version_store_space_usage) and the oldest transaction
--                      reading or making row versions, its session and program_name
--                      (sys.dm_tran_active_snapshot_database_transactions, sys.dm_exec_sessions):
--                      VIEW SERVER STATE, or on 2022 and later VIEW SERVER PERFORMANCE STATE,
--                      a server permission granted to the relay's login in master, not to a
--                      database role (outbox_relay_version_store_bytes,
--                      xmin_horizon_age_seconds, and the WARN xmin_horizon_held naming that
--                      transaction past horizon_warn); on Azure SQL Database VIEW DATABASE
--                      STATE in the database instead;
--                          USE master; GRANT VIEW SERVER PERFORMANCE STATE TO [relay];  -- 2022+
--                          USE master; GRANT VIEW SERVER STATE TO [relay];              -- before
--                    These let the login read the server's state, not any table's data.
--   outbox_admin     optional, for `outbox-relay dead retry` only: it re-inserts dead rows
--                    with their original id (SET IDENTITY_INSERT), which SQL Server allows
--                    only with ALTER on the table. Keep it out of the always-running relay:
--                    run `dead retry` with a separate login that is a member of outbox_admin.
--   Nobody here may create, drop or truncate; `outbox-relay init` runs as db_owner.
-- The column list is written before ON (GRANT SELECT (col) ON OBJECT::t), the form SQL
-- Server and Babelfish both accept.

IF DATABASE_PRINCIPAL_ID(N'outbox_producer') IS NULL EXEC(N'CREATE ROLE [outbox_producer]');
IF DATABASE_PRINCIPAL_ID(N'outbox_relay') IS NULL EXEC(N'CREATE ROLE [outbox_relay]');
IF DATABASE_PRINCIPAL_ID(N'outbox_admin') IS NULL EXEC(N'CREATE ROLE [outbox_admin]');
GO

-- producer: INSERT, plus reading the idempotency key for the duplicate check
GRANT INSERT ON OBJECT::[outbox].[messages] TO [outbox_producer];
GRANT SELECT ([message_id]) ON OBJECT::[outbox].[messages] TO [outbox_producer];
GO

-- relay: drain, settle, clean up, dead-letter, lead (earlier versions of this file also
-- granted INSERT on the outbox: taken back)
GRANT SELECT, UPDATE, DELETE ON OBJECT::[outbox].[messages] TO [outbox_relay];
REVOKE INSERT ON OBJECT::[outbox].[messages] FROM [outbox_relay];
GRANT SELECT, INSERT, DELETE ON OBJECT::[outbox].[messages_dead] TO [outbox_relay];
GRANT SELECT, INSERT, UPDATE ON OBJECT::[outbox].[messages_lease] TO [outbox_relay];
GO

-- admin (optional): `outbox-relay dead retry` needs IDENTITY_INSERT, i.e. ALTER on the outbox
GRANT SELECT, INSERT, UPDATE, DELETE ON OBJECT::[outbox].[messages] TO [outbox_admin];
GRANT ALTER ON OBJECT::[outbox].[messages] TO [outbox_admin];
GRANT SELECT, INSERT, DELETE ON OBJECT::[outbox].[messages_dead] TO [outbox_admin];
GO
