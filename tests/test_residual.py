"""The fused residual add: ``rms_norm(x, scale, residual=r)`` -> (y, h), h = x + r.

Oracles: a jnp transcription (h summed in float32, y = norm(h) from that sum in x's
dtype, h cast to residual_dtype) and PyTorch (``x + r`` in float64, then the norm).
Every forward and backward kernel variant is forced through its config at the launcher
level; the public op is checked in every mode and dtype combination. On CPU the kernels
run in Pallas interpret mode; ``make gpu-check`` runs this file with interpret=False.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_norm
from pallas_norm import config as pn_config
from pallas_norm import reference

MODES = pn_config.MODES
_EPS_RMS = float(jnp.finfo(jnp.float32).eps)
# (x dtype, residual dtype, residual_dtype): bf16 x with an fp32 residual stream, and
# the other combinations a pre-norm stack uses.
DTYPES = [
    ("float32", "float32", None),
    ("bfloat16", "bfloat16", None),
    ("bfloat16", "float32", None),
    ("bfloat16", "bfloat16", "float32"),
    ("float16", "float16", None),
    ("float32", "bfloat16", "bfloat16"),
]
SHAPES = [(1, 1), (7, 3), (6, 1000)]  # (the kernel-variant tests cover long rows)
# About one unit roundoff; float32 gets a floor of 2^-17 (the launcher tests' 2e-5
# scale): a LayerNorm row of N = 1 has rstd = 1/sqrt(eps) ~ 316, which amplifies the
# last bit of any term.
_ULP = {"float32": 2.0**-17, "bfloat16": 2.0**-8, "float16": 2.0**-10}


def _interpret():
  return jax.default_backend() != "gpu"


def _inputs(m, n, xd, rd, *, layer, seed=0):
  rng = np.random.default_rng(seed + 31 * m + n)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  x = jnp.asarray(f(m, n) * 2 + 0.5, xd)
  r = jnp.asarray(f(m, n) * 3 + (2.0 if layer else 0.0), rd)
  scale = jnp.asarray(1 + 0.5 * f(n), jnp.float32)
  bias = jnp.asarray(f(n), jnp.float32) if layer else None
  dy = jnp.asarray(f(m, n), xd)
  return x, r, scale, bias, dy


def _ref(x, r, scale, bias, *, layer, residual_dtype=None, scale_offset=0.0):
  """(y, h) by the formula: h in float32, y from it in x's dtype, h cast at the end."""
  hd = r.dtype if residual_dtype is None else jnp.dtype(residual_dtype)
  h = x.astype(jnp.float32) + r.astype(jnp.float32)
  y = reference.norm(h, scale, bias, eps=1e-5 if layer else _EPS_RMS,
                     scale_offset=scale_offset, subtract_mean=layer)[0]
  return y.astype(x.dtype), h.astype(hd)


def _op(layer, **kw):
  if layer:
    return lambda x, r, s, b: pallas_norm.layer_norm(x, s, b, residual=r, **kw)
  return lambda x, r, s, b: pallas_norm.rms_norm(x, s, residual=r, **kw)


def _coarser(*dtypes):
  """The dtype with the larger unit roundoff (h's rounding bounds the backward's)."""
  return max((jnp.dtype(d).name for d in dtypes if d is not None), key=_ULP.get)


def _close(got, want, dtype, n=1, what=""):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  tol = 4 * _ULP[jnp.dtype(dtype).name] * max(1.0, np.sqrt(n) / 8)
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()),
                             err_msg=what)


# --------------------------------------------------------------------------- public op


