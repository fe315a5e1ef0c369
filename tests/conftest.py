"""Test defaults: CPU only, unless the environment says otherwise."""
import os

# Before jax is imported anywhere: tests run on the CPU backend; deviceless H100
# compiles do not need a GPU backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
