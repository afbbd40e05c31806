"""nki_autotune.autotune: benchmarking, search, numerics, decisions and the CLI."""
