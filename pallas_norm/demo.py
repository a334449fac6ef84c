"""The main job: train a small Llama-style character-level transformer on real text.

``python -m pallas_norm.demo`` (or ``make demo``) trains a Flax NNX model whose every
RMSNorm (two per block, plus the final norm) is ``pallas_norm.RMSNorm``, with optax
AdamW and a ``jax.jit`` train step. It then trains the identical model with
``flax.nnx.RMSNorm``, from the same init on the same batches, and prints both loss
curves' end points, both speeds, and a few lines sampled from the pallas_norm model.
A loss-curve PNG goes to ``--out``.

The text is the Python documentation that ships with every CPython
(``pydoc_data.topics``), or ``--text FILE``. On a machine with no GPU the Pallas
kernels run in interpret mode (slow, but the same kernels); on a GPU the same command
runs them compiled.

With several local devices (``--devices``, default all of them) each step is data
parallel: standard ``jax.jit`` SPMD over a 1-D ``("data",)`` mesh with Auto axis types,
the model and optimizer state replicated and each batch split over its rows, so that
pallas_norm's kernels run on every device's own rows and only gradients are all-reduced.

Across processes (issue #59; docs/multi_gpu.md, "Many hosts") the same step runs on one
global mesh under ``jax.distributed``: ``--coordinator HOST:PORT --num-processes K
--process-id I`` (what SLURM, Kubernetes or mpirun start each process with), or
``--distributed auto`` (``jax.distributed.initialize()``'s cluster detection). The mesh
holds ``--devices`` local devices of every process; every process draws the same global
batches and feeds its own rows (``jax.make_array_from_process_local_data``), and only
process 0 prints and writes files. ``--processes K`` launches K such processes on this
machine (``pallas_norm.distributed.launch``): one GPU each where there are K GPUs, else
``--devices`` (default 1) fake CPU devices each.

``--fp8`` adds a third model (issue #27): the same one with each block's norm -> dense
pairs (the attention norm -> qkv, the MLP norm -> gate/up projection) replaced by
``flax_layers.RMSNormDenseFP8`` (FP8 activations and weights, e5m2 gradients, delayed
scaling by default, ``--fp8-scaling``), and all three compute in bfloat16 (float32
params): the demo then reports how closely the FP8 model's loss curve tracks the bf16
pallas_norm model's (final losses and the max |Δloss| over the run), from the same init
on the same batches. The train step differentiates the FP8 layers' ``Fp8Meta`` state
too and writes its "gradients" (the new amax histories) back (``update_fp8_meta``).

Model (pre-norm blocks)::

    h = embed(tokens)                                  # [B, T, D]
    for each block:
      h = h + attention(rms_norm(h))                   # causal, RoPE
      h = h + w_down(silu(w_gate(rms_norm(h))) * w_up(rms_norm(h)))   # SwiGLU
    logits = lm_head(rms_norm(h))                       # [B, T, V]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import pallas_norm
from flax_layers import fp8 as _fp8_layers
from pallas_norm import config as _config
from pallas_norm import distributed as _distributed
from pallas_norm import ops as _ops

__all__ = ["DemoConfig", "RunResult", "DemoResults", "CharTransformer", "load_text",
           "check_config", "data_parallel_devices", "data_mesh", "train", "fp8_tracking",
           "FP8_TOLERANCE", "main"]

# Fraction of the text held out for the held-out loss (the tail of the text).
_HELDOUT_FRACTION = 0.1
_SAMPLE_PROMPTS = 3
# --fp8: the steps at the end whose mean loss the FP8 / bf16 comparison reports.
_FP8_TAIL = 50
# --fp8: how closely the FP8 model's train loss (nats/char) must track the bf16 model's.
# The yardstick is the bf16 noise floor: pallas_norm's and flax's bf16 models, which
# differ only in rounding, drift apart by max |Δ| 0.028 over 300 steps of the default
# config (CPU, backend xla, 2026-11-23); the FP8 model (delayed or current scaling) by
# 0.047-0.048, its last-50-step mean by +0.004/+0.005 and its held-out loss by
# +0.010/+0.018. The bounds leave about 2x headroom over those measurements.
FP8_TOLERANCE = {
    "max_abs_diff": 0.1,  # any single step (one batch of 16 x 64 chars: noisy)
    "final_diff": 0.02,  # mean of the last _FP8_TAIL steps, |FP8 - bf16| (~1% of 1.8)
    "heldout_diff": 0.04,  # |held-out loss FP8 - bf16| after training
}


# --backend: pallas_norm's backends, and "auto" for backend=None (ops.rms_norm)
BACKENDS = _ops.BACKENDS + ("auto",)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """Everything one demo run depends on (the CLI flags)."""

  steps: int = 1000
  batch: int = 16
  seq: int = 64
  d_model: int = 64
  layers: int = 2
  heads: int = 4
  learning_rate: float = 3e-3
  mode: str | None = None
  backend: str = "pallas"
  text: str | None = None  # a UTF-8 file; None: pydoc_data.topics
  out: str = "demo_out"
  seed: int = 0
  eval_batches: int = 4
  sample_chars: int = 120
  progress: bool = True
  # local devices (of each process) for data parallel; None: all; 1: one device
  devices: int | None = None
  fp8: bool = False  # also train the FP8 model (norm -> dense pairs fused, FP8 GEMMs); bf16
  fp8_scaling: str = "delayed"  # the FP8 layers' scaling: "delayed" or "current"


@dataclasses.dataclass
class RunResult:
  """One model's training run."""

  norm: str  # the norm class the model uses
  losses: np.ndarray  # [steps] f32 train loss of each step's batch
  train_loss: float  # mean loss on eval_batches fixed train batches, after training
  heldout_loss: float  # the same on held-out batches
  steps_per_s: float  # after the first (compiling) step
  compile_s: float  # wall time of the first step
  # The sharding of the token batches handed to the train step; None: host arrays (one
  # device, the single-device path).
  batch_sharding: jax.sharding.Sharding | None = None


