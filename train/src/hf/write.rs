//! Hugging Face weights out, streamed: the safetensors shards of a model
//! whose tensors arrive one at a time (a group gathered, written, dropped),
//! so that no rank ever holds the model. The tensors' names, shapes and
//! order are known first, so each shard's header is written before its
//! data; a shard closes at `max_shard_bytes` (a tensor larger than that
//! has a shard of its own), and with more than one shard, the index
//! (`model.safetensors.index.json`) names each tensor's file. One shard is
//! `model.safetensors`, as transformers writes it.
//!
//! The safetensors crate serializes tensors it holds in memory, in an
//! order of its own; writing tensors as they arrive needs the header
//! first, so this writes the format's 8-byte length and JSON header
//! itself (each file read back through the crate in the tests).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// The dtype weights are written in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightsDtype {
    /// bf16, rounded to nearest even: what models are shared in.
    #[default]
    Bf16,
    /// The f32 master weights, exactly.
    F32,
}

impl WeightsDtype {
    /// Bytes an element takes.
    pub fn bytes(self) -> usize {
        match self {
            WeightsDtype::Bf16 => 2,
            WeightsDtype::F32 => 4,
        }
    }

    /// Its safetensors name.
    fn safetensors(self) -> &'static str {
        match self {
            WeightsDtype::Bf16 => "BF16",
            WeightsDtype::F32 => "F32",
        }
    }

    /// Its name in `config.json`'s `torch_dtype`.
    pub fn torch(self) -> &'static str {
        match self {
            WeightsDtype::Bf16 => "bfloat16",
            WeightsDtype::F32 => "float32",
        }
    }
}

/// A tensor to be written: its name, shape and dtype.
#[derive(Clone, Debug)]
pub struct Planned {
    /// Its name in the checkpoint.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype in the file.
    pub dtype: WeightsDtype,
}

impl Planned {
    fn elems(&self) -> usize {
        self.shape.iter().product()
    }

    fn bytes(&self) -> usize {
        self.elems() * self.dtype.bytes()
    }
}

/// Writes a model's tensors, in the planned order, into sharded
/// safetensors files under a directory.
pub struct ShardWriter {
    dir: PathBuf,
    /// The files' stem (`model`: `model.safetensors`, or
    /// `model-00001-of-00002.safetensors` and `model.safetensors.index.json`).
    stem: String,
    /// Each shard's file name and the tensors in it (indices into
    /// `tensors`).
    shards: Vec<(String, std::ops::Range<usize>)>,
    tensors: Vec<Planned>,
    /// The next tensor to be written.
    next: usize,
    /// Bytes of it written so far.
    done: usize,
    /// The open shard: its index and file.
    open: Option<(usize, BufWriter<File>)>,
    /// Reused to narrow a tensor's values.
    bytes: Vec<u8>,
}

fn error(path: &Path, problem: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        problem: problem.into(),
        fix: "check the disk (space, permissions) and the checkpoint directory".into(),
    }
}

impl ShardWriter {
    /// Plans the shards of `tensors` (written in this order), at most
    /// `max_shard_bytes` of data a shard, named by `stem` (`"model"`:
    /// transformers' names).
    pub fn new(dir: &Path, stem: &str, tensors: Vec<Planned>, max_shard_bytes: u64) -> ShardWriter {
        assert!(
            tensors.iter().all(|t| t.bytes() > 0),
            "planned tensors hold at least one element"
        );
        let mut cuts = Vec::new();
        let (mut start, mut bytes) = (0, 0u64);
        for (i, tensor) in tensors.iter().enumerate() {
            let size = tensor.bytes() as u64;
            if i > start && bytes + size > max_shard_bytes {
                cuts.push(start..i);
                (start, bytes) = (i, 0);
            }
            bytes += size;
        }
        cuts.push(start..tensors.len());
        let count = cuts.len();
        let shards = cuts
            .into_iter()
            .enumerate()
            .map(|(k, range)| {
                let name = if count == 1 {
                    format!("{stem}.safetensors")
                } else {
                    format!("{stem}-{:05}-of-{count:05}.safetensors", k + 1)
                };
                (name, range)
            })
            .collect();
        ShardWriter {
            dir: dir.to_path_buf(),
            stem: stem.to_string(),
            shards,
            tensors,
            next: 0,
            done: 0,
            open: None,
            bytes: Vec::new(),
        }
    }

