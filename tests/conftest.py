"""Shared fixtures: the tiny model every short run (e2e and Ray tiers) starts from, built once per
test session; the per-test timeout plugin (`tests/timeouts.py`)."""
import pytest

pytest_plugins = ["tests.timeouts"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from xray.data.tokenizer import VOCAB_SIZE, save_char_tokenizer
    from xray.builtin.tiny_llama import TinySpec, build_tiny_model

    spec = TinySpec(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=2, num_kv_heads=2, max_position_embeddings=128)
    directory = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", spec, seed=3)
    save_char_tokenizer(directory)
    return directory
