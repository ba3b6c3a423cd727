"""Draft trees: the likeliest continuations of a mask block, verified in one forward.

A mask block drafts its slots side by side: slot j's distribution does not
depend on what slot j - 1 drafted (beyond the n-gram prior). A chain verifies
one token per slot; a tree verifies several per slot, arranged so that each
node's path is a draft of the block. With the same drafter and one forward,
more of the target's tokens are among the drafts.

Building (`build_tree`): a node at depth d is a path `t1 .. td` with score
`Σ log q_j(t_j | t_{j-1}, t_{j-2})` — each slot's calibrated draft
log-probability of its candidate, re-scored by the drafter's n-gram prior given
the two tokens before it on that path (as chain drafting does slot by slot).
The tree is the `budget - 1` best-scoring paths (plus the root, the bonus).
Scores only fall with depth, so that set is closed under prefixes. Found
level by level: each level keeps its `budget - 1` best nodes, every child of
which is scored; a node of the best set is always among its level's best
(fewer than `budget - 1` nodes of any level score above it). Fixed shapes
throughout (the budget, the block size, `C` candidates a slot).

Verifying (`tree_step`): the nodes go through the target as clean rows in one
forward, node t at the root's position plus its depth, its K/V written to
cache slot `root + t`, seeing the cache before the root and its own ancestors
(`pytree.TreeRows`). The target's token at each node (argmax at T = 0, a
sample at T > 0) picks the child that continues: the accepted path is the
longest run of nodes each of which is the target's token after its parent,
and the target's token after the last one is the new bonus. At T > 0 each
node's token is an independent sample of the target's distribution there, so
the emitted tokens are samples of the target (the path only decides which
samples are looked at): multi-draft verification of the siblings, each a
point-mass draft — recursive rejection sampling over deterministic siblings
accepts the same Σ p(child). The accepted nodes' K/V then move to the slots
of their positions, and sequential drafting continues from the path's end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flexdraft_jax.decoding import verify
from flexdraft_jax.decoding.sampling import SamplingParams, target_tokens
from flexdraft_jax.decoding.state import KV_BLOCK, DecodeState
from flexdraft_jax.drafter import model as drafter_model
from flexdraft_jax.model import pytree, transformer

# A small penalty per level keeps a child strictly below its parent where the
# draft's probability rounds to 1 (log 0), so the best set stays prefix-closed
# (and `build_tree` disables any node whose parent was not chosen all the same).
_DEPTH_TIE = 1e-4
_IMPOSSIBLE = -1e30  # the score of a padding node


def _children(cfg, drafter, state: DecodeState, j: int, prev2_BxW, prev_BxW):
  """Log-probabilities `[B, W, C]` of slot j's candidates after each of W
  nodes whose last two tokens are `prev2`, `prev` (token ids; -1: none): the
  calibrated draft log-probabilities, re-scored by the n-gram prior given
  those tokens and renormalised over the draft vocabulary (as chain drafting
  re-scores them, `drafter_model.rescored`)."""
  lp_BxC = state.cand_lp_BxDxC[:, j]
  W = prev_BxW.shape[1]
  lp = jnp.broadcast_to(lp_BxC[:, None, :], (lp_BxC.shape[0], W, lp_BxC.shape[1]))
  if not drafter.config.rescores:
    return lp
  cand = jnp.broadcast_to(state.cand_BxDxC[:, j][:, None, :], lp.shape)
  upto = jnp.broadcast_to(state.length_B[:, None], prev_BxW.shape)
  bias = drafter_model.prior_bias(cfg, drafter, cand, prev2_BxW, prev_BxW,
                                  state.hist_BxL, upto)
  # The prior moves mass among the C candidates; the rest of the vocabulary
  # keeps its own: log Σ over V' of the re-scored probabilities.
  rest = jnp.maximum(1.0 - jnp.sum(jnp.exp(lp_BxC), axis=-1), 0.0)[:, None]
  norm = jnp.log(rest + jnp.sum(jnp.exp(lp + bias), axis=-1))
  return lp + bias - norm[..., None]


def build_tree(cfg, drafter, state: DecodeState, budget: int, with_scores: bool = False):
  """The draft tree of each row: `budget` nodes, node 0 the bonus (the root).

  Returns (tokens_BxN, parent_BxN, depth_BxN): token ids, each node's parent
  (-1 for the root; parents come before their children) and depth (root 0);
  `with_scores`: also the non-root nodes' scores, best first `[B, N - 1]`.
  """
  B, D, C = state.cand_BxDxC.shape
  n = W = budget - 1                   # nodes besides the root; kept per level
  to_ids = lambda idx: drafter_model.to_token_ids(drafter.params, idx)
  # Level 1: the root's children (C of them; padded to W with impossible ones).
  score = _children(cfg, drafter, state, 0, jnp.full((B, 1), -1, jnp.int32),
                    state.bonus_B[:, None])[:, 0] - _DEPTH_TIE   # [B, C]
  cand = state.cand_BxDxC[:, 0]
  if C < W:
    score = jnp.pad(score, ((0, 0), (0, W - C)), constant_values=_IMPOSSIBLE)
    cand = jnp.pad(cand, ((0, 0), (0, W - C)))
  score, pick = jax.lax.top_k(score, W)
  tok = to_ids(jnp.take_along_axis(cand, pick, axis=1))
  prev2 = jnp.broadcast_to(state.bonus_B[:, None], (B, W))
  levels = [(score, tok, jnp.full((B, W), -1, jnp.int32))]  # (score, token, parent)
  for j in range(1, D):
    s, t, _ = levels[-1]
    child = s[:, :, None] + _children(cfg, drafter, state, j, prev2, t) - _DEPTH_TIE
    best, flat = jax.lax.top_k(child.reshape(B, W * C), W)
    parent = (flat // C).astype(jnp.int32)
    cand = jnp.take_along_axis(state.cand_BxDxC[:, j], flat % C, axis=1)
    prev2 = jnp.take_along_axis(t, parent, axis=1)
    levels.append((best, to_ids(cand), parent))
  # The n best of all levels' nodes, in order of depth (a topological order).
  score_BxL = jnp.concatenate([lv[0] for lv in levels], axis=1)      # L = D * W
  best_scores, chosen = jax.lax.top_k(score_BxL, n)
  chosen = jnp.sort(chosen, axis=1)                                  # by level, then rank
  depth = (chosen // W + 1).astype(jnp.int32)
  # Node index (1..n) of each level entry, -1 where not chosen; a chosen
  # entry's parent (an entry of the level above) is always chosen.
  index_BxL = jnp.full((B, D * W), -1, jnp.int32).at[
      jnp.arange(B)[:, None], chosen].set(jnp.arange(1, n + 1, dtype=jnp.int32)[None])
  parent_entry = jnp.concatenate(
      [jnp.full((B, W), -1, jnp.int32)]
      + [lv[2] + (i - 1) * W for i, lv in enumerate(levels) if i > 0], axis=1)
  pe = jnp.take_along_axis(parent_entry, chosen, axis=1)
  parent = jnp.where(pe < 0, 0, jnp.take_along_axis(index_BxL, jnp.maximum(pe, 0), axis=1))
  tok = jnp.take_along_axis(jnp.concatenate([lv[1] for lv in levels], axis=1), chosen,
                            axis=1)
  # A node whose parent was not chosen (ties at the boundary) never matches:
  # token -1 is no target token, and its position would be wrong.
  tok = jnp.where(parent < 0, -1, tok)
  parent = jnp.maximum(parent, 0)
  root = lambda x, v: jnp.concatenate([jnp.full((B, 1), v, x.dtype), x], axis=1)
  tokens = jnp.concatenate([state.bonus_B[:, None], tok], axis=1)
  if with_scores:
    return tokens, root(parent, -1), root(depth, 0), best_scores
  return tokens, root(parent, -1), root(depth, 0)


def path_probs(cfg, drafter, state: DecodeState, budget: int):
  """`[B, budget - 1]`: the draft probability of each non-root node's path,
  best first. The first n - 1 are the tree of n nodes' (every cut of the best
  paths is closed under prefixes), and their sum is the tokens a step of it
  would accept beyond the bonus if the draft were calibrated."""
  return jnp.exp(build_tree(cfg, drafter, state, budget, with_scores=True)[3])


def ancestors(parent_BxN, max_depth: int):
  """bool `[B, N, N]`: [b, t, u] iff u is t or an ancestor of t (trees of at
  most `max_depth` levels below the root)."""
  B, N = parent_BxN.shape
  eye = jnp.broadcast_to(jnp.eye(N, dtype=bool)[None], (B, N, N))
  anc, has = eye, (parent_BxN >= 0)[:, :, None]
  for _ in range(max_depth):  # each round reaches one level further up
    anc = eye | (jnp.take_along_axis(anc, jnp.maximum(parent_BxN, 0)[:, :, None], axis=1)
                 & has)
  return anc


def accepted_path(tokens_BxN, parent_BxN, depth_BxN, y_BxN, max_depth: int):
  """(a, path_BxA): how many drafts are accepted, and the nodes of the accepted
  path by depth (`path[:, 0]` the root; entries past `a` are 0). A node is on
  the path iff its parent is and its token is the target's after its parent."""
  B, N = tokens_BxN.shape
  ok = jnp.arange(N)[None] == 0
  match = tokens_BxN == jnp.take_along_axis(y_BxN, jnp.maximum(parent_BxN, 0), axis=1)
  for _ in range(max_depth):
    ok = (jnp.arange(N)[None] == 0) | (
        jnp.take_along_axis(ok, jnp.maximum(parent_BxN, 0), axis=1) & match)
  a = jnp.max(jnp.where(ok, depth_BxN, 0), axis=1).astype(jnp.int32)
  at_depth = ok[:, None, :] & (depth_BxN[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])
  path = jnp.argmax(at_depth, axis=2).astype(jnp.int32)  # 0 where no node (past a)
  return a, path


