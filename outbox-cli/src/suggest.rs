//! Suggestions for a mistyped name: the outbox tables that do exist in the configured schema
//! (PostgreSQL) or database (MySQL / MariaDB), closest first, so that a wrong `--table` is not
//! answered with "run `outbox migrate`" (which would create a second, empty outbox beside the
//! real one).

use crate::error::CliError;

/// Levenshtein distance between `a` and `b` (by characters).
pub fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = Vec::with_capacity(b.len() + 1);
        cur.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur.push((prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// `candidates` ordered by their distance to `wanted`, then by name.
pub fn closest(wanted: &str, mut candidates: Vec<String>) -> Vec<String> {
    candidates.sort_by(|x, y| {
        distance(wanted, x)
            .cmp(&distance(wanted, y))
            .then_with(|| x.cmp(y))
    });
    candidates.dedup();
    candidates
}

/// The error for an outbox table `table` that does not exist in `place` (schema or
/// database) where the outbox tables `others` do: names them, closest first, and warns off
/// `outbox migrate`.
pub fn missing_table(place: &str, table: &str, others: Vec<String>) -> CliError {
    let others = closest(table, others);
    CliError::not_ready(
        format!(
            "there is no outbox table {table:?} in {place}; the outbox table(s) there: {}",
            others.join(", ")
        ),
        format!(
            "pass --table {} (or set outbox.table / OUTBOX_OUTBOX__TABLE) if you meant it; \
             `outbox migrate` would create a second, empty outbox named {table:?}",
            others[0]
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances_and_order() {
        assert_eq!(distance("", ""), 0);
        assert_eq!(distance("outbox_events", "outbox_events"), 0);
        assert_eq!(distance("outbox_evnets", "outbox_events"), 2);
        assert_eq!(distance("kitten", "sitting"), 3);
        assert_eq!(distance("", "abc"), 3);
        let ordered = closest(
            "orders_outbx",
            vec![
                "payments_outbox".into(),
                "orders_outbox".into(),
                "audit".into(),
                "orders_outbox".into(),
            ],
        );
        assert_eq!(ordered, ["orders_outbox", "payments_outbox", "audit"]);
    }

    #[test]
    fn the_error_names_the_closest_table_and_warns_off_migrate() {
        let e = missing_table(
            "schema \"shop\"",
            "outbox_evnts",
            vec!["orders".into(), "outbox_events".into()],
        );
        assert_eq!(e.exit_code(), 4);
        assert!(e.message.contains("outbox_events, orders"), "{}", e.message);
        let hint = e.hint.unwrap();
        assert!(hint.starts_with("pass --table outbox_events"), "{hint}");
        assert!(hint.contains("second, empty outbox"), "{hint}");
    }
}
