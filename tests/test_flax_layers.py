"""flax_layers: drop-in proof against flax.nnx / flax.linen RMSNorm and LayerNorm.

The same small model is built twice from the same ``nnx.Rngs``, once with flax's norms
and once with pallas_norm's; params, outputs, gradients, an optax step, split/merge and
remat must agree. Runs the Pallas kernels (interpret mode on CPU), so shapes are small.
"""

import dataclasses
import inspect
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import flax_layers
import pallas_norm
from flax_layers import linen as pl_linen
from pallas_norm import config

_D_IN, _D, _D_OUT = 8, 16, 4
_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}
_PAIRS = [(nnx.RMSNorm, pallas_norm.RMSNorm), (nnx.LayerNorm, pallas_norm.LayerNorm)]
_LINEN_PAIRS = [(nn.RMSNorm, pl_linen.RMSNorm), (nn.LayerNorm, pl_linen.LayerNorm)]


class _Model(nnx.Module):
  """Linear -> RMSNorm -> gelu -> Linear -> LayerNorm -> Linear."""

  def __init__(self, rms, ln, *, rngs: nnx.Rngs):
    self.inp = nnx.Linear(_D_IN, _D, rngs=rngs)
    self.rms = rms(_D, rngs=rngs)
    self.mid = nnx.Linear(_D, _D, rngs=rngs)
    self.ln = ln(_D, rngs=rngs)
    self.out = nnx.Linear(_D, _D_OUT, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.gelu(self.rms(self.inp(x)))
    return self.out(self.ln(self.mid(h)))


def _models(seed=0):
  return (_Model(nnx.RMSNorm, nnx.LayerNorm, rngs=nnx.Rngs(seed)),
          _Model(pallas_norm.RMSNorm, pallas_norm.LayerNorm, rngs=nnx.Rngs(seed)))


def _x(shape=(2, 5, _D_IN), dtype=jnp.float32, seed=1):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _flat(tree):
  return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_same_params(ref, got):
  ref, got = _flat(ref), _flat(got)
  assert list(ref) == list(got)
  for k in ref:
    assert (ref[k].shape, ref[k].dtype) == (got[k].shape, got[k].dtype), k
    np.testing.assert_array_equal(ref[k], got[k], err_msg=k)


def _assert_close(ref, got, tol=1e-5):
  for (k, r), g in zip(_flat(ref).items(), _flat(got).values()):
    assert r.dtype == g.dtype, k
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                               rtol=tol, atol=tol, err_msg=k)


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


# --------------------------------------------------------------------------- import


def test_import_pallas_norm_does_not_import_flax():
  code = ("import sys, pallas_norm; assert 'flax' not in sys.modules, 'flax imported'; "
          "import flax_layers; assert pallas_norm.RMSNorm is flax_layers.RMSNorm; "
          "assert pallas_norm.LayerNorm is flax_layers.LayerNorm; "
          "assert flax_layers.linen.RMSNorm.__module__ == 'flax_layers.linen'")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  subprocess.run([sys.executable, "-c", code], check=True, env=env,
                 cwd=os.path.dirname(os.path.dirname(__file__)))


def test_unknown_attribute():
  with pytest.raises(AttributeError, match="GroupNorm"):
    pallas_norm.GroupNorm  # noqa: B018


# --------------------------------------------------------------------------- NNX drop-in


def test_same_params_tree():
  ref, got = _models()
  _assert_same_params(nnx.state(ref, nnx.Param), nnx.state(got, nnx.Param))


def test_uses_the_pallas_kernel():
  layer = pallas_norm.RMSNorm(_D, rngs=nnx.Rngs(0))
  assert "pallas_call" in str(jax.make_jaxpr(layer)(_x((3, _D))))
  layer = pallas_norm.RMSNorm(_D, backend="xla", rngs=nnx.Rngs(0))
  assert "pallas_call" not in str(jax.make_jaxpr(layer)(_x((3, _D))))


