//! Model architectures behind one interface, [`Model`]: each architecture
//! in its own file, written once over the ops of a [`Backend`] on
//! `strata_device` views, found by name in one registry
//! ([`ARCHITECTURES`]). The engine, checkpoints, the step builder and
//! `strata plan` take everything architectural from here: the parameter
//! groups and their tensors' names and shapes, initial values, what a block
//! keeps for its backward, each part's forward and backward, the FLOPs the
//! plans are costed with, the Hugging Face config. Nothing outside an
//! architecture's file names it or one of its tensors (a test searches the
//! sources).
//!
//! A model is a sequence of parameter groups: group 0, the outer group (the
//! embeddings, the final norm and the LM head, tied or not), then block `b`
//! at group `b + 1`. A step runs the outer group's embedding forward, each
//! block's forward, the head's forward and backward (the loss), each
//! block's backward, and the embedding backward; the engine decides when
//! each group's parameters are present (gathered across ranks) and where
//! what a block keeps lives between passes.
//!
//! Adding an architecture: a file `model/<arch>.rs` with a type that
//! implements [`Model`] and its [`Architecture`] entry (a constructor from
//! [`ModelConfig`], a standard shape by size, its Hugging Face config read
//! back), its module here and its entry in [`ARCHITECTURES`]. Whatever it computes differently (another
//! norm, an MLP with a gate and its own width, fewer key/value heads than
//! query heads, an untied head inside the outer group) stays inside its
//! file: the engine sees groups of parameters, buffers and calls.
//!
//! ```
//! use strata_train::ModelConfig;
//! use strata_train::model;
//!
//! let model = model::build(&ModelConfig::default()).unwrap();
//! assert_eq!(model.groups().len(), 1 + model.layers());
//! assert_eq!(model.params(), model.groups().iter().map(|g| g.params()).sum::<usize>());
//! ```

mod config;
pub mod gpt2;
mod init;
pub mod llama;
mod parts;

use std::fmt;
use std::ops::Range;

use strata_device::{Buffer, Dtype, View, ViewMut};
use strata_kernels::{Backend, Readback};

use crate::error::{Result, TrainError};

pub use config::{ModelConfig, RopeScaling};
pub(crate) use parts::{Parts, TypedParts, expect_len};

/// The outer group's index: the embeddings, the final norm and the LM head
/// (tied or not); block `b` is group `b + 1`.
pub const OUTER: usize = 0;

/// The largest hidden size an architecture accepts (a 175B model's: 12288).
pub const HIDDEN_MAX: usize = 1 << 16;
/// The widest MLP accepted.
pub const FFN_MAX: usize = 1 << 18;
/// The most blocks accepted (a 175B model's: 96).
pub const LAYERS_MAX: usize = 1 << 12;
/// The longest sequence accepted.
pub const SEQ_MAX: usize = 1 << 20;
/// The largest vocabulary accepted. With the other limits, every
/// parameter and activation count fits in 63 bits.
pub const VOCAB_MAX: usize = 1 << 24;

