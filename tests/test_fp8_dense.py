"""flax_layers.fp8: the fused norm -> FP8 dense layer against a jnp version of its recipe.

The recipe, written here from the formulas (module docstring of flax_layers.fp8): the
norm in float32 (pallas_norm.reference), each GEMM operand quantised with the same
scales (pallas_norm.fp8.quantise / current_scale, flax's compute_scale for delayed
scaling), the GEMMs in float32 of the dequantised operands (flax fp8_ops' dequantize),
and the norm's own vjp. The layer must give the same out, dx, dgamma, dbeta, dW, dbias
and the same new delayed-scaling state. Everything runs under jax.jit (eager dispatch
would compile op by op); most cases on the "xla" backend (the FP8 norm's kernels have
their own tests), one on the Pallas kernels in interpret mode.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.linen import fp8_ops

import flax_layers
import pallas_norm
from flax_layers import fp8
from flax_layers import linen as pl_linen
from pallas_norm import reference
from pallas_norm.fp8 import current_scale, fp8_max, quantise

_F32 = jnp.float32
_E4M3, _E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_EPS = 1e-6
# Same quantised operands on both sides: what is left is float32 accumulation order and
# the final rounding to x's dtype. On a GPU (--gpu) the layer's GEMMs are cuBLASLt's FP8
# ones (their own accumulation) and the compiled norm's float32 output may round an
# element to the neighbouring FP8 value: looser.
_ON_GPU = jax.default_backend() == "gpu"
_TOL = {jnp.float32: 1e-2 if _ON_GPU else 2e-5, jnp.bfloat16: 2e-2 if _ON_GPU else 1e-2}
_HIGHEST = jax.lax.Precision.HIGHEST  # the recipe's float32 GEMMs: no TF32 on a GPU


def _deq(v, scale, dt):
  """v quantised with scale (() f32) and dequantised to float32. The FP8 value passes
  an optimization_barrier: compiled for a GPU, XLA (whose default
  ``xla_allow_excess_precision`` lets it drop a convert to a narrower float and back)
  otherwise removes the round trip and the recipe computes with unquantised values
  (measured on an H100: 0.8% of max median error in its output)."""
  q = jax.lax.optimization_barrier(quantise(v.astype(_F32), _F32(1) / scale, dt))
  return fp8_ops.dequantize(q, _F32, scale)


def _delayed(scale, hist, dt):
  return fp8_ops.compute_scale(jnp.max(hist), scale, _F32(fp8_max(dt))).reshape(())


def _push(hist, amax):
  return jnp.roll(hist, -1).at[0].set(amax)


def _recipe(x, kernel, scale, ln_bias, bias, dout, *, subtract_mean, state, grad_dt):
  """(out, (dx, dscale, dln_bias, dkernel, dbias), new_state) of the recipe in jnp."""
  def norm(x, scale, ln_bias):
    return reference.norm(x.astype(_F32), scale, ln_bias, eps=_EPS,
                          subtract_mean=subtract_mean)[0]  # [M, N] f32

  y, norm_vjp = jax.vjp(norm, x, scale, ln_bias)
  wf = kernel.astype(_F32)
  y_amax, w_amax = jnp.max(jnp.abs(y)), jnp.max(jnp.abs(wf))
  if state is None:
    s_y, s_w = current_scale(y_amax, _E4M3), current_scale(w_amax, _E4M3)
  else:
    s_y = _delayed(state.input_scale, state.input_amax_history, _E4M3)
    s_w = _delayed(state.kernel_scale, state.kernel_amax_history, _E4M3)
  y_d, w_d = _deq(y, s_y, _E4M3), _deq(wf, s_w, _E4M3)
  out = jnp.matmul(y_d, w_d, precision=_HIGHEST).astype(x.dtype)
  if bias is not None:
    out = out + bias.astype(x.dtype)
  g_amax = jnp.max(jnp.abs(dout.astype(_F32)))
  s_g = (current_scale(g_amax, grad_dt) if state is None else
         _delayed(state.output_grad_scale, state.output_grad_amax_history, grad_dt))
  g_d = _deq(dout, s_g, grad_dt)
  dy = jnp.matmul(g_d, w_d.T, precision=_HIGHEST).astype(x.dtype)
  dx, dscale, dln_bias = norm_vjp(dy.astype(_F32))
  dkernel = jnp.matmul(y_d.T, g_d, precision=_HIGHEST).astype(kernel.dtype)
  dbias = None if bias is None else jnp.sum(dout.astype(_F32), 0).astype(bias.dtype)
  new = None
  if state is not None:
    new = fp8.DelayedScalingState(
        s_y.reshape(1), _push(state.input_amax_history, y_amax),
        s_w.reshape(1), _push(state.kernel_amax_history, w_amax),
        s_g.reshape(1), _push(state.output_grad_amax_history, g_amax))
  return out, (dx.astype(x.dtype), dscale, dln_bias, dkernel, dbias), new


def _inputs(m=16, n=64, f=48, dtype=_F32, subtract_mean=False, seed=0):
  """(x [m, n], kernel [n, f], scale [n], ln_bias [n] or None, bias [f], dout [m, f])
  from numpy's rng (eager jax.random would compile op by op)."""
  rng = np.random.default_rng(seed)
  r = lambda *shape: rng.standard_normal(shape, np.float32)
  x = jnp.asarray(r(m, n) * 3 + 0.5, dtype)
  ln_bias = jnp.asarray(0.1 * r(n)) if subtract_mean else None
  return (x, jnp.asarray(r(n, f) * 0.05), jnp.asarray(1 + 0.1 * r(n)), ln_bias,
          jnp.asarray(0.1 * r(f)), jnp.asarray(r(m, f) * 1e-3, dtype))


