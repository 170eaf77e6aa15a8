//! Which instruction set the kernels run with: detected once at start from
//! the CPU the binary runs on (never the build machine), overridable with
//! `STRATA_ISA` for comparisons and debugging.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use crate::OptimError;

/// An instruction set the kernels are compiled for. Every variant exists on
/// every target; [`Isa::is_available`] says which the running CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust over 4-lane arrays, vectorized for the target's baseline
    /// (SSE2 on x86-64, NEON on aarch64). Always available.
    Portable,
    /// AVX2 with FMA, F16C and AES-NI (stochastic rounding's random bits).
    Avx2,
    /// AVX-512F and AES-NI (stochastic rounding's random bits four
    /// 128-bit AES rounds at a time).
    Avx512,
    /// AVX-512F and BW with VAES: the random bits in 512-bit AES rounds
    /// (Ice Lake-SP).
    Avx512Vaes,
    /// AVX-512F, BW, VL and BF16 (`vcvtneps2bf16` for bf16 outputs), and
    /// VAES (every such CPU but Cooper Lake has it; Cooper Lake runs
    /// [`Isa::Avx512`]).
    Avx512Bf16,
}

impl Isa {
    /// Every variant, weakest first.
    pub const ALL: [Isa; 5] = [
        Isa::Portable,
        Isa::Avx2,
        Isa::Avx512,
        Isa::Avx512Vaes,
        Isa::Avx512Bf16,
    ];

    /// Whether the running CPU (and OS) supports this instruction set.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
                    && std::arch::is_x86_feature_detected!("aes")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("aes")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vaes => {
                Isa::Avx512.is_available()
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("vaes")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => {
                Isa::Avx512Vaes.is_available()
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The instruction sets this CPU supports, weakest first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL
            .into_iter()
            .filter(|isa| isa.is_available())
            .collect()
    }

    /// The strongest instruction set this CPU supports.
    pub fn detect() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|isa| isa.is_available())
            .unwrap_or(Isa::Portable)
    }

    /// The instruction set for this process, chosen once: `STRATA_ISA` when
    /// it names an available one, else [`Isa::detect`] (also for "best" or
    /// an empty value, as `--isa best`). A bad `STRATA_ISA` is logged once
    /// and ignored.
    pub fn chosen() -> Isa {
        static CHOSEN: OnceLock<Isa> = OnceLock::new();
        *CHOSEN.get_or_init(|| match std::env::var("STRATA_ISA") {
            Ok(name) if matches!(name.trim(), "" | "best") => Isa::detect(),
            Ok(name) => match Isa::parse_available(&name) {
                Ok(isa) => isa,
                Err(error) => {
                    let detected = Isa::detect();
                    tracing::warn!("STRATA_ISA ignored: {error}; using {detected}");
                    detected
                }
            },
            Err(_) => Isa::detect(),
        })
    }

    /// Parses a name and checks the CPU supports it.
    pub fn parse_available(name: &str) -> Result<Isa, OptimError> {
        let isa: Isa = name.parse()?;
        if !isa.is_available() {
            let available: Vec<&str> = Isa::available().iter().map(|isa| isa.name()).collect();
            return Err(OptimError::IsaUnavailable {
                isa: isa.name(),
                available: available.join(", "),
            });
        }
        Ok(isa)
    }

    /// The name `FromStr` accepts and benchmarks print.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vaes => "avx512vaes",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Isa {
    type Err = OptimError;

    fn from_str(name: &str) -> Result<Isa, OptimError> {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| OptimError::UnknownIsa {
                name: name.to_string(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for isa in Isa::ALL {
            assert_eq!(isa.name().parse::<Isa>().unwrap(), isa);
        }
        let error = "sse9".parse::<Isa>().unwrap_err().to_string();
        assert!(
            error.contains("sse9") && error.contains("avx512bf16"),
            "{error}"
        );
    }

    #[test]
    fn detection_picks_an_available_set() {
        assert!(Isa::detect().is_available());
        assert_eq!(Isa::available().last(), Some(&Isa::detect()));
        assert!(Isa::available().contains(&Isa::Portable));
    }
}
