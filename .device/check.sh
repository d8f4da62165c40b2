#!/usr/bin/env bash
# The GPU check (issue 18): what asyncrl verifies on a lent GPU machine, in ONE call of the device tool.
#
#   here, once:   PYTHON=/path/to/python .device/fetch_wheels.sh      (wheels of .device/wheels.txt into .whl/)
#   device call:  command "bash .device/check.sh", carry [".whl"], timeout_s 600          (docs/gpu.md)
#   rehearsal:    REHEARSE=1 PYTHON=.venv/bin/python bash .device/check.sh   (here, on the CPU: the gpu tests skip,
#                 (b) runs without the GPU overrides, (d) with --quick; it catches a broken script or import)
#
# The machine (one H200, torch 2.11 + CUDA, Python 3.12) has no Ray, no vLLM and no network: the carried
# wheels are installed into /tmp/site, and everything below runs without Ray. Sections, each under a time
# limit; a failed one does not stop the others, and the summary at the end lists them all:
#   environment      GPU, torch, CUDA, NCCL; Ray absent; the wheels; asyncrl imports
#   (a) gpu tests    every `-m gpu` test of tests/unit and tests/component (CUDA graphs, static decode, ...)
#   (b) first_digit  examples/first_digit in one process, trainer and generator colocated on cuda:0; the
#                    reward curve's start and end (.device/first_digit.py)
#   (c) nccl + ipc   two NCCL ranks on one GPU via NCCL_HOSTID; the IPC transport's gpu tests, if present
#   (d) throughput   benchmarks/gpu_throughput.py: generation tokens/s at batch 64 vs 1, train-step time
#   (e) compile      trainer.compile's gpu tests (tests/component/test_compile.py): Triton kernels against eager
# The log goes to stdout and $OUT/check.log; $OUT also gets the pytest reports, the example's metrics and
# the benchmark's JSON line. Exit status 0 when every section passed. About 4-5 minutes on an H200; the sections
# share a budget of BUDGET_S seconds (560), so that the summary is printed inside a 600 s device call.
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.."
WORK="${WORK:-/tmp/asyncrl-gpu-check}"
OUT="${OUT:-$WORK/out}"
PY="${PYTHON:-python3}"
REHEARSE="${REHEARSE:-}"
mkdir -p "$OUT" "$WORK"

results=()
failed=0

# the whole check stays inside one device call (its timeout_s is at most 600): a section gets at most what is left
# of BUDGET_S, and one that would get under 20 s is skipped, so the summary is always printed
BUDGET_S="${BUDGET_S:-560}"

# section NAME LIMIT_S FUNCTION: run FUNCTION (exported below) in a child bash under a time limit, record its
# outcome; a failure does not stop the script
section() {
    local name=$1 limit=$2 fn=$3 rc=0 start=$SECONDS
    local left=$((BUDGET_S - SECONDS))
    echo
    if [ "$left" -lt 20 ]; then
        failed=1
        results+=("$(printf '%-34s %-28s %4d s' "$name" "SKIPPED (budget spent)" 0)")
        echo "=== $name: SKIPPED, ${left}s left of the ${BUDGET_S}s budget ==="
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "=== $name (limit ${limit}s) ==="
    timeout --kill-after=15 "$limit" bash -c "set -euo pipefail; $fn" || rc=$?
    local verdict=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        verdict="FAILED (time limit)"
    elif [ "$rc" -ne 0 ]; then
        verdict="FAILED (exit $rc)"
    fi
    [ "$rc" -eq 0 ] || failed=1
    results+=("$(printf '%-34s %-28s %4d s' "$name" "$verdict" $((SECONDS - start)))")
    echo "=== $name: $verdict in $((SECONDS - start)) s ==="
}

