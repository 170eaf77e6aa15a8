//! Thin, checked wrappers over the few Linux calls strata-storage needs.
//! All FFI outside the aligned buffer and the io_uring engine lives here.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Direct-I/O alignment as reported by the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioAlign {
    /// Required alignment of buffer addresses.
    pub memory_bytes: u32,
    /// Required alignment of file offsets and lengths.
    pub offset_bytes: u32,
}

/// Asks statx(STATX_DIOALIGN) for the direct-I/O alignment of an open file.
/// `Ok(None)` when the kernel or filesystem does not report it; `Ok(Some)` with
/// zeros when the file does not support direct I/O at all.
pub fn statx_dio_align(file: &File) -> io::Result<Option<DioAlign>> {
    // SAFETY: statx is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    // The fd is open for the lifetime of `file`; the path is NUL-terminated.
    // SAFETY: those, and `stx` is a valid, writable statx buffer.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::ENOSYS) | Some(libc::EINVAL) => Ok(None),
            _ => Err(err),
        };
    }
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Ok(None);
    }
    Ok(Some(DioAlign {
        memory_bytes: stx.stx_dio_mem_align,
        offset_bytes: stx.stx_dio_offset_align,
    }))
}

/// The logical block size of the block device holding `file`, from /sys.
pub fn logical_block_size(file: &File) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let dev = file.metadata().ok()?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let base = format!("/sys/dev/block/{major}:{minor}");
    // A partition has no queue/ of its own; its parent disk does.
    for candidate in [
        format!("{base}/queue/logical_block_size"),
        format!("{base}/../queue/logical_block_size"),
    ] {
        if let Ok(text) = std::fs::read_to_string(&candidate)
            && let Ok(size) = text.trim().parse::<u32>()
            && size > 0
        {
            return Some(size);
        }
    }
    None
}

/// Bytes an unprivileged user may still allocate on the filesystem of `path`.
pub fn available_bytes(path: &Path) -> io::Result<u64> {
    let stat = statvfs(path)?;
    Ok(stat.f_bavail as u64 * stat.f_frsize as u64)
}

fn statvfs(path: &Path) -> io::Result<libc::statvfs> {
    let c_path = c_path(path)?;
    // SAFETY: statvfs is plain old data; all-zero is a valid value.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is NUL-terminated and `stat` is a valid out-pointer.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stat)
}

/// Filesystems that live in RAM, where "drive speed" would be memory speed.
pub fn is_memory_filesystem(path: &Path) -> io::Result<bool> {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    let c_path = c_path(path)?;
    // SAFETY: statfs is plain old data; all-zero is a valid value.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is NUL-terminated and `stat` is a valid out-pointer.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), &mut stat) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let magic = stat.f_type as i64;
    Ok(magic == TMPFS_MAGIC || magic == RAMFS_MAGIC)
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// Reserves `len` bytes of disk for `file` (no sparse holes, ENOSPC now rather than mid-run).
pub fn fallocate(file: &File, len: u64) -> io::Result<()> {
    // SAFETY: plain syscall on an fd owned by `file`.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `len` bytes at `offset` of `file` read as zeros without writing
/// them: `FALLOC_FL_ZERO_RANGE` (the blocks stay allocated, marked
/// unwritten), else `FALLOC_FL_PUNCH_HOLE` (tmpfs) followed by a plain
/// `fallocate` of the range, so that the blocks the hole gave back are
/// reserved again (a preallocated swap file keeps its ENOSPC up front).
/// `Ok(false)` when the file system supports neither: the caller writes
/// the zeros.
pub fn zero_range(file: &File, offset: u64, len: u64) -> io::Result<bool> {
    let keep = libc::FALLOC_FL_KEEP_SIZE;
    let call = |mode: libc::c_int| {
        // SAFETY: plain syscall on an fd owned by `file`.
        let rc = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                mode,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        match rc {
            0 => Ok(true),
            _ => match io::Error::last_os_error() {
                err if err.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(false),
                err => Err(err),
            },
        }
    };
    if call(libc::FALLOC_FL_ZERO_RANGE | keep)? {
        return Ok(true);
    }
    if call(libc::FALLOC_FL_PUNCH_HOLE | keep)? {
        return match call(keep)? {
            true => Ok(true),
            false => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the file system punched a hole but cannot reserve its blocks again",
            )),
        };
    }
    Ok(false)
}

/// Takes an exclusive advisory lock without blocking; `Ok(false)` if another
/// open file description holds it.
pub fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    // SAFETY: plain syscall on an fd owned by `file`.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(err)
    }
}

