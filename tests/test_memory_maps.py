"""A long-lived process drops its compiled programs before it nears the mapping limit."""

import sys

import pytest

import flexdraft_jax as fd
from flexdraft_jax.decoding import memory_maps
from tests.decoding_util import bigram_drafter, tiny_target

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads Linux's /proc/self/maps")


def test_generate_drops_compiled_programs_near_the_mapping_limit(monkeypatch):
  target = tiny_target(vocab=32, eos=0, seed=1)
  drafter = bigram_drafter(target)
  run = lambda b: fd.generate(target, [[1, 2, 3]] * b, max_new_tokens=8, drafter=drafter,
                              mode="sequential")
  first = run(1)
  for b in (2, 3, 4):  # a program for each batch size: a few hundred mappings each
    run(b)
  assert not memory_maps.release_if_near_limit()  # far below the real limit
  held = memory_maps.count()
  # A limit the process is now just past FRACTION of: the next call drops
  # every compiled program, then compiles the one it needs again.
  monkeypatch.setattr(memory_maps, "limit", lambda: int(held / memory_maps.FRACTION) - 1)
  again = run(1)
  assert memory_maps.count() < held - 500
  assert again.token_ids == first.token_ids
