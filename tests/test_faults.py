"""Faults: interrupted runs (Ctrl-C, SIGTERM, a killed save), two runs on one
folder, a changed config on resume, a sweep that ran nothing but its baseline,
output kept without a tokenizer. Each ends in one line or the right behaviour,
and a rerun goes on with nothing lost or repeated."""

from __future__ import annotations

import csv
import gc
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest

import flexdraft_jax as fd
from flexdraft_jax import run_control
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.training import regen_store, regenerate, train
from tests import data_fixture, tiny

REPO = tiny.REPO
TINY = os.path.join(REPO, "configs", "tiny_test.py")


def _steps(workdir) -> list:
  with open(os.path.join(workdir, "metrics.csv")) as f:
    return [int(r["step"]) for r in csv.DictReader(f)]


def _ckpts(workdir) -> list:
  return sorted(int(s) for s in os.listdir(os.path.join(workdir, "ckpt")) if s.isdigit())


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def _lines(err: str) -> list:
  """stderr without absl's log lines and progress bars."""
  return [x for x in err.replace("\r", "\n").splitlines()
          if x.strip() and not re.match(r"[IWEF]\d{4} ", x) and not re.search(r"s/it|it/s", x)]


@pytest.fixture(scope="module")
def regen(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("regen"))
  tiny.write_fake_regen(d, tiny.tiny_target(), n=24)
  return d


# ---------------------------------------------------------------- lock ----

def test_folder_lock_names_its_holder_and_takes_over_a_stale_one(tmp_path, capsys):
  d = str(tmp_path)
  lock = os.path.join(d, run_control.LOCK_FILE)
  with run_control.folder_lock(d, "train"):
    held = json.load(open(lock))
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    with pytest.raises(FlexDraftError) as e:
      with run_control.folder_lock(d, "eval"):
        pass
    assert str(e.value).startswith(f"--workdir {d} is in use by train (process "
                                   f"{os.getpid()} on {socket.gethostname()} since ")
    assert str(e.value).endswith("): wait for it to end, or use another folder")
  assert not os.path.exists(lock)  # released
  # a lock left by a process that is gone (killed: no cleanup) is taken over
  dead = _dead_pid()
  with open(lock, "w") as f:
    json.dump({"pid": dead, "host": socket.gethostname(), "since": time.time(),
               "command": "regenerate"}, f)
  with run_control.folder_lock(d, "train"):
    assert json.load(open(lock))["pid"] == os.getpid()
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith(
      f"train: taking over the lock of regenerate (process {dead} on "
      f"{socket.gethostname()} since ")
  assert err[0].endswith("), which is no longer running")


def test_held_signals_wait_for_the_caller_and_a_second_one_acts_at_once():
  before = signal.getsignal(signal.SIGTERM)
  with run_control.stop_on_signals():
    with run_control.held():
      signal.raise_signal(signal.SIGTERM)
      with run_control.critical():  # a write inside: still held when it ends
        pass
      assert run_control.pending() == signal.SIGTERM
      with pytest.raises(run_control.Stopped) as e:
        signal.raise_signal(signal.SIGINT)  # Ctrl-C again: no waiting
        time.sleep(1)
      assert e.value.signum == signal.SIGINT
  assert run_control.pending() is None
  assert signal.getsignal(signal.SIGTERM) is before  # the handlers are given back


class _SignalInGc:
  """A gc callback that sends `signals` to this process, one per call, while
  `armed()`: Python drops what a signal handler raises in a gc callback."""

  def __init__(self, *signals, armed=lambda: True):
    self.signals, self.armed, self.sent = list(signals), armed, []

  def __call__(self, phase, info):
    if self.signals and self.armed():
      self.sent.append(self.signals[0])
      signal.raise_signal(self.signals.pop(0))
      sum(range(100))  # bytecode in the callback, where the handler runs

  def __enter__(self):
    gc.callbacks.append(self)
    return self

  def __exit__(self, *exc):
    gc.callbacks.remove(self)


def test_a_stop_raised_in_a_gc_callback_is_not_lost(capsys):
  before = signal.getsignal(signal.SIGTERM)
  collected = []
  with run_control.stop_on_signals():
    with _SignalInGc(signal.SIGINT) as inject, pytest.raises(run_control.Stopped) as e:
      for i in range(3):
        gc.collect()  # the Stopped raised in the callback is dropped here ...
        collected.append(i)
        run_control.check()  # ... and raised again here
    assert inject.sent == [signal.SIGINT] and collected == [0]
    assert e.value.signum == signal.SIGINT
    # A second signal is still the project's (Python's default would end the
    # process on SIGTERM): it raises at once.
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    with pytest.raises(run_control.Stopped) as e:
      signal.raise_signal(signal.SIGTERM)
      time.sleep(1)
    assert e.value.signum == signal.SIGTERM
  assert signal.getsignal(signal.SIGTERM) is before
  run_control.check()  # the run is over: nothing is left to raise
  assert "Exception ignored" not in capsys.readouterr().err  # not reported as lost


