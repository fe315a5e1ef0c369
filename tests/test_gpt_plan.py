"""The GPU check's GPT rows: their order, the time budget that drops them, their summary."""
from __future__ import annotations

import pytest

from benchmarks import gpt, gpt_plan, gpu_check
from benchmarks.gpt_plan import Budget, Row


def _rows():
  return (Row("a", 1, 8, "bf16", estimate_s=10), Row("a", 1, 8, "delayed", estimate_s=20),
          Row("b", 1, 8, "bf16", estimate_s=10), Row("b", 1, 8, "delayed", estimate_s=30),
          Row("a", 1, 8, "current", estimate_s=5))


def test_rows_run_in_order_while_they_fit_and_a_bf16_row_only_with_its_fp8_partner():
  # 45 s: a's pair (30 s); b's bf16 would fit alone (10 <= 15) but not with its partner
  # (40), which does not fit either; a's current scaling (5) still does.
  assert gpt_plan.expected_to_run(_rows(), 45) == [True, True, False, False, True]
  assert gpt_plan.expected_to_run(_rows(), 75) == [True] * 5
  assert gpt_plan.expected_to_run(_rows(), 5) == [False, False, False, False, True]
  text = gpt_plan.format_plan(_rows(), 45)
  assert text.count("dropped if the estimates hold") == 2 and "total ~  35 s" in text


def test_the_budget_scales_estimates_by_what_rows_took():
  now = [0.0]
  budget = Budget(100, clock=lambda: now[0])
  first, second, third = (Row("a", 1, 8, "delayed", estimate_s=s) for s in (20, 25, 20))
  assert budget.left_s(first) == 100 and budget.fits(first)
  now[0] = 40.0
  budget.ran(first, 40.0)  # twice its estimate: the next rows need twice theirs
  assert budget.scale == 2 and budget.needs_s(second) == 50 and budget.fits(second)
  now[0] = 90.0
  budget.ran(second, 50.0)
  assert budget.left_s(third) == 10 and not budget.fits(third)
  assert "10 s left" in budget.drop_reason(third) and "about 40 s" in budget.drop_reason(third)


def test_only_essential_rows_may_take_the_time_kept_for_later_rows():
  budget = Budget(100, reserve_s=60, clock=lambda: 0.0)
  pair = (Row("a", 1, 8, "bf16", estimate_s=30, essential=True),
          Row("a", 1, 8, "delayed", estimate_s=40, essential=True))
  variant = Row("a", 1, 8, "current", estimate_s=50)
  assert budget.fits(pair[0], pair[1]) and not budget.fits(variant)
  assert budget.left_s(pair[0]) == 100 and budget.left_s(variant) == 40
  assert gpt_plan.expected_to_run(pair + (variant,), 100, reserve_s=60) == [True, True, False]
  assert gpt_plan.expected_to_run((variant,) + pair, 100, reserve_s=60) == [False, True, True]


def test_the_check_measures_each_size_s_pair_first_and_1b_variants_after_350m_ones():
  labels = [r.label for r in gpt_plan.GPT_ROWS]
  assert labels[:4] == ["350m bf16", "350m delayed", "1b bf16", "1b delayed"]
  assert labels[4:] == ["350m delayed, adamw_fp8, fp8 saved", "350m current",
                        "1b delayed, adamw_fp8, fp8 saved", "1b current"]
  assert {(r.size, r.batch, r.seq) for r in gpt_plan.GPT_ROWS} == {("350m", 8, 1024),
                                                                   ("1b", 8, 2048)}
  assert [(r.model, r.batch, r.variant) for r in gpt_plan.MOE_ROWS] == [
      ("125m, 8 experts top-2", 32, "bf16"),
      ("125m, 8 experts top-2", 32, "delayed, adamw_fp8, fp8 saved")]
  assert [r.essential for r in gpt_plan.GPT_ROWS] == [True] * 4 + [False] * 4
  # By the estimates, the two pairs and the MoE rows fit the GPT sections' time.
  moe = sum(r.estimate_s for r in gpt_plan.MOE_ROWS)
  runs = gpt_plan.expected_to_run(gpt_plan.GPT_ROWS, gpt_plan.GPT_BUDGET_S, reserve_s=moe)
  assert runs[:4] == [True] * 4


def _measured(variant, recipe, tokens_per_s, measured_ms, predicted_ms):
  return {"model": "350m", "size": "350m", "batch": 8, "seq": 1024, "variant": variant,
          "recipe": recipe, "requested_backend": "auto", "tokens_per_s": tokens_per_s,
          "step": {"median_s": measured_ms / 1e3}, "memory": {"total": 2**30},
          "predicted": {"step_s": predicted_ms / 1e3,
                        "measured_over_predicted": measured_ms / predicted_ms}}


def test_the_summary_and_highlights_give_speedups_and_measured_against_predicted():
  rows = [_measured("bf16", "bf16", 100.0, 40.0, 32.0),
          _measured("delayed", "delayed", 130.0, 30.0, 27.0),
          {"model": "350m", "variant": "current", "recipe": "current",
           "requested_backend": "auto", "dropped": "not enough time"}]
  models = gpt.summarize(rows)
  assert models["350m"]["fp8_speedup_vs_bf16"] == {"delayed": pytest.approx(1.3)}
  assert models["350m"]["step_ms"]["bf16"]["measured_over_predicted"] == pytest.approx(1.25)
  plan = [{"label": "350m bf16", "status": "ran"}, {"label": "350m delayed", "status": "ran"},
          {"label": "350m current", "status": "dropped", "reason": "not enough time"}]
  found = gpu_check._gpt_highlights({"models": models, "plan": plan})
  assert found["350m"]["tokens_per_s"] == {"bf16": 100, "delayed": 130}
  assert found["350m"]["step_ms"]["delayed"] == {"measured": 30.0, "predicted": 27.0,
                                                 "measured_over_predicted": 1.111}
  assert found["not_run"] == {"350m current": "not enough time"}
