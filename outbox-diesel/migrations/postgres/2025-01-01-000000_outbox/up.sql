-- outbox tables for PostgreSQL (outbox-diesel). Idempotent: safe to run again.
-- Copy this directory into your diesel migrations, or call `outbox_diesel::migrate`.

-- Serialises concurrent runs (several relays starting at once); released at commit.
SELECT pg_advisory_xact_lock(7362291004541029);

CREATE TABLE IF NOT EXISTS outbox (
    id             BIGSERIAL    PRIMARY KEY,
    msg_id         VARCHAR(64)  NOT NULL,            -- business-built, global dedup key
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
    last_error     TEXT,
    CONSTRAINT outbox_msg_id_key UNIQUE (msg_id)
);

-- Holds NEW rows only: the id-ordered claim walks it and never sees SENT rows.
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (id) WHERE status = 0;
-- Per-key order probe ("is there an older NEW row of this key?") over NEW rows only.
CREATE INDEX IF NOT EXISTS outbox_pending_key ON outbox (msg_key, id) WHERE status = 0;
-- Per-key claim: the keys whose oldest messages wait for a retry. Only NEW rows that
-- failed before: small, and never written by an emit or by marking a row SENT.
CREATE INDEX IF NOT EXISTS outbox_retrying ON outbox (msg_key, id) WHERE status = 0 AND retries > 0;
-- Dead letters for operators; small by construction.
CREATE INDEX IF NOT EXISTS outbox_dead ON outbox (id) WHERE status = 2;
-- Retention: SENT rows oldest first (`purge_sent`), without walking the others.
CREATE INDEX IF NOT EXISTS outbox_sent ON outbox (sent_at) WHERE status = 1;

CREATE TABLE IF NOT EXISTS consumed_msg (
    consumer_group VARCHAR(64) NOT NULL,
    msg_id         VARCHAR(64) NOT NULL,
    consumed_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, msg_id)
);
-- Retention: purge rows older than the redelivery horizon in bounded batches.
CREATE INDEX IF NOT EXISTS consumed_msg_consumed_at ON consumed_msg (consumed_at);

-- Not used since relays announce that they are parked with an advisory lock
-- (`outbox_diesel::wake_lock_key`); kept for emitters of earlier releases, which read it.
CREATE TABLE IF NOT EXISTS outbox_relay_idle (
    relay_id   VARCHAR(64)  PRIMARY KEY,
    idle_until TIMESTAMPTZ  NOT NULL
);

-- The migration versions applied, one row each. `outbox_diesel::migrate` (and `outbox
-- migrate`) refuses to run over tables a newer release migrated (a higher version here).
CREATE TABLE IF NOT EXISTS outbox_migrations (
    version    INT          PRIMARY KEY,
    applied_at TIMESTAMPTZ  NOT NULL DEFAULT now()
);
INSERT INTO outbox_migrations (version) VALUES (1) ON CONFLICT (version) DO NOTHING;
