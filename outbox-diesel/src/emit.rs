use std::borrow::Cow;
use std::collections::HashSet;

use outbox_core::{
    DEFAULT_MAX_PAYLOAD_BYTES, Envelope, Headers, InvalidConfig, MsgId, OutboxEvent, TRACEPARENT,
};

use crate::backend::Database as _;
use crate::{OutboxConnection, Result};

/// Whether [`Emit`] on PostgreSQL wakes a relay with `NOTIFY` (delivered at commit).
/// Ignored on MySQL and SQLite, whose relays poll.
///
/// `NOTIFY` serializes committing transactions (BENCHMARKS.md measures what that costs),
/// so the default notifies only while a relay is actually parked waiting for work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Notify {
    /// Never notify; relays find new rows by polling (and a busy relay never waits).
    Never,
    /// Notify on every emit of one event (`emit`, or `emit_all` of one event), a duplicate
    /// too, and on every `emit_all` of several that inserted a row (even when a later
    /// duplicate took the rows back). PostgreSQL folds the NOTIFYs of one transaction into
    /// one. Every committing transaction takes the database's NOTIFY lock in turn, which
    /// caps the emit throughput of many connections.
    Always,
    /// Notify only while a relay is parked waiting for work (it holds the channel's
    /// [wake-up lock](wake_lock_key)), checked inside the INSERT statement itself: no
    /// extra round trip. While relays are busy an emit pays only that check, a shared
    /// try of the lock; while one is parked, each emitting transaction also sends a
    /// NOTIFY, which is what delivers its row at once. An emit of one event that is a duplicate
    /// may wake a parked relay too, as may an `emit_all` whose rows a later duplicate
    /// took back (it finds nothing new and parks again).
    #[default]
    WhenRelayIdle,
}

/// The advisory lock (PostgreSQL's two-key form, `pg_advisory_lock(int4, int4)`) by
/// which relays announce that they are parked on `channel`: a parked relay holds it
/// exclusively on its LISTEN connection, and a [`Notify::WhenRelayIdle`] emit tries it
/// shared (to the end of its transaction) and notifies when that fails. The first key is
/// `0x6f757462` (`"outb"`), the second the channel's FNV-1a hash (31 bits, so that
/// both read the same as `oid`s in `pg_locks`), so that relays
/// of different channels do not make each other's emitters notify. Keep both out of your
/// own advisory locks; `pg_locks` shows the parked relay:
///
/// ```
/// let (class, key) = outbox_diesel::wake_lock_key("outbox");
/// let sql = format!(
///     "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = {class} \
///      AND objid = {key} AND objsubid = 2 AND mode = 'ExclusiveLock' AND granted"
/// );
/// # let _ = sql;
/// assert_eq!(class, 0x6f75_7462);
/// assert!(key >= 0);
/// ```
pub fn wake_lock_key(channel: &str) -> (i32, i32) {
    let hash = channel.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    let key = i32::try_from(hash & 0x7fff_ffff).expect("31 bits");
    (0x6f75_7462, key)
}

/// Settings of [`Emit::emit_with`]. `Default` (and [`EmitOptions::DEFAULT`]): payloads up
/// to 1 MiB, [`Notify::WhenRelayIdle`] on channel `outbox`, no headers.
///
/// It follows the workspace's configuration contract: readable fields, one consuming
/// `with_<field>` setter per field, and [`validate`](Self::validate), which every emit
/// runs on the options it is given (an invalid value is
/// [`outbox_core::Error::Config`], before anything is written).
///
/// ```
/// use outbox_diesel::{EmitOptions, Notify};
/// let opts = EmitOptions::new().with_max_payload_bytes(64 * 1024).with_notify(Notify::Never);
/// assert_eq!(opts.max_payload_bytes, 64 * 1024);
/// assert!(opts.validate().is_ok());
///
/// let err = EmitOptions::new().with_max_payload_bytes(0).validate().unwrap_err();
/// assert_eq!(err.to_string(), "invalid configuration: max_payload_bytes must be at least 1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EmitOptions {
    /// Largest serialized payload accepted, in bytes (default 1 MiB; at least 1).
    pub max_payload_bytes: usize,
    /// When to `NOTIFY` the relay on PostgreSQL (default [`Notify::WhenRelayIdle`]).
    pub notify: Notify,
    /// The `NOTIFY` channel (default `outbox`; 1 to 63 bytes, no NUL, as PostgreSQL
    /// takes a channel name); the relay must listen on the same one
    /// ([`PgRelayStore::with_channel`](crate::PgRelayStore::with_channel)).
    pub channel: Cow<'static, str>,
    /// Headers added to every event emitted with these options (default none), such as
    /// the request's trace context under [`TRACEPARENT`](outbox_core::TRACEPARENT).
    pub headers: Headers,
}

