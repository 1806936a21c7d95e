"""Perplexity of a causal language model on token ids: the accuracy measure of the real-model tests,
the demo and the README's table.

``python -m compile_backend.models.perplexity`` prints that table: SmolLM2-135M-Instruct
(``smollm2.py``) in float32 and quantized with each scheme, its perplexity on README.md, AWQ both
round-to-nearest and calibrated on docs/DESIGN.md (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import copy
import math
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def logits_of(output) -> torch.Tensor:
    """The logits of a model's output: a tensor, or an object with ``.logits`` (transformers)."""
    return output if isinstance(output, torch.Tensor) else output.logits


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int | None = None) -> float:
    """``exp`` of the mean next-token negative log-likelihood of ``ids`` (``[S]`` or ``[B, S]``)
    under ``model`` (called as ``model(ids)``), in float64 from float32 log-probabilities.

    ``window``: split the sequence into consecutive windows of that many tokens, each scored on its
    own (no context carried over); None scores it in one call.
    """
    ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
    window = window or ids.shape[1]
    total, count = 0.0, 0
    for start in range(0, ids.shape[1], window):
        chunk = ids[:, start:start + window]
        if chunk.shape[1] < 2:
            continue
        logits = logits_of(model(chunk)).float()
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                              reduction="sum")
        total += nll.double().item()
        count += chunk[:, 1:].numel()
    return math.exp(total / count)


def dequantized(model: nn.Module) -> nn.Module:
    """``model`` with each ``AWQLinear`` replaced, in place, by an ``nn.Linear`` holding its
    dequantized weight in float32 (and bias): the quantized weights, computed on float32
    activations.  ``AWQLinear`` of a float32 model computes in float16, which a CPU without float16
    matrix instructions runs many times slower than float32; this measures the weights' accuracy
    there (it differs from the layers' own result by float16's rounding of their input and output)."""
    from ..quantize import AWQLinear

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, AWQLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device=child.qweight.device)
                with torch.no_grad():
                    linear.weight.copy_(child.dequantized_weight().float().t())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias.float())
                setattr(module, name, linear)
    return model


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv=None) -> None:
    from ..quantize import quantize_model
    from . import smollm2

    root = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description="SmolLM2 perplexity per quantization scheme (a markdown table)")
    parser.add_argument("--text", default=str(root / "README.md"), help="text scored (default: README.md)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of --text scored (one window)")
    parser.add_argument("--calibration", default=str(root / "docs" / "DESIGN.md"),
                        help="text AWQ is calibrated on (default: docs/DESIGN.md)")
    parser.add_argument("--calibration-tokens", type=int, default=1024)
    parser.add_argument("--schemes", nargs="+", default=["int8", "fp8-rowwise", "awq-g64", "awq-g32"])
    parser.add_argument("--awq-layers", choices=("float32", "module"), default="float32",
                        help="AWQ perplexity with the dequantized weights in float32 (fast on a CPU) or "
                             "with the AWQLinear layers themselves (float16 inside)")
    parser.add_argument("--compiled", action="store_true", help="also the model compiled with quantfuse")
    args = parser.parse_args(argv)

    model, tokenizer = smollm2.load_smollm2()
    text = tokenizer(Path(args.text).read_text(), return_tensors="pt").input_ids[0][:args.tokens]
    calibration = tokenizer(Path(args.calibration).read_text(), return_tensors="pt").input_ids[0][
        :args.calibration_tokens]
    print(f"SmolLM2-135M-Instruct, {len(text)} tokens of {Path(args.text).name}; AWQ calibrated on "
          f"{len(calibration)} tokens of {Path(args.calibration).name}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    head = "| scheme | perplexity | vs float |" + (" compiled |" if args.compiled else "") + " quantize s |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    base = perplexity(model, text)
    print(f"| float32 | {base:.2f} | | " + ("| " if args.compiled else "") + "|", flush=True)
    for scheme in args.schemes:
        for calibrated in ((False, True) if scheme.startswith("awq") else (False,)):
            start = time.perf_counter()
            quantized = quantize_model(copy.deepcopy(model), scheme, calibration=calibration if calibrated else None)
            seconds = time.perf_counter() - start
            name = scheme + (" calibrated" if calibrated else " round-to-nearest" if scheme.startswith("awq") else "")
            measured = dequantized(copy.deepcopy(quantized)) if (
                scheme.startswith("awq") and args.awq_layers == "float32") else quantized
            ppl = perplexity(measured, text)
            row = f"| {name} | {ppl:.2f} | {100 * (ppl / base - 1):+.1f}% |"
            if args.compiled:
                torch._dynamo.reset()
                row += f" {perplexity(torch.compile(quantized, backend='quantfuse'), text):.2f} |"
            print(f"{row} {seconds:.0f} |", flush=True)
    print(f"peak memory {_rss_gb():.2f} GB", file=sys.stderr)


if __name__ == "__main__":
    main()
