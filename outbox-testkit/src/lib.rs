//! In-memory backends, fault injection, crash simulation and the conformance suite for the outbox.
