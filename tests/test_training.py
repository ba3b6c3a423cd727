"""Training pipeline on a random tiny target (CPU): data, loss, steps, resume, sharding."""

import dataclasses
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from tests import data_fixture, tiny  # noqa: E402

from flexdraft_jax.drafter import checkpoint as drafter_ckpt  # noqa: E402
from flexdraft_jax.drafter.model import DrafterConfig, init_draft_params  # noqa: E402
from flexdraft_jax.model import pytree, transformer  # noqa: E402
from flexdraft_jax.model.config import FlexDraftError  # noqa: E402
from flexdraft_jax.training import (checkpoints, data, kv_cache, loss as loss_lib,  # noqa: E402
                                    prompt_mix, regen_store, sharding, train)
from flexdraft_jax.training import steps as steps_lib  # noqa: E402
from flexdraft_jax.training.config import base_config  # noqa: E402
from flexdraft_jax.paths import data_root  # noqa: E402

# Subprocesses share the suite's compile cache (tests/conftest.py).
XLA_CACHE = jax.config.jax_compilation_cache_dir

STEPS = 24


@pytest.fixture(scope="module")
def target():
  return tiny.tiny_target()


@pytest.fixture(scope="module")
def regen(tmp_path_factory, target):
  d = str(tmp_path_factory.mktemp("regen"))
  return d, tiny.write_fake_regen(d, target, n=24)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, regen):
  """An uninterrupted run: STEPS steps, checkpoints every 4, eval every 6."""
  workdir = str(tmp_path_factory.mktemp("ref"))
  cfg = tiny.tiny_config(regen[0], num_steps=STEPS, ckpt_every=4, eval_every=6)
  return train.train(cfg, workdir), workdir


def _flat(tree):
  return {k: np.asarray(v) for k, v in drafter_ckpt.flatten(tree).items()}


def _read_csv(path):
  import csv
  with open(path) as f:
    return list(csv.DictReader(f))


# ------------------------------------------------------------------ data ----

def test_tfds_dataset_round_trips(regen):
  regen_dir, recs = regen
  got = regen_store.load_records(regen_dir)
  want = sorted(recs, key=lambda r: r["uid"])
  assert [r.uid for r in got] == [r["uid"] for r in want]
  for g, w in zip(got, want):
    assert g.source == w["source"]
    np.testing.assert_array_equal(g.prompt_ids, w["prompt_ids"])
    np.testing.assert_array_equal(g.answer_ids, w["answer_ids"])
  # a plain tfds reader sees the same dataset
  import tensorflow_datasets as tfds
  path = os.path.join(regen_store.tfds_dir(regen_dir), regen_store.DATASET_NAME, "1.0.0")
  src = tfds.builder_from_directory(path).as_data_source()["train"]
  assert len(src) == len(recs)


def test_packer_is_static_deterministic_and_in_range(regen):
  recs = regen_store.load_records(regen[0])
  T, K, bs = 40, 3, 4
  p = data.Packer(recs, seq_len=T, anchors=K, block_size=bs, pad_id=256, seed=1)
  b = p.train_batch(5, 6)
  assert b["tokens_BxT"].shape == (6, T) and b["anchor_BxK"].shape == (6, K)
  idx, _ = p.train_indices(5, 6)
  for row, i in enumerate(idx):
    r = recs[i]
    n = min(len(r.prompt_ids) + len(r.answer_ids), T)
    assert b["length_B"][row] == n
    a = b["anchor_BxK"][row][b["anchor_ok_BxK"][row]]
    assert np.all(a >= len(r.prompt_ids) - 1)
    assert np.all(a + bs <= T - 1) and np.all(a + 1 < n)
  again = p.train_batch(5, 6)
  for k in b:
    np.testing.assert_array_equal(b[k], again[k])
  assert not np.array_equal(p.train_batch(6, 6)["tokens_BxT"], b["tokens_BxT"])
  part = p.train_batch(5, 6, rows=(2, 4))  # a process's slice of the same batch
  np.testing.assert_array_equal(part["anchor_BxK"], b["anchor_BxK"][2:4])


@pytest.fixture(scope="module")
def fixture_data(tmp_path_factory):
  """Prompt files in each source's format (tests/data_fixture.py), no real data."""
  return data_fixture.write(str(tmp_path_factory.mktemp("data")))


def test_prompt_sources_exclude_eval_splits(fixture_data, monkeypatch):
  monkeypatch.setenv("FLEXDRAFT_DATA", fixture_data)
  cfg = tiny.tiny_config("/unused").data
  assert cfg.paths.mbpp.startswith(fixture_data)
  mbpp = prompt_mix.read_source("mbpp", cfg.paths.mbpp)
  ids = [int(p.uid.split(":")[1]) for p in mbpp]
  assert sorted(ids) == sorted(data_fixture.MBPP_TRAIN_IDS)  # never 1-510
  assert all("Your code should pass this test:\nassert add_" in p.text for p in mbpp)
  cfg.mix = dict(gsm8k=4, mbpp=2, arena_hard_v01=-1, arena_hard_v20=1)
  prompts = prompt_mix.load_prompts(cfg)
  assert len(prompts) == 4 + 2 + 3 + 1
  assert len({p.uid for p in prompts}) == len(prompts)
  assert all(p.text.endswith(cfg.suffix.gsm8k) for p in prompts if p.source == "gsm8k")


def test_prompt_variants_frame_the_same_questions(fixture_data, monkeypatch):
  from flexdraft_jax.evaluation import benchmarks
  monkeypatch.setenv("FLEXDRAFT_DATA", fixture_data)
  cfg = tiny.tiny_config("/unused").data
  cfg.mix = dict(gsm8k=4, mbpp=-1, arena_hard_v01=-1, arena_hard_v20=1)
  own = {p.uid: p for p in prompt_mix.load_prompts(cfg)}
  cfg.variant = "bench"  # the benchmarks' instructions; arena prompts have none
  bench = prompt_mix.load_prompts(cfg)
  assert {p.source for p in bench} == {"gsm8k", "mbpp"}
  for p in bench:
    base = own[data.question_uid(p.uid)]
    assert p.uid == base.uid + "#bench" and p.text != base.text
    instruction = (benchmarks.MATH_INSTRUCTION if p.source == "gsm8k"
                   else benchmarks.CODE_INSTRUCTION)
    assert p.text.endswith(instruction)
    suffix = cfg.suffix[p.source]
    assert p.text[:-len(instruction)] == base.text[:-len(suffix)]
  cfg.variant = "fn"  # MBPP as HumanEval frames a prompt
  fn = prompt_mix.load_prompts(cfg)
  assert sorted(p.uid for p in fn) == sorted(f"mbpp:{i}#fn" for i in data_fixture.MBPP_TRAIN_IDS)
  i = data_fixture.MBPP_TRAIN_IDS[0]
  text = next(p.text for p in fn if p.uid == f"mbpp:{i}#fn")
  assert text.startswith("Complete the following Python function")
  assert f"def add_{i}(x):\n" in text and f">>> add_{i}(1) == {i + 1}\n" in text
  assert f"return x + {i}" not in text  # the signature, never the solution
  cfg.variant = "doc"  # the same, the test shown as HumanEval shows an example
  doc = {p.uid: p.text for p in prompt_mix.load_prompts(cfg)}
  assert sorted(doc) == sorted(f"mbpp:{i}#doc" for i in data_fixture.MBPP_TRAIN_IDS)
  assert f">>> add_{i}(1)\n    {i + 1}\n" in doc[f"mbpp:{i}#doc"]
  assert f"return x + {i}" not in doc[f"mbpp:{i}#doc"]
  cfg.variant = "nope"
  with pytest.raises(FlexDraftError, match="unknown prompt variant 'nope'"):
    prompt_mix.load_prompts(cfg)


def test_mbpp_function_needs_the_tested_def_on_one_line():
  task = {"text": "Sum two numbers.", "test_list": ["assert add(1, 2) == 3"],
          "code": "import math\r\nclass Helper: \r\n\tpass\r\ndef helper(x):\r\n"
                  "\treturn x\r\ndef add(a, b): \r\n\treturn a + b"}
  assert prompt_mix.mbpp_function(task) == (
      'import math\ndef add(a, b):\n    """Sum two numbers.\n    >>> add(1, 2) == 3\n'
      '    True\n    """')
  two = dict(task, test_list=["assert add(1, 2) == 3", "assert add(*(2, 2)) == (2 == 2) + 3",
                              "assert add(0, 0) < 1", "assert add(0, 0"])
  assert prompt_mix.mbpp_function(two, examples=True) == (  # tests not `CALL == VALUE` are left out
      'import math\ndef add(a, b):\n    """Sum two numbers.\n    >>> add(1, 2)\n    3\n'
      '    >>> add(*(2, 2))\n    (2 == 2) + 3\n    """')
  assert prompt_mix.mbpp_function(dict(task, code="def add(a,\n        b):\n  return a + b")) == ""
  assert prompt_mix.mbpp_function(dict(task, code="def other(a):\n  return a")) == ""


def test_split_eval_holds_out_own_prompts_and_drops_their_variants():
  rec = lambda uid: regen_store.Record(uid, uid.split(":")[0], np.array([1], np.int32),
                                np.array([2, 3], np.int32))
  own = [rec(f"gsm8k:{i}") for i in range(40)]
  train0, held0 = data.split_eval(own, 5)
  variants = [rec(r.uid + "#bench") for r in own] + [rec("gsm8k:99#bench")]
  train, held = data.split_eval(own + variants, 5)
  # the same held-out answers as without variants, never a variant
  assert [r.uid for r in held] == [r.uid for r in held0] and len(held) == 5
  held_q = {r.uid for r in held}
  assert not {data.question_uid(r.uid) for r in train} & held_q
  # every other record trains: the own prompts' and their variants'
  assert len(train) == len(own) + len(variants) - 2 * 5
  assert {r.uid for r in train0} < {r.uid for r in train}
  # the held-out questions' variant answers score them in the variants' format
  assert {r.uid for r in data.held_out_variants(own + variants, 5)} == {
      q + "#bench" for q in held_q}
  assert data.held_out_variants(own, 5) == []


