"""Which model a name means: one parser, and the same error wherever a bad name is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvasird.cli import main
from kvasird.errors import ModelError
from kvasird.model.distribution import ShardService
from kvasird.model.ref import FORMS, ModelRef, ModelRefError
from kvasird.model.store import AmbiguousName

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


@pytest.mark.parametrize("text", ["smollm2:135m-instruct", "SmolLM2:135M-Instruct",
                                  "smollm2-135m-instruct", "tiny:q3", MODEL_ID[:16]])
def test_a_name_or_an_id_prefix_is_looked_up_in_lower_case(text: str) -> None:
    ref = ModelRef.parse(text)
    assert (ref.kind, ref.value, ref.from_peers) == ("name", text.lower(), True)


def test_a_file_wins_over_a_name_that_looks_the_same(tmp_path, monkeypatch) -> None:
    (tmp_path / "tiny").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert ModelRef.parse("tiny").kind == "path" and not ModelRef.parse("tiny").from_peers


def test_the_forms_name_every_way_to_give_a_model() -> None:
    for form in ("smollm2:135m-instruct", "64 hex digits", "8+ hex digits", "GGUF file",
                 "bundled:smollm2"):
        assert form in FORMS


def test_a_model_id_has_no_gguf_file_here() -> None:
    with pytest.raises(ModelRefError, match=r"needs its GGUF file: give the file's path or "
                                            r"bundled:NAME \(bundled:smollm2\)"):
        ModelRef.parse(MODEL_ID).gguf()


BAD = [
    ("", "the name is empty"),
    ("/nowhere/model.gguf", "there is no file at /nowhere/model.gguf"),
    ("bundled:llama-70b", "kvasird bundles no model 'llama-70b'"),
    ("z" * 65, "it is not a model name or id, and no file has that name"),
    ("Llama 3 8B!", "it is not a model name or id, and no file has that name"),
    ("smollm2::135m", "it is not a model name or id, and no file has that name"),
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


async def test_a_configured_name_this_node_holds_needs_no_peer(moe_path: Path,
                                                               store_factory) -> None:
    store = store_factory("s")
    model_id = store.import_gguf(moe_path, "tiny:q3").model_id
    shards = ShardService(None, store)  # type: ignore[arg-type]  # no peers needed
    for text in ("tiny:q3", model_id[:16]):
        manifest = await shards.resolve(text, lambda model_id: [])
        assert manifest.model_id == model_id


async def test_a_configured_name_waits_for_a_record_naming_it(moe_path: Path, store_factory,
                                                              autojump_clock) -> None:
    store = store_factory("s")
    model_id = store.import_gguf(moe_path).model_id  # its manifest is here under another name
    asked: list[str] = []

    def named(text: str) -> list[str]:
        asked.append(text)
        return [model_id] if len(asked) > 3 else []

    shards = ShardService(None, store)  # type: ignore[arg-type]
    manifest = await shards.resolve("smollm2:135m-instruct", lambda m: [], named)
    assert manifest.model_id == model_id and set(asked) == {"smollm2:135m-instruct"}


async def test_a_configured_name_two_models_claim_is_refused_with_both_ids(
        store_factory) -> None:
    other = "c" * 64
    shards = ShardService(None, store_factory("s"))  # type: ignore[arg-type]
    with pytest.raises(AmbiguousName) as err:
        await shards.resolve("tiny:q3", lambda m: [], lambda text: [MODEL_ID, other])
    assert MODEL_ID in str(err.value) and other in str(err.value)
    assert str(err.value).startswith("[market] model = 'tiny:q3' names 2 models")
