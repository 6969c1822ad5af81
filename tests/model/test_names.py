"""Model names: what a person reads and types instead of the 64-hex model id."""

from __future__ import annotations

import pytest

from kvasird.compute.ggufview import GGUFFile
from kvasird.model.bundled import bundled_path
from kvasird.errors import ModelError
from kvasird.model.names import (
    agreed_name,
    checked_name,
    human_name,
    model_name,
    named_by,
    slug,
)

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


# --- the name on the network: family:tag ------------------------------------------------

MODEL_ID = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_the_bundled_model_is_named_family_colon_size_and_variant() -> None:
    path = bundled_path()
    assert model_name(GGUFFile(path).metadata, path.name) == "smollm2:135m-instruct"


def test_a_model_known_only_by_its_metadata_is_named_from_it() -> None:
    assert model_name(CONVERTED) == "smollm2:135m-8k-lc100k-mix1-ep2"
    assert model_name(CONVERTED, "layers-0-15.gguf") == model_name(CONVERTED)


def test_a_name_without_a_basename_has_no_tag() -> None:
    assert model_name({"general.name": "Phi 3 Mini"}) == "phi-3-mini"
    assert model_name({"general.basename": "Qwen3", "general.size_label": "30B-A3B"},
                      "Qwen3-30B-A3B-Instruct-Q4_K_M.gguf") == "qwen3:30b-a3b-instruct"
    assert model_name({}) == "unnamed-model"


def test_every_derived_name_is_a_valid_name_of_bounded_length() -> None:
    long = {"general.basename": "b" * 100, "general.size_label": "7B",
            "general.finetune": "f" * 100}
    name = model_name(long)
    assert checked_name(name) == name and len(name) <= 129


@pytest.mark.parametrize("text", ["tiny:q3", "Qwen3.6:35B-A3B", " smollm2 ", "a_b-c.d"])
def test_a_name_given_by_hand_is_kept_in_lower_case(text: str) -> None:
    assert checked_name(text) == text.strip().lower()


@pytest.mark.parametrize("text", ["", "tiny q3", "a:b:c", ":q3", "-x", "x" * 65, "é:1"])
def test_a_name_that_is_not_family_colon_tag_is_refused_with_the_form(text: str) -> None:
    with pytest.raises(ModelError, match=r"^--name .* is not a model name: a model name is "):
        checked_name(text, "--name")


@pytest.mark.parametrize("text", [
    "smollm2:135m-instruct", "SMOLLM2:135M-INSTRUCT", "smollm2-135m-instruct",
    "SmolLM2 135M Instruct", MODEL_ID, MODEL_ID.upper(), MODEL_ID[:8], MODEL_ID[:16]])
def test_a_model_is_named_by_its_name_slug_id_or_id_prefix(text: str) -> None:
    assert named_by(text, MODEL_ID, "smollm2:135m-instruct")


@pytest.mark.parametrize("text", ["", "smollm2", MODEL_ID[:7], MODEL_ID[1:9], "tiny:q3"])
def test_a_short_prefix_or_another_name_names_nothing(text: str) -> None:
    assert not named_by(text, MODEL_ID, "smollm2:135m-instruct")


def test_the_name_most_choosers_announce_wins_over_adopted_ones() -> None:
    adopted = [("smollm2:135m-instruct", False)] * 5
    assert agreed_name([*adopted, ("tiny:q3", True)]) == "tiny:q3"
    assert agreed_name([("a:1", True), ("b:1", True), ("b:1", True)]) == "b:1"


def test_without_a_chooser_the_most_adopted_name_wins() -> None:
    assert agreed_name([("a:1", False), ("b:1", False), ("b:1", False), ("", True)]) == "b:1"


def test_a_tie_goes_to_the_same_name_whatever_the_order() -> None:
    claims = [("tiny:q3", True), ("smollm2:135m-instruct", True)]
    assert agreed_name(claims) == agreed_name(claims[::-1]) == "smollm2:135m-instruct"


def test_no_claim_names_nothing() -> None:
    assert agreed_name([]) == agreed_name([("", True)]) == ""
