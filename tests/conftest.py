"""Shared fixtures: the tiny model every short run (e2e and Ray tiers) starts from, and a larger
one that teaches it (on-policy distillation), each built once per test session; the per-test
timeout plugin (`tests/timeouts.py`)."""
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


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory):
    """A larger model over the same tokenizer (twice the width), the teacher of on-policy distillation."""
    from xray.data.tokenizer import VOCAB_SIZE, save_char_tokenizer
    from xray.builtin.tiny_llama import TinySpec, build_tiny_model

    spec = TinySpec(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_heads=4, num_kv_heads=2, max_position_embeddings=128)
    directory = build_tiny_model(tmp_path_factory.mktemp("teacher") / "tiny-teacher", spec, seed=5)
    save_char_tokenizer(directory)
    return directory
