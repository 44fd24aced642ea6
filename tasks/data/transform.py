"""Init / Apply Image Transformation, and the one place an image becomes the network's input.

Init saves a TransformSpec (``transform.json``); Apply runs it over an ImageDirectory. Training,
export and scoring build their transforms here too, from the ModelDirectory's spec, so scoring
cannot drift from training. Two modes, as in the Azure component: inference (deterministic steps)
and training (random steps too). No Prefect import: torchrun workers import this module.
Details: docs/images.md#transforms.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from models.atomic import atomic_directory, check_destination, write_json
from models.bounded_parse import parse_json, shown
from models.transform_spec import MODES, RECIPE_FIELDS, AppliedTransform, Mode, TransformSpec
from tasks.data.datasets import holding_folders
from tasks.data.imagedir import (
    MANIFEST,
    ImageEntry,
    ImageRefused,
    SkippedFile,
    SkipReason,
    load_rgb,
    recorded_source,
)
from tasks.data.manifest_stream import ManifestWriter, StreamedManifest, iter_images, read_head
from tasks.shared.errors import (
    InvalidParameterError,
    InvalidTransformationDirectoryError,
    NoUsableImagesError,
)
from tasks.shared.step import step, tasks_on_first_use
from tasks.shared.validation import checked, describe

if TYPE_CHECKING:  # torch and torchvision take seconds to import: only building a pipeline does
    from torchvision.transforms import v2

TRANSFORM_JSON = "transform.json"
FORMAT = "imageops.TransformationDirectory"
FORMAT_VERSION = 1
# Strengths of the random steps Azure only switches on or off (torchvision's usual values).
COLOR_JITTER = 0.4
RANDOM_GRAYSCALE_P = 0.1
PERSPECTIVE_DISTORTION = 0.5
ERASING_P = 0.5  # random erasing's probability where the spec leaves it empty (torchvision's)

_HINT = "Create one with `imageops transform init DEST` (Init Image Transformation)."


def transform_spec(**values: Any) -> TransformSpec:
    """A spec from option values; a bad one raises InvalidParameterError naming value and range."""
    return checked(TransformSpec, values, "image transformation option")


def init_transformation(dest: Path, spec: TransformSpec | Mapping[str, Any] | None = None) -> Path:
    """Init Image Transformation: write ``spec`` (default: Azure's) to ``dest/transform.json``.

    ``dest`` is written atomically and replaced whole. Returns ``dest``. Raises
    InvalidParameterError for a value out of range.
    """
    if not isinstance(spec, TransformSpec):
        spec = transform_spec(**dict(spec or {}))
    with atomic_directory(Path(dest), replaces=TRANSFORM_JSON) as tmp:
        write_json(
            tmp / TRANSFORM_JSON,
            {"format": FORMAT, "format_version": FORMAT_VERSION, "transform": spec.model_dump()},
        )
    return Path(dest)


def read_transformation(path: Path) -> TransformSpec:
    """The spec in the TransformationDirectory ``path``.

    Raises InvalidTransformationDirectoryError when ``path`` has no ``transform.json``, when the
    file is not one Init Image Transformation wrote, or when a value in it is out of range.
    """
    path = Path(path)
    file = path / TRANSFORM_JSON
    if not file.is_file():
        raise InvalidTransformationDirectoryError(
            f"{path} is not a transformation directory: {TRANSFORM_JSON} is missing.", _HINT
        )
    try:
        data = parse_json(file.read_bytes())
    except (OSError, ValueError) as exc:  # not UTF-8, not JSON, nested too deep
        raise InvalidTransformationDirectoryError(
            f"{file} is not readable JSON: {exc}.", _HINT
        ) from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT or "transform" not in data:
        raise InvalidTransformationDirectoryError(
            f"{file} is not a transform spec (expected format {FORMAT!r}).", _HINT
        )
    version = data.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise InvalidTransformationDirectoryError(
            f"{file} has format version {shown(version)}; this imageops reads up to "
            f"{FORMAT_VERSION}.",
            "Write it again with `imageops transform init` of this imageops, or upgrade imageops.",
        )
    try:
        return TransformSpec.model_validate(data["transform"])
    except ValidationError as exc:
        message, hint = describe(TransformSpec, exc)
        raise InvalidTransformationDirectoryError(
            f"{file} holds an invalid transform spec: {message}.", f"{hint} {_HINT}"
        ) from exc


def crop_size(spec: TransformSpec) -> int:
    """The side of the crop training ends with: it decides the network's input size.

    The random crop, else the random resized crop, else the center crop, else (resize only) the
    centered square of the resized image. Raises InvalidTransformationDirectoryError when
    resize and every crop are off: images of different sizes would reach the network.
    """
    crop = spec.crop_side()
    if crop is None:
        raise InvalidTransformationDirectoryError(
            "resize, center crop, random crop and random resized crop are all off: images of "
            "different sizes would reach the network, which needs one input size.",
            "Turn center crop on (its size becomes the network's input size), or resize.",
        )
    return crop


def input_size(spec: TransformSpec) -> int:
    """The side of the square image the network sees, the same in training and inference.

    Training decides it (:func:`crop_size`), plus twice the padding when pad is on; inference
    resizes and center-crops to the same size (:func:`inference_resize`).
    """
    crop_size(spec)  # refuses a spec without a crop
    side = spec.input_side()
    assert side is not None
    return side


def inference_resize(spec: TransformSpec) -> int | None:
    """The shorter side inference resizes to before its center crop (None: resize is off).

    When training crops at another size than the center crop (Azure's random resized crop 256
    switched on with the center crop 224 of a 256 resize), inference keeps the center crop's
    share of the resized image, as torchvision's recipes (224 of 256) and timm's ``crop_pct``
    do, and crops at the training size: 256 of a 293 resize. At one size (the modern recipe's
    random resized crop takes the center crop's), inference is the resize and the center crop.
    """
    if not spec.resize:
        return None
    crop = spec.crop_side()
    if spec.center_crop and crop is not None and spec.center_crop_size != crop:
        return max(1, round(spec.resize_size * crop / spec.center_crop_size))
    return spec.resize_size


def inference_steps(spec: TransformSpec) -> dict[str, Any]:
    """The inference transform of ``spec`` as plain values, in the order :func:`build_transform`
    runs them: ``resize`` (shorter side, or None), ``center_crop``, ``padding``, ``grayscale``,
    ``mean`` and ``std``, and the ``input_size`` they make.

    For code that runs the transform without torchvision or imageops: the registered MLflow
    model (models/image_pyfunc.py) carries them in its MLmodel file.
    """
    return {
        "resize": inference_resize(spec),
        "center_crop": crop_size(spec),
        "padding": spec.padding if spec.pad else 0,
        "grayscale": spec.grayscale,
        "mean": list(spec.mean),
        "std": list(spec.std),
        "input_size": input_size(spec),
    }


def build_transform(
    spec: TransformSpec,
    mode: Mode,
    *,
    normalize: bool = True,
    prepared: Mode | None = None,
) -> v2.Compose:
    """The torchvision v2 pipeline of ``spec`` in ``mode``: PIL image in, tensor out.

    ``normalize``: a float tensor normalised by the spec's mean and std, for the network; without
    it, a uint8 tensor that can be saved as a picture. ``prepared``: the mode Apply Image
    Transformation already ran on the images, whose steps are not run again. Raises
    InvalidParameterError for an unknown mode. Details: docs/images.md#transforms.
    """
    import torch
    from torchvision.transforms import v2

    if mode not in MODES:
        raise InvalidParameterError(
            f"mode = {mode!r}, expected one of {', '.join(MODES)}.",
            "Use inference (deterministic steps only) or training (the random steps too).",
        )
    training = mode == "training" and prepared != "training"
    steps: list[v2.Transform] = [v2.ToImage()]
    if prepared is None:
        steps += _geometry(spec, training)
    elif training and spec.random_resized_crop:
        steps.append(v2.RandomResizedCrop(input_size(spec), scale=_rrc_scale(spec), antialias=True))
    if training and spec.color_jitter:
        steps.append(v2.ColorJitter(COLOR_JITTER, COLOR_JITTER, COLOR_JITTER))
    if spec.grayscale and prepared is None:
        steps.append(v2.Grayscale(num_output_channels=3))  # the network takes 3 channels
    if training:
        steps += _random_steps(spec)
        steps += _policy(spec)  # on the uint8 image, as torchvision's policies expect
    if normalize:
        steps += [
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(spec.mean), std=list(spec.std)),
        ]
    if training and spec.random_erasing:  # on the tensor: erased pixels become 0 (the mean)
        p = spec.random_erasing_probability
        steps.append(v2.RandomErasing(p=ERASING_P if p is None else p))
    return v2.Compose(steps)


def per_batch_steps(transform: v2.Compose) -> tuple[v2.Compose, v2.Compose]:
    """(the steps each image needs, the steps run once on the stacked batch) of ``transform``.

    Its closing ToDtype and Normalize do the same to every pixel whatever the image: on a batch
    of 64 they cost one call instead of 64, and a reader decodes at 64 px in 0.47 ms of CPU an
    image instead of 0.76 (issue 45), with the same numbers to the bit.
    """
    from torchvision.transforms import v2

    steps = list(transform.transforms)
    first = len(steps)
    while first and isinstance(steps[first - 1], v2.ToDtype | v2.Normalize):
        first -= 1
    return v2.Compose(steps[:first]), v2.Compose(steps[first:])


def _rrc_scale(spec: TransformSpec) -> tuple[float, float]:
    return (spec.rrc_scale(), 1.0)  # empty outside a recipe: Azure's 0.08


def _policy(spec: TransformSpec) -> list[v2.Transform]:
    """The spec's augmentation policy (none when empty: a recipe fills it in training runs)."""
    from torchvision.transforms import v2

    magnitude = spec.augmentation_magnitude
    if spec.augmentation == "randaugment":
        return [v2.RandAugment() if magnitude is None else v2.RandAugment(magnitude=magnitude)]
    if spec.augmentation == "trivialaugment":
        return [v2.TrivialAugmentWide()]
    if spec.augmentation == "augmix":
        severity = 3 if magnitude is None else min(max(magnitude, 1), 10)
        return [v2.AugMix(severity=severity)]
    if spec.augmentation == "autoaugment":
        return [v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)]
    return []


def _geometry(spec: TransformSpec, training: bool) -> list[v2.Transform]:
    """Resize, crop and pad: every image leaves as an ``input_size`` square (when it has one)."""
    from torchvision.transforms import v2

    crop = spec.crop_side()
    steps: list[v2.Transform] = []
    if training and spec.random_resized_crop:
        # It picks its area from the whole image: resizing first would only lose detail.
        steps.append(v2.RandomResizedCrop(spec.rrc_size(), scale=_rrc_scale(spec), antialias=True))
    elif training and spec.resize:
        steps.append(v2.Resize(spec.resize_size, antialias=True))
    elif not training and (size := inference_resize(spec)) is not None:
        steps.append(v2.Resize(size, antialias=True))
    if training and spec.random_crop:
        steps.append(v2.RandomCrop(spec.random_crop_size, pad_if_needed=True))
    elif crop is not None and not (training and spec.random_resized_crop):
        steps.append(v2.CenterCrop(crop))  # pads an image smaller than the crop
    if spec.pad and spec.padding:
        steps.append(v2.Pad(spec.padding, fill=0))
    return steps


def check_applied(
    spec: TransformSpec, applied: AppliedTransform | None, root: Path, mode: Mode
) -> Mode | None:
    """Refuse images prepared for another transform; return the mode they were prepared in.

    ``applied`` is the ImageDirectory's record of Apply Image Transformation (None: raw
    images). Its spec must be ``spec``: running a second transform over finished images would
    resize them twice, silently. Images that carry a training draw cannot be validated or
    scored (``mode`` inference) as they are.
    """
    if applied is None:
        return None
    ours, theirs = spec.model_dump(), applied.spec.model_dump()
    # A field a training recipe fills (augmentation) and one side left empty is no difference:
    # a trained model's spec has the recipe's values, data prepared before has none.
    differ = [
        f"{k} {theirs[k]} vs {ours[k]}"
        for k in ours
        if ours[k] != theirs[k] and not (k in RECIPE_FIELDS and None in (ours[k], theirs[k]))
    ]
    if differ:
        raise InvalidTransformationDirectoryError(
            f"{root} was prepared by Apply Image Transformation with another transform than "
            f"this run's (the data's vs the run's: {'; '.join(differ[:6])}"
            f"{' ...' if len(differ) > 6 else ''}).",
            "Leave out the transform to use the data's own, or apply the run's transform to the "
            "untransformed images with `imageops transform apply`.",
        )
    if mode == "inference" and applied.mode == "training":
        raise InvalidTransformationDirectoryError(
            f"{root} was prepared in training mode: its images carry one draw of the random "
            "steps, and validation and scoring need the deterministic ones.",
            "Apply the transform to it with `imageops transform apply --mode inference`.",
        )
    return applied.mode


def transform_for(
    spec: TransformSpec, mode: Mode, root: Path, applied: AppliedTransform | None
) -> v2.Compose:
    """The pipeline that takes the images of ``root`` to the network in ``mode``.

    Raw images get all of ``spec``; images Apply Image Transformation prepared with ``spec`` get
    what it has not done yet. Raises InvalidTransformationDirectoryError (:func:`check_applied`).
    """
    return build_transform(spec, mode, prepared=check_applied(spec, applied, root, mode))


def applied_to(root: Path) -> AppliedTransform | None:
    """What Apply Image Transformation did to ``root`` (None: raw images, or no ImageDirectory)."""
    return read_head(root).transform if (Path(root) / MANIFEST).is_file() else None


def data_transform(
    roots: Mapping[str, tuple[Path, AppliedTransform | None]],
) -> TransformSpec | None:
    """The spec the data sets were prepared with (None: all raw); prepared ones must agree.

    Raw data sets beside prepared ones are fine: they go through the whole spec.
    """
    prepared = [(role, root, a.spec) for role, (root, a) in roots.items() if a is not None]
    if any(spec != prepared[0][2] for _, _, spec in prepared):
        named = ", ".join(f"{role} ({root})" for role, root, _ in prepared)
        raise InvalidTransformationDirectoryError(
            f"The data sets were prepared with different transforms: {named}.",
            "Apply one transform (`imageops transform apply`) to every data set of the run.",
        )
    return prepared[0][2] if prepared else None


def _random_steps(spec: TransformSpec) -> list[v2.Transform]:
    from torchvision.transforms import v2

    chosen: list[tuple[bool, Any]] = [
        (spec.random_horizontal_flip, lambda: v2.RandomHorizontalFlip()),
        (spec.random_vertical_flip, lambda: v2.RandomVerticalFlip()),
        (spec.random_rotation, lambda: v2.RandomRotation(spec.random_rotation_degrees)),
        (spec.random_affine, lambda: v2.RandomAffine(spec.random_affine_degrees)),
        (spec.random_grayscale, lambda: v2.RandomGrayscale(RANDOM_GRAYSCALE_P)),
        (spec.random_perspective, lambda: v2.RandomPerspective(PERSPECTIVE_DISTORTION)),
    ]
    return [make() for on, make in chosen if on]


def apply_transformation(
    transform: Path, images: Path, dest: Path, *, mode: Mode = "inference", seed: int = 1
) -> StreamedManifest:
    """Apply Image Transformation: ``images`` through the spec in ``transform``, into ``dest``.

    ``dest`` becomes an ImageDirectory (PNG images, new manifest; unreadable images skipped and
    listed), written atomically. ``mode``: "training" (random steps drawn from ``seed`` and each
    path) or "inference". Returns the new manifest. Raises InvalidTransformationDirectoryError,
    InvalidImageDirectoryError, InvalidParameterError (bad mode, ``dest`` overlapping an input),
    NoUsableImagesError. Details: docs/images.md#transforms.
    """
    transform, images, dest = Path(transform), Path(images), Path(dest)
    with holding_folders(images, dest):  # neither replaced, nor versioned half-written, meanwhile
        return _apply(transform, images, dest, mode, seed)


def _apply(transform: Path, images: Path, dest: Path, mode: Mode, seed: int) -> StreamedManifest:
    """:func:`apply_transformation` with the folders' locks held."""
    import torch
    from torchvision.transforms import v2

    spec = read_transformation(transform)
    pipeline = build_transform(spec, mode, normalize=False)
    head = read_head(images)
    if head.transform is not None:
        raise InvalidTransformationDirectoryError(
            f"{images} already went through Apply Image Transformation ({head.transform.mode} "
            "mode): a second transform would resize and crop finished images again.",
            f"Apply the transform to the ImageDirectory it came from ({head.source}).",
        )
    _check_dest(dest, images, transform)
    check_destination(dest, replaces=MANIFEST)
    skipped: list[SkippedFile] = []
    taken: set[str] = set()
    read = 0
    # Seeding per image leaves the caller's random state as it was. The images are streamed
    # from the manifest and into the new one: memory does not grow with them.
    with (
        atomic_directory(dest, replaces=MANIFEST) as tmp,
        ManifestWriter(tmp, dest) as written,
        torch.random.fork_rng(devices=[]),
    ):
        for entry in iter_images(images):
            read += 1
            try:
                image = load_rgb(images / entry.path)
            except ImageRefused as refused:  # over the image limits (a hand-edited directory)
                skipped.append(SkippedFile(path=entry.path, reason=refused.reason))
                continue
            except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ...)
                reason = SkipReason.UNREADABLE_IMAGE.because(f"{type(exc).__name__}: {exc}")
                skipped.append(SkippedFile(path=entry.path, reason=reason))
                continue
            torch.manual_seed(_image_seed(seed, entry.path))
            out = v2.functional.to_pil_image(pipeline(image))
            buffer = io.BytesIO()
            out.save(buffer, format="PNG")
            data = buffer.getvalue()
            path = _png_path(entry.path, taken)
            (tmp / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp / path).write_bytes(data)
            written.add(
                ImageEntry(
                    path=path,
                    label=entry.label,
                    sha256=hashlib.sha256(data).hexdigest(),
                    width=out.width,
                    height=out.height,
                )
            )
        if not written.count:
            raise NoUsableImagesError(
                f"None of the {read} image(s) in {images} could be read.",
                "Re-create the ImageDirectory with `imageops convert`.",
            )
        result = head.model_copy(
            update={
                "source": recorded_source(images),
                "skipped": skipped,
                "fingerprint": None,
                "transform": AppliedTransform(spec=spec, mode=mode, seed=seed),
            }
        )
        return written.finish(result)


