"""Models the demo, the tests and the benchmarks run: ``llama``, a small Llama in plain PyTorch."""
