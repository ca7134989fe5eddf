"""What a checkpointed call reads besides its tensor arguments (``remat.manual.inputs``): tensors an
argument object holds, attributes the call sets itself, attributes of modules it reaches but does
not run; and the manual forms under ``torch.func`` transforms and forward-mode AD."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fw_ad
from torch import nn

import remat


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float = 1.0


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _block(net: nn.Module, batch: Any) -> torch.Tensor:
    return net(batch.x * batch.scale)


@pytest.mark.parametrize("kind", ["dataclass", "namespace", "nested"])
def test_a_tensor_an_argument_object_holds_written_before_backward_is_refused(kind: str) -> None:
    """pytree passes a dataclass or a namespace as it is: the recomputation would read the written
    tensor by reference (torch's checkpoint gives other gradients, silently)."""
    net, x = _net(), torch.randn(4, 8)
    batch: Any = {
        "dataclass": Batch(x),
        "namespace": types.SimpleNamespace(x=x, scale=1.0),
        "nested": types.SimpleNamespace(inner=Batch(x), scale=1.0),
    }[kind]

    def block(net: nn.Module, b: Any) -> torch.Tensor:
        return _block(net, b.inner if kind == "nested" else b)

    y = remat.checkpoint(block, net, batch)
    x.copy_(torch.randn(4, 8))  # the input buffer reused for the next batch before backward
    with pytest.raises(
        remat.RecomputationError,
        match=r"remat\.checkpoint: a parameter or tensor the function read by reference .* an argument "
        r"object such as a dataclass holds\) was modified in place before backward .*float32\[4, 8\]",
    ):
        y.sum().backward()


def test_a_tensor_an_argument_object_holds_unwritten_gives_the_plain_gradients() -> None:
    net, x = _net(), torch.randn(4, 8)
    net(x * 2.0).sum().backward()
    plain = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    remat.checkpoint(_block, net, Batch(x, 2.0)).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), plain, strict=True))


class _Mapped(nn.Module):
    """Keeps its attention map as a plain attribute, as visualisation code does."""

    def __init__(self) -> None:
        super().__init__()
        self.qk, self.v = nn.Linear(16, 32), nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(h).chunk(2, -1)
        a = (q @ k.transpose(-1, -2)).softmax(-1)
        self.attn_map = a.detach()
        return h + a @ self.v(h)


def _steps(blocks: nn.ModuleList, checkpointed: bool, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(1)
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    for _ in range(steps):
        h = torch.randn(2, 5, 16)
        opt.zero_grad()
        for i in range(len(blocks)):
            f = lambda t, i=i: blocks[i](t)  # noqa: E731 - a closure over the whole model, as users write
            h = remat.checkpoint(f, h) if checkpointed else f(h)
        h.pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in blocks.parameters()]


def test_attributes_a_call_sets_or_another_block_set_do_not_stop_training() -> None:
    """A block's own ``self.attn_map = ...`` is the call's output; block 1's attribute, which block
    0's closure reaches, is not read by block 0's recomputation. Both were refused (the forward's
    tensor gone) from the second step on; torch's checkpoint trains."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Mapped(), _Mapped()])
    start = {k: v.clone() for k, v in blocks.state_dict().items()}
    plain = _steps(blocks, checkpointed=False)
    blocks.load_state_dict(start)
    assert all(torch.equal(a, b) for a, b in zip(_steps(blocks, checkpointed=True), plain, strict=True))


@pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")
@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_a_normed_module_called_twice_recomputes_its_weight_each_time(norm: str) -> None:
    """The old-style weight / spectral norm sets ``weight`` in a pre-hook at every call: an unrolled
    cell run twice under checkpoint was refused (the first call's weight gone)."""

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        cell = getattr(torch.nn.utils, norm)(nn.Linear(16, 16))
        h = x = torch.randn(4, 16, requires_grad=True)
        for _ in range(2):
            h = (remat.checkpoint(cell, h) if checkpointed else cell(h)).tanh()
        h.sum().backward()
        return [x.grad, *(p.grad for p in cell.parameters()), *cell.buffers()]

    assert all(torch.equal(a, b) for a, b in zip(grads(True), grads(False), strict=True))


def test_a_replaced_attribute_of_a_module_that_ran_is_still_refused_when_gone() -> None:
    """The refusal stays where the module ran in the call and its tensor is gone."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = torch.full((4,), 2.0)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.lin(h).tanh() * self.scale

    block = Scaled()
    y = remat.checkpoint(block, torch.randn(3, 4, requires_grad=True))
    block.scale = torch.full((4,), 3.0)  # the forward's tensor: referred to by nothing now
    with pytest.raises(
        remat.RecomputationError, match=r"holds another tensor since the forward.*Scaled\.scale"
    ):
        y.sum().backward()


def test_a_saved_tensor_read_outside_backward_keeps_no_recomputation() -> None:
    """A tool reading a saved tensor before backward (``grad_fn._saved_*``) recomputes the call; what
    it recomputed is not kept for a backward that never comes (it was, as long as the graph)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256))
    x = torch.randn(64, 256, requires_grad=True)
    y = remat.checkpoint(block, x)
    with remat.memory.track() as m:
        saved = y.grad_fn._saved_mat1  # type: ignore[union-attr]
        assert saved.shape == (64, 512)
        del saved
    assert m.current_bytes == 0, f"{m.current_bytes} bytes of the recomputation kept"
    y.sum().backward()
    assert x.grad is not None


