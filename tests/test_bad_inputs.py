"""Every bad input of docs/bad_inputs.md prints its one line (no traceback), and
the checks that need no model run before the model is loaded.

CASES is the table: (surface, what is wrong, argv or a call, the exact line).
`{d}` in argv and lines is a temporary directory holding the bad files; the
docs show it as `DIR`. test_docs_table_is_this_table keeps the two in step.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import flexdraft_jax as fd
from flexdraft_jax.__main__ import COMMANDS
from flexdraft_jax.training import data, regen_store
from tests import tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "bad_inputs.md")
TINY = "configs/tiny_test.py"
EVAL = "configs/eval_smollm2.py"
GEN = ["--model", "random:tiny", "--prompt", "hi", "--max-new-tokens", "2"]
OFFLINE = "launch/offline.py"  # a script (stdlib only), not a command of the package
AOT = ["--target", "random:tiny", "--drafter", "random:L=2,block=4", "--modes", "ar,sequential:4",
       "--out", "{d}/aot"]


class Case(dict):
  """surface, bad (what is wrong), argv (a CLI command) or call (Python), line."""


def cli(surface, bad, argv, line, model=False, env=None, fresh=False):
  """`env`: environment variables the command runs with (`bad` names them);
  `fresh`: run in a process of its own (`python -m flexdraft_jax`), whose
  whole stderr must be `line` (what a process that ran nothing before prints)."""
  return Case(surface=surface, bad=bad, argv=argv, line=line, model=model, env=env or {},
              fresh=fresh)


def api(bad, call, line, warning=False, surface="generate()"):
  """`call`: generate()'s arguments (a value, or a function of the tiny target
  that makes it), or a function of the tiny target that makes the whole call."""
  return Case(surface=surface, bad=bad, call=call, line=line, warning=warning)


CASES = [
    # ----------------------------------------------------- generate CLI ----
    cli("generate", "`--batch-size -2`", ["generate", *GEN, "--batch-size", "-2"],
        "error: --batch-size must be an integer >= 1 (unset: all prompts in one batch), "
        "got -2"),
    cli("generate", "`--batch-size 0` (it meant \"all\")", ["generate", *GEN, "--batch-size", "0"],
        "error: --batch-size must be an integer >= 1 (unset: all prompts in one batch), "
        "got 0"),
    cli("generate", "`--batch-size x`", ["generate", *GEN, "--batch-size", "x"],
        "error: flag --batch-size=x: invalid literal for int() with base 10: 'x' "
        "(see --help)"),
    cli("generate", "`--temperature nan` (decoded all-zero tokens)",
        ["generate", *GEN, "--temperature", "nan"],
        "error: --temperature must be a finite number >= 0, got nan"),
    cli("generate", "`--temperature inf`", ["generate", *GEN, "--temperature", "inf"],
        "error: --temperature must be a finite number >= 0, got inf"),
    cli("generate", "`--top-p 1.5`", ["generate", *GEN, "--top-p", "1.5"],
        "error: --top-p must be in (0, 1], got 1.5"),
    cli("generate", "`--max-new-tokens 0`", ["generate", *GEN, "--max-new-tokens", "0"],
        "error: --max-new-tokens must be an integer >= 1, got 0"),
    cli("generate", "`--mode flex` without `--drafter`", ["generate", *GEN, "--mode", "flex"],
        "error: mode 'flex' needs a drafter (--drafter PATH)"),
    cli("generate", "`--drafter` that does not exist",
        ["generate", *GEN, "--mode", "flex", "--drafter", "{d}/nope"],
        "error: no drafter at {d}/nope (not a directory)"),
    cli("generate", "`--parallel-drafter` in mode `ar` (it would be ignored silently)",
        ["generate", *GEN, "--parallel-drafter", "{d}/nope"],
        "warning: mode 'ar' does not use the parallel drafter (--parallel-drafter): only "
        "'parallel' and 'flex' do", model=True),
    cli("generate", "`--prompts-file` is a directory", ["generate", *GEN, "--prompts-file", "{d}"],
        "error: prompts file {d} is a directory"),
    cli("generate", "`--prompts-file` is not UTF-8",
        ["generate", *GEN, "--prompts-file", "{d}/latin1.jsonl"],
        "error: prompts file {d}/latin1.jsonl is not UTF-8 text (byte 15)"),
    cli("generate", "`{\"prompt\": 123}` in the prompts file",
        ["generate", *GEN, "--prompts-file", "{d}/int.jsonl"],
        "error: {d}/int.jsonl:1: 'prompt' must be a string, got int 123"),
    cli("generate", "`--stop 99999` (outside the vocabulary: never matched)",
        ["generate", *GEN, "--stop", "99999"],
        "error: stop id 99999 is outside the vocabulary [0, 264)", model=True),
    cli("generate", "`--block-size 99` in mode `ar` (was ignored silently)",
        ["generate", *GEN, "--block-size", "99"],
        "warning: --block-size=99 has no effect in mode 'ar' (no drafts)", model=True),
    cli("generate", "`--draft-sampling` at T=0 (was ignored silently)",
        ["generate", *GEN, "--draft-sampling"],
        "warning: --draft-sampling has no effect at temperature 0 (greedy decoding drafts "
        "and keeps the argmax)", model=True),
    cli("generate", "`--top-k 5` at T=0 (was ignored silently)",
        ["generate", *GEN, "--top-k", "5"],
        "warning: --top-k=5 has no effect at temperature 0 (greedy decoding keeps the "
        "argmax)", model=True),
    cli("generate", "an HF folder without `tokenizer.json` (decoded, then failed on the text)",
        ["generate", "--model", "{d}/notok", "--prompt", "hi"],
        "error: --model {d}/notok has no tokenizer.json, and prompts on the command line "
        "are text: add the tokenizer, or pass token ids to generate() in Python"),
    cli("generate", "a prompt past the model's context with `--max-len` (was not checked)",
        ["generate", *GEN, "--prompt", "x" * 2100, "--max-len", "4096"],
        "error: --prompt number 2 (2100 tokens) + --max-new-tokens=2 exceeds the model's "
        "context of 2048", model=True),
    cli("generate", "`--max-new-tokens 2147483648 --max-len 4096` (an OverflowError)",
        ["generate", *GEN[:4], "--max-new-tokens", "2147483648", "--max-len", "4096"],
        "error: --max-new-tokens=2147483648 is beyond any model's context (positions are "
        "int32: at most 2147483647)"),
    cli("generate", "`--max-len 6 --max-new-tokens 8` (the cache grew silently)",
        ["generate", *GEN[:4], "--max-new-tokens", "8", "--max-len", "6"],
        "error: --max-len=6 is too short: the prompt (2 tokens) + --max-new-tokens=8 needs "
        "13 (with 3 spare positions for the decode steps); raise it, or leave it unset",
        model=True),
    cli("generate", "`--model` a drafter folder (advised adding a tokenizer)",
        ["generate", "--model", "{d}/drafter", "--prompt", "hi"],
        "error: --model {d}/drafter is a drafter folder (it holds drafter.json), not a "
        "target: pass it as --drafter {d}/drafter, with --model the target it was made for "
        "(random:tiny:0) and a speculative --mode (flex, say)"),
    cli("generate", "`--seed 18446744073709551616` (2**64: an OverflowError after decoding)",
        ["generate", *GEN, "--seed", str(2 ** 64)],
        "error: --seed must fit 64 bits (-2**63 <= seed < 2**64), got 18446744073709551616"),
    cli("generate", "`--stream --json` (text as it comes, or one object at the end)",
        ["generate", *GEN, "--stream", "--json"],
        "error: --stream prints the text as it comes, --json one object at the end: "
        "pass one of them"),
    cli("generate", "`--compile_cache` a file (it would be written into)",
        ["generate", *GEN, "--compile_cache", "{d}/afile"],
        "error: the compile cache {d}/afile is not a folder (set another with "
        "--compile_cache or $FLEXDRAFT_COMPILE_CACHE, or 'off')"),
    cli("generate", "`--top-p 0` in a new process (JAX's INFO line `Resetting cache at "
        "<empty>.` came first on stderr)", ["generate", *GEN, "--top-p", "0"],
        "error: --top-p must be in (0, 1], got 0.0", fresh=True),
    # ------------------------------------------------ generate() in Python ----
    api("`sampling=SamplingParams(temperature=float(\"nan\"))`",
        dict(sampling=lambda t: fd.SamplingParams(temperature=float("nan"))),
        "temperature must be a finite number >= 0, got nan"),
    api("`sampling={\"temperature\": 0.7}` (a dict, not the options object)",
        dict(sampling={"temperature": 0.7}),
        "sampling must be a SamplingParams, got dict {'temperature': 0.7} (e.g. "
        "sampling=SamplingParams())"),
    api("bytes prompts (became token ids)", dict(prompts=b"hello"),
        "prompts are bytes: pass text (str) or lists of token ids"),
    api("a bytes prompt in the list", dict(prompts=[b"hello"]),
        "prompt 0 is bytes: pass text (str) or a list of token ids"),
    api("float token ids (were truncated)", dict(prompts=[[1.5, 2.0]]),
        "prompt 0 has a token id that is not an integer: 1.5"),
    api("a flat id list", dict(prompts=[1, 2, 3]),
        "prompts is a flat list of 3 ids: pass a list of prompts, e.g. [[1, 2, 3]] for "
        "one prompt of ids"),
    api("an int `stop`", dict(stop=5),
        "stop must be a list of token ids or single-token strings, got int 5 "
        "(e.g. stop=[5])"),
    api("a stop id outside the vocabulary (did nothing)", dict(stop=[99999]),
        "stop id 99999 is outside the vocabulary [0, 264)"),
    api("`runtime=RuntimeOptions(batch_size=0)` (meant \"all\")",
        dict(runtime=lambda t: fd.RuntimeOptions(batch_size=0)),
        "batch_size must be an integer >= 1 (unset: all prompts in one batch), got 0"),
    api("`speculation=SpecOptions(block_size=3)` in mode `ar` (FlexDraftWarning)",
        dict(speculation=fd.SpecOptions(block_size=3)),
        "speculation.block_size=3 has no effect in mode 'ar' (no drafts)", warning=True),
    api("`speculation=SpecOptions(draft_dtype=\"float16\")`",
        dict(speculation=lambda t: fd.SpecOptions(draft_dtype="float16")),
        "draft_dtype must be one of ('auto', 'bfloat16', 'target'), got 'float16'"),
    api("`speculation=SpecOptions(draft_dtype=\"bfloat16\")` in mode `ar` (FlexDraftWarning)",
        dict(speculation=fd.SpecOptions(draft_dtype="bfloat16")),
        "speculation.draft_dtype=bfloat16 has no effect in mode 'ar' (no drafts)",
        warning=True),
    api("`sampling=SamplingParams(draft_sampling=True)` at T=0 (FlexDraftWarning)",
        dict(sampling=fd.SamplingParams(draft_sampling=True)),
        "sampling.draft_sampling has no effect at temperature 0 (greedy decoding drafts "
        "and keeps the argmax)", warning=True),
    api("`sampling=SamplingParams(top_k=5)` at T=0 (FlexDraftWarning)",
        dict(sampling=fd.SamplingParams(top_k=5)),
        "sampling.top_k=5 has no effect at temperature 0 (greedy decoding keeps the argmax)",
        warning=True),
    api("`chat=True` with token-id prompts (FlexDraftWarning; was silent)", dict(chat=True),
        "chat=True has no effect on the 1 prompt(s) given as token ids (the chat template "
        "applies to text)", warning=True),
    api("`seed=1.5` (a JAX traceback)", dict(seed=1.5), "seed must be an integer, got float 1.5"),
    api("`seed=None` (a NoneType traceback)", dict(seed=None),
        "seed must be an integer, got NoneType None"),
    api("text prompts for a target without a tokenizer (failed after decoding)",
        dict(target=lambda t: t._replace(tokenizer=None), prompts=["hi"]),
        "random:tiny:0 has no tokenizer (no tokenizer.json): pass prompts as token ids, "
        "e.g. [[1, 2, 3]]"),
    api("`mode=\"parallel\"` with a drafter trained to read the bonus (`bonus_input`, "
        "no `bonus_dropout`; FlexDraftWarning)",
        dict(mode="parallel", drafter=lambda target: _bonus_drafter(target)),
        "mode 'parallel' drafts before the bonus is known and this drafter was trained to "
        "read it (bonus_input without bonus_dropout): it drafts blind, poorly; "
        "'sequential' or 'flex' suit it", warning=True),
    api("a `parallel_drafter` of another block size than the drafter's",
        dict(mode="flex", drafter=lambda target: _bonus_drafter(target),
             parallel_drafter=lambda target: _bonus_drafter(target, block_size=2)),
        "the parallel drafter's block size 2 differs from the drafter's 4: they must "
        "match"),
    api("a `parallel_drafter` in mode \"sequential\" (FlexDraftWarning)",
        dict(mode="sequential", drafter=lambda target: _bonus_drafter(target),
             parallel_drafter=lambda target: _bonus_drafter(target)),
        "mode 'sequential' does not use the parallel drafter (parallel_drafter): only "
        "'parallel' and 'flex' do", warning=True),
    api("`chat=\"False\"` (a string: turned the chat template on)", dict(chat="False"),
        "chat must be True or False, got str 'False'"),
    api("`sampling=SamplingParams(draft_sampling=\"False\")` (taken as true)",
        dict(sampling=lambda t: fd.SamplingParams(draft_sampling="False")),
        "draft_sampling must be True, False or None (auto), got str 'False'"),
    api("`speculation=SpecOptions(threshold=\"0.5\")` (said `got 0.5`)",
        dict(speculation=lambda t: fd.SpecOptions(threshold="0.5")),
        "threshold θ must be in [0, 1], got str '0.5'"),
    api("`speculation=SpecOptions(cost_cache=123)` (a TypeError after prefill)",
        dict(speculation=lambda t: fd.SpecOptions(cost_cache=123)),
        "cost_cache must be a file path, '' or None (the costs in memory only), or "
        "'default', got int 123"),
    api("a dict of prompts (decoded its keys)", dict(prompts={"a": "hi"}),
        "prompts must be a list of strings or of token-id lists, got dict {'a': 'hi'}"),
    api("a path as the drafter (an AttributeError)",
        dict(mode="flex", drafter="path/to/drafter"),
        "drafter must be a loaded Drafter, got str 'path/to/drafter': load it with "
        "fd.load_drafter('path/to/drafter', target)"),
    api("a name as the target (an AttributeError)", dict(target="random:tiny"),
        "target must be a loaded Target, got str 'random:tiny': load it with "
        "fd.load_target('random:tiny')"),
    api("`temperature=0.7`, a keyword of the earlier API (a TypeError)",
        dict(temperature=0.7),
        "generate() takes sampling options in sampling=fd.SamplingParams(temperature=0.7), "
        "not temperature="),
    api("`batch_size=2, max_len=64`, keywords of the earlier API (a TypeError)",
        dict(batch_size=2, max_len=64),
        "generate() takes runtime options in runtime=fd.RuntimeOptions(batch_size=2, "
        "max_len=64), not batch_size=, max_len="),
    api("`seed=2**64` (an OverflowError)", dict(seed=2 ** 64),
        "seed must fit 64 bits (-2**63 <= seed < 2**64), got 18446744073709551616"),
    api("`load_drafter(path, \"random:tiny\")`, a name as the target (an AttributeError)",
        lambda t: fd.load_drafter("path/to/drafter", "random:tiny"),
        "target must be a loaded Target, got str 'random:tiny': load it with "
        "fd.load_target('random:tiny')", surface="load_drafter()"),
    # -------------------------------------------------------------- train ----
    cli("train", "`--workdir` under a file",
        ["train", f"--config={TINY}", "--workdir", "{d}/afile/run"],
        "error: --workdir {d}/afile/run: a file is in the way (not a directory)"),
    cli("train", "`--workdir` not writable", ["train", f"--config={TINY}", "--workdir", "{ro}"],
        "error: --workdir {ro} is not writable: Permission denied"),
    cli("train", "a missing config file", ["train", "--config=configs/nope.py", "--workdir", "{d}/w"],
        "error: config file not found: configs/nope.py"),
    cli("train", "an unknown `--config.*` key",
        ["train", f"--config={TINY}", "--config.train.nope=3", "--workdir", "{d}/w"],
        f"error: unknown config key --config.train.nope ({TINY} has no 'train.nope')"),
    cli("train", "`--config.train.batch_size=-2`",
        ["train", f"--config={TINY}", "--config.train.batch_size=-2", "--workdir", "{d}/w"],
        "error: --config.train.batch_size must be an integer >= 1, got -2"),
    cli("train", "`--config.train.ema_decay=1` (an average that never moves)",
        ["train", f"--config={TINY}", "--config.train.ema_decay=1", "--workdir", "{d}/w"],
        "error: --config.train.ema_decay must be a number in [0, 1), got 1.0"),
    cli("train", "`--config.train.max_minutes=-1` (a budget already spent)",
        ["train", f"--config={TINY}", "--config.train.max_minutes=-1", "--workdir", "{d}/w"],
        "error: --config.train.max_minutes must be a number >= 0 (0: no limit), got -1.0"),
    cli("train", "`--config.train.decay_steps` with the cosine schedule (it decays already)",
        ["train", f"--config={TINY}", "--config.train.decay_steps=2", "--workdir", "{d}/w"],
        "error: --config.train.decay_steps must be 0 unless train.schedule is 'constant' "
        "(cosine decays already), got 2"),
    cli("train", "`--config.train.loss=kl` with `train.precompute_kv` (no clean pass in the step)",
        ["train", f"--config={TINY}", "--config.train.loss=kl",
         "--config.train.precompute_kv=True", "--workdir", "{d}/w"],
        "error: --config.train.loss must be 'ce' with train.precompute_kv (the kl loss reads "
        "the target's distribution off the clean pass in the step), got 'kl'"),
    cli("train", "data regenerated by another target (was trained on silently)",
        ["train", f"--config={TINY}", "--config.target=random:tiny:1",
         "--config.data.regen_dir={d}/regen0", "--config.train.seq_len=48",
         "--workdir", "{d}/w"],
        "error: {d}/regen0 holds answers regenerated by random:tiny:0, not by "
        "random:tiny:1 (another fingerprint): regenerate with this target into another "
        "--config.data.regen_dir, or train the target that made them", model=True),
    cli("train", "every prompt longer than `seq_len` (trained on nothing, loss 0)",
        ["train", f"--config={TINY}", "--config.data.regen_dir={d}/regen",
         "--config.train.seq_len=30", "--workdir", "{d}/w"],
        "error: 20 of 20 training sequences have no anchor block within seq_len=30 (their "
        "prompt leaves fewer than 5 tokens for the answer): raise --config.train.seq_len "
        "or lower --config.data.max_prompt_tokens and regenerate"),
    # --------------------------------------------------------------- eval ----
    cli("eval", "`--workdir` is a file", ["eval", f"--config={EVAL}", "--workdir", "{d}/afile"],
        "error: --workdir {d}/afile: a file is in the way (not a directory)"),
    cli("eval", "`--config.eval.batch_sizes=0`",
        ["eval", f"--config={EVAL}", "--config.eval.batch_sizes=0", "--workdir", "{d}/e"],
        "error: --config.eval.batch_sizes and --config.ablation.batch_sizes must be >= 1, "
        "got 0"),
    cli("eval", "`--config.eval.temperatures=nan`",
        ["eval", f"--config={EVAL}", "--config.eval.temperatures=nan", "--workdir", "{d}/e"],
        "error: --config.eval.temperatures: each must be a finite number >= 0, got nan"),
    cli("eval", "benchmark files missing (a clone without `$FLEXDRAFT_DATA`)",
        ["eval", f"--config={EVAL}", "--config.data_dir={d}/none", "--config.eval.datasets=gsm8k",
         "--workdir", "{d}/e"],
        "error: gsm8k: data file not found: {d}/none/gsm8k/test.jsonl (get it from "
        "openai/grade-school-math grade_school_math/data/test.jsonl; see shared/data/README.md; "
        "point --config.data_dir or $FLEXDRAFT_DATA at the folder)"),
    cli("eval", "`--config.eval.limit=0` (ran every prompt)",
        ["eval", f"--config={EVAL}", "--config.eval.limit=0", "--workdir", "{d}/e"],
        "error: --config.eval.limit must be an integer >= 1 (prompts per benchmark), or -1 "
        "for every prompt, got 0"),
    cli("eval", "`--config.eval.modes=` (ran the AR baseline alone and reported success)",
        ["eval", f"--config={EVAL}", "--config.eval.modes=", "--workdir", "{d}/e"],
        "error: --config.eval.modes is empty: name at least one (e.g. "
        "--config.eval.modes=ar,flex)"),
    cli("eval", "resuming over a `results.json` that holds `[1, 2, 3]` (an AttributeError)",
        ["eval", f"--config={EVAL}", "--config.eval.prompts_file={d}/eval_prompts.json",
         "--config.eval.datasets=gsm8k", "--config.ablation.enabled=False",
         "--workdir", "{d}/listresults"],
        "error: {d}/listresults/results.json is not the results of an eval sweep (a JSON "
        "list); it is left as it is: use another --workdir"),
    # --------------------------------------------------------- regenerate ----
    cli("regenerate", "`regen_dir` under a file",
        ["regenerate", f"--config={TINY}", "--config.data.regen_dir={d}/afile/r"],
        "error: --config.data.regen_dir {d}/afile/r: a file is in the way (not a directory)"),
    cli("regenerate", "`--config.data.batch_size=0`",
        ["regenerate", f"--config={TINY}", "--config.data.batch_size=0",
         "--config.data.regen_dir={d}/r"],
        "error: --config.data.batch_size must be an integer >= 1, got 0"),
    cli("regenerate", "`--config.data.part=2/2` (parts are 0 .. N-1)",
        ["regenerate", f"--config={TINY}", "--config.data.part=2/2",
         "--config.data.regen_dir={d}/r"],
        "error: --config.data.part must be '' or 'I/N' with 0 <= I < N, got '2/2'"),
    cli("regenerate", "a prompt file that is missing",
        ["regenerate", f"--config={TINY}", "--config.data.paths.gsm8k={d}/none.jsonl",
         "--config.data.mix.arena_hard_v01=0", "--config.data.regen_dir={d}/r"],
        "error: prompt file not found: {d}/none.jsonl"),
    # -------------------------------------------------------- offline-tau ----
    cli("offline-tau", "`--limit=0` (ran every prompt)", ["offline-tau", "--limit=0"],
        "error: --limit must be an integer >= 1 (prompts per benchmark), or -1 for every "
        "prompt, got 0"),
    cli("offline-tau", "a `--drafters` folder that does not exist (found after answering "
        "the benchmark)", ["offline-tau", "--drafters={d}/nope"],
        "error: --drafters: no drafter at {d}/nope (not a directory)"),
    cli("offline-tau", "`--answers` a file of other records (was added to and written over)",
        ["offline-tau", "--answers={d}/list.json"],
        "error: --answers {d}/list.json is not an answers cache (it holds a JSON list of "
        "other records); it is left as it is: pass another --answers"),
    # ----------------------------------------------------- offline-accept ----
    cli("offline-accept", "`--temperatures=0,-1`", ["offline-accept", "--temperatures=0,-1"],
        "error: --temperatures: '-1' is not a temperature (a number >= 0)"),
    cli("offline-accept", "`--temperatures=warm`", ["offline-accept", "--temperatures=warm"],
        "error: --temperatures: 'warm' is not a temperature (a number >= 0)"),
    cli("offline-accept", "`--fit_temperature` with only T = 0 (nothing to fit)",
        ["offline-accept", "--fit_temperature", "--temperatures=0"],
        "error: --fit_temperature needs a temperature > 0 in --temperatures"),
    cli("offline-accept", "`--fit_temperature --limit=1` (no prompt left to report)",
        ["offline-accept", "--fit_temperature", "--limit=1"],
        "error: --fit_temperature needs --limit >= 2 (it fits on the first half of the "
        "prompts and reports the second)"),
    cli("offline-accept", "`--fit_out` without `--fit_temperature` (nothing to write)",
        ["offline-accept", "--fit_out={d}/fitted"],
        "error: --fit_out needs --fit_temperature and one drafter in --drafters"),
    cli("offline-accept", "`--fit_out` an existing file (would be written over)",
        ["offline-accept", "--fit_temperature", "--fit_out={d}/afile"],
        "error: --fit_out {d}/afile exists: offline-accept writes a new drafter directory "
        "and replaces nothing; pass another --fit_out"),
    cli("offline-accept", "a `--drafters` folder that does not exist",
        ["offline-accept", "--drafters={d}/nope"],
        "error: --drafters: no drafter at {d}/nope (not a directory)"),
    # ---------------------------------------------------------- add-ngram ----
    cli("add-ngram", "`--weight=nan` (wrote a drafter whose prior is NaN)",
        ["add-ngram", f"--config={TINY}", "--weight=nan", "--out={d}/ngram"],
        "error: --weight must be a finite number, got nan"),
    cli("add-ngram", "`--weight=inf`", ["add-ngram", f"--config={TINY}", "--weight=inf",
                                         "--out={d}/ngram"],
        "error: --weight must be a finite number, got inf"),
    cli("add-ngram", "`--out` an existing file (was deleted for the drafter folder)",
        ["add-ngram", f"--config={TINY}", "--out={d}/afile"],
        "error: --out {d}/afile is a file: add-ngram writes a drafter folder and replaces "
        "only an earlier drafter; pass another --out"),
    cli("add-ngram", "`--out` a folder of other files (was deleted for the drafter folder)",
        ["add-ngram", f"--config={TINY}", "--out={d}/notok"],
        "error: --out {d}/notok is a folder that holds no drafter: add-ngram writes a drafter "
        "folder and replaces only an earlier drafter; pass another --out"),
    cli("add-ngram", "`--grid=abc` (a ValueError)", ["add-ngram", "--grid=abc"],
        "error: each --grid setting is λ:μ3:μ2, three finite numbers (e.g. "
        "--grid=0.2:3:2,0.4:3:2), got 'abc'"),
    cli("add-ngram", "`--grid=0.2:3` (two numbers: a ValueError)", ["add-ngram", "--grid=0.2:3"],
        "error: each --grid setting is λ:μ3:μ2, three finite numbers (e.g. "
        "--grid=0.2:3:2,0.4:3:2), got '0.2:3'"),
    # ------------------------------------------------------ self-instruct ----
    cli("self-instruct", "`--out` an existing directory (failed after sampling, left "
        "`DIR.tmp`)", ["self-instruct", f"--config={TINY}", "--num=2", "--out={d}/notok"],
        "error: --out {d}/notok is a directory: pass the path of the question file (JSON "
        "lines), e.g. {d}/notok/questions.jsonl"),
    # ------------------ resumes with other settings, checks before the work ----
    cli("regenerate", "a rerun with other settings into a folder of answers (300- and "
        "20-token answers were mixed)",
        ["regenerate", f"--config={TINY}", "--config.data.max_new_tokens=20",
         "--config.data.regen_dir={d}/regen300"],
        "error: {d}/regen300 holds answers with max_new_tokens=300, not 20; use another "
        "--config.data.regen_dir"),
    cli("regenerate", "a folder of answers without `meta.json` (a run stopped before its "
        "end: its settings unknown)",
        ["regenerate", f"--config={TINY}", "--config.data.regen_dir={d}/regen"],
        "error: {d}/regen holds 6 shards of answers but no meta.json saying which target "
        "and settings made them; use another --config.data.regen_dir"),
    cli("eval", "`--config.dtype=bfloat16` into a float32 workdir (reported its float32 "
        "cells as done)",
        ["eval", f"--config={EVAL}", "--config.eval.prompts_file={d}/eval_prompts.json",
         "--config.eval.datasets=gsm8k", "--config.ablation.enabled=False",
         "--config.dtype=bfloat16", "--workdir", "{d}/f32results"],
        "error: {d}/f32results holds results for dtype='float32', not 'bfloat16'; use "
        "another --workdir"),
    cli("generate", "a prompts file whose 4th prompt is past the model's context (decoded "
        "the first 3, then failed: their outputs lost)",
        ["generate", "--model", "random:tiny", "--max-new-tokens", "2", "--batch-size", "1",
         "--prompts-file", "{d}/long4.jsonl"],
        "error: the prompt on {d}/long4.jsonl:4 (2100 tokens) + --max-new-tokens=2 exceeds "
        "the model's context of 2048", model=True),
    api("the 4th of 4 prompts past the model's context (the first 3 decoded, then lost)",
        dict(prompts=[[3, 4, 5]] * 3 + [[3] * 2100],
             runtime=lambda t: fd.RuntimeOptions(batch_size=1)),
        "prompt 3 (2100 tokens) + max_new_tokens=2 exceeds the model's context of 2048"),
    cli("offline-accept", "`--fit_out` under a file (ran the whole fit, then a "
        "FileExistsError)", ["offline-accept", "--fit_temperature", "--fit_out={d}/afile/fit.json"],
        "error: --fit_out {d}/afile/fit.json: a file is in the way ({d}/afile is not a "
        "directory)"),
    cli("offline-tau", "`--answers` under a file (answered every benchmark, then a "
        "NotADirectoryError)", ["offline-tau", "--answers={d}/afile/answers.json"],
        "error: --answers {d}/afile/answers.json: a file is in the way ({d}/afile is not a "
        "directory)"),
    cli("add-ngram", "`--out` under a file (counted the n-grams, then failed to write)",
        ["add-ngram", f"--config={TINY}", "--out={d}/afile/ngram"],
        "error: --out {d}/afile/ngram: a file is in the way ({d}/afile is not a directory)"),
    # ------------------------------- tiny temperatures, empty lists, bundles ----
    cli("generate", "`--temperature 1e-39` (a float32 subnormal: every mode decoded ids 0, "
        "1, 2)", ["generate", *GEN, "--temperature", "1e-39"],
        "error: --temperature must be 0 (greedy) or >= 1e-06, got 1e-39"),
    api("`sampling=SamplingParams(temperature=1e-39)` (decoded ids 0, 1, 2)",
        dict(sampling=lambda t: fd.SamplingParams(temperature=1e-39)),
        "temperature must be 0 (greedy) or >= 1e-06, got 1e-39"),
    api("`sampling=SamplingParams(temperature=1e-9)` (sampled drafts: a NaN softmax, ids 0)",
        dict(sampling=lambda t: fd.SamplingParams(temperature=1e-9)),
        "temperature must be 0 (greedy) or >= 1e-06, got 1e-09"),
    cli("eval", "`--config.eval.temperatures=1e-39`",
        ["eval", f"--config={EVAL}", "--config.eval.temperatures=1e-39", "--workdir", "{d}/e"],
        "error: --config.eval.temperatures: each must be 0 (greedy) or >= 1e-06, got 1e-39"),
    cli("offline-accept", "`--temperatures=0,1e-39` (failed after the model loaded)",
        ["offline-accept", "--temperatures=0,1e-39"],
        "error: --temperatures: each must be 0 (greedy) or >= 1e-06, got 1e-39"),
    cli("generate", "`XDG_CACHE_HOME='~/.cache'` (relative: wrote `./~/.cache` under the "
        "current folder)", ["generate", *GEN], "warning: $XDG_CACHE_HOME='~/.cache' is not an "
        "absolute path, which the XDG base directory spec says to ignore: caches go to "
        "~/.cache instead", model=True, env={"XDG_CACHE_HOME": "~/.cache"}),
    cli("offline-tau", "`--datasets=` (printed an empty table and exited 0)",
        ["offline-tau", "--datasets="],
        "error: --datasets is empty: name at least one benchmark (e.g. "
        "--datasets=gsm8k,humaneval,mbpp)"),
    cli("offline-tau", "`--datasets=gsm8k,nope` (failed after the target loaded)",
        ["offline-tau", "--datasets=gsm8k,nope"],
        "error: --datasets: unknown benchmark 'nope' (known: gsm8k, math500, humaneval, "
        "mbpp, mt_bench)"),
    cli("offline-accept", "`--datasets=`", ["offline-accept", "--datasets="],
        "error: --datasets is empty: name at least one benchmark (e.g. "
        "--datasets=gsm8k,humaneval,mbpp)"),
    cli("launch/offline.py", "`pack` into a folder of other files (deleted its `drafter/`)",
        [OFFLINE, "pack", "{d}/notok", "--python-version", "3.12"],
        "error: {d}/notok holds files pack did not write (no manifest.json of a bundle): "
        "pack writes a new folder or replaces one it wrote; pass another folder"),
    cli("launch/offline.py", "`pack --drafter nope` (found after every wheel was downloaded)",
        [OFFLINE, "pack", "{d}/bundle", "--python-version", "3.12", "--drafter", "{d}/nope"],
        "error: --drafter: no drafter at {d}/nope (not a directory)"),
    cli("launch/offline.py", "`pack --drafter` a folder without `drafter.json`",
        [OFFLINE, "pack", "{d}/bundle", "--python-version", "3.12", "--drafter", "{d}/notok"],
        "error: --drafter: {d}/notok holds no drafter (no drafter.json)"),
    cli("launch/offline.py", "`install` a folder without `manifest.json` (a traceback)",
        [OFFLINE, "install", "{d}/notok"],
        "error: {d}/notok has no manifest.json: it is not a bundle pack wrote, or was copied "
        "without it; copy the bundle again"),
    cli("launch/offline.py", "`install` a bundle missing a wheel it lists (a traceback)",
        [OFFLINE, "install", "{d}/nowheel"],
        "error: {d}/nowheel/wheels/x-1-py3-none-any.whl is missing (listed in "
        "{d}/nowheel/manifest.json): copy the bundle again"),
    cli("launch/offline.py", "`install` from a cut part (a traceback, and a large "
        "`DIR.tar.joined` left)", [OFFLINE, "install", "{d}/cut.tar"],
        "error: {d}/cut.tar.part000 is cut or damaged: 10 bytes, where pack wrote 20: copy "
        "it again"),
    cli("launch/offline.py", "`install` from parts with one missing (joined without it)",
        [OFFLINE, "install", "{d}/gap.tar"],
        "error: {d}/gap.tar.part001 is missing (part 002 is here): copy it again"),
    # ------------------------------------------------------------- aot ----
    cli("aot", "`--topology v9x:2x2` (no such chip)", ["aot", *AOT, "--topology", "v9x:2x2"],
        "error: --topology 'v9x:2x2': unknown chip 'v9x' (known: v4, v5e, v5p, v6e; e.g. "
        "v5e:2x4, v6e:1x1, v4:2x2x1)"),
    cli("aot", "`--topology v4:2x2` (a v4 slice has 3 axes)", ["aot", *AOT, "--topology", "v4:2x2"],
        "error: --topology 'v4:2x2': a v4 slice is 3 numbers >= 1 joined by x (e.g. v4:2x2x2)"),
    cli("aot", "`--modes ar,beam:4`", ["aot", *AOT, "--modes", "ar,beam:4"],
        "error: --modes: 'beam:4' is not a mode: ar, parallel:K, sequential:K (K >= 2 the "
        "verify length) or tree:N (N >= 2 nodes)"),
    cli("aot", "`--modes sequential:8` with a drafter of block 4",
        ["aot", *AOT, "--modes", "sequential:8"],
        "error: --modes sequential:8: the verify length exceeds the drafter's block size 4"),
    cli("aot", "`--batch_sizes 0`", ["aot", *AOT, "--batch_sizes", "0"],
        "error: --batch_sizes: '0' is not an integer >= 1"),
    cli("aot", "`--max_len 64 --prompt_len 64` (no room to decode)",
        ["aot", *AOT, "--max_len", "64", "--prompt_len", "64"],
        "error: --prompt_len=64 and 9 spare positions for the decode steps leave no room to "
        "decode in --max_len=64"),
    cli("aot", "`--target random:nope`", ["aot", *AOT, "--target", "random:nope"],
        "error: unknown random target 'nope' (known: tiny, tiny-qwen3, tiny-qwen2, "
        "smollm2-135m-shape)"),
    cli("aot", "`--drafter` made for another target",
        ["aot", *AOT, "--drafter", "flexdraft_jax/drafters/smollm2_135m_L8"],
        "error: flexdraft_jax/drafters/smollm2_135m_L8 was made for target 'smollm2-135m' "
        "(num_layers=30), not 'random:tiny' (num_layers=4)"),
    cli("aot", "`--out` a folder holding files it did not write", ["aot", *AOT, "--out", "{d}"],
        "error: --out {d} holds files this command did not write: give a new folder"),
]


def _bonus_drafter(target, block_size=4):
  from flexdraft_jax.drafter.model import Drafter, DrafterConfig, init_draft_params
  import jax
  dcfg = DrafterConfig(num_layers=1, block_size=block_size, calib_rank=8, bonus_input=True)
  params = init_draft_params(target.params, target.config, dcfg, jax.random.PRNGKey(0))
  return Drafter(dcfg, params, target.fingerprint)


def _id(case) -> str:
  return re.sub(r"\W+", "_", f"{case['surface']}_{case['bad']}").strip("_")[:60]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
  """The bad files the cases name: a file in the way, a read-only dir, prompts
  files, and regenerated data whose prompts are all longer than 25 tokens."""
  tmp_path = tmp_path_factory.mktemp("bad")
  (tmp_path / "afile").write_text("x")
  (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
  (tmp_path / "int.jsonl").write_text(json.dumps({"prompt": 123}) + "\n")
  (tmp_path / "notok").mkdir()  # an HF checkpoint folder without tokenizer.json
  (tmp_path / "notok" / "config.json").write_text("{}")
  (tmp_path / "list.json").write_text("[1, 2, 3]")
  (tmp_path / "eval_prompts.json").write_text(json.dumps({"gsm8k": ["What is 2+3?"]}))
  (tmp_path / "listresults").mkdir()  # an eval workdir whose results.json is not its own
  (tmp_path / "listresults" / "results.json").write_text("[1, 2, 3]")
  (tmp_path / "long4.jsonl").write_text("".join(  # its 4th prompt: past the context
      json.dumps(p) + "\n" for p in ["a", "b", "c", "x" * 2100]))
  (tmp_path / "f32results").mkdir()  # an eval workdir begun in float32
  (tmp_path / "f32results" / "results.json").write_text(json.dumps(
      {"version": 1, "meta": {"settings": {"dtype": "float32"}, "prompts": {}},
       "cells": {}, "ablation": []}))
  regen_store.write_shard(str(tmp_path / "regen300"), 0, [])  # answers of 300 tokens
  (tmp_path / "regen300" / "meta.json").write_text(json.dumps(
      {"target": "random:tiny:0", "max_new_tokens": 300, "chat_kwargs": {},
       "dtype": "float32"}))
  (tmp_path / "nowheel").mkdir()  # an offline bundle whose wheel was not copied
  (tmp_path / "nowheel" / "manifest.json").write_text(json.dumps(
      {"requirements": {}, "wheels": {"x-1-py3-none-any.whl": "0" * 64}}))
  (tmp_path / "cut.tar.part000").write_bytes(b"x" * 10)  # its list says 20 bytes
  (tmp_path / "cut.tar.parts.json").write_text(json.dumps(
      {"bundle": "cut", "parts": [{"name": "cut.tar.part000", "bytes": 20, "sha256": ""}]}))
  for i in (0, 2):  # parts without their list, part001 missing
    (tmp_path / f"gap.tar.part{i:03d}").write_bytes(b"x" * 10)
  target0 = tiny.tiny_target()  # random:tiny:0's answers, with their meta.json
  tiny.write_fake_regen(str(tmp_path / "regen0"), target0, n=24)
  (tmp_path / "regen0" / "meta.json").write_text(json.dumps(
      {"target": target0.name, "target_fingerprint": target0.fingerprint}))
  ro = tmp_path / "readonly"
  ro.mkdir()
  ro.chmod(0o500)
  tiny.write_fake_regen(str(tmp_path / "regen"), tiny.tiny_target(), n=24)
  from flexdraft_jax.drafter import checkpoint
  checkpoint.save_drafter(str(tmp_path / "drafter"), _bonus_drafter(target0), target0)
  yield str(tmp_path), str(ro)
  ro.chmod(0o700)


def _no_model(monkeypatch):
  """Loading a model fails the test: the checks must come first."""
  def fail(*a, **k):
    raise AssertionError("the model was loaded before the input was checked")
  from flexdraft_jax import api as api_mod
  from flexdraft_jax.model import loading
  from flexdraft_jax.model import random_target
  monkeypatch.setattr(fd, "load_target", fail)
  monkeypatch.setattr(api_mod, "load_target", fail)
  monkeypatch.setattr(loading, "load_target", fail)
  monkeypatch.setattr(random_target, "load", fail)


def _offline_script(monkeypatch):
  """launch/offline.py as a module; pip running fails the test (the checks come first)."""
  spec = importlib.util.spec_from_file_location("offline", os.path.join(REPO, OFFLINE))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  monkeypatch.setattr(module, "_pip", lambda *a, **k: pytest.fail(
      f"pip ran before the input was checked: {a}"))
  return module


def _fill(x, d, ro):
  return x.replace("{d}", d).replace("{ro}", ro)


@pytest.mark.parametrize("case", [c for c in CASES if "argv" in c], ids=_id)
def test_cli_bad_input_prints_one_line(case, bad_files, monkeypatch, capsys,
                                       absl_flags_restored):
  d, ro = bad_files
  monkeypatch.setenv("FLEXDRAFT_COST_CACHE", "")
  for name, value in case["env"].items():
    monkeypatch.setenv(name, _fill(value, d, ro))
  if not case["model"]:
    _no_model(monkeypatch)
  argv = [_fill(a, d, ro) for a in case["argv"]]
  line = _fill(case["line"], d, ro)
  if "{ro}" in case["argv"][-1] and os.access(ro, os.W_OK):
    pytest.skip("running as root: a read-only directory is writable")
  if case["fresh"]:
    return _fresh_process_prints(argv, line, d)
  if argv[0] == OFFLINE:
    command = lambda: _offline_script(monkeypatch).main(argv[1:])
  else:
    command = lambda: importlib.import_module(COMMANDS[argv[0]]).run(
        [f"flexdraft_jax {argv[0]}"] + argv[1:])
  with pytest.raises(SystemExit) as e:
    command()
  err = capsys.readouterr().err
  assert "Traceback" not in err
  if line.startswith("warning:"):
    assert e.value.code in (0, None), err
    assert line in err.splitlines(), err
  else:
    assert e.value.code == 1
    assert err.strip().splitlines()[-1] == line, err
    assert sum(x.startswith("error:") for x in err.splitlines()) == 1


def _fresh_process_prints(argv, line, d):
  """`python -m flexdraft_jax ARGV` in a new process prints `line` alone on
  stderr: nothing before it (a library's log line), nothing after, exit 1."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", FLEXDRAFT_COST_CACHE="",
             FLEXDRAFT_COMPILE_CACHE=os.path.join(d, "xla"))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a folder of JAX's own: never reset
  r = subprocess.run([sys.executable, "-m", "flexdraft_jax", *argv], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stderr
  assert r.stderr.splitlines() == [line], r.stderr


@pytest.mark.parametrize("case", [c for c in CASES if "call" in c], ids=_id)
def test_generate_bad_input_is_one_line(case):
  def call():  # an options object may refuse its values itself, when made
    if callable(case["call"]):
      return case["call"](tiny.tiny_target())
    kw = {k: v(tiny.tiny_target()) if callable(v) else v for k, v in case["call"].items()}
    target = kw.pop("target", tiny.tiny_target())
    prompts = kw.pop("prompts", [[3, 4, 5]])
    fd.generate(target, prompts, max_new_tokens=2, **kw)
  if case["warning"]:
    with pytest.warns(fd.FlexDraftWarning) as rec:
      call()
    assert [str(w.message) for w in rec if w.category is fd.FlexDraftWarning] == [case["line"]]
    return
  with pytest.raises(fd.FlexDraftError) as e:
    call()
  assert str(e.value) == case["line"]


def test_a_prompt_past_the_context_fails_the_call_before_any_batch_decodes(monkeypatch):
  from flexdraft_jax.decoding import engine
  decoded = []
  batch = engine._generate_batch
  monkeypatch.setattr(engine, "_generate_batch",
                      lambda *a, **k: decoded.append(1) or batch(*a, **k))
  target = tiny.tiny_target()
  prompts = [[3, 4, 5]] * 3 + [[3] * 2100]
  line = "prompt 3 (2100 tokens) + max_new_tokens=2 exceeds the model's context of 2048"
  one = fd.RuntimeOptions(batch_size=1)
  with pytest.raises(fd.FlexDraftError, match=re.escape(line)):
    fd.generate(target, prompts, max_new_tokens=2, runtime=one)
  with pytest.raises(fd.FlexDraftError, match=re.escape(line)):  # when called, not iterated
    fd.generate_stream(target, prompts, max_new_tokens=2, runtime=one)
  with pytest.raises(fd.FlexDraftError, match=r"^runtime.max_len=64 is too short: prompt 1 "):
    fd.generate(target, [[3] * 10, [3] * 60], max_new_tokens=2,
                runtime=fd.RuntimeOptions(batch_size=1, max_len=64))
  assert decoded == []
  assert len(fd.generate(target, prompts[:3], max_new_tokens=2, runtime=one).token_ids) == 3


def _generate_json(argv, capsys) -> dict:
  from flexdraft_jax import cli
  assert cli.main(GEN[:4] + ["--json"] + argv) == 0
  return json.loads(capsys.readouterr().out)


def test_generate_cli_takes_the_python_api_names(monkeypatch, capsys):
  monkeypatch.setenv("FLEXDRAFT_COST_CACHE", "")
  base = ["--max-new-tokens", "8", "--prompt", "abc"]
  free = _generate_json(base, capsys)["outputs"]
  stop = free[1]["token_ids"][3]
  cut = free[1]["token_ids"].index(stop) + 1
  # --stop (an id), --attn-impl and the old --attention-impl, --max-len
  for flag in ("--attn-impl", "--attention-impl"):
    out = _generate_json(base + ["--stop", str(stop), flag, "xla", "--max-len", "64"],
                         capsys)["outputs"]
    assert out[1]["token_ids"] == free[1]["token_ids"][:cut]
  from flexdraft_jax import cli
  with pytest.raises(fd.FlexDraftError, match=r"longer than the cache \(--max-len=4\)"):
    cli.main(GEN + ["--prompt", "a longer prompt", "--max-len", "4"])


def test_integer_arrays_are_still_prompts():
  import jax.numpy as jnp
  target = tiny.tiny_target()
  ref = fd.generate(target, [[3, 4, 5]], max_new_tokens=3).token_ids
  for prompts in (np.array([[3, 4, 5]], np.int64), jnp.asarray([[3, 4, 5]], jnp.int32),
                  [[np.int32(3), 4, jnp.int32(5)]]):
    assert fd.generate(target, prompts, max_new_tokens=3).token_ids == ref


def test_no_effect_options_used_as_meant_are_silent():
  target = tiny.tiny_target()
  with warnings.catch_warnings():
    warnings.simplefilter("error", fd.FlexDraftWarning)
    fd.generate(target, [[3, 4, 5]], max_new_tokens=2,
                sampling=fd.SamplingParams(temperature=1.0, draft_sampling=True))


def test_the_smallest_temperature_decodes_the_argmax_in_every_mode(monkeypatch):
  # At the bound logits / T is still finite: sampling is the argmax (greedy's
  # ids), where 1e-39 decoded ids 0, 1, 2 in every mode.
  from flexdraft_jax.decoding.options import MODES
  from flexdraft_jax.decoding.sampling import MIN_TEMPERATURE
  monkeypatch.setenv("FLEXDRAFT_COST_CACHE", "")
  target = tiny.tiny_target()
  drafter = _bonus_drafter(target)
  for mode in MODES:
    kw = dict(mode=mode, drafter=None if mode == "ar" else drafter, max_new_tokens=6,
              speculation=fd.SpecOptions(flex_threshold=2) if mode == "flex" else None)
    kw = {k: v for k, v in kw.items() if v is not None}
    greedy = fd.generate(target, [[3, 4, 5]], **kw).token_ids
    coldest = fd.generate(target, [[3, 4, 5]], seed=7, **kw,
                          sampling=fd.SamplingParams(temperature=MIN_TEMPERATURE)).token_ids
    assert coldest == greedy, mode
    assert greedy[0][:3] != [0, 1, 2], mode  # what the flushed temperature gave


def test_a_relative_xdg_cache_home_is_ignored_with_one_warning(tmp_path, monkeypatch, capsys):
  import gguf  # noqa: F401  (index_path reads its version)

  from flexdraft_jax import compile_cache, paths
  from flexdraft_jax.decoding import step_costs
  from flexdraft_jax.kernels import cpu_matmul
  from flexdraft_jax.model import gguf_loader
  monkeypatch.setattr(paths, "_RELATIVE_WARNED", set())
  for name in ("FLEXDRAFT_COST_CACHE", "FLEXDRAFT_KERNEL_CACHE", gguf_loader.INDEX_ENV):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.chdir(tmp_path)
  (tmp_path / "m.gguf").write_bytes(b"GGUF")
  home_cache = os.path.join(os.path.expanduser("~"), ".cache", "flexdraft_jax")
  for relative in ("~/.cache", "cache"):
    monkeypatch.setenv("XDG_CACHE_HOME", relative)
    where = [compile_cache.default_root(), step_costs.cost_cache_path("default"),
             cpu_matmul.cache_dir(), gguf_loader.index_path("m.gguf")]
    assert all(w.startswith(home_cache + os.sep) for w in where), where
    assert capsys.readouterr().err.splitlines() == [  # once for the four
        f"warning: $XDG_CACHE_HOME={relative!r} is not an absolute path, which the XDG "
        "base directory spec says to ignore: caches go to ~/.cache instead"]
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # an absolute one is used
  assert compile_cache.default_root() == str(tmp_path / "xdg" / "flexdraft_jax" / "xla")
  assert capsys.readouterr().err == ""
  assert sorted(os.listdir(tmp_path)) == ["m.gguf"]  # nothing made under the folder


@pytest.mark.parametrize("command, flags", [
    ("train", ("--config", "--workdir")), ("eval", ("--config", "--workdir")),
    ("regenerate", ("--config", "--limit", "--max_minutes")),
    ("aot", ("--target", "--drafter", "--topology", "--batch_sizes", "--modes", "--out"))])
def test_short_help_lists_the_key_flags(command, flags, capsys):
  module = importlib.import_module(COMMANDS[command])
  with pytest.raises(SystemExit):
    module.run([f"flexdraft_jax {command}", "--help"])
  out = capsys.readouterr().out
  for flag in flags:
    assert f"  {flag}:" in out, out


def test_train_says_where_it_writes_first(bad_files, monkeypatch, capsys):
  from flexdraft_jax.training import train
  d, _ = bad_files
  _no_model(monkeypatch)  # it fails on the data (no anchors) after saying so
  config = tiny.tiny_config(os.path.join(d, "regen"), seq_len=30, precompute_kv=True)
  with pytest.raises(fd.FlexDraftError, match="no anchor block"):
    train.train(config, os.path.join(d, "w"))
  assert capsys.readouterr().out.splitlines()[0] == (
      f"train: writing checkpoints, metrics and drafters to {d}/w; the clean K/V cache "
      f"to {d}/w/deep_kv (--config.train.deep_kv_dir)")


def test_tiny_test_config_leaves_every_kept_prompt_an_anchor(capsys):
  c = tiny.tiny_test_config()
  T, bs = c.train.seq_len, c.drafter.block_size

  def rec(prompt_len, answer_len):
    return regen_store.Record("u", "s", np.ones(prompt_len, np.int32), np.ones(answer_len, np.int32))

  # the longest prompt regeneration keeps, with the shortest and longest answer
  kept = [rec(c.data.max_prompt_tokens, n) for n in (1, c.data.max_new_tokens)]
  assert data.without_anchor(kept, T, bs) == 0
  assert data.without_anchor([rec(T - bs + 1, 1)], T, bs) == 1  # one token longer
  data.check_anchors(kept + [rec(T, 5)], T, bs)  # some without: one warning line
  assert capsys.readouterr().out == (
      f"train: warning: 1 of 3 training sequences have no anchor block within "
      f"seq_len={T} (their prompt leaves fewer than {bs + 1} tokens for the answer); "
      "they add nothing\n")
  with pytest.raises(fd.FlexDraftError, match=f"^2 of 3 training sequences"):
    data.check_anchors(kept[:1] + [rec(T, 5)] * 2, T, bs)


def render_table() -> str:
  """The markdown table of docs/bad_inputs.md."""
  rows = ["| where | bad input | what it prints |", "|---|---|---|"]
  for c in CASES:
    line = c["line"] if "argv" in c else (
        f"`FlexDraftWarning: {c['line']}`" if c["warning"] else f"`FlexDraftError: {c['line']}`")
    if "argv" in c:
      line = f"`{line}`"
    line = line.replace("{d}", "DIR").replace("{ro}", "DIR").replace("|", "\\|")
    rows.append(f"| {c['surface']} | {c['bad'].replace('|', '/')} | {line} |")
  return "\n".join(rows) + "\n"


def test_docs_table_is_this_table():
  with open(DOC, encoding="utf-8") as f:
    doc = f.read()
  assert render_table() in doc, "regenerate the table: python -c 'from tests import " \
      "test_bad_inputs as t; print(t.render_table())'"
