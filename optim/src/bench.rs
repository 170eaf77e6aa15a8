//! The kernels `strata bench adam` and the criterion bench measure, on
//! buffers allocated once per size, and the interleaved timing loop they
//! share. Each kernel has a byte count per parameter (what it must read and
//! write), so params/s turns into bytes/s and can be set against
//! `roofline_4r3w`, which streams Adam's 4-read/3-write fp32 pattern with
//! no arithmetic to speak of.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use half::{bf16, f16};

use crate::{
    AdagradConfig, AdamCoefficients, AdamConfig, LionConfig, LowPrecisionMut, Master, Moments,
    MomentsRef, OptimError, OutOfPlaceShard, Pool, Rounding, Values,
};

/// The stretch [`BenchKernel::EngineStepBf16`] walks its buffers in: a
/// 256 KiB host chunk of fp32 (the training engine's default host buffer).
/// The engine's stretches are at most this long and uneven (also cut where
/// a state set's m and v begin, and at the bf16 copy's chunks), so the
/// bench is the rate the engine's walk can reach, not below it.
pub const ENGINE_STRETCH_ELEMS: usize = 64 << 10;

/// A benchmarked kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BenchKernel {
    /// AdamW, fp32 gradients and moments (what DeepSpeed's CPUAdam and
    /// PyTorch's fused AdamW do).
    AdamwFp32,
    /// AdamW, fp32, on idle parameters: zero gradients, m zero and v
    /// subnormal (1e-39), as for an embedding row whose token has not been
    /// seen for tens of thousands of steps (rounding to nearest never
    /// takes it to zero). Libraries that keep subnormal moments take
    /// microcode assists on every step there; strata reads them as zero,
    /// so after the warm-up's first step its moments are zero: this is its
    /// steady state.
    AdamwFp32Idle,
    /// The fused offload step: bf16 gradients x (unscale x clip), AdamW on
    /// fp32 master weights and moments, bf16 params out.
    OffloadStepBf16,
    /// The same with fp16 gradients and fp16 params out.
    OffloadStepFp16,
    /// The offload step with bf16 moments as well.
    OffloadStepBf16Moments,
    /// The offload step with bf16 moments rounded stochastically (state
    /// dtype (a): fp32 master, bf16 moments).
    OffloadStepBf16MomentsSr,
    /// AdamW on bf16 masters and moments, all rounded stochastically, bf16
    /// gradients in (state dtype (b); the masters are the 16-bit copy).
    OffloadStepBf16Master,
    /// The offload step as the training engine runs it: out of place from
    /// one fp32 state set into the other (alternating each step, states
    /// streamed past the caches), bf16 gradients in, bf16 params out, the
    /// buffers walked in host chunks ([`ENGINE_STRETCH_ELEMS`]) handed to
    /// the pool in one call.
    EngineStepBf16,
    /// [`BenchKernel::EngineStepBf16`] with state dtype (b): bf16 masters
    /// and moments, rounded stochastically, from one bf16 state set into
    /// the other; the bf16 copy is the masters' bits.
    EngineStepBf16Master,
    /// Adam with L2 weight decay, fp32.
    AdamL2Fp32,
    /// Adagrad, fp32.
    AdagradFp32,
    /// Lion, fp32.
    LionFp32,
    /// The global-norm + overflow pass over bf16 gradients.
    GradNormBf16,
    /// `acc += bf16 gradients` into fp32.
    AccumulateBf16,
    /// Adam's memory traffic with trivial arithmetic: the memory limit.
    Roofline4r3w,
}