/// Checks each `(key, value, max)` of a shape: at least 1 and at most
/// `max`, in order; the error names the key.
pub(crate) fn check_sizes(sizes: &[(&'static str, usize, usize)]) -> Result<()> {
    for &(key, value, max) in sizes {
        if value == 0 {
            return Err(crate::error::bad(key, value, "it must be at least 1"));
        }
        if value > max {
            return Err(crate::error::bad(key, value, format!("use at most {max}")));
        }
    }
    Ok(())
}

/// One entry of the registry: an architecture's name and constructors.
#[derive(Clone, Copy)]
pub struct Architecture {
    /// Its name in `[model] arch`, `meta.json` and `strata plan --arch`.
    pub name: &'static str,
    /// The file under `train/src/model/` that implements it (without
    /// `.rs`): its own name, or its family's (variants of one design share
    /// one implementation).
    pub source: &'static str,
    /// The model of a `[model]` table's shape, checked.
    pub build: fn(&ModelConfig) -> Result<Box<dyn Model>>,
    /// A standard shape of about `params` parameters (`strata plan
    /// --params`): the `[model]` table, with its sequence and vocabulary.
    pub for_params: fn(f64) -> Result<ModelConfig>,
    /// The `[model]` table of a Hugging Face `config.json` of this
    /// architecture (its `model_type` is the architecture's name); what
    /// strata does not compute as that config says is refused by key.
    pub from_hf_config: fn(&serde_json::Value) -> Result<ModelConfig>,
}

/// The registry: every architecture strata trains. The first is the
/// default.
pub const ARCHITECTURES: &[Architecture] = &[
    gpt2::ARCHITECTURE,
    llama::ARCHITECTURE,
    llama::ARCHITECTURE_MISTRAL,
    llama::ARCHITECTURE_QWEN2,
];

/// The default architecture's name (`[model] arch` when left out).
pub fn default_arch() -> &'static str {
    ARCHITECTURES[0].name
}

/// The registry's entry named `name`, or an error listing the names.
pub fn architecture(name: &str) -> Result<&'static Architecture> {
    ARCHITECTURES
        .iter()
        .find(|known| known.name == name)
        .ok_or_else(|| {
            crate::error::bad(
                "model.arch",
                format!("{name:?}"),
                format!(
                    "strata trains these architectures: {}",
                    ARCHITECTURES
                        .iter()
                        .map(|known| format!("{:?}", known.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })
}

/// The `[model]` table of a Hugging Face `config.json`, by the
/// architecture its `model_type` names.
pub fn from_hf_config(config: &serde_json::Value) -> Result<ModelConfig> {
    let model_type = config
        .get("model_type")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| {
            crate::error::bad(
                "config.json model_type",
                config
                    .get("model_type")
                    .map_or("(none)".into(), |v| v.to_string()),
                "a Hugging Face config.json names its model_type (a string)",
            )
        })?;
    (architecture(model_type)?.from_hf_config)(config)
}

/// The architecture `config.arch` names, of `config`'s shape (checked).
pub fn build(config: &ModelConfig) -> Result<Box<dyn Model>> {
    (architecture(config.arch.name())?.build)(config)
}

/// One tensor of a parameter group: where it sits in the group's flat
/// view, how the optimizer and the ops treat it, and how a Hugging Face
/// checkpoint names and shapes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Its name in the architecture's Hugging Face checkpoints.
    pub name: String,
    /// Its shape there (row-major; the elements in `range` in that order).
    pub shape: Vec<usize>,
    /// Its elements in the group's flat view.
    pub range: Range<usize>,
    /// Whether AdamW decays it (weight matrices and embedding tables).
    pub decays: bool,
    /// Whether the ops read it in f32 whatever the compute dtype (norm
    /// parameters, biases, tables that are looked up): with bf16 compute
    /// only these are widened when the group is gathered.
    pub reads_f32: bool,
}

/// One parameter group: the outer group (embeddings, final norm, head) or
/// a block, as consecutive tensors of one flat f32 view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// Its name in the engine's tensors and the optimizer's checkpoint
    /// shards (`embed`, `block0`, ...).
    pub name: String,
    /// Its tensors, in layout order, covering the view.
    pub tensors: Vec<TensorSpec>,
}

impl GroupSpec {
    /// Parameters in the group.
    pub fn params(&self) -> usize {
        self.tensors.last().map_or(0, |t| t.range.end)
    }

    /// The ranges read in f32, adjacent ones merged.
    pub fn f32_ranges(&self) -> Vec<Range<usize>> {
        let mut ranges: Vec<Range<usize>> = Vec::new();
        for tensor in self.tensors.iter().filter(|t| t.reads_f32) {
            match ranges.last_mut() {
                Some(last) if last.end == tensor.range.start => last.end = tensor.range.end,
                _ => ranges.push(tensor.range.clone()),
            }
        }
        ranges
    }
}

/// A group's parameters as the ops read them: all of them in f32 (biases,
/// norm parameters, the embedding tables), and the same values in the
/// compute dtype for the matrix products (the same view when it is f32).
#[derive(Debug, Clone, Copy)]
pub struct Weights<'a> {
    /// Every parameter, f32.
    pub f32: View<'a>,
    /// Every parameter in the compute dtype (only its weight matrices are
    /// read).
    pub compute: View<'a>,
}

impl<'a> From<View<'a>> for Weights<'a> {
    /// f32 compute: one view serves both.
    fn from(view: View<'a>) -> Self {
        Weights {
            f32: view,
            compute: view,
        }
    }
}

