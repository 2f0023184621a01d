"""Export a trained checkpoint of any residual strategy as a standalone model directory.

    export_checkpoint(CKPT, OUT_DIR)   -> safetensors + mhar_config.json (mhar_lit.load_pretrained, lm-eval),
                                          config.json + trust_remote_code modules (transformers without
                                          mhar_lit), tokenizer.json
    export_main(argv)                  `python -m mhar_lit.export ...` (see export/cli.py)
"""

from mhar_lit.export.cli import export_main
from mhar_lit.export.core import export_checkpoint

__all__ = ["export_checkpoint", "export_main"]
