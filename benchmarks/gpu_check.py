"""Benchmark: the checks to run the day a GPU is lent (``benchmarks/gpu_check.sh`` runs this).

Greedy exactness against ``transformers`` per decode layout (float32 exact, bfloat16 within
``--bf16-tokens``), operator calls and host milliseconds per decode step by rows and layout against
``generate`` and the compiled step against the bare compiled forward, and the 8-branch job against
``generate(num_return_sequences=8)`` and 8 sequential calls, and that job with drafts from the prompt
and sibling branches against without (``rksc_bench.gpu_check``). On a CPU,
``--quick`` checks on a tiny model that the script runs:

    ./dev python benchmarks/gpu_check.py --quick --device cpu --no-lock
"""

from __future__ import annotations

from rksc_bench import harness
from rksc_bench.gpu_check import PARTS, CheckOptions, run_check


def main(argv: list[str] | None = None) -> None:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_device()
    parser.add_argument("--quick", action="store_true", help="a tiny model and small sizes: checks the script runs")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--rows", type=harness.positive_int_list, default=[1, 8, 16, 32], help="rows of the step part")
    parser.add_count("--bf16-tokens", 16, "tokens that must match before a bfloat16 difference ")
    parser.add_count("--new-tokens", 32, "tokens per greedy prompt ")
    args = parser.parse_args(argv)
    harness.start_run(args)
    options = CheckOptions(device=None if args.device == "auto" else args.device, model=args.model, quick=args.quick,
                           rows=tuple(args.rows), bf16_tokens=args.bf16_tokens, new_tokens=args.new_tokens)
    harness.write_json(args.json_out, run_check(options, tuple(args.parts.split(","))))


if __name__ == "__main__":
    main()
