"""The programs a decode run (and a drafter's training) compiles, built from
shapes alone and compiled for a TPU slice that is not attached.

A target is its config (a builtin's GGUF header, an HF folder's config.json,
a random target's table entry): its weights are `jax.ShapeDtypeStruct`s laid
out as the loaders lay them out (`jax.eval_shape` of the modules' `init`), a
drafter its drafter.json (or a random one's L and block). Every argument
carries the sharding the engine gives it on that slice (the batch split over
the devices, the weights replicated), and `jit(...).lower(...).compile()`
runs the TPU compiler, Mosaic included; its memory and cost analyses become
the report's rows (report.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import time
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flexdraft_jax.aot import report
from flexdraft_jax.aot.chips import Topology
from flexdraft_jax.model.config import FlexDraftError, ModelConfig

RANDOM_DRAFTER = re.compile(r"random(?::L=(\d+))?(?:,block=(\d+))?")
DEFAULT_RANDOM_DRAFTER = "random:L=4,block=8"


# ----------------------------------------------------------- the inputs ----

class TargetShape(NamedTuple):
  name: str
  config: ModelConfig


class DrafterShape(NamedTuple):
  name: str
  config: object  # DrafterConfig


def target_shape(spec: str) -> TargetShape:
  """The target's config, read without its weights: `random:NAME`, a builtin
  name (its GGUF file's header), an HF folder or its config.json."""
  from flexdraft_jax.model import loading
  if spec.startswith("random:"):
    from flexdraft_jax.model.random_target import RANDOM_CONFIGS
    name = spec.split(":")[1]
    if name not in RANDOM_CONFIGS:
      raise FlexDraftError(f"unknown random target {name!r} "
                           f"(known: {', '.join(RANDOM_CONFIGS)})")
    return TargetShape(spec, RANDOM_CONFIGS[name])
  path = os.path.expanduser(spec)
  if os.path.basename(path) == "config.json" and os.path.isfile(path):
    path = os.path.dirname(path) or "."
  if os.path.isdir(path):
    from flexdraft_jax.model import hf
    if not os.path.isfile(os.path.join(path, "config.json")):
      raise FlexDraftError(f"--target {spec}: no config.json in that folder")
    return TargetShape(os.path.basename(os.path.normpath(path)), hf.read_config(path))
  if spec in loading.BUILTINS or path.lower().endswith(".gguf"):
    from flexdraft_jax.model import gguf_loader
    file = loading.builtin_path(spec) if spec in loading.BUILTINS else path
    if not os.path.isfile(file):
      raise FlexDraftError(f"missing GGUF file {spec}")
    meta, tensors = gguf_loader.read_gguf(file)
    return TargetShape(spec, gguf_loader.read_config(meta, set(tensors), file))
  raise FlexDraftError(
      f"unknown target {spec!r}: not a folder with config.json, not a config.json, not a "
      f".gguf file, not a builtin name ({', '.join(loading.BUILTINS)}), not random:NAME")


def drafter_shape(spec: Optional[str], target: TargetShape) -> Optional[DrafterShape]:
  """The drafter's config: a drafter folder's drafter.json (made for a target
  of these shapes), `random:L=N,block=M`, or None ("none")."""
  from flexdraft_jax.drafter.model import DrafterConfig
  if spec in (None, "", "none"):
    return None
  cfg = target.config
  m = RANDOM_DRAFTER.fullmatch(spec)
  if m:
    dcfg = DrafterConfig(num_layers=int(m.group(1) or 4), block_size=int(m.group(2) or 8))
  elif spec.startswith("random"):
    raise FlexDraftError(f"--drafter {spec!r}: a random drafter is random:L=N,block=M "
                         f"(e.g. {DEFAULT_RANDOM_DRAFTER})")
  else:
    from flexdraft_jax.drafter import checkpoint
    meta = checkpoint.read_meta(os.path.expanduser(spec))
    made = meta.get("target", {})
    for key in ("num_layers", "hidden_size", "vocab_size"):
      if made.get(key) != getattr(cfg, key):
        raise FlexDraftError(
            f"{spec} was made for target {made.get('name')!r} ({key}={made.get(key)}), "
            f"not {target.name!r} ({key}={getattr(cfg, key)})")
    try:
      dcfg = DrafterConfig(**meta["config"])
    except (KeyError, TypeError) as e:
      raise FlexDraftError(f"corrupt drafter at {spec}: bad config ({e})") from None
  dcfg.validate(cfg)
  return DrafterShape(spec, dcfg)


@dataclasses.dataclass(frozen=True)
class ModeSpec:
  """A decode chunk: `ar`, `parallel:K`, `sequential:K` (verify length K) or
  `tree:N` (sequential steps verifying a draft tree of N nodes)."""
  kind: str
  k: int = 0

  def __str__(self):
    return self.kind if self.kind == "ar" else f"{self.kind}:{self.k}"


def parse_modes(text: str) -> list:
  """`ar,parallel:4,sequential:8,tree:16` -> ModeSpecs (one-line errors)."""
  out = []
  for part in [p.strip() for p in str(text).split(",") if p.strip()]:
    kind, _, k = part.partition(":")
    if kind == "ar" and not k:
      out.append(ModeSpec("ar"))
    elif kind in ("parallel", "sequential", "tree") and k.isdigit() and int(k) >= 2:
      out.append(ModeSpec(kind, int(k)))
    else:
      raise FlexDraftError(f"--modes: {part!r} is not a mode: ar, parallel:K, sequential:K "
                           "(K >= 2 the verify length) or tree:N (N >= 2 nodes)")
  if not out:
    raise FlexDraftError("--modes is empty: e.g. ar,parallel:4,sequential:8,tree:16")
  return list(dict.fromkeys(out))


def check_modes(modes: list, drafter: Optional[DrafterShape], vocab_size: int) -> None:
  """Each speculative mode against the drafter's block (one line)."""
  spec = [m for m in modes if m.kind != "ar"]
  if spec and drafter is None:
    raise FlexDraftError(f"--modes {spec[0]} needs a drafter (--drafter a drafter folder "
                         f"or {DEFAULT_RANDOM_DRAFTER})")
  for m in spec:
    bs = drafter.config.block_size
    if m.kind in ("parallel", "sequential") and m.k > bs:
      raise FlexDraftError(f"--modes {m}: the verify length exceeds the drafter's block "
                           f"size {bs}")
    if m.kind == "tree":
      top = min(drafter.config.rescore_top, drafter.config.draft_vocab or vocab_size)
      most = 1 + sum(top ** d for d in range(1, bs))
      if m.k > most:
        raise FlexDraftError(f"--modes {m} exceeds the {most} nodes this drafter's block "
                             f"can fill (block {bs}, {top} candidates a slot)")


# ---------------------------------------------------- the slice's devices ----

def compiler_missing() -> Optional[str]:
  """None where the TPU compiler (libtpu) can be imported, else the line
  that names the install."""
  import importlib.util
  if importlib.util.find_spec("libtpu") is None:
    return 'compiling for a TPU needs the TPU compiler (libtpu): pip install "jax[tpu]"'
  return None


def topology_devices(topo: Topology) -> list:
  """The devices of a TPU slice that is not attached (`get_topology_desc`)."""
  from jax.experimental import topologies
  # The TPU runtime looks for a slice on this host unless told what it is.
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", topo.accelerator_type())
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topo.name,
                                        chips_per_host_bounds=topo.host_bounds())
  except Exception as e:  # the runtime's own refusal, e.g. a slice it does not make
    raise FlexDraftError(f"--topology {topo.name}: the TPU runtime refused it: "
                         f"{report.first_line(e)}") from None
  return list(desc.devices)


