"""The package's rooms import one way: each only from the rooms before it."""

from __future__ import annotations

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "flexdraft_jax")
# the order of docs/design.md's table
ROOMS = ("kernels", "model", "drafter", "decoding", "evaluation", "training", "aot")


def _imported_rooms(path: str) -> set:
  rooms = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    else:
      continue
    for name in names:
      parts = name.split(".")
      if parts[0] == "flexdraft_jax" and len(parts) > 1 and parts[1] in ROOMS:
        rooms.add(parts[1])
  return rooms


def test_each_room_imports_only_the_rooms_before_it():
  back_edges = []
  for i, room in enumerate(ROOMS):
    for root, _, files in os.walk(os.path.join(PACKAGE, room)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(root, f)
          for other in _imported_rooms(path) - set(ROOMS[:i + 1]):
            back_edges.append(f"{os.path.relpath(path, PACKAGE)} imports {other}")
  assert not back_edges, back_edges
