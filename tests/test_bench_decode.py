"""CPU tests of pallas_norm.bench.decode (``--decode``): the plan, the argument errors, the
refusal to time without a GPU, the weights as arguments of the jitted step, and a smoke
run of the three variants at toy sizes whose outputs agree (no timing claims: the timed
run is on the GPU)."""

import json

import jax
import pytest

from pallas_norm import bench
from pallas_norm.bench import decode

pytestmark = pytest.mark.cpu_only

_TOY = {"qwen3": "base=qwen3-2048,d=64,layers=1,heads=4,kv_heads=2,head_dim=16,ffn=64,cache=4",
        "gemma": "base=gemma-2048,d=64,layers=1,heads=2,kv_heads=1,head_dim=32,ffn=64,cache=4"}


def test_dry_run_prints_every_config_and_batch(call_main):
  rc, out, err = call_main(bench.main, "--decode", "--dry-run")
  assert rc == 0, err
  assert "20 cases x 3 variants" in out  # 5 configs x B = 1, 8, 64, 512
  for name in decode.CONFIGS:
    assert name in out
  # Qwen3 4096 at B=512: 9 norms of [512, 4096] (2 a layer and the final one), and the
  # QK-norm's 32 and 8 heads a token over head_dim 128
  assert "9 x [512, 4096], 4 x [16384, 128], 4 x [4096, 128]" in out
  rc, out, _ = call_main(bench.main, "--decode", "--dry-run", "--configs", "gemma-2048",
                         "--batches", "8", "--layers", "2")
  # Gemma: pre- and post-norms, 4 a layer, then the final norm
  assert rc == 0 and "layers=2" in out and "9 x [8, 2048], 2 x [64, 256]" in out


@pytest.mark.parametrize("argv, match", [
    (["--configs", "mistral-4096"], "not in"),
    (["--config", "base=qwen3-4096,width=3"], "unknown keys"),
    (["--config", "base=llama-2048,heads=5"], "multiple of kv_heads"),
    (["--variants", "flax,fusd"], "choose from flax,pallas_norm,pallas_norm_fused"),
    (["--batches", "1,x"], "comma list of integers"),
    (["--batches", "0"], "positive"),
    (["--rounds", "0"], "--rounds=0 must be >= 1"),
])
def test_bad_arguments_are_usage_errors(argv, match, call_main):
  rc, _, err = call_main(decode.main, "--dry-run", *argv)
  assert rc == 2 and match in err, err


def test_timing_needs_a_gpu(call_main):
  rc, _, err = call_main(bench.main, "--decode", "--configs", "llama-2048")
  assert rc == 2 and "needs a GPU" in err and "--dry-run" in err


def test_weights_are_arguments_not_constants():
  """The jitted step's jaxpr, nested jaxprs included, holds no constant: the parameters
  and the cache come in as arguments. The same model with its parameters closed over
  holds them all (the check sees what it must)."""
  from flax import nnx
  cfg = decode.e2e.parse_config(_TOY["qwen3"], decode.CONFIGS)
  steps, params = decode.build(cfg)
  cache, x = decode.inputs(cfg, 2)
  for v, step in steps.items():
    assert decode.const_bytes(jax.make_jaxpr(step)(params, cache, x)) == 0, v
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: decode._model_cls()(cfg, "flax",
                                                                      rngs=nnx.Rngs(0))))
  closed = jax.jit(lambda x: nnx.merge(graphdef, params)(x, cache))
  captured = decode.const_bytes(jax.make_jaxpr(closed)(x))
  assert captured >= decode.weight_bytes(cfg), (captured, decode.weight_bytes(cfg))


def test_smoke_run_on_cpu(tmp_path, call_main):
  """The Qwen3 and Gemma styles at toy sizes, B = 1 and 3, every variant (the Llama style
  is Qwen3's block without the QK-norms: kept out for CI time): the rows carry the step
  time, the speedup against flax, no constants, (no CUPTI here) the reason the breakdown
  is missing, and outputs within two bf16 ulps of flax's."""
  out = tmp_path / "decode.json"
  rc, stdout, err = call_main(
      bench.main, "--decode", "--allow-cpu", "--configs", "", "--config", _TOY["qwen3"],
      "--config", _TOY["gemma"], "--batches", "1,3", "--rounds", "1", "--samples", "2",
      "--chain", "1", "--warmup", "0", "--out", str(out), "--hlo-dir", str(tmp_path / "hlo"))
  assert rc == 0, err
  hlo = sorted(p.name for p in (tmp_path / "hlo").iterdir())
  assert len(hlo) == 2 * 2 * len(decode.VARIANTS)  # (config, B) x variant
  fused = next((tmp_path / "hlo").glob("decode_*_B3_pallas_norm_fused.hlo.txt")).read_text()
  assert fused.startswith("HloModule") and "pallas_norm_fwd" in fused
  rows = json.loads(out.read_text())["rows"]
  assert [(r["style"], r["batch"], r["variant"]) for r in rows] == [
      (s, b, v) for s in ("qwen3", "gemma") for b in (1, 3) for v in decode.VARIANTS]
  for r in rows:
    assert r["us"] > 0 and r["samples"] == 2 and r["const_bytes"] == 0
    assert r["breakdown"]["status"] == "n/a" and "CUPTI" in r["breakdown"]["reason"]
    assert r["norm_fusions"] > 0
    # y has RMS 1 (unit gamma), so |y| <= sqrt(d) = 8, where a bf16 ulp is at most 2**-5
    assert r["max_abs_diff"] <= 2 * 2**-5, r
    if r["variant"] == "flax":
      assert r["speedup"] == 1.0 and r["max_abs_diff"] == 0.0
  assert out.with_suffix(".png").exists() and f"wrote {out}" in stdout


def test_keep_command_buffers(monkeypatch):
  """--command-buffers drops the bench's flag (XLA's default command buffers again) and
  keeps the user's flags; after the backend started it is an error, not a no-op."""
  from pallas_norm.bench import timing
  jax.devices()
  with pytest.raises(RuntimeError, match="started its backend"):
    timing.keep_command_buffers()
  monkeypatch.setattr(timing, "_backend_started", lambda: False)
  monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x {timing.COMMAND_BUFFER_FLAG}")
  timing.keep_command_buffers()
  import os
  assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
