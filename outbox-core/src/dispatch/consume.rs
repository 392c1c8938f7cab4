use super::Dispatcher;
use super::prepared::{run_async_catching_panic, run_catching_panic};
use crate::{
    AsyncInbox, Delivery, Error, HandlerError, Inbox, InboxBatchOutcomes, Prepared, Processed,
};

impl<C: 'static> Dispatcher<C> {
    /// [`consume`](Self::consume) on an [`AsyncInbox`]: decodes `delivery`, then awaits
    /// the dedup transaction with the handler inside it. A panic of the handler is
    /// caught inside the transaction, which then rolls back, and reported as
    /// [`Error::Handler`] ("handler panicked: ..").
    pub async fn consume_async<I>(
        &self,
        inbox: &I,
        group: &str,
        delivery: &Delivery,
    ) -> Result<Processed, Error>
    where
        I: AsyncInbox<Conn = C>,
        C: Send,
    {
        let prepared = self.prepare(&delivery.envelope)?;
        Self::consume_prepared(inbox, group, prepared, delivery.clone()).await
    }

    /// The transaction of [`consume_async`](Self::consume_async) for a message prepared
    /// already ([`prepare`](Self::prepare)).
    pub async fn consume_prepared<I>(
        inbox: &I,
        group: &str,
        prepared: Prepared<C>,
        delivery: Delivery,
    ) -> Result<Processed, Error>
    where
        I: AsyncInbox<Conn = C>,
        C: Send,
    {
        let msg_id = delivery.envelope.msg_id.clone();
        inbox
            .process(group, &msg_id, move |conn| {
                Box::pin(async move { run_async_catching_panic(prepared, conn, &delivery).await })
            })
            .await
    }

    /// [`consume_batch`](Self::consume_batch) on an [`AsyncInbox`]: the deliveries go
    /// through one [`AsyncInbox::process_batch`], with the same outcomes; a handler's
    /// panic costs only its own message.
    pub async fn consume_batch_async<I>(
        &self,
        inbox: &I,
        group: &str,
        deliveries: &[Delivery],
    ) -> Result<InboxBatchOutcomes, Error>
    where
        I: AsyncInbox<Conn = C>,
        C: Send,
    {
        let PreparedBatch {
            mut outcomes,
            mut runs,
            msg_ids,
        } = self.prepare_all(deliveries);
        if runs.is_empty() {
            return Ok(outcomes.into_iter().flatten().collect());
        }
        let processed = inbox
            .process_batch(group, &msg_ids, |i, conn| {
                let (delivery, prepared) = &mut runs[i];
                let (delivery, prepared) = ((*delivery).clone(), prepared.take());
                Box::pin(async move {
                    let prepared = prepared.ok_or_else(|| {
                        HandlerError::msg("the inbox ran this message's handler twice")
                    })?;
                    run_async_catching_panic(prepared, conn, &delivery).await
                })
            })
            .await?;
        merge_outcomes(&mut outcomes, processed, msg_ids.len())
    }

    /// Prepares each delivery of a batch ([`PreparedBatch`]).
    fn prepare_all<'d>(&self, deliveries: &'d [Delivery]) -> PreparedBatch<'d, C> {
        let mut outcomes = Vec::with_capacity(deliveries.len());
        let mut runs = Vec::new();
        let mut msg_ids = Vec::new();
        for delivery in deliveries {
            match self.prepare(&delivery.envelope) {
                Ok(prepared) => {
                    outcomes.push(None);
                    runs.push((delivery, Some(prepared)));
                    msg_ids.push(delivery.envelope.msg_id.clone());
                }
                Err(e) => outcomes.push(Some(Err(e))),
            }
        }
        PreparedBatch {
            outcomes,
            runs,
            msg_ids,
        }
    }

    /// Decodes and applies one delivery exactly once in effect for `group`: the dedup row
    /// and the handler's writes commit together in `inbox`.
    pub fn consume<I>(
        &self,
        inbox: &I,
        group: &str,
        delivery: &Delivery,
    ) -> Result<Processed, Error>
    where
        I: Inbox<Conn = C>,
    {
        let prepared = self.prepare(&delivery.envelope)?;
        inbox.process(group, &delivery.envelope.msg_id, |conn| {
            prepared.run(conn, delivery)
        })
    }

    /// Decodes and applies many deliveries for `group` through one
    /// [`Inbox::process_batch`]: with a store that has savepoints, one transaction for
    /// the batch and a savepoint per message.
    ///
    /// Returns one outcome per delivery, in order. A delivery that does not
    /// [`prepare`](Self::prepare) (an unknown type, an undecodable payload) gets that
    /// error ([`Error::is_poison`]) and never reaches the store; a handler that fails or
    /// panics (reported as [`Error::Handler`]) rolls back only its own message, and a
    /// message's transient conflict is its [`Error::Transient`]; the others commit
    /// together. The outer `Err` is the store's failure as a whole, or
    /// [`Error::TransientBatch`] when a conflict rolled back the whole transaction (see
    /// [`Inbox::process_batch`]): nothing is known to have committed.
    ///
    /// ```
    /// use outbox_core::{Delivery, Dispatcher, Envelope, Handler, HandlerError, MemoryDb,
    ///                   MemoryTx, OutboxEvent, Processed};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    /// struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64 }
    ///
    /// struct Total;
    /// impl Handler<OrderPaid> for Total {
    ///     type Conn = MemoryTx<i64>;
    ///     fn handle(&self, e: OrderPaid, tx: &mut MemoryTx<i64>, _: &Delivery) -> Result<(), HandlerError> {
    ///         if e.amount_cents < 0 {
    ///             return Err(HandlerError::msg("negative amount"));
    ///         }
    ///         *tx.data() += e.amount_cents;
    ///         Ok(())
    ///     }
    /// }
    ///
    /// let mut dispatcher = Dispatcher::new();
    /// dispatcher.register::<OrderPaid, _>(Total)?;
    /// let delivery = |id: &str, amount_cents| -> Result<Delivery, outbox_core::Error> {
    ///     let e = OrderPaid { order_id: id.into(), amount_cents };
    ///     Ok(Delivery { envelope: Envelope::from_event(&e, 1024)?, delivery_count: 1, entry_id: None })
    /// };
    /// let batch = [delivery("o-1", 100)?, delivery("o-2", -5)?, delivery("o-3", 20)?];
    ///
    /// let db = MemoryDb::new(0_i64);
    /// let outcomes = dispatcher.consume_batch(&db, "totals", &batch)?;
    /// assert!(matches!(outcomes[0], Ok(Processed::Applied)));
    /// let refused = outcomes[1].as_ref().unwrap_err();
    /// assert!(outbox_core::error_chain(refused).to_string().contains("negative amount"));
    /// assert!(matches!(outcomes[2], Ok(Processed::Applied)));
    /// assert_eq!(db.read(|total| *total), 120);
    /// # Ok::<_, outbox_core::Error>(())
    /// ```
    pub fn consume_batch<I>(
        &self,
        inbox: &I,
        group: &str,
        deliveries: &[Delivery],
    ) -> Result<InboxBatchOutcomes, Error>
    where
        I: Inbox<Conn = C>,
    {
        let PreparedBatch {
            mut outcomes,
            mut runs,
            msg_ids,
        } = self.prepare_all(deliveries);
        if runs.is_empty() {
            return Ok(outcomes.into_iter().flatten().collect());
        }
        let processed = inbox.process_batch(group, &msg_ids, |i, conn| {
            let (delivery, prepared) = &mut runs[i];
            let prepared = prepared
                .take()
                .ok_or_else(|| HandlerError::msg("the inbox ran this message's handler twice"))?;
            run_catching_panic(prepared, conn, delivery)
        })?;
        merge_outcomes(&mut outcomes, processed, msg_ids.len())
    }
}

