"""The decoding engine with Pallas attention (interpret mode on CPU) equals XLA."""

import flexdraft_jax as fd
from tests.decoding_util import random_drafter, tiny_target


def test_pallas_engine_is_token_identical_to_xla():
  target = tiny_target()
  drafter = random_drafter(target, block_size=4, noise=0.5)
  prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15]]
  for mode in ("ar", "parallel", "sequential"):
    kw = dict(max_new_tokens=9, drafter=drafter, mode=mode, stop=[],
              speculation=fd.SpecOptions(threshold=0.3 if mode != "ar" else 0.0))
    xla = fd.generate(target, prompts, runtime=fd.RuntimeOptions(attn_impl="xla"), **kw)
    pallas = fd.generate(target, prompts, runtime=fd.RuntimeOptions(attn_impl="pallas"),
                         **kw)
    assert pallas.token_ids == xla.token_ids, mode
