//! Compute: the workspace (one block's buffers, held for the run, and
//! each micro-batch's streams between blocks) and one op of the step run
//! on the backend: all-gather a group's shards, the model's forward or
//! backward, reduce-scatter the gradient.

use std::time::Instant;

use half::bf16;
use strata_device::{View, ViewMut};
use strata_kernels::Backend;
use strata_optim::{Values, grad_norm, widen};
use strata_runtime::{Access, Tier};

use crate::error::Result;
use crate::gpt::{
    BlockActivations, BlockScratch, GptConfig, HeadBuffers, block_backward, block_forward,
    embed_backward, embed_forward, head_forward_backward,
};

use super::moves::{HOST_WORKSPACE, Kept, guard, read_f32};
use strata_scheduler::{StepOp, Work};

use super::optimizer::Update;
use super::steps::label;
use super::tensors::{Group, processor_tier};
use super::tensors::{grad_index, param_index};
use super::{Engine, PER_GROUP};

/// Compute buffers: one block's worth, held for the whole run, and the
/// streams between blocks of each micro-batch in flight at once.
pub(super) struct Workspace {
    pub(super) gathered: Vec<f32>,
    pub(super) shard16: Vec<bf16>,
    pub(super) shard32: Vec<f32>,
    pub(super) grad_full: Vec<f32>,
    pub(super) acts: BlockActivations,
    pub(super) scratch: BlockScratch,
    pub(super) head: HeadBuffers,
    /// A block's kept input, read back for the recompute (checkpointing).
    pub(super) saved: Vec<f32>,
    pub(super) y: Vec<f32>,
    pub(super) dx: Vec<f32>,
    /// Per micro-batch in flight: the forward stream, the backward stream,
    /// the embeddings' gradient, the input and target tokens.
    pub(super) streams: Vec<Stream>,
}

/// One micro-batch's buffers between ops.
pub(super) struct Stream {
    pub(super) x: Vec<f32>,
    pub(super) dy: Vec<f32>,
    pub(super) dembed: Vec<f32>,
    pub(super) inputs: Vec<u32>,
    pub(super) targets: Vec<u32>,
}

impl Workspace {
    pub(super) fn new(
        backend: &dyn Backend,
        gpt: &GptConfig,
        batch: usize,
        groups: &[Group],
        world: usize,
        checkpoint: bool,
        in_flight: usize,
    ) -> Result<Self> {
        let shard_max = groups.iter().map(|g| g.shard).max().expect("groups");
        let padded_max = shard_max * world;
        let embed_padded = groups[0].padded(world);
        let stream = batch * gpt.seq * gpt.hidden;
        let acts = BlockActivations::new(backend, gpt, batch)?;
        // With checkpointing a block's backward recomputes from its input,
        // read back here; without, the saved activations are read straight
        // into `acts`.
        let saved = if checkpoint { stream } else { 0 };
        Ok(Workspace {
            gathered: vec![0.0; padded_max],
            shard16: vec![bf16::ZERO; shard_max],
            shard32: vec![0.0; shard_max],
            grad_full: vec![0.0; padded_max],
            acts,
            scratch: BlockScratch::new(backend, gpt, batch)?,
            head: HeadBuffers::new(backend, gpt, batch)?,
            saved: vec![0.0; saved],
            y: vec![0.0; stream],
            dx: vec![0.0; stream],
            streams: (0..in_flight)
                .map(|_| Stream {
                    x: vec![0.0; stream],
                    dy: vec![0.0; stream],
                    dembed: vec![0.0; embed_padded],
                    inputs: vec![0; batch * gpt.seq],
                    targets: vec![0; batch * gpt.seq],
                })
                .collect(),
        })
    }