def test_format_gap_slices_split_trained_on_formats_from_held_out():
  rec = lambda uid: regen_store.Record(uid, uid.split(":")[0], np.array([1], np.int32),
                                np.array([2, 3], np.int32))
  own = [rec(f"gsm8k:{i}") for i in range(40)] + [rec(f"mbpp:{i}") for i in range(10)]
  recs = own + [rec(r.uid + "#bench") for r in own] + [rec("gsm8k:3#doc")]
  parts = data.format_slices(recs, "gsm8k", num_eval=8, limit=6)
  trained_own, trained_bench, held, held_bench = parts.values()
  held_q = {r.uid for r in data.split_eval(recs, 8)[1] if r.source == "gsm8k"}
  assert {r.uid for r in held} == held_q and held_q
  assert {r.uid for r in held_bench} == {q + "#bench" for q in held_q}
  assert len(trained_own) == len(trained_bench) == 6
  assert all("#" not in r.uid and r.source == "gsm8k" for r in trained_own)
  assert all(r.uid.endswith("#bench") and r.source == "gsm8k" for r in trained_bench)
  # nothing trained-on answers a held-out question, in either format
  assert not {data.question_uid(r.uid) for r in trained_own + trained_bench} & held_q


def test_shipped_dataset_holds_training_questions_only():
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with np.load(os.path.join(repo, "datasets", "smollm2_135m", "regen.npz")) as z:
    uids, sources = [str(u) for u in z["uid"]], [str(s) for s in z["source"]]
    lengths = z["prompt_len"] + z["answer_len"]
    n_ids, meta = len(z["ids"]), json.loads(str(z["meta"]))
  with open(os.path.join(repo, "flexdraft_jax", "drafters", "smollm2_135m",
                         "drafter.json")) as f:
    assert meta["target_fingerprint"] in f.read()  # the shipped drafter's target
  assert len(set(uids)) == len(uids) and int(lengths.sum()) == n_ids
  for uid, source in zip(uids, sources):
    question, _, variant = uid.partition("#")
    assert question.split(":")[0] == source and source in prompt_mix.SOURCES
    assert variant == "" or source in prompt_mix.VARIANTS[variant]
    if source == "mbpp":  # never a test or few-shot task
      assert 511 <= int(question.split(":")[1]) <= 974, uid
    if source == "gsm8k":  # train.jsonl's 7,473 rows
      assert 0 <= int(question.split(":")[1]) < 7473, uid
  # the chat questions the target wrote ship beside it (its card's self_instruct.jsonl)
  with open(os.path.join(repo, "datasets", "smollm2_135m", "self_instruct.jsonl")) as f:
    written = {json.loads(line)["uid"] for line in f}
  chat = {u for u, s in zip(uids, sources) if s == "self_instruct"}
  assert chat and chat <= written


REAL_MBPP = os.path.join(data_root(), "mbpp", "mbpp.jsonl")


@pytest.mark.skipif(not os.path.isfile(REAL_MBPP), reason=f"needs the real MBPP file "
                    f"({REAL_MBPP}; set $FLEXDRAFT_DATA): CI has it")
def test_real_mbpp_training_split_is_511_to_974():
  ids = [int(p.uid.split(":")[1]) for p in prompt_mix.read_source("mbpp", REAL_MBPP)]
  assert min(ids) == 511 and max(ids) == 974 and len(ids) == 464


# ------------------------------------------------------------------ loss ----

def test_mask_rows_layout():
  m = loss_lib.mask_rows(jnp.array([[3, 10]]), 4)
  np.testing.assert_array_equal(m.pos_BxM, [[4, 5, 6, 7, 11, 12, 13, 14]])
  np.testing.assert_array_equal(m.limit_BxM, [[3, 3, 3, 3, 10, 10, 10, 10]])
  np.testing.assert_array_equal(m.group_M, [0, 0, 0, 0, 1, 1, 1, 1])


def test_block_diagonal_mask_attention_equals_the_group_mask():
  """Training's anchor blocks scored against their own block's keys only
  (`extra_block`) give the group-mask attention's output and gradients."""
  from flexdraft_jax.model import attention
  rng = np.random.default_rng(0)
  B, K, G, D, S, n, bs = 2, 3, 3, 8, 24, 5, 4
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, k, v = normal(B, n * bs, K * G, D), normal(B, K, S, D), normal(B, K, S, D)
  xk, xv = normal(B, n * bs, K, D), normal(B, n * bs, K, D)
  # limits -1 (no clean key: the block's own keys only) up to the whole cache
  limit = jnp.asarray(np.repeat(rng.integers(-1, S, (B, n)), bs, axis=1), jnp.int32)
  group = jnp.repeat(jnp.arange(n), bs)

  def out_and_grads(block):
    f = lambda q, xk, xv, k: attention.attend_xla(q, k, v, limit, xk, xv, group, group,
                                                  extra_block=block)
    return f(q, xk, xv, k), jax.grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2, 3))(
        q, xk, xv, k)

  (want, want_g), (got, got_g) = out_and_grads(None), out_and_grads(bs)
  np.testing.assert_allclose(got, want, atol=1e-5)
  for g, w in zip(got_g, want_g):
    np.testing.assert_allclose(g, w, atol=1e-4)
  # the mask rows of loss.mask_rows carry the block; decoding's do not
  assert loss_lib.mask_rows(jnp.array([[3, 10]]), 4).block == 4
  with pytest.raises(ValueError, match="extra_block=3"):
    attention.attend_xla(q, k, v, limit, xk, xv, group, group, extra_block=3)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3", "tiny-qwen2"])
def test_dual_path_clean_rows_equal_target(name):
  t = tiny.tiny_target(name, seed=3)
  cfg, dcfg = t.config, DrafterConfig(num_layers=2, block_size=4, calib_rank=8)
  draft = init_draft_params(t.params, cfg, dcfg, jax.random.PRNGKey(0))
  draft["mask"] = draft["mask"] * 50.0  # make mask rows matter
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
  anchors = jnp.array([[2, 6], [0, 7]])
  masks = loss_lib.mask_rows(anchors, dcfg.block_size)
  zeros = pytree.KVCache.zeros(cfg, 2, 12, jnp.float32)
  h_ref, _, cache_ref = transformer.forward(t.params, cfg, zeros, tokens, pos)
  h, hm, cache = transformer.forward(t.params, cfg, zeros, tokens, pos, draft=draft,
                                     masks=masks, num_draft_layers=2)
  np.testing.assert_array_equal(h, h_ref)         # bit-identical clean rows
  np.testing.assert_array_equal(cache.k, cache_ref.k)
  # training's deep-only pass against the clean cache = the joint pass
  h_clean, cache2 = loss_lib.clean_pass(t.params, cfg, tokens)
  np.testing.assert_array_equal(h_clean, h_ref)
  _, hm2, _ = transformer.forward(t.params, cfg, cache2, None, None, draft=draft,
                                  masks=masks, num_draft_layers=2)
  np.testing.assert_allclose(hm2, hm, atol=1e-5, rtol=1e-5)


def test_precomputed_deep_kv_gives_the_same_loss(regen, target):
  dcfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=8)
  packer = data.Packer(regen_store.load_records(regen[0]), seq_len=40, anchors=2,
                       block_size=4, pad_id=256, seed=0)
  batch = packer.train_batch(0, 3)
  draft = init_draft_params(target.params, target.config, dcfg, jax.random.PRNGKey(0))
  f = jax.jit(lambda b: loss_lib.loss_and_metrics(draft, target.params, target.config,
                                                  dcfg, b))
  k, v = loss_lib.deep_kv(target.params, target.config, batch["tokens_BxT"], 2)
  assert k.shape == (3, 2, target.config.num_kv_heads, 40, target.config.head_dim)
  loss, m = f(batch)
  loss2, m2 = f(dict(batch, **loss_lib.deep_kv_entries(k, v)))
  np.testing.assert_allclose(loss2, loss, rtol=1e-6)
  assert float(m2["tau"]) == float(m["tau"])


