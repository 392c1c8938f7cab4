//! Emit throughput against a hand-written diesel insert of the same row, on PostgreSQL at
//! `DATABASE_URL`, with 1 and 8 connections; one event per transaction.
//!
//! Run with: `cargo bench -p outbox-diesel --bench emit` (`BENCH_TXNS` transactions per
//! connection and round, default 1000). Prints throughputs and the ratio emit / hand-written;
//! the target is ≥ 0.95 (without NOTIFY).

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection as _;
use diesel::prelude::*;
use outbox_core::OutboxEvent;
use outbox_diesel::schema::pg::outbox;
use outbox_diesel::{Emit, EmitOptions, Notify};

#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
struct AccountTransferred {
    #[outbox(id)]
    transfer_id: String,
    from: String,
    to: String,
    amount: i64,
}

fn event(round: &str, worker: usize, i: usize) -> AccountTransferred {
    AccountTransferred {
        transfer_id: format!("{round}-{worker}-{i}"),
        from: "alice".into(),
        to: "bob".into(),
        amount: 100,
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Way {
    Hand,
    Emit(Notify),
}

fn hand_written(c: &mut PgConnection, e: &AccountTransferred) -> QueryResult<usize> {
    let payload = serde_json::to_value(e).expect("serializable");
    diesel::insert_into(outbox::table)
        .values((
            outbox::msg_id.eq(e.msg_id().expect("valid").into_string()),
            outbox::topic.eq(e.topic()),
            outbox::event_type.eq(e.event_type()),
            outbox::msg_key.eq(e.ordering_key()),
            outbox::schema_version.eq(1),
            outbox::payload.eq(payload),
            outbox::headers.eq(serde_json::json!({})),
        ))
        .execute(c)
}

fn run(url: &str, way: Way, conns: usize, txns: usize) -> f64 {
    let round = format!("{way:?}-{conns}-{:08x}", fastrand::u32(..));
    let started = Instant::now();
    std::thread::scope(|s| {
        for w in 0..conns {
            let round = &round;
            s.spawn(move || {
                let mut c = PgConnection::establish(url).expect("PostgreSQL reachable");
                let opts = match way {
                    Way::Emit(n) => EmitOptions::new().notify(n),
                    Way::Hand => EmitOptions::new(),
                };
                for i in 0..txns {
                    let e = event(round, w, i);
                    c.transaction(|c| {
                        match way {
                            Way::Hand => {
                                hand_written(c, &e)?;
                            }
                            Way::Emit(_) => {
                                c.emit_with(&opts, e)?;
                            }
                        }
                        Ok::<_, diesel::result::Error>(())
                    })
                    .expect("transaction");
                }
            });
        }
    });
    (conns * txns) as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let txns: usize = std::env::var("BENCH_TXNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let schema = format!("bench_{:08x}", fastrand::u32(..));
    let mut admin = PgConnection::establish(&base).expect("PostgreSQL reachable");
    admin
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .unwrap();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}options=-csearch_path%3D{schema}");
    outbox_diesel::migrate(&mut PgConnection::establish(&url).unwrap()).unwrap();

    for conns in [1, 8] {
        // Warm up, then alternate rounds and keep each way's best to damp noise.
        run(&url, Way::Hand, conns, txns / 10 + 1);
        run(&url, Way::Emit(Notify::Never), conns, txns / 10 + 1);
        let (mut hand, mut emit, mut idle) = (0f64, 0f64, 0f64);
        for _ in 0..3 {
            hand = hand.max(run(&url, Way::Hand, conns, txns));
            emit = emit.max(run(&url, Way::Emit(Notify::Never), conns, txns));
            idle = idle.max(run(&url, Way::Emit(Notify::WhenRelayIdle), conns, txns));
        }
        println!(
            "{conns} connection(s): hand-written {hand:.0} tx/s, emit {emit:.0} tx/s (ratio {:.3}), \
             emit WhenRelayIdle {idle:.0} tx/s (ratio {:.3})",
            emit / hand,
            idle / hand
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .unwrap();
}
