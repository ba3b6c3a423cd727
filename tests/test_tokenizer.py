"""Tokenizer: encode/decode and chat templates agree with transformers' tokenizers."""

from __future__ import annotations

import os

import pytest

from flexdraft_jax.model import loading
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.model.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "",
    "  leading spaces,\ttabs\tand\n\nnewlines   \n",
    "unicode: café naïve Ærøskøbing 日本語テキスト 🤖👍🏽 Ω≈ç√∫ — “quotes” ½ ²",
    "def square(x):\n    return x ** 2  # squares x\n\nprint([square(i) for i in range(10)])\n",
    "Numbers 3.14159, 2024-01-01, 1,000,000 and 12345678901234567890.",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "don't you'll we're it's I'M   UPPER lower MiXeD\r\nCRLF",
]

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a prime number."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Write `print(1)` in Python.\n  Thanks"}],
]


def _hf_chat_ids(hf_tok, messages, **kwargs):
  out = hf_tok.apply_chat_template(messages, tokenize=True, **kwargs)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


# ---- SmolLM2 (tokenizer rebuilt from the GGUF vocabulary) -------------------

@pytest.fixture(scope="module")
def smollm2_hf_tokenizer():
  from transformers import AutoTokenizer
  path = loading.builtin_path("smollm2-135m")
  return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encode_decode_match_hf(smollm2_target, smollm2_hf_tokenizer, text):
  tok, hf = smollm2_target.tokenizer, smollm2_hf_tokenizer
  ids = tok.encode(text)
  assert ids == hf.encode(text)
  assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
  assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
  assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)


@pytest.mark.slow
@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_chat_template_matches_hf(smollm2_target, smollm2_hf_tokenizer, chat, gen):
  messages = CHATS[chat]
  want = _hf_chat_ids(smollm2_hf_tokenizer, messages, add_generation_prompt=gen)
  assert smollm2_target.tokenizer.apply_chat_template(messages, add_generation_prompt=gen) == want


@pytest.mark.slow
def test_smollm2_special_ids(smollm2_target, smollm2_hf_tokenizer):
  tok = smollm2_target.tokenizer
  assert tok.bos_token_id == smollm2_hf_tokenizer.bos_token_id == 1
  assert tok.eos_token_ids == (smollm2_hf_tokenizer.eos_token_id,) == (2,)
  assert tok.vocab_size == len(smollm2_hf_tokenizer) == 49152
  assert tok.apply_chat_template("hi") == tok.apply_chat_template(
      [{"role": "user", "content": "hi"}])


# ---- tiny HF directory (tokenizer.json + chat_template.jinja) ----------------

@pytest.fixture(scope="module")
def tiny_pair(tiny_hf):
  from transformers import AutoTokenizer
  path = tiny_hf["qwen3_tied"][0]
  return loading.load_target(path).tokenizer, AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_encode_decode_match_hf(tiny_pair, text):
  tok, hf = tiny_pair
  assert tok.encode(text) == hf.encode(text)
  assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("kwargs", [dict(add_generation_prompt=True),
                                    dict(add_generation_prompt=False),
                                    dict(add_generation_prompt=True, enable_thinking=False)])
def test_tiny_chat_template_matches_hf(tiny_pair, chat, kwargs):
  tok, hf = tiny_pair
  messages = CHATS[chat]
  assert tok.render_chat(messages, **kwargs) == hf.apply_chat_template(messages, tokenize=False,
                                                                       **kwargs)
  assert tok.apply_chat_template(messages, **kwargs) == _hf_chat_ids(hf, messages, **kwargs)


def test_tiny_special_ids(tiny_pair):
  tok, hf = tiny_pair
  assert hf.eos_token_id in tok.eos_token_ids and 2 in tok.eos_token_ids
  assert tok.vocab_size == len(hf)
  assert "<think>" in tok.render_chat("x", enable_thinking=False)
  assert "<think>" not in tok.render_chat("x")


def test_template_errors_are_flexdraft_errors(tiny_pair):
  tok, _ = tiny_pair
  bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
  with pytest.raises(FlexDraftError, match="chat template error: the system message must come"):
    tok.apply_chat_template(bad)
  with pytest.raises(FlexDraftError, match="invalid chat template"):
    Tokenizer(tok.backend, chat_template="{% for m in messages %}")
  with pytest.raises(FlexDraftError, match="no chat template"):
    Tokenizer(tok.backend).apply_chat_template("hi")


# Constructs Qwen3-style templates rely on: namespace, reversed slices, string
# methods, tojson (non-ASCII kept), tools, loop variables, whitespace control.
QWEN_STYLE_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages[::-1] %}
  {%- if m.role == 'user' and ns.last_user < 0 %}{% set ns.last_user = messages|length - 1 - loop.index0 %}{% endif %}
{%- endfor %}
{%- if tools %}{{- '<tools>' + tools | tojson + '</tools>\\n' }}{% endif %}
{%- for m in messages %}
  {%- set content = m.content %}
  {%- if m.role == 'assistant' and '</think>' in content %}
    {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
  {%- endif %}
  {{- '<|im_start|>' + m.role + '\\n' + content }}
  {%- if loop.index0 == ns.last_user and content.startswith('Q') %}{{ ' [last]' }}{% endif %}
  {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"""


def test_qwen_style_template_constructs(tiny_pair):
  tok, hf = tiny_pair
  ours = Tokenizer(tok.backend, special_tokens=tok.special_tokens,
                   chat_template=QWEN_STYLE_TEMPLATE)
  messages = [{"role": "user", "content": "Q: café?"},
              {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nYes."},
              {"role": "user", "content": "Q again"}]
  tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
  want = hf.apply_chat_template(messages, tools=tools, chat_template=QWEN_STYLE_TEMPLATE,
                                tokenize=False, add_generation_prompt=True)
  assert ours.render_chat(messages, tools=tools) == want
  assert "[last]" in want and "météo" in want and "hmm" not in want
