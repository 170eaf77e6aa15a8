//! Which blocks recompute their forward in backward
//! (`train.checkpoint_activations`): every one, none, or with `"auto"` the
//! fastest in a simulation of the plans of a few candidates:
//! [`strata_scheduler::recompute::choose`]'s picks from this rank's
//! budgets and two measurements taken here (one block's forward on the
//! backend, a round trip of an activation through the runtime), and every
//! block. Nothing is measured when every block's activations fit the
//! device: then none recomputes.

use std::time::Instant;

use strata_runtime::{Access, Dtype, Runtime, TensorKind, TensorMeta, Tier};
use strata_scheduler as sched;
use strata_scheduler::recompute::{Held, RecomputeInput, choose, rooms};

use super::compute::Workspace;
use super::config::{Placement, TrainConfig};
use super::env::Env;
use super::tensors::Kept;
use super::tensors::{Slot, class_of, links, sched_tier};
use crate::error::Result;
use crate::model::Buffers;

/// Bytes of the activation round trip measured, at most.
const LINK_PROBE_BYTES_MAX: u64 = 64 << 20;

/// Timed repetitions of each measurement (after one untimed).
const PROBE_ROUNDS: usize = 3;

/// What one block keeps per micro-batch: its activation buffer, or its
/// input part.
pub(super) fn kept_bytes(buffers: &Buffers) -> Kept {
    let dtype = buffers.dtype();
    Kept {
        whole: buffers.kept_bytes(),
        input: buffers.input_bytes(),
        dtype,
    }
}

/// What the engine's plans are costed with when they were measured: one
/// block's forward of one micro-batch, and the host <-> device rates.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rates {
    pub(super) block_forward_ns: f64,
    pub(super) host_to_device_bytes_per_s: f64,
    pub(super) device_to_host_bytes_per_s: f64,
}

/// The blocks that may recompute, per candidate, best guess first: one
/// for `true` and `false` and when every block's activations fit the
/// device; else, with the rates measured for them, `recompute::choose`'s
/// pick, its pick with nothing kept on the host, and every block, for the
/// engine to simulate and pick from.
pub(super) struct Candidates {
    pub(super) recompute: Vec<Vec<bool>>,
    pub(super) rates: Option<Rates>,
}

impl Rates {
    /// The engine's links with host <-> device as measured.
    pub(super) fn links(&self) -> sched::Links {
        let mut links = links();
        links.host_to_device.bytes_per_s = self.host_to_device_bytes_per_s;
        links.device_to_host.bytes_per_s = self.device_to_host_bytes_per_s;
        links
    }
}

impl Candidates {
    fn one(recompute: Vec<bool>) -> Candidates {
        Candidates {
            recompute: vec![recompute],
            rates: None,
        }
    }
}

