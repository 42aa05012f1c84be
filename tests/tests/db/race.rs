//! Racing replicas: replicas with their own pools race for the same messages; the
//! database lets exactly one of them apply each effect.

use inbox_tests::{
    Backend, create_accounts, credit, on_every_backend, scalar_i64, shuffled_deliveries,
    with_migrated_db,
};
use sea_orm::{DatabaseConnection, TransactionTrait};
use sea_orm_inbox::prelude::*;
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::sync::{Barrier, Mutex};
use uuid::Uuid;

const CONSUMER: &str = "billing.credit";

/// One delivery handled the way the docs say: claim first, credit through `txn`, commit;
/// roll back on `Duplicate`. Returns whether this delivery won the claim.
async fn handle(
    db: &DatabaseConnection,
    id: Uuid,
) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
    let claim = txn.claim_message(id, CONSUMER).await?;
    let won = claim.is_claimed();
    match claim {
        Claim::Claimed(claimed) => {
            credit(&txn, 1).await?;
            claimed.commit(txn).await?;
        }
        Claim::Duplicate | Claim::Refused(_) => txn.rollback().await?,
    }
    Ok(won)
}

async fn two_replicas_race_for_one_message_50_times(backend: Backend) {
    const ROUNDS: i64 = 50;
    with_migrated_db(backend, async |db| {
        let replicas = [Arc::new(db.connect().await), Arc::new(db.connect().await)];
        create_accounts(replicas[0].as_ref()).await;

        for round in 0..ROUNDS {
            let id = Uuid::new_v4();
            let barrier = Arc::new(Barrier::new(2));
            let tasks: Vec<_> = replicas
                .iter()
                .map(|replica| {
                    let (replica, barrier) = (Arc::clone(replica), Arc::clone(&barrier));
                    tokio::spawn(async move {
                        barrier.wait().await;
                        handle(&replica, id).await.expect("no error but Duplicate")
                    })
                })
                .collect();
            let mut outcomes = Vec::new();
            for task in tasks {
                outcomes.push(task.await.expect("replica task"));
            }
            outcomes.sort_by_key(|won| !won);
            assert!(
                outcomes == [true, false],
                "round {round} on {backend:?}: {outcomes:?}"
            );
        }

        let conn = replicas[0].as_ref();
        assert_eq!(
            scalar_i64(conn, "SELECT balance FROM account WHERE id = 1").await,
            ROUNDS,
            "one credit per message"
        );
        assert_eq!(
            scalar_i64(conn, "SELECT COUNT(*) FROM inbox").await,
            ROUNDS,
            "one marker per message"
        );
        for replica in replicas {
            replica.as_ref().clone().close().await.ok();
        }
    })
    .await;
}

async fn four_replicas_consume_500_messages_delivered_3_times(backend: Backend) {
    const MESSAGES: usize = 500;
    const COPIES: usize = 3;
    const REPLICAS: usize = 4;
    const WORKERS_PER_REPLICA: usize = 2;
    with_migrated_db(backend, async |db| {
        let setup = db.connect().await;
        create_accounts(&setup).await;

        let ids: Vec<Uuid> = (0..MESSAGES).map(|_| Uuid::new_v4()).collect();
        let queue = Arc::new(Mutex::new(VecDeque::from(shuffled_deliveries(
            &ids, COPIES, 0x5EED,
        ))));
        let mut workers = Vec::new();
        for _ in 0..REPLICAS {
            let replica = Arc::new(db.connect_with(WORKERS_PER_REPLICA as u32).await);
            for _ in 0..WORKERS_PER_REPLICA {
                let (replica, queue) = (Arc::clone(&replica), Arc::clone(&queue));
                workers.push(tokio::spawn(async move {
                    let (mut claimed, mut duplicates, mut errors) = (0usize, 0usize, Vec::new());
                    loop {
                        let Some(id) = queue.lock().await.pop_front() else {
                            break;
                        };
                        match handle(&replica, id).await {
                            Ok(true) => claimed += 1,
                            Ok(false) => duplicates += 1,
                            Err(err) => errors.push(err.to_string()),
                        }
                    }
                    (claimed, duplicates, errors)
                }));
            }
        }
        let (mut claimed, mut duplicates, mut errors) = (0, 0, Vec::new());
        for worker in workers {
            let (c, d, e) = worker.await.expect("worker");
            claimed += c;
            duplicates += d;
            errors.extend(e);
        }
        assert!(
            errors.is_empty(),
            "errors other than Duplicate on {backend:?}: {errors:?}"
        );
        assert_eq!(claimed, MESSAGES);
        assert_eq!(duplicates, MESSAGES * (COPIES - 1));
        assert_eq!(
            scalar_i64(&setup, "SELECT balance FROM account WHERE id = 1").await,
            MESSAGES as i64
        );
        assert_eq!(
            scalar_i64(&setup, "SELECT COUNT(*) FROM inbox").await,
            MESSAGES as i64
        );
    })
    .await;
}

on_every_backend!(
    two_replicas_race_for_one_message_50_times,
    four_replicas_consume_500_messages_delivered_3_times,
);
