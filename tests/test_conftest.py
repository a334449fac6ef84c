"""`pytest tests` alone runs what `make test` runs: conftest.py sets the Makefile's CPU
XLA flags (CPU_TEST_FLAGS) when they are not given, and the two lists stay equal."""

import os
import pathlib
import re

import pytest

import conftest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_cpu_flags_match_the_makefile():
  line = re.search(r"^CPU_TEST_FLAGS = (.*)$", (ROOT / "Makefile").read_text(), re.M)
  assert line, "Makefile has no CPU_TEST_FLAGS line"
  assert tuple(line.group(1).split()) == conftest.CPU_TEST_FLAGS


def test_cpu_flags_are_set(on_gpu):
  if on_gpu:
    pytest.skip("the CPU flags are for interpret mode; --gpu leaves XLA_FLAGS as given")
  flags = os.environ.get("XLA_FLAGS", "").split()
  for flag in conftest.CPU_TEST_FLAGS:
    assert flag in flags, (flag, flags)
