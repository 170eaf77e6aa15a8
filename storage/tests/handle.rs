//! `IoHandle`: whole buffers written and read back through every path
//! (direct in place, direct through the bounce blocks, buffered tails and
//! unaligned offsets), on both engines, and its errors.

use strata_storage::{AlignedBuf, EngineKind, HandleConfig, IoHandle, Op, probe_uring};

fn engines() -> Vec<EngineKind> {
    match probe_uring() {
        Ok(()) => vec![EngineKind::Uring, EngineKind::Threads],
        Err(reason) => {
            eprintln!("io_uring skipped here: {reason}");
            vec![EngineKind::Threads]
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

/// Writes `data` from memory at `misalign` bytes past an aligned address,
/// at `offset` in the file, reads it back the same way, and compares.
fn round_trip(engine: EngineKind, threads: usize, len: usize, misalign: usize, offset: u64) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("t.bin");
    let config = HandleConfig {
        block_bytes: 64 << 10,
        queue_depth: 4,
        threads,
        engine,
    };
    let mut handle = IoHandle::new(config).unwrap();
    let data = pattern(len, threads as u8);
    let mut out = AlignedBuf::new(len + misalign + 4096, 4096).unwrap();
    let mut back = AlignedBuf::new(len + misalign + 4096, 4096).unwrap();
    // SAFETY: both buffers outlive the waits below and are not touched meanwhile.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), out.as_mut_ptr().add(misalign), len);
        handle
            .start(
                Op::Write,
                out.as_mut_ptr().add(misalign),
                len,
                &path,
                offset,
            )
            .unwrap();
    }
    assert_eq!(handle.wait().unwrap(), 1);
    let file_len = std::fs::metadata(&path).unwrap().len();
    assert_eq!(
        file_len,
        offset + len as u64,
        "the write extended the file past what was asked"
    );
    // SAFETY: as above.
    unsafe {
        handle
            .start(
                Op::Read,
                back.as_mut_ptr().add(misalign),
                len,
                &path,
                offset,
            )
            .unwrap();
    }
    assert_eq!(handle.wait().unwrap(), 1);
    // SAFETY: `len` bytes were read there.
    let read = unsafe { std::slice::from_raw_parts(back.as_ptr().add(misalign), len) };
    assert!(
        read == &data[..],
        "{engine} threads={threads} len={len} misalign={misalign} offset={offset}: bytes differ"
    );
}

#[test]
fn every_path_writes_and_reads_back_the_same_bytes() {
    for engine in engines() {
        for threads in [1, 3] {
            for (len, misalign, offset) in [
                (1 << 20, 0, 0),               // direct, in place
                ((1 << 20) + 4096 * 3, 64, 0), // direct (bounced where 64 is too little)
                ((1 << 20) + 4096, 1, 0),      // direct through bounce blocks
                ((1 << 20) + 1234, 0, 8192),   // buffered tail
                (300_001, 8, 4096),            // bounce and tail
                (100_000, 0, 17),              // unaligned offset: all buffered
                (5, 3, 0),                     // shorter than a block
            ] {
                round_trip(engine, threads, len, misalign, offset);
            }
        }
    }
}

#[test]
fn many_operations_in_flight_are_counted_and_land_where_asked() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut handle = IoHandle::new(HandleConfig {
        block_bytes: 4096,
        queue_depth: 8,
        threads: 2,
        engine: engines()[0],
    })
    .unwrap();
    let pieces: Vec<Vec<u8>> = (0..16).map(|i| pattern(40_000, i as u8)).collect();
    let path = dir.path().join("many.bin");
    for (i, piece) in pieces.iter().enumerate() {
        // SAFETY: `pieces` is neither moved nor modified until `wait`.
        unsafe {
            handle
                .start(
                    Op::Write,
                    piece.as_ptr().cast_mut(),
                    piece.len(),
                    &path,
                    i as u64 * 40_960,
                )
                .unwrap();
        }
    }
    assert_eq!(handle.pending(), 16);
    assert_eq!(handle.wait().unwrap(), 16);
    assert_eq!(handle.wait().unwrap(), 0);
    let file = std::fs::read(&path).unwrap();
    for (i, piece) in pieces.iter().enumerate() {
        let at = i * 40_960;
        assert_eq!(&file[at..at + piece.len()], &piece[..], "piece {i}");
    }
}

#[test]
fn errors_name_the_path_and_the_cause() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut handle = IoHandle::new(HandleConfig {
        engine: engines()[0],
        ..HandleConfig::default()
    })
    .unwrap();
    let mut buf = vec![0u8; 8192];
    let missing = dir.path().join("absent.bin");
    // SAFETY: `buf` outlives the handle's use of it (the call fails before any I/O).
    let error = unsafe { handle.start(Op::Read, buf.as_mut_ptr(), buf.len(), &missing, 0) }
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("absent.bin") && error.contains("No such file"),
        "{error}"
    );

    let short = dir.path().join("short.bin");
    std::fs::write(&short, [1u8; 100]).unwrap();
    // SAFETY: as above.
    let error = unsafe { handle.start(Op::Read, buf.as_mut_ptr(), buf.len(), &short, 0) }
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("short.bin") && error.contains("8092"),
        "{error}"
    );

    let into_dir = dir.path().join("sub");
    std::fs::create_dir(&into_dir).unwrap();
    // SAFETY: as above.
    let error = unsafe { handle.start(Op::Write, buf.as_mut_ptr(), buf.len(), &into_dir, 0) }
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("sub") && error.contains("os error"),
        "{error}"
    );

    // SAFETY: as above.
    let error = unsafe {
        handle.start(
            Op::Write,
            buf.as_mut_ptr(),
            buf.len(),
            &short,
            u64::MAX - 10,
        )
    }
    .unwrap_err()
    .to_string();
    assert!(error.contains("offset"), "{error}");
    assert_eq!(
        handle.wait().unwrap(),
        0,
        "failed starts leave nothing pending"
    );
}

#[test]
fn dropping_a_handle_waits_for_its_operations() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("drop.bin");
    let data = pattern(4 << 20, 9);
    {
        let mut handle = IoHandle::new(HandleConfig {
            threads: 2,
            engine: engines()[0],
            ..HandleConfig::default()
        })
        .unwrap();
        // SAFETY: `data` outlives the handle, whose drop waits for the write.
        unsafe {
            handle
                .start(Op::Write, data.as_ptr().cast_mut(), data.len(), &path, 0)
                .unwrap()
        };
    }
    assert!(std::fs::read(&path).unwrap() == data);
}
