"""Sharded inputs under jax.jit (pallas_norm.spmd), on several devices.

On CPU this runs on 8 fake devices, in its own process (``make test`` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``PALLAS_NORM_SHARDED=1``);
``make gpu-check`` runs it on the GPUs when there are two or more. The meshes below
are built from the device count.

Every case checks, against the unsharded XLA reference: y, dx, dscale, dbias values;
their shardings (y and dx: x's; dscale and dbias: the hidden axes'); no all-gather in
the compiled forward+backward; bitwise-identical results on a second run.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_norm
from flax_layers import linen as pn_linen
from pallas_norm import reference, spmd

NDEV = jax.device_count()
if NDEV < 2:
  raise pytest.UsageError(
      f"tests/sharded needs >= 2 devices, found {NDEV}: run it as `make test` does, with "
      f"XLA_FLAGS=--xla_force_host_platform_device_count=8 PALLAS_NORM_SHARDED=1")
HALF = NDEV // 2 if NDEV >= 4 else 1  # the second axis of the 2-D meshes

# name -> (mesh shape, axis names, spec of a rank-3 x [B, S, N])
LAYOUTS = {
    "dp": ((NDEV,), ("data",), P("data", None, None)),
    "sp": ((NDEV,), ("seq",), P(None, "seq", None)),
    "dp_sp": ((2, HALF), ("data", "seq"), P("data", "seq", None)),
    "tp": ((NDEV,), ("model",), P(None, None, "model")),
    "dp_tp": ((2, HALF), ("data", "model"), P("data", None, "model")),
    "fsdp_2axes_rows": ((2, HALF), ("data", "fsdp"), P(("data", "fsdp"), None, None)),
    "unused_axis": ((2, HALF), ("data", "model"), P("data", None, None)),
}
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
_EPS_RMS = float(jnp.finfo(jnp.float32).eps)


def _shape(layout, rank, n_per_shard):
  """x's shape for ``layout``: every sharded dimension divisible by its shards."""
  mesh_shape, names, spec = LAYOUTS[layout]
  size = dict(zip(names, mesh_shape))
  shards = [math.prod(size[a] for a in ((e,) if isinstance(e, str) else e or ()))
            for e in spec]
  b, s, _ = (2 * shards[0], 3 * shards[1], None)
  n = n_per_shard * shards[2]
  if rank == 2:
    return (b * s, n), P(_merge(spec[0], spec[1]), spec[2])
  if rank == 3:
    return (b, s, n), spec
  return (b, 2, s, n), P(spec[0], None, spec[1], spec[2])


def _merge(a, b):
  axes = tuple(x for e in (a, b) for x in ((e,) if isinstance(e, str) else e or ()))
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _inputs(shape, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  n = shape[-1]
  x = (jax.random.normal(k[0], shape, jnp.float32) * 2 + 0.5).astype(dtype)
  scale = 1 + 0.1 * jax.random.normal(k[1], (n,), jnp.float32)
  bias = 0.1 * jax.random.normal(k[2], (n,), jnp.float32)
  dy = jax.random.normal(k[3], shape, jnp.float32).astype(dtype)
  return x, scale, bias, dy


def _ops(op, backend="pallas"):
  if op == "rms":
    ours = lambda x, s, b: pallas_norm.rms_norm(x, s, backend=backend)
    ref = lambda x, s, b: reference.norm(x, s, None, eps=_EPS_RMS, subtract_mean=False)[0]
  else:
    ours = lambda x, s, b: pallas_norm.layer_norm(x, s, b, backend=backend)
    ref = lambda x, s, b: reference.norm(x, s, b, eps=1e-5, subtract_mean=True)[0]
  return ours, ref


def _fwd_bwd(f):
  def step(x, s, b, dy):
    y, vjp = jax.vjp(f, x, s, b)
    return (y, *vjp(dy))
  return jax.jit(step)


def _collectives(compiled_text):
  return {c: compiled_text.count(f" {c}(") + compiled_text.count(f" {c}-start(")
          for c in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")}


def _spec_of(a):
  spec = a.sharding.spec
  return tuple(spec) + (None,) * (a.ndim - len(spec))


def _tol(dtype, n, m):
  base = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}[dtype]
  return base * math.sqrt(n), base * math.sqrt(m) * 4


CASES = [
    # (layout, rank, n per shard, op, dtype)
    ("dp", 2, 37, "rms", jnp.float32),
    ("dp", 3, 203, "layer", jnp.float32),
    ("dp", 4, 64, "rms", jnp.bfloat16),
    ("sp", 3, 37, "layer", jnp.float32),
    ("sp", 4, 40, "rms", jnp.float32),
    ("dp_sp", 3, 96, "rms", jnp.float32),
    ("dp_sp", 4, 33, "layer", jnp.bfloat16),
    ("tp", 2, 37, "layer", jnp.float32),
    ("tp", 3, 37, "rms", jnp.float32),
    ("tp", 3, 160, "layer", jnp.bfloat16),
    ("dp_tp", 3, 37, "layer", jnp.float32),
    ("dp_tp", 4, 64, "rms", jnp.float32),
    ("dp_tp", 2, 50, "rms", jnp.bfloat16),
    ("fsdp_2axes_rows", 3, 40, "layer", jnp.float32),
    ("unused_axis", 3, 24, "rms", jnp.float32),
]


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("layout,rank,n_shard,op,dtype", CASES,
                         ids=[f"{c[0]}-{c[1]}d-n{c[2]}-{c[3]}-{jnp.dtype(c[4]).name}"
                              for c in CASES])
def test_sharded_matches_reference(layout, rank, n_shard, op, dtype, axis_type):
  _check_sharded(layout, rank, n_shard, op, dtype, axis_type, "pallas")


@pytest.mark.gpu  # jax-triton needs a GPU jaxlib
@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("layout,op", [("dp", "rms"), ("tp", "layer"), ("dp_tp", "rms"),
                                       ("sp", "layer")])
def test_triton_backend_sharded(layout, op, axis_type):
  _check_sharded(layout, 3, 96, op, jnp.bfloat16, axis_type, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("layout,op", [("dp", "rms"), ("sp", "layer")])
def test_mosaic_backend_sharded(layout, op, axis_type):
  """backend="mosaic" with rows sharded, compiled (the next test: interpret mode)."""
  _check_sharded(layout, 3, 128, op, jnp.float32, axis_type, "mosaic")


@pytest.mark.cpu_only
@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_mosaic_interpret_on_several_devices_is_a_clear_error(axis_type):
  """JAX 0.10's Mosaic GPU interpreter cannot run on several devices (Auto meshes: the
  process aborted in custom_partitioning; Explicit: the backward's barriers collided):
  a NotImplementedError before any kernel, naming the remedies."""
  mesh = jax.make_mesh((NDEV,), ("data",), axis_types=(AXIS_TYPES[axis_type],))
  x = jax.device_put(jnp.ones((2 * NDEV, 128)), NamedSharding(mesh, P("data", None)))
  with pytest.raises(NotImplementedError, match="on one device, on a GPU"):
    jax.jit(lambda x: pallas_norm.rms_norm(x, backend="mosaic"))(x)


def _check_sharded(layout, rank, n_shard, op, dtype, axis_type, backend):
  mesh_shape, names, _ = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names))
  shape, spec = _shape(layout, rank, n_shard)
  hidden = spec[-1]
  x, scale, bias, dy = _inputs(shape, dtype)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  args = (put(x, spec), put(scale, P(hidden)), put(bias, P(hidden)), put(dy, spec))
  ours, ref = _ops(op, backend)
  step = _fwd_bwd(ours)
  out = step(*args)
  expected = _fwd_bwd(ref)(x, scale, bias, dy)

  m = math.prod(shape[:-1])
  tol_x, tol_p = _tol(dtype, shape[-1], m)
  for name, got, want, tol in zip(("y", "dx", "dscale", "dbias"), out, expected,
                                  (tol_x, tol_x, tol_p, tol_p)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol, err_msg=name)
  x_spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  # Equivalent, not equal: XLA drops size-1 mesh axes (the (2, 1) meshes of two GPUs).
  same = lambda a, s: a.sharding.is_equivalent_to(NamedSharding(mesh, P(*s)), a.ndim)
  assert same(out[0], x_spec), out[0].sharding
  assert same(out[1], x_spec), out[1].sharding
  for g in out[2:] if op == "layer" else out[2:3]:  # (rms: b is unused, its zero ct P())
    assert same(g, (hidden,)), g.sharding

  coll = _collectives(step.lower(*args).compile().as_text())
  assert coll["all-gather"] == 0, coll
  rows_sharded = any(e is not None for e in x_spec[:-1])
  assert (coll["all-reduce"] > 0) == (rows_sharded or hidden is not None), coll

  again = step(*args)
  for a, b in zip(out, again):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("layout,op", [("dp", "rms"), ("sp", "layer"), ("tp", "layer"),
                                       ("dp_tp", "rms")])
