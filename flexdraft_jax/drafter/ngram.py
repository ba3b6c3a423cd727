"""The n-gram prior (beyond the paper): drafts re-scored slot by slot.

A mask block drafts its slots in parallel, each blind to what the slots before
it drafted, so adjacent slots often draft alike (" down down down" where the
truth is " step by step"). Where a slot can still be accepted, the slots before
it drafted the truth, so conditioning slot j on the drafts before it is
conditioning on the true text. The prior adds, to each slot's `rescore_top`
likeliest draft-vocabulary candidates c,

  λ · log( p(c | d_{j-2}, d_{j-1}) / p(c) )          (the regenerated data's n-grams)
  + μ3 · [d_{j-2} d_{j-1} c occurs in the row's text] + μ2 · [d_{j-1} c occurs there]

where d_0 is the bonus (slot 1 reads the bigram only) and the row's text is the
prompt and everything decided so far, the bonus included (prompt lookup: answers
repeat their question's numbers and names). p(c | a, b) interpolates the
trigram counts with the bigram's, and that with the unigram's (additive
smoothing `ngram_smoothing_*`). Drafting then picks slot by slot
(`model.rescored_drafts`); training and offline scoring feed the true previous
tokens, which is what drafting sees wherever the slot counts. Verification is
untouched: decoding stays lossless.

Tables (`params["ngram"]`, integer keys sorted for `searchsorted`; K = the
draft vocabulary's size, index K = a token outside it):
  index       [V]    int32   token id -> draft index, K outside
  uni_logp    [K]    float   log unigram probability (add-one)
  prev_count  [K+1]  float   how often each index precedes an answer token
  bi_key      [nb]   int32   prev·K + c          bi_count  [nb] float
  ctx_key     [nc]   int32   prev2·(K+1) + prev   ctx_count [nc] float
  tri_key     [nt]   int32   row of ctx_key·K + c tri_count [nt] float
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax.model.config import FlexDraftError

INT32_MAX = 2 ** 31 - 1


def table_shapes(vocab_size: int, K: int, nb: int, nc: int, nt: int) -> dict:
  """{name: (shape, integer?)} of the tables (for a drafter's expected tensors)."""
  return {"index": ((vocab_size,), True), "uni_logp": ((K,), False),
          "prev_count": ((K + 1,), False), "bi_key": ((nb,), True),
          "bi_count": ((nb,), False), "ctx_key": ((nc,), True), "ctx_count": ((nc,), False),
          "tri_key": ((nt,), True), "tri_count": ((nt,), False)}


def build_tables(answers, vocab_ids, vocab_size: int) -> dict:
  """The tables (numpy) from `answers`: token-id sequences, each the last two
  prompt tokens then the answer (so the answer's first tokens have their
  context); counted are the answer tokens inside the draft vocabulary."""
  vocab_ids = np.asarray(vocab_ids, np.int64)
  K = len(vocab_ids)
  index = np.full((vocab_size,), K, np.int64)
  index[vocab_ids] = np.arange(K)
  p2, p1, c = [], [], []
  for seq in answers:
    s = index[np.asarray(seq, np.int64)]
    if len(s) < 3:
      continue
    p2.append(s[:-2]), p1.append(s[1:-1]), c.append(s[2:])
  if not c:
    raise FlexDraftError("no answer of 3 or more tokens to count n-grams in")
  p2, p1, c = (np.concatenate(x) for x in (p2, p1, c))
  keep = c < K
  p2, p1, c = p2[keep], p1[keep], c[keep]
  ctx_key, ctx_row, ctx_count = np.unique(p2 * (K + 1) + p1, return_inverse=True,
                                          return_counts=True)
  if (K + 1) ** 2 > INT32_MAX or len(ctx_key) * K > INT32_MAX:
    raise FlexDraftError(f"n-gram keys of a {K}-token draft vocabulary overflow int32 "
                         "(use a draft vocabulary of at most ~46k tokens)")
  bi_key, bi_count = np.unique(p1 * K + c, return_counts=True)
  tri_key, tri_count = np.unique(ctx_row * K + c, return_counts=True)
  uni = np.bincount(c, minlength=K) + 1.0
  f32 = lambda x: np.asarray(x, np.float32)
  i32 = lambda x: np.asarray(x, np.int32)
  return {"index": i32(index), "uni_logp": f32(np.log(uni / uni.sum())),
          "prev_count": f32(np.bincount(p1, minlength=K + 1)),
          "bi_key": i32(bi_key), "bi_count": f32(bi_count),
          "ctx_key": i32(ctx_key), "ctx_count": f32(ctx_count),
          "tri_key": i32(tri_key), "tri_count": f32(tri_count)}


def _lookup(keys, values, x):
  """values[i] where keys[i] == x, else 0 (keys sorted)."""
  i = jnp.clip(jnp.searchsorted(keys, x), 0, keys.shape[0] - 1)
  return jnp.where(keys[i] == x, values[i].astype(jnp.float32), 0.0)


def data_pmi(ng, K: int, prev2, prev, cand, smoothing_bi: float, smoothing_tri: float):
  """log p(c | prev2, prev) - log p(c) `[..., C]` for draft indices `cand`
  after token ids `prev` (`[...]`) and `prev2` (-1: the bigram alone)."""
  logu = ng["uni_logp"][cand].astype(jnp.float32)
  i1 = ng["index"][jnp.maximum(prev, 0)]
  n1 = ng["prev_count"][i1].astype(jnp.float32)[..., None]
  p = (_lookup(ng["bi_key"], ng["bi_count"], i1[..., None] * K + cand)
       + smoothing_bi * jnp.exp(logu)) / (n1 + smoothing_bi)
  if ng["ctx_key"].shape[0]:
    ctx = ng["index"][jnp.maximum(prev2, 0)] * (K + 1) + i1
    r = jnp.clip(jnp.searchsorted(ng["ctx_key"], ctx), 0, ng["ctx_key"].shape[0] - 1)
    seen = ng["ctx_key"][r] == ctx
    n2 = jnp.where(seen, ng["ctx_count"][r].astype(jnp.float32), 0.0)[..., None]
    n3 = jnp.where(seen[..., None],
                   _lookup(ng["tri_key"], ng["tri_count"], r[..., None] * K + cand), 0.0)
    tri = (n3 + smoothing_tri * p) / (n2 + smoothing_tri)
    p = jnp.where((prev2 >= 0)[..., None], tri, p)
  return jnp.log(p) - logu


def in_context(hist_BxT, upto_BxM, prev2_BxM, prev_BxM, cand_ids_BxMxC):
  """(trigram, bigram) `[B, M, C]` float: whether `prev2 prev c` and `prev c`
  occur in each row's text `hist[:upto + 1]` (prev2 = -1: no trigram)."""
  B, T = hist_BxT.shape
  t = jnp.arange(T)
  shift = lambda x, n: jnp.pad(x, ((0, 0), (n, 0)), constant_values=-1)[:, :T]
  h1, h2 = shift(hist_BxT, 1), shift(hist_BxT, 2)
  ok = t[None, None, :] <= upto_BxM[..., None]                       # [B, M, T]
  m2 = ok & (h1[:, None, :] == prev_BxM[..., None])
  m3 = m2 & (h2[:, None, :] == prev2_BxM[..., None]) & (prev2_BxM >= 0)[..., None]
  eq = hist_BxT[:, None, None, :] == cand_ids_BxMxC[..., None]         # [B, M, C, T]
  tri = jnp.any(eq & m3[:, :, None, :], -1)
  bi = jnp.any(eq & m2[:, :, None, :], -1)
  return tri.astype(jnp.float32), bi.astype(jnp.float32)
