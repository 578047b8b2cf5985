"""llmserve.modelgen: deterministic HF-format model folders that transformers loads as-is."""

import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tokenizers import Tokenizer

from llmserve.cli import main
from llmserve.modelgen import make_model, preset_config, train_tokenizer
from llmserve.modelgen.chat_template import CHAT_TEMPLATE
from llmserve.modelgen.safetensors_io import INDEX_FILE, SINGLE_FILE
from llmserve.modelgen.tokenizer import (
    BOS_TOKEN,
    END_HEADER_TOKEN,
    EOS_TOKEN,
    EOT_TOKEN,
    SPECIAL_TOKENS,
    START_HEADER_TOKEN,
)
from llmserve.modelgen.weights import param_count

transformers = pytest.importorskip("transformers")

MULTILINGUAL = "Café naïve Zürich — 日本語の文章 中文 한국어 😀🚀 👨‍👩‍👧 def f(x): return x ** 2  # ok"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "日本語の文章", "1, 2, 3,"]
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "tied": {"tie_word_embeddings": True},
    "head_dim": {"head_dim": 32},  # tiny's default head_dim is 64 / 4 = 16
    "llama3_rope": {"rope_scaling": "llama3"},
    "sharded": {"shards": 3},
}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _file_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="session")
def variant_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modelgen")
    return {name: make_model(root / name, preset="tiny", seed=0, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="session")
def tiny_dir(variant_dirs: dict[str, Path]) -> Path:
    return variant_dirs["base"]


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("modelgen_small"), preset="small", seed=0)


# --- determinism -------------------------------------------------------------------------------

def test_same_arguments_give_identical_files(tiny_dir: Path, tmp_path: Path) -> None:
    again = make_model(tmp_path / "again", preset="tiny", seed=0)
    assert _file_bytes(again) == _file_bytes(tiny_dir)


