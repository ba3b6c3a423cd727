"""`generate`'s options and their checks: the modes, the option groups
(`SamplingParams` in sampling.py, `SpecOptions`, `RuntimeOptions`), and the
checks of prompts and stop tokens that need no model."""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import enum
import numbers
from typing import Optional

from flexdraft_jax import checks
from flexdraft_jax.checks import check_int as _check_int
from flexdraft_jax.checks import is_int as _is_int
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
# `decode_params.resolve_draft_dtype`).
DRAFT_DTYPES = ("auto", "bfloat16", "target")
MAX_POSITIONS = 2 ** 31 - 1  # positions and lengths are int32 on the device


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
    checks.check_number("threshold θ", self.threshold, "in [0, 1]", lambda t: 0 <= t <= 1)
    checks.check_choice("strategy", self.strategy, verify.STRATEGIES)
    ft = self.flex_threshold
    if not (ft == "auto" if isinstance(ft, str) else _is_int(ft) and ft >= 0):
      got = checks.shown(ft) if isinstance(ft, str) or _is_int(ft) else checks.describe(ft)
      raise FlexDraftError(f"flex threshold must be 'auto' or an integer >= 0, got {got}")
    checks.check_choice("draft_dtype", self.draft_dtype, DRAFT_DTYPES)
    if self.cost_cache is not None:  # checked here, not when flex first writes it
      checks.check_path("cost_cache", self.cost_cache, "a file path, '' or None (the "
                        "costs in memory only), or 'default'")
    checks.check_bool("calibrate", self.calibrate)
    if isinstance(self.group_buckets, (str, bytes)) or not hasattr(self.group_buckets,
                                                                  "__iter__"):
      raise FlexDraftError(f"group_buckets must be a tuple of verify lengths (integers "
                           f">= 2), got {checks.describe(self.group_buckets)}")
    for g in self.group_buckets:
      _check_int("each of group_buckets", g, 2)
    # a tuple of ints, so that the options hash (they key compiled programs)
    object.__setattr__(self, "group_buckets", tuple(int(g) for g in self.group_buckets))


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
    checks.check_choice("attn_impl", self.attn_impl, ATTN_IMPLS)
    _check_int("steps_per_call", self.steps_per_call, 1)


GROUPS = (("sampling", SamplingParams), ("speculation", SpecOptions),
          ("runtime", RuntimeOptions))


def python_name(name: str) -> str:
  """How `generate` spells an option: `speculation.block_size`, `max_new_tokens`."""
  for group, cls in GROUPS:
    if name in {f.name for f in dataclasses.fields(cls)}:
      return f"{group}.{name}"
  return name


# Each option group as a line spells its constructor. generate() took every
# option as a keyword before the groups; such a keyword gets a line naming
# the group that holds it now (check_keywords).
_GROUP_CALLS = {"sampling": "fd.SamplingParams", "speculation": "fd.SpecOptions",
                "runtime": "fd.RuntimeOptions"}
SEED_RANGE = (-2 ** 63, 2 ** 64)  # the seeds that fit 64 bits, signed or not


def check_keywords(unknown: dict, accepted, groups=None, where: str = "generate()") -> None:
  """Refuses keywords `generate` does not take (it takes `accepted`): those of
  its earlier API (one per option, now in the option groups) get their new
  spelling, e.g. `sampling=fd.SamplingParams(temperature=0.7)`, with the
  fields set in the group objects also given (`groups`: {name: object});
  others the closest keyword it takes."""
  if not unknown:
    return
  by_group = {}
  for name, cls in GROUPS:  # the fields the caller set already, in the group's object
    given = (groups or {}).get(name)
    if isinstance(given, cls) and any(f.name in unknown for f in dataclasses.fields(cls)):
      by_group[name] = [f"{f.name}={checks.shown(getattr(given, f.name))}"
                        for f in dataclasses.fields(cls)
                        if f.name not in unknown and getattr(given, f.name) != f.default]
  for key, value in unknown.items():
    group = next((g for g, cls in GROUPS
                  if key in {f.name for f in dataclasses.fields(cls)}), None)
    if group is None:
      near = difflib.get_close_matches(key, accepted, n=1)
      raise FlexDraftError(f"{where} has no argument {key!r}"
                           + (f" (did you mean {near[0]}=?)" if near else "")
                           + f"; it takes {', '.join(accepted)}")
    by_group.setdefault(group, []).append(f"{key}={checks.shown(value)}")
  parts = [f"{g} options in {g}={_GROUP_CALLS[g]}({', '.join(kw)})"
           for g, kw in by_group.items() if kw]
  spelled = " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 2 else parts)
  old = ", ".join(f"{k}=" for k in unknown)
  raise FlexDraftError(f"{where} takes {spelled}, not {old}")


