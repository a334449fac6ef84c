"""Every implementation the kernel bench times, as a function of (x, scale, bias).

pallas_norm (each backend and mode), the XLA reference (``reference.norm`` under
``jax.jit``; for the FP8-output ops the jnp chain norm -> amax -> quantise -> transpose),
``flax.nnx.RMSNorm``/``LayerNorm``, tokamax, torch and Liger-Kernel; each
one runs when it can be imported (``probe`` says why not otherwise). The eps is the same
for every implementation (``plan.EPS``).

forward+backward = ``jax.jit`` of ``jax.vjp`` of the op applied to a fixed random dy
(``fwdbwd``); the step returns y too, so that every implementation writes it.

tokamax is timed as ``PallasTritonNormalization(input_output_alias=False)``: the op that
``tokamax.layer_norm(..., implementation="triton")`` calls, with the same kernel and
launch config, minus one thing. Its default forward aliases y onto x; in a jitted step
whose x stays live (a parameter here, a residual stream in a model), XLA then copies x
first with a device-to-device memcpy. CUPTI kernel time does not see that copy, and the
kernel then reads x from L2, where the copy left it. On an H200 (2026-11-21), 4096x1024
bf16: 4.26 us aliased (kernel only), 5.79 us without the alias
(``benchmarks/results/h200_2026-11-21_tokamax_alias.txt``). Its VJP writes dx over x in
the same way; ``tokamax_vjp_without_alias`` launches the same kernel with the same
config into a buffer of its own. The step's results are bitwise the same. H200,
2026-11-22, RMSNorm 32768x128 forward+backward: 13.94 us aliased (kernels only), 15.30
us without; the H100: 15.17 / 17.74 us. From 4096x4096 up the two tie
(``benchmarks/results/h200_2026-11-22_tokamax_vjp_alias.txt``). Re-run both A/Bs with
``python -m pallas_norm.bench ab tokamax-alias``.
"""

from __future__ import annotations

import functools
import importlib
import sys

import jax
import jax.numpy as jnp

from pallas_norm import reference
from pallas_norm.bench.plan import (EPS, FP8_DELAYED_SCALE, FP8_INPUT_GROUP, Impl, fp8_input,
                                    fp8_static, fp8_variant)


def jax_fn(impl: Impl, op: str):
  """f(x, scale, bias) -> y for a JAX implementation (bias is None for RMSNorm); for a
  "*_res" op, f((x, r), scale, bias) -> (y, h); for an FP8-output op, -> Fp8Norm; for an
  FP8-input op, f((x8, x_scale), scale, bias) -> y."""
  eps = EPS[op]
  if fp8_input(op):
    return _fp8_input_fn(impl, op, eps)
  if fp8_variant(op) is not None:
    return _fp8_fn(impl, op, eps)
  if op.endswith("_res"):
    return _residual_fn(impl, op[:-len("_res")], eps)
  layer = op == "layer"
  if impl.family == "pallas_norm":
    import pallas_norm
    if layer:
      return lambda x, s, b: pallas_norm.layer_norm(x, s, b, eps=eps, mode=impl.mode,
                                                    backend=impl.backend)
    return lambda x, s, b: pallas_norm.rms_norm(x, s, eps=eps, mode=impl.mode,
                                                backend=impl.backend)
  if impl.name == "xla":
    return lambda x, s, b: reference.norm(x, s, b, eps=eps, subtract_mean=layer)[0]
  if impl.name == "tokamax":
    import tokamax  # noqa: F401 - fails early, with tokamax's own error, if it is absent
    from absl import flags
    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags: not our argv
      flags.FLAGS(sys.argv[:1])
    # What layer_norm(implementation="triton") runs, without the y-onto-x and dx-onto-x
    # aliases whose memcpy CUPTI cannot see (module docstring).
    from tokamax._src.ops.normalization import pallas_triton
    op = pallas_triton.PallasTritonNormalization(input_output_alias=False,
                                                 vjp=tokamax_vjp_without_alias())
    return lambda x, s, b: op(x=x, scale=s, offset=b, epsilon=eps, subtract_mean=layer)
  if impl.name == "flax":
    return _flax_fn(op, eps)
  raise ValueError(f"{impl.name=} is not a JAX implementation")


