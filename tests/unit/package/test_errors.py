"""The error hierarchy: what each error is, and that it survives pickling between ranks."""

from __future__ import annotations

import pickle

import pytest

from hyperckpt import CheckpointChangedError, CheckpointError, CheckpointNotFoundError


def test_a_checkpoint_error_is_a_value_error() -> None:
    assert issubclass(CheckpointError, ValueError)


def test_not_found_is_a_checkpoint_error_and_a_file_not_found_error() -> None:
    err = CheckpointNotFoundError("x.safetensors: missing", path="x.safetensors")
    assert isinstance(err, CheckpointError)
    assert isinstance(err, FileNotFoundError)
    assert isinstance(err, OSError)
    with pytest.raises(FileNotFoundError):
        raise err


def test_changed_is_a_checkpoint_error_but_not_not_found() -> None:
    assert issubclass(CheckpointChangedError, CheckpointError)
    assert not issubclass(CheckpointChangedError, FileNotFoundError)


def test_the_message_is_the_text_alone() -> None:
    err = CheckpointNotFoundError("a.safetensors: gone", path="a.safetensors", tensor="w")
    assert str(err) == "a.safetensors: gone"
    assert err.args == ("a.safetensors: gone",)


def test_path_and_tensor_default_to_none() -> None:
    err = CheckpointError("bad")
    assert (err.path, err.tensor) == (None, None)


@pytest.mark.parametrize("cls", [CheckpointError, CheckpointNotFoundError, CheckpointChangedError])
def test_errors_pickle_with_type_message_path_and_tensor(cls: type[CheckpointError]) -> None:
    err = cls("m-1.safetensors: tensor 'w': broken", path="m-1.safetensors", tensor="w")
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        copy = pickle.loads(pickle.dumps(err, protocol=protocol))
        assert type(copy) is cls
        assert str(copy) == str(err)
        assert (copy.path, copy.tensor) == ("m-1.safetensors", "w")


def test_a_pickled_error_keeps_its_cause_text_only() -> None:
    try:
        try:
            raise OSError(5, "Input/output error")
        except OSError as cause:
            raise CheckpointError("f: cannot read", path="f") from cause
    except CheckpointError as err:
        copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == "f: cannot read"
