"""Result files, the summary table and the plot of the kernel bench.

Output of a run: JSON (``meta``, ``rows``, ``summary``: pallas_norm's heuristic against
the best peer per cell), CSV of the rows and a PNG plot at ``--out`` (default
``benchmarks/results/<device>_<date>.json``); the table is printed last.
``--plot-only A.json [B.json ...]`` merges result files (``merge``: a later file's row
replaces an earlier one's) and redraws the plot and the table.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import pathlib

from pallas_norm.bench import timing
from pallas_norm.bench.plan import (IMPL_BY_NAME, IMPLS, KERNEL_OPS, PASSES, fp8_static,
                                    fp8_variant)

_STATUSES = {"ok": "", "n/a": "n/a", "skipped": "skip", "error": "err",
             "unavailable": "unav", "not run": "-"}

_CSV_FIELDS = ("op", "pass", "m", "n", "dtype", "impl", "family", "status", "us", "us_p10",
               "us_p90", "gbs", "pct_copy", "bytes", "rotations", "iters", "timer",
               "compile_s", "check", "check_detail", "kernels", "kernel_us", "bytes_design",
               "gbs_design", "rounds_us", "reason")


def out_path(args, meta: dict) -> pathlib.Path:
  """``--out``, else benchmarks/results/<device>_<date>.json."""
  if args.out:
    return pathlib.Path(args.out)
  name = f"{timing.slug(meta['device'])}_{meta['date'][:10]}.json"
  return pathlib.Path("benchmarks/results") / name


def write(path: pathlib.Path, meta: dict, rows: list[dict]) -> None:
  """The JSON (meta, rows, summary) at ``path`` and the rows' CSV beside it."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary(rows)},
                             indent=1, default=str) + "\n")
  with path.with_suffix(".csv").open("w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=_CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({**r, "kernels": ";".join(r.get("kernels", [])),
                  "kernel_us": ";".join(f"{t:.2f}" for t in r.get("kernel_us", [])),
                  "rounds_us": ";".join(f"{t:.3f}" for t in r.get("rounds_us", []))})


def finish(path: pathlib.Path, doc: dict) -> None:
  """The PNG beside ``path`` (a failed plot is reported, not raised), then the table."""
  png = path.with_suffix(".png")
  try:
    plot(doc, png)
    print(f"wrote {png}")
  except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
    print(f"plot failed: {type(e).__name__}: {e}")
  print(format_table(doc["rows"], doc["meta"]), flush=True)


def shape_txt(r: dict) -> str:
  return f"{r['m']}x{r['n']}"


def _key(r: dict):
  return (r["op"], r["pass"], r["m"], r["n"])


def summary(rows: list[dict]) -> list[dict]:
  """Per (op, pass, shape): pallas_norm's heuristic against the best peer."""
  out = []
  for key in dict.fromkeys(_key(r) for r in rows):
    ok = [r for r in rows if _key(r) == key and r["status"] == "ok"]
    peers = [r for r in ok if r["family"] == "peer"]
    ours = [r for r in ok if r["family"] == "pallas_norm"]
    heur = next((r for r in ok if r["impl"] == "pallas"), None)
    best_peer = max(peers, key=lambda r: r["gbs"], default=None)
    best_ours = max(ours, key=lambda r: r["gbs"], default=None)
    s = {"op": key[0], "pass": key[1], "m": key[2], "n": key[3],
         "pallas_gbs": heur and heur["gbs"], "pallas_pct_copy": heur and heur.get("pct_copy"),
         "best_peer": best_peer and best_peer["impl"],
         "best_peer_gbs": best_peer and best_peer["gbs"],
         "best_pallas_norm": best_ours and best_ours["impl"],
         "best_pallas_norm_gbs": best_ours and best_ours["gbs"]}
    s["ratio"] = (heur["gbs"] / best_peer["gbs"]) if heur and best_peer else None
    out.append(s)
  return out


