#!/usr/bin/env bash
# Runs mla-engine's GPU checks on a host with NVIDIA GPUs and no Rust toolchain, from the folder
# `cargo xtask gpu-bundle` writes (this script is its run.sh).
#
#   run.sh [PHASE...]    default: tests golden tp
#     tests   the nextest archive: cuda_kernels, cuda_forward, nvrtc_compile, tp_nccl
#             (TEST_FILTER: a nextest filter instead, e.g. 'binary(tp_nccl)')
#     golden  `generate --backend cuda` against `--backend cpu` on every golden file: the
#             prefill traces with `generate diff`, and the greedy text
#     tp      `generate --backend cuda --tp 2` against `--tp 1` on every golden file (2 GPUs)
#     synth   writes the synthetic full-width GLM-5 and DeepSeek-V3 files (4 layers, Q4_K)
#     tp-synth  TP=2 against TP=1 on the synthetic GLM-5 file: trace diff, decode tokens/s and
#             all-reduce time per token (MLA_TP_TIMING=1)
#     bench   bench.sh on the synthetic files (issue 9)
#     ab      this build's whole-model decode and prefill beside each baseline's (gpu-bundle
#             --baseline REV), on the synthetic files, the builds alternating AB_ROUNDS times
#             (default 2; ABBA order); AB_CONTEXT (default 4096): decode also after a prompt that long (0:
#             not). A table of every build's range at the end (ab.log), the JSON in $WORK/ab;
#             then this build's GLM-5 decode on the chain clock (bench --chain-clock)
#
# synth runs in the background from the start (tp-synth and bench wait for it). Each phase's
# log goes to $WORK/NAME.log (WORK default /tmp/mla-gpu) and to stdout; at the end the logs and
# the bench's JSON are packed into $OUT/results.tar.gz ($OUT: the device tool's folder, else
# ./out). Every phase is killed MLA_LIMIT seconds (default 560) after the start, so the pack
# happens inside a caller's time limit. MAX_TOKENS (default 24) greedy tokens per generate.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
work=${WORK:-/tmp/mla-gpu}
limit=${MLA_LIMIT:-560}
max_tokens=${MAX_TOKENS:-24}
mkdir -p "$out" "$work"
export MLA_CUBIN_CACHE=${MLA_CUBIN_CACHE:-$work/cubin}
export NCCL_NVLS_ENABLE=0 # never NVLink multicast on shared hosts
[ -x "$here/bin/generate" ] || tar -xzf "$here/bin.tar.gz" -C "$here"
bin=$here/bin

# The test binaries read the golden fixtures at the build machine's workspace path. Take the
# bundle's copy, or the checkout the bundle sits in when it was built with --no-fixtures.
src=$here/workspace
[ -e "$src/golden/manifest.json" ] || src=$(cd "$here/.." && pwd)
ws="@WORKSPACE@"
if [ ! -e "$ws/golden/manifest.json" ]; then
  mkdir -p "$(dirname "$ws")"
  ln -sfn "$src" "$ws"
fi

# cudarc opens libnccl.so; the NCCL wheels and some distributions ship only libnccl.so.2.
if ! ldconfig -p | grep -q 'libnccl\.so '; then
  nccl=$(find /usr /opt -name 'libnccl.so.2' 2>/dev/null | head -n 1)
  if [ -n "$nccl" ]; then
    mkdir -p "$here/lib" && ln -sfn "$nccl" "$here/lib/libnccl.so"
    export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi

# Short enough (under 16 tokens) that the CUDA backend runs every product in f32 matrix-vector
# kernels: the traces then agree to f32 summation order (1e-4); cuda_forward covers the bf16
# tensor-core path of longer prompts.
prompt="In the beginning God created"
golden_files() {
  for f in ds3.f32 ds3.q8_0 ds3.q4_k_m ds3.mix ds3.legacy-q8_0 glm5.q8_0 \
    v2lite.q8_0-00001-of-00003 story.q8_0; do
    echo "$ws/golden/models/$f.gguf"
  done
}

