#!/usr/bin/env bash
# docs/labs/s60.sh PHASE... (carry ["bundle-gpu"]; a bundle of main + docs/labs/s60.patch,
# whose default path is main's; MLA_LAB_K4=1 puts Q4_K's and Q5_K's bulk-copy kernels on a
# ring of 4 stages on sm_90). Best on an H200: the ring of 4 was timed only on an H100
# (fifty-eighth look), where the H200's dense and MoE rows lose 10-20% of copy more.
#   tests   the GPU suite as shipped (main's code: f145163 and later), then the matvec, MoE and
#           forward tests with the lab on (~150 s)
#   rows    the MLA, read, Q4_K and Q5_K rows, lab off / on, two rounds (~150 s)
#   decode  both synthetic files (written in the background from the first phase on), lab off /
#           on, two rounds (~150 s)
#   ncu     ncu's memory sections of one launch each: a 64 MiB read (grid sweep, block
#           stretches) and the Q4_K launches of the fifty-eighth and fifty-ninth looks, lab off
#           (~120 s)
# One call takes `tests rows decode`, a second `ncu`.
set -uo pipefail
b=bundle-gpu; [ -x $b/bin/xtask ] || tar -xzf $b/bin.tar.gz -C $b
out=${OUT:-/tmp/out}; mkdir -p "$out"; x=$b/bin/xtask
export MLA_CUBIN_CACHE=/tmp/cubin
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
head -n 1 $b/bin/builds
if [ ! -e /tmp/synth.started ]; then
  touch /tmp/synth.started
  ( nice -n 19 $x synth --arch glm-dsa --layers 4 --quant q4_k /tmp/glm5.gguf >/dev/null 2>&1
    nice -n 19 $x synth --arch deepseek2 --layers 4 --quant q4_k /tmp/ds3.gguf >/dev/null 2>&1
    touch /tmp/synth.done ) &
fi
for p in "$@"; do
  t0=$SECONDS
  case $p in
  tests)
    OUT=$out/tests bash $b/run.sh tests >"$out/tests.log" 2>&1
    grep -E "FAIL|Summary" "$out/tests.log" | tail -n 4
    MLA_LAB_K4=1 TEST_FILTER='binary(cuda_forward) | test(/matvec|moe/)' OUT=$out/tests-lab \
      bash $b/run.sh tests >"$out/tests-lab.log" 2>&1
    grep -E "FAIL|Summary" "$out/tests-lab.log" | tail -n 4 ;;
  rows)
    for r in 1 2; do for v in 0 1; do
      MLA_LAB_K4=$v $x bench --filter "copy,mla_decode,read ,matvec q4_k,moe q4_k,matvec q5_k,moe q5_k" \
        --json "$out/rows-$v-$r.json" >"$out/rows-$v-$r.log" 2>&1
      echo "== rows k4=$v r$r"; grep -E "copy|mla_decode|read |q4_k|q5_k" "$out/rows-$v-$r.log" | cut -c10-100
    done; done ;;
  decode)
    while [ ! -e /tmp/synth.done ]; do sleep 2; done
    echo "(synth waited for: $((SECONDS - t0)) s)"
    for r in 1 2; do for v in 0 1; do for m in glm5 ds3; do
      MLA_LAB_K4=$v $x bench --skip-kernels --model /tmp/$m.gguf --prefill 512 --tokens 32 \
        >"$out/dec-$m-$v-$r.log" 2>&1
      echo "== $m k4=$v r$r"; grep -E "decode|prefill" "$out/dec-$m-$v-$r.log" | awk '{$1=""; print}' | cut -c1-110
    done; done; done ;;
  ncu)
    # The filter splits at commas; --quick runs a row's launch twice, so skip 1 takes the
    # first row's second launch and skip 3 the second row's.
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
    done ;;
  esac
  echo "-- $p: $((SECONDS - t0)) s"
done
cd $out && tar czf /tmp/all.tgz . && mv /tmp/all.tgz . && ls | wc -l
