"""remat.memory: counted live bytes and budget parsing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import remat
from remat.memory import format_bytes, parse_budget, parse_bytes
from remat.pipeline.schedule import build


def test_counts_each_storage_once_until_it_dies() -> None:
    with remat.memory.track() as m:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        v = a.view(10, 100)  # a view counts nothing
        a.add_(1)  # in place counts nothing
        assert m.current_bytes == 4000
        b = torch.empty(250, dtype=torch.float64)  # 2000 bytes
        assert m.current_bytes == 6000
        del a
        assert m.current_bytes == 6000, "the view still holds the storage"
        del v
        assert m.current_bytes == 2000
        del b
    assert m.current_bytes == 0
    assert m.peak_bytes == 6000
    assert [s.bytes for s in m.timeline][:2] == [4000, 4000]


def test_pre_existing_tensors_are_not_counted() -> None:
    x = torch.ones(100)
    with remat.memory.track() as m:
        y = x * 2
        del x
    assert m.peak_bytes == 400
    assert y.shape == (100,)


def test_saved_tensors_counted_until_backward_frees_them() -> None:
    x = torch.randn(256, requires_grad=True)
    with remat.memory.track() as m:
        y = x.exp()  # exp saves its output
        z = y.sum()
        del y
        assert m.current_bytes == 1024 + 4, "autograd still holds exp's output; z is 4 bytes"
        z.backward()
        del z
    assert m.current_bytes == 1024, "what is left is x.grad"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GB", 2 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("100", 100),
        ("64kb", 64_000),
        ("3K", 3072),
        (4096, 4096),
    ],
)
def test_parse_bytes(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["two GB", "5 parsecs", "", "-3GB", "0", "1e-9", "1e9 parsecs", "1.5B"])
def test_parse_bytes_rejects_unparsable(bad: str) -> None:
    with pytest.raises(remat.RematValueError, match=r"remat\.memory\.parse_bytes: "):
        parse_bytes(bad)


def test_parse_bytes_rejects_ratios_and_wrong_types() -> None:
    with pytest.raises(remat.RematTypeError, match=r"a byte count is required, not a ratio .*got 0\.5"):
        parse_bytes(0.5)
    with pytest.raises(remat.RematTypeError, match=r"must be an int or a string \(got list\)"):
        parse_bytes([1])
    with pytest.raises(remat.RematValueError, match=r"must be positive \(got -1\)"):
        parse_bytes(-1)


def test_numpy_whole_numbers_are_byte_counts_and_counts() -> None:
    """A budget or a count computed with NumPy (``np.int64``) is a whole number like an int; NumPy's
    floats stay ratios and bools stay refused."""
    assert parse_bytes(np.int64(4096)) == 4096
    assert type(parse_bytes(np.uint16(100))) is int
    assert parse_budget(np.int32(2**20)) == 2**20
    assert parse_budget(np.float64(0.5)) == 0.5
    with pytest.raises(remat.RematValueError, match=r"must be positive \(got -3\)"):
        parse_bytes(np.int64(-3))
    with pytest.raises(remat.RematTypeError, match=r"not a ratio or a bool \(got True\)"):
        parse_bytes(True)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    torch.testing.assert_close(remat.checkpoint_sequential(layers, np.int64(2), x), layers(x), rtol=0, atol=0)
    schedule = build("1f1b", np.int64(2), np.int64(4))
    assert (schedule.n_ranks, schedule.n_microbatches) == (2, 4) and type(schedule.n_ranks) is int
    with remat.dynamic(budget=np.int64(10**8)) as region:
        layers(x).sum().backward()
    assert region.stats.ops > 0


def test_parse_budget_accepts_ratio_or_bytes() -> None:
    assert parse_budget(0.25) == 0.25
    assert parse_budget("1MiB") == 2**20
    with pytest.raises(
        remat.RematValueError, match=r"remat\.memory\.parse_budget: a ratio budget must lie in \(0, 1\]"
    ):
        parse_budget(1.5)


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(12) == "12 B"
    # rounding carries into the next unit, and terabytes have theirs (1024.00 KiB, 1048576.00 GiB,
    # and 1023.9 cut to 1023 B, before)
    assert [format_bytes(n) for n in (2**20 - 1, 2**40, 1023.9, 1023.4, -2048)] == [
        "1.00 MiB",
        "1.00 TiB",
        "1.00 KiB",
        "1023 B",
        "-2.00 KiB",
    ]


@pytest.mark.parametrize(
    ("device", "rule"),
    [
        ("meta", r"the device must be a CPU or a CUDA device \('meta'\)"),
        ("CPU", r"unknown device \('CPU'\)"),
        (None, r"device must be a torch\.device or its name \(None\)"),
        (0, r"device must be a torch\.device or its name \(0\)"),
    ],
)
def test_track_rejects_a_device_it_cannot_measure(device: object, rule: str) -> None:
    """``"CPU"``, ``None`` or ``0`` raised torch's own errors."""
    error = remat.RematTypeError if device in (None, 0) else remat.RematValueError
    with pytest.raises(error, match=r"remat\.memory\.track: " + rule), remat.memory.track(device):  # type: ignore[arg-type]
        pass


