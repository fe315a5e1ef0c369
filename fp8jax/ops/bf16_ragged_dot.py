"""`bf16_ragged_dot`: `jax.lax.ragged_dot` on JAX's own Hopper grouped GEMMs, forward and backward.

The high-precision twin of `fp8_ragged_dot`, and the baseline FP8 expert GEMMs are
measured against. Compiled for an H100, XLA lowers `lax.ragged_dot` to a dense
expansion: every row multiplied by every expert's weights and masked, G times the FLOPs
of the grouped product (`fp8jax inspect` says "dense expansion"). JAX ships grouped
GEMM kernels for Hopper in Mosaic GPU; this op runs them, so a bf16 MoE layer does the
FLOPs of one dense GEMM per expert GEMM, as its FP8 twin does:

    fprop  y[r]  = x[r] @ w[g(r)]        ragged_dot_mgpu.ragged_dot(x, w)
    dgrad  dx[r] = dy[r] @ w[g(r)]^T     ragged_dot_mgpu.ragged_dot(dy, w, transpose_rhs=True)
    wgrad  dw[g] = x_g^T dy_g            transposed_ragged_dot_mgpu.transposed_ragged_dot(x, dy)

with the tiling JAX's own sweep picks for an H100 (`MOSAIC_BLOCKS`); each kernel sits in
a named scope of its name, by which `fp8jax inspect` / `fp8jax cost` know it
(`fp8jax.lowering.grouped_gemms`). The demo GPT at 125m with 8 experts (top 2, batch 8 x
1024), its bf16 train step compiled for an H100 without a GPU: predicted 24.52 ms on these
kernels, 106.64 ms on XLA's expansion (`fp8jax cost --gpt 125m --experts 8 --top-k 2
--batch 8`).

Where the kernels run: lowered for a GPU (a deviceless compile too) that is a Hopper,
for x and w of one 16-bit dtype (bf16 or f16) whose M, K and N are positive multiples of
128 (the kernels' 128-row and 128-column tiles, and their 64-deep contraction steps),
outside `jax.shard_map` and explicit-axis meshes (the kernels declare no sharding), under
a JAX that has them. Everywhere else `lax.ragged_dot` runs and JAX differentiates it, so
on a CPU the numbers are `lax.ragged_dot`'s bit for bit; on a Hopper GPU a call the
kernels cannot take warns once, saying why.

`lax.ragged_dot`'s semantics, which the kernels do not all keep by themselves: they write
only the rows of the groups, so the rows past sum(group_sizes) of y and dx are set to
zero after them (a select XLA fuses into the next kernel where it can), and the sizes
go to them as `lax.ragged_dot` reads them (a negative size counts as 0, rows past M are
cut). A caller whose rows all belong to a group (a dropless MoE layer: every sorted
(token, expert) pair has its expert) says so with `all_rows_grouped=True`, and the
kernels' outputs are used as they are. JAX's wgrad kernel sizes its persistent grid by
`jax.devices()[0].core_count`, which a deviceless compile on a CPU host lacks: there it
is given an H100 SXM's 132 SMs while the kernel is traced.

A custom VJP: reverse-mode differentiation only (forward mode is refused with
`fp8jax.ForwardModeError`, as for `fp8_ragged_dot`).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.mesh.axes import inside_shard_map
from fp8jax.mesh.explicit import is_explicitly_sharded
from fp8jax.mesh.partitioning import vmapped_as
from fp8jax.ops.guards import reverse_mode_only
from fp8jax.ops.ragged_dot import check_operands, hopper_possible

# JAX's tuning of its Hopper grouped GEMMs (ragged_dot_mgpu's own sweep, an H100).
MOSAIC_BLOCKS = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
                     grid_block_n=1)
# M, K and N must be multiples of this: each is a tile's rows or columns in one of the
# three kernels (128), or a multiple of their 64-deep contraction step.
_TILE = 128
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_H100_SMS = 132
_WARNED: set[str] = set()


def bf16_ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                    all_rows_grouped: bool = False) -> jax.Array:
  """`jax.lax.ragged_dot(x, w, group_sizes)`, on JAX's Hopper grouped GEMMs where they apply.

  Args:
    x: [M, K] floating, rows sorted by group.
    w: [G, K, N] floating, one [K, N] weight per group (expert).
    group_sizes: int32 [G], rows per group, >= 0 with sum <= M (checked where its values
      are known).
    all_rows_grouped: True promises sum(group_sizes) == M (every row in a group, as the
      sorted pairs of a dropless MoE layer are), which spares the kernels' outputs the
      zeroing of rows past the groups' sum; where the promise is broken those rows are
      undefined on the kernel path. Checked where the sizes' values are known.

  Returns:
    y [M, N] in the dtype `lax.ragged_dot` gives (x's, for x and w of one dtype); rows
    past sum(group_sizes) are zero. Lowered for a Hopper GPU with bf16 / f16 operands
    whose M, K, N are multiples of 128, y and both gradients come from JAX's Mosaic GPU
    grouped kernels; otherwise from `lax.ragged_dot` (see the module docstring).
  """
  check_operands(x, w, group_sizes, "bf16_ragged_dot")
  _check_all_rows_grouped(all_rows_grouped, group_sizes, x.shape[0])
  why_not = _why_kernels_cannot_run(x, w, group_sizes)
  if why_not is not None:
    _warn_on_hopper(why_not)
    return jax.lax.ragged_dot(x, w, group_sizes)
  with reverse_mode_only("fp8jax.bf16_ragged_dot", "jax.lax.ragged_dot",
                         why="its backward pass runs its own grouped GEMM kernels"):
    return _grouped(x, w, group_sizes.astype(jnp.int32), all_rows_grouped)


def _check_all_rows_grouped(all_rows_grouped, group_sizes, rows: int) -> None:
  if not isinstance(all_rows_grouped, bool):
    raise TypeError(f"all_rows_grouped={all_rows_grouped!r} must be True or False.")
  if all_rows_grouped and not isinstance(group_sizes, jax.core.Tracer):
    total = int(np.sum(np.asarray(group_sizes)))
    if total != rows:
      raise ValueError(
          f"all_rows_grouped=True, but group_sizes sums to {total}, not the {rows} rows of "
          "x: pass all_rows_grouped=False where rows past the groups must be zero.")


def _why_kernels_cannot_run(x, w, group_sizes) -> str | None:
  """Why JAX's kernels cannot take this call however it is lowered, or None if they can
  (lowered for a GPU: `jax.lax.platform_dependent` decides the rest)."""
  if not hopper_possible():
    return "the GPU is not a Hopper"
  if x.dtype != w.dtype or x.dtype not in _KERNEL_DTYPES:
    return (f"x is {x.dtype} and w {w.dtype}: the kernels take bfloat16 or float16 "
            "operands of one dtype")
  sizes = {"M": x.shape[0], "K": x.shape[1], "N": w.shape[2]}
  off_tiles = {name: size for name, size in sizes.items() if size == 0 or size % _TILE}
  if off_tiles:
    return (f"{off_tiles} not positive multiples of {_TILE}, the kernels' tiles (pad the "
            "rows or the widths to run them)")
  if inside_shard_map() or is_explicitly_sharded(x, w, group_sizes):
    return ("inside jax.shard_map or on an explicit-axis mesh, where JAX's kernels cannot "
            "say how their outputs are sharded")
  if _mosaic_kernels() is None:
    return "this JAX has no Mosaic GPU grouped GEMMs with transpose_rhs"
  return None


def _warn_on_hopper(why_not: str) -> None:
  """Warns once per reason where the process's GPU is a Hopper: there the fallback is
  XLA's dense expansion, G times the FLOPs."""
  if jax.default_backend() != "gpu" or not hopper_possible() or why_not in _WARNED:
    return
  _WARNED.add(why_not)
  warnings.warn(f"fp8jax.bf16_ragged_dot runs jax.lax.ragged_dot (on this GPU a dense "
                f"expansion: every row times every expert) instead of JAX's grouped GEMM "
                f"kernels: {why_not}.", stacklevel=3)


@functools.cache
def _mosaic_kernels() -> types.SimpleNamespace | None:
  """JAX's Hopper grouped GEMMs (`ragged`, `transposed`), or None where this JAX lacks
  them. Imported on first use: the modules load Mosaic GPU and JAX's test utilities,
  which `import fp8jax` has no need for."""
  try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
  except ImportError:
    return None
  # dgrad reads w as stored ([G, K, N]) through `transpose_rhs`; older kernels lack it.
  if "transpose_rhs" not in inspect.signature(ragged_dot_mgpu.ragged_dot).parameters:
    return None
  return types.SimpleNamespace(ragged=ragged_dot_mgpu.ragged_dot,
                               transposed=transposed_ragged_dot_mgpu.transposed_ragged_dot)


# ----- the custom VJP: each GEMM chosen where the program is lowered ---------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, group_sizes, all_rows_grouped):
  kernel = functools.partial(_kernel_fprop, all_rows_grouped=all_rows_grouped)
  return _on_hopper(kernel, _xla_fprop, x, w, group_sizes)


def _grouped_fwd(x, w, group_sizes, all_rows_grouped):
  return _grouped(x, w, group_sizes, all_rows_grouped), (x, w, group_sizes)


def _grouped_bwd(all_rows_grouped, residuals, dy):
  kernel = functools.partial(_kernel_grads, all_rows_grouped=all_rows_grouped)
  dx, dw = _on_hopper(kernel, _xla_grads, *residuals, dy)
  return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _on_hopper(kernel, xla, *args):
  """`kernel(*args)` where the program is lowered for a GPU, `xla(*args)` elsewhere and
  under `jax.vmap` (a Mosaic kernel has no batching rule)."""
  return jax.lax.platform_dependent(*args, cuda=vmapped_as(kernel, xla), default=xla)


def _xla_fprop(x, w, group_sizes):
  return jax.lax.ragged_dot(x, w, group_sizes)


def _xla_grads(x, w, group_sizes, dy):
  """(dx, dw) as JAX differentiates `lax.ragged_dot` (the same operations)."""
  _, pullback = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, group_sizes), x, w)
  return pullback(dy)


