"""`python -m flexdraft_jax.evaluation.demo`: AR vs FlexDraft on a few real prompts.

Loads SmolLM2-135M-Instruct and the shipped drafter (a random one, loudly, when
it is missing), decodes a math, a code and a chat prompt with `ar` and with a
speculative mode (default `flex`: it measures the step costs here and picks
parallel, sequential or AR steps), and prints the texts, τ and the speedup over
AR measured in this run (the median of a few timed runs each; "≈ 1×" when it is
within their run-to-run spread), and the whole command's seconds. Decode
tokens/s leave out compiling, so no warm-up run is needed: the first run
compiles (or loads the programs an earlier run kept, see compile_cache.py).
The prompts decode one at a time by default (`--batch-size 1`): on a CPU that is
where speculation pays (a larger batch makes the verify forward compute-bound,
and flex then runs AR steps).
"""

from __future__ import annotations

import argparse
import sys
import time

from flexdraft_jax.decoding.options import MODES, TREE, Mode
from flexdraft_jax.evaluation import benchmarks
from flexdraft_jax.model.config import FlexDraftError

PROMPTS = (
    ("math", "A baker makes 24 muffins in the morning and twice as many in the afternoon. "
             "She sells 50 of them. How many muffins does she have left?"
     + benchmarks.MATH_INSTRUCTION),
    ("code", "Write a Python function `is_palindrome(s)` that ignores case and spaces."
     + benchmarks.CODE_INSTRUCTION),
    ("chat", "Give me three short tips for a productive morning."),
)


def _parser() -> argparse.ArgumentParser:
  from flexdraft_jax.evaluation.sweep import SHIPPED_DRAFTER
  p = argparse.ArgumentParser(prog="python -m flexdraft_jax.evaluation.demo",
                              description=__doc__.splitlines()[0])
  p.add_argument("--model", default="smollm2-135m", help="a load_target spec")
  p.add_argument("--drafter", default=SHIPPED_DRAFTER,
                 help="drafter directory (relative: cwd, then the repo)")
  p.add_argument("--mode", default="flex", choices=MODES[1:])
  p.add_argument("--threshold", type=float, default=0.01, help="selective verification θ")
  p.add_argument("--tree-budget", type=int, default=0,
                 help="draft trees of up to N nodes (sequential, and flex's choices among "
                 "8, 16, … N); 0: chains only")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=1,
                 help="prompts decoded together (1: one at a time)")
  p.add_argument("--repeats", type=int, default=2,
                 help="timed runs per mode (their spread is the noise a speedup must beat; "
                 "each AR run decodes every prompt anew: the command's time grows with it)")
  p.add_argument("--compile-cache", default=None,
                 help="folder of JAX's persistent compilation cache, or 'off' (default: "
                 "$FLEXDRAFT_COMPILE_CACHE, else $XDG_CACHE_HOME/flexdraft_jax/xla)")
  return p


def _timed(fd, target, ids, drafter, mode, args) -> tuple:
  """`args.repeats` timed generations (the first compiles, or loads what an
  earlier run kept; its compiling is not decode time); returns (the last
  result, tokens/s of each run)."""
  kw = dict(max_new_tokens=args.max_new_tokens, drafter=drafter, mode=mode,
            speculation=fd.SpecOptions(threshold=args.threshold if mode != Mode.AR
                                       else 0.0,
                                       tree_budget=args.tree_budget or None
                                       if mode != Mode.AR else None),
            runtime=fd.RuntimeOptions(batch_size=args.batch_size))
  rates, runs = [], []
  t = time.perf_counter()
  for _ in range(args.repeats):
    res = fd.generate(target, ids, **kw)
    rates.append(res.stats["tokens_per_second"])
    runs.append(res.stats)
  spent = time.perf_counter() - t
  total = lambda k: sum(r[k] for r in runs)
  setup = total("compile_seconds") + total("flex_timing_seconds")
  print(f"  {mode:>10}: {spent:5.1f}s in all (compiling and timing steps {setup:.1f}s: "
        f"{total('programs_compiled')} programs compiled, {total('programs_from_cache')} "
        "loaded from the compile cache), "
        f"decode {res.stats['decode_seconds']:6.2f}s a run, {_median(rates):7.1f} tok/s "
        f"(runs: {', '.join(f'{r:.1f}' for r in rates)}), τ={res.stats['tau']:.2f}",
        flush=True)
  return res, rates


def _median(xs) -> float:
  xs = sorted(xs)
  return 0.5 * (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2])


def speedup_text(ar_rates, spec_rates, only_ar_steps: bool = False) -> str:
  """The speedup of the median tokens/s, or "≈ 1×" when it is within the
  run-to-run noise: the larger relative spread (max - min) / median of
  either mode's timed runs."""
  ratio = _median(spec_rates) / max(_median(ar_rates), 1e-9)
  if only_ar_steps:
    return f"≈ 1× (flex decoded with AR steps; measured {ratio:.2f}×)"
  noise = max((max(r) - min(r)) / max(_median(r), 1e-9) for r in (ar_rates, spec_rates))
  if abs(ratio - 1.0) <= noise:
    return (f"≈ 1× (within noise: measured {ratio:.2f}×, runs of one mode differ by "
            f"up to {100 * noise:.0f}%)")
  return f"{ratio:.2f}×"


