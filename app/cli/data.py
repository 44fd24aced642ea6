"""Data commands: sample data, Convert, Split, DVC versions, Init / Apply Image Transformation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from app.cli.root import (
    _config,
    _given,
    _options_from,
    _print_commit_hint,
    app,
    out,
    sample_app,
    transform_app,
)
from models.transform_spec import TransformSpec
from tasks.data.archive import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_MEMBER_BYTES,
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_RATIO,
)


@sample_app.command("digits")
def sample_digits(
    dest: Annotated[Path, typer.Argument(help="Folder to write (one sub-folder per digit).")],
    size: Annotated[int, typer.Option(help="Side of the square PNGs, in pixels (>= 8).")] = 32,
    per_class: Annotated[
        int | None, typer.Option(help="Keep at most this many images per digit (default: all).")
    ] = None,
) -> None:
    """Write scikit-learn's 1,797 handwritten digits as RGB PNGs in class folders."""
    from tasks.data.sample import write_digits

    write_digits(dest, size=size, per_class=per_class)
    out.print(f"wrote digits to {dest}")


@app.command()
def convert(
    source: Annotated[Path, typer.Argument(help="Image folder or .zip/.tar/.tar.gz/.tar.bz2.")],
    dest: Annotated[Path, typer.Argument(help="ImageDirectory to write (replaced atomically).")],
    max_archive_members: Annotated[
        int, typer.Option(min=1, help="Refuse an archive of more members (archive bombs).")
    ] = DEFAULT_MAX_MEMBERS,
    max_archive_bytes: Annotated[
        int, typer.Option(min=1, help="Refuse an archive that inflates to more bytes in all.")
    ] = DEFAULT_MAX_BYTES,
    max_archive_member_bytes: Annotated[
        int, typer.Option(min=1, help="Skip a member that inflates to more bytes.")
    ] = DEFAULT_MAX_MEMBER_BYTES,
    max_archive_ratio: Annotated[
        int,
        typer.Option(
            min=1,
            help="Skip a member, or refuse the archive, that inflates to more times its size "
            "(past the first 16 MiB, where any ratio is allowed).",
        ),
    ] = DEFAULT_MAX_RATIO,
    workers: Annotated[
        int | None,
        typer.Option(
            help="Processes checking images, this one included (default: every core, once the "
            "input is large enough to gain from them; 1: this process only)."
        ),
    ] = None,
) -> None:
    """Convert to Image Directory: class sub-folders become labels; broken files are reported.

    Images over IMAGEOPS_MAX_PIXELS pixels (default 40,000,000) or an aspect ratio of
    IMAGEOPS_MAX_ASPECT_RATIO:1 (default 100) are skipped, as every other step refuses them.
    """
    from tasks.data.convert import ConvertLimits
    from tasks.data.convert import convert as run
    from tasks.data.imageformat import visible_name

    limits = ConvertLimits(
        max_archive_members=max_archive_members,
        max_archive_bytes=max_archive_bytes,
        max_archive_member_bytes=max_archive_member_bytes,
        max_archive_ratio=max_archive_ratio,
    )
    manifest = run(source, dest, limits, workers=workers)
    kind = f"{len(manifest.classes)} classes" if manifest.labeled else "unlabeled"
    # Names are the user's (a file may be called "[red].png"): printed as they are, not as markup.
    out.print(
        escape(f"{dest}: {manifest.image_count} images, {kind}, {len(manifest.skipped)} skipped")
    )
    for item in manifest.skipped[:20]:
        out.print(escape(visible_name(f"  skipped {item.path}: {item.reason}")))


@app.command()
def split(
    source: Annotated[Path, typer.Argument(help="ImageDirectory to split.")],
    first: Annotated[Path, typer.Argument(help="First output (gets the fraction).")],
    second: Annotated[Path, typer.Argument(help="Second output (the rest).")],
    fraction: Annotated[float, typer.Option(help="Share of each class in FIRST, 0..1.")] = 0.9,
    seed: Annotated[int, typer.Option(help="Random seed: same seed, same split.")] = 1,
) -> None:
    """Split Image Directory, stratified by class."""
    from tasks.data.split import split as run

    a, b = run(source, first, second, fraction=fraction, seed=seed)
    out.print(f"{first}: {a.image_count} images; {second}: {b.image_count} images")


