"""Tuned launch configs as data: the tables ``python -m pallas_norm.tune`` writes, and
their lookup.

A table is one JSON file per device kind (jax's ``device_kind``, lower case, spaces as
underscores: ``nvidia_h200.json``). The shipped ones are package data in this folder; a
user's own live in ``~/.cache/pallas_norm/`` (``PALLAS_NORM_TUNING_DIR`` overrides).
Each entry is the fastest config the tuner measured for one key and one backend (and,
for the forward, one mode):

  key     pass      "fwd" (the forward alone), "fwd_stats" (the forward that also writes
                    mean/rstd: under ``jax.vjp``), "bwd" (the backward, both stages),
                    or an FP8-output kernel: "fp8_stats", "fp8_delayed",
                    "fp8_delayed_t", "fp8_quantise", "fp8_quantise_t", "fp8_static"
                    (delayed scaling's y alone: ``stats=False``, no y_t)
          family    "rms" or "layer", then "_res" with ``residual=``, "_llama" with
                    ``cast="llama"``, "_post" with ``post_norm_scale=`` ("rms_res_post":
                    the one-kernel forward, "fwd" only)
          x         x's dtype name (an FP8 name: FP8 input, ``x_scale=``)
          params    scale's dtype name, "none" without scale
          n         the row length N
          m         the rows M it was measured at; looked up by ``m_bucket``
  value   backend, mode (forward), config (``config.entry_fields``' normalised
          fields), us (median kernel time), default_us (the default config's)

Lookup (``lookup``), with no timing: the user's table, then the shipped one. In a table,
the entries of the same pass, family and dtypes (and backend and mode where the caller
fixed them) with N_e of N's padded width N' (``padded_width``, the next power of 2: the
kernels' tiles are N' wide, and a tile tuned at one N' says nothing of another; H200,
2026-11-29: LayerNorm's fwd+bwd at 16384x16384 took 8063 us with the 8192x8192
entries rebuilt for it, 872 with the default:
benchmarks/results/h200_2026-11-29_steady_tuned_vs_untuned_a5624e7.log) and M_e in M's
bucket (``m_bucket``; all M above 4096 are one bucket, ``STEADY_BUCKET``: a config tuned
for one wave of few rows says nothing of many waves, nor the reverse); of those the nearest point: the smallest
|log2 N - log2 N_e|, then N_e >= N before N_e < N, then the larger M_e; at that point
(N_e, M_e) the smallest ``us``.
``config.py`` re-validates the entry for the actual shape and takes its default where
it does not fit. Deterministic; each table is read once a
process (``clear_cache`` forgets them). A missing shipped table for a GPU, or a corrupt
or older-version table, gives one warning, then the default.

``PALLAS_NORM_TUNING``: "all" (default), "shipped" (ignore the user's tables) or "none"
(ignore every table: the default alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import threading
import warnings

__all__ = ["FORMAT", "VERSION", "PASSES", "M_BUCKETS", "STEADY_BUCKET", "Key", "Entry", "Table",
           "TableError", "padded_width", "m_bucket", "device_slug", "shipped_path",
           "shipped_tables", "user_dir", "user_path", "tables", "lookup", "forced", "context",
           "clear_cache"]

FORMAT = "pallas_norm.tuning"
VERSION = 1
PASSES = ("fwd", "fwd_stats", "bwd", "fp8_stats", "fp8_delayed", "fp8_delayed_t",
          "fp8_quantise", "fp8_quantise_t", "fp8_static")
# Upper bounds of the M buckets (1 row; decode and small batches; training); M above the
# last is bucket len(M_BUCKETS).
M_BUCKETS = (1, 8, 64, 512, 4096, 32768, 262144)
# An entry applies in its own M bucket only; from this bucket up (more than 4096 rows:
# many waves, the steady state) the buckets are one.
STEADY_BUCKET = 5
_HERE = pathlib.Path(__file__).parent


class TableError(ValueError):
  """A table that cannot be used: not JSON, another format or version, a bad entry."""


def padded_width(n: int) -> int:
  """N' = the next power of 2 of ``n`` (at least 1): the width of the kernels' row tile,
  and the widths one table entry serves."""
  return 1 << max(int(n) - 1, 0).bit_length()


def m_bucket(m: int) -> int:
  """The index of the M bucket of ``m`` rows: the first ``M_BUCKETS`` bound >= m."""
  for i, hi in enumerate(M_BUCKETS):
    if m <= hi:
      return i
  return len(M_BUCKETS)


def _bucket(m: int) -> int:
  return min(m_bucket(m), STEADY_BUCKET)


def device_slug(kind: str) -> str:
  """A table's file stem for a device kind: "NVIDIA H200" -> "nvidia_h200"."""
  return "_".join(str(kind).lower().split()).replace("/", "_")


