"""Training recipes: modern (the default) and azure (the Azure component, exact), each field still
the user's to set."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torchvision.transforms import v2

from models.transform_spec import AppliedTransform, TransformSpec
from models.untrained import resnet
from models.zoo import build_model
from tasks.data.transform import build_transform, check_applied, inference_steps, input_size
from tasks.shared.errors import InvalidParameterError, InvalidTransformationDirectoryError
from tasks.train.build import batch_mixer, build_optimizer, training_loss
from tasks.train.params import RunConfig, TrainParams
from tasks.train.recipes import TRAINING, resolve_transform
from tasks.train.schedule import lr_factor


def test_the_default_recipe_is_modern() -> None:
    assert TrainParams().recipe == "modern"
    assert TrainParams().resolved() == TrainParams(recipe="modern").resolved()


def test_azure_resolves_to_the_azure_components_settings() -> None:
    azure = TrainParams(recipe="azure").resolved()
    assert azure.recipe == "azure"
    assert (azure.optimizer, azure.schedule, azure.learning_rate) == ("sgd", "poly", 0.001)
    assert (azure.momentum, azure.weight_decay, azure.warmup_epochs) == (0.9, 1e-4, 0)
    assert (azure.label_smoothing, azure.decay_norm_and_bias) == (0.0, True)


def test_a_field_set_wins_over_the_recipe_and_the_rest_come_from_it() -> None:
    modern = TrainParams(recipe="modern", learning_rate=0.01, label_smoothing=0.0).resolved()
    assert (modern.learning_rate, modern.label_smoothing) == (0.01, 0.0)  # set: kept, 0 too
    assert (modern.optimizer, modern.schedule, modern.weight_decay) == ("adamw", "cosine", 0.05)
    assert modern.warmup_epochs == 1 and modern.decay_norm_and_bias is False
    assert all(getattr(modern, name) is not None for name in TRAINING["modern"])
    assert modern.resolved() == modern  # resolving again changes nothing


def test_modern_fine_tunes_a_pretrained_network_head_first_and_the_backbone_slower() -> None:
    scratch = TrainParams(recipe="modern").resolved(pretrained=False)
    assert (scratch.head_only_epochs, scratch.backbone_lr_scale) == (0, 1.0)
    tuned = TrainParams(recipe="modern").resolved(pretrained=True)
    assert (tuned.head_only_epochs, tuned.backbone_lr_scale) == (1, 0.1)
    assert TrainParams(recipe="modern", head_only_epochs=0).resolved(True).head_only_epochs == 0
    # azure stays the Azure component, pretrained or not: the whole network at one rate
    azure = TrainParams(recipe="azure")
    assert azure.resolved(pretrained=True) == azure.resolved()
    # The run's configuration (config.json, MLflow params) holds the values it resolved to.
    config = RunConfig(
        params=TrainParams(recipe="modern"), architecture=resnet("resnet18", pretrained=True),
        classes=["a", "b"], transform=TransformSpec(), train_data=Path("t"), val_data=Path("v"),
        data_fingerprint={}, out=Path("m"), run_dir=Path("r"), device="cpu", precision="fp32",
        world_size=1,
    )  # fmt: skip
    assert (config.params.head_only_epochs, config.params.backbone_lr_scale) == (1, 0.1)
    reread = RunConfig.model_validate_json(config.model_dump_json())
    assert reread.params == config.params


def test_a_bad_recipe_or_recipe_value_is_refused_naming_it() -> None:
    with pytest.raises(InvalidParameterError, match="recipe"):
        TrainParams.checked(recipe="fancy")
    with pytest.raises(InvalidParameterError, match="label_smoothing"):
        TrainParams.checked(label_smoothing=1.0)
    with pytest.raises(InvalidParameterError, match="optimizer"):
        TrainParams.checked(optimizer="lion")


def test_modern_optimizer_is_adamw_without_decay_on_norm_layers_and_biases() -> None:
    model = build_model(resnet("resnet18", pretrained=False), 3)
    flat = {id(p) for p in model.parameters() if p.ndim <= 1}
    assert flat  # batch norm scales and shifts, the head's bias

    modern = build_optimizer(model, 0.002, TrainParams(recipe="modern").resolved())
    assert isinstance(modern, torch.optim.AdamW)
    decayed, kept = modern.param_groups
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.05, 0.0)
    assert {id(p) for p in kept["params"]} == flat
    assert all(p.ndim > 1 for p in decayed["params"])
    assert decayed["lr"] == 0.002 and decayed["betas"][0] == 0.9

    azure = build_optimizer(model, 0.002, TrainParams(recipe="azure").resolved())
    assert isinstance(azure, torch.optim.SGD)
    (group,) = azure.param_groups
    assert (group["weight_decay"], group["momentum"], group["nesterov"]) == (1e-4, 0.9, True)
    assert len(group["params"]) == len(list(model.parameters()))


def test_cosine_schedule_warms_up_then_follows_half_a_cosine() -> None:
    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=10, total_steps=110, schedule="cosine")

    assert [factor(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]  # the same warm-up as poly
    assert factor(10) == 1.0
    assert factor(60) == pytest.approx(0.5)  # half way through the decay
    assert factor(35) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert factor(109) == pytest.approx((1 + math.cos(math.pi * 99 / 100)) / 2)
    assert 0 < factor(109) < 0.001
    # poly is unchanged: (1 - progress) ** 0.9
    assert lr_factor(60, warmup_steps=10, total_steps=110) == pytest.approx(0.5**0.9)


@pytest.mark.parametrize(
    ("augmentation", "kind"),
    [
        ("randaugment", v2.RandAugment),
        ("trivialaugment", v2.TrivialAugmentWide),
        ("augmix", v2.AugMix),
        ("autoaugment", v2.AutoAugment),
    ],
)
def test_an_augmentation_policy_runs_in_training_mode_only(augmentation: str, kind: type) -> None:
    spec = TransformSpec(
        resize_size=24, center_crop_size=20, augmentation=augmentation, augmentation_magnitude=5
    )
    training = build_transform(spec, "training")
    assert [type(t) for t in training.transforms].count(kind) == 1
    assert kind not in [type(t) for t in build_transform(spec, "inference").transforms]
    image = torch.randint(0, 256, (3, 30, 30), dtype=torch.uint8)
    torch.manual_seed(0)
    assert training(image).shape == (3, 20, 20) and training(image).dtype == torch.float32


def test_modern_fills_the_augmentation_a_spec_leaves_empty() -> None:
    modern = resolve_transform(TransformSpec(), "modern")
    assert (modern.augmentation, modern.augmentation_magnitude) == ("randaugment", 21)
    assert (modern.random_erasing, modern.random_erasing_probability) == (True, 0.25)
    steps = build_transform(modern, "training").transforms
    (policy,) = [t for t in steps if isinstance(t, v2.RandAugment)]
    (erasing,) = [t for t in steps if isinstance(t, v2.RandomErasing)]
    assert (policy.magnitude, erasing.p) == (21, 0.25)
    # Another policy keeps its own strength (AugMix's severity is not on RandAugment's scale).
    augmix = resolve_transform(TransformSpec(augmentation="augmix"), "modern")
    assert augmix.augmentation_magnitude is None
    (mixer,) = [
        t for t in build_transform(augmix, "training").transforms if isinstance(t, v2.AugMix)
    ]
    assert mixer.severity == 3
    mine = resolve_transform(TransformSpec(augmentation="none", random_erasing=False), "modern")
    assert (mine.augmentation, mine.random_erasing) == ("none", False)  # set: kept
    # a spec outside training runs (transform apply) leaves them empty: no policy, no erasing
    plain = [type(t) for t in build_transform(TransformSpec(), "training").transforms]
    assert v2.RandAugment not in plain and v2.RandomErasing not in plain


def _crops(spec: TransformSpec) -> list[v2.RandomResizedCrop]:
    steps = build_transform(spec, "training").transforms
    return [t for t in steps if isinstance(t, v2.RandomResizedCrop)]


def test_modern_brings_a_random_resized_crop_at_the_input_size() -> None:
    """The default spec (resize 256, center crop 224) under the default recipe: training crops
    a random half-to-all of the image to 224; inference is the resize and center crop as ever."""
    modern = resolve_transform(TransformSpec(), "modern")
    rrc = modern.random_resized_crop, modern.random_resized_crop_size
    assert (*rrc, modern.random_resized_crop_scale) == (True, 224, 0.5)
    (crop,) = _crops(modern)
    assert (tuple(crop.size), crop.scale) == ((224, 224), (0.5, 1.0))
    training = [type(t) for t in build_transform(modern, "training").transforms]
    assert v2.Resize not in training and v2.CenterCrop not in training
    assert input_size(modern) == 224
    assert inference_steps(modern) == inference_steps(TransformSpec())
    assert (inference_steps(modern)["resize"], inference_steps(modern)["center_crop"]) == (256, 224)
    inference = build_transform(modern, "inference").transforms
    assert [type(t) for t in inference[1:3]] == [v2.Resize, v2.CenterCrop]
    assert (inference[1].size, inference[2].size) == ([256], (224, 224))
    # The docs' 64 px transform: what bench/accuracy.py once asked for by options.
    small = resolve_transform(TransformSpec(resize_size=64, center_crop_size=64), "modern")
    assert (tuple(_crops(small)[0].size), _crops(small)[0].scale) == ((64, 64), (0.5, 1.0))
    assert inference_steps(small)["resize"] == 64
    # resize only: the resized image's square; padding stays around the crop
    resize_only = resolve_transform(TransformSpec(center_crop=False), "modern")
    assert resize_only.random_resized_crop_size == 256
    padded = resolve_transform(TransformSpec(pad=True, padding=4), "modern")
    assert (padded.random_resized_crop_size, input_size(padded)) == (224, 232)
    # The run records the values it resolved to (config.json, MLflow params, model.json).
    config = RunConfig(
        params=TrainParams(), architecture=resnet("resnet18", pretrained=False),
        classes=["a", "b"], transform=TransformSpec(), train_data=Path("t"), val_data=Path("v"),
        data_fingerprint={}, out=Path("m"), run_dir=Path("r"), device="cpu", precision="fp32",
        world_size=1,
    )  # fmt: skip
    assert config.transform == modern
    assert RunConfig.model_validate_json(config.model_dump_json()).transform == modern


def test_azure_leaves_the_transform_as_the_azure_component_has_it() -> None:
    azure = resolve_transform(TransformSpec(), "azure")
    rrc = azure.random_resized_crop, azure.random_resized_crop_size
    assert (*rrc, azure.random_resized_crop_scale) == (False, 256, 0.08)
    steps = [type(t) for t in build_transform(azure, "training").transforms]
    assert steps == [type(t) for t in build_transform(TransformSpec(), "training").transforms]
    assert v2.RandomResizedCrop not in steps
    switched = resolve_transform(TransformSpec(random_resized_crop=True), "azure")
    (crop,) = _crops(switched)
    assert (tuple(crop.size), crop.scale) == ((256, 256), (0.08, 1.0))


def test_a_transform_with_its_own_geometry_keeps_it_under_modern() -> None:
    off = resolve_transform(TransformSpec(random_resized_crop=False), "modern")
    assert off.random_resized_crop is False and not _crops(off)  # False is not empty
    random_crop = resolve_transform(TransformSpec(random_crop=True), "modern")
    assert random_crop.random_resized_crop is False and not _crops(random_crop)
    assert v2.RandomCrop in [type(t) for t in build_transform(random_crop, "training").transforms]
    mine = resolve_transform(
        TransformSpec(random_resized_crop_size=200, random_resized_crop_scale=0.3), "modern"
    )
    (crop,) = _crops(mine)
    assert (tuple(crop.size), crop.scale, input_size(mine)) == ((200, 200), (0.3, 1.0), 200)
    # outside a training run (transform apply) an empty field is off: no random resized crop
    assert not _crops(TransformSpec())


def test_data_prepared_before_a_recipe_filled_the_spec_is_still_the_models() -> None:
    """A model trained with modern records randaugment; the validation data it was trained on,
    prepared by `transform apply` with the same spec, has those fields empty: the same spec."""
    data_spec = TransformSpec(resize_size=20, center_crop_size=20)
    applied = AppliedTransform(spec=data_spec, mode="inference", seed=1)
    model_spec = resolve_transform(data_spec, "modern")
    assert check_applied(model_spec, applied, "val", "inference") == "inference"
    other = resolve_transform(data_spec.model_copy(update={"resize_size": 24}), "modern")
    with pytest.raises(InvalidTransformationDirectoryError, match="resize_size 20 vs 24"):
        check_applied(other, applied, "val", "inference")


def test_balanced_class_weights_make_a_rare_class_count_as_much() -> None:
    params = TrainParams(class_weights="balanced").resolved()
    loss = training_loss(params, [0, 0, 0, 0, 0, 0, 1, 1, 2], 4)  # class 3 has no image
    torch.testing.assert_close(loss.weight, torch.tensor([9 / 24, 9 / 8, 9 / 4, 0.0]))
    assert training_loss(TrainParams().resolved(), [0, 1], 2).weight is None
    smoothed = training_loss(TrainParams().resolved(), [0, 1], 2)  # modern, the default
    assert smoothed.label_smoothing == 0.1
    assert training_loss(TrainParams(recipe="azure").resolved(), [0, 1], 2).label_smoothing == 0


def test_mixup_and_cutmix_give_soft_labels_on_the_batch() -> None:
    assert batch_mixer(TrainParams().resolved(), 10) is None  # off in both recipes
    images = torch.rand(8, 3, 16, 16)
    labels = torch.arange(8) % 4
    for values in (
        {"mixup_alpha": 0.2},
        {"cutmix_alpha": 1.0},
        {"mixup_alpha": 0.2, "cutmix_alpha": 1.0},
    ):
        mix = batch_mixer(TrainParams(**values).resolved(), 4)
        torch.manual_seed(0)
        mixed, soft = mix(images, labels)
        assert mixed.shape == images.shape and soft.shape == (8, 4)
        torch.testing.assert_close(soft.sum(dim=1), torch.ones(8))
        assert (soft.max(dim=1).values < 1).any()  # labels mixed, not one-hot


def test_an_epoch_with_mixing_clipping_and_weights_trains_and_clips(tmp_path) -> None:
    """The loop's new parts on a real epoch: soft targets through the weighted, smoothed loss,
    and no gradient above the clip when the optimizer steps."""
    from torch.utils.data import DataLoader, TensorDataset

    from tasks.train.loop import StepParts, train_one_epoch
    from tasks.train.precision import Amp
    from tasks.train.schedule import build_scheduler

    torch.manual_seed(0)
    model = build_model(resnet("resnet18", pretrained=False), 3)
    params = TrainParams(
        recipe="modern", mixup_alpha=0.4, cutmix_alpha=1.0, clip_grad_norm=0.01,
        class_weights="balanced",
    ).resolved()  # fmt: skip
    data = TensorDataset(torch.rand(12, 3, 32, 32), torch.tensor([0] * 8 + [1] * 3 + [2]))
    loader = DataLoader(data, batch_size=4)
    optimizer = build_optimizer(model, 0.001, params)
    norms: list[float] = []
    optimizer.register_step_pre_hook(
        lambda opt, *_: norms.append(
            float(torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
            ))
        )
    )  # fmt: skip
    amp = Amp.for_run("cpu", "fp32", 32)
    parts = StepParts(
        optimizer,
        build_scheduler(optimizer, steps_per_epoch=3, epochs=1, warmup_epochs=1, schedule="cosine"),
        training_loss(params, data.tensors[1].tolist(), 3),
        amp.grad_scaler(),
        amp,
        torch.device("cpu"),
        mix=batch_mixer(params, 3),
        clip_grad_norm=params.clip_grad_norm,
    )
    import logging

    stats = train_one_epoch(
        model, loader, parts, epoch=1, epochs=1, print_frequency=10, log=logging.getLogger("t")
    )
    assert math.isfinite(stats.loss) and stats.images == 12
    assert len(norms) == 3 and max(norms) <= 0.01 * 1.001


def test_transfer_learning_trains_the_head_alone_then_all_with_a_slower_backbone() -> None:
    """head_only_epochs: the backbone does not move while the new head learns; then it does, at
    backbone_lr_scale times the head's rate."""
    from models.zoo import head_parameters
    from tasks.train.schedule import build_scheduler

    torch.manual_seed(0)
    spec = resnet("resnet18", pretrained=False)
    model = build_model(spec, 3)
    head = head_parameters(spec, model)
    assert head == {id(model.fc.weight), id(model.fc.bias)}
    params = TrainParams(recipe="modern", head_only_epochs=1, backbone_lr_scale=0.1).resolved()
    optimizer = build_optimizer(model, 0.01, params, head)
    rates = {(g["backbone"], g["weight_decay"]): g["lr"] for g in optimizer.param_groups}
    assert rates == {
        (False, 0.05): 0.01,
        (False, 0.0): 0.01,
        (True, 0.05): 0.001,
        (True, 0.0): 0.001,
    }
    scheduler = build_scheduler(
        optimizer, steps_per_epoch=2, epochs=3, warmup_epochs=0, schedule="cosine",
        head_only_epochs=1,
    )  # fmt: skip
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        scheduler.step()

    for _ in range(2):  # epoch 1: the head alone
        step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {"fc.weight", "fc.bias"}
    step()  # epoch 2: everything, the backbone at a tenth of the head's rate
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert "conv1.weight" in moved and "layer4.1.bn2.bias" in moved
    head_rate, backbone_rate = optimizer.param_groups[0]["lr"], optimizer.param_groups[2]["lr"]
    assert backbone_rate == pytest.approx(head_rate * 0.1) and backbone_rate > 0


