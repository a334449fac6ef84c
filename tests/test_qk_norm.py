"""pallas_norm.qk_norm: the QK-norm of a packed q|k|v projection read in place (issue #58,
a decode step's slice copies). Interpret mode on CPU, the kernels on a GPU (--gpu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm


def _qkv(lead, h, k, d, dtype=jnp.bfloat16, extra=None, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  p = h + 2 * k if extra is None else h + k + extra
  qkv = (jax.random.normal(keys[0], (*lead, p, d), jnp.float32) * 2.0 + 0.5).astype(dtype)
  qs = jax.random.normal(keys[1], (d,), jnp.float32) * 0.5 + 1.0
  ks = jax.random.normal(keys[2], (d,), jnp.float32) * 0.5 + 1.0
  return qkv, qs, ks


def _slices(qkv, qs, ks, h, k, **kw):
  return (pallas_norm.rms_norm(qkv[..., :h, :], qs, **kw),
          pallas_norm.rms_norm(qkv[..., h:h + k, :], ks, **kw))


def _same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# (leading axes, H, K, head_dim, heads after q|k): decode (1 token), a batch, odd counts
SHAPES = [((1,), 8, 4, 128, None), ((3, 5), 8, 4, 128, None), ((7,), 7, 3, 96, None),
          ((2,), 16, 2, 64, 0), ((4,), 4, 4, 256, 9)]


@pytest.mark.parametrize("lead,h,k,d,extra", SHAPES)
@pytest.mark.parametrize("cast", ["torch", "gemma"])
def test_same_bits_as_the_slices(lead, h, k, d, extra, cast):
  """q and k bit for bit those of rms_norm on the two slices (bf16, float32 scales
  rounded to bf16 with param_cast as the NNX layers pass them; and, for one shape,
  float32 x)."""
  qkv, qs, ks = _qkv(lead, h, k, d, extra=extra)
  kw = dict(eps=1e-6, cast=cast, param_cast=jnp.bfloat16)
  q, kk = pallas_norm.qk_norm(qkv, qs, ks, num_heads=h, num_kv_heads=k, **kw)
  assert q.shape == (*lead, h, d) and kk.shape == (*lead, k, d)
  _same((q, kk), _slices(qkv, qs, ks, h, k, **kw))
  if lead == (7,):  # float32 x and scales as they are, once
    f32 = qkv.astype(jnp.float32)
    _same(pallas_norm.qk_norm(f32, qs, ks, num_heads=h, num_kv_heads=k, cast=cast),
          _slices(f32, qs, ks, h, k, cast=cast))


def test_one_pass_no_copies():
  """The jitted program: two pallas_calls (one a head range) and no slice, gather or
  copy of qkv before them; the slices' program has its slices."""
  qkv, qs, ks = _qkv((2,), 8, 4, 128)
  jaxpr = jax.make_jaxpr(lambda a: pallas_norm.qk_norm(a, qs, ks, num_heads=8,
                                                       num_kv_heads=4))(qkv)

  def prims(j):
    out = []
    for e in j.eqns:
      out.append(str(e.primitive))
      if str(e.primitive) == "pallas_call":  # the kernel body's own ops don't count
        continue
      for v in e.params.values():  # nested jaxprs: custom_vjp, pjit
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            out += prims(sub)
    return out
  got = prims(jaxpr.jaxpr)
  assert got.count("pallas_call") == 2, got
  assert not {"slice", "dynamic_slice", "gather", "copy", "copy_p"} & set(got), got
  base = prims(jax.make_jaxpr(lambda a: _slices(a, qs, ks, 8, 4))(qkv).jaxpr)
  assert "slice" in base


def test_eager_calls_compile_once():
  """Two eager calls with equal arguments share one compiled program (the statics are
  hashable by value)."""
  from pallas_norm import qk
  qkv, qs, ks = _qkv((2,), 4, 2, 64)
  qk._qk_jit.clear_cache()
  for _ in range(2):
    jax.block_until_ready(pallas_norm.qk_norm(qkv, qs, ks, num_heads=4, num_kv_heads=2))
  assert qk._qk_jit._cache_size() == 1


def test_gradients_are_the_slices():
  """d qkv (zero on the value heads), d q_scale and d k_scale: the slices' vjp."""
  qkv, qs, ks = _qkv((3,), 4, 2, 64, dtype=jnp.float32)
  f = lambda a, s1, s2: pallas_norm.qk_norm(a, s1, s2, num_heads=4, num_kv_heads=2)
  g = lambda a, s1, s2: _slices(a, s1, s2, 4, 2)
  cts = tuple(jax.random.normal(jax.random.key(i), o.shape, o.dtype)
              for i, o in enumerate(g(qkv, qs, ks)))
  (_, pf), (_, pg) = jax.vjp(f, qkv, qs, ks), jax.vjp(g, qkv, qs, ks)
  got, want = pf(cts), pg(cts)
  _same(got, want)
  assert not np.asarray(got[0][:, 6:]).any()


def test_fallbacks_give_the_same_values():
  """cast="llama" and backend="xla" take the slices (the same function)."""
  qkv, qs, ks = _qkv((2,), 4, 2, 64)
  for kw in (dict(cast="llama"), dict(backend="xla")):
    _same(pallas_norm.qk_norm(qkv, qs, ks, num_heads=4, num_kv_heads=2, **kw),
          _slices(qkv, qs, ks, 4, 2, **kw))


@pytest.mark.parametrize("args,kw,err,match", [
    ("rank1", {}, ValueError, "rank >= 2"),
    ("few_heads", {}, ValueError, "fewer than num_heads"),
    ("scale_shape", {}, ValueError, "q_scale must have shape"),
    ("list", {}, TypeError, "qkv must be an array"),
    ("ints", {}, TypeError, "floating"),
    ("ok", dict(num_heads=0), ValueError, "num_heads must be >= 1"),
    ("ok", dict(num_kv_heads=2.0), TypeError, "num_kv_heads must be an int"),
    ("ok", dict(eps=-1.0), ValueError, "eps"),
    ("ok", dict(cast="nope"), ValueError, "cast"),
])
def test_bad_input(args, kw, err, match):
  """A clear error before any kernel runs."""
  qkv, qs, ks = _qkv((2,), 4, 2, 64)
  a = {"rank1": (qkv[0, 0],), "few_heads": (qkv[:, :5],), "list": ([[1.0]],),
       "ints": (qkv.astype(jnp.int32),), "scale_shape": (qkv,), "ok": (qkv,)}[args]
  q_scale = qs[:32] if args == "scale_shape" else qs
  kwargs = dict(dict(num_heads=4, num_kv_heads=2), **kw)
  with pytest.raises(err, match=match):
    pallas_norm.qk_norm(*a, q_scale, ks, **kwargs)
