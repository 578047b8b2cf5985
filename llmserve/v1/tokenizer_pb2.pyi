from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Conversation(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: Conversation
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[Conversation, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("token_ids", "prompt_text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class DetokenizeStreamRequest(_message.Message):
    __slots__ = ("sequence_id", "token_ids", "final", "skip_special_tokens", "context_token_ids")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    final: bool
    skip_special_tokens: bool
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., final: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., context_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeStreamResponse(_message.Message):
    __slots__ = ("sequence_id", "text", "final", "num_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    text: str
    final: bool
    num_tokens: int
    def __init__(self, sequence_id: _Optional[int] = ..., text: _Optional[str] = ..., final: _Optional[bool] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpecialToken(_message.Message):
    __slots__ = ("id", "content")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    id: int
    content: str
    def __init__(self, id: _Optional[int] = ..., content: _Optional[str] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("vocab_size", "bos_token_id", "eos_token_ids", "bos_token", "eos_token", "special_tokens", "has_chat_template", "chat_template", "model_max_length")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token: str
    eos_token: str
    special_tokens: _containers.RepeatedCompositeFieldContainer[SpecialToken]
    has_chat_template: bool
    chat_template: str
    model_max_length: int
    def __init__(self, vocab_size: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., special_tokens: _Optional[_Iterable[_Union[SpecialToken, _Mapping]]] = ..., has_chat_template: _Optional[bool] = ..., chat_template: _Optional[str] = ..., model_max_length: _Optional[int] = ...) -> None: ...

class GetTokenizerJsonRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerJsonResponse(_message.Message):
    __slots__ = ("tokenizer_json", "sha256", "vocab_size")
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json: str
    sha256: str
    vocab_size: int
    def __init__(self, tokenizer_json: _Optional[str] = ..., sha256: _Optional[str] = ..., vocab_size: _Optional[int] = ...) -> None: ...
