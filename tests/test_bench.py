"""CPU tests of pallas_norm.bench: the plan, the bytes model, the output files, the
refusal to time without a GPU, and the sweep and A/B subcommands' candidates and configs.
The timing itself runs only on the GPU machine."""

import inspect
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from pallas_norm import bench
from pallas_norm import config as C
from pallas_norm.bench import ab, cli, peers, run, sweep, timing
from pallas_norm.bench import plan as bench_plan

pytestmark = pytest.mark.cpu_only


def _args(*argv):
  return cli.parser().parse_args(list(argv))


def test_bytes_model():
  assert bench.bytes_model(4096, 1024, 2, "fwd") == 2 * 4096 * 1024 * 2
  assert bench.bytes_model(4096, 1024, 2, "fwdbwd") == 5 * 4096 * 1024 * 2
  assert bench.bytes_model(3, 5, 4, "fwd") == 120
  with pytest.raises(ValueError, match="pass_"):
    bench.bytes_model(1, 1, 2, "bwd")
  assert bench.bytes_model(3, 5, 2, "fwd", "rms_res") == 4 * 30
  assert bench.bytes_model(3, 5, 2, "fwdbwd", "layer_res") == 8 * 30


def test_rotations_cover_four_l2():
  l2 = 60 * 10**6
  for m, n in bench.BENCH_SHAPES:
    r = bench.rotations(m, n, 2, l2)
    assert r >= 1
    assert r * m * n * 2 >= 4 * l2 or r == 64
  assert bench.rotations(16384, 16384, 2, l2) == 1
  assert bench.rotations(4096, 1024, 2, l2) == 29


def test_rotating_step_cycles_and_is_not_rejitted():
  import jax
  import jax.numpy as jnp
  step = jax.jit(lambda x, dy: (x * 2, (dy + 1, x[:1])))
  sets = [(jnp.full((4,), float(i)), jnp.zeros((4,))) for i in range(3)]
  rot = timing.rotating_step(step, sets)
  assert isinstance(rot, jax.stages.Wrapped)  # profiler.measure calls it as it is
  firsts = [float(rot()[0]) for _ in range(4)]
  assert firsts == [0.0, 1.0, 2.0, 0.0]  # the smallest output, from copy i % R


def test_parse_shapes():
  assert bench.parse_shapes("4096x1024,8192x4096") == ((4096, 1024), (8192, 4096))
  assert bench.parse_shapes(" 7X3 , 7x3,") == ((7, 3),)
  for bad in ("4096", "4096x", "ax2", "0x5", "1x2x3", ","):
    with pytest.raises(ValueError):
      bench.parse_shapes(bad)


def test_default_plan():
  plan = bench.build_plan(_args())
  shapes = list(dict.fromkeys((c.m, c.n) for c in plan))
  assert shapes[:8] == list(bench.BENCH_SHAPES)
  assert {(8192, 2048), (8192, 4096), (8192, 5120), (8192, 8192)} <= set(shapes)
  # the decode shapes (issue #58): M = 1, 8, 64, 512 at N = 2048, 4096, 8192, none of
  # them in the two tables above: 8 + 3 new LLM shapes + 12
  assert set(bench_plan.DECODE_SHAPES) <= set(shapes)
  assert {m for m, _ in bench_plan.DECODE_SHAPES} == {1, 8, 64, 512}
  assert len(shapes) == len(set(shapes)) == 23
  impls = {c.impl for c in plan}
  assert {"pallas", "triton", "mosaic", "xla", "flax", "tokamax", "torch", "liger"} <= impls
  assert {f"{b}:{m}" for b in ("pallas", "triton")
          for m in ("reload", "cached", "persistent")} <= impls
  assert {c.op for c in plan} == {"rms", "layer"} and {c.pass_ for c in plan} == {"fwd", "fwdbwd"}
  # The heuristic and the peers of every shape run before the per-mode sweep.
  phases = [c.phase for c in plan]
  assert phases == sorted(phases)
  assert len(plan) == len(set(plan))


def test_plan_filters():
  plan = bench.build_plan(_args("--shapes", "64x128", "--ops", "rms", "--passes", "fwd",
                                "--impls", "pallas:*,xla"))
  assert [(c.impl, c.op, c.pass_, c.m, c.n) for c in plan] == [
      ("xla", "rms", "fwd", 64, 128),
      ("pallas:reload", "rms", "fwd", 64, 128),
      ("pallas:cached", "rms", "fwd", 64, 128),
      ("pallas:persistent", "rms", "fwd", 64, 128)]
  quick = bench.build_plan(_args("--quick"))
  assert not any(c.phase for c in quick)
  assert len({(c.m, c.n) for c in quick}) == 4
  for argv in (("--impls", "nope"), ("--ops", "rms,group"), ("--passes", "bwd")):
    with pytest.raises(ValueError):
      bench.build_plan(_args(*argv))


