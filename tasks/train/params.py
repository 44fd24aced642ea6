"""Train PyTorch Model parameters, and the resolved configuration a torchrun worker runs from.

:class:`TrainParams` is what a person sets: the Azure design's parameters with its defaults and
ranges, and the recipe that fills the fields left empty (the Prefect UI renders it as a form).
:class:`RunConfig` is everything a worker needs, resolved once by the launcher and saved as JSON in
the run folder: a restarted worker trains exactly the same job, and a checkpoint can tell whether
it belongs to that job.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.atomic import write_json
from models.form_sections import FormSection, flattened, schema_extra
from models.transform_spec import TransformSpec
from models.untrained import ModelSpec
from tasks.shared.validation import checked
from tasks.train.recipes import (
    FINE_TUNING,
    TRAINING,
    Recipe,
    Schedule,
    filled,
    resolve_transform,
)

# Where and how patiently a job runs, not what it trains: outside a job's identity, so a retry
# through another cluster address, or with more patience, resumes the same run.
PLACEMENT_FIELDS = frozenset({"cluster", "cluster_timeout_s", "rdzv_timeout_s"})

# The float formats of the forward pass (tasks.train.precision decides "auto").
Precision = Literal["auto", "fp32", "bf16", "fp16"]
Resolved = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
# Sane upper limits, so a typo (10^12 epochs, a batch of 10^9) is refused when the request is
# made, not after hours or at the first batch: 10,000 epochs is days even on the digits, and no
# process holds 65,536 images of any input size in one batch. The form shows them as maximums.
MAX_EPOCHS = 10_000
MAX_BATCH_SIZE = 65_536
# The run form's cards (models.form_sections): epochs, batch, recipe, learning rate, seed and
# patience first; what the recipe fills, and where and how the job runs, below.
# fmt: off
FORM_SECTIONS = (
    FormSection(
        "recipe_options",
        "Recipe options",
        "What the recipe fills where they are left empty.",
        (
            "optimizer", "schedule", "warmup_epochs", "momentum", "weight_decay",
            "head_only_epochs", "backbone_lr_scale", "decay_norm_and_bias", "mixup_alpha",
            "cutmix_alpha", "accumulation_steps", "ema_decay", "clip_grad_norm",
            "class_weights", "label_smoothing",
        ),
    ),
    FormSection(
        "distribution",
        "Machines and processes",
        "Where the job runs: this machine (torchrun) or a Ray cluster, with how many processes.",
        (
            "nodes", "nproc_per_node", "device", "precision", "num_workers", "compile",
            "cluster", "cluster_timeout_s", "rdzv_timeout_s",
        ),
    ),
)
# fmt: on


class TrainParams(BaseModel):
    """Azure's Train PyTorch Model parameters (defaults and ranges from the Azure design), and the
    recipe (modern unless ``azure`` is asked for) that fills the fields left empty."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, json_schema_extra=schema_extra(FORM_SECTIONS)
    )

    epochs: int = Field(
        5,
        gt=0,
        le=MAX_EPOCHS,
        title="Epochs",
        description=f"How many times the whole training set is iterated; at most {MAX_EPOCHS:,}.",
    )
    batch_size: int = Field(
        16,
        gt=0,
        le=MAX_BATCH_SIZE,
        title="Batch size",
        description="Images per batch in each process (Azure's meaning; Vertex AI's global batch "
        "is this x nodes x processes per node). At most the training set's images and "
        f"{MAX_BATCH_SIZE:,}.",
    )
    recipe: Recipe = Field(
        "modern",
        title="Recipe",
        description="Fills every recipe field left empty (a field you set wins). modern (the "
        "default, the best measured): AdamW, cosine decay after a warm-up epoch, label "
        "smoothing, RandAugment, random erasing, a random resized crop. azure: the Azure "
        "component's exact defaults (SGD with Nesterov momentum, polynomial decay, no "
        "augmentation). docs/configuration.md has both.",
    )
    optimizer: Literal["sgd", "adamw", "adam", "rmsprop"] | None = Field(
        None,
        title="Optimizer",
        description="sgd (Nesterov momentum), adamw (decoupled weight decay), adam (L2 weight "
        "decay) or rmsprop (with momentum). Empty: the recipe's (azure: sgd, modern: adamw).",
    )
    schedule: Schedule | None = Field(
        None,
        title="Learning-rate schedule",
        description="Per step, after the warm-up: poly (Azure's polynomial decay to 0), cosine "
        "(half a cosine to 0) or step (a tenth at each third); or onecycle (torch's OneCycleLR: "
        "up from 1/25 over the first 30% of the steps, then down; no warm-up). Empty: the "
        "recipe's (azure: poly, modern: cosine).",
    )
    warmup_epochs: int | None = Field(
        None,
        ge=0,
        le=MAX_EPOCHS,
        title="Warm-up epochs",
        description="Epochs over which the learning rate rises linearly to its full value, "
        "in case the initial rate is too large to start converging. Empty: the recipe's "
        "(azure: 0, modern: 1).",
    )
    learning_rate: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        title="Learning rate",
        description="Initial learning rate of one process; distributed runs use it x the "
        "number of processes. Empty: the recipe's, 0.001 (Azure's text; its table says 0.1).",
    )
    momentum: float | None = Field(
        None,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        title="Momentum",
        description="SGD momentum (Nesterov when above 0), AdamW's beta1: how much of the last "
        "step each step keeps. Empty: the recipe's (0.9).",
    )
    weight_decay: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        title="Weight decay",
        description="SGD: L2 penalty on the weights, as in torchvision's recipes; AdamW: "
        "decoupled decay. Empty: the recipe's (azure: 0.0001, modern: 0.05).",
    )
    head_only_epochs: int | None = Field(
        None,
        ge=0,
        le=MAX_EPOCHS,
        title="Head-only epochs",
        description="Transfer learning: for this many first epochs only the new classification "
        "head learns (the backbone's learning rate is 0), then the whole network. Empty: the "
        "recipe's (0).",
    )
    backbone_lr_scale: float | None = Field(
        None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        title="Backbone learning-rate scale",
        description="The backbone's learning rate as a share of the head's (e.g. 0.1 for a "
        "pretrained backbone that should move less than the new head); 1: one rate for all. "
        "Empty: the recipe's (1).",
    )
    decay_norm_and_bias: bool | None = Field(
        None,
        title="Decay norm layers and biases",
        description="Apply weight decay to normalisation layers' weights and to biases too. "
        "Empty: the recipe's (azure: yes, modern: no).",
    )
    mixup_alpha: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        title="MixUp alpha",
        description="MixUp of each training batch (torchvision v2.MixUp): images and labels "
        "blended with a share drawn from Beta(alpha, alpha); 0: off. With CutMix too, each batch "
        "gets one of the two. Empty: the recipe's (azure and modern: 0).",
    )
    cutmix_alpha: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        title="CutMix alpha",
        description="CutMix of each training batch (torchvision v2.CutMix): a box of another "
        "image pasted in, labels mixed by its area; 0: off. Empty: the recipe's (0).",
    )
    accumulation_steps: int | None = Field(
        None,
        ge=1,
        title="Gradient accumulation",
        description="Batches whose gradients add up into one optimizer step: the step sees "
        "batch_size x this images per process (a bigger batch than memory holds); the schedule "
        "counts optimizer steps. Empty: the recipe's (1).",
    )
    ema_decay: float | None = Field(
        None,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        title="EMA decay",
        description="Keep an exponential moving average of the weights, updated after every "
        "optimizer step with this decay (e.g. 0.999); validated, kept as the best and exported "
        "instead of the weights. 0: off. Empty: the recipe's (0).",
    )
    clip_grad_norm: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        title="Gradient clipping",
        description="Largest L2 norm of all gradients together before each step (scaled down "
        "above it); 0: no clipping. Empty: the recipe's (0).",
    )
    class_weights: Literal["none", "balanced"] | None = Field(
        None,
        title="Class weights",
        description="balanced: each class's loss weighted by images / (classes x its images) "
        "in the training set, so a rare class counts as much as a common one; none: every "
        "image alike. Empty: the recipe's (none).",
    )
    label_smoothing: float | None = Field(
        None,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        title="Label smoothing",
        description="Share of the target spread over the other classes in the training loss, "
        "0 to below 1. Empty: the recipe's (azure: 0, modern: 0.1).",
    )
    seed: int = Field(
        1,
        title="Random seed",
        description="Seeds initialisation, shuffling and augmentation: the same seed, data and "
        "hardware give the same model.",
    )
    patience: int = Field(
        3,
        gt=0,
        title="Patience",
        description="Stop early after this many epochs without a lower validation loss.",
    )
    print_frequency: int = Field(
        10,
        gt=0,
        title="Print frequency",
        description="Log the training loss every this many iterations of an epoch.",
    )
    nodes: int = Field(
        1,
        ge=1,
        title="Nodes",
        description="Machines taking part, one node's processes on each. More than 1 needs a Ray "
        "cluster (cluster).",
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        title="Processes per node",
        description="Training processes per machine; on GPU at most one per visible GPU.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        title="Device",
        description="auto: CUDA when a GPU is visible, else CPU (gloo).",
    )
    precision: Precision = Field(
        "auto",
        title="Precision",
        description="Float format of the forward pass. auto, decided from what the hardware "
        "is (never timed) and logged with its reason: on CPU bfloat16 where the CPU has AMX or "
        "AVX-512 BF16 and inputs are 64 px or more, else fp32; on GPU bfloat16 from compute "
        "capability 8.0 (A100, H100), else float16 with loss scaling. fp16 is for GPUs only. "
        "Weights and optimizer stay fp32.",
    )
    num_workers: int | None = Field(
        None,
        ge=0,
        title="Loader workers",
        description="DataLoader processes per training process (0: load in the training "
        "process). Empty: 0 on CPU, where the training processes already use every core; on GPU "
        "every core of the process's share of the node but one (forked from one fork server).",
    )
    compile: bool = Field(
        False,
        title="torch.compile",
        description="Compile the training step's network with torch.compile (TorchInductor): "
        "the first steps wait for the compiler (a minute or more), later ones may run faster. "
        "Off by default: measured in docs/benchmarks.md (train_speed) before it is a default "
        "anywhere. Validation, checkpoints and the exported model use the network uncompiled.",
    )

    cluster: str | None = Field(
        None,
        title="Ray cluster",
        description="Address of the Ray cluster that runs the job (host:port of its head "
        "or auto), one node's processes per machine, nothing shared but the "
        "servers. Empty: torchrun on this machine (nodes must be 1).",
        min_length=1,
    )
    cluster_timeout_s: int = Field(
        180,
        gt=0,
        title="Cluster wait (s)",
        description="How long to wait for the cluster to answer and to offer every node "
        "(also after a lost node, for capacity to come back) before failing.",
    )
    rdzv_timeout_s: int = Field(
        180,
        gt=0,
        title="Rendezvous wait (s)",
        description="How long the nodes of a cluster job wait for each other at the rendezvous.",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def resolved(self, pretrained: bool = False) -> TrainParams:
        """These parameters with every recipe field left empty filled from the recipe (its
        fine-tuning values when the network starts from ``pretrained`` weights)."""
        defaults = TRAINING[self.recipe] | (FINE_TUNING[self.recipe] if pretrained else {})
        return self.model_copy(update=filled(self.model_dump(), defaults))

    @model_validator(mode="before")
    @classmethod
    def _from_form_sections(cls, data: Any) -> Any:
        return flattened(data, FORM_SECTIONS)

    @model_validator(mode="after")
    def _placed(self) -> TrainParams:
        """Several nodes need a cluster to place them: torchrun alone runs on one machine."""
        if self.nodes > 1 and not self.cluster:
            raise ValueError(
                f"nodes = {self.nodes} needs a Ray cluster to run on; cluster is empty. Give "
                "the address of the cluster's head (cluster / --cluster host:6379), or nodes = 1"
            )
        return self

    @classmethod
    def checked(cls, **values: Any) -> TrainParams:
        """Validate ``values``; a bad one raises InvalidParameterError naming value and range."""
        return checked(cls, values, "training parameter")


class TrialHook(BaseModel):
    """Where a tuning trial's training reports its metric after every epoch (tasks.tune).

    Rank 0 reports to the Optuna study and asks whether to prune; the answer reaches every rank.
    Not part of the job's identity: it says where to report, not what to train, so a re-run of an
    interrupted trial (another trial number) still resumes the same run from its checkpoint.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The study's journal file; None: the database of IMAGEOPS_TUNING_STORAGE, read from the
    # environment (its URL may hold a password: it stays out of config.json and MLflow).
    storage: str | None = None
    study_name: str
    trial_number: int = Field(ge=0)
    metric: str = Field(description="The per-epoch metric reported, e.g. val/top1.")
    early_stopping: bool = Field(
        False, description="Prune when worse than the median of completed trials."
    )
    min_trials: int = Field(1, ge=1, description="Completed trials before anything is pruned.")
    min_epochs: int = Field(1, ge=1, description="A trial is judged from this epoch on.")


class RunConfig(BaseModel):
    """Everything a worker needs, resolved by the launcher; saved as ``config.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = 1
    params: TrainParams
    architecture: ModelSpec
    classes: list[str]
    # Training mode for the training set, inference mode for validation (tasks.data.transform).
    transform: TransformSpec
    train_data: Path
    val_data: Path
    # sha256 of each manifest.json: a resumed run must see the very same data.
    data_fingerprint: dict[str, str]
    data_version: dict[str, str] = Field(default_factory=dict)
    out: Path
    run_dir: Path
    mlflow_run_id: str | None = None
    device: Literal["cpu", "cuda"]
    # The precision resolved for this device (tasks.train.precision): "auto" is decided once
    # per run by the launcher and kept in config.json, so every rank, every restart and every
    # resume trains in the same format.
    precision: Resolved
    world_size: int = Field(ge=1)
    # Set when the run is a tuning trial; excluded from the job's identity (see TrialHook).
    tuning: TrialHook | None = None

    @model_validator(mode="before")
    @classmethod
    def _recipe_filled(cls, data: Any) -> Any:
        """The recipe's values in every field the request left empty, in ``params`` and in the
        transform's augmentation: a run (its identity, its records, its model) holds the values
        it trains with, never an empty field (tasks.train.recipes)."""
        if isinstance(data, dict) and "params" in data and "transform" in data:
            spec = data.get("architecture")
            pretrained = (
                spec.pretrained
                if isinstance(spec, ModelSpec)
                else dict(spec or {}).get("pretrained", False)
            )
            params = TrainParams.model_validate(data["params"]).resolved(bool(pretrained))
            transform = TransformSpec.model_validate(data["transform"])
            data = {**data, "params": params}
            data["transform"] = resolve_transform(transform, params.recipe)
        return data

    def digest(self) -> str:
        """Identity of the job: a checkpoint is only resumed by a job with the same digest."""
        # Without the data's and the output's locations (the data's identity is its fingerprint):
        # the nodes of a cluster job each hold the data and the run folder at paths of their own.
        exclude = dict.fromkeys(("tuning", "train_data", "val_data", "out", "run_dir"), True)
        exclude["params"] = set(PLACEMENT_FIELDS)
        return hashlib.sha256(self.model_dump_json(exclude=exclude).encode()).hexdigest()

    def job_key(self) -> str:
        """Identity of the training request, whichever MLflow run and run folder it lands in.

        The digest without ``run_dir`` and ``mlflow_run_id``: the same model, data (manifest
        fingerprints), parameters, transform and output give the same key, so a retry of the
        same request can find the unfinished run it started and continue it. Without the
        resolved ``precision`` too: the request is ``params.precision``, and what "auto" became
        is decided once per run and kept on its resumes, whatever the machine measures later.
        """
        exclude = dict.fromkeys(("run_dir", "mlflow_run_id", "tuning", "precision"), True)
        exclude["params"] = set(PLACEMENT_FIELDS)
        request = self.model_dump_json(exclude=exclude)
        return hashlib.sha256(request.encode()).hexdigest()

    def save(self, path: Path) -> Path:
        return write_json(path, self.model_dump(mode="json"))

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        return cls.model_validate_json(Path(path).read_bytes())


def manifest_fingerprint(root: Path) -> str:
    """sha256 of ``<root>/manifest.json``, which lists every image with its own sha256."""
    from tasks.data.imagedir import MANIFEST

    return hashlib.sha256((Path(root) / MANIFEST).read_bytes()).hexdigest()