def _state(length=8, seed=1):
  """A used-looking delayed-scaling state: scales and histories that are not the
  current amaxes (so a mix-up of the two shows)."""
  rng = np.random.default_rng(seed)
  hist = lambda top: jnp.asarray(rng.uniform(0.1, 1.0, length).astype(np.float32) * top)
  return fp8.DelayedScalingState(jnp.full((1,), 0.02, _F32), hist(9.0),
                                 jnp.full((1,), 3e-4, _F32), hist(0.2),
                                 jnp.full((1,), 1e-7, _F32), hist(5e-3))


def _allclose(got, want, tol, what):
  want = np.asarray(want, np.float32)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol,
                             atol=tol * float(np.max(np.abs(want))), err_msg=what)


def _check_against_recipe(x, kernel, scale, ln_bias, bias, dout, *, subtract_mean, state,
                          grad_dt=_E5M2, backend="xla", tol=None):
  def f(x, kernel, scale, ln_bias, bias, state):
    return fp8.norm_dense_fp8(x, kernel, scale, ln_bias, bias, subtract_mean=subtract_mean,
                              eps=_EPS, state=state, grad_fp8_dtype=grad_dt,
                              backend=backend)

  @jax.jit
  def fwd_bwd(*args):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(dout)

  out, (dx, dkernel, dscale, dln_bias, dbias, new) = fwd_bwd(x, kernel, scale, ln_bias,
                                                             bias, state)
  want_out, want_grads, want_new = jax.jit(functools.partial(
      _recipe, subtract_mean=subtract_mean, grad_dt=grad_dt))(
          x, kernel, scale, ln_bias, bias, dout, state=state)
  tol = tol or _TOL[x.dtype.type]
  assert out.dtype == x.dtype and out.shape == want_out.shape
  _allclose(out, want_out, tol, "out")
  for name, got, want in zip(("dx", "dscale", "dln_bias", "dkernel", "dbias"),
                             (dx, dscale, dln_bias, dkernel, dbias), want_grads):
    if want is None:
      assert got is None, name
      continue
    assert got.dtype == want.dtype and got.shape == want.shape, name
    _allclose(got, want, tol, name)
  if state is None:
    assert new is None
  else:  # overwrite-with-gradient: the "gradient" of the state is the next state
    for name, got, want in zip(fp8.DelayedScalingState._fields, new, want_new):
      np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
  return out, new


