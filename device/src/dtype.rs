//! Element types.

use serde::{Deserialize, Serialize};

/// Element type of a tensor or a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// 32-bit unsigned integer (token ids).
    U32,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::F32 | Dtype::U32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// Lower-case name, as in configs and messages.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::U32 => "u32",
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that is the element of one [`Dtype`].
pub trait Element: Copy + Send + Sync + 'static {
    /// Its dtype.
    const DTYPE: Dtype;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
}
impl Element for half::bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
}
impl Element for half::f16 {
    const DTYPE: Dtype = Dtype::F16;
}
impl Element for u32 {
    const DTYPE: Dtype = Dtype::U32;
}
