"""The decode batch sharded over 8 fake CPU devices gives the same tokens as 1."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
import jax
import flexdraft_jax as fd
from tests.decoding_util import random_drafter, tiny_target
target = tiny_target()
drafter = random_drafter(target, block_size=4, noise=0.5)
prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23], [30, 31], [40], [41, 42, 43], [44]]
out = {"devices": jax.device_count()}
for batch in (8, 3):
  for mode, theta in (("ar", 0.0), ("parallel", 0.3), ("sequential", 0.0)):
    r = fd.generate(target, prompts[:batch], max_new_tokens=21, drafter=drafter,
                    mode=mode, speculation=fd.SpecOptions(threshold=theta), stop=[])
    out[f"{batch}-{mode}"] = r.token_ids
print(json.dumps(out))
"""


def _run(devices: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root,
                       capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  return json.loads(res.stdout.strip().splitlines()[-1])


def test_eight_devices_match_one():
  one, eight = _run(1), _run(8)
  assert one.pop("devices") == 1 and eight.pop("devices") == 8
  assert one == eight
  assert one["8-parallel"] == one["8-ar"]
