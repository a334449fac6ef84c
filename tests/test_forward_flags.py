"""The whole-row Pallas forwards' tuned flags, on CPU (interpret mode). Each is in the
Pallas search space of the modes that read it, kept by the table round trip, dropped
where the mode ignores it, and gives the same bits either way.

ForwardConfig.stream_x: multi_wave_cached and static_persistent load x, and the
residual, with the ``.cg`` cache modifier (the default) or without (a plain load: the
Triton backend's); the chunked rows (multi_wave_reload, chunked static_persistent) with
``.cg`` or with the eviction hints (evict_last, then evict_first in the reload: the
Triton backend's reload); the loads' modifier and hint are read from the kernel's
trace.

ForwardConfig.reload_params: static_persistent loads scale/bias once a program and
holds them across its row blocks (the default), or loads them for each row block after
its statistics (fewer registers a thread); where they are loaded is read from the
trace."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_norm import config
from pallas_norm import tuning
from pallas_norm.kernels import forward

GPU = config.DeviceInfo("gpu", "some GPU", 132)


def _space(mode, m=64, n=4096, backend="pallas", **kw):
  return config.search_space("fwd", m, n, GPU, backend=backend, mode=mode,
                             subtract_mean=True, **kw)


def test_search_space():
  """In the Pallas search of every mode (and the post-norm kernel); not in the Triton
  backend's, or in the split-row cached kernel's."""
  assert _space("multi_wave_cached")["stream_x"] == (True, False)
  assert _space("static_persistent")["stream_x"] == (True, False)
  assert _space("static_persistent", n=65536)["stream_x"] == (True, False)  # chunked
  assert _space("multi_wave_reload")["stream_x"] == (True, False)
  assert _space("multi_wave_cached", post_norm=True)["stream_x"] == (True, False)
  assert "stream_x" not in _space("multi_wave_cached", backend="triton")
  assert "stream_x" not in _space("multi_wave_reload", backend="triton")
  assert "stream_x" not in _space("multi_wave_cached", n=65536)  # the split-row kernel


def test_search_space_reload_params():
  """In the Pallas search of whole-row static_persistent only."""
  assert _space("static_persistent")["reload_params"] == (False, True)
  assert "reload_params" not in _space("multi_wave_cached")
  assert "reload_params" not in _space("static_persistent", backend="triton")
  assert "reload_params" not in _space("static_persistent", n=65536)  # chunked rows


@pytest.mark.parametrize("field,value,mode,n,kept", [
    ("stream_x", False, "multi_wave_cached", 8192, True),
    ("stream_x", False, "static_persistent", 8192, True),
    ("stream_x", False, "multi_wave_reload", 8192, True),
    ("stream_x", False, "static_persistent", 65536, True),
    ("stream_x", False, "multi_wave_cached", 65536, False),
    ("reload_params", True, "static_persistent", 8192, True),
    ("reload_params", True, "multi_wave_cached", 8192, False),
    ("reload_params", True, "static_persistent", 65536, False)])
def test_table_round_trip(field, value, mode, n, kept):
  """entry_fields -> Entry -> from_entry keeps the flag where the mode reads it (whole
  rows), and gives the default where it does not."""
  block_n = min(n, 8192) if mode != "static_persistent" or n <= 8192 else 16384
  block_n = 4096 if mode == "multi_wave_reload" else block_n  # chunks
  cfg = config.ForwardConfig(mode, 1, block_n, 8, 132 if mode == "static_persistent" else 0,
                             **{field: value})
  key = tuning.Key("fwd", "layer", "bfloat16", "bfloat16", n, 512)
  e = tuning.Entry(key, "pallas", mode,
                   tuple(sorted(config.entry_fields(cfg, n, GPU.num_sms).items())))
  got = config.from_entry(e, 512, n, GPU, "pallas")
  assert got is not None and (getattr(got, field) == value) is kept


@pytest.fixture
def modifiers(monkeypatch):
  """The cache_modifier of every load the forward traces (None: a plain load)."""
  seen = []
  load = forward._load

  def spy(ref_at, mask, **kw):
    seen.append(kw.get("cache_modifier") or kw.get("eviction_policy"))
    return load(ref_at, mask, **kw)

  monkeypatch.setattr(forward, "_load", spy)
  monkeypatch.setattr(forward, "stream_cache_modifier", lambda: ".cg")
  return seen


def _stream_x_runs(modifiers, mode, block_n, residual):
  """LayerNorm of 7 rows of 1000 with stream_x True and False, the outputs asserted
  bitwise equal: {stream_x: the loads' modifiers and hints} (``modifiers``: the
  fixture's list)."""
  k = jax.random.split(jax.random.key(0), 4)
  m, n = 7, 1000
  x = jax.random.normal(k[0], (m, n), jnp.bfloat16)
  r = jax.random.normal(k[1], (m, n), jnp.bfloat16) if residual else None
  w, b = (1 + 0.1 * jax.random.normal(k[2], (n,)), 0.1 * jax.random.normal(k[3], (n,)))
  outs, loads = {}, {}
  for stream in (True, False):
    del modifiers[:]
    cfg = config.ForwardConfig(mode, 2, block_n, 4,
                               3 if mode == "static_persistent" else 0, stream_x=stream)
    outs[stream] = forward.norm_forward(x, w, b, eps=1e-5, scale_offset=0.0,
                                        subtract_mean=True, config=cfg, interpret=True,
                                        residual=r)
    loads[stream] = list(modifiers)
  for a, c in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
  return loads


@pytest.mark.parametrize("mode", ["multi_wave_cached", "static_persistent"])
@pytest.mark.parametrize("residual", [False, True], ids=["x", "x+residual"])
def test_loads_and_bits(modifiers, mode, residual):
  """The row in one tile: stream_x=True, x (and the residual) loaded with .cg; False:
  no load with it. y, mean, rstd (and h) bitwise equal."""
  loads = _stream_x_runs(modifiers, mode, 1024, residual)
  assert loads[True].count(".cg") >= (2 if residual else 1), loads[True]
  assert ".cg" not in loads[False], loads[False]


@pytest.mark.parametrize("mode", ["multi_wave_reload", "static_persistent"])
@pytest.mark.parametrize("residual", [False, True], ids=["x", "x+residual"])
def test_chunked_rows_loads_and_bits(modifiers, mode, residual):
  """Rows of 1000 in chunks of 256: stream_x=True, every load of x (and the residual)
  with .cg; False, none with it, the statistics pass's evict_last and the reload's
  evict_first instead. y, mean, rstd (and h) bitwise equal."""
  loads = _stream_x_runs(modifiers, mode, 256, residual)
  per_pass = 4 * (2 if residual else 1)  # 4 chunks a pass, x (and r)
  assert loads[True].count(".cg") == 2 * per_pass, loads[True]
  assert ".cg" not in loads[False], loads[False]
  assert loads[False].count("evict_last") == loads[False].count("evict_first") == per_pass


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("residual", [False, True], ids=["x", "x+residual"])
def test_reload_params_loads_and_bits(monkeypatch, layer, residual):
  """7 rows over 3 programs of row blocks of 2: scale/bias loaded before the kernel's
  row-block loop held, inside its body reloaded; the outputs bitwise equal."""
  calls = []
  load_params = forward._load_params

  def spy(*a, **kw):  # True: traced inside the row-block loop's body
    calls.append(any(f.function == "body" and "forward.py" in f.filename
                     for f in inspect.stack()))
    return load_params(*a, **kw)

  monkeypatch.setattr(forward, "_load_params", spy)
  k = jax.random.split(jax.random.key(1), 4)
  m, n = 7, 1000
  x = jax.random.normal(k[0], (m, n), jnp.bfloat16)
  r = jax.random.normal(k[1], (m, n), jnp.bfloat16) if residual else None
  w = 1 + 0.1 * jax.random.normal(k[2], (n,))
  b = 0.1 * jax.random.normal(k[3], (n,)) if layer else None
  outs, traced = {}, {}
  for reload in (False, True):
    del calls[:]
    cfg = config.ForwardConfig("static_persistent", 2, 1024, 4, 3, reload_params=reload)
    outs[reload] = forward.norm_forward(x, w, b, eps=1e-5, scale_offset=0.0,
                                        subtract_mean=layer, config=cfg, interpret=True,
                                        residual=r)
    traced[reload] = list(calls)
  assert traced[False] and not any(traced[False]), traced
  assert traced[True] and all(traced[True]), traced
  for a, c in zip(jax.tree.leaves(outs[False]), jax.tree.leaves(outs[True])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


@pytest.mark.parametrize("cfg,name", [
    (config.ForwardConfig("static_persistent", 1, 8192, 8, 264, reload_params=False),
     "persistent"),
    (config.ForwardConfig("static_persistent", 1, 8192, 8, 264, reload_params=True),
     "persistent"),
    (config.ForwardConfig("multi_wave_reload", 1, 4096, 16, stream_x=True), "reload"),
    (config.ForwardConfig("multi_wave_reload", 1, 4096, 16, stream_x=False), "reload")],
    ids=["hold-params", "reload-params", "reload-cg", "reload-evict"])
def test_flags_lower_to_triton(cfg, name):
  """The forward with either value of reload_params (persistent, the row in one tile)
  and of stream_x (reload, 4096-wide chunks) lowers for the GPU on a CPU (Pallas's
  Triton lowering, no GPU): one Triton call, LayerNorm with the residual, mean/rstd."""
  sds = jax.ShapeDtypeStruct

  def f(x, r, w, b):
    return forward.norm_forward(x, w, b, eps=1e-5, scale_offset=0.0, subtract_mean=True,
                                config=cfg, interpret=False, residual=r)

  args = (sds((512, 8192), jnp.bfloat16), sds((512, 8192), jnp.bfloat16),
          sds((8192,), jnp.bfloat16), sds((8192,), jnp.bfloat16))
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1 and f"pallas_norm_fwd_{name}" in text