def test_batches_cut_to_their_longest_sequence_give_the_same_loss(regen, target):
  """Without precomputed K/V a batch is cut to its longest sequence rounded up
  to `width_multiple`; the step's loss and metrics do not change, and a
  process's share of a global batch is cut to the global batch's width."""
  recs = regen_store.load_records(regen[0])
  dcfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=8, bonus_input=True)
  pack = lambda m: data.Packer(recs, seq_len=96, anchors=3, block_size=4, pad_id=256,
                               seed=0, width_multiple=m)
  full, cut = pack(0).train_batch(0, 4), pack(8).train_batch(0, 4)
  longest = int(full["length_B"].max())
  assert full["tokens_BxT"].shape[1] == 96
  assert cut["tokens_BxT"].shape[1] == -(-longest // 8) * 8 < 96
  np.testing.assert_array_equal(cut["tokens_BxT"], full["tokens_BxT"][:, :-(-longest // 8) * 8])
  draft = init_draft_params(target.params, target.config, dcfg, jax.random.PRNGKey(0))
  f = lambda b: loss_lib.loss_and_metrics(draft, target.params, target.config, dcfg, b)
  (loss, m), (loss_cut, m_cut) = f(full), f(cut)
  np.testing.assert_allclose(loss_cut, loss, rtol=1e-5)
  assert float(m_cut["tau"]) == float(m["tau"])
  np.testing.assert_array_equal(m_cut["acc_S"], m["acc_S"])
  # the row of the longest sequence cut out of the global batch: the width stays
  longest_row = int(np.argmax(full["length_B"]))
  rows = (0, 1) if longest_row else (1, 2)
  share = pack(8).train_batch(0, 4, rows)
  assert -(-int(share["length_B"].max()) // 8) * 8 < cut["tokens_BxT"].shape[1]
  assert share["tokens_BxT"].shape == (1, cut["tokens_BxT"].shape[1])


def _fake_batches(packer, rows, n):
  """Record u's K for `n` layers is a function of (u, layer), V its negative;
  two records a batch."""
  kv = np.array([[[ord(packer.records[i].uid) * 100 + layer] * 3
                  for layer in range(n)] for i in rows], np.float32)
  kv = kv.reshape(len(rows), n, 3)
  for i in range(0, len(rows), 2):
    yield rows[i:i + 2], kv[i:i + 2], -kv[i:i + 2]


def _fake_kv_cache(tmp_path, uids):
  """A packer of records `uids` and a cached(num_layers) that logs what it
  computes: record u's K is a function of (u, layer), V its negative."""
  packer = types.SimpleNamespace(seq_len=8, records=[types.SimpleNamespace(uid=u)
                                                     for u in uids])
  calls = []

  def compute_for(n):
    def compute(rows):
      calls.append((n, [packer.records[i].uid for i in rows]))
      yield from _fake_batches(packer, rows, n)
    return compute

  def cached(n, name="train"):
    return kv_cache.cached_deep_kv(str(tmp_path), name, "fp", packer,
                                 DrafterConfig(num_layers=n), compute_for(n))
  return packer, cached, calls


def test_deep_kv_cache_serves_fewer_layers(tmp_path):
  packer, cached, calls = _fake_kv_cache(tmp_path, "ab")
  k3, v3 = cached(3)
  k2, v2 = cached(2)                      # the last two of the three cached layers
  np.testing.assert_array_equal(k2, k3[:, 1:])
  np.testing.assert_array_equal(v2, v3[:, 1:])
  assert calls == [(3, ["a", "b"])]
  cached(4)                               # more layers than cached: computed again
  assert calls[-1] == (4, ["a", "b"])


def test_deep_kv_cache_stores_the_asked_dtype_and_serves_either(tmp_path):
  packer, _, calls = _fake_kv_cache(tmp_path, "ab")

  def compute(rows):
    calls.append([packer.records[i].uid for i in rows])
    yield from _fake_batches(packer, rows, 2)

  k16, v16 = kv_cache.cached_deep_kv(str(tmp_path), "train", "fp", packer,
                                   DrafterConfig(num_layers=2), compute, dtype="float16")
  assert k16.dtype == np.float16 and np.load(tmp_path / "train_v.npy").dtype == np.float16
  expect = np.array([[[ord(u) * 100 + layer] * 3 for layer in range(2)] for u in "ab"],
                    np.float32)
  np.testing.assert_array_equal(k16, expect.astype(np.float16))
  np.testing.assert_array_equal(v16, -expect.astype(np.float16))
  # more records at the compute dtype: a float32 shard beside the float16 one
  packer.records.append(types.SimpleNamespace(uid="c"))
  k, _ = kv_cache.cached_deep_kv(str(tmp_path), "train", "fp", packer,
                               DrafterConfig(num_layers=2), compute)
  assert calls == [["a", "b"], ["c"]]
  assert np.load(tmp_path / "train-1_k.npy").dtype == np.float32
  np.testing.assert_allclose(np.asarray(k[np.arange(3)], np.float32)[2],
                             ord("c") * 100 + np.array([[0] * 3, [1] * 3]))


def test_deep_kv_cache_computes_only_new_records(tmp_path):
  packer, cached, calls = _fake_kv_cache(tmp_path, "ab")
  cached(2)
  cached(2, name="eval")                  # same records under another name: reused
  assert calls == [(2, ["a", "b"])]
  packer.records[:] = [types.SimpleNamespace(uid=u) for u in "cbad"]
  mtime = os.path.getmtime(tmp_path / "train_k.npy")
  k, v = cached(2)                        # more data: only c and d are computed
  assert calls[-1] == (2, ["c", "d"])
  expect = np.array([[[ord(u) * 100 + layer] * 3 for layer in range(2)]
                     for u in "cbad"], np.float32)
  np.testing.assert_array_equal(k, expect)
  np.testing.assert_array_equal(v, -expect)
  # the new records are a shard of their own: what was cached is not rewritten
  assert json.load(open(tmp_path / "train.json"))["uids"] == list("ab")
  assert json.load(open(tmp_path / "train-1.json"))["uids"] == list("cd")
  assert os.path.getmtime(tmp_path / "train_k.npy") == mtime
  k, _ = cached(2)                        # and now all of it is cached
  assert len(calls) == 2
  np.testing.assert_array_equal(k, expect)
  np.testing.assert_array_equal(k[np.array([3, 0]), 1], expect[[3, 0], 1])
  np.testing.assert_array_equal(k[2], expect[2])
  packer.records.append(types.SimpleNamespace(uid="e"))
  k, _ = cached(2)                        # a third shard
  assert calls[-1] == (2, ["e"]) and k.shape == (5, 2, 3)
  assert json.load(open(tmp_path / "train-2.json"))["uids"] == ["e"]


def test_deep_kv_cache_resumes_an_interrupted_pass(tmp_path):
  packer, cached, calls = _fake_kv_cache(tmp_path, "abcdef")

  def interrupted(rows):
    for i, batch in enumerate(_fake_batches(packer, rows, 3)):
      if i == 1:
        raise KeyboardInterrupt
      yield batch

  with pytest.raises(KeyboardInterrupt):
    kv_cache.cached_deep_kv(str(tmp_path), "train", "fp", packer,
                          DrafterConfig(num_layers=3), interrupted, flush_every=0.0)
  assert not (tmp_path / "train.json").exists()     # not a finished cache
  assert len(json.load(open(tmp_path / "train.tmp.json"))["done"]) == 2
  k, v = cached(3)                                  # the rerun computes the other 4
  assert calls == [(3, list("cdef"))]
  expect = np.array([[[ord(u) * 100 + layer] * 3 for layer in range(3)]
                     for u in "abcdef"], np.float32)
  np.testing.assert_array_equal(k, expect)
  np.testing.assert_array_equal(v, -expect)
  assert not (tmp_path / "train.tmp.json").exists()


def test_deep_kv_cache_refuses_a_pass_the_disk_cannot_hold(tmp_path, monkeypatch):
  """The pass checks the free disk before its first write (a memory-mapped
  write to a full disk kills the process); a cache already there stays."""
  packer, cached, calls = _fake_kv_cache(tmp_path, "ab")
  cached(2)
  packer.records.append(types.SimpleNamespace(uid="c"))
  # record c needs 2 (K, V) x 2 layers x 3 values x 4 bytes = 48 bytes
  monkeypatch.setattr(kv_cache.shutil, "disk_usage",
                      lambda d: types.SimpleNamespace(free=47))
  with pytest.raises(FlexDraftError, match=r"clean K/V of 1 records needs .* GB more under"):
    cached(2)
  assert sorted(f.name for f in tmp_path.iterdir()) == ["train.json", "train_k.npy",
                                                        "train_v.npy"]
  monkeypatch.setattr(kv_cache.shutil, "disk_usage",
                      lambda d: types.SimpleNamespace(free=48))
  k, _ = cached(2)
  assert calls[-1] == (2, ["c"]) and k.shape == (3, 2, 3)


def test_loss_weights_and_offline_tau():
  w = loss_lib.slot_weights(4, 2.0)
  np.testing.assert_allclose(w, [0.0, 1.0, np.exp(-0.5), np.exp(-1.0)], rtol=1e-6)
  V = 5
  labels = jnp.array([[[1, 2, 3], [1, 2, 3]]])     # slots 1..3 of two anchors
  pred = jnp.array([[[1, 2, 0], [0, 2, 3]]])       # anchor 0: 2 right, anchor 1: 0
  logits = jax.nn.one_hot(pred, V)
  valid = jnp.ones((1, 2, 3), bool)
  m = loss_lib.offline_metrics(logits, labels, valid, jnp.ones((1, 2), bool))
  assert float(m["tau"]) == pytest.approx((3 + 1) / 2)
  np.testing.assert_allclose(m["acc_S"], [0.0, 0.5, 1.0, 0.5])
  ok = jnp.array([[True, False]])                   # anchor 1 padding
  s = loss_lib.offline_sums(logits, labels, valid, ok, per_anchor=True)
  np.testing.assert_array_equal(s["tau_BxK"], [[3.0, 0.0]])
  assert float(s["tau_sum"]) == 3.0
  assert "tau_BxK" not in loss_lib.offline_sums(logits, labels, valid, ok)


def test_kl_soft_labels_are_the_targets_next_token_distribution(target):
  """The `kl` loss's soft label for mask position p is the target's distribution
  read at p - 1 of a plain forward, restricted to the draft vocabulary."""
  cfg = target.config
  rng = np.random.RandomState(1)
  vocab = np.sort(rng.choice(cfg.vocab_size, 16, replace=False)).astype(np.int32)
  dcfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=8, draft_vocab=16)
  draft = init_draft_params(target.params, cfg, dcfg, jax.random.PRNGKey(0), vocab=vocab)
  toks = jnp.asarray(rng.randint(3, 200, size=(2, 24)), jnp.int32)
  pos = jnp.array([[[5, 6, 7], [12, 13, 14]], [[3, 4, 5], [20, 21, 22]]], jnp.int32)
  h, _ = loss_lib.clean_pass(target.params, cfg, toks)
  got = np.asarray(loss_lib.target_logp(target.params, cfg, draft, h, pos))
  full = np.asarray(transformer.logits(target.params, cfg, h), np.float64)
  for b in range(2):
    for m, p in enumerate(np.asarray(pos[b]).reshape(-1)):
      z = full[b, p - 1, vocab]
      np.testing.assert_allclose(got[b, m], z - z.max() - np.log(np.exp(z - z.max()).sum()),
                                 atol=1e-5)


def test_kl_loss_is_nonnegative_and_training_lowers_it(target):
  cfg = target.config
  dcfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=8)
  draft = init_draft_params(target.params, cfg, dcfg, jax.random.PRNGKey(0))
  toks = jnp.asarray(np.random.RandomState(2).randint(3, 90, size=(2, 20)), jnp.int32)
  batch = {"tokens_BxT": toks, "length_B": jnp.array([20, 15], jnp.int32),
           # anchor 17's block runs past the batch's width (rows 20, 21: no loss)
           "anchor_BxK": jnp.array([[3, 17], [2, 9]], jnp.int32),
           "anchor_ok_BxK": jnp.ones((2, 2), bool)}
  kl = lambda d: loss_lib.loss_and_metrics(d, target.params, cfg, dcfg, batch,
                                           loss_type="kl")[0]
  opt = optax.adam(3e-3)

  @jax.jit
  def step(d, s):
    u, s = opt.update(jax.grad(kl)(d), s, d)
    return optax.apply_updates(d, u), s

  before, d, s = float(kl(draft)), draft, opt.init(draft)
  assert before > 0
  for _ in range(20):
    d, s = step(d, s)
  assert 0 <= float(kl(d)) < 0.5 * before


def test_walk_tau_visits_the_anchors_decoding_would():
  # τ 3 at answer token 0 -> the next step starts at token 3 (τ 1), then 4 (τ 2),
  # then 6 (τ 5, past the end): 4 steps for 7 tokens; the anchors between are
  # never visited, whatever their τ.
  assert loss_lib.walk_tau(np.array([3, 9, 9, 1, 2, 9, 5])) == (7, 4)
  assert loss_lib.walk_tau(np.ones(5)) == (5, 5)
  assert loss_lib.walk_tau(np.array([], np.float32)) == (0, 0)
  # an anchor without a τ (0: padding) still moves on by one token
  assert loss_lib.walk_tau(np.zeros(3)) == (3, 3)


# ----------------------------------------------------------------- steps ----

def test_only_drafter_is_trained_and_target_is_bit_identical(regen, tmp_path):
  # (with the clean K/V precomputed once per sequence: the CPU configs' path)
  cfg = tiny.tiny_config(regen[0], num_steps=STEPS, precompute_kv=True)
  su = train.setup(cfg, str(tmp_path))
  state, target_params, packer, (train_step, _), mesh = (
      su.state, su.target_params, su.packers.train, su.steps, su.mesh)
  assert packer.deep_kv[0].shape[0] == len(packer.records)
  assert sorted(os.listdir(tmp_path / "deep_kv"))[:3] == ["eval.json", "eval_k.npy",
                                                          "eval_v.npy"]
  before = jax.tree.map(np.array, target_params)
  draft0 = _flat(state.params)
  # the optimizer state mirrors the draft pytree only
  n_draft = sum(x.size for x in jax.tree.leaves(state.params))
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert n_opt <= 2 * n_draft + 8
  for leaf in jax.tree.leaves(state.opt_state):
    assert leaf.shape != target_params["embed"].shape
  for step in range(3):
    batch = sharding.put_batch(packer.train_batch(step, 8), mesh, 8)
    state, m = train_step(state, target_params, batch)
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, target_params))
  after = _flat(state.params)
  assert all(not np.array_equal(after[k], draft0[k]) for k in after), \
      "every draft leaf should move"
  assert np.isfinite(float(m["loss"]))


def test_loss_falls(reference):
  rows = _read_csv(os.path.join(reference[1], "metrics.csv"))
  losses = [float(r["loss"]) for r in rows if r["loss"]]
  assert len(losses) == STEPS
  assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:2]), losses
  taus = [float(r["eval_tau"]) for r in rows if r["eval_tau"]]
  assert len(taus) == STEPS // 6 and max(taus) >= taus[0]


