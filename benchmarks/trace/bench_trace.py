"""Trace benchmarks: paper-size fake-tensor traces against analytic memory estimates, and the cost
model's ranking of ops against measured CPU times. See README.md in this folder for the results.

    python benchmarks/trace/bench_trace.py fake   # BERT-Large 16x512 and ResNet-50 64x224², fake tensors
    python benchmarks/trace/bench_trace.py fake --all  # and the rest of the zoo at paper size
    python benchmarks/trace/bench_trace.py cost   # Spearman rank correlation, cost model vs measured
"""

from __future__ import annotations

import argparse
import platform
import resource
import time
from pathlib import Path
from typing import Any

import scipy.stats
import torch

from remat import zoo
from remat._units import format_bytes
from remat.trace import Phase, Trace, capture, cost, load
from remat.trace.liveness import live_bytes

GiB = 2**30


def forward_end_bytes(trace: Trace) -> int:
    """Activation bytes live after the last forward op: what the forward pass stored."""
    last = max(op.index for op in trace.ops if op.phase is Phase.FORWARD)
    return live_bytes(trace)[last][1]


def resnet50_stored(batch: int, image: int) -> int:
    """Bytes a ResNet-50 forward keeps for backward (fp32), counted from the architecture: each
    convolution's output (batch norm saves its input), each batch norm's output that a ReLU and
    the next convolution keep, each residual sum (ReLU in place), the stem's max-pool output and
    its int64 indices. Batch-norm statistics and the classifier are negligible."""
    side = image // 2
    stem = 2 * 64 * side * side  # conv out, bn out
    side //= 2
    floats = stem + 64 * side * side * (1 + 2)  # max-pool output + int64 indices (2 floats each)
    for stage, blocks in enumerate((3, 4, 6, 3)):
        width = 64 * 2**stage
        for b in range(blocks):
            out_side = side // 2 if stage > 0 and b == 0 else side
            floats += 2 * width * side * side  # conv1 out, bn1/relu out (at the input resolution)
            floats += 2 * width * out_side * out_side  # conv2 out, bn2/relu out
            floats += 2 * 4 * width * out_side * out_side  # conv3 out, residual sum
            if b == 0:
                floats += 4 * width * out_side * out_side  # downsample conv out
            side = out_side
    return 4 * batch * floats


def bert_large_stored(batch: int, seq: int) -> int:
    """Bytes a BERT-Large MLM forward keeps (fp32, PyTorch eager on CPU: the math attention path,
    fp32 dropout masks). Per layer, in units of s·b·h floats: Q, K, V and the attention context
    (4), two dropout masks, two residual sums and two LayerNorm outputs (6), the MLP's pre- and
    post-GELU (4 + 4); in units of a·s²·b floats: softmax output, dropout mask, dropped
    probabilities (3). So 18·sbh + 3·as²b floats (Korthikanti et al. count 34·sbh + 5·as²b bytes
    for fp16 with 1-byte masks). Plus embeddings (3·sbh) and the MLM head (3·sbh, and the logits
    and their log-softmax: 2·s·b·V)."""
    s, b, h, a, layers, vocab = seq, batch, 1024, 16, 24, 30522
    per_layer = 18 * s * b * h + 3 * a * s * s * b
    return 4 * (layers * per_layer + 6 * s * b * h + 2 * s * b * vocab)


def bert_large_korthikanti(batch: int, seq: int) -> int:
    """The textbook count (Korthikanti et al., 2022: 34·sbh + 5·as²b bytes per layer in fp16 with
    1-byte dropout masks) moved to fp32 activations: 66·sbh + 9·as²b bytes, same head and
    embeddings as ``bert_large_stored``."""
    s, b, h, a, layers, vocab = seq, batch, 1024, 16, 24, 30522
    return layers * (66 * s * b * h + 9 * a * s * s * b) + 4 * (6 * s * b * h + 2 * s * b * vocab)