@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_matches_recipe(subtract_mean, scaling, dtype):
  """out, every gradient and the new delayed-scaling state equal the jnp recipe's."""
  x, kernel, scale, ln_bias, bias, dout = _inputs(dtype=dtype, subtract_mean=subtract_mean)
  state = _state() if scaling == "delayed" else None
  out, new = _check_against_recipe(x, kernel, scale, ln_bias, bias, dout,
                                   subtract_mean=subtract_mean, state=state)
  # It is an FP8 approximation of the float layer: within e4m3's rounding.
  exact = jax.jit(lambda x, *p: reference.norm(x.astype(_F32), *p, eps=_EPS,
                                               subtract_mean=subtract_mean)[0])(
                                                   x, scale, ln_bias) @ kernel + bias
  err = np.abs(np.asarray(out, np.float32) - np.asarray(exact))
  assert err.max() < 0.1 * np.abs(np.asarray(exact)).max()
  if new is not None:  # the delayed scales really are the history's, not this call's
    assert float(new.input_scale[0]) == pytest.approx(
        float(np.max(state.input_amax_history)) / 448.0, rel=1e-6)


def test_e4m3_gradient_and_batch_dims():
  """grad_fp8_dtype=e4m3fn (TransformerEngine's E4M3 recipe), x with two batch dims
  and no dense bias or gamma."""
  x, kernel, _, _, _, dout = _inputs(m=12)
  x3, dout3 = x.reshape(3, 4, -1), dout.reshape(3, 4, -1)

  def f(x, kernel):
    return fp8.norm_dense_fp8(x, kernel, eps=_EPS, grad_fp8_dtype=_E4M3, backend="xla")

  out, (dx, dkernel) = jax.jit(lambda *a: (lambda o, vjp: (o, vjp(dout3)))(
      *jax.vjp(f, *a)))(x3, kernel)
  want_out, (want_dx, _, _, want_dk, _), _ = jax.jit(functools.partial(
      _recipe, subtract_mean=False, state=None, grad_dt=_E4M3))(
          x, kernel, None, None, None, dout)
  assert out.shape == (3, 4, kernel.shape[1]) and dx.shape == x3.shape
  tol = _TOL[jnp.float32]
  _allclose(out.reshape(want_out.shape), want_out, tol, "out")
  _allclose(dx.reshape(want_dx.shape), want_dx, tol, "dx")
  _allclose(dkernel, want_dk, tol, "dkernel")


def test_pallas_kernels_match_recipe():
  """The Pallas kernels (interpret mode on CPU): the FP8 norm with its transposed copy
  and the two-stage backward, delayed scaling, LayerNorm."""
  x, kernel, scale, ln_bias, bias, dout = _inputs(m=32, n=128, f=32, subtract_mean=True)
  _check_against_recipe(x, kernel, scale, ln_bias, bias, dout, subtract_mean=True,
                        state=_state(), backend="pallas", tol=_TOL[jnp.float32] * 5)


def test_empty_rows():
  x = jnp.zeros((0, 64), _F32)
  layer = flax_layers.RMSNormDenseFP8(64, 8, backend="xla", rngs=nnx.Rngs(0))
  out = layer(x)
  assert out.shape == (0, 8) and out.dtype == _F32


# --------------------------------------------------------------------------- layers


def _trainer(layer, lr=1e-2):
  """step(x) -> loss: a jitted adam step of mean(layer(x)**2), with update_fp8_meta."""
  opt = nnx.Optimizer(layer, optax.adam(lr), wrt=nnx.Param)
  diff = nnx.DiffState(0, (nnx.Param, fp8.Fp8Meta))

  @nnx.jit
  def step(layer, opt, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2), argnums=diff)(layer)
    opt.update(layer, fp8.update_fp8_meta(layer, grads))
    return loss

  return lambda x: float(step(layer, opt, x))


