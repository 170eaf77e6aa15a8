//! Hugging Face folders in and out. In ([`HfFolder`]): `config.json` and the weights
//! (`model.safetensors`, or shards named by `model.safetensors.index.json`)
//! of a model strata trains, mapped (memmap2), never read whole. A group's
//! tensors are converted to f32 straight from the mapped pages into the
//! caller's buffer, so loading a model needs one group's f32 values at a
//! time, not the model.
//!
//! Everything is checked before anything is read: each file's header,
//! every tensor a model's groups name (present, of its shape, in bf16,
//! fp16 or f32), and each shard the index names. An error names the file
//! and what to do. Out ([`ShardWriter`]): a model's tensors written as they
//! arrive into sharded safetensors with their index.

mod write;

pub use write::{Planned, ShardWriter, WeightsDtype};

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};

use crate::error::{Result, TrainError};
use crate::model::{GroupSpec, Model, ModelConfig};

/// The index of a sharded checkpoint.
pub const INDEX: &str = "model.safetensors.index.json";
/// A single-file checkpoint's weights.
pub const WEIGHTS: &str = "model.safetensors";
/// The most shards an index may name.
pub const SHARDS_MAX: usize = 1 << 16;
/// The largest `config.json` or index read.
const JSON_BYTES_MAX: u64 = 64 << 20;

/// One tensor of a mapped file.
#[derive(Debug, Clone)]
struct Entry {
    shard: usize,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    /// Its bytes in the file.
    start: usize,
    end: usize,
}

/// A mapped safetensors file.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    map: MappedFile,
}

/// A file mapped read only, whose pages are dropped from this process once
/// read ([`MappedFile::release`]): how a folder's shards and a resume's
/// optimizer shards are read without holding them in memory.
#[derive(Debug)]
pub(crate) struct MappedFile {
    map: memmap2::Mmap,
}

impl MappedFile {
    /// Maps `file` (opened for reading).
    pub(crate) fn map(file: &File) -> std::io::Result<MappedFile> {
        // A file changed under a run while it reads it is outside what
        // strata guards (as with any read).
        // SAFETY: the map is read only and lives as long as this value.
        let map = unsafe { memmap2::Mmap::map(file) }?;
        Ok(MappedFile { map })
    }

    /// Drops the pages of `start..start + len` from this process (a later
    /// read faults them in again from the file).
    pub(crate) fn release(&self, start: usize, len: usize) {
        // A private read-only file mapping: MADV_DONTNEED loses no write.
        // SAFETY: no reference into the range outlives this call's caller's read of it.
        let dropped = unsafe {
            self.map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len)
        };
        if let Err(err) = dropped {
            tracing::debug!("madvise(DONTNEED) of bytes {start}..{}: {err}", start + len);
        }
    }
}

impl MappedFile {
    /// [`MappedFile::release`] of `bytes`, a slice of this file's map.
    pub(crate) fn release_slice(&self, bytes: &[u8]) {
        let start = (bytes.as_ptr() as usize)
            .checked_sub(self.map.as_ptr() as usize)
            .filter(|start| start + bytes.len() <= self.map.len())
            .expect("a slice of this map");
        self.release(start, bytes.len());
    }
}