/// A batch of deliveries as [`Dispatcher::prepare_all`] prepared it.
struct PreparedBatch<'d, C> {
    /// One per delivery, in order: `None` for a prepared delivery (its outcome comes
    /// from the store), the delivery's error otherwise.
    outcomes: Vec<Option<Result<Processed, Error>>>,
    /// The prepared deliveries, in order; each `Prepared` is taken by its handler's run.
    runs: Vec<(&'d Delivery, Option<Prepared<C>>)>,
    /// The msg_ids of `runs`, in the same order, for the store.
    msg_ids: Vec<crate::MsgId>,
}

/// The outcomes of a batch in delivery order: those decided before the store
/// (`Some`), and the store's for the others, in turn.
fn merge_outcomes(
    outcomes: &mut Vec<Option<Result<Processed, Error>>>,
    processed: InboxBatchOutcomes,
    expected: usize,
) -> Result<InboxBatchOutcomes, Error> {
    if processed.len() != expected {
        // A broken `Inbox` implementation: nothing can be told about any message.
        return Err(Error::store(format!(
            "Inbox::process_batch returned {} outcomes for {expected} messages",
            processed.len(),
        )));
    }
    let mut processed = processed.into_iter();
    Ok(std::mem::take(outcomes)
        .into_iter()
        .map(|o| o.unwrap_or_else(|| processed.next().expect("lengths checked above")))
        .collect())
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::{Envelope, Handler, MemoryDb, MemoryTx, MsgId, OutboxEvent};

    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    struct Credit {
        #[outbox(id)]
        id: String,
        amount: i64,
    }

    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    struct Credited {
        #[outbox(id)]
        id: String,
    }

    type Balances = BTreeMap<String, i64>;

    /// Credits the amount and emits `Credited`; a negative amount fails after writing,
    /// zero panics after writing.
    struct Apply(AtomicUsize);
    impl Handler<Credit> for Apply {
        type Conn = MemoryTx<Balances>;
        fn handle(
            &self,
            e: Credit,
            tx: &mut MemoryTx<Balances>,
            _: &Delivery,
        ) -> Result<(), HandlerError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            *tx.data().entry(e.id.clone()).or_default() += e.amount;
            tx.emit(Credited { id: e.id })?;
            match e.amount {
                0 => panic!("zero credit"),
                a if a < 0 => Err(HandlerError::msg("negative credit")),
                _ => Ok(()),
            }
        }
    }

    fn dispatcher() -> (Dispatcher<MemoryTx<Balances>>, Arc<Apply>) {
        struct Shared(Arc<Apply>);
        impl Handler<Credit> for Shared {
            type Conn = MemoryTx<Balances>;
            fn handle(
                &self,
                e: Credit,
                tx: &mut MemoryTx<Balances>,
                d: &Delivery,
            ) -> Result<(), HandlerError> {
                self.0.handle(e, tx, d)
            }
        }
        let apply = Arc::new(Apply(AtomicUsize::new(0)));
        let mut d = Dispatcher::new();
        d.register::<Credit, _>(Shared(Arc::clone(&apply))).unwrap();
        (d, apply)
    }

    fn credit(id: &str, amount: i64) -> Delivery {
        let e = Credit {
            id: id.into(),
            amount,
        };
        super::super::first_delivery(Envelope::from_event(&e, 1024).unwrap())
    }

    fn id(s: &str) -> MsgId {
        MsgId::new(s).unwrap()
    }

    fn kinds(outcomes: &[Result<Processed, Error>]) -> Vec<String> {
        outcomes
            .iter()
            .map(|o| match o {
                Ok(p) => format!("{p:?}"),
                Err(e) => format!("Err({})", crate::error_chain(e)),
            })
            .collect()
    }

    /// An inbox with only `process`: gets the default `process_batch`.
    struct OnlyProcess {
        db: MemoryDb<Balances>,
        transactions: AtomicUsize,
    }

    impl Inbox for OnlyProcess {
        type Conn = MemoryTx<Balances>;
        fn process<F>(&self, group: &str, msg_id: &MsgId, handle: F) -> Result<Processed, Error>
        where
            F: FnOnce(&mut MemoryTx<Balances>) -> Result<(), HandlerError>,
        {
            self.transactions.fetch_add(1, Ordering::SeqCst);
            if msg_id.as_str() == "down:Credit" {
                return Err(Error::store("connection refused"));
            }
            Inbox::process(&self.db, group, msg_id, handle)
        }
    }

    #[test]
    fn a_failing_message_in_a_memory_batch_leaves_no_trace_and_the_others_commit() {
        let db = MemoryDb::new(Balances::new());
        let (d, apply) = dispatcher();
        let batch = [credit("a", 10), credit("b", -5), credit("c", 20)];
        let outcomes = d.consume_batch(&db, "g", &batch).unwrap();
        assert_eq!(
            kinds(&outcomes),
            ["Applied", "Err(handler failed: negative credit)", "Applied"]
        );
        assert_eq!(apply.0.load(Ordering::SeqCst), 3);
        assert_eq!(
            db.read(Clone::clone),
            Balances::from([("a".into(), 10), ("c".into(), 20)])
        );
        let emitted: Vec<_> = db
            .rows()
            .iter()
            .map(|r| r.envelope.msg_id.to_string())
            .collect();
        assert_eq!(emitted, ["a:Credited", "c:Credited"]);
        // No dedup row for `b`: its redelivery runs the handler again.
        let again = d.consume_batch(&db, "g", &[credit("b", 5)]).unwrap();
        assert_eq!(kinds(&again), ["Applied"]);
        assert_eq!(db.read(|b| b["b"]), 5);
    }

    #[test]
    fn duplicates_in_the_batch_and_against_earlier_commits_do_not_run_the_handler() {
        let db = MemoryDb::new(Balances::new());
        let (d, apply) = dispatcher();
        assert_eq!(
            d.consume(&db, "g", &credit("a", 1)).unwrap(),
            Processed::Applied
        );
        let batch = [
            credit("a", 1),
            credit("b", 2),
            credit("b", 2),
            credit("c", -1),
            credit("c", 3),
        ];
        let outcomes = d.consume_batch(&db, "g", &batch).unwrap();
        // The second `c` runs: the first attempt failed and left no dedup row.
        assert_eq!(
            kinds(&outcomes),
            [
                "Duplicate",
                "Applied",
                "Duplicate",
                "Err(handler failed: negative credit)",
                "Applied"
            ]
        );
        assert_eq!(apply.0.load(Ordering::SeqCst), 1 + 3);
        assert_eq!(
            db.read(Clone::clone),
            Balances::from([("a".into(), 1), ("b".into(), 2), ("c".into(), 3)])
        );
        // Another group has its own dedup rows.
        let other = Inbox::process_batch(&db, "h", &[id("a:Credit")], |_, _| Ok(())).unwrap();
        assert_eq!(kinds(&other), ["Applied"]);
    }

    #[test]
    fn a_panicking_handler_fails_only_its_own_message() {
        let db = MemoryDb::new(Balances::new());
        let (d, _) = dispatcher();
        let outcomes = d
            .consume_batch(&db, "g", &[credit("a", 1), credit("z", 0), credit("c", 3)])
            .unwrap();
        assert_eq!(
            kinds(&outcomes),
            [
                "Applied",
                "Err(handler failed: handler panicked: zero credit)",
                "Applied"
            ]
        );
        assert!(db.read(|b| !b.contains_key("z") && b.len() == 2));
        assert!(db.row("z:Credited").is_none());
    }

    #[test]
    fn poison_is_reported_per_message_without_touching_the_store() {
        let inbox = OnlyProcess {
            db: MemoryDb::new(Balances::new()),
            transactions: AtomicUsize::new(0),
        };
        let (d, apply) = dispatcher();
        let mut unknown = credit("u", 1);
        unknown.envelope.event_type = "Debit".into();
        let mut garbled = credit("g", 1);
        garbled.envelope.payload = "{not json".into();
        let outcomes = d
            .consume_batch(&inbox, "g", &[unknown.clone(), garbled.clone()])
            .unwrap();
        assert!(
            outcomes
                .iter()
                .all(|o| o.as_ref().is_err_and(Error::is_poison))
        );
        assert_eq!(inbox.transactions.load(Ordering::SeqCst), 0);
        assert_eq!(apply.0.load(Ordering::SeqCst), 0);

        let outcomes = d
            .consume_batch(
                &inbox,
                "g",
                &[unknown, credit("a", 1), garbled, credit("b", 2)],
            )
            .unwrap();
        assert!(matches!(outcomes[0], Err(Error::UnknownEventType(_))));
        assert!(matches!(outcomes[1], Ok(Processed::Applied)));
        assert!(matches!(outcomes[2], Err(Error::Decode { .. })));
        assert!(matches!(outcomes[3], Ok(Processed::Applied)));
        assert_eq!(inbox.db.read(|b| b.len()), 2);
    }

    #[test]
    fn the_default_batch_processes_one_message_per_transaction() {
        let inbox = OnlyProcess {
            db: MemoryDb::new(Balances::new()),
            transactions: AtomicUsize::new(0),
        };
        let mut seen = Vec::new();
        let ids = [
            id("a:Credit"),
            id("down:Credit"),
            id("b:Credit"),
            id("a:Credit"),
        ];
        let outcomes = inbox
            .process_batch("g", &ids, |i, tx| {
                seen.push(i);
                *tx.data().entry(ids[i].to_string()).or_default() += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(
            kinds(&outcomes),
            [
                "Applied",
                "Err(store error: connection refused)",
                "Applied",
                "Duplicate"
            ]
        );
        assert!(outcomes[1].as_ref().is_err_and(Error::is_outage));
        assert_eq!(seen, [0, 2]);
        assert_eq!(inbox.transactions.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn an_empty_batch_is_empty() {
        let db = MemoryDb::new(Balances::new());
        let (d, _) = dispatcher();
        assert!(d.consume_batch(&db, "g", &[]).unwrap().is_empty());
        let none = Inbox::process_batch(&db, "g", &[], |_, _| Ok(())).unwrap();
        assert!(none.is_empty());
    }

    #[test]
    fn a_panic_inside_process_batch_itself_commits_nothing_in_memory() {
        let db = MemoryDb::new(Balances::new());
        let ids = [id("a:Credit"), id("b:Credit")];
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Inbox::process_batch(&db, "g", &ids, |i, tx: &mut MemoryTx<Balances>| {
                tx.data().insert("written".into(), 1);
                assert!(i == 0, "boom");
                Ok(())
            })
        }));
        assert!(unwound.is_err());
        assert!(db.read(|b| b.is_empty()));
        // Nor the dedup row of the message before the panic.
        let outcomes = Inbox::process_batch(&db, "g", &ids[..1], |_, _| Ok(())).unwrap();
        assert_eq!(kinds(&outcomes), ["Applied"]);
    }
}

