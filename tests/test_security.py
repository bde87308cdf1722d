"""No pickle, no remote code unless asked: a model folder cannot run code by being loaded."""

from __future__ import annotations

import json
import pickle
import re

import pytest
from workflow_helpers import REPO

from stagereplay.engines.transformers.engine import ModelError, Runtime, load_model
from stagereplay.inputs.checkpoints import build_random_qwen2


class _RunsOnUnpickle:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_no_pickle_loader_in_the_library():
    pattern = re.compile(r"\btorch\.load\(|\bimport pickle\b|\bpickle\.loads?\(|\bnumpy\.load\(.*allow_pickle=True")
    offenders = [
        str(path.relative_to(REPO)) for path in sorted((REPO / "src").rglob("*.py")) if pattern.search(path.read_text())
    ]
    assert offenders == []


def test_a_folder_with_only_pickle_weights_is_refused_unloaded(tmp_path):
    folder = build_random_qwen2(tmp_path / "model", seed=0)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsOnUnpickle(marker)))
    with pytest.raises(ModelError, match="no .safetensors weights"):
        load_model(folder, Runtime(precision="fp32", device="cpu", threads=1))
    assert not marker.exists()


def _folder_with_its_own_code(tmp_path):
    folder = build_random_qwen2(tmp_path / "model", seed=0)
    marker = tmp_path / "executed"
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_own.OwnConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_own.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers import Qwen2Config as OwnConfig\n"
    )
    return folder, marker


def test_code_shipped_with_a_model_does_not_run_by_default(tmp_path):
    folder, marker = _folder_with_its_own_code(tmp_path)
    assert Runtime(precision="fp32", device="cpu", threads=1).trust_remote_code is False
    load_model(folder, Runtime(precision="fp32", device="cpu", threads=1))
    assert not marker.exists()


@pytest.fixture
def _auto_class_restored():
    """Loading a model's own code registers its config class for an auto class, for the whole process
    (transformers' ``register_for_auto_class``). The shipped class here is transformers' own Qwen2Config, so every
    later ``save_pretrained`` of a Qwen2 config in this process would try to copy its source file beside it and
    fail (tests/test_served.py did, run after this module in one process). The registration is undone."""
    from transformers import Qwen2Config

    before = Qwen2Config.__dict__.get("_auto_class", _UNSET)
    yield
    if before is _UNSET:
        if "_auto_class" in Qwen2Config.__dict__:
            delattr(Qwen2Config, "_auto_class")
    else:
        Qwen2Config._auto_class = before


_UNSET = object()


def test_code_shipped_with_a_model_runs_only_when_asked(tmp_path, _auto_class_restored):
    folder, marker = _folder_with_its_own_code(tmp_path)
    try:
        load_model(folder, Runtime(precision="fp32", device="cpu", threads=1, trust_remote_code=True))
    except ValueError:
        pass  # the shipped class need not be loadable: what matters is that it was imported
    assert marker.exists()


def test_a_model_built_after_one_that_ran_its_own_code_saves(tmp_path):
    """The registration above does not outlive its test: a random Qwen2 is built and saved after it."""
    assert (build_random_qwen2(tmp_path / "after", seed=1) / "config.json").is_file()


def test_the_config_keeps_remote_code_off_by_default():
    import yaml

    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert schema["properties"]["runtime"]["properties"]["trust_remote_code"]["default"] is False
    for name in ("config.yaml", "test.yaml", "paper.yaml"):
        config = yaml.safe_load((REPO / "config" / name).read_text())
        assert not config.get("runtime", {}).get("trust_remote_code", False), name
