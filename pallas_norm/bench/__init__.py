"""GPU benchmarks of pallas_norm: ``python -m pallas_norm.bench`` (``make bench``).

What lives where:
  cli.py      the command line: the kernel bench (no subcommand), ``--sharded``,
              ``--e2e``, ``sweep`` and ``ab``; ``__main__.py`` runs it.
  timing.py   how a call is timed: the XLA flag that lets CUPTI see kernels (set when
              this package is imported), CUPTI kernel time over rotated inputs, CUDA
              events for torch, the copy reference, the run's metadata.
  plan.py     shapes, implementations, the bytes model, the L2 rotation count, the plan.
  peers.py    every implementation as a function: pallas_norm, XLA, flax, tokamax
              (without its output aliases), torch, Liger.
  run.py      the kernel bench's run loop: inputs, ``--check``, one row per case.
  report.py   result files (JSON, CSV), the summary table, the plot, ``--plot-only``.
  sharded.py  ``--sharded``: data and tensor parallel over every local GPU against XLA.
  e2e.py      ``--e2e``: decoder train steps with flax's norms, pallas_norm's, and the
              fused residual add.
  sweep.py    ``sweep``: the launch-config sweeps behind ``pallas_norm/config.py``.
  ab.py       ``ab``: interleaved A/Bs of launch configs, backends and tokamax's
              aliases, and a target for ncu.

The method and the tables: ``docs/performance.md``; which results file backs which
rule or table, and the command that wrote it: ``benchmarks/README.md``.
"""

from pallas_norm.bench import timing  # noqa: F401 - first: sets XLA_FLAGS before a backend starts
from pallas_norm.bench.cli import main
from pallas_norm.bench.peers import tokamax_vjp_without_alias
from pallas_norm.bench.plan import (BENCH_SHAPES, IMPLS, LLM_SHAPES, Case, build_plan,
                                    bytes_model, parse_shapes, rotations)
from pallas_norm.bench.report import format_table, plot

__all__ = [
    "BENCH_SHAPES",
    "LLM_SHAPES",
    "IMPLS",
    "Case",
    "bytes_model",
    "parse_shapes",
    "rotations",
    "build_plan",
    "format_table",
    "plot",
    "main",
    "tokamax_vjp_without_alias",
]
