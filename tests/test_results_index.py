"""benchmarks/README.md indexes every results file: a result is never orphaned, and the
index names no file that is gone. Pure Python, no jax."""

import fnmatch
import pathlib
import re


def test_every_result_is_indexed():
  """benchmarks/README.md names every file of benchmarks/results/ (backticked names,
  with {a,b} alternatives and * globs), and each name it gives matches a file."""
  root = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
  files = sorted(p.name for p in (root / "results").iterdir())
  index = (root / "README.md").read_text()
  index = index[index.index("## Index of `results/`"):]

  def expand(pattern):
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
      return [pattern]
    return [e for alt in m.group(1).split(",")
            for e in expand(pattern[:m.start()] + alt + pattern[m.end():])]

  patterns = [p for tok in re.findall(r"`((?:h[12]00|cpu_\d{4}-)[^`\s]*)`", index) for p in expand(tok)]
  unmatched = [p for p in patterns if not fnmatch.filter(files, p)]
  assert not unmatched, f"benchmarks/README.md names files that do not exist: {unmatched}"
  orphans = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
  assert not orphans, f"results files missing from benchmarks/README.md's index: {orphans}"