@dataclasses.dataclass
class DemoResults:
  """What ``train`` returns: both runs, samples and facts about the setup."""

  pallas: RunResult
  flax: RunResult
  samples: list[str]  # text generated by the pallas_norm model
  num_params: int
  vocab_size: int
  text_chars: int
  num_devices: int = 1  # devices each train step ran on (in all processes)
  mesh: jax.sharding.Mesh | None = None  # the data-parallel mesh; None: one device
  fp8: RunResult | None = None  # --fp8: the FP8 model's run (the others then run in bf16)


def fp8_tracking(results: DemoResults) -> dict:
  """--fp8: how closely the FP8 model's loss curve tracks the bf16 pallas_norm model's.

  Returns max_abs_diff (max over steps of |loss_fp8 - loss_bf16|), final_bf16 /
  final_fp8 (the mean train loss of the last ``_FP8_TAIL`` steps, or all if fewer),
  final_diff (their difference, fp8 - bf16), heldout_diff (the held-out losses'),
  bf16_noise (max |Δ| between the two bf16 models, pallas_norm's and flax's) and
  within_tolerance (every |diff| within ``FP8_TOLERANCE``).
  """
  a, b = results.pallas.losses, results.fp8.losses
  tail = slice(-min(_FP8_TAIL, len(a)), None)
  t = dict(max_abs_diff=float(np.max(np.abs(b - a))), final_bf16=float(a[tail].mean()),
           final_fp8=float(b[tail].mean()),
           final_diff=float(b[tail].mean() - a[tail].mean()),
           heldout_diff=results.fp8.heldout_loss - results.pallas.heldout_loss,
           bf16_noise=float(np.max(np.abs(results.flax.losses - a))))
  t["within_tolerance"] = all(abs(t[k]) <= v for k, v in FP8_TOLERANCE.items())
  return t


# --------------------------------------------------------------------------- data


def load_text(path: str | None) -> str:
  """The training text: ``path`` (UTF-8) or, for None, CPython's pydoc topics.

  Raises:
    OSError: ``path`` cannot be read.
    ValueError: the text is empty.
  """
  if path is None:
    import pydoc_data.topics
    text = "\n".join(pydoc_data.topics.topics.values())
    where = "pydoc_data.topics"
  else:
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read()
    where = path
  if not text.strip():
    raise ValueError(f"the text in {where} is empty")
  return text


def check_config(cfg: DemoConfig, text_chars: int, *, local_devices: int | None = None,
                 processes: int | None = None) -> None:
  """Raises ValueError, with the flag's name, for a config the demo cannot run.

  ``local_devices`` / ``processes``: the devices each process will have and the process
  count (default: this process's, ``jax.local_device_count()`` and
  ``jax.process_count()``; the launcher passes its children's without starting jax).
  """
  processes = jax.process_count() if processes is None else processes
  for flag, v in (("steps", cfg.steps), ("batch", cfg.batch), ("seq", cfg.seq),
                  ("d-model", cfg.d_model), ("layers", cfg.layers), ("heads", cfg.heads),
                  ("eval-batches", cfg.eval_batches)):
    if v < 1:
      raise ValueError(f"--{flag}={v} must be a positive integer")
  if cfg.d_model % (2 * cfg.heads):
    raise ValueError(f"--d-model={cfg.d_model} must be a multiple of 2 * --heads "
                     f"({2 * cfg.heads}): RoPE rotates pairs of each head's features")
  if cfg.mode is not None and cfg.mode not in _config.MODES:
    raise ValueError(f"--mode={cfg.mode!r} is not one of {_config.MODES}")
  if cfg.backend not in BACKENDS:
    raise ValueError(f"--backend={cfg.backend!r} is not one of {BACKENDS}")
  if cfg.fp8 and cfg.backend not in _fp8_layers.FP8_BACKENDS:
    raise ValueError(f"--fp8 needs --backend in {_fp8_layers.FP8_BACKENDS} (the quantising "
                     f"norm's backends), not {cfg.backend!r}")
  if cfg.fp8_scaling not in _fp8_layers.SCALINGS:
    raise ValueError(f"--fp8-scaling={cfg.fp8_scaling!r} is not one of "
                     f"{_fp8_layers.SCALINGS}")
  if not cfg.learning_rate > 0:
    raise ValueError(f"--lr={cfg.learning_rate} must be positive")
  if cfg.devices is not None:
    if cfg.devices < 1:
      raise ValueError(f"--devices={cfg.devices} must be a positive integer")
    local = jax.local_device_count() if local_devices is None else local_devices
    if cfg.devices > local:
      raise ValueError(f"--devices={cfg.devices}, but this process has {local} local "
                       f"device(s)")
    total = cfg.devices * processes
    if cfg.batch % total:
      across = f" x {processes} processes" if processes > 1 else ""
      raise ValueError(f"--batch={cfg.batch} must be a multiple of --devices="
                       f"{cfg.devices}{across}: data parallel gives every device "
                       f"batch/{total} sequences")
  elif cfg.batch % processes:
    raise ValueError(f"--batch={cfg.batch} must be a multiple of the {processes} "
                     f"processes: each feeds batch/{processes} sequences")
  need = int(np.ceil((cfg.seq + 2) / _HELDOUT_FRACTION))
  if text_chars < need:
    raise ValueError(f"the text has {text_chars} characters; --seq={cfg.seq} needs at "
                     f"least {need} (a {_HELDOUT_FRACTION:.0%} held-out split of seq+2)")
  if cfg.backend == "mosaic" and local_devices is None:  # (the launcher: its children do)
    _check_mosaic(cfg)


