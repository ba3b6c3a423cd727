"""generate_stream: each row's tokens as they are decided, the same tokens and
stats as generate, text that never splits a character."""

import pytest

import flexdraft_jax as fd
from flexdraft_jax.decoding import engine, step_costs
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.model.random_target import ByteTokenizer
from tests.decoding_util import random_drafter, tiny_target
from tests.test_decoding import prompts_for


@pytest.fixture(scope="module")
def target():
  return tiny_target()


def _collect(stream):
  """{row: [tokens]} and {row: text} joined from a stream's chunks."""
  toks, texts = {}, {}
  for c in stream:
    assert c.token_ids or c.text, "a chunk carries new tokens (or the text they held)"
    toks.setdefault(c.row, []).extend(c.token_ids)
    texts[c.row] = texts.get(c.row, "") + c.text
  return toks, texts


# flex "auto" chooses by the wall time its steps take, so two calls may choose
# differently (same tokens, other steps); flex with a fixed B* (the paper's
# rule: parallel at most B* live rows, else sequential) chooses the same.
@pytest.mark.parametrize("mode, theta, flex_threshold", [
    ("ar", 0.0, "auto"), ("parallel", 0.0, "auto"), ("sequential", 0.3, "auto"),
    ("flex", 0.0, 4), ("flex", 0.0, "auto")])
def test_stream_yields_the_batch_call_s_tokens_in_every_mode(target, mode, theta,
                                                              flex_threshold, monkeypatch):
  monkeypatch.setattr(step_costs, "_COSTS_IN_MEMORY", {})
  # 9 prompts in batches of 8 and 1: rows finish apart (a stop token that one
  # row emits early), and the batch of 8 shrinks as its rows finish.
  prompts = prompts_for(9, seed=5)
  long = fd.generate(target, prompts, max_new_tokens=30, stop=[])
  stop = long.token_ids[0][6]
  kw = dict(max_new_tokens=30, stop=[stop], seed=3,
            runtime=fd.RuntimeOptions(batch_size=8))
  if mode != "ar":
    kw.update(drafter=random_drafter(target, block_size=4, noise=0.5), mode=mode,
              speculation=fd.SpecOptions(threshold=theta, cost_cache=None,
                                         flex_threshold=flex_threshold))
  batch = fd.generate(target, prompts, **kw)
  stream = fd.generate_stream(target, prompts, **kw)
  assert isinstance(stream, fd.GenerateStream) and stream.result is None
  chunks = sum(1 for _ in stream)
  assert stream.result is not None
  stream = fd.generate_stream(target, prompts, **kw)
  toks, texts = _collect(stream)
  assert [toks.get(r, []) for r in range(len(prompts))] == batch.token_ids
  assert [texts.get(r, "") for r in range(len(prompts))] == batch.texts
  assert stream.result.token_ids == batch.token_ids and stream.result.texts == batch.texts
  timed = mode == "flex" and flex_threshold == "auto"
  for k in ("new_tokens", "decode_tokens", "steps", "tau", "accept_hist"):
    if not (timed and k in ("steps", "tau", "accept_hist")):
      assert stream.result.stats[k] == batch.stats[k], k
  if mode == "flex" and not timed:  # rows finished apart: B* = 4 met both modes
    assert {m for m, _ in stream.result.stats["mode_steps"]} == {"parallel", "sequential"}
  # tokens came out in several pieces per row, not once at the end
  assert chunks > len(prompts)
  assert len(set(len(t) for t in batch.token_ids)) > 1, "rows should finish apart"


def test_stream_stats_add_up_and_leave_out_the_caller_s_time(target):
  import time
  stream = fd.generate_stream(target, prompts_for(1, seed=2), max_new_tokens=40, stop=[])
  held = 0.0
  for _ in stream:
    t = time.perf_counter()
    time.sleep(0.05)  # the caller prints slowly
    held += time.perf_counter() - t
  s = stream.result.stats
  assert held > 0.1
  parts = ("compile_seconds", "flex_timing_seconds", "prefill_seconds", "decode_seconds",
           "other_seconds")
  assert sum(s[k] for k in parts) == pytest.approx(s["seconds"], abs=1e-6)
  assert s["other_seconds"] >= held - 0.01  # the caller's time is not decoding
  assert s["decode_seconds"] < s["seconds"] - held