impl BenchKernel {
    /// Every kernel, in table order.
    pub const ALL: [BenchKernel; 15] = [
        BenchKernel::AdamwFp32,
        BenchKernel::AdamwFp32Idle,
        BenchKernel::OffloadStepBf16,
        BenchKernel::OffloadStepFp16,
        BenchKernel::OffloadStepBf16Moments,
        BenchKernel::OffloadStepBf16MomentsSr,
        BenchKernel::OffloadStepBf16Master,
        BenchKernel::EngineStepBf16,
        BenchKernel::EngineStepBf16Master,
        BenchKernel::AdamL2Fp32,
        BenchKernel::AdagradFp32,
        BenchKernel::LionFp32,
        BenchKernel::GradNormBf16,
        BenchKernel::AccumulateBf16,
        BenchKernel::Roofline4r3w,
    ];

    /// The name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            BenchKernel::AdamwFp32 => "adamw_fp32",
            BenchKernel::AdamwFp32Idle => "adamw_fp32_idle",
            BenchKernel::OffloadStepBf16 => "offload_step_bf16",
            BenchKernel::OffloadStepFp16 => "offload_step_fp16",
            BenchKernel::OffloadStepBf16Moments => "offload_step_bf16_moments",
            BenchKernel::OffloadStepBf16MomentsSr => "offload_step_bf16_moments_sr",
            BenchKernel::OffloadStepBf16Master => "offload_step_bf16_master",
            BenchKernel::EngineStepBf16 => "engine_step_bf16",
            BenchKernel::EngineStepBf16Master => "engine_step_bf16_master",
            BenchKernel::AdamL2Fp32 => "adam_l2_fp32",
            BenchKernel::AdagradFp32 => "adagrad_fp32",
            BenchKernel::LionFp32 => "lion_fp32",
            BenchKernel::GradNormBf16 => "grad_norm_bf16",
            BenchKernel::AccumulateBf16 => "accumulate_bf16",
            BenchKernel::Roofline4r3w => "roofline_4r3w",
        }
    }

    /// Bytes each parameter must move: reads plus writes, counted once.
    pub fn bytes_per_param(self) -> u64 {
        match self {
            // p, g, m, v read (16); p, m, v written (12).
            BenchKernel::AdamwFp32
            | BenchKernel::AdamwFp32Idle
            | BenchKernel::AdamL2Fp32
            | BenchKernel::Roofline4r3w => 28,
            // p, m, v read (12) + 2-byte grad; p, m, v written + 2-byte out.
            BenchKernel::OffloadStepBf16 | BenchKernel::OffloadStepFp16 => 28,
            // One state set read, the other written (no read for
            // ownership: streamed), gradient in, copy out.
            BenchKernel::EngineStepBf16 => 28,
            // p (4) + g, m, v (2 each) read; p (4) + m, v, out (2 each) written.
            BenchKernel::OffloadStepBf16Moments | BenchKernel::OffloadStepBf16MomentsSr => 20,
            // bf16 master, gradient and moments: 2 + 2 read, 2 x 2 read and
            // written, master written.
            BenchKernel::OffloadStepBf16Master => 14,
            // One bf16 state set read (6), the other written (6), gradient
            // in, copy out.
            BenchKernel::EngineStepBf16Master => 16,
            // p, g, state read; p, state written.
            BenchKernel::AdagradFp32 | BenchKernel::LionFp32 => 20,
            BenchKernel::GradNormBf16 => 2,
            BenchKernel::AccumulateBf16 => 10,
        }
    }
}

impl fmt::Display for BenchKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BenchKernel {
    type Err = String;

    fn from_str(name: &str) -> Result<BenchKernel, String> {
        BenchKernel::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = BenchKernel::ALL.iter().map(|k| k.name()).collect();
                format!("unknown kernel {name:?}; choose from {}", names.join(", "))
            })
    }
}

/// The buffers of [`BenchBuffers`], named so that what each kernel touches
/// is written down once (`buffers`) and both allocation and the memory
/// estimate follow from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Buffer {
    P,
    G,
    M,
    V,
    Sum,
    GBf16,
    GF16,
    MBf16,
    VBf16,
    OutBf16,
    OutF16,
    /// A second set of fp32 params, m and v (out-of-place steps).
    States2,
    /// bf16 masters for the first set (whose moments are `MBf16` and
    /// `VBf16`), and the second set's masters, m and v.
    Bf16States2,
    /// An idle parameter's zero gradient, zero m and subnormal v.
    Idle,
}

