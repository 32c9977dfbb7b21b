#!/usr/bin/env bash
# docs/labs/s59.sh (carry ["bundle-gpu"]): on a bundle of main + s59.patch, whose default path
# is main's; MLA_LAB_BK32=1 switches the lab on. The DSA, MLA and forward GPU tests (lab off,
# then the MLA ones on), the bench's MLA and indexer rows off / on (2 rounds), ncu of the GLM-5
# file's own top-k after 16K / 24K positions, decode of both files after 8192 positions off / on.
set -uo pipefail
b=bundle-gpu; [ -x $b/bin/xtask ] || tar -xzf $b/bin.tar.gz -C $b
out=${OUT:-/tmp/out}; mkdir -p "$out"; x=$b/bin/xtask
export MLA_CUBIN_CACHE=/tmp/cubin
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
head -n 1 $b/bin/builds
( $x synth --arch glm-dsa --layers 4 --quant q4_k /tmp/glm5.gguf >/dev/null 2>&1
  $x synth --arch deepseek2 --layers 4 --quant q4_k /tmp/ds3.gguf >/dev/null 2>&1; touch /tmp/synth.done ) &
t0=$SECONDS
TEST_FILTER='binary(cuda_forward) | test(/dsa|topk|mla|attention|decode/)' OUT=$out/tests bash $b/run.sh tests >"$out/tests.log" 2>&1
grep -E "FAIL|Summary" "$out/tests.log" | tail -n 4
MLA_LAB_BK32=1 TEST_FILTER='test(/mla|attention|decode/)' OUT=$out/tests-lab bash $b/run.sh tests >"$out/tests-lab.log" 2>&1
grep -E "FAIL|Summary" "$out/tests-lab.log" | tail -n 4
echo "-- tests $((SECONDS - t0)) s"
for r in 1 2; do for v in 0 1; do
  MLA_LAB_BK32=$v $x bench --filter "copy,mla_decode,dsa_indexer" >"$out/mla-$v-$r.log" 2>&1
  echo "== bk32=$v r$r"; grep -E "mla_decode|dsa_" "$out/mla-$v-$r.log" | awk '{$1=""; print}' | cut -c1-90
done; done
while [ ! -e /tmp/synth.done ]; do sleep 2; done
for ctx in 16384 24576; do
  ncu --clock-control none --profile-from-start off -k 'regex:^topk_rows' --metrics gpu__time_duration.sum $x bench --profile-token --profile-context $ctx --model /tmp/glm5.gguf >"$out/ncu-topk-$ctx.txt" 2>&1
  echo "== topk $ctx"; grep -E "^  topk_rows|gpu__time_duration" "$out/ncu-topk-$ctx.txt" | awk '{print $1, $NF}' | paste -s -d' '
done
for r in 1 2; do for v in 0 1; do for m in glm5 ds3; do
  MLA_LAB_BK32=$v $x bench --skip-kernels --model /tmp/$m.gguf --prefill 0 --tokens 64 --long-context 8192 >"$out/dec-$m-$v-$r.log" 2>&1
  echo "== $m bk32=$v r$r"; grep -E "decode" "$out/dec-$m-$v-$r.log" | awk '{$1=""; print}' | cut -c1-110
done; done; done
cd $out && tar czf /tmp/all.tgz . && mv /tmp/all.tgz . && ls | wc -l
