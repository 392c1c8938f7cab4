//! What the CDC tests share: a private PostgreSQL with logical decoding, the outbox
//! migrated in it, rows inserted by plain SQL, a Redis publisher under a unique prefix,
//! and the stream read back.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use diesel::connection::SimpleConnection as _;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::{Connection as _, PgConnection, RunQueryDsl as _};
use outbox_cdc::{CdcConfig, CdcRelay, PgPool};
use outbox_core::{Error, PublishOutcomes, Publisher, Rejected, StoredMessage};
use outbox_redis::{PublisherConfig, RedisPublisher};
use outbox_tests::{ScratchPostgres, Stoppable, redis_url, spawn_until, unique_prefix};

/// The topic every test row is published to.
pub const TOPIC: &str = "cdc.test";

/// A private cluster with the outbox migrated (unpartitioned, or partitioned).
pub struct Db {
    pub server: ScratchPostgres,
    pub url: String,
    pub pool: PgPool,
}

impl Db {
    pub fn start(partitioned: bool) -> Self {
        Self::start_with(partitioned, &[])
    }

    pub fn start_with(partitioned: bool, settings: &[(&str, &str)]) -> Self {
        let mut all = vec![
            ("wal_level", "logical"),
            ("max_replication_slots", "10"),
            ("max_wal_senders", "10"),
        ];
        all.extend_from_slice(settings);
        let server = ScratchPostgres::start_with(&all);
        let url = server.url();
        let pool = Pool::builder()
            .max_size(6)
            .build(ConnectionManager::<PgConnection>::new(&url))
            .expect("pool");
        let db = Self { server, url, pool };
        let mut c = db.conn();
        if partitioned {
            outbox_diesel::migrate_partitioned(&mut c, &outbox_diesel::PartitionPolicy::default())
                .expect("partitioned migration");
            outbox_diesel::maintain_partitions(&mut c).expect("partitions");
        } else {
            outbox_diesel::migrate(&mut c).expect("migration");
        }
        db
    }

    pub fn conn(&self) -> PgConnection {
        PgConnection::establish(&self.url).expect("connect to the scratch PostgreSQL")
    }

    /// CDC mode set up with `config`.
    pub fn setup(&self, config: &CdcConfig) -> outbox_cdc::SetupReport {
        outbox_cdc::setup(&mut self.conn(), config).expect("setup")
    }

    /// One scalar of `sql` as i64 (column `v`).
    pub fn scalar(&self, sql: &str) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct Row {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            v: i64,
        }
        diesel::sql_query(sql)
            .get_result::<Row>(&mut self.conn())
            .expect(sql)
            .v
    }
}

/// The msg_id of message `n` of `key`.
pub fn msg_id(key: &str, n: u32) -> String {
    format!("{key}:{n}")
}

/// Inserts message `n` of `key` on `c` (in whatever transaction `c` is in), as emit does.
pub fn insert(c: &mut PgConnection, key: &str, n: u32) {
    c.batch_execute(&format!(
        "INSERT INTO outbox (msg_id, topic, event_type, msg_key, payload) \
         VALUES ('{id}', '{TOPIC}', 'Ping', '{key}', '{{\"n\": {n}}}')",
        id = msg_id(key, n)
    ))
    .expect("insert");
}

/// Inserts messages `from..to` of `key`, each in its own transaction.
pub fn insert_each(db: &Db, key: &str, range: std::ops::Range<u32>) {
    let mut c = db.conn();
    for n in range {
        insert(&mut c, key, n);
    }
}

/// A Redis publisher under a unique stream prefix; the stream's name.
pub fn publisher() -> (RedisPublisher, String) {
    let prefix = unique_prefix("cdc");
    let p = RedisPublisher::new(redis_url())
        .expect("redis url")
        .with_config(PublisherConfig::default().with_stream_prefix(prefix.clone()))
        .expect("publisher config");
    (p, format!("{prefix}{TOPIC}"))
}

/// Another publisher to the stream `name` (of [`publisher`]).
pub fn publisher_for(name: &str) -> RedisPublisher {
    let prefix = name.strip_suffix(TOPIC).expect("a stream of TOPIC");
    RedisPublisher::new(redis_url())
        .expect("redis url")
        .with_config(PublisherConfig::default().with_stream_prefix(prefix.to_owned()))
        .expect("publisher config")
}

/// Each entry on `stream` as (msg_id, payload, headers), in stream order.
pub fn entries(stream: &str) -> Vec<(String, String, String)> {
    let client = redis::Client::open(redis_url()).expect("redis");
    let mut c = client.get_connection().expect("redis connection");
    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(&mut c)
        .expect("XRANGE");
    reply
        .ids
        .iter()
        .map(|e| {
            let field = |f: &str| e.get::<String>(f).unwrap_or_default();
            let msg_id = e.get::<String>("msg_id").expect("msg_id field");
            (msg_id, field("payload"), field("headers"))
        })
        .collect()
}