@pytest.mark.parametrize("mode,dtypes",
                         [(None, d) for d in DTYPES]
                         + [(m, ("bfloat16", "float32", None)) for m in MODES],
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_matches_formula(layer, dtypes, mode):
  """y, h and the grads of x, residual, scale (and bias) against the jnp formula over
  the shape table: every dtype combination (the heuristic's modes), and every mode.
  The backward recomputes x_hat from the saved h, so its error is bounded by the
  coarser of x's and h's dtypes."""
  xd, rd, hd = dtypes
  for m, n in SHAPES:
    if layer and n == 1 and jnp.dtype(hd or rd) != jnp.float32:
      # A row of one: h - mean is h's rounding error (mean is the float32 sum's), times
      # rstd = 1/sqrt(eps); the exact dx is 0 + dh. Not a meaningful comparison.
      continue
    x, r, scale, bias, dy = _inputs(m, n, xd, rd, layer=layer)
    ours = _op(layer, residual_dtype=hd, mode=mode)
    want_fn = functools.partial(_ref, layer=layer, residual_dtype=hd)
    (y, h), pull = jax.vjp(ours, x, r, scale, bias)
    (y_w, h_w), pull_w = jax.vjp(want_fn, x, r, scale, bias)
    assert (y.dtype, h.dtype) == (y_w.dtype, h_w.dtype) == (jnp.dtype(xd), h_w.dtype)
    assert h.dtype == jnp.dtype(hd or rd)
    _close(y, y_w, xd, n, f"y {m}x{n}")
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_w, np.float32))
    dh = jnp.asarray(np.random.default_rng(n).standard_normal((m, n)), h.dtype)
    grads, grads_w = pull((dy, dh)), pull_w((dy, dh))
    for name, g, w in zip(("dx", "dresidual", "dscale", "dbias"), grads, grads_w):
      if w is None:
        assert g is None
        continue
      assert g.dtype == w.dtype, name
      _close(g, w, _coarser(xd, h.dtype, g.dtype if g.ndim == 2 else None),
             m if name in ("dscale", "dbias") else n, f"{name} {m}x{n}")


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("xd", ["float32", "bfloat16"])
def test_matches_torch(layer, xd):
  """Against torch: ``h = x + r`` in float64, then the norm; loss sum(y*dy) + sum(h*dh).
  The error of ours and of torch in x's dtype are both bounded by the float64 answer."""
  m, n = 33, 1000
  x, r, scale, bias, dy = _inputs(m, n, xd, "float32", layer=layer)
  dh = jnp.asarray(np.random.default_rng(1).standard_normal((m, n)), jnp.float32)
  t = lambda a, dt=torch.float64: None if a is None else torch.tensor(
      np.asarray(jnp.asarray(a, jnp.float32)), dtype=dt, requires_grad=True)
  xt, rt, st, bt = t(x), t(r), t(scale), t(bias)
  ht = xt + rt
  yt = (torch.nn.functional.layer_norm(ht, (n,), st, bt, 1e-5) if layer
        else torch.nn.functional.rms_norm(ht, (n,), st, _EPS_RMS))
  ((yt * t(dy, torch.float64).detach()).sum() + (ht * t(dh).detach()).sum()).backward()
  want = [yt.detach().numpy(), ht.detach().numpy(), xt.grad.numpy(), rt.grad.numpy(),
          st.grad.numpy()]
  (y, h), pull = jax.vjp(_op(layer), x, r, scale, bias)
  dx, dr, ds, _ = pull((dy, dh))
  _close(y, want[0], xd, n, "y")
  _close(h, want[1], "float32", 1, "h")
  _close(dx, want[2], xd, n, "dx")
  _close(dr, want[3], xd, n, "dresidual")  # dx + dh, rounded through x's dtype or not
  _close(ds, want[4], xd, m, "dscale")


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("which", ["y", "h", "both"])
def test_cotangents_on_one_output(layer, which):
  """jax.vjp with the cotangent on y only, on h only, and on both."""
  x, r, scale, bias, dy = _inputs(9, 300, "float32", "float32", layer=layer)
  dh = jnp.asarray(np.random.default_rng(2).standard_normal((9, 300)), jnp.float32)
  cts = {"y": (dy, jnp.zeros_like(dh)), "h": (jnp.zeros_like(dy), dh), "both": (dy, dh)}
  got = jax.vjp(_op(layer), x, r, scale, bias)[1](cts[which])
  want = jax.vjp(functools.partial(_ref, layer=layer), x, r, scale, bias)[1](cts[which])
  for g, w in zip(got, want):
    if w is not None:
      _close(g, w, "float32", 300)
  if which == "h":  # only the add: dx = dresidual = dh, dscale = 0
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(dh))
    np.testing.assert_array_equal(np.asarray(got[2]), 0.0)


