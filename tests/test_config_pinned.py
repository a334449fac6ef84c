"""Pins every launch config that ``pallas_norm.config`` chooses (issue #28).

The heuristic's rules must not change by accident: this test runs the public selectors
(``forward_config``, ``backward_config``, ``choose_mode``, ``reduce_config``,
``split_resident_programs``, ``cached_max_block_n``, ``device_info``) over a table of
cases and asserts exact equality, field by field, with the values stored in
``tests/data/config_pinned.json``.

The data file holds, per selector, the distinct configs (one a line: the class name and
every field in the order of ``"fields"``), the distinct rows of len(MS) x len(DTYPES)
consecutive cases as indices into those, and each row's index. The table of cases is
the full product of
  device        cpu (the interpret-mode fallback: DeviceInfo("cpu", "cpu", 4)),
                H100 SXM and H200 (132 SMs), and an A100 (108 SMs: another GPU with
                another SM count, for the rules that depend on the SM count or the name);
  backend       "pallas", "triton";
  subtract_mean False (RMSNorm), True (LayerNorm);
  mode          None (the heuristic) and each of ``config.MODES`` (forward only);
  N             ``NS``: each threshold of the rules, its neighbours and the usual sizes;
  M             ``MS``: 1 to 262144;
  dtype         float32, bfloat16, float16.
A selector that raises is pinned as the exception's type name.

Regenerate the data file (only when a rule changes on purpose; review the diff of the
configs table and say why in the commit message):

    .venv/bin/python tests/test_config_pinned.py --regen

Without ``--regen`` the script prints how many cases differ from the stored file.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import sys

import jax.numpy as jnp
import pytest

from pallas_norm import config as pn_config

DATA = pathlib.Path(__file__).parent / "data" / "config_pinned.json"

DEVICES = {
    "cpu": pn_config.DeviceInfo("cpu", "cpu", 4),
    "h100": pn_config.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 132),
    "h200": pn_config.DeviceInfo("gpu", "NVIDIA H200", 132),
    "a100": pn_config.DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108),
}
BACKENDS = ("pallas", "triton")
SUBTRACT_MEAN = (False, True)
FWD_MODES = (None, *pn_config.MODES)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
MS = (1, 7, 128, 1000, 4096, 16384, 65536, 262144)
# Thresholds of the rules (256, 2048, 3072, 4096, 5120, 6144, 8192, 12288, 16384, 32768,
# 65536, 262144, 4096 x SMs, 8192 x SMs for 108 and 132 SMs, the backward split's
# W^2 / 4 steps up to the 32-warp limit), each with a neighbour, and common hidden sizes.
NS = (1, 64, 127, 128, 200, 256, 257, 512, 768, 1000, 1024, 1536, 2048, 2049, 2560, 3072,
      3073, 3584, 4096, 4097, 4608, 5120, 5121, 6144, 6145, 7168, 8192, 8193, 10240, 12288,
      12289, 14336, 16384, 16385, 24576, 32768, 32769, 49152, 65536, 65537, 131072, 262144,
      262145, 442368, 442369, 524288, 540672, 540673, 884736, 884737, 1048576, 1048577,
      1081344, 1081345, 2097152, 67108864, 67108865)
# reduce_config(n, num_programs) and split_resident_programs(num_warps) on their own.
REDUCE_NS = (1, 8, 100, 128, 1024, 5120, 8192, 65536)
REDUCE_GS = (1, 2, 3, 31, 32, 100, 132, 264, 512, 528, 1000, 1024, 2048, 4096)
WARPS = (1, 2, 4, 8, 16, 32, 64)


def _grid() -> dict:
  return dict(devices={k: dataclasses.astuple(v) for k, v in DEVICES.items()},
              backends=list(BACKENDS), subtract_mean=list(SUBTRACT_MEAN),
              fwd_modes=list(FWD_MODES), dtypes=list(DTYPES), ms=list(MS), ns=list(NS),
              reduce_ns=list(REDUCE_NS), reduce_gs=list(REDUCE_GS), warps=list(WARPS))


def _fields() -> dict:
  return {c.__name__: [f.name for f in dataclasses.fields(c)]
          for c in (pn_config.ForwardConfig, pn_config.BackwardConfig)}


def _fwd_cases(devices=DEVICES):
  """(label, kwargs) in a fixed order, the device outermost: the stored index list
  follows it."""
  for dev, be, sm, mode, n, m, dt in itertools.product(
      devices, BACKENDS, SUBTRACT_MEAN, FWD_MODES, NS, MS, DTYPES):
    yield ((dev, be, sm, mode, n, m, dt),
           dict(m=m, n=n, dtype=DTYPES[dt], mode=mode, device=DEVICES[dev],
                subtract_mean=sm, backend=be))


def _bwd_cases(devices=DEVICES):
  for dev, be, sm, n, m, dt in itertools.product(
      devices, BACKENDS, SUBTRACT_MEAN, NS, MS, DTYPES):
    yield ((dev, be, sm, n, m, dt),
           dict(m=m, n=n, dtype=DTYPES[dt], device=DEVICES[dev], subtract_mean=sm,
                backend=be))


_STR: dict = {}


def _encode(fn, **kw) -> str:
  """One line per config: the class name and every field, or ``!ErrorType``."""
  try:
    cfg = fn(**kw)
  except (ValueError, NotImplementedError) as e:
    return f"!{type(e).__name__}"
  # Every field in declaration order (vars(): dataclasses.astuple deep-copies, 10x
  # slower), formatted once per distinct config.
  key = (type(cfg).__name__, tuple(vars(cfg).values()))
  if key not in _STR:
    _STR[key] = f"{key[0]}{key[1]}"
  return _STR[key]


def _values(name: str, devices=DEVICES) -> list[str]:
  """The current config.py's answer for each case of table ``name`` (forward and
  backward: on ``devices`` only), in order."""
  if name == "forward":
    return [_encode(pn_config.forward_config, **kw) for _, kw in _fwd_cases(devices)]
  if name == "backward":
    return [_encode(pn_config.backward_config, **kw) for _, kw in _bwd_cases(devices)]
  if name == "reduce":
    return [repr(pn_config.reduce_config(n, g)) for n in REDUCE_NS for g in REDUCE_GS]
  if name == "split_resident_programs":
    return [repr(pn_config.split_resident_programs(w)) for w in WARPS]
  if name == "cached_max_block_n":
    return [repr(pn_config.cached_max_block_n(d)) for d in DTYPES.values()]
  assert name == "constants", name
  return [repr(pn_config.MODES), repr(pn_config.RELOAD_UNROLL_MAX_CHUNKS)]


def _labels(name: str, devices=DEVICES) -> list:
  if name == "forward":
    return [c for c, _ in _fwd_cases(devices)]
  if name == "backward":
    return [c for c, _ in _bwd_cases(devices)]
  if name == "reduce":
    return [(n, g) for n in REDUCE_NS for g in REDUCE_GS]
  return {"split_resident_programs": list(WARPS), "cached_max_block_n": list(DTYPES),
          "constants": ["MODES", "RELOAD_UNROLL_MAX_CHUNKS"]}[name]


TABLES = ("forward", "backward", "reduce", "split_resident_programs", "cached_max_block_n",
          "constants")
_ROW = len(MS) * len(DTYPES)  # forward/backward: the cases of one N of one group


def _pack(values: list[str], row: int) -> dict:
  """Stored form: the distinct configs (one a line), the distinct rows of ``row``
  consecutive cases as config indices, and each row's index."""
  configs = sorted(set(values))
  ci = {v: i for i, v in enumerate(configs)}
  rows_of = [tuple(ci[v] for v in values[i:i + row]) for i in range(0, len(values), row)]
  rows = sorted(set(rows_of))
  ri = {r: i for i, r in enumerate(rows)}
  return {"configs": configs, "rows": [list(r) for r in rows],
          "cases": [ri[r] for r in rows_of]}


