//! Device buffers and strided views of them.
//!
//! A [`Buffer`] is memory on one device: host memory for the CPU device,
//! a device allocation on a GPU. Operations take [`View`]s (read) and
//! [`ViewMut`]s (write): a 2-D window of a buffer, `rows x cols` elements
//! with `row_stride` elements between row starts, so an attention head's
//! columns of a packed QKV matrix are a view, not a copy. A view borrows
//! its buffer, so the borrow checker keeps a written view from aliasing
//! any other; what a GPU still does with a buffer after the borrow ends is
//! ordered by its stream and fences (see [`crate::Fence`]).
//!
//! This is one of the few modules with `unsafe`: host allocation, and
//! turning a host view back into a slice.

use std::alloc::Layout;
use std::marker::PhantomData;
use std::ops::Range;

use crate::error::{DeviceError, Result};
use crate::{DeviceKind, Dtype, Element};

/// Alignment of host buffers: a cache line, and every vector width.
pub const HOST_ALIGN_BYTES: usize = 64;

/// Memory on a device: `len` elements of `dtype`.
pub struct Buffer {
    address: u64,
    len: usize,
    dtype: Dtype,
    kind: DeviceKind,
    release: Release,
}

enum Release {
    Host(Layout),
    Foreign(Option<Box<dyn FnOnce(u64) + Send + Sync>>),
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .field("kind", &self.kind)
            .finish()
    }
}

impl Buffer {
    /// `len` zeroed elements of `dtype` in host memory (the CPU device's),
    /// aligned to [`HOST_ALIGN_BYTES`].
    pub fn host(dtype: Dtype, len: usize) -> Result<Buffer> {
        let bytes = (len as u64)
            .checked_mul(dtype.bytes())
            .filter(|&b| b <= isize::MAX as u64 - HOST_ALIGN_BYTES as u64)
            .ok_or(DeviceError::Size {
                elems: len as u64,
                dtype,
            })?;
        // A zero-sized allocation is not allowed; one line stands in.
        let layout = Layout::from_size_align((bytes as usize).max(1), HOST_ALIGN_BYTES)
            .expect("size checked above, alignment a power of two");
        // SAFETY: the layout has a non-zero size.
        let pointer = unsafe { std::alloc::alloc_zeroed(layout) };
        if pointer.is_null() {
            return Err(DeviceError::HostAlloc {
                what: "a host buffer",
                len_bytes: bytes,
                cause: "the allocator returned null".into(),
            });
        }
        Ok(Buffer {
            address: pointer as u64,
            len,
            dtype,
            kind: DeviceKind::Cpu,
            release: Release::Host(layout),
        })
    }

    /// Adopts memory allocated elsewhere (a GPU allocation): `release` is
    /// called once with `address` when the buffer is dropped.
    ///
    /// # Safety
    /// `address` must be the start of `len` elements of `dtype` on a device
    /// of `kind`, valid until `release` runs and used by no one else;
    /// for [`DeviceKind::Cpu`] it must be host memory aligned for `dtype`.
    pub unsafe fn from_raw(
        address: u64,
        len: usize,
        dtype: Dtype,
        kind: DeviceKind,
        release: Box<dyn FnOnce(u64) + Send + Sync>,
    ) -> Buffer {
        Buffer {
            address,
            len,
            dtype,
            kind,
            release: Release::Foreign(Some(release)),
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Which device holds it.
    pub fn kind(&self) -> DeviceKind {
        self.kind
    }

    /// Bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.len as u64 * self.dtype.bytes()
    }

    /// The whole buffer as one row.
    pub fn view(&self) -> View<'_> {
        View {
            raw: Raw::flat(self.address, self.dtype, self.kind, self.len),
            _buffer: PhantomData,
        }
    }

    /// The whole buffer as one row, to write.
    pub fn view_mut(&mut self) -> ViewMut<'_> {
        ViewMut {
            raw: Raw::flat(self.address, self.dtype, self.kind, self.len),
            _buffer: PhantomData,
        }
    }

    /// The elements, when the buffer is host memory of `T`.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        self.view().host()
    }

    /// The elements to write, when the buffer is host memory of `T`.
    pub fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        self.view_mut().into_host()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        match &mut self.release {
            // SAFETY: allocated in `host` with this layout, freed once here.
            Release::Host(layout) => unsafe {
                std::alloc::dealloc(self.address as *mut u8, *layout)
            },
            Release::Foreign(release) => {
                if let Some(release) = release.take() {
                    release(self.address);
                }
            }
        }
    }
}

