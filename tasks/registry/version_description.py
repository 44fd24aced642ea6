"""A model version's description in the registry (Markdown): what it takes, what it returns,
and how well, each figure labelled by where it comes from. Its own module: register.py is the
registering, this the text a person reads on the version's page."""

from __future__ import annotations

from models.directory import ONNX, ModelInfo
from tasks.data.transform import inference_steps
from tasks.inference.evaluate import SUMMARY_ROWS, TOP_K
from tasks.inference.score import LABEL_COLUMN, PROBABILITY_PREFIX
from tasks.registry.version_scores import Holdout
from tasks.shared.artifacts import for_people

IMAGE_COLUMN = "image"  # the pyfunc's input column (models/image_pyfunc.py)
MAX_DESCRIBED_CLASSES = 2000  # characters of class names in a version's description
DESCRIBED_METRICS = ("accuracy", "top5_accuracy", "f1_macro", "ece")  # of SUMMARY_ROWS


def describe_version(
    info: ModelInfo,
    name: str,
    version: int | str,
    validated: tuple[Holdout, dict[str, float]] | None = None,
) -> str:
    """The model version's description (Markdown): what it takes and returns, and how well.

    How well, labelled by where each figure comes from: ``validated``, the validation set and
    the metrics this ONNX model scored on it (what `imageops evaluate` of the version gives),
    and training's own validation (PyTorch, the kept epoch), which can differ by a few images.
    """
    steps = inference_steps(info.transform)
    side = steps["input_size"]
    classes = ", ".join(info.classes)
    if len(classes) > MAX_DESCRIBED_CLASSES:  # MLflow keeps up to 5000 characters
        shown = classes[:MAX_DESCRIBED_CLASSES].rsplit(", ", 1)[0]
        classes = f"{shown}, ... (all of them: `classes` in the MLmodel file)"
    metrics = _training_figures(info.metrics)
    if validated is None:
        metrics += (
            " This ONNX model was not scored at registration (`imageops register --val-data` "
            "scores it), so `imageops evaluate` of it may differ by a few images."
        )
    else:
        held, scores = validated
        k = min(TOP_K, len(info.classes))
        shown = ", ".join(
            f"{SUMMARY_ROWS[key].format(k=k)} {for_people(scores[key])}"
            for key in DESCRIBED_METRICS
            if key in scores
        )
        metrics = (
            f"**Metrics of this model** on the validation set `{held.path.name}` ({held.images} "
            "images), as `imageops score` and `imageops evaluate` of it compute them (ONNX "
            f"Runtime, float32): {shown}.\n\n{metrics}"
        )
    resize = f"resize shorter side to {steps['resize']}, " if steps["resize"] else ""
    return (
        f"Image classifier ({info.architecture.arch}), {len(info.classes)} classes: {classes}.\n\n"
        f"**Takes** a DataFrame with one column `{IMAGE_COLUMN}`, one image per row: the bytes "
        "of an image file (PNG, JPEG, BMP, PPM, TIFF, WebP; base64 in a REST request) or a "
        "decoded HxWx3 uint8 array, any size. The preprocessing is built in "
        f"({resize}center crop {steps['center_crop']}"
        + (f", pad {steps['padding']}" if steps["padding"] else "")
        + (", grayscale" if steps["grayscale"] else "")
        + f", normalise): the network sees {side}x{side} RGB.\n\n"
        f"**Returns** one row per image: `{PROBABILITY_PREFIX}<class>` per class (softmax) and "
        f"`{LABEL_COLUMN}`. A value that is not a readable image (or has float pixels) is "
        "refused with an error naming it.\n\n"
        f"{metrics}\n\n"
        f'```python\nmlflow.pyfunc.load_model("models:/{name}/{version}").predict(\n'
        f'    pd.DataFrame({{"{IMAGE_COLUMN}": [open("image.png", "rb").read()]}}))\n```\n\n'
        f"The raw network is `artifacts/{ONNX}` (float32 Nx3x{side}x{side} normalised input, "
        "logits out)."
    )


def _training_figures(metrics: dict[str, float]) -> str:
    """Training's own figures, validation and training apart, the kept epoch and the last: one
    list of ``final/train/loss, train/loss, val/loss`` under "validation" misled (issue 47)."""

    def figures(prefix: str) -> str:
        return ", ".join(
            f"{key} {for_people(value)}"  # the run's metric names, as MLflow shows them
            for key, value in sorted(metrics.items())
            if key.startswith(prefix) and (prefix or "/" not in key)
        )

    groups = [
        ("**Training's own validation** (PyTorch, the kept epoch): ", "val/"),
        ("Training, the kept epoch: ", "train/"),
        ("The last epoch's validation: ", "final/val/"),
        ("The last epoch's training: ", "final/train/"),
        ("Other: ", ""),  # a model.json of another shape: nothing left out
    ]
    shown = [f"{label}{text}." for label, prefix in groups if (text := figures(prefix))]
    return " ".join(shown) or "**Training's own validation** (PyTorch, the kept epoch): none."
