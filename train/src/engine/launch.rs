//! The launch contract: which rank of how many this process is, read from
//! the variables its launcher sets - torchrun's (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), else
//! Open MPI's (`OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`,
//! `_LOCAL_SIZE`), else PMI's (MPICH and Intel MPI: `PMI_RANK`,
//! `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`), else Slurm's
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
//! `SLURM_NTASKS_PER_NODE`). Without any, the process is a run of its
//! own (its ranks, if several, are threads). torchrun's ranks meet over
//! TCP: through its agent's store when `TORCHELASTIC_USE_AGENT_STORE` says
//! there is one, else at rank 0's `MASTER_ADDR:MASTER_PORT`. srun's meet
//! over TCP too, at `MASTER_ADDR:MASTER_PORT` when set, else on the step's
//! first node at a port of the job and step id; mpirun's and PMI
//! launchers' over MPI.

use crate::error::{Result, TrainError};

/// Who launched the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun (or `strata train --nproc`): a rendezvous at
    /// `MASTER_ADDR:MASTER_PORT`.
    Torchrun,
    /// Open MPI's mpirun.
    OpenMpi,
    /// A PMI launcher (MPICH's or Intel MPI's mpiexec).
    Pmi,
    /// Slurm's srun.
    Slurm,
}

impl Launcher {
    /// Its name, as a message says it.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "Open MPI's mpirun",
            Launcher::Pmi => "a PMI launcher (mpiexec)",
            Launcher::Slurm => "Slurm's srun",
        }
    }

    /// Whether its processes find each other through MPI (mpirun and
    /// PMI launchers); torchrun's and srun's meet over TCP.
    pub fn is_mpi(self) -> bool {
        matches!(self, Launcher::OpenMpi | Launcher::Pmi)
    }
}

/// This process's place in a launched job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Who launched it.
    pub launcher: Launcher,
    /// Its rank, `0..world`.
    pub rank: usize,
    /// Processes in the job.
    pub world: usize,
    /// Its rank among the processes on its machine (which GPU it takes).
    pub local_rank: usize,
    /// Processes on its machine.
    pub local_world: usize,
    /// Where rank 0 meets the others over TCP (torchrun and srun):
    /// torchrun's `MASTER_ADDR:MASTER_PORT`; under srun those if set, else
    /// the step's first node and a port of its job and step id.
    pub master: Option<(String, u16)>,
    /// Under torchrun's agent (`TORCHELASTIC_USE_AGENT_STORE=True`), which
    /// serves a c10d TCPStore at `master`: the prefix of this run's keys
    /// there (`TORCHELASTIC_RUN_ID`/`TORCHELASTIC_RESTART_COUNT`, so a
    /// restarted job meets afresh). `None`: rank 0 listens at `master`.
    pub store: Option<String>,
}

