"""A torch reference for tests and benchmarks: the same weights in HF transformers.

Needs torch and transformers (the `test` extra); nothing in the library imports
this module.
"""

from __future__ import annotations

import numpy as np


def hf_llama_from_target(target):
  """An HF LlamaForCausalLM (torch fp32, tied) holding a loaded Llama target's
  weights (stacked layout)."""
  import torch
  import transformers
  cfg = target.config
  hf_cfg = transformers.LlamaConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
      max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
      attn_implementation="eager")
  model = transformers.LlamaForCausalLM(hf_cfg).eval()
  p, lp = target.params, target.params["layers"]
  t = lambda x: torch.from_numpy(np.array(x, dtype=np.float32))
  state = {"model.embed_tokens.weight": t(p["embed"]), "model.norm.weight": t(p["final_norm"])}
  names = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
           "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}
  for i in range(cfg.num_layers):
    for key, hf_name in names.items():
      w = lp[key][i]
      state[f"model.layers.{i}.{hf_name}.weight"] = t(w.T if w.ndim == 2 else w)
  result = model.load_state_dict(state, strict=False)
  if set(result.missing_keys) - {"lm_head.weight"} or result.unexpected_keys:
    raise ValueError(f"weights do not match the HF model: {result}")
  if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
    raise ValueError("the HF model's LM head is not tied to its embedding")
  return model