    /// The shards' file names.
    pub fn files(&self) -> impl Iterator<Item = &str> {
        self.shards.iter().map(|(name, _)| name.as_str())
    }

    /// Writes tensor `name`, the next planned, whole from f32 values
    /// (narrowed to its dtype, to nearest even for bf16).
    pub fn write(&mut self, name: &str, values: &[f32]) -> Result<()> {
        self.check_next(name, values.len() * self.tensors[self.next].dtype.bytes());
        self.append(values)
    }

    /// Writes tensor `name`, the next planned, whole from bytes already
    /// in its dtype.
    pub fn write_bytes(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        self.check_next(name, bytes.len());
        self.append_bytes(bytes)
    }

    fn check_next(&self, name: &str, bytes: usize) {
        let planned = &self.tensors[self.next];
        assert_eq!(
            planned.name, name,
            "tensors are written in the planned order"
        );
        assert_eq!(self.done, 0, "{name}: written whole, not after a part");
        assert_eq!(planned.bytes(), bytes, "{name}: its planned bytes");
    }

    /// Continues the planned tensors with f32 values, each narrowed to the
    /// dtype of the tensor it lands in, across tensor (and shard) ends: a
    /// group streamed a piece at a time.
    pub fn append(&mut self, mut values: &[f32]) -> Result<()> {
        let mut bytes = std::mem::take(&mut self.bytes);
        while !values.is_empty() {
            let planned = self
                .tensors
                .get(self.next)
                .expect("no more values than planned");
            let width = planned.dtype.bytes();
            let n = ((planned.bytes() - self.done) / width).min(values.len());
            bytes.clear();
            bytes.resize(n * width, 0);
            super::narrow(&values[..n], &mut bytes);
            let written = self.append_bytes(&bytes);
            if written.is_err() {
                self.bytes = bytes;
                return written;
            }
            values = &values[n..];
        }
        self.bytes = bytes;
        Ok(())
    }