/// RLIMIT_MEMLOCK soft limit in bytes (`None` = unlimited).
pub fn memlock_limit_bytes() -> Option<u64> {
    // SAFETY: rlimit is plain old data; all-zero is a valid value.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: valid resource id and out-pointer.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    if rc != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(limit.rlim_cur)
}

/// Swaps the directory entries `a` and `b` (both must exist) in one step,
/// `renameat2(RENAME_EXCHANGE)`: at no moment does either name stand for
/// nothing. EINVAL where the file system cannot (NFS, some FUSE ones).
pub fn rename_exchange(a: &Path, b: &Path) -> io::Result<()> {
    let (a, b) = (c_path(a)?, c_path(b)?);
    // SAFETY: both paths are NUL-terminated and outlive the call; the
    // syscall reads them and nothing else.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bytes of memory this process may still take: MemAvailable from
/// /proc/meminfo, or less where its cgroup's memory limit (a container's;
/// v2 or v1) or its address-space limit (`ulimit -v`) leaves less. `None`
/// where none of them can be read. Past any of them an allocation fails
/// (or the cgroup's OOM killer strikes) however much the machine has.
pub fn mem_available_bytes() -> Option<u64> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let meminfo = read("/proc/meminfo");
    let available = meminfo
        .as_deref()
        .and_then(|m| kib_field(m, "MemAvailable:"));
    let cgroup = read("/proc/self/cgroup").and_then(|c| cgroup_room(&c, &read));
    let address_space = address_space_room(read("/proc/self/status").as_deref());
    [available, cgroup, address_space]
        .into_iter()
        .flatten()
        .min()
}

/// A `Name:   N kB` line's bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// What the memory cgroups of /proc/self/cgroup's `cgroup` text leave,
/// read through `read`: at each level from the process's cgroup up to the
/// mount's root (inside a container without its own cgroup namespace the
/// path named does not exist there, and the root is the container's), the
/// limit less the usage, the reclaimable page cache (`inactive_file`) not
/// counted as used; the least of them. v2's `memory.max`, `memory.current`
/// and `memory.stat`, else v1's `memory.limit_in_bytes`,
/// `memory.usage_in_bytes` and `memory.stat`'s `total_inactive_file`.
/// `None` without a limit anywhere.
fn cgroup_room(cgroup: &str, read: &dyn Fn(&str) -> Option<String>) -> Option<u64> {
    let number = |path: String| read(&path)?.trim().parse::<u64>().ok();
    let stat = |path: String, key: &str| {
        let text = read(&path)?;
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(key))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok()
    };
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (root, files) = if id == "0" && controllers.is_empty() {
            (
                "/sys/fs/cgroup",
                ["memory.max", "memory.current", "inactive_file"],
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                "/sys/fs/cgroup/memory",
                [
                    "memory.limit_in_bytes",
                    "memory.usage_in_bytes",
                    "total_inactive_file",
                ],
            )
        } else {
            continue;
        };
        let mut least: Option<u64> = None;
        let mut level = path.trim_end_matches('/');
        loop {
            let base = format!("{root}{level}");
            // v2 writes "max" (no number) and v1 a page-rounded i64::MAX
            // when there is no limit.
            if let Some(limit) = number(format!("{base}/{}", files[0])).filter(|&l| l < 1 << 62) {
                let usage = number(format!("{base}/{}", files[1])).unwrap_or(0);
                let cache = stat(format!("{base}/memory.stat"), files[2]).unwrap_or(0);
                let room = limit.saturating_sub(usage.saturating_sub(cache));
                least = Some(least.map_or(room, |l| l.min(room)));
            }
            match level.rfind('/') {
                Some(cut) => level = &level[..cut],
                None => break,
            }
        }
        if least.is_some() {
            return least;
        }
    }
    None
}

/// What `ulimit -v` (RLIMIT_AS) leaves beside the process's mapped size
/// (`VmSize` in /proc/self/status); `None` without a limit.
fn address_space_room(status: Option<&str>) -> Option<u64> {
    // SAFETY: rlimit is plain old data; all-zero is a valid value.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: valid resource id and out-pointer.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) };
    if rc != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    let mapped = status.and_then(|s| kib_field(s, "VmSize:")).unwrap_or(0);
    Some(limit.rlim_cur.saturating_sub(mapped))
}

