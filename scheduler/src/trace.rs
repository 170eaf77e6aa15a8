//! A step's access trace: the tensors, the ops in the order they run, and
//! what each op reads and writes. Recorded while a step runs
//! ([`TraceRecorder`]) or generated from a model description.

use serde::Serialize;

use crate::error::SchedulerError;
pub use crate::tier::Tier;

/// What runs an op; its tensors must be on that processor's tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Processor {
    /// The GPU's compute stream; tensors on [`Tier::Device`].
    Gpu,
    /// The CPU (the optimizer); tensors on [`Tier::Host`].
    Cpu,
}

impl Processor {
    /// The tier this processor reads and writes.
    pub fn tier(self) -> Tier {
        match self {
            Processor::Gpu => Tier::Device,
            Processor::Cpu => Tier::Host,
        }
    }
}

/// How an op touches a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Reads it: it must be there.
    Read,
    /// Overwrites it whole: it needs room, not its old contents.
    Write,
    /// Reads and writes it: it must be there; other copies go stale.
    Update,
}

/// What a tensor is, for reports and for the baseline policy's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorClass {
    /// Low-precision parameters the GPU computes with.
    Param,
    /// Gradients.
    Grad,
    /// fp32 master weights and optimizer moments.
    OptimizerState,
    /// Saved activations (checkpoints).
    Activation,
    /// Anything else.
    Other,
}

impl TensorClass {
    /// Every class, in [`TensorClass::index`] order.
    pub const ALL: [TensorClass; 5] = [
        TensorClass::Param,
        TensorClass::Grad,
        TensorClass::OptimizerState,
        TensorClass::Activation,
        TensorClass::Other,
    ];

    /// Its position in per-class tables (`ALL[c.index()] == c`).
    pub fn index(self) -> usize {
        match self {
            TensorClass::Param => 0,
            TensorClass::Grad => 1,
            TensorClass::OptimizerState => 2,
            TensorClass::Activation => 3,
            TensorClass::Other => 4,
        }
    }
}

/// One tensor of the step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorSpec {
    /// A name for reports.
    pub name: String,
    /// Its size.
    pub bytes: u64,
    /// What it is.
    pub class: TensorClass,
    /// Where its only copy is when the step starts and must be again when
    /// it ends; `None` for a tensor the step creates by writing it.
    pub home: Option<Tier>,
}

/// One op's use of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Access {
    /// Index into [`Trace::tensors`].
    pub tensor: u32,
    /// How it is used.
    pub mode: Mode,
}

/// One op of the step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Op {
    /// A name for reports (`fwd.l3.fc1`).
    pub name: String,
    /// What runs it.
    pub processor: Processor,
    /// The tensors it touches, each once.
    pub accesses: Vec<Access>,
    /// Estimated compute time.
    pub compute_ns: u64,
    /// Collective work before compute (all-gather of parameters), on the
    /// collective link; 0 for none.
    pub gather_ns: u64,
    /// Collective work after compute (reduce-scatter of gradients); the
    /// op's writes are final only after it.
    pub reduce_ns: u64,
    /// Starts only after every earlier op has finished (a global gradient
    /// norm before clipping).
    pub barrier: bool,
}

impl Op {
    /// An op with no collective work and no barrier.
    pub fn new(
        name: impl Into<String>,
        processor: Processor,
        accesses: Vec<Access>,
        compute_ns: u64,
    ) -> Op {
        Op {
            name: name.into(),
            processor,
            accesses,
            compute_ns,
            gather_ns: 0,
            reduce_ns: 0,
            barrier: false,
        }
    }
}

/// A step: tensors and ops in program order.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Trace {
    /// Every tensor the step touches.
    pub tensors: Vec<TensorSpec>,
    /// The ops, in the order the program issues them.
    pub ops: Vec<Op>,
}

