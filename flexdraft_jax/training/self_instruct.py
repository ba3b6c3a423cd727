"""`python -m flexdraft_jax self-instruct`: the target writes chat-style user
questions on many topics, a prompt source (`self_instruct`) for `regenerate`.

  python -m flexdraft_jax self-instruct --config configs/smollm2_135m.py --num=2000
  python -m flexdraft_jax regenerate --config configs/smollm2_135m.py \\
      --config.data.mix.self_instruct=2000

For each candidate (a topic seed from `TOPICS`, a style from `STYLES` and one
of its openers) the target gets the style's instruction through its chat
template, its answer already begun with the opener inside a quote
(`Here is such a request: "Compare`), and samples the rest
(`config.data.self_instruct`: temperature, top_p, max_new_tokens, seed).
`clean_question` keeps the quoted question when it is one sensible line on
its topic; exact and reordered duplicates are dropped, and so is anything
close to an MT-Bench question (`config.data.self_instruct.mt_bench`, an
evaluation set that is never trained on; a missing file skips that filter
with a note).

The questions go to `config.data.paths.self_instruct` (or --out) as JSON
lines: uid, source, question, topic, style, opener, candidate and the
generation settings. The file is the same for a given seed, target and
settings; candidates are sampled in fixed batches, so a larger --num extends
a file (its first questions stay as they are) and an interrupted run resumes.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Iterable, NamedTuple, Optional

import numpy as np

from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.training.self_instruct_topics import STYLES, TOPICS

SOURCE = "self_instruct"

# Words too common to tell questions apart (for duplicates and MT-Bench overlap).
_STOP = frozenset("""a an the and or but if of to in on at by for with about from into
as is are was were be been being am do does did doing have has had can could would
should will shall may might must you your yours i me my we our us it its this that
these those there their they them he she his her him what which who whom whose why
how when where not no yes so than then too very just also please some any more most
other such own same only one two""".split())
_META = ("ai assistant", "a user might", "such a request", "such a question",
         "here is a", "here's a", "this question", "this request", "as an ai",
         "i'm here to", "i am here to", "i'm ready", "rhetorical", "step-by-step reasoning",
         "play a role", "asking it to",
         "user's request", "user:", "assistant:", "the following", "below", "[")
_META_WORDS = re.compile(r"\b(?:the|an|ai) ai\b")  # the model speaking of itself
# A word again one word later ("support and support", "DIY DIY"; not "step by step").
_REPEAT = re.compile(r"\b(\w{3,})(?:\W+(?!by\b|to\b)\w+)?\W+\1\b", re.IGNORECASE)
# Openers that start a question: what follows must ask something (hold a "?").
_ASKING = frozenset("How What Why Which When Should Is Can Could".split())
_LABEL = re.compile(r"^\s*(?:(?:question|request|user|prompt|query|q)\s*[:\-]|\d+[.)]|[-*•])\s*",
                    re.IGNORECASE)
_CLOSE = re.compile(r"(?<=[?.!])\"|\"\s*(?:\n|$)")
MIN_WORDS, MAX_WORDS, MAX_CHARS = 4, 60, 300
MAX_PROMPT_TOKENS = 256
# Batches in a row without a new question after which sampling gives up: a
# target that does not write the questions asked for would loop for ever.
MAX_BARREN_BATCHES = 20


def content_words(text: str) -> frozenset:
  """The lower-cased words of `text` that carry meaning (no stop words, > 2 letters)."""
  return frozenset(w for w in re.findall(r"[a-z0-9']+", text.lower())
                   if len(w) > 2 and w not in _STOP)


def _on_topic(question: str, topic: str) -> bool:
  """Whether the question names its topic: a topic word's first 4 letters
  start one of its words (`bake` meets `baking`)."""
  words = re.findall(r"[a-z0-9]+", question.lower())
  stems = [w[:4] for w in content_words(topic)] or [""]
  return any(w.startswith(s) for s in stems for w in words)


def clean_question(text: str, topic: str = "", asking: bool = False) -> Optional[str]:
  """The user question in a sampled answer (opener included), or None when
  there is none: the text up to the quote that closes it (else its first
  line), label and quotes stripped, cut after its last full sentence; it must
  end with ? . or !, hold MIN_WORDS..MAX_WORDS words (<= MAX_CHARS chars),
  not talk about the instruction itself, given a `topic` name it, and with
  `asking` hold a question mark."""
  t = text.replace("\r", "")
  m = _CLOSE.search(t)
  t = t[:m.start()] if m else t.split("\n", 1)[0]
  t = t.split("\n", 1)[0]
  while (s := _LABEL.sub("", t, count=1)) != t:
    t = s
  t = " ".join(t.strip().strip("\"'*`“”").split())
  ends = [i for i, c in enumerate(t) if c in "?.!" and (i + 1 == len(t) or t[i + 1] == " ")]
  if not ends:
    return None
  t = t[:ends[-1] + 1]
  low = t.lower()
  if (not MIN_WORDS <= len(t.split()) <= MAX_WORDS or len(t) > MAX_CHARS
      or not t[0].isalpha() or not t[0].isupper() or "\ufffd" in t or "```" in t
      or "http" in low or any(m in low for m in _META) or _META_WORDS.search(low)
      or _REPEAT.search(t)
      or sum(not c.isascii() for c in t) > 0.1 * len(t)):
    return None
  if (topic and not _on_topic(t, topic)) or (asking and "?" not in t):
    return None
  return t


def near(words: frozenset, other: frozenset) -> bool:
  """Near-duplicates by content words: Jaccard >= 0.5, or >= 4 shared words
  that are >= 75 % of the shorter one's."""
  shared = len(words & other)
  if not shared:
    return False
  return (shared / len(words | other) >= 0.5
          or shared >= 4 and shared >= 0.75 * min(len(words), len(other)))


