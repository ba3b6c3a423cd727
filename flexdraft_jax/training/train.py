"""`python -m flexdraft_jax train --config configs/X.py --workdir DIR`.

Trains the draft pytree on regenerated data (SPEC §4): only the drafter is
differentiated and has optimizer state; the target pytree is an input of the
jitted step and comes back untouched. Checkpoints (orbax, async, atomic) hold
(step, draft params, optimizer state, their moving average with
train.ema_decay > 0) and resume exactly: batch order and anchors depend only on
(seed, step). WORKDIR gets:

  ckpt/               orbax CheckpointManager
  metrics.csv         per logged step; eval rows carry eval_tau / eval_loss (the
                      held-out answers) and variant_eval_tau / variant_eval_loss
                      (the held-out questions in the prompt variants' formats)
  events.out.tfevents.*  the same scalars for TensorBoard
  best_drafter/       save_drafter export of the checkpoint with the best eval τ
  final_drafter/      the last step's drafter
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import os
import shutil
import time
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from jax.sharding import NamedSharding, PartitionSpec as P

from flexdraft_jax import run_control
from flexdraft_jax.drafter import checkpoint as drafter_ckpt
from flexdraft_jax.drafter.model import (Drafter, DrafterConfig, init_draft_params,
                                         trainable)
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.model import loading, transformer
from flexdraft_jax.training import data, loss as loss_lib, sharding
from flexdraft_jax.training.config import check_train_config
from flexdraft_jax.training.metrics_log import MetricsLog
from flexdraft_jax.util import round_up

DECAY_KEYS = ("q", "k", "v", "o", "w1", "w2")


class TrainResult(NamedTuple):
  summary: dict      # JSON-able: steps, tokens seen, best eval τ, data
  params: Any        # final draft pytree on the host (fp32)


class TrainState(NamedTuple):
  step: jax.Array
  params: Any        # the draft pytree (fp32 master copy)
  opt_state: Any
  ema: Any = None    # moving average of params (train.ema_decay > 0), else None


def scored_params(state: TrainState):
  """The weights a run scores and exports: the moving average when it keeps one."""
  return state.params if state.ema is None else state.ema


def make_optimizer(tc) -> tuple:
  """AdamW (decay on matrices only) + warm-up, then cosine or constant (with
  an optional linear decay over its last `decay_steps`) + global-norm clipping."""
  if tc.get("schedule", "cosine") == "constant":
    schedule = optax.warmup_constant_schedule(0.0, tc.lr, max(tc.warmup_steps, 1))
    decay = tc.get("decay_steps", 0)
    if decay:
      start = tc.num_steps - decay
      schedule = optax.join_schedules(
          [schedule, optax.linear_schedule(schedule(start), 0.0, decay)], [start])
  else:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, max(tc.warmup_steps, 1), max(tc.num_steps, tc.warmup_steps + 1),
        end_value=tc.lr * 0.05)
  decay_mask = lambda p: jax.tree_util.tree_map_with_path(
      lambda path, _: path[-1].key in DECAY_KEYS, p)
  tx = optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                   optax.adamw(schedule, b1=tc.b1, b2=tc.b2,
                               weight_decay=tc.weight_decay, mask=decay_mask))
  return tx, schedule


def drafter_config(config) -> DrafterConfig:
  return DrafterConfig(**dict(config.drafter))


def make_steps(cfg, dcfg, tx, schedule, tc, shardings: dict, mesh, fixed=None):
  """Jitted (train_step, eval_step) with explicit shardings; `fixed` holds the
  draft pytree's untrained leaves (the draft vocabulary), closed over.

  With a pure data-parallel mesh (model axis 1) the per-shard work runs under
  `shard_map` and one all-reduce sums gradients and statistics: a single
  collective per step (GSPMD's extra gathers can deadlock emulated CPU
  devices). With a model axis, GSPMD partitions the whole step.
  """
  kw = dict(gamma=tc.gamma, loss_type=tc.loss, attn_impl=tc.attn_impl)
  fixed = fixed or {}

  def grads_and_sums(params, target_params, batch):
    f = lambda p: loss_lib.loss_sums(dict(p, **fixed), target_params, cfg, dcfg,
                                     batch, **kw)
    (_, sums), grads = jax.value_and_grad(f, has_aux=True)(params)
    sums["tokens"] = jnp.sum(batch["length_B"]).astype(jnp.float32)
    return grads, sums

  def eval_sums(params, target_params, batch):
    return loss_lib.loss_sums(dict(params, **fixed), target_params, cfg, dcfg,
                              batch, **kw)[1]

  if mesh.shape["model"] == 1:
    def summed(fn):
      local = lambda *a: jax.lax.psum(fn(*a), "data")
      return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                           out_specs=P(), check_vma=False)
    grads_and_sums, eval_sums = summed(grads_and_sums), summed(eval_sums)

  def train_step(state: TrainState, target_params, batch):
    grads, sums = grads_and_sums(state.params, target_params, batch)
    grads = jax.tree.map(lambda g: g / jnp.maximum(sums["weight"], 1e-9), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ema = state.ema
    if ema is not None:
      ema = jax.tree.map(lambda e, p: e + (1.0 - tc.ema_decay) * (p - e), ema, params)
    m = loss_lib.finalize(sums)
    m.update(grad_norm=optax.tree.norm(grads), lr=schedule(state.step),
             tokens=sums["tokens"])
    return TrainState(state.step + 1, params, opt_state, ema), m

  def eval_step(params, target_params, batch):
    return eval_sums(params, target_params, batch)

  rep = shardings["replicated"]
  train = jax.jit(train_step, donate_argnums=(0,),
                  in_shardings=(shardings["state"], shardings["target"], shardings["batch"]),
                  out_shardings=(shardings["state"], rep))
  evaluate = jax.jit(eval_step, in_shardings=(shardings["state"].params,
                                              shardings["target"], shardings["batch"]),
                     out_shardings=rep)
  return train, evaluate


def _remove_cut_saves(workdir: str) -> None:
  """Removes what a save cut short (a killed run) leaves: `N.orbax-checkpoint-tmp*`
  folders under WORKDIR/ckpt. The complete checkpoints stay."""
  if jax.process_index() == 0:
    for tmp in glob.glob(os.path.join(os.path.abspath(workdir), "ckpt",
                                      "*.orbax-checkpoint-tmp*")):
      shutil.rmtree(tmp, ignore_errors=True)


def _checkpoint_manager(workdir: str, tc) -> ocp.CheckpointManager:
  _remove_cut_saves(workdir)
  options = ocp.CheckpointManagerOptions(
      max_to_keep=tc.max_to_keep, enable_async_checkpointing=True, create=True)
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "ckpt"),
                               options=options)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=x.sharding), tree)


EVAL_SLOTS = 4  # eval rows log the accuracy of drafting slots 1..EVAL_SLOTS


def _eval_metrics(sums: list) -> dict:
  """Held-out τ, loss and per-slot accuracy from the eval batches' summed counts."""
  total = {k: sum(np.asarray(s[k], np.float64) for s in sums) for k in sums[0]}
  m = loss_lib.finalize(total)
  out = {"eval_tau": float(m["tau"]), "eval_loss": float(m["loss"])}
  acc = np.asarray(m["acc_S"])
  out.update({f"eval_acc_{j}": float(acc[j]) if j < len(acc) else 0.0
              for j in range(1, EVAL_SLOTS + 1)})
  return out