def test_generate_stops_on_a_signal_that_landed_in_a_gc_callback(monkeypatch):
  from flexdraft_jax.decoding import driver
  target = tiny.tiny_target()
  chunk, calls, collecting, collected = driver.Driver._chunk, [], [], []

  def chunk_then_collect(self, *a, **k):  # a collection after the first chunk
    out = chunk(self, *a, **k)
    calls.append(1)
    if len(calls) == 1:
      collecting.append(1)
      gc.collect()
      collecting.pop()
      collected.append(1)
    return out

  monkeypatch.setattr(driver.Driver, "_chunk", chunk_then_collect)
  stream = dict(runtime=fd.RuntimeOptions(steps_per_call=2))
  with run_control.stop_on_signals(), _SignalInGc(signal.SIGTERM, armed=lambda: collecting):
    with pytest.raises(run_control.Stopped) as e:
      list(fd.generate_stream(target, [[3, 4, 5]], max_new_tokens=40, **stream))
  assert e.value.signum == signal.SIGTERM
  assert collected == [1]  # the collection ended: its callback's Stopped was dropped
  assert len(calls) == 1  # and the next chunk did not start: raised again there


def test_a_command_stopped_twice_in_gc_callbacks_ends_cleanly(tmp_path):
  """`python -m flexdraft_jax generate`, two SIGTERMs landing in gc callbacks
  while it decodes: one stop line, exit 128 + 15, through `exit_now` (no
  teardown while a computation may be in flight)."""
  script = (
      "import gc, os, runpy, signal, sys\n"
      "from flexdraft_jax.decoding import driver\n"
      "chunk, collecting, sent = driver.Driver._chunk, [], []\n"
      "def chunk_then_collect(self, *a, **k):\n"
      "  out = chunk(self, *a, **k)\n"
      "  collecting.append(1)\n"
      "  gc.collect()\n"
      "  collecting.pop()\n"
      "  return out\n"
      "driver.Driver._chunk = chunk_then_collect\n"
      "def term(phase, info):  # at the collection's start, then at its end\n"
      "  if collecting and len(sent) < 2:\n"
      "    sent.append(phase)\n"
      "    signal.raise_signal(signal.SIGTERM)\n"
      "    sum(range(100))\n"
      "gc.callbacks.append(term)\n"
      "sys.argv = ['flexdraft_jax'] + sys.argv[1:]\n"
      "runpy.run_module('flexdraft_jax', run_name='__main__')\n")
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", FLEXDRAFT_COST_CACHE="",
             FLEXDRAFT_COMPILE_CACHE=str(tmp_path / "xla"))
  args = ["generate", "--model", "random:tiny", "--prompt", "hi", "--max-new-tokens", "200",
          "--stream"]  # chunks of 16 steps
  r = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 128 + signal.SIGTERM, r.stderr[-3000:]  # not -15 (killed), 139
  assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
  assert [x for x in _lines(r.stderr) if "stopped" in x or " tokens, decode " in x] == [
      "stopped by SIGTERM: generate stopped; to resume, run: python -m flexdraft_jax "
      + " ".join(args)]


def test_a_second_train_on_a_workdir_gets_one_line(tmp_path, regen, capsys):
  w = str(tmp_path / "w")
  os.makedirs(w)
  argv = ["flexdraft_jax train", f"--config={TINY}", f"--config.data.regen_dir={regen}",
          "--workdir", w]
  with run_control.folder_lock(w, "train"):  # the first run, still going
    with pytest.raises(SystemExit) as e:
      train.run(argv)
  assert e.value.code == 1
  err = capsys.readouterr().err
  assert "Traceback" not in err
  assert err.strip().splitlines()[-1].startswith(
      f"error: --workdir {w} is in use by train (process {os.getpid()} on ")
  assert not os.path.exists(os.path.join(w, "ckpt"))  # it wrote nothing


# ------------------------------------------------------- interrupting train ----

