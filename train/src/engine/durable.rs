//! The file operations a checkpoint is published with, behind a trait so
//! that a simulated filesystem with a crash model can stand in for the
//! real one in tests: [`RealFs`] is std::fs; the tests' `SimFs` keeps a
//! file's bytes only once it is fsynced and a directory's entries (created,
//! renamed, removed) only once that directory is fsynced, and a crash
//! returns exactly that. It shows that publishing stays whole when the
//! machine dies (dropping the page cache), not only when the process does.

use std::io;
use std::path::Path;

/// What checkpoint publishing does to files.
pub(crate) trait Fs {
    /// Creates `dir` and its missing parents.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Creates `dir`, whose parent exists.
    fn create_dir(&self, dir: &Path) -> io::Result<()>;
    /// The names in `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Creates (or truncates) `path`, writes `bytes` and fsyncs the file.
    fn write_synced(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;
    /// The bytes of `path`.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// The bytes of `path`, handed to `each` a piece at a time (a file
    /// larger than memory is never held whole); its length.
    fn read_pieces(&self, path: &Path, each: &mut dyn FnMut(&[u8])) -> io::Result<u64>;
    /// Renames `from` to `to`, replacing a file there.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Swaps the entries `a` and `b` (both exist) in one step.
    fn exchange(&self, a: &Path, b: &Path) -> io::Result<()>;
    /// Removes `dir` and everything in it.
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// fsyncs the directory `dir`, so that its entries last.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Whether `path` exists.
    fn exists(&self, path: &Path) -> bool;
}

/// Bytes a file is read in by [`read_pieces`].
const PIECE_BYTES: usize = 8 << 20;

/// The bytes of the file at `path`, handed to `each` [`PIECE_BYTES`] at a
/// time; its length.
pub(crate) fn read_pieces(path: &Path, each: &mut dyn FnMut(&[u8])) -> io::Result<u64> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut buffer = vec![0u8; PIECE_BYTES];
    let mut total = 0u64;
    loop {
        let read = match file.read(&mut buffer) {
            Ok(0) => return Ok(total),
            Ok(read) => read,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        each(&buffer[..read]);
        total += read as u64;
    }
}

/// Creates `dir` and its missing parents, and fsyncs the parent of each
/// one it made: a directory lasts only once its parent is fsynced, so a
/// power cut could otherwise take a run's first checkpoints with it.
pub(crate) fn create_dir_all_durably(fs: &dyn Fs, dir: &Path) -> io::Result<()> {
    let missing: Vec<&Path> = dir.ancestors().take_while(|a| !fs.exists(a)).collect();
    fs.create_dir_all(dir)?;
    for made in missing {
        if let Some(parent) = made.parent() {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            fs.sync_dir(parent)?;
        }
    }
    Ok(())
}

/// The real filesystem.
pub(crate) struct RealFs;

impl Fs for RealFs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        crate::crash::point("create_dir_all");
        std::fs::create_dir_all(dir)
    }

    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        crate::crash::point("create_dir");
        std::fs::create_dir(dir)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        Ok(std::fs::read_dir(dir)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect())
    }

    fn write_synced(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        use std::io::Write;
        crate::crash::point("create");
        let mut file = std::fs::File::create(path)?;
        crate::crash::point("write");
        file.write_all(bytes)?;
        crate::crash::point("sync");
        file.sync_all()
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        std::fs::read(path)
    }

    fn read_pieces(&self, path: &Path, each: &mut dyn FnMut(&[u8])) -> io::Result<u64> {
        read_pieces(path, each)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        crate::crash::point("rename");
        std::fs::rename(from, to)
    }

    fn exchange(&self, a: &Path, b: &Path) -> io::Result<()> {
        crate::crash::point("exchange");
        strata_storage::sys::rename_exchange(a, b)
    }

    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        crate::crash::point("remove_dir_all");
        std::fs::remove_dir_all(dir)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        crate::crash::point("sync_dir");
        std::fs::File::open(dir)?.sync_all()
    }

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }
}