def test_delayed_scaling_history_in_training():
  """Three jitted train steps: each pushes its amaxes into the histories (newest at 0,
  the one before rolled to the end), each scale is the max of the history before the
  step over fp8_max (1 on the first step, whose history is empty), and a forward
  without a gradient leaves the state alone."""
  layer = flax_layers.RMSNormDenseFP8(64, 16, amax_history_length=4, backend="xla",
                                      rngs=nnx.Rngs(0))
  x = _inputs()[0]
  xs = [x * (1 + i) for i in range(3)]
  assert float(layer.input_scale[0]) == 1.0
  nnx.jit(lambda layer, x: layer(x))(layer, x)  # evaluation: no gradient, no state change
  assert not np.any(np.asarray(layer.input_amax_history[...]))
  amax = jax.jit(lambda x, s: jnp.max(jnp.abs(
      reference.norm(x, s, eps=1e-6, subtract_mean=False)[0])))
  train, amaxes = _trainer(layer), []
  for i, xi in enumerate(xs):
    before = {k: np.asarray(getattr(layer, k)[...]) for k in fp8.DelayedScalingState._fields}
    amaxes.append(float(amax(xi, layer.scale[...])))
    train(xi)
    h = np.asarray(layer.input_amax_history[...])
    assert h[0] == pytest.approx(amaxes[-1], rel=1e-6)
    np.testing.assert_array_equal(h[1:], np.roll(before["input_amax_history"], -1)[1:])
    want = 1.0 if i == 0 else before["input_amax_history"].max() / 448.0
    assert float(layer.input_scale[0]) == pytest.approx(want, rel=1e-6)
    assert float(layer.kernel_amax_history[0]) == pytest.approx(
        float(jnp.max(jnp.abs(layer.kernel[...]))), rel=0.05)  # the kernel before the step
    assert float(layer.output_grad_amax_history[0]) > 0
  assert [float(v) for v in np.asarray(layer.input_amax_history[...])[[0, 3, 2]]] == \
      pytest.approx(amaxes[::-1], rel=1e-6)


def test_delayed_layer_trained_without_its_meta_warns_and_runs_current_scaling():
  """The plain flax train step (nnx.grad of the model: Fp8Meta not differentiated, so
  never written back) would leave the histories empty and every scale 1, and the output
  gradient of a mean loss under e5m2's smallest subnormal (dkernel and dx all zero). The
  layer sees at trace time that its state is not differentiated: a warning naming the
  fix, and current scaling: the gradients of a scaling="current" layer, nonzero. The
  train step that differentiates Fp8Meta (update_fp8_meta) gets no warning."""
  delayed, current = (flax_layers.RMSNormDenseFP8(64, 48, scaling=s, backend="xla",
                                                  rngs=nnx.Rngs(0))
                      for s in ("delayed", "current"))
  x = _inputs()[0]
  grad = nnx.jit(nnx.grad(lambda m, x: jnp.mean(m(x) ** 2)))
  grads = {}
  for layer in (delayed, current):
    opt = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.Param)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      g0 = grad(layer, x)
      opt.update(layer, g0)
      grads[layer.scaling] = [nnx.to_pure_dict(g0), nnx.to_pure_dict(grad(layer, x))]
    msgs = [str(w.message) for w in caught if "delayed-scaling state" in str(w.message)]
    assert len(msgs) == (1 if layer.scaling == "delayed" else 0), msgs
    if msgs:
      assert "RMSNormDenseFP8" in msgs[0] and "update_fp8_meta" in msgs[0]
  assert not np.any(np.asarray(delayed.input_amax_history[...]))  # never written back
  for step, (gd, gc) in enumerate(zip(grads["delayed"], grads["current"])):
    assert set(gd) == set(gc) == {"scale", "kernel", "bias"}, step
    for name in gc:
      assert np.abs(gc[name]).max() > 0, (step, name)
      np.testing.assert_array_equal(gd[name], gc[name], err_msg=f"step {step} {name}")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the documented train step: delayed, no warning
    _trainer(flax_layers.RMSNormDenseFP8(64, 48, backend="xla", rngs=nnx.Rngs(0)))(x)