def test_transforms_and_determinism():
  """jit, vmap, grad under checkpoint, a rank-3 x, 1-D x; bitwise-equal reruns."""
  x, r, scale, _, _ = _inputs(12, 96, "bfloat16", "float32", layer=False)
  f = _op(False, residual_dtype=jnp.float32)
  want = _ref(x, r, scale, None, layer=False, residual_dtype=jnp.float32)
  for got in (jax.jit(f)(x, r, scale, None),
              jax.vmap(f, in_axes=(0, 0, None, None))(x.reshape(3, 4, 96),
                                                       r.reshape(3, 4, 96), scale, None),
              f(x.reshape(3, 4, 96), r.reshape(3, 4, 96), scale, None)):
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g, np.float32).reshape(w.shape),
                                    np.asarray(w, np.float32))
  y1, h1 = f(x[0], r[0], scale, None)
  assert y1.shape == h1.shape == (96,)

  def loss(x, r, s):
    y, h = jax.checkpoint(f)(x, r, s, None)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(h))

  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  g1, g2 = g(x, r, scale), g(x, r, scale)
  gw = jax.grad(lambda x, r, s: jnp.sum(_ref(x, r, s, None, layer=False,
                                              residual_dtype=jnp.float32)[0]
                                         .astype(jnp.float32) ** 2)
                + jnp.sum(jnp.sin(_ref(x, r, s, None, layer=False,
                                       residual_dtype=jnp.float32)[1])),
                argnums=(0, 1, 2))(x, r, scale)
  for a, b, w in zip(g1, g2, gw):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _close(a, w, a.dtype if a.ndim == 2 else "bfloat16", 96)


def test_without_residual_unchanged():
  """No residual: the op returns y alone, bit for bit what it returned before."""
  x, _, scale, _, _ = _inputs(7, 1000, "bfloat16", "bfloat16", layer=False)
  y = pallas_norm.rms_norm(x, scale)
  assert isinstance(y, jax.Array)
  y_ref = reference.norm(x, scale, None, eps=_EPS_RMS, subtract_mean=False)[0]
  _close(y, y_ref, "bfloat16", 1000)


def test_xla_backend_is_the_formula():
  x, r, scale, bias, _ = _inputs(5, 64, "bfloat16", "float32", layer=True)
  got = pallas_norm.layer_norm(x, scale, bias, residual=r, backend="xla")
  for g, w in zip(got, _ref(x, r, scale, bias, layer=True)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_errors():
  x = jnp.ones((4, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"residual.shape=\(4, 7\) must equal"):
    pallas_norm.rms_norm(x, residual=jnp.ones((4, 7)))
  with pytest.raises(TypeError, match="residual.dtype=int32"):
    pallas_norm.rms_norm(x, residual=jnp.ones((4, 8), jnp.int32))
  with pytest.raises(ValueError, match="needs a residual"):
    pallas_norm.rms_norm(x, residual_dtype=jnp.float32)
  with pytest.raises(TypeError, match="residual_dtype=int8"):
    pallas_norm.layer_norm(x, residual=x, residual_dtype=jnp.int8)


# ------------------------------------------------------- every kernel variant, by config


def _launch_case(m, n, layer, cfg_fwd, cfg_bwd, xd="bfloat16", rd="float32", hd="float32"):
  """norm_forward(residual=) with cfg_fwd and norm_backward(dh=) with cfg_bwd against
  the formula's values and vjp."""
  from pallas_norm.kernels import backward, forward
  x, r, scale, bias, dy = _inputs(m, n, xd, rd, layer=layer)
  b = bias if layer else None
  kw = dict(eps=1e-5, scale_offset=0.5, subtract_mean=layer)
  y, mean, rstd, h = forward.norm_forward(x, scale, b, config=cfg_fwd, interpret=_interpret(),
                                          residual=r, residual_dtype=jnp.dtype(hd), **kw)
  ref = functools.partial(_ref, layer=layer, residual_dtype=hd, scale_offset=0.5)
  (y_w, h_w), pull = jax.vjp(lambda x, r, s, c: ref(x, r, s, c), x, r, scale, b)
  _close(y, y_w, xd, n, "y")
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_w, np.float32))
  dh = jnp.asarray(np.random.default_rng(3).standard_normal((m, n)), hd)
  dx, dres, ds, db = backward.norm_backward(
      dy, h, scale, mean, rstd, has_bias=layer, scale_offset=0.5, subtract_mean=layer,
      config=cfg_bwd, interpret=_interpret(), scale_dtype=scale.dtype,
      bias_dtype=scale.dtype, dh=dh, dx_dtype=jnp.dtype(xd), residual_dtype=jnp.dtype(rd))
  want = pull((dy, dh))
  assert (dx.dtype, dres.dtype) == (jnp.dtype(xd), jnp.dtype(rd))
  for name, g, w in zip(("dx", "dres", "dscale", "dbias"), (dx, dres, ds, db), want):
    if w is not None:
      _close(g, w, xd, m if name in ("dscale", "dbias") else n, name)


