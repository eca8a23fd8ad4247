//! The idempotent consumer engine: dedupe and effect in one transaction, contiguous offset commits.
