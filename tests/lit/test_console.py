"""The console: the plan names the warm-start / RL boundary and says when no RL step will run."""

from trace_lightning.lit.console import plan_lines


def test_plan_names_where_the_warm_start_ends() -> None:
    assert plan_lines(0, 300, 250, "trace_compact") == [
        "steps 0-249: supervised warm start", "steps 250-299: RL with trace_compact (50 steps)"]


def test_plan_without_warm_start_or_after_resume_is_rl_only() -> None:
    assert plan_lines(0, 10, 0, "fp4_qat") == ["steps 0-9: RL with fp4_qat (10 steps)"]
    assert plan_lines(260, 300, 250, "trace") == ["steps 260-299: RL with trace (40 steps)"]


def test_max_steps_inside_the_warm_start_says_no_rl_step_will_run() -> None:
    (line,) = plan_lines(0, 100, 250, "trace_compact")
    assert "no RL step will run" in line and "100" in line and "250" in line
