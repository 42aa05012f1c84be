//! Stable keys. Each constructor matches golden vectors computed by
//! an independent implementation of the format (UUIDv5 under `MESSAGE_ID_NAMESPACE` of a
//! kind label and length-prefixed fields); equal inputs give equal ids, any changed field a
//! different one. The vectors pin the format: a change here breaks deduplication across an
//! upgrade, so never update them to make a test pass.

use inbox_tests::{Backend, on_every_backend, with_migrated_db};
use sea_orm::TransactionTrait;
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{InboxError, MESSAGE_ID_NAMESPACE};
use uuid::Uuid;

fn golden(text: &str) -> MessageId {
    MessageId::from_uuid(Uuid::parse_str(text).expect("a golden vector"))
}

#[test]
fn namespace_is_pinned() {
    assert_eq!(
        MESSAGE_ID_NAMESPACE.to_string(),
        "709d3c4c-2471-40b1-9e0d-6e29544bb19f"
    );
}

#[test]
fn broker_ids_match_golden_vectors() {
    assert_eq!(
        MessageId::from_broker_id("order-42").unwrap(),
        golden("2b1ae4a4-adcc-5790-aade-c47816fec5c9")
    );
    assert_eq!(
        MessageId::from_broker_id("Bestellung-ä-1").unwrap(),
        golden("3542023a-eb33-5f7e-bfca-eb8cd5631a0d")
    );
    // Normalised: surrounding white space goes; case and inner bytes stay.
    assert_eq!(
        MessageId::from_broker_id(" order-42\t\n").unwrap(),
        MessageId::from_broker_id("order-42").unwrap()
    );
    assert_ne!(
        MessageId::from_broker_id("Order-42").unwrap(),
        MessageId::from_broker_id("order-42").unwrap()
    );
    assert_ne!(
        MessageId::from_broker_id("order-43").unwrap(),
        MessageId::from_broker_id("order-42").unwrap()
    );
}

#[test]
fn cloud_events_match_golden_vectors_and_fields_do_not_run_together() {
    let event = MessageId::from_cloud_event("https://example.com/orders", "A234-1234-1234");
    assert_eq!(
        event.unwrap(),
        golden("64e3138a-9046-5a9f-abda-e51ded8dbec9")
    );
    let ab_c = MessageId::from_cloud_event("ab", "c").unwrap();
    let a_bc = MessageId::from_cloud_event("a", "bc").unwrap();
    assert_eq!(ab_c, golden("d51c8f6c-fa2b-52dc-ba74-8de86ab25481"));
    assert_eq!(a_bc, golden("7888ddca-2443-50c4-97b4-e5e8bc4fb562"));
    assert_ne!(ab_c, a_bc);
    let base = MessageId::from_cloud_event("/orders", "e-1").unwrap();
    assert_eq!(
        base,
        MessageId::from_cloud_event(" /orders ", "e-1").unwrap()
    );
    assert_ne!(
        base,
        MessageId::from_cloud_event("/payments", "e-1").unwrap()
    );
    assert_ne!(base, MessageId::from_cloud_event("/orders", "e-2").unwrap());
    // A broker id never collides with a CloudEvent made of the same text.
    assert_ne!(
        MessageId::from_broker_id("e-1").unwrap(),
        MessageId::from_cloud_event("/orders", "e-1").unwrap()
    );
}

#[test]
fn kafka_positions_match_golden_vectors() {
    let record = MessageId::from_kafka("payments", 3, 1_000).unwrap();
    assert_eq!(record, golden("ad5e0ebc-ff7b-55d3-8869-3561d2d79f64"));
    assert_eq!(record, MessageId::from_kafka("payments", 3, 1_000).unwrap());
    assert_ne!(
        record,
        MessageId::from_kafka("payments-dlq", 3, 1_000).unwrap()
    );
    assert_ne!(record, MessageId::from_kafka("payments", 4, 1_000).unwrap());
    assert_ne!(record, MessageId::from_kafka("payments", 3, 1_001).unwrap());
}

#[test]
fn idempotency_keys_match_golden_vectors() {
    let id = MessageId::from_broker_id("order-42").unwrap();
    assert_eq!(
        id.idempotency_key("mailer").to_string(),
        "419fb460-959c-58a5-a163-25fc8a5104eb"
    );
    assert_ne!(id.idempotency_key("mailer"), id.idempotency_key("billing"));
    assert_ne!(id.idempotency_key("mailer"), id.as_uuid());
}

/// The outbox ids a handler derives: the stored rows of every earlier version keep
/// deduplicating a re-run enqueue only while this format holds.
#[test]
fn outgoing_ids_match_golden_vectors() {
    let incoming = MessageId::from_broker_id("order-42").unwrap();
    assert_eq!(
        incoming.outgoing("shipping", 0),
        golden("50271a0e-7d9f-5e9b-84d6-35b9b8e3a893")
    );
    assert_eq!(
        incoming.outgoing("shipping", 1),
        golden("8d4bde25-c562-5ee9-b00f-ba074f7c4ad9")
    );
    assert_ne!(
        incoming.outgoing("shipping", 0).as_uuid(),
        incoming.idempotency_key("shipping")
    );
}

#[test]
fn empty_fields_and_negative_positions_are_refused() {
    assert!(matches!(
        MessageId::from_broker_id("  "),
        Err(InboxError::EmptyKeyField { .. })
    ));
    assert!(matches!(
        MessageId::from_cloud_event("/orders", ""),
        Err(InboxError::EmptyKeyField {
            field: "CloudEvents id"
        })
    ));
    assert!(matches!(
        MessageId::from_kafka("", 0, 0),
        Err(InboxError::EmptyKeyField { .. })
    ));
    assert!(matches!(
        MessageId::from_kafka("t", -1, 0),
        Err(InboxError::NegativeKafkaPosition { .. })
    ));
    assert!(matches!(
        MessageId::from_kafka("t", 0, -1001),
        Err(InboxError::NegativeKafkaPosition { .. })
    ));
}

/// A redelivery with the same broker fields claims the same marker on every backend.
async fn derived_keys_deduplicate_redeliveries(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        for delivery in 0..2 {
            let id = MessageId::from_kafka("payments", 3, 1_000).unwrap();
            let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
            let claim = txn.claim_message(id, "ledger").await.unwrap();
            assert_eq!(claim.is_claimed(), delivery == 0, "delivery {delivery}");
            if claim.is_claimed() {
                txn.commit().await.unwrap();
            } else {
                txn.rollback().await.unwrap();
            }
        }
    })
    .await;
}

on_every_backend!(derived_keys_deduplicate_redeliveries);
