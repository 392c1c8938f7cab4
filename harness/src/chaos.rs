//! What the chaos run's processes share: the [`Tick`] event, the tables, and the
//! consumer's handler, which makes a double application visible.
//!
//! The producer commits per-key sequences: the `n`-th committed [`Tick`] of key `k` has
//! `seq == n`, allocated by bumping `chaos_keys.next_seq` in the emitting transaction (a
//! rolled-back transaction gives its numbers back). The consumer's handler adds `seq` to
//! the key's row of `chaos_sums` and increments its count, and appends a row to
//! `chaos_log`, which has no unique key: each application leaves a trace, so applying a
//! message twice shows as a count above `n`, a sum above `n(n+1)/2`, and two log rows.
//! It also keeps the key's last applied `seq` and counts each application that does not
//! follow it (`breaks`): the order at the handler, which ordered consumers promise. The
//! key's row lock serializes its applications, so the count is in commit order.
//!
//! `bin/chaos/` runs the whole experiment; `bin/chaos_consumer.rs` is the consumer
//! process it starts.

use diesel::prelude::*;
use outbox_core::{AsyncTxHandler, Delivery, Handler, HandlerError, OutboxEvent};
use outbox_diesel::Emit as _;
use serde::{Deserialize, Serialize};

/// One step of a key's sequence. The msg_id, `{key}/{seq}/{tx}:Tick`, names the
/// producer's transaction too, so a message of a rolled-back transaction can be told
/// apart from the committed message that later took its sequence number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, OutboxEvent)]
#[outbox(topic = "chaos.tick", key = key, id = "{key}/{seq}/{tx}")]
pub struct Tick {
    /// The ordering key.
    pub key: String,
    /// Position in the key's sequence, from 1.
    pub seq: i64,
    /// The producer transaction that emitted it.
    pub tx: u64,
}

/// The parts of a [`Tick`] msg_id: key, seq and transaction, or `None` if `msg_id` is not
/// one.
pub fn parse_msg_id(msg_id: &str) -> Option<(&str, i64, u64)> {
    let body = msg_id.strip_suffix(":Tick")?;
    let mut parts = body.rsplitn(3, '/');
    let tx = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    let key = parts.next()?;
    Some((key, seq, tx))
}

diesel::table! {
    /// The producer's counter per key: the last committed sequence number.
    chaos_keys (k) {
        /// The key.
        k -> Text,
        /// The last sequence number handed out by a committed transaction.
        next_seq -> BigInt,
    }
}

diesel::table! {
    /// The consumer's effect per key.
    chaos_sums (k) {
        /// The key.
        k -> Text,
        /// Sum of the applied messages' sequence numbers.
        total -> BigInt,
        /// Number of applications.
        applied -> BigInt,
        /// The `seq` of the last application.
        last_seq -> BigInt,
        /// Applications whose `seq` did not follow `last_seq`.
        breaks -> BigInt,
    }
}

diesel::table! {
    /// The producers' committed transactions, one row each, written in the transaction:
    /// whether one whose COMMIT was cut off committed after all, whatever retention left
    /// of its outbox rows.
    chaos_txs (tx) {
        /// The transaction's id.
        tx -> BigInt,
    }
}

diesel::table! {
    /// One row per application (no unique key, on purpose).
    chaos_log (id) {
        /// Row id.
        id -> BigInt,
        /// The applied message.
        msg_id -> Text,
        /// Its key.
        k -> Text,
        /// Its sequence number.
        seq -> BigInt,
    }
}

/// The chaos tables on PostgreSQL.
pub const POSTGRES_SETUP: &str = "
    CREATE TABLE chaos_keys (k VARCHAR(32) PRIMARY KEY, next_seq BIGINT NOT NULL);
    CREATE TABLE chaos_sums (k VARCHAR(32) PRIMARY KEY, total BIGINT NOT NULL, applied BIGINT NOT NULL,
                             last_seq BIGINT NOT NULL DEFAULT 0, breaks BIGINT NOT NULL DEFAULT 0);
    CREATE TABLE chaos_log (id BIGSERIAL PRIMARY KEY, msg_id VARCHAR(64) NOT NULL,
                            k VARCHAR(32) NOT NULL, seq BIGINT NOT NULL);
    CREATE TABLE chaos_txs (tx BIGINT PRIMARY KEY);
";

/// The chaos tables on MySQL / MariaDB.
pub const MYSQL_SETUP: &str = "
    CREATE TABLE chaos_keys (k VARCHAR(32) PRIMARY KEY, next_seq BIGINT NOT NULL);
    CREATE TABLE chaos_sums (k VARCHAR(32) PRIMARY KEY, total BIGINT NOT NULL, applied BIGINT NOT NULL,
                             last_seq BIGINT NOT NULL DEFAULT 0, breaks BIGINT NOT NULL DEFAULT 0);
    CREATE TABLE chaos_log (id BIGINT AUTO_INCREMENT PRIMARY KEY, msg_id VARCHAR(64) NOT NULL,
                            k VARCHAR(32) NOT NULL, seq BIGINT NOT NULL);
    CREATE TABLE chaos_txs (tx BIGINT PRIMARY KEY);
