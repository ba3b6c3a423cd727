"""`generate`: check the inputs, tokenise, batch, prefill, run the driver
(driver.py) over the jitted chunks (chunk.py), collect results and stats."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import warnings
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax import checks, compile_cache
from flexdraft_jax.decoding import flex_costs, memory_maps, sharding, timing
from flexdraft_jax.decoding.chunk import prefill_batch
from flexdraft_jax.decoding.driver import Driver
from flexdraft_jax.decoding.options import (Mode, RuntimeOptions, SpecOptions,
                                            check_keywords, check_options, check_prompts,
                                            check_stop, ignored_options, python_name)
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.decoding.state import KV_BLOCK
from flexdraft_jax.drafter.model import (Drafter, draft_head, narrow_draft_params,
                                         narrowed_dtype)
from flexdraft_jax.kernels import cpu_matmul
from flexdraft_jax.model import pytree
from flexdraft_jax.model.config import FlexDraftError, FlexDraftWarning, Target
from flexdraft_jax.util import round_up


@dataclasses.dataclass
class GenerateResult:
  token_ids: list      # per prompt: new ids, up to and including a stop token
  texts: list
  stats: dict


@dataclasses.dataclass
class StreamChunk:
  """Tokens of one row that were just decided: `row` (the prompt's index),
  its new `token_ids`, and their `text` (None without a tokenizer). A row's
  texts joined are its `GenerateResult.texts` entry; text that ends inside a
  multi-byte character waits for the token that completes it."""
  row: int
  token_ids: list
  text: Optional[str]


class GenerateStream:
  """What `generate_stream` returns: iterate it for `StreamChunk`s as rows
  commit tokens; once it is exhausted, `result` is the `GenerateResult` that
  `generate` would have returned (the same tokens, texts and stats)."""

  def __init__(self, chunks):
    self._chunks = chunks
    self.result: Optional[GenerateResult] = None

  def __iter__(self):
    return self

  def __next__(self) -> StreamChunk:
    try:
      return next(self._chunks)
    except StopIteration as e:
      self.result = e.value
      raise StopIteration from None

  def close(self):
    """Stops decoding (what is not decoded yet never is)."""
    self._chunks.close()


def _encode_prompts(target, prompts, chat: bool):
  tok = target.tokenizer
  ids = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      x = tok.apply_chat_template(p) if chat else tok.encode(p)
    else:
      x = [int(t) for t in p]
      bad = [t for t in x if not 0 <= t < target.config.vocab_size]
      if bad:
        raise FlexDraftError(f"prompt {i} has token id {bad[0]} outside the "
                             f"vocabulary [0, {target.config.vocab_size})")
    if not x:
      bos = target.config.bos_token_id
      if bos is None:
        raise FlexDraftError(f"prompt {i} is empty and the model has no BOS token")
      x = [bos]  # an empty prompt is generated from BOS
    ids.append(list(x))
  return ids


MAX_STOP_IDS = 8


def _stop_array(stop_ids: tuple) -> jax.Array:
  return jnp.asarray(list(stop_ids) + [-1] * (MAX_STOP_IDS - len(stop_ids)), jnp.int32)


def _stop_ids(target, stop) -> tuple:
  check_stop(stop)
  vocab = target.config.vocab_size
  if stop is None:
    ids = tuple(target.config.eos_token_ids)
  else:
    ids = []
    for s in stop:
      if isinstance(s, str):
        if target.tokenizer is None:
          raise FlexDraftError(f"stop string {s!r} needs a tokenizer and {target.name} "
                               "has none: pass the stop token's id")
        enc = target.tokenizer.encode(s)
        if len(enc) != 1:
          raise FlexDraftError(f"stop string {s!r} is not a single token")
        s = enc[0]
      if not 0 <= int(s) < vocab:
        raise FlexDraftError(f"stop id {int(s)} is outside the vocabulary [0, {vocab})")
      ids.append(int(s))
    ids = tuple(ids)
  ids = tuple(sorted(set(ids)))
  if len(ids) > MAX_STOP_IDS:
    raise FlexDraftError(f"at most {MAX_STOP_IDS} stop tokens, got {len(ids)}")
  return ids


def generate(target, prompts: Sequence, *, drafter: Optional[Drafter] = None,
             parallel_drafter: Optional[Drafter] = None,
             mode: str = "ar", max_new_tokens: int = 128,
             sampling: SamplingParams = SamplingParams(),
             speculation: SpecOptions = SpecOptions(),
             runtime: RuntimeOptions = RuntimeOptions(),
             chat: bool = False, stop=None, seed: int = 0, **unknown) -> GenerateResult:
  """Generates continuations of `prompts` (strings or id lists).

  `mode` is one of `Mode` ("ar", "parallel", "sequential", "flex"); every
  mode's output is the target's (token-identical to "ar" at T=0). The option
  groups: `sampling` (temperature, top-k/p, draft sampling), `speculation`
  (block size, verify length, θ, flex's B*, the draft dtype, the cost cache)
  and `runtime` (batch size, cache length, attention kernel); see options.py.
  `stop`: token ids or single-token strings (default: the model's EOS).
  `parallel_drafter`: a second drafter, trained to draft blind, that parallel
  mode uses (in "parallel", and in "flex" where it picks parallel steps);
  `drafter` then drafts for sequential steps only. It must share `drafter`'s
  block size and draft vocabulary (the drafts in flight pass between them).
  `seed`: any integer that fits 64 bits (each batch's key from seed + its
  first prompt's index, wrapping at 2**64).
  Returns GenerateResult(token_ids, texts, stats). The stats' seconds add up
  to the call: `compile_seconds` (every program compiled or loaded, once),
  `flex_timing_seconds` (flex timing its steps, its compiling left out),
  `prefill_seconds`, `decode_seconds` and `other_seconds` (tokenising, weight
  layouts, moving rows), summed in `seconds`.

  Every argument's type is checked first (checks.py); a keyword of the earlier
  API (`temperature=`, `batch_size=`, …) gets a line naming its option group.
  """
  run = _start(target, prompts, unknown=unknown, drafter=drafter,
               parallel_drafter=parallel_drafter, mode=mode, max_new_tokens=max_new_tokens, sampling=sampling,
               speculation=speculation, runtime=runtime, chat=chat, stop=stop, seed=seed)
  return _drain(run(stream=False))


def generate_stream(target, prompts: Sequence, *, drafter: Optional[Drafter] = None,
                    parallel_drafter: Optional[Drafter] = None,
                    mode: str = "ar", max_new_tokens: int = 128,
                    sampling: SamplingParams = SamplingParams(),
                    speculation: SpecOptions = SpecOptions(),
                    runtime: RuntimeOptions = RuntimeOptions(),
                    chat: bool = False, stop=None, seed: int = 0,
                    **unknown) -> GenerateStream:
  """`generate` as an iterator: the same arguments, checked now; iterating
  decodes and yields each row's tokens as they are decided (`StreamChunk`),
  and then `.result` holds what `generate` returns — the same tokens at the
  same seed, and its stats (`decode_seconds` leaves out the time the loop's
  body took between chunks; it is in `other_seconds`)."""
  run = _start(target, prompts, unknown=unknown, drafter=drafter,
               parallel_drafter=parallel_drafter, mode=mode, max_new_tokens=max_new_tokens, sampling=sampling,
               speculation=speculation, runtime=runtime, chat=chat, stop=stop, seed=seed)
  return GenerateStream(run(stream=True))


def _drain(chunks):
  """The return value of the generator `chunks`, run to its end."""
  while True:
    try:
      next(chunks)
    except StopIteration as e:
      return e.value


def _start(target, prompts, *, unknown, drafter, parallel_drafter, mode, max_new_tokens,
           sampling, speculation, runtime, chat, stop, seed):
  """Checks every input (one-line errors now, before anything slow); returns
  `run(stream)`, a generator of StreamChunks (none unless `stream`) that
  returns the GenerateResult."""
  started = timing.now()
  check_keywords(unknown, _ARGS, dict(sampling=sampling, speculation=speculation,
                                      runtime=runtime))
  checks.check_loaded("target", target, Target, "fd.load_target({})")
  for name, value in (("drafter", drafter), ("parallel_drafter", parallel_drafter)):
    if value is not None:
      checks.check_loaded(name, value, Drafter, "fd.load_drafter({}, target)")
  compile_cache.ensure()
  timing.listen()
  mode = check_options(mode=mode, max_new_tokens=max_new_tokens, sampling=sampling,
                       speculation=speculation, runtime=runtime, stop=stop, chat=chat,
                       seed=seed)
  for line in ignored_options(mode=mode, sampling=sampling, speculation=speculation,
                              drafter=drafter, parallel_drafter=parallel_drafter):
    warnings.warn(line, FlexDraftWarning, stacklevel=2)
  if mode == Mode.PARALLEL and parallel_drafter is not None:
    drafter = parallel_drafter  # parallel steps only: the one drafter they use
  if mode != Mode.AR and drafter is None:
    raise FlexDraftError(f"mode {str(mode)!r} needs a drafter (--drafter PATH)")
  if mode not in (Mode.PARALLEL, Mode.FLEX):
    parallel_drafter = None
  if mode == Mode.AR:
    drafter = None
  else:
    drafter = _speculative_drafter(drafter, target, mode, speculation)
  if parallel_drafter is not None and parallel_drafter is not drafter:
    parallel_drafter = _speculative_drafter(parallel_drafter, target, Mode.PARALLEL,
                                            speculation, warn_blind=False)
    _check_drafter_pair(drafter, parallel_drafter)
  else:
    parallel_drafter = None
  tree_top = _tree_top(drafter, mode, speculation, sampling, target.config.vocab_size)
  prompts = check_prompts(prompts)
  n_ids = sum(not isinstance(p, str) for p in prompts)
  if target.tokenizer is None and n_ids < len(prompts):
    raise FlexDraftError(f"{target.name} has no tokenizer (no tokenizer.json): pass "
                         "prompts as token ids, e.g. [[1, 2, 3]]")
  if chat and n_ids:
    warnings.warn(f"chat=True has no effect on the {n_ids} prompt(s) given as token ids "
                  "(the chat template applies to text)", FlexDraftWarning, stacklevel=2)
  ids = _encode_prompts(target, prompts, chat)
  stop_ids = _stop_ids(target, stop)
  batch_size = runtime.batch_size or len(ids)  # None: one batch

  def run(stream: bool):
    results, stats_list = [None] * len(ids), []
    narrow = resolve_draft_dtype(speculation.draft_dtype, target.params)
    texts = _TextStreams(target.tokenizer) if stream else None
    for start in range(0, len(ids), batch_size):
      chunk = ids[start:start + batch_size]
      memory_maps.release_if_near_limit()
      batch = _generate_batch(target, chunk, max_new_tokens, sampling,
                              seed_key(seed, start), drafter, mode, speculation, stop_ids,
                              runtime, narrow, parallel_drafter, tree_top, stream=stream)
      while True:  # the batch's rows so far after each chunk (streaming only)
        try:
          rows = next(batch)
        except StopIteration as e:
          toks, st = e.value
          break
        yield from texts.update({start + r: t for r, t in rows.items()})
      if stream:  # the rest of each row's text
        yield from texts.update({start + r: t for r, t in enumerate(toks)}, final=True)
      results[start:start + len(chunk)] = toks
      stats_list.append(st)
    stats = _merge_stats(stats_list, mode)
    out = GenerateResult(results, _texts(target.tokenizer, results), stats)
    _whole_call_times(stats, started, timing.now())
    return out

  return run


_ARGS = tuple(inspect.signature(generate).parameters)[2:-1]  # its keyword arguments


def seed_key(seed: int, offset: int = 0) -> jax.Array:
  """The PRNG key of `seed + offset`, from all 64 bits of that sum (modulo
  2**64: no seed overflows). For 0 <= seed + offset < 2**32 it is
  `jax.random.PRNGKey(seed + offset)`, the key decoding has always drawn
  from; beyond, `PRNGKey` (without 64-bit ints) would keep only the low 32
  bits, and seeds 5 and 2**32 + 5 would draw alike."""
  u = (int(seed) + offset) % 2 ** 64
  if jax.config.jax_default_prng_impl != "threefry2x32":  # keys of another layout
    key = jax.random.PRNGKey(u & 0xFFFFFFFF)
    return jax.random.fold_in(key, u >> 32) if u >> 32 else key
  return jnp.asarray(np.array([u >> 32, u & 0xFFFFFFFF], np.uint32))  # PRNGKey's layout


def _speculative_drafter(drafter: Drafter, target, mode: Mode, so: SpecOptions,
                         warn_blind: bool = True) -> Drafter:
  """`drafter` checked against `target` and `mode`, with `so`'s block size and
  calibration."""
  from flexdraft_jax.drafter.compat import check_compatible
  check_compatible(drafter, target)
  if warn_blind and mode == Mode.PARALLEL and not drafter.config.drafts_blind:
    warnings.warn("mode 'parallel' drafts before the bonus is known and this drafter "
                  "was trained to read it (bonus_input without bonus_dropout): it "
                  "drafts blind, poorly; 'sequential' or 'flex' suit it",
                  FlexDraftWarning, stacklevel=3)
  drafter = _with_block_size(drafter, so.block_size)
  if so.verify_len is not None and so.verify_len > drafter.config.block_size:
    raise FlexDraftError(f"{python_name('verify_len')}={so.verify_len} exceeds the "
                         f"block size {drafter.config.block_size}")
  if not so.calibrate:  # ablation: drafts without the bonus-guided calibration
    drafter = drafter._replace(config=dataclasses.replace(drafter.config, calibrate=False))
  return drafter


def _tree_top(drafter: Optional[Drafter], mode: Mode, so: SpecOptions,
              sp: SamplingParams, vocab_size: int) -> int:
  """Candidates kept per draft slot for draft trees (`speculation.tree_budget`;
  0 without): the drafter's `rescore_top`, the candidates its n-gram prior
  re-scores. Checks the budget against what the drafter can fill."""
  if so.tree_budget is None or drafter is None:
    return 0
  if mode not in (Mode.SEQUENTIAL, Mode.FLEX):
    raise FlexDraftError(f"{python_name('tree_budget')} runs in mode 'sequential' or "
                         f"'flex' (draft trees verify, then draft), not {str(mode)!r}")
  if sp.draft_sampling and not sp.greedy:
    raise FlexDraftError(f"{python_name('tree_budget')} verifies the likeliest drafts "
                         f"(each node a point-mass draft): turn "
                         f"{python_name('draft_sampling')} off")
  dcfg = drafter.config
  top = min(dcfg.rescore_top, dcfg.draft_vocab or vocab_size)
  # the root, and every path of 1 .. block - 1 candidates
  most = 1 + sum(top ** d for d in range(1, dcfg.block_size))
  if so.tree_budget > most:
    raise FlexDraftError(f"{python_name('tree_budget')}={so.tree_budget} exceeds the "
                         f"{most} nodes this drafter's block can fill (block "
                         f"{dcfg.block_size}, {top} candidates a slot)")
  return top


def _check_drafter_pair(drafter: Drafter, parallel_drafter: Drafter):
  """The drafts in flight pass between the two drafters as flex switches modes
  (and at T > 0 with their draft distributions): one block size, one draft
  vocabulary."""
  a, b = drafter.config, parallel_drafter.config
  if a.block_size != b.block_size:
    raise FlexDraftError(f"the parallel drafter's block size {b.block_size} differs from "
                         f"the drafter's {a.block_size}: they must match")
  va, vb = drafter.params.get("vocab"), parallel_drafter.params.get("vocab")
  same = (va is None and vb is None) or (
      va is not None and vb is not None and va.shape == vb.shape
      and bool(np.array_equal(np.asarray(va), np.asarray(vb))))
  if not same:
    raise FlexDraftError("the parallel drafter's draft vocabulary differs from the "
                         "drafter's: they must draft over the same token ids")
  if not b.drafts_blind:
    warnings.warn("the parallel drafter was trained to read the bonus (bonus_input "
                  "without bonus_dropout): parallel mode drafts before the bonus is "
                  "known, so it drafts blind, poorly", FlexDraftWarning, stacklevel=4)


def _texts(tokenizer, results: list) -> list:
  """Each row's text; None without a tokenizer (the ids are the output)."""
  if tokenizer is None:
    return [None] * len(results)
  return [tokenizer.decode(t) for t in results]


class _TextStreams:
  """Per row, the tokens and text streamed so far: each update yields a
  StreamChunk for every row with new tokens. Text is the decoded tokens so
  far, less a trailing replacement character (U+FFFD: bytes of a character
  whose last token has not come yet), which waits for the next update; the
  final one gives the rest, so a row's texts join to `tokenizer.decode`."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.tokens, self.text = {}, {}

  def update(self, rows: dict, final: bool = False):
    for r, toks in sorted(rows.items()):
      had = self.tokens.get(r, [])
      if len(toks) <= len(had) and not final:
        continue
      new_ids = list(toks[len(had):])
      self.tokens[r] = list(toks)
      piece = None
      if self.tokenizer is not None:
        text = self.tokenizer.decode(toks)
        if not final:
          text = text.rstrip("\ufffd")
        shown = self.text.get(r, "")
        piece = text[len(shown):] if text.startswith(shown) else ""
        self.text[r] = shown + piece
        if not new_ids and not piece:
          continue
      elif not new_ids:
        continue
      yield StreamChunk(r, new_ids, piece)


def _whole_call_times(stats: dict, start: float, end: float):
  """The call's seconds in `stats`, parts that add up to `seconds`: compiling
  (every program compiled or loaded from the persistent cache, wherever it
  happened, counted once), flex's step timing, prefill and decode (each less
  the compiling inside it), and the rest (`other_seconds`)."""
  stats["seconds"] = end - start
  stats["compile_seconds"] = timing.covered(timing.compile_spans(start, end), start, end)
  stats["programs_compiled"], stats["programs_from_cache"] = timing.programs(start, end)
  parts = sum(stats[k] for k in ("compile_seconds", "flex_timing_seconds",
                                 "prefill_seconds", "decode_seconds"))
  stats["other_seconds"] = max(stats["seconds"] - parts, 0.0)
  stats["compile_cache"] = compile_cache.folder()


def _with_block_size(drafter: Drafter, block_size: Optional[int]) -> Drafter:
  """A drafter may decode with a smaller block than it was trained with."""
  trained = drafter.config.block_size
  if block_size is None or block_size == trained:
    return drafter
  if not 2 <= block_size <= trained:
    raise FlexDraftError(f"block size {block_size} is not supported by this drafter "
                         f"(trained with {trained}; use 2..{trained})")
  return drafter._replace(config=dataclasses.replace(drafter.config, block_size=block_size))


# id(tree) -> (tree, per-layer copy); the few most recent trees (a target and
# its drafters), so a long-lived process doesn't keep every tree it decoded.
_unstacked = collections.OrderedDict()
_UNSTACKED_MAX = 4


def resolve_draft_dtype(draft_dtype: str, target_params):
  """The dtype the draft pass reads its matmul weights in, or None for the
  weights' own. "auto": bf16 where the CPU kernel runs and the target is fp32
  (SmolLM2-135M's L = 8 draft pass at batch 1 on the 2-core CPU: 8.7 -> 6.0
  ms); elsewhere the weights' own dtype."""
  if draft_dtype == "bfloat16":
    return jnp.bfloat16
  if draft_dtype == "target":
    return None
  fp32 = target_params["embed"].dtype == jnp.float32
  return jnp.bfloat16 if fp32 and cpu_matmul.available() else None


# (trees, dtype) -> narrowed draft pytree, the most recent few
_narrowed = collections.OrderedDict()


def _draft_decoding_params(target_params, cfg, draft_params, dtype=None):
  """The draft pytree for decoding: per-layer (matmul weights `[out, in]`, see
  `pytree.decode_layer`), the calibration's too, and with a draft
  vocabulary its draft head (those rows of the LM head) gathered once here,
  not every step. With `dtype` the draft pass reads its weights narrowed
  (`narrow_draft_params`), a copy cached per (target, drafter) pair."""
  def make():
    params = _decoding_params(draft_params, _draft_layout)
    if "vocab" in params:
      params = dict(params, head=draft_head(target_params, cfg, params))
    return params if dtype is None else narrow_draft_params(target_params, cfg, params,
                                                            dtype)
  if dtype is None:
    return make()
  key = (id(target_params), id(draft_params), str(jnp.dtype(dtype)))
  return _cached(_narrowed, key, (target_params, draft_params), make)


def _draft_layout(draft_params):
  """A draft pytree per-layer, its calibration MLP's weights transposed too."""
  params = pytree.unstack_layers(draft_params)
  if "calib" not in params:
    return params
  return dict(params, calib=pytree.decode_layer(params["calib"], keys=("w1", "w2")))


def _decoding_params(tree, convert=pytree.unstack_layers):
  """`tree` with per-layer weight arrays: decoding reads each layer's weights in
  place instead of slicing a stacked array. A tree already in that layout
  (`load_target(..., layout="layers")`) is used as is; a stacked one gets a
  per-layer copy (`convert`), cached per pytree object."""
  if pytree.is_per_layer(tree):
    return tree
  return _cached(_unstacked, id(tree), (tree,), lambda: convert(tree))


def _cached(cache, key, trees: tuple, make):
  """`make()`, cached in `cache` under `key` while `trees` (what it was made
  from, matched by identity) live; the `_UNSTACKED_MAX` most recent entries."""
  hit = cache.get(key)
  if hit is None or any(a is not b for a, b in zip(hit[0], trees)):
    hit = (trees, make())
    cache[key] = hit
  cache.move_to_end(key)
  while len(cache) > _UNSTACKED_MAX:
    cache.popitem(last=False)
  return hit[1]


def spare_positions(bs: int, tree_budget=None) -> int:
  """Cache slots a request needs past its last token: two draft blocks, or a
  draft tree's nodes where that is more."""
  return max(2 * bs, tree_budget or 0) + 1


# Each cache length and padded prompt length is a program to compile (or load):
# requests up to MIN_CACHE_LEN positions share that one length (the attention
# over the extra empty slots is a small part of a step), and prompts are padded
# to a multiple of PROMPT_PAD.
MIN_CACHE_LEN = 2 * KV_BLOCK
PROMPT_PAD = 64


def _capacity(cfg, plens, max_new, bs, max_len, tree_budget=0):
  """The KV-cache length: `max_len` (rounded up to KV_BLOCK) or what the
  request needs. The model's context bounds prompt + new tokens either way; a
  `max_len` too short for the request is an error, never silently enlarged."""
  longest = max(plens)
  spare = spare_positions(bs, tree_budget)
  need = longest + max_new + spare
  if max_len is not None and longest + 1 > max_len:
    raise FlexDraftError(f"a prompt has {longest} tokens, longer than the cache "
                         f"(runtime.max_len={max_len})")
  if longest + max_new > cfg.max_position_embeddings:
    raise FlexDraftError(
        f"prompt of {longest} tokens + max_new_tokens={max_new} exceeds the "
        f"model's context of {cfg.max_position_embeddings}")
  if max_len is None:  # short requests share one length: one set of programs
    most = round_up(cfg.max_position_embeddings + spare, KV_BLOCK)
    return max(round_up(need, KV_BLOCK), min(MIN_CACHE_LEN, most))
  if max_len < need:
    raise FlexDraftError(
        f"runtime.max_len={max_len} is too short: a prompt of {longest} tokens + max_new_tokens="
        f"{max_new} needs {need} (with {spare} spare positions for the decode "
        "steps); raise it, or leave it unset")
  most = round_up(cfg.max_position_embeddings + spare, KV_BLOCK)
  if max_len > most:  # positions past the context are never written: memory for nothing
    raise FlexDraftError(
        f"runtime.max_len={max_len} is beyond the model's context of "
        f"{cfg.max_position_embeddings} (a cache of {most} holds every request): "
        "lower it, or leave it unset")
  return round_up(max_len, KV_BLOCK)


def _generate_batch(target, ids, max_new, sp, key, drafter, mode, opts, stop_ids,
                    runtime: RuntimeOptions, draft_dtype=None, parallel_drafter=None,
                    tree_top=0, stream: bool = False):
  """A generator: prefills and decodes one batch; with `stream` it yields
  {row: its tokens so far} after each chunk. Returns (tokens, stats)."""
  cfg = target.config
  mesh = sharding.batch_mesh()
  B, Bp = len(ids), sharding.padded_batch(len(ids), mesh)
  plens = [len(x) for x in ids] + [1] * (Bp - len(ids))  # pad rows start done
  bs = drafter.config.block_size if drafter is not None else 1
  S = _capacity(cfg, plens, max_new, bs, runtime.max_len,
                opts.tree_budget if tree_top else 0)
  prompt = np.zeros((Bp, round_up(max(plens), PROMPT_PAD)), np.int32)
  for i, x in enumerate(ids):
    prompt[i, :len(x)] = x
  prompt, plen, valid = sharding.put_batch(
      mesh, prompt, np.asarray(plens, np.int32), np.arange(Bp) < B)
  dcfg = None if drafter is None else drafter.config
  dparams = None if drafter is None else sharding.replicate(
      mesh, _draft_decoding_params(target.params, cfg, drafter.params, draft_dtype))
  if parallel_drafter is not None:
    parallel_drafter = parallel_drafter._replace(params=sharding.replicate(
        mesh, _draft_decoding_params(target.params, cfg, parallel_drafter.params,
                                     draft_dtype)))
  target = target._replace(
      params=sharding.replicate(mesh, _decoding_params(target.params)))
  drafter = None if drafter is None else drafter._replace(params=dparams)
  static = dict(cfg=cfg, dcfg=dcfg, sp=sp, attn_impl=runtime.attn_impl)
  traced = dict(max_new=jnp.int32(max_new), stop_ids=_stop_array(stop_ids))
  t0 = timing.now()
  state = prefill_batch(target.params, dparams, prompt, plen, valid,
                   key, S=S, out_len=S,  # max_new < S; shapes need only S
                   cache_sharding=sharding.cache_sharding(mesh), tree_top=tree_top,
                   **static, **traced)
  jax.block_until_ready(state)
  t1 = w1 = timing.now()
  driver = Driver(target, drafter, mode, opts, static, traced, Bp, S,
                  steps_per_call=runtime.steps_per_call, mesh=mesh,
                  parallel_drafter=parallel_drafter)
  paused = []  # (start, end): the caller held the stream
  for state in driver.chunks(state, max_new, stream=stream):
    if stream:
      t = timing.now()
      yield {r: x for r, x in driver.rows_so_far(state).items() if r < B}
      paused.append((t, timing.now()))
  state = jax.block_until_ready(state)
  w2 = timing.now()
  # Decode time leaves out compiling, flex's one-time step-cost timing and
  # the time the caller of a stream held it; each span is counted once.
  compiling = timing.compile_spans(w1, w2)
  in_prefill = timing.covered(timing.compile_spans(t0, t1), t0, t1)
  compile_in_decode = timing.covered(compiling, w1, w2)
  not_decoding = timing.covered(compiling + driver.timing_spans, w1, w2)
  excluded = timing.covered(compiling + driver.timing_spans + paused, w1, w2)
  hist = np.asarray(state.accept_hist)
  tokens = driver.outputs_in_order(state, Bp)[:B]
  new_tokens = sum(len(t) for t in tokens)
  decode_tokens = new_tokens - sum(1 for t in tokens if t)  # t0 comes from prefill
  steps = int(np.asarray(state.steps))
  committed = int((hist * np.arange(len(hist))).sum())
  stats = {
      "prefill_seconds": max(t1 - t0 - in_prefill, 0.0),
      "decode_seconds": max(w2 - w1 - excluded, 1e-9),
      "compile_seconds": in_prefill + compile_in_decode,
      "flex_timing_seconds": not_decoding - compile_in_decode,
      "new_tokens": new_tokens, "decode_tokens": decode_tokens, "steps": steps,
      "committed_tokens": committed, "verified_row_steps": int(hist.sum()),
      "accept_hist": hist.tolist(), "batch_size": B,
      "draft_dtype": (narrowed_dtype(dparams) or "target") if drafter is not None else None,
  }
  stats.update(driver.stats())
  return tokens, stats


def mode_emitted(parts) -> dict:
  """{mode: [row-steps, tokens emitted]} summed over stats `parts`."""
  out = {}
  for p in parts:
    for m, (r, t) in p.get("mode_emitted", {}).items():
      acc = out.setdefault(m, [0, 0])
      acc[0], acc[1] = acc[0] + r, acc[1] + t
  return out


def mode_tau(parts) -> dict:
  """{mode: τ of its steps, emitted tokens only} over stats `parts`."""
  return {m: t / r for m, (r, t) in mode_emitted(parts).items() if r}


def _merge_stats(parts, mode):
  s = {"mode": str(mode), "draft_dtype": parts[0]["draft_dtype"]}
  for k in ("prefill_seconds", "decode_seconds", "compile_seconds", "flex_timing_seconds",
            "new_tokens", "decode_tokens", "steps", "committed_tokens",
            "verified_row_steps"):
    s[k] = sum(p[k] for p in parts)
  width = max(len(p["accept_hist"]) for p in parts)
  hist = np.zeros(width, np.int64)
  for p in parts:
    hist[:len(p["accept_hist"])] += p["accept_hist"]
  s["accept_hist"] = hist.tolist()
  # Decode throughput (SPEC §5): tokens decided after prefill (each row's
  # first token comes from the prefill forward) per second of decoding;
  # compiling and flex's step-cost timing are not decoding.
  s["tokens_per_second"] = timing.tokens_per_second(s["decode_tokens"], s["decode_seconds"])
  # τ (SPEC §5): tokens emitted per row verification (nothing past a stop or
  # max_new_tokens: `committed_tokens` counts those too), overall and per mode
  s["tau"] = s["decode_tokens"] / max(s["verified_row_steps"], 1)
  s["mode_emitted"], s["mode_tau"] = mode_emitted(parts), mode_tau(parts)
  for k in ("group_counts", "mode_steps"):  # run-length [value, steps] lists
    s[k] = [x for p in parts for x in p.get(k, [])]
  if "flex_threshold" in parts[0]:
    s["flex_threshold"] = parts[0]["flex_threshold"]
    s["step_costs"] = {b: c for p in parts for b, c in p["step_costs"].items()}
    # per batch shape, the choice record of the last batch of that shape, with
    # the chunks of every batch of that shape summed
    s["flex_choices"] = {b: dict(c) for p in parts for b, c in p.get("flex_choices", {}).items()}
    for b, c in s["flex_choices"].items():
      runs = [p["flex_choices"][b]["chunks"] for p in parts
              if "chunks" in p.get("flex_choices", {}).get(b, {})]
      if runs:
        c["chunks"] = flex_costs.merge_chunk_records(runs)
  return s
