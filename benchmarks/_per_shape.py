"""The command line of the per-shape sweep scripts (mosaic_sweep.py,
param_dtype_sweep.py): each shape in its own process (a fault loses that shape only),
its ROW lines printed as they come, the JSON written after every shape.

    python benchmarks/SCRIPT.py [--out FILE.json]   every shape of SHAPES
    python benchmarks/SCRIPT.py OP M N             one shape (what the first runs)
"""
import json
import subprocess
import sys
import traceback


def pct_of_copy(us, streams: int, m: int, n: int, itemsize: int, copy_gbs):
  """% of the copy's GB/s that ``streams`` [M, N] arrays of ``itemsize`` moved in ``us``
  microseconds reach (None without a time or a copy figure)."""
  if not us or not copy_gbs:
    return None
  return 100 * streams * m * n * itemsize / (us * 1e-6) / 1e9 / copy_gbs


def record(rows: list, shape: dict, row: dict, measure):
  """``measure(row)`` fills ``row`` (time, % of copy, differences) and returns what the
  caller keeps; a config that does not fit (any exception) is recorded in
  ``row["error"]`` instead, not fatal (None is returned). The row is appended to
  ``rows`` and printed as a ``ROW`` line (JSON, with ``shape``) at once."""
  out = None
  try:
    out = measure(row)
  except Exception as e:  # noqa: BLE001 (a failing config is a result)
    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  rows.append(row)
  print("ROW " + json.dumps(dict(**shape, **row)), flush=True)
  return out


def main(script: str, run_shape, shapes, fmt, timeout: int = 300) -> None:
  """``run_shape(op, m, n) -> dict`` with ``rows``; ``fmt(op, m, n, row) -> str``, the
  line printed for a row."""
  if len(sys.argv) > 1 and sys.argv[1] != "--out":
    op, m, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:
      r = dict(ok=True, **run_shape(op, m, n))
    except Exception:
      r = dict(ok=False, error=traceback.format_exc()[-1800:])
    print("RESULT " + json.dumps(dict(op=op, m=m, n=n, **r)), flush=True)
    return
  out = sys.argv[2] if len(sys.argv) > 2 else None
  results = []
  for c in shapes:
    p = subprocess.run([sys.executable, script, *map(str, c)], capture_output=True,
                       text=True, timeout=timeout)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
    if lines:
      results.append(json.loads(lines[-1][7:]))
    else:
      rows = [json.loads(l[4:]) for l in p.stdout.splitlines() if l.startswith("ROW ")]
      results.append(dict(op=c[0], m=c[1], n=c[2], ok=False, rows=rows,
                          error=f"rc={p.returncode} {p.stderr[-1500:]}"))
    r = results[-1]
    for row in r.get("rows", []):
      print(fmt(*c, row), flush=True)
    if not r.get("ok"):
      print("  FAILED", r.get("error", "")[-600:], flush=True)
    if out:  # after every shape: a run cut short keeps what it measured
      json.dump(results, open(out, "w"), indent=1)
