//! Consecutive parts of one flat buffer, for architectures to lay their
//! parameters and working buffers out in: plain ([`Parts`]) or each part
//! of its own dtype and 16-byte aligned ([`TypedParts`]).

use std::ops::Range;

use strata_device::{Buffer, Dtype, View, ViewMut};
use strata_kernels::Backend;

use crate::error::{Result, TrainError};

/// Consecutive parts of one flat buffer, by their lengths.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Parts<const N: usize> {
    pub(crate) lens: [usize; N],
    pub(crate) ends: [usize; N],
}

impl<const N: usize> Parts<N> {
    pub(crate) fn new(lens: [usize; N]) -> Self {
        let mut ends = lens;
        for i in 1..N {
            ends[i] += ends[i - 1];
        }
        Parts { lens, ends }
    }

    pub(crate) fn total(&self) -> usize {
        self.ends[N - 1]
    }

    /// Elements of parts `first..=last`.
    pub(crate) fn span(&self, first: usize, last: usize) -> Range<usize> {
        let start = if first == 0 { 0 } else { self.ends[first - 1] };
        start..self.ends[last]
    }

    pub(crate) fn range(&self, i: usize) -> Range<usize> {
        self.span(i, i)
    }

    pub(crate) fn split<'a>(&self, view: ViewMut<'a>) -> [ViewMut<'a>; N] {
        view.split_parts(self.lens)
    }

    pub(crate) fn views<'a>(&self, view: View<'a>) -> [View<'a>; N] {
        std::array::from_fn(|i| view.range(self.range(i)))
    }
}

/// Parts of one buffer of a compute dtype, some of them of another dtype
/// (f32 statistics in a bf16 buffer), each starting 16-byte aligned (what
/// the tensor-core kernels' 16-byte copies need).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TypedParts<const N: usize> {
    /// Each part's elements, of its own dtype.
    pub(crate) lens: [usize; N],
    pub(crate) dtypes: [Dtype; N],
    /// The parts in the buffer's elements.
    pub(crate) parts: Parts<N>,
    /// The buffer's dtype.
    pub(crate) dtype: Dtype,
}

impl<const N: usize> TypedParts<N> {
    pub(crate) fn new(dtype: Dtype, parts: [(usize, Dtype); N]) -> Self {
        let unit = dtype.bytes() as usize;
        let in_buffer = parts.map(|(len, d)| (len * d.bytes() as usize).div_ceil(16) * 16 / unit);
        TypedParts {
            lens: parts.map(|p| p.0),
            dtypes: parts.map(|p| p.1),
            parts: Parts::new(in_buffer),
            dtype,
        }
    }

    pub(crate) fn total(&self) -> usize {
        self.parts.total()
    }

    /// A buffer for these parts on `backend`.
    pub(crate) fn alloc(&self, backend: &dyn Backend) -> Result<Buffer> {
        Ok(backend.alloc(self.dtype, self.total())?)
    }

    pub(crate) fn split<'a>(&self, view: ViewMut<'a>) -> [ViewMut<'a>; N] {
        let mut parts = self.parts.split(view).into_iter();
        std::array::from_fn(|i| {
            let part = parts.next().expect("N parts");
            let part = part
                .as_dtype(self.dtypes[i])
                .expect("parts start 16-byte aligned");
            part.range(0..self.lens[i])
        })
    }

    pub(crate) fn views<'a>(&self, view: View<'a>) -> [View<'a>; N] {
        std::array::from_fn(|i| self.view(view, i))
    }

    pub(crate) fn view<'a>(&self, view: View<'a>, i: usize) -> View<'a> {
        let part = view.range(self.parts.range(i));
        let part = part
            .as_dtype(self.dtypes[i])
            .expect("parts start 16-byte aligned");
        part.range(0..self.lens[i])
    }
}

/// Checks that `view` holds `expected` elements; the error names it.
pub(crate) fn expect_len(what: &'static str, view_len: usize, expected: usize) -> Result<()> {
    if view_len != expected {
        return Err(TrainError::Shape {
            what,
            actual: view_len,
            expected,
        });
    }
    Ok(())
}
