"""The UntrainedModelDirectory: the Azure DenseNet and ResNet components' options, as plain data.

A component writes ``model.json`` naming the architecture and its options: no weights and nothing
pickled; the network is built at train time, when the number of classes is known
(:func:`models.zoo.build_model`). No torch here: the CLI builds its options and the Prefect forms
their schema from these models, and must start fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from models.atomic import atomic_directory, write_json
from models.errors import InvalidModelDirectoryError

MODEL_JSON = "model.json"
UNTRAINED_FORMAT = "imageops.UntrainedModelDirectory"

DENSENETS = ("densenet121", "densenet161", "densenet169", "densenet201")
RESNETS = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "resnext101_32x8d",
    "wide_resnet50_2",
    "wide_resnet101_2",
)
# The on/off options of ModelSpec that only one family has (see Family.switch).
SWITCHES = ("memory_efficient", "zero_init_residual")


@dataclass(frozen=True)
class Family:
    """A model family of the zoo: its torchvision architectures and the switch only it has.

    Adding a family is one of these in :data:`FAMILIES` (with :func:`register_family`) and its
    network builder in :data:`models.zoo.NETWORKS`; every entry point (CLI, forms, params.yaml,
    tuning) then offers its architectures.
    """

    name: str  # model.json's "family"
    title: str  # how people write it: "DenseNet"
    archs: tuple[str, ...]  # torchvision model names
    switch: str | None = None  # one of SWITCHES, or None


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` to the zoo; an architecture of two families is refused."""
    if family.switch is not None and family.switch not in SWITCHES:
        raise ValueError(f"{family.name}: switch {family.switch!r} is not one of {SWITCHES}.")
    taken = set(family.archs) & set(architectures())
    if taken:
        raise ValueError(f"{family.name}: {sorted(taken)} belong to another family already.")
    FAMILIES[family.name] = family
    return family


def architectures() -> tuple[str, ...]:
    """Every architecture of the zoo, family by family."""
    return tuple(arch for family in FAMILIES.values() for arch in family.archs)


def family_of(arch: str) -> Family:
    """The family of ``arch``; an unknown name is InvalidModelDirectoryError, never a default."""
    for family in FAMILIES.values():
        if arch in family.archs:
            return family
    _check_name(arch, architectures(), "imageops")
    raise AssertionError("unreachable")


register_family(Family("densenet", "DenseNet", DENSENETS, "memory_efficient"))
register_family(Family("resnet", "ResNet", RESNETS, "zero_init_residual"))