impl std::ops::Deref for MappedFile {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

/// A model and each of its groups' values in host memory, f32
/// ([`HfFolder::read_model`]).
pub type HostModel = (Box<dyn Model>, Vec<Vec<f32>>);

/// A Hugging Face model folder, opened: its config parsed, its weight
/// files mapped and their headers read.
#[derive(Debug)]
pub struct HfFolder {
    dir: PathBuf,
    config: serde_json::Value,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, Entry>,
}

fn error(path: &Path, problem: impl Into<String>, fix: impl Into<String>) -> TrainError {
    TrainError::HfFolder {
        path: path.to_path_buf(),
        problem: problem.into(),
        fix: fix.into(),
    }
}

/// A JSON file, parsed; the error names the file.
fn read_json(path: &Path) -> Result<serde_json::Value> {
    let len = std::fs::metadata(path)
        .map_err(|e| {
            error(
                path,
                format!("cannot be read ({e})"),
                "give the folder a Hugging Face model was saved to (save_pretrained)",
            )
        })?
        .len();
    if len > JSON_BYTES_MAX {
        return Err(error(
            path,
            format!("is {len} bytes, more than a model's JSON holds ({JSON_BYTES_MAX})"),
            "check that the file is what its name says",
        ));
    }
    let text = std::fs::read(path).map_err(|e| {
        error(
            path,
            format!("cannot be read ({e})"),
            "check its permissions",
        )
    })?;
    serde_json::from_slice(&text).map_err(|e| {
        error(
            path,
            format!("does not parse as JSON ({e})"),
            "restore the file from the model's source",
        )
    })
}

impl HfFolder {
    /// Opens `dir`: parses `config.json`, maps the weights (the index's
    /// shards, or `model.safetensors`) and reads every header.
    pub fn open(dir: &Path) -> Result<HfFolder> {
        if !dir.is_dir() {
            return Err(error(
                dir,
                "is not a directory",
                "give the folder a Hugging Face model was saved to (with config.json and its safetensors)",
            ));
        }
        let config = read_json(&dir.join("config.json"))?;
        let index_path = dir.join(INDEX);
        let files: Vec<String> = if index_path.exists() {
            let index = read_json(&index_path)?;
            let map = index
                .get("weight_map")
                .and_then(serde_json::Value::as_object)
                .ok_or_else(|| {
                    error(
                        &index_path,
                        "has no weight_map object",
                        "restore the file from the model's source",
                    )
                })?;
            let mut files: Vec<String> = Vec::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    error(
                        &index_path,
                        format!("names no file for {name}"),
                        "restore the file from the model's source",
                    )
                })?;
                if file.contains('/') || file.contains("..") {
                    return Err(error(
                        &index_path,
                        format!("names {file:?}, outside the folder"),
                        "a shard lies beside the index",
                    ));
                }
                if !files.iter().any(|f| f == file) {
                    files.push(file.to_string());
                }
            }
            files.sort();
            if files.len() > SHARDS_MAX {
                return Err(error(
                    &index_path,
                    format!("names {} shards", files.len()),
                    format!("strata reads at most {SHARDS_MAX}"),
                ));
            }
            files
        } else if dir.join(WEIGHTS).exists() {
            vec![WEIGHTS.to_string()]
        } else {
            return Err(error(
                dir,
                format!("has neither {WEIGHTS} nor {INDEX}"),
                "save the model's weights as safetensors (save_pretrained(dir, safe_serialization=True))",
            ));
        };
        let mut folder = HfFolder {
            dir: dir.to_path_buf(),
            config,
            shards: Vec::new(),
            tensors: BTreeMap::new(),
        };
        for file in files {
            folder.map(&file)?;
        }
        Ok(folder)
    }

    /// Maps `file` and reads its header's tensors.
    fn map(&mut self, file: &str) -> Result<()> {
        let path = self.dir.join(file);
        let handle = File::open(&path).map_err(|e| {
            error(
                &path,
                format!("cannot be opened ({e})"),
                "every shard the index names must be in the folder: download the missing one",
            )
        })?;
        let map = MappedFile::map(&handle).map_err(|e| {
            error(
                &path,
                format!("cannot be mapped ({e})"),
                "check the file system",
            )
        })?;
        let (header_len, metadata) = safetensors::SafeTensors::read_metadata(&map[..]).map_err(|e| {
            let problem = match e {
                safetensors::SafeTensorError::MetadataIncompleteBuffer => format!(
                    "is {} bytes, not the size its header describes (cut short, or with bytes after its data)",
                    map.len()
                ),
                e => format!(
                    "has a corrupt safetensors header at byte 0 (the header's length, then its JSON from byte 8): {e:?}"
                ),
            };
            error(&path, problem, "download the file again")
        })?;
        let data_start = 8 + header_len;
        let shard = self.shards.len();
        for (name, info) in metadata.tensors() {
            let (start, end) = info.data_offsets;
            let (start, end) = (data_start + start, data_start + end);
            if end > map.len() || start > end {
                return Err(error(
                    &path,
                    format!(
                        "says {name} lies at bytes {start}..{end}, past the file's {} bytes",
                        map.len()
                    ),
                    "download the file again (it is cut short)",
                ));
            }
            self.tensors.insert(
                name.clone(),
                Entry {
                    shard,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start,
                    end,
                },
            );
        }
        self.shards.push(Shard { path, map });
        Ok(())
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json`.
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// The `[model]` table `config.json` gives (its `model_type` picks the
    /// architecture); an architecture strata does not train is refused
    /// with the list it does.
    pub fn model_config(&self) -> Result<ModelConfig> {
        crate::model::from_hf_config(&self.config).map_err(|e| {
            let path = self.dir.join("config.json");
            match e {
                TrainError::Config { key, value, fix } => {
                    error(&path, format!("{key} = {value}"), fix)
                }
                other => error(&path, other.to_string(), "give a model strata trains"),
            }
        })
    }

    /// Bytes of the mapped weights.
    pub fn bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.map.len() as u64).sum()
    }

    /// The entry of `name`: the tensor of that name, or the one tensor
    /// named `<prefix>.<name>` with a one-word prefix (a model class may
    /// save its body under its base model's name).
    fn entry(&self, name: &str) -> Option<&Entry> {
        if let Some(entry) = self.tensors.get(name) {
            return Some(entry);
        }
        let mut found = self.tensors.iter().filter(|(key, _)| {
            key.strip_suffix(name)
                .and_then(|prefix| prefix.strip_suffix('.'))
                .is_some_and(|prefix| !prefix.is_empty() && !prefix.contains('.'))
        });
        match (found.next(), found.next()) {
            (Some((_, entry)), None) => Some(entry),
            _ => None,
        }
    }

    /// The folder's model (its `config.json`; `seq` tokens a sequence when
    /// given, at most its positions) with every parameter read into host
    /// memory as f32, a vector per group: for inference (evaluation,
    /// generation), not the tiered load a run does.
    pub fn read_model(&self, seq: Option<usize>) -> Result<HostModel> {
        let mut config = self.model_config()?;
        if let Some(seq) = seq {
            config.seq = seq;
        }
        let model = crate::model::build(&config)?;
        self.check(&*model)?;
        let groups = model
            .groups()
            .iter()
            .map(|group| {
                let mut values = vec![0f32; group.params()];
                self.read_group(group, &mut values)?;
                Ok(values)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((model, groups))
    }

    /// Checks that every tensor of `model`'s groups is in the folder, of
    /// its shape and of a dtype strata reads (before anything is written).
    pub fn check(&self, model: &dyn Model) -> Result<()> {
        for group in model.groups() {
            for tensor in &group.tensors {
                let Some(entry) = self.entry(&tensor.name) else {
                    return Err(error(
                        &self.dir,
                        format!("holds no tensor {}", tensor.name),
                        "the weights must be those of the model config.json describes",
                    ));
                };
                let path = &self.shards[entry.shard].path;
                if entry.shape != tensor.shape {
                    return Err(error(
                        path,
                        format!(
                            "holds {} of shape {:?}, but the config's model needs {:?}",
                            tensor.name, entry.shape, tensor.shape
                        ),
                        "the weights must be those of the model config.json describes",
                    ));
                }
                if !matches!(
                    entry.dtype,
                    safetensors::Dtype::BF16 | safetensors::Dtype::F16 | safetensors::Dtype::F32
                ) {
                    return Err(error(
                        path,
                        format!("holds {} as {:?}", tensor.name, entry.dtype),
                        "strata reads bf16, fp16 and f32 weights: convert the checkpoint (quantized ones are not trained)",
                    ));
                }
                let elems: usize = entry.shape.iter().product();
                let width = match entry.dtype {
                    safetensors::Dtype::F32 => 4,
                    _ => 2,
                };
                if entry.end - entry.start != elems * width {
                    return Err(error(
                        path,
                        format!(
                            "gives {} {} bytes for {elems} elements of {:?}",
                            tensor.name,
                            entry.end - entry.start,
                            entry.dtype
                        ),
                        "download the file again",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Reads the elements `range` of `group`'s flat f32 view (its tensors
    /// in layout order) into `out`, widened from the file's dtype. Call
    /// [`HfFolder::check`] first.
    pub fn read(
        &self,
        group: &GroupSpec,
        range: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        assert_eq!(out.len(), range.len(), "one f32 per element read");
        for tensor in &group.tensors {
            let (lo, hi) = (
                range.start.max(tensor.range.start),
                range.end.min(tensor.range.end),
            );
            if lo >= hi {
                continue;
            }
            let entry = self.entry(&tensor.name).ok_or_else(|| {
                error(
                    &self.dir,
                    format!("holds no tensor {}", tensor.name),
                    "check the folder first (HfFolder::check)",
                )
            })?;
            let bytes = &self.shards[entry.shard].map[entry.start..entry.end];
            let (from, to) = (lo - tensor.range.start, hi - tensor.range.start);
            let dst = &mut out[lo - range.start..hi - range.start];
            widen(entry.dtype, bytes, from, to, dst);
        }
        Ok(())
    }

    /// Gives back the mapped pages of `group`'s tensors (read once, they
    /// would otherwise stay in the process's memory until the folder is
    /// dropped): a load holds one group's pages at a time.
    pub fn release(&self, group: &GroupSpec) {
        for tensor in &group.tensors {
            let Some(entry) = self.entry(&tensor.name) else {
                continue;
            };
            // `read` borrows the map only while it copies.
            self.shards[entry.shard]
                .map
                .release(entry.start, entry.end - entry.start);
        }
    }

    /// Reads all of `group` into `out` (its [`GroupSpec::params`]).
    pub fn read_group(&self, group: &GroupSpec, out: &mut [f32]) -> Result<()> {
        self.read(group, 0..group.params(), out)
    }
}

/// `values` into `out` as f32, or as bf16 (to nearest even, in SIMD) when
/// `out` holds two bytes a value: [`widen`]'s way back, for states and
/// checkpoint weights alike.
pub(crate) fn narrow(values: &[f32], out: &mut [u8]) {
    if out.len() == 4 * values.len() {
        out.copy_from_slice(bytemuck::cast_slice(values));
        return;
    }
    debug_assert_eq!(out.len(), 2 * values.len());
    match bytemuck::try_cast_slice_mut::<u8, bf16>(out) {
        Ok(target) => strata_optim::narrow(
            strata_optim::Isa::chosen(),
            values,
            strata_optim::LowPrecisionMut::Bf16(target),
        ),
        // An odd address: element by element, the same rounding.
        Err(_) => {
            for (x, b) in values.iter().zip(out.chunks_exact_mut(2)) {
                b.copy_from_slice(&bf16::from_f32(*x).to_bits().to_ne_bytes());
            }
        }
    }
}

/// Elements `from..to` of little-endian `bytes` of `dtype` into `dst` as
/// f32: in SIMD where the bytes are aligned for their type (a mapped
/// file's tensors are, but for an f32 tensor after an odd count of 16-bit
/// elements), element by element otherwise.
pub(crate) fn widen(
    dtype: safetensors::Dtype,
    bytes: &[u8],
    from: usize,
    to: usize,
    dst: &mut [f32],
) {
    use strata_optim::{Isa, Values};
    let isa = Isa::chosen();
    let simd = match dtype {
        safetensors::Dtype::F32 => bytemuck::try_cast_slice::<u8, f32>(&bytes[4 * from..4 * to])
            .map(|v| dst.copy_from_slice(v))
            .is_ok(),
        safetensors::Dtype::BF16 => bytemuck::try_cast_slice::<u8, bf16>(&bytes[2 * from..2 * to])
            .map(|v| strata_optim::widen(isa, Values::Bf16(v), dst))
            .is_ok(),
        safetensors::Dtype::F16 => bytemuck::try_cast_slice::<u8, f16>(&bytes[2 * from..2 * to])
            .map(|v| strata_optim::widen(isa, Values::F16(v), dst))
            .is_ok(),
        _ => false,
    };
    if simd {
        return;
    }
    match dtype {
        safetensors::Dtype::F32 => {
            for (d, b) in dst.iter_mut().zip(bytes[4 * from..4 * to].chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        safetensors::Dtype::BF16 => {
            for (d, b) in dst.iter_mut().zip(bytes[2 * from..2 * to].chunks_exact(2)) {
                *d = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        safetensors::Dtype::F16 => {
            for (d, b) in dst.iter_mut().zip(bytes[2 * from..2 * to].chunks_exact(2)) {
                *d = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        other => unreachable!("checked: {other:?} is not read"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values narrowed in SIMD (an aligned buffer) and element by element
    /// (an odd one) are the same bytes: round to nearest even at ties,
    /// subnormals, infinities, overflow to infinity, NaN kept NaN.
    #[test]
    fn bf16_narrows_alike_aligned_or_not() {
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            f32::from_bits(0x3F80_8000), // a tie: to even (down)
            f32::from_bits(0x3F81_8000), // a tie: to even (up)
            f32::from_bits(0x3F80_8001),
            f32::MIN_POSITIVE / 3.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::NAN,
        ];
        values.extend((0..1000).map(|i| (i as f32 * 0.7311).sin() * 1e3));
        let n = values.len();
        let mut aligned = vec![0u16; n];
        narrow(&values, bytemuck::cast_slice_mut(&mut aligned));
        let mut odd = vec![0u8; 2 * n + 1];
        narrow(&values, &mut odd[1..]);
        let odd: Vec<u16> = odd[1..]
            .chunks_exact(2)
            .map(|b| u16::from_ne_bytes([b[0], b[1]]))
            .collect();
        for (i, (a, b)) in aligned.iter().zip(&odd).enumerate() {
            let nan = |bits: u16| bf16::from_bits(bits).is_nan();
            assert!(
                a == b || (nan(*a) && nan(*b)),
                "value {i} ({}): {a:#06x} vs {b:#06x}",
                values[i]
            );
        }
    }

    use crate::model::{Arch, ModelConfig};

    /// An architecture other than the default (whose norms end in
    /// `norm.weight`).
    fn other_arch() -> &'static str {
        crate::model::ARCHITECTURES
            .iter()
            .map(|a| a.name)
            .find(|name| *name != crate::model::default_arch())
            .expect("more than one architecture")
    }

    /// A folder of a tiny model of `arch` whose weights `tensor` builds.
    fn folder(
        dir: &Path,
        arch: &str,
        tensor: impl Fn(&str, &[usize]) -> (safetensors::Dtype, Vec<u8>),
    ) -> Box<dyn Model> {
        let config = ModelConfig {
            arch: Arch::named(arch).unwrap(),
            vocab: 10,
            seq: 4,
            hidden: 8,
            heads: 2,
            layers: 1,
            ..ModelConfig::default()
        };
        let model = config.build().unwrap();
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), model.hf_config().to_string()).unwrap();
        let data: Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> = model
            .groups()
            .iter()
            .flat_map(|g| g.tensors.clone())
            .map(|t| {
                let (dtype, bytes) = tensor(&t.name, &t.shape);
                (t.name, t.shape, dtype, bytes)
            })
            .collect();
        let views = data.iter().map(|(name, shape, dtype, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap();
            (name.clone(), view)
        });
        std::fs::write(
            dir.join(WEIGHTS),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
        model
    }

    #[test]
    fn every_dtype_strata_reads_widens_exactly_and_others_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        for (k, dtype) in [
            safetensors::Dtype::F32,
            safetensors::Dtype::BF16,
            safetensors::Dtype::F16,
        ]
        .into_iter()
        .enumerate()
        {
            let at = dir.path().join(format!("ok{k}"));
            let model = folder(&at, other_arch(), |_, shape| {
                let n: usize = shape.iter().product();
                let values = (0..n).map(|i| (i % 7) as f32 * 0.5 - 1.0);
                let bytes = match dtype {
                    safetensors::Dtype::F32 => values.flat_map(f32::to_le_bytes).collect(),
                    safetensors::Dtype::BF16 => values
                        .flat_map(|v| bf16::from_f32(v).to_le_bytes())
                        .collect(),
                    _ => values
                        .flat_map(|v| f16::from_f32(v).to_le_bytes())
                        .collect(),
                };
                (dtype, bytes)
            });
            let opened = HfFolder::open(&at).unwrap();
            opened.check(model.as_ref()).unwrap();
            for group in model.groups() {
                let mut out = vec![f32::NAN; group.params()];
                opened.read_group(&group, &mut out).unwrap();
                for t in &group.tensors {
                    for (i, v) in out[t.range.clone()].iter().enumerate() {
                        assert_eq!(*v, (i % 7) as f32 * 0.5 - 1.0, "{dtype:?} {}", t.name);
                    }
                }
                opened.release(&group);
            }
        }
        let at = dir.path().join("ints");
        let model = folder(&at, other_arch(), |name, shape| {
            let n: usize = shape.iter().product();
            match name.ends_with("norm.weight") {
                true => (safetensors::Dtype::I32, vec![0; 4 * n]),
                false => (safetensors::Dtype::F32, vec![0; 4 * n]),
            }
        });
        let err = HfFolder::open(&at)
            .unwrap()
            .check(model.as_ref())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.safetensors")
                && err.contains("as I32")
                && err.contains("strata reads bf16, fp16 and f32"),
            "{err}"
        );
        // A tensor cut short in its file.
        let at = dir.path().join("short");
        folder(&at, other_arch(), |_, shape| {
            let n: usize = shape.iter().product();
            (safetensors::Dtype::F32, vec![0; 4 * n])
        });
        let bytes = std::fs::read(at.join(WEIGHTS)).unwrap();
        std::fs::write(at.join(WEIGHTS), &bytes[..bytes.len() - 16]).unwrap();
        let err = HfFolder::open(&at).unwrap_err().to_string();
        assert!(
            err.contains("not the size its header describes")
                && err.contains("download the file again"),
            "{err}"
        );
    }
}
