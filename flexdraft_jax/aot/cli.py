"""`python -m flexdraft_jax aot`: compiles a decode run's programs for a TPU
slice that is not attached, and reports whether each fits and what a step costs.

  python -m flexdraft_jax aot --target=smollm2-135m \\
      --drafter=flexdraft_jax/drafters/smollm2_135m_L8 --topology=v5e:1x1 \\
      --batch_sizes=1,16 --out=runs/aot/smollm2_v5e

Compiles, with the TPU compiler (`pip install "jax[tpu]"`; no TPU needed), the
prefill and each `--modes` chunk at each batch size, and the drafter's
training step (`--train`), from shapes alone: `--target` is a builtin, an HF
folder or just its config.json, or random:NAME; `--drafter` a drafter folder,
random:L=N,block=M, or none (AR only). Writes aot_report.json and
aot_report.md into `--out` (a new folder, or one with an earlier report of
this command): each program's memory a chip against the chip's HBM, the
compiler's flops and bytes, a roofline step time (max of bytes / HBM
bandwidth, flops / peak bf16) and each mode's step as a multiple of AR's.
Exit status 0 when every program compiled and fits, 2 when one did not (one
line each on stderr), 1 on bad input.
"""

from __future__ import annotations

import sys

from flexdraft_jax.model.config import FlexDraftError

NAMES = ("target", "drafter", "topology", "batch_sizes", "max_len", "prompt_len", "modes",
         "attn_impl", "dtype", "train", "train_batch", "train_seq_len", "out")
DEFAULT_DRAFTER = "flexdraft_jax/drafters/smollm2_135m_L8"
DTYPES = ("bfloat16", "float32")


def _define_flags() -> tuple:
  from absl import flags
  for name in NAMES:
    if name in flags.FLAGS:
      delattr(flags.FLAGS, name)
  flags.DEFINE_string("target", "smollm2-135m", "builtin name, HF folder (or its "
                      "config.json: shapes are enough), .gguf file, or random:NAME")
  flags.DEFINE_string("drafter", None, "drafter folder, random:L=N,block=M, or none "
                      f"(default: {DEFAULT_DRAFTER} for the target it was made for, "
                      "else none)")
  flags.DEFINE_string("topology", "v5e:1x1", "TPU slice: v5e:AxB, v6e:AxB, v4:AxBxC, "
                      "v5p:AxBxC")
  flags.DEFINE_list("batch_sizes", ["1", "16"], "decode batch sizes")
  flags.DEFINE_integer("max_len", 2048, "KV-cache positions")
  flags.DEFINE_integer("prompt_len", 256, "prompt tokens prefill takes (padded to 64)")
  flags.DEFINE_string("modes", "ar,parallel:4,sequential:4,sequential:8,tree:16",
                      "decode chunks: ar, parallel:K, sequential:K, tree:N")
  flags.DEFINE_enum("attn_impl", "auto", ("auto", "pallas", "xla"),
                    "attention (auto: the Pallas kernels on a TPU)")
  flags.DEFINE_enum("dtype", "bfloat16", DTYPES, "the target's weights")
  flags.DEFINE_bool("train", True, "also the drafter's training step (needs a drafter)")
  flags.DEFINE_integer("train_batch", 8, "training step: sequences a batch")
  flags.DEFINE_integer("train_seq_len", 512, "training step: tokens a sequence")
  flags.DEFINE_string("out", None, "(required) a new folder for the report")
  return NAMES


def _batch_sizes(values) -> tuple:
  out = []
  for v in values:
    if not str(v).strip().isdigit() or int(v) < 1:
      raise FlexDraftError(f"--batch_sizes: {v!r} is not an integer >= 1")
    out.append(int(v))
  if not out:
    raise FlexDraftError("--batch_sizes is empty: e.g. 1,16")
  return tuple(dict.fromkeys(out))