def test_train_interrupted_after_and_mid_checkpoint_resumes_every_step_once(
    tmp_path, regen, monkeypatch, capfd):
  w = str(tmp_path / "run")
  flags = [f"--config={TINY}", f"--config.data.regen_dir={regen}",
           "--config.train.seq_len=48", "--config.train.ckpt_every=2",
           "--config.train.eval_every=4", "--config.train.log_every=1"]
  # 1. Ctrl-C on the command line once a checkpoint is complete.
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  args = ["train", *flags, "--config.train.num_steps=100000", "--workdir", w]
  # `python -m flexdraft_jax ARGS` with Ctrl-C's default handler (a job started
  # in the background inherits SIGINT ignored)
  cmd = [sys.executable, "-c", "import runpy, signal, sys; "
         "signal.signal(signal.SIGINT, signal.default_int_handler); "
         "sys.argv = ['flexdraft_jax'] + sys.argv[1:]; "
         "runpy.run_module('flexdraft_jax', run_name='__main__')", *args]
  p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  t0 = time.time()
  while not os.path.isdir(os.path.join(w, "ckpt", "4")) and p.poll() is None:
    assert time.time() - t0 < 300, "no checkpoint in 300 s"
    time.sleep(0.05)
  p.send_signal(signal.SIGINT)
  out, err = p.communicate(timeout=300)
  assert p.returncode == 128 + signal.SIGINT, err[-3000:]
  assert "Traceback" not in err and "RuntimeError" not in err, err[-3000:]
  stopped = [x for x in _lines(err) if x.startswith("stopped")]
  first = max(_ckpts(w))
  assert stopped and stopped == [x for x in _lines(err) if "stopped" in x]
  # the step it reached is the checkpoint it stopped with
  assert stopped[0].startswith(f"stopped by SIGINT: train at step {first}; ")
  assert stopped[0].endswith(
      f"; checkpoint {first} is complete in {w}/ckpt; to resume, run: python -m "
      f"flexdraft_jax train {' '.join(flags)} --config.train.num_steps=100000 "
      f"--workdir {w}")
  assert not glob.glob(os.path.join(w, "ckpt", "*tmp*"))
  assert not os.path.exists(os.path.join(w, run_control.LOCK_FILE))
  assert _steps(w)[:first] == list(range(1, first + 1))

  # 2. SIGTERM (a scheduler) while a checkpoint is being written: the save in
  # flight is finished, then the run stops.
  end = first + 8
  at = first + 4 - first % 2  # a periodic save (the stop above saved the step it reached)
  cfg = tiny.tiny_config(regen, num_steps=end, ckpt_every=2, eval_every=4, log_every=1)
  save, seen = ocp.CheckpointManager.save, {}

  def save_then_term(self, step, *a, **k):
    out = save(self, step, *a, **k)
    if step == at:
      seen["in_flight"] = not os.path.isdir(os.path.join(w, "ckpt", str(step)))
      signal.raise_signal(signal.SIGTERM)
    return out

  monkeypatch.setattr(ocp.CheckpointManager, "save", save_then_term)
  with run_control.stop_on_signals(), pytest.raises(run_control.Stopped) as e:
    train.train(cfg, w)
  monkeypatch.undo()
  assert seen == {"in_flight": True}
  assert e.value.signum == signal.SIGTERM
  assert e.value.where == (f"train at step {at}; checkpoint {at} is "
                           f"complete in {w}/ckpt")
  assert at in _ckpts(w) and not glob.glob(os.path.join(w, "ckpt", "*tmp*"))
  assert not os.path.exists(os.path.join(w, run_control.LOCK_FILE))

  # 3. A save cut short by SIGKILL leaves its temporary folder: the rerun
  # removes it and goes on from the last complete checkpoint to the end.
  shutil.copytree(os.path.join(w, "ckpt", str(at)),
                  os.path.join(w, "ckpt", f"{at + 2}.orbax-checkpoint-tmp-1234"))
  result = train.train(cfg, w)
  assert result.summary["steps"] == end
  assert _steps(w) == list(range(1, end + 1))  # every step once, in order
  assert not glob.glob(os.path.join(w, "ckpt", "*tmp*"))
  assert end in _ckpts(w)
  assert os.path.isfile(os.path.join(w, "final_drafter", "drafter.json"))
  assert "Traceback" not in capfd.readouterr().err

  # 4. Resuming with another drafter shape or another target: one line.
  cfg.train.num_steps = end + 2
  cfg.drafter.num_layers = 1
  with pytest.raises(FlexDraftError) as e:
    train.train(cfg, w)
  assert str(e.value) == (f"--workdir {w} holds checkpoints of another drafter shape "
                          "(drafter.num_layers=2 there, 1 here): use another --workdir, "
                          "or the config it was started with")
  cfg.drafter.num_layers, cfg.target = 2, "random:tiny:1"
  with pytest.raises(FlexDraftError, match=rf"^--workdir {w} holds checkpoints of target "
                     r"random:tiny:0 \(fingerprint \w+\), not random:tiny:1 \(\w+\): "
                     "use another --workdir$"):
    train.train(cfg, w)
  assert "Traceback" not in capfd.readouterr().err
  assert _steps(w) == list(range(1, end + 1))  # nothing touched


def _train_cmd(args):
  """`python -m flexdraft_jax ARGS` as a scheduler starts it (SIGTERM: its default)."""
  return [sys.executable, "-c", "import runpy, sys; sys.argv = ['flexdraft_jax'] + "
          "sys.argv[1:]; runpy.run_module('flexdraft_jax', run_name='__main__')", *args]


def test_sigterm_between_checkpoints_saves_the_step_reached_and_resumes_there(tmp_path,
                                                                             regen):
  w = str(tmp_path / "run")
  flags = [f"--config={TINY}", f"--config.data.regen_dir={regen}",
           "--config.train.seq_len=48", "--config.train.ckpt_every=1000",
           "--config.train.eval_every=0", "--config.train.log_every=1"]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  p = subprocess.Popen(_train_cmd(["train", *flags, "--config.train.num_steps=100000",
                                   "--workdir", w]),
                       env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
  metrics, t0 = os.path.join(w, "metrics.csv"), time.time()
  while p.poll() is None and not (os.path.exists(metrics) and len(_steps(w)) >= 3):
    assert time.time() - t0 < 300, "no third step in 300 s"
    time.sleep(0.05)
  seen = len(_steps(w))
  p.send_signal(signal.SIGTERM)  # well before the first periodic checkpoint (1000)
  out, err = p.communicate(timeout=300)
  assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  stopped = [x for x in _lines(err) if "stopped" in x]
  assert len(stopped) == 1, err[-3000:]
  reached = int(re.match(r"stopped by SIGTERM: train at step (\d+); ", stopped[0]).group(1))
  assert reached >= seen
  assert stopped[0].startswith(f"stopped by SIGTERM: train at step {reached}; checkpoint "
                               f"{reached} is complete in {w}/ckpt; to resume, run: ")
  assert _ckpts(w) == [reached]  # the step it reached, saved on the way out
  assert _steps(w) == list(range(1, reached + 1))
  # the rerun resumes there and goes on: every step in metrics.csv once
  result = train.train(tiny.tiny_config(regen, num_steps=reached + 2, ckpt_every=1000,
                                        eval_every=0, log_every=1), w)
  assert result.summary["steps"] == reached + 2
  assert _steps(w) == list(range(1, reached + 3))
  assert result.summary["tokens_seen"] > 0


def test_diverging_training_stops_in_one_line_and_saves_nothing_non_finite(tmp_path, regen,
                                                                           capsys):
  import numpy as np
  from flexdraft_jax.drafter import checkpoint as drafter_ckpt
  w = str(tmp_path / "run")
  argv = ["flexdraft_jax train", f"--config={TINY}", f"--config.data.regen_dir={regen}",
          "--config.train.seq_len=48", "--config.train.lr=1e12",
          "--config.train.ckpt_every=1", "--config.train.eval_every=1", "--workdir", w]
  with pytest.raises(SystemExit) as e:
    train.run(argv)
  assert e.value.code == 1
  err = capsys.readouterr().err
  assert "Traceback" not in err
  (line,) = [x for x in _lines(err) if x.startswith("error:")]
  m = re.match(r"error: training diverged at step (\d+) \((loss \S+, grad norm \S+|the "
               r"weights are no longer finite)\); nothing non-finite was saved and "
               rf"checkpoint (\d+) in {w}/ckpt is the last finite one \(a rerun resumes "
               r"there\): lower --config.train.lr \(now 1e\+12\) and rerun$", line)
  assert m, line
  step, last = int(m.group(1)), int(m.group(3))
  assert last == max(_ckpts(w)) < step
  assert not os.path.exists(os.path.join(w, "final_drafter"))
  assert not os.path.exists(os.path.join(w, "summary.json"))  # no claim of success
  for d in ("best_drafter",):  # what was kept is finite
    drafter = drafter_ckpt.load_drafter(os.path.join(w, d), tiny.tiny_target())
    import jax
    assert all(np.isfinite(np.asarray(x, np.float32)).all()
               for x in jax.tree.leaves(drafter.params))
  # every checkpoint kept holds finite weights
  mngr = ocp.CheckpointManager(os.path.join(w, "ckpt"))
  for s in _ckpts(w):
    state = mngr.restore(s, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))
  mngr.close()