def _check_mosaic(cfg: DemoConfig) -> None:
  """ValueError where backend='mosaic' cannot serve the model's norms.

  The Mosaic GPU kernels serve fewer shapes than the others (N a multiple of 128, among
  others: docs/mosaic.md); their own checks run when the op is traced, so this traces the
  norm's forward and backward at the model's shape (``jax.eval_shape``: no kernel runs)
  and turns their NotImplementedError into the flag error.
  """
  ndev, _ = data_parallel_devices(cfg)
  rows = cfg.batch // (ndev * jax.process_count()) * cfg.seq
  x = jax.ShapeDtypeStruct((rows, cfg.d_model), jnp.float32)
  scale = jax.ShapeDtypeStruct((cfg.d_model,), jnp.float32)
  loss = lambda x, scale: pallas_norm.rms_norm(x, scale, backend="mosaic").sum()
  try:
    jax.eval_shape(jax.grad(loss, argnums=(0, 1)), x, scale)
  except NotImplementedError as e:
    raise ValueError(f"--backend mosaic cannot serve this model's norms ([{rows}, "
                     f"{cfg.d_model}] rows per device): {e}") from None


def data_parallel_devices(cfg: DemoConfig) -> tuple[int, str | None]:
  """(how many local devices the run uses in each process, why it uses one device where
  it could use more).

  ``cfg.devices`` (checked by ``check_config``) is used as given. None means all local
  devices, unless ``cfg.batch`` does not divide by their number (times the process
  count): then each process uses one device and the second item says so (None
  otherwise).
  """
  if cfg.devices is not None:
    return cfg.devices, None
  local, processes = jax.local_device_count(), jax.process_count()
  if local > 1 and cfg.batch % (local * processes):
    return 1, (f"data parallel off: --batch={cfg.batch} is not a multiple of the "
               f"{local * processes} devices, so the run uses one device per process "
               f"(pass --devices N with N dividing the batch to split it)")
  return local, None


def data_mesh(n: int) -> jax.sharding.Mesh:
  """The 1-D ``("data",)`` mesh, Auto axis type, over the first ``n`` local devices of
  every process (process 0's first): [n * jax.process_count()] devices."""
  devices = [d for p in range(jax.process_count())
             for d in [d for d in jax.devices() if d.process_index == p][:n]]
  return jax.make_mesh((len(devices),), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,), devices=devices)


def _feed(sharding: NamedSharding, a: np.ndarray, axis: int) -> jax.Array:
  """The global array of ``a`` (the same host array in every process), sharded along
  ``axis``: each process hands over only the rows its own devices hold."""
  rows = [i[axis] for i in sharding.addressable_devices_indices_map(a.shape).values()]
  lo, hi = min(r.start or 0 for r in rows), max(r.stop or a.shape[axis] for r in rows)
  local = a[(slice(None),) * axis + (slice(lo, hi),)]
  return jax.make_array_from_process_local_data(sharding, local, a.shape)


def _windows(data: np.ndarray, starts: np.ndarray, seq: int):
  """data [L] int32, starts [...] -> (x, y), each [..., seq] int32 (y is x shifted)."""
  w = data[starts[..., None] + np.arange(seq + 1)]  # [..., seq + 1]
  return w[..., :-1], w[..., 1:]


# --------------------------------------------------------------------------- model


