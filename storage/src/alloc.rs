//! [`ExtentAllocator`]: aligned extents of a linear address space, best fit
//! from the bottom or first fit from the top, free neighbours coalesced.
//!
//! The two ends keep two lifetimes apart: long-lived or churning tensors
//! best-fit low, short-lived ones that are freed in the reverse order they
//! were made (a step's activations) stack down from the top, so that the
//! holes one kind leaves are not cut up by the other.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::StorageError;
use crate::size::round_up;

/// Hands out aligned, non-overlapping `[offset, offset+len)` ranges of
/// `0..capacity_bytes`. Every byte is either free or allocated, never both.
#[derive(Debug, Clone)]
pub struct ExtentAllocator {
    capacity_bytes: u64,
    align_bytes: u64,
    /// Free extents by offset -> length; adjacent ones are always merged.
    by_offset: BTreeMap<u64, u64>,
    /// The same free extents by (length, offset), for best fit.
    by_size: BTreeSet<(u64, u64)>,
    free_bytes: u64,
}

impl ExtentAllocator {
    /// An allocator over `capacity_bytes` (rounded down to `align_bytes`).
    pub fn new(capacity_bytes: u64, align_bytes: u64) -> Self {
        assert!(align_bytes > 0, "alignment must be positive");
        let capacity_bytes = capacity_bytes / align_bytes * align_bytes;
        let mut allocator = Self {
            capacity_bytes,
            align_bytes,
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            free_bytes: 0,
        };
        if capacity_bytes > 0 {
            allocator.insert_free(0, capacity_bytes);
        }
        allocator
    }

    /// Allocates `len_bytes` rounded up to the alignment; returns (offset, length).
    /// Picks the smallest free extent that fits, lowest offset first.
    pub fn allocate(&mut self, len_bytes: u64) -> Result<(u64, u64), StorageError> {
        let len = round_up(len_bytes.max(1), self.align_bytes);
        let Some(&(free_len, offset)) = self.by_size.range((len, 0)..).next() else {
            return Err(self.out_of_space(len));
        };
        self.remove_free(offset, free_len);
        if free_len > len {
            self.insert_free(offset + len, free_len - len);
        }
        Ok((offset, len))
    }

    /// Allocates `len_bytes` rounded up to the alignment at the top of the
    /// highest free extent that fits: successive allocations stack down
    /// from the end of the space, and one freed last-in first-out leaves
    /// the free space as it was. Returns (offset, length).
    pub fn allocate_from_top(&mut self, len_bytes: u64) -> Result<(u64, u64), StorageError> {
        let len = round_up(len_bytes.max(1), self.align_bytes);
        // Free extents are few (they are coalesced): a scan from the top.
        let Some((offset, free_len)) = self
            .by_offset
            .iter()
            .rev()
            .map(|(&o, &l)| (o, l))
            .find(|&(_, l)| l >= len)
        else {
            return Err(self.out_of_space(len));
        };
        self.remove_free(offset, free_len);
        if free_len > len {
            self.insert_free(offset, free_len - len);
        }
        Ok((offset + free_len - len, len))
    }

    fn out_of_space(&self, needed_bytes: u64) -> StorageError {
        StorageError::OutOfSpace {
            needed_bytes,
            free_bytes: self.free_bytes,
            largest_free_bytes: self.largest_free_bytes(),
            capacity_bytes: self.capacity_bytes,
        }
    }

    /// Returns `[offset, offset+len_bytes)` to the free space. Panics if that
    /// range was not allocated (a double free or a foreign range).
    pub fn free(&mut self, offset: u64, len_bytes: u64) {
        assert!(len_bytes > 0, "freeing an empty extent");
        assert!(
            offset.is_multiple_of(self.align_bytes) && len_bytes.is_multiple_of(self.align_bytes),
            "freeing a misaligned extent {offset}+{len_bytes}"
        );
        let end = offset.checked_add(len_bytes).expect("extent end overflows");
        assert!(
            end <= self.capacity_bytes,
            "freeing past capacity: {offset}+{len_bytes}"
        );
        let before = self
            .by_offset
            .range(..=offset)
            .next_back()
            .map(|(&o, &l)| (o, l));
        let after = self.by_offset.range(offset..).next().map(|(&o, &l)| (o, l));
        if let Some((o, l)) = before {
            assert!(
                o + l <= offset,
                "double free: {offset}+{len_bytes} overlaps free {o}+{l}"
            );
        }
        if let Some((o, l)) = after {
            assert!(
                end <= o,
                "double free: {offset}+{len_bytes} overlaps free {o}+{l}"
            );
        }
        let (mut start, mut stop) = (offset, end);
        if let Some((o, l)) = before
            && o + l == offset
        {
            self.remove_free(o, l);
            start = o;
        }
        if let Some((o, l)) = after
            && o == end
        {
            self.remove_free(o, l);
            stop = o + l;
        }
        self.insert_free(start, stop - start);
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free_bytes -= len;
    }

