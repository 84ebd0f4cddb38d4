"""Benchmarks, run from the repository root as ``python -m bench.<name>`` (see docs/benchmarks.md).

Also the shared pieces the tests use: the benchmark models (``bench.models``), synthetic stores for
scale runs (``bench.synth_store``) and the headless Chromium and a dashboard process (``bench.browser``)."""
