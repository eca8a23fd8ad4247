//! The partitioner: which partition a record's key maps to.
//!
//! Per-aggregate order rests on one aggregate's records sharing a partition, so only
//! partitioners that hash the key are accepted. The default is [`Partitioner::Murmur2Random`]:
//! the key hash of the Java client's default partitioner (`murmur2(key) & 0x7fffffff) %
//! partitions`), so a Java (or Kafka Streams, or Kafka Connect) producer writing the same
//! aggregate ids to the same topic puts them on the same partitions as this publisher.
//! librdkafka's own default, `consistent_random` (CRC32), does not, and neither do the FNV-1a
//! partitioners.
//!
//! Changing the partitioner of a topic that already holds events moves keys to other
//! partitions, just like changing the partition count: a consumer may then see version N+1 of an
//! aggregate (new partition) before version N (old partition, not yet consumed). Record the
//! partitioner ([`crate::TopicReport::partitioner`]) and pass it back with
//! [`crate::KafkaPublisherBuilder::expect_partitioner`] to have such a change reported.

use std::fmt;
use std::str::FromStr;

use outbox_core::ConfigError;

/// A key-hashing librdkafka partitioner (the `partitioner` property).
///
/// Keyless partitioners (`random`) are not representable: they would scatter one aggregate's
/// events over all partitions. The `*_random` variants differ from their plain twins only for
/// records without a key (or, for `consistent`, with an empty key); the publisher always sends
/// the aggregate id, which is never empty, so twins map every key alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Partitioner {
    /// `murmur2_random`: Java-compatible murmur2 hash of the key. The default.
    #[default]
    Murmur2Random,
    /// `murmur2`: Java-compatible murmur2 hash of the key.
    Murmur2,
    /// `consistent_random`: CRC32 hash of the key (librdkafka's own default).
    ConsistentRandom,
    /// `consistent`: CRC32 hash of the key.
    Consistent,
    /// `fnv1a_random`: FNV-1a hash of the key.
    Fnv1aRandom,
    /// `fnv1a`: FNV-1a hash of the key.
    Fnv1a,
}

/// The partitioner used when none is configured: [`Partitioner::Murmur2Random`], the Java
/// client's keyed partitioning. See the [module docs](self).
pub const DEFAULT_PARTITIONER: Partitioner = Partitioner::Murmur2Random;

/// The hash function a partitioner applies to a non-empty key; partitioners with the same hash
/// put every key of the publisher on the same partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyHash {
    /// murmur2, as the Java client.
    Murmur2,
    /// CRC32.
    Crc32,
    /// FNV-1a.
    Fnv1a,
}

impl Partitioner {
    /// Every accepted partitioner.
    pub const ALL: [Partitioner; 6] = [
        Self::Murmur2Random,
        Self::Murmur2,
        Self::ConsistentRandom,
        Self::Consistent,
        Self::Fnv1aRandom,
        Self::Fnv1a,
    ];

    /// The librdkafka property value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Murmur2Random => "murmur2_random",
            Self::Murmur2 => "murmur2",
            Self::ConsistentRandom => "consistent_random",
            Self::Consistent => "consistent",
            Self::Fnv1aRandom => "fnv1a_random",
            Self::Fnv1a => "fnv1a",
        }
    }

    /// The hash applied to the key.
    pub const fn key_hash(self) -> KeyHash {
        match self {
            Self::Murmur2Random | Self::Murmur2 => KeyHash::Murmur2,
            Self::ConsistentRandom | Self::Consistent => KeyHash::Crc32,
            Self::Fnv1aRandom | Self::Fnv1a => KeyHash::Fnv1a,
        }
    }

    /// Whether `self` and `other` put every (non-empty) key on the same partition.
    pub const fn maps_keys_like(self, other: Partitioner) -> bool {
        matches!(
            (self.key_hash(), other.key_hash()),
            (KeyHash::Murmur2, KeyHash::Murmur2)
                | (KeyHash::Crc32, KeyHash::Crc32)
                | (KeyHash::Fnv1a, KeyHash::Fnv1a)
        )
    }

    /// Parses a `partitioner` property value. Keyless partitioners are refused with the reason
    /// and the fix; unknown values list the accepted ones.
    pub fn parse(value: &str) -> Result<Self, ConfigError> {
        let v = value.trim().to_ascii_lowercase();
        if let Some(p) = Self::ALL.into_iter().find(|p| p.as_str() == v) {
            return Ok(p);
        }
        let accepted = Self::ALL.map(Self::as_str).join(", ");
        if v == "random" {
            return Err(ConfigError::new(format!(
                "partitioner=random is refused: it ignores the key, so one aggregate's events \
                 would land on different partitions and lose their order. Remove the property \
                 to use the default {} (the Java client's keyed partitioning), or choose one of: \
                 {accepted}",
                DEFAULT_PARTITIONER.as_str()
            )));
        }
        Err(ConfigError::new(format!(
            "partitioner={value:?} is refused: the outbox publisher accepts only partitioners \
             that hash the key ({accepted}); remove the property to use the default {}",
            DEFAULT_PARTITIONER.as_str()
        )))
    }
}

impl fmt::Display for Partitioner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Partitioner {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_table() {
        for p in Partitioner::ALL {
            assert_eq!(Partitioner::parse(p.as_str()).unwrap(), p);
            assert_eq!(p.as_str().parse::<Partitioner>().unwrap(), p);
        }
        assert_eq!(
            Partitioner::parse(" Murmur2_Random ").unwrap(),
            Partitioner::Murmur2Random
        );
        assert_eq!(Partitioner::default(), DEFAULT_PARTITIONER);
        assert_eq!(DEFAULT_PARTITIONER.as_str(), "murmur2_random");

        let random = Partitioner::parse("random").unwrap_err().to_string();
        assert!(random.contains("partitioner=random"), "{random}");
        assert!(random.contains("ignores the key"), "{random}");
        assert!(random.contains("murmur2_random"), "{random}");
        let unknown = Partitioner::parse("round_robin").unwrap_err().to_string();
        assert!(unknown.contains("round_robin"), "{unknown}");
        assert!(unknown.contains("consistent_random"), "{unknown}");
        assert!(Partitioner::parse("").is_err());
    }

    #[test]
    fn twins_map_keys_alike_and_families_differ() {
        use Partitioner::*;
        assert!(Murmur2Random.maps_keys_like(Murmur2));
        assert!(ConsistentRandom.maps_keys_like(Consistent));
        assert!(Fnv1a.maps_keys_like(Fnv1aRandom));
        assert!(!Murmur2Random.maps_keys_like(ConsistentRandom));
        assert!(!Consistent.maps_keys_like(Fnv1a));
        assert!(!Fnv1aRandom.maps_keys_like(Murmur2));
    }
}