// SAFETY: a Buffer owns its memory; shared access only reads it (views),
// and writes need `&mut` (ViewMut), as for a Vec.
unsafe impl Send for Buffer {}
// SAFETY: as above.
unsafe impl Sync for Buffer {}

/// The geometry shared by both kinds of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Raw {
    /// Base address of the buffer (host pointer or device address).
    pub address: u64,
    /// Element type.
    pub dtype: Dtype,
    /// Device of the buffer.
    pub kind: DeviceKind,
    /// First element, from the buffer's start.
    pub offset: usize,
    /// Rows.
    pub rows: usize,
    /// Columns (elements per row).
    pub cols: usize,
    /// Elements between the starts of two rows.
    pub row_stride: usize,
}

impl Raw {
    fn flat(address: u64, dtype: Dtype, kind: DeviceKind, len: usize) -> Raw {
        Raw {
            address,
            dtype,
            kind,
            offset: 0,
            rows: 1,
            cols: len,
            row_stride: len,
        }
    }

    /// Elements the view reaches from its first: `(rows - 1) * stride + cols`.
    pub fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1) * self.row_stride + self.cols
        }
    }

    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether its rows follow one another with no gap.
    pub fn is_contiguous(&self) -> bool {
        self.rows <= 1 || self.row_stride == self.cols
    }

    /// The address of its first element.
    pub fn start_address(&self) -> u64 {
        self.address + self.offset as u64 * self.dtype.bytes()
    }

    fn within(self, extent: usize, what: Raw) -> Result<Raw> {
        let end = what.offset + what.extent();
        if what.extent() > 0 && end > self.offset + extent {
            return Err(DeviceError::ViewBounds {
                rows: what.rows,
                cols: what.cols,
                row_stride: what.row_stride,
                offset: what.offset,
                end,
                len: self.offset + extent,
                dtype: self.dtype,
            });
        }
        Ok(what)
    }

    fn matrix(self, rows: usize, cols: usize) -> Result<Raw> {
        assert!(self.is_contiguous(), "only a contiguous view is reshaped");
        let shaped = Raw {
            rows,
            cols,
            row_stride: cols,
            ..self
        };
        self.within(self.extent(), shaped)
    }

    fn range(self, range: Range<usize>) -> Raw {
        assert!(
            self.is_contiguous(),
            "only a contiguous view is cut by range"
        );
        assert!(
            range.start <= range.end && range.end <= self.len(),
            "range {range:?} of a view of {} elements",
            self.len()
        );
        Raw::flat(self.address, self.dtype, self.kind, range.len()).at(self.offset + range.start)
    }

    fn at(mut self, offset: usize) -> Raw {
        self.offset = offset;
        self
    }

    fn columns(self, columns: Range<usize>) -> Raw {
        assert!(
            columns.start <= columns.end && columns.end <= self.cols,
            "columns {columns:?} of a view of {} columns",
            self.cols
        );
        Raw {
            offset: self.offset + columns.start,
            cols: columns.len(),
            ..self
        }
    }

    fn rows(self, rows: Range<usize>) -> Raw {
        assert!(
            rows.start <= rows.end && rows.end <= self.rows,
            "rows {rows:?} of a view of {} rows",
            self.rows
        );
        Raw {
            offset: self.offset + rows.start * self.row_stride,
            rows: rows.len(),
            ..self
        }
    }

    /// Start and length in bytes of a contiguous view of host memory.
    fn host_byte_range(&self) -> Option<(*mut u8, usize)> {
        (self.kind == DeviceKind::Cpu && self.is_contiguous()).then(|| {
            let len = self.len() * self.dtype.bytes() as usize;
            (self.start_address() as *mut u8, len)
        })
    }

    /// The same bytes as elements of `dtype` (every dtype takes any bits):
    /// contiguous, with a whole number of them from an address aligned for
    /// them.
    fn as_dtype(self, dtype: Dtype) -> Result<Raw> {
        let bytes = self.len() as u64 * self.dtype.bytes();
        let address = self.start_address();
        if !self.is_contiguous()
            || !bytes.is_multiple_of(dtype.bytes())
            || !address.is_multiple_of(dtype.bytes())
        {
            return Err(DeviceError::ViewDtype {
                from: self.dtype,
                to: dtype,
                bytes,
                address,
            });
        }
        Ok(Raw::flat(
            address,
            dtype,
            self.kind,
            (bytes / dtype.bytes()) as usize,
        ))
    }

    fn host_pointer<T: Element>(&self) -> Option<*mut T> {
        assert_eq!(
            self.dtype,
            T::DTYPE,
            "a {} view read as {}",
            self.dtype,
            T::DTYPE
        );
        (self.kind == DeviceKind::Cpu).then_some(self.start_address() as *mut T)
    }
}