impl<'a> Weights<'a> {
    /// Checks both views hold `total` elements; the error names `what`.
    pub(crate) fn check(&self, what: &'static str, total: usize) -> Result<()> {
        expect_len(what, self.f32.len(), total)?;
        expect_len(what, self.compute.len(), total)
    }
}

/// What the outer group's parts cost, as fractions of one block's forward
/// ([`Model::outer_costs`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OuterCosts {
    /// The embeddings' forward, and again their backward.
    pub embed: f64,
    /// The head's forward and backward, with the loss.
    pub head: f64,
}

/// The compute buffers of one block and of the head, for micro-batches of
/// a fixed number of sequences, allocated once by [`Model::buffers`]. The
/// architecture cuts each into its own parts; the engine sees only what a
/// block keeps for its backward.
#[derive(Debug)]
pub struct Buffers {
    /// Sequences in a micro-batch.
    pub(crate) batch: usize,
    /// What a block's forward keeps for its backward: one buffer of the
    /// compute dtype whose first `input_elems` elements are the block's
    /// input (what activation checkpointing keeps).
    pub(crate) acts: Buffer,
    pub(crate) input_elems: usize,
    /// A block's working buffers.
    pub(crate) scratch: Buffer,
    /// The head's working buffers, for `head_rows` rows.
    pub(crate) head: Buffer,
    pub(crate) head_rows: usize,
}

impl Buffers {
    /// Bytes of every buffer.
    pub fn bytes(&self) -> u64 {
        self.acts.bytes() + self.scratch.bytes() + self.head.bytes()
    }

    /// Bytes a block keeps for its backward when it does not recompute.
    pub fn kept_bytes(&self) -> u64 {
        self.acts.bytes()
    }

    /// Bytes a block keeps for its backward when it recomputes (its input).
    pub fn input_bytes(&self) -> u64 {
        self.input_elems as u64 * self.acts.dtype().bytes()
    }

    /// Everything a block keeps, as one view: what a run without
    /// checkpointing saves between forward and backward.
    pub fn kept(&self) -> View<'_> {
        self.acts.view()
    }

    /// Everything kept, to restore what [`Buffers::kept`] saved.
    pub fn kept_mut(&mut self) -> ViewMut<'_> {
        self.acts.view_mut()
    }

    /// The last forward's input (what activation checkpointing keeps).
    pub fn input(&self) -> View<'_> {
        self.acts.view().range(0..self.input_elems)
    }

    /// The activations' dtype (what the kept views are read as).
    pub fn dtype(&self) -> Dtype {
        self.acts.dtype()
    }
}

/// One architecture of a given shape: what the engine, checkpoints and the
/// planners need to know of a model, and its parts' forward and backward
/// over a [`Backend`]. Every op is asynchronous on the backend's stream.
pub trait Model: Send + Sync + fmt::Debug {
    /// Its name in the registry ([`ARCHITECTURES`]).
    fn arch(&self) -> &'static str;

    /// Tokens in a sequence.
    fn seq(&self) -> usize;

    /// Token ids it reads (`0..vocab`).
    fn vocab(&self) -> usize;

    /// Blocks.
    fn layers(&self) -> usize;

    /// Elements per token of the stream between blocks (the embeddings'
    /// output, each block's input and output, the head's input).
    fn stream_width(&self) -> usize;

    /// The parameter groups: the outer group, then each block.
    fn groups(&self) -> Vec<GroupSpec>;

    /// All parameters.
    fn params(&self) -> usize {
        self.groups().iter().map(GroupSpec::params).sum()
    }

    /// Writes group `g`'s initial values into `out` (its
    /// [`GroupSpec::params`]), the same for a seed whatever the ranks.
    fn init(&self, g: usize, seed: u64, out: &mut [f32]);

    /// Matrix-product FLOPs of one block's forward over `tokens` tokens:
    /// what the plans are costed with when nothing was measured.
    fn block_forward_flops(&self, tokens: usize) -> f64;

    /// What the outer group's parts cost the plans, as fractions of one
    /// block's forward.
    fn outer_costs(&self) -> OuterCosts;

    /// The compute buffers of one block and the head for `batch` sequences
    /// on `backend`, the activations of `dtype` (f32 or bf16).
    fn buffers(&self, backend: &dyn Backend, batch: usize, dtype: Dtype) -> Result<Buffers>;