def test_a_non_finite_update_is_caught_before_the_weights_are_kept(tmp_path, regen,
                                                                    monkeypatch):
  # finite metrics, weights gone NaN: the check before a checkpoint stops the run
  import jax
  import jax.numpy as jnp
  w = str(tmp_path / "run")
  cfg = tiny.tiny_config(regen, num_steps=4, ckpt_every=2, eval_every=0, log_every=1)
  make = train.make_steps

  def spoiling(*a, **k):
    step, ev = make(*a, **k)

    def spoilt(state, tp, batch):
      state, m = step(state, tp, batch)
      bad = jax.tree.map(lambda x: jnp.where(state.step >= 4, jnp.nan, x), state.params)
      return state._replace(params=bad), m
    return spoilt, ev

  monkeypatch.setattr(train, "make_steps", spoiling)
  with pytest.raises(FlexDraftError, match=rf"^training diverged at step 4 \(the weights "
                     rf"are no longer finite\); nothing non-finite was saved and checkpoint 2 "
                     rf"in {w}/ckpt is the last finite one"):
    train.train(cfg, w)
  assert _ckpts(w) == [2] and not os.path.exists(os.path.join(w, "final_drafter"))
  assert not os.path.exists(os.path.join(w, "best_drafter"))


def _tree(folder) -> dict:
  return {f: open(f, "rb").read() for f in glob.glob(os.path.join(folder, "**"),
                                                     recursive=True) if os.path.isfile(f)}


