-- outbox tables for MySQL 8 / MariaDB 10.6+ (outbox-diesel). Idempotent: safe to run again.
-- Copy this directory into your diesel migrations, or call `outbox_diesel::migrate`.
-- Timestamps are DATETIME(6) in UTC: outbox-diesel writes and compares them with
-- UTC_TIMESTAMP(6), never with the session time zone.

CREATE TABLE IF NOT EXISTS outbox (
    id             BIGINT       NOT NULL AUTO_INCREMENT,
    msg_id         VARCHAR(64)  NOT NULL,            -- business-built, global dedup key
    topic          VARCHAR(128) NOT NULL,
    event_type     VARCHAR(128) NOT NULL,
    msg_key        VARCHAR(255) NOT NULL,            -- ordering key
    schema_version INT          NOT NULL DEFAULT 1,
    payload        LONGTEXT     NOT NULL,            -- the whole event, JSON text
    headers        TEXT         NOT NULL,            -- JSON object
    status         SMALLINT     NOT NULL DEFAULT 0,  -- 0 NEW / 1 SENT / 2 DEAD
    retries        INT          NOT NULL DEFAULT 0,
    next_retry_at  DATETIME(6)  NOT NULL,
    created_at     DATETIME(6)  NOT NULL,
    sent_at        DATETIME(6)  NULL,
    last_error     TEXT         NULL,
    PRIMARY KEY (id),
    UNIQUE KEY outbox_msg_id_key (msg_id),
    -- The claim (status = 0 ORDER BY id, next_retry_at checked in the index) reads only
    -- NEW entries: no partial indexes here, so status leads.
    KEY outbox_claim (status, id, next_retry_at),
    -- Backlog: due NEW rows by time.
    KEY outbox_status_next_retry (status, next_retry_at),
    -- Per-key order probe over NEW rows.
    KEY outbox_pending_key (status, msg_key, id),
    -- Retention: SENT rows oldest first (`purge_sent`). Not led by status, so that the
    -- claim never prefers it to outbox_claim (NEW and DEAD rows have no sent_at).
    KEY outbox_sent (sent_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS consumed_msg (
    consumer_group VARCHAR(64) NOT NULL,
    msg_id         VARCHAR(64) NOT NULL,
    consumed_at    DATETIME(6) NOT NULL,
    PRIMARY KEY (consumer_group, msg_id),
    KEY consumed_msg_consumed_at (consumed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- The migration versions applied, one row each. `outbox_diesel::migrate` (and `outbox
-- migrate`) refuses to run over tables a newer release migrated (a higher version here).
CREATE TABLE IF NOT EXISTS outbox_migrations (
    version    INT          NOT NULL,
    applied_at DATETIME(6)  NOT NULL,
    PRIMARY KEY (version)
) ENGINE = InnoDB;
-- IGNORE: only the primary key can collide here (a second run).
INSERT IGNORE INTO outbox_migrations (version, applied_at) VALUES (1, UTC_TIMESTAMP(6));
