"""QK-norm from a packed q|k|v projection: ``pallas_norm.qk_norm``.

Qwen3, Gemma 3 and OLMo 2 normalise each query and key head over head_dim (RMSNorm)
before attention. With a packed projection, ``qkv = x @ w_qkv`` reshaped to
[..., H + 2K, head_dim] (H query heads, K key/value heads), the norms take slices
``qkv[..., :H, :]`` and ``qkv[..., H:H + K, :]``. A custom call needs its operand
contiguous, so each slice is a copy kernel before a norm kernel: four launches a layer,
a cost of its own in a decode step (a few tokens, every kernel latency-bound;
docs/performance.md#few-rows). ``qk_norm`` reads both head ranges of qkv in place, one
multi_wave_cached launch each (``norm_forward``'s ``x_rows``): two launches, no copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_norm import config as _config
from pallas_norm import ops as _ops
from pallas_norm import tuning as _tuning

__all__ = ["qk_norm"]

_OP = "qk_norm"


def qk_norm(qkv, q_scale, k_scale, *, num_heads: int, num_kv_heads: int, eps=None,
            scale_offset=0.0, cast="torch", param_cast=None, backend="pallas",
            interpret=None):
  """RMSNorm of the query and the key heads of a packed q|k|v projection, read in place:
  ``(rms_norm(qkv[..., :H, :], q_scale), rms_norm(qkv[..., H:H + K, :], k_scale))``
  with the same arguments, bit for bit, without the slices' copies (Qwen3's and Gemma 3's
  QK-norm; vLLM fuses the same pair, with RoPE, in ``fused_qk_norm_rope``).

  Args:
    qkv: [..., P, D] float32, bfloat16 or float16, rank >= 2: each token's P >= H + K
      heads of D = head_dim, the H query heads first, then the K key heads (the value
      heads, or anything else, after them are not read).
    q_scale, k_scale: [D] float arrays: the query and the key norm's scale.
    num_heads: H >= 1, the query heads.
    num_kv_heads: K >= 1, the key heads.
    eps, scale_offset, cast, param_cast: as in ``pallas_norm.rms_norm`` (cast
      "gemma": Gemma 3's ``1 + scale``).
    backend: "pallas" (default) or "xla" (the two slices and ``rms_norm(...,
      backend="xla")``).
    interpret: None runs Pallas interpret mode when there is no GPU; True/False force it.

  Returns:
    (q [..., H, D], k [..., K, D]) in qkv's dtype (cast="llama": rms_norm's dtype).
    Differentiable in qkv and both scales (custom_vjp: the backward is the two slices'
    rms_norm backward, which recomputes their forward: a training step pays two norm
    kernels more than the slices would; qk_norm is made for inference).

  The one-pass path is taken on the Pallas backend with cast "torch" or "gemma", on a
  single device (``jax.device_count() == 1``: under several devices qkv may be sharded
  over its heads, which the head ranges cannot follow, and ``rms_norm`` serves sharded
  arrays without a gather) and concrete shapes; otherwise the slices and ``rms_norm``
  (the same values).

  Raises:
    TypeError: qkv, q_scale or k_scale not a float array (as ``rms_norm``); num_heads or
      num_kv_heads not an int.
    ValueError: qkv of rank < 2, num_heads or num_kv_heads < 1, P < H + K, a scale of a
      shape other than (D,), or what ``rms_norm`` refuses (eps < 0, an unknown cast or
      backend, cast="gemma" with scale_offset other than 0 or 1).
  """
  for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
    if not isinstance(v, int) or isinstance(v, bool):
      raise TypeError(f"{_OP}: {name} must be an int, got {v!r}")
    if v < 1:
      raise ValueError(f"{_OP}: {name} must be >= 1, got {v}")
  _ops._check_array(_OP, "qkv", qkv)
  qkv = jnp.asarray(qkv)
  if qkv.ndim < 2:
    raise ValueError(f"{_OP}: qkv must be [..., P, head_dim] (rank >= 2), got shape "
                     f"{qkv.shape}")
  p, d = qkv.shape[-2:]
  h, k = num_heads, num_kv_heads
  if isinstance(p, int) and p < h + k:
    raise ValueError(f"{_OP}: qkv has {p} heads on axis -2, fewer than num_heads + "
                     f"num_kv_heads = {h} + {k}")
  for name, s in (("q_scale", q_scale), ("k_scale", k_scale)):
    _ops._check_array(_OP, name, s)
    if jnp.shape(s) != (d,):
      raise ValueError(f"{_OP}: {name} must have shape ({d},) (head_dim), got "
                       f"{jnp.shape(s)}")
  if eps is None:
    eps = float(jnp.finfo(jnp.float32).eps)
  # rms_norm's checks (dtypes, eps, backend, cast, param_cast), before any kernel
  _ops._check_args(_OP, qkv, q_scale, None, eps, None, backend)
  _ops._check_args(_OP, qkv, k_scale, None, eps, None, backend)
  scale_offset = _ops._check_cast(_OP, cast, q_scale, scale_offset)
  q_scale, _, q_cast = _ops._param_cast(_OP, q_scale, None, param_cast, backend, None, cast)
  k_scale, _, k_cast = _ops._param_cast(_OP, k_scale, None, param_cast, backend, None, cast)
  st = _QkStatic(h, k, float(eps), float(scale_offset), cast,
                 None if param_cast is None else jnp.dtype(param_cast).name, q_cast, k_cast,
                 _ops._resolve_interpret(interpret, _OP), backend, _tuning.context())
  shape_ok = all(isinstance(v, int) for v in qkv.shape) and math.prod(qkv.shape[:-2]) > 0
  if (backend != "pallas" or cast not in ("torch", "gemma") or not shape_ok
      or jax.device_count() != 1):
    return _slices(qkv, q_scale, k_scale, st)
  return _qk_jit(qkv, jnp.asarray(q_scale), jnp.asarray(k_scale), st)


@dataclasses.dataclass(frozen=True)
class _QkStatic:
  """qk_norm's static arguments (hashable: the jitted body is traced once per value)."""

  h: int
  k: int
  eps: float
  scale_offset: float
  cast: str
  param_cast: str | None  # the caller's, for the slices' rms_norm
  q_cast: str | None  # the kernels' in-load rounding of q_scale / k_scale (ops._param_cast)
  k_cast: str | None
  interpret: bool
  backend: str
  tables: tuple = ()  # the tuning tables' context (configs are chosen at trace time)


