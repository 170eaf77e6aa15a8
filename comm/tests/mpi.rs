//! The MPI backend under `mpirun`: the conformance suite every backend
//! passes, at 1, 2 and 4 processes (4 oversubscribed on a 2-core machine);
//! the bench's comparison with MPI's own collectives, tiny;
//! a cancel that ends a wait for a peer that never comes; and a peer that
//! exits in the middle of a run, which the others report by rank within
//! the timeout instead of waiting forever. Each check launches this test
//! binary under `mpirun` (the parent, when `mpirun` is on PATH; skipped
//! with the reason otherwise, failed instead with `STRATA_REQUIRE_MPI=1`),
//! and each launched process runs one mode (`STRATA_MPI_TEST`).

#![cfg(feature = "mpi")]

use std::process::Command;
use std::time::{Duration, Instant};

use strata_comm::{Collective, CommError, MpiWorld, conformance};
use strata_device::ViewMut;

/// The mode a launched process runs.
const MODE: &str = "STRATA_MPI_TEST";
const TEST: &str = "mpi_processes_pass_the_conformance_suite_and_survive_a_peer";
/// The elements one exchange may carry in these checks.
const ELEMS_MAX: usize = 4 * 1031 + 8;

fn mpirun() -> Option<Command> {
    let found = Command::new("mpirun").arg("--version").output().is_ok();
    if !found {
        if std::env::var_os("STRATA_REQUIRE_MPI").is_some_and(|v| v == "1") {
            panic!("STRATA_REQUIRE_MPI=1 and no mpirun on PATH (apt-get install openmpi-bin)");
        }
        eprintln!("skipped: no mpirun on PATH (apt-get install openmpi-bin libopenmpi-dev)");
        return None;
    }
    let mut command = Command::new("mpirun");
    // As root (CI containers) Open MPI asks for both.
    command
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .arg("--oversubscribe");
    Some(command)
}

/// Runs this test as `processes` ranks in `mode` under mpirun (the extra
/// arguments before the program); its exit status and output.
fn launch(
    mpirun: &mut Command,
    processes: usize,
    mode: &str,
    extra: &[&str],
) -> (bool, String, Duration) {
    let started = Instant::now();
    let out = mpirun
        .args(extra)
        .args(["-n", &processes.to_string()])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads", "1"])
        .env(MODE, mode)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text, started.elapsed())
}

#[test]
fn mpi_processes_pass_the_conformance_suite_and_survive_a_peer() {
    if let Ok(mode) = std::env::var(MODE) {
        return launched(&mode);
    }
    let Some(_) = mpirun() else { return };
    for processes in [1, 2, 4] {
        let (ok, text, took) = launch(&mut mpirun().unwrap(), processes, "conformance", &[]);
        eprintln!("{processes} processes: {:.1} s", took.as_secs_f64());
        assert!(ok, "{processes} processes:\n{text}");
        for rank in 0..processes {
            assert!(
                text.contains(&format!("rank {rank} of {processes}: conformance ok")),
                "{processes} processes, rank {rank}:\n{text}"
            );
        }
    }
    // The bench's measurement, tiny.
    let (ok, text, _) = launch(&mut mpirun().unwrap(), 2, "bench", &[]);
    assert!(ok && text.contains("rank 0: compared"), "{text}");
    // A cancel ends rank 0's wait for a peer that is not coming.
    let (_, text, _) = launch(&mut mpirun().unwrap(), 2, "cancel", &[]);
    assert!(text.contains("rank 0: cancelled within"), "{text}");
    // Rank 1 exits mid-run; rank 0's next exchange names it, after the
    // timeout, with mpirun told not to end the job for it.
    let (_, text, took) = launch(&mut mpirun().unwrap(), 2, "leave", &["--enable-recovery"]);
    eprintln!("a peer that left: {:.1} s\n{text}", took.as_secs_f64());
    assert!(text.contains("rank 0: timed out naming [1]"), "{text}");
    assert!(took < Duration::from_secs(30), "{took:?}");
}

/// What a process under mpirun does in `mode`.
fn launched(mode: &str) {
    let world = MpiWorld::init().unwrap();
    let (rank, size) = (world.rank(), world.world());
    match mode {
        "conformance" => {
            let group = world.group(ELEMS_MAX, Duration::from_secs(60));
            let checked = conformance::check(&group, ELEMS_MAX)
                .and_then(|()| conformance::check_splits(&group, ELEMS_MAX));
            match checked {
                Ok(()) => println!("rank {rank} of {size}: conformance ok"),
                Err(failure) => panic!("rank {rank} of {size}: {failure}"),
            }
        }
        "bench" => {
            let group = world.group(ELEMS_MAX, Duration::from_secs(60));
            let c = group.compare_with_mpi(None, 2 * 1024, 3).unwrap();
            let times = [c.all_gather_s, c.reduce_scatter_s];
            assert!(
                times.iter().flatten().all(|t| t.is_finite() && *t > 0.0),
                "{c:?}"
            );
            assert_eq!((c.bytes, c.rounds), (8 * 1024, 3));
            println!("rank {rank}: compared {c:?}");
        }
        "cancel" => {
            let group = world.group(ELEMS_MAX, Duration::from_secs(60));
            if rank == 0 {
                let cancel = group.cancel_token();
                let started = Instant::now();
                let canceller = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(300));
                    cancel.cancel();
                });
                let mut values = [1f32; 64];
                let got = group.all_reduce(ViewMut::host_slice(&mut values));
                canceller.join().unwrap();
                assert!(matches!(got, Err(CommError::Cancelled)), "{got:?}");
                // Later calls are refused, not attempted.
                let again = group.all_reduce(ViewMut::host_slice(&mut values));
                assert!(
                    matches!(again, Err(CommError::Abandoned { .. })),
                    "{again:?}"
                );
                println!(
                    "rank 0: cancelled within {:.2} s",
                    started.elapsed().as_secs_f64()
                );
            }
            // Rank 1 never joins; both exit (rank 0 without finalizing).
        }
        "leave" => {
            let group = world.group(ELEMS_MAX, Duration::from_secs(3));
            let mut values = [rank as f32; 16];
            group
                .all_reduce(ViewMut::host_slice(&mut values))
                .unwrap()
                .wait()
                .unwrap();
            if rank == 1 {
                // Gone without a word (as a killed process is).
                std::process::exit(0);
            }
            let got = group.all_reduce(ViewMut::host_slice(&mut values));
            match got {
                Err(CommError::Timeout { ref peers, .. }) => {
                    println!("rank 0: timed out naming {peers:?}");
                    println!("{}", got.unwrap_err());
                }
                other => panic!("rank 0: {other:?}"),
            }
        }
        other => panic!("no mode {other}"),
    }
    drop(world);
}
