"""End-to-end train-step benchmark: ``python -m pallas_norm.bench --e2e``.

Trains decoder stacks with a jitted optax adamw step and times the step with each norm
variant, in one process, the variants alternated round by round so that machine drift
cancels:

  flax     flax's norms (``nnx.RMSNorm`` / ``nnx.LayerNorm``; Gemma: its own
           ``x * rsqrt(mean(x^2) + eps) * (1 + scale)`` in jnp, as flax's Gemma does),
           the residual add written ``h = h + delta`` before the norm;
  pallas   ``pallas_norm.RMSNorm`` / ``LayerNorm`` as drop-ins, the same code;
  fused    pallas_norm with the fused residual add: ``y, h = norm(delta, residual=h)``.

Configs (``--config NAME`` or ``--config key=value,...`` for your own sizes): a Llama-3
style stack (RMSNorm, GQA, SwiGLU), a Qwen3 style stack (plus QK-norm: RMSNorm over
head_dim 128 of q and k), and a Gemma style stack (zero-centred gamma: cast="gemma",
GeGLU, multi-query attention). bf16 activations, fp32 parameters and adamw state.

Per variant it reports:
  * step time: ``--chain`` steps dispatched back to back (as a training loop runs
    them), wall clock up to ``jax.block_until_ready`` divided by ``--chain``; the median
    of ``--rounds`` x ``--steps`` such samples (after compilation and ``--warmup``
    steps), and tokens/s = batch * seq / median;
  * compiled temp memory (``compile().memory_analysis().temp_size_in_bytes``);
  * a CUPTI breakdown of one step (``jax.experimental.mosaic.gpu.profiler``): every
    kernel's time, in categories: ``norm`` (pallas_norm's kernels and every XLA kernel
    whose HLO instruction carries the ``pn_norm`` name scope, which wraps the residual
    add and the norm in each variant: what XLA fuses around a norm, and the adds and
    casts around our calls), ``gemm``, ``attention``, ``other``.

``--fp8-dense`` (issue #27) times norm -> dense stacks instead: ``layers`` blocks
``h = h + dense(norm(h))`` ([batch * seq, d] bf16 activations, a d x d projection, fp32
params and adamw state, loss mean(h**2)), with the variants

  flax         ``nnx.RMSNorm`` then ``nnx.Linear``, both bf16 (``dtype=jnp.bfloat16``);
  pallas       ``pallas_norm.RMSNorm`` then ``nnx.Linear``;
  fp8          ``flax_layers.RMSNormDenseFP8``, delayed scaling (its Fp8Meta state is
               carried with the optimizer state and overwritten with its "gradient");
  fp8_current  the same with current scaling;

on the configs of ``FP8_DENSE_CONFIGS`` (``--config d4096`` etc.; ``key=value`` sizes
start from ``base=d4096``). Each row also counts the compiled step's cuBLAS GEMM calls
by target (``gemm_calls``: ``__cublas$lt$matmul$f8`` are the FP8 ones).

Output: JSON (and a PNG) under ``--out``; the table is printed. ``speedup``: flax's
median step time / the variant's; ``speedup_paired``: the median over rounds of the
same ratio within a round (drift between rounds cancels), with its interquartile range.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import re
import sys
import time

__all__ = ["CONFIGS", "FP8_DENSE_CONFIGS", "Config", "VARIANTS", "FP8_DENSE_VARIANTS",
           "build", "classify", "norm_fusions", "run_meta", "write_results", "main"]

VARIANTS = ("flax", "pallas", "fused")
FP8_DENSE_VARIANTS = ("flax", "pallas", "fp8", "fp8_current")


@dataclasses.dataclass(frozen=True)
class Config:
  """One decoder stack. ``style``: "llama" (RMSNorm, SwiGLU), "qwen3" (plus QK-norm) or
  "gemma" (zero-centred RMSNorm gamma, GeGLU)."""

  name: str
  style: str
  d: int
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  seq: int
  batch: int
  vocab: int = 32000
  eps: float = 1e-6
  packed_qkv: int = 0  # 1: one q|k|v projection, q and k sliced from it (the QK-norm's input)


CONFIGS = {
    "llama": Config("llama", "llama", d=4096, layers=2, heads=32, kv_heads=8, head_dim=128,
                    ffn=14336, seq=2048, batch=2),
    "qwen3": Config("qwen3", "qwen3", d=2048, layers=4, heads=16, kv_heads=8, head_dim=128,
                    ffn=6144, seq=4096, batch=1),
    "gemma": Config("gemma", "gemma", d=2048, layers=4, heads=8, kv_heads=1, head_dim=256,
                    ffn=16384, seq=2048, batch=2),
}

# --fp8-dense: norm -> dense stacks (style "dense"; the attention and MLP fields unused).
FP8_DENSE_CONFIGS = {
    f"d{d}": Config(f"d{d}", "dense", d=d, layers=4, heads=0, kv_heads=0, head_dim=0, ffn=0,
                    seq=2048, batch=4)
    for d in (4096, 8192)
}


def parse_config(text: str, configs: dict = CONFIGS) -> Config:
  """A name of ``configs``, or ``base=NAME,d=1024,layers=2,...`` (fields of the base's
  dataclass: Config here, decode.Config for ``--decode``; the base defaults to the first
  of ``configs``)."""
  if "=" not in text:
    if text not in configs:
      raise ValueError(f"--config {text!r}: not one of {sorted(configs)} (or key=value,...)")
    return configs[text]
  toks = [tok for tok in text.split(",") if tok]
  bad = [tok for tok in toks if "=" not in tok]
  if bad:
    raise ValueError(f"--config {text!r}: {bad} is not key=value")
  kv = dict(tok.split("=", 1) for tok in toks)
  base_name = kv.pop("base", next(iter(configs)))
  if base_name not in configs:
    raise ValueError(f"--config {text!r}: base={base_name!r} is not one of {sorted(configs)}")
  base = configs[base_name]
  fields = {f.name: f.type for f in dataclasses.fields(base)}
  unknown = set(kv) - set(fields)
  if unknown:
    raise ValueError(f"--config: unknown keys {sorted(unknown)}; fields: {sorted(fields)}")
  cast = {}
  for k, v in kv.items():
    try:
      cast[k] = float(v) if k == "eps" else v if k in ("name", "style") else int(v)
    except ValueError:
      raise ValueError(f"--config {text!r}: {k}={v!r} is not "
                       f"{'a number' if k == 'eps' else 'an integer'}") from None
  styles = ("dense",) if base.style == "dense" else ("llama", "qwen3", "gemma")
  if cast.get("style", base.style) not in styles:
    raise ValueError(f"--config {text!r}: style={cast['style']!r} is not one of {styles}")
  return dataclasses.replace(base, **{"name": f"custom_{base.name}", **cast})


# --------------------------------------------------------------------------- the model


def _norm_cls(variant: str, cfg: Config):
  """A factory ``make(num_features) -> module`` of the variant's norm."""
  import jax.numpy as jnp
  from flax import nnx

  import pallas_norm
  gemma = cfg.style == "gemma"
  common = dict(epsilon=cfg.eps, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  if variant == "flax":
    if gemma:
      return lambda n, rngs: _GemmaRMSNorm(n, cfg.eps, rngs=rngs)
    return lambda n, rngs: nnx.RMSNorm(n, **common, rngs=rngs)
  # cast="gemma" (HF GemmaRMSNorm): the torch arithmetic with scale_offset=1 (ops maps it
  # so; runs before 2026-11-23 15:00 passed scale_offset=1.0 itself, the same program).
  extra = dict(cast="gemma", scale_init=nnx.initializers.zeros) if gemma else {}
  return lambda n, rngs: pallas_norm.RMSNorm(n, **common, **extra, rngs=rngs)


class _GemmaRMSNorm:  # replaced by an nnx.Module subclass in _modules()
  pass


def _modules():
  """The nnx classes, defined once flax is imported (the module imports without it)."""
  global _GemmaRMSNorm
  import jax
  import jax.numpy as jnp
  from flax import nnx

  class GemmaRMSNorm(nnx.Module):
    """Gemma's RMSNorm as flax's Gemma writes it: float32, times (1 + scale)."""

    def __init__(self, n, eps, *, rngs):
      # one params key drawn, as flax's and pallas_norm's norms do: the same stream
      self.scale = nnx.Param(nnx.initializers.zeros(rngs.params(), (n,), jnp.float32))
      self.eps = eps

    def __call__(self, x):
      xf = x.astype(jnp.float32)
      y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
      return (y * (1.0 + self.scale[...])).astype(x.dtype)

  _GemmaRMSNorm = GemmaRMSNorm

  class Block(nnx.Module):
    def __init__(self, cfg: Config, variant: str, *, rngs):
      make = _norm_cls(variant, cfg)
      lin = functools.partial(nnx.Linear, use_bias=False, dtype=jnp.bfloat16,
                              param_dtype=jnp.float32, rngs=rngs)
      d, hd = cfg.d, cfg.head_dim
      self.cfg, self.fused = cfg, variant == "fused"
      self.attn_norm, self.mlp_norm = make(d, rngs), make(d, rngs)
      if cfg.packed_qkv:
        self.wqkv = lin(d, (cfg.heads + 2 * cfg.kv_heads) * hd)
      else:
        self.wq, self.wk = lin(d, cfg.heads * hd), lin(d, cfg.kv_heads * hd)
        self.wv = lin(d, cfg.kv_heads * hd)
      self.wo = lin(cfg.heads * hd, d)
      self.q_norm = make(hd, rngs) if cfg.style == "qwen3" else None
      self.k_norm = make(hd, rngs) if cfg.style == "qwen3" else None
      self.w_gate, self.w_up, self.w_down = lin(d, cfg.ffn), lin(d, cfg.ffn), lin(cfg.ffn, d)

    def attention(self, y):
      c = self.cfg
      b, s, _ = y.shape
      if c.packed_qkv:  # q and k are slices of one projection: inside the norms' scope,
        #                 so that a copy XLA makes of them for a custom call counts there
        qkv = self.wqkv(y).reshape(b, s, c.heads + 2 * c.kv_heads, c.head_dim)
        v = qkv[:, :, c.heads + c.kv_heads:]
        with jax.named_scope("pn_norm"):
          q, k = qkv[:, :, :c.heads], qkv[:, :, c.heads:c.heads + c.kv_heads]
      else:
        q = self.wq(y).reshape(b, s, c.heads, c.head_dim)
        k = self.wk(y).reshape(b, s, c.kv_heads, c.head_dim)
        v = self.wv(y).reshape(b, s, c.kv_heads, c.head_dim)
      if self.q_norm is not None:
        with jax.named_scope("pn_norm"):
          q, k = self.q_norm(q), self.k_norm(k)
      o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                       implementation=_ATTENTION["impl"])
      return self.wo(o.reshape(b, s, c.heads * c.head_dim))

    def mlp(self, y):
      act = (functools.partial(jax.nn.gelu, approximate=True) if self.cfg.style == "gemma"
             else jax.nn.silu)
      return self.w_down(act(self.w_gate(y)) * self.w_up(y))

    def __call__(self, delta, h):
      """(delta, h) -> (delta, h): h the residual stream, delta the last sublayer's
      output not yet added (None before the first block)."""
      for norm, sub in ((self.attn_norm, self.attention), (self.mlp_norm, self.mlp)):
        with jax.named_scope("pn_norm"):
          if delta is None:
            y = norm(h)
          elif self.fused:
            y, h = norm(delta, residual=h)
          else:
            h = h + delta
            y = norm(h)
        delta = sub(y)
      return delta, h

  class Model(nnx.Module):
    def __init__(self, cfg: Config, variant: str, *, rngs):
      self.embed = nnx.Embed(cfg.vocab, cfg.d, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                             rngs=rngs)
      self.blocks = nnx.List([Block(cfg, variant, rngs=rngs) for _ in range(cfg.layers)])
      self.final_norm = _norm_cls(variant, cfg)(cfg.d, rngs)
      self.head = nnx.Linear(cfg.d, cfg.vocab, use_bias=False, dtype=jnp.bfloat16,
                             param_dtype=jnp.float32, rngs=rngs)
      self.fused = variant == "fused"

    def __call__(self, tokens):
      h, delta = self.embed(tokens), None
      for block in self.blocks:
        delta, h = block(delta, h)
      with jax.named_scope("pn_norm"):
        if self.fused:
          y, _ = self.final_norm(delta, residual=h)
        else:
          y = self.final_norm(h + delta)
      return self.head(y)

  return Model