# gen NAME MODEL ARGS...: greedy text to $work/NAME.txt, the prefill trace to $work/NAME.st.
gen() {
  local name=$1 model=$2
  shift 2
  timeout 120 "$bin/generate" --model "$model" --prompt "$prompt" --max-tokens "$max_tokens" \
    --trace "$work/$name.st" "$@" >"$work/$name.txt" 2>"$work/$name.err"
  local rc=$?
  tail -n 3 "$work/$name.err"
  return $rc
}

# same A B: the two runs' prefill traces stage by stage, and their greedy text.
same() {
  "$bin/generate" diff "$work/$1.st" "$work/$2.st" --threshold 1e-4 >"$work/$1-vs-$2.diff"
  echo "diff exit $?: $(grep -E '^logits ' "$work/$1-vs-$2.diff" | tr -s ' ') | $(tail -n 1 "$work/$1-vs-$2.diff")"
  awk '{for (i = 2; i <= NF; i++) if ($i ~ /^[0-9.]+e[-+]?[0-9]+$/ && $i + 0 >= m) {m = $i + 0; w = $1}}
    END {printf "worst stage %s %.3e\n", w, m}' "$work/$1-vs-$2.diff"
  if cmp -s "$work/$1.txt" "$work/$2.txt"; then
    echo "greedy text identical: $(head -c 160 "$work/$1.txt")"
  else
    echo "greedy text differs:"; echo "  $1: $(head -c 160 "$work/$1.txt")"
    echo "  $2: $(head -c 160 "$work/$2.txt")"
  fi
}

phase_tests() {
  local filter="${TEST_FILTER:-@FILTER@}"
  timeout 300 "$bin/cargo-nextest" nextest run --archive-file "$here/tests.tar.zst" \
    --workspace-remap "$src" -E "$filter" --no-fail-fast \
    --success-output final --failure-output final
}

phase_golden() {
  for m in $(golden_files); do
    n=$(basename "$m" .gguf)
    echo "-- $n"
    gen "$n.cpu" "$m" --backend cpu && gen "$n.cuda" "$m" --backend cuda && same "$n.cuda" "$n.cpu"
  done
}

phase_tp() {
  for m in $(golden_files); do
    n=$(basename "$m" .gguf)
    echo "-- $n"
    [ -e "$work/$n.cuda.st" ] || gen "$n.cuda" "$m" --backend cuda
    gen "$n.tp2" "$m" --backend cuda --tp 2 && same "$n.tp2" "$n.cuda"
  done
}

synth_file() { echo "${BENCH_WORK:-/tmp/mla-bench}/$1.gguf"; }

wait_synth() {
  while [ -e "$work/synth.running" ]; do sleep 2; done
}

phase_synth() {
  mkdir -p "$(dirname "$(synth_file glm5)")"
  for m in glm5 ds3; do
    [ -e "$(synth_file $m)" ] && continue
    arch=glm-dsa; [ $m = ds3 ] && arch=deepseek2
    t0=$SECONDS
    "$bin/xtask" synth --arch $arch --layers 4 --quant q4_k "$(synth_file $m).part" 2>&1 | tail -n 2 &&
      mv "$(synth_file $m).part" "$(synth_file $m)"
    echo "synth $m: $((SECONDS - t0)) s"
  done
}

phase_tp_synth() {
  # Words of the synthetic vocabulary: 9 tokens, the f32 path, so TP=2 must match TP=1 to
  # f32 reordering. (A 17-token prompt takes the bf16 path, where a 1e-5 difference flips
  # bf16 roundings and random weights amplify them layer after layer.)
  local m prompt="And God said let there be light" max_tokens=64
  wait_synth
  m=$(synth_file glm5)
  [ -e "$m" ] || { echo "no $m (phase synth)"; return 1; }
  gen synth.tp1 "$m" --backend cuda
  MLA_TP_TIMING=1 gen synth.tp2.timed "$m" --backend cuda --tp 2
  gen synth.tp2 "$m" --backend cuda --tp 2 && same synth.tp2 synth.tp1
}

phase_bench() {
  wait_synth
  OUT=$work/bench BENCH_WORK=$(dirname "$(synth_file glm5)") timeout 400 bash "$here/bench.sh"
}

