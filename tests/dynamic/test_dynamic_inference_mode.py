"""``remat.dynamic`` under ``torch.inference_mode`` (composite ops arrive whole: NOTE [inference mode]
in ``remat.dynamic.interceptor``), random factories of another device, and a region left unentered."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import remat

_COPIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "reshape of an expanded view": lambda h: h.unsqueeze(1).expand(256, 2, 64).reshape(512, 64),
    "contiguous": lambda h: h.t().contiguous(),
    "to": lambda h: h.to(torch.float64),
    "flatten": lambda h: h.t().flatten(),
}


def _program(
    copy: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, ws: list[torch.Tensor]
) -> torch.Tensor:
    with torch.inference_mode():
        hs = [x]
        for i in range(12):
            hs.append(torch.tanh(hs[-1] @ ws[i % 3]))
        outs = [copy(h) for h in hs[1:4]]  # evicted by now: read through an op that copies
        return torch.stack([o.double().sum() for o in outs])


@pytest.mark.parametrize("copy", sorted(_COPIES))
@pytest.mark.parametrize("policy", ["dtr", "coop"])
def test_composite_ops_under_inference_mode_restore_what_they_read(copy: str, policy: str) -> None:
    """They passed for views and read an evicted input (a crash, or torch's 'data is not allocated
    yet'), and their copies became constants of the region."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    ws = [torch.randn(64, 64, generator=g) / 8 for _ in range(3)]
    plain = _program(_COPIES[copy], x, ws)
    budget = 700_000
    region = remat.dynamic(budget, policy, keep=(x, *ws), cost="model", reserve=0.1)
    with remat.memory.track(allocator=True) as measured, region:
        got = _program(_COPIES[copy], x, ws)
    assert torch.equal(got, plain)
    assert region.stats.evictions > 0 and region.stats.recomputations > 0
    assert measured.peak_bytes + region.stats.outside_bytes <= budget


def test_a_random_factory_of_another_device_passes_through() -> None:
    """``torch.randn(device="meta")`` in a CPU region: no tensor argument, results elsewhere; it went
    on to take the meta device's generator state (torch's error)."""
    with remat.dynamic("1MB"):
        t = torch.randn(8, 64, device="meta")
        u = torch.nn.functional.dropout(torch.empty(8, 64, device="meta"), 0.1)
    assert t.is_meta and u.is_meta


def test_leaving_a_region_never_entered_is_a_clear_error() -> None:
    with pytest.raises(
        remat.RematRuntimeError, match=r"remat\.dynamic: the region was left without being entered"
    ):
        remat.dynamic("1MB").__exit__(None, None, None)


def test_a_llama_generates_under_inference_mode_as_plainly_and_as_under_no_grad() -> None:
    """``generate`` under ``torch.inference_mode`` (as evaluation code runs it): the same tokens within
    a budget that evicts (it crashed in the key-value heads' ``expand(...).reshape(...)``), and the
    same unbudgeted pool peak as under ``no_grad`` (the copies were constants: 3.6 times as much)."""
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=32,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))

    def generate(grad_off: Callable[[], object]) -> torch.Tensor:
        with grad_off():  # type: ignore[attr-defined]
            return model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)

    plain = generate(torch.inference_mode)
    peaks = []
    for grad_off in (torch.inference_mode, torch.no_grad):
        free = remat.dynamic(None, "dtr", keep=model, cost="model")
        with free:
            assert torch.equal(generate(grad_off), plain)
        peaks.append(free.stats.peak_bytes)
    assert peaks[0] == peaks[1]
    region = remat.dynamic(
        int(0.98 * peaks[0]), "dtr", keep=model, cost="model", reserve=0.1, thrash_limit=50.0
    )
    with remat.memory.track(allocator=True) as measured, region:
        assert torch.equal(generate(torch.inference_mode), plain)
    assert region.stats.evictions > 0
    assert measured.peak_bytes + region.stats.outside_bytes <= region.budget