def test_residual_sharded(layout, op, axis_type):
  """The fused residual add, sharded: (y, h) and the grads of x, residual, scale and
  bias against the unsharded formula; y, h, dx, dresidual keep x's sharding; no
  all-gather; bitwise-identical reruns. bf16 x with an fp32 residual stream."""
  mesh_shape, names, _ = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names))
  shape, spec = _shape(layout, 3, 40)
  hidden = spec[-1]
  x, scale, bias, dy = _inputs(shape, jnp.bfloat16, seed=11)
  r = jax.random.normal(jax.random.key(12), shape, jnp.float32)
  dh = jax.random.normal(jax.random.key(13), shape, jnp.float32)
  layer = op == "layer"

  def ours(x, r, s, b):
    if layer:
      return pallas_norm.layer_norm(x, s, b, residual=r)
    return pallas_norm.rms_norm(x, s, residual=r)

  def ref(x, r, s, b):
    h = x.astype(jnp.float32) + r
    y = reference.norm(h, s, b if layer else None, eps=1e-5 if layer else _EPS_RMS,
                       subtract_mean=layer)[0]
    return y.astype(x.dtype), h

  def step_of(f):
    def step(x, r, s, b, dy, dh):
      out, vjp = jax.vjp(f, x, r, s, b)
      return (*out, *vjp((dy, dh)))
    return jax.jit(step)

  put = lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp))
  args = (put(x, spec), put(r, spec), put(scale, P(hidden)), put(bias, P(hidden)),
          put(dy, spec), put(dh, spec))
  step = step_of(ours)
  out = step(*args)
  want = step_of(ref)(x, r, scale, bias, dy, dh)
  names_ = ("y", "h", "dx", "dresidual", "dscale", "dbias")
  for name, g, w in zip(names_, out, want):
    if name == "dbias" and not layer:
      continue
    tol = 2e-2 if name in ("y", "dx") else 2e-4 * math.sqrt(math.prod(shape[:-1]))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=tol, rtol=tol, err_msg=name)
  x_spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  same = lambda a, s: a.sharding.is_equivalent_to(NamedSharding(mesh, P(*s)), a.ndim)
  for g in out[:4]:
    assert same(g, x_spec), g.sharding
  assert same(out[4], (hidden,)), out[4].sharding
  assert _collectives(step.lower(*args).compile().as_text())["all-gather"] == 0
  for a, b in zip(out, step(*args)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("layout,op", [("dp", "rms"), ("tp", "layer")])
def test_llama_cast_sharded(layout, op, axis_type):
  """cast="llama" sharded: y in the promoted dtype (float32 for bf16 x and float32
  params) with x's sharding, grads against the unsharded XLA backend's, no all-gather."""
  mesh_shape, names, _ = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names))
  shape, spec = _shape(layout, 3, 40)
  x, scale, bias, _ = _inputs(shape, jnp.bfloat16, seed=21)
  dy = jax.random.normal(jax.random.key(22), shape, jnp.float32)
  layer = op == "layer"

  def f(backend):
    def norm(x, s, b):
      if layer:
        return pallas_norm.layer_norm(x, s, b, cast="llama", backend=backend)
      return pallas_norm.rms_norm(x, s, cast="llama", backend=backend)
    return _fwd_bwd(norm)

  put = lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp))
  args = (put(x, spec), put(scale, P(spec[-1])), put(bias, P(spec[-1])), put(dy, spec))
  step = f("pallas")
  out, want = step(*args), f("xla")(x, scale, bias, dy)
  assert out[0].dtype == jnp.float32
  for name, g, w in zip(("y", "dx", "dscale", "dbias"), out, want):
    if name == "dbias" and not layer:
      continue
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=3e-2, rtol=3e-2, err_msg=name)
  x_spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  assert out[0].sharding.is_equivalent_to(NamedSharding(mesh, P(*x_spec)), out[0].ndim)
  assert _collectives(step.lower(*args).compile().as_text())["all-gather"] == 0


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_post_norm_sharded(layout, axis_type):
  """post_norm_scale= sharded (rows: the one-kernel forward on each device's rows;
  hidden: the two norms, each combining its statistics): the forward alone and under
  jax.vjp against the unsharded jnp formula; y and h keep x's sharding; no all-gather."""
  mesh_shape, names, _ = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names))
  shape, spec = _shape(layout, 3, 32)
  hidden = spec[-1]
  x, scale, post, dy = _inputs(shape, jnp.bfloat16, seed=41)
  r = jax.random.normal(jax.random.key(42), shape, jnp.bfloat16)

  def f(backend):
    def norm(x, r, s, p):
      return pallas_norm.rms_norm(x, s, residual=r, post_norm_scale=p, eps=1e-6,
                                  cast="gemma", backend=backend)
    def step(x, r, s, p, dy):
      out, pull = jax.vjp(norm, x, r, s, p)
      return (*out, *pull((dy, dy)))
    return jax.jit(norm), jax.jit(step)

  put = lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp))
  args = (put(x, spec), put(r, spec), put(scale, P(hidden)), put(post, P(hidden)))
  (fwd, step), (fwd_x, step_x) = f("pallas"), f("xla")
  got = (*fwd(*args), *step(*args, put(dy, spec)))
  want = (*fwd_x(x, r, scale, post), *step_x(x, r, scale, post, dy))
  tol = 2e-4 * math.sqrt(math.prod(shape[:-1]))
  for name, g, w in zip(("y", "h", "y_vjp", "h_vjp", "dx", "dres", "dscale", "dpost"),
                        got, want):
    t = 5e-2 if name not in ("dscale", "dpost") else tol + 5e-2
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=t, rtol=2**-6, err_msg=name)
  x_spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  same = lambda a, s: a.sharding.is_equivalent_to(NamedSharding(mesh, P(*s)), a.ndim)
  for g in got[:6]:
    assert same(g, x_spec), g.sharding
  for fn, a in ((fwd, args), (step, (*args, put(dy, spec)))):
    assert _collectives(fn.lower(*a).compile().as_text())["all-gather"] == 0


