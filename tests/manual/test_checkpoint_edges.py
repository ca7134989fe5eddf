"""``remat.checkpoint`` where the program is not a plain forward: a last op whose kernel writes what
autograd saved, copies of a module in the module form, segments of ``checkpoint_sequential`` over
modules with buffers, and ``torch.compile`` around a checkpointed call. Each compared bit for bit
with the plain program."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.optim.swa_utils import AveragedModel

import remat
from remat import RecomputationError
from remat.manual import checkpoint as checkpoint_module


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("check", ["shapes", "values"])
def test_a_last_op_that_writes_what_it_saved_runs_whole_in_the_recomputation(check: str) -> None:
    """RReLU saves its noise before its kernel fills it: a recomputation stopped at the last save
    (as torch's early stop does) handed backward unwritten memory (NOTE [early stop]); the value
    check compares what the ops left, not what the save saw."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.RReLU())
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    block(x).pow(2).sum().backward()
    expected = (x.grad.clone(), _grads(block))  # type: ignore[union-attr]
    x.grad = None
    block.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    remat.checkpoint(block, x, check=check).pow(2).sum().backward()  # type: ignore[arg-type]
    assert torch.equal(x.grad, expected[0])  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(_grads(block), expected[1], strict=True))


def test_a_copy_of_a_module_in_the_module_form_runs_its_own_weights() -> None:
    torch.manual_seed(0)
    layer = remat.checkpoint(nn.Linear(4, 3))
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.add_(1.0)
    x = torch.randn(2, 4)
    twin(x).sum().backward()
    assert twin.weight.grad is not None and layer.weight.grad is None
    assert torch.equal(twin(x), x @ twin.weight.t() + twin.bias)
    average = AveragedModel(layer)  # an EMA copies the module it averages
    with torch.no_grad():
        average.module.weight.mul_(0.5)
    assert torch.equal(average(x), x @ average.module.weight.t() + average.module.bias)


class _Normalizer(nn.Module):
    """Reads a moving average it then updates, by assigning a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("average", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.average
        self.average = 0.5 * self.average + 0.5 * x.mean(0).detach()
        return y


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 8), _Normalizer(), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)]


@pytest.mark.parametrize("check", ["shapes", "values"])
def test_sequential_segments_read_buffers_as_their_forward_found_them(check: str) -> None:
    x = torch.randn(4, 8)
    plain = nn.Sequential(*_layers())
    plain(x).sum().backward()
    chain = nn.Sequential(*_layers())
    remat.checkpoint_sequential(chain, 2, x, check=check).sum().backward()  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(_grads(chain), _grads(plain), strict=True))
    for a, b in zip(chain.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)


def _custom_forward(module: nn.Module | list[nn.Module]):  # type: ignore[no-untyped-def]
    """The closure transformers once wrapped each layer in (``create_custom_forward``)."""

    def custom_forward(x: torch.Tensor) -> torch.Tensor:
        for m in module if isinstance(module, list) else [module]:
            x = m(x)
        return x

    return custom_forward


@pytest.mark.parametrize("held", ["module", "list"])
@pytest.mark.parametrize("check", ["shapes", "values"])
def test_modules_a_closure_holds_are_recomputed_from_their_buffers_as_the_forward_found_them(
    held: str, check: str
) -> None:
    """A function whose closure holds the modules it runs: their buffers are noted as for the
    module form (the recomputation read the moving average its forward had already updated)."""
    x = torch.randn(4, 8)
    plain = nn.Sequential(*_layers())
    plain(x).sum().backward()
    chain = nn.Sequential(*_layers())
    body = list(chain[:3]) if held == "list" else chain[:3]
    h = remat.checkpoint(_custom_forward(body), x, check=check)
    chain[3:](h).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(chain), _grads(plain), strict=True))
    for a, b in zip(chain.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)


_GLOBAL_BODY = nn.Sequential(*_layers()[:3])


def _global_forward(x: torch.Tensor) -> torch.Tensor:
    """A function written at a script's top level, running a module it names as a global."""
    return _GLOBAL_BODY(x)


def _calling_forward(x: torch.Tensor) -> torch.Tensor:
    """A function that reaches the global module through another function it calls."""
    return _global_forward(x)


def _comprehension_forward(x: torch.Tensor) -> torch.Tensor:
    """The global module named inside a comprehension (a code object of its own)."""
    return [_GLOBAL_BODY(h) for h in [x]][0]


