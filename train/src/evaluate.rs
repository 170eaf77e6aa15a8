//! Evaluation: a model's mean loss and perplexity over every window of a
//! corpus (held-out data), forward only. The windows are read in file
//! order, each once, with the marks training reads (loss masks, packed
//! documents kept apart); the loss is the mean over the targets counted.
//!
//! The weights are in host memory and the ops run on the CPU backend in
//! f32, the head's logits a chunk of rows at a time.

use std::time::Instant;

use strata_device::{Buffer, Dtype, View};
use strata_kernels::{Backend, CpuBackend, IGNORE_TARGET, no_position_ids};

use crate::engine::Corpus;
use crate::engine::data::split_tokens;
use crate::error::{Result, bad};
use crate::model::{Buffers, Model, OUTER, Weights};

/// Rows of logits computed at once: `LOGIT_ROWS x vocab` f32.
pub const LOGIT_ROWS: usize = 256;

/// What [`evaluate`] measured.
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
}

/// One batch size's buffers.
struct Pass {
    batch: usize,
    buffers: Buffers,
    x: Buffer,
    y: Buffer,
}

/// The loss of `model` (each group's values in `groups`) over the first
/// `windows_max` windows of `corpus` (all of them without it),
/// `micro_batch` sequences a forward pass; `progress` is told of each
/// window done.
pub fn evaluate(
    model: &dyn Model,
    groups: &[Vec<f32>],
    corpus: &Corpus,
    (micro_batch, windows_max): (usize, Option<u64>),
    progress: &dyn Fn(u64),
) -> Result<Evaluation> {
    let seq = model.seq();
    if corpus.seq() != seq {
        return Err(bad(
            "seq",
            corpus.seq(),
            format!("the corpus was cut for sequences of {seq} tokens, the model's"),
        ));
    }
    if micro_batch == 0 {
        return Err(bad("micro_batch", 0, "give at least 1 sequence a pass"));
    }
    let windows = windows_max.map_or(corpus.windows(), |n| n.min(corpus.windows()));
    if windows == 0 {
        return Err(bad(
            "windows",
            0,
            "evaluate at least one window of the data",
        ));
    }
    let backend = CpuBackend;
    let (width, vocab) = (model.stream_width(), model.vocab());
    let pass = |batch: usize| -> Result<Pass> {
        Ok(Pass {
            batch,
            buffers: model.buffers(&backend, batch, Dtype::F32)?,
            x: backend.alloc(Dtype::F32, batch * seq * width)?,
            y: backend.alloc(Dtype::F32, batch * seq * width)?,
        })
    };
    let full = micro_batch.min(windows as usize);
    let mut passes = vec![pass(full)?];
    let rest = (windows % full as u64) as usize;
    if rest > 0 {
        passes.push(pass(rest)?);
    }
    let rows = full * seq;
    let mut tokens = vec![0u32; full * (seq + 1)];
    let (mut inputs, mut targets, mut ids) = (vec![0u32; rows], vec![0u32; rows], vec![0u32; rows]);
    let chunk = LOGIT_ROWS.min(rows);
    let mut logits = backend.alloc(Dtype::F32, chunk * vocab)?;
    let mut dlogits = backend.alloc(Dtype::F32, chunk * vocab)?;
    let (mut sum, mut counted) = (0.0f64, 0u64);
    let started = Instant::now();
    let mut window = 0u64;
    while window < windows {
        let pass = match (windows - window) as usize {
            left if left >= full => &mut passes[0],
            _ => passes.last_mut().expect("a pass for the rest"),
        };
        let (batch, n) = (pass.batch, pass.batch * seq);
        for (i, sequence) in tokens.chunks_exact_mut(seq + 1).take(batch).enumerate() {
            corpus.window(window + i as u64, sequence);
        }
        let packed = split_tokens(
            &tokens[..batch * (seq + 1)],
            0,
            batch,
            seq,
            (&mut inputs[..n], &mut targets[..n], &mut ids[..n]),
        );
        let position_ids = match packed {
            true => View::host_slice(&ids[..n]),
            false => no_position_ids(),
        };
        model.embed_forward(
            &backend,
            View::host_slice(&groups[OUTER]),
            View::host_slice(&inputs[..n]),
            position_ids,
            pass.x.view_mut(),
        )?;
        for params in &groups[1..] {
            model.block_forward(
                &backend,
                batch,
                position_ids,
                Weights::from(View::host_slice(params)),
                pass.x.view(),
                &mut pass.buffers,
                pass.y.view_mut(),
            )?;
            std::mem::swap(&mut pass.x, &mut pass.y);
        }
        for start in (0..n).step_by(chunk) {
            let end = (start + chunk).min(n);
            let part = &targets[start..end];
            let counts = part.iter().filter(|&&t| t != IGNORE_TARGET).count();
            if counts == 0 {
                continue;
            }
            let r = end - start;
            model.head_logits(
                &backend,
                View::host_slice(&groups[OUTER]).into(),
                pass.x.view().range(start * width..end * width),
                &mut pass.buffers,
                logits.view_mut().range(0..r * vocab),
            )?;
            // The mean over the chunk's rows, ignored targets adding
            // nothing; no gradient is wanted (scale 0).
            let mean = backend
                .cross_entropy(
                    logits.view().range(0..r * vocab),
                    View::host_slice(part),
                    0.0,
                    dlogits.view_mut().range(0..r * vocab),
                )?
                .get()?;
            sum += mean * r as f64;
            counted += counts as u64;
        }
        window += batch as u64;
        progress(batch as u64);
    }
    let seconds = started.elapsed().as_secs_f64();
    if counted == 0 {
        return Err(bad(
            "targets",
            0,
            "every target of the windows read is masked: evaluate data with loss targets",
        ));
    }
    let loss = sum / counted as f64;
    Ok(Evaluation {
        windows,
        targets: counted,
        loss,
        perplexity: loss.exp(),
        seconds,
        tokens_per_s: (windows * seq as u64) as f64 / seconds.max(1e-9),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelConfig;
    use strata_device::ViewMut;

    /// The evaluation is the mean next-token cross-entropy of every window,
    /// computed here from the whole forward's logits in f64, whatever the
    /// batch; a cap reads the first windows.
    #[test]
    fn the_loss_is_every_windows_mean_cross_entropy_whatever_the_batch() {
        let config = ModelConfig {
            vocab: 256,
            seq: 8,
            hidden: 16,
            heads: 2,
            layers: 2,
            ..ModelConfig::default()
        };
        let model = crate::model::build(&config).unwrap();
        let groups = crate::model::initial_values(&*model, 3);
        let text = b"the tiers hold every tensor, and move it where it is needed. ".repeat(3);
        let corpus = Corpus::new(text, 8).unwrap();
        let mut window = vec![0u32; 9];
        let (mut sum, mut rows) = (0f64, 0u64);
        for w in 0..corpus.windows() {
            corpus.window(w, &mut window);
            let mut logits = vec![0f32; 8 * 256];
            let blocks: Vec<View<'_>> = groups[1..].iter().map(|g| View::host_slice(g)).collect();
            crate::model::forward_logits(
                &*model,
                &CpuBackend,
                View::host_slice(&groups[0]),
                &blocks,
                View::host_slice(&window[..8]),
                ViewMut::host_slice(&mut logits),
            )
            .unwrap();
            for (row, &target) in logits.chunks_exact(256).zip(&window[1..]) {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let log_sum: f64 = row
                    .iter()
                    .map(|&v| f64::from(v - max).exp())
                    .sum::<f64>()
                    .ln()
                    + f64::from(max);
                sum += log_sum - f64::from(row[target as usize]);
                rows += 1;
            }
        }
        let want = sum / rows as f64;
        for batch in [1, 3, 100] {
            let got = evaluate(&*model, &groups, &corpus, (batch, None), &|_| {}).unwrap();
            assert_eq!((got.windows, got.targets), (corpus.windows(), rows));
            assert!(
                (got.loss - want).abs() <= 1e-5 * want,
                "batch {batch}: {} vs {want}",
                got.loss
            );
            assert!((got.perplexity - want.exp()).abs() <= 1e-4 * want.exp());
        }
        let first = evaluate(&*model, &groups, &corpus, (2, Some(3)), &|_| {}).unwrap();
        assert_eq!((first.windows, first.targets), (3, 24));
        let err = evaluate(&*model, &groups, &corpus, (0, None), &|_| {}).unwrap_err();
        assert!(err.to_string().contains("micro_batch"), "{err}");
    }
}
