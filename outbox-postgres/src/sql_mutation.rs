//! **Test only** (feature `sql-mutation`, off by default): mutation testing of the store's SQL.
//!
//! `scripts/mutants-sql` mutates the statements of [`OutboxSql`] one mutant at a time and runs
//! the tests against each, with one build: a store built while `OUTBOX_SQL_MUTANT` is set
//! applies that mutant to its statement text, once, at `build()`. Without the variable nothing
//! changes (CI builds with `--all-features`). A mutant that does not apply (an unknown
//! statement, an offset outside it, text that is not there) fails `build()`, so a run can never
//! test the unmutated code by mistake.
//!
//! A mutant is JSON: `{"statement": "claim_decide_lease", "variant": "plain", "offset": 1234,
//! "original": "<=", "replacement": "<"}`. `offset` is a byte offset in the statement's
//! canonical text ([`statements`]: schema `sql_mutants`, table `outbox_events`) of `variant`
//! (`plain`, or `first_version` for a store with `accept_first_version`). A store with other
//! names gets the same mutation: its text is the canonical one with the names replaced. A store
//! of the other variant gets it where the mutated text has a unique context in both texts, and
//! stays unmutated where that code does not exist in its variant.

use crate::error::config;
use crate::schema::qualified;
use crate::sql::{seed, OutboxSql};
use outbox_core::StoreError;

/// The environment variable a store reads its mutant from.
pub const ENV: &str = "OUTBOX_SQL_MUTANT";
/// Schema of the canonical texts.
pub const SCHEMA: &str = "sql_mutants";
/// Table of the canonical texts.
pub const TABLE: &str = "outbox_events";

macro_rules! fields {
    ($sql:expr) => {{
        let s = $sql;
        [
            ("append", &mut s.append),
            ("append_one", &mut s.append_one),
            ("claim_candidates", &mut s.claim_candidates),
            ("claim_decide_lease", &mut s.claim_decide_lease),
            ("claim_decide_locked", &mut s.claim_decide_locked),
            ("claim_decide_lease_runs", &mut s.claim_decide_lease_runs),
            ("claim_decide_locked_runs", &mut s.claim_decide_locked_runs),
            ("unlease_locked", &mut s.unlease_locked),
            ("park_undecodable", &mut s.park_undecodable),
            ("lock_keys", &mut s.lock_keys),
            ("complete_lease", &mut s.complete_lease),
            ("complete_locked", &mut s.complete_locked),
            ("release_lease", &mut s.release_lease),
            ("lease_rows", &mut s.lease_rows),
            ("owner_leases", &mut s.owner_leases),
            ("release_owner_lease", &mut s.release_owner_lease),
            ("event_state", &mut s.event_state),
            ("retry_parked", &mut s.retry_parked),
            ("discard_parked", &mut s.discard_parked),
            ("reissue_parked", &mut s.reissue_parked),
            ("list_parked", &mut s.list_parked),
            ("parked_event", &mut s.parked_event),
            ("audit_trail", &mut s.audit_trail),
            ("audit", &mut s.audit),
            ("cleanup", &mut s.cleanup),
            ("stats", &mut s.stats),
            ("table_stats", &mut s.table_stats),
        ]
    }};
}

/// Which store the offsets of a mutant refer to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// `accept_first_version(false)`, the default.
    Plain,
    /// `accept_first_version(true)`.
    FirstVersion,
}

impl Variant {
    fn parse(s: &str) -> Result<Self, String> {
        match s {
            "plain" => Ok(Self::Plain),
            "first_version" => Ok(Self::FirstVersion),
            other => Err(format!(
                "unknown variant {other:?} (plain or first_version)"
            )),
        }
    }
    fn of(accept_first_version: bool) -> Self {
        if accept_first_version {
            Self::FirstVersion
        } else {
            Self::Plain
        }
    }
}

/// One mutation of one statement.
#[derive(Clone, Debug)]
pub struct Mutant {
    /// The [`OutboxSql`] field.
    pub statement: String,
    /// The canonical text `offset` refers to.
    pub variant: Variant,
    /// Byte offset of `original` in that text.
    pub offset: usize,
    /// The text replaced (must be there).
    pub original: String,
    /// What replaces it.
    pub replacement: String,
}

impl Mutant {
    /// Parses the JSON form (see the module docs).
    pub fn parse(json: &str) -> Result<Self, String> {
        let v: serde_json::Value =
            serde_json::from_str(json).map_err(|e| format!("{ENV} is not JSON: {e}"))?;
        let text = |k: &str| {
            v.get(k)
                .and_then(|x| x.as_str())
                .map(str::to_owned)
                .ok_or_else(|| format!("{ENV}: missing string {k:?}"))
        };
        let offset = v
            .get("offset")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| format!("{ENV}: missing number \"offset\""))?;
        Ok(Self {
            statement: text("statement")?,
            variant: Variant::parse(&text("variant")?)?,
            offset: usize::try_from(offset).map_err(|e| e.to_string())?,
            original: text("original")?,
            replacement: text("replacement")?,
        })
    }
}

