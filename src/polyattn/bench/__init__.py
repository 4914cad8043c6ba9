"""GPU benchmarks: our kernels and the anchors timed side by side in one process (README, "GPU kernels and benchmarks").

`python -m polyattn.bench kernels --out DIR` and `python -m polyattn.bench decode --out DIR`
(also `polyattn bench ...`) write JSON rows `{op, impl, T, B, H, K, V, mode, ms, ...}`, a
markdown table of ratios and a PNG plot into DIR.
"""
