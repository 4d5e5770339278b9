#!/usr/bin/env bash
# The docs/gpu.md checklist on a machine with NVIDIA GPUs, in one command, within a time budget.
#
#   bash scripts/gpu_check.sh OUT_DIR [SECONDS]
#
# Run from the repository root, with a CUDA build of torch as `python3` (or $PYTHON) and
# distkit's dependencies installed (nothing is installed from an index: the GPU machines this
# project borrows have none). Optional inputs, as files in the checkout:
#   .gpu/apex-25.04.tar.gz, .gpu/apex-25.09.tar.gz  NVIDIA apex sources (../shared/vendor/):
#       each is built Python-only into its own folder and tested on its own;
#   .data/  the MNIST cache (DISTKIT_DATA_DIR) for examples/mnist.py, which cannot fetch there;
#   .gpu/deepspeed/  DeepSpeed's wheel and its requirements' (`python3 scripts/gpu_wheels.py
#       fetch`, run where there is an index; GPU_CHECK_DEEPSPEED names another folder):
#       installed first, each absent or older one into /tmp/deepspeed, which every later step
#       then has on its PYTHONPATH.
#
# What it does, each step with its own time limit, every log under OUT_DIR:
#   smoke.log            nvidia-smi, Python/torch/CUDA, the GPU, `distkit doctor`, versions;
#   deepspeed.log        DeepSpeed installed from .gpu/deepspeed/ (when that folder is there);
#   suite.log/.xml       the test suite on CUDA (pytest-xdist when installed), with the skip
#                        reasons; cut off with SIGINT (so pytest still prints its summary) when
#                        its share of the budget runs out;
#   apex-V-*.log         per apex generation: the build, then tests/strategies/test_apex.py,
#                        test_host_syncs.py and test_cuda_paths.py (real apex, the sync-debug-mode
#                        test, the paths added since the last GPU run);
#   focus.log/.xml       the in-process CUDA paths first, whatever the suite reaches:
#                        tests/strategies/test_cuda_paths.py (token-exact, the user loop, a GAN,
#                        weights and predictions on the GPU), tests/runtime/test_cuda_drop_in.py
#                        (the Runtime as a drop-in: a user's Optimizer subclass, LambdaLR, the
#                        hand loop under sync debug mode), tests/trainer/test_cuda_mfu.py (MFU
#                        against the published peak; its figures in focus.xml), the background
#                        save's pinned staging, test_cuda_large_models.py (DeepSpeed, FSDP's
#                        CPU offload and a world of one's policy, activation checkpointing and
#                        its memory peak, meta models), the host-sync test, compile="blocks"
#                        with inductor, the memory, profiler and determinism tests,
#                        torch.compile, the checkpoint tests (resume onto the GPU);
#   examples.log         seg.py under torchrun (apex fp16, ddp bf16), mnist.py with dp, gan.py
#                        (the Runtime loop, bf16), lm.py (token-exact, fp16; tokens/s and MFU)
#                        and lm.py bf16 with compile="blocks" (tokens/s) under torchrun;
#   bench.log, gpu.json  benchmarks/gpu.py (peers: distkit, the hand loop, Fabric, the Lightning
#                        Trainer, Accelerate), run last and alone so nothing else shares the GPU;
#   summary.txt          one line per step: its exit status and seconds.
set -u
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [SECONDS]}
budget=${2:-480}
py=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$PWD
export PYTHONPATH=$root PYTHONUNBUFFERED=1
# a lone GPU: the tests' child processes (2 to 4 ranks each) run on the CPU; tests/conftest.py
export DISTKIT_TESTS_HIDE_LONE_GPU=1
export DISTKIT_DATA_DIR=${DISTKIT_DATA_DIR:-$root/.data}
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }

# step NAME LIMIT CMD...: run CMD under `timeout` (SIGINT first, SIGKILL 20 s later), log to
# OUT/NAME.log, and append "NAME rc=N Ns" to the summary.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    # bash -c: timeout runs programs, and the steps are this script's (exported) functions.
    # Started with SIGINT ignored (nohup, a background job), the steps still take timeout's
    # SIGINT: GNU timeout catches SIGINT itself, and a caught signal is back at its default
    # after exec (tests/test_gpu_check.py, started-sigint-ignored).
    timeout -s INT -k 20 "$limit" bash -c '"$@"' "$name" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(($(date +%s) - start))s (at $(elapsed)s)" >>"$out/summary.txt"
    return $rc
}

