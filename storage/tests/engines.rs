//! Both engines through IoQueue, clean and under injected faults.

use std::path::PathBuf;

use strata_storage::{
    AlignedBuf, EngineKind, FaultEngine, FaultRates, IoFile, IoQueue, Op, RawEngine, Request,
    StorageError, engine,
};

const BLOCK: usize = 64 << 10;
const BLOCKS: usize = 32;

fn kinds() -> Vec<EngineKind> {
    match strata_storage::probe_uring() {
        Ok(()) => vec![EngineKind::Uring, EngineKind::Threads],
        Err(reason) => {
            println!("skipped: io_uring engine ({reason})");
            vec![EngineKind::Threads]
        }
    }
}

fn pattern(seed: u8) -> AlignedBuf {
    let mut buf = AlignedBuf::new(BLOCK * BLOCKS, 4096).unwrap();
    for (i, byte) in buf.iter_mut().enumerate() {
        *byte = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    buf
}

/// Pushes one request per block and waits for all; returns the results.
fn run(queue: &mut IoQueue, op: Op, buf: &mut AlignedBuf) -> Vec<Result<(), StorageError>> {
    let base = buf.as_mut_ptr();
    let mut results: Vec<Option<Result<(), StorageError>>> = (0..BLOCKS).map(|_| None).collect();
    let mut next = 0;
    let mut done = Vec::new();
    while results.iter().any(Option::is_none) {
        while next < BLOCKS && queue.has_room() {
            let request = Request {
                op,
                file: 0,
                offset: (next * BLOCK) as u64,
                // SAFETY: inside `buf`, which outlives this loop.
                ptr: unsafe { base.add(next * BLOCK) },
                len: BLOCK as u32,
                tag: next as u64,
            };
            // SAFETY: `buf` is not touched until every completion is back.
            unsafe { queue.push(request) };
            next += 1;
        }
        queue.submit_and_wait(1, &mut done);
        for completion in done.drain(..) {
            results[completion.tag as usize] = Some(completion.result);
        }
    }
    results.into_iter().map(Option::unwrap).collect()
}

fn queue_over(
    kind: EngineKind,
    depth: usize,
    rates: Option<(FaultRates, u64)>,
) -> (
    IoQueue,
    tempfile::TempDir,
    Option<std::sync::Arc<std::sync::Mutex<strata_storage::FaultCounts>>>,
) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path: PathBuf = dir.path().join("data");
    let file = IoFile::open(&path, true).unwrap();
    let fd = file.fd();
    std::mem::forget(file.file); // the fd lives as long as the test process
    let engine = engine::build(kind, &[fd], depth).unwrap();
    match rates {
        None => (IoQueue::new(engine, vec![path], 8), dir, None),
        Some((rates, seed)) => {
            let faulty = FaultEngine::new(engine, rates, seed);
            let counts = faulty.counts_handle();
            let boxed: Box<dyn RawEngine> = Box::new(faulty);
            (IoQueue::new(boxed, vec![path], 8), dir, Some(counts))
        }
    }
}

#[test]
fn round_trip_on_every_engine() {
    for kind in kinds() {
        let (mut queue, _dir, _) = queue_over(kind, 8, None);
        let mut source = pattern(1);
        assert!(
            run(&mut queue, Op::Write, &mut source)
                .iter()
                .all(Result::is_ok),
            "{kind}"
        );
        let mut target = AlignedBuf::new(BLOCK * BLOCKS, 4096).unwrap();
        assert!(
            run(&mut queue, Op::Read, &mut target)
                .iter()
                .all(Result::is_ok),
            "{kind}"
        );
        assert!(
            source[..] == target[..],
            "{kind}: data differs after a round trip"
        );
        assert_eq!(queue.stats().completed, 2 * BLOCKS as u64);
    }
}

#[test]
fn reading_past_the_end_is_a_typed_eof() {
    for kind in kinds() {
        let (mut queue, _dir, _) = queue_over(kind, 4, None);
        let mut target = AlignedBuf::new(BLOCK * BLOCKS, 4096).unwrap();
        let results = run(&mut queue, Op::Read, &mut target);
        assert!(
            results
                .iter()
                .all(|r| matches!(r, Err(StorageError::UnexpectedEof { .. }))),
            "{kind}: {results:?}"
        );
    }
}

#[test]
fn short_transfers_and_eagain_are_retried_to_the_right_bytes() {
    for kind in kinds() {
        let rates = FaultRates {
            short: 0.3,
            eagain: 0.2,
            ..Default::default()
        };
        let (mut queue, _dir, counts) = queue_over(kind, 8, Some((rates, 42)));
        let mut source = pattern(2);
        assert!(
            run(&mut queue, Op::Write, &mut source)
                .iter()
                .all(Result::is_ok)
        );
        let mut target = AlignedBuf::new(BLOCK * BLOCKS, 4096).unwrap();
        assert!(
            run(&mut queue, Op::Read, &mut target)
                .iter()
                .all(Result::is_ok)
        );
        assert!(
            source[..] == target[..],
            "{kind}: retried transfers moved wrong bytes"
        );
        let counts = *counts.unwrap().lock().unwrap();
        let stats = queue.stats();
        assert!(
            counts.short > 0 && counts.eagain > 0,
            "{kind}: nothing injected: {counts:?}"
        );
        assert_eq!(stats.short_resubmits, counts.short, "{kind}");
        assert_eq!(stats.again_resubmits, counts.eagain, "{kind}");
    }
}

#[test]
fn endless_eagain_ends_as_retries_exhausted() {
    let rates = FaultRates {
        eagain: 1.0,
        ..Default::default()
    };
    let (mut queue, _dir, _) = queue_over(EngineKind::Threads, 4, Some((rates, 7)));
    let mut source = pattern(3);
    let results = run(&mut queue, Op::Write, &mut source);
    for result in results {
        match result {
            Err(StorageError::RetriesExhausted {
                retries,
                op: Op::Write,
                ..
            }) => assert_eq!(retries, 8),
            other => panic!("expected RetriesExhausted, got {other:?}"),
        }
    }
}

#[test]
fn eio_and_enospc_surface_as_typed_errors() {
    for kind in kinds() {
        let rates = FaultRates {
            eio: 0.2,
            enospc: 0.2,
            ..Default::default()
        };
        let (mut queue, _dir, counts) = queue_over(kind, 8, Some((rates, 9)));
        let mut source = pattern(4);
        let results = run(&mut queue, Op::Write, &mut source);
        let counts = *counts.unwrap().lock().unwrap();
        let eio = results
            .iter()
            .filter(|r| matches!(r, Err(StorageError::Io { .. })))
            .count() as u64;
        let full = results
            .iter()
            .filter(|r| matches!(r, Err(StorageError::DiskFull { .. })))
            .count() as u64;
        assert_eq!(
            (eio, full),
            (counts.eio, counts.enospc),
            "{kind}: every injected fault must surface"
        );
        assert!(eio > 0 && full > 0, "{kind}: seed injected nothing");
        let message = results
            .iter()
            .find_map(|r| r.as_ref().err())
            .unwrap()
            .to_string();
        assert!(message.contains("offset"), "{message}");
    }
}
