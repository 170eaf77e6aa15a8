//! Aligned host buffers for direct I/O, optionally page-locked.
//!
//! Buffers of [`HUGE_PAGE_BYTES`] or more are anonymous mappings of their
//! own, advised to use transparent huge pages before anything touches them
//! (where THP is `madvise`-only, as on most distributions, nothing else
//! gets them). A direct request's pages are then a few physically
//! contiguous runs instead of one segment per 4 KiB page: a 1 MiB request
//! over scattered 4 KiB pages is 256 segments, more than many block devices
//! take in one request (virtio's `max_segments` is often 254), so the
//! kernel splits it; and pinning, page walks and TLB misses shrink too.
//!
//! The runtime may hand in memory that something else allocated and pinned
//! (CUDA host allocations) through [`AlignedBuf::from_raw_parts`]; storage
//! treats both the same way.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Result, StorageError};
use crate::size::ByteSize;

/// Alignment that satisfies direct I/O on every device we know (and pages).
pub const PAGE_BYTES: usize = 4096;

/// Buffers this large or larger are mapped on their own, on huge pages
/// where the kernel has them (x86-64's and most arm64 kernels' PMD size).
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// How a buffer's memory is returned when it is dropped.
enum Release {
    Global(Layout),
    /// A mapping of our own (`munmap` of the buffer's range).
    Mapped,
    Foreign(Box<dyn FnOnce(NonNull<u8>, usize) + Send + Sync>),
}

/// An owned, zero-initialised host buffer whose address and length are
/// multiples of its alignment.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    align: usize,
    locked: bool,
    /// Locked by [`AlignedBuf::try_lock`]: unlocked on drop before the
    /// memory goes back.
    mlocked: bool,
    release: Option<Release>,
}

// SAFETY: AlignedBuf owns its memory exclusively (like Vec<u8>); access goes
// through &self / &mut self.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out &[u8].
unsafe impl Sync for AlignedBuf {}

static MEMLOCK_WARNED: AtomicBool = AtomicBool::new(false);

impl AlignedBuf {
    /// Allocates `len_bytes` (rounded up to `align`) of zeroed memory aligned to
    /// `align` (a power of two, at least 512).
    pub fn new(len_bytes: usize, align: usize) -> Result<Self> {
        Self::allocate(len_bytes, align, true)
    }

    /// Like [`AlignedBuf::new`], but a buffer of [`HUGE_PAGE_BYTES`] or more
    /// is left uncommitted: its pages are placed (on the NUMA node of the
    /// thread that commits them) by [`commit_pages`] calls, from whichever
    /// threads will use them, or by first touch. Until committed it reads
    /// as zeros like any other.
    pub fn new_uncommitted(len_bytes: usize, align: usize) -> Result<Self> {
        Self::allocate(len_bytes, align, false)
    }

    fn allocate(len_bytes: usize, align: usize, commit: bool) -> Result<Self> {
        assert!(
            align.is_power_of_two() && align >= 512,
            "alignment {align} must be a power of two >= 512"
        );
        let refused = |cause: &str| StorageError::HostAlloc {
            len_bytes,
            align_bytes: align,
            cause: cause.to_string(),
        };
        let len = len_bytes
            .max(1)
            .div_ceil(align)
            .checked_mul(align)
            .filter(|&len| len <= isize::MAX as usize - HUGE_PAGE_BYTES)
            .ok_or_else(|| refused("larger than an address space"))?;
        if len >= HUGE_PAGE_BYTES && align <= PAGE_BYTES {
            return Self::mapped(len, align, commit);
        }
        let layout = Layout::from_size_align(len, align)
            .map_err(|_| refused("not a valid allocation layout"))?;
        // SAFETY: layout has non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| refused("the allocator returned null"))?;
        Ok(Self {
            ptr,
            len,
            align,
            locked: false,
            mlocked: false,
            release: Some(Release::Global(layout)),
        })
    }