";

/// The name of key number `i`.
pub fn key_name(i: usize) -> String {
    format!("k{i}")
}

/// The database work of the chaos run, on one connection type.
pub trait ChaosDb: Connection {
    /// Inserts the rows of keys `0..keys` into `chaos_keys` and `chaos_sums`.
    fn seed_keys(&mut self, keys: usize) -> QueryResult<()>;
    /// Takes the key's next sequence number and emits its [`Tick`] (inside the caller's
    /// transaction).
    fn emit_next(&mut self, key: &str, tx: u64) -> Result<Tick, outbox_diesel::Error>;
    /// Applies `tick` (the handler's writes).
    fn apply(&mut self, tick: &Tick, msg_id: &str) -> QueryResult<()>;
    /// Records producer transaction `tx` in `chaos_txs` (inside it).
    fn record_tx(&mut self, tx: u64) -> QueryResult<()>;
    /// Whether producer transaction `tx` committed (its `chaos_txs` row exists).
    fn tx_committed(&mut self, tx: u64) -> QueryResult<bool>;
}

/// The handler's writes for `tick`, run by `$run` on each statement (`q`): the blocking
/// and the async handler share the statements, each runs them its own way.
macro_rules! apply_tick {
    ($tick:expr, $msg_id:expr, |$q:ident| $run:expr) => {{
        let tick: &Tick = $tick;
        // `breaks` before `last_seq`: MySQL assigns left to right, so the comparison
        // sees the old `last_seq` there as on PostgreSQL.
        let broke = diesel::dsl::sql::<diesel::sql_types::BigInt>("CASE WHEN last_seq + 1 = ")
            .bind::<diesel::sql_types::BigInt, _>(tick.seq)
            .sql(" THEN 0 ELSE 1 END");
        let rows = {
            let $q = diesel::update(chaos_sums::table.find(&tick.key)).set((
                chaos_sums::total.eq(chaos_sums::total + tick.seq),
                chaos_sums::applied.eq(chaos_sums::applied + 1),
                chaos_sums::breaks.eq(chaos_sums::breaks + broke),
                chaos_sums::last_seq.eq(tick.seq),
            ));
            $run?
        };
        if rows != 1 {
            return Err(diesel::result::Error::NotFound);
        }
        let $q = diesel::insert_into(chaos_log::table).values((
            chaos_log::msg_id.eq($msg_id),
            chaos_log::k.eq(&tick.key),
            chaos_log::seq.eq(tick.seq),
        ));
        $run.map(drop)
    }};
}

macro_rules! impl_chaos_db {
    ($($conn:ty),*) => {$(
        impl ChaosDb for $conn {
            fn seed_keys(&mut self, keys: usize) -> QueryResult<()> {
                let names: Vec<String> = (0..keys).map(key_name).collect();
                diesel::insert_into(chaos_keys::table)
                    .values(names.iter().map(|k| (chaos_keys::k.eq(k), chaos_keys::next_seq.eq(0))).collect::<Vec<_>>())
                    .execute(self)?;
                diesel::insert_into(chaos_sums::table)
                    .values(names.iter().map(|k| (chaos_sums::k.eq(k), chaos_sums::total.eq(0), chaos_sums::applied.eq(0))).collect::<Vec<_>>())
                    .execute(self)
                    .map(drop)
            }

            fn emit_next(&mut self, key: &str, tx: u64) -> Result<Tick, outbox_diesel::Error> {
                // The UPDATE locks the key's row until the transaction ends, which
                // serializes the writers of one key: its outbox ids follow commit order,
                // as the relay's per-key order requires.
                diesel::update(chaos_keys::table.find(key))
                    .set(chaos_keys::next_seq.eq(chaos_keys::next_seq + 1))
                    .execute(self)?;
                let seq = chaos_keys::table.find(key).select(chaos_keys::next_seq).first(self)?;
                let tick = Tick { key: key.to_owned(), seq, tx };
                self.emit(tick.clone())?;
                Ok(tick)
            }

            fn apply(&mut self, tick: &Tick, msg_id: &str) -> QueryResult<()> {
                apply_tick!(tick, msg_id, |q| q.execute(self))
            }

            fn record_tx(&mut self, tx: u64) -> QueryResult<()> {
                diesel::insert_into(chaos_txs::table)
                    .values(chaos_txs::tx.eq(tx as i64))
                    .execute(self)
                    .map(drop)
            }

            fn tx_committed(&mut self, tx: u64) -> QueryResult<bool> {
                let n: i64 = chaos_txs::table.find(tx as i64).count().get_result(self)?;
                Ok(n > 0)
            }
        }
    )*};
}

impl_chaos_db!(diesel::PgConnection, diesel::MysqlConnection);

/// A fault the handler plays on a message's first delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerFault {
    /// Return an error after the handler's writes (which must roll back).
    Fail,
    /// Panic after the handler's writes (which must roll back).
    Panic,
}