def _unpack(t: dict) -> list[str]:
  return [t["configs"][c] for r in t["cases"] for c in t["rows"][r]]


def _row_len(name: str) -> int:
  return _ROW if name in ("forward", "backward") else 1


def _dump() -> str:
  """The data file: JSON with one config, one row a line, the case indices in lines
  of len(NS) (the Ns of one (device, backend, op, mode) group)."""
  out = ["{", f'"grid": {json.dumps(_grid())},', f'"fields": {json.dumps(_fields())},',
         '"tables": {']
  for ti, name in enumerate(TABLES):
    t = _pack(_values(name), _row_len(name))
    cases = t["cases"]
    out.append(f"{json.dumps(name)}: {{")
    out.append(' "configs": [\n  ' + ",\n  ".join(map(json.dumps, t["configs"])) + "],")
    out.append(' "rows": [\n  ' + ",\n  ".join(map(json.dumps, t["rows"])) + "],")
    out.append(' "cases": [\n  ' + ",\n  ".join(
        ",".join(map(str, cases[i:i + len(NS)])) for i in range(0, len(cases), len(NS)))
               + "]}" + ("," if ti < len(TABLES) - 1 else ""))
  out += ["}", "}"]
  return "\n".join(out) + "\n"


def _diff(stored: dict, name: str, device: str | None = None) -> list[str]:
  """Differences between the stored and the current answers of table ``name`` (on
  ``device`` only, if given: the forward and backward tables put the device
  outermost)."""
  want = _unpack(stored["tables"][name])
  devices = DEVICES
  if device is not None:
    i, per = list(DEVICES).index(device), len(want) // len(DEVICES)
    want, devices = want[i * per:(i + 1) * per], {device: DEVICES[device]}
  got = _values(name, devices)
  assert len(want) == len(got), f"{name}: {len(want)} stored cases, {len(got)} now"
  return [f"{label}: pinned {w}, now {g}"
          for label, w, g in zip(_labels(name, devices), want, got) if w != g]