def flex_lines(stats: dict) -> list:
  """Per batch shape: flex's last choice with the tokens/s it predicted for it
  and the runners-up, then the predicted / measured tokens/s of its chunks
  (over every batch of that shape)."""
  lines = []
  for rows, c in stats.get("flex_choices", {}).items():
    mode, k = c["choice"]
    pred = c["tokens_per_s"]
    best = f"{mode}:{k}" if k else mode
    others = sorted(pred.items(), key=lambda x: -x[1])[:4]
    what = (f" (draft trees of {k} nodes)" if mode == TREE else
            f" verifying up to {k - 1} drafts" if k else "")
    lines.append(f"flex at batch {rows} chose {mode}{what}: predicted {pred[best]:.1f} tok/s ("
                 + ", ".join(f"{m} {v:.1f}" for m, v in others if m != best) + ")")
    if c.get("chunks"):  # what the decoding chunks really did, against the prediction
      lines.append("  its chunks, predicted / measured: " + ", ".join(
          f"{m} ×{x['steps']} steps {x['predicted_tokens_per_s']:.1f} / "
          f"{x['measured_tokens_per_s']:.1f} tok/s" for m, x in c["chunks"].items()))
  return lines


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.max_new_tokens < 1 or args.repeats < 2 or args.batch_size < 1:
    raise FlexDraftError("--max-new-tokens and --batch-size must be >= 1 and --repeats >= 2")
  if args.tree_budget < 0 or args.tree_budget == 1:
    raise FlexDraftError(f"--tree-budget must be 0 (chains) or an integer >= 2, got "
                         f"{args.tree_budget}")
  if args.tree_budget and args.mode == Mode.PARALLEL:
    raise FlexDraftError("--tree-budget runs in mode sequential or flex, not parallel")
  if not 0 <= args.threshold <= 1:
    raise FlexDraftError(f"--threshold must be in [0, 1], got {args.threshold}")
  import jax

  import flexdraft_jax as fd
  from flexdraft_jax.decoding import timing
  from flexdraft_jax.evaluation import sweep
  fd.use_compile_cache(args.compile_cache, explicit=args.compile_cache is not None)
  t0 = time.perf_counter()
  target = fd.load_target(args.model, layout="layers")
  print(f"target {target.name}: {target.config.num_layers} layers, loaded in "
        f"{time.perf_counter() - t0:.1f}s on {jax.devices()[0].device_kind}", flush=True)
  config = sweep.default_config()
  config.drafter = args.drafter
  drafter, info = sweep.load_main_drafter(config, target)
  if info["kind"] == "random":
    print(f"\n{'!' * 78}\n!! {info['note']}\n!! (train one: python -m flexdraft_jax train "
          f"--config configs/smollm2_135m.py)\n{'!' * 78}\n", flush=True)
  else:
    print(f"drafter {info['path']}: L={drafter.config.num_layers}, "
          f"bs={drafter.config.block_size}", flush=True)
  kw = benchmarks.chat_kwargs(target)
  ids = [benchmarks.render(target.tokenizer, [{"role": "user", "content": text}], kw)
         for _, text in PROMPTS]
  print(f"decoding {len(ids)} prompts (batch {min(args.batch_size, len(ids))}), max_new_tokens="
        f"{args.max_new_tokens}, T=0:", flush=True)
  ar, ar_rates = _timed(fd, target, ids, None, Mode.AR, args)
  spec, spec_rates = _timed(fd, target, ids, drafter, args.mode, args)

  for (kind, text), b in zip(PROMPTS, spec.texts):
    print(f"\n=== {kind}: {text.splitlines()[0][:90]}\n{b.strip()}")
  same = ar.token_ids == spec.token_ids
  mode_steps = spec.stats.get("mode_steps", [])  # run-length [[mode, steps], …]
  steps = {m: sum(n for k, n in mode_steps if k == m) for m, _ in mode_steps}
  mode_tau = spec.stats.get("mode_tau", {})
  used = ", ".join(f"{m} {n}" + (f" (τ {mode_tau[m]:.2f})" if m in mode_tau else "")
                   for m, n in steps.items())
  speedup = speedup_text(ar_rates, spec_rates, only_ar_steps=set(steps) == {"ar"})
  whole = time.time() - timing.process_started()
  print(f"\n{'=' * 78}\nAR            {_median(ar_rates):8.1f} tok/s decoding"
        f"\n{args.mode:<13} {_median(spec_rates):8.1f} tok/s decoding   "
        f"τ={spec.stats['tau']:.2f}   speedup over AR: {speedup}"
        f"\nthe whole command: {whole:.1f}s ({2 * args.repeats} generate calls of "
        f"{len(ids)} prompts, with loading and compiling)"
        f"\nsteps per mode: {used or args.mode};  outputs identical to AR: {same}")
  for line in flex_lines(spec.stats):
    print(line)
  if args.mode == Mode.FLEX and steps.get(Mode.AR):
    print("flex measured the step costs on this machine and predicted plain AR steps "
          "to be fastest " + ("here" if set(steps) == {"ar"} else "after its "
          "speculative steps") + " (speculative verification does not pay on this "
          "hardware with this drafter at that point), so it decoded with AR steps.")
  if info["kind"] == "random":
    print("NOTE: the drafter is RANDOM (untrained): τ ≈ 1 and no speedup are expected.")
  if not same:
    print("NOTE: an output differs from AR: at T=0 that happens only where the target's "
          "top-2 logits tie to float precision (the sweep's lossless column checks it).")
  print("=" * 78)
  return 0


if __name__ == "__main__":
  try:
    sys.exit(main())
  except FlexDraftError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