/// [`MemoryDb`](crate::MemoryDb) as an [`AsyncInbox`]: users' unit tests of
/// [`AsyncTxHandler`]s.
#[cfg(all(test, feature = "memory"))]
mod async_memory_inbox_tests {
    use super::*;
    use crate::{AsyncTxHandler, Envelope, MemoryDb, MemoryTx, OutboxEvent, Status};

    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    struct Deposit {
        #[outbox(id)]
        id: String,
        amount: i64,
    }

    #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
    struct Deposited {
        #[outbox(id)]
        id: String,
    }

    /// Adds the amount to the balance across an await (a transaction that began in
    /// between would lose one of the two deposits) and emits `Deposited`; a negative
    /// amount fails after writing, zero panics after writing.
    struct Bank;
    impl AsyncTxHandler<Deposit> for Bank {
        type Conn = MemoryTx<i64>;
        async fn handle(
            &self,
            e: Deposit,
            tx: &mut MemoryTx<i64>,
            _: &Delivery,
        ) -> Result<(), HandlerError> {
            let before = *tx.data();
            tokio::task::yield_now().await;
            *tx.data() = before + e.amount;
            tx.emit(Deposited { id: e.id })?;
            match e.amount {
                0 => panic!("zero deposit"),
                a if a < 0 => Err(HandlerError::msg("negative deposit")),
                _ => Ok(()),
            }
        }
    }