def _run_cli(*argv, cwd=None):
  return subprocess.run([sys.executable, "-m", "pallas_norm.bench", *argv],
                        capture_output=True, text=True, timeout=300, cwd=cwd,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_cli_help_dry_run_and_gpu_refusal(tmp_path, call_main):
  # python -m once; the rest calls cli.main in this process (the same code, no start-up)
  helped = _run_cli("--help")
  assert helped.returncode == 0 and "sweep" in helped.stdout and "--plot-only" in helped.stdout
  rc, out, err = call_main(cli.main, "--dry-run", "--shapes", "4096x1024")
  assert rc == 0, err
  assert "phase 0 4096x1024" in out and "R=32" in out
  rc, out, err = call_main(cli.main, "--shapes", "64x128", "--out", str(tmp_path / "r.json"))
  assert rc == 2
  assert "needs a GPU" in err
  assert not (tmp_path / "r.json").exists()
  assert call_main(cli.main, "--shapes", "64")[0] == 2  # argparse error


def _synthetic_doc():
  rows = []
  for impl, family, scale in (("pallas", "pallas_norm", 1.1), ("xla", "peer", 1.0),
                              ("tokamax", "peer", 0.9)):
    for n in (128, 1024, 4096):
      gbs = 1000.0 * scale * (1 + n / 4096)
      rows.append({"op": "rms", "pass": "fwd", "m": 4096, "n": n, "dtype": "bf16",
                   "impl": impl, "family": family, "status": "ok", "gbs": gbs,
                   "us": 2 * 4096 * n * 2 / gbs / 1e3, "pct_copy": 100 * gbs / 3000})
  rows.append({"op": "rms", "pass": "fwd", "m": 4096, "n": 128, "dtype": "bf16",
               "impl": "pallas:cached", "family": "pallas_norm", "status": "skipped",
               "reason": "NotImplementedError: too long"})
  meta = {"device": "NVIDIA H200", "dtype": "bf16", "date": "2026-11-21T00:00:00+00:00",
          "copy_gbs": 3000.0, "git_commit": "abc"}
  return {"meta": meta, "rows": rows}


def test_plot_only_redraws_png_and_table(tmp_path, call_main):
  src = tmp_path / "h200.json"
  src.write_text(json.dumps(_synthetic_doc()))
  rc, out, err = call_main(cli.main, "--plot-only", str(src))
  assert rc == 0, err
  png = tmp_path / "h200.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  last = out.strip().splitlines()
  assert last[-1].startswith("pal=pallas")  # the table is printed last
  row = next(line for line in last if line.startswith("rms   fwd    4096x4096"))
  assert row.split()[-1] == "1.10" and "xla" in row  # pallas / best peer (xla)
  assert "skip" in next(line for line in last if line.startswith("rms   fwd    4096x128 "))


def test_plot_only_merges_into_out(tmp_path, call_main):
  a, b = _synthetic_doc(), _synthetic_doc()
  b["rows"] = [dict(r, gbs=r["gbs"] * 2) for r in b["rows"] if r["impl"] == "xla"]
  (tmp_path / "a.json").write_text(json.dumps(a))
  (tmp_path / "b.json").write_text(json.dumps(b))
  out = tmp_path / "merged" / "m.json"
  rc, stdout, err = call_main(cli.main, "--plot-only", str(tmp_path / "a.json"),
                         str(tmp_path / "b.json"), "--out", str(out))
  assert rc == 0, err
  doc = json.loads(out.read_text())
  assert len(doc["rows"]) == len(a["rows"])
  xla = [r for r in doc["rows"] if r["impl"] == "xla"]
  assert all(r["gbs"] > 2000 for r in xla)
  assert out.with_suffix(".csv").read_text().startswith("op,pass,m,n,")
  assert out.with_suffix(".png").exists()
  assert all(s["best_peer"] == "xla" for s in doc["summary"])
  # The merged file names both runs (each row keeps its own run's % of copy).
  assert [m["file"] for m in doc["meta"]["merged_from"]] == ["a.json", "b.json"]
  assert stdout.count("  merged: ") == 2


def test_plot_only_refuses_what_it_cannot_read(tmp_path, call_main):
  """A missing file, a file that is not JSON, and a results file of another script (a
  sweep's) are argparse errors (exit 2) naming the file, not tracebacks."""
  (tmp_path / "bad.json").write_text("{not json")
  (tmp_path / "sweep.json").write_text(json.dumps({"rows": [{"config": "x", "us": 1.0}]}))
  for name, match in (("missing.json", "cannot read it as JSON"),
                      ("bad.json", "cannot read it as JSON"),
                      ("sweep.json", "not a `python -m pallas_norm.bench` kernel result")):
    rc, _, err = call_main(cli.main, "--plot-only", str(tmp_path / name))
    assert rc == 2 and name in err and match in err, err


def test_run_orchestration_on_cpu(tmp_path, monkeypatch, capsys):
  """The run loop end to end on CPU: CUPTI is missing there, so timings are n/a with the
  reason (never a number), --check still compares with the reference, torch rows are
  unavailable, and the files are written."""
  monkeypatch.setattr(timing, "COPY_BYTES", 1 << 16)
  monkeypatch.setattr(bench_plan, "MAX_ROTATIONS", 2)
  out = tmp_path / "cpu.json"
  args = _args("--shapes", "16x256", "--impls", "xla,flax,torch", "--iters", "2", "--check",
               "--out", str(out))
  rc = run.run_plan(args, bench.build_plan(args))
  assert rc == 0
  doc = json.loads(out.read_text())
  assert doc["meta"]["copy_gbs"] is None and "CUPTI" in doc["meta"]["copy_reason"]
  assert doc["meta"]["bytes_model"]["fwd"] == "2*M*N*itemsize"
  assert doc["meta"]["bytes_model"]["fwdbwd"] == "5*M*N*itemsize"
  by = {(r["impl"], r["op"], r["pass"]): r for r in doc["rows"]}
  assert len(by) == 12
  for (impl, op, p), r in by.items():
    if impl == "torch":
      assert r["status"] == "unavailable"
      continue
    assert r["status"] == "n/a" and "CUPTI" in r["reason"] and "us" not in r
    assert r["check"] == "ok", r["check_detail"]
    assert r["bytes"] == bench.bytes_model(16, 256, 2, p)
  assert "dbias" in by[("flax", "layer", "fwdbwd")]["check_detail"]
  assert out.with_suffix(".png").exists() and out.with_suffix(".csv").exists()
  assert capsys.readouterr().out.strip().splitlines()[-1].startswith("xla=xla")


def test_rounds_alternate_implementations(tmp_path, monkeypatch):
  """--rounds: a cell's implementations all compile and pass --check first, then are timed
  round by round in turn (xla, flax, xla, flax, ...); a row's us is the median of all its
  rounds' calls, rounds_us each round's median, the kernels the first round's, after one
  untimed round (xla, flax). The timer is faked (no CUPTI on CPU): call k returns k us
  for each of its calls."""
  monkeypatch.setattr(timing, "COPY_BYTES", 1 << 16)
  monkeypatch.setattr(bench_plan, "MAX_ROTATIONS", 2)
  steps = []
  real = timing.cupti_time

  def fake(step, arg_sets, iters, per_call=False):
    if not per_call:  # the copy's measurement: the real (n/a) one
      return real(step, arg_sets, iters)
    steps.append(step)
    k = float(len(steps))
    return {"us": k, "us_p10": k, "us_p90": k, "kernels": [f"k{len(steps)}"],
            "kernel_us": [k], "per_call_us": [k] * iters}

  monkeypatch.setattr(timing, "cupti_time", fake)
  out = tmp_path / "rounds.json"
  args = _args("--shapes", "16x256", "--ops", "rms", "--passes", "fwd,fwdbwd", "--impls",
               "xla,flax", "--iters", "2", "--rounds", "3", "--check", "--out", str(out))
  assert run.run_plan(args, bench.build_plan(args)) == 0
  assert len(steps) == 16  # 2 cells x 2 implementations x (1 untimed + 3 rounds)
  for cell in (steps[:8], steps[8:]):
    assert cell[0] is cell[2] is cell[4] is cell[6] and cell[1] is cell[3] is cell[5]
    assert cell[0] is not cell[1]
  doc = json.loads(out.read_text())
  by = {(r["impl"], r["pass"]): r for r in doc["rows"]}
  assert [by[("xla", "fwd")][k] for k in ("status", "us", "rounds_us", "kernels")] == [
      "ok", 5.0, [3.0, 5.0, 7.0], ["k3"]]
  assert [by[("flax", "fwdbwd")][k] for k in ("us", "rounds_us", "kernels")] == [
      14.0, [12.0, 14.0, 16.0], ["k12"]]
  assert all(r["check"] == "ok" for r in doc["rows"])
  assert doc["meta"]["rounds"] == 3 and "3 rounds of 2 calls" in doc["meta"]["method"]
  assert "3.000;5.000;7.000" in out.with_suffix(".csv").read_text()
  with pytest.raises(SystemExit):
    cli.main(["--rounds", "0", "--dry-run"])


def _cpu_run(tmp_path, monkeypatch, ops, shape, impls, rotations):
  """The kernel bench's run loop on CPU (interpret mode) with --check: (its plan's
  (impl, pass) pairs, the rows it wrote)."""
  monkeypatch.setattr(timing, "COPY_BYTES", 1 << 16)
  monkeypatch.setattr(bench_plan, "MAX_ROTATIONS", rotations)
  out = tmp_path / "run.json"
  args = _args("--shapes", shape, "--ops", ops, "--impls", impls, "--iters", "2", "--check",
               "--out", str(out))
  plan = bench.build_plan(args)
  assert run.run_plan(args, plan) == 0
  return {(c.impl, c.pass_) for c in plan}, json.loads(out.read_text())["rows"]


@pytest.mark.parametrize("ops,m,bwd_op,detail", [
    ("rms_res,layer_res", 16, "layer_res", "dbias"),
    ("rms_post_res", 8, "rms_post_res", "dscale")], ids=["res", "post_norm"])
def test_residual_ops_on_cpu(tmp_path, monkeypatch, ops, m, bwd_op, detail):
  """The fused residual add ("*_res" ops) and Gemma's post-norm before it
  (rms_post_res): only pallas, xla and flax are planned; their bytes model is 4 (fwd)
  and 8 (fwdbwd) x M*N*itemsize; --check passes for each, forward and backward (six
  outputs for LayerNorm's fwdbwd: y, h, dx, dresidual, dscale, dbias); the post-norm
  op's own title."""
  planned, rows = _cpu_run(tmp_path, monkeypatch, ops, f"{m}x256",
                           "pallas,xla,flax,torch,tokamax", rotations=2)
  assert {i for i, _ in planned} == {"pallas", "xla", "flax"}
  assert len(rows) == 6 * len(ops.split(","))
  for r in rows:
    assert r["check"] == "ok", r
    assert r["bytes"] == {"fwd": 4, "fwdbwd": 8}[r["pass"]] * m * 256 * 2
  bwd = [r for r in rows if r["op"] == bwd_op and r["pass"] == "fwdbwd"][0]
  assert "dresidual" in bwd["check_detail"] and detail in bwd["check_detail"]
  from pallas_norm.bench import report
  assert report._title("rms_post_res") == "RMSNorm post-norm +residual"


def test_fwdbwd_dep_pass_on_cpu(tmp_path, monkeypatch):
  """--passes fwdbwd_dep: the same outputs as fwdbwd (--check against the reference, the
  same bytes), its step holds dy back behind an optimization_barrier on (y, dy), and
  fwdbwd's does not."""
  from pallas_norm.bench import peers
  monkeypatch.setattr(timing, "COPY_BYTES", 1 << 16)
  monkeypatch.setattr(bench_plan, "MAX_ROTATIONS", 2)
  out = tmp_path / "dep.json"
  args = _args("--shapes", "16x256", "--ops", "rms,layer_res", "--passes", "fwdbwd_dep",
               "--impls", "pallas,flax", "--iters", "2", "--check", "--out", str(out))
  plan = bench.build_plan(args)
  assert {c.pass_ for c in plan} == {"fwdbwd_dep"}
  assert run.run_plan(args, plan) == 0
  rows = json.loads(out.read_text())["rows"]
  assert len(rows) == 4
  for r in rows:
    assert r["check"] == "ok", r
    assert r["bytes"] == bench.bytes_model(16, 256, 2, "fwdbwd", r["op"])
  f = peers.jax_fn(bench_plan.IMPL_BY_NAME["flax"], "rms")
  x = jnp.ones((4, 128), jnp.bfloat16)
  s = jnp.ones((128,), jnp.float32)
  prims = lambda p: {str(e.primitive) for e in jax.make_jaxpr(  # noqa: E731
      peers.step_of(f, "rms", p))(x, s, None, x).eqns}
  assert "optimization_barrier" in prims("fwdbwd_dep")
  assert "optimization_barrier" not in prims("fwdbwd")


def test_fp8_ops_plan_and_bytes():
  """--ops fp8 is the eight FP8-output ops, forward only, pallas (heuristic) and xla."""
  plan = bench.build_plan(_args("--shapes", "64x128", "--ops", "fp8", "--impls",
                                "pallas,pallas:*,xla,flax"))
  assert {c.op for c in plan} == set(bench_plan.FP8_OPS) and len(bench_plan.FP8_OPS) == 8
  assert {c.pass_ for c in plan} == {"fwd"} and {c.impl for c in plan} == {"pallas", "xla"}
  assert bench_plan.fp8_variant("layer_fp8_delayed_t") == ("layer", True, True)
  assert bench_plan.fp8_variant("rms") is None
  assert bench.bytes_model(8, 16, 2, "fwd", "rms_fp8") == 3 * 128
  assert bench.bytes_model(8, 16, 2, "fwd", "layer_fp8_delayed_t") == 4 * 128
  assert bench_plan.fp8_design_bytes(8, 16, 2, "rms_fp8_t") == 6 * 128
  assert bench_plan.fp8_design_bytes(8, 16, 2, "rms_fp8_delayed") == 3 * 128
  with pytest.raises(ValueError, match="forward only"):
    bench.bytes_model(8, 16, 2, "fwdbwd", "rms_fp8")


@pytest.mark.parametrize("residual", [False, True], ids=["static", "static_res"])
def test_fp8_static_ops_on_cpu(tmp_path, monkeypatch, residual):
  """rms_fp8_static / layer_fp8_static (W8A8 serving's given scale) and *_fp8_static_res
  (vLLM's fused_add_rms_norm_static_fp8_quant: (x, r) in, y and h out): the step returns
  y (and h) alone, --check passes on it against the jnp chain; bytes the delayed op's
  ((itemsize + 1) * M * N, with the residual (3 * itemsize + 1) * M * N); pallas and xla
  planned, forward only; not in --ops fp8."""
  sfx = "_res" if residual else ""
  assert bench_plan.fp8_variant(f"layer_fp8_static{sfx}") == ("layer", True, False)
  assert bench.bytes_model(8, 16, 2, "fwd", f"rms_fp8_static{sfx}") == (7 if residual else 3) * 128
  assert not set(bench_plan.FP8_STATIC_OPS + bench_plan.FP8_STATIC_RES_OPS) & set(
      bench_plan.FP8_OPS)
  planned, rows = _cpu_run(tmp_path, monkeypatch, f"rms_fp8_static{sfx},layer_fp8_static{sfx}",
                           "16x256", "pallas,xla,flax", rotations=1)
  assert planned == {("pallas", "fwd"), ("xla", "fwd")}
  assert len(rows) == 4
  for r in rows:
    assert r["check"] == "ok", r
    assert r["check_detail"].startswith("y:rel=") and "amax" not in r["check_detail"]
    assert ("h:rel=" in r["check_detail"]) == residual
  f = peers.jax_fn(bench_plan.IMPL_BY_NAME["pallas"], f"rms_fp8_static{sfx}")
  x = jnp.ones((16, 256), jnp.bfloat16)
  out = f((x, x) if residual else x, jnp.ones((256,), jnp.float32), None)
  y = out[0] if residual else out
  assert y.shape == (16, 256) and y.dtype == jnp.float8_e4m3fn
  if residual:
    assert out[1].dtype == jnp.bfloat16 and float(out[1][0, 0]) == 2.0


@pytest.mark.parametrize("op", ["layer_fp8_t", "rms_fp8_delayed_t"])
def test_fp8_ops_on_cpu(tmp_path, monkeypatch, op):
  """An FP8-output op through the run loop (interpret mode): --check against the jnp
  chain passes on every Fp8Norm output the step returns, the bytes model is (itemsize +
  1 + 1) * M * N with the transposed copy. Under delayed scaling the step leaves out
  the given y_scale (a constant of the step, which XLA would copy out with a MemcpyD2D
  that the CUPTI kernel time does not see: peers._fp8_fn)."""
  monkeypatch.setattr(timing, "COPY_BYTES", 1 << 16)
  monkeypatch.setattr(bench_plan, "MAX_ROTATIONS", 1)
  out = tmp_path / "fp8.json"
  args = _args("--shapes", "16x256", "--ops", op, "--impls", "pallas,xla",
               "--iters", "2", "--check", "--out", str(out))
  assert run.run_plan(args, bench.build_plan(args)) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["impl"] for r in rows] == ["pallas", "xla"]
  for r in rows:
    assert r["check"] == "ok", r
    assert "y_t:rel=" in r["check_detail"] and "amax:rel=" in r["check_detail"]
    assert ("y_scale:" in r["check_detail"]) == ("delayed" not in op), r["check_detail"]
    assert r["bytes"] == 4 * 16 * 256
  f = peers.jax_fn(bench_plan.IMPL_BY_NAME["pallas"], op)
  x = jnp.ones((16, 256), jnp.bfloat16)
  leaves = jax.tree.leaves(jax.eval_shape(f, x, x[0], x[0]))
  assert len(leaves) == len(run._fp8_names(op)) == (5 if "delayed" in op else 6)


