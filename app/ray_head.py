"""Ask a Ray head whether it takes a token, in milliseconds: one gRPC call, without Ray.

Ray's own client (``ray status``) takes seconds to import, more on a busy machine; a wrong token
must be one error within seconds. The call is the one a joining node makes first: the GCS's
cluster metadata (``InternalKVGet`` of ``cluster/CLUSTER_METADATA``), the token sent as Ray's
clients send it (``authorization: Bearer <token>``), over HTTP/2 with httpx (h2 is in the lock
through Prefect's ``httpx[http2]``). The metadata holds the head's Ray and Python versions, which
a node must match.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys

import httpx

KV_GET = "/ray.rpc.InternalKVGcsService/InternalKVGet"
METADATA_KEY, METADATA_NAMESPACE = b"CLUSTER_METADATA", b"cluster"  # Ray's usage_lib
UNAUTHENTICATED = "16"  # gRPC's status code


class RayHeadRefused(Exception):
    """The head refused the token (gRPC UNAUTHENTICATED)."""


class RayHeadUnanswered(Exception):
    """No gRPC answer from the head: nothing listens, or something that is not Ray's GCS."""


def cluster_metadata(address: str, token: str, timeout_s: float) -> dict:
    """The head's cluster metadata (empty when it has none yet); raises ``RayHeadRefused`` for
    a wrong token, ``RayHeadUnanswered`` when no GCS answers at ``address`` (host:port)."""
    request = _field(1, METADATA_KEY) + _field(2, METADATA_NAMESPACE)
    try:
        with httpx.Client(http1=False, http2=True, timeout=timeout_s) as client:
            answer = client.post(
                f"http://{address}{KV_GET}",
                content=b"\0" + len(request).to_bytes(4, "big") + request,  # gRPC's framing
                headers={"content-type": "application/grpc", "te": "trailers",
                         "authorization": f"Bearer {token}"},
            )  # fmt: skip
    except httpx.HTTPError as exc:
        raise RayHeadUnanswered(str(exc) or type(exc).__name__) from exc
    # An error's answer is headers only, the status among them; a reply's status is in its
    # trailers, which httpx does not read: then the body is the reply.
    status = answer.headers.get("grpc-status")
    if status == UNAUTHENTICATED:
        raise RayHeadRefused(answer.headers.get("grpc-message", "UNAUTHENTICATED"))
    if answer.status_code != 200 or "grpc" not in answer.headers.get("content-type", ""):
        raise RayHeadUnanswered(f"HTTP {answer.status_code}, not a gRPC answer")
    if status not in (None, "0"):
        raise RayHeadUnanswered(f"gRPC status {status}: {answer.headers.get('grpc-message')}")
    try:
        value = _fields(answer.content[5:]).get(2)  # InternalKVGetReply.value
        return json.loads(value) if value else {}
    except (IndexError, ValueError) as exc:
        raise RayHeadUnanswered(f"not a reply of Ray's GCS: {exc}") from exc


def version_mismatch(metadata: dict) -> str | None:
    """What differs between the head's Ray and Python and this machine's, by Ray's own rule
    (``ray._private.utils.check_version_info``): the Ray version, and Python's up to the patch
    (up to the minor version with RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor)."""
    if not metadata:
        return None
    ray, python = importlib.metadata.version("ray"), ".".join(map(str, sys.version_info[:3]))
    parts = 2 if os.environ.get("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL") == "minor" else 3
    head_python = metadata.get("python_version", python)
    if metadata.get("ray_version", ray) == ray and (
        head_python.split(".")[:parts] == python.split(".")[:parts]
    ):
        return None
    return (
        f"the head runs Ray {metadata.get('ray_version')} on Python {head_python}, this machine "
        f"Ray {ray} on Python {python}"
    )


def _varint(number: int) -> bytes:
    out = bytearray()
    while True:
        low, number = number & 0x7F, number >> 7
        out.append(low | (0x80 if number else 0))
        if not number:
            return bytes(out)


def _field(number: int, value: bytes) -> bytes:
    """A protobuf bytes field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    number = shift = 0
    while True:
        byte = data[at]
        number |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return number, at


def _fields(data: bytes) -> dict[int, bytes]:
    """A protobuf message's bytes and message fields by number (varints read past)."""
    fields: dict[int, bytes] = {}
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        if key & 7 == 0:
            _, at = _read_varint(data, at)
        elif key & 7 == 2:
            size, at = _read_varint(data, at)
            fields[key >> 3], at = data[at : at + size], at + size
        else:  # no other wire type in this reply
            break
    return fields