def test_jit_grad_and_optax_steps_match_flax():
  x, y = _x(), _x((2, 5, _D_OUT), seed=2)

  def loss_and_out(model, x, y):
    out = model(x)
    return jnp.mean((out - y) ** 2), out

  @nnx.jit
  def step(model, opt, x, y):
    (loss, out), (grads, dx) = nnx.value_and_grad(loss_and_out, argnums=(0, 1),
                                                  has_aux=True)(model, x, y)
    opt.update(model, grads)
    return loss, out, grads, dx

  first, params = [], []
  for model in _models():
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    first.append(step(model, opt, x, y))
    losses = [float(step(model, opt, x, y)[0]) for _ in range(2)]
    assert losses[-1] < float(first[-1][0])
    params.append(nnx.state(model, nnx.Param))
  (l_ref, out_ref, g_ref, dx_ref), (l_got, out_got, g_got, dx_got) = first
  np.testing.assert_allclose(out_got, out_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(l_got, l_ref, rtol=1e-5)
  np.testing.assert_allclose(dx_got, dx_ref, rtol=1e-4, atol=1e-5)
  _assert_close(g_ref, g_got, tol=1e-4)
  _assert_close(*params, tol=1e-4)


def test_split_merge_and_checkpoint_swap():
  ref, got = _models()
  x = _x()
  forward = nnx.jit(lambda m, x: m(x))
  y_ref, y_got = ref(x), forward(got, x)
  graphdef, state = nnx.split(got)
  np.testing.assert_array_equal(forward(nnx.merge(graphdef, state), x), y_got)
  # A flax-norm model's state loads into the pallas_norm graph, and back.
  _, ref_state = nnx.split(ref)
  np.testing.assert_allclose(forward(nnx.merge(graphdef, ref_state), x), y_ref,
                             rtol=1e-5, atol=1e-5)
  nnx.update(ref, state)


def test_remat_matches_flax():
  ref, got = _models()
  x, y = _x(), _x((2, 5, _D_OUT), seed=2)

  def remat_loss(model, x, y):
    return jnp.mean((nnx.remat(lambda m, x: m(x))(model, x) - y) ** 2)

  g_ref = nnx.grad(_loss)(ref, x, y)
  g_remat = nnx.jit(nnx.grad(remat_loss))(got, x, y)
  _assert_close(g_ref, g_remat, tol=1e-4)


@pytest.mark.parametrize("x_dtype,param_dtype,dtype", [
    (jnp.float32, jnp.float32, None),
    (jnp.bfloat16, jnp.float32, None),  # promotes to float32, as flax does
    (jnp.bfloat16, jnp.bfloat16, None),
    (jnp.float32, jnp.float32, jnp.bfloat16),
    (jnp.float16, jnp.float32, jnp.float16),
])
@pytest.mark.parametrize("pair", _PAIRS, ids=["rms", "ln"])
def test_dtypes_follow_flax(pair, x_dtype, param_dtype, dtype):
  flax_cls, ours_cls = pair
  ref = flax_cls(_D, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
  got = ours_cls(_D, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
  _assert_same_params(nnx.state(ref), nnx.state(got))
  x = _x((3, _D), x_dtype)
  y_ref, y_got = ref(x), got(x)
  assert y_got.dtype == y_ref.dtype and y_got.shape == y_ref.shape
  tol = _TOL[jnp.dtype(y_ref.dtype).type]
  np.testing.assert_allclose(np.asarray(y_got, np.float32), np.asarray(y_ref, np.float32),
                             rtol=tol, atol=tol)


@pytest.mark.parametrize("kwargs", [{"use_scale": False}, {"use_bias": False},
                                    {"use_scale": False, "use_bias": False},
                                    {"epsilon": 1e-2}])
def test_layer_norm_options_match_flax(kwargs):
  ref = nnx.LayerNorm(_D, **kwargs, rngs=nnx.Rngs(0))
  got = pallas_norm.LayerNorm(_D, **kwargs, rngs=nnx.Rngs(0))
  _assert_same_params(nnx.state(ref), nnx.state(got))
  for k, v in kwargs.items():
    assert getattr(got, k) == v
  x = _x((3, 2, _D)) * 0.1
  np.testing.assert_allclose(got(x), ref(x), rtol=1e-5, atol=1e-5)


def test_rms_norm_without_scale_and_initialisers():
  ref = nnx.RMSNorm(_D, use_scale=False, rngs=nnx.Rngs(0))
  got = pallas_norm.RMSNorm(_D, use_scale=False, rngs=nnx.Rngs(0))
  assert got.scale is None and not nnx.state(got)
  x = _x((3, _D))
  np.testing.assert_allclose(got(x), ref(x), rtol=1e-5, atol=1e-5)
  init = nnx.initializers.normal(1.0)
  ref = nnx.RMSNorm(_D, scale_init=init, rngs=nnx.Rngs(3))
  got = pallas_norm.RMSNorm(_D, scale_init=init, rngs=nnx.Rngs(3))
  _assert_same_params(nnx.state(ref), nnx.state(got))
  np.testing.assert_allclose(got(x), ref(x), rtol=1e-5, atol=1e-5)


def test_scale_offset_zero_centred_gamma():
  x = _x((3, _D))
  plain = pallas_norm.RMSNorm(_D, rngs=nnx.Rngs(0))
  gemma = pallas_norm.RMSNorm(_D, scale_init=nnx.initializers.zeros, scale_offset=1.0,
                              rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(gemma.scale[...], 0.0)
  np.testing.assert_allclose(gemma(x), plain(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", config.MODES)
def test_mode_passes_through(mode):
  ref = nnx.RMSNorm(_D, rngs=nnx.Rngs(0))
  got = pallas_norm.RMSNorm(_D, mode=mode, rngs=nnx.Rngs(0))
  x = _x((7, _D))
  np.testing.assert_allclose(got(x), ref(x), rtol=1e-5, atol=1e-5)


def test_bad_mode_and_backend_raise_at_construction():
  with pytest.raises(ValueError, match="RMSNorm: mode='fastest'.*valid modes"):
    pallas_norm.RMSNorm(_D, mode="fastest", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="LayerNorm: backend='cuda'.*valid backends"):
    pallas_norm.LayerNorm(_D, backend="cuda", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(epsilon=None), TypeError, "RMSNorm: epsilon must be a real number"),
    (dict(epsilon="a"), TypeError, "epsilon must be a real number"),
    (dict(epsilon=-1e-6), ValueError, "epsilon=-1e-06 must be finite and >= 0"),
    (dict(scale_offset=None), TypeError, "scale_offset must be a real number"),
    (dict(cast="bogus"), ValueError, "cast='bogus' is not a casting mode"),
    (dict(residual_dtype="banana"), TypeError, "residual_dtype='banana' is not a dtype"),
    (dict(residual_dtype=jnp.int32), TypeError, "residual_dtype=int32 must be float32"),
    (dict(num_features=0), ValueError, "num_features=0 must be a positive int"),
    (dict(num_features=-1), ValueError, "num_features=-1 must be a positive int"),
])
def test_constructor_checks(kw, exc, match):
  """The NNX layers check their own arguments when built, naming the argument (not a
  bare float() or broadcast error at the first call); Linen's at its first call."""
  kw = {"num_features": _D, **kw}
  with pytest.raises(exc, match=match):
    pallas_norm.RMSNorm(rngs=nnx.Rngs(0), **kw)
  linen_kw = {k: v for k, v in kw.items() if k != "num_features"}
  if linen_kw:
    from flax_layers import linen as ours_linen
    with pytest.raises(exc, match=match):
      ours_linen.RMSNorm(**linen_kw).init(jax.random.key(0), _x((2, _D)))


# --------------------------------------------------------------------------- Linen


@pytest.mark.parametrize("pair", _LINEN_PAIRS, ids=["rms", "ln"])
def test_linen_init_apply_grad_match_flax(pair):
  flax_cls, ours_cls = pair
  x = _x((2, 3, _D))
  v_ref = flax_cls().init(jax.random.key(0), x)
  v_got = ours_cls().init(jax.random.key(0), x)
  _assert_same_params(v_ref, v_got)

  def loss(cls, v, x):
    return jnp.sum(jnp.sin(cls().apply(v, x)))

  np.testing.assert_allclose(ours_cls().apply(v_got, x), flax_cls().apply(v_ref, x),
                             rtol=1e-5, atol=1e-5)
  g_ref = jax.grad(loss, argnums=(1, 2))(flax_cls, v_ref, x)
  g_got = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)(ours_cls, v_got, x)
  _assert_close(g_ref, g_got, tol=1e-4)


@pytest.mark.parametrize("kwargs", [{"param_dtype": jnp.bfloat16},
                                    {"dtype": jnp.bfloat16},
                                    {"use_scale": False, "epsilon": 1e-3}])
@pytest.mark.parametrize("pair", _LINEN_PAIRS, ids=["rms", "ln"])
def test_linen_options_match_flax(pair, kwargs):
  flax_cls, ours_cls = pair
  x = _x((3, _D))
  v_ref = flax_cls(**kwargs).init(jax.random.key(0), x)
  v_got = ours_cls(**kwargs).init(jax.random.key(0), x)
  _assert_same_params(v_ref, v_got)
  y_ref, y_got = flax_cls(**kwargs).apply(v_ref, x), ours_cls(**kwargs).apply(v_got, x)
  assert y_got.dtype == y_ref.dtype
  tol = _TOL[jnp.dtype(y_ref.dtype).type]
  np.testing.assert_allclose(np.asarray(y_got, np.float32), np.asarray(y_ref, np.float32),
                             rtol=tol, atol=tol)


@pytest.mark.parametrize("pair", _LINEN_PAIRS, ids=["rms", "ln"])
def test_linen_narrow_dtype_normalises_x_as_given(pair):
  """flax.linen computes the statistics from x as given and casts only y to ``dtype``:
  fp32 x at 1000 + small noise with dtype=bf16 (rounded to bf16 first, every x would be
  1000 and LayerNorm's y all zeros). The Linen twins do the same; with a residual, h is
  x + r summed from the unrounded x (its dtype: residual_dtype). (flax with
  use_fast_variance=False: its E[x^2] - E[x]^2 cancels at this offset.)"""
  flax_cls, ours_cls = pair
  x = 1000 + 0.1 * _x((4, 64))
  v = flax_cls().init(jax.random.key(0), x)
  y_ref = flax_cls(dtype=jnp.bfloat16, use_fast_variance=False).apply(v, x)
  y_got = ours_cls(dtype=jnp.bfloat16).apply(v, x)
  assert y_got.dtype == y_ref.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y_got, np.float32), np.asarray(y_ref, np.float32),
                             rtol=1e-2, atol=1e-2)
  assert np.abs(np.asarray(y_got, np.float32)).max() > 0.5  # not the rounded x's zeros
  r = 0.1 * _x((4, 64))
  y, h = ours_cls(dtype=jnp.bfloat16, residual_dtype=jnp.float32).apply(v, x, r)
  assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(h), np.asarray(x + r))


