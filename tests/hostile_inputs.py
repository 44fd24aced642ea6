"""The hostile-input corpus: inputs a careless or malicious user may hand imageops, built in code.

Each :class:`Case` writes its input under a throw-away folder (no binary test files in git), names
the command a user would type and the outcome it must end in: ``ok: <what the report says>``, or
the name of the error class whose message (and "what to do" hint) the CLI prints. The test
(``tests/test_hostile_inputs.py``) runs every case through the CLI; ``python -m
tests.hostile_inputs --write docs/reliability.md`` writes the table of cases for the docs, so the
two never drift apart.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import sys
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

STEPS = (
    "convert", "split", "transform", "train", "export", "score", "evaluate", "tune", "promote",
    "run", "cli",
)  # fmt: skip
PICKLE_MARKER = "unpickled-a-user-file"  # what the pickle payloads create if anyone loads them


@dataclass(frozen=True)
class Inputs:
    """What a case builds from: its own folder and the shared (read-only) sample data."""

    root: Path  # the case's folder: inputs under root/in, outputs under root/out
    digits: Path  # raw digits: class folders 0, 1, 2 of 16x16 RGB PNGs
    train: Path  # labeled ImageDirectories split from the digits
    val: Path
    model: Path  # an exported ModelDirectory (model.json, safetensors, model.onnx): copy it first

    @property
    def src(self) -> Path:
        return self.root / "in"

    @property
    def out(self) -> Path:
        return self.root / "out"


@dataclass(frozen=True)
class Run:
    """The command to run (``imageops`` arguments) and where its output goes."""

    argv: list[str]
    dest: Path  # nothing may appear outside it; after a failure it holds nothing new
    made: str = ""  # after success, this file exists under dest ("" : dest itself is the file)
    forbidden: tuple[Path, ...] = ()  # paths an escape would write (../../x, absolute names)
    removed: tuple[Path, ...] = ()  # a killed run's leftovers beside dest: gone after the run
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    id: str
    step: str
    description: str
    build: Callable[[Inputs], Run]
    expect: str  # "ok: <report text>" or the error class name
    says: str = ""  # text the error message must contain (errors only)
    slow: bool = False  # runs torchrun
    memory: bool = False  # tests/test_memory_bounds.py also measures its peak memory


# --- building blocks ----------------------------------------------------------------------------


def _digits(io_: Inputs, dest: Path, per_class: int = 3, classes: tuple[str, ...] = ("0", "1")):
    """Copy a few real digit PNGs into class folders under ``dest``."""
    for label in classes:
        (dest / label).mkdir(parents=True, exist_ok=True)
        for png in sorted((io_.digits / label).glob("*.png"))[:per_class]:
            shutil.copy(png, dest / label / png.name)
    return dest


def _jpeg_bytes(io_: Inputs, mode: str = "RGB") -> bytes:
    from PIL import Image

    image = Image.open(next((io_.digits / "0").glob("*.png"))).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(side: int = 30_000) -> bytes:
    """A valid side x side 1-bit PNG of one colour: a few hundred KB that decode to 900 Mpixels."""
    row = b"\x00" + b"\x00" * ((side + 7) // 8)
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def _png16(width: int = 16, height: int = 16) -> bytes:
    """A 48-bit RGB PNG (16 bits per channel), written by hand: Pillow cannot write one."""
    row = b"\x00" + struct.pack(">HHH", 65535, 32768, 0) * width
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0))
        + _png_chunk(b"IDAT", zlib.compress(row * height))
        + _png_chunk(b"IEND", b"")
    )


class _Payload:
    """Unpickling this creates PICKLE_MARKER in the working folder: proof that a load ran code."""

    def __init__(self, where: Path) -> None:
        self.where = str(where / PICKLE_MARKER)

    def __reduce__(self):
        return (open, (self.where, "w"))


def pickle_payload(where: Path) -> bytes:
    import pickle

    return pickle.dumps(_Payload(where))


def _convert(io_: Inputs, source: Path, **kwargs: object) -> Run:
    return Run(["convert", str(source), str(io_.out / "images")], io_.out / "images", **kwargs)


def _tar_of(io_: Inputs, members: Callable[[tarfile.TarFile], None], name: str = "a.tar") -> Path:
    """A tar of two digit classes plus what ``members`` adds."""
    good = _digits(io_, io_.root / "staging")
    archive = io_.src / name
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w") as tar:
        tar.add(good, arcname="digits")
        members(tar)
    shutil.rmtree(good)
    return archive


def _tar_entry(tar: tarfile.TarFile, name: str, kind: bytes, link: str) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    tar.addfile(info)


def _zip_of(io_: Inputs, extra: dict[str, bytes], name: str = "a.zip") -> Path:
    """A zip of two digit classes plus the members in ``extra`` (name -> bytes)."""
    good = _digits(io_, io_.root / "staging")
    archive = io_.src / name
    archive.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(good.rglob("*.png")):
            zf.write(path, f"digits/{path.relative_to(good).as_posix()}")
        for member, data in extra.items():
            zf.writestr(member, data)
    shutil.rmtree(good)
    return archive


def _untrained(io_: Inputs, arch: str = "resnet18") -> Path:
    from models.untrained import resnet, write_untrained

    folder = write_untrained(resnet("resnet18", pretrained=False), io_.src / "untrained")
    if arch != "resnet18":  # an architecture imageops does not know, as a hand-edited file says
        spec = json.loads((folder / "model.json").read_text())
        (folder / "model.json").write_text(json.dumps({**spec, "arch": arch}))
    return folder


def _imagedir(io_: Inputs, name: str, classes: tuple[str, ...], labeled: bool = True) -> Path:
    """A small ImageDirectory converted from the digits (unlabeled: a flat folder)."""
    from tasks.data.convert import convert

    raw = _digits(io_, io_.root / f"raw-{name}", per_class=4, classes=classes)
    if not labeled:
        for png in list(raw.rglob("*.png")):
            png.rename(raw / f"{png.parent.name}-{png.name}")
        for folder in [p for p in raw.iterdir() if p.is_dir()]:
            folder.rmdir()
    convert(raw, io_.src / name)
    shutil.rmtree(raw)
    return io_.src / name


def _train(io_: Inputs, model: Path, train: Path, val: Path, *options: str) -> Run:
    from flows.config import DEMO_TRANSFORM
    from tasks.data.transform import init_transformation

    dest = io_.out / "model"
    transform = init_transformation(io_.root / "transform-32", DEMO_TRANSFORM)  # the digits' size
    argv = ["train", str(model), str(train), str(val), str(dest), "--epochs", "1"]
    argv += ["--transform", str(transform)]
    return Run([*argv, "--batch-size", "4", "--device", "cpu", *options], dest, made="model.json")


def _model_copy(io_: Inputs) -> Path:
    return Path(shutil.copytree(io_.model, io_.src / "model"))


def _score(io_: Inputs, model: str, images: Path, name: str = "scores.csv") -> Run:
    return Run(["score", model, str(images), str(io_.out / name)], io_.out / name)


def _tuning_spec(io_: Inputs, parameter: str) -> Run:
    spec = io_.src / "tuning.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(
        "study_name: hostile\nmetric: val/top1\ngoal: maximize\nmax_trial_count: 1\n"
        f"parameters:\n{parameter}"
    )
    return _tune(io_, spec)


def _tune(io_: Inputs, spec: Path) -> Run:
    # A configured (unreachable) Prefect API: the spec is refused before anything calls it, and no
    # temporary server is started for a command that cannot run.
    argv = ["tune", str(spec), "--train-data", str(io_.train), "--val-data", str(io_.val)]
    return Run(argv, io_.out, env={"PREFECT_API_URL": "http://127.0.0.1:9/api"})


# --- the cases ----------------------------------------------------------------------------------


def _truncated_jpeg(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    whole = _jpeg_bytes(io_)
    (io_.src / "0" / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    return _convert(io_, io_.src, made="manifest.json")


def _zero_byte(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    (io_.src / "1" / "empty.png").write_bytes(b"")
    return _convert(io_, io_.src, made="manifest.json")


def _text_as_png(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    (io_.src / "1" / "notes.png").write_text("this is not a picture\n")
    return _convert(io_, io_.src, made="manifest.json")


def _deep_and_cmyk(io_: Inputs) -> Run:
    from PIL import Image

    _digits(io_, io_.src)
    (io_.src / "0" / "rgb48.png").write_bytes(_png16())
    Image.new("I;16", (16, 16), 40000).save(io_.src / "0" / "gray16.png")
    (io_.src / "1" / "cmyk.jpg").write_bytes(_jpeg_bytes(io_, "CMYK"))
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(io_.src / "1" / "cmyk.tif")
    return _convert(io_, io_.src, made="manifest.json")


def _bomb(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    (io_.src / "0" / "bomb.png").write_bytes(png_bomb())
    return _convert(io_, io_.src, made="manifest.json")


def _zip_traversal(io_: Inputs) -> Run:
    archive = _zip_of(io_, {"../../x": b"escaped", "digits/0/../../../x.png": b"escaped"})
    out = io_.out / ".images.extract-anything"  # where members land: two levels up is root
    forbidden = (out.parent.parent / "x", io_.root.parent / "x", io_.root.parent / "x.png")
    return _convert(io_, archive, made="manifest.json", forbidden=forbidden)


def _zip_absolute(io_: Inputs) -> Run:
    target = io_.root.parent / f"{io_.root.name}-absolute.png"
    archive = _zip_of(io_, {str(target): b"escaped"})
    return _convert(io_, archive, made="manifest.json", forbidden=(target,))


def _tar_symlink(io_: Inputs) -> Run:
    target = io_.root.parent / f"{io_.root.name}-via-link"

    def links(tar: tarfile.TarFile) -> None:
        _tar_entry(tar, "digits/0/passwd.png", tarfile.SYMTYPE, "/etc/passwd")
        _tar_entry(tar, "digits/up", tarfile.SYMTYPE, "../../..")
        info = tarfile.TarInfo(f"digits/up/{target.name}")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))

    return _convert(io_, _tar_of(io_, links), made="manifest.json", forbidden=(target,))


def _tar_hardlink(io_: Inputs) -> Run:
    def links(tar: tarfile.TarFile) -> None:
        _tar_entry(tar, "digits/1/shadow.png", tarfile.LNKTYPE, "/etc/shadow")
        _tar_entry(tar, "digits/1/again.png", tarfile.LNKTYPE, "digits/1/missing.png")

    return _convert(io_, _tar_of(io_, links, "a.tar.gz"), made="manifest.json")


def _nested_archive(io_: Inputs) -> Run:
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("../../inner-escape.png", b"escaped")
    archive = _zip_of(io_, {"digits/0/inner.zip": inner.getvalue()})
    return _convert(io_, archive, made="manifest.json", forbidden=(io_.root / "inner-escape.png",))


def _unicode_names(io_: Inputs) -> Run:
    src = io_.src
    for label, name in (("café crème", "naïve one.png"), ("数字 2", "画像 01.png")):
        (src / label).mkdir(parents=True)
        for i, png in enumerate(sorted((io_.digits / "0").glob("*.png"))[:3]):
            shutil.copy(png, src / label / f"{i} {name}")
    return _convert(io_, src, made="manifest.json")


def _markup_names(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    (io_.src / "[bold]").mkdir()
    shutil.copy(next((io_.digits / "2").glob("*.png")), io_.src / "[bold]" / "[i]2.png")
    (io_.src / "0" / "[red]broken.png").write_bytes(b"no image")
    return _convert(io_, io_.src, made="manifest.json")


def _empty_class(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    (io_.src / "9").mkdir()
    return _convert(io_, io_.src, made="manifest.json")


def _single_class(io_: Inputs) -> Run:
    _digits(io_, io_.src, classes=("0",))
    return _convert(io_, io_.src, made="manifest.json")


def _markup_missing(io_: Inputs) -> Run:
    (io_.src / "[").mkdir(parents=True)
    return _convert(io_, io_.src / "[" / "]nowhere")


def _only_junk(io_: Inputs) -> Run:
    (io_.src / "0").mkdir(parents=True)
    (io_.src / "0" / "a.png").write_bytes(b"")
    (io_.src / "0" / "b.jpg").write_text("text")
    return _convert(io_, io_.src)


def _missing_source(io_: Inputs) -> Run:
    return _convert(io_, io_.src / "nowhere")


def _dest_in_source(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    return Run(["convert", str(io_.src), str(io_.src / "images")], io_.src / "images")


def _cut_archive(io_: Inputs) -> Run:
    archive = _tar_of(io_, lambda tar: None, "a.tar.gz")
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    return _convert(io_, archive)


def _csv_escape(io_: Inputs) -> Run:
    _digits(io_, io_.src / "photos")
    rows = [f"photos/{p.relative_to(io_.src / 'photos').as_posix()},{p.parent.name}"
            for p in sorted((io_.src / "photos").rglob("*.png"))]  # fmt: skip
    rows += ["../../../etc/passwd,0", "/etc/hostname,1"]
    (io_.src / "labels.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return _convert(io_, io_.src / "labels.csv", made="manifest.json")


def _precious(path: Path, text: str = "the only copy of my notes\n") -> Path:
    """A file of the user's where an output folder is asked for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _convert_dest_file(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    dest = _precious(io_.out / "images")
    return Run(["convert", str(io_.src), str(dest)], dest)


