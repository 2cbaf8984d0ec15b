"""`varlen.conf`: the Hydra configs, package data (Hydra's pkg:// search path needs this file)."""
