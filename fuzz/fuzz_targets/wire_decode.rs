//! Fuzzes `outbox_core::wire::decode_record` / `decode` with arbitrary headers, key and value,
//! alone or as mutations of a valid record (so the fuzzer reaches the field parsers).
//!
//! Properties: no panic; a failure is a typed `DecodeError` with a message; a decoded envelope
//! passes validation, names its aggregate in the headers (`aggregate_of`), re-encodes and
//! decodes to itself, and both entry points agree when no value is null.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use outbox_core::{wire, AggregateKey, Envelope, EnvelopeLimits, RecordHeader};

#[derive(Arbitrary, Debug)]
enum Edit {
    Drop(u8),
    Replace(u8, Option<Vec<u8>>),
    ReplaceText(u8, String),
    Rename(u8, String),
    Duplicate(u8),
    Insert(u8, String, Option<Vec<u8>>),
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// Start from a valid record's headers instead of none.
    from_valid: bool,
    edits: Vec<Edit>,
    value: Option<Vec<u8>>,
    key: Option<Vec<u8>>,
}

fn valid() -> Envelope {
    Envelope::builder("order", "o-1", 3, "order.shipped")
        .schema_version(2)
        .header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        .header("tenant", "acme")
        .build()
        .expect("a valid envelope")
}

fn apply(headers: &mut Vec<RecordHeader>, edit: Edit) {
    let at = |i: u8, len: usize| (len > 0).then(|| usize::from(i) % len);
    match edit {
        Edit::Drop(i) => {
            if let Some(i) = at(i, headers.len()) {
                headers.remove(i);
            }
        }
        Edit::Replace(i, v) => {
            if let Some(i) = at(i, headers.len()) {
                headers[i].value = v;
            }
        }
        Edit::ReplaceText(i, v) => {
            if let Some(i) = at(i, headers.len()) {
                headers[i].value = Some(v.into_bytes());
            }
        }
        Edit::Rename(i, name) => {
            if let Some(i) = at(i, headers.len()) {
                headers[i].name = name;
            }
        }
        Edit::Duplicate(i) => {
            if let Some(i) = at(i, headers.len()) {
                let h = headers[i].clone();
                headers.push(h);
            }
        }
        Edit::Insert(i, name, value) => {
            let i = at(i, headers.len() + 1).unwrap_or(0);
            headers.insert(i, RecordHeader { name, value });
        }
    }
}

fuzz_target!(|input: Input| {
    let mut headers: Vec<RecordHeader> = if input.from_valid {
        wire::encode_headers(&valid())
            .into_iter()
            .map(|(k, v)| RecordHeader::new(k, v))
            .collect()
    } else {
        Vec::new()
    };
    for edit in input.edits {
        apply(&mut headers, edit);
    }
    let decoded = wire::decode_record(&headers, input.value.as_deref());
    // The consumer's view of the same record never panics either.
    let received = outbox_core::ReceivedMessage::from_record(
        outbox_core::LogPosition::new("t", 0, 0),
        input.key,
        headers.clone(),
        input.value.clone(),
        None,
    );
    assert_eq!(received.envelope, decoded, "from_record decodes like decode_record");
    let _ = received.to_record();
    if headers.iter().all(|h| h.value.is_some()) {
        let pairs: Vec<(String, Vec<u8>)> = headers
            .iter()
            .map(|h| (h.name.clone(), h.value.clone().unwrap_or_default()))
            .collect();
        let plain = wire::decode(&pairs, input.value.as_deref().unwrap_or(&[]));
        assert_eq!(plain, decoded, "decode and decode_record disagree");
    }
    match decoded {
        Err(e) => assert!(!e.to_string().is_empty(), "an error without a message"),
        Ok(e) => {
            e.validate(&EnvelopeLimits::unlimited().with_max_payload_bytes(usize::MAX))
                .expect("a decoded envelope is valid");
            assert_eq!(
                wire::aggregate_of(&headers),
                Some(AggregateKey::of(&e)),
                "aggregate_of names the decoded aggregate"
            );
            let again = wire::decode(&wire::encode_headers(&e), &e.payload.bytes)
                .expect("a decoded envelope re-encodes into a decodable record");
            assert_eq!(again, e, "re-encoding changed the envelope");
        }
    }
});
