"""CPU tests of ``python -m pallas_norm.bench --sharded``: the plan, the HLO collective count,
and one whole run on two fake CPU devices (interpret mode, wall clock). Fake devices must be
set before jax starts, so the run is a subprocess."""

import json
import os
import subprocess
import sys

import jax
import pytest

from pallas_norm.bench import sharded as bench_sharded

pytestmark = pytest.mark.cpu_only

_ERR_TOL = {"y": 0.05, "dx": 0.1}  # bf16, [2, 8, 128]: max |pallas_norm - XLA|


def _run_cli(*argv):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  return subprocess.run([sys.executable, "-m", "pallas_norm.bench", "--sharded", *argv],
                        capture_output=True, text=True, timeout=300, env=env)


def test_parse_shapes():
  assert bench_sharded.parse_shapes("16x4096x4096, 2X8x128,16x4096x4096") == (
      (16, 4096, 4096), (2, 8, 128))
  for bad in ("16x4096", "0x8x128", "ax8x128", "1x2x3x4", ","):
    with pytest.raises(ValueError):
      bench_sharded.parse_shapes(bad)


def test_collectives_count_opcodes_not_names():
  hlo = "\n".join([
      "%all-reduce.1 = f32[128]{0} all-reduce(%p), channel_id=1, to_apply=%add",
      "%psum.7 = (f32[128]{0}, f32[128]{0}) all-reduce(%a, %b), to_apply=%add",
      "%ags = (f32[4]{0}, f32[8]{0}) all-gather-start(%x), dimensions={0}",
      "%agd = f32[8]{0} all-gather-done(%ags)",
      "%fusion = f32[8]{0} fusion(%all-reduce.1), calls=%all-gather.fused",
      "%cp = f32[8]{0} collective-permute(%x), metadata={op_name=\"ppermute\"}",
  ])
  assert bench_sharded.collectives(hlo) == {
      "all-gather": 1, "all-reduce": 2, "reduce-scatter": 0, "all-to-all": 0,
      "collective-permute": 1}


def test_help_and_dry_run_plan_every_cell_without_a_gpu(call_main):
  rc, out, _ = call_main(bench_sharded.main, "--help")
  assert rc == 0 and "--axis-types" in out
  rc, out, err = call_main(bench_sharded.main, "--dry-run", "--shapes", "16x4096x4096")
  assert rc == 0, err
  ndev = max(2, jax.device_count())  # one CPU device here: planned as the 2 of a GPU pair
  assert "plan: 24 cells" in out
  assert f'dp x P("data", None, None) local [{16 * 4096 // ndev}, 4096]' in out
  assert f'tp x P(None, None, "model") local [65536, {4096 // ndev}]' in out
  rc, _, err = call_main(bench_sharded.main, "--dry-run", "--shapes", "3x8x128")
  assert rc == 2 and "unevenly" in err


def test_refuses_cpu_without_allow_cpu(tmp_path, call_main):
  rc, _, err = call_main(bench_sharded.main, "--shapes", "2x8x128", "--out", str(tmp_path))
  assert rc == 2
  assert "needs >= 2 GPUs" in err
  assert not list(tmp_path.iterdir())


def test_cpu_run_writes_every_cell(tmp_path):
  # RMSNorm only (CI time): LayerNorm's sharded paths are tests/sharded's.
  proc = _run_cli("--allow-cpu", "--shapes", "2x8x128", "--iters", "2", "--ops", "rms",
                  "--out", str(tmp_path))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  (result,) = tmp_path.glob("cpu_*_sharded_*.json")
  assert result.with_suffix(".png").stat().st_size > 0
  doc = json.loads(result.read_text())
  assert doc["meta"]["device"] == "cpu" and doc["meta"]["device_count"] == 2
  rows = doc["rows"]
  keys = {(r["op"], r["pass"], r["layout"], r["axis_type"], r["impl"]) for r in rows}
  assert keys == {(op, p, lay, at, impl) for op in ("rms",)
                  for p in ("fwd", "fwdbwd", "fwdbwd_dep")
                  for lay in ("dp", "tp") for at in ("auto", "explicit")
                  for impl in ("pallas_norm", "xla")}
  for r in rows:
    assert r["status"] == "ok", r
    assert r["method"] == "wall" and r["samples"] >= 30 and r["us"] > 0
    assert set(r["collectives"]) == set(bench_sharded.COLLECTIVES)
    assert r["local"] == ([8, 128] if r["layout"] == "dp" else [16, 64])
    if r["layout"] == "dp":
      assert r["single_us"] > 0 and r["dp_over_single"] > 0
  for r in (r for r in rows if r["impl"] == "pallas_norm"):
    assert r["collectives"]["all-gather"] == 0, r
    assert r["speedup"] > 0 and r["check"] == "ok", r
    assert r["err_y"] <= _ERR_TOL["y"], r
    if r["pass"] != "fwd":
      assert r["err_dx"] <= _ERR_TOL["dx"], r
      assert set(r["err"]) == ({"y", "dx", "dscale", "dbias"} if r["op"] == "layer"
                               else {"y", "dx", "dscale"})
    else:
      assert r["err_dx"] is None
    if r["layout"] == "tp":  # the statistics cross the hidden shards
      assert r["collectives"]["all-reduce"] >= 1, r
  assert "speedup = xla us / ours" in proc.stdout
