"""Errors leave a Workhorse as themselves when they can cross processes, else as their text."""
import pickle

import pytest

from xray.workhorse.base import WorkhorseError, portable_errors

pytestmark = pytest.mark.unit


class Unpicklable(ValueError):
    def __init__(self, message: str):
        super().__init__(message)
        self.hook = lambda: None  # a lambda attribute: pickling the exception fails


def test_an_unpicklable_error_arrives_as_its_text():
    with pytest.raises(WorkhorseError) as info:
        with portable_errors():
            raise Unpicklable("max_model_len 1024 exceeds the model's 512 positions")
    text = str(info.value)
    assert text.startswith("Unpicklable: max_model_len 1024 exceeds the model's 512 positions")
    assert "Traceback" in text
    assert pickle.loads(pickle.dumps(info.value)).args == info.value.args  # it crosses processes


def test_a_picklable_error_stays_itself():
    with pytest.raises(KeyError, match="x"):
        with portable_errors():
            raise KeyError("x")
