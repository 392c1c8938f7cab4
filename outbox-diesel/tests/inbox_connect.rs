//! `DieselInbox::connect` builds a pool that skips r2d2's `SELECT 1` on check-out: a
//! connection the server dropped fails one message's transaction (nothing is recorded,
//! so the message runs again), and the next message gets a new connection.

mod fixtures;

use diesel::RunQueryDsl as _;
use fixtures::{Backend, Pg};
use outbox_core::{Inbox, MsgId, Processed};
use outbox_diesel::PgInbox;

#[derive(diesel::QueryableByName)]
struct Pid {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pid: i32,
}

#[test]
fn pg_a_dropped_connection_fails_one_message_then_the_pool_reconnects() {
    let db = Pg::create();
    let inbox = PgInbox::connect(&db.url, 1).unwrap();
    let id = |s: &str| MsgId::new(s).unwrap();
    let mut pid = 0;
    let first = inbox.process("g", &id("a:E"), |c| {
        pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
            .get_result::<Pid>(c)?
            .pid;
        Ok(())
    });
    assert_eq!(first.unwrap(), Processed::Applied);

    // The server drops the pooled connection while it sits idle.
    let mut admin = Pg::connect(&db);
    diesel::sql_query(format!("SELECT pg_terminate_backend({pid})"))
        .execute(&mut admin)
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));

    let mut ran = false;
    let lost = inbox.process("g", &id("b:E"), |_| {
        ran = true;
        Ok(())
    });
    assert!(lost.is_err(), "the dead connection fails: {lost:?}");
    assert!(!ran, "the handler never ran on the dead connection");
    let again = inbox.process("g", &id("b:E"), |_| Ok(()));
    assert_eq!(again.unwrap(), Processed::Applied, "a new connection");
    let recorded = Pg::scalar(
        &mut admin,
        "SELECT count(*) AS n FROM consumed_msg WHERE consumer_group = 'g'",
    );
    assert_eq!(recorded, 2);
}
