//! Compute: the workspace (one block's buffers, held for the run, and
//! each micro-batch's streams between blocks) and one op of the step run
//! on the backend: all-gather a group's shards, the model's forward or
//! backward, reduce-scatter the gradient.

use std::time::Instant;

use strata_device::{Buffer, Dtype, View};
use strata_kernels::{Backend, Readback};

use crate::error::Result;
use crate::model::{Buffers, Model, OUTER, Weights};

use super::moves::{with_device_view, write_from_view};
use strata_scheduler::{StepOp, Work};

use super::optimizer::Update;
use super::steps::label;
use super::tensors::{Group, processor_tier};
use super::tensors::{grad_index, param_index};
use super::{Engine, PER_GROUP};

/// Device scalars that may wait to be read at once (a quarter of the CUDA
/// backend's readback slots).
pub(super) const SCALARS_PENDING_MAX: usize = 16;

/// Where a device scalar goes once read.
#[derive(Clone, Copy, Debug)]
pub(super) enum Scalar {
    /// A micro-batch's mean loss, added to the step's.
    Loss,
    /// Group `g`'s gradient sum of squares.
    Norm(usize),
}

/// Compute buffers on the backend's device: one block's worth, held for
/// the whole run, and the streams between blocks of each micro-batch in
/// flight at once.
pub(super) struct Workspace {
    /// A group's parameters, gathered whole (f32 holding bf16's values).
    pub(super) gathered: Buffer,
    /// This rank's shard of a group, between the collectives and the
    /// tensors (more than one rank only).
    pub(super) shard32: Buffer,
    pub(super) grad_full: Buffer,
    /// One block's and the head's buffers, the model's to cut.
    pub(super) buffers: Buffers,
    pub(super) y: Buffer,
    pub(super) dx: Buffer,
    /// The step's token ids of one micro-batch, cut on the host before
    /// their upload.
    pub(super) inputs_host: Vec<u32>,
    pub(super) targets_host: Vec<u32>,
    /// Per micro-batch of the step (all are in flight at once): the forward
    /// stream, the backward stream, the input and target tokens.
    pub(super) streams: Vec<Stream>,
    /// The embeddings' gradient, summed over the step's micro-batches (the
    /// heads' and the embeddings' backward) and reduced once, after the
    /// last.
    pub(super) dembed: Buffer,
    /// With bf16 compute, the gathered parameters again in bf16 (what the
    /// matrix products read); an empty f32 buffer with f32 compute.
    pub(super) gathered16: Buffer,
}

