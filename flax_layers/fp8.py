"""A fused norm -> FP8 quantise -> FP8 matmul layer (TransformerEngine's LayerNormDenseGeneral).

``RMSNormDenseFP8`` / ``LayerNormDenseFP8`` (Flax NNX; Linen twins in
``flax_layers.linen``) compute ``dense(norm(x))`` with both GEMM operands in FP8, as
TransformerEngine JAX's ``LayerNormDenseGeneral`` (``layernorm_fp8_dot``) does, from
pallas_norm's quantising norm (``pallas_norm.fp8.rms_norm_fp8``, issue #27). One
``jax.custom_vjp`` covers the whole block, so no FP8 tensor needs a cotangent:

    forward   y, y_scale, amax, y_t, mean, rstd = rms_norm_fp8(x, gamma, y_scale=s_y,
                                                              transpose=True)
              w = quantise(W, s_w)                                   e4m3 [N, F]
              out = (y @ w) * (s_y * s_w)                            FP8 GEMM, f32 acc.
    backward  g = quantise(dout, s_g)                                e5m2 [M, F]
              dy = (g @ w.T) * (s_g * s_w)                           FP8 GEMM (dgrad)
              dW = (y_t @ g) * (s_y * s_g)                           FP8 GEMM (wgrad)
              dx, dgamma, dbeta = norm_backward(dy, x, gamma, beta, mean, rstd)

(x [M, N], W [N, F]; every scale is a float32 DEQUANTISATION scale, value ~= q * s, as
in pallas_norm.fp8, TransformerEngine's scale_inv and flax fp8_ops.) The transposed FP8
copy ``y_t`` [N, M] that the norm's kernel writes in the same pass feeds the
weight-gradient GEMM; the norm's backward is pallas_norm's deterministic two-stage one,
from the saved x, mean and rstd. FP8 dtypes follow TransformerEngine's HYBRID recipe:
float8_e4m3fn forward (activations and weights), float8_e5m2 for the gradient.

Scaling (``scaling=``):
  "delayed"  TransformerEngine's DelayedScaling and flax's ``Fp8DotGeneral``: each
             tensor's scale comes from the max of an amax history of the last
             ``amax_history_length`` steps (flax's ``compute_scale``; the previous scale
             while the history holds no positive finite amax, so the first step runs with
             scale 1), and this step's amax is pushed into it (flax's
             ``compute_amax_history``). The histories and scales (input, kernel, output
             gradient) are ``Fp8Meta`` variables (Linen: flax's ``_overwrite_with_gradient``
             collection). The output gradient's amax is only known in the backward, so the
             layer uses flax's overwrite-with-gradient mechanism: the vjp returns each new
             history and scale as the *gradient* of the old one, and the train step writes
             those "gradients" into the model instead of handing them to the optimizer
             (``update_fp8_meta(model, grads)`` in NNX, module docstring of the classes).
             A forward without a gradient (evaluation) leaves them unchanged. Call each
             layer once per step: two calls would add their "gradients". A gradient
             that does not differentiate the state (flax's plain
             ``nnx.value_and_grad(loss)(model)``) would never fill the histories, so
             every scale would stay 1 and small output gradients would flush to zero:
             the layer sees it at trace time (custom_vjp's symbolic zeros), warns, and
             runs current scaling for that call (docs/fp8.md, "Scaling").
  "current"  every scale is this call's amax / fp8_max (``pallas_norm.fp8.current_scale``);
             no state, one more read of W and of dout per step.

XLA turns each ``dot_general`` of FP8 operands with a float32 result, times the product
of two float32 scalars, cast to the output dtype, into one cuBLASLt FP8 GEMM
(``__cublas$lt$matmul$f8``; the scales become its a/b scale operands) on Hopper and
later (or, where its autotuner prefers, a Triton GEMM fusion of the FP8 operands);
``fp8_gemm_calls`` lists the GEMMs of a compiled program (``report_fp8_gemms`` prints
the layer's). On a CPU the same program runs the dots on converted operands.

Reused from flax (``flax.linen.fp8_ops``): ``compute_scale``, ``compute_amax_history``
and ``OVERWRITE_WITH_GRADIENT``. Quantisation is pallas_norm.fp8's ``quantise`` (the
contract's multiply-by-inverse order; flax's ``quantize`` divides).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import math
import re
import typing as tp
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops as _flax_fp8
from flax.nnx.nn.linear import default_kernel_init

from flax_layers import _flax_args
from pallas_norm import fp8 as _fp8
from pallas_norm import ops as _ops
from pallas_norm import spmd as _spmd

__all__ = ["RMSNormDenseFP8", "LayerNormDenseFP8", "Fp8Meta", "DelayedScalingState",
           "norm_dense_fp8", "init_delayed_scaling", "update_fp8_meta", "gemm_calls_in",
           "fp8_gemm_count", "fp8_gemm_calls", "report_fp8_gemms",
           "SCALINGS", "FP8_BACKENDS", "FP8_GEMM_TARGET", "OVERWRITE_WITH_GRADIENT"]

SCALINGS = ("delayed", "current")
FP8_BACKENDS = _fp8.FP8_BACKENDS  # the quantising norm's: "pallas", "xla"
FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
OVERWRITE_WITH_GRADIENT = _flax_fp8.OVERWRITE_WITH_GRADIENT
_F32 = jnp.float32
_TINY = _fp8.MIN_Y_SCALE  # 2**-126: the floor of a delayed scale (current scaling's too)
_E4M3, _E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
# The FP8 dtypes each GEMM operand may take. cuBLASLt's FP8 GEMM needs an e4m3 operand
# on at least one side; the forward GEMM has two fp8_dtype operands (y and W), so
# fp8_dtype is e4m3 (TransformerEngine's HYBRID and E4M3 recipes both keep it).
_FWD_DTYPES = (_E4M3,)
_GRAD_DTYPES = (_E5M2, _E4M3)


class DelayedScalingState(tp.NamedTuple):
  """Delayed scaling's state of one layer: float32 arrays, flax ``Fp8DotGeneral``'s names
  and shapes (scales ``(1,)``, histories ``(amax_history_length,)``).

  As an argument of ``norm_dense_fp8`` its cotangent is the NEW state (flax's
  overwrite-with-gradient): the input and kernel entries from this step's forward, the
  output gradient's from its backward.
  """

  input_scale: jax.Array
  input_amax_history: jax.Array
  kernel_scale: jax.Array
  kernel_amax_history: jax.Array
  output_grad_scale: jax.Array
  output_grad_amax_history: jax.Array


def init_delayed_scaling(amax_history_length: int = 1024) -> DelayedScalingState:
  """The initial state: scales one, histories zero (flax's and TransformerEngine's)."""
  _check_history(amax_history_length)
  # a buffer of its own each (a train step donating the state must not see one twice)
  return DelayedScalingState(*(jnp.ones((1,), _F32) if name.endswith("_scale") else
                               jnp.zeros((amax_history_length,), _F32)
                               for name in DelayedScalingState._fields))


@dataclasses.dataclass(frozen=True)
class _Static:
  """Hashable non-differentiable arguments of the custom_vjp."""

  subtract_mean: bool
  eps: float
  scale_offset: float
  fp8_dtype: str
  grad_fp8_dtype: str
  kernel_dtype: str  # dW's
  backend: str
  interpret: bool | None


# --------------------------------------------------------------------------- checks


def _check_history(amax_history_length) -> None:
  if (isinstance(amax_history_length, bool) or not isinstance(amax_history_length, int)
      or amax_history_length < 1):
    raise ValueError(f"{amax_history_length=} must be a positive integer")


def _check_fp8_dtypes(fp8_dtype, grad_fp8_dtype) -> tuple[jnp.dtype, jnp.dtype]:
  out = []
  for name, dt, allowed in (("fp8_dtype", fp8_dtype, _FWD_DTYPES),
                            ("grad_fp8_dtype", grad_fp8_dtype, _GRAD_DTYPES)):
    try:
      d = jnp.dtype(dt)
    except TypeError as e:
      raise TypeError(f"{name}={dt!r} is not a dtype") from e
    if d not in allowed:
      raise TypeError(f"{name}={d} must be one of {[a.name for a in allowed]} (the "
                      f"forward GEMM's two operands are fp8_dtype and cuBLASLt's FP8 GEMM "
                      f"needs an e4m3 operand; the gradient takes e5m2 in "
                      f"TransformerEngine's HYBRID recipe, e4m3 in its E4M3 one)")
    out.append(d)
  return out[0], out[1]


def check_layer_args(scaling: str, amax_history_length: int, fp8_dtype,
                     grad_fp8_dtype, backend: str) -> None:
  """The FP8 layers' constructor checks (NNX and Linen): ValueError / TypeError."""
  if scaling not in SCALINGS:
    raise ValueError(f"{scaling=} must be one of {SCALINGS}")
  _check_history(amax_history_length)
  _check_fp8_dtypes(fp8_dtype, grad_fp8_dtype)
  if backend not in FP8_BACKENDS:
    raise ValueError(f"{backend=} must be one of {FP8_BACKENDS} (the quantising "
                     f"norm's backends)")


