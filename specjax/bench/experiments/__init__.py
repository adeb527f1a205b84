"""Benchmarks run by hand, one module each (`python -m specjax.bench.experiments.NAME --help`), whose
figures are in docs/BENCHMARKS.md with the exact command: token recycling offline (`recycle`), the LM
head's share of a step (`lm_head_share`), the verify window's cost per matmul (`verify_profile`), step
cost on an accelerator mesh (`mesh_device`), and two HTTP measurements against a running server
(`http_ttft`, `hostile_latency`). They sit above the bench's library modules and import none of each
other."""
