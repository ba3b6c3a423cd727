"""Adds the n-gram prior (`drafter.ngram`) to a trained drafter.

  python -m flexdraft_jax add-ngram \\
      --drafter=flexdraft_jax/drafters/smollm2_135m_L8 --out=runs/ngram/drafter

Counts the bigrams and trigrams of the config's regenerated answers (the
training split: `train.num_eval` held-out answers are left out, so that
the held-out τ stays held out), stores them with the
drafter and sets the prior's weights: `--weight` λ on the data's n-gram PMI,
`--context_trigram` / `--context_bigram` on an n-gram occurring in the row's
own text, `--top` candidates re-scored per slot — or, with `--grid=λ:μ3:μ2,…`,
the setting with the best walk τ on the held-out answers. The drafter's weights
are untouched. Score it with `python -m flexdraft_jax offline-tau --drafters=OUT`.
"""

from __future__ import annotations

import dataclasses


def _define_flags(argv) -> tuple:
  """Defines this command's flags; returns their names."""
  from absl import flags
  from ml_collections import config_flags
  names = ("drafter", "out", "weight", "context_trigram", "context_bigram", "smoothing_bi",
           "smoothing_tri", "top", "grid", "max_new_tokens", "config")
  for name in list(flags.FLAGS):
    if name in names or name.startswith("config."):
      delattr(flags.FLAGS, name)
  flags.DEFINE_string("drafter", "flexdraft_jax/drafters/smollm2_135m_L8", "the trained drafter")
  flags.DEFINE_string("out", "runs/ngram/drafter", "where the drafter with its prior goes")
  flags.DEFINE_float("weight", 0.2, "λ: the data n-gram PMI's weight (0, and no --grid λ: "
                     "no tables)")
  flags.DEFINE_float("context_trigram", 3.0, "μ3: bias where the trigram occurs in the row")
  flags.DEFINE_float("context_bigram", 2.0, "μ2: bias where the bigram occurs in the row")
  flags.DEFINE_float("smoothing_bi", 1.0, "additive smoothing of the bigram toward the unigram")
  flags.DEFINE_float("smoothing_tri", 2.0, "additive smoothing of the trigram toward the bigram")
  flags.DEFINE_integer("top", 32, "candidates re-scored per slot")
  flags.DEFINE_list("grid", [], "λ:μ3:μ2 settings to score on the held-out answers (walk τ, "
                    "first --max_new_tokens tokens); the best one is saved instead of the flags'")
  flags.DEFINE_integer("max_new_tokens", 128, "answer tokens scored per held-out answer")
  config_flags.DEFINE_config_file(
      "config", "configs/smollm2_135m.py",
      "the training config: its data (packed, regen_dir) and train.num_eval",
      sys_argv=list(argv))
  return names


def _portable(path: str) -> str:
  """`path` relative to the working directory where it lies under it: the drafter's
  record should not name one machine's directories."""
  import os
  rel = os.path.relpath(os.path.abspath(path))
  return path if rel.startswith("..") else rel


GRID_FORMAT = ("each --grid setting is λ:μ3:μ2, three finite numbers (e.g. "
               "--grid=0.2:3:2,0.4:3:2)")


def parse_grid(settings) -> list:
  """The `--grid` settings as (λ, μ3, μ2) float triples, or one line naming the
  first one that is not three finite numbers."""
  import math
  from flexdraft_jax.model.config import FlexDraftError
  out = []
  for setting in settings:
    try:
      values = tuple(float(x) for x in setting.split(":"))
    except ValueError:
      values = ()
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
      raise FlexDraftError(f"{GRID_FORMAT}, got {setting!r}")
    out.append(values)
  return out


def _best_on_held_out(target, drafter, held):
  """The drafter config of the `--grid` setting with the best walk τ on the
  held-out records."""
  from absl import flags
  from flexdraft_jax.training import offline_tau
  FLAGS = flags.FLAGS
  prompts = [list(r.prompt_ids) for r in held]
  answers = [list(r.answer_ids[:FLAGS.max_new_tokens]) for r in held]
  print("| λ | μ3 | μ2 | held-out walk τ | acc 1 | acc 2 | acc 3 | acc 4 |\n"
        "|---|---|---|---|---|---|---|---|", flush=True)
  best = None
  for lam, mu3, mu2 in parse_grid(FLAGS.grid):
    dcfg = dataclasses.replace(drafter.config, ngram_weight=lam, context_trigram=mu3,
                               context_bigram=mu2)
    r = offline_tau.score(target, drafter._replace(config=dcfg), prompts, answers,
                          FLAGS.max_new_tokens)
    print(f"| {lam:g} | {mu3:g} | {mu2:g} | {r['walk_tau']:.3f} | "
          + " | ".join(f"{a:.3f}" for a in r["acc"]) + " |", flush=True)
    if best is None or r["walk_tau"] > best[0]:
      best = (r["walk_tau"], dcfg)
  return best[1]