def _setup(config, workdir=None):
  """Target, data, mesh, initial state and jitted steps."""
  tc = config.train
  dcfg = drafter_config(config)
  if tc.seq_len < dcfg.block_size + 2:
    raise FlexDraftError(f"seq_len={tc.seq_len} is too short for block_size="
                         f"{dcfg.block_size}")

  # The data's checks come before the (slow) target load.
  data.use_packed(config.data)
  records = data.load_records(config.data.regen_dir)
  num_eval = min(tc.num_eval, len(records) // 5)
  train_recs, eval_recs = data.split_eval(records, num_eval)
  # The held-out questions again, in the prompt variants' (the benchmarks') formats.
  variant_recs = (data.held_out_variants(records, num_eval)
                  if tc.get("eval_variants", True) else [])
  data.check_anchors(train_recs, tc.seq_len, dcfg.block_size)
  target = loading.load_target(config.target, config.dtype)
  data.check_made_by(config.data.regen_dir, target)
  cfg = target.config
  dcfg.validate(cfg)
  pack = functools.partial(data.Packer, seq_len=tc.seq_len, block_size=dcfg.block_size,
                           pad_id=cfg.pad_token_id, seed=tc.seed,
                           width_multiple=tc.get("width_multiple", 0))
  eval_pack = functools.partial(pack, anchors=tc.eval_anchors or tc.anchors_per_seq)
  packers = (pack(train_recs, anchors=tc.anchors_per_seq,
                  source_weights=dict(config.data.get("source_weights", {})),
                  variant_weights=dict(config.data.get("variant_weights", {})),
                  bonus_dropout=dcfg.bonus_dropout),
             *(eval_pack(rs) if rs else None for rs in (eval_recs, variant_recs)),
             # a drafter trained blind too is also scored blind (parallel mode)
             eval_pack(eval_recs, bonus_dropout=1.0)
             if eval_recs and dcfg.bonus_dropout else None)

  mesh = sharding.make_mesh(**dict(config.mesh))
  tx, schedule = make_optimizer(tc)
  vocab = None
  if dcfg.draft_vocab:
    vocab = _draft_vocab(workdir, train_recs, dcfg.draft_vocab, cfg)
  # Every process computes the same initial drafter from the same target.
  draft0 = jax.device_get(init_draft_params(
      target.params, cfg, dcfg, jax.random.PRNGKey(tc.seed), jnp.float32, vocab=vocab))
  init_mask_rows = 0
  if tc.init_from:
    draft0 = warm_start(draft0, drafter_ckpt.load_drafter(tc.init_from, target), cfg,
                        dcfg)
    # The learning curve goes on from the rows the source drafter has seen.
    init_mask_rows = int(drafter_ckpt.read_meta(tc.init_from).get("training", {})
                         .get("mask_rows", 0))
  # The vocabulary is data, not a weight: it stays out of the trained state.
  fixed = {k: v for k, v in draft0.items() if k == "vocab"}
  draft0 = trainable(draft0)
  target_sh = sharding.param_shardings(target.params, mesh)
  target_params = sharding.put_global(jax.device_get(target.params), target_sh)
  params_sh = sharding.param_shardings(draft0, mesh)
  params = sharding.put_global(draft0, params_sh)
  rep = NamedSharding(mesh, P())
  opt_state = jax.jit(tx.init)(params)
  # The average starts at the initial weights, in buffers of its own (the state
  # is donated to the step).
  ema = sharding.put_global(draft0, params_sh) if tc.get("ema_decay", 0.0) else None
  state_sh = TrainState(rep, params_sh,
                        sharding.state_shardings(opt_state, params_sh, mesh),
                        None if ema is None else params_sh)
  state = jax.device_put(TrainState(jnp.int32(0), params, opt_state, ema), state_sh)
  shardings_ = {"state": state_sh, "target": target_sh, "replicated": rep,
                "batch": sharding.batch_sharding(mesh)}
  if tc.precompute_kv:
    for name, p in zip(("train", "eval", "eval_variants", "eval"), packers):
      if p is not None:
        compute = functools.partial(iter_deep_kv, p, target_params, cfg, dcfg,
                                    tc, rep, name)  # rows -> batches
        kv_dir = tc.deep_kv_dir or (workdir and os.path.join(workdir, "deep_kv"))
        p.deep_kv = _cached_deep_kv(kv_dir, name, target.fingerprint, p, dcfg, compute,
                                    dtype=tc.get("deep_kv_dtype") or None)
    # The steps read the deep layers only: their weights as separate arrays,
    # sliced once here rather than in every step.
    target_params = jax.jit(functools.partial(transformer.deep_layers_view,
                                              num_draft_layers=dcfg.num_layers))(
                                                  target_params)
    shardings_["target"] = jax.tree.map(lambda x: x.sharding, target_params)
  steps = make_steps(cfg, dcfg, tx, schedule, tc, shardings_, mesh,
                     jax.device_put(fixed, rep))
  # Keep only what exports need; the params now live in `target_params`.
  ref = types.SimpleNamespace(config=cfg, name=target.name, fingerprint=target.fingerprint)
  info = {"target": ref, "records": len(records), "train_records": len(train_recs),
          "eval_records": len(eval_recs), "eval_variant_records": len(variant_recs),
          "fixed_params": fixed,
          "init_mask_rows": init_mask_rows}
  return state, target_params, packers, steps, mesh, info


def iter_deep_kv(packer, target_params, cfg, dcfg, tc, replicated, name="train",
                 rows=None):
  """The deep layers' clean K/V of records `rows` of `packer` (default: all),
  batch by batch: yields `(rows_b, k, v)`, `k`/`v` `[len(rows_b), L, K, seq_len, D]`
  for those records. Records go in length order, each batch cut to its longest
  sequence (rounded up to 64; causal attention makes the padding irrelevant)."""
  fn = jax.jit(lambda tp, toks: loss_lib.deep_kv(
      tp, cfg, toks, dcfg.num_layers, attn_impl=tc.attn_impl),
               out_shardings=(replicated, replicated))
  rows = list(range(len(packer.records))) if rows is None else list(rows)
  n, bsz, T = len(rows), tc.batch_size, packer.seq_len
  toks_lens = [packer.tokens(packer.records[i]) for i in rows]
  order = sorted(range(n), key=lambda i: toks_lens[i][1])
  for start in tqdm.trange(0, n, bsz, desc=f"clean K/V ({name})",
                           disable=jax.process_index() != 0, dynamic_ncols=True):
    idx = [order[min(start + b, n - 1)] for b in range(bsz)]
    width = min(T, round_up(max(toks_lens[i][1] for i in idx), 64))
    toks = np.stack([toks_lens[i][0][:width] for i in idx])
    k, v = fn(target_params, sharding.put_global(toks, replicated))
    take = min(bsz, n - start)
    k, v = (np.asarray(x.addressable_data(0))[:take] for x in (k, v))
    pad = [(0, 0)] * 3 + [(0, T - width), (0, 0)]
    yield [rows[i] for i in idx[:take]], np.pad(k, pad), np.pad(v, pad)


def _gather(batches, rows) -> tuple:
  """`(k, v)` `[len(rows), ...]` in `rows` order from `(rows_b, k, v)` batches."""
  where = {r: i for i, r in enumerate(rows)}
  ks = vs = None
  for rows_b, k, v in batches:
    if ks is None:
      ks, vs = (np.zeros((len(rows),) + x.shape[1:], x.dtype) for x in (k, v))
    at = [where[r] for r in rows_b]
    ks[at], vs[at] = k, v
  return ks, vs


def precompute_deep_kv(packer, target_params, cfg, dcfg, tc, replicated, name="train",
                       rows=None):
  """`iter_deep_kv` gathered: `[len(rows), L, K, seq_len, D]` in `rows` order."""
  rows = list(range(len(packer.records))) if rows is None else list(rows)
  return _gather(iter_deep_kv(packer, target_params, cfg, dcfg, tc, replicated, name,
                              rows), rows)


class RecordRows:
  """Records kept in several arrays (the shards of a K/V cache) read as one
  `[N, ...]` array: `x[rows, ...]` gathers each row from the shard holding it
  (memory-mapped shards read only those rows). `where[i] = (shard, row)`."""

  def __init__(self, shards: list, where: list):
    self.shards = shards
    self._shard = np.array([s for s, _ in where], np.int64)
    self._row = np.array([r for _, r in where], np.int64)
    self.shape = (len(where),) + tuple(shards[0].shape[1:])
    self.dtype = np.result_type(*[s.dtype for s in shards])  # float16 + float32: float32

  def __len__(self) -> int:
    return self.shape[0]

  def __getitem__(self, key):
    key = key if isinstance(key, tuple) else (key,)
    scalar = np.ndim(key[0]) == 0 and not isinstance(key[0], slice)
    idx = np.atleast_1d(np.arange(len(self))[key[0]])
    parts, out = {}, None
    for s in np.unique(self._shard[idx]):
      at = np.flatnonzero(self._shard[idx] == s)
      parts[s] = at, np.asarray(self.shards[s][(self._row[idx[at]],) + key[1:]])
    for at, x in parts.values():
      if out is None:
        out = np.empty((len(idx),) + x.shape[1:], self.dtype)
      out[at] = x
    if out is None:  # no rows
      out = np.asarray(self.shards[0][(np.zeros((0,), np.int64),) + key[1:]], self.dtype)
    return out[0] if scalar else out

  def __array__(self, dtype=None, copy=None):
    return self[:] if dtype is None else self[:].astype(dtype)


def _cached_sources(d, key, num_layers):
  """What directory `d` holds for `key`: {name: (uids, k, v)}, each array the
  last `num_layers` layers of a cache made for at least that many."""
  sources = {}
  for fname in sorted(os.listdir(d)) if os.path.isdir(d) else []:
    if not fname.endswith(".json") or fname.endswith(".tmp.json"):
      continue
    with open(os.path.join(d, fname)) as f:
      meta = json.load(f)
    cached_layers = meta.get("num_layers", 0)
    if (any(meta.get(k) != v for k, v in key.items()) or cached_layers < num_layers
        or not isinstance(meta.get("uids"), list)):
      continue
    name = fname[:-len(".json")]
    k, v = (np.load(os.path.join(d, f"{name}_{c}.npy"), mmap_mode="r")
            [:, cached_layers - num_layers:] for c in "kv")
    sources[name] = (meta["uids"], k, v)
  return sources


def _shard_name(d, name) -> str:
  """`name`, else the first free `name-J` (J = 1, 2, ...) in directory `d`."""
  shard, j = name, 0
  while os.path.exists(os.path.join(d, f"{shard}.json")):
    j += 1
    shard = f"{name}-{j}"
  return shard


def _cached_deep_kv(d, name, fingerprint, packer, dcfg, compute, flush_every=60.0,
                    dtype=None):
  """The K/V of every record of `packer`, from `compute(rows)` (which yields
  `(rows_b, k, v)` batches of those records) and saved under directory `d`
  (None: in memory only), reused record by record while the target and the
  sequence length are the same. The directory holds shards `S_{k,v}.npy` +
  `S.json` (the uid of each row); a pass computes only the records no shard
  holds, as a new shard (`NAME`, then `NAME-1`, `NAME-2`, ...): more data adds
  its records and never rewrites what is cached. A cache made for more draft
  layers serves fewer — its last L layers — so an L = 2, 4, 6, 8 ablation that
  shares one directory runs the target's clean pass once. New shards store
  `dtype` (None: as computed; "float16" halves the disk, and the steps cast it
  back); shards of either serve. Returns `(k, v)`, `[N, L, K, T, D]` each: one
  shard's arrays, else a `RecordRows` view."""
  n = len(packer.records)
  uids = [r.uid for r in packer.records]
  if not d:
    return _gather(compute(list(range(n))), list(range(n)))
  key = {"fingerprint": fingerprint, "seq_len": packer.seq_len}
  sources = _cached_sources(d, key, dcfg.num_layers)
  for src_uids, k, v in sources.values():
    if src_uids == uids:
      return k, v
  found = {}
  for src, (src_uids, _, _) in sources.items():
    for row, uid in enumerate(src_uids):
      found.setdefault(uid, (src, row))
  new = list(dict.fromkeys(uid for uid in uids if uid not in found))
  if new:
    shard, k, v = _write_shard(d, name, dict(key, num_layers=dcfg.num_layers, uids=new),
                               uids, compute, flush_every, dtype)
    sources[shard] = (new, k, v)
    found.update((uid, (shard, row)) for row, uid in enumerate(new))
  names = sorted({found[uid][0] for uid in uids})
  where = [(names.index(found[uid][0]), found[uid][1]) for uid in uids]
  return tuple(RecordRows([sources[s][c] for s in names], where) for c in (1, 2))


def _write_shard(d, name, meta, uids, compute, flush_every, dtype=None) -> tuple:
  """Computes the records `meta["uids"]` (rows of a packer whose records are
  `uids`) into a new shard of `d`: (shard, k, v). Computed batches go straight
  into memory-mapped `SHARD_{k,v}.tmp.npy` (the K/V of all the data can exceed
  the RAM) and `NAME.tmp.json` lists the records written so far (every
  `flush_every` seconds): an interrupted pass over the same records resumes
  where it stopped."""
  tmp_meta = os.path.join(d, f"{name}.tmp.json")
  write = jax.process_index() == 0  # only the first process writes the cache
  shard, done = _shard_name(d, name), set()
  if write and os.path.exists(tmp_meta):
    with open(tmp_meta) as f:
      partial = json.load(f)
    if ({k: partial.get(k) for k in meta} == meta and all(
        os.path.exists(os.path.join(d, f"{partial.get('shard')}_{c}.tmp.npy"))
        for c in "kv")):
      shard, done = partial["shard"], set(partial.get("done", []))
  tmp = {c: os.path.join(d, f"{shard}_{c}.tmp.npy") for c in "kv"}
  row_of = {uid: i for i, uid in enumerate(meta["uids"])}
  todo = [i for i, uid in enumerate(uids) if uid in row_of and uid not in done]
  print(f"clean K/V ({name}): {len(uids) - len(todo)} of {len(uids)} records cached "
        f"in {d}, computing {len(todo)} into {shard}", flush=True)
  os.makedirs(d, exist_ok=True)
  out = tuple(np.load(tmp[c], mmap_mode="r+") for c in "kv") if done else None

  def checkpoint():
    if write:
      for x in out:
        x.flush()
      with open(tmp_meta + ".part", "w") as f:
        json.dump(dict(meta, shard=shard, done=sorted(done)), f)
      os.replace(tmp_meta + ".part", tmp_meta)

  last, checked_disk = time.monotonic(), False
  for rows_b, k, v in compute(todo):
    if not checked_disk:
      # Before writing anything: the shard's files grow to full size as records
      # come in, and a memory-mapped write to a full disk kills the process.
      need = 2 * len(todo) * k[0].size * np.dtype(dtype or k.dtype).itemsize
      free = shutil.disk_usage(d).free
      if write and need > free:
        raise FlexDraftError(
            f"the clean K/V of {len(todo)} records needs {need / 1e9:.1f} GB more under "
            f"{d}, which has {free / 1e9:.1f} GB free: set train.deep_kv_dir elsewhere, "
            "train.deep_kv_dtype=float16, or train.precompute_kv=False")
      checked_disk = True
    if out is None:
      shape = (len(row_of),) + k.shape[1:]
      dt = np.dtype(dtype or k.dtype)
      out = tuple(np.lib.format.open_memmap(tmp[c], "w+", dt, shape) if write
                  else np.zeros(shape, dt) for c in "kv")
    at = [row_of[uids[r]] for r in rows_b]
    out[0][at], out[1][at] = k, v
    done.update(uids[r] for r in rows_b)
    if time.monotonic() - last > flush_every:
      checkpoint()
      last = time.monotonic()
  if not write:
    return (shard,) + out
  checkpoint()
  del out
  for c in "kv":
    os.replace(tmp[c], os.path.join(d, f"{shard}_{c}.npy"))
  with open(os.path.join(d, f"{shard}.json"), "w") as f:
    json.dump(meta, f)
  os.remove(tmp_meta)
  return (shard,) + tuple(np.load(os.path.join(d, f"{shard}_{c}.npy"), mmap_mode="r")
                          for c in "kv")


def _host_drafter(config, state: TrainState, fingerprint: str, fixed=None) -> Drafter:
  params = dict(sharding.to_host(scored_params(state)), **jax.device_get(fixed or {}))
  return Drafter(drafter_config(config), params, fingerprint)


def _draft_vocab(workdir, records, size: int, cfg) -> np.ndarray:
  """The draft vocabulary of a run: made from the training records once and
  kept in WORKDIR/draft_vocab.npy, so a resumed run keeps it when data is added."""
  path = workdir and os.path.join(workdir, "draft_vocab.npy")
  if path and os.path.exists(path):
    vocab = np.load(path)
    if vocab.shape != (size,):
      raise FlexDraftError(f"{path} holds {vocab.shape[0]} ids, the config asks "
                           f"draft_vocab={size}; use a new --workdir")
    return vocab
  vocab = data.draft_vocabulary(records, size, cfg.vocab_size, cfg.eos_token_ids)
  if path and jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    np.save(path + ".tmp.npy", vocab)
    os.replace(path + ".tmp.npy", path)
  return vocab


def warm_start(params, source: Drafter, cfg, dcfg) -> dict:
  """`params` (a fresh draft pytree) with the weights of a trained drafter: the
  mask and attention as they are, the calibration output columns matched by
  token id (ids the source never drafted start at zero). Draft layers match
  from the top: a source with fewer layers fills this config's last ones (the
  others keep their init, copies of the target's projectors), one with more
  gives its last ones."""
  src = source.params
  out = jax.tree.map(np.asarray, params)
  have, want = src["layers"]["q"].shape, out["layers"]["q"].shape
  if have[1:] != want[1:] or set(src["layers"]) != set(out["layers"]):
    raise FlexDraftError(f"init_from drafter has draft layers of shape {have}, this "
                         f"config {want}")
  n = min(have[0], want[0])
  for key, x in src["layers"].items():
    layers = np.array(out["layers"][key])
    layers[want[0] - n:] = np.asarray(x)[have[0] - n:]
    out["layers"][key] = layers
  out["mask"] = np.broadcast_to(np.asarray(src["mask"]), out["mask"].shape).copy()
  if "bonus_in" in src and "bonus_in" in out:
    out["bonus_in"] = np.asarray(src["bonus_in"])
  for k in ("w1", "b1"):
    out["calib"][k] = np.asarray(src["calib"][k])
  w2, b2 = np.asarray(src["calib"]["w2"]), np.asarray(src["calib"]["b2"])
  if source.config.calib_tied or dcfg.calib_tied or w2.shape[0] != out["calib"]["w2"].shape[0]:
    if w2.shape != out["calib"]["w2"].shape:
      raise FlexDraftError("init_from drafter's calibration MLP does not match this "
                           f"config ({w2.shape} vs {out['calib']['w2'].shape})")
    out["calib"]["w2"], out["calib"]["b2"] = w2, b2
    return out
  src_ids = np.asarray(src["vocab"]) if "vocab" in src else np.arange(cfg.vocab_size)
  full_w2 = np.zeros((w2.shape[0], cfg.vocab_size), w2.dtype)
  full_b2 = np.zeros((cfg.vocab_size,), b2.dtype)
  full_w2[:, src_ids], full_b2[src_ids] = w2, b2
  dst_ids = np.asarray(out["vocab"]) if "vocab" in out else np.arange(cfg.vocab_size)
  out["calib"]["w2"], out["calib"]["b2"] = full_w2[:, dst_ids], full_b2[dst_ids]
  return out


# Drafter settings that shape the trained state: a checkpoint made with others
# cannot be resumed.
SHAPE_KEYS = ("num_layers", "block_size", "calib_rank", "calib_tied", "draft_vocab",
              "per_slot_mask", "bonus_input")


def _check_same_run(saved: dict, made_by: dict, where: str) -> None:
  """Refuses (one line) to resume checkpoints of another target or drafter
  shape; a changed drafter setting that shapes nothing gets a note."""
  if saved.get("target_fingerprint", made_by["target_fingerprint"]) != \
      made_by["target_fingerprint"]:
    raise FlexDraftError(
        f"{where} holds checkpoints of target {saved.get('target')} (fingerprint "
        f"{saved['target_fingerprint']}), not {made_by['target']} "
        f"({made_by['target_fingerprint']}): use another --workdir")
  old, new = saved.get("drafter") or {}, made_by["drafter"]
  changed = [k for k in old if k in new and old[k] != new[k]]
  shape = [k for k in changed if k in SHAPE_KEYS]
  if shape:
    diff = ", ".join(f"drafter.{k}={old[k]!r} there, {new[k]!r} here" for k in shape)
    raise FlexDraftError(f"{where} holds checkpoints of another drafter shape ({diff}): "
                         "use another --workdir, or the config it was started with")
  if changed and jax.process_index() == 0:
    print("train: note: resuming with " + ", ".join(
        f"drafter.{k}={new[k]!r} (the checkpoints were trained with {old[k]!r})"
        for k in changed), flush=True)


def _restore(mngr, state, made_by: dict):
  """(start step, state, meta) from the latest checkpoint, if any. A run that
  turns the moving average on resumes a checkpoint without one with the
  average started at the restored weights (and one that turns it off drops it).
  `made_by` (the target and drafter config) goes into the checkpoints' meta,
  and a checkpoint made by others is refused in one line."""
  meta = {"tokens_seen": 0, "best_tau": -1.0, "best_step": -1}
  start = mngr.latest_step() or 0
  if start:
    where = f"--workdir {os.path.dirname(os.fspath(mngr.directory))}"
    saved = mngr.restore(start, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    _check_same_run(dict(saved.meta), made_by, where)
    had_ema = bool(dict(saved.meta).get("ema", False))
    like = state._replace(ema=state.params if had_ema else None)
    try:
      restored = mngr.restore(start, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_abstract(like)), meta=ocp.args.JsonRestore()))
    except (ValueError, TypeError, KeyError) as e:  # older checkpoints: no made_by
      first = (str(e).strip().splitlines() or [""])[0][:200]
      raise FlexDraftError(f"{where}: checkpoint {start} does not fit this config "
                           f"({type(e).__name__}: {first}); use another --workdir, or "
                           "the config it was started with") from None
    meta, ema = dict(restored.meta), restored.state.ema
    if state.ema is None:
      ema = None
    elif ema is None:
      ema = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(restored.state.params)
    state = restored.state._replace(ema=ema)
  meta["ema"] = state.ema is not None
  meta.update(made_by)
  return start, state, meta


