"""Tuning as data (issue #57): the tables' lookup (pallas_norm.tuning) and the config
glue (config.table_key, entry_fields, from_entry, fits), on CPU.

  lookup       the nearest point (N by log distance within N's padded width, then the M
               bucket only, then N_e >= N, then the larger M_e), the smallest us there,
               the backend= / mode= filters, the key's group;
  sources      the user's table before the shipped one; PALLAS_NORM_TUNING all /
               shipped / none and a bad value; forced() entries;
  warnings     a missing table for a GPU, a corrupt or older-version table: one warning
               a file (until tuning.clear_cache()) and the default, never a crash;
  from_entry   re-validation (split rows beyond residency, a whole-row cached tile past
               32768, block_m past the rows, pieces) and the round trip
               entry_fields -> Entry -> from_entry;
  the op       rms_norm in interpret mode runs the user table's config, matches the
               reference, and an explicit mode= wins;
  packaging    a built wheel carries pallas_norm/tuning/*.json.
"""

import contextlib
import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys
import tomllib
import warnings
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from pallas_norm import config, reference, tuning
from pallas_norm.kernels import forward

CPU = config.DeviceInfo("cpu", "cpu", 4)
H100 = config.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 132)
H200 = config.DeviceInfo("gpu", "NVIDIA H200", 132)
A100 = config.DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108)
SMALL = config.DeviceInfo("gpu", "NVIDIA Small GPU", 4)  # few SMs: little residency
REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_TUNING = pathlib.Path(tuning.__file__).parent  # the real shipped-table folder
# a distinctive forward config for RMSNorm bf16 at N = 256 (the default there is
# multi_wave_cached [16, 256] x 4 warps on CPU)
TUNED = dict(block_m=8, block_n=128, num_warps=2)


@pytest.fixture(autouse=True)
def _fresh_tables(monkeypatch, tmp_path):
  """A user folder and a shipped folder of this test's own (both empty), the default
  policy, and no table cached from another test."""
  monkeypatch.setenv("PALLAS_NORM_TUNING_DIR", str(tmp_path / "user"))
  monkeypatch.delenv("PALLAS_NORM_TUNING", raising=False)
  monkeypatch.setattr(tuning, "_HERE", tmp_path / "shipped")
  tuning.clear_cache()
  yield
  tuning.clear_cache()


def _entry(n=256, m=16, *, pass_="fwd", family="rms", x="bfloat16", params="none",
           backend="pallas", mode="multi_wave_reload", us=1.0, **cfg) -> tuning.Entry:
  cfg = cfg or TUNED
  return tuning.Entry(tuning.Key(pass_, family, x, params, n, m), backend, mode,
                      tuple(sorted(cfg.items())), us)


def _as_entry(cfg, pass_: str, m: int, n: int, device, backend: str = "pallas",
              dtype=jnp.bfloat16, subtract_mean: bool = False) -> tuning.Entry:
  """A config stored as the tuner stores it (through JSON)."""
  key = config.table_key(pass_, m, n, dtype, subtract_mean=subtract_mean)
  e = tuning.Entry(key, backend, getattr(cfg, "mode", ""),
                   tuple(sorted(config.entry_fields(cfg, n, device.num_sms).items())))
  return tuning.Entry.from_json(json.loads(json.dumps(e.to_json())))


def _table(*entries) -> tuning.Table:
  return tuning.Table.from_doc(json.loads(json.dumps(tuning.to_doc(entries, {}))))


def _write(path: pathlib.Path, doc) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
  return path


def _write_table(folder: pathlib.Path, kind: str, *entries) -> pathlib.Path:
  return _write(folder / f"{tuning.device_slug(kind)}.json",
                tuning.to_doc(entries, {"device_kind": kind}))


def _user() -> pathlib.Path:
  return tuning.user_dir()


def _shipped() -> pathlib.Path:
  return tuning.shipped_path("x").parent


@contextlib.contextmanager
def _recorded():
  """The pallas_norm warnings raised in the block, every one (no deduplication)."""
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    got: list = []
    yield got
    got.extend(str(w.message) for w in seen if "pallas_norm" in str(w.message))


def _fwd(device=CPU, m=16, n=256, **kw):
  """forward_config as ops calls it for rms_norm(x) (bf16, no scale, no vjp)."""
  return config.forward_config(m, n, jnp.bfloat16, kw.pop("mode", None), device,
                               return_residuals=False, **kw)


