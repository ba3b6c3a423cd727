"""The README holds: every path and link it names exists, every flag it shows is in its
command's `--help`, every `--config.a.b` it shows is a field of that config."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
TOP = ("flexdraft_jax/", "launch/", "docs/", "configs/", "datasets/", "tests/")
FLAG = re.compile(r"--[a-z][a-z0-9_.-]*")


def _text() -> str:
  with open(README, encoding="utf-8") as f:
    return f.read()


def _commands() -> list:
  """The shell commands in the README's bash blocks, continuation lines joined and
  comments dropped."""
  commands = []
  for block in re.findall(r"```bash\n(.*?)```", _text(), re.S):
    for line in block.replace("\\\n", " ").splitlines():
      line = line.split("  #")[0].strip()
      if line and not line.startswith("#"):
        commands.append(line)
  return commands


def _program(words: list) -> tuple:
  """(the argv that prints the command's help, its flags) for a README command;
  (None, flags) for one without flag help (the bash scripts)."""
  if words[:3] == ["python", "-m", "flexdraft_jax"]:
    return (sys.executable, "-m", "flexdraft_jax", words[3]), words[4:]
  if words[0] == "python" and words[1] == "launch/offline.py":
    return (sys.executable, words[1], words[2]), words[3:]
  if words[0] == "python" and words[1].startswith("launch/"):
    return (sys.executable, words[1]), words[2:]
  return None, words[1:]


@functools.lru_cache(maxsize=None)
def _help(argv: tuple) -> str:
  out = subprocess.run(list(argv) + ["--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
  text = out.stdout + out.stderr
  # absl exits 1 after printing --help (argparse, in launch scripts, 0); the
  # package's commands exit 0
  ok = (0,) if tuple(argv[1:3]) == ("-m", "flexdraft_jax") else (0, 1)
  assert out.returncode in ok and FLAG.search(out.stdout), (argv, text[-2000:])
  return text


@functools.lru_cache(maxsize=None)
def _config(path: str):
  sys.path.insert(0, REPO)  # configs import flexdraft_jax from the checkout
  from flexdraft_jax.cli_util import _load_config_file
  return _load_config_file(os.path.join(REPO, path))


def _has_field(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    try:
      node = node[part]
    except (KeyError, TypeError):
      return False
  return True


def _flag_name(flag: str) -> str:
  return flag.split("=", 1)[0]


def test_readme_is_short():
  assert len(_text().splitlines()) <= 250


def test_every_link_and_path_exists():
  text = _text()
  missing = []
  for target in re.findall(r"\]\(([^)#]+)\)", text):
    if not target.startswith(("http://", "https://")) and not os.path.exists(
        os.path.join(REPO, target)):
      missing.append(target)
  for code in re.findall(r"`([^`\n]+)`", text) + _commands():
    for word in re.split(r"[\s=,:]+", code):
      word = word.strip("()[].;'\"")
      if word.startswith(TOP) and not re.search(r"[{*<]|OUT|DIR", word):
        if not os.path.exists(os.path.join(REPO, word)):
          missing.append(word)
  assert not missing, missing


def test_every_command_flag_is_in_its_help():
  unknown = []
  for command in _commands():
    words = shlex.split(command)
    argv, args = _program(words)
    if argv is None:
      continue
    config = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if config is None and "--config" in args:
      config = args[args.index("--config") + 1]
    for flag in (_flag_name(a) for a in args if a.startswith("--")):
      if flag.startswith("--config."):
        if not _has_field(_config(config), flag[len("--config."):]):
          unknown.append(f"{command}: {flag}")
      elif flag not in FLAG.findall(_help(argv)):
        unknown.append(f"{command}: {flag}")
  assert not unknown, unknown


def test_generate_options_table_matches_the_cli():
  """Each option in the table is a `generate` keyword, or a field of the option
  group its row names (`sampling: …`), and a CLI flag."""
  import dataclasses
  import inspect

  from flexdraft_jax.decoding.engine import generate
  from flexdraft_jax.decoding.options import GROUPS
  text = _text()
  table = text[text.index("| option | default | meaning |"):]
  table = table[:table.index("\n\n")]
  groups = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in GROUPS}
  keywords = set(inspect.signature(generate).parameters)
  flags = set(FLAG.findall(_help((sys.executable, "-m", "flexdraft_jax", "generate"))))
  n = 0
  for row in table.splitlines()[2:]:
    cell = row.split("|")[1].strip()
    group = cell.split(":")[0] if re.match(r"[a-z]+: ", cell) else None
    for option in re.findall(r"`([a-z_]+)`", cell):
      n += 1
      assert option in (groups[group] if group else keywords), (group, option)
      assert "--" + option.replace("_", "-") in flags, option
  assert n >= 15, n
  assert {name for name, _ in GROUPS} <= keywords


def test_prose_flags_are_known():
  """Flags in the README's running text belong to one of its commands, and its
  `--config.` fields to the training config."""
  prose = re.sub(r"```.*?```", "", _text(), flags=re.S)
  known = set()
  for command in _commands():
    words = shlex.split(command)
    argv, _ = _program(words)
    if argv is not None:
      known |= set(FLAG.findall(_help(argv)))
  for script in set(re.findall(r"launch/[a-z_]+\.sh", _text())):  # their usage comments
    with open(os.path.join(REPO, script), encoding="utf-8") as f:
      known |= set(FLAG.findall(f.read()))
  unknown = []
  for code in re.findall(r"`([^`\n]+)`", prose):
    for flag in (_flag_name(f) for f in FLAG.findall(code)):
      if flag == "--config.":  # the override syntax itself: `--config.FIELD=VALUE`
        continue
      if flag.startswith("--config."):
        if not _has_field(_config("configs/smollm2_135m.py"), flag[len("--config."):]):
          unknown.append(flag)
      elif flag not in known:
        unknown.append(flag)
  assert not unknown, unknown
