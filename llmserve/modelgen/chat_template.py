"""Llama 3 style chat template and the tokenizer_config.json / special_tokens_map.json around it."""

from typing import Any

from llmserve.modelgen.tokenizer import BOS_TOKEN, EOS_TOKEN, SPECIAL_TOKENS

# The Llama 3 Instruct template: BOS once, then per message a header and <|eot_id|>. It renders BOS
# itself, so rendered chats must be encoded with add_special_tokens=False (as HF does) or BOS doubles.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] | trim) + '<|eot_id|>' -%}"
    "{%- if loop.index0 == 0 -%}{%- set content = bos_token + content -%}{%- endif -%}"
    "{{- content -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)


def _added_token_entry(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def tokenizer_config(token_ids: dict[str, int], model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for transformers' fast tokenizer over tokenizer.json."""
    decoder = {str(token_ids[t]): _added_token_entry(t) for t in SPECIAL_TOKENS}
    return {
        "added_tokens_decoder": decoder,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_map() -> dict[str, str]:
    return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
