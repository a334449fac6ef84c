"""One process of tests/multihost: every public op family on a global mesh of 8 devices.

Run by tests/multihost/test_multihost.py, never by pytest itself:

    python tests/multihost/_worker.py --out DIR [--coordinator HOST:PORT
        --num-processes 2 --process-id I]

With the jax.distributed flags it is one of 2 processes of 4 fake CPU devices each (gloo
collectives); without them, the single-process run of 8 devices that the test compares
with. Either way the global mesh has 8 devices, every case's global inputs are the same
numpy arrays (each process feeds its addressable shards, ``make_array_from_callback``),
and each case's jitted step runs twice. The process writes ``DIR/p{I}of{K}.npz``: for each
case and output, the whole global array (``process_allgather``) of both runs, float32;
the single-process run also writes ``ref``: the same computation with ``backend="xla"``
(the jnp reference), unsharded (but for the shard_map cases). ``meta``: which processes each
mesh axis spans.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_norm import distributed

NDEV = 8
SHAPE = (8, 16, 256)  # x [B, S, N]: every layout below divides it

# name -> (mesh shape, axis names, spec of x [B, S, N]). One-axis meshes run over all 8
# devices, so their collectives cross the two processes; dp_tp is the usual layout across
# hosts: "data" over the processes, "model" over each process's own devices.
LAYOUTS = {
    "dp": ((NDEV,), ("data",), P("data", None, None)),
    "sp": ((NDEV,), ("seq",), P(None, "seq", None)),
    "tp": ((NDEV,), ("model",), P(None, None, "model")),
    "dp_tp": ((2, NDEV // 2), ("data", "model"), P("data", None, "model")),
}
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
_EPS_RMS = float(jnp.finfo(jnp.float32).eps)


@dataclasses.dataclass(frozen=True)
class Case:
  """One check: ``build(mesh, spec, backend)`` -> (f, inputs).

  f(*inputs) returns a tuple of arrays (outputs, then gradients); inputs is a list of
  (numpy array, PartitionSpec). ``single_tol`` / ``ref_tol``: the largest |difference|
  from the 1-process run / from backend="xla", relative to the output's largest
  magnitude (float32 outputs: 1e-6, a few ulps; bf16 outputs: one bf16 ulp, 2**-8);
  ``fp8``: outputs that are FP8 values.
  """

  name: str
  family: str
  layout: str
  axis_type: str
  build: object
  outputs: tuple[str, ...]
  ref_tol: float = 2e-5
  single_tol: float = 1e-6
  fp8: tuple[str, ...] = ()


def _data(shape, seed, *, dtype=np.float32, loc=0.5, std=2.0):
  return (np.random.default_rng(seed).normal(size=shape) * std + loc).astype(dtype)


def _vjp_step(f, n_in, dy):
  """(*inputs) -> (outputs..., grads of the first n_in inputs) with cotangent dy."""
  def step(*args):
    y, pull = jax.vjp(lambda *a: f(*a, *args[n_in:]), *args[:n_in])
    return (*(y if isinstance(y, tuple) else (y,)), *pull(dy))
  return step


def _norm(op, dtype=np.float32, cast="torch"):
  """rms_norm / layer_norm (fwd + vjp): y, dx, dscale, dbias."""
  def build(mesh, spec, backend):
    import pallas_norm
    x, dy = _data(SHAPE, 1).astype(dtype), _data(SHAPE, 2, loc=0.0, std=1.0).astype(dtype)
    if cast == "llama":  # llama: y in the promoted dtype, float32 for float32 params
      dy = dy.astype(np.float32)
    w, b = 1 + 0.1 * _data(SHAPE[-1:], 3, loc=0.0, std=1.0), 0.1 * _data(SHAPE[-1:], 4)
    if op == "rms":
      f = lambda x, w, b: pallas_norm.rms_norm(x, w, cast=cast, backend=backend)
    else:
      f = lambda x, w, b: pallas_norm.layer_norm(x, w, b, cast=cast, backend=backend)
    hidden = P(spec[-1])
    return _vjp_step(f, 3, dy), [(x, spec), (w, hidden), (b, hidden)]
  return build


def _residual(op):
  """The fused residual add: y, h, dx, dresidual, dscale, dbias (bf16 x, f32 stream)."""
  def build(mesh, spec, backend):
    import pallas_norm
    x = jnp.asarray(_data(SHAPE, 5), jnp.bfloat16)
    r = _data(SHAPE, 6)
    dy, dh = (jnp.asarray(_data(SHAPE, 7, loc=0.0), jnp.bfloat16),
              _data(SHAPE, 8, loc=0.0))
    w, b = 1 + 0.1 * _data(SHAPE[-1:], 9, loc=0.0, std=1.0), 0.1 * _data(SHAPE[-1:], 10)
    fn = pallas_norm.rms_norm if op == "rms" else pallas_norm.layer_norm
    extra = (lambda b: ()) if op == "rms" else (lambda b: (b,))
    f = lambda x, r, w, b: fn(x, w, *extra(b), residual=r, backend=backend)
    hidden = P(spec[-1])
    return (_vjp_step(f, 4, (dy, jnp.asarray(dh))),
            [(np.asarray(x), spec), (r, spec), (w, hidden), (b, hidden)])
  return build


def _fp8_output(op, *, delayed):
  """rms_norm_fp8 / layer_norm_fp8 with transpose: y, y_scale, amax, y_t, rstd. The
  largest |x| sits on the last device's rows and columns: the amax is global."""
  def build(mesh, spec, backend):
    import pallas_norm
    x = _data(SHAPE, 11)
    x[(-1,) * x.ndim] = 40.0
    x = np.asarray(jnp.asarray(x, jnp.bfloat16))
    w, b = 1 + 0.1 * _data(SHAPE[-1:], 12, loc=0.0, std=1.0), 0.1 * _data(SHAPE[-1:], 13)
    kw = dict(transpose=True, y_scale=jnp.float32(0.05) if delayed else None,
              backend=backend)
    if op == "rms":
      call = lambda x, w, b: pallas_norm.rms_norm_fp8(x, w, **kw)
    else:
      call = lambda x, w, b: pallas_norm.layer_norm_fp8(x, w, b, **kw)

    def f(x, w, b):
      o = call(x, w, b)
      return (o.y.astype(jnp.float32), o.y_scale, o.amax, o.y_t.astype(jnp.float32),
              o.rstd)
    hidden = P(spec[-1])
    return f, [(x, spec), (w, hidden), (b, hidden)]
  return build


