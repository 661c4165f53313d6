#!/usr/bin/env bash
# Prepares a fresh machine for cpumoe: the Arm cross toolchain and qemu (for the Arm kernel tests), Debian's
# chromium (for the report page's browser test), a
# virtualenv in .venv with the CPU build of PyTorch 2.13.0, and cpumoe built in place. Idempotent: it
# skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v aarch64-linux-gnu-g++ >/dev/null || need_apt+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null || need_apt+=(qemu-user-static)
command -v chromium >/dev/null || need_apt+=(chromium)   # the report's browser test (playwright drives it)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: ${need_apt[*]} missing (not root): the Arm kernel and report browser tests will be skipped"
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
# torch is pinned to the CPU wheel; installing it first keeps pip from resolving a CUDA build.
if ! .venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q torch==2.13.0
fi
stamp=.venv/.cpumoe-deps
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q setuptools wheel
  .venv/bin/pip install -q torch==2.13.0 numpy rich pytest transformers safetensors tokenizers fastapi uvicorn prometheus_client openai httpx \
    compressed-tensors aiohttp matplotlib playwright ray
  touch "$stamp"
fi
# Rebuild the extension when a C++ source or the build script changed.
so=$(ls cpumoe/_C*.so 2>/dev/null | head -n1 || true)
if [ -z "$so" ] || [ -n "$(find csrc setup.py -newer "$so" -type f | head -n1)" ]; then
  echo "setup: building cpumoe (C++ extension, about a minute)"
  .venv/bin/pip install -q --no-build-isolation --no-deps -e .
fi