def test_onecycle_is_torchs_one_cycle_and_step_falls_tenfold_each_third() -> None:
    from torch.optim.lr_scheduler import OneCycleLR

    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    reference = OneCycleLR(optimizer, max_lr=1.0, total_steps=50)
    for step in range(50):
        got = lr_factor(step, warmup_steps=5, total_steps=50, schedule="onecycle")  # no warm-up
        assert got == pytest.approx(optimizer.param_groups[0]["lr"], abs=1e-9), step
        optimizer.step()
        reference.step()
    factors = [lr_factor(s, warmup_steps=10, total_steps=100, schedule="step") for s in range(100)]
    assert factors[9] == 1.0 and set(factors[10:40]) == {1.0}
    assert factors[40:70] == pytest.approx([0.1] * 30)
    assert factors[70:] == pytest.approx([0.01] * 30)


@pytest.mark.parametrize(
    ("optimizer", "kind"),
    [("adam", torch.optim.Adam), ("rmsprop", torch.optim.RMSprop), ("adamw", torch.optim.AdamW)],
)
def test_every_optimizer_is_torchs_with_the_runs_momentum_and_decay(
    optimizer: str, kind: type
) -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    params = TrainParams(
        recipe="azure", optimizer=optimizer, momentum=0.8, weight_decay=0.01
    ).resolved()
    built = build_optimizer(model, 0.1, params)
    assert type(built) is kind
    group = built.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.1, 0.01)  # azure decays every tensor
    if optimizer == "rmsprop":
        assert group["momentum"] == 0.8
    else:
        assert group["betas"] == (0.8, 0.999)
    model(torch.rand(5, 4)).sum().backward()
    built.step()  # it trains


