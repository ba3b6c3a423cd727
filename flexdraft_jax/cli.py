"""`python -m flexdraft_jax generate`: decode prompts from the command line.

  python -m flexdraft_jax generate --model smollm2-135m --chat --prompt "What is 7 * 8?" \\
      --drafter flexdraft_jax/drafters/smollm2_135m_L8 --mode flex --json

Each flag is a generate() option: `--max-new-tokens` is `max_new_tokens`,
`--verify-len` is `speculation.verify_len`. Switches: `--chat`, `--json`,
`--stream` (each row's text as it is decided), `--draft-sampling`. Bad input
prints one `error: …` line before the model loads. Compiled programs are kept
between runs (`--compile_cache`). The last line gives the command's seconds
since it started, in parts that add up: startup (imports), load, compile
(programs compiled, and loaded from the cache), flex timing its steps,
prefill, decode, other.
"""

from __future__ import annotations

import json
import re
import sys
import time
import warnings

from absl import flags

from flexdraft_jax import cli_util
from flexdraft_jax.decoding import capacity, options, timing
from flexdraft_jax.decoding.verify import STRATEGIES
from flexdraft_jax.model.config import FlexDraftError, FlexDraftWarning

PROG = "python -m flexdraft_jax generate"


# When the command started: the process's start, imports included.
STARTED = [timing.process_started()]
PROMPT_KEYS = ("prompt", "question", "text", "problem")


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


FLAGS = (  # (absl DEFINE_*, name as generate() spells it, default, help[, enum values])
    ("string", "model", "smollm2-135m", "HF safetensors dir, .gguf file or builtin name"),
    ("multi_string", "prompt", [], "a prompt (repeatable)"),
    ("string", "prompts_file", None,
     f"JSONL: strings or objects with one of {PROMPT_KEYS}"),
    ("integer", "max_new_tokens", 128, "tokens to generate per prompt"),
    ("float", "temperature", 0.0, "sampling temperature (0: greedy; else >= 1e-6)"),
    ("integer", "top_k", None, "sample from the k most likely tokens"),
    ("float", "top_p", None, "sample from the smallest set with this much mass"),
    ("integer", "seed", 0, "the sampling seed"),
    ("bool", "chat", False, "apply the chat template"),
    ("enum", "dtype", "float32", "the target's weights", ("float32", "bfloat16")),
    ("string", "drafter", None, "drafter directory (needed by every mode but ar)"),
    ("string", "parallel_drafter", None,
     "a second drafter directory, trained blind, for parallel steps (parallel, flex)"),
    ("enum", "mode", options.Mode.AR.value, "the decoding mode", options.MODES),
    ("float", "threshold", 0.0, "selective-verification θ (0 keeps every group)"),
    ("enum", "strategy", "cumulative_product", "selective verification's confidence",
     STRATEGIES),
    ("string", "flex_threshold", "auto", "B*: an integer or 'auto'"),
    ("bool", "draft_sampling", None, "T>0: sample drafts and verify by rejection sampling "
     "(default: on, off with --tree-budget)"),
    ("integer", "block_size", None, "decode with a smaller block than trained"),
    ("integer", "verify_len", None,
     "verify at most K-1 drafts per step (K <= block size; flex picks K itself up to this)"),
    ("integer", "tree_budget", None,
     "sequential (and flex's) steps verify a draft tree of N nodes (unset: a chain)"),
    ("enum", "draft_dtype", "auto", "the draft pass's matmul weights (auto: bfloat16 where "
     "the CPU kernel runs; outputs are the target's either way)",
     options.DRAFT_DTYPES),
    ("string", "cost_cache", "default",
     "flex's step-cost file ('' keeps the costs in memory only)"),
    ("integer", "batch_size", None,
     "prompts decoded together (>= 1; default: all in one batch)"),
    ("multi_string", "stop", None, "a stop token: an id, or text that is one token "
     "(repeatable; default: the model's EOS)"),
    ("integer", "max_len", None,
     "KV-cache length (default: longest prompt + max new tokens + blocks)"),
    ("enum", "attn_impl", "xla", "attention kernels", options.ATTN_IMPLS),
    ("bool", "json", False, "print one JSON object"),
    ("bool", "stream", False, "print each row's text as its tokens are decided"),
)