def _check_dest(dest: Path, *inputs: Path) -> None:
    out = dest.resolve()
    for source in (p.resolve() for p in inputs):
        if out == source or out.is_relative_to(source) or source.is_relative_to(out):
            # Writing there would replace or nest inside an input while it is being read.
            raise InvalidParameterError(
                f"The output {out} overlaps the input {source}.",
                "Write the transformed images to a folder of their own.",
            )


def _image_seed(seed: int, path: str) -> int:
    """A seed per (run seed, image): the draw does not depend on order or on other images."""
    digest = hashlib.sha256(f"{seed}\0{path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # torch.manual_seed takes < 2**63


def _png_path(path: str, taken: set[str]) -> str:
    """``path`` with a .png suffix, numbered when two sources would meet (a.jpg and a.png)."""
    source = PurePosixPath(path)
    candidate, number = source.with_suffix(".png"), 0
    while candidate.as_posix() in taken:
        number += 1
        candidate = source.with_name(f"{source.stem}-{number}.png")
    taken.add(candidate.as_posix())
    return candidate.as_posix()


# Workers import this module and must not import Prefect (seconds per process, and threads that a
# forked DataLoader worker could deadlock on): the tasks are made on first use.
__getattr__ = tasks_on_first_use(
    globals(),
    init_transformation_task=lambda: step(init_transformation, name="init-image-transformation"),
    apply_transformation_task=lambda: step(apply_transformation, name="apply-image-transformation"),
)
