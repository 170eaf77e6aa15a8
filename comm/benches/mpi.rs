//! The MPI backend's all-gather and reduce-scatter against MPI's own
//! (`MPI_Allgather`, `MPI_Reduce_scatter_block`) on the same f32 buffers,
//! interleaved round by round, medians of rank 0's per-call times; then
//! the TCP backend's (the same ranks, meeting at a port rank 0 picks and
//! broadcasts) against MPI's own the same way:
//!
//! ```sh
//! cargo bench -p strata-comm --features mpi --bench mpi -- --ranks 2 --mib 64 --rounds 9
//! ```
//!
//! It launches itself under `mpirun` (as root, with Open MPI's two
//! allow-run-as-root variables set) and prints one JSON line. The tests
//! run the same measurement tiny (`comm/tests/mpi.rs`).

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use strata_comm::{Collective, MpiWorld, Rendezvous, TcpWorld};
use strata_device::ViewMut;

const CHILD: &str = "STRATA_MPI_BENCH";

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str, default: usize| -> anyhow::Result<usize> {
        match args.iter().position(|a| a == flag) {
            Some(i) => args
                .get(i + 1)
                .with_context(|| format!("{flag} takes a number"))?
                .parse()
                .with_context(|| format!("{flag} takes a number")),
            None => Ok(default),
        }
    };
    let (ranks, mib, rounds) = (
        value("--ranks", 2)?,
        value("--mib", 64)?,
        value("--rounds", 9)?,
    );
    if ranks == 0 || mib == 0 || rounds == 0 {
        bail!("--ranks, --mib and --rounds must be at least 1");
    }
    if std::env::var_os(CHILD).is_some() {
        return measure(mib, rounds);
    }
    let status = Command::new("mpirun")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env(CHILD, "1")
        .args(["--oversubscribe", "-n", &ranks.to_string()])
        .arg(std::env::current_exe()?)
        .args(["--mib", &mib.to_string(), "--rounds", &rounds.to_string()])
        .status()
        .context("run mpirun (apt-get install openmpi-bin libopenmpi-dev)")?;
    if !status.success() {
        bail!("mpirun: {status}");
    }
    Ok(())
}

fn measure(mib: usize, rounds: usize) -> anyhow::Result<()> {
    let world = MpiWorld::init()?;
    let elems = (mib << 20) / 4 / world.world() * world.world();
    let group = world.group(elems, Duration::from_secs(600));
    let mpi = group.compare_with_mpi(None, elems, rounds)?;
    // The TCP backend's sockets between the same ranks, at a free port of
    // rank 0's (this machine: mpirun here starts every rank on it).
    let mut port = [0u32];
    if world.rank() == 0 {
        port[0] = u32::from(strata_comm::free_port()?);
    }
    group.broadcast(0, ViewMut::host_slice(&mut port))?.wait()?;
    let tcp = TcpWorld::connect(&Rendezvous {
        rank: world.rank(),
        world: world.world(),
        master: ("127.0.0.1".into(), port[0] as u16),
        store: None,
        timeout: Duration::from_secs(60),
    })?;
    let sockets = tcp.group(elems, Duration::from_secs(600));
    let tcp = group.compare_with_mpi(Some(&sockets as &dyn Collective), elems, rounds)?;
    if world.rank() == 0 {
        let ratio = |[ours, theirs]: [f64; 2]| theirs / ours;
        println!(
            "{{\"ranks\":{},\"bytes\":{},\"rounds\":{},\"all_gather_s\":{:?},\"reduce_scatter_s\":{:?},\"all_gather_speed_vs_mpi\":{:.3},\"reduce_scatter_speed_vs_mpi\":{:.3},\"tcp_all_gather_s\":{:?},\"tcp_reduce_scatter_s\":{:?},\"tcp_all_gather_speed_vs_mpi\":{:.3},\"tcp_reduce_scatter_speed_vs_mpi\":{:.3}}}",
            world.world(),
            mpi.bytes,
            mpi.rounds,
            mpi.all_gather_s,
            mpi.reduce_scatter_s,
            ratio(mpi.all_gather_s),
            ratio(mpi.reduce_scatter_s),
            tcp.all_gather_s,
            tcp.reduce_scatter_s,
            ratio(tcp.all_gather_s),
            ratio(tcp.reduce_scatter_s)
        );
    }
    Ok(())
}