def read_avoid(path: str) -> list:
  """Content-word sets of every turn of an MT-Bench style file (JSON lines with
  `turns`); [] and a printed note when `path` is empty or missing."""
  if not path or not os.path.isfile(path):
    print(f"self-instruct: no MT-Bench file at {path!r} (config.data.self_instruct."
          "mt_bench): questions are not checked against it", flush=True)
    return []
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [w for r in rows for turn in r.get("turns", []) if (w := content_words(turn))]


class Candidate(NamedTuple):
  index: int
  topic: str
  style: str
  opener: str


def candidates(seed: int, start: int = 0) -> Iterable[Candidate]:
  """Candidates `start`, `start + 1`, ...: every (topic, style, opener) once in
  a seeded order, then again in another order (sampling differs each pass)."""
  combos = [(t, s, o) for t in TOPICS for s, st in STYLES.items() for o in st.openers]
  k = start
  while True:
    cycle, pos = divmod(k, len(combos))
    order = np.random.default_rng([seed, cycle]).permutation(len(combos))
    for p in order[pos:]:
      yield Candidate(k, *combos[p])
      k += 1


def question_of(cand: Candidate, text: str) -> Optional[str]:
  """The question a candidate's sampled continuation `text` makes, or None."""
  if text[:1] not in (" ", ",", "'", "?"):  # "List" -> "Listing", "List-B": no request
    return None
  asking = cand.style in ("ask", "reason") or cand.opener.split()[0] in _ASKING
  return clean_question(cand.opener + text, cand.topic, asking=asking)


def candidate_ids(tokenizer, cand: Candidate, chat_kwargs: dict) -> list:
  """The target's input for one candidate: the instruction through the chat
  template, then the answer begun (lead + opener)."""
  from flexdraft_jax.training.regenerate import prompt_ids
  style = STYLES[cand.style]
  ids = prompt_ids(tokenizer, style.instruction.format(topic=cand.topic), chat_kwargs)
  lead = style.lead.format(topic=cand.topic) + cand.opener
  return ids + [int(t) for t in tokenizer.encode(lead, add_special_tokens=False)]


def _batch_seed(seed: int, batch: int) -> int:
  from flexdraft_jax.training.prompt_mix import stable_int
  return stable_int(f"{SOURCE}:{seed}:{batch}") & 0x7FFFFFFF


