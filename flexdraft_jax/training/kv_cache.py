"""The deep layers' clean K/V of the training records, computed once
(`train.precompute_kv`) and kept in memory or memory-mapped shards on disk,
so a training step runs only the mask rows."""

from __future__ import annotations

import json
import os
import shutil
import time

import jax
import numpy as np
import tqdm

from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.training import loss as loss_lib, sharding
from flexdraft_jax.util import round_up


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


def cached_deep_kv(d, name, fingerprint, packer, dcfg, compute, flush_every=60.0,
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
