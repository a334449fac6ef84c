"""The tuner end to end on CPU (issue #57): interpret mode, a tiny grid and an injected,
deterministic timer. The kernels run (every candidate is traced, compiled and checked);
only the time is made up, as a function of the candidate's config."""

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from pallas_norm import config, reference, tune, tuning
from pallas_norm.kernels import backward, forward

CPU = config.DeviceInfo("cpu", "cpu", 4)


@pytest.fixture(autouse=True)
def _fresh_tables(monkeypatch, tmp_path):
  monkeypatch.setenv("PALLAS_NORM_TUNING_DIR", str(tmp_path / "user"))
  monkeypatch.delenv("PALLAS_NORM_TUNING", raising=False)
  tuning.clear_cache()
  yield
  tuning.clear_cache()


def _timer(calls):
  """us = 10 + |num_warps - 2| / 2, + 3 outside multi_wave_reload (so the search must
  move num_warps, and the forward's best mode is reload); counts its calls."""
  def timer(cand, exe, arg_sets, iters, skip=0):
    calls.append(cand.config)
    f = cand.entry.fields
    return 10.0 + abs(f["num_warps"] - 2) * 0.5 + (
        0.0 if cand.entry.mode in ("multi_wave_reload", "") else 3.0)
  return timer


def _run(tmp_path, keys, calls, **kw):
  return tune.run(keys, out=tmp_path / "cpu.json", device=CPU, backends=("pallas",),
                  timer=_timer(calls), progress=False, rounds=1, log=lambda *a: None, **kw)


def _run_user(tmp_path, keys, timer):
  """``keys`` tuned with ``timer`` into the user's table of the "cpu" device kind
  (tmp_path/user, where the tests' PALLAS_NORM_TUNING_DIR points), which the ops read."""
  return tune.run(keys, out=tmp_path / "user" / "cpu.json", device=CPU, backends=("pallas",),
                  timer=timer, progress=False, rounds=1, log=lambda *a: None)


def _spy(monkeypatch):
  """The configs the launchers were called with."""
  seen = {"fwd": [], "bwd": []}
  f, b = forward.norm_forward, backward.norm_backward
  monkeypatch.setattr(forward, "norm_forward",
                      lambda *a, **k: seen["fwd"].append(k["config"]) or f(*a, **k))
  monkeypatch.setattr(backward, "norm_backward",
                      lambda *a, **k: seen["bwd"].append(k["config"]) or b(*a, **k))
  return seen


@pytest.mark.cpu_only  # the tables of the "cpu" device kind, interpret mode
def test_tune_end_to_end(tmp_path, monkeypatch):
  seen = _spy(monkeypatch)
  calls = []
  keys = tune.keys_for([(16, 256)], ("rms",), ("fwd", "bwd"))
  path = _run(tmp_path, keys, calls, search_top=3)
  doc = json.loads(path.read_text())
  assert doc["format"] == tuning.FORMAT and doc["version"] == tuning.VERSION
  assert doc["device_kind"] == "cpu" and doc["timing"] == "injected timer"
  table = tuning.Table.load(path)
  fwd = {e.mode: e for e in table.groups["fwd", "rms", "bfloat16", "bfloat16"]}
  assert set(fwd) == set(config.MODES)  # one entry a mode
  # the injected optimum: num_warps 2 in every mode; reload the fastest mode
  assert all(e.fields["num_warps"] == 2 for e in fwd.values())
  assert fwd["multi_wave_reload"].us == 10.0
  assert fwd["multi_wave_cached"].us == 13.0
  (bwd,) = table.groups["bwd", "rms", "bfloat16", "bfloat16"]
  assert bwd.fields["num_warps"] == 2 and bwd.us == 10.0
  assert bwd.default_us == 10.0 + abs(config.backward_config(
      16, 256, jnp.bfloat16, CPU, tuned=False).num_warps - 2) * 0.5
  # every candidate ran as its own trace: the launchers saw many distinct configs
  assert len({c.num_warps for c in seen["fwd"]}) >= 4
  assert len({c.num_warps for c in seen["bwd"]}) >= 4
  # as the user's table (the default place), the op now runs the tuned configs
  (tmp_path / "user").mkdir()
  path.rename(tmp_path / "user" / "cpu.json")
  tuning.clear_cache()
  seen["fwd"].clear()
  x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 256)), jnp.bfloat16)
  s = jnp.ones((256,), jnp.bfloat16)
  y = pallas_norm.rms_norm(x, s)
  want = config.from_entry(fwd["multi_wave_reload"], 16, 256, CPU, "pallas")
  assert seen["fwd"] == [want]
  ref = reference.norm(x, s, None, eps=float(jnp.finfo(jnp.float32).eps),
                       subtract_mean=False)[0]
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                             rtol=2e-2, atol=2e-2)
  # an explicit mode still wins over the table's pick
  seen["fwd"].clear()
  pallas_norm.rms_norm(x, s, mode="multi_wave_cached")
  assert seen["fwd"][0].mode == "multi_wave_cached"


