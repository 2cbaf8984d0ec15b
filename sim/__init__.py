"""The discrete-event simulator: the engine's own scheduling code on a simulated clock."""

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built
