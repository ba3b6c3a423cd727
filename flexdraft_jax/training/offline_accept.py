"""Offline acceptance at T > 0: how well a drafter's draft distribution q
matches the target's p_T, per draft slot and temperature.

  python -m flexdraft_jax offline-accept \\
      --drafters=flexdraft_jax/drafters/smollm2_135m_L8 --datasets=gsm8k,mt_bench \\
      --limit=32 --max_new_tokens=128 --temperatures=0,0.7,1

At temperature T > 0 a draft d is accepted with probability min(1, p_T(d)/q(d))
(rejection sampling), so a slot's expected acceptance is

  point    p_T(argmax q)        argmax drafts (`draft_sampling` off), and
  sampled  Σ_v min(p_T(v), q_T(v))   drafts sampled from q_T = softmax(logits / T),
                                     as decoding samples them (`draft_sampling`).

At T = 0 both are 1 where the draft is the target's argmax (offline-tau's
per-slot accuracy). The answers are offline-tau's (the target's greedy answers
to the first `--limit` prompts of each benchmark, the same `--answers` cache)
and the drafts are scored along the trainer's own path (`loss.draft_pass`):
every answer token is an anchor, the drafter's calibrated logits carry the
n-gram prior reading the true tokens before each slot, and p_T is the target's
distribution at the same position.

τ. At an anchor, the chance that slots 1..i are all accepted is taken as
Π_{j≤i} a_j, each slot's acceptance a_j computed with the true tokens before it
(teacher forcing: the earlier drafts are taken to have been accepted as the
answer's tokens — exact at T = 0, an approximation at T > 0, where the accepted
tokens are samples of p_T rather than the greedy answer). The anchor's
expected τ is 1 + Σ_i Π_{j≤i} a_j; `uniform τ` is its mean over anchors and
`walk τ` the expected tokens per step of sequential decoding walking the
answer (from each anchor the next step starts τ tokens on; offline-tau's walk
τ, over the distribution of τ instead of its value). At T = 0 they equal
offline-tau's numbers.

`--fit_temperature` fits a draft temperature per slot for each T > 0: q_j =
softmax(logits_j / (T·r_j)) with the ratio r_j from a grid (2^(k/8), 1/4..4)
that maximises the mean Σ min(p_T, q_j) over the first half of each dataset's
prompts; the table then reports the second half, before (r = 1) and after.
"""

from __future__ import annotations

import functools
import os

import numpy as np

# Draft-temperature ratios `--fit_temperature` tries: 2^(k/8) for k = -16..16.
RATIO_GRID = tuple(float(2.0 ** (k / 8)) for k in range(-16, 17))


def expected_accept(t_logits_xV, d_logits_xW, sp, vocab_W=None, ratio=1.0):
  """(point, sampled) expected acceptance of drafts against the target for
  rows of target logits `[..., V]` and draft logits `[..., W]` (`vocab_W`: the
  draft vocabulary's ids, None: W = V). `sp`: the SamplingParams both are
  sampled under (greedy: both are 1 where the argmax draft is the target's
  argmax); `ratio`: the drafts' temperature relative to sp's (broadcasts
  against the rows)."""
  import jax.numpy as jnp
  ids = (lambda i: i) if vocab_W is None else (lambda i: jnp.take(vocab_W, i))
  draft_id = ids(jnp.argmax(d_logits_xW, axis=-1))
  if sp.greedy:
    hit = (draft_id == jnp.argmax(t_logits_xV, axis=-1)).astype(jnp.float32)
    return hit, hit
  p_xV, p_xW = target_probs(t_logits_xV, sp, vocab_W)
  point = jnp.take_along_axis(p_xV, draft_id[..., None], axis=-1)[..., 0]
  return point, sampled_accept(p_xW, d_logits_xW, sp, ratio)


def target_probs(t_logits_xV, sp, vocab_W=None):
  """p_T over the vocabulary and over the draft vocabulary's ids (not
  renormalised: the mass off it can never be matched)."""
  import jax
  import jax.numpy as jnp

  from flexdraft_jax.decoding.sampling import processed_logits
  p = jax.nn.softmax(processed_logits(t_logits_xV, sp), axis=-1)
  return p, (p if vocab_W is None else jnp.take(p, vocab_W, axis=-1))