def _default(device=CPU, m=16, n=256, **kw):
  return _fwd(device, m, n, tuned=False, **kw)


# ------------------------------------------------------------------------------ lookup


def test_nearest_n_by_log_distance():
  near, far = _entry(n=2560, us=9.0), _entry(n=4096, us=1.0)
  t = _table(far, near)
  # |log2 2600 - log2 2560| = 0.02 < |log2 4096 - log2 2600| = 0.66, whatever the us
  assert t.nearest(tuning.Key("fwd", "rms", "bfloat16", "none", 2600, 16)) == near
  assert t.nearest(tuning.Key("fwd", "rms", "bfloat16", "none", 3600, 16)) == far


def test_an_entry_serves_its_padded_width_only():
  """N' (the next power of 2) is the kernels' tile width: an entry serves the N of its
  own N' and no other, however near (8192's one tile at 16384 spills)."""
  t = _table(_entry(n=2048))
  key = lambda n: tuning.Key("fwd", "rms", "bfloat16", "none", n, 16)
  assert t.nearest(key(2048)) is not None and t.nearest(key(1025)) is not None
  assert t.nearest(key(2049)) is None and t.nearest(key(1024)) is None
  assert [tuning.padded_width(n) for n in (1, 2, 3, 1024, 1025, 5120)] == [
      1, 2, 4, 1024, 2048, 8192]


def test_own_m_bucket_then_wider_n_then_larger_m():
  one, small, big = _entry(m=1, us=3.0), _entry(m=16, us=2.0), _entry(m=8192, us=1.0)
  t = _table(one, small, big)
  key = lambda n, m: tuning.Key("fwd", "rms", "bfloat16", "none", n, m)
  assert t.nearest(key(256, 1)) == one       # bucket 0 (M = 1)
  assert t.nearest(key(256, 40)) == small    # bucket 2 (9..64)
  assert t.nearest(key(256, 5)) is None      # bucket 1: no entry there, the default
  assert t.nearest(key(256, 2000)) is None   # bucket 4
  # from 4097 rows up one bucket (STEADY_BUCKET)
  assert t.nearest(key(256, 4097)) == big and t.nearest(key(256, 10 ** 6)) == big
  # the same log distance either side: N_e >= N first, wherever it sits in the table
  lo, hi = _entry(n=576, us=1.0), _entry(n=1024, us=5.0)  # 768 = sqrt(576 * 1024)
  for t in (_table(lo, hi), _table(hi, lo)):
    assert t.nearest(key(768, 16)) == hi
  # the same point but for M_e within one bucket (9..64): the larger M_e
  m16, m64 = _entry(m=16, us=1.0), _entry(m=64, us=5.0)
  for t in (_table(m16, m64), _table(m64, m16)):
    assert t.nearest(key(256, 32)) == m64
  # another bucket is never taken, even at the same N
  t = _table(_entry(n=256, m=1, us=7.0), _entry(n=200, m=16, us=1.0))
  assert t.nearest(key(256, 16)).key.n == 200


def test_smallest_us_at_the_point_and_the_filters():
  reload_ = _entry(us=5.0)
  cached = _entry(mode="multi_wave_cached", us=4.0)
  triton = _entry(backend="triton", mode="multi_wave_cached", us=3.0)
  untimed = _entry(backend="mosaic", mode="multi_wave_cached", us=None)
  elsewhere = _entry(n=200, us=0.5)  # faster, but not the nearest point
  t = _table(untimed, reload_, elsewhere, cached, triton)
  key = tuning.Key("fwd", "rms", "bfloat16", "none", 256, 16)
  assert t.nearest(key) == triton
  assert t.nearest(key, backend="pallas") == cached
  assert t.nearest(key, mode="multi_wave_reload") == reload_
  assert t.nearest(key, backend="pallas", mode="multi_wave_reload") == reload_
  assert t.nearest(key, backend="mosaic") == untimed
  assert t.nearest(key, mode="static_persistent") is None
  # the filters apply before the nearest point: at 220 elsewhere (200) is nearest, but
  # the only cached entries are at 256
  near = tuning.Key("fwd", "rms", "bfloat16", "none", 220, 16)
  assert t.nearest(near) == elsewhere
  assert t.nearest(near, backend="pallas", mode="multi_wave_cached") == cached


