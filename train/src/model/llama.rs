//! The Llama family behind [`Model`]: Llama (`"llama"`: Llama 2 and 3),
//! Mistral (`"mistral"`) and Qwen2 (`"qwen2"`), one implementation with
//! each variant's switches: a token embedding without positions,
//! pre-RMSNorm blocks (grouped-query causal attention with rotary position
//! embeddings, a SwiGLU MLP of its own width), a final RMSNorm, an LM head
//! tied to the embedding or not; Qwen2 adds biases to the query, key and
//! value projections; Mistral's sliding window is accepted when a sequence
//! fits inside it. The numbers are transformers' `LlamaForCausalLM`,
//! `MistralForCausalLM` and `Qwen2ForCausalLM` in f32 (the fixtures' test
//! compares them).
//!
//! Parameters keep Hugging Face's shapes (`nn.Linear` weights `out x in`,
//! row-major), so a checkpoint's tensor is its range as it is; the
//! products read them transposed. A block's query, key and value weights
//! are adjacent (one `(heads + 2 kv_heads) head_dim x hidden` matrix: one
//! product), and so are the MLP's gate and up weights (one `2 ffn x
//! hidden` product, cut by the SwiGLU op).
//!
//! The head and its loss run over chunks of rows (at most
//! [`LOGITS_CHUNK_ELEMS`] logits at once): a 128,256-token vocabulary
//! never holds `rows x vocab` logits. Cutting rows rather than the
//! vocabulary keeps the three products of the unchunked head, with no
//! second pass for the softmax's normalizer.

use strata_device::{Dtype, View, ViewMut};
use strata_kernels::{Attention, Backend, Matrix, Readback};
use strata_storage::engine::SplitMix64;

use super::config::RopeScaling;
use super::init::fill_normal;
use super::{
    Arch, Architecture, Buffers, FFN_MAX, GroupSpec, HIDDEN_MAX, LAYERS_MAX, Model, ModelConfig,
    OuterCosts, Parts, SEQ_MAX, TensorSpec, TypedParts, VOCAB_MAX, Weights, attend_cached,
    check_sizes, expect_len,
};
use crate::error::{Result, bad};

/// Logits the head holds at once (a chunk of rows times the vocabulary):
/// 64 MiB in bf16.
pub const LOGITS_CHUNK_ELEMS: usize = 1 << 25;

/// What tells the family's members apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    /// The registry's name, and the config's `model_type`.
    pub name: &'static str,
    /// transformers' class (`architectures` in `config.json`).
    pub class: &'static str,
    /// Biases on the query, key and value projections.
    pub qkv_bias: bool,
    /// Whether a sliding attention window is part of its config.
    pub window: bool,
    /// Whether the window applies when the config has no
    /// `use_sliding_window` (Mistral: yes; Qwen2: no, transformers'
    /// default is false).
    pub window_by_default: bool,
    /// What transformers' config class takes for a key `config.json`
    /// leaves out (a config written by hand, trimmed, or saved by another
    /// version).
    pub defaults: HfDefaults,
}

