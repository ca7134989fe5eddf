"""Offload where the program is not a plain chain of fresh tensors: a result on its argument's
storage (``_unsafe_view``), sparse tensors under a policy, a saved tensor the program still holds;
and arguments that only look like numbers."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import remat
from remat.policy import Decision, OpContext


@pytest.mark.parametrize("shape", [(128, 64), (4, 32, 64)])
def test_a_linear_on_a_3d_input_offloads_its_matmul(shape: tuple[int, ...]) -> None:
    """A bias-free linear on a 3-D input runs ``mm`` then ``_unsafe_view`` on its storage: the
    storage keeps the ``mm``'s decision (the view's, RECOMPUTE, replaced it, and nothing moved)."""
    torch.manual_seed(0)
    lin, x = nn.Linear(64, 256, bias=False), torch.randn(*shape)
    with remat.offload(remat.OffloadOps({"aten.mm"})) as offloaded:
        loss = nn.functional.gelu(lin(x)).sum()  # gelu saves the linear's output
    loss.backward()
    assert (offloaded.stats().moved, offloaded.stats().bytes_out) == (1, 128 * 256 * 4)


class _OffloadAll:
    def decide(self, ctx: OpContext) -> Decision:
        return Decision.OFFLOAD


def _sparse_product(w: torch.Tensor) -> torch.Tensor:
    return torch.sparse.mm((torch.eye(8) * 2.0).to_sparse(), w * 3)


@pytest.mark.parametrize("form", ["checkpoint", "scope"])
def test_sparse_tensors_under_a_policy_are_kept_or_refused_clearly(form: str) -> None:
    """A policy that keeps a sparse result keeps it; one that offloads it gets remat's error (both
    crashed in torch, reading the size of a storage a sparse tensor has not)."""

    def run(policy: remat.Policy) -> torch.Tensor:
        w = torch.randn(8, 8, requires_grad=True)
        if form == "checkpoint":
            out = remat.checkpoint(_sparse_product, w, policy=policy)
        else:
            with remat.scope(policy):
                out = _sparse_product(w)
        out.sum().backward()
        assert w.grad is not None
        return w.grad

    assert torch.equal(run(remat.SaveComputeIntensive()), torch.full((8, 8), 6.0))
    with pytest.raises(remat.RematValueError, match=r"cannot be moved to host memory \(a torch.sparse_coo"):
        run(_OffloadAll())


def test_a_saved_tensor_the_program_still_holds_comes_back_as_itself() -> None:
    """Moved out while the caller keeps it (tanh's output, which tanh saves), the tensor itself
    is what backward reads: no copy beside it (the region's peak was 255 KiB above the plain
    step's)."""
    torch.manual_seed(0)
    lin, x = nn.Linear(256, 256), torch.randn(512, 256)

    def step(offload: bool) -> tuple[int, torch.Tensor]:
        lin.zero_grad(set_to_none=True)
        with remat.memory.track(timeline=False, allocator=True) as tracked:
            with remat.offload(prefetch=0) if offload else contextlib.nullcontext():
                h = torch.tanh(lin(x))
            h.sum().backward()
        assert lin.weight.grad is not None
        return tracked.peak_bytes, lin.weight.grad.clone()

    (plain, expected), (moved, got) = step(False), step(True)
    assert torch.equal(got, expected)
    assert moved <= plain


@pytest.mark.parametrize("prefetch", [0, 1, 4])
def test_what_the_program_still_holds_is_read_where_it_lives_and_never_prefetched(prefetch: int) -> None:
    """NOTE [read where it lives]: a view autograd saved of a storage the program keeps (``mm``
    saves ``h.t()``), and activations the program keeps, are read from the device in backward:
    no copy beside them, none prefetched (each added a storage's bytes to the step's peak above
    the plain step's), and the gradients are the plain step's."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(6))
    w = torch.randn(128, 128, requires_grad=True)
    for p in [*layers.parameters(), w]:
        p.grad = torch.zeros_like(p)
    x = torch.randn(128, 128)

    def step(region: contextlib.AbstractContextManager[object]) -> tuple[int, list[torch.Tensor], int]:
        for p in [*layers.parameters(), w]:
            assert p.grad is not None
            p.grad.zero_()
        with remat.memory.track(timeline=False, allocator=True) as tracked:
            kept = []
            with region as offloader:
                h = x
                for i, layer in enumerate(layers):
                    h = torch.tanh(layer(h))
                    if i % 2 == 0:
                        kept.append(h)  # the program holds every other activation
                loss = h.square().sum() + (kept[0].t() @ w).sum()
            loss.backward()
            del loss, h, kept
        back = offloader.stats().bytes_back if offloader is not None else 0
        return tracked.peak_bytes, [p.grad.clone() for p in [*layers.parameters(), w]], back

    plain, expected, _ = step(contextlib.nullcontext())
    moved, got, back = step(remat.offload(prefetch=prefetch))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert moved <= plain
    # the program holds the outputs of layers 0, 2, 4 and (as h) 5: only those of 1 and 3 come back
    assert back == 2 * 128 * 128 * 4


def test_a_saved_output_whose_data_is_swapped_after_the_region_reads_what_autograd_saved() -> None:
    """``y.data = ...`` after the region gives ``y`` a new storage without a version: autograd's
    saved output still reads the old one, and so does the region (it read ``y`` itself)."""

    def run(region: contextlib.AbstractContextManager[object]) -> torch.Tensor:
        torch.manual_seed(0)
        x = torch.randn(8, 8, requires_grad=True)
        with region:
            y = torch.tanh(x * 2)  # tanh saves its output
        loss = y.sum()
        y.data = torch.zeros(8, 8)
        loss.backward()
        assert x.grad is not None
        return x.grad

    assert torch.equal(run(remat.offload()), run(contextlib.nullcontext()))


def test_a_policy_class_and_a_bool_or_float_size_are_clear_errors() -> None:
    """The region form checks its policy as the others do (a class gave a bare TypeError from
    ``decide``), and a size of False or 0.0 is no byte count (both read as 0)."""
    refused = pytest.raises(remat.RematTypeError, match=r"remat\.offload: policy .* not its class")
    with refused, remat.offload(policy=remat.OffloadLarger):  # type: ignore[arg-type]
        pass
    for size in (False, 0.0):
        with pytest.raises(remat.RematTypeError, match=rf"remat\.offload: a byte count .*\(got {size}\)"):
            remat.Offloader(min_bytes=size)  # type: ignore[arg-type]
        with pytest.raises(remat.RematTypeError, match=rf"remat\.policy: a byte count .*\(got {size}\)"):
            remat.OffloadLarger(size)  # type: ignore[arg-type]
    assert remat.Offloader(min_bytes=0).min_bytes == remat.Offloader(min_bytes="0").min_bytes == 0


@pytest.mark.parametrize("form", ["offload", "offload, OffloadLarger", "scope, OffloadLarger"])
def test_a_tensor_its_own_op_fills_after_saving_it_moves_filled(form: str) -> None:
    """RReLU saves the noise it is about to fill, without moving its version: moved at the save,
    the copy held whatever the memory held before, and the gradients came out as garbage
    (NOTE [moved after its op] in ``remat.host.region``; ``Offloader.refill`` for the tape)."""
    x = torch.randn(64, 64)
    w = torch.randn(64, 64, requires_grad=True)

    def step(region: contextlib.AbstractContextManager[object]) -> torch.Tensor:
        torch.manual_seed(0)
        with region:
            loss = nn.functional.rrelu(x @ w, training=True).tanh().sum()
        (grad,) = torch.autograd.grad(loss, w)
        return grad

    region = {
        "offload": remat.offload(),
        "offload, OffloadLarger": remat.offload(remat.OffloadLarger(0)),
        "scope, OffloadLarger": remat.scope(remat.OffloadLarger(0)),
    }[form]
    assert torch.equal(step(region), step(contextlib.nullcontext()))


def test_a_moved_tensor_written_after_its_save_and_let_go_is_refused() -> None:
    """Plain autograd refuses the backward; the parcel checked the version of a tensor that was
    gone and gave the gradient of the bytes copied before the write."""
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)

    def body() -> torch.Tensor:
        y = torch.sigmoid(x @ w)  # sigmoid saves its output ...
        y.mul_(2)  # ... which is then written, and dropped with the function
        return y.sum()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        body().backward()
    with remat.offload():
        loss = body()
    with pytest.raises(
        remat.RecomputationError, match=r"remat\.offload: a tensor saved for backward was modified"
    ):
        loss.backward()


def test_scope_moves_a_storage_once_when_autograd_saves_a_view_of_a_moved_tensor() -> None:
    """transformers' Conv1D: ``addmm`` then ``view``, the view saved by the next op. The tape moves
    the ``addmm`` result inside its dispatch mode, where a witness gets a counter of its own; the
    view saved later shares the tensor's counter, so its bytes cross once (they crossed twice, and
    the host held them twice)."""
    torch.manual_seed(0)
    x = torch.randn(4, 48, 64, requires_grad=True)
    w = torch.randn(64, 256, requires_grad=True)
    b = torch.randn(256, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = torch.addmm(b, x.view(-1, 64), w).view(4, 48, 256)
        return (0.5 * h * (1.0 + torch.tanh(h + 0.044715 * torch.pow(h, 3.0)))).sum()

    def grads() -> list[torch.Tensor]:
        got = [t.grad for t in (x, w, b)]
        x.grad = w.grad = b.grad = None
        assert all(g is not None for g in got)
        return got  # type: ignore[return-value]

    block(x).backward()
    expected = grads()
    offloader = remat.Offloader(prefetch=0)
    with remat.scope(remat.OffloadComputeIntensive(), offloader=offloader):
        loss = block(x)
    loss.backward()
    assert all(torch.equal(g, e) for g, e in zip(grads(), expected, strict=True))
    stats = offloader.stats()
    assert stats.moved == 1
    assert stats.bytes_out == stats.host_peak_bytes == 4 * 48 * 256 * 4


def test_an_offloaded_output_with_a_conjugate_view_leaves_the_device() -> None:
    """A version witness of ``c.conj()`` held the whole complex storage the policy moved to host
    memory (``remat.aten.version_witness``), so the device kept it too."""
    x = torch.randn(256, 256, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        c = torch.complex(x, x * 2)
        return (c.conj().real * x).sum()

    def forward_leaves(policy: remat.Policy) -> tuple[int, int]:
        offloader = remat.Offloader()
        with remat.memory.track(allocator=True) as tracked:
            loss = remat.checkpoint(fn, x, policy=policy, offloader=offloader)
        left = tracked.current_bytes
        loss.backward()
        x.grad = None
        return left, offloader.stats().bytes_out

    kept, _ = forward_leaves(remat.SaveOps({"aten.complex"}))
    left, moved = forward_leaves(remat.OffloadOps({"aten.complex"}))
    assert moved == 256 * 256 * 8
    assert left <= kept - moved


def test_a_tensor_made_around_a_nested_block_is_moved_by_the_block_that_made_it() -> None:
    """NOTE [nested blocks]: ``h`` is made in the outer block and saved by a matmul in the inner
    one; the inner block kept it on the device (it did not make it), though the outer one moves
    what it makes."""
    torch.manual_seed(0)
    first, second = nn.Linear(256, 256), nn.Linear(256, 256)
    x = torch.randn(256, 256)

    def step(nested: bool) -> tuple[int, int, list[torch.Tensor]]:
        first.zero_grad(set_to_none=True)
        second.zero_grad(set_to_none=True)
        with remat.memory.track(allocator=True) as tracked:
            with remat.offload(prefetch=0) as outer:
                h = torch.tanh(first(x))
                with remat.offload(prefetch=0) if nested else contextlib.nullcontext():
                    y = second(h)
                loss = y.sum()
            del h, y
        left = tracked.current_bytes
        loss.backward()
        grads = [p.grad.clone() for p in (*first.parameters(), *second.parameters()) if p.grad is not None]
        return left, outer.stats().bytes_out, grads

    alone, moved_alone, expected = step(False)
    left, moved, got = step(True)
    assert moved == moved_alone == 256 * 256 * 4
    assert left == alone
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)) and len(got) == 4


def test_a_tensor_handed_to_the_block_around_comes_back_through_it() -> None:
    """The inner block's offloader read back a parcel the outer one made: its cargo numbers are its
    own, and it returned another tensor's bytes (gradients off by 3.8)."""
    torch.manual_seed(0)
    inp, inp2 = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)

    def step(nested: bool) -> torch.Tensor:
        inp.grad = inp2.grad = None
        with remat.offload():
            x = inp * 2  # made by the outer block
            with remat.offload() if nested else contextlib.nullcontext():
                u = (inp2 * 3).sin()  # the inner block's first cargo
                v = x.sin().sin()  # x: the outer block's first cargo
                out = (u + v).sum()
            del x
        out.backward()
        assert inp.grad is not None
        return inp.grad.clone()

    assert torch.equal(step(True), step(False))