def settings(config, target=None) -> dict:
  """The generation settings a file's questions were made with (without
  `target`: those the config says, checked before the model loads)."""
  sc = config.data.self_instruct
  made_by = ({"target": target.name, "target_fingerprint": target.fingerprint}
             if target is not None else {})
  return {**made_by, "seed": int(sc.seed), "temperature": float(sc.temperature),
          "top_p": float(sc.top_p), "max_new_tokens": int(sc.max_new_tokens),
          "batch_size": int(sc.batch_size), "chat_kwargs": dict(config.data.chat_kwargs),
          "mt_bench_filter": bool(sc.mt_bench and os.path.isfile(sc.mt_bench)),
          "dtype": str(config.dtype)}


# Settings files made before they were recorded lack: not compared there.
RECORDED_LATER = ("dtype",)


def check_settings(out: str, rows: list, gen: dict) -> None:
  """Refuses (one line naming the setting) to extend `rows`, the questions in
  `out`, with questions of other settings `gen`."""
  if not rows:
    return
  made = rows[0].get("generation") or {}
  for key, value in gen.items():
    if key in RECORDED_LATER and key not in made:
      continue
    if made.get(key) != value:
      raise FlexDraftError(f"{out} holds questions made with {key}={made.get(key)!r}, not "
                           f"{value!r}; use another --out")


def make_questions(target, num: int, gen: dict, *, avoid=(), rows=(), chat_kwargs=None,
                   max_batches: int = 0, on_batch=None,
                   max_barren: int = MAX_BARREN_BATCHES) -> list:
  """`rows` (earlier questions of the same `gen` settings) followed by new ones
  until there are `num`; `avoid`: content-word sets no question may be near.
  Candidates are sampled `gen["batch_size"]` at a time (batch b with seed
  `_batch_seed(seed, b)`), so the rows are the same however often a run is
  resumed. `on_batch(rows, seconds)` after each batch; `max_batches` > 0
  stops after that many new batches. `max_barren` batches in a row that add
  no question stop it with a FlexDraftError (the rows so far were given to
  `on_batch`)."""
  from flexdraft_jax.decoding.engine import generate
  from flexdraft_jax.decoding.options import RuntimeOptions
  from flexdraft_jax.decoding.sampling import SamplingParams
  from flexdraft_jax.util import round_up
  rows, bs = list(rows), gen["batch_size"]
  seen = {content_words(r["question"]) for r in rows}
  last = rows[-1]["candidate"] if rows else -1
  batch = (last + 1) // bs if rows else 0
  if rows and last % bs != bs - 1:
    batch = last // bs  # redo the batch the file ends in: candidates after `last`
  max_len = round_up(MAX_PROMPT_TOKENS + gen["max_new_tokens"], 64)
  stream = candidates(gen["seed"], batch * bs)
  done = barren = 0
  while len(rows) < num and not (max_batches and done >= max_batches):
    before = len(rows)
    chunk = [next(stream) for _ in range(bs)]
    ids = [candidate_ids(target.tokenizer, c, chat_kwargs or {}) for c in chunk]
    if max(map(len, ids)) > MAX_PROMPT_TOKENS:  # one cache size: one compile
      raise FlexDraftError(f"a self-instruct prompt is over {MAX_PROMPT_TOKENS} tokens")
    t0 = time.perf_counter()
    res = generate(target, ids, max_new_tokens=gen["max_new_tokens"],
                   sampling=SamplingParams(temperature=gen["temperature"], top_p=gen["top_p"]),
                   runtime=RuntimeOptions(batch_size=bs, max_len=max_len),
                   seed=_batch_seed(gen["seed"], batch))
    dt = time.perf_counter() - t0
    for c, text in zip(chunk, res.texts):
      if c.index <= last or len(rows) >= num:
        continue
      q = question_of(c, text)
      words = content_words(q or "")
      if not q or words in seen or any(near(words, a) for a in avoid):
        continue
      seen.add(words)
      rows.append({"uid": f"{SOURCE}:{gen['seed']}-{c.index:06d}", "source": SOURCE,
                   "question": q, "topic": c.topic, "style": c.style,
                   "opener": c.opener, "candidate": c.index, "generation": gen})
    batch, done = batch + 1, done + 1
    if on_batch:
      on_batch(rows, dt)
    barren = barren + 1 if len(rows) == before else 0
    if barren >= max_barren:
      raise FlexDraftError(
          f"self-instruct gave up: {barren} batches in a row ({barren * bs} candidates) "
          f"made no acceptable question ({len(rows)}/{num} made); the target does not "
          "write the questions asked for (try another target, or "
          "--config.data.self_instruct.temperature)")
  return rows


