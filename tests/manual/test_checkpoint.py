"""remat.checkpoint and remat.checkpoint_sequential compute exactly what the plain model computes."""

from __future__ import annotations

import pytest
import torch
from models import assert_same, build, train, twin
from torch import nn

import remat

POLICIES = [None, remat.SaveComputeIntensive(), remat.SaveOps(frozenset({"aten.mm", "aten.addmm"}))]


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "bert"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_checkpoint_per_block_matches_plain(name: str, autocast: torch.dtype | None) -> None:
    model, batch, blocks = build(name)
    wrapped = twin(model)
    for block in blocks(wrapped):
        remat.checkpoint(block)
    assert_same(train(model, batch, autocast=autocast), train(wrapped, batch, autocast=autocast))


@pytest.mark.parametrize("policy", POLICIES[1:], ids=["compute-intensive", "save-mm"])
@pytest.mark.parametrize("name", ["gpt2", "cnn"])
def test_checkpoint_with_policy_matches_plain(name: str, policy: remat.Policy) -> None:
    model, batch, blocks = build(name)
    wrapped = twin(model)
    for block in blocks(wrapped):
        remat.checkpoint(block, policy=policy)
    assert_same(train(model, batch), train(wrapped, batch))


def test_batch_norm_statistics_updated_once() -> None:
    model, batch, blocks = build("cnn")
    wrapped = twin(model)
    for block in blocks(wrapped):
        remat.checkpoint(block)
    train(wrapped, batch, steps=4)
    bn = wrapped.layers[0].bn
    assert bn.num_batches_tracked.item() == 4
    train(model, batch, steps=4)
    assert torch.equal(model.layers[0].bn.running_var, bn.running_var)


def _deep_mlp() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(9)])
    return layers, torch.randn(32, 64, requires_grad=True)


def _peak(fn) -> int:  # type: ignore[no-untyped-def]
    with remat.memory.track(timeline=False) as m:
        fn().sum().backward()
    return m.peak_bytes


def test_checkpoint_lowers_counted_peak() -> None:
    layers, x = _deep_mlp()
    plain = _peak(lambda: layers(x))
    per_layer = _peak(lambda: _chain([lambda h, m=m: remat.checkpoint(m, h) for m in layers], x))
    seq = _peak(lambda: remat.checkpoint_sequential(layers, "sqrt", x))
    assert per_layer < plain
    assert seq < plain


def _chain(fns, x):  # type: ignore[no-untyped-def]
    for f in fns:
        x = f(x)
    return x


@pytest.mark.parametrize("segments", [1, 2, 3, "sqrt", 9])
def test_checkpoint_sequential_matches_plain(segments: int | str) -> None:
    layers, x = _deep_mlp()
    expected = torch.autograd.grad(layers(x).sum(), [x, *layers.parameters()])
    got = torch.autograd.grad(
        remat.checkpoint_sequential(layers, segments, x).sum(), [x, *layers.parameters()]
    )
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


