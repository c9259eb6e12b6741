"""Outside models: registered by name or installed through the entry-point group, their structure checked against
the model before a run trusts it (every zoo model passes the same check: tests/test_feature_loss.py)."""

import dataclasses
from importlib import metadata

import pytest

import fedjax_sparse.models as models
from fedjax_sparse.models import get_model, register_model
from fedjax_sparse.run.cli import main
from test_faults import TINY, records


@pytest.fixture
def clean_models(monkeypatch):
    monkeypatch.setattr(models, "_OUTSIDE", {})
    monkeypatch.setattr(models, "REFUSED", {})
    monkeypatch.setattr(models.INSTALLED, "loaded", False)


def _wide_mlp(input_shape, num_classes):
    """The zoo's MLP under another name: an outside model whose structure is right."""
    return dataclasses.replace(get_model("mlp", input_shape, num_classes), name="wide_mlp")


def test_a_registered_model_trains_from_the_command_line(clean_models, tmp_path, capsys):
    register_model("wide_mlp", _wide_mlp)
    assert "wide_mlp" in models.model_names()
    mine, zoo = tmp_path / "mine", tmp_path / "zoo"
    assert main(["run", *TINY, "--rounds", "2", "--model", "wide_mlp", "--out", str(mine)]) == 0
    assert main(["run", *TINY, "--rounds", "2", "--model", "mlp", "--out", str(zoo)]) == 0
    assert records(mine) == records(zoo)  # the same module under another name trains the same
    capsys.readouterr()


def test_an_installed_model_is_found_through_its_entry_point_and_a_broken_one_refused(clean_models, monkeypatch):
    good = metadata.EntryPoint("wide_mlp", "test_model_registry:_wide_mlp", models.ENTRY_POINT_GROUP)
    broken = metadata.EntryPoint("missing_net", "no_such_package.nets:net", models.ENTRY_POINT_GROUP)
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points", lambda group=None, **kw: (
        [good, broken] if group == models.ENTRY_POINT_GROUP else real(group=group, **kw)))
    assert get_model("wide_mlp", (8, 8, 1), 10).name == "wide_mlp"
    with pytest.raises(ValueError, match="plug-in model 'missing_net' .* cannot be used: ModuleNotFoundError: No module named"):
        get_model("missing_net", (8, 8, 1), 10)


@pytest.mark.parametrize("mistake,words", [
    ("kernel path", "layer 'fc3': no kernel at params/head/kernel"),
    ("units", "layer 'fc2': its kernel [256, 256] has 256 units on its last axis, the structure says 128"),
    ("not last", "its logits are not the output of its last layer 'fc2'"),
])
def test_a_structure_that_does_not_describe_its_model_is_refused_in_one_line(clean_models, mistake, words):
    def wrong(input_shape, num_classes):
        model = get_model("mlp", input_shape, num_classes)
        layers = list(model.structure.layers)
        if mistake == "kernel path":
            layers[-1] = dataclasses.replace(layers[-1], kernel=("head", "kernel"))
        elif mistake == "units":
            layers[1] = dataclasses.replace(layers[1], num_units=128)
        else:
            layers = layers[:-1]
        return dataclasses.replace(model, name="wrong", structure=dataclasses.replace(model.structure,
                                                                                      layers=tuple(layers)))

    register_model("wrong", wrong)
    with pytest.raises(ValueError, match=words.replace("[", "\\[").replace("]", "\\]")):
        get_model("wrong", (8, 8, 1), 10)


def test_a_zoo_name_or_an_unknown_model_is_refused(clean_models, tmp_path, capsys):
    with pytest.raises(ValueError, match="model 'mlp' is one of the library's"):
        register_model("mlp", _wide_mlp)
    assert main(["run", *TINY, "--rounds", "1", "--model", "nonet", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model 'nonet' is not a model; valid: mlp" in err