def test_residual_sharded_differently_is_an_error():
  mesh = jax.make_mesh((NDEV,), ("data",), axis_types=(AxisType.Explicit,))
  x = jax.device_put(jnp.ones((NDEV, 2 * NDEV)), NamedSharding(mesh, P("data")))
  r = jax.device_put(jnp.ones((NDEV, 2 * NDEV)), NamedSharding(mesh, P(None, "data")))
  with pytest.raises(ValueError, match="residual is sharded"):
    jax.jit(lambda x, r: pallas_norm.rms_norm(x, residual=r))(x, r)


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("layout,op", [("dp", "layer"), ("tp", "rms"), ("dp_tp", "layer")])
def test_forward_only(layout, op, axis_type):
  """Outside jax.vjp the forward writes no residuals: its own partitioning rule."""
  mesh_shape, names, _ = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names))
  shape, spec = _shape(layout, 3, 24)
  x, scale, bias, _ = _inputs(shape, jnp.float32, seed=7)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  ours, ref = _ops(op)
  f = jax.jit(ours)
  args = (put(x, spec), put(scale, P(spec[-1])), put(bias, P(spec[-1])))
  y = f(*args)
  np.testing.assert_allclose(np.asarray(y), np.asarray(jax.jit(ref)(x, scale, bias)),
                             atol=2e-5, rtol=2e-5)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), y.ndim), y.sharding
  assert _collectives(f.lower(*args).compile().as_text())["all-gather"] == 0


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_checkpoint_and_grad(axis_type):
  mesh = jax.make_mesh((2, HALF), ("data", "model"),
                       axis_types=(AXIS_TYPES[axis_type],) * 2)
  shape, spec = (4, 6, 8 * HALF), P("data", None, "model")
  x, scale, bias, _ = _inputs(shape, jnp.float32, seed=1)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))

  def loss(norm):
    def f(x, s, b):
      return jnp.sum(jnp.tanh(jax.checkpoint(norm)(x, s, b)) ** 2)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  got = loss(lambda x, s, b: pallas_norm.layer_norm(x, s, b))(
      put(x, spec), put(scale, P("model")), put(bias, P("model")))
  want = loss(lambda x, s, b: reference.norm(x, s, b, eps=1e-5, subtract_mean=True)[0])(
      x, scale, bias)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)


def test_vmap_on_several_devices():
  x, scale, _, _ = _inputs((3, 5, 24), jnp.float32, seed=2)
  f = jax.jit(jax.vmap(jax.grad(lambda x, s: jnp.sum(pallas_norm.rms_norm(x, s) ** 3),
                                argnums=(0, 1)), in_axes=(0, None)))
  r = jax.jit(jax.vmap(jax.grad(lambda x, s: jnp.sum(
      reference.norm(x, s, eps=_EPS_RMS, subtract_mean=False)[0] ** 3), argnums=(0, 1)),
      in_axes=(0, None)))
  for g, w in zip(f(x, scale), r(x, scale)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-5)


def test_uneven_hidden_sharding_is_an_error():
  """Auto meshes: XLA may pick an uneven layout (JAX refuses one for device_put and on
  Explicit meshes); our partitioning rule refuses it before any kernel runs. It runs
  inside XLA's compilation, which reports its ValueError as a JaxRuntimeError (as
  docs/multi_gpu.md says)."""
  mesh = jax.make_mesh((NDEV,), ("model",), axis_types=(AxisType.Auto,))
  x = jnp.ones((4, NDEV + 1), jnp.float32)  # NDEV + 1 is never a multiple of NDEV >= 2
  with pytest.raises(jax.errors.JaxRuntimeError, match="uneven") as info:
    jax.jit(lambda x: pallas_norm.rms_norm(
        jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, "model")))))(x)
  assert "pallas_norm" in str(info.value)