def devices_per_chip(devices) -> int:
  """Devices a chip (2 where each TensorCore is a device, as v4's are)."""
  chips = {tuple(getattr(d, "coords", (d.id,))) for d in devices}
  return max(1, len(devices) // max(1, len(chips)))


# -------------------------------------------------------------- shapes ----

def _target_params(cfg: ModelConfig, dtype, layout: str):
  from flexdraft_jax.model import transformer
  model = transformer.Transformer(cfg, layout, dtype=dtype)
  return jax.eval_shape(lambda: model.init(jax.random.key(0), method="weights"))["params"]


def _draft_params(stacked_target, cfg, dcfg, dtype):
  """The draft pytree's shapes as load_drafter makes it (weights in `dtype`,
  the vocabulary and n-gram keys int32)."""
  from flexdraft_jax.drafter.model import init_draft_params
  vocab = (jax.ShapeDtypeStruct((dcfg.draft_vocab,), jnp.int32) if dcfg.draft_vocab
           else None)
  return jax.eval_shape(lambda tp: init_draft_params(tp, cfg, dcfg, jax.random.PRNGKey(0),
                                                     dtype, vocab=vocab), stacked_target)


def _placed(tree, sharding):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                      tree)


def _with_shardings(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


# ----------------------------------------------------------- compiling ----

@dataclasses.dataclass
class Plan:
  target: TargetShape
  drafter: Optional[DrafterShape]
  topology: Topology
  batch_sizes: tuple
  modes: list
  max_len: int
  prompt_len: int
  attn_impl: str
  dtype: str
  train: bool
  train_batch: int = 8
  train_seq_len: int = 512


def _analysis(compiled) -> tuple:
  """(memory dict, cost dict) per device from a compiled program."""
  m = compiled.memory_analysis()
  memory = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
            "generated_code": m.generated_code_size_in_bytes}
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict a device program
    cost = cost[0] if cost else {}
  cost = cost or {}
  return memory, {"flops": cost.get("flops", 0.0),
                  "bytes_accessed": cost.get("bytes accessed", 0.0)}