/// The longest channel name PostgreSQL takes (`NAMEDATALEN - 1` bytes).
const MAX_CHANNEL_LEN: usize = 63;

impl EmitOptions {
    /// The defaults, as a constant.
    pub const DEFAULT: Self = Self {
        max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        notify: Notify::WhenRelayIdle,
        channel: Cow::Borrowed(crate::DEFAULT_CHANNEL),
        headers: Headers::new(),
    };

    /// The defaults.
    pub fn new() -> Self {
        Self::DEFAULT
    }

    /// Sets the payload size limit in bytes.
    #[must_use]
    pub fn with_max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// Sets the PostgreSQL wake-up mode.
    #[must_use]
    pub fn with_notify(mut self, notify: Notify) -> Self {
        self.notify = notify;
        self
    }

    /// Sets the PostgreSQL `NOTIFY` channel.
    #[must_use]
    pub fn with_channel(mut self, channel: impl Into<Cow<'static, str>>) -> Self {
        self.channel = channel.into();
        self
    }

    /// Sets the headers added to every event emitted with these options, replacing any
    /// set before.
    #[must_use]
    pub fn with_headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// Adds one header to every event emitted with these options, keeping the others.
    /// Build the options per request to carry its trace context to the consumers:
    ///
    /// ```
    /// use outbox_diesel::EmitOptions;
    /// let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    /// let opts = EmitOptions::new().with_header(outbox_core::TRACEPARENT, traceparent);
    /// assert_eq!(opts.headers["traceparent"], traceparent);
    /// ```
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Checks every field against its rule: `max_payload_bytes` at least 1, `channel` a
    /// name PostgreSQL takes for `NOTIFY` (1 to 63 bytes, no NUL).
    pub fn validate(&self) -> std::result::Result<(), InvalidConfig> {
        if self.max_payload_bytes == 0 {
            return Err(InvalidConfig::new(
                "max_payload_bytes",
                "must be at least 1",
            ));
        }
        if self.channel.is_empty() || self.channel.len() > MAX_CHANNEL_LEN {
            return Err(InvalidConfig::new(
                "channel",
                format!("must be 1 to {MAX_CHANNEL_LEN} bytes long"),
            ));
        }
        if self.channel.contains('\0') {
            return Err(InvalidConfig::new("channel", "must not contain NUL"));
        }
        Ok(())
    }

    /// Serializes `event` under these options.
    fn envelope<E: OutboxEvent>(&self, event: &E) -> Result<Envelope> {
        let mut envelope = Envelope::from_event(event, self.max_payload_bytes)?;
        envelope
            .headers
            .extend(self.headers.iter().map(|(k, v)| (k.clone(), v.clone())));
        outbox_core::trace::add_current(&mut envelope.headers);
        Ok(envelope)
    }
}