def test_resuming_a_damaged_latest_checkpoint_is_one_line_offering_the_intact_one(
    tmp_path, regen, capfd):
  w = str(tmp_path / "run")
  train.train(tiny.tiny_config(regen, num_steps=4, ckpt_every=2, eval_every=0), w)
  ckpt = os.path.join(w, "ckpt")
  argv = ["flexdraft_jax train", f"--config={TINY}", f"--config.data.regen_dir={regen}",
          "--config.train.seq_len=48", "--config.train.num_steps=8",
          "--config.train.ckpt_every=2", "--config.train.eval_every=0", "--workdir", w]

  def resume_fails() -> str:
    before = _tree(w)
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
      train.run(argv)
    assert e.value.code == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0]
    assert _tree(w) == before  # nothing moved, deleted or written
    return errors[0]

  # 1. a partial copy: step 6 holds its records but none of its arrays
  os.makedirs(os.path.join(ckpt, "6", "state"))
  for name in ("_CHECKPOINT_METADATA", "meta"):
    src = os.path.join(ckpt, "4", name)
    (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(ckpt, "6", name))
  shutil.copy(os.path.join(ckpt, "4", "state", "_METADATA"), os.path.join(ckpt, "6", "state"))
  line = resume_fails()
  assert re.fullmatch(
      rf"error: --workdir {w}: checkpoint 6 is incomplete or damaged \(a partial copy, or "
      rf"cut files: .+\); checkpoint 4 is intact: move {ckpt}/6 out of {ckpt} to resume "
      r"from step 4", line), line
  shutil.rmtree(os.path.join(ckpt, "6"))
  # 2. cut data files: blamed on the checkpoint, not on the config
  for f in glob.glob(os.path.join(ckpt, "4", "state", "ocdbt.process_0", "d", "*")):
    with open(f, "r+b") as fh:
      fh.truncate(os.path.getsize(f) // 2)
  line = resume_fails()
  assert "does not fit this config" not in line
  assert re.fullmatch(
      rf"error: --workdir {w}: checkpoint 4 is incomplete or damaged \(a partial copy, or "
      rf"cut files: .+\); checkpoint 2 is intact: move {ckpt}/4 out of {ckpt} to resume "
      r"from step 2", line), line
  # moved aside as the line says, the run resumes from step 2
  os.rename(os.path.join(ckpt, "4"), str(tmp_path / "4.damaged"))
  with pytest.raises(SystemExit) as e:
    train.run(argv)
  assert e.value.code in (0, None)
  assert "steps 2..8" in capfd.readouterr().out
  assert _steps(w) == list(range(1, 9))


def test_resumed_metrics_drop_a_row_a_killed_run_cut_short(tmp_path):
  from flexdraft_jax.training.metrics_log import MetricsLog
  log = MetricsLog(str(tmp_path), ["step", "loss", "tau"])
  for step in (1, 2, 3):
    log.write(step, {"loss": 1.0, "tau": 2.0})
  log.close()
  with open(tmp_path / "metrics.csv", "a") as f:
    f.write("4,0.5")  # killed mid-line
  MetricsLog(str(tmp_path), ["step", "loss", "tau"], resume_step=4).close()
  assert _steps(str(tmp_path)) == [1, 2, 3]


# -------------------------------------------------- interrupting regenerate ----

def _regenerate_interrupted(tmp_path, monkeypatch, mbpp: int):
  """A tiny regenerate (4 GSM8K + `mbpp` MBPP prompts, 2 a shard) stopped by
  Ctrl-C while its first shard is written; returns (regen_dir, argv)."""
  monkeypatch.setenv("FLEXDRAFT_DATA", data_fixture.write(str(tmp_path / "data")))
  regen_dir = str(tmp_path / "regen")
  argv = ["flexdraft_jax regenerate", f"--config={TINY}",
          f"--config.data.regen_dir={regen_dir}", "--config.data.max_new_tokens=3",
          "--config.data.batch_size=2", "--config.data.mix.gsm8k=4",
          f"--config.data.mix.mbpp={mbpp}", "--config.data.mix.arena_hard_v01=0"]
  write = regen_store.write_shard

  def write_then_interrupt(*a, **k):
    out = write(*a, **k)
    signal.raise_signal(signal.SIGINT)  # Ctrl-C while the shard is written
    return out

  with monkeypatch.context() as m, pytest.raises(SystemExit) as e:
    m.setattr(regen_store, "write_shard", write_then_interrupt)
    regenerate.run(argv)
  assert e.value.code == 128 + signal.SIGINT
  return regen_dir, argv


def test_regenerate_interrupted_keeps_its_shards_and_resumes(tmp_path, monkeypatch, capsys):
  regen_dir, argv = _regenerate_interrupted(tmp_path, monkeypatch, mbpp=2)
  err = capsys.readouterr().err
  assert "Traceback" not in err
  shards = regen_store.shard_dir(regen_dir)
  assert err.strip().splitlines()[-1] == (
      f"stopped by SIGINT: regenerate after 2 new answers; 1 shards kept in {shards} "
      "(the dataset is built when a run ends); to resume, run: python -m flexdraft_jax "
      f"regenerate {' '.join(argv[1:])}")
  assert os.listdir(shards) == ["shard-00000.jsonl"]
  assert not os.path.exists(os.path.join(regen_dir, run_control.LOCK_FILE))
  first = regen_store.read_shards(regen_dir)
  with pytest.raises(SystemExit) as e:
    regenerate.run(argv)
  assert e.value.code in (0, None)
  assert "regenerate: 2 answered, 4 to answer" in capsys.readouterr().out
  uids = [r.uid for r in regen_store.load_records(regen_dir)]
  assert len(uids) == len(set(uids)) == 6  # every prompt of the mix (4 + 2) once
  assert regen_store.read_shards(regen_dir)[:2] == first  # kept, not answered again


def test_regenerate_stopped_early_refuses_a_rerun_with_other_settings(tmp_path, monkeypatch,
                                                                      capsys):
  # The settings are on disk before the first shard: a run stopped before its end
  # (before it used to write meta.json) cannot be continued with others.
  from flexdraft_jax.model import loading
  regen_dir, argv = _regenerate_interrupted(tmp_path, monkeypatch, mbpp=0)
  meta_path = os.path.join(regen_dir, "meta.json")
  assert json.load(open(meta_path))["max_new_tokens"] == 3  # written before the shard
  before = _tree(regen_dir)

  def no_model(*a, **k):
    raise AssertionError("the model was loaded before the settings were checked")

  capsys.readouterr()
  for flag, line in (
      ("--config.data.max_new_tokens=20", "max_new_tokens=3, not 20"),
      ("--config.dtype=bfloat16", "dtype='float32', not 'bfloat16'")):
    with monkeypatch.context() as m, pytest.raises(SystemExit) as e:
      m.setattr(loading, "load_target", no_model)
      regenerate.run(argv + [flag])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        f"error: {regen_dir} holds answers with {line}; use another "
        "--config.data.regen_dir"]
    assert _tree(regen_dir) == before  # nothing written, nothing removed

  # shards without a meta.json (a run of an earlier version, stopped before its
  # end): what made them is unknown, so nothing is added to them
  os.remove(meta_path)
  with pytest.raises(FlexDraftError, match=rf"^{regen_dir} holds 1 shards of answers but no "
                     r"meta.json saying which target and settings made them; use another "
                     r"--config.data.regen_dir$"):
    regenerate.regenerate(tiny.tiny_config(regen_dir))
  assert not os.path.exists(meta_path)


# -------------------------------------------------------------- eval ----

def _eval_argv(workdir, prompts_file, modes):
  return ["flexdraft_jax eval", f"--config={os.path.join(REPO, 'configs', 'eval_smollm2.py')}",
          "--workdir", workdir, "--config.target=random:tiny", "--config.drafter=",
          "--config.random_drafter.num_layers=2", "--config.random_drafter.block_size=4",
          "--config.random_drafter.calib_rank=16", f"--config.eval.prompts_file={prompts_file}",
          "--config.eval.datasets=gsm8k", "--config.eval.batch_sizes=1",
          f"--config.eval.modes={modes}", "--config.eval.max_new_tokens=4",
          "--config.eval.max_len=128", "--config.eval.theta=0",
          "--config.eval.warmup=False", "--config.ablation.enabled=False"]