@pytest.mark.cpu_only  # the tables of the "cpu" device kind, interpret mode
def test_tune_post_norm_family(tmp_path, monkeypatch):
  """rms_res_post (``post_norm_scale=``'s one-kernel forward): "fwd" keys only; its
  search moves the cached kernel's tile and warps (no column splits); from the user's
  table the op launches that kernel with the entry's config, and the plain residual
  norm does not take it."""
  assert [k.pass_ for k in tune.keys_for([(16, 256)], ("rms_res_post",))] == ["fwd"]
  seen = _spy(monkeypatch)
  calls = []
  keys = tune.keys_for([(16, 256)], ("rms_res_post",), ("fwd",))
  path = _run(tmp_path, keys, calls)
  (e,) = tuning.Table.load(path).groups["fwd", "rms_res_post", "bfloat16", "bfloat16"]
  assert e.mode == "multi_wave_cached" and e.fields["num_warps"] == 2 and e.us == 13.0
  assert e.fields["column_splits"] == 1
  assert len({c.num_warps for c in seen["fwd"]}) >= 4
  (tmp_path / "user").mkdir()
  path.rename(tmp_path / "user" / "cpu.json")
  tuning.clear_cache()
  seen["fwd"].clear()
  rng = np.random.default_rng(0)
  x, r = (jnp.asarray(rng.standard_normal((16, 256)), jnp.bfloat16) for _ in range(2))
  s = jnp.ones((256,), jnp.bfloat16)
  y, h = pallas_norm.rms_norm(x, s, residual=r, post_norm_scale=s)
  want = config.from_entry(e, 16, 256, CPU, "pallas")
  assert seen["fwd"] == [want] and want.num_warps == 2
  seen["fwd"].clear()  # the two calls (first traced here): their own keys, not this one
  y2, h2 = pallas_norm.rms_norm(pallas_norm.rms_norm(x, s), s, residual=r)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y2, np.float32))
  assert len(seen["fwd"]) == 2 and want not in seen["fwd"]
  assert seen["fwd"][1] == config.forward_config(16, 256, jnp.bfloat16, None, CPU,
                                                 residual=True, return_residuals=False)


def test_tune_is_deterministic_and_resumes(tmp_path):
  keys = tune.keys_for([(8, 128)], ("layer",), ("fwd",))
  calls = []
  first = json.loads(_run(tmp_path, keys, calls).read_text())["entries"]
  assert calls
  calls.clear()
  again = json.loads(_run(tmp_path, keys, calls).read_text())["entries"]
  assert calls == [] and again == first  # resumed: nothing timed again
  other = tmp_path / "b"
  other.mkdir()
  second = json.loads(_run(other, keys, []).read_text())["entries"]
  assert second == first


def test_table_keeps_its_run_history(tmp_path):
  """meta["runs"]: every run that tuned keys (command, commit, date, jax, keys tuned),
  oldest first; a table written before the history gives its own last command first;
  a run that tunes nothing (resumed) adds none."""
  a, b = (tune.keys_for([(8, n)], ("rms",), ("fwd",)) for n in (128, 256))
  path = tmp_path / "cpu.json"
  _run(tmp_path, a, [], argv=["--shapes", "8x128"])
  doc = json.loads(path.read_text())
  doc.pop("runs")  # as a table from before the history
  doc["made_by"] = "python -m pallas_norm.tune --old"
  path.write_text(json.dumps(doc))
  _run(tmp_path, b, [], argv=["--shapes", "8x256"])
  _run(tmp_path, b, [], argv=["--shapes", "8x256", "--again"])  # resumed: nothing tuned
  doc = json.loads(path.read_text())
  assert [(r["made_by"], r["keys"]) for r in doc["runs"]] == [
      ("python -m pallas_norm.tune --old", None),
      ("python -m pallas_norm.tune --shapes 8x256", 1)]
  assert doc["made_by"] == "python -m pallas_norm.tune --shapes 8x256"
  assert all(set(r) == {"made_by", "commit", "date", "jax", "keys"} for r in doc["runs"])
  assert len(tuning.Table.load(path).groups["fwd", "rms", "bfloat16", "bfloat16"]) == 6


def test_tune_searches_from_the_fastest_defaults_only(tmp_path):
  """search_top=1: only the fastest default's (backend, mode) is searched; the other
  modes' entries are their defaults."""
  path = _run(tmp_path, tune.keys_for([(8, 128)], ("rms",), ("fwd",)), [], search_top=1)
  fwd = {e.mode: e for e in tuning.Table.load(path).groups["fwd", "rms", "bfloat16",
                                                            "bfloat16"]}
  default = config.forward_config(8, 128, jnp.bfloat16, "multi_wave_cached", CPU,
                                  tuned=False)
  assert fwd["multi_wave_reload"].fields["num_warps"] == 2
  assert fwd["multi_wave_cached"].fields["num_warps"] == default.num_warps != 2


