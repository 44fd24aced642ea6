"""The sha256 of a file: images are hashed by the ten thousand, models by the hundred megabytes.

``hashlib.file_digest`` allocates a 256 KiB buffer per call, which cost more than hashing a 4 KB
image (a split of 50,000 images spent a third of its time there): a file up to
``WHOLE_READ_BYTES`` is read in one call, a larger one in blocks.
"""

from __future__ import annotations

import hashlib
import os

WHOLE_READ_BYTES = 8 << 20
_BLOCK = 1 << 20


def file_sha256(path: str | os.PathLike[str]) -> tuple[int, str]:
    """``(size, hex sha256)`` of the file at ``path``; raises OSError as ``open`` does."""
    with open(path, "rb", buffering=0) as raw:
        if os.fstat(raw.fileno()).st_size <= WHOLE_READ_BYTES:
            data = raw.readall()  # what is there now, even if it grew since the fstat
            return len(data), hashlib.sha256(data).hexdigest()
        digest, size = hashlib.sha256(), 0
        while block := raw.read(_BLOCK):
            digest.update(block)
            size += len(block)
        return size, digest.hexdigest()
