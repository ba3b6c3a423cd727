"""Self-instruct questions: cleaning, duplicates, the MT-Bench filter, the
sampler's determinism on the tiny random target, and regenerate answering them."""

from __future__ import annotations

import json
import os

import pytest

from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.training import prompt_mix, regen_store, regenerate, self_instruct as si
from tests import tiny

GEN = {"seed": 0, "temperature": 0.9, "top_p": 0.95, "max_new_tokens": 8, "batch_size": 4}


@pytest.fixture(scope="module")
def target():
  return tiny.tiny_target()


@pytest.mark.parametrize("raw, topic, want", [
    ("How do I bake bread at home?", "baking bread", "How do I bake bread at home?"),
    # the quote the lead opened closes the question; commentary after it goes
    ('What is the French Revolution and why did it start?"\n\nThis question asks',
     "the French Revolution", "What is the French Revolution and why did it start?"),
    ("Question: Can you explain how vaccines train the immune system?", "vaccines",
     "Can you explain how vaccines train the immune system?"),
    ('1. "Write a short poem about rainbows."', "", "Write a short poem about rainbows."),
    # cut after the last full sentence (the answer ran out of tokens)
    ("Write a recipe for a quick soup. Please include a list of spices and",
     "making soup", "Write a recipe for a quick soup."),
    ("Which  is better,\n tea or coffee?", "", None),           # first line only
    ("How do you make it perfect?", "cooking pasta", None),     # not on its topic
    ("How do I start a small business without a plan", "", None),  # no sentence end
    ("Why?", "", None),                                         # too short
    ("What " + "very " * 70 + "long question?", "", None),     # too long
    ("What a great question a user might ask an AI assistant about sleep?", "", None),
    ("Help me plan\n\nHere is a plan: 1. wake up.", "", None),
    ("What does ```print(x)``` do in Python?", "", None),
    ("what is a prime number?", "", None),                      # not a capital start
    ("Pretend you are an AI, and help a grieving friend.", "", None),
    ("Draft an email to [company_name] about my order.", "", None),  # a placeholder
    ("Summarize the text below in two sentences.", "", None),   # text it never saw
    ("Make a plan to support and support all users.", "", None),  # a loop
    ("Explain step by step how to bake bread.", "", "Explain step by step how to bake bread."),
    ("Suppose I cut my hand. Can you help me with a question that requires careful "
     "step-by-step reasoning?", "", None),                      # the instruction echoed
])
def test_clean_question(raw, topic, want):
  assert si.clean_question(raw, topic) == want


def test_a_question_opener_must_ask():
  told = "Suppose I have 12 apples and give away 5. Then I buy 3 more."
  assert si.clean_question(told) == told
  assert si.clean_question(told, asking=True) is None
  assert si.clean_question(told[:-1] + ", how many do I have?", asking=True)
  reason = si.Candidate(0, "fractions", "reason", "Suppose")
  assert si.question_of(reason, " I cut a pizza into fractions: 3/8 and 1/4.") is None
  assert si.question_of(reason, " I eat 3/8 of a pizza; what fraction is left?") == (
      "Suppose I eat 3/8 of a pizza; what fraction is left?")
  listing = si.Candidate(0, "board games", "list", "List")
  assert si.question_of(listing, "ing board games is fun.") is None
  assert si.question_of(listing, "-B: board games are fun.") is None
  what = si.Candidate(0, "board games", "ask", "What")
  assert si.question_of(what, "'s a good board game for four?") == (
      "What's a good board game for four?")
  assert si.question_of(listing, " three board games for a family night.") == (
      "List three board games for a family night.")


def test_near_duplicates_by_content_words():
  w = si.content_words
  assert w("How do I bake bread?") == w("Bread: how do I bake it?")
  hawaii = w("Compose an engaging travel blog post about a recent trip to Hawaii, "
             "highlighting cultural experiences and must-see attractions.")
  assert si.near(w("Write a travel blog post about my trip to Hawaii."), hawaii)
  assert not si.near(w("How do I write a blog post?"), hawaii)
  assert not si.near(w("What are black holes made of?"), hawaii)


def _cleaner(question):
  """Stands in for question_of (the random target writes no questions)."""
  return lambda cand, text: question(text, cand.topic)