def _rope(x, sin, cos):
  """Rotary embedding of x: [B, T, H, Dh] with sin/cos: [T, Dh/2] (rotate-half)."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  sin, cos = sin[:, None, :], cos[:, None, :]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _linear(fp8, dtype):
  """The projection a norm feeds: nnx.Linear, or with ``fp8`` (a RMSNormDenseFP8
  factory) the fused norm -> FP8 dense layer; ``linear(d_in, d_out, rngs=)``."""
  if fp8 is not None:
    return functools.partial(fp8, use_bias=False, dtype=dtype)
  return functools.partial(nnx.Linear, use_bias=False, dtype=dtype)


class _Attention(nnx.Module):
  """Causal multi-head self-attention with RoPE (``fp8``: qkv is the fused layer)."""

  def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs, dtype=None, fp8=None):
    self.heads = heads
    self.qkv = _linear(fp8, dtype)(d_model, 3 * d_model, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, h, sin, cos):
    b, t, d = h.shape
    qkv = self.qkv(h).reshape(b, t, 3, self.heads, d // self.heads)  # [B, T, 3, H, Dh]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q, k = _rope(q, sin, cos), _rope(k, sin, cos)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, T, H, Dh]
    return self.out(o.reshape(b, t, d))


class _SwiGLU(nnx.Module):
  """w_down(silu(w_gate(h)) * w_up(h)), hidden = 8/3 d rounded up to 8, as in Llama
  (``fp8``: gate_up is the fused layer)."""

  def __init__(self, d_model: int, *, rngs: nnx.Rngs, dtype=None, fp8=None):
    hidden = -(-8 * d_model // 3 // 8) * 8
    self.gate_up = _linear(fp8, dtype)(d_model, 2 * hidden, rngs=rngs)
    self.down = nnx.Linear(hidden, d_model, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, h):
    gate, up = jnp.split(self.gate_up(h), 2, axis=-1)
    return self.down(jax.nn.silu(gate) * up)


class _Block(nnx.Module):
  """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h)). With ``fp8`` the norms
  live in the fused layers (qkv, gate_up) and attn_norm / mlp_norm are None; the params
  are drawn in the same order (norm scale, then its projection's kernel)."""

  def __init__(self, d_model: int, heads: int, norm, *, rngs: nnx.Rngs, dtype=None,
               fp8=None):
    self.attn_norm = None if fp8 else norm(d_model, rngs=rngs)
    self.attn = _Attention(d_model, heads, rngs=rngs, dtype=dtype, fp8=fp8)
    self.mlp_norm = None if fp8 else norm(d_model, rngs=rngs)
    self.mlp = _SwiGLU(d_model, rngs=rngs, dtype=dtype, fp8=fp8)

  def __call__(self, h, sin, cos):
    unless = lambda norm, h: h if norm is None else norm(h)
    h = h + self.attn(unless(self.attn_norm, h), sin, cos)
    return h + self.mlp(unless(self.mlp_norm, h))


class CharTransformer(nnx.Module):
  """A Llama-style decoder over characters.

  Args:
    vocab_size: number of distinct characters.
    d_model: width of the residual stream.
    layers: number of blocks.
    heads: attention heads (d_model must be a multiple of 2 * heads).
    norm: the RMSNorm class (or a partial of one) called as ``norm(d_model, rngs=rngs)``,
      e.g. ``pallas_norm.RMSNorm`` or ``flax.nnx.RMSNorm``.
    rngs: rng streams for the parameters.
    dtype: the compute dtype of the embedding and the dense layers (default None: float32;
      pass the norms a ``dtype`` through ``norm`` too).
    fp8: None, or a ``flax_layers.RMSNormDenseFP8`` factory (``fp8(d_in, d_out, rngs=,
      use_bias=, dtype=)``) that replaces each block's norm -> qkv and norm -> gate_up
      pairs (not the final norm -> lm_head: the vocabulary stays in float GEMMs). The
      params are drawn in the same order as without it: the same init.
  """

  def __init__(self, vocab_size: int, d_model: int, layers: int, heads: int, norm, *,
               rngs: nnx.Rngs, dtype=None, fp8=None):
    self.heads = heads
    self.embed = nnx.Embed(vocab_size, d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([_Block(d_model, heads, norm, rngs=rngs, dtype=dtype, fp8=fp8)
                            for _ in range(layers)])
    self.final_norm = norm(d_model, rngs=rngs)
    self.lm_head = nnx.Linear(d_model, vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, tokens):
    """tokens: [B, T] int32 -> logits [B, T, vocab_size] f32."""
    t = tokens.shape[1]
    dh = self.embed.features // self.heads
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq  # [T, Dh/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    h = self.embed(tokens)  # [B, T, D]
    for block in self.blocks:
      h = block(h, sin, cos)
    return self.lm_head(self.final_norm(h))


def _loss(model, x, y):
  logits = model(x).astype(jnp.float32)  # [B, T, V]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# --------------------------------------------------------------------------- training


def _make_steps(graphdef, mesh=None):
  """jit-compiled (train_step, eval_losses) over the flat (model, optimizer) state.

  With a ``mesh`` both return their results (state, losses) replicated over it.
  """
  jit_kw = {} if mesh is None else {"out_shardings": NamedSharding(mesh, P())}

  # The FP8 layers' Fp8Meta state (delayed scaling) is differentiated too: its
  # "gradients" are the new amax histories, written back (update_fp8_meta); a model
  # without any differentiates its params only, as nnx.value_and_grad's default.
  diff = nnx.DiffState(0, (nnx.Param, _fp8_layers.Fp8Meta))

  @functools.partial(jax.jit, donate_argnums=0, **jit_kw)
  def train_step(state, x, y):
    model, opt = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(_loss, argnums=diff)(model, x, y)
    opt.update(model, _fp8_layers.update_fp8_meta(model, grads))
    return nnx.state((model, opt)), loss

  @functools.partial(jax.jit, **jit_kw)
  def eval_losses(state, xs, ys):  # xs, ys: [S, K, B, T] -> [S] mean loss of each set
    model, _ = nnx.merge(graphdef, state)
    losses = jax.lax.map(lambda xy: _loss(model, *xy), (xs.reshape(-1, *xs.shape[2:]),
                                                        ys.reshape(-1, *ys.shape[2:])))
    return losses.reshape(xs.shape[:2]).mean(axis=1)

  return train_step, eval_losses


def _run(name: str, model, cfg: DemoConfig, batches, evals, mesh=None):
  """Trains ``model`` on ``batches`` (steps x (x, y), each [B, T]).

  ``evals`` is (xs, ys), each [2, K, B, T]: K fixed train batches, then K held-out ones.
  With a ``mesh`` (data parallel) the state is replicated over it and every batch is
  split over its ``"data"`` axis along B, the evaluation batches too; the state returned
  (for sampling) stays replicated over the mesh. Returns
  (RunResult, (graphdef, state)).
  """
  opt = nnx.Optimizer(model, optax.adamw(cfg.learning_rate, weight_decay=0.01),
                      wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))
  train_step, eval_losses = _make_steps(graphdef, mesh)
  batch_sharding = None
  if mesh is not None:
    state = jax.device_put(state, NamedSharding(mesh, P()))
    batch_sharding = NamedSharding(mesh, P("data"))  # [B, T]: rows over "data"
    batches = (tuple(_feed(batch_sharding, a, 0) for a in xy) for xy in batches)
  losses = []
  bar = tqdm(total=cfg.steps, desc=f"{name:>20}", disable=not cfg.progress,
             dynamic_ncols=True, file=sys.stderr)
  t0 = time.perf_counter()
  t_first = None
  for i, (x, y) in enumerate(batches):
    if batch_sharding is not None:
      assert x.sharding == batch_sharding and y.sharding == batch_sharding, x.sharding
    state, loss = train_step(state, x, y)
    losses.append(loss)
    if i == 0:
      loss.block_until_ready()
      t_first = time.perf_counter()
    if i % 10 == 0 or i == cfg.steps - 1:
      bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
    bar.update(1)
  losses[-1].block_until_ready()  # the steps run in order: the last one's loss is the end
  t_end = time.perf_counter()
  # Gathered after the clock stops, one by one: a jnp.stack of the 1000 losses compiles a
  # 1000-operand concatenate (0.5 s on CPU, more on a GPU) in whichever run comes first,
  # which the steps/s of the pallas_norm model paid until 2026-11-27.
  losses = np.asarray(jax.device_get(losses), np.float32)
  bar.close()
  rest = cfg.steps - 1
  steps_per_s = rest / (t_end - t_first) if rest else float("nan")
  if mesh is not None:  # the evaluation batches [2, K, B, T] are split along B too
    evals = tuple(_feed(NamedSharding(mesh, P(None, None, "data")), a, 2) for a in evals)
  train_loss, heldout_loss = (float(v) for v in eval_losses(state, *evals))
  return RunResult(name, losses, train_loss, heldout_loss, steps_per_s, t_first - t0,
                   batch_sharding), (graphdef, state)


def _sample(graphdef, state, prompts, n_chars: int, seed: int):
  """Generates n_chars after each prompt ([P, T] int32) -> [P, n_chars] int32."""

  @jax.jit
  def generate(state, prompts, key):
    model, _ = nnx.merge(graphdef, state)

    def one(window, key):  # window: [P, T]
      logits = model(window)[:, -1]  # [P, V]
      nxt = jax.random.categorical(key, logits / 0.8).astype(window.dtype)  # temperature 0.8
      return jnp.concatenate([window[:, 1:], nxt[:, None]], axis=1), nxt

    _, out = jax.lax.scan(one, prompts, jax.random.split(key, n_chars))  # [n, P]
    return out.T

  return np.asarray(generate(state, prompts, jax.random.key(seed)))


def train(cfg: DemoConfig, text: str | None = None) -> DemoResults:
  """Trains the pallas_norm model and the flax.nnx.RMSNorm twin; returns both runs.

  Args:
    cfg: the run's config (``check_config`` must accept it).
    text: the training text; None loads ``cfg.text`` with ``load_text``.

  Both models train on the devices ``data_parallel_devices(cfg)`` picks in each process:
  data parallel over ``data_mesh(n)`` when there are several in all (n per process),
  as before on the default device when there is one.

  Returns:
    DemoResults with both RunResults (same init, same batches), generated samples, and
    the device count and mesh the steps ran on.

  Raises:
    ValueError, OSError: from ``load_text`` / ``check_config``.
  """
  if text is None:
    text = load_text(cfg.text)
  check_config(cfg, len(text))
  chars = sorted(set(text))
  lut = {c: i for i, c in enumerate(chars)}
  data = np.fromiter((lut[c] for c in text), np.int32, len(text))  # [L]
  split = int(len(data) * (1 - _HELDOUT_FRACTION))
  train_data, heldout_data = data[:split], data[split:]

  rng = np.random.default_rng(cfg.seed)
  starts = rng.integers(0, len(train_data) - cfg.seq - 1, size=(cfg.steps, cfg.batch))
  batches = [_windows(train_data, s, cfg.seq) for s in starts]
  eval_shape = (cfg.eval_batches, cfg.batch)
  eval_sets = [_windows(d, rng.integers(0, len(d) - cfg.seq - 1, size=eval_shape), cfg.seq)
               for d in (train_data, heldout_data)]
  evals = tuple(np.stack(a) for a in zip(*eval_sets))  # (xs, ys), each [2, K, B, T]

  # --fp8: every model computes in bfloat16 (float32 params), the FP8 one's baseline.
  dtype = jnp.bfloat16 if cfg.fp8 else None

  def build(norm, fp8=None):
    return CharTransformer(len(chars), cfg.d_model, cfg.layers, cfg.heads,
                           functools.partial(norm, dtype=dtype), rngs=nnx.Rngs(cfg.seed),
                           dtype=dtype, fp8=fp8)

  ours_norm = functools.partial(pallas_norm.RMSNorm, mode=cfg.mode,
                                backend=None if cfg.backend == "auto" else cfg.backend)
  ours = build(ours_norm)
  # The flax.nnx.RMSNorm twin gets a copy of the same initial state: the param trees
  # are identical, so one model's state loads into the other's graph.
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: build(nnx.RMSNorm)))
  theirs = nnx.merge(graphdef, jax.tree.map(jnp.copy, nnx.state(ours)))
  num_params = sum(p.size for p in jax.tree.leaves(nnx.state(ours, nnx.Param)))
  # The FP8 model draws its params in the same order from the same seed: the same init.
  fp8_model = build(ours_norm, functools.partial(
      _fp8_layers.RMSNormDenseFP8, scaling=cfg.fp8_scaling,
      backend=cfg.backend)) if cfg.fp8 else None

  local_devices, _ = data_parallel_devices(cfg)
  num_devices = local_devices * jax.process_count()
  mesh = data_mesh(local_devices) if num_devices > 1 else None
  pallas_run, (graphdef, state) = _run("pallas_norm.RMSNorm", ours, cfg, batches, evals,
                                       mesh)
  flax_run, _ = _run("flax.nnx.RMSNorm", theirs, cfg, batches, evals, mesh)
  fp8_run = None
  if fp8_model is not None:
    fp8_run, _ = _run(f"RMSNormDenseFP8 ({cfg.fp8_scaling})", fp8_model, cfg, batches,
                      evals, mesh)

  # Prompts end at held-out line breaks, so each sample starts a fresh line.
  ends = np.flatnonzero(heldout_data[cfg.seq:] == lut.get("\n", -1)) + cfg.seq + 1
  if len(ends) < _SAMPLE_PROMPTS:
    ends = np.arange(cfg.seq, len(heldout_data) + 1)
  prompt_ends = rng.choice(ends, size=_SAMPLE_PROMPTS, replace=False)
  prompts = heldout_data[prompt_ends[:, None] - cfg.seq + np.arange(cfg.seq)]  # [P, T]
  if jax.process_count() > 1:  # each process samples on its own device, from host params
    state = jax.device_get(state)
  generated = _sample(graphdef, state, prompts, cfg.sample_chars, cfg.seed)
  samples = ["".join(chars[i] for i in row) for row in generated]
  return DemoResults(pallas_run, flax_run, samples, int(num_params), len(chars), len(text),
                     num_devices, mesh, fp8_run)


