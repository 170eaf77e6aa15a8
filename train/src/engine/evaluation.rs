//! Evaluation inside the engine: forward-only passes over held-out
//! windows with the parameters where training keeps them (a model larger
//! than the device evaluates offloaded, as it trains) on the run's backend
//! and ranks; `run.rs`'s `evaluate` runs it on a checkpoint. Each pass is one of the
//! schedule's planned shapes ([`super::steps::eval_ops`]): the embedding,
//! every block's forward keeping nothing, the loss; no gradient, update or
//! activation is written, and the next step finds every tensor home.
//!
//! Windows are read in file order, each once: pass `p` takes windows
//! `p x world x per_rank ..`, rank `r` its `r`-th slice of them. The last
//! pass is padded with sequences whose every target is masked, which count
//! nothing. The loss is the mean over the targets counted on every rank,
//! as the training step's with loss masks.

use std::time::Instant;

use strata_runtime::Tier;
use strata_scheduler::{StepOp, Work};

use crate::error::{Result, bad};
use crate::model::OUTER;

use super::data::NOT_A_TARGET;
use super::step_loop::count_targets;
use super::{Corpus, Engine, TierBytes, eval_shape};

/// What an evaluation measured.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Evaluation {
    /// Windows read (sequences of `seq + 1` tokens).
    pub windows: u64,
    /// Targets the loss counted.
    pub targets: u64,
    /// The mean cross-entropy over them (nats).
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Seconds the forward passes took.
    pub seconds: f64,
    /// Tokens (inputs) read a second.
    pub tokens_per_s: f64,
    /// Rank 0's peak bytes per tier so far (device including the compute
    /// workspace): during a run, the run's.
    pub peak_bytes: TierBytes,
}

impl Engine {
    /// The mean loss of the model as it stands (the last step's update
    /// applied) over the first `windows_max` windows of `corpus` (all of
    /// them without it), forward only, `progress` told of the windows each
    /// pass reads (every rank's). Every rank calls it together with the
    /// same corpus; each gets the whole evaluation. The training state is
    /// untouched: the next step computes what it would have.
    pub fn evaluate(
        &mut self,
        corpus: &Corpus,
        windows_max: Option<u64>,
        progress: &dyn Fn(u64),
    ) -> Result<Evaluation> {
        self.flush()?;
        let seq = self.env.model().seq();
        if corpus.seq() != seq {
            return Err(bad(
                "seq",
                corpus.seq(),
                format!("the corpus was cut for sequences of {seq} tokens, the model's"),
            ));
        }
        let windows = windows_max.map_or(corpus.windows(), |n| n.min(corpus.windows()));
        if windows == 0 {
            return Err(bad(
                "windows",
                0,
                "evaluate at least one window of the data",
            ));
        }
        let (rank, world) = (self.env.rank(), self.env.world());
        let mut tokens = vec![0u32; self.env.tokens_per_step()];
        let per_rank = (tokens.len() / (seq + 1)) as u64;
        let per_pass = per_rank * world as u64;
        let rows = (self.env.config().train.micro_batch * seq) as f64;
        let started = Instant::now();
        // This rank's sum of the micro-batches' losses over their rows,
        // and its targets counted.
        let mut totals = [0.0f64, 0.0];
        for first in (0..windows).step_by(per_pass as usize) {
            let mine = first + rank as u64 * per_rank;
            for (i, sequence) in tokens.chunks_exact_mut(seq + 1).enumerate() {
                match mine + i as u64 {
                    w if w < windows => corpus.window(w, sequence),
                    // Past the last window: nothing counts.
                    _ => sequence.fill(NOT_A_TARGET),
                }
            }
            totals[1] += count_targets(&tokens, seq) as f64;
            let losses = self.forward_pass(&tokens);
            let losses = match losses {
                Ok(losses) => losses,
                Err(err) => {
                    // Part way through a pass the moves are no step's.
                    self.state.fail();
                    return Err(err);
                }
            };
            totals[0] += losses * rows;
            progress(per_pass.min(windows - first));
        }
        if world > 1 {
            self.env.collective().all_reduce_scalars(&mut totals)?;
        }
        let seconds = started.elapsed().as_secs_f64();
        let [sum, counted] = totals;
        if counted == 0.0 {
            return Err(bad(
                "targets",
                0,
                "every target of the windows read is masked: evaluate data with loss targets",
            ));
        }
        let loss = sum / counted;
        let stats = self.env.runtime().stats();
        let mut peak = [0, 1, 2].map(|i| stats.tiers[i].peak_bytes);
        peak[Tier::Device.index()] += self.schedule.prediction().workspace_bytes;
        Ok(Evaluation {
            windows,
            targets: counted as u64,
            loss,
            perplexity: loss.exp(),
            seconds,
            tokens_per_s: (windows * seq as u64) as f64 / seconds.max(1e-9),
            peak_bytes: TierBytes::from_array(peak),
        })
    }

    /// One forward-only pass over this rank's `tokens` (a step's worth):
    /// the sum of its micro-batches' mean losses.
    fn forward_pass(&mut self, tokens: &[u32]) -> Result<f64> {
        self.ws.forget_gathered();
        let shape = eval_shape(self.moves.current());
        let ops = self.schedule.take_ops(shape);
        let result = self.run_pass(&ops, tokens);
        self.schedule.end_ops(ops);
        result
    }

    fn run_pass(&mut self, ops: &[StepOp], tokens: &[u32]) -> Result<f64> {
        self.schedule.begin_step(&ops[0].op);
        self.issue_actions(false)?;
        self.issue_actions(true)?;
        let mut losses = Vec::with_capacity(self.env.config().train.in_flight());
        for step_op in ops {
            let started = Instant::now();
            self.begin_op(step_op)?;
            // Each op's span in the trace: what it did, its group and
            // micro-batch.
            let (what, group, m) = match step_op.work {
                Work::EmbedForward { m } => {
                    self.gather(OUTER)?;
                    self.ws.embed_forward(&self.env, m, tokens)?;
                    ("eval: embed forward", OUTER, m)
                }
                Work::Forward {
                    m,
                    layer,
                    keep: false,
                    ..
                } => {
                    self.gather(layer + 1)?;
                    self.ws.block_forward(&self.env, m, layer)?;
                    ("eval: block forward", layer + 1, m)
                }
                Work::Loss { m } => {
                    self.gather(OUTER)?;
                    // The training head with no gradient wanted (scale 0):
                    // the same loss, bit for bit, as a step's forward.
                    losses.push(self.ws.head(&self.env, m, 0.0)?);
                    ("eval: loss", OUTER, m)
                }
                other => unreachable!("{other:?} in a forward-only pass"),
            };
            self.env
                .runtime()
                .record_compute(what, group as u32, Some(m as u32), started);
            self.issue_actions(true)?;
        }
        self.end_step()?;
        losses.into_iter().map(|loss| Ok(loss.get()?)).sum()
    }
}