/// The canonical texts of every statement, in field order.
pub fn statements(variant: Variant) -> Vec<(&'static str, String)> {
    let mut sql = OutboxSql::new(SCHEMA, TABLE, variant == Variant::FirstVersion);
    fields!(&mut sql)
        .into_iter()
        .map(|(name, text)| (name, text.clone()))
        .collect()
}

/// Where the mutant's text is in `variant`'s canonical statement: `Ok(None)` when that code is
/// not in this variant. Refuses a mutant that does not apply to its own variant.
pub fn locate(m: &Mutant, variant: Variant) -> Result<Option<usize>, String> {
    let text_of = |v: Variant| {
        statements(v)
            .into_iter()
            .find(|(name, _)| *name == m.statement)
            .map(|(_, text)| text)
            .ok_or_else(|| format!("{ENV}: unknown statement {:?}", m.statement))
    };
    let own = text_of(m.variant)?;
    let end = m.offset.checked_add(m.original.len());
    if m.original.is_empty() || end.and_then(|e| own.get(m.offset..e)) != Some(&m.original) {
        return Err(format!(
            "{ENV}: {:?} is not at byte {} of {} ({:?})",
            m.original,
            m.offset,
            m.statement,
            own.get(m.offset..own.len().min(m.offset.saturating_add(40)))
                .unwrap_or("")
        ));
    }
    if variant == m.variant {
        return Ok(Some(m.offset));
    }
    Ok(transfer(
        &own,
        m.offset,
        m.original.len(),
        &text_of(variant)?,
    ))
}

/// The position in `to` of the text at `from[at..at + len]`: a context around it, widened until
/// it is unique in `from`, must occur exactly once in `to` (both sides, then the left or the
/// right side alone, for a mutant next to text that differs between the two).
fn transfer(from: &str, at: usize, len: usize, to: &str) -> Option<usize> {
    let floor = |mut i: usize| {
        while !from.is_char_boundary(i) {
            i -= 1;
        }
        i
    };
    let ceil = |mut i: usize| {
        while !from.is_char_boundary(i) {
            i += 1;
        }
        i
    };
    for (left, right) in [(true, true), (true, false), (false, true)] {
        let mut k = 8;
        loop {
            let lo = if left {
                floor(at.saturating_sub(k))
            } else {
                at
            };
            let hi = if right {
                ceil((at + len + k).min(from.len()))
            } else {
                at + len
            };
            let ctx = &from[lo..hi];
            if from.matches(ctx).count() == 1 {
                let hits: Vec<usize> = to.match_indices(ctx).map(|(i, _)| i).collect();
                if hits.len() == 1 {
                    return Some(hits[0] + (at - lo));
                }
                break;
            }
            if (lo == 0 || !left) && (hi == from.len() || !right) {
                break;
            }
            k += 8;
        }
    }
    None
}

/// The statements of a store on `schema`.`table` with the mutant applied, by field name.
pub fn mutated_statements(
    m: &Mutant,
    schema: &str,
    table: &str,
    accept_first_version: bool,
) -> Result<Vec<(&'static str, String)>, String> {
    let mut sql = mutated(m, schema, table, accept_first_version)?;
    Ok(fields!(&mut sql)
        .into_iter()
        .map(|(name, text)| (name, text.clone()))
        .collect())
}

/// The statements of a store on `schema`.`table`, with the mutant applied.
pub(crate) fn mutated(
    m: &Mutant,
    schema: &str,
    table: &str,
    accept_first_version: bool,
) -> Result<OutboxSql, String> {
    let variant = Variant::of(accept_first_version);
    let at = locate(m, variant)?;
    let mut canonical = OutboxSql::new(SCHEMA, TABLE, accept_first_version);
    let mut real = OutboxSql::new(schema, table, accept_first_version);
    let names: Vec<(String, String)> = ["_aggregate", "_archive", "_audit", ""]
        .iter()
        .map(|s| {
            (
                qualified(SCHEMA, &format!("{TABLE}{s}")),
                qualified(schema, &format!("{table}{s}")),
            )
        })
        .chain([(
            seed(SCHEMA, TABLE).to_string(),
            seed(schema, table).to_string(),
        )])
        .collect();
    for ((name, c), (_, r)) in fields!(&mut canonical).into_iter().zip(fields!(&mut real)) {
        let rename = |text: &str| {
            names
                .iter()
                .fold(text.to_owned(), |t, (from, to)| t.replace(from, to))
        };
        if rename(c) != *r {
            return Err(format!(
                "{ENV}: {name} of {schema}.{table} is not its canonical text renamed"
            ));
        }
        if name == m.statement {
            if let Some(at) = at {
                c.replace_range(at..at + m.original.len(), &m.replacement);
                *r = rename(c);
            }
        }
    }
    Ok(real)
}