# --------------------------------------------------------------------------- CLI


def _plot(results: DemoResults, title: str, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                    gridspec_kw={"height_ratios": [3, 1]})
  runs = ((results.pallas, "-"), (results.flax, "--"))
  if results.fp8 is not None:
    runs += ((results.fp8, ":"),)
  for run, style in runs:
    ax.plot(np.arange(1, len(run.losses) + 1), run.losses, style, lw=1.2,
            label=f"{run.norm} (held-out {run.heldout_loss:.3f})")
  ax.set_ylabel("train loss (nats/char)")
  ax.set_title(title)
  ax.legend()
  ax.grid(alpha=0.3)
  other = results.flax if results.fp8 is None else results.fp8
  diff = np.abs(results.pallas.losses - other.losses)
  ax_diff.plot(np.arange(1, len(diff) + 1), diff, color="k", lw=1)
  ax_diff.set_ylabel("|Δ loss|" if results.fp8 is None else "|Δ loss| FP8 vs bf16")
  ax_diff.set_xlabel("step")
  ax_diff.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _parser() -> argparse.ArgumentParser:
  d = DemoConfig()
  p = argparse.ArgumentParser(
      prog="python -m pallas_norm.demo",
      description="Train a small Llama-style char-level transformer whose RMSNorms are "
                  "pallas_norm.RMSNorm, next to the same model with flax.nnx.RMSNorm.")
  p.add_argument("--steps", type=int, default=d.steps, help="training steps (default %(default)s)")
  p.add_argument("--batch", type=int, default=d.batch, help="sequences per step (default %(default)s)")
  p.add_argument("--seq", type=int, default=d.seq, help="characters per sequence (default %(default)s)")
  p.add_argument("--d-model", type=int, default=d.d_model, help="model width (default %(default)s)")
  p.add_argument("--layers", type=int, default=d.layers, help="transformer blocks (default %(default)s)")
  p.add_argument("--heads", type=int, default=d.heads, help="attention heads (default %(default)s)")
  p.add_argument("--lr", type=float, default=d.learning_rate, help="AdamW learning rate (default %(default)s)")
  p.add_argument("--mode", choices=_config.MODES, default=None,
                 help="kernel mode (default: the heuristic picks)")
  p.add_argument("--backend", choices=BACKENDS, default=d.backend,
                 help="pallas_norm backend (default %(default)s; auto: backend=None, "
                      "the backend measured faster per kernel)")
  p.add_argument("--text", default=None, metavar="FILE",
                 help="a UTF-8 text file to train on (default: CPython's pydoc_data.topics)")
  p.add_argument("--out", default=d.out, help="output folder for the loss-curve PNG (default %(default)s)")
  p.add_argument("--seed", type=int, default=d.seed, help="init and batch seed (default %(default)s)")
  p.add_argument("--devices", type=int, default=None, metavar="N",
                 help="local devices to train on, data parallel over a ('data',) mesh "
                      "(default: all; 1: one device)")
  p.add_argument("--fp8", action="store_true",
                 help="also train the model with its norm -> dense pairs as "
                      "flax_layers.RMSNormDenseFP8 (FP8 GEMMs); all models in bfloat16; "
                      "reports how closely its loss tracks the bf16 model's")
  p.add_argument("--fp8-scaling", choices=_fp8_layers.SCALINGS, default=d.fp8_scaling,
                 help="the FP8 layers' scaling (default %(default)s)")
  p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  _distributed.add_arguments(p)
  return p