def test_mesh_layout():
  spec, rows, hidden = spmd.mesh_layout((4, 6, 8), P(("a", "b"), None, "c"),
                                        {"a": 2, "b": 2, "c": 4})
  assert (tuple(spec), rows, hidden) == ((("a", "b"), None, "c"), ("a", "b"), ("c",))
  with pytest.raises(ValueError, match=r"dimension 1 \(size 6\) over \('c',\) \(4 shards\)"):
    spmd.mesh_layout((4, 6, 8), P(None, "c"), {"c": 4})


def test_unbound_axis_name_is_an_error():
  with pytest.raises(ValueError, match="not a bound mesh axis"):
    pallas_norm.rms_norm(jnp.ones((2, 8)), axis_name="model")


@pytest.mark.cpu_only
def test_check_vma_in_interpret_mode_is_a_clear_error():
  """JAX's interpret-mode lowering cannot take varying-typed operands: a ValueError
  before any kernel, naming the remedy."""
  mesh = jax.make_mesh((NDEV,), ("model",), axis_types=(AxisType.Auto,))
  f = jax.jit(jax.shard_map(lambda x: pallas_norm.rms_norm(x, axis_name="model"), mesh=mesh,
                            in_specs=P(None, "model"), out_specs=P(None, "model")))
  with pytest.raises(ValueError, match="check_vma=False to that shard_map, or run on a GPU"):
    f(jnp.ones((2, 4 * NDEV)))


def _check_vma_cases():
  """(name, mesh, fn(x, s) inside a default shard_map, in_specs, flax twin)."""
  mesh = jax.make_mesh((2, HALF), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  return mesh, {
      # data parallel, scale replicated: dscale is psummed by JAX's transpose of pvary
      "dp": (lambda x, s, **kw: pallas_norm.rms_norm(x, s, **kw),
             lambda x, s: nnx.RMSNorm(x.shape[-1], rngs=nnx.Rngs(0), epsilon=_EPS_RMS,
                                      use_fast_variance=False)(x) * s,
             (P("data", None), P())),
      # tensor parallel with flax's axis_name, scale sharded alike
      "tp": (lambda x, s, **kw: pallas_norm.layer_norm(x, s, axis_name="model", **kw),
             lambda x, s: nnx.LayerNorm(x.shape[-1], rngs=nnx.Rngs(0), axis_name="model",
                                        use_fast_variance=False)(x) * s,
             (P("data", "model"), P("model"))),
  }


@pytest.mark.cpu_only
@pytest.mark.parametrize("case", ["dp", "tp"])
def test_check_vma_types_lower_for_cuda(case):
  """Without a GPU: under a default (check_vma=True) shard_map the kernels' outputs are
  typed varying like x, so forward and grad trace and lower for CUDA (interpret=False),
  with the collectives the layout needs and no all-gather."""
  mesh, cases = _check_vma_cases()
  ours, _, specs = cases[case]
  f = jax.shard_map(functools.partial(ours, interpret=False), mesh=mesh, in_specs=specs,
                    out_specs=specs[0])
  g = jax.grad(lambda x, s: jnp.sum(f(x, s) ** 2), argnums=(0, 1))
  x, s = jnp.ones((8, 64 * HALF)), jnp.ones(64 * HALF)
  text = jax.jit(g).trace(x, s).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("all_gather") == 0
  # dp: the psum of dscale over "data"; tp: also the pmeans of the statistics and row sums
  assert text.count("all_reduce") == (1 if case == "dp" else 5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "triton"])
@pytest.mark.parametrize("case", ["dp", "tp"])
def test_check_vma_matches_flax(case, backend):
  """Inside a default (check_vma=True) shard_map: y and the grads of x and scale equal
  flax's (nnx.RMSNorm / nnx.LayerNorm, the same axis_name) in the same shard_map."""
  mesh, cases = _check_vma_cases()
  ours, theirs, specs = cases[case]
  x = jax.random.normal(jax.random.key(7), (16, 96 * HALF)) * 2 + 0.5
  s = 1 + 0.1 * jax.random.normal(jax.random.key(8), (96 * HALF,))
  got, want = (
      jax.jit(jax.value_and_grad(
          lambda x, s: jnp.sum(jnp.sin(jax.shard_map(fn, mesh=mesh, in_specs=specs,
                                                       out_specs=specs[0])(x, s))),
          argnums=(0, 1)))(x, s)
      for fn in (functools.partial(ours, backend=backend), theirs))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=2e-4)


def _in_shard_map(fn, x, mesh):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(None, "model"),
                               out_specs=P(None, "model"), check_vma=False))(x)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_axis_name_matches_flax_nnx(kind):
  mesh = jax.make_mesh((NDEV,), ("model",), axis_types=(AxisType.Auto,))
  n_local = 12
  x = jax.random.normal(jax.random.key(3), (6, n_local * NDEV)) * 3 + 1
  ours_cls, theirs_cls = ((pallas_norm.RMSNorm, nnx.RMSNorm) if kind == "rms"
                          else (pallas_norm.LayerNorm, nnx.LayerNorm))
  outs = []
  for cls in (ours_cls, theirs_cls):
    graphdef, state = nnx.split(cls(n_local, axis_name="model", rngs=nnx.Rngs(0)))
    outs.append(_in_shard_map(lambda x: nnx.merge(graphdef, state)(x), x, mesh))
  np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), atol=2e-6, rtol=2e-6)
  # and the statistics are the whole row's: the unsharded op on x
  np.testing.assert_raises(AssertionError, np.testing.assert_allclose,
                           np.asarray(outs[0]),
                           np.asarray(_in_shard_map(
                               lambda x: nnx.merge(*nnx.split(ours_cls(
                                   n_local, rngs=nnx.Rngs(0))))(x), x, mesh)), atol=1e-3)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_axis_name_matches_flax_linen(kind):
  mesh = jax.make_mesh((NDEV,), ("model",), axis_types=(AxisType.Auto,))
  x = jax.random.normal(jax.random.key(4), (5, 8 * NDEV)) * 2 - 1
  ours_cls, theirs_cls = ((pn_linen.RMSNorm, nn.RMSNorm) if kind == "rms"
                          else (pn_linen.LayerNorm, nn.LayerNorm))
  outs = []
  for cls in (ours_cls, theirs_cls):
    layer = cls(axis_name="model")
    # (flax's own layers cannot init with an unbound axis_name: init a twin without it)
    variables = cls().init(jax.random.key(0), x[:, :8])
    outs.append(_in_shard_map(lambda x: layer.apply(variables, x), x, mesh))
  np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), atol=2e-6, rtol=2e-6)