def test_layer_classes_document_their_arguments():
  """help() of the FP8 layers shows the shared argument list and the real signature (a
  string expression in a class body is not its docstring; ``**kwargs`` hides the args)."""
  import inspect
  for cls, has_ln_bias in ((flax_layers.RMSNormDenseFP8, False),
                           (flax_layers.LayerNormDenseFP8, True)):
    assert "amax_history_length" in cls.__doc__ and "Raises:" in cls.__doc__
    params = inspect.signature(cls.__init__).parameters
    assert {"in_features", "out_features", "scaling", "amax_history_length", "rngs"} <= set(params)
    assert ("use_ln_bias" in params) == has_ln_bias
  assert inspect.signature(flax_layers.LayerNormDenseFP8.__init__).parameters[
      "use_ln_bias"].default is True


def test_scanned_stack_matches_unrolled_layers():
  """Three delayed-scaling blocks stacked by nnx.vmap and run by nnx.scan (+ remat), as a
  scanned LLM stack: the loss, every gradient and each layer's new amax histories equal
  those of the same three layers applied one after another."""
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.proj = flax_layers.RMSNormDenseFP8(64, 64, dtype=jnp.bfloat16, use_bias=False,
                                              amax_history_length=4, rngs=rngs)

    def __call__(self, x):
      return x + self.proj(x)

  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return Block(rngs)

  def scanned(blocks, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, block):
      return block(x)
    return body(x, blocks)

  blocks = make(nnx.Rngs(0))
  graph, state = nnx.split(blocks)
  layers = [nnx.merge(graph, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(3)]

  def unrolled(layers, x):
    for layer in layers:
      x = layer(x)
    return x

  x = _inputs(32, 64, dtype=jnp.bfloat16)[0].reshape(4, 8, 64)
  diff = nnx.DiffState(0, (nnx.Param, flax_layers.Fp8Meta))
  grad = lambda f: nnx.jit(nnx.value_and_grad(
      lambda m, x: jnp.mean(f(m, x).astype(jnp.float32) ** 2), argnums=diff))
  l_scan, g_scan = grad(scanned)(blocks, x)
  l_loop, g_loop = grad(unrolled)(layers, x)
  np.testing.assert_allclose(float(l_scan), float(l_loop), rtol=1e-3)  # bf16 roundings
  g_scan = nnx.to_pure_dict(g_scan)["proj"]
  for i, g in enumerate(g_loop):
    for name, want in nnx.to_pure_dict(g)["proj"].items():
      got = np.asarray(g_scan[name][i], np.float32)
      want = np.asarray(want, np.float32)
      np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(),
                                 err_msg=f"layer {i} {name}")
  h = np.asarray(g_scan["input_amax_history"])         # the new histories, per layer
  assert h.shape == (3, 4) and np.all(h[:, 0] > 0) and not np.any(h[:, 1:])


def test_current_scaling_has_no_state_and_trains():
  layer = flax_layers.LayerNormDenseFP8(64, 16, scaling="current", backend="xla",
                                        rngs=nnx.Rngs(0))
  assert not jax.tree.leaves(nnx.state(layer, fp8.Fp8Meta))
  assert set(nnx.state(layer, nnx.Param).keys()) == {"scale", "ln_bias", "kernel", "bias"}
  x = _inputs()[0]
  train = _trainer(layer, lr=3e-2)
  losses = [train(x) for _ in range(20)]
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]


