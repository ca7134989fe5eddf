"""``remat.aten``: the facts every dispatch mode reads, checked against what the ops do."""

from __future__ import annotations

import torch

from remat import aten


def test_a_random_op_draws_from_its_generator_then_its_device_argument_then_its_tensor() -> None:
    x = torch.randn(3)
    g = torch.Generator()
    assert aten.source_of((x,), {"generator": g}) is g
    assert aten.source_of((x, 0.5, g), {}) is g  # positional, as _fused_dropout takes it
    assert aten.source_of((x,), {"device": "meta"}) == torch.device("meta")  # rand_like(x, device=)
    assert aten.source_of((x,), {}) == x.device
    assert aten.source_of(([3],), {}) == torch.device("cpu")


def test_replayed_draws_again_and_leaves_the_callers_stream() -> None:
    state = aten.capture((torch.device("cpu"),))
    first = torch.rand(4)
    with aten.replayed(state):
        assert torch.equal(torch.rand(4), first)
    assert not torch.equal(torch.rand(4), first)  # the caller's stream went on from after ``first``
    assert aten.state_nbytes(torch.device("cpu")) == state.tensors()[0].untyped_storage().nbytes()


def test_batch_norm_writes_its_statistics_without_its_schema_saying_so() -> None:
    facts = aten.facts(torch.ops.aten.native_batch_norm.default)
    assert not facts.writes and not facts.pure
    assert [name for _, name in facts.hidden_writes] == ["running_mean", "running_var"]
    args = (None, None, None, None, None, True)
    assert facts.all_writes(args) == facts.hidden_writes
    assert facts.all_writes((*args[:5], False)) == ()  # eval mode writes nothing
    assert aten.writes_hidden("aten.native_batch_norm.default")


def test_views_writes_and_metadata() -> None:
    view = aten.facts(torch.ops.aten.view.default)
    assert view.view_only and view.aliases[0] == (0, "self")
    add_ = aten.facts(torch.ops.aten.add_.Tensor)
    assert add_.writes == ((0, "self"),) and add_.written_returns == (True,) and not add_.view_only
    assert aten.facts(torch.ops.aten.mm.default).pure
    assert aten.facts(torch.ops.aten.bernoulli_.float).random
    assert aten.facts(torch.ops.aten.sym_size.int).metadata
    assert not aten.facts(torch.ops.aten.mm.default).metadata


def test_a_version_witness_of_a_lazy_conjugate_or_negative_view_holds_no_memory() -> None:
    """It shares the view's counter and none of its storage (``set_`` on a tensor with the conjugate
    bit resolved it into the old storage, which the witness then kept alive)."""
    base = torch.ones(64, 64, dtype=torch.complex64)
    for view in (base.conj(), torch._neg_view(base)):
        witness = aten.version_witness(view)
        assert witness.untyped_storage().nbytes() == 0
        assert witness._version == view._version
        base.add_(1)
        assert witness._version == view._version == base._version