@pytest.fixture
def prompts_file(tmp_path):
  path = tmp_path / "prompts.json"
  path.write_text(json.dumps({"gsm8k": ["What is 2+3?"]}))
  return str(path)


def test_eval_interrupted_keeps_its_cells_and_resumes(tmp_path, prompts_file, monkeypatch,
                                                      capsys):
  from flexdraft_jax.evaluation import cells, sweep
  w = str(tmp_path / "eval")
  argv = _eval_argv(w, prompts_file, "ar,sequential")
  run_cell, calls = cells.run_cell, []

  def term_in_second_cell(*a, **k):
    calls.append(1)
    if len(calls) == 2:
      signal.raise_signal(signal.SIGTERM)  # a scheduler, while the cell runs
    return run_cell(*a, **k)

  monkeypatch.setattr(cells, "run_cell", term_in_second_cell)
  with pytest.raises(SystemExit) as e:
    sweep.run(argv)
  monkeypatch.undo()
  assert e.value.code == 128 + signal.SIGTERM
  err = capsys.readouterr().err
  assert "Traceback" not in err
  assert err.strip().splitlines()[-1] == (
      f"stopped by SIGTERM: eval with 1 cells done, kept in {w}/results.json (results.md "
      "is written when a sweep ends); to resume, run: python -m flexdraft_jax eval "
      f"{' '.join(argv[1:])}")
  assert not os.path.exists(os.path.join(w, run_control.LOCK_FILE))
  with pytest.raises(SystemExit) as e:
    sweep.run(argv)
  assert e.value.code in (0, None)
  assert "1 cells run, 1 already done" in capsys.readouterr().out


def test_eval_rerun_with_other_settings_is_refused_even_before_its_first_cell(
    tmp_path, prompts_file, monkeypatch, capsys):
  # A bfloat16 rerun into a float32 workdir said "0 cells run, 2 already done"
  # and reported the float32 cells as its own.
  from flexdraft_jax import api
  from flexdraft_jax.evaluation import cells, sweep
  w = str(tmp_path / "eval")
  argv = _eval_argv(w, prompts_file, "ar,sequential")
  results = os.path.join(w, "results.json")
  run_cell = cells.run_cell

  def term_in_first_cell(*a, **k):
    signal.raise_signal(signal.SIGTERM)
    return run_cell(*a, **k)

  with monkeypatch.context() as m, pytest.raises(SystemExit) as e:
    m.setattr(cells, "run_cell", term_in_first_cell)
    sweep.run(argv)
  assert e.value.code == 128 + signal.SIGTERM
  kept = json.load(open(results))  # the settings are on disk before any cell
  assert kept["cells"] == {} and kept["meta"]["settings"]["dtype"] == "float32"

  def no_model(*a, **k):
    raise AssertionError("the model was loaded before the settings were checked")

  def refused(extra, line):
    before = _tree(w)
    capsys.readouterr()
    with monkeypatch.context() as m, pytest.raises(SystemExit) as e:
      m.setattr(api, "load_target", no_model)
      sweep.run(argv + extra)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [f"error: {w} holds results for {line}; use "
                                        "another --workdir"]
    assert _tree(w) == before  # nothing written

  refused(["--config.dtype=bfloat16"], "dtype='float32', not 'bfloat16'")
  with pytest.raises(SystemExit) as e:  # the same settings resume
    sweep.run(argv)
  assert e.value.code in (0, None)
  assert "eval: 2 cells run, 0 already done" in capsys.readouterr().out
  refused(["--config.dtype=bfloat16"], "dtype='float32', not 'bfloat16'")
  refused(["--config.eval.lossless_tol=0.5"], "eval.lossless_tol=1e-05, not 0.5")
  assert "target in float32" in open(os.path.join(w, "results.md")).read()


def test_eval_that_ran_nothing_but_the_baseline_says_so_and_fails(tmp_path, prompts_file,
                                                                 monkeypatch, capsys):
  # A drafter trained only to read the bonus: the sweep leaves its parallel
  # cells out; with nothing else asked, only AR ran.
  from flexdraft_jax.drafter.model import Drafter, DrafterConfig, init_draft_params
  from flexdraft_jax.evaluation import sweep
  import jax

  def bonus_drafter(config, target):
    dcfg = DrafterConfig(num_layers=1, block_size=4, calib_rank=8, bonus_input=True)
    params = init_draft_params(target.params, target.config, dcfg, jax.random.PRNGKey(0))
    return Drafter(dcfg, params, target.fingerprint), {
        "kind": "trained", "path": "", "id": "bonus", "note": "",
        "config": {"num_layers": 1, "block_size": 4}}

  monkeypatch.setattr(sweep, "load_main_drafter", bonus_drafter)
  w = str(tmp_path / "eval")
  with pytest.raises(SystemExit) as e:
    sweep.run(_eval_argv(w, prompts_file, "ar,parallel"))
  assert e.value.code == 1
  err = capsys.readouterr().err
  key = "gsm8k|bs=1|parallel|T=0|theta=0|drafter=main"
  assert err.strip().splitlines()[-1] == (
      "error: nothing but the AR baseline ran: 1 cells skipped (parallel mode drafts "
      "before the bonus is known and this drafter was trained to read it (bonus_input "
      f"without bonus_dropout)); {w}/results.md lists them")
  md = open(os.path.join(w, "results.md")).read()
  assert "> **1 cells were skipped**" in md and "## Skipped cells" in md
  assert f"| {key} | parallel mode drafts before the bonus is known" in md
  results = json.load(open(os.path.join(w, "results.json")))
  assert list(results["skipped_cells"]) == [key] and key not in results["cells"]


