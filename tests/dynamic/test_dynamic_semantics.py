"""What remat.dynamic must get right besides the budget: views, in-place ops, tensors the program
keeps, changing shapes, the module wrapper and the arena's real memory."""

from __future__ import annotations

import copy

import pytest
import torch
from dynamic_models import copies, workload
from models import loss_of

import remat
from remat.dynamic import DynamicModule, backends, homes

BACKENDS = backends.names()


def _views_and_mutations(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    first = h[:, :8]  # a view, read long after h may have been evicted
    h2 = torch.relu(h @ w) * 1.0
    h2.mul_(2.0).add_(1.0)  # in place on an op output
    kept = h2.clone()
    h2[:, 0].zero_()  # in place through a view
    h3 = torch.sigmoid((x @ (h2.t() @ x)).t().t() @ w)  # (64, 32)
    acc = torch.zeros_like(h3)
    for _ in range(3):
        acc.add_(h3 * kept)  # the old version of kept is read again and again
    return (acc.sum() + first.sum()) * h2.mean()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["dtr", "coop"])
def test_views_and_in_place_ops_under_a_tight_budget(policy: str, backend: str) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(64, 32), torch.randn(32, 32)
    wp = w.clone().requires_grad_()
    expected = _views_and_mutations(x, wp)
    expected.backward()
    wd = w.clone().requires_grad_()
    reserve = 0.3 if backend == "arena" else 0  # the arena copies what the program keeps out beside it
    region = remat.dynamic(
        108_000, policy, backend=backend, keep=(x, wd), thrash_limit=50.0, cost="model", reserve=reserve
    )
    with region:
        out = _views_and_mutations(x, wd)
        out.backward()
    assert torch.equal(out, expected)
    assert torch.equal(wd.grad, wp.grad)
    assert region.stats.evictions > 0 and region.stats.recomputations > 0
    assert region.stats.compare().same_evictions


def test_shapes_and_control_flow_change_between_steps_and_kept_tensors_survive() -> None:
    model, batch = workload("gpt2")
    twin = copy.deepcopy(model)
    region = remat.dynamic("900KB", "coop", keep=twin, thrash_limit=50.0, cost="model", reserve=0)
    kept, kept_plain = [], []
    evictions = 0
    for step, length in enumerate((32, 17, 25)):
        ids = batch(step)["input_ids"][:, :length]
        torch.manual_seed(step)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        (out.loss * (2 if step == 1 else 1)).backward()
        kept_plain.append(out.logits[:, -1].detach())
        with region:
            torch.manual_seed(step)
            got = twin(input_ids=ids, labels=ids, use_cache=False)
            loss = got.loss * 2 if step == 1 else got.loss  # control flow differs per step
            loss.backward()
            kept.append(got.logits[:, -1].detach())  # made in the region, held across steps
        evictions += region.stats.evictions
    assert evictions > 0
    for a, b in zip(kept_plain, kept, strict=True):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_module_wrapper_trains_like_the_plain_module() -> None:
    plain, model, batch = copies("cnn")
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped = DynamicModule(model, "900KB", "dtr", optimizer=opt, thrash_limit=50.0, cost="model", reserve=0)
    for step in range(3):
        inputs = batch(step)
        for m, o in ((plain, opt_plain), (wrapped, opt)):
            o.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            loss_of(m(**inputs)).backward()
            o.step()
    wrapped.close()
    assert wrapped.stats.evictions > 0
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_arena_memory_measured_stays_within_the_budget() -> None:
    """The arena, the matrix products run into their blocks (``out=``, nothing copied in) and what
    the program keeps, copied out at the end, all within the budget as the allocator counts it."""
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(256, 64), torch.randn(64, 256), torch.randn(256, 64)
    g = torch.randn(256, 64)
    expected = []
    for w in (w1, w2):
        w.requires_grad_()

    def step() -> torch.Tensor:
        h = x
        for _ in range(4):
            h = torch.tanh(torch.tanh(h @ w1) @ w2)
        h.backward(g)
        return h.detach()

    plain = step()
    expected = [w1.grad.clone(), w2.grad.clone()]
    w1.grad = w2.grad = None
    budget = 2_200_000
    with remat.memory.track(allocator=True) as measured:
        region = remat.dynamic(
            budget, "coop", backend="arena", keep=(x, w1, w2, g), cost="model", reserve=0.3
        )
        with region:
            out = step()
    assert region.stats.copied_ops == ()
    assert region.stats.evictions > 0
    assert measured.peak_bytes + region.stats.outside_bytes <= budget
    assert torch.equal(out, plain)
    assert torch.equal(w1.grad, expected[0]) and torch.equal(w2.grad, expected[1])


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["dtr", "coop"])
def test_cuda_budget_holds_in_the_allocators_count(policy: str) -> None:
    """On CUDA the allocator's own statistics: the region's peak plus the bytes from before it (the
    model, which the budget counts too) stays within the budget, the reserve covering the kernels'
    scratch buffers (not learned on CUDA)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not homes.swappable():
        pytest.skip(f"torch {torch.__version__} cannot swap storages (see test_dynamic_errors)")
    device = torch.device("cuda")
    plain_model, batch = workload("gpt2")
    model = copy.deepcopy(plain_model).to(device)
    plain_model.to(device)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch(0).items()}
    torch.manual_seed(0)
    loss_of(plain_model(**inputs)).backward()
    free = remat.dynamic(None, policy, keep=model, device=device, cost="model")
    torch.manual_seed(0)
    with free:
        loss_of(model(**inputs)).backward()
    model.zero_grad(set_to_none=True)
    budget = int(0.7 * free.stats.peak_bytes)
    region = remat.dynamic(budget, policy, keep=model, device=device, cost="model", thrash_limit=50.0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    with region:
        loss_of(model(**inputs)).backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base + region.stats.outside_bytes <= budget
    for p, q in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