/// The fault, if any, for `msg_id`: about one message in `one_in` fails and another one
/// in `one_in` panics on its first delivery (none with `one_in` 0 or 1). Decided by a
/// hash of the msg_id, so the run knows afterwards which messages were hit.
pub fn handler_fault(msg_id: &str, one_in: u64) -> Option<HandlerFault> {
    if one_in < 2 {
        return None;
    }
    match fnv1a(msg_id.as_bytes()) % one_in {
        0 => Some(HandlerFault::Fail),
        1 => Some(HandlerFault::Panic),
        _ => None,
    }
}

/// FNV-1a: stable across processes and builds, unlike the standard library's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The consumer's handler: applies each [`Tick`] to `chaos_sums` and `chaos_log`, and
/// fails or panics on the first delivery of the messages [`handler_fault`] picks, after
/// its writes, so that a rollback that did not happen would show.
pub struct ApplyTick<C> {
    fault_one_in: u64,
    conn: std::marker::PhantomData<fn() -> C>,
}

impl<C> ApplyTick<C> {
    /// The handler; see [`handler_fault`] for `fault_one_in`.
    pub fn new(fault_one_in: u64) -> Self {
        Self {
            fault_one_in,
            conn: std::marker::PhantomData,
        }
    }
}

impl<C: ChaosDb + 'static> Handler<Tick> for ApplyTick<C> {
    type Conn = C;

    fn handle(&self, tick: Tick, conn: &mut C, d: &Delivery) -> Result<(), HandlerError> {
        let msg_id = d.envelope.msg_id.as_str();
        conn.apply(&tick, msg_id)?;
        play_fault(d, self.fault_one_in)
    }
}

/// After the handler's writes: fails or panics on the first delivery of the messages
/// [`handler_fault`] picks.
fn play_fault(d: &Delivery, fault_one_in: u64) -> Result<(), HandlerError> {
    let msg_id = d.envelope.msg_id.as_str();
    if d.delivery_count > 1 {
        return Ok(());
    }
    match handler_fault(msg_id, fault_one_in) {
        Some(HandlerFault::Fail) => Err(HandlerError::msg(format!(
            "chaos: {msg_id} fails on its first delivery"
        ))),
        Some(HandlerFault::Panic) => panic!("chaos: {msg_id} panics on its first delivery"),
        None => Ok(()),
    }
}

/// [`ApplyTick`] on diesel-async's PostgreSQL connection, for consumers on the async inbox
/// (`chaos_consumer --async-inbox`): the same writes and faults, awaited in the dedup
/// transaction.
pub struct ApplyTickAsync {
    fault_one_in: u64,
}

impl ApplyTickAsync {
    /// The handler; see [`handler_fault`] for `fault_one_in`.
    pub fn new(fault_one_in: u64) -> Self {
        Self { fault_one_in }
    }
}

impl AsyncTxHandler<Tick> for ApplyTickAsync {
    type Conn = diesel_async::AsyncPgConnection;

    async fn handle(
        &self,
        tick: Tick,
        conn: &mut diesel_async::AsyncPgConnection,
        d: &Delivery,
    ) -> Result<(), HandlerError> {
        nonblocking::apply(conn, &tick, d.envelope.msg_id.as_str()).await?;
        play_fault(d, self.fault_one_in)
    }
}

mod nonblocking {
    // Not diesel's prelude: its `RunQueryDsl` would make `execute` ambiguous.
    use diesel::result::QueryResult;
    use diesel::{ExpressionMethods as _, QueryDsl as _};
    use diesel_async::{AsyncPgConnection, RunQueryDsl as _};

    use super::{Tick, chaos_log, chaos_sums};

    /// [`ChaosDb::apply`](super::ChaosDb::apply), awaited.
    pub(super) async fn apply(
        conn: &mut AsyncPgConnection,
        tick: &Tick,
        msg_id: &str,
    ) -> QueryResult<()> {
        apply_tick!(tick, msg_id, |q| q.execute(conn).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msg_ids_round_trip() {
        let t = Tick {
            key: "k7".into(),
            seq: 42,
            tx: 1 << 40,
        };
        let id = t.msg_id().unwrap();
        assert_eq!(id.as_str(), "k7/42/1099511627776:Tick");
        assert_eq!(parse_msg_id(id.as_str()), Some(("k7", 42, 1 << 40)));
        assert_eq!(t.ordering_key(), "k7");
        assert_eq!(parse_msg_id("k7/42:Tick"), None);
        assert_eq!(parse_msg_id("k7/x/1:Tick"), None);
    }

    #[test]
    fn handler_faults_are_rare_and_stable() {
        let hit = |i: u64| handler_fault(&format!("k1/{i}/7:Tick"), 100);
        let fails = (0..10_000)
            .filter(|&i| hit(i) == Some(HandlerFault::Fail))
            .count();
        let panics = (0..10_000)
            .filter(|&i| hit(i) == Some(HandlerFault::Panic))
            .count();
        assert!((50..200).contains(&fails), "{fails}");
        assert!((50..200).contains(&panics), "{panics}");
        assert_eq!(handler_fault("k1/1/7:Tick", 0), None);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
