"""The property suites as a library: the hypothesis strategies and correctness properties that
tests/ runs on the shipped plug-ins, importable from an installed wheel to run on a user's.
Needs the `test` extra (hypothesis, pytest)."""
