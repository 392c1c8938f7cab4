-- outbox tables for PostgreSQL 14 or later, partitioned by time (outbox-diesel). Idempotent:
-- safe to run again. `outbox migrate --partitioned` (or `outbox_diesel::migrate_partitioned`)
-- runs it, converts an unpartitioned `outbox` first, and creates the partitions; the relay
-- (or `outbox partitions maintain`) then creates them ahead and drops expired ones whole.
-- See docs/table-partitions.md.

-- Serialises concurrent runs (several relays starting at once); released at commit.
SELECT pg_advisory_xact_lock(7362291004541029);

-- How the partitions are kept: one row, read by every maintenance run.
CREATE TABLE IF NOT EXISTS outbox_partitioning (
    singleton      BOOLEAN PRIMARY KEY DEFAULT true CHECK (singleton),
    interval_secs  BIGINT  NOT NULL DEFAULT 86400  CHECK (interval_secs > 0),   -- one partition per day
    premake        INT     NOT NULL DEFAULT 7      CHECK (premake >= 0),        -- created this many ahead
    retention_secs BIGINT  NOT NULL DEFAULT 604800 CHECK (retention_secs >= 0)  -- kept after its range ends
);
INSERT INTO outbox_partitioning DEFAULT VALUES ON CONFLICT DO NOTHING;

CREATE SEQUENCE IF NOT EXISTS outbox_id_seq;
CREATE TABLE IF NOT EXISTS outbox (
    id             BIGINT       NOT NULL DEFAULT nextval('outbox_id_seq'),
    msg_id         VARCHAR(64)  NOT NULL,            -- business-built dedup key (see the trigger)
    topic          VARCHAR(128) NOT NULL,
    event_type     VARCHAR(128) NOT NULL,
    msg_key        VARCHAR(255) NOT NULL,            -- ordering key
    schema_version INT          NOT NULL DEFAULT 1,
    payload        JSONB        NOT NULL,            -- the whole event
    headers        JSONB        NOT NULL DEFAULT '{}',
    status         SMALLINT     NOT NULL DEFAULT 0,  -- 0 NEW / 1 SENT / 2 DEAD
    retries        INT          NOT NULL DEFAULT 0,
    next_retry_at  TIMESTAMPTZ  NOT NULL DEFAULT now(),
    created_at     TIMESTAMPTZ  NOT NULL DEFAULT now(),
    sent_at        TIMESTAMPTZ,
    last_error     TEXT
) PARTITION BY RANGE (created_at);
ALTER SEQUENCE outbox_id_seq OWNED BY outbox.id;

-- The same partial indexes as the unpartitioned table, one per partition: an old
-- partition's hold only its few NEW or DEAD rows, so the claim stays flat. Each partition
-- also has unique indexes of its own on (id) and (msg_id), made with it: a unique index
-- of the whole table would have to contain created_at.
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (id) WHERE status = 0;
CREATE INDEX IF NOT EXISTS outbox_pending_key ON outbox (msg_key, id) WHERE status = 0;
CREATE INDEX IF NOT EXISTS outbox_retrying ON outbox (msg_key, id) WHERE status = 0 AND retries > 0;
CREATE INDEX IF NOT EXISTS outbox_dead ON outbox (id) WHERE status = 2;

-- msg_id is unique across partitions: an insert of a msg_id that any partition holds is
-- skipped (0 rows, as `ON CONFLICT DO NOTHING` reports a duplicate on the unpartitioned
-- table). The lock on the msg_id's hash, taken before the look, orders two transactions
-- inserting the same msg_id: the second looks after the first has committed (READ
-- COMMITTED: each statement of this function reads a new snapshot). Under REPEATABLE
-- READ and SERIALIZABLE a look cannot see a row committed after the transaction's
-- snapshot, so a concurrent insert of the same msg_id fails with a serialization failure
-- instead (retry the transaction), as a unique index would make it.
-- The look skips the partitions ahead (`created_at <= now_`, pruned as the statement
-- starts): every row there is, its time its transaction's start, is older than the clock.
CREATE OR REPLACE FUNCTION outbox_dedup_msg_id() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz;
BEGIN
    IF NOT pg_try_advisory_xact_lock(1869968484, hashtext(NEW.msg_id)) THEN
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE EXCEPTION 'could not serialize access: msg_id % is being inserted by a concurrent transaction',
                NEW.msg_id
                USING ERRCODE = 'serialization_failure';
        END IF;
        PERFORM pg_advisory_xact_lock(1869968484, hashtext(NEW.msg_id));
    END IF;
    now_ := clock_timestamp();  -- after the lock: the rows of those it waited for are older
    IF EXISTS (SELECT 1 FROM outbox WHERE msg_id = NEW.msg_id AND created_at <= now_) THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END $$;

CREATE TABLE IF NOT EXISTS consumed_msg (
    consumer_group VARCHAR(64) NOT NULL,
    msg_id         VARCHAR(64) NOT NULL,
    consumed_at    TIMESTAMPTZ NOT NULL DEFAULT now()
) PARTITION BY RANGE (consumed_at);

-- (consumer_group, msg_id) unique across partitions, as msg_id in outbox.
CREATE OR REPLACE FUNCTION consumed_msg_dedup() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz;
BEGIN
    IF NOT pg_try_advisory_xact_lock(1869968485, hashtext(NEW.consumer_group || '/' || NEW.msg_id)) THEN
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE EXCEPTION 'could not serialize access: msg_id % of group % is being recorded by a concurrent transaction',
                NEW.msg_id, NEW.consumer_group USING ERRCODE = 'serialization_failure';
        END IF;
        PERFORM pg_advisory_xact_lock(1869968485, hashtext(NEW.consumer_group || '/' || NEW.msg_id));
    END IF;
    now_ := clock_timestamp();
    IF EXISTS (SELECT 1 FROM consumed_msg
               WHERE consumer_group = NEW.consumer_group AND msg_id = NEW.msg_id
                 AND consumed_at <= now_) THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END $$;

-- The triggers, created once (CREATE TRIGGER has no IF NOT EXISTS before PostgreSQL 14's
-- OR REPLACE, which would lock the table at every run).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = 'outbox'::regclass AND tgname = 'outbox_dedup_msg_id') THEN
        CREATE TRIGGER outbox_dedup_msg_id BEFORE INSERT ON outbox
            FOR EACH ROW EXECUTE FUNCTION outbox_dedup_msg_id();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = 'consumed_msg'::regclass AND tgname = 'consumed_msg_dedup') THEN
        CREATE TRIGGER consumed_msg_dedup BEFORE INSERT ON consumed_msg
            FOR EACH ROW EXECUTE FUNCTION consumed_msg_dedup();
    END IF;
END $$;

-- Not used since relays announce that they are parked with an advisory lock; kept as in
-- the unpartitioned migration for emitters of earlier releases.
CREATE TABLE IF NOT EXISTS outbox_relay_idle (
    relay_id   VARCHAR(64)  PRIMARY KEY,
    idle_until TIMESTAMPTZ  NOT NULL
);

CREATE TABLE IF NOT EXISTS outbox_migrations (
    version    INT          PRIMARY KEY,
    applied_at TIMESTAMPTZ  NOT NULL DEFAULT now()
);
INSERT INTO outbox_migrations (version) VALUES (1) ON CONFLICT (version) DO NOTHING;