def without_tables(step):
  """``step`` traced with ``PALLAS_NORM_TUNING=none``: launch configs from the default
  alone (configs are chosen at trace time, so the variable is set around the trace)."""
  import os

  def untuned(*args):
    before = os.environ.get("PALLAS_NORM_TUNING")
    os.environ["PALLAS_NORM_TUNING"] = "none"
    try:
      return step(*args)
    finally:
      if before is None:
        del os.environ["PALLAS_NORM_TUNING"]
      else:
        os.environ["PALLAS_NORM_TUNING"] = before
  return untuned


def fwdbwd(f, op: str = "rms", dependent: bool = False):
  """step(x, s, b, dy) -> (y, grads): ``jax.vjp`` of ``f``, pulled back at dy. For an
  FP8-input op x is (x8, x_scale) and the grads are (dx, dscale, dbias): the scales are
  constants (their cotangent, zero, is not written).

  ``dependent`` ("fwdbwd_dep"): dy is released only once y exists
  (``jax.lax.optimization_barrier`` on (y, dy)), the order of a training step, where dy
  is a function of y. Without it nothing orders the backward after the forward, and XLA
  may fuse its own norm's backward row sums into the forward's statistics pass (one read
  of x and one kernel fewer than a training step can have)."""
  def vjp(x, s, b):
    if fp8_input(op):
      x8, x_scale = x
      return jax.vjp(lambda x8, s, b: f((x8, x_scale), s, b), x8, s, b)
    return jax.vjp(f, x, s, b)

  def step(x, s, b, dy):
    y, pull = vjp(x, s, b)
    if dependent:
      y, dy = jax.lax.optimization_barrier((y, dy))
    return y, pull(dy)
  return step


def step_of(f, op: str, pass_: str):
  """The jitted-to-be step of one pass: f itself ("fwd"), ``fwdbwd`` or, for
  "fwdbwd_dep", ``fwdbwd(..., dependent=True)``."""
  if pass_ == "fwd":
    return f
  return fwdbwd(f, op, dependent=pass_ == "fwdbwd_dep")


class _DropAliases:
  """A module whose ``pallas_call`` loses its ``input_output_aliases`` argument; every
  other attribute is the wrapped module's."""

  def __init__(self, module):
    self._module = module

  def __getattr__(self, name):
    return getattr(self._module, name)

  def pallas_call(self, *args, input_output_aliases=None, **kwargs):
    del input_output_aliases  # the outputs get buffers of their own
    return self._module.pallas_call(*args, **kwargs)


def tokamax_vjp_without_alias():
  """tokamax's Pallas-Triton VJP with the same kernel and launch config, minus the
  dx-onto-x alias of its ``pallas_call`` (module docstring: CUPTI does not see the copy
  of x that the alias costs).

  Raises:
    RuntimeError: this tokamax's VJP no longer launches through ``block.pallas_call``,
      so the alias cannot be dropped (rather than time it with a hidden copy).
  """
  from tokamax._src.ops.normalization import pallas_triton_vjp as tv
  if not callable(getattr(getattr(tv, "block", None), "pallas_call", None)):
    raise RuntimeError("tokamax's pallas_triton_vjp has no block.pallas_call to drop the "
                       "dx-onto-x alias from; update "
                       "pallas_norm.bench.peers.tokamax_vjp_without_alias")

  class NoAliasVjp(tv.PallasTritonNormalizationVjp):
    # tokamax binds arguments by _fwd's signature: keep the original's.
    @functools.wraps(tv.PallasTritonNormalizationVjp._fwd)
    def _fwd(self, *args, **kwargs):  # runs while the op is traced
      block = tv.block
      tv.block = _DropAliases(block)
      try:
        return super()._fwd(*args, **kwargs)
      finally:
        tv.block = block

  return NoAliasVjp()