@pytest.fixture(scope="module")
def stored():
  data = json.loads(DATA.read_text())
  assert data["grid"] == json.loads(json.dumps(_grid())), (
      "the case grid changed: regenerate with `python tests/test_config_pinned.py --regen`")
  assert data["fields"] == _fields(), "the config dataclasses' fields changed"
  return data


@pytest.mark.parametrize("name, device", [
    *((t, d) for t in ("forward", "backward") for d in DEVICES),
    *((t, None) for t in TABLES[2:])])
def test_config_pinned(stored, name, device):
  bad = _diff(stored, name, device)
  assert not bad, f"{len(bad)} {name} configs changed, e.g.:\n" + "\n".join(bad[:25])


def test_choose_mode_is_forward_configs_mode(stored):
  """choose_mode (demo.py calls it alone) picks the pinned forward_config(mode=None)'s
  mode."""
  want = _unpack(stored["tables"]["forward"])
  for ((dev, be, sm, mode, n, m, dt), _), w in zip(_fwd_cases(), want):
    if mode is not None:
      continue
    got = pn_config.choose_mode(m, n, DTYPES[dt], DEVICES[dev], subtract_mean=sm,
                                backend=be)
    assert w.startswith(f"ForwardConfig({got!r},"), (dev, be, sm, n, m, dt, got, w)


class _FakeDevice:

  def __init__(self, platform, device_kind, core_count=None):
    self.platform, self.device_kind = platform, device_kind
    if core_count is not None:
      self.core_count = core_count