def define_flags() -> None:
  """(Re)defines generate's flags on absl's FLAGS, at their defaults (a
  process may run several commands)."""
  names = [_flag(f[1])[2:] for f in FLAGS] + ["attention-impl"]
  for name in names:
    if name in flags.FLAGS:
      delattr(flags.FLAGS, name)
  for kind, name, default, help_, *values in FLAGS:
    define = getattr(flags, f"DEFINE_{kind}")
    if values:
      define(_flag(name)[2:], default, values[0], help_)
    else:
      define(_flag(name)[2:], default, help_)
  flags.DEFINE_alias("attention-impl", "attn-impl")


class _Args:
  """The parsed flags by generate()'s names: `args.max_new_tokens`."""

  def __getattr__(self, name):
    return flags.FLAGS[_flag(name)[2:]].value


# The flags that fill generate()'s option groups, named as their fields.
OPTION_FLAGS = ("temperature", "top_k", "top_p", "draft_sampling", "block_size",
                "verify_len", "threshold", "strategy", "flex_threshold", "draft_dtype",
                "cost_cache", "batch_size", "max_len", "attn_impl", "tree_budget")


def _options(args) -> dict:
  """generate()'s mode, max_new_tokens, option groups and stop from the flags."""
  from flexdraft_jax.decoding.sampling import SamplingParams
  stop = None if args.stop is None else [_stop_token(s) for s in args.stop]
  return dict(
      mode=args.mode, max_new_tokens=args.max_new_tokens, stop=stop,
      sampling=SamplingParams(args.temperature, args.top_k, args.top_p,
                              args.draft_sampling),
      speculation=options.SpecOptions(
          block_size=args.block_size, verify_len=args.verify_len,
          threshold=args.threshold, strategy=args.strategy,
          flex_threshold=options.parse_flex_threshold(args.flex_threshold,
                                                      "--flex-threshold"),
          draft_dtype=args.draft_dtype, cost_cache=args.cost_cache,
          tree_budget=args.tree_budget),
      runtime=options.RuntimeOptions(batch_size=args.batch_size, max_len=args.max_len,
                                     attn_impl=args.attn_impl))


def _read_prompts_file(path: str) -> list:
  """[(line number, prompt)] of a JSONL prompts file."""
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
        prompts.append((n, rec))
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
  """Generates for the flags in `argv` (no program name); bad input raises
  FlexDraftError."""
  define_flags()
  cli_util.define_compile_cache_flag()
  try:
    rest = flags.FLAGS([PROG] + list(argv))
  except flags.Error as e:
    raise FlexDraftError(f"{e} (see --help)") from None
  return _main(rest)