impl Buffer {
    fn bytes_per_param(self) -> u64 {
        match self {
            Buffer::States2 | Buffer::Idle => 12,
            Buffer::Bf16States2 => 8,
            Buffer::P | Buffer::G | Buffer::M | Buffer::V | Buffer::Sum => 4,
            _ => 2,
        }
    }
}

/// What `kernel` reads and writes (Lion's momentum shares `M`; Adagrad's
/// sum of squares must stay non-negative, so it has its own).
fn buffers(kernel: BenchKernel) -> &'static [Buffer] {
    use Buffer::*;
    match kernel {
        BenchKernel::AdamwFp32 | BenchKernel::AdamL2Fp32 | BenchKernel::Roofline4r3w => {
            &[P, G, M, V]
        }
        BenchKernel::AdamwFp32Idle => &[P, Idle],
        BenchKernel::OffloadStepBf16 => &[P, GBf16, M, V, OutBf16],
        BenchKernel::OffloadStepFp16 => &[P, GF16, M, V, OutF16],
        BenchKernel::OffloadStepBf16Moments | BenchKernel::OffloadStepBf16MomentsSr => {
            &[P, GBf16, MBf16, VBf16, OutBf16]
        }
        BenchKernel::OffloadStepBf16Master => &[OutBf16, GBf16, MBf16, VBf16],
        BenchKernel::EngineStepBf16 => &[P, GBf16, M, V, States2, OutBf16],
        BenchKernel::EngineStepBf16Master => &[GBf16, MBf16, VBf16, Bf16States2, OutBf16],
        BenchKernel::AdagradFp32 => &[P, G, Sum],
        BenchKernel::LionFp32 => &[P, G, M],
        BenchKernel::GradNormBf16 => &[GBf16],
        BenchKernel::AccumulateBf16 => &[G, GBf16],
    }
}

/// Bytes of buffers `kernels` need together at `params` parameters.
pub fn buffer_bytes(params: usize, kernels: &[BenchKernel]) -> u64 {
    let mut used: Vec<Buffer> = kernels
        .iter()
        .flat_map(|&k| buffers(k).iter().copied())
        .collect();
    used.sort_by_key(|&b| b as u8);
    used.dedup();
    used.iter()
        .map(|b| b.bytes_per_param() * params as u64)
        .sum()
}

/// A buffer whose first element sits on a page boundary, as the runtime's
/// pinned host buffers do (a plain `Vec` starts 16 bytes past one, which
/// splits every 64-byte vector across two cache lines).
#[derive(Default)]
struct PageAligned<T> {
    storage: Vec<T>,
    start: usize,
}

impl<T: Copy + Default> PageAligned<T> {
    const PAGE_BYTES: usize = 4096;

    fn from_fn(n: usize, f: impl Fn(usize) -> T) -> PageAligned<T> {
        let size = std::mem::size_of::<T>();
        let mut storage = Vec::with_capacity(n + Self::PAGE_BYTES / size);
        let address = storage.as_ptr() as usize;
        let start = (address.next_multiple_of(Self::PAGE_BYTES) - address) / size;
        storage.resize(start, T::default());
        storage.extend((0..n).map(f));
        PageAligned { storage, start }
    }

    fn len(&self) -> usize {
        self.storage.len() - self.start
    }

    fn get(&self) -> &[T] {
        &self.storage[self.start..]
    }

    fn get_mut(&mut self) -> &mut [T] {
        &mut self.storage[self.start..]
    }
}

