//! Which CPUs the optimizer pool may use and how they group into physical
//! cores, so the pool gets one thread per core (memory-bound kernels gain
//! nothing from SMT siblings) and each thread stays on its core. From hwloc
//! with the `hwloc` feature, else from /sys/devices/system/cpu; both start
//! from the process's affinity mask, so taskset and cgroup cpusets are
//! respected.

use std::collections::BTreeMap;
use std::io;

/// CPUs this process may run on, grouped by physical core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuTopology {
    /// The CPUs (OS indices) of each physical core, cores in order.
    pub cores: Vec<Vec<usize>>,
    /// Where this came from: "hwloc", "sysfs" or "affinity" (no core
    /// information; every CPU counted as a core).
    pub source: &'static str,
}

impl CpuTopology {
    /// Reads the topology of the CPUs this process may use.
    pub fn detect() -> CpuTopology {
        let allowed = allowed_cpus();
        #[cfg(feature = "hwloc")]
        if let Some(topology) = from_hwloc(&allowed) {
            return topology;
        }
        from_sysfs(&allowed).unwrap_or_else(|| CpuTopology {
            cores: allowed.iter().map(|&cpu| vec![cpu]).collect(),
            source: "affinity",
        })
    }

    /// Physical cores available.
    pub fn core_count(&self) -> usize {
        self.cores.len()
    }

    /// The CPUs of local rank `index`'s share when `of` ranks divide this
    /// machine's cores: a run of `cores / of` whole cores (SMT siblings
    /// included), in the topology's order (hwloc's keeps a run within a
    /// package and NUMA node where the count allows); `None` when there
    /// are fewer cores than ranks.
    pub fn share(&self, index: usize, of: usize) -> Option<Vec<usize>> {
        assert!(index < of, "local rank {index} of {of}");
        let per = self.cores.len() / of;
        (per > 0).then(|| self.cores[index * per..(index + 1) * per].concat())
    }

    /// The CPU for the `index`th pool thread: the first CPU of each core in
    /// turn, then the cores' SMT siblings, then around again.
    pub fn cpu_for_thread(&self, index: usize) -> usize {
        let order: Vec<usize> = (0..self.cores.iter().map(Vec::len).max().unwrap_or(1))
            .flat_map(|sibling| {
                self.cores
                    .iter()
                    .filter_map(move |core| core.get(sibling).copied())
            })
            .collect();
        order[index % order.len()]
    }
}

/// The CPUs in this process's affinity mask (all online CPUs if it cannot
/// be read).
pub fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: cpu_set_t is plain bits; all-zero is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: `set` is a live cpu_set_t and `size` is its size.
        let rc = unsafe { libc::sched_getaffinity(0, size, &mut set) };
        if rc == 0 {
            let is_set = |cpu: usize| {
                // SAFETY: reads the initialized set; `cpu` < CPU_SETSIZE, its size in bits.
                unsafe { libc::CPU_ISSET(cpu, &set) }
            };
            let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                .filter(|&cpu| is_set(cpu))
                .collect();
            if !cpus.is_empty() {
                return cpus;
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, usize::from)).collect()
}

/// The machine's online CPUs, from /sys/devices/system/cpu/online
/// (`0-15,32-47`); `None` where it cannot be read.
pub fn online_cpu_count() -> Option<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?;
    parse_cpu_list(text.trim())
}

/// The number of CPUs in a kernel CPU list (`0-3,8,10-11` is 7).
fn parse_cpu_list(text: &str) -> Option<usize> {
    text.split(',').try_fold(0usize, |count, part| {
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let cpu = part.parse::<usize>().ok()?;
                (cpu, cpu)
            }
        };
        (last >= first).then(|| count + last - first + 1)
    })
}

/// Whether a launcher bound this process to part of the machine (its
/// affinity mask is smaller than the online CPUs): then the CPUs it may
/// use are its own share, not shared with the machine's other ranks.
pub fn bound_to_a_share() -> bool {
    online_cpu_count().is_some_and(|online| allowed_cpus().len() < online)
}

/// Pins the calling thread to one CPU.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("CPU {cpu} is beyond CPU_SETSIZE"),
            ));
        }
        // SAFETY: all-zero is a valid empty cpu_set_t.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `cpu` < CPU_SETSIZE (checked above), so the bit is inside the set.
        unsafe { libc::CPU_SET(cpu, &mut set) };
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: `set` is a live cpu_set_t of `size` bytes; pid 0 is this thread.
        let rc = unsafe { libc::sched_setaffinity(0, size, &set) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpu;
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "thread pinning is implemented for Linux only",
        ))
    }
}