def _forms() -> dict[str, Any]:
    return {"scope": remat.scope, "offload": remat.offload}


@pytest.mark.parametrize("form", ["scope", "offload"])
def test_scope_and_offload_run_as_they_are_under_torch_func_and_forward_ad(form: str) -> None:
    """As ``remat.checkpoint`` does: torch.func's grad refuses saved-tensor hooks (torch's error),
    and forward-mode AD handed ``remat.offload`` a zero tangent with no storage."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    region = _forms()[form]

    def loss(w: torch.Tensor, inside: bool) -> torch.Tensor:
        if not inside:
            return torch.func.functional_call(lin, {"weight": w}, (x,)).tanh().sum()
        with region():
            return torch.func.functional_call(lin, {"weight": w}, (x,)).tanh().sum()

    w = lin.weight.detach()
    assert torch.equal(torch.func.grad(loss)(w, True), torch.func.grad(loss)(w, False))
    tangent = torch.randn(4, 8)
    outs = []
    for inside in (True, False):
        with fw_ad.dual_level():
            dual = fw_ad.make_dual(x, tangent)
            if inside:
                with region():
                    out = lin(dual).tanh()
            else:
                out = lin(dual).tanh()
            outs.append(fw_ad.unpack_dual(out).tangent)
    assert torch.equal(outs[0], outs[1])


def test_a_gone_parameter_of_a_module_not_run_is_put_back_in_its_place() -> None:
    """A parameter replaced since the forward, whose tensor is gone, is taken away while the
    recomputation runs (it does not read it) and put back where it was among its module's."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    x = torch.randn(2, 4, requires_grad=True)
    y = remat.checkpoint(lambda t: model["body"](t).tanh(), x)
    model["unused"].weight = nn.Parameter(torch.zeros(4, 4))  # the old one: referred to by nothing now
    names = [n for n, _ in model.named_parameters()]
    y.sum().backward()
    assert [n for n, _ in model.named_parameters()] == names
    assert torch.equal(model["unused"].weight, torch.zeros(4, 4))
    plain = x.detach().requires_grad_()
    model["body"](plain).tanh().sum().backward()
    assert torch.equal(x.grad, plain.grad)


class _Tracked(nn.Module):
    """A module whose forward checkpoints a function closing over it, which writes the module's
    buffers in place without calling a module's forward (a step count, a moving average it then
    reads)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("average", torch.zeros(width))

    def forward(self, x: torch.Tensor, form: str, policy: remat.Policy | None) -> torch.Tensor:
        def inner(x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.lin(x))
            self.count += 1
            self.average.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
            return h * (1 + self.average)

        return remat.checkpoint(inner, x, policy=policy) if form == "checkpoint" else inner(x)


@pytest.mark.parametrize("policy", [None, remat.SaveComputeIntensive()])
def test_buffers_a_closure_writes_without_a_forward_are_shielded(policy: remat.Policy | None) -> None:
    """The recomputation wrote them again (a count of 2) and read the average the forward left
    (other gradients): only a module's forward pre-hook swapped a closure's modules' buffers."""
    models = []
    for form in ("plain", "checkpoint"):
        torch.manual_seed(0)
        model, x = _Tracked(16), torch.randn(8, 16)
        model(x, form, policy).square().sum().backward()
        models.append(model)
    plain, ours = models
    assert ours.count.item() == plain.count.item() == 1
    assert torch.equal(ours.average, plain.average)
    pairs = zip(ours.parameters(), plain.parameters(), strict=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs)  # type: ignore[arg-type]