def read_questions(path: str) -> list:
  if not os.path.isfile(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def write_questions(path: str, rows: list) -> None:
  """Writes the rows as JSON lines, atomically (no failure leaves the
  temporary file)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  try:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      for r in rows:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)
  except BaseException:
    if os.path.isfile(path + ".tmp"):
      os.remove(path + ".tmp")
    raise


def check_out(out: str, flag: str = "--out") -> None:
  """The question file must be a file (or not there yet): one line before
  anything is sampled."""
  if os.path.isdir(out):
    raise FlexDraftError(f"{flag} {out} is a directory: pass the path of the question "
                         f"file (JSON lines), e.g. {os.path.join(out, 'questions.jsonl')}")
  parent = os.path.dirname(os.path.abspath(out))
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise FlexDraftError(f"{flag} {out}: a file is in the way ({parent} is not a "
                         "directory)")


def self_instruct(config, num: int, out: str = "") -> dict:
  """Makes (or extends) the question file `out` (default
  `config.data.paths.self_instruct`) to `num` questions; returns counts."""
  from flexdraft_jax.model import loading
  check_out(out or config.data.paths[SOURCE],
            "--out" if out else "--config.data.paths.self_instruct")
  out = out or config.data.paths[SOURCE]
  sc = config.data.self_instruct
  avoid = read_avoid(sc.mt_bench)
  rows = read_questions(out)
  check_settings(out, rows, settings(config))  # other settings: one line before the load
  target = loading.load_target(config.target, config.dtype)
  gen = settings(config, target)
  check_settings(out, rows, gen)
  if len(rows) >= num:
    print(f"self-instruct: {out} holds {len(rows)} questions already (>= --num={num})",
          flush=True)
    return {"out": out, "questions": len(rows), "new": 0}
  print(f"self-instruct: {len(rows)} questions in {out}, making {num - len(rows)} more "
        f"with {target.name}", flush=True)
  tried = {"batches": 0, "seconds": 0.0}

  def on_batch(new_rows, seconds):
    tried["batches"] += 1
    tried["seconds"] += seconds
    write_questions(out, new_rows)
    print(f"self-instruct: {len(new_rows)}/{num} questions ({seconds:.1f}s a batch)",
          flush=True)

  before = len(rows)
  first = rows[-1]["candidate"] + 1 if rows else 0
  try:
    rows = make_questions(target, num, gen, avoid=avoid, rows=rows,
                          chat_kwargs=dict(config.data.chat_kwargs), on_batch=on_batch)
  except FlexDraftError as e:
    raise FlexDraftError(f"{e}; the questions made are in {out}") from None
  write_questions(out, rows)
  made = len(rows) - before
  seen = rows[-1]["candidate"] + 1 - first if made else tried["batches"] * gen["batch_size"]
  stats = {"out": out, "questions": len(rows), "new": made, "candidates": seen,
           "kept": round(made / seen, 3) if seen else None,
           "seconds": round(tried["seconds"], 1),
           "questions_per_s": round(made / tried["seconds"], 3) if tried["seconds"] else None}
  print(json.dumps(stats), flush=True)
  return stats


def run(argv):
  """Entry from `python -m flexdraft_jax self-instruct`."""
  from absl import flags

  from flexdraft_jax import cli_util
  for name in ("num", "out"):
    if name in flags.FLAGS:
      delattr(flags.FLAGS, name)
  cli_util.define_flags(argv, workdir=False)
  flags.DEFINE_integer("num", 0, "(required) questions the file should hold")
  flags.DEFINE_string("out", "", "the question file (default: config.data.paths."
                      "self_instruct, where regenerate reads it)")

  def main(args):
    if len(args) > 1:
      raise FlexDraftError(f"unexpected arguments: {' '.join(args[1:])}")
    config = cli_util.load_config("configs/smollm2_135m.py")
    if flags.FLAGS.num < 1:
      raise FlexDraftError("--num must be >= 1 (questions the file should hold)")
    self_instruct(config, flags.FLAGS.num, flags.FLAGS.out)

  cli_util.run_main(main, argv, doc=__doc__, key_flags=("config", "num", "out"))