def run_fake(everything: bool) -> None:
    cases: list[tuple[str, dict[str, Any], int | None]] = [
        ("bert-large", {"batch": 16, "seq": 512}, bert_large_stored(16, 512)),
        ("resnet50", {"batch": 64, "image": 224}, resnet50_stored(64, 224)),
    ]
    if everything:  # the rest of the zoo at its default (paper) size, without an analytic figure
        cases += [
            (name, {"batch": zoo.get(name).batch, zoo.get(name).input: zoo.get(name).size}, None)
            for name in zoo.names()
            if name not in ("bert-large", "resnet50")
        ]
    print(
        "| model | size | ops | tensors | build + capture s | forward stored | analytic | ratio "
        "| activation peak | peak with constants | est. step on A100 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, size, analytic in cases:
        start = time.perf_counter()
        model, inputs, loss_fn = zoo.build(name, fake=True, **size)
        trace = capture(model, inputs, loss_fn, name=name, device="a100")
        seconds = time.perf_counter() - start
        stored = forward_end_bytes(trace)
        sizes = " ".join(f"{k} {v}" for k, v in size.items())
        print(
            f"| {name} | {sizes} | {len(trace.ops):,} | {len(trace.tensors):,} | {seconds:.1f} "
            f"| {format_bytes(stored)} | {format_bytes(analytic) if analytic else '-'} "
            f"| {f'{stored / analytic:.4f}' if analytic else '-'} "
            f"| {format_bytes(trace.activation_peak_bytes)} | {format_bytes(trace.peak_bytes)} "
            f"| {trace.total_est_cost * 1e3:.0f} ms |"
        )
    textbook = bert_large_korthikanti(16, 512)
    print(f"\nBERT-Large, textbook count with 1-byte masks: {format_bytes(textbook)}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\nmax RSS of this process: {rss:.2f} GiB")


# Full architectures at a batch small enough for one CPU core.
COST_SIZES: dict[str, dict[str, Any]] = {
    "bert": {"batch": 2, "seq": 128},
    "bert-large": {"batch": 1, "seq": 128},
    "bilstm": {"batch": 16, "seq": 32},
    "densenet121": {"batch": 2, "image": 224},
    "gpt2": {"batch": 2, "seq": 128},
    "resnet50": {"batch": 2, "image": 224},
    "unet": {"batch": 1, "image": 128},
    "vit": {"batch": 2, "image": 224},
}


def spearman(x: list[float], y: list[float]) -> float:
    return float(scipy.stats.spearmanr(x, y).statistic)


def run_cost(repeats: int) -> None:
    calibrated = cost.calibrate("cpu")
    print(f"calibrated: {calibrated}; preset: {cost.PROFILES['cpu']}\n")
    print(
        "| model | size | ops | measured step s | ρ preset cpu | ρ calibrated | ρ ops that allocate "
        "| est/measured total (calibrated) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, size in COST_SIZES.items():
        model, inputs, loss_fn = zoo.build(name, **size)
        capture(model, inputs, loss_fn, repeats=1)  # warm-up: first calls of oneDNN kernels are slow
        trace = capture(model, inputs, loss_fn, name=name, repeats=repeats, device="cpu")
        again = cost.estimate(trace, calibrated)
        measured = [op.cost for op in trace.ops]
        allocating = [op for op in again.ops if any(trace.tensors[t].alias_of is None for t in op.outputs)]
        sizes = " ".join(f"{k} {v}" for k, v in size.items())
        print(
            f"| {name} | {sizes} | {len(trace.ops):,} | {trace.total_cost:.2f} "
            f"| {spearman(measured, [op.est_cost for op in trace.ops]):.3f} "
            f"| {spearman(measured, [op.est_cost for op in again.ops]):.3f} "
            f"| {spearman([op.cost for op in allocating], [op.est_cost for op in allocating]):.3f} "
            f"| {again.total_est_cost / trace.total_cost:.2f} |"
        )
    print("\nDTR logs (Titan V times; no shapes, so priced by bytes only, preset titan-v):\n")
    print("| log | ops | ρ |")
    print("|---|---|---|")
    for log in ("resnet32-56", "transformer-10", "lstm-128"):
        try:
            trace = cost.estimate(
                load(Path(__file__).resolve().parents[2] / "data" / "dtr" / f"{log}.log"), "titan-v"
            )
        except Exception as err:  # the importer may not be in this checkout yet
            print(f"| {log} | - | not loaded: {err} |")
            continue
        rho = spearman([o.cost for o in trace.ops], [o.est_cost for o in trace.ops])
        print(f"| {log} | {len(trace.ops):,} | {rho:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["fake", "cost"])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per op for 'cost'")
    parser.add_argument("--all", action="store_true", help="'fake': also the rest of the zoo at paper size")
    args = parser.parse_args()
    torch.set_num_threads(1)  # op times on one core: the machine is shared, and ranks are what we compare
    machine = platform.processor() or platform.machine()
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {machine}, {threads} threads\n")
    if args.what == "fake":
        run_fake(args.all)
    else:
        run_cost(args.repeats)


if __name__ == "__main__":
    main()