def test_axis_name_grads_match_reference():
  mesh = jax.make_mesh((NDEV,), ("model",), axis_types=(AxisType.Auto,))
  x, scale, bias, _ = _inputs((6, 10 * NDEV), jnp.float32, seed=5)

  def loss(norm):
    def f(x, s, b):
      y = jax.shard_map(norm, mesh=mesh, in_specs=(P(None, "model"), P("model"), P("model")),
                        out_specs=P(None, "model"), check_vma=False)(x, s, b)
      return jnp.sum(jnp.sin(y))
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  got = loss(lambda x, s, b: pallas_norm.layer_norm(x, s, b, axis_name="model"))(
      x, scale, bias)
  want = jax.jit(jax.grad(lambda x, s, b: jnp.sum(jnp.sin(reference.norm(
      x, s, b, eps=1e-5, subtract_mean=True)[0])), argnums=(0, 1, 2)))(x, scale, bias)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_nnx_with_partitioning_under_jit(axis_type):
  """A model built for flax's norm, with partitioned params, runs sharded with ours."""
  mesh = jax.make_mesh((2, HALF), ("data", "model"),
                       axis_types=(AXIS_TYPES[axis_type],) * 2)
  n = 16 * HALF
  x = jax.random.normal(jax.random.key(6), (4, 3, n)) + 0.3
  results = []
  for cls in (pallas_norm.LayerNorm, nnx.LayerNorm):
    with jax.set_mesh(mesh):
      layer = cls(n, scale_init=nnx.with_partitioning(nnx.initializers.ones_init(),
                                                      ("model",)),
                  bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)),
                  rngs=nnx.Rngs(0))
      graphdef, state = nnx.split(layer)
      state = jax.device_put(state, nnx.get_named_sharding(state, mesh))
      xs = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))

      @jax.jit
      def step(state, x):
        def loss(state):
          return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)
        return jax.value_and_grad(loss)(state)

      loss_value, grads = step(state, xs)
      assert grads["scale"].value.sharding.is_equivalent_to(
          NamedSharding(mesh, P("model")), 1), grads["scale"].value.sharding
      results.append((loss_value, grads))
  np.testing.assert_allclose(float(results[0][0]), float(results[1][0]), rtol=1e-5)
  for k in ("scale", "bias"):
    np.testing.assert_allclose(np.asarray(results[0][1][k].value),
                               np.asarray(results[1][1][k].value), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "residual"])