@pytest.mark.parametrize("segments", [2, 4])
def test_checkpoint_sequential_runs_a_module_held_twice_twice(segments: int) -> None:
    """An nn.Sequential holding one module at two places (weights tied) runs it at both, as its
    forward does (``children()`` lists it once: the chain lost a layer)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    layers = nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    expected = torch.autograd.grad(layers(x).sum(), [x, *layers.parameters()])
    out = remat.checkpoint_sequential(layers, segments, x)
    got = torch.autograd.grad(out.sum(), [x, *layers.parameters()])
    assert torch.equal(out, layers(x))
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_segment_bounds() -> None:
    from remat.manual.sequential import segment_bounds

    assert segment_bounds(9, "sqrt") == [(0, 3), (3, 6), (6, 9)]
    assert segment_bounds(5, 2) == [(0, 3), (3, 5)]


def test_kwargs_none_and_non_tensor_values() -> None:
    lin = nn.Linear(4, 4)

    def fn(x: torch.Tensor, scale: float, bias: torch.Tensor | None = None, *, mode: str = "a") -> dict:
        y = lin(x) * scale
        if bias is not None:
            y = y + bias
        return {"y": y.sin(), "mode": mode, "none": None}

    x = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    out = remat.checkpoint(fn, x, 2.0, bias=b, mode="z")
    assert out["mode"] == "z" and out["none"] is None
    grads = torch.autograd.grad(out["y"].sum(), [x, b, lin.weight])
    expected = torch.autograd.grad(fn(x, 2.0, bias=b)["y"].sum(), [x, b, lin.weight])
    for e, g in zip(expected, grads, strict=True):
        assert torch.equal(e, g)


@pytest.mark.parametrize("container", ["list", "tuple", "dict"])
def test_tensors_given_in_containers_are_inputs_like_any_other(container: str) -> None:
    """Tensors inside lists, tuples and dicts get their gradients; one written in place after the
    forward is refused as a top-level input is (its recomputation read the new values: a wrong
    gradient, silently, as ``torch.utils.checkpoint`` gives)."""

    def pack(a: torch.Tensor, b: torch.Tensor) -> object:
        return {"list": [a, b], "tuple": (a, b), "dict": {"a": a, "b": b}}[container]

    def fn(xs: object) -> torch.Tensor:
        a, b = (xs["a"], xs["b"]) if isinstance(xs, dict) else xs  # type: ignore[misc]
        return (a * 2).sin() * b.tanh()

    w = torch.tensor([0.5, 1.0, 1.5], requires_grad=True)
    b = torch.tensor([0.2, -0.4, 0.6], requires_grad=True)
    expected = torch.autograd.grad(fn(pack(w * 1.0, b)).sum(), (w, b))
    got = torch.autograd.grad(remat.checkpoint(fn, pack(w * 1.0, b)).sum(), (w, b))
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    a = w * 1.0
    out = remat.checkpoint(fn, pack(a, b))
    a.add_(1.0)  # after the forward, before backward
    with pytest.raises(RuntimeError, match=r"remat\.checkpoint: a tensor saved for backward \(an input"):
        out.sum().backward()


def test_one_tensor_given_in_several_places_is_one_tensor_again() -> None:
    """Self-attention called as ``attn(h, h, h)`` takes its packed projection where ``query is key
    is value``; the recomputation got three detached copies and took the other path."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(32, 4, batch_first=True)
    h = torch.randn(2, 8, 32, requires_grad=True)
    wrt = (h, *attn.parameters())
    expected = torch.autograd.grad(attn(h, h, h)[0].sum(), wrt)
    got = torch.autograd.grad(remat.checkpoint(lambda q, k, v: attn(q, k, v)[0], h, h, h).sum(), wrt)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_partial_backwards_leave_no_recomputed_tensor_behind() -> None:
    """Each backward that reads only some of a region's saved tensors let the rest stay with the
    region until it died: repeated ``autograd.grad`` for one weight grew the memory per call."""
    torch.manual_seed(0)
    l1, l2 = nn.Linear(64, 64), nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    y = remat.checkpoint(lambda t: l2(l1(t).tanh()).sigmoid(), x)
    held = []
    for calls in (1, 5):
        with remat.memory.track(allocator=True) as m:
            for _ in range(calls):
                torch.autograd.grad(y.sum(), l2.weight, retain_graph=True)
        held.append(m.current_bytes)
    assert held[1] == held[0] <= 0


def test_nested_checkpoints() -> None:
    inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    outer_lin = nn.Linear(8, 8)

    def outer(x: torch.Tensor) -> torch.Tensor:
        h = outer_lin(x).relu()
        return remat.checkpoint(inner, h).exp()

    x = torch.randn(4, 8, requires_grad=True)
    params = [x, *inner.parameters(), *outer_lin.parameters()]
    expected = torch.autograd.grad(outer(x).sum(), params)
    got = torch.autograd.grad(remat.checkpoint(outer, x).sum(), params)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_backward_inputs_and_frozen_inputs() -> None:
    lin = nn.Linear(6, 6)
    x = torch.randn(5, 6)  # frozen input: only the parameters require grad (as with LoRA)
    remat.checkpoint(lin, x).tanh().sum().backward(inputs=[lin.weight])
    assert lin.weight.grad is not None and lin.bias.grad is None
    expected = torch.autograd.grad(lin(x).tanh().sum(), [lin.weight])[0]
    assert torch.equal(expected, lin.weight.grad)


def test_recomputes_once_per_backward_and_stops_early() -> None:
    calls = {"fn": 0, "tail": 0}
    lin = nn.Linear(4, 4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls["fn"] += 1
        y = lin(x).sigmoid().exp()
        calls["tail"] += 1
        return y + 1  # add saves nothing: nothing after exp is needed for backward

    x = torch.randn(3, 4, requires_grad=True)
    y = remat.checkpoint(fn, x)
    assert calls == {"fn": 1, "tail": 1}
    y.sum().backward(retain_graph=True)
    assert calls == {"fn": 2, "tail": 1}, "one recomputation for all saved tensors, stopped after exp"
    first = x.grad.clone()
    y.sum().backward()
    assert calls["fn"] == 3, "a second backward over a retained graph recomputes again"
    assert torch.equal(x.grad, 2 * first)


def test_rng_replayed_and_caller_stream_untouched() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5, training=True) * 3

    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(7)
    expected = torch.autograd.grad(fn(x).pow(2).sum(), x)[0]
    after_plain = torch.rand(3)
    torch.manual_seed(7)
    got = torch.autograd.grad(remat.checkpoint(fn, x).pow(2).sum(), x)[0]
    assert torch.equal(expected, got)
    assert torch.equal(after_plain, torch.rand(3))