smoke() {
    nvidia-smi
    "$py" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version()); print(torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'
    "$py" -m distkit.cli doctor
    "$py" -m pip list 2>/dev/null | grep -iE '^(torch|lightning|pytorch-lightning|accelerate|numpy|pytest|pytest-xdist|pytest-timeout|hypothesis|tensorboard) '
}

build_apex() {  # VERSION: the Python-only build into /tmp/apex-VERSION
    local version=$1 src=/tmp/apex-src
    mkdir -p "$src" && tar xzf ".gpu/apex-$version.tar.gz" -C "$src" || return
    if ! "$py" -m pip install -q --no-build-isolation --no-deps --no-cache-dir \
        --target "/tmp/apex-$version" "$src/apex-$version"; then
        # the package without pip (no version metadata): the Python-only build's contents
        echo "pip install failed: using the source tree's apex/ as it is"
        mkdir -p "/tmp/apex-$version" && cp -r "$src/apex-$version/apex" "/tmp/apex-$version/"
    fi
    PYTHONPATH="/tmp/apex-$version:$root" "$py" -c 'import apex; print("apex at", apex.__file__); from distkit.strategies.apex._detect import detect_apex; print(detect_apex())'
}

test_apex() {  # VERSION
    # shellcheck disable=SC2046
    PYTHONPATH="/tmp/apex-$1:$root" "$py" -m pytest -q -rA -p no:cacheprovider --timeout 120 $(workers 2) \
        tests/strategies/test_apex.py tests/strategies/test_host_syncs.py \
        tests/strategies/test_cuda_paths.py
    local rc=$?
    if [ "$("$py" -c 'from distkit.strategies.apex._detect import detect_apex; print(detect_apex().generation)' 2>/dev/null)" = legacy ]; then
        for mode in plain upcast; do  # does a hand-written O1 loop skip its first step too?
            echo "== scripts/apex_o1_first_step.py $mode"
            PYTHONPATH="/tmp/apex-$1:$root" timeout 60 "$py" scripts/apex_o1_first_step.py "$mode"
        done
    fi
    return $rc
}

examples() {
    local apex_path=/tmp/apex-25.04 waited=0
    while [ ! -d "$apex_path/apex" ] && [ -f .gpu/apex-25.04.tar.gz ] && [ $waited -lt 90 ]; do
        sleep 2 && waited=$((waited + 2))  # the apex lane builds it
    done
    echo "== seg.py, apex fp16 (apex 25.04), torchrun --nproc_per_node 1"
    PYTHONPATH="$apex_path:$root" timeout 150 "$py" -m torch.distributed.run --standalone \
        --nproc_per_node 1 examples/seg.py --strategy apex --precision fp16 --epochs 3
    echo "rc=$?"
    echo "== seg.py, ddp bf16, torchrun --nproc_per_node 1"
    timeout 150 "$py" -m torch.distributed.run --standalone --nproc_per_node 1 \
        examples/seg.py --strategy ddp --precision bf16 --epochs 3
    echo "rc=$?"
    echo "== mnist.py, dp"
    timeout 150 "$py" examples/mnist.py --strategy dp --epochs 3
    echo "rc=$?"
    echo "== gan.py (distkit.Runtime, two models), ddp bf16, torchrun --nproc_per_node 1"
    timeout 150 "$py" -m torch.distributed.run --standalone --nproc_per_node 1 \
        examples/gan.py --strategy ddp --precision bf16 --epochs 2 --out-dir "$out/gan"
    echo "rc=$?"
    echo "== lm.py (token-exact), ddp fp16, accumulation 2, torchrun --nproc_per_node 1"
    timeout 150 "$py" -m torch.distributed.run --standalone --nproc_per_node 1 \
        examples/lm.py --strategy ddp --precision fp16 --grad-accum 2 --epochs 2 \
        --out "$out/lm-out"
    echo "rc=$?"
    # (the fp16 run above prints MFU against the GPU's published peak; under a compile no
    # FLOPs are counted, so this one prints tokens/s only)
    echo "== lm.py, bf16, compile=blocks (inductor's Triton kernels), torchrun --nproc_per_node 1"
    timeout 200 "$py" -m torch.distributed.run --standalone --nproc_per_node 1 \
        examples/lm.py --strategy ddp --precision bf16 --compile blocks --epochs 2 \
        --out "$out/lm-blocks-out"
    echo "rc=$?"
}