@pytest.mark.parametrize("fn", [_global_forward, _calling_forward, _comprehension_forward])
@pytest.mark.parametrize("check", ["shapes", "values"])
def test_modules_a_function_names_as_globals_are_recomputed_from_their_buffers_as_the_forward_found_them(
    check: str, fn: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """The recomputation read the moving average its forward had already updated: gradients off,
    and ``check="values"`` failed; also where the module is a global of a function the region
    calls."""
    x = torch.randn(4, 8)
    plain = nn.Sequential(*_layers())
    plain(x).sum().backward()
    rest = nn.Sequential(*_layers()[3:])
    before = copy.deepcopy(_GLOBAL_BODY.state_dict())
    try:
        h = remat.checkpoint(fn, x, check=check)
        rest(h).sum().backward()
        chain = nn.Sequential(*_GLOBAL_BODY, *rest)
        assert all(torch.equal(a, b) for a, b in zip(_grads(chain), _grads(plain), strict=True))
        for a, b in zip(chain.buffers(), plain.buffers(), strict=True):
            assert torch.equal(a, b)
    finally:
        _GLOBAL_BODY.load_state_dict(before)
        _GLOBAL_BODY.zero_grad(set_to_none=True)


_LARGE_GLOBAL = nn.BatchNorm1d(300_000)  # buffers past COPY_LIMIT


def _names_a_large_global() -> bool:
    return _LARGE_GLOBAL.training


def test_a_large_module_reached_leaves_the_others_shielded() -> None:
    """A helper the function calls names a model whose buffers are too large to copy: the modules
    the closure holds lost their shield with it (all or nothing), and the moving average was read
    as the forward left it."""
    x = torch.randn(4, 8)
    plain = nn.Sequential(*_layers())
    plain(x).sum().backward()
    chain = nn.Sequential(*_layers())
    body = chain[:3]

    def fn(h: torch.Tensor) -> torch.Tensor:
        assert _names_a_large_global()
        return body(h)

    chain[3:](remat.checkpoint(fn, x)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(chain), _grads(plain), strict=True))


def _reach_c() -> object:
    return _LARGE_GLOBAL  # three calls below ``_reach_top`` through ``_reach_a``


def _reach_b() -> object:
    return _reach_c()


def _reach_a() -> object:
    return _reach_b()


def _reach_d() -> object:
    return _reach_a()  # ``_reach_a`` again, one call deeper


def _reach_top() -> object:
    return _reach_a(), _reach_d()


def test_reach_follows_each_function_from_where_it_is_shallowest() -> None:
    """Depth first, ``_reach_a`` was met first below ``_reach_d`` and not followed again from
    ``_reach_top``, so ``_reach_c`` lay past the depth followed."""
    from remat.manual.reach import held

    assert any(v is _LARGE_GLOBAL for v in held(_reach_top))


class _Runner:
    """Not a module: holds the modules one of its methods runs."""

    def __init__(self, body: nn.Module) -> None:
        self.body = body

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("held", ["method of an object", "dict in a closure"])
def test_modules_reached_through_an_object_or_a_dict_are_recomputed_from_the_buffers_the_forward_found(
    held: str,
) -> None:
    """The recomputation read the moving average its forward had already updated: silently wrong
    gradients (``check="shapes"``), as ``torch.utils.checkpoint`` gives."""
    x = torch.randn(4, 8)
    plain = nn.Sequential(*_layers())
    plain(x).sum().backward()
    chain = nn.Sequential(*_layers())
    body = chain[:3]
    modules = {"body": body}
    fn = _Runner(body).run if held.startswith("method") else (lambda h: modules["body"](h))
    chain[3:](remat.checkpoint(fn, x)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(chain), _grads(plain), strict=True))
    for a, b in zip(chain.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)


def _block(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ x.t()).sum(-1) * torch.tanh(x).exp()[:, 0]


@pytest.mark.parametrize("policy", [None, remat.SaveComputeIntensive()])
def test_a_checkpoint_inside_a_compiled_function_gives_the_eager_gradients(
    policy: remat.Policy | None,
) -> None:
    """The compiled forward saves other tensors than an eager run makes again (NOTE [under
    torch.compile]): the call compiles as torch's own checkpoint, or runs outside the graph."""
    torch.manual_seed(0)
    x = torch.randn(6, 6, requires_grad=True)
    _block(x).pow(2).sum().backward()
    expected = x.grad.clone()  # type: ignore[union-attr]
    torch._dynamo.reset()
    for wrap in (lambda x: remat.checkpoint(_block, x, policy=policy), lambda x: _block(x)):
        x.grad = None
        torch.compile(wrap, backend="aot_eager")(x).pow(2).sum().backward()
        assert torch.equal(x.grad, expected)  # type: ignore[arg-type]
    x.grad = None
    reference = torch.compile(
        lambda x: torch_checkpoint.checkpoint(_block, x, use_reentrant=False), backend="aot_eager"
    )
    reference(x).pow(2).sum().backward()
    assert torch.equal(x.grad, expected)  # type: ignore[arg-type]


