//! Fuzzes envelope validation through the builder with arbitrary fields and limits.
//!
//! Properties: no panic; a rejection is a typed `ValidationError` with a message; a built
//! envelope passes `validate` with the limits it was built with, survives the wire format
//! (encode, decode) and JSON unchanged, and building is deterministic.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use outbox_core::{wire, Envelope, EnvelopeLimits, EventId, Payload};

#[derive(Arbitrary, Debug)]
struct Limits {
    max_payload_bytes: u16,
    max_name_len: u8,
    max_headers: u8,
    max_header_bytes: u16,
}

#[derive(Arbitrary, Debug)]
struct Input {
    aggregate_type: String,
    aggregate_id: String,
    aggregate_version: i64,
    event_type: String,
    schema_version: i32,
    content_type: String,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
    created_at_micros: i64,
    event_id: u128,
    limits: Option<Limits>,
}

fuzz_target!(|input: Input| {
    // Limits at or below the defaults: a consumer decodes with the defaults, so an envelope a
    // producer may build must be one a consumer accepts.
    let defaults = EnvelopeLimits::default();
    let limits = match &input.limits {
        None => defaults.clone(),
        Some(l) => {
            let mut limits = defaults.clone();
            limits.max_payload_bytes = usize::from(l.max_payload_bytes);
            limits.max_name_len = usize::from(l.max_name_len).min(defaults.max_name_len);
            limits.max_headers = usize::from(l.max_headers).min(defaults.max_headers);
            limits.max_header_bytes =
                usize::from(l.max_header_bytes).min(defaults.max_header_bytes);
            limits
        }
    };
    let Some(created_at) = chrono::DateTime::from_timestamp_micros(input.created_at_micros) else {
        return;
    };
    let mut builder = Envelope::builder(
        input.aggregate_type.clone(),
        input.aggregate_id.clone(),
        input.aggregate_version,
        input.event_type.clone(),
    )
    .event_id(EventId::from_parts(created_at, input.event_id))
    .schema_version(input.schema_version)
    .payload(Payload::new(input.content_type.clone(), input.payload.clone()))
    .created_at(created_at)
    .limits(limits.clone());
    for (k, v) in &input.headers {
        builder = builder.header(k.clone(), v.clone());
    }
    let built = builder.clone().build();
    assert_eq!(built, builder.build(), "building is deterministic");
    match built {
        Err(e) => assert!(!e.to_string().is_empty(), "an error without a message"),
        Ok(e) => {
            e.validate(&limits).expect("a built envelope validates");
            assert_eq!(e.created_at, created_at, "micros are kept");
            let decoded = wire::decode(&wire::encode_headers(&e), &e.payload.bytes)
                .unwrap_or_else(|err| panic!("a built envelope does not decode: {err}"));
            assert_eq!(decoded, e, "the wire format changed the envelope");
            let json = serde_json::to_vec(&e).expect("serializes");
            let back: Envelope = serde_json::from_slice(&json).expect("deserializes");
            assert_eq!(back, e, "JSON changed the envelope");
        }
    }
});