_ATTENTION = {"impl": None}  # jax.nn.dot_product_attention's implementation (--attention)


def _dense_stack(cfg: Config, variant: str, *, rngs):
  """--fp8-dense: ``cfg.layers`` blocks h = h + dense(norm(h)), d x d, bf16."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import flax_layers
  import pallas_norm
  bf16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)

  class Block(nnx.Module):
    def __init__(self):
      d = cfg.d
      if variant.startswith("fp8"):
        scaling = "current" if variant == "fp8_current" else "delayed"
        self.norm, self.dense = None, flax_layers.RMSNormDenseFP8(
            d, d, epsilon=cfg.eps, use_bias=False, scaling=scaling, **bf16, rngs=rngs)
      else:
        norm = nnx.RMSNorm if variant == "flax" else pallas_norm.RMSNorm
        self.norm = norm(d, epsilon=cfg.eps, **bf16, rngs=rngs)
        self.dense = nnx.Linear(d, d, use_bias=False, **bf16, rngs=rngs)

    def __call__(self, h):
      with jax.named_scope("pn_norm"):
        y = h if self.norm is None else self.norm(h)
      return h + self.dense(y)

  class Stack(nnx.Module):
    def __init__(self):
      self.blocks = nnx.List([Block() for _ in range(cfg.layers)])

    def __call__(self, h):
      for block in self.blocks:
        h = block(h)
      return h

  return Stack()


def _build_dense(cfg: Config, variant: str, seed: int):
  """build() for --fp8-dense: the state is (params, (opt_state, fp8_meta)); the step
  differentiates the Fp8Meta state too and keeps its gradient as its next value."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from flax_layers import fp8
  model = _dense_stack(cfg, variant, rngs=nnx.Rngs(seed))
  graphdef, params, meta = nnx.split(model, nnx.Param, fp8.Fp8Meta)
  tx = optax.adamw(1e-4)
  opt_state = (tx.init(params), meta)

  def loss_fn(params, meta, x):
    h = nnx.merge(graphdef, params, meta)(x)
    return jnp.mean(jnp.square(h.astype(jnp.float32)))

  def step(params, opt_state, x):
    opt_state, meta = opt_state
    loss, (grads, meta) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, meta, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), (opt_state, meta), loss

  return jax.jit(step), jax.jit(step, donate_argnums=(0, 1)), params, opt_state