def sampled_accept(p_xW, d_logits_xW, sp, ratio=1.0):
  """Σ min(p, q) for drafts sampled as decoding samples them: q =
  softmax(processed_logits(logits / ratio)) (`state.draft_tokens`)."""
  import jax
  import jax.numpy as jnp

  from flexdraft_jax.decoding.sampling import processed_logits
  q = jax.nn.softmax(processed_logits(d_logits_xW / jnp.asarray(ratio)[..., None], sp),
                     axis=-1)
  return jnp.sum(jnp.minimum(p_xW, q), axis=-1)


def accept_fn(target, drafter, temperatures, fit: bool = False):
  """`_accept_fn` of the target's and drafter's configs, built once per
  process (each score() of a comparison reuses the compiled function)."""
  return _accept_fn(target.config, drafter.config, tuple(temperatures), fit)


@functools.lru_cache(maxsize=8)
def _accept_fn(cfg, dcfg, temperatures, fit: bool):
  """A jitted `f(draft_params, target_params, batch, ratio_TxS)` over one
  answer's anchor blocks: `point`/`sampled` `[nT, B, K, S]` (expected
  acceptance at each temperature, 0 where a slot is past the answer), `valid`
  `[B, K, S]` and, with `fit`, `grid` `[nT, G, S]`: the summed sampled
  acceptance at each ratio of RATIO_GRID."""
  import jax
  import jax.numpy as jnp

  from flexdraft_jax.decoding.sampling import SamplingParams
  from flexdraft_jax.model import transformer
  from flexdraft_jax.training import loss as loss_lib

  def f(draft_params, target_params, batch, ratio_TxS):
    d = loss_lib.draft_pass(draft_params, target_params, cfg, dcfg, batch)
    lg, valid, pos = d["logits_BxKxSxV"], d["valid_BxKxS"], d["pos_BxKxS"]
    B, K, S, _ = lg.shape
    vocab = d["draft"].get("vocab")
    ids = (lambda i: i) if vocab is None else (lambda i: jnp.take(vocab, i))
    draft_id = ids(jnp.argmax(lg, axis=-1))                     # [B, K, S]
    t_all = transformer.logits(target_params, cfg, d["h_clean"])  # [B, T, V]
    # p for the token at mask position p is read at p - 1 (per position once,
    # then gathered: anchors' slots share positions)
    prev = jnp.clip(pos - 1, 0, t_all.shape[1] - 1)
    rows = lambda x: jnp.take_along_axis(x, prev.reshape(B, K * S)[..., None],
                                         axis=1).reshape(B, K, S, -1)
    out = {"point": [], "sampled": [], "grid": [], "valid": valid}
    for i, T in enumerate(temperatures):
      sp = SamplingParams(temperature=T)
      if T == 0:
        pt = sa = (draft_id == rows(jnp.argmax(t_all, -1)[..., None])[..., 0]).astype(
            jnp.float32)
      else:
        p_V, p_W = target_probs(t_all, sp, vocab)
        p_W = rows(p_W)
        pt = p_V[jnp.arange(B)[:, None, None], prev, draft_id]
        sa = sampled_accept(p_W, lg, sp, ratio_TxS[i])
      out["point"].append(pt * valid)
      out["sampled"].append(sa * valid)
      if fit and T > 0:
        g = jax.lax.map(lambda r: jnp.sum(sampled_accept(p_W, lg, sp, r) * valid, axis=(0, 1)),
                        jnp.asarray(RATIO_GRID))
        out["grid"].append(g)
      elif fit:
        out["grid"].append(jnp.zeros((len(RATIO_GRID), S)))
    out["point"], out["sampled"] = jnp.stack(out["point"]), jnp.stack(out["sampled"])
    out["grid"] = jnp.stack(out["grid"]) if fit else jnp.zeros((0,))
    return out

  return jax.jit(f)