def test_different_seed_changes_weights_not_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    other = make_model(tmp_path / "seed1", preset="tiny", seed=1)
    assert (other / SINGLE_FILE).read_bytes() != (tiny_dir / SINGLE_FILE).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_sharded_weights_equal_single_file(variant_dirs: dict[str, Path]) -> None:
    d = variant_dirs["sharded"]
    assert not (d / SINGLE_FILE).exists()
    index = _read_json(d / INDEX_FILE)
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        merged.update(load_file(d / f))
    single = load_file(variant_dirs["base"] / SINGLE_FILE)
    assert set(index["weight_map"]) == set(merged) == set(single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    assert all(torch.equal(merged[n], single[n]) for n in single)


def test_rewriting_unsharded_removes_stale_shards(tmp_path: Path) -> None:
    make_model(tmp_path, preset="tiny", shards=2)
    make_model(tmp_path, preset="tiny")
    assert sorted(p.name for p in tmp_path.glob("model*")) == [SINGLE_FILE]


# --- HF loading --------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_llama_loads_without_missing_keys(variant_dirs: dict[str, Path], variant: str) -> None:
    d = variant_dirs[variant]
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        d, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stored: dict[str, torch.Tensor] = {}
    for f in d.glob("model*.safetensors"):
        stored.update(load_file(f))
    params = dict(model.named_parameters(remove_duplicate=False))
    assert all(torch.equal(params[n], stored[n]) for n in stored)
    cfg = model.config
    if variant == "tied":
        assert "lm_head.weight" not in stored
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if variant == "head_dim":
        assert cfg.head_dim == 32
        assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    if variant == "llama3_rope":
        assert cfg.rope_parameters["rope_type"] == "llama3"
        assert cfg.rope_parameters["original_max_position_embeddings"] == 2048 // 4
        assert model.model.rotary_emb.rope_type == "llama3"


def test_config_fields(tiny_dir: Path) -> None:
    cfg = _read_json(tiny_dir / "config.json")
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert cfg["rope_theta"] == 500000.0 and cfg["rms_norm_eps"] == 1e-5 and cfg["hidden_act"] == "silu"
    assert cfg["tie_word_embeddings"] is False
    assert cfg["bos_token_id"] == tok.token_to_id(BOS_TOKEN)
    assert cfg["eos_token_id"] == tok.token_to_id(EOS_TOKEN)
    gen = _read_json(tiny_dir / "generation_config.json")
    assert gen == {"bos_token_id": cfg["bos_token_id"], "do_sample": False,
                   "eos_token_id": [cfg["eos_token_id"], tok.token_to_id(EOT_TOKEN)]}
    assert load_file(tiny_dir / SINGLE_FILE)["model.norm.weight"].dtype == torch.float32


def test_preset_shapes() -> None:
    bench = preset_config("llama", "bench")
    assert (bench["hidden_size"], bench["num_hidden_layers"], bench["num_attention_heads"],
            bench["num_key_value_heads"], bench["intermediate_size"], bench["vocab_size"]) == (
        1024, 8, 16, 4, 2816, 32000)
    assert 150e6 < param_count(bench) < 160e6
    assert preset_config("llama", "small")["vocab_size"] == 2048
    ds = preset_config("deepseek_v2", "bench")
    assert (ds["kv_lora_rank"], ds["qk_rope_head_dim"], ds["qk_nope_head_dim"], ds["v_head_dim"],
            ds["n_routed_experts"], ds["num_experts_per_tok"], ds["q_lora_rank"]) == (512, 64, 128, 128, 64, 6, None)
    assert 300e6 < param_count(ds) < 330e6


def test_config_override_applies_last_and_drives_vocab(tmp_path: Path) -> None:
    d = make_model(tmp_path, preset="tiny", config_override={"num_hidden_layers": 1, "vocab_size": 600})
    cfg = _read_json(d / "config.json")
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == 600
    assert Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size() == 600
    weights = load_file(d / SINGLE_FILE)
    assert weights["lm_head.weight"].shape == (600, 64)
    assert not any(n.startswith("model.layers.1.") for n in weights)


# --- tokenizer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["tiny_dir", "small_dir"])
def test_tokenizer_vocab_matches_config(fixture: str, request: pytest.FixtureRequest) -> None:
    d: Path = request.getfixturevalue(fixture)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == _read_json(d / "config.json")["vocab_size"]
    assert all(tok.token_to_id(t) is not None for t in SPECIAL_TOKENS)


def test_bench_vocab_trains_exactly_and_fast() -> None:
    start = time.perf_counter()
    tok = train_tokenizer(32000)
    assert time.perf_counter() - start < 30
    assert tok.get_vocab_size() == 32000
    assert tok.token_to_id("<|reserved_0|>") is None  # merges alone reach the size


def test_short_corpus_is_padded_with_reserved_tokens() -> None:
    tok = train_tokenizer(4000, augment=False)
    assert tok.get_vocab_size() == 4000
    assert tok.token_to_id("<|reserved_0|>") is not None
    assert tok.id_to_token(3999).startswith("<|reserved_")


def test_encode_prepends_bos_and_roundtrips_multibyte(tiny_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    enc = tok.encode(MULTILINGUAL)
    assert enc.ids[0] == tok.token_to_id(BOS_TOKEN)
    assert tok.encode(MULTILINGUAL, add_special_tokens=False).ids == enc.ids[1:]
    assert tok.decode(enc.ids) == MULTILINGUAL
    assert tok.decode(enc.ids, skip_special_tokens=False) == BOS_TOKEN + MULTILINGUAL


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_any_text_roundtrips(text: str) -> None:
    tok = train_tokenizer(512)  # cached after the first call
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_autotokenizer_and_chat_template(tiny_dir: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert hf(MULTILINGUAL)["input_ids"] == raw.encode(MULTILINGUAL).ids
    assert hf.bos_token == BOS_TOKEN and hf.eos_token == EOS_TOKEN
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi 😀 "}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"{BOS_TOKEN}{START_HEADER_TOKEN}system{END_HEADER_TOKEN}\n\nBe brief.{EOT_TOKEN}"
        f"{START_HEADER_TOKEN}user{END_HEADER_TOKEN}\n\nHi 😀{EOT_TOKEN}"
        f"{START_HEADER_TOKEN}assistant{END_HEADER_TOKEN}\n\n"
    )
    no_prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith(EOT_TOKEN)
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert ids.count(raw.token_to_id(BOS_TOKEN)) == 1  # the template's BOS, not a doubled one
    assert _read_json(tiny_dir / "tokenizer_config.json")["chat_template"] == CHAT_TEMPLATE


# --- peaked next-token distributions -----------------------------------------------------------

def _top2_gaps(model_dir: Path, new_tokens: int = 8) -> list[float]:
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    gaps: list[float] = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        for logits in out.logits:
            top = logits[0].topk(2).values
            gaps.append(float(top[0] - top[1]))
    return gaps


@pytest.mark.parametrize("fixture", ["tiny_dir", "small_dir"])
def test_next_token_logits_are_peaked(fixture: str, request: pytest.FixtureRequest) -> None:
    gaps = _top2_gaps(request.getfixturevalue(fixture))
    assert statistics.median(gaps) > 1.0
    assert sum(g > 0.5 for g in gaps) / len(gaps) > 0.7


# --- CLI ---------------------------------------------------------------------------------------

def test_cli_make_model_with_variants(tmp_path: Path) -> None:
    cli_dir = tmp_path / "cli"
    rc = main(["make-model", "--arch", "llama", "--preset", "tiny", "--seed", "3", "--out", str(cli_dir),
               "--tie-word-embeddings", "--head-dim", "32", "--rope-scaling", "llama3", "--shards", "2",
               "--config-override", '{"rms_norm_eps": 1e-6}'])
    assert rc == 0
    cfg = _read_json(cli_dir / "config.json")
    assert cfg["tie_word_embeddings"] and cfg["head_dim"] == 32 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    api = make_model(tmp_path / "api", preset="tiny", seed=3, tie_word_embeddings=True, head_dim=32,
                     rope_scaling="llama3", shards=2, config_override={"rms_norm_eps": 1e-6})
    assert _file_bytes(api) == _file_bytes(cli_dir)


def test_cli_writes_deepseek_v2(tmp_path: Path) -> None:
    override = '{"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}'
    argv = ["make-model", "--arch", "deepseek_v2", "--rope-scaling", "yarn", "--config-override", override]
    assert main(argv + ["--out", str(tmp_path / "a")]) == 0
    assert main(argv + ["--out", str(tmp_path / "b")]) == 0
    assert _file_bytes(tmp_path / "a") == _file_bytes(tmp_path / "b")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"] and cfg["rope_scaling"]["rope_type"] == "yarn"
    names = load_file(tmp_path / "a" / SINGLE_FILE).keys()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.0.self_attn.q_a_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names


def test_cli_rejects_bad_override(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["make-model", "--out", str(tmp_path), "--config-override", "[1, 2]"])
