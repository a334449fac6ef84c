"""Shared pytest setup.

``--gpu`` (used by ``make gpu-check``) requires a CUDA GPU, runs the kernels with
``interpret=False`` and enables the tests marked ``gpu``. Without it, the ``gpu`` tests
are reported as skipped (never as passes) and everything runs in interpret mode.
"""

import os

import pytest


def pytest_addoption(parser):
  parser.addoption("--gpu", action="store_true", default=False,
                   help="run on a CUDA GPU with interpret=False, plus the gpu-only tests")


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (make gpu-check)")
  config.addinivalue_line("markers", "cpu_only: only meaningful in interpret mode on CPU")
  if config.getoption("--gpu"):
    import jax
    if jax.default_backend() != "gpu":
      raise pytest.UsageError(f"--gpu given but jax.default_backend()={jax.default_backend()!r}")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--gpu"):
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU: run `make gpu-check` on the GPU machine")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope="session")
def on_gpu(pytestconfig):
  return bool(pytestconfig.getoption("--gpu"))