def chain_tau(a_KxS):
  """(Σ expected τ, Σ expected steps of the walk) over one answer's anchors,
  from each anchor's per-slot acceptance `a_KxS` (anchor i: the block whose
  bonus is answer token i; slots past the answer hold 0). P(τ = 1 + m) =
  Π_{j≤m} a_j · (1 - a_{m+1}); the walk's expected steps from anchor i is
  E(i) = 1 + Σ_m P_i(τ = 1 + m)·E(i + 1 + m), E(past the end) = 0."""
  a = np.asarray(a_KxS, np.float64)
  K, S = a.shape
  run = np.cumprod(a, axis=1)                          # P(slots 1..m all accepted)
  reach = np.concatenate([np.ones((K, 1)), run], 1)    # m = 0..S
  p_len = reach - np.concatenate([run, np.zeros((K, 1))], 1)  # P(τ = 1 + m)
  steps = np.zeros(K + S + 2)
  for i in range(K - 1, -1, -1):
    steps[i] = 1.0 + np.dot(p_len[i], steps[i + 1:i + 2 + S])
  return float(np.sum(1.0 + run.sum(1))), float(steps[0])


def score(target, drafter, prompts: list, answers: list, max_new_tokens: int = 128,
          temperatures=(0.0, 0.7, 1.0), ratios=None, fit: bool = False,
          blind: bool = False) -> dict:
  """Per temperature T (in order) and kind ("point", "sampled"): per-slot mean
  expected acceptance `acc` (slots 1..S), `uniform_tau` and `walk_tau` of
  `drafter` over the answers, and `anchors`. `ratios`: `{T: [r_1..r_S]}`,
  the sampled drafts' temperature per slot relative to T (1 where a T is not
  in it; default: the drafter's own, `DrafterConfig.draft_temperature`). `fit`:
  also `grid` `{T: [G, S]}`, the mean sampled acceptance at each ratio of
  RATIO_GRID. `blind`: parallel mode's drafting (offline_tau.score)."""
  import jax

  from flexdraft_jax.drafter.model import draft_temperature_ratios
  from flexdraft_jax.training import offline_tau
  S = drafter.config.block_size - 1
  temperatures = tuple(float(t) for t in temperatures)
  ratio_TxS = np.ones((len(temperatures), S), np.float32)
  for i, T in enumerate(temperatures):
    stored = draft_temperature_ratios(drafter.config, T, S)
    if ratios is not None:
      ratio_TxS[i] = ratios.get(T, 1.0)
    elif stored is not None:
      ratio_TxS[i] = stored
  fn = accept_fn(target, drafter, temperatures, fit)
  nT = len(temperatures)
  sums = {k: np.zeros((nT, S)) for k in ("point", "sampled")}
  tau = {k: np.zeros((nT, 2)) for k in ("point", "sampled")}   # Σ τ, Σ steps
  grid = np.zeros((nT, len(RATIO_GRID), S))
  n_slot = np.zeros(S)
  anchors = tokens = 0
  for p, a in zip(prompts, answers):
    batch = offline_tau.answer_batch(p, a, max_new_tokens, drafter.config, blind)
    if batch is None:
      continue
    out = jax.device_get(fn(drafter.params, target.params, batch, ratio_TxS))
    n = len(a)
    anchors, tokens = anchors + n, tokens + n
    n_slot += out["valid"][0, :n].sum(0)
    for k in sums:
      sums[k] += out[k][:, 0, :n].sum(1)
      for i in range(nT):
        tau[k][i] += chain_tau(out[k][i, 0, :n])
    if fit:
      grid += out["grid"]
  res = {"anchors": anchors, "temperatures": temperatures}
  for k in sums:
    res[k] = [{"acc": [float(x) for x in sums[k][i] / np.maximum(n_slot, 1)],
               "uniform_tau": float(tau[k][i, 0] / max(anchors, 1)),
               "walk_tau": float(tokens / max(tau[k][i, 1], 1e-9))}
              for i in range(nT)]
  if fit:
    res["grid"] = {T: grid[i] / np.maximum(n_slot, 1) for i, T in enumerate(temperatures)
                   if T > 0}
  return res


def fitted_ratios(grid_by_T: dict) -> dict:
  """`{T: [r_1..r_S]}`: per temperature and slot, the ratio of RATIO_GRID with
  the highest mean sampled acceptance (`score(..., fit=True)["grid"]`)."""
  return {T: [RATIO_GRID[int(i)] for i in np.argmax(g, axis=0)]
          for T, g in grid_by_T.items()}


