"""The drafter (SPEC §1) as a Flax linen module over its draft pytree: mask
vector, deep-layer draft attention, calibration MLP."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax.drafter import ngram
from flexdraft_jax.model import pytree, transformer
from flexdraft_jax.model.config import FlexDraftError, ModelConfig


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  num_layers: int = 4        # L: deep layers with draft attention.
  block_size: int = 16       # bs: mask tokens per block.
  calib_rank: int = 256      # r: hidden width of the calibration MLP.
  calib_tied: bool = False   # low-rank head 2H -> r -> H, then the tied LM head.
  calibrate: bool = True     # apply the calibration MLP when drafting (ablation: off).
  # K > 0: drafts come from the K ids in `params["vocab"]` only (SPEC §7): the
  # draft head is those rows of the LM head and calibration outputs K logits.
  draft_vocab: int = 0
  per_slot_mask: bool = False  # a learned mask vector per block slot ([bs, H]).
  # Slot 0 (on the bonus's position) enters the deep layers as the mask plus
  # `embed(bonus) @ bonus_in` (SPEC §7): every slot can attend to the bonus.
  # Needs the bonus before drafting (sequential steps), unless trained blind too:
  bonus_input: bool = False
  # The fraction of training blocks whose slot 0 entered as the mask alone
  # (the bonus input dropped): > 0 means the same weights also draft blind,
  # inside the verify forward of parallel mode, where the bonus is not yet
  # known (calibration and the n-gram prior then read it).
  bonus_dropout: float = 0.0
  # The n-gram prior (`drafter.ngram`, beyond the paper): each slot's
  # `rescore_top` likeliest drafts re-scored given the drafts before it, by the
  # data's n-grams (tables of these sizes in `params["ngram"]`, weight
  # `ngram_weight`) and by the row's own text (`context_trigram`,
  # `context_bigram`). Drafting then picks slot by slot.
  ngram_bigrams: int = 0
  ngram_contexts: int = 0
  ngram_trigrams: int = 0
  ngram_weight: float = 0.0
  ngram_smoothing_bi: float = 1.0
  ngram_smoothing_tri: float = 2.0
  context_trigram: float = 0.0
  context_bigram: float = 0.0
  rescore_top: int = 32
  # Draft sampling's temperature per slot, fitted on held-out answers
  # (`offline-accept --fit_temperature`): ((T, (r_1 .. r_S)), ...). At sampling
  # temperature T with `draft_sampling`, slot j's drafts are sampled from
  # softmax(logits / (T·r_j)), r_j interpolated in T between the listed
  # temperatures and held beyond them; () samples at T itself. Verification
  # reads the same q, so outputs stay the target's; argmax drafts (T = 0 or
  # `draft_sampling` off) are unchanged.
  draft_temperature: tuple = ()

  def __post_init__(self):
    # drafter.json holds lists; the config is hashed (a jit's static argument)
    object.__setattr__(self, "draft_temperature", tuple(
        (float(t), tuple(float(r) for r in rs)) for t, rs in self.draft_temperature))

  @property
  def has_ngram_tables(self) -> bool:
    return self.ngram_bigrams > 0

  @property
  def drafts_blind(self) -> bool:
    """Whether the drafter was trained to draft before the bonus is known
    (parallel mode): it reads no bonus input, or was trained with it dropped."""
    return not self.bonus_input or self.bonus_dropout > 0

  @property
  def rescores(self) -> bool:
    """Whether drafting re-scores slot by slot (the n-gram prior is on)."""
    return ((self.has_ngram_tables and self.ngram_weight != 0)
            or self.context_trigram != 0 or self.context_bigram != 0)

  def validate(self, cfg: ModelConfig):
    if not 1 <= self.num_layers <= cfg.num_layers:
      raise FlexDraftError(
          f"drafter num_layers={self.num_layers} must be in [1, {cfg.num_layers}]")
    if self.block_size < 2:
      raise FlexDraftError(f"block_size={self.block_size} must be at least 2")
    if not 0.0 <= self.bonus_dropout <= 1.0 or (self.bonus_dropout and not self.bonus_input):
      raise FlexDraftError(f"bonus_dropout={self.bonus_dropout} must be in [0, 1], and 0 "
                           "without bonus_input")
    if self.calib_rank < 1:
      raise FlexDraftError(f"calib_rank={self.calib_rank} must be at least 1")
    if not 0 <= self.draft_vocab <= cfg.vocab_size:
      raise FlexDraftError(f"draft_vocab={self.draft_vocab} must be in [0, "
                           f"{cfg.vocab_size}] (0: the full vocabulary)")
    if self.rescores and not 1 <= self.rescore_top <= (self.draft_vocab or cfg.vocab_size):
      raise FlexDraftError(f"rescore_top={self.rescore_top} must be in [1, "
                           f"{self.draft_vocab or cfg.vocab_size}] (the draft vocabulary)")
    for t, rs in self.draft_temperature:
      if not (np.isfinite(t) and t > 0 and len(rs) == self.block_size - 1
              and all(np.isfinite(r) and r > 0 for r in rs)):
        raise FlexDraftError(
            f"draft_temperature entry ({t}, {list(rs)}) must be a temperature > 0 and "
            f"{self.block_size - 1} finite ratios > 0 (one per draft slot)")
    if min(self.ngram_bigrams, self.ngram_contexts, self.ngram_trigrams) < 0 or (
        self.ngram_bigrams == 0 and self.ngram_contexts + self.ngram_trigrams > 0):
      raise FlexDraftError("n-gram table sizes must be >= 0, with bigrams wherever "
                           "there are trigrams")


def draft_temperature_ratios(dcfg: DrafterConfig, temperature: float, slots: int):
  """Each of the first `slots` draft slots' sampling temperature relative to
  `temperature` (`DrafterConfig.draft_temperature`), float32 `[slots]`, or None
  where the drafter holds none (or T = 0)."""
  if not dcfg.draft_temperature or not temperature > 0:
    return None
  ts = np.array([t for t, _ in dcfg.draft_temperature])
  rs = np.array([r for _, r in dcfg.draft_temperature])[np.argsort(ts)]
  ts = np.sort(ts)
  return np.array([np.interp(temperature, ts, rs[:, j]) for j in range(slots)], np.float32)


class Drafter(NamedTuple):
  """A drafter: its static config, its trainable pytree and the target it fits."""
  config: DrafterConfig
  params: Any
  target_fingerprint: str = ""


class DraftModel(nn.Module):
  """The drafter as a linen module: it declares the draft pytree as the
  "draft" collection and reads the target's weights through `target`, whose
  scope it shares (collection "params").

  `init` creates the draft pytree: attention copies of the target's last L
  layers, a random mask vector (0.02·N(0,1)) and a calibration MLP whose last
  layer is zero (identity). Given a target (`apply` with "params" and a
  mutable "draft", see `init_draft_params`) it copies that one, else it
  creates a random target of `target`'s shape too. The data leaves (`vocab`,
  `ngram`) start at zero and are filled by their builders.
  """
  target: transformer.Transformer
  dcfg: DrafterConfig
  dtype: Any = None  # of the weights `init` creates; None: the target's
  # The key of `init`'s draws (mask, then calibration w1: `split(init_key)`,
  # so a seed draws the drafter it always drew); None: the "params" rng.
  init_key: Any = None

  @classmethod
  def of(cls, cfg: ModelConfig, dcfg: DrafterConfig, target_params=None, dtype=None,
         init_key=None):
    """The drafter of `dcfg` over a target of `cfg` (laid out as `target_params`)."""
    target = (transformer.Transformer(cfg) if target_params is None
              else transformer.Transformer.of(cfg, target_params))
    return cls(target, dcfg, dtype, init_key)

  def setup(self):
    nn.share_scope(self, self.target)
    cfg, dcfg = self.target.cfg, self.dcfg
    H = cfg.hidden_size
    self._declare("mask", self._init_mask)
    self._declare("layers", self._init_layers)
    self._declare("calib", self._init_calib)
    if dcfg.has_ngram_tables:  # filled by `ngram.build_tables` (not trained)
      K = dcfg.draft_vocab or cfg.vocab_size
      self._declare("ngram", lambda: {
          k: jnp.zeros(shape, jnp.int32 if integer else self._dtype())
          for k, (shape, integer) in ngram.table_shapes(
              cfg.vocab_size, K, dcfg.ngram_bigrams, dcfg.ngram_contexts,
              dcfg.ngram_trigrams).items()})
    if dcfg.bonus_input:  # zero: starts as the plain mask
      self._declare("bonus_in", lambda: jnp.zeros((H, H), self._dtype()))
    if dcfg.draft_vocab:  # the ids, set by `init_draft_params` (not trained)
      self._declare("vocab", lambda: jnp.zeros((dcfg.draft_vocab,), jnp.int32))

  def _declare(self, name: str, init):
    """A draft variable; one a tree lacks (training drops the data leaves) is
    declared only where the collection is being created."""
    if self.is_mutable_collection("draft") or self.has_variable("draft", name):
      self.variable("draft", name, init)

  def _dtype(self):
    return self.dtype or self.target.embedding.dtype

  def _key(self, i: int):
    """Key of init's draw i (0: mask, 1: calibration w1)."""
    if self.init_key is None:
      return self.make_rng("params")
    return jax.random.split(self.init_key)[i]

  def _init_mask(self):
    H = self.target.cfg.hidden_size
    shape = (self.dcfg.block_size, H) if self.dcfg.per_slot_mask else (H,)
    return (0.02 * jax.random.normal(self._key(0), shape)).astype(self._dtype())

  def _init_layers(self):
    """Copies of the target's attention weights in its last L layers."""
    tp, n = self.target.weights(), self.target.cfg.num_layers
    s = n - self.dcfg.num_layers
    return {k: jnp.stack([pytree.layer_leaf(tp, k, i) for i in range(s, n)]
                         ).astype(self._dtype())
            for k in pytree.layer_keys(tp) if k in pytree.ATTN_KEYS}

  def _init_calib(self):
    cfg, dcfg, dtype = self.target.cfg, self.dcfg, self._dtype()
    H, r = cfg.hidden_size, dcfg.calib_rank
    out = H if dcfg.calib_tied else (dcfg.draft_vocab or cfg.vocab_size)
    w1 = jax.random.normal(self._key(1), (2 * H, r)) / np.sqrt(2 * H)
    return {"w1": w1.astype(dtype), "b1": jnp.zeros((r,), dtype),
            "w2": jnp.zeros((r, out), dtype), "b2": jnp.zeros((out,), dtype)}

  def weights(self) -> dict:
    """The draft pytree (the "draft" collection)."""
    return self.variables["draft"]

  def head(self):
    """The draft LM head `[V', H]`: the LM head's rows of the draft vocabulary,
    or all of them. Decoding builds it once per call (`draft["head"]`);
    training gathers it inside the step."""
    return draft_head(self.variables["params"], self.target.cfg, self.weights())

  def calibration_bias(self, x_BxMxH, bonus_BxM, head_VxH=None):
    """The bonus-guided bias `[B, M, V']` added to draft logits (fp32)."""
    draft = self.weights()
    calib = draft["calib"]
    e = self.target.embed(bonus_BxM).astype(x_BxMxH.dtype)
    # `calib` may hold w1/w2 transposed as w1_t/w2_t (decoding; see transformer.linear)
    z = jax.nn.silu(transformer.linear(calib, "w1", jnp.concatenate([e, x_BxMxH], -1))
                    + calib["b1"])
    out = transformer.linear(calib, "w2", z) + calib["b2"]
    if not self.dcfg.calib_tied:
      return out.astype(jnp.float32)
    return _head_product(draft, head_VxH, out)

  def logits(self, hm_BxMxH, bonus_BxM, *, calibrate: bool = True, context=None):
    """Calibrated draft logits `[B, M, V']` from mask hidden states (see
    `draft_logits`)."""
    cfg, draft = self.target.cfg, self.weights()
    head = self.head()
    x = transformer.rms_norm(hm_BxMxH, self.target.final_norm, cfg.rms_norm_eps)
    out = _head_product(draft, head, x)
    if calibrate and self.dcfg.calibrate:
      out = out + self.calibration_bias(x, bonus_BxM, head)
    if context is not None and self.dcfg.rescores:
      out = rescored(cfg, Drafter(self.dcfg, draft), out, *context)
    return out