def test_linen_in_a_model():
  class Net(nn.Module):
    norm: type

    @nn.compact
    def __call__(self, x):
      return nn.Dense(_D_OUT)(self.norm()(nn.Dense(_D)(x)))

  x = _x()
  v_ref = Net(nn.RMSNorm).init(jax.random.key(0), x)
  v_got = Net(pl_linen.RMSNorm).init(jax.random.key(0), x)
  _assert_same_params(v_ref, v_got)
  np.testing.assert_allclose(jax.jit(Net(pl_linen.RMSNorm).apply)(v_got, x),
                             Net(nn.RMSNorm).apply(v_ref, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pair", _PAIRS, ids=["rms", "ln"])
def test_nnx_accepts_every_flax_argument(pair):
  flax_cls, ours_cls = pair
  theirs = inspect.signature(flax_cls.__init__).parameters
  ours = inspect.signature(ours_cls.__init__).parameters
  assert [k for k in theirs if k not in ours] == []
  for k in theirs:
    assert ours[k].kind == theirs[k].kind, k
    if theirs[k].default is not inspect.Parameter.empty:
      assert ours[k].default == theirs[k].default, k
  assert "mask" in inspect.signature(ours_cls.__call__).parameters


@pytest.mark.parametrize("pair", _LINEN_PAIRS, ids=["rms", "ln"])
def test_linen_accepts_every_flax_attribute_in_flax_order(pair):
  """Positional construction means the same as flax's: flax's fields are our prefix."""
  flax_cls, ours_cls = pair
  names = lambda c: [f.name for f in dataclasses.fields(c) if f.name not in ("parent", "name")]
  assert names(ours_cls)[:len(names(flax_cls))] == names(flax_cls)
  defaults = {f.name: f.default for f in dataclasses.fields(flax_cls)}
  for f in dataclasses.fields(ours_cls):
    if f.name in defaults and f.name not in ("parent", "name"):
      assert f.default == defaults[f.name], f.name


@pytest.mark.parametrize("kwargs", [
    {"reduction_axes": (-1,), "feature_axes": -1},
    {"reduction_axes": 2, "feature_axes": [2]},           # x.ndim - 1 for a 3-D x
    {"use_fast_variance": False},
    {"scale_metadata": {"note": "s"}},
], ids=["tuple_axes", "positive_axes", "slow_variance", "metadata"])
@pytest.mark.parametrize("pair", _PAIRS, ids=["rms", "ln"])
def test_nnx_flax_arguments_match_flax(pair, kwargs):
  flax_cls, ours_cls = pair
  x = _x((2, 3, _D), jnp.bfloat16)
  ref, got = (c(_D, **kwargs, rngs=nnx.Rngs(0)) for c in pair)
  if "scale_metadata" in kwargs:
    assert got.scale.get_metadata()["note"] == "s"
    assert got.scale.get_metadata() == ref.scale.get_metadata()
  y_ref, y_got = ref(x), got(x)
  assert y_got.dtype == y_ref.dtype
  np.testing.assert_allclose(np.asarray(y_got, np.float32), np.asarray(y_ref, np.float32),
                             rtol=2e-2, atol=2e-2)


def test_nnx_bias_metadata_and_custom_promote_dtype():
  def to_f32(args, dtype=None):
    return tuple(None if a is None else jnp.asarray(a, jnp.float32) for a in args)
  kwargs = dict(bias_metadata={"note": "b"}, promote_dtype=to_f32)
  ref = nnx.LayerNorm(_D, **kwargs, rngs=nnx.Rngs(0))
  got = pallas_norm.LayerNorm(_D, **kwargs, rngs=nnx.Rngs(0))
  assert got.bias.get_metadata() == ref.bias.get_metadata()
  assert got.bias.get_metadata()["note"] == "b"
  x = _x((4, _D), jnp.bfloat16)
  y_ref, y_got = ref(x), got(x)
  assert y_got.dtype == y_ref.dtype == jnp.float32   # the promotion was to_f32's
  np.testing.assert_allclose(y_got, y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs", [{"force_float32_reductions": False},
                                    {"use_fast_variance": False, "reduction_axes": (2,)}],
                         ids=["bf16_reductions", "slow_variance"])
@pytest.mark.parametrize("pair", _LINEN_PAIRS, ids=["rms", "ln"])
def test_linen_flax_attributes_match_flax(pair, kwargs):
  x = _x((2, 3, _D), jnp.bfloat16)
  (v_ref, y_ref), (v_got, y_got) = [
      (lambda m: (lambda v: (v, m.apply(v, x)))(m.init(jax.random.key(0), x)))(c(**kwargs))
      for c in pair]
  _assert_same_params(v_ref, v_got)
  assert y_got.dtype == y_ref.dtype
  np.testing.assert_allclose(np.asarray(y_got, np.float32), np.asarray(y_ref, np.float32),
                             rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("cls", [pallas_norm.RMSNorm, pallas_norm.LayerNorm])
def test_nnx_unsupported_flax_arguments_are_clear_errors(cls):
  for bad in ({"reduction_axes": (-2, -1)}, {"feature_axes": -2}, {"reduction_axes": "x"}):
    with pytest.raises(ValueError, match="last axis only"):
      cls(_D, **bad, rngs=nnx.Rngs(0))
  x = _x((2, 3, _D))
  with pytest.raises(ValueError, match=r"reduction_axes=0 on x of rank 3.*last axis only"):
    cls(_D, reduction_axes=0, rngs=nnx.Rngs(0))(x)
  layer = cls(_D, rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="mask"):
    layer(x, mask=x > 0)
  with pytest.raises(TypeError, match="not flax's `mask`"):
    layer(x, x > 0)                                     # flax's RMSNorm(x, mask)
  with pytest.raises(ValueError, match="promote_dtype"):
    cls(_D, cast="llama", promote_dtype=lambda a, dtype=None: a, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("cls", [pl_linen.RMSNorm, pl_linen.LayerNorm])
def test_linen_unsupported_flax_attributes_are_clear_errors(cls):
  x = _x((2, 3, _D))
  with pytest.raises(ValueError, match="last axis only"):
    cls(reduction_axes=(-2, -1)).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="feature_axes=1 on x of rank 3"):
    cls(feature_axes=1).init(jax.random.key(0), x)
  v = cls().init(jax.random.key(0), x)
  with pytest.raises(NotImplementedError, match="mask"):
    cls().apply(v, x, mask=x > 0)


class _ScanBlock(nnx.Module):
  """x + Linear(norm(x)), bf16 activations: the block a scanned LLM stack repeats."""

  def __init__(self, norm, *, rngs: nnx.Rngs):
    self.norm = norm(_D, rngs=rngs)
    self.lin = nnx.Linear(_D, _D, dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, x):
    return x + self.lin(self.norm(x))


class _ScanStack(nnx.Module):
  """Three blocks with stacked params ([3, ...]), run by nnx.scan over nnx.remat."""

  def __init__(self, norm, *, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _ScanBlock(norm, rngs=rngs)
    self.blocks = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, block):
      return block(x)
    return body(x, self.blocks)


@pytest.mark.parametrize("pair", _PAIRS, ids=["rms", "ln"])
def test_nnx_scan_over_layers_matches_flax(pair):
  """Layers stacked by nnx.vmap and run by nnx.scan (+ remat), as scanned LLM stacks are."""
  x = jax.random.normal(jax.random.key(3), (2, 5, _D), jnp.bfloat16)
  results = []
  for cls in pair:
    model = _ScanStack(cls, rngs=nnx.Rngs(0))
    loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)
    results.append(nnx.jit(nnx.value_and_grad(loss))(model, x))
  (l_ref, g_ref), (l_got, g_got) = results
  np.testing.assert_allclose(float(l_got), float(l_ref), rtol=2e-2)
  g_ref, g_got = nnx.to_pure_dict(g_ref), nnx.to_pure_dict(g_got)
  assert g_got["blocks"]["norm"]["scale"].shape == (3, _D)
  for path in (("norm", "scale"), ("lin", "kernel")):
    want = g_ref["blocks"][path[0]][path[1]]
    got = g_got["blocks"][path[0]][path[1]]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                               atol=2e-2 * float(jnp.max(jnp.abs(want))), rtol=0)


