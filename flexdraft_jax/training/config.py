"""The shared shape of a training config; configs/*.py fill it in.

Paths default to `$FLEXDRAFT_DATA` (else `<repo>/../shared/data`) for prompt
files and `$FLEXDRAFT_RUNS` (else `<repo>/../runs`) for regenerated data and
the questions the target wrote (self_instruct).
"""

from __future__ import annotations

import math
import numbers
import os

import ml_collections

from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.paths import data_root, runs_root

MATH_SUFFIX = ("\n\nSolve the problem step by step, then give the final answer "
               "as `Final Answer: \\boxed{N}`.")
CODE_SUFFIX = "\n\nWrite the solution as one markdown code block."


def base_config(name: str) -> ml_collections.ConfigDict:
  """Defaults every config starts from (sized for a small CPU run)."""
  root = data_root()
  c = ml_collections.ConfigDict()
  c.name = name
  c.target = "smollm2-135m"       # a model.loading spec, or random:NAME[:SEED]
  c.dtype = "float32"             # target compute dtype (fp32 is fastest on CPU)

  c.drafter = ml_collections.ConfigDict(dict(
      num_layers=4, block_size=16, calib_rank=256, calib_tied=False,
      draft_vocab=0, per_slot_mask=False, bonus_input=False,
      # > 0 (with bonus_input): that fraction of blocks trains blind, so the
      # drafter serves parallel mode too (DrafterConfig.bonus_dropout)
      bonus_dropout=0.0))

  c.data = ml_collections.ConfigDict()
  c.data.regen_dir = os.path.join(runs_root(), "regen", name)
  # A packed regenerated dataset (regen_store.pack_regen) to start from: unpacked into
  # regen_dir by `train` and `regenerate` (which then answers the rest).
  c.data.packed = ""
  # Training visits a source's answers this many times an epoch (default 1),
  # e.g. {"gsm8k": 2} to lean on math; 0 leaves a source out.
  c.data.source_weights = ml_collections.ConfigDict(dict(
      gsm8k=1, mbpp=1, arena_hard_v01=1, arena_hard_v20=1, self_instruct=1))
  # ... and an answer to a prompt variant (prompt_mix.VARIANTS) that many times more,
  # e.g. {"bench": 2}: the benchmarks' own instructions, whose answers are the
  # ones online τ is measured on.
  c.data.variant_weights = ml_collections.ConfigDict(dict(bench=1, fn=1, doc=1))
  c.data.mix = ml_collections.ConfigDict(dict(
      gsm8k=400, mbpp=200, arena_hard_v01=100, arena_hard_v20=100, self_instruct=0))
  c.data.paths = ml_collections.ConfigDict(dict(
      gsm8k=os.path.join(root, "gsm8k", "train.jsonl"),
      mbpp=os.path.join(root, "mbpp", "mbpp.jsonl"),
      arena_hard_v01=os.path.join(root, "arena_hard", "question_v0.1.jsonl"),
      arena_hard_v20=os.path.join(root, "arena_hard", "question_v2.0.jsonl"),
      # questions the target wrote (`python -m flexdraft_jax self-instruct`)
      self_instruct=os.path.join(runs_root(), "self_instruct", f"{name}.jsonl")))
  # How `self-instruct` samples them; questions near an MT-Bench turn (an
  # evaluation set) are dropped ("" or a missing file: not checked, with a note).
  c.data.self_instruct = ml_collections.ConfigDict(dict(
      seed=0, temperature=0.8, top_p=0.95, max_new_tokens=48, batch_size=32,
      mt_bench=os.path.join(root, "mt_bench", "question.jsonl")))
  c.data.suffix = ml_collections.ConfigDict(dict(gsm8k=MATH_SUFFIX, mbpp=CODE_SUFFIX))
  c.data.chat_kwargs = ml_collections.ConfigDict()  # e.g. enable_thinking=False
  # "" (the mix as above) or a name in prompt_mix.VARIANTS: the mix's questions framed
  # another way (e.g. "bench": the benchmarks' instructions), answered as new records
  c.data.variant = ""
  c.data.seed = 0
  c.data.max_prompt_tokens = 256  # longer prompts are skipped
  c.data.max_new_tokens = 256
  c.data.batch_size = 16          # regeneration batch (one shard per batch)
  # "I/N": answer only the prompts whose uid hashes to part I of N, so N
  # processes (or hosts) regenerate one mix side by side, each into its own
  # regen_dir; "" answers them all.
  c.data.part = ""

  c.train = ml_collections.ConfigDict(dict(
      seq_len=512, batch_size=8, anchors_per_seq=4, gamma=7.0,
      # "ce": the data's token (the target's greedy one) at each mask position;
      # "kl": KL(target || drafter) over the draft vocabulary, the target's own
      # distribution read off the clean pass (so not with precomputed K/V).
      loss="ce",
      lr=1e-3, warmup_steps=50, num_steps=2000, weight_decay=0.01,
      clip_norm=1.0, b1=0.9, b2=0.95, seed=0,
      log_every=10, eval_every=100, num_eval=32, eval_batch_size=8,
      eval_anchors=0,  # anchor blocks per held-out sequence (0: anchors_per_seq)
      # Also score the held-out questions' answers to the prompt variants (the
      # benchmarks' formats; prompt_mix.VARIANTS) when the data has them.
      eval_variants=True,
      ckpt_every=100, max_to_keep=3, stop_at_step=0, attn_impl="xla",
      # Compute the deep layers' clean K/V of every sequence once and keep it in
      # host memory instead of a clean pass per step (CE loss only; memory
      # N·T·L·2·kv_size·bytes — for small targets).
      precompute_kv=False,
      # Without it, each batch is cut to its longest sequence rounded up to this
      # multiple (0: every batch seq_len wide): the clean pass in the step then
      # costs the batch's tokens, at one compiled step per width.
      width_multiple=64,
      # Where that cache lives (default WORKDIR/deep_kv). Runs that share one
      # directory share the clean pass; a cache for L layers serves any L' <= L.
      deep_kv_dir="",
      # The dtype new cache shards store ("": the compute dtype; "float16"
      # halves the disk and page cache the steps read; they cast it back).
      deep_kv_dtype="",
      # A saved drafter to start from (warm start, fresh optimizer): its mask and
      # attention as they are, calibration columns matched by token id.
      init_from="",
      # "cosine" (warm-up, then cosine to 5 % of lr at num_steps) or "constant"
      # (warm-up, then lr): a constant rate does not depend on num_steps, so a
      # run can be extended on resume without a jump in its learning rate.
      schedule="cosine",
      # With "constant": the last decay_steps steps before num_steps fall
      # linearly from lr to 0 (warm-up, stable, decay). A cool-down branch of a
      # constant-rate run: copy a checkpoint into a new workdir and resume it
      # with num_steps = that step + decay_steps. 0: no decay.
      decay_steps=0,
      # > 0 (e.g. 0.998): the drafter that is scored, exported and returned is an
      # exponential moving average of the trained weights (started at the initial
      # ones); the checkpoint keeps both. 0: the trained weights themselves.
      ema_decay=0.0,
      # > 0: the run stops after the first step that ends this many minutes
      # after `train` began (target load, compiles and a warm start's first
      # eval included; with several processes, the first logged step past
      # it), as if it had reached num_steps there: a last eval,
      # checkpoint and the exports. A run with a time budget ends on time;
      # rerunning the command resumes it.
      max_minutes=0.0))

  c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1))
  c.distributed = ml_collections.ConfigDict(dict(
      coordinator="", num_processes=1, process_id=0))
  return c


