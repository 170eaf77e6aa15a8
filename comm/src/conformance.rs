//! One conformance suite for every backend: each rank of a group calls
//! [`check`] with its member, and every operation is run on values each
//! rank can compute for every other (f32, bf16 and u32; odd sizes, one
//! element up to past a chunk of 16-bit sums), the results compared bit
//! for bit with sums in rank order (16-bit floats summed in fp32, rounded
//! once), and shapes and limits refused by name. Ranks as threads run it in
//! the unit tests; under `mpirun`, the MPI backend's tests.

use half::bf16;
use strata_device::{View, ViewMut};

use crate::{Collective, CommError};

/// Sizes (elements per rank's shard) every operation runs at.
pub const SIZES: [usize; 4] = [1, 7, 300, 1031];

/// Rank `rank`'s element `i` of an operand: fractions whose sums round, so
/// that a sum in another order shows.
pub fn value(rank: usize, i: usize) -> f32 {
    ((rank + 1) as f32 * 0.1) + (i % 97) as f32 * 1.0e-3 + (i as f32) / 7.0
}

/// The sum over `world` ranks of element `i`, in rank order from zero.
fn sum_f32(world: usize, i: usize) -> f32 {
    (0..world).fold(0.0f32, |s, r| s + value(r, i))
}

/// The bf16 sum over `world` ranks of element `i`: each rank's value in
/// bf16, summed in fp32 in rank order, rounded once.
fn sum_bf16(world: usize, i: usize) -> bf16 {
    bf16::from_f32((0..world).fold(0.0f32, |s, r| s + bf16::from_f32(value(r, i)).to_f32()))
}

/// A failure as the suite reports it.
fn fail(what: String) -> String {
    format!("conformance: {what}")
}