impl Default for EmitOptions {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Writes events to the outbox in the caller's transaction: `use outbox_diesel::Emit;`
/// adds these methods to `PgConnection`, `MysqlConnection`, `SqliteConnection` and r2d2
/// pooled connections of them.
///
/// Emit never opens a connection or a transaction: call it inside your own
/// `conn.transaction(..)`, so the message exists iff your transaction commits. Each
/// emit is one `INSERT` (on PostgreSQL with the optional `NOTIFY` in the same statement),
/// a statement diesel keeps prepared.
///
/// The errors emit detects itself (duplicate msg_id, invalid msg_id — an empty id field
/// among them, [`InvalidMsgId::EmptyPart`](outbox_core::InvalidMsgId::EmptyPart) —, payload
/// too large or not serializable, field too long) leave the transaction usable: nothing was written,
/// and you may roll back (what `?` does) or carry on. A database error (a lost
/// connection, a statement timeout) is like any failed statement: on PostgreSQL it aborts
/// the transaction, which can then only roll back. A duplicate msg_id is [`outbox_core::Error::Duplicate`]; after `?` has
/// turned it into a [`diesel::result::Error`], test it with [`is_duplicate`](crate::is_duplicate).
///
/// With the `opentelemetry` feature, every message emitted carries the current span's
/// W3C `traceparent` header unless it has one already (see [`outbox_core::trace`]).
pub trait Emit {
    /// Writes `event` with the default [`EmitOptions`] and returns its msg_id.
    fn emit<E: OutboxEvent>(&mut self, event: E) -> Result<MsgId> {
        self.emit_with(&EmitOptions::DEFAULT, event)
    }

    /// Writes `event` with `options` and returns its msg_id. Options that break their
    /// rules ([`EmitOptions::validate`]) are refused with [`outbox_core::Error::Config`].
    fn emit_with<E: OutboxEvent>(&mut self, options: &EmitOptions, event: E) -> Result<MsgId>;

    /// Writes several events in one multi-row `INSERT` (chunked past 1000 rows), all or
    /// nothing: on any error (a duplicate included) none of them is left in the
    /// transaction.
    fn emit_all<E, I>(&mut self, events: I) -> Result<Vec<MsgId>>
    where
        E: OutboxEvent,
        I: IntoIterator<Item = E>,
    {
        self.emit_all_with(&EmitOptions::DEFAULT, events)
    }

    /// [`emit_all`](Self::emit_all) with `options`.
    fn emit_all_with<E, I>(&mut self, options: &EmitOptions, events: I) -> Result<Vec<MsgId>>
    where
        E: OutboxEvent,
        I: IntoIterator<Item = E>;

    /// Writes ready-made envelopes (for instance with headers added by
    /// [`Envelope::with_header`]); all or nothing like [`emit_all`](Self::emit_all). The
    /// payload limit of `options` is checked here too.
    fn emit_envelopes(&mut self, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()>;
}

impl<C: OutboxConnection> Emit for C {
    fn emit_with<E: OutboxEvent>(&mut self, options: &EmitOptions, event: E) -> Result<MsgId> {
        let envelope = options.prepare_one(&event)?;
        self.db().insert(options, std::slice::from_ref(&envelope))?;
        Ok(envelope.msg_id)
    }

    fn emit_all_with<E, I>(&mut self, options: &EmitOptions, events: I) -> Result<Vec<MsgId>>
    where
        E: OutboxEvent,
        I: IntoIterator<Item = E>,
    {
        // Validated, within the payload limit and traced already: only the msg_ids are
        // left to check.
        let envelopes = options.prepare_all(events)?;
        unique_msg_ids(&envelopes)?;
        if !envelopes.is_empty() {
            self.db().insert(options, &envelopes)?;
        }
        Ok(envelopes.into_iter().map(|e| e.msg_id).collect())
    }

    fn emit_envelopes(&mut self, options: &EmitOptions, envelopes: &[Envelope]) -> Result<()> {
        options.check_envelopes(envelopes)?;
        if envelopes.is_empty() {
            return Ok(());
        }
        self.db().insert(options, &with_trace(envelopes))
    }
}

/// What every emit, blocking or async, checks and builds before its statement.
impl EmitOptions {
    /// Validates these options and serializes one event.
    pub(crate) fn prepare_one<E: OutboxEvent>(&self, event: &E) -> Result<Envelope> {
        self.validate()?;
        self.envelope(event)
    }

