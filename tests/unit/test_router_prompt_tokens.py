"""Text and chat prompts tokenized as vLLM does (prompt_tokens.py), with the tiny model's tokenizer
and chat template (trained here from kvpool's sources: nothing is downloaded)."""

import pytest

from kvpool.bench.tiny_tokenizer import write_tiny_tokenizer
from kvpool.router.prompt_tokens import PromptTokenizer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    return PromptTokenizer(str(write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=400)))


def test_chat_prompts_are_the_rendered_template_tokenized(tokenizer):
    hf = tokenizer._tokenizer
    ids = tokenizer.token_ids(CHAT, {"messages": MESSAGES})
    assert ids == list(hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert ids[0] == hf.bos_token_id and ids[-len(hf("<|assistant|>\n").input_ids):] == hf("<|assistant|>\n").input_ids
    # continuing the last message: no generation prompt
    ids = tokenizer.token_ids(CHAT, {"messages": MESSAGES + [{"role": "assistant", "content": "hi"}],
                                     "continue_final_message": True})  # fmt: skip
    assert ids is not None and hf.decode(ids).rstrip().endswith("hi")


def test_completion_prompts_and_what_is_left_alone(tokenizer):
    hf = tokenizer._tokenizer
    assert tokenizer.token_ids(COMPLETIONS, {"prompt": "hello world"}) == hf("hello world").input_ids
    assert tokenizer.token_ids(COMPLETIONS, {"prompt": ["hello world"]}) == hf("hello world").input_ids
    assert tokenizer.token_ids(COMPLETIONS, {"prompt": [1, 2, 3]}) is None  # token ids: counted already
    assert tokenizer.token_ids(COMPLETIONS, {"prompt": ["a", "b"]}) is None  # several prompts
    assert tokenizer.token_ids(CHAT, {"messages": []}) is None
    assert tokenizer.token_ids(CHAT, {"messages": [{"role": "user", "content": 7}]}) is None  # the template fails
    assert tokenizer.token_ids("/v1/embeddings", {"input": "x"}) is None


def test_a_tokenizer_that_does_not_load_says_so(tmp_path):
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        PromptTokenizer(str(tmp_path / "nothing-here"))