def write_fitted(out: str, source: str, drafter, target, ratios: dict) -> str:
  """A copy of the drafter at `source` (loaded as `drafter`) in the new
  directory `out`, its config holding `ratios` as `draft_temperature`; its
  training record is the source's."""
  import dataclasses

  from flexdraft_jax.drafter import checkpoint
  dcfg = dataclasses.replace(drafter.config, draft_temperature=tuple(
      (float(T), tuple(float(r) for r in rs)) for T, rs in sorted(ratios.items())))
  dcfg.validate(target.config)
  training = checkpoint.read_meta(source).get("training", {})
  return checkpoint.save_drafter(out, drafter._replace(config=dcfg), target,
                                 training=training)


def table_header(S: int) -> str:
  slots = " | ".join(f"α{j}" for j in range(1, S + 1))
  return (f"| drafter | dataset | T | drafts | {slots} | uniform τ | walk τ |\n"
          "|" + "---|" * (S + 6))


def table_rows(first: str, second: str, r: dict, label: str = "") -> list:
  rows = []
  for i, T in enumerate(r["temperatures"]):
    for kind in ("point", "sampled") if T > 0 else ("point",):
      x = r[kind][i]
      accs = " | ".join(f"{v:.3f}" for v in x["acc"])
      name = ("argmax" if T > 0 else "argmax (T = 0)") if kind == "point" else "sampled"
      rows.append(f"| {first} | {second} | {T:g} | {name}{label} | {accs} | "
                  f"{x['uniform_tau']:.3f} | {x['walk_tau']:.3f} |")
  return rows


def _temperatures(values) -> tuple:
  from flexdraft_jax.decoding.sampling import MIN_TEMPERATURE
  from flexdraft_jax.model.config import FlexDraftError
  out = []
  for v in values:
    try:
      t = float(v)
    except ValueError:
      t = float("nan")
    if not np.isfinite(t) or t < 0:
      raise FlexDraftError(f"--temperatures: {v!r} is not a temperature (a number >= 0)")
    if 0 < t < MIN_TEMPERATURE:  # logits / T overflows float32 (sampling.py)
      raise FlexDraftError(f"--temperatures: each must be 0 (greedy) or >= "
                           f"{MIN_TEMPERATURE:g}, got {v}")
    out.append(t)
  if not out:
    raise FlexDraftError("--temperatures is empty: name at least one (e.g. 0,0.7,1)")
  return tuple(out)