def test_tune_searches_the_fastest_pallas_mode_whatever_its_rank(tmp_path):
  """search_top=1 with XLA the fastest default: XLA has nothing to search, and the
  Pallas backend's fastest mode (reload, _timer's) is searched all the same (its entry
  is what backend="pallas" runs): it moves num_warps to 2; the slower Pallas modes keep
  their defaults."""
  calls = []
  pallas_timer = _timer(calls)

  def timer(cand, exe, arg_sets, iters, skip=0):
    return 1.0 if cand.entry.backend == "xla" else pallas_timer(cand, exe, arg_sets, iters)
  path = tune.run(tune.keys_for([(8, 128)], ("rms",), ("fwd",)), out=tmp_path / "cpu.json",
                  device=CPU, backends=("pallas", "xla"), timer=timer, progress=False,
                  rounds=1, log=lambda *a: None, search_top=1)
  fwd = {(e.backend, e.mode): e for e in tuning.Table.load(path).groups[
      "fwd", "rms", "bfloat16", "bfloat16"]}
  default = config.forward_config(8, 128, jnp.bfloat16, "multi_wave_cached", CPU,
                                  tuned=False)
  assert ("xla", "") in fwd
  assert fwd["pallas", "multi_wave_reload"].fields["num_warps"] == 2
  assert fwd["pallas", "multi_wave_cached"].fields["num_warps"] == default.num_warps != 2


@pytest.mark.parametrize("start_times,kept", [((1.248, 1.216), True), ((1.3,), False)])
def test_confirm_keeps_the_start_within_a_timer_step(tmp_path, start_times, kept):
  """A finalist replaces the start only with every confirm time below the start's
  least. CUPTI's times move in 32 ns steps: a start at 1.216/1.248 us against a
  finalist at 1.216 has medians 1.3% apart, one step of noise (the 8x4096 entry that
  was 9% slower at 8x2048, H200 2026-11-29); a start at 1.3 loses."""
  key = tune.keys_for([(8, 128)], ("rms",), ("fwd",))[0]
  mode = "multi_wave_reload"
  start = tune._default(key, "pallas", mode, CPU).config
  calls = []

  def timer(cand, exe, arg_sets, iters, skip=0):
    if cand.config != start:
      return 1.216
    calls.append(1)
    return start_times[(len(calls) - 1) % len(start_times)]
  path = tune.run([key], out=tmp_path / "cpu.json", device=CPU, backends=("pallas",),
                  timer=timer, progress=False, rounds=1, search_top=3,
                  log=lambda *a: None)
  (e,) = [e for e in tuning.Table.load(path).groups["fwd", "rms", "bfloat16", "bfloat16"]
          if e.mode == mode]
  assert len(calls) > 1  # the start was confirmed
  if kept:
    assert tune._candidate(key, "pallas", mode, e.fields, CPU).config == start
    assert e.us == 1.232  # the start's median
  else:
    assert tune._candidate(key, "pallas", mode, e.fields, CPU).config != start
    assert e.us == 1.216


def test_tune_budget_stops_before_a_key(tmp_path):
  calls = []
  path = _run(tmp_path, tune.keys_for([(8, 128)], ("rms",), ("fwd",)), calls, budget_s=0)
  assert calls == [] and json.loads(path.read_text())["entries"] == []


def test_tune_drops_a_winner_that_fails_the_check(tmp_path, monkeypatch):
  """A candidate whose output fails the check is never written: the next best is."""
  real = tune._check_candidate
  checked = []

  def check(key, meas, cand, ref):
    checked.append(cand.entry.fields["num_warps"])
    return "made wrong" if cand.entry.fields["num_warps"] == 2 else real(key, meas, cand,
                                                                         ref)
  monkeypatch.setattr(tune, "_check_candidate", check)
  path = _run(tmp_path, tune.keys_for([(8, 128)], ("rms",), ("fwd",)), [])
  entries = tuning.Table.load(path).groups["fwd", "rms", "bfloat16", "bfloat16"]
  assert 2 in checked  # the injected optimum was checked, and refused
  assert len(entries) == 3 and all(e.fields["num_warps"] in (1, 4) for e in entries)


