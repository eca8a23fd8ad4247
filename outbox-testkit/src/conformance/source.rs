//! The message source checks, one per contract clause of [`MessageSource`]. Each takes a fresh
//! [`SourceHarness`]: its own topic and consumer group.
//!
//! Polls wait at most [`SourceCapabilities::patience`](super::SourceCapabilities::patience) for a message (a broker's first group
//! join takes seconds); "nothing more arrives" is watched for [`SourceCapabilities::quiet`](super::SourceCapabilities::quiet).

use std::time::Duration;

use outbox_core::watermark::{BeginKind, SharedOffsetTracker};
use outbox_core::{
    wire, CommitOffset, LogPosition, MessageSource, ReceivedMessage, RecordHeader, SourceErrorKind,
};

use super::{event, not_applicable, unique, RawRecord, SourceHarness};

fn agg(name: &str) -> String {
    format!("{name}-{}", unique())
}

/// A record carrying a valid envelope for `aggregate` at `version`, as a publisher writes it.
fn envelope_record(aggregate: &str, version: i64) -> (outbox_core::Envelope, RawRecord) {
    let e = event(aggregate, version);
    let record = RawRecord {
        key: Some(e.aggregate_id.clone().into_bytes()),
        headers: wire::encode_headers(&e)
            .into_iter()
            .map(|(k, v)| RecordHeader::new(k, v))
            .collect(),
        value: Some(e.payload.bytes.clone()),
    };
    (e, record)
}

/// Produces `n` envelope records for one aggregate into `partition`; returns their offsets.
async fn fill<H: SourceHarness>(h: &H, partition: i32, n: usize) -> Vec<i64> {
    let a = agg("fill");
    let mut offsets = Vec::with_capacity(n);
    for v in 1..=n as i64 {
        offsets.push(h.produce(partition, envelope_record(&a, v).1).await);
    }
    offsets
}

/// Polls until `n` messages arrived; fails the check after the harness's patience.
async fn poll_n<S: MessageSource>(
    source: &S,
    n: usize,
    patience: Duration,
) -> Vec<ReceivedMessage> {
    let deadline = tokio::time::Instant::now() + patience;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} of {n} messages arrived within {patience:?}: {:?}",
            out.len(),
            positions(&out)
        );
        if let Some(m) = source.poll(Duration::from_millis(200)).await.expect("poll") {
            out.push(m);
        }
    }
    out
}

/// Polls for `quiet`, returning whatever arrives (the checks expect nothing).
async fn poll_quiet<S: MessageSource>(source: &S, quiet: Duration) -> Vec<ReceivedMessage> {
    let deadline = tokio::time::Instant::now() + quiet;
    let mut out = Vec::new();
    while tokio::time::Instant::now() < deadline {
        if let Some(m) = source.poll(Duration::from_millis(100)).await.expect("poll") {
            out.push(m);
        }
    }
    out
}

fn positions(messages: &[ReceivedMessage]) -> Vec<(i32, i64)> {
    messages
        .iter()
        .map(|m| (m.position.partition, m.position.offset))
        .collect()
}

fn sorted(mut v: Vec<(i32, i64)>) -> Vec<(i32, i64)> {
    v.sort_unstable();
    v
}