def _compile_ahead(steps, state, target_params, packers, mesh, tc, start):
  """Multi-process: compile before the first collective, then meet — compile
  times differ between processes by more than the collectives' set-up timeout."""
  (train_step, eval_step), (packer, eval_packer, *_) = steps, packers
  first = sharding.put_batch(packer.train_batch(start, tc.batch_size,
                                                sharding.local_rows(tc.batch_size)),
                             mesh, tc.batch_size)
  train_step = train_step.lower(state, target_params, first).compile()
  if eval_packer is not None and tc.eval_every > 0:
    eb = eval_packer.eval_batches(tc.eval_batch_size,
                                  sharding.local_rows(tc.eval_batch_size))[0]
    eval_step = eval_step.lower(scored_params(state), target_params, sharding.put_batch(
        eb, mesh, tc.eval_batch_size)).compile()
  sharding.barrier("flexdraft_train_compiled")
  return train_step, eval_step


def _train_row(m, meta, bs, rate) -> dict:
  return {"loss": float(m["loss"]), "tau": float(m["tau"]), "lr": float(m["lr"]),
          "grad_norm": float(m["grad_norm"]), "tokens_seen": meta["tokens_seen"],
          "steps_per_s": rate, **{f"acc_{j}": float(m["acc_S"][j]) for j in range(1, bs)}}


