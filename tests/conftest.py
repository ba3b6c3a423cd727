"""Shared fixtures: tiny random HF checkpoints, and the builtin SmolLM2 target.

Every tiny model has all its norm weights and biases randomised (HF initialises
them to 1 / 0, which would hide a missing or misplaced norm/bias).
"""

from __future__ import annotations

import os
import tempfile

import pytest

from flexdraft_jax.model.hf_reference import hf_llama_from_target

TINY_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{% for message in messages %}
  {% if message.role == 'system' and not loop.first %}
    {{ raise_exception('the system message must come first') }}
  {% elif message.role != 'system' %}
{{ '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>' }}
{% if message.role == 'assistant' %}{{ eos_token }}{% endif %}

  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\\n' }}
  {% if enable_thinking is defined and enable_thinking is false %}
{{ '<think>\\n\\n</think>\\n\\n' }}
  {% endif %}
{% endif %}"""

_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "def square(x):\n    return x * x  # café, naïve, 日本語",
    "Numbers: 3.14159, 2024-01-01 and 42!",
    "<think>reasoning</think> The answer is 7.",
]

TINY = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _randomise(model, seed: int):
  """Gives every parameter a non-trivial random value (norms around 1, biases ±0.3)."""
  import torch
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name:
        p.copy_(1.0 + 0.3 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.3 * noise)
      elif "embed_tokens" in name:
        p.copy_(0.5 * noise)
      else:
        p.copy_(noise / p.shape[-1] ** 0.5)
  return model


def _tiny_tokenizer():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=TINY["vocab_size"], show_progress=False,
      special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_CORPUS * 20, trainer)
  return tok


def _save_tokenizer(path: str):
  from transformers import PreTrainedTokenizerFast
  hf = PreTrainedTokenizerFast(tokenizer_object=_tiny_tokenizer(), eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
  hf.chat_template = TINY_CHAT_TEMPLATE
  hf.save_pretrained(path)


def _build(kind: str, seed: int, **overrides):
  import torch
  import transformers
  cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
         "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
  torch.manual_seed(seed)
  cfg = cls[0](**{**TINY, **overrides}, attn_implementation="eager")
  cfg.eos_token_id = 2
  return _randomise(cls[1](cfg).eval(), seed)


TINY_MODELS = {
    "qwen3_tied": ("qwen3", dict(head_dim=12, tie_word_embeddings=True, rope_theta=1000.0)),
    "qwen3_untied": ("qwen3", dict(head_dim=12, tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "llama": ("llama", dict(tie_word_embeddings=False, rope_theta=5000.0)),
    "llama_rope3": ("llama", dict(tie_word_embeddings=False, rope_theta=5000.0, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2_bias": ("qwen2", dict(tie_word_embeddings=False, num_key_value_heads=1)),
}


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
  """{name: (checkpoint dir, HF torch model)} for every entry of TINY_MODELS."""
  out = {}
  for i, (name, (kind, overrides)) in enumerate(TINY_MODELS.items()):
    path = str(tmp_path_factory.mktemp(name))
    model = _build(kind, seed=100 + i, **overrides)
    model.save_pretrained(path)
    if name == "qwen3_tied":
      _save_tokenizer(path)
    out[name] = (path, model)
  return out


@pytest.fixture(scope="session")
def sharded_llama_dir(tiny_hf, tmp_path_factory):
  """The `llama` tiny model saved as a sharded safetensors checkpoint."""
  path = str(tmp_path_factory.mktemp("llama_sharded"))
  tiny_hf["llama"][1].save_pretrained(path, max_shard_size="20KB")
  assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
  return path


@pytest.fixture(scope="session")
def smollm2_target():
  """The builtin `smollm2-135m` target, float32."""
  from flexdraft_jax.model.loading import load_target
  return load_target("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_target):
  """An HF LlamaForCausalLM (torch fp32) holding SmolLM2's dequantized weights."""
  return hf_llama_from_target(smollm2_target)


@pytest.fixture(autouse=True)
def absl_flags_restored():
  """Removes the absl flags a test's in-process command defined (a command
  defines its flags when it runs): left on the process-wide FLAGS, a later
  script that defines the same name at import (add-ngram's and a profiler's
  --top) would fail. Flags that libraries define once, at import, stay."""
  from absl import flags
  before = set(flags.FLAGS)
  yield
  for name in set(flags.FLAGS) - before:
    if name in flags.FLAGS and (flags.FLAGS.find_module_defining_flag(name) or ""
                                ).startswith("flexdraft_jax."):
      delattr(flags.FLAGS, name)


@pytest.fixture(autouse=True)
def flex_calibration_forgotten():
  """Flex starts each request from how confidence predicted acceptance in the
  last request with the same target, drafter and temperature in the process
  (flex._SCALES): every test starts from none."""
  from flexdraft_jax.decoding import flex
  flex._SCALES.clear()
  yield
  flex._SCALES.clear()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program after each test module. XLA maps each loaded
  CPU executable's code into the process; the whole suite in one process
  otherwise passes Linux's per-process mapping limit (vm.max_map_count, 65,530)
  and the next executable to load crashes the process. The persistent compile
  cache makes the recompiles cheap."""
  yield
  from flexdraft_jax.decoding import memory_maps
  memory_maps.release()


def pytest_configure(config):
  """One persistent XLA compile cache for the whole suite (and the subprocesses
  tests start): the same tiny targets are compiled by many tests and by every
  rerun. `$FLEXDRAFT_TEST_XLA_CACHE` moves it; the `slow` marker is registered
  in setup.cfg."""
  import jax
  # Tests patch functions that decode programs call: a traced program kept
  # from another test (decoding/kept_programs.py) would not see the patch.
  # The tests of kept programs turn them on where they need them.
  os.environ["FLEXDRAFT_KEPT_PROGRAMS"] = "off"
  jax.config.update("jax_compilation_cache_dir", os.environ.get(
      "FLEXDRAFT_TEST_XLA_CACHE",
      os.path.join(tempfile.gettempdir(), f"flexdraft_test_xla_cache_{os.getuid()}")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
