//! The pinned host pool: size classes of fixed-size buffers, each class cut
//! from one contiguous region allocated once at start (the drive merges
//! requests over contiguous memory into larger ones; see strata-storage).
//!
//! A tensor's host copy is a list of [`Slot`]s whose sizes follow one
//! canonical plan for its length ([`HostPool::plan`]): as many of the largest
//! buffers as fit, then the next size down, and a last partial buffer of the
//! smallest class. The same plan gives the chunks of its NVMe copy, so any
//! host copy lines up with any NVMe copy of the same tensor.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use strata_device::DeviceError;
use strata_storage::{AlignedBuf, HUGE_PAGE_BYTES, PAGE_BYTES, StorageError, commit_pages};

use crate::config::ClassConfig;
use crate::error::{Result, RuntimeError};

/// The threads that will update the pinned pool (the optimizer's), lent to
/// commit its pages at start: the kernel places each page on the NUMA node
/// of the thread that commits it, and many threads commit a large pool
/// faster than one.
pub trait Spread: Sync {
    /// How many threads [`Spread::each`] runs `work` on.
    fn threads(&self) -> usize;

    /// Runs `work(i)` once on each thread `i` in `0..threads()`, all at
    /// once, and returns when every call has.
    fn each(&self, work: &(dyn Fn(usize) + Sync));
}

/// Commits the pages under `bytes`: on the calling thread without a
/// `spread`; with one, in huge-page windows dealt round-robin to its
/// threads, so each thread's share lies all along the region, as each
/// optimizer call's data does (a call's groups are cut evenly over the
/// threads, wherever in the pool their chunks are). On a host with more
/// than one NUMA node the pool is then spread over the nodes the threads
/// run on, like `numactl --interleave` over those nodes, instead of
/// landing on the allocating thread's; no thread reads all of its share
/// from its own node. The first error any thread meets is returned, with
/// the offset of its window; the other threads stop at their next window.
pub fn commit_spread(bytes: &mut [u8], spread: Option<&dyn Spread>) -> Result<()> {
    let Some(spread) = spread.filter(|s| s.threads() > 1) else {
        return Ok(commit_pages(bytes)?);
    };
    let (len, threads) = (bytes.len(), spread.threads());
    let mut shares: Vec<Vec<Window>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, window) in bytes.chunks_mut(HUGE_PAGE_BYTES).enumerate() {
        shares[i % threads].push((i * HUGE_PAGE_BYTES, window));
    }
    let shares: Vec<Mutex<Vec<Window>>> = shares.into_iter().map(Mutex::new).collect();
    // The first failure, and the offset of its window; the other threads
    // stop at their next window (memory is short: committing more would
    // only make it shorter).
    let failed = Mutex::new(None);
    let stop = AtomicBool::new(false);
    spread.each(&|thread| {
        // A broken `Spread`, not anything the memory or the user did.
        assert!(
            thread < threads,
            "Spread::each ran thread {thread} of a spread of {threads}"
        );
        let share = &shares[thread];
        for (offset, window) in lock(share).iter_mut() {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            if let Err(error) = commit_pages(window) {
                stop.store(true, Ordering::Relaxed);
                lock(&failed).get_or_insert((*offset, error));
                return;
            }
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        // Named by the whole region, not the window it failed in.
        Some((offset, StorageError::HostAlloc { cause, .. })) => Err(StorageError::HostAlloc {
            len_bytes: len,
            align_bytes: PAGE_BYTES,
            cause: format!("{cause}, {offset} bytes in"),
        }
        .into()),
        Some((_, error)) => Err(error.into()),
        None => Ok(()),
    }
}

/// A window's offset in the region, and its bytes.
type Window<'a> = (usize, &'a mut [u8]);

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// One buffer of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    /// Size class (index, smallest first).
    pub class: u8,
    /// Buffer within the class.
    pub index: u32,
}

/// One chunk of a tensor's canonical plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Size class of the buffer that holds it.
    pub class: u8,
    /// Offset of the chunk in the tensor.
    pub offset: u64,
    /// Bytes of the tensor in it (the buffer may be larger: last chunk).
    pub len_bytes: u64,
}

struct Region {
    buffer_bytes: u64,
    buffers: u32,
    memory: AlignedBuf,
}