/// A path's parent and last name (every path the simulation sees has both).
#[cfg(test)]
fn split(path: &Path) -> (std::path::PathBuf, String) {
    let parent = path.parent().expect("a path with a parent").to_path_buf();
    let name = path.file_name().expect("a path with a name");
    (parent, name.to_string_lossy().into_owned())
}

#[cfg(test)]
pub(crate) use sim::SimFs;

#[cfg(test)]
mod sim {
    use std::cell::RefCell;
    use std::collections::BTreeMap;

    use super::*;

    #[derive(Clone, Debug)]
    enum Node {
        /// Live bytes, and the bytes the last fsync made durable.
        File {
            data: Vec<u8>,
            synced: Option<Vec<u8>>,
        },
        /// Live entries, and the entries the last fsync of the directory
        /// made durable (name -> node).
        Dir {
            entries: BTreeMap<String, usize>,
            synced: BTreeMap<String, usize>,
        },
    }

    #[derive(Clone, Debug)]
    struct State {
        nodes: Vec<Node>,
        /// Mutating operations done so far.
        ops: usize,
    }

    /// An in-memory filesystem rooted at `/` with ext4's durability as
    /// POSIX promises it, a crash, and a fault at a chosen operation.
    #[derive(Clone, Debug)]
    pub(crate) struct SimFs {
        state: RefCell<State>,
        /// The mutating operation (from 0) that fails with ENOSPC.
        pub(crate) fail_at: Option<usize>,
        /// A broken writer for the negative control: file fsyncs do nothing.
        pub(crate) skip_file_sync: bool,
        /// A file system that cannot swap two entries (EINVAL, as NFS).
        pub(crate) no_exchange: bool,
    }