/// Every buffer the kernels touch, for one size; allocated on first use.
#[derive(Default)]
pub struct BenchBuffers {
    params: usize,
    p: PageAligned<f32>,
    g: PageAligned<f32>,
    m: PageAligned<f32>,
    v: PageAligned<f32>,
    /// Adagrad's sum of squares (never negative, so not shared).
    sum: PageAligned<f32>,
    g_bf16: PageAligned<bf16>,
    g_f16: PageAligned<f16>,
    m_bf16: PageAligned<bf16>,
    v_bf16: PageAligned<bf16>,
    out_bf16: PageAligned<bf16>,
    out_f16: PageAligned<f16>,
    /// The second state set: params, m, v.
    states2: [PageAligned<f32>; 3],
    /// bf16 masters of the first set; the second set's masters, m, v.
    bf16_states2: [PageAligned<bf16>; 4],
    /// An idle parameter's gradient, m and v.
    idle: [PageAligned<f32>; 3],
    step: u64,
}

/// One chunk's moments as the step reads them and as it writes them.
type MomentViews<T> =
    for<'a> fn(&'a [T], &'a [T], &'a mut [T], &'a mut [T]) -> (MomentsRef<'a>, Moments<'a>);

/// The engine-shaped step: odd steps read the first state set (params, m,
/// v) and write the second, even steps the other way; the buffers walked
/// in host chunks ([`ENGINE_STRETCH_ELEMS`]) as the engine walks a group's
/// states, in one pool call. `stochastic`: bf16 states rounded so, keyed by
/// each chunk's first element.
fn engine_step<T: Master>(
    pool: &Pool,
    c: &AdamCoefficients,
    step: u64,
    sets: [[&mut PageAligned<T>; 3]; 2],
    (grads, copy): (&[bf16], &mut [bf16]),
    views: MomentViews<T>,
    stochastic: bool,
) {
    let [[p1, m1, v1], [p2, m2, v2]] = sets;
    let ((p_in, m_in, v_in), (p_out, m_out, v_out)) = if step % 2 == 1 {
        ((p1.get(), m1.get(), v1.get()), (p2, m2, v2))
    } else {
        ((p2.get(), m2.get(), v2.get()), (p1, m1, v1))
    };
    let chunk = ENGINE_STRETCH_ELEMS;
    let shards = p_in
        .chunks(chunk)
        .zip(m_in.chunks(chunk).zip(v_in.chunks(chunk)))
        .zip(grads.chunks(chunk))
        .zip(p_out.get_mut().chunks_mut(chunk))
        .zip(m_out.get_mut().chunks_mut(chunk))
        .zip(v_out.get_mut().chunks_mut(chunk))
        .zip(copy.chunks_mut(chunk))
        .enumerate()
        .map(|(k, ((((((p0, (m0, v0)), g), p), m), v), out))| {
            let (moments_in, moments_out) = views(m0, v0, m, v);
            OutOfPlaceShard {
                coefficients: c,
                params_in: p0,
                moments_in,
                grads: Values::Bf16(g),
                params_out: p,
                moments_out,
                out: Some(LowPrecisionMut::Bf16(out)),
                rounding: match stochastic {
                    true => Rounding::Stochastic {
                        seed: 1,
                        step,
                        first: (k * chunk) as u64,
                    },
                    false => Rounding::Nearest,
                },
            }
        })
        .collect();
    pool.adam_step_out_of_place_many(shards);
}

/// A deterministic value in [-1, 1) times `scale` for element `i` (no RNG
/// needed).
fn value(i: usize, salt: u32, scale: f32) -> f32 {
    let h = (i as u32 ^ salt)
        .wrapping_mul(2_654_435_761)
        .rotate_left(13);
    ((h % 20_000) as f32 / 10_000.0 - 1.0) * scale
}

fn ensure<T: Copy + Default>(buffer: &mut PageAligned<T>, n: usize, f: impl Fn(usize) -> T) {
    if buffer.len() != n {
        *buffer = PageAligned::from_fn(n, f);
    }
}