/// The pool's memory. Immutable after start, so buffer addresses can be
/// computed without a lock; which buffers are free is [`FreeLists`]' job.
pub struct HostPool {
    regions: Vec<Region>,
}

impl HostPool {
    /// Allocates every class's region with `allocate(bytes)` (page-locked
    /// memory: CUDA host memory on a GPU machine, mlock otherwise; see
    /// [`crate::Device::alloc_host`]).
    pub fn new(
        classes: &[ClassConfig],
        allocate: &mut dyn FnMut(usize) -> Result<AlignedBuf>,
    ) -> Result<Self> {
        assert!(
            classes
                .windows(2)
                .all(|w| w[0].buffer_size.0 < w[1].buffer_size.0),
            "size classes sorted, smallest first, distinct"
        );
        assert!(classes.len() <= u8::MAX as usize, "class index fits u8");
        let mut regions = Vec::with_capacity(classes.len());
        for class in classes {
            let buffers = class.bytes.0 / class.buffer_size.0;
            assert!(buffers > 0 && buffers <= u64::from(u32::MAX));
            let region_bytes = buffers * class.buffer_size.0;
            // Memory refused by the kernel or the driver: named by the region.
            let memory = allocate(region_bytes as usize).map_err(|error| {
                let cause = match error {
                    RuntimeError::Storage(StorageError::HostAlloc { cause, .. }) => cause,
                    RuntimeError::Device(DeviceError::Cuda {
                        op: op @ "cuMemHostAlloc",
                        cause,
                    }) => format!("{op}: {cause}"),
                    other => return other,
                };
                RuntimeError::HostPool {
                    region_bytes,
                    buffer_bytes: class.buffer_size.0,
                    cause,
                }
            })?;
            regions.push(Region {
                buffer_bytes: class.buffer_size.0,
                buffers: buffers as u32,
                memory,
            });
        }
        Ok(Self { regions })
    }

    /// Number of size classes.
    pub fn classes(&self) -> usize {
        self.regions.len()
    }

    /// Buffer size of a class.
    pub fn buffer_bytes(&self, class: u8) -> u64 {
        self.regions[class as usize].buffer_bytes
    }

    /// Buffers in a class.
    pub fn buffers(&self, class: u8) -> u32 {
        self.regions[class as usize].buffers
    }

    /// Bytes of the whole pool.
    pub fn capacity_bytes(&self) -> u64 {
        self.regions
            .iter()
            .map(|r| r.buffer_bytes * u64::from(r.buffers))
            .sum()
    }

    /// Whether every region is page-locked.
    pub fn is_locked(&self) -> bool {
        self.regions.iter().all(|r| r.memory.is_locked())
    }

    /// The canonical chunks of a tensor of `len_bytes`, largest buffers first.
    pub fn plan(&self, len_bytes: u64, out: &mut Vec<Chunk>) {
        out.clear();
        let mut offset = 0;
        for class in (0..self.regions.len()).rev() {
            let size = self.regions[class].buffer_bytes;
            while len_bytes - offset >= size {
                out.push(Chunk {
                    class: class as u8,
                    offset,
                    len_bytes: size,
                });
                offset += size;
            }
        }
        if offset < len_bytes {
            out.push(Chunk {
                class: 0,
                offset,
                len_bytes: len_bytes - offset,
            });
        }
    }

    /// Start of a buffer. Valid for [`HostPool::buffer_bytes`] bytes for the
    /// pool's life; who may touch it is decided by whoever holds the slot.
    pub fn ptr(&self, slot: Slot) -> *mut u8 {
        let region = &self.regions[slot.class as usize];
        assert!(slot.index < region.buffers, "slot {slot:?} out of range");
        let offset = slot.index as usize * region.buffer_bytes as usize;
        // The region is only ever accessed through raw pointers after start.
        region.memory.as_ptr().wrapping_add(offset).cast_mut()
    }
}

/// Which buffers of each class are free. Lives under the registry's lock.
pub struct FreeLists {
    free: Vec<Vec<u32>>,
    buffer_bytes: Vec<u64>,
}

/// Why a plan could not be served: the first class that ran short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// The class.
    pub class: u8,
    /// Buffers of it the plan needs.
    pub needed: u32,
    /// Buffers of it free.
    pub free: u32,
}

