"""Integrations of remat with other libraries; each imports its library only when used.

``huggingface``: a ``transformers`` model's own gradient-checkpointing switch, executed by remat.
``distributed``: FSDP2's forward hooks kept out of remat's view, one plan for every rank (DDP and
FSDP2).
"""

from remat.integrations import distributed, huggingface

__all__ = ["distributed", "huggingface"]