def _need(ok: bool, name: str, rule: str, value) -> None:
  if not ok:
    raise FlexDraftError(f"--config.{name} must be {rule}, got {value!r}")


def _int(section, name: str, low: int, prefix: str) -> None:
  v = section[name]
  _need(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= low,
        f"{prefix}.{name}", f"an integer >= {low}", v)


def check_data_config(dc) -> None:
  """Range checks of `config.data` that need no model (run before loading one)."""
  from flexdraft_jax.training.prompt_mix import SOURCES
  for name, low in (("batch_size", 1), ("max_new_tokens", 1), ("max_prompt_tokens", 1)):
    _int(dc, name, low, "data")
  for source, count in dict(dc.mix).items():
    _need(source in SOURCES, f"data.mix.{source}", f"one of {', '.join(SOURCES)}", source)
    _need(isinstance(count, int) and count >= -1, f"data.mix.{source}",
          "an integer >= -1 (-1: all)", count)
  from flexdraft_jax.training.prompt_mix import VARIANTS
  variant = dc.variant
  _need(variant == "" or variant in VARIANTS, "data.variant",
        f"'' or one of {', '.join(VARIANTS)}", variant)
  part = dc.part
  _need(part == "" or parse_part(part) is not None, "data.part",
        "'' or 'I/N' with 0 <= I < N", part)


