"""`python -m flexdraft_jax.evaluation.demo`: AR vs FlexDraft on a few real prompts.

Loads SmolLM2-135M-Instruct and the shipped drafter (a random one, loudly, when
it is missing), decodes a math, a code and a chat prompt with `ar` and with a
speculative mode (default `flex`: it measures the step costs here and picks
parallel, sequential or AR steps), both warmed up on the same prompts, and
prints the texts, τ and the speedup over AR measured in this run.
"""

from __future__ import annotations

import argparse
import sys
import time

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
  p.add_argument("--mode", default="flex", choices=("parallel", "sequential", "flex"))
  p.add_argument("--threshold", type=float, default=0.01, help="selective verification θ")
  p.add_argument("--max-new-tokens", type=int, default=64)
  return p


def _timed(fd, target, ids, drafter, mode, args) -> tuple:
  """Generates twice (the first compiles) and returns the second result."""
  kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, drafter=drafter,
            mode=mode, threshold=args.threshold if mode != "ar" else 0.0)
  t = time.perf_counter()
  fd.generate(target, ids, **kw)
  warm = time.perf_counter() - t
  res = fd.generate(target, ids, **kw)
  print(f"  {mode:>10}: warm-up {warm:5.1f}s, decode {res.stats['decode_seconds']:6.2f}s, "
        f"{res.stats['tokens_per_second']:7.1f} tok/s, τ={res.stats['tau']:.2f}", flush=True)
  return res


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  import jax

  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import sweep
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
  print(f"decoding {len(ids)} prompts (batch {len(ids)}), max_new_tokens="
        f"{args.max_new_tokens}, T=0:", flush=True)
  ar = _timed(fd, target, ids, None, "ar", args)
  spec = _timed(fd, target, ids, drafter, args.mode, args)

  for (kind, text), b in zip(PROMPTS, spec.texts):
    print(f"\n=== {kind}: {text.splitlines()[0][:90]}\n{b.strip()}")
  same = ar.token_ids == spec.token_ids
  speedup = spec.stats["tokens_per_second"] / max(ar.stats["tokens_per_second"], 1e-9)
  mode_steps = spec.stats.get("mode_steps", [])  # run-length [[mode, steps], …]
  steps = {m: sum(n for k, n in mode_steps if k == m) for m, _ in mode_steps}
  used = ", ".join(f"{m} {n}" for m, n in steps.items())
  print(f"\n{'=' * 78}\nAR            {ar.stats['tokens_per_second']:8.1f} tok/s"
        f"\n{args.mode:<13} {spec.stats['tokens_per_second']:8.1f} tok/s   "
        f"τ={spec.stats['tau']:.2f}   speedup over AR: {speedup:.2f}×"
        f"\nsteps per mode: {used or args.mode};  outputs identical to AR: {same}")
  for rows, c in spec.stats.get("flex_choices", {}).items():
    mode, k = c["choice"]
    pred = c["tokens_per_s"]
    best = f"{mode}:{k}" if k else mode
    others = sorted(pred.items(), key=lambda x: -x[1])[:4]
    print(f"flex at batch {rows} chose {mode}" + (f" verifying up to {k - 1} drafts" if k
          else "") + f": predicted {pred[best]:.1f} tok/s ("
          + ", ".join(f"{m} {v:.1f}" for m, v in others if m != best) + ")")
  if args.mode == "flex" and set(steps) == {"ar"}:
    print("flex measured the step costs on this machine and predicted plain AR steps "
          "to be fastest here (speculative verification does not pay on this "
          "hardware with this drafter), so it decoded with AR steps.")
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
