#!/usr/bin/env bash
# Every GPU check and GPU figure of towerflow, in one command on a machine with an NVIDIA GPU
# and a CUDA build of PyTorch (run from the repository root; logs land in OUT_DIR):
#
#   benchmarks/gpu_check.sh OUT_DIR gpu-tests suite figures   # all three, ~10 minutes
#
# gpu-tests: the tests marked gpu; suite: the whole suite on the machine's CPUs, the GPU
# visible; figures: article 002 / 000 section 1 on the GPU, then every GPU figure.
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

stage environment
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/env.txt"
python3 -c "import sys, torch, grpc, google.protobuf as pb; print('python', sys.version.split()[0],
'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0),
'grpc', grpc.__version__, 'protobuf', pb.__version__)" | tee -a "$out/env.txt"

if [[ $what == *" gpu-tests "* ]]; then
    stage "GPU tests"
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 \
        | tee "$out/gpu-tests.log" | tail -25
fi
if [[ $what == *" suite "* ]]; then
    stage "whole suite on the CPUs (GPU visible)"
    timeout 420 python3 -m pytest -q -n 8 -rfE -p no:cacheprovider --timeout 240 tests 2>&1 \
        | tee "$out/suite.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -60
fi
if [[ $what == *" figures "* ]]; then
    stage "article 002 and 000 section 1 on the GPU"
    timeout 120 python3 examples/device_placement.py --gpu-memory-fraction 0.5 \
        > "$out/device-placement.log" 2>&1
    grep -A2 -E "^Device mapping|^=== an operation|OutOfMemoryError|allocated|^add.*GPU" \
        "$out/device-placement.log" | head -30
    stage "towerflow train cifar10 --num-gpus 1 vs a plain PyTorch loop"
    timeout 240 python3 benchmarks/train_vs_plain.py --steps 600 --runs 2 2>&1 | tail -6
    stage "Trainer (SingleDevice) vs a plain loop, same batches on the GPU"
    timeout 120 python3 benchmarks/mirrored_vs_ddp.py --only single --device cuda:0 \
        --batch-size 128 --steps 50 --rounds 10 2>&1 | tail -2
    stage "article 001: variables on a CPU ps task vs mirrored, one GPU"
    timeout 200 python3 benchmarks/ps_vs_mirrored.py --steps 300 2>&1 | tail -4
    stage "placement log and scope on the GPU"
    timeout 120 python3 benchmarks/placement_overhead.py --device cuda:0 --rounds 100 2>&1 \
        | tail -7
    stage "sparse click: GPU workers, tables on CPU ps tasks vs nn.EmbeddingBag on the GPU"
    timeout 200 python3 benchmarks/sparse_embedding.py --device cuda --seconds 10 2>&1 | tail -9
fi
stage done
