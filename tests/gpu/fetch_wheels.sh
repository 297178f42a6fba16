#!/usr/bin/env bash
# Step 1 of the GPU tier, on a machine that reaches PyPI (yours): download into .gpu_wheels/ the
# wheels the lent GPU machine lacks (it has PyTorch, transformers, NCCL, pytest; Python 3.12,
# x86_64; no package registry): Megatron-core, DeepSpeed (built here as a pure-Python wheel, its
# ops compile on first use) and their missing dependencies, at this project's versions.
# .gpu_wheels/ is ignored by git; the device tool carries it (carry: [".gpu_wheels"]).
# Step 2, on the GPU machine: tests/gpu/run_on_device.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
dest=.gpu_wheels
rm -rf "$dest" && mkdir -p "$dest"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$dest" \
  "megatron-core==$(version megatron-core)" "pydantic==$(version pydantic)" \
  "pydantic-core==$(version pydantic-core)" "annotated-types==$(version annotated-types)" \
  "typing-inspection==$(version typing-inspection)" "hjson==$(version hjson)"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "deepspeed==$(version deepspeed)"
du -sh "$dest" && ls "$dest"
