"""Where Ctrl-C is noticed inside mypyc-compiled loops, which run no bytecode and so no signal
handlers: calling this interpreted function runs them. Keep it out of varlen.compiled.MODULES."""


def poll() -> None:
    """A no-op whose call runs pending signal handlers (it may raise KeyboardInterrupt)."""
    return None
