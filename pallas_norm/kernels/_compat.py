"""Workarounds for JAX's Pallas Triton lowering, the kernels' output types, and the
Pallas Mosaic GPU API across jax 0.10-0.12.

``out_struct(shape, dtype, like)`` / ``varying_axes`` / ``to_varying``: inside a
``jax.shard_map`` with ``check_vma=True`` (its default) every value's type names the
mesh axes it varies over, and a ``pallas_call`` needs that type on each output
(``jax.ShapeDtypeStruct(..., manual_axis_type=)``; older JAX: ``vma=``). The kernels
type each output like their main input; ``ops`` first brings x, scale and bias to the
same varying axes (``to_varying``, whose transpose is the ``psum`` that gives dscale
of a replicated scale). jax-triton types its outputs as invariant, so the Triton
launches are re-typed with ``to_varying`` after the call. Outside such a shard_map
nothing varies and these are plain ShapeDtypeStructs.

``stream_cache_modifier()``: the cache modifier of the kernels' x and dy loads, data
read from HBM for one row block and not reused by the program's SM.

``ld.global.cg`` caches a load in L2 only, not in L1. XLA launches Pallas kernels
preferring shared memory (docs/performance.md, "The two backends"), which leaves about 23 KB of
each SM's L1 to the loads; with ``.cg`` the streamed x and dy no longer pass through
it, and scale/bias (read by every row) stay there. H200, 2026-11-22, bf16 forward,
default configs, CUPTI over rotated inputs (``python -m pallas_norm.bench ab fwd``;
benchmarks/results/h200_2026-11-22_load_cg.txt): RMSNorm 8192^2 70.1 us against 72.2,
16384^2 270.3 / 276.1, 8192 x 5120 44.0 / 44.7; LayerNorm 8192 x 5120 46.8 / 47.7,
16384^2 288.1 / 295.5.

``pallas.triton.load(..., cache_modifier=".cg")`` is what asks for it, and JAX's
lowering accepts only ".ca" and ".cg" there but then looks the string up in a table
keyed "ca", "cg", ... (jax 0.10.2 and 0.11.2: ``KeyError: '.cg'``). This module adds the
dotted spellings to that table, then checks by lowering a one-load kernel for CUDA
(which works on a CPU-only machine too). If the table is not there, or the lowering
still fails, the kernels load without a cache modifier (``None``): slower on the GPU,
same results.

Mosaic GPU (``kernels/mosaic_*.py``, issue #29): ``mosaic_interpret_params()`` (the
interpreter's parameters; its module is private, jax >= 0.10), ``mosaic_kernel_kwargs()``
(``plgpu.kernel``'s ``out_type`` / ``scratch_types``, ``out_shape`` / ``scratch_shapes``
in older JAX) and ``mosaic_lane_semantics()`` (Lane lowering semantics, no longer the
default from jax 0.11).
"""

from __future__ import annotations

import functools
import inspect

import jax

_CG = ".cg"


def _lowers(cache_modifier: str) -> bool:
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  def kernel(x_ref, o_ref):
    o_ref[...] = plgpu.load(x_ref, cache_modifier=cache_modifier)

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                        compiler_params=plgpu.CompilerParams(num_warps=1))
  try:
    jax.jit(call).trace(jax.ShapeDtypeStruct((16,), jnp.float32)).lower(
        lowering_platforms=("cuda",))
  except Exception:  # noqa: BLE001 (any failure means: do not use it)
    return False
  return True


@functools.cache
def stream_cache_modifier() -> str | None:
  """".cg" where JAX's Pallas Triton lowering can lower it (after the fix above), else
  None. Computed once a process, at the first kernel trace."""
  if _lowers(_CG):
    return _CG
  try:
    from jax._src.pallas.triton import lowering
    table = lowering._STR_TO_CACHE_MODIFIER  # noqa: SLF001 (the fix needs it)
  except (ImportError, AttributeError):
    return None
  if not isinstance(table, dict) or "cg" not in table:
    return None
  for key, value in list(table.items()):
    if not key.startswith("."):
      table.setdefault("." + key, value)
  return _CG if _lowers(_CG) else None


# --------------------------------------------------------------------------- check_vma


def varying_axes(a) -> frozenset:
  """The mesh axes that ``a`` varies over, by its type (inside a ``jax.shard_map`` with
  ``check_vma=True``); empty elsewhere."""
  t = jax.typeof(a)
  mat = getattr(t, "mat", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(t, "vma", None) or ())


@functools.cache
def _struct_params() -> frozenset:
  return frozenset(inspect.signature(jax.ShapeDtypeStruct).parameters)


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """``jax.ShapeDtypeStruct(shape, dtype)`` for a pallas_call output that varies over
  the mesh axes ``like`` varies over."""
  mat = getattr(jax.typeof(like), "mat", None)
  if mat is not None and "manual_axis_type" in _struct_params():
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(mat)(varying=mat.varying))
  if "vma" in _struct_params():
    return jax.ShapeDtypeStruct(shape, dtype, vma=varying_axes(like))
  return jax.ShapeDtypeStruct(shape, dtype)


def to_varying(a, axes):
  """``a`` typed to vary over ``axes`` too (``jax.lax.pcast``; a no-op on the values).
  None stays None."""
  if a is None:
    return None
  missing = tuple(sorted(frozenset(axes) - varying_axes(a)))
  if not missing:
    return a
  pcast = getattr(jax.lax, "pcast", None)
  if pcast is not None:
    return pcast(a, missing, to="varying")
  return jax.lax.pvary(a, missing)


def mosaic_interpret_params():
  """InterpretGPUParams for JAX's Mosaic GPU interpreter: out-of-bounds reads give
  zeros (TMA's zero fill), as do uninitialised buffers. Raises NotImplementedError
  where this JAX has no such interpreter."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError as e:  # pragma: no cover (jax < 0.10)
    raise NotImplementedError(
        "backend='mosaic' in interpret mode needs JAX's Mosaic GPU interpreter "
        "(jax._src.pallas.mosaic_gpu.interpret, jax >= 0.10)") from e
  return InterpretGPUParams(out_of_bounds_reads="uninitialized",
                            uninitialized_memory="zero")


@functools.cache
def mosaic_kernel_kwargs() -> tuple[str, str]:
  """plgpu.kernel's names for the output and scratch types (``out_type`` /
  ``scratch_types``; ``out_shape`` / ``scratch_shapes`` in older JAX)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  params = inspect.signature(plgpu.kernel).parameters
  if "out_type" in params:
    return "out_type", "scratch_types"
  return "out_shape", "scratch_shapes"


def mosaic_lane_semantics():
  """CompilerParams with Lane lowering semantics: jax 0.11 made Warpgroup the default,
  whose layout inference fails on these kernels ("A satisfiable system should not have
  remaining unsatisfied constraints", H200, jax 0.11.2, even at 100x1024); 0.10's
  default was Lane (git diff jax-v0.10.2 jax-v0.11.0 --
  jax/_src/pallas/mosaic_gpu/core.py). The kernels give their register layouts
  themselves (``mosaic_backward._Layouts``)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
