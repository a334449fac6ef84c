"""ForwardConfig.stream_x: the whole-row Pallas forwards (multi_wave_cached,
static_persistent) load x, and the residual, with the ``.cg`` cache modifier (the
default) or without (a plain load: the Triton backend's). A tuned field: in the Pallas
search space of the whole-row modes, kept by the table round trip, dropped where the
mode ignores it; y, mean and rstd are the same bits either way. On CPU (interpret
mode); the loads' modifier is read from the kernel's trace."""

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
  """In the Pallas search of the whole-row modes (and the post-norm kernel); not in
  the Triton backend's, the reload mode's, or past the whole-row tile."""
  assert _space("multi_wave_cached")["stream_x"] == (True, False)
  assert _space("static_persistent")["stream_x"] == (True, False)
  assert _space("multi_wave_cached", post_norm=True)["stream_x"] == (True, False)
  assert "stream_x" not in _space("multi_wave_reload")
  assert "stream_x" not in _space("multi_wave_cached", backend="triton")
  assert "stream_x" not in _space("multi_wave_cached", n=65536)  # the split-row kernel


@pytest.mark.parametrize("mode,n,kept", [
    ("multi_wave_cached", 8192, False), ("static_persistent", 8192, False),
    ("multi_wave_reload", 8192, True), ("static_persistent", 65536, True)])
def test_table_round_trip(mode, n, kept):
  """entry_fields -> Entry -> from_entry keeps stream_x=False where the mode reads it
  (whole rows), and gives the default (True) where it does not."""
  block_n = min(n, 8192) if mode != "static_persistent" or n <= 8192 else 16384
  cfg = config.ForwardConfig(mode, 1, block_n, 8, 132 if mode == "static_persistent" else 0,
                             stream_x=False)
  key = tuning.Key("fwd", "layer", "bfloat16", "bfloat16", n, 512)
  e = tuning.Entry(key, "pallas", mode,
                   tuple(sorted(config.entry_fields(cfg, n, GPU.num_sms).items())))
  got = config.from_entry(e, 512, n, GPU, "pallas")
  assert got is not None and got.stream_x is kept


@pytest.fixture
def modifiers(monkeypatch):
  """The cache_modifier of every load the forward traces (None: a plain load)."""
  seen = []
  load = forward._load

  def spy(ref_at, mask, **kw):
    seen.append(kw.get("cache_modifier"))
    return load(ref_at, mask, **kw)

  monkeypatch.setattr(forward, "_load", spy)
  monkeypatch.setattr(forward, "stream_cache_modifier", lambda: ".cg")
  return seen


@pytest.mark.parametrize("mode", ["multi_wave_cached", "static_persistent"])
@pytest.mark.parametrize("residual", [False, True], ids=["x", "x+residual"])
def test_loads_and_bits(modifiers, mode, residual):
  """stream_x=True: x (and the residual) loaded with .cg; False: no load with it. y,
  mean, rstd (and h) bitwise equal."""
  k = jax.random.split(jax.random.key(0), 4)
  m, n = 7, 1000
  x = jax.random.normal(k[0], (m, n), jnp.bfloat16)
  r = jax.random.normal(k[1], (m, n), jnp.bfloat16) if residual else None
  w, b = (1 + 0.1 * jax.random.normal(k[2], (n,)), 0.1 * jax.random.normal(k[3], (n,)))
  outs = {}
  for stream in (True, False):
    del modifiers[:]
    cfg = config.ForwardConfig(mode, 2, 1024, 4, 3 if mode == "static_persistent" else 0,
                               stream_x=stream)
    outs[stream] = forward.norm_forward(x, w, b, eps=1e-5, scale_offset=0.0,
                                        subtract_mean=True, config=cfg, interpret=True,
                                        residual=r)
    cg = modifiers.count(".cg")
    assert cg >= (2 if residual else 1) if stream else cg == 0, (stream, modifiers)
  for a, c in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
