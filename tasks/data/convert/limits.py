"""Convert's caps, as one value: what one image and one archive may be before they are refused.

The CLI (`imageops convert --max-archive-members ...`), the pipeline and the tests build one
:class:`ConvertLimits` and pass it whole; it is checked once, when it is made.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tasks.data.archive import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_MEMBER_BYTES,
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_RATIO,
)
from tasks.data.imagecheck import DEFAULT_MAX_ASPECT_RATIO, DEFAULT_MAX_PIXELS
from tasks.shared.errors import InvalidParameterError

_IMAGE_LIMITS = ("max_pixels", "max_aspect_ratio")


@dataclass(frozen=True)
class ConvertLimits:
    """Per image: ``max_pixels`` (width x height) and ``max_aspect_ratio`` (longer side over
    shorter side) refuse decompression bombs and slivers from the header. Per archive:
    ``max_archive_members``, ``max_archive_bytes`` (in total), ``max_archive_member_bytes`` (per
    member) and ``max_archive_ratio`` (inflated over compressed size) cap what it may unpack to
    (see :mod:`tasks.data.archive`). Every value is a whole number >= 1 (InvalidParameterError)."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_aspect_ratio: int = DEFAULT_MAX_ASPECT_RATIO
    max_archive_members: int = DEFAULT_MAX_MEMBERS
    max_archive_bytes: int = DEFAULT_MAX_BYTES
    max_archive_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES
    max_archive_ratio: int = DEFAULT_MAX_RATIO

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(
                    f"{item.name} must be a whole number >= 1, got {value!r}."
                )

    def images(self) -> dict[str, int]:
        """The per-image limits, as :class:`tasks.data.imagecheck.CheckJob` takes them."""
        return {name: getattr(self, name) for name in _IMAGE_LIMITS}

    def archive(self) -> dict[str, int]:
        """The archive caps, named as the CLI options are."""
        return {k: v for k, v in asdict(self).items() if k not in _IMAGE_LIMITS}


def check_workers(workers: int | None) -> None:
    """``workers`` is None (every core) or a whole number >= 1."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)):
        raise InvalidParameterError(f"workers must be a whole number >= 1, got {workers!r}.")
    if workers is not None and workers < 1:
        raise InvalidParameterError(
            f"workers must be >= 1, got {workers}.", "Leave it out to use every core."
        )


def check_apart(source: Path, dest: Path) -> None:
    """Refuse a ``dest`` that overlaps ``source``: replacing it would delete the source, or the
    output would be read as input."""
    src, dst = source.resolve(), dest.resolve()
    if src == dst or src.is_relative_to(dst) or dst.is_relative_to(src):
        raise InvalidParameterError(
            f"dest {dest} and source {source} overlap.",
            "Write the ImageDirectory to a folder outside the source, e.g. data/images.",
        )
