"""The public API checks its arguments' types at the door (flexdraft_jax/checks.py):
strings where objects or booleans go, dicts where lists go, the keywords of the
earlier API; seeds are any integer that fits 64 bits; every command's --help
exits 0. docs/bad_inputs.md holds one row per kind (tests/test_bad_inputs.py);
here every entry point and field."""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import subprocess

import jax
import numpy as np
import pytest

import flexdraft_jax as fd
from flexdraft_jax.__main__ import COMMANDS
from flexdraft_jax.decoding import inputs, options
from flexdraft_jax.drafter import checkpoint
from tests import tiny
from tests.decoding_util import random_drafter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def target():
  return tiny.tiny_target()


@pytest.mark.parametrize("make, line", [
    (lambda: fd.SamplingParams(temperature="0.5"),
     "temperature must be a finite number >= 0, got str '0.5'"),
    (lambda: fd.SamplingParams(top_k=2.0), "top_k must be an integer >= 1, got float 2.0"),
    (lambda: fd.SamplingParams(top_p=True), "top_p must be in (0, 1], got bool True"),
    (lambda: fd.SamplingParams(draft_sampling=1),
     "draft_sampling must be True, False or None (auto), got int 1"),
    (lambda: fd.SpecOptions(block_size="4"), "block_size must be an integer >= 2, got str '4'"),
    (lambda: fd.SpecOptions(threshold=None), "threshold θ must be in [0, 1], got NoneType None"),
    (lambda: fd.SpecOptions(threshold=1.5), "threshold θ must be in [0, 1], got 1.5"),
    (lambda: fd.SpecOptions(strategy=["min_confidence"]),
     "strategy must be one of ('cumulative_product', 'min_confidence'), got list "
     "['min_confidence']"),
    (lambda: fd.SpecOptions(flex_threshold=1.5),
     "flex threshold must be 'auto' or an integer >= 0, got float 1.5"),
    (lambda: fd.SpecOptions(flex_threshold="often"),
     "flex threshold must be 'auto' or an integer >= 0, got 'often'"),
    (lambda: fd.SpecOptions(cost_cache=b"/tmp/costs.json"),
     "cost_cache must be a file path, '' or None (the costs in memory only), or 'default', "
     "got bytes b'/tmp/costs.json'"),
    (lambda: fd.SpecOptions(calibrate="False"), "calibrate must be True or False, got str 'False'"),
    (lambda: fd.SpecOptions(group_buckets=4),
     "group_buckets must be a tuple of verify lengths (integers >= 2), got int 4"),
    (lambda: fd.SpecOptions(group_buckets=(2, "4")),
     "each of group_buckets must be an integer >= 2, got str '4'"),
    (lambda: fd.RuntimeOptions(batch_size=2.0),
     "batch_size must be an integer >= 1 (unset: all prompts in one batch), got float 2.0"),
    (lambda: fd.RuntimeOptions(attn_impl=None),
     "attn_impl must be one of ('xla', 'pallas', 'auto'), got NoneType None"),
    (lambda: fd.RuntimeOptions(steps_per_call=np.int64(0)),
     "steps_per_call must be an integer >= 1, got 0"),
])
def test_option_groups_refuse_wrong_types_when_made(make, line):
  with pytest.raises(fd.FlexDraftError) as e:
    make()
  assert str(e.value) == line


@pytest.mark.parametrize("kw, line", [
    (dict(chat=np.str_("True")), "chat must be True or False, got str_ 'True'"),
    (dict(chat=None), "chat must be True or False, got NoneType None"),
    (dict(mode=["ar"]), "mode must be one of ('ar', 'parallel', 'sequential', 'flex'), got "
     "list ['ar']"),
    (dict(max_new_tokens="8"), "max_new_tokens must be an integer >= 1, got str '8'"),
    (dict(prompts={"hi", "ho"}), "prompts must be a list of strings or of token-id lists, "
     "got set {"),
    (dict(prompts=[{3, 4}]), "prompt 0 is set {3, 4}: a prompt is text (str) or a list of "
     "token ids"),
    (dict(prompts=None), "prompts must be a list of strings or of token-id lists, got "
     "NoneType None"),
    (dict(stop={"a": 1}), "stop must be a list of token ids or single-token strings, got "
     "dict {'a': 1}"),
    (dict(mode="flex", drafter=object()), "drafter must be a Drafter (from "
     "fd.load_drafter(path, target)), got object <object object at"),
    (dict(mode="flex", drafter="d1", parallel_drafter=pathlib.Path("d2")),
     "drafter must be a loaded Drafter, got str 'd1': load it with fd.load_drafter('d1', "
     "target)"),
    (dict(seed=-2 ** 63 - 1), "seed must fit 64 bits (-2**63 <= seed < 2**64), got "
     "-9223372036854775809"),
    (dict(seed="3"), "seed must be an integer, got str '3'"),
])
def test_generate_refuses_wrong_types(target, kw, line):
  kw = dict(dict(prompts=[[3, 4]], max_new_tokens=2), **kw)
  with pytest.raises(fd.FlexDraftError) as e:
    fd.generate(target, kw.pop("prompts"), **kw)
  assert str(e.value).startswith(line), str(e.value)


