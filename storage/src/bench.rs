//! Measuring the drive through strata's own engines: one point of a sweep
//! (`strata bench nvme`), and the swap store against the raw engine
//! (`strata bench swap`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::buffer::AlignedBuf;
use crate::config::StorageConfig;
use crate::engine::{self, EngineKind};
use crate::error::{Op, Result, StorageError};
use crate::file::IoFile;
use crate::queue::{Completion, IoQueue, Request};
use crate::size::ByteSize;
use crate::store::SwapStore;

/// One configuration to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PointSpec {
    /// Direction.
    pub op: Op,
    /// Engine.
    pub engine: EngineKind,
    /// Bytes per request.
    pub block_bytes: u64,
    /// Requests in flight per ring.
    pub queue_depth: usize,
    /// Rings (threads), each over its own slice of the file.
    pub rings: usize,
}

/// What one point measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PointResult {
    /// The configuration.
    pub spec: PointSpec,
    /// Bytes moved.
    pub bytes: u64,
    /// Bytes per second.
    pub bw_bytes: f64,
    /// Requests per second.
    pub iops: f64,
    /// Median request latency.
    pub latency_ns_p50: u64,
    /// 99th-percentile request latency.
    pub latency_ns_p99: u64,
}

/// A test file opened for direct I/O, laid out with real data so reads hit
/// the drive (ext4 answers reads of unwritten extents with zeros, at memory
/// speed) and writes overwrite allocated blocks.
pub struct TestFile {
    io: IoFile,
    size_bytes: u64,
}

impl TestFile {
    /// Creates or reuses `dir/strata-bench.dat` of `size_bytes`. Refuses a
    /// filesystem in RAM or without O_DIRECT: it would report memory speed.
    pub fn prepare(dir: &Path, size_bytes: u64) -> Result<Self> {
        refuse_memory_filesystem(dir)?;
        let path = dir.join("strata-bench.dat");
        let existing = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let available = crate::sys::available_bytes(dir).map_err(|cause| StorageError::Os {
            what: "statvfs",
            path: dir.to_path_buf(),
            cause,
        })?;
        if size_bytes > existing && size_bytes - existing > available {
            return Err(StorageError::NoSpace {
                path: dir.to_path_buf(),
                needed_bytes: size_bytes - existing,
                available_bytes: available,
            });
        }
        let io = require_direct(IoFile::open(&path, true)?)?;
        if !size_bytes.is_multiple_of(io.align_bytes) {
            return Err(StorageError::Misaligned {
                what: "size",
                value: size_bytes,
                align_bytes: io.align_bytes,
            });
        }
        let file = Self { io, size_bytes };
        if existing != size_bytes || !layout_marker(&path).exists() {
            let _ = std::fs::remove_file(layout_marker(&path));
            file.io.file.set_len(0).map_err(|cause| StorageError::Os {
                what: "truncate",
                path: path.clone(),
                cause,
            })?;
            crate::sys::fallocate(&file.io.file, size_bytes).map_err(|cause| StorageError::Os {
                what: "fallocate",
                path: path.clone(),
                cause,
            })?;
            let engine = if engine::probe_uring().is_ok() {
                EngineKind::Uring
            } else {
                EngineKind::Threads
            };
            let layout = PointSpec {
                op: Op::Write,
                engine,
                block_bytes: 1 << 20,
                queue_depth: 16,
                rings: 1,
            };
            file.run(layout, &mut |_| {})?;
            std::fs::write(layout_marker(&path), b"").map_err(|cause| StorageError::Os {
                what: "write",
                path: layout_marker(&path),
                cause,
            })?;
        }
        Ok(file)
    }

    /// Opens an existing file that already holds `size_bytes` (a swap file),
    /// without laying it out or ever deleting it.
    pub fn over(path: &Path, size_bytes: u64) -> Result<Self> {
        let io = require_direct(IoFile::open(path, false)?)?;
        Ok(Self { io, size_bytes })
    }

    /// Path of the test file.
    pub fn path(&self) -> &Path {
        &self.io.path
    }

    /// Direct-I/O alignment of the file.
    pub fn align_bytes(&self) -> u64 {
        self.io.align_bytes
    }

    /// Deletes the test file.
    pub fn remove(self) -> Result<()> {
        let path = self.io.path.clone();
        drop(self);
        let _ = std::fs::remove_file(layout_marker(&path));
        std::fs::remove_file(&path).map_err(|cause| StorageError::Os {
            what: "remove",
            path,
            cause,
        })
    }