impl Launch {
    /// The launch `get` (the process's environment: `std::env::var`
    /// without the error) describes, or None for a process no launcher
    /// started. A variable that does not parse, or numbers that do not
    /// fit (a rank past the world), are refused naming the variable.
    pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let sets = [
            (
                Launcher::Torchrun,
                ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            ),
            (
                Launcher::OpenMpi,
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
            ),
            (
                Launcher::Pmi,
                ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
            ),
            (
                Launcher::Slurm,
                [
                    "SLURM_PROCID",
                    "SLURM_NTASKS",
                    "SLURM_LOCALID",
                    "SLURM_NTASKS_PER_NODE",
                ],
            ),
        ];
        for (launcher, [rank, world, local_rank, local_world]) in sets {
            // A launcher is known by its rank and world; the local ones
            // default to the whole job on one machine.
            let (Some(r), Some(w)) = (get(rank), get(world)) else {
                continue;
            };
            let number = |name: &'static str, text: &str| -> Result<usize> {
                text.trim().parse::<usize>().map_err(|_| TrainError::Config {
                    key: name,
                    value: text.to_string(),
                    fix: format!(
                        "{name} must be a whole number (set by {}); unset it if this process was not launched by it",
                        launcher.name()
                    ),
                })
            };
            let rank_value = number(rank, &r)?;
            let world_value = number(world, &w)?;
            let local_rank_value = match get(local_rank) {
                Some(text) => number(local_rank, &text)?,
                None => rank_value,
            };
            let local_world_value = match get(local_world) {
                // Slurm writes "2(x3)" for three nodes of two tasks each.
                Some(text) if launcher == Launcher::Slurm => {
                    number(local_world, text.split('(').next().unwrap_or(&text))?
                }
                Some(text) => number(local_world, &text)?,
                // Without --ntasks-per-node, srun says each node's tasks
                // in a list ("2(x3),1"), this node's at SLURM_NODEID.
                None if launcher == Launcher::Slurm => {
                    let node = get("SLURM_NODEID")
                        .and_then(|t| t.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
                        .into_iter()
                        .find_map(get)
                        .and_then(|list| tasks_on_node(&list, node))
                        .unwrap_or(world_value)
                }
                None => world_value,
            };
            let out_of = |name: &'static str, value: usize, of: &'static str, max: usize| {
                TrainError::Config {
                    key: name,
                    value: value.to_string(),
                    fix: format!(
                        "{name} must be below {of} ({max}): the launcher's variables disagree"
                    ),
                }
            };
            if world_value == 0 || rank_value >= world_value {
                return Err(out_of(rank, rank_value, world, world_value));
            }
            if local_world_value == 0
                || local_world_value > world_value
                || local_rank_value >= local_world_value
            {
                return Err(out_of(
                    local_rank,
                    local_rank_value,
                    local_world,
                    local_world_value,
                ));
            }
            let port = match get("MASTER_PORT") {
                Some(text) => Some(text.trim().parse::<u16>().map_err(|_| TrainError::Config {
                    key: "MASTER_PORT",
                    value: text.clone(),
                    fix: "MASTER_PORT must be a TCP port (1-65535)".into(),
                })?),
                None => None,
            };
            let master = match launcher {
                Launcher::Torchrun => Some((
                    get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
                    port.unwrap_or(29500),
                )),
                // Rank 0 runs on the step's first node; the port is the
                // job step's, so that every rank picks the same one.
                Launcher::Slurm => {
                    let nodes = [
                        "SLURM_STEP_NODELIST",
                        "SLURM_JOB_NODELIST",
                        "SLURM_NODELIST",
                    ]
                    .into_iter()
                    .find_map(get);
                    let addr = get("MASTER_ADDR")
                        .or_else(|| nodes.as_deref().and_then(first_host))
                        .unwrap_or_else(|| "127.0.0.1".into());
                    let id = |name: &str| {
                        get(name)
                            .and_then(|text| text.trim().parse::<u64>().ok())
                            .unwrap_or(0)
                    };
                    let derived = SLURM_PORT_BASE
                        + ((id("SLURM_JOB_ID") * 31 + id("SLURM_STEP_ID")) % SLURM_PORTS) as u16;
                    Some((addr, port.unwrap_or(derived)))
                }
                _ => None,
            };
            let store = match (launcher, get("TORCHELASTIC_USE_AGENT_STORE")) {
                (Launcher::Torchrun, Some(flag)) if flag.trim() == "True" => Some(format!(
                    "{}/{}",
                    get("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into()),
                    get("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into())
                )),
                _ => None,
            };
            return Ok(Some(Launch {
                launcher,
                rank: rank_value,
                world: world_value,
                local_rank: local_rank_value,
                local_world: local_world_value,
                master,
                store,
            }));
        }
        Ok(None)
    }

    /// [`Launch::from_env`] over this process's environment.
    pub fn of_this_process() -> Result<Option<Launch>> {
        Launch::from_env(&|name| std::env::var(name).ok())
    }

    /// The run's ranks under this launch: the launcher's world; a config's
    /// `train.ranks` must be 1 (the same config runs as threads or as
    /// processes) or that world.
    pub fn check_ranks(&self, ranks: usize) -> Result<()> {
        if ranks == 1 || ranks == self.world {
            return Ok(());
        }
        Err(TrainError::Config {
            key: "train.ranks",
            value: ranks.to_string(),
            fix: format!(
                "{} started {} processes, each one rank: set train.ranks = 1 or {} (or launch {ranks})",
                self.launcher.name(),
                self.world,
                self.world
            ),
        })
    }
}

/// The first port srun's ranks meet at, and how many follow it (one is
/// picked by the job and step id): below Linux's ephemeral ports, so that
/// no socket another rank opens meanwhile is given it.
const SLURM_PORT_BASE: u16 = 20000;
const SLURM_PORTS: u64 = 12_768;

/// Node `node`'s tasks in a Slurm tasks-per-node list (`2(x3),1`: three
/// nodes of two, then one of one).
fn tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut at = 0;
    for item in list.trim().split(',') {
        let (tasks, times) = match item.split_once("(x") {
            Some((tasks, times)) => (tasks, times.trim_end_matches(')').parse::<usize>().ok()?),
            None => (item, 1),
        };
        at += times;
        if node < at {
            return tasks.trim().parse().ok();
        }
    }
    None
}

