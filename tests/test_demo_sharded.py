"""pallas_norm.demo data parallel: 4 (fake CPU) devices train as one device does.

The device count of the CPU platform is fixed when jax starts, so each run is its own
process with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``: one through the CLI
with ``--devices 4`` (data parallel), one with ``--devices 1`` (one device, on the same
4-device host). The two run concurrently; each writes what it saw to a JSON file.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

# Fake CPU devices in subprocesses: CPU behaviour (the 2-GPU data-parallel path is what
# tests/sharded checks on the GPUs), so gpu-check skips it.
pytestmark = pytest.mark.cpu_only

_DEVICES = 4
_BATCH, _SEQ = 8, 16
_TINY = ["--steps", "8", "--batch", str(_BATCH), "--seq", str(_SEQ), "--d-model", "16",
         "--layers", "1", "--heads", "2", "--no-progress"]

# Runs in the subprocess: argv = [json path, png folder, --devices N]. Calls demo.main
# with train spied on (as tests/test_demo.py does), then probes the --devices errors.
_RUNNER = r"""
import contextlib, dataclasses, io, json, sys
import jax
from pallas_norm import demo

out_path, png_dir, *flags = sys.argv[1:]
runs, real_train = [], demo.train

def spy(cfg, text=None):
  runs.append(real_train(dataclasses.replace(cfg, eval_batches=1, sample_chars=8), text))
  return runs[-1]

demo.train = spy
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
  rc = demo.main(TINY + ["--out", png_dir] + flags)
(r,) = runs

def run_facts(run):
  sh = run.batch_sharding
  return {"losses": run.losses.tolist(), "train_loss": run.train_loss,
          "heldout_loss": run.heldout_loss,
          "batch_spec": None if sh is None else list(sh.spec),
          "batch_devices": None if sh is None else len(sh.device_set),
          "batch_shard_shape": None if sh is None else list(sh.shard_shape((BATCH, SEQ)))}

errors = {}
for argv in (["--batch", "8", "--devices", "3"], ["--devices", "5"]):
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err):
      demo.main(argv)
  except SystemExit as e:
    errors[" ".join(argv)] = [e.code, err.getvalue()]
fallback = demo.data_parallel_devices(demo.DemoConfig(batch=6))

with open(out_path, "w") as f:
  json.dump({"rc": rc, "printed": printed.getvalue(), "local": jax.local_device_count(),
             "num_devices": r.num_devices,
             "mesh": None if r.mesh is None else dict(r.mesh.shape),
             "pallas": run_facts(r.pallas), "flax": run_facts(r.flax),
             "samples": r.samples, "errors": errors, "fallback": list(fallback)}, f)
"""


@pytest.fixture(scope="session")
def runs(run_once):
  """{devices: what the run with --devices devices saw}, both on a 4-device CPU host."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={_DEVICES}").strip())
  code = f"TINY = {_TINY!r}\nBATCH, SEQ = {_BATCH}, {_SEQ}\n" + _RUNNER

  def compute(tmp):
    procs = {}
    for n in (_DEVICES, 1):
      procs[n] = subprocess.Popen(
          [sys.executable, "-c", code, str(tmp / f"{n}.json"), str(tmp / f"png{n}"),
           "--devices", str(n)],
          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for n, p in procs.items():
      _, err = p.communicate(timeout=600)
      assert p.returncode == 0, f"--devices {n} run failed:\n{err[-4000:]}"

  tmp = run_once("demo_sharded", compute)
  results = {}
  for n in (_DEVICES, 1):
    with open(tmp / f"{n}.json") as f:
      results[n] = json.load(f)
  return results


def test_data_parallel_losses_match_one_device(runs):
  """Same init, same batches: 4-way data parallel gives one device's loss curves.

  Tolerance: what changes is only the order of float32 sums (each device's partial
  batch mean and gradients, then the all-reduces, including pallas_norm's psum of
  dscale). Measured over these 8 AdamW steps: max |Δ loss| 9.5e-7, max relative 2.1e-7
  (about 2 ulps), pallas and flax alike. rtol=1e-5 leaves ~50x room for other
  reduction orders, and is still ~10x under a real bug: dropping pallas_norm's dscale
  psum (each device keeping its own rows' sum) moves the losses by 9e-5 relative from
  the second step, and by up to 7e-4 by the eighth.
  """
  dp, one = runs[_DEVICES], runs[1]
  for norm in ("pallas", "flax"):
    a, b = np.asarray(dp[norm]["losses"]), np.asarray(one[norm]["losses"])
    assert a.shape == (8,) and np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=0, err_msg=norm)
    for k in ("train_loss", "heldout_loss"):
      np.testing.assert_allclose(dp[norm][k], one[norm][k], rtol=1e-5, err_msg=f"{norm} {k}")
  # The pallas_norm model still tracks its flax.nnx.RMSNorm twin when data parallel.
  np.testing.assert_allclose(dp["pallas"]["losses"], dp["flax"]["losses"], rtol=1e-4,
                             atol=1e-4)
  assert len(dp["samples"]) == 3 and all(len(s) == 8 for s in dp["samples"])


def test_data_parallel_uses_all_devices_and_splits_batch(runs):
  """--devices 4: a ('data': 4) mesh, every batch split 2 rows per device; --devices 1
  on the same host: one device, host batches, and the run says so."""
  dp, one = runs[_DEVICES], runs[1]
  assert dp["rc"] == 0 and dp["local"] == _DEVICES
  assert dp["num_devices"] == _DEVICES and dp["mesh"] == {"data": _DEVICES}
  for norm in ("pallas", "flax"):
    assert dp[norm]["batch_spec"] == ["data"]
    assert dp[norm]["batch_devices"] == _DEVICES
    assert dp[norm]["batch_shard_shape"] == [_BATCH // _DEVICES, _SEQ]
  assert f"data parallel over {_DEVICES} of {_DEVICES} local devices" in dp["printed"]
  assert f"Mesh('data': {_DEVICES}" in dp["printed"]
  assert f"for [{_BATCH // _DEVICES * _SEQ}, 16] rows per device" in dp["printed"]
  assert one["rc"] == 0 and one["num_devices"] == 1 and one["mesh"] is None
  assert one["pallas"]["batch_spec"] is None and one["flax"]["batch_spec"] is None
  assert f"single device: --devices 1 (of {_DEVICES} local devices)" in one["printed"]
  assert "data parallel over" not in one["printed"]


def test_devices_flag_errors_and_fallback(runs):
  """--devices that the batch or the host cannot serve exits 2; the default (all
  devices) falls back to one device, saying why, when the batch does not divide."""
  errors = runs[_DEVICES]["errors"]
  code, err = errors["--batch 8 --devices 3"]
  assert code == 2 and "--batch=8 must be a multiple of --devices=3" in err
  code, err = errors["--devices 5"]
  assert code == 2 and f"this process has {_DEVICES} local device(s)" in err
  n, why = runs[_DEVICES]["fallback"]
  assert n == 1 and "data parallel off: --batch=6 is not a multiple of the 4" in why