def _check_call(x, kernel, scale, ln_bias, bias, state, subtract_mean) -> None:
  op = "norm_dense_fp8"
  if jnp.ndim(kernel) != 2:
    raise ValueError(f"{op}: kernel.shape={jnp.shape(kernel)} must be [in_features, "
                     f"out_features]")
  n, f = jnp.shape(kernel)
  if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != n:
    raise ValueError(f"{op}: x.shape={jnp.shape(x)} must end in in_features={n} "
                     f"(kernel.shape={jnp.shape(kernel)})")
  for name, a in (("x", x), ("kernel", kernel), ("scale", scale), ("ln_bias", ln_bias),
                  ("bias", bias)):
    if a is not None and not jnp.issubdtype(jnp.result_type(a), jnp.floating):
      raise TypeError(f"{op}: {name}.dtype={jnp.result_type(a)} must be a float dtype")
    if a is not None and jnp.result_type(a) in _fp8.FP8_DTYPES:
      raise TypeError(f"{op}: {name}.dtype={jnp.result_type(a)}: the layer quantises its "
                      f"own operands; pass them in float32, bfloat16 or float16")
  for name, a, size in (("scale", scale, n), ("ln_bias", ln_bias, n), ("bias", bias, f)):
    if a is not None and jnp.shape(a) != (size,):
      raise ValueError(f"{op}: {name}.shape={jnp.shape(a)} must be ({size},)")
  if ln_bias is not None and not subtract_mean:
    raise ValueError(f"{op}: ln_bias is LayerNorm's beta; RMSNorm (subtract_mean=False) "
                     f"has none")
  if state is None:
    return
  if not isinstance(state, DelayedScalingState):
    raise TypeError(f"{op}: state must be a DelayedScalingState or None (current "
                    f"scaling), got {type(state).__name__}")
  hist = jnp.shape(state.input_amax_history)
  for name, a in state._asdict().items():
    want = (1,) if name.endswith("_scale") else hist
    if jnp.shape(a) != want or len(hist) != 1 or jnp.result_type(a) != jnp.dtype(_F32):
      raise ValueError(f"{op}: state.{name} is {jnp.result_type(a)}{list(jnp.shape(a))}; "
                       f"the scales must be float32[1] and the histories float32[L], one L")
    if name.endswith("_scale") and not isinstance(a, jax.core.Tracer):
      v = float(jnp.asarray(a)[0])
      if not (math.isfinite(v) and v > 0):  # under jit: _delayed_scale's fallbacks
        raise ValueError(f"{op}: state.{name}={v} must be finite and > 0 (a "
                         f"dequantisation scale; init_delayed_scaling starts them at 1)")


