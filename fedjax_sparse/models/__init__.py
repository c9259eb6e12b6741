"""The model zoo: `get_model(name, input_shape, num_classes) -> Model`.

Every model is a Flax module called as `module(x, train, mask=None)` on float32
NHWC images (the MLP also on [B, features] vectors, `char_lstm` on int32 token
sequences), returning `[B, num_classes]` logits, together with the
`ModelStructure` of its prunable (conv/dense/LSTM) layers; see `structure.py`.

  mlp           2x256 MLP (quick runs, digits)
  lenet5_caffe  SpaFL FMNIST LeNet-5-Caffe (430,500 weights, 580 units)
  spafl_cnn     SpaFL CIFAR-10 4-conv/3-dense CNN
  vgg9          FedLDF VGG-9 (8 conv + BN, 1 dense)
  vgg11         SPATL VGG-11 (8-conv encoder, 3-dense predictor)
  resnet20/32   SPATL CIFAR ResNets (option-A shortcuts)
  preresnet18   HeteroFL/FedGSE pre-activation ResNet-18
  cnn4          HeteroFL/FedGSE 4-conv "Conv" model (64-128-256-512)
  cnn2          SPATL FEMNIST 2-conv CNN (FedAvg's; also named femnist_cnn)
  char_lstm     LEAF Shakespeare: embedding 8, two LSTM layers of 256, next of 80 characters
"""

from __future__ import annotations

from fedjax_sparse.models.check import check_model
from fedjax_sparse.models.cnn import cnn2, cnn4, spafl_cnn
from fedjax_sparse.models.lenet import lenet5_caffe
from fedjax_sparse.models.mlp import mlp
from fedjax_sparse.models.recurrent import char_lstm
from fedjax_sparse.models.resnet import preresnet18, resnet20, resnet32
from fedjax_sparse.models.structure import Layer, Model, ModelFactory, ModelStructure
from fedjax_sparse.models.vgg import vgg9, vgg11
from fedjax_sparse.plugins import EntryPointGroup, brief

MODEL_NAMES = ('mlp', 'lenet5_caffe', 'spafl_cnn', 'vgg9', 'vgg11', 'resnet20', 'resnet32',
               'preresnet18', 'cnn4', 'cnn2', 'char_lstm')
MODEL_ALIASES = {'femnist_cnn': 'cnn2'}  # another name of a model, for the paper setting it comes from

_FACTORIES: dict[str, ModelFactory] = {
    'mlp': mlp,
    'lenet5_caffe': lenet5_caffe,
    'spafl_cnn': spafl_cnn,
    'vgg9': vgg9,
    'vgg11': vgg11,
    'resnet20': resnet20,
    'resnet32': resnet32,
    'preresnet18': preresnet18,
    'cnn4': cnn4,
    'cnn2': cnn2,
    'char_lstm': char_lstm,
}
assert tuple(_FACTORIES) == MODEL_NAMES


ENTRY_POINT_GROUP = "fedjax_sparse.models"
_OUTSIDE: dict[str, ModelFactory] = {}  # models registered from outside the library, by name
REFUSED: dict[str, str] = {}  # installed plug-in models that could not be registered: name -> why
INSTALLED = EntryPointGroup(ENTRY_POINT_GROUP)


def register_model(name: str, factory: ModelFactory) -> None:
    """Makes `factory(input_shape, num_classes) -> Model` the model `name` (`--model name`); its structure is
    checked against the model when it is built (`models.check`). A name of the zoo's is refused."""
    if not isinstance(name, str) or not name.replace("_", "").isalnum():
        raise ValueError(f"a model's name is letters, digits and underscores, got {name!r}")
    if name in _FACTORIES or name in MODEL_ALIASES:
        raise ValueError(f"model {name!r} is one of the library's; give the outside model another name")
    if not callable(factory):
        raise ValueError(f"model {name!r}: its factory must be callable as factory(input_shape, num_classes), got "
                         f"{type(factory).__name__}")
    _OUTSIDE[name] = factory


def _load_entry_points() -> None:
    """Registers the models installed packages declare (group `fedjax_sparse.models`: name = a factory), once;
    one that cannot be loaded or registered is left out, why in `REFUSED`."""
    def refuse(entry, why):
        REFUSED[entry.name] = (f"plug-in model {entry.name!r} (entry point {entry.name} = {entry.value!r}) "
                               f"cannot be used: {why}")

    def take(entry, factory):
        try:
            register_model(entry.name, factory)
        except ValueError as err:
            refuse(entry, brief(err))

    INSTALLED.load(take, refuse)


def model_names() -> list[str]:
    """The zoo's models, then those registered from outside (installed packages' included)."""
    _load_entry_points()
    return [*MODEL_NAMES, *_OUTSIDE]


def get_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> Model:
    """Builds model `name` (or an alias of one) for inputs of `input_shape` and `num_classes` outputs.

    Raises ValueError for an unknown name, when the model cannot take the input shape (e.g. a net whose
    feature map would shrink to nothing), or, for a model from outside the library, when its structure
    does not describe it (`models.check.check_model`).
    """
    name = MODEL_ALIASES.get(name, name)
    if name in _FACTORIES:
        return _FACTORIES[name](tuple(int(d) for d in input_shape), int(num_classes))
    if name not in model_names():
        if name in REFUSED:
            raise ValueError(REFUSED[name])
        raise ValueError(f"unknown model {name!r}; valid models are {', '.join(model_names())} "
                         f"(and {', '.join(f'{a} = {m}' for a, m in MODEL_ALIASES.items())})")
    model = _OUTSIDE[name](tuple(int(d) for d in input_shape), int(num_classes))
    if not isinstance(model, Model):
        raise ValueError(f"model {name!r}: its factory returned a {type(model).__name__}, not a Model")
    check_model(model)
    return model


__all__ = ['MODEL_ALIASES', 'MODEL_NAMES', 'get_model', 'Model', 'ModelStructure', 'Layer', 'model_names',
           'register_model']
