"""`python -m fp8jax.lowering [options]`: the same as `fp8jax inspect [options]`."""
import sys

from fp8jax.cli import main

sys.exit(main(["inspect", *sys.argv[1:]]))
