"""The decode layout's transposed matmul weights against plain `[in, out]` ones.

  PYTHONPATH=. python launch/experiments/bench_layout.py --batch=1

Decoding holds the target's and the drafter's matmul weights as `[out, in]`
(`pytree.decode_layer`) and computes `W @ x.T` (`transformer.matmul_t`).
This times one decode step (AR, sequential at several k) of SmolLM2-135M and
the shipped drafter with those weights ("transposed") and with the same weights
as plain `[in, out]` per-layer dicts ("plain", the `x @ W` products decoding
ran before), in one process, alternating, on the decode state of a real run:
the median over rounds of the mean of a few calls. The draft head is a
transposed product in both (it is the LM head's `[V, H]` rows).
"""

from __future__ import annotations

import functools
import json
import statistics
import time

from absl import app, flags

from flexdraft_jax.decoding import capture

flags.DEFINE_integer("batch", 1, "rows per step")
flags.DEFINE_list("ks", ["2", "3", "4", "5", "8"], "verify lengths of the sequential steps")
flags.DEFINE_integer("rounds", 8, "alternating timing rounds")
flags.DEFINE_integer("calls", 5, "calls per round (their mean is one sample)")
flags.DEFINE_string("drafter", "flexdraft_jax/drafters/smollm2_135m_L8", "drafter directory")
FLAGS = flags.FLAGS

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as "
          "many clips in May. How many clips did Natalia sell altogether in April and May?")


def plain(layers: list) -> list:
  """Weight dicts with every KEY_t weight back as KEY, `[in, out]`."""
  import jax.numpy as jnp
  return [{k.removesuffix("_t"): jnp.asarray(w.T) if k.endswith("_t") else w
           for k, w in layer.items()} for layer in layers]


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp

  import flexdraft_jax as fd
  from flexdraft_jax.decoding import chunk
  from flexdraft_jax.evaluation import plan

  target = fd.load_target("smollm2-135m", layout="layers")
  drafter = fd.load_drafter(plan.resolve_path(FLAGS.drafter), target)
  (tp, dp, state), kw = capture.first_chunk(target, drafter, [PROMPT] * FLAGS.batch)
  real = chunk.run_chunk
  weights = {"transposed": (tp, dp),
             "plain": (dict(tp, layers=plain(tp["layers"])),
                       dict(dp, layers=plain(dp["layers"]), calib=plain([dp["calib"]])[0]))}

  def step(tp, dp, st, mode, k):  # one step of the jitted decode loop
    return real(tp, dp, st, **dict(kw, mode=mode, num_groups=k, n_steps=jnp.int32(1))).bonus_B

  cells = [("ar", 0)] + [("sequential", int(k)) for k in FLAGS.ks]
  fns = {c: jax.jit(functools.partial(step, mode=c[0], k=c[1])) for c in cells}
  outs = {}
  for c in cells:
    for name, (t, d) in weights.items():
      for _ in range(2):  # compile + warm
        outs[(name, c)] = jax.block_until_ready(fns[c](t, d, state))
  same = all(bool((outs[("transposed", c)] == outs[("plain", c)]).all()) for c in cells)
  samples = {}
  for r in range(FLAGS.rounds):
    order = list(weights) if r % 2 == 0 else list(weights)[::-1]
    for c in cells:
      for name in order:
        t, d = weights[name]
        t0 = time.perf_counter()
        for _ in range(FLAGS.calls):
          out = fns[c](t, d, state)
        jax.block_until_ready(out)
        samples.setdefault((name, c), []).append(
            1e3 * (time.perf_counter() - t0) / FLAGS.calls)
  ms = {k: statistics.median(v) for k, v in samples.items()}
  ar = {name: ms[(name, cells[0])] for name in weights}
  print(f"batch {FLAGS.batch}: ms per step, median of {FLAGS.rounds} rounds "
        f"(same tokens both ways: {same})")
  print("| step | transposed ms | plain ms | transposed / plain | "
        "÷ AR, transposed | ÷ AR, plain |")
  print("|---|---|---|---|---|---|")
  for c in cells:
    a, b = ms[("transposed", c)], ms[("plain", c)]
    label = "ar" if c[0] == "ar" else f"{c[0]}:{c[1]}"
    print(f"| {label} | {a:.1f} | {b:.1f} | {a / b:.2f} | {a / ar['transposed']:.2f} | "
          f"{b / ar['plain']:.2f} |")
  print(json.dumps({"batch": FLAGS.batch, "same_tokens": same,
                    "ms": {f"{n}|{c[0]}:{c[1]}": round(v, 2) for (n, c), v in ms.items()}}))


if __name__ == "__main__":
  app.run(main)