def test_a_checkpoint_inside_a_compiled_function_keeps_less_than_a_plain_call() -> None:
    """While Dynamo traces, ``transformed()`` reads as on (its functorch interpreter): the call ran
    as a plain one (as under ``remat.plainly()``) and kept its insides. It now compiles as torch's
    checkpoint, and a policy is asked, outside the graph."""
    torch.manual_seed(0)
    layers = (nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4))
    blocks = nn.ModuleList(layers)
    x = torch.randn(64, 256, requires_grad=True)
    asked: list[str] = []

    class Asked:
        def decide(self, ctx: remat.OpContext) -> remat.Decision:
            asked.append(ctx.module)
            return remat.Decision.RECOMPUTE

    def peak(policy: remat.Policy | None, plainly: bool = False) -> tuple[int, torch.Tensor]:
        def step(h: torch.Tensor) -> torch.Tensor:
            with remat.plainly() if plainly else contextlib.nullcontext():
                for block in blocks:
                    h = remat.checkpoint(block, h, policy=policy)
            return h.pow(2).sum()

        torch._dynamo.reset()
        run = torch.compile(step, backend="aot_eager")
        run(x).backward()
        x.grad = None
        with remat.memory.track(allocator=True) as m:
            run(x).backward()
        return m.peak_bytes, x.grad.clone()  # type: ignore[union-attr]

    kept, expected = peak(None, plainly=True)
    compiled, grad = peak(None)
    assert compiled < kept and torch.equal(grad, expected)
    _, grad = peak(Asked())
    assert torch.equal(grad, expected) and {"0", "1", "2"} <= set(asked)


def test_a_checkpoint_dynamo_runs_eagerly_while_it_compiles_what_it_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past its recompile limit Dynamo runs the code after ``run``'s graph break eagerly but still
    compiles the frames it calls (a T5's blocks, each called with other arguments, reached the
    limit): the function's compiled forward saved other tensors than its eager run again made. Run
    here as ``run`` made a frame Dynamo skips and does not recurse from: the call is remat's eager
    one with Dynamo off below it."""
    skipped = torch.compiler.disable(checkpoint_module.run, recursive=False)
    monkeypatch.setattr(checkpoint_module, "run", skipped)
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    block(x).pow(2).sum().backward()
    tensors = [*block.parameters(), x]
    expected = [t.grad.clone() for t in tensors]  # type: ignore[union-attr]
    for t in tensors:
        t.grad = None
    torch._dynamo.reset()
    torch.compile(lambda h: remat.checkpoint(block, h).pow(2).sum(), backend="aot_eager")(x).backward()
    assert all(torch.equal(t.grad, e) for t, e in zip(tensors, expected, strict=True))  # type: ignore[arg-type]
    torch._dynamo.reset()


class _OwnMask(nn.Module):
    """Masks with numbers from a generator of its own (NOTE [own generators])."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        mask = torch.rand(x.shape, generator=generator or self.generator) < 0.5
        return torch.tanh(self.lin(x) * mask)  # mul saves the mask, tanh its output


_GLOBAL_GENERATOR = torch.Generator()


def _masked_by_global(mask: _OwnMask, x: torch.Tensor) -> torch.Tensor:
    return mask(x, _GLOBAL_GENERATOR)


def _calling_masked_by_global(mask: _OwnMask, x: torch.Tensor) -> torch.Tensor:
    return _masked_by_global(mask, x)


