//! Every CUDA C kernel compiles with NVRTC, clean, for every architecture
//! strata targets. NVRTC needs no GPU: CI installs the library (the
//! `nvidia-cuda-nvrtc-cu12` wheel) and sets `STRATA_REQUIRE_NVRTC=1`, so
//! there this test fails instead of skipping.

use std::sync::Arc;

use strata_kernels::KernelError;
use strata_kernels::cuda::{
    ATTENTION_NAME, ATTENTION_SOURCE, FLASH_HEAD_DIMS, FLASH_PER_HEAD_DIM, OPS_NAME, OPS_SOURCE,
    attention_kernels, flash_shared_bytes, nvrtc, ops_kernels,
};

/// Each CUDA C source with the kernels it must define.
fn sources() -> [(&'static str, &'static str, Vec<String>); 2] {
    [
        (OPS_NAME, OPS_SOURCE, ops_kernels()),
        (ATTENTION_NAME, ATTENTION_SOURCE, attention_kernels()),
    ]
}

/// Whether NVRTC is here; prints why a test skips when it is not.
fn nvrtc_present(test: &str) -> bool {
    match strata_device::cuda::probe_library(strata_device::cuda::Library::Nvrtc) {
        Ok(()) => true,
        Err(err) if std::env::var_os("STRATA_REQUIRE_NVRTC").is_some() => {
            panic!("{test}: STRATA_REQUIRE_NVRTC is set but {err}")
        }
        Err(err) => {
            eprintln!("skipping {test}: {err}");
            false
        }
    }
}

#[test]
fn every_kernel_compiles_clean_to_a_cubin_for_every_architecture() {
    if !nvrtc_present("every_kernel_compiles_clean_to_a_cubin_for_every_architecture") {
        return;
    }
    assert_eq!(ops_kernels().len(), 53);
    assert_eq!(attention_kernels().len(), 7);
    for (name, source, kernels) in sources() {
        for arch in nvrtc::ARCHS {
            let cubin = nvrtc::compile(name, source, arch).unwrap_or_else(|err| panic!("{err}"));
            // An ELF image (a cubin), not PTX text.
            assert_eq!(&cubin.image[..4], b"\x7fELF", "{name} sm_{arch}");
            for kernel in &kernels {
                assert!(cubin.defines(kernel), "{name} sm_{arch} lacks {kernel}");
            }
            assert!(!cubin.defines("gelu_f16"), "the symbol check can fail");
            // Compiled once per process.
            let again = nvrtc::compile(name, source, arch).unwrap();
            assert!(Arc::ptr_eq(&cubin, &again));
        }
    }
}

#[test]
fn a_broken_source_or_a_warning_fails_with_the_log_and_an_unknown_arch_is_refused() {
    if !nvrtc_present(
        "a_broken_source_or_a_warning_fails_with_the_log_and_an_unknown_arch_is_refused",
    ) {
        return;
    }
    let broken = "extern \"C\" __global__ void k(float *x) { x[0] = undefined_name; }\n";
    let err = nvrtc::compile("broken", broken, 90).unwrap_err();
    assert!(
        matches!(err, KernelError::Compile { arch: 90, .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("broken.cu") && text.contains("undefined_name"),
        "{text}"
    );
    // An unused variable is a warning: it fails too.
    let warned = "extern \"C\" __global__ void k(float *x) { int unused = 3; x[0] = 1.0f; }\n";
    let err = nvrtc::compile("warned", warned, 90)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("with warnings") && err.contains("unused"),
        "{err}"
    );
    let err = nvrtc::compile(OPS_NAME, OPS_SOURCE, 75)
        .unwrap_err()
        .to_string();
    assert!(err.contains("sm_75") && err.contains("sm_90"), "{err}");
}

/// ptxas's report for every kernel, every architecture: no register
/// spills, static shared memory within the per-block limit (48 KiB), and
/// the tensor-core attention's dynamic shared memory within the
/// architecture's opt-in limit. Prints the table.
#[test]
fn no_kernel_spills_registers_or_passes_the_shared_memory_limit() {
    if !nvrtc_present("no_kernel_spills_registers_or_passes_the_shared_memory_limit") {
        return;
    }
    for arch in nvrtc::ARCHS {
        let limit = nvrtc::shared_bytes_max(arch).unwrap();
        for kernel in FLASH_PER_HEAD_DIM {
            for d in FLASH_HEAD_DIMS {
                let bytes = u64::from(flash_shared_bytes(kernel, d));
                assert!(
                    bytes <= limit,
                    "sm_{arch}: {kernel}_d{d} takes {bytes} bytes of shared memory"
                );
            }
        }
    }
    assert_eq!(nvrtc::shared_bytes_max(75), None);
    for (name, source, kernels) in sources() {
        check_resources(name, source, &kernels);
    }
}

fn check_resources(name: &'static str, source: &str, kernels: &[String]) {
    for arch in nvrtc::ARCHS {
        let cubin = nvrtc::compile(name, source, arch).unwrap();
        let mut reported: Vec<&str> = cubin.resources.iter().map(|r| r.kernel.as_str()).collect();
        reported.sort();
        let mut expected: Vec<&str> = kernels.iter().map(|k| k.as_ref()).collect();
        expected.sort();
        assert_eq!(
            reported, expected,
            "sm_{arch}: ptxas reported other kernels"
        );
        for r in &cubin.resources {
            eprintln!(
                "sm_{arch} {:<40} {:>3} registers {:>6} B shared {:>4} B stack {} B spilled",
                r.kernel, r.registers, r.shared_bytes, r.stack_bytes, r.spill_store_bytes
            );
            assert_eq!(
                (r.spill_store_bytes, r.spill_load_bytes),
                (0, 0),
                "sm_{arch}: {} spills registers",
                r.kernel
            );
            assert!(
                r.shared_bytes <= nvrtc::STATIC_SHARED_BYTES_MAX,
                "sm_{arch}: {} declares {} bytes of shared memory",
                r.kernel,
                r.shared_bytes
            );
            assert!(r.registers > 0 && r.registers <= 255, "{r:?}");
        }
    }
}

/// The resident AdamW reads v as strata_optim's kernels do: as zero where
/// subnormal only from `FLUSH_V_EPS_MIN` up, a number `ops.cu` repeats.
/// (A plain text check: it needs no NVRTC.)
#[test]
fn the_device_adamw_reads_v_from_optims_eps_threshold() {
    let threshold = format!("k.eps >= {:e}f", strata_optim::FLUSH_V_EPS_MIN);
    assert!(
        OPS_SOURCE.contains(&threshold),
        "ops.cu's adamw_bf16 must test `{threshold}`"
    );
}