@pytest.mark.parametrize("field,value", [
    ("pass_", "fwd_stats"), ("pass_", "bwd"), ("family", "layer"), ("family", "rms_res"),
    ("family", "rms_llama"), ("x", "float32"), ("params", "bfloat16")])
def test_another_key_group_does_not_match(field, value):
  t = _table(_entry())
  key = dict(pass_="fwd", family="rms", x="bfloat16", params="none", n=256, m=16)
  assert t.nearest(tuning.Key(**key)) is not None
  assert t.nearest(tuning.Key(**{**key, field: value})) is None


def test_table_key_of_a_call():
  k = config.table_key("fwd_stats", 0, 4096, jnp.bfloat16, subtract_mean=True,
                       residual=True, param_dtype=jnp.float32)
  assert k == tuning.Key("fwd_stats", "layer_res", "bfloat16", "float32", 4096, 1)
  k = config.table_key("bwd", 7, 100, jnp.float16, subtract_mean=False, llama=True)
  assert k.group == ("bwd", "rms_llama", "float16", "none")


# ----------------------------------------------------------------------------- sources


@pytest.mark.parametrize("policy,want", [
    (None, "user"), ("all", "user"), ("ALL ", "user"), ("shipped", "shipped"),
    ("none", None)])
def test_user_table_wins_over_shipped_and_the_policy(monkeypatch, policy, want):
  user = _entry(num_warps=2, block_m=8, block_n=128)
  shipped = _entry(num_warps=1, block_m=8, block_n=64)
  _write_table(_user(), "cpu", user)
  _write_table(_shipped(), "cpu", shipped)
  if policy is not None:
    monkeypatch.setenv("PALLAS_NORM_TUNING", policy)
  key = config.table_key("fwd", 16, 256, jnp.bfloat16, subtract_mean=False)
  found = tuning.lookup(key, "cpu", gpu=False)
  expect = {"user": user, "shipped": shipped, None: None}[want]
  assert (found and found[0]) == expect
  cfg = _fwd()
  assert cfg == (config.from_entry(expect, 16, 256, CPU, "pallas") if expect
                 else _default())
  if expect:
    assert cfg != _default()  # the entry is distinctive: a table was read


def test_the_shipped_table_answers_what_the_users_does_not():
  _write_table(_user(), "cpu", _entry(n=4096))
  shipped = _entry(n=256, num_warps=1, block_m=8, block_n=64)
  _write_table(_shipped(), "cpu", shipped)
  key = config.table_key("fwd", 16, 256, jnp.bfloat16, subtract_mean=False)
  entry, table = tuning.lookup(key, "cpu", gpu=False)
  assert entry == shipped and pathlib.Path(table.path).parent == _shipped()


@pytest.mark.parametrize("value", ["user", "off", "0"])
def test_a_bad_policy_raises(monkeypatch, value):
  monkeypatch.setenv("PALLAS_NORM_TUNING", value)
  key = config.table_key("fwd", 16, 256, jnp.bfloat16, subtract_mean=False)
  with pytest.raises(ValueError, match="PALLAS_NORM_TUNING"):
    tuning.lookup(key, "cpu", gpu=False)
  with pytest.raises(ValueError, match="PALLAS_NORM_TUNING"):
    _fwd()


def test_forced_entries_answer_first():
  wide = _entry(n=2048, block_m=1, block_n=512, num_warps=4)
  _write_table(_user(), "cpu", _entry(), wide)
  forced = _entry(num_warps=1, block_m=8, block_n=64, us=99.0)
  before = tuning.context()
  with tuning.forced(forced):
    assert tuning.context() != before
    assert _fwd() == config.from_entry(forced, 16, 256, CPU, "pallas")
    assert _fwd(n=200) == config.from_entry(forced, 16, 200, CPU, "pallas")  # nearest
    # beyond the forced entries' reach (another N'): the tables as usual
    assert _fwd(n=2048) == config.from_entry(wide, 16, 2048, CPU, "pallas")
  assert tuning.context() == before
  assert _fwd() == config.from_entry(_entry(), 16, 256, CPU, "pallas")


# ---------------------------------------------------------------------------- warnings