def test_best_and_final_drafters_exported(reference, target):
  result, workdir = reference
  best = drafter_ckpt.load_drafter(os.path.join(workdir, "best_drafter"), target)
  final = drafter_ckpt.load_drafter(os.path.join(workdir, "final_drafter"), target)
  meta = drafter_ckpt.read_meta(os.path.join(workdir, "best_drafter"))
  assert meta["training"]["best_step"] == result.summary["best_step"]
  assert result.summary["steps"] == STEPS and result.summary["tokens_seen"] > 0
  f = _flat(final.params)
  for k, v in _flat(result.params).items():
    np.testing.assert_allclose(f[k], v, atol=2e-2, rtol=1e-2)  # bf16 on disk
  assert best.config == final.config


def test_resume_gives_the_uninterrupted_result(tmp_path, regen, reference):
  result, ref_dir = reference
  cfg = tiny.tiny_config(regen[0], num_steps=STEPS, ckpt_every=4, eval_every=6,
                         stop_at_step=STEPS // 2)
  partial = train.train(cfg, str(tmp_path))
  assert partial.summary["steps"] == STEPS // 2
  cfg.train.stop_at_step = 0
  resumed = train.train(cfg, str(tmp_path))
  a, b = _flat(result.params), _flat(resumed.params)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert resumed.summary["tokens_seen"] == result.summary["tokens_seen"]
  ref_rows = _read_csv(os.path.join(ref_dir, "metrics.csv"))
  new_rows = _read_csv(os.path.join(str(tmp_path), "metrics.csv"))
  assert [r["loss"] for r in new_rows] == [r["loss"] for r in ref_rows]


def test_max_minutes_ends_the_run_on_time_and_a_rerun_resumes(tmp_path, regen):
  # A budget shorter than the setup: the first step is the last, and the run
  # ends as at num_steps (checkpoint, metrics row, both exports); rerunning
  # without the budget goes on from that checkpoint.
  cfg = tiny.tiny_config(regen[0], num_steps=6, ckpt_every=100, eval_every=3,
                         max_minutes=1e-4)
  cut = train.train(cfg, str(tmp_path))
  assert cut.summary["steps"] == 1
  rows = _read_csv(os.path.join(str(tmp_path), "metrics.csv"))
  assert rows[-1]["step"] == "1" and rows[-1]["eval_tau"]
  for name in ("best_drafter", "final_drafter"):
    assert os.path.isfile(os.path.join(str(tmp_path), name, "drafter.json"))
  cfg.train.max_minutes = 0.0
  resumed = train.train(cfg, str(tmp_path))
  assert resumed.summary["steps"] == 6
  steps = [r["step"] for r in _read_csv(os.path.join(str(tmp_path), "metrics.csv"))]
  assert steps == ["1", "2", "3", "4", "5", "6"]


def _old_optimizer(tc, schedule):
  """The optimizer before `multi_transform` (00d9e48): AdamW's chain over the
  draft tree alone."""
  decay_mask = lambda p: jax.tree_util.tree_map_with_path(
      lambda path, _: path[-1].key in steps_lib.DECAY_KEYS, p)
  return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                     optax.adamw(schedule, b1=tc.b1, b2=tc.b2,
                                 weight_decay=tc.weight_decay, mask=decay_mask))


def test_a_checkpoint_from_before_multi_transform_resumes_exactly(regen, tmp_path):
  # A run saved while the optimizer state was AdamW's over the draft tree
  # alone resumes: step, weights and moments carry over, and it trains on as
  # the same run saved in the current layout does. A checkpoint that fits
  # neither layout is refused in one line, and nothing in its workdir changes.
  a, b, c = (str(tmp_path / d) for d in "abc")
  cfg = tiny.tiny_config(regen[0], num_steps=4, ckpt_every=2, eval_every=2,
                         stop_at_step=2)
  train.train(cfg, a)
  su = train.setup(cfg, a)
  made_by = {"target": su.target.name, "target_fingerprint": su.target.fingerprint,
             "drafter": dataclasses.asdict(train.drafter_config(cfg))}
  mngr = checkpoints.checkpoint_manager(a, cfg.train)
  start, state, meta = checkpoints.restore(mngr, su.state, made_by)
  mngr.close()

  # The same state in the old layout, built with the old optimizer.
  trained = state.opt_state.inner_states[steps_lib.TRAINED].inner_state
  adam, sched = trained[1][0], trained[1][2]
  assert int(adam.count) == 2 and any(np.abs(x).max() > 0 for x in
                                      jax.tree.leaves((adam.mu, adam.nu)))
  old_tx = _old_optimizer(cfg.train, steps_lib.make_optimizer(cfg.train)[1])
  clip, (old_adam, decay, old_sched) = old_tx.init(state.params)
  old = (clip, (old_adam._replace(count=adam.count, mu=adam.mu["draft"],
                                  nu=adam.nu["draft"]),
                decay, old_sched._replace(count=sched.count)))

  def save(workdir, opt_state):
    mngr = checkpoints.checkpoint_manager(workdir, cfg.train)
    mngr.save(start, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state._replace(opt_state=opt_state)),
        meta=ocp.args.JsonSave(meta)))
    mngr.wait_until_finished()
    shutil.copy(os.path.join(a, "metrics.csv"), workdir)
    return mngr

  mngr = save(b, old)
  got_start, got, _ = checkpoints.restore(mngr, su.state, made_by)
  mngr.close()
  assert got_start == start == 2 and int(got.step) == 2
  assert jax.tree.structure(got.opt_state) == jax.tree.structure(state.opt_state)
  got_adam = got.opt_state.inner_states[steps_lib.TRAINED].inner_state[1][0]
  for x, y in zip(jax.tree.leaves((state.params, adam)),
                  jax.tree.leaves((got.params, got_adam))):
    np.testing.assert_array_equal(x, y)
  cfg.train.stop_at_step = 0
  whole, resumed = train.train(cfg, a), train.train(cfg, b)
  assert resumed.summary["steps"] == 4
  p, q = _flat(whole.params), _flat(resumed.params)
  for k in p:
    np.testing.assert_array_equal(p[k], q[k])
  assert ([r["loss"] for r in _read_csv(os.path.join(b, "metrics.csv"))]
          == [r["loss"] for r in _read_csv(os.path.join(a, "metrics.csv"))])

  save(c, {"not": jnp.zeros(3)}).close()
  files = {f: open(f, "rb").read() for f in glob.glob(os.path.join(c, "**"), recursive=True)
           if os.path.isfile(f)}
  with pytest.raises(FlexDraftError, match="checkpoint 2 does not fit this config"):
    train.train(cfg, c)
  assert files == {f: open(f, "rb").read()
                   for f in glob.glob(os.path.join(c, "**"), recursive=True)
                   if os.path.isfile(f)}


