"""Networks split into a feature extractor and a linear head.

Every classifier here is a MONAI network (or, for IsoFed's 28 px CNN, a plain
``nn.Module``) with three additions the federated methods rely on:

* ``head`` -- the last ``nn.Linear``; row ``c`` of its weight and entry ``c`` of
  its bias belong to class ``c``, so an aggregator can address one class;
* ``head_name`` -- that module's dotted name, the prefix of its state-dict keys;
* ``extract(x)`` -- the features the head sees (for prototypes, TADL).

State-dict keys are those of the MONAI parent, so checkpoints interchange with
plain MONAI networks. Constructor arguments are kept as attributes of the same
name: nvflare's job export rebuilds a model from them.
"""

from __future__ import annotations

import torch
from monai.networks.nets import BasicUNet, DenseNet121, ResNet
from torch import nn


def _load_init(net: nn.Module, ckpt: str | None) -> None:
    """Initialise from a local checkpoint (e.g. ImageNet weights); never downloads.

    The head is skipped when its shape differs (different class count).
    """
    if not ckpt:
        return
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state = state.get("model", state) if isinstance(state, dict) else state
    own = net.state_dict()
    keep = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not keep:
        raise ValueError(f"{ckpt}: no tensor matches the network's keys and shapes")
    net.load_state_dict(keep, strict=False)


class DenseNet121Classifier(DenseNet121):
    """MONAI DenseNet121; head ``class_layers.out``. ``hidden`` > 0 inserts
    Linear(hidden)+ReLU+Dropout before the head (Surgical Aggregation's released model)."""

    head_name = "class_layers.out"

    def __init__(self, spatial_dims: int = 2, in_channels: int = 1, out_channels: int = 6, hidden: int = 0,
                 dropout: float = 0.3, init_ckpt: str | None = None):
        super().__init__(spatial_dims=spatial_dims, in_channels=in_channels, out_channels=out_channels)
        self.spatial_dims, self.in_channels, self.out_channels = spatial_dims, in_channels, out_channels
        self.hidden, self.dropout, self.init_ckpt = hidden, dropout, init_ckpt
        if hidden:
            width = self.class_layers.out.in_features
            out = self.class_layers.out
            del self.class_layers.out
            self.class_layers.add_module("hidden", nn.Linear(width, hidden))
            self.class_layers.add_module("hidden_act", nn.ReLU())
            self.class_layers.add_module("hidden_drop", nn.Dropout(dropout))
            self.class_layers.add_module("out", nn.Linear(hidden, out.out_features))
        _load_init(self, init_ckpt)

    @property
    def head(self) -> nn.Linear:
        return self.class_layers.out

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return self.class_layers[:-1](self.features(x))


class ResNet18Classifier(ResNet):
    """MONAI ResNet-18 with the standard stride-2 stem; head ``fc``."""

    head_name = "fc"

    def __init__(self, spatial_dims: int = 2, in_channels: int = 1, out_channels: int = 6, init_ckpt: str | None = None,
                 widen_factor: float = 1.0):
        # widen_factor (MONAI's): channel width multiplier; 0.25 trains ~8x faster on CPU (long-budget studies)
        super().__init__(block="basic", layers=[2, 2, 2, 2], block_inplanes=[64, 128, 256, 512],
                         spatial_dims=spatial_dims, n_input_channels=in_channels, num_classes=out_channels,
                         conv1_t_stride=2, widen_factor=widen_factor)
        self.spatial_dims, self.in_channels, self.out_channels, self.init_ckpt = spatial_dims, in_channels, out_channels, init_ckpt
        self.widen_factor = widen_factor
        _load_init(self, init_ckpt)

    @property
    def head(self) -> nn.Linear:
        return self.fc

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn1(self.conv1(x)))
        if not self.no_max_pool:
            x = self.maxpool(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.avgpool(x).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.extract(x))