@pytest.mark.parametrize("fake, want", [
    (("gpu", "NVIDIA H100 80GB HBM3", 132), DEVICES["h100"]),
    (("gpu", "NVIDIA H200", 132), DEVICES["h200"]),
    (("gpu", "NVIDIA A100-SXM4-80GB", 108), DEVICES["a100"]),
    (("cpu", "cpu"), DEVICES["cpu"]),
    # A GPU that reports no SM count is treated as the interpret-mode fallback.
    (("gpu", "NVIDIA H200"), pn_config.DeviceInfo("cpu", "NVIDIA H200", 4)),
    (("gpu", "NVIDIA H200", 0), pn_config.DeviceInfo("cpu", "NVIDIA H200", 4)),
])
def test_device_info(monkeypatch, fake, want):
  dev = _FakeDevice(*fake)
  assert pn_config.device_info(dev) == want
  monkeypatch.setattr(pn_config.jax, "devices", lambda *a, **k: [dev])
  assert pn_config.device_info() == want
  # device=None falls back to device_info(): the same configs as passing it.
  for n in (1024, 8192, 16384, 65536):
    for sm in SUBTRACT_MEAN:
      assert (_encode(pn_config.forward_config, m=4096, n=n, dtype=jnp.bfloat16,
                      subtract_mean=sm)
              == _encode(pn_config.forward_config, m=4096, n=n, dtype=jnp.bfloat16,
                         device=want, subtract_mean=sm))
      assert (pn_config.backward_config(4096, n, jnp.bfloat16, subtract_mean=sm)
              == pn_config.backward_config(4096, n, jnp.bfloat16, want, subtract_mean=sm))


def test_unknown_mode_raises():
  with pytest.raises(ValueError):
    pn_config.forward_config(128, 1024, jnp.float32, "bogus", DEVICES["h200"])


if __name__ == "__main__":
  if "--regen" in sys.argv[1:]:
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(_dump())
    data = json.loads(DATA.read_text())
    print(f"wrote {DATA} ({DATA.stat().st_size} bytes): " + ", ".join(
        f"{k} {len(_unpack(t))} cases / {len(t['configs'])} configs"
        for k, t in data["tables"].items()))
  else:
    data = json.loads(DATA.read_text())
    for name in TABLES:
      bad = _diff(data, name)
      print(f"{name}: {len(bad)} differ" + "".join(f"\n  {b}" for b in bad[:10]))


def test_residual_rules():
  """The fused residual add's picks ([T#residual]): H200, 2-byte dtypes, Pallas only;
  elsewhere residual=True picks what the plain norm picks."""
  h200, h100 = DEVICES["h200"], DEVICES["h100"]
  fwd = lambda m, n, ln, d, dt=jnp.bfloat16, res=True, be="pallas": pn_config.forward_config(
      m, n, dt, None, d, subtract_mean=ln, backend=be, residual=res)
  bwd = lambda m, n, ln, d, dt=jnp.bfloat16, res=True, be="pallas": pn_config.backward_config(
      m, n, dt, d, subtract_mean=ln, backend=be, residual=res)
  assert fwd(8192, 8192, False, h200, res=False).mode == "static_persistent"
  got = fwd(8192, 8192, False, h200)
  assert (got.mode, got.block_m, got.block_n) == ("multi_wave_cached", 1, 8192)
  got = fwd(8192, 4096, True, h200)
  assert (got.mode, got.block_m, got.block_n, got.num_warps) == ("multi_wave_cached", 1,
                                                                 4096, 8)
  got = bwd(16384, 4096, True, h200)  # the plain rule's pick ([T#bwd-ln-4096])
  assert (got.block_m, got.block_n, got.num_warps, got.num_programs) == (2, 4096, 16, 132)
  assert got == bwd(16384, 4096, True, h200, res=False)
  assert bwd(16384, 4096, True, h200, be="triton").block_m == 1  # not measured there
  assert bwd(8192, 8192, True, h200).num_warps == 32
  assert bwd(8192, 8192, True, h200, res=False).num_warps == 16
  assert bwd(8192, 3072, True, h200).pieces  # the pieces rule keeps its rows
  for kw in (dict(d=h100), dict(d=h200, dt=jnp.float32), dict(d=h200, be="triton")):
    d = kw.pop("d")
    for m, n, ln in ((8192, 8192, False), (8192, 4096, True), (8192, 8192, True)):
      assert fwd(m, n, ln, d, **kw) == fwd(m, n, ln, d, res=False, **kw)
      if (m, n, ln) == (8192, 8192, True) and d is h100 and not kw:
        continue  # the N' = 8192 LayerNorm backward's rules (test below)
      assert _stock(bwd(m, n, ln, d, **kw)) == _stock(bwd(m, n, ln, d, res=False, **kw))