def check_out(out: str) -> None:
  """`--out` is a drafter folder to write or replace: an empty folder or one
  that does not exist yet, or an earlier drafter (replaced, as training
  replaces its own, its other files kept). Anything else there (a file, a
  folder of other things) is refused in one line: it would be deleted."""
  import os
  from flexdraft_jax.drafter import checkpoint
  from flexdraft_jax.model.config import FlexDraftError
  if not out:
    raise FlexDraftError("--out is required (the drafter folder to write)")
  if not os.path.lexists(out):
    from flexdraft_jax.cli_util import check_can_write
    check_can_write(out, "--out")  # now, not after the counting
    return
  if os.path.isdir(out) and not os.listdir(out):
    return
  what = "a file" if not os.path.isdir(out) else "a folder that holds no drafter"
  try:
    checkpoint.read_meta(out)
  except FlexDraftError:
    raise FlexDraftError(f"--out {out} is {what}: add-ngram writes a drafter folder and "
                         "replaces only an earlier drafter; pass another --out") from None


def main(argv):
  import math
  import os
  from absl import flags
  from flexdraft_jax.model.config import FlexDraftError
  if len(argv) > 1:
    raise FlexDraftError(f"unexpected arguments: {' '.join(argv[1:])}")
  FLAGS = flags.FLAGS
  for name in ("weight", "context_trigram", "context_bigram", "smoothing_bi",
               "smoothing_tri"):
    if not math.isfinite(FLAGS[name].value):
      raise FlexDraftError(f"--{name} must be a finite number, got {FLAGS[name].value}")
  check_out(FLAGS.out)
  grid = parse_grid(FLAGS.grid)  # before anything loads
  import numpy as np
  import flexdraft_jax as fd
  from flexdraft_jax.drafter import checkpoint, ngram
  from flexdraft_jax.drafter.model import Drafter
  from flexdraft_jax.evaluation import plan
  from flexdraft_jax.training import data, regen_store
  config = FLAGS.config
  target = fd.load_target(config.target)
  src = plan.resolve_path(FLAGS.drafter)
  drafter = fd.load_drafter(src, target)
  print(f"add_ngram: {src} -> {FLAGS.out}", flush=True)
  dcfg = dataclasses.replace(
      drafter.config, ngram_weight=FLAGS.weight, context_trigram=FLAGS.context_trigram,
      context_bigram=FLAGS.context_bigram, ngram_smoothing_bi=FLAGS.smoothing_bi,
      ngram_smoothing_tri=FLAGS.smoothing_tri, rescore_top=FLAGS.top,
      ngram_bigrams=0, ngram_contexts=0, ngram_trigrams=0)
  params = {k: v for k, v in drafter.params.items() if k != "ngram"}
  record = {"weight": FLAGS.weight, "context_trigram": FLAGS.context_trigram,
            "context_bigram": FLAGS.context_bigram, "top": FLAGS.top}
  if FLAGS.weight or FLAGS.grid:
    regen_store.use_packed(config.data)
    train, held = data.split_eval(regen_store.load_records(config.data.regen_dir),
                                  config.train.num_eval)
  if FLAGS.weight or any(lam for lam, _, _ in grid):
    vocab = (np.asarray(params["vocab"]) if "vocab" in params
             else np.arange(target.config.vocab_size))
    tables = ngram.build_tables(
        [np.concatenate([r.prompt_ids[-2:], r.answer_ids]) for r in train], vocab,
        target.config.vocab_size)
    dcfg = dataclasses.replace(dcfg, ngram_bigrams=len(tables["bi_key"]),
                               ngram_contexts=len(tables["ctx_key"]),
                               ngram_trigrams=len(tables["tri_key"]))
    params["ngram"] = tables
    source = config.data.packed or config.data.regen_dir
    record.update(answers=len(train), data=_portable(source),
                  bigrams=dcfg.ngram_bigrams, trigrams=dcfg.ngram_trigrams)
    print(f"add_ngram: {len(train)} answers: {dcfg.ngram_bigrams} bigrams, "
          f"{dcfg.ngram_contexts} two-token contexts, {dcfg.ngram_trigrams} trigrams",
          flush=True)
  dcfg.validate(target.config)
  if FLAGS.grid:
    dcfg = _best_on_held_out(target, Drafter(dcfg, params, drafter.target_fingerprint), held)
    record.update(weight=dcfg.ngram_weight, context_trigram=dcfg.context_trigram,
                  context_bigram=dcfg.context_bigram, chosen_on="held-out walk τ")
  meta = checkpoint.read_meta(src)
  out = Drafter(dcfg, params, drafter.target_fingerprint)
  checkpoint.save_drafter(FLAGS.out, out, target,
                          training=dict(meta.get("training", {}), ngram=record))
  print(f"add_ngram: wrote {os.path.abspath(FLAGS.out)}", flush=True)


def run(argv):
  """Entry from `python -m flexdraft_jax add-ngram`."""
  from flexdraft_jax import cli_util
  names = _define_flags(argv)
  cli_util.run_main(main, argv, doc=__doc__, key_flags=names)
