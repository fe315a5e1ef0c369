"""`python -m fp8jax.cli` is the `fp8jax` command."""
import sys

from fp8jax.cli import main

sys.exit(main())
