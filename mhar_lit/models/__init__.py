"""Pure-PyTorch models (no Lightning import here)."""

from mhar_lit.models.decoder import DecoderLM, RMSNorm

__all__ = ["DecoderLM", "RMSNorm"]