def _fp8_input(op):
  """FP8 x with one float32 scale per 16 elements (x_scale laid out like x): y, dx,
  dscale, dbias, dx_scale (bf16 y and dx; x_scale's cotangent is zero)."""
  def build(mesh, spec, backend):
    import pallas_norm
    g = 16
    x = np.asarray(jnp.asarray(_data(SHAPE, 14), jnp.float8_e4m3fn))
    s = np.random.default_rng(15).uniform(0.5, 2.0, SHAPE[:-1] + (SHAPE[-1] // g,))
    s = s.astype(np.float32)
    dy = jnp.asarray(_data(SHAPE, 16, loc=0.0), jnp.bfloat16)
    w, b = 1 + 0.1 * _data(SHAPE[-1:], 17, loc=0.0, std=1.0), 0.1 * _data(SHAPE[-1:], 18)
    if op == "rms":
      f = lambda x, w, b, s: pallas_norm.rms_norm(x, w, x_scale=s, backend=backend)
    else:
      f = lambda x, w, b, s: pallas_norm.layer_norm(x, w, b, x_scale=s, backend=backend)
    hidden = P(spec[-1])
    return _vjp_step(f, 4, dy), [(x, spec), (w, hidden), (b, hidden), (s, spec)]
  return build


def _flax_axis_name(kind):
  """pallas_norm.RMSNorm / LayerNorm (NNX) with axis_name="model" inside jax.shard_map
  (check_vma=False: interpret mode needs it), each device holding N / |model| features and
  its slice of the params: y and the grads of x, scale (and bias)."""
  def build(mesh, spec, backend):
    import pallas_norm
    from flax import nnx
    n_local = SHAPE[-1] // mesh.shape["model"]
    cls = pallas_norm.RMSNorm if kind == "rms" else pallas_norm.LayerNorm
    graphdef, state = nnx.split(cls(n_local, axis_name="model", backend=backend,
                                    rngs=nnx.Rngs(0)))
    x, dy = _data(SHAPE, 19), _data(SHAPE, 20, loc=0.0, std=1.0)
    w, b = 1 + 0.1 * _data(SHAPE[-1:], 21, loc=0.0, std=1.0), 0.1 * _data(SHAPE[-1:], 22)

    def local(x, w, b):  # one device's [.., n_local] slice
      st = jax.tree.map(lambda a: a, state)
      st.replace_by_pure_dict({"scale": w, "bias": b} if kind == "layer" else {"scale": w})
      return nnx.merge(graphdef, st)(x)

    hidden = P(spec[-1])
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec, hidden, hidden), out_specs=spec,
                      check_vma=False)
    return _vjp_step(f, 3, dy), [(x, spec), (w, hidden), (b, hidden)]
  return build