    /// The embeddings' forward: `x` (`tokens x stream_width`) from the
    /// token ids, with the outer group's parameters in f32. `position_ids`
    /// (u32 per token; empty: each token's place in its sequence) are the
    /// tokens' places in their documents when documents are packed into a
    /// sequence ([`Backend::attention`]): a model's positions restart per
    /// document, and its attention stays inside one.
    fn embed_forward(
        &self,
        backend: &dyn Backend,
        outer: View<'_>,
        tokens: View<'_>,
        position_ids: View<'_>,
        x: ViewMut<'_>,
    ) -> Result<()>;

    /// One block's forward for `batch` sequences: `out = block(x)`, keeping
    /// what its backward needs in `buffers`; `position_ids` as
    /// [`Model::embed_forward`]'s.
    #[allow(clippy::too_many_arguments)]
    fn block_forward(
        &self,
        backend: &dyn Backend,
        batch: usize,
        position_ids: View<'_>,
        params: Weights<'_>,
        x: View<'_>,
        buffers: &mut Buffers,
        out: ViewMut<'_>,
    ) -> Result<()>;

    /// One block's backward from what its forward kept in `buffers`:
    /// writes `dx` and adds the parameter gradients to `dparams`
    /// (`position_ids` as the forward's).
    #[allow(clippy::too_many_arguments)]
    fn block_backward(
        &self,
        backend: &dyn Backend,
        batch: usize,
        position_ids: View<'_>,
        params: Weights<'_>,
        dout: View<'_>,
        buffers: &mut Buffers,
        dx: ViewMut<'_>,
        dparams: ViewMut<'_>,
    ) -> Result<()>;

    /// The head's forward and backward: the mean cross-entropy of the last
    /// block's output `x` against `targets`; writes `dx` and adds to the
    /// outer group's gradients `douter`, both multiplied by `grad_scale`.
    /// The loss is read back without waiting for the device.
    #[allow(clippy::too_many_arguments)]
    fn head_forward_backward(
        &self,
        backend: &dyn Backend,
        outer: Weights<'_>,
        x: View<'_>,
        targets: View<'_>,
        grad_scale: f32,
        buffers: &mut Buffers,
        dx: ViewMut<'_>,
        douter: ViewMut<'_>,
    ) -> Result<Readback>;

    /// Elements (f32) of one block's key/value cache for `capacity`
    /// positions (decoding: [`Model::block_decode`]).
    fn kv_cache_elems(&self, capacity: usize) -> usize;

    /// Elements (f32) of the scratch one [`Model::block_decode`] works in.
    fn decode_scratch_elems(&self) -> usize;

    /// Decoding, in f32: one token's row `x` (`stream_width`) at
    /// `position` through a block into `out`, its key and value written
    /// into row `position` of the block's `cache` (the rows before it hold
    /// the tokens before it), attending over rows `0..=position`. `out` is
    /// that row of [`Model::block_forward`] over the sequence.
    #[allow(clippy::too_many_arguments)]
    fn block_decode(
        &self,
        backend: &dyn Backend,
        params: Weights<'_>,
        position: usize,
        x: View<'_>,
        cache: ViewMut<'_>,
        scratch: ViewMut<'_>,
        out: ViewMut<'_>,
    ) -> Result<()>;

    /// Buffers for [`Model::head_logits`] alone over at most `rows` rows
    /// (f32; no block's: decoding's one row at a time).
    fn head_buffers(&self, backend: &dyn Backend, rows: usize) -> Result<Buffers>;

    /// The head's forward alone: the logits (`rows x vocab`) of the last
    /// block's output `x`, any number of rows up to `buffers`' (one, when
    /// decoding).
    fn head_logits(
        &self,
        backend: &dyn Backend,
        outer: Weights<'_>,
        x: View<'_>,
        buffers: &mut Buffers,
        logits: ViewMut<'_>,
    ) -> Result<()>;

    /// The embeddings' backward: adds `dx`'s contribution to the outer
    /// group's gradients `douter` (`position_ids` as the forward's).
    fn embed_backward(
        &self,
        backend: &dyn Backend,
        tokens: View<'_>,
        position_ids: View<'_>,
        dx: View<'_>,
        douter: ViewMut<'_>,
    ) -> Result<()>;

