"""GPT-2, BERT (base and large) and ViT from ``transformers``, built from configs with random
weights: nothing is downloaded.

The full configs are the published ones (GPT-2 small, BERT-Base, BERT-Large, ViT-Base/16); the tiny
ones keep the architecture with 2 layers of width 32. Losses are computed here from the logits
(next-token for GPT-2, every token for BERT's masked-LM head, classes for ViT) so that every zoo
workload is ``loss_fn(model(*inputs))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.zoo.registry import Workload, ZooModel, register

_TINY_VOCAB = 128
_TINY: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
_LARGE: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
}


def _construct(cls: Any, config: Any) -> nn.Module:
    # On fake tensors the values are never seen, and some initializers (trunc_normal_) branch on
    # data, which fake tensors cannot do: skip transformers' weight init there.
    from torch._guards import detect_fake_mode
    from transformers.initialization import no_init_weights

    if detect_fake_mode() is None:
        return cls(config)  # type: ignore[no-any-return]
    with no_init_weights():
        model = cls(config)
    model.tie_weights()  # skipped with the init, and tied embeddings change the graph
    return model  # type: ignore[no-any-return]


def _token_loss(labels: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    return lambda out: nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def _gpt2(batch: int, seq: int, tiny: bool) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = _TINY_VOCAB if tiny else 50257
    size: dict[str, Any] = {"n_embd": 32, "n_layer": 2, "n_head": 2} if tiny else {}
    config = GPT2Config(vocab_size=vocab, bos_token_id=vocab - 1, eos_token_id=vocab - 1, **size)
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    return Workload(_construct(GPT2LMHeadModel, config), (tokens[:, :-1],), _token_loss(tokens[:, 1:]))


def _bert(large: bool) -> Callable[[int, int, bool], Workload]:
    def make(batch: int, seq: int, tiny: bool) -> Workload:
        from transformers import BertConfig, BertForMaskedLM

        size = {**_TINY, "vocab_size": _TINY_VOCAB} if tiny else _LARGE if large else {}
        config = BertConfig(**size)
        tokens = torch.randint(0, config.vocab_size, (batch, seq))
        labels = torch.randint(0, config.vocab_size, (batch, seq))
        return Workload(_construct(BertForMaskedLM, config), (tokens,), _token_loss(labels))

    return make


def _vit(batch: int, image: int, tiny: bool) -> Workload:
    from transformers import ViTConfig, ViTForImageClassification

    classes = 10 if tiny else 1000
    size: dict[str, Any] = {**_TINY, "patch_size": 8} if tiny else {"patch_size": 16}
    config = ViTConfig(image_size=image, **size)
    config.num_labels = classes
    pixels = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, classes, (batch,))
    model = _construct(ViTForImageClassification, config)
    return Workload(model, (pixels,), lambda out: nn.functional.cross_entropy(out.logits, labels))


register(ZooModel("gpt2", "GPT-2 small (124M), causal LM", "seq", 8, 512, _gpt2, max_size=1024))
register(
    ZooModel("bert", "BERT-Base (110M), masked LM on every token", "seq", 32, 512, _bert(False), max_size=512)
)
register(
    ZooModel(
        "bert-large", "BERT-Large (335M), masked LM on every token", "seq", 16, 512, _bert(True), max_size=512
    )
)
register(
    ZooModel(
        "vit", "ViT-Base/16 (86M), ImageNet classifier", "image", 64, 224, _vit, multiple=16, tiny_size=32
    )
)