def test_a_missing_gpu_table_warns_once_and_gives_the_default(monkeypatch):
  gpu = config.DeviceInfo("gpu", "NVIDIA Test GPU", 132)
  with _recorded() as got:
    fwd = [_fwd(gpu, 4096, 4096) for _ in range(3)]
    bwd = config.backward_config(4096, 4096, jnp.bfloat16, gpu)
    assert config.choose_backend("fwd", 4096, jnp.bfloat16, device=gpu, m=4096) == "pallas"
  assert len(got) == 1 and "nvidia_test_gpu.json" in got[0]
  assert fwd == [_default(gpu, 4096, 4096)] * 3
  assert bwd == config.backward_config(4096, 4096, jnp.bfloat16, gpu, tuned=False)
  tuning.clear_cache()  # forgets the warning too
  with _recorded() as got:
    _fwd(gpu, 4096, 4096)
  assert len(got) == 1
  # no warning on CPU (no table is shipped for it), nor where tables are off
  with _recorded() as got:
    _fwd()
    monkeypatch.setenv("PALLAS_NORM_TUNING", "none")
    tuning.clear_cache()
    _fwd(gpu, 4096, 4096)
  assert got == []


def _doc(**kw):
  return dict(tuning.to_doc([_entry()], {"device_kind": "cpu"}), **kw)


def _bad_entry(**kw):
  return {**_entry(n=512).to_json(), **kw}


def _with(bad) -> dict:
  """A table of the good entry and ``bad``."""
  return _doc(entries=_doc()["entries"] + [bad])