/// Binds every thread of this process, and every thread it starts later,
/// to `cpus` (its share of the machine, as a launcher's core binding does).
pub fn bind_process(cpus: &[usize]) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: all-zero is a valid empty cpu_set_t.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &cpu in cpus {
            if cpu >= libc::CPU_SETSIZE as usize {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("CPU {cpu} is beyond CPU_SETSIZE"),
                ));
            }
            // SAFETY: `cpu` < CPU_SETSIZE (checked above), so the bit is inside the set.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // Each thread's own mask: the threads already running (a pool a
        // tokenizer started), then this one, which those it starts inherit.
        for task in std::fs::read_dir("/proc/self/task")?.flatten() {
            let Ok(tid) = task.file_name().to_string_lossy().parse::<libc::pid_t>() else {
                continue;
            };
            // SAFETY: `set` is a live cpu_set_t of `size` bytes; `tid` is a
            // thread of this process (one that ended since is ESRCH).
            let rc = unsafe { libc::sched_setaffinity(tid, size, &set) };
            let error = io::Error::last_os_error();
            if rc != 0 && error.raw_os_error() != Some(libc::ESRCH) {
                return Err(error);
            }
        }
        // SAFETY: as above; 0 is the calling thread.
        if unsafe { libc::sched_setaffinity(0, size, &set) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpus;
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "binding to cores is implemented for Linux only",
        ))
    }
}

/// Groups the allowed CPUs by (package, core) from
/// /sys/devices/system/cpu/cpuN/topology.
fn from_sysfs(allowed: &[usize]) -> Option<CpuTopology> {
    let read = |cpu: usize, file: &str| -> Option<i64> {
        let path = format!("/sys/devices/system/cpu/cpu{cpu}/topology/{file}");
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    };
    let mut cores: BTreeMap<(i64, i64), Vec<usize>> = BTreeMap::new();
    for &cpu in allowed {
        let key = (read(cpu, "physical_package_id")?, read(cpu, "core_id")?);
        cores.entry(key).or_default().push(cpu);
    }
    (!cores.is_empty()).then(|| CpuTopology {
        cores: cores.into_values().collect(),
        source: "sysfs",
    })
}

#[cfg(feature = "hwloc")]
fn from_hwloc(allowed: &[usize]) -> Option<CpuTopology> {
    use hwlocality::Topology;
    use hwlocality::object::types::ObjectType;

    let topology = Topology::new().ok()?;
    let mut cores = Vec::new();
    for core in topology.objects_with_type(ObjectType::Core) {
        let cpuset = core.cpuset()?;
        let cpus: Vec<usize> = cpuset
            .iter_set()
            .map(usize::from)
            .filter(|cpu| allowed.contains(cpu))
            .collect();
        if !cpus.is_empty() {
            cores.push(cpus);
        }
    }
    (!cores.is_empty()).then_some(CpuTopology {
        cores,
        source: "hwloc",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_count_their_ranges() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(7));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn threads_fill_cores_before_siblings() {
        let topology = CpuTopology {
            cores: vec![vec![0, 4], vec![1, 5], vec![2]],
            source: "test",
        };
        let cpus: Vec<usize> = (0..7).map(|i| topology.cpu_for_thread(i)).collect();
        assert_eq!(cpus, [0, 1, 2, 4, 5, 0, 1]);
    }

    #[test]
    fn each_local_rank_gets_its_own_run_of_whole_cores() {
        let topology = CpuTopology {
            cores: vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7], vec![8]],
            source: "test",
        };
        assert_eq!(topology.share(0, 2), Some(vec![0, 4, 1, 5]));
        assert_eq!(topology.share(1, 2), Some(vec![2, 6, 3, 7]));
        assert_eq!(topology.share(4, 5), Some(vec![8]));
        assert_eq!(topology.share(0, 6), None);
        // Disjoint for every count that fits.
        for of in 1..=5 {
            let mut all: Vec<usize> = (0..of)
                .flat_map(|i| topology.share(i, of).unwrap())
                .collect();
            let n = all.len();
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), n, "{of} ranks");
        }
    }

    #[test]
    fn detection_covers_the_allowed_cpus() {
        let topology = CpuTopology::detect();
        let mut seen: Vec<usize> = topology.cores.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, allowed_cpus(), "{topology:?}");
        assert!(topology.core_count() >= 1);
        if cfg!(feature = "hwloc") {
            assert_eq!(topology.source, "hwloc", "hwloc was built in but not used");
        }
    }
}