    /// Bytes of every buffer (what they would take on a GPU).
    pub(super) fn bytes(&self) -> u64 {
        let streams = self.streams.iter();
        let floats = [
            &self.gathered,
            &self.shard32,
            &self.grad_full,
            &self.saved,
            &self.y,
            &self.dx,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>()
            + streams
                .clone()
                .map(|s| s.x.len() + s.dy.len() + s.dembed.len())
                .sum::<usize>();
        let tokens = streams
            .map(|s| s.inputs.len() + s.targets.len())
            .sum::<usize>();
        let bf16s = self.shard16.len();
        (4 * floats + 2 * bf16s + 4 * tokens) as u64
            + self.acts.bytes()
            + self.scratch.bytes()
            + self.head.bytes()
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
    /// step's, looked up.
    fn embed_forward(&mut self, m: usize, tokens: &[u32]) -> Result<()> {
        let batch = self.config.train.micro_batch;
        let streams = self.ws.streams.len();
        self.gather(0)?;
        let stream = &mut self.ws.streams[m % streams];
        split_tokens(
            tokens,
            m,
            batch,
            self.gpt.seq,
            &mut stream.inputs,
            &mut stream.targets,
        );
        let embed = &self.ws.gathered[..self.groups[0].params];
        embed_forward(
            &*self.backend,
            &self.gpt,
            View::host_slice(embed),
            View::host_slice(&stream.inputs),
            ViewMut::host_slice(&mut stream.x),
        )?;
        Ok(())
    }

    /// Block `b`'s forward of micro-batch `m`; keeps what its backward needs
    /// (its input with checkpointing, else all its activations) in the
    /// saved tensor.
    fn block_forward(&mut self, m: usize, b: usize) -> Result<()> {
        let batch = self.config.train.micro_batch;
        let streams = self.ws.streams.len();
        self.gather(b + 1)?;
        let ws = &mut self.ws;
        let stream = &mut ws.streams[m % streams];
        let params = &ws.gathered[..self.groups[b + 1].params];
        block_forward(
            &*self.backend,
            &self.gpt,
            batch,
            View::host_slice(params),
            View::host_slice(&stream.x),
            &mut ws.acts,
            &mut ws.scratch,
            ViewMut::host_slice(&mut ws.y),
        )?;
        std::mem::swap(&mut stream.x, &mut ws.y);
        let index = self.saved_index(m, b);
        self.write_tensor(index, Tier::Device, Kept::Saved)?;
        Ok(())
    }

    /// The head's forward and backward of micro-batch `m` (the first also
    /// issues the deferred write-backs); adds its loss.
    fn head(&mut self, m: usize) -> Result<()> {
        let world = self.collective.world();
        let streams = self.ws.streams.len();
        if m == 0 {
            self.write_back_deferred()?;
        }
        self.gather(0)?;
        let scale = self.scaler.scale() / (self.config.train.grad_accumulation * world) as f32;
        let embed_params = self.groups[0].params;
        let ws = &mut self.ws;
        let stream = &mut ws.streams[m % streams];
        stream.dembed.fill(0.0);
        let loss = head_forward_backward(
            &*self.backend,
            &self.gpt,
            View::host_slice(&ws.gathered[..embed_params]),
            View::host_slice(&stream.x),
            View::host_slice(&stream.targets),
            scale,
            &mut ws.head,
            ViewMut::host_slice(&mut stream.dy),
            ViewMut::host_slice(&mut stream.dembed[..embed_params]),
        )?;
        self.loss_sum += loss.get()?;
        Ok(())
    }

    /// Block `b`'s backward of micro-batch `m` from what its forward saved
    /// (recomputed from its input with checkpointing); reduce-scatters the
    /// gradient.
    fn block_backward(&mut self, m: usize, b: usize) -> Result<()> {
        let batch = self.config.train.micro_batch;
        let world = self.collective.world();
        let streams = self.ws.streams.len();
        self.gather(b + 1)?;
        let index = self.saved_index(m, b);
        let id = self.slots[index].id.expect("saved in forward");
        let ws = &mut self.ws;
        let params = View::host_slice(&ws.gathered[..self.groups[b + 1].params]);
        if self.config.train.checkpoint_activations {
            read_f32(&self.runtime, id, Tier::Device, &mut ws.saved)?;
            block_forward(
                &*self.backend,
                &self.gpt,
                batch,
                params,
                View::host_slice(&ws.saved),
                &mut ws.acts,
                &mut ws.scratch,
                ViewMut::host_slice(&mut ws.y),
            )?;
        } else {
            // Read straight back into the block's activations.
            let acts = ws.acts.view_mut().into_host::<f32>();
            read_f32(&self.runtime, id, Tier::Device, acts.expect(HOST_WORKSPACE))?;
        }
        let padded = self.groups[b + 1].padded(world);
        ws.grad_full[..padded].fill(0.0);
        let stream = &mut ws.streams[m % streams];
        block_backward(
            &*self.backend,
            &self.gpt,
            batch,
            params,
            &ws.acts,
            View::host_slice(&stream.dy),
            &mut ws.scratch,
            ViewMut::host_slice(&mut ws.dx),
            ViewMut::host_slice(&mut ws.grad_full[..self.groups[b + 1].params]),
        )?;
        std::mem::swap(&mut ws.dx, &mut stream.dy);
        self.reduce_gradient(b + 1, m)?;
        Ok(())
    }

    /// The embeddings' backward of micro-batch `m`; reduce-scatters the
    /// gradient.
    fn embed_backward(&mut self, m: usize) -> Result<()> {
        let streams = self.ws.streams.len();
        let embed_params = self.groups[0].params;
        let stream = &mut self.ws.streams[m % streams];
        embed_backward(
            &*self.backend,
            &self.gpt,
            View::host_slice(&stream.inputs),
            View::host_slice(&stream.dy),
            ViewMut::host_slice(&mut stream.dembed[..embed_params]),
        )?;
        self.reduce_gradient(0, m)?;
        Ok(())
    }

    pub(super) fn saved_index(&self, m: usize, b: usize) -> usize {
        PER_GROUP * self.groups.len() + m * self.gpt.layers + b
    }

    /// All-gathers group `g`'s current bf16 shards into the workspace (as
    /// f32: the values are bf16's).
    pub(super) fn gather(&mut self, g: usize) -> Result<()> {
        // A late update of the group writes the parameters read here.
        self.wait_worker(Some(g))?;
        let index = param_index(g, self.current);
        let id = self.slots[index].id.expect("parameters are registered");
        let n = self.groups[g].shard;
        guard(&self.runtime, id, Tier::Device, Access::Read)?
            .read_into(bytemuck::cast_slice_mut(&mut self.ws.shard16[..n]))?;
        widen(
            self.isa,
            Values::Bf16(&self.ws.shard16[..n]),
            &mut self.ws.shard32[..n],
        );
        let padded = self.groups[g].padded(self.collective.world());
        self.collective
            .all_gather(
                View::host_slice(&self.ws.shard32[..n]),
                ViewMut::host_slice(&mut self.ws.gathered[..padded]),
            )?
            .wait()?;
        Ok(())
    }

    /// Reduce-scatters the full gradient in the workspace into group `g`'s
    /// shard: written in micro-batch 0, added to after.
    pub(super) fn reduce_gradient(&mut self, g: usize, m: usize) -> Result<()> {
        let n = self.groups[g].shard;
        let padded = self.groups[g].padded(self.collective.world());
        // The embeddings' gradient gathers the head's and the embedding's
        // parts over the whole backward in its own buffer.
        let streams = self.ws.streams.len();
        let full = if g == 0 {
            &self.ws.streams[m % streams].dembed
        } else {
            &self.ws.grad_full
        };
        self.collective
            .reduce_scatter(
                View::host_slice(&full[..padded]),
                ViewMut::host_slice(&mut self.ws.shard32[..n]),
            )?
            .wait()?;
        let index = grad_index(g);
        let last = m + 1 == self.config.train.grad_accumulation;
        if m == 0 {
            if last {
                self.sum_squares[g] =
                    grad_norm(self.isa, Values::F32(&self.ws.shard32[..n])).sum_squares;
            }
            self.write_tensor(index, Tier::Device, Kept::Shard(n))
        } else {
            let id = self.slots[index].id.expect("written in micro-batch 0");
            let mut held = guard(&self.runtime, id, Tier::Device, Access::Write)?;
            // The full gradient is reduced: its buffer is free for the sum.
            let sum = &mut self.ws.grad_full[..n];
            held.read_into(bytemuck::cast_slice_mut(sum))?;
            for (sum, add) in sum.iter_mut().zip(&self.ws.shard32[..n]) {
                *sum += add;
            }
            if last {
                self.sum_squares[g] = grad_norm(self.isa, Values::F32(sum)).sum_squares;
            }
            Ok(held.write_from(bytemuck::cast_slice(sum))?)
        }
    }
}
