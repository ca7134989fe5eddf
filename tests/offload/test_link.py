"""The link model: parsing, transfer times, and errors."""

import pytest
import torch

import remat


def test_a_link_parses_rates_and_latency_and_charges_latency_plus_bytes_over_bandwidth() -> None:
    link = remat.Link(d2h="25GB/s", h2d="12.5 GB/s", latency="10us")
    assert link.d2h == 25e9 and link.h2d == 12.5e9 and link.latency == pytest.approx(1e-5)
    assert link.d2h_seconds(25 * 10**9) == pytest.approx(1.0 + 1e-5)
    assert link.h2d_seconds(25 * 10**9) == pytest.approx(2.0 + 1e-5)
    assert remat.Link() == remat.Link(d2h=25e9, h2d=25e9, latency=10e-6)
    assert "GiB/s" in str(link)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d2h": "fast"}, r"remat\.Link: cannot parse this rate \(got 'fast'\)"),
        ({"h2d": 0}, r"remat\.Link: a rate must be positive"),
        ({"d2h": "-1GB/s"}, r"remat\.Link: .*positive"),
        ({"latency": "soon"}, r"remat\.Link: cannot parse this duration"),
        ({"latency": -1.0}, r"remat\.Link: a duration must be at least 0"),
        ({"latency": "1e400"}, r"remat\.Link: a duration must be at least 0 and finite \(got '1e400'\)"),
        ({"latency": "-1us"}, r"remat\.Link: a duration must be at least 0 and finite \(got '-1us'\)"),
        ({"d2h": "0GB/s"}, r"remat\.Link: a rate must be positive and finite \(got '0GB/s'\)"),
    ],
)
def test_a_bad_link_gets_a_clear_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        remat.Link(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_measuring_a_link_without_a_gpu_says_what_to_do_instead() -> None:
    with pytest.raises(
        remat.RematRuntimeError, match=r"remat\.Link\.measure: measuring a link needs a CUDA device"
    ):
        remat.Link.measure()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_measured_link_has_positive_rates() -> None:
    link = remat.Link.measure(nbytes="16MiB", repeats=3)
    assert link.d2h > 1e8 and link.h2d > 1e8 and link.latency >= 0


def test_numpy_numbers_are_numbers() -> None:
    """A rate, a latency and a prefetch depth from numpy (a config read with it) were refused."""
    import numpy as np

    link = remat.Link(d2h=np.int64(5), h2d=np.float32(2.0), latency=np.float64(0.0))
    assert (link.d2h, link.h2d, link.latency) == (5.0, 2.0, 0.0)
    assert remat.Offloader(prefetch=np.int64(3)).prefetch == 3  # type: ignore[arg-type]