    fn bank() -> Dispatcher<MemoryTx<i64>> {
        let mut d = Dispatcher::new();
        d.register_tx::<Deposit, _>(Bank).unwrap();
        d
    }

    fn deposit(id: &str, amount: i64) -> Delivery {
        let e = Deposit {
            id: id.into(),
            amount,
        };
        super::super::first_delivery(Envelope::from_event(&e, 1024).unwrap())
    }

    /// The emitted `Deposited` rows, by msg_id.
    fn deposited(db: &MemoryDb<i64>) -> Vec<String> {
        db.rows()
            .into_iter()
            .filter(|r| r.status == Status::New)
            .map(|r| r.envelope.msg_id.to_string())
            .collect()
    }

    #[tokio::test]
    async fn applied_once_failures_and_panics_leave_nothing() {
        let (d, db) = (bank(), MemoryDb::new(0_i64));
        let consume = |delivery: Delivery| {
            let (d, db) = (&d, &db);
            async move { d.consume_async(db, "bank", &delivery).await }
        };
        assert_eq!(consume(deposit("a", 5)).await.unwrap(), Processed::Applied);
        assert_eq!(
            consume(deposit("a", 5)).await.unwrap(),
            Processed::Duplicate
        );
        let refused = consume(deposit("b", -1)).await.unwrap_err();
        assert!(matches!(refused, Error::Handler(_)), "{refused}");
        let panicked = consume(deposit("c", 0)).await.unwrap_err();
        assert!(
            crate::error_chain(&panicked)
                .to_string()
                .contains("zero deposit"),
            "{panicked}"
        );
        assert_eq!(db.read(|n| *n), 5, "failed handlers' writes rolled back");
        assert_eq!(deposited(&db), ["a:Deposited"]);
        // Neither left the database held, nor the dedup row behind.
        assert_eq!(consume(deposit("b", 2)).await.unwrap(), Processed::Applied);
        assert_eq!(db.read(|n| *n), 7);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn async_and_blocking_transactions_are_serial() {
        let (d, db) = (bank(), MemoryDb::new(0_i64));
        let blocking = {
            let db = db.clone();
            tokio::task::spawn_blocking(move || {
                for _ in 0..50 {
                    db.transaction(|tx| {
                        *tx.data() += 1;
                        Ok::<_, Error>(())
                    })
                    .unwrap();
                }
            })
        };
        // Interleaved at every await of one task, beside the blocking thread.
        let deposits: Vec<_> = (0..50).map(|i| deposit(&format!("d{i}"), 1)).collect();
        let outcomes = futures_util::future::join_all(
            deposits.iter().map(|x| d.consume_async(&db, "bank", x)),
        )
        .await;
        for outcome in outcomes {
            assert_eq!(outcome.unwrap(), Processed::Applied);
        }
        blocking.await.unwrap();
        assert_eq!(db.read(|n| *n), 100, "no deposit lost");
    }

    #[tokio::test]
    async fn a_batch_keeps_what_succeeded_and_nothing_of_what_failed() {
        let (d, db) = (bank(), MemoryDb::new(0_i64));
        d.consume_async(&db, "bank", &deposit("a", 1))
            .await
            .unwrap();
        let batch = [
            deposit("b", 10),
            deposit("c", -1),
            deposit("a", 1),
            deposit("d", 0),
            deposit("b", 10),
            deposit("e", 100),
        ];
        let outcomes = d.consume_batch_async(&db, "bank", &batch).await.unwrap();
        let kinds: Vec<_> = outcomes
            .iter()
            .map(|o| match o {
                Ok(p) => format!("{p:?}"),
                Err(e) => format!("Err({})", crate::error_chain(e)),
            })
            .collect();
        assert_eq!(kinds[0], "Applied");
        assert!(kinds[1].contains("negative deposit"), "{kinds:?}");
        assert_eq!(kinds[2], "Duplicate");
        assert!(kinds[3].contains("zero deposit"), "{kinds:?}");
        assert_eq!(kinds[4..], ["Duplicate", "Applied"]);
        assert_eq!(db.read(|n| *n), 111);
        assert_eq!(
            deposited(&db),
            ["a:Deposited", "b:Deposited", "e:Deposited"]
        );
    }
}
