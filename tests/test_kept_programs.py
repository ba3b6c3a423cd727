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


def _run(cache: str, kept: str = "on", prelude: str = ""):
  env = dict(os.environ, FLEXDRAFT_COMPILE_CACHE=cache, FLEXDRAFT_KEPT_PROGRAMS=kept,
             JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return subprocess.run([sys.executable, "-c", prelude + SCRIPT], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


def _decode(cache: str, kept: str = "on", prelude: str = "") -> dict:
  """SCRIPT's output in a process of its own (a crash, 139 / -11, fails), with
  its `warning:` lines."""
  r = _run(cache, kept, prelude)
  assert r.returncode == 0, f"exit status {r.returncode}: {r.stderr[-3000:]}"
  out = json.loads(r.stdout.strip().splitlines()[-1])
  out["warnings"] = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
  return out


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


def _prefill(stats) -> str:
  folder = os.path.join(stats["compile_cache"], kept_programs.SUBFOLDER)
  (name,) = [f for f in os.listdir(folder)
             if f.startswith("prefill_batch-") and f.endswith(kept_programs.SUFFIX)]
  return os.path.join(folder, name)


def _damage(path: str, how: str) -> None:
  with open(path, "rb") as f:
    data = bytearray(f.read())
  if how == "flip":  # one bit in the middle of the serialized program
    data[len(data) // 2] ^= 0x10
  elif how == "cut":  # a copy cut short
    data = data[:len(data) // 3]
  elif how == "flip under a good checksum":  # damaged before its checksum was made
    payload = bytearray(kept_programs._unpack(bytes(data)))
    payload[len(payload) // 3] ^= 0x04
    data = kept_programs._pack(payload)
  with open(path, "wb") as f:
    f.write(data)


def test_a_damaged_kept_program_is_exported_again_never_run(tmp_path):
  root = str(tmp_path / "xla")
  first = _decode(root)
  assert first["warnings"] == []
  path = _prefill(first["stats"])
  for how in ("flip", "cut", "flip under a good checksum"):
    _damage(path, how)
    with open(path, "rb") as f:
      damaged = f.read()
    run = _decode(root)  # no crash ...
    assert run["tokens"] == first["tokens"], how
    assert len(run["warnings"]) == 1, (how, run["warnings"])  # ... one line, naming it
    assert run["warnings"][0].startswith(f"warning: the kept program {path} does not "), how
    assert run["warnings"][0].endswith("; traced again, and the file replaced")
    with open(path, "rb") as f:
      replaced = f.read()
    assert replaced != damaged and kept_programs._unpack(replaced), how
  again = _decode(root)
  assert again["warnings"] == [] and again["traced"] == 0  # read back, as before
  assert not [f for f in os.listdir(os.path.dirname(path)) if kept_programs.TRIAL in f]


# Reading the prefill program back crashes the process, as a damaged program
# that deserializes can (SIGSEGV); a program exported in the process runs.
CRASH_ON_READ = """
import os, signal
from jax import export
_deserialize = export.deserialize
def _crashing(data):
  exported = _deserialize(data)
  if "prefill" in exported.fun_name:
    os.kill(os.getpid(), signal.SIGSEGV)
  return exported
export.deserialize = _crashing
"""


def test_a_program_that_crashed_its_process_is_exported_again_on_the_next_run(tmp_path):
  import signal
  root = str(tmp_path / "xla")
  first = _decode(root, prelude=CRASH_ON_READ)  # exported, not read: it runs
  path = _prefill(first["stats"])
  crashed = _run(root, prelude=CRASH_ON_READ)  # read back: the process dies in it
  assert crashed.returncode == -signal.SIGSEGV, crashed.stderr[-3000:]
  markers = [f for f in os.listdir(os.path.dirname(path)) if kept_programs.TRIAL in f]
  assert len(markers) == 1 and markers[0].startswith(os.path.basename(path))
  # The next run does not read it (it would crash again): exported again.
  run = _decode(root, prelude=CRASH_ON_READ)
  assert run["tokens"] == first["tokens"]
  assert len(run["warnings"]) == 1, run["warnings"]
  assert run["warnings"][0].startswith(
      f"warning: the kept program {path} was running for the first time in process ")
  assert run["warnings"][0].endswith(" when that process ended (a crash?); traced again, "
                                     "and the file replaced")
  assert not [f for f in os.listdir(os.path.dirname(path)) if kept_programs.TRIAL in f]


def test_kept_files_carry_a_checksum_and_trial_markers_judge_their_process(
    kept_in, monkeypatch, capsys):
  import socket
  import time

  import jax
  import jax.numpy as jnp
  monkeypatch.setenv(kept_programs.ENV, "on")
  plus_one = kept_programs.kept(name="plus_one", static_argnames=())(
      jax.jit(lambda x: x + 1))
  assert plus_one(jnp.ones(3)).tolist() == [2.0] * 3
  (name,) = os.listdir(kept_in)
  path = os.path.join(kept_in, name)
  with open(path, "rb") as f:
    kept = f.read()
  assert kept.startswith(kept_programs.HEADER)
  with pytest.raises(ValueError, match="does not match"):
    kept_programs._unpack(kept[:-1] + bytes([kept[-1] ^ 1]))
  with pytest.raises(ValueError, match="no checksum header"):
    kept_programs._unpack(kept_programs._unpack(kept))  # a file of the older format

  def call(warned: str = ""):
    plus_one.clear()
    assert plus_one(jnp.ones(3)).tolist() == [2.0] * 3
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert err == ([f"warning: the kept program {path} {warned}; traced again, and the "
                    "file replaced"] if warned else [])
    assert not os.path.exists(kept_programs._marker(path))  # this process's trial ended

  call()  # read back, on trial, proven
  # A marker of a process that is gone: suspect, exported again, the marker removed.
  import subprocess as sp
  dead = sp.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  here = socket.gethostname()
  open(f"{path}{kept_programs.TRIAL}.{dead.pid}.{here}", "w").close()
  call(f"was running for the first time in process {dead.pid} on {here} when that "
       "process ended (a crash?)")
  assert os.listdir(kept_in) == [name]
  # A live process's (this host's), or another host's recent one: it may be
  # running it now; left as it is.
  live = f"{path}{kept_programs.TRIAL}.{os.getppid()}.{here}"
  other = f"{path}{kept_programs.TRIAL}.1234.another-host"
  open(live, "w").close()
  open(other, "w").close()
  call()
  assert os.path.exists(live) and os.path.exists(other)
  os.remove(live)
  old = time.time() - kept_programs.TRIAL_SECONDS - 60  # another host's, long gone
  os.utime(other, (old, old))
  call("was running for the first time in process 1234 on another-host when that "
       "process ended (a crash?)")
  assert os.listdir(kept_in) == [name]
  # The older format (no checksum): exported again, with one.
  with open(path, "wb") as f:
    f.write(kept_programs._unpack(kept))
  call("does not read back (no checksum header: damaged, or of an older format)")
  with open(path, "rb") as f:
    assert f.read() == kept