def test_device_pipeline_fits_the_steps_to_its_budget_and_archives(tmp_path, regen):
  # launch/device_pipeline.py at tiny scale: the probe's fitted num_steps, the
  # run, its curve and the archive of its best drafter.
  import tarfile
  out = tmp_path / "out"
  cmd = [sys.executable, os.path.join(tiny.REPO, "launch", "device_pipeline.py"),
         f"--config={os.path.join(tiny.REPO, 'configs', 'tiny_test.py')}",
         f"--config.data.regen_dir={regen[0]}", "--config.train.seq_len=48",
         "--config.train.eval_every=2", f"--out={out}", "--minutes=1.2",
         "--reserve_minutes=0.9", "--probe", "--probe_steps=2"]
  env = dict(os.environ, PYTHONPATH=tiny.REPO)
  if XLA_CACHE:
    env["JAX_COMPILATION_CACHE_DIR"] = XLA_CACHE
  done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  summary = json.load(open(out / "summary.json"))
  probe, run = summary["stages"]["probe"], summary["stages"]["train"]
  assert probe["seconds_per_step"] > 0 and probe["num_steps"] >= 1
  assert run["steps"] <= probe["num_steps"] and run["best_eval_tau"] >= 1.0
  assert summary["stages"]["export"]["curve"] and (out / "curve.png").stat().st_size > 0
  with tarfile.open(out / "drafter.tar.xz") as tar:
    assert "drafter/drafter.json" in tar.getnames()


# -------------------------------------------------------------- sharding ----