def test_check_flags_a_wrong_output():
  import jax.numpy as jnp
  ref = jnp.linspace(-3, 3, 512, dtype=jnp.float32).reshape(2, 256)
  assert run.compare(ref.astype(jnp.bfloat16), ref, "bf16")["check"] == "ok"
  assert run.compare(ref * 1.1, ref, "bf16")["check"] == "FAIL"
  assert run.compare(ref.at[0, 0].set(jnp.nan), ref, "bf16")["check"] == "FAIL"


def test_cupti_time_reports_each_kernels_median(monkeypatch):
  """The call's time is the median of the per-call sums; each kernel gets its own median
  (ms from the profiler, us out), in launch order."""
  calls = [[("fwd", 0.010), ("bwd", 0.020)], [("fwd", 0.012), ("bwd", 0.030)],
           [("fwd", 0.011), ("bwd", 0.025)]]

  class FakeProfiler:
    @staticmethod
    def measure(fn, aggregate, iterations):
      assert aggregate is False and iterations == 3
      return lambda: (None, calls)

  monkeypatch.setattr(timing, "profiler", lambda: FakeProfiler)
  out = timing.cupti_time(lambda x: x, [(1,)], 3)
  assert out["kernels"] == ["fwd", "bwd"]
  assert out["us"] == pytest.approx(36.0)  # sums 30, 42, 36
  assert out["kernel_us"] == pytest.approx([11.0, 25.0])