def _fp8_fn(impl: Impl, op: str, eps: float):
  """f(x, scale, bias) -> Fp8Norm: pallas_norm's kernels, or on "xla" the jnp chain
  (reference.norm in float32, amax, quantise, transpose; backend="xla") under jit."""
  import pallas_norm
  norm, delayed, transpose = fp8_variant(op)
  backend = impl.backend or impl.name  # pallas-untuned: "pallas", traced without tables
  if impl.mode is not None or backend not in ("pallas", "xla"):
    raise NotImplementedError(f"{impl.name} has no FP8 output")
  f = pallas_norm.layer_norm_fp8 if norm == "layer" else pallas_norm.rms_norm_fp8
  extra = (lambda b: (b,)) if norm == "layer" else (lambda b: ())
  y_scale = jnp.float32(FP8_DELAYED_SCALE) if delayed else None

  def fn(x, s, b):
    res = {}
    if op.endswith("_res"):  # (x, r): the fused residual add; y and h returned
      x, rr = x
      res = dict(residual=rr)
    # the static ops: y alone, the y-only kernel (stats=False), but *_fp8_static_stats
    lean = dict(stats=False) if fp8_static(op) and not op.endswith("_stats") else {}
    r = f(x, s, *extra(b), y_scale=y_scale, transpose=transpose, eps=eps,
          backend=backend, **res, **lean)
    if res:
      return r[0].y, r[1]
    # Delayed scaling hands the given y_scale back. Here it is a constant of the jitted
    # step, which XLA copies into an output buffer with a MemcpyD2D (1.2-1.3 us on the
    # H100, not in the CUPTI kernel time: benchmarks/kernel_clock_gaps.py at fd31e12); a caller's
    # own scale costs nothing of the kind, so the step leaves it out. A static-scale op
    # (W8A8 serving) returns y alone: what XLA does not need (the amax's reduce of the
    # per-program partials) is left out of the program.
    if fp8_static(op):
      return r.y
    return r._replace(y_scale=None) if delayed else r
  return fn


def _fp8_input_fn(impl: Impl, op: str, eps: float):
  """f((x8, x_scale), scale, bias) -> y in scale's dtype: pallas_norm with FP8 x (groups
  of FP8_INPUT_GROUP) on its backend and mode, or on "xla" the jnp chain under jit
  (``reference.dequantise``, then ``reference.norm``: backend="xla", whose custom_vjp
  returns dx in y's dtype as the kernels do, where JAX's own derivative of
  ``x8.astype(f32)`` would round dx to FP8)."""
  import pallas_norm
  if impl.family != "pallas_norm" and impl.name != "xla":
    raise NotImplementedError(f"{impl.name} has no FP8 input")
  layer = op.startswith("layer")
  norm = pallas_norm.layer_norm if layer else pallas_norm.rms_norm
  extra = (lambda b: (b,)) if layer else (lambda b: ())
  backend = impl.backend or "xla"

  def f(xq, s, b):
    x8, x_scale = xq
    return norm(x8, s, *extra(b), x_scale=x_scale, group_size=FP8_INPUT_GROUP,
                out_dtype=s.dtype, eps=eps, mode=impl.mode, backend=backend)
  return f


def _residual_fn(impl: Impl, op: str, eps: float):
  """f((x, r), scale, bias) -> (y, h) for the fused residual add ("rms_post": with
  Gemma's post-norm of x first, its scale the same ``scale``)."""
  if op == "rms_post":
    return _post_norm_fn(impl, eps)
  layer = op == "layer"
  if impl.family == "pallas_norm":
    import pallas_norm
    norm = pallas_norm.layer_norm if layer else pallas_norm.rms_norm
    extra = (lambda b: (b,)) if layer else (lambda b: ())
    return lambda xr, s, b: norm(xr[0], s, *extra(b), residual=xr[1], eps=eps,
                                 mode=impl.mode, backend=impl.backend)
  if impl.name == "xla":  # the same formula, jnp under jit: XLA fuses it
    def f(xr, s, b):
      x, r = xr
      h = x.astype(jnp.float32) + r.astype(jnp.float32)
      y = reference.norm(h, s, b, eps=eps, subtract_mean=layer)[0]
      return y.astype(x.dtype), h.astype(r.dtype)
    return f
  if impl.name == "flax":  # what a flax model writes: the add, then flax's norm
    norm = _flax_fn(op, eps)
    def g(xr, s, b):
      h = xr[0] + xr[1]
      return norm(h, s, b), h
    return g
  raise NotImplementedError(f"{impl.name} has no fused residual add")