@pytest.mark.cpu_only  # the tables of the "cpu" device kind, interpret mode
def test_a_table_can_pick_xla(tmp_path, monkeypatch):
  """Where the table's fastest is "xla", backend=None runs the jnp math for that pass
  (no kernel), with the same values and gradients; backend="pallas" keeps the kernels."""
  seen = _spy(monkeypatch)

  def timer(cand, exe, arg_sets, iters, skip=0):
    return 1.0 if cand.entry.backend == "xla" else 5.0
  # "fwd" too: under jit, the custom_vjp's primal is traced beside its fwd rule (the spy
  # sees the primal's config though only the rule runs)
  path = tune.run(tune.keys_for([(8, 128)], ("layer",), ("fwd", "fwd_stats", "bwd"),
                                ("float32",)),
                  out=tmp_path / "user" / "cpu.json", device=CPU, backends=("pallas", "xla"),
                  timer=timer, progress=False, rounds=1, log=lambda *a: None)
  table = tuning.Table.load(path)
  assert {e.backend for e in table.entries()} == {"pallas", "xla"}
  # default_us is the Pallas default's time, not xla's (whose config can compare equal)
  assert {e.default_us for e in table.entries()} == {5.0}
  tuning.clear_cache()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
  s, b = (jnp.asarray(rng.standard_normal(128), jnp.float32) for _ in range(2))
  dy = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)

  def grads(backend):
    f = lambda x, s, b: pallas_norm.layer_norm(x, s, b, backend=backend, interpret=True)
    y, pull = jax.vjp(f, x, s, b)
    return (y, *pull(dy))
  seen["fwd"].clear(), seen["bwd"].clear()
  got = grads(None)
  assert seen["fwd"] == [] and seen["bwd"] == []  # the table's xla for both passes
  want = grads("xla")
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
  grads("pallas")
  assert seen["fwd"] and seen["bwd"]


@pytest.mark.cpu_only  # the tables of the "cpu" device kind, interpret mode
def test_the_primal_and_the_vjp_forward_pick_their_own_pass(tmp_path, monkeypatch):
  """backend=None's forward alone takes the table's "fwd" entry, under jax.vjp its
  "fwd_stats" (here xla and pallas): the primal had taken fwd_stats' backend (H200,
  2026-11-29: LayerNorm 512x16384 ran Triton at 14.1 us, the "fwd" entry's Pallas
  11.6)."""
  seen = _spy(monkeypatch)

  def timer(cand, exe, arg_sets, iters, skip=0):
    xla_wins = cand.entry.key.pass_ == "fwd"
    return 1.0 if (cand.entry.backend == "xla") == xla_wins else 5.0
  tune.run(tune.keys_for([(8, 128)], ("layer",), ("fwd", "fwd_stats"), ("float32",)),
           out=tmp_path / "user" / "cpu.json", device=CPU, backends=("pallas", "xla"),
           timer=timer, progress=False, rounds=1, log=lambda *a: None)
  tuning.clear_cache()
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
  s, b = (jnp.asarray(rng.standard_normal(128), jnp.float32) for _ in range(2))
  f = lambda x, s, b: pallas_norm.layer_norm(x, s, b, backend=None, interpret=True)
  seen["fwd"].clear()
  y = f(x, s, b)
  assert seen["fwd"] == []  # "fwd": the jnp math
  y_vjp, _ = jax.vjp(f, x, s, b)
  assert seen["fwd"]  # "fwd_stats": the Pallas kernel
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_vjp), rtol=1e-5, atol=1e-5)


def test_tune_fp8_input_and_refused_keys(tmp_path):
  """FP8 x (x_scale= a group of 16): its keys are tuned and checked like the others;
  a key the op refuses (FP8 x with a residual) is skipped, not an error."""
  keys = tune.keys_for([(8, 256)], ("rms", "rms_res"), ("fwd", "bwd"), ("float8_e4m3fn",),
                       ("bfloat16",))
  path = _run(tmp_path, keys, [])
  table = tuning.Table.load(path)
  assert set(table.groups) == {("fwd", "rms", "float8_e4m3fn", "bfloat16"),
                               ("bwd", "rms", "float8_e4m3fn", "bfloat16")}
  assert all(e.us is not None for e in table.entries())


@pytest.mark.cpu_only  # the tables of the "cpu" device kind, interpret mode
def test_tune_fp8_output_passes(tmp_path):
  """The FP8-output kernels' keys: Fp8Config fields and their kernel's flag
  (``separate`` for delayed scaling's y_t) are searched, checked, written, and read back
  by kernels/fp8.py from the user's table."""
  from pallas_norm.kernels import fp8 as kfp8

  def timer(cand, exe, arg_sets, iters, skip=0):
    f = cand.entry.fields
    return 10.0 + abs(f["num_warps"] - 2) + (0.0 if f.get("separate") else 1.0)
  keys = tune.keys_for([(16, 256)], ("rms",), ("fp8_delayed", "fp8_delayed_t"))
  path = _run_user(tmp_path, keys, timer)
  table = tuning.Table.load(path)
  (t,) = table.groups["fp8_delayed_t", "rms", "bfloat16", "bfloat16"]
  assert t.fields["separate"] is True and t.fields["num_warps"] == 2
  tuning.clear_cache()
  assert kfp8.transpose_separately(True, (16, 256), jnp.bfloat16, False, jnp.bfloat16)
  assert not kfp8.transpose_separately(True)  # no call given: the default
  cfg = kfp8.fp8_config(16, 256, jnp.bfloat16, kernel="delayed", interpret=True,
                        param_dtype=jnp.bfloat16)
  assert cfg.num_warps == 2
  x = jnp.asarray(np.random.default_rng(2).standard_normal((16, 256)), jnp.bfloat16)
  s = jnp.ones((256,), jnp.bfloat16)
  r = pallas_norm.rms_norm_fp8(x, s, y_scale=jnp.float32(8 / 448), transpose=True)
  np.testing.assert_array_equal(np.asarray(r.y_t, np.float32), np.asarray(r.y, np.float32).T)