def _fake_tokamax_vjp(monkeypatch, with_block=True):
  """A stand-in for tokamax's pallas_triton_vjp module: its VJP launches through
  block.pallas_call with dx aliased onto x, as tokamax 0.0.12 does."""
  import types
  calls = []
  block = types.SimpleNamespace(
      pallas_call=lambda kernel, **kw: calls.append(kw) or kernel, other="kept")
  tv = types.ModuleType("tokamax._src.ops.normalization.pallas_triton_vjp")

  class Vjp:
    def _fwd(self, x, *, config=None):
      del config
      return tv.block.pallas_call(x, grid=(1,), input_output_aliases={1: 0}), tv.block.other

  tv.PallasTritonNormalizationVjp = Vjp
  if with_block:
    tv.block = block
  names = ["tokamax", "tokamax._src", "tokamax._src.ops", "tokamax._src.ops.normalization"]
  for name in names:
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
  monkeypatch.setitem(sys.modules, tv.__name__, tv)
  monkeypatch.setattr(sys.modules[names[-1]], "pallas_triton_vjp", tv, raising=False)
  return tv, block, calls


def test_tokamax_vjp_without_alias_drops_only_the_alias(monkeypatch):
  tv, block, calls = _fake_tokamax_vjp(monkeypatch)
  vjp = peers.tokamax_vjp_without_alias()
  assert isinstance(vjp, tv.PallasTritonNormalizationVjp)
  # tokamax binds arguments by the signature of _fwd (it drops "config" from it).
  assert list(inspect.signature(vjp._fwd).parameters) == ["x", "config"]
  assert vjp._fwd("kernel") == ("kernel", "kept")  # other attributes pass through
  assert calls == [{"grid": (1,)}]  # same launch, no input_output_aliases
  assert tv.block is block  # the module is restored after the trace
  tv.PallasTritonNormalizationVjp()._fwd("kernel")  # tokamax's own VJP keeps its alias
  assert calls[-1] == {"grid": (1,), "input_output_aliases": {1: 0}}