# --------------------------------------------------------------------------- FP8 pieces


def _scaled_dot(a, a_scale, b, b_scale, contract, out_dtype, out_spec=None):
  """``dot_general(a, b)`` of FP8 operands accumulated in float32, times
  ``a_scale * b_scale`` (() float32 each), cast to ``out_dtype``: the pattern XLA's GPU
  gemm rewriter makes one ``__cublas$lt$matmul$f8`` of (the scales become its a/b scale
  operands, the cast its output type). ``contract``: (a's, b's) contracting dims.

  ``out_spec`` (one mesh-axis entry a dim, from ``_gemm_spec``): the output's sharding on an
  Explicit mesh, where JAX asks for it whenever a contracting dim is sharded (the weight
  gradient of a data-parallel batch, a row-parallel kernel) and the custom_vjp's
  cotangents must keep the primals' shardings; ignored elsewhere (Auto meshes and one
  device: XLA's partitioner decides)."""
  kw = {}
  explicit = _spmd._explicit_sharding(a) or _spmd._explicit_sharding(b)
  if explicit is not None and out_spec is not None:
    kw["out_sharding"] = jax.sharding.NamedSharding(explicit[0],
                                                    jax.sharding.PartitionSpec(*out_spec))
  out = jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=_F32, **kw)
  return (out * (a_scale * b_scale)).astype(out_dtype)


def _spec(a) -> tuple:
  """a's PartitionSpec entries, padded with None to its rank (() off a mesh)."""
  spec = tuple(getattr(jax.typeof(a).sharding, "spec", ()) or ())
  return spec + (None,) * (a.ndim - len(spec))


def _gemm_spec(rows: tuple, cols) -> tuple:
  """The [*rows, cols] output spec of a GEMM: the activation's row dims' sharding, and
  the other operand's column sharding unless it uses a mesh axis the rows already do
  (FSDP: a weight sharded over the data axis; the product then keeps only the row
  sharding, XLA gathering the weight as FSDP does)."""
  used = {a for e in rows for a in _spmd._axes(e)}
  return (*rows, None if used & set(_spmd._axes(cols)) else cols)


def _delayed_scale(scale, history, fp8_dtype):
  """Delayed scaling's () scale for this step from the (1,) scale and the amax history
  (flax fp8_ops' ``compute_scale``: max(history) / fp8_max, or the old scale while that
  is not positive and finite), floored at float32's smallest normal 2**-126: below it
  flax's ``1 / (fp8_max / amax)`` is 0 (an amax under about 1.3e-36), and 1 / scale, the
  quantiser's multiplier, inf, which turns exact zeros into NaN. An old scale that is
  not finite or under 2**-126 (a state edited by hand; eager calls raise, _check_call)
  is taken as 1.0, init_delayed_scaling's start."""
  old = scale.reshape(())
  old = jnp.where(jnp.isfinite(old) & (old >= _F32(_TINY)), old, _F32(1.0)).reshape(1)
  amax = jnp.max(history, axis=0)
  s = _flax_fp8.compute_scale(amax, old, _F32(_fp8.fp8_max(fp8_dtype))).reshape(())
  return jnp.maximum(s, _F32(_TINY))


def _push(history, amax):
  """The history with this step's amax pushed in (flax's ``compute_amax_history``)."""
  return _flax_fp8.compute_amax_history(amax, history)


