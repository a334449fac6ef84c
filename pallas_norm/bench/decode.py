"""Decode-step benchmark: ``python -m pallas_norm.bench --decode``.

A jitted forward step of a decoder stack over B tokens (one a sequence: a decode step),
with each norm variant, in one process, the variants alternated round by round:

  flax               flax's ``nnx.RMSNorm`` (Gemma: its ``x * rsqrt(mean(x^2) + eps) *
                     (1 + scale)`` in jnp, as flax's Gemma writes it), the residual add
                     ``h = h + delta`` before each norm;
  pallas_norm        ``pallas_norm.RMSNorm`` as a drop-in, the same code;
  pallas_norm_fused  pallas_norm with its fusions: the residual add,
                     ``y, h = norm(delta, residual=h)`` (Gemma: with the post-norm of
                     delta in the same kernel, ``post_norm=``), and the QK-norm read
                     from the packed projection in place (``pallas_norm.qk_norm``,
                     Qwen3 and Gemma; no slice copies).

The norm layers are those of the train-step bench (``e2e._norm_cls``). The step is
``step(params, cache, x) -> y``: x [B, d] bf16 through ``layers`` blocks of

  norm -> packed q|k|v projection d -> (heads + 2 kv_heads) * head_dim
       -> [qwen3, gemma: RMSNorm of q and of k over head_dim: B * (heads + kv_heads) rows]
       -> attention of the B queries over a fixed cache of ``cache`` keys and values
          plus the token's own (grouped-query; no RoPE)
       -> o projection -> [gemma: post-attention norm] -> residual add
  norm -> gated MLP (gate and up d -> ffn, SwiGLU; Gemma GeGLU; down ffn -> d)
       -> [gemma: post-MLP norm] -> residual add

then the final norm; y is the final norm's output (no LM head), fed back as the next
step's x. Weights are bf16 (norm scales float32, as flax's default); the parameters and
the cache are ARGUMENTS of the jitted step, not constants captured by it (each row
records ``const_bytes``: the bytes of every constant in the step's jaxpr, nested ones
included). Configs (``--configs`` names, or ``--config key=value,...`` from
``base=NAME``): Llama-3 style (RMSNorm, SwiGLU), Qwen3 style (plus QK-norm), Gemma 3
style (zero-centred gamma, ``cast="gemma"``; pre- and post-norms around each sublayer;
QK-norm; GeGLU), at d 2048 and 4096.

Per config, batch B (``--batches``) and variant it reports:
  * step time: ``--chain`` steps dispatched back to back, each on the last one's output
    (as a decode loop runs them), wall clock up to ``jax.block_until_ready`` divided by
    ``--chain``; the median (and p10, p90) of ``--rounds`` x ``--samples`` samples after
    compilation and ``--warmup`` steps; ``speedup`` = flax's median / the variant's and
    ``speedup_paired`` (the median over rounds of the same ratio within a round);
  * ``weight_gbs``: the bytes of the weights (read once a step) / the median time;
  * a CUPTI breakdown of one step (``e2e._breakdown``: norm = pallas_norm's kernels and
    every XLA kernel of the ``pn_norm`` name scope, which wraps each residual add and
    norm; gemm; attention; other);
  * ``max_abs_diff``: the largest |y - y_flax| of one step on the same x.

XLA flags: importing ``pallas_norm.bench`` turns XLA's command buffers (CUDA graphs)
off unless XLA_FLAGS names ``--xla_gpu_enable_command_buffer`` (``timing``), so that
CUPTI sees every kernel; every variant pays its kernels' launches alike.
``--command-buffers`` keeps XLA's default (a step's kernels launched as graphs, as a
user's jitted step runs). The flags are in the JSON's ``meta.xla_flags``.

Output: JSON (and a PNG) under ``--out``; the table is printed. Timing needs a GPU
(exit code 2 without one; ``--allow-cpu`` runs the step at toy sizes in interpret mode,
a smoke test); ``--dry-run`` prints the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from pallas_norm.bench import e2e

__all__ = ["BATCHES", "CONFIGS", "Config", "VARIANTS", "build", "const_bytes", "main"]

VARIANTS = ("flax", "pallas_norm", "pallas_norm_fused")
_E2E_VARIANT = {"flax": "flax", "pallas_norm": "pallas", "pallas_norm_fused": "fused"}
BATCHES = (1, 8, 64, 512)


@dataclasses.dataclass(frozen=True)
class Config:
  """One decoder stack for a decode step. ``style``: "llama" (RMSNorm, SwiGLU), "qwen3"
  (plus QK-norm over head_dim) or "gemma" (Gemma 3: zero-centred gamma, post-norms,
  QK-norm, GeGLU). ``cache``: the keys and values each query attends to besides its own."""

  name: str
  style: str
  d: int
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  cache: int = 16
  eps: float = 1e-6

  @property
  def qk_norm(self) -> bool:
    return self.style in ("qwen3", "gemma")

  @property
  def post_norms(self) -> bool:
    return self.style == "gemma"


# Widths and head layouts of Llama 3.2 1B / Llama 3 8B, Qwen3 1.7B / 8B, and a Gemma 3
# style stack at d 2048 (head_dim 256); 4 layers each (--layers).
CONFIGS = {
    "llama-2048": Config("llama-2048", "llama", d=2048, layers=4, heads=32, kv_heads=8,
                         head_dim=64, ffn=8192),
    "llama-4096": Config("llama-4096", "llama", d=4096, layers=4, heads=32, kv_heads=8,
                         head_dim=128, ffn=14336),
    "qwen3-2048": Config("qwen3-2048", "qwen3", d=2048, layers=4, heads=16, kv_heads=8,
                         head_dim=128, ffn=6144),
    "qwen3-4096": Config("qwen3-4096", "qwen3", d=4096, layers=4, heads=32, kv_heads=8,
                         head_dim=128, ffn=12288),
    "gemma-2048": Config("gemma-2048", "gemma", d=2048, layers=4, heads=8, kv_heads=4,
                         head_dim=256, ffn=8192),
}


def weight_bytes(cfg: Config) -> int:
  """Bytes of the bf16 projection weights a step reads (the norm scales are negligible)."""
  qkv = cfg.d * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
  o = cfg.heads * cfg.head_dim * cfg.d
  return 2 * cfg.layers * (qkv + o + 3 * cfg.d * cfg.ffn)


def norm_calls(cfg: Config, b: int) -> list[list[int]]:
  """The norms of a step as [count, M, N]: of width d (pre-norms, Gemma's post-norms,
  the final norm; M = B) and the QK-norm's over head_dim (M = B * heads for q and
  B * kv_heads for k, a layer each)."""
  calls = [[(4 if cfg.post_norms else 2) * cfg.layers + 1, b, cfg.d]]
  if cfg.qk_norm:
    calls += [[cfg.layers, b * cfg.heads, cfg.head_dim],
              [cfg.layers, b * cfg.kv_heads, cfg.head_dim]]
  return calls


# --------------------------------------------------------------------------- the model


def _model_cls():
  """The nnx decoder class, defined once flax is imported (the module imports without)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import pallas_norm
  e2e._modules()  # defines e2e._GemmaRMSNorm, flax's Gemma norm

  class Block(nnx.Module):
    def __init__(self, cfg: Config, variant: str, *, rngs):
      make = e2e._norm_cls(_E2E_VARIANT[variant], cfg)
      lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=jnp.bfloat16,  # noqa: E731
                                    param_dtype=jnp.bfloat16, rngs=rngs)
      d, hd = cfg.d, cfg.head_dim
      self.cfg, self.fused = cfg, variant == "pallas_norm_fused"
      self.attn_norm, self.mlp_norm = make(d, rngs), make(d, rngs)
      self.post_attn_norm = make(d, rngs) if cfg.post_norms else None
      self.post_mlp_norm = make(d, rngs) if cfg.post_norms else None
      self.q_norm = make(hd, rngs) if cfg.qk_norm else None
      self.k_norm = make(hd, rngs) if cfg.qk_norm else None
      self.wqkv = lin(d, (cfg.heads + 2 * cfg.kv_heads) * hd)
      self.wo = lin(cfg.heads * hd, d)
      self.w_gate, self.w_up, self.w_down = lin(d, cfg.ffn), lin(d, cfg.ffn), lin(cfg.ffn, d)

    def attention(self, y, kv):
      c = self.cfg
      b = y.shape[0]
      # The projection written once, as every variant's norms read it: without the
      # barrier XLA fused the B = 1 projection (a GEMV, a reduce fusion) into the
      # concatenate of v with the cache beside qk_norm's custom call, 124-142 us a
      # step (h200_2026-11-28_decode_565c321.json, Qwen3-2048 and Gemma-2048).
      qkv = jax.lax.optimization_barrier(
          self.wqkv(y).reshape(b, c.heads + 2 * c.kv_heads, c.head_dim))
      v = qkv[:, c.heads + c.kv_heads:]  # [B, kv_heads, head_dim]
      with jax.named_scope("pn_norm"):  # q and k slices: a copy made for a norm counts there
        q, k = qkv[:, :c.heads], qkv[:, c.heads:c.heads + c.kv_heads]
        if self.q_norm is not None and self.fused:  # both head ranges read in place
          qn = self.q_norm
          q, k = pallas_norm.qk_norm(qkv, qn.scale[...], self.k_norm.scale[...],
                                     num_heads=c.heads, num_kv_heads=c.kv_heads,
                                     eps=float(qn.epsilon), cast=qn.cast,
                                     param_cast=qn.dtype)
        elif self.q_norm is not None:  # B * heads and B * kv_heads rows of head_dim
          q, k = self.q_norm(q), self.k_norm(k)
      cache_k, cache_v = kv  # [B, S, kv_heads, head_dim] each
      keys = jnp.concatenate([cache_k, k[:, None]], axis=1)  # [B, S + 1, kv_heads, hd]
      vals = jnp.concatenate([cache_v, v[:, None]], axis=1)
      qg = q.reshape(b, c.kv_heads, c.heads // c.kv_heads, c.head_dim)
      s = jnp.einsum("bkgd,bskd->bkgs", qg, keys,
                     preferred_element_type=jnp.float32) * c.head_dim ** -0.5
      p = jax.nn.softmax(s, axis=-1).astype(vals.dtype)
      o = jnp.einsum("bkgs,bskd->bkgd", p, vals)  # [B, kv_heads, group, hd]
      return self.wo(o.reshape(b, c.heads * c.head_dim))

    def mlp(self, y):
      act = (lambda g: jax.nn.gelu(g, approximate=True)) if self.cfg.style == "gemma" \
          else jax.nn.silu
      return self.w_down(act(self.w_gate(y)) * self.w_up(y))

    def __call__(self, delta, h, kv, pending=None):
      """(delta, h, pending) -> (delta, h, pending): h the residual stream, delta the
      last sublayer's output not yet added (None before the first block), pending the
      post-norm still to apply to it (the fused variant's Gemma post-norms, run in the
      next norm's kernel: ``norm(delta, residual=h, post_norm=pending)``)."""
      subs = ((self.attn_norm, self.post_attn_norm, lambda y: self.attention(y, kv)),
              (self.mlp_norm, self.post_mlp_norm, self.mlp))
      for norm, post, sub in subs:
        with jax.named_scope("pn_norm"):
          if delta is None:
            y = norm(h)
          elif self.fused:
            y, h = norm(delta, residual=h, post_norm=pending)
          else:
            h = h + delta
            y = norm(h)
        delta, pending = sub(y), None
        if post is not None and self.fused:
          pending = post
        elif post is not None:
          with jax.named_scope("pn_norm"):
            delta = post(delta)
      return delta, h, pending

  class Decoder(nnx.Module):
    def __init__(self, cfg: Config, variant: str, *, rngs):
      self.blocks = nnx.List([Block(cfg, variant, rngs=rngs) for _ in range(cfg.layers)])
      self.final_norm = e2e._norm_cls(_E2E_VARIANT[variant], cfg)(cfg.d, rngs)
      self.fused = variant == "pallas_norm_fused"

    def __call__(self, x, cache):
      """x: [B, d]; cache: one (keys, values) a layer, [B, S, kv_heads, head_dim] each."""
      h, delta, pending = x, None, None
      for block, kv in zip(self.blocks, cache):
        delta, h, pending = block(delta, h, kv, pending)
      with jax.named_scope("pn_norm"):
        if self.fused:
          y, _ = self.final_norm(delta, residual=h, post_norm=pending)
        else:
          y = self.final_norm(h + delta)
      return y

  return Decoder


def build(cfg: Config, variants=VARIANTS, seed: int = 0):
  """({variant: jitted step(params, cache, x) -> y [B, d]}, params): one parameter
  pytree (the flax variant's initialisation) that every variant's step takes as its
  first argument.

  Raises:
    ValueError: a variant not in VARIANTS, or a variant whose parameters are not laid
      out as flax's.
  """
  import jax
  from flax import nnx
  bad = [v for v in variants if v not in VARIANTS]
  if bad:
    raise ValueError(f"{bad=} must be in {VARIANTS}")
  decoder = _model_cls()
  _, params = nnx.split(decoder(cfg, "flax", rngs=nnx.Rngs(seed)), nnx.Param)
  steps = {}
  for v in variants:
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda v=v: decoder(cfg, v, rngs=nnx.Rngs(seed))),
                                   nnx.Param)
    if jax.tree.structure(abstract) != jax.tree.structure(params):
      raise ValueError(f"variant {v!r}: its parameters are not laid out as flax's")

    def step(params, cache, x, graphdef=graphdef):
      return nnx.merge(graphdef, params)(x, cache)

    steps[v] = jax.jit(step)
  return steps, params


