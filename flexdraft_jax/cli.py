"""`python -m flexdraft_jax generate`: decode prompts from the command line."""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings

from flexdraft_jax.model.config import FlexDraftError, FlexDraftWarning

PROMPT_KEYS = ("prompt", "question", "text", "problem")


class _Parser(argparse.ArgumentParser):
  """argparse with a one-line error (no usage block)."""

  def error(self, message):
    raise FlexDraftError(f"{message} (see --help)")


def _stop_token(text: str):
  try:
    return int(text)
  except ValueError:
    return text


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def _flag_names(msg: str, names, lead: bool = True) -> str:
  """`msg` naming the flags, not the Python arguments: every `name=` or
  `group.name=` and (with `lead`) a leading `name ` become `--flag-name`."""
  for name in names:
    if lead and msg.startswith(name + " "):
      msg = _flag(name) + msg[len(name):]
    msg = re.sub(rf"(?<![\w.-])(?:\w+\.)?{name}=", _flag(name) + "=", msg)
  return msg


def _parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python -m flexdraft_jax generate",
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
  p.add_argument("--draft-dtype", default="auto", choices=("auto", "bfloat16", "target"),
                 help="the draft pass's matmul weights (auto: bfloat16 where the CPU "
                      "kernel runs; outputs are the target's either way)")
  p.add_argument("--cost-cache", default="default",
                 help="flex's step-cost file ('' keeps the costs in memory only)")
  p.add_argument("--batch-size", type=int,
                 help="prompts decoded together (>= 1; default: all in one batch)")
  p.add_argument("--stop", action="append", type=_stop_token,
                 help="a stop token: an id, or text that is one token (repeatable; "
                      "default: the model's EOS)")
  p.add_argument("--max-len", type=int,
                 help="KV-cache length (default: longest prompt + max new tokens + blocks)")
  p.add_argument("--attn-impl", "--attention-impl", dest="attn_impl", default="xla",
                 choices=("xla", "pallas", "auto"))
  p.add_argument("--json", action="store_true", help="print one JSON object")
  return p


# The flags that fill generate()'s option groups, named as their fields.
OPTION_FLAGS = ("temperature", "top_k", "top_p", "draft_sampling", "block_size",
                "verify_len", "threshold", "strategy", "flex_threshold", "draft_dtype",
                "cost_cache", "batch_size", "max_len", "attn_impl")


def _options(args) -> dict:
  """generate()'s mode, max_new_tokens, option groups and stop from the flags."""
  from flexdraft_jax.decoding import options
  from flexdraft_jax.decoding.sampling import SamplingParams
  return dict(
      mode=args.mode, max_new_tokens=args.max_new_tokens, stop=args.stop,
      sampling=SamplingParams(args.temperature, args.top_k, args.top_p,
                              args.draft_sampling),
      speculation=options.SpecOptions(
          block_size=args.block_size, verify_len=args.verify_len,
          threshold=args.threshold, strategy=args.strategy,
          flex_threshold=options.parse_flex_threshold(args.flex_threshold,
                                                      "--flex-threshold"),
          draft_dtype=args.draft_dtype, cost_cache=args.cost_cache),
      runtime=options.RuntimeOptions(batch_size=args.batch_size, max_len=args.max_len,
                                     attn_impl=args.attn_impl))


def _read_prompts_file(path: str) -> list:
  prompts = []
  try:
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        rec = json.loads(line)
        if not isinstance(rec, (str, dict)):
          raise FlexDraftError(f"{path}:{n} is a JSON {type(rec).__name__}: a line is a "
                               f"string or an object with one of the keys {PROMPT_KEYS}")
        if isinstance(rec, dict):
          key = next((k for k in PROMPT_KEYS if k in rec), None)
          if key is None:
            raise FlexDraftError(f"{path}:{n} has none of the keys {PROMPT_KEYS}")
          rec = rec[key]
          if not isinstance(rec, str):
            raise FlexDraftError(f"{path}:{n}: {key!r} must be a string, got "
                                 f"{type(rec).__name__} {json.dumps(rec)}")
        prompts.append(rec)
  except FileNotFoundError:
    raise FlexDraftError(f"prompts file not found: {path}") from None
  except IsADirectoryError:
    raise FlexDraftError(f"prompts file {path} is a directory") from None
  except UnicodeDecodeError as e:
    raise FlexDraftError(f"prompts file {path} is not UTF-8 text (byte {e.start})") from None
  except OSError as e:
    raise FlexDraftError(f"cannot read prompts file {path}: {e.strerror}") from None
  except json.JSONDecodeError as e:
    raise FlexDraftError(f"{path} is not valid JSONL: {e}") from None
  return prompts


def main(argv) -> int:
  args = _parser().parse_args(argv)
  prompts = list(args.prompt)
  if args.prompts_file:
    prompts += _read_prompts_file(args.prompts_file)
  if not prompts:
    raise FlexDraftError("no prompts: pass --prompt TEXT or --prompts-file F.jsonl")
  # Every check that needs no model runs before the (slow) model load.
  from flexdraft_jax.decoding import options
  names = OPTION_FLAGS + ("max_new_tokens", "stop")
  try:
    kw = _options(args)
    options.check_options(**kw)
  except FlexDraftError as e:
    raise FlexDraftError(_flag_names(str(e), names)) from None
  if args.mode != "ar":
    if not args.drafter:
      raise FlexDraftError(f"mode {args.mode!r} needs a drafter (--drafter PATH)")
    from flexdraft_jax.drafter import checkpoint
    checkpoint.read_meta(args.drafter)  # a missing or unreadable drafter: one line now
  for line in options.ignored_options(
      mode=kw["mode"], sampling=kw["sampling"], speculation=kw["speculation"],
      drafter=args.drafter, spell=_flag):
    print(f"warning: {line}", file=sys.stderr)
  from flexdraft_jax.model import loading
  if not loading.has_tokenizer(args.model):
    raise FlexDraftError(f"--model {args.model} has no tokenizer.json, and prompts on the "
                         "command line are text: add the tokenizer, or pass token ids "
                         "to generate() in Python")
  import flexdraft_jax as fd  # heavy imports after argument checks

  target = fd.load_target(args.model, dtype=args.dtype, layout="layers")
  drafter = fd.load_drafter(args.drafter, target) if args.mode != "ar" else None
  with warnings.catch_warnings():  # printed above, once
    warnings.simplefilter("ignore", FlexDraftWarning)
    try:
      result = fd.generate(target, prompts, seed=args.seed, drafter=drafter,
                           chat=args.chat, **kw)
    except FlexDraftError as e:
      raise FlexDraftError(_flag_names(str(e), names, lead=False)) from None
  if args.json:
    print(json.dumps({
        "outputs": [{"prompt": p, "token_ids": t, "text": x}
                    for p, t, x in zip(prompts, result.token_ids, result.texts)],
        "stats": result.stats}))
  else:
    for p, x in zip(prompts, result.texts):
      print(f"### {p}\n{x}\n")
    s = result.stats
    left_out = s["compile_seconds"] + s["flex_timing_seconds"]
    print(f"[{s['mode']}] {s['new_tokens']} tokens, decode {s['decode_seconds']:.2f}s "
          f"({s['tokens_per_second']:.1f} tok/s), steps={s['steps']}, τ={s['tau']:.2f}"
          + (f"; {left_out:.1f}s compiling/timing steps not counted" if left_out >= 0.05
             else ""), file=sys.stderr)
  return 0


def run(argv):
  """Entry from `python -m flexdraft_jax generate`; user errors are one line."""
  try:
    sys.exit(main(argv[1:]))
  except (FlexDraftError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
