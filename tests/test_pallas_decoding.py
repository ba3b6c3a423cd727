"""The decoding engine with Pallas attention (interpret mode on CPU) equals XLA."""

import flexdraft_jax as fd
from tests.decoding_util import ngram_drafter, random_drafter, tiny_target


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


def test_pallas_tree_decoding_equals_ar(monkeypatch):
  """Draft trees verified by the Pallas kernels (interpret mode) emit AR's
  tokens; the spy checks the tree rows reached the kernels."""
  from flexdraft_jax.kernels import attention as kattn
  trees = []
  real = kattn.attend_pallas

  def spy(*a, **kw):
    trees.append(kw.get("tree") is not None)
    return real(*a, **kw)

  monkeypatch.setattr(kattn, "attend_pallas", spy)
  target = tiny_target()
  drafter = ngram_drafter(target, block_size=4, weight=1.0)
  prompts = [[5, 6, 7, 8]]
  ref = fd.generate(target, prompts, max_new_tokens=8, stop=[])
  out = fd.generate(target, prompts, max_new_tokens=8, stop=[], drafter=drafter,
                    mode="sequential", speculation=fd.SpecOptions(tree_budget=8),
                    runtime=fd.RuntimeOptions(attn_impl="pallas"))
  assert any(trees)
  assert out.token_ids == ref.token_ids