    /// Validates these options and serializes the events of an `emit_all`.
    pub(crate) fn prepare_all<E, I>(&self, events: I) -> Result<Vec<Envelope>>
    where
        E: OutboxEvent,
        I: IntoIterator<Item = E>,
    {
        self.validate()?;
        events.into_iter().map(|e| self.envelope(&e)).collect()
    }

    /// Validates these options and ready-made envelopes: each payload within the limit,
    /// no msg_id twice.
    pub(crate) fn check_envelopes(&self, envelopes: &[Envelope]) -> Result<()> {
        self.validate()?;
        if let Some(e) = envelopes
            .iter()
            .find(|e| e.payload.len() > self.max_payload_bytes)
        {
            return Err(outbox_core::Error::PayloadTooLarge {
                msg_id: e.msg_id.clone(),
                size: e.payload.len(),
                limit: self.max_payload_bytes,
            }
            .into());
        }
        unique_msg_ids(envelopes)
    }
}

/// Fails on the first msg_id that comes twice in one multi-row emit.
pub(crate) fn unique_msg_ids(envelopes: &[Envelope]) -> Result<()> {
    let mut seen = HashSet::with_capacity(envelopes.len());
    match envelopes.iter().find(|e| !seen.insert(e.msg_id.as_str())) {
        Some(e) => Err(outbox_core::Error::Duplicate(e.msg_id.clone()).into()),
        None => Ok(()),
    }
}

/// `envelopes`, each with the current span's `traceparent` unless it has one (see
/// [`outbox_core::trace`]); borrowed when there is nothing to add.
pub(crate) fn with_trace(envelopes: &[Envelope]) -> Cow<'_, [Envelope]> {
    let mut current = Headers::new();
    outbox_core::trace::add_current(&mut current);
    let Some(parent) = current.remove(TRACEPARENT) else {
        return Cow::Borrowed(envelopes);
    };
    if envelopes
        .iter()
        .all(|e| e.headers.contains_key(TRACEPARENT))
    {
        return Cow::Borrowed(envelopes);
    }
    let traced = envelopes.iter().map(|e| {
        let mut e = e.clone();
        e.headers
            .entry(TRACEPARENT.to_owned())
            .or_insert_with(|| parent.clone());
        e
    });
    Cow::Owned(traced.collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid_and_each_rule_names_its_field() {
        assert_eq!(EmitOptions::default().validate(), Ok(()));
        let field = |o: EmitOptions| o.validate().unwrap_err().field().to_owned();
        assert_eq!(
            field(EmitOptions::new().with_max_payload_bytes(0)),
            "max_payload_bytes"
        );
        assert_eq!(field(EmitOptions::new().with_channel("")), "channel");
        assert_eq!(
            field(EmitOptions::new().with_channel("c".repeat(64))),
            "channel"
        );
        assert_eq!(field(EmitOptions::new().with_channel("a\0b")), "channel");
        let longest = EmitOptions::new().with_channel("c".repeat(63));
        assert_eq!(longest.validate(), Ok(()));
    }

    #[test]
    fn each_setter_keeps_the_other_fields() {
        let o = EmitOptions::new()
            .with_max_payload_bytes(10)
            .with_notify(Notify::Never)
            .with_channel("ch")
            .with_header("a", "1")
            .with_header("b", "2");
        assert_eq!(o.max_payload_bytes, 10);
        assert_eq!(o.notify, Notify::Never);
        assert_eq!(o.channel, "ch");
        assert_eq!(o.headers.len(), 2);
        let replaced = o.with_headers(Headers::new());
        assert!(replaced.headers.is_empty());
        assert_eq!(replaced.channel, "ch");
    }
}
