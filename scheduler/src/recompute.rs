//! Which blocks recompute their activations in backward: [`choose`].
//!
//! All micro-batches of a step run block by block, so every block keeps
//! something for its backward per micro-batch in flight: all its
//! activations, or only its input (then its forward runs again in
//! backward). Kept activations go to the device while it has room and to
//! host memory past that (a round trip over PCIe); recomputing costs one
//! block forward. The blocks that keep everything are the last ones: their
//! backward comes first, so what stays on the device is what is needed
//! soonest, and what goes to the host has the longest to come back.
//!
//! A block kept whole needs room for its activations on the device, where
//! they are made, whatever goes to the host later.
//!
//! The choice minimises a bottleneck model of the step, the larger of the
//! compute (recompute included) and each PCIe direction's traffic
//! (activations offloaded included); ties keep more blocks whole (less
//! work for the same time). When everything fits on the device, nothing is
//! recomputed.

use serde::{Deserialize, Serialize};

use crate::error::SchedulerError;
use crate::plan::Link;
use crate::trace::{TensorClass, Tier};

/// Which blocks recompute: written `true` (every block), `false` (none)
/// or `"auto"` (those [`choose`] picks) in a config, and `every`, `none`
/// or `auto` on a command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "BoolOrWord", into = "BoolOrWord")]
pub enum Checkpointing {
    /// Every block recomputes its forward in backward.
    Every,
    /// No block does: all activations are kept (on the device, or offloaded
    /// to the host and beyond).
    Never,
    /// The blocks [`choose`] picks from the budgets and rates.
    Auto,
}

impl Checkpointing {
    /// Per block of `layers` when the choice is fixed; None for `Auto`.
    pub fn fixed(self, layers: usize) -> Option<Vec<bool>> {
        match self {
            Checkpointing::Every => Some(vec![true; layers]),
            Checkpointing::Never => Some(vec![false; layers]),
            Checkpointing::Auto => None,
        }
    }
}

impl std::str::FromStr for Checkpointing {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "every" | "true" => Ok(Checkpointing::Every),
            "none" | "false" => Ok(Checkpointing::Never),
            "auto" => Ok(Checkpointing::Auto),
            other => Err(format!(
                "{other:?} is not every (true), none (false) or auto"
            )),
        }
    }
}

/// How a [`Checkpointing`] is written in a config.
#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum BoolOrWord {
    Bool(bool),
    Text(String),
}

impl TryFrom<BoolOrWord> for Checkpointing {
    type Error = String;

    fn try_from(value: BoolOrWord) -> Result<Self, String> {
        match value {
            BoolOrWord::Bool(true) => Ok(Checkpointing::Every),
            BoolOrWord::Bool(false) => Ok(Checkpointing::Never),
            BoolOrWord::Text(text) if text == "auto" => Ok(Checkpointing::Auto),
            BoolOrWord::Text(text) => Err(format!(
                "checkpoint_activations: {text:?} is not true, false or \"auto\""
            )),
        }
    }
}

impl From<Checkpointing> for BoolOrWord {
    fn from(checkpointing: Checkpointing) -> Self {
        match checkpointing {
            Checkpointing::Every => BoolOrWord::Bool(true),
            Checkpointing::Never => BoolOrWord::Bool(false),
            Checkpointing::Auto => BoolOrWord::Text("auto".into()),
        }
    }
}

/// What the choice weighs, per step of one rank.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RecomputeInput {
    /// Blocks.
    pub layers: usize,
    /// Micro-batches in flight (each block keeps one set per micro-batch).
    pub micro_batches: usize,
    /// Bytes one block keeps for one micro-batch without recompute, on the
    /// device (what crosses PCIe when it is offloaded).
    pub full_bytes: u64,
    /// Bytes it keeps with recompute (its input), on the device.
    pub input_bytes: u64,
    /// The same two on the host (pool buffers are whole): (whole, input).
    pub host_bytes: (u64, u64),
    /// Device bytes the kept activations may use.
    pub device_room_bytes: u64,
    /// Host bytes they may use past the device's room.
    pub host_room_bytes: u64,
    /// One block's forward for one micro-batch (the cost of a recompute).
    pub block_forward_ns: f64,
    /// The step's compute without any recompute.
    pub step_compute_ns: f64,
    /// Device -> host.
    pub device_to_host: Link,
    /// Host -> device.
    pub host_to_device: Link,
    /// What else crosses each direction per step (parameters up, gradients
    /// down): ns of (host -> device, device -> host).
    pub link_busy_ns: (f64, f64),
}

