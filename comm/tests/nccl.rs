//! The NCCL backend on a GPU: every operation on device buffers at world
//! size 1 (over ranks as threads for the host group) and at two processes
//! sharing the one GPU (each its own NCCL host, `NCCL_HOSTID`, over the
//! loopback, the host group over TCP), results compared bit for bit with
//! rank-order sums (at two ranks NCCL's sum is the one addition); a subgroup
//! split from the pair; one rank killed, and the other stopped within its
//! timeout, naming the collective. Skipped, saying why, where NCCL or a GPU
//! is missing; failed instead with `STRATA_REQUIRE_GPU=1`.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use half::bf16;
use strata_comm::conformance::value;
use strata_comm::{Collective, CommError, InProcess, Nccl, Rendezvous, TcpWorld};
use strata_device::cuda::{Context, PinnedHost};
use strata_device::{DeviceKind, Dtype, Element, StreamKind, View, ViewMut};

const ELEMS_MAX: usize = 2 * 1031 + 8;
const SIZES: [usize; 3] = [1, 7, 1031];
/// How long a rank waits for a peer in these checks.
const TIMEOUT: Duration = Duration::from_secs(5);

/// One GPU test at a time (their timings would mix otherwise).
static GPU: Mutex<()> = Mutex::new(());

/// The GPU's context, or `None` (having said why) where NCCL or a GPU is
/// missing.
fn gpu() -> Option<Arc<Context>> {
    let why = match (
        strata_comm::nccl_version(),
        strata_device::cuda::probe_device(),
    ) {
        (Ok(_), Ok(())) => match Context::open(0) {
            Ok(context) => return Some(context),
            Err(err) => err.to_string(),
        },
        (Err(err), _) => err.to_string(),
        (_, Err(why)) => why,
    };
    assert!(
        std::env::var_os("STRATA_REQUIRE_GPU").is_none(),
        "STRATA_REQUIRE_GPU is set, but: {why}"
    );
    println!("skipped: {why}");
    None
}

/// Device memory holding a copy of a host slice.
struct OnDevice {
    context: Arc<Context>,
    address: u64,
    len: usize,
    dtype: Dtype,
    staging: PinnedHost,
}

impl OnDevice {
    fn upload<T: Element>(context: &Arc<Context>, values: &[T]) -> OnDevice {
        let bytes = std::mem::size_of_val(values).max(4);
        let staging = context.alloc_pinned(bytes, 64).unwrap();
        // SAFETY: the staging buffer holds `bytes` and is ours.
        unsafe {
            std::ptr::copy_nonoverlapping(
                values.as_ptr().cast::<u8>(),
                staging.pointer().as_ptr(),
                std::mem::size_of_val(values),
            )
        };
        let address = context.malloc(bytes as u64).unwrap();
        // Synced below before either is touched.
        // SAFETY: a pinned source and fresh device memory of `bytes`.
        unsafe { context.write_on_compute(staging.pointer().as_ptr(), address, bytes) }.unwrap();
        context.record(StreamKind::Compute).unwrap().wait().unwrap();
        OnDevice {
            context: context.clone(),
            address,
            len: values.len(),
            dtype: T::DTYPE,
            staging,
        }
    }

    fn view(&self) -> View<'_> {
        // SAFETY: `len` elements of `dtype` this value owns, borrowed.
        unsafe { View::from_raw_parts(self.address, self.len, self.dtype, DeviceKind::Cuda) }
    }

    fn view_mut(&mut self) -> ViewMut<'_> {
        // SAFETY: as above, borrowed mutably.
        unsafe { ViewMut::from_raw_parts(self.address, self.len, self.dtype, DeviceKind::Cuda) }
    }

    fn download<T: Element + Default>(&self) -> Vec<T> {
        let bytes = self.len * std::mem::size_of::<T>();
        let host = self.staging.pointer().as_ptr();
        // SAFETY: the staging buffer holds the bytes; synced before reading.
        unsafe { self.context.read_on_compute(self.address, host, bytes) }.unwrap();
        self.context
            .record(StreamKind::Compute)
            .unwrap()
            .wait()
            .unwrap();
        let mut out = vec![T::default(); self.len];
        // SAFETY: `bytes` were copied in, and `out` holds them.
        unsafe { std::ptr::copy_nonoverlapping(host, out.as_mut_ptr().cast::<u8>(), bytes) };
        out
    }
}

impl Drop for OnDevice {
    fn drop(&mut self) {
        // SAFETY: ours, and every operation on it was waited for.
        unsafe { self.context.free(self.address) }.unwrap();
    }
}