def build(cfg: Config, variant: str, seed: int = 0):
  """(step, donating step, params, opt_state): a jitted adamw step on next-token loss
  (``cfg.style == "dense"``: on mean(h**2) of a norm -> dense stack)."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  if cfg.style == "dense":
    return _build_dense(cfg, variant, seed)
  model = _modules()(cfg, variant, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adamw(1e-4)
  opt_state = tx.init(params)

  def loss_fn(params, tokens):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step), jax.jit(step, donate_argnums=(0, 1)), params, opt_state


# --------------------------------------------------------------------------- measuring


_GEMM = re.compile(r"gemm|cutlass|cublas|nvjet|xmma|sm90|sm100|matmul|dot", re.I)
_ATTN = re.compile(r"flash|fmha|attention|cudnn|sdpa", re.I)


def norm_fusions(hlo_text: str) -> set[str]:
  """Names of the compiled HLO's top-level instructions (fusions, custom calls) whose
  metadata carries the ``pn_norm`` name scope: what XLA builds around (or of) the norms.
  Both spellings: the HLO's ``loop_add_fusion.3`` and the kernel's ``loop_add_fusion_3``."""
  out = set()
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
    if m and "pn_norm" in line:
      out.update((m.group(1), m.group(1).replace(".", "_").replace("-", "_")))
  return out


def classify(name: str, norm_names: set[str]) -> str:
  """A kernel's category: norm, gemm, attention or other."""
  base = name.split("(")[0].strip()
  if "pallas_norm" in base or base in norm_names:
    return "norm"
  if _ATTN.search(base):
    return "attention"
  if _GEMM.search(base):
    return "gemm"
  return "other"