def test_tokamax_vjp_without_alias_refuses_an_unknown_tokamax(monkeypatch):
  _fake_tokamax_vjp(monkeypatch, with_block=False)
  with pytest.raises(RuntimeError, match="dx-onto-x alias"):
    peers.tokamax_vjp_without_alias()


def test_sweep_grids_keep_their_candidates():
  """Every grid builds configs for the shapes it was run on (132 SMs, as on an H100 or
  H200), and the grids folded from one-off scripts keep their candidates."""
  from pallas_norm import config as C
  for name, grid in sweep.GRIDS.items():
    for kern in grid.kernels.split(","):
      cls = C.ForwardConfig if kern == "fwd" else C.BackwardConfig
      for shape in grid.shapes.split(",")[:3]:
        m, n = map(int, shape.split("x"))
        cands = getattr(grid, kern)(m, n, 132, grid.ops.split(",")[0])
        assert cands and all(isinstance(c, cls) for c in cands), (name, shape)
  programs = sweep.GRIDS["narrow-bwd-programs"].bwd(32768, 128, 132, "rms")
  assert [c.num_programs for c in programs] == [528, 512, 384, 264, 256, 128] * 2
  split = sweep.GRIDS["split"].fwd(4096, 65536, 132, "rms")
  assert [(c.block_n, c.num_warps) for c in split[1:]] == [
      (8192, 4), (8192, 8), (8192, 16), (16384, 8), (16384, 16)]
  split_bwd = sweep.GRIDS["split-bwd"].bwd(4096, 65536, 132, "rms")
  lags = {(c.block_n, c.num_warps, c.split_lag) for c in split_bwd if c.split_rows}
  assert {(2048, 4, lag) for lag in range(4)} <= lags
  stages = sweep.GRIDS["reload-bwd-stages"].bwd(16384, 16384, 132, "rms")
  assert {c.num_stages for c in stages if c.reload_rows} == {1, 2, 3}
  assert sweep.main(["--grid", "split", "--shapes", "4096x65536", "--dry-run"]) == 0
  for argv in (["--grid", "split", "--kernels", "bwd"], ["--ops", "group"]):
    with pytest.raises(SystemExit):
      sweep.main(argv + ["--dry-run"])


