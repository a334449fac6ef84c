"""A/B of forward configs (with residuals, as under jax.vjp), rounds interleaved, on
rotated inputs.

  python benchmarks/ab_split_fwd.py {rms|layer} ROUNDS SHAPES CFGS

SHAPES: comma-separated MxN. CFGS: ';'-separated, each one of the following, with
"@nocg" or "@cgall" appended to trace it with the x/dy loads' cache modifier off
(_compat.py) or on for all of them (sweep.ab_first_call):
  default                 config.forward_config's pick
  psplit:bn,nw,occ[,lag[,early]]
                          static_persistent with split_rows: G = occ x SMs / cdiv(N, bn);
                          early 1 sets split_early_publish
  cached:bn,nw,chunk[,bm] multi_wave_cached split over cdiv(N, bn) programs, [bm, bn]
                          splits (bm 1 unless given)
  tile:bm,bn,nw           multi_wave_cached, [bm, bn] tiles (bn >= N)
  persistent:bn,nw,occ    static_persistent walking rows in bn-wide chunks, occ x SMs
  reload:bn,nw            multi_wave_reload
Method: benchmarks/sweep.py's CUPTI kernel time (median of 10 calls a round, printed per
round), inputs rotated over >= 256 MiB; GB/s = 2 x M x N x itemsize / time; y and rstd
checked against the XLA reference. PN_NOLIMIT=1: see sweep.ab_warm_up. PN_BIAS=0 or 1
overrides whether there is a bias (by default LayerNorm has one, RMSNorm none).
The measurement behind config.py's forward split-row rule.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402  (sets XLA_FLAGS before jax starts a backend)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_norm import config as C, reference  # noqa: E402
from pallas_norm.kernels import forward  # noqa: E402


def _config(kind, a, m, n, sm, sms):
  if kind == "default":
    return C.forward_config(m, n, jnp.bfloat16, subtract_mean=sm)
  if kind == "psplit":
    bn, nw, occ, *rest = a
    g = min(m, max(1, occ * sms // -(-n // bn)))
    return C.ForwardConfig("static_persistent", 1, bn, nw, g, split_rows=True,
                           split_lag=rest[0] if rest else 2,
                           split_early_publish=bool(rest[1]) if len(rest) > 1 else False)
  if kind == "cached":
    bn, nw, ch, *bm = a
    return C.ForwardConfig("multi_wave_cached", bm[0] if bm else 1, bn, nw, chunk_n=ch)
  if kind == "tile":
    bm, bn, nw = a
    return C.ForwardConfig("multi_wave_cached", bm, bn, nw)
  if kind == "persistent":
    bn, nw, occ = a
    return C.ForwardConfig("static_persistent", 1, bn, nw, min(m, occ * sms))
  if kind == "reload":
    bn, nw = a
    return C.ForwardConfig("multi_wave_reload", 1, bn, nw)
  raise SystemExit(f"unknown config kind {kind!r}")


def main():
  op, rounds, shapes, cfgs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
  dt = getattr(jnp, os.environ.get("DT", "bfloat16"))
  sm = op == "layer"
  sms = sweep.ab_warm_up()
  for shape in shapes.split(","):
    m, n = map(int, shape.split("x"))
    nbytes = m * n * jnp.dtype(dt).itemsize
    reps = max(2, -(-4 * (64 << 20) // nbytes))
    key = jax.random.PRNGKey(0)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (m, n), dt) + (3.0 if sm else 0.0)
          for i in range(reps)]
    scale = jnp.ones((n,), jnp.bfloat16) * 1.25
    with_bias = bool(int(os.environ.get("PN_BIAS", int(sm))))
    bias = jnp.ones((n,), jnp.bfloat16) * 0.5 if with_bias else None
    y_ref, _, rstd_ref = reference.norm(xs[0], scale, bias, eps=1e-5, subtract_mean=sm)
    fns = {}
    for cs in cfgs.split(";"):
      kind, _, args = cs.partition(":")
      args, kind = (v.removesuffix("@nocg").removesuffix("@cgall") for v in (args, kind))
      cfg = _config(kind, [int(v) for v in args.split(",")] if args else [], m, n, sm, sms)
      fn = jax.jit(lambda x, cfg=cfg: forward.norm_forward(
          x, scale, bias, eps=1e-5, scale_offset=0.0, subtract_mean=sm, config=cfg,
          interpret=False))
      try:
        y, _, rstd = sweep.ab_first_call(cs, fn, xs[0])
      except Exception as e:  # noqa: BLE001 (a config the kernel refuses)
        print(f"{op} {shape} {cs} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32))))
      rerr = float(jnp.max(jnp.abs(rstd - rstd_ref) / rstd_ref))
      fns[cs] = (fn, f"y_err={err:.3g} rstd_rel={rerr:.2g}")
    sweep.ab_report(f"fwd {op} {shape}", fns, [(x,) for x in xs], rounds, 2 * nbytes)


if __name__ == "__main__":
  main()
