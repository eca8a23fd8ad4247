//! The demo's invariants: nothing lost, the poison parked and blocking only its aggregate,
//! duplicates absorbed, the projection equal to the published state.

use outbox_core::ParkKind;

#[tokio::test]
async fn demo_pipeline_holds_its_invariants() {
    let orders = 12;
    let s = outbox_examples::run_memory_demo(orders).await.unwrap();
    println!("{s}");
    // placed + confirmed per order, plus order-big placed and confirmed.
    assert_eq!(s.appended, 2 * orders + 2);
    assert_eq!(s.rejected.len(), 1, "the double confirmation is rejected");
    // Everything but order-big's two events is published; order-big/1 parked, /2 blocked.
    assert_eq!(s.marked_published, 2 * orders);
    assert_eq!(s.parked.len(), 1);
    assert_eq!(s.parked[0].envelope.aggregate_id, "order-big");
    assert_eq!(s.parked[0].reason.kind, ParkKind::PermanentError);
    assert_eq!(s.parked[0].reason.error.kind, "record_too_large");
    assert_eq!(s.blocked_behind_parked, 1);
    // Lost acks made duplicates in the log; the consumer absorbed them.
    assert_eq!(s.distinct_published, 2 * orders);
    assert!(s.records_in_log > s.distinct_published, "{s}");
    assert_eq!(s.consumer.applied as usize, 2 * orders);
    assert_eq!(
        s.consumer.duplicates as usize,
        s.records_in_log - s.distinct_published
    );
    assert_eq!(s.projection_rows, orders);
    assert!(
        s.retried >= 3,
        "three injected broker failures were retried: {s}"
    );
    assert!(s.oldest_parked_age.is_some());
}
