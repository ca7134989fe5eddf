"""A policy is told which module issued each op (``OpContext.module``), and ``remat.ByModule`` decides by
it: the same paths in every form, exact gradients, and less memory than saving everything."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from models import assert_same, build, train, twin
from torch import nn

import remat
from remat import ByModule, Decision, OpContext

R, S, OFF = Decision.RECOMPUTE, Decision.SAVE, Decision.OFFLOAD


class Seen:
    """Recomputes everything; notes each op's packet and module path."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def decide(self, ctx: OpContext) -> Decision:
        self.seen.add((ctx.packet, ctx.module))
        return R


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.mlp = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x)).sigmoid()


INSIDE = {("aten.addmm", "attn.0"), ("aten.relu", "attn.1"), ("aten.addmm", "mlp"), ("aten.sigmoid", "Block")}


class Model(nn.Module):
    """Opens each form inside its own forward: the model's call is outside the region."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.block, self.form, self.policy = Block(), form, Seen()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.policy
        if self.form == "module":
            return remat.checkpoint(self.block, x, policy=p)
        if self.form == "function":
            return remat.checkpoint(lambda t: self.block(t) * 2, x, policy=p)
        if self.form == "scope":
            with remat.scope(policy=p):
                return self.block(x) * 2
        with remat.offload(policy=p):
            return self.block(x) * 2


@pytest.mark.parametrize("form", ["module", "function", "scope", "offload"])
def test_every_form_names_the_modules_below_the_region(form: str) -> None:
    model = Model(form)
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    # the module the region runs is the root; for a function or a block, the module whose call the
    # region starts in (each root's own ops by its class name)
    if form == "module":
        assert model.policy.seen == INSIDE
    else:
        below = {(op, f"block.{m}" if m != "Block" else "block") for op, m in INSIDE}
        assert model.policy.seen == below | {("aten.mul", "Model")}


def test_a_region_at_the_top_level_names_below_the_outermost_module_it_calls() -> None:
    block, p, x = Block(), Seen(), torch.randn(2, 4, requires_grad=True)
    with remat.scope(policy=p):
        y = block(x) * 2
    y.sum().backward()
    assert p.seen == INSIDE | {("aten.mul", "")}


def test_a_module_made_a_checkpoint_and_a_sequential_name_their_modules() -> None:
    block, p = Block(), Seen()
    remat.checkpoint(block, policy=p)  # the module form: its forward is the region
    block(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert p.seen == INSIDE
    chain = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 4))
    p = Seen()
    remat.checkpoint_sequential(chain, 2, torch.randn(2, 4, requires_grad=True), policy=p).sum().backward()
    assert p.seen == {("aten.addmm", "0"), ("aten.addmm", "1.0"), ("aten.tanh", "1.1")}


def test_a_module_made_in_the_region_is_named_by_its_class_below_its_caller() -> None:
    class Maker(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.Identity()(x.exp())  # ``exp`` in Maker, nothing in the Identity

    class Made(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Maker()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return NewLinear()(self.inner(x))

    class NewLinear(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.tanh()

    p = Seen()
    remat.checkpoint(Made(), torch.randn(3, requires_grad=True), policy=p).sum().backward()
    assert p.seen == {("aten.exp", "inner"), ("aten.tanh", "Made.NewLinear")}


def test_a_region_in_another_thread_names_its_own_modules() -> None:
    found: dict[str, set[tuple[str, str]]] = {}

    def work(name: str) -> None:
        p, block, x = Seen(), Block(), torch.randn(2, 4, requires_grad=True)
        with remat.scope(policy=p):
            y = block(x)
        y.sum().backward()
        found[name] = p.seen

    threads = [threading.Thread(target=work, args=(str(i),)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert found == {"0": INSIDE, "1": INSIDE}


@pytest.mark.parametrize("how", ["checkpoint", "huggingface-checkpoint", "huggingface-scope"])
def test_gpt2_blocks_name_attention_and_mlp(how: str) -> None:
    model, batch, blocks = build("gpt2")
    p = Seen()
    if how == "checkpoint":
        for block in blocks(model):
            remat.checkpoint(block, policy=p)
    else:
        remat.integrations.huggingface.enable(model, form=how.split("-")[1], policy=p)  # type: ignore[arg-type]
    model(**batch(0)).loss.backward()
    modules = {m for _, m in p.seen}
    assert {"ln_1", "attn", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"} <= modules
    assert ("aten.addmm", "attn.c_attn") in p.seen and ("aten.addmm", "mlp.c_fc") in p.seen
    assert all(not m.startswith("transformer") for m in modules)  # paths below each block


MEGATRON = ByModule({"attn": R, "attn.c_attn": S, "attn.c_proj": S}, default=S)


@pytest.mark.parametrize("form", ["checkpoint", "scope"])
def test_by_module_trains_exactly_as_plain_and_keeps_less(form: str) -> None:
    """Megatron's selective recomputation (the attention's core recomputed): exact, and between
    recomputing every op and saving every op in the allocator's count."""
    model, batch, blocks = build("gpt2")

    def peak(policy: remat.Policy | None) -> tuple[int, Any]:
        wrapped = twin(model)
        for block in blocks(wrapped):
            if form == "checkpoint":
                remat.checkpoint(block, policy=policy)
            else:
                forward = block.forward

                def scoped(*args: Any, _f: Any = forward, **kwargs: Any) -> Any:
                    with remat.scope(policy=policy):
                        return _f(*args, **kwargs)

                block.forward = scoped  # type: ignore[method-assign]
        run = train(wrapped, batch, steps=2)
        with remat.memory.track(allocator=True) as m:
            wrapped(**batch(5)).loss.backward()
        return m.peak_bytes, run

    selective, run = peak(MEGATRON)
    assert_same(train(twin(model), batch, steps=2), run)
    # a SAVE keeps an op's output for the recomputation, needed by backward or not (as in torch's
    # selective checkpointing): saving every op keeps more than a plain step on this small model
    assert peak(remat.RecomputeAll())[0] < selective < peak(ByModule(default=S))[0]