CORRUPT = {
    "not_json": "{ this is not json",
    "empty_file": "",
    "a_list": [],
    "another_format": _doc(format="someone.else"),
    "no_format": {k: v for k, v in _doc().items() if k != "format"},
    "older_version": _doc(version=tuning.VERSION - 1),
    "newer_version": _doc(version=tuning.VERSION + 1),
    "entries_not_a_list": _doc(entries={"a": 1}),
    "entry_without_n": _with({k: v for k, v in _bad_entry().items() if k != "n"}),
    "entry_of_an_unknown_pass": _with(_bad_entry(pass_="fwdd")),
    "entry_with_n_0": _with(_bad_entry(n=0)),
    "entry_config_not_an_object": _with(_bad_entry(config=[1])),
    "entry_us_not_a_number": _with(_bad_entry(us="fast")),
    "entry_not_an_object": _with(3),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_a_corrupt_table_warns_once_and_gives_the_default(case):
  """The table also holds a good entry for the key: ignored with the rest."""
  path = _write(_user() / "cpu.json", CORRUPT[case])
  assert _default() != config.from_entry(_entry(), 16, 256, CPU, "pallas")
  with _recorded() as got:
    cfgs = [_fwd() for _ in range(3)]
    cfgs.append(_fwd(mode="multi_wave_reload"))
  assert cfgs[:3] == [_default()] * 3
  assert cfgs[3] == _default(mode="multi_wave_reload")
  assert len(got) == 1 and "ignoring a tuning table" in got[0]
  if not case.startswith("entry_"):  # a bad entry's message names the entry, not the file
    assert str(path) in got[0]
  if "version" in case:
    assert "version" in got[0]
  tuning.clear_cache()
  with _recorded() as got:
    _fwd()
  assert len(got) == 1


def test_two_corrupt_tables_warn_once_each():
  _write(_user() / "cpu.json", "{")
  _write(_shipped() / "cpu.json", _doc(version=0))
  with _recorded() as got:
    for _ in range(2):
      assert _fwd() == _default()
  assert len(got) == 2


@pytest.mark.parametrize("cfg", [
    dict(TUNED, block_m="eight"), dict(TUNED, block_m=None), dict(TUNED, block_n=[128]),
    dict(TUNED, programs_per_sm="many"), dict(TUNED, chunk_n="x")],
    ids=["block_m_str", "block_m_null", "block_n_list", "programs_per_sm_str", "chunk_n_str"])
def test_a_bad_config_value_warns_once_and_gives_the_default(cfg):
  _write_table(_user(), "cpu", _entry(**cfg))
  with _recorded() as got:
    cfgs = [_fwd() for _ in range(2)]
  assert cfgs == [_default()] * 2
  assert len(got) == 1


def test_an_unknown_config_field_gives_the_default():
  _write_table(_user(), "cpu", _entry(**TUNED, bogus=3))
  assert _fwd() == _default()


# -------------------------------------------------------------------------- from_entry


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_split_rows_beyond_residency_give_the_default(pass_):
  """A split-row entry measured on 132 SMs, looked up on a GPU of 4: 64 (forward) or 128
  (backward) programs a row, more than 4 SMs x split_resident_programs(1) = 32."""
  m, n = 4096, 65536
  if pass_ == "fwd":
    cfg = config.forward_config(m, n, jnp.bfloat16, "static_persistent", H200,
                                subtract_mean=True, tuned=False)
  else:
    cfg = config.backward_config(m, n, jnp.bfloat16, H200, subtract_mean=True,
                                 tuned=False)
  assert cfg.split_rows and config.cdiv(n, cfg.block_n) > SMALL.num_sms * (
      config.split_resident_programs(cfg.num_warps))
  e = _as_entry(cfg, pass_, m, n, H200, subtract_mean=True)
  assert config.from_entry(e, m, n, H200, "pallas") == cfg
  assert config.from_entry(e, m, n, SMALL, "pallas") is None
  assert config.from_entry(e, m, n, H200, "triton") is None  # split rows: Pallas only
  # through the tables: the default for SMALL
  _write_table(_user(), SMALL.name, e)
  with _recorded():
    if pass_ == "fwd":
      got = config.forward_config(m, n, jnp.bfloat16, "static_persistent", SMALL,
                                  subtract_mean=True)
      want = config.forward_config(m, n, jnp.bfloat16, "static_persistent", SMALL,
                                   subtract_mean=True, tuned=False)
    else:
      got = config.backward_config(m, n, jnp.bfloat16, SMALL, subtract_mean=True)
      want = config.backward_config(m, n, jnp.bfloat16, SMALL, subtract_mean=True,
                                    tuned=False)
  assert got == want and not got.split_rows


def test_a_cached_whole_row_entry_past_32768_gives_the_default():
  cfg = config.ForwardConfig("multi_wave_cached", 1, 32768, 16)
  e = _as_entry(cfg, "fwd", 4096, 32768, H200)
  assert config.from_entry(e, 4096, 30000, H200, "pallas") == cfg
  assert config.from_entry(e, 4096, 40000, H200, "pallas") is None  # pads to 65536
  _write_table(_user(), H200.name, e)
  with _recorded():
    got = config.forward_config(4096, 40000, jnp.bfloat16, None, H200,
                                return_residuals=False)
  assert got == config.forward_config(4096, 40000, jnp.bfloat16, None, H200,
                                      return_residuals=False, tuned=False)
  assert not (got.mode == "multi_wave_cached" and got.block_n >= 40000)


def test_from_entry_clamps_block_m_and_the_grid_to_the_rows():
  e = _entry(m=4096, mode="static_persistent", block_m=64, block_n=256, num_warps=4,
             programs_per_sm=2.0)
  for m, block_m, programs in ((4096, 64, 64), (1000, 64, 16), (3, 4, 1), (1, 1, 1)):
    cfg = config.from_entry(e, m, 256, H200, "pallas")
    assert (cfg.block_m, cfg.num_programs) == (block_m, programs)
  # 2 programs a SM of this device, where the rows allow
  assert config.from_entry(e, 10 ** 6, 256, A100, "pallas").num_programs == 216
  # CPU: interpret mode's row block (at least min(64, next_power_of_2(m)))
  assert config.from_entry(e, 16, 256, CPU, "pallas").block_m == 16
  assert config.from_entry(e, 3, 256, CPU, "pallas").block_m == 4


def test_from_entry_block_n_follows_the_row():
  whole = _entry(n=1024, block_m=1, block_n=1024, num_warps=4, mode="multi_wave_cached")
  assert config.from_entry(whole, 4, 1500, H200, "pallas").block_n == 2048
  assert config.from_entry(whole, 4, 600, H200, "pallas").block_n == 1024
  chunk = _entry(n=4096, block_m=1, block_n=1024, num_warps=4)
  assert config.from_entry(chunk, 4, 8000, H200, "pallas").block_n == 1024
  assert config.from_entry(chunk, 4, 2100, H200, "pallas").block_n == 1024
  assert config.from_entry(chunk, 4, 4096, H200, "pallas").block_n == 1024


def test_from_entry_pieces_cover_the_row():
  fields = dict(block_m=1, block_n=4096, num_warps=8, programs_per_sm=2.0,
                pieces_round=512)
  e = _entry(n=3072, pass_="bwd", family="layer", mode="", **fields)
  for n in (2100, 2500, 3000, 3072, 3073, 4096, 5000, 6000):
    cfg = config.from_entry(e, 4096, n, H200, "pallas")
    p = cfg.pieces
    assert p, n
    assert all(a > b for a, b in zip(p, p[1:])) and all(v & (v - 1) == 0 for v in p)
    assert n <= sum(p) < n + 512 and sum(p) <= cfg.block_n == config.next_power_of_2(n)
  assert config.from_entry(e, 4096, 3000, H200, "pallas").pieces == (2048, 1024)
  # the Triton backend's kernel has no pieces
  assert config.from_entry(e, 4096, 3000, H200, "triton") is None
  # a chunked row (block_n < N) takes no pieces
  chunked = _entry(n=16384, pass_="bwd", family="layer", mode="", **fields)
  cfg = config.from_entry(chunked, 4096, 16384, H200, "pallas")
  assert cfg.block_n == 4096 and cfg.pieces == ()
  # a tile too narrow for the rounded row: one tile, no pieces
  narrow = _entry(n=3072, pass_="bwd", family="layer", mode="",
                  **dict(fields, pieces_round=3000))
  assert config.from_entry(narrow, 4096, 3072, H200, "pallas").pieces == ()


def test_fits_checks_the_launchers_limits():
  fc = config.ForwardConfig
  assert config.fits(fc("multi_wave_reload", 64, 1024, 4), 1024, H200, "pallas")
  assert not config.fits(fc("multi_wave_reload", 128, 1024, 4), 1024, H200, "pallas")
  assert not config.fits(fc("multi_wave_reload", 1, 2048, 4), 1024, H200, "pallas")
  assert not config.fits(fc("multi_wave_cached", 1, 8192, 4, chunk_n=1024), 65536, H200,
                         "triton")  # the split-row cached kernel: Pallas only
  assert not config.fits(fc("multi_wave_cached", 1, 4096, 4), 65536, SMALL, "pallas")
  assert config.fits(fc("multi_wave_cached", 1, 4096, 4), 65536, CPU, "pallas")


ROUND_TRIP_FWD = [  # (device, m, n, mode, subtract_mean, backend)
    (H200, 4096, 4096, None, False, "pallas"),
    (H200, 1, 4096, None, True, "pallas"),
    (H100, 8192, 8192, None, True, "pallas"),
    (H100, 4096, 12288, "static_persistent", False, "pallas"),
    (H200, 4096, 65536, "static_persistent", True, "pallas"),    # split rows
    (H200, 4096, 32768, None, False, "pallas"),                  # split cached rows
    (H200, 4096, 65536, None, False, "pallas"),
    (A100, 1000, 768, "static_persistent", False, "pallas"),
    (A100, 7, 5120, None, True, "pallas"),
    (H200, 4096, 16384, "multi_wave_reload", False, "triton"),
    (CPU, 16, 256, None, False, "pallas"),
    (CPU, 7, 1000, "static_persistent", True, "pallas"),
    (CPU, 199, 760, "multi_wave_reload", False, "pallas"),
]
ROUND_TRIP_BWD = [  # (device, m, n, subtract_mean, backend)
    (H200, 4096, 4096, False, "pallas"),
    (H100, 8192, 3000, True, "pallas"),                          # pieces
    (H100, 8192, 8192, True, "pallas"),                          # stage-1 flags
    (H200, 4096, 65536, False, "pallas"),                        # split rows
    (H200, 4096, 200000, True, "pallas"),                        # split, early publish
    (A100, 7, 5120, True, "pallas"),
    (H100, 4096, 2048, True, "triton"),
    (CPU, 16, 256, False, "pallas"),
    (CPU, 7, 1000, True, "pallas"),
]


@pytest.mark.parametrize("device,m,n,mode,subtract_mean,backend", ROUND_TRIP_FWD)
def test_round_trip_forward(device, m, n, mode, subtract_mean, backend):
  cfg = config.forward_config(m, n, jnp.bfloat16, mode, device,
                              subtract_mean=subtract_mean, backend=backend, tuned=False)
  e = _as_entry(cfg, "fwd", m, n, device, backend, subtract_mean=subtract_mean)
  assert config.from_entry(e, m, n, device, backend) == cfg


@pytest.mark.parametrize("device,m,n,subtract_mean,backend", ROUND_TRIP_BWD)
def test_round_trip_backward(device, m, n, subtract_mean, backend):
  cfg = config.backward_config(m, n, jnp.bfloat16, device, subtract_mean=subtract_mean,
                               backend=backend, tuned=False)
  e = _as_entry(cfg, "bwd", m, n, device, backend, subtract_mean=subtract_mean)
  assert config.from_entry(e, m, n, device, backend) == cfg


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_round_trip_cpu_wide_rows(pass_):
  m, n = 128, 1536
  cfg = (config.forward_config(m, n, jnp.bfloat16, None, CPU, tuned=False)
         if pass_ == "fwd" else config.backward_config(m, n, jnp.bfloat16, CPU,
                                                       tuned=False))
  assert cfg.block_m * cfg.block_n > 65536  # what the CPU default runs
  e = _as_entry(cfg, pass_, m, n, CPU)
  assert config.from_entry(e, m, n, CPU, "pallas") == cfg


@pytest.mark.parametrize("device,m,n,backend", [
    (H200, 4096, 8193, "triton"), (H100, 4096, 1048577, "pallas")])
def test_round_trip_backward_below_one_program_a_sm(device, m, n, backend):
  cfg = config.backward_config(m, n, jnp.bfloat16, device, backend=backend, tuned=False)
  assert cfg.num_programs < device.num_sms and cfg.num_programs < config.cdiv(
      m, cfg.block_m)
  e = _as_entry(cfg, "bwd", m, n, device, backend)
  assert config.from_entry(e, m, n, device, backend) == cfg


# ----------------------------------------------------------------------------- the op


def _spy(monkeypatch) -> list:
  """The forward configs the Pallas launcher is called with (at trace time)."""
  seen, launch = [], forward.norm_forward
  monkeypatch.setattr(forward, "norm_forward",
                      lambda *a, **k: seen.append(k["config"]) or launch(*a, **k))
  return seen


def _x(m, n):
  return jnp.asarray(np.random.default_rng(0).standard_normal((m, n)), jnp.bfloat16)


def _check(y, x):
  ref = reference.norm(x, None, None, eps=float(jnp.finfo(jnp.float32).eps),
                       subtract_mean=False)[0]
  assert y.shape == x.shape and y.dtype == x.dtype
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                             rtol=2e-2, atol=2e-2)


