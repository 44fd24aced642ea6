"""The UntrainedModelDirectory: the Azure DenseNet and ResNet components' options, as plain data.

The zoo beyond them: every other classification network of torchvision by its name, and timm's
models as ``timm/<name>``.

A component writes ``model.json`` naming the architecture and its options: no weights and nothing
pickled; the network is built at train time, when the number of classes is known
(:func:`models.zoo.build_model`). No torch here: the CLI builds its options and the Prefect forms
their schema from these models, and must start fast.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from models.atomic import atomic_directory, write_json
from models.errors import InvalidModelDirectoryError
from models.form_sections import FormSection, flattened, schema_extra

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
# Every other classification network of torchvision (tests/test_zoo.py checks this list against
# torchvision.models.list_models, so a torchvision upgrade that adds one fails a test).
TORCHVISION = (
    "alexnet",
    *(f"convnext_{size}" for size in ("tiny", "small", "base", "large")),
    *(f"efficientnet_b{i}" for i in range(8)),
    *(f"efficientnet_v2_{size}" for size in ("s", "m", "l")),
    "googlenet",
    "inception_v3",
    "maxvit_t",
    *(f"mnasnet{width}" for width in ("0_5", "0_75", "1_0", "1_3")),
    "mobilenet_v2",
    "mobilenet_v3_large",
    "mobilenet_v3_small",
    *(f"regnet_x_{flops}" for flops in ("400mf", "800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf")),
    *(
        f"regnet_y_{flops}"
        for flops in ("400mf", "800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf", "128gf")
    ),
    "resnext101_64x4d",
    *(f"shufflenet_v2_x{width}" for width in ("0_5", "1_0", "1_5", "2_0")),
    "squeezenet1_0",
    "squeezenet1_1",
    *(f"swin_{size}" for size in ("t", "s", "b")),
    *(f"swin_v2_{size}" for size in ("t", "s", "b")),
    *(f"vgg{depth}{bn}" for depth in (11, 13, 16, 19) for bn in ("", "_bn")),
    *(f"vit_{size}" for size in ("b_16", "b_32", "l_16", "l_32", "h_14")),
)
TIMM_PREFIX = "timm/"  # timm's models are named timm/<timm model name>, e.g. timm/resnet18.a1_in1k
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
    # A family of more names than a list holds (timm's): every name with this prefix is its own,
    # checked against the library when the network is built (models.zoo), not here.
    prefix: str | None = None

    def has(self, arch: str) -> bool:
        """Whether ``arch`` is one of this family's names."""
        if self.prefix is not None:
            return arch.startswith(self.prefix) and len(arch) > len(self.prefix)
        return arch in self.archs


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
        if family.has(arch):
            return family
    _check_name(arch, architectures(), "imageops")
    raise AssertionError("unreachable")


register_family(Family("densenet", "DenseNet", DENSENETS, "memory_efficient"))
register_family(Family("resnet", "ResNet", RESNETS, "zero_init_residual"))
register_family(Family("torchvision", "torchvision", TORCHVISION))
register_family(Family("timm", "timm", (), prefix=TIMM_PREFIX))


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


# The run form's one card (models.form_sections): the two families' own switches.
FORM_SECTIONS = (
    FormSection(
        "family_options",
        "DenseNet and ResNet options",
        "The Azure DenseNet and ResNet components' own switches; other networks take neither.",
        ("memory_efficient", "zero_init_residual"),
    ),
)


class ModelChoice(BaseModel):
    """The DenseNet / ResNet component's options for any architecture of the zoo, by name.

    One definition for every entry point: the Prefect forms, params.yaml's ``model`` section,
    ``imageops model build`` and tuning. Defaults are the Azure ResNet component's; a switch of
    the other family (memory efficient on a ResNet) is refused.
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, json_schema_extra=schema_extra(FORM_SECTIONS)
    )

    name: str = Field(
        default="resnext101_32x8d",
        title="Architecture",
        description="A torchvision classifier by name: the Azure components' DenseNets "
        "(densenet121/161/169/201) and ResNets (resnet18 to 152, resnext50_32x4d, "
        "resnext101_32x8d, wide_resnet50_2/101_2), any other (`imageops model list`), or "
        "timm/<name> (timm/resnet18.a1_in1k).",
    )
    pretrained: bool = Field(
        default=True,
        title="Pretrained",
        description="Start from the published ImageNet weights (kept in IMAGEOPS_WEIGHTS_CACHE); "
        "the transform should match them (`imageops transform init --like-model NAME`).",
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

    @model_validator(mode="before")
    @classmethod
    def _from_form_sections(cls, data: Any) -> Any:
        return flattened(data, FORM_SECTIONS)

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
        close = difflib.get_close_matches(name, allowed, n=3, cutoff=0.6)
        listed = f"Did you mean {' or '.join(close)}? " if close else ""
        choices = (
            f"Choose one of: {', '.join(allowed)}."
            if len(allowed) <= 20
            else "`imageops model list` lists every name; a timm model is timm/<name>."
        )
        raise InvalidModelDirectoryError(f"Unknown {family} model name {name!r}.", listed + choices)


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
    if not family.has(spec.arch):
        _check_name(spec.arch, family.archs, family.title)
    return spec
