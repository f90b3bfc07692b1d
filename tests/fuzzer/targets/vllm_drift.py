"""vLLM 0.33.0 moved under attnfuzz: one edit of its source per drift, as a later release might make it, applied
either to a copy of vLLM's package (`copy_with`: a tree of links to the installed one with the edited file a real
copy, first on sys.path of a fresh interpreter) or to the live module of a process that has imported vLLM
(`apply`: the edited function compiled under vLLM's own file name and bound in the original's place, the class's
abstract methods recounted as its creation would count them). The same text edit either way.

    python -c "from tests.fuzzer.targets.vllm_drift import apply; apply('kwarg'); ..."
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import inspect
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Drift:
    module: str
    qualname: str  # the function or method the edit is in
    old: str
    new: str  # every `old` in it becomes `new`
    renamed: str | None = None  # the method's new name, where the edit renames it (the old one is gone)
    target: str = ""  # the attnfuzz target that calls it
    why: str = ""


SPARSE_UTILS = "vllm.v1.attention.backends.mla.sparse_utils"
FLASHMLA_SPARSE = "vllm.v1.attention.backends.mla.flashmla_sparse"
SPARSE_MLA = "vllm.model_executor.layers.attention.sparse_mla_attention"
FLASHINFER_SPARSE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse"

DRIFTS = {
    # A keyword the index remap's call sites pass, renamed.
    "kwarg": Drift(SPARSE_UTILS, "triton_convert_req_index_to_global_index", "NUM_TOPK_TOKENS", "NUM_TOPK",
                   target="vllm.index_remap", why="the remap's NUM_TOPK_TOKENS= renamed NUM_TOPK="),
    # FlashMLASparseBackend.get_builder_cls moved to another name: AttentionBackend's abstract declaration answers.
    "method": Drift(FLASHMLA_SPARSE, "FlashMLASparseBackend.get_builder_cls", "def get_builder_cls(",
                    "def get_metadata_builder_cls(", renamed="get_metadata_builder_cls", target="vllm.flashmla_sparse",
                    why="FlashMLASparseBackend.get_builder_cls renamed get_metadata_builder_cls"),
    # FlashMLASparseImpl.forward_mqa returns a third value.
    "return": Drift(FLASHMLA_SPARSE, "FlashMLASparseImpl.forward_mqa", "return attn_out, lse",
                    "return attn_out, lse, None",
                    target="vllm.flashmla_sparse", why="FlashMLASparseImpl.forward_mqa returns (out, lse, None)"),
    # ... or the output alone: unpacked as (out, lse), a tensor of two rows would be taken apart row by row.
    "return-one": Drift(FLASHMLA_SPARSE, "FlashMLASparseImpl.forward_mqa", "return attn_out, lse", "return attn_out",
                        target="vllm.flashmla_sparse", why="FlashMLASparseImpl.forward_mqa returns the output alone"),
    # A keyword that FlashMLASparseImpl takes into **mla_args and passes on to SparseMLACommonImpl, renamed there: the
    # TypeError comes from FlashMLASparseImpl.__init__'s own frame, vLLM's.
    "kwarg-through": Drift(SPARSE_MLA, "SparseMLACommonImpl.__init__", "q_lora_rank", "q_lora_dim",
                           target="vllm.flashmla_sparse",
                           why="SparseMLACommonImpl's q_lora_rank= (passed on by FlashMLASparseImpl's **mla_args) "
                               "renamed q_lora_dim="),
    # FlashInfer's sparse backends' customize_spec renamed: AttentionBackend's fallback of the old name (the spec as it
    # is) answers in its place, and the cache is laid out as the backend would not lay it out.
    "fallback": Drift(FLASHINFER_SPARSE, "_FlashInferMLASparseBackendBase.customize_spec", "def customize_spec(",
                      "def customize_kv_cache_spec(", renamed="customize_kv_cache_spec",
                      target="vllm.flashinfer_sparse_sm100",
                      why="FlashInfer's sparse backends' customize_spec renamed customize_kv_cache_spec"),
    # A device query a CPU host's torch cannot answer, as 0.34's FlashMLASparseImpl.__init__ made one
    # (`torch.accelerator.current_device_index()`): not a call that moved, and not vLLM's answer either.
    "device-query": Drift(SPARSE_UTILS, "triton_convert_req_index_to_global_index",
                          "    num_tokens = req_id.shape[0]\n",
                          "    num_tokens = req_id.shape[0] + 0 * torch.accelerator.current_device_index()\n",
                          target="vllm.index_remap", why="the remap asks torch.accelerator for its device index"),
}


def _owner_and_function(drift: Drift):
    module = importlib.import_module(drift.module)
    *classes, name = drift.qualname.split(".")
    owner = module
    for c in classes:
        owner = getattr(owner, c)
    fn = owner.__dict__[name] if classes else getattr(module, name)
    return module, owner, name, getattr(fn, "__func__", fn)  # a staticmethod's function (its source has the decorator)


def apply(name: str) -> None:
    """The drift `name`, in this process's vLLM."""
    drift = DRIFTS[name]
    module, owner, attr, fn = _owner_and_function(drift)
    lines, first = inspect.getsourcelines(fn)
    source = textwrap.dedent("".join(lines))
    assert drift.old in source, f"{drift.qualname} of this vLLM has no {drift.old!r}"
    namespace: dict = {}
    # Compiled under vLLM's file name and line numbers: its frames are vLLM's, as an edited release's would be. A
    # method is defined inside a function whose argument `__class__` is its class: the cell a class body gives
    # the methods it defines, which zero-argument super() reads.
    edited_source = source.replace(drift.old, drift.new)
    if isinstance(owner, type):
        edited_source = "def _define(__class__):\n" + textwrap.indent(edited_source, "    ") + \
            f"    return {drift.renamed or attr}\n"
    exec(compile("\n" * (first - 1 - isinstance(owner, type)) + edited_source, inspect.getsourcefile(fn), "exec"),
         module.__dict__, namespace)
    edited = namespace["_define"](owner) if isinstance(owner, type) else namespace[drift.renamed or attr]
    function = getattr(edited, "__func__", edited)
    function.__qualname__ = f"{owner.__qualname__}.{drift.renamed or attr}" if isinstance(owner, type) else attr
    if drift.renamed:
        delattr(owner, attr)
    setattr(owner, drift.renamed or attr, edited)
    if isinstance(owner, type):
        abc.update_abstractmethods(owner)


def copy_with(name: str, where: Path) -> Path:
    """A copy of the installed vLLM package under `where` with the drift `name` in its source: a tree of links to
    the installed files, the edited one a real file. Returns the directory to put first on sys.path."""
    drift = DRIFTS[name]
    spec = importlib.util.find_spec("vllm")
    installed = Path(spec.origin).parent
    root = where / "site"
    for dirpath, dirnames, filenames in os.walk(installed):
        rel = Path(dirpath).relative_to(installed)
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        (root / "vllm" / rel).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            (root / "vllm" / rel / f).symlink_to(Path(dirpath) / f)
    path = root / Path(*drift.module.split(".")).with_suffix(".py")
    text = path.read_text()
    original = "".join(inspect.getsourcelines(_owner_and_function(drift)[3])[0])
    assert text.count(original) == 1, f"{drift.qualname}'s source is not once in {path}"
    path.unlink()  # the link: the copy gets a file of its own
    path.write_text(text.replace(original, original.replace(drift.old, drift.new)))
    return root
