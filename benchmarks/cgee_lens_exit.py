"""Benchmark: training-free level-2 exit rules for the verifier, replayed on recorded logit lenses.

CGEE level 2 stops a verifier pass at a middle layer once its decision looks settled. The library's
rule (``cgee.lens_exit_layer``) trusts the lens's absolute label entropy, and on the default model
that lens is badly calibrated (P(Yes) near 1 in middle layers where the full pass gives ~0.3), so
the rule is off by default. This script tries rules that only use the lens's *relative* signal,
the way SimExit-style training-free exits do:

* ``pick``: exit once the answer the picking rule (``cgee.pick_answer``: share x P(Yes)) would
  return has been the same for ``window`` consecutive layers;
* ``ranking``: exit once the whole order of the candidates by share x P(Yes) has been the same for
  ``window`` layers;
* ``margin``: exit once the pick is unchanged and the gap between the top two normalised
  share x P(Yes) values moved less than ``epsilon`` over ``window`` layers;
* ``entropy``: the library's rule (``theta``, ``epsilon``, ``min_layer``), for reference.

Every rule only reads what the verifier's hooks compute online: per layer and candidate, the Yes/No
logits at the scored position. The records come from ``benchmarks/cgee.py --workload ladder
--record-lens`` (the lens of every layer of every full verification), so nothing runs a model here
and the replay is exact. Rules are chosen on the seeded calibration half of the questions (the
most verifier layers saved with the decision error's Wilson 95% upper bound at most
``--target-error``, errors counted against full-depth verification) and reported on the held-out
half, beside the accuracy against the gold answer. Saved work is counted in verifier layers; each
check costs ``--check-cost`` layers (0 by default, which makes the savings an upper bound).

    ./dev python benchmarks/cgee_lens_exit.py --records benchmarks/results/cgee_ladder_records.json \
        --out docs/bench/cgee_lens_exit.md --plot docs/bench/cgee_lens_exit.png
"""

from __future__ import annotations

from pathlib import Path

from rksc_bench import harness
from rksc_bench.lens_exit import load_records, plot, render, report, report_json


def main(argv: list[str] | None = None) -> None:
    # Replays saved records: no model, nothing timed, so no bench lock.
    parser = harness.bench_parser(__file__, __doc__, model=False, lock=False, json_out="none")
    parser.add_argument("--records", default="benchmarks/results/cgee_ladder_records.json")
    parser.add_seed(0, "seed of the calibration / held-out split")
    parser.add_argument("--target-error", type=float, default=0.05,
                        help="largest Wilson 95%% upper bound of the decision error a chosen rule may have")
    parser.add_argument("--check-cost", type=float, default=0.0, help="cost of one exit check, in verifier layers")
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    parser.add_argument("--plot", default=None, help="write the agreement-by-layer plot to this PNG")
    parser.add_json_out(Path("benchmarks/results/cgee_lens_exit.json"))
    args = parser.parse_args(argv)
    if not 0 < args.target_error < 1:
        parser.error(f"--target-error must be in (0, 1), got {args.target_error}")
    if args.check_cost < 0:
        parser.error(f"--check-cost must be >= 0, got {args.check_cost}")
    meta, records = load_records(Path(args.records))
    result = report(meta, records, seed=args.seed, target_error=args.target_error, check_cost=args.check_cost)
    text = render(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    harness.write_json(args.json_out, report_json(result))


if __name__ == "__main__":
    main()
