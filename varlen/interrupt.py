"""Where Ctrl-C is noticed inside compiled loops.

Python runs a signal's handler (SIGINT's raises KeyboardInterrupt) only when the interpreter
executes bytecode. Code compiled with mypyc (the scheduling core, varlen/compiled.py) never does
on its own, so a simulation would run to its end before a Ctrl-C took effect. Its loops call
`poll` every so often: entering this interpreted function runs the pending handlers. This module
must stay out of the compiled core (varlen.compiled.MODULES)."""


def poll() -> None:
    """A no-op whose call runs pending signal handlers (it may raise KeyboardInterrupt)."""
    return None