def _stock(cfg):
  """cfg without the flags the stage-1 rules set ([T#recompute-dx], [T#stage1-flags])."""
  return dataclasses.replace(cfg, recompute_dx=False, prefetch_stats=False,
                             joint_row_sums=False)


def test_residual_recompute_dx_rule():
  """LayerNorm + residual at N' = 8192, bf16, the Pallas backward on a GPU: dx from x and
  dy converted again ([T#recompute-dx]); nothing else takes it."""
  bwd = lambda m, n, d, ln=True, dt=jnp.bfloat16, res=True, be="pallas": (
      pn_config.backward_config(m, n, dt, DEVICES[d], subtract_mean=ln, backend=be,
                                residual=res).recompute_dx)
  for d in ("h100", "h200", "a100"):
    assert bwd(4096, 8192, d) and bwd(8192, 8192, d) and bwd(1000, 6000, d)
    assert not bwd(4096, 8192, d, ln=False)
    assert not bwd(4096, 8192, d, res=False)
    assert not bwd(4096, 8192, d, dt=jnp.float16)
    assert not bwd(4096, 8192, d, dt=jnp.float32)
    assert not bwd(4096, 8192, d, be="triton")
    assert not bwd(8192, 4096, d) and not bwd(4096, 16384, d)
  assert not bwd(4096, 8192, "cpu")
  warps = lambda d, res=True, dt=jnp.bfloat16: pn_config.backward_config(
      4096, 8192, dt, DEVICES[d], subtract_mean=True, residual=res).num_warps
  assert warps("h100") == warps("h200") == 32  # 32 warps with the residual on both
  assert warps("h100", res=False) == warps("h200", res=False) == 16
  assert warps("a100") == warps("h100", dt=jnp.float32) == 16


def test_reduce_warps():
  """Stage 2 ([T#reduce]): 8 warps for a full 8192-element tile on the Pallas backend,
  16 on the Triton one; fewer for smaller tiles."""
  assert pn_config.reduce_config(4096, 132)["reduce_num_warps"] == 8
  assert pn_config.reduce_config(4096, 132, "triton")["reduce_num_warps"] == 16
  assert pn_config.reduce_config(64, 2)["reduce_num_warps"] == 1  # a [2, 64] tile
  bwd = pn_config.backward_config(8192, 4096, jnp.bfloat16, DEVICES["h200"],
                                  backend="triton")
  assert bwd.reduce_num_warps == 16


def test_fp8_rms_forward_tiles():
  """FP8 x, RMSNorm, Pallas ([T#fp8-in-fwd]): two-row tiles at N' = 4096 (whole-row
  tile) and 8192 (the persistent one); LayerNorm, bf16 x and the Triton backend keep
  their picks."""
  h200 = DEVICES["h200"]
  fwd = lambda m, n, dt, ln=False, be="pallas": pn_config.forward_config(
      m, n, dt, None, h200, subtract_mean=ln, backend=be)
  fp8 = jnp.float8_e4m3fn
  got = fwd(8192, 4096, fp8)
  assert (got.mode, got.block_m, got.num_warps) == ("multi_wave_cached", 2, 4)
  got = fwd(8192, 8192, fp8)
  assert (got.mode, got.block_m, got.num_warps) == ("static_persistent", 2, 16)
  assert fwd(8192, 4096, jnp.bfloat16).block_m == 1
  assert fwd(8192, 8192, jnp.bfloat16).block_m == 1
  assert fwd(8192, 4096, fp8, be="triton").block_m == 1