def test_accumulated_batches_make_the_step_one_big_batch_makes() -> None:
    """Two batches of 2 accumulated = one batch of 4 (a model without batch statistics); an
    epoch of 3 batches with accumulation 2 makes 2 optimizer steps (the last window is short)."""
    import logging

    from torch.utils.data import DataLoader, TensorDataset

    from tasks.train.loop import StepParts, train_one_epoch
    from tasks.train.precision import Amp
    from tasks.train.schedule import build_scheduler

    data = TensorDataset(torch.rand(6, 5), torch.tensor([0, 1, 2, 0, 1, 2]))
    amp = Amp.for_run("cpu", "fp32", 32)
    params = TrainParams(optimizer="sgd", momentum=0.0, weight_decay=0.0).resolved()

    def trained(batch: int, accumulation: int, images: int) -> tuple[nn.Module, int]:
        torch.manual_seed(0)
        model = nn.Linear(5, 3)
        optimizer = build_optimizer(model, 0.5, params)
        steps: list[int] = []
        optimizer.register_step_post_hook(lambda *_: steps.append(1))
        subset = torch.utils.data.Subset(data, range(images))
        loader = DataLoader(subset, batch_size=batch)
        scheduler = build_scheduler(optimizer, steps_per_epoch=9, epochs=1, warmup_epochs=0)
        parts = StepParts(
            optimizer, scheduler, nn.CrossEntropyLoss(), amp.grad_scaler(), amp,
            torch.device("cpu"), accumulation=accumulation,
        )  # fmt: skip
        train_one_epoch(model, loader, parts, epoch=1, epochs=1, print_frequency=10,
                        log=logging.getLogger("t"))  # fmt: skip
        return model, len(steps)

    big, big_steps = trained(batch=4, accumulation=1, images=4)
    small, small_steps = trained(batch=2, accumulation=2, images=4)
    assert (big_steps, small_steps) == (1, 1)
    torch.testing.assert_close(small.weight, big.weight)
    torch.testing.assert_close(small.bias, big.bias)
    _, steps = trained(batch=2, accumulation=2, images=6)
    assert steps == 2


