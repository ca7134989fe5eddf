"""remat.dynamic on programs off the common path: empty tensors read by recomputed ops (batch norm in
eval mode returns empty statistics), the cost model on ops whose tensors share a storage or that
write into ``out=``, generators as op arguments, storages resized in place, and results sized by
the data."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import RematValueError
from remat.aten import scratch


class _EvalNet(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c)
        self.c1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.c2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn0(self.stem(x)))
        h = h + torch.relu(self.bn1(self.c1(h)))
        h = h + torch.relu(self.bn2(self.c2(h)))
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


@pytest.mark.filterwarnings("error:remat.dynamic")  # eval's empty statistics are counted high, unsaid
@pytest.mark.parametrize("policy", ["dtr", "dte"])
def test_empty_tensors_read_by_recomputed_ops_stay_at_hand(policy: str) -> None:
    """In eval mode batch norm returns empty statistics that its backward reads; the program drops
    them before that backward is recomputed (it crashed there)."""
    torch.manual_seed(0)
    init = _EvalNet().eval()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16, generator=generator), torch.randint(0, 5, (8,), generator=generator)
    plain = copy.deepcopy(init)
    plain(x, y).backward()
    model = copy.deepcopy(init)
    free = remat.dynamic(None, policy, keep=model, cost="model")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with free:
            model(x, y).backward()
    model = copy.deepcopy(init)
    region = remat.dynamic(int(0.9 * free.stats.peak_bytes), policy, keep=model, cost="model")
    with region:
        model(x, y).backward()
    assert region.stats.recomputations > 0
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]


def test_the_cost_model_prices_attention_on_one_storage_and_out_matmuls() -> None:
    """q, k and v views of one projection are one storage to the runtime; ``mm(out=)`` makes no new
    storage: the FLOP rules, which read arguments by position, fell over both (the step is priced
    by bytes there)."""
    torch.manual_seed(0)
    w = torch.randn(16, 48, requires_grad=True)
    x = torch.randn(2, 8, 16)

    def step() -> torch.Tensor:
        q, k, v = (x @ w).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = torch.empty(16, 16)
        torch.mm(x.view(16, 16), x.view(16, 16).t(), out=out)
        return F.scaled_dot_product_attention(q, k, v).sum() + out.sum()

    step().backward()
    expected = w.grad.clone()  # type: ignore[union-attr]
    w.grad = None
    with remat.dynamic(None, "dtr", keep=(w,), cost="model"):
        step().backward()
    assert torch.equal(w.grad, expected)  # type: ignore[arg-type]


def test_a_generator_argument_keys_the_scratch_by_its_device() -> None:
    """Its repr is its address: a new generator each step never found the scratch learned."""
    t = torch.ones(4)
    keys = {
        scratch.signature_of("aten.multinomial.default", [t, 2, False, torch.Generator()]) for _ in range(3)
    }
    assert len(keys) == 1


def test_a_storage_resized_in_place_is_refused() -> None:
    x = torch.randn(64, 64)
    refused = pytest.raises(RematValueError, match=r"changed the size of a tensor's storage in place")
    with refused, remat.dynamic(10**7, "dtr", cost="model"):
        buffer = torch.tanh(x).clone()
        buffer.resize_(256, 64)


def test_results_sized_by_the_data_beyond_the_reserve_are_told() -> None:
    """``unique`` runs before its results can be sized (no bound for it: NOTE [bounded ops] in
    ``remat.dynamic.sizing``): the reserve covers it, or a warning says the allocator's count may
    have passed the budget."""
    x = torch.randn(256, 64)

    def step() -> torch.Tensor:
        return torch.unique(torch.tanh(x)).mean()

    free = remat.dynamic(None, "dtr", cost="model")
    with free:
        step()
    told = pytest.warns(UserWarning, match=r"aten\._unique2\.default ran before its results could be sized")
    with told, remat.dynamic(10 * free.stats.peak_bytes, "dtr", cost="model", reserve=1024):
        step()


@pytest.mark.parametrize(
    ("device", "match"),
    [
        ("tpu", r"remat\.dynamic: unknown device \('tpu'\)"),
        (3.5, r"remat\.dynamic: device must be a torch\.device or its name \(3\.5\)"),
        ("meta", r"remat\.dynamic: the device must be a CPU or a CUDA device \('meta'\)"),
    ],
)
def test_a_device_it_cannot_run_on_is_a_clear_error(device: object, match: str) -> None:
    """A bad device was a bare torch error (an AssertionError for CUDA on a CPU build)."""
    with pytest.raises((remat.RematTypeError, remat.RematValueError), match=match):
        remat.dynamic(None, device=device)  # type: ignore[arg-type]


@pytest.mark.parametrize("keep", [5.0, {"a": 3}, [nn.Linear(2, 2), 7]])
def test_numbers_in_keep_are_refused_outside_an_optimizers_state(keep: object) -> None:
    """A number in what the caller keeps is a mistake (they were skipped silently); an optimizer's
    step count in its state is not."""
    refused = pytest.raises(remat.RematTypeError, match=r"remat\.dynamic: keep takes modules")
    with refused, remat.dynamic(None, keep=keep):
        pass
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with remat.dynamic(None, keep=(model, optimizer)):
        model(torch.ones(1, 2)).sum().backward()


def test_an_op_with_a_result_it_does_not_return_is_placed_before_it_runs() -> None:
    """A convolution's backward whose input needs no gradient returns None for it: its other
    results are still sized by its meta kernel and placed before it runs (the op ran unplaced on
    every step, beside the budget, and warned of it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    x = torch.randn(4, 3, 16, 16)  # needs no gradient
    twin = copy.deepcopy(model)
    model(x).square().sum().backward()
    with remat.dynamic(None, keep=twin):  # the kernels' scratch, learned
        twin(x).square().sum().backward()
    twin.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # no reserve: any op run before it is placed warns
        warnings.filterwarnings("error", message=".*could be sized")
        with remat.dynamic("1GB", keep=twin, reserve=0):
            twin(x).square().sum().backward()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]


