-- outbox tables for SQLite (outbox-diesel). Idempotent: safe to run again.
-- Copy this directory into your diesel migrations, or call `outbox_diesel::migrate`.
-- Timestamps are UTC text 'YYYY-MM-DD HH:MM:SS.SSS', written and compared with
-- strftime('%Y-%m-%d %H:%M:%f', 'now') so that text order is time order.

CREATE TABLE IF NOT EXISTS outbox (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: id order is emit order
    msg_id         TEXT    NOT NULL,
    topic          TEXT    NOT NULL,
    event_type     TEXT    NOT NULL,
    msg_key        TEXT    NOT NULL,
    schema_version INTEGER NOT NULL DEFAULT 1,
    payload        TEXT    NOT NULL,
    headers        TEXT    NOT NULL DEFAULT '{}',
    status         INTEGER NOT NULL DEFAULT 0,         -- 0 NEW / 1 SENT / 2 DEAD
    retries        INTEGER NOT NULL DEFAULT 0,
    next_retry_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    created_at     TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    sent_at        TEXT,
    last_error     TEXT,
    CONSTRAINT outbox_msg_id_key UNIQUE (msg_id)
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (id) WHERE status = 0;
CREATE INDEX IF NOT EXISTS outbox_pending_key ON outbox (msg_key, id) WHERE status = 0;
CREATE INDEX IF NOT EXISTS outbox_dead ON outbox (id) WHERE status = 2;
-- Retention: SENT rows oldest first (`purge_sent`), without walking the others.
CREATE INDEX IF NOT EXISTS outbox_sent ON outbox (sent_at) WHERE status = 1;

CREATE TABLE IF NOT EXISTS consumed_msg (
    consumer_group TEXT NOT NULL,
    msg_id         TEXT NOT NULL,
    consumed_at    TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (consumer_group, msg_id)
);
CREATE INDEX IF NOT EXISTS consumed_msg_consumed_at ON consumed_msg (consumed_at);

-- SQLite has no row locks: one relay per database. The relay holds an OS lock on
-- `<database file>.outbox-relay.lock`; this row serves only databases without a file
-- (in memory), where it is written when the relay starts and deleted when it stops.
CREATE TABLE IF NOT EXISTS outbox_relay_lease (
    singleton    INTEGER PRIMARY KEY CHECK (singleton = 1),
    owner        TEXT    NOT NULL,
    heartbeat_at TEXT    NOT NULL
);

-- The migration versions applied, one row each. `outbox_diesel::migrate` (and `outbox
-- migrate`) refuses to run over tables a newer release migrated (a higher version here).
CREATE TABLE IF NOT EXISTS outbox_migrations (
    version    INTEGER PRIMARY KEY,
    applied_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
);
INSERT OR IGNORE INTO outbox_migrations (version) VALUES (1);