def _checked_text(parser, cfg: DemoConfig, **devices) -> str:
  """The training text, once ``check_config(cfg, ..., **devices)`` accepts the config
  and --out can be made; else argparse's exit 2."""
  try:
    text = load_text(cfg.text)
    check_config(cfg, len(text), **devices)
  except OSError as e:
    parser.error(f"--text {cfg.text}: {e.strerror or e}")
  except ValueError as e:
    parser.error(str(e))
  try:
    os.makedirs(cfg.out, exist_ok=True)
  except OSError as e:
    parser.error(f"--out {cfg.out}: {e.strerror or e}")
  return text


def _launch(parser, argv: list[str], cfg: DemoConfig, k: int) -> int:
  """--processes K: K processes of this command on this machine, one jax.distributed job.

  One GPU each where this machine has >= K GPUs (``--devices`` must then be 1 or left
  out), else ``--devices`` (default 1) fake CPU devices each. Process 0's output is this
  one's. Returns 0, or the exit code of the first process that failed (its stderr tail
  printed). The config is checked here first, without starting jax.
  """
  on_gpu = _distributed.local_gpu_count() >= k
  if on_gpu and cfg.devices not in (None, 1):
    parser.error(f"--processes {k} on this machine's GPUs gives each process one GPU: "
                 f"--devices={cfg.devices} must be 1 or left out")
  cpu_devices = None if on_gpu else cfg.devices or 1
  _checked_text(parser, cfg, local_devices=cpu_devices or 1, processes=k)
  rest, skip = [], False
  for a in argv:  # the command line less --processes K
    if skip or a.startswith("--processes="):
      skip = False
    elif a == "--processes":
      skip = True
    else:
      rest.append(a)
  where = "one GPU" if on_gpu else f"{cpu_devices} CPU device(s)"
  print(f"--processes {k}: {k} processes of jax.distributed on this machine, {where} each "
        f"(coordinator on localhost); process 0's output follows", file=sys.stderr)
  try:
    _distributed.launch([sys.executable, "-m", "pallas_norm.demo"] + rest, k,
                        cpu_devices=cpu_devices, timeout=None, passthrough=0)
  except _distributed.LaunchError as e:
    print(f"python -m pallas_norm.demo --processes {k}: {e}", file=sys.stderr)
    return next((r.returncode for r in e.results if r.returncode), 1)
  return 0


