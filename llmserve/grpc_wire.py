"""Request deserializers that turn malformed bytes into INVALID_ARGUMENT instead of UNKNOWN.

protobuf rejects a proto3 `string` field holding invalid UTF-8 at parse time. In grpcio the parse
runs in the request deserializer, before any servicer code, and a deserializer that raises makes
the call fail with UNKNOWN ("Unexpected <class 'DecodeError'>") - the client is told the server
broke, not that it sent bad bytes. Other languages' clients (Go, C++ with raw bytes, hand-built
frames) can send such messages, so a server registers its methods with `tolerant()` deserializers:
a message that does not parse becomes an `InvalidRequest` value, which the servicer answers with
INVALID_ARGUMENT naming the offending field (found by walking the wire format). Used by the router
and the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message


@dataclass(frozen=True)
class InvalidRequest:
    """Stands in for a request message that could not be parsed."""

    message: str


def tolerant(message_cls: type[Message]) -> Callable[[bytes], Message | InvalidRequest]:
    def deserialize(data: bytes) -> Message | InvalidRequest:
        try:
            return message_cls.FromString(data)
        except DecodeError as exc:
            try:
                where = find_invalid_utf8(cast(Descriptor, message_cls.DESCRIPTOR), data)
            except Exception:  # noqa: BLE001 - a deserializer that raises is UNKNOWN to the client
                where = None
            if where is not None:
                return InvalidRequest(f"{where}: invalid UTF-8 in a string field")
            return InvalidRequest(f"request: malformed {message_cls.DESCRIPTOR.name} message ({exc})")

    return deserialize


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def find_invalid_utf8(desc: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """Path ("sampling_params.stop[1]") of the first string field in `data` that is not valid UTF-8,
    or None. Best effort: returns None for data that is malformed in other ways."""
    counts: dict[str, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
                continue
            if wire_type == 1:
                pos += 8
                continue
            if wire_type == 5:
                pos += 4
                continue
            if wire_type != 2:
                return None
            length, pos = _varint(data, pos)
            payload, pos = data[pos:pos + length], pos + length
            field = desc.fields_by_number.get(number)
            if field is None:
                continue
            name = prefix + field.name
            if field.is_repeated:
                i = counts.get(field.name, 0)
                counts[field.name] = i + 1
                name = f"{name}[{i}]"
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    payload.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif (field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None
                  and not field.message_type.GetOptions().map_entry):
                inner = find_invalid_utf8(field.message_type, payload, name + ".")
                if inner is not None:
                    return inner
    except (ValueError, IndexError):
        return None
    return None
