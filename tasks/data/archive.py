"""Safe extraction of image archives (.zip, .tar, .tar.gz/.tgz, .tar.bz2) for Convert.

An archive comes from somewhere else: every member is checked before a byte is written (regular
files and folders only, staying under the destination), and caps on members, bytes and compression
ratio, checked on the headers and again on the bytes inflated, stop zip and tar bombs. Member names
are decoded as the zip format says; one that cannot be written is refused with the reason.
Details: docs/convert.md#archives.
"""

from __future__ import annotations

import errno
import functools
import lzma
import os
import re
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from models.atomic import name_limit
from tasks.data.imagedir import SkippedFile, SkipReason
from tasks.shared.errors import NoUsableImagesError, UnsafeArchiveError

DEFAULT_MAX_MEMBERS = 500_000
DEFAULT_MAX_BYTES = 20 * 1024**3  # the whole archive, inflated
DEFAULT_MAX_MEMBER_BYTES = 1024**3  # one member, inflated (an image over 336 MB is refused anyway)
# Inflated / compressed: a member against its compressed size, the archive against its size on
# disk. Photos do not compress (about 1:1), text does (5 to 20:1), zeros go to 1,000:1.
DEFAULT_MAX_RATIO = 200
RATIO_FLOOR = 16 * 1024**2  # up to this many bytes inflated, any ratio is allowed
_ZIP_SUFFIXES = (".zip",)
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tbz")
ARCHIVE_SUFFIXES = _ZIP_SUFFIXES + _TAR_SUFFIXES
_CHUNK = 1024 * 1024
_DRIVE = re.compile(r"^[A-Za-z]:")
_CHECK_COMPLETE = (
    "Check that the file is complete (a download cut short?) and lists with `unzip -l` or "
    "`tar -tf`."
)


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def archive_kind(path: Path) -> str | None:
    """``"zip"`` or ``"tar"`` from the file name, or None when it is not an archive we read."""
    name = Path(path).name.lower()
    if name.endswith(_ZIP_SUFFIXES):
        return "zip"
    if name.endswith(_TAR_SUFFIXES):
        return "tar"
    return None


def extract_archive(
    archive: Path,
    dest: Path,
    *,
    max_members: int = DEFAULT_MAX_MEMBERS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
    max_ratio: int = DEFAULT_MAX_RATIO,
) -> list[SkippedFile]:
    """Extract the safe members of ``archive`` into the existing empty folder ``dest``.

    Returns the refused members with their reasons (``UnsafeArchiveMember``: over
    ``max_member_bytes`` or ``max_ratio``). Raises :class:`UnsafeArchiveError` when the whole
    archive is over ``max_members``, ``max_bytes`` or ``max_ratio`` (a partial extraction would be a
    silently partial data set), :class:`NoUsableImagesError` when it is not a readable archive.
    Details: docs/convert.md#extract_archive.
    """
    archive, dest = Path(archive), Path(dest)
    kind = archive_kind(archive)
    caps = _Caps(archive, max_bytes, max_member_bytes, max_ratio)
    if kind == "zip":
        return _extract_zip(archive, dest, max_members, caps)
    if kind == "tar":
        return _extract_tar(archive, dest, max_members, caps)
    raise NoUsableImagesError(
        f"{archive} is not an archive imageops reads.",
        f"Use a folder or one of: {', '.join(ARCHIVE_SUFFIXES)}.",
    )


def _safe_target(dest: Path, name: str) -> Path | None:
    """Where member ``name`` may be written under ``dest``; None for the archive's root itself."""
    if "\x00" in name:
        raise _Refused(SkipReason.UNSAFE_ARCHIVE_MEMBER.because("NUL byte in the name"))
    if name.startswith("/") or _DRIVE.match(name):
        raise _Refused(SkipReason.UNSAFE_ARCHIVE_MEMBER.because("absolute path"))
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if ".." in parts:
        raise _Refused(SkipReason.UNSAFE_ARCHIVE_MEMBER.because("'..' in the path"))
    if not parts:
        return None
    limit = _name_limit(str(dest))
    if any(len(os.fsencode(part)) > limit for part in parts):
        raise _Refused(
            SkipReason.BAD_FILE_NAME.because(
                f"a name longer than the {limit} bytes this file system takes"
            )
        )
    target = dest.joinpath(*parts)
    # Nothing we write is a link, but check the resolved path anyway: defence in depth.
    root = os.path.realpath(dest)
    if os.path.commonpath([root, os.path.realpath(target)]) != root:
        raise _Refused(SkipReason.UNSAFE_ARCHIVE_MEMBER.because("resolves outside the archive"))
    return target


@functools.lru_cache(maxsize=8)
def _name_limit(dest: str) -> int:
    """Asked once per extraction folder, not once per member."""
    return name_limit(Path(dest))


