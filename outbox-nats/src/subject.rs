//! The subject mapping: which NATS subject an event is published to, and whether a stream's
//! subject filters cover it.
//!
//! | event | subject ([`SubjectMapping::AggregateType`], the default) | subject ([`SubjectMapping::AggregateTypeAndId`]) |
//! |---|---|---|
//! | aggregate type without a route | `<prefix>.<aggregate_type>` | `<prefix>.<aggregate_type>.<aggregate_id>` |
//! | aggregate type routed to `S` | `S` | `S.<aggregate_id>` |
//!
//! Routes are by aggregate type, never by event type, so one aggregate's events all land on
//! one subject space and (a stream is one ordered log) in one stream, in publication order.
//! The aggregate id always travels in the `aggregate_id` header ([`outbox_core::wire`]); with
//! [`SubjectMapping::AggregateTypeAndId`] it is also the last subject token, which lets a
//! consumer filter one aggregate or a stream partition aggregates with a subject transform.
//! A subject token may not be empty or contain `.`, `*`, `>` or whitespace: an aggregate type
//! (or id, when it goes into the subject) that is not a valid token fails as a permanent
//! [`outbox_core::PublishErrorKind::Serialization`] error of that record.

use outbox_core::ConfigError;

/// Where the aggregate id goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SubjectMapping {
    /// One subject per aggregate type (or route); the id in the `aggregate_id` header only.
    #[default]
    AggregateType,
    /// The aggregate id appended as the last subject token.
    AggregateTypeAndId,
}

/// Whether `token` is a valid literal subject token (non-empty, no `.`, `*`, `>`, whitespace
/// or control characters).
pub fn is_valid_token(token: &str) -> bool {
    !token.is_empty()
        && token
            .chars()
            .all(|c| !matches!(c, '.' | '*' | '>') && !c.is_whitespace() && !c.is_control())
}

/// Checks a literal subject from configuration (a prefix or a route): dot-separated valid
/// tokens, no wildcards. `what` names the setting in the error.
pub fn validate_subject(what: &str, subject: &str) -> Result<(), ConfigError> {
    if !subject.is_empty() && subject.split('.').all(is_valid_token) {
        Ok(())
    } else {
        Err(ConfigError::new(format!(
            "{what}: {subject:?} is not a literal NATS subject (dot-separated tokens without \
             wildcards, whitespace or empty tokens)"
        )))
    }
}

/// Whether every subject matched by `subject` (itself possibly with wildcards) is matched by
/// the stream filter `filter`: the check that a stream captures all of an outbox subject space.
///
/// ```
/// use outbox_nats::subject::covers;
/// assert!(covers("outbox.>", "outbox.order"));
/// assert!(covers("outbox.*", "outbox.order"));
/// assert!(covers("outbox.>", "outbox.order.*"));
/// assert!(!covers("outbox.*", "outbox.order.*"));
/// assert!(!covers("outbox.order", "outbox.>"));
/// ```
pub fn covers(filter: &str, subject: &str) -> bool {
    let f: Vec<&str> = filter.split('.').collect();
    let s: Vec<&str> = subject.split('.').collect();
    for (i, ft) in f.iter().enumerate() {
        if *ft == ">" {
            // Matches one or more remaining tokens.
            return s.len() > i;
        }
        let Some(st) = s.get(i) else {
            return false;
        };
        match (*ft, *st) {
            ("*", ">") => return false,
            ("*", _) => {}
            (_, "*" | ">") => return false,
            (a, b) if a == b => {}
            _ => return false,
        }
    }
    f.len() == s.len()
}

/// Whether some subject is matched by both `a` and `b` (the subject filters of two streams
/// overlap, or a stream filter touches an outbox subject space).
pub fn overlaps(a: &str, b: &str) -> bool {
    let a: Vec<&str> = a.split('.').collect();
    let b: Vec<&str> = b.split('.').collect();
    for i in 0..a.len().max(b.len()) {
        match (a.get(i), b.get(i)) {
            (Some(&">"), Some(_)) | (Some(_), Some(&">")) => return true,
            (Some(x), Some(y)) if *x == "*" || *y == "*" || x == y => {}
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens() {
        for ok in ["order", "o-1", "ORDER_2", "é", "a:b"] {
            assert!(is_valid_token(ok), "{ok}");
        }
        for bad in ["", "a.b", "*", ">", "a b", "a\tb", "a\nb", "x>"] {
            assert!(!is_valid_token(bad), "{bad:?}");
        }
        assert!(validate_subject("p", "outbox.events").is_ok());
        for bad in ["", "outbox.", ".x", "a..b", "a.*", "a.>", "a b"] {
            let err = validate_subject("prefix", bad).unwrap_err().to_string();
            assert!(err.contains("prefix"), "{err}");
        }
    }

    #[test]
    fn coverage_table() {
        let table = [
            ("outbox.>", "outbox.order", true),
            ("outbox.>", "outbox.order.o-1", true),
            ("outbox.>", "outbox.>", true),
            ("outbox.>", "outbox.*", true),
            ("outbox.>", "outbox", false),
            ("outbox.*", "outbox.order", true),
            ("outbox.*", "outbox.*", true),
            ("outbox.*", "outbox.>", false),
            ("outbox.*", "outbox.order.*", false),
            ("outbox.order", "outbox.order", true),
            ("outbox.order", "outbox.*", false),
            ("outbox.order", "outbox.payment", false),
            (">", "anything.at.all", true),
            ("*.*", "a.b", true),
            ("*.*", "a.b.c", false),
            ("a.*.c", "a.*.c", true),
            ("a.*.c", "a.b.>", false),
        ];
        for (filter, subject, expected) in table {
            assert_eq!(
                covers(filter, subject),
                expected,
                "{filter} covers {subject}"
            );
        }
    }

    #[test]
    fn overlap_table() {
        let table = [
            ("outbox.>", "outbox.order", true),
            ("outbox.*", "outbox.order.x", false),
            ("outbox.order", "outbox.payment", false),
            ("*.order", "outbox.*", true),
            (">", "x", true),
            ("a.b", "a.b.c", false),
        ];
        for (a, b, expected) in table {
            assert_eq!(overlaps(a, b), expected, "{a} ~ {b}");
            assert_eq!(overlaps(b, a), expected, "{b} ~ {a}");
        }
    }
}
