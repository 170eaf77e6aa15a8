//! Accounting (bytes per tier now and at peak, bytes per link, time spent
//! waiting) and the Chrome/Perfetto trace of every transfer, wait and span
//! of compute.

use std::cell::Cell;
use std::io::Write;

use serde::Serialize;

use crate::tier::{Link, TensorId, Tier};

/// One tier's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierStats {
    /// Bytes held by tensor copies now.
    pub used_bytes: u64,
    /// Most bytes ever held at once.
    pub peak_bytes: u64,
    /// The tier's budget (capacity).
    pub budget_bytes: u64,
}

/// One link's traffic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LinkStats {
    /// Bytes moved.
    pub bytes: u64,
    /// Transfers (one per tensor hop).
    pub transfers: u64,
    /// Time transfers on this link were running (summed over movers).
    pub busy_ns: u64,
}

/// A snapshot of the runtime's accounting.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Per tier, in [`Tier::ALL`] order.
    pub tiers: [TierStats; 3],
    /// Per link, in [`Link::ALL`] order.
    pub links: [LinkStats; 4],
    /// Time callers spent blocked on moves (waiting on completions, or for a
    /// move to land before a guard could be taken).
    pub wait_ns: u64,
    /// How many such waits there were.
    pub waits: u64,
    /// Copies dropped to make room (free: another tier held the data).
    pub spills_dropped: u64,
    /// Copies written down a tier to make room.
    pub spills_written: u64,
    /// Tensors registered now.
    pub tensors: usize,
    /// Placements refused by injected out-of-memory faults
    /// ([`crate::MemoryFaults`]; simulations only).
    pub ooms_injected: u64,
}

impl Stats {
    /// One tier.
    pub fn tier(&self, tier: Tier) -> &TierStats {
        &self.tiers[tier.index()]
    }

    /// One link.
    pub fn link(&self, link: Link) -> &LinkStats {
        &self.links[link.index()]
    }
}

/// What an event in the trace was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A transfer over a link.
    Transfer(Link),
    /// A caller blocked on a move.
    Wait,
    /// A copy written down to make room.
    Spill(Tier),
    /// Work of a caller (a block's forward, an optimizer step): what, for
    /// which group of parameters, in which micro-batch.
    Compute {
        /// What ran, e.g. "block forward".
        what: &'static str,
        /// The group (0: embeddings, 1 + b: block b).
        group: u32,
        /// The micro-batch; none for work of the whole step.
        micro_batch: Option<u32>,
        /// Parameters it updated (an optimizer step; 0 for other work):
        /// the trace shows them and their rate.
        params: u64,
    },
    /// A collective between ranks (on [`COLLECTIVE_LANE`]): what, for
    /// which group of parameters; its bytes on this rank are the event's.
    Collective {
        /// What ran, e.g. "all-gather".
        what: &'static str,
        /// The group (0: embeddings, 1 + b: block b).
        group: u32,
    },
}

/// One complete event ("ph":"X").
#[derive(Clone, Copy, Debug)]
pub struct TraceEvent {
    /// What happened.
    pub kind: EventKind,
    /// To which tensor (none for compute).
    pub tensor: Option<TensorId>,
    /// Bytes involved.
    pub bytes: u64,
    /// Start, ns since the runtime started.
    pub start_ns: u64,
    /// Duration.
    pub duration_ns: u64,
    /// Thread lane (mover index, or the caller's lane).
    pub lane: u32,
}

/// A bounded event log: capacity fixed at start, later events are counted.
pub struct Trace {
    events: Vec<TraceEvent>,
    dropped: u64,
}

impl Trace {
    /// Room for `events_max` events, allocated now.
    pub fn new(events_max: usize) -> Self {
        Self {
            events: Vec::with_capacity(events_max),
            dropped: 0,
        }
    }

    /// Records an event, or counts it if the log is full (never allocates).
    pub fn push(&mut self, event: TraceEvent) {
        if self.events.len() < self.events.capacity() {
            self.events.push(event);
        } else {
            self.dropped += 1;
        }
    }