def _quantise_xla(v, inv, fp8_dtype):
  """``pallas_norm.fp8.quantise(v, inv, fp8_dtype)``'s values, for tensors XLA quantises
  (the weight, the output gradient): the clip as ``jnp.clip``, whose XLA maximum and
  minimum keep NaN as quantise's two selects do (+-Inf saturate, -0 stays -0). With the
  selects, XLA built the weight's quantise into transposing fusions (cuBLASLt's FP8 GEMM
  takes the weight K-contiguous) that wrote both comparison masks, [N, F] each, to memory
  and read the weight three times (H100 HLO, docs/fp8_tuning.md#fp8-packed)."""
  hi = _fp8.fp8_max(fp8_dtype)
  return jnp.clip(v * inv, -hi, hi).astype(fp8_dtype)


def _quantise_tensor(v, scale, fp8_dtype):
  """(q, scale, amax) of a float tensor: scale () f32 given (delayed) or None (current:
  this tensor's amax / fp8_max); q = quantise(v * (1 / scale)) (``_quantise_xla``)."""
  vf = v.astype(_F32)
  amax = jnp.max(jnp.abs(vf))
  if scale is None:
    scale = _fp8.current_scale(amax, fp8_dtype)
  return _quantise_xla(vf, _F32(1.0) / scale, fp8_dtype), scale, amax


# --------------------------------------------------------------------------- custom_vjp


def _norm_fp8(st: _Static, x, scale, ln_bias, y_scale, transpose: bool) -> _fp8.Fp8Norm:
  """``rms_norm_fp8`` / ``layer_norm_fp8`` of x [..., N], y_t as [N, *lead] (served for
  every row sharding; the weight-gradient GEMM contracts its row dims)."""
  op = "layer_norm_fp8" if st.subtract_mean else "rms_norm_fp8"
  return _fp8._norm_fp8(op, x, scale, ln_bias, eps=st.eps, y_scale=y_scale, fp8_dtype=st.fp8_dtype,
                        transpose=transpose, scale_offset=st.scale_offset,
                        subtract_mean=st.subtract_mean, mode=None, backend=st.backend,
                        interpret=st.interpret, yt_lead=True)


def _forward(st: _Static, x, scale, ln_bias, kernel, state, transpose: bool):
  """out [..., F] in x's dtype and the residuals (x [..., N], kernel [N, F]). x keeps its
  row dims (no reshape to [M, N]: on a mesh that would move the rows of a sequence-
  parallel x); the GEMMs contract over N, or over the row dims (the weight gradient)."""
  fwd_dt = jnp.dtype(st.fp8_dtype)
  y_scale = k_scale = None
  if state is not None:
    y_scale = _delayed_scale(state.input_scale, state.input_amax_history, fwd_dt)
    k_scale = _delayed_scale(state.kernel_scale, state.kernel_amax_history, fwd_dt)
  norm = _norm_fp8(st, x, scale, ln_bias, y_scale, transpose)  # y [..., N] fp8
  w, k_scale, k_amax = _quantise_tensor(kernel, k_scale, fwd_dt)  # [N, F] fp8
  last = x.ndim - 1
  out = _scaled_dot(norm.y, norm.y_scale, w, k_scale, ((last,), (0,)), x.dtype,  # [..., F]
                    _gemm_spec(_spec(x)[:-1], _spec(kernel)[1]))
  new = None
  if state is not None:  # this step's input and kernel entries of the new state
    new = (norm.y_scale.reshape(1), _push(state.input_amax_history, norm.amax),
           k_scale.reshape(1), _push(state.kernel_amax_history, k_amax))
  res = (x, scale, ln_bias, norm.y_t, norm.y_scale, norm.mean, norm.rstd, w, k_scale,
         state, new)
  return out, res


def _first_order_only(fn):
  """``fn(st, *args)`` as a custom_jvp whose JVP raises a TypeError: differentiating the
  layer's vjp rules again (jax.grad of jax.grad, jax.hessian) would reach the kernels,
  which JAX cannot differentiate, and the FP8 roundings have no useful derivative."""
  @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
  def f(st, *args):
    return fn(st, *args)

  @f.defjvp
  def f_jvp(st, primals, tangents):
    raise TypeError(
        "norm_dense_fp8 (RMSNormDenseFP8 / LayerNormDenseFP8) is differentiable once: "
        "its backward runs FP8 GEMMs and pallas_norm's kernels, which have no derivative "
        "of their own (jax.grad of jax.grad, jax.hessian, jax.jvp of its gradient). "
        "Differentiate the bf16 model (pallas_norm.RMSNorm + a dense layer) for "
        "higher-order derivatives")
  return f


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm_dense(st: _Static, x, scale, ln_bias, kernel, state):
  return _forward(st, x, scale, ln_bias, kernel, state, transpose=False)[0]