/// The per-block candidates of `config`: fixed for `true` and `false`;
/// for `"auto"`, chosen for this rank's rooms (`capacity_bytes`: what the
/// plan may use per tier, `slots`: the tensors with their homes).
pub(super) fn recompute_blocks(
    env: &Env,
    ws: &mut Workspace,
    slots: &[Slot],
    capacity_bytes: [u64; 3],
) -> Result<Candidates> {
    let (config, runtime) = (env.config(), &**env.runtime());
    let layers = env.model().layers();
    if let Some(fixed) = config.train.checkpoint_activations.fixed(layers) {
        return Ok(Candidates::one(fixed));
    }
    let batch = config.train.micro_batch;
    let Kept { whole, input, .. } = kept_bytes(ws.buffers());
    let footprint = |bytes: u64, tier: Tier| runtime.footprint_bytes(bytes)[tier.index()];
    let states = slots
        .iter()
        .filter(|s| s.meta.kind != TensorKind::Activation)
        .map(|slot| Held {
            class: class_of(slot.meta.kind),
            home: slot.home.map(sched_tier),
            bytes: runtime.footprint_bytes(slot.meta.len_bytes()),
        });
    let (device_room, host_room) = rooms(states, capacity_bytes);
    let mut input_model = RecomputeInput {
        layers,
        micro_batches: config.train.in_flight(),
        full_bytes: footprint(whole, Tier::Device),
        input_bytes: footprint(input, Tier::Device),
        host_bytes: (footprint(whole, Tier::Host), footprint(input, Tier::Host)),
        device_room_bytes: device_room,
        host_room_bytes: host_room,
        block_forward_ns: 0.0,
        step_compute_ns: 0.0,
        device_to_host: links().device_to_host,
        host_to_device: links().host_to_device,
        link_busy_ns: (0.0, 0.0),
    };
    let all_kept = input_model
        .full_bytes
        .saturating_mul((layers * input_model.micro_batches) as u64);
    if all_kept <= input_model.device_room_bytes {
        tracing::info!(
            "activations: every block keeps its {} bytes per micro-batch on the device, none recomputes",
            input_model.full_bytes
        );
        return Ok(Candidates::one(vec![false; layers]));
    }
    let forward_ns = measure_block_forward(env, batch, ws)?;
    // A measurement, not the run: when the runtime refuses the probe (no
    // room, an injected fault), the links' estimates stand in.
    let (up, down) = measure_links(runtime, input_model.full_bytes, capacity_bytes)
        .unwrap_or_else(|err| {
            tracing::warn!("activations: the host<->device rates could not be measured ({err}); using the estimates");
            let estimate = links();
            (estimate.host_to_device.bytes_per_s, estimate.device_to_host.bytes_per_s)
        });
    input_model.block_forward_ns = forward_ns;
    // A block's forward and backward (twice the forward) per micro-batch.
    input_model.step_compute_ns = 3.0 * forward_ns * (layers * input_model.micro_batches) as f64;
    input_model.host_to_device.bytes_per_s = up;
    input_model.device_to_host.bytes_per_s = down;
    input_model.link_busy_ns = link_busy_ns(config, runtime, slots, up, down);
    let rates = Rates {
        block_forward_ns: forward_ns,
        host_to_device_bytes_per_s: up,
        device_to_host_bytes_per_s: down,
    };
    tracing::info!(
        "activations: not all fit the device; block forward {:.3} ms, host<->device {:.2}/{:.2} GB/s measured",
        forward_ns / 1e6,
        up / 1e9,
        down / 1e9,
    );
    let on_device = RecomputeInput {
        host_room_bytes: 0,
        ..input_model
    };
    let mut recompute = Vec::with_capacity(3);
    // The rooms are estimates: when nothing fits them, the plans of every
    // block recomputing decide, and say what does not fit.
    for choice in [choose(&input_model), choose(&on_device)]
        .into_iter()
        .flatten()
    {
        if !recompute.contains(&choice.recompute) {
            recompute.push(choice.recompute);
        }
    }
    let every = vec![true; layers];
    if !recompute.contains(&every) {
        recompute.push(every);
    }
    Ok(Candidates {
        recompute,
        rates: Some(rates),
    })
}

/// The parameters' and gradients' traffic each step, in ns each way: the
/// parameters up once per pass (forward and backward) when they live off
/// the device, the gradients down when the optimizer does.
fn link_busy_ns(
    config: &TrainConfig,
    runtime: &Runtime,
    slots: &[Slot],
    up: f64,
    down: f64,
) -> (f64, f64) {
    let mut bytes = (0u64, 0u64);
    for slot in slots {
        let device = runtime.footprint_bytes(slot.meta.len_bytes())[Tier::Device.index()];
        match slot.meta.kind {
            // Both sets counted: the step fetches its own twice (forward
            // and backward).
            TensorKind::Param if config.placement.params != Placement::Device => bytes.0 += device,
            TensorKind::Grad if config.placement.optimizer != Placement::Device => {
                bytes.1 += device
            }
            _ => {}
        }
    }
    (bytes.0 as f64 / up * 1e9, bytes.1 as f64 / down * 1e9)
}