phase_ab() {
  local m r file rev order rounds=${AB_ROUNDS:-2}
  [ "$(wc -l <"$bin/builds")" -gt 1 ] || { echo "no baseline in this bundle (gpu-bundle --baseline REV)"; return 1; }
  wait_synth
  mkdir -p "$work/ab"
  for m in glm5 ds3; do
    [ -e "$(synth_file $m)" ] || { echo "no $(synth_file $m) (phase synth)"; continue; }
    for r in $(seq "$rounds"); do
      # The builds in turn, the order reversed every other round (ABBA...): a drift of the
      # GPU's clocks over the call then weighs on every build alike.
      order=cat; [ $((r % 2)) = 0 ] && order=tac
      $order "$bin/builds" | while read -r file rev; do
        echo "-- $m, round $r, $rev"
        "$bin/$file" bench --skip-kernels --long-context "${AB_CONTEXT:-4096}" \
          --model "$(synth_file $m)" --json "$work/ab/$m.$rev.$r.json"
      done
    done
  done
  # Per model and row, each build's tokens/s over the rounds (min-max) and its share of the
  # bandwidth bound; the builds in bin/builds' order (this build first).
  python3 - "$work/ab" "$bin/builds" <<'EOF'
import collections, glob, json, os, sys
revs = [line.split()[1] for line in open(sys.argv[2]) if line.strip()]
runs = collections.defaultdict(list)  # (model, row, rev) -> [(tok_s, of_copy)]
for path in glob.glob(os.path.join(sys.argv[1], "*.json")):
    model, rev = os.path.basename(path).split(".")[:2]
    for row in json.load(open(path))["rows"]:
        if row.get("section") != "model" or "tok_s" not in row:
            continue  # the ceilings, or a model that failed
        name = row["name"].replace(f" {model}.gguf", "")
        runs[model, name, rev].append((row["tok_s"], row.get("of_copy")))
        if "host_us" in row:  # the host's time to queue a step: near the step, it sets the pace
            runs[model, name + ", host us", rev].append((row["host_us"], None))
for model in sorted({k[0] for k in runs}):
    print(f"\n{model}: tokens/s, min-max over the rounds (of the bandwidth bound)")
    print(f"{'':34}" + "".join(f"{r:>32}" for r in revs))
    for name in sorted({k[1] for k in runs if k[0] == model}):
        cells = []
        for r in revs:
            v = runs.get((model, name, r), [])
            t = [x[0] for x in v]
            c = [x[1] for x in v if x[1] is not None]
            cell = f"{min(t):,.1f}-{max(t):,.1f}" if t else "-"
            if c:
                cell += f" ({100 * min(c):.1f}-{100 * max(c):.1f}%)"
            cells.append(f"{cell:>32}")
        print(f"{name:34}" + "".join(cells))
EOF
  echo "-- this build's decode steps on the chain clock (glm5)"
  "$bin/xtask" bench --chain-clock --tokens 16 --long-context "${AB_CONTEXT:-4096}" \
    --model "$(synth_file glm5)" --json "$work/chain-glm5.json"
}

if [ "${1:-}" = --phase ]; then
  "phase_${2//-/_}"
  exit
fi

start=$SECONDS
{ nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } 2>&1 |
  tee "$work/gpu.log" | tail -n 4
phases=${*:-tests golden tp}
if [[ " $phases " == *" synth "* ]]; then
  touch "$work/synth.running"
  (nice -n 19 "$0" --phase synth >"$work/synth.log" 2>&1; rm -f "$work/synth.running") &
fi
for p in $phases; do
  [ "$p" = synth ] && continue
  left=$((limit - (SECONDS - start)))
  if [ "$left" -le 10 ]; then
    echo "== $p: not run, past the ${limit} s limit" | tee -a "$work/skipped.log"
    continue
  fi
  echo "== $p ($((SECONDS - start)) s)"
  t0=$SECONDS
  timeout "$left" "$0" --phase "$p" 2>&1 | tee "$work/$p.log"
  echo "== $p: exit ${PIPESTATUS[0]}, $((SECONDS - t0)) s"
done
[ -e "$work/synth.log" ] && tail -n 6 "$work/synth.log"
tar -czf "$out/results.tar.gz" -C "$work" --exclude='*.st' --exclude=cubin --exclude='*.gguf' . 2>/dev/null
echo "results: $out/results.tar.gz ($((SECONDS - start)) s in all)"