def test_sampling_is_deterministic_and_resumes(target, monkeypatch):
  raw = []
  monkeypatch.setattr(si, "question_of",
                      _cleaner(lambda text, topic: raw.append(text) or f"What about {topic}?"))
  whole = si.make_questions(target, 6, GEN)
  first = list(raw)
  raw.clear()
  assert si.make_questions(target, 6, GEN) == whole and raw == first
  # three now, three more later: the same file as six at once
  part = si.make_questions(target, 3, GEN)
  assert si.make_questions(target, 6, GEN, rows=part) == whole
  assert [r["candidate"] for r in whole] == sorted(r["candidate"] for r in whole)
  assert len({r["uid"] for r in whole}) == 6
  assert all(r["uid"].startswith("self_instruct:0-") and r["source"] == "self_instruct"
             for r in whole)
  raw.clear()
  si.make_questions(target, 2, dict(GEN, seed=1))
  assert raw[:4] != first[:4]  # another seed: other candidates, other samples


def test_duplicates_and_mt_bench_questions_are_dropped(target, tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(si, "question_of", _cleaner(lambda text, topic: "How do I start?"))
  rows = si.make_questions(target, 5, GEN, max_batches=2)
  assert [r["question"] for r in rows] == ["How do I start?"]  # 8 sampled, 1 kept
  # an MT-Bench file whose first turn is near candidate 1's question
  topics = [c.topic for c, _ in zip(si.candidates(0), range(8))]
  mt = tmp_path / "question.jsonl"
  mt.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": [
      f"Please tell me everything useful to know about {topics[1]} in detail, today.",
      "Now shorter."]}) + "\n")
  avoid = si.read_avoid(str(mt))
  monkeypatch.setattr(si, "question_of", _cleaner(
      lambda text, topic: f"What is useful to know about {topic} today?"))
  rows = si.make_questions(target, 4, GEN, avoid=avoid)
  assert [r["topic"] for r in rows] == [t for t in topics if t != topics[1]][:4]
  assert si.read_avoid(str(tmp_path / "none.jsonl")) == []
  assert "no MT-Bench file" in capsys.readouterr().out


def test_regenerate_answers_self_instruct_prompts(target, tmp_path, monkeypatch):
  monkeypatch.setattr(si, "question_of", _cleaner(
      lambda text, topic: f"What should I know about {topic}?"))
  config = tiny.tiny_config(str(tmp_path / "regen"))
  config.data.mix = dict(gsm8k=0, mbpp=0, arena_hard_v01=0, arena_hard_v20=0,
                         self_instruct=3)
  config.data.paths.self_instruct = str(tmp_path / "si.jsonl")
  config.data.self_instruct.update(batch_size=4, max_new_tokens=8)
  config.data.self_instruct.mt_bench = str(tmp_path / "absent.jsonl")
  with pytest.raises(FlexDraftError, match="make them first with python -m flexdraft_jax "
                     "self-instruct"):
    prompt_mix.load_prompts(config.data)
  stats = si.self_instruct(config, 5)
  assert stats["questions"] == 5 and stats["new"] == 5
  rows = si.read_questions(config.data.paths.self_instruct)
  assert rows[0]["generation"]["target_fingerprint"] == target.fingerprint
  assert rows[0]["generation"]["mt_bench_filter"] is False
  assert si.self_instruct(config, 5)["new"] == 0  # already there: untouched
  config.data.max_new_tokens = 4
  regenerate.regenerate(config)
  recs = regen_store.read_shards(config.data.regen_dir)
  by_uid = {r["uid"]: r["question"] for r in rows}
  assert len(recs) == 3 and all(r["source"] == "self_instruct" for r in recs)
  for r in recs:
    text = target.tokenizer.decode(r["prompt_ids"])
    assert by_uid[r["uid"]] in text


def test_cli_needs_a_positive_num(capsys):
  with pytest.raises(SystemExit) as e:
    si.run(["flexdraft_jax self-instruct",
            f"--config={os.path.join(tiny.REPO, 'configs', 'tiny_test.py')}", "--num=0"])
  assert e.value.code == 1
  assert capsys.readouterr().err.strip() == (
      "error: --num must be >= 1 (questions the file should hold)")