    fn enoent(path: &Path) -> io::Error {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("{} not found", path.display()),
        )
    }

    impl SimFs {
        /// An empty filesystem whose root is durable.
        pub(crate) fn new() -> SimFs {
            SimFs {
                state: RefCell::new(State {
                    nodes: vec![Node::Dir {
                        entries: BTreeMap::new(),
                        synced: BTreeMap::new(),
                    }],
                    ops: 0,
                }),
                fail_at: None,
                skip_file_sync: false,
                no_exchange: false,
            }
        }

        /// Mutating operations done so far.
        pub(crate) fn ops(&self) -> usize {
            self.state.borrow().ops
        }

        /// What survives a power cut now: each directory's fsynced entries,
        /// each file's fsynced bytes (empty if never fsynced).
        pub(crate) fn crash(&self) -> SimFs {
            let mut state = self.state.borrow().clone();
            for node in &mut state.nodes {
                match node {
                    Node::File { data, synced } => *data = synced.clone().unwrap_or_default(),
                    Node::Dir { entries, synced } => *entries = synced.clone(),
                }
            }
            SimFs {
                state: RefCell::new(state),
                fail_at: None,
                skip_file_sync: false,
                no_exchange: self.no_exchange,
            }
        }

        fn lookup(&self, path: &Path) -> Option<usize> {
            let state = self.state.borrow();
            let mut at = 0;
            for part in path.components().skip(1) {
                let Node::Dir { entries, .. } = &state.nodes[at] else {
                    return None;
                };
                at = *entries.get(&*part.as_os_str().to_string_lossy())?;
            }
            Some(at)
        }

        fn dir_of(&self, path: &Path) -> io::Result<usize> {
            match self.lookup(path) {
                Some(at) if matches!(self.state.borrow().nodes[at], Node::Dir { .. }) => Ok(at),
                _ => Err(enoent(path)),
            }
        }

        /// Counts a mutating operation, failing the chosen one.
        fn step(&self) -> io::Result<()> {
            let mut state = self.state.borrow_mut();
            state.ops += 1;
            if Some(state.ops - 1) == self.fail_at {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            Ok(())
        }

        fn entries(&self, dir: usize) -> std::cell::RefMut<'_, BTreeMap<String, usize>> {
            std::cell::RefMut::map(self.state.borrow_mut(), |s| match &mut s.nodes[dir] {
                Node::Dir { entries, .. } => entries,
                Node::File { .. } => unreachable!("dir_of checked"),
            })
        }

        fn add(&self, path: &Path, node: Node) -> io::Result<()> {
            let (parent, name) = split(path);
            let dir = self.dir_of(&parent)?;
            let id = {
                let mut state = self.state.borrow_mut();
                state.nodes.push(node);
                state.nodes.len() - 1
            };
            self.entries(dir).insert(name, id);
            Ok(())
        }
    }

    impl Fs for SimFs {
        fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
            if self.lookup(dir).is_some() {
                return Ok(());
            }
            if let Some(parent) = dir.parent() {
                self.create_dir_all(parent)?;
            }
            self.create_dir(dir)
        }

        fn create_dir(&self, dir: &Path) -> io::Result<()> {
            self.step()?;
            if self.lookup(dir).is_some() {
                return Err(io::Error::from_raw_os_error(libc::EEXIST));
            }
            self.add(
                dir,
                Node::Dir {
                    entries: BTreeMap::new(),
                    synced: BTreeMap::new(),
                },
            )
        }

        fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
            let dir = self.dir_of(dir)?;
            Ok(self.entries(dir).keys().cloned().collect())
        }

        fn write_synced(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
            self.step()?;
            let synced = (!self.skip_file_sync).then(|| bytes.to_vec());
            self.add(
                path,
                Node::File {
                    data: bytes.to_vec(),
                    synced,
                },
            )
        }

        fn read_pieces(&self, path: &Path, each: &mut dyn FnMut(&[u8])) -> io::Result<u64> {
            let bytes = self.read(path)?;
            each(&bytes);
            Ok(bytes.len() as u64)
        }

        fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
            let at = self.lookup(path).ok_or_else(|| enoent(path))?;
            match &self.state.borrow().nodes[at] {
                Node::File { data, .. } => Ok(data.clone()),
                Node::Dir { .. } => Err(io::Error::from_raw_os_error(libc::EISDIR)),
            }
        }

        fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
            self.step()?;
            let (from_parent, from_name) = split(from);
            let (to_parent, to_name) = split(to);
            let (source, target) = (self.dir_of(&from_parent)?, self.dir_of(&to_parent)?);
            let id = self
                .entries(source)
                .remove(&from_name)
                .ok_or_else(|| enoent(from))?;
            self.entries(target).insert(to_name, id);
            Ok(())
        }

        fn exchange(&self, a: &Path, b: &Path) -> io::Result<()> {
            self.step()?;
            if self.no_exchange {
                return Err(io::Error::from_raw_os_error(libc::EINVAL));
            }
            let ((a_parent, a_name), (b_parent, b_name)) = (split(a), split(b));
            let (a_dir, b_dir) = (self.dir_of(&a_parent)?, self.dir_of(&b_parent)?);
            let a_id = *self.entries(a_dir).get(&a_name).ok_or_else(|| enoent(a))?;
            let b_id = *self.entries(b_dir).get(&b_name).ok_or_else(|| enoent(b))?;
            self.entries(a_dir).insert(a_name, b_id);
            self.entries(b_dir).insert(b_name, a_id);
            Ok(())
        }

        fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
            self.step()?;
            let (parent, name) = split(dir);
            let parent = self.dir_of(&parent)?;
            self.entries(parent)
                .remove(&name)
                .map(drop)
                .ok_or_else(|| enoent(dir))
        }

        fn sync_dir(&self, dir: &Path) -> io::Result<()> {
            self.step()?;
            let at = self.dir_of(dir)?;
            if let Node::Dir { entries, synced } = &mut self.state.borrow_mut().nodes[at] {
                *synced = entries.clone();
            }
            Ok(())
        }

        fn exists(&self, path: &Path) -> bool {
            self.lookup(path).is_some()
        }
    }
}