/// The msg_ids on `stream`, in stream order.
pub fn stream(stream: &str) -> Vec<String> {
    entries(stream).into_iter().map(|(id, ..)| id).collect()
}

/// Waits until `stream` holds every msg_id of `expected` (up to 60 s); the stream.
pub fn wait_for_all(name: &str, expected: &[String]) -> Vec<String> {
    let want: HashSet<&String> = expected.iter().collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let got = stream(name);
        let have: HashSet<&String> = got.iter().collect();
        if want.is_subset(&have) {
            return got;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "missing on the stream after 60 s: {:?}",
            want.difference(&have).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The first occurrence of each msg_id, in stream order.
pub fn firsts(got: &[String]) -> Vec<String> {
    let mut seen = HashSet::new();
    got.iter()
        .filter(|m| seen.insert(m.as_str()))
        .cloned()
        .collect()
}

/// A config for tests: short intervals.
pub fn fast() -> CdcConfig {
    CdcConfig::default()
        .with_status_interval(Duration::from_millis(200))
        .with_takeover_after(Duration::from_secs(3))
        .with_standby_poll(Duration::from_millis(200))
        .with_retry_poll(Duration::from_millis(100))
        .with_lag_interval(Duration::from_millis(200))
        .with_outage_backoff(
            outbox_core::OutageBackoff::default()
                .with_min(Duration::from_millis(50))
                .with_max(Duration::from_millis(500)),
        )
}

/// A relay task over `db`, stopped by the returned sender.
pub fn spawn_relay<P: Publisher + 'static>(
    db: &Db,
    publisher: P,
    config: CdcConfig,
) -> Stoppable<outbox_cdc::Result<()>> {
    let relay = CdcRelay::new(&db.url, db.pool.clone(), publisher)
        .expect("relay")
        .with_config(config)
        .expect("config");
    spawn_until(move |stop| async move { relay.run_until(stop).await })
}

/// A publisher that refuses the messages whose msg_id is in its list, each a number of
/// times (`u32::MAX`: always), and publishes everything else through `inner`.
pub struct Refusing<P> {
    pub inner: P,
    pub refuse: Mutex<Vec<(String, u32)>>,
    pub attempts: Mutex<Vec<String>>,
}

impl<P> Refusing<P> {
    pub fn new(inner: P, refuse: &[(&str, u32)]) -> Self {
        Self {
            inner,
            refuse: Mutex::new(refuse.iter().map(|(m, n)| ((*m).to_owned(), *n)).collect()),
            attempts: Mutex::new(Vec::new()),
        }
    }
}

impl<P: Publisher> Publisher for Refusing<P> {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        let mut refused = vec![false; batch.len()];
        {
            let mut list = self.refuse.lock().unwrap();
            let mut attempts = self.attempts.lock().unwrap();
            for (i, m) in batch.iter().enumerate() {
                attempts.push(m.envelope.msg_id.to_string());
                if let Some((_, left)) = list
                    .iter_mut()
                    .find(|(id, _)| id == m.envelope.msg_id.as_str())
                    && *left > 0
                {
                    *left = left.saturating_sub(1);
                    refused[i] = true;
                }
            }
        }
        let pass: Vec<StoredMessage> = batch
            .iter()
            .zip(&refused)
            .filter(|(_, r)| !**r)
            .map(|(m, _)| m.clone())
            .collect();
        let mut published = self.inner.publish(&pass).await?.into_iter();
        Ok(refused
            .iter()
            .map(|&r| {
                if r {
                    Err(Rejected::new("refused by the test"))
                } else {
                    published.next().unwrap_or(Ok(()))
                }
            })
            .collect())
    }
}

/// A polling relay (`polling`, spawned) started by mistake in CDC mode stops at once with
/// a relay conflict whose reason names `relay`, the relay that owns the outbox.
pub async fn assert_refused_in_cdc_mode(polling: Stoppable<Result<(), Error>>, relay: &str) {
    let (_stop, task) = polling;
    let refused = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the polling relay stops at once")
        .unwrap()
        .unwrap_err();
    assert!(refused.is_relay_conflict(), "{refused}");
    let chain = outbox_core::error_chain(&refused).to_string();
    assert!(chain.contains(relay), "{refused}");
}

/// A publisher whose call carrying `trigger` fails once as an outage (Redis down),
/// before publishing anything of it.
pub struct DownOnce<P> {
    pub inner: P,
    pub trigger: &'static str,
    pub fired: std::sync::atomic::AtomicBool,
}

impl<P: Publisher> Publisher for DownOnce<P> {
    async fn publish(&self, batch: &[StoredMessage]) -> Result<PublishOutcomes, Error> {
        if batch
            .iter()
            .any(|m| m.envelope.msg_id.as_str() == self.trigger)
            && !self.fired.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(Error::broker_unavailable("down for the test"));
        }
        self.inner.publish(batch).await
    }
}
