//! Injected time. The relay and the stores of the testkit never read the system clock directly,
//! so simulations run on virtual time.

use chrono::{DateTime, Utc};

/// A source of the current time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current time.
    fn now(&self) -> DateTime<Utc>;
}

/// The system clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

impl<C: Clock + ?Sized> Clock for std::sync::Arc<C> {
    fn now(&self) -> DateTime<Utc> {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed(DateTime<Utc>);

    impl Clock for Fixed {
        fn now(&self) -> DateTime<Utc> {
            self.0
        }
    }

    #[test]
    fn system_clock_reads_the_system_time() {
        let before = Utc::now();
        let now = SystemClock.now();
        assert!(before <= now && now <= Utc::now(), "{now}");
    }

    #[test]
    fn a_shared_clock_reads_the_clock_it_shares() {
        let at = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let shared: std::sync::Arc<dyn Clock> = std::sync::Arc::new(Fixed(at));
        assert_eq!(std::sync::Arc::clone(&shared).now(), at);
        assert_eq!(std::sync::Arc::new(Fixed(at)).now(), at);
    }
}