def _too_many(archive: Path, max_members: int) -> UnsafeArchiveError:
    return UnsafeArchiveError(
        f"{archive} has more than {max_members:,} members; refused as a possible archive bomb.",
        "If it is genuine, run `imageops convert` again with a larger --max-archive-members, "
        "or extract it yourself and convert the folder.",
    )


class _Caps:
    """How much an archive may inflate to, in total and per member; raises or refuses past it."""

    def __init__(self, archive: Path, max_bytes: int, max_member_bytes: int, ratio: int) -> None:
        self.archive = archive
        self.max_bytes = max_bytes
        self.max_member_bytes = max_member_bytes
        self.ratio = ratio
        try:
            self.size = archive.stat().st_size
        except OSError:
            self.size = 0  # opening it fails next, with the reason
        self.total = 0  # bytes inflated so far (or declared, where that is what is counted)

    def add(self, n: int) -> None:
        """Count ``n`` more bytes of the archive's content; raise once past a total cap."""
        self.total += n
        self.check_total(self.total)

    def check_total(self, total: int) -> None:
        if total > self.max_bytes:
            raise UnsafeArchiveError(
                f"{self.archive} unpacks to more than {self.max_bytes:,} bytes; refused as a "
                "possible archive bomb.",
                "If it is genuine, run `imageops convert` again with a larger "
                "--max-archive-bytes, or extract it yourself and convert the folder.",
            )
        if total > max(RATIO_FLOOR, self.ratio * self.size):
            raise UnsafeArchiveError(
                f"{self.archive} unpacks to more than {self.ratio} times its size "
                f"({self.size:,} bytes); refused as a possible archive bomb.",
                "If it is genuine, run `imageops convert` again with a larger "
                "--max-archive-ratio, or extract it yourself and convert the folder.",
            )

    def member_refusal(self, size: int, compressed: int | None) -> str | None:
        """Why a member of ``size`` bytes inflated (``compressed`` on disk, zip only) is refused."""
        if size > self.max_member_bytes:
            return SkipReason.UNSAFE_ARCHIVE_MEMBER.because(
                f"inflates to more than {self.max_member_bytes:,} bytes (imageops convert "
                "--max-archive-member-bytes); not extracted"
            )
        if compressed is not None and size > max(RATIO_FLOOR, self.ratio * compressed):
            return SkipReason.UNSAFE_ARCHIVE_MEMBER.because(
                f"inflates to more than {self.ratio} times its {compressed:,} compressed bytes "
                "(imageops convert --max-archive-ratio), a possible zip bomb; not extracted"
            )
        return None


# Errors that mean "this member cannot exist here" (a file named like a folder that holds other
# members, a name too long or not encodable); anything else (a full disk) is the machine's fault
# and is raised.
_MEMBER_ERRNOS = {errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.EILSEQ}


def _cannot_create(exc: OSError) -> _Refused:
    return _Refused(
        SkipReason.UNREADABLE_ARCHIVE_MEMBER.because(f"cannot be created here: {exc.strerror}")
    )


def _make_dir(target: Path) -> None:
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if exc.errno in _MEMBER_ERRNOS:
            raise _cannot_create(exc) from exc
        raise


def _open_new(target: Path) -> BinaryIO:
    """Create ``target`` (and its folders); a second member with the same name is refused."""
    _make_dir(target.parent)
    try:
        return target.open("xb")
    except FileExistsError as exc:
        raise _Refused(
            SkipReason.UNSAFE_ARCHIVE_MEMBER.because("a member with this name came earlier")
        ) from exc
    except OSError as exc:
        if exc.errno in _MEMBER_ERRNOS:
            raise _cannot_create(exc) from exc
        raise


_UTF8_FLAG = 1 << 11  # general purpose bit 11: the name (and comment) are UTF-8
_CENTRAL_RECORD = struct.Struct("<4s6H3L5H2L")  # a central directory record, up to its name


class _Overlay:
    """A binary file as :class:`zipfile.ZipFile` reads it, with the bytes from ``at`` replaced
    by ``patch``. Without a patch it keeps the last read, for :func:`_open_zip`."""

    def __init__(self, fh: BinaryIO, at: int = 0, patch: bytes = b"") -> None:
        self._fh, self._at, self._patch = fh, at, patch
        self.last_read: tuple[int, bytes] = (0, b"")

    def read(self, size: int = -1) -> bytes:
        start = self._fh.tell()
        data = self._fh.read(size)
        if not self._patch:
            self.last_read = (start, data)
            return data
        lo, hi = max(start, self._at), min(start + len(data), self._at + len(self._patch))
        if lo < hi:
            middle = self._patch[lo - self._at : hi - self._at]
            data = data[: lo - start] + middle + data[hi - start :]
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._fh.seek(offset, whence)

    def tell(self) -> int:
        return self._fh.tell()

    def seekable(self) -> bool:
        return True


