"""`generate`'s options and their checks: the modes, the option groups
(`SamplingParams` in sampling.py, `SpecOptions`, `RuntimeOptions`), and the
checks of prompts and stop tokens that need no model."""

from __future__ import annotations

import dataclasses
import enum
import numbers
from typing import Optional

import numpy as np

from flexdraft_jax.decoding import verify
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.model.config import FlexDraftError


class Mode(str, enum.Enum):
  """A decoding mode; equal to (and hashed as) its string, so "flex" works too."""
  AR = "ar"                  # the target alone, one token a step
  PARALLEL = "parallel"      # drafts inside the verify forward
  SEQUENTIAL = "sequential"  # verifies, then drafts through the deep layers
  FLEX = "flex"              # picks AR, parallel or sequential by measured cost

  def __str__(self):
    return self.value

  def __format__(self, spec):
    return format(self.value, spec)

  def __hash__(self):
    return str.__hash__(self)


MODES = tuple(m.value for m in Mode)
# What the driver and flex call sequential steps that verify a draft tree
# (`SpecOptions.tree_budget`), their k the tree's node budget: not a mode one
# asks for (that is "sequential" with a budget), one flex may choose.
TREE = "tree"
ATTN_IMPLS = ("xla", "pallas", "auto")
# The draft pass's matmul weights: "bfloat16" (half the bytes; drafts may
# differ slightly, outputs do not), "target" (the target's dtype, as loaded),
# "auto" (bfloat16 where the CPU kernel runs it on an fp32 target, see
# `engine.resolve_draft_dtype`).
DRAFT_DTYPES = ("auto", "bfloat16", "target")
MAX_POSITIONS = 2 ** 31 - 1  # positions and lengths are int32 on the device


def _is_int(x) -> bool:
  """An integer (Python, NumPy or a 0-d integer array), not a bool or a float."""
  if isinstance(x, bool):
    return False
  if isinstance(x, numbers.Integral):
    return True
  dtype = getattr(x, "dtype", None)
  return dtype is not None and getattr(x, "ndim", 1) == 0 and np.dtype(dtype).kind in "iu"


def _check_int(name: str, value, low: int, hint: str = ""):
  if not _is_int(value) or value < low:
    raise FlexDraftError(f"{name} must be an integer >= {low}{hint}, got {value!r}")


def _check_positions(name: str, value):
  if value is not None and value > MAX_POSITIONS:
    raise FlexDraftError(f"{name}={value} is beyond any model's context (positions "
                         f"are int32: at most {MAX_POSITIONS})")


def parse_flex_threshold(value, name: str = "flex_threshold"):
  """B* from a flag or config value: 'auto', or an integer (a string of one)."""
  if isinstance(value, str) and value != "auto":
    try:
      return int(value)
    except ValueError:
      raise FlexDraftError(f"{name} must be 'auto' or an integer, got {value!r}") from None
  return value


