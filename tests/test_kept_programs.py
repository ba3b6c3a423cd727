"""Decode programs kept traced between processes (decoding/kept_programs.py):
a second process calls the exported programs without tracing them, every mode
decodes the same tokens through them, and a program is never read under
another source, when damaged, or when kept programs are off."""

import json
import os
import subprocess
import sys

import pytest

import flexdraft_jax as fd
from flexdraft_jax.decoding import kept_programs, memory_maps
from tests.decoding_util import random_drafter, tiny_target

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny target and drafter decoding in sequential mode, counting the times
# the sequential step's Python code runs (it runs only while a program traces).
SCRIPT = """
import json
import flexdraft_jax as fd
from flexdraft_jax.decoding import sequential
from tests.decoding_util import random_drafter
traced = []
step = sequential.sequential_step
sequential.sequential_step = lambda *a, **k: traced.append(1) or step(*a, **k)
target = fd.load_target("random:tiny", layout="layers")
drafter = random_drafter(target, block_size=4, noise=0.5)
out = fd.generate(target, ["hello there"], max_new_tokens=24, drafter=drafter,
                  mode="sequential", speculation=fd.SpecOptions(cost_cache=None))
print(json.dumps({"stats": out.stats, "tokens": out.token_ids, "traced": len(traced)}))
"""