def _unflag_false_utf8(directory: bytes) -> tuple[bytes, list[int]]:
    """The central directory with the UTF-8 flag cleared on each name that is not UTF-8, and
    the positions (in directory order) of those records."""
    data = bytearray(directory)
    pos, index, liars = 0, 0, []
    while pos + _CENTRAL_RECORD.size <= len(data) and data[pos : pos + 4] == b"PK\x01\x02":
        fields = _CENTRAL_RECORD.unpack_from(data, pos)
        flags, name_len, extra_len, comment_len = fields[3], fields[10], fields[11], fields[12]
        start = pos + _CENTRAL_RECORD.size
        if flags & _UTF8_FLAG:
            try:
                bytes(data[start : start + name_len]).decode("utf-8")
            except UnicodeDecodeError:
                struct.pack_into("<H", data, pos + 8, flags & ~_UTF8_FLAG)
                liars.append(index)
        pos = start + name_len + extra_len + comment_len
        index += 1
    return bytes(data), liars


@contextmanager
def _open_zip(archive: Path) -> Iterator[tuple[zipfile.ZipFile, set[int]]]:
    """Open a zip: the ZipFile, and the positions (in ``infolist()``) of the members whose name
    it calls UTF-8 though it is not. Raises NoUsableImagesError when it is no readable zip."""
    with ExitStack() as stack:
        try:
            zf, liars = _read_zip(archive, stack)
        except (zipfile.BadZipFile, OSError, UnicodeDecodeError) as exc:
            raise NoUsableImagesError(
                f"{archive} is not a readable zip archive: {exc}.", _CHECK_COMPLETE
            ) from exc
        with zf:
            yield zf, liars


def _read_zip(archive: Path, stack: ExitStack) -> tuple[zipfile.ZipFile, set[int]]:
    """``zipfile`` refuses the whole archive for one name flagged UTF-8 that is not. Then it is
    read again with the flag cleared in the copy of the central directory it reads (the file is
    not changed), so every other member can still be extracted."""
    try:
        return zipfile.ZipFile(archive), set()
    except UnicodeDecodeError:
        pass
    fh = stack.enter_context(open(archive, "rb"))  # noqa: SIM115 (the stack closes it)
    recorder = _Overlay(fh)
    try:
        return zipfile.ZipFile(recorder), set()  # type: ignore[arg-type]  (changed meanwhile)
    except UnicodeDecodeError:
        at, directory = recorder.last_read  # its last read: the directory it could not decode
    patch, liars = _unflag_false_utf8(directory)
    return zipfile.ZipFile(_Overlay(fh, at, patch)), set(liars)  # type: ignore[arg-type]


def _zip_name(info: zipfile.ZipInfo) -> str:
    """The member's name as the writer meant it (docs/convert.md#archives)."""
    if info.flag_bits & _UTF8_FLAG:
        return info.orig_filename
    raw = info.orig_filename.encode("cp437")  # what zipfile decoded: the bytes come back whole
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return info.orig_filename


def zip_names(archive: Path) -> list[str]:
    """The names of a zip's members as :func:`extract_archive` writes them (none it refuses
    for its name); nothing is extracted. Raises NoUsableImagesError when it is no zip."""
    with _open_zip(archive) as (zf, liars):
        return [_zip_name(info) for i, info in enumerate(zf.infolist()) if i not in liars]


def _extract_zip(archive: Path, dest: Path, max_members: int, caps: _Caps) -> list[SkippedFile]:
    skipped: list[SkippedFile] = []
    with _open_zip(archive) as (zf, liars):
        infos = zf.infolist()
        if len(infos) > max_members:
            raise _too_many(archive, max_members)
        # The declared sizes can lie; this is only the cheap early refusal, the count of bytes
        # inflated below is what enforces the caps.
        caps.check_total(sum(info.file_size for info in infos))
        for index, info in enumerate(infos):
            if index in liars:
                raw = info.orig_filename.encode("cp437")
                reason = "the zip says this name is UTF-8, but it is not; rename it and zip again"
                shown = raw.decode("utf-8", "backslashreplace")
                skipped.append(
                    SkippedFile(path=shown, reason=SkipReason.BAD_FILE_NAME.because(reason))
                )
                continue
            spelled = _zip_name(info)
            # Windows tools sometimes write backslashes; the zip format says "/".
            name = spelled.replace("\\", "/")
            try:
                kind = stat.S_IFMT(info.external_attr >> 16)
                if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                    raise _Refused(
                        SkipReason.UNSAFE_ARCHIVE_MEMBER.because(
                            f"a {_zip_kind(kind)}, not a regular file or folder"
                        )
                    )
                target = _safe_target(dest, name)
                if target is None:
                    continue
                if info.is_dir():
                    _make_dir(target)
                    continue
                refused = caps.member_refusal(info.file_size, info.compress_size)
                if refused:
                    raise _Refused(refused)
                _copy_zip_member(zf, info, target, caps)
            except _Refused as refused:
                skipped.append(SkippedFile(path=spelled, reason=refused.reason))
    return skipped