/// Key, headers (in order, null values kept when the backend has them) and value come back as
/// they were written, at the position they were written to; a record with a valid envelope
/// decodes to it and any other record is a typed decoding error, never a panic.
pub async fn records_round_trip_key_headers_and_value<H: SourceHarness>(h: &H) {
    let caps = h.capabilities();
    let topic = h.topic();
    let (e, enveloped) = envelope_record(&agg("rt"), 1);
    let raw = RawRecord {
        key: None,
        headers: vec![
            RecordHeader::new("x-binary", vec![0u8, 255, 1, 128]),
            RecordHeader::new("x-empty", Vec::new()),
            RecordHeader::new("x-binary", b"repeated name".to_vec()),
        ],
        value: Some(b"\x00\xffnot an envelope".to_vec()),
    };
    let mut sent = vec![
        (0, h.produce(0, enveloped.clone()).await, enveloped),
        (1, h.produce(1, raw.clone()).await, raw),
    ];
    if caps.null_values {
        let nulls = RawRecord {
            key: Some(b"k".to_vec()),
            headers: vec![RecordHeader::null("x-null"), RecordHeader::new("x-v", "v")],
            value: None,
        };
        sent.push((0, h.produce(0, nulls.clone()).await, nulls));
    } else {
        not_applicable(
            "records_round_trip_key_headers_and_value (null header and record values)",
            "the backend stores no null values",
        );
    }
    let member = h.join().await;
    let got = poll_n(&member, sent.len(), caps.patience).await;
    for (partition, offset, record) in &sent {
        let m = got
            .iter()
            .find(|m| m.position.partition == *partition && m.position.offset == *offset)
            .unwrap_or_else(|| {
                panic!(
                    "no message at {topic}/{partition}@{offset}; got {:?}",
                    positions(&got)
                )
            });
        assert_eq!(
            m.position,
            LogPosition::new(topic.clone(), *partition, *offset)
        );
        assert_eq!(m.key, record.key, "key at {}", m.position);
        assert_eq!(m.headers, record.headers, "headers at {}", m.position);
        assert_eq!(
            m.value().map(<[u8]>::to_vec),
            record.value,
            "value at {}",
            m.position
        );
    }
    let decoded = got
        .iter()
        .find(|m| m.position.partition == 0 && m.position.offset == sent[0].1)
        .expect("the envelope record");
    assert_eq!(decoded.envelope.as_ref().expect("decodes"), &e);
    for m in got.iter().filter(|m| m.position != decoded.position) {
        assert!(
            m.envelope.is_err(),
            "a record without an envelope decoded: {}",
            m.position
        );
    }
    assert!(
        poll_quiet(&member, caps.quiet).await.is_empty(),
        "more messages than records"
    );
    h.leave(member).await;
}

/// Auto-commit is off: polling alone commits nothing (not even when the member leaves), and a
/// new member of the group reads every record again from the earliest offset.
pub async fn nothing_is_committed_without_a_commit_call<H: SourceHarness>(h: &H) {
    let caps = h.capabilities();
    let offsets = fill(h, 0, 3).await;
    let first = h.join().await;
    let got = poll_n(&first, 3, caps.patience).await;
    assert_eq!(
        positions(&got),
        offsets.iter().map(|o| (0, *o)).collect::<Vec<_>>(),
        "a group without a committed offset starts at the earliest record, in order"
    );
    assert_eq!(h.committed(0).await, None, "polling committed an offset");
    h.leave(first).await;
    assert_eq!(h.committed(0).await, None, "leaving committed an offset");
    let second = h.join().await;
    let again = poll_n(&second, 3, caps.patience).await;
    assert_eq!(
        positions(&again),
        positions(&got),
        "an uncommitted message is delivered again to a new member"
    );
    let ids = |ms: &[ReceivedMessage]| -> Vec<_> {
        ms.iter()
            .map(|m| m.envelope.as_ref().expect("decodes").event_id)
            .collect()
    };
    assert_eq!(ids(&again), ids(&got));
    h.leave(second).await;
}

/// A commit moves exactly the given partitions to exactly the given next offsets: not more,
/// not less, the other partitions untouched; an empty commit moves nothing.
pub async fn commit_moves_exactly_the_given_offsets<H: SourceHarness>(h: &H) {
    let caps = h.capabilities();
    fill(h, 0, 3).await;
    fill(h, 1, 3).await;
    let member = h.join().await;
    let got = poll_n(&member, 6, caps.patience).await;
    let topic = h.topic();
    member
        .commit(&[CommitOffset::new(topic.clone(), 0, 2)])
        .await
        .expect("commit");
    assert_eq!(h.committed(0).await, Some(2), "the given offset");
    assert_eq!(h.committed(1).await, None, "a partition not given");
    member
        .commit(&[
            CommitOffset::new(topic.clone(), 1, 1),
            CommitOffset::new(topic.clone(), 0, 3),
        ])
        .await
        .expect("commit");
    assert_eq!(h.committed(0).await, Some(3));
    assert_eq!(h.committed(1).await, Some(1));
    member.commit(&[]).await.expect("an empty commit");
    assert_eq!(
        (h.committed(0).await, h.committed(1).await),
        (Some(3), Some(1)),
        "an empty commit moved an offset"
    );
    // Nothing more was delivered for the commits.
    assert!(poll_quiet(&member, caps.quiet).await.is_empty());
    assert_eq!(got.len(), 6);
    h.leave(member).await;
}

