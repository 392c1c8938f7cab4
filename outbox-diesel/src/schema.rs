//! diesel `table!` definitions of the outbox tables, one module per backend, matching the
//! shipped migrations. Query them with the diesel DSL, for example
//! `outbox_diesel::schema::pg::outbox::table.filter(status.eq(2))`.
//!
//! The crate itself does not need them to emit or relay; they are for your own queries
//! and for diesel's `allow_tables_to_appear_in_same_query!` with your schema.

/// PostgreSQL: `payload` and `headers` are `JSONB`, timestamps `TIMESTAMPTZ`.
#[cfg(feature = "postgres")]
pub mod pg {
    diesel::table! {
        /// The outbox: one row per emitted message.
        outbox (id) {
            /// Row id: publish order.
            id -> BigInt,
            /// Business-built global dedup key (unique).
            msg_id -> Varchar,
            /// Stream topic.
            topic -> Varchar,
            /// Event type name.
            event_type -> Varchar,
            /// Ordering key.
            msg_key -> Varchar,
            /// Payload schema version.
            schema_version -> Integer,
            /// The event as JSON.
            payload -> Jsonb,
            /// Headers as a JSON object of strings.
            headers -> Jsonb,
            /// 0 NEW, 1 SENT, 2 DEAD.
            status -> SmallInt,
            /// Failed publish attempts.
            retries -> Integer,
            /// When the row is due (again).
            next_retry_at -> Timestamptz,
            /// When the row was emitted.
            created_at -> Timestamptz,
            /// When the row was published.
            sent_at -> Nullable<Timestamptz>,
            /// The last publish error.
            last_error -> Nullable<Text>,
        }
    }

    diesel::table! {
        /// Consumed messages per consumer group: the consumer's idempotency record.
        consumed_msg (consumer_group, msg_id) {
            /// The consumer group.
            consumer_group -> Varchar,
            /// The message id.
            msg_id -> Varchar,
            /// When it was applied.
            consumed_at -> Timestamptz,
        }
    }

    diesel::table! {
        /// One row per parked relay: until when it waits for work (drives
        /// `Notify::WhenRelayIdle`).
        outbox_relay_idle (relay_id) {
            /// The relay store's id.
            relay_id -> Varchar,
            /// The relay is parked until this time.
            idle_until -> Timestamptz,
        }
    }
}

/// MySQL / MariaDB: `payload` is `LONGTEXT` and `headers` `TEXT` holding JSON, timestamps
/// `DATETIME(6)` in UTC.
#[cfg(feature = "mysql")]
pub mod mysql {
    diesel::table! {
        /// The outbox: one row per emitted message.
        outbox (id) {
            /// Row id: publish order.
            id -> BigInt,
            /// Business-built global dedup key (unique).
            msg_id -> Varchar,
            /// Stream topic.
            topic -> Varchar,
            /// Event type name.
            event_type -> Varchar,
            /// Ordering key.
            msg_key -> Varchar,
            /// Payload schema version.
            schema_version -> Integer,
            /// The event as JSON text.
            payload -> Text,
            /// Headers as a JSON object of strings.
            headers -> Text,
            /// 0 NEW, 1 SENT, 2 DEAD.
            status -> SmallInt,
            /// Failed publish attempts.
            retries -> Integer,
            /// When the row is due (again), UTC.
            next_retry_at -> Datetime,
            /// When the row was emitted, UTC.
            created_at -> Datetime,
            /// When the row was published, UTC.
            sent_at -> Nullable<Datetime>,
            /// The last publish error.
            last_error -> Nullable<Text>,
        }
    }

    diesel::table! {
        /// Consumed messages per consumer group: the consumer's idempotency record.
        consumed_msg (consumer_group, msg_id) {
            /// The consumer group.
            consumer_group -> Varchar,
            /// The message id.
            msg_id -> Varchar,
            /// When it was applied, UTC.
            consumed_at -> Datetime,
        }
    }
}

/// SQLite: JSON as `TEXT`, timestamps as UTC text `YYYY-MM-DD HH:MM:SS.SSS`.
#[cfg(feature = "sqlite")]
pub mod sqlite {
    diesel::table! {
        /// The outbox: one row per emitted message.
        outbox (id) {
            /// Row id: publish order.
            id -> BigInt,
            /// Business-built global dedup key (unique).
            msg_id -> Text,
            /// Stream topic.
            topic -> Text,
            /// Event type name.
            event_type -> Text,
            /// Ordering key.
            msg_key -> Text,
            /// Payload schema version.
            schema_version -> Integer,
            /// The event as JSON text.
            payload -> Text,
            /// Headers as a JSON object of strings.
            headers -> Text,
            /// 0 NEW, 1 SENT, 2 DEAD.
            status -> SmallInt,
            /// Failed publish attempts.
            retries -> Integer,
            /// When the row is due (again), UTC.
            next_retry_at -> Timestamp,
            /// When the row was emitted, UTC.
            created_at -> Timestamp,
            /// When the row was published, UTC.
            sent_at -> Nullable<Timestamp>,
            /// The last publish error.
            last_error -> Nullable<Text>,
        }
    }

    diesel::table! {
        /// Consumed messages per consumer group: the consumer's idempotency record.
        consumed_msg (consumer_group, msg_id) {
            /// The consumer group.
            consumer_group -> Text,
            /// The message id.
            msg_id -> Text,
            /// When it was applied, UTC.
            consumed_at -> Timestamp,
        }
    }

    diesel::table! {
        /// The single relay's lease on this database.
        outbox_relay_lease (singleton) {
            /// Always 1.
            singleton -> Integer,
            /// The holding relay's token.
            owner -> Text,
            /// Its last heartbeat, UTC.
            heartbeat_at -> Timestamp,
        }
    }
}