_DRIVER = r"""
import sys, numpy as np
sys.path.insert(0, {repo!r})
import jax
from tests import tiny
jax.config.update("jax_compilation_cache_dir", {cache!r})
from flexdraft_jax.training import train
from flexdraft_jax.drafter.checkpoint import flatten
cfg = tiny.tiny_config({regen!r}, num_steps={steps}, ckpt_every=4, eval_every=0)
cfg.distributed.coordinator = sys.argv[2]
cfg.distributed.num_processes = int(sys.argv[3])
cfg.distributed.process_id = int(sys.argv[4])
cfg.mesh.model = int(sys.argv[5])
r = train.train(cfg, sys.argv[1])
if jax.process_index() == 0:
  np.savez(sys.argv[1] + "/params.npz", **{{k: np.asarray(v) for k, v in flatten(r.params).items()}})
print("devices", jax.device_count(), "processes", jax.process_count())
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(workdir, regen_dir, devices, num_processes=1, model=1):
  code = _DRIVER.format(repo=tiny.REPO,
                        cache=XLA_CACHE, regen=regen_dir, steps=STEPS)
  # generous collective timeouts: the CPU may be shared and slow
  flags = (f"--xla_force_host_platform_device_count={devices} "
           "--xla_cpu_collective_timeout_seconds=600 "
           "--xla_cpu_collective_call_terminate_timeout_seconds=600")
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
      + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  coord = f"127.0.0.1:{_free_port()}" if num_processes > 1 else ""
  procs = []
  for i in range(num_processes):
    # a file, not a pipe: an unread pipe can block one rank inside a collective
    log = open(os.path.join(workdir, f"log{i}.txt"), "w")
    procs.append((subprocess.Popen([sys.executable, "-c", code, workdir, coord,
                                    str(num_processes), str(i), str(model)], env=env,
                                   stdout=log, stderr=subprocess.STDOUT), log.name))
  return procs


def _check_matches(reference, procs, workdir, devices, processes):
  try:
    for p, _ in procs:
      p.wait(timeout=400)
  finally:
    for p, _ in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  outs = [open(name).read() for _, name in procs]
  for (p, _), out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  assert f"devices {devices} processes {processes}" in outs[0]
  got = np.load(os.path.join(workdir, "params.npz"))
  for k, v in _flat(reference[0].params).items():
    np.testing.assert_allclose(got[k], v, atol=1e-5, rtol=1e-5)
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert summary["tokens_seen"] == reference[0].summary["tokens_seen"]


@pytest.fixture(scope="module", autouse=True)
def sharded_runs(request, tmp_path_factory):
  """The 8-device and 2x4-device runs start first, in the background, so their
  compiles and collective set-up overlap with the in-process tests (only when
  this pytest run selects the tests that read them)."""
  selected = {item.originalname for item in request.session.items}
  runs = {}
  for name, devices, processes, model, test in (
      ("8dev", 8, 1, 1, "test_data_parallel_over_8_devices_matches_1_device"),
      ("2proc", 4, 2, 1, "test_two_processes_of_4_devices_match_1_device"),
      ("model2", 8, 1, 2, "test_model_axis_sharding_matches_1_device")):
    if test not in selected:
      continue
    regen = request.getfixturevalue("regen")
    d = str(tmp_path_factory.mktemp(name))
    runs[name] = (d, _launch(d, regen[0], devices, processes, model))
  yield runs
  for _, procs in runs.values():  # never leave a run behind
    for p, _ in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def test_data_parallel_over_8_devices_matches_1_device(sharded_runs, reference):
  d, procs = sharded_runs["8dev"]
  _check_matches(reference, procs, d, 8, 1)


def test_two_processes_of_4_devices_match_1_device(sharded_runs, reference):
  d, procs = sharded_runs["2proc"]
  _check_matches(reference, procs, d, 8, 2)


def test_model_axis_sharding_matches_1_device(sharded_runs, reference):
  # mesh data=4 x model=2: vocab / heads / mlp dimensions split by the rules
  d, procs = sharded_runs["model2"]
  _check_matches(reference, procs, d, 8, 1)


def test_logical_axis_rules_shard_model_axis():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  spec = sharding.spec_for("gate", (4, 64, 128), mesh)
  assert tuple(spec) == (None, None, "model")
  assert tuple(sharding.spec_for("embed", (264, 64), mesh)) == ("model", None)
  assert tuple(sharding.spec_for("unknown", (3, 3), mesh)) == ()


# ------------------------------------------------------------ regenerate ----

def _greedy_reference(t, prompt_ids, max_new):
  """Greedy continuation by full recomputation (no cache), fixed shapes."""
  T = len(prompt_ids) + max_new
  fwd = jax.jit(lambda toks: transformer.logits(
      t.params, t.config, transformer.forward(
          t.params, t.config, pytree.KVCache.zeros(t.config, 1, T, jnp.float32),
          toks, jnp.arange(T)[None])[0]))
  ids = list(prompt_ids)
  for _ in range(max_new):
    toks = np.zeros((1, T), np.int32)
    toks[0, :len(ids)] = ids
    nxt = int(jnp.argmax(fwd(jnp.asarray(toks))[0, len(ids) - 1]))
    ids.append(nxt)
    if nxt in t.config.eos_token_ids:
      break
  return ids[len(prompt_ids):]


def test_regenerate_cli_answers_greedily_and_resumes(tmp_path, target, fixture_data,
                                                    monkeypatch, capsys):
  pytest.importorskip("flexdraft_jax.decoding.engine")
  from flexdraft_jax.training import regenerate
  monkeypatch.setenv("FLEXDRAFT_DATA", fixture_data)  # the config's prompt paths
  regen_dir = str(tmp_path / "regen")
  argv = ["flexdraft_jax regenerate",
          f"--config={os.path.join(tiny.REPO, 'configs', 'tiny_test.py')}",
          f"--config.data.regen_dir={regen_dir}", "--config.data.max_new_tokens=5",
          "--config.data.mix.gsm8k=2", "--config.data.mix.mbpp=2",
          "--config.data.mix.arena_hard_v01=0"]
  with pytest.raises(SystemExit) as e:
    regenerate.run(argv)
  assert e.value.code in (0, None)
  assert f"regenerate: writing to {regen_dir} (--config.data.regen_dir" in capsys.readouterr().out
  recs = regen_store.load_records(regen_dir)
  assert sorted(r.source for r in recs) == ["gsm8k", "gsm8k", "mbpp", "mbpp"]
  for r in recs[:2]:
    assert r.prompt_ids[0] == target.tokenizer.BOS
    assert list(r.answer_ids) == _greedy_reference(target, list(r.prompt_ids), 5)
  meta = json.load(open(os.path.join(regen_dir, "meta.json")))
  assert meta["last_run_tokens_per_s"] > 0
  # more prompts later: only the new ones are answered
  cfg = tiny.tiny_config(regen_dir)
  cfg.data.max_new_tokens = 5
  cfg.data.mix = dict(gsm8k=3, mbpp=2, arena_hard_v01=0, arena_hard_v20=0)
  n_shards = regen_store.next_shard_index(regen_dir)
  regenerate.regenerate(cfg)
  assert regen_store.next_shard_index(regen_dir) == n_shards + 1
  assert len(regen_store.load_records(regen_dir)) == 5
  cfg.target = "random:tiny:1"  # another target may not add to this data
  with pytest.raises(Exception, match="target_fingerprint"):
    regenerate.regenerate(cfg)


def test_regenerate_parts_split_the_mix(tmp_path, fixture_data, monkeypatch):
  # Two processes with data.part 0/2 and 1/2 answer disjoint prompts that
  # together are the whole mix.
  from flexdraft_jax.training import regenerate
  monkeypatch.setenv("FLEXDRAFT_DATA", fixture_data)
  uids = []
  for i in range(2):
    cfg = tiny.tiny_config(str(tmp_path / f"p{i}"))
    cfg.data.max_new_tokens = 2
    cfg.data.mix = dict(gsm8k=4, mbpp=2, arena_hard_v01=0, arena_hard_v20=0)
    cfg.data.part = f"{i}/2"
    regenerate.regenerate(cfg)
    uids.append({r.uid for r in regen_store.load_records(cfg.data.regen_dir)})
  whole = {p.uid for p in prompt_mix.load_prompts(cfg.data)}
  assert uids[0] and uids[1] and not uids[0] & uids[1]
  assert uids[0] | uids[1] == whole and len(whole) == 6
  # merged into one dir: every answer once; merging again adds nothing
  p0, p1 = str(tmp_path / "p0"), str(tmp_path / "p1")
  assert regen_store.merge_regen(p0, p1) == len(uids[1])
  assert regen_store.merge_regen(p0, p1) == 0
  merged = regen_store.load_records(p0)
  assert sorted(r.uid for r in merged) == sorted(whole)
  cfg.target = "random:tiny:1"  # another target's answers do not merge
  other = str(tmp_path / "other")
  cfg.data.regen_dir, cfg.data.part = other, ""
  regenerate.regenerate(cfg)
  with pytest.raises(FlexDraftError, match="cannot merge .* target_fingerprint"):
    regen_store.merge_regen(p0, other)


def test_metrics_log_csv_and_tensorboard(tmp_path):
  import csv
  from flexdraft_jax.training.metrics_log import MetricsLog
  log = MetricsLog(str(tmp_path), ["step", "loss"])
  for step in (1, 2, 3):
    log.write(step, {"loss": 1.0 / step})
  log.close()
  assert any(p.name.startswith("events.out.tfevents") and p.stat().st_size > 0
             for p in tmp_path.iterdir())
  resumed = MetricsLog(str(tmp_path), ["step", "loss"], resume_step=2)
  resumed.close()
  with open(tmp_path / "metrics.csv") as f:
    assert [r["step"] for r in csv.DictReader(f)] == ["1", "2"]  # rows past 2 dropped



# ------------------------------------------------------- draft vocabulary ----

def test_draft_vocabulary_takes_the_most_frequent_answer_tokens():
  rec = lambda ans: regen_store.Record("u", "s", np.array([9, 9, 9], np.int32),
                                np.array(ans, np.int32))
  recs = [rec([5, 5, 5, 3, 3, 7]), rec([3, 2, 2, 5])]
  # counts: 5 ×4, 3 ×3, 2 ×2, 7 ×1; prompt tokens (9) do not count; stop id 0 first
  np.testing.assert_array_equal(data.draft_vocabulary(recs, 4, 12, always=[0]),
                                [0, 5, 3, 2])
  np.testing.assert_array_equal(data.draft_vocabulary(recs, 6, 12), [5, 3, 2, 7, 0, 1])
  with pytest.raises(Exception, match="exceeds the target's vocabulary"):
    data.draft_vocabulary(recs, 13, 12)


def test_precomputed_kv_in_length_buckets_equals_one_pass(regen, target):
  cfg = tiny.tiny_config(regen[0])
  dcfg = train.drafter_config(cfg)
  recs = regen_store.load_records(regen[0])
  packer = data.Packer(recs, seq_len=cfg.train.seq_len, anchors=2, block_size=4,
                       pad_id=0, seed=0)
  rep = jax.sharding.NamedSharding(sharding.make_mesh(data=-1, model=1),
                                   jax.sharding.PartitionSpec())
  tc = types.SimpleNamespace(batch_size=3, attn_impl="xla")
  k, v = kv_cache.precompute_deep_kv(packer, target.params, target.config, dcfg, tc, rep)
  toks = np.stack([packer.tokens(r)[0] for r in recs])
  k1, v1 = loss_lib.deep_kv(target.params, target.config, toks, dcfg.num_layers)
  for i, r in enumerate(recs):
    n = packer.tokens(r)[1]
    np.testing.assert_allclose(k[i, :, :, :n], k1[i, :, :, :n], atol=2e-5)
    np.testing.assert_allclose(v[i, :, :, :n], v1[i, :, :, :n], atol=2e-5)


def test_training_with_a_draft_vocabulary(regen, target, tmp_path):
  cfg = tiny.tiny_config(regen[0], num_steps=6, eval_every=3)
  cfg.drafter.draft_vocab = 8
  result = train.train(cfg, str(tmp_path))
  vocab = np.load(tmp_path / "draft_vocab.npy")
  answers = np.concatenate([r.answer_ids for r in regen_store.load_records(regen[0])])
  assert set(np.unique(answers)) <= set(vocab.tolist())  # 6 distinct answer tokens
  assert target.config.eos_token_ids[0] in vocab.tolist()
  d = drafter_ckpt.load_drafter(str(tmp_path / "final_drafter"), target)
  assert d.config.draft_vocab == 8
  np.testing.assert_array_equal(np.asarray(d.params["vocab"]), vocab)
  assert d.params["vocab"].dtype == jnp.int32
  assert d.params["calib"]["w2"].shape == (cfg.drafter.calib_rank, 8)
  assert result.summary["mask_rows"] == 6 * cfg.train.batch_size * \
      cfg.train.anchors_per_seq * cfg.drafter.block_size
  rows = _read_csv(tmp_path / "metrics.csv")
  ev = [r for r in rows if r["eval_tau"]]
  assert len(ev) == 2 and all(0 <= float(r["eval_acc_1"]) <= 1 for r in ev)
  # it decodes losslessly
  import flexdraft_jax as fd
  prompts = [r.prompt_ids.tolist() for r in regen_store.load_records(regen[0])[:3]]
  ref = fd.generate(target, prompts, max_new_tokens=12)
  out = fd.generate(target, prompts, max_new_tokens=12, drafter=d, mode="sequential")
  assert out.token_ids == ref.token_ids


def test_eval_steps_off_the_log_cadence_log_their_training_row(regen, tmp_path):
  cfg = tiny.tiny_config(regen[0], num_steps=4, eval_every=2)
  cfg.train.log_every = 3                 # evals at 2 and 4, logs at 3 and 4
  train.train(cfg, str(tmp_path))
  rows = {r["step"]: r for r in _read_csv(tmp_path / "metrics.csv")}
  assert sorted(rows, key=int) == ["2", "3", "4"]
  assert rows["2"]["eval_tau"] and rows["2"]["loss"] and not rows["3"]["eval_tau"]


def test_eval_also_scores_the_held_out_questions_in_the_variants_formats(target, tmp_path):
  own = tiny.fake_records(target, 24)
  # every answer again as a prompt variant's: the held-out questions' variant
  # answers are then the held-out answers, and must score the same
  recs = own + [dict(r, uid=r["uid"] + "#bench") for r in own]
  regen_dir = str(tmp_path / "regen")
  for s in range(0, len(recs), 4):
    regen_store.write_shard(regen_dir, s // 4, recs[s:s + 4])
  regen_store.build_dataset(regen_dir)
  cfg = tiny.tiny_config(regen_dir, num_steps=2, eval_every=2)
  cfg.data.variant_weights.bench = 3
  su = train.setup(cfg)
  packer, held, variants, blind = su.packers
  assert blind is None                   # no bonus_dropout: nothing is scored blind
  info = su.counts
  held_q = {r.uid for r in held.records}
  assert len(held_q) == cfg.train.num_eval == info["eval_variant_records"]
  assert {r.uid for r in variants.records} == {q + "#bench" for q in held_q}
  assert not {data.question_uid(r.uid) for r in packer.records} & held_q
  train.train(cfg, str(tmp_path / "a"))
  row = _read_csv(tmp_path / "a" / "metrics.csv")[-1]
  assert row["step"] == "2" and row["variant_eval_loss"]
  assert float(row["variant_eval_loss"]) == pytest.approx(float(row["eval_loss"]), abs=1e-6)
  assert float(row["variant_eval_tau"]) == pytest.approx(float(row["eval_tau"]), abs=1e-6)
  # the exported drafter records the mix's weights with the rest of its recipe
  record = drafter_ckpt.read_meta(str(tmp_path / "a" / "final_drafter"))["training"]
  assert record["variant_weights"] == {"bench": 3, "fn": 1, "doc": 1}
  assert record["eval_variant_records"] == len(held_q)
  cfg.train.eval_variants = False
  train.train(cfg, str(tmp_path / "b"))
  assert "variant_eval_tau" not in _read_csv(tmp_path / "b" / "metrics.csv")[-1]


def test_a_warm_started_run_is_scored_before_its_first_step(regen, target, tmp_path):
  cfg = tiny.tiny_config(regen[0], num_steps=4, eval_every=4)
  first = train.train(cfg, str(tmp_path / "a"))
  cfg = tiny.tiny_config(regen[0], num_steps=2, eval_every=2)
  cfg.train.init_from = str(tmp_path / "a" / "final_drafter")
  train.train(cfg, str(tmp_path / "b"))
  rows = _read_csv(tmp_path / "b" / "metrics.csv")
  assert rows[0]["step"] == "0" and rows[0]["loss"] == ""
  # the source drafter (stored in bf16) scores about what it scored when saved
  assert abs(float(rows[0]["eval_tau"]) - first.summary["best_eval_tau"]) < 0.05
  assert int(rows[0]["mask_rows"]) == first.summary["mask_rows"]
  assert os.path.isdir(tmp_path / "b" / "best_drafter")


def test_constant_schedule_holds_the_rate_whatever_num_steps():
  tc = base_config("x").train
  tc.update(lr=1e-3, warmup_steps=10, num_steps=100, schedule="constant")
  _, constant = train.make_optimizer(tc)
  tc.schedule = "cosine"
  _, cosine = train.make_optimizer(tc)
  assert float(constant(5)) == pytest.approx(5e-4) == float(cosine(5))
  assert float(constant(100)) == float(constant(10_000)) == pytest.approx(1e-3)
  assert float(cosine(100)) == pytest.approx(5e-5)


def test_constant_schedule_cools_down_over_its_last_decay_steps():
  # Warm-up, stable, then linear to 0 at num_steps: the cool-down branch of a
  # constant-rate run resumed with num_steps = its step + decay_steps.
  tc = base_config("x").train
  tc.update(lr=1e-3, warmup_steps=10, num_steps=100, decay_steps=40, schedule="constant")
  _, wsd = train.make_optimizer(tc)
  assert float(wsd(5)) == pytest.approx(5e-4)
  assert float(wsd(10)) == float(wsd(60)) == pytest.approx(1e-3)
  assert float(wsd(70)) == pytest.approx(7.5e-4)
  assert float(wsd(90)) == pytest.approx(2.5e-4)
  assert float(wsd(100)) == float(wsd(1000)) == 0.0
  tc.num_steps, tc.decay_steps = 2000, 0
  _, constant = train.make_optimizer(tc)
  assert float(constant(1999)) == pytest.approx(1e-3)


def test_moving_average_is_scored_exported_and_resumed(regen, target, tmp_path):
  # Turned on when resuming a run without one, the average starts at the
  # restored weights; at a decay near 1 it stays there while training moves on.
  first = train.train(tiny.tiny_config(regen[0], num_steps=4, eval_every=4,
                                       ckpt_every=4), str(tmp_path / "a"))
  cfg = tiny.tiny_config(regen[0], num_steps=8, eval_every=4, ckpt_every=4,
                         ema_decay=1 - 1e-7)
  held = train.train(cfg, str(tmp_path / "a"))
  start, moved = _flat(first.params), _flat(held.params)
  for k in start:
    np.testing.assert_allclose(moved[k], start[k], atol=1e-5)
  exported = _flat(drafter_ckpt.load_drafter(str(tmp_path / "a" / "final_drafter"),
                                             target).params)
  for k in start:
    np.testing.assert_allclose(exported[k], start[k], atol=2e-2, rtol=1e-2)  # bf16
  assert drafter_ckpt.read_meta(str(tmp_path / "a" / "final_drafter"))["training"][
      "ema_decay"] == cfg.train.ema_decay
  row = _read_csv(tmp_path / "a" / "metrics.csv")[-1]
  assert row["step"] == "8" and abs(float(row["eval_loss"]) - first_eval_loss(
      tmp_path / "a")) < 1e-4
  assert abs(float(row["raw_eval_loss"]) - float(row["eval_loss"])) > 1e-3

  # An average kept from the start resumes exactly, and a decay near 0 is the
  # trained weights: the same run as without one.
  kw = dict(num_steps=8, eval_every=4, ckpt_every=2, ema_decay=0.5)
  whole = train.train(tiny.tiny_config(regen[0], **kw), str(tmp_path / "b"))
  train.train(tiny.tiny_config(regen[0], stop_at_step=3, **kw), str(tmp_path / "c"))
  resumed = train.train(tiny.tiny_config(regen[0], **kw), str(tmp_path / "c"))
  a, b = _flat(whole.params), _flat(resumed.params)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  plain = train.train(tiny.tiny_config(regen[0], num_steps=8, eval_every=4),
                      str(tmp_path / "d"))
  near = train.train(tiny.tiny_config(regen[0], num_steps=8, eval_every=4,
                                      ema_decay=1e-9), str(tmp_path / "e"))
  p, n = _flat(plain.params), _flat(near.params)
  assert any(np.abs(a[k] - p[k]).max() > 1e-4 for k in a)   # 0.5 averages
  for k in p:
    np.testing.assert_allclose(n[k], p[k], atol=1e-6)


def first_eval_loss(workdir):
  """The eval loss a run logged at its first eval row."""
  return next(float(r["eval_loss"]) for r in _read_csv(os.path.join(workdir, "metrics.csv"))
              if r["eval_loss"])


def test_warm_start_keeps_weights_and_matches_calibration_by_token_id(target):
  cfg = target.config
  full_cfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=16)
  src = init_draft_params(target.params, cfg, full_cfg, jax.random.PRNGKey(1))
  src["calib"]["w2"] = jax.random.normal(jax.random.PRNGKey(2), src["calib"]["w2"].shape)
  src["calib"]["b2"] = jnp.arange(cfg.vocab_size, dtype=jnp.float32)
  src["layers"]["q"] = src["layers"]["q"] + 1.0
  vocab = np.array([7, 3, 100, 0], np.int32)
  dcfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=16, draft_vocab=4,
                       per_slot_mask=True)
  fresh = init_draft_params(target.params, cfg, dcfg, jax.random.PRNGKey(0), vocab=vocab)
  from flexdraft_jax.drafter.model import Drafter
  out = train.warm_start(fresh, Drafter(full_cfg, src), cfg, dcfg)
  np.testing.assert_array_equal(out["layers"]["q"], src["layers"]["q"])
  np.testing.assert_array_equal(out["calib"]["w2"], np.asarray(src["calib"]["w2"])[:, vocab])
  np.testing.assert_array_equal(out["calib"]["b2"], vocab.astype(np.float32))
  assert out["mask"].shape == (4, cfg.hidden_size)          # per slot, each the source's
  np.testing.assert_array_equal(out["mask"][2], src["mask"])
  with pytest.raises(Exception, match="draft layers"):
    train.warm_start(fresh, Drafter(full_cfg, dict(src, layers={
        k: v[..., :1] for k, v in src["layers"].items()})), cfg, dcfg)
  # fewer source layers fill the top ones; the rest keep their init
  one = train.warm_start(fresh, Drafter(full_cfg, dict(src, layers={
      k: v[1:] for k, v in src["layers"].items()})), cfg, dcfg)
  np.testing.assert_array_equal(one["layers"]["q"][1], src["layers"]["q"][1])
  np.testing.assert_array_equal(one["layers"]["q"][0], fresh["layers"]["q"][0])
  assert not np.array_equal(one["layers"]["q"][0], src["layers"]["q"][0])
  # more source layers give their top ones
  small = init_draft_params(target.params, cfg, DrafterConfig(
      num_layers=1, block_size=4, calib_rank=16, draft_vocab=4, per_slot_mask=True),
      jax.random.PRNGKey(0), vocab=vocab)
  top = train.warm_start(small, Drafter(full_cfg, src), cfg, dcfg)
  np.testing.assert_array_equal(top["layers"]["q"][0], src["layers"]["q"][1])


def test_warm_start_gives_new_draft_ids_the_bias_of_the_source_s_rarest(target):
  # A source with a draft vocabulary (most frequent first) and learned biases;
  # the new run's vocabulary keeps two of its ids and adds two it never drafted.
  cfg = target.config
  from flexdraft_jax.drafter.model import Drafter
  src_cfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=16, draft_vocab=8)
  src = init_draft_params(target.params, cfg, src_cfg, jax.random.PRNGKey(1),
                          vocab=np.arange(10, 18, dtype=np.int32))
  src["calib"]["b2"] = -jnp.arange(8, dtype=jnp.float32)  # 0 (id 10) ... -7 (id 17)
  src["calib"]["w2"] = jnp.ones_like(src["calib"]["w2"])
  dcfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=16, draft_vocab=4)
  vocab = np.array([10, 3, 17, 40], np.int32)
  fresh = init_draft_params(target.params, cfg, dcfg, jax.random.PRNGKey(0), vocab=vocab)
  out = train.warm_start(fresh, Drafter(src_cfg, src), cfg, dcfg)
  rarest = (-6.0 - 7.0) / 2  # the mean of the source's last quarter (ids 16, 17)
  np.testing.assert_array_equal(out["calib"]["b2"], [0.0, rarest, -7.0, rarest])
  np.testing.assert_array_equal(out["calib"]["w2"][:, [1, 3]], 0.0)
  np.testing.assert_array_equal(out["calib"]["w2"][:, [0, 2]], 1.0)


def test_per_slot_masks_equal_to_one_vector_change_nothing(target):
  cfg = target.config
  one = DrafterConfig(num_layers=2, block_size=4, calib_rank=16)
  per = DrafterConfig(num_layers=2, block_size=4, calib_rank=16, per_slot_mask=True)
  p = init_draft_params(target.params, cfg, one, jax.random.PRNGKey(0))
  q = dict(p, mask=jnp.tile(p["mask"][None], (4, 1)))
  assert init_draft_params(target.params, cfg, per, jax.random.PRNGKey(0))["mask"].shape \
      == (4, cfg.hidden_size)
  toks = jnp.asarray(np.random.RandomState(0).randint(3, 90, size=(2, 20)), jnp.int32)
  batch = {"tokens_BxT": toks, "length_B": jnp.array([20, 15], jnp.int32),
           "anchor_BxK": jnp.array([[3, 8], [2, 9]], jnp.int32),
           "anchor_ok_BxK": jnp.ones((2, 2), bool)}
  a = loss_lib.loss_sums(p, target.params, cfg, one, batch)[0]
  b = loss_lib.loss_sums(q, target.params, cfg, per, batch)[0]
  np.testing.assert_allclose(a, b, rtol=1e-6)
  q2 = dict(q, mask=q["mask"].at[2].add(0.5))               # slot 2 differs: loss moves
  assert abs(float(loss_lib.loss_sums(q2, target.params, cfg, per, batch)[0]) - float(a)) > 1e-4


def test_packed_dataset_round_trips_and_continues(regen, tmp_path):
  import shutil
  regen_dir, recs = str(tmp_path / "src"), regen[1]
  shutil.copytree(regen[0], regen_dir)  # the shared fixture keeps its meta.json
  with open(os.path.join(regen_dir, "meta.json"), "w") as f:
    json.dump({"target_fingerprint": "fp-x", "max_new_tokens": 12}, f)
  info = regen_store.pack_regen(regen_dir, str(tmp_path / "p.npz"))
  assert info["records"] == len(recs)
  fresh = str(tmp_path / "fresh")
  assert regen_store.unpack_regen(str(tmp_path / "p.npz"), fresh) == len(recs)
  got, want = regen_store.load_records(fresh), regen_store.load_records(regen_dir)
  assert [r.uid for r in got] == [r.uid for r in want]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g.prompt_ids, w.prompt_ids)
    np.testing.assert_array_equal(g.answer_ids, w.answer_ids)
  assert regen_store.unpack_regen(str(tmp_path / "p.npz"), fresh) == 0   # nothing new
  with open(os.path.join(fresh, "meta.json"), "w") as f:
    json.dump({"target_fingerprint": "other"}, f)
  with pytest.raises(Exception, match="holds answers of target other"):
    regen_store.unpack_regen(str(tmp_path / "p.npz"), fresh)
  with pytest.raises(Exception, match="no packed regenerated dataset"):
    regen_store.unpack_regen(str(tmp_path / "missing.npz"), fresh)


def test_source_and_variant_weights_repeat_records_within_an_epoch():
  recs = [regen_store.Record(f"u{i}", "a" if i < 3 else "b", np.array([1], np.int32),
                      np.array([2, 3], np.int32)) for i in range(5)]
  p = data.Packer(recs, seq_len=8, anchors=1, block_size=2, pad_id=0, seed=0,
                  source_weights={"a": 2, "b": 0})
  idx, _ = p.train_indices(0, 6)     # one epoch: each "a" twice, no "b"
  assert sorted(idx) == [0, 0, 1, 1, 2, 2]
  plain = data.Packer(recs, seq_len=8, anchors=1, block_size=2, pad_id=0, seed=0)
  assert sorted(plain.train_indices(0, 5)[0]) == [0, 1, 2, 3, 4]
  with pytest.raises(Exception, match="integers >= 0"):
    data.Packer(recs, seq_len=8, anchors=1, block_size=2, pad_id=0, seed=0,
                source_weights={"a": 1.5})
  # a variant's answers: the source's weight times the variant's
  recs += [regen_store.Record("u0#bench", "a", np.array([1], np.int32), np.array([2, 3], np.int32)),
           regen_store.Record("u3#fn", "b", np.array([1], np.int32), np.array([2, 3], np.int32))]
  p = data.Packer(recs, seq_len=8, anchors=1, block_size=2, pad_id=0, seed=0,
                  source_weights={"a": 2}, variant_weights={"bench": 3, "fn": 0})
  assert sorted(p.train_indices(0, 14)[0]) == [0, 0, 1, 1, 2, 2, 3, 4] + [5] * 6
  with pytest.raises(Exception, match=r"variant weights name no prompt variant: \['x'\]"):
    data.Packer(recs, seq_len=8, anchors=1, block_size=2, pad_id=0, seed=0,
                variant_weights={"x": 2})


def _bonus_drafter(target, seed=0, scale=3.0):
  """A drafter that reads the bonus at slot 0, with a large random `bonus_in`."""
  from flexdraft_jax.drafter.model import Drafter
  dcfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=16, bonus_input=True)
  p = init_draft_params(target.params, target.config, dcfg, jax.random.PRNGKey(seed))
  assert not np.any(np.asarray(p["bonus_in"]))           # starts as the plain mask
  H = target.config.hidden_size
  p["bonus_in"] = scale * jax.random.normal(jax.random.PRNGKey(seed + 1), (H, H)) / np.sqrt(H)
  p["calib"]["w2"] = jax.random.normal(jax.random.PRNGKey(seed + 2), p["calib"]["w2"].shape)
  return Drafter(dcfg, p, target.fingerprint)


def test_bonus_input_drafts_the_same_in_training_and_decoding(target):
  # Decoding: the prefix 0..a in the cache, the bonus at a+1, one deep-only
  # mask pass (as after prefill or a sequential verify). Training: the loss over
  # a sequence whose tokens after the bonus are those drafts must score every
  # slot right (offline τ = bs); with another bonus token it must not.
  from flexdraft_jax.decoding import state as state_lib
  from flexdraft_jax.decoding.sampling import SamplingParams
  cfg, drafter = target.config, _bonus_drafter(target)
  bs, a = drafter.config.block_size, 9
  rng = np.random.RandomState(3)
  prefix = jnp.asarray(rng.randint(3, 90, size=(1, a + 1)), jnp.int32)
  cache = pytree.KVCache.zeros(cfg, 1, 32, jnp.float32)
  pos = jnp.arange(a + 1, dtype=jnp.int32)[None]
  _, _, cache = transformer.forward(target.params, cfg, cache, prefix, pos)

  def drafts_after(bonus):
    b = jnp.array([bonus], jnp.int32)
    hm = state_lib.deep_pass(target.params, cfg, drafter, cache, jnp.array([a + 1]), b,
                             "xla")
    d = state_lib.draft_tokens(target.params, cfg, drafter, hm, b, SamplingParams(), None)[0]
    return np.asarray(d)[0], np.asarray(hm)[0]

  bonus = 40
  d, hm = drafts_after(bonus)
  # slots 1.. see the bonus through attention (not only through calibration)
  assert np.abs(hm[1:] - drafts_after(41)[1][1:]).max() > 1e-3
  toks = jnp.concatenate([prefix, jnp.array([[bonus]]), jnp.asarray(d)[None],
                          jnp.zeros((1, 4), jnp.int32)], axis=1)
  batch = {"tokens_BxT": toks, "length_B": jnp.array([a + 1 + bs], jnp.int32),
           "anchor_BxK": jnp.array([[a]], jnp.int32), "anchor_ok_BxK": jnp.ones((1, 1), bool)}
  _, m = loss_lib.loss_and_metrics(drafter.params, target.params, cfg, drafter.config, batch)
  assert float(m["tau"]) == bs
  other = dict(batch, tokens_BxT=toks.at[0, a + 1].set(41))
  _, m = loss_lib.loss_and_metrics(drafter.params, target.params, cfg, drafter.config, other)
  assert float(m["tau"]) < bs


def test_bonus_input_reaches_only_slot_0_and_warm_starts(target):
  cfg, drafter = target.config, _bonus_drafter(target)
  masks = loss_lib.mask_rows(jnp.array([[3, 8]], jnp.int32), 4)
  bonus = jnp.array([[5] * 4 + [6] * 4], jnp.int32)
  hm = transformer.mask_input(target.params, cfg, drafter.params,
                              masks._replace(bonus_BxM=bonus), jnp.float32)
  plain = np.asarray(drafter.params["mask"])
  rows_with_bonus = [m for m in range(8) if not np.allclose(hm[0, m], plain)]
  assert rows_with_bonus == [0, 4]                       # slot 0 of each block
  # no bonus known (None, or -1 for a block): that slot 0 is the mask alone
  blind = transformer.mask_input(target.params, cfg, drafter.params, masks, jnp.float32)
  np.testing.assert_array_equal(blind[0], np.broadcast_to(plain, blind[0].shape))
  half = transformer.mask_input(target.params, cfg, drafter.params,
                                masks._replace(bonus_BxM=bonus.at[:, 4:].set(-1)),
                                jnp.float32)
  np.testing.assert_array_equal(half[0, :4], hm[0, :4])
  np.testing.assert_array_equal(half[0, 4:], blind[0, 4:])
  fresh = init_draft_params(target.params, cfg, drafter.config, jax.random.PRNGKey(7))
  out = train.warm_start(fresh, drafter, cfg, drafter.config)
  np.testing.assert_array_equal(out["bonus_in"], drafter.params["bonus_in"])


def test_bonus_dropout_trains_blind_blocks_as_parallel_mode_drafts(target, regen):
  # A block drawn blind scores as the same drafter with no bonus input
  # (bonus_in = 0), a sighted one as without dropout; the packer draws about
  # the asked share of blind blocks, deterministically.
  import dataclasses
  cfg, drafter = target.config, _bonus_drafter(target)
  records = regen_store.load_records(regen[0])
  pack = lambda p: data.Packer(records, seq_len=512, anchors=8, block_size=4, pad_id=0,
                               seed=0, bonus_dropout=p)
  batch = pack(0.5).train_batch(0, 8)
  assert batch["blind_BxK"].shape == (8, 8) and 16 < batch["blind_BxK"].sum() < 48
  np.testing.assert_array_equal(batch["blind_BxK"], pack(0.5).train_batch(0, 8)["blind_BxK"])
  np.testing.assert_array_equal(batch["anchor_BxK"], pack(0.0).train_batch(0, 8)["anchor_BxK"])
  assert "blind_BxK" not in pack(0.0).train_batch(0, 8)
  dcfg = dataclasses.replace(drafter.config, bonus_dropout=0.5)
  loss = lambda params, b: float(loss_lib.loss_sums(params, target.params, cfg, dcfg, b)[0])
  no_bonus = dict(drafter.params, bonus_in=0 * drafter.params["bonus_in"])
  plain = {k: v for k, v in batch.items() if k != "blind_BxK"}
  every = dict(plain, blind_BxK=np.ones((8, 8), bool))
  none = dict(plain, blind_BxK=np.zeros((8, 8), bool))
  assert loss(drafter.params, every) == pytest.approx(loss(no_bonus, plain), rel=1e-6)
  assert loss(drafter.params, none) == pytest.approx(loss(drafter.params, plain), rel=1e-6)
  assert abs(loss(drafter.params, every) - loss(drafter.params, none)) > 1e-3
  mixed = loss(drafter.params, batch)
  assert min(loss(drafter.params, every), loss(drafter.params, none)) < mixed < max(
      loss(drafter.params, every), loss(drafter.params, none))


def test_a_run_with_bonus_dropout_is_scored_blind_and_records_it(regen, tmp_path):
  cfg = tiny.tiny_config(regen[0], num_steps=2, eval_every=2)
  cfg.drafter.bonus_input, cfg.drafter.bonus_dropout = True, 0.5
  result = train.train(cfg, str(tmp_path))
  row = _read_csv(tmp_path / "metrics.csv")[-1]
  assert row["step"] == "2" and row["blind_eval_tau"] and row["blind_eval_loss"]
  assert float(row["blind_eval_loss"]) != pytest.approx(float(row["eval_loss"]), abs=1e-6)
  # the best drafter is picked on the mean of both
  assert result.summary["best_eval_tau"] == pytest.approx(
      0.5 * (float(row["eval_tau"]) + float(row["blind_eval_tau"])), abs=1e-5)
  saved = drafter_ckpt.load_drafter(str(tmp_path / "final_drafter"), tiny.tiny_target())
  assert saved.config.bonus_dropout == 0.5 and saved.config.drafts_blind
  cfg.drafter.bonus_input = False
  with pytest.raises(FlexDraftError, match="drafter.bonus_dropout must be in \\[0, 1\\], "
                     "and 0 without drafter.bonus_input, got 0.5"):
    train.train(cfg, str(tmp_path / "b"))


def test_offline_tau_scores_parallel_modes_drafting_blind(target):
  # --blind: the drafter drafts as in parallel mode (its bonus input unread):
  # the same scores as the drafter without a bonus input, unlike sighted ones.
  from flexdraft_jax.training import offline_tau
  drafter = _bonus_drafter(target)
  rng = np.random.RandomState(0)
  prompts = [list(rng.randint(3, 90, size=6)) for _ in range(2)]
  answers = [list(rng.randint(3, 90, size=n)) for n in (9, 12)]
  plain = drafter._replace(params=dict(drafter.params, bonus_in=0 * drafter.params["bonus_in"]))
  blind = offline_tau.score(target, drafter, prompts, answers, 16, blind=True)
  assert blind == offline_tau.score(target, plain, prompts, answers, 16)
  assert blind["anchors"] == 21
  assert blind != offline_tau.score(target, drafter, prompts, answers, 16)