@pytest.mark.cpu_only  # a table for the "cpu" device kind and CPU tiles
def test_op_runs_the_user_table(monkeypatch):
  fast = _entry(us=1.0)  # reload [8 -> 16 on CPU, 128] x 2 warps
  cached = _entry(mode="multi_wave_cached", us=2.0, block_m=8, block_n=256, num_warps=1)
  _write_table(_user(), "cpu", fast, cached)
  jax.clear_caches()  # no trace of an earlier test (see the next test)
  seen = _spy(monkeypatch)
  x = _x(16, 256)
  want = config.ForwardConfig("multi_wave_reload", 16, 128, 2)
  assert config.from_entry(fast, 16, 256, CPU, "pallas") == want == _fwd()
  assert want != _default()
  _check(pallas_norm.rms_norm(x), x)
  assert seen == [want]
  # an explicit mode wins over the table's pick (and takes the table's entry of it)
  seen.clear()
  _check(pallas_norm.rms_norm(x, mode="multi_wave_cached"), x)
  assert seen == [config.ForwardConfig("multi_wave_cached", 16, 256, 1)]
  seen.clear()
  _check(pallas_norm.rms_norm(x, mode="static_persistent"), x)
  assert seen == [_default(mode="static_persistent")]


@pytest.mark.cpu_only  # a table for the "cpu" device kind and CPU tiles
def test_op_follows_a_table_installed_after_a_trace(monkeypatch):
  seen = _spy(monkeypatch)
  x = _x(8, 128)
  pallas_norm.rms_norm(x)
  e = _entry(n=128, m=8, block_m=8, block_n=64, num_warps=1)
  _write_table(_user(), "cpu", e)
  tuning.clear_cache()
  want = config.from_entry(e, 8, 128, CPU, "pallas")
  assert _fwd(m=8, n=128) == want
  seen.clear()
  _check(pallas_norm.rms_norm(x), x)
  assert seen == [want]


