"""The mechanism under every form: the host pool, ``Offloader.out``/``back``, the policies that
decide OFFLOAD, and the errors (a bad link, a host budget too small, a tensor that cannot move)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import assert_same, build, train, twin
from torch import nn

import remat
from remat.host import HostPool, Offloader, Parcel, unmovable
from remat.policy import Decision, OpContext

TENSORS = {
    "contiguous": lambda: torch.randn(8, 16),
    "strided view": lambda: torch.randn(8, 16)[2:, ::3],
    "transposed": lambda: torch.randn(8, 16).t(),
    "bfloat16": lambda: torch.randn(5, 7).to(torch.bfloat16),
    "int64": lambda: torch.arange(40).view(5, 8),
    "bool": lambda: torch.rand(33) > 0.5,
    "complex": lambda: torch.randn(6, dtype=torch.complex64),
}


@pytest.mark.parametrize("make", TENSORS.values(), ids=TENSORS.keys())
def test_a_tensor_comes_back_bit_for_bit_with_its_strides(make: functools.partial[torch.Tensor]) -> None:
    t = make()
    offloader = Offloader(prefetch=0)
    parcel = offloader.out(t)
    back = offloader.back(parcel)
    assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride()
    assert back.storage_offset() == t.storage_offset()
    assert torch.equal(back, t)
    assert back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_the_link_model_charges_each_copy_and_the_same_storage_moves_once() -> None:
    link = remat.Link(d2h="1GB/s", h2d="2GB/s", latency="1ms")
    offloader = Offloader(link=link, prefetch=0)
    t = torch.randn(1000)
    first, again = offloader.out(t), offloader.out(t)
    assert first.cargo is again.cargo and first.cargo.uses == 2
    offloader.back(first)
    offloader.back(first)  # the second use takes the copy the first brought back
    stats = offloader.stats()
    assert (stats.moved, stats.bytes_out, stats.bytes_back) == (1, 4000, 4000)
    assert stats.d2h_seconds == pytest.approx(link.d2h_seconds(4000))
    assert stats.h2d_seconds == pytest.approx(link.h2d_seconds(4000))
    assert "offloaded 1 tensors" in str(stats)


def test_prefetch_brings_back_the_next_parcels_in_backward_order() -> None:
    offloader = Offloader(prefetch=2)
    tensors = [torch.full((100,), float(i)) for i in range(5)]
    parcels = [offloader.out(t) for t in tensors]
    for parcel, t in zip(reversed(parcels), reversed(tensors), strict=True):
        assert torch.equal(offloader.back(parcel), t)
    stats = offloader.stats()
    assert stats.prefetched == 4 and stats.bytes_back == stats.bytes_out


def test_a_written_tensor_is_known_and_a_freed_parcel_returns_its_buffer() -> None:
    offloader = Offloader()
    t = torch.randn(256)
    parcel = offloader.out(t)
    assert not parcel.written()
    t.add_(1)
    assert parcel.written()
    assert offloader.pool.used_bytes == 1024
    del parcel
    assert offloader.pool.used_bytes == 0 and offloader.pool.cached_bytes == 1024


def test_the_host_pool_reuses_buffers_by_size_and_torch_does_not_count_them() -> None:
    pool = HostPool()
    with remat.memory.track(allocator=True) as m:
        first = pool.take(1 << 20)
    assert m.peak_bytes == 0  # numpy's memory, out of the device's count
    pool.give(first, pinned=False)
    again = pool.take(1 << 20)
    assert again.data_ptr() == first.data_ptr()
    assert pool.take(1 << 10).data_ptr() != first.data_ptr()
    assert pool.peak_bytes == (1 << 20) + (1 << 10)


def test_without_a_budget_the_cache_holds_no_more_than_was_ever_in_use() -> None:
    """Steps of another shape each left buffers of sizes no later step asked for: a shared
    offloader over 40 sequence lengths held 3.4 MiB idle with nothing in use."""
    pool = HostPool()
    for n in range(100, 140):  # a step of two buffers of one size, another size each step
        if n % 2:
            pool.give(pool.take(n * 256), pinned=False)
        a, b = pool.take(n * 512), pool.take(n * 512)
        pool.give(a, pinned=False)
        pool.give(b, pinned=False)
        assert pool.used_bytes == 0 and pool.cached_bytes <= pool.peak_used
    reused = pool.take(139 * 512)  # the last step's size is still at hand
    assert any(reused.data_ptr() == b.data_ptr() for b in (a, b))


def test_a_host_budget_releases_cached_buffers_first_then_refuses() -> None:
    pool = HostPool(budget=3000)
    pool.give(pool.take(2000), pinned=False)
    assert pool.cached_bytes == 2000
    pool.take(1500)  # the cached 2000 go to make room
    assert pool.held_bytes == 1500
    with pytest.raises(
        remat.RematRuntimeError, match=r"remat\.offload: the host budget is too small .*2\.00 KiB asked"
    ):
        pool.take(2048)


def test_a_host_budget_too_small_for_a_region_is_a_clear_error() -> None:
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    with (
        pytest.raises(
            remat.RematRuntimeError, match=r"remat\.offload: the host budget is too small .*host_budget"
        ),
        remat.offload(host_budget="16KiB"),
    ):
        net(torch.randn(32, 64))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"link": "25GB/s"},
            remat.RematTypeError,
            r"remat\.offload: link must be a remat\.Link \(got '25GB/s'\)",
        ),
        ({"link": remat.Link}, remat.RematTypeError, r"remat\.offload: link must be a remat\.Link"),
        (
            {"prefetch": -1},
            remat.RematValueError,
            r"remat\.offload: prefetch must be a whole number .*got -1",
        ),
        ({"host_budget": "lots"}, remat.RematValueError, r"remat\.offload: "),
        ({"min_bytes": 1.5}, remat.RematTypeError, r"remat\.offload: "),
    ],
)
def test_bad_settings_are_clear_errors(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match), remat.offload(**kwargs):  # type: ignore[arg-type]
        pass


def test_a_bad_link_rate_is_a_clear_error() -> None:
    with pytest.raises(remat.RematValueError, match=r"remat\.Link: cannot parse this rate \(got 'fast'\)"):
        remat.offload(link=remat.Link(d2h="fast"))


def test_offload_demanded_of_a_tensor_that_cannot_move_is_a_clear_error() -> None:
    x = torch.randn(4, 4, device="meta", requires_grad=True)
    with (
        pytest.raises(
            remat.RematValueError, match=r"remat\.offload: this tensor cannot be moved .*a tensor on meta"
        ),
        remat.offload(remat.OffloadLarger(0)),
    ):
        (x * 2).tanh()
    d, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    with (
        pytest.raises(remat.RematValueError, match=r"cannot be moved .*a torch\.sparse_coo tensor"),
        remat.offload(remat.OffloadOps(frozenset({"aten._to_sparse"}))),
    ):
        torch.sparse.mm((d * 2).to_sparse(), w)
    with pytest.raises(remat.RematValueError, match=r"cannot be moved .*a tensor on meta"):
        remat.checkpoint(lambda a: (a * 2).tanh(), x, policy=remat.OffloadLarger(0))
    with (
        pytest.raises(remat.RematValueError, match=r"cannot be moved .*a tensor on meta"),
        remat.scope(remat.OffloadLarger(0)),
    ):
        (x * 2).tanh()


def test_without_a_policy_a_tensor_that_cannot_move_stays() -> None:
    x = torch.randn(4, 4, device="meta", requires_grad=True)
    with remat.offload() as offloader:
        (x * 2).tanh()
    assert offloader.stats().moved == 0
    assert unmovable(x) == "a tensor on meta"


def test_a_saved_tensor_written_after_the_region_is_refused_in_backward() -> None:
    x = torch.randn(64, requires_grad=True)
    with remat.offload():
        h = x * 2
        y = h.tanh()  # saves its output
    y.mul_(2)
    with pytest.raises(
        remat.RecomputationError, match=r"remat\.offload: a tensor saved for backward was modified"
    ):
        y.sum().backward()


def test_the_manual_forms_refuse_an_offloader_of_another_type() -> None:
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(
        remat.RematTypeError, match=r"remat\.checkpoint: offloader must be a remat\.Offloader"
    ):
        remat.checkpoint(torch.tanh, x, offloader="cpu")  # type: ignore[call-overload]
    with (
        pytest.raises(remat.RematTypeError, match=r"remat\.scope: offloader must be a remat\.Offloader"),
        remat.scope(offloader="cpu"),
    ):  # type: ignore[arg-type]
        pass


def test_the_offload_policies_decide_per_op() -> None:
    mm = OpContext(op="aten.mm.default", packet="aten.mm", out_bytes=4096)
    gelu = OpContext(op="aten.gelu.default", packet="aten.gelu", out_bytes=64)
    assert remat.OffloadComputeIntensive().decide(mm) is Decision.OFFLOAD
    assert remat.OffloadComputeIntensive().decide(gelu) is Decision.RECOMPUTE
    assert remat.OffloadOps(frozenset({"aten.gelu"})).decide(gelu) is Decision.OFFLOAD
    assert remat.OffloadOps(frozenset({"aten.gelu"})).decide(mm) is Decision.RECOMPUTE
    larger = remat.OffloadLarger("1KiB")
    assert (
        larger.min_bytes == 1024
        and larger == remat.OffloadLarger(1024)
        and hash(larger) == hash(remat.OffloadLarger(1024))
    )
    assert larger.decide(mm) is Decision.OFFLOAD and larger.decide(gelu) is Decision.RECOMPUTE


def needs_cuda(test: Callable[[], None]) -> Callable[[], None]:
    gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
    return pytest.mark.cuda(gpu(test))


@needs_cuda
def test_on_cuda_a_tensor_goes_to_pinned_memory_on_a_side_stream_and_comes_back() -> None:
    t = torch.randn(1024, 64, device="cuda")[:, ::2]
    offloader = Offloader(prefetch=0)
    parcel = offloader.out(t)
    assert parcel.cargo.buffer.is_pinned() and parcel.cargo.ready is not None
    back = offloader.back(parcel)
    assert back.device == t.device and back.stride() == t.stride()
    assert torch.equal(back, t)


@needs_cuda
def test_on_cuda_the_region_matches_plain_and_lowers_the_allocator_peak() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(6)]).cuda()
    x = torch.randn(1024, 512, device="cuda")

    def step(region: bool) -> tuple[list[torch.Tensor], int, int]:
        net.zero_grad(set_to_none=False)
        with remat.memory.track("cuda") as m:
            with remat.offload(prefetch=2) if region else torch.enable_grad() as off:
                loss = net(x).square().sum()
            loss.backward()
        moved = off.stats().bytes_out if region else 0
        return [p.grad.clone() for p in net.parameters()], m.peak_bytes, moved

    step(False)  # gradients allocated once
    plain, plain_peak, _ = step(False)
    grads, peak, moved = step(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True))
    assert moved > 0 and peak < plain_peak


def test_views_of_one_storage_share_its_host_copy() -> None:
    qkv = torch.randn(8, 3 * 16)
    q, k, v = qkv.split(16, dim=1)
    offloader = Offloader(prefetch=0)
    parcels = [offloader.out(t) for t in (q, k, v)]
    assert len({id(p.cargo) for p in parcels}) == 1 and parcels[0].cargo.uses == 3
    for parcel, t in zip(parcels, (q, k, v), strict=True):
        assert torch.equal(offloader.back(parcel), t)
    stats = offloader.stats()
    assert stats.bytes_out == stats.bytes_back == qkv.nbytes


def test_a_host_budget_too_small_for_a_checkpoint_and_a_bad_threshold_are_clear_errors() -> None:
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    offloader = Offloader(host_budget="4KiB")
    with pytest.raises(remat.RematRuntimeError, match=r"remat\.offload: the host budget is too small"):
        remat.checkpoint(net, torch.randn(32, 64), policy=remat.OffloadLarger(1), offloader=offloader)
    with pytest.raises(remat.RematValueError, match=r"remat\.policy: a size is 0 bytes or more \(got -1\)"):
        remat.OffloadLarger(-1)


def test_a_copy_is_held_only_for_the_reads_left_after_reads_of_the_live_storage() -> None:
    """NOTE [read where it lives] with [moved once, read twice]: a storage saved twice, read once from
    the device while the program held it, then copied back once it let go: the copy was held for a
    second read that never comes."""
    offloader = Offloader(prefetch=0)
    t = torch.randn(256)
    first, second = offloader.out(t, follows=True), offloader.out(t, follows=True)
    assert first.cargo is second.cargo and first.cargo.uses == 2
    live = offloader.back(first)
    assert live.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    expected = t.clone()
    del t, live
    again = offloader.back(second)
    assert torch.equal(again, expected)
    assert second.cargo.held is None


FORMS = ["offload", "checkpoint", "scope"]


def _exps(*leaves: torch.Tensor) -> torch.Tensor:
    return sum((leaf.exp().sum() for leaf in leaves), torch.zeros(()))


@pytest.mark.parametrize("form", FORMS)
def test_tensors_under_min_bytes_stay_and_those_at_or_over_it_move(form: str) -> None:
    """``exp`` saves its output: of outputs of 4096, 1024, 1020 and 64 bytes (and scalar sums), a
    ``min_bytes`` of 1 KiB moves exactly the first two, under a policy that offloads every op."""
    torch.manual_seed(0)
    leaves = [torch.randn(n, requires_grad=True) for n in (1024, 256, 255, 16)]
    expected = torch.autograd.grad(_exps(*leaves), leaves)
    policy = remat.OffloadLarger(0)  # OFFLOAD for every op
    if form == "offload":
        with remat.offload(policy, min_bytes="1KiB") as offloader:
            loss = _exps(*leaves)
    else:
        offloader = Offloader(min_bytes="1KiB")
        if form == "checkpoint":
            loss = remat.checkpoint(_exps, *leaves, policy=policy, offloader=offloader)
        else:
            with remat.scope(policy, offloader=offloader):
                loss = _exps(*leaves)
    assert (offloader.stats().moved, offloader.stats().bytes_out) == (2, 4096 + 1024)
    grads = torch.autograd.grad(loss, leaves)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert offloader.stats().bytes_back == 4096 + 1024


class _Noted(Offloader):
    """An offloader that notes the storage of every tensor ``out`` is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given: list[int] = []

    def out(self, t: torch.Tensor, *args: Any, **kwargs: Any) -> Parcel:
        self.given.append(t.untyped_storage().data_ptr())
        return super().out(t, *args, **kwargs)


