"""Where a train step's device time goes: its kernels grouped by what they do.

A profiler trace of a step lists kernels by name and duration (`benchmarks.device_trace`);
the compiled program says what each kernel is (`program_kernels`: its HLO instruction, the
JAX op it comes from, its operand dtypes if it is a GEMM). `RULES` turns the two into one
category per kernel, and `category_table` sums the trace by category, per step:

    kernels = program_kernels(compiled.as_text(), cost_report)
    measured = category_table(events, steps=2, kernels=kernels)
    predicted = predicted_table(cost_report, kernels)       # the cost model, same categories
    print(format_table(measured, predicted))

Categories (`CATEGORIES`, in the order the rules try them; the first rule that matches wins):

  gemm_fp8_e5m2   GEMMs with an E5M2 operand (the gradient's GEMMs under HYBRID: dgrad, wgrad)
  gemm_fp8_e4m3   GEMMs on E4M3 operands only (the forward GEMMs)
  gemm_bf16       GEMMs on bf16 or f16 operands
  gemm_other      GEMMs on other operands (f32 runs as TF32) or whose dtype is unknown
  attention       fused attention kernels: cuDNN's, fp8jax's Pallas and Mosaic ones
  fp8_cast        FP8 quantization: the `cast_transpose_amax` / `amax` Pallas kernels, and
                  any other kernel of the forward or backward pass that writes an FP8 array
                  (a norm's kernel that writes FP8 counts as the norm's, the FP8 optimizer
                  moments' kernels as the optimizer's)
  fp8_state       the FP8 state's update (`fp8_scale_update`, the step's closing of the state)
  optimizer       kernels outside the forward and backward pass: gradient clipping and the
                  optimizer's update (and a few constants computed once, e.g. rotary tables)
  norm            kernels of a norm layer (a module whose name ends in "norm")
  slice_copy      data movement: slices, dynamic (update) slices, copies, transposes,
                  concatenates, pads, broadcasts (fills), memcpy / memset
  elementwise     every other kernel XLA generated: loop and reduction fusions (residual
                  adds, GELU, rotary embedding, the loss, gradient reductions)
  other           what no rule matched: `category_table` lists these kernels by name

A kernel's name in a GPU trace is its HLO instruction's name with '.' and '-' made '_'
for kernels XLA generates (`loop_add_fusion.3` runs as `loop_add_fusion_3`; identical fusions
share the first one's kernel and name), the `name=` of a Pallas Triton kernel
(`cast_transpose_amax`, a second one `cast_transpose_amax__1`), or a library's own name for
cuBLAS (`nvjet_sm90_qqtst_...`, `sm90_xmma_gemm_...`) and cuDNN (`cudnn_generated_...sdpa...`)
kernels. A kernel event that names its HLO instruction (`hlo_op`, absent inside CUDA graphs)
is matched by that, otherwise by its name; a kernel matched to neither is categorized by its
name alone (a library GEMM's dtype from its name: `NAME_GEMM_DTYPES`). Each category lists its
kernels with the most time (`top`), so a wrong rule shows on the first trace that has one.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Iterable, Mapping, Sequence

from fp8jax.lowering.cost import CostReport
from fp8jax.lowering.gemms import find_gemms
from fp8jax.lowering.hlo_text import parse_hlo_module


@dataclasses.dataclass(frozen=True)
class Rule:
  """Kernels of `category`: those whose `field` matches `pattern` (`re.search`).

  Attributes:
    category: the category the kernel gets.
    field: what the pattern is matched against: "name" (the kernel's name in the trace),
      "op" (the JAX op path of its HLO instruction, e.g.
      'jit(train_step)/transpose(jvp(Gpt))/blocks/mlp/up/...'), "hlo" (its opcode, the
      custom-call target and the dtypes it writes: 'fusion -> f8e4m3fn,f32') or "gemm"
      (a GEMM's operand dtypes: 'f8e4m3fn,f8e5m2'; empty for other kernels).
    pattern: a regular expression.
    matches: what it matches, in words.
  """

  category: str
  field: str
  pattern: str
  matches: str


# Sanitized (XLA) or dotted (HLO) names of fusions that only move data.
_DATA_MOVEMENT = (r"(dynamic_update_slice|dynamic_slice|slice|copy|transpose|concatenate|pad|"
                  r"broadcast|bitcast)")

RULES: tuple[Rule, ...] = (
    Rule("gemm_fp8_e5m2", "gemm", r"f8e5m2", "a GEMM with an E5M2 operand"),
    Rule("gemm_fp8_e4m3", "gemm", r"f8e4m3", "a GEMM on E4M3 operands"),
    Rule("gemm_bf16", "gemm", r"^(b?f16,)*b?f16$", "a GEMM on bf16 / f16 operands"),
    Rule("gemm_other", "gemm", r".", "any other GEMM (f32, or operand dtypes unknown)"),
    Rule("attention", "name", r"cudnn|fmha|sdpa|flash_attention|hopper_attention",
         "cuDNN's attention kernels, fp8jax's Pallas flash / Hopper attention kernels"),
    Rule("attention", "hlo", r"cudnn\$fmha", "XLA's cuDNN attention custom calls"),
    Rule("attention", "op", r"dot_product_attention|/attention/jit\((forward|backward)\)/",
         "kernels of jax.nn.dot_product_attention or of fp8jax's attention kernels' "
         "forward / backward calls"),
    Rule("fp8_cast", "name", r"cast_transpose|^amax", "fp8jax's cast / amax Pallas kernels"),
    Rule("fp8_cast", "op", r"cast_transpose\w*/pallas_call|/amax/pallas_call",
         "the same kernels by their JAX op path"),
    Rule("fp8_state", "name", r"scale_update", "fp8jax's scale-update Pallas kernel"),
    Rule("fp8_state", "op", r"scale_update|jit\(_close_call\)",
         "closing the step's FP8 state (amax histories, scales)"),
    Rule("optimizer", "op", r"^jit\((?!.*\b(jvp|transpose)\()",
         "a kernel of the jitted step outside the gradient (no jvp( / transpose( in its op "
         "path): clipping, the optimizer update"),
    Rule("norm", "op", r"norm/", "a kernel inside a module whose name ends in 'norm'"),
    Rule("fp8_cast", "hlo", r"-> .*f8e", "another kernel that writes an FP8 array"),
    Rule("slice_copy", "name",
         rf"^(wrapped_|loop_|input_)?{_DATA_MOVEMENT}(_{_DATA_MOVEMENT})*(_fusion)?([._]\d+)*$",
         "an XLA kernel named only for data movement (wrapped_slice.3, "
         "loop_dynamic_update_slice_fusion_2, copy_7, input_concatenate_fusion)"),
    Rule("slice_copy", "name", r"^[Mm]em(cpy|set)", "a memcpy or memset"),
    Rule("slice_copy", "hlo", r"^(copy|copy-start|dynamic-slice|dynamic-update-slice|slice|"
         r"transpose|concatenate|pad|broadcast)\b", "an unfused data-movement op"),
    Rule("elementwise", "hlo", r"^(?!custom-call)\S", "any other kernel XLA generated"),
    Rule("elementwise", "name", r"fusion|^(wrapped|loop|input)_",
         "an XLA fusion's kernel not found in the program"),
)
CATEGORIES: tuple[str, ...] = tuple(dict.fromkeys(r.category for r in RULES)) + ("other",)

# A library GEMM kernel that no HLO instruction names: its operand dtypes from its name
# (first match). cuBLAS's nvjet kernels spell FP8 operands as q (E4M3) and r (E5M2)
# before their tile shape ('nvjet_sm90_qrtst_...'; an H100 trace of fp8_dense's three
# GEMMs shows qq, qr and rq), and bf16 ones without ('nvjet_sm90_tst_..._h_...');
# xmma and CUTLASS kernels spell their types out.
NAME_GEMM_DTYPES: tuple[tuple[str, str], ...] = (
    (r"nvjet_(sm\d+_)?(qr|rq|rr)|e5m2", "f8e5m2"),
    (r"nvjet_(sm\d+_)?qq|e4m3", "f8e4m3fn"),
    (r"nvjet|bf16", "bf16"),
    (r"gemm|gemv|xmma|cutlass|splitKreduce", "?"),
)


@dataclasses.dataclass(frozen=True)
class HloKernel:
  """What the compiled program says about one kernel (see `Rule` for the fields)."""

  name: str
  op: str
  hlo: str
  gemm: str


def program_kernels(hlo_text: str, report: CostReport) -> dict[str, HloKernel]:
  """The kernels of a compiled program by HLO instruction name.

  Args:
    hlo_text: the optimized HLO (`compiled.as_text()`).
    report: `fp8jax.lowering.cost.cost_hlo` of the same text (which instructions launch a
      kernel, and which of them are GEMMs).

  Returns:
    {instruction name: HloKernel}.
  """
  module = parse_hlo_module(hlo_text)
  instructions = {i.name: i for c in module.computations.values()
                  for i in c.instructions.values()}
  gemm_dtypes = {g.name: g.operand_dtypes for g in find_gemms(module)}
  kernels = {}
  for k in report.kernels:
    instr = instructions.get(k.name)
    if instr is None:
      continue
    target = instr.attributes.get("custom_call_target", "").strip('"')
    writes = ",".join(s.dtype for s in instr.shapes)
    dtypes = gemm_dtypes.get(k.name) or ((k.gemm_dtype,) if k.is_gemm else ())
    kernels[k.name] = HloKernel(name=k.name, op=k.op_name,
                                hlo=f"{instr.opcode}{' ' + target if target else ''} -> {writes}",
                                gemm=",".join(d or "?" for d in dtypes))
  return kernels


def kernel_name(hlo_name: str) -> str:
  """The name XLA gives the GPU kernel of an HLO instruction ('loop_add_fusion.3' ->
  'loop_add_fusion_3')."""
  return re.sub(r"[^A-Za-z0-9_]", "_", hlo_name)


def categorize(name: str, kernel: HloKernel | None, rules: Sequence[Rule] = RULES) -> str:
  """The category of a kernel named `name`, described by `kernel` where the program has it."""
  fields = {"name": name, "op": "", "hlo": "", "gemm": ""}
  if kernel is not None:
    fields.update(op=kernel.op, hlo=kernel.hlo, gemm=kernel.gemm)
  else:
    fields["gemm"] = next((dtype for pattern, dtype in NAME_GEMM_DTYPES
                           if re.search(pattern, name)), "")
  for rule in rules:
    value = fields[rule.field]
    if value and re.search(rule.pattern, value):
      return rule.category
  return "other"


class _Resolver:
  """Finds a trace kernel's HLO instruction: by the event's `hlo_op`, else by its name."""

  def __init__(self, kernels: Mapping[str, HloKernel]):
    self.kernels = kernels
    self.by_kernel_name = {}
    for name, kernel in kernels.items():
      self.by_kernel_name.setdefault(kernel_name(name), kernel)
    self.counts = collections.Counter()

  def __call__(self, name: str, hlo_op: str) -> HloKernel | None:
    for how, found in (("hlo_op", self.kernels.get(hlo_op)),
                       ("name", self.kernels.get(name) or self.by_kernel_name.get(name))):
      if found is not None:
        self.counts[how] += 1
        return found
    self.counts["unresolved"] += 1
    return None


def category_table(events: Iterable, steps: int, kernels: Mapping[str, HloKernel] | None = None,
                   rules: Sequence[Rule] = RULES, top: int = 5) -> dict:
  """Device time per category, per step, from a trace of `steps` steps.

  Args:
    events: the trace's kernels (`benchmarks.device_trace.KernelEvent`: name, hlo_op,
      start_us, duration_us).
    steps: how many steps the trace holds (everything is divided by it).
    kernels: `program_kernels` of the traced program (None: categorize by name alone).
    rules: the rules to apply.
    top: how many kernel names to list per category (`other` lists three times as many).

  Returns:
    {"steps", "kernels", "span_s", "busy_s", "gaps_s", "kernel_s" (all per step: kernel
    launches, first start to last end, time some kernel ran, span less busy, the sum of
    kernel durations), "resolved" ({"hlo_op" | "name" | "unresolved": kernels}),
    "streams" (the streams or threads the kernels ran on),
    "by_category": {category: {"seconds", "kernels", "top": [[name, seconds, kernels]]}}},
    categories in `CATEGORIES` order, those without kernels left out.
  """
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps={steps!r} must be a positive int: the steps the trace holds.")
  events = list(events)
  resolve = _Resolver(kernels or {})
  seconds, launches = collections.Counter(), collections.Counter()
  by_name: dict = collections.defaultdict(collections.Counter)
  names_count: dict = collections.defaultdict(collections.Counter)
  for e in events:
    category = categorize(e.name, resolve(e.name, e.hlo_op), rules)
    seconds[category] += e.duration_us * 1e-6
    launches[category] += 1
    by_name[category][e.name] += e.duration_us * 1e-6
    names_count[category][e.name] += 1
  span = (max(e.start_us + e.duration_us for e in events) - min(e.start_us for e in events)
          if events else 0.0) * 1e-6
  busy = _union_us(events) * 1e-6
  table = {"steps": steps, "kernels": len(events) / steps, "span_s": span / steps,
           "busy_s": busy / steps, "gaps_s": (span - busy) / steps,
           "kernel_s": sum(seconds.values()) / steps, "resolved": dict(resolve.counts),
           "streams": sorted({e.stream for e in events}), "by_category": {}}
  for category in CATEGORIES:
    if launches[category]:
      listed = top * 3 if category == "other" else top
      table["by_category"][category] = {
          "seconds": seconds[category] / steps, "kernels": launches[category] / steps,
          "top": [[name, s / steps, names_count[category][name] / steps]
                  for name, s in by_name[category].most_common(listed)]}
  return table


def predicted_table(report: CostReport, kernels: Mapping[str, HloKernel],
                    rules: Sequence[Rule] = RULES) -> dict:
  """The cost model's time and launches per category for one step of `report`'s program.

  Returns:
    {category: {"seconds", "kernels"}}, in `CATEGORIES` order.
  """
  seconds, launches = collections.Counter(), collections.Counter()
  for k in report.kernels:
    category = categorize(kernel_name(k.name), kernels.get(k.name), rules)
    seconds[category] += k.time_s
    launches[category] += k.launches
  return {c: {"seconds": seconds[c], "kernels": launches[c]} for c in CATEGORIES if launches[c]}


def format_table(measured: dict, predicted: dict | None = None, title: str = "") -> str:
  """The tables as text: one row per category, measured beside predicted, then the totals."""
  predicted = predicted or {}
  header = f"{'category':<14} {'ms/step':>9} {'kernels':>8} {'predicted ms':>13} {'kernels':>8}"
  lines = ([title] if title else []) + [header, "-" * len(header)]
  for category in CATEGORIES:
    row, guess = measured["by_category"].get(category), predicted.get(category)
    if row is None and guess is None:
      continue
    ms = f"{row['seconds'] * 1e3:9.3f} {row['kernels']:8.0f}" if row else f"{'-':>9} {'-':>8}"
    pms = (f"{guess['seconds'] * 1e3:13.3f} {guess['kernels']:8d}" if guess
           else f"{'-':>13} {'-':>8}")
    lines.append(f"{category:<14} {ms} {pms}")
  lines.append(f"{'gaps':<14} {measured['gaps_s'] * 1e3:9.3f}")
  total = sum(g["seconds"] for g in predicted.values())
  lines.append(f"{'span':<14} {measured['span_s'] * 1e3:9.3f} {measured['kernels']:8.0f} "
               f"{total * 1e3:13.3f} {sum(g['kernels'] for g in predicted.values()):8d}")
  other = measured["by_category"].get("other")
  if other:
    lines.append("other: " + ", ".join(f"{n} ({s * 1e3:.3f} ms)" for n, s, _ in other["top"]))
  return "\n".join(lines)


def _union_us(events) -> float:
  """Microseconds during which at least one of `events` ran (overlaps counted once)."""
  total, end = 0.0, None
  for start, stop in sorted((e.start_us, e.start_us + e.duration_us) for e in events):
    if end is None or start > end:
      total += stop - start
      end = stop
    elif stop > end:
      total += stop - end
      end = stop
  return total