    /// Continues the planned tensors with bytes already in their dtypes,
    /// across tensor (and shard) ends.
    pub fn append_bytes(&mut self, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let planned = self
                .tensors
                .get(self.next)
                .expect("no more bytes than planned");
            let n = (planned.bytes() - self.done).min(bytes.len());
            let shard = self.shard_of_next()?;
            let (_, file) = self.open.as_mut().expect("opened by shard_of_next");
            if self.done == 0 {
                crate::crash::point("write a tensor");
            }
            if let Err(e) = file.write_all(&bytes[..n]) {
                let name = &self.tensors[self.next].name;
                let path = self.dir.join(&self.shards[shard].0);
                return Err(error(&path, format!("cannot write {name}: {e}")));
            }
            bytes = &bytes[n..];
            self.done += n;
            if self.done == self.tensors[self.next].bytes() {
                self.next += 1;
                self.done = 0;
            }
        }
        Ok(())
    }

    /// The shard of the next tensor, open (the one before closed).
    fn shard_of_next(&mut self) -> Result<usize> {
        let shard = self
            .shards
            .iter()
            .position(|(_, r)| r.contains(&self.next))
            .expect("planned");
        if self.open.as_ref().map(|(k, _)| *k) != Some(shard) {
            self.close()?;
            self.open = Some((shard, self.start(shard)?));
        }
        Ok(shard)
    }

    /// Creates shard `k` and writes its header.
    fn start(&self, k: usize) -> Result<BufWriter<File>> {
        let (file_name, range) = &self.shards[k];
        let path = self.dir.join(file_name);
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut at = 0usize;
        for tensor in &self.tensors[range.clone()] {
            let len = tensor.bytes();
            header.insert(
                tensor.name.clone(),
                serde_json::json!({
                    "dtype": tensor.dtype.safetensors(),
                    "shape": tensor.shape,
                    "data_offsets": [at, at + len],
                }),
            );
            at += len;
        }
        let mut json = serde_json::to_vec(&header).expect("a header serializes");
        // The data starts 8-byte aligned (the format pads with spaces).
        json.resize(json.len().next_multiple_of(8), b' ');
        crate::crash::point("create a shard");
        let file =
            File::create(&path).map_err(|e| error(&path, format!("cannot create it: {e}")))?;
        let mut file = BufWriter::with_capacity(1 << 20, file);
        file.write_all(&(json.len() as u64).to_le_bytes())
            .and_then(|()| file.write_all(&json))
            .map_err(|e| error(&path, format!("cannot write its header: {e}")))?;
        Ok(file)
    }

    /// Flushes and fsyncs the open shard.
    fn close(&mut self) -> Result<()> {
        if let Some((k, file)) = self.open.take() {
            let path = self.dir.join(&self.shards[k].0);
            let file = file
                .into_inner()
                .map_err(|e| error(&path, format!("cannot write it: {}", e.error())))?;
            crate::crash::point("sync a shard");
            file.sync_all()
                .map_err(|e| error(&path, format!("cannot sync it: {e}")))?;
        }
        Ok(())
    }

    /// Closes the last shard and, with more than one, writes the index.
    /// Every planned tensor must have been written.
    pub fn finish(mut self) -> Result<()> {
        assert_eq!(
            self.next,
            self.tensors.len(),
            "every planned tensor written"
        );
        self.close()?;
        if self.shards.len() > 1 {
            let total: usize = self.tensors.iter().map(Planned::bytes).sum();
            let mut map = serde_json::Map::new();
            for (file, range) in &self.shards {
                for tensor in &self.tensors[range.clone()] {
                    map.insert(tensor.name.clone(), file.clone().into());
                }
            }
            let index = serde_json::json!({
                "metadata": {"total_size": total},
                "weight_map": map,
            });
            let path = self
                .dir
                .join(format!("{}.safetensors.index.json", self.stem));
            let bytes = serde_json::to_vec_pretty(&index).expect("an index serializes");
            let mut file =
                File::create(&path).map_err(|e| error(&path, format!("cannot create it: {e}")))?;
            file.write_all(&bytes)
                .and_then(|()| file.sync_all())
                .map_err(|e| error(&path, format!("cannot write it: {e}")))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_read_back_through_the_crate_and_the_folder_reader() {
        let dir = tempfile::tempdir().unwrap();
        // `b` is f32 whatever the others are (a master beside bf16 moments).
        let planned = |dtype| {
            let tensor = |name: &str, shape: Vec<usize>, dtype| Planned {
                name: name.into(),
                shape,
                dtype,
            };
            vec![
                tensor("a", vec![3, 5], dtype),
                tensor("b", vec![7], WeightsDtype::F32),
                tensor("c", vec![2, 2, 2], dtype),
            ]
        };
        let tensors = planned(WeightsDtype::F32);
        let values: Vec<Vec<f32>> = tensors
            .iter()
            .enumerate()
            .map(|(t, p)| {
                (0..p.elems())
                    .map(|i| (t * 100 + i) as f32 * 0.25)
                    .collect()
            })
            .collect();
        for (dtype, max, files) in [
            (WeightsDtype::F32, 1 << 20, 1),
            (WeightsDtype::Bf16, 50, 2),
            (WeightsDtype::F32, 1, 3),
        ] {
            let out = dir.path().join(format!("{dtype:?}-{max}"));
            std::fs::create_dir(&out).unwrap();
            let mut writer = ShardWriter::new(&out, "model", planned(dtype), max);
            assert_eq!(writer.files().count(), files);
            for (p, v) in tensors.iter().zip(&values) {
                writer.write(&p.name, v).unwrap();
            }
            writer.finish().unwrap();
            assert_eq!(out.join(super::super::INDEX).exists(), files > 1);
            for file in std::fs::read_dir(&out).unwrap().flatten() {
                let name = file.file_name().to_string_lossy().into_owned();
                if name.ends_with(".safetensors") {
                    let bytes = std::fs::read(file.path()).unwrap();
                    safetensors::SafeTensors::deserialize(&bytes).unwrap();
                }
            }
            // Read back as a model folder's weights.
            std::fs::write(out.join("config.json"), "{}").unwrap();
            let folder = super::super::HfFolder::open(&out).unwrap();
            let group = crate::model::GroupSpec {
                name: "g".into(),
                tensors: tensors
                    .iter()
                    .scan(0, |at, p| {
                        let range = *at..*at + p.elems();
                        *at = range.end;
                        Some(crate::model::TensorSpec {
                            name: p.name.clone(),
                            shape: p.shape.clone(),
                            range,
                            decays: false,
                            reads_f32: true,
                        })
                    })
                    .collect(),
            };
            let mut read = vec![0f32; group.params()];
            folder.read_group(&group, &mut read).unwrap();
            assert_eq!(read, values.concat(), "{dtype:?}");
        }
    }
}