def test_no_grad_and_inference_mode_just_run() -> None:
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.autograd.graph.saved_tensors_hooks)
        return x * 2

    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(remat.checkpoint(fn, x), x * 2)
    with torch.inference_mode():
        y = remat.checkpoint(fn, torch.ones(2))
    assert y.is_inference() and len(calls) == 2


def test_decorator_forms() -> None:
    lin = nn.Linear(3, 3)

    @remat.checkpoint
    def f(x: torch.Tensor) -> torch.Tensor:
        return lin(x).exp()

    @remat.checkpoint(policy=remat.SaveComputeIntensive())
    def g(x: torch.Tensor) -> torch.Tensor:
        return lin(x).exp()

    x = torch.randn(2, 3, requires_grad=True)
    expected = torch.autograd.grad(lin(x).exp().sum(), x)[0]
    assert torch.equal(torch.autograd.grad(f(x).sum(), x)[0], expected)
    assert torch.equal(torch.autograd.grad(g(x).sum(), x)[0], expected)
    assert f.__name__ == "f"


def test_shape_divergence_is_reported() -> None:
    state = {"n": 4}

    def fn(x: torch.Tensor) -> torch.Tensor:
        state["n"] -= 1
        return x[: state["n"]].exp()

    y = remat.checkpoint(fn, torch.randn(5, requires_grad=True))
    with pytest.raises(remat.RecomputationError, match=r"remat\.checkpoint: a recomputed tensor differs"):
        y.sum().backward()


def test_value_check_names_the_op_and_module() -> None:
    class Drifting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return (self.lin(x) + self.calls).exp()

    m = Drifting()
    x = torch.randn(2, 4, requires_grad=True)
    y = remat.checkpoint(m, x, check="values")
    # add saves nothing for backward; exp saves its output, the first saved tensor that diverges
    with pytest.raises(
        remat.RecomputationError,
        match=r"remat\.checkpoint: .*other values.*aten\.exp\.default in module Drifting",
    ):
        y.sum().backward()
    # the same check passes on deterministic code
    m2 = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    remat.checkpoint(m2, x, check="values").sum().backward()