def train(config, workdir: str) -> TrainResult:
  """Runs (or resumes) training in `workdir`, one run per workdir at a time
  (WORKDIR/flexdraft.lock names it). Ctrl-C or SIGTERM stops it cleanly: the
  checkpoint being saved is finished, nothing half-written is left, and
  `run_control.Stopped` says where it stopped (rerunning resumes)."""
  check_train_config(config)
  t_begin = time.perf_counter()  # train.max_minutes counts from here
  sharding.maybe_initialize_distributed(**dict(config.distributed))
  lock = contextlib.nullcontext()
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    lock = run_control.folder_lock(os.path.abspath(workdir), "train")
  run = {}  # what a stop must close: the checkpoint manager, the log, the step
  with lock:
    try:
      return _train(config, workdir, t_begin, run)
    except KeyboardInterrupt as e:
      raise run_control.stopped(e, _stop_cleanly(run, workdir)) from None


def _stop_cleanly(run: dict, workdir: str) -> str:
  """After Ctrl-C / SIGTERM: the save in flight finished and orbax closed (its
  threads would fail at exit), leftovers of a cut save removed, the log
  closed. Returns where the run stopped."""
  if run.get("bar") is not None:
    run["bar"].close()
  mngr, latest = run.get("mngr"), None
  if mngr is not None:
    with contextlib.suppress(Exception):
      mngr.wait_until_finished()
    with contextlib.suppress(Exception):
      latest = mngr.latest_step()
    with contextlib.suppress(Exception):
      mngr.close()
  _remove_cut_saves(workdir)
  if run.get("log") is not None:
    run["log"].close()
  at = (f"at step {run['step']}" if run.get("step") is not None
        else "before its first step")
  ckpt = os.path.join(os.path.abspath(workdir), "ckpt")
  kept = (f"checkpoint {latest} is complete in {ckpt}" if latest
          else "no checkpoint yet (a rerun starts over)")
  return f"train {at}; {kept}"