def _zip_kind(kind: int) -> str:
    names = {
        stat.S_IFLNK: "symlink",
        stat.S_IFCHR: "character device",
        stat.S_IFBLK: "block device",
        stat.S_IFIFO: "FIFO",
        stat.S_IFSOCK: "socket",
    }
    return names.get(kind, f"file of type {kind:o}")


def _copy_zip_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, caps: _Caps) -> None:
    """Inflate one member into ``target`` a chunk at a time, counting what actually comes out."""
    out = _open_new(target)
    size = 0
    try:
        with out, zf.open(info) as src:
            while chunk := src.read(_CHUNK):
                size += len(chunk)
                refused = caps.member_refusal(size, info.compress_size)
                if refused:
                    raise _Refused(refused)
                caps.add(len(chunk))
                out.write(chunk)
    except (zipfile.BadZipFile, RuntimeError, NotImplementedError, zlib.error, EOFError) as exc:
        # CRC mismatch, encrypted member, unsupported compression, cut-off data.
        target.unlink(missing_ok=True)
        raise _Refused(SkipReason.UNREADABLE_ARCHIVE_MEMBER.because(str(exc))) from exc
    except BaseException:
        target.unlink(missing_ok=True)
        raise


def _tar_kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"symlink to {member.linkname!r}"
    if member.islnk():
        return f"hard link to {member.linkname!r}"
    if member.ischr() or member.isblk():
        return "device"
    if member.isfifo():
        return "FIFO"
    if member.issparse():
        return "sparse file"
    return f"tar member of type {member.type!r}"


def _extract_tar(archive: Path, dest: Path, max_members: int, caps: _Caps) -> list[SkippedFile]:
    try:
        tf = tarfile.open(archive, mode="r:*")  # noqa: SIM115 (closed by `with tf` below)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise NoUsableImagesError(
            f"{archive} is not a readable tar archive: {exc}.", _CHECK_COMPLETE
        ) from exc
    skipped: list[SkippedFile] = []
    count = 0
    with tf:
        try:
            # Iterate lazily: a bomb with millions of headers is refused at the cap, not listed.
            for member in tf:
                count += 1
                if count > max_members:
                    raise _too_many(archive, max_members)
                try:
                    target = _safe_target(dest, member.name)
                    if target is None:
                        continue
                    if member.isdir():
                        _make_dir(target)
                        continue
                    if not member.isreg() or member.issparse():
                        raise _Refused(
                            SkipReason.UNSAFE_ARCHIVE_MEMBER.because(
                                f"a {_tar_kind(member)}, not a regular file or folder"
                            )
                        )
                    # tarfile reads exactly member.size bytes of the (decompressed) stream, so
                    # the header's size is what inflating costs, even for a member not extracted.
                    caps.add(member.size)
                    refused = caps.member_refusal(member.size, None)
                    if refused:
                        raise _Refused(refused)
                    _extract_tar_member(tf, member, dest, target)
                except _Refused as refused:  # (SkippedFile shows a non-UTF-8 name's bytes)
                    skipped.append(SkippedFile(path=member.name, reason=refused.reason))
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno is not None:
                raise  # the machine's fault (a full disk), not the archive's: retryable
            # A cut-off or corrupt stream (gzip and bz2 raise OSError without an errno): refuse
            # the whole archive rather than convert a silently partial data set.
            raise NoUsableImagesError(
                f"{archive} is damaged after {count} member(s): {exc}.", _CHECK_COMPLETE
            ) from exc
    return skipped


def _extract_tar_member(
    tf: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, target: Path
) -> None:
    if os.path.lexists(target):
        raise _Refused(
            SkipReason.UNSAFE_ARCHIVE_MEMBER.because("a member with this name came earlier")
        )
    _make_dir(target.parent)
    try:
        tf.extract(member, dest, set_attrs=False, filter="data")
    except tarfile.FilterError as exc:
        raise _Refused(SkipReason.UNSAFE_ARCHIVE_MEMBER.because(str(exc))) from exc
    except OSError as exc:
        if exc.errno in _MEMBER_ERRNOS:
            raise _cannot_create(exc) from exc
        raise
    # What landed must be the regular file we checked, where we checked it.
    if target.is_symlink() or not target.is_file():
        target.unlink(missing_ok=True)
        raise _Refused(SkipReason.UNSAFE_ARCHIVE_MEMBER.because("did not extract as a file"))
