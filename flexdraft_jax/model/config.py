"""Architecture hyper-parameters of a target model (Llama / Qwen2 / Qwen3 families)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional


class FlexDraftError(ValueError):
  """A user-facing error: its message is one line naming what is wrong."""


class FlexDraftWarning(UserWarning):
  """A user-facing warning (an option that has no effect): one line."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a decoder-only transformer.

  Weights are laid out `[in, out]` (x @ W); see `flexdraft_jax/model/params.py`.
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  # Only llama3-style rope scaling is supported; kept as a sorted tuple of items
  # so the config stays hashable (it is a static jit argument).
  rope_scaling: Optional[tuple] = None
  rms_norm_eps: float = 1e-6
  qk_norm: bool = False          # Qwen3: RMSNorm on each q/k head.
  attention_bias: bool = False   # Qwen2: biases on q/k/v.
  tie_embeddings: bool = True
  max_position_embeddings: int = 8192
  bos_token_id: Optional[int] = None
  eos_token_ids: tuple = ()
  pad_token_id: int = 0
  model_type: str = "llama"

  @property
  def q_size(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int:
    return self.num_kv_heads * self.head_dim

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise FlexDraftError(
          f"num_heads={self.num_heads} is not a multiple of "
          f"num_kv_heads={self.num_kv_heads}")


SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


def rope_scaling_tuple(rope_scaling: Optional[dict]) -> Optional[tuple]:
  """Validates an HF `rope_scaling` dict and freezes it into a tuple."""
  if not rope_scaling:
    return None
  kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
  if kind not in SUPPORTED_ROPE_TYPES:
    raise FlexDraftError(
        f"unsupported rope_scaling type {kind!r} (supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)})")
  if kind == "default":
    return None
  items = {k: v for k, v in rope_scaling.items() if k != "type"}
  items["rope_type"] = kind
  return tuple(sorted(items.items()))


class Target(NamedTuple):
  """A loaded target (model/loading.py): config, target pytree, tokenizer,
  display name, fingerprint."""
  config: ModelConfig
  params: Any
  tokenizer: Any
  name: str
  fingerprint: str
