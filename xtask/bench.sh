#!/usr/bin/env bash
# Runs mla-engine's benchmark (issue 9) on a GPU host without Rust, from the GPU bundle
# (`cargo xtask gpu-bundle` puts this script beside run.sh and the `xtask` binary in bin/).
#
#   bench.sh [MODEL...]     MODEL: glm5 (4 layers, GLM-5 shapes, Q4_K) and/or ds3 (4 layers,
#                           DeepSeek-V3 shapes, Q4_K); default: glm5 ds3
#
# 1. writes the synthetic files with `xtask synth` (in the background, niced, on local disk),
# 2. measures the ceilings and every decode / prefill kernel meanwhile (kernels.json),
# 3. times whole-model decode and prefill, one process per file: first with MLA_PDL=0 (kernels
#    launched one after the other, model-NAME-no-pdl.json), then as shipped (model-NAME.json),
# 4. the chain clock: each launch's share of a decode step as the steps run back to back,
#    short and after 4096 positions (chain-MODEL.json),
# 5. ncu: one decode token of the first model (launches and kernel time per token,
#    ncu-token.csv), one 512-token prefill of each (ncu-prefill-MODEL.csv) and the main decode
#    and prefill kernels (ncu-kernels.txt).
# Everything printed goes to bench.log. Results under $OUT (the device tool's folder), else ./out;
# the synthetic files under $BENCH_WORK (default /tmp/mla-bench).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
work=${BENCH_WORK:-/tmp/mla-bench}
mkdir -p "$out" "$work"
export MLA_CUBIN_CACHE=${MLA_CUBIN_CACHE:-/tmp/mla-cubin}
[ -x "$here/bin/xtask" ] || tar -xzf "$here/bin.tar.gz" -C "$here"
x="$here/bin/xtask"

main() {
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit \
    --format=csv
  nproc; df -h "$work" | tail -1

  models=${*:-glm5 ds3}
  synth_args() {
    case $1 in
      glm5) echo "--arch glm-dsa --layers 4 --quant q4_k" ;;
      ds3) echo "--arch deepseek2 --layers 4 --quant q4_k" ;;
      *) echo "unknown model $1" >&2; return 1 ;;
    esac
  }
  (
    for m in $models; do
      [ -e "$work/$m.gguf" ] && { echo "$m.gguf: already there"; continue; }
      t0=$SECONDS
      nice -n 19 "$x" synth $(synth_args "$m") "$work/$m.gguf" 2>&1 | tail -n 2
      echo "synth $m: $((SECONDS - t0)) s, done at $(date -u +%T)"
    done
  ) >"$work/synth.log" 2>&1 &
  synth=$!

  echo "== kernels"
  "$x" bench --json "$out/kernels.json"

  echo "== torch bf16 matmul (cuBLAS, for reference)"
  python3 - <<'EOF' || true
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3): a @ b
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ts = []
for _ in range(9):
    s.record(); a @ b; e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
ts.sort()
print(f"torch bf16 8192^3: {2 * 8192**3 / (ts[4] * 1e-3) / 1e12:.0f} TFLOP/s (median of 9)")
EOF

  wait $synth
  echo "== synth"
  cat "$work/synth.log"

  for m in $models; do
    echo "== model $m without programmatic dependent launch (MLA_PDL=0)"
    MLA_PDL=0 "$x" bench --skip-kernels --model "$work/$m.gguf" --json "$out/model-$m-no-pdl.json"
    echo "== model $m"
    "$x" bench --skip-kernels --model "$work/$m.gguf" --json "$out/model-$m.json"
  done

  for m in $models; do
    echo "== chain clock: $m decode, short and after 4096 positions, what each launch adds"
    "$x" bench --chain-clock --tokens 16 --model "$work/$m.gguf" --json "$out/chain-$m.json"
  done

  first=${models%% *}
  echo "== ncu: one decode token of $first"
  ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
    "$x" bench --profile-token --model "$work/$first.gguf" >"$out/ncu-token.csv" 2>"$work/ncu-token.err"
  echo "ncu token: exit $?, $(grep -c '"gpu__time_duration.sum"' "$out/ncu-token.csv") kernel launches"
  tail -n 3 "$work/ncu-token.err"

  profiles=ncu-token
  for m in $models; do
    echo "== ncu: one 512-token prefill of $m"
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      "$x" bench --profile-prefill 512 --model "$work/$m.gguf" >"$out/ncu-prefill-$m.csv" 2>"$work/ncu-prefill-$m.err"
    echo "ncu prefill $m: exit $?"
    profiles="$profiles ncu-prefill-$m"
  done
  for f in $profiles; do
    echo "-- $f: device time per kernel"
    python3 - "$out/$f.csv" <<'EOF'
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14 and r[12] == "gpu__time_duration.sum"]
total, count = collections.Counter(), collections.Counter()
for r in rows:
    total[r[4]] += float(r[14].replace(",", "")) * {"ns": 1e-3, "us": 1, "ms": 1e3}.get(r[13], 1)
    count[r[4]] += 1
print(f"{sum(total.values()):.1f} us in {sum(count.values())} launches")
for name, us in total.most_common(12):
    print(f"{us:10.1f} us {count[name]:5d}  {name}")
EOF
  done

  echo "== ncu: decode and prefill kernels"
  sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
    --section LaunchStats --section WarpStateStats --section SchedulerStats"
  # read_bytes: launches that only read 64 MiB (the grid sweeping, a block a stretch) beside the products.
  ncu --clock-control none -k 'regex:^(matvec_tma_q4_k|matvec_tc_q4_k|matvec_tc8_q4_k|matvec_q4_k|mla_decode_split|matmul_cp_q4_k|read_bytes)$' \
    --launch-count 12 $sections \
    "$x" bench --quick --filter 'read 64 MiB,matvec q4_k ds3.ffn_up,matvec q4_k ds3.kv_a,mla_decode ds3 8K,matmul q4_k ds3.ffn_up 2048x' \
    >"$out/ncu-kernels.txt" 2>&1
  echo "ncu kernels: exit $?"
  # The grouped MoE product of a real prefill (its spans come from the routing).
  ncu --clock-control none --profile-from-start off -k 'regex:^matmul_cp_spans' --launch-count 1 \
    $sections --section InstructionStats --section ComputeWorkloadAnalysis \
    "$x" bench --profile-prefill 512 --model "$work/$first.gguf" >>"$out/ncu-kernels.txt" 2>&1
  echo "ncu grouped prefill product: exit $?"
  date -u +%FT%TZ
}

main "$@" 2>&1 | tee "$out/bench.log"