/// At `build()`: the statements with the mutant of [`ENV`] applied, unchanged without it.
pub(crate) fn from_env(
    sql: OutboxSql,
    schema: &str,
    table: &str,
    accept_first_version: bool,
) -> Result<OutboxSql, StoreError> {
    match std::env::var(ENV) {
        Err(std::env::VarError::NotPresent) => Ok(sql),
        Err(e) => Err(config(format!("{ENV}: {e}"))),
        Ok(json) => Mutant::parse(&json)
            .and_then(|m| mutated(&m, schema, table, accept_first_version))
            .map_err(config),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mutant(statement: &str, original: &str, replacement: &str) -> Mutant {
        let text = statements(Variant::Plain)
            .into_iter()
            .find(|(n, _)| *n == statement)
            .unwrap()
            .1;
        Mutant {
            statement: statement.into(),
            variant: Variant::Plain,
            offset: text.find(original).unwrap(),
            original: original.into(),
            replacement: replacement.into(),
        }
    }

    #[test]
    fn a_named_mutation_reaches_a_store_of_any_name_and_variant() {
        let m = mutant(
            "claim_decide_lease",
            "c.aggregate_version <= c.last",
            "c.aggregate_version < c.last",
        );
        for first in [false, true] {
            let plain = OutboxSql::new("shop", "events", first);
            let sql = mutated(&m, "shop", "events", first).unwrap();
            assert_ne!(
                sql.claim_decide_lease, plain.claim_decide_lease,
                "first_version {first}"
            );
            assert_eq!(
                sql.claim_decide_lease.replace(
                    "c.aggregate_version < c.last",
                    "c.aggregate_version <= c.last"
                ),
                plain.claim_decide_lease
            );
            // Nothing else changes.
            assert_eq!(sql.claim_decide_locked, plain.claim_decide_locked);
            assert_eq!(sql.complete_lease, plain.complete_lease);
        }
    }

    #[test]
    fn code_of_one_variant_only_leaves_the_other_unmutated() {
        let text = statements(Variant::FirstVersion)
            .into_iter()
            .find(|(n, _)| *n == "event_state")
            .unwrap()
            .1;
        let original = "min(u.aggregate_version) FILTER";
        let m = Mutant {
            statement: "event_state".into(),
            variant: Variant::FirstVersion,
            offset: text.find(original).unwrap(),
            original: original.into(),
            replacement: "max(u.aggregate_version) FILTER".into(),
        };
        assert_eq!(locate(&m, Variant::Plain).unwrap(), None);
        let plain = mutated(&m, "shop", "events", false).unwrap();
        assert_eq!(
            plain.event_state,
            OutboxSql::new("shop", "events", false).event_state
        );
        let first = mutated(&m, "shop", "events", true).unwrap();
        assert!(first
            .event_state
            .contains("max(u.aggregate_version) FILTER"));
    }

    #[test]
    fn unknown_statements_and_absent_text_are_refused() {
        let mut m = mutant(
            "complete_lease",
            "a.lease_token = f.tok",
            "a.lease_token <> f.tok",
        );
        assert!(mutated(&m, "shop", "events", false).is_ok());
        m.statement = "no_such_statement".into();
        let e = mutated(&m, "shop", "events", false).unwrap_err();
        assert!(e.contains("unknown statement"), "{e}");
        m.statement = "complete_lease".into();
        m.offset += 1;
        let e = mutated(&m, "shop", "events", false).unwrap_err();
        assert!(e.contains("is not at byte"), "{e}");
        m.offset = usize::MAX;
        assert!(mutated(&m, "shop", "events", false).is_err());
        assert!(Mutant::parse("{\"statement\": \"x\"}").is_err());
        assert!(Mutant::parse("not json").is_err());
        let parsed = Mutant::parse(
            r#"{"statement":"lock_keys","variant":"first_version","offset":7,"original":"pg_advisory_xact_lock","replacement":"pg_try_advisory_xact_lock"}"#,
        )
        .unwrap();
        assert_eq!(parsed.variant, Variant::FirstVersion);
        assert!(mutated(&parsed, "shop", "events", true)
            .unwrap()
            .lock_keys
            .contains("pg_try_"));
        let bad_variant =
            r#"{"statement":"x","variant":"other","offset":0,"original":"a","replacement":"b"}"#;
        assert!(Mutant::parse(bad_variant).unwrap_err().contains("variant"));
    }
}
