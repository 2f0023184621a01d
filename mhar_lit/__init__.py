"""mhar_lit: Multi-Head Attention Residuals (MHAR) and its baselines, trained with PyTorch Lightning.

`import mhar_lit` only needs torch; Lightning, litdata, MLflow and Triton are imported where used.
"""

from mhar_lit.config import NAMED_SIZES, ModelConfig
from mhar_lit.models.decoder import DecoderLM
from mhar_lit.residual import (
    BlockAttnRes,
    DeltaAttnRes,
    FullAttnRes,
    HyperConnections,
    ResidualStrategy,
    StandardResidual,
)
from mhar_lit.routing import route

__version__ = "0.1.0"

__all__ = [
    "ModelConfig",
    "NAMED_SIZES",
    "DecoderLM",
    "ResidualStrategy",
    "StandardResidual",
    "HyperConnections",
    "FullAttnRes",
    "BlockAttnRes",
    "DeltaAttnRes",
    "route",
]