impl FreeLists {
    /// Every buffer of `pool` free.
    pub fn new(pool: &HostPool) -> Self {
        Self {
            free: pool
                .regions
                .iter()
                .map(|r| (0..r.buffers).rev().collect())
                .collect(),
            buffer_bytes: pool.regions.iter().map(|r| r.buffer_bytes).collect(),
        }
    }

    /// Free buffers in a class.
    pub fn free_buffers(&self, class: u8) -> u32 {
        self.free[class as usize].len() as u32
    }

    /// Free bytes over all classes.
    pub fn free_bytes(&self) -> u64 {
        self.free
            .iter()
            .zip(&self.buffer_bytes)
            .map(|(free, bytes)| free.len() as u64 * bytes)
            .sum()
    }

    /// Takes one buffer per chunk, all or nothing.
    pub fn take(&mut self, chunks: &[Chunk], out: &mut Vec<Slot>) -> Result<(), Shortfall> {
        for class in 0..self.free.len() as u8 {
            let needed = chunks.iter().filter(|c| c.class == class).count() as u32;
            let free = self.free_buffers(class);
            if needed > free {
                return Err(Shortfall {
                    class,
                    needed,
                    free,
                });
            }
        }
        out.clear();
        out.extend(chunks.iter().map(|chunk| {
            Slot {
                class: chunk.class,
                index: self.free[chunk.class as usize]
                    .pop()
                    .expect("counted above"),
            }
        }));
        Ok(())
    }

    /// Returns buffers.
    pub fn give_back(&mut self, slots: &[Slot]) {
        for slot in slots {
            let free = &mut self.free[slot.class as usize];
            debug_assert!(!free.contains(&slot.index), "double free of {slot:?}");
            free.push(slot.index);
        }
    }