/// A read-only window of a buffer.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    raw: Raw,
    _buffer: PhantomData<&'a Buffer>,
}

/// A window of a buffer to write.
#[derive(Debug)]
pub struct ViewMut<'a> {
    raw: Raw,
    _buffer: PhantomData<&'a mut Buffer>,
}

impl<'a> View<'a> {
    /// A host slice as a view on the CPU device.
    pub fn host_slice<T: Element>(slice: &'a [T]) -> View<'a> {
        View {
            raw: Raw::flat(
                slice.as_ptr() as u64,
                T::DTYPE,
                DeviceKind::Cpu,
                slice.len(),
            ),
            _buffer: PhantomData,
        }
    }

    /// A view of `len` elements of `dtype` at `address` on a device of
    /// `kind`, memory someone else owns (a runtime tensor's device copy).
    ///
    /// # Safety
    /// The memory must hold `len` elements of `dtype` (aligned for it), on
    /// a device of `kind`, and stay valid and unwritten by others for `'a`
    /// (work enqueued on it is ordered by the owner's fences).
    pub unsafe fn from_raw_parts(
        address: u64,
        len: usize,
        dtype: Dtype,
        kind: DeviceKind,
    ) -> View<'a> {
        View {
            raw: Raw::flat(address, dtype, kind, len),
            _buffer: PhantomData,
        }
    }

    /// Its geometry.
    pub fn raw(&self) -> Raw {
        self.raw
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    /// Its element type.
    pub fn dtype(&self) -> Dtype {
        self.raw.dtype
    }

    /// This contiguous view as `rows x cols`; fails if it holds fewer.
    pub fn matrix(self, rows: usize, cols: usize) -> Result<View<'a>> {
        Ok(self.with(self.raw.matrix(rows, cols)?))
    }

    /// Elements `range` of this contiguous view.
    pub fn range(self, range: Range<usize>) -> View<'a> {
        self.with(self.raw.range(range))
    }

    /// The same bytes read as `dtype` (a buffer holding parts of several
    /// types); fails unless the view is contiguous and its bytes and
    /// address are multiples of `dtype`'s size.
    pub fn as_dtype(self, dtype: Dtype) -> Result<View<'a>> {
        Ok(self.with(self.raw.as_dtype(dtype)?))
    }

    /// Columns `columns` of every row (strided).
    pub fn columns(self, columns: Range<usize>) -> View<'a> {
        self.with(self.raw.columns(columns))
    }

    /// Rows `rows`.
    pub fn rows(self, rows: Range<usize>) -> View<'a> {
        self.with(self.raw.rows(rows))
    }

    /// The elements from the first to the last it reaches, when it is host
    /// memory of `T` (for a strided view, the rows' gaps included).
    pub fn host<T: Element>(self) -> Option<&'a [T]> {
        let pointer = self.raw.host_pointer::<T>()?;
        // The view was cut from a live, shared borrow (a buffer or a slice) of host
        // memory of `T` that holds its whole extent (checked where views are cut).
        // SAFETY: that borrow lasts 'a and holds `extent()` elements of `T`.
        let slice = unsafe { std::slice::from_raw_parts(pointer, self.raw.extent()) };
        Some(slice)
    }

    /// The bytes of this view, when it is contiguous host memory.
    pub fn host_bytes(self) -> Option<&'a [u8]> {
        let (pointer, len) = self.raw.host_byte_range()?;
        // SAFETY: as `View::host`: a live shared borrow of the whole contiguous view.
        let bytes = unsafe { std::slice::from_raw_parts(pointer, len) };
        Some(bytes)
    }

    fn with(self, raw: Raw) -> View<'a> {
        View {
            raw,
            _buffer: PhantomData,
        }
    }
}

