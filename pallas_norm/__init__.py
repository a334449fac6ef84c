"""pallas_norm: fused RMSNorm and LayerNorm for JAX (Pallas GPU kernels, Triton lowering).

Public API: ``rms_norm``, ``layer_norm`` (functional), ``qk_norm`` (the QK-norm of a
packed q|k|v projection, pallas_norm.qk), ``rms_norm_fp8``,
``layer_norm_fp8`` and their ``Fp8Norm`` result (the FP8-output norms, pallas_norm.fp8),
``RMSNorm``, ``LayerNorm`` and the fused norm -> FP8 dense ``RMSNormDenseFP8``,
``LayerNormDenseFP8`` (Flax NNX layers, loaded lazily so that ``import pallas_norm`` does
not import flax).
"""

from pallas_norm.fp8 import Fp8Norm, layer_norm_fp8, rms_norm_fp8
from pallas_norm.ops import layer_norm, rms_norm
from pallas_norm.qk import qk_norm

__version__ = "0.1.0"

_FLAX_LAYERS = ("RMSNorm", "LayerNorm", "RMSNormDenseFP8", "LayerNormDenseFP8")

__all__ = ["rms_norm", "layer_norm", "qk_norm", "rms_norm_fp8", "layer_norm_fp8", "Fp8Norm",
           *_FLAX_LAYERS, "__version__"]


def __getattr__(name):
  if name in _FLAX_LAYERS:
    import flax_layers
    return getattr(flax_layers, name)
  raise AttributeError(f"module 'pallas_norm' has no attribute {name!r}")
