"""Step cost models: how long one engine step takes, given what each request in it computes.
One module per model (base.py is the interface). Torch-free, so the simulator starts fast.
"""

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built