def _decode(cache: str, kept: str = "on") -> dict:
  env = dict(os.environ, FLEXDRAFT_COMPILE_CACHE=cache, FLEXDRAFT_KEPT_PROGRAMS=kept,
             JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def _kept(stats) -> list:
  folder = os.path.join(stats["compile_cache"], kept_programs.SUBFOLDER)
  return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_a_second_process_decodes_without_tracing(tmp_path):
  root = str(tmp_path / "xla")
  first = _decode(root)
  assert first["traced"] > 0
  files = _kept(first["stats"])
  assert any(f.startswith("run_chunk-") for f in files)
  assert any(f.startswith("prefill_batch-") for f in files)

  second = _decode(root)
  assert second["tokens"] == first["tokens"]
  assert second["traced"] == 0  # the step's code never ran: nothing traced
  assert second["stats"]["programs_compiled"] == 0
  assert _kept(second["stats"]) == files

  # Off: traced again, nothing kept.
  off = _decode(str(tmp_path / "xla_off"), kept="off")
  assert off["traced"] > 0 and off["tokens"] == first["tokens"]
  assert _kept(off["stats"]) == []


@pytest.fixture
def kept_in(tmp_path, monkeypatch):
  """Kept programs in a folder of the test's own (on where $FLEXDRAFT_KEPT_PROGRAMS
  says so), with no program of an earlier test in memory, traced or kept."""
  from flexdraft_jax import compile_cache
  monkeypatch.setattr(compile_cache, "folder", lambda: str(tmp_path / "xla"))
  memory_maps.release()
  yield str(tmp_path / "xla" / kept_programs.SUBFOLDER)
  memory_maps.release()


MODES = [("ar", {}), ("parallel", {}), ("sequential", {}),
         ("sequential", dict(tree_budget=8)), ("sequential", dict(threshold=0.3))]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_mode_decodes_the_same_tokens_through_kept_programs(kept_in, temperature,
                                                                  monkeypatch):
  target = tiny_target()
  drafter = random_drafter(target, block_size=4, noise=0.5)
  prompts = [[3, 4, 5, 6], [7, 8]]

  def run(mode, spec, kept):
    monkeypatch.setenv(kept_programs.ENV, kept)
    out = fd.generate(
        target, prompts, max_new_tokens=20, drafter=drafter, mode=mode, seed=5,
        sampling=fd.SamplingParams(temperature=temperature),
        speculation=fd.SpecOptions(cost_cache=None, **spec))
    return out.token_ids, out.stats["steps"], out.stats["accept_hist"]

  # Flex too: with a fixed B* (parallel at one live row, else sequential) it
  # chooses alike in every call. "auto" chooses by the wall time of its steps,
  # so only its tokens are compared, and only at T = 0 (at T > 0 other choices
  # draw other samples).
  flex = [("flex", dict(flex_threshold=1))] + ([("flex", {})] if temperature == 0 else [])
  for mode, spec in MODES + flex:
    plain = run(mode, spec, "off")
    exported = run(mode, spec, "on")  # traced, exported, kept
    kept_programs.clear()
    loaded = run(mode, spec, "on")    # read back from the files
    n = 1 if spec == {} and mode == "flex" else 3
    assert exported[:n] == plain[:n], (mode, spec)
    assert loaded[:n] == plain[:n], (mode, spec)
  kept = os.listdir(kept_in)
  assert any(f.startswith("run_chunk-") for f in kept)
  assert any(f.startswith("prefill_batch-") for f in kept)


def _counting(monkeypatch):
  """Counts the sequential step's traces."""
  from flexdraft_jax.decoding import sequential
  traced, step = [], sequential.sequential_step
  monkeypatch.setattr(sequential, "sequential_step",
                      lambda *a, **k: traced.append(1) or step(*a, **k))
  return traced


def test_a_program_is_not_read_under_another_source_or_when_damaged(kept_in,
                                                                    monkeypatch):
  monkeypatch.setenv("FLEXDRAFT_KEPT_PROGRAMS", "on")
  target = tiny_target()
  drafter = random_drafter(target, block_size=4, noise=0.5)
  kw = dict(max_new_tokens=12, drafter=drafter, mode="sequential",
            speculation=fd.SpecOptions(cost_cache=None))
  traced = _counting(monkeypatch)
  want = fd.generate(target, [[3, 4, 5]], **kw).token_ids
  chunks = lambda: sorted(f for f in os.listdir(kept_in) if f.startswith("run_chunk-"))
  kept = chunks()
  assert traced and len(kept) == 1

  memory_maps.release()  # the process's traced and compiled programs too
  traced.clear()
  assert fd.generate(target, [[3, 4, 5]], **kw).token_ids == want
  assert not traced  # read back, not traced

  # Another source (an edited package): another key, traced again.
  memory_maps.release()
  source_key = kept_programs.source_key
  monkeypatch.setattr(kept_programs, "source_key", lambda: "another source")
  assert fd.generate(target, [[3, 4, 5]], **kw).token_ids == want
  assert traced and len(chunks()) == 2
  monkeypatch.setattr(kept_programs, "source_key", source_key)

  # A damaged file: traced and written again.
  path = os.path.join(kept_in, kept[0])
  with open(path, "wb") as f:
    f.write(b"not a program")
  memory_maps.release()
  traced.clear()
  assert fd.generate(target, [[3, 4, 5]], **kw).token_ids == want
  assert traced
  with open(path, "rb") as f:
    assert f.read() != b"not a program"


def test_the_folder_is_bounded_and_the_least_recently_used_programs_go(kept_in,
                                                                        monkeypatch):
  import time

  import jax
  import jax.numpy as jnp
  monkeypatch.setenv(kept_programs.ENV, "on")
  plus_one = kept_programs.kept(name="plus_one", static_argnames=())(
      jax.jit(lambda x: x + 1))
  os.makedirs(kept_in)
  now = time.time()
  stale = []
  for age in (300, 200, 100):  # programs of an older source, say: 100 bytes each
    stale.append(os.path.join(kept_in, f"old{age}{kept_programs.SUFFIX}"))
    with open(stale[-1], "wb") as f:
      f.write(b"x" * 100)
    os.utime(stale[-1], (now - age, now - age))
  assert plus_one(jnp.ones(3)).tolist() == [2.0] * 3
  (first,) = [f for f in os.listdir(kept_in) if f.startswith("plus_one-")]
  first = os.path.join(kept_in, first)
  size = os.path.getsize(first)
  os.utime(first, (now - 400, now - 400))  # written longest ago ...
  plus_one.clear()
  assert plus_one(jnp.ones(3)).tolist() == [2.0] * 3
  assert os.path.getmtime(first) > now - 1  # ... but read just now
  # Room for two programs and 150 bytes more: the two oldest stale files go.
  monkeypatch.setattr(kept_programs, "MAX_BYTES", 2 * size + 150)
  assert plus_one(jnp.ones(4)).tolist() == [2.0] * 4
  second = [f for f in os.listdir(kept_in) if f.startswith("plus_one-")
            and os.path.join(kept_in, f) != first]
  assert len(second) == 1 and abs(os.path.getsize(os.path.join(kept_in, second[0])) - size) < 40
  assert not os.path.exists(stale[0]) and not os.path.exists(stale[1])
  assert os.path.exists(stale[2]) and os.path.exists(first)
  # A bound below the newest program alone removes all but it.
  plus_one.clear()
  monkeypatch.setattr(kept_programs, "MAX_BYTES", 1)
  assert plus_one(jnp.ones(5)).tolist() == [2.0] * 5
  (left,) = os.listdir(kept_in)
  assert left.startswith("plus_one-") and os.path.join(kept_in, left) != first


def test_kept_programs_follow_the_compile_cache(monkeypatch, tmp_path):
  from flexdraft_jax import compile_cache
  monkeypatch.setattr(compile_cache, "folder", lambda: str(tmp_path / "xla" / "v"))
  monkeypatch.setenv(kept_programs.ENV, "on")
  assert kept_programs.folder() == str(tmp_path / "xla" / "v" / kept_programs.SUBFOLDER)
  for off in ("off", "0", "false"):
    monkeypatch.setenv(kept_programs.ENV, off)
    assert kept_programs.folder() is None
  monkeypatch.setenv(kept_programs.ENV, "on")
  monkeypatch.setattr(compile_cache, "folder", lambda: None)  # the compile cache off
  assert kept_programs.folder() is None