def init_draft_params(target_params, cfg: ModelConfig, dcfg: DrafterConfig,
                      rng: jax.Array, dtype=None, vocab=None):
  """A fresh draft pytree for `target_params`: `DraftModel`'s init over that
  target (`dtype` defaults to the target's).

  With `dcfg.draft_vocab` = K, `vocab` (K distinct ids) becomes the int32 leaf
  `params["vocab"]` — not trainable (see `trainable`)."""
  dcfg.validate(cfg)
  if dcfg.draft_vocab:
    vocab = check_vocab(vocab, dcfg.draft_vocab, cfg.vocab_size)
  model = DraftModel.of(cfg, dcfg, target_params, dtype, init_key=rng)
  params, _ = model.apply(transformer.variables(target_params), method="weights",
                          mutable="draft")
  params = dict(params)
  if dcfg.draft_vocab:
    params["vocab"] = vocab
  return params


def check_vocab(vocab, size: int, vocab_size: int) -> jax.Array:
  """`vocab` as int32 `[size]` of distinct ids in [0, vocab_size), or a one-line error."""
  if vocab is None:
    raise FlexDraftError(f"draft_vocab={size} needs the vocabulary ids (see "
                         "drafter.vocab.frequent_tokens)")
  if isinstance(vocab, jax.ShapeDtypeStruct):  # shapes only (jax.eval_shape)
    return jnp.zeros(vocab.shape, jnp.int32)
  v = np.asarray(vocab)
  if v.shape != (size,) or not np.issubdtype(v.dtype, np.integer):
    raise FlexDraftError(f"draft vocabulary must be {size} integer ids, got "
                         f"shape {v.shape} {v.dtype}")
  if v.min() < 0 or v.max() >= vocab_size or len(np.unique(v)) != size:
    raise FlexDraftError(f"draft vocabulary ids must be distinct and in [0, {vocab_size})")
  return jnp.asarray(v, jnp.int32)