/// One model state as [`rooms`] sees it: its class, its home, and the
/// bytes a copy takes on each tier ([`Tier::ALL`] order).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Held {
    /// What it is.
    pub class: TensorClass,
    /// Where it lives between uses; None: nowhere (made and used in a
    /// step, as a GPU's 16-bit gradient).
    pub home: Option<Tier>,
    /// Bytes of a copy per tier.
    pub bytes: [u64; 3],
}

/// The device and host bytes left for kept activations: each tier's
/// capacity less the model states homed there, less twice what streams
/// through it at once (parameters and gradients homed off the device pass
/// through the device, where compute reads and adds to them; states homed
/// on NVMe pass through the host), counted per class as the largest
/// tensor: an op uses one of each and the next op's arrive meanwhile.
pub fn rooms(states: impl IntoIterator<Item = Held>, capacity_bytes: [u64; 3]) -> (u64, u64) {
    let mut homed = [0u64; 3];
    let mut streaming = [[0u64; TensorClass::ALL.len()]; 3];
    for held in states {
        if let Some(home) = held.home {
            homed[home.index()] += held.bytes[home.index()];
        }
        let through = |tier: Tier| match tier {
            Tier::Device => {
                matches!(held.class, TensorClass::Param | TensorClass::Grad)
                    && held.home != Some(Tier::Device)
            }
            Tier::Host => held.home == Some(Tier::Nvme),
            Tier::Nvme => false,
        };
        for tier in Tier::ALL.into_iter().filter(|&t| through(t)) {
            let most = &mut streaming[tier.index()][held.class.index()];
            *most = (*most).max(held.bytes[tier.index()]);
        }
    }
    let room = |tier: Tier| {
        let held: u64 = streaming[tier.index()].iter().sum();
        capacity_bytes[tier.index()]
            .saturating_sub(homed[tier.index()])
            .saturating_sub(2 * held)
    };
    (room(Tier::Device), room(Tier::Host))
}

/// The blocks that recompute, and what the model predicts for that.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RecomputeChoice {
    /// Per block: whether its backward recomputes its forward.
    pub recompute: Vec<bool>,
    /// Bytes kept on the device.
    pub device_bytes: u64,
    /// Bytes kept on the host (a round trip each step).
    pub host_bytes: u64,
    /// The step's modelled time.
    pub step_ns: f64,
}

impl RecomputeChoice {
    /// Blocks that recompute.
    pub fn recomputed(&self) -> usize {
        self.recompute.iter().filter(|&&r| r).count()
    }
}

/// Where the kept tensors go with the last `kept` blocks whole: the
/// device takes the whole ones first (their backward comes first), then
/// inputs, in the room it has; the host the rest. (device bytes, host
/// bytes, bytes that cross PCIe each way), or None past u64.
fn split(input: &RecomputeInput, kept: usize) -> Option<(u64, u64, u64)> {
    let mb = input.micro_batches as u64;
    let wholes = mb.checked_mul(kept as u64)?;
    let inputs = mb.checked_mul((input.layers - kept) as u64)?;
    let room = input.device_room_bytes;
    let wholes_in = wholes.min(room / input.full_bytes.max(1));
    let left = room - wholes_in * input.full_bytes;
    let inputs_in = inputs.min(left / input.input_bytes.max(1));
    let device = wholes_in * input.full_bytes + inputs_in * input.input_bytes;
    let (wholes_out, inputs_out) = (wholes - wholes_in, inputs - inputs_in);
    let host = wholes_out
        .checked_mul(input.host_bytes.0)?
        .checked_add(inputs_out.checked_mul(input.host_bytes.1)?)?;
    let crossing = wholes_out
        .checked_mul(input.full_bytes)?
        .checked_add(inputs_out.checked_mul(input.input_bytes)?)?;
    Some((device, host, crossing))
}

