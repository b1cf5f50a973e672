"""Token ids of text and chat prompts, as the served model's vLLM makes them (`--tokenizer MODEL`).

Rules:
- Completions: the text through the tokenizer, with special tokens unless the body says
  `add_special_tokens: false` (vLLM's default for completions). Chat: the model's chat template
  rendered as vLLM renders it by default (`add_generation_prompt` true, `continue_final_message`,
  `tools` and `chat_template_kwargs` from the body), then tokenized without special tokens.
- A prompt the tokenizer or its template cannot take gives None: the request is then sized by its
  characters and routed with no chain, as without a tokenizer. Token-id prompts are never re-tokenized.
- Pure but for loading the tokenizer once, at start. Tokenizing a long prompt takes milliseconds:
  the HTTP shell runs it on a worker thread, never on the event loop (app.py).
"""

from __future__ import annotations

from typing import Any

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
TOKENIZED_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH})


class PromptTokenizer:
    def __init__(self, model: str, tokenizer: Any | None = None) -> None:
        """`model`: a local directory or a hub id the machine has cached (nothing is downloaded at
        request time); `tokenizer`: an already loaded one (tests)."""
        if tokenizer is None:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ValueError("--tokenizer needs the transformers package (it comes with vLLM)") from None
            try:
                tokenizer = AutoTokenizer.from_pretrained(model)
            except (OSError, ValueError) as e:
                raise ValueError(f"--tokenizer {model!r}: cannot load a tokenizer from it: {e}") from None
        self.model = model
        self._tokenizer = tokenizer

    def token_ids(self, path: str, body: dict) -> list[int] | None:
        try:
            if path == CHAT_PATH:
                return self._chat(body)
            if path == COMPLETIONS_PATH:
                return self._completion(body)
        except Exception:  # noqa: BLE001  (a template or tokenizer error: routed as without a tokenizer)
            return None
        return None

    def _completion(self, body: dict) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None  # token ids (counted exactly already), or several prompts
        special = body.get("add_special_tokens", True) is not False
        return list(self._tokenizer(prompt, add_special_tokens=special).input_ids)

    def _chat(self, body: dict) -> list[int] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        kwargs = body.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        continue_final = body.get("continue_final_message") is True
        text = self._tokenizer.apply_chat_template(
            messages, tools=body.get("tools"), tokenize=False, continue_final_message=continue_final,
            add_generation_prompt=body.get("add_generation_prompt", not continue_final) is not False, **kwargs,
        )  # fmt: skip
        special = body.get("add_special_tokens", False) is True
        return list(self._tokenizer(text, add_special_tokens=special).input_ids)