def test_ab_builds_every_config_kind(capsys):
  """``ab fwd`` / ``ab bwd`` parse each config spec into the launch config it names, and
  refuse a bad spec before any timing; the GPU-only A/Bs refuse to run on the CPU."""
  f = ab._fwd_config("psplit", [1024, 1, 8, 3, 1], 4096, 65536, True, 132)
  assert (f.mode, f.block_n, f.num_programs, f.split_rows, f.split_lag,
          f.split_early_publish) == ("static_persistent", 1024, 16, True, 3, True)
  b = ab._bwd_config("split", [512, 1, 20, 1, 0, 3, 2, 1], 4096, 65536, True, 132)
  assert (b.block_m, b.block_n, b.num_programs, b.split_lag, b.split_early_publish) == (
      2, 512, 20, 3, True)
  p = ab._bwd_config("pieces", [1, 8, 2, 2048, 1024], 8192, 3072, True, 132)
  assert (p.block_n, p.pieces, p.num_programs) == (4096, (2048, 1024), 264)
  specs = {"fwd": "default;psplit:1024,1,8;cached:8192,4,4096,2@nocg;tile:2,2048,4;"
                  "persistent:16384,16,4;reload:4096,8@cgall",
           "bwd": "default;split:512,1,20,1,0;reload:1,4096,16,1;tile:1,8192,16,1;"
                  "tileg:1,8192,16,128;pieces:1,8,2,2048,1024;pair:4096,16,2"}
  for kernel, configs in specs.items():
    assert ab.main([kernel, "--op", "layer", "--shapes", "8192x3072", "--configs", configs,
                    "--dry-run"]) == 0
    assert capsys.readouterr().out.count(f"{kernel} layer 8192x3072") == configs.count(";") + 1
  # --residual: "default" is config.py's residual pick
  res_default = ab._bwd_config("default", [], 8192, 8192, True, 132, residual=True)
  assert res_default == C.backward_config(8192, 8192, jnp.bfloat16, subtract_mean=True,
                                          residual=True)
  assert ab.main(["bwd", "--op", "layer", "--residual", "--shapes", "64x128", "--configs",
                  "default;tile:2,128,4,1", "--dry-run"]) == 0
  assert capsys.readouterr().out.count("bwd layer 64x128") == 2
  with pytest.raises(SystemExit):
    ab.main(["bwd", "--op", "rms", "--shapes", "64x128", "--configs", "nope:1", "--dry-run"])
  assert ab.main(["triton", "--variant", "pallas"]) == 2
  assert "needs a GPU" in capsys.readouterr().err


