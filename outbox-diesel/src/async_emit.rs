//! Emit on diesel-async connections: [`AsyncEmit`], the async twin of [`Emit`](crate::Emit).

use std::future::Future;

use diesel_async::AsyncConnectionCore;
use outbox_core::{Envelope, MsgId, OutboxEvent};

use crate::{EmitOptions, Result};

/// The default options, as a place that lives as long as the futures borrowing it.
static DEFAULT_OPTIONS: EmitOptions = EmitOptions::DEFAULT;

/// The backends whose async connections [`AsyncEmit`] writes to: PostgreSQL (feature
/// `async-postgres`) and MySQL / MariaDB (feature `async-mysql`). Crate-private, so
/// `AsyncEmit` is sealed. Each backend runs the statements of its blocking emit (the
/// same query types, hence the same SQL text and prepared-statement cache keys).
pub(crate) trait AsyncInsert: diesel::backend::Backend {
    /// Inserts envelopes (validated by the caller: sizes, in-batch duplicates).
    fn insert<C>(
        conn: &mut C,
        options: &EmitOptions,
        envelopes: &[Envelope],
    ) -> impl Future<Output = Result<()>> + Send
    where
        C: AsyncConnectionCore<Backend = Self>;
}

/// Writes events to the outbox in the caller's diesel-async transaction: `use
/// outbox_diesel::AsyncEmit;` adds these methods to `AsyncPgConnection` (feature
/// `async-postgres`), `AsyncMysqlConnection` (feature `async-mysql`) and the pooled
/// connections of diesel-async's pools (deadpool, bb8, mobc), which dereference to them.
///
/// Everything [`Emit`](crate::Emit) says holds here: the same statements (on PostgreSQL
/// with the same [`Notify`](crate::Notify) modes, so a parked relay wakes up the same
/// way), the same checks and the same errors — a duplicate msg_id is
/// [`outbox_core::Error::Duplicate`] and leaves the transaction usable, and after `?` has
/// turned it into a [`diesel::result::Error`], [`is_duplicate`](crate::is_duplicate)
/// recognizes it. The event is serialized before the returned future first runs, so the
/// event type need not be `Send`; the future is.
///
/// ```no_run
/// # #[cfg(feature = "async-postgres")]
/// # async fn pay(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), diesel::result::Error> {
/// use diesel_async::AsyncConnection as _;
/// use outbox_core::OutboxEvent;
/// use outbox_diesel::AsyncEmit as _;
///
/// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
/// struct OrderPaid {
///     #[outbox(id)]
///     order_id: String,
/// }
///
/// conn.transaction(async |c| {
///     // ... your own statements on `c` ...
///     c.emit(OrderPaid { order_id: "o-1".into() }).await?;
///     Ok(())
/// })
/// .await
/// # }
/// # #[cfg(feature = "async-postgres")]
/// # fn main() { let _ = pay; }
/// # #[cfg(not(feature = "async-postgres"))]
/// # fn main() {}
/// ```
#[allow(private_bounds)] // the crate-private `AsyncInsert` is the seal
pub trait AsyncEmit: AsyncConnectionCore<Backend: AsyncInsert> + Sized {
    /// Writes `event` with the default [`EmitOptions`] and returns its msg_id.
    fn emit<E: OutboxEvent>(&mut self, event: E) -> impl Future<Output = Result<MsgId>> + Send {
        self.emit_with(&DEFAULT_OPTIONS, event)
    }

    /// Writes `event` with `options` and returns its msg_id. Options that break their
    /// rules ([`EmitOptions::validate`]) are refused with [`outbox_core::Error::Config`].
    fn emit_with<E: OutboxEvent>(
        &mut self,
        options: &EmitOptions,
        event: E,
    ) -> impl Future<Output = Result<MsgId>> + Send {
        let envelope = options.prepare_one(&event);
        async move {
            let envelope = envelope?;
            Self::Backend::insert(self, options, std::slice::from_ref(&envelope)).await?;
            Ok(envelope.msg_id)
        }
    }

    /// Writes several events in one multi-row `INSERT` (chunked past 1000 rows), all or
    /// nothing: on any error (a duplicate included) none of them is left in the
    /// transaction.
    fn emit_all<E, I>(&mut self, events: I) -> impl Future<Output = Result<Vec<MsgId>>> + Send
    where
        E: OutboxEvent,
        I: IntoIterator<Item = E>,
    {
        self.emit_all_with(&DEFAULT_OPTIONS, events)
    }

    /// [`emit_all`](Self::emit_all) with `options`.
    fn emit_all_with<E, I>(
        &mut self,
        options: &EmitOptions,
        events: I,
    ) -> impl Future<Output = Result<Vec<MsgId>>> + Send
    where
        E: OutboxEvent,
        I: IntoIterator<Item = E>,
    {
        // Validated, within the payload limit and traced already: only the msg_ids are
        // left to check.
        let envelopes = options
            .prepare_all(events)
            .and_then(|envelopes| crate::emit::unique_msg_ids(&envelopes).map(|()| envelopes));
        async move {
            let envelopes = envelopes?;
            if !envelopes.is_empty() {
                Self::Backend::insert(self, options, &envelopes).await?;
            }
            Ok(envelopes.into_iter().map(|e| e.msg_id).collect())
        }
    }

    /// Writes ready-made envelopes; all or nothing like [`emit_all`](Self::emit_all). The
    /// payload limit of `options` is checked here too.
    fn emit_envelopes(
        &mut self,
        options: &EmitOptions,
        envelopes: &[Envelope],
    ) -> impl Future<Output = Result<()>> + Send {
        // The caller's span, not whichever is current when the future is polled.
        let envelopes = crate::emit::with_trace(envelopes);
        async move {
            options.check_envelopes(&envelopes)?;
            if envelopes.is_empty() {
                return Ok(());
            }
            Self::Backend::insert(self, options, &envelopes).await
        }
    }
}

impl<C> AsyncEmit for C where C: AsyncConnectionCore<Backend: AsyncInsert> {}