def _post_norm_fn(impl: Impl, eps: float):
  """f((x, r), scale, None) -> (y, h): h = r + rms_norm(x, scale) (in x's dtype), y =
  rms_norm(h, scale)."""
  if impl.family == "pallas_norm":
    import pallas_norm
    return lambda xr, s, b: pallas_norm.rms_norm(xr[0], s, residual=xr[1], post_norm_scale=s,
                                                 eps=eps, mode=impl.mode, backend=impl.backend)
  if impl.name == "xla":  # the same formula, jnp under jit: XLA fuses it
    def f(xr, s, b):
      x, r = xr
      d = reference.norm(x, s, None, eps=eps, subtract_mean=False)[0].astype(x.dtype)
      h = d.astype(jnp.float32) + r.astype(jnp.float32)
      y = reference.norm(h, s, None, eps=eps, subtract_mean=False)[0]
      return y.astype(x.dtype), h.astype(r.dtype)
    return f
  if impl.name == "flax":  # flax Gemma's block: post-norm, the add, the next norm
    norm = _flax_fn("rms", eps)
    def g(xr, s, b):
      h = norm(xr[0], s, b) + xr[1]
      return norm(h, s, b), h
    return g
  raise NotImplementedError(f"{impl.name} has no post-norm")


def _flax_fn(op: str, eps: float):
  """flax.nnx defaults (LayerNorm: use_fast_variance=True), eps matched, params and
  output in x's dtype, run functionally (split/merge, what nnx.jit does)."""
  from flax import nnx

  def f(x, s, b):
    n = x.shape[-1]
    kw = dict(epsilon=eps, dtype=x.dtype, param_dtype=s.dtype, rngs=nnx.Rngs(0))
    module = nnx.LayerNorm(n, **kw) if op == "layer" else nnx.RMSNorm(n, **kw)
    graphdef, _ = nnx.split(module)
    params = {"scale": nnx.Param(s)}
    if op == "layer":
      params["bias"] = nnx.Param(b)
    return nnx.merge(graphdef, nnx.State(params))(x)

  return f


def torch_fn(impl: Impl, op: str):
  """f(x, weight, bias) -> y on torch CUDA tensors."""
  eps = EPS[op]
  if impl.name == "torch":
    import torch.nn.functional as F
    if op == "layer":
      return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, eps)
  if impl.name == "liger":
    from liger_kernel.transformers import functional as lf
    if op == "layer":
      return lambda x, w, b: lf.liger_layer_norm(x, w, b, eps)
    # in_place=False: the default writes dx over dy, which the rotation reuses.
    return lambda x, w, b: lf.liger_rms_norm(x, w, eps, in_place=False)
  raise ValueError(f"{impl.name=} is not a torch implementation")


def probe(impl: Impl, torch_ok: tuple[bool, str]) -> str | None:
  """Why ``impl`` cannot run here, or None."""
  needs = {"triton": "jax_triton", "flax": "flax.nnx", "tokamax": "tokamax",
           "liger": "liger_kernel.transformers.functional"}
  if impl.kind == "torch" and not torch_ok[0]:
    return torch_ok[1]
  mod = needs.get(impl.backend if impl.family == "pallas_norm" else impl.name)
  if mod is None:
    return None
  try:
    importlib.import_module(mod)
  except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
    return f"cannot import {mod}: {type(e).__name__}: {e}"
  return None
