"""Quantized Hugging Face checkpoints loaded into quantfuse modules: ``from_pretrained``.

* ``files``: the folder or Hub repository, ``config.json``, safetensors shards read one by one;
* ``compressed_tensors`` / ``awq`` / ``gptq``: one format each, its ``quantization_config`` checked and each
  quantized linear planned (which tensors, which module, how they convert);
* ``model``: the transformers model built without weights, linears swapped, tensors set in place;
* ``loader``: ``from_pretrained`` itself.

transformers and safetensors are imported only when ``from_pretrained`` runs.
"""

from .common import UnsupportedCheckpointError
from .loader import from_pretrained

__all__ = ["UnsupportedCheckpointError", "from_pretrained"]
