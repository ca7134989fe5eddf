"""Integrations of remat with other libraries; each imports its library only when used.

``huggingface``: a ``transformers`` model's own gradient-checkpointing switch, executed by remat.
"""

from remat.integrations import huggingface

__all__ = ["huggingface"]