/// The first host of a Slurm node list (`node[07-09,12],gpu3` is
/// `node07`).
fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list
        .char_indices()
        .scan(0i32, |depth, (i, c)| {
            match c {
                '[' => *depth += 1,
                ']' => *depth -= 1,
                _ => {}
            }
            Some((i, c, *depth))
        })
        .find(|&(_, c, depth)| c == ',' && depth == 0)
        .map_or(list.len(), |(i, _, _)| i);
    let first = &list[..end];
    let host = match first.split_once('[') {
        None => first.to_string(),
        Some((prefix, rest)) => {
            let item = rest.trim_end_matches(']').split([',', '-']).next()?;
            format!("{prefix}{item}")
        }
    };
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn launch(vars: &[(&str, &str)]) -> Result<Option<Launch>> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Launch::from_env(&|name| vars.get(name).cloned())
    }

    #[test]
    fn each_launchers_variables_give_the_rank_in_order_of_precedence() {
        assert_eq!(launch(&[]).unwrap(), None);
        let torchrun = launch(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29400"),
            // torchrun's come first, whatever else is set.
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            torchrun,
            Launch {
                launcher: Launcher::Torchrun,
                rank: 3,
                world: 8,
                local_rank: 1,
                local_world: 2,
                master: Some(("node0".into(), 29400)),
                store: None,
            }
        );
        // Under torchrun's agent, its store, keyed by run and restart.
        let agent = launch(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(agent.store.as_deref(), Some("job7/2"));
        let ompi = launch(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "16"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (ompi.launcher, ompi.rank, ompi.world, ompi.master),
            (Launcher::OpenMpi, 1, 4, None)
        );
        let pmi = launch(&[("PMI_RANK", "2"), ("PMI_SIZE", "3")])
            .unwrap()
            .unwrap();
        assert_eq!(
            (pmi.launcher, pmi.rank, pmi.local_rank, pmi.local_world),
            (Launcher::Pmi, 2, 2, 3)
        );
        let slurm = launch(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2(x3)"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                slurm.launcher,
                slurm.rank,
                slurm.local_rank,
                slurm.local_world
            ),
            (Launcher::Slurm, 5, 1, 2)
        );
        assert!(ompi.launcher.is_mpi() && !slurm.launcher.is_mpi() && !torchrun.launcher.is_mpi());
        // srun's ranks meet on the step's first node, at its job's port.
        let step = launch(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NODELIST", "gpu[07-09,12],cpu3"),
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap()
        .unwrap();
        let (host, port) = step.master.unwrap();
        assert_eq!(host, "gpu07");
        assert_eq!(port, SLURM_PORT_BASE + ((4242 * 31) % SLURM_PORTS) as u16);
        assert_eq!(first_host("n1"), Some("n1".into()));
        assert_eq!(tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(tasks_on_node("2(x3),1", 4), None);
        let listed = launch(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "3"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((listed.local_rank, listed.local_world), (0, 1));
        assert_eq!(first_host("a[3,5],b"), Some("a3".into()));
    }

    #[test]
    fn variables_that_disagree_or_do_not_parse_are_refused_by_name() {
        let err = launch(&[("RANK", "two"), ("WORLD_SIZE", "4")]).unwrap_err();
        assert!(
            err.to_string().contains("RANK") && err.to_string().contains("two"),
            "{err}"
        );
        let err = launch(&[("RANK", "4"), ("WORLD_SIZE", "4")]).unwrap_err();
        assert!(err.to_string().contains("WORLD_SIZE"), "{err}");
        let err = launch(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap_err();
        assert!(
            err.to_string().contains("OMPI_COMM_WORLD_LOCAL_RANK"),
            "{err}"
        );
        let err = launch(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "x")]).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
    }

    #[test]
    fn a_configs_ranks_are_one_or_the_launchers() {
        let l = launch(&[("PMI_RANK", "0"), ("PMI_SIZE", "4")])
            .unwrap()
            .unwrap();
        assert!(l.check_ranks(1).is_ok() && l.check_ranks(4).is_ok());
        let err = l.check_ranks(2).unwrap_err().to_string();
        assert!(
            err.contains("train.ranks") && err.contains('2') && err.contains('4'),
            "{err}"
        );
    }
}