/// Rank-order sum over `world` ranks of element `i` of their operands.
fn sum(world: usize, i: usize) -> f32 {
    (0..world).fold(0.0f32, |s, r| s + value(r, i))
}

/// Every operation of `group` on device buffers of `context`, checked.
fn exercise(group: &dyn Collective, context: &Arc<Context>) {
    let (rank, world) = (group.rank(), group.world());
    for n in SIZES {
        let mine: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
        let shard = OnDevice::upload(context, &mine);
        let mut out = OnDevice::upload(context, &vec![0.0f32; world * n]);
        group
            .all_gather(shard.view(), out.view_mut())
            .unwrap()
            .wait()
            .unwrap();
        let gathered = out.download::<f32>();
        for (j, got) in gathered.iter().enumerate() {
            assert_eq!(
                got.to_bits(),
                value(j / n, j % n).to_bits(),
                "all_gather {n}"
            );
        }
        let full: Vec<f32> = (0..world * n).map(|j| value(rank, j)).collect();
        let full = OnDevice::upload(context, &full);
        let mut part = OnDevice::upload(context, &vec![0.0f32; n]);
        group
            .reduce_scatter(full.view(), part.view_mut())
            .unwrap()
            .wait()
            .unwrap();
        for (i, got) in part.download::<f32>().iter().enumerate() {
            let want = sum(world, rank * n + i);
            assert_eq!(got.to_bits(), want.to_bits(), "reduce_scatter {n}");
        }
        let halves: Vec<bf16> = full
            .download::<f32>()
            .iter()
            .map(|&x| bf16::from_f32(x))
            .collect();
        let halves = OnDevice::upload(context, &halves);
        let mut part16 = OnDevice::upload(context, &vec![bf16::ZERO; n]);
        group
            .reduce_scatter(halves.view(), part16.view_mut())
            .unwrap()
            .wait()
            .unwrap();
        for (i, got) in part16.download::<bf16>().iter().enumerate() {
            let j = rank * n + i;
            let want = (0..world).fold(0.0f32, |s, r| s + bf16::from_f32(value(r, j)).to_f32());
            assert_eq!(
                got.to_bits(),
                bf16::from_f32(want).to_bits(),
                "bf16 reduce_scatter {n}"
            );
        }
        let mut values = OnDevice::upload(context, &mine);
        group.all_reduce(values.view_mut()).unwrap().wait().unwrap();
        for (i, got) in values.download::<f32>().iter().enumerate() {
            assert_eq!(got.to_bits(), sum(world, i).to_bits(), "all_reduce {n}");
        }
        let root = world - 1;
        let mut values = OnDevice::upload(context, &mine);
        group
            .broadcast(root, values.view_mut())
            .unwrap()
            .wait()
            .unwrap();
        for (i, got) in values.download::<f32>().iter().enumerate() {
            assert_eq!(got.to_bits(), value(root, i).to_bits(), "broadcast {n}");
        }
    }
    // Host operands go to the host group; a wrong shape is refused.
    let mine = [value(rank, 0); 3];
    let mut host = vec![0.0f32; 3 * world];
    group
        .all_gather(View::host_slice(&mine), ViewMut::host_slice(&mut host))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(host[3 * (world - 1)], value(world - 1, 0));
    let shard = OnDevice::upload(context, &mine);
    let mut short = OnDevice::upload(context, &[0.0f32; 2]);
    match group.all_gather(shard.view(), short.view_mut()) {
        Err(CommError::Shape {
            op: "all_gather", ..
        }) => {}
        other => panic!("a short output was not refused: {:?}", other.err()),
    }
    let mut scalars = [rank as f64 + 1.0];
    group.all_reduce_scalars(&mut scalars).unwrap();
    assert_eq!(scalars[0], (1..=world).sum::<usize>() as f64);
}

#[test]
fn nccl_at_world_size_one_runs_every_operation_on_the_gpu() {
    let _one = GPU.lock().unwrap_or_else(|p| p.into_inner());
    let Some(context) = gpu() else { return };
    let (major, minor, patch) = strata_comm::nccl_version().unwrap();
    println!("NCCL {major}.{minor}.{patch}");
    let host = InProcess::group(1, ELEMS_MAX).pop().unwrap();
    let group = Nccl::connect(Box::new(host), context.clone(), ELEMS_MAX, TIMEOUT).unwrap();
    exercise(&group, &context);
    let single = group.split(&[0]).unwrap();
    exercise(&*single, &context);
}

/// Which part of the two-process checks this process plays, when the
/// parent test started it.
const CHILD: &str = "STRATA_NCCL_CHILD";