@pytest.mark.parametrize("pair", _LINEN_PAIRS, ids=["rms", "ln"])
def test_linen_scan_over_layers_matches_flax(pair):
  """Linen: nn.scan over nn.remat blocks, params stacked on a leading layer axis."""
  def stack(norm):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        return x + nn.Dense(_D, dtype=jnp.bfloat16)(norm()(x)), None

    class Stack(nn.Module):
      @nn.compact
      def __call__(self, x):
        layers = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=3)
        return layers()(x, None)[0]
    return Stack()

  x = jax.random.normal(jax.random.key(4), (2, 5, _D), jnp.bfloat16)
  results = []
  for cls in pair:
    net = stack(cls)
    params = net.init(jax.random.key(0), x)
    loss = lambda p, x: jnp.mean(net.apply(p, x).astype(jnp.float32) ** 2)
    results.append((params, jax.jit(jax.value_and_grad(loss))(params, x)))
  (p_ref, (l_ref, g_ref)), (p_got, (l_got, g_got)) = results
  _assert_same_params(p_ref, p_got)
  np.testing.assert_allclose(float(l_got), float(l_ref), rtol=2e-2)
  (name,) = [k for k in g_got["params"]["ScanCheckpointBlock_0"] if "Norm" in k]
  want = jax.tree.leaves(g_ref["params"]["ScanCheckpointBlock_0"][name])
  got = jax.tree.leaves(g_got["params"]["ScanCheckpointBlock_0"][name])
  for w, g in zip(want, got, strict=True):
    assert g.shape[0] == 3
    np.testing.assert_allclose(np.asarray(g), np.asarray(w),
                               atol=2e-2 * float(jnp.max(jnp.abs(w))), rtol=0)


def test_all_names():
  assert flax_layers.__all__ == ["RMSNorm", "LayerNorm", "RMSNormDenseFP8",
                                 "LayerNormDenseFP8", "Fp8Meta", "update_fp8_meta", "linen"]
  assert pl_linen.__all__ == ["RMSNorm", "LayerNorm", "RMSNormDenseFP8", "LayerNormDenseFP8"]