def _main(rest) -> int:
  if len(rest) > 1:
    raise FlexDraftError(f"unexpected arguments: {' '.join(rest[1:])} (see --help)")
  args = _Args()
  prompts = list(args.prompt)
  # where each prompt came from, as an error names it
  origins = (["the prompt"] if len(prompts) == 1 else
             [f"--prompt number {k}" for k in range(1, len(prompts) + 1)])
  if args.prompts_file:
    lines = _read_prompts_file(args.prompts_file)
    prompts += [p for _, p in lines]
    origins += [f"the prompt on {args.prompts_file}:{n}" for n, _ in lines]
  if not prompts:
    raise FlexDraftError("no prompts: pass --prompt TEXT or --prompts-file F.jsonl")
  if args.stream and args.json:
    raise FlexDraftError("--stream prints the text as it comes, --json one object at the "
                         "end: pass one of them")
  # Every check that needs no model runs before the (slow) model load.
  names = OPTION_FLAGS + ("max_new_tokens", "stop", "seed")
  try:
    kw = _options(args)
    mode = options.check_options(**kw, seed=args.seed)
  except FlexDraftError as e:
    raise FlexDraftError(_flag_names(str(e), names)) from None
  if mode != options.Mode.AR:
    if not args.drafter:
      raise FlexDraftError(f"mode {args.mode!r} needs a drafter (--drafter PATH)")
    from flexdraft_jax.drafter import checkpoint
    checkpoint.read_meta(args.drafter)  # a missing or unreadable drafter: one line now
    if args.parallel_drafter:
      checkpoint.read_meta(args.parallel_drafter)
  for line in options.ignored_options(
      mode=kw["mode"], sampling=kw["sampling"], speculation=kw["speculation"],
      drafter=args.drafter, parallel_drafter=args.parallel_drafter, spell=_flag):
    print(f"warning: {line}", file=sys.stderr)
  from flexdraft_jax.drafter.checkpoint import drafter_folder_target
  from flexdraft_jax.model import loading
  made_for = drafter_folder_target(args.model)
  if made_for is not None:
    raise FlexDraftError(f"--model {args.model} is a drafter folder (it holds drafter.json), "
                         f"not a target: pass it as --drafter {args.model}, with --model the "
                         "target it was made for" + (f" ({made_for})" if made_for else "")
                         + " and a speculative --mode (flex, say)")
  if not loading.has_tokenizer(args.model):
    raise FlexDraftError(f"--model {args.model} has no tokenizer.json, and prompts on the "
                         "command line are text: add the tokenizer, or pass token ids "
                         "to generate() in Python")
  import flexdraft_jax as fd  # heavy imports after argument checks

  loading_started = time.time()
  target = fd.load_target(args.model, dtype=args.dtype, layout="layers")
  drafter = fd.load_drafter(args.drafter, target) if mode != options.Mode.AR else None
  parallel_drafter = (fd.load_drafter(args.parallel_drafter, target)
                      if args.parallel_drafter and mode in (options.Mode.PARALLEL,
                                                            options.Mode.FLEX) else None)
  loaded = time.time()
  with warnings.catch_warnings():  # printed above, once
    warnings.simplefilter("ignore", FlexDraftWarning)
    try:
      call = dict(seed=args.seed, drafter=drafter, parallel_drafter=parallel_drafter,
                  chat=args.chat, **kw)
      if args.stream:
        result = _stream(fd.generate_stream(target, prompts, **call), prompts)
      else:
        result = fd.generate(target, prompts, **call)
    except capacity.PromptDoesNotFit as e:  # named as the command line gave it
      flagged = capacity.PromptDoesNotFit(_flag_names(e.template, names, lead=False), e.index)
      raise FlexDraftError(flagged.named(origins[e.index])) from None
    except FlexDraftError as e:
      raise FlexDraftError(_flag_names(str(e), names, lead=False)) from None
  times = command_times(result.stats, loading_started, loaded)
  if args.json:
    print(json.dumps({
        "outputs": [{"prompt": p, "token_ids": t, "text": x}
                    for p, t, x in zip(prompts, result.token_ids, result.texts)],
        "stats": result.stats, "command_seconds": times}))
  else:
    if not args.stream:
      for p, x in zip(prompts, result.texts):
        print(f"### {p}\n{x}\n")
    s = result.stats
    print(f"[{s['mode']}] {s['new_tokens']} tokens, decode {s['decode_seconds']:.2f}s "
          f"({s['tokens_per_second']:.1f} tok/s), steps={s['steps']}, τ={s['tau']:.2f}\n"
          + times_line(times, s), file=sys.stderr)
  return 0


def _stream(stream, prompts):
  """Prints each row's text as it comes (a `### prompt` line where the row
  changes); returns the GenerateResult."""
  last = None
  for piece in stream:
    if piece.row != last:
      print(("\n\n" if last is not None else "") + f"### {prompts[piece.row]}", flush=True)
      last = piece.row
    print(piece.text, end="", flush=True)
  print("\n", flush=True)
  return stream.result


def command_times(stats: dict, loading_started: float, loaded: float) -> dict:
  """The command's seconds since it started, in parts that add up to it:
  startup (imports, checks), loading the model and drafters, and generate's
  parts (`stats`); what came after generate (printing) goes to `other`."""
  end = time.time()
  total = end - STARTED[0]
  out = {"seconds": total, "startup": loading_started - STARTED[0],
         "load": loaded - loading_started}
  for k in ("compile", "flex_timing", "prefill", "decode"):
    out[k] = stats[f"{k}_seconds"]
  out["other"] = max(total - sum(v for k, v in out.items() if k != "seconds"), 0.0)
  return out


def times_line(times: dict, stats: dict) -> str:
  """The command's time and its parts, one line."""
  cache = stats.get("compile_cache")
  compiled = (f" ({stats['programs_compiled']} programs compiled, "
              f"{stats['programs_from_cache']} loaded from "
              + (f"the cache {cache})" if cache else "no cache: off)"))
  return (f"{times['seconds']:.1f}s in all: startup {times['startup']:.1f}s, load "
          f"{times['load']:.1f}s, compile {times['compile']:.1f}s{compiled}, "
          + (f"flex timing steps {times['flex_timing']:.1f}s, "
             if times["flex_timing"] >= 0.05 else "")
          + f"prefill {times['prefill']:.2f}s, decode {times['decode']:.2f}s, other "
          f"{times['other']:.1f}s")


def run(argv):
  """Entry from `python -m flexdraft_jax generate`; user errors are one line."""
  define_flags()
  cli_util.run_main(_main, argv, doc=__doc__, key_flags=[_flag(f[1])[2:] for f in FLAGS])