FIXED_KEYS = ("vocab", "ngram")  # data, not weights: never trained


def trainable(params) -> dict:
  """The draft pytree without its vocabulary and n-gram tables (what gets
  gradients)."""
  return {k: v for k, v in params.items() if k not in FIXED_KEYS}


def draft_head(target_params, cfg: ModelConfig, draft_params):
  """`DraftModel.head` of these pytrees: a gather, which the engine also runs
  eagerly, once per call (outside a jit, binding a module costs ~40 ms)."""
  if "head" in draft_params:
    return draft_params["head"]
  head = target_params["embed"] if cfg.tie_embeddings else target_params["lm_head"].T
  if "vocab" in draft_params:
    head = jnp.take(head, draft_params["vocab"], axis=0)
  return head


def _head_product(draft_params, head_VxH, x_BxMxH):
  """`x @ head.T` `[B, M, V']` in fp32. Decoding (the draft head gathered once,
  `draft_params["head"]`) takes `transformer.matmul_t`, the faster product for
  a mask block's few rows on a CPU; training keeps the plain one."""
  if "head" in draft_params:
    return transformer.matmul_t(head_VxH, x_BxMxH, preferred_element_type=jnp.float32)
  return jnp.einsum("BMH,VH->BMV", x_BxMxH, head_VxH, preferred_element_type=jnp.float32)