def compile_row(name: str, mode: str, batch: int, lower, *, topo: Topology, per_chip: int,
                padded_batch: int, log=None) -> tuple:
  """(row, compiled or None): `lower()` lowered and compiled; a refusal at
  either step is the row's error."""
  started = time.perf_counter()
  compiled, error = None, None
  try:
    compiled = lower().compile()
  except Exception as e:  # the compiler's refusal: reported, not raised
    error = e
  seconds = time.perf_counter() - started
  if compiled is None:
    row = report.program_row(name, mode, batch, chip=topo.chip, devices_per_chip=per_chip,
                             padded_batch=padded_batch, error=error, seconds=seconds)
  else:
    memory, cost = _analysis(compiled)
    row = report.program_row(name, mode, batch, chip=topo.chip, devices_per_chip=per_chip,
                             padded_batch=padded_batch, memory=memory, cost=cost,
                             seconds=seconds)
  if log:
    log(f"{name}: " + (f"{row['bytes_per_chip'] / 2 ** 20:.1f} MiB a chip, "
                       f"{row['flops'] / 1e9:.3f} GFLOP, {seconds:.1f}s" if compiled
                       else f"refused: {row['error']}"))
  return row, compiled


def decode_rows(plan: Plan, devices, log=None) -> list:
  """Prefill and each mode's chunk at each batch size, compiled."""
  from flexdraft_jax.decoding import capacity, chunk, decode_params, inputs
  from flexdraft_jax.decoding.options import Mode
  from flexdraft_jax.decoding.sampling import SamplingParams
  from flexdraft_jax.util import round_up
  cfg, dtype = plan.target.config, jnp.dtype(plan.dtype)
  dcfg = None if plan.drafter is None else plan.drafter.config
  n = len(devices)
  mesh = Mesh(np.asarray(devices), ("data",))
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  per_chip = devices_per_chip(devices)
  stacked = _target_params(cfg, dtype, "stacked")
  target = _placed(jax.eval_shape(decode_params.decoding_params, stacked), rep)
  draft = None
  if dcfg is not None:
    raw = _draft_params(stacked, cfg, dcfg, dtype)
    narrow = decode_params.resolve_draft_dtype("auto", stacked)
    draft = _placed(jax.eval_shape(functools.partial(
        decode_params._draft_pytree, cfg=cfg,
        dtype=None if narrow is None else jnp.dtype(narrow).name), stacked, raw), rep)
  S = capacity.cache_length(cfg, [plan.prompt_len], 1, 1, plan.max_len)
  width = round_up(plan.prompt_len, capacity.PROMPT_PAD)
  i32 = lambda shape=(), s=rep: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s)
  traced = dict(max_new=i32(), stop_ids=_placed(inputs.stop_array(()), rep))
  key = _placed(jax.eval_shape(lambda: inputs.seed_key(0)), rep)
  rows = []
  tree_tops = sorted({(min(dcfg.rescore_top, dcfg.draft_vocab or cfg.vocab_size)
                       if m.kind == "tree" else 0) for m in plan.modes})
  for B in plan.batch_sizes:
    Bp = round_up(B, n)
    prompt = (i32((Bp, width), split), i32((Bp,), split),
              jax.ShapeDtypeStruct((Bp,), jnp.bool_, sharding=split))
    for top in tree_tops:
      sp = SamplingParams().resolved(trees=bool(top))
      static = dict(cfg=cfg, dcfg=dcfg, sp=sp, attn_impl=plan.attn_impl)
      pre_args = (target, draft, *prompt, key)
      pre_kw = dict(S=S, out_len=S, cache_sharding=split if n > 1 else None, tree_top=top,
                    **static, **traced)
      name = f"prefill B={B}" + (f" (trees, {top} candidates a slot)" if top else "")
      row, compiled = compile_row(
          name, "prefill", B, lambda: chunk.prefill_batch.lower(*pre_args, **pre_kw),
          topo=plan.topology, per_chip=per_chip, padded_batch=Bp, log=log)
      rows.append(row)
      state = jax.eval_shape(functools.partial(chunk.prefill_batch.jitted, **pre_kw),
                             *pre_args)
      state = (_with_shardings(state, compiled.output_shardings) if compiled is not None
               else _placed(state, rep))
      for m in plan.modes:
        m_top = (min(dcfg.rescore_top, dcfg.draft_vocab or cfg.vocab_size)
                 if m.kind == "tree" else 0)
        if m_top != top:
          continue
        mode = {"ar": Mode.AR, "parallel": Mode.PARALLEL}.get(m.kind, Mode.SEQUENTIAL)
        kw = dict(mode=mode, num_groups=m.k if m.kind != "tree" else 0, n_steps=i32(),
                  theta=jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
                  strategy="cumulative_product", refresh=False,
                  tree_budget=m.k if m.kind == "tree" else 0, **static, **traced)
        if m.kind == "ar":
          kw["dcfg"] = None
        row, _ = compile_row(
            f"chunk {m} B={B}", str(m), B,
            lambda kw=kw: chunk.run_chunk.lower(target, draft if m.kind != "ar" else None,
                                                state, **kw),
            topo=plan.topology, per_chip=per_chip, padded_batch=Bp, log=log)
        rows.append(row)
  return rows