    /// Bytes that a set of slots occupies.
    pub fn bytes_of(&self, slots: &[Slot]) -> u64 {
        slots
            .iter()
            .map(|s| self.buffer_bytes[s.class as usize])
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_storage::ByteSize;

    fn pool() -> HostPool {
        let classes = [
            ClassConfig {
                buffer_size: ByteSize(4096),
                bytes: ByteSize(4 * 4096),
            },
            ClassConfig {
                buffer_size: ByteSize(65536),
                bytes: ByteSize(2 * 65536),
            },
        ];
        HostPool::new(&classes, &mut |bytes| Ok(AlignedBuf::new(bytes, 4096)?)).unwrap()
    }

    /// `threads` threads of their own, of which only those in `run` work
    /// (under the indices given).
    struct Threads {
        threads: usize,
        run: Vec<usize>,
    }

    impl Spread for Threads {
        fn threads(&self) -> usize {
            self.threads
        }
        fn each(&self, work: &(dyn Fn(usize) + Sync)) {
            std::thread::scope(|scope| {
                for &i in &self.run {
                    scope.spawn(move || work(i));
                }
            });
        }
    }

    #[test]
    fn spread_commits_huge_page_windows_round_robin_on_the_threads() {
        let windows = 10;
        let len = windows * HUGE_PAGE_BYTES;
        let committed = |buf: &AlignedBuf| -> Option<Vec<bool>> {
            (0..windows)
                .map(|k| strata_storage::sys::page_present(buf[k * HUGE_PAGE_BYTES..].as_ptr()))
                .collect()
        };
        let spread = |run: Vec<usize>| Threads { threads: 3, run };
        let mut buf = AlignedBuf::new_uncommitted(len, 4096).unwrap();
        let Some(before) = committed(&buf) else {
            println!("skipped: /proc/self/pagemap cannot be read here");
            return;
        };
        assert_eq!(before, vec![false; windows]);
        // Only thread 0 of 3 works: windows 0, 3, 6 and 9, and no others.
        commit_spread(&mut buf, Some(&spread(vec![0]))).unwrap();
        let expected: Vec<bool> = (0..windows).map(|k| k % 3 == 0).collect();
        assert_eq!(committed(&buf).unwrap(), expected);
        // All three: every window.
        commit_spread(&mut buf, Some(&spread(vec![0, 1, 2]))).unwrap();
        assert_eq!(committed(&buf).unwrap(), vec![true; windows]);
        assert!(buf.iter().all(|&b| b == 0));
        // Without threads (or with one), the caller commits everything.
        let mut alone = AlignedBuf::new_uncommitted(len, 4096).unwrap();
        commit_spread(&mut alone, None).unwrap();
        assert_eq!(committed(&alone).unwrap(), vec![true; windows]);
    }

    /// Claims three threads, and runs thread 5 on the caller.
    struct Broken;

    impl Spread for Broken {
        fn threads(&self) -> usize {
            3
        }
        fn each(&self, work: &(dyn Fn(usize) + Sync)) {
            work(5)
        }
    }

    #[test]
    #[should_panic(expected = "Spread::each ran thread 5 of a spread of 3")]
    fn a_spread_that_runs_a_thread_it_does_not_have_is_a_broken_invariant() {
        let mut buf = AlignedBuf::new_uncommitted(2 * HUGE_PAGE_BYTES, 4096).unwrap();
        let _ = commit_spread(&mut buf, Some(&Broken));
    }

    #[test]
    fn a_region_that_cannot_be_had_is_named_with_the_key_to_lower() {
        let classes = [ClassConfig {
            buffer_size: ByteSize(65536),
            bytes: ByteSize(3 * 65536),
        }];
        // The pool's error when every allocation fails with `error`.
        let refused = |error: &dyn Fn(usize) -> RuntimeError| {
            HostPool::new(&classes, &mut |bytes| Err(error(bytes)))
                .err()
                .unwrap()
        };
        let error = refused(&|bytes| {
            StorageError::HostAlloc {
                len_bytes: bytes,
                align_bytes: 4096,
                cause: "mmap: Cannot allocate memory (os error 12)".into(),
            }
            .into()
        });
        let text = error.to_string();
        assert!(
            matches!(
                error,
                RuntimeError::HostPool {
                    region_bytes: 196608,
                    buffer_bytes: 65536,
                    ..
                }
            ) && text.contains("os error 12")
                && text.contains("lower host.budget"),
            "{text}"
        );
        // The driver's allocation (the CUDA device's fallback) likewise.
        let error = refused(&|_| {
            DeviceError::Cuda {
                op: "cuMemHostAlloc",
                cause: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            }
            .into()
        });
        let text = error.to_string();
        assert!(
            matches!(error, RuntimeError::HostPool { .. })
                && text.contains("cuMemHostAlloc: CUDA_ERROR_OUT_OF_MEMORY"),
            "{text}"
        );
        // Other errors pass through as they are.
        let error = refused(&|_| {
            DeviceError::Cuda {
                op: "cuMemHostRegister",
                cause: "x".into(),
            }
            .into()
        });
        assert!(matches!(error, RuntimeError::Device(_)), "{error}");
    }

    #[test]
    fn plan_covers_the_tensor_with_little_waste() {
        let pool = pool();
        let mut chunks = Vec::new();
        pool.plan(65536 + 3 * 4096 + 100, &mut chunks);
        let classes: Vec<u8> = chunks.iter().map(|c| c.class).collect();
        assert_eq!(classes, vec![1, 0, 0, 0, 0]);
        assert_eq!(chunks.last().unwrap().len_bytes, 100);
        let end = chunks.last().map(|c| c.offset + c.len_bytes).unwrap();
        assert_eq!(end, 65536 + 3 * 4096 + 100);
    }

    #[test]
    fn take_is_all_or_nothing() {
        let pool = pool();
        let mut lists = FreeLists::new(&pool);
        let (mut chunks, mut slots) = (Vec::new(), Vec::new());
        pool.plan(3 * 65536, &mut chunks);
        let short = lists.take(&chunks, &mut slots).unwrap_err();
        assert_eq!(
            short,
            Shortfall {
                class: 1,
                needed: 3,
                free: 2
            }
        );
        assert_eq!(lists.free_bytes(), pool.capacity_bytes());
        pool.plan(65536 + 4096, &mut chunks);
        lists.take(&chunks, &mut slots).unwrap();
        assert_eq!(lists.bytes_of(&slots), 65536 + 4096);
        lists.give_back(&slots);
        assert_eq!(lists.free_bytes(), pool.capacity_bytes());
    }
}