    /// The architecture's Hugging Face `config.json` for this shape, as
    /// strata computes it (`AutoModelForCausalLM.from_pretrained` of a
    /// checkpoint's step directory reads it).
    fn hf_config(&self) -> serde_json::Value;

    /// This shape as the planners see it (`strata plan`, the cluster
    /// estimates), for micro-batches of `micro_batch` sequences.
    fn cost_model(&self, micro_batch: u64) -> strata_scheduler::Model;
}

/// Every group's initial values for `seed` ([`Model::init`]), a vector
/// each: a model in host memory, as [`forward_logits`], evaluation and
/// generation read one.
pub fn initial_values(model: &dyn Model, seed: u64) -> Vec<Vec<f32>> {
    model
        .groups()
        .iter()
        .enumerate()
        .map(|(g, spec)| {
            let mut values = vec![0f32; spec.params()];
            model.init(g, seed, &mut values);
            values
        })
        .collect()
}

/// A decoding step's attention ([`Model::block_decode`]): writes the new
/// row's key and value, from its packed `qkv` (`q | k | v`, of
/// `shape`'s widths), into row `position` of the block's `cache` (keys,
/// then values, `capacity x kv_hidden` each), and attends over rows
/// `0..=position` into `out`.
pub(crate) fn attend_cached(
    backend: &dyn Backend,
    shape: strata_kernels::Attention,
    position: usize,
    qkv: View<'_>,
    cache: ViewMut<'_>,
    out: ViewMut<'_>,
) -> Result<()> {
    let (h, kvh) = (shape.hidden(), shape.kv_hidden());
    expect_len("decode qkv", qkv.len(), shape.qkv_width())?;
    let capacity = cache.len() / (2 * kvh).max(1);
    expect_len("key/value cache", cache.len(), 2 * capacity * kvh)?;
    if position >= capacity {
        return Err(crate::error::bad(
            "position",
            position,
            format!("the key/value cache holds {capacity} positions"),
        ));
    }
    let [mut keys, mut values] = Parts::new([capacity * kvh; 2]).split(cache);
    let row = position * kvh..(position + 1) * kvh;
    backend.copy(qkv.range(h..h + kvh), keys.reborrow().range(row.clone()))?;
    backend.copy(
        qkv.range(h + kvh..h + 2 * kvh),
        values.reborrow().range(row),
    )?;
    let seen = (position + 1) * kvh;
    backend.attention_decode(
        shape,
        position + 1,
        qkv.range(0..h),
        keys.view().range(0..seen),
        values.view().range(0..seen),
        out,
    )?;
    Ok(())
}