/// One pread or pwrite: bytes moved, or the negated errno (the io_uring CQE convention).
///
/// # Safety
/// `ptr..ptr+len` must be valid for reads (for a write) or writes (for a read)
/// and not accessed by anything else until this returns.
pub unsafe fn pread_or_pwrite(
    fd: i32,
    is_read: bool,
    ptr: *mut u8,
    len: usize,
    offset: u64,
) -> i32 {
    // SAFETY: forwarded from this function's contract.
    let rc = unsafe {
        if is_read {
            libc::pread(fd, ptr.cast(), len, offset as libc::off_t)
        } else {
            libc::pwrite(fd, ptr.cast(), len, offset as libc::off_t)
        }
    };
    if rc < 0 {
        -io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    } else {
        rc as i32
    }
}

/// Whether the page holding `address` is in memory, from
/// `/proc/self/pagemap` (bit 63 of its entry, readable without privileges);
/// `None` where the file cannot be read. For tests and diagnostics of where
/// memory was committed.
pub fn page_present(address: *const u8) -> Option<bool> {
    use std::io::{Read, Seek, SeekFrom};
    // SAFETY: sysconf reads a constant of the system; no memory is touched.
    let page_bytes = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
    let mut pagemap = File::open("/proc/self/pagemap").ok()?;
    let page = address as u64 / page_bytes.max(1);
    pagemap.seek(SeekFrom::Start(page * 8)).ok()?;
    let mut entry = [0u8; 8];
    pagemap.read_exact(&mut entry).ok()?;
    Some(u64::from_le_bytes(entry) >> 63 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A container's memory limit (cgroup v2 or v1) caps what is available;
    /// "max", an unlimited v1 value or a cgroup without the memory
    /// controller do not.
    #[test]
    fn a_cgroup_memory_limit_caps_what_is_available() {
        let files = |pairs: &'static [(&'static str, &'static str)]| {
            move |path: &str| {
                pairs
                    .iter()
                    .find(|(p, _)| *p == path)
                    .map(|(_, v)| v.to_string())
            }
        };
        let v2 = files(&[
            ("/sys/fs/cgroup/job/memory.max", "8589934592\n"),
            ("/sys/fs/cgroup/job/memory.current", "3221225472\n"),
            (
                "/sys/fs/cgroup/job/memory.stat",
                "anon 1073741824\ninactive_file 2147483648\n",
            ),
        ]);
        // 8 GiB less 3 GiB used, of which 2 GiB is reclaimable cache.
        assert_eq!(cgroup_room("0::/job\n", &v2), Some(7 << 30));
        // A parent's tighter limit counts; inside a container whose path
        // is not under its own mount, the mount's root is the container's.
        let nested = files(&[
            ("/sys/fs/cgroup/job/memory.max", "4294967296"),
            ("/sys/fs/cgroup/job/memory.current", "0"),
            ("/sys/fs/cgroup/job/step/memory.max", "max"),
        ]);
        assert_eq!(cgroup_room("0::/job/step\n", &nested), Some(4 << 30));
        let container = files(&[
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "2147483648"),
            ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "1073741824"),
        ]);
        assert_eq!(
            cgroup_room("4:memory:/docker/abc\n", &container),
            Some(1 << 30)
        );
        let unlimited = files(&[("/sys/fs/cgroup/job/memory.max", "max\n")]);
        assert_eq!(cgroup_room("0::/job\n", &unlimited), None);
        let v1 = files(&[
            (
                "/sys/fs/cgroup/memory/pod/memory.limit_in_bytes",
                "4294967296",
            ),
            (
                "/sys/fs/cgroup/memory/pod/memory.usage_in_bytes",
                "5368709120",
            ),
        ]);
        let text = "5:cpu,cpuacct:/pod\n4:memory:/pod\n0::/\n";
        assert_eq!(cgroup_room(text, &v1), Some(0), "usage above the limit");
        let v1_unlimited = files(&[(
            "/sys/fs/cgroup/memory/pod/memory.limit_in_bytes",
            "9223372036854771712",
        )]);
        assert_eq!(cgroup_room(text, &v1_unlimited), None);
        assert_eq!(cgroup_room("", &v2), None);
        assert!(mem_available_bytes().is_some_and(|b| b > 0));
    }

    #[test]
    fn rename_exchange_swaps_two_directories_or_names_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        for (path, text) in [(&a, "old"), (&b, "new")] {
            std::fs::create_dir(path).unwrap();
            std::fs::write(path.join("f"), text).unwrap();
        }
        rename_exchange(&a, &b).unwrap();
        assert_eq!(std::fs::read_to_string(a.join("f")).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(b.join("f")).unwrap(), "old");
        let missing = dir.path().join("c");
        let err = rename_exchange(&a, &missing).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
    }
}