def format_table(rows: list[dict], meta: dict) -> str:
  """GB/s per (op, pass, shape) x implementation, then pallas vs the best peer."""
  impls = [i for i in IMPLS if any(r["impl"] == i.name for r in rows)]
  width = {i.name: max(6, len(i.abbrev)) for i in impls}
  copy = meta.get("copy_gbs")
  fp8 = any(fp8_variant(r["op"]) for r in rows)
  fp8in = any(r["op"].endswith("_fp8in") for r in rows)
  lines = [f"{meta.get('device', '?')}  {meta.get('dtype', '?')}  {meta.get('date', '?')}  "
           f"GB/s (fwd 2*M*N*s, fwd+bwd 5*M*N*s bytes"
           f"{'; *_res 4 and 8' if any(r['op'].endswith('_res') for r in rows) else ''}"
           f"{'; *_fp8* (s+1)*M*N, +M*N with y_t' if fp8 else ''}"
           f"{'; *_fp8in (1+s+1/4)*M*N, +(1+2s+1/4)*M*N' if fp8in else ''}); copy "
           f"{f'{copy:.0f}' if copy else 'n/a'} GB/s; commit {str(meta.get('git_commit'))[:10]}"]
  for src in meta.get("merged_from", []):  # rows of several runs; % of copy is each run's
    lines.append(f"  merged: {src['file']} ({src['date']}, commit {src['git_commit']}, copy "
                 f"{src['copy_gbs'] or 0:.0f} GB/s)")
  ow = max([5] + [len(r["op"]) for r in rows])
  head = f"{'op':{ow}} {'pass':6} {'MxN':12}" + "".join(
      f" {i.abbrev:>{width[i.name]}}" for i in impls)
  lines.append(head + f" | {'pal%cp':>6} {'best peer':>13} {'pal/peer':>8}")
  by = {(_key(r), r["impl"]): r for r in rows}
  for s in summary(rows):
    key = (s["op"], s["pass"], s["m"], s["n"])
    cells = []
    for i in impls:
      r = by.get((key, i.name))
      if r is None:
        txt = ""
      elif r["status"] == "ok":
        txt = f"{r['gbs']:.0f}" + ("!" if r.get("check") == "FAIL" else "")
      else:
        txt = _STATUSES.get(r["status"], r["status"])
      cells.append(f" {txt:>{width[i.name]}}")
    pct = f"{s['pallas_pct_copy']:.0f}%" if s["pallas_pct_copy"] is not None else "-"
    peer = (f"{s['best_peer_gbs']:.0f} {s['best_peer']}" if s["best_peer"] else "-")
    ratio = f"{s['ratio']:.2f}" if s["ratio"] is not None else "-"
    lines.append(f"{s['op']:{ow}} {s['pass']:6} {shape_txt(s):<12}"
                 + "".join(cells) + f" | {pct:>6} {peer:>13} {ratio:>8}")
  legend = ", ".join(f"{i.abbrev}={i.name}" for i in impls)
  lines.append(f"{legend}; n/a=no CUPTI kernels, err=error, skip=refused (e.g. cached N), "
               f"unav=not importable, -=not run, !=--check failed")
  return "\n".join(lines)