/// transformers' defaults (5.x) for the keys of a config class that
/// `config.json` may leave out; the rest of them (`rms_norm_eps` 1e-6,
/// `rope_theta` 10000, untied embeddings) are the same for the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfDefaults {
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads`; None: as many as the query heads (Llama's
    /// rule, and every class's for an explicit null).
    pub num_key_value_heads: Option<usize>,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `sliding_window` (an explicit null is no window).
    pub sliding_window: Option<usize>,
}

/// The family's `rms_norm_eps` where `config.json` or `[model]` gives none.
const HF_NORM_EPS: f64 = 1e-6;
/// The family's `rope_theta` where `config.json` or `[model]` gives none.
const HF_ROPE_THETA: f64 = 10_000.0;

/// Llama 2 and 3.
pub const LLAMA: Variant = Variant {
    name: "llama",
    class: "LlamaForCausalLM",
    qkv_bias: false,
    window: false,
    window_by_default: false,
    defaults: HfDefaults {
        vocab_size: 32_000,
        hidden_size: 4096,
        intermediate_size: 11_008,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: None,
        max_position_embeddings: 2048,
        sliding_window: None,
    },
};
/// Mistral.
pub const MISTRAL: Variant = Variant {
    name: "mistral",
    class: "MistralForCausalLM",
    qkv_bias: false,
    window: true,
    window_by_default: true,
    defaults: HfDefaults {
        vocab_size: 32_000,
        hidden_size: 4096,
        intermediate_size: 14_336,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: Some(8),
        max_position_embeddings: 131_072,
        sliding_window: Some(4096),
    },
};
/// Qwen2 (and Qwen2.5).
pub const QWEN2: Variant = Variant {
    name: "qwen2",
    class: "Qwen2ForCausalLM",
    qkv_bias: true,
    window: true,
    window_by_default: false,
    defaults: HfDefaults {
        vocab_size: 151_936,
        hidden_size: 4096,
        intermediate_size: 22_016,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: Some(32),
        max_position_embeddings: 32_768,
        sliding_window: Some(4096),
    },
};

/// Llama's entry in the registry.
pub const ARCHITECTURE: Architecture = Architecture {
    name: LLAMA.name,
    source: "llama",
    build: |c| Llama::build(LLAMA, c),
    for_params: |p| Llama::for_params(LLAMA, p),
    from_hf_config: |j| Llama::from_hf_config(LLAMA, j),
};
/// Mistral's entry in the registry.
pub const ARCHITECTURE_MISTRAL: Architecture = Architecture {
    name: MISTRAL.name,
    source: "llama",
    build: |c| Llama::build(MISTRAL, c),
    for_params: |p| Llama::for_params(MISTRAL, p),
    from_hf_config: |j| Llama::from_hf_config(MISTRAL, j),
};
/// Qwen2's entry in the registry.
pub const ARCHITECTURE_QWEN2: Architecture = Architecture {
    name: QWEN2.name,
    source: "llama",
    build: |c| Llama::build(QWEN2, c),
    for_params: |p| Llama::for_params(QWEN2, p),
    from_hf_config: |j| Llama::from_hf_config(QWEN2, j),
};

/// A model of the family, of one shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Llama {
    /// Which member.
    pub variant: Variant,
    /// Vocabulary.
    pub vocab: usize,
    /// Tokens in a sequence.
    pub seq: usize,
    /// Hidden size (`heads x head_dim`).
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// The MLP's inner width.
    pub ffn: usize,
    /// Blocks.
    pub layers: usize,
    /// The rotary base.
    pub rope_theta: f64,
    /// Llama 3's frequency scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// RMSNorm's epsilon.
    pub norm_eps: f64,
    /// Whether the LM head is the token embedding.
    pub tied: bool,
    /// Positions the model was made for (at least `seq`).
    pub max_positions: usize,
    /// The attention window, if any (at least `seq`).
    pub sliding_window: Option<usize>,
    /// Rows of the head's logits at once.
    pub(crate) logit_rows: usize,
    /// The rotary frequencies (`head_dim / 2`).
    inv_freq: Vec<f32>,
}

/// The default MLP width for a hidden size: 8/3 of it, rounded up to a
/// multiple of 64.
/// Llama 3's published shapes (3.2 1B and 3B, 3.1 8B, 70B and 405B):
/// hidden, layers, heads, key/value heads, MLP width, tied head.
const LLAMA3_SHAPES: [(usize, usize, usize, usize, usize, bool); 5] = [
    (2048, 16, 32, 8, 8192, true),
    (3072, 28, 24, 8, 8192, true),
    (4096, 32, 32, 8, 14336, false),
    (8192, 80, 64, 8, 28672, false),
    (16384, 126, 128, 8, 53248, false),
];

/// The Llama 3 shape nearest `params` (by ratio), when one is within 1.5x
/// of it: `--params 70B` is Llama 3 70B, not a dense table's shape.
fn llama3_shape(params: f64) -> Option<ModelConfig> {
    let config = |&(hidden, layers, heads, kv_heads, ffn, tied): &(
        usize,
        usize,
        usize,
        usize,
        usize,
        bool,
    )| ModelConfig {
        arch: Arch::named(LLAMA.name).expect("llama is registered"),
        vocab: 128_256,
        seq: 2048,
        hidden,
        heads,
        layers,
        kv_heads: Some(kv_heads),
        ffn: Some(ffn),
        rope_theta: Some(500_000.0),
        tie_embeddings: Some(tied),
        ..ModelConfig::default()
    };
    let count = |c: &ModelConfig| c.build().map(|m| m.params() as f64).ok();
    LLAMA3_SHAPES
        .iter()
        .map(config)
        .filter_map(|c| Some((count(&c)?, c)))
        .map(|(n, c)| ((n / params).ln().abs(), c))
        .filter(|(distance, _)| *distance <= 1.5f64.ln())
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, c)| c)
}

fn default_ffn(hidden: usize) -> usize {
    (8 * hidden).div_ceil(3).next_multiple_of(64)
}

/// transformers' rotary frequencies for `head_dim` and `theta`, scaled as
/// Llama 3 says when it does (`_compute_llama3_parameters`).
pub fn inv_freq(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            // transformers: 1 / theta^(2i / d) in f32.
            let exponent = (2 * i) as f32 / head_dim as f32;
            let base = 1.0 / (theta as f32).powf(exponent);
            let Some(s) = scaling else {
                return base;
            };
            let (low_wavelen, high_wavelen) = (
                s.original_max_positions as f64 / s.low_freq_factor,
                s.original_max_positions as f64 / s.high_freq_factor,
            );
            let wavelen = 2.0 * std::f64::consts::PI / f64::from(base);
            let scaled = if wavelen > low_wavelen {
                f64::from(base) / s.factor
            } else {
                f64::from(base)
            };
            if wavelen < high_wavelen || wavelen > low_wavelen {
                return scaled as f32;
            }
            let smooth = (s.original_max_positions as f64 / wavelen - s.low_freq_factor)
                / (s.high_freq_factor - s.low_freq_factor);
            ((1.0 - smooth) * scaled / s.factor + smooth * scaled) as f32
        })
        .collect()
}

// A block's parameters, in layout order.
const LN1: usize = 0;
const Q_W: usize = 1;
const V_W: usize = 3;
const Q_B: usize = 4;
const V_B: usize = 6;
const O_W: usize = 7;
const LN2: usize = 8;
const GATE_W: usize = 9;
const UP_W: usize = 10;
const DOWN_W: usize = 11;
/// The norms and biases (read in f32, not decayed).
const VECTORS: [usize; 5] = [LN1, Q_B, 5, V_B, LN2];

// The outer group's parameters.
const EMBED: usize = 0;
const NORM: usize = 1;
const LM_HEAD: usize = 2;

impl Llama {
    /// The shape `[model]` gives, with the variant's defaults, checked.
    pub fn new(variant: Variant, config: &ModelConfig) -> Result<Llama> {
        if !variant.window
            && let Some(window) = config.sliding_window
        {
            return Err(bad(
                "model.sliding_window",
                window,
                format!("{} has no attention window: leave it out", variant.name),
            ));
        }
        let heads = config.heads;
        let mut model = Llama {
            variant,
            vocab: config.vocab,
            seq: config.seq,
            hidden: config.hidden,
            heads,
            kv_heads: config.kv_heads.unwrap_or(heads),
            ffn: config.ffn.unwrap_or(default_ffn(config.hidden)),
            layers: config.layers,
            rope_theta: config.rope_theta.unwrap_or(HF_ROPE_THETA),
            rope_scaling: config.rope_scaling,
            norm_eps: config.norm_eps.unwrap_or(HF_NORM_EPS),
            tied: config.tie_embeddings.unwrap_or(false),
            max_positions: config.max_positions.unwrap_or(config.seq),
            sliding_window: config.sliding_window,
            logit_rows: 1,
            inv_freq: Vec::new(),
        };
        model.validate()?;
        model.logit_rows = (LOGITS_CHUNK_ELEMS / model.vocab).max(1);
        model.inv_freq = inv_freq(
            model.head_dim(),
            model.rope_theta,
            model.rope_scaling.as_ref(),
        );
        Ok(model)
    }

    fn build(variant: Variant, config: &ModelConfig) -> Result<Box<dyn Model>> {
        Ok(Box::new(Llama::new(variant, config)?))
    }

    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads.max(1)
    }

    /// Width of the keys (and the values).
    fn kv_hidden(&self) -> usize {
        self.kv_heads * self.head_dim()
    }

    /// Width of a packed query | key | value row.
    fn qkv_width(&self) -> usize {
        self.hidden + 2 * self.kv_hidden()
    }

    /// Checks the shape; the error names the key.
    pub fn validate(&self) -> Result<()> {
        check_sizes(&[
            ("model.vocab", self.vocab, VOCAB_MAX),
            ("model.seq", self.seq, SEQ_MAX),
            ("model.hidden", self.hidden, HIDDEN_MAX),
            ("model.heads", self.heads, self.hidden.max(1)),
            ("model.kv_heads", self.kv_heads, self.heads.max(1)),
            ("model.ffn", self.ffn, FFN_MAX),
            ("model.layers", self.layers, LAYERS_MAX),
        ])?;
        if !self.hidden.is_multiple_of(self.heads) || !self.head_dim().is_multiple_of(2) {
            return Err(bad(
                "model.hidden",
                self.hidden,
                format!(
                    "it must be model.heads ({}) times an even head size (rotary embeddings turn pairs)",
                    self.heads
                ),
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(bad(
                "model.kv_heads",
                self.kv_heads,
                format!("it must divide model.heads ({})", self.heads),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(bad(
                "model.rope_theta",
                self.rope_theta,
                "give the rotary base, above 1 (10000 for Llama 2, 500000 for Llama 3)",
            ));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0 && self.norm_eps < 1.0) {
            return Err(bad(
                "model.norm_eps",
                self.norm_eps,
                "give RMSNorm's epsilon, between 0 and 1 (1e-6 or 1e-5)",
            ));
        }
        if let Some(s) = &self.rope_scaling {
            let finite = [s.factor, s.low_freq_factor, s.high_freq_factor]
                .iter()
                .all(|v| v.is_finite() && *v > 0.0);
            if !finite || s.high_freq_factor <= s.low_freq_factor || s.original_max_positions == 0 {
                return Err(bad(
                    "model.rope_scaling",
                    format!("{s:?}"),
                    "give factor, low_freq_factor < high_freq_factor (all positive) and original_max_positions >= 1, as Llama 3's config.json does",
                ));
            }
        }
        if self.seq > self.max_positions {
            return Err(bad(
                "model.seq",
                self.seq,
                format!(
                    "the model was made for at most {} positions (model.max_positions): train on that many or fewer",
                    self.max_positions
                ),
            ));
        }
        if let Some(window) = self.sliding_window
            && self.seq > window
        {
            return Err(bad(
                "model.sliding_window",
                window,
                format!(
                    "strata attends over whole sequences: a sequence of {} tokens does not fit the window; use model.seq <= {window}",
                    self.seq
                ),
            ));
        }
        Ok(())
    }

    /// A standard shape of about `params` parameters: for Llama, the Llama 3
    /// shape within 1.5x of it; otherwise (or past them) the dense table's
    /// layers, hidden size and heads with the variant's MLP (8/3 x
    /// hidden), grouped-query heads (8 key/value heads from 32 heads up),
    /// at 2048 tokens with Llama 3's vocabulary and an untied head.
    fn for_params(variant: Variant, params: f64) -> Result<ModelConfig> {
        if variant.name == LLAMA.name
            && let Some(shape) = llama3_shape(params)
        {
            return Ok(shape);
        }
        let dense = strata_scheduler::Model::for_params(params)?;
        let heads = dense.heads as usize;
        Ok(ModelConfig {
            arch: Arch::named(variant.name)?,
            vocab: 128_256,
            seq: dense.seq as usize,
            hidden: dense.hidden as usize,
            heads,
            layers: dense.layers as usize,
            kv_heads: Some(if heads >= 32 { 8 } else { heads }),
            ffn: Some(default_ffn(dense.hidden as usize)),
            rope_theta: Some(500_000.0),
            tie_embeddings: Some(false),
            ..ModelConfig::default()
        })
    }

    /// The parameter layout of one block.
    fn block_parts(&self) -> Parts<12> {
        let (h, f, kv) = (self.hidden, self.ffn, self.kv_hidden());
        let b = usize::from(self.variant.qkv_bias);
        Parts::new([
            h,
            h * h,
            kv * h,
            kv * h,
            b * h,
            b * kv,
            b * kv,
            h * h,
            h,
            f * h,
            f * h,
            h * f,
        ])
    }

    /// The outer group's layout: the embedding, the final norm, an untied
    /// head (empty when tied).
    fn outer_parts(&self) -> Parts<3> {
        let table = self.vocab * self.hidden;
        Parts::new([table, self.hidden, if self.tied { 0 } else { table }])
    }

    fn outer_group(&self) -> GroupSpec {
        let (v, h, parts) = (self.vocab, self.hidden, self.outer_parts());
        let mut tensors = vec![
            TensorSpec {
                name: "model.embed_tokens.weight".into(),
                shape: vec![v, h],
                range: parts.range(EMBED),
                decays: true,
                reads_f32: true,
            },
            TensorSpec {
                name: "model.norm.weight".into(),
                shape: vec![h],
                range: parts.range(NORM),
                decays: false,
                reads_f32: true,
            },
        ];
        if !self.tied {
            tensors.push(TensorSpec {
                name: "lm_head.weight".into(),
                shape: vec![v, h],
                range: parts.range(LM_HEAD),
                decays: true,
                reads_f32: false,
            });
        }
        GroupSpec {
            name: "embed".into(),
            tensors,
        }
    }

    fn block_group(&self, b: usize) -> GroupSpec {
        let (h, f, kv) = (self.hidden, self.ffn, self.kv_hidden());
        let parts = self.block_parts();
        let names: [(&str, Vec<usize>); 12] = [
            ("input_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.q_proj.bias", vec![h]),
            ("self_attn.k_proj.bias", vec![kv]),
            ("self_attn.v_proj.bias", vec![kv]),
            ("self_attn.o_proj.weight", vec![h, h]),
            ("post_attention_layernorm.weight", vec![h]),
            ("mlp.gate_proj.weight", vec![f, h]),
            ("mlp.up_proj.weight", vec![f, h]),
            ("mlp.down_proj.weight", vec![h, f]),
        ];
        GroupSpec {
            name: format!("block{b}"),
            tensors: names
                .into_iter()
                .enumerate()
                .filter(|(i, _)| parts.lens[*i] > 0)
                .map(|(i, (name, shape))| {
                    let vector = VECTORS.contains(&i);
                    TensorSpec {
                        name: format!("model.layers.{b}.{name}"),
                        shape,
                        range: parts.range(i),
                        decays: !vector,
                        reads_f32: vector,
                    }
                })
                .collect(),
        }
    }

    fn attention_shape(&self, batch: usize) -> Attention {
        Attention {
            batch,
            seq: self.seq,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim(),
        }
    }

    /// What a block keeps: its input, the first norm's output and 1/rms,
    /// the turned q | k | v, what attention saves, attention's output, the
    /// residual after it, the second norm's output and 1/rms, gate | up,
    /// the SwiGLU's output.
    fn activation_parts(
        &self,
        backend: &dyn Backend,
        batch: usize,
        dtype: Dtype,
    ) -> TypedParts<11> {
        let (n, h, f) = (batch * self.seq, self.hidden, self.ffn);
        let saved = backend.attention_saved_elems(self.attention_shape(batch));
        TypedParts::new(
            dtype,
            [
                (n * h, dtype),
                (n * h, dtype),
                (n, Dtype::F32),
                (n * self.qkv_width(), dtype),
                (saved, Dtype::F32),
                (n * h, dtype),
                (n * h, dtype),
                (n * h, dtype),
                (n, Dtype::F32),
                (n * 2 * f, dtype),
                (n * f, dtype),
            ],
        )
    }

    /// A block's working buffers: attention's workspace, the rotary
    /// frequencies, then the gradients of attention's output, q | k | v,
    /// the first residual, the second norm's output, gate | up, the
    /// SwiGLU's output and the first norm's output.
    fn scratch_parts(&self, backend: &dyn Backend, batch: usize, dtype: Dtype) -> TypedParts<9> {
        let (n, h, f) = (batch * self.seq, self.hidden, self.ffn);
        let workspace = backend.attention_workspace_elems(self.attention_shape(batch));
        TypedParts::new(
            dtype,
            [
                (workspace, Dtype::F32),
                (self.head_dim() / 2, Dtype::F32),
                (n * h, dtype),
                (n * self.qkv_width(), dtype),
                (n * h, dtype),
                (n * h, dtype),
                (n * 2 * f, dtype),
                (n * f, dtype),
                (n * h, dtype),
            ],
        )
    }

    /// A block's second half over `n` rows: `out = x1 + down(swiglu(gate
    /// | up(rms_norm(x1))))`, keeping its norm's output and 1/rms, gate |
    /// up and the SwiGLU's output in `[c, r2, gu, m]`.
    fn mlp(
        &self,
        backend: &dyn Backend,
        params: Weights<'_>,
        n: usize,
        x1: View<'_>,
        [mut c, r2, mut gu, mut m]: [ViewMut<'_>; 4],
        mut out: ViewMut<'_>,
    ) -> Result<()> {
        let (parts, p) = (self.block_parts(), self.block_views(params));
        backend.rms_norm(x1, p[LN2], self.norm_eps as f32, c.reborrow(), r2)?;
        let w_gate_up = params.compute.range(parts.span(GATE_W, UP_W));
        linear(backend, c.view(), w_gate_up, None, n, gu.reborrow())?;
        backend.swiglu(
            gu.view().matrix(n, 2 * self.ffn)?,
            m.reborrow().matrix(n, self.ffn)?,
        )?;
        linear(backend, m.view(), p[DOWN_W], None, n, out.reborrow())?;
        backend.add(out, x1)?;
        Ok(())
    }

    /// One decoding step's working rows (f32): the first norm's output and
    /// 1/rms, q | k | v, the rotary frequencies, attention's output, the
    /// residual after it, the second norm's output and 1/rms, gate | up,
    /// the SwiGLU's output.
    fn decode_parts(&self) -> Parts<10> {
        let (h, f) = (self.hidden, self.ffn);
        Parts::new([
            h,
            1,
            self.qkv_width(),
            self.head_dim() / 2,
            h,
            h,
            h,
            1,
            2 * f,
            f,
        ])
    }

    /// The head's buffers: the final norm's output and 1/rms, a chunk's
    /// logits and their gradient, the norm output's gradient.
    fn head_parts(&self, rows: usize, dtype: Dtype) -> TypedParts<5> {
        let (n, h) = (rows, self.hidden);
        let chunk = self.logit_rows.min(n) * self.vocab;
        TypedParts::new(
            dtype,
            [
                (n * h, dtype),
                (n, Dtype::F32),
                (chunk, dtype),
                (chunk, dtype),
                (n * h, dtype),
            ],
        )
    }

    /// Each block tensor's view: matrices in the compute dtype, the rest
    /// f32.
    fn block_views<'a>(&self, weights: Weights<'a>) -> [View<'a>; 12] {
        let parts = self.block_parts();
        let (f32s, compute) = (parts.views(weights.f32), parts.views(weights.compute));
        std::array::from_fn(|i| match VECTORS.contains(&i) {
            true => f32s[i],
            false => compute[i],
        })
    }

    /// The head's weight (`vocab x hidden`, compute dtype): the
    /// embedding's when tied.
    fn head_weight<'a>(&self, outer: Weights<'a>) -> View<'a> {
        let parts = self.outer_parts();
        outer
            .compute
            .range(parts.range(if self.tied { EMBED } else { LM_HEAD }))
    }
}

