"""The drafter's training loss (SPEC §4) and its offline metrics.

A batch holds `tokens_BxT` (prompt + answer, padded), `length_B` (real length)
and `anchor_BxK` with `anchor_ok_BxK`; optionally `deep_k`/`deep_v`, the clean
K/V of the deep layers computed once per sequence (`deep_kv`), which replace
the per-step clean pass. Anchor block k has `bs` masks at
positions a+1..a+bs that see clean 0..a (limit a) and each other (group k).
Slot j sits at position a+1+j and, for j >= 1, is trained to predict the token
there; slot 0 lies on the bonus token (the token at a+1), gets no loss, and the
bonus feeds the calibration MLP.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flexdraft_jax.drafter.model import DrafterConfig, DraftModel, draft_head
from flexdraft_jax.model import pytree, transformer
from flexdraft_jax.model.config import ModelConfig


def mask_rows(anchor_BxK, bs: int) -> pytree.MaskRows:
  """MaskRows for K anchor blocks of `bs` masks each (M = K·bs rows)."""
  B, K = anchor_BxK.shape
  j = jnp.arange(bs, dtype=jnp.int32)
  pos = (anchor_BxK[:, :, None] + 1 + j).reshape(B, K * bs)
  limit = jnp.repeat(anchor_BxK, bs, axis=1)
  group = jnp.repeat(jnp.arange(K, dtype=jnp.int32), bs)
  return pytree.MaskRows(pos, limit, group, block=bs)


def slot_weights(bs: int, gamma: float):
  """exp(-(j-1)/γ) for slots j >= 1, 0 for slot 0."""
  j = jnp.arange(bs, dtype=jnp.float32)
  return jnp.where(j >= 1, jnp.exp(-(j - 1) / gamma), 0.0)


def clean_pass(target_params, cfg: ModelConfig, tokens_BxT, *, attn_impl="xla"):
  """The frozen target over the whole sequence once: (h_BxTxH, cache), no grad."""
  B, T = tokens_BxT.shape
  cache = pytree.KVCache.zeros(cfg, B, T, target_params["embed"].dtype)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  h, _, cache = transformer.Transformer.of(cfg, target_params).apply(
      transformer.variables(target_params), cache, tokens_BxT, pos, attn_impl=attn_impl,
      method="forward")
  return jax.lax.stop_gradient(h), jax.lax.stop_gradient(cache)


def deep_kv(target_params, cfg: ModelConfig, tokens_BxT, num_draft_layers: int, *,
            attn_impl="xla"):
  """The clean K/V of the deep layers, `[B, L, K, T, D]` each — all the mask rows
  ever read — so a trainer can compute them once per sequence."""
  _, cache = clean_pass(target_params, cfg, tokens_BxT, attn_impl=attn_impl)
  s = cfg.num_layers - num_draft_layers
  return tuple(jnp.moveaxis(c[s:], 0, 1) for c in (cache.k, cache.v))


def deep_kv_entries(k_BxLxKxTxD, v_BxLxKxTxD) -> dict:
  """Batch entries of precomputed clean K/V (`deep_kv`'s output): `deep_k{l}`
  and `deep_v{l}`, one contiguous `[B, K, T, D]` array per deep layer, which a
  step reads in place (slicing `[B, L, ...]` in the step copies it)."""
  return {f"deep_{c}{l}": x[:, l] for c, x in (("k", k_BxLxKxTxD), ("v", v_BxLxKxTxD))
          for l in range(x.shape[1])}


def _cache_from_deep(batch, cfg: ModelConfig, num_draft_layers: int, dtype):
  """The deep layers' KVCache from the batch's `deep_k{l}`/`deep_v{l}`: per-layer
  arrays, None for the shallow layers (a mask-only pass reads no other)."""
  s = cfg.num_layers - num_draft_layers
  layers = lambda c: tuple([None] * s + [batch[f"deep_{c}{l}"].astype(dtype)
                                         for l in range(num_draft_layers)])
  return pytree.KVCache(layers("k"), layers("v"))


def draft_pass(draft_params, target_params, cfg: ModelConfig, dcfg: DrafterConfig,
               batch: dict, *, attn_impl: str = "xla") -> dict:
  """The drafter over a batch's anchor blocks, as training scores it: each
  drafting slot's calibrated logits (the n-gram prior reading the true tokens
  before it) and its label. Returns `logits_BxKxSxV` (draft vocabulary),
  `label_BxKxS` (draft-vocabulary indices), `in_vocab_BxKxS`, `valid_BxKxS`,
  `pos_BxKxS`, `h_clean` (the clean pass's hidden states; None when the batch
  brings precomputed K/V) and `draft` (the draft pytree in the target's dtype).
  The loss and the offline acceptance measures (`offline_accept`) both read it."""
  bs = dcfg.block_size
  tokens, length = batch["tokens_BxT"], batch["length_B"]
  anchor, anchor_ok = batch["anchor_BxK"], batch["anchor_ok_BxK"]
  B, T = tokens.shape
  K = anchor.shape[1]
  dtype = target_params["embed"].dtype
  draft = jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
      draft_params)

  if "deep_k0" in batch:  # clean K/V computed ahead of time (see deep_kv_entries)
    h_clean = None
    cache = _cache_from_deep(batch, cfg, dcfg.num_layers, dtype)
    if not pytree.is_per_layer(target_params):
      target_params = pytree.deep_layers_view(target_params, dcfg.num_layers)
  else:
    h_clean, cache = clean_pass(target_params, cfg, tokens, attn_impl=attn_impl)
  masks = mask_rows(anchor, bs)
  bonus_B_K = jnp.take_along_axis(tokens, jnp.minimum(anchor + 1, T - 1), axis=1)
  if dcfg.bonus_input:
    # Blocks drawn blind (`blind_BxK`, drafter.bonus_dropout) draft as parallel
    # mode does, before the bonus is known: slot 0 is the mask alone.
    seen_B_K = bonus_B_K
    if "blind_BxK" in batch:
      seen_B_K = jnp.where(batch["blind_BxK"], -1, bonus_B_K)
    masks = masks._replace(bonus_BxM=jnp.repeat(seen_B_K, bs, axis=1))
  variables = transformer.variables(target_params, draft)
  _, hm, _ = transformer.Transformer.of(cfg, target_params).apply(
      variables, cache, None, None, masks=masks, num_draft_layers=dcfg.num_layers,
      attn_impl=attn_impl, method="forward")
  # Slot 0 (on the bonus) takes part in the deep layers but drafts nothing:
  # its head and calibration are skipped. S = bs - 1 slots from here on.
  S = bs - 1
  hm = hm.reshape(B, K, bs, -1)[:, :, 1:].reshape(B, K * S, -1)
  pos_BxKxS = masks.pos_BxM.reshape(B, K, bs)[:, :, 1:]
  bonus_BxM = jnp.repeat(bonus_B_K, S, axis=1)
  context = None
  if dcfg.rescores:  # the n-gram prior reads the true tokens before each slot
    at = lambda d: jnp.take_along_axis(
        tokens, jnp.clip(pos_BxKxS - d, 0, T - 1).reshape(B, K * S), axis=1)
    first = jnp.tile(jnp.arange(S) == 0, K)[None]   # slot 1: after the bonus alone
    context = (jnp.where(first, -1, at(2)), at(1), tokens, jnp.repeat(anchor + 1, S, axis=1))
  logits = DraftModel.of(cfg, dcfg, target_params).apply(
      variables, hm, bonus_BxM, context=context, method="logits")
  label_BxKxS = jnp.take_along_axis(
      tokens, jnp.minimum(pos_BxKxS, T - 1).reshape(B, K * S), axis=1).reshape(B, K, S)
  valid_BxKxS = (pos_BxKxS < length[:, None, None]) & anchor_ok[:, :, None]
  # Labels as draft-vocabulary indices; a token outside it can never be drafted:
  # no loss, and it counts as a miss.
  label_BxKxS, in_vocab = _draft_index(draft, cfg, label_BxKxS)
  return {"logits_BxKxSxV": logits.reshape(B, K, S, -1), "label_BxKxS": label_BxKxS,
          "in_vocab_BxKxS": in_vocab, "valid_BxKxS": valid_BxKxS, "pos_BxKxS": pos_BxKxS,
          "h_clean": h_clean, "draft": draft}


def loss_sums(draft_params, target_params, cfg: ModelConfig, dcfg: DrafterConfig,
              batch: dict, *, gamma: float = 7.0, loss_type: str = "ce",
              attn_impl: str = "xla", per_anchor: bool = False):
  """Additive statistics of a batch, so data-parallel shards can be summed.

  Returns (loss_num, sums): loss_num = Σ weight·loss over (anchor, slot);
  sums = {weight, loss_num, correct_S, n_slot_S, tau_sum, n_anchor}.
  `finalize(sums)` turns them into the loss and metrics. `per_anchor` adds
  `tau_BxK`, each anchor's τ (0 where not `anchor_ok`), which is not additive.
  """
  if "deep_k0" in batch and loss_type == "kl":
    raise ValueError("loss_type='kl' needs the clean pass (no precomputed K/V)")
  d = draft_pass(draft_params, target_params, cfg, dcfg, batch, attn_impl=attn_impl)
  logits_BxKxSxV, label_BxKxS = d["logits_BxKxSxV"], d["label_BxKxS"]
  valid_BxKxS, in_vocab = d["valid_BxKxS"], d["in_vocab_BxKxS"]
  logp = jax.nn.log_softmax(logits_BxKxSxV, axis=-1)
  if loss_type == "ce":
    per_BxKxS = -jnp.take_along_axis(logp, label_BxKxS[..., None], axis=-1)[..., 0]
  elif loss_type == "kl":
    t_logp = target_logp(target_params, cfg, d["draft"], d["h_clean"],
                         d["pos_BxKxS"]).reshape(logp.shape)
    per_BxKxS = jnp.sum(jnp.exp(t_logp) * (t_logp - logp), axis=-1)
  else:
    raise ValueError(f"loss_type must be ce or kl, got {loss_type!r}")
  w_BxKxS = valid_BxKxS * in_vocab * slot_weights(dcfg.block_size, gamma)[1:]
  loss_num = jnp.sum(per_BxKxS * w_BxKxS)
  sums = offline_sums(logits_BxKxSxV, label_BxKxS, valid_BxKxS, batch["anchor_ok_BxK"],
                      in_vocab_BxKxS=in_vocab, per_anchor=per_anchor)
  sums.update(weight=jnp.sum(w_BxKxS), loss_num=jax.lax.stop_gradient(loss_num))
  return loss_num, sums


def target_logp(target_params, cfg: ModelConfig, draft, h_clean_BxTxH, pos_BxKxS):
  """The target's own log-probabilities for the token at each mask position p
  (read at p - 1 of the clean pass), over the draft vocabulary and renormalised
  there: `[B, K·S, V']`, no gradient. The `kl` loss's soft labels; the head is
  the draft vocabulary's rows, so they cost V'/V of the full LM head."""
  B, T = h_clean_BxTxH.shape[:2]
  # A block may run past the batch's width (those rows get no loss); clip so
  # that the gather never fills them with NaN, which 0 weight would not cancel.
  prev = jnp.clip(pos_BxKxS.reshape(B, -1) - 1, 0, T - 1)
  h_prev = jnp.take_along_axis(h_clean_BxTxH, prev[..., None], axis=1)
  x = transformer.rms_norm(h_prev, target_params["final_norm"], cfg.rms_norm_eps)
  head = draft_head(target_params, cfg, draft)
  t_logits = jnp.einsum("BMH,VH->BMV", x, head, preferred_element_type=jnp.float32)
  return jax.lax.stop_gradient(jax.nn.log_softmax(t_logits, -1))


def _draft_index(draft, cfg: ModelConfig, label_BxKxS):
  """(index in the draft vocabulary, whether the label is in it)."""
  if "vocab" not in draft:
    return label_BxKxS, jnp.ones(label_BxKxS.shape, bool)
  vocab = draft["vocab"]
  inverse = jnp.full((cfg.vocab_size,), -1, jnp.int32).at[vocab].set(
      jnp.arange(vocab.shape[0], dtype=jnp.int32))
  idx = inverse[label_BxKxS]
  return jnp.maximum(idx, 0), idx >= 0


def offline_sums(logits_BxKxSxV, label_BxKxS, valid_BxKxS, anchor_ok_BxK,
                 in_vocab_BxKxS=None, per_anchor: bool = False) -> dict:
  """Counts behind per-slot accuracy and offline τ, over the drafting slots
  1..bs-1 (S = bs - 1 of them; `correct_S`/`n_slot_S` get a zero slot 0 in
  front so index j is slot j).

  τ at an anchor = 1 + number of leading slots whose argmax equals the true
  continuation (a slot past the sequence end, or a label outside the draft
  vocabulary, stops the run).
  """
  correct = (jnp.argmax(logits_BxKxSxV, -1) == label_BxKxS) & valid_BxKxS
  if in_vocab_BxKxS is not None:
    correct &= in_vocab_BxKxS
  run = jnp.cumprod(correct.astype(jnp.int32), axis=-1)
  tau_BxK = 1.0 + jnp.sum(run, axis=-1)
  slot0 = lambda x: jnp.pad(x, (1, 0))
  extra = {"tau_BxK": tau_BxK * anchor_ok_BxK} if per_anchor else {}
  return extra | {"correct_S": slot0(jnp.sum(correct, axis=(0, 1)).astype(jnp.float32)),
          "n_slot_S": slot0(jnp.sum(valid_BxKxS, axis=(0, 1)).astype(jnp.float32)),
          "tau_sum": jnp.sum(tau_BxK * anchor_ok_BxK),
          "n_anchor": jnp.sum(anchor_ok_BxK).astype(jnp.float32)}


def walk_tau(tau_A) -> tuple:
  """(tokens, steps) of sequential decoding over one answer, predicted from the
  offline τ at each of its anchors (`tau_A[i]`: the block whose bonus is answer
  token i): from the first anchor, each step moves on by its τ. Decoding visits
  the anchors right after a miss, where drafts do worse than at a random
  anchor, so tokens / steps is the online τ the uniform mean overstates."""
  i, steps = 0, 0
  while i < len(tau_A):
    i += max(int(tau_A[i]), 1)
    steps += 1
  return len(tau_A), steps


def finalize(sums: dict) -> dict:
  """Summed statistics -> loss, acc_S (per slot; slot 0 is 0), tau, counts."""
  return {"loss": sums["loss_num"] / jnp.maximum(sums["weight"], 1e-9),
          "acc_S": sums["correct_S"] / jnp.maximum(sums["n_slot_S"], 1),
          "tau": sums["tau_sum"] / jnp.maximum(sums["n_anchor"], 1),
          "n_anchor": sums["n_anchor"], "n_slot": jnp.sum(sums["n_slot_S"])}


def offline_metrics(logits_BxKxSxV, label_BxKxS, valid_BxKxS, anchor_ok_BxK) -> dict:
  """Per-slot accuracy and offline τ of one batch (see offline_sums)."""
  sums = offline_sums(logits_BxKxSxV, label_BxKxS, valid_BxKxS, anchor_ok_BxK)
  return finalize(dict(sums, loss_num=0.0, weight=1.0))


def loss_and_metrics(draft_params, target_params, cfg: ModelConfig,
                     dcfg: DrafterConfig, batch: dict, **kw):
  """The weighted per-slot loss over all valid (anchor, slot) pairs, and metrics
  (loss, acc_S, tau, n_anchor, n_slot)."""
  loss_num, sums = loss_sums(draft_params, target_params, cfg, dcfg, batch, **kw)
  metrics = finalize(sums)
  return loss_num / jnp.maximum(sums["weight"], 1e-9), metrics
