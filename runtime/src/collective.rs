//! Collectives between data-parallel ranks: the [`Collective`] trait (NCCL
//! will implement it), and [`InProcess`], ranks as threads of one process.
//! Sums run in rank order, so results are the same bits whatever the
//! threads' timing.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::RuntimeError;

/// What ZeRO-3 needs from a data-parallel group.
pub trait Collective: Send + Sync {
    /// This rank, `0..world()`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Every rank's `shard` (all the same length), concatenated in rank
    /// order into `out` (`world() * shard.len()`).
    fn all_gather(&self, shard: &[f32], out: &mut [f32]) -> Result<(), RuntimeError>;
    /// Sums `full` (the same length on every rank, `world() * shard.len()`)
    /// across ranks and leaves this rank's part of the sum in `shard`.
    fn reduce_scatter(&self, full: &[f32], shard: &mut [f32]) -> Result<(), RuntimeError>;
    /// Sums `values` across ranks, in place (norms, overflow counts).
    fn all_reduce(&self, values: &mut [f64]) -> Result<(), RuntimeError>;
}

struct Shared {
    gate: Gate,
    slots: Vec<Mutex<Vec<f32>>>,
    scalars: Vec<Mutex<Vec<f64>>>,
    elems_max: usize,
}

/// A barrier that a rank can leave: the ranks waiting at it, or arriving
/// later, get [`RuntimeError::PeerLeft`] instead of waiting forever for a
/// rank that failed or stopped.
struct Gate {
    state: Mutex<GateState>,
    turned: Condvar,
    world: usize,
}

struct GateState {
    arrived: usize,
    generation: u64,
    left: Option<usize>,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        // Nothing panics while holding it.
        self.state.lock().expect("collective gate")
    }

    fn wait(&self) -> Result<(), RuntimeError> {
        let mut state = self.lock();
        if let Some(rank) = state.left {
            return Err(RuntimeError::PeerLeft { rank });
        }
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived == self.world {
            state.arrived = 0;
            state.generation += 1;
            self.turned.notify_all();
            return Ok(());
        }
        // Passed once the last rank arrives, even if one leaves after.
        while state.generation == generation {
            if let Some(rank) = state.left {
                return Err(RuntimeError::PeerLeft { rank });
            }
            state = self.turned.wait(state).expect("collective gate");
        }
        Ok(())
    }

    fn leave(&self, rank: usize) {
        self.lock().left.get_or_insert(rank);
        self.turned.notify_all();
    }
}

/// One rank of an in-process group; [`InProcess::group`] makes them all.
/// Dropping it (the rank returned, failed or panicked) fails the others'
/// collectives from then on rather than leaving them waiting.
pub struct InProcess {
    rank: usize,
    shared: Arc<Shared>,
}

/// Scalars one [`Collective::all_reduce`] may carry.
pub const SCALARS_MAX: usize = 64;

