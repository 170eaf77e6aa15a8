//! Byte sizes written the way people write them: `4096`, `128KiB`, `1MiB`, `2GiB`, `1G`.

use std::fmt;
use std::str::FromStr;

/// A byte count that parses from and prints as a human size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

const UNITS: [(&str, u64); 10] = [
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("TB", 1_000_000_000_000),
    ("GB", 1_000_000_000),
    ("MB", 1_000_000),
    ("KB", 1_000),
    ("T", 1 << 40),
    ("G", 1 << 30),
];

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let digits_end = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(digits_end);
        let number = number.replace('_', "");
        let unit = unit.trim();
        let multiplier = match unit {
            "" | "B" => 1,
            "M" => 1 << 20,
            "K" | "k" => 1 << 10,
            _ => UNITS
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(unit))
                .map(|(_, m)| *m)
                .ok_or_else(|| {
                    format!("unknown unit {unit:?} in size {text:?}: use B, KiB, MiB, GiB or TiB")
                })?,
        };
        let bytes = if number.contains('.') {
            let value: f64 = number.parse().map_err(|_| {
                format!("{text:?} is not a size: write e.g. 4096, 128KiB, 1MiB or 2GiB")
            })?;
            (value * multiplier as f64).round() as u64
        } else {
            let value: u64 = number.parse().map_err(|_| {
                format!("{text:?} is not a size: write e.g. 4096, 128KiB, 1MiB or 2GiB")
            })?;
            value
                .checked_mul(multiplier)
                .ok_or_else(|| format!("size {text:?} overflows 64 bits"))?
        };
        Ok(ByteSize(bytes))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, unit) in &UNITS[..4] {
            if self.0 >= *unit && self.0.is_multiple_of(*unit) {
                return write!(f, "{}{name}", self.0 / unit);
            }
        }
        for (name, unit) in &UNITS[..4] {
            if self.0 >= *unit {
                return write!(f, "{:.2}{name}", self.0 as f64 / *unit as f64);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl serde::Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte count or a size such as \"1MiB\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom("a size cannot be negative"))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// Rounds `value` up to a multiple of `align` (a power of two or any positive number).
pub fn round_up(value: u64, align: u64) -> u64 {
    assert!(align > 0, "alignment must be positive");
    value.div_ceil(align) * align
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_people_write() {
        for (text, bytes) in [
            ("4096", 4096),
            ("128KiB", 128 << 10),
            ("1MiB", 1 << 20),
            ("1 MiB", 1 << 20),
            ("2GiB", 2 << 30),
            ("1G", 1 << 30),
            ("1.5GiB", 3 << 29),
            ("64M", 64 << 20),
            ("8k", 8192),
            ("1_000", 1000),
            ("2GB", 2_000_000_000),
        ] {
            assert_eq!(text.parse::<ByteSize>(), Ok(ByteSize(bytes)), "{text}");
        }
        assert!(
            "12 parsecs"
                .parse::<ByteSize>()
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!("MiB".parse::<ByteSize>().is_err());
        assert!(
            "99999999999TiB"
                .parse::<ByteSize>()
                .unwrap_err()
                .contains("overflow")
        );
    }

    #[test]
    fn prints_round_trip() {
        for bytes in [1u64, 4096, 128 << 10, 1 << 20, 3 << 30, 1536 << 20] {
            let shown = ByteSize(bytes).to_string();
            assert_eq!(shown.parse::<ByteSize>(), Ok(ByteSize(bytes)), "{shown}");
        }
        assert_eq!(ByteSize(1 << 20).to_string(), "1MiB");
        assert_eq!(ByteSize(1536 << 20).to_string(), "1536MiB");
    }

    #[test]
    fn rounds_up() {
        assert_eq!(round_up(0, 4096), 0);
        assert_eq!(round_up(1, 4096), 4096);
        assert_eq!(round_up(8192, 4096), 8192);
        assert_eq!(round_up(10, 3), 12);
    }
}