@pytest.mark.cpu_only  # the tables of the "cpu" device kind, interpret mode
def test_tune_fp8_static_pass(tmp_path):
  """"fp8_static" (y alone, stats=False) is tuned on the op it names and seeded by the
  "fp8_delayed" entry of its shape; kernels/fp8.py reads it for stats=False calls only,
  and falls back to the "fp8_delayed" entry where the table has no "fp8_static" one."""
  from pallas_norm.kernels import fp8 as kfp8

  def timer(cand, exe, arg_sets, iters, skip=0):  # y alone best at 1 warp, stats at 2
    best = 1 if cand.entry.key.pass_ == "fp8_static" else 2
    return 10.0 + abs(cand.entry.fields["num_warps"] - best)
  keys = tune.keys_for([(16, 256)], ("rms",), ("fp8_delayed", "fp8_static"))
  path = _run_user(tmp_path, keys, timer)
  table = tuning.Table.load(path)
  (d,) = table.groups["fp8_delayed", "rms", "bfloat16", "bfloat16"]
  (st,) = table.groups["fp8_static", "rms", "bfloat16", "bfloat16"]
  assert (d.fields["num_warps"], st.fields["num_warps"]) == (2, 1)
  seeds = tune._table_seeds(st.key, "pallas", None, CPU, [d])
  assert [c.config[0].num_warps for c in seeds] == [2] and seeds[0].entry.key == st.key
  tuning.clear_cache()
  kw = dict(kernel="delayed", interpret=True, param_dtype=jnp.bfloat16)
  assert kfp8.fp8_config(16, 256, jnp.bfloat16, stats=False, **kw).num_warps == 1
  assert kfp8.fp8_config(16, 256, jnp.bfloat16, **kw).num_warps == 2
  x = jnp.asarray(np.random.default_rng(4).standard_normal((16, 256)), jnp.bfloat16)
  s = jnp.ones((256,), jnp.bfloat16)
  ys = jnp.float32(8 / 448)
  y_alone = pallas_norm.rms_norm_fp8(x, s, y_scale=ys, stats=False, interpret=True)
  full = pallas_norm.rms_norm_fp8(x, s, y_scale=ys, interpret=True)
  np.testing.assert_array_equal(np.asarray(y_alone.y, np.float32),
                                np.asarray(full.y, np.float32))
  tune._write(path, [d], dict(device_kind="cpu", num_sms=CPU.num_sms))
  tuning.clear_cache()
  assert kfp8.fp8_config(16, 256, jnp.bfloat16, stats=False, **kw).num_warps == 2


@pytest.mark.cpu_only  # the tables of the "cpu" device kind, interpret mode
def test_tune_fp8_residual_family(tmp_path):
  """The static-scale FP8 op with residual= (family rms_res, pass fp8_delayed): its row
  block kernel's tile and warps are searched (no persistent programs, no packing) and
  read back by kernels/fp8.py for residual calls only; current scaling's passes are not
  served with a residual (skipped, not an error)."""
  from pallas_norm.kernels import fp8 as kfp8

  def timer(cand, exe, arg_sets, iters, skip=0):
    return 10.0 + abs(cand.entry.fields["num_warps"] - 2)
  keys = tune.keys_for([(16, 256)], ("rms_res",), ("fp8_delayed", "fp8_stats"))
  path = _run_user(tmp_path, keys, timer)
  table = tuning.Table.load(path)
  assert set(table.groups) == {("fp8_delayed", "rms_res", "bfloat16", "bfloat16")}
  (e,) = table.groups["fp8_delayed", "rms_res", "bfloat16", "bfloat16"]
  assert e.fields["num_warps"] == 2 and e.fields["programs_per_sm"] == 0
  assert not e.fields["packed"] and e.fields["column_splits"] == 1
  tuning.clear_cache()
  kw = dict(kernel="delayed", interpret=True, param_dtype=jnp.bfloat16)
  assert kfp8.fp8_config(16, 256, jnp.bfloat16, residual=True, **kw).num_warps == 2
  plain = kfp8.fp8_config(16, 256, jnp.bfloat16, **kw)
  assert plain == kfp8.fp8_config(16, 256, jnp.bfloat16, tuned=False, **kw)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((16, 256)), jnp.bfloat16)
  s = jnp.ones((256,), jnp.bfloat16)
  out, h = pallas_norm.rms_norm_fp8(x, s, y_scale=jnp.float32(8 / 448), residual=x)
  np.testing.assert_array_equal(np.asarray(h, np.float32), 2 * np.asarray(x, np.float32))


