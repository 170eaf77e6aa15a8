//! Sums across ranks in rank order, the one way every backend adds: the
//! result starts at zero and adds rank 0's part, then rank 1's, and so on,
//! so that a sum is the same bits whatever the backend, the timing or the
//! order the parts arrived in. 16-bit floats are summed in fp32 and
//! rounded once. Nothing is allocated.

use half::{bf16, f16};
use strata_device::{Dtype, ViewMut};

use crate::error::{CommError, Result};

/// Elements of 16-bit sums kept in fp32 at once (on the stack).
const NARROW_CHUNK: usize = 256;

/// How a backend hands the sum a rank's part: `part(rank, from, len, add)`
/// calls `add` with the bytes of elements `from..from + len` of `rank`'s
/// part (aligned for the dtype).
pub(crate) type Parts<'a> = dyn Fn(usize, usize, usize, &mut dyn FnMut(&[u8])) + 'a;

/// `Dtype` unless `dtype` is one the sums carry (floats), refused before
/// anything is exchanged.
pub(crate) fn summable(op: &'static str, dtype: Dtype) -> Result<()> {
    match dtype {
        Dtype::U32 => Err(CommError::Dtype {
            op,
            dtype,
            why: "integers are gathered, not summed",
        }),
        _ => Ok(()),
    }
}

/// Writes into `out` (a host view) the sum of `world` ranks' parts of its
/// length, in rank order.
pub(crate) fn sum_in_rank_order(
    op: &'static str,
    world: usize,
    out: &mut ViewMut<'_>,
    part: &Parts<'_>,
) -> Result<()> {
    let dtype = out.dtype();
    match dtype {
        Dtype::F32 => {
            let out = out.host::<f32>().expect("checked host");
            out.fill(0.0);
            for rank in 0..world {
                part(rank, 0, out.len(), &mut |bytes| {
                    let values: &[f32] = bytemuck::cast_slice(bytes);
                    for (s, v) in out.iter_mut().zip(values) {
                        *s += v;
                    }
                });
            }
        }
        Dtype::Bf16 => sum_narrow::<bf16>(world, out.host::<bf16>().expect("checked host"), part),
        Dtype::F16 => sum_narrow::<f16>(world, out.host::<f16>().expect("checked host"), part),
        Dtype::U32 => return summable(op, dtype),
    }
    Ok(())
}

/// Sums 16-bit floats in fp32, in rank order, rounding once at the end,
/// [`NARROW_CHUNK`] elements at a time.
fn sum_narrow<T: bytemuck::Pod + Into<f32> + HalfFrom>(
    world: usize,
    out: &mut [T],
    part: &Parts<'_>,
) {
    let mut sums = [0.0f32; NARROW_CHUNK];
    for (c, chunk) in out.chunks_mut(NARROW_CHUNK).enumerate() {
        let sums = &mut sums[..chunk.len()];
        sums.fill(0.0);
        for rank in 0..world {
            part(rank, c * NARROW_CHUNK, chunk.len(), &mut |bytes| {
                let values: &[T] = bytemuck::cast_slice(bytes);
                for (sum, v) in sums.iter_mut().zip(values) {
                    *sum += (*v).into();
                }
            });
        }
        for (o, sum) in chunk.iter_mut().zip(sums.iter()) {
            *o = T::from_f32_rne(*sum);
        }
    }
}

/// Rounding from fp32, as `half` does it.
trait HalfFrom {
    fn from_f32_rne(value: f32) -> Self;
}
impl HalfFrom for bf16 {
    fn from_f32_rne(value: f32) -> Self {
        bf16::from_f32(value)
    }
}
impl HalfFrom for f16 {
    fn from_f32_rne(value: f32) -> Self {
        f16::from_f32(value)
    }
}