def test_a_sparse_result_passes_through_the_region() -> None:
    """A sparse tensor has no storage to manage: the region crashed on it with torch's "Cannot
    access storage of SparseTensorImpl"."""
    torch.manual_seed(0)
    x = torch.randn(16, 16)
    w = torch.randn(16, 4, requires_grad=True)
    expected_out = torch.sparse.mm((x * (x > 1)).to_sparse(), w).tanh()
    (expected,) = torch.autograd.grad(expected_out.sum(), w)
    with remat.dynamic("1MB"):
        out = torch.sparse.mm((x * (x > 1)).to_sparse(), w).tanh()
        (got,) = torch.autograd.grad(out.sum(), w)
    assert torch.equal(out, expected_out) and torch.equal(got, expected)


@pytest.mark.parametrize("lazy", ["conj", "neg"])
def test_a_lazy_conjugate_or_negative_view_is_recomputed_with_its_bit(lazy: str) -> None:
    """``b.conj()`` reaches an op as ``b``'s values with the conjugate bit (``b.conj().imag`` with
    the negative bit); the op run again over the storage alone computed with ``b`` itself: a
    conjugated result, the wrong sign."""
    n = 64

    def body() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        a = torch.randn(n, n, dtype=torch.cfloat)
        b = a * 2
        d = (b.conj() if lazy == "conj" else b.conj().imag) * 3
        fill = [torch.randn(n, n, dtype=torch.cfloat) for _ in range(6)]  # evicts d
        s = sum(f.sum() for f in fill)
        return (d.sum() + (s if lazy == "conj" else s.real) * 0).clone(), d

    expected, made = body()
    region = remat.dynamic(6 * n * n * 8, "dtr", cost="model")
    with region:
        got, again = body()
    assert region.stats.recomputations > 0
    assert torch.equal(again, made) and torch.equal(got, expected)


def test_a_lazy_module_in_keep_is_counted_once_it_has_parameters() -> None:
    """``keep=(model,)`` with a lazy layer not yet run asked its uninitialized weight for its
    storage (torch's ValueError as the region opened)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 4)), torch.randn(8, 32)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)  # the lazy layer draws its weights in its first forward
    reference(x).sum().backward()
    torch.manual_seed(1)
    with remat.dynamic(None, keep=(model,)):
        model(x).sum().backward()
    assert all(
        torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )  # type: ignore[arg-type]


def test_an_op_reading_a_sparse_tensor_is_recomputed_with_it() -> None:
    """A graph convolution's ``sparse.mm(adj, h)`` evicted and run again got None where ``adj``
    was (torch's "mat1 and mat2 must have the same dtype"): only the region's tensors are slots of
    a recipe, and the others stay in it as they are."""
    torch.manual_seed(0)
    n, w = 256, 32
    adj = torch.sparse_coo_tensor(torch.randint(0, n, (2, 600)), torch.rand(600), (n, n)).coalesce()
    layers, x = nn.ModuleList([nn.Linear(w, w) for _ in range(4)]), torch.randn(n, w, requires_grad=True)

    def step() -> list[torch.Tensor]:
        layers.zero_grad(set_to_none=True)
        x.grad = None
        h = x
        for layer in layers:
            h = torch.sparse.mm(adj, layer(h)).tanh() + h
        h.pow(2).sum().backward()
        return [x.grad, *(p.grad for p in layers.parameters())]  # type: ignore[list-item]

    expected = step()
    with remat.memory.track(allocator=True) as plain:
        step()
    region = remat.dynamic(0.9, peak=plain.peak_bytes, keep=(layers,), cost="model")
    with region:
        got = step()
    assert region.stats.recomputations > 0
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