/// After a restart a member resumes at the last committed offset of each partition: the
/// messages past it come again in order, nothing before it does.
pub async fn a_new_member_resumes_from_the_last_commit<H: SourceHarness>(h: &H) {
    let caps = h.capabilities();
    let p0 = fill(h, 0, 5).await;
    let p1 = fill(h, 1, 2).await;
    let first = h.join().await;
    let got = poll_n(&first, 7, caps.patience).await;
    let at = |p: i32, o: i64| {
        got.iter()
            .find(|m| m.position.partition == p && m.position.offset == o)
            .unwrap_or_else(|| panic!("no message at {p}@{o}"))
            .clone()
    };
    first
        .commit(&[at(0, p0[2]).position.next(), at(1, p1[1]).position.next()])
        .await
        .expect("commit");
    h.leave(first).await;
    let second = h.join().await;
    let again = poll_n(&second, 2, caps.patience).await;
    assert_eq!(
        positions(&again),
        vec![(0, p0[3]), (0, p0[4])],
        "resumes after the committed offset of partition 0; partition 1 was all committed"
    );
    for m in &again {
        assert_eq!(
            m.envelope.as_ref().expect("decodes"),
            at(0, m.position.offset).envelope.as_ref().expect("decodes"),
            "the same record comes again"
        );
    }
    let extra = poll_quiet(&second, caps.quiet).await;
    assert!(
        extra.is_empty(),
        "committed messages came again: {:?}",
        positions(&extra)
    );
    h.leave(second).await;
}

/// On a clean revoke (the member leaves) a source with rebalance callbacks commits exactly the
/// attached tracker's final offsets, never past an unfinished message; a source without them
/// commits nothing. Either way the next member resumes at what was committed.
pub async fn leaving_commits_the_trackers_final_offsets<H: SourceHarness>(h: &H) {
    let caps = h.capabilities();
    let offsets = fill(h, 0, 5).await;
    let tracker = SharedOffsetTracker::new();
    let first = h.join().await;
    first.attach_offsets(tracker.clone());
    let got = poll_n(&first, 5, caps.patience).await;
    {
        let mut t = tracker.lock();
        let tickets: Vec<_> = got.iter().map(|m| t.begin(&m.position)).collect();
        // Finished out of order: 0, 1 and 3; 2 still running; 4 not final.
        for i in [0, 1, 3] {
            t.finish(&tickets[i]);
        }
    }
    h.leave(first).await;
    let resume = if caps.commits_on_leave {
        assert_eq!(
            h.committed(0).await,
            Some(offsets[2]),
            "the revoke commit is the lowest unfinished offset"
        );
        2
    } else {
        assert_eq!(
            h.committed(0).await,
            None,
            "a source without revoke callbacks committed on leave"
        );
        0
    };
    let second = h.join().await;
    let again = poll_n(&second, 5 - resume, caps.patience).await;
    assert_eq!(
        positions(&again),
        offsets[resume..]
            .iter()
            .map(|o| (0, *o))
            .collect::<Vec<_>>()
    );
    h.leave(second).await;
}

/// On assignment the source tells the attached tracker (which forgets what it held for the
/// partition): the first message after it begins a fresh watermark, not a rewind of stale
/// entries, and a ticket of the earlier assignment no longer counts.
pub async fn assignment_resets_the_attached_tracker<H: SourceHarness>(h: &H) {
    let caps = h.capabilities();
    let offsets = fill(h, 0, 1).await;
    let tracker = SharedOffsetTracker::new();
    let stale = tracker
        .lock()
        .begin(&LogPosition::new(h.topic(), 0, offsets[0] + 50));
    let member = h.join().await;
    member.attach_offsets(tracker.clone());
    let got = poll_n(&member, 1, caps.patience).await;
    let (kind, stale_counts) = {
        let mut t = tracker.lock();
        let (_, kind) = t.begin_checked(&got[0].position);
        (kind, t.is_current(&stale))
    };
    assert!(
        matches!(kind, BeginKind::Forward),
        "the assignment did not reach the tracker: the first message is a {kind:?}"
    );
    assert!(
        !stale_counts,
        "a ticket of an earlier assignment still counts"
    );
    h.leave(member).await;
}