_OTHER_TOP = 12  # the breakdown's "other_top": that many [kernel, us], the longest first


def _breakdown(step, args, hlo_text: str) -> dict:
  """CUPTI kernel time of one step by category (us), the norm kernels' names, the
  longest "other" kernels (``other_top``: [name, us] summed over a name's launches in one
  step), and ``launches``: the kernels launched in one step by category and in all (a
  host-bound step's wall time follows its launches more than its kernel time)."""
  from pallas_norm.bench import timing
  norm_names = norm_fusions(hlo_text)
  rot = timing.rotating_step(step, [args])
  _, timings = timing.profiler().measure(rot, aggregate=False, iterations=3)()
  calls = timings if timings and isinstance(timings[0], list) else [timings]
  per_cat = []
  for it in calls:
    cats = {"norm": 0.0, "gemm": 0.0, "attention": 0.0, "other": 0.0}
    for kname, ms in it:
      cats[classify(kname, norm_names)] += ms * 1e3
    per_cat.append(cats)
  import numpy as np
  out = {k: float(np.median([c[k] for c in per_cat])) for k in per_cat[0]}
  out["total"] = float(np.median([sum(c.values()) for c in per_cat]))
  out["norm_kernels"] = sorted({k for k, _ in calls[0] if classify(k, norm_names) == "norm"})
  other: dict[str, float] = {}  # the "other" kernels of the first call, by name
  launches = dict.fromkeys(per_cat[0], 0)
  for kname, ms in calls[0]:
    cat = classify(kname, norm_names)
    launches[cat] += 1
    if cat == "other":
      other[kname] = other.get(kname, 0.0) + ms * 1e3
  out["other_top"] = sorted(([k, round(v, 1)] for k, v in other.items()),
                            key=lambda kv: -kv[1])[:_OTHER_TOP]
  out["launches"] = dict(launches, total=len(calls[0]))
  return out


