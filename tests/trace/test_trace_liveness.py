"""remat.trace.liveness: the live bytes of hand-made traces with no budget (see NOTE [liveness semantics])."""

from __future__ import annotations

from remat.trace import Op, Release, TensorInfo, Trace
from remat.trace.liveness import activation_peak_bytes, live_bytes, liveness, peak_bytes


def _trace(tensors: list[TensorInfo], events: list[Op | Release]) -> Trace:
    return Trace(tuple(tensors), tuple(events))


def test_constants_count_from_the_start_and_outputs_after_their_op() -> None:
    trace = _trace(
        [TensorInfo(0, 100, constant=True), TensorInfo(1, 10), TensorInfo(2, 20)],
        [Op(0, "a", (0,), (1,)), Op(1, "b", (1,), (2,)), Release(1), Op(2, "c", (2,), ()), Release(2)],
    )
    assert live_bytes(trace) == [(110, 10), (130, 30), (120, 20)]
    r = liveness(trace)
    assert (r.peak_bytes, r.activation_peak_bytes, r.constant_bytes, r.end_bytes, r.peak_op) == (
        130,
        30,
        100,
        100,
        1,
    )
    assert peak_bytes(trace) == trace.peak_bytes == 130
    assert activation_peak_bytes(trace) == trace.activation_peak_bytes == 30
    assert "peak 130 B" in str(r)


def test_an_alias_keeps_its_storage_until_every_handle_is_released() -> None:
    trace = _trace(
        [
            TensorInfo(0, 8, constant=True),
            TensorInfo(1, 64),
            TensorInfo(2, 0, alias_of=1),
            TensorInfo(3, 0, alias_of=2),
        ],
        [
            Op(0, "make", (0,), (1,)),
            Op(1, "view", (1,), (2,)),
            Release(1),  # the owner's handle goes, the view keeps the storage
            Op(2, "view", (2,), (3,)),  # an alias of an alias: same storage
            Release(2),
            Op(3, "read", (3,), ()),
            Release(3),
            Op(4, "after", (0,), ()),
        ],
    )
    assert [made for _, made in live_bytes(trace)] == [64, 64, 64, 64, 0]
    assert trace.liveness.end_bytes == 8


def test_a_released_constant_frees_its_bytes_but_not_the_activation_count() -> None:
    trace = _trace(
        [TensorInfo(0, 1000, constant=True), TensorInfo(1, 10)],
        [Release(0), Op(0, "make", (), (1,))],
    )
    assert live_bytes(trace) == [(10, 10)]
    assert trace.peak_bytes == 1000 and trace.activation_peak_bytes == 10


def test_an_empty_trace() -> None:
    trace = _trace([TensorInfo(0, 5, constant=True)], [])
    r = trace.liveness
    assert (r.peak_bytes, r.activation_peak_bytes, r.end_bytes, r.peak_op) == (5, 0, 5, -1)