def test_the_weight_average_follows_each_step_and_survives_a_resume(tmp_path) -> None:
    """EMA: the average after each optimizer step is decay x average + (1 - decay) x weights;
    a checkpoint keeps it, and a resumed run continues from it, not from the weights."""
    from tasks.train.build import weight_average
    from tasks.train.checkpoint import save_checkpoint
    from tasks.train.loop import StepParts
    from tasks.train.precision import Amp
    from tasks.train.progress import Progress, checkpoint_state, resume
    from tasks.train.run_folder import CHECKPOINT
    from tasks.train.schedule import build_scheduler

    assert weight_average(nn.Linear(2, 2), 0.0) is None  # off

    def parts_for(model: nn.Module) -> StepParts:
        optimizer = build_optimizer(model, 0.1, TrainParams(ema_decay=0.5).resolved())
        ema = weight_average(model, 0.5)
        optimizer.register_step_post_hook(lambda *_: ema.update_parameters(model))
        scheduler = build_scheduler(optimizer, steps_per_epoch=4, epochs=1, warmup_epochs=0)
        amp = Amp.for_run("cpu", "fp32", 32)
        return StepParts(optimizer, scheduler, nn.CrossEntropyLoss(), amp.grad_scaler(), amp,
                         torch.device("cpu"), ema=ema)  # fmt: skip

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    parts = parts_for(model)
    expected = model.weight.detach().clone()
    for step in range(3):
        parts.optimizer.zero_grad()
        model(torch.rand(4, 3)).sum().backward()
        parts.optimizer.step()
        current = model.weight.detach()
        expected = current.clone() if step == 0 else 0.5 * expected + 0.5 * current
    torch.testing.assert_close(parts.ema.module.weight, expected)
    assert not torch.equal(parts.ema.module.weight, model.weight)  # an average, not the weights

    config = RunConfig(
        params=TrainParams(ema_decay=0.5), architecture=resnet("resnet18", pretrained=False),
        classes=["a", "b"], transform=TransformSpec(), train_data=Path("t"), val_data=Path("v"),
        data_fingerprint={}, out=tmp_path / "model", run_dir=tmp_path, device="cpu",
        precision="fp32", world_size=1,
    )  # fmt: skip
    progress = Progress()
    progress.epoch = 1
    save_checkpoint(tmp_path / CHECKPOINT, checkpoint_state(config, model, parts, progress))
    fresh = nn.Linear(3, 2)
    fresh_parts = parts_for(fresh)
    _, _, resumed = resume(config, fresh, fresh_parts, primary=False)
    assert resumed
    torch.testing.assert_close(fresh_parts.ema.module.weight, parts.ema.module.weight)
    torch.testing.assert_close(fresh.weight, model.weight)


def test_the_random_resized_crops_smallest_share_reaches_torchvision() -> None:
    spec = TransformSpec(random_resized_crop=True, random_resized_crop_size=20,
                         random_resized_crop_scale=0.5)  # fmt: skip
    (crop,) = [t for t in build_transform(spec, "training").transforms
               if isinstance(t, v2.RandomResizedCrop)]  # fmt: skip
    assert (crop.scale, tuple(crop.size)) == ((0.5, 1.0), (20, 20))
    (azure,) = [t for t in build_transform(TransformSpec(random_resized_crop=True), "training")
                .transforms if isinstance(t, v2.RandomResizedCrop)]  # fmt: skip
    assert azure.scale == (0.08, 1.0)