def test_fp8_rms_forward_h100_8192():
  """FP8 x, RMSNorm, N' = 8192 on the H100 ([T#fp8-in-fwd]): the static_persistent
  [2, 8192] x 16 tile, 2 programs a SM, when the call returns mean/rstd (jax.vjp's
  forward); without them, LayerNorm, a residual add, the Triton backend, bf16 x and
  another GPU keep their picks."""
  fwd = lambda m, n, dt=jnp.float8_e4m3fn, ln=False, d="h100", mode=None, **kw: (
      pn_config.forward_config(m, n, dt, mode, DEVICES[d], subtract_mean=ln, **kw))
  got = fwd(8192, 8192)
  assert (got.mode, got.block_m, got.block_n, got.num_warps, got.num_programs) == (
      "static_persistent", 2, 8192, 16, 264)
  assert fwd(1000, 6000).num_programs == 264 and fwd(3, 6000).num_programs == 2
  assert fwd(8192, 8192, param_dtype=jnp.float32) == got
  stock = fwd(8192, 8192, return_residuals=False)
  assert (stock.mode, stock.block_m) == ("multi_wave_cached", 1)
  for kw in (dict(ln=True), dict(residual=True), dict(backend="triton"),
             dict(dt=jnp.bfloat16), dict(d="a100")):
    assert fwd(8192, 8192, **kw) == fwd(8192, 8192, return_residuals=False, **kw), kw
  assert fwd(8192, 4096) == fwd(8192, 4096, return_residuals=False)
  assert fwd(8192, 8192, mode="multi_wave_cached").mode == "multi_wave_cached"


def test_f32_params_tiles():
  """float32 scale/bias with a 2-byte x ([T#f32-params]): static_persistent [2, N']
  tiles on the Pallas backend of the H100 and H200 at N' = 4096 and 8192 (RMSNorm's 8192
  on the H100 only); elsewhere (bf16 params, float32 x, FP8 x but at N' = 8192 on the
  H100, a residual, the Triton backend, another GPU, other N') param_dtype changes
  nothing."""
  h200, h100, a100 = DEVICES["h200"], DEVICES["h100"], DEVICES["a100"]
  f32, bf16 = jnp.float32, jnp.bfloat16
  # the rules (tuned=False): a shipped table's bf16-params entries would answer p=bf16
  fwd = lambda m, n, ln, dt=bf16, p=f32, d=h200, **kw: pn_config.forward_config(
      m, n, dt, kw.pop("mode", None), d, subtract_mean=ln, param_dtype=p, tuned=False,
      **kw)
  for d, m, n, ln, want in ((h200, 4096, 8192, True, (2, 8, 132)),
                            (h100, 4096, 8192, True, (2, 8, 132)),
                            (h200, 8192, 4096, True, (2, 8, 264)),
                            (h100, 8192, 4096, False, (2, 8, 264)),
                            (h200, 8192, 3000, True, (2, 8, 264)),
                            (h200, 100, 4096, False, (2, 8, 50)),
                            (h100, 4096, 8192, False, (2, 16, 264))):
    got = fwd(m, n, ln, d=d)
    assert (got.mode, got.block_n) == ("static_persistent", pn_config.next_power_of_2(n))
    assert (got.block_m, got.num_warps, got.num_programs) == want, (d, m, n, ln, got)
    assert pn_config.choose_mode(m, n, bf16, d, subtract_mean=ln,
                                 param_dtype=f32) == "static_persistent"
    assert fwd(m, n, ln, d=d, dt=jnp.float16) == got
    assert fwd(m, n, ln, d=d, mode="static_persistent") == got  # the mode asked for
    assert fwd(m, n, ln, d=d, mode="multi_wave_cached").mode == "multi_wave_cached"
  for m, n, ln in ((4096, 8192, True), (8192, 4096, True), (8192, 4096, False),
                   (4096, 8192, False), (8192, 2048, True), (8192, 16384, True)):
    for d in (h200, h100):
      plain = fwd(m, n, ln, d=d, p=None)
      assert fwd(m, n, ln, d=d, p=bf16) == plain
      assert fwd(m, n, ln, d=d, dt=f32, p=f32) == fwd(m, n, ln, d=d, dt=f32, p=None)
      fp8 = jnp.float8_e4m3fn
      if not (d is h100 and n == 8192):  # FP8 x's own rule there (test_fp8_forward_h100_8192)
        assert fwd(m, n, ln, d=d, dt=fp8) == fwd(m, n, ln, d=d, dt=fp8, p=None)
      assert fwd(m, n, ln, d=d, backend="triton") == fwd(m, n, ln, d=d, p=None,
                                                          backend="triton")
      assert fwd(m, n, ln, d=d, residual=True) == fwd(m, n, ln, d=d, p=None, residual=True)
    assert fwd(m, n, ln, d=a100) == fwd(m, n, ln, d=a100, p=None)
  assert fwd(4096, 8192, False) == fwd(4096, 8192, False, p=None)  # its own tile already


