"""How the benchmarks time a call, and what they record about the machine.

Method (``../shared/BENCHMARKING.md``; the full write-up: ``docs/performance.md``):
  * JAX: CUPTI kernel time from ``jax.experimental.mosaic.gpu.profiler.measure(step,
    aggregate=False, iterations=K)``; the time of one call is the sum of all of its
    kernels (a backward is several). ``XLA_FLAGS`` gets
    ``--xla_gpu_enable_command_buffer=`` before jax starts its backend (this module does
    it when it is imported), so that CUPTI sees the kernels; when it still reports none
    the row says "n/a" and why.
  * L2: R device copies of the inputs, R * bytes(x) >= 4 * L2 (``plan.rotations``), and
    the step cycles through them, one copy per call (``rotating_step``). No flush kernel
    (its dirty lines would be written back on the next kernel's time).
  * Compilation is excluded (one warm-up call); the median of ``--iters`` (>= 30) calls
    is reported, with the 10th and 90th percentiles in the JSON.
  * torch peers: CUDA events around each call on the same rotated inputs (shared
    through DLPack), queued behind ``torch.cuda._sleep`` so the host runs ahead; the
    median. Events include the gaps between a call's kernels, which CUPTI does not.
  * Copy: ``-a`` on a 1 GiB buffer under ``jax.jit`` (one read and one write of every
    byte), timed as above: copy GB/s = 2 * bytes / median time; torch's ``copy_`` too
    when torch has a GPU, and the faster of the two is the reference.

Times are in microseconds (``us``) unless a name says otherwise.
"""

from __future__ import annotations

import os

COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer="


