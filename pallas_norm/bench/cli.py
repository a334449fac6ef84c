"""The command line: ``python -m pallas_norm.bench [sweep | ab] ...`` (``make bench``).

  (no subcommand)  the kernel bench: pallas_norm (every mode and the heuristic, on the
                   "pallas" and "triton" backends) against its peers, side by side in
                   one process on the same inputs (``run``, ``report``);
  --sharded        the sharded bench over every local GPU (``sharded``; --sharded --help);
  --e2e            the train-step bench (``e2e``; --e2e --help);
  --decode         the decode-step bench (``decode``; --decode --help);
  sweep            launch-config sweeps of the Pallas kernels (``sweep``; sweep --help);
  ab               interleaved A/Bs: launch configs, backends, tokamax's aliases, an ncu
                   target (``ab``; ab --help).

Output of the kernel bench: progress lines as it goes; JSON and CSV (rows + metadata)
and a PNG plot at ``--out``; the summary table is printed last. ``--plot-only A.json
[B.json ...]`` merges result files and redraws the plot and the table; ``--dry-run``
prints the plan.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from pallas_norm.bench import report, run, timing
from pallas_norm.bench.plan import DTYPES, IMPLS, build_plan, print_plan

def parser() -> argparse.ArgumentParser:
  """The kernel bench's options (``--sharded``, ``--e2e``, ``--decode``, ``sweep`` and
  ``ab`` have parsers of their own)."""
  p = argparse.ArgumentParser(
      prog="python -m pallas_norm.bench",
      description="Side-by-side GPU benchmark of pallas_norm against XLA, flax, tokamax, "
                  "torch and Liger (CUPTI kernel time, rotated inputs, median). "
                  "Bytes model: fwd 2*M*N*itemsize, fwd+bwd 5*M*N*itemsize; FP8 output "
                  "(itemsize+1)*M*N, +M*N with the transposed copy; FP8 input fwd "
                  "(1+itemsize+4/16)*M*N, fwd+bwd +(1+2*itemsize+4/16)*M*N.",
      epilog="--sharded: the sharded benchmark over every local GPU instead "
             "(pallas_norm/bench/sharded.py; its options: --sharded --help). "
             "--e2e: the train-step benchmark (pallas_norm/bench/e2e.py; --e2e --help). "
             "--decode: the decode-step benchmark (pallas_norm/bench/decode.py; "
             "--decode --help). "
             "Subcommands: 'sweep' (launch-config sweeps; sweep --help) and 'ab' "
             "(interleaved A/Bs; ab --help). The results and the command behind each: "
             "benchmarks/README.md.")
  p.add_argument("--shapes", help="MxN list, e.g. 4096x1024,8192x4096 (default: the "
                                  "kernel table of pallas_norm/bench/plan.py: BENCH_SHAPES plus Llama/Qwen "
                                  "hidden sizes at M=8192, LLM_SHAPES, plus M=1,8,64,512 at "
                                  "N=2048,4096,8192, DECODE_SHAPES)")
  p.add_argument("--ops", default="rms,layer",
                 help="rms,layer (default both); rms_res,layer_res: the fused residual add "
                      "(pallas, xla and flax only); rms_post_res: with Gemma's post-norm "
                      "of x first (post_norm_scale=); FP8 output, forward only, pallas "
                      "against the jnp chain (xla): rms_fp8,layer_fp8 (current scaling), "
                      "*_fp8_delayed (delayed), suffix _t with the transposed copy "
                      "(rms_fp8_delayed_t); 'fp8' for all eight; rms_fp8_static,layer_fp8_static "
                      "(and *_fp8_static_res: with the fused residual add) "
                      "(a given y_scale, y alone: W8A8 serving, stats=False; "
                      "*_fp8_static_stats: the same with stats=True, the A/B); FP8 input "
                      "(x float8_e4m3fn with float32 scales a group of 16, y in --dtype): rms_fp8in,layer_fp8in "
                      "('fp8in' for both), pallas and triton against the jnp chain (xla)")
  p.add_argument("--passes", default="fwd,fwdbwd",
                 help="fwd,fwdbwd (default both); fwdbwd_dep: forward+backward with dy "
                      "released only once y exists, a training step's order (torch's "
                      "eager backward runs in that order anyway)")
  p.add_argument("--impls", help="comma list of " + ",".join(i.name for i in IMPLS)
                 + "; 'pallas:*' / 'triton:*' for every mode (default: all)")
  p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
  p.add_argument("--iters", type=int, default=30, help="timed calls per case (>= 30 for results)")
  p.add_argument("--rounds", type=int, default=1,
                 help="rounds of --iters calls each, the implementations of an (op, pass, "
                      "shape) cell alternated round by round after all of them compiled; "
                      "a row's us is the median of every round's calls (default 1: each "
                      "implementation timed once, one after the other)")
  p.add_argument("--quick", action="store_true",
                 help="4 shapes, heuristic and peers only (no per-mode sweep)")
  p.add_argument("--check", action="store_true",
                 help="compare every output (and grads) with the XLA reference before timing")
  p.add_argument("--budget-s", type=float, default=420.0,
                 help="stop starting new cases after this many seconds (default 420)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", help="result JSON path (CSV and PNG beside it); default "
                               "benchmarks/results/<device>_<date>.json")
  p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
  p.add_argument("--plot-only", nargs="+", metavar="FILE.json",
                 help="merge result files, redraw the PNG (at --out or beside the first "
                      "file) and print the table; no GPU")
  return p


def main(argv: list[str] | None = None) -> int:
  """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code
  (0 ok, 1 a ``--check`` failed, 2 no GPU or bad arguments)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] == "sweep":
    from pallas_norm.bench import sweep
    return sweep.main(argv[1:])
  if argv and argv[0] == "ab":
    from pallas_norm.bench import ab
    return ab.main(argv[1:])
  if "--sharded" in argv:  # the multi-GPU benchmark, with options of its own
    from pallas_norm.bench import sharded
    return sharded.main([a for a in argv if a != "--sharded"])
  if "--e2e" in argv:  # the train-step benchmark, with options of its own
    from pallas_norm.bench import e2e
    return e2e.main([a for a in argv if a != "--e2e"])
  if "--decode" in argv:  # the decode-step benchmark, with options of its own
    from pallas_norm.bench import decode
    return decode.main([a for a in argv if a != "--decode"])
  p = parser()
  args = p.parse_args(argv)
  if args.iters < 1:
    p.error(f"--iters={args.iters} must be >= 1")
  if args.rounds < 1:
    p.error(f"--rounds={args.rounds} must be >= 1")
  if args.plot_only:
    try:
      doc = report.merge(args.plot_only)
    except ValueError as e:
      p.error(str(e))
    out = pathlib.Path(args.out) if args.out else pathlib.Path(args.plot_only[0])
    if args.out:
      report.write(out, doc["meta"], doc["rows"])
      print(f"wrote {out} and {out.with_suffix('.csv')}")
    report.finish(out, doc)
    return 0
  try:
    plan = build_plan(args)
  except ValueError as e:
    p.error(str(e))
  if args.dry_run:
    print_plan(plan, args)
    return 0
  if timing.gpu_missing():
    return 2
  return run.run_plan(args, plan)