def test_stage1_flags_rule():
  """prefetch_stats and joint_row_sums ([T#stage1-flags]): the one-tile persistent
  stage 1 on the H100, Pallas, 2-byte dtypes and FP8 x; nowhere else."""
  def flags(m, n, ln, d="h100", dt=jnp.bfloat16, res=False, be="pallas"):
    c = pn_config.backward_config(m, n, dt, DEVICES[d], subtract_mean=ln, backend=be,
                                  residual=res)
    return c.prefetch_stats, c.joint_row_sums
  assert flags(8192, 4096, True) == (True, False)  # plain N' = 4096: stats only
  assert flags(8192, 4096, True, res=True) == (True, True)
  assert flags(4096, 8192, True) == (True, True)
  assert flags(4096, 8192, True, res=True) == (False, True)  # residual N' = 8192
  assert flags(8192, 3072, True) == (True, True)  # the pieces
  assert flags(8192, 1024, True, dt=jnp.float16) == (True, True)
  assert flags(8192, 2048, False) == (True, False)  # RMSNorm: one row sum
  assert flags(4096, 8192, False) == (False, False)
  assert flags(4096, 8192, False, res=True) == (False, False)
  assert flags(8192, 16384, True) == (False, False)  # not the one-tile kernel
  assert flags(32768, 2048, True, res=True) == (False, False)  # the stock kernel won
  assert flags(32768, 2048, True) == (True, True)
  assert flags(16384, 1024, True, res=True) == (True, True)
  assert flags(16384, 1024, False, res=True) == (True, False)
  assert flags(16384, 256, True) == (False, False)  # not measured
  e4m3 = jnp.float8_e4m3fn  # FP8 x
  assert flags(8192, 4096, False, dt=e4m3) == (True, False)
  assert flags(8192, 8192, False, dt=e4m3) == (True, False)
  assert flags(8192, 4096, True, dt=e4m3) == (True, True)  # the H100 FP8 tile's
  assert flags(8192, 8192, True, dt=e4m3) == (True, True)
  assert flags(8192, 4096, True, dt=e4m3, res=True) == (False, False)  # not measured
  for kw in (dict(d="h200"), dict(d="a100"), dict(d="cpu"), dict(dt=jnp.float32),
             dict(be="triton")):
    for m, n, ln, res in ((8192, 4096, True, False), (8192, 4096, True, True),
                          (4096, 8192, True, False), (8192, 2048, False, False)):
      assert flags(m, n, ln, res=res, **kw) == (False, False), (kw, m, n, ln, res)


