-- Least-privilege roles for outbox-relay on PostgreSQL (deploy/README.md).
--
-- Run as the owner of the outbox tables (the role that ran `outbox-relay init`, or a
-- superuser), in the application database, AFTER the tables exist:
--     outbox-relay schema --dialect postgres | psql -v ON_ERROR_STOP=1 -d app   (or: outbox-relay init -c relay.ini)
--     psql -v ON_ERROR_STOP=1 -d app -f grants-postgres.sql
-- Idempotent: running it twice is safe.
--
-- Names used: schema "outbox", outbox table outbox.messages, dead-letter table
-- outbox.messages_dead (the defaults). For another table (relay.ini `table = S.T`), replace
-- every outbox.messages with S.T and outbox.messages_dead with S.T_dead (the dead table is
-- always <table>_dead, shortened with a hash when longer than 63 bytes: see
-- `outbox-relay schema --table S.T` for the exact name), and "outbox" in the schema grants by S.
--
-- The two roles are NOLOGIN groups; give your login roles membership:
--     CREATE ROLE orders_app LOGIN PASSWORD '...' IN ROLE outbox_producer;
--     CREATE ROLE relay      LOGIN PASSWORD '...' IN ROLE outbox_relay;
-- (or GRANT outbox_producer TO existing_app_role;)
--
-- What each needs and why:
--   outbox_producer  INSERT on the outbox, USAGE on the schema (name lookup; the table-exists
--                    check uses to_regclass()). Duplicate message_ids are detected with
--                    INSERT ... ON CONFLICT DO NOTHING (no conflict target, so no SELECT
--                    privilege is needed) and the row count; tests/test_grants.py sends through
--                    liboutbox as an INSERT-only role. The
--                    identity column needs no sequence grant. The AFTER INSERT NOTIFY trigger
--                    runs pg_notify(), which PUBLIC may execute.
--   outbox_relay     SELECT/UPDATE/DELETE on the outbox (claim with FOR UPDATE SKIP LOCKED,
--                    lease, mark sent, retention cleanup), INSERT on the outbox
--                    (`outbox-relay dead retry`), SELECT/INSERT/DELETE on the dead-letter table
--                    (dead-lettering, `dead list|retry|purge`). The relay's settle statement
--                    moves rows to the dead table with INSERT ... ON CONFLICT (id) DO UPDATE,
--                    and PostgreSQL checks UPDATE for that clause on every execution, so the
--                    relay also has UPDATE on the dead table (drop it if that clause goes).
--                    `dead retry` re-inserts with OVERRIDING SYSTEM VALUE: INSERT is enough.
--                    Leadership is a lease row in outbox.messages_lease (SELECT, INSERT,
--                    UPDATE: take and renew it); wake-ups use LISTEN, which needs no grant.
--                    SELECT on the outbox's id sequence: where claims may start (below).
--   Neither role may create, alter, drop or truncate anything. `outbox-relay init` (DDL) is
--   run by the table owner / migration role, not by these roles.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_producer') THEN
        CREATE ROLE outbox_producer NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay') THEN
        CREATE ROLE outbox_relay NOLOGIN;
    END IF;
END
$$;

-- Start from nothing on these objects (PUBLIC has no table rights by default; be explicit).
REVOKE ALL ON SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON TABLE outbox.messages, outbox.messages_dead, outbox.messages_lease FROM PUBLIC;
REVOKE ALL ON TABLE outbox.messages, outbox.messages_dead, outbox.messages_lease
    FROM outbox_producer, outbox_relay;

GRANT USAGE ON SCHEMA outbox TO outbox_producer, outbox_relay;

-- producer: INSERT only
GRANT INSERT ON TABLE outbox.messages TO outbox_producer;

-- relay: drain, settle, clean up, retry
GRANT SELECT, UPDATE, DELETE, INSERT ON TABLE outbox.messages TO outbox_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE outbox.messages_dead TO outbox_relay;
GRANT SELECT, INSERT, UPDATE ON TABLE outbox.messages_lease TO outbox_relay;

-- The claims' floor: a few times a second the relay reads the id sequence's last value
-- (pg_sequence_last_value) and which transactions hold the outbox's ROW EXCLUSIVE lock
-- (pg_locks, readable by every role), to find where its claims may start instead of the
-- table's first row (their cost then does not grow with the rows marked since the last
-- vacuum). SELECT on the sequence reads it and changes nothing. Without it the relay logs
-- once (event claim_floor_unavailable) and its claims start from the first row. The
-- sequence of another table S.T is S.T_id_seq: `SELECT pg_get_serial_sequence('S.T', 'id')`.
GRANT SELECT ON SEQUENCE outbox.messages_id_seq TO outbox_relay;

-- Table health (`/metrics`: outbox_relay_table_*, outbox_relay_xmin_horizon_*, and the WARN
-- naming whoever holds the xmin horizon back): the dead/live tuple counts and last autovacuum
-- (pg_stat_user_tables), the size (pg_total_relation_size) and pg_replication_slots need no
-- grant. Which session holds the horizon back (pg_stat_activity.backend_xmin, backend_xid)
-- every role sees; when its transaction began, its state and walsenders (a standby's
-- feedback) are hidden for other roles' sessions unless the relay is a member of
-- pg_read_all_stats, a built-in role that reads statistics and activity only (it is part of
-- pg_monitor; it changes nothing). Without it the relay logs once that it cannot see them
-- and times a holder from when it first sees it. Granting a built-in role is cluster-wide and
-- needs a superuser (or, on PostgreSQL 15, a role with CREATEROLE).
GRANT pg_read_all_stats TO outbox_relay;

-- Optional, for `outbox-relay stats` run as the relay role: reading pg_stat_user_tables
-- needs no grant; nothing else is required.
