//! Criterion benchmarks of the CPU optimizer kernels: AdamW fp32, the fused
//! bf16 offload step and the 4-read/3-write roofline, per size and thread
//! count, reported as elements (parameters) per second.
//!
//! `cargo bench -p strata-optim`; `strata bench adam` runs the same kernels
//! (`strata_optim::bench`) as an interleaved sweep with JSON output.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use strata_optim::bench::{BenchBuffers, BenchKernel};
use strata_optim::{Pool, PoolConfig};

const SIZES: [usize; 2] = [1 << 20, 16 << 20];
const KERNELS: [BenchKernel; 3] = [
    BenchKernel::AdamwFp32,
    BenchKernel::OffloadStepBf16,
    BenchKernel::Roofline4r3w,
];

fn kernels(c: &mut Criterion) {
    let single = Pool::new(PoolConfig {
        threads: Some(1),
        ..PoolConfig::default()
    })
    .expect("one-thread pool");
    let all = Pool::new(PoolConfig::default()).expect("default pool");
    for params in SIZES {
        let mut buffers = BenchBuffers::new(params);
        let mut group = c.benchmark_group(format!("optim/{params}"));
        group.throughput(Throughput::Elements(params as u64));
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(3));
        for pool in [&single, &all] {
            for kernel in KERNELS {
                buffers.prepare(kernel);
                let id = format!("{kernel}/{}T/{}", pool.threads(), pool.isa());
                group.bench_function(id, |b| {
                    b.iter(|| buffers.run(kernel, pool).expect("valid bench step"))
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