def test_nnx_scan_over_layers_sharded(axis_type, fused):
  """A scanned stack (nnx.vmap-stacked blocks, nnx.scan + nnx.remat) on data-parallel
  activations: the norm's custom partitioning inside the while loop, no all-gather, and
  the loss and dscale of flax's RMSNorm (ours: with the fused residual add, or not)."""
  mesh = jax.make_mesh((NDEV,), ("data",), axis_types=(AXIS_TYPES[axis_type],))
  d = 32

  def stack(cls):
    ours = cls is pallas_norm.RMSNorm

    class Block(nnx.Module):
      def __init__(self, rngs):
        self.norm = cls(d, rngs=rngs, **({"residual_dtype": jnp.float32} if ours else {}))
        self.lin = nnx.Linear(d, d, dtype=jnp.bfloat16, rngs=rngs)

      def __call__(self, carry):
        x, r = carry
        if ours and fused:
          y, h = self.norm(x, residual=r)
        else:
          h = x.astype(jnp.float32) + r
          y = self.norm(h.astype(x.dtype))
        return self.lin(y), h

    class Stack(nnx.Module):
      def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
          return Block(rngs)
        self.blocks = make(rngs)

      def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def body(carry, block):
          return block(carry)
        return body((x, jnp.zeros_like(x, dtype=jnp.float32)), self.blocks)[0]
    return Stack(nnx.Rngs(0))

  x = jax.random.normal(jax.random.key(9), (2 * NDEV, 3, d), jnp.bfloat16)
  results = []
  for cls in (pallas_norm.RMSNorm, nnx.RMSNorm):
    with jax.set_mesh(mesh):
      graphdef, state = nnx.split(stack(cls))
      xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))

      @jax.jit
      def step(state, x):
        loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(x).astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss)(state)

      if cls is pallas_norm.RMSNorm:
        text = step.lower(state, xs).compile().as_text()
        assert _collectives(text)["all-gather"] == 0, _collectives(text)
      results.append(step(state, xs))
  (l_got, g_got), (l_ref, g_ref) = results
  np.testing.assert_allclose(float(l_got), float(l_ref), rtol=1e-2)
  got = np.asarray(g_got["blocks"]["norm"]["scale"][...])
  want = np.asarray(g_ref["blocks"]["norm"]["scale"][...])
  assert got.shape == (3, d)
  np.testing.assert_allclose(got, want, atol=1e-2 * float(np.max(np.abs(want))), rtol=0)


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_linen_with_logical_partitioning_under_jit(axis_type):
  """Linen: params boxed by nn.with_logical_partitioning, sharded by their logical rules."""
  mesh = jax.make_mesh((2, HALF), ("data", "model"),
                       axis_types=(AXIS_TYPES[axis_type],) * 2)
  rules = (("embed", "model"),)
  n = 16 * HALF
  x = jax.random.normal(jax.random.key(8), (4, 3, n)) - 0.2
  results = []
  for cls in (pn_linen.LayerNorm, nn.LayerNorm):
    layer = cls(scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))
    boxed = layer.init(jax.random.key(0), x)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    params = jax.device_put(nn.unbox(boxed), shardings)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))

    @jax.jit
    def step(params, x):
      return jax.value_and_grad(lambda p: jnp.sum(layer.apply(p, x) ** 2))(params)

    loss_value, grads = step(params, xs)
    g = grads["params"]["scale"]
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, P("model")), 1), g.sharding
    results.append((loss_value, grads))
  np.testing.assert_allclose(float(results[0][0]), float(results[1][0]), rtol=1e-5)
  for k in ("scale", "bias"):
    np.testing.assert_allclose(np.asarray(results[0][1]["params"][k]),
                               np.asarray(results[1][1]["params"][k]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("axis_type,op,backend", [
    ("auto", "layer", "pallas"), ("explicit", "rms", "pallas"),
    pytest.param("auto", "rms", "triton", marks=pytest.mark.gpu),  # jax-triton: GPU only
    pytest.param("explicit", "layer", "triton", marks=pytest.mark.gpu)])
def test_fp8_input_sharded(axis_type, op, backend):
  """FP8 x with its group scales (x_scale laid out like x), rows and hidden dim sharded:
  y, dx and dscale against the reference that dequantises first; y and dx keep x's
  sharding, x_scale's cotangent is zero; no all-gather. A hidden shard that would split
  a group of scales is a ValueError naming x_scale's sharding."""
  mesh = jax.make_mesh((2, HALF), ("data", "model"),
                       axis_types=(AXIS_TYPES[axis_type],) * 2)
  spec, layer, g = P("data", None, "model"), op == "layer", 16
  shape = (4, 3, 2 * g * HALF)
  x, scale, bias, dy = _inputs(shape, jnp.float32, seed=21)
  x = x.astype(jnp.float8_e4m3fn)
  s = jax.random.uniform(jax.random.key(22), shape[:-1] + (shape[-1] // g,), minval=0.5,
                         maxval=2.0)
  dy = dy.astype(jnp.bfloat16)
  ours = (lambda x, s, w, b: pallas_norm.layer_norm(x, w, b, x_scale=s, backend=backend)
          ) if layer else (
      lambda x, s, w, b: pallas_norm.rms_norm(x, w, x_scale=s, backend=backend))
  ref = lambda xd, w, b: reference.norm(xd, w, b if layer else None,
                                        eps=1e-5 if layer else _EPS_RMS,
                                        subtract_mean=layer, out_dtype=jnp.bfloat16)[0]

  @jax.jit
  def step(x, s, w, b, dy):
    y, pull = jax.vjp(ours, x, s, w, b)
    return (y, *pull(dy))

  put = lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp))
  args = (put(x, spec), put(s, spec), put(scale, P("model")), put(bias, P("model")),
          put(dy, spec))
  y, dx, ds_x, ds, _ = step(*args)
  y_w, pull = jax.vjp(ref, reference.dequantise(x, s), scale, bias)
  dx_w, ds_w, _ = pull(dy)
  tol_x, tol_p = _tol(jnp.bfloat16, shape[-1], 12)
  for name, got, want, tol in (("y", y, y_w, tol_x), ("dx", dx, dx_w, tol_x),
                               ("dscale", ds, ds_w, tol_p)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol, err_msg=name)
  assert y.dtype == dx.dtype == jnp.bfloat16 and not np.asarray(ds_x).any()
  for a in (y, dx):
    assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3), a.sharding
  assert _collectives(step.lower(*args).compile().as_text())["all-gather"] == 0
  if HALF > 1:  # 16 columns a shard: a group of 32 would straddle two shards
    with pytest.raises(Exception, match="x_scale of shape .* is uneven"):
      jax.jit(lambda x, s: pallas_norm.rms_norm(x, x_scale=s, group_size=2 * g))(
          put(x[..., :g * HALF], spec), put(s[..., :HALF // 2], P("data", None, None)))


FP8_CASES = [
    # (layout, axis type, op, delayed scaling, transpose, rank)
    ("dp", "auto", "rms", False, True, 3),
    ("dp", "explicit", "layer", True, True, 3),
    ("sp", "auto", "layer", False, False, 3),
    ("dp_sp", "explicit", "rms", False, False, 4),
    ("fsdp_2axes_rows", "auto", "rms", True, True, 2),
    ("unused_axis", "explicit", "rms", False, True, 3),
    ("tp", "auto", "rms", True, True, 3),
    ("tp", "explicit", "layer", False, True, 2),
    ("tp", "explicit", "rms", False, False, 4),
    ("dp_tp", "auto", "layer", True, False, 3),
    ("dp_tp", "explicit", "rms", False, True, 3),
]


@pytest.mark.parametrize("layout,axis_type,op,delayed,transpose,rank", FP8_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{'delayed' if c[3] else 'current'}"
                              f"{'-t' if c[4] else ''}-{c[5]}d" for c in FP8_CASES])
def test_fp8_output_sharded(layout, axis_type, op, delayed, transpose, rank):
  """rms_norm_fp8 / layer_norm_fp8 with x's rows and/or hidden dim sharded: the
  unsharded call's y, y_t (within one FP8 step: the shards' row blocks and partial sums
  differ, so rstd may differ by an ulp), y_scale, amax, mean and rstd; the amax is
  global (a pmax over the sharding axes: the largest value sits on the last device's
  rows and columns), so is current scaling's y_scale; y keeps x's sharding, mean and
  rstd its row sharding, y_t [N, M] is sharded along N like x's hidden dim and along M
  like x's first dim; bitwise the same on a second run; no all-gather in the compiled
  call; a NaN on one device reaches every device's amax."""
  mesh_shape, names, _ = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names))
  shape, spec = _shape(layout, rank, 40)
  x, scale, bias, _ = _inputs(shape, jnp.bfloat16, seed=31)
  x = x.at[(-1,) * rank].set(40.0)
  layer = op == "layer"
  fn = pallas_norm.layer_norm_fp8 if layer else pallas_norm.rms_norm_fp8
  params = (scale, bias) if layer else (scale,)
  kw = dict(transpose=transpose, y_scale=jnp.float32(0.05) if delayed else None)
  call = jax.jit(lambda x, *p: tuple(fn(x, *p, **kw)))
  want = call(x, *params)
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  compiled = call.lower(xs, *params).compile()  # one compile: run it, read its HLO
  got = compiled(xs, *params)
  for name, g, w in zip(("y", "y_scale", "amax", "y_t", "mean", "rstd"), got, want):
    assert (g is None) == (w is None), name
    if g is None:
      continue
    g, w = np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
    if name in ("y", "y_t"):  # e4m3: 3 mantissa bits, one step is 2**-3 relative
      np.testing.assert_allclose(g, w, rtol=2.0**-3, atol=2.0**-9, err_msg=name)
      assert np.mean(g == w) > 0.99, name
    else:
      np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=name)
  again = compiled(xs, *params)
  for g, a in zip(got, again):
    if g is not None:
      np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                    np.asarray(a.astype(jnp.float32)))
  y, _, _, y_t, mean, rstd = got
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), len(shape)), y.sharding
  assert rstd.sharding.is_equivalent_to(NamedSharding(mesh, P(*tuple(spec)[:-1])),
                                        len(shape) - 1), rstd.sharding
  if transpose:
    want_t = P(tuple(spec)[-1], tuple(spec)[0])
    assert y_t.sharding.is_equivalent_to(NamedSharding(mesh, want_t), 2), y_t.sharding
  assert _collectives(compiled.as_text())["all-gather"] == 0
  nan = jax.device_put(x.at[(-1,) * rank].set(jnp.nan), NamedSharding(mesh, spec))
  assert np.isnan(float(compiled(nan, *params)[2]))


