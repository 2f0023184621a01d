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


def load_pretrained(path, device="cpu", dtype=None, backend=None):
    """Load a directory written by `python -m mhar_lit convert` as a DecoderLM in eval mode (safetensors only)."""
    import torch

    from mhar_lit.convert import load_pretrained as _load

    return _load(path, device=device, dtype=dtype or torch.float32, backend=backend)


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
    "load_pretrained",
]