def _convert_dest_foreign(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    dest = io_.out / "documents"
    _precious(dest / "notes.txt")
    return Run(["convert", str(io_.src), str(dest)], dest)


def _split_dest_file(io_: Inputs) -> Run:
    dest = io_.out / "split"
    _precious(dest / "b")
    return Run(["split", str(io_.train), str(dest / "a"), str(dest / "b")], dest)


def _transform_init_dest_file(io_: Inputs) -> Run:
    dest = _precious(io_.out / "transform")
    return Run(["transform", "init", str(dest), "--resize-size", "16"], dest)


def _transform_apply_dest_link(io_: Inputs) -> Run:
    from tasks.data.transform import init_transformation

    spec = init_transformation(io_.src / "transform", {"resize_size": 16})
    dest = io_.out / "images"
    dest.symlink_to(_precious(io_.out / "elsewhere" / "notes.txt").parent)
    return Run(["transform", "apply", str(spec), str(io_.val), str(dest)], io_.out)


def _train_out_file(io_: Inputs) -> Run:
    run = _train(io_, _untrained(io_), io_.train, io_.val)
    _precious(run.dest)
    return Run(run.argv, run.dest)


def _coco_deep(io_: Inputs) -> Run:
    _digits(io_, io_.src / "photos")
    images = [{"id": i, "file_name": f"photos/{p.relative_to(io_.src / 'photos').as_posix()}"}
              for i, p in enumerate(sorted((io_.src / "photos").rglob("*.png")))]  # fmt: skip
    head = json.dumps({"images": images, "categories": [{"id": 0, "name": "0"}]})
    deep = "[" * 100_000 + "]" * 100_000  # 200 KB: a list in a list ... 100,000 deep
    (io_.src / "labels.json").write_text(head[:-1] + ', "info": ' + deep + "}")
    return _convert(io_, io_.src / "labels.json")


def _coco_huge(io_: Inputs) -> Run:
    from tasks.data.labelfiles import MAX_LABEL_FILE_BYTES

    _digits(io_, io_.src / "photos")
    with open(io_.src / "labels.json", "wb") as fh:  # sparse: no disk used, no time spent
        fh.truncate(MAX_LABEL_FILE_BYTES + 1)
    return _convert(io_, io_.src / "labels.json")


# --- memory: hostile sizes (issue 18) -----------------------------------------------------------
# Each of these once made a command take gigabytes; tests/test_memory_bounds.py runs them as
# subprocesses and checks that peak memory stays near a run on a small normal input.

GiB = 1024**3
_MiB = 1024**2
# zlib.crc32 of 4,095 MiB of zeros (computed once: it takes a second).
_CRC_4095_MIB_OF_ZEROS = 0x65D3537A


def _zeros_deflated(mib: int) -> bytes:
    """Raw deflate of ``mib`` MiB of zeros, about 1 KB a MiB, made without compressing them all.

    After a full flush a compressor starts afresh, so each MiB compresses to the same block:
    compress one, repeat it, end with an empty final block.
    """
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = packer.compress(bytes(_MiB)) + packer.flush(zlib.Z_FULL_FLUSH)
    return block * mib + b"\x03\x00"


def _crafted_zip(path: Path, members: list[tuple[str, int, int, bytes]]) -> Path:
    """A zip written byte by byte: ``(name, crc32, size declared, deflated data)`` per member, so
    a member may inflate to gigabytes (or declare what it likes) without being compressed here."""
    local, central = b"", b""
    for name, crc, size, data in members:
        raw = name.encode()
        fields = (20, 0, 8, 0, 33, crc, len(data), size, len(raw))  # 33: 1980-01-01
        central += struct.pack("<IH", 0x02014B50, 20) + struct.pack("<HHHHHIIIH", *fields)
        central += struct.pack("<HHHHII", 0, 0, 0, 0, 0, len(local)) + raw
        local += struct.pack("<I", 0x04034B50) + struct.pack("<HHHHHIIIH", *fields)
        local += struct.pack("<H", 0) + raw + data
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, *[len(members)] * 2, len(central),
                      len(local), 0)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(local + central + end)
    return path


def _digit_members(io_: Inputs) -> list[tuple[str, int, int, bytes]]:
    """The digit PNGs of two classes, as :func:`_crafted_zip` members under ``digits/``."""
    members = []
    for label in ("0", "1"):
        for png in sorted((io_.digits / label).glob("*.png"))[:3]:
            packer = zlib.compressobj(9, zlib.DEFLATED, -15)
            data = png.read_bytes()
            deflated = packer.compress(data) + packer.flush()
            members.append((f"digits/{label}/{png.name}", zlib.crc32(data), len(data), deflated))
    return members