FWD = {
    "cached": pn_config.ForwardConfig("multi_wave_cached", 2, 1024, 4),
    "cached_split": pn_config.ForwardConfig("multi_wave_cached", 2, 256, 4, chunk_n=64),
    "reload": pn_config.ForwardConfig("multi_wave_reload", 2, 256, 4),
    "persistent": pn_config.ForwardConfig("static_persistent", 2, 1024, 4, 3),
    "persistent_chunked": pn_config.ForwardConfig("static_persistent", 2, 256, 4, 3),
    "persistent_split": pn_config.ForwardConfig("static_persistent", 1, 256, 4, 2,
                                                split_rows=True, split_lag=2),
}
_RED = pn_config.reduce_config(1000, 2)
BWD = {
    "persistent": pn_config.BackwardConfig(2, 1024, 4, 2, **_RED),
    "pieces": pn_config.BackwardConfig(1, 1024, 4, 2, pieces=(512, 256, 128, 64, 32, 16), **_RED),
    "reload": pn_config.BackwardConfig(2, 256, 4, 2, reload_rows=True, **_RED),
    "split": pn_config.BackwardConfig(1, 256, 4, 2, split_rows=True, split_lag=1,
                                      chunk_n=64, **_RED),
    "columns": pn_config.BackwardConfig(2, 256, 4, 2, **_RED),
}


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("fwd,bwd", list(zip(FWD, list(BWD) + ["persistent"])))
def test_kernel_variants(fwd, bwd, layer):
  _launch_case(9, 1000, layer, FWD[fwd], BWD[bwd])


@pytest.mark.parametrize("bwd", ["persistent", "columns"])
def test_dh_loaded_at_store(monkeypatch, bwd):
  """Backward stage 1 with dh loaded at the store (tiles wider than
  PREFETCH_DH_MAX_BLOCK_N) rather than prefetched with x and dy."""
  from pallas_norm.kernels import backward
  monkeypatch.setattr(backward, "PREFETCH_DH_MAX_BLOCK_N", 0)
  _launch_case(9, 1000, True, FWD["persistent"], BWD[bwd])


_STAGE1_KNOBS = {"recompute": dict(recompute_dx=True),
                 "stats_joint": dict(prefetch_stats=True, joint_row_sums=True),
                 "depth3_all": dict(prefetch_depth=3, recompute_dx=True,
                                    prefetch_stats=True, joint_row_sums=True),
                 "reload_all": dict(reload_scale=True, recompute_dx=True,
                                    prefetch_stats=True, joint_row_sums=True)}


