"""Hardware ceiling: the machine's matrix-multiply throughput in float32 and bfloat16.

Usage: ``python -m bench.ceiling [--full] [--json PATH]``

A square ``torch.matmul`` is about the best case for this machine's math units (oneDNN/BLAS on CPU,
cuBLAS on GPU): nothing a network does runs faster per FLOP. The runner puts the training and
scoring FLOP/s of the other benchmarks next to it as a percentage, so the headroom left is visible.
Each sample is the best single matmul over a short window; the window is repeated and the table
shows the median of those windows with their range.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/ceiling.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import Section, Stat, Table, run_main

PRECISIONS = ("fp32", "bf16")


def matmul_peak(precision: str, n: int, seconds: float) -> float:
    """Best FLOP/s of an ``n`` x ``n`` x ``n`` ``torch.matmul`` over about ``seconds``."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    for _ in range(2):  # first calls pick and build the kernels
        torch.matmul(a, b)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def forward_flops(arch: str, size: int, classes: int = 10) -> int:
    """FLOPs of one forward pass of torchvision's ``arch`` on one ``size`` x ``size`` image.

    What the other benchmarks multiply their images/s by to set them against the matmul peak.
    """
    import torch
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    model = torchvision.models.get_model(arch, num_classes=classes).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.zeros(1, 3, size, size))
    return counter.get_total_flops()


def run(full: bool, work: Path) -> Section:
    import torch

    n, windows, seconds = (4096, 5, 3.0) if full else (2048, 3, 1.5)
    peaks: dict[str, list[float]] = {name: [] for name in PRECISIONS}
    for _ in range(windows):  # alternating, so a busy spell touches both precisions
        for name in PRECISIONS:
            peaks[name].append(matmul_peak(name, n, seconds) / 1e9)
    stats = {name: Stat(values, "GFLOP/s") for name, values in peaks.items()}
    ratio = Stat([b / f for f, b in zip(peaks["fp32"], peaks["bf16"], strict=True)], "x")
    return Section(
        key="ceiling",
        title="Hardware ceiling: matrix-multiply throughput",
        command=f"python -m bench.ceiling{' --full' if full else ''}",
        text=[
            f"Square {n}x{n} `torch.matmul`, {torch.get_num_threads()} threads; each sample is "
            f"the fastest call in a {seconds:g} s window, {windows} windows per precision, "
            "alternating."
        ],
        tables=[
            Table(
                ["precision", "matmul throughput", "vs fp32 (same window)"],
                [["fp32", stats["fp32"], "1.00x"], ["bf16", stats["bf16"], ratio]],
            )
        ],
        figures={
            f"peak/{name}": Stat([v * 1e9 for v in values], "FLOP/s")
            for name, values in peaks.items()
        },
    )


if __name__ == "__main__":
    sys.exit(run_main(run, __doc__.split("\n\n")[0]))