@pytest.mark.parametrize(
    "form",
    ["argument", "closure", "module", "global", "global of a callee", "partial", "partial of a function"],
)
def test_a_generator_of_the_programs_own_is_replayed_in_the_recomputation(form: str) -> None:
    """The recomputation draws the forward's numbers from the program's own generator, found among
    the arguments, in the closure, on the module, as a global of the function or of a function it
    calls, or among a partial's arguments or its function's globals, and leaves it where the
    forward left it (it drew the next numbers: other masks, silently wrong gradients)."""
    torch.manual_seed(0)
    plain = _OwnMask()
    wrapped = copy.deepcopy(plain)
    x = torch.randn(4, 8)
    if form.startswith("global") or form == "partial of a function":
        plain.generator = _GLOBAL_GENERATOR.manual_seed(5)
    plain(x).sum().backward()
    expected = plain.generator.get_state()
    drawn_from = wrapped.generator
    if form.startswith("global"):
        drawn_from = _GLOBAL_GENERATOR.manual_seed(5)  # the module holds a generator it does not use
        fn = _masked_by_global if form == "global" else _calling_masked_by_global
        out = remat.checkpoint(fn, wrapped, x)
    elif form == "partial of a function":
        drawn_from = _GLOBAL_GENERATOR.manual_seed(5)
        out = remat.checkpoint(functools.partial(_masked_by_global, wrapped), x)
    elif form == "partial":
        out = remat.checkpoint(functools.partial(wrapped, generator=wrapped.generator), x)
    elif form == "argument":
        generator = wrapped.generator
        out = remat.checkpoint(wrapped, x, generator)
    elif form == "closure":
        generator = wrapped.generator
        out = remat.checkpoint(lambda h: wrapped(h, generator), x)
    else:
        out = remat.checkpoint(wrapped, x)
    out.sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(wrapped), _grads(plain), strict=True))
    assert torch.equal(drawn_from.get_state(), expected)


class _LazyScale(nn.Module):
    """Fills a cache on its first call (one op the recomputation does not run), then chains
    matmuls, with an activation between them or not."""

    def __init__(self, activation: bool) -> None:
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.randn(8, 8) / 3) for _ in range(3)])
        self.activation = activation
        self.scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            self.scale = torch.full((8, 8), 0.5)
        for w in self.w:
            x = torch.mm(x, w)
            x = x.sin() if self.activation else x
        return x


@pytest.mark.parametrize("activation", [False, True])
@pytest.mark.parametrize("policy", [remat.SaveOps({"aten.mm"}), remat.SaveComputeIntensive()])
def test_an_op_only_the_forward_runs_shifts_no_saved_output(activation: bool, policy: remat.Policy) -> None:
    """Saved outputs are matched per op (the n-th mm gets the n-th mm's), as torch's selective
    checkpoint matches them: matched by position among all ops, the cache's one op handed each mm
    the previous one's output (gradients off by up to 44, no error), or met a ``sin`` where a ``mm``
    was saved (a false error)."""
    torch.manual_seed(0)
    plain, x = _LazyScale(activation), torch.randn(8, 8)
    wrapped = copy.deepcopy(plain)
    plain(x).pow(2).sum().backward()
    remat.checkpoint(wrapped, x, policy=policy).pow(2).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(wrapped), _grads(plain), strict=True))


