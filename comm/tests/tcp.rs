//! The TCP backend, each rank a thread of this test with its own sockets
//! (the bytes go through the kernel as between processes): the
//! conformance suite at 1 to 4 ranks, a cancel that ends a wait, a peer
//! that goes away (named at once, not after the timeout), ranks that call
//! different collectives (told so), a rendezvous a rank never joins (named
//! within the timeout), and the rendezvous through torch's own c10d
//! TCPStore, as torchrun's agent serves it (skipped, saying why, without
//! torch; failed instead with `STRATA_REQUIRE_TORCH=1`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use strata_comm::{Collective, CommError, Rendezvous, TcpWorld, conformance};
use strata_device::ViewMut;

/// The elements one exchange may carry in these checks.
const ELEMS_MAX: usize = 4 * 1031 + 8;

fn free_port() -> u16 {
    strata_comm::free_port().unwrap()
}

fn rendezvous(rank: usize, world: usize, port: u16, store: Option<&str>) -> Rendezvous {
    Rendezvous {
        rank,
        world,
        master: ("127.0.0.1".into(), port),
        store: store.map(str::to_owned),
        timeout: Duration::from_secs(20),
    }
}

/// `world` ranks, each on its own thread, connected through rank 0 at a
/// free port (or the store given), each running `body` on its world.
fn ranks<T: Send>(
    world: usize,
    store: Option<(u16, &str)>,
    body: impl Fn(TcpWorld) -> T + Sync,
) -> Vec<T> {
    let port = store.map_or_else(free_port, |(port, _)| port);
    std::thread::scope(|scope| {
        let body = &body;
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                scope.spawn(move || {
                    let r = rendezvous(rank, world, port, store.map(|(_, p)| p));
                    body(TcpWorld::connect(&r).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn tcp_ranks_pass_the_conformance_suite() {
    for world in 1..=4 {
        let results = ranks(world, None, |w| {
            let group = w.group(ELEMS_MAX, Duration::from_secs(20));
            conformance::check(&group, ELEMS_MAX)
        });
        for (rank, result) in results.into_iter().enumerate() {
            assert_eq!(result, Ok(()), "rank {rank} of {world}");
        }
    }
}

#[test]
fn tcp_subgroups_pass_the_conformance_suite() {
    for world in 2..=4 {
        let results = ranks(world, None, |w| {
            let group = w.group(ELEMS_MAX, Duration::from_secs(20));
            conformance::check_splits(&group, ELEMS_MAX)
        });
        for (rank, result) in results.into_iter().enumerate() {
            assert_eq!(result, Ok(()), "rank {rank} of {world}");
        }
    }
}

#[test]
fn a_cancel_ends_a_wait_and_the_group_refuses_after_it() {
    let results = ranks(2, None, |w| {
        let group = w.group(ELEMS_MAX, Duration::from_secs(20));
        if w.rank() == 1 {
            // Never joins the exchange; keeps its sockets open meanwhile.
            std::thread::sleep(Duration::from_millis(800));
            return None;
        }
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
        let again = group.all_reduce(ViewMut::host_slice(&mut values));
        assert!(
            matches!(
                again,
                Err(CommError::Cancelled | CommError::Abandoned { .. })
            ),
            "{again:?}"
        );
        Some(started.elapsed())
    });
    let took = results[0].unwrap();
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn a_peer_that_goes_away_is_named_at_once() {
    let results = ranks(3, None, |w| {
        let group = w.group(ELEMS_MAX, Duration::from_secs(30));
        let mut values = [w.rank() as f32; 16];
        group
            .all_reduce(ViewMut::host_slice(&mut values))
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(values, [3.0; 16]);
        if w.rank() == 2 {
            // Gone without a word, its sockets closed (as a killed
            // process's are).
            drop(group);
            drop(w);
            return None;
        }
        let started = Instant::now();
        let got = group.all_reduce(ViewMut::host_slice(&mut values));
        Some((got.map(|_| ()), started.elapsed()))
    });
    for (rank, result) in results.into_iter().take(2).enumerate() {
        let (got, took) = result.unwrap();
        // At first hand, or from the survivor that saw it first (which
        // tells the others before its own sockets close).
        match got {
            Err(CommError::Closed { rank: 2, op, .. }) => assert_eq!(op, "all_reduce"),
            other => panic!("rank {rank}: {other:?}"),
        }
        // Far inside the 30 s timeout.
        assert!(took < Duration::from_secs(5), "rank {rank}: {took:?}");
    }
}

#[test]
fn ranks_that_call_different_collectives_are_told_so() {
    let results = ranks(2, None, |w| {
        let group = w.group(ELEMS_MAX, Duration::from_secs(5));
        let mut values = [1f32; 8];
        match w.rank() {
            0 => group
                .all_reduce(ViewMut::host_slice(&mut values))
                .map(|_| ()),
            _ => {
                let sent = group.broadcast(1, ViewMut::host_slice(&mut values));
                // Open until rank 0 has read what it sent.
                std::thread::sleep(Duration::from_millis(500));
                sent.map(|_| ())
            }
        }
    });
    let said = format!("{:?}", results[0]);
    assert!(
        matches!(results[0], Err(CommError::Disagree { rank: 1, .. })),
        "{said}"
    );
    let message = results[0].as_ref().unwrap_err().to_string();
    assert!(
        message.contains("broadcast") && message.contains("all_reduce"),
        "{message}"
    );
}

#[test]
fn a_rank_that_never_comes_is_named_within_the_timeout() {
    let port = free_port();
    let started = Instant::now();
    let r = Rendezvous {
        timeout: Duration::from_secs(1),
        ..rendezvous(0, 3, port, None)
    };
    let alone = std::thread::spawn(move || {
        let r = Rendezvous {
            timeout: Duration::from_secs(1),
            ..rendezvous(1, 3, port, None)
        };
        TcpWorld::connect(&r).map(|_| ())
    });
    let got = TcpWorld::connect(&r).map(|_| ());
    let message = got.unwrap_err().to_string();
    assert!(
        message.contains("rank(s) [2]") && message.contains("MASTER_PORT"),
        "{message}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(alone.join().unwrap().is_err());
    // A port that is taken is named, with the fix.
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let message = TcpWorld::connect(&rendezvous(0, 2, port, None))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        message.contains(&format!("MASTER_PORT {port} is taken")),
        "{message}"
    );
}

/// torch's c10d TCPStore served by a Python process, as torchrun's agent
/// serves it; its port, or None (skipped) without torch.
fn torch_store() -> Option<(std::process::Child, u16)> {
    let script = "import sys, torch.distributed as d\n\
                  s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n\
                  print(s.port, flush=True)\n\
                  sys.stdin.read()\n";
    let spawned = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let required = std::env::var_os("STRATA_REQUIRE_TORCH").is_some_and(|v| v == "1");
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) if !required => {
            eprintln!("skipped: no python3 ({e})");
            return None;
        }
        Err(e) => panic!("STRATA_REQUIRE_TORCH=1 and no python3: {e}"),
    };
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    match line.trim().parse::<u16>() {
        Ok(port) => Some((child, port)),
        Err(_) => {
            let out = child.wait_with_output().unwrap();
            let why = String::from_utf8_lossy(&out.stderr);
            assert!(
                !required,
                "STRATA_REQUIRE_TORCH=1 and no torch store: {why}"
            );
            eprintln!(
                "skipped: torch's TCPStore did not start (pip install torch): {}",
                why.lines().last().unwrap_or("")
            );
            None
        }
    }
}

#[test]
fn tcp_ranks_meet_through_torchs_tcpstore() {
    let Some((store, port)) = torch_store() else {
        return;
    };
    for (world, prefix) in [(3, "run-a/0"), (2, "run-a/1")] {
        let results = ranks(world, Some((port, prefix)), |w| {
            let group = w.group(ELEMS_MAX, Duration::from_secs(20));
            conformance::check(&group, ELEMS_MAX)
        });
        for (rank, result) in results.into_iter().enumerate() {
            assert_eq!(result, Ok(()), "rank {rank} of {world} ({prefix})");
        }
    }
    drop(store);
}