# ---------------------------------------------------- the answers cache ----

def test_answers_cache_answers_other_prompts_of_a_benchmark_anew(tmp_path, monkeypatch):
  # offline-tau's cache is keyed by benchmark, limit, max_new_tokens and target: a
  # --data_dir with other gsm8k prompts got the cached answers to the first ones.
  from flexdraft_jax.training import offline_tau
  target, cache = tiny.tiny_target(), str(tmp_path / "answers.json")
  first = data_fixture.write(str(tmp_path / "a"))
  other = data_fixture.write(str(tmp_path / "b"))
  test = os.path.join(other, "gsm8k", "test.jsonl")
  rows = [json.loads(x) for x in open(test)]
  with open(test, "w") as f:
    for r in rows:
      f.write(json.dumps(dict(r, question="Another question: " + r["question"])) + "\n")
  answered = []
  generate = fd.generate
  monkeypatch.setattr(fd, "generate", lambda *a, **k: answered.append(1) or generate(*a, **k))

  def answers(data_dir):
    return offline_tau.benchmark_answers(target, "gsm8k", data_dir, limit=2,
                                         max_new_tokens=3, batch_size=2, cache=cache)

  a = answers(first)
  b = answers(other)
  assert len(answered) == 2 and a["prompts"] != b["prompts"]
  assert answers(first) == a and answers(other) == b and len(answered) == 2  # both kept
  assert len(json.load(open(cache))) == 2


# ------------------------------------------------------------ generate ----

def test_ids_decoded_without_a_tokenizer_are_returned():
  target = tiny.tiny_target()
  ref = fd.generate(target, [[3, 4, 5]], max_new_tokens=4)
  out = fd.generate(target._replace(tokenizer=None), [[3, 4, 5]], max_new_tokens=4)
  assert out.token_ids == ref.token_ids and len(out.token_ids[0]) == 4
  assert out.texts == [None] and ref.texts[0]
  with pytest.raises(FlexDraftError, match="stop string 'a' needs a tokenizer"):
    fd.generate(target._replace(tokenizer=None), [[3, 4, 5]], max_new_tokens=4, stop=["a"])


def test_hard_limits_hold_whatever_max_len_says():
  target = tiny.tiny_target()
  n = target.config.max_position_embeddings
  with pytest.raises(FlexDraftError, match=f"exceeds the model's context of {n}"):
    fd.generate(target, [[3] * (n - 2)], max_new_tokens=4,
                runtime=fd.RuntimeOptions(max_len=2 * n))
  # a cache exactly as long as the request needs is used as it is
  out = fd.generate(target, [[3, 4, 5]], max_new_tokens=4,
                    runtime=fd.RuntimeOptions(max_len=3 + 4 + 3))
  assert len(out.token_ids[0]) == 4
  with pytest.raises(FlexDraftError, match=r"max_len=9 is too short: .* needs 10 "):
    fd.generate(target, [[3, 4, 5]], max_new_tokens=4, runtime=fd.RuntimeOptions(max_len=9))
  # an absurd cache (memory for positions no request reaches) is one line
  with pytest.raises(FlexDraftError, match=rf"^runtime\.max_len=100000000 is beyond the model's "
                     rf"context of {n} \(a cache of \d+ holds every request\)"):
    fd.generate(target, [[3, 4, 5]], max_new_tokens=4,
                runtime=fd.RuntimeOptions(max_len=10 ** 8))


# ------------------------------------------------- outputs and endless loops ----

def test_learning_curve_without_out_writes_beside_the_run_not_into_the_checkout(
    tmp_path, monkeypatch, capsys):
  from flexdraft_jax.training import learning_curve
  tracked = os.path.join(REPO, "docs", "results", "learning_curve.md")
  before = open(tracked, "rb").read() if os.path.exists(tracked) else None
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.csv").write_text(
      "step,mask_rows,eval_tau,eval_acc_1,eval_acc_2,eval_acc_3,eval_acc_4\n"
      "4,1000,2.0,0.5,0.4,0.3,0.2\n8,2000,2.2,0.5,0.4,0.3,0.2\n")
  monkeypatch.chdir(REPO)  # where the old default (docs/results/…) was overwritten
  with pytest.raises(SystemExit) as e:
    learning_curve.run(["flexdraft_jax learning-curve", f"--metrics={run}/metrics.csv"])
  assert e.value.code in (0, None)
  assert capsys.readouterr().out.splitlines()[-1] == (
      f"learning-curve: wrote {run}/learning_curve.png and .md")
  assert (run / "learning_curve.md").read_text().startswith("| mask rows | offline τ |")
  assert (run / "learning_curve.png").stat().st_size > 0
  assert (open(tracked, "rb").read() if os.path.exists(tracked) else None) == before