def test_params_like_norm_and_linear():
  """The same init as nnx.RMSNorm followed by nnx.Linear from the same rngs: scale
  ones, kernel and bias from the next two params keys (a drop-in for the pair)."""
  layer = flax_layers.RMSNormDenseFP8(32, 8, rngs=nnx.Rngs(3))
  rngs = nnx.Rngs(3)
  norm, lin = nnx.RMSNorm(32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)
  for got, want in ((layer.scale, norm.scale), (layer.kernel, lin.kernel),
                    (layer.bias, lin.bias)):
    np.testing.assert_array_equal(got[...], want[...])
    assert got[...].dtype == want[...].dtype


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("name", ["RMSNormDenseFP8", "LayerNormDenseFP8"])
def test_nnx_and_linen_agree(name, scaling):
  """The same params (and state) give the same output and gradients (params and
  overwrite-with-gradient collection) in NNX and Linen, under jit; bf16 compute."""
  kw = dict(scaling=scaling, amax_history_length=8, dtype=jnp.bfloat16, backend="xla")
  x = _inputs(dtype=jnp.bfloat16)[0]
  lin = getattr(pl_linen, name)(features=16, **kw)
  variables = lin.init(jax.random.key(0), x)
  layer = getattr(flax_layers, name)(64, 16, **kw, rngs=nnx.Rngs(0))
  owg = fp8.OVERWRITE_WITH_GRADIENT
  assert (owg in variables) == (scaling == "delayed")
  nnx.update(layer, nnx.State({**variables["params"], **variables.get(owg, {})}))

  def loss_linen(v):
    return jnp.mean(lin.apply(v, x).astype(_F32) ** 2)

  def loss_nnx(layer):
    return jnp.mean(layer(x).astype(_F32) ** 2)

  l1, g1 = jax.jit(jax.value_and_grad(loss_linen))(variables)
  diff = nnx.DiffState(0, (nnx.Param, fp8.Fp8Meta))
  l2, g2 = nnx.jit(nnx.value_and_grad(loss_nnx, argnums=diff))(layer)
  assert float(l1) == pytest.approx(float(l2), rel=1e-3 if _ON_GPU else 0)
  flat2 = {k: v[...] for k, v in g2.items()}
  flat1 = {**g1["params"], **g1.get(owg, {})}
  assert set(flat1) == set(flat2)
  for k in flat1:  # the same program; on a GPU each compilation tunes its own GEMMs
    np.testing.assert_allclose(flat1[k], flat2[k], rtol=1e-3 if _ON_GPU else 0, err_msg=k)


