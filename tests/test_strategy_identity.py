"""One identity per residual strategy: to_config / from_config round trips, labels, and which classes a
checkpoint or converted directory may name."""

import inspect
import json

import pytest
import torch

import mhar_lit.residual as residual_pkg
from mhar_lit.config import ModelConfig
from mhar_lit.errors import UserError
from mhar_lit.lit.module import LanguageModel, model_from_checkpoint
from mhar_lit.models.decoder import DecoderLM
from mhar_lit.residual import (
    BlockAttnRes,
    DeltaAttnRes,
    FullAttnRes,
    HyperConnections,
    ResidualStrategy,
    StandardResidual,
)
from mhar_lit.residual.base import ALLOWED_PACKAGES, init_parameters

CASES = [
    (StandardResidual, {}, "StandardResidual"),
    (HyperConnections, {"streams": 2}, "HyperConnections(streams=2, dynamic=True, variant=zhu)"),
    (HyperConnections, {"streams": 3, "dynamic": False, "variant": "mhar_code"},
     "HyperConnections(streams=3, dynamic=False, variant=mhar_code)"),
    (FullAttnRes, {"heads": 2, "random_query_init": True}, "FullAttnRes(heads=2, random_query_init=True)"),
    (FullAttnRes, {"heads": 1, "eps": 1e-5}, "FullAttnRes(heads=1, eps=1e-05)"),
    (FullAttnRes, {"heads": 4, "logit_scale": 2, "routing_lr_scale": 4},
     "FullAttnRes(heads=4, logit_scale=2.0, routing_lr_scale=4.0)"),
    (BlockAttnRes, {"heads": 4, "layers_per_block": 1}, "BlockAttnRes(heads=4, layers_per_block=1)"),
    (BlockAttnRes, {"heads": 2, "num_blocks": 2, "two_phase": True}, "BlockAttnRes(heads=2, num_blocks=2)"),
    (DeltaAttnRes, {"heads": 2, "layers_per_block": 1, "null_source": False},
     "DeltaAttnRes(heads=2, layers_per_block=1, null_source=False)"),
    (DeltaAttnRes, {"heads": 4, "layers_per_block": 2, "legacy_block_delta": True},
     "DeltaAttnRes(heads=4, layers_per_block=2, legacy_block_delta=True)"),
]

# Per option of the built-in strategies, a value other than the one the strategy is built with in BASE below. A new
# option must be listed here (test_every_option_reaches_the_label_and_identity names it otherwise), which puts it
# under the check that it reaches the method's label and identity.
OTHER_VALUE = {
    "heads": 2, "random_query_init": True, "eps": 1e-5, "logit_scale": "heads", "routing_lr_scale": 8.0,
    "layers_per_block": 1, "num_blocks": 2, "two_phase": True, "streams": 2, "dynamic": True, "variant": "mhar_code",
    "null_source": False, "legacy_block_delta": True,
}
# The base each option is varied from: valid with every single change (mhar_code is static only).
BASE = {HyperConnections: {"dynamic": False}, DeltaAttnRes: {"layers_per_block": 2}}


def _variants():
    """(class, changed option or None, strategy) for every built-in strategy: its base, then one option changed."""
    for cls in _shipped_strategies():
        base = BASE.get(cls, {})
        yield cls, None, cls(**base)
        for option in init_parameters(cls):
            if option in OTHER_VALUE:
                yield cls, option, cls(**{**base, option: OTHER_VALUE[option]})


def _shipped_strategies() -> list[type]:
    return sorted((cls for cls in vars(residual_pkg).values()
                   if isinstance(cls, type) and issubclass(cls, ResidualStrategy) and not inspect.isabstract(cls)
                   and cls.__name__ in residual_pkg.__all__ and cls.__name__ != "RoutedResidual"),
                  key=lambda cls: cls.__name__)


def test_every_option_reaches_the_label_and_identity():
    """Each option of each strategy, changed alone, changes the identity and the label, unless the class declares
    it a speed option (then neither changes); every variant is valid on a real model shape."""
    missing = sorted({f"{cls.__name__}.{o}" for cls in _shipped_strategies() for o in init_parameters(cls)
                      if o not in OTHER_VALUE})
    assert not missing, f"options without a value in OTHER_VALUE: {missing}"
    bases = {}
    for cls, option, strategy in _variants():
        strategy.bind(_config())  # the combination is one a model accepts
        if option is None:
            bases[cls] = strategy
            continue
        base = bases[cls]
        same = option in cls.speed_options
        assert (strategy.identity() == base.identity()) == same, f"{cls.__name__}.{option}"
        assert (strategy.method_label() == base.method_label()) == same, f"{cls.__name__}.{option}"


def test_different_identities_get_different_labels():
    """Across every strategy and option variant, a label names one identity: `compare` never pools two methods."""
    identity_of_label = {}
    for _, _, strategy in _variants():
        identity = json.dumps(strategy.identity(), sort_keys=True)
        assert identity_of_label.setdefault(strategy.method_label(), identity) == identity, strategy.method_label()


