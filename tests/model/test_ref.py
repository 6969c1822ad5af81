"""Which model a name means: one parser, and the same error wherever a bad name is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvasird.cli import main
from kvasird.errors import ModelError
from kvasird.model.distribution import ShardService
from kvasird.model.ref import FORMS, ModelRef, ModelRefError

MODEL_ID = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_bundled_names_a_model_kvasird_fetches_itself() -> None:
    ref = ModelRef.parse("bundled:smollm2")
    assert (ref.kind, ref.value, str(ref)) == ("bundled", "smollm2", "bundled:smollm2")


def test_a_path_names_the_file_absolute_with_home_expanded(tmp_path, monkeypatch) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("HOME", str(tmp_path))
    ref = ModelRef.parse("~/m.gguf")
    assert (ref.kind, ref.value) == ("path", str((tmp_path / "m.gguf").resolve()))
    assert ref.gguf() == (tmp_path / "m.gguf").resolve() and str(ref) == ref.value


def test_a_relative_path_is_taken_from_the_working_directory(tmp_path, monkeypatch) -> None:
    (tmp_path / "model-without-suffix").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    ref = ModelRef.parse("model-without-suffix")
    assert ref == ModelRef("path", str((tmp_path / "model-without-suffix").resolve()))


def test_64_hex_digits_are_a_model_id_in_lower_case() -> None:
    assert ModelRef.parse(MODEL_ID) == ModelRef("id", MODEL_ID)
    assert ModelRef.parse(MODEL_ID.upper()) == ModelRef("id", MODEL_ID)


def test_a_model_id_has_no_gguf_file_here() -> None:
    with pytest.raises(ModelRefError, match=r"needs its GGUF file: give the file's path or "
                                            r"bundled:NAME \(bundled:smollm2\)"):
        ModelRef.parse(MODEL_ID).gguf()


BAD = [
    ("", "the name is empty"),
    ("/nowhere/model.gguf", "there is no file at /nowhere/model.gguf"),
    ("bundled:llama-70b", "kvasird bundles no model 'llama-70b'"),
    ("z" * 64, "it is not a model id (64 hex digits), and no file has that name"),
    (MODEL_ID[:63], "it is not a model id (64 hex digits), and no file has that name"),
]


@pytest.mark.parametrize(("text", "reason"), BAD)
def test_a_bad_name_says_why_and_lists_the_forms(text: str, reason: str) -> None:
    with pytest.raises(ModelRefError) as err:
        ModelRef.parse(text)
    assert str(err.value) == f"{text!r} names no model: {reason}; {FORMS}"
    assert "bundled:smollm2" in FORMS and "64 hex digits" in FORMS and "GGUF file" in FORMS
    assert isinstance(err.value, ModelError)


def test_where_the_name_was_given_opens_the_message() -> None:
    with pytest.raises(ModelRefError, match=r"^market\.model = 'bundled:x' names no model: "):
        ModelRef.parse("bundled:x", where="market.model")


def _message(text: str, where: str = "") -> str:
    with pytest.raises(ModelRefError) as err:
        ModelRef.parse(text, where)
    return str(err.value)


@pytest.mark.parametrize(("text", "reason"), BAD)
def test_the_command_line_gives_the_same_error(text: str, reason: str, tmp_path, capsys) -> None:
    assert main(["--home", str(tmp_path / "home"), "model", "add", text]) == 1
    assert capsys.readouterr().err == f"kvasird: {_message(text)}\n"
    assert main(["localnet", "up", "--dir", str(tmp_path / "net"), "--model", text]) == 1
    assert capsys.readouterr().err == f"kvasird: {_message(text)}\n"
    assert not (tmp_path / "home" / "shards").exists() and not (tmp_path / "net").exists()


@pytest.mark.parametrize(("text", "reason"), BAD[1:])
async def test_the_configured_model_gives_the_same_error(text: str, reason: str,
                                                         store_factory) -> None:
    shards = ShardService(None, store_factory("s"))  # type: ignore[arg-type]  # no peers needed
    with pytest.raises(ModelRefError) as err:
        await shards.resolve(text, lambda model_id: [])
    assert str(err.value) == _message(text, "market.model")


def test_adding_a_model_id_says_that_a_file_is_needed(tmp_path, capsys) -> None:
    assert main(["--home", str(tmp_path), "model", "add", MODEL_ID]) == 1
    assert "needs its GGUF file" in capsys.readouterr().err


def test_a_model_added_by_path_records_the_absolute_file(moe_path: Path, store_factory,
                                                         monkeypatch) -> None:
    monkeypatch.chdir(moe_path.parent)
    store = store_factory("s")
    manifest = store.add(ModelRef.parse(moe_path.name))
    [record] = store.models()
    assert (record.model_id, record.source) == (manifest.model_id, str(moe_path.resolve()))