def test_add_ngram_out_replaces_only_a_drafter_it_can_read(tmp_path):
  from flexdraft_jax.drafter import checkpoint as drafter_ckpt
  from flexdraft_jax.drafter.model import Drafter, DrafterConfig, init_draft_params
  from flexdraft_jax.training import add_ngram
  import jax
  target = tiny.tiny_target()
  dcfg = DrafterConfig(num_layers=1, block_size=4, calib_rank=8)
  old = str(tmp_path / "old")
  drafter_ckpt.save_drafter(old, Drafter(dcfg, init_draft_params(
      target.params, target.config, dcfg, jax.random.PRNGKey(0)), target.fingerprint), target)
  add_ngram.check_out(old)                         # an earlier drafter: replaced
  add_ngram.check_out(str(tmp_path / "new"))       # not there yet
  (tmp_path / "empty").mkdir()
  add_ngram.check_out(str(tmp_path / "empty"))     # nothing in it to lose
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("x")
  with pytest.raises(FlexDraftError, match=r"is a folder that holds no drafter: add-ngram "
                     r"writes a drafter folder and replaces only an earlier drafter"):
    add_ngram.check_out(str(tmp_path / "mine"))
  assert (tmp_path / "mine" / "notes.txt").read_text() == "x"


def test_self_instruct_gives_up_on_a_target_that_never_writes_a_question(tmp_path, capsys):
  from flexdraft_jax.training import self_instruct as si
  out = tmp_path / "q.jsonl"
  argv = ["flexdraft_jax self-instruct", f"--config={TINY}", "--num=2", f"--out={out}",
          "--config.data.self_instruct.batch_size=4",
          "--config.data.self_instruct.max_new_tokens=8",
          "--config.data.self_instruct.mt_bench="]
  with pytest.raises(SystemExit) as e:
    si.run(argv)
  assert e.value.code == 1
  cap = capsys.readouterr()
  assert "Traceback" not in cap.err
  assert cap.err.strip().splitlines() == [
      f"error: self-instruct gave up: {si.MAX_BARREN_BATCHES} batches in a row "
      f"({si.MAX_BARREN_BATCHES * 4} candidates) made no acceptable question (0/2 made); "
      "the target does not write the questions asked for (try another target, or "
      f"--config.data.self_instruct.temperature); the questions made are in {out}"]
  batches = [x for x in cap.out.splitlines() if x.startswith("self-instruct: 0/2 questions")]
  assert len(batches) == si.MAX_BARREN_BATCHES
  assert sorted(os.listdir(tmp_path)) == ["q.jsonl"]  # no q.jsonl.tmp left


def test_self_instruct_rerun_with_other_settings_is_one_line_before_the_model_loads(
    tmp_path, monkeypatch, capsys):
  from flexdraft_jax.model import loading
  from flexdraft_jax.training import self_instruct as si
  out = tmp_path / "q.jsonl"
  made = si.settings(tiny.tiny_test_config(), tiny.tiny_target())
  out.write_text(json.dumps({"uid": "self_instruct:0-000000", "source": "self_instruct",
                             "question": "What is a lemma?", "candidate": 0,
                             "generation": made}) + "\n")
  before = out.read_text()

  def no_model(*a, **k):
    raise AssertionError("the model was loaded before the settings were checked")

  monkeypatch.setattr(loading, "load_target", no_model)
  with pytest.raises(SystemExit) as e:
    si.run(["flexdraft_jax self-instruct", f"--config={TINY}", "--num=3", f"--out={out}",
            "--config.data.self_instruct.temperature=0.25"])
  assert e.value.code == 1
  assert capsys.readouterr().err.strip().splitlines() == [
      f"error: {out} holds questions made with temperature={made['temperature']!r}, not "
      "0.25; use another --out"]
  assert out.read_text() == before


def test_eval_over_a_results_file_it_did_not_write_leaves_it_as_it_is(tmp_path, prompts_file,
                                                                      capsys):
  from flexdraft_jax.evaluation import sweep
  w = tmp_path / "eval"
  w.mkdir()
  (w / "results.json").write_text("[1, 2, 3]")
  with pytest.raises(SystemExit) as e:
    sweep.run(_eval_argv(str(w), prompts_file, "ar,sequential"))
  assert e.value.code == 1
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      f"error: {w}/results.json is not the results of an eval sweep (a JSON list); it is "
      "left as it is: use another --workdir")
  assert (w / "results.json").read_text() == "[1, 2, 3]"
  assert sorted(os.listdir(w)) == ["results.json"]  # nothing else written, lock released


def test_a_gguf_edited_in_place_keeping_size_and_mtime_is_read_afresh(tmp_path, monkeypatch):
  # Its index was found by path, size and mtime: it served the config as it was.
  import gguf

  from flexdraft_jax.model import gguf_loader, loading
  path = str(tmp_path / "model.gguf")
  shutil.copyfile(loading.builtin_path("smollm2-135m"), path)
  monkeypatch.setenv(gguf_loader.INDEX_ENV, str(tmp_path / "index"))
  key = "llama.context_length"
  assert gguf_loader.read_gguf(path)[0][key] == 8192
  where, before = gguf_loader.index_path(path), os.stat(path)
  field = gguf.GGUFReader(path).fields[key]  # a uint32: the field's last 4 bytes
  at = field.offset + sum(p.nbytes for p in field.parts) - 4
  with open(path, "r+b") as f:
    f.seek(at)
    f.write((4096).to_bytes(4, "little"))
  os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
  after = os.stat(path)
  assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
  assert gguf_loader.index_path(path) == where  # the same index is found
  meta, _ = gguf_loader.read_gguf(path)
  assert meta[key] == 4096
  cfg = gguf_loader.read_config(meta, set(), path)
  assert cfg.max_position_embeddings == 4096
  # the index was written again: the next load reads it, parsing nothing
  monkeypatch.setattr(gguf_loader, "_open", lambda p: pytest.fail("parsed again"))
  assert gguf_loader.read_gguf(path)[0][key] == 4096