def test_a_path_as_the_parallel_drafter_names_it(target):
  drafter = random_drafter(target)
  with pytest.raises(fd.FlexDraftError, match=r"^parallel_drafter must be a loaded Drafter, "
                     r"got PosixPath PosixPath\('d2'\): load it with fd.load_drafter\('d2', "
                     r"target\)$"):
    fd.generate(target, [[3]], mode="flex", drafter=drafter,
                parallel_drafter=pathlib.Path("d2"))


def test_loaders_refuse_wrong_types(target, tmp_path):
  cases = [
      (lambda: fd.load_target(123), "spec must be a model folder, a .gguf file or a builtin "
       "name (str), got int 123"),
      (lambda: fd.load_target("random:tiny", dtype="int32"), "dtype must be a "
       "floating-point dtype such as 'float32' or 'bfloat16', got str 'int32'"),
      (lambda: fd.load_target("random:tiny", dtype=32), "dtype must be a floating-point "
       "dtype such as 'float32' or 'bfloat16', got int 32"),
      (lambda: fd.load_target("random:tiny", layout=["layers"]), "layout must be one of "
       "('stacked', 'layers'), got list ['layers']"),
      (lambda: fd.load_drafter(123, target), "path must be a drafter folder (str), got int 123"),
      (lambda: fd.load_drafter("d", {"config": 1}), "target must be a Target (from "
       "fd.load_target(path)), got dict {'config': 1}"),
      (lambda: fd.target_logits("random:tiny", [[3]]), "target must be a loaded Target, got "
       "str 'random:tiny': load it with fd.load_target('random:tiny')"),
  ]
  for call, line in cases:
    with pytest.raises(fd.FlexDraftError) as e:
      call()
    assert str(e.value) == line
  # what the loaders take still loads
  assert fd.load_target("random:tiny", dtype=jax.numpy.bfloat16).params["embed"].dtype == \
      jax.numpy.bfloat16
  path = tmp_path / "drafter"
  checkpoint.save_drafter(str(path), random_drafter(target), target)
  assert fd.load_drafter(path, target).config.block_size == 4  # a pathlib.Path
  # a drafter folder given as the target is named as one, with the target it fits
  with pytest.raises(fd.FlexDraftError) as e:
    fd.load_target(str(path))
  assert str(e.value) == (
      f"{path} is a drafter folder (it holds drafter.json), not a target: load it with "
      f"fd.load_drafter({str(path)!r}, target), the target from fd.load_target('random:tiny:0')")


def test_options_of_the_right_types_still_work(target):
  spec = fd.SpecOptions(group_buckets=[4, 2], cost_cache=pathlib.Path("costs.json"),
                        calibrate=np.bool_(True), threshold=np.float32(0.5))
  assert spec.group_buckets == (4, 2) and hash(spec)  # a tuple: the options hash
  sp = fd.SamplingParams(temperature=np.float32(1.0), top_k=np.int64(5), top_p=1,
                         draft_sampling=np.bool_(False))
  out = fd.generate(target, (p for p in [[3, 4]]), max_new_tokens=3, sampling=sp,
                    chat=np.bool_(False), seed=np.uint64(2 ** 64 - 1))
  assert len(out.token_ids[0]) == 3


@pytest.mark.parametrize("group, cls", options.GROUPS)
def test_every_keyword_of_the_earlier_api_names_its_group(target, group, cls):
  for field in dataclasses.fields(cls):
    value = field.default
    with pytest.raises(fd.FlexDraftError) as e:
      fd.generate(target, [[3, 4]], max_new_tokens=2, **{field.name: value})
    assert str(e.value) == (
        f"generate() takes {group} options in {group}=fd.{cls.__name__}("
        f"{field.name}={value!r}), not {field.name}="), field.name