def _backward(st: _Static, res, dout):
  x, scale, ln_bias, y_t, y_scale, mean, rstd, w, k_scale, state, new = res
  grad_dt = jnp.dtype(st.grad_fp8_dtype)
  g_scale = None
  if state is not None:
    g_scale = _delayed_scale(state.output_grad_scale, state.output_grad_amax_history,
                             grad_dt)
  g, g_scale, g_amax = _quantise_tensor(dout, g_scale, grad_dt)  # [M, F] fp8
  # dgrad [..., N] with x's sharding (the norm's backward takes dy as x); wgrad [N, F]
  # from y_t [N, *lead] and g [*lead, F] over the row dims, with the kernel's sharding
  # (a cotangent keeps its primal's).
  last, rows = x.ndim - 1, tuple(range(x.ndim - 1))
  dy = _scaled_dot(g, g_scale, w, k_scale, ((last,), (1,)), x.dtype, _spec(x))
  dw = _scaled_dot(y_t, y_scale, g, g_scale, (tuple(r + 1 for r in rows), rows),
                   st.kernel_dtype, _spec(w))
  dx, dscale, dbias = _fp8.norm_backward(
      dy, x, scale, ln_bias, mean, rstd, subtract_mean=st.subtract_mean,
      scale_offset=st.scale_offset, backend=st.backend, interpret=st.interpret)
  new_state = None
  if state is not None:
    new_state = DelayedScalingState(
        *new, g_scale.reshape(1), _push(state.output_grad_amax_history, g_amax))
  return dx, dscale, dbias, dw, new_state


_forward_rule = _first_order_only(functools.partial(_forward, transpose=True))
_backward_rule = _first_order_only(_backward)

_UNDIFFERENTIATED_STATE = (
    "{op}(scaling='delayed') is differentiated without its delayed-scaling state (the "
    "Fp8Meta amax histories and scales are not among the differentiated variables), so "
    "their new values, which the layer returns as their gradient, would never be written "
    "back: the histories would stay empty, every scale 1, and output gradients under "
    "float8_e5m2's smallest subnormal (2^-16) would be flushed to zero. This call runs "
    "current scaling instead. For delayed scaling, differentiate Fp8Meta too and write it "
    "back: nnx.value_and_grad(loss, argnums=nnx.DiffState(0, (nnx.Param, Fp8Meta))) and "
    "optimizer.update(model, update_fp8_meta(model, grads)) (Linen: differentiate the "
    "'_overwrite_with_gradient' collection and keep its gradient as its next value); or "
    "pass scaling='current'.")


def _fwd_rule(st: _Static, *args):
  """custom_vjp's forward with symbolic zeros: each leaf of ``args`` is a
  ``CustomVJPPrimal``. A delayed-scaling state that is not differentiated (``perturbed``
  False: the train step would drop its new value) is set aside for current scaling, with
  a warning (``_UNDIFFERENTIATED_STATE``), at trace time."""
  is_primal = lambda v: isinstance(v, jax.custom_derivatives.CustomVJPPrimal)
  x, scale, ln_bias, kernel, state = jax.tree.map(lambda p: p.value, args,
                                                  is_leaf=is_primal)
  if state is not None and not any(p.perturbed for p in jax.tree.leaves(args[-1],
                                                                        is_leaf=is_primal)):
    op = "LayerNormDenseFP8" if st.subtract_mean else "RMSNormDenseFP8"
    warnings.warn(_UNDIFFERENTIATED_STATE.format(op=op), stacklevel=2)
    state = None
  return _forward_rule(st, x, scale, ln_bias, kernel, state)


def _bwd_rule(st: _Static, res, dout):
  """custom_vjp's backward with symbolic zeros: a SymbolicZero dout (the output unused)
  becomes zeros; a state set aside by ``_fwd_rule`` gets no cotangent (None)."""
  if isinstance(dout, jax.custom_derivatives.SymbolicZero):
    dout = jnp.zeros(dout.aval.shape, dout.aval.dtype)
  return _backward_rule(st, res, dout)


# The vjp rules: the forward with the transposed copy, and the backward, each
# differentiable only once (_first_order_only); symbolic zeros tell the forward whether
# the delayed-scaling state is differentiated (_fwd_rule).
_norm_dense.defvjp(_fwd_rule, _bwd_rule, symbolic_zeros=True)


# --------------------------------------------------------------------------- public op