impl<'a> ViewMut<'a> {
    /// A host slice as a writable view on the CPU device.
    pub fn host_slice<T: Element>(slice: &'a mut [T]) -> ViewMut<'a> {
        ViewMut {
            raw: Raw::flat(
                slice.as_mut_ptr() as u64,
                T::DTYPE,
                DeviceKind::Cpu,
                slice.len(),
            ),
            _buffer: PhantomData,
        }
    }

    /// A writable view of `len` elements of `dtype` at `address` on a
    /// device of `kind`, memory someone else owns.
    ///
    /// # Safety
    /// As [`View::from_raw_parts`], and no one else reads or writes the
    /// memory for `'a`.
    pub unsafe fn from_raw_parts(
        address: u64,
        len: usize,
        dtype: Dtype,
        kind: DeviceKind,
    ) -> ViewMut<'a> {
        ViewMut {
            raw: Raw::flat(address, dtype, kind, len),
            _buffer: PhantomData,
        }
    }

    /// Its geometry.
    pub fn raw(&self) -> Raw {
        self.raw
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    /// Its element type.
    pub fn dtype(&self) -> Dtype {
        self.raw.dtype
    }

    /// Reborrows it to read.
    pub fn view(&self) -> View<'_> {
        View {
            raw: self.raw,
            _buffer: PhantomData,
        }
    }

