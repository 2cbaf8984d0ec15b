"""Step cost models: how long one engine step takes, given what each request in it computes.

One module per model, one formula each (base.py): `roofline`, `measured` (operator tables read in
`profiles`, predicted in `gemm`, `collectives`, `attention`), `fitted`, `replay`, and
`communication` (TP / PP collectives over a per-GPU model); `hardware` holds the spec and shape.
Torch-free: the simulator starts in well under a second and runs without torch.
"""

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built