@dataclasses.dataclass(frozen=True)
class SpecOptions:
  """How the speculative modes draft and verify (`generate(speculation=...)`)."""
  block_size: Optional[int] = None  # a smaller mask block than trained (None: trained)
  verify_len: Optional[int] = None  # k: verify at most k - 1 drafts (None: block size)
  threshold: float = 0.0            # selective verification θ (0 keeps every group)
  strategy: str = "cumulative_product"
  flex_threshold: object = "auto"   # B*: an int, or "auto" (times the modes)
  draft_dtype: str = "auto"         # see DRAFT_DTYPES; outputs never change
  cost_cache: object = "default"    # flex's step-cost file (step_costs.cost_cache_path)
  calibrate: bool = True            # False: drafts without the bonus calibration (ablation)
  group_buckets: tuple = ()         # verify lengths that compile (() -> 2, 3, 4, 8, …)
  # N > 0: sequential steps verify a draft tree of N nodes (the bonus and N - 1
  # drafts, decoding/tree.py) instead of a chain; None: the chain
  tree_budget: Optional[int] = None

  def __post_init__(self):
    if self.block_size is not None:
      _check_int("block_size", self.block_size, 2)
    if self.verify_len is not None:
      _check_int("verify_len", self.verify_len, 2)
    if self.tree_budget is not None:
      _check_int("tree_budget", self.tree_budget, 2, " (unset: a chain)")
    t = self.threshold
    if not isinstance(t, numbers.Real) or isinstance(t, bool) or not 0.0 <= t <= 1.0:
      raise FlexDraftError(f"threshold θ must be in [0, 1], got {t}")
    if self.strategy not in verify.STRATEGIES:
      raise FlexDraftError(f"strategy must be one of {verify.STRATEGIES}, "
                           f"got {self.strategy!r}")
    if self.flex_threshold != "auto" and (
        not _is_int(self.flex_threshold) or self.flex_threshold < 0):
      raise FlexDraftError(
          f"flex threshold must be 'auto' or an integer >= 0, got {self.flex_threshold!r}")
    if self.draft_dtype not in DRAFT_DTYPES:
      raise FlexDraftError(f"draft_dtype must be one of {DRAFT_DTYPES}, "
                           f"got {self.draft_dtype!r}")


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
  """How a request runs (`generate(runtime=...)`); outputs never depend on it."""
  batch_size: Optional[int] = None  # prompts decoded together (None: all at once)
  max_len: Optional[int] = None     # the KV cache's length (None: what the request needs)
  attn_impl: str = "xla"            # see ATTN_IMPLS
  steps_per_call: int = 16          # speculative steps per device loop

  def __post_init__(self):
    if self.batch_size is not None:
      _check_int("batch_size", self.batch_size, 1, " (unset: all prompts in one batch)")
    if self.max_len is not None:
      _check_int("max_len", self.max_len, 2)
      _check_positions("max_len", self.max_len)
    if self.attn_impl not in ATTN_IMPLS:
      raise FlexDraftError(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
    _check_int("steps_per_call", self.steps_per_call, 1)


GROUPS = (("sampling", SamplingParams), ("speculation", SpecOptions),
          ("runtime", RuntimeOptions))


def python_name(name: str) -> str:
  """How `generate` spells an option: `speculation.block_size`, `max_new_tokens`."""
  for group, cls in GROUPS:
    if name in {f.name for f in dataclasses.fields(cls)}:
      return f"{group}.{name}"
  return name


def check_prompts(prompts) -> list:
  """`prompts` as a list of str / id sequences, or a one-line error naming the
  first one that is neither (bytes, a number, float ids, a flat id list)."""
  if isinstance(prompts, (bytes, bytearray)):
    raise FlexDraftError("prompts are bytes: pass text (str) or lists of token ids")
  if isinstance(prompts, str):
    return [prompts]
  try:
    prompts = list(prompts)
  except TypeError:
    raise FlexDraftError(f"prompts must be a list of strings or of token-id lists, "
                         f"got {type(prompts).__name__}") from None
  if not prompts:
    raise FlexDraftError("no prompts given")
  if all(_is_int(p) for p in prompts):
    raise FlexDraftError(f"prompts is a flat list of {len(prompts)} ids: pass a list "
                         "of prompts, e.g. [[1, 2, 3]] for one prompt of ids")
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      continue
    if isinstance(p, (bytes, bytearray)):
      raise FlexDraftError(f"prompt {i} is bytes: pass text (str) or a list of token ids")
    if isinstance(p, (numbers.Number, dict)) or not hasattr(p, "__iter__"):
      raise FlexDraftError(f"prompt {i} is {type(p).__name__} {p!r}: a prompt is "
                           "text (str) or a list of token ids")
    bad = next((t for t in p if not _is_int(t)), None)
    if bad is not None:
      raise FlexDraftError(f"prompt {i} has a token id that is not an integer: {bad!r}")
  return prompts


def check_stop(stop):
  """`stop` is None or a list of token ids / single-token strings."""
  if stop is None:
    return
  if isinstance(stop, (str, bytes, numbers.Number)) or not hasattr(stop, "__iter__"):
    raise FlexDraftError(f"stop must be a list of token ids or single-token strings, "
                         f"got {type(stop).__name__} {stop!r} (e.g. stop=[{stop!r}])")
  bad = next((s for s in stop if not (_is_int(s) or isinstance(s, str))), None)
  if bad is not None:
    raise FlexDraftError(f"a stop token must be an integer id or a string, got {bad!r}")


def check_options(*, mode="ar", max_new_tokens=128, sampling=SamplingParams(),
                  speculation=SpecOptions(), runtime=RuntimeOptions(), stop=None) -> Mode:
  """Every check of `generate`'s options that needs no model (run before loading
  one; each group checked itself when made); returns the Mode."""
  if mode not in MODES:
    raise FlexDraftError(f"mode must be one of {MODES}, got {mode!r}")
  _check_int("max_new_tokens", max_new_tokens, 1)
  _check_positions("max_new_tokens", max_new_tokens)
  for (name, cls), value in zip(GROUPS, (sampling, speculation, runtime)):
    if not isinstance(value, cls):
      raise FlexDraftError(f"{name} must be a {cls.__name__}, got "
                           f"{type(value).__name__} {value!r} (e.g. {name}={cls.__name__}())")
  check_stop(stop)
  return Mode(mode)


def ignored_options(*, mode="ar", sampling=SamplingParams(), speculation=SpecOptions(),
                    drafter=None, parallel_drafter=None, spell=python_name) -> list:
  """One line per option given that has no effect with the others (they
  would otherwise be ignored silently). `spell` names an option (CLI flags)."""
  sp, so, out = sampling, speculation, []
  if mode == Mode.AR:
    for name in ("block_size", "verify_len", "threshold", "tree_budget"):
      if getattr(so, name):
        out.append(f"{spell(name)}={getattr(so, name)} has no effect in mode 'ar' "
                   "(no drafts)")
    if drafter is not None:
      out.append(f"mode 'ar' does not use the drafter ({spell('drafter')})")
    if so.draft_dtype != "auto":
      out.append(f"{spell('draft_dtype')}={so.draft_dtype} has no effect in mode 'ar' "
                 "(no drafts)")
  if so.tree_budget and mode == Mode.SEQUENTIAL:
    for name in ("verify_len", "threshold"):  # every step verifies the whole tree
      if getattr(so, name):
        out.append(f"{spell(name)}={getattr(so, name)} has no effect with "
                   f"{spell('tree_budget')} in mode 'sequential' (each step verifies "
                   "the whole tree)")
  if parallel_drafter is not None and mode not in (Mode.PARALLEL, Mode.FLEX):
    out.append(f"mode {str(mode)!r} does not use the parallel drafter "
               f"({spell('parallel_drafter')}): only 'parallel' and 'flex' do")
  if mode != Mode.FLEX and so.flex_threshold != "auto":
    out.append(f"{spell('flex_threshold')} has no effect in mode {str(mode)!r}")
  if sp.draft_sampling and sp.greedy:
    out.append(f"{spell('draft_sampling')} has no effect at temperature 0 (greedy "
               "decoding drafts and keeps the argmax)")
  for name in ("top_k", "top_p"):
    if getattr(sp, name) is not None and sp.greedy:
      out.append(f"{spell(name)}={getattr(sp, name)} has no effect at temperature 0 "
                 "(greedy decoding keeps the argmax)")
  return out