def _slices(qkv, q_scale, k_scale, st: _QkStatic):
  """The two slices' rms_norm: the fallback and the backward."""
  norm = functools.partial(_ops.rms_norm, eps=st.eps, scale_offset=st.scale_offset,
                           cast=st.cast, param_cast=st.param_cast, backend=st.backend,
                           interpret=st.interpret)
  return (norm(qkv[..., :st.h, :], q_scale),
          norm(qkv[..., st.h:st.h + st.k, :], k_scale))


def _kernels(qkv, q_scale, k_scale, st: _QkStatic):
  """(q, k): one multi_wave_cached launch a head range, qkv read in place."""
  from pallas_norm.kernels import forward
  lead, (p, d) = qkv.shape[:-2], qkv.shape[-2:]
  tokens = math.prod(lead)
  x2 = qkv.reshape(tokens * p, d)
  outs = []
  for scale, offset, heads, pc in ((q_scale, 0, st.h, st.q_cast),
                                   (k_scale, st.h, st.k, st.k_cast)):
    m = tokens * heads
    cfg = _config.forward_config(m, d, qkv.dtype, "multi_wave_cached",
                                 param_dtype=jnp.dtype(pc) if pc else scale.dtype,
                                 return_residuals=False)
    ctx = forward.params_cast_to(pc) if pc else contextlib.nullcontext()
    with ctx:
      y, _, _ = forward.norm_forward(x2, scale, None, eps=st.eps,
                                     scale_offset=st.scale_offset, subtract_mean=False,
                                     config=cfg, interpret=st.interpret,
                                     return_residuals=False,
                                     x_rows=(heads, p, offset, m))
    outs.append(y.reshape(*lead, heads, d))
  return tuple(outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _qk(qkv, q_scale, k_scale, st):
  return _kernels(qkv, q_scale, k_scale, st)


def _qk_fwd(qkv, q_scale, k_scale, st):
  return _kernels(qkv, q_scale, k_scale, st), (qkv, q_scale, k_scale)


def _qk_bwd(st, res, cts):
  _, pull = jax.vjp(lambda a, qs, ks: _slices(a, qs, ks, st), *res)
  return pull(cts)


_qk.defvjp(_qk_fwd, _qk_bwd)
_qk_jit = jax.jit(_qk, static_argnums=(3,))