# --------------------------------------------------------------------------- packaging


def test_package_data_glob():
  data = tomllib.loads((REPO / "pyproject.toml").read_text())
  assert "tuning/*.json" in data["tool"]["setuptools"]["package-data"]["pallas_norm"]


def test_wheel_carries_the_tables(tmp_path):
  """A wheel built from a copy of the source tree (one dummy table added) holds it and
  every table shipped now. Offline: pip, no index, no build isolation."""
  src = tmp_path / "src"
  src.mkdir()
  ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(REPO / name, src / name)
  for name in ("pallas_norm", "flax_layers"):
    shutil.copytree(REPO / name, src / name, ignore=ignore)
  dummy = _entry(n=4096, m=4096)
  _write_table(src / "pallas_norm" / "tuning", "NVIDIA Test GPU", dummy)
  tables = sorted(p.name for p in (src / "pallas_norm" / "tuning").glob("*.json"))
  assert set(tables) >= {"nvidia_test_gpu.json"} | {
      p.name for p in PACKAGE_TUNING.glob("*.json")}
  out = tmp_path / "wheel"
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                  "--no-build-isolation", "--disable-pip-version-check", "-q", "-w",
                  str(out), str(src)], check=True, cwd=src, timeout=120,
                 capture_output=True)
  (whl,) = out.glob("pallas_norm-*.whl")
  with zipfile.ZipFile(whl) as z:
    names = set(z.namelist())
    assert {f"pallas_norm/tuning/{t}" for t in tables} <= names
    assert "pallas_norm/tuning/__init__.py" in names
    doc = json.loads(z.read("pallas_norm/tuning/nvidia_test_gpu.json"))
  assert list(tuning.Table.from_doc(doc).entries()) == [dummy]


