"""Many processes, one global mesh: JAX's own ``jax.distributed``, and a local launcher.

pallas_norm needs nothing of its own across processes (hosts, or one process a GPU): the
ops are partitioned by ``shard_map`` / ``custom_partitioning``, so under
``jax.distributed.initialize()`` a mesh over every process's devices just works
(docs/multi_gpu.md, "Many hosts"). This module holds what the project's command lines
(``python -m pallas_norm.demo``) and multi-process tests (``tests/multihost``) share:

- ``add_arguments`` / ``check_arguments`` / ``initialize``: the standard flags
  ``--coordinator HOST:PORT --num-processes K --process-id I`` (what any launcher, SLURM,
  Kubernetes or mpirun, passes on), or ``--distributed auto`` (the cluster
  auto-detection of ``jax.distributed.initialize()`` with no arguments);
- ``launch``: K copies of a command on this machine, each given those flags (a free
  localhost port as coordinator) and its own devices: ``cpu_devices`` fake CPU devices
  each, or one GPU each (``CUDA_VISIBLE_DEVICES``). It waits with a timeout, and when one
  process fails it stops the others (which would wait on it in a collective forever) and
  reports which one failed and the tail of its stderr.

The launcher never imports jax's backends itself: a parent holding the GPUs would starve
its children.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time

__all__ = ["add_arguments", "check_arguments", "initialize", "is_distributed", "free_port",
           "local_gpu_count", "child_env", "ProcessResult", "LaunchError", "launch"]

_STDERR_TAIL = 4000  # characters of a failed process's stderr in a LaunchError


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the multi-process flags (all default None) to ``parser``."""
  g = parser.add_argument_group(
      "many processes (jax.distributed; docs/multi_gpu.md, 'Many hosts')")
  g.add_argument("--coordinator", "--coordinator-address", dest="coordinator",
                 metavar="HOST:PORT",
                 help="process 0's address, as jax.distributed.initialize's "
                      "coordinator_address (with --num-processes and --process-id)")
  g.add_argument("--num-processes", type=int, metavar="K", help="how many processes in all")
  g.add_argument("--process-id", type=int, metavar="I", help="this process: 0 .. K-1")
  g.add_argument("--distributed", choices=("auto",),
                 help="auto: jax.distributed.initialize() with no arguments, which reads "
                      "the cluster's environment (SLURM, Open MPI, Kubernetes, Cloud TPU)")
  g.add_argument("--processes", type=int, metavar="K",
                 help="local launcher: run K processes of this command on this machine "
                      "(coordinator on localhost); one GPU each where there are >= K "
                      "GPUs, else fake CPU devices (--devices each, default 1)")


def check_arguments(args: argparse.Namespace) -> str | None:
  """The error message for an inconsistent set of multi-process flags, else None."""
  given = [f for f, v in (("--coordinator", args.coordinator),
                          ("--num-processes", args.num_processes),
                          ("--process-id", args.process_id)) if v is not None]
  if args.processes is not None:
    if args.processes < 1:
      return f"--processes={args.processes} must be a positive integer"
    if given or args.distributed:
      return (f"--processes launches the processes itself (each gets --coordinator, "
              f"--num-processes and --process-id): drop {', '.join(given) or '--distributed'}")
  if args.distributed and given:
    return f"--distributed auto reads the cluster's environment: drop {', '.join(given)}"
  if given and len(given) < 3:
    missing = sorted({"--coordinator", "--num-processes", "--process-id"} - set(given))
    return f"{', '.join(given)} also needs {', '.join(missing)}"
  if given:
    if args.num_processes < 1:
      return f"--num-processes={args.num_processes} must be a positive integer"
    if not 0 <= args.process_id < args.num_processes:
      return (f"--process-id={args.process_id} must be in [0, --num-processes="
              f"{args.num_processes})")
    if not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", args.coordinator):
      return f"--coordinator={args.coordinator!r} must be HOST:PORT"
  return None


def is_distributed(args: argparse.Namespace) -> bool:
  """Whether ``args`` ask this process to join a multi-process run."""
  return bool(args.distributed) or args.coordinator is not None


def initialize(args: argparse.Namespace) -> None:
  """``jax.distributed.initialize`` from ``args`` (checked by ``check_arguments``).

  Call before anything touches jax's devices. CPU collectives across processes are
  gloo's (jax's default has none); GPUs keep NCCL.

  Raises:
    RuntimeError, ValueError: from jax (no coordinator reachable, no cluster detected).
  """
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if args.distributed == "auto":
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)