/// Runs every operation on `c` (every rank of its group calls it at once,
/// each with its own member) with `elems_max`, the backend's limit on one
/// exchange. The first result that differs, or an error, is returned with
/// what was being checked.
pub fn check(c: &dyn Collective, elems_max: usize) -> Result<(), String> {
    let (rank, world) = (c.rank(), c.world());
    let err = |what: &str, e: CommError| fail(format!("rank {rank} of {world}, {what}: {e}"));
    for n in SIZES {
        if n * world > elems_max {
            continue;
        }
        let what = |op: &str| format!("{op} of {n} elements a rank");
        // all_gather, f32 and u32.
        let shard: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
        let mut out = vec![0f32; n * world];
        c.all_gather(View::host_slice(&shard), ViewMut::host_slice(&mut out))
            .and_then(|f| Ok(f.wait()?))
            .map_err(|e| err(&what("all_gather f32"), e))?;
        for (k, v) in out.iter().enumerate() {
            let want = value(k / n, k % n);
            if v.to_bits() != want.to_bits() {
                return Err(fail(format!(
                    "rank {rank}: {}: element {k} is {v}, want {want}",
                    what("all_gather f32")
                )));
            }
        }
        let ids: Vec<u32> = (0..n).map(|i| (rank * 1_000_003 + i) as u32).collect();
        let mut all = vec![0u32; n * world];
        c.all_gather(View::host_slice(&ids), ViewMut::host_slice(&mut all))
            .and_then(|f| Ok(f.wait()?))
            .map_err(|e| err(&what("all_gather u32"), e))?;
        if all
            .iter()
            .enumerate()
            .any(|(k, &v)| v != ((k / n) * 1_000_003 + k % n) as u32)
        {
            return Err(fail(format!(
                "rank {rank}: {} differs",
                what("all_gather u32")
            )));
        }
        // reduce_scatter, f32 and bf16: this rank's part of the sum.
        let full: Vec<f32> = (0..n * world).map(|i| value(rank, i)).collect();
        let mut part = vec![0f32; n];
        c.reduce_scatter(View::host_slice(&full), ViewMut::host_slice(&mut part))
            .and_then(|f| Ok(f.wait()?))
            .map_err(|e| err(&what("reduce_scatter f32"), e))?;
        for (i, v) in part.iter().enumerate() {
            let want = sum_f32(world, rank * n + i);
            if v.to_bits() != want.to_bits() {
                return Err(fail(format!(
                    "rank {rank}: {}: element {i} is {v}, want {want} (rank order)",
                    what("reduce_scatter f32")
                )));
            }
        }
        let full16: Vec<bf16> = full.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut part16 = vec![bf16::ZERO; n];
        c.reduce_scatter(View::host_slice(&full16), ViewMut::host_slice(&mut part16))
            .and_then(|f| Ok(f.wait()?))
            .map_err(|e| err(&what("reduce_scatter bf16"), e))?;
        for (i, v) in part16.iter().enumerate() {
            let want = sum_bf16(world, rank * n + i);
            if v.to_bits() != want.to_bits() {
                return Err(fail(format!(
                    "rank {rank}: {}: element {i} is {v}, want {want} (fp32 sums, rounded once)",
                    what("reduce_scatter bf16")
                )));
            }
        }
        // all_reduce, f32 and bf16, of a length no rank count divides.
        let len = n * world + 1;
        if len <= elems_max {
            let mut values: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
            c.all_reduce(ViewMut::host_slice(&mut values))
                .and_then(|f| Ok(f.wait()?))
                .map_err(|e| err(&what("all_reduce f32"), e))?;
            for (i, v) in values.iter().enumerate() {
                let want = sum_f32(world, i);
                if v.to_bits() != want.to_bits() {
                    return Err(fail(format!(
                        "rank {rank}: {}: element {i} is {v}, want {want}",
                        what("all_reduce f32")
                    )));
                }
            }
            let mut values: Vec<bf16> = (0..len).map(|i| bf16::from_f32(value(rank, i))).collect();
            c.all_reduce(ViewMut::host_slice(&mut values))
                .and_then(|f| Ok(f.wait()?))
                .map_err(|e| err(&what("all_reduce bf16"), e))?;
            for (i, v) in values.iter().enumerate() {
                let want = sum_bf16(world, i);
                if v.to_bits() != want.to_bits() {
                    return Err(fail(format!(
                        "rank {rank}: {}: element {i} is {v}, want {want}",
                        what("all_reduce bf16")
                    )));
                }
            }
        }
        // broadcast from every root.
        for root in 0..world {
            let mut values: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
            c.broadcast(root, ViewMut::host_slice(&mut values))
                .and_then(|f| Ok(f.wait()?))
                .map_err(|e| err(&what(&format!("broadcast from {root}")), e))?;
            if values
                .iter()
                .enumerate()
                .any(|(i, v)| v.to_bits() != value(root, i).to_bits())
            {
                return Err(fail(format!(
                    "rank {rank}: {} differs",
                    what(&format!("broadcast from {root}"))
                )));
            }
        }
        // send and receive around a ring.
        if world > 1 {
            let (next, before) = ((rank + 1) % world, (rank + world - 1) % world);
            let values: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
            let mut got = vec![0f32; n];
            // Even ranks send first, odd ones receive first: no cycle of
            // sends waiting for receives.
            let mut ring = || -> crate::Result<()> {
                if rank % 2 == 0 {
                    c.send(next, View::host_slice(&values))?.wait()?;
                    c.recv(before, ViewMut::host_slice(&mut got))?.wait()?;
                } else {
                    let mut held = vec![0f32; n];
                    c.recv(before, ViewMut::host_slice(&mut held))?.wait()?;
                    c.send(next, View::host_slice(&values))?.wait()?;
                    got = held;
                }
                Ok(())
            };
            ring().map_err(|e| err(&what("send and recv"), e))?;
            if got
                .iter()
                .enumerate()
                .any(|(i, v)| v.to_bits() != value(before, i).to_bits())
            {
                return Err(fail(format!("rank {rank}: {} differs", what("recv"))));
            }
        }
    }
    // Scalars.
    let mut scalars: Vec<f64> = (0..5).map(|i| (rank * 10 + i) as f64 / 3.0).collect();
    c.all_reduce_scalars(&mut scalars)
        .map_err(|e| err("all_reduce_scalars", e))?;
    for (i, v) in scalars.iter().enumerate() {
        let want = (0..world).fold(0.0f64, |s, r| s + (r * 10 + i) as f64 / 3.0);
        if v.to_bits() != want.to_bits() {
            return Err(fail(format!(
                "rank {rank}: all_reduce_scalars element {i} is {v}, want {want}"
            )));
        }
    }
    // Refused by name before anything moves (every rank refuses alike).
    let shard = [0f32; 3];
    let mut wrong = vec![0f32; 3 * world + 1];
    match c.all_gather(View::host_slice(&shard), ViewMut::host_slice(&mut wrong)) {
        Err(CommError::Shape { .. }) => {}
        other => {
            return Err(fail(format!(
                "rank {rank}: an all_gather output of the wrong size gave {other:?}"
            )));
        }
    }
    let mut big = vec![0f32; elems_max + 1];
    match c.all_reduce(ViewMut::host_slice(&mut big)) {
        Err(CommError::Limit { .. }) => {}
        other => {
            return Err(fail(format!(
                "rank {rank}: an exchange above elems_max gave {other:?}"
            )));
        }
    }
    let mut ids = [0u32; 4];
    match c.all_reduce(ViewMut::host_slice(&mut ids)) {
        Err(CommError::Dtype { .. }) => {}
        other => {
            return Err(fail(format!(
                "rank {rank}: a sum of integers gave {other:?}"
            )));
        }
    }
    Ok(())
}

/// [`check`] on subgroups split from `c` (every rank calls it at once):
/// blocks of two neighbouring ranks (as hybrid sharding's shard groups)
/// and the ranks of one parity (its replica groups), then the whole group
/// again; a split without this rank is refused by name.
pub fn check_splits(c: &dyn Collective, elems_max: usize) -> Result<(), String> {
    let (rank, world) = (c.rank(), c.world());
    let block: Vec<usize> = (rank / 2 * 2..(rank / 2 * 2 + 2).min(world)).collect();
    let parity: Vec<usize> = (rank % 2..world).step_by(2).collect();
    for (what, members) in [("block", &block), ("parity", &parity)] {
        let sub = c.split(members).map_err(|e| {
            fail(format!(
                "rank {rank} of {world}: split {what} {members:?}: {e}"
            ))
        })?;
        if sub.world() != members.len() || members[sub.rank()] != rank {
            return Err(fail(format!(
                "rank {rank}: the {what} subgroup {members:?} says rank {} of {}",
                sub.rank(),
                sub.world()
            )));
        }
        check(&*sub, elems_max)
            .map_err(|e| format!("rank {rank} of {world}, {what} subgroup {members:?}: {e}"))?;
    }
    check(c, elems_max)?;
    let without: Vec<usize> = (0..world).filter(|&r| r != rank).collect();
    match c.split(&without) {
        Err(CommError::Split { .. }) => Ok(()),
        other => Err(fail(format!(
            "rank {rank}: a split without this rank gave {:?}",
            other.map(|_| ())
        ))),
    }
}