def png_strip(width: int, height: int) -> bytes:
    """A valid 8-bit gray PNG of ``width`` x ``height``: 1x600,000 is 1.2 KB on disk."""
    row = b"\x00" + b"\x80" * width
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def _sparse(path: Path, size: int, head: bytes = b"") -> Path:
    """A file of ``size`` bytes that takes no disk and no time: ``head``, then a hole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size)
    return path


def _big_non_image(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    _sparse(io_.src / "0" / "clip.mov", 3 * GiB)
    return _convert(io_, io_.src, made="manifest.json")


def _big_png_file(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    ihdr = struct.pack(">IIBBBBB", 16, 16, 8, 0, 0, 0, 0)
    head = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
    _sparse(io_.src / "1" / "huge.png", 3 * GiB, head)
    return _convert(io_, io_.src, made="manifest.json")


def _zip_member_bomb(io_: Inputs) -> Run:
    bomb = ("digits/0/zeros.png", _CRC_4095_MIB_OF_ZEROS, 4095 * _MiB, _zeros_deflated(4095))
    return _convert(io_, _crafted_zip(io_.src / "a.zip", [*_digit_members(io_), bomb]))


def _zip_lying_sizes(io_: Inputs) -> Run:
    liar = ("digits/0/zeros.png", _CRC_4095_MIB_OF_ZEROS, 1_000, _zeros_deflated(4095))
    archive = _crafted_zip(io_.src / "a.zip", [*_digit_members(io_), liar])
    return _convert(io_, archive, made="manifest.json")


def _zip_ratio(io_: Inputs) -> Run:
    crc = zlib.crc32(bytes(8 * _MiB))
    small = [(f"digits/1/zeros{i:03d}.png", crc, 8 * _MiB, _zeros_deflated(8)) for i in range(200)]
    return _convert(io_, _crafted_zip(io_.src / "a.zip", [*_digit_members(io_), *small]))


def _tgz_ratio(io_: Inputs) -> Run:
    """A .tar.gz of 64 members of 4 MiB of zeros, deflated as :func:`_zeros_deflated` does: only
    inflating it tells how big it is (a tar has no table of contents)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = packer.compress(bytes(_MiB)) + packer.flush(zlib.Z_FULL_FLUSH)
    body, crc, size = b"", 0, 0
    for i in range(64):
        info = tarfile.TarInfo(f"digits/1/zeros{i:02d}.png")
        info.size = 4 * _MiB
        header = info.tobuf(tarfile.GNU_FORMAT)
        body += packer.compress(header) + packer.flush(zlib.Z_FULL_FLUSH) + block * 4
        crc, size = zlib.crc32(header, crc), size + len(header) + info.size
        for _ in range(4):
            crc = zlib.crc32(bytes(_MiB), crc)
    end = bytes(2 * tarfile.BLOCKSIZE)
    body += packer.compress(end) + packer.flush()
    crc, size = zlib.crc32(end, crc), size + len(end)
    archive = io_.src / "a.tar.gz"
    archive.parent.mkdir(parents=True, exist_ok=True)
    gzip_header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    archive.write_bytes(gzip_header + body + struct.pack("<II", crc, size & 0xFFFFFFFF))
    return _convert(io_, archive)


def _strip_convert(height: int) -> Callable[[Inputs], Run]:
    def build(io_: Inputs) -> Run:
        _digits(io_, io_.src)
        (io_.src / "0" / "strip.png").write_bytes(png_strip(1, height))
        return _convert(io_, io_.src, made="manifest.json")

    return build


def _score_oversized(io_: Inputs) -> Run:
    """Scoring loads every image itself: one run (ONNX Runtime starts in seconds) for all three."""
    images = _digits(io_, io_.src / "images", per_class=2)
    (images / "0" / "strip-600k.png").write_bytes(png_strip(1, 600_000))
    (images / "1" / "strip-2m.png").write_bytes(png_strip(1, 2_000_000))
    _sparse(images / "1" / "huge.png", 3 * GiB, b"\x89PNG\r\n\x1a\n")
    return _score(io_, str(io_.model), images)


def _killed_leftovers(dest: Path, folders: list[str], files: list[str]) -> tuple[Path, ...]:
    """What a SIGKILLed run writing ``dest`` leaves beside it (no live process holds them), and
    names that look alike but are not its own (kept: the test sees any change outside dest)."""
    names = {
        "tmp": f".{dest.name}.0123abcd.tmp",
        "old": f".{dest.name}.89abcdef.old",
        "extract": f".{dest.name}.extract-k3j_h5g6",  # tempfile's letters: an older version's
        "shards": f".{dest.name}.shards-0123abcd",
    }
    for name in [f".{dest.name}.tmp", f".{dest.name}X.0123abcd.tmp", f"{dest.name}.0123abcd.tmp"]:
        (dest.parent / name).write_text("not imageops'")
    for kind in folders:
        (dest.parent / names[kind] / "0").mkdir(parents=True)
        (dest.parent / names[kind] / "0" / "half.png").write_bytes(b"\x89PNG")
    for kind in files:
        (dest.parent / names[kind]).write_text("path,Scored Labels\nhalf")
    return tuple(dest.parent / names[kind] for kind in folders + files)


def _convert_after_kill(io_: Inputs) -> Run:
    _digits(io_, io_.src / "photos")
    run = _convert(io_, io_.src / "photos", made="manifest.json")
    return replace(run, removed=_killed_leftovers(run.dest, ["tmp", "old", "extract"], []))


def _score_after_kill(io_: Inputs) -> Run:
    _digits(io_, io_.src / "images", per_class=2)
    run = _score(io_, str(io_.model), io_.src / "images")
    return replace(run, removed=_killed_leftovers(run.dest, ["shards"], ["tmp"]))


