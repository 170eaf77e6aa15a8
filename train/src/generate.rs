//! Generation: a model read from a Hugging Face folder (a checkpoint's
//! step directory, or any folder of an architecture strata trains), fed a
//! token at a time through every block with a key/value cache
//! ([`Model::block_decode`]), giving the next token's logits; and the
//! choice of the next token ([`Sampler`]: greedy at temperature 0, else
//! seeded sampling with top-k).
//!
//! The weights are read whole into host memory and the ops run on the CPU
//! backend in f32 (the CUDA backend has no decode kernels yet); the cache
//! holds `capacity` positions, at most the model's sequence length.

use std::path::Path;

use strata_device::{Buffer, Dtype, View};
use strata_kernels::{Backend, CpuBackend};
use strata_storage::engine::SplitMix64;

use crate::error::{Result, bad};
use crate::hf::HfFolder;
use crate::model::{Buffers, Model, OUTER, Weights};

/// A model ready to decode: its weights, one key/value cache per block,
/// and the position the next token goes to.
pub struct Generator {
    model: Box<dyn Model>,
    backend: CpuBackend,
    groups: Vec<Vec<f32>>,
    caches: Vec<Buffer>,
    scratch: Buffer,
    buffers: Buffers,
    x: Buffer,
    y: Buffer,
    logits: Buffer,
    capacity: usize,
    position: usize,
}

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generator")
            .field("model", &self.model)
            .field("capacity", &self.capacity)
            .field("position", &self.position)
            .finish_non_exhaustive()
    }
}

impl Generator {
    /// The model of the Hugging Face folder `dir` (`config.json` and its
    /// safetensors), every parameter read into host memory as f32, its
    /// caches for `capacity` positions (default and at most: the model's
    /// sequence length).
    pub fn open(dir: &Path, capacity: Option<usize>) -> Result<Generator> {
        let (model, groups) = HfFolder::open(dir)?.read_model(None)?;
        let capacity = capacity.map_or(model.seq(), |c| c.min(model.seq()));
        Generator::new(model, groups, capacity)
    }

    /// `model` with each group's values `groups`, its caches holding
    /// `capacity` positions (at most the model's sequence length).
    pub fn new(model: Box<dyn Model>, groups: Vec<Vec<f32>>, capacity: usize) -> Result<Generator> {
        if capacity == 0 || capacity > model.seq() {
            return Err(bad(
                "capacity",
                capacity,
                format!(
                    "a key/value cache holds 1 to the model's sequence length, {} positions",
                    model.seq()
                ),
            ));
        }
        let specs = model.groups();
        if groups.len() != specs.len()
            || groups
                .iter()
                .zip(&specs)
                .any(|(g, s)| g.len() != s.params())
        {
            return Err(bad(
                "groups",
                groups.len(),
                format!(
                    "give the model's {} parameter groups, each of its size",
                    specs.len()
                ),
            ));
        }
        let backend = CpuBackend;
        let f32s = |len| backend.alloc(Dtype::F32, len);
        let caches = (0..model.layers())
            .map(|_| f32s(model.kv_cache_elems(capacity)))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Generator {
            scratch: f32s(model.decode_scratch_elems())?,
            buffers: model.head_buffers(&backend, 1)?,
            x: f32s(model.stream_width())?,
            y: f32s(model.stream_width())?,
            logits: f32s(model.vocab())?,
            caches,
            groups,
            capacity,
            position: 0,
            backend,
            model,
        })
    }

    /// The model it decodes.
    pub fn model(&self) -> &dyn Model {
        &*self.model
    }

    /// Positions its cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Tokens fed so far (the next one's position).
    pub fn position(&self) -> usize {
        self.position
    }

    /// Feeds `token` at the next position; returns the logits of the token
    /// after it (`vocab`).
    pub fn feed(&mut self, token: u32) -> Result<&[f32]> {
        if self.position == self.capacity {
            return Err(bad(
                "tokens",
                self.position + 1,
                format!(
                    "the key/value cache holds {} positions (the model's sequence length): give a shorter prompt or fewer new tokens",
                    self.capacity
                ),
            ));
        }
        if token as usize >= self.model.vocab() {
            return Err(bad(
                "token",
                token,
                format!("the model's vocabulary is 0..{}", self.model.vocab()),
            ));
        }
        let (model, backend) = (&*self.model, &self.backend);
        let place = [u32::try_from(self.position).expect("positions fit u32")];
        model.embed_forward(
            backend,
            View::host_slice(&self.groups[OUTER]),
            View::host_slice(&[token]),
            View::host_slice(&place),
            self.x.view_mut(),
        )?;
        for (b, cache) in self.caches.iter_mut().enumerate() {
            model.block_decode(
                backend,
                Weights::from(View::host_slice(&self.groups[b + 1])),
                self.position,
                self.x.view(),
                cache.view_mut(),
                self.scratch.view_mut(),
                self.y.view_mut(),
            )?;
            std::mem::swap(&mut self.x, &mut self.y);
        }
        model.head_logits(
            backend,
            View::host_slice(&self.groups[OUTER]).into(),
            self.x.view(),
            &mut self.buffers,
            self.logits.view_mut(),
        )?;
        self.position += 1;
        Ok(self.logits.as_slice::<f32>().expect("host f32 logits"))
    }
}