def test_ab_backward_tags_set_the_few_row_kernels_fields():
  """A backward spec's tags: "@fr" the one-kernel backward, "@cb<m>.<n>" its column
  programs' tile, "@w<k>" the warps; the untagged spec keeps the kind's values."""
  import argparse
  args = argparse.Namespace(kernel="bwd", op="rms", residual=False, shapes="64x8192",
                            configs="tileg:1,8192,16,64;tileg:1,8192,16,64@fr@cb64.256@w8")
  plain, tagged = ab._configs(args, 132).values()
  assert (plain.fused_reduce, plain.num_warps) == (False, 16)
  assert (tagged.fused_reduce, tagged.column_block_m, tagged.column_block_n,
          tagged.num_warps, tagged.num_programs) == (True, 64, 256, 8, 64)


def test_git_commit_says_dirty(tmp_path, monkeypatch):
  """The results' commit: HEAD, "-dirty" where a tracked file differs from it (the GPU
  machine's copy of a working tree whose git metadata lags), the variable first."""
  monkeypatch.delenv("PALLAS_NORM_GIT_COMMIT", raising=False)
  git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t",
                                   *a], cwd=tmp_path, check=True, capture_output=True,
                                  text=True).stdout.strip()
  git("init", "-q")
  (tmp_path / "f.py").write_text("a = 1\n")
  git("add", "f.py")
  git("commit", "-q", "-m", "one")
  sha = git("rev-parse", "HEAD")
  assert timing.git_commit(cwd=tmp_path) == sha
  assert timing.git_commit(short=True, cwd=tmp_path) == sha[:7]
  (tmp_path / "f.py").write_text("a = 2\n")
  assert timing.git_commit(cwd=tmp_path) == sha + "-dirty"
  monkeypatch.setenv("PALLAS_NORM_GIT_COMMIT", "abc")
  assert timing.git_commit(cwd=tmp_path) == "abc"
  assert timing.git_commit(cwd=tmp_path / "nowhere") == "abc"
  monkeypatch.delenv("PALLAS_NORM_GIT_COMMIT")
  assert timing.git_commit(cwd=tmp_path.parent / "not-a-repo-") == "unknown"