    /// Measures one point over the whole file, each ring cycling through its
    /// own pool of `queue_depth` buffers (as fio does); `progress` gets bytes
    /// as they move.
    pub fn run(&self, spec: PointSpec, progress: &mut dyn FnMut(u64)) -> Result<PointResult> {
        self.run_with(spec, None, progress)
    }

    /// Measures one point moving the whole file to or from `memory` (file
    /// offset i <-> memory offset i): the raw engine doing exactly what a
    /// tensor transfer does, with no pool in between.
    pub fn run_over(
        &self,
        spec: PointSpec,
        memory: &mut AlignedBuf,
        progress: &mut dyn FnMut(u64),
    ) -> Result<PointResult> {
        assert!(
            memory.len() as u64 >= self.size_bytes,
            "memory smaller than the file"
        );
        self.run_with(
            spec,
            Some(SendPtr(memory.as_mut_ptr(), memory.len())),
            progress,
        )
    }

    fn run_with(
        &self,
        spec: PointSpec,
        memory: Option<SendPtr>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<PointResult> {
        if !spec.block_bytes.is_multiple_of(self.io.align_bytes) {
            return Err(StorageError::Misaligned {
                what: "block size",
                value: spec.block_bytes,
                align_bytes: self.io.align_bytes,
            });
        }
        if spec.block_bytes > crate::config::BLOCK_BYTES_MAX || spec.block_bytes > self.size_bytes {
            return Err(StorageError::Config {
                key: "block_size",
                value: ByteSize(spec.block_bytes).to_string(),
                fix: format!(
                    "use at most {} and at most the test size",
                    ByteSize(crate::config::BLOCK_BYTES_MAX)
                ),
            });
        }
        let slice_bytes =
            (self.size_bytes / spec.rings as u64) / self.io.align_bytes * self.io.align_bytes;
        // Rings set up (buffers, registration) before the barrier; only the
        // transfers are timed, from the first ring's start to the last one's end.
        let barrier = std::sync::Barrier::new(spec.rings);
        let outcomes: Vec<Result<RingOutcome>> = std::thread::scope(|scope| {
            let (sender, receiver) = std::sync::mpsc::channel::<u64>();
            let handles: Vec<_> = (0..spec.rings)
                .map(|ring| {
                    let (sender, barrier) = (sender.clone(), &barrier);
                    let range = (ring as u64 * slice_bytes, slice_bytes);
                    scope.spawn(move || self.run_ring(spec, range, memory, barrier, &sender))
                })
                .collect();
            drop(sender);
            for bytes in receiver {
                progress(bytes);
            }
            handles
                .into_iter()
                .map(|h| h.join().expect("bench ring panicked"))
                .collect()
        });
        let mut bytes = 0;
        let mut latencies = Vec::new();
        let (mut first_start, mut last_end) = (None::<Instant>, None::<Instant>);
        for outcome in outcomes {
            let mut ring = outcome?;
            bytes += ring.bytes;
            latencies.append(&mut ring.latencies_ns);
            first_start = Some(first_start.map_or(ring.started, |t| t.min(ring.started)));
            last_end = Some(last_end.map_or(ring.ended, |t| t.max(ring.ended)));
        }
        let seconds = match (first_start, last_end) {
            (Some(start), Some(end)) => (end - start).as_secs_f64().max(1e-9),
            _ => unreachable!("at least one ring ran"),
        };
        latencies.sort_unstable();
        Ok(PointResult {
            spec,
            bytes,
            bw_bytes: bytes as f64 / seconds,
            iops: latencies.len() as f64 / seconds,
            latency_ns_p50: percentile(&latencies, 0.50),
            latency_ns_p99: percentile(&latencies, 0.99),
        })
    }

    /// One ring over `[offset, offset+len)`: keeps `queue_depth` requests in
    /// flight, sequentially, from registered buffers.
    fn run_ring(
        &self,
        spec: PointSpec,
        (base, len): (u64, u64),
        memory: Option<SendPtr>,
        barrier: &std::sync::Barrier,
        progress: &std::sync::mpsc::Sender<u64>,
    ) -> Result<RingOutcome> {
        // Every ring reaches the barrier, even one whose setup failed.
        let setup = self.ring_setup(spec, memory);
        barrier.wait();
        // The pool comes first in the tuple, so it drops after the queue (and
        // after its drain).
        let (_pool, slots, mut queue) = setup?;
        let requests = len.div_ceil(spec.block_bytes);
        let mut latencies = Vec::with_capacity(requests as usize);
        let mut free: Vec<usize> = (0..spec.queue_depth).collect();
        let mut done: Vec<Completion> = Vec::with_capacity(spec.queue_depth);
        let (mut next, mut moved, mut reported) = (0u64, 0u64, 0u64);
        let started = Instant::now();
        while next < requests || queue.in_flight() > 0 {
            while next < requests && queue.has_room() {
                let slot = free.pop().expect("a free buffer per free slot");
                let offset = next * spec.block_bytes;
                let bytes = spec.block_bytes.min(len - offset) as u32;
                let ptr = match memory {
                    // SAFETY: base + offset + bytes <= file size <= memory length.
                    Some(SendPtr(start, _)) => unsafe { start.add((base + offset) as usize) },
                    None => slots[slot],
                };
                let request = Request {
                    op: spec.op,
                    file: 0,
                    offset: base + offset,
                    ptr,
                    len: bytes,
                    tag: slot as u64,
                };
                // SAFETY: buffer `slot` is ours alone until its completion returns.
                unsafe { queue.push(request) };
                next += 1;
            }
            queue.submit_and_wait(1, &mut done);
            for completion in done.drain(..) {
                completion.result?;
                free.push(completion.tag as usize);
                latencies.push(completion.latency_ns);
                moved += spec.block_bytes;
            }
            if moved - reported >= 64 << 20 {
                let _ = progress.send(moved - reported);
                reported = moved;
            }
        }
        let ended = Instant::now();
        let moved = moved.min(len);
        let _ = progress.send(moved.saturating_sub(reported));
        Ok(RingOutcome {
            bytes: moved,
            latencies_ns: latencies,
            started,
            ended,
        })
    }
}

type RingSetup = (Option<AlignedBuf>, Vec<*mut u8>, IoQueue);

/// Memory shared by the ring threads of one `run_over`: start and length.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8, usize);

// SAFETY: each ring touches only its own disjoint slice of the memory, and
// `run_over` holds the only `&mut` to it until every ring has finished.
unsafe impl Send for SendPtr {}

impl TestFile {
    /// Buffers (locked, registered) and a queue for one bench ring.
    fn ring_setup(&self, spec: PointSpec, memory: Option<SendPtr>) -> Result<RingSetup> {
        let block = spec.block_bytes as usize;
        let engine =
            engine::build(spec.engine, &[self.io.fd()], spec.queue_depth).map_err(|cause| {
                StorageError::Os {
                    what: "starting the engine for",
                    path: self.io.path.clone(),
                    cause,
                }
            })?;
        let mut queue = IoQueue::new(
            engine,
            vec![self.io.path.clone()],
            crate::queue::RETRIES_MAX_DEFAULT,
        );
        if let Some(SendPtr(start, len)) = memory {
            // `run_over` borrows the memory mutably until every ring thread (and so
            // every queue, drained on drop) has finished.
            // SAFETY: the registered memory outlives every request on the queue.
            unsafe { queue.register_buffers(&[(start, len)]) };
            return Ok((None, Vec::new(), queue));
        }
        // One contiguous, locked, registered region carved into a buffer per
        // slot, as a pinned pool would be.
        let mut pool = AlignedBuf::new_locked(
            block * spec.queue_depth,
            self.io.align_bytes.max(4096) as usize,
        )?;
        fill_random(&mut pool, spec.queue_depth as u64);
        let base = pool.as_mut_ptr();
        let slots: Vec<*mut u8> = (0..spec.queue_depth)
            // SAFETY: slot i's buffer lies inside the pool (i < queue_depth).
            .map(|i| unsafe { base.add(i * block) })
            .collect();
        // The pool comes first in the returned tuple, so it drops last.
        // SAFETY: the caller keeps the pool alive longer than the queue.
        unsafe { queue.register_buffers(&[(base, pool.len())]) };
        Ok((Some(pool), slots, queue))
    }
}

struct RingOutcome {
    bytes: u64,
    latencies_ns: Vec<u64>,
    started: Instant,
    ended: Instant,
}

/// Checks that `dir` exists, is writable and is not in RAM, where "drive
/// speed" would be memory speed.
fn refuse_memory_filesystem(dir: &Path) -> Result<()> {
    crate::file::check_dir_writable(dir)?;
    let ram = crate::sys::is_memory_filesystem(dir).map_err(|cause| StorageError::Os {
        what: "statfs",
        path: dir.to_path_buf(),
        cause,
    })?;
    if ram {
        return Err(StorageError::Config {
            key: "dir",
            value: dir.display().to_string(),
            fix: "it is on tmpfs/ramfs (RAM), so the result would be memory speed: pass a directory on the drive to measure".into(),
        });
    }
    Ok(())
}

/// Refuses a file without O_DIRECT: its reads would come from the page cache.
fn require_direct(io: IoFile) -> Result<IoFile> {
    if io.direct {
        return Ok(io);
    }
    Err(StorageError::Config {
        key: "dir",
        value: io.path.display().to_string(),
        fix: "its filesystem refuses O_DIRECT, so reads would come from the page cache: pass a directory on a filesystem that supports direct I/O".into(),
    })
}

/// Fills a buffer with seeded pseudo-random bytes. Patterned data would let a
/// compressing or deduplicating layer under the drive (a VM host, a SAN)
/// report speeds that real tensors never see; fio scrambles its buffers for
/// the same reason.
pub fn fill_random(buf: &mut [u8], seed: u64) {
    let mut rng = crate::engine::SplitMix64(seed);
    for chunk in buf.chunks_mut(8) {
        chunk.copy_from_slice(&rng.next_u64().to_le_bytes()[..chunk.len()]);
    }
}

fn layout_marker(path: &Path) -> PathBuf {
    path.with_extension("dat.laidout")
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// One round of the swap-store comparison.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SwapRound {
    /// Raw engine write, bytes/s.
    pub raw_write_bw_bytes: f64,
    /// Raw engine read, bytes/s.
    pub raw_read_bw_bytes: f64,
    /// Swap store write (checksums computed), bytes/s.
    pub store_write_bw_bytes: f64,
    /// Swap store read (checksums verified), bytes/s.
    pub store_read_bw_bytes: f64,
}

/// Writes and reads one `size_bytes` tensor through the swap store, and the
/// same tensor memory to the same blocks of the same swap file through the
/// raw engine, `rounds` times.
/// Each read follows its own side's write; which side goes first alternates,
/// so drive and host caches treat both alike.
pub fn swap_vs_raw(
    config: &StorageConfig,
    size_bytes: u64,
    rounds: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<SwapRound>> {
    if config.dirs.len() != 1 {
        return Err(StorageError::Config {
            key: "dirs",
            value: config.dirs.len().to_string(),
            fix: "the swap bench measures one directory".into(),
        });
    }
    let dir = &config.dirs[0];
    refuse_memory_filesystem(dir)?;
    let engine = config.engine.resolve()?;
    let store = SwapStore::open(&StorageConfig {
        capacity: ByteSize(size_bytes),
        ..config.clone()
    })?;
    let extent = store.allocate(size_bytes)?;
    assert_eq!(
        store.logical_offset(&extent),
        0,
        "the first extent of a fresh store starts at 0"
    );
    let raw = TestFile::over(&store.paths()[0], size_bytes)?;
    let mut tensor =
        AlignedBuf::new_locked(size_bytes as usize, store.align_bytes().max(4096) as usize)?;
    fill_random(&mut tensor, 0x5717_a7a5);
    let spec = |op| PointSpec {
        op,
        engine,
        block_bytes: config.block_size.0,
        queue_depth: config.queue_depth,
        rings: config.rings,
    };
    let raw_round = |tensor: &mut AlignedBuf| -> Result<(f64, f64)> {
        let write = raw.run_over(spec(Op::Write), tensor, &mut |_| {})?.bw_bytes;
        Ok((
            write,
            raw.run_over(spec(Op::Read), tensor, &mut |_| {})?.bw_bytes,
        ))
    };
    let store_round = |tensor: &mut AlignedBuf| -> Result<(f64, f64)> {
        let started = Instant::now();
        store.write(&extent, tensor)?;
        let write = size_bytes as f64 / started.elapsed().as_secs_f64();
        let started = Instant::now();
        store.read(&extent, tensor)?;
        Ok((write, size_bytes as f64 / started.elapsed().as_secs_f64()))
    };
    let mut rounds_out = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let ((raw_write, raw_read), (store_write, store_read)) = if round % 2 == 0 {
            let raw = raw_round(&mut tensor)?;
            (raw, store_round(&mut tensor)?)
        } else {
            let store = store_round(&mut tensor)?;
            (raw_round(&mut tensor)?, store)
        };
        rounds_out.push(SwapRound {
            raw_write_bw_bytes: raw_write,
            raw_read_bw_bytes: raw_read,
            store_write_bw_bytes: store_write,
            store_read_bw_bytes: store_read,
        });
        progress(round + 1);
    }
    drop(raw);
    Ok(rounds_out)
}
