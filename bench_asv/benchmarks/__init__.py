"""asv benchmarks of rlk (see ../README.md); the standalone runner ../run.py shares them."""