def parse_part(part: str):
  """"I/N" -> (I, N) with 0 <= I < N; None when it is not that."""
  i, sep, n = str(part).partition("/")
  if not (sep and i.isdigit() and n.isdigit()) or not 0 <= int(i) < int(n):
    return None
  return int(i), int(n)


def check_train_config(config) -> None:
  """Range checks of `config.train` and `config.drafter` that need no model."""
  tc, dc = config.train, config.drafter
  for name, low in (("num_layers", 1), ("block_size", 2), ("calib_rank", 1),
                    ("draft_vocab", 0)):
    _int(dc, name, low, "drafter")
  for name, low in (("batch_size", 1), ("anchors_per_seq", 1), ("num_steps", 1),
                    ("warmup_steps", 0), ("log_every", 1), ("eval_every", 0),
                    ("num_eval", 0), ("eval_batch_size", 1), ("eval_anchors", 0),
                    ("ckpt_every", 1), ("max_to_keep", 1), ("stop_at_step", 0),
                    ("width_multiple", 0)):
    _int(tc, name, low, "train")
  _int(tc, "seq_len", dc.block_size + 2, "train")
  p = dc.bonus_dropout
  _need(isinstance(p, numbers.Real) and 0 <= p <= 1 and (p == 0 or dc.bonus_input),
        "drafter.bonus_dropout", "in [0, 1], and 0 without drafter.bonus_input", p)
  for name in ("lr", "gamma"):
    v = tc[name]
    _need(isinstance(v, numbers.Real) and math.isfinite(v) and v > 0, f"train.{name}",
          "a finite number > 0", v)
  _need(tc.loss in ("ce", "kl"), "train.loss", "'ce' or 'kl'", tc.loss)
  _need(tc.loss == "ce" or not tc.precompute_kv, "train.loss",
        "'ce' with train.precompute_kv (the kl loss reads the target's distribution "
        "off the clean pass in the step)", tc.loss)
  _need(tc.schedule in ("cosine", "constant"), "train.schedule",
        "'cosine' or 'constant'", tc.schedule)
  decay = tc.decay_steps
  _need(isinstance(decay, numbers.Integral) and not isinstance(decay, bool)
        and 0 <= decay <= tc.num_steps - tc.warmup_steps,
        "train.decay_steps",
        f"an integer in [0, num_steps - warmup_steps = {tc.num_steps - tc.warmup_steps}]",
        decay)
  _need(not decay or tc.schedule == "constant", "train.decay_steps",
        "0 unless train.schedule is 'constant' (cosine decays already)", decay)
  minutes = tc.max_minutes
  _need(isinstance(minutes, numbers.Real) and not isinstance(minutes, bool)
        and minutes >= 0, "train.max_minutes", "a number >= 0 (0: no limit)", minutes)
  ema = tc.ema_decay
  _need(isinstance(ema, numbers.Real) and 0 <= ema < 1, "train.ema_decay",
        "a number in [0, 1)", ema)
  kv_dtype = tc.deep_kv_dtype
  _need(kv_dtype in ("", "float32", "float16"), "train.deep_kv_dtype",
        "'', 'float32' or 'float16'", kv_dtype)


def qwen3_config(name: str, env_var: str, default_path: str, num_layers: int):
  """The Qwen3 recipe on an accelerator host (bf16, thinking disabled, long
  answers); the sizes differ only in the target path and L."""
  c = base_config(name)
  c.target = os.environ.get(env_var, default_path)
  c.dtype = "bfloat16"
  c.drafter.num_layers = num_layers
  c.drafter.block_size = 16
  c.drafter.calib_rank = 256
  c.data.mix = dict(gsm8k=-1, mbpp=-1, arena_hard_v01=-1, arena_hard_v20=-1,
                    self_instruct=0)
  c.data.chat_kwargs = dict(enable_thinking=False)
  c.data.max_prompt_tokens = 1024
  c.data.max_new_tokens = 1024
  c.data.batch_size = 64
  c.train.seq_len = 2048
  c.train.batch_size = 32
  c.train.anchors_per_seq = 16
  c.train.lr = 6e-4
  c.train.warmup_steps = 500
  c.train.num_steps = 20000
  c.train.log_every = 20
  c.train.eval_every = 1000
  c.train.ckpt_every = 1000
  c.train.num_eval = 128
  c.train.eval_batch_size = 32
  return c