def draft_logits(target_params, cfg: ModelConfig, drafter: Drafter,
                 hm_BxMxH, bonus_BxM, *, calibrate: bool = True, context=None):
  """Calibrated draft logits `[B, M, V']` from mask hidden states (pre final
  norm); V' is the draft vocabulary (`to_token_ids` maps indices to ids).
  `context` = (prev2_BxM, prev_BxM, hist_BxT, upto_BxM): the two tokens before
  each row's slot and the text its block drafts after — the n-gram prior's
  inputs (`rescored`; training passes the true tokens, drafting, which knows
  them only slot by slot, calls `rescored_drafts`). `DraftModel.logits` over
  plain pytrees."""
  return DraftModel.of(cfg, drafter.config, target_params).apply(
      transformer.variables(target_params, drafter.params), hm_BxMxH, bonus_BxM,
      calibrate=calibrate, context=context, method="logits")


def prior_bias(cfg: ModelConfig, drafter: Drafter, cand_BxMxC, prev2_BxM, prev_BxM,
               hist_BxT, upto_BxM):
  """The n-gram prior's bias `[B, M, C]` for draft-vocabulary candidates."""
  dcfg, p = drafter.config, drafter.params
  bias = jnp.zeros(cand_BxMxC.shape, jnp.float32)
  if dcfg.has_ngram_tables and dcfg.ngram_weight:
    bias += dcfg.ngram_weight * ngram.data_pmi(
        p["ngram"], dcfg.draft_vocab or cfg.vocab_size, prev2_BxM, prev_BxM, cand_BxMxC,
        dcfg.ngram_smoothing_bi, dcfg.ngram_smoothing_tri)
  if dcfg.context_trigram or dcfg.context_bigram:
    tri, bi = ngram.in_context(hist_BxT, upto_BxM, prev2_BxM, prev_BxM,
                               to_token_ids(p, cand_BxMxC))
    bias += dcfg.context_trigram * tri + dcfg.context_bigram * bi
  return bias


def _top(logits, k: int):
  """Indices of the `k` largest logits. The barrier keeps XLA:CPU from fusing
  the top-k into its consumers, which made it ~60x slower (0.17 -> 10 ms at
  batch 1 for the 7 slots' candidates)."""
  _, idx = jax.lax.top_k(jax.lax.stop_gradient(logits), k)
  return jax.lax.optimization_barrier(idx)