def run(argv):
  """Entry from `python -m flexdraft_jax offline-accept`."""
  from absl import flags

  from flexdraft_jax import cli_util
  from flexdraft_jax.training import offline_tau
  names = ("drafters", "datasets", "limit", "max_new_tokens", "batch_size", "answers",
           "data_dir", "model", "blind", "temperatures", "fit_temperature", "fit_out",
           "sampled_answers")
  offline_tau.define_flags(names)
  flags.DEFINE_list("temperatures", ["0", "0.7", "1"], "sampling temperatures")
  flags.DEFINE_bool("fit_temperature", False, "fit a draft temperature per slot and T > 0 "
                    "on the first half of each dataset's prompts; report the second half "
                    "before and after")
  flags.DEFINE_bool("sampled_answers", False, "score each T > 0 on the target's answers "
                    "sampled at T (seed 0; cached beside the greedy ones) instead of its "
                    "greedy answers")
  flags.DEFINE_string("fit_out", "", "with --fit_temperature and one drafter: write a copy "
                      "of it holding the fitted draft temperatures (its config's "
                      "draft_temperature) to this new directory")
  FLAGS = flags.FLAGS

  def main(args):
    from flexdraft_jax.model.config import FlexDraftError
    if len(args) > 1:
      raise FlexDraftError(f"unexpected arguments: {' '.join(args[1:])}")
    temperatures = _temperatures(FLAGS.temperatures)
    if FLAGS.fit_temperature and not any(t > 0 for t in temperatures):
      raise FlexDraftError("--fit_temperature needs a temperature > 0 in --temperatures")
    if FLAGS.fit_temperature and FLAGS.limit == 1:
      raise FlexDraftError("--fit_temperature needs --limit >= 2 (it fits on the first half "
                           "of the prompts and reports the second)")
    if FLAGS.fit_out:
      if not FLAGS.fit_temperature or len(FLAGS.drafters) != 1:
        raise FlexDraftError("--fit_out needs --fit_temperature and one drafter in "
                             "--drafters")
      if os.path.lexists(FLAGS.fit_out):
        raise FlexDraftError(f"--fit_out {FLAGS.fit_out} exists: offline-accept writes a "
                             "new drafter directory and replaces nothing; pass another "
                             "--fit_out")
      cli_util.check_can_write(FLAGS.fit_out, "--fit_out")  # now, not after the fit
    import flexdraft_jax as fd
    from flexdraft_jax.evaluation import plan
    # Which answers each temperature is scored on: the greedy ones, or (with
    # --sampled_answers) the target's answers sampled at that temperature.
    groups = ([(T,) for T in temperatures] if FLAGS.sampled_answers else [temperatures])
    answer_T = [g[0] if FLAGS.sampled_answers else 0.0 for g in groups]
    target, sets = offline_tau.prepare(FLAGS, "offline-accept",
                                       tuple(dict.fromkeys(answer_T)))
    if len(set(answer_T)) == 1:
      sets = {answer_T[0]: sets}
    for path in FLAGS.drafters:
      drafter = fd.load_drafter(plan.resolve_path(path), target)
      S = drafter.config.block_size - 1
      name = path + (" (blind)" if FLAGS.blind else "")
      if not FLAGS.fit_temperature:
        print(table_header(S), flush=True)
        for ds in FLAGS.datasets:
          for temps, aT in zip(groups, answer_T):
            d = sets[aT][ds]
            r = score(target, drafter, d["prompts"], d["answers"], FLAGS.max_new_tokens,
                      temps, blind=FLAGS.blind)
            print("\n".join(table_rows(name, f"{ds} ({len(d['prompts'])})", r)), flush=True)
        continue
      halves = {ds: (len(d["prompts"]) + 1) // 2 for ds, d in sets[answer_T[0]].items()}
      grid = {}
      for temps, aT in zip(groups, answer_T):
        if not any(T > 0 for T in temps):
          continue
        for ds, d in sets[aT].items():
          h = halves[ds]
          r = score(target, drafter, d["prompts"][:h], d["answers"][:h],
                    FLAGS.max_new_tokens, temps, fit=True, blind=FLAGS.blind)
          for T, g in r["grid"].items():  # pooled over datasets, weighted by anchors
            grid[T] = grid.get(T, 0) + g * r["anchors"]
      ratios = fitted_ratios(grid)
      print(f"{name}: draft temperature / T per slot, fitted on the first "
            f"{'/'.join(map(str, halves.values()))} prompts of {','.join(halves)}:",
            flush=True)
      for T, rs in ratios.items():
        print(f"  T = {T:g}: " + ", ".join(f"{x:.3f}" for x in rs), flush=True)
      print(table_header(S), flush=True)
      for ds in FLAGS.datasets:
        for temps, aT in zip(groups, answer_T):
          d, h = sets[aT][ds], halves[ds]
          held = (d["prompts"][h:], d["answers"][h:])
          for label, rt in (("", None), (", fitted t", ratios)):
            if label and not any(T > 0 for T in temps):
              continue
            r = score(target, drafter, *held, FLAGS.max_new_tokens, temps, ratios=rt,
                      blind=FLAGS.blind)
            rows = table_rows(name, f"{ds} (last {len(held[0])})", r, label)
            print("\n".join(x for x in rows if not label or "sampled" in x), flush=True)
      if FLAGS.fit_out:
        write_fitted(FLAGS.fit_out, plan.resolve_path(path), drafter, target, ratios)
        print(f"offline-accept: wrote the drafter with its fitted draft temperatures to "
              f"{os.path.abspath(FLAGS.fit_out)}", flush=True)

  cli_util.run_main(main, argv, doc=__doc__, key_flags=names)
