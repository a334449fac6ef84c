"""tests/multihost's shared fixture: each process-pair run once per pytest run."""

import fcntl
import os

import pytest


@pytest.fixture(scope="session")
def run_once(tmp_path_factory):
  """``run_once(name, compute)``: the folder that ``compute(folder)`` filled, computed once
  for the whole pytest run. Under pytest-xdist every worker may ask (``--dist
  loadgroup`` did not keep these modules on one worker: each pair ran on both, 2026-11-28),
  so the workers share the folder under one file lock: the first computes, the others
  wait asleep and read it; and no two process pairs run side by side (their gloo
  collectives wait spinning, which on CI's 2 cores slows both)."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # shared by the workers of this run

  def run(name, compute):
    folder = root / f"multihost_{name}"
    with open(root / "multihost.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      try:
        if not (folder / "done").exists():
          folder.mkdir(exist_ok=True)
          compute(folder)
          (folder / "done").touch()
      finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
    return folder

  return run
