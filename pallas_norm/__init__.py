"""pallas_norm: fused RMSNorm and LayerNorm for JAX (Pallas GPU kernels, Triton lowering).

Public API: ``rms_norm``, ``layer_norm`` (functional), ``rms_norm_fp8``,
``layer_norm_fp8`` and their ``Fp8Norm`` result (the FP8-output norms, pallas_norm.fp8),
and ``RMSNorm``, ``LayerNorm`` (Flax NNX layers, loaded lazily so that
``import pallas_norm`` does not import flax).
"""

from pallas_norm.fp8 import Fp8Norm, layer_norm_fp8, rms_norm_fp8
from pallas_norm.ops import layer_norm, rms_norm

__version__ = "0.1.0"

__all__ = ["rms_norm", "layer_norm", "rms_norm_fp8", "layer_norm_fp8", "Fp8Norm", "RMSNorm",
           "LayerNorm", "__version__"]


def __getattr__(name):
  if name in ("RMSNorm", "LayerNorm"):
    import flax_layers
    return getattr(flax_layers, name)
  raise AttributeError(f"module 'pallas_norm' has no attribute {name!r}")
