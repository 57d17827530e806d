"""lit_align: preference and RL alignment of language models (SFT, DPO, GRPO) on PyTorch Lightning."""

from lit_align.errors import LitAlignError

__version__ = "0.1.0"
__all__ = ["LitAlignError", "__version__"]
