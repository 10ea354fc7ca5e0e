#!/usr/bin/env bash
# Every GPU check and GPU figure of towerflow, in one command on a machine with an NVIDIA GPU
# and a CUDA build of PyTorch (run from the repository root; logs land in OUT_DIR):
#
#   benchmarks/gpu_check.sh OUT_DIR                    # gpu-tests suite figures, < 9 minutes
#
# Each stage has its cap (GPU tests 100 s, suite 290 s, figures 170 s: 560 s in all); a stage
# cut at its cap still names what failed and says how many tests did not finish.
#   benchmarks/gpu_check.sh OUT_DIR suite              # one part (gpu-tests, suite, figures)
#
# gpu-tests: the tests marked gpu; suite: every other test, with -n sized to the machine's
# cores, the GPU visible (the names of failing tests are kept from the verbose log even when
# the run is cut off); figures: article 002 / 000 section 1 on the GPU, then the GPU figures.
# At the end one line goes to benchmarks/RESULTS.md (and OUT_DIR/summary.txt):
#
#   GPU suite: N passed, F failed, M skipped on NVIDIA <name> (commit <sha>)
#
# counting the GPU tests and the suite together. The commit is TOWERFLOW_COMMIT when set
# (a copy of the tree without .git), else git's HEAD.
#
# Where towerflow is not installed, it runs from src/ (PYTHONPATH); wheels in .whl/ (the
# dependencies missing on that machine) are installed to /tmp/site first.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR [gpu-tests] [suite] [figures]}
shift
what=" ${*:-gpu-tests suite figures} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import towerflow" 2>/dev/null || export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
stage() { echo "=== $1 ($(date +%T))"; }
cores=$(nproc)
workers=$(( cores > 2 ? cores - 2 : 1 ))   # two cores left for the GPU tests' own processes

stage environment
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/env.txt"
python3 -c "import sys, torch, grpc, google.protobuf as pb; print('python', sys.version.split()[0],
'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0),
'grpc', grpc.__version__, 'protobuf', pb.__version__)" | tee -a "$out/env.txt"
echo "cores $cores, suite workers $workers, OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset}" \
    | tee -a "$out/env.txt"

if [[ $what == *" gpu-tests "* ]]; then
    stage "GPU tests"
    timeout -s INT 100 python3 -m pytest -v -rfE -m gpu -p no:cacheprovider --timeout 120 tests \
        > "$out/gpu-tests.log" 2>&1
    grep -E "passed|failed" "$out/gpu-tests.log" | tail -1
fi
if [[ $what == *" suite "* ]]; then
    stage "the suite on $workers workers (GPU visible)"
    timeout -s INT 290 python3 -m pytest -v -n "$workers" -rfE -m "not gpu" -p no:cacheprovider \
        --timeout 150 tests > "$out/suite.log" 2>&1
    grep -E "^(=+ )?[0-9]+ (passed|failed)" "$out/suite.log" | tail -1 \
        || echo "the suite was cut off before its summary"
fi
if [[ $what == *" figures "* ]]; then
    stage "article 002 and 000 section 1 on the GPU"
    timeout 30 python3 examples/device_placement.py --gpu-memory-fraction 0.5 \
        > "$out/device-placement.log" 2>&1
    grep -A2 -E "^Device mapping|^=== an operation|OutOfMemoryError|allocated|^add.*GPU" \
        "$out/device-placement.log" | head -20
    stage "towerflow train cifar10 --num-gpus 1 vs a plain PyTorch loop"
    timeout 45 python3 benchmarks/train_vs_plain.py --steps 300 --runs 1 2>&1 | tail -4
    # each keeps its figures: towerflow's examples/s against the one-GPU-process ceiling
    keep="towerflow:|worker [0-9]:|Error|error:"
    stage "sparse click: GPU workers, tables on CPU ps tasks vs nn.EmbeddingBag on the GPU"
    timeout 35 python3 benchmarks/sparse_embedding.py --device cuda --seconds 5 2>&1 \
        | grep -E "$keep"
    stage "sparse click, hybrid: the table on CPU ps tasks, the dense layer all-reduced by the GPU workers"
    timeout 30 python3 benchmarks/sparse_embedding.py --device cuda --dense allreduce --seconds 4 \
        2>&1 | grep -E "$keep"
    stage "the same, the next step's rows pulled while a step runs (--embedding-staleness 1)"
    timeout 30 python3 benchmarks/sparse_embedding.py --device cuda --dense allreduce \
        --embedding-staleness 1 --seconds 4 2>&1 | grep -E "$keep"
fi

logs=()
for log in "$out/gpu-tests.log" "$out/suite.log"; do [ -f "$log" ] && logs+=("$log"); done
if [ ${#logs[@]} -gt 0 ]; then
    stage "summary"
    commit=${TOWERFLOW_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
    python3 benchmarks/gpu_summary.py --gpu "$gpu" --commit "$commit" "${logs[@]}" \
        | tee "$out/summary.txt"
    printf '\n%s\n' "$(head -1 "$out/summary.txt")" >> benchmarks/RESULTS.md
fi
stage done