def main(argv: list[str] | None = None) -> int:
  """The CLI. Bad input exits with code 2 and a one-line message (argparse's), before
  anything runs. ``--processes K`` returns the first failed process's exit code."""
  parser = _parser()
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser.parse_args(argv)
  if (msg := _distributed.check_arguments(args)) is not None:
    parser.error(msg)
  cfg = DemoConfig(steps=args.steps, batch=args.batch, seq=args.seq, d_model=args.d_model,
                   layers=args.layers, heads=args.heads, learning_rate=args.lr,
                   mode=args.mode, backend=args.backend, text=args.text, out=args.out,
                   seed=args.seed, progress=not args.no_progress, devices=args.devices,
                   fp8=args.fp8, fp8_scaling=args.fp8_scaling)
  if args.processes is not None:
    return _launch(parser, argv, cfg, args.processes)
  if _distributed.is_distributed(args):
    try:
      _distributed.initialize(args)
    except (RuntimeError, ValueError) as e:
      parser.error(f"jax.distributed.initialize: {e}")
  text = _checked_text(parser, cfg)
  platform = _config.device_info().platform
  if cfg.backend == "triton" and platform != "gpu":
    parser.error("--backend triton needs a GPU (jax-triton cannot run on CPU); "
                 "use --backend pallas, which runs in interpret mode here")
  if jax.process_index() == 0:
    return _report(cfg, text, platform)
  # the other processes train their part of each step, silently
  with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
    train(dataclasses.replace(cfg, progress=False), text)
  return 0