impl Trace {
    /// Checks indices, duplicate accesses, and that a tensor without a home
    /// is written before it is read.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let invalid = |s: String| Err(SchedulerError::InvalidTrace(s));
        if self.tensors.len() > u32::MAX as usize || self.ops.len() > u32::MAX as usize {
            return invalid("more than 2^32 tensors or ops".into());
        }
        let mut exists: Vec<bool> = self.tensors.iter().map(|t| t.home.is_some()).collect();
        for (index, op) in self.ops.iter().enumerate() {
            for (position, access) in op.accesses.iter().enumerate() {
                let tensor = access.tensor as usize;
                if tensor >= self.tensors.len() {
                    return invalid(format!(
                        "op {index} ({}) uses tensor {tensor}, but there are {}",
                        op.name,
                        self.tensors.len()
                    ));
                }
                if op.accesses[..position]
                    .iter()
                    .any(|a| a.tensor == access.tensor)
                {
                    return invalid(format!(
                        "op {index} ({}) lists tensor {} twice",
                        op.name, self.tensors[tensor].name
                    ));
                }
                if access.mode != Mode::Write && !exists[tensor] {
                    return invalid(format!(
                        "op {index} ({}) reads {} before anything writes it (give it a home tier or write it first)",
                        op.name, self.tensors[tensor].name
                    ));
                }
                exists[tensor] = true;
            }
        }
        if let Some(t) = self.tensors.iter().find(|t| t.bytes == 0) {
            return invalid(format!("tensor {} has 0 bytes", t.name));
        }
        Ok(())
    }

    /// A 64-bit signature of the step's shape: op names, processors and
    /// accesses, tensor sizes and classes. Compute estimates are left out,
    /// so a step that runs faster is the same step; another sequence length
    /// (other sizes) or another op order is not.
    pub fn signature(&self) -> u64 {
        let mut hash = Fnv::new();
        for tensor in &self.tensors {
            hash.write(&tensor.bytes.to_le_bytes());
            hash.write(&[tensor.class as u8, tensor.home.map_or(9, |t| t as u8)]);
        }
        for op in &self.ops {
            hash.write(&op_fingerprint(op).to_le_bytes());
        }
        hash.0
    }

    /// For each tensor, the indices of the ops that touch it, ascending.
    pub fn uses(&self) -> Vec<Vec<u32>> {
        let mut uses = vec![Vec::new(); self.tensors.len()];
        for (index, op) in self.ops.iter().enumerate() {
            for access in &op.accesses {
                uses[access.tensor as usize].push(index as u32);
            }
        }
        uses
    }

    /// Bytes an op needs on its tier at once.
    pub fn op_bytes(&self, op: usize) -> u64 {
        self.ops[op]
            .accesses
            .iter()
            .map(|a| self.tensors[a.tensor as usize].bytes)
            .sum()
    }
}

/// A fingerprint of one op: its name, processor and accesses.
pub fn op_fingerprint(op: &Op) -> u64 {
    let mut hash = Fnv::new();
    hash.write(op.name.as_bytes());
    hash.write(&[op.processor as u8]);
    for access in &op.accesses {
        hash.write(&access.tensor.to_le_bytes());
        hash.write(&[access.mode as u8]);
    }
    hash.0
}

/// FNV-1a, 64 bit: stable across runs and platforms, unlike std's hasher.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// Records a trace while a step runs: tensors as they are registered, ops
/// as they are issued. Bounded by `tensors_max` and `ops_max`, reserved at
/// start.
#[derive(Debug)]
pub struct TraceRecorder {
    trace: Trace,
    tensors_max: usize,
    ops_max: usize,
}

impl TraceRecorder {
    /// A recorder that holds up to `tensors_max` tensors and `ops_max` ops.
    pub fn new(tensors_max: usize, ops_max: usize) -> Self {
        TraceRecorder {
            trace: Trace {
                tensors: Vec::with_capacity(tensors_max),
                ops: Vec::with_capacity(ops_max),
            },
            tensors_max,
            ops_max,
        }
    }

    /// Adds a tensor; returns its index for [`Access::tensor`].
    pub fn tensor(&mut self, spec: TensorSpec) -> Result<u32, SchedulerError> {
        if self.trace.tensors.len() == self.tensors_max {
            return Err(SchedulerError::Limit {
                what: "tensors_max",
                limit: self.tensors_max as u64,
            });
        }
        self.trace.tensors.push(spec);
        Ok(self.trace.tensors.len() as u32 - 1)
    }

