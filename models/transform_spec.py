"""The transform spec: how an image becomes the network's input, as plain, validated data.

It holds the 21 options of Azure's Init Image Transformation (defaults and ranges from Azure)
plus the normalisation the network needs. It lives in ``models/`` because a trained ModelDirectory
stores it in ``model.json``: scoring rebuilds the very transform training validated with, from
this one definition. The torchvision pipelines built from it are in ``tasks/data/transform.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.form_sections import FormSection, flattened, schema_extra

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MAX_DEGREES = 180
# The Azure design's two modes of Apply Image Transformation: training adds the random steps.
Mode = Literal["training", "inference"]
MODES: tuple[str, ...] = get_args(Mode)
# torchvision's augmentation policies (v2.RandAugment, TrivialAugmentWide, AugMix, AutoAugment).
Augmentation = Literal["none", "randaugment", "trivialaugment", "augmix", "autoaugment"]
MAX_MAGNITUDE = 30  # RandAugment's num_magnitude_bins - 1 (torchvision's default 31 bins)
# Azure's random resized crop (256 px, 8% to 100% of the area): what an empty size or scale is
# outside a training recipe.
RRC_SIZE = 256
RRC_SCALE = 0.08
# The fields a training recipe fills where a spec leaves them empty (tasks.train.recipes).
RECIPE_FIELDS = (
    "random_resized_crop",
    "random_resized_crop_size",
    "random_resized_crop_scale",
    "random_erasing",
    "random_erasing_probability",
    "augmentation",
    "augmentation_magnitude",
)


# The run form's cards (models.form_sections): the sizes first, then what training alone does.
# fmt: off
FORM_SECTIONS = (
    FormSection(
        "padding_and_grayscale",
        "Padding and grayscale",
        "The other steps every image takes, in training and inference alike.",
        ("pad", "padding", "grayscale"),
    ),
    FormSection(
        "training_augmentation",
        "Random changes in training",
        "Applied to training images only; validation, export and scoring never see them.",
        (
            "color_jitter", "random_resized_crop", "random_resized_crop_size",
            "random_resized_crop_scale", "random_crop", "random_crop_size",
            "random_horizontal_flip", "random_vertical_flip", "random_rotation",
            "random_rotation_degrees", "random_affine", "random_affine_degrees",
            "random_grayscale", "random_perspective", "random_erasing",
            "random_erasing_probability", "augmentation", "augmentation_magnitude",
        ),
    ),
    FormSection(
        "normalisation",
        "Normalisation",
        "What each channel is shifted and scaled by; ImageNet's unless the network needs others.",
        ("mean", "std"),
    ),
)
# fmt: on


def _size(default: int, title: str, description: str) -> Any:
    return Field(default, gt=0, title=title, description=description)


def _degrees(title: str, description: str) -> Any:
    return Field(0, ge=0, le=MAX_DEGREES, title=title, description=description)


class TransformSpec(BaseModel):
    """The Azure design's Init Image Transformation options, and the normalisation.

    Random transforms (the ``random_*`` options and color jitter) run in training mode only;
    inference mode drops them, so scoring is deterministic. Training decides the network's input
    size: its last crop (random crop, else random resized crop, else center crop), plus padding;
    inference resizes and center-crops to that same size (see
    :func:`tasks.data.transform.input_size`).
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        json_schema_extra=schema_extra(FORM_SECTIONS, saved_as="imageops-image-transformation"),
    )

    resize: bool = Field(
        True,
        title="Resize",
        description="Resize each image so its shorter side is `resize_size` pixels "
        "(aspect ratio kept).",
    )
    resize_size: int = _size(256, "Size", "Shorter side after resizing, in pixels (> 0).")
    center_crop: bool = Field(
        True,
        title="Center crop",
        description="Crop the square of `center_crop_size` at the image center, after the "
        "resize (inference keeps its share of the image with a training crop).",
    )
    center_crop_size: int = _size(224, "Crop size", "Side of the center crop, in pixels (> 0).")
    pad: bool = Field(
        False,
        title="Pad",
        description="Add `padding` pixels of value 0 on every side (the input grows by 2 x "
        "padding).",
    )
    padding: int = Field(
        0, ge=0, title="Padding", description="Pixels added on each border (>= 0)."
    )
    color_jitter: bool = Field(
        False,
        title="Color jitter",
        description="Randomly change brightness, contrast and saturation (training only).",
    )
    grayscale: bool = Field(
        False,
        title="Grayscale",
        description="Convert every image to grayscale (kept as 3 equal channels for the network).",
    )
    random_resized_crop: bool | None = Field(
        None,
        title="Random resized crop",
        description="Training only: crop a random area (`random_resized_crop_scale` to 100%) "
        "with a random aspect ratio (3/4 to 4/3) and resize it to `random_resized_crop_size` "
        "(used to train Inception). Replaces resize and center crop in training. Empty: the "
        "training recipe's (azure: off; modern: on, unless random crop is on); off outside "
        "training.",
    )
    random_resized_crop_size: int | None = Field(
        None,
        gt=0,
        title="Random resized crop size",
        description="Side of the random resized crop, in pixels (> 0). Empty: the training "
        f"recipe's (azure: {RRC_SIZE}, Azure's default; modern: the side of the crop the spec "
        "gives otherwise, the center crop's, else the resize's, so training and inference see "
        f"one input size); {RRC_SIZE} outside a recipe.",
    )
    random_resized_crop_scale: float | None = Field(
        None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        title="Random resized crop scale",
        description="Smallest share of the image's area a random resized crop takes (it takes "
        "up to all of it); 0.5 or more for small images or small objects. Empty: the training "
        f"recipe's (azure: {RRC_SCALE}, Azure's; modern: 0.5); {RRC_SCALE} outside a recipe.",
    )
    random_crop: bool = Field(
        False,
        title="Random crop",
        description="Training only: crop a square of `random_crop_size` at a random place "
        "(instead of the center crop).",
    )
    random_crop_size: int = _size(
        224, "Random crop size", "Side of the random crop, in pixels (> 0)."
    )
    random_horizontal_flip: bool = Field(
        True,
        title="Random horizontal flip",
        description="Training only: flip left-right with probability 0.5 (not for digits or text).",
    )
    random_vertical_flip: bool = Field(
        False,
        title="Random vertical flip",
        description="Training only: flip upside-down with probability 0.5.",
    )
    random_rotation: bool = Field(
        False,
        title="Random rotation",
        description="Training only: rotate by an angle drawn from "
        "[-random_rotation_degrees, +random_rotation_degrees].",
    )
    random_rotation_degrees: int = _degrees(
        "Rotation degrees", f"Largest rotation angle, 0 to {MAX_DEGREES}."
    )
    random_affine: bool = Field(
        False,
        title="Random affine",
        description="Training only: a random affine transform rotating by up to "
        "`random_affine_degrees`, keeping the image center.",
    )
    random_affine_degrees: int = _degrees(
        "Affine degrees", f"Largest rotation of the affine transform, 0 to {MAX_DEGREES}."
    )
    random_grayscale: bool = Field(
        False,
        title="Random grayscale",
        description="Training only: convert to grayscale with probability 0.1.",
    )
    random_perspective: bool = Field(
        False,
        title="Random perspective",
        description="Training only: a random perspective distortion (scale 0.5) with "
        "probability 0.5.",
    )
    random_erasing: bool | None = Field(
        None,
        title="Random erasing",
        description="Training only: erase a random rectangle of the normalised tensor with "
        "probability `random_erasing_probability` (Zhong et al., 2017). Empty: the training "
        "recipe's (azure: off, modern: on); off outside training.",
    )
    random_erasing_probability: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        title="Random erasing probability",
        description="Chance that random erasing erases a rectangle of an image, 0 to 1. Empty: "
        "the training recipe's (azure: 0.5, modern: 0.25); 0.5 outside training.",
    )
    augmentation: Augmentation | None = Field(
        None,
        title="Augmentation policy",
        description="Training only: a learned or random augmentation policy of torchvision, "
        "applied to the image before it becomes a tensor: randaugment, trivialaugment (Trivial"
        "AugmentWide), augmix, autoaugment (its ImageNet policy) or none. Empty: the training "
        "recipe's (azure: none, modern: randaugment); none outside training.",
    )
    augmentation_magnitude: int | None = Field(
        None,
        ge=0,
        le=MAX_MAGNITUDE,
        title="Augmentation magnitude",
        description=f"RandAugment's magnitude (0 to {MAX_MAGNITUDE}) and AugMix's severity "
        "(1 to 10). Empty: the training recipe's (modern with RandAugment: 21, timm's "
        "rand-m7), else torchvision's default (9 for RandAugment, 3 for AugMix).",
    )
    mean: Annotated[
        list[Annotated[float, Field(allow_inf_nan=False)]], Field(min_length=3, max_length=3)
    ] = Field(
        default=list(IMAGENET_MEAN),  # pydantic copies it per instance; the schema shows it
        title="Normalisation mean",
        description="Per-channel (R, G, B) mean subtracted after scaling to [0, 1]; ImageNet's "
        "by default, which pretrained weights expect.",
    )
    std: Annotated[
        list[Annotated[float, Field(gt=0, allow_inf_nan=False)]],
        Field(min_length=3, max_length=3),
    ] = Field(
        default=list(IMAGENET_STD),
        title="Normalisation std",
        description="Per-channel (R, G, B) standard deviation divided by, each > 0; ImageNet's "
        "by default.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_form_sections(cls, data: Any) -> Any:
        return flattened(data, FORM_SECTIONS)

    def crop_side(self) -> int | None:
        """The side of the crop training ends with: the random crop, else the random resized
        crop, else the center crop, else (resize only) the resized image's centered square.
        None when all are off (see :func:`tasks.data.transform.crop_size`)."""
        for on, size in (
            (self.random_crop, self.random_crop_size),
            (self.random_resized_crop, self.rrc_size()),
            (self.center_crop, self.center_crop_size),
            (self.resize, self.resize_size),
        ):
            if on:
                return size
        return None

    def rrc_size(self) -> int:
        """The random resized crop's side: its size, Azure's 256 where empty (no recipe)."""
        size = self.random_resized_crop_size
        return RRC_SIZE if size is None else size

    def rrc_scale(self) -> float:
        """The random resized crop's smallest share: its scale, Azure's 0.08 where empty."""
        scale = self.random_resized_crop_scale
        return RRC_SCALE if scale is None else scale

    def input_side(self) -> int | None:
        """The side of the square the network sees: the crop, plus the padding on both sides."""
        crop = self.crop_side()
        return None if crop is None else crop + (2 * self.padding if self.pad else 0)


class AppliedTransform(BaseModel):
    """What Apply Image Transformation did to an ImageDirectory, kept in its manifest.

    Train and Score read it: they use this spec (a different one is refused, never silently
    resized) and skip the steps already applied to the images.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: TransformSpec
    mode: Mode = Field(
        description="inference: deterministic steps only; training: one draw of "
        "the random steps too."
    )
    seed: int = Field(description="Random seed of the training mode's draw.")