def plot(doc: dict, png: str | os.PathLike) -> None:
  """GB/s against N (log2), one line per implementation, one panel per (op, pass)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in doc["rows"] if r["status"] == "ok"]
  meta = doc["meta"]
  ops = [op for op in KERNEL_OPS if any(r["op"] == op for r in rows)] or ["rms"]
  passes = [p for p in PASSES if any(r["pass"] == p for r in rows)] or ["fwd"]
  fig, axes = plt.subplots(len(ops), len(passes), figsize=(6.5 * len(passes), 4.5 * len(ops)),
                           squeeze=False)
  for (i, op), (j, p) in itertools.product(enumerate(ops), enumerate(passes)):
    ax = axes[i][j]
    for impl in dict.fromkeys(r["impl"] for r in rows):
      pts = sorted((r["n"], r["m"], r["gbs"]) for r in rows
                   if r["op"] == op and r["pass"] == p and r["impl"] == impl)
      if pts:
        style = "-o" if IMPL_BY_NAME.get(impl, IMPLS[0]).family == "pallas_norm" else "--s"
        ax.plot([q[0] for q in pts], [q[2] for q in pts], style, ms=4, label=impl)
    if meta.get("copy_gbs"):
      ax.axhline(meta["copy_gbs"], color="k", lw=1, ls=":",
                 label=f"copy {meta['copy_gbs']:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("N (hidden size)")
    ax.set_ylabel("GB/s (fwd (s+1)MN (+MN y_t))" if fp8_variant(op)
                  else "GB/s (fwd 2MNs, fwd+bwd 5MNs)")
    ax.set_title(f"{_title(op)} {'forward' if p == 'fwd' else 'forward+backward'}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
  fig.suptitle(f"{meta.get('device', '?')} {meta.get('dtype', '')} - {str(meta.get('date', ''))[:10]}")
  fig.tight_layout()
  save_png(fig, png)
  plt.close(fig)


def save_png(fig, path, dpi: int = 110) -> None:
  """Write matplotlib ``fig`` to ``path`` as a PNG re-encoded with a 256-colour palette
  (Pillow, matplotlib's own dependency): a plot's few colours and their antialiasing
  shades survive it, and the file is about 3x smaller than the RGBA one.
  benchmarks/results travels with the working tree to the GPU machine, which takes at
  most 64 MiB."""
  fig.savefig(path, dpi=dpi)
  from PIL import Image  # Pillow: imported where a figure is drawn, as matplotlib is
  with Image.open(path) as im:
    pal = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
  pal.save(path, optimize=True)


def _title(op: str) -> str:
  """"rms" -> "RMSNorm", "layer_fp8_delayed_t" -> "LayerNorm FP8 delayed +y_t"."""
  name = "LayerNorm" if op.startswith("layer") else "RMSNorm"
  if op.endswith("_fp8in"):
    return f"{name} FP8 input"
  if op == "rms_post_res":
    return f"{name} post-norm +residual"
  if op.endswith("_res"):
    return f"{name} +residual"
  fp8 = fp8_variant(op)
  if fp8 is None:
    return name
  if fp8_static(op):
    return f"{name} FP8 static scale (y only)" + (" +residual" if op.endswith("_res") else "")
  return f"{name} FP8 {'delayed' if fp8[1] else 'current'}{' +y_t' if fp8[2] else ''}"


def merge(paths: list[str]) -> dict:
  """Rows of several result files; a later file's row replaces an earlier one's.
  ValueError for a file that is missing, not JSON, or not a kernel-bench result (a
  JSON with "meta" and "rows" of op/pass/shape rows)."""
  rows: dict = {}
  meta: dict = {}
  sources = []
  for p in paths:
    try:
      doc = json.loads(pathlib.Path(p).read_text())
    except (OSError, ValueError) as e:
      raise ValueError(f"--plot-only {p}: cannot read it as JSON ({type(e).__name__}: {e})")
    if not (isinstance(doc, dict) and isinstance(doc.get("meta"), dict)
            and isinstance(doc.get("rows"), list)
            and all(isinstance(r, dict) and {"op", "pass", "m", "n", "impl"} <= set(r)
                    for r in doc["rows"])):
      raise ValueError(f"--plot-only {p}: not a `python -m pallas_norm.bench` kernel result "
                       f"(a JSON of 'meta' and 'rows' with op, pass, m, n, impl); the other "
                       f"scripts' files have their own format (benchmarks/README.md)")
    meta = {**meta, **doc["meta"]}
    sources.append({k: doc["meta"].get(k) for k in ("date", "git_commit", "device", "copy_gbs",
                                                    "argv")} | {"file": pathlib.Path(p).name})
    for r in doc["rows"]:
      rows[(_key(r), r["dtype"], r["impl"])] = r
  if len(paths) > 1:  # each row keeps its own run's % of copy; meta names every run
    meta["merged_from"] = sources
  return {"meta": meta, "rows": list(rows.values())}


