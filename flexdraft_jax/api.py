"""The public surface: load a target (and drafter), get logits, generate."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax import checks
from flexdraft_jax.compile_cache import use_compile_cache  # noqa: F401
from flexdraft_jax.decoding.engine import (GenerateResult, GenerateStream,  # noqa: F401
                                           StreamChunk, generate, generate_stream)
from flexdraft_jax.decoding.options import Mode, RuntimeOptions, SpecOptions  # noqa: F401
from flexdraft_jax.decoding.sampling import SamplingParams  # noqa: F401
from flexdraft_jax.model import transformer
from flexdraft_jax.model.config import FlexDraftError, Target


def load_target(spec: str, dtype: str = "float32", layout: str = "stacked"):
  """A Target(config, params, tokenizer, name, fingerprint) from an HF
  safetensors directory, a `.gguf` file, a builtin name (`smollm2-135m`) or,
  for tests, `random:NAME`.

  layout="layers" holds each layer's weights as separate arrays, the layout
  decoding reads: a decode-only job (generation, evaluation) then holds the
  weights once, where a "stacked" target (what training needs) also gets a
  per-layer copy the first time it decodes.
  """
  from flexdraft_jax import compile_cache
  from flexdraft_jax.drafter.checkpoint import drafter_folder_target
  from flexdraft_jax.model import loading
  made_for = drafter_folder_target(spec)
  if made_for is not None:
    raise FlexDraftError(
        f"{spec} is a drafter folder (it holds drafter.json), not a target: load it with "
        f"fd.load_drafter({str(spec)!r}, target), the target from fd.load_target("
        f"{made_for or 'TARGET'!r})")
  compile_cache.ensure()  # the persistent compilation cache, unless chosen otherwise
  return loading.load_target(spec, dtype, layout)


def load_drafter(path: str, target):
  """A Drafter saved by training, checked against `target` (a loaded Target,
  from `load_target`); one-line refusal."""
  from flexdraft_jax.drafter import checkpoint
  return checkpoint.load_drafter(path, target)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(params, ids_BxT, *, cfg):
  return transformer.Transformer.of(cfg, params).apply(transformer.variables(params),
                                                       ids_BxT)


def target_logits(target, token_ids) -> jax.Array:
  """Full-sequence fp32 logits `[B, T, V]` for int ids `[B, T]` (no cache reuse)."""
  checks.check_loaded("target", target, Target, "fd.load_target({})")
  ids = np.asarray(token_ids)
  if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
    raise FlexDraftError(f"token_ids must be an int array [B, T], got shape "
                         f"{ids.shape} of {ids.dtype}")
  if ids.size and (ids.min() < 0 or ids.max() >= target.config.vocab_size):
    raise FlexDraftError(f"token ids must be in [0, {target.config.vocab_size})")
  from flexdraft_jax import compile_cache
  compile_cache.ensure()
  return _logits(target.params, jnp.asarray(ids, jnp.int32), cfg=target.config)
