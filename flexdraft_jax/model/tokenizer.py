"""Tokenizer of a target checkpoint: a `tokenizers.Tokenizer` plus its chat template.

Built either from an HF `tokenizer.json` (+ `tokenizer_config.json`) or from the
vocabulary a GGUF file embeds. Chat templates are rendered the way transformers
renders them (sandboxed Jinja, `trim_blocks`, `lstrip_blocks`, the special tokens
as variables), so chat prompts give the same ids as HF's
`apply_chat_template(..., tokenize=True)`.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Optional, Sequence, Union

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from flexdraft_jax.model.config import FlexDraftError

Messages = Union[str, Sequence[dict]]

# llama.cpp `tokenizer.ggml.pre` values whose split regex differs from GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
                "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
                "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


def _byte_alphabet() -> dict:
  """GPT-2's byte -> printable unicode character table (byte-level BPE)."""
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
          + list(range(0xAE, 0x100)))
  table, extra = {}, 0
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (HF training templates): renders the body."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise FlexDraftError(f"invalid chat template (line {e.lineno}): {e.message}") from e


def _token_text(tok) -> Optional[str]:
  """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
  if isinstance(tok, dict):
    return tok.get("content")
  return tok


class Tokenizer:
  """Encode/decode plus chat-template rendering for one checkpoint."""

  def __init__(self, backend: tokenizers.Tokenizer, *,
               special_tokens: Optional[dict] = None,
               chat_template: Optional[str] = None,
               bos_token_id: Optional[int] = None,
               eos_token_ids: Sequence[int] = ()):
    """`special_tokens`: {"bos_token": str, "eos_token": str, ...} for templates."""
    self.backend = backend
    self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    self.chat_template = chat_template
    self._template = _compile_template(chat_template) if chat_template else None
    self._bos = bos_token_id
    self._eos = tuple(dict.fromkeys(int(i) for i in eos_token_ids))

  # ---- construction -------------------------------------------------------

  @classmethod
  def from_hf_dir(cls, path: str, *, bos_token_id=None, eos_token_ids=()) -> "Tokenizer":
    """From `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` in `path`.

    `bos_token_id`/`eos_token_ids` (from the model config) take precedence; the
    tokenizer config's `eos_token` is appended to the eos ids.
    """
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
      raise FlexDraftError(f"missing tokenizer.json in {path}")
    try:
      backend = tokenizers.Tokenizer.from_file(tok_file)
    except Exception as e:  # the Rust error type is not exported
      raise FlexDraftError(f"cannot read {tok_file}: {e}") from e
    tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    special = {k: _token_text(tcfg.get(k))
               for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    template = _hf_chat_template(path, tcfg)
    if bos_token_id is None and special["bos_token"] is not None:
      bos_token_id = backend.token_to_id(special["bos_token"])
    eos = list(eos_token_ids)
    if special["eos_token"] is not None and backend.token_to_id(special["eos_token"]) is not None:
      eos.append(backend.token_to_id(special["eos_token"]))
    return cls(backend, special_tokens=special, chat_template=template,
               bos_token_id=bos_token_id, eos_token_ids=eos)

  @classmethod
  def from_gguf_fields(cls, fields: dict) -> "Tokenizer":
    """From a GGUF's `tokenizer.*` metadata ({key: python value}); byte-level BPE only."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
      raise FlexDraftError(
          f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2')")
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    backend = _byte_level_bpe(tokens, fields.get("tokenizer.ggml.merges") or [],
                              fields.get("tokenizer.ggml.pre"))
    _add_gguf_special_tokens(backend, tokens, types)
    ids = {k: fields.get(f"tokenizer.ggml.{k}_token_id")
           for k in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    if fields.get("tokenizer.ggml.add_bos_token") and ids["bos"] is not None:
      bos = tokens[ids["bos"]]
      backend.post_processor = processors.TemplateProcessing(
          single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos"])])
    special = {name: tokens[ids[k]] if ids[k] is not None else None
               for name, k in (("bos_token", "bos"), ("eos_token", "eos"),
                               ("unk_token", "unknown"), ("pad_token", "padding"))}
    eos = [ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None]
    return cls(backend, special_tokens=special,
               chat_template=fields.get("tokenizer.chat_template"),
               bos_token_id=ids["bos"], eos_token_ids=eos)

  # ---- properties ---------------------------------------------------------

  @property
  def bos_token_id(self) -> Optional[int]:
    return self._bos

  @property
  def eos_token_ids(self) -> tuple:
    return self._eos

  @property
  def vocab_size(self) -> int:
    """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  # ---- encode / decode ----------------------------------------------------

  def encode(self, text: str, add_special_tokens: bool = True) -> list:
    """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. BOS)."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids`."""
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages_or_text: Messages, add_generation_prompt: bool = True,
                  **kwargs: Any) -> str:
    """The chat template rendered to text (a string is one user message)."""
    if self._template is None:
      raise FlexDraftError("this checkpoint has no chat template")
    if isinstance(messages_or_text, str):
      messages = [{"role": "user", "content": messages_or_text}]
    else:
      messages = [{k: v for k, v in dict(m).items() if v is not None} for m in messages_or_text]
    variables = dict(self.special_tokens)
    variables.update(kwargs)
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    try:
      return self._template.render(messages=messages,
                                   add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
      raise FlexDraftError(f"chat template error: {e}") from e

  def apply_chat_template(self, messages_or_text: Messages, add_generation_prompt: bool = True,
                          **kwargs: Any) -> list:
    """Ids of the rendered chat; kwargs (e.g. `enable_thinking=False`) reach the template."""
    text = self.render_chat(messages_or_text, add_generation_prompt, **kwargs)
    return self.encode(text, add_special_tokens=False)


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise FlexDraftError(f"cannot parse {path}: {e}") from e


def _hf_chat_template(path: str, tcfg: dict) -> Optional[str]:
  """`chat_template.jinja` (transformers >= 4.43 saves it there) or tokenizer_config's."""
  jinja_file = os.path.join(path, "chat_template.jinja")
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return f.read()
  template = tcfg.get("chat_template")
  if isinstance(template, list):  # [{"name": ..., "template": ...}]
    named = {t["name"]: t["template"] for t in template}
    template = named.get("default", next(iter(named.values()), None))
  return template


def _byte_level_bpe(tokens: list, merges: list, pre: Optional[str]) -> tokenizers.Tokenizer:
  """A byte-level BPE like transformers builds from a GGUF vocabulary."""
  alphabet = _byte_alphabet()
  letters = set(alphabet.values())
  vocab = {}
  for i, tok in enumerate(tokens):
    spelled = tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8"))
    vocab.setdefault(spelled, i)
  pairs = [tuple(m.split(" ", 1)) for m in merges]
  backend = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="",
      fuse_unk=False, dropout=None))
  split = _GGUF_SPLITS.get(pre)
  if split is None:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  return backend


def _add_gguf_special_tokens(backend, tokens, types):
  """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens."""
  letters = set(_byte_alphabet().values())
  control = [AddedToken(t, normalized=False, special=True)
             for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL and set(t) <= letters]
  if control:
    backend.add_special_tokens(control)
  user = [AddedToken(t, normalized=False, special=False)
          for t, ty in zip(tokens, types)
          if ty == _GGUF_USER_DEFINED and backend.token_to_id(t) is not None]
  if user:
    backend.add_tokens(user)
