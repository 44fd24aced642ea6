"""Real sample data: scikit-learn's handwritten digits written as a PNG ImageFolder.

1,797 real 8x8 grayscale scans of the digits 0-9 ship inside scikit-learn, so the demo and the
tests need no download. They are written upscaled and as RGB, the way a user's photos would come.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

from models.atomic import atomic_directory
from tasks.data.datasets import holding_folders
from tasks.shared.errors import InvalidParameterError


def write_digits(
    dest: Path,
    *,
    size: int = 32,
    classes: Sequence[int] | None = None,
    per_class: int | None = None,
) -> Path:
    """Write the digits as ``dest/<digit>/<digit>_<index>.png`` (RGB, ``size`` x ``size``).

    ``classes`` keeps only those digits and ``per_class`` caps the images per digit (the first
    ones in scikit-learn's order), for small test sets. The folder is written atomically.
    """
    if size < 8:
        raise InvalidParameterError(f"size must be >= 8 (the digits are 8x8), got {size}.")
    if per_class is not None and per_class < 1:
        raise InvalidParameterError(f"per_class must be >= 1, got {per_class}.")
    digits = load_digits()
    wanted = set(range(10) if classes is None else classes)
    if not wanted or not wanted <= set(range(10)):
        raise InvalidParameterError(f"classes must be digits 0-9, got {sorted(wanted)}.")
    seen: dict[int, int] = {}
    with holding_folders(Path(dest)), atomic_directory(Path(dest)) as tmp:
        for index, (pixels, target) in enumerate(zip(digits.images, digits.target, strict=True)):
            label = int(target)
            if label not in wanted or (per_class is not None and seen.get(label, 0) >= per_class):
                continue
            seen[label] = seen.get(label, 0) + 1
            # The scans are 0..16 ink levels: invert to dark ink on white paper, like a photo.
            gray = (255 - pixels * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
            image = Image.fromarray(gray, mode="L").resize((size, size), Image.Resampling.BICUBIC)
            folder = tmp / str(label)
            folder.mkdir(exist_ok=True)
            image.convert("RGB").save(folder / f"{label}_{index:04d}.png")
    return Path(dest)
