#!/usr/bin/env bash
# strata bench nvme against fio (io_uring, O_DIRECT) on the same file, same
# request size and queue depth, alternating which runs first, ROUNDS times.
# Prints each median and the median of the per-round ratios strata/fio.
#
#   benches/nvme_vs_fio.sh [DIR]
#   env: SIZE (bytes, default 2 GiB)  ROUNDS (default 3)
#        POINTS ("block_bytes:queue_depth ...", default "1048576:32 131072:32")
#        STRATA (binary; default: cargo build --release, target/release/strata)
#        CHECK=1: exit 1 if a ratio misses its bar (0.95 at 1 MiB, 0.90 below)
#
# Sizes go to fio as plain bytes: fio reads "64MiB" as 64e6 and "128KiB" as 128000.
set -euo pipefail

dir=${1:-strata-nvme-bench}
size=${SIZE:-$((2 << 30))}
rounds=${ROUNDS:-3}
points=${POINTS:-"1048576:32 131072:32"}

if ! command -v fio >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -qq fio >/dev/null
  else
    echo "fio is not installed: apt-get install fio (or your distribution's package)" >&2
    exit 2
  fi
fi
if [ -z "${STRATA:-}" ]; then
  cargo build --release --quiet --bin strata
  STRATA=target/release/strata
fi
mkdir -p "$dir"
file="$dir/strata-bench.dat"

median() { sort -g | awk '{v[NR]=$1} END {if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }

fio_bw() { # rw bs qd -> bytes/s
  fio --name=strata-vs-fio --filename="$file" --size="$size" --rw="$1" --bs="$2" --iodepth="$3" \
      --direct=1 --ioengine=io_uring --output-format=json 2>/dev/null \
    | grep -o '"bw_bytes" : [0-9]*' | awk '{print $3}' | sort -n | tail -1
}

strata_bw() { # rw bs qd -> bytes/s
  "$STRATA" --log-level warn bench nvme --dir "$dir" --size "$size" --rw "$1" --block-size "$2" \
      --queue-depth "$3" --engine uring --keep --json \
    | grep -o '"bw_bytes":[0-9.e+]*' | head -1 | cut -d: -f2
}

# Lay the file out once (unmeasured); both tools then reuse it.
strata_bw write 1048576 32 >/dev/null

status=0
printf '%-8s %-6s %4s %12s %12s %8s %6s\n' block rw qd "fio GB/s" "strata GB/s" ratio bar
for point in $points; do
  bs=${point%%:*}; qd=${point##*:}
  bar=0.90; [ "$bs" -ge 1048576 ] && bar=0.95
  for rw in write read; do
    fio_all=(); strata_all=(); ratios=()
    for ((round = 0; round < rounds; round++)); do
      if ((round % 2 == 0)); then f=$(fio_bw $rw $bs $qd); s=$(strata_bw $rw $bs $qd)
      else s=$(strata_bw $rw $bs $qd); f=$(fio_bw $rw $bs $qd); fi
      fio_all+=("$f"); strata_all+=("$s")
      ratios+=("$(awk -v s="$s" -v f="$f" 'BEGIN {printf "%.4f", s / f}')")
    done
    f=$(printf '%s\n' "${fio_all[@]}" | median)
    s=$(printf '%s\n' "${strata_all[@]}" | median)
    r=$(printf '%s\n' "${ratios[@]}" | median)
    verdict=$(awk -v r="$r" -v b="$bar" 'BEGIN {print (r >= b) ? "ok" : "MISS"}')
    [ "$verdict" = ok ] || status=1
    printf '%-8s %-6s %4s %12.2f %12.2f %8.3f %6s %s\n' "$bs" "$rw" "$qd" \
      "$(awk -v v="$f" 'BEGIN {print v / 1e9}')" "$(awk -v v="$s" 'BEGIN {print v / 1e9}')" "$r" "$bar" "$verdict"
  done
done
echo "ratios are medians of $rounds alternating rounds (strata/fio), size $size bytes, dir $dir"
rm -f "$file" "$file.laidout" "$dir/strata-bench.laidout" 2>/dev/null || true
if [ "${CHECK:-0}" = 1 ]; then exit $status; fi