@pytest.mark.parametrize("knobs", list(_STAGE1_KNOBS))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_stage1_knobs_bitwise(layer, residual, knobs):
  """The persistent stage 1 with row blocks prefetched further ahead, dx computed from x
  and dy converted again after the row reductions, mean/rstd loaded a row block ahead,
  LayerNorm's two row sums as one reduction, or the scale loaded each row block
  (BackwardConfig.prefetch_depth, recompute_dx, prefetch_stats, joint_row_sums,
  reload_scale): the same values as the stock kernel, bit
  for bit (the same float32 operations in the same order); bf16, so that recompute_dx
  takes its path. On the GPU (``--gpu``) at a width of the rules ([T#recompute-dx],
  [T#stage1-flags]) and ragged rows."""
  from pallas_norm.kernels import backward
  m, n, g = (1000, 8192, 132) if not _interpret() else (13, 256, 3)  # 3 steps a program
  x, r, scale, _, dy = _inputs(m, n, "bfloat16", "bfloat16", layer=layer)
  h = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(jnp.bfloat16)
  _, mean, rstd = reference.norm(h, scale, None, eps=1e-5, subtract_mean=layer)
  dh = jnp.asarray(np.random.default_rng(5).standard_normal((m, n)), jnp.bfloat16)
  base = pn_config.BackwardConfig(2 if _interpret() else 1, n, 4 if _interpret() else 16,
                                  g, **pn_config.reduce_config(n, g))
  kw = dict(has_bias=layer, scale_offset=0.0, subtract_mean=layer, interpret=_interpret(),
            scale_dtype=jnp.bfloat16, bias_dtype=jnp.bfloat16)
  if residual:
    kw.update(dh=dh, dx_dtype=jnp.bfloat16, residual_dtype=jnp.bfloat16)
  run = lambda cfg: backward.norm_backward(dy, h, scale.astype(jnp.bfloat16), mean, rstd,
                                           config=cfg, **kw)
  want = run(base)
  got = run(dataclasses.replace(base, **_STAGE1_KNOBS[knobs]))
  for a, b in zip(got, want):
    if b is not None:
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_prefetch_depth_checked():
  with pytest.raises(ValueError, match="prefetch_depth"):
    pn_config.BackwardConfig(1, 256, 4, 2, prefetch_depth=0)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_kernel_variants_same_dtype(layer):
  """x, residual and h all bf16: dx and dresidual are one array."""
  _launch_case(5, 1000, layer, FWD["cached_split"], BWD["split"], "bfloat16", "bfloat16",
               "bfloat16")


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("mode", MODES)
def test_tensor_parallel_kernels(layer, mode):
  """norm_forward_stats / norm_forward_apply with a residual (the hidden-dim-sharded
  pair), one shard: the statistics are h's, h is written by the statistics kernel."""
  from pallas_norm.kernels import forward
  m, n = 7, 300
  x, r, scale, bias, _ = _inputs(m, n, "bfloat16", "float32", layer=layer)
  cfg = pn_config.forward_config(m, n, jnp.bfloat16, mode, subtract_mean=layer)
  s1, s2, h = forward.norm_forward_stats(x, subtract_mean=layer, config=cfg,
                                         interpret=_interpret(), residual=r)
  hf = x.astype(jnp.float32) + r
  np.testing.assert_array_equal(np.asarray(h), np.asarray(hf))
  if layer:
    mean, rstd = s1, jax.lax.rsqrt(s2 / n + 1e-5)
  else:
    mean, rstd = None, jax.lax.rsqrt(s1 / n + 1e-5)
  y = forward.norm_forward_apply(x, scale, bias if layer else None, mean, rstd,
                                 scale_offset=0.0, config=cfg, interpret=_interpret(),
                                 residual=r)
  y_w = reference.norm(hf, scale, bias if layer else None, eps=1e-5, subtract_mean=layer)[0]
  _close(y, y_w.astype(jnp.bfloat16), "bfloat16", n)


# --------------------------------------------------------------------------- flax layers


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_flax_layers(kind):
  """NNX and Linen: ``norm(x, residual=r)`` returns (y, h) as the op does, with the
  layer's ``residual_dtype``; without a residual the layer returns y alone."""
  from flax import nnx

  from flax_layers import linen as pn_linen
  x, r, _, _, _ = _inputs(6, 64, "bfloat16", "bfloat16", layer=kind == "layer")
  nnx_cls, linen_cls = ((pallas_norm.RMSNorm, pn_linen.RMSNorm) if kind == "rms"
                        else (pallas_norm.LayerNorm, pn_linen.LayerNorm))
  layer = nnx_cls(64, residual_dtype=jnp.float32, rngs=nnx.Rngs(0))
  y, h = layer(x, residual=r)
  assert h.dtype == jnp.float32
  want = _op(kind == "layer", residual_dtype=jnp.float32, eps=1e-6)(
      x.astype(jnp.float32), r, jnp.ones(64), None if kind == "rms" else jnp.zeros(64))
  for g, w in zip((y, h), want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert isinstance(layer(x), jax.Array)
  lin = linen_cls(residual_dtype=jnp.float32)
  variables = lin.init(jax.random.key(0), x)
  y2, h2 = lin.apply(variables, x, residual=r)
  for g, w in zip((y2, h2), want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