environment() {
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv || echo "nvidia-smi failed"
    "$PY" - <<'EOF'
import importlib.util, os, sys
import torch
nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else "none"
nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
print(f"python {sys.version.split()[0]}; torch {torch.__version__}; CUDA {torch.version.cuda}; "
      f"devices {torch.cuda.device_count()}; NCCL {nccl}")
print("ray installed:", importlib.util.find_spec("ray") is not None, "| vllm installed:",
      importlib.util.find_spec("vllm") is not None)
if not torch.cuda.is_available():
    if os.environ.get("REHEARSE"):  # set and not empty, as the sections below test it
        print("REHEARSE=1: no CUDA device; the sections run on the CPU")
        sys.exit(0)
    sys.exit("no CUDA device: nothing to check here (REHEARSE=1 tries the script on the CPU)")
print("device 0:", torch.cuda.get_device_name(0))
EOF
    if [ -n "$REHEARSE" ]; then
        echo "REHEARSE: .whl/ not installed (its wheels are for the GPU machine's Python 3.12); the local packages"
    elif compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        echo "installed into /tmp/site: $(cd .whl && ls *.whl | tr '\n' ' ')"
    else
        echo "no .whl/ carried: relying on the image's packages"
    fi
    "$PY" -c "import msgspec, tomli_w, asyncrl.cli, asyncrl.deploy.local, engines.torch_engine, transports; \
print('asyncrl imports without Ray; msgspec', msgspec.__version__)"
}

gpu_tests() {  # (a): the files with gpu-marked tests, except the ones (c) and (e) run
    local files
    files=$(grep -l "mark.gpu" tests/unit/*.py tests/component/*.py \
            | grep -v -e test_nccl_hostid.py -e test_ipc_transport.py -e test_compile.py | tr '\n' ' ')
    echo "files: $files"
    # shellcheck disable=SC2086  # one word per file
    "$PY" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" $files
}

first_digit() {  # (b)
    rm -rf "$WORK/first_digit" "$WORK/models"
    local rc=0
    "$PY" .device/first_digit.py "$WORK/first_digit" ${REHEARSE:+--cpu} || rc=$?
    cp "$WORK/first_digit/metrics.jsonl" "$OUT/first_digit_metrics.jsonl" 2>/dev/null || true
    return "$rc"
}

transports_on_gpu() {  # (c)
    local files=tests/component/test_nccl_hostid.py
    if [ -f tests/component/test_ipc_transport.py ]; then
        files="$files tests/component/test_ipc_transport.py"
    else
        echo "tests/component/test_ipc_transport.py is not here yet: NCCL only"
    fi
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/transport_tests.xml" $files
}

throughput() {  # (d)
    # shellcheck disable=SC2046  # no word or one
    "$PY" benchmarks/gpu_throughput.py $([ -n "$REHEARSE" ] && echo --quick || echo --device cuda) \
        | tee "$WORK/gpu_throughput.log"
    tail -n 1 "$WORK/gpu_throughput.log" > "$OUT/gpu_throughput.json"
}

compiled_on_gpu() {  # (e): last, as compiling Triton kernels takes the longest and is the least certain to fit
    "$PY" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/compile_tests.xml" tests/component/test_compile.py
}

main() {
    echo "asyncrl GPU check: $(git log -1 --format='%h %s' 2>/dev/null || echo 'commit unknown'); $(date -u)"
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    section "environment" 90 environment
    if [ "$failed" -ne 0 ]; then
        echo "the environment is not usable: stopping here"
        return 1
    fi
    section "(a) gpu tests" 100 gpu_tests
    section "(b) first_digit on cuda, colocated" 150 first_digit
    section "(c) nccl hostid + ipc transport" 100 transports_on_gpu
    section "(d) gpu_throughput benchmark" 200 throughput
    section "(e) trainer.compile on cuda" 150 compiled_on_gpu
    echo
    echo "=== summary ==="
    printf '%s\n' "${results[@]}"
    [ -s "$OUT/gpu_throughput.json" ] && echo "benchmark: $(cat "$OUT/gpu_throughput.json")"
    return "$failed"
}

# `timeout` runs each section's function in a child bash, which gets them (and the settings) exported; tee keeps
# the whole log in $OUT
export -f environment gpu_tests first_digit transports_on_gpu throughput compiled_on_gpu
export OUT WORK PY REHEARSE
main 2>&1 | tee "$OUT/check.log"