@pytest.mark.cpu_only  # the tables of the "cpu" device kind, interpret mode
def test_cli(capsys, tmp_path):
  assert tune.main(["--dry-run", "--shapes", "1x4096,64x1000", "--families", "rms,layer_res",
                    "--passes", "fwd,bwd"]) == 0
  out = capsys.readouterr().out
  assert "8 keys" in out and "bwd layer_res bfloat16 bfloat16 64x1000" in out
  assert tune.main(["--families", "rmsnorm", "--dry-run"]) == 2
  assert "rmsnorm" in capsys.readouterr().err
  # timing needs a GPU: exit 2 with the reason, nothing written
  assert tune.main(["--shapes", "8x128", "--out", str(tmp_path / "t.json")]) == 2
  assert "GPU" in capsys.readouterr().err and not (tmp_path / "t.json").exists()


def test_search_space_candidates_fit():
  """Every value of every field the search tries either rebuilds to a config that
  fits, or is pruned by from_entry (never an exception)."""
  gpu = config.DeviceInfo("gpu", "some GPU", 100)
  for m, n in itertools.product((512, 64), (128, 1000, 4096, 16384, 20000, 70000)):
    for pass_ in ("fwd", "bwd"):
      for mode in (config.MODES if pass_ == "fwd" else (None,)):
        key = tuning.Key(pass_, "layer", "bfloat16", "bfloat16", n, m)
        start = tune._default(key, "pallas", mode, gpu)
        if start is None:
          continue
        space = config.search_space(pass_, m, n, gpu, backend="pallas", mode=mode,
                                    subtract_mean=True)
        for field, values in space.items():
          for v in values:
            fields = dict(start.entry.fields, **{field: v})
            e = tuning.Entry(key, "pallas", mode or "", tuple(sorted(fields.items())))
            cfg = config.from_entry(e, m, n, gpu, "pallas")
            assert cfg is None or config.fits(cfg, n, gpu, "pallas")


def test_search_space_holds_the_few_row_one_tile_backward():
  """Rows of N' 16384: the few-row default's one-tile backward (one kernel,
  fused_reduce) and its column tiles are in the Pallas search space at 64 rows and past
  them; other backends keep the split."""
  gpu = config.DeviceInfo("gpu", "some GPU", 132)
  few = config.search_space("bwd", 64, 16384, gpu, backend="pallas", mode=None,
                            subtract_mean=False)
  assert 16384 in few["block_n"] and few["fused_reduce"] == (False, True)
  assert "column_block_n" in few and "prefetch_stats" in few
  many = config.search_space("bwd", 512, 16384, gpu, backend="pallas", mode=None,
                             subtract_mean=False)
  assert 16384 in many["block_n"] and many["fused_reduce"] == (False, True)
  triton = config.search_space("bwd", 512, 16384, gpu, backend="triton", mode=None,
                               subtract_mean=False)
  assert 16384 not in triton["block_n"] and "fused_reduce" not in triton


def test_search_space_chunks_the_split_backwards_tile():
  """The split-row backward's 512-column split can be walked in chunks below it (the
  domain's 1024 and 2048 clamp to 512, one tile): an entry's chunk_n 256 is rebuilt as
  such, 2048 as the whole split."""
  gpu = config.DeviceInfo("gpu", "some GPU", 132)
  space = config.search_space("bwd", 512, 16384, gpu, backend="pallas", mode=None,
                              subtract_mean=True)
  assert {128, 256} <= set(space["chunk_n"])
  key = tuning.Key("bwd", "layer", "bfloat16", "bfloat16", 16384, 512)
  start = tune._default(key, "pallas", None, gpu)
  assert start.config.split_rows and start.config.block_n == 512
  for chunk, want in ((256, 256), (2048, 512)):
    fields = dict(start.entry.fields, chunk_n=chunk)
    e = tuning.Entry(key, "pallas", "", tuple(sorted(fields.items())))
    cfg = config.from_entry(e, 512, 16384, gpu, "pallas")
    assert cfg is not None and cfg.chunk_n == want, (chunk, cfg)


