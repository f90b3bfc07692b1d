"""scripts/gpu_flashinfer.py, offline: the parts FlashInfer travels to the GPU host in join back to the file only in
order and from one build, and the manifest packs what the MLA module's JIT build reaches and nothing of csrc/ else."""

import importlib.util
import os

import pytest

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("gpu_flashinfer", ROOT / "scripts" / "gpu_flashinfer.py")
gfi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gfi)


def test_split_then_join_gives_the_file_back_and_a_wrong_order_fails(tmp_path):
    blob = tmp_path / "x.tar.xz"
    blob.write_bytes(os.urandom(10_000))
    parts = gfi.split(blob, tmp_path / "out", [4096, 0])
    assert [p.stat().st_size for p in parts] == [4096, 10_000 - 4096]
    assert [p.relative_to(tmp_path / "out").as_posix() for p in parts] == ["p1/x.tar.xz.part-1", "p2/x.tar.xz.part-2"]
    sums = parts[-1].parent / "SHA256SUMS"  # travels with the last part
    out = tmp_path / "host" / "x.tar.xz"
    out.parent.mkdir()
    gfi.join(parts, out, sums)
    assert out.read_bytes() == blob.read_bytes()
    with pytest.raises(ValueError, match="checksum mismatch"):
        gfi.join(parts[::-1], out, sums)
    assert not out.exists()
    with pytest.raises(ValueError, match="names no"):
        gfi.join(parts, tmp_path / "host" / "other.tar.xz", sums)
    with pytest.raises(ValueError, match="do not fill"):
        gfi.split(blob, tmp_path / "out2", [10_000, 0])


def _write(path, text=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_manifest_packs_the_include_trees_the_mla_sources_and_what_they_reach_in_csrc(tmp_path):
    site, gen = tmp_path / "site", tmp_path / "gen"
    pkg, data = site / "flashinfer", site / "flashinfer" / "data"
    _write(pkg / "__init__.py")
    _write(pkg / "mla" / "_core.py")
    _write(pkg / "experimental" / "k" / "kernel.cu")  # another module's kernel source: left out
    _write(site / "flashinfer_python-0.7.2.post1.dist-info" / "METADATA")
    for tree in gfi.INCLUDE_TREES:
        _write(data / tree / "keep.h")
    _write(data / "include" / "flashinfer" / "page.cuh", '#include "utils.cuh"\n#include <cuda_runtime.h>\n')
    _write(data / "include" / "flashinfer" / "utils.cuh")
    for src in gfi.MLA_SOURCES:
        _write(data / src)
    # vLLM's MLA prefill JIT-builds FlashInfer's concat_mla_k from csrc/concat_mla.cu: it and what it reaches go.
    _write(data / "csrc" / "concat_mla.cu", '#include "tvm_ffi_utils.h"\n#include <flashinfer/concat_mla.cuh>\n')
    _write(data / "include" / "flashinfer" / "concat_mla.cuh")
    _write(data / "csrc" / "tvm_ffi_utils.h", "#include <tvm/ffi/function.h>\n")
    _write(data / "csrc" / "unrelated.cuh")  # in csrc, reached by nothing: left out
    _write(data / "cutlass" / "examples" / "big.cu")  # outside the include trees: left out
    for name in ("batch_mla_sm90_plan.cu", "batch_mla_sm90_run.cu", "batch_mla_sm90_binding.cu"):
        _write(gen / name, '#include "batch_mla_sm90_config.inc"\n#include "tvm_ffi_utils.h"\n')
    _write(gen / "batch_mla_sm90_config.inc", "#include <flashinfer/page.cuh>\n")
    files, info = gfi.manifest(site, gen)
    assert "flashinfer/data/csrc/tvm_ffi_utils.h" in files and "flashinfer/data/csrc/unrelated.cuh" not in files
    assert "flashinfer/experimental/k/kernel.cu" not in files and "flashinfer/mla/_core.py" in files
    assert "flashinfer/data/cutlass/examples/big.cu" not in files
    assert "flashinfer_python-0.7.2.post1.dist-info/METADATA" in files
    assert all(f"flashinfer/data/{t}/keep.h" in files for t in gfi.INCLUDE_TREES)
    assert all(f"flashinfer/data/{s}" in files for s in gfi.MLA_SOURCES + gfi.CONCAT_MLA_SOURCES)
    assert info["csrc_reached"] == ["flashinfer/data/csrc/concat_mla.cu", "flashinfer/data/csrc/tvm_ffi_utils.h"]
    assert info["missing"] == []
    assert info["unresolved"] == ["cuda_runtime.h", "tvm/ffi/function.h"]