def _flax_jit(mesh, spec, backend):
  """pallas_norm.RMSNorm (NNX) under jax.jit on data-parallel x, params replicated: y and
  the grads of x and scale (the scale's summed over the rows of every process)."""
  import pallas_norm
  from flax import nnx
  graphdef, state = nnx.split(pallas_norm.RMSNorm(SHAPE[-1], backend=backend,
                                                  rngs=nnx.Rngs(0)))
  x, dy = _data(SHAPE, 23), _data(SHAPE, 24, loc=0.0, std=1.0)
  w = 1 + 0.1 * _data(SHAPE[-1:], 25, loc=0.0, std=1.0)

  def f(x, w):
    st = jax.tree.map(lambda a: a, state)
    st.replace_by_pure_dict({"scale": w})
    return nnx.merge(graphdef, st)(x)

  return _vjp_step(f, 2, dy), [(x, spec), (w, P())]


_NORM_OUT = ("y", "dx", "dscale", "dbias")
_FP8_IN_OUT = ("y", "dx", "dscale", "dbias", "dx_scale")
CASES = [
    # RMSNorm and LayerNorm: every layout on both mesh types, one op each way round
    Case("rms-dp-auto", "rms_norm", "dp", "auto", _norm("rms"), _NORM_OUT),
    Case("layer-dp-explicit", "layer_norm", "dp", "explicit", _norm("layer"), _NORM_OUT),
    Case("layer-sp-auto", "layer_norm", "sp", "auto", _norm("layer"), _NORM_OUT),
    Case("rms-sp-explicit", "rms_norm", "sp", "explicit", _norm("rms"), _NORM_OUT),
    Case("rms-tp-auto", "rms_norm", "tp", "auto", _norm("rms"), _NORM_OUT),
    Case("layer-tp-explicit", "layer_norm", "tp", "explicit", _norm("layer"), _NORM_OUT),
    Case("layer-dp_tp-auto", "layer_norm", "dp_tp", "auto", _norm("layer"), _NORM_OUT),
    Case("rms-dp_tp-explicit", "rms_norm", "dp_tp", "explicit", _norm("rms"), _NORM_OUT),
    # residual=
    Case("rms_residual-dp_tp-auto", "residual=", "dp_tp", "auto", _residual("rms"),
         ("y", "h", "dx", "dresidual", "dscale", "dbias"), ref_tol=2e-2, single_tol=2**-8),
    Case("layer_residual-tp-explicit", "residual=", "tp", "explicit", _residual("layer"),
         ("y", "h", "dx", "dresidual", "dscale", "dbias"), ref_tol=2e-2, single_tol=2**-8),
    # cast=
    Case("rms_llama-dp-explicit", "cast=", "dp", "explicit",
         _norm("rms", jnp.bfloat16, "llama"), _NORM_OUT, ref_tol=3e-2, single_tol=2**-8),
    Case("rms_gemma-tp-auto", "cast=", "tp", "auto", _norm("rms", cast="gemma"),
         _NORM_OUT),
    # the FP8-output ops' global amax (with the transposed copy)
    Case("rms_fp8_out_current-dp-auto", "rms_norm_fp8", "dp", "auto",
         _fp8_output("rms", delayed=False), ("y", "y_scale", "amax", "y_t", "rstd"),
         fp8=("y", "y_t")),
    Case("layer_fp8_out_delayed-tp-explicit", "layer_norm_fp8", "tp", "explicit",
         _fp8_output("layer", delayed=True), ("y", "y_scale", "amax", "y_t", "rstd"),
         fp8=("y", "y_t")),
    Case("rms_fp8_out_current-dp_tp-explicit", "rms_norm_fp8", "dp_tp", "explicit",
         _fp8_output("rms", delayed=False), ("y", "y_scale", "amax", "y_t", "rstd"),
         fp8=("y", "y_t")),
    # FP8 input (x_scale=)
    Case("rms_fp8_in-dp_tp-explicit", "x_scale=", "dp_tp", "explicit", _fp8_input("rms"),
         _FP8_IN_OUT, ref_tol=2e-2, single_tol=2**-8),
    Case("layer_fp8_in-tp-auto", "x_scale=", "tp", "auto", _fp8_input("layer"),
         _FP8_IN_OUT, ref_tol=2e-2, single_tol=2**-8),
    # the Flax layers
    Case("nnx_rms_axis_name-tp-auto", "RMSNorm (shard_map, axis_name)", "tp", "auto",
         _flax_axis_name("rms"), _NORM_OUT),
    Case("nnx_layer_axis_name-dp_tp-explicit", "LayerNorm (shard_map, axis_name)", "dp_tp",
         "explicit", _flax_axis_name("layer"), _NORM_OUT),
    Case("nnx_rms_jit-dp-explicit", "RMSNorm (jit)", "dp", "explicit", _flax_jit,
         ("y", "dx", "dscale")),
]