def test_a_parameter_made_in_the_block_stays_on_the_device() -> None:
    """A lazy module's first forward inside the block makes its weight there: it was moved to the
    host (256 KiB out, and a ``host_budget`` of 100 KiB refused) though the program keeps it."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.LazyLinear(256), nn.Tanh(), nn.Linear(256, 1)), torch.randn(4, 256)
    with remat.offload(host_budget="100KiB") as offloader:
        model(x).sum().backward()
    assert offloader.stats().bytes_out < 256 * 256 * 4


def test_forward_mode_ad_runs_in_the_block_and_under_the_counting_tracker() -> None:
    """Forward-mode AD makes implicit zero tensors with no memory; asked for their storage, the
    block and the tracker raised torch's "invalid python storage"."""
    import torch.autograd.forward_ad as forward_ad

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)), torch.randn(4, 8)
    expected = torch.func.jvp(model, (x,), (torch.ones_like(x),))
    for context in (remat.offload(), remat.memory.track()):
        with context:
            got = torch.func.jvp(model, (x,), (torch.ones_like(x),))
            with forward_ad.dual_level():
                forward_ad.unpack_dual(model(forward_ad.make_dual(x, torch.ones_like(x))))
        assert all(map(torch.equal, got, expected))


def test_a_lazy_conjugate_view_of_an_offloaded_tensor_is_recomputed_in_a_scope() -> None:
    """``spec * spec.conj()`` saves a conjugate view of the offloaded spectrum: the scope handed it
    to the offloader, which refuses lazy bits (naming ``remat.offload``); the other forms already
    kept it. It is recomputed now, and the gradient is the plain one."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        spec = torch.fft.rfft(x * 2, dim=1)
        return torch.fft.irfft(spec * spec.conj(), n=16, dim=1)

    (expected,) = torch.autograd.grad(f(x).sum(), x)
    with remat.scope(policy=remat.OffloadLarger(1)):
        y = f(x)
    (got,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_views_of_unsafe_chunk_move_their_own_bytes_and_lower_the_peak(prefetch: int) -> None:
    """``unsafe_chunk`` gives each view a version counter of its own, so a view cannot share the
    host copy of the storage another view moved; each moved the whole storage again, and the
    block's peak was no lower than the plain one (a sweep's case rose 1% and, with prefetch, 11%
    above it). Each such view now moves its own bytes (NOTE [a view on a counter of its own])."""
    torch.manual_seed(0)
    lin, out = nn.Linear(64, 192), nn.Linear(64, 64)
    x = torch.randn(512, 64, requires_grad=True)

    def step(offloaded: bool) -> tuple[int, list[torch.Tensor]]:
        lin.zero_grad(set_to_none=True)
        out.zero_grad(set_to_none=True)
        x.grad = None
        with remat.memory.track(allocator=True) as tracked:
            with remat.offload(prefetch=prefetch) if offloaded else contextlib.nullcontext():
                q, k, v = lin(x).unsafe_chunk(3, -1)
                loss = out(q * k * v.sigmoid()).pow(2).sum()
            del q, k, v
            loss.backward()
        return tracked.peak_bytes, [x.grad, *lin.parameters(), *out.parameters()]  # type: ignore[list-item]

    step(False)  # the allocator's first step learns its kernels' scratch
    plain, expected = step(False)
    expected = [t.grad if isinstance(t, nn.Parameter) else t for t in expected]
    step(True)
    moved, got = step(True)
    got = [t.grad if isinstance(t, nn.Parameter) else t for t in got]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))  # type: ignore[arg-type]
    assert moved < plain
