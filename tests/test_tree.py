"""Draft trees (decoding/tree.py): the tree is the best paths, verification
follows the target, tree decoding equals AR; real prompts on SmolLM2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexdraft_jax as fd
from flexdraft_jax.decoding import state as state_lib
from flexdraft_jax.decoding import tree
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.model import attention, pytree
from tests.decoding_util import bigram_drafter, ngram_drafter, random_drafter, tiny_target
from tests.test_decoding import assert_lossless, cost_cache, prompts_for  # noqa: F401


@pytest.fixture(scope="module")
def target():
  return tiny_target()


def _prefilled(target, drafter, prompt, top):
  cfg = target.config
  return state_lib.prefill(
      target.params, cfg, pytree.KVCache.zeros(cfg, 1, 128, jnp.float32),
      jnp.asarray([prompt]), jnp.asarray([len(prompt)]), jnp.asarray([True]),
      jax.random.PRNGKey(0), sp=SamplingParams(), max_new=jnp.int32(20), out_len=64,
      stop_ids=jnp.asarray([-1]), drafter=drafter, tree_top=top)


def _all_paths(target, drafter, state):
  """(Σ log q, path) of every path of candidates up to the block's depth,
  re-scored slot by slot as `tree._children` does, one path at a time."""
  cand = np.asarray(state.cand_BxDxC[0])
  out = []

  def walk(path, total, prev2, prev):
    j = len(path)
    if j == cand.shape[0]:
      return
    lp = np.asarray(tree._children(target.config, drafter, state, j,
                                   jnp.asarray([[prev2]]), jnp.asarray([[prev]]))[0, 0])
    for c, l in zip(cand[j], lp):
      out.append((total + float(l), path + (int(c),)))
      walk(path + (int(c),), total + float(l), prev, int(c))

  walk((), 0.0, -1, int(state.bonus_B[0]))
  return out


@pytest.mark.parametrize("make, budget", [
    (lambda t: random_drafter(t, block_size=4, noise=0.05), 9),
    (lambda t: ngram_drafter(t, block_size=4, weight=1.0), 12)])
def test_the_tree_is_the_best_paths(target, make, budget):
  """Every node's path is among the `budget - 1` likeliest paths of the block
  (brute force over all paths of the candidates), the set is prefix-closed and
  in topological order, and siblings differ."""
  drafter = make(target)
  top = 5
  st = _prefilled(target, drafter, [5, 9, 12, 7], top)
  tokens, parent, depth = (np.asarray(x)[0] for x in tree.build_tree(
      target.config, drafter, st, budget))
  assert tokens[0] == int(st.bonus_B[0]) and parent[0] == -1 and depth[0] == 0
  assert all(0 <= parent[t] < t and depth[t] == depth[parent[t]] + 1
             for t in range(1, budget))
  kids = {}
  for t in range(1, budget):
    kids.setdefault(parent[t], []).append(tokens[t])
  assert all(len(set(v)) == len(v) for v in kids.values())
  # All paths of every depth over the candidates (token ids == indices here).
  scored = sorted(_all_paths(target, drafter, st), key=lambda x: -x[0])
  best = {p for _, p in scored[:budget - 1]}
  cutoff = scored[budget - 2][0]

  def path_of(t):
    out = []
    while t > 0:
      out.append(int(tokens[t]))
      t = parent[t]
    return tuple(reversed(out))

  got = {path_of(t) for t in range(1, budget)}
  # Equal sets, up to ties at the cut-off (scores within float noise of it).
  diff = got ^ best
  assert all(abs(s - cutoff) < 1e-3 for s, p in scored if p in diff), diff


def test_accepted_path_follows_the_target():
  # root 0 ─ 1 (tok 7) ─ 3 (tok 9) ─ 5 (tok 4)
  #        └ 2 (tok 8) ─ 4 (tok 2)
  tokens = jnp.asarray([[1, 7, 8, 9, 2, 4]])
  parent = jnp.asarray([[-1, 0, 0, 1, 2, 3]])
  depth = jnp.asarray([[0, 1, 1, 2, 2, 3]])
  # target after root: 8 → node 2; after node 2: 2 → node 4; after node 4: 6 (bonus)
  y = jnp.asarray([[8, 9, 2, 5, 6, 0]])
  a, path = tree.accepted_path(tokens, parent, depth, y, 3)
  assert int(a[0]) == 2 and path[0, :3].tolist() == [0, 2, 4]
  anc = np.asarray(tree.ancestors(parent, 3))[0]
  assert anc[5].tolist() == [True, True, False, True, False, True]
  assert anc[4].tolist() == [True, False, True, False, True, False]
  # nothing matches: only the root
  a, path = tree.accepted_path(tokens, parent, depth, jnp.asarray([[3, 0, 0, 0, 0, 0]]), 3)
  assert int(a[0]) == 0


def test_tree_attention_sees_ancestors_only():
  """A tree's rows in the cache see the slots before the root and their own
  ancestors: the same as each row's path attended to as a sequence."""
  r = np.random.RandomState(0)
  B, K, G, D, S, T, start = 2, 2, 2, 8, 256, 5, 7
  N = K * G
  parent = np.array([-1, 0, 0, 1, 2])
  anc = np.zeros((T, T), bool)
  for t in range(T):
    u = t
    while u >= 0:
      anc[t, u] = True
      u = parent[u]
  q = jnp.asarray(r.randn(B, T, N, D), jnp.float32)
  k = jnp.asarray(r.randn(B, K, S, D), jnp.float32)
  v = jnp.asarray(r.randn(B, K, S, D), jnp.float32)
  slot = jnp.broadcast_to(start + jnp.arange(T), (B, T))
  treeinfo = (jnp.full((B,), start), jnp.broadcast_to(jnp.asarray(anc), (B, T, T)))
  got = attention.attend(q, k, v, slot, tree=treeinfo, kv_block=128)
  whole = attention.attend(q, k, v, slot, tree=treeinfo)
  for t in range(T):
    # row t alone, over a cache whose tree slots hold only its ancestors
    keep = np.concatenate([np.arange(start), start + np.flatnonzero(anc[t])])
    ref = attention.attend(q[:, t:t + 1], k[:, :, keep], v[:, :, keep],
                           jnp.full((B, 1), len(keep) - 1))
    np.testing.assert_allclose(got[:, t], ref[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(whole[:, t], ref[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch, budget", [(1, 2), (1, 6), (3, 16), (5, 9)])
def test_tree_decoding_equals_ar(target, batch, budget):
  prompts = prompts_for(batch, seed=20 + batch)
  drafter = ngram_drafter(target, block_size=4, weight=1.0)
  ref = fd.generate(target, prompts, max_new_tokens=33)
  out = fd.generate(target, prompts, max_new_tokens=33, drafter=drafter,
                    mode="sequential", speculation=fd.SpecOptions(tree_budget=budget))
  assert_lossless(target, prompts, ref.token_ids, out.token_ids)
  assert out.stats["new_tokens"] == ref.stats["new_tokens"]
  if budget > 2:   # the tree took more than one token some steps
    assert out.stats["tau"] > 1.0


def test_tree_decoding_with_stops_and_rows_finishing_apart(target):
  prompts = prompts_for(5, seed=7)
  long = fd.generate(target, prompts, max_new_tokens=40, stop=[])
  stop = long.token_ids[0][9]
  ref = fd.generate(target, prompts, max_new_tokens=40, stop=[stop])
  drafter = bigram_drafter(target, block_size=4, scale=3.0)
  out = fd.generate(target, prompts, max_new_tokens=40, stop=[stop], drafter=drafter,
                    mode="sequential", speculation=fd.SpecOptions(tree_budget=12))
  assert_lossless(target, prompts, ref.token_ids, out.token_ids)


def test_a_tree_accepts_at_least_what_its_chain_does(target):
  """The tree of N nodes holds more paths than the chain of the same forward
  size: over the same prompts it emits at least as many tokens a step."""
  prompts = prompts_for(4, seed=3)
  drafter = ngram_drafter(target, block_size=4, weight=1.0)
  kw = dict(max_new_tokens=40, drafter=drafter, mode="sequential", stop=[])
  chain = fd.generate(target, prompts, **kw)
  big = fd.generate(target, prompts, speculation=fd.SpecOptions(tree_budget=16), **kw)
  assert big.token_ids == chain.token_ids
  assert big.stats["tau"] >= chain.stats["tau"]


def test_tree_budget_bad_inputs(target):
  drafter = random_drafter(target, block_size=4)
  with pytest.raises(fd.FlexDraftError, match="tree_budget must be an integer >= 2"):
    fd.SpecOptions(tree_budget=1)
  with pytest.raises(fd.FlexDraftError, match="runs in mode 'sequential' or 'flex'"):
    fd.generate(target, [[3, 4]], drafter=drafter, mode="parallel",
                speculation=fd.SpecOptions(tree_budget=8))
  with pytest.raises(fd.FlexDraftError, match="exceeds the 33 nodes"):
    fd.generate(target, [[3, 4]], drafter=random_drafter(target, block_size=2),
                mode="sequential", speculation=fd.SpecOptions(tree_budget=34))
  with pytest.raises(fd.FlexDraftError, match="turn sampling.draft_sampling off"):
    fd.generate(target, [[3, 4]], drafter=drafter, mode="sequential",
                sampling=fd.SamplingParams(temperature=1.0, draft_sampling=True),
                speculation=fd.SpecOptions(tree_budget=8))


@pytest.mark.parametrize("cheapest", ["tree", "sequential", "ar"])
def test_flex_weighs_draft_trees(target, cost_cache, monkeypatch, cheapest):
  """With `tree_budget`, flex weighs trees of each budget (8, 16, …, N) beside
  AR and the chains, and runs the one its measured costs favour: trees run as
  sequential steps verifying a tree, losslessly."""
  from flexdraft_jax.decoding import chunk, flex_costs
  def measure(self, state, B, S, again=False):
    cost = lambda m: 1.0 if m == cheapest else 100.0
    out = {"ar": cost("ar"),
           **{m: {str(k): cost(m) for k in self.buckets} for m in ("sequential", "parallel")}}
    out["tree"] = {str(n): cost("tree") for n in self.tree_budgets}
    return out
  monkeypatch.setattr(flex_costs.StepCosts, "measure", measure)
  prompts = prompts_for(3, seed=4)
  drafter = ngram_drafter(target, block_size=4, weight=1.0)
  ref = fd.generate(target, prompts, max_new_tokens=40)
  budgets = []
  real = chunk.run_chunk
  monkeypatch.setattr(chunk, "run_chunk",
                      lambda *a, **kw: budgets.append(kw["tree_budget"]) or real(*a, **kw))
  out = fd.generate(target, prompts, max_new_tokens=40, drafter=drafter, mode="flex",
                    speculation=fd.SpecOptions(tree_budget=16))
  assert_lossless(target, prompts, ref.token_ids, out.token_ids)
  assert {m for m, _ in out.stats["mode_steps"]} == {cheapest}
  rates = out.stats["flex_choices"]["3"]["tokens_per_s"]
  assert {"tree:8", "tree:16", "sequential:4", "ar"} <= set(rates)
  if cheapest == "tree":  # one cost for all: the larger tree first (more τ predicted)
    assert budgets[0] == 16 and set(budgets) <= {8, 16}
  else:
    assert set(budgets) == {0}


def test_flex_tree_tau_fits_what_trees_accepted(target):
  """A tree's predicted τ starts from the chain's scaled by the draft mass the
  tree adds, and moves to what its own steps accepted."""
  from flexdraft_jax.decoding import flex
  drafter = ngram_drafter(target, block_size=4, weight=1.0)
  st = _prefilled(target, drafter, [5, 9, 12, 7], 32)
  mass = np.full((1, 15), 0.05)
  policy = flex.FlexPolicy(target, drafter,
                           fd.SpecOptions(tree_budget=16), (2, 3, 4), None,
                           tree_mass=lambda state, n: mass[:, :n - 1])
  assert policy.cost_model.tree_budgets == (8, 16)
  chain_mass = float(np.cumprod(np.asarray(st.conf_BxD, np.float64), axis=1).sum())
  tau = policy.tau_by_tree(st, 2.0)
  assert tau[8] == pytest.approx(1.0 + 7 * 0.05 / chain_mass, rel=1e-6)
  assert tau[16] > tau[8]
  # tree:16 steps that each accepted 3 drafts (4 tokens): τ moves towards 4
  for _ in range(6):
    policy.observe(np.array([0, 0, 0, 0, 5]), "tree", 16, B=1)
  later = policy.tau_by_tree(st, 2.0)
  assert later[16] > tau[16] and later[16] < 4.0
  assert later[8] > tau[8]   # the fit carries to the budget that has not run
