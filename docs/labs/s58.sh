#!/usr/bin/env bash
# docs/labs/s58.sh PHASE...  (carry ["bundle-gpu"]): on a bundle of main + s58.patch, whose
# default path is main's; MLA_LAB_Q4K4=1 / MLA_LAB_TOPK_HOME=1 switch the two labs on.
#   tests  GPU suite as shipped (main's code), then the labs on (matvec, moe, dsa, forward)
#   rows   the read rows, Q4_K matvec and MoE rows and the DSA indexer rows, both labs off /
#          on alternating (Q4K4 moves only the Q4_K rows, TOPK_HOME only the indexer's 32K
#          row, the one on a cluster), 2 rounds
#   l2     the Q4_K rows over L2, off/on
#   ncu    ncu memory sections of read_bytes, ffn_up and MoE Q4_K launches, and of MLA
#          decode's split kernels (DS3 and one TP-8 rank at 8K) (as shipped)
#   synth  the GLM-5 and DS3 files, in the background (decode and topk wait)
#   decode both files' decode/prefill, Q4K4 off/on, 2 rounds
#   topk   ncu of the GLM-5 file's own top-k after 16384 / 24576 positions, HOME off/on;
#          decode after 24576 positions, HOME off/on, 2 rounds
set -uo pipefail
b=bundle-gpu
[ -x $b/bin/xtask ] || tar -xzf $b/bin.tar.gz -C $b
out=${OUT:-/tmp/out}; mkdir -p "$out"
x=$b/bin/xtask
export MLA_CUBIN_CACHE=/tmp/cubin
sf=/tmp/mla-bench; mkdir -p $sf
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
head -n 1 $b/bin/builds
wait_synth() { while [ -e $sf/running ]; do sleep 2; done; }
for p in "$@"; do
  t0=$SECONDS
  case $p in
  tests)
    OUT=$out/tests bash $b/run.sh tests >"$out/tests.log" 2>&1
    grep -E "FAIL|Summary" "$out/tests.log" | tail -n 6
    MLA_LAB_Q4K4=1 MLA_LAB_TOPK_HOME=1 TEST_FILTER='binary(cuda_forward) | test(/matvec|moe|dsa/)' \
      OUT=$out/tests-lab bash $b/run.sh tests >"$out/tests-lab.log" 2>&1
    grep -E "FAIL|Summary" "$out/tests-lab.log" | tail -n 6 ;;
  rows)
    for r in 1 2; do for v in 0 1; do
      MLA_LAB_Q4K4=$v MLA_LAB_TOPK_HOME=$v $x bench --filter "read ,matvec q4_k,moe q4_k,dsa_indexer" --json "$out/rows-$v-$r.json" >"$out/rows-$v-$r.log" 2>&1
      echo "== rows labs=$v round $r"; grep -E "copy|read 64|read 128|ds3.ffn_up|moe|dsa" "$out/rows-$v-$r.log" | head -n 14
    done; done ;;
  l2)
    for v in 0 1; do
      MLA_LAB_Q4K4=$v $x bench --l2 --filter "matvec q4_k,moe q4_k" --json "$out/l2-$v.json" >"$out/l2-$v.log" 2>&1
      echo "== l2 q4k4=$v"; grep -E "ffn_up|moe" "$out/l2-$v.log" | head -n 6
    done ;;
  ncu)
    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables \
      --metrics dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \
      -k 'regex:^(read_bytes|matvec_tma_q4_k|matvec_tma_items_q4_k)$' \
      $x bench --quick --filter "read 64,read 128,matvec q4_k ds3.ffn_up,moe q4_k ds3" >"$out/ncu-mem.txt" 2>&1
    echo "ncu exit $?"; grep -E "^  [a-z_]+|Duration|DRAM Throughput|dram__|L2 Hit Rate " "$out/ncu-mem.txt" | head -n 70
    # MLA decode's split kernels: shared-memory wavefronts and the tensor pipe beside time
    # (the code's counts put a key tile's shared reads and writes near or above its mma time).
    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum \
      -k 'regex:^mla_decode_split' \
      $x bench --quick --filter "mla_decode ds3 8K,mla_decode ds3 tp8 rank 8K" >"$out/ncu-mla.txt" 2>&1
    echo "ncu mla exit $?"; grep -E "^  mla|Duration|wavefronts_mem_shared|bank_conflicts|hmma|Shared Memory|Stall" "$out/ncu-mla.txt" | head -n 40 ;;
  synth)
    ( touch $sf/running
      for m in glm5 ds3; do
        [ -e $sf/$m.gguf ] && continue
        arch=glm-dsa; [ $m = ds3 ] && arch=deepseek2
        nice -n 19 $x synth --arch $arch --layers 4 --quant q4_k $sf/$m.part >$out/synth-$m.log 2>&1 && mv $sf/$m.part $sf/$m.gguf
      done
      rm -f $sf/running ) & ;;
  decode)
    wait_synth
    for r in 1 2; do for v in 0 1; do for m in glm5 ds3; do
      MLA_LAB_Q4K4=$v $x bench --skip-kernels --model $sf/$m.gguf --prefill 512 --tokens 32 \
        --json "$out/dec-$m-$v-$r.json" >"$out/dec-$m-$v-$r.log" 2>&1
      echo "== $m q4k4=$v round $r"; grep -E "decode|prefill" "$out/dec-$m-$v-$r.log" | head -n 4
    done; done; done ;;
  topk)
    wait_synth
    for ctx in 16384 24576; do for v in 0 1; do
      MLA_LAB_TOPK_HOME=$v ncu --clock-control none --profile-from-start off -k 'regex:^topk_rows' \
        --metrics gpu__time_duration.sum $x bench --profile-token --profile-context $ctx \
        --model $sf/glm5.gguf >"$out/ncu-topk-$ctx-$v.txt" 2>&1
      echo "== topk ctx $ctx home=$v"; grep -E "^  topk_rows|gpu__time_duration" "$out/ncu-topk-$ctx-$v.txt" | awk '{print $1, $NF}' | paste -s -d' ' 
    done; done
    for r in 1 2; do for v in 0 1; do
      MLA_LAB_TOPK_HOME=$v $x bench --skip-kernels --model $sf/glm5.gguf --prefill 0 --tokens 96 \
        --long-context 24576 --json "$out/dec24k-$v-$r.json" >"$out/dec24k-$v-$r.log" 2>&1
      echo "== glm5 24576 home=$v round $r"; grep -E "decode" "$out/dec24k-$v-$r.log" | head -n 3
    done; done ;;
  esac
  echo "-- $p: $((SECONDS - t0)) s"
done
wait_synth
