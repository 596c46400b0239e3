"""Profiles: the shipped ones load; a bad one fails before anything starts, naming field and fix."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from thunderctl.cluster.plan import plan_workers
from thunderctl.engines.local import EngineHome
from thunderctl.profile import DEFAULT_PROFILE, PROFILES_DIR, ProfileError, load_profile, parse_profile

H100 = PROFILES_DIR / "2xh100.yaml"


def test_shipped_profiles_are_valid() -> None:
    local = load_profile(DEFAULT_PROFILE)
    assert local.engine.kind == "vllm-cpu" and local.nodes[0].transport == "local"
    h100 = load_profile(H100)
    assert [n.gpus for n in h100.nodes] == [8, 8]
    assert load_profile() == local  # the embedded default


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p["nodes"][1].update(tensor_parallel=3), "nodes[1].tensor_parallel: 3 does not divide gpus: 8"),
        (lambda p: p["nodes"][0].update(replicas=3), "nodes[0].replicas: 3 × tensor_parallel: 4 needs 12 GPUs"),
        (lambda p: p["nodes"][0].update(gpus=-1), "nodes[0].gpus: -1: Input should be greater than or equal to 0"),
        (lambda p: p["nodes"][0].update(transport="telnet"), "nodes[0].transport: 'telnet'"),
        (lambda p: p["nodes"][0].update(gpu=8), "nodes[0].gpu: unknown field"),
        (lambda p: p.pop("model"), "model: required but missing"),
        (lambda p: p["nodes"][1].update(name="node-1"), "node-1 appears more than once"),
        (
            lambda p: p["scheduler"].update(admission={"pause_target": 0.99}),
            "admission.pause_target (0.99) must be below",
        ),
        (lambda p: p["engine"].update(kind="vllm-cpu"), "engine.kind: vllm-cpu with nodes that have gpus"),
        (
            lambda p: (p["engine"].update(kind="vllm-cpu", kv_offload_gib=4), [n.update(gpus=0) for n in p["nodes"]]),
            "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs",
        ),
        (lambda p: p.update(nodes=[]), "nodes: []: List should have at least 1 item"),
        (
            lambda p: p["engine"].update(args=["--tool-call-parser", "llama3_json"]),
            "engine.tool_call_parser: 'hermes' but args pass --tool-call-parser llama3_json",
        ),
        (
            lambda p: p["engine"].update(stream_interval=8, args=["--stream-interval=4"]),
            "engine.stream_interval: 8 but args pass --stream-interval 4; give it in one of the two",
        ),
        (lambda p: p["engine"].update(stream_interval=0), "engine.stream_interval: 0"),
        (
            lambda p: p["gateway"].update(stream_interval_ms=5),
            "stream_interval_ms was removed (no gain measured, docs/evidence/removed-laws.md); delete it",
        ),
    ],
)
def test_invalid_profile_names_the_field_the_value_and_the_fix(edit, message) -> None:
    data = copy.deepcopy(yaml.safe_load(H100.read_text()))
    edit(data)
    with pytest.raises(ProfileError) as error:
        parse_profile(data, "bad.yaml")
    assert message in str(error.value)
    assert str(error.value).startswith("bad.yaml is not a valid profile")


def test_local_node_on_a_remote_host_points_to_ssh() -> None:
    data = yaml.safe_load(DEFAULT_PROFILE.read_text())
    data["nodes"][0]["host"] = "10.1.2.3"
    with pytest.raises(ProfileError, match="use transport: ssh"):
        parse_profile(data, "x.yaml")


def test_cpu_engine_block_size_must_suit_vllm_cpu() -> None:
    data = yaml.safe_load(DEFAULT_PROFILE.read_text())
    data["engine"]["block_size"] = 16
    with pytest.raises(ProfileError, match="engine.block_size: 16 is not a multiple of 32"):
        parse_profile(data, "x.yaml")


@pytest.mark.parametrize(
    ("text", "message"),
    [("cluster: [unclosed", "is not valid YAML"), ("- just\n- a list", "a profile is a YAML mapping")],
)
def test_unreadable_profiles(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


def test_missing_profile_file() -> None:
    with pytest.raises(ProfileError, match="cannot read profile /nonexistent.yaml"):
        load_profile(Path("/nonexistent.yaml"))


@pytest.mark.parametrize("command", [["doctor"], ["up", "--dry-run"]])
def test_doctor_and_up_refuse_a_host_kv_tier_on_vllm_cpu_before_starting_anything(
    tmp_path: Path, command: list[str]
) -> None:
    from typer.testing import CliRunner

    from thunderctl.cli import app

    data = yaml.safe_load((Path(__file__).parents[1] / "profiles" / "local.yaml").read_text())
    data["engine"]["kv_offload_gib"] = 4
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, [*command, "-f", str(path)])
    output = " ".join(result.output.split())  # rich wraps lines
    assert result.exit_code == 1
    assert "engine.kv_offload_gib" in output
    assert "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs" in output
    assert "vllm.entrypoints" not in output  # no worker planned, none started


def doctor_output(tmp_path: Path, data: dict) -> str:
    from typer.testing import CliRunner

    from thunderctl.cli import app

    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["doctor", "-f", str(path)])
    return " ".join(result.output.replace("│", " ").split())  # rich wraps lines and draws a table


@pytest.mark.parametrize("shipped", ["local.yaml", "2xh100.yaml"])
def test_every_worker_of_a_shipped_vllm_profile_parses_tool_calls(tmp_path: Path, shipped: str) -> None:
    profile = load_profile(PROFILES_DIR / shipped)
    for plan in plan_workers(profile, EngineHome(tmp_path)):
        line = " ".join(plan.command)
        assert "--enable-auto-tool-choice --tool-call-parser hermes" in line, plan.id


@pytest.mark.parametrize("shipped", ["local.yaml", "2xh100.yaml", "sim.yaml"])
def test_every_kind_of_worker_is_started_with_the_profiles_stream_interval(tmp_path: Path, shipped: str) -> None:
    data = yaml.safe_load((PROFILES_DIR / shipped).read_text())
    data["engine"]["stream_interval"] = 8
    for plan in plan_workers(parse_profile(data, shipped), EngineHome(tmp_path)):
        assert " --stream-interval 8" in " ".join(plan.command), plan.id


def test_tool_call_flags_the_engine_args_pass_already_are_not_passed_twice(tmp_path: Path) -> None:
    data = yaml.safe_load(DEFAULT_PROFILE.read_text())
    data["engine"]["args"] = ["--tool-call-parser=hermes", "--enable-auto-tool-choice"]
    (plan,) = plan_workers(parse_profile(data, "x.yaml"), EngineHome(tmp_path))
    assert [a for a in plan.command if a.startswith("--") and "tool" in a] == [
        "--tool-call-parser=hermes",
        "--enable-auto-tool-choice",
    ]


def test_an_unknown_tool_call_parser_is_refused_with_the_names_vllm_ships() -> None:
    data = yaml.safe_load(DEFAULT_PROFILE.read_text())
    data["engine"]["tool_call_parser"] = "hermess"
    with pytest.raises(ProfileError) as error:
        parse_profile(data, "x.yaml")
    message = str(error.value)
    assert "engine.tool_call_parser: 'hermess' is not a tool-call parser vLLM 0.32.0 ships; use one of" in message
    assert all(name in message for name in ("hermes", "llama3_json", "mistral", "qwen3_coder"))


def test_doctor_warns_that_a_vllm_profile_without_a_tool_call_parser_answers_tools_with_a_400(
    tmp_path: Path,
) -> None:
    data = yaml.safe_load(DEFAULT_PROFILE.read_text())
    del data["engine"]["tool_call_parser"]
    output = doctor_output(tmp_path, data)
    assert (
        'warn engine tool calls: no tool-call parser: vLLM answers a request with tools and tool_choice "auto" with a 400'
        in output
    )
    assert "fix: set engine.tool_call_parser" in output


def test_doctor_does_not_warn_a_profile_whose_workers_parse_tool_calls(tmp_path: Path) -> None:
    output = doctor_output(tmp_path, yaml.safe_load(DEFAULT_PROFILE.read_text()))
    assert "engine tool calls ok --tool-call-parser hermes" in output
    assert "engine.tool_call_parser" not in output


def test_a_sim_profile_is_not_warned_about_tool_calls_and_refuses_a_parser(tmp_path: Path) -> None:
    data = yaml.safe_load((PROFILES_DIR / "sim.yaml").read_text())
    assert "tool calls" not in doctor_output(tmp_path, data)  # a simulated worker answers tools by itself
    data["engine"]["tool_call_parser"] = "hermes"
    with pytest.raises(ProfileError, match="engine.tool_call_parser is for vLLM workers"):
        parse_profile(data, "sim.yaml")