def _time_round(dstep, state, tokens, samples: int, chain: int):
  """``samples`` timings of one step each: ``chain`` steps dispatched back to back (as a
  training loop runs them), wall clock up to ``jax.block_until_ready`` of the last one's
  outputs, divided by ``chain``. Returns (seconds per step list, state, last loss)."""
  import jax
  params, opt_state = state
  jax.block_until_ready((params, opt_state))
  times = []
  for _ in range(samples):
    t0 = time.perf_counter()
    for _ in range(chain):
      params, opt_state, loss = dstep(params, opt_state, tokens)
    jax.block_until_ready((params, opt_state, loss))
    times.append((time.perf_counter() - t0) / chain)
  return times, (params, opt_state), float(loss)


def run_config(cfg: Config, args) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from flax_layers import fp8
  if cfg.style == "dense":  # the step's input: x [batch * seq, d] bf16
    tokens = jax.random.normal(jax.random.key(args.seed), (cfg.batch * cfg.seq, cfg.d),
                               jnp.bfloat16)
  else:
    tokens = jax.random.randint(jax.random.key(args.seed), (cfg.batch, cfg.seq + 1), 0,
                                cfg.vocab)
  order = FP8_DENSE_VARIANTS if cfg.style == "dense" else VARIANTS
  variants = [v for v in order if v in args.variants.split(",")]
  live = {}
  rows = {}
  for v in variants:
    step, dstep, params, opt_state = build(cfg, v, args.seed)
    compiled = step.lower(params, opt_state, tokens).compile()
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    row = {"config": cfg.name, "variant": v, **dataclasses.asdict(cfg),
           "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
           "norm_fusions": len(norm_fusions(hlo)),
           "gemm_calls": dict(fp8.gemm_calls_in(hlo))}
    try:
      row["breakdown"] = _breakdown(step, (params, opt_state, tokens), hlo)
    except Exception as e:  # noqa: BLE001 - CUPTI missing (CPU) or failing
      row["breakdown"] = {"status": "n/a", "reason": f"{type(e).__name__}: {e}"[:500]}
    del step, compiled
    state = (params, opt_state)
    _, state, _ = _time_round(dstep, state, tokens, args.warmup, 1)
    live[v], rows[v] = (dstep, state), row
  samples = {v: [] for v in variants}
  per_round = {v: [] for v in variants}  # each round's median
  for _ in range(args.rounds):  # alternate: drift hits every variant alike
    for v in variants:
      dstep, state = live[v]
      ts, state, loss = _time_round(dstep, state, tokens, args.steps, args.chain)
      live[v] = (dstep, state)
      samples[v] += ts
      per_round[v].append(float(np.median(ts)))
      rows[v]["loss"] = loss
  base = float(np.median(samples[variants[0]])) if variants[0] == "flax" else None
  out = []
  for v in variants:
    med = float(np.median(samples[v]))
    row = rows[v]
    row.update(step_ms=med * 1e3, step_ms_p10=float(np.percentile(samples[v], 10)) * 1e3,
               step_ms_p90=float(np.percentile(samples[v], 90)) * 1e3,
               samples=len(samples[v]), tokens_per_s=cfg.batch * cfg.seq / med,
               speedup=(base / med) if base else None)
    if base:  # paired by round: flax's round median over this variant's, same round
      ratios = np.asarray(per_round["flax"]) / np.asarray(per_round[v])
      row.update(speedup_paired=float(np.median(ratios)),
                 speedup_paired_p25=float(np.percentile(ratios, 25)),
                 speedup_paired_p75=float(np.percentile(ratios, 75)),
                 rounds=len(ratios))
    out.append(row)
    print(_line(row), flush=True)
  return out


