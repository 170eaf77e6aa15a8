//! The measurement behind `strata bench tiers`: each path through the
//! runtime next to the raw path in the same run. host<->nvme is compared
//! with the storage engine moving the same bytes between one contiguous
//! buffer and the same blocks of the same swap file; host<->device with one
//! memcpy in the calling thread on the CPU device, or one cudaMemcpyAsync
//! from pinned memory on a GPU. Runtime and raw alternate which goes first.

use std::time::Instant;

use strata_storage::bench::{PointSpec, TestFile, fill_random};
use strata_storage::{ByteSize, Op, PAGE_BYTES, StorageConfig, round_up};

use crate::config::{ClassConfig, DeviceConfig, HostConfig, RuntimeConfig};
use crate::device::Direction;
use crate::error::{Result, RuntimeError};
use crate::residency::Runtime;
use crate::state::Access;
use crate::tier::{Dtype, Link, TensorKind, TensorMeta, Tier};

/// Buffer size of the pool's large class in the bench.
const LARGE_BUFFER_BYTES: u64 = 16 << 20;

/// One round: bytes/s of each link through the runtime and raw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TiersRound {
    /// Through the runtime, per link in [`Link::ALL`] order.
    pub runtime_bytes_per_s: [f64; 4],
    /// The raw path, per link.
    pub raw_bytes_per_s: [f64; 4],
}

/// What the bench runs on.
#[derive(Clone, Debug)]
pub struct TiersSpec {
    /// The NVMe tier's settings (one directory).
    pub nvme: StorageConfig,
    /// The device (its budget is set from `size_bytes`).
    pub device: DeviceConfig,
    /// Bytes of the tensor moved.
    pub size_bytes: u64,
    /// Rounds.
    pub rounds: usize,
}

/// The runtime config the bench builds: a pool of 16 MiB buffers holding
/// the tensor (plus 64 KiB buffers for a remainder), a device arena and a
/// swap store just large enough.
pub fn bench_config(spec: &TiersSpec) -> RuntimeConfig {
    let large_bytes = round_up(spec.size_bytes, LARGE_BUFFER_BYTES);
    RuntimeConfig {
        device: DeviceConfig {
            budget: ByteSize(round_up(spec.size_bytes, 1 << 20)),
            ..spec.device.clone()
        },
        host: HostConfig {
            classes: vec![
                ClassConfig {
                    buffer_size: ByteSize(64 << 10),
                    bytes: ByteSize(LARGE_BUFFER_BYTES),
                },
                ClassConfig {
                    buffer_size: ByteSize(LARGE_BUFFER_BYTES),
                    bytes: ByteSize(large_bytes),
                },
            ],
            ..Default::default()
        },
        nvme: Some(StorageConfig {
            capacity: ByteSize(large_bytes + LARGE_BUFFER_BYTES),
            ..spec.nvme.clone()
        }),
        ..Default::default()
    }
}

/// Runs the comparison; `progress` gets the rounds done. Returns the device
/// it ran on, described, and the rounds.
pub fn tiers_vs_raw(
    spec: &TiersSpec,
    progress: &mut dyn FnMut(usize),
) -> Result<(String, Vec<TiersRound>)> {
    if spec.nvme.dirs.len() != 1 {
        return Err(RuntimeError::Config {
            key: "nvme.dirs",
            value: spec.nvme.dirs.len().to_string(),
            fix: "the tiers bench measures one directory".into(),
        });
    }
    if spec.size_bytes == 0 || !spec.size_bytes.is_multiple_of(PAGE_BYTES as u64) {
        return Err(RuntimeError::Config {
            key: "size",
            value: spec.size_bytes.to_string(),
            fix: "use a non-zero multiple of 4 KiB".into(),
        });
    }
    let runtime = Runtime::new(&bench_config(spec))?;
    let store = runtime.store().expect("bench config has an nvme tier");
    let meta = TensorMeta::new(
        "bench",
        TensorKind::Param,
        Dtype::F32,
        &[spec.size_bytes / 4],
    );
    let id = runtime.register(meta, Tier::Host)?;
    {
        let mut guard = runtime.acquire(id, Tier::Host, Access::Write)?;
        guard.for_each_chunk_mut(&mut |offset, bytes| fill_random(bytes, 0x5717_a7a5 ^ offset))?;
    }
    let mut raw_buffer = runtime
        .device()
        .alloc_host(spec.size_bytes as usize, &crate::device::commit_here)?;
    fill_random(&mut raw_buffer, 0x1234_5678);
    let raw_file = TestFile::over(&store.paths()[0], spec.size_bytes)?;
    let engine = spec.nvme.engine.resolve()?;
    let point = |op| PointSpec {
        op,
        engine,
        block_bytes: spec.nvme.block_size.0,
        queue_depth: spec.nvme.queue_depth,
        rings: spec.nvme.rings,
    };
    let mut rounds = Vec::with_capacity(spec.rounds);
    for round in 0..spec.rounds {
        let mut runtime_bw = [0.0; 4];
        let mut raw_bw = [0.0; 4];
        let mut run_runtime = || -> Result<()> {
            let mut timed = |link: Link, target: Tier| -> Result<()> {
                let started = Instant::now();
                runtime.move_to(id, target)?.wait()?;
                // A move to the device completes when its copy is enqueued:
                // timed until the bytes have landed.
                runtime.acquire(id, target, Access::Read)?.ready().wait()?;
                runtime_bw[link.index()] = rate(spec.size_bytes, started);
                Ok(())
            };
            timed(Link::HostToNvme, Tier::Nvme)?;
            timed(Link::NvmeToHost, Tier::Host)?;
            runtime.release(id, Tier::Nvme)?;
            timed(Link::HostToDevice, Tier::Device)?;
            runtime.release(id, Tier::Host)?;
            timed(Link::DeviceToHost, Tier::Host)
        };
        let mut run_raw = || -> Result<()> {
            // The tensor is on the host only now: the swap blocks and the
            // arena are free for the raw paths.
            raw_bw[Link::HostToNvme.index()] = raw_file
                .run_over(point(Op::Write), &mut raw_buffer, &mut |_| {})?
                .bw_bytes;
            raw_bw[Link::NvmeToHost.index()] = raw_file
                .run_over(point(Op::Read), &mut raw_buffer, &mut |_| {})?
                .bw_bytes;
            for (link, direction) in [
                (Link::HostToDevice, Direction::ToDevice),
                (Link::DeviceToHost, Direction::ToHost),
            ] {
                let started = Instant::now();
                // Between rounds the runtime holds no device copy, so the arena
                // range is the bench's alone.
                // SAFETY: the raw buffer outlives this synchronous copy.
                unsafe {
                    runtime.device().raw_copy(
                        direction,
                        raw_buffer.as_mut_ptr(),
                        0,
                        spec.size_bytes as usize,
                    )?
                };
                raw_bw[link.index()] = rate(spec.size_bytes, started);
            }
            Ok(())
        };
        if round % 2 == 0 {
            run_runtime()?;
            run_raw()?;
        } else {
            run_raw()?;
            run_runtime()?;
        }
        rounds.push(TiersRound {
            runtime_bytes_per_s: runtime_bw,
            raw_bytes_per_s: raw_bw,
        });
        progress(round + 1);
    }
    drop(raw_file);
    Ok((runtime.device().describe(), rounds))
}

fn rate(bytes: u64, started: Instant) -> f64 {
    bytes as f64 / started.elapsed().as_secs_f64()
}