    /// Reborrows it to write, for one call.
    pub fn reborrow(&mut self) -> ViewMut<'_> {
        ViewMut {
            raw: self.raw,
            _buffer: PhantomData,
        }
    }

    /// This contiguous view as `rows x cols`; fails if it holds fewer.
    pub fn matrix(self, rows: usize, cols: usize) -> Result<ViewMut<'a>> {
        let raw = self.raw.matrix(rows, cols)?;
        Ok(self.with(raw))
    }

    /// Elements `range` of this contiguous view.
    pub fn range(self, range: Range<usize>) -> ViewMut<'a> {
        let raw = self.raw.range(range);
        self.with(raw)
    }

    /// As [`View::as_dtype`], to write.
    pub fn as_dtype(self, dtype: Dtype) -> Result<ViewMut<'a>> {
        let raw = self.raw.as_dtype(dtype)?;
        Ok(self.with(raw))
    }

    /// Columns `columns` of every row (strided).
    pub fn columns(self, columns: Range<usize>) -> ViewMut<'a> {
        let raw = self.raw.columns(columns);
        self.with(raw)
    }

    /// Rows `rows`.
    pub fn rows(self, rows: Range<usize>) -> ViewMut<'a> {
        let raw = self.raw.rows(rows);
        self.with(raw)
    }

    /// Cuts this contiguous view in two at element `mid`.
    pub fn split_at(self, mid: usize) -> (ViewMut<'a>, ViewMut<'a>) {
        let (head, tail) = (self.raw.range(0..mid), self.raw.range(mid..self.len()));
        let _consumed = self;
        let make = |raw| ViewMut {
            raw,
            _buffer: PhantomData,
        };
        (make(head), make(tail))
    }

    /// Cuts the first `lens.iter().sum()` elements of this contiguous view
    /// into `N` consecutive parts of `lens` elements (a model's saved
    /// activations, a block's gradients), each writable on its own.
    pub fn split_parts<const N: usize>(self, lens: [usize; N]) -> [ViewMut<'a>; N] {
        let mut rest = Some(self);
        std::array::from_fn(|i| {
            let (head, tail) = rest.take().expect("one part at a time").split_at(lens[i]);
            rest = Some(tail);
            head
        })
    }

    /// The elements from the first to the last it reaches, to write, when
    /// it is host memory of `T`.
    pub fn into_host<T: Element>(self) -> Option<&'a mut [T]> {
        let pointer = self.raw.host_pointer::<T>()?;
        // As `View::host`, and exclusive: views cut from one `ViewMut` (`split_at`)
        // never overlap; strided writable views are cut (`columns`) from one consumed.
        // SAFETY: an exclusive borrow of `extent()` elements of `T` for 'a.
        let slice = unsafe { std::slice::from_raw_parts_mut(pointer, self.raw.extent()) };
        Some(slice)
    }

    /// The bytes of this view to write, when it is contiguous host memory.
    pub fn into_host_bytes(self) -> Option<&'a mut [u8]> {
        let (pointer, len) = self.raw.host_byte_range()?;
        // SAFETY: as `ViewMut::into_host`: an exclusive borrow of the whole view.
        let bytes = unsafe { std::slice::from_raw_parts_mut(pointer, len) };
        Some(bytes)
    }

    /// As [`ViewMut::into_host`], for the length of a borrow.
    pub fn host<T: Element>(&mut self) -> Option<&mut [T]> {
        self.reborrow().into_host()
    }

    fn with(self, raw: Raw) -> ViewMut<'a> {
        ViewMut {
            raw,
            _buffer: PhantomData,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_cut_rows_columns_and_ranges_of_a_buffer() {
        let mut buffer = Buffer::host(Dtype::F32, 12).unwrap();
        assert_eq!(
            buffer.as_ptr_aligned(),
            0,
            "host buffers are cache-line aligned"
        );
        for (i, v) in buffer.as_mut_slice::<f32>().unwrap().iter_mut().enumerate() {
            *v = i as f32;
        }
        let matrix = buffer.view().matrix(3, 4).unwrap();
        let column = matrix.columns(1..3).rows(1..3);
        assert_eq!(column.raw().extent(), 6);
        assert_eq!(
            column.host::<f32>().unwrap(),
            &[5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
        );
        assert_eq!(matrix.range(2..4).host::<f32>().unwrap(), &[2.0, 3.0]);
        let (head, tail) = buffer.view_mut().split_at(5);
        assert_eq!((head.len(), tail.len()), (5, 7));
        let [a, mut b, c] = buffer.view_mut().split_parts([2, 3, 4]);
        assert_eq!((a.len(), b.len(), c.len()), (2, 3, 4));
        assert_eq!(b.host::<f32>().unwrap(), &[2.0, 3.0, 4.0]);
        assert_eq!(c.view().host::<f32>().unwrap(), &[5.0, 6.0, 7.0, 8.0]);
        assert!(matches!(
            buffer.view().matrix(4, 4),
            Err(DeviceError::ViewBounds {
                end: 16,
                len: 12,
                ..
            })
        ));
    }

    #[test]
    fn a_view_reads_its_bytes_as_another_dtype_when_they_divide_and_align() {
        let mut buffer = Buffer::host(Dtype::Bf16, 10).unwrap();
        {
            // Elements 2..6 of bf16 are two f32 at byte 4.
            let mut floats = buffer.view_mut().range(2..6).as_dtype(Dtype::F32).unwrap();
            assert_eq!(floats.len(), 2);
            floats.host::<f32>().unwrap().copy_from_slice(&[1.0, -2.0]);
        }
        let halves = buffer.view().range(2..6);
        let words: Vec<u16> = halves
            .host::<half::bf16>()
            .unwrap()
            .iter()
            .map(|h| h.to_bits())
            .collect();
        // Little-endian: each f32's low half first; 1.0 = 0x3f80_0000.
        assert_eq!(words, [0x0000, 0x3f80, 0x0000, 0xc000]);
        let back = halves.as_dtype(Dtype::F32).unwrap();
        assert_eq!(back.host::<f32>().unwrap(), &[1.0, -2.0]);
        // An odd number of halves, or an address not 4-byte aligned, is not
        // a whole number of aligned f32.
        for range in [2..5, 1..5] {
            let err = buffer.view().range(range.clone()).as_dtype(Dtype::F32);
            assert!(
                matches!(err, Err(DeviceError::ViewDtype { to: Dtype::F32, .. })),
                "{range:?}: {err:?}"
            );
        }
        let text = buffer
            .view()
            .range(1..5)
            .as_dtype(Dtype::F32)
            .unwrap_err()
            .to_string();
        assert!(text.contains("cannot be read as f32"), "{text}");
        let strided = buffer.view().matrix(2, 4).unwrap().columns(0..2);
        assert!(strided.as_dtype(Dtype::F32).is_err());
    }

    #[test]
    fn an_absurd_size_is_an_error_not_an_abort() {
        assert!(matches!(
            Buffer::host(Dtype::F32, usize::MAX / 2),
            Err(DeviceError::Size { .. })
        ));
    }

    impl Buffer {
        fn as_ptr_aligned(&self) -> u64 {
            self.address % HOST_ALIGN_BYTES as u64
        }
    }
}