def plan_from_flags():
  """The plan the flags ask for, every check that needs no compiler done (one
  line each); returns (plan, the --out folder, notes to print)."""
  from absl import flags
  from flexdraft_jax.aot import chips, programs, report
  F = flags.FLAGS
  out = report.check_out(F.out)
  topo = chips.parse_topology(F.topology)
  batches = _batch_sizes(F.batch_sizes)
  modes = programs.parse_modes(F.modes)
  for name in ("max_len", "prompt_len", "train_batch", "train_seq_len"):
    if F[name].value < 1:
      raise FlexDraftError(f"--{name} must be an integer >= 1, got {F[name].value}")
  target = programs.target_shape(F.target)
  spec, notes = F.drafter, []
  if spec is None:  # the shipped drafter where it fits the target, else AR only
    spec = DEFAULT_DRAFTER if _made_for(DEFAULT_DRAFTER, target) else "none"
    if spec == "none" and any(m.kind != "ar" for m in modes):
      modes = [m for m in modes if m.kind == "ar"] or [programs.ModeSpec("ar")]
      notes.append(f"{DEFAULT_DRAFTER} is not made for {target.name}: AR only (--drafter "
                   f"{programs.DEFAULT_RANDOM_DRAFTER} compiles the speculative modes)")
  drafter = programs.drafter_shape(spec, target)
  programs.check_modes(modes, drafter, target.config.vocab_size)
  _check_cache(target, drafter, modes, F.max_len, F.prompt_len)
  if F.train and drafter is not None and F.train_seq_len < drafter.config.block_size + 2:
    raise FlexDraftError(f"--train_seq_len={F.train_seq_len} is too short for the "
                         f"drafter's block of {drafter.config.block_size}")
  missing = programs.compiler_missing()  # last: every other mistake shows without it
  if missing:
    raise FlexDraftError(missing)
  plan = programs.Plan(target, drafter, topo, batches, modes, F.max_len, F.prompt_len,
                       F.attn_impl, F.dtype, F.train, F.train_batch, F.train_seq_len)
  return plan, out, notes


def _check_cache(target, drafter, modes, max_len: int, prompt_len: int) -> None:
  """The cache holds the prompt and a step's spare positions, and no more
  than the model's context needs (as `generate` checks `runtime.max_len`)."""
  from flexdraft_jax.decoding import capacity
  from flexdraft_jax.decoding.state import KV_BLOCK
  from flexdraft_jax.util import round_up
  bs = drafter.config.block_size if drafter is not None else 1
  spare = capacity.spare_positions(bs, max([m.k for m in modes if m.kind == "tree"],
                                           default=0))
  if prompt_len + spare >= max_len:
    raise FlexDraftError(f"--prompt_len={prompt_len} and {spare} spare positions for the "
                         f"decode steps leave no room to decode in --max_len={max_len}")
  ctx = target.config.max_position_embeddings
  most = round_up(ctx + spare, KV_BLOCK)
  if max_len > most:
    raise FlexDraftError(f"--max_len={max_len} is beyond {target.name}'s context of {ctx} "
                         f"(a cache of {most} holds every request)")


def _made_for(drafter_path: str, target) -> bool:
  from flexdraft_jax.drafter import checkpoint
  try:
    made = checkpoint.read_meta(drafter_path).get("target", {})
  except FlexDraftError:
    return False
  cfg = target.config
  return all(made.get(k) == getattr(cfg, k) for k in ("num_layers", "hidden_size",
                                                       "vocab_size"))


def main(argv) -> int:
  if len(argv) > 1:
    raise FlexDraftError(f"unexpected arguments: {' '.join(argv[1:])} (see --help)")
  import os

  import jax

  from flexdraft_jax import compile_cache
  plan, out, notes = plan_from_flags()
  if not os.environ.get("JAX_PLATFORMS"):  # the host compiles; it needs no accelerator
    jax.config.update("jax_platforms", "cpu")
  compile_cache.use_compile_cache("off")  # programs for a chip this machine lacks
  from flexdraft_jax.aot import programs, report
  log = lambda line: print(f"aot: {line}", file=sys.stderr, flush=True)
  for line in notes:
    log(line)
  log(f"compiling for {plan.topology.name}: {plan.target.name}, drafter "
      f"{plan.drafter.name if plan.drafter else 'none'}, batches "
      f"{','.join(map(str, plan.batch_sizes))}, modes {','.join(map(str, plan.modes))}")
  result = programs.compile_all(plan, log=log)
  json_path, md_path = report.write(out, result)
  print(report.markdown(result), end="")
  print(f"aot: report in {json_path} and {md_path}", file=sys.stderr)
  bad = report.problems(result["programs"])
  for line in bad:
    print(f"aot: {line}", file=sys.stderr)
  sys.exit(report.exit_status(result["programs"]))


def run(argv):
  """Entry from `python -m flexdraft_jax aot`."""
  from flexdraft_jax import cli_util
  names = _define_flags()
  cli_util.run_main(main, argv, doc=__doc__, key_flags=names)