@app.command()
def version(
    path: Annotated[Path, typer.Argument(help="Folder inside the project to track with DVC.")],
    tag: Annotated[
        list[str] | None,
        typer.Option(
            help="Also record this tag of the version in the DVC remote (repeatable), e.g. v1: "
            "any machine sharing the remote then names it NAME@v1."
        ),
    ] = None,
) -> None:
    """Version a data set with DVC (dvc add + push to the configured remote); print its reference.

    The reference is NAME@md5 (NAME: the path under data/), which any machine sharing the DVC
    remote passes as its data (`imageops train`, the deployments' forms). The version also
    becomes NAME@latest there, and NAME@TAG for each --tag.
    """
    from tasks.data.data_refs import reference
    from tasks.data.version_tags import dataset_name
    from tasks.data.versioning import version as run
    from tasks.shared.settings import get_settings

    settings = get_settings()
    md5 = run(path, settings, tags=tag or ())
    # Markup off: a data set's name is the user's ("[raw]/x" is no style).
    ref = reference(dataset_name(settings.project_root / path, settings), md5)
    out.print(ref, markup=False, soft_wrap=True)
    _print_commit_hint([path], f"Version {path}")


@transform_app.command("init")
@_options_from(TransformSpec)
def transform_init(
    dest: Annotated[
        Path, typer.Argument(help="TransformationDirectory to write (transform.json).")
    ],
    config: Annotated[
        Path | None,
        typer.Option(
            help="params.yaml-shaped file: start from its `transform` section instead of the "
            "Azure design's defaults."
        ),
    ] = None,
    like_model: Annotated[
        str | None,
        typer.Option(
            help="A network of the zoo (efficientnet_b3, vit_b_16, timm/convnext_tiny.fb_in1k, "
            "...): take the size, crop share, mean and std its pretrained weights were trained "
            "on (torchvision's weights metadata, timm's pretrained_cfg); the options given "
            "still win."
        ),
    ] = None,
    **options: Any,
) -> None:
    """Init Image Transformation: save a transform spec (the Azure design's defaults, changed by the
    options given)."""
    from tasks.data.transform import init_transformation, input_size, read_transformation
    from tasks.shared.errors import InvalidTransformationDirectoryError

    base = _config(config).transform.model_dump() if config is not None else {}
    if like_model is not None:
        from models.untrained import spec_for
        from models.zoo import transform_fields

        base |= transform_fields(spec_for(like_model, pretrained=True))
    init_transformation(dest, {**base, **_given(options)})
    try:
        size = input_size(read_transformation(dest))
        out.print(f"wrote {dest} (the network sees {size}x{size} images)")
    except InvalidTransformationDirectoryError as exc:  # fine for Apply, not for training
        out.print(f"wrote {dest}; not usable for training: {exc}")


@transform_app.command("apply")
def transform_apply(
    transform: Annotated[Path, typer.Argument(help="TransformationDirectory (transform init).")],
    images: Annotated[Path, typer.Argument(help="ImageDirectory to transform.")],
    dest: Annotated[Path, typer.Argument(help="ImageDirectory to write (PNG, same classes).")],
    mode: Annotated[
        str,
        typer.Option(
            help="inference: deterministic steps only (every random transform dropped); "
            "training: the random steps too."
        ),
    ] = "inference",
    seed: Annotated[
        int, typer.Option(help="Random seed of the training mode: same seed, same images.")
    ] = 1,
) -> None:
    """Apply Image Transformation: write the transformed images as a new ImageDirectory."""
    from tasks.data.imageformat import visible_name
    from tasks.data.manifest_stream import iter_images
    from tasks.data.transform import apply_transformation

    manifest = apply_transformation(transform, images, dest, mode=mode, seed=seed)  # type: ignore[arg-type]
    sizes = sorted({(e.width, e.height) for e in iter_images(dest)})
    shown = ", ".join(f"{w}x{h}" for w, h in sizes[:5]) + (" ..." if len(sizes) > 5 else "")
    out.print(
        escape(f"{dest}: {manifest.image_count} images ({shown}), {len(manifest.skipped)} skipped")
    )
    for item in manifest.skipped[:20]:
        out.print(escape(visible_name(f"  skipped {item.path}: {item.reason}")))