def _line(r: dict) -> str:
  b = r.get("breakdown", {})
  cats = (" ".join(f"{k}={b[k]:.0f}" for k in ("norm", "gemm", "attention", "other", "total"))
          if "total" in b else f"breakdown n/a ({b.get('reason', '')[:80]})")
  sp = (f"{r['speedup']:.3f}x (paired {r['speedup_paired']:.3f}x, IQR "
        f"{r['speedup_paired_p25']:.3f}-{r['speedup_paired_p75']:.3f})"
        if r.get("speedup") else "-")
  temp = f"{r['temp_bytes'] / 2**30:.2f} GiB" if r.get("temp_bytes") else "n/a"
  return (f"{r['config']:<7} {r['variant']:<11} step {r['step_ms']:8.2f} ms "
          f"(p10 {r['step_ms_p10']:.2f}, p90 {r['step_ms_p90']:.2f}, n={r['samples']}) "
          f"{r['tokens_per_s']:9.0f} tok/s  speedup {sp}  temp {temp}  "
          f"CUPTI us: {cats}  loss {r['loss']:.4f}")


def format_table(rows: list[dict], meta: dict) -> str:
  lines = [f"{meta['device']}  {meta['date']}  commit {str(meta['git_commit'])[:10]}  "
           f"(step: median wall ms; CUPTI us of one step by category)",
           f"{'config':<7} {'variant':<11} {'step ms':>8} {'speedup':>8} {'paired':>7} {'tok/s':>9} "
           f"{'norm us':>8} {'gemm us':>8} {'attn us':>8} {'other us':>8} {'temp GiB':>8}"]
  for r in rows:
    b = r.get("breakdown", {})
    g = lambda k: f"{b[k]:8.0f}" if k in b else f"{'n/a':>8}"
    sp = (f"{r['speedup']:8.3f} {r['speedup_paired']:7.3f}" if r.get("speedup")
          else f"{'-':>8} {'-':>7}")
    tb = f"{r['temp_bytes'] / 2**30:8.2f}" if r.get("temp_bytes") else f"{'n/a':>8}"
    lines.append(f"{r['config']:<7} {r['variant']:<11} {r['step_ms']:8.2f} {sp} "
                 f"{r['tokens_per_s']:9.0f} {g('norm')} {g('gemm')} {g('attention')} "
                 f"{g('other')} {tb}")
  return "\n".join(lines)


def plot(doc: dict, png) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from pallas_norm.bench import report
  rows = doc["rows"]
  configs = list(dict.fromkeys(r["config"] for r in rows))
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  width = 0.8 / len(variants)
  for i, v in enumerate(variants):
    rs = [next((r for r in rows if r["config"] == c and r["variant"] == v), None)
          for c in configs]
    xs = [j + i * width for j in range(len(configs))]
    axes[0].bar(xs, [r["speedup"] or 1.0 if r else 0 for r in rs], width, label=v)
    axes[1].bar(xs, [r["breakdown"].get("norm", 0) if r else 0 for r in rs], width, label=v)
  for ax, title in zip(axes, ("step speedup over flax (median wall clock)",
                              "norm-attributed CUPTI us per step")):
    ax.set_xticks([j + width for j in range(len(configs))], configs)
    ax.set_title(title)
    ax.legend()
  axes[0].axhline(1.0, color="k", lw=0.5)
  fig.suptitle(f"{doc['meta']['device']} {doc['meta']['date']} {doc['meta']['git_commit']}")
  fig.tight_layout()
  report.save_png(fig, png)
  plt.close(fig)


def run_meta(argv, method: str) -> dict:
  """A run's metadata: the device, the date, the commit, the versions, the command line
  (``argv``, default sys.argv[1:]), XLA_FLAGS and ``method`` (also for ``--decode``)."""
  import jax

  from pallas_norm.bench import timing
  dev = jax.devices()[0]
  return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "git_commit": timing.git_commit(), "jax": jax.__version__,
          "flax": timing.version("flax"), "optax": timing.version("optax"),
          "argv": list(argv if argv is not None else sys.argv[1:]),
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "method": method}