    /// A fresh anonymous mapping (zeroed by the kernel) starting on a
    /// [`HUGE_PAGE_BYTES`] boundary (an unaligned start would leave its
    /// first and last huge-page windows partial), advised to use huge
    /// pages, then, with `commit`, committed ([`commit_pages`]), so a
    /// shortage is this call's error rather than an out-of-memory kill
    /// later, in the middle of a step. The advice is a hint: a kernel
    /// without THP, or with it off, maps 4 KiB pages.
    fn mapped(len: usize, align: usize, commit: bool) -> Result<Self> {
        let refused = |what: &str, err: std::io::Error| StorageError::HostAlloc {
            len_bytes: len,
            align_bytes: align,
            cause: format!("{what}: {err}"),
        };
        let span = len + HUGE_PAGE_BYTES;
        // SAFETY: a new private anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(refused("mmap", std::io::Error::last_os_error()));
        }
        let start = (raw as usize).next_multiple_of(HUGE_PAGE_BYTES);
        let (head, tail) = (start - raw as usize, span - (start - raw as usize) - len);
        // SAFETY: both ranges lie inside the mapping just made and outside
        // `start..start + len`, which stays mapped.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        let ptr = NonNull::new(start as *mut u8).expect("a mapping is never at address zero");
        let mut buf = Self {
            ptr,
            len,
            align,
            locked: false,
            mlocked: false,
            release: Some(Release::Mapped),
        };
        // SAFETY: the range is the mapping just made, ours alone.
        unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        if commit {
            // `buf` unmaps the range as it drops.
            commit_pages(&mut buf)?;
        }
        Ok(buf)
    }

    /// Like [`AlignedBuf::new`], then page-locks the memory with mlock. If the
    /// memlock limit refuses, logs one warning for the process naming the limit
    /// and the fix, and returns the buffer unlocked.
    pub fn new_locked(len_bytes: usize, align: usize) -> Result<Self> {
        let mut buf = Self::new(len_bytes, align)?;
        buf.try_lock();
        Ok(buf)
    }

    /// Adopts memory allocated (and possibly pinned) elsewhere, such as a
    /// CUDA host allocation.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, aligned to
    /// `align`, exclusively owned by the returned buffer, and stay valid until
    /// `release(ptr, len)` is called, which happens exactly once, on drop.
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        align: usize,
        page_locked: bool,
        release: impl FnOnce(NonNull<u8>, usize) + Send + Sync + 'static,
    ) -> Self {
        assert!(align.is_power_of_two(), "alignment must be a power of two");
        assert_eq!(
            ptr.as_ptr() as usize % align,
            0,
            "pointer is not aligned to {align}"
        );
        assert_eq!(len % align, 0, "length {len} is not a multiple of {align}");
        Self {
            ptr,
            len,
            align,
            locked: page_locked,
            mlocked: false,
            release: Some(Release::Foreign(Box::new(release))),
        }
    }

    /// Page-locks the memory with mlock (which also commits whatever is not
    /// yet committed, from the calling thread). If the memlock limit
    /// refuses, logs one warning for the process naming the limit and the
    /// fix, and leaves the buffer unlocked ([`AlignedBuf::is_locked`]).
    pub fn try_lock(&mut self) {
        if self.locked {
            return;
        }
        // SAFETY: the range is our own live allocation.
        let rc = unsafe { libc::mlock(self.ptr.as_ptr().cast(), self.len) };
        if rc == 0 {
            (self.locked, self.mlocked) = (true, true);
            return;
        }
        let err = std::io::Error::last_os_error();
        if !MEMLOCK_WARNED.swap(true, Ordering::Relaxed) {
            let limit = match crate::sys::memlock_limit_bytes() {
                Some(bytes) => ByteSize(bytes).to_string(),
                None => "unlimited".to_string(),
            };
            tracing::warn!(
                "could not page-lock {} of host memory ({err}); RLIMIT_MEMLOCK is {limit}. \
                 Raise it with `ulimit -l unlimited` (or a memlock line in /etc/security/limits.conf, \
                 or LimitMEMLOCK= for a systemd service). Continuing with unlocked memory: \
                 correct, but pages may be swapped out and transfers slower.",
                ByteSize(self.len as u64)
            );
        }
    }

    /// Keeps the memory out of child processes (`MADV_DONTFORK`): memory
    /// a device reads and writes by DMA must not be copied on write after
    /// a fork, which would leave the parent writing pages the device no
    /// longer sees. A refusal (memory not mapped in whole pages) is logged.
    pub fn exclude_from_fork(&mut self) {
        // SAFETY: the range is our own live allocation; the advice changes
        // only what a fork copies.
        let rc = unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_DONTFORK) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            tracing::warn!(
                len = self.len,
                "could not keep host memory out of child processes: {err}"
            );
        }
    }

    /// Length in bytes (a multiple of [`AlignedBuf::align`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: buffers hold at least one alignment unit.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Alignment of the address and the length.
    pub fn align(&self) -> usize {
        self.align
    }

    /// Whether the pages are locked in RAM.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Start address.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start address, writable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

