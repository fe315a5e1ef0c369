"""The `fp8jax` command: one module per subcommand.

    fp8jax compare                       # the demo: a small GPT in bf16 and FP8 (CPU, minutes)
    fp8jax sweep --recipes delayed,current --history 1,16 --margin 0,1 --steps 100
    fp8jax train --recipe delayed --size 125m --steps 2000 --out out/125m
    fp8jax train --resume --out out/125m --steps 4000
    fp8jax calibrate out/bf16/checkpoints/step_0000300 --out out/fp8-calibrated

    fp8jax inspect                       # the built-in example: an fp8_dense MLP train step
    fp8jax inspect --xla-defaults        # the same with XLA's default GEMM flags (Triton on)
    fp8jax inspect --factory mypkg.train:lowering_example --strict
    fp8jax inspect --hlo dump/module_0001.jit_step.sm_9.0a_gpu_after_optimizations.txt

    fp8jax cost                          # predicted H100 time: the example in FP8 vs its bf16 twin
    fp8jax cost --summary --recipe current --widths 4096,16384,4096 --batch 4 --seq 2048
    fp8jax cost --factory mypkg.train:fp8_step --baseline mypkg.train:bf16_step --json cost.json
    fp8jax cost --constant hbm_bytes_per_s=2.6e12 --constant kernel_overhead_s=4e-6

`inspect` lists every GEMM of a compiled function and what it lowered to.
`--strict` exits with status 1 unless every GEMM runs in FP8, for use in CI.
`python -m fp8jax.lowering` is `fp8jax inspect`.

`cost` predicts the time of a compiled program kernel by kernel with the
roofline of `fp8jax.lowering.cost` (one table per program, then the comparison
and the predicted speedup of the FP8 program over its bf16 baseline).
`--constant NAME=VALUE` (repeatable) overrides a `CostConstants` field, e.g.
with your own GPU's measurements (`python -m benchmarks.roofline`); `--summary`
prints the totals only; `--json PATH` also writes the full report.

`--factory MODULE:FUNCTION` (and `--baseline`) names a function of no arguments
that returns `(fn, args)`: the function to compile and a tuple of example
arguments (arrays or `jax.ShapeDtypeStruct`s). Both commands compile for an
H100 without a GPU ("deviceless", the 'hopper' extra) unless JAX has a GPU
backend (`--target` chooses), with every GEMM on cuBLAS unless `--xla-defaults`.
"""
from __future__ import annotations

import argparse

from fp8jax import platform_guard as _platform_guard  # noqa: F401  (before any backend use)
from fp8jax.cli import calibrate, compare, cost, inspect, sweep, train

SUBCOMMANDS = {"compare": compare, "sweep": sweep, "train": train, "calibrate": calibrate,
               "inspect": inspect, "cost": cost}


def main(argv: list[str] | None = None) -> int:
  """Runs the command line; returns the exit status."""
  parser = argparse.ArgumentParser(prog="fp8jax", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  for module in SUBCOMMANDS.values():
    module.add_parser(commands)
  args = parser.parse_args(argv)
  return SUBCOMMANDS[args.command].run(args)