def inputs(cfg: Config, b: int, seed: int = 0):
  """(cache, x): the fixed keys and values of every layer, [B, S, kv_heads, head_dim]
  bf16 each, and x [B, d] bf16."""
  import jax
  import jax.numpy as jnp
  keys = jax.random.split(jax.random.key(seed + 1), 2 * cfg.layers + 1)
  shape = (b, cfg.cache, cfg.kv_heads, cfg.head_dim)
  cache = [(jax.random.normal(keys[2 * i], shape, jnp.bfloat16),
            jax.random.normal(keys[2 * i + 1], shape, jnp.bfloat16)) for i in range(cfg.layers)]
  return cache, jax.random.normal(keys[-1], (b, cfg.d), jnp.bfloat16)


def const_bytes(closed_jaxpr) -> int:
  """Bytes of every constant of ``closed_jaxpr`` and of the jaxprs nested in its
  equations (a jitted function's own constants sit in its pjit equation's jaxpr)."""
  import numpy as np
  from jax.extend import core as jcore

  def nested(params):
    for p in params.values():
      for item in p if isinstance(p, (tuple, list)) else (p,):
        if isinstance(item, (jcore.ClosedJaxpr, jcore.Jaxpr)):
          yield item

  def walk(j) -> int:
    total = 0
    if isinstance(j, jcore.ClosedJaxpr):
      total += sum(int(np.asarray(c).nbytes) if hasattr(c, "shape") else 0 for c in j.consts)
      j = j.jaxpr
    for eqn in j.eqns:
      total += sum(walk(sub) for sub in nested(eqn.params))
    return total

  return walk(closed_jaxpr)