def test_pallas_untuned_serves_the_fp8_ops():
  """``pallas-untuned`` runs the FP8-output ops on the Pallas kernels (the tuned against
  untuned bench of their table entries); its run refused them before (2026-11-29)."""
  impl = bench_plan.IMPL_BY_NAME["pallas-untuned"]
  assert bench_plan.serves(impl, "rms_fp8_static") and bench_plan.serves(impl, "layer_fp8_static_res")
  f = peers.jax_fn(impl, "rms_fp8_static")
  x = jnp.ones((8, 256), jnp.bfloat16)
  y = f(x, jnp.ones((256,), jnp.float32), None)
  assert y.dtype == jnp.float8_e4m3fn and y.shape == x.shape
  with pytest.raises(NotImplementedError):
    peers.jax_fn(bench_plan.IMPL_BY_NAME["flax"], "rms_fp8_static")(x, x[0], None)


def _pallas_call_outputs(closed):
  """Output counts of every pallas_call in a (closed) jaxpr, nested ones included."""
  found = []

  def walk(j):
    j = getattr(j, "jaxpr", j)
    for eqn in j.eqns:
      if eqn.primitive.name == "pallas_call":
        found.append(len(eqn.outvars))
      for p in eqn.params.values():
        for sub in p if isinstance(p, (tuple, list)) else (p,):
          if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
            walk(sub)
  walk(closed)
  return found


def test_static_ops_run_the_y_only_kernel():
  """The W8A8 static ops time the serving op, stats=False (one kernel, y its one
  output); *_fp8_static_stats the same op with stats=True (y and the mean, rstd and
  amax outputs), the A/B of the two."""
  impl = bench_plan.IMPL_BY_NAME["pallas"]
  x = jnp.ones((8, 256), jnp.bfloat16)
  s = jnp.ones((256,), jnp.float32)
  lean = jax.make_jaxpr(peers.jax_fn(impl, "rms_fp8_static"))(x, s, None)
  full = jax.make_jaxpr(peers.jax_fn(impl, "rms_fp8_static_stats"))(x, s, None)
  assert _pallas_call_outputs(lean) == [1] and _pallas_call_outputs(full) == [4]
  assert bench_plan.fp8_variant("layer_fp8_static_stats") == ("layer", True, False)
  assert bench_plan.fp8_static("layer_fp8_static_stats")
