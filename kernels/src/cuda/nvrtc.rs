//! CUDA C to cubin through NVRTC, loaded at run time (building needs no
//! CUDA, and compiling needs no GPU: CI compiles every kernel).
//!
//! Kernels are compiled straight to a cubin for the device's architecture
//! (`sm_90` on an H100), never to PTX for the driver to JIT: what runs is
//! what was checked. The compile log is read on success too, and a warning
//! fails the compile (the sources are ours). Each (source, architecture)
//! is compiled once per process; later calls share the cubin.
//!
//! ptxas runs verbose: what it reports per kernel (registers, static
//! shared memory, stack frame, spill stores and loads) is parsed out of the
//! log into [`Cubin::resources`], where the tests hold every kernel to no
//! spills and shared memory within the architecture's limit; anything else
//! in the log is a warning.

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
    /// What ptxas reported for each kernel, in the order it compiled them.
    pub resources: Vec<KernelResources>,
}

/// What ptxas reported for one kernel (`--ptxas-options=-v`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's (unmangled, `extern "C"`) name.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory per block.
    pub shared_bytes: u64,
    /// Stack frame per thread.
    pub stack_bytes: u64,
    /// Bytes of registers spilled to local memory, stored.
    pub spill_store_bytes: u64,
    /// Bytes of spilled registers loaded back.
    pub spill_load_bytes: u64,
}

/// Static shared memory a block may declare, on every architecture strata
/// targets (more needs dynamic shared memory and an opt-in attribute).
pub const STATIC_SHARED_BYTES_MAX: u64 = 48 << 10;

/// Shared memory a block may use on `arch` once its kernel opts in
/// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`): the CUDA
/// programming guide's per-architecture limit. None for an architecture
/// strata does not compile for.
pub fn shared_bytes_max(arch: u32) -> Option<u64> {
    match arch {
        80 => Some(163 << 10),
        89 => Some(99 << 10),
        90 => Some(227 << 10),
        _ => None,
    }
}

/// Splits a verbose compile log into ptxas's per-kernel reports and the
/// other lines (warnings), which it returns joined.
pub fn parse_log(log: &str) -> (Vec<KernelResources>, String) {
    let mut kernels: Vec<KernelResources> = Vec::new();
    let mut properties_of: Option<String> = None;
    let mut other = Vec::new();
    let number_before = |text: &str, unit: &str| -> Option<u64> {
        let at = text.find(unit)?;
        text[..at].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        let Some(rest) = line.strip_prefix("ptxas") else {
            if !line.trim().is_empty() {
                other.push(line);
            }
            continue;
        };
        let rest = rest.trim_start();
        if let Some(info) = rest.strip_prefix("info") {
            let info = info.trim_start().trim_start_matches(':').trim();
            if let Some(entry) = info.strip_prefix("Compiling entry function '") {
                let name = entry.split('\'').next().unwrap_or_default();
                kernels.push(KernelResources {
                    kernel: name.to_string(),
                    ..KernelResources::default()
                });
            } else if let Some(function) = info.strip_prefix("Function properties for ") {
                properties_of = Some(function.trim().to_string());
            } else if let (true, Some(last)) = (info.starts_with("Used "), kernels.last_mut()) {
                last.registers = number_before(info, " registers").unwrap_or(0) as u32;
                last.shared_bytes = number_before(info, " bytes smem").unwrap_or(0);
            }
            // gmem, compile time and the like: nothing to keep.
        } else if let Some(frame) = rest.strip_prefix('.') {
            // The stack line of the function named just before.
            let named = properties_of.take();
            if let Some(kernel) = kernels
                .iter_mut()
                .rev()
                .find(|k| Some(&k.kernel) == named.as_ref())
            {
                kernel.stack_bytes = number_before(frame, " bytes stack frame").unwrap_or(0);
                kernel.spill_store_bytes = number_before(frame, " bytes spill stores").unwrap_or(0);
                kernel.spill_load_bytes = number_before(frame, " bytes spill loads").unwrap_or(0);
            }
        } else {
            // "ptxas warning : ..." and anything else ptxas says.
            other.push(line);
        }
    }
    (kernels, other.join("\n"))
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
    let (image, resources) = compile_uncached(name, source, arch)?;
    let cubin = Arc::new(Cubin {
        name,
        arch,
        image,
        resources,
    });
    // Two threads may both compile: either result is the same module.
    Ok(cache()
        .lock()
        .expect("nvrtc cache")
        .entry(key)
        .or_insert(cubin)
        .clone())
}

fn compile_uncached(
    name: &'static str,
    source: &str,
    arch: u32,
) -> Result<(Vec<u8>, Vec<KernelResources>)> {
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
    options.push("--ptxas-options=-v".to_string());
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
    let (resources, warnings) = parse_log(&log);
    if !warnings.is_empty() {
        // Our sources compile clean: a warning is a bug to fix, not noise.
        return Err(KernelError::Compile {
            source_name: name,
            arch,
            log: format!("compiled, with warnings:\n{warnings}"),
        });
    }
    Ok((image, resources))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_reports_are_parsed_per_kernel_and_other_lines_are_warnings() {
        let log = "ptxas info    : 0 bytes gmem
ptxas info    : Function properties for helper
ptxas         .     8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'k' for 'sm_90'
ptxas info    : Function properties for k
ptxas         .     16 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 10 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'plain' for 'sm_90'
ptxas info    : Function properties for plain
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, 352 bytes cmem[0]
ptxas info    : Compile time = 1.949 ms
";
        let (kernels, warnings) = parse_log(log);
        assert_eq!(warnings, "");
        assert_eq!(
            kernels,
            [
                KernelResources {
                    kernel: "k".into(),
                    registers: 10,
                    shared_bytes: 1024,
                    stack_bytes: 16,
                    spill_store_bytes: 12,
                    spill_load_bytes: 4,
                },
                KernelResources {
                    kernel: "plain".into(),
                    registers: 8,
                    ..KernelResources::default()
                },
            ]
        );
        let warned = format!(
            "{log}ptxas warning : Value of threads per SM is out of range\nt.cu(3): warning: unused\n"
        );
        let (_, warnings) = parse_log(&warned);
        assert_eq!(
            warnings,
            "ptxas warning : Value of threads per SM is out of range\nt.cu(3): warning: unused"
        );
    }
}