def _kernel_fprop(x, w, group_sizes, *, all_rows_grouped: bool):
  sizes = group_sizes if all_rows_grouped else _clipped(group_sizes, x.shape[0])
  with jax.named_scope("ragged_dot_mgpu"):
    y = _mosaic_kernels().ragged(x, w, group_sizes=sizes, **MOSAIC_BLOCKS)
  return y if all_rows_grouped else _zero_tail(y, sizes)


def _kernel_grads(x, w, group_sizes, dy, *, all_rows_grouped: bool):
  kernels = _mosaic_kernels()
  sizes = group_sizes if all_rows_grouped else _clipped(group_sizes, x.shape[0])
  dy = dy.astype(x.dtype)
  # dgrad: dy [M, N] against each w[g] [K, N] read as its transpose.
  with jax.named_scope("ragged_dot_mgpu"):
    dx = kernels.ragged(dy, w, group_sizes=sizes, transpose_rhs=True, **MOSAIC_BLOCKS)
  with _sm_count_for_trace(), jax.named_scope("transposed_ragged_dot_mgpu"):
    dw = kernels.transposed(x, dy, group_sizes=sizes, **MOSAIC_BLOCKS)
  return dx if all_rows_grouped else _zero_tail(dx, sizes), dw.astype(w.dtype)


def _clipped(group_sizes, rows: int):
  """The sizes as `lax.ragged_dot` reads them: negative ones 0, none past `rows`."""
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows)
  return jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype)).astype(jnp.int32)


def _zero_tail(y, sizes):
  """y with its rows past sum(sizes), which the kernels leave unwritten, set to zero."""
  rows = jax.lax.broadcasted_iota(jnp.int32, y.shape, 0)
  return jnp.where(rows < jnp.sum(sizes), y, jnp.zeros((), y.dtype))


@contextlib.contextmanager
def _sm_count_for_trace():
  """Where JAX's device has no `core_count` (a deviceless compile traced on a CPU host),
  an H100 SXM's SM count while the wgrad kernel is traced; on a GPU, nothing changes."""
  if hasattr(jax.devices()[0], "core_count"):
    yield
    return
  h100 = types.SimpleNamespace(core_count=_H100_SMS)
  with mock.patch.object(jax, "devices", lambda *args, **kwargs: [h100]):
    yield