def norm_dense_fp8(x, kernel, scale=None, ln_bias=None, bias=None, *,
                   subtract_mean: bool = False, eps: float = 1e-6, scale_offset: float = 0.0,
                   state: DelayedScalingState | None = None,
                   fp8_dtype=jnp.float8_e4m3fn, grad_fp8_dtype=jnp.float8_e5m2,
                   backend: str = "pallas",
                   interpret: bool | None = None):
  """``norm(x) @ kernel + bias`` with an FP8 norm output and FP8 GEMMs (module docstring).

  TransformerEngine JAX's ``layernorm_fp8_dot`` (``LayerNormDenseGeneral``'s op) with
  pallas_norm's quantising norm and deterministic backward; the result matches
  ``dense(rms_norm(x))`` / ``dense(layer_norm(x))`` up to FP8 rounding.

  Args:
    x: [..., N] float32, bfloat16 or float16 (the compute dtype: the result's, and the
      dtype of dy the norm's backward receives); M = prod(x.shape[:-1]).
    kernel: [N, F] float, quantised from its own values (not from a cast copy); dW comes
      back in its dtype.
    scale: [N] or None, the norm's gamma (times ``scale_offset + scale``).
    ln_bias: [N] or None, LayerNorm's beta (``subtract_mean=True`` only).
    bias: [F] or None, the dense layer's bias, added after the GEMM in x's dtype.
    subtract_mean: False for RMSNorm (``rms_norm_fp8``), True for LayerNorm.
    eps: added to the mean square (variance) before the square root.
    scale_offset: y = x_hat * (scale_offset + scale) (+ ln_bias).
    state: None for current scaling, or delayed scaling's ``DelayedScalingState``; its
      gradient is the next step's state (flax's overwrite-with-gradient).
    fp8_dtype: the forward operands' FP8 dtype: float8_e4m3fn.
    grad_fp8_dtype: the output gradient's: float8_e5m2 (default, HYBRID) or e4m3fn.
    backend, interpret: pallas_norm.fp8's (backend "pallas" or "xla"; the FP8 norm
      has no ``mode``: its kernels have their own structure).

  Returns:
    [..., F] in x's dtype.

  Raises:
    ValueError: kernel not 2-D, x's last axis not N, param shapes not (N,) / (F,),
      ln_bias with RMSNorm, a malformed state, a bad backend (pallas_norm.fp8's).
    TypeError: non-float arrays, an FP8 dtype not allowed, a state of another type.
  """
  fwd_dt, grad_dt = _check_fp8_dtypes(fp8_dtype, grad_fp8_dtype)
  _check_call(x, kernel, scale, ln_bias, bias, state, subtract_mean)
  _ops._check_real("norm_dense_fp8", "eps", eps, non_negative=True)
  _ops._check_real("norm_dense_fp8", "scale_offset", scale_offset)
  x = jnp.asarray(x)
  n, f = jnp.shape(kernel)
  lead = x.shape[:-1]
  if math.prod(lead) == 0:
    out = jnp.zeros((*lead, f), x.dtype)
  else:
    kernel = jnp.asarray(kernel)
    st = _Static(bool(subtract_mean), float(eps), float(scale_offset), fwd_dt.name,
                 grad_dt.name, kernel.dtype.name, backend, interpret)
    x2 = x.reshape(1, n) if x.ndim == 1 else x   # x keeps its row dims (see _forward)
    out = _norm_dense(st, x2, scale, ln_bias, kernel, state).reshape(*lead, f)
  if bias is not None:
    out = out + bias.astype(out.dtype)
  return out


# --------------------------------------------------------------------------- NNX layers


class Fp8Meta(nnx.Variable):
  """FP8 scaling state (amax histories and scales) whose gradient is its new value.

  NNX's spelling of flax Linen's ``_overwrite_with_gradient`` collection: differentiate
  with ``wrt=(nnx.Param, Fp8Meta)`` and let ``update_fp8_meta`` write the Fp8Meta part
  of the gradients into the model (the optimizer gets the rest).
  """


def update_fp8_meta(model, grads: nnx.State) -> nnx.State:
  """Writes the ``Fp8Meta`` entries of ``grads`` (the new amax histories and scales
  that the FP8 layers' vjp returns as gradients) into ``model``; returns the other
  entries (the params' gradients, for the optimizer).

  The train step of a model with delayed-scaling FP8 layers::

    diff = nnx.DiffState(0, (nnx.Param, Fp8Meta))
    loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model, batch)
    optimizer.update(model, update_fp8_meta(model, grads))

  A model without Fp8Meta variables (current scaling) is left as it is.
  """
  meta, rest = nnx.split_state(grads, Fp8Meta, ...)
  nnx.update(model, meta)
  return rest


def _param(init, rngs: nnx.Rngs, shape, param_dtype, use: bool = True):
  """A Param drawing one ``rngs.params()`` key, or None (no draw) when not used."""
  if not use:
    return nnx.data(None)
  return nnx.Param(init(rngs.params(), shape, param_dtype))