class SimpleCNN(nn.Module):
    """IsoFed's CNN for 28 px images: two 5x5 conv + 2x2 max-pool, two FC
    layers, a two-layer MLP, then the linear head."""

    head_name = "head"

    def __init__(self, in_channels: int = 3, out_channels: int = 8, init_ckpt: str | None = None):
        super().__init__()
        self.in_channels, self.out_channels, self.init_ckpt = in_channels, out_channels, init_ckpt
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        )
        self.fc = nn.Sequential(nn.Linear(16 * 4 * 4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU())
        self.mlp = nn.Sequential(nn.Linear(84, 84), nn.ReLU(), nn.Linear(84, 84), nn.ReLU())
        self.head = nn.Linear(84, out_channels)
        _load_init(self, init_ckpt)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.fc(self.conv(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.extract(x))


class GroupNormUNet(BasicUNet):
    """MONAI BasicUNet (two convolutions per level) with GroupNorm.

    MONAI's residual ``UNet`` puts a GroupNorm on its output channels and so
    fails for 1-2 output channels; BasicUNet ends in a plain convolution.
    """

    def __init__(self, spatial_dims: int = 2, in_channels: int = 3, out_channels: int = 1,
                 features: tuple = (16, 16, 32, 64, 128, 16), num_groups: int = 8, init_ckpt: str | None = None):
        super().__init__(spatial_dims=spatial_dims, in_channels=in_channels, out_channels=out_channels,
                         features=tuple(features), norm=("group", {"num_groups": num_groups}))
        self.spatial_dims, self.in_channels, self.out_channels = spatial_dims, in_channels, out_channels
        self.features, self.num_groups, self.init_ckpt = tuple(features), num_groups, init_ckpt
        _load_init(self, init_ckpt)


class TwinUNet(nn.Module):
    """Two ``GroupNormUNet`` s, ``f1`` and ``f2``, federated as one network (FedMix's F1, F2).

    Each is initialised by its own draw, so the two start different; one state
    dict (``f1.*``, ``f2.*``) carries both through aggregation and checkpoints.
    ``forward`` gives F1's logits (``output="first"``, what a FedMix model ships
    by default) or the logit of the two networks' mean probability
    (``output="mean"``).
    """

    OUTPUTS = ("first", "mean")

    def __init__(self, spatial_dims: int = 2, in_channels: int = 3, out_channels: int = 1,
                 features: tuple = (16, 16, 32, 64, 128, 16), num_groups: int = 8, init_ckpt: str | None = None,
                 output: str = "first"):
        super().__init__()
        if output not in self.OUTPUTS:
            raise ValueError(f"TwinUNet output must be one of {self.OUTPUTS}, not {output!r}")
        self.spatial_dims, self.in_channels, self.out_channels = spatial_dims, in_channels, out_channels
        self.features, self.num_groups, self.init_ckpt, self.output = tuple(features), num_groups, init_ckpt, output
        self.f1 = GroupNormUNet(spatial_dims, in_channels, out_channels, features, num_groups)
        self.f2 = GroupNormUNet(spatial_dims, in_channels, out_channels, features, num_groups)
        if init_ckpt:
            # Only a checkpoint of two networks: one network's weights in both would start F1 = F2, which then
            # always agree (FedMix's selection and cross supervision do nothing).
            state = torch.load(init_ckpt, map_location="cpu", weights_only=True)
            state = state.get("model", state) if isinstance(state, dict) else state
            if not is_twin(state):
                raise ValueError(f"{init_ckpt}: TwinUNet starts from a checkpoint of two networks (keys f1.*, f2.*); "
                                 "one network's weights would make F1 and F2 start identical")
            _load_init(self, init_ckpt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.f1(x)
        if self.output == "mean":
            return torch.logit((torch.sigmoid(a) + torch.sigmoid(self.f2(x))) / 2, eps=1e-6)
        return a


TWIN_PREFIXES = ("f1.", "f2.")


def is_twin(state: dict) -> bool:
    """True for a ``TwinUNet`` state dict (every key under ``f1.`` or ``f2.``)."""
    return bool(state) and all(k.startswith(TWIN_PREFIXES) for k in state)


def first_of_twin(state: dict) -> dict:
    """F1's weights of a ``TwinUNet`` state dict, keyed as a plain UNet's; any other state dict as it is."""
    if not is_twin(state):
        return state
    return {k[len("f1."):]: v for k, v in state.items() if k.startswith("f1.")}


# ------------------------------------------------------------ state helpers

NORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


def head_keys(net: nn.Module) -> list:
    """State-dict keys of the head (weight, bias)."""
    return [f"{net.head_name}.weight", f"{net.head_name}.bias"]


def batchnorm_keys(net: nn.Module) -> list:
    """State-dict keys (affine params and running stats) of every batch-norm layer."""
    keys = []
    for name, mod in net.named_modules():
        if isinstance(mod, NORM_TYPES):
            keys += [f"{name}.{k}" for k in mod.state_dict()]
    return keys


def batchnorm_keys_by_name(keys) -> list:
    """The keys of ``keys`` (a state dict's names) that belong to a batch-norm layer, told from the names
    alone: a layer with running statistics keeps ``<layer>.running_mean``, and its weight, bias, running
    variance and batch count sit beside it. What a filter can find in a reply without the network
    (``flare.withhold``); equals ``batchnorm_keys`` for layers that track statistics (torch's default)."""
    keys = [k for k in keys if isinstance(k, str)]
    layers = {k[: -len("running_mean")] for k in keys if k == "running_mean" or k.endswith(".running_mean")}
    return [k for k in keys if k[: k.rfind(".") + 1] in layers
            and k[k.rfind(".") + 1:] in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]


def freeze_batchnorm(net: nn.Module) -> None:
    """FedBN+: batch norm in inference mode at its current statistics, not trained."""
    for mod in net.modules():
        if isinstance(mod, NORM_TYPES):
            mod.eval()
            for p in mod.parameters():
                p.requires_grad_(False)


def rebuild(net: nn.Module) -> nn.Module:
    """A fresh instance of the same class from the constructor arguments it keeps."""
    import inspect

    params = inspect.signature(type(net).__init__).parameters
    return type(net)(**{p: getattr(net, p) for p in params if p != "self" and hasattr(net, p)})
