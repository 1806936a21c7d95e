"""Checkpoint files: the folder (or Hub repository), ``config.json`` and the safetensors shards."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import torch

log = logging.getLogger("quantfuse.checkpoints")

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def resolve(path) -> str:
    """A local folder as it is; anything else is taken as a Hub repository id and downloaded
    (config and safetensors files only) through ``huggingface_hub``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"from_pretrained: path {path!r} is a file; expected a checkpoint folder or a Hub id")
    if os.path.isabs(path) or path.startswith(".") or path.count("/") != 1:
        # A Hub id is "owner/name"; anything else was meant as a local folder.
        raise ValueError(f"from_pretrained: no folder {path!r} (and it is not a Hub id 'owner/name')")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"from_pretrained: path {path!r} is not a folder (and huggingface_hub, needed to "
                         "download a Hub repository, is not installed)") from None
    log.info("downloading %s from the Hugging Face Hub", path)
    return snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])


def read_config(folder: str) -> dict:
    file = os.path.join(folder, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"from_pretrained: {folder!r} has no config.json")
    with open(file) as f:
        return json.load(f)


def shards(folder: str) -> dict[str, list[str]]:
    """shard file -> the tensor names it holds, in file order (``model.safetensors`` or the shards
    named by ``model.safetensors.index.json``); reads headers only."""
    from safetensors import safe_open

    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"from_pretrained: {index!r} has no 'weight_map'")
        files: dict[str, list[str]] = {}
        for key, file in weight_map.items():
            files.setdefault(file, []).append(key)
        for file in files:
            if not os.path.isfile(os.path.join(folder, file)):
                raise ValueError(f"from_pretrained: shard {file!r} named by {INDEX} is missing from {folder!r}")
        return files
    single = os.path.join(folder, SINGLE)
    if not os.path.isfile(single):
        raise ValueError(f"from_pretrained: {folder!r} holds neither {SINGLE} nor {INDEX}")
    with safe_open(single, framework="pt") as f:
        return {SINGLE: list(f.keys())}


def read_shards(folder: str, files: dict[str, list[str]], device: torch.device
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, shard after shard, read straight onto ``device``; one log
    line per shard."""
    from safetensors import safe_open

    for i, (file, keys) in enumerate(files.items(), 1):
        log.info("loading shard %d/%d: %s (%d tensors)", i, len(files), file, len(keys))
        with safe_open(os.path.join(folder, file), framework="pt", device=str(device)) as f:
            for key in keys:
                yield key, f.get_tensor(key)
