"""A/B of backward configs (stage 1 + 2), rounds interleaved, on rotated inputs.

  python benchmarks/ab_split_bwd.py {rms|layer} ROUNDS SHAPES CFGS

SHAPES: comma-separated MxN. CFGS: ';'-separated, each one of the following, with
"@nocg" or "@cgall" appended to trace it with the x/dy loads' cache modifier off
(_compat.py) or on for all of them (sweep.ab_first_call):
  default                       config.backward_config's pick
  split:bn,nw,occ,stages,chunk[,lag[,bm[,early]]]
                                split-row kernel, G = occ x SMs / cdiv(N, bn);
                                early 1 sets split_early_publish
  reload:bm,bn,nw,occ           reload-row kernel, G = occ x SMs
  tile:bm,bn,nw,occ             single-tile persistent kernel (bn >= N), G = occ x SMs
  tileg:bm,bn,nw,G              the same with G programs
  pieces:bm,nw,occ,w1,w2,...    the same, its tile cut into column pieces w1, w2, ...
  pair:bn,nw,occ                row-statistics + column-tiled pair
Method: benchmarks/sweep.py's CUPTI kernel time (median of 10 calls a round, printed
per round), inputs rotated over >= 256 MiB; dx and dscale checked against the XLA
reference. PN_NOLIMIT=1: see sweep.ab_warm_up.
The measurement behind config.py's _BWD_SPLIT_* rule.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402  (sets XLA_FLAGS before jax starts a backend)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_norm import config as C, reference  # noqa: E402
from pallas_norm.kernels import backward  # noqa: E402


def _config(kind, a, m, n, sm, sms):
  if kind == "default":
    return C.backward_config(m, n, jnp.bfloat16, subtract_mean=sm)
  if kind == "split":
    bn, nw, occ, st, ch, *rest = a
    bm = rest[1] if len(rest) > 1 else 1
    g = min(-(-m // bm), max(1, occ * sms // -(-n // bn)))
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            num_stages=st, split_rows=True, chunk_n=ch,
                            split_lag=rest[0] if rest else 2,
                            split_early_publish=bool(rest[2]) if len(rest) > 2 else False,
                            **C.reduce_config(n, g))
  if kind == "reload":
    bm, bn, nw, occ = a
    g = min(-(-m // bm), occ * sms)
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            reload_rows=True, **C.reduce_config(n, g))
  if kind == "tile":
    bm, bn, nw, occ = a
    g = min(-(-m // bm), occ * sms)
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            **C.reduce_config(n, g))
  if kind == "tileg":
    bm, bn, nw, g = a
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            **C.reduce_config(n, g))
  if kind == "pieces":
    bm, nw, occ, *widths = a
    g = min(-(-m // bm), occ * sms)
    return C.BackwardConfig(block_m=bm, block_n=C.next_power_of_2(sum(widths)),
                            num_warps=nw, num_programs=g, pieces=tuple(widths),
                            **C.reduce_config(n, g))
  if kind == "pair":
    bn, nw, occ = a
    g = max(1, occ * sms // -(-n // bn))
    return C.BackwardConfig(block_m=1, block_n=bn, num_warps=nw, num_programs=g,
                            **C.reduce_config(n, g))
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
    xs = [jax.random.normal(jax.random.fold_in(key, i), (m, n), dt) for i in range(reps)]
    dys = [jax.random.normal(jax.random.fold_in(key, 99 + i), (m, n), dt) for i in range(reps)]
    scale = jnp.ones((n,), jnp.bfloat16) * 1.25
    bias = jnp.ones((n,), jnp.bfloat16) * 0.5 if sm else None
    f = lambda x, s, b: reference.norm(x, s, b, eps=1e-5, subtract_mean=sm)  # noqa: E731
    stats = [f(x, scale, bias) for x in xs]
    _, pull = jax.vjp(lambda x, s: f(x, s, bias)[0], xs[0], scale)
    dxr, dsr = [a.astype(jnp.float32) for a in pull(dys[0])]
    fns = {}
    for cs in cfgs.split(";"):
      kind, _, args = cs.partition(":")
      args, kind = (v.removesuffix("@nocg").removesuffix("@cgall") for v in (args, kind))
      cfg = _config(kind, [int(v) for v in args.split(",")] if args else [], m, n, sm, sms)
      fn = jax.jit(lambda dy, x, mean, rstd, cfg=cfg: backward.norm_backward(
          dy, x, scale, mean, rstd, has_bias=sm, scale_offset=0.0, subtract_mean=sm,
          config=cfg, interpret=False, scale_dtype=scale.dtype, bias_dtype=jnp.bfloat16))
      try:
        out = sweep.ab_first_call(cs, fn, dys[0], xs[0], stats[0][1], stats[0][2])
      except Exception as e:  # noqa: BLE001 (a config the kernel refuses)
        print(f"{op} {shape} {cs} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      err = float(jnp.max(jnp.abs(out[0].astype(jnp.float32) - dxr)))
      errs = float(jnp.max(jnp.abs(out[1].astype(jnp.float32) - dsr))
                   / (jnp.max(jnp.abs(dsr)) + 1e-9))
      fns[cs] = (fn, f"dx_err={err:.3g} ds_rel={errs:.2g}")
    ins = [(dy, x, s[1], s[2]) for dy, x, s in zip(dys, xs, stats)]
    sweep.ab_report(f"bwd {op} {shape}", fns, ins, rounds, 3 * nbytes)


if __name__ == "__main__":
  main()
