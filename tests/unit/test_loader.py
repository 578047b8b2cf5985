"""Loading a model folder: config errors name the unsupported value, checkpoint errors name the
tensor, overrides reach the model, sharded and single-file checkpoints load the same weights, and
--dtype decides the parameter and KV dtype."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.bench.driver import StaticBatch
from worker_svc.config.engine_config import EngineConfig
from worker_svc.config.model_config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ConfigError, load_model_config
from worker_svc.executor.model_loader import CheckpointError
from worker_svc.executor.model_runner import ModelRunner

PROMPTS = [[5, 17, 300, 42, 9, 77, 120], [400, 3, 250]]



def _runner(model_dir: Path, dtype: str = "float32", **kw) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=str(model_dir), dtype=dtype, max_total_tokens=256,
                                    max_running_requests=4, **kw))


def _logits(runner: ModelRunner) -> torch.Tensor:
    """Prefill PROMPTS, then one decode step (fixed tokens, so runners that disagree on the argmax
    still decode the same thing); both steps' logits, stacked [2, B, V]."""
    batch = StaticBatch(runner, len(PROMPTS))
    try:
        prefill = batch.extend(PROMPTS)
        decode = batch.decode(torch.tensor([11, 222]))
    finally:
        batch.release()
    return torch.stack([prefill, decode])


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _edit_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


# ---- config errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], ["MixtralForCausalLM"]])
def test_unsupported_architecture_is_named(model_copy, architectures):
    _edit_config(model_copy, architectures=architectures)
    with pytest.raises(ConfigError) as info:
        _runner(model_copy)
    message = str(info.value)
    assert architectures[0] in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_missing_architecture_field(model_copy):
    _edit_config(model_copy, architectures=[])
    with pytest.raises(ConfigError, match="architecture") as info:
        _runner(model_copy)
    assert "LlamaForCausalLM" in str(info.value)


@pytest.mark.parametrize(
    "changes, name",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}}, "yarn"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),  # transformers 4.x legacy key
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, "longrope"),  # transformers 5
    ],
)
def test_unsupported_rope_scaling_is_named(model_copy, changes, name):
    _edit_config(model_copy, **changes)
    with pytest.raises(ConfigError) as info:
        _runner(model_copy)
    message = str(info.value)
    assert repr(name) in message
    assert all(t in message for t in SUPPORTED_ROPE_TYPES)


