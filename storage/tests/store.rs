//! The swap store: round trips, striping, async use, errors with numbers.

use strata_storage::{
    AlignedBuf, ByteSize, EngineChoice, OWNED_DIR, StorageConfig, StorageError, SwapStore,
};

fn config(dirs: &[&std::path::Path], capacity: u64) -> StorageConfig {
    StorageConfig {
        dirs: dirs.iter().map(|d| d.to_path_buf()).collect(),
        capacity: ByteSize(capacity),
        block_size: ByteSize(64 << 10),
        stripe_size: ByteSize(128 << 10),
        queue_depth: 8,
        ..Default::default()
    }
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn filled(len: usize, seed: u64) -> AlignedBuf {
    let mut buf = AlignedBuf::new(len, 4096).unwrap();
    let mut state = seed;
    for chunk in buf.chunks_mut(8) {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
    buf
}

#[test]
fn round_trip_striped_over_two_dirs_on_each_engine() {
    let engines = match strata_storage::probe_uring() {
        Ok(()) => vec![EngineChoice::Uring, EngineChoice::Threads],
        Err(reason) => {
            println!("skipped: uring store ({reason})");
            vec![EngineChoice::Threads]
        }
    };
    for engine in engines {
        let (a, b) = (tempdir(), tempdir());
        let store = SwapStore::open(&StorageConfig {
            engine,
            rings: 2,
            ..config(&[a.path(), b.path()], 16 << 20)
        })
        .unwrap();
        let extent = store.allocate(3 << 20).unwrap();
        let source = filled(3 << 20, 5);
        store.write(&extent, &source).unwrap();
        let mut target = AlignedBuf::new(3 << 20, 4096).unwrap();
        store.read(&extent, &mut target).unwrap();
        assert!(source[..] == target[..], "{engine:?}");
        // Striping put half the data in each file.
        for path in store.paths() {
            let on_disk = std::fs::read(&path).unwrap();
            assert!(
                on_disk.iter().any(|&b| b != 0),
                "{} holds none of the stripe",
                path.display()
            );
        }
    }
}

#[test]
fn files_are_private_and_deleted_on_drop() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempdir();
    let store = SwapStore::open(&config(&[dir.path()], 4 << 20)).unwrap();
    let paths = store.paths();
    let mode = std::fs::metadata(&paths[0]).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert_eq!(
        std::fs::metadata(&paths[0]).unwrap().len(),
        4 << 20,
        "capacity is preallocated"
    );
    let extent = store.allocate(4096).unwrap();
    drop(store);
    assert!(paths[0].exists(), "an extent still holds the store open");
    drop(extent);
    assert!(!paths[0].exists());
    assert!(!dir.path().join(OWNED_DIR).exists());
}

#[test]
fn stale_files_from_a_crashed_run_are_removed() {
    let dir = tempdir();
    let owned = dir.path().join(OWNED_DIR);
    std::fs::create_dir(&owned).unwrap();
    let stale = owned.join("swap-999999-0-0.bin");
    std::fs::write(&stale, vec![1u8; 8192]).unwrap();
    let live = SwapStore::open(&config(&[dir.path()], 1 << 20)).unwrap();
    assert!(!stale.exists(), "stale file survived");
    // A second store beside a live one leaves the live one's file alone.
    let second = SwapStore::open(&config(&[dir.path()], 1 << 20)).unwrap();
    assert!(live.paths()[0].exists());
    drop((live, second));
}

#[tokio::test(flavor = "current_thread")]
async fn async_transfers_hand_the_buffer_back() {
    let dir = tempdir();
    let store = SwapStore::open(&config(&[dir.path()], 8 << 20)).unwrap();
    let extent = store.allocate(1 << 20).unwrap();
    let (buf, result) = store.write_async(&extent, filled(1 << 20, 9)).await;
    result.unwrap();
    let (target, result) = store
        .read_async(&extent, AlignedBuf::new(1 << 20, 4096).unwrap())
        .await;
    result.unwrap();
    assert!(buf[..] == target[..]);
}

#[test]
fn tickets_from_threads_overlap() {
    let dir = tempdir();
    let store = SwapStore::open(&config(&[dir.path()], 16 << 20)).unwrap();
    let extents: Vec<_> = (0..4).map(|_| store.allocate(1 << 20).unwrap()).collect();
    let tickets: Vec<_> = extents
        .iter()
        .enumerate()
        .map(|(i, e)| store.write_start(e, filled(1 << 20, i as u64)))
        .collect();
    for ticket in tickets {
        ticket.wait().1.unwrap();
    }
    for (i, extent) in extents.iter().enumerate() {
        let (buf, result) = store
            .read_start(extent, AlignedBuf::new(1 << 20, 4096).unwrap())
            .wait();
        result.unwrap();
        assert!(buf[..] == filled(1 << 20, i as u64)[..]);
    }
}

#[test]
fn misuse_gets_errors_that_name_the_problem() {
    let dir = tempdir();
    let store = SwapStore::open(&config(&[dir.path()], 2 << 20)).unwrap();
    let extent = store.allocate(1 << 20).unwrap();
    let mut small = AlignedBuf::new(4096, 4096).unwrap();
    assert!(matches!(
        store.read(&extent, &mut AlignedBuf::new(1 << 20, 4096).unwrap()),
        Err(StorageError::ExtentNotWritten { .. })
    ));
    assert!(matches!(
        store.write(&extent, &small),
        Err(StorageError::BufferTooSmall {
            buffer_bytes: 4096,
            ..
        })
    ));
    assert!(matches!(
        store.read(&extent, &mut small),
        Err(StorageError::BufferTooSmall { .. })
    ));
    // A write in flight blocks a second write of the same extent. Whether the
    // first is still in flight is a race, so try until it is seen busy.
    let second = filled(1 << 20, 2);
    let mut seen_busy = false;
    for attempt in 0..50 {
        let ticket = store.write_start(&extent, filled(1 << 20, attempt));
        match store.write(&extent, &second) {
            Err(StorageError::ExtentBusy {
                busy_with,
                requested,
                ..
            }) => {
                assert_eq!(
                    (busy_with, requested),
                    (strata_storage::Op::Write, strata_storage::Op::Write)
                );
                seen_busy = true;
            }
            Ok(()) => {}
            Err(other) => panic!("unexpected {other}"),
        }
        ticket.wait().1.unwrap();
        if seen_busy {
            break;
        }
    }
    assert!(seen_busy, "a write in flight never blocked a second write");
    match store.allocate(2 << 20) {
        Err(StorageError::OutOfSpace {
            needed_bytes,
            free_bytes,
            ..
        }) => assert_eq!((needed_bytes, free_bytes), (2 << 20, 1 << 20)),
        other => panic!("expected OutOfSpace, got {other:?}"),
    }
}

#[test]
fn bad_directories_and_sizes_are_refused_with_the_fix() {
    let missing = SwapStore::open(&config(&[std::path::Path::new("/no/such/dir")], 1 << 20))
        .err()
        .unwrap();
    assert!(
        missing.to_string().contains("/no/such/dir") && missing.to_string().contains("mkdir"),
        "{missing}"
    );
    let read_only = SwapStore::open(&config(&[std::path::Path::new("/proc")], 1 << 20))
        .err()
        .unwrap();
    assert!(
        matches!(read_only, StorageError::NotWritable { .. }),
        "{read_only}"
    );
    let dir = tempdir();
    let huge = SwapStore::open(&config(&[dir.path()], 1 << 60))
        .err()
        .unwrap();
    assert!(matches!(huge, StorageError::NoSpace { .. }), "{huge}");
    assert!(huge.to_string().contains("free space"), "{huge}");
}

#[test]
fn dropping_a_busy_extent_frees_it_after_the_transfer() {
    let dir = tempdir();
    let store = SwapStore::open(&config(&[dir.path()], 2 << 20)).unwrap();
    let extent = store.allocate(2 << 20).unwrap();
    let ticket = store.write_start(&extent, filled(2 << 20, 3));
    drop(extent);
    ticket.wait().1.unwrap();
    assert_eq!(store.free_bytes(), store.capacity_bytes());
    store.allocate(2 << 20).unwrap();
}

/// `zero` leaves an extent that held data reading zeros, checksums and
/// all, over a stripe boundary and two files; the extents beside it keep
/// their data; a never-written extent is refused, a zeroed one is not;
/// `zero_all` zeroes several side by side; and an extent busy with a
/// write cannot be zeroed.
#[test]
fn zero_reads_back_zeros_and_leaves_neighbours_alone() {
    let (a, b) = (tempdir(), tempdir());
    let store = SwapStore::open(&config(&[a.path(), b.path()], 16 << 20)).unwrap();
    let before = store.allocate(192 << 10).unwrap();
    let zeroed = store.allocate(320 << 10).unwrap();
    let after = store.allocate(64 << 10).unwrap();
    for (extent, seed) in [(&before, 1), (&zeroed, 2), (&after, 3)] {
        store
            .write(extent, &filled(extent.len_bytes() as usize, seed))
            .unwrap();
    }
    store.zero(&zeroed).unwrap();
    let mut back = AlignedBuf::new(320 << 10, 4096).unwrap();
    store.read(&zeroed, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "the zeroed extent reads zeros"
    );
    for (extent, seed) in [(&before, 1), (&after, 3)] {
        let len = extent.len_bytes() as usize;
        let mut back = AlignedBuf::new(len, 4096).unwrap();
        store.read(extent, &mut back).unwrap();
        assert!(
            back[..] == filled(len, seed)[..],
            "a neighbour kept its data"
        );
    }
    // Never written: a read is refused; zeroed instead, it reads zeros.
    let fresh = store.allocate(64 << 10).unwrap();
    let mut buf = AlignedBuf::new(64 << 10, 4096).unwrap();
    assert!(matches!(
        store.read(&fresh, &mut buf),
        Err(StorageError::ExtentNotWritten { .. })
    ));
    store.zero(&fresh).unwrap();
    buf.fill(7);
    store.read(&fresh, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    // Written over after zeroing, it holds the new data.
    let data = filled(64 << 10, 9);
    store.write(&fresh, &data).unwrap();
    store.read(&fresh, &mut buf).unwrap();
    assert!(buf[..] == data[..]);
    // Several at once, side by side: one range.
    let pair = [
        store.allocate(128 << 10).unwrap(),
        store.allocate(64 << 10).unwrap(),
    ];
    for extent in &pair {
        store
            .write(extent, &filled(extent.len_bytes() as usize, 11))
            .unwrap();
    }
    store.zero_all(&pair).unwrap();
    for extent in &pair {
        let mut back = AlignedBuf::new(extent.len_bytes() as usize, 4096).unwrap();
        store.read(extent, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0));
    }
    // Busy with a write: refused by name.
    let ticket = store.write_start(&zeroed, filled(320 << 10, 4));
    let busy = store.zero(&zeroed);
    let (_, written) = ticket.wait();
    written.unwrap();
    if let Err(err) = busy {
        assert!(matches!(err, StorageError::ExtentBusy { .. }), "{err}");
    }
}

/// On tmpfs, which has no zero range, `zero` punches a hole and reserves
/// its blocks again: the zeroed extent reads zeros and the swap file keeps
/// the space it reserved at open (a later write cannot run out of it).
#[test]
fn zero_on_tmpfs_keeps_the_files_blocks() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        println!("skipped: no /dev/shm");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    let store = SwapStore::open(&config(&[dir.path()], 4 << 20)).unwrap();
    let extent = store.allocate(1 << 20).unwrap();
    store.write(&extent, &filled(1 << 20, 3)).unwrap();
    let blocks = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&store.paths()[0]).unwrap().blocks()
    };
    let before = blocks();
    store.zero(&extent).unwrap();
    assert_eq!(blocks(), before, "the punched blocks are reserved again");
    let mut back = AlignedBuf::new(1 << 20, 4096).unwrap();
    store.read(&extent, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0));
}
