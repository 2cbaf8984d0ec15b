"""Step cost models: how long one engine step takes, given what each request in it computes.

One module per model, one formula per model (base.py says how a formula is written and what is
derived from it): `roofline` (analytic, from an HF config and a hardware spec), `measured`
(operator tables taken on real GPUs, read and predicted in `operators`), `fitted` (the profiled
model, fitted to a real engine's step log), `replay` (recorded durations played back), and
`communication` (tensor / pipeline parallel collectives on top of a per-GPU model). `hardware`
holds the hardware spec and the model shape. All torch-free: the simulator must start in well
under a second and run where torch is not installed.
"""

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built
