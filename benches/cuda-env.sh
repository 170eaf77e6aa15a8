# Sourced (`. benches/cuda-env.sh`) before running strata on a CUDA 13
# machine: cudarc looks for the unversioned library names (then CUDA 12's),
# and such a machine may have only the versioned ones, or keep them off the
# loader's path (the toolkit's lib64, the Python wheels' nvidia/*/lib).
# Each missing one is linked into a temporary folder put on
# LD_LIBRARY_PATH, beside its own folder (NVRTC loads its builtins library
# by name). Does nothing without a GPU. Also defines `has_gpu`, whether an
# NVIDIA GPU answers here.
has_gpu() { command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; }

link_cuda_libraries() {
    local links found dir lib linked= cache
    links=$(mktemp -d)
    # Read whole first: `ldconfig -p | grep -q` fails under a caller's
    # pipefail once grep stops reading early.
    cache=$(ldconfig -p 2> /dev/null)
    for lib in nvrtc cublasLt cublas nccl; do
        grep -q "lib$lib\.so " <<< "$cache" && continue
        # The toolkit's own copy first, else the newest version found.
        found=$(find /usr/local/cuda/lib64 -name "lib$lib.so*" 2> /dev/null | sort -V | tail -n 1)
        [ -z "$found" ] && found=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib \
            /usr/lib/x86_64-linux-gnu /opt /usr/local/lib -name "lib$lib.so*" 2> /dev/null |
            awk -F/ '{print $NF "\t" $0}' | sort -V | tail -n 1 | cut -f2)
        # pip's wheels (torch's NCCL is nvidia-nccl's libnccl.so.2).
        [ -z "$found" ] && found=$(find $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2> /dev/null) \
            -path "*nvidia*" -name "lib$lib.so*" 2> /dev/null | sort -V | tail -n 1)
        [ -z "$found" ] && continue
        ln -sf "$found" "$links/lib$lib.so"
        linked="$linked lib$lib.so -> $found;"
        dir=$(dirname "$found")
        LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
    export LD_LIBRARY_PATH="$links${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "CUDA libraries linked in $links:${linked:- none needed}"
}
if has_gpu; then
    link_cuda_libraries
fi