class ModelSpec(BaseModel):
    """``model.json`` of an UntrainedModelDirectory: the architecture and its options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["imageops.UntrainedModelDirectory"] = UNTRAINED_FORMAT
    format_version: int = 1
    family: str  # a name in FAMILIES (checked by read_untrained, with the architecture)
    arch: str
    pretrained: bool
    memory_efficient: bool = False
    zero_init_residual: bool = False


def densenet(
    model_name: str = "densenet201", pretrained: bool = True, memory_efficient: bool = False
) -> ModelSpec:
    """Azure DenseNet component (defaults: densenet201, pretrained, not memory efficient)."""
    _check_name(model_name, DENSENETS, "DenseNet")
    return ModelSpec(
        family="densenet", arch=model_name, pretrained=pretrained, memory_efficient=memory_efficient
    )


def resnet(
    model_name: str = "resnext101_32x8d", pretrained: bool = True, zero_init_residual: bool = False
) -> ModelSpec:
    """Azure ResNet component (defaults: resnext101_32x8d, pretrained, no zero-init residual)."""
    _check_name(model_name, RESNETS, "ResNet")
    return ModelSpec(
        family="resnet",
        arch=model_name,
        pretrained=pretrained,
        zero_init_residual=zero_init_residual,
    )


def spec_for(
    model_name: str,
    pretrained: bool = False,
    *,
    memory_efficient: bool = False,
    zero_init_residual: bool = False,
) -> ModelSpec:
    """The spec for any zoo architecture, by name; a switch of another family is refused."""
    family = family_of(model_name)
    switches = {"memory_efficient": memory_efficient, "zero_init_residual": zero_init_residual}
    for switch, on in switches.items():
        if on and switch != family.switch:
            owners = [f.title + "s" for f in FAMILIES.values() if f.switch == switch]
            raise InvalidModelDirectoryError(
                f"{switch} applies to {', '.join(owners)}, not {model_name}.", "Leave it off."
            )
    return ModelSpec(family=family.name, arch=model_name, pretrained=pretrained, **switches)


class ModelChoice(BaseModel):
    """The DenseNet / ResNet component's options for any architecture of the zoo, by name.

    One definition for every entry point: the Prefect forms, params.yaml's ``model`` section,
    ``imageops model build`` and tuning. Defaults are the Azure ResNet component's; a switch of
    the other family (memory efficient on a ResNet) is refused.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        default="resnext101_32x8d",
        title="Architecture",
        description=f"One of {', '.join(architectures())}.",
    )
    pretrained: bool = Field(
        default=True,
        title="Pretrained",
        description="Start from torchvision's ImageNet weights (from the weights cache, "
        "IMAGEOPS_WEIGHTS_CACHE; needs the file there or network access).",
    )
    memory_efficient: bool = Field(
        default=False,
        title="Memory efficient (DenseNet)",
        description="DenseNets only: recompute activations in the backward pass (checkpointing): "
        "less memory, slower.",
    )
    zero_init_residual: bool = Field(
        default=False,
        title="Zero-init residual (ResNet)",
        description="ResNets only: start the last BatchNorm of each residual block at zero, so "
        "each block starts as the identity.",
    )

    @model_validator(mode="after")
    def _known(self) -> ModelChoice:
        # Not a ValueError: pydantic lets the Azure component's own error through as it is.
        self.spec()
        return self

    def spec(self) -> ModelSpec:
        """The UntrainedModelDirectory's ``model.json`` for this choice."""
        return spec_for(
            self.name,
            self.pretrained,
            memory_efficient=self.memory_efficient,
            zero_init_residual=self.zero_init_residual,
        )


def _check_name(name: str, allowed: tuple[str, ...], family: str) -> None:
    if name not in allowed:
        raise InvalidModelDirectoryError(
            f"Unknown {family} model name {name!r}.", f"Choose one of: {', '.join(allowed)}."
        )


def write_untrained(spec: ModelSpec, dest: Path) -> Path:
    """Write the UntrainedModelDirectory for ``spec`` to ``dest`` (atomically)."""
    with atomic_directory(Path(dest), replaces=MODEL_JSON) as tmp:
        write_json(tmp / MODEL_JSON, spec.model_dump(mode="json"))
    return Path(dest)


def read_untrained(path: Path) -> ModelSpec:
    """Read an UntrainedModelDirectory; anything else is Azure's InvalidModelDirectoryError."""
    path = Path(path)
    hint = "Create one with `imageops model resnet DEST` or `imageops model densenet DEST`."
    if not (path / MODEL_JSON).is_file():
        raise InvalidModelDirectoryError(f"{path} is not a model directory: no {MODEL_JSON}.", hint)
    try:
        spec = ModelSpec.model_validate_json((path / MODEL_JSON).read_bytes())
    except ValidationError as exc:
        raise InvalidModelDirectoryError(
            f"{path / MODEL_JSON} is not an untrained PyTorch model directory "
            f"({exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}).",
            hint,
        ) from exc
    family = FAMILIES.get(spec.family)
    if family is None:
        raise InvalidModelDirectoryError(
            f"{path / MODEL_JSON} names the model family {spec.family!r}, which imageops does "
            "not have.",
            f"Use one of: {', '.join(FAMILIES)}. {hint}",
        )
    _check_name(spec.arch, family.archs, family.title)
    return spec