/// One block's forward of one micro-batch on the workspace (its values are
/// whatever it holds: the time is what counts), synchronized, the median
/// of [`PROBE_ROUNDS`] after an untimed one (a GPU compiles and loads its
/// kernels then).
fn measure_block_forward(env: &Env, batch: usize, ws: &mut Workspace) -> Result<f64> {
    let (backend, model) = (env.backend(), env.model());
    // The first block's parameters' count.
    let block_params = env.groups()[1].params;
    let mut times = [0.0; PROBE_ROUNDS];
    for round in 0..=PROBE_ROUNDS {
        let started = Instant::now();
        ws.probe_block_forward(backend, model, batch, block_params)?;
        // The host waits for the device (`Backend::wait` would only order
        // the compute stream: on a GPU the clock would time the launches).
        backend.record()?.wait()?;
        if round > 0 {
            times[round - 1] = started.elapsed().as_nanos() as f64;
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[PROBE_ROUNDS / 2])
}

/// Bytes per second host -> device and back through the runtime (pinned
/// pool, copy engines), for a tensor of up to `bytes`: the best of
/// [`PROBE_ROUNDS`]. The probe tensor is freed before the model's are
/// registered.
fn measure_links(runtime: &Runtime, bytes: u64, capacity_bytes: [u64; 3]) -> Result<(f64, f64)> {
    let room = capacity_bytes[Tier::Device.index()].min(capacity_bytes[Tier::Host.index()]) / 4;
    let bytes = bytes.min(LINK_PROBE_BYTES_MAX).min(room) / 4 * 4;
    if bytes == 0 {
        let fallback = links();
        return Ok((
            fallback.host_to_device.bytes_per_s,
            fallback.device_to_host.bytes_per_s,
        ));
    }
    let meta = TensorMeta::new(
        "activation link probe",
        TensorKind::Activation,
        Dtype::F32,
        &[bytes / 4],
    );
    let id = runtime.register_unfilled(meta, Tier::Host)?;
    let rate = |started: Instant| bytes as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let timed = || -> Result<(f64, f64)> {
        let mut best = (0.0f64, 0.0f64);
        for _ in 0..PROBE_ROUNDS {
            let started = Instant::now();
            runtime.move_to(id, Tier::Device)?.wait()?;
            runtime
                .acquire(id, Tier::Device, Access::Read)?
                .ready()
                .wait()?;
            best.0 = best.0.max(rate(started));
            runtime.release(id, Tier::Host)?;
            let started = Instant::now();
            runtime.move_to(id, Tier::Host)?.wait()?;
            runtime
                .acquire(id, Tier::Host, Access::Read)?
                .ready()
                .wait()?;
            // Moving down released the device copy.
            best.1 = best.1.max(rate(started));
        }
        Ok(best)
    };
    let measured = timed();
    // Freed whatever the measurement did; its error first.
    let freed = runtime.free(id);
    let measured = measured?;
    freed?;
    Ok(measured)
}

/// Widens the recomputed prefix of blocks (1, 2, 4, ... blocks, then all)
/// when the plans do not fit with the choice; false when every block
/// recomputes already.
pub(super) fn widen(recompute: &mut [bool]) -> bool {
    let recomputed = recompute.iter().filter(|&&r| r).count();
    if recomputed == recompute.len() {
        return false;
    }
    let next = (2 * recomputed).max(1).min(recompute.len());
    recompute[..next].fill(true);
    true
}

#[cfg(test)]
mod tests {
    use super::widen;

    #[test]
    fn widening_doubles_the_recomputed_prefix_until_every_block_recomputes() {
        let mut recompute = vec![false; 5];
        let mut seen = Vec::new();
        while widen(&mut recompute) {
            seen.push(recompute.iter().filter(|&&r| r).count());
            let recomputed = seen[seen.len() - 1];
            assert!(recompute[..recomputed].iter().all(|&r| r));
        }
        assert_eq!(seen, [1, 2, 4, 5]);
    }
}
