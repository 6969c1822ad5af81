"""Model names: what a person reads and types instead of the 64-hex model id."""

from __future__ import annotations

import pytest

from kvasird.compute.ggufview import GGUFFile
from kvasird.model.bundled import bundled_path
from kvasird.model.names import human_name, slug

CONVERTED = {"general.name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "general.basename": "smollm2",
             "general.size_label": "135M", "general.finetune": "8k-lc100k-mix1-ep2"}
"""What llama.cpp's converter wrote into the bundled model."""


def test_the_bundled_model_is_named_as_its_publisher_names_it() -> None:
    path = bundled_path()
    name = human_name(GGUFFile(path).metadata, path.name)
    assert (name, slug(name)) == ("SmolLM2 135M Instruct", "smollm2-135m-instruct")


def test_a_slice_is_named_from_the_metadata_it_carries() -> None:
    assert human_name(CONVERTED, "layers-0-15.gguf") == "smollm2 135M 8k-lc100k-mix1-ep2"
    assert human_name(CONVERTED, "head.gguf") == human_name(CONVERTED)


def test_metadata_keeps_the_case_of_the_basename() -> None:
    meta = {"general.basename": "Qwen3", "general.size_label": "30B-A3B",
            "general.finetune": "Instruct", "general.version": "2507", "general.name": "x"}
    assert human_name(meta, "model.gguf") == "Qwen3 30B-A3B Instruct 2507"


@pytest.mark.parametrize("file_name", [
    "Qwen3-30B-A3B-Instruct-Q4_K_M.gguf", "Qwen3-30B-A3B-Instruct-Q4_K_M-00001-of-00003.gguf",
    "Qwen3-30B-A3B-Instruct.BF16.gguf", "qwen3-30b-a3b-instruct-iq2_xs.gguf"])
def test_a_conventional_file_name_loses_its_encoding_and_shard(file_name: str) -> None:
    meta = {"general.basename": "qwen3", "general.size_label": "30B-A3B"}
    assert slug(human_name(meta, file_name)) == "qwen3-30b-a3b-instruct"


def test_a_file_name_that_names_another_model_is_not_used() -> None:
    assert human_name(CONVERTED, "TinyLlama-135M-Chat.gguf") == human_name(CONVERTED)
    assert human_name(CONVERTED, "SmolLM2-360M-Instruct.gguf") == human_name(CONVERTED)


def test_without_a_basename_general_name_then_the_file_name_serve() -> None:
    assert human_name({"general.name": "Phi 3 Mini"}, "a.gguf") == "Phi 3 Mini"
    assert human_name({}, "my-model.Q8_0.gguf") == "my model"
    assert human_name({}) == "unnamed model"


def test_names_from_bytes_and_odd_whitespace_are_clean() -> None:
    assert human_name({"general.basename": b"Mistral", "general.size_label": " 7B\n"}) == \
        "Mistral 7B"


@pytest.mark.parametrize(("name", "expected"), [
    ("SmolLM2 135M Instruct", "smollm2-135m-instruct"), ("Qwen2.5 7B", "qwen2.5-7b"),
    ("Llama 3.1 8B / Instruct (v2)", "llama-3.1-8b-instruct-v2"), ("  -x-  ", "x")])
def test_a_slug_is_lower_case_words_joined_by_dashes(name: str, expected: str) -> None:
    assert slug(name) == expected
