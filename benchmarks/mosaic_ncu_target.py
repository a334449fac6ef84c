"""A target for ncu (issue #29): one norm forward or backward, on the Mosaic GPU or the
Pallas (Triton lowering) backend, called 5 times. bf16 x, float32 scale/bias.

Usage (GPU machine), e.g.:
  ncu --clock-control none -k regex:pallas_norm --launch-skip 2 --launch-count 1 \\
      --metrics sm__warps_active.avg.pct_of_peak_sustained_active,... \\
      python benchmarks/mosaic_ncu_target.py layer 8192 4096 fwd mosaic [BM STAGES G_PER_SM INPLACE]
"""
import sys

import jax
import jax.numpy as jnp

from pallas_norm import config as CF
from pallas_norm.kernels import backward as B
from pallas_norm.kernels import forward as F
from pallas_norm.kernels import mosaic_backward as MB
from pallas_norm.kernels import mosaic_forward as MF

op, m, n, kind, impl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
extra = [int(a) for a in sys.argv[6:]]
layer = op == "layer"
s = 1 + 0.1 * jax.random.normal(jax.random.key(0), (n,))
b = 0.1 * s if layer else None
x = jax.random.normal(jax.random.key(1), (m, n), jnp.bfloat16)
dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=False)
_, mu, r = F.norm_forward(x, s, b, config=CF.forward_config(m, n, x.dtype, subtract_mean=layer),
                          **kw)
if kind == "fwd":
  if impl == "mosaic":
    cfg = MF.forward_config(m, n, x.dtype, layer)
    if extra:
      cfg = MF.MosaicForwardConfig(extra[0], cfg.block_w, extra[1],
                                   extra[2] * CF.device_info().num_sms, bool(extra[3]))
    f = jax.jit(lambda x: MF.norm_forward(x, s, b, config=cfg, **kw))
  else:
    f = jax.jit(lambda x: F.norm_forward(x, s, b, config=CF.forward_config(
        m, n, x.dtype, subtract_mean=layer), **kw))
  args = (x,)
else:
  bkw = dict(has_bias=layer, scale_offset=0.0, subtract_mean=layer, interpret=False,
             scale_dtype=jnp.float32, bias_dtype=jnp.float32 if layer else None)
  mod, cfg = ((MB, MB.backward_config(m, n, x.dtype, layer)) if impl == "mosaic" else
              (B, CF.backward_config(m, n, x.dtype, subtract_mean=layer)))
  f = jax.jit(lambda dy, x: mod.norm_backward(dy, x, s, mu, r, config=cfg, **bkw))
  args = (dy, x)
for _ in range(5):
  jax.block_until_ready(f(*args))
