"""Offline τ of drafters on the benchmarks' own answers: what online τ will read.

  python -m flexdraft_jax offline-tau \\
      --drafters=flexdraft_jax/drafters/smollm2_135m,flexdraft_jax/drafters/smollm2_135m_L8 \\
      --datasets=gsm8k,humaneval,mbpp --limit=64 --max_new_tokens=128

Training's held-out τ scores answers to the training mix's prompts; online τ on
benchmark prompts reads lower (the benchmarks' instructions, other questions).
This command answers the first `--limit` prompts of each benchmark greedily with
the target (chat template, `--max_new_tokens`, stops on; cached in `--answers`,
so each drafter after the first costs only its offline pass) and scores every
drafter on those answers with the trainer's own loss code, at every anchor:

  uniform τ  the mean over all anchors (what training's eval reports), and
  walk τ     the τ sequential decoding would read (`loss.walk_tau`: from the
             first anchor each step moves on by its τ) — within 0.02 of the
             online sweep on GSM8K, HumanEval and MBPP (64 prompts each;
             docs/experiments.md), where the uniform mean reads 0.17–0.32 higher.

Drafters can be compared here in minutes instead of a sweep's half hour.
`--blind` scores parallel mode's drafting instead (slot 0 blind, the bonus read
by calibration and the n-gram prior only).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np


def benchmark_answers(target, name: str, data_dir: str, *, limit: int,
                      max_new_tokens: int, batch_size: int, cache: str,
                      temperature: float = 0.0) -> dict:
  """{"prompts": [...], "answers": [...]} token ids of the target's greedy answers
  (`temperature` > 0: answers sampled at that temperature, seed 0) to the first
  `limit` prompts of benchmark `name`, from the JSON file `cache` or answered
  now (and added to it). The cache is keyed by these settings and the target;
  a benchmark whose prompts differ from the cached ones is answered anew."""
  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import benchmarks
  key = f"{name}/{limit}/{max_new_tokens}/{target.fingerprint}"
  if temperature > 0:
    key += f"/T={temperature:g}"
  kw = benchmarks.chat_kwargs(target)
  rows = benchmarks.load_benchmark(name, data_dir, limit)
  prompts = [benchmarks.render(target.tokenizer, benchmarks.messages_for_turn(r, []), kw)
             for r in rows]
  cached = read_answers(cache)
  if key in cached and cached[key]["prompts"] != prompts:
    # the same benchmark name, other prompts (another --data_dir, an edited file):
    # their answers are kept apart, under the digest of the prompts
    key += "/prompts=" + hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
  if key in cached:
    return cached[key]
  how = f"sampled at T = {temperature:g}" if temperature > 0 else "greedy"
  print(f"{name}: answering {len(prompts)} prompts (AR, {how}, batch {batch_size})",
        flush=True)
  out = fd.generate(target, prompts, max_new_tokens=max_new_tokens, seed=0,
                    sampling=fd.SamplingParams(temperature=temperature),
                    runtime=fd.RuntimeOptions(batch_size=batch_size))
  cached[key] = {"prompts": prompts, "answers": [list(map(int, a)) for a in out.token_ids]}
  os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
  with open(cache + ".tmp", "w") as f:
    json.dump(cached, f)
  os.replace(cache + ".tmp", cache)
  return cached[key]


def read_answers(cache: str) -> dict:
  """The answers cache `cache` ({} when there is none); a file that is not one
  (another program's, broken JSON, a folder) is refused in one line and left as
  it is: the answers are added to it and it is written over."""
  from flexdraft_jax.model.config import FlexDraftError
  if not os.path.lexists(cache):
    return {}
  try:
    with open(cache) as f:
      cached = json.load(f)
  except (OSError, ValueError) as e:
    raise FlexDraftError(f"--answers {cache} is not an answers cache this can read "
                         f"({type(e).__name__}: {e}); it is left as it is: pass another "
                         "--answers") from None
  if not (isinstance(cached, dict) and all(
      isinstance(v, dict) and {"prompts", "answers"} <= set(v) for v in cached.values())):
    raise FlexDraftError(f"--answers {cache} is not an answers cache (it holds a JSON "
                         f"{type(cached).__name__} of other records); it is left as it is: "
                         "pass another --answers")
  return cached


def answer_batch(prompt: list, answer: list, max_new_tokens: int, dcfg,
                 blind: bool = False):
  """A loss batch of one answer with an anchor block at every answer token
  (anchor i: the block whose bonus is answer token i), padded to the anchors
  of `max_new_tokens` so that every answer shares one shape; None for an empty
  answer. `blind`: every block drafts before its bonus is known."""
  import jax.numpy as jnp
  from flexdraft_jax.util import round_up
  if len(answer) < 1:
    return None
  K = round_up(max_new_tokens, 16)  # anchors per answer, padded: one shape
  p, a = list(prompt), list(answer)
  toks = p + a
  T = round_up(len(p) + K + dcfg.block_size + 1, 64)
  anchor = np.full((K,), len(p) - 1)
  anchor[:len(a)] = np.arange(len(p) - 1, len(toks) - 1)
  ok = np.arange(K) < len(a)
  batch = {"tokens_BxT": jnp.asarray([toks + [0] * (T - len(toks))], jnp.int32),
           "length_B": jnp.asarray([len(toks)], jnp.int32),
           "anchor_BxK": jnp.asarray(anchor[None], jnp.int32),
           "anchor_ok_BxK": jnp.asarray(ok[None])}
  if blind:
    batch["blind_BxK"] = jnp.ones((1, K), bool)
  return batch


def score(target, drafter, prompts: list, answers: list, max_new_tokens: int = 128,
          blind: bool = False) -> dict:
  """Uniform and walk τ, per-slot accuracy of `drafter` over the answers (each
  at most `max_new_tokens` long). `blind`: drafting as parallel mode does, in
  the verify forward, before the bonus is known (a drafter's bonus input then
  unread; calibration and the n-gram prior still read the bonus)."""
  import jax
  from flexdraft_jax.training import loss as loss_lib
  cfg, dcfg = target.config, drafter.config
  fn = jax.jit(lambda dp, tp, b: loss_lib.loss_sums(dp, tp, cfg, dcfg, b,
                                                    per_anchor=True)[1])
  tau_sum = anchors = walk_tokens = walk_steps = 0
  correct = n_slot = 0
  for p, a in zip(prompts, answers):
    batch = answer_batch(p, a, max_new_tokens, dcfg, blind)
    if batch is None:
      continue
    s = jax.device_get(fn(drafter.params, target.params, batch))
    tau_sum += float(s["tau_sum"])
    anchors += float(s["n_anchor"])
    tokens, steps = loss_lib.walk_tau(s["tau_BxK"][0][:len(a)])
    walk_tokens, walk_steps = walk_tokens + tokens, walk_steps + steps
    correct, n_slot = correct + s["correct_S"], n_slot + s["n_slot_S"]
  acc = correct / np.maximum(n_slot, 1)
  return {"uniform_tau": tau_sum / max(anchors, 1), "walk_tau": walk_tokens / max(walk_steps, 1),
          "acc": [float(x) for x in acc[1:5]], "anchors": int(anchors)}


def table_header(first: str, second: str, count: str) -> str:
  """The markdown header of a score table (one row per drafter and slice)."""
  return (f"| {first} | {second} | {count} | anchors | uniform τ | walk τ | acc 1 | acc 2 "
          "| acc 3 | acc 4 |\n|---|---|---|---|---|---|---|---|---|---|")


def table_row(first: str, second: str, count: int, r: dict) -> str:
  accs = " | ".join(f"{x:.3f}" for x in r["acc"])
  return (f"| {first} | {second} | {count} | {r['anchors']} | {r['uniform_tau']:.3f} | "
          f"{r['walk_tau']:.3f} | {accs} |")


FLAG_NAMES = ("drafters", "datasets", "limit", "max_new_tokens", "batch_size", "answers",
              "data_dir", "model", "blind")


def define_flags(names) -> None:
  """(Re)defines offline-tau's flags (FLAG_NAMES) on absl's FLAGS, at their
  defaults, after removing every flag in `names` (a process may run several
  commands); offline-accept defines its own beside them."""
  from absl import flags
  for name in names:
    if name in flags.FLAGS:
      delattr(flags.FLAGS, name)
  flags.DEFINE_list("drafters", ["flexdraft_jax/drafters/smollm2_135m_L8"],
                    "drafter directories")
  flags.DEFINE_list("datasets", ["gsm8k", "humaneval", "mbpp"], "benchmarks")
  flags.DEFINE_integer("limit", 64, "prompts per benchmark (the first ones; -1: all)")
  flags.DEFINE_integer("max_new_tokens", 128, "answer tokens per prompt")
  flags.DEFINE_integer("batch_size", 16, "AR batch that answers the prompts")
  flags.DEFINE_string("answers", "", "cache of the target's answers (default: "
                      "offline_tau/answers.json under $FLEXDRAFT_RUNS, else ../runs beside "
                      "the checkout)")
  flags.DEFINE_string("data_dir", "", "benchmark files (default: $FLEXDRAFT_DATA, else "
                      "../shared/data)")
  flags.DEFINE_string("model", "smollm2-135m", "the target the drafters belong to")
  flags.DEFINE_bool("blind", False, "score drafting as parallel mode does, before the "
                    "bonus is known (a drafter's bonus input unread)")


def prepare(FLAGS, command: str, temperatures=(0.0,)):
  """(target, {dataset: answers}) for the parsed flags, every check that needs
  no model first (the drafters' directories and files, `--limit`, `--datasets`,
  the answers cache): bad input is one line before the target answers anything. With
  several `temperatures`, {T: {dataset: answers at T}}."""
  from flexdraft_jax.drafter import checkpoint
  from flexdraft_jax.evaluation import benchmarks, plan
  from flexdraft_jax.model.config import FlexDraftError
  from flexdraft_jax.paths import data_root, runs_root
  plan.check_limit(FLAGS.limit, "--limit")
  if not FLAGS.drafters:
    raise FlexDraftError("--drafters is empty: name at least one drafter directory")
  if not FLAGS.datasets:  # printed an empty table and exited 0
    raise FlexDraftError("--datasets is empty: name at least one benchmark (e.g. "
                         "--datasets=gsm8k,humaneval,mbpp)")
  for name in FLAGS.datasets:  # an unknown one failed after the target loaded
    try:
      benchmarks.canonical_name(name)
    except FlexDraftError as e:
      raise FlexDraftError(f"--datasets: {e}") from None
  for path in FLAGS.drafters:
    if not os.path.isdir(plan.resolve_path(path)):
      raise FlexDraftError(f"--drafters: no drafter at {path} (not a directory)")
    checkpoint.read_meta(plan.resolve_path(path))  # unreadable: one line
  from flexdraft_jax.cli_util import check_can_write
  answers = FLAGS.answers or os.path.join(runs_root(), "offline_tau", "answers.json")
  read_answers(answers)
  check_can_write(answers, "--answers")  # now, not after answering the benchmarks
  print(f"{command}: the target's answers are cached in {os.path.abspath(answers)} "
        "(--answers)", flush=True)
  import flexdraft_jax as fd
  target = fd.load_target(FLAGS.model)
  data_dir = FLAGS.data_dir or data_root()
  sets = {T: {name: benchmark_answers(target, name, data_dir, limit=FLAGS.limit,
                                      max_new_tokens=FLAGS.max_new_tokens,
                                      batch_size=FLAGS.batch_size, cache=answers,
                                      temperature=T)
              for name in FLAGS.datasets} for T in temperatures}
  return target, (sets[temperatures[0]] if len(temperatures) == 1 else sets)


def run(argv):
  """Entry from `python -m flexdraft_jax offline-tau`."""
  from absl import flags

  from flexdraft_jax import cli_util
  define_flags(FLAG_NAMES)
  FLAGS = flags.FLAGS

  def main(args):
    from flexdraft_jax.model.config import FlexDraftError
    if len(args) > 1:
      raise FlexDraftError(f"unexpected arguments: {' '.join(args[1:])}")
    import flexdraft_jax as fd
    from flexdraft_jax.evaluation import plan
    target, sets = prepare(FLAGS, "offline-tau")
    print(table_header("drafter", "dataset", "prompts"), flush=True)
    for path in FLAGS.drafters:
      drafter = fd.load_drafter(plan.resolve_path(path), target)
      for name, d in sets.items():
        r = score(target, drafter, d["prompts"], d["answers"], FLAGS.max_new_tokens,
                  blind=FLAGS.blind)
        print(table_row(path + (" (blind)" if FLAGS.blind else ""), name,
                        len(d["prompts"]), r), flush=True)

  cli_util.run_main(main, argv, doc=__doc__, key_flags=FLAG_NAMES)