def mesh_of(layout: str, axis_type: str) -> jax.sharding.Mesh:
  shape, names, _ = LAYOUTS[layout]
  return jax.make_mesh(shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names))


def _global(a: np.ndarray, mesh, spec) -> jax.Array:
  """The global array of ``a``, each process filling its own devices' shards."""
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                      lambda idx: a[idx])


def _host(outs) -> list[np.ndarray]:
  from jax.experimental import multihost_utils
  outs = [o.astype(jnp.float32) for o in outs]
  return [np.asarray(o) for o in multihost_utils.process_allgather(outs, tiled=True)]


def run_case(case: Case, single: bool) -> dict[str, np.ndarray]:
  """{'{case}/{output}/{run1|run2|ref}': float32 global array}."""
  mesh = mesh_of(case.layout, case.axis_type)
  spec = LAYOUTS[case.layout][2]
  f, inputs = case.build(mesh, spec, "pallas")
  step = jax.jit(f)
  args = [_global(a, mesh, s) for a, s in inputs]
  result = {}
  for run in ("run1", "run2"):
    outs = _host(step(*args))
    if len(outs) != len(case.outputs):
      raise AssertionError(f"{case.name}: {len(outs)} outputs, expected {case.outputs}")
    result.update({f"{case.name}/{k}/{run}": v for k, v in zip(case.outputs, outs)})
  if single:
    f_ref, inputs = case.build(mesh, spec, "xla")
    # unsharded, except where the case's own shard_map needs x laid out on the mesh
    ref_args = args if "shard_map" in case.family else [a for a, _ in inputs]
    outs = [np.asarray(jnp.asarray(o, jnp.float32)) for o in jax.jit(f_ref)(*ref_args)]
    result.update({f"{case.name}/{k}/ref": v for k, v in zip(case.outputs, outs)})
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
  parser.add_argument("--fail", action="store_true", help="raise after jax.distributed "
                      "starts, on the last process (the harness's own test)")
  distributed.add_arguments(parser)
  args = parser.parse_args(argv)
  if (msg := distributed.check_arguments(args)) is not None:
    parser.error(msg)
  if distributed.is_distributed(args):
    distributed.initialize(args)
  if args.fail and jax.process_index() == jax.process_count() - 1:
    raise RuntimeError(f"deliberate failure in process {jax.process_index()}")
  if jax.device_count() != NDEV:
    raise RuntimeError(f"{jax.device_count()=} must be {NDEV}")
  names = [n for n in args.cases.split(",") if n]
  cases = [c for c in CASES if not names or c.name in names]
  single = jax.process_count() == 1
  result = {}
  for case in cases:
    result.update(run_case(case, single))
  meta = {"process_count": jax.process_count(), "local_devices": jax.local_device_count(),
          "mesh_processes": {
              layout: np.vectorize(lambda d: d.process_index)(
                  mesh_of(layout, "auto").devices).tolist() for layout in LAYOUTS}}
  path = os.path.join(args.out, f"p{jax.process_index()}of{jax.process_count()}.npz")
  np.savez(path, meta=json.dumps(meta), **result)
  return 0


if __name__ == "__main__":
  try:
    code = main()
  except BaseException:  # noqa: BLE001: any failure, reported, then out at once
    # jax.distributed's shutdown at exit waits for the other processes first (a barrier
    # with a timeout, ~30 s); exiting here leaves the launcher to stop them now.
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
  sys.exit(code)