def test_generate_s_seconds_add_up_without_overlap(target, monkeypatch):
  monkeypatch.setattr(step_costs, "_COSTS_IN_MEMORY", {})
  import time
  drafter = random_drafter(target, block_size=4, noise=0.5)
  t = time.perf_counter()
  # a cache length no other test uses: this call compiles, and flex times its steps
  s = fd.generate(target, prompts_for(2, seed=4), max_new_tokens=24, drafter=drafter,
                  mode="flex", speculation=fd.SpecOptions(cost_cache=None),
                  runtime=fd.RuntimeOptions(max_len=736)).stats
  wall = time.perf_counter() - t
  parts = ("compile_seconds", "flex_timing_seconds", "prefill_seconds", "decode_seconds",
           "other_seconds")
  assert all(s[k] >= 0 for k in parts)
  assert s["compile_seconds"] > 0 and s["flex_timing_seconds"] > 0
  assert sum(s[k] for k in parts) == pytest.approx(s["seconds"], abs=1e-6)
  assert s["seconds"] <= wall  # the parts never overlap: they fit in the call
  assert s["programs_compiled"] + s["programs_from_cache"] > 0


def test_text_streams_never_split_a_character():
  tok = ByteTokenizer()
  ids = tok.encode("añ€😀b") + [0xE2, 0x82, 0x41]  # ends in an invalid sequence, then "A"
  streams = engine._TextStreams(tok)
  pieces = []
  for n in range(1, len(ids) + 1):  # one token at a time
    for c in streams.update({0: ids[:n]}):
      assert c.row == 0 and c.token_ids == [ids[n - 1]]
      assert "\ufffd" not in c.text or n == len(ids)
      pieces.append(c.text)
  pieces += [c.text for c in streams.update({0: ids}, final=True)]
  assert "".join(pieces) == tok.decode(ids)
  assert pieces[:3] == ["a", "", "ñ"]  # ñ waits for its second byte


def test_stream_arguments_are_checked_before_iterating(target):
  with pytest.raises(FlexDraftError, match="needs a drafter"):
    fd.generate_stream(target, [[3, 4]], mode="sequential")


def test_stream_can_stop_early(target):
  stream = fd.generate_stream(target, prompts_for(2, seed=1), max_new_tokens=64, stop=[])
  first = next(iter(stream))
  assert first.token_ids
  stream.close()
  assert stream.result is None
  with pytest.raises(StopIteration):
    next(stream)


def test_cli_streams_and_its_seconds_add_up_to_the_command(tmp_path):
  import os
  import re
  import subprocess
  import sys
  import time
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, FLEXDRAFT_COMPILE_CACHE=str(tmp_path / "xla"))
  t = time.time()
  r = subprocess.run([sys.executable, "-m", "flexdraft_jax", "generate", "--model",
                      "random:tiny", "--prompt", "hi", "--max-new-tokens", "40", "--stream"],
                     cwd=repo, env=env, capture_output=True, text=True, timeout=600)
  wall = time.time() - t
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.startswith("### hi\n")
  line = r.stderr.strip().splitlines()[-1]
  m = re.match(r"([\d.]+)s in all: startup ([\d.]+)s, load ([\d.]+)s, compile ([\d.]+)s "
               r"\((\d+) programs compiled, (\d+) loaded from the cache [^)]*\), "
               r"prefill ([\d.]+)s, decode ([\d.]+)s, other ([\d.]+)s$", line)
  assert m, line
  total, *parts = (float(m.group(i)) for i in (1, 2, 3, 4, 7, 8, 9))
  assert abs(sum(parts) - total) <= 0.05 * len(parts)  # each printed to 0.1 s or better
  assert total <= wall  # the parts never overlap: they fit in the process
  assert int(m.group(5)) > 0