    /// Events kept.
    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }

    /// Events not kept because the log was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Writes the Chrome trace-event JSON (opens in chrome://tracing and
    /// ui.perfetto.dev). `name_of` names tensors.
    pub fn write_chrome(
        &self,
        out: &mut dyn Write,
        name_of: &dyn Fn(TensorId) -> Option<String>,
    ) -> std::io::Result<()> {
        let mut events = Vec::with_capacity(self.events.len() + 8);
        for lane in self.lanes() {
            let name = match lane {
                CALLER_LANE => "compute".to_string(),
                OPTIMIZER_LANE => "cpu optimizer".to_string(),
                COLLECTIVE_LANE => "collectives".to_string(),
                lane => format!("mover {lane}"),
            };
            events.push(serde_json::json!({
                "name": "thread_name", "ph": "M", "pid": 1, "tid": lane,
                "args": {"name": name},
            }));
        }
        for event in &self.events {
            let (name, category) = match event.kind {
                EventKind::Transfer(link) => (link.name().to_string(), "transfer"),
                EventKind::Wait => ("wait".to_string(), "wait"),
                EventKind::Spill(tier) => (format!("spill {tier}"), "spill"),
                EventKind::Compute { what, .. } => (what.to_string(), "compute"),
                EventKind::Collective { what, .. } => (what.to_string(), "collective"),
            };
            let args = match (event.kind, event.tensor) {
                (
                    EventKind::Compute {
                        group,
                        micro_batch,
                        params: 0,
                        ..
                    },
                    _,
                ) => serde_json::json!({ "group": group, "micro_batch": micro_batch }),
                (EventKind::Collective { group, .. }, _) => serde_json::json!({
                    "group": group,
                    "bytes": event.bytes,
                    "bytes_per_s": event.bytes as f64 / (event.duration_ns.max(1) as f64 / 1e9),
                }),
                (EventKind::Compute { group, params, .. }, _) => serde_json::json!({
                    "group": group,
                    "params": params,
                    "params_per_s": params as f64 / (event.duration_ns.max(1) as f64 / 1e9),
                }),
                (_, tensor) => serde_json::json!({
                    "tensor": tensor.map(|t| t.0),
                    "name": tensor.and_then(name_of),
                    "bytes": event.bytes,
                }),
            };
            events.push(serde_json::json!({
                "name": name,
                "cat": category,
                "ph": "X",
                "pid": 1,
                "tid": event.lane,
                "ts": event.start_ns as f64 / 1e3,
                "dur": event.duration_ns as f64 / 1e3,
                "args": args,
            }));
        }
        let document = serde_json::json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"dropped_events": self.dropped},
        });
        serde_json::to_writer(&mut *out, &document)?;
        out.flush()
    }

    fn lanes(&self) -> Vec<u32> {
        let mut lanes: Vec<u32> = self.events.iter().map(|e| e.lane).collect();
        lanes.sort_unstable();
        lanes.dedup();
        lanes
    }
}

/// The trace lane of callers (not movers): the compute thread's.
pub const CALLER_LANE: u32 = 1000;

/// The trace lane of the CPU optimizer's thread.
pub const OPTIMIZER_LANE: u32 = 1001;

/// The trace lane of collectives between ranks (whichever thread waits
/// for them), beside compute.
pub const COLLECTIVE_LANE: u32 = 1002;

thread_local! {
    static LANE: Cell<u32> = const { Cell::new(CALLER_LANE) };
}

/// Puts this thread's waits and compute spans on `lane` of the trace
/// (threads start on [`CALLER_LANE`]). Lanes below [`CALLER_LANE`] are the
/// movers'.
///
/// # Panics
/// If `lane` is a mover's.
pub fn set_caller_lane(lane: u32) {
    assert!(
        lane >= CALLER_LANE,
        "lane {lane} is a mover's: callers use {CALLER_LANE} and up"
    );
    LANE.with(|l| l.set(lane));
}

/// Whether `lane` is a mover's (a thread that holds no guard).
pub(crate) fn is_mover_lane(lane: u32) -> bool {
    lane < CALLER_LANE
}

/// This thread's lane in the trace.
pub(crate) fn caller_lane() -> u32 {
    LANE.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_trace_counts_instead_of_growing() {
        let mut trace = Trace::new(2);
        let event = TraceEvent {
            kind: EventKind::Wait,
            tensor: Some(TensorId(1)),
            bytes: 0,
            start_ns: 0,
            duration_ns: 5,
            lane: CALLER_LANE,
        };
        for _ in 0..5 {
            trace.push(event);
        }
        assert_eq!(trace.events().len(), 2);
        assert_eq!(trace.dropped(), 3);
        let mut out = Vec::new();
        trace.write_chrome(&mut out, &|_| Some("w".into())).unwrap();
        let parsed: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(parsed["traceEvents"].as_array().unwrap().len(), 3);
    }
}