/// How the next token is chosen from the logits: the largest at
/// temperature 0 (the first of equals, as `argmax`), else drawn from the
/// softmax of the logits over the temperature, among the `top_k` largest
/// when set, by a generator seeded with `seed`.
#[derive(Clone, Debug)]
pub struct Sampler {
    temperature: f32,
    top_k: Option<usize>,
    rng: SplitMix64,
    /// The candidates' indices and weights (no allocation per token).
    order: Vec<usize>,
    weights: Vec<f64>,
}

impl Sampler {
    /// A sampler; a temperature must be finite and at least 0, a top-k at
    /// least 1.
    pub fn new(temperature: f32, top_k: Option<usize>, seed: u64) -> Result<Sampler> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(bad(
                "temperature",
                temperature,
                "give 0 (greedy) or a positive number",
            ));
        }
        if top_k == Some(0) {
            return Err(bad(
                "top_k",
                0,
                "keep at least 1 candidate (1 is greedy), or leave it out",
            ));
        }
        Ok(Sampler {
            temperature,
            top_k,
            rng: SplitMix64(seed),
            order: Vec::new(),
            weights: Vec::new(),
        })
    }

    /// The next token of `logits`.
    pub fn next(&mut self, logits: &[f32]) -> u32 {
        assert!(!logits.is_empty(), "logits over a vocabulary");
        if self.temperature == 0.0 || self.top_k == Some(1) {
            return greedy(logits);
        }
        self.order.clear();
        self.order.extend(0..logits.len());
        let keep = self.top_k.unwrap_or(logits.len()).min(logits.len());
        if keep < logits.len() {
            self.order.select_nth_unstable_by(keep - 1, |&a, &b| {
                logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
            });
            self.order.truncate(keep);
            self.order.sort_unstable();
        }
        let max = self
            .order
            .iter()
            .map(|&i| logits[i])
            .fold(f32::NEG_INFINITY, f32::max);
        let t = f64::from(self.temperature);
        self.weights.clear();
        self.weights.extend(
            self.order
                .iter()
                .map(|&i| ((f64::from(logits[i]) - f64::from(max)) / t).exp()),
        );
        let total: f64 = self.weights.iter().sum();
        let mut draw = self.rng.next_f64() * total;
        for (&i, &w) in self.order.iter().zip(&self.weights) {
            if draw < w {
                return i as u32;
            }
            draw -= w;
        }
        *self.order.last().expect("a candidate") as u32
    }
}

/// The index of the largest logit, the first of equals.
pub fn greedy(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest_and_sampling_follows_its_seed_and_top_k() {
        assert_eq!(greedy(&[0.5, 2.0, 2.0, -1.0]), 1);
        let logits = [0.0f32, 1.0, 2.0, 3.0, 2.5];
        let mut greedy_sampler = Sampler::new(0.0, None, 1).unwrap();
        assert_eq!(greedy_sampler.next(&logits), 3);
        let draws = |seed| {
            let mut s = Sampler::new(1.0, Some(2), seed).unwrap();
            (0..64).map(|_| s.next(&logits)).collect::<Vec<_>>()
        };
        let a = draws(7);
        assert_eq!(a, draws(7), "the same seed, the same tokens");
        assert_ne!(a, draws(8));
        assert!(a.iter().all(|&t| t == 3 || t == 4), "top 2 only: {a:?}");
        assert!(a.contains(&3) && a.contains(&4));
        assert!(Sampler::new(-1.0, None, 0).is_err());
        assert!(Sampler::new(f32::NAN, None, 0).is_err());
        assert!(Sampler::new(1.0, Some(0), 0).is_err());
    }
}