@pytest.mark.parametrize("stats", [True, False], ids=["stats", "y_only"])
@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("layout,op", [("dp", "rms"), ("dp_sp", "layer")])
def test_fp8_output_residual_sharded(layout, axis_type, op, stats):
  """residual= with the rows sharded (static scale): y within one FP8 step of the
  unsharded call and mostly equal, h bitwise, amax global (None with stats=False); y
  and h keep x's sharding; no all-gather. The hidden dim sharded: NotImplementedError
  before any kernel (on an Auto mesh from inside XLA's compilation)."""
  mesh_shape, names, _ = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names))
  shape, spec = _shape(layout, 3, 40)
  x, scale, bias, _ = _inputs(shape, jnp.bfloat16, seed=51)
  r = jax.random.normal(jax.random.key(52), shape, jnp.float32)
  fn = pallas_norm.layer_norm_fp8 if op == "layer" else pallas_norm.rms_norm_fp8
  params = (scale, bias) if op == "layer" else (scale,)
  call = jax.jit(lambda x, r, *p: fn(x, *p, y_scale=jnp.float32(0.05), residual=r,
                                     stats=stats))
  (want, want_h) = call(x, r, *params)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
  compiled = call.lower(put(x), put(r), *params).compile()
  got, h = compiled(put(x), put(r), *params)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(want_h))
  g, w = np.asarray(got.y.astype(jnp.float32)), np.asarray(want.y.astype(jnp.float32))
  np.testing.assert_allclose(g, w, rtol=2.0**-3, atol=2.0**-9)
  assert np.mean(g == w) > 0.99
  if stats:
    np.testing.assert_allclose(float(got.amax), float(want.amax), rtol=1e-6)
  else:
    assert got.amax is None and got.mean is None and got.rstd is None
  for a in (got.y, h):
    assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), len(shape)), a.sharding
  assert _collectives(compiled.as_text())["all-gather"] == 0
  tp_mesh_shape, tp_names, tp_spec = LAYOUTS["tp"]
  tp = jax.make_mesh(tp_mesh_shape, tp_names,
                     axis_types=(AXIS_TYPES[axis_type],) * len(tp_names))
  tshape, _ = _shape("tp", 3, 40)
  xt, rt = (jax.device_put(jnp.ones(tshape, jnp.bfloat16), NamedSharding(tp, tp_spec))
            for _ in range(2))
  with pytest.raises((NotImplementedError, jax.errors.JaxRuntimeError),
                     match="tensor parallel"):
    jax.block_until_ready(jax.jit(lambda x, r: pallas_norm.rms_norm_fp8(
        x, y_scale=jnp.float32(0.05), residual=r, stats=stats))(xt, rt))
  if not stats:  # y alone, no residual: the same refusal
    with pytest.raises((NotImplementedError, jax.errors.JaxRuntimeError),
                       match="stats=False.*tensor parallel"):
      jax.block_until_ready(jax.jit(lambda x: pallas_norm.rms_norm_fp8(
          x, y_scale=jnp.float32(0.05), stats=False))(xt))


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_fp8_output_unserved_layouts_are_errors(axis_type):
  """y_t with a non-leading row dim sharded: a ValueError naming the sharding, not a
  gather."""
  at = (AXIS_TYPES[axis_type],)
  x = _inputs((4, 6, 8 * NDEV), jnp.bfloat16)[0]
  put = lambda mesh, spec: jax.device_put(x, NamedSharding(mesh, spec))
  sp = put(jax.make_mesh((2,), ("seq",), axis_types=at), P(None, "seq", None))
  with pytest.raises(Exception, match="transposed copy y_t"):
    jax.jit(lambda x: pallas_norm.rms_norm_fp8(x, transpose=True).y_t)(sp)


def _assert_same_step(l1, g1, l2, g2):
  """A sharded FP8 dense step (loss l2, grads g2) against the unsharded one (l1, g1):
  the loss to 1e-5, every gradient and new amax history to 2% of its largest value."""
  np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5)
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(g1)),
                               jax.tree_util.tree_leaves_with_path(nnx.state(g2))):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2 * np.abs(a).max() + 1e-30,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_fp8_dense_layer_data_parallel(axis_type):
  """flax_layers.RMSNormDenseFP8 (delayed scaling) in a jitted value_and_grad with a
  data-parallel batch: the loss, the gradients and the new amax histories match the
  unsharded step (the amaxes are global), and the compiled step has no all-gather (the
  weight gradient y_t @ g is a local FP8 GEMM, then a psum)."""
  import flax_layers
  mesh = jax.make_mesh((NDEV,), ("data",), axis_types=(AXIS_TYPES[axis_type],))
  layer = flax_layers.RMSNormDenseFP8(64, 32, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = _inputs((2 * NDEV, 4, 64), jnp.bfloat16, seed=41)[0]
  diff = nnx.DiffState(0, (nnx.Param, flax_layers.Fp8Meta))
  loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)
  step = nnx.jit(lambda m, x: nnx.value_and_grad(loss, argnums=diff)(m, x))
  l1, g1 = step(layer, x)
  xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
  with jax.set_mesh(mesh):
    l2, g2 = step(layer, xs)
    graph, state = nnx.split(layer)
    text = jax.jit(lambda s, x: nnx.value_and_grad(loss, argnums=diff)(
        nnx.merge(graph, s), x)).lower(state, xs).compile().as_text()
  _assert_same_step(l1, g1, l2, g2)
  assert _collectives(text)["all-gather"] == 0


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("kernel_spec", [(None, "model"), ("model", None), ("data", None)],
                         ids=["column_parallel", "row_parallel", "fsdp"])
