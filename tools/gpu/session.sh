#!/usr/bin/env bash
# One short run on a bare GPU machine with no network: the GPU benchmark, then the GPU test tier.
#
# Run from the repository's root, with gpu_carry/ beside it (made here by `python3 tools/gpu/carry.py`: ComfyUI's
# tree and the wheels it needs that the machine lacks) and $OUT set to the folder whose files come back:
#
#   bash tools/gpu/session.sh
#
#   1. the GPU tier: pytest -m gpu tests/core with DEVICE_CONTROL_REQUIRE_GPU=1 (a test that finds no GPU fails),
#      while the benchmark's fixtures (SD1.5, SDXL) are made on the processor beside it;
#   2. tools/gpu/bench.py: ComfyUI's own offloading beside ours on a card held small, under a time limit (no run
#      starts after BENCH_LIMIT seconds; it is killed at BENCH_KILL), and one profiled run of ours per case.
#
#   3. with BENCH_REPEATS=N, N-1 more benchmark runs (no profile) into $OUT/repeat<i>/, for medians; with
#      STAGED_ARGS set, one more run with DEVICE_CONTROL_MAX_PINNED_FRACTION=0.01 (slabs left pageable cross through
#      the staging buffers) into $OUT/staged/.
#
# Each part runs whatever happened to the other; everything is logged under $OUT (machine.txt, gpu_session.log,
# bench_gpu_log.txt, bench_gpu.json, bench_gpu.md, gpu_tier.txt, profile_<case>.txt). At most 8 files come back, so
# more than 8 are packed into $OUT/gpu_session.tar.gz. The exit code is 0 only when the tier and the first benchmark
# passed. Expected: about 3 minutes for the benchmark, under 1 for the tier.
set -u -o pipefail

OUT=${OUT:-/tmp/device_control_gpu_out}
CARRY=${GPU_CARRY:-gpu_carry}
WORK=${GPU_WORK:-/tmp/device_control_gpu}
BENCH_LIMIT=${BENCH_LIMIT:-210}
BENCH_KILL=${BENCH_KILL:-280}
TIER_KILL=${TIER_KILL:-180}
FIXTURES=${GPU_FIXTURES:-$WORK/fixtures}
# More arguments for the benchmark (a dry run here, without a GPU: BENCH_ARGS="--simulate --budgets 1GB").
BENCH_ARGS=${BENCH_ARGS:-}
BENCH_REPEATS=${BENCH_REPEATS:-1}
STAGED_ARGS=${STAGED_ARGS:-}
# The fixtures the chosen cases read (tools/gpu/fixtures.py), made while the GPU tier runs.
FIXTURE_KEYS=${FIXTURE_KEYS:-sd15_checkpoint,sd15_vae,sdxl_unet}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/gpu_session.log

say() { echo "[Device Control] $(date +%T) $*" | tee -a "$LOG"; }

machine() {
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,pcie.link.gen.current,pcie.link.width.current \
        --format=csv >"$OUT/machine.txt" 2>&1
    python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' >>"$OUT/machine.txt" 2>&1
    nproc >>"$OUT/machine.txt"
    free -g >>"$OUT/machine.txt" 2>&1
}

setup() {
    local archive
    archive=$(ls "$CARRY"/comfyui-*.tar.gz 2>/dev/null | head -n 1)
    if [ -z "$archive" ]; then
        echo "no ComfyUI archive in $CARRY (make it here with: python3 tools/gpu/carry.py; carry gpu_carry)"
        return 1
    fi
    tar -xzf "$archive" -C "$WORK" || return 1
    COMFY=$WORK/$(basename "$archive" .tar.gz)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        "$CARRY"/wheels/*.whl || return 1
    python3 -c 'import torchsde, trampoline, gguf' || return 1
}

started=$(date +%s)
say "GPU run in $PWD, output in $OUT"
machine
tee -a "$LOG" <"$OUT/machine.txt"
# The wheels first; the stand-ins (PyAV) last, so a real package there wins.
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}:$PWD/tools/gpu/stand_ins"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset DEVICE_CONTROL_SIMULATE_GPU DEVICE_CONTROL_SIMULATE_LINK DEVICE_CONTROL_PREFETCH

tier() {
    say "GPU tier: pytest -m gpu tests/core, killed at ${TIER_KILL}s"
    DEVICE_CONTROL_REQUIRE_GPU=1 timeout -k 10 "$TIER_KILL" python3 -m pytest -m gpu tests/core -p no:cacheprovider \
        -rA 2>&1 | tee "$OUT/gpu_tier.txt"
    tier_rc=$?
    say "GPU tier: exit code $tier_rc after $(($(date +%s) - started)) s"
}

bench_rc=1
tier_rc=1
if setup >>"$LOG" 2>&1; then
    # The fixtures are made on the processor while the GPU tier runs (it is short and uses the GPU alone); the
    # benchmark then finds them current and starts timing at once.
    say "fixtures $FIXTURE_KEYS in the background, in $FIXTURES"
    python3 tools/gpu/bench.py --make-fixtures "$FIXTURE_KEYS" --fixtures "$FIXTURES" --comfyui-dir "$COMFY" \
        >"$WORK/fixtures.txt" 2>>"$LOG" &
    fixtures_pid=$!
    tier
    wait "$fixtures_pid"
    say "fixtures: exit code $? after $(($(date +%s) - started)) s"
    say "benchmark: ComfyUI $COMFY, no run starts after ${BENCH_LIMIT}s, killed at ${BENCH_KILL}s"
    timeout -k 10 "$BENCH_KILL" python3 tools/gpu/bench.py --comfyui-dir "$COMFY" --fixtures "$FIXTURES" \
        --out "$OUT" --time-limit "$BENCH_LIMIT" --profile $BENCH_ARGS 2>&1 | tee "$OUT/bench_gpu_log.txt"
    bench_rc=$?
    say "benchmark: exit code $bench_rc after $(($(date +%s) - started)) s"
    for i in $(seq 2 "$BENCH_REPEATS"); do
        timeout -k 10 "$BENCH_KILL" python3 tools/gpu/bench.py --comfyui-dir "$COMFY" --fixtures "$FIXTURES" \
            --out "$OUT/repeat$i" --time-limit "$BENCH_LIMIT" $BENCH_ARGS >"$OUT/repeat$i.log" 2>&1
        say "benchmark, run $i: exit code $? after $(($(date +%s) - started)) s"
    done
    if [ -n "$STAGED_ARGS" ]; then
        DEVICE_CONTROL_MAX_PINNED_FRACTION=0.01 timeout -k 10 "$BENCH_KILL" python3 tools/gpu/bench.py \
            --comfyui-dir "$COMFY" --fixtures "$FIXTURES" --out "$OUT/staged" --time-limit "$BENCH_LIMIT" \
            $STAGED_ARGS >"$OUT/staged.log" 2>&1
        say "benchmark, staged: exit code $? after $(($(date +%s) - started)) s"
    fi
else
    tail -n 20 "$LOG"
    say "setup failed (above): the benchmark does not run; the GPU tier still does"
    tier
fi
find "$OUT" -type f | sort | tee -a "$LOG"
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
    (cd "$OUT" && tar -czf /tmp/gpu_session.tar.gz . && find . -mindepth 1 -delete && mv /tmp/gpu_session.tar.gz .)
fi
[ "$bench_rc" -eq 0 ] && [ "$tier_rc" -eq 0 ]