/// A member whose partitions another member took over without a clean revoke (a lost
/// assignment) commits nothing: its commit is refused as a rebalance (or skipped), the group's
/// offsets do not move, and the new owner reads from the last commit.
pub async fn a_member_that_lost_its_partitions_commits_nothing<H: SourceHarness>(h: &H) {
    let caps = h.capabilities();
    let offsets = fill(h, 0, 3).await;
    let tracker = SharedOffsetTracker::new();
    let stalled = h.join().await;
    stalled.attach_offsets(tracker.clone());
    let got = poll_n(&stalled, 3, caps.patience).await;
    {
        let mut t = tracker.lock();
        for m in &got {
            let ticket = t.begin(&m.position);
            t.finish(&ticket);
        }
    }
    let owner = h.take_over(&stalled).await;
    match stalled.commit(&[got[2].position.next()]).await {
        Ok(()) => {}
        Err(e) => assert_eq!(
            e.kind,
            SourceErrorKind::Rebalanced,
            "a refused commit after a lost assignment must say so: {e}"
        ),
    }
    assert_eq!(
        h.committed(0).await,
        None,
        "a member that lost its partitions moved the group's offset"
    );
    let again = poll_n(&owner, 3, caps.patience).await;
    assert_eq!(
        sorted(positions(&again)),
        offsets.iter().map(|o| (0, *o)).collect::<Vec<_>>(),
        "the new owner reads what was not committed"
    );
    h.leave(owner).await;
    drop(stalled);
}

/// `poll` is cancellation safe: polls dropped before they completed lose no message and
/// duplicate none.
pub async fn a_dropped_poll_loses_no_message<H: SourceHarness>(h: &H) {
    let caps = h.capabilities();
    let offsets = fill(h, 0, 3).await;
    let member = h.join().await;
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + caps.patience;
    while got.len() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {:?} arrived",
            positions(&got)
        );
        // Most of these polls are dropped half-way; a completed one keeps its message.
        if let Ok(polled) = tokio::time::timeout(
            Duration::from_millis(unique() % 7 + 1),
            member.poll(Duration::from_secs(5)),
        )
        .await
        {
            if let Some(m) = polled.expect("poll") {
                got.push(m);
            }
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(
        positions(&got),
        offsets.iter().map(|o| (0, *o)).collect::<Vec<_>>()
    );
    assert!(poll_quiet(&member, caps.quiet).await.is_empty());
    h.leave(member).await;
}

/// A group whose committed offset fell below the earliest available one fails the poll with
/// a retention gap naming the partition; it never skips ahead silently.
pub async fn a_commit_below_the_earliest_offset_is_a_retention_gap<H: SourceHarness>(h: &H) {
    let caps = h.capabilities();
    if !caps.deletes_records {
        return not_applicable(
            "a_commit_below_the_earliest_offset_is_a_retention_gap",
            "the harness cannot delete records",
        );
    }
    let offsets = fill(h, 0, 4).await;
    let first = h.join().await;
    let got = poll_n(&first, 4, caps.patience).await;
    first
        .commit(&[got[0].position.next()])
        .await
        .expect("commit");
    h.leave(first).await;
    h.delete_records_before(0, offsets[3]).await;
    let second = h.join().await;
    let deadline = tokio::time::Instant::now() + caps.patience;
    let err = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no retention gap reported"
        );
        match second.poll(Duration::from_millis(200)).await {
            Err(e) => break e,
            Ok(Some(m)) => panic!(
                "read {} past a retention gap instead of failing",
                m.position
            ),
            Ok(None) => {}
        }
    };
    assert_eq!(err.kind, SourceErrorKind::RetentionGap, "{err}");
    assert!(
        err.to_string().contains(&format!("{}/0", h.topic())),
        "the gap does not name the partition: {err}"
    );
    drop(second);
}

/// Starting from the latest offset: a partition without a committed offset starts at its end
/// when first assigned, and that start is committed, so the next member reads the records
/// produced after it (and none before).
pub async fn start_from_latest_skips_earlier_records_and_keeps_later_ones<H: SourceHarness>(h: &H) {
    let caps = h.capabilities();
    let before = fill(h, 0, 2).await;
    let Some(first) = h.join_from_latest().await else {
        return not_applicable(
            "start_from_latest_skips_earlier_records_and_keeps_later_ones",
            "the source always starts at the earliest offset",
        );
    };
    let deadline = tokio::time::Instant::now() + caps.patience;
    while h.committed(0).await.is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the start position was never committed"
        );
        if let Some(m) = first.poll(Duration::from_millis(200)).await.expect("poll") {
            panic!("read {} that was produced before the start", m.position);
        }
    }
    assert_eq!(
        h.committed(0).await,
        Some(before[1] + 1),
        "the end at assignment"
    );
    let after = fill(h, 0, 2).await;
    h.leave(first).await;
    let second = h
        .join_from_latest()
        .await
        .expect("the harness joined from the latest offset once");
    let got = poll_n(&second, 2, caps.patience).await;
    assert_eq!(
        positions(&got),
        after.iter().map(|o| (0, *o)).collect::<Vec<_>>(),
        "the records produced after the first assignment"
    );
    h.leave(second).await;
}
