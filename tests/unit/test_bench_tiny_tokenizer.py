"""The tiny model's tokenizer: trained locally, exactly the model's vocabulary, specials at 0-2,
any id decodes, text round-trips, and the chat template renders roles."""

import json

import jinja2
import pytest
from tokenizers import Tokenizer

from kvpool.bench.tiny_tokenizer import CHAT_TEMPLATE, write_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=8000)


def test_vocabulary_is_the_models_and_specials_come_first(tok_dir):
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == 8000
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    assert isinstance(tok.decode(list(range(3, 8000, 7))), str)  # every id the model can sample decodes
    text = "kvpool routes each turn where it finishes soonest: ünïcode too."
    assert tok.decode(tok.encode(text).ids) == text
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["chat_template"]) == ("<s>", "</s>", CHAT_TEMPLATE)


def test_writing_again_is_a_no_op(tok_dir):
    before = (tok_dir / "tokenizer.json").stat().st_mtime_ns
    write_tiny_tokenizer(tok_dir, vocab_size=8000)
    assert (tok_dir / "tokenizer.json").stat().st_mtime_ns == before


def test_chat_template_renders_roles_and_content_parts():
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    text = template.render(bos_token="<s>", add_generation_prompt=True, messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    ])  # fmt: skip
    assert text == "<s><|system|>\nbe brief\n<|user|>\nhi\nthere\n<|assistant|>\n"
