//! CUDA C to cubin through NVRTC, loaded at run time (building needs no
//! CUDA, and compiling needs no GPU: CI compiles every kernel).
//!
//! Kernels are compiled straight to a cubin for the device's architecture
//! (`sm_90` on an H100), never to PTX for the driver to JIT: what runs is
//! what was checked. The compile log is read on success too, and a warning
//! fails the compile (the sources are ours). Each (source, architecture)
//! is compiled once per process; later calls share the cubin.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result, sys};
use strata_device::cuda::{Library, probe_library};

use crate::error::{KernelError, Result};

/// A compiled module: the cubin's bytes and the architecture it is for.
#[derive(Debug)]
pub struct Cubin {
    /// The source's name (for messages).
    pub name: &'static str,
    /// Compute capability times ten plus minor (90 for sm_90).
    pub arch: u32,
    /// The ELF image the driver loads (`cuModuleLoadData`).
    pub image: Vec<u8>,
}

impl Cubin {
    /// Whether the module defines a kernel of this (unmangled) name.
    pub fn defines(&self, kernel: &str) -> bool {
        let name = kernel.as_bytes();
        // The ELF string table holds each symbol NUL-terminated.
        self.image
            .windows(name.len() + 2)
            .any(|w| w[0] == 0 && &w[1..=name.len()] == name && w[name.len() + 1] == 0)
    }
}

/// Architectures strata compiles for: Ampere (sm_80), Ada (sm_89),
/// Hopper (sm_90).
pub const ARCHS: [u32; 3] = [80, 89, 90];

/// Compile options besides the architecture: IEEE division and square
/// root, no flush of subnormals (the CPU reference keeps them), fused
/// multiply-add where the source writes one, C++17, line info for
/// profilers.
const OPTIONS: [&str; 6] = [
    "--std=c++17",
    "--fmad=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--ftz=false",
    "--generate-line-info",
];

type Cache = Mutex<HashMap<(&'static str, u32, u64), Arc<Cubin>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Compiles `source` (named `name` in messages) to a cubin for `arch`, or
/// returns the one this process already compiled.
pub fn compile(name: &'static str, source: &str, arch: u32) -> Result<Arc<Cubin>> {
    if !ARCHS.contains(&arch) {
        return Err(KernelError::Arch {
            arch,
            supported: ARCHS.map(|a| format!("sm_{a}")).join(", "),
        });
    }
    let key = (name, arch, xxhash_rust::xxh3::xxh3_64(source.as_bytes()));
    if let Some(cubin) = cache().lock().expect("nvrtc cache").get(&key) {
        return Ok(cubin.clone());
    }
    probe_library(Library::Nvrtc)?;
    let image = compile_uncached(name, source, arch)?;
    let cubin = Arc::new(Cubin { name, arch, image });
    // Two threads may both compile: either result is the same module.
    Ok(cache()
        .lock()
        .expect("nvrtc cache")
        .entry(key)
        .or_insert(cubin)
        .clone())
}

fn compile_uncached(name: &'static str, source: &str, arch: u32) -> Result<Vec<u8>> {
    let failed = |stage: &'static str, err: result::NvrtcError| KernelError::Compile {
        source_name: name,
        arch,
        log: format!("{stage} failed: {err:?}"),
    };
    let text = CString::new(source).map_err(|_| KernelError::Compile {
        source_name: name,
        arch,
        log: "the source holds a NUL byte".into(),
    })?;
    let file = CString::new(format!("{name}.cu")).expect("no NUL in a kernel source's name");
    let program = result::create_program(&text, Some(&file)).map_err(|e| failed("create", e))?;
    let mut options: Vec<String> = OPTIONS.iter().map(|o| o.to_string()).collect();
    options.push(format!("--gpu-architecture=sm_{arch}"));
    // SAFETY: `program` was just created and is destroyed only below.
    let compiled = unsafe { result::compile_program(program, &options) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(program) }
        .map(|log| text_of(&log))
        .unwrap_or_else(|err| format!("(the log could not be read: {err:?})"));
    let image = match compiled {
        // SAFETY: as above; the program compiled.
        Ok(()) => unsafe { cubin_of(program) }.map_err(|e| failed("nvrtcGetCUBIN", e)),
        Err(err) => Err(KernelError::Compile {
            source_name: name,
            arch,
            log: format!("{err:?}:\n{log}"),
        }),
    };
    // SAFETY: as above; not used after this.
    let destroyed = unsafe { result::destroy_program(program) };
    let image = image?;
    destroyed.map_err(|e| failed("destroy", e))?;
    if !log.trim().is_empty() {
        // Our sources compile clean: a warning is a bug to fix, not noise.
        return Err(KernelError::Compile {
            source_name: name,
            arch,
            log: format!("compiled, with warnings:\n{log}"),
        });
    }
    Ok(image)
}

/// The NUL-terminated text NVRTC returns, as a String.
fn text_of(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    CStr::from_bytes_until_nul(&bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
}

/// The cubin of a compiled program.
///
/// # Safety
/// `program` must come from `create_program`, be compiled without error
/// and not yet be destroyed.
unsafe fn cubin_of(program: sys::nvrtcProgram) -> std::result::Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: `program` is live (the caller's contract); `size` is writable.
    unsafe { sys::nvrtcGetCUBINSize(program, &mut size) }.result()?;
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds the `size` bytes NVRTC said it writes.
    unsafe { sys::nvrtcGetCUBIN(program, image.as_mut_ptr().cast()) }.result()?;
    Ok(image)
}