def test_track_counts_on_cpu_named_with_its_index() -> None:
    """``"cpu:0"`` counted nothing: tensors say ``cpu``."""
    with remat.memory.track("cpu:0") as m:
        x = torch.zeros(1000)
    assert m.peak_bytes == 4000
    del x


@pytest.mark.parametrize("allocator", [False, True])
def test_track_keeps_its_figures_when_the_block_raises(allocator: bool) -> None:
    """With ``allocator=True`` a block that raised left every figure at 0."""
    with pytest.raises(KeyError), remat.memory.track(allocator=allocator) as m:
        x = torch.zeros(1000)
        raise KeyError
    assert m.peak_bytes == 4000
    del x


def test_a_track_inside_another_says_so() -> None:
    """It said a torch.profiler session was running, where the profiler was the outer track's."""
    with (
        remat.memory.track(allocator=True),
        pytest.raises(
            remat.RematRuntimeError, match=r"another remat\.memory\.track\(allocator=True\) is measuring"
        ),
    ):
        remat.memory.track(allocator=True).__enter__()


@pytest.mark.cuda
def test_cuda_uses_allocator_statistics(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("needs CUDA")
    with remat.memory.track(device) as m:
        a = torch.empty(2**20, device=device)
        del a
    assert m.peak_bytes >= 4 * 2**20


def test_allocator_counts_what_no_dispatch_mode_sees() -> None:
    # torch.get_rng_state allocates its tensor without an ATen op: the allocator sees it.
    with remat.memory.track(allocator=True) as allocator, remat.memory.track() as tensors:
        state = torch.get_rng_state()
        y = torch.ones(100)
    assert tensors.peak_bytes == 400
    assert allocator.peak_bytes == allocator.current_bytes == 400 + state.untyped_storage().nbytes()
    del y


def test_allocator_refuses_to_start_inside_another_profiler() -> None:
    track = remat.memory.track(allocator=True)
    with (
        torch.profiler.profile(),
        pytest.raises(remat.RematRuntimeError, match=r"remat\.memory\.track: allocator=True"),
    ):
        track.__enter__()


def test_allocator_tracking_runs_compiled_code_as_compiled() -> None:
    # Dynamo runs no compiled code under a dispatch mode, so allocator=True keeps no timeline by
    # default: the compiled graph runs, and its allocations are counted.
    graphs_run: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        def run(*args: torch.Tensor) -> object:
            graphs_run.append(1)
            return gm(*args)

        return run

    f = torch.compile(lambda x: (x * 2).sin(), backend=backend)
    x = torch.randn(100)
    f(x)
    with remat.memory.track(allocator=True) as m:
        y = f(x)
    assert len(graphs_run) == 2
    assert (m.ops, m.timeline) == (0, [])
    assert (m.peak_bytes, m.current_bytes) == (800, 400), "x * 2 and its sine, then the sine alone"
    with remat.memory.track(allocator=True, timeline=True) as m:
        y = f(x)
    assert m.ops == len(m.timeline) > 0
    assert m.peak_bytes == 800
    del y


@pytest.mark.parametrize("grow", ["out=", "resize_"])
def test_a_storage_grown_in_place_is_counted(grow: str) -> None:
    """``out=`` into an empty tensor and ``resize_`` grow a storage the counter had seen at 0 bytes
    (or not at all): it counted nothing where the allocator counts 4 MB."""
    a = torch.randn(1000, 1000)
    with remat.memory.track() as counted:
        if grow == "out=":
            torch.add(a, 1, out=torch.empty(0))
        else:
            torch.empty(0).resize_(1000, 1000)
    assert counted.peak_bytes == 1000 * 1000 * 4