def test_lazy_export_from_pallas_norm():
  assert pallas_norm.RMSNormDenseFP8 is flax_layers.RMSNormDenseFP8
  assert pallas_norm.LayerNormDenseFP8 is flax_layers.LayerNormDenseFP8


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(scaling="just-in-time"), ValueError, "scaling='just-in-time' must be one of"),
    (dict(amax_history_length=0), ValueError, "amax_history_length=0 must be a positive"),
    (dict(fp8_dtype=_E5M2), TypeError, "fp8_dtype=float8_e5m2 must be one of"),
    (dict(grad_fp8_dtype=jnp.bfloat16), TypeError, "grad_fp8_dtype=bfloat16 must be one"),
    (dict(backend="triton"), ValueError, "backend='triton' must be one of"),
])
def test_constructor_errors(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    flax_layers.RMSNormDenseFP8(8, 4, **kwargs, rngs=nnx.Rngs(0))
  with pytest.raises(exc, match=match):
    pl_linen.RMSNormDenseFP8(features=4, **kwargs).init(jax.random.key(0), jnp.ones((2, 8)))


def test_call_errors():
  with pytest.raises(TypeError, match="has no ln_bias"):
    flax_layers.RMSNormDenseFP8(8, 4, use_ln_bias=True, rngs=nnx.Rngs(0))
  layer = flax_layers.RMSNormDenseFP8(8, 4, backend="xla", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"must end in in_features=8"):
    layer(jnp.ones((2, 6)))
  x, k = jnp.ones((2, 8)), jnp.ones((8, 4))
  cases = [
      (dict(kernel=jnp.ones((8, 4, 1))), ValueError, "must be \\[in_features, out_features\\]"),
      (dict(scale=jnp.ones((4,))), ValueError, r"scale.shape=\(4,\) must be \(8,\)"),
      (dict(bias=jnp.ones((8,))), ValueError, r"bias.shape=\(8,\) must be \(4,\)"),
      (dict(ln_bias=jnp.ones((8,))), ValueError, "RMSNorm .* has none"),
      (dict(x=jnp.ones((2, 8), jnp.int32)), TypeError, "x.dtype=int32 must be a float"),
      (dict(state=(1, 2)), TypeError, "must be a DelayedScalingState"),
      (dict(state=_state()._replace(kernel_amax_history=jnp.zeros((3,)))), ValueError,
       "one L"),
      (dict(state=_state()._replace(input_scale=jnp.zeros((1,)))), ValueError,
       r"state.input_scale=0.0 must be finite and > 0"),
      (dict(state=_state()._replace(kernel_scale=jnp.full((1,), jnp.nan))), ValueError,
       r"state.kernel_scale=nan must be finite and > 0"),
      (dict(x=jnp.ones((2, 8), jnp.float8_e4m3fn)), TypeError, "quantises its own operands"),
      (dict(eps=None), TypeError, "norm_dense_fp8: eps must be a real number"),
  ]
  for kw, exc, match in cases:
    args = dict(x=x, kernel=k) | kw
    with pytest.raises(exc, match=match):
      fp8.norm_dense_fp8(args.pop("x"), args.pop("kernel"), backend="xla", **args)


def test_delayed_scale_guards():
  """_delayed_scale: flax's compute_scale, floored at 2**-126 (an amax history of about
  1e-37 gave flax's scale 0, whose reciprocal made the quantised zeros NaN), and a state
  scale that is not finite or under 2**-126 (a hand-edited state, which eager calls
  refuse) taken as 1.0, so a jitted call matches a fresh state's."""
  tiny = np.finfo(np.float32).tiny
  hist = jnp.zeros((4,), _F32).at[1].set(1e-37)
  s = fp8._delayed_scale(jnp.ones((1,), _F32), hist, jnp.float8_e4m3fn)
  assert float(s) == tiny
  hist = jnp.zeros((4,), _F32).at[1].set(3.0)
  want = fp8_ops.compute_scale(jnp.max(hist), jnp.ones((1,), _F32), _F32(448.0)).reshape(())
  assert float(fp8._delayed_scale(jnp.ones((1,), _F32), hist, jnp.float8_e4m3fn)) == float(want)
  x = jax.random.normal(jax.random.key(0), (4, 16))
  k = jax.random.normal(jax.random.key(1), (16, 8)) * 0.1
  f = jax.jit(lambda st: fp8.norm_dense_fp8(x, k, state=st, backend="xla"))
  fresh = fp8.init_delayed_scaling(8)  # scales 1, histories 0: the old scale is used
  ref = jax.tree.leaves(f(fresh))[0]
  for v in (0.0, float("nan"), float("inf"), 1e-40):
    bad = fresh._replace(input_scale=jnp.full((1,), v, _F32),
                         kernel_scale=jnp.full((1,), v, _F32))
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(f(bad))[0]), np.asarray(ref))


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_gpu_d4096_matches_recipe_and_uses_fp8_gemms(subtract_mean, rank):
  """Compiled on the GPU at d=4096 (Pallas kernels): the jitted forward and grads
  against the jnp recipe (cuBLASLt accumulates in its own order: a looser float32
  tolerance), and XLA's program calls cuBLASLt's FP8 GEMM three times (forward, dgrad,
  wgrad) and no float GEMM. Rank 3: the layer sees x [2, 1024, N] (its GEMMs contract
  N, or the two row dims for the weight gradient)."""
  x, kernel, scale, ln_bias, bias, dout = _inputs(m=2048, n=4096, f=4096, dtype=jnp.bfloat16,
                                                  subtract_mean=subtract_mean)
  state = _state(length=16)
  state = state._replace(input_amax_history=state.input_amax_history / 9.0 * 12.0)

  def f(x, kernel, scale, ln_bias, bias, state):
    xr = x.reshape(2, -1, x.shape[-1]) if rank == 3 else x
    out = fp8.norm_dense_fp8(xr, kernel, scale, ln_bias, bias, subtract_mean=subtract_mean,
                             eps=_EPS, state=state)
    return out.reshape(x.shape[0], -1)

  def fwd_bwd(*args):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(dout)

  args = (x, kernel, scale, ln_bias, bias, state)
  out, grads = jax.jit(fwd_bwd)(*args)
  want_out, want_grads, want_new = _recipe(x, kernel, scale, ln_bias, bias, dout,
                                           subtract_mean=subtract_mean, state=state,
                                           grad_dt=_E5M2)
  _allclose(out, want_out, 2e-2, "out")
  got = (grads[0], grads[2], grads[3], grads[1], grads[4])
  for name, g, w in zip(("dx", "dscale", "dln_bias", "dkernel", "dbias"), got, want_grads):
    if w is not None:
      _allclose(g, w, 2e-2, name)
  for name, g, w in zip(fp8.DelayedScalingState._fields, grads[5], want_new):
    np.testing.assert_allclose(g, w, rtol=1e-5, err_msg=name)
  calls = fp8.fp8_gemm_calls(fwd_bwd, *args)
  assert fp8.fp8_gemm_count(calls) == 3 == sum(calls.values()), calls


