"""The scheduler's settings: the paper's policy named once, and `serve --scheduler KEY=VALUE` from the model."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from support import write_profile
from thunderctl.cli import app
from thunderctl.profile import ProfileError, load_profile
from thunderctl.scheduler import PauseOrder, PlacementRule, SchedulerConfig
from thunderctl.settings import allowed, shown
from thunderctl.sim.arms import ArmName, build_router
from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.presets import get_preset

# The simulator's `reference` arm as it was written out before the policy had a name: the
# figures of docs/evidence/sim-*.md and docs/admission.md were measured with it.
PAPERS_ARM = SchedulerConfig(
    adaptive=False, retention=False, resume_aging_tokens_per_s=None, pause_target=0.85,
    pause_order=PauseOrder.SHORTEST, wait_bound_s=None, placement=PlacementRule.ROOMIEST, critical_path=False,
)  # fmt: skip
WIDE = {"COLUMNS": "250", "NO_COLOR": "1"}


def test_the_simulators_reference_arm_runs_the_papers_policy() -> None:
    _, policy = build_router(ArmName.REFERENCE, [], VirtualClock(), get_preset("h100-tp4-32b"))
    assert policy is not None
    assert policy.scheduler.config == SchedulerConfig.reference()
    assert SchedulerConfig.reference().model_dump(exclude={"policy"}) == PAPERS_ARM.model_dump(exclude={"policy"})


def test_a_profile_takes_the_reference_policy_with_a_setting_of_its_own(tmp_path: Path) -> None:
    scheduler = {"policy": "reference", "tick_interval_s": 2, "wait_bound_s": 300}
    config = load_profile(write_profile(tmp_path, scheduler=scheduler)).scheduler
    assert config == SchedulerConfig.reference(tick_interval_s=2, wait_bound_s=300)
    assert (config.adaptive, config.placement, config.wait_bound_s) == (False, PlacementRule.ROOMIEST, 300)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("pause_ordr=shortest", ["no setting 'pause_ordr'", "did you mean pause_order?"]),
        ("pause_order=biggest", ["--scheduler pause_order=biggest", "'shortest' or 'longest-in-tool'"]),
        ("pause_threshold=2", ["--scheduler pause_threshold=2", "allowed: a number > 0 and ≤ 1.5"]),
        ("adaptive=maybe", ["--scheduler adaptive=maybe", "allowed: true or false"]),
        ("tick_interval_s", ["give KEY=VALUE"]),
    ],
)
def test_serve_refuses_a_bad_scheduler_setting_naming_it_and_what_is_allowed(setting: str, named: list[str]) -> None:
    result = CliRunner(env=WIDE).invoke(app, ["serve", "--worker", "http://127.0.0.1:9", "--scheduler", setting])
    assert result.exit_code == 1
    for words in named:
        assert words in result.stderr


def test_serve_help_lists_every_scheduler_setting_with_its_default_and_description() -> None:
    result = CliRunner(env=WIDE).invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())  # rich wraps long lines
    for name, field in SchedulerConfig.model_fields.items():
        assert field.description, f"{name} has no description for --help"
        assert f"{name} = {shown(field.default)}: {allowed(field)}; {field.description}" in text


@pytest.mark.parametrize(
    ("setting", "why"),
    [
        ("group_head_start_s", "the group head start never shortened"),
        ("wait_bound_factor", "the wait bound that followed the waits made no more steps"),
    ],
)
def test_a_profile_that_sets_a_removed_setting_is_told_it_was_removed_and_why(
    tmp_path: Path, setting: str, why: str
) -> None:
    with pytest.raises(ProfileError, match=f"{setting} was removed: {why}"):
        load_profile(write_profile(tmp_path, scheduler={setting: 3}))