@pytest.mark.parametrize("check", ["shapes", "values"])
def test_modules_given_as_arguments_are_recomputed_from_their_buffers_as_the_forward_found_them(
    check: str,
) -> None:
    """A module passed to the function as an argument: its buffers are noted as the module form's
    (the recomputation read the moving average its forward had already updated)."""
    x = torch.randn(4, 8)
    plain = nn.Sequential(*_layers())
    plain(x).sum().backward()
    chain = nn.Sequential(*_layers())
    h = remat.checkpoint(lambda body, h: body(h), chain[:3], x, check=check)
    chain[3:](h).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(chain), _grads(plain), strict=True))
    for a, b in zip(chain.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("check", ["shapes", "values"])
def test_a_lazy_module_first_called_in_a_region_keeps_the_random_numbers_of_its_forward(check: str) -> None:
    """A lazy layer's first forward draws its weights from the generator dropout then draws from;
    its recomputation (the layer made by then) drew dropout's mask from another point: a wrong
    gradient with the default check (``torch.utils.checkpoint`` gives it too). That call runs
    plainly; the next ones recompute."""

    def step(wrap: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.LazyLinear(4), nn.Dropout(0.5), nn.Linear(4, 2))
        grads = []
        for _ in range(2):
            x = torch.ones(2, 3, requires_grad=True)
            wrap(model, x).sum().backward()
            grads += [x.grad, *(p.grad.clone() for p in model.parameters())]  # type: ignore[union-attr]
        return grads

    expected = step(lambda m, x: m(x))
    got = step(lambda m, x: remat.checkpoint(m, x, check=check))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("form", ["checkpoint", "scope", "scope, closure"])
def test_an_inference_tensor_the_region_reads_without_saving_it(form: str) -> None:
    """Plain autograd takes a tensor made under ``torch.inference_mode`` that no op saves; the
    checkpoint raised torch's "cannot be saved for backward" (holding its inputs), the scope
    crashed on its version counter (it has none)."""
    with torch.inference_mode():
        x = torch.randn(3)
    p = torch.randn(3, requires_grad=True)

    def fn(a: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return (a + q).sin()  # add saves nothing

    expected = torch.autograd.grad(fn(x, p).sum(), p)
    if form == "checkpoint":
        out = remat.checkpoint(fn, x, p)
    else:
        with remat.scope():
            out = fn(x, p) if form == "scope" else (lambda q: fn(x, q))(p)
    got = torch.autograd.grad(out.sum(), p)
    assert torch.equal(got[0], expected[0])


class _HandDropout(nn.Module):
    """A hand-written dropout (``rand_like``, as drop path draws with ``rand``) and ``nn.Dropout``
    after it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.drop = nn.Linear(64, 64), nn.Linear(64, 64), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        h = h * (torch.rand_like(h) > 0.1) / 0.9
        return x + self.drop(self.l2(h))


@pytest.mark.parametrize(
    "policy",
    [remat.OffloadLarger("1KiB"), remat.SaveOps(frozenset({"aten.rand_like"}))],
    ids=["offload", "save"],
)
def test_a_kept_random_op_still_draws_in_the_recomputation(policy: remat.Policy) -> None:
    """NOTE [kept, run all the same]: the kept ``rand_like`` was handed back without running, the
    generator stayed behind, and the dropout after it drew another mask: gradients off by up to
    21.7, with no error (``torch.utils.checkpoint`` with the same policy gives the same numbers)."""
    torch.manual_seed(0)
    block, x0 = _HandDropout(), torch.randn(32, 64)

    def run(policy: remat.Policy | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        m = copy.deepcopy(block)
        x = x0.clone().requires_grad_(True)
        torch.manual_seed(1)
        y = m(x) if policy is None else remat.checkpoint(m, x, policy=policy)
        y.pow(2).sum().backward()
        return [p.grad for p in m.parameters()] + [x.grad], torch.rand(3)  # type: ignore[list-item]

    (expected, after), (got, again) = run(None), run(policy)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert torch.equal(again, after)


class _Averaged(nn.Module):
    """Batch norm, and a buffer the forward updates and then reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.register_buffer("avg", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(x))
        with torch.no_grad():
            self.avg.mul_(0.5).add_(h.detach().mean(0))
        return torch.tanh(h * self.avg)


@pytest.mark.parametrize("form", ["module", "call", "function"])
def test_a_compiled_region_updates_its_buffers_once_and_recomputes_from_what_the_forward_read(
    form: str,
) -> None:
    """NOTE [compiled regions]: ``remat.checkpoint(torch.compile(m))`` recomputed through the compiled
    graph, which calls no forward pre-hook: batch norm counted two batches, and the recomputation
    read the average its forward had updated (gradients -0.2154 against -0.3462), in silence."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def built() -> _Averaged:
        torch.manual_seed(0)
        return _Averaged()

    plain = torch.compile(built(), backend="eager")
    plain(x).sum().backward()
    inner = built()
    if form == "module":
        remat.checkpoint(torch.compile(inner, backend="eager"))(x).sum().backward()
    elif form == "call":
        remat.checkpoint(torch.compile(inner, backend="eager"), x).sum().backward()
    else:
        remat.checkpoint(torch.compile(lambda t: inner(t), backend="eager"), x).sum().backward()
    reference = plain._orig_mod
    assert inner.norm.num_batches_tracked.item() == 1
    for a, b in zip(
        [*reference.parameters(), *reference.buffers()], [*inner.parameters(), *inner.buffers()], strict=True
    ):
        assert torch.equal(a, b)
    for a, b in zip(reference.parameters(), inner.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_torch_func_transforms_and_forward_ad_run_the_call_as_it_is() -> None:
    """Under ``torch.func.vmap``/``grad``/``jvp`` and forward-mode AD a checkpointed call raised
    torch's error about remat's anchor of the inputs (an ``autograd.Function`` without
    ``setup_context`` or ``jvp``); ``torch.utils.checkpoint`` runs there."""
    import torch.autograd.forward_ad as fw_ad
    from torch.func import grad, jvp, vmap

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin(x)).sin()

    def checkpointed(x: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(f, x)

    x, v = torch.randn(3, 4), torch.randn(3, 4)

    def forward_ad(fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        with fw_ad.dual_level():
            return fw_ad.unpack_dual(fn(fw_ad.make_dual(x, v))).tangent

    for transform in (
        forward_ad,
        lambda fn: vmap(fn)(x),
        lambda fn: grad(lambda t: fn(t).sum())(x),
        lambda fn: jvp(fn, (x,), (v,))[1],
    ):
        assert torch.equal(transform(checkpointed), transform(f))


def test_arguments_of_every_plain_kind_reach_the_recomputation_as_given() -> None:
    """Tensors, numbers, flags, strings and None, positional and by keyword, one tensor given
    twice: the recomputation is called with the same values (the tensors detached, requiring grad as
    they did), and the gradients are the plain call's."""
    seen: list[tuple[Any, ...]] = []

    def fn(
        x: torch.Tensor, n: int, flag: bool, name: str, scale: float = 1.0, *, y: torch.Tensor, z: Any = 0
    ):
        seen.append((x.requires_grad, n, flag, name, scale, y.requires_grad, z, x is y))
        return (x * y * scale).sin().sum() * n

    x = torch.randn(4, requires_grad=True)
    y = torch.randn(4)
    expected = torch.autograd.grad(fn(x, 3, True, "a", 2.0, y=y, z=None), x)[0]
    got = torch.autograd.grad(remat.checkpoint(fn, x, 3, True, "a", 2.0, y=y, z=None), x)[0]
    assert torch.equal(expected, got)
    assert seen[1] == seen[2] == (True, 3, True, "a", 2.0, False, None, False)
    seen.clear()
    torch.autograd.grad(remat.checkpoint(fn, x, 2, False, "b", y=x), x)
    assert seen[0] == seen[1] == (True, 2, False, "b", 1.0, True, 0, True)


class _Dropping:
    """A callable object, not a module, holding a layer and a generator of its own."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.lin, self.g = nn.Linear(8, 8), torch.Generator().manual_seed(3)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * (torch.rand(x.shape, generator=self.g) > 0.5)


@pytest.mark.parametrize("check", ["shapes", "values"])
def test_a_callable_objects_own_generator_is_reached(check: str) -> None:
    """``remat.checkpoint(obj, x)`` with ``obj.__call__`` drawing from ``obj.g``: the object's
    attributes were reached through a bound method only, so the recomputation drew another mask
    (a wrong gradient, no error) and left the generator advanced twice."""
    x = torch.randn(4, 8)
    plain = _Dropping()
    plain(x).sum().backward()
    block = _Dropping()
    remat.checkpoint(block, x, check=check).sum().backward()
    assert torch.equal(block.lin.weight.grad, plain.lin.weight.grad)  # type: ignore[arg-type]
    assert torch.equal(block.g.get_state(), plain.g.get_state())


class _Config:
    """Settings held by a module, one attribute below it: remat does not reach a generator here."""

    def __init__(self) -> None:
        self.g = torch.Generator().manual_seed(3)


class _Shuffle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.config = nn.Linear(8, 8), _Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))[:, torch.randperm(8, generator=self.config.g)] * x


def test_the_value_check_sees_a_recomputation_that_moves_values() -> None:
    """A permutation drawn again from a generator remat does not reach has the forward's sum and
    absolute sum: ``check="values"`` passed it, with a wrong gradient. Its fingerprint weighs the
    values by position now."""
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RecomputationError, match=r"remat.checkpoint: a recomputed tensor has other values"):
        remat.checkpoint(_Shuffle(), x, check="values").pow(2).sum().backward()


def test_a_last_kernel_filling_a_view_of_memory_saved_before_still_runs() -> None:
    """``rrelu_with_noise`` fills the noise it saved, here a row of a buffer whose other row an
    earlier op saved: a recomputation that stopped at a save outside the graph whose memory was
    saved before skipped the kernel, and every slope of the gradient read 1.0 (NOTE [early stop])."""
    n = 16

    def fn(x: torch.Tensor) -> torch.Tensor:
        buf = torch.ones(2, n)
        return torch.ops.aten.rrelu_with_noise(x * buf[0], buf[1], 0.1, 0.3, True)

    grads = []
    for run in (fn, lambda x: remat.checkpoint(fn, x)):
        x = torch.linspace(-1, 1, n).requires_grad_()
        torch.manual_seed(1)
        run(x).sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])  # type: ignore[arg-type]
