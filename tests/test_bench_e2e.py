"""CPU tests of pallas_norm.bench.e2e (``--e2e``): configs, the kernel classification,
and a smoke run of the three styles at toy sizes (no timing claims: the timed run is on
the GPU)."""

import json

import pytest

from pallas_norm import bench
from pallas_norm.bench import e2e as bench_e2e

pytestmark = pytest.mark.cpu_only

_TOY = "d=32,layers=1,heads=2,kv_heads=1,head_dim=16,ffn=64,seq=8,batch=1,vocab=64"


def test_parse_config():
  assert bench_e2e.parse_config("qwen3") is bench_e2e.CONFIGS["qwen3"]
  c = bench_e2e.parse_config("base=gemma,d=256,layers=2,eps=1e-5")
  assert (c.name, c.style, c.d, c.layers, c.eps, c.head_dim) == ("custom_gemma", "gemma",
                                                                  256, 2, 1e-5, 256)
  with pytest.raises(ValueError, match="unknown keys"):
    bench_e2e.parse_config("base=llama,width=3")
  with pytest.raises(ValueError, match="not one of"):
    bench_e2e.parse_config("mistral")


@pytest.mark.parametrize("argv, match", [
    (["--config", "mistral"], "not one of"),
    (["--config", "base=mistral,d=32"], "base='mistral' is not one of"),
    (["--config", "base=qwen3,d=abc"], "d='abc' is not an integer"),
    (["--config", "d=32,layers"], "is not key=value"),
    (["--config", "base=llama,style=dense"], "style='dense' is not one of"),
    (["--variants", "bogus"], "choose from flax,pallas,fused"),
    (["--variants", "flax,fusd"], "choose from flax,pallas,fused"),  # a typo: not dropped
    (["--fp8-dense", "--variants", "fused"], "choose from flax,pallas,fp8,fp8_current"),
    (["--rounds", "0"], "--rounds=0 must be >= 1"),
])
def test_bad_arguments_are_usage_errors(argv, match, call_main):
  """Every bad --config / --variants / count is an argparse error (exit 2) before any
  model is built, on any machine."""
  rc, _, err = call_main(bench_e2e.main, "--allow-cpu", *argv)
  assert rc == 2 and match in err, err


def test_classify_and_norm_fusions():
  hlo = "\n".join([
      'ENTRY %main {',
      '  %loop_add_fusion.3 = bf16[4,8] fusion(%a, %b), kind=kLoop, calls=%fused_add.3, '
      'metadata={op_name="jit(step)/jvp(Model)/pn_norm/add"}',
      '  %input_reduce_fusion.1 = f32[4] fusion(%c), kind=kInput, calls=%f, '
      'metadata={op_name="jit(step)/loss/reduce_sum"}',
      '}'])
  names = bench_e2e.norm_fusions(hlo)
  assert "loop_add_fusion_3" in names and "input_reduce_fusion_1" not in names
  assert bench_e2e.classify("loop_add_fusion_3", names) == "norm"
  assert bench_e2e.classify("pallas_norm_fwd_cached", names) == "norm"
  assert bench_e2e.classify("input_reduce_fusion_1", names) == "other"
  assert bench_e2e.classify("sm90_xmma_gemm_bf16bf16_bf16f32", names) == "gemm"
  assert bench_e2e.classify("cudnn_generated_fort_native_sdpa", names) == "attention"


def test_breakdown_counts_launches(monkeypatch):
  """The breakdown of one step from a faked CUPTI profile (no CUPTI on CPU): time by
  category (median of the iterations), the launches of one step by category."""
  from pallas_norm.bench import timing
  step_kernels = [("pallas_norm_fwd_cached", 0.002), ("sm90_xmma_gemm_bf16", 0.010),
                  ("pallas_norm_fwd_cached", 0.003), ("loop_add_fusion_3", 0.001),
                  ("input_concatenate_fusion", 0.004)]

  class Profiler:
    @staticmethod
    def measure(fn, aggregate, iterations):
      return lambda: (None, [list(step_kernels) for _ in range(iterations)])
  monkeypatch.setattr(timing, "profiler", lambda: Profiler)
  hlo = '  %loop_add_fusion.3 = bf16[4] fusion(%a), metadata={op_name="x/pn_norm/add"}'
  b = bench_e2e._breakdown(lambda *a: None, (), hlo)
  assert b["launches"] == {"norm": 3, "gemm": 1, "attention": 0, "other": 1, "total": 5}
  assert b["norm"] == pytest.approx(6.0) and b["gemm"] == pytest.approx(10.0)
  assert b["norm_kernels"] == ["loop_add_fusion_3", "pallas_norm_fwd_cached"]
  assert b["other_top"] == [["input_concatenate_fusion", 4.0]]


def test_smoke_run_on_cpu(tmp_path):
  """The Qwen3 and Gemma styles train a few toy steps with flax's norms and with the fused
  residual (the drop-in variant is the same layers without ``residual=``, covered by the
  flax layer tests; it and the Llama style, Qwen3's block without the QK-norms, are kept
  out for CI time); the rows carry the step time, tokens/s, the
  speedup against flax, temp memory and (no CUPTI here) the reason the breakdown is
  missing; the fused losses agree with flax's."""
  out = tmp_path / "e2e.json"
  argv = ["--e2e", "--allow-cpu", "--rounds", "1", "--steps", "2", "--chain", "1",
          "--warmup", "1", "--variants", "flax,fused",
          "--attention", "xla", "--out", str(out)]
  # Qwen3's block is Llama's plus the QK-norms; Gemma's has cast="gemma" (CI time).
  for style in ("qwen3", "gemma"):
    argv += ["--config", f"base={style},{_TOY}"]
  assert bench.main(argv) == 0
  doc = json.loads(out.read_text())
  rows = doc["rows"]
  assert [(r["style"], r["variant"]) for r in rows] == [
      (s, v) for s in ("qwen3", "gemma") for v in ("flax", "fused")]
  for r in rows:
    assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["samples"] == 2
    assert r["breakdown"]["status"] == "n/a" and "CUPTI" in r["breakdown"]["reason"]
    assert r["norm_fusions"] > 0
  for s in ("qwen3", "gemma"):
    by = {r["variant"]: r for r in rows if r["style"] == s}
    assert by["flax"]["speedup"] == 1.0
    # the same model, the same data: the losses after the same steps agree
    assert abs(by["fused"]["loss"] - by["flax"]["loss"]) < 2e-2, (s, by)
  assert out.with_suffix(".png").exists()


def test_fp8_dense_smoke_run_on_cpu(tmp_path):
  """--fp8-dense: the norm -> dense stack with flax's bf16 layers and with
  RMSNormDenseFP8 (delayed scaling, its state carried through the steps) at toy sizes;
  the same init, so the losses after the same steps agree within FP8 rounding; no cuBLAS
  calls on a CPU."""
  out = tmp_path / "e2e_fp8.json"
  argv = ["--e2e", "--fp8-dense", "--allow-cpu", "--rounds", "1", "--steps", "2",
          "--chain", "1", "--warmup", "1", "--variants", "flax,fp8",
          "--config", "base=d4096,d=64,layers=2,seq=8,batch=2", "--out", str(out)]
  assert bench.main(argv) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["style"], r["variant"], r["d"]) for r in rows] == [("dense", "flax", 64),
                                                                 ("dense", "fp8", 64)]
  for r in rows:
    assert r["step_ms"] > 0 and r["samples"] == 2 and r["gemm_calls"] == {}
  flax, fp8 = (r["loss"] for r in rows)
  assert abs(fp8 - flax) < 0.05 * flax, (flax, fp8)