def test_keywords_of_several_groups_and_unknown_keywords(target):
  with pytest.raises(fd.FlexDraftError) as e:
    fd.generate(target, [[3]], temperature=0.7, top_k=4, batch_size=2, verify_len=3)
  assert str(e.value) == (
      "generate() takes sampling options in sampling=fd.SamplingParams(temperature=0.7, "
      "top_k=4), speculation options in speculation=fd.SpecOptions(verify_len=3) and runtime "
      "options in runtime=fd.RuntimeOptions(batch_size=2), not temperature=, top_k=, "
      "batch_size=, verify_len=")
  # with the group's object given too, the spelling keeps the fields it sets
  with pytest.raises(fd.FlexDraftError) as e:
    fd.generate(target, [[3]], sampling=fd.SamplingParams(top_p=0.9), temperature=0.7,
                runtime=fd.RuntimeOptions(max_len=64))
  assert str(e.value) == (
      "generate() takes sampling options in sampling=fd.SamplingParams(top_p=0.9, "
      "temperature=0.7), not temperature=")
  with pytest.raises(fd.FlexDraftError) as e:
    fd.generate(target, [[3]], max_new_token=3)
  assert str(e.value) == (
      "generate() has no argument 'max_new_token' (did you mean max_new_tokens=?); it takes "
      "drafter, parallel_drafter, mode, max_new_tokens, sampling, speculation, runtime, "
      "chat, stop, seed")


def test_seed_keys_are_jax_keys_for_ordinary_seeds_and_use_all_64_bits():
  for seed, offset in ((0, 0), (3, 2), (2 ** 31, 0), (2 ** 32 - 2, 1)):
    np.testing.assert_array_equal(inputs.seed_key(seed, offset),
                                  jax.random.PRNGKey(seed + offset))
  np.testing.assert_array_equal(inputs.seed_key(2 ** 63 - 1, 1), [2 ** 31, 0])
  np.testing.assert_array_equal(inputs.seed_key(-1), inputs.seed_key(2 ** 64 - 1))
  np.testing.assert_array_equal(inputs.seed_key(2 ** 64 - 1, 1), inputs.seed_key(0))
  assert not np.array_equal(inputs.seed_key(5), inputs.seed_key(2 ** 32 + 5))
  impl = jax.config.jax_default_prng_impl
  jax.config.update("jax_default_prng_impl", "rbg")  # another key layout: the same rules
  try:
    np.testing.assert_array_equal(inputs.seed_key(3, 2), jax.random.PRNGKey(5))
    assert inputs.seed_key(2 ** 63 - 1, 1).shape == jax.random.PRNGKey(0).shape == (4,)
    assert not np.array_equal(inputs.seed_key(5), inputs.seed_key(2 ** 32 + 5))
  finally:
    jax.config.update("jax_default_prng_impl", impl)


def test_large_seeds_decode_every_batch(target):
  """seed=2**63-1 over two batches used to overflow at the second (seed + 1) and
  lose the first's output. Each batch draws from seed + its first prompt's
  index, wrapping at 2**64: as if decoded alone with that seed."""
  sp = fd.SamplingParams(temperature=5.0)  # the tiny target's tokens vary with the key
  prompts = [[3, 4, 5], [6, 7]]
  run = lambda p, seed, bs=None: fd.generate(  # noqa: E731
      target, p, max_new_tokens=8, sampling=sp, seed=seed,
      runtime=fd.RuntimeOptions(batch_size=bs)).token_ids
  for seed, second in ((2 ** 63 - 1, 2 ** 63), (2 ** 64 - 1, 0)):
    both = run(prompts, seed, bs=1)
    assert both == run(prompts[:1], seed) + run(prompts[1:], second)
  assert run(prompts, -1) == run(prompts, 2 ** 64 - 1)  # the same 64 bits
  assert run(prompts, 5) != run(prompts, 2 ** 32 + 5)  # the high bits count


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_help_exits_0(command, capsys, absl_flags_restored):
  """absl exits 1 after printing the help; asked for it, a command exits 0."""
  module = importlib.import_module(COMMANDS[command])
  code = 0
  try:
    module.run([f"flexdraft_jax {command}", "--help"])
  except SystemExit as e:
    code = e.code
  out = capsys.readouterr().out
  assert code in (0, None), out
  if command == "build-kernel":
    assert out.startswith("usage: python -m flexdraft_jax build-kernel")
  else:  # in-process the text above the flags is pytest's; the flags are the command's
    assert "flags:" in out and "Try --helpfull" in out, out


def test_module_help_and_setup_help_exit_0(tmp_path):
  import sys
  for argv, first in ((["--help"], "usage: python -m flexdraft_jax {"),
                      (["train", "--help"], "`python -m flexdraft_jax train --config")):
    out = subprocess.run([sys.executable, "-m", "flexdraft_jax", *argv], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(first), (out.stdout, out.stderr)
  log = tmp_path / "calls.log"  # a stub python: --help must install nothing
  (tmp_path / "python").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
  (tmp_path / "python").chmod(0o755)
  out = subprocess.run(["bash", "launch/setup.sh", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=60,
                       env=dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}"))
  assert out.returncode == 0, out.stderr
  assert "usage: bash launch/setup.sh " in out.stdout and "--test" in out.stdout
  assert not log.exists()