# --------------------------------------------------------------------------- measuring


def _time_round(step, params, cache, x, samples: int, chain: int) -> list[float]:
  """``samples`` timings (seconds a step): ``chain`` steps back to back, each on the last
  one's output, wall clock up to ``jax.block_until_ready``, divided by ``chain``."""
  import jax
  times = []
  for _ in range(samples):
    t0 = time.perf_counter()
    y = x
    for _ in range(chain):
      y = step(params, cache, y)
    jax.block_until_ready(y)
    times.append((time.perf_counter() - t0) / chain)
  return times


def run_case(cfg: Config, b: int, steps: dict, params, args) -> list[dict]:
  """Every variant of ``steps`` at batch ``b``, alternated for ``args.rounds`` rounds."""
  import jax
  import numpy as np
  cache, x = inputs(cfg, b, args.seed)
  rows, ys = {}, {}
  for v, step in steps.items():
    compiled = step.lower(params, cache, x).compile()
    hlo = compiled.as_text()
    row = {"config": cfg.name, "batch": b, "variant": v, **dataclasses.asdict(cfg),
           "weight_bytes": weight_bytes(cfg), "norm_calls": norm_calls(cfg, b),
           "const_bytes": const_bytes(jax.make_jaxpr(step)(params, cache, x)),
           "norm_fusions": len(e2e.norm_fusions(hlo))}
    try:
      row["breakdown"] = e2e._breakdown(step, (params, cache, x), hlo)
    except Exception as e:  # noqa: BLE001 - CUPTI missing (CPU) or failing
      row["breakdown"] = {"status": "n/a", "reason": f"{type(e).__name__}: {e}"[:500]}
    ys[v] = np.asarray(step(params, cache, x), np.float32)
    _time_round(step, params, cache, x, args.warmup, 1)
    rows[v] = row
  samples = {v: [] for v in steps}
  per_round = {v: [] for v in steps}
  for _ in range(args.rounds):  # alternate: drift hits every variant alike
    for v, step in steps.items():
      ts = _time_round(step, params, cache, x, args.samples, args.chain)
      samples[v] += ts
      per_round[v].append(float(np.median(ts)))
  base = float(np.median(samples["flax"])) if "flax" in steps else None
  out = []
  for v in steps:
    med = float(np.median(samples[v]))
    row = rows[v]
    row.update(us=med * 1e6, us_p10=float(np.percentile(samples[v], 10)) * 1e6,
               us_p90=float(np.percentile(samples[v], 90)) * 1e6, samples=len(samples[v]),
               weight_gbs=weight_bytes(cfg) / med / 1e9,
               speedup=(base / med) if base else None,
               max_abs_diff=(float(np.max(np.abs(ys[v] - ys["flax"]))) if base else None))
    if base:
      ratios = np.asarray(per_round["flax"]) / np.asarray(per_round[v])
      row.update(speedup_paired=float(np.median(ratios)),
                 speedup_paired_p25=float(np.percentile(ratios, 25)),
                 speedup_paired_p75=float(np.percentile(ratios, 75)), rounds=len(ratios))
    out.append(row)
  return out