class _NormDenseFP8(nnx.Module):
  """The parameters, state and call that RMSNormDenseFP8 and LayerNormDenseFP8 share."""

  subtract_mean: bool = False

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      epsilon: float = 1e-6,
      use_scale: bool = True,
      scale_init: nnx.Initializer = nnx.initializers.ones,
      scale_offset: float = 0.0,
      use_ln_bias: bool = False,
      ln_bias_init: nnx.Initializer = nnx.initializers.zeros,
      use_bias: bool = True,
      kernel_init: nnx.Initializer = default_kernel_init,
      bias_init: nnx.Initializer = nnx.initializers.zeros,
      dtype: tp.Any | None = None,
      param_dtype: tp.Any = jnp.float32,
      scaling: str = "delayed",
      amax_history_length: int = 1024,
      fp8_dtype: tp.Any = jnp.float8_e4m3fn,
      grad_fp8_dtype: tp.Any = jnp.float8_e5m2,
      backend: str = "pallas",
      rngs: nnx.Rngs,
  ):
    check_layer_args(scaling, amax_history_length, fp8_dtype, grad_fp8_dtype, backend)
    _flax_args.check_config(type(self).__name__,
                            features=dict(in_features=in_features, out_features=out_features),
                            epsilon=epsilon, scale_offset=scale_offset)
    self.scale = _param(scale_init, rngs, (in_features,), param_dtype, use_scale)
    self.ln_bias = _param(ln_bias_init, rngs, (in_features,), param_dtype, use_ln_bias)
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features),
                                        param_dtype))
    self.bias = _param(bias_init, rngs, (out_features,), param_dtype, use_bias)
    if scaling == "delayed":
      for name, v in init_delayed_scaling(amax_history_length)._asdict().items():
        setattr(self, name, Fp8Meta(v))
    self.in_features, self.out_features = in_features, out_features
    self.epsilon, self.scale_offset = epsilon, scale_offset
    self.dtype, self.param_dtype = dtype, param_dtype
    self.scaling, self.amax_history_length = scaling, amax_history_length
    self.fp8_dtype, self.grad_fp8_dtype = fp8_dtype, grad_fp8_dtype
    self.backend = backend

  def __call__(self, x):
    """``x: [..., in_features]`` -> ``[..., out_features]`` in ``dtype`` (default: the
    result type of x and the params, as flax's layers)."""
    params = [None if p is None else p[...]
              for p in (self.scale, self.ln_bias, self.kernel, self.bias)]
    scale, ln_bias, kernel, bias = params
    dtype = self.dtype or jnp.result_type(x, *(p for p in params if p is not None))
    state = None
    if self.scaling == "delayed":
      state = DelayedScalingState(*(getattr(self, k)[...]
                                    for k in DelayedScalingState._fields))
    return norm_dense_fp8(jnp.asarray(x, dtype), kernel, scale, ln_bias, bias,
                          subtract_mean=self.subtract_mean, eps=float(self.epsilon),
                          scale_offset=float(self.scale_offset), state=state,
                          fp8_dtype=self.fp8_dtype, grad_fp8_dtype=self.grad_fp8_dtype,
                          backend=self.backend)


_ARGS_DOC = """
  Args:
    in_features: N, the normalised (and contracted) axis.
    out_features: F.
    epsilon: added to the mean square (LayerNorm: the variance) (default 1e-6, flax's).
    use_scale: multiply by ``scale_offset + scale`` (default True); param ``scale`` [N].
    scale_init: initializer for scale (default: ones).
    scale_offset: y = x_hat * (scale_offset + scale) (default 0.0; 1.0 with zeros
      scale_init for Gemma's zero-centred gamma).
    use_bias: add the dense bias (default True, as nnx.Linear); param ``bias`` [F].
    kernel_init: initializer for ``kernel`` [N, F] (default: nnx.Linear's lecun_normal);
      wrap it in ``nnx.with_partitioning(init, spec)`` to shard the kernel (column or
      row parallel, FSDP; docs/fp8.md).
    bias_init: initializer for bias (default: zeros).
    dtype: the compute and result dtype (default None: the result type of x and the
      params, as flax; pass jnp.bfloat16 for a bf16 model).
    param_dtype: the params' dtype (default float32); W is quantised from it.
    scaling: "delayed" (default; TransformerEngine's and flax's recipe: Fp8Meta state) or
      "current" (no state).
    amax_history_length: delayed scaling's history length (default 1024, as
      TransformerEngine and flax).
    fp8_dtype: the forward operands' FP8 dtype (default float8_e4m3fn, the only one).
    grad_fp8_dtype: the output gradient's (default float8_e5m2: HYBRID; or e4m3fn).
    backend: passed to pallas_norm.fp8: "pallas" (default) or "xla" (its jnp chain).
    rngs: rng key; keys are drawn for scale, ln_bias, kernel, bias in that order (a
      param that is not used draws none).

  Delayed-scaling variables (``Fp8Meta``, flax Fp8DotGeneral's names): input_scale,
  kernel_scale, output_grad_scale [1] f32 (ones) and input_amax_history,
  kernel_amax_history, output_grad_amax_history [amax_history_length] f32 (zeros). The
  train step differentiates them too and writes their gradients back with
  ``update_fp8_meta`` (module docstring).

  Raises:
    ValueError: an unknown scaling or backend, amax_history_length < 1; at call time x's
      last axis not in_features.
    TypeError: an FP8 dtype other than the allowed ones.
"""


class RMSNormDenseFP8(_NormDenseFP8):
  """RMSNorm (https://arxiv.org/abs/1910.07467) then a dense layer, in FP8.

  ``dense(rms_norm(x))`` as one fused block: pallas_norm's quantising RMSNorm writes the
  FP8 activation (and its transpose for the weight gradient) and the projection runs as
  FP8 GEMMs, forward and backward (``norm_dense_fp8``; TransformerEngine's
  ``LayerNormDenseGeneral(layernorm_type="rmsnorm")``). It replaces an
  ``nnx.RMSNorm`` followed by ``nnx.Linear``: params ``scale`` [N] (the norm's) and
  ``kernel`` [N, F], ``bias`` [F] (the Linear's).

  Example usage::

    >>> from flax import nnx
    >>> import jax, jax.numpy as jnp
    >>> import flax_layers

    >>> layer = flax_layers.RMSNormDenseFP8(8, 4, scaling="current", backend="xla",
    ...                                     rngs=nnx.Rngs(0))
    >>> y = layer(jnp.ones((2, 8)))
    >>> y.shape, y.dtype
    ((2, 4), dtype('float32'))
"""

  def __init__(self, in_features: int, out_features: int, **kwargs):
    if "use_ln_bias" in kwargs:
      raise TypeError("RMSNormDenseFP8 has no ln_bias (RMSNorm has no beta); use "
                      "LayerNormDenseFP8")
    super().__init__(in_features, out_features, **kwargs)