def _set_xla_env() -> None:
  """Append the CUPTI-friendly XLA flag (keeping XLA_FLAGS) and share the GPU with torch."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_gpu_enable_command_buffer" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFER_FLAG}".strip()
  # JAX would take 75% of the GPU up front; torch peers need room beside it.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def keep_command_buffers() -> None:
  """Drop the flag ``_set_xla_env`` added (XLA's default command buffers again), before
  jax starts its backend.

  Raises:
    RuntimeError: the backend has started (XLA read XLA_FLAGS already).
  """
  if _backend_started():
    raise RuntimeError("keep_command_buffers() after jax started its backend: XLA has "
                       "read XLA_FLAGS already")
  flags = os.environ.get("XLA_FLAGS", "").split()
  os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f != COMMAND_BUFFER_FLAG)


def _backend_started() -> bool:
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge._backends)
  except Exception:  # noqa: BLE001 - a private attribute; unknown means "no"
    return False


# XLA reads XLA_FLAGS when it creates its backend, not when jax is imported (which the
# package __init__ has already done under `python -m`), so this is early enough unless
# something started the backend already; run.run_plan says so if it did.
BACKEND_STARTED_EARLY = _backend_started()
_set_xla_env()

import importlib.metadata  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.stages  # noqa: E402
import numpy as np  # noqa: E402

from pallas_norm.bench.plan import ASSUMED_L2  # noqa: E402

COPY_BYTES = 1 << 30


class NoGpu(RuntimeError):
  pass


def require_gpu() -> None:
  """Raises NoGpu unless jax's default backend is a GPU."""
  backend = jax.default_backend()
  if backend != "gpu":
    raise NoGpu(f"pallas_norm.bench needs a GPU (jax.default_backend()={backend!r}); "
                f"use --dry-run to print the plan or --plot-only FILE.json to redraw "
                f"a result")


def gpu_missing() -> bool:
  """True, with the reason printed to stderr, unless jax's default backend is a GPU: the
  commands that time return exit code 2 then."""
  try:
    require_gpu()
  except NoGpu as e:
    print(e, file=sys.stderr)
    return True
  return False


def profiler():
  from jax.experimental.mosaic.gpu import profiler as mosaic_profiler
  return mosaic_profiler


def rotating_step(step, arg_sets):
  """A callable that runs ``step`` on the next argument set at each call.

  ``profiler.measure`` calls its function with the same arguments every iteration and
  jits anything that is not already a ``jax.stages.Wrapped``; subclassing that protocol
  keeps the rotation in Python, one copy per call.
  """
  class _Rotating(jax.stages.Wrapped):

    def __init__(self):
      self.calls = 0

    def __call__(self):
      args = arg_sets[self.calls % len(arg_sets)]
      self.calls += 1
      # Hand back only the smallest output: it is ready when the whole call is, and
      # the big ones are freed instead of piling up over the iterations.
      return min(jax.tree.leaves(step(*args)), key=lambda a: a.size)

    def trace(self, *args, **kwargs):
      raise NotImplementedError

    def lower(self, *args, **kwargs):
      raise NotImplementedError

  return _Rotating()


def summarise(per_call_us: list[float]) -> dict:
  """{us: median, us_p10, us_p90, samples} of per-call times in microseconds."""
  a = np.asarray(per_call_us, np.float64)
  return {"us": float(np.median(a)), "us_p10": float(np.percentile(a, 10)),
          "us_p90": float(np.percentile(a, 90)), "samples": int(a.size)}


def cupti_time(step, arg_sets, iters: int, per_call: bool = False) -> dict:
  """CUPTI kernel time of ``step`` over rotated ``arg_sets``: {us, us_p10, us_p90, kernels}
  (with ``per_call``, also "per_call_us": each call's time) or {status: "n/a", reason}.
  The sum of the kernels' durations: memsets and memcpys (XLA writes a constant aliased
  into a kernel, or returned, with one) and the gaps between kernels are not in it;
  benchmarks/kernel_clock_gaps.py at fd31e12 traces them (docs/performance.md, "Nor our
  own memsets and memcpys")."""
  rot = rotating_step(step, arg_sets)
  try:
    _, timings = profiler().measure(rot, aggregate=False, iterations=iters)()
  except RuntimeError as e:  # e.g. kernel names differing between iterations
    return {"status": "n/a", "reason": f"CUPTI: {e}"}
  if not timings:
    return {"status": "n/a", "reason": "CUPTI reported no kernels (XLA may have run the "
                                       "program as a command buffer)"}
  if isinstance(timings[0], tuple):  # iterations=1 returns one list, not a list of lists
    timings = [timings]
  calls = [sum(ms for _, ms in it) * 1e3 for it in timings]
  out = summarise(calls)
  if per_call:
    out["per_call_us"] = calls
  out["kernels"] = [name for name, _ in timings[0]]
  # Each kernel's own median, in launch order (so they need not add up to "us"), over
  # the calls that launched the same kernels as the first.
  names = out["kernels"]
  same = [it for it in timings if [nm for nm, _ in it] == names]
  out["kernel_us"] = [float(np.median([it[i][1] for it in same]) * 1e3)
                      for i in range(len(names))]
  return out


def time_us(fn, inputs, iters: int) -> float | None:
  """Median CUPTI time (us) of ``fn`` over rotated ``inputs`` after one call, or None if no
  kernel was seen: the timing of ``sweep`` and ``ab``."""
  jax.block_until_ready(fn(*inputs[0]))
  return cupti_time(fn, inputs, iters).get("us")


def torch_time(call, n_sets: int, iters: int) -> dict:
  """Median CUDA-event time of ``call(i)``, i cycling over ``n_sets`` rotated inputs."""
  import torch
  call(0)
  torch.cuda.synchronize()
  t0 = time.perf_counter()
  for i in range(3):
    call(i % n_sets)
  host_s = (time.perf_counter() - t0) / 3  # host time to enqueue one call
  torch.cuda.synchronize()
  starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
  ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
  sleep = getattr(torch.cuda, "_sleep", None)
  if sleep is not None:  # let the host enqueue every call before the GPU reaches them
    sleep(int(min(2e9, 2e9 * 1.5 * iters * host_s)))
  for k in range(iters):
    starts[k].record()
    call(k % n_sets)
    ends[k].record()
  torch.cuda.synchronize()
  return summarise([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])


def warm_up(seconds: float = 3.0) -> None:
  """Keep the GPU busy for a few seconds so that its clocks have ramped before timing."""
  a = jnp.ones((1 << 28,), jnp.float32)
  f = jax.jit(lambda v: v * 2)
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    jax.block_until_ready(f(a))


def measure_copy(dtype, iters: int) -> dict:
  """GB/s of a 1 GiB read+write (``-a`` under jit): 2 * bytes / median CUPTI time."""
  itemsize = jnp.dtype(dtype).itemsize
  a = jax.random.normal(jax.random.key(1), (COPY_BYTES // itemsize // 4096, 4096), dtype)
  step = jax.jit(lambda v: -v)
  jax.block_until_ready(step(a))
  t = cupti_time(step, [(a,)], iters)
  del a
  if "us" not in t:
    return {"copy_gbs": None, "copy_reason": t["reason"]}
  return {"copy_gbs": 2 * COPY_BYTES / (t["us"] * 1e-6) / 1e9, "copy_us": t["us"],
          "copy_bytes": COPY_BYTES, "copy_kernels": t["kernels"]}


def torch_copy_gbs(iters: int) -> float | None:
  """GB/s of torch's 1 GiB device-to-device ``copy_`` (CUDA events)."""
  import torch
  src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
  dst = torch.empty_like(src)
  t = torch_time(lambda i: dst.copy_(src), 1, iters)
  del src, dst
  torch.cuda.empty_cache()
  return 2 * COPY_BYTES / (t["us"] * 1e-6) / 1e9


# --------------------------------------------------------------------------- metadata


def version(dist: str) -> str | None:
  """The installed version of distribution ``dist``, or None."""
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def git_commit(short: bool = False, cwd=None) -> str:
  """$PALLAS_NORM_GIT_COMMIT, else ``git rev-parse HEAD`` of this checkout (or of the one
  at ``cwd``; ``short``: 7 hex digits) with "-dirty" appended where a tracked file
  differs from it, else "unknown". (The GPU machine gets a copy of the working tree
  whose git metadata can lag it: results then read an older commit, "-dirty".)"""
  env = os.environ.get("PALLAS_NORM_GIT_COMMIT")
  if env:
    return env
  here = cwd or pathlib.Path(__file__).resolve().parent
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         timeout=10, cwd=here)
    sha = out.stdout.strip()
    if out.returncode != 0 or not sha:
      return "unknown"
    diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True,
                          timeout=30, cwd=here)
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return (sha[:7] if short else sha) + ("-dirty" if diff.returncode == 1 else "")


def torch_status() -> tuple[bool, str]:
  """(torch can run on a GPU here, why not)."""
  try:
    import torch
  except Exception as e:  # noqa: BLE001
    return False, f"cannot import torch: {e}"
  if not torch.cuda.is_available():
    return False, f"torch {torch.__version__} has no CUDA device"
  return True, ""


def device_meta(torch_ok: bool) -> dict:
  """The first device's kind, SM count and L2 size (from torch, else ``ASSUMED_L2``)."""
  d = jax.devices()[0]
  meta = {"device": d.device_kind, "num_sms": getattr(d, "core_count", None),
          "l2_bytes": ASSUMED_L2, "l2_source": "assumed"}
  if torch_ok:
    import torch
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
    if l2:
      meta.update(l2_bytes=int(l2), l2_source="torch")
  return meta


def slug(text: str) -> str:
  """A file-name-safe lower-case form of ``text`` ("NVIDIA H200" -> "nvidia-h200")."""
  return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"
