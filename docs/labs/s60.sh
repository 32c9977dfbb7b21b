#!/usr/bin/env bash
# docs/labs/s60.sh (carry ["bundle-gpu"]; `cargo xtask gpu-bundle --no-fixtures --out
# bundle-gpu` of main): f145163 and later on a GPU, best an H200 (the target table's GPU). The
# GPU suite; the bench's MLA rows, read rows and Q4_K rows twice; ncu's memory sections of one
# launch of a 64 MiB read (grid sweep, then block stretches) and of the Q4_K rows whose H100
# figures are in the fifty-eighth and fifty-ninth looks. ~300 s.
set -uo pipefail
b=bundle-gpu; [ -x $b/bin/xtask ] || tar -xzf $b/bin.tar.gz -C $b
out=${OUT:-/tmp/out}; mkdir -p "$out"; x=$b/bin/xtask
export MLA_CUBIN_CACHE=/tmp/cubin
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
head -n 1 $b/bin/builds
t0=$SECONDS
OUT=$out/tests bash $b/run.sh tests >"$out/tests.log" 2>&1
grep -E "FAIL|Summary" "$out/tests.log" | tail -n 4
echo "-- tests $((SECONDS - t0)) s"
for r in 1 2; do
  $x bench --filter "copy,mla_decode,read ,matvec q4_k,moe q4_k" >"$out/rows-$r.log" 2>&1
  echo "== rows r$r"; grep -E "copy|mla_decode|read |q4_k" "$out/rows-$r.log" | cut -c10-110
done
# The filter splits at commas; --quick runs a row's launch twice, so skip 1 takes the first
# row's second launch and skip 3 the second row's.
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats"
i=0
for probe in "1|read 64 MiB" "3|read 64 MiB" "1|matvec q4_k ds3.ffn_up" "1|matvec q4_k ds3.attn_output" \
  "1|matvec q4_k glm5.ffn_down" "1|moe q4_k ds3" "1|moe q4_k glm5"; do
  i=$((i + 1)); skip=${probe%%|*}; row=${probe#*|}
  ncu --clock-control none -k 'regex:^(read_bytes|matvec_.*q4_k)$' --launch-skip $skip --launch-count 1 \
    $sections $x bench --quick --filter "$row" >"$out/ncu-$i.txt" 2>&1
  echo "== ncu $row (launch $((skip + 1)))"
  grep -E "^  [a-z_0-9]+\(|Duration|DRAM Throughput|L2 Hit Rate|Warp Cycles Per Issued|Achieved Occupancy" \
    "$out/ncu-$i.txt" | awk '{$1=$1; print}' | paste -s -d'|' | cut -c1-400
done
cd $out && tar czf /tmp/all.tgz . && mv /tmp/all.tgz . && ls | wc -l