def test_cupti_timer_leaves_out_the_forwards_kernels_by_name(monkeypatch):
  """A "bwd" time leaves out one kernel of each of the forward's names, wherever it ran
  (a backward's zero fill can run before the forward); a name missing or no kernel left
  gives no time: never an entry of 0 us."""
  from pallas_norm.bench import timing
  monkeypatch.setattr(timing, "cupti_time", lambda exe, args, iters: {
      "us": 16.0, "kernels": ["zero", "fwd", "bwd", "fwd"], "kernel_us": [1.0, 5.0, 8.0, 2.0]})
  exe = lambda *a: jnp.zeros(())
  assert tune.cupti_timer(None, exe, [()], 3) == 16.0
  assert tune.cupti_timer(None, exe, [()], 3, skip=("fwd",)) == 11.0  # the first
  assert tune.cupti_timer(None, exe, [()], 3, skip=("fwd", "fwd")) == 9.0
  assert tune.cupti_timer(None, exe, [()], 3, skip=("stats",)) is None
  assert tune.cupti_timer(None, exe, [()], 3, skip=("zero", "fwd", "bwd", "fwd")) is None


def test_bwd_step_orders_the_backward_after_the_forward():
  """The tuner's "bwd" step releases dy once y exists (a training step's order): its
  jaxpr has the optimization barrier, and the cotangents are the plain vjp's."""
  key = tune.keys_for([(8, 128)], ("rms",), ("bwd",), ("float32",))[0]
  prepare, fn = tune._step(key, "pallas", None)
  args = prepare(tune._inputs(key, 1)[0])
  assert "optimization_barrier" in str(jax.make_jaxpr(fn)(*args))
  x, s, b, r, dy, _ = args
  f = lambda x, s: pallas_norm.rms_norm(x, s, backend="xla")
  want = jax.vjp(f, x, s)[1](dy)
  got = fn(*args)
  for g, w in zip(got[:2], want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["rms", "layer_res"])