def test_fp8_dense_layer_sharded_kernel(axis_type, kernel_spec):
  """RMSNormDenseFP8 with its kernel sharded (nnx.with_partitioning) over a (data, model)
  mesh, rows over "data": the step matches the unsharded one, dW keeps the kernel's
  sharding on Explicit meshes (a custom_vjp cotangent must), and no all-gather moves
  an activation (an array with the M rows): only the weight, as FSDP does."""
  import flax_layers
  from flax_layers import fp8 as fp8_layers
  mesh = jax.make_mesh((2, HALF), ("data", "model"), axis_types=(AXIS_TYPES[axis_type],) * 2)
  n, f = 64, 48
  x = _inputs((2 * NDEV, 5, n), jnp.bfloat16, seed=43)[0]  # M = 10 NDEV: no weight dim
  m_rows = x.shape[0] * x.shape[1]
  diff = nnx.DiffState(0, (nnx.Param, flax_layers.Fp8Meta))
  loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)
  make = lambda init: flax_layers.RMSNormDenseFP8(n, f, dtype=jnp.bfloat16, kernel_init=init,
                                                  rngs=nnx.Rngs(0))
  l1, g1 = nnx.jit(lambda m, x: nnx.value_and_grad(loss, argnums=diff)(m, x))(
      make(fp8_layers.default_kernel_init), x)
  with jax.set_mesh(mesh):
    layer = make(nnx.with_partitioning(fp8_layers.default_kernel_init, kernel_spec))
    graph, state = nnx.split(layer)
    state = jax.device_put(state, nnx.get_named_sharding(state, mesh))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
    step = jax.jit(lambda s, x: nnx.value_and_grad(loss, argnums=diff)(nnx.merge(graph, s), x))
    text = step.lower(state, xs).compile().as_text()
    l2, g2 = step(state, xs)
  _assert_same_step(l1, g1, l2, g2)
  if axis_type == "explicit":
    assert g2["kernel"][...].sharding.is_equivalent_to(
        NamedSharding(mesh, P(*kernel_spec)), 2), g2["kernel"][...].sharding
  gathered = [line for line in text.splitlines()
              if (" all-gather(" in line or " all-gather-start(" in line) and " = " in line]
  for line in gathered:
    shape = line.split(" = ", 1)[1].split("{", 1)[0]
    assert str(m_rows) not in shape.replace("[", ",").replace("]", ",").split(","), line


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("layout", ["sp", "dp_sp"])
def test_fp8_dense_layer_sequence_parallel(axis_type, layout):
  """RMSNormDenseFP8 on x [B, S, N] with the sequence dim sharded (alone, or with the
  batch): the layer keeps x's row dims (the transposed copy y_t [N, B, S] is laid out
  like x), so the step matches the unsharded one with no all-gather at all (before
  2026-11-27 it reshaped x to [M, N]: an all-gather of x on Auto meshes, a JAX reshape
  error on Explicit ones)."""
  import flax_layers
  mesh_shape, names, spec = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names))
  x = _inputs((4, 4 * NDEV, 64), jnp.bfloat16, seed=47)[0]
  diff = nnx.DiffState(0, (nnx.Param, flax_layers.Fp8Meta))
  loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)
  layer = flax_layers.LayerNormDenseFP8(64, 48, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  l1, g1 = nnx.jit(lambda m, x: nnx.value_and_grad(loss, argnums=diff)(m, x))(layer, x)
  with jax.set_mesh(mesh):
    graph, state = nnx.split(layer)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    step = jax.jit(lambda s, x: nnx.value_and_grad(loss, argnums=diff)(nnx.merge(graph, s), x))
    text = step.lower(state, xs).compile().as_text()
    l2, g2 = step(state, xs)
  _assert_same_step(l1, g1, l2, g2)
  assert _collectives(text)["all-gather"] == 0, _collectives(text)
  assert _collectives(text)["all-to-all"] == 0, _collectives(text)


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_hessian_vector_product_sharded(axis_type, layout):
  """A Hessian-vector product (jax.jvp of jax.grad) of a LayerNorm loss on sharded x:
  the kernels' custom_jvp tangents (the jnp math) are partitioned as XLA partitions jnp;
  equal to backend="xla"'s on one device."""
  mesh_shape, names, _ = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names))
  shape, spec = _shape(layout, 3, 24)
  x, scale, bias, _ = _inputs(shape, jnp.float32, seed=51)
  v = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

  def hvp(backend, x, v):
    loss = lambda x: jnp.sum(pallas_norm.layer_norm(x, scale, bias, backend=backend) ** 3)
    return jax.jvp(jax.grad(loss), (x,), (v,))[1]

  want = jax.jit(lambda x, v: hvp("xla", x, v))(x, v)
  with jax.set_mesh(mesh):
    xs, vs = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, v))
    got = jax.jit(lambda x, v: hvp("pallas", x, v))(xs, vs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                             atol=1e-4 * float(jnp.max(jnp.abs(want))))


def test_grad_of_grad_with_axis_name():
  """jax.grad of jax.grad of a LayerNorm inside jax.shard_map with axis_name (the hidden
  dim split over "model"): the reference tangents reduce their statistics over the same
  axis; equal to backend="xla"'s."""
  mesh = jax.make_mesh((2, HALF), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  x, scale, _, _ = _inputs((4, 16 * HALF), jnp.float32, seed=53)

  def gg(backend):
    def loss(x, w):
      f = jax.shard_map(
          lambda x, w: pallas_norm.layer_norm(x, w, None, axis_name="model", backend=backend),
          mesh=mesh, in_specs=(P("data", "model"), P("model")),
          out_specs=P("data", "model"), check_vma=False)
      return jnp.sum(f(x, w) ** 3)
    g = jax.grad(loss, argnums=(0, 1))
    return jax.jit(jax.grad(lambda x, w: sum(jnp.sum(t ** 2) for t in g(x, w)),
                            argnums=(0, 1)))(x, scale)

  for got, want in zip(gg("pallas"), gg("xla")):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-4 * float(jnp.max(jnp.abs(want))))
