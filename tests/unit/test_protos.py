"""protos/: the committed generated modules match the .proto files, import cleanly, and every
service, method, message, field, enum and enum value carries a comment."""

from __future__ import annotations

import importlib.resources
import shutil
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from llmserve import protos_gen
from llmserve.cli import main


def test_gen_protos_check_passes_on_committed_tree(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gen-protos", "--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_check_detects_changed_missing_and_stale_files(tmp_path: Path) -> None:
    shutil.copytree(protos_gen.PROTO_ROOT, tmp_path / "protos")
    expected = protos_gen.generate(tmp_path / "protos")
    assert protos_gen.write(expected, tmp_path)  # everything was missing
    assert not protos_gen.compare(expected, tmp_path)

    proto = tmp_path / "protos/llmserve/v1/tokenizer.proto"
    proto.write_text(proto.read_text().replace("message GetInfoRequest {}", "message GetInfoRequest { bool x = 1; }"))
    (tmp_path / "llmserve/v1/old_pb2.py").write_text("")
    (tmp_path / "llmserve/v1/router_pb2.pyi").unlink()
    drift = protos_gen.compare(protos_gen.generate(tmp_path / "protos"), tmp_path)
    assert drift.changed == ["llmserve/v1/tokenizer_pb2.py", "llmserve/v1/tokenizer_pb2.pyi"]
    assert drift.missing == ["llmserve/v1/router_pb2.pyi"]
    assert drift.stale == ["llmserve/v1/old_pb2.py"]


def test_generated_modules_import_and_expose_the_apis() -> None:
    from llmserve.v1 import router_pb2, router_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc

    router = router_pb2.DESCRIPTOR.services_by_name["Router"]
    assert router.full_name == "llmserve.v1.Router"
    assert [m.name for m in router.methods] == [
        "Generate", "Chat", "Tokenize", "Detokenize", "GetModelInfo", "ListWorkers"]
    assert router.methods_by_name["Generate"].output_type.name == "GenerateResponse"
    tokenizer = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"]
    assert [m.name for m in tokenizer.methods] == [
        "Encode", "Decode", "DetokenizeStream", "GetInfo", "GetTokenizerJson"]
    assert hasattr(router_pb2_grpc, "RouterStub") and hasattr(tokenizer_pb2_grpc, "TokenizerServicer")
    # The router reuses the tokenizer's chat types (a cross-file import in the generated code).
    chat = router_pb2.ChatRequest(messages=[tokenizer_pb2.ChatMessage(role="user", content="hi")])
    assert router_pb2.ChatRequest.FromString(chat.SerializeToString()) == chat
    # proto3 `optional`: unset and zero are distinguishable where zero means something.
    params = router_pb2.SamplingParams(temperature=0.0)
    assert params.HasField("temperature") and not params.HasField("seed")


def _descriptor_set(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    from grpc_tools import protoc

    out = tmp_path / "set.pb"
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    files = [str(f) for f in protos_gen.proto_files()]
    rc = protoc.main(["protoc", f"-I{protos_gen.PROTO_ROOT}", f"-I{well_known}", "--include_source_info",
                      f"--descriptor_set_out={out}", *files])
    assert rc == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def test_every_element_is_documented(tmp_path: Path) -> None:
    undocumented = []
    for file in _descriptor_set(tmp_path).file:
        comments = {tuple(loc.path): loc.leading_comments.strip() for loc in file.source_code_info.location}
        # Paths per descriptor.proto: 4 = message_type (2 = field), 5 = enum_type (2 = value), 6 = service (2 = method).
        for i, msg in enumerate(file.message_type):
            undocumented += [] if comments.get((4, i)) else [f"{file.name}: message {msg.name}"]
            undocumented += [f"{file.name}: {msg.name}.{f.name}" for j, f in enumerate(msg.field)
                             if not comments.get((4, i, 2, j))]
            assert not msg.nested_type and not msg.enum_type, "nested types: extend this check"
        for i, enum in enumerate(file.enum_type):
            undocumented += [] if comments.get((5, i)) else [f"{file.name}: enum {enum.name}"]
            undocumented += [f"{file.name}: {enum.name}.{v.name}" for j, v in enumerate(enum.value)
                             if not comments.get((5, i, 2, j))]
        for i, svc in enumerate(file.service):
            undocumented += [] if comments.get((6, i)) else [f"{file.name}: service {svc.name}"]
            undocumented += [f"{file.name}: {svc.name}.{m.name}" for j, m in enumerate(svc.method)
                             if not comments.get((6, i, 2, j))]
    assert not undocumented, "add a comment above: " + ", ".join(undocumented)