def test_value_check_names_module_path() -> None:
    class Stateful(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.count += 1
            return (x * self.count).exp()

    block = nn.Sequential(nn.Linear(4, 4), Stateful())
    y = remat.checkpoint(block, torch.randn(2, 4), check="values")
    with pytest.raises(remat.RecomputationError, match=r"in module 1\b"):
        y.sum().backward()


def test_bad_input_errors() -> None:
    with pytest.raises(remat.RematTypeError, match=r"remat\.checkpoint: fn must be callable \(got int\)"):
        remat.checkpoint(3, torch.ones(1))
    with pytest.raises(remat.RematValueError, match=r"remat\.checkpoint: check must be"):
        remat.checkpoint(torch.sin, torch.ones(1), check="bits")
    with pytest.raises(remat.RematTypeError, match=r"remat\.checkpoint: policy must be an object with"):
        remat.checkpoint(torch.sin, torch.ones(1), policy="save-all")
    with pytest.raises(remat.RematTypeError, match=r"\(the function <lambda>\); put the function in"):
        remat.checkpoint(torch.sin, torch.ones(1), policy=lambda ctx: remat.Decision.SAVE)
    with pytest.raises(remat.RematValueError, match=r"got True\).*check= keyword itself.*functools.partial"):
        remat.checkpoint(lambda x, check: x, torch.ones(1), check=True)
    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(
        remat.RematValueError, match=r"remat\.checkpoint_sequential: segments must lie .*3 for 2"
    ):
        remat.checkpoint_sequential(layers, 3, torch.ones(1, 2))
    with pytest.raises(remat.RematValueError, match=r"got 0 for 2"):
        remat.checkpoint_sequential(layers, 0, torch.ones(1, 2))
    with pytest.raises(remat.RematTypeError, match=r"segments must be a positive int or 'sqrt'"):
        remat.checkpoint_sequential(layers, "half", torch.ones(1, 2))


def test_autocast_replayed_when_backward_runs_outside() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_out = lin(x).relu()
    expected = torch.autograd.grad(expected_out.float().sum(), [x, lin.weight])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = remat.checkpoint(lambda t: lin(t).relu(), x)
    assert out.dtype == torch.bfloat16
    got = torch.autograd.grad(out.float().sum(), [x, lin.weight])
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


@pytest.mark.cuda
def test_cuda_rng_replayed(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("needs CUDA")
    x = torch.randn(256, device=device, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(t, 0.5) * 2

    torch.manual_seed(3)
    expected = torch.autograd.grad(fn(x).sum(), x)[0]
    torch.manual_seed(3)
    got = torch.autograd.grad(remat.checkpoint(fn, x).sum(), x)[0]
    assert torch.equal(expected, got)


def _compose(name: str, model: nn.Module, run_blocks) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The model's loss with its blocks run by ``run_blocks(blocks, h)``."""
    if name == "gpt2":
        ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
        tr = model.transformer
        h = tr.drop(tr.wte(ids) + tr.wpe(torch.arange(16)))
        logits = model.lm_head(tr.ln_f(run_blocks(list(tr.h), h)))
    elif name == "bert":
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
        h = model.bert.embeddings(input_ids=ids)
        logits = model.cls(run_blocks(list(model.bert.encoder.layer), h))
    else:
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(5))
        ids = torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(6))
        h = run_blocks(list(model.layers), model.stem(x))
        logits = model.head(h.mean((2, 3)))
    return nn.functional.cross_entropy(logits.flatten(0, -2), ids.flatten())


@pytest.mark.parametrize("name", ["cnn", "gpt2", "bert"])
def test_checkpoint_sequential_on_real_blocks(name: str) -> None:
    model, _, _ = build(name)
    wrapped = twin(model)

    def train_steps(m: nn.Module, run_blocks) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        torch.manual_seed(11)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = _compose(name, m, run_blocks)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    plain = train_steps(model, lambda blocks, h: _chain(blocks, h))
    ours = train_steps(wrapped, lambda blocks, h: remat.checkpoint_sequential(blocks, 2, h))
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    for (n, a), b in zip(model.state_dict().items(), wrapped.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def test_bad_policies_sequences_and_flags_are_clear_errors() -> None:
    x = torch.ones(2, 2, requires_grad=True)
    with pytest.raises(remat.RematTypeError, match=r"remat\.checkpoint: policy .* not its class \(the class"):
        remat.checkpoint(torch.sin, x, policy=remat.SaveComputeIntensive)  # type: ignore[arg-type]
    refused = pytest.raises(remat.RematTypeError, match=r"remat\.scope: policy .* not its class")
    with refused, remat.scope(policy=remat.RecomputeAll):  # type: ignore[arg-type]
        pass
    with pytest.raises(remat.RematTypeError, match=r"remat\.SaveOps: ops must be a collection of op names"):
        remat.SaveOps("aten.addmm")  # type: ignore[arg-type]
    with pytest.raises(remat.RematTypeError, match=r"remat\.OffloadOps: ops must be a collection"):
        remat.OffloadOps(3)  # type: ignore[arg-type]
    assert remat.SaveOps(["aten.mm"]).ops == frozenset({"aten.mm"})  # type: ignore[arg-type]
    for typo in ("aten.addmmm", "aten.mm.defualt", "atne.mm"):  # matched no op, silently
        with pytest.raises(remat.RematValueError, match=rf"remat\.SaveOps: .* \(no such op: {typo}\)"):
            remat.SaveOps({typo})
    assert remat.OffloadOps({"aten.mm.default", "aten.bmm"}).ops == {"aten.mm.default", "aten.bmm"}

    class Stringly:  # its answers were taken as some decision, silently
        def decide(self, ctx: remat.OpContext) -> remat.Decision:
            return "offload"  # type: ignore[return-value]

    said = r"remat\.policy: decide\(ctx\) must return a remat\.Decision \(Stringly\.decide gave 'offload'"
    with pytest.raises(remat.RematValueError, match=said):
        remat.checkpoint(lambda h: h @ h, x, policy=Stringly()).sum().backward()
    with pytest.raises(remat.RematValueError, match=said), remat.scope(policy=Stringly()):
        x @ x
    with pytest.raises(remat.RematValueError, match=said), remat.offload(policy=Stringly()):
        x @ x
    with pytest.raises(
        remat.RematTypeError, match=r"remat\.checkpoint_sequential: functions .* \(got a Linear\)"
    ):
        remat.checkpoint_sequential(nn.Linear(2, 2), 1, x)  # type: ignore[arg-type]
    refused = pytest.raises(
        remat.RematTypeError, match=r"remat\.memory\.track: allocator must be True or False"
    )
    with refused, remat.memory.track(allocator="yes"):  # type: ignore[arg-type]
        pass