def write_results(doc: dict, out, plot_fn, table: str) -> None:
  """Write ``doc`` as JSON at ``out`` and ``plot_fn(doc, png)`` beside it (a failing
  plot is reported, not raised), then print ``table`` and the path."""
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(doc, indent=1))
  try:
    plot_fn(doc, out.with_suffix(".png"))
  except Exception as e:  # noqa: BLE001
    print(f"plot failed: {e}", file=sys.stderr)
  print(table)
  print(f"wrote {out}")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m pallas_norm.bench --e2e",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--config", action="append",
                 help=f"one of {sorted(CONFIGS)} or key=value,... (base=NAME, then Config "
                      f"fields); repeatable; default: all three")
  p.add_argument("--fp8-dense", action="store_true",
                 help="time norm -> dense stacks: flax, pallas, fp8 (RMSNormDenseFP8, "
                      "delayed scaling), fp8_current; configs "
                      f"{sorted(FP8_DENSE_CONFIGS)} (default: all)")
  p.add_argument("--variants", default=None,
                 help=f"comma list (default: all; {','.join(VARIANTS)}, or with "
                      f"--fp8-dense {','.join(FP8_DENSE_VARIANTS)})")
  p.add_argument("--rounds", type=int, default=12, help="alternation rounds")
  p.add_argument("--steps", type=int, default=3,
                 help="timed samples per variant per round (each of --chain steps)")
  p.add_argument("--chain", type=int, default=5,
                 help="steps dispatched back to back per sample, then one "
                      "block_until_ready; the sample is their mean")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--attention", default="cudnn", choices=("cudnn", "xla"),
                 help="jax.nn.dot_product_attention implementation (cudnn falls back to "
                      "xla, with a note, where it cannot run)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--allow-cpu", action="store_true", help="run on CPU (smoke test)")
  p.add_argument("--out", help="JSON path (PNG beside it)")
  return p


def main(argv=None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  table = FP8_DENSE_CONFIGS if args.fp8_dense else CONFIGS
  known = FP8_DENSE_VARIANTS if args.fp8_dense else VARIANTS
  if args.variants is None:
    args.variants = ",".join(known)
  wanted = [v for v in args.variants.split(",") if v]
  if not wanted or set(wanted) - set(known):
    parser.error(f"--variants {args.variants!r}: choose from {','.join(known)}"
                 + ("" if args.fp8_dense else " (the FP8 dense variants need --fp8-dense)"))
  try:
    configs = [parse_config(c, table) for c in (args.config or sorted(table))]
  except ValueError as e:
    parser.error(str(e))
  for name in ("rounds", "steps", "chain"):
    if getattr(args, name) < 1:
      parser.error(f"--{name}={getattr(args, name)} must be >= 1")
  import jax
  if jax.default_backend() != "gpu" and not args.allow_cpu:
    print(f"pallas_norm.bench --e2e needs a GPU (jax.default_backend()="
          f"{jax.default_backend()!r}); --allow-cpu for a smoke run", file=sys.stderr)
    return 2
  _ATTENTION["impl"] = None if args.attention == "xla" else "cudnn"
  meta = run_meta(argv, "per sample: --chain steps dispatched back to back, wall clock "
                  "up to block_until_ready, divided by --chain; median of rounds x steps "
                  "samples, variants alternated round by round in one process; CUPTI "
                  "breakdown of one non-donating step (median of 3); norm = pallas_norm "
                  "kernels + XLA kernels of the pn_norm name scope")
  rows, notes = [], []
  for cfg in configs:
    try:
      rows += run_config(cfg, args)
    except Exception as e:  # noqa: BLE001
      if _ATTENTION["impl"] == "cudnn":
        notes.append(f"{cfg.name}: cudnn attention failed ({type(e).__name__}: "
                     f"{str(e)[:200]}); rerun with xla attention")
        print(notes[-1], flush=True)
        _ATTENTION["impl"] = None
        rows += run_config(cfg, args)
        _ATTENTION["impl"] = "cudnn"
      else:
        raise
  meta["notes"] = notes
  meta["attention"] = args.attention
  kind = "e2e_fp8_dense" if args.fp8_dense else "e2e"
  write_results({"meta": meta, "rows": rows},
                args.out or f"benchmarks/results/{kind}_{meta['git_commit']}.json",
                plot, format_table(rows, meta))
  return 0


if __name__ == "__main__":
  sys.exit(main())