/// The whole model's forward for inference: the logits (`tokens x vocab`)
/// of `tokens` (whole sequences of `model.seq()`), from the outer group's
/// parameters and each block's. It allocates its buffers on `backend` (one
/// block's activations, not the model's) and returns once the backend has
/// written `logits` (an evaluation, not a step's path).
pub fn forward_logits(
    model: &dyn Model,
    backend: &dyn Backend,
    outer: View<'_>,
    blocks: &[View<'_>],
    tokens: View<'_>,
    logits: ViewMut<'_>,
) -> Result<()> {
    let seq = model.seq();
    let batch = tokens.len() / seq;
    expect_len("tokens", tokens.len(), batch.max(1) * seq)?;
    expect_len("blocks", blocks.len(), model.layers())?;
    let n = batch * seq * model.stream_width();
    let mut buffers = model.buffers(backend, batch, Dtype::F32)?;
    let mut x = backend.alloc(Dtype::F32, n)?;
    let mut y = backend.alloc(Dtype::F32, n)?;
    let ids = strata_kernels::no_position_ids();
    model.embed_forward(backend, outer, tokens, ids, x.view_mut())?;
    for &params in blocks {
        model.block_forward(
            backend,
            batch,
            ids,
            params.into(),
            x.view(),
            &mut buffers,
            y.view_mut(),
        )?;
        std::mem::swap(&mut x, &mut y);
    }
    model.head_logits(backend, outer.into(), x.view(), &mut buffers, logits)?;
    // The buffers above are freed on return: the ops must be done with them.
    backend.record()?.wait()?;
    Ok(())
}

/// The name of an architecture in the registry, as `[model] arch` holds
/// it: `Copy`, and only ever one of [`ARCHITECTURES`]' names.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Arch(&'static str);

impl Arch {
    /// The registered architecture `name`, or an error listing them.
    pub fn named(name: &str) -> Result<Arch> {
        architecture(name).map(|known| Arch(known.name))
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        self.0
    }
}

impl Default for Arch {
    fn default() -> Self {
        Arch(default_arch())
    }
}

impl fmt::Debug for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl serde::Serialize for Arch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Arch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Arch::named(&name).map_err(|err| match err {
            TrainError::Config { fix, .. } => {
                serde::de::Error::custom(format!("arch {name:?} is not known: {fix}"))
            }
            other => serde::de::Error::custom(other),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every registered architecture, at the default shape.
    fn models() -> Vec<Box<dyn Model>> {
        ARCHITECTURES
            .iter()
            .map(|a| {
                let config = ModelConfig {
                    arch: Arch::named(a.name).unwrap(),
                    ..ModelConfig::default()
                };
                build(&config).unwrap()
            })
            .collect()
    }

    #[test]
    fn every_group_is_covered_by_its_tensors_once_and_their_names_are_unique() {
        for model in models() {
            let groups = model.groups();
            assert_eq!(groups.len(), 1 + model.layers(), "{}", model.arch());
            let mut names = std::collections::BTreeSet::new();
            for group in &groups {
                let mut at = 0;
                for tensor in &group.tensors {
                    assert_eq!(tensor.range.start, at, "{}", tensor.name);
                    assert_eq!(tensor.range.len(), tensor.shape.iter().product::<usize>());
                    assert!(names.insert(tensor.name.clone()), "{}", tensor.name);
                    at = tensor.range.end;
                }
                assert_eq!(at, group.params());
            }
            let total: usize = groups.iter().map(GroupSpec::params).sum();
            assert_eq!(total, model.params());
            assert_eq!(
                model.cost_model(1).params(),
                total as u64,
                "{}",
                model.arch()
            );
        }
    }

    #[test]
    fn every_architectures_hugging_face_config_reads_back_as_its_table() {
        for a in ARCHITECTURES {
            let config = ModelConfig {
                arch: Arch::named(a.name).unwrap(),
                vocab: 300,
                seq: 24,
                layers: 3,
                ..ModelConfig::default()
            };
            let written = build(&config).unwrap().hf_config();
            let read = from_hf_config(&written).unwrap();
            // Read back, the same model (an architecture may spell out
            // the defaults it left implicit).
            assert_eq!(build(&read).unwrap().hf_config(), written, "{}", a.name);
            assert_eq!(
                (
                    read.arch,
                    read.vocab,
                    read.seq,
                    read.hidden,
                    read.heads,
                    read.layers
                ),
                (config.arch, 300, 24, config.hidden, config.heads, 3),
                "{}",
                a.name
            );
        }
        let err = from_hf_config(&serde_json::json!({"n_layer": 2})).unwrap_err();
        assert!(err.to_string().contains("model_type"), "{err}");
        let err = from_hf_config(&serde_json::json!({"model_type": "nope"})).unwrap_err();
        assert!(err.to_string().contains("strata trains these"), "{err}");
    }

    #[test]
    fn f32_ranges_merge_adjacent_tensors() {
        let tensor = |range: Range<usize>, reads_f32| TensorSpec {
            name: format!("t{}", range.start),
            shape: vec![range.len()],
            range,
            decays: false,
            reads_f32,
        };
        let group = GroupSpec {
            name: "g".into(),
            tensors: vec![
                tensor(0..2, true),
                tensor(2..5, true),
                tensor(5..9, false),
                tensor(9..10, true),
            ],
        };
        assert_eq!(group.f32_ranges(), [0..5, 9..10]);
    }

    #[test]
    fn an_unknown_architecture_is_named_with_the_list() {
        let err = Arch::named("nope").unwrap_err().to_string();
        assert!(
            err.contains("model.arch") && err.contains("\"nope\""),
            "{err}"
        );
        for a in ARCHITECTURES {
            assert!(err.contains(&format!("{:?}", a.name)), "{err}");
        }
        // In a config file: engine::config's tests.
    }
}