/// `y = x w^T (+ b)`: a linear layer of Hugging Face's `out x in` weight,
/// `x` `rows x in`.
fn linear(
    backend: &dyn Backend,
    x: View<'_>,
    w: View<'_>,
    bias: Option<View<'_>>,
    rows: usize,
    y: ViewMut<'_>,
) -> Result<()> {
    let inputs = x.len() / rows.max(1);
    let outputs = w.len() / inputs.max(1);
    let (a, b) = (
        Matrix::n(x.matrix(rows, inputs)?),
        Matrix::t(w.matrix(outputs, inputs)?),
    );
    let c = y.matrix(rows, outputs)?;
    match bias {
        Some(bias) => backend.gemm_bias(a, b, bias, c)?,
        None => backend.gemm(a, b, 1.0, 0.0, c)?,
    }
    Ok(())
}

/// A linear layer's backward: `dw += dy^T x` (and `db += colsum(dy)`),
/// then `dx = dy w`.
#[allow(clippy::too_many_arguments)]
fn linear_backward(
    backend: &dyn Backend,
    x: View<'_>,
    w: View<'_>,
    dy: View<'_>,
    rows: usize,
    dw: ViewMut<'_>,
    db: Option<ViewMut<'_>>,
    dx: ViewMut<'_>,
) -> Result<()> {
    let inputs = x.len() / rows.max(1);
    let outputs = w.len() / inputs.max(1);
    let dy_m = dy.matrix(rows, outputs)?;
    backend.gemm(
        Matrix::t(dy_m),
        Matrix::n(x.matrix(rows, inputs)?),
        1.0,
        1.0,
        dw.matrix(outputs, inputs)?,
    )?;
    if let Some(db) = db {
        backend.bias_grad(dy, db)?;
    }
    backend.gemm(
        Matrix::n(dy_m),
        Matrix::n(w.matrix(outputs, inputs)?),
        1.0,
        0.0,
        dx.matrix(rows, inputs)?,
    )?;
    Ok(())
}

