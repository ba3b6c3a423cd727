"""Training metrics to `metrics.csv` and a TensorBoard event file (no TensorFlow).

The event file is written by hand: TFRecord framing (length, masked CRC32C)
around `Event{wall_time, step, summary{value{tag, simple_value}}}` protobufs,
which is all TensorBoard's scalar dashboard reads.
"""

from __future__ import annotations

import csv
import os
import socket
import struct
import time


def _crc32c_table():
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    table.append(c)
  return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  c = 0xFFFFFFFF
  for b in data:
    c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
  return c ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  c = crc32c(data)
  return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


def _field_bytes(field: int, payload: bytes) -> bytes:
  return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def event_bytes(step: int, scalars: dict, wall_time=None, file_version=None) -> bytes:
  """One serialized `tensorflow.Event` proto."""
  out = b"\x09" + struct.pack("<d", time.time() if wall_time is None else wall_time)
  out += b"\x10" + _varint(step & (2 ** 64 - 1))
  if file_version is not None:
    out += _field_bytes(3, file_version.encode())
  if scalars:
    values = b"".join(
        _field_bytes(1, _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", v))
        for tag, v in scalars.items())
    out += _field_bytes(5, values)
  return out


def tfrecord(data: bytes) -> bytes:
  n = struct.pack("<Q", len(data))
  return n + struct.pack("<I", _masked_crc(n)) + data + struct.pack("<I", _masked_crc(data))


class MetricsLog:
  """Appends rows to WORKDIR/metrics.csv and scalars to a TensorBoard file.

  On resume from step `resume_step`, CSV rows past it (written after the
  checkpoint) are dropped, so the log matches an uninterrupted run.
  """

  def __init__(self, workdir: str, columns: list, *, enabled: bool = True,
               resume_step: int = 0):
    self.enabled, self.columns = enabled, columns
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.csv")
    kept = []
    if resume_step and os.path.exists(self.path):
      with open(self.path) as f:
        kept = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
    with open(self.path, "w", newline="") as f:
      w = csv.DictWriter(f, columns, extrasaction="ignore")
      w.writeheader()
      w.writerows(kept)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    self._events = open(os.path.join(workdir, name), "ab")
    self._events.write(tfrecord(event_bytes(0, {}, file_version="brain.Event:2")))
    self._events.flush()

  def write(self, step: int, row: dict) -> None:
    if not self.enabled:
      return
    row = dict(row, step=step)
    with open(self.path, "a", newline="") as f:
      csv.DictWriter(f, self.columns, extrasaction="ignore").writerow(
          {k: _fmt(row.get(k)) for k in self.columns})
    scalars = {k: float(v) for k, v in row.items()
               if k != "step" and isinstance(v, (int, float))}
    self._events.write(tfrecord(event_bytes(step, scalars)))
    self._events.flush()

  def close(self) -> None:
    if self.enabled:
      self._events.close()


def _fmt(v):
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.6g}"
  return v
