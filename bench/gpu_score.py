"""GPU scoring speed: ``imageops score`` (ONNX Runtime's CUDA provider) against torch eager on the
GPU in fp32 and fp16, end to end, decoding included (issue 30).

Usage: ``python -m bench.gpu_score [--json PATH] [--device cuda|cpu] [--quick]``

Without a CUDA GPU it prints why and exits; ``--device cpu --quick`` runs it end to end on the CPU
at toy sizes, to check the script, not to measure. Needs torch, torchvision, onnx, onnxscript,
onnxruntime (``onnxruntime-gpu`` for the CUDA provider; without it only the torch rows are
measured), pandas, pyarrow and the project's pure-Python dependencies: no Prefect, MLflow or DVC.

It writes photo-sized synthetic JPEGs (:func:`bench.gpu_train.make_image_directory`: 180 to 320 px
a side, 10 classes), saves a seeded, untrained resnet50 (10 classes, resize 256, center crop 224:
scoring speed does not depend on the weights) as a ModelDirectory and exports it
(:func:`tasks.inference.export.export_onnx`, parity-checked). Each round then scores every image
with each engine, one right after the other, so each per-round ratio compares runs seconds apart:

- **torch eager fp32 / fp16**: a plain loop, the way a user writes one: the ModelDirectory's model
  on the GPU under ``torch.inference_mode()`` (fp16: also ``torch.autocast``), the same image list,
  reader (``load_rgb``) and inference transform as ``score``, one image after another in the main
  thread, batch 64 copied from pinned memory, softmax and argmax on the GPU, no table written.
- **ONNX Runtime** (``tasks.inference.score.score`` as a user calls it: session start-up, its
  decoding threads and the CSV included), on the CUDA provider when this onnxruntime has it.

The engines alone (one decoded batch of 64 already in host memory, no decoding or table) are timed
in interleaved runs after a warm-up. The tables agree when ONNX Runtime's labels match torch fp32's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/gpu_score.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import Section, Stat, Table, no_cuda_here, run_main, usable_cores, versions

GOAL_VS_TORCH_FP32 = 1.5  # ONNX Runtime end to end against torch eager fp32: the goal
BATCH = 64  # score()'s default batch
ENGINES = ("torch eager fp32", "torch eager fp16", "ONNX Runtime (`score`)")


@dataclass(frozen=True)
class Plan:
    device: str
    arch: str
    images: int
    rounds: int
    alone_runs: int
    resize: int
    crop: int


GPU = Plan("cuda", "resnet50", images=2048, rounds=3, alone_runs=20, resize=256, crop=224)
CPU_QUICK = Plan("cpu", "resnet18", images=96, rounds=1, alone_runs=2, resize=73, crop=64)


def make_model(work: Path, plan: Plan) -> Path:
    """A seeded, untrained model saved as a ModelDirectory and exported to ONNX."""
    import torch

    from models.directory import ModelInfo, save_model_directory
    from models.transform_spec import TransformSpec
    from models.untrained import resnet
    from models.zoo import build_model
    from tasks.inference.export import export_onnx

    spec = resnet(plan.arch, pretrained=False)
    torch.manual_seed(0)
    transform = TransformSpec(
        resize=True, resize_size=plan.resize, center_crop=True, center_crop_size=plan.crop
    )
    info = ModelInfo(
        architecture=spec, classes=[f"class_{i}" for i in range(10)], transform=transform
    )
    model_dir = save_model_directory(work / "model", build_model(spec, 10), info)
    export_onnx(model_dir)
    return model_dir


def torch_eager(model_dir: Path, images: Path, device: str, half: bool) -> tuple[float, list[str]]:
    """(seconds, labels) of the plain torch loop over ``images``, decoding included."""
    import numpy as np
    import torch

    from models.directory import load_model_directory
    from tasks.data.imagedir import load_rgb
    from tasks.data.transform import build_transform
    from tasks.inference.score import list_images

    start = time.perf_counter()
    model, info = load_model_directory(model_dir)
    model = model.to(device).eval()
    transform = build_transform(info.transform, "inference")
    refs, _ = list_images(images)
    classes = np.asarray(info.classes, dtype=object)
    labels: list[str] = []
    pin = device == "cuda"
    with torch.inference_mode(), torch.autocast(device, dtype=torch.float16, enabled=half):
        for first in range(0, len(refs), BATCH):
            x = torch.stack([transform(load_rgb(r.file)) for r in refs[first : first + BATCH]])
            x = (x.pin_memory() if pin else x).to(device, non_blocking=True)
            best = torch.softmax(model(x).float(), dim=1).argmax(dim=1).cpu().numpy()
            labels += list(classes[best])
    return time.perf_counter() - start, labels


def onnx_runtime(model_dir: Path, images: Path, dest: Path) -> tuple[float, list[str]]:
    """(seconds, labels) of :func:`tasks.inference.score.score` as a user calls it."""
    import pandas as pd

    from tasks.inference.score import LABEL_COLUMN, score

    start = time.perf_counter()
    score(model_dir, images, dest, batch_size=BATCH)
    seconds = time.perf_counter() - start
    table = pd.read_csv(dest, dtype={LABEL_COLUMN: str})
    return seconds, list(table.sort_values("id")[LABEL_COLUMN])


def engines_alone(model_dir: Path, images: Path, plan: Plan) -> dict[str, list[float]]:
    """images/s of each engine on one decoded batch in host memory, interleaved runs."""
    import torch

    from models.directory import ONNX, load_model_directory
    from tasks.data.imagedir import load_rgb
    from tasks.data.transform import build_transform
    from tasks.inference.export import INPUT_NAME, OUTPUT_NAME
    from tasks.inference.score import inference_session, list_images

    model, info = load_model_directory(model_dir)
    model = model.to(plan.device).eval()
    transform = build_transform(info.transform, "inference")
    refs, _ = list_images(images)
    x = torch.stack([transform(load_rgb(ref.file)) for ref in refs[:BATCH]])
    session = inference_session(model_dir / ONNX)
    feed = {INPUT_NAME: x.numpy()}
    pinned = x.pin_memory() if plan.device == "cuda" else x

    def eager(half: bool) -> None:
        with torch.autocast(plan.device, dtype=torch.float16, enabled=half):
            model(pinned.to(plan.device, non_blocking=True)).float().cpu()

    calls = {
        ENGINES[0]: lambda: eager(False),
        ENGINES[1]: lambda: eager(True),
        ENGINES[2]: lambda: session.run([OUTPUT_NAME], feed),
    }
    rates: dict[str, list[float]] = {name: [] for name in ENGINES}
    with torch.inference_mode():
        for call in calls.values():  # warm-up: kernels, cuDNN's choices, ORT's allocations
            call()
            call()
        for _ in range(plan.alone_runs):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                rates[name].append(BATCH / (time.perf_counter() - start))
    return rates


def providers(model_dir: Path) -> list[str]:
    """The execution providers a scoring session runs on here, first choice first."""
    from models.directory import ONNX
    from tasks.inference.score import inference_session

    return list(inference_session(model_dir / ONNX).get_providers())


def run(plan: Plan, work: Path, command: str) -> Section:
    from bench.gpu_train import GPU as TRAIN_PLAN
    from bench.gpu_train import make_image_directory

    began = time.perf_counter()
    images = make_image_directory(work / "images", plan.images, 0, TRAIN_PLAN)
    print(f"wrote {plan.images:,} JPEGs in {time.perf_counter() - began:.1f} s", flush=True)
    began = time.perf_counter()
    model_dir = make_model(work, plan)
    print(f"saved and exported {plan.arch} in {time.perf_counter() - began:.1f} s", flush=True)
    used = providers(model_dir)
    print(f"scoring sessions run on {used}", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in ENGINES}
    ratios: dict[str, list[float]] = {name: [] for name in ENGINES}
    agree: list[float] = []
    torch_eager(model_dir, images, plan.device, half=False)  # untimed: CUDA's start, the caches
    for round_ in range(1, plan.rounds + 1):
        fp32, fp32_labels = torch_eager(model_dir, images, plan.device, half=False)
        fp16, _ = torch_eager(model_dir, images, plan.device, half=True)
        ours, labels = onnx_runtime(model_dir, images, work / "scored.csv")
        agree.append(sum(a == b for a, b in zip(labels, fp32_labels, strict=True)) / len(labels))
        for name, seconds in zip(ENGINES, (fp32, fp16, ours), strict=True):
            rates[name].append(plan.images / seconds)
            ratios[name].append(fp32 / seconds)
        print(
            f"round {round_}: "
            + ", ".join(f"{n} {rates[n][-1]:,.0f} images/s" for n in ENGINES)
            + f"; labels agree {agree[-1]:.2%}",
            flush=True,
        )
    alone = engines_alone(model_dir, images, plan)
    for name in ENGINES:
        print(f"alone: {name} {statistics.median(alone[name]):,.0f} images/s", flush=True)
    return report(plan, used, rates, ratios, alone, agree, command)


def report(
    plan: Plan,
    used: list[str],
    rates: dict[str, list[float]],
    ratios: dict[str, list[float]],
    alone: dict[str, list[float]],
    agree: list[float],
    command: str,
) -> Section:
    import torch

    found = versions(("torch", "torchvision", "onnxruntime", "onnxruntime-gpu", "Pillow", "numpy"))
    soft = ", ".join(f"{k} {v}" for k, v in found.items())
    gpu = (
        f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
        if plan.device == "cuda"
        else "no GPU: --device cpu, toy sizes (checks the script, measures nothing)"
    )
    on_cuda = used[:1] == ["CUDAExecutionProvider"]
    rows = [
        [
            name,
            Stat(rates[name], "images/s"),
            Stat(ratios[name], "x"),
            Stat(alone[name], "images/s"),
        ]
        for name in ENGINES
    ]
    ours = statistics.median(ratios[ENGINES[2]])
    met = "met" if ours >= GOAL_VS_TORCH_FP32 and on_cuda else "not met"
    goals = [
        [
            "ONNX Runtime (`score`, CUDA provider) / torch eager fp32, end to end",
            f">= {GOAL_VS_TORCH_FP32:.1f}x",
            f"{ours:.2f}x" + ("" if on_cuda else f" (on {used[0]}: no CUDA provider here)"),
            met,
        ],
        ["ONNX Runtime's labels = torch eager fp32's", "100%", f"{min(agree):.2%}", ""],
    ]
    text = [
        f"Device: {gpu}, {usable_cores()} usable cores; {soft}. {plan.arch} (10 classes, seeded, "
        f"untrained), resize {plan.resize}, center crop {plan.crop}; {plan.images:,} synthetic "
        f"JPEGs (180 to 320 px a side); batch {BATCH}. Scoring sessions ran on {used}.",
        f"End to end: {plan.rounds} rounds, each engine scoring every image once per round, one "
        "right after the other, after an untimed torch pass; ratios are per round against torch "
        "eager fp32. torch eager is a plain loop (one image after another in the main thread, "
        "pinned batches); `score` decodes in a thread per core while ONNX Runtime runs the "
        f"previous batch. The engines alone: one decoded batch, {plan.alone_runs} interleaved "
        "runs after a warm-up, host memory in and out.",
    ]
    tables = [
        Table(
            ["engine", "images/s end to end", "vs torch eager fp32", "engine alone"],
            rows,
            "Scoring on the GPU",
        ),
        Table(["goal (issue 30)", "wanted", "measured", ""], goals, "Goals"),
    ]
    return Section(
        key="gpu_score", title="GPU scoring speed", command=command, text=text, tables=tables
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="toy sizes (with --device cpu)")
    args, rest = parser.parse_known_args(argv)
    if args.device == "cuda" and no_cuda_here("gpu_score"):
        return 0
    elif not args.quick:
        raise SystemExit("--device cpu runs the toy sizes only: add --quick")
    plan = GPU if args.device == "cuda" else CPU_QUICK
    command = "python -m bench.gpu_score" + (" --device cpu --quick" if args.quick else "")
    return run_main(lambda _full, work: run(plan, work, command), __doc__.split("\n\n")[0], rest)


if __name__ == "__main__":
    sys.exit(main())