/// This test binary as rank `rank` of two, running `mode`.
fn child(rank: usize, port: u16, mode: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            "nccl_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, format!("{rank}:{port}:{mode}"))
        // Two NCCL hosts on one GPU, over the loopback's sockets.
        .env("NCCL_HOSTID", format!("strata-nccl-test-{rank}"))
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("NCCL_NET", "Socket")
        .env("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// A child's exit and its output (both streams, drained as it runs).
struct Ended {
    success: bool,
    text: String,
}

/// Both children of `mode`, their output drained on threads, killed past
/// two minutes.
fn pair(mode: &str) -> Vec<Ended> {
    let port = strata_comm::free_port().unwrap();
    let mut children: Vec<Child> = (0..2)
        .map(|rank| child(rank, port, mode).spawn().unwrap())
        .collect();
    let drains: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let (mut out, mut err) = (c.stdout.take().unwrap(), c.stderr.take().unwrap());
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = out.read_to_string(&mut text);
                let _ = err.read_to_string(&mut text);
                text
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut statuses = vec![None; 2];
    while statuses.iter().any(Option::is_none) {
        for (child, status) in children.iter_mut().zip(&mut statuses) {
            if status.is_none() {
                *status = child.try_wait().unwrap();
            }
        }
        if Instant::now() > deadline {
            children.iter_mut().for_each(|c| drop(c.kill()));
            panic!("the two ranks ran past two minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    statuses
        .into_iter()
        .zip(drains)
        .map(|(status, drain)| Ended {
            success: status.unwrap().success(),
            text: drain.join().unwrap(),
        })
        .collect()
}

#[test]
fn two_processes_on_one_gpu_give_rank_order_sums() {
    let _one = GPU.lock().unwrap_or_else(|p| p.into_inner());
    if gpu().is_none() {
        return;
    }
    for (rank, ended) in pair("exercise").iter().enumerate() {
        assert!(ended.success, "rank {rank}: {}", ended.text);
        assert!(
            ended.text.contains("exercised"),
            "rank {rank}: {}",
            ended.text
        );
    }
}

#[test]
fn a_killed_rank_stops_the_other_within_its_timeout() {
    let _one = GPU.lock().unwrap_or_else(|p| p.into_inner());
    if gpu().is_none() {
        return;
    }
    let ended = pair("die");
    let survivor = &ended[0];
    assert!(survivor.success, "rank 0: {}", survivor.text);
    let line = survivor.text.lines().find(|l| l.contains("stopped after"));
    println!(
        "{}",
        line.unwrap_or_else(|| panic!("rank 0: {}", survivor.text))
    );
}

/// The children's side (does nothing when the parent did not start it).
#[test]
fn nccl_child() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    let mut parts = role.split(':');
    let rank: usize = parts.next().unwrap().parse().unwrap();
    let port: u16 = parts.next().unwrap().parse().unwrap();
    let mode = parts.next().unwrap();
    let context = Context::open(0).unwrap();
    let world = TcpWorld::connect(&Rendezvous {
        rank,
        world: 2,
        master: ("127.0.0.1".into(), port),
        store: None,
        timeout: Duration::from_secs(60),
    })
    .unwrap();
    let host = world.group(ELEMS_MAX, TIMEOUT);
    let group = Nccl::connect(Box::new(host), context.clone(), ELEMS_MAX, TIMEOUT).unwrap();
    match mode {
        "exercise" => {
            exercise(&group, &context);
            for part in [[0], [1]] {
                if part[0] == rank {
                    exercise(&*group.split(&part).unwrap(), &context);
                }
            }
            println!("rank {rank}: exercised");
        }
        "die" if rank == 1 => std::process::exit(3),
        "die" => {
            let started = Instant::now();
            let mut values = OnDevice::upload(&context, &[1.0f32; 1 << 20]);
            let err = loop {
                let done = group
                    .all_reduce(values.view_mut())
                    .and_then(|fence| Ok(fence.wait()?));
                if let Err(err) = done {
                    break err;
                }
                assert!(
                    started.elapsed() < TIMEOUT * 4,
                    "no error after the peer died"
                );
            };
            let waited = started.elapsed();
            assert!(
                waited < TIMEOUT + Duration::from_secs(10),
                "{waited:?}: {err}"
            );
            println!("rank 0: stopped after {waited:?}: {err}");
            // The group refuses every later call.
            assert!(matches!(
                group.all_reduce(values.view_mut()),
                Err(CommError::Abandoned { .. })
            ));
        }
        other => panic!("unknown mode {other}"),
    }
}