    /// Adds the next op.
    pub fn op(&mut self, op: Op) -> Result<(), SchedulerError> {
        if self.trace.ops.len() == self.ops_max {
            return Err(SchedulerError::Limit {
                what: "ops_max",
                limit: self.ops_max as u64,
            });
        }
        self.trace.ops.push(op);
        Ok(())
    }

    /// Ops recorded so far.
    pub fn ops(&self) -> &[Op] {
        &self.trace.ops
    }

    /// Forgets the ops recorded this step (keeping their room).
    pub fn clear_ops(&mut self) {
        self.trace.ops.clear();
    }

    /// Ends the step: the validated trace, and an empty recorder with the
    /// same tensors for the next step.
    pub fn finish(&mut self) -> Result<Trace, SchedulerError> {
        let trace = Trace {
            tensors: self.trace.tensors.clone(),
            ops: std::mem::replace(&mut self.trace.ops, Vec::with_capacity(self.ops_max)),
        };
        trace.validate()?;
        Ok(trace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_round_trip() {
        for (i, class) in TensorClass::ALL.into_iter().enumerate() {
            assert_eq!(class.index(), i);
        }
        for (i, tier) in Tier::ALL.into_iter().enumerate() {
            assert_eq!(tier.index(), i);
            assert_eq!(tier.toward(tier), tier);
        }
        assert_eq!(Tier::Nvme.toward(Tier::Device), Tier::Host);
        assert_eq!(Tier::Device.toward(Tier::Nvme), Tier::Host);
    }

    fn access(tensor: u32, mode: Mode) -> Access {
        Access { tensor, mode }
    }

    fn read(tensor: u32) -> Access {
        access(tensor, Mode::Read)
    }

    fn tiny() -> Trace {
        Trace {
            tensors: vec![
                TensorSpec {
                    name: "w".into(),
                    bytes: 100,
                    class: TensorClass::Param,
                    home: Some(Tier::Host),
                },
                TensorSpec {
                    name: "a".into(),
                    bytes: 50,
                    class: TensorClass::Activation,
                    home: None,
                },
            ],
            ops: vec![
                Op::new(
                    "fwd",
                    Processor::Gpu,
                    vec![read(0), access(1, Mode::Write)],
                    10,
                ),
                Op::new("bwd", Processor::Gpu, vec![read(0), read(1)], 20),
            ],
        }
    }

    #[test]
    fn signature_ignores_compute_estimates_but_not_sizes_or_order() {
        let base = tiny();
        let mut slower = base.clone();
        slower.ops[1].compute_ns = 99;
        assert_eq!(base.signature(), slower.signature());
        let mut longer = base.clone();
        longer.tensors[1].bytes = 60;
        assert_ne!(base.signature(), longer.signature());
        let mut swapped = base.clone();
        swapped.ops.swap(0, 1);
        assert_ne!(base.signature(), swapped.signature());
    }

    #[test]
    fn validate_names_a_read_before_write() {
        let mut trace = tiny();
        trace.ops[0].accesses[1].mode = Mode::Read;
        let error = trace.validate().unwrap_err().to_string();
        assert!(
            error.contains("reads a before anything writes it"),
            "{error}"
        );
        assert!(tiny().validate().is_ok());
    }

    #[test]
    fn recorder_keeps_tensors_and_bounds_ops() {
        let mut recorder = TraceRecorder::new(2, 1);
        let w = recorder
            .tensor(TensorSpec {
                name: "w".into(),
                bytes: 8,
                class: TensorClass::Param,
                home: Some(Tier::Host),
            })
            .unwrap();
        let op = Op::new("f", Processor::Gpu, vec![read(w)], 1);
        recorder.op(op.clone()).unwrap();
        assert!(matches!(
            recorder.op(op.clone()),
            Err(SchedulerError::Limit {
                what: "ops_max",
                limit: 1
            })
        ));
        let first = recorder.finish().unwrap();
        assert_eq!(first.ops.len(), 1);
        recorder.op(op).unwrap();
        assert_eq!(recorder.finish().unwrap().signature(), first.signature());
    }
}
