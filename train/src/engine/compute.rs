//! The workspace: compute buffers on the backend's device, one block's
//! worth held for the run, and the streams between blocks of each
//! micro-batch in flight; and the work done on them for one op of the
//! step: all-gather a group's shards, the model's forward or backward,
//! reduce-scatter the gradient. It knows no tensor's place: the step loop
//! hands it the runtime tensors to read and write.

use std::time::Instant;

use strata_device::{Buffer, Dtype, View};
use strata_kernels::{Backend, Readback, no_position_ids};
use strata_runtime::TensorId;

use crate::error::{Result, TrainError};
use crate::model::{Buffers, Model, OUTER, Weights};

use super::access::{with_device_view, write_from_view};
use super::data::split_tokens;
use super::env::Env;
use super::tensors::Group;

/// The first `n` gathered parameters as the model reads them: f32, and the
/// bf16 copy for the matrix products when there is one (bf16 compute).
fn weights<'a>(gathered: &'a Buffer, gathered16: &'a Buffer, n: usize) -> Weights<'a> {
    let f32 = gathered.view().range(0..n);
    match gathered16.dtype() {
        Dtype::F32 => f32.into(),
        _ => Weights {
            f32,
            compute: gathered16.view().range(0..n),
        },
    }
}

/// Compute buffers on the backend's device: one block's worth, held for
/// the whole run, and the streams between blocks of each micro-batch in
/// flight at once.
pub(super) struct Workspace {
    /// A group's parameters, gathered whole (f32 holding bf16's values).
    gathered: Buffer,
    /// This rank's shard of a group, between the collectives and the
    /// tensors (more than one rank only).
    shard32: Buffer,
    grad_full: Buffer,
    /// One block's and the head's buffers, the model's to cut.
    buffers: Buffers,
    y: Buffer,
    dx: Buffer,
    /// The step's token ids of one micro-batch, cut on the host before
    /// their upload.
    inputs_host: Vec<u32>,
    targets_host: Vec<u32>,
    position_ids_host: Vec<u32>,
    /// Per micro-batch of the step (all are in flight at once): the forward
    /// stream, the backward stream, the input and target tokens.
    streams: Vec<Stream>,
    /// The outer group's gradient, summed over the step's micro-batches
    /// (the heads' and the embeddings' backward) and reduced once, after
    /// the last.
    dembed: Buffer,
    /// With bf16 compute, the gathered parameters again in bf16 (what the
    /// matrix products read); an empty f32 buffer with f32 compute.
    gathered16: Buffer,
    /// With f32 compute and several shards: the bf16 shards as gathered,
    /// before they are widened into `gathered`.
    staged16: Buffer,
    /// Which group's shard tensor the gathered buffers hold, while nothing
    /// can have written it since: the op's next micro-batches read it
    /// again without another gather (every rank skips alike).
    holds: Option<(usize, TensorId)>,
}

/// One micro-batch's buffers between ops.
struct Stream {
    x: Buffer,
    dy: Buffer,
    inputs: Buffer,
    targets: Buffer,
    /// The tokens' places in their documents, when documents start inside
    /// its sequences (`packed`); else unread.
    position_ids: Buffer,
    packed: bool,
}

/// The position ids the model reads of a stream's `position_ids`: the
/// uploaded ones when `packed`.
fn ids(position_ids: &Buffer, packed: bool) -> View<'_> {
    match packed {
        true => position_ids.view(),
        false => no_position_ids(),
    }
}

