"""Device memory a decode job holds, stacked vs per-layer target layout.

Run (from the repository root):
  PYTHONPATH=. python launch/experiments/decode_memory.py --layout=layers
  PYTHONPATH=. python launch/experiments/decode_memory.py --layout=stacked

Loads SmolLM2-135M and the shipped drafter, generates once (sequential mode,
16 tokens) and prints the bytes of the target's weights, of every live device
array after the generation (`jax.live_arrays()`) and the process's peak RSS.
A stacked target gets a per-layer copy when it first decodes; "layers" is
loaded in the layout decoding reads, so it holds the weights once. One layout
per process: the peak RSS is the process's.
"""

from __future__ import annotations

import resource

from absl import app
from absl import flags

flags.DEFINE_enum("layout", "layers", ["layers", "stacked"], "target layout")
flags.DEFINE_string("drafter", "flexdraft_jax/drafters/smollm2_135m_L8", "drafter directory")
FLAGS = flags.FLAGS


def main(_):
  import jax
  import flexdraft_jax as fd
  target = fd.load_target("smollm2-135m", layout=FLAGS.layout)
  drafter = fd.load_drafter(FLAGS.drafter, target)
  weights = sum(x.nbytes for x in jax.tree.leaves(target.params))
  out = fd.generate(target, ["What is 2+3?"], max_new_tokens=16, drafter=drafter,
                    mode="sequential", chat=True)
  live = sum(x.nbytes for x in jax.live_arrays())
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
  mib = 2**20
  print(f"layout={FLAGS.layout}: target weights {weights / mib:.0f} MiB; live device "
        f"arrays after generate {live / mib:.0f} MiB; peak RSS {rss:.0f} MiB; "
        f"first tokens {out.token_ids[0][:8]}")


if __name__ == "__main__":
  app.run(main)