impl InProcess {
    /// A group of `world` ranks exchanging at most `elems_max` floats per
    /// rank and call; buffers are allocated here, once.
    pub fn group(world: usize, elems_max: usize) -> Vec<InProcess> {
        assert!(world > 0, "a group needs a rank");
        let shared = Arc::new(Shared {
            gate: Gate {
                state: Mutex::new(GateState {
                    arrived: 0,
                    generation: 0,
                    left: None,
                }),
                turned: Condvar::new(),
                world,
            },
            slots: (0..world)
                .map(|_| Mutex::new(Vec::with_capacity(elems_max)))
                .collect(),
            scalars: (0..world)
                .map(|_| Mutex::new(Vec::with_capacity(SCALARS_MAX)))
                .collect(),
            elems_max,
        });
        (0..world)
            .map(|rank| InProcess {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    fn check(&self, elems: usize) -> Result<(), RuntimeError> {
        if elems > self.shared.elems_max {
            return Err(RuntimeError::Limit {
                what: "collective_elems_max",
                max: self.shared.elems_max as u64,
            });
        }
        Ok(())
    }

    fn post(&self, data: &[f32]) {
        let mut slot = self.shared.slots[self.rank]
            .lock()
            .expect("collective slot");
        slot.clear();
        slot.extend_from_slice(data);
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.shared.gate.leave(self.rank);
    }
}

impl Collective for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.slots.len()
    }

    fn all_gather(&self, shard: &[f32], out: &mut [f32]) -> Result<(), RuntimeError> {
        assert_eq!(out.len(), shard.len() * self.world(), "all_gather output");
        self.check(shard.len())?;
        self.post(shard);
        self.shared.gate.wait()?;
        for (slot, part) in self
            .shared
            .slots
            .iter()
            .zip(out.chunks_exact_mut(shard.len().max(1)))
        {
            let slot = slot.lock().expect("collective slot");
            assert_eq!(slot.len(), shard.len(), "ranks disagree on the shard size");
            part.copy_from_slice(&slot);
        }
        self.shared.gate.wait()?;
        Ok(())
    }

    fn reduce_scatter(&self, full: &[f32], shard: &mut [f32]) -> Result<(), RuntimeError> {
        assert_eq!(
            full.len(),
            shard.len() * self.world(),
            "reduce_scatter input"
        );
        self.check(full.len())?;
        self.post(full);
        self.shared.gate.wait()?;
        let (start, len) = (self.rank * shard.len(), shard.len());
        shard.fill(0.0);
        for slot in &self.shared.slots {
            let slot = slot.lock().expect("collective slot");
            assert_eq!(slot.len(), full.len(), "ranks disagree on the size");
            for (s, v) in shard.iter_mut().zip(&slot[start..start + len]) {
                *s += v;
            }
        }
        self.shared.gate.wait()?;
        Ok(())
    }

    fn all_reduce(&self, values: &mut [f64]) -> Result<(), RuntimeError> {
        if values.len() > SCALARS_MAX {
            return Err(RuntimeError::Limit {
                what: "collective scalars (SCALARS_MAX)",
                max: SCALARS_MAX as u64,
            });
        }
        {
            let mut slot = self.shared.scalars[self.rank]
                .lock()
                .expect("collective slot");
            slot.clear();
            slot.extend_from_slice(values);
        }
        self.shared.gate.wait()?;
        values.fill(0.0);
        for slot in &self.shared.scalars {
            let slot = slot.lock().expect("collective slot");
            for (v, s) in values.iter_mut().zip(slot.iter()) {
                *v += s;
            }
        }
        self.shared.gate.wait()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send>(world: usize, f: impl Fn(&InProcess) -> T + Sync) -> Vec<T> {
        let ranks = InProcess::group(world, 64);
        std::thread::scope(|scope| {
            let handles: Vec<_> = ranks.iter().map(|r| scope.spawn(|| f(r))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn gather_concatenates_in_rank_order() {
        for out in run(3, |c| {
            let shard = [c.rank() as f32; 2];
            let mut out = [0.0; 6];
            c.all_gather(&shard, &mut out).unwrap();
            out
        }) {
            assert_eq!(out, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
        }
    }

    #[test]
    fn reduce_scatter_sums_each_part_in_rank_order() {
        let shards = run(2, |c| {
            let full: Vec<f32> = (0..4).map(|i| (i + 10 * c.rank()) as f32).collect();
            let mut shard = [0.0; 2];
            c.reduce_scatter(&full, &mut shard).unwrap();
            shard
        });
        assert_eq!(shards, vec![[10.0, 12.0], [14.0, 16.0]]);
        // Repeated calls reuse the buffers and give the same bits.
        let again = run(4, |c| {
            let full: Vec<f32> = (0..8).map(|i| 0.1 * (i + c.rank()) as f32).collect();
            let mut sums = Vec::new();
            for _ in 0..50 {
                let mut shard = [0.0; 2];
                c.reduce_scatter(&full, &mut shard).unwrap();
                let mut norm = [f64::from(shard[0]), 1.0];
                c.all_reduce(&mut norm).unwrap();
                sums.push((shard, norm));
            }
            sums
        });
        for rank in &again {
            assert!(rank.iter().all(|s| s == &rank[0]));
            assert_eq!(rank[0].1[1], 4.0);
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_collectives_instead_of_hanging() {
        let mut ranks = InProcess::group(3, 64);
        let gone = ranks.pop().expect("three ranks");
        let errors = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|c| {
                    scope.spawn(move || {
                        let mut values = [1.0];
                        // Both survivors pass one exchange with the third...
                        c.all_reduce(&mut values)?;
                        // ...which leaves while they wait at the next.
                        c.all_reduce(&mut values).map(|_| values[0])
                    })
                })
                .collect();
            let mut values = [1.0];
            gone.all_reduce(&mut values).unwrap();
            assert_eq!(values[0], 3.0);
            drop(gone);
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap_err().to_string())
                .collect::<Vec<_>>()
        });
        for err in errors {
            assert!(err.contains("rank 2") && err.contains("left"), "{err}");
        }
    }

    #[test]
    fn oversized_exchanges_name_the_limit() {
        let errors = run(1, |c| {
            let mut out = vec![0.0; 65];
            c.all_gather(&[0.0; 65], &mut out).unwrap_err().to_string()
        });
        assert!(errors[0].contains("collective_elems_max"), "{}", errors[0]);
    }
}