def test_xla_bwd_step_is_the_backward_alone(family):
  """On "xla" the "bwd" step is jax.vjp's pullback on residuals made outside it (the
  step less the forward alone was no backward's time): no forward in what is timed,
  the plain vjp's cotangents (with residual=, dy for both y and h)."""
  key = tune.keys_for([(8, 128)], (family,), ("bwd",), ("float32",))[0]
  prepare, fn = tune._step(key, "xla", None)
  x, s, b, r, dy, xs = tune._inputs(key, 1)[0]
  pull, ct = prepare((x, s, b, r, dy, xs))
  jaxpr = str(jax.make_jaxpr(fn)(pull, ct))
  assert "rsqrt" not in jaxpr  # the forward's statistics are residuals, not recomputed
  f = tune._op(key, "xla", None)
  want = jax.vjp(lambda x, s, b, r: f(x, s, b, r, xs), x, s, b, r)[1](ct)
  for g, w in zip(jax.tree.leaves(fn(pull, ct)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_coordinate_search_moves_from_a_seed():
  """One field at a time cannot reach a config two fields away from the start; a seed
  (another backend's or mode's default) there is timed and the search moves from it."""
  key = tune.keys_for([(8, 128)], ("rms",), ("fwd",))[0]
  mode = "multi_wave_reload"
  start = tune._default(key, "pallas", mode, CPU)
  far = dict(start.entry.fields, num_stages=2, num_warps=1)
  seed = tune._candidate(key, "pallas", mode, far, CPU)
  assert seed is not None and seed.config != start.config

  def timer(cand, exe, arg_sets, iters, skip=0):
    return 1.0 if cand.config == seed.config else 10.0

  def search(seeds):
    meas = tune._Measurer(key, "pallas", mode, tune._inputs(key, 1), timer, 1, 1,
                          lambda *a: None)
    tune._coordinate_search(start, key, "pallas", mode, CPU, meas, 1, 0.01, seeds=seeds)
    return meas.times
  assert seed.config not in search(())  # the start's neighbours only
  times = search([seed])
  assert times[seed.config] == 1.0 == min(t for t in times.values() if t is not None)


def test_few_row_default_seeds_the_search_past_64_rows():
  """512 rows of N' 16384: the many-row default backward splits the row; the few-row
  default (one tile a row) rebuilt for 512 rows is a seed, as no one-field move from
  the split reaches it. At 64 rows there is none (it is the default)."""
  gpu = config.DeviceInfo("gpu", "some GPU", 132)
  key = tuning.Key("bwd", "rms", "bfloat16", "bfloat16", 16384, 512)
  start = tune._default(key, "pallas", None, gpu)
  assert start.config.split_rows
  seeds = tune._few_row_seeds(key, "pallas", None, gpu)
  assert [s.config.fused_reduce for s in seeds] == [True, False]
  for seed in seeds:
    assert seed.config.block_n == 16384 and not seed.config.split_rows
    assert seed.config.num_programs > 64  # rebuilt for 512 rows, not 64 programs
  assert tune._few_row_seeds(dataclasses.replace(key, m=64), "pallas", None, gpu) == []


def test_one_row_backward_is_seeded_with_the_one_tile_column_splits():
  """Below 8 rows of N' 16384 the backward's default is a split row; the one-tile
  kernel over 4, 8 and 16 column splits seeds its search (three fields away)."""
  gpu = config.DeviceInfo("gpu", "NVIDIA H200", 132)
  key = tuning.Key("bwd", "rms", "bfloat16", "bfloat16", 16384, 1)
  assert tune._default(key, "pallas", None, gpu).config.split_rows
  seeds = tune._few_row_seeds(key, "pallas", None, gpu)
  assert [(c.config.block_n, c.config.column_splits, c.config.split_rows) for c in seeds] == [
      (16384, 4, False), (16384, 8, False), (16384, 16, False)]
  assert tune._few_row_seeds(dataclasses.replace(key, m=8), "pallas", None, gpu) == []


def test_table_seeds_are_the_keys_and_its_siblings_entries():
  """The table's entries at the key's pass and shape (its own, and the other families',
  the bias or the residual aside), and its own family's at N/2 and 2N in its M bucket,
  rebuilt for the key, seed the search; those of another shape, family or backend do
  not."""
  key = tuning.Key("bwd", "rms", "float32", "float32", 128, 8)

  def entry(k, backend="pallas", **fields):
    c = tune._candidate(k, backend, None, dict(tune._default(k, "pallas", None, CPU)
                                               .entry.fields, **fields), CPU)
    return dataclasses.replace(c.entry, backend=backend)
  own = entry(key, num_warps=1)
  sib = entry(dataclasses.replace(key, family="layer_res"), num_warps=2)
  wider = entry(dataclasses.replace(key, n=256, m=5), num_warps=8)  # own family, 2N
  others = [entry(dataclasses.replace(key, m=16), num_warps=4),
            entry(dataclasses.replace(key, n=512), num_warps=4),
            entry(dataclasses.replace(key, n=256, family="layer"), num_warps=4),
            entry(key, backend="triton", num_warps=4)]
  seeds = tune._table_seeds(key, "pallas", None, CPU, [own, sib, wider, *others])
  assert [s.config.num_warps for s in seeds] == [1, 2, 8]
  assert all(s.entry.key == key for s in seeds)  # rebuilt for the key


def test_seed_tables_reach_the_search(tmp_path, monkeypatch, capsys):
  """run(seed_tables=): another table's entries (another device's, say) join the
  output's own as the search's table; a file that is no table is refused before any key
  is timed; --seed-tables parses 'shipped', 'none' and paths."""
  keys = tune.keys_for([(8, 128)], ("rms",), ("fwd",))
  other = tmp_path / "other.json"  # another GPU's table, one entry of the key
  start = tune._default(keys[0], "pallas", "multi_wave_reload", CPU)
  tune._write(other, [dataclasses.replace(start.entry, us=1.0)],
              dict(device_kind="other GPU", num_sms=132))
  seen = []
  monkeypatch.setattr(tune, "tune_key", lambda key, device, **kw: seen.append(kw["table"]) or [])
  _run(tmp_path, keys, [], seed_tables=[other, tmp_path / "missing.json"])
  assert seen == [list(tuning.Table.load(other).entries())] and seen[0]
  bad = tmp_path / "bad.json"
  bad.write_text("{}")
  seen.clear()
  with pytest.raises(tuning.TableError):
    _run(tmp_path, keys, [], seed_tables=[bad], resume=False)
  assert seen == []
  assert tune._seed_tables("none") == []
  assert tune._seed_tables("shipped") == tuning.shipped_tables()
  assert any(p.name == "nvidia_h200.json" for p in tuning.shipped_tables())
  assert tune._seed_tables(f"{bad},{other}") == [bad, other]
  # the command line: the bad table named, exit 2, nothing written
  monkeypatch.setattr(tune.C, "device_info", lambda: config.DeviceInfo("gpu", "some GPU", 132))
  out = tmp_path / "t.json"
  assert tune.main(["--shapes", "8x128", "--out", str(out), "--seed-tables", str(bad)]) == 2
  assert not out.exists() and seen == [] and "pallas_norm.tune:" in capsys.readouterr().err


def test_table_preset_covers_every_m_bucket_at_every_width():
  """make tune's grid (--preset table): at each width of TABLE_NS a shape in each M
  bucket, the steady one (training sizes) included; the larger M first."""
  for n in tune.TABLE_NS:
    got = {min(tuning.m_bucket(m), tuning.STEADY_BUCKET) for m, k in tune.TABLE_SHAPES
           if k == n}
    assert got == set(range(tuning.STEADY_BUCKET + 1)), (n, got)
  ms = [m for m, _ in tune.TABLE_SHAPES]
  assert ms == sorted(ms, reverse=True) and len(set(tune.TABLE_SHAPES)) == len(ms)
