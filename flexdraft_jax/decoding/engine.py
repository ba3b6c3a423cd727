"""`generate`: check the inputs, tokenise, batch, prefill, run the driver
(driver.py) over the jitted chunks (chunk.py), collect results and stats."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax import checks, compile_cache, run_control
from flexdraft_jax.decoding import (call_stats, capacity, decode_params, inputs, memory_maps,
                                    sharding, timing)
from flexdraft_jax.decoding.chunk import prefill_batch
from flexdraft_jax.decoding.driver import Driver
from flexdraft_jax.decoding.options import (Mode, RuntimeOptions, SpecOptions,
                                            check_keywords, check_options, check_prompts,
                                            ignored_options)
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.drafter.model import Drafter, narrowed_dtype
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
    drafter = inputs.speculative_drafter(drafter, target, mode, speculation)
  if parallel_drafter is not None and parallel_drafter is not drafter:
    parallel_drafter = inputs.speculative_drafter(parallel_drafter, target, Mode.PARALLEL,
                                                  speculation, warn_blind=False)
    inputs.check_drafter_pair(drafter, parallel_drafter)
  else:
    parallel_drafter = None
  tree_top = inputs.tree_top(drafter, mode, speculation, sampling, target.config.vocab_size)
  sampling = sampling.resolved(trees=bool(tree_top))
  prompts = check_prompts(prompts)
  n_ids = sum(not isinstance(p, str) for p in prompts)
  if target.tokenizer is None and n_ids < len(prompts):
    raise FlexDraftError(f"{target.name} has no tokenizer (no tokenizer.json): pass "
                         "prompts as token ids, e.g. [[1, 2, 3]]")
  if chat and n_ids:
    warnings.warn(f"chat=True has no effect on the {n_ids} prompt(s) given as token ids "
                  "(the chat template applies to text)", FlexDraftWarning, stacklevel=2)
  ids = inputs.encode_prompts(target, prompts, chat)
  stop_ids = inputs.stop_ids(target, stop)
  batch_size = runtime.batch_size or len(ids)  # None: one batch
  # Every prompt must fit before any batch decodes: a long one late in the list
  # fails the call now, not after the batches before it (their output lost).
  capacity.check_request(target.config, [len(x) for x in ids], max_new_tokens,
                         drafter.config.block_size if drafter is not None else 1,
                         runtime.max_len, speculation.tree_budget if tree_top else 0)

  def run(stream: bool):
    results, stats_list = [None] * len(ids), []
    narrow = decode_params.resolve_draft_dtype(speculation.draft_dtype, target.params)
    texts = _TextStreams(target.tokenizer) if stream else None
    # Every batch pads its prompts to the call's longest: one prefill program
    # for the call (a shape is a program to compile or load) where its batches'
    # prompt lengths differ.
    prompt_width = round_up(max(len(x) for x in ids), capacity.PROMPT_PAD)
    for start in range(0, len(ids), batch_size):
      run_control.check()  # a stop whose exception was lost (run_control.py)
      chunk = ids[start:start + batch_size]
      memory_maps.release_if_near_limit()
      batch = _generate_batch(target, chunk, max_new_tokens, sampling,
                              inputs.seed_key(seed, start), drafter, mode, speculation, stop_ids,
                              runtime, narrow, parallel_drafter, tree_top, stream=stream,
                              prompt_width=prompt_width)
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
    stats = call_stats.merge_stats(stats_list, mode)
    # whether drafts were sampled (`draft_sampling` decided: auto is on at T > 0
    # without draft trees); None where nothing was drafted
    stats["draft_sampling"] = (sampling.sampled_drafts
                               if drafter is not None and not sampling.greedy else None)
    out = GenerateResult(results, _texts(target.tokenizer, results), stats)
    call_stats.whole_call_times(stats, started, timing.now())
    return out

  return run


_ARGS = tuple(inspect.signature(generate).parameters)[2:-1]  # its keyword arguments


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


def _generate_batch(target, ids, max_new, sp, key, drafter, mode, opts, stop_ids,
                    runtime: RuntimeOptions, draft_dtype=None, parallel_drafter=None,
                    tree_top=0, stream: bool = False, prompt_width: int = 0):
  """A generator: prefills and decodes one batch; with `stream` it yields
  {row: its tokens so far} after each chunk. Returns (tokens, stats). Prompts
  are padded to `prompt_width` where the cache holds it, else to their own
  longest (a multiple of PROMPT_PAD either way)."""
  cfg = target.config
  mesh = sharding.batch_mesh()
  B, Bp = len(ids), sharding.padded_batch(len(ids), mesh)
  plens = [len(x) for x in ids] + [1] * (Bp - len(ids))  # pad rows start done
  bs = drafter.config.block_size if drafter is not None else 1
  S = capacity.cache_length(cfg, plens, max_new, bs, runtime.max_len,
                            opts.tree_budget if tree_top else 0)
  own = round_up(max(plens), capacity.PROMPT_PAD)
  prompt = np.zeros((Bp, max(own, prompt_width if prompt_width <= S else 0)), np.int32)
  for i, x in enumerate(ids):
    prompt[i, :len(x)] = x
  prompt, plen, valid = sharding.put_batch(
      mesh, prompt, np.asarray(plens, np.int32), np.arange(Bp) < B)
  dcfg = None if drafter is None else drafter.config
  dparams = None if drafter is None else sharding.replicate(
      mesh, decode_params.draft_decoding_params(target.params, cfg, drafter.params,
                                                draft_dtype))
  if parallel_drafter is not None:
    parallel_drafter = parallel_drafter._replace(params=sharding.replicate(
        mesh, decode_params.draft_decoding_params(target.params, cfg, parallel_drafter.params,
                                                  draft_dtype)))
  target = target._replace(
      params=sharding.replicate(mesh, decode_params.decoding_params(target.params)))
  drafter = None if drafter is None else drafter._replace(params=dparams)
  static = dict(cfg=cfg, dcfg=dcfg, sp=sp, attn_impl=runtime.attn_impl)
  traced = dict(max_new=jnp.int32(max_new), stop_ids=inputs.stop_array(stop_ids))
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