def _report(cfg: DemoConfig, text: str, platform: str) -> int:
  """Process 0's part of ``main``: trains, prints the table, writes the PNG and
  losses.json into ``cfg.out``."""
  interpret = cfg.backend != "xla" and platform != "gpu"
  dev = jax.devices()[0]
  procs = jax.process_count()
  print(f"jax {jax.__version__}: backend {jax.default_backend()}, device {dev.device_kind} "
        f"({len(jax.devices())} device(s)" + (f" in {procs} processes)" if procs > 1 else ")"))
  ndev, why = data_parallel_devices(cfg)
  if procs > 1:
    total = ndev * procs
    print(f"data parallel over {total} devices in {procs} processes (jax.distributed), "
          f"{ndev} of each one's {jax.local_device_count()} local devices: "
          f"{data_mesh(ndev)}, batch {cfg.batch} split {cfg.batch // total} per device, "
          f"each process feeding its {cfg.batch // procs} rows; model and optimizer "
          f"state replicated")
    ndev = total
  elif jax.local_device_count() > 1:  # one device: the output is as it always was
    if ndev > 1:
      print(f"data parallel over {ndev} of {jax.local_device_count()} local devices: "
            f"{data_mesh(ndev)}, batch {cfg.batch} split {cfg.batch // ndev} per device, "
            f"model and optimizer state replicated")
    else:
      print(why or f"single device: --devices 1 (of {jax.local_device_count()} local devices)")
  if cfg.backend == "xla":
    how = "the jnp reference, no kernels"
  else:
    m, n = cfg.batch // ndev * cfg.seq, cfg.d_model  # each device's rows
    mode = cfg.mode or _config.choose_mode(m, n, jnp.float32, _config.device_info())
    rows = "rows" if ndev == 1 else "rows per device"
    how = (f"mode={mode} ({'forced' if cfg.mode else 'heuristic'}, for [{m}, {n}] {rows}), "
           f"kernels {'in Pallas INTERPRET mode (no GPU)' if interpret else 'compiled'}")
  print(f"pallas_norm {pallas_norm.__version__}: backend={cfg.backend!r}, {how}")
  print(f"text: {cfg.text or 'pydoc_data.topics'} ({len(text):,} chars); "
        f"model d_model={cfg.d_model} layers={cfg.layers} heads={cfg.heads} seq={cfg.seq} "
        f"batch={cfg.batch} steps={cfg.steps}")
  if cfg.fp8:
    print(f"--fp8: models in bfloat16 (float32 params); the FP8 model's norm -> qkv and "
          f"norm -> gate_up pairs are RMSNormDenseFP8 (e4m3 forward, e5m2 gradients, "
          f"{cfg.fp8_scaling} scaling)")

  t0 = time.perf_counter()
  r = train(cfg, text)
  wall = time.perf_counter() - t0

  png = os.path.join(cfg.out, "loss_curve.png")
  with open(os.path.join(cfg.out, "losses.json"), "w") as f:
    json.dump({"num_devices": r.num_devices, "num_processes": jax.process_count(),
               **{run.norm: {"losses": run.losses.tolist(), "train_loss": run.train_loss,
                             "heldout_loss": run.heldout_loss}
                  for run in (r.pallas, r.flax) + ((r.fp8,) if r.fp8 else ())}}, f)
  _plot(r, f"char-level Llama-style transformer on {os.path.basename(cfg.text or 'pydoc_data.topics')}", png)

  print(f"\nparams: {r.num_params:,}  vocab: {r.vocab_size} chars")
  print(f"{'norm':<22}{'train loss':>11}{'held-out':>10}{'steps/s':>9}{'compile s':>11}")
  for run in (r.pallas, r.flax) + ((r.fp8,) if r.fp8 is not None else ()):
    print(f"{run.norm:<22}{run.train_loss:>11.4f}{run.heldout_loss:>10.4f}"
          f"{run.steps_per_s:>9.2f}{run.compile_s:>11.1f}")
  if platform == "gpu":  # what the steps/s column can and cannot tell there
    print(f"steps/s: the whole train step's wall clock (the host's dispatch included); at "
          f"d_model={cfg.d_model} that says little about the norm kernels "
          f"(docs/demo.md); a train step at real widths: python -m pallas_norm.bench --e2e")
  diff = np.abs(r.pallas.losses - r.flax.losses)
  print(f"loss curves: max |Δ| = {diff.max():.2e} over {len(diff)} steps "
        f"(first loss {r.pallas.losses[0]:.4f}, last {r.pallas.losses[-1]:.4f})")
  if r.fp8 is not None:
    t = fp8_tracking(r)
    print(f"FP8 vs bf16 (pallas_norm.RMSNorm): max |Δloss| = {t['max_abs_diff']:.4f} over "
          f"{len(r.fp8.losses)} steps; final loss (mean of the last "
          f"{min(_FP8_TAIL, len(r.fp8.losses))} steps) bf16 {t['final_bf16']:.4f}, FP8 "
          f"{t['final_fp8']:.4f} (Δ {t['final_diff']:+.4f}); held-out Δ "
          f"{t['heldout_diff']:+.4f}; bf16 noise floor (pallas_norm vs flax) max |Δ| "
          f"{t['bf16_noise']:.4f}")
    bounds = ", ".join(f"|{k}| <= {v}" for k, v in FP8_TOLERANCE.items())
    print(f"FP8 tracks bf16 ({bounds}): {'yes' if t['within_tolerance'] else 'NO'}")
  print("\nsamples from the pallas_norm model (temperature 0.8, after held-out prompts):")
  for s in r.samples:
    lines = [ln.rstrip() for ln in s.splitlines() if ln.strip()][:2]
    print("\n".join(f"  | {ln}" for ln in lines))
  print(f"\nloss curve: {png} (the losses: losses.json)   total wall time: {wall:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