class LayerNormDenseFP8(_NormDenseFP8):
  """LayerNorm (https://arxiv.org/abs/1607.06450) then a dense layer, in FP8.

  As ``RMSNormDenseFP8`` with LayerNorm (``layer_norm_fp8``; TransformerEngine's
  ``LayerNormDenseGeneral``), plus ``use_ln_bias`` (default True): LayerNorm's beta,
  param ``ln_bias`` [N] (TransformerEngine's name), initialised by ``ln_bias_init``
  (default zeros).
"""

  subtract_mean = True

  def __init__(self, in_features: int, out_features: int, *, use_ln_bias: bool = True,
               **kwargs):
    super().__init__(in_features, out_features, use_ln_bias=use_ln_bias, **kwargs)


def _document(cls, drop=(), defaults=None):
  """The class docstring with the shared argument list appended (a string expression in
  the class body is not its docstring), and ``__init__``'s signature as the base's, so
  that help() and inspect.signature show every argument, not ``**kwargs``."""
  cls.__doc__ += _ARGS_DOC
  sig = inspect.signature(_NormDenseFP8.__init__)
  params = [p.replace(default=(defaults or {}).get(p.name, p.default))
            for p in sig.parameters.values() if p.name not in drop]
  cls.__init__.__signature__ = sig.replace(parameters=params)


_document(RMSNormDenseFP8, drop=("use_ln_bias", "ln_bias_init"))
_document(LayerNormDenseFP8, defaults={"use_ln_bias": True})


# --------------------------------------------------------------------------- HLO check


_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_GEMM_FUSION = re.compile(r'"kind":"(__triton_gemm|__triton_nested_gemm_fusion|__cudnn\$fusion)"')
_F8_OPERAND = re.compile(r"\bf8e\w*\[")


def gemm_calls_in(hlo_text: str) -> collections.Counter:
  """A Counter of the GEMMs in compiled (GPU) HLO text, by how XLA runs them: cuBLAS
  custom-call targets (``__cublas$lt$matmul$f8`` is cuBLASLt's FP8 GEMM;
  ``__cublas$gemm`` / ``__cublas$lt$matmul`` float ones) and GEMM fusions XLA
  generates itself (``__triton_gemm``, ...), suffixed ``[f8]`` when an operand is FP8.
  Empty for a CPU program."""
  calls = collections.Counter()
  for line in hlo_text.splitlines():
    if "custom-call(" in line and (m := _TARGET.search(line)) and "cublas" in m.group(1):
      calls[m.group(1)] += 1
    elif " fusion(" in line and (m := _GEMM_FUSION.search(line)):
      calls[m.group(1) + ("[f8]" if _F8_OPERAND.search(line) else "")] += 1
  return calls


def fp8_gemm_count(calls: collections.Counter) -> int:
  """How many of ``gemm_calls_in``'s GEMMs take FP8 operands."""
  return calls[FP8_GEMM_TARGET] + sum(v for k, v in calls.items() if k.endswith("[f8]"))


def fp8_gemm_calls(fn, *args) -> collections.Counter:
  """``gemm_calls_in`` of the compiled ``jax.jit(fn)(*args)``."""
  return gemm_calls_in(jax.jit(fn).lower(*args).compile().as_text())


def report_fp8_gemms(m: int = 8192, n: int = 4096, f: int = 4096) -> bool:
  """Compiles the gradient of ``RMSNormDenseFP8(n, f)`` (bf16, delayed scaling) at
  x [m, n] on the default device, prints its GEMMs by kind (``gemm_calls_in``) and
  returns whether all three (forward, dgrad, wgrad) are FP8 GEMMs and there is no
  other: ``python -c "from flax_layers import fp8; fp8.report_fp8_gemms()"``."""
  layer = RMSNormDenseFP8(n, f, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  graphdef, params, meta = nnx.split(layer, nnx.Param, Fp8Meta)
  x = jax.random.normal(jax.random.key(0), (m, n), jnp.bfloat16)

  def loss(params, meta, x):
    return jnp.sum(nnx.merge(graphdef, params, meta)(x).astype(_F32) ** 2)

  calls = fp8_gemm_calls(jax.grad(loss, argnums=(0, 1)), params, meta, x)
  fp8 = fp8_gemm_count(calls)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}: RMSNormDenseFP8 "
        f"[{m}, {n}] @ [{n}, {f}], gradient: GEMMs {dict(calls)}")
  print(f"FP8 GEMMs: {fp8} of 3 (forward, dgrad, wgrad), {calls[FP8_GEMM_TARGET]} of them "
        f"{FP8_GEMM_TARGET}; other GEMMs: {sum(calls.values()) - fp8}")
  return fp8 == 3 and sum(calls.values()) == 3