impl Workspace {
    pub(super) fn new(
        backend: &dyn Backend,
        model: &dyn Model,
        batch: usize,
        groups: &[Group],
        world: usize,
        in_flight: usize,
        dtype: Dtype,
    ) -> Result<Self> {
        let shard_max = groups.iter().map(|g| g.shard).max().expect("groups");
        let padded_max = shard_max * world;
        let embed_padded = groups[OUTER].padded(world);
        let tokens = batch * model.seq();
        let stream = tokens * model.stream_width();
        let f32s = |len| backend.alloc(Dtype::F32, len);
        let acts = |len| backend.alloc(dtype, len);
        let streams = (0..in_flight)
            .map(|_| -> Result<Stream> {
                Ok(Stream {
                    x: acts(stream)?,
                    dy: acts(stream)?,
                    inputs: backend.alloc(Dtype::U32, tokens)?,
                    targets: backend.alloc(Dtype::U32, tokens)?,
                    position_ids: backend.alloc(Dtype::U32, tokens)?,
                    packed: false,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Workspace {
            gathered: f32s(padded_max)?,
            shard32: f32s(if world > 1 { shard_max } else { 0 })?,
            grad_full: f32s(padded_max)?,
            buffers: model.buffers(backend, batch, dtype)?,
            y: acts(stream)?,
            dx: acts(stream)?,
            inputs_host: vec![0; tokens],
            targets_host: vec![0; tokens],
            position_ids_host: vec![0; tokens],
            streams,
            dembed: f32s(embed_padded)?,
            gathered16: match dtype {
                Dtype::F32 => f32s(0)?,
                _ => acts(padded_max)?,
            },
            staged16: backend.alloc(
                Dtype::Bf16,
                match (dtype, world) {
                    (Dtype::F32, 2..) => padded_max,
                    _ => 0,
                },
            )?,
            holds: None,
        })
    }

    /// Forgets which group the gathered buffers hold (at a step's or an
    /// evaluation's start: the shards may have been written since).
    pub(super) fn forget_gathered(&mut self) {
        self.holds = None;
    }

    /// Bytes of every buffer on the device.
    pub(super) fn bytes(&self) -> u64 {
        let streams: u64 = self
            .streams
            .iter()
            .map(|s| {
                s.x.bytes()
                    + s.dy.bytes()
                    + s.inputs.bytes()
                    + s.targets.bytes()
                    + s.position_ids.bytes()
            })
            .sum();
        [
            &self.dembed,
            &self.gathered16,
            &self.staged16,
            &self.gathered,
            &self.shard32,
            &self.grad_full,
            &self.y,
            &self.dx,
        ]
        .iter()
        .map(|b| b.bytes())
        .sum::<u64>()
            + streams
            + self.buffers.bytes()
    }

    /// One block's and the head's buffers.
    pub(super) fn buffers(&self) -> &Buffers {
        &self.buffers
    }

    /// One block's forward of the first micro-batch's stream on whatever
    /// the workspace holds (a timing probe: the values do not matter).
    pub(super) fn probe_block_forward(
        &mut self,
        backend: &dyn Backend,
        model: &dyn Model,
        batch: usize,
        block_params: usize,
    ) -> Result<()> {
        model.block_forward(
            backend,
            batch,
            no_position_ids(),
            weights(&self.gathered, &self.gathered16, block_params),
            self.streams[0].x.view(),
            &mut self.buffers,
            self.y.view_mut(),
        )
    }

    /// The embeddings' forward of micro-batch `m`: its tokens cut from the
    /// step's, uploaded, looked up in the gathered outer group.
    pub(super) fn embed_forward(&mut self, env: &Env, m: usize, tokens: &[u32]) -> Result<()> {
        let (backend, model) = (env.backend(), env.model());
        let packed = split_tokens(
            tokens,
            m,
            env.config().train.micro_batch,
            model.seq(),
            (
                &mut self.inputs_host,
                &mut self.targets_host,
                &mut self.position_ids_host,
            ),
        );
        let stream = &mut self.streams[m];
        backend.upload(
            View::host_slice(&self.inputs_host),
            stream.inputs.view_mut(),
        )?;
        backend.upload(
            View::host_slice(&self.targets_host),
            stream.targets.view_mut(),
        )?;
        stream.packed = packed;
        if packed {
            backend.upload(
                View::host_slice(&self.position_ids_host),
                stream.position_ids.view_mut(),
            )?;
        }
        model.embed_forward(
            backend,
            self.gathered.view().range(0..env.groups()[OUTER].params),
            stream.inputs.view(),
            ids(&stream.position_ids, stream.packed),
            stream.x.view_mut(),
        )
    }

    /// Block `b`'s forward of micro-batch `m` with its gathered parameters.
    pub(super) fn block_forward(&mut self, env: &Env, m: usize, b: usize) -> Result<()> {
        let stream = &mut self.streams[m];
        env.model().block_forward(
            env.backend(),
            env.config().train.micro_batch,
            ids(&stream.position_ids, stream.packed),
            weights(&self.gathered, &self.gathered16, env.groups()[b + 1].params),
            stream.x.view(),
            &mut self.buffers,
            self.y.view_mut(),
        )?;
        std::mem::swap(&mut stream.x, &mut self.y);
        Ok(())
    }

    /// Writes what the last block forward keeps for its backward (its
    /// input when the block `recomputes`, else all its activations) into
    /// the tensor `id`.
    pub(super) fn save(&self, env: &Env, id: TensorId, recomputes: bool) -> Result<()> {
        let saved = if recomputes {
            self.buffers.input()
        } else {
            self.buffers.kept()
        };
        write_from_view(env.runtime(), env.backend(), id, saved, saved.dtype())
    }

    /// The head's forward and backward of micro-batch `m`, the gradients
    /// scaled by `scale` (the first zeroes the outer group's gradient the
    /// step's micro-batches sum); its loss, to read later.
    pub(super) fn head(&mut self, env: &Env, m: usize, scale: f32) -> Result<Readback> {
        let (backend, outer_params) = (env.backend(), env.groups()[OUTER].params);
        if m == 0 {
            backend.zero(self.dembed.view_mut())?;
        }
        let stream = &mut self.streams[m];
        env.model().head_forward_backward(
            backend,
            weights(&self.gathered, &self.gathered16, outer_params),
            stream.x.view(),
            stream.targets.view(),
            scale,
            &mut self.buffers,
            stream.dy.view_mut(),
            self.dembed.view_mut().range(0..outer_params),
        )
    }

    /// Block `b`'s backward of micro-batch `m` from what its forward kept
    /// in the tensor `saved` (its input, recomputed from, when it
    /// `recomputes`), adding to the gradient the step's micro-batches sum.
    pub(super) fn block_backward(
        &mut self,
        env: &Env,
        m: usize,
        b: usize,
        saved: TensorId,
        recomputes: bool,
    ) -> Result<()> {
        let (backend, model) = (env.backend(), env.model());
        let batch = env.config().train.micro_batch;
        let group = &env.groups()[b + 1];
        let params = weights(&self.gathered, &self.gathered16, group.params);
        let dtype = self.buffers.dtype();
        let (buffers, y) = (&mut self.buffers, &mut self.y);
        let position_ids = ids(&self.streams[m].position_ids, self.streams[m].packed);
        if recomputes {
            // The recompute reads the kept input where it lies.
            with_device_view(env.runtime(), backend, saved, dtype, |input| {
                model.block_forward(
                    backend,
                    batch,
                    position_ids,
                    params,
                    input,
                    buffers,
                    y.view_mut(),
                )
            })?;
        } else {
            // Copied straight back into the block's activations.
            with_device_view(env.runtime(), backend, saved, dtype, |kept| {
                Ok(backend.copy(kept, buffers.kept_mut())?)
            })?;
        }
        // The block's gradient is summed over the step's micro-batches
        // (they run one after another here) and leaves after the last.
        if m == 0 {
            let padded = group.padded(env.shards());
            backend.zero(self.grad_full.view_mut().range(0..padded))?;
        }
        let stream = &mut self.streams[m];
        model.block_backward(
            backend,
            batch,
            ids(&stream.position_ids, stream.packed),
            params,
            stream.dy.view(),
            &mut self.buffers,
            self.dx.view_mut(),
            self.grad_full.view_mut().range(0..group.params),
        )?;
        std::mem::swap(&mut self.dx, &mut stream.dy);
        Ok(())
    }

    /// The embeddings' backward of micro-batch `m`, into the outer group's
    /// gradient.
    pub(super) fn embed_backward(&mut self, env: &Env, m: usize) -> Result<()> {
        let outer_params = env.groups()[OUTER].params;
        let stream = &self.streams[m];
        env.model().embed_backward(
            env.backend(),
            stream.inputs.view(),
            ids(&stream.position_ids, stream.packed),
            stream.dy.view(),
            self.dembed.view_mut().range(0..outer_params),
        )
    }

    /// All-gathers group `g`'s bf16 shards, the tensor `shard`, into the
    /// workspace (as f32: the values are bf16's), and with bf16 compute
    /// into the bf16 copy the products read. One rank widens its device
    /// copy straight into the gathered buffer: with bf16 compute only what
    /// the model reads in f32 (a block's vectors; tables that are looked
    /// up), the rest copied as it is. A group the buffers still hold (the
    /// same op's earlier micro-batch gathered it) is not gathered again:
    /// once per block and pass, not once per micro-batch.
    pub(super) fn gather(&mut self, env: &Env, g: usize, shard: TensorId) -> Result<()> {
        if self.holds == Some((g, shard)) {
            return Ok(());
        }
        // Set once the buffers hold it whole: a failed gather leaves none.
        self.holds = None;
        self.gather_anew(env, g, shard)?;
        self.holds = Some((g, shard));
        Ok(())
    }

    /// [`Workspace::gather`] whatever the buffers hold.
    fn gather_anew(&mut self, env: &Env, g: usize, shard: TensorId) -> Result<()> {
        let (backend, runtime, collective) = (env.backend(), env.runtime(), env.shard_group());
        let group = &env.groups()[g];
        let n = group.shard;
        let padded = group.padded(env.shards());
        let bf16 = self.gathered16.dtype() == Dtype::Bf16;
        if env.shards() == 1 {
            let (gathered, gathered16) = (&mut self.gathered, &mut self.gathered16);
            return with_device_view(runtime, backend, shard, Dtype::Bf16, |shard| {
                if !bf16 {
                    backend.cast(shard, gathered.view_mut().range(0..n))?;
                } else {
                    for range in &group.reads_f32 {
                        let target = gathered.view_mut().range(range.clone());
                        backend.cast(shard.range(range.clone()), target)?;
                    }
                }
                if bf16 {
                    backend.copy(shard, gathered16.view_mut().range(0..n))?;
                }
                Ok(())
            });
        }
        // Gathered as they are kept, in bf16 (half the bytes of f32),
        // then widened where the model reads f32: the values are bf16's,
        // so the bits are those of a gather in f32.
        let staged = match bf16 {
            true => &mut self.gathered16,
            false => &mut self.staged16,
        };
        let hybrid = env.replicas().is_some();
        let started = Instant::now();
        with_device_view(runtime, backend, shard, Dtype::Bf16, |shard| {
            collective
                .all_gather(shard, staged.view_mut().range(0..padded))
                .and_then(|fence| Ok(fence.wait()?))
                .map_err(|e| TrainError::of_group(e, "shard", hybrid))?;
            Ok(())
        })?;
        runtime.record_collective("all-gather", g as u32, padded as u64 * 2, started);
        match bf16 {
            true => {
                for range in &group.reads_f32 {
                    let target = self.gathered.view_mut().range(range.clone());
                    backend.cast(self.gathered16.view().range(range.clone()), target)?;
                }
            }
            false => backend.cast(
                self.staged16.view().range(0..padded),
                self.gathered.view_mut().range(0..padded),
            )?,
        }
        Ok(())
    }

    /// Reduce-scatters group `g`'s full gradient, summed in the workspace
    /// over the step's micro-batches, into its shard's tensor `id` (in
    /// `dtype`); returns the shard's sum of squares, to read later.
    pub(super) fn reduce_gradient(
        &mut self,
        env: &Env,
        g: usize,
        id: TensorId,
        dtype: Dtype,
    ) -> Result<Readback> {
        let (backend, collective) = (env.backend(), env.shard_group());
        let group = &env.groups()[g];
        let n = group.shard;
        let padded = group.padded(env.shards());
        let full = if g == OUTER {
            &mut self.dembed
        } else {
            &mut self.grad_full
        };
        // Summed over the shard group, then (hybrid sharding) over the
        // replicas holding the same shard.
        let hybrid = env.replicas().is_some();
        let runtime = env.runtime();
        let across = |values: strata_device::ViewMut<'_>| -> Result<()> {
            if let Some(replicas) = env.replicas() {
                let (started, bytes) = (Instant::now(), values.len() as u64 * 4);
                replicas
                    .all_reduce(values)
                    .and_then(|fence| Ok(fence.wait()?))
                    .map_err(|e| TrainError::of_group(e, "replica", true))?;
                runtime.record_collective("all-reduce (replicas)", g as u32, bytes, started);
            }
            Ok(())
        };
        let shard = if env.shards() == 1 {
            across(full.view_mut().range(0..n))?;
            full.view().range(0..n)
        } else {
            let started = Instant::now();
            collective
                .reduce_scatter(
                    full.view().range(0..padded),
                    self.shard32.view_mut().range(0..n),
                )
                .and_then(|fence| Ok(fence.wait()?))
                .map_err(|e| TrainError::of_group(e, "shard", hybrid))?;
            runtime.record_collective("reduce-scatter", g as u32, padded as u64 * 4, started);
            across(self.shard32.view_mut().range(0..n))?;
            self.shard32.view().range(0..n)
        };
        // The norm of the f32 sum; the tensor keeps it in the gradients'
        // dtype (bf16 with bf16 compute: half the bytes to the optimizer).
        let norm = backend.sum_squares(shard)?;
        write_from_view(env.runtime(), backend, id, shard, dtype)?;
        Ok(norm)
    }
}

#[cfg(test)]
mod tests {
    use strata_kernels::IGNORE_TARGET;

    use super::super::data::{DOCUMENT_START, NOT_A_TARGET};
    use super::*;

    /// A micro-batch's inputs are the ids under the marks, its targets
    /// the next tokens but the marked ones, its position ids restart at
    /// each document start (and it says so).
    #[test]
    fn split_tokens_reads_ids_targets_and_positions_through_the_marks() {
        let (seq, batch) = (4, 2);
        let s = DOCUMENT_START;
        let tokens = [
            // Micro-batch 0: a plain sequence, and one with a prompt.
            1,
            2,
            3,
            4,
            5,
            6,
            7 | NOT_A_TARGET,
            8,
            9,
            10,
            // Micro-batch 1: a document starting inside the window.
            11,
            12,
            13 | s | NOT_A_TARGET,
            14,
            15,
            16,
            17,
            18 | s,
            19,
            20,
        ];
        let (mut inputs, mut targets, mut ids) = ([0; 8], [0; 8], [0; 8]);
        let packed = split_tokens(
            &tokens,
            0,
            batch,
            seq,
            (&mut inputs, &mut targets, &mut ids),
        );
        assert!(!packed);
        assert_eq!(inputs, [1, 2, 3, 4, 6, 7, 8, 9]);
        let x = IGNORE_TARGET;
        assert_eq!(targets, [2, 3, 4, 5, x, 8, 9, 10]);
        let packed = split_tokens(
            &tokens,
            1,
            batch,
            seq,
            (&mut inputs, &mut targets, &mut ids),
        );
        assert!(packed);
        assert_eq!(inputs, [11, 12, 13, 14, 16, 17, 18, 19]);
        assert_eq!(targets, [12, x, 14, 15, 17, x, 19, 20]);
        assert_eq!(ids, [0, 1, 0, 1, 0, 1, 0, 1]);
    }
}