    /// Total capacity.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Free bytes in all.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Allocated bytes in all.
    pub fn allocated_bytes(&self) -> u64 {
        self.capacity_bytes - self.free_bytes
    }

    /// Largest contiguous free extent.
    pub fn largest_free_bytes(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    /// Number of separate free extents (1 when nothing is allocated).
    pub fn free_extents(&self) -> usize {
        self.by_offset.len()
    }

    /// The free extents in address order, for checks.
    pub fn free_list(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_offset.iter().map(|(&o, &l)| (o, l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesces_back_to_one_extent() {
        let mut alloc = ExtentAllocator::new(1 << 20, 4096);
        let a = alloc.allocate(4096).unwrap();
        let b = alloc.allocate(5000).unwrap();
        let c = alloc.allocate(4096).unwrap();
        assert_eq!(b.1, 8192);
        alloc.free(b.0, b.1);
        alloc.free(a.0, a.1);
        alloc.free(c.0, c.1);
        assert_eq!(alloc.free_extents(), 1);
        assert_eq!(alloc.free_bytes(), 1 << 20);
    }

    #[test]
    fn best_fit_reuses_the_tightest_hole() {
        let mut alloc = ExtentAllocator::new(1 << 20, 4096);
        let small = alloc.allocate(4096).unwrap();
        let _keep = alloc.allocate(4096).unwrap();
        let big = alloc.allocate(16384).unwrap();
        let _keep2 = alloc.allocate(4096).unwrap();
        alloc.free(small.0, small.1);
        alloc.free(big.0, big.1);
        assert_eq!(alloc.allocate(4096).unwrap().0, small.0);
    }

    #[test]
    fn out_of_space_carries_the_numbers() {
        let mut alloc = ExtentAllocator::new(16384, 4096);
        let _a = alloc.allocate(8192).unwrap();
        match alloc.allocate(12288) {
            Err(StorageError::OutOfSpace {
                needed_bytes,
                free_bytes,
                largest_free_bytes,
                capacity_bytes,
            }) => {
                assert_eq!(
                    (needed_bytes, free_bytes, largest_free_bytes, capacity_bytes),
                    (12288, 8192, 8192, 16384)
                );
            }
            other => panic!("expected OutOfSpace, got {other:?}"),
        }
    }

    #[test]
    fn the_top_stacks_down_and_unwinds_to_one_extent() {
        let mut alloc = ExtentAllocator::new(1 << 20, 4096);
        let low = alloc.allocate(4096).unwrap();
        let a = alloc.allocate_from_top(8192).unwrap();
        let b = alloc.allocate_from_top(5000).unwrap();
        assert_eq!(a, ((1 << 20) - 8192, 8192));
        assert_eq!(b, ((1 << 20) - 16384, 8192));
        // Best fit from the bottom leaves the top alone.
        assert_eq!(alloc.allocate(4096).unwrap().0, 4096);
        alloc.free(b.0, b.1);
        alloc.free(a.0, a.1);
        assert_eq!(alloc.free_list().last(), Some((8192, (1 << 20) - 8192)));
        alloc.free(low.0, low.1);
        // A hole near the top is taken before lower room.
        let c = alloc.allocate_from_top(4096).unwrap();
        assert_eq!(c.0, (1 << 20) - 4096);
        let err = alloc.allocate_from_top(2 << 20).unwrap_err().to_string();
        assert!(err.contains(&(2u64 << 20).to_string()), "{err}");
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_is_caught() {
        let mut alloc = ExtentAllocator::new(1 << 20, 4096);
        let a = alloc.allocate(4096).unwrap();
        let _b = alloc.allocate(4096).unwrap();
        alloc.free(a.0, a.1);
        alloc.free(a.0, a.1);
    }
}
