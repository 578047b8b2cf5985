from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStreamRequest(_message.Message):
    __slots__ = ("open", "cancel", "credit")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    open: _containers.RepeatedCompositeFieldContainer[CallOpen]
    cancel: _containers.RepeatedCompositeFieldContainer[CallCancel]
    credit: int
    def __init__(self, open: _Optional[_Iterable[_Union[CallOpen, _Mapping]]] = ..., cancel: _Optional[_Iterable[_Union[CallCancel, _Mapping]]] = ..., credit: _Optional[int] = ...) -> None: ...

class CallOpen(_message.Message):
    __slots__ = ("call", "generate_request", "client_request_id")
    CALL_FIELD_NUMBER: _ClassVar[int]
    GENERATE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    call: int
    generate_request: bytes
    client_request_id: str
    def __init__(self, call: _Optional[int] = ..., generate_request: _Optional[bytes] = ..., client_request_id: _Optional[str] = ...) -> None: ...

class CallCancel(_message.Message):
    __slots__ = ("call", "reason")
    CALL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    call: int
    reason: str
    def __init__(self, call: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class WorkerStreamResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CallItem]
    def __init__(self, items: _Optional[_Iterable[_Union[CallItem, _Mapping]]] = ...) -> None: ...

class CallItem(_message.Message):
    __slots__ = ("call", "generate_response", "end")
    CALL_FIELD_NUMBER: _ClassVar[int]
    GENERATE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    call: int
    generate_response: bytes
    end: CallEnd
    def __init__(self, call: _Optional[int] = ..., generate_response: _Optional[bytes] = ..., end: _Optional[_Union[CallEnd, _Mapping]] = ...) -> None: ...

class CallEnd(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