def _wrapped_in(
    form: str, blocks: list[nn.Module], policy: remat.Policy, monkeypatch: pytest.MonkeyPatch
) -> tuple[Callable[[], contextlib.AbstractContextManager[Any]] | None, list[_Noted]]:
    """``blocks`` in ``remat.checkpoint`` or ``remat.scope`` with ``policy``, or a
    ``remat.offload(policy)`` region for each step; and the offloaders they use, noting."""
    made: list[_Noted] = []
    if form == "offload":

        class Made(_Noted):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                made.append(self)

        monkeypatch.setattr(sys.modules["remat.host.region"], "Offloader", Made)
        return lambda: remat.offload(policy), made
    made.append(offloader := _Noted())
    for block in blocks:
        if form == "checkpoint":
            remat.checkpoint(block, policy=policy, offloader=offloader)
            continue
        forward = block.forward

        @functools.wraps(forward)
        def scoped(*args: Any, forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            with remat.scope(policy, offloader=offloader):
                return forward(*args, **kwargs)

        block.forward = scoped  # type: ignore[method-assign]
    return None, made


def _never_moved(name: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two training steps of ``name`` under a policy that offloads every op, equal to plain bit for
    bit; something moved, and no storage of a parameter or buffer."""
    model, batch, blocks = MODELS[name]()
    wrapped = twin(model)
    region, made = _wrapped_in(form, blocks(wrapped), remat.OffloadLarger(0), monkeypatch)
    assert_same(train(model, batch, steps=2), train(wrapped, batch, steps=2, region=region))
    held = {
        t.untyped_storage().data_ptr(): n for n, t in [*wrapped.named_parameters(), *wrapped.named_buffers()]
    }
    assert made and all(o.stats().moved > 0 for o in made)
    assert [held[ptr] for o in made for ptr in o.given if ptr in held] == []


class _Chunked(nn.Module):
    """A linear layer, batch norm, and a parameter and a buffer read through ``unsafe_chunk`` (whose
    schema promises new tensors: its results lie on the parameter's and the buffer's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.norm = nn.BatchNorm1d(32)
        self.pair = nn.Parameter(torch.randn(64, 32))
        self.register_buffer("scales", torch.rand(2, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.linear(x)))
        a, b = self.pair.unsafe_chunk(2)
        s, t = self.scales.unsafe_chunk(2)
        return ((h @ a * s).tanh() * (h @ b * t)).sum()


def _chunked() -> tuple[nn.Module, Callable[[int], dict[str, Any]], Callable[[nn.Module], list[nn.Module]]]:
    torch.manual_seed(0)

    def batch(step: int) -> dict[str, Any]:
        return {"x": torch.randn(8, 32, generator=torch.Generator().manual_seed(step))}

    return _Chunked().train(), batch, lambda m: [m]


MODELS = {"chunked": _chunked, **{name: functools.partial(build, name) for name in ("gpt2", "bert", "cnn")}}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn"])
def test_parameters_and_buffers_never_move_under_a_policy_that_offloads_every_op(
    name: str, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole model in ``remat.offload``, each layer in ``remat.checkpoint`` or ``remat.scope``."""
    _never_moved(name, form, monkeypatch)


@pytest.mark.parametrize("form", FORMS)
def test_a_parameter_and_a_buffer_read_through_unsafe_chunk_never_move(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``unsafe_chunk`` results on a parameter's storage, under a policy that offloads every op."""
    _never_moved("chunked", form, monkeypatch)


def test_another_threads_prefetch_never_reads_a_cargo_still_being_copied_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One offloader shared by two threads: thread A's backward prefetched a cargo that thread B
    had registered and not yet filled, and B's backward then read the unfilled copy (wrong
    gradients, no error). B's copy out is held open here until A's step ends, or a second."""
    import copy
    import threading

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)), torch.randn(64, 32)

    def grads(m: nn.Module, batch: torch.Tensor, offloader: Offloader) -> list[torch.Tensor]:
        remat.checkpoint(m, batch, policy=remat.OffloadLarger(1), offloader=offloader).pow(2).sum().backward()
        return [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]

    expected = grads(copy.deepcopy(model), x, Offloader())
    shared, copying, a_done = Offloader(prefetch=4), threading.Event(), threading.Event()
    copy_out, calls = Offloader._copy_out, []

    def slow_copy_out(self: Offloader, cargo: Any, storage: torch.UntypedStorage) -> None:
        calls.append(threading.current_thread().name)
        if calls.count("B") == 2 and not copying.is_set():
            copying.set()
            a_done.wait(timeout=1.0)
        copy_out(self, cargo, storage)

    monkeypatch.setattr(Offloader, "_copy_out", slow_copy_out)
    got: dict[str, list[torch.Tensor]] = {}

    def a() -> None:
        copying.wait(timeout=5.0)
        grads(copy.deepcopy(model), x + 7.0, shared)
        a_done.set()

    threads = [
        threading.Thread(target=lambda: got.update(B=grads(copy.deepcopy(model), x, shared)), name="B")
    ]
    threads.append(threading.Thread(target=a, name="A"))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert copying.is_set()
    assert all(torch.equal(g, e) for g, e in zip(got["B"], expected, strict=True))
