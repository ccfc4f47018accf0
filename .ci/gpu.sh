#!/usr/bin/env bash
# The GPU checks of the `small` preset, in one call of at most 10 minutes on one NVIDIA GPU:
#   1. the small preset on real code: XL alone and memory + XL, bf16, side by side on the one card,
#      each stopped at a deadline (a checkpoint is saved), then scored: perplexity with the
#      memory-off ablation and the bands, and the memory-size curve;
#   2. benchmark.py, paper preset, bf16, batch 32, paired rounds: the ratios, MFU and recall;
#   3. the model's and the kernels' tests on the GPU.
# The corpus: the sdists of docs/results.md's Python packages (bring them as .gpu/sdists, an ignored
# folder of the working tree, and carry it) and the running Python's standard library.
# SMOKE=1 shrinks everything for a dry run on a CPU. Every log goes to $OUT.
set -u
[ -f train.py ] || { echo "run from the project root"; exit 1; }
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
O=${OUT:-$(mktemp -d)}; W=$(mktemp -d); mkdir -p "$O"
PY=${PY:-python3}
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$O/timeline.log"; }
if [ "${SMOKE:-0}" = 1 ]; then
  PRESET="--preset tiny --batch-size 2 --eval-docs 1 --eval-tokens 512"; TRAIN_S=60
  BENCH="--preset tiny --batch-size 2 --memory-sizes 0,1024 --timed-steps 1"; SIZES=512,1024
  TESTS="test_memorizing_transformer.py -k t5_buckets"; PACKAGES=6; STDLIB=json
else
  PRESET="--preset small --dtype bfloat16 --eval-docs 4 --eval-tokens 65536"; TRAIN_S=240
  BENCH="--preset paper --batch-size 32 --dtype bfloat16 --timed-steps 3 --train-only"
  BENCH="$BENCH --attention fused --rounds 5 --compile-jobs 3 --memory-sizes 0,8192,65536"
  SIZES=2048,8192,65536; TESTS="test_memorizing_transformer.py test_kernels.py"; PACKAGES=99
  STDLIB=.
fi
nvidia-smi -L 2>/dev/null; $PY -c "import jax; print('jax', jax.__version__, jax.devices())"

el "in parallel: the corpus's tokens (CPU) and the benchmark (GPU)"
prep() {  # the packages' Python files and the standard library, tokenized once for both runs
  mkdir -p "$W/code"
  for f in $(ls .gpu/sdists/*.tar.gz 2>/dev/null | head -n $PACKAGES); do tar -xzf "$f" -C "$W/code"; done
  cp -r "$($PY -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/$STDLIB" \
    "$W/code/stdlib"
  $PY train.py $PRESET $DATA --steps 1 --memory-size 0 --eval-every 0 --out "$W/prep" \
    > "$O/prep.log" 2>&1; echo "prep rc $?" >> "$O/prep.log"
}
DATA="--data $W/code --data-format repo --suffixes .py --cache-dir $W/cache"
prep &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 240 $PY benchmark.py $BENCH --json "$O/bench.json" \
  > "$O/bench.log" 2>&1; echo "bench rc $?" >> "$O/bench.log"
wait; grep -E "^run|note|rc" "$O/prep.log"

el "in parallel: XL and memory + XL to the deadline, then scored; the tests"
run() {  # name, flags...: train until the deadline (SIGTERM saves a checkpoint), then score it
  local name=$1; shift
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout -s TERM $TRAIN_S $PY train.py $PRESET $DATA \
    --steps 20000 --eval-every 0 --save-every 1000 --out "$W/$name" "$@" > "$O/$name.log" 2>&1
  echo "train rc $?" >> "$O/$name.log"
  $PY evaluate.py perplexity "$W/$name" --json "$O/$name.ppl.json" >> "$O/$name.log" 2>&1
  if [ "$name" = memory ]; then
    $PY evaluate.py curve "$W/$name" --memory-sizes $SIZES --json "$O/$name.curve.json" \
      >> "$O/$name.log" 2>&1
  fi
  tail -n 3 "$W/$name/metrics.jsonl" > "$O/$name.metrics.tail" 2>/dev/null
}
tests() {
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout $TRAIN_S $PY -m pytest -q -p no:cacheprovider \
    -n 2 $TESTS > "$O/pytest.log" 2>&1; echo "pytest rc $?" >> "$O/pytest.log"
}
run xl --memory-size 0 & run memory & tests & wait
el "done"
for f in xl memory; do echo "== $f"; grep -E "^run|^step|^eval|^error|rc|^memory|^ +[0-9]+ " "$O/$f.log" | tail -12; done
tail -8 "$O/bench.log"; tail -3 "$O/pytest.log"
