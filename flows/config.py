"""Pipeline parameters: one typed model, the Prefect UI form, the shape of ``params.yaml``.

Defaults are Azure's (the training recipe aside: modern, the best measured; ``recipe: azure``
gives the Azure component's exact defaults), except where the bundled demo needs otherwise
(resnet18 from scratch at 32x32 on two CPU processes instead of a pretrained resnext101 at
224x224 on one GPU; no random horizontal flip, since a mirrored digit is not the same digit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from models.bounded_parse import read_yaml, shown
from models.form_sections import FormSection, flattened, schema_extra
from models.transform_spec import TransformSpec
from models.untrained import ModelChoice
from tasks.data.convert import find_source, source_classes
from tasks.data.data_refs import REF_SYNTAX, ResolvedData, ref_dataset_name, resolve_data
from tasks.data.datasets import NAME_PATTERN, name_problem, source_name
from tasks.data.split import first_share
from tasks.data.transform import input_size
from tasks.shared.errors import InvalidParameterError, InvalidTransformationDirectoryError
from tasks.shared.forms import form_field
from tasks.shared.settings import Settings
from tasks.train.params import TrainParams
from tasks.train.request import check_sizes

# Azure's Init Image Transformation, sized for the 32x32 digits: the center crop and the random
# crop a person may switch on are 32, so training and scoring see the same input size. The random
# resized crop's size stays empty: the recipe sizes it to the center crop (modern), so a transform
# typed over this one (center crop 16) trains at its own size, not at 32.
DEMO_TRANSFORM = TransformSpec(
    resize_size=32,
    center_crop_size=32,
    random_crop_size=32,
    random_horizontal_flip=False,
)
# resnet18 from scratch: the digits are too small and too unlike ImageNet for its weights to help,
# and the demo must not need a weights download.
DEMO_MODEL = ModelChoice(name="resnet18", pretrained=False)
# Two training processes: the demo shows DDP on a 2-core machine.
DEMO_TRAIN = TrainParams(nproc_per_node=2)
# The model and training sections as every form shows them (the pipeline's and the train
# deployment's): one definition, so the two forms cannot drift apart.
MODEL_FIELD = form_field(
    title="Model",
    description="The network: a DenseNet or ResNet of the Azure components, any other "
    "torchvision classifier by name, or timm/<name>.",
)
TRAIN_FIELD = form_field(
    title="Training parameters",
    description="Train PyTorch Model's parameters and the recipe; empty fields take the "
    "recipe's values.",
)


def fills_from(default: BaseModel) -> BeforeValidator:
    """Fill the fields a partial object leaves out from ``default``, not from its class.

    Prefect replaces a whole parameter when a run gives part of it (``prefect deployment run
    imageops-train-model/train -p 'params={"epochs": 2}'``: deployment parameters merge per
    top-level key), and so does a params.yaml section with one key. pydantic alone would fill the
    rest from the class's defaults (Azure's: one process, so half the demo's learning rate);
    this keeps the values of ``default``, which the form shows.
    """
    kept = default.model_dump(exclude_defaults=True)

    def fill(value: Any) -> Any:
        return {**kept, **value} if isinstance(value, dict) else value

    return BeforeValidator(fill)


# The demo's values as the types of parameters and params.yaml sections: what a partial value
# leaves out is the demo's (DEMO_*), whatever the class's own default is.
DemoTrainParams = Annotated[TrainParams, fills_from(DEMO_TRAIN)]
DemoTransform = Annotated[TransformSpec, fills_from(DEMO_TRANSFORM)]
DemoModel = Annotated[ModelChoice, fills_from(DEMO_MODEL)]


class SplitChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fraction: float = Field(
        default=0.9, ge=0.0, le=1.0, title="Training fraction", description="Share per class."
    )
    seed: int = Field(
        default=1,
        title="Split seed",
        description="Seeds which images go to training: same seed and images, same split.",
    )


class PromotionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: str = Field(
        default="accuracy",
        title="Promotion metric",
        description="Evaluate Model metric the challenger must win on (higher is better): "
        "accuracy, top5_accuracy, precision/recall/f1 _macro or _weighted.",
    )
    margin: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        title="Promotion margin",
        description="How much more than the champion's the challenger's metric must be.",
    )


# The pipeline form's own card (models.form_sections): what a run does besides the float model.
FORM_SECTIONS = (
    FormSection(
        "int8",
        "INT8 model",
        "Whether to write a static INT8 model too, and the top-1 it may lose. Empty: none.",
        ("quantize", "max_top1_drop"),
    ),
)


class PipelineConfig(BaseModel):
    """Everything ``imageops run`` and the pipeline flow take."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=schema_extra(FORM_SECTIONS))

    @model_validator(mode="before")
    @classmethod
    def _from_form_sections(cls, data: Any) -> Any:
        return flattened(data, FORM_SECTIONS)

    source: str = Field(
        default="data/raw/digits",
        title="Raw images",
        description="Folder (class sub-folders = labels) or .zip/.tar archive under the project "
        f"root, or a version of one as {REF_SYNTAX} (raw/digits@latest) from the DVC remote.",
    )
    dataset: str = Field(
        default="",
        # In the form's schema too, so a server refuses a bad name before any worker starts.
        pattern=f"^$|{NAME_PATTERN}",
        title="Data set name",
        description="The prepared folders are data/<dataset>/images, train and val; empty: the "
        "source's folder or archive name. Runs on one data set take turns.",
    )
    split: SplitChoice = Field(
        default_factory=SplitChoice,
        title="Split",
        description="Split Image Directory: the share of each class that trains; the rest "
        "validates.",
    )
    transform: DemoTransform = Field(
        default=DEMO_TRANSFORM,
        title="Image transformation",
        description="Init Image Transformation: how images become the network's input. "
        "Training uses its training mode; validation, export and scoring its inference mode.",
    )
    model: Annotated[DemoModel, MODEL_FIELD] = DEMO_MODEL
    train: Annotated[DemoTrainParams, TRAIN_FIELD] = DEMO_TRAIN
    quantize: bool = Field(
        default=False,
        title="Quantize to INT8",
        description="Also write a static INT8 model (calibrated on the training split), kept only "
        "if it loses at most max_top1_drop points of validation top-1.",
    )
    max_top1_drop: float = Field(
        default=0.5,
        ge=0.0,
        le=100.0,
        title="Most top-1 INT8 may lose (points)",
        description="The INT8 model is kept only if its validation top-1 is at most this many "
        "points below the float model's.",
    )
    promotion: PromotionChoice = Field(
        default_factory=PromotionChoice,
        title="Promotion",
        description="When the new model (@challenger) becomes @champion: the metric on the "
        "validation set and the margin it must win by.",
    )
    score_batch_size: int = Field(
        default=64,
        gt=0,
        title="Scoring batch size",
        description="Images per ONNX Runtime call when the validation set is scored.",
    )
    version_data: bool = Field(
        default=True, title="Version data with DVC", description="dvc add + push every data set."
    )

    @field_validator("dataset", mode="before")  # before the pattern: this says what to pass
    @classmethod
    def _usable_name(cls, name: object) -> object:
        """A name becomes a folder under data/: one safe path component, checked up front."""
        problem = isinstance(name, str) and name and name_problem(name)
        if problem:
            raise ValueError(f"not a usable data set name ({problem}), e.g. --dataset digits")
        return name

    @model_validator(mode="after")
    def _usable_source_name(self) -> PipelineConfig:
        """A name taken from the source must make a folder too, or the user must give one."""
        problem = not self.dataset and name_problem(self.dataset_name)
        if problem:
            raise ValueError(
                f"the source {self.source!r} gives the data set name {self.dataset_name!r}, which "
                f"is not usable ({problem}): name the data set with --dataset NAME (dataset: in "
                "params.yaml)"
            )
        return self

    @property
    def dataset_name(self) -> str:
        """The data set this run prepares: ``dataset``, else the source's name."""
        return self.dataset or source_name(ref_dataset_name(self.source))

    def check_sources(self, settings: Settings) -> tuple[ResolvedData, Path]:
        """Refuse, before any step writes anything, a run whose source cannot make a classifier.

        Returns (source, data set folder), the source resolved on this machine
        (:func:`tasks.data.data_refs.resolve_data`: a reference or a missing path under data/
        is fetched from the DVC remote). Raises NoUsableImagesError for an unreadable source,
        NotLabeledDatasetError for one without classes, InvalidDatasetError for one class,
        InvalidParameterError for a missing source, one that overlaps its data set folder or
        a training batch (or process count) its training split could not fill, and
        DataUnavailableError for a version the remote lacks.
        """
        given = settings.project_root / self.source  # a version fetched lies outside the project
        data = settings.data_path / self.dataset_name
        if given.resolve().is_relative_to(data.resolve()) or data.resolve().is_relative_to(
            given.resolve()
        ):
            raise InvalidParameterError(
                f"The source {given.resolve()} and the data set folder {data.resolve()} "
                f"overlap: preparing data set {self.dataset_name!r} would write into its own "
                "source.",
                "Name the data set with --dataset NAME (dataset: in params.yaml) so its folder "
                "data/NAME lies apart from the source, or move the raw images out of data/NAME.",
            )
        resolved = resolve_data(self.source, "source", settings)
        source_classes(resolved.path)
        self._check_training_set(resolved.path)
        return resolved, data

    def _check_training_set(self, source: Path) -> None:
        """Refuse a batch the training split cannot fill, before convert, version and split run.

        The split is not made yet; its size is at most split's share (rounded down, as split
        rounds it) of each class's image files in the source, counted by name (convert only
        leaves files out), so a request refused here would be refused at the training.
        """
        sizes = find_source(source).class_sizes(source)
        if sizes is None:  # a source that cannot count without converting: train checks it
            return
        fraction = self.split.fraction
        most = sum(first_share(fraction, n) for n in sizes.values())
        check_sizes(
            self.train,
            most,
            f"at most {most} images: split's {fraction:g} of each class of the "
            f"{sum(sizes.values())} image files in {self.source}, rounded down",
        )

    @field_validator("transform")
    @classmethod
    def _one_input_size(cls, spec: TransformSpec) -> TransformSpec:
        """Refuse, before any step runs, a spec that would train and score at different sizes."""
        try:
            input_size(spec)
        except InvalidTransformationDirectoryError as exc:
            raise ValueError(str(exc)) from exc
        return spec

    @classmethod
    def from_yaml(cls, path: Path) -> PipelineConfig:
        """Read a ``params.yaml``-shaped file; unknown keys and bad values are refused."""
        hint = "Fix the value in the file; `imageops run --help` lists every option."
        data = read_yaml(path, InvalidParameterError, hint) or {}
        return cls.checked(data, str(path), hint)

    @classmethod
    def checked(cls, data: dict, origin: str, hint: str) -> PipelineConfig:
        """Validate ``data``; a bad value is an InvalidParameterError naming it and its origin."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            # A whole-model check (no field) would echo every value: name none.
            where = f"{field}: " if field else ""
            got = f" (got {shown(first.get('input'))})" if field else ""
            raise InvalidParameterError(f"{origin}: {where}{first['msg']}{got}.", hint) from exc