impl BenchBuffers {
    /// Buffers for `params` parameters (nothing allocated yet).
    pub fn new(params: usize) -> BenchBuffers {
        BenchBuffers {
            params,
            ..BenchBuffers::default()
        }
    }

    /// Allocates and fills what `kernel` needs, so its first timed run
    /// does not pay for page faults.
    pub fn prepare(&mut self, kernel: BenchKernel) {
        let n = self.params;
        for &buffer in buffers(kernel) {
            match buffer {
                Buffer::P => ensure(&mut self.p, n, |i| value(i, 1, 1.0)),
                Buffer::G => ensure(&mut self.g, n, |i| value(i, 2, 1e-2)),
                Buffer::M => ensure(&mut self.m, n, |i| value(i, 3, 1e-3).abs()),
                Buffer::V => ensure(&mut self.v, n, |i| value(i, 4, 1e-6).abs()),
                Buffer::Sum => ensure(&mut self.sum, n, |i| value(i, 6, 1e-3).abs()),
                Buffer::GBf16 => ensure(&mut self.g_bf16, n, |i| bf16::from_f32(value(i, 5, 1e2))),
                Buffer::GF16 => ensure(&mut self.g_f16, n, |i| f16::from_f32(value(i, 5, 1e2))),
                Buffer::MBf16 => ensure(&mut self.m_bf16, n, |i| bf16::from_f32(value(i, 3, 1e-3))),
                Buffer::VBf16 => ensure(&mut self.v_bf16, n, |i| {
                    bf16::from_f32(value(i, 4, 1e-6).abs())
                }),
                Buffer::OutBf16 => ensure(&mut self.out_bf16, n, |_| bf16::ZERO),
                Buffer::OutF16 => ensure(&mut self.out_f16, n, |_| f16::ZERO),
                Buffer::States2 => {
                    for (salt, state) in self.states2.iter_mut().enumerate() {
                        ensure(state, n, |i| value(i, 7 + salt as u32, 1e-3).abs());
                    }
                }
                Buffer::Idle => {
                    let [g, m, v] = &mut self.idle;
                    ensure(g, n, |_| 0.0);
                    ensure(m, n, |_| 0.0);
                    ensure(v, n, |_| 1e-39);
                }
                Buffer::Bf16States2 => {
                    for (salt, state) in self.bf16_states2.iter_mut().enumerate() {
                        ensure(state, n, |i| {
                            bf16::from_f32(value(i, 11 + salt as u32, 1e-3).abs())
                        });
                    }
                }
            }
        }
    }