def _train(config, workdir: str, t_begin: float, run: dict) -> TrainResult:
  tc, bs = config.train, config.drafter.block_size
  is_main = jax.process_index() == 0
  if is_main:
    print(f"train: writing checkpoints, metrics and drafters to {os.path.abspath(workdir)}"
          f"{_other_writes(config, workdir)}", flush=True)
  state, target_params, packers, steps, mesh, info = _setup(config, workdir)
  (packer, eval_packer, variant_packer, blind_packer), target = packers, info.pop("target")
  fixed = info.pop("fixed_params")
  mngr = run["mngr"] = _checkpoint_manager(workdir, tc)
  made_by = {"target": target.name, "target_fingerprint": target.fingerprint,
             "drafter": dataclasses.asdict(drafter_config(config))}
  start, state, meta = _restore(mngr, state, made_by)
  end = min(tc.stop_at_step, tc.num_steps) if tc.stop_at_step else tc.num_steps
  columns = (["step", "mask_rows", "loss", "tau", "lr", "grad_norm", "tokens_seen",
              "steps_per_s"] + [f"acc_{j}" for j in range(1, bs)]
             + ["eval_tau", "eval_loss"] + [f"eval_acc_{j}" for j in range(1, EVAL_SLOTS + 1)]
             # with a moving average, eval_* score it and these the trained weights
             + (["raw_eval_tau", "raw_eval_loss"] if state.ema is not None else [])
             + (["variant_eval_tau", "variant_eval_loss"] if variant_packer is not None
                else [])
             + (["blind_eval_tau", "blind_eval_loss"] if blind_packer is not None else []))
  log = run["log"] = MetricsLog(workdir, columns, enabled=is_main, resume_step=start)
  if is_main:
    print(f"train: {sharding.describe(mesh)}; {info['train_records']} train / "
          f"{info['eval_records']} eval sequences (+ {info['eval_variant_records']} "
          f"in the prompt variants' formats); steps {start}..{end}", flush=True)
  record = lambda: {
      "target": target.name, "regen_dir": os.path.abspath(config.data.regen_dir),
      "mix": dict(config.data.mix),
      "source_weights": dict(config.data.get("source_weights", {})),
      "variant_weights": dict(config.data.get("variant_weights", {})),
      **info, "steps": int(sharding.scalar(state.step)),
      "tokens_seen": meta["tokens_seen"], "mask_rows": meta["mask_rows"],
      "best_eval_tau": meta["best_tau"],
      "best_step": meta["best_step"], "config": config.name,
      # the scored/exported weights: a moving average (ema_decay > 0) or the trained ones
      "lr": tc.lr, "schedule": tc.schedule,
      "decay_steps": tc.get("decay_steps", 0), "ema_decay": tc.ema_decay}
  evaluating = eval_packer is not None and tc.eval_every > 0
  if jax.process_count() > 1 and start < end:
    steps = _compile_ahead(steps, state, target_params, packers, mesh, tc, start)
  train_step, eval_step = steps
  rows = sharding.local_rows(tc.batch_size)
  rows_per_step = tc.batch_size * tc.anchors_per_seq * bs  # mask rows, global
  meta.setdefault("mask_rows", info.pop("init_mask_rows") + start * rows_per_step)

  if evaluating and start == 0 and tc.init_from:
    # A warm start is measured first: the held-out set may differ from the one
    # the source drafter was scored on (more data moves it), and the run's
    # best drafter must beat its starting point.
    ev = _evaluate(eval_step, scored_params(state), target_params, eval_packer, mesh, tc)
    if blind_packer is not None:
      blind = _evaluate(eval_step, scored_params(state), target_params, blind_packer,
                        mesh, tc)
      ev.update(blind_eval_tau=blind["eval_tau"], blind_eval_loss=blind["eval_loss"])
    meta["best_tau"], meta["best_step"] = _score(ev), 0
    _export(os.path.join(workdir, "best_drafter"), config, state, target, record(),
            is_main, fixed)
    log.write(0, {"mask_rows": meta["mask_rows"], **ev})
    if is_main:
      blind = (f"; blind (parallel mode) {ev['blind_eval_tau']:.3f}"
               if "blind_eval_tau" in ev else "")
      print(f"step 0 (warm start from {tc.init_from}): eval tau {ev['eval_tau']:.3f} "
            f"loss {ev['eval_loss']:.3f}{blind}", flush=True)
  bar = run["bar"] = tqdm.tqdm(total=end, initial=start, disable=not is_main,
                              dynamic_ncols=True)
  run["step"] = start
  t_last, s_last = time.perf_counter(), start
  put = lambda step: sharding.put_batch(packer.train_batch(step, tc.batch_size, rows), mesh,
                                       tc.batch_size)
  batch = put(start) if start < end else None
  deadline = t_begin + 60.0 * tc.max_minutes if tc.get("max_minutes", 0.0) else None
  for step in range(start, end):
    state, m = train_step(state, target_params, batch)
    # The step runs asynchronously: assemble the next batch meanwhile (with
    # cached K/V, reads from the memory-mapped cache), then wait for it.
    batch = put(step + 1) if step + 1 < end else None
    m = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), m)
    meta["tokens_seen"] += int(m["tokens"])
    meta["mask_rows"] += rows_per_step
    done, row = step + 1, {}
    run["step"] = done
    # Out of time: this step is the run's last, as if it were num_steps.
    last = done == end or (deadline is not None and _past(deadline, done, tc.log_every))
    eval_now = evaluating and (done % tc.eval_every == 0 or last)
    if done % tc.log_every == 0 or last or eval_now:
      # An eval step off the log cadence logs its training row too.
      now = time.perf_counter()
      row = _train_row(m, meta, bs, (done - s_last) / max(now - t_last, 1e-9))
      row["mask_rows"] = meta["mask_rows"]
      t_last, s_last = now, done
      bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['tau']:.2f}")
    if eval_now:
      ev = _evaluate(eval_step, scored_params(state), target_params, eval_packer, mesh, tc)
      if state.ema is not None:
        raw = _evaluate(eval_step, state.params, target_params, eval_packer, mesh, tc)
        ev.update(raw_eval_tau=raw["eval_tau"], raw_eval_loss=raw["eval_loss"])
      if variant_packer is not None:
        var = _evaluate(eval_step, scored_params(state), target_params, variant_packer,
                        mesh, tc)
        ev.update(variant_eval_tau=var["eval_tau"], variant_eval_loss=var["eval_loss"])
      if blind_packer is not None:
        blind = _evaluate(eval_step, scored_params(state), target_params, blind_packer,
                          mesh, tc)
        ev.update(blind_eval_tau=blind["eval_tau"], blind_eval_loss=blind["eval_loss"])
      row.update(ev)
      if _score(ev) > meta["best_tau"]:
        meta["best_tau"], meta["best_step"] = _score(ev), done
        with run_control.critical():  # not cut between its two renames
          _export(os.path.join(workdir, "best_drafter"), config, state, target,
                  record(), is_main, fixed)
      more = (f"; trained weights {ev['raw_eval_tau']:.3f}" if state.ema is not None
              else "")
      if variant_packer is not None:
        more += f"; prompt variants {ev['variant_eval_tau']:.3f}"
      if blind_packer is not None:
        more += f"; blind (parallel mode) {ev['blind_eval_tau']:.3f}"
      bar.write(f"step {done}: eval tau {ev['eval_tau']:.3f} loss {ev['eval_loss']:.3f} "
                f"(best {meta['best_tau']:.3f} @ {meta['best_step']}){more}")
    if row:
      log.write(done, row)
    if done % tc.ckpt_every == 0 or last:
      with run_control.critical():  # a stop then waits for this save to finish
        mngr.save(done, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))))
    bar.update(1)
    if last and done < end:
      bar.write(f"train: stopping at step {done} after train.max_minutes="
                f"{tc.max_minutes} (rerun to resume)")
      break
  bar.close()
  mngr.wait_until_finished()
  mngr.close()
  log.close()

  final = _host_drafter(config, state, target.fingerprint, fixed)
  summary = record()
  if is_main:
    drafter_ckpt.save_drafter(os.path.join(workdir, "final_drafter"), final, target,
                              training=summary)
    if not evaluating:  # nothing to choose from: best = last
      drafter_ckpt.save_drafter(os.path.join(workdir, "best_drafter"), final, target,
                                training=summary)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
  return TrainResult(summary, final.params)