/// Commits the pages under `bytes` from the calling thread, so that each
/// lands on that thread's NUMA node (the kernel places an anonymous page
/// where the thread that faults it in runs), and a shortage is this call's
/// error, naming the bytes, rather than an out-of-memory kill at a later
/// first touch. The bytes keep their values. Pages that `bytes` only partly
/// covers are committed too (they are touched, not advised). Kernels older
/// than Linux 5.14 (no `MADV_POPULATE_WRITE`) get every page touched
/// instead, and a shortage there is the kill it would have been anyway.
pub fn commit_pages(bytes: &mut [u8]) -> Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    let start = bytes.as_mut_ptr() as usize;
    let (first, end) = (start.next_multiple_of(PAGE_BYTES), start + bytes.len());
    let last = end / PAGE_BYTES * PAGE_BYTES;
    // One byte of every page partly covered at either end, or of every page
    // where the advice is refused: read and written back, so nothing changes.
    let touch = |bytes: &mut [u8], from: usize, to: usize| {
        let mut at = from;
        while at < to {
            let byte = &mut bytes[at - start];
            // SAFETY: `byte` is a valid, exclusive reference into `bytes`;
            // volatile so that the write (which commits the page) stays.
            unsafe { std::ptr::write_volatile(byte, std::ptr::read_volatile(byte)) };
            at = (at / PAGE_BYTES + 1) * PAGE_BYTES;
        }
    };
    if first >= last {
        touch(bytes, start, end);
        return Ok(());
    }
    touch(bytes, start, first);
    touch(bytes, last, end);
    // Populating writes nothing a reader could see (pages keep their contents).
    // SAFETY: `first..last` lies inside `bytes`, which we hold exclusively.
    let rc = unsafe {
        libc::madvise(
            first as *mut libc::c_void,
            last - first,
            libc::MADV_POPULATE_WRITE,
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINVAL) {
            return Err(StorageError::HostAlloc {
                len_bytes: bytes.len(),
                align_bytes: PAGE_BYTES,
                cause: format!("committing the memory: {err}"),
            });
        }
        touch(bytes, first, last);
    }
    Ok(())
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // Zeroed at allocation, or guaranteed by from_raw_parts' contract.
        // SAFETY: ptr is valid for len initialised bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("align", &self.align)
            .field("locked", &self.locked)
            .finish()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.release.take() {
            Some(Release::Global(layout)) => {
                if self.mlocked {
                    // SAFETY: the range is our own allocation, locked by us.
                    unsafe { libc::munlock(self.ptr.as_ptr().cast(), self.len) };
                }
                // SAFETY: allocated with this exact layout in `new`.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
            }
            Some(Release::Mapped) => {
                // SAFETY: the range is our own mapping (made in `mapped`),
                // unmapped once, here; unmapping also unlocks it.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
            }
            Some(Release::Foreign(release)) => {
                if self.mlocked {
                    // SAFETY: the range is the adopted memory, still valid
                    // until `release`, locked by us.
                    unsafe { libc::munlock(self.ptr.as_ptr().cast(), self.len) };
                }
                release(self.ptr, self.len)
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_rounded() {
        let buf = AlignedBuf::new(5000, 4096).unwrap();
        assert_eq!(buf.len(), 8192);
        assert_eq!(buf.as_ptr() as usize % 4096, 0);
        assert!(buf.iter().all(|&b| b == 0));
    }

    #[test]
    fn large_buffers_are_mappings_advised_onto_huge_pages() {
        let mut buf = AlignedBuf::new(HUGE_PAGE_BYTES * 3 + 5, 4096).unwrap();
        assert_eq!(buf.len(), HUGE_PAGE_BYTES * 3 + 4096);
        assert_eq!(buf.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        assert!(matches!(buf.release, Some(Release::Mapped)));
        assert!(buf.iter().all(|&b| b == 0));
        let last = buf.len() - 1;
        buf[last] = 9;
        assert_eq!(buf[last], 9);
        // Alignments above a page still come from the allocator.
        let big_align = AlignedBuf::new(HUGE_PAGE_BYTES, HUGE_PAGE_BYTES).unwrap();
        assert_eq!(big_align.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        assert!(matches!(big_align.release, Some(Release::Global(_))));
        // Where the kernel has THP, the mapping carries the advice.
        if std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|mode| !mode.contains("[never]"))
        {
            let flags = smaps_field(buf.as_ptr(), "VmFlags:");
            assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
        }
    }

    /// A field of the smaps entry whose range holds `address` (an adjacent
    /// mapping with the same flags may have merged with it).
    fn smaps_field(address: *const u8, field: &str) -> String {
        let address = address as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let holds = |line: &str| {
            let range = line.split(' ').next().unwrap_or("");
            let mut ends = range.split('-').map(|x| usize::from_str_radix(x, 16));
            matches!((ends.next(), ends.next()), (Some(Ok(a)), Some(Ok(b))) if a <= address && address < b)
        };
        smaps
            .lines()
            .skip_while(|line| !holds(line))
            .find(|line| line.starts_with(field))
            .expect("the mapping is listed in smaps")
            .to_string()
    }

    #[test]
    fn uncommitted_buffers_commit_where_asked_and_keep_their_bytes() {
        let mut buf = AlignedBuf::new_uncommitted(HUGE_PAGE_BYTES * 8, 4096).unwrap();
        assert!(matches!(buf.release, Some(Release::Mapped)));
        // Each huge-page window's first page: in memory or not.
        let committed = |buf: &AlignedBuf| -> Option<Vec<bool>> {
            (0..8)
                .map(|k| crate::sys::page_present(buf[k * HUGE_PAGE_BYTES..].as_ptr()))
                .collect()
        };
        let Some(before) = committed(&buf) else {
            println!("skipped the residency checks: /proc/self/pagemap cannot be read here");
            return;
        };
        assert_eq!(before, vec![false; 8]);
        // Two huge-page windows, from an unaligned start to an unaligned end:
        // the partial pages at both ends are committed too (the first page
        // of window 2 only holds the start).
        let (from, to) = (HUGE_PAGE_BYTES * 2 + 100, HUGE_PAGE_BYTES * 4 - 100);
        commit_pages(&mut buf[from..to]).unwrap();
        let windows: Vec<bool> = (0..8).map(|k| k == 2 || k == 3).collect();
        assert_eq!(committed(&buf).unwrap(), windows);
        assert_eq!(crate::sys::page_present(buf[to - 1..].as_ptr()), Some(true));
        assert!(buf.iter().all(|&b| b == 0));
        // Committing again keeps what was written, at any offset and length.
        for (i, b) in buf[..3 * PAGE_BYTES].iter_mut().enumerate() {
            *b = i as u8 ^ 0x5a;
        }
        commit_pages(&mut buf[1..3 * PAGE_BYTES - 1]).unwrap();
        commit_pages(&mut buf[5..6]).unwrap();
        commit_pages(&mut []).unwrap();
        assert!(
            buf[..3 * PAGE_BYTES]
                .iter()
                .enumerate()
                .all(|(i, &b)| b == i as u8 ^ 0x5a)
        );
        buf.try_lock();
        buf.try_lock();
    }

    #[test]
    fn absurd_sizes_are_refused_with_the_reason() {
        let error = AlignedBuf::new(usize::MAX - 10, 4096).unwrap_err();
        assert!(
            error.to_string().contains("larger than an address space"),
            "{error}"
        );
    }

    #[test]
    fn locked_or_warned_never_fails() {
        // Bigger than a default 8 MiB memlock limit: must still succeed.
        let mut buf = AlignedBuf::new_locked(64 << 20, 4096).unwrap();
        buf[0] = 7;
        assert_eq!(buf[0], 7);
    }

    #[test]
    fn foreign_memory_is_released_once() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicUsize;
        let layout = Layout::from_size_align(8192, 4096).unwrap();
        // SAFETY: non-zero layout.
        let raw = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).unwrap();
        let released = Arc::new(AtomicUsize::new(0));
        let counter = released.clone();
        let release = move |ptr: NonNull<u8>, _len: usize| {
            counter.fetch_add(1, Ordering::SeqCst);
            // SAFETY: allocated above with `layout`, released once.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) }
        };
        // SAFETY: we own `raw` (8192 bytes, 4096-aligned) and free it in release.
        let buf = unsafe { AlignedBuf::from_raw_parts(raw, 8192, 4096, true, release) };
        assert!(buf.is_locked());
        drop(buf);
        assert_eq!(released.load(Ordering::SeqCst), 1);
    }
}
