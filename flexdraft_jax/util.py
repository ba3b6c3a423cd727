"""Integer helpers shared by every layer of the package (imports nothing)."""


def ceil_div(x: int, m: int) -> int:
  """⌈x / m⌉ for integers."""
  return -(-x // m)


def round_up(x: int, m: int) -> int:
  """The smallest multiple of `m` that is >= x."""
  return ceil_div(x, m) * m
