//! The same residency paths on a CUDA device. Skipped, saying why, where no
//! GPU can be used; run for real on a GPU machine.

use strata_runtime::bench::{TiersSpec, tiers_vs_raw};
use strata_runtime::{
    Access, DeviceChoice, DeviceConfig, Dtype, Link, Runtime, RuntimeConfig, TensorKind,
    TensorMeta, Tier,
};
use strata_storage::{ByteSize, StorageConfig};

fn gpu_or_skip(test: &str) -> bool {
    match strata_runtime::device::cuda_available() {
        Ok(()) => true,
        Err(reason) => {
            eprintln!("skipped {test}: no CUDA device ({reason})");
            false
        }
    }
}

#[test]
fn cuda_round_trip_keeps_every_byte() {
    if !gpu_or_skip("cuda_round_trip_keeps_every_byte") {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = RuntimeConfig {
        device: DeviceConfig {
            kind: DeviceChoice::Cuda,
            budget: ByteSize(64 << 20),
            ..Default::default()
        },
        nvme: Some(StorageConfig {
            dirs: vec![dir.path().to_path_buf()],
            capacity: ByteSize(256 << 20),
            ..Default::default()
        }),
        host: strata_runtime::HostConfig {
            budget: ByteSize(256 << 20),
            ..Default::default()
        },
        ..Default::default()
    };
    let runtime = Runtime::new(&config).unwrap();
    let bytes = (40 << 20) + 4096 * 3 + 8;
    let id = runtime
        .register(
            TensorMeta::new("w", TensorKind::Param, Dtype::Bf16, &[bytes / 2]),
            Tier::Device,
        )
        .unwrap();
    let zeros = {
        runtime.move_to(id, Tier::Host).unwrap().wait().unwrap();
        let guard = runtime.acquire(id, Tier::Host, Access::Read).unwrap();
        let mut out = vec![1; bytes as usize];
        guard.read_into(&mut out).unwrap();
        out
    };
    assert!(
        zeros.iter().all(|&b| b == 0),
        "registered on the GPU zeroed"
    );
    let data: Vec<u8> = (0..bytes).map(|i| (i * 31 + 7) as u8).collect();
    runtime
        .acquire(id, Tier::Host, Access::Write)
        .unwrap()
        .write_from(&data)
        .unwrap();
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    let guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    assert!(guard.device_address().is_some());
    // The GPU copy read through its guard (one synchronous copy).
    let mut direct = vec![0; bytes as usize];
    guard.read_into(&mut direct).unwrap();
    assert_eq!(direct, data, "a GPU copy read through its guard");
    drop(guard);
    runtime.move_to(id, Tier::Nvme).unwrap().wait().unwrap();
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    runtime.release(id, Tier::Host).unwrap();
    runtime.release(id, Tier::Nvme).unwrap();
    runtime.move_to(id, Tier::Host).unwrap().wait().unwrap();
    let guard = runtime.acquire(id, Tier::Host, Access::Read).unwrap();
    let mut out = vec![0; bytes as usize];
    guard.read_into(&mut out).unwrap();
    assert_eq!(
        out, data,
        "host -> nvme -> host -> device -> host changed bytes"
    );
    assert!(runtime.stats().link(Link::DeviceToHost).bytes >= bytes);
    // Overwritten on the GPU from host bytes, read back there: first with
    // no device copy (fresh space, nothing uploaded), then over one.
    drop(guard);
    runtime.release(id, Tier::Device).ok();
    assert!(!runtime.residency(id).unwrap().contains(&Tier::Device));
    let uploaded = runtime.stats().link(Link::HostToDevice).bytes;
    let flipped: Vec<u8> = data.iter().map(|b| !b).collect();
    runtime.overwrite(id, Tier::Device, &flipped).unwrap();
    assert_eq!(
        runtime.stats().link(Link::HostToDevice).bytes,
        uploaded,
        "a whole overwrite moved the old bytes up first"
    );
    let guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    guard.read_into(&mut out).unwrap();
    assert_eq!(out, flipped, "a GPU copy overwritten through the runtime");
    drop(guard);
    runtime.overwrite(id, Tier::Device, &data).unwrap();
    let guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    guard.read_into(&mut out).unwrap();
    assert_eq!(out, data, "a GPU copy overwritten in place");
}

#[test]
fn cuda_tiny_tiers_bench() {
    if !gpu_or_skip("cuda_tiny_tiers_bench") {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spec = TiersSpec {
        nvme: StorageConfig {
            dirs: vec![dir.path().to_path_buf()],
            ..Default::default()
        },
        device: DeviceConfig {
            kind: DeviceChoice::Cuda,
            ..Default::default()
        },
        size_bytes: 32 << 20,
        rounds: 2,
    };
    let (device, rounds) = tiers_vs_raw(&spec, &mut |_| {}).unwrap();
    assert!(!device.is_empty());
    for round in rounds {
        assert!(round.runtime_bytes_per_s.iter().all(|&bw| bw > 0.0));
    }
}

// The four cross-stream hazards, on a GPU, with the test's own work on the
// runtime's context standing in for kernels: long chains of device copies
// on the compute stream (or uploads on the host->device stream) keep the
// stream busy while the runtime is asked for the hazardous thing, which it
// must order after them by events.

use std::sync::Arc;
use strata_device::StreamKind;
use strata_device::cuda::Context;

const MIB: u64 = 1 << 20;

/// A runtime on a context the test also drives: `device` bytes of arena, a
/// pinned pool of `host` bytes in `buffer`-byte buffers, no NVMe.
fn on_gpu(device: u64, host: u64, buffer: u64) -> (Arc<Context>, Runtime) {
    let context = Context::open(0).unwrap();
    let config = RuntimeConfig {
        device: DeviceConfig {
            kind: DeviceChoice::Cuda,
            budget: ByteSize(device),
            ..Default::default()
        },
        host: strata_runtime::HostConfig {
            classes: vec![strata_runtime::ClassConfig {
                buffer_size: ByteSize(buffer),
                bytes: ByteSize(host),
            }],
            ..Default::default()
        },
        nvme: None,
        ..Default::default()
    };
    let arena = strata_runtime::CudaDevice::on_context(context.clone(), device).unwrap();
    let runtime = Runtime::with_parts(&config, Box::new(arena), None).unwrap();
    (context, runtime)
}

fn bytes_of(seed: u8, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn tensor(runtime: &Runtime, name: &str, data: &[u8]) -> strata_runtime::TensorId {
    let id = runtime
        .register(
            TensorMeta::new(
                name,
                TensorKind::Param,
                Dtype::F32,
                &[data.len() as u64 / 4],
            ),
            Tier::Host,
        )
        .unwrap();
    runtime
        .acquire(id, Tier::Host, Access::Write)
        .unwrap()
        .write_from(data)
        .unwrap();
    id
}

/// The tensor's bytes in `tier`, read through a guard.
fn bytes_in(runtime: &Runtime, id: strata_runtime::TensorId, tier: Tier) -> Vec<u8> {
    let guard = runtime.acquire(id, tier, Access::Read).unwrap();
    let mut out = vec![0u8; guard.len_bytes() as usize];
    guard.read_into(&mut out).unwrap();
    out
}

/// `times` device copies of `len` bytes `from` -> `to` on the compute stream.
fn busy(context: &Context, from: u64, to: u64, len: u64, times: usize) {
    for _ in 0..times {
        // SAFETY: both ranges are live allocations of `len` bytes the test owns (or guards), distinct; they are read back only after a fence.
        unsafe { context.copy_on_compute(from, to, len as usize) }.unwrap();
    }
}

/// Device bytes read back after everything enqueued so far.
fn download(context: &Context, device: u64, len: u64) -> Vec<u8> {
    context.synchronize().unwrap();
    let mut out = vec![0u8; len as usize];
    // SAFETY: `out` holds `len` bytes; the range is a live allocation; synchronous.
    unsafe { context.raw_copy(StreamKind::CopyToHost, out.as_mut_ptr(), device, out.len()) }
        .unwrap();
    out
}

#[test]
fn cuda_a_kernel_reads_a_tensor_only_after_its_upload_lands() {
    if !gpu_or_skip("cuda_a_kernel_reads_a_tensor_only_after_its_upload_lands") {
        return;
    }
    let len = 256 * MIB;
    let (context, runtime) = on_gpu(len + MIB, len, 64 * MIB);
    let data = bytes_of(1, len);
    let id = tensor(&runtime, "w", &data);
    // The move completes once its copy is enqueued (about 5 ms of PCIe).
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    let mut guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    let out = context.malloc(len).unwrap();
    context.wait_on(StreamKind::Compute, guard.ready()).unwrap();
    busy(&context, guard.device_address().unwrap(), out, len, 1);
    guard.used_until(context.record(StreamKind::Compute).unwrap());
    drop(guard);
    assert!(
        download(&context, out, len) == data,
        "the kernel read before the upload landed"
    );
    // SAFETY: allocated above; the context is synchronized.
    unsafe { context.free(out) }.unwrap();
}

#[test]
fn cuda_a_device_range_is_not_reused_while_queued_work_still_reads_it() {
    if !gpu_or_skip("cuda_a_device_range_is_not_reused_while_queued_work_still_reads_it") {
        return;
    }
    let len = 128 * MIB;
    // Room for one tensor on the device: the second must take the first's.
    let (context, runtime) = on_gpu(len, 2 * len, 64 * MIB);
    let (a_data, b_data) = (bytes_of(2, len), bytes_of(3, len));
    let a = tensor(&runtime, "a", &a_data);
    let b = tensor(&runtime, "b", &b_data);
    runtime.move_to(a, Tier::Device).unwrap().wait().unwrap();
    let scratch = context.malloc(len).unwrap();
    let mut guard = runtime.acquire(a, Tier::Device, Access::Read).unwrap();
    context.wait_on(StreamKind::Compute, guard.ready()).unwrap();
    // Tens of milliseconds of reads of a's range still queued ...
    busy(&context, guard.device_address().unwrap(), scratch, len, 200);
    guard.used_until(context.record(StreamKind::Compute).unwrap());
    drop(guard);
    // ... when its room is given up and another tensor uploaded into it.
    runtime.release(a, Tier::Device).unwrap();
    runtime.move_to(b, Tier::Device).unwrap().wait().unwrap();
    assert!(
        download(&context, scratch, len) == a_data,
        "the range was overwritten under a queued reader"
    );
    assert!(bytes_in(&runtime, b, Tier::Device) == b_data);
    // SAFETY: allocated above; the context is synchronized.
    unsafe { context.free(scratch) }.unwrap();
}

#[test]
fn cuda_a_gradient_is_downloaded_only_after_the_kernel_writing_it() {
    if !gpu_or_skip("cuda_a_gradient_is_downloaded_only_after_the_kernel_writing_it") {
        return;
    }
    let len = 128 * MIB;
    let (context, runtime) = on_gpu(2 * len, 2 * len, 64 * MIB);
    let gradient = runtime
        .register(
            TensorMeta::new("grad", TensorKind::Grad, Dtype::F32, &[len / 4]),
            Tier::Device,
        )
        .unwrap();
    let expected = bytes_of(4, len);
    let source = context.malloc(len).unwrap();
    let mut staged = expected.clone();
    // SAFETY: `staged` holds `len` bytes, the range is live; synchronous.
    unsafe {
        context.raw_copy(
            StreamKind::CopyToDevice,
            staged.as_mut_ptr(),
            source,
            staged.len(),
        )
    }
    .unwrap();
    let mut guard = runtime
        .acquire(gradient, Tier::Device, Access::Write)
        .unwrap();
    context.wait_on(StreamKind::Compute, guard.ready()).unwrap();
    // The "backward" writes the gradient for tens of milliseconds.
    busy(&context, source, guard.device_address().unwrap(), len, 200);
    guard.used_until(context.record(StreamKind::Compute).unwrap());
    drop(guard);
    runtime
        .move_to(gradient, Tier::Host)
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        bytes_in(&runtime, gradient, Tier::Host) == expected,
        "downloaded before the kernel writing it finished"
    );
    context.synchronize().unwrap();
    // SAFETY: allocated above; the context is synchronized.
    unsafe { context.free(source) }.unwrap();
}

#[test]
fn cuda_a_pinned_buffer_is_not_reused_while_a_copy_from_it_is_in_flight() {
    if !gpu_or_skip("cuda_a_pinned_buffer_is_not_reused_while_a_copy_from_it_is_in_flight") {
        return;
    }
    let len = 64 * MIB;
    // One pinned buffer: the second tensor must take the first's.
    let (context, runtime) = on_gpu(2 * len, len, len);
    let first = bytes_of(5, len);
    let id = tensor(&runtime, "w", &first);
    // Keep the host->device stream busy (tens of milliseconds) so the
    // runtime's upload below queues behind it.
    let block = 256 * MIB;
    let pinned = context.alloc_pinned(block as usize, 4096).unwrap();
    let sink = context.malloc(block).unwrap();
    for _ in 0..10 {
        // SAFETY: the pinned block and the sink are live for the whole test, written by no one; the context is synchronized before they go.
        unsafe {
            context.copy_async(
                StreamKind::CopyToDevice,
                pinned.pointer().as_ptr(),
                sink,
                block as usize,
            )
        }
        .unwrap();
    }
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    // The host copy is given up while its upload is still queued; another
    // tensor takes the only pinned buffer and writes other bytes into it.
    runtime.release(id, Tier::Host).unwrap();
    let other = tensor(&runtime, "x", &bytes_of(6, len));
    assert!(
        bytes_in(&runtime, id, Tier::Device) == first,
        "the pinned source was reused under its upload"
    );
    runtime.free(other).unwrap();
    context.synchronize().unwrap();
    // SAFETY: allocated above; the context is synchronized.
    unsafe { context.free(sink) }.unwrap();
}
