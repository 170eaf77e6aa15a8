//! Reads keys of a DeepSpeed config, recording which were read: each is
//! looked up in [`super::KEYS`], and `"auto"` accepted only where it has a
//! meaning there.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use super::{Treatment, collect_leaves, ds_error, rule};
use crate::error::Result;

/// A DeepSpeed setting as read: absent (or null), `"auto"`, or a value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Setting<T> {
    Absent,
    Auto,
    Given(T),
}

impl<T> Setting<T> {
    /// The value, `auto` for `"auto"`, `absent` when absent.
    pub(super) fn or(self, auto: T, absent: T) -> T {
        match self {
            Setting::Absent => absent,
            Setting::Auto => auto,
            Setting::Given(value) => value,
        }
    }
}

/// Reads keys of the config, recording which were read.
pub(super) struct Reader<'a> {
    root: &'a Map<String, Value>,
    used: BTreeSet<String>,
}

impl<'a> Reader<'a> {
    /// A reader of `root` that has read nothing.
    pub(super) fn new(root: &'a Map<String, Value>) -> Reader<'a> {
        Reader {
            root,
            used: BTreeSet::new(),
        }
    }

    /// The keys read so far.
    pub(super) fn into_used(self) -> BTreeSet<String> {
        self.used
    }

    /// Whether a section (or key) is present, without reading it.
    pub(super) fn has(&self, key: &str) -> bool {
        self.lookup(key).is_some()
    }

    pub(super) fn lookup(&self, key: &str) -> Option<&Value> {
        let mut parts = key.split('.');
        let mut value = self.root.get(parts.next()?)?;
        for part in parts {
            value = value.as_object()?.get(part)?;
        }
        (!value.is_null()).then_some(value)
    }

    /// The raw value of `key`, marked read; `"auto"` is checked against
    /// the table.
    pub(super) fn raw(&mut self, key: &str) -> Result<Setting<Value>> {
        let rule = rule(key);
        debug_assert!(
            rule.is_some_and(|rule| rule.treatment != Treatment::Ignored),
            "the mapper reads {key}, which KEYS does not map"
        );
        let Some(value) = self.lookup(key).cloned() else {
            return Ok(Setting::Absent);
        };
        self.used.insert(key.to_string());
        if value.as_str() == Some("auto") {
            if rule.is_none_or(|rule| rule.auto.is_empty()) {
                return Err(ds_error(
                    key,
                    "\"auto\"",
                    "\"auto\" has no meaning for this key in strata: give a value (see docs/deepspeed-config.md)",
                ));
            }
            return Ok(Setting::Auto);
        }
        Ok(Setting::Given(value))
    }

    /// Marks every key under `section` read (a disabled section's).
    pub(super) fn consume(&mut self, section: &str) {
        if let Some(Value::Object(map)) = self.lookup(section) {
            let mut leaves = Vec::new();
            collect_leaves(map, section, &mut leaves);
            self.used.extend(leaves);
        }
    }

    pub(super) fn f64(&mut self, key: &str) -> Result<Setting<f64>> {
        Ok(match self.raw(key)? {
            Setting::Given(value) => match value.as_f64() {
                Some(number) if number.is_finite() => Setting::Given(number),
                _ => return Err(ds_error(key, value, "give a number")),
            },
            Setting::Auto => Setting::Auto,
            Setting::Absent => Setting::Absent,
        })
    }

    /// A whole number, also written as a float (`5e8`).
    pub(super) fn u64(&mut self, key: &str) -> Result<Setting<u64>> {
        Ok(match self.raw(key)? {
            Setting::Given(value) => match json_u64(&value) {
                Some(number) => Setting::Given(number),
                None => return Err(ds_error(key, value, "give a whole number >= 0")),
            },
            Setting::Auto => Setting::Auto,
            Setting::Absent => Setting::Absent,
        })
    }

    pub(super) fn bool(&mut self, key: &str) -> Result<Setting<bool>> {
        Ok(match self.raw(key)? {
            Setting::Given(Value::Bool(flag)) => Setting::Given(flag),
            Setting::Given(value) => return Err(ds_error(key, value, "give true or false")),
            Setting::Auto => Setting::Auto,
            Setting::Absent => Setting::Absent,
        })
    }

    pub(super) fn string(&mut self, key: &str) -> Result<Setting<String>> {
        Ok(match self.raw(key)? {
            Setting::Given(Value::String(text)) => Setting::Given(text),
            Setting::Given(value) => return Err(ds_error(key, value, "give a string")),
            Setting::Auto => Setting::Auto,
            Setting::Absent => Setting::Absent,
        })
    }
}

pub(super) fn json_u64(value: &Value) -> Option<u64> {
    if let Some(number) = value.as_u64() {
        return Some(number);
    }
    let float = value.as_f64()?;
    // Integral floats below 2^53 convert exactly.
    (float >= 0.0 && float.fract() == 0.0 && float < 9.007_199_254_740_992e15)
        .then_some(float as u64)
}
