"""The one walker of two JSON values (ledger.jsondiff), as verify, the provenance checks and
bench/same_ledger.py use it."""

from __future__ import annotations

import json
import math

from stagereplay.ledger.jsondiff import differences, first_difference, path_text, value_at
from stagereplay.ledger.provenance import first_config_difference


def test_the_first_difference_goes_in_the_saved_order_then_the_new_keys():
    saved = {"b": 1, "a": {"x": [1, 2, {"y": 3}]}}
    assert first_difference(saved, json.loads(json.dumps(saved))) is None
    assert first_difference(saved, {"b": 2, "a": {"x": [1, 2, {"y": 4}]}}) == ("b",)
    assert first_difference(saved, {"b": 1, "a": {"x": [1, 2, {"y": 4}]}}) == ("a", "x", 2, "y")
    assert first_difference(saved, {"a": {"x": [1, 2, {"y": 3}]}}) == ("b",)
    assert first_difference(saved, {**saved, "c": 0}) == ("c",)
    assert first_difference([1, 2], [1, 2, 3]) == (2,)
    assert first_difference([1, 2, 3], [1]) == (1,)


def test_leaves_are_equal_in_value_and_type_and_nan_equals_nan():
    assert first_difference({"p": 1}, {"p": 1.0}) == ("p",)
    assert first_difference({"p": True}, {"p": 1}) == ("p",)
    assert first_difference({"p": math.nan}, {"p": float("nan")}) is None
    assert first_difference({"p": 1}, {"p": 1.0}, strict=False) is None


def test_every_difference_is_listed_lazily():
    a = {"x": [1, 2], "y": {"z": 0}, "w": 5}
    b = {"x": [1, 3, 4], "y": {"z": 1}, "v": 5}
    assert list(differences(a, b)) == [("x", 1), ("x", 2), ("y", "z"), ("w",), ("v",)]
    assert [path_text(path) for path in differences(a, b)] == ["x[1]", "x[2]", "y.z", "w", "v"]
    assert path_text(()) == ""


def test_a_config_difference_is_in_sorted_key_order_and_compares_lists_whole():
    recorded = {"stage": {"suffix_tokens": 8, "prefix": 4}, "precisions": ["bf16", "fp32"]}
    assert first_config_difference(recorded, {"stage": {"suffix_tokens": 9, "prefix": 5}, "precisions": ["bf16"]}) == (
        "precisions",
    )
    assert first_config_difference(recorded, {**recorded, "stage": {"suffix_tokens": 9, "prefix": 5}}) == (
        "stage",
        "prefix",
    )
    assert first_config_difference(recorded, {**recorded, "stage": {"suffix_tokens": 8.0, "prefix": 4}}) is None
    assert first_config_difference(recorded, {"precisions": ["bf16", "fp32"]}) == ("stage",)


def test_a_value_is_found_by_its_path_or_is_absent():
    data = {"a": [{"b": 1}]}
    assert value_at(data, ("a", 0, "b")) == 1
    assert value_at(data, ()) == data
    assert value_at(data, ("a", 1, "b")) == "absent"
    assert value_at(data, ("a", "b"), None) is None
    assert value_at(data, ("c",), "<absent>") == "<absent>"