/// `key` of `config.json` as a whole number; `default` where the key is
/// absent or null (transformers' class takes its default for both).
fn size_or(json: &serde_json::Value, key: &'static str, default: usize) -> Result<usize> {
    match json.get(key) {
        None | Some(serde_json::Value::Null) => Ok(default),
        Some(_) => size(json, key),
    }
}

/// transformers' `LlamaConfig` and its kin, read: a whole number under
/// `key`.
fn size(json: &serde_json::Value, key: &'static str) -> Result<usize> {
    json.get(key)
        .and_then(serde_json::Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| {
            bad(
                key,
                json.get(key).map_or("(none)".into(), |v| v.to_string()),
                "the config gives it as a whole number",
            )
        })
}

impl Llama {
    /// The `[model]` table of a `config.json` of this variant: its shape,
    /// rotary base and scaling (transformers 4's `rope_theta` and
    /// `rope_scaling`, or 5's `rope_parameters`), norm epsilon, tied head,
    /// positions and window. What strata does not compute that way is
    /// refused by key: another activation than SiLU, biases Llama does not
    /// have, a head size other than hidden / heads, a `rope_type` other
    /// than `default` and `llama3`.
    fn from_hf_config(variant: Variant, json: &serde_json::Value) -> Result<ModelConfig> {
        let null = serde_json::Value::Null;
        let get = |key: &str| json.get(key).unwrap_or(&null);
        let refuse = |key: &'static str, value: &serde_json::Value, fix: &str| {
            Err(bad(
                key,
                value,
                format!("{fix}: strata's {} computes only that", variant.name),
            ))
        };
        let d = variant.defaults;
        let (hidden, heads) = (
            size_or(json, "hidden_size", d.hidden_size)?,
            size_or(json, "num_attention_heads", d.num_attention_heads)?,
        );
        match get("hidden_act") {
            serde_json::Value::Null => {}
            v if v.as_str() == Some("silu") => {}
            v => return refuse("hidden_act", v, "give \"silu\""),
        }
        for key in ["attention_bias", "mlp_bias"] {
            match get(key) {
                serde_json::Value::Null | serde_json::Value::Bool(false) => {}
                v => {
                    return refuse(
                        if key == "mlp_bias" {
                            "mlp_bias"
                        } else {
                            "attention_bias"
                        },
                        v,
                        "give false",
                    );
                }
            }
        }
        match get("head_dim") {
            serde_json::Value::Null => {}
            v if v.as_u64() == Some(0) || v.as_u64() == Some((hidden / heads.max(1)) as u64) => {}
            v => return refuse("head_dim", v, "give hidden_size / num_attention_heads"),
        }
        // transformers 5 keeps the rotary settings in rope_parameters; 4
        // in rope_theta and rope_scaling.
        let rope = match get("rope_parameters") {
            serde_json::Value::Null => get("rope_scaling"),
            parameters => parameters,
        };
        let theta = match (rope.get("rope_theta"), get("rope_theta")) {
            (Some(v), _) | (None, v) if !v.is_null() => Some(
                v.as_f64()
                    .ok_or_else(|| bad("rope_theta", v, "the config gives it as a number"))?,
            ),
            _ => Some(HF_ROPE_THETA),
        };
        let rope_type = rope
            .get("rope_type")
            .or_else(|| rope.get("type"))
            .unwrap_or(&null);
        let rope_scaling = match rope_type.as_str() {
            None | Some("default") => None,
            Some("llama3") => {
                let number = |key: &'static str| -> Result<f64> {
                    rope.get(key)
                        .and_then(serde_json::Value::as_f64)
                        .ok_or_else(|| {
                            bad(
                                key,
                                rope.get(key).unwrap_or(&null),
                                "Llama 3's rope scaling gives it as a number",
                            )
                        })
                };
                Some(RopeScaling {
                    factor: number("factor")?,
                    low_freq_factor: number("low_freq_factor")?,
                    high_freq_factor: number("high_freq_factor")?,
                    original_max_positions: number("original_max_position_embeddings")? as usize,
                })
            }
            Some(_) => {
                return refuse(
                    "rope_scaling.rope_type",
                    rope_type,
                    "give \"default\" or \"llama3\" (linear, dynamic, yarn and longrope are not computed)",
                );
            }
        };
        let window = match (
            variant.window,
            json.get("sliding_window"),
            get("use_sliding_window"),
        ) {
            (false, _, _) => None,
            // A window in the config that is not used (Qwen2's, unless
            // use_sliding_window says so).
            (true, _, serde_json::Value::Bool(false)) => None,
            (true, _, serde_json::Value::Null) if !variant.window_by_default => None,
            // Absent: the class's default; null: no window.
            (true, None, _) => d.sliding_window,
            (true, Some(serde_json::Value::Null), _) => None,
            (true, Some(v), _) => Some(v.as_u64().ok_or_else(|| {
                bad(
                    "sliding_window",
                    v,
                    "the config gives it as a whole number or null",
                )
            })? as usize),
        };
        // Sequences as long as the model takes (within its window); a run
        // may train on fewer (`model.seq`).
        let max_positions = size_or(json, "max_position_embeddings", d.max_position_embeddings)?;
        let seq = max_positions.min(window.unwrap_or(usize::MAX));
        let config = ModelConfig {
            arch: Arch::named(variant.name)?,
            init_from: None,
            vocab: size_or(json, "vocab_size", d.vocab_size)?,
            seq,
            hidden,
            heads,
            layers: size_or(json, "num_hidden_layers", d.num_hidden_layers)?,
            // Absent: the class's default (Mistral's 8, Qwen2's 32);
            // null: one per query head, as transformers takes None.
            kv_heads: Some(match json.get("num_key_value_heads") {
                None => d.num_key_value_heads.unwrap_or(heads),
                Some(serde_json::Value::Null) => heads,
                Some(_) => size(json, "num_key_value_heads")?,
            }),
            ffn: Some(size_or(json, "intermediate_size", d.intermediate_size)?),
            rope_theta: theta,
            rope_scaling,
            norm_eps: match get("rms_norm_eps") {
                serde_json::Value::Null => Some(HF_NORM_EPS),
                v => Some(
                    v.as_f64()
                        .ok_or_else(|| bad("rms_norm_eps", v, "the config gives it as a number"))?,
                ),
            },
            tie_embeddings: match get("tie_word_embeddings") {
                serde_json::Value::Null => Some(false),
                v => Some(v.as_bool().ok_or_else(|| {
                    bad("tie_word_embeddings", v, "the config gives true or false")
                })?),
            },
            max_positions: (seq != max_positions).then_some(max_positions),
            sliding_window: window,
        };
        Llama::new(variant, &config)?;
        Ok(config)
    }
}