def test_per_head_logit_scales_and_routing_lr_are_four_methods():
    """H = 8, H = 8 with c = sqrt(H), with c = H and with the routing lr x H: four labels, four identities."""
    arms = [FullAttnRes(heads=8), FullAttnRes(heads=8, logit_scale="sqrt_heads"),
            FullAttnRes(heads=8, logit_scale="heads"), FullAttnRes(heads=8, routing_lr_scale=8)]
    assert [a.method_label() for a in arms] == [
        "FullAttnRes(heads=8)", "FullAttnRes(heads=8, logit_scale=sqrt_heads)",
        "FullAttnRes(heads=8, logit_scale=heads)", "FullAttnRes(heads=8, routing_lr_scale=8.0)"]
    assert len({json.dumps(a.identity(), sort_keys=True) for a in arms}) == 4
    # a number is one method however it is spelled
    assert FullAttnRes(heads=8, routing_lr_scale=8).identity() == FullAttnRes(heads=8, routing_lr_scale=8.0).identity()


def test_strategies_say_what_they_are():
    """The questions consumers ask (export to transformers, compare's baseline, conversion, optimiser groups)."""
    standard, full, delta = StandardResidual(), FullAttnRes(heads=2), DeltaAttnRes(heads=2, layers_per_block=1)
    assert standard.is_standard_residual and not full.is_standard_residual and not delta.is_standard_residual
    assert standard.preserves_pretrained_function and delta.preserves_pretrained_function
    assert not full.preserves_pretrained_function and not HyperConnections().preserves_pretrained_function
    model = DecoderLM(_config(), full)
    assert standard.routing_parameters() == [] and model.residual.routing_parameters() == [full.query]


def test_an_older_files_identity_takes_the_defaults_of_options_added_since():
    """A checkpoint written before logit_scale / routing_lr_scale / num_blocks existed trained with their defaults;
    retired arguments and speed options are dropped."""
    old = {"class_path": BlockAttnRes.class_path(),
           "options": {"heads": 4, "layers_per_block": 2, "random_query_init": False, "eps": 1e-6,
                       "two_phase": True, "backend": "triton"}}
    assert BlockAttnRes.identity_of(old) == BlockAttnRes(heads=4, layers_per_block=2).identity()
    assert BlockAttnRes.identity_of(old) != BlockAttnRes(heads=4, num_blocks=2).identity()


def _config() -> ModelConfig:
    return ModelConfig.from_name("tiny", num_layers=4)


def test_every_shipped_strategy_is_covered():
    assert set(_shipped_strategies()) == {cls for cls, _, _ in CASES}


@pytest.mark.parametrize("cls,kwargs,label", CASES, ids=lambda v: getattr(v, "__name__", None) or str(v))
def test_to_config_from_config_round_trip(cls, kwargs, label):
    """to_config -> JSON -> from_config builds an equal strategy: the same config, a state that loads strictly
    into the twin model (same names and shapes) and equal outputs (fp64, exact: the same computation)."""
    torch.manual_seed(0)
    strategy = cls(**kwargs)
    model = DecoderLM(_config(), strategy).double().eval()
    with torch.no_grad():  # move off the identity-like init, so a dropped option would show in the outputs
        for p in model.residual.parameters():
            p.add_(0.3 * torch.randn_like(p))
    config = json.loads(json.dumps(strategy.to_config()))
    assert config["class_path"] == f"{cls.__module__}.{cls.__qualname__}"
    assert set(config["init_args"]) == set(inspect.signature(cls.__init__).parameters) - {"self"}
    twin_strategy = ResidualStrategy.from_config(config)
    assert type(twin_strategy) is cls and twin_strategy.to_config() == config
    twin = DecoderLM(_config(), twin_strategy).double().eval()
    twin.load_state_dict(model.state_dict(), strict=True)
    for (name, a), (name_b, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert name == name_b and torch.equal(a, b), name
    x = torch.randint(0, 320, (2, 11))
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))
    assert strategy.method_label() == label


def test_from_config_reads_the_older_options_key_and_refuses_unknown_args():
    built = ResidualStrategy.from_config({"class_path": "mhar_lit.residual.FullAttnRes", "options": {"heads": 2}})
    assert isinstance(built, FullAttnRes) and built.heads == 2
    with pytest.raises(UserError, match=r"does not take the init args \['head'\]"):
        ResidualStrategy.from_config({"class_path": "mhar_lit.residual.FullAttnRes", "init_args": {"head": 2}})
    with pytest.raises(UserError, match="needs a 'class_path' string"):
        ResidualStrategy.from_config({"init_args": {}})


@pytest.mark.parametrize("class_path", ["os.system", "collections.OrderedDict", "subprocess.Popen",
                                        "mhar_lit.residualx.Evil", "mhar_lit.lit.module.LanguageModel", "Standard"])
def test_a_class_outside_the_allowed_packages_is_refused_before_import(class_path):
    with pytest.raises(UserError, match=rf"class_path {class_path!r} is not in the allowed packages "
                                        rf"\(mhar_lit.residual\).*--allow_class {class_path}"):
        ResidualStrategy.from_config({"class_path": class_path, "init_args": {}})