def free_port() -> int:
  """A TCP port free on localhost now (the OS picks it; another program could take it
  before the coordinator binds it, which then fails loudly, never silently)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def local_gpu_count() -> int:
  """NVIDIA GPUs on this machine (``nvidia-smi -L``; 0 without it), without jax."""
  if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu" or not shutil.which("nvidia-smi"):
    return 0
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return 0
  return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def child_env(process_id: int, *, cpu_devices: int | None, base: dict | None = None) -> dict:
  """The environment of local process ``process_id``.

  ``cpu_devices`` set: JAX on CPU with that many fake devices (any device-count flag in
  ``XLA_FLAGS`` replaced). None: GPU ``process_id`` only (``CUDA_VISIBLE_DEVICES``).
  """
  env = dict(os.environ if base is None else base)
  if cpu_devices is None:
    env["CUDA_VISIBLE_DEVICES"] = str(process_id)
    return env
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={cpu_devices}"])
  env["JAX_PLATFORMS"] = "cpu"
  return env


@dataclasses.dataclass
class ProcessResult:
  """One launched process: its exit code (None: stopped by the launcher), its output."""

  process_id: int
  returncode: int | None
  stdout: str
  stderr: str


class LaunchError(RuntimeError):
  """A launched process failed or timed out; ``results`` holds every process's."""

  def __init__(self, message: str, results: list[ProcessResult]):
    super().__init__(message)
    self.results = results


def launch(command: list[str], num_processes: int, *, cpu_devices: int | None,
           timeout: float | None, env: dict | None = None, passthrough: int | None = None,
           cwd: str | None = None) -> list[ProcessResult]:
  """Runs ``command`` as ``num_processes`` processes of one jax.distributed job.

  Args:
    command: argv; each process gets ``--coordinator localhost:PORT --num-processes K
      --process-id I`` appended.
    num_processes: K >= 1.
    cpu_devices: fake CPU devices per process; None: one GPU per process.
    timeout: seconds for the whole job; past it every process is stopped (None: no
      limit).
    env: the base environment (default os.environ), then ``child_env``'s changes.
    passthrough: a process whose stdout/stderr go to this process's (live), or None.
    cwd: the processes' working directory.

  Returns:
    [K] ProcessResult in process order, all with return code 0 (the passthrough
    process's output is "").

  Raises:
    LaunchError: a process exited non-zero (the first to do so is named, with its exit
      code and stderr tail; the others were stopped), or the timeout passed (the
      processes still running are named).
  """
  if num_processes < 1:
    raise ValueError(f"{num_processes=} must be >= 1")
  port = free_port()
  flags = lambda i: ["--coordinator", f"localhost:{port}", "--num-processes",
                     str(num_processes), "--process-id", str(i)]
  with tempfile.TemporaryDirectory(prefix="pallas_norm_launch_") as tmp:
    procs, files = [], []
    for i in range(num_processes):
      if i == passthrough:
        out = err = None
      else:
        out = open(os.path.join(tmp, f"{i}.out"), "w+")
        err = open(os.path.join(tmp, f"{i}.err"), "w+")
      files.append((out, err))
      procs.append(subprocess.Popen(command + flags(i), stdout=out, stderr=err, cwd=cwd,
                                    env=child_env(i, cpu_devices=cpu_devices, base=env)))
    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    try:
      while True:
        codes = [p.poll() for p in procs]
        failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if (failed is not None or None not in codes or time.monotonic() > deadline):
          break
        time.sleep(0.05)
    finally:
      running = [i for i, p in enumerate(procs) if p.poll() is None]
      for i in running:
        procs[i].kill()
      for p in procs:
        p.wait()
    results = []
    for i, (out, err) in enumerate(files):
      text = []
      for f in (out, err):
        if f is None:
          text.append("")
          continue
        f.seek(0)
        text.append(f.read())
        f.close()
      rc = None if i in running else procs[i].returncode
      results.append(ProcessResult(i, rc, *text))
  if failed is not None:
    r = results[failed]
    stopped = [i for i in running if i != failed]
    raise LaunchError(
        f"process {failed} of {num_processes} exited with code {r.returncode}"
        + (f" (stopped the others still running: {stopped})" if stopped else "")
        + (f"; its stderr ends:\n{r.stderr[-_STDERR_TAIL:]}" if r.stderr else ""), results)
  if running:
    tails = "".join(f"\n--- process {i} stderr ends:\n{results[i].stderr[-1000:]}"
                    for i in running)
    raise LaunchError(f"timed out after {timeout:g} s: processes {running} of "
                      f"{num_processes} still running, stopped{tails}", results)
  return results

