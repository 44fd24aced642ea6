"""What a training worker builds before its first epoch: data, loaders, model, optimizer.

Every rank builds the same: the datasets from the manifests the launcher checked, its shard's
loaders, the network initialised from the run's seed, the optimizer of the run's recipe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from models.untrained import ModelSpec
from models.zoo import build_model
from tasks.data.imagedir import read_manifest
from tasks.data.transform import transform_for
from tasks.shared.errors import InvalidDatasetError
from tasks.train import distributed
from tasks.train.data import (
    LoaderSetup,
    ManifestImageFolder,
    PreparedLoader,
    SeededSampler,
    ShardSampler,
    loader_workers,
    make_loader,
    training_loader,
)
from tasks.train.loop import derive_seed, seed_everything
from tasks.train.params import RunConfig, TrainParams, manifest_fingerprint
from tasks.train.precision import Amp


def configure_backends(device: torch.device) -> None:
    """Backend switches for speed on ``device``.

    On CUDA, cuDNN's autotuner (``cudnn.benchmark``) stays off: measured on an H100 for resnet50
    in bf16 channels-last (docs/benchmarks.md, "GPU (H100)"), its search cost 14.5 s in the first
    three steps and 7.9 s more for the last, smaller batch of an epoch, and the algorithms it
    found were no faster than cuDNN's own choice (3,715 against 3,746 images/s). GPU runs repeat
    a seed up to float rounding (some kernels add in a varying order); CPU runs bit for bit.
    """
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False


def prepare_model(
    spec: ModelSpec, num_classes: int, device: torch.device, seed: int, amp: Amp, size: int
) -> nn.Module:
    """The network for ``spec``, initialised from ``seed``, on ``device`` in ``amp``'s layout.

    Every rank passes the same seed: identical initial weights everywhere (DDP would broadcast
    rank 0's anyway, but a 1-process run must match too). ``size``: the input's side in pixels.
    """
    seed_everything(derive_seed(seed, "init"))
    return build_model(spec, num_classes, size).to(device, memory_format=amp.memory_format)


def build_optimizer(
    model: nn.Module, lr: float, params: TrainParams, head: set[int] | None = None
) -> torch.optim.Optimizer:
    """The run's optimizer at learning rate ``lr``: Azure's SGD with Nesterov momentum, or AdamW.

    ``params`` are resolved (:meth:`TrainParams.resolved`). Nesterov needs a momentum above 0: a
    momentum of 0 (a tuning trial may ask for it) is plain SGD. Without ``decay_norm_and_bias``,
    tensors of one dimension (biases, normalisation layers' scales and shifts) are not decayed,
    as in torchvision's and timm's recipes: decaying them only fights the normalisation.
    ``head``: the ids of the head's parameters (:func:`models.zoo.head_parameters`); the others,
    the backbone, learn at ``lr`` x ``backbone_lr_scale``, in groups marked ``backbone`` (the
    schedule holds them at 0 during ``head_only_epochs``).

    Fused: one kernel updates every parameter, where the default (foreach) makes a pass over all
    weights per term (decay, momentum, Nesterov); on CPU that saves about 5 ms a step for resnet18,
    which counts at small image sizes (docs/benchmarks.md).
    """
    head = head or set()
    groups: list[dict] = []
    for backbone in (False, True):
        members = [p for p in model.parameters() if (id(p) not in head) == backbone]
        parts = [members]
        if not params.decay_norm_and_bias:  # weights decayed; 1-D tensors not
            parts = [[p for p in members if p.ndim > 1], [p for p in members if p.ndim <= 1]]
        for i, part in enumerate(parts):
            if part:
                groups.append({
                    "params": part,
                    "weight_decay": params.weight_decay if i == 0 else 0.0,
                    "lr": lr * (params.backbone_lr_scale if backbone else 1.0),
                    "backbone": backbone,
                })  # fmt: skip
    momentum = params.momentum
    if params.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(momentum, 0.999), fused=True)
    if params.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=(momentum, 0.999), fused=True)
    if params.optimizer == "rmsprop":  # torch has no fused RMSprop
        return torch.optim.RMSprop(groups, lr=lr, momentum=momentum)
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=momentum > 0, fused=True)


def batch_mixer(
    params: TrainParams, num_classes: int
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """MixUp and/or CutMix of each training batch (one of them per batch when both are on), or
    None. torchvision's v2 transforms, on the batch once it is on the device."""
    from torchvision.transforms import v2

    mixers: list[v2.Transform] = []
    if params.mixup_alpha:
        mixers.append(v2.MixUp(alpha=params.mixup_alpha, num_classes=num_classes))
    if params.cutmix_alpha:
        mixers.append(v2.CutMix(alpha=params.cutmix_alpha, num_classes=num_classes))
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)


def weight_average(model: nn.Module, decay: float) -> nn.Module | None:
    """The exponential moving average of ``model``'s weights and buffers (torch's
    ``AveragedModel`` with its EMA function), or None when ``decay`` is 0. Every rank keeps its
    own: after each DDP step the weights are the same everywhere, so the averages are too."""
    if not decay:
        return None
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def training_loss(params: TrainParams, targets: Sequence[int], num_classes: int) -> nn.Module:
    """Cross-entropy with the run's label smoothing and, with ``class_weights`` balanced, each
    class weighted by images / (classes x its images) in ``targets`` (the training set's labels):
    scikit-learn's "balanced". A class without images gets weight 0 (it never occurs)."""
    weight = None
    if params.class_weights == "balanced":
        counts = torch.bincount(torch.as_tensor(list(targets)), minlength=num_classes).double()
        weight = torch.where(counts > 0, counts.sum() / (num_classes * counts), 0.0).float()
    return nn.CrossEntropyLoss(weight=weight, label_smoothing=params.label_smoothing)


def load_datasets(config: RunConfig) -> dict[str, ManifestImageFolder]:
    """The ``train`` and ``val`` datasets, refused if their manifests changed since the launch.

    The manifests must be the ones the launcher checked: a resumed run sees the same data.
    """
    datasets = {}
    for role, root in (("train", config.train_data), ("val", config.val_data)):
        if manifest_fingerprint(root) != config.data_fingerprint[role]:
            raise InvalidDatasetError(
                f"The {role} dataset {root} changed after this run was configured.",
                "Start a new run on the data as it is now.",
            )
        manifest = read_manifest(root)
        # Validation sees exactly what scoring will: the inference mode of the same spec.
        mode = "training" if role == "train" else "inference"
        transform = transform_for(config.transform, mode, root, manifest.transform)
        datasets[role] = ManifestImageFolder(root, manifest, transform)
    return datasets


def loader_setup(config: RunConfig, device: torch.device) -> LoaderSetup:
    """How this process makes its loaders: the run's loader processes, or the device's default."""
    return LoaderSetup(device, loader_workers(device, config.params.num_workers))


def build_loaders(
    datasets: dict[str, ManifestImageFolder],
    config: RunConfig,
    dist: distributed.DistInfo,
    setup: LoaderSetup,
) -> tuple[PreparedLoader, SeededSampler, PreparedLoader]:
    """This rank's training loader and its sampler, and its validation loader."""
    params = config.params
    train_loader, sampler = training_loader(
        datasets["train"],
        batch_size=params.batch_size,
        seed=params.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        setup=setup,
    )
    val_loader = make_loader(
        datasets["val"],
        batch_size=params.batch_size,
        sampler=ShardSampler(len(datasets["val"]), dist.rank, dist.world_size),
        setup=setup,
    )
    return train_loader, sampler, val_loader