def test_an_entry_that_is_the_whole_default_means_the_default_mode_too():
  """An entry equal to the default at its point, its mode included, gives another N of
  its N' that N's default with its own mode when the caller leaves the mode open (the
  mode's default where the caller fixed it)."""
  at, there = (8192, 8192), (8192, 5120)
  fwd = lambda mn, mode=None, tuned=False: config.forward_config(
      *mn, jnp.bfloat16, mode, H200, return_residuals=False, tuned=tuned)
  here = fwd(at)
  assert fwd(there).mode != here.mode  # the premise: the default's mode differs
  _write_table(_user(), H200.name, _as_entry(here, "fwd", *at, H200))
  tuning.clear_cache()
  assert fwd(there, tuned=True) == fwd(there)
  assert fwd(there, here.mode, tuned=True) == fwd(there, here.mode)


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_an_entry_that_is_the_default_at_its_point_means_the_default(pass_):
  """An entry equal to the default at its own (M, N) gives, at another N of its reach,
  that N's default, not its tile rebuilt; an entry that is not the default applies."""
  def default(m, n, tuned=False):
    if pass_ == "bwd":
      return config.backward_config(m, n, jnp.bfloat16, H200, tuned=tuned)
    return config.forward_config(m, n, jnp.bfloat16, "static_persistent", H200,
                                 return_residuals=False, tuned=tuned)
  at, there = (512, 16384), (512, 12288)  # one N' (the lookup's reach)
  own = _as_entry(default(*at), pass_, *at, H200)
  assert config.from_entry(own, *there, H200, "pallas") != default(*there)  # the hazard
  _write_table(_user(), H200.name, own)
  tuning.clear_cache()
  assert default(*there, tuned=True) == default(*there)
  assert default(*at, tuned=True) == default(*at)
  other = dataclasses.replace(default(*at), num_warps=2 if default(*at).num_warps != 2
                              else 4)
  tuned = _as_entry(other, pass_, *at, H200)
  _write_table(_user(), H200.name, tuned)
  tuning.clear_cache()
  assert default(*there, tuned=True) == config.from_entry(tuned, *there, H200, "pallas")
  assert default(*there, tuned=True) != default(*there)