def _move_path(cache, length_B, path_BxA, a_B):
  """Moves the K/V of the accepted nodes from their tree slots (`length +
  node`) to the slots of their positions (`length + depth`), in every layer."""
  B, A = path_BxA.shape
  src = length_B[:, None] + path_BxA
  dst = jnp.where(jnp.arange(A)[None] <= a_B[:, None], length_B[:, None] + jnp.arange(A),
                  jnp.iinfo(jnp.int32).max)  # past the path: dropped
  b = jnp.arange(B)[:, None]

  def move(c):  # [B, K, S, D] or stacked [n, B, K, S, D]
    if c.ndim == 4:
      rows = c[b, :, src]                                     # [B, A, K, D]
      return c.at[b, :, dst].set(rows, mode="drop")
    rows = c[:, b, :, src]                                    # [B, A, n, K, D]
    return c.at[:, b, :, dst].set(rows, mode="drop")

  return pytree.KVCache(*(jax.tree.map(move, part) for part in cache))


def tree_step(target_params, cfg, drafter, state: DecodeState, *, budget: int,
              sp: SamplingParams, max_new, stop_ids, attn_impl: str = "xla") -> DecodeState:
  """Verify the draft tree of `budget` nodes in one forward, commit the longest
  accepted path and its bonus, then draft the next block from the path's end
  (sequential mode's deep-layers pass)."""
  D = state.cand_BxDxC.shape[1]
  tokens, parent, depth = build_tree(cfg, drafter, state, budget)
  anc = ancestors(parent, D)
  slot = state.length_B[:, None] + jnp.arange(budget, dtype=jnp.int32)[None]
  h, _, cache = transformer.Transformer.of(cfg, target_params).apply(
      transformer.variables(target_params), state.cache, tokens,
      state.length_B[:, None] + depth, attn_impl=attn_impl, kv_block=KV_BLOCK,
      tree=pytree.TreeRows(slot, anc), method="forward")
  key = jax.random.fold_in(state.key, state.steps)
  y = target_tokens(target_params, cfg, h, key, sp)            # [B, N]
  a, path = accepted_path(tokens, parent, depth, y, D)
  cache = _move_path(cache, state.length_B, path, a)
  # Laid out as a chain: y_path[i] is the target's token after path node i,
  # which is node i + 1's token for i < a, and the new bonus at i = a.
  y_path = jnp.take_along_axis(y, path, axis=1)
  chain = state._replace(drafts_BxD=jnp.take_along_axis(tokens, path[:, 1:], axis=1))
  new = verify.commit(chain, y_path, a, cache, max_new=max_new, stop_ids=stop_ids)
  new = new._replace(drafts_BxD=state.drafts_BxD)
  return verify.refresh_drafts(target_params, cfg, drafter, new, sp=sp,
                               attn_impl=attn_impl)
