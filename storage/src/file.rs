//! Opening files for direct I/O and discovering their alignment.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::error::{Result, StorageError};

/// How a file's direct-I/O alignment was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlignSource {
    /// statx(STATX_DIOALIGN), Linux 6.1 and later.
    Statx,
    /// The block device's logical block size from /sys.
    BlockDevice,
    /// Nothing reported it: 4096, which every device accepts.
    Default,
}

/// An open file, with whether direct I/O is in effect and its alignment.
#[derive(Debug)]
pub struct IoFile {
    /// The open file.
    pub file: File,
    /// Its path, for error messages.
    pub path: PathBuf,
    /// Whether O_DIRECT is in effect (false: buffered fallback).
    pub direct: bool,
    /// Alignment of offsets, lengths and buffer addresses.
    pub align_bytes: u64,
    /// Where the alignment came from.
    pub align_source: AlignSource,
}

impl IoFile {
    /// Opens (creating if asked) `path` for reading and writing with O_DIRECT.
    /// A filesystem that refuses O_DIRECT gets buffered I/O and a warning.
    pub fn open(path: &Path, create: bool) -> Result<Self> {
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(create).mode(0o600);
        let (file, direct) = match options.clone().custom_flags(libc::O_DIRECT).open(path) {
            Ok(file) => (file, true),
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(
                    "{} refuses O_DIRECT (tmpfs or a network filesystem?): using buffered I/O, \
                     so speeds include the page cache and RAM holds copies of the data",
                    path.display()
                );
                (options.open(path).map_err(|e| open_error(path, e))?, false)
            }
            Err(err) => return Err(open_error(path, err)),
        };
        let (align_bytes, align_source) = discover_alignment(&file, direct);
        Ok(Self {
            file,
            path: path.to_path_buf(),
            direct,
            align_bytes,
            align_source,
        })
    }

    /// The raw descriptor, for engines.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

fn open_error(path: &Path, err: io::Error) -> StorageError {
    match err.kind() {
        io::ErrorKind::NotFound => StorageError::DirMissing {
            path: path.parent().unwrap_or(path).to_path_buf(),
        },
        _ => StorageError::NotWritable {
            path: path.to_path_buf(),
            cause: err,
        },
    }
}

fn discover_alignment(file: &File, direct: bool) -> (u64, AlignSource) {
    if !direct {
        return (crate::buffer::PAGE_BYTES as u64, AlignSource::Default);
    }
    if let Ok(Some(dio)) = crate::sys::statx_dio_align(file)
        && dio.offset_bytes > 0
    {
        let align = dio.offset_bytes.max(dio.memory_bytes);
        return (u64::from(align), AlignSource::Statx);
    }
    if let Some(size) = crate::sys::logical_block_size(file) {
        return (u64::from(size), AlignSource::BlockDevice);
    }
    (crate::buffer::PAGE_BYTES as u64, AlignSource::Default)
}

/// Checks that `dir` exists, is a directory and accepts new files.
pub fn check_dir_writable(dir: &Path) -> Result<()> {
    let meta = std::fs::metadata(dir).map_err(|err| match err.kind() {
        io::ErrorKind::NotFound => StorageError::DirMissing {
            path: dir.to_path_buf(),
        },
        _ => StorageError::NotWritable {
            path: dir.to_path_buf(),
            cause: err,
        },
    })?;
    if !meta.is_dir() {
        return Err(StorageError::NotWritable {
            path: dir.to_path_buf(),
            cause: io::Error::other("not a directory"),
        });
    }
    let probe = dir.join(format!(".strata-write-probe-{}", std::process::id()));
    match File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(err) => Err(StorageError::NotWritable {
            path: dir.to_path_buf(),
            cause: err,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_direct_with_an_alignment() {
        let dir = tempfile::tempdir_in(".").unwrap();
        let file = IoFile::open(&dir.path().join("f"), true).unwrap();
        assert!(file.align_bytes >= 512 && file.align_bytes.is_power_of_two());
    }

    #[test]
    fn missing_dir_is_named() {
        let err = check_dir_writable(Path::new("/no/such/strata/dir")).unwrap_err();
        assert!(matches!(err, StorageError::DirMissing { .. }), "{err}");
        assert!(err.to_string().contains("/no/such/strata/dir"));
    }
}
