"""`python -m flexdraft_jax generate`: decode prompts from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from flexdraft_jax.model.config import FlexDraftError

PROMPT_KEYS = ("prompt", "question", "text", "problem")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m flexdraft_jax generate",
                              description="Generate with a target model, "
                              "optionally with a FlexDraft drafter (lossless).")
  p.add_argument("--model", default="smollm2-135m",
                 help="HF safetensors dir, .gguf file or builtin name")
  p.add_argument("--prompt", action="append", default=[], help="repeatable")
  p.add_argument("--prompts-file", help="JSONL: strings or objects with "
                 f"one of {PROMPT_KEYS}")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-k", type=int)
  p.add_argument("--top-p", type=float)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--chat", action="store_true", help="apply the chat template")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--drafter", help="drafter directory (needed by every mode but ar)")
  p.add_argument("--mode", default="ar", choices=("ar", "parallel", "sequential", "flex"))
  p.add_argument("--threshold", type=float, default=0.0,
                 help="selective-verification θ (0 keeps every group)")
  p.add_argument("--strategy", default="cumulative_product",
                 choices=("cumulative_product", "min_confidence"))
  p.add_argument("--flex-threshold", default="auto", help="B*: an integer or 'auto'")
  p.add_argument("--draft-sampling", action="store_true",
                 help="T>0: sample drafts and verify by rejection sampling")
  p.add_argument("--block-size", type=int, help="decode with a smaller block than trained")
  p.add_argument("--verify-len", type=int,
                 help="verify at most K-1 drafts per step (K <= block size; flex picks "
                      "K itself up to this)")
  p.add_argument("--cost-cache", default="default",
                 help="flex's step-cost file ('' keeps the costs in memory only)")
  p.add_argument("--batch-size", type=int)
  p.add_argument("--attention-impl", default="xla", choices=("xla", "pallas", "auto"))
  p.add_argument("--json", action="store_true", help="print one JSON object")
  return p


def _read_prompts_file(path: str) -> list:
  prompts = []
  try:
    with open(path) as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        rec = json.loads(line)
        if isinstance(rec, str):
          prompts.append(rec)
          continue
        key = next((k for k in PROMPT_KEYS if k in rec), None)
        if key is None:
          raise FlexDraftError(f"{path}:{n} has none of the keys {PROMPT_KEYS}")
        prompts.append(rec[key])
  except FileNotFoundError:
    raise FlexDraftError(f"prompts file not found: {path}") from None
  except json.JSONDecodeError as e:
    raise FlexDraftError(f"{path} is not valid JSONL: {e}") from None
  return prompts


def main(argv) -> int:
  args = _parser().parse_args(argv)
  import flexdraft_jax as fd  # heavy imports after argument checks

  prompts = list(args.prompt)
  if args.prompts_file:
    prompts += _read_prompts_file(args.prompts_file)
  if not prompts:
    raise FlexDraftError("no prompts: pass --prompt TEXT or --prompts-file F.jsonl")
  flex_threshold = args.flex_threshold
  if flex_threshold != "auto":
    try:
      flex_threshold = int(flex_threshold)
    except ValueError:
      raise FlexDraftError(f"--flex-threshold must be an integer or 'auto', "
                           f"got {flex_threshold!r}") from None
  target = fd.load_target(args.model, dtype=args.dtype, layout="layers")
  drafter = fd.load_drafter(args.drafter, target) if args.drafter else None
  result = fd.generate(
      target, prompts, max_new_tokens=args.max_new_tokens,
      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
      seed=args.seed, drafter=drafter, mode=args.mode, chat=args.chat,
      batch_size=args.batch_size, threshold=args.threshold,
      strategy=args.strategy, flex_threshold=flex_threshold,
      attn_impl=args.attention_impl, draft_sampling=args.draft_sampling,
      block_size=args.block_size, verify_len=args.verify_len,
      cost_cache=args.cost_cache)
  if args.json:
    print(json.dumps({
        "outputs": [{"prompt": p, "token_ids": t, "text": x}
                    for p, t, x in zip(prompts, result.token_ids, result.texts)],
        "stats": result.stats}))
  else:
    for p, x in zip(prompts, result.texts):
      print(f"### {p}\n{x}\n")
    s = result.stats
    print(f"[{s['mode']}] {s['new_tokens']} tokens in {s['decode_seconds']:.2f}s "
          f"({s['tokens_per_second']:.1f} tok/s), steps={s['steps']}, τ={s['tau']:.2f}",
          file=sys.stderr)
  return 0


def run(argv):
  """Entry from `python -m flexdraft_jax generate`; user errors are one line."""
  try:
    sys.exit(main(argv[1:]))
  except (FlexDraftError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