    /// One step of `kernel` over every parameter on `pool`. Offload steps
    /// unscale by 1/1024 as a loss-scaled run would.
    pub fn run(&mut self, kernel: BenchKernel, pool: &Pool) -> Result<(), OptimError> {
        self.prepare(kernel);
        self.step += 1;
        let step = self.step;
        let adamw = AdamConfig::adamw(1e-4);
        match kernel {
            BenchKernel::AdamwFp32 | BenchKernel::AdamL2Fp32 => {
                let config = if kernel == BenchKernel::AdamwFp32 {
                    adamw
                } else {
                    AdamConfig {
                        weight_decay: 0.01,
                        ..AdamConfig::adam(1e-4)
                    }
                };
                let c = config.coefficients(step, 1.0)?;
                pool.adam_step(
                    &c,
                    self.p.get_mut(),
                    Values::F32(self.g.get()),
                    Moments::F32 {
                        m: self.m.get_mut(),
                        v: self.v.get_mut(),
                    },
                    None,
                );
            }
            BenchKernel::AdamwFp32Idle => {
                let c = adamw.coefficients(step, 1.0)?;
                let [g, m, v] = &mut self.idle;
                let moments = Moments::F32 {
                    m: m.get_mut(),
                    v: v.get_mut(),
                };
                pool.adam_step(&c, self.p.get_mut(), Values::F32(g.get()), moments, None);
            }
            BenchKernel::OffloadStepBf16 => {
                let c = adamw.coefficients(step, 1.0 / 1024.0)?;
                let out = Some(LowPrecisionMut::Bf16(self.out_bf16.get_mut()));
                pool.adam_step(
                    &c,
                    self.p.get_mut(),
                    Values::Bf16(self.g_bf16.get()),
                    Moments::F32 {
                        m: self.m.get_mut(),
                        v: self.v.get_mut(),
                    },
                    out,
                );
            }
            BenchKernel::OffloadStepFp16 => {
                let c = adamw.coefficients(step, 1.0 / 1024.0)?;
                let out = Some(LowPrecisionMut::F16(self.out_f16.get_mut()));
                pool.adam_step(
                    &c,
                    self.p.get_mut(),
                    Values::F16(self.g_f16.get()),
                    Moments::F32 {
                        m: self.m.get_mut(),
                        v: self.v.get_mut(),
                    },
                    out,
                );
            }
            BenchKernel::OffloadStepBf16Moments | BenchKernel::OffloadStepBf16MomentsSr => {
                let c = adamw.coefficients(step, 1.0 / 1024.0)?;
                let moments = Moments::Bf16 {
                    m: self.m_bf16.get_mut(),
                    v: self.v_bf16.get_mut(),
                };
                let out = Some(LowPrecisionMut::Bf16(self.out_bf16.get_mut()));
                let rounding = match kernel {
                    BenchKernel::OffloadStepBf16MomentsSr => Rounding::Stochastic {
                        seed: 1,
                        step,
                        first: 0,
                    },
                    _ => Rounding::Nearest,
                };
                pool.adam_step_rounded(
                    &c,
                    self.p.get_mut(),
                    Values::Bf16(self.g_bf16.get()),
                    moments,
                    out,
                    rounding,
                );
            }
            BenchKernel::OffloadStepBf16Master => {
                let c = adamw.coefficients(step, 1.0 / 1024.0)?;
                let moments = Moments::Bf16 {
                    m: self.m_bf16.get_mut(),
                    v: self.v_bf16.get_mut(),
                };
                pool.adam_step_bf16_master(
                    &c,
                    self.out_bf16.get_mut(),
                    Values::Bf16(self.g_bf16.get()),
                    moments,
                    Rounding::Stochastic {
                        seed: 1,
                        step,
                        first: 0,
                    },
                );
            }
            BenchKernel::EngineStepBf16 => {
                let c = adamw.coefficients(step, 1.0 / 1024.0)?;
                let [p2, m2, v2] = &mut self.states2;
                let set1 = [&mut self.p, &mut self.m, &mut self.v];
                let buffers = (self.g_bf16.get(), self.out_bf16.get_mut());
                let views: MomentViews<f32> =
                    |m0, v0, m, v| (MomentsRef::F32 { m: m0, v: v0 }, Moments::F32 { m, v });
                engine_step(pool, &c, step, [set1, [p2, m2, v2]], buffers, views, false);
            }
            BenchKernel::EngineStepBf16Master => {
                let c = adamw.coefficients(step, 1.0 / 1024.0)?;
                let [p1, p2, m2, v2] = &mut self.bf16_states2;
                let set1 = [p1, &mut self.m_bf16, &mut self.v_bf16];
                let buffers = (self.g_bf16.get(), self.out_bf16.get_mut());
                let views: MomentViews<bf16> =
                    |m0, v0, m, v| (MomentsRef::Bf16 { m: m0, v: v0 }, Moments::Bf16 { m, v });
                engine_step(pool, &c, step, [set1, [p2, m2, v2]], buffers, views, true);
            }
            BenchKernel::AdagradFp32 => {
                let c = AdagradConfig::new(1e-4).coefficients(step, 1.0)?;
                pool.adagrad_step(
                    &c,
                    self.p.get_mut(),
                    Values::F32(self.g.get()),
                    self.sum.get_mut(),
                    None,
                );
            }
            BenchKernel::LionFp32 => {
                let c = LionConfig::new(1e-5).coefficients(step, 1.0)?;
                pool.lion_step(
                    &c,
                    self.p.get_mut(),
                    Values::F32(self.g.get()),
                    self.m.get_mut(),
                    None,
                );
            }
            BenchKernel::GradNormBf16 => {
                let norm = pool.grad_norm(&[Values::Bf16(self.g_bf16.get())]);
                std::hint::black_box(norm);
            }
            BenchKernel::AccumulateBf16 => {
                pool.accumulate(self.g.get_mut(), Values::Bf16(self.g_bf16.get()));
            }
            BenchKernel::Roofline4r3w => {
                pool.roofline_4r3w(
                    self.p.get_mut(),
                    self.g.get(),
                    self.m.get_mut(),
                    self.v.get_mut(),
                );
            }
        }
        Ok(())
    }
}

