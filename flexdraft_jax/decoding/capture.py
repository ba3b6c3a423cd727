"""The decode state of a real run, for the step profilers in launch/experiments/.

`first_chunk(target, drafter, prompts)` decodes `prompts` (sequential mode,
the chat template, stops off) and returns the first jitted chunk's arguments —
`(target_params, draft_params, state)`, copied before the chunk donates them,
in the layout decoding uses (`draft_dtype` as `generate` takes it) — and its
keyword arguments.
"""

from __future__ import annotations


def first_chunk(target, drafter, prompts, max_new_tokens: int = 128,
                draft_dtype: str = "auto") -> tuple:
  import jax
  import jax.numpy as jnp

  import flexdraft_jax as fd
  from flexdraft_jax.decoding import chunk

  first, real = {}, chunk.run_chunk

  def capture(*a, **kw):
    if not first:
      first.update(args=a[:2] + (jax.tree.map(jnp.copy, a[2]),), kw=kw)
    return real(*a, **kw)

  chunk.run_chunk = capture
  try:
    fd.generate(target, prompts, max_new_tokens=max_new_tokens, drafter=drafter,
                mode=fd.Mode.SEQUENTIAL, stop=[], chat=True,
                speculation=fd.SpecOptions(verify_len=2, draft_dtype=draft_dtype))
  finally:
    chunk.run_chunk = real
  return first["args"], first["kw"]
