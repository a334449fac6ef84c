"""jax.export of the ops (docs/usage.md, "Saving a program: jax.export")."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_norm

TRITON_TARGET = "__gpu$xla.gpu.triton"  # the target docs/usage.md names


def _inputs():
  x = jax.random.normal(jax.random.key(0), (64, 256), jnp.bfloat16)
  return x, jnp.linspace(0.5, 1.5, 256, dtype=jnp.float32)


def test_export_without_gpu_runs_the_interpreted_program():
  """Interpret mode and backend="xla" lower to plain HLO: exported with JAX's default
  checks, and the exported call gives the jitted function's bits."""
  x, s = _inputs()
  for backend in ("pallas", "xla"):
    f = jax.jit(lambda x, s, b=backend: pallas_norm.rms_norm(x, s, backend=b, interpret=True))
    exported = export.export(f)(x, s)
    np.testing.assert_array_equal(np.asarray(exported.call(x, s), np.float32),
                                  np.asarray(f(x, s), np.float32))


@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm", "rms_norm_fp8"])
def test_symbolic_batch_dimension(fn):
  """Shape polymorphism: the kernels' configs come from concrete shapes, so a symbolic
  dimension is a clear NotImplementedError naming backend='xla', which exports it."""
  op = getattr(pallas_norm, fn)
  spec = jax.ShapeDtypeStruct(export.symbolic_shape("b, 128"), jnp.float32)
  with pytest.raises(NotImplementedError, match="symbolic dimension.*backend='xla'"):
    export.export(jax.jit(lambda x: op(x, jnp.ones(128))))(spec)
  if fn != "rms_norm_fp8":
    exported = export.export(jax.jit(lambda x: op(x, jnp.ones(128), backend="xla")))(spec)
    x = jnp.linspace(-1, 1, 3 * 128, dtype=jnp.float32).reshape(3, 128)
    # (compiled with a symbolic batch, XLA may fuse the reductions another way: on an
    # H100 LayerNorm's outputs differed by up to 3.3e-7 from the concrete program's)
    np.testing.assert_allclose(np.asarray(exported.call(x)),
                               np.asarray(op(x, jnp.ones(128), backend="xla")),
                               rtol=1e-5, atol=1e-6)


def test_serialised_round_trip():
  """docs/usage.md's serialize() / deserialize() (flatbuffers, the "export" and "test"
  extras): the deserialised call gives the jitted function's bits, forward and grad.
  (Skipped only where flatbuffers is not installed: the GPU machine's own Python.)"""
  pytest.importorskip("flatbuffers", reason="jax.export's serialize() needs flatbuffers")
  x, s = _inputs()
  loss = lambda x, s: pallas_norm.rms_norm(x, s, interpret=True).astype(jnp.float32).sum()
  for f in (jax.jit(lambda x, s: pallas_norm.rms_norm(x, s, interpret=True)),
            jax.jit(jax.grad(loss, argnums=(0, 1)))):
    blob = export.export(f)(x, s).serialize()
    got = export.deserialize(blob).call(x, s)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(f(x, s))):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("what", ["forward", "grad"])
def test_export_for_cuda_needs_the_triton_check_disabled(what):
  """The compiled kernels (lowered for CUDA here, without a GPU) are the custom call the
  docs name: JAX's plain export refuses it, and disabling the check for that one target
  exports the program, the kernels inside it."""
  x, s = _inputs()
  loss = lambda x, s: pallas_norm.rms_norm(x, s, interpret=False)
  if what == "grad":
    loss = jax.grad(lambda x, s: pallas_norm.rms_norm(x, s, interpret=False)
                    .astype(jnp.float32).sum(), argnums=(0, 1))
  f = jax.jit(loss)
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
    export.export(f, platforms=("cuda",))(x, s)
  exported = export.export(f, platforms=("cuda",), disabled_checks=[
      export.DisabledSafetyCheck.custom_call(TRITON_TARGET)])(x, s)
  assert exported.platforms == ("cuda",)
  assert f"custom_call @{TRITON_TARGET}" in exported.mlir_module()
