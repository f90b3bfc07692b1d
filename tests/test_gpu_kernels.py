"""scripts/gpu-kernels.sh, offline: a pack cut in parts travels as the GPU host gets it (a part stashed by one call,
the last with its checksum carried by the next), installs once, and a damaged or missing part stops the install."""

import subprocess
import tarfile

from tests.conftest import ROOT


def _kernels(*args, packs, host):
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-kernels.sh"), *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "GPU_KERNELS_PACKS": str(packs), "GPU_KERNELS_HOST": str(host)},
                          timeout=60)


def _pack(tmp_path, payload: bytes):
    """A cutedsl pack (two parts) of one file, as `build` leaves it."""
    pack = tmp_path / "repo" / ".gpu-cutedsl"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "cutlass.py").write_bytes(payload)
    pack.mkdir(parents=True)
    with tarfile.open(pack / "cutedsl.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "src" / "cutlass.py", arcname="cutlass.py")
    (pack / "VERSION").write_text("test\n")
    done = _kernels("split", "cutedsl", packs=tmp_path / "repo", host=tmp_path / "host")
    assert done.returncode == 0, done.stderr
    return pack


def test_parts_stashed_then_installed_give_the_pack_back_once(tmp_path):
    payload = bytes(range(256)) * 400
    pack = _pack(tmp_path, payload)
    assert sorted(p.name for p in pack.glob("p*/*")) == ["PARTS", "SHA256SUMS", "VERSION", "cutedsl.tar.xz.part-1",
                                                        "cutedsl.tar.xz.part-2"]
    repo, host = tmp_path / "repo", tmp_path / "host"
    p2 = pack / "p2"
    p2.rename(tmp_path / "p2-later")  # call 1 carries p1 only
    assert _kernels("stash", "cutedsl", packs=repo, host=host).returncode == 0
    (pack / "p1").rename(tmp_path / "p1-done")  # call 2 carries p2 only
    (tmp_path / "p2-later").rename(p2)
    done = _kernels("install", "cutedsl", packs=repo, host=host)
    assert done.returncode == 0 and "installed" in done.stdout, done.stdout + done.stderr
    assert (host / "cutedsl" / "site" / "cutlass.py").read_bytes() == payload
    again = _kernels("install", "cutedsl", packs=repo, host=host)
    assert again.returncode == 0 and "already installed" in again.stdout


def test_a_missing_or_damaged_part_stops_the_install(tmp_path):
    pack = _pack(tmp_path, b"x" * 50_000)
    repo = tmp_path / "repo"
    (pack / "p1").rename(tmp_path / "p1-never")  # the machine went back after call 1: part 1 is gone
    missing = _kernels("install", "cutedsl", packs=repo, host=tmp_path / "host1")
    assert missing.returncode == 1 and "part 1 of 2 missing" in missing.stderr
    (tmp_path / "p1-never").rename(pack / "p1")
    part = pack / "p1" / "cutedsl.tar.xz.part-1"
    part.write_bytes(b"\0" + part.read_bytes()[1:])
    damaged = _kernels("install", "cutedsl", packs=repo, host=tmp_path / "host2")
    assert damaged.returncode == 1 and "checksum mismatch" in damaged.stderr
    assert not (tmp_path / "host2" / "cutedsl" / ".ready").exists()