def check_seed(seed) -> None:
  """A seed is an integer that fits 64 bits, signed or unsigned (the key is
  made of its 64 bits: seed and seed + 2**64 are the same seed)."""
  if not _is_int(seed):
    raise FlexDraftError(f"seed must be an integer, got {checks.describe(seed)}")
  low, high = SEED_RANGE
  if not low <= int(seed) < high:
    raise FlexDraftError(f"seed must fit 64 bits (-2**63 <= seed < 2**64), got "
                         f"{checks.shown(seed)}")


def _unordered(x) -> bool:
  return isinstance(x, (collections.abc.Mapping, set, frozenset))


def check_prompts(prompts) -> list:
  """`prompts` as a list of str / id sequences, or a one-line error naming the
  first one that is neither (bytes, a number, float ids, a flat id list). A
  dict or a set is refused: it iterates its keys, in no order of the caller's."""
  if isinstance(prompts, (bytes, bytearray)):
    raise FlexDraftError("prompts are bytes: pass text (str) or lists of token ids")
  if isinstance(prompts, str):
    return [prompts]
  if _unordered(prompts) or not hasattr(prompts, "__iter__"):
    raise FlexDraftError(f"prompts must be a list of strings or of token-id lists, "
                         f"got {checks.describe(prompts)}")
  prompts = list(prompts)
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
    if isinstance(p, numbers.Number) or _unordered(p) or not hasattr(p, "__iter__"):
      raise FlexDraftError(f"prompt {i} is {checks.describe(p)}: a prompt is "
                           "text (str) or a list of token ids")
    bad = next((t for t in p if not _is_int(t)), None)
    if bad is not None:
      raise FlexDraftError(f"prompt {i} has a token id that is not an integer: {bad!r}")
  return prompts


def check_stop(stop):
  """`stop` is None or a list of token ids / single-token strings."""
  if stop is None:
    return
  if (isinstance(stop, (str, bytes, numbers.Number, collections.abc.Mapping))
      or not hasattr(stop, "__iter__")):
    example = f" (e.g. stop=[{stop!r}])" if isinstance(stop, (str, int)) else ""
    raise FlexDraftError(f"stop must be a list of token ids or single-token strings, "
                         f"got {checks.describe(stop)}{example}")
  bad = next((s for s in stop if not (_is_int(s) or isinstance(s, str))), None)
  if bad is not None:
    raise FlexDraftError(f"a stop token must be an integer id or a string, got {bad!r}")


def check_options(*, mode="ar", max_new_tokens=128, sampling=SamplingParams(),
                  speculation=SpecOptions(), runtime=RuntimeOptions(), stop=None,
                  chat=False, seed=0) -> Mode:
  """Every check of `generate`'s options that needs no model (run before loading
  one; each group checked itself when made); returns the Mode."""
  checks.check_choice("mode", mode, MODES)
  _check_int("max_new_tokens", max_new_tokens, 1)
  _check_positions("max_new_tokens", max_new_tokens)
  for (name, cls), value in zip(GROUPS, (sampling, speculation, runtime)):
    if not isinstance(value, cls):
      raise FlexDraftError(f"{name} must be a {cls.__name__}, got "
                           f"{checks.describe(value)} (e.g. {name}={cls.__name__}())")
  check_stop(stop)
  checks.check_bool("chat", chat)
  check_seed(seed)
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