workers() {  # N: pytest's arguments for N workers, when pytest-xdist is installed
    if "$py" -c 'import xdist' 2>/dev/null; then echo "-n $1"; fi
}

# the focus step's tests, the CUDA-only files first (pytest hands them out in this order)
FOCUS_DEFAULT="tests/strategies/test_cuda_paths.py tests/runtime/test_cuda_drop_in.py
    tests/trainer/test_cuda_mfu.py tests/checkpoint/test_cuda_background_save.py
    tests/strategies/test_cuda_large_models.py tests/strategies/test_host_syncs.py
    tests/strategies/test_compile_blocks.py tests/trainer/test_memory.py
    tests/trainer/test_profiler.py tests/runtime/test_determinism.py
    tests/strategies/test_compile.py tests/checkpoint"
focus() {
    # shellcheck disable=SC2046  # the words of workers' output are pytest's arguments
    "$py" -m pytest -q -rfEs -p no:cacheprovider --timeout 150 --junitxml "$out/focus.xml" \
        $(workers "${FOCUS_WORKERS:-3}") ${FOCUS_TESTS:-$FOCUS_DEFAULT}
}

suite() {
    # shellcheck disable=SC2046
    "$py" -m pytest -q -rfEs -p no:cacheprovider --timeout 150 --durations 25 \
        --junitxml "$out/suite.xml" $(workers "${SUITE_WORKERS:-10}") ${SUITE_TESTS:-tests}
}

install_deepspeed() {  # DeepSpeed from .gpu/deepspeed/ into /tmp/deepspeed (no index on the machine)
    "$py" scripts/gpu_wheels.py install "$deepspeed_wheels" /tmp/deepspeed
}

deepspeed_wheels=${GPU_CHECK_DEEPSPEED:-.gpu/deepspeed}
export py out root deepspeed_wheels FOCUS_DEFAULT
export -f install_deepspeed smoke build_apex test_apex examples workers suite focus
skipped() {  # NAME: listed in $GPU_CHECK_SKIP (space-separated)?
    case " ${GPU_CHECK_SKIP:-} " in *" $1 "*) echo "$1 skipped (GPU_CHECK_SKIP)" >>"$out/summary.txt" ;; *) return 1 ;; esac
}
skipped smoke || step smoke 60 smoke
if [ ! -d "$deepspeed_wheels" ]; then
    echo "deepspeed skipped: no $deepspeed_wheels/ (scripts/gpu_wheels.py fetch)" >>"$out/summary.txt"
elif ! skipped deepspeed && step deepspeed 120 install_deepspeed; then
    export PYTHONPATH=/tmp/deepspeed:$PYTHONPATH
fi
# three lanes side by side: the suite; each apex generation built and tested in turn; the
# examples (the apex one waits for the 25.04 build)
phase=$((budget * ${GPU_CHECK_SUITE_SHARE:-60} / 100))
skipped suite || step suite "$phase" suite &
(for version in 25.04 25.09; do
    if [ ! -f ".gpu/apex-$version.tar.gz" ]; then
        echo "apex-$version skipped: no .gpu/apex-$version.tar.gz" >>"$out/summary.txt"
    elif ! skipped apex; then
        step "apex-$version-build" 120 build_apex "$version" &&
            step "apex-$version-tests" $((phase / 2)) test_apex "$version"
    fi
done) &
skipped examples || step examples "$phase" examples &
skipped focus || step focus "$phase" focus &
wait
left=$((budget - $(elapsed) - 10))
if skipped bench; then
    :
elif [ "$left" -gt 60 ]; then
    step bench "$left" "$py" benchmarks/gpu.py --gpus 1 --models cnn,resnet \
        --precisions 32,bf16 --benchmarks peers --steps "${GPU_CHECK_STEPS:-40}" \
        --rounds "${GPU_CHECK_ROUNDS:-2}" --timeout 150 --results "$out/bench" \
        --out "$out/gpu.json"
else
    echo "bench skipped: ${left}s left of the budget" >>"$out/summary.txt"
fi
echo "done at $(elapsed)s" >>"$out/summary.txt"
cat "$out/summary.txt"
