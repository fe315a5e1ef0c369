"""One kernel that closes a delayed-scaling step for many tensor roles at once.

At the end of a training step every FP8 tensor role (x, kernel, grad of every
layer) pushes the step's amax into its history and gets a new scale. Written in
jnp, XLA compiles that into a few kernels *per role* (it does not fuse
independent small outputs into one kernel), so the update of a deep model is
dozens of tiny launches. This kernel does all roles of one call in a single
launch: it reads each role's arrays and writes each role's outputs directly,
so nothing is concatenated or split around it.

Per role, with history length L and `numerator = fmt_max / 2**margin`:

    amax      = max(amax, other_amax)   when a second amax per role is given (what
                                        the forward and the backward pass recorded)
    finite    = |amax| < inf                       (false for NaN and inf)
    history'  = [finite ? amax : 0, history[0], ..., history[L-2]]
    window    = max(history')    ("max")   or   history'[0]    ("most_recent")
    candidate = numerator / window, if window > 0 and finite and the quotient is
                finite and > 0; else scale
    scale'    = candidate if finite and amax > 0, else scale
    scale_inv'= 1 / scale'
    amax'     = 0

The max of two amaxes is taken on their bit patterns (amaxes are >= 0 or NaN,
and for those the int32 order is the float order with NaN above inf), so a NaN
on either side survives on every backend. Divisions are IEEE round-to-nearest (`div.rn.f32`): Triton's own float32 `/`
is an approximate division, which would make the scales differ from the same
update computed by XLA on another platform. `close_steps_reference` is the same
update in jnp, the definition the kernel matches bit for bit.

Every role's arrays are passed as 1-D [n] (amax, scale) and 1-D [n * L]
(history, row-major [n, L]); a meta stacked over n layers is one role with n
rows. A launch carries at most `ROLES_PER_CALL` roles, keeping its pointer
arguments (seven to ten per role, 320 pointers at most) well inside the kernel parameter
limit.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.varying import check_summed, out_struct, varying_axes

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
ROLES_PER_CALL = 32


def close_steps(amaxes, histories, scales, numerators, *, history_len: int,
                amax_compute_algo: str, other_amaxes=None, packed: bool = False,
                in_place: Sequence[bool] | None = None, written_over=None,
                interpret: bool = False):
  """Closes one delayed-scaling step for every role, in ceil(roles / 32) launches.

  Args:
    amaxes: list of float32[n_i], each role's step amax (n_i rows; 1 for an
      unstacked role).
    other_amaxes: optional second list like `amaxes`, max-combined with it first.
    histories: list of float32[n_i * L], each role's amax history, row-major [n_i, L].
    scales: list of float32[n_i], each role's current scale.
    numerators: list of Python floats, `fmt_max / 2**margin` per role.
    history_len: L.
    amax_compute_algo: "max" or "most_recent".
    packed: give each launch its roles' amaxes, other amaxes, histories and
      scales concatenated in one vector instead of one operand per role and
      kind. The same results. Where those arrays are slices of one vector
      already (the state after one all-reduce, `fp8jax.all_reduce_amax`), XLA
      makes the concatenation one small kernel, where the slices would be a
      kernel each. Inside `shard_map` only arrays that vary alike are packed
      (each output must vary as what it is computed from).
    in_place: optional sequence of bools, one per role: write the role's new history and
      scale over its old ones (input/output aliases; not with `packed`). For a history
      that is the step's own state, donated: XLA then updates it where it is instead of
      copying the result there after the launch. Not for one an earlier kernel wrote (a
      cast's copy): there the result would be copied into the state's buffer instead.
    written_over: optional pair `(scale_invs, amaxes)` of lists like `scales`: the old
      state's arrays that each `in_place` role's scale_inv and amax (0) outputs are
      written over (input/output aliases; never read). Pass the step's donated state:
      then no in-place role's array of it is pruned as unused, so JAX pairs each
      donated buffer with its own new value and XLA copies nothing into the state
      after the launch.
    interpret: run the Pallas interpreter (CPU).

  Returns:
    (scales, scale_invs, histories, amaxes): lists shaped like the inputs; the
    amaxes are 0.
  """
  _check(amaxes, histories, scales, numerators, history_len, amax_compute_algo, other_amaxes)
  in_place = tuple(bool(v) for v in in_place) if in_place is not None else (False,) * len(amaxes)
  if len(in_place) != len(amaxes):
    raise ValueError(f"in_place has {len(in_place)} entries for {len(amaxes)} roles; give one "
                     "per role.")
  if packed and any(in_place):
    raise ValueError("in_place takes per-role histories; packed=True gives the launch one "
                     "vector of every role's. Pass one of them.")
  if written_over is not None:
    _check_written_over(written_over, scales)
  outputs = ([], [], [], [])
  for start in range(0, len(amaxes), ROLES_PER_CALL):
    part = slice(start, start + ROLES_PER_CALL)
    arrays = [tuple(amaxes[part]), tuple(other_amaxes[part]) if other_amaxes is not None else (),
              tuple(histories[part]), tuple(scales[part])]
    rows = tuple(int(a.shape[0]) for a in arrays[0])
    flat = [a for kind in arrays for a in kind]
    pack = packed and len({varying_axes(a) for a in flat}) == 1
    if pack:  # one vector of amaxes, other amaxes, histories and scales
      vector = jnp.concatenate(flat)
      arrays = [(vector,) if kind else () for kind in arrays]
    # The old scale_invs and amaxes of the roles written in place, in role order.
    spares = tuple(
        tuple(old for old, here in zip(kind[part], in_place[part]) if here and not pack)
        for kind in (written_over or ((), ())))
    results = _close_call(*arrays, *spares,
                          tuple(float(v) for v in numerators[part]), rows, history_len,
                          amax_compute_algo, pack, () if pack else in_place[part], interpret)
    for collected, produced in zip(outputs, results):
      collected.extend(produced)
  return outputs


def close_steps_reference(amaxes, histories, scales, numerators, *, history_len: int,
                          amax_compute_algo: str, other_amaxes=None):
  """`close_steps` in plain jnp."""
  _check(amaxes, histories, scales, numerators, history_len, amax_compute_algo, other_amaxes)
  outputs = ([], [], [], [])
  others = other_amaxes if other_amaxes is not None else [None] * len(amaxes)
  for amax, other, history, scale, numerator in zip(amaxes, others, histories, scales,
                                                    numerators):
    if other is not None:
      amax = amax_max(amax, other)
    history = history.reshape(-1, history_len)
    finite = jnp.abs(amax) < jnp.inf
    recorded = jnp.where(finite, amax, 0.0)
    history = jnp.concatenate([recorded[:, None], history[:, :history_len - 1]], axis=1)
    window = jnp.max(history, axis=1) if amax_compute_algo == "max" else history[:, 0]
    candidate = jnp.float32(numerator) / window
    usable = ((jnp.abs(window) < jnp.inf) & (window > 0) & (jnp.abs(candidate) < jnp.inf) &
              (candidate > 0))
    new_scale = jnp.where(finite & (amax > 0), jnp.where(usable, candidate, scale), scale)
    for collected, value in zip(outputs, (new_scale, 1.0 / new_scale, history.reshape(-1),
                                          jnp.zeros_like(amax))):
      collected.append(value)
  return outputs


def amax_max(a, b):
  """max(a, b) of two amaxes (>= 0 or NaN) on their bit patterns: NaN wins on any backend."""
  a_bits = jax.lax.bitcast_convert_type(a, jnp.int32)
  b_bits = jax.lax.bitcast_convert_type(b, jnp.int32)
  return jax.lax.bitcast_convert_type(jnp.maximum(a_bits, b_bits), jnp.float32)


def _check(amaxes, histories, scales, numerators, history_len, amax_compute_algo,
           other_amaxes=None):
  if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
    raise ValueError(f"amax_compute_algo={amax_compute_algo!r} must be one of "
                     f"{AMAX_COMPUTE_ALGOS}.")
  if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
    raise ValueError(f"history_len={history_len!r} must be an integer >= 1.")
  counts = {len(amaxes), len(histories), len(scales), len(numerators)}
  if len(counts) != 1:
    raise ValueError("amaxes, histories, scales and numerators must list the same roles; got "
                     f"{len(amaxes)}, {len(histories)}, {len(scales)} and {len(numerators)}.")
  if other_amaxes is not None and [jnp.shape(a) for a in other_amaxes] != [
      jnp.shape(a) for a in amaxes]:
    raise ValueError("other_amaxes must have the shapes of amaxes, role by role.")
  for i, (amax, history, scale) in enumerate(zip(amaxes, histories, scales)):
    rows = jnp.shape(amax)
    if (len(rows) != 1 or jnp.shape(scale) != rows or
        jnp.shape(history) != (rows[0] * history_len,)):
      raise ValueError(
          f"role {i}: amax {jnp.shape(amax)}, scale {jnp.shape(scale)} and history "
          f"{jnp.shape(history)} must be [n], [n] and [n * {history_len}].")
    for name, value in (("amax", amax), ("history", history), ("scale", scale)):
      if jnp.result_type(value) != jnp.float32:
        raise TypeError(f"role {i}: {name} must be float32, got {jnp.result_type(value)}.")


def _check_written_over(written_over, scales) -> None:
  if len(written_over) != 2:
    raise ValueError("written_over must be a pair (scale_invs, amaxes) of lists like scales; "
                     f"got {len(written_over)} entries.")
  for name, kind in zip(("scale_invs", "amaxes"), written_over):
    if [jnp.shape(a) for a in kind] != [jnp.shape(s) for s in scales]:
      raise ValueError(
          f"written_over's {name} must have the shapes of scales, role by role; got "
          f"{[jnp.shape(a) for a in kind]} for {[jnp.shape(s) for s in scales]}. Pass the "
          "old state's arrays of those roles, or written_over=None.")
    for i, a in enumerate(kind):
      if jnp.result_type(a) != jnp.float32:
        raise TypeError(f"written_over's {name}: role {i} must be float32, got "
                        f"{jnp.result_type(a)}.")


def _next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _divide(numerator, denominator, interpret):
  """IEEE float32 division (Triton's `/` is approximate on NVIDIA GPUs)."""
  if interpret:
    return numerator / denominator
  numerator = jnp.broadcast_to(numerator, denominator.shape).astype(jnp.float32)
  (quotient,) = plgpu.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[numerator, denominator], constraints="=r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(denominator.shape, jnp.float32)])
  return quotient


def _close_role(amax_ref, other_ref, history_ref, scale_ref, out_scale_ref, out_scale_inv_ref,
                out_history_ref, out_amax_ref, *, rows, starts, numerator, history_len, algo,
                in_place, interpret):
  """One role's update. Its amax, other amax, history and scale start at the element
  offsets `starts` of their refs (all 0 unless packed into one ref)."""
  amax_at, other_at, history_at, scale_at = starts
  rows_p = _next_power_of_two(rows)
  cols_p = _next_power_of_two(history_len)
  row = jax.lax.iota(jnp.int32, rows_p)
  row_mask = row < rows
  amax = plgpu.load(amax_ref.at[amax_at + row], mask=row_mask, other=0.0)
  if other_ref is not None:
    amax = amax_max(amax, plgpu.load(other_ref.at[other_at + row], mask=row_mask, other=0.0))
  scale = plgpu.load(scale_ref.at[scale_at + row], mask=row_mask, other=1.0)
  finite = jnp.abs(amax) < jnp.inf
  recorded = jnp.where(finite, amax, 0.0)

  # history'[r, c + 1] = history[r, c] for c < L - 1; history'[r, 0] = recorded[r].
  row2 = jax.lax.broadcasted_iota(jnp.int32, (rows_p, cols_p), 0)
  col2 = jax.lax.broadcasted_iota(jnp.int32, (rows_p, cols_p), 1)
  kept_mask = (row2 < rows) & (col2 < history_len - 1)
  kept = plgpu.load(history_ref.at[history_at + row2 * history_len + col2], mask=kept_mask,
                    other=0.0)
  if in_place and not interpret:
    # An in-place role's history and scale are written over themselves (all or none:
    # `_in_place_aliases`), so every load of the role (its amax, scale and history
    # above) comes before this barrier and every store after it. The history is rolled
    # over itself: every thread's load is done before any thread
    # stores (a barrier, which the compiler moves no memory access across either).
    plgpu.debug_barrier()
  plgpu.store(out_history_ref.at[row2 * history_len + col2 + 1], kept, mask=kept_mask)
  plgpu.store(out_history_ref.at[row * history_len], recorded, mask=row_mask)

  if algo == "max":
    # Entries are finite and >= 0 (every recorded amax was), so 0 is neutral.
    window = jnp.maximum(recorded, jnp.max(jnp.where(kept_mask, kept, 0.0), axis=1))
  else:
    window = recorded
  candidate = _divide(jnp.float32(numerator), jnp.where(row_mask, window, 1.0), interpret)
  usable = ((jnp.abs(window) < jnp.inf) & (window > 0) & (jnp.abs(candidate) < jnp.inf) &
            (candidate > 0))
  new_scale = jnp.where(finite & (amax > 0), jnp.where(usable, candidate, scale), scale)
  scale_inv = _divide(jnp.float32(1.0), jnp.where(row_mask, new_scale, 1.0), interpret)
  plgpu.store(out_scale_ref.at[row], new_scale, mask=row_mask)
  plgpu.store(out_scale_inv_ref.at[row], scale_inv, mask=row_mask)
  plgpu.store(out_amax_ref.at[row], jnp.zeros_like(amax), mask=row_mask)


def _close_kernel(*refs, row_counts, numerators, history_len, algo, interpret, has_other,
                  packed, spare_inputs, rolled_in_place):
  """refs: the inputs, then the four outputs (one ref per role each).

  The inputs are one ref per role for amaxes, other amaxes (if any), histories
  and scales in that order, or (`packed`) one ref holding all of them in that
  order, concatenated; then `spare_inputs` buffers that outputs are written over,
  never read. `rolled_in_place[i]`: role i's history and scale outputs are its inputs'
  buffers.
  """
  roles = len(row_counts)
  n_inputs = (1 if packed else roles * (4 if has_other else 3)) + spare_inputs
  inputs, outs = refs[:n_inputs], refs[n_inputs:]
  out_scale, out_scale_inv, out_history, out_amax = (
      outs[k * roles:(k + 1) * roles] for k in range(4))
  for i in range(roles):
    role_inputs, starts = (_packed_role(inputs[0], i, row_counts, history_len, has_other)
                           if packed else _own_role(inputs, i, roles, has_other))
    _close_role(*role_inputs, out_scale[i], out_scale_inv[i], out_history[i], out_amax[i],
                rows=row_counts[i], starts=starts, numerator=numerators[i],
                history_len=history_len, algo=algo, in_place=rolled_in_place[i],
                interpret=interpret)


def _own_role(inputs, i, roles, has_other):
  """Role i's (amax, other amax or None, history, scale) refs, one per kind, from 0."""
  kinds = [inputs[k * roles:(k + 1) * roles] for k in range(4 if has_other else 3)]
  amax, other, history, scale = (
      (k[i] for k in kinds) if has_other else (kinds[0][i], None, kinds[1][i], kinds[2][i]))
  return (amax, other, history, scale), (0, 0, 0, 0)


def _packed_role(ref, i, row_counts, history_len, has_other):
  """Role i's refs and element offsets in the one packed vector [amaxes | other amaxes |
  histories | scales] of all roles."""
  total, row = sum(row_counts), sum(row_counts[:i])
  histories_at = total * (2 if has_other else 1)
  scales_at = histories_at + total * history_len
  starts = (row, total + row, histories_at + row * history_len, scales_at + row)
  return (ref, ref if has_other else None, ref, ref), starts


@functools.partial(jax.jit, static_argnums=(6, 7, 8, 9, 10, 11, 12))
def _close_call(amaxes, others, histories, scales, old_scale_invs, old_amaxes, numerators,
                row_counts, history_len, algo, packed, in_place, interpret):
  """One launch. Each input is a tuple with one array per role; or (`packed`) each is
  a 1-tuple of the same vector holding all of them (`_close_kernel`). `old_scale_invs`
  and `old_amaxes`: one array per `in_place` role, or none (`close_steps`'s
  `written_over`)."""
  roles = len(row_counts)
  operands = (*amaxes, *others, *histories, *scales, *old_scale_invs, *old_amaxes)
  check_summed(operands)
  if packed:
    # Each kind is the one packed vector, which every role reads: repeat it per role
    # for the declarations below.
    amaxes, histories, scales = ((kind[0],) * roles for kind in (amaxes, histories, scales))
    others = (others[0],) * roles if others else ()
    operands = operands[:1]
  # Inside shard_map each output varies as the inputs it is computed from: the
  # step's amax (and the amax output, zeros like it) from the role's amaxes, the
  # rolled history from them and the history, the scales from all four.
  recorded = [varying_axes(a, o) for a, o in zip(amaxes, others or [None] * roles)]
  rolled = [axes | varying_axes(h) for axes, h in zip(recorded, histories)]
  scaled = [axes | varying_axes(s) for axes, s in zip(rolled, scales)]
  vector = lambda sizes, kinds: [out_struct((n,), jnp.float32, axes)
                                 for n, axes in zip(sizes, kinds)]
  out_shape = (*vector(row_counts, scaled), *vector(row_counts, scaled),
               *vector([rows * history_len for rows in row_counts], rolled),
               *vector(row_counts, recorded))
  aliases = _in_place_aliases(roles, bool(others), in_place, histories, scales,
                              (old_scale_invs, old_amaxes), (rolled, scaled, recorded))
  kernel = functools.partial(_close_kernel, row_counts=row_counts, numerators=numerators,
                             history_len=history_len, algo=algo, interpret=interpret,
                             has_other=bool(others), packed=packed,
                             spare_inputs=len(old_scale_invs) + len(old_amaxes),
                             rolled_in_place=tuple(2 * roles + i in aliases.values()
                                                   for i in range(roles)))
  flat = pl.pallas_call(
      kernel, out_shape=out_shape, interpret=interpret, name="fp8_scale_update",
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
  )(*operands)
  return tuple(list(flat[k * roles:(k + 1) * roles]) for k in range(4))


def _in_place_aliases(roles, has_other, in_place, histories, scales, spares, varies) -> dict:
  """The input/output aliases that write each `in_place` role's new history and scale
  over its old ones, and its scale_inv and amax over the `spares` (old scale_invs, old
  amaxes: one per in-place role) where given. Safe in place: one program updates a
  role after it has loaded all of it. Not where an output would vary over other
  `shard_map` axes than the buffer it is written over (`varies`: how each role's history,
  scale (and scale_inv) and amax outputs vary)."""
  histories_at = roles * (2 if has_other else 1)
  scales_at = histories_at + roles
  spares_at = (scales_at + roles, scales_at + roles + len(spares[0]))
  rolled, scaled, recorded = varies
  aliases, spare = {}, 0
  for i in range(roles):
    if not (in_place and in_place[i]):
      continue
    writes = [(histories_at + i, 2 * roles + i, histories[i], rolled[i]),
              (scales_at + i, i, scales[i], scaled[i])]
    for kind, (at, out_at, varied) in enumerate(
        ((spares_at[0], roles, scaled), (spares_at[1], 3 * roles, recorded))):
      if spares[kind]:
        writes.append((at + spare, out_at + i, spares[kind][spare], varied[i]))
    spare += 1
    if all(varying_axes(old) == varied for _, _, old, varied in writes):
      aliases.update({operand: output for operand, output, _, _ in writes})
  return aliases