def _cell(b: dict, k: str) -> str:
  return f"{b[k]:8.1f}" if k in b else f"{'n/a':>8}"


def format_table(rows: list[dict], meta: dict) -> str:
  w = max([11] + [len(r["config"]) for r in rows])
  lines = [f"{meta['device']}  {meta['date']}  commit {str(meta['git_commit'])[:10]}  "
           f"(step: median wall us; CUPTI us of one step by category; kernels: launched a step)",
           f"{'config':<{w}} {'B':>4} {'variant':<17} {'step us':>8} {'p10':>8} {'p90':>8} "
           f"{'speedup':>7} {'paired':>7} {'norm us':>8} {'gemm us':>8} {'attn us':>8} "
           f"{'other us':>8} {'kernels':>7} {'wt GB/s':>7} {'max|dy|':>7}"]
  for r in rows:
    b = r.get("breakdown", {})
    sp = (f"{r['speedup']:7.3f} {r['speedup_paired']:7.3f}" if r.get("speedup")
          else f"{'-':>7} {'-':>7}")
    diff = f"{r['max_abs_diff']:7.3f}" if r.get("max_abs_diff") is not None else f"{'-':>7}"
    lines.append(f"{r['config']:<{w}} {r['batch']:>4} {r['variant']:<17} {r['us']:8.1f} "
                 f"{r['us_p10']:8.1f} {r['us_p90']:8.1f} {sp} "
                 + " ".join(_cell(b, k) for k in ("norm", "gemm", "attention", "other"))
                 + f" {b.get('launches', {}).get('total', '-'):>7}"
                 + f" {r['weight_gbs']:7.0f} {diff}")
  return "\n".join(lines)