def _score(ev: dict) -> float:
  """What picks the best drafter: held-out τ; for a drafter trained blind
  too, the mean of its τ with the bonus read and blind."""
  if "blind_eval_tau" in ev:
    return 0.5 * (ev["eval_tau"] + ev["blind_eval_tau"])
  return ev["eval_tau"]


def _past(deadline: float, step: int, every: int) -> bool:
  """Whether the clock has passed `deadline`. Several processes must stop at the
  same step (the steps are collectives): they agree on it every `every` steps
  only, so the step loop does not wait on a cross-host gather each step."""
  if jax.process_count() == 1:
    return time.perf_counter() >= deadline
  if step % every:
    return False
  from jax.experimental import multihost_utils
  past = np.int32(time.perf_counter() >= deadline)
  return bool(multihost_utils.process_allgather(past).max())


def _other_writes(config, workdir) -> str:
  """Where else training writes: the unpacked data, the clean K/V cache."""
  out = []
  if config.data.get("packed", ""):
    out.append(f"regenerated data into {os.path.abspath(config.data.regen_dir)} "
               "(--config.data.regen_dir)")
  if config.train.precompute_kv:
    kv_dir = config.train.deep_kv_dir or os.path.join(workdir, "deep_kv")
    out.append(f"the clean K/V cache to {os.path.abspath(kv_dir)} "
               "(--config.train.deep_kv_dir)")
  return "".join(f"; {x}" for x in out)


def _evaluate(eval_step, params, target_params, packer, mesh, tc) -> dict:
  rows = sharding.local_rows(tc.eval_batch_size)
  sums = []
  for b in packer.eval_batches(tc.eval_batch_size, rows):
    m = eval_step(params, target_params, sharding.put_batch(b, mesh, tc.eval_batch_size))
    sums.append({k: np.asarray(v.addressable_data(0)) for k, v in m.items()})
  return _eval_metrics(sums)


def _export(path, config, state, target, record, is_main, fixed=None) -> bool:
  drafter = _host_drafter(config, state, target.fingerprint, fixed)  # every process
  if is_main:
    drafter_ckpt.save_drafter(path, drafter, target, training=record)
  return is_main


def run(argv):
  from flexdraft_jax import cli_util
  from flexdraft_jax.cli_util import define_flags
  define_flags(argv, workdir="where checkpoints, metrics and the exported drafters go")

  def main(args):
    config, workdir = cli_util.config_and_workdir(args, "configs/smollm2_135m.py")
    result = train(config, workdir)
    if jax.process_index() == 0:
      print(json.dumps(result.summary))

  cli_util.run_main(main, argv, doc=__doc__)