def train_row(plan: Plan, devices, log=None) -> dict:
  """The drafter's jitted training step (training/steps.py) at
  `plan.train_batch` sequences of `plan.train_seq_len` tokens."""
  from flexdraft_jax.drafter.model import trainable
  from flexdraft_jax.training import sharding, steps
  from flexdraft_jax.training.config import base_config
  from flexdraft_jax.util import round_up
  cfg = plan.target.config
  # Training has no n-gram prior (add-ngram adds it to a trained drafter).
  dcfg = dataclasses.replace(plan.drafter.config, ngram_bigrams=0, ngram_contexts=0,
                             ngram_trigrams=0, ngram_weight=0.0, context_trigram=0.0,
                             context_bigram=0.0)
  n = len(devices)
  mesh = Mesh(np.asarray(devices).reshape(n, 1), ("data", "model"))
  tc = base_config("aot").train
  tc.batch_size, tc.seq_len, tc.attn_impl = plan.train_batch, plan.train_seq_len, plan.attn_impl
  tc.precompute_kv = False
  tx, schedule = steps.make_optimizer(tc)
  target = _target_params(cfg, jnp.dtype(plan.dtype), "stacked")
  draft0 = _draft_params(target, cfg, dcfg, jnp.float32)
  fixed = {k: np.zeros(v.shape, v.dtype) for k, v in draft0.items() if k == "vocab"}
  params = trainable(draft0)
  rep = NamedSharding(mesh, P())
  target_sh = sharding.param_shardings(target, mesh)
  params_sh = sharding.param_shardings(params, mesh)
  opt_state = jax.eval_shape(tx.init, steps.optimizer_variables(target, params))
  ema = params if tc.ema_decay else None
  state_sh = steps.TrainState(rep, params_sh,
                              sharding.state_shardings(opt_state, params_sh, mesh),
                              None if ema is None else params_sh)
  state = steps.TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state, ema)
  shardings_ = {"state": state_sh, "target": target_sh, "replicated": rep,
                "batch": sharding.batch_sharding(mesh)}
  train_step, _ = steps.make_steps(cfg, dcfg, tx, schedule, tc, shardings_, mesh, fixed)
  B, T, K = round_up(plan.train_batch, n), plan.train_seq_len, tc.anchors_per_seq
  batch = {"tokens_BxT": jax.ShapeDtypeStruct((B, T), jnp.int32),
           "length_B": jax.ShapeDtypeStruct((B,), jnp.int32),
           "anchor_BxK": jax.ShapeDtypeStruct((B, K), jnp.int32),
           "anchor_ok_BxK": jax.ShapeDtypeStruct((B, K), jnp.bool_)}
  if dcfg.bonus_dropout:
    batch["blind_BxK"] = jax.ShapeDtypeStruct((B, K), jnp.bool_)
  row, _ = compile_row(f"train_step B={plan.train_batch} T={T}", "train", plan.train_batch,
                       lambda: train_step.lower(state, target, batch), topo=plan.topology,
                       per_chip=devices_per_chip(devices), padded_batch=B, log=log)
  return row


