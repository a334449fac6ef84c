"""Registers and spills of FP8-output row-block kernels, compiled for the H100/H200
(sm_90a) on a CPU: no device time. Each config's Pallas kernel is lowered for CUDA
(`lowering_platforms=("cuda",)`), the Triton module that JAX's Pallas Triton lowering
emits (TTIR, the custom call's ``ir``) is compiled by Triton to PTX; the bundled
`ptxas -v` gives registers a thread and spill bytes. Programs a SM need
`programs * 32 * num_warps * registers <= 65536` (registers allocated 8 at a time):
a tile whose registers forbid the programs a SM it asks for runs them in waves.
Usage: python benchmarks/fp8_regs_cpu.py KERNEL:OP:MxN 'TILES'
  KERNEL delayed or stats, OP rms or layer; TILES a Python list of Fp8Config tuples
  (block_m, num_warps, programs a SM, hoist_params, row_amax, packed, stream_x,
  packed_params), e.g. "[(2, 4, 2, True, True, True, False, False)]"; bf16 x and
  scale/bias.
  python benchmarks/fp8_regs_cpu.py fp8in:OP:MxN[,MxN...]: every kernel of the forward
  and backward (jax.vjp) of OP with float8_e4m3fn x (groups of 16) and bf16 scale/bias,
  dy bf16, with the configs the library picks on an H100 (``op_registers``).
Needs TRITON_ALWAYS_COMPILE=1 (set here) so that Triton's cache does not skip PTX."""
import ast, os, re, subprocess, sys, tempfile
os.environ["TRITON_ALWAYS_COMPILE"] = "1"
import jax, jax.numpy as jnp
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nv
from pallas_norm.kernels import fp8 as K

PTX = []
_cubin = nv.CUDABackend.make_cubin


def _keep_ptx(self, src, metadata, opt, capability):
  PTX.append(src)
  return _cubin(self, src, metadata, opt, capability)


nv.CUDABackend.make_cubin = _keep_ptx
PTXAS = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")


def _ptxas(ttir, num_warps):
  """(registers a thread, spill store bytes) of one Triton module compiled for sm_90a."""
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "kernel.ttir")
    open(path, "w").write(ttir)
    triton.compile(path, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=num_warps, num_stages=1))
    open(os.path.join(d, "k.ptx"), "w").write(PTX[-1])
    log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", os.path.join(d, "k.ptx"), "-o",
                          os.path.join(d, "k.o")], capture_output=True, text=True).stderr
  return (int(re.search(r"Used (\d+) registers", log).group(1)),
          int(re.search(r"(\d+) bytes spill stores", log).group(1)))


def op_registers(fn, *args, device="NVIDIA H100 80GB HBM3", sms=132):
  """[(kernel name, num_warps, registers, spill bytes)] of every Pallas Triton kernel
  that ``fn(*args)`` (public ops with ``interpret=False``) lowers to, with the configs
  the library picks on ``device`` (config.device_info answers as that GPU). Each custom
  call's own Triton module (its ``ir`` bytecode) is compiled with its ``num_warps``."""
  from jax._src.lib.mlir import ir
  from jax._src.pallas.triton import lowering as L
  from pallas_norm import config as C
  cached = C._device_info_cached
  C._device_info_cached = lambda p, name, cores: C.DeviceInfo("gpu", device, sms)
  try:
    low = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    C._device_info_cached = cached
  calls = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for o in block.operations:
          if o.operation.name == "stablehlo.custom_call" and (
              "mhlo.backend_config" in o.operation.attributes):
            cfg = o.operation.attributes["mhlo.backend_config"]
            if "ir" in cfg:
              calls.append((str(cfg["name"]).strip('"'), int(str(cfg["num_warps"]).split()[0]),
                            cfg["ir"].value_bytes))
          walk(o.operation)

  walk(low.compiler_ir("stablehlo").operation)
  out = []
  for name, warps, bc in calls:
    with L._new_ir_context():
      ttir = ir.Module.parse(bc).operation.get_asm(enable_debug_info=False)
    PTX.clear()
    out.append((name, warps, *_ptxas(ttir, warps)))
  return out


def registers(kernel, op, m, n, cfg):
  """(registers a thread, spill store bytes) of the kernel ``cfg`` runs for [m, n]."""
  x = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((n,), jnp.bfloat16)
  layer = op == "layer"
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=False, config=cfg)
  if kernel == "delayed":
    f = lambda x, s, b: K.fp8_norm_delayed(x, s, b if layer else None, 3.0,
                                           fp8_dtype=jnp.float8_e4m3fn, transpose=False,
                                           **kw)
  else:
    f = lambda x, s, b: K.fp8_stats(x, s, b if layer else None, **kw)
  (_, _, regs, spill), = op_registers(f, x, s, s)
  return regs, spill


def fits(num_warps, regs):
  """Programs a SM that ``regs`` registers a thread allow (65536 a SM, 8 at a time)."""
  return 65536 // (32 * num_warps * -(-regs // 8) * 8)


def fp8in_vjp(op, m, n):
  """(f, args): OP's forward and backward with FP8 x, for ``op_registers``."""
  import pallas_norm
  args = (jax.ShapeDtypeStruct((m, n), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((m, n // 16), jnp.float32),
          jax.ShapeDtypeStruct((n,), jnp.bfloat16), jax.ShapeDtypeStruct((m, n), jnp.bfloat16))

  def f(x, xs, s, dy):
    if op == "rms":
      g = lambda s: pallas_norm.rms_norm(x, s, x_scale=xs, interpret=False)
    else:
      g = lambda s: pallas_norm.layer_norm(x, s, s, x_scale=xs, interpret=False)
    y, vjp = jax.vjp(g, s)
    return y, vjp(dy)
  return f, args


if __name__ == "__main__":
  kernel, op, shape = sys.argv[1].split(":")
  if kernel == "fp8in":
    print(f"FP8-input {op} forward + backward, the H100's picks, sm_90a (compiled on a "
          f"CPU): kernel, warps, registers a thread, spill bytes, programs a SM allowed")
    for sh in shape.split(","):
      m, n = map(int, sh.split("x"))
      f, args = fp8in_vjp(op, m, n)
      for name, w, r, sp in op_registers(f, *args):
        print(f"  {m}x{n} {name}: {w} warps, {r} registers, {sp} spill bytes; "
              f"{fits(w, r)} a SM",
              flush=True)
    sys.exit(0)
  m, n = map(int, shape.split("x"))
  bn = 1 << (n - 1).bit_length()
  print(f"{kernel} {op} {m}x{n}, sm_90a (compiled on a CPU): registers a thread, spill "
        f"bytes, programs a SM the registers allow")
  for t in ast.literal_eval(sys.argv[2]):
    bm, warps, per_sm, hoist, ra, packed, cg, pp = t
    cfg = K.Fp8Config(bm, bn, warps, 132 * per_sm, True, hoist, ra, packed=packed,
                      stream_x=cg, packed_params=pp)
    r, spill = registers(kernel, op, m, n, cfg)
    print(f"  {t}: {r} registers, {spill} spill bytes; fits {fits(warps, r)} a SM "
          f"(asks {per_sm})",
          flush=True)
