"""`python -m flexdraft_jax COMMAND [flags]`: generate, self-instruct, regenerate,
train, eval, and the drafter tools (add-ngram, offline-tau,
offline-accept, learning-curve, build-kernel), and aot (a decode run's programs
compiled for a TPU slice that is not attached)."""

import importlib
import sys

COMMANDS = {
    "generate": "flexdraft_jax.cli",
    "self-instruct": "flexdraft_jax.training.self_instruct",
    "regenerate": "flexdraft_jax.training.regenerate",
    "train": "flexdraft_jax.training.train",
    "eval": "flexdraft_jax.evaluation.sweep",
    "add-ngram": "flexdraft_jax.training.add_ngram",
    "offline-tau": "flexdraft_jax.training.offline_tau",
    "offline-accept": "flexdraft_jax.training.offline_accept",
    "learning-curve": "flexdraft_jax.training.learning_curve",
    "build-kernel": "flexdraft_jax.kernels.cpu_matmul",
    "aot": "flexdraft_jax.aot.cli",
}


def main():
  if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    asked = sys.argv[1:] in (["--help"], ["-h"])
    print(f"usage: python -m flexdraft_jax {{{','.join(COMMANDS)}}} [flags]; "
          "add --help after a command for its flags", file=sys.stdout if asked else sys.stderr)
    sys.exit(0 if asked else 2)
  command = sys.argv[1]
  from flexdraft_jax import cli_util
  cli_util.OWN_PROCESS = True  # this process is the command's: a stop ends it directly
  module = importlib.import_module(COMMANDS[command])
  module.run([f"flexdraft_jax {command}"] + sys.argv[2:])


if __name__ == "__main__":
  main()