def test_config_json_missing(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        _runner(tmp_path)


def test_override_can_make_the_config_invalid_too(tiny_model):
    with pytest.raises(ConfigError, match="FalconForCausalLM"):
        _runner(tiny_model, json_model_override_args={"architectures": ["FalconForCausalLM"]})


def test_eos_ids_merge_generation_config(model_copy):
    eos = json.loads((model_copy / "config.json").read_text())["eos_token_id"]
    eot = json.loads((model_copy / "generation_config.json").read_text())["eos_token_id"][1]
    assert load_model_config(model_copy).eos_token_ids == (eos, eot)
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_model_config(model_copy).eos_token_ids == (eos, 7)
    (model_copy / "generation_config.json").unlink()
    assert load_model_config(model_copy).eos_token_ids == (eos,)


# ---- checkpoint errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.down_proj.weight",  # a plain (row-parallel) weight
        "model.layers.1.self_attn.k_proj.weight",  # a fragment of the fused qkv_proj
        "model.layers.0.mlp.up_proj.weight",  # a fragment of the fused gate_up_proj
        "model.norm.weight",
        "lm_head.weight",  # untied: the LM head is its own tensor
    ],
)
def test_missing_tensor_is_named(model_copy, name):
    _edit_weights(model_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as info:
        _runner(model_copy)
    message = str(info.value)
    assert repr(name) in message
    assert "missing 1 tensor" in message


@pytest.mark.parametrize(
    "name, shape",
    [
        ("model.layers.0.mlp.down_proj.weight", (64, 100)),  # wrong input dim of a row-parallel weight
        ("model.layers.0.self_attn.q_proj.weight", (64, 32)),  # right rows, wrong columns
        ("model.layers.1.self_attn.v_proj.weight", (64, 64)),  # too many KV heads
        ("model.layers.1.mlp.gate_proj.weight", (100, 64)),
        ("model.embed_tokens.weight", (500, 64)),  # vocab mismatch
        ("model.layers.0.input_layernorm.weight", (65,)),
        ("lm_head.weight", (512, 32)),
    ],
)
def test_misshaped_tensor_is_named(model_copy, name, shape):
    def edit(tensors):
        assert tuple(tensors[name].shape) != shape
        tensors[name] = torch.zeros(shape)

    _edit_weights(model_copy, edit)
    with pytest.raises(CheckpointError) as info:
        _runner(model_copy)
    message = str(info.value)
    assert repr(name) in message and "wrong shape" in message


def test_ignored_and_unknown_tensors_do_not_fail(model_copy, tiny_model):
    reference = _logits(_runner(tiny_model))

    def edit(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        tensors["model.extra_head.weight"] = torch.ones(3, 3)

    _edit_weights(model_copy, edit)
    assert torch.equal(_logits(_runner(model_copy)), reference)


def test_no_safetensors_files(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        _runner(model_copy)


# ---- overrides, sharding, dtype ------------------------------------------------------------------


def test_json_model_override_args(tiny_model):
    default = _runner(tiny_model)
    overridden = _runner(tiny_model, json_model_override_args={"rms_norm_eps": 0.25, "rope_theta": 1000.0})
    assert default.model_config.rms_norm_eps == 1e-5
    assert overridden.model_config.rms_norm_eps == 0.25
    assert overridden.model_config.rope.theta == 1000.0
    norms = [overridden.model.model.norm] + [
        m for layer in overridden.model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    assert all(norm.eps == 0.25 for norm in norms)
    assert not torch.allclose(_logits(default), _logits(overridden), atol=1e-3)
    # The folder on disk is untouched.
    assert json.loads((tiny_model / "config.json").read_text())["rms_norm_eps"] == 1e-5


def test_sharded_checkpoint_loads_the_same_weights(model_factory, tiny_model):
    sharded = model_factory("tiny", shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (sharded / "model.safetensors").exists()
    single = _runner(tiny_model)
    split = _runner(sharded)
    assert single.model.state_dict().keys() == split.model.state_dict().keys()
    for name, tensor in single.model.state_dict().items():
        assert torch.equal(tensor, split.model.state_dict()[name]), name
    assert torch.equal(_logits(single), _logits(split))


def test_sharded_checkpoint_missing_tensor_is_named(model_factory, tmp_path):
    sharded = Path(shutil.copytree(model_factory("tiny", shards=3), tmp_path / "sharded"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    shard = sharded / index["weight_map"][name]
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=repr(name).replace(".", r"\.")):
        _runner(sharded)


@pytest.mark.parametrize(
    "dtype, expected",
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("auto", torch.bfloat16),  # the generated config.json says torch_dtype bfloat16
        ("float16", torch.bfloat16),  # no fast fp16 on the CPU: bf16 instead
    ],
)
def test_dtype(tiny_model, dtype, expected):
    runner = _runner(tiny_model, dtype=dtype)
    assert runner.dtype == expected
    assert {p.dtype for p in runner.model.parameters()} == {expected}
    assert {b.dtype for b in runner.kv.pool.k_buffers + runner.kv.pool.v_buffers} == {expected}
    assert runner.kv.bytes_per_token == 2 * 2 * 2 * 16 * torch.empty((), dtype=expected).element_size()
    logits = _logits(runner)
    assert logits.dtype == torch.float32  # logits are float32 whatever the weights
    if expected is not torch.float32:
        reference = _logits(_runner(tiny_model, dtype="float32"))
        cosine = torch.nn.functional.cosine_similarity(logits.flatten(0, 1), reference.flatten(0, 1), dim=-1)
        assert cosine.min().item() > 0.999
