"""The public API's checks of its arguments' types, shared by every entry point
(`generate`, the option groups, `load_target`, `load_drafter`).

Python takes many wrong types without a word — any non-empty string is true,
so `chat="False"` turned the chat template on; a dict iterates its keys, so
`generate({"a": "hi"})` decoded "a" — or fails deep inside with an
AttributeError (a path where a loaded drafter goes). Each check here refuses
with one `FlexDraftError` line naming the argument, what it takes and what it
got; when the type is wrong the line names the type (`got str '0.5'`), so a
string is never shown as if it were the number.
"""

from __future__ import annotations

import numbers
import os

import numpy as np

from flexdraft_jax.model.config import FlexDraftError

_REPR_LIMIT = 80


def describe(value) -> str:
  """`value` with its type, as a line shows a wrong type: `str '0.5'`."""
  text = shown(value)
  if len(text) > _REPR_LIMIT:
    text = text[:_REPR_LIMIT - 3] + "..."
  return f"{type(value).__name__} {text}"


def shown(value) -> str:
  """`value` as a line shows a value of the right type (NumPy scalars as the
  Python number they hold: `-2`, not `np.int64(-2)`)."""
  if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
    value = value.item()
  return repr(value)


def is_int(x) -> bool:
  """An integer (Python, NumPy or a 0-d integer array), not a bool or a float."""
  if isinstance(x, (bool, np.bool_)):
    return False
  if isinstance(x, numbers.Integral):
    return True
  dtype = getattr(x, "dtype", None)
  return dtype is not None and getattr(x, "ndim", 1) == 0 and np.dtype(dtype).kind in "iu"


def is_real(x) -> bool:
  """A real number (Python or NumPy, integer or float), not a bool or a string."""
  return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def check_int(name: str, value, low=None, hint: str = "") -> None:
  """`value` is an integer >= `low` (any integer without one)."""
  what = f"an integer{'' if low is None else f' >= {low}'}{hint}"
  if not is_int(value):
    raise FlexDraftError(f"{name} must be {what}, got {describe(value)}")
  if low is not None and value < low:
    raise FlexDraftError(f"{name} must be {what}, got {shown(value)}")


def check_number(name: str, value, what: str, ok=lambda v: True) -> None:
  """`value` is a real number for which `ok` holds; the line says `name` must
  be `what`."""
  if not is_real(value):
    raise FlexDraftError(f"{name} must be {what}, got {describe(value)}")
  if not ok(value):
    raise FlexDraftError(f"{name} must be {what}, got {shown(value)}")


def check_bool(name: str, value, allowed: str = "True or False") -> None:
  """`value` is True or False (a NumPy bool too), never a string or a number
  that Python would read as one; `allowed` says what the caller takes."""
  if not isinstance(value, (bool, np.bool_)):
    raise FlexDraftError(f"{name} must be {allowed}, got {describe(value)}")


def check_choice(name: str, value, choices) -> None:
  """`value` is one of the strings `choices`."""
  if not isinstance(value, str):
    raise FlexDraftError(f"{name} must be one of {tuple(choices)}, got {describe(value)}")
  if value not in choices:
    raise FlexDraftError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_path(name: str, value, what: str = "a path (str)") -> None:
  """`value` is a path: a str or an `os.PathLike`."""
  if not isinstance(value, (str, os.PathLike)):
    raise FlexDraftError(f"{name} must be {what}, got {describe(value)}")


def check_loaded(name: str, value, cls: type, loader: str) -> None:
  """`value` is a `cls` object, as `loader` makes one (e.g. `fd.load_target`):
  a path or a name in its place gets the call that loads it. `loader` is a
  format string with `{}` where that path or name goes."""
  if isinstance(value, cls):
    return
  if isinstance(value, (str, os.PathLike)):
    raise FlexDraftError(f"{name} must be a loaded {cls.__name__}, got {describe(value)}: "
                         f"load it with {loader.format(repr(os.fspath(value)))}")
  raise FlexDraftError(f"{name} must be a {cls.__name__} (from "
                       f"{loader.format('path')}), got {describe(value)}")