/// One kernel's timings at one size and thread count.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchSample {
    /// The kernel.
    pub kernel: BenchKernel,
    /// Seconds per step, one entry per round (each the mean of its reps).
    pub seconds: Vec<f64>,
}

/// Times `kernels` on `buffers`, interleaved: every round runs each kernel
/// (in an order rotated per round) for at least `round_min` of wall time.
/// Returns one sample per kernel with one entry per round.
pub fn measure(
    pool: &Pool,
    buffers: &mut BenchBuffers,
    kernels: &[BenchKernel],
    rounds: usize,
    round_min: Duration,
    mut progress: impl FnMut(),
) -> Result<Vec<BenchSample>, OptimError> {
    // Warm up (allocation, page faults, caches) and size the repetitions.
    let mut reps = Vec::with_capacity(kernels.len());
    for &kernel in kernels {
        buffers.run(kernel, pool)?;
        let start = Instant::now();
        buffers.run(kernel, pool)?;
        let once = start.elapsed().max(Duration::from_nanos(1));
        reps.push(
            (round_min.as_secs_f64() / once.as_secs_f64())
                .ceil()
                .clamp(1.0, 1e6) as u32,
        );
    }
    let mut samples: Vec<BenchSample> = kernels
        .iter()
        .map(|&kernel| BenchSample {
            kernel,
            seconds: Vec::with_capacity(rounds),
        })
        .collect();
    for round in 0..rounds {
        for offset in 0..kernels.len() {
            let k = (round + offset) % kernels.len();
            let start = Instant::now();
            for _ in 0..reps[k] {
                buffers.run(kernels[k], pool)?;
            }
            samples[k]
                .seconds
                .push(start.elapsed().as_secs_f64() / f64::from(reps[k]));
            progress();
        }
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolConfig;

    #[test]
    fn every_kernel_runs_in_tiny_mode_and_names_round_trip() {
        let pool = Pool::new(PoolConfig {
            threads: Some(2),
            parallel_elems_min: 0,
            ..PoolConfig::default()
        })
        .unwrap();
        let mut buffers = BenchBuffers::new(1000);
        let samples = measure(
            &pool,
            &mut buffers,
            &BenchKernel::ALL,
            2,
            Duration::ZERO,
            || {},
        )
        .unwrap();
        assert_eq!(samples.len(), BenchKernel::ALL.len());
        for sample in &samples {
            assert_eq!(sample.seconds.len(), 2);
            assert!(sample.seconds.iter().all(|&s| s > 0.0));
            assert_eq!(
                sample.kernel.name().parse::<BenchKernel>().unwrap(),
                sample.kernel
            );
        }
        assert!(buffers.p.get().iter().all(|x| x.is_finite()));
        assert!(
            "adam"
                .parse::<BenchKernel>()
                .unwrap_err()
                .contains("adamw_fp32")
        );
    }
}