/// The modelled step time with `kept` whole blocks, or None when they do
/// not fit device and host.
fn step_ns(input: &RecomputeInput, kept: usize) -> Option<(f64, u64, u64)> {
    // A block's activations are made on the device, whole, before any can
    // be offloaded.
    if kept > 0 && input.full_bytes > input.device_room_bytes {
        return None;
    }
    let (device, host, crossing) = split(input, kept)?;
    if host > input.host_room_bytes {
        return None;
    }
    let recomputes = ((input.layers - kept) * input.micro_batches) as f64;
    let compute = input.step_compute_ns + recomputes * input.block_forward_ns;
    let (up_busy, down_busy) = input.link_busy_ns;
    let (up, down) = if crossing == 0 {
        (up_busy, down_busy)
    } else {
        (
            up_busy + input.host_to_device.time_ns(crossing),
            down_busy + input.device_to_host.time_ns(crossing),
        )
    };
    Some((compute.max(up).max(down), device, host))
}

/// The blocks that recompute: the first `layers - kept` for the `kept`
/// with the shortest modelled step that fits.
pub fn choose(input: &RecomputeInput) -> Result<RecomputeChoice, SchedulerError> {
    if input.layers == 0
        || input.micro_batches == 0
        || input.input_bytes > input.full_bytes
        || input.host_bytes.1 > input.host_bytes.0
    {
        return Err(SchedulerError::Config {
            what: "activation plan",
            reason: format!(
                "{} blocks, {} micro-batches, {} bytes kept whole and {} as an input: blocks and micro-batches must be positive and an input no larger than the whole",
                input.layers, input.micro_batches, input.full_bytes, input.input_bytes
            ),
        });
    }
    let mut best: Option<(usize, f64, u64, u64)> = None;
    for kept in 0..=input.layers {
        let Some((time, device, host)) = step_ns(input, kept) else {
            continue;
        };
        // `<=`: a tie goes to more blocks kept whole.
        if best.is_none_or(|(_, best_time, _, _)| time <= best_time) {
            best = Some((kept, time, device, host));
        }
    }
    let Some((kept, step_ns, device_bytes, host_bytes)) = best else {
        let needed = (input.input_bytes.max(input.host_bytes.1))
            .saturating_mul((input.layers * input.micro_batches) as u64);
        return Err(SchedulerError::ActivationsDoNotFit {
            needed_bytes: needed,
            device_room_bytes: input.device_room_bytes,
            host_room_bytes: input.host_room_bytes,
        });
    };
    let recomputed = input.layers - kept;
    Ok(RecomputeChoice {
        recompute: (0..input.layers).map(|b| b < recomputed).collect(),
        device_bytes,
        host_bytes,
        step_ns,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn link(bytes_per_s: f64) -> Link {
        Link {
            bytes_per_s,
            latency_ns: 10_000,
        }
    }

    /// 12 blocks, 4 micro-batches, 100 MB whole or 10 MB as an input.
    fn input() -> RecomputeInput {
        RecomputeInput {
            layers: 12,
            micro_batches: 4,
            full_bytes: 100 << 20,
            input_bytes: 10 << 20,
            host_bytes: (100 << 20, 10 << 20),
            device_room_bytes: 1 << 40,
            host_room_bytes: 0,
            block_forward_ns: 1e6,
            step_compute_ns: 4.0 * 12.0 * 4.0 * 1e6,
            device_to_host: link(25e9),
            host_to_device: link(25e9),
            link_busy_ns: (0.0, 0.0),
        }
    }

    #[test]
    fn nothing_recomputes_when_everything_fits_on_the_device() {
        let choice = choose(&input()).unwrap();
        assert_eq!(choice.recomputed(), 0);
        assert_eq!(choice.device_bytes, 12 * 4 * (100 << 20));
        assert_eq!(choice.host_bytes, 0);
    }

    #[test]
    fn a_small_device_recomputes_the_first_blocks_and_keeps_the_last_whole() {
        let mut input = input();
        // Room for 5 whole blocks and 7 inputs, per micro-batch.
        input.device_room_bytes = 4 * (5 * (100 << 20) + 7 * (10 << 20));
        let choice = choose(&input).unwrap();
        assert_eq!(choice.recomputed(), 7);
        assert!(choice.recompute[..7].iter().all(|&r| r));
        assert!(!choice.recompute[7..].iter().any(|&r| r));
        assert_eq!(choice.host_bytes, 0);
    }

    #[test]
    fn a_fast_link_offloads_and_a_slow_one_recomputes() {
        let mut input = input();
        input.device_room_bytes = 4 * 12 * (10 << 20);
        input.host_room_bytes = 1 << 40;
        // 25 GB/s moves 100 MB twice in ~8 ms, more than the 1 ms
        // recompute, but the step's 192 ms of compute hides the traffic of
        // every block: keep them all.
        assert_eq!(choose(&input).unwrap().recomputed(), 0);
        // At 1 GB/s the whole round trip (~5 GB) takes 5 s: recompute.
        input.host_to_device = link(1e9);
        input.device_to_host = link(1e9);
        let slow = choose(&input).unwrap();
        assert!(slow.recomputed() > 0, "{slow:?}");
        assert!(slow.step_ns < step_ns(&input, 12).unwrap().0);
    }

    #[test]
    fn no_block_is_kept_whole_when_its_activations_cannot_be_made_on_the_device() {
        let mut input = input();
        input.device_room_bytes = 99 << 20;
        input.host_room_bytes = 1 << 40;
        assert_eq!(choose(&input).unwrap().recomputed(), 12);
        // Room for one: the rest go to the host as the link allows.
        input.device_room_bytes = 100 << 20;
        assert!(choose(&input).unwrap().recomputed() < 12);
    }

    #[test]
    fn rooms_leave_out_homed_states_and_twice_the_largest_streaming_ones() {
        let held = |class, home, bytes| Held {
            class,
            home: Some(home),
            bytes: [bytes; 3],
        };
        let states = [
            // Parameters on the host stream through the device.
            held(TensorClass::Param, Tier::Host, 10),
            held(TensorClass::Param, Tier::Host, 30),
            // Optimizer states on NVMe stream through the host.
            held(TensorClass::OptimizerState, Tier::Nvme, 50),
            // Homed on the device: counted whole there, never streaming.
            held(TensorClass::Grad, Tier::Device, 7),
        ];
        let (device, host) = rooms(states, [1000, 1000, 1000]);
        assert_eq!(device, 1000 - 7 - 2 * 30);
        assert_eq!(host, 1000 - 40 - 2 * 50);
        assert_eq!(rooms(states, [10, 10, 10]), (0, 0));
    }

    #[test]
    fn what_fits_nowhere_is_said_with_the_numbers() {
        let mut input = input();
        input.device_room_bytes = 1 << 20;
        let err = choose(&input).unwrap_err().to_string();
        assert!(err.contains(&(4u64 * 12 * (10 << 20)).to_string()), "{err}");
        input.micro_batches = 0;
        let err = choose(&input).unwrap_err().to_string();
        assert!(err.contains("micro-batches must be positive"), "{err}");
    }

    proptest! {
        /// The choice fits its rooms, recomputes a prefix of the blocks, is
        /// no slower than any other count that fits, and a roomier device
        /// never makes it slower.
        #[test]
        fn the_choice_fits_is_a_prefix_and_is_the_fastest(
            layers in 1usize..40,
            micro_batches in 1usize..9,
            full in 1u64..1_000,
            input_share in 0u64..=100,
            device_room in 0u64..400_000,
            host_room in 0u64..400_000,
            forward_ns in 0.0f64..1e6,
            rate in 1e6f64..1e10,
            busy in 0.0f64..1e6,
        ) {
            let input = RecomputeInput {
                layers,
                micro_batches,
                full_bytes: full,
                input_bytes: full * input_share / 100,
                host_bytes: (full + 7, full * input_share / 100 + 7),
                device_room_bytes: device_room,
                host_room_bytes: host_room,
                block_forward_ns: forward_ns,
                step_compute_ns: 4.0 * (layers * micro_batches) as f64 * forward_ns,
                device_to_host: link(rate),
                host_to_device: link(rate),
                link_busy_ns: (busy, busy),
            };
            let Ok(choice) = choose(&input) else {
                prop_assert!(step_ns(&input, 0).is_none());
                return Ok(());
            };
            let recomputed = choice.recomputed();
            prop_assert!(choice.recompute[..recomputed].iter().all(|&r| r));
            prop_assert!(choice.device_bytes <= device_room);
            prop_assert!(choice.host_bytes <= host_room);
            for kept in 0..=layers {
                if let Some((time, _, _)) = step_ns(&input, kept) {
                    prop_assert!(choice.step_ns <= time);
                }
            }
            let roomier = RecomputeInput { device_room_bytes: device_room * 2, ..input };
            prop_assert!(choose(&roomier).unwrap().step_ns <= choice.step_ns);
        }
    }
}