def test_by_module_matching() -> None:
    def decide(policy: ByModule, module: str) -> Decision:
        return policy.decide(OpContext(op="aten.mm.default", packet="aten.mm", module=module))

    p = ByModule({"layers.*.mlp": OFF, "layers.1": S, "attn": S, "attn.core": R})
    assert decide(p, "layers.0.mlp") is OFF and decide(p, "layers.0.mlp.fc") is OFF  # below a path
    assert decide(p, "layers.1.mlp") is OFF  # three parts over two
    assert decide(p, "layers.1.attn") is S and decide(p, "layers.10") is R  # "layers.1" is no prefix of it
    assert decide(p, "attn.core.softmax") is R and decide(p, "attn") is S and decide(p, "") is R
    tie = ByModule({"a.*": S, "*.b": OFF})  # as many parts: the first given
    assert decide(tie, "a.b") is S
    assert ByModule({"a": S}) == ByModule((("a", S),)) and hash(ByModule({"a": S})) == hash(
        ByModule({"a": S})
    )
    assert decide(ByModule(default=S), "x") is S


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decisions": {"attn": "save"}}, r"remat\.ByModule: decisions must map module paths .*'save'"),
        ({"decisions": {"": S}}, r"remat\.ByModule: decisions must map .*non-empty"),
        ({"decisions": ["attn"]}, r"remat\.ByModule: decisions must map .*\['attn'\]"),
        ({"decisions": {"a": S}, "default": "save"}, r"remat\.ByModule: default must be a remat\.Decision"),
    ],
)
def test_by_module_bad_input(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(remat.RematTypeError, match=match):
        ByModule(**kwargs)
