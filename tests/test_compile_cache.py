"""The persistent compilation cache: a second process loads what the first
compiled; programs made under another JAX version or machine are never read."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from flexdraft_jax import compile_cache
from flexdraft_jax.model.config import FlexDraftError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny target and drafter decoding in sequential mode: its stats, and the
# compile-cache folder programs were kept in.
SCRIPT = """
import json
import flexdraft_jax as fd
from tests.decoding_util import random_drafter
target = fd.load_target("random:tiny", layout="layers")
drafter = random_drafter(target, block_size=4, noise=0.5)
out = fd.generate(target, ["hello there"], max_new_tokens=24, drafter=drafter,
                  mode="sequential", speculation=fd.SpecOptions(cost_cache=None))
print(json.dumps({"stats": out.stats, "tokens": out.token_ids}))
"""


def _decode(cache: str, env_extra=None) -> dict:
  env = dict(os.environ, FLEXDRAFT_COMPILE_CACHE=cache, JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env.update(env_extra or {})
  r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def _programs(folder) -> set:
  return {f for f in os.listdir(folder) if f.endswith("-cache")}


def test_a_second_process_loads_the_programs_the_first_compiled(tmp_path):
  root = str(tmp_path / "xla")
  first = _decode(root)
  folder = first["stats"]["compile_cache"]
  assert os.path.dirname(folder) == root
  assert os.path.basename(folder).startswith(f"jax{__import__('jax').__version__}-")
  written = _programs(folder)
  assert any(f.startswith("jit_run_chunk-") for f in written)
  assert any(f.startswith("jit_prefill_batch-") for f in written)
  assert first["stats"]["programs_compiled"] > 0
  assert first["stats"]["programs_from_cache"] == 0

  second = _decode(root)
  assert second["tokens"] == first["tokens"]
  assert second["stats"]["programs_compiled"] == 0  # nothing compiled again
  assert second["stats"]["programs_from_cache"] >= first["stats"]["programs_compiled"]
  assert _programs(folder) == written

  # The same programs under another JAX version's (or machine's) subfolder —
  # as another version would have left them — are not read.
  other = tmp_path / "xla_other"
  other.mkdir()
  shutil.copytree(folder, other / "jax0.0.1-jaxlib0.0.1-000000000000")
  third = _decode(str(other))
  assert third["stats"]["programs_from_cache"] == 0
  assert third["stats"]["programs_compiled"] == first["stats"]["programs_compiled"]
  assert os.path.basename(third["stats"]["compile_cache"]) == os.path.basename(folder)

  # Off: nothing kept, nothing read.
  off = _decode("off", {"XDG_CACHE_HOME": str(tmp_path / "xdg")})
  assert off["stats"]["compile_cache"] is None
  assert off["stats"]["programs_from_cache"] == 0 and off["stats"]["programs_compiled"] > 0
  assert not (tmp_path / "xdg" / "flexdraft_jax" / "xla").exists()


def test_the_subfolder_names_jax_jaxlib_the_cpu_and_the_kernel(monkeypatch):
  import jax
  import jaxlib

  from flexdraft_jax.kernels import cpu_matmul
  key = compile_cache.version_key()
  assert key.startswith(f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-")
  monkeypatch.setattr(jax, "__version__", "0.0.1")
  assert compile_cache.version_key() != key
  monkeypatch.undo()
  monkeypatch.setattr(cpu_matmul, "_cpu_flags", lambda: "flags : sse2")  # another CPU
  assert compile_cache.version_key() != key
  monkeypatch.undo()
  monkeypatch.setattr(cpu_matmul, "_key", lambda defines=(): "another kernel build")
  assert compile_cache.version_key() != key


def test_where_the_cache_goes(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.resolve() == str(tmp_path / "flexdraft_jax" / "xla")
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
  assert compile_cache.resolve() == str(tmp_path / "mine")
  for off in ("off", "OFF", "0", ""):
    monkeypatch.setenv(compile_cache.ENV, off)
    assert compile_cache.resolve() is None
  assert compile_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")


def test_a_file_is_not_a_cache_folder(tmp_path):
  f = tmp_path / "notes.txt"
  f.write_text("mine")
  with pytest.raises(FlexDraftError, match="is not a folder"):
    compile_cache.use_compile_cache(str(f))
  assert f.read_text() == "mine"


def test_flex_takes_its_first_costs_from_another_cache_length(tmp_path, monkeypatch):
  """Timing compiles every variant it times: where the cost cache holds this
  batch shape at another cache length, flex starts from those costs."""
  import flexdraft_jax as fd
  from flexdraft_jax.decoding import driver, step_costs
  from tests.decoding_util import random_drafter, tiny_target
  monkeypatch.setattr(step_costs, "_COSTS_IN_MEMORY", {})
  target = tiny_target()
  drafter = random_drafter(target, block_size=4, noise=0.5)
  kw = dict(max_new_tokens=8, drafter=drafter, mode="flex",
            speculation=fd.SpecOptions(cost_cache=str(tmp_path / "costs.json")))
  first = fd.generate(target, [[3, 4, 5]], runtime=fd.RuntimeOptions(max_len=256), **kw)
  timed, real = [], driver.Driver._time
  monkeypatch.setattr(driver.Driver, "_time",
                      lambda self, *a, **k: timed.append(a[1:]) or real(self, *a, **k))
  out = fd.generate(target, [[3, 4, 5]], runtime=fd.RuntimeOptions(max_len=384), **kw)
  assert timed == []
  assert out.stats["step_costs"]["1"] == first.stats["step_costs"]["1"]
  assert out.stats["flex_timing_seconds"] == 0
  # another batch size has no costs to start from: it is timed
  fd.generate(target, [[3, 4, 5], [6, 7]], runtime=fd.RuntimeOptions(max_len=384), **kw)
  assert timed