def test_gemm_calls_in_hlo_text():
  """The HLO scan behind the GPU check, on lines as XLA prints them."""
  hlo = "\n".join([
      '  %c = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[8,16]{1,0} %a, f8e4m3fn[8,16]'
      '{1,0} %b, f32[] %s, f32[] %t), custom_call_target="__cublas$lt$matmul$f8", '
      'backend_config={}',
      '  %d = (f32[8,8]{1,0}, s8[0]{0}) custom-call(f32[8,16]{1,0} %a, f32[16,8]{1,0} %b), '
      'custom_call_target="__cublas$gemm"',
      '  %g = bf16[8,8]{1,0} fusion(f8e5m2[8,16]{1,0} %a, f8e4m3fn[16,8]{1,0} %b), '
      'kind=kCustom, calls=%f, backend_config={"fusion_backend_config":{"kind":'
      '"__triton_gemm"}}',
      '  %h = f32[8]{0} custom-call(f32[8]{0} %a), custom_call_target="Sharding"',
  ])
  calls = fp8.gemm_calls_in(hlo)
  assert calls == {"__cublas$lt$matmul$f8": 1, "__cublas$gemm": 1, "__triton_gemm[f8]": 1}
  assert fp8.fp8_gemm_count(calls) == 2


@pytest.mark.parametrize("dt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_xla_quantise_matches_quantise(dt):
  """The layer's XLA-side quantisation (jnp.clip) gives pallas_norm.fp8.quantise's bytes:
  NaN kept, +-Inf and out-of-range values saturated, -0 kept, rounding at every
  magnitude, on the device the suite runs on."""
  from flax_layers import fp8 as layer_fp8
  rng = np.random.default_rng(0)
  v = np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.integers(-8, 6, 4096),
                      [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30]])
  v = jnp.asarray(v, _F32)
  for inv in (_F32(1.0), _F32(37.5), _F32(1e-3)):
    got = jax.jit(layer_fp8._quantise_xla, static_argnums=2)(v, inv, dt)
    want = jax.jit(quantise, static_argnums=2)(v, inv, dt)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                  np.asarray(want).view(np.uint8))