/// One micro-batch's buffers between ops.
pub(super) struct Stream {
    pub(super) x: Buffer,
    pub(super) dy: Buffer,
    pub(super) inputs: Buffer,
    pub(super) targets: Buffer,
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
            streams,
            dembed: f32s(embed_padded)?,
            gathered16: match dtype {
                Dtype::F32 => f32s(0)?,
                _ => acts(padded_max)?,
            },
        })
    }

    /// Bytes of every buffer on the device.
    pub(super) fn bytes(&self) -> u64 {
        let streams: u64 = self
            .streams
            .iter()
            .map(|s| s.x.bytes() + s.dy.bytes() + s.inputs.bytes() + s.targets.bytes())
            .sum();
        [
            &self.dembed,
            &self.gathered16,
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
}

/// The first `n` gathered parameters as the model reads them: f32, and the
/// bf16 copy for the matrix products when there is one (bf16 compute).
pub(super) fn weights<'a>(gathered: &'a Buffer, gathered16: &'a Buffer, n: usize) -> Weights<'a> {
    let f32 = gathered.view().range(0..n);
    match gathered16.dtype() {
        Dtype::F32 => f32.into(),
        _ => Weights {
            f32,
            compute: gathered16.view().range(0..n),
        },
    }
}

/// Micro-batch `m`'s inputs and next-token targets out of the step's
/// sequences of `seq + 1` tokens.
pub(super) fn split_tokens(
    tokens: &[u32],
    m: usize,
    batch: usize,
    seq: usize,
    inputs: &mut [u32],
    targets: &mut [u32],
) {
    let micro = &tokens[m * batch * (seq + 1)..(m + 1) * batch * (seq + 1)];
    for (i, sequence) in micro.chunks_exact(seq + 1).enumerate() {
        inputs[i * seq..(i + 1) * seq].copy_from_slice(&sequence[..seq]);
        targets[i * seq..(i + 1) * seq].copy_from_slice(&sequence[1..]);
    }
}

impl Engine {
    /// Tells the tracker the op starts, issues the plan's next actions,
    /// and runs it.
    pub(super) fn run_op(
        &mut self,
        step_op: &StepOp,
        tokens: &[u32],
        update: &Update,
    ) -> Result<()> {
        if let (Work::Update { group: g, late }, Some(_)) = (step_op.work, &self.worker) {
            // Queued before the boundary's actions are issued, so that moves
            // of what it writes wait for it (else they carry stale bytes).
            // Its thread waits for its inputs' moves itself.
            self.update_group(g, late, processor_tier(step_op.op.processor), update)?;
            self.announce(&step_op.op)?;
            return self.issue_actions(true);
        }
        let started = Instant::now();
        self.announce(&step_op.op)?;
        let tier = processor_tier(step_op.op.processor);
        for access in &step_op.op.accesses {
            self.settle_fetch(access.tensor as usize, tier)?;
        }
        match step_op.work {
            Work::EmbedForward { m } => self.embed_forward(m, tokens)?,
            Work::Forward { m, layer, .. } => self.block_forward(m, layer)?,
            Work::Head { m } => self.head(m)?,
            Work::Backward { m, layer, .. } => self.block_backward(m, layer)?,
            Work::EmbedBackward { m } => self.embed_backward(m)?,
            Work::Update { group, late } => self.update_group(group, late, tier, update)?,
            Work::Norm => unreachable!("decided by Engine::decide"),
            Work::Commit => self.wait_worker(None)?,
        }
        let (what, group, micro_batch) = label(step_op.work);
        self.runtime
            .record_compute(what, group as u32, micro_batch.map(|m| m as u32), started);
        self.issue_actions(true)
    }

    /// The embeddings' forward of micro-batch `m`: its tokens cut from the
    /// step's, uploaded, looked up.
    fn embed_forward(&mut self, m: usize, tokens: &[u32]) -> Result<()> {
        let batch = self.config.train.micro_batch;
        self.gather(OUTER)?;
        let ws = &mut self.ws;
        split_tokens(
            tokens,
            m,
            batch,
            self.model.seq(),
            &mut ws.inputs_host,
            &mut ws.targets_host,
        );
        let stream = &mut ws.streams[m];
        let backend = &*self.backend;
        backend.upload(View::host_slice(&ws.inputs_host), stream.inputs.view_mut())?;
        backend.upload(
            View::host_slice(&ws.targets_host),
            stream.targets.view_mut(),
        )?;
        self.model.embed_forward(
            backend,
            ws.gathered.view().range(0..self.groups[OUTER].params),
            stream.inputs.view(),
            stream.x.view_mut(),
        )?;
        Ok(())
    }

    /// Block `b`'s forward of micro-batch `m`; keeps what its backward needs
    /// (its input when it recomputes, else all its activations) in the
    /// saved tensor.
    fn block_forward(&mut self, m: usize, b: usize) -> Result<()> {
        let batch = self.config.train.micro_batch;
        self.gather(b + 1)?;
        let ws = &mut self.ws;
        let stream = &mut ws.streams[m];
        self.model.block_forward(
            &*self.backend,
            batch,
            weights(&ws.gathered, &ws.gathered16, self.groups[b + 1].params),
            stream.x.view(),
            &mut ws.buffers,
            ws.y.view_mut(),
        )?;
        std::mem::swap(&mut stream.x, &mut ws.y);
        let id = self.tensor_to_write(self.saved_index(m, b))?;
        let saved = if self.recompute[b] {
            self.ws.buffers.input()
        } else {
            self.ws.buffers.kept()
        };
        write_from_view(&self.runtime, &*self.backend, id, saved, saved.dtype())
    }

    /// The head's forward and backward of micro-batch `m` (the first also
    /// issues the deferred write-backs); adds its loss.
    fn head(&mut self, m: usize) -> Result<()> {
        let world = self.collective.world();
        if m == 0 {
            self.write_back_deferred()?;
        }
        self.gather(OUTER)?;
        let scale = self.scaler.scale() / (self.config.train.grad_accumulation * world) as f32;
        let embed_params = self.groups[OUTER].params;
        let ws = &mut self.ws;
        if m == 0 {
            self.backend.zero(ws.dembed.view_mut())?;
        }
        let stream = &mut ws.streams[m];
        let loss = self.model.head_forward_backward(
            &*self.backend,
            weights(&ws.gathered, &ws.gathered16, embed_params),
            stream.x.view(),
            stream.targets.view(),
            scale,
            &mut ws.buffers,
            stream.dy.view_mut(),
            ws.dembed.view_mut().range(0..embed_params),
        )?;
        self.defer_scalar(Scalar::Loss, loss)
    }

    /// Block `b`'s backward of micro-batch `m` from what its forward saved
    /// (recomputed from its input when it recomputes); reduce-scatters the
    /// gradient.
    fn block_backward(&mut self, m: usize, b: usize) -> Result<()> {
        let batch = self.config.train.micro_batch;
        let world = self.collective.world();
        self.gather(b + 1)?;
        let index = self.saved_index(m, b);
        let id = self.slots[index].id.expect("saved in forward");
        let ws = &mut self.ws;
        let params = weights(&ws.gathered, &ws.gathered16, self.groups[b + 1].params);
        let backend = &*self.backend;
        let dtype = ws.buffers.dtype();
        let model = &*self.model;
        if self.recompute[b] {
            // The recompute reads the kept input where it lies.
            with_device_view(&self.runtime, backend, id, dtype, |input| {
                model.block_forward(
                    backend,
                    batch,
                    params,
                    input,
                    &mut ws.buffers,
                    ws.y.view_mut(),
                )
            })?;
        } else {
            // Copied straight back into the block's activations.
            with_device_view(&self.runtime, backend, id, dtype, |saved| {
                Ok(backend.copy(saved, ws.buffers.kept_mut())?)
            })?;
        }
        // The block's gradient is summed over the step's micro-batches
        // (they run one after another here) and leaves after the last.
        let padded = self.groups[b + 1].padded(world);
        if m == 0 {
            backend.zero(ws.grad_full.view_mut().range(0..padded))?;
        }
        let stream = &mut ws.streams[m];
        model.block_backward(
            backend,
            batch,
            params,
            stream.dy.view(),
            &mut ws.buffers,
            ws.dx.view_mut(),
            ws.grad_full.view_mut().range(0..self.groups[b + 1].params),
        )?;
        std::mem::swap(&mut ws.dx, &mut stream.dy);
        if m + 1 == self.config.train.grad_accumulation {
            self.reduce_gradient(b + 1)?;
        }
        Ok(())
    }

    /// The embeddings' backward of micro-batch `m`; after the last,
    /// reduce-scatters the gradient the step's micro-batches summed.
    fn embed_backward(&mut self, m: usize) -> Result<()> {
        let embed_params = self.groups[OUTER].params;
        let ws = &mut self.ws;
        let stream = &ws.streams[m];
        self.model.embed_backward(
            &*self.backend,
            stream.inputs.view(),
            stream.dy.view(),
            ws.dembed.view_mut().range(0..embed_params),
        )?;
        if m + 1 == self.config.train.grad_accumulation {
            self.reduce_gradient(OUTER)?;
        }
        Ok(())
    }

    pub(super) fn saved_index(&self, m: usize, b: usize) -> usize {
        PER_GROUP * self.groups.len() + m * self.model.layers() + b
    }

    /// All-gathers group `g`'s current bf16 shards into the workspace (as
    /// f32: the values are bf16's), and with bf16 compute into the bf16
    /// copy the products read. One rank widens its device copy straight
    /// into the gathered buffer: with bf16 compute only what the model
    /// reads in f32 (a block's vectors; tables that are looked up), the rest
    /// copied as it is.
    pub(super) fn gather(&mut self, g: usize) -> Result<()> {
        // A late update of the group writes the parameters read here.
        self.wait_worker(Some(g))?;
        let index = param_index(g, self.current);
        let id = self.slots[index].id.expect("parameters are registered");
        let n = self.groups[g].shard;
        let padded = self.groups[g].padded(self.collective.world());
        let (backend, ws) = (&*self.backend, &mut self.ws);
        let bf16 = ws.gathered16.dtype() == Dtype::Bf16;
        if self.collective.world() == 1 {
            let reads_f32 = &self.groups[g].reads_f32;
            return with_device_view(&self.runtime, backend, id, Dtype::Bf16, |shard| {
                if !bf16 {
                    backend.cast(shard, ws.gathered.view_mut().range(0..n))?;
                } else {
                    for range in reads_f32 {
                        let gathered = ws.gathered.view_mut().range(range.clone());
                        backend.cast(shard.range(range.clone()), gathered)?;
                    }
                }
                if bf16 {
                    backend.copy(shard, ws.gathered16.view_mut().range(0..n))?;
                }
                Ok(())
            });
        }
        with_device_view(&self.runtime, backend, id, Dtype::Bf16, |shard| {
            Ok(backend.cast(shard, ws.shard32.view_mut().range(0..n))?)
        })?;
        self.collective
            .all_gather(
                ws.shard32.view().range(0..n),
                ws.gathered.view_mut().range(0..padded),
            )?
            .wait()?;
        if bf16 {
            // The values are bf16's: the cast is exact.
            backend.cast(
                ws.gathered.view().range(0..padded),
                ws.gathered16.view_mut().range(0..padded),
            )?;
        }
        Ok(())
    }

    /// Reduce-scatters group `g`'s full gradient, summed in the workspace
    /// over the step's micro-batches, into its shard's tensor, and takes
    /// the shard's sum of squares.
    pub(super) fn reduce_gradient(&mut self, g: usize) -> Result<()> {
        let n = self.groups[g].shard;
        let padded = self.groups[g].padded(self.collective.world());
        let id = self.tensor_to_write(grad_index(g))?;
        let (backend, ws) = (&*self.backend, &mut self.ws);
        let full = if g == OUTER {
            ws.dembed.view()
        } else {
            ws.grad_full.view()
        };
        let shard = if self.collective.world() == 1 {
            full.range(0..n)
        } else {
            self.collective
                .reduce_scatter(full.range(0..padded), ws.shard32.view_mut().range(0..n))?
                .wait()?;
            ws.shard32.view().range(0..n)
        };
        // The norm of the f32 sum; the tensor keeps it in the gradients'
        // dtype (bf16 with bf16 compute: half the bytes to the optimizer).
        let norm = backend.sum_squares(shard)?;
        let dtype = self.slots[grad_index(g)].meta.dtype;
        write_from_view(&self.runtime, backend, id, shard, dtype)?;
        self.defer_scalar(Scalar::Norm(g), norm)
    }

    /// Keeps a scalar the device computes, to read at the barrier; past
    /// [`SCALARS_PENDING_MAX`] pending, reads the oldest first (long done).
    fn defer_scalar(&mut self, into: Scalar, value: Readback) -> Result<()> {
        if self.scalars.len() == SCALARS_PENDING_MAX {
            self.read_oldest_scalar()?;
        }
        self.scalars.push_back((into, value));
        Ok(())
    }

    fn read_oldest_scalar(&mut self) -> Result<()> {
        let (into, value) = self.scalars.pop_front().expect("a scalar pending");
        let value = value.get()?;
        match into {
            // Added in the order the micro-batches ran.
            Scalar::Loss => self.loss_sum += value,
            Scalar::Norm(g) => self.sum_squares[g] = value,
        }
        Ok(())
    }

    /// Reads every pending scalar, in the order they were computed.
    pub(super) fn read_scalars(&mut self) -> Result<()> {
        while !self.scalars.is_empty() {
            self.read_oldest_scalar()?;
        }
        Ok(())
    }
}