def test_a_non_strategy_inside_the_package_is_refused():
    with pytest.raises(UserError, match="'mhar_lit.residual.base.UserError' is not a ResidualStrategy subclass"):
        ResidualStrategy.from_config({"class_path": "mhar_lit.residual.base.UserError"})
    with pytest.raises(UserError, match="cannot import residual class_path 'mhar_lit.residual.NoSuch'"):
        ResidualStrategy.from_config({"class_path": "mhar_lit.residual.NoSuch"})


USER_STRATEGY = '''
import torch
from mhar_lit.residual import ResidualStrategy

class ScaledResidual(ResidualStrategy):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale
    def build(self, config):
        self.alpha = torch.nn.Parameter(torch.full((config.num_sites,), self.scale))
    def begin(self, embedding):            return embedding
    def sublayer_input(self, h, site):     return h
    def sublayer_output(self, h, site, y): return h + self.alpha[site] * y
    def final(self, h):                    return h
'''


def _save(module, path):
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": {}}
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, path)
    return ckpt


def test_a_users_strategy_works_when_named_and_is_refused_from_a_file_alone(tmp_path, monkeypatch):
    (tmp_path / "my_strategies.py").write_text(USER_STRATEGY)
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_strategies import ScaledResidual

    module = LanguageModel(size="tiny", residual=ScaledResidual(scale=0.5))
    ckpt = _save(module, tmp_path / "user.ckpt")
    assert ckpt["mhar_lit"]["residual"] == {"class_path": "my_strategies.ScaledResidual", "init_args": {"scale": 0.5}}
    # resuming with the class the user's config names: compared, nothing imported from the file
    LanguageModel(size="tiny", residual=ScaledResidual(scale=0.5)).on_load_checkpoint(ckpt)
    with pytest.raises(UserError, match="'my_strategies.ScaledResidual' is not in the allowed packages"):
        model_from_checkpoint(str(tmp_path / "user.ckpt"))
    allowed = ALLOWED_PACKAGES + ("my_strategies.ScaledResidual",)
    model = model_from_checkpoint(str(tmp_path / "user.ckpt"), allowed=allowed)
    assert model.residual.scale == 0.5 and torch.equal(model.residual.alpha, module.model.residual.alpha)


def test_a_checkpoint_naming_foreign_code_is_refused(tmp_path):
    module = LanguageModel(size="tiny", residual=FullAttnRes(heads=2))
    ckpt = _save(module, tmp_path / "ok.ckpt")
    ckpt["mhar_lit"]["residual"] = {"class_path": "os.system", "init_args": {"command": "echo pwned"}}
    torch.save(ckpt, tmp_path / "evil.ckpt")
    with pytest.raises(UserError, match="'os.system' is not in the allowed packages"):
        model_from_checkpoint(str(tmp_path / "evil.ckpt"))


def test_a_strategy_must_store_its_init_args():
    class Forgetful(StandardResidual):
        def __init__(self, width: int = 3):
            super().__init__()

    with pytest.raises(TypeError, match=r"argument 'width' is not stored as an attribute of the same name"):
        Forgetful().to_config()

    class Unserialisable(StandardResidual):
        def __init__(self, where=None):
            super().__init__()
            self.where = where

    with pytest.raises(TypeError, match="Unserialisable.where = .* is not JSON-serialisable"):
        Unserialisable(where=object()).to_config()


@pytest.mark.parametrize("cls,kwargs,label", CASES, ids=lambda v: getattr(v, "__name__", None) or str(v))
def test_a_checkpoint_loads_without_a_random_init_and_computes_what_was_saved(cls, kwargs, label, tmp_path,
                                                                              monkeypatch):
    """model_from_checkpoint builds every strategy's model without drawing an init (the file holds every tensor),
    in fp32 with the head still tied to the embedding, and gives the saved model's logits bitwise; a bf16 file
    loads as the same values in fp32."""
    torch.manual_seed(0)
    module = LanguageModel(size="tiny", residual=cls(**kwargs))
    with torch.no_grad():  # off the identity-like init, so a strategy tensor left unloaded would show
        for p in module.model.residual.parameters():
            p.add_(0.3 * torch.randn_like(p))
    _save(module, tmp_path / "m.ckpt")
    _save(LanguageModel(size="tiny", residual=cls(**kwargs)).to(torch.bfloat16), tmp_path / "bf16.ckpt")

    def no_draw(*args, **kwargs):
        raise AssertionError("a random init was drawn for a model whose weights are all loaded")

    monkeypatch.setattr(torch.nn.init, "normal_", no_draw)
    monkeypatch.setattr(torch.Tensor, "normal_", no_draw)
    model = model_from_checkpoint(str(tmp_path / "m.ckpt"))
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert model.lm_head.weight is model.embed_tokens.weight
    x = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(x), module.model.eval()(x))
    bf16 = model_from_checkpoint(str(tmp_path / "bf16.ckpt"))
    saved = torch.load(tmp_path / "bf16.ckpt", weights_only=True)["state_dict"]
    for name, tensor in bf16.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, saved[f"model.{name}"].float()), name