def rescored(cfg: ModelConfig, drafter: Drafter, logits_BxMxV, prev2_BxM, prev_BxM,
             hist_BxT, upto_BxM, cand=None):
  """`logits` with the n-gram prior added to each row's `rescore_top` largest
  (`cand`, their indices, when known)."""
  if cand is None:
    cand = _top(logits_BxMxV, drafter.config.rescore_top)
  bias = prior_bias(cfg, drafter, cand, prev2_BxM, prev_BxM, hist_BxT, upto_BxM)
  B, M, _ = cand.shape
  return logits_BxMxV.at[jnp.arange(B)[:, None, None], jnp.arange(M)[None, :, None],
                         cand].add(bias)


def rescored_drafts(cfg: ModelConfig, drafter: Drafter, logits_BxSxV, bonus_B,
                    hist_BxT, upto_B, pick):
  """Slot-by-slot drafting under the n-gram prior: slot 1 re-scored after the
  bonus, slot j after the drafts `pick` chose for the slots before it.
  `pick(j, logits_BxV)` -> draft-vocabulary indices `[B]`; `hist[:, :upto+1]`
  is each row's text through the bonus. Returns the re-scored logits
  `[B, S, V']` and the picks `[B, S]`."""
  cand = _top(logits_BxSxV, drafter.config.rescore_top)  # all slots at once
  prev2, prev = jnp.full_like(bonus_B, -1), bonus_B
  rows, picks = [], []
  for j in range(logits_BxSxV.shape[1]):
    lg = rescored(cfg, drafter, logits_BxSxV[:, j:j + 1], prev2[:, None], prev[:, None],
                  hist_BxT, upto_B[:, None], cand[:, j:j + 1])[:, 0]
    idx = pick(j, lg)
    rows.append(lg)
    picks.append(idx)
    prev2, prev = prev, to_token_ids(drafter.params, idx)
  return jnp.stack(rows, 1), jnp.stack(picks, 1)


# The decoding draft pytree's matmul weights (`[out, in]`, see
# `pytree.decode_layer`) that `narrow_draft_params` may narrow.
_NARROW_KEYS = tuple(k + "_t" for k in pytree.MATMUL_KEYS) + ("w1_t", "w2_t")


def narrow_draft_params(target_params, cfg: ModelConfig, draft_params, dtype):
  """A decoding draft pytree (per-layer, see `decode_params.draft_decoding_params`)
  whose draft pass reads its matmul weights in `dtype` (bf16): the draft
  attention, the calibration MLP, the draft head and `deep_mlp` — a copy of
  the deep layers' MLP weights for the mask rows (`transformer.forward`).
  Only drafts change (and only slightly); verification reads the target's own
  weights, so decoding stays lossless."""
  n, L = cfg.num_layers, len(draft_params["layers"])
  narrow = lambda d: {k: (v.astype(dtype) if k in _NARROW_KEYS else v) for k, v in d.items()}
  deep_mlp = [dict({k + "_t": pytree.layer_leaf(target_params, k, i).T.astype(dtype)
                    for k in ("gate", "up", "down")},
                   post_norm=pytree.layer_leaf(target_params, "post_norm", i))
              for i in range(n - L, n)]
  out = dict(draft_params, layers=[narrow(lp) for lp in draft_params["layers"]],
             deep_mlp=deep_mlp)
  if "calib" in out:
    out["calib"] = narrow(out["calib"])
  if "head" in out:
    out["head"] = out["head"].astype(dtype)
  return out


def narrowed_dtype(draft_params) -> str:
  """The dtype a decoding draft pytree's draft pass reads ("" when not narrowed)."""
  if "deep_mlp" not in draft_params:
    return ""
  return str(draft_params["deep_mlp"][0]["gate_t"].dtype)


def to_token_ids(draft_params, idx):
  """Draft-vocabulary indices -> the target's token ids."""
  if "vocab" not in draft_params:
    return idx
  return jnp.take(draft_params["vocab"], idx, axis=0)


def to_full_vocab(draft_params, probs_BxMxK, vocab_size: int):
  """Draft-vocabulary probabilities scattered into the target's vocabulary
  (zero outside the draft vocabulary)."""
  if "vocab" not in draft_params:
    return probs_BxMxK
  full = jnp.zeros(probs_BxMxK.shape[:-1] + (vocab_size,), probs_BxMxK.dtype)
  return full.at[..., draft_params["vocab"]].set(probs_BxMxK)


def num_params(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
