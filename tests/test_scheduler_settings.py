"""The scheduler's settings: the paper's policy named once, and `serve --scheduler KEY=VALUE` from the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from support import write_profile
from thunderctl.cli import app
from thunderctl.profile import ProfileError, load_profile
from thunderctl.scheduler import PauseOrder, PlacementRule, SchedulerConfig
from thunderctl.scheduler.config import SECTIONS, Ending
from thunderctl.settings import allowed, parse_settings, setting_fields, shown
from thunderctl.sim.arms import ArmName, build_router
from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.presets import get_preset

# The simulator's `reference` arm as it was written out before the policy had a name: the
# figures of docs/evidence/sim-*.md and docs/admission.md were measured with it.
PAPERS_ARM = SchedulerConfig(
    adaptive={"enabled": False}, retention={"enabled": False}, placement=PlacementRule.ROOMIEST,
    admission={"pause_target": 0.85, "pause_order": PauseOrder.SHORTEST},
    waits={"aging_tokens_per_s": None, "bound_s": None, "critical_path": False},
)  # fmt: skip
WIDE = {"COLUMNS": "250", "NO_COLOR": "1"}


def test_the_simulators_reference_arm_runs_the_papers_policy() -> None:
    _, policy = build_router(ArmName.REFERENCE, [], VirtualClock(), get_preset("h100-tp4-32b"))
    assert policy is not None
    assert policy.scheduler.config == SchedulerConfig.reference()
    assert SchedulerConfig.reference().model_dump(exclude={"policy"}) == PAPERS_ARM.model_dump(exclude={"policy"})


def test_a_profile_takes_the_reference_policy_with_a_setting_of_its_own(tmp_path: Path) -> None:
    scheduler = {"policy": "reference", "tick_interval_s": 2, "waits": {"bound_s": 300}}
    config = load_profile(write_profile(tmp_path, scheduler=scheduler)).scheduler
    assert config == SchedulerConfig.reference(tick_interval_s=2, waits={"bound_s": 300})
    assert (config.adaptive.enabled, config.placement, config.waits.bound_s) == (False, PlacementRule.ROOMIEST, 300)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("pause_ordr=shortest", ["no setting 'pause_ordr'", "did you mean admission.pause_order?"]),
        (
            "admission.pause_order=biggest",
            ["--scheduler admission.pause_order=biggest", "'shortest' or 'longest-in-tool'"],
        ),
        ("admission.pause_threshold=2", ["--scheduler admission.pause_threshold=2", "allowed: a number > 0 and ≤ 1.5"]),
        ("adaptive.enabled=maybe", ["--scheduler adaptive.enabled=maybe", "allowed: true or false"]),
        ("ending.flor_s=3", ["no setting 'ending.flor_s'", "did you mean ending.floor_s?"]),
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
    for key, field in setting_fields(SchedulerConfig).items():
        assert field.description, f"{key} has no description for --help"
        assert f"{key} = {shown(field.default)}: {allowed(field)}; {field.description}" in text


def test_serve_help_heads_each_section_with_what_its_law_does() -> None:
    text = " ".join(CliRunner(env=WIDE).invoke(app, ["serve", "--help"]).output.split())
    for section in SECTIONS.values():
        assert (section.__doc__ or "").strip() in text


def test_a_profile_sets_a_law_by_its_section() -> None:
    config = SchedulerConfig.model_validate(yaml.safe_load("ending:\n  floor_s: 45\nwaits:\n  bound_s: null\n"))
    assert (config.ending.floor_s, config.waits.bound_s, config.ending.margin) == (45, None, Ending().margin)


def test_serve_takes_a_sections_setting_by_its_dotted_key() -> None:
    config = parse_settings(SchedulerConfig, ["ending.floor_s=45", "waits.bound_s=none"], "--scheduler")
    assert (config.ending.floor_s, config.waits.bound_s) == (45, None)


@pytest.mark.parametrize(
    ("flat", "value", "read_as"),
    [("end_floor_s", 45, ("ending", "floor_s")), ("retention", False, ("retention", "enabled"))],
)
def test_a_flat_key_of_the_release_before_is_read_with_a_warning_naming_its_section(flat, value, read_as) -> None:
    section, name = read_as
    with pytest.warns(FutureWarning, match=f"{flat} is now {section}.{name}"):
        config = SchedulerConfig.model_validate({flat: value})
    assert getattr(getattr(config, section), name) == value


def test_serve_reads_a_flat_key_of_the_release_before_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="wait_bound_s is now waits.bound_s"):
        config = parse_settings(SchedulerConfig, ["wait_bound_s=none"], "--scheduler")
    assert config.waits.bound_s is None


def test_the_reference_policy_keeps_its_own_settings_in_a_section_given_in_part() -> None:
    config = SchedulerConfig.reference(admission={"buffer_tokens": 0})
    assert (config.admission.buffer_tokens, config.admission.pause_target) == (0, 0.85)


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