impl Model for Llama {
    fn arch(&self) -> &'static str {
        self.variant.name
    }

    fn seq(&self) -> usize {
        self.seq
    }

    fn vocab(&self) -> usize {
        self.vocab
    }

    fn layers(&self) -> usize {
        self.layers
    }

    fn stream_width(&self) -> usize {
        self.hidden
    }

    fn groups(&self) -> Vec<GroupSpec> {
        let blocks = (0..self.layers).map(|b| self.block_group(b));
        std::iter::once(self.outer_group()).chain(blocks).collect()
    }

    fn init(&self, g: usize, seed: u64, out: &mut [f32]) {
        // transformers' `_init_weights`: normal (0, 0.02) matrices, norms
        // 1, biases 0.
        let mut rng = SplitMix64(seed ^ (g as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let group = if g == 0 {
            self.outer_group()
        } else {
            self.block_group(g - 1)
        };
        for tensor in &group.tensors {
            let piece = &mut out[tensor.range.clone()];
            if tensor.decays {
                fill_normal(piece, 0.02, &mut rng);
            } else if tensor.shape.len() == 1 && tensor.name.ends_with("norm.weight") {
                piece.fill(1.0);
            } else {
                piece.fill(0.0);
            }
        }
    }

    fn block_forward_flops(&self, tokens: usize) -> f64 {
        let (h, f) = (self.hidden as f64, self.ffn as f64);
        let qkv = h * self.qkv_width() as f64;
        2.0 * tokens as f64 * (qkv + h * h + 3.0 * h * f)
    }

    fn outer_costs(&self) -> OuterCosts {
        // The head's three products of the vocabulary against a block's
        // forward; lookups are small.
        let block = self.block_forward_flops(1);
        OuterCosts {
            embed: 0.05,
            head: 6.0 * (self.vocab * self.hidden) as f64 / block,
        }
    }

    fn buffers(&self, backend: &dyn Backend, batch: usize, dtype: Dtype) -> Result<Buffers> {
        let acts = self.activation_parts(backend, batch, dtype);
        Ok(Buffers {
            batch,
            input_elems: acts.lens[0],
            acts: acts.alloc(backend)?,
            scratch: self.scratch_parts(backend, batch, dtype).alloc(backend)?,
            head: self.head_parts(batch * self.seq, dtype).alloc(backend)?,
            head_rows: batch * self.seq,
        })
    }

    fn head_buffers(&self, backend: &dyn Backend, rows: usize) -> Result<Buffers> {
        Ok(Buffers {
            batch: 0,
            input_elems: 0,
            acts: backend.alloc(Dtype::F32, 0)?,
            scratch: backend.alloc(Dtype::F32, 0)?,
            head: self.head_parts(rows, Dtype::F32).alloc(backend)?,
            head_rows: rows,
        })
    }

    fn embed_forward(
        &self,
        backend: &dyn Backend,
        outer: View<'_>,
        tokens: View<'_>,
        position_ids: View<'_>,
        x: ViewMut<'_>,
    ) -> Result<()> {
        let parts = self.outer_parts();
        expect_len("embedding parameters", outer.len(), parts.total())?;
        let table = outer.range(parts.range(EMBED));
        backend.embedding(table, outer.range(0..0), tokens, position_ids, self.seq, x)?;
        Ok(())
    }

    fn block_forward(
        &self,
        backend: &dyn Backend,
        batch: usize,
        position_ids: View<'_>,
        params: Weights<'_>,
        x: View<'_>,
        buffers: &mut Buffers,
        out: ViewMut<'_>,
    ) -> Result<()> {
        let (n, h) = (batch * self.seq, self.hidden);
        let parts = self.block_parts();
        params.check("block parameters", parts.total())?;
        expect_len("block input", x.len(), n * h)?;
        expect_len("block output", out.len(), n * h)?;
        let p = self.block_views(params);
        let weights = params.compute;
        let dtype = buffers.dtype();
        let [workspace, mut freq, ..] = self
            .scratch_parts(backend, batch, dtype)
            .split(buffers.scratch.view_mut());
        let [
            input,
            mut a,
            r1,
            mut qkv,
            saved,
            mut att,
            mut x1,
            c,
            r2,
            gu,
            m,
        ] = self
            .activation_parts(backend, batch, dtype)
            .split(buffers.acts.view_mut());
        let eps = self.norm_eps as f32;
        backend.copy(x, input)?;
        backend.rms_norm(x, p[LN1], eps, a.reborrow(), r1)?;
        let bias = self
            .variant
            .qkv_bias
            .then(|| params.f32.range(parts.span(Q_B, V_B)));
        let w_qkv = weights.range(parts.span(Q_W, V_W));
        linear(backend, a.view(), w_qkv, bias, n, qkv.reborrow())?;
        let shape = self.attention_shape(batch);
        backend.upload(View::host_slice(&self.inv_freq), freq.reborrow())?;
        backend.rotary(shape, position_ids, freq.view(), false, qkv.reborrow())?;
        backend.attention(
            shape,
            position_ids,
            qkv.view(),
            att.reborrow(),
            saved,
            workspace,
        )?;
        linear(backend, att.view(), p[O_W], None, n, x1.reborrow())?;
        backend.add(x1.reborrow(), x)?;
        self.mlp(backend, params, n, x1.view(), [c, r2, gu, m], out)
    }

    fn block_backward(
        &self,
        backend: &dyn Backend,
        batch: usize,
        position_ids: View<'_>,
        params: Weights<'_>,
        dout: View<'_>,
        buffers: &mut Buffers,
        mut dx: ViewMut<'_>,
        dparams: ViewMut<'_>,
    ) -> Result<()> {
        let (n, h, f) = (batch * self.seq, self.hidden, self.ffn);
        let parts = self.block_parts();
        params.check("block parameters", parts.total())?;
        expect_len("block gradients", dparams.len(), parts.total())?;
        expect_len("block output gradient", dout.len(), n * h)?;
        expect_len("block input gradient", dx.len(), n * h)?;
        let p = self.block_views(params);
        let weights = params.compute;
        let dtype = buffers.dtype();
        let [x, a, r1, qkv, saved, att, x1, c, r2, gu, m] = self
            .activation_parts(backend, batch, dtype)
            .views(buffers.acts.view());
        // The gradients, cut as the backward writes them: ln1, q | k | v,
        // their biases, o, ln2, gate | up, down.
        let lens = parts.lens;
        let [dln1, dw_qkv, db_qkv, dw_o, dln2, dw_gate_up, dw_down] = dparams.split_parts([
            lens[LN1],
            lens[Q_W] + lens[2] + lens[V_W],
            lens[Q_B] + lens[5] + lens[V_B],
            lens[O_W],
            lens[LN2],
            lens[GATE_W] + lens[UP_W],
            lens[DOWN_W],
        ]);
        let [
            workspace,
            mut freq,
            mut datt,
            mut dqkv,
            mut dx1,
            mut dc,
            mut dgu,
            mut dm,
            mut da,
        ] = self
            .scratch_parts(backend, batch, dtype)
            .split(buffers.scratch.view_mut());
        backend.upload(View::host_slice(&self.inv_freq), freq.reborrow())?;
        // The MLP.
        linear_backward(backend, m, p[DOWN_W], dout, n, dw_down, None, dm.reborrow())?;
        backend.swiglu_backward(
            dm.view().matrix(n, f)?,
            gu.matrix(n, 2 * f)?,
            dgu.reborrow().matrix(n, 2 * f)?,
        )?;
        let w_gate_up = weights.range(parts.span(GATE_W, UP_W));
        linear_backward(
            backend,
            c,
            w_gate_up,
            dgu.view(),
            n,
            dw_gate_up,
            None,
            dc.reborrow(),
        )?;
        backend.copy(dout, dx1.reborrow())?;
        backend.rms_norm_backward(dc.view(), x1, p[LN2], r2, dx1.reborrow(), dln2)?;
        // Attention.
        linear_backward(
            backend,
            att,
            p[O_W],
            dx1.view(),
            n,
            dw_o,
            None,
            datt.reborrow(),
        )?;
        let shape = self.attention_shape(batch);
        backend.attention_backward(
            shape,
            position_ids,
            qkv,
            att,
            saved,
            datt.view(),
            dqkv.reborrow(),
            workspace,
        )?;
        // The queries and keys were turned after the product: turn their
        // gradients back.
        backend.rotary(shape, position_ids, freq.view(), true, dqkv.reborrow())?;
        let w_qkv = weights.range(parts.span(Q_W, V_W));
        let db = self.variant.qkv_bias.then_some(db_qkv);
        linear_backward(backend, a, w_qkv, dqkv.view(), n, dw_qkv, db, da.reborrow())?;
        backend.copy(dx1.view(), dx.reborrow())?;
        backend.rms_norm_backward(da.view(), x, p[LN1], r1, dx, dln1)?;
        Ok(())
    }

    fn head_forward_backward(
        &self,
        backend: &dyn Backend,
        outer: Weights<'_>,
        x: View<'_>,
        targets: View<'_>,
        grad_scale: f32,
        buffers: &mut Buffers,
        mut dx: ViewMut<'_>,
        douter: ViewMut<'_>,
    ) -> Result<Readback> {
        let (h, v) = (self.hidden, self.vocab);
        let n = targets.len();
        let parts = self.outer_parts();
        outer.check("embedding parameters", parts.total())?;
        expect_len("embedding gradients", douter.len(), parts.total())?;
        expect_len("head input", x.len(), n * h)?;
        expect_len("head targets", n, buffers.batch * self.seq)?;
        let gamma = outer.f32.range(parts.range(NORM));
        let w = self.head_weight(outer);
        let w = w.matrix(v, h)?;
        let [mut hf, mut r, mut logits, mut dlogits, mut dhf] = self
            .head_parts(buffers.head_rows, buffers.dtype())
            .split(buffers.head.view_mut());
        backend.rms_norm(x, gamma, self.norm_eps as f32, hf.reborrow(), r.reborrow())?;
        // The gradients: the head's weight (the embedding's when tied), and
        // the final norm's.
        let [d_embed, mut dgamma, d_head] = douter.split_parts(parts.lens);
        let mut dw = if self.tied { d_embed } else { d_head };
        let mut losses = Vec::new();
        let mut start = 0;
        while start < n {
            let rows = self.logit_rows.min(n - start);
            let hf_c = hf
                .view()
                .range(start * h..(start + rows) * h)
                .matrix(rows, h)?;
            let mut logits_c = logits.reborrow().range(0..rows * v);
            let mut dlogits_c = dlogits.reborrow().range(0..rows * v);
            backend.gemm(
                Matrix::n(hf_c),
                Matrix::t(w),
                1.0,
                0.0,
                logits_c.reborrow().matrix(rows, v)?,
            )?;
            let share = rows as f64 / n as f64;
            let loss = backend.cross_entropy(
                logits_c.view(),
                targets.range(start..start + rows),
                grad_scale * share as f32,
                dlogits_c.reborrow(),
            )?;
            losses.push((loss, share));
            let dl = dlogits_c.view().matrix(rows, v)?;
            backend.gemm(
                Matrix::n(dl),
                Matrix::n(w),
                1.0,
                0.0,
                dhf.reborrow()
                    .range(start * h..(start + rows) * h)
                    .matrix(rows, h)?,
            )?;
            backend.gemm(
                Matrix::t(dl),
                Matrix::n(hf_c),
                1.0,
                1.0,
                dw.reborrow().matrix(v, h)?,
            )?;
            start += rows;
        }
        backend.zero(dx.reborrow())?;
        backend.rms_norm_backward(dhf.view(), x, gamma, r.view(), dx, dgamma.reborrow())?;
        Ok(if losses.len() == 1 {
            losses.pop().expect("one chunk").0
        } else {
            Readback::weighted_sum(losses)
        })
    }

    fn head_logits(
        &self,
        backend: &dyn Backend,
        outer: Weights<'_>,
        x: View<'_>,
        buffers: &mut Buffers,
        logits: ViewMut<'_>,
    ) -> Result<()> {
        let (h, v) = (self.hidden, self.vocab);
        let parts = self.outer_parts();
        outer.check("embedding parameters", parts.total())?;
        let n = x.len() / h;
        expect_len("head input", x.len(), n * h)?;
        expect_len("logits", logits.len(), n * v)?;
        let head = self.head_parts(buffers.head_rows, buffers.dtype());
        if n * h > head.lens[0] {
            expect_len("head buffers", head.lens[0], n * h)?;
        }
        let gamma = outer.f32.range(parts.range(NORM));
        let w = self.head_weight(outer);
        let [hf, r, ..] = head.split(buffers.head.view_mut());
        let (mut hf, r) = (hf.range(0..n * h), r.range(0..n));
        backend.rms_norm(x, gamma, self.norm_eps as f32, hf.reborrow(), r)?;
        backend.gemm(
            Matrix::n(hf.view().matrix(n, h)?),
            Matrix::t(w.matrix(v, h)?),
            1.0,
            0.0,
            logits.matrix(n, v)?,
        )?;
        Ok(())
    }

    fn kv_cache_elems(&self, capacity: usize) -> usize {
        2 * capacity * self.kv_hidden()
    }

    fn decode_scratch_elems(&self) -> usize {
        self.decode_parts().total()
    }

    fn block_decode(
        &self,
        backend: &dyn Backend,
        params: Weights<'_>,
        position: usize,
        x: View<'_>,
        cache: ViewMut<'_>,
        scratch: ViewMut<'_>,
        out: ViewMut<'_>,
    ) -> Result<()> {
        let h = self.hidden;
        let parts = self.block_parts();
        params.check("block parameters", parts.total())?;
        expect_len("block input", x.len(), h)?;
        expect_len("block output", out.len(), h)?;
        expect_len("decode scratch", scratch.len(), self.decode_scratch_elems())?;
        let p = self.block_views(params);
        let [mut a, r1, mut qkv, mut freq, mut att, mut x1, c, r2, gu, m] =
            self.decode_parts().split(scratch);
        backend.rms_norm(x, p[LN1], self.norm_eps as f32, a.reborrow(), r1)?;
        let bias = self
            .variant
            .qkv_bias
            .then(|| params.f32.range(parts.span(Q_B, V_B)));
        let w_qkv = params.compute.range(parts.span(Q_W, V_W));
        linear(backend, a.view(), w_qkv, bias, 1, qkv.reborrow())?;
        let shape = Attention {
            batch: 1,
            seq: 1,
            ..self.attention_shape(1)
        };
        let place = [u32::try_from(position).expect("positions fit u32")];
        backend.upload(View::host_slice(&self.inv_freq), freq.reborrow())?;
        backend.rotary(
            shape,
            View::host_slice(&place),
            freq.view(),
            false,
            qkv.reborrow(),
        )?;
        attend_cached(backend, shape, position, qkv.view(), cache, att.reborrow())?;
        linear(backend, att.view(), p[O_W], None, 1, x1.reborrow())?;
        backend.add(x1.reborrow(), x)?;
        self.mlp(backend, params, 1, x1.view(), [c, r2, gu, m], out)
    }

    fn embed_backward(
        &self,
        backend: &dyn Backend,
        tokens: View<'_>,
        position_ids: View<'_>,
        dx: View<'_>,
        douter: ViewMut<'_>,
    ) -> Result<()> {
        let parts = self.outer_parts();
        expect_len("embedding gradients", douter.len(), parts.total())?;
        let [dtable, none, _] =
            douter.split_parts([parts.lens[EMBED], 0, parts.lens[NORM] + parts.lens[LM_HEAD]]);
        backend.embedding_backward(tokens, position_ids, self.seq, dx, dtable, none)?;
        Ok(())
    }

    fn hf_config(&self) -> serde_json::Value {
        let mut config = serde_json::json!({
            "model_type": self.variant.name,
            "architectures": [self.variant.class],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim(),
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.map(|s| serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_positions,
            })),
            "tie_word_embeddings": self.tied,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "bos_token_id": null,
            "eos_token_id": null,
            "use_cache": true,
            "dtype": "float32",
            "torch_dtype": "float32",
        });
        let object = config.as_object_mut().expect("a JSON object");
        if self.variant.qkv_bias {
            object.insert(
                "use_sliding_window".into(),
                self.sliding_window.is_some().into(),
            );
            object.insert("max_window_layers".into(), self.layers.into());
        } else {
            object.insert("attention_bias".into(), false.into());
            object.insert("mlp_bias".into(), false.into());
        }
        if self.variant.window {
            object.insert("sliding_window".into(), self.sliding_window.into());
        }
        config
    }

    fn cost_model(&self, micro_batch: u64) -> strata_scheduler::Model {
        strata_scheduler::Model {
            micro_batch,
            kv_heads: self.kv_heads as u32,
            ffn: self.ffn as u64,
            gated_mlp: true,
            biases: false,
            qkv_biases: self.variant.qkv_bias,
            norm_params: self.hidden as u64,
            learned_positions: false,
            tied_head: self.tied,
            ..strata_scheduler::Model::dense(
                self.layers as u32,
                self.hidden as u64,
                self.heads as u32,
                self.seq as u64,
                self.vocab as u64,
            )
        }
    }
}

#[cfg(test)]
mod tests;