def _split_raw(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    dest = io_.out / "split"
    return Run(["split", str(io_.src), str(dest / "a"), str(dest / "b")], dest)


def _split_bad_manifest(io_: Inputs) -> Run:
    images = Path(shutil.copytree(io_.train, io_.src / "train"))
    (images / "manifest.json").write_text('{"images": [{"path": "../../etc/passwd"')
    dest = io_.out / "split"
    return Run(["split", str(images), str(dest / "a"), str(dest / "b")], dest)


def _tampered(io_: Inputs, path: str, outside: Path | None = None) -> Path:
    """A copy of the training ImageDirectory whose first manifest entry is replaced by ``path``.

    ``outside``: a real digit PNG is put there first, so that a step that followed the entry would
    find an image to read (and split one to copy) rather than fail on a missing file.
    """
    images = Path(shutil.copytree(io_.train, io_.src / "tampered"))
    if outside is not None:
        outside.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(next((io_.digits / "0").glob("*.png")), outside)
    manifest = json.loads((images / "manifest.json").read_text())
    manifest["images"][0]["path"] = path
    (images / "manifest.json").write_text(json.dumps(manifest))
    return images


def _split_manifest_traversal(io_: Inputs) -> Run:
    images = _tampered(io_, "../../escaped/pwned.png", io_.root / "escaped" / "pwned.png")
    dest = io_.out / "split"
    forbidden = (io_.out / "escaped", dest / "escaped")
    return Run(["split", str(images), str(dest / "a"), str(dest / "b")], dest, forbidden=forbidden)


def _transform_manifest_absolute(io_: Inputs) -> Run:
    from tasks.data.transform import init_transformation

    outside = io_.root / "abs" / "pwned.png"
    images = _tampered(io_, str(outside), outside)
    spec = init_transformation(io_.src / "transform", {"resize_size": 16})
    dest = io_.out / "images"
    return Run(["transform", "apply", str(spec), str(images), str(dest)], dest)


def _train_manifest_backslash(io_: Inputs) -> Run:
    images = _tampered(io_, "..\\..\\escaped\\pwned.png")
    return _train(io_, _untrained(io_), images, io_.val)


def _score_manifest_symlink(io_: Inputs) -> Run:
    images = _tampered(io_, "")
    manifest = json.loads((images / "manifest.json").read_text())
    first = sorted(images.rglob("*.png"))[0]
    manifest["images"][0]["path"] = first.relative_to(images).as_posix()
    (images / "manifest.json").write_text(json.dumps(manifest))
    outside = io_.root / "secret.png"
    shutil.copy(first, outside)
    first.unlink()
    first.symlink_to(outside)
    return _score(io_, str(io_.model), images)


def _export_sample_traversal(io_: Inputs) -> Run:
    model = _model_copy(io_)
    sample = _tampered(io_, "0/../../../escaped/pwned.png", io_.root / "escaped" / "pwned.png")
    return Run(["export", str(model), "--sample", str(sample)], model)


def _convert_symlink_out(io_: Inputs) -> Run:
    _digits(io_, io_.src / "photos")
    outside = io_.root / "secret.png"
    shutil.copy(next((io_.digits / "2").glob("*.png")), outside)
    (io_.src / "photos" / "0" / "link.png").symlink_to(outside)
    (io_.src / "photos" / "1" / "inside.png").symlink_to(next((io_.src / "photos" / "0").iterdir()))
    return _convert(io_, io_.src / "photos", made="manifest.json")


def _split_fraction(io_: Inputs) -> Run:
    dest = io_.out / "split"
    argv = ["split", str(io_.train), str(dest / "a"), str(dest / "b"), "--fraction", "1.5"]
    return Run(argv, dest)


def _split_single_class(io_: Inputs) -> Run:
    images = _imagedir(io_, "one", ("0",))
    dest = io_.out / "split"
    argv = ["split", str(images), str(dest / "a"), str(dest / "b"), "--fraction", "0.5"]
    return Run(argv, dest, made="a/manifest.json")


def _transform_missing_spec(io_: Inputs) -> Run:
    (io_.src / "transform").mkdir(parents=True)
    dest = io_.out / "images"
    return Run(["transform", "apply", str(io_.src / "transform"), str(io_.val), str(dest)], dest)


def _transform_bad_value(io_: Inputs) -> Run:
    dest = io_.out / "transform"
    return Run(["transform", "init", str(dest), "--resize-size", "-5"], dest)


def _transform_unknown_mode(io_: Inputs) -> Run:
    from tasks.data.transform import init_transformation

    spec = init_transformation(io_.src / "transform", {"resize_size": 16})
    dest = io_.out / "images"
    return Run(["transform", "apply", str(spec), str(io_.val), str(dest), "--mode", "x"], dest)


def _train_unlabeled(io_: Inputs) -> Run:
    data = _imagedir(io_, "flat", ("0", "1"), labeled=False)
    return _train(io_, _untrained(io_), data, io_.val)


def _train_other_classes(io_: Inputs) -> Run:
    val = _imagedir(io_, "val", ("0", "1"))
    return _train(io_, _untrained(io_), io_.train, val)


def _train_single_class(io_: Inputs) -> Run:
    one = _imagedir(io_, "one", ("0",))
    return _train(io_, _untrained(io_), one, one)


def _train_big_batch(io_: Inputs) -> Run:
    run = _train(io_, _untrained(io_), io_.train, io_.val)
    return Run([*run.argv, "--batch-size", "1000"], run.dest)


def _train_unknown_arch(io_: Inputs) -> Run:
    return _train(io_, _untrained(io_, arch="resnet9000"), io_.train, io_.val)


def _train_pickled_model(io_: Inputs) -> Run:
    folder = io_.src / "untrained"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(pickle_payload(io_.src))
    return _train(io_, folder, io_.train, io_.val)


def _train_nan(io_: Inputs) -> Run:
    run = _train(io_, _untrained(io_), io_.train, io_.val)
    return Run([*run.argv, "--learning-rate", "1e12", "--print-frequency", "1"], run.dest)


def _export_not_a_model(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    return Run(["export", str(io_.src)], io_.src)


def _export_pickle_weights(io_: Inputs) -> Run:
    model = _model_copy(io_)
    (model / "model.onnx").unlink()
    (model / "model.safetensors").write_bytes(pickle_payload(io_.src))
    return Run(["export", str(model)], model)


def _score_pickle_beside(io_: Inputs) -> Run:
    model = _model_copy(io_)
    (model / "model.pkl").write_bytes(pickle_payload(io_.src))
    (model / "model.pt").write_bytes(pickle_payload(io_.src))
    return _score(io_, str(model), io_.val)


def _score_truncated_onnx(io_: Inputs) -> Run:
    model = _model_copy(io_)
    onnx_file = model / "model.onnx"
    onnx_file.write_bytes(onnx_file.read_bytes()[: onnx_file.stat().st_size // 2])
    return _score(io_, str(model), io_.val)


def _score_reordered_classes(io_: Inputs) -> Run:
    model = _model_copy(io_)
    info = json.loads((model / "model.json").read_text())
    info["classes"] = info["classes"][::-1]  # an edit: every label moved to another class
    (model / "model.json").write_text(json.dumps(info))
    return _score(io_, str(model), io_.val)


def _score_bad_images(io_: Inputs) -> Run:
    _digits(io_, io_.src / "images", per_class=2)
    (io_.src / "images" / "0" / "cut.jpg").write_bytes(_jpeg_bytes(io_)[:200])
    (io_.src / "images" / "1" / "empty.png").write_bytes(b"")
    return _score(io_, str(io_.model), io_.src / "images")


def _score_odd_names(io_: Inputs) -> Run:
    import os

    folder = io_.src / "images"
    folder.mkdir(parents=True)
    scans = sorted(io_.digits.rglob("*.png"))
    for name, scan in zip(["a\rb.png", "c\nd.png", "e\tf.png", 'q"u,o.png'], scans, strict=False):
        shutil.copy(scan, folder / name)
    shutil.copy(scans[-1], os.fsdecode(os.fsencode(folder) + b"/caf\xe9.png"))
    return _score(io_, str(io_.model), folder)


# --- hostile ONNX models (issue 43) -------------------------------------------------------------

HOSTILE_ONNX = ("nan-rows", "two-inputs", "classes-not-json", "huge-allocation", "endless-loop",
                "wrong-shape")  # fmt: skip


def hostile_onnx(model: Path, kind: str) -> Path:
    """Replace the copied ModelDirectory ``model``'s model.onnx by a tiny graph (onnx.helper) of
    ``kind``, with model.json's input size and classes: ``nan-rows`` returns NaN for the first
    image of each batch and +inf for the second (the others get finite scores), ``two-inputs`` takes
    a second tensor, ``classes-not-json`` stores a class list that is not JSON, ``huge-allocation``
    asks for 2 PiB at run time, ``endless-loop`` runs a Loop of 2^62 iterations, ``wrong-shape``
    returns one row for the whole batch. Returns ``model``."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from models.directory import read_model_info
    from tasks.data.transform import input_size
    from tasks.inference.export import INPUT_NAME, META_CLASSES, OUTPUT_NAME

    info = read_model_info(model)
    side, count = input_size(info.transform), len(info.classes)
    weights = np.random.default_rng(0).standard_normal((3 * side * side, count)) / side
    consts = {
        "W": weights.astype(np.float32),
        "zero": np.int64(0),
        "one": np.int64(1),
        "axis0": np.array([0], np.int64),
        "axis1": np.array([1], np.int64),
        "half": np.float32(0.5),
        "onef": np.float32(1.0),
        "huge": np.array([2**48], np.int64),
        "M": np.int64(2**62),
        "true": np.bool_(True),
    }
    node = helper.make_node
    nodes = [node("Flatten", [INPUT_NAME], ["flat"]), node("MatMul", ["flat", "W"], ["mm"])]
    inputs = [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["N", 3, side, side])]
    extra = {  # each kind's graph between the scores (mm) and the output
        "nan-rows": [  # rows r = 0, 1, ... of the batch: log(r - 0.5) + 1 / (r - 1)
            node("Shape", [INPUT_NAME], ["n1"], end=1),
            node("Squeeze", ["n1", "axis0"], ["n"]),
            node("Range", ["zero", "n", "one"], ["r64"]),
            node("Cast", ["r64"], ["r"], to=1),
            node("Sub", ["r", "half"], ["r_half"]),
            node("Log", ["r_half"], ["nan_at_0"]),
            node("Sub", ["r", "onef"], ["r_one"]),
            node("Reciprocal", ["r_one"], ["inf_at_1"]),
            node("Add", ["nan_at_0", "inf_at_1"], ["bad"]),
            node("Unsqueeze", ["bad", "axis1"], ["column"]),
            node("Add", ["mm", "column"], [OUTPUT_NAME]),
        ],
        "two-inputs": [node("Add", ["mm", "bias"], [OUTPUT_NAME])],
        "huge-allocation": [  # N x 2^48 floats: more than any address space holds
            node("Shape", [INPUT_NAME], ["n1"], end=1),
            node("Mul", ["n1", "huge"], ["size"]),
            node("ConstantOfShape", ["size"], ["zeros"]),
            node("ReduceSum", ["zeros"], ["total"], keepdims=0),
            node("Add", ["mm", "total"], [OUTPUT_NAME]),
        ],
        "endless-loop": [
            node(
                "Loop",
                ["M", "true", "onef"],
                ["looped"],
                body=helper.make_graph(
                    [node("Identity", ["go"], ["go_on"]), node("Add", ["v", "onef"], ["v_next"])],
                    "body",
                    [
                        helper.make_tensor_value_info("i", TensorProto.INT64, []),
                        helper.make_tensor_value_info("go", TensorProto.BOOL, []),
                        helper.make_tensor_value_info("v", TensorProto.FLOAT, []),
                    ],
                    [
                        helper.make_tensor_value_info("go_on", TensorProto.BOOL, []),
                        helper.make_tensor_value_info("v_next", TensorProto.FLOAT, []),
                    ],
                ),
            ),
            node("Add", ["mm", "looped"], [OUTPUT_NAME]),
        ],
        "wrong-shape": [node("ReduceMean", ["mm"], [OUTPUT_NAME], axes=[0])],
    }.get(kind, [node("Identity", ["mm"], [OUTPUT_NAME])])
    if kind == "two-inputs":
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["N", count]))
    used = {name for n in nodes + extra for name in n.input}
    graph = helper.make_graph(
        nodes + extra, kind, inputs,
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["N", count])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items() if k in used],
    )  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    classes = "['0', '1', '2'" if kind == "classes-not-json" else json.dumps(info.classes)
    helper.set_model_props(proto, {META_CLASSES: classes})
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(model / "model.onnx"))
    return model


def _score_hostile_onnx(kind: str, **env: str) -> Callable[[Inputs], Run]:
    def build(io_: Inputs) -> Run:
        run = _score(io_, str(hostile_onnx(_model_copy(io_), kind)), io_.val)
        return replace(run, env=env)

    return build


def _score_time_limit(io_: Inputs) -> Run:
    return replace(
        _score(io_, str(io_.model), io_.val), env={"IMAGEOPS_SCORE_BATCH_TIMEOUT_S": "-1"}
    )


# --- any name the file system allows (issue 18) -------------------------------------------------

# Names a careless table, plot or terminal trips on: line ends, a tab, CSV's quote and comma, a
# word pandas reads as missing, matplotlib's math delimiters, spaces at both ends, a terminal
# escape, non-Latin text. Linux allows each as a file or folder name.
ODD_NAMES = (
    "a\rb", "c\nd", "e\r\nf", "g\th", 'q"u,o', "NA", "$\\frac$", " pad ", "\x1b[31mred", "数字 2",
)  # fmt: skip
LATIN1 = b"caf\xe9"  # allowed too, but not UTF-8: no manifest, table or JSON can hold it
LONG = "n" * 246 + ".png"  # 250 bytes: allowed, though ".<it>.<random>.tmp" would not be


def odd_folder(
    folder: Path, digits: Path, classes: tuple[str, ...] = (), latin1: bool = True
) -> Path:
    """Digit PNGs named after every odd name, plus one of 250 bytes (and one not UTF-8): in one
    class folder per name of ``classes``, or all in ``folder`` when there are none."""
    scans = sorted(digits.rglob("*.png"))
    names = [f"{name}.png" for name in ODD_NAMES] + [LONG]
    for i, label in enumerate(classes or ("",)):
        where = folder / label
        where.mkdir(parents=True, exist_ok=True)
        for j, name in enumerate(names):
            shutil.copy(scans[(i * len(names) + j) % len(scans)], where / name)
        if latin1:
            latin1_name = os.fsdecode(os.fsencode(where) + b"/" + LATIN1 + b".png")
            shutil.copy(scans[-1 - i], latin1_name)
    return folder


def rename_zip_members(archive: Path, names: dict[bytes, bytes], utf8: bool) -> Path:
    """Give zip members new names of the same length, the UTF-8 flag (general purpose bit 11)
    set or cleared, in the local headers and the central directory: a careless zip writer."""
    data = bytearray(archive.read_bytes())
    found = 0
    for signature, flags_at, length_at, name_at in (
        (b"PK\x03\x04", 6, 26, 30),  # local file header
        (b"PK\x01\x02", 8, 28, 46),  # central directory record
    ):
        at = data.find(signature)
        while at >= 0:
            (length,) = struct.unpack_from("<H", data, at + length_at)
            new = names.get(bytes(data[at + name_at : at + name_at + length]))
            if new is not None:
                data[at + name_at : at + name_at + length] = new
                (flags,) = struct.unpack_from("<H", data, at + flags_at)
                flags = flags | 0x800 if utf8 else flags & ~0x800
                struct.pack_into("<H", data, at + flags_at, flags)
                found += 1
            at = data.find(signature, at + 4)
    assert found == 2 * len(names), "every name is in a local header and the central directory"
    archive.write_bytes(bytes(data))
    return archive


def _png(io_: Inputs) -> bytes:
    return next((io_.digits / "2").glob("*.png")).read_bytes()


def _zip_utf8_lies(io_: Inputs) -> Run:
    png = _png(io_)
    archive = _zip_of(io_, {"digits/0/cafX.png": png, "digits/1/naïve.png": png})
    rename_zip_members(archive, {b"digits/0/cafX.png": b"digits/0/" + LATIN1 + b".png"}, utf8=True)
    return _convert(io_, archive, made="1/naïve.png")


def _zip_cp437_name(io_: Inputs) -> Run:
    png = _png(io_)
    archive = _zip_of(io_, {"digits/0/cafX.png": png, "digits/1/naXXve.png": png})
    names = {b"digits/0/cafX.png": b"digits/0/caf\x82.png",  # cp437, as old Windows tools write
             b"digits/1/naXXve.png": "digits/1/naïve.png".encode()}  # fmt: skip
    rename_zip_members(archive, names, utf8=False)
    return _convert(io_, archive, made="0/café.png")


def _deep(io_: Inputs) -> str:
    return "1/" + "/".join(["d" * 200] * 2) + "/deep.png"  # 400+ bytes; no part over 255


def _tar_long_names(io_: Inputs) -> Run:
    png = _png(io_)

    def long_names(tar: tarfile.TarFile) -> None:
        for name in ("digits/0/" + "x" * 300 + ".png", "digits/" + _deep(io_)):
            info = tarfile.TarInfo(name)
            info.size = len(png)
            tar.addfile(info, io.BytesIO(png))

    return _convert(io_, _tar_of(io_, long_names), made=_deep(io_))


def _convert_250_byte_names(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    (io_.src / ("c" * 250)).mkdir()
    for folder in ("0", "c" * 250):
        shutil.copy(next((io_.digits / "2").glob("*.png")), io_.src / folder / LONG)
    return _convert(io_, io_.src, made=f"{'c' * 250}/{LONG}")


def _convert_long_dest(io_: Inputs) -> Run:
    from tasks.data.convert import convert

    dest = io_.out / ("d" * 250)
    convert(_digits(io_, io_.root / "before", per_class=1), dest)  # replaced: ".<dest>...old"
    archive = _tar_of(io_, lambda tar: None, "a.tar.gz")  # extracted into ".<dest>...extract-"
    return Run(["convert", str(archive), str(dest)], dest, made="manifest.json")


def _convert_dest_too_long(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    return Run(["convert", str(io_.src), str(io_.out / ("d" * 256))], io_.out)


def _convert_control_names(io_: Inputs) -> Run:
    odd_folder(io_.src, io_.digits, classes=("c\nd", "\x1b[31mred"), latin1=False)
    (io_.src / "c\nd" / "\x1b[2Jbroken.png").write_bytes(b"")  # reported: the escape shown
    return _convert(io_, io_.src, made="c\nd/a\rb.png")


def _convert_non_utf8(io_: Inputs) -> Run:
    _digits(io_, io_.src)
    shutil.copy(_first(io_), os.fsdecode(os.fsencode(io_.src / "0") + b"/" + LATIN1 + b".png"))
    latin1_class = os.fsencode(io_.src) + b"/" + LATIN1
    os.mkdir(latin1_class)
    shutil.copy(_first(io_), os.fsdecode(latin1_class + b"/x.png"))
    return _convert(io_, io_.src, made="manifest.json")


def _first(io_: Inputs) -> Path:
    return next((io_.digits / "2").glob("*.png"))


def _odd_imagedir(io_: Inputs, classes: tuple[str, ...]) -> Path:
    from tasks.data.convert import convert

    convert(odd_folder(io_.root / "raw-odd", io_.digits, classes), io_.src / "odd")
    shutil.rmtree(io_.root / "raw-odd")
    return io_.src / "odd"


def _split_odd_names(io_: Inputs) -> Run:
    images = _odd_imagedir(io_, ODD_NAMES[:4])
    dest = io_.out / "split"
    argv = ["split", str(images), str(dest / "a"), str(dest / "b"), "--fraction", "0.5"]
    return Run(argv, dest, made="a/manifest.json")


def _split_long_dest(io_: Inputs) -> Run:
    dest = io_.out / "split"
    argv = ["split", str(io_.val), str(dest / ("a" * 250)), str(dest / ("b" * 250))]
    return Run(argv, dest, made=f"{'b' * 250}/manifest.json")


def odd_model(model: Path, dest: Path, classes: tuple[str, ...]) -> Path:
    """A copy of the exported 3-class model whose classes are ``classes``, as if it had been
    trained on them: in model.json and in the list the exporter writes into the ONNX model."""
    import onnx

    from tasks.inference.export import META_CLASSES

    copy = Path(shutil.copytree(model, dest))
    info = json.loads((copy / "model.json").read_text())
    (copy / "model.json").write_text(json.dumps({**info, "classes": list(classes)}))
    proto = onnx.load(str(copy / "model.onnx"))
    for prop in proto.metadata_props:
        if prop.key == META_CLASSES:
            prop.value = json.dumps(list(classes))
    onnx.save(proto, str(copy / "model.onnx"))
    return copy


def _evaluate_odd_classes(io_: Inputs) -> Run:
    from tasks.inference.score import score

    images = _odd_imagedir(io_, ODD_NAMES)  # ten classes; the model knows three of them
    model = odd_model(io_.model, io_.src / "model", (ODD_NAMES[0], ODD_NAMES[6], ODD_NAMES[8]))
    scored = score(model, images, io_.out / "eval" / "scored.csv")
    return Run(["evaluate", str(scored)], scored.parent, made="scored.per_class.csv")


def _score_long_output(io_: Inputs) -> Run:
    return _score(io_, str(io_.model), io_.val, name="s" * 246 + ".csv")


def _evaluate_long_table_name(io_: Inputs) -> Run:
    from tasks.inference.score import score

    scored = score(io_.model, io_.val, io_.src / ("s" * 246 + ".csv"))
    return Run(["evaluate", str(scored)], io_.src)


def _train_dest_too_long(io_: Inputs) -> Run:
    run = _train(io_, _untrained(io_), io_.train, io_.val)
    dest = run.dest.with_name("m" * 256)
    return Run([str(dest) if a == str(run.dest) else a for a in run.argv], io_.out)


def _score_missing_model(io_: Inputs) -> Run:
    return _score(io_, "models:/no-such-model@champion", io_.val)


def _score_bad_uri(io_: Inputs) -> Run:
    return _score(io_, "models:/../../etc@", io_.val)


def _score_bad_table(io_: Inputs) -> Run:
    return _score(io_, str(io_.model), io_.val, name="scores.txt")


def _score_no_images(io_: Inputs) -> Run:
    (io_.src / "images").mkdir(parents=True)
    (io_.src / "images" / "readme.txt").write_text("nothing to see")
    return _score(io_, str(io_.model), io_.src / "images")


def _tune_bad_scale(io_: Inputs) -> Run:
    return _tuning_spec(
        io_, "  - {name: learning_rate, type: double, min: 0.001, max: 0.1, scale: cubic}\n"
    )


def _tune_log_zero(io_: Inputs) -> Run:
    return _tuning_spec(
        io_, "  - {name: learning_rate, type: double, min: 0, max: 0.1, scale: log}\n"
    )


def _tune_unknown_parameter(io_: Inputs) -> Run:
    return _tuning_spec(io_, "  - {name: rm_rf, type: categorical, values: [a, b]}\n")


def _tune_self_parent(io_: Inputs) -> Run:
    return _tuning_spec(
        io_, "  - {name: momentum, type: double, min: 0.8, max: 0.9, parent: momentum}\n"
    )


def _tune_grid_double(io_: Inputs) -> Run:
    spec = _tuning_spec(io_, "  - {name: learning_rate, type: double, min: 0.001, max: 0.1}\n")
    text = spec.argv[1]
    Path(text).write_text(Path(text).read_text().replace("goal:", "algorithm: grid\ngoal:"))
    return spec


def _tune_missing_spec(io_: Inputs) -> Run:
    return _tune(io_, io_.src / "missing.yaml")


def _tune_not_yaml(io_: Inputs) -> Run:
    spec = io_.src / "tuning.yaml"
    spec.parent.mkdir(parents=True)
    spec.write_text("!!python/object/apply:os.system ['touch pwned']\n")
    return _tune(io_, spec)


def _tune_alias_bomb(io_: Inputs) -> Run:
    spec = io_.src / "tuning.yaml"
    spec.parent.mkdir(parents=True)
    spec.write_text(f"study_name: bomb\nmetric: val/top1\n{alias_bomb()}")
    return _tune(io_, spec)


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """An unknown key holding ``levels`` YAML anchors, each a list of ``width`` aliases of the one
    before: under 500 bytes that expand to ``width ** levels`` values (387 million)."""
    anchors = [f"  l1: &l1 [{', '.join(['lol'] * width)}]"]
    for level in range(2, levels + 1):
        aliases = ", ".join([f"*l{level - 1}"] * width)
        anchors.append(f"  l{level}: &l{level} [{aliases}]")
    return "bomb:\n" + "\n".join(anchors) + "\n"


def _run_config(io_: Inputs, text: str) -> Run:
    """``imageops run --config params.yaml``: refused as the file is read, before any step."""
    config = io_.src / "params.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(text)
    return Run(["run", "--config", str(config)], io_.out)


def _run_unknown_key(io_: Inputs) -> Run:
    return _run_config(io_, "source: data/raw/digits\nbomb: [lol]\n")


def _run_alias_bomb(io_: Inputs) -> Run:
    return _run_config(io_, f"source: data/raw/digits\n{alias_bomb()}")


def _run_deep_yaml(io_: Inputs) -> Run:
    return _run_config(io_, "bomb:\n" + "- " * 2_000 + "x\n")  # a list in a list in a ...


def _run_long_value(io_: Inputs) -> Run:
    return _run_config(io_, f"bomb: {'x' * 200_000}\n")


def _run_big_file(io_: Inputs) -> Run:
    return _run_config(io_, "source: data/raw/digits\n" + "# a comment\n" * 100_000)


def _transform_deep_json(io_: Inputs) -> Run:
    spec = io_.src / "transform" / "transform.json"
    spec.parent.mkdir(parents=True)
    spec.write_text('{"format": "x", "transform": ' + "[" * 100_000 + "]" * 100_000 + "}")
    dest = io_.out / "images"
    return Run(["transform", "apply", str(spec.parent), str(io_.val), str(dest)], dest)


def _promote_no_model(io_: Inputs) -> Run:
    return Run(["promote", str(io_.val)], io_.out)


def _registered(io_: Inputs, name: str) -> str:
    """Register a copy of the model under ``name`` (its own, so other cases see no model)."""
    from tasks.registry.register import register
    from tasks.shared.settings import Settings

    register(_model_copy(io_), settings=Settings(registered_model_name=name), alias="champion")
    shutil.rmtree(io_.src / "model")
    return name


def _promote_missing_alias(io_: Inputs) -> Run:
    name = _registered(io_, "hostile-promote")
    argv = ["promote", str(io_.val), "--candidate", "no-such-alias"]
    return Run(argv, io_.out, env={"IMAGEOPS_REGISTERED_MODEL_NAME": name})


def _score_missing_alias(io_: Inputs) -> Run:
    return _score(io_, f"models:/{_registered(io_, 'hostile-score')}@no-such-alias", io_.val)


def _promote_unlabeled(io_: Inputs) -> Run:
    data = _imagedir(io_, "flat", ("0", "1"), labeled=False)
    return Run(["promote", str(data)], io_.out)


def _cli_unknown_command(io_: Inputs) -> Run:
    return Run(["frobnicate", str(io_.src)], io_.out)


def _cli_bad_number(io_: Inputs) -> Run:
    run = _train(io_, io_.src, io_.train, io_.val)
    return Run([*run.argv, "--epochs", "many"], run.dest)


def _cli_missing_argument(io_: Inputs) -> Run:
    return Run(["split", str(io_.train)], io_.out)


CASES: list[Case] = [
    Case("convert-truncated-jpeg", "convert", "a JPEG cut in half among good PNGs",
         _truncated_jpeg, "ok: 6 images, 2 classes, 1 skipped; skipped 0/cut.jpg: UnreadableImage"),
    Case("convert-zero-byte", "convert", "a zero-byte .png", _zero_byte,
         "ok: 1 skipped; skipped 1/empty.png: EmptyFile"),
    Case("convert-text-as-png", "convert", "a text file named .png", _text_as_png,
         "ok: 1 skipped; skipped 1/notes.png: NotAnImage"),
    Case("convert-16bit-cmyk", "convert", "16-bit gray and RGB PNGs, CMYK JPEG and TIFF",
         _deep_and_cmyk, "ok: 10 images, 2 classes, 0 skipped"),
    Case("convert-png-bomb", "convert", "a 30000x30000 PNG (a few hundred KB on disk)", _bomb,
         "ok: 1 skipped; skipped 0/bomb.png: ImageExceedsLimit: 900,000,000 pixels is over "
         "the limit of 40,000,000"),
    Case("convert-zip-traversal", "convert", "zip members `../../x` and `digits/0/../../../x.png`",
         _zip_traversal, "ok: 6 images; UnsafeArchiveMember: '..' in the path"),
    Case("convert-zip-absolute", "convert", "a zip member with an absolute path", _zip_absolute,
         "ok: 6 images; UnsafeArchiveMember: absolute path"),
    Case("convert-tar-symlink", "convert",
         "tar symlinks to /etc/passwd and to ../../.., and a file written through the link",
         _tar_symlink, "ok: 6 images; UnsafeArchiveMember"),
    Case("convert-tar-hardlink", "convert", "tar.gz hard links to /etc/shadow and to a member",
         _tar_hardlink, "ok: 6 images; UnsafeArchiveMember"),
    Case("convert-nested-archive", "convert", "a zip inside the zip (itself holding ../../x)",
         _nested_archive, "ok: 6 images, 2 classes, 1 skipped; skipped 0/inner.zip"),
    Case("convert-unicode-names", "convert", "unicode and spaces in class and file names",
         _unicode_names, "ok: 6 images, 2 classes, 0 skipped"),
    Case("convert-markup-names", "convert", "rich markup in names: `[bold]/[/].png`",
         _markup_names, "ok: 7 images, 3 classes, 1 skipped; skipped 0/[red]broken.png"),
    Case("convert-markup-path", "convert", "a missing source named `[/]nowhere`",
         _markup_missing, "NoUsableImagesError", "[/]nowhere"),
    Case("convert-empty-class", "convert", "an empty class folder", _empty_class,
         "ok: 6 images, 2 classes, 1 skipped; skipped 9/: EmptyClass"),
    Case("convert-single-class", "convert", "one class folder only", _single_class,
         "ok: 3 images, 1 classes, 0 skipped"),
    Case("convert-only-junk", "convert", "a folder of broken files only", _only_junk,
         "NoUsableImagesError", "no usable image"),
    Case("convert-missing-source", "convert", "a source that does not exist", _missing_source,
         "NoUsableImagesError", "does not exist"),
    Case("convert-dest-in-source", "convert", "the destination inside the source",
         _dest_in_source, "InvalidParameterError", "overlap"),
    Case("convert-cut-archive", "convert", "a .tar.gz cut in half", _cut_archive,
         "NoUsableImagesError", "a.tar.gz"),
    Case("convert-csv-escape", "convert", "a CSV manifest naming ../../../etc/passwd and /etc",
         _csv_escape, "ok: 6 images, 2 classes, 2 skipped; UnsafePath"),
    Case("convert-symlink-out", "convert",
         "a folder whose image is a symlink to a file outside it (and one to a file inside)",
         _convert_symlink_out,
         "ok: 7 images, 2 classes, 1 skipped; UnsafePath: a symlink leads outside the source"),
    Case("convert-dest-is-file", "convert", "an existing file as the destination",
         _convert_dest_file, "InvalidParameterError", "exists and is a file"),
    Case("convert-dest-foreign-folder", "convert",
         "an existing folder of other files (no manifest.json) as the destination",
         _convert_dest_foreign, "InvalidParameterError", "folder of other files"),
    Case("convert-coco-deep", "convert",
         "a COCO JSON (200 KB) holding a list nested 100,000 deep", _coco_deep,
         "InvalidLabelFileError", "nested 100,001 deep"),
    Case("convert-coco-huge", "convert", "a label file over the 1 GiB limit (sparse)", _coco_huge,
         "InvalidLabelFileError", "label files of up to 1,073,741,824 bytes"),
    Case("convert-big-non-image", "convert", "a 3 GiB `.mov` in a class folder (sparse)",
         _big_non_image, "ok: 6 images, 2 classes, 1 skipped; skipped 0/clip.mov: NotAnImage",
         memory=True),
    Case("convert-big-png-file", "convert",
         "a 3 GiB file named `.png` that starts like a 16x16 PNG (sparse)", _big_png_file,
         "ok: 6 images, 2 classes, 1 skipped; skipped 1/huge.png: ImageExceedsLimit: the file is "
         "3,221,225,472 bytes", memory=True),
    Case("convert-zip-member-bomb", "convert",
         "a 4 MB zip member that inflates to 4,095 MiB of zeros", _zip_member_bomb,
         "UnsafeArchiveError", "unpacks to more than 200 times its size", memory=True),
    Case("convert-zip-lying-sizes", "convert",
         "the same member, its zip headers claiming 1,000 bytes", _zip_lying_sizes,
         "ok: 6 images, 2 classes, 1 skipped; UnreadableArchiveMember: Bad CRC-32", memory=True),
    Case("convert-zip-ratio", "convert",
         "a 1.7 MB zip of 200 members of 8 MiB of zeros each (1.6 GiB)", _zip_ratio,
         "UnsafeArchiveError", "unpacks to more than 200 times its size", memory=True),
    Case("convert-tgz-ratio", "convert",
         "a 270 KB .tar.gz of 64 members of 4 MiB of zeros (only inflating it tells)", _tgz_ratio,
         "UnsafeArchiveError", "unpacks to more than 200 times its size", memory=True),
    Case("convert-strip-600k", "convert", "a 1.2 KB PNG of 1x600,000 px", _strip_convert(600_000),
         "ok: 6 images, 2 classes, 1 skipped; skipped 0/strip.png: ImageExceedsLimit: 1x600000 "
         "has an aspect ratio of 600,000:1, over the limit of 100:1", memory=True),
    Case("convert-strip-2m", "convert", "a 4 KB PNG of 1x2,000,000 px", _strip_convert(2_000_000),
         "ok: 6 images, 2 classes, 1 skipped; skipped 0/strip.png: ImageExceedsLimit: 1x2000000 "
         "has an aspect ratio of 2,000,000:1", memory=True),
    Case("score-oversized-images", "score",
         "PNGs of 1x600,000 and 1x2,000,000 px and a 3 GiB `.png` (sparse) among the images "
         "(each becomes an `ImageExceedsLimit` row, the others are scored)",
         _score_oversized, "ok: wrote", memory=True),
    Case("convert-killed-leftovers", "convert",
         "a killed run's `.images.<8>.tmp`, `.old` and `.extract-<8>` folders beside the "
         "destination (removed) and look-alike names (kept)", _convert_after_kill,
         "ok: 6 images, 2 classes"),
    Case("split-raw-folder", "split", "a raw image folder, not an ImageDirectory", _split_raw,
         "InvalidImageDirectoryError", "is not an ImageDirectory"),
    Case("split-bad-manifest", "split", "a manifest.json cut short", _split_bad_manifest,
         "InvalidImageDirectoryError", "manifest.json"),
    Case("split-manifest-traversal", "split",
         "a manifest.json entry `../../escaped/pwned.png` (the file exists there)",
         _split_manifest_traversal, "InvalidImageDirectoryError", "'..' in the path"),
    Case("transform-manifest-absolute", "transform",
         "a manifest.json entry with an absolute path to an image outside",
         _transform_manifest_absolute, "InvalidImageDirectoryError", "absolute path"),
    Case("train-manifest-backslash", "train", "a manifest.json entry `..\\..\\escaped\\pwned.png`",
         _train_manifest_backslash, "InvalidImageDirectoryError", "'..' in the path"),
    Case("score-manifest-symlink", "score",
         "an ImageDirectory whose listed image is a symlink to a file outside it",
         _score_manifest_symlink, "InvalidImageDirectoryError", "symlink"),
    Case("export-sample-traversal", "export",
         "--sample whose manifest lists `0/../../../escaped/pwned.png`",
         _export_sample_traversal, "InvalidImageDirectoryError", "'..' in the path"),
    Case("split-dest-is-file", "split", "the second output an existing file",
         _split_dest_file, "InvalidParameterError", "exists and is a file"),
    Case("split-bad-fraction", "split", "--fraction 1.5", _split_fraction,
         "InvalidParameterError", "fraction"),
    Case("split-single-class", "split", "one class of 4 images, half and half",
         _split_single_class, "ok: 2 images; 2 images"),
    Case("transform-missing-spec", "transform", "a TransformationDirectory without transform.json",
         _transform_missing_spec, "InvalidTransformationDirectoryError", "transform.json"),
    Case("transform-deep-json", "transform", "transform.json nested 100,000 arrays deep",
         _transform_deep_json, "InvalidTransformationDirectoryError", "nested 100,001 deep"),
    Case("transform-bad-value", "transform", "transform init --resize-size -5",
         _transform_bad_value, "InvalidParameterError", "resize_size = -5"),
    Case("transform-unknown-mode", "transform", "transform apply --mode x",
         _transform_unknown_mode, "InvalidParameterError", "mode"),
    Case("transform-init-dest-is-file", "transform", "transform init onto an existing file",
         _transform_init_dest_file, "InvalidParameterError", "exists and is a file"),
    Case("transform-apply-dest-link", "transform",
         "transform apply onto a symlink to a folder of other files",
         _transform_apply_dest_link, "InvalidParameterError", "is a symlink"),
    Case("train-out-is-file", "train", "an existing file as the model output",
         _train_out_file, "InvalidParameterError", "exists and is a file"),
    Case("train-unlabeled", "train", "unlabeled training data", _train_unlabeled,
         "NotLabeledDatasetError", "labeled"),
    Case("train-other-classes", "train", "validation classes that differ from training",
         _train_other_classes, "InvalidDatasetError", "only in training: ['2']"),
    Case("train-single-class", "train", "training and validation data with one class",
         _train_single_class, "InvalidDatasetError", "needs two or more"),
    Case("train-big-batch", "train", "--batch-size 1000, larger than the data",
         _train_big_batch, "InvalidParameterError", "larger than the training set"),
    Case("train-unknown-arch", "train", "model.json naming architecture resnet9000",
         _train_unknown_arch, "InvalidModelDirectoryError", "resnet9000"),
    Case("train-pickled-model", "train", "a model folder holding only a pickle (model.pt)",
         _train_pickled_model, "InvalidModelDirectoryError", "no model.json"),
    Case("train-nan-loss", "train", "--learning-rate 1e12: the loss becomes NaN", _train_nan,
         "TrainingDivergedError", "training loss became", slow=True),
    Case("export-not-a-model", "export", "an image folder given as the model",
         _export_not_a_model, "InvalidModelDirectoryError", "no model.json"),
    Case("export-pickle-weights", "export", "model.safetensors replaced by a pickle",
         _export_pickle_weights, "InvalidModelDirectoryError", "model.safetensors"),
    Case("score-pickle-beside", "score", "a model directory with pickles (model.pkl, model.pt)",
         _score_pickle_beside, "ok: wrote"),
    Case("score-truncated-onnx", "score", "model.onnx cut to half its size",
         _score_truncated_onnx, "InvalidModelDirectoryError", "is not a readable ONNX model"),
    Case("score-reordered-classes", "score", "model.json's class list reversed",
         _score_reordered_classes, "InvalidModelDirectoryError", "would get the wrong labels"),
    Case("score-onnx-two-inputs", "score", "a model.onnx with two graph inputs",
         _score_hostile_onnx("two-inputs"), "InvalidModelDirectoryError",
         "scoring feeds one float tensor"),
    Case("score-onnx-classes-not-json", "score",
         "a model.onnx whose class list (`imageops.classes` metadata) is not JSON",
         _score_hostile_onnx("classes-not-json"), "InvalidModelDirectoryError",
         "is not a JSON list"),
    Case("score-onnx-huge-allocation", "score", "a model.onnx that allocates 2 PiB at run time",
         _score_hostile_onnx("huge-allocation"), "ScoringFailedError",
         "failed to allocate memory"),
    Case("score-onnx-endless-loop", "score",
         "a model.onnx running a Loop of 2^62 iterations, `IMAGEOPS_SCORE_BATCH_TIMEOUT_S=0.3`",
         _score_hostile_onnx("endless-loop", IMAGEOPS_SCORE_BATCH_TIMEOUT_S="0.3"),
         "ScoringFailedError", "ran past the time limit of 0.3 s"),
    Case("score-bad-time-limit", "score", "`IMAGEOPS_SCORE_BATCH_TIMEOUT_S=-1`",
         _score_time_limit, "InvalidParameterError", "expected a number of seconds above 0"),
    Case("score-onnx-wrong-shape", "score",
         "a model.onnx returning one row of scores for a whole batch",
         _score_hostile_onnx("wrong-shape"), "ScoringFailedError", "returned scores of shape"),
    Case("score-bad-images", "score", "a truncated JPEG and an empty PNG among the images",
         _score_bad_images, "ok: wrote"),
    Case("score-odd-names", "score",
         "a raw folder with `\\r`, `\\n`, tab, quote and comma in names, and a Latin-1 name",
         _score_odd_names, "ok: wrote"),
    Case("convert-zip-utf8-flag-lies", "convert",
         "a zip member flagged UTF-8 (bit 11) whose name is Latin-1 bytes", _zip_utf8_lies,
         "ok: 7 images, 2 classes, 1 skipped; skipped digits/0/caf\\xe9.png: BadFileName: the zip "
         "says this name is UTF-8, but it is not"),
    Case("convert-zip-cp437-name", "convert",
         "zip names without the UTF-8 flag: one cp437 (`caf\\x82.png`), one UTF-8 all the same",
         _zip_cp437_name, "ok: 8 images, 2 classes, 0 skipped"),
    Case("convert-tar-long-name", "convert",
         "tar members with a 304-byte name and a 419-byte path of short names (PAX headers)",
         _tar_long_names, "ok: 7 images, 2 classes, 1 skipped; BadFileName: a name longer than the "
         "255 bytes this file system takes"),
    Case("convert-250-byte-names", "convert",
         "a 250-byte class folder and 250-byte file names (too long once `.tmp` is added)",
         _convert_250_byte_names, "ok: 8 images, 3 classes, 0 skipped"),
    Case("convert-long-dest", "convert",
         "an archive converted onto an existing ImageDirectory with a 250-byte name",
         _convert_long_dest, "ok: 6 images, 2 classes, 0 skipped"),
    Case("convert-dest-name-too-long", "convert", "a destination name of 256 bytes",
         _convert_dest_too_long, "InvalidParameterError", "at most 255 bytes"),
    Case("convert-control-char-names", "convert",
         "class folders and files named with `\\r`, `\\n`, `\\r\\n`, tab, quote, comma, `$`, "
         "ANSI escapes, `NA` and spaces at both ends; one of them empty",
         _convert_control_names, "ok: 22 images, 2 classes, 1 skipped; skipped "
         "c\\nd/\\x1b[2Jbroken.png: EmptyFile"),
    Case("convert-non-utf8-name", "convert", "a Latin-1 file name and a Latin-1 class folder",
         _convert_non_utf8, "ok: 6 images, 2 classes, 3 skipped; skipped 0/caf\\xe9.png: "
         "BadFileName: the name is not UTF-8; skipped caf\\xe9/: EmptyClass"),
    Case("split-odd-names", "split", "an ImageDirectory of odd class and file names",
         _split_odd_names, "ok: /a: 20 images; /b: 24 images"),
    Case("split-long-dest", "split", "two outputs with 250-byte names", _split_long_dest,
         "ok: aaaa: 15 images; bbbb: 3 images"),
    Case("score-long-output", "score", "a scored table with a 250-byte name", _score_long_output,
         "ok: wrote"),
    Case("evaluate-odd-class-names", "evaluate",
         "a scored table whose ten classes have odd names (`\\r`, `\\n`, `$\\frac$`, ...)",
         _evaluate_odd_classes, "ok: accuracy:"),
    Case("evaluate-long-table-name", "evaluate",
         "a scored table with a 250-byte name: its outputs' names would be longer",
         _evaluate_long_table_name, "InvalidParameterError", "rename the scored table"),
    Case("train-dest-name-too-long", "train", "a model output name of 256 bytes",
         _train_dest_too_long, "InvalidParameterError", "at most 255 bytes"),
    Case("score-missing-model", "score", "models:/no-such-model@champion", _score_missing_model,
         "RegistryError", "no-such-model"),
    Case("score-missing-alias", "score", "models:/<a registered model>@no-such-alias",
         _score_missing_alias, "RegistryError", "no-such-alias"),
    Case("score-bad-uri", "score", "models:/../../etc@", _score_bad_uri,
         "RegistryError", "models:/"),
    Case("score-bad-table", "score", "a scored table named .txt", _score_bad_table,
         "InvalidParameterError", ".txt"),
    Case("score-killed-leftovers", "score",
         "a killed run's `.scores.csv.<8>.tmp` and `.shards-<8>` folder beside the table "
         "(removed) and look-alike names (kept)", _score_after_kill, "ok: wrote"),
    Case("score-no-images", "score", "a folder with no image in it", _score_no_images,
         "NoUsableImagesError", "image"),
    Case("tune-bad-scale", "tune", "a parameter with scale: cubic", _tune_bad_scale,
         "InvalidTuningSpecError", "[scale] = 'cubic'"),
    Case("tune-log-scale-zero", "tune", "a log scale from min 0", _tune_log_zero,
         "InvalidTuningSpecError", "min"),
    Case("tune-unknown-parameter", "tune", "a parameter training does not have",
         _tune_unknown_parameter, "InvalidTuningSpecError", "rm_rf"),
    Case("tune-self-parent", "tune", "a parameter that is its own parent", _tune_self_parent,
         "InvalidTuningSpecError", "its parent"),
    Case("tune-grid-double", "tune", "a grid search over a double", _tune_grid_double,
         "InvalidTuningSpecError", "grid search cannot"),
    Case("tune-missing-spec", "tune", "a spec file that does not exist", _tune_missing_spec,
         "InvalidTuningSpecError", "missing.yaml"),
    Case("tune-python-tag", "tune", "YAML with a !!python/object tag", _tune_not_yaml,
         "InvalidTuningSpecError", "tuning.yaml"),
    Case("tune-alias-bomb", "tune",
         "tuning.yaml whose unknown key holds 9 levels of 9 YAML aliases (387 million values)",
         _tune_alias_bomb, "InvalidTuningSpecError", "more than 10,000 values"),
    Case("promote-no-model", "promote", "no registered model at all", _promote_no_model,
         "RegistryError", "registered model"),
    Case("promote-missing-alias", "promote", "--candidate no-such-alias of a registered model",
         _promote_missing_alias, "RegistryError", "its aliases: @champion -> v1"),
    Case("promote-unlabeled-holdout", "promote", "an unlabeled holdout", _promote_unlabeled,
         "InvalidParameterError", "unlabeled"),
    Case("run-unknown-key", "run", "run --config a params.yaml with a key imageops does not know",
         _run_unknown_key, "InvalidParameterError", "bomb: Extra inputs are not permitted"),
    Case("run-alias-bomb", "run",
         "run --config a 534-byte params.yaml whose unknown key holds 9 levels of 9 YAML aliases "
         "(387 million values)", _run_alias_bomb, "InvalidParameterError",
         "line 7: the document holds more than 10,000 values", memory=True),
    Case("run-deep-yaml", "run", "run --config a params.yaml nested 2,000 lists deep",
         _run_deep_yaml, "InvalidParameterError", "lists and mappings nest more than 64 deep"),
    Case("run-long-value", "run",
         "run --config a params.yaml whose unknown key holds a 200,000-character string",
         _run_long_value, "InvalidParameterError", "xxxxxxxxxx...xxxxxxxxxx"),
    Case("run-big-file", "run", "run --config a 1.2 MB params.yaml (comments)", _run_big_file,
         "InvalidParameterError", "is over 262,144 bytes, the most imageops reads of a YAML file"),
    Case("cli-unknown-command", "cli", "imageops frobnicate", _cli_unknown_command,
         "UsageError", "No such command"),
    Case("cli-bad-number", "cli", "train --epochs many", _cli_bad_number,
         "BadParameter", "--epochs"),
    Case("cli-missing-argument", "cli", "split with one of its three folders",
         _cli_missing_argument, "MissingParameter", "Missing argument"),
]  # fmt: skip


OTHER_PARTS = "## Injected faults, concurrent runs, security"
# How far a *peak memory* case may go above its step's run on a small normal input, in MB. Reading
# a config file costs next to nothing; convert's workers and ONNX Runtime vary by more.
MEMORY_MARGIN_MB = {"convert": 300, "score": 300, "run": 100, "tune": 100}


def markdown() -> str:
    """The corpus part of docs/reliability.md: every case and what the user sees."""
    lines = [
        "# Reliability: hostile inputs",
        "",
        "Generated from `tests/hostile_inputs.py` by `python -m tests.hostile_inputs --write "
        "docs/reliability.md` (it keeps the last section as it is);",
        "`tests/test_hostile_inputs.py` runs every case through the CLI;",
        "`tests/test_memory_bounds.py` runs the cases marked *peak memory* again, as subprocesses,",
        "and checks that each one's peak memory (workers included) stays within a margin of the",
        "same command on a small normal input (a few images; a config file with the same mistake).",
        "The limits they meet are in [Configuration](configuration.md).",
        "",
        "Each case ends in success with a report, or in a named error: the CLI prints",
        '"error: <ErrorName>: <what was wrong>" and "what to do: <hint>" and exits with status 2',
        "(usage errors come from the command-line parser: its message and `--help`). Never a",
        "traceback, never a file outside the destination, never a half output that looks whole.",
        "",
        "| id | step | input | outcome |",
        "| --- | --- | --- | --- |",
    ]
    for case in CASES:
        outcome = case.expect if case.expect.startswith("ok") else f"{case.expect}: {case.says}"
        if case.memory:
            outcome += f"; *peak memory* within {MEMORY_MARGIN_MB[case.step]} MB of a small input's"
        cells = [f"`{case.id}`", case.step, case.description, outcome]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n\n"


def write_doc(path: Path) -> None:
    """Rewrite the corpus part of ``path``; the section the rest of issue 9 fills is kept."""
    old = path.read_text() if path.exists() else ""
    rest = old[old.index(OTHER_PARTS) :] if OTHER_PARTS in old else ""
    rest = rest or f"{OTHER_PARTS}\n\nTracked in the rest of issue 9.\n"
    path.write_text(markdown() + rest)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        sys.exit("usage: python -m tests.hostile_inputs --write docs/reliability.md")
    write_doc(Path(sys.argv[2]))
