//! Typed views of the slices kernels take, so one entry point covers every
//! dtype combination, and [`Split`], which cuts all the slices of one call
//! at the same index so a pool can hand the halves to different threads.

use half::{bf16, f16};

/// Read-only values in one of the three float formats (gradients, inputs of
/// conversions and accumulation).
#[derive(Clone, Copy, Debug)]
pub enum Values<'a> {
    /// fp32.
    F32(&'a [f32]),
    /// bfloat16.
    Bf16(&'a [bf16]),
    /// IEEE fp16.
    F16(&'a [f16]),
}

/// A 16-bit destination: the compute copy of parameters written by a fused
/// step, or the target of a conversion.
#[derive(Debug)]
pub enum LowPrecisionMut<'a> {
    /// bfloat16.
    Bf16(&'a mut [bf16]),
    /// IEEE fp16.
    F16(&'a mut [f16]),
}

/// Adam's first and second moments, both in one format. fp16 is not
/// offered: the second moment (squared gradients) overflows its range.
#[derive(Debug)]
pub enum Moments<'a> {
    /// fp32 moments (what PyTorch and DeepSpeed keep).
    F32 {
        /// First moment (`exp_avg`).
        m: &'a mut [f32],
        /// Second moment (`exp_avg_sq`).
        v: &'a mut [f32],
    },
    /// bf16 moments: half the memory and traffic; each step rounds them
    /// to nearest even.
    Bf16 {
        /// First moment (`exp_avg`).
        m: &'a mut [bf16],
        /// Second moment (`exp_avg_sq`).
        v: &'a mut [bf16],
    },
}

impl Values<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Values::F32(x) => x.len(),
            Values::Bf16(x) => x.len(),
            Values::F16(x) => x.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl LowPrecisionMut<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            LowPrecisionMut::Bf16(x) => x.len(),
            LowPrecisionMut::F16(x) => x.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Moments<'_> {
    /// Elements (both moments have this many; checked when stepping).
    pub fn len(&self) -> usize {
        match self {
            Moments::F32 { m, .. } => m.len(),
            Moments::Bf16 { m, .. } => m.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn assert_len(&self, len: usize) {
        let (m, v) = match self {
            Moments::F32 { m, v } => (m.len(), v.len()),
            Moments::Bf16 { m, v } => (m.len(), v.len()),
        };
        assert!(
            m == len && v == len,
            "moments hold {m} and {v} elements, params {len}"
        );
    }
}

/// Cuts every slice of a kernel call at the same element index.
pub trait Split: Sized {
    /// The first `mid` elements and the rest.
    fn split_at(self, mid: usize) -> (Self, Self);
}

impl<T> Split for &[T] {
    fn split_at(self, mid: usize) -> (Self, Self) {
        <[T]>::split_at(self, mid)
    }
}

impl<T> Split for &mut [T] {
    fn split_at(self, mid: usize) -> (Self, Self) {
        self.split_at_mut(mid)
    }
}

impl<T: Split> Split for Option<T> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            Some(x) => {
                let (a, b) = x.split_at(mid);
                (Some(a), Some(b))
            }
            None => (None, None),
        }
    }
}

impl Split for Values<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            Values::F32(x) => (Values::F32(&x[..mid]), Values::F32(&x[mid..])),
            Values::Bf16(x) => (Values::Bf16(&x[..mid]), Values::Bf16(&x[mid..])),
            Values::F16(x) => (Values::F16(&x[..mid]), Values::F16(&x[mid..])),
        }
    }
}

impl Split for LowPrecisionMut<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            LowPrecisionMut::Bf16(x) => {
                let (a, b) = x.split_at_mut(mid);
                (LowPrecisionMut::Bf16(a), LowPrecisionMut::Bf16(b))
            }
            LowPrecisionMut::F16(x) => {
                let (a, b) = x.split_at_mut(mid);
                (LowPrecisionMut::F16(a), LowPrecisionMut::F16(b))
            }
        }
    }
}

impl Split for Moments<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            Moments::F32 { m, v } => {
                let ((m0, m1), (v0, v1)) = (m.split_at_mut(mid), v.split_at_mut(mid));
                (Moments::F32 { m: m0, v: v0 }, Moments::F32 { m: m1, v: v1 })
            }
            Moments::Bf16 { m, v } => {
                let ((m0, m1), (v0, v1)) = (m.split_at_mut(mid), v.split_at_mut(mid));
                (
                    Moments::Bf16 { m: m0, v: v0 },
                    Moments::Bf16 { m: m1, v: v1 },
                )
            }
        }
    }
}

/// Adam's moments to read from (an out-of-place step's inputs), in one
/// format.
#[derive(Clone, Copy, Debug)]
pub enum MomentsRef<'a> {
    /// fp32 moments.
    F32 {
        /// First moment.
        m: &'a [f32],
        /// Second moment.
        v: &'a [f32],
    },
    /// bf16 moments.
    Bf16 {
        /// First moment.
        m: &'a [bf16],
        /// Second moment.
        v: &'a [bf16],
    },
}

impl MomentsRef<'_> {
    /// Elements (asserting m and v agree).
    pub fn len(&self) -> usize {
        let (m, v) = match self {
            MomentsRef::F32 { m, v } => (m.len(), v.len()),
            MomentsRef::Bf16 { m, v } => (m.len(), v.len()),
        };
        assert_eq!(m, v, "m and v differ in length");
        m
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Split for MomentsRef<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            MomentsRef::F32 { m, v } => {
                let ((m0, m1), (v0, v1)) = (m.split_at(mid), v.split_at(mid));
                (
                    MomentsRef::F32 { m: m0, v: v0 },
                    MomentsRef::F32 { m: m1, v: v1 },
                )
            }
            MomentsRef::Bf16 { m, v } => {
                let ((m0, m1), (v0, v1)) = (m.split_at(mid), v.split_at(mid));
                (
                    MomentsRef::Bf16 { m: m0, v: v0 },
                    MomentsRef::Bf16 { m: m1, v: v1 },
                )
            }
        }
    }
}

macro_rules! split_tuple {
    ($($t:ident $v:ident $index:tt),+) => {
        impl<$($t: Split),+> Split for ($($t,)+) {
            fn split_at(self, mid: usize) -> (Self, Self) {
                $(let $v = self.$index.split_at(mid);)+
                (($($v.0,)+), ($($v.1,)+))
            }
        }
    };
}

split_tuple!(A a 0, B b 1);
split_tuple!(A a 0, B b 1, C c 2);
split_tuple!(A a 0, B b 1, C c 2, D d 3);
split_tuple!(A a 0, B b 1, C c 2, D d 3, E e 4);
split_tuple!(A a 0, B b 1, C c 2, D d 3, E e 4, F f 5);
split_tuple!(A a 0, B b 1, C c 2, D d 3, E e 4, F f 5, G g 6);

/// Copies up to [`crate::simd::LANES_MAX`] tail elements into a zero-padded
/// stack buffer, so a tail runs through the same vector code as the body.
#[inline(always)]
pub(crate) fn padded<T: Copy + Default>(tail: &[T]) -> [T; crate::simd::LANES_MAX] {
    let mut buffer = [T::default(); crate::simd::LANES_MAX];
    buffer[..tail.len()].copy_from_slice(tail);
    buffer
}