def test_fp8_layer_norm_backward_h100_4096():
  """FP8 x, LayerNorm, N' = 4096, the H100 ([T#fp8-in-bwd]): [1, 4096] x 32 warps, one
  program a SM; bf16 x, RMSNorm, N' = 8192, the H200 and the Triton backend keep theirs."""
  def tile(m, n, ln=True, d="h100", dt=jnp.float8_e4m3fn, be="pallas"):
    c = pn_config.backward_config(m, n, dt, DEVICES[d], subtract_mean=ln, backend=be)
    return c.block_m, c.block_n, c.num_warps, c.num_programs
  assert tile(8192, 4096) == (1, 4096, 32, 132)
  assert tile(16384, 4096, dt=jnp.float8_e5m2) == (1, 4096, 32, 132)
  assert tile(8192, 4096) != tile(8192, 4096, dt=jnp.bfloat16)
  for kw in (dict(dt=jnp.bfloat16), dict(ln=False), dict(d="h200"), dict(be="triton")):
    assert tile(8192, 4096, **kw) != (1, 4096, 32, 132), kw
  assert tile(8192, 8192) == tile(8192, 8192, d="h200")


def test_fp8_layer_norm_forward_h100_primal():
  """FP8 x, LayerNorm, N' = 4096, the H100, no mean/rstd written, 2-byte scale/bias
  ([T#fp8-in-fwd]): [1, 4096] x 8 warps; with residuals written, float32 or no
  parameters, bf16 x, RMSNorm, a residual add, the H200 or N' = 8192 it stays as before."""
  def tile(n=4096, ln=True, d="h100", dt=jnp.float8_e4m3fn, p=jnp.bfloat16, rr=False,
           res=False):
    c = pn_config.forward_config(8192, n, dt, subtract_mean=ln, device=DEVICES[d],
                                 param_dtype=p, return_residuals=rr, residual=res)
    return c.mode, c.block_m, c.block_n, c.num_warps
  assert tile() == ("multi_wave_cached", 1, 4096, 8)
  assert tile(p=jnp.float16, dt=jnp.float8_e5m2) == ("multi_wave_cached", 1, 4096, 8)
  for kw in (dict(rr=True), dict(p=jnp.float32), dict(p=None), dict(d="h200"),
             dict(dt=jnp.bfloat16), dict(ln=False), dict(res=True), dict(n=8192)):
    assert tile(**kw)[1:] != (1, 4096, 8), kw
  assert tile(rr=True) == tile(p=jnp.float32)


def test_fp8_forward_h100_8192():
  """FP8 x at N' = 8192 on the H100 ([T#fp8-in-fwd]): float32 scale/bias take the
  static_persistent [2, 8192] x 16 tile, 2 a SM, both ops, with or without mean/rstd;
  RMSNorm takes it under jax.vjp whatever its scale; LayerNorm with 2-byte scale/bias
  under jax.vjp takes multi_wave_cached [2, 8192] x 16; the rest keep [1, 8192] x 8."""
  def cfg(ln=True, p=jnp.bfloat16, rr=True, d="h100", dt=jnp.float8_e4m3fn, res=False,
          n=8192):
    c = pn_config.forward_config(8192, n, dt, subtract_mean=ln, device=DEVICES[d],
                                 param_dtype=p, return_residuals=rr, residual=res)
    return c.mode, c.block_m, c.block_n, c.num_warps, c.num_programs
  persistent = ("static_persistent", 2, 8192, 16, 264)
  for ln in (False, True):
    for rr in (False, True):
      assert cfg(ln=ln, p=jnp.float32, rr=rr) == persistent, (ln, rr)
  assert cfg(ln=False, p=jnp.bfloat16, rr=True) == persistent
  assert cfg(ln=False, p=None, rr=True) == persistent
  assert cfg(ln=True, p=jnp.bfloat16, rr=True) == ("multi_wave_cached", 2, 8192, 16, 0)
  assert cfg(ln=True, p=jnp.float16, rr=True, n=6000) == ("multi_wave_cached", 2, 8192, 16, 0)
  for kw in (dict(rr=False), dict(ln=False, rr=False), dict(p=None)):
    assert cfg(**kw)[:4] == ("multi_wave_cached", 1, 8192, 8), kw
  for kw in (dict(d="h200", p=jnp.float32, rr=False), dict(dt=jnp.bfloat16, rr=False),
             dict(res=True, p=jnp.float32, rr=False)):
    assert cfg(**kw) != persistent, kw