@contextlib.contextmanager
def _no_persistent_cache():
  """JAX's persistent compilation cache off meanwhile: it would write programs
  for a chip this process cannot load, and warn on reading them back."""
  from jax.experimental.compilation_cache import compilation_cache
  was = jax.config.jax_enable_compilation_cache
  if not was:
    yield
    return
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # JAX decides once whether the cache is used
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


def compile_all(plan: Plan, log=None) -> dict:
  """Every program of the plan compiled for its slice: the report's dict."""
  from flexdraft_jax.kernels import _platform
  from flexdraft_jax.model.attention import resolve_impl
  devices = topology_devices(plan.topology)
  with _platform.building_for("tpu"), _no_persistent_cache():
    attention = resolve_impl(plan.attn_impl)  # what "auto" runs on a TPU
    rows = decode_rows(plan, devices, log)
    if plan.train and plan.drafter is not None:
      rows.append(train_row(plan, devices, log))
  chip = plan.topology.chip
  return {
      "format": report.FORMAT, "version": 1,
      "target": plan.target.name,
      "drafter": plan.drafter.name if plan.drafter else "none",
      "topology": plan.topology.name, "devices": len(devices),
      "devices_per_chip": devices_per_chip(devices),
      "device_kind": devices[0].device_kind,
      "chip": dataclasses.asdict(chip),
      "dtype": plan.dtype, "attn_impl": plan.attn_impl,
      "attention": attention, "max_len": plan.max_len,
      "prompt_len": plan.prompt_len, "batch_sizes": list(plan.batch_sizes),
      "modes": [str(m) for m in plan.modes],
      "train": ({"batch": plan.train_batch, "seq_len": plan.train_seq_len}
                if plan.train and plan.drafter is not None else None),
      "versions": _versions(),
      "programs": report.with_ar_ratios(rows),
  }


def _versions() -> dict:
  from importlib import metadata
  out = {}
  for dist in ("jax", "jaxlib", "libtpu"):
    try:
      out[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      out[dist] = None
  return out