def plot(doc: dict, png) -> None:
  """Per config: the speedup over flax against B, and the norm-attributed CUPTI us."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from pallas_norm.bench import report
  rows = doc["rows"]
  configs = list(dict.fromkeys(r["config"] for r in rows))
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  fig, axes = plt.subplots(2, len(configs), figsize=(3.6 * len(configs), 6.5), squeeze=False)
  for j, c in enumerate(configs):
    for v in variants:
      rs = sorted((r for r in rows if r["config"] == c and r["variant"] == v),
                  key=lambda r: r["batch"])
      bs = [r["batch"] for r in rs]
      axes[0][j].plot(bs, [r["speedup"] or 1.0 for r in rs], "o-", label=v)
      axes[1][j].plot(bs, [r["breakdown"].get("norm", float("nan")) for r in rs], "o-",
                      label=v)
    axes[0][j].axhline(1.0, color="k", lw=0.5)
    axes[0][j].set_title(f"{c}\nspeedup over flax (wall)", fontsize=9)
    axes[1][j].set_title(f"{c}\nnorm-attributed CUPTI us a step", fontsize=9)
    for ax in (axes[0][j], axes[1][j]):
      ax.set_xscale("log", base=2)
      ax.set_xlabel("B (tokens)")
  axes[0][0].legend(fontsize=8)
  fig.suptitle(f"decode step, {doc['meta']['device']} {doc['meta']['date']} "
               f"{doc['meta']['git_commit']}")
  fig.tight_layout()
  report.save_png(fig, png)
  plt.close(fig)


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m pallas_norm.bench --decode",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--configs", default=",".join(CONFIGS),
                 help=f"comma list of {','.join(CONFIGS)} (default: all)")
  p.add_argument("--config", action="append", default=[],
                 help="one more config, key=value,... from base=NAME (Config fields, e.g. "
                      "base=qwen3-4096,layers=8,cache=512); repeatable")
  p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                 help="tokens a step (default 1,8,64,512)")
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help=f"comma list of {','.join(VARIANTS)} (default: all)")
  p.add_argument("--layers", type=int, help="layers of every config (default: its own, 4)")
  p.add_argument("--cache", type=int, help="cached keys and values a query attends to, "
                                           "every config (default: its own, 16)")
  p.add_argument("--rounds", type=int, default=10, help="alternation rounds")
  p.add_argument("--samples", type=int, default=3, help="samples per variant per round")
  p.add_argument("--chain", type=int, default=10,
                 help="steps a sample, each on the last one's output, then one "
                      "block_until_ready; the sample is their mean")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--budget-s", type=float, default=240.0,
                 help="start no new (config, B) case after this many seconds (default 240)")
  p.add_argument("--command-buffers", action="store_true",
                 help="keep XLA's default command buffers (CUDA graphs: a step's kernels "
                      "launched as one graph, as a user's jitted step runs); the CUPTI "
                      "breakdown may then miss kernels")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--allow-cpu", action="store_true", help="run on CPU (smoke test)")
  p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
  p.add_argument("--out", help="JSON path (PNG beside it); default "
                               "benchmarks/results/decode_<commit>.json")
  p.add_argument("--hlo-dir", help="also write each case's optimised HLO, one file a "
                                   "variant: DIR/decode_<config>_B<b>_<variant>.hlo.txt "
                                   "(which fusion a kernel of the breakdown is)")
  return p


def _configs(args, parser) -> list[Config]:
  names = [n for n in args.configs.split(",") if n]
  bad = [n for n in names if n not in CONFIGS]
  if bad:
    parser.error(f"--configs {bad} not in {list(CONFIGS)}")
  try:
    configs = [CONFIGS[n] for n in names] + [e2e.parse_config(t, CONFIGS) for t in args.config]
  except ValueError as e:
    parser.error(str(e))
  if not configs:
    parser.error("no config: give --configs or --config")
  over = {k: getattr(args, k) for k in ("layers", "cache") if getattr(args, k) is not None}
  configs = [dataclasses.replace(c, **over) for c in configs]
  for c in configs:
    if c.heads % c.kv_heads or c.layers < 1 or c.cache < 0:
      parser.error(f"config {c.name}: heads={c.heads} must be a multiple of kv_heads="
                   f"{c.kv_heads}, layers={c.layers} >= 1 and cache={c.cache} >= 0")
  return configs


def _parse(argv):
  parser = _parser()
  args = parser.parse_args(argv)
  args.variants = tuple(v for v in args.variants.split(",") if v)
  if not args.variants or set(args.variants) - set(VARIANTS):
    parser.error(f"--variants {','.join(args.variants)!r}: choose from {','.join(VARIANTS)}")
  try:
    args.batches = tuple(dict.fromkeys(int(b) for b in args.batches.split(",") if b))
  except ValueError:
    parser.error(f"--batches {args.batches!r} must be a comma list of integers")
  if not args.batches or min(args.batches) < 1:
    parser.error(f"--batches {args.batches!r} must be positive integers")
  for name in ("rounds", "samples", "chain"):
    if getattr(args, name) < 1:
      parser.error(f"--{name}={getattr(args, name)} must be >= 1")
  return args, _configs(args, parser)


def write_hlo(cfg: Config, b: int, steps: dict, params, directory, seed: int = 0) -> list:
  """Each variant's step at batch ``b`` compiled as timed, its optimised HLO written to
  ``directory/decode_<config>_B<b>_<variant>.hlo.txt`` (the fusions the CUPTI breakdown
  names: ``loop_reduce_fusion_11`` and the like); returns the paths."""
  import pathlib
  d = pathlib.Path(directory)
  d.mkdir(parents=True, exist_ok=True)
  cache, x = inputs(cfg, b, seed)
  paths = []
  for v, step in steps.items():
    path = d / f"decode_{cfg.name}_B{b}_{v}.hlo.txt"
    path.write_text(step.lower(params, cache, x).compile().as_text())
    paths.append(path)
  return paths


def print_plan(configs: list[Config], args) -> None:
  """``--dry-run``: every (config, B) case, its weights and the rows its norms see."""
  n = len(configs) * len(args.batches)
  print(f"plan: {n} cases x {len(args.variants)} variants ({','.join(args.variants)}), "
        f"{n * len(args.variants)} compiles; rounds={args.rounds} x samples={args.samples} "
        f"x chain={args.chain} steps a variant; budget={args.budget_s:.0f}s")
  for c in configs:
    print(f"  {c.name:<11} {c.style:<5} d={c.d} layers={c.layers} heads={c.heads}/"
          f"{c.kv_heads}x{c.head_dim} ffn={c.ffn} cache={c.cache} weights="
          f"{weight_bytes(c) / 2**20:.0f} MiB bf16")
    for b in args.batches:
      calls = ", ".join(f"{k} x [{m}, {n}]" for k, m, n in norm_calls(c, b))
      print(f"    B={b:<4} norms a step (count x [M, N]): {calls}")


def main(argv=None) -> int:
  args, configs = _parse(argv)
  if args.dry_run:
    print_plan(configs, args)
    return 0
  if args.command_buffers:
    from pallas_norm.bench import timing
    timing.keep_command_buffers()
  import jax
  if jax.default_backend() != "gpu" and not args.allow_cpu:
    print(f"pallas_norm.bench --decode needs a GPU to time (jax.default_backend()="
          f"{jax.default_backend()!r}); --dry-run prints the plan, --allow-cpu runs a "
          f"smoke test", file=sys.stderr)
    return 2
  meta = e2e.run_meta(argv, "per sample: --chain steps dispatched back to back, each on "
                      "the last one's output, wall clock up to block_until_ready, divided "
                      "by --chain; median of rounds x samples, variants alternated round "
                      "by round in one process; params and cache are arguments of the "
                      "jitted step; CUPTI breakdown of one step (median of 3); norm = "
                      "pallas_norm kernels + XLA kernels of the pn_norm name scope")
  start, rows, skipped = time.monotonic(), [], []
  for cfg in configs:
    steps, params = build(cfg, args.variants, args.seed)
    for b in args.batches:
      if time.monotonic() - start > args.budget_s:
        skipped.append(f"{cfg.name} B={b}")
        continue
      case = run_case(cfg, b, steps, params, args)
      if args.hlo_dir:
        write_hlo(cfg, b, steps, params, args.hlo_dir, args.seed)
      for r in case:
        print(format_table([r], meta).splitlines()[-1], flush=True)
      rows += case
    del steps, params
  meta["skipped_over_budget"] = skipped
  if skipped:
    print(f"over --budget-s {args.budget_s:.0f}: skipped {', '.join(skipped)}", flush=True)
  e2e.write_results({"meta": meta, "rows": rows},
                    args.out or f"benchmarks/results/decode_{meta['git_commit']}.json",
                    plot, format_table(rows, meta))
  return 0


if __name__ == "__main__":
  sys.exit(main())