@dataclasses.dataclass(frozen=True)
class Key:
  """What a launch config is looked up by (module docstring)."""

  pass_: str
  family: str
  x: str
  params: str
  n: int
  m: int

  def __post_init__(self):
    if self.pass_ not in PASSES:
      raise ValueError(f"{self.pass_=} must be one of {PASSES}")
    if self.n < 1 or self.m < 1:
      raise ValueError(f"{self.n=} and {self.m=} must be >= 1")

  @property
  def group(self) -> tuple[str, str, str, str]:
    return self.pass_, self.family, self.x, self.params


def family(subtract_mean: bool, residual: bool = False, llama: bool = False,
           post_norm: bool = False) -> str:
  """A key's op family: "rms"/"layer", "_res" with the residual add, "_llama", "_post"
  (the post-norm before the residual add, ``post_norm_scale=``: its one-kernel forward)."""
  return ("layer" if subtract_mean else "rms") + ("_res" if residual else "") + (
      "_llama" if llama else "") + ("_post" if post_norm else "")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One measured winner: its key, the backend (and mode) and the normalised config
  (``config.entry_fields``), with its median time and the default's, in us."""

  key: Key
  backend: str
  mode: str
  config: tuple[tuple[str, object], ...]
  us: float | None = None
  default_us: float | None = None

  @property
  def fields(self) -> dict:
    return dict(self.config)

  def to_json(self) -> dict:
    k = self.key
    return dict(pass_=k.pass_, family=k.family, x=k.x, params=k.params, n=k.n, m=k.m,
                backend=self.backend, mode=self.mode, config=self.fields, us=self.us,
                default_us=self.default_us)

  @classmethod
  def from_json(cls, d: dict) -> "Entry":
    try:
      key = Key(str(d["pass_"]), str(d["family"]), str(d["x"]), str(d["params"]),
                int(d["n"]), int(d["m"]))
      cfg = d["config"]
      if not isinstance(cfg, dict):
        raise TypeError(f"config must be an object, got {type(cfg).__name__}")
      for a, b in cfg.items():
        if not isinstance(b, (bool, int, float)):
          raise TypeError(f"config value {a}={b!r} must be a number or a bool")
      cfg = tuple(sorted((str(a), b) for a, b in cfg.items()))
      us = None if d.get("us") is None else float(d["us"])
      dus = None if d.get("default_us") is None else float(d["default_us"])
      return cls(key, str(d["backend"]), str(d.get("mode") or ""), cfg, us, dus)
    except (KeyError, TypeError, ValueError) as e:
      raise TableError(f"bad entry {d!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Table:
  """A loaded table: ``meta`` (device kind, SM count, the last command, commit, date,
  and "runs": every run's, ``tune._runs``) and its entries grouped by ``Key.group``."""

  path: str
  meta: dict
  groups: dict

  @classmethod
  def from_doc(cls, doc, path: str = "<memory>") -> "Table":
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
      raise TableError(f"{path}: not a {FORMAT} table")
    if doc.get("version") != VERSION:
      raise TableError(f"{path}: table version {doc.get('version')!r}, this pallas_norm "
                       f"reads version {VERSION} (make it again: python -m pallas_norm.tune)")
    entries = doc.get("entries")
    if not isinstance(entries, list):
      raise TableError(f"{path}: 'entries' must be a list")
    groups: dict = {}
    for d in entries:
      try:
        e = Entry.from_json(d)
      except TableError as err:
        raise TableError(f"{path}: {err}") from None
      groups.setdefault(e.key.group, []).append(e)
    meta = {k: v for k, v in doc.items() if k != "entries"}
    return cls(path, meta, {g: tuple(v) for g, v in groups.items()})

  @classmethod
  def load(cls, path) -> "Table":
    try:
      doc = json.loads(pathlib.Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise TableError(f"{path}: {e}") from None
    return cls.from_doc(doc, str(path))

  def entries(self):
    for es in self.groups.values():
      yield from es

  def nearest(self, key: Key, backend: str | None = None,
              mode: str | None = None) -> Entry | None:
    """The entry for ``key`` by the module docstring's rule, or None."""
    b, w = _bucket(key.m), padded_width(key.n)
    cands = [e for e in self.groups.get(key.group, ())
             if (backend is None or e.backend == backend)
             and (mode is None or e.mode == mode)
             and padded_width(e.key.n) == w and _bucket(e.key.m) == b]
    if not cands:
      return None
    ln = math.log2(key.n)
    def dist(e):
      return (abs(math.log2(e.key.n) - ln), e.key.n < key.n, -e.key.m)
    best = min(dist(e) for e in cands)
    point = [e for e in cands if dist(e) == best]
    inf = float("inf")
    return min(point, key=lambda e: inf if e.us is None else e.us)


def to_doc(entries, meta: dict) -> dict:
  """A table's JSON document: ``meta``, then the entries sorted by key."""
  rows = sorted((e.to_json() for e in entries),
                key=lambda d: (d["pass_"], d["family"], d["x"], d["params"], d["n"],
                               d["m"], d["backend"], d["mode"]))
  return dict(format=FORMAT, version=VERSION, **meta, entries=rows)


def shipped_path(kind: str) -> pathlib.Path:
  """The shipped table of a device kind (package data beside this module)."""
  return _HERE / f"{device_slug(kind)}.json"


def shipped_tables() -> list[pathlib.Path]:
  """Every shipped table, of any device kind (sorted by name)."""
  return sorted(_HERE.glob("*.json"))


def user_dir() -> pathlib.Path:
  """Where a user's tables live: ``$PALLAS_NORM_TUNING_DIR``, else
  ``~/.cache/pallas_norm``."""
  d = os.environ.get("PALLAS_NORM_TUNING_DIR")
  return pathlib.Path(d) if d else pathlib.Path.home() / ".cache" / "pallas_norm"


def user_path(kind: str) -> pathlib.Path:
  return user_dir() / f"{device_slug(kind)}.json"


def _policy() -> str:
  p = os.environ.get("PALLAS_NORM_TUNING", "all").strip().lower() or "all"
  if p not in ("all", "shipped", "none"):
    raise ValueError(f"PALLAS_NORM_TUNING={p!r} must be 'all', 'shipped' or 'none'")
  return p


@functools.lru_cache(maxsize=None)
def _load(path: str, warn_missing: bool) -> Table | None:
  p = pathlib.Path(path)
  if not p.exists():
    if warn_missing:
      warnings.warn(f"pallas_norm: no tuned table for this GPU ({p.name} is not shipped); "
                    f"launch configs come from the default (config.py). "
                    f"`python -m pallas_norm.tune` makes one.", stacklevel=4)
    return None
  try:
    return Table.load(p)
  except TableError as e:
    warnings.warn(f"pallas_norm: ignoring a tuning table: {e}; launch configs come from "
                  f"the default (config.py).", stacklevel=4)
    return None


def tables(kind: str, gpu: bool = True) -> tuple[Table, ...]:
  """The tables that apply to device kind ``kind``, first match first: the user's, then
  the shipped one (``PALLAS_NORM_TUNING`` may drop either). ``gpu``: warn once where a
  GPU has no shipped table."""
  policy = _policy()
  if policy == "none":
    return ()
  out = []
  if policy == "all":
    out.append(_load(str(user_path(kind)), False))
  # a GPU with neither table: one warning (the user's own table is enough)
  out.append(_load(str(shipped_path(kind)), gpu and out[:1] in ([], [None])))
  return tuple(t for t in out if t is not None)


_FORCED = threading.local()


@contextlib.contextmanager
def forced(*entries: Entry):
  """Within the block, ``lookup`` answers these entries first, by exact key group and
  nearest point, as if they were the first table (the tuner times candidates so)."""
  prev = getattr(_FORCED, "table", None)
  groups: dict = {}
  for e in entries:
    groups.setdefault(e.key.group, []).append(e)
  _FORCED.table = Table("<forced>", {}, {g: tuple(v) for g, v in groups.items()})
  try:
    yield
  finally:
    _FORCED.table = prev


def lookup(key: Key, kind: str, *, backend: str | None = None, mode: str | None = None,
           gpu: bool = True) -> tuple[Entry, Table] | None:
  """The entry for ``key`` on device kind ``kind`` and the table it came from, or None
  (module docstring). ``backend`` / ``mode``: only entries of those."""
  forced_table = getattr(_FORCED, "table", None)
  for t in ((forced_table,) if forced_table is not None else ()) + tables(kind, gpu):
    e = t.nearest(key, backend, mode)
    if e is not None:
      return e, t
  return None


_GENERATION = [0]  # counts clear_cache() calls


def context() -> tuple:
  """A hashable token of what lookups answer now (the policy, the user's folder, the
  tables read since the last ``clear_cache``, the forced entries): the ops put it in
  their jit's static arguments, so that a change is traced again rather than served
  from a cached trace."""
  forced_table = getattr(_FORCED, "table", None)
  entries = () if forced_table is None else tuple(forced_table.entries())
  return (_policy(), str(user_dir()), _GENERATION[0], entries)


def clear_cache() -> None:
  """Forget the tables read so far (and their warnings): the next lookup reads again,
  and the ops trace again."""
  _load.cache_clear()
  _GENERATION[0] += 1
