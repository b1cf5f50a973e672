"""A tokenizer and chat template for the tiny Llama, trained here with `tokenizers`, so the demo's
servers take text and chat requests (OpenAI clients, agent replayers) and not only token ids.

Rules:
- Byte-level BPE (any text encodes, nothing is unknown) trained on kvpool's own source files, so
  it needs no download and is the same on every machine with the same checkout.
- Ids 0, 1, 2 are <pad>, <s>, </s> (the model's pad/bos/eos; `prompts.TokenSpace` draws above
  them), and the vocabulary is exactly the model's size: ids training did not fill are reserved
  tokens, so any id the model samples decodes.
- The chat template is plain role markers; the model's weights are random, so answers are noise:
  this is for plumbing (routing, caching, streaming), not for reading.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('\\n') %}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ content }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_MARKER = "kvpool-tiny-tokenizer-1"


def _corpus() -> list[str]:
    root = Path(__file__).resolve().parents[1]  # the kvpool package
    return [p.read_text(errors="replace") for p in sorted(root.rglob("*.py"))]


def write_tiny_tokenizer(model_dir: Path | str, vocab_size: int = 8000, max_length: int = 16384) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `model_dir`
    (idempotent for the same vocabulary size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    if (model_dir / "tokenizer.json").exists() and config_path.exists():
        old = json.loads(config_path.read_text())
        if old.get("kvpool") == _MARKER and old.get("kvpool_vocab_size") == vocab_size:
            return model_dir
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, more than the model's {vocab_size}")
    missing = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([f"<reserved_{k}>" for k in range(missing)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    config_path.write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **specials, "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "add_bos_token": False,
        "kvpool": _MARKER, "kvpool_vocab_size": vocab_size,
    }, indent=2))  # fmt: skip
    (model_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return model_dir
