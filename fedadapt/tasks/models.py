"""Models of the tasks: the papers' architectures.

Papers: Δ-SGD (Kim et al., arXiv:2306.11201; authors' code
``jlylekim/auto-tuned-FL``), Fed-LAMB (Karimi et al., arXiv:2110.00532) and
FedDuA (Takakura et al., "FedDuA: Doubly Adaptive Federated Learning", which
follows the FedExP code ``Divyansh03/FedExP`` of Jhunjhunwala et al.,
arXiv:2301.09604).

Models and parameter counts (each checked in ``tests/tasks/test_models.py``):

* :class:`MLP`: the digits task's small perceptron (unchanged).
* :class:`CNNMnist`: Δ-SGD MNIST/FMNIST CNN, also Fed-LAMB's MNIST CNN
  (Δ-SGD §4; Fed-LAMB §4): 21,840.
* :class:`LambMLP`: Fed-LAMB MNIST MLP 784→200→10 (§4): 159,010.
* :func:`resnet18_cifar`: Δ-SGD / FedDuA CIFAR ResNet-18 (Δ-SGD §4;
  FedDuA §5.1, App. H.2): 11,173,962 for 10 classes, BN or GroupNorm.
* :func:`resnet50_cifar`: Δ-SGD CIFAR-100 ResNet-50 (Δ-SGD §4): 23,705,252 for 100
  classes.
* :class:`FemnistCNN`: FedDuA FEMNIST CNN, App. Table 5: 1,206,590.
* :class:`ShakespeareLSTM`: FedDuA LSTM, App. Table 4: 1,093,199.
* :class:`LinearRegression`: FedDuA synthetic linear model (FedDuA §5.1,
  App. H.2): 1,000.
* :class:`ResNet9`: Fed-LAMB CIFAR-10 ResNet-9 (our choice of network, §4
  leaves it open): 6,573,120.

Every classifier returns *logits*: use it with ``nn.CrossEntropyLoss``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP",
    "Bottleneck",
    "BasicBlock",
    "CNNMnist",
    "FemnistCNN",
    "LambMLP",
    "LinearRegression",
    "ResNet9",
    "ResNetCIFAR",
    "ShakespeareLSTM",
    "count_parameters",
    "representation",
    "representation_layer",
    "resnet18_cifar",
    "resnet50_cifar",
]

#: Normalisation layer of the ResNets: BatchNorm or GroupNorm.
NormKind = Literal["batch", "group"]


def count_parameters(model: nn.Module) -> int:
    """Return the number of trainable parameters.

    Parameters
    ----------
    model : nn.Module
        Any module.

    Returns
    -------
    int
        Sum of ``p.numel()`` over the parameters with ``requires_grad``.
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class MLP(nn.Module):
    """A one-hidden-layer perceptron: Linear → ReLU → Linear."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits."""
        return self.net(x)


def representation_layer(model: nn.Module) -> nn.Linear:
    """Return the layer whose input is the model's *representation*.

    The rule (our choice, for MOON's z and any other use): the representation
    is the input of the model's last ``nn.Linear`` layer in registration
    order, the classifier of every model here (MOON, Li et al. 2021 §3.1,
    uses the output of a projection head the task models lack; the Δ-SGD
    code uses the ResNet's pooled features, :meth:`ResNetCIFAR.features`,
    the same tensor). For :class:`LinearRegression` that is the input x
    itself: the model has no hidden layer.

    Raises ValueError when the model has no ``nn.Linear`` layer.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear layer, so no representation "
            "(the input of its last Linear layer) is defined"
        )
    return linears[-1]


def representation(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Run ``model(x)``; return (its representation as ``(N, d)``, its output).

    The representation is the input of :func:`representation_layer`,
    flattened to two dimensions (one row per example), taken from the same
    forward pass as the output.
    """
    captured: list[torch.Tensor] = []
    hook = representation_layer(model).register_forward_pre_hook(
        lambda _module, args: captured.append(args[0])
    )
    try:
        output = model(x)
    finally:
        hook.remove()
    return captured[-1].flatten(1), output


# ---------------------------------------------------------------------------
# MNIST / FMNIST
# ---------------------------------------------------------------------------


class CNNMnist(nn.Module):
    """The Δ-SGD MNIST/FMNIST CNN (Δ-SGD §4; code ``src/cnn.py``).

    conv 1→10 (5×5), max-pool 2, ReLU; conv 10→20 (5×5), Dropout2d, max-pool 2,
    ReLU; flatten (20·4·4 = 320); FC 320→50, ReLU, dropout (p = 0.5); FC
    50→``num_classes``. With 28×28 inputs and 10 classes: 21,840 parameters
    The same shape is Fed-LAMB's MNIST CNN ("two max-pooled
    convolutional layers followed by a dropout layer and two fully-connected
    layers with 320 and 50 cells", Fed-LAMB §4).

    Deviation: the official code returns ``log_softmax``; this model returns the
    logits. ``CrossEntropyLoss(logits)`` equals ``NLLLoss(log_softmax(logits))``
    and, since ``log_softmax`` is idempotent, also equals the code's
    ``CrossEntropyLoss(log_softmax(logits))``; the argmax is unchanged. So the
    loss, gradients and accuracy are identical.

    Parameters
    ----------
    num_classes : int (default: 10)
        Output classes.
    in_channels : int (default: 1)
        Input channels (the code's ``args.num_channels``).
    dropout : float (default: 0.5)
        Rate of both the ``Dropout2d`` and the FC dropout (PyTorch's default,
        used by the code).

    Notes
    -----
    Input: ``(N, in_channels, 28, 28)``; output: ``(N, num_classes)``.
    """

    def __init__(
        self, num_classes: int = 10, in_channels: int = 1, dropout: float = 0.5
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d(dropout)
        self.fc1 = nn.Linear(320, 50)
        self.fc_drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits of shape ``(N, num_classes)``."""
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = torch.flatten(x, 1)
        x = self.fc_drop(F.relu(self.fc1(x)))
        return self.fc2(x)


class LambMLP(nn.Module):
    """Fed-LAMB's MNIST MLP: 784 → 200 (ReLU, dropout) → 10.

    Fed-LAMB (Karimi et al., arXiv:2110.00532) §4: "a simple multilayer
    perceptron (MLP), which has one hidden layer containing 200 cells with
    dropout". 784·200 + 200 + 200·10 + 10 = 159,010 parameters.

    The dropout rate is not stated; the default 0.5 is PyTorch's default, used
    by the MLP of the federated code base that the Δ-SGD code derives from
    (``src/cnn.py`` ``MLP``, which applies dropout before the ReLU; the two
    orders are the same function since ReLU commutes with dropout's mask and
    positive scaling). Returns logits (that ``MLP`` ends in a softmax, which
    would be wrong before ``CrossEntropyLoss``).

    Parameters
    ----------
    in_features : int (default: 784)
        Flattened input size (28·28).
    hidden : int (default: 200)
        Hidden units.
    num_classes : int (default: 10)
        Output classes.
    dropout : float (default: 0.5)
        Dropout rate after the hidden layer (our choice).
    """

    def __init__(
        self,
        in_features: int = 784,
        hidden: int = 200,
        num_classes: int = 10,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits of shape ``(N, num_classes)``."""
        return self.net(x)


# ---------------------------------------------------------------------------
# CIFAR ResNets (kuangliu's CIFAR variant)
# ---------------------------------------------------------------------------


def _norm(
    kind: NormKind, channels: int, groups: int, track_running_stats: bool = True
) -> nn.Module:
    """Return a BatchNorm2d or GroupNorm layer over ``channels`` channels."""
    if kind == "batch":
        return nn.BatchNorm2d(channels, track_running_stats=track_running_stats)
    if kind == "group":
        return nn.GroupNorm(groups, channels)
    raise ValueError(f"norm must be 'batch' or 'group', got {kind!r}")


def _shortcut(
    in_planes: int, out_planes: int, stride: int, norm: NormKind, groups: int
) -> nn.Module:
    """Return a block's shortcut: identity, or a 1×1 projection where shapes change.

    The projection's norm layer always keeps running statistics (the Δ-SGD
    code turns them off only on the blocks' inner BNs).
    """
    if stride == 1 and in_planes == out_planes:
        return nn.Sequential()
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False),
        _norm(norm, out_planes, groups),
    )


class BasicBlock(nn.Module):
    """ResNet basic block (two 3×3 convs), kuangliu's CIFAR variant.

    Parameters
    ----------
    in_planes : int
        Input channels.
    planes : int
        Output channels (``expansion = 1``).
    stride : int (default: 1)
        Stride of the first conv and of the 1×1 projection shortcut.
    norm : {"batch", "group"} (default: "batch")
        Normalisation layer.
    groups : int (default: 2)
        Groups of ``GroupNorm`` (FedExP code: 2; FedDuA does not state its norm
        layer and follows that code).
    track_running_stats : bool (default: True)
        For ``norm="batch"``: whether ``bn1``/``bn2`` keep running statistics.
        The Δ-SGD code sets ``False`` on these two BNs only; the
        shortcut's BN keeps the standard behaviour, as in that code.
    """

    expansion = 1

    def __init__(
        self,
        in_planes: int,
        planes: int,
        stride: int = 1,
        norm: NormKind = "batch",
        groups: int = 2,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(
            in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False
        )
        self.bn1 = _norm(norm, planes, groups, track_running_stats)
        self.conv2 = nn.Conv2d(
            planes, planes, kernel_size=3, stride=1, padding=1, bias=False
        )
        self.bn2 = _norm(norm, planes, groups, track_running_stats)
        self.shortcut = _shortcut(
            in_planes, self.expansion * planes, stride, norm, groups
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """ResNet bottleneck block (1×1, 3×3, 1×1 convs), kuangliu's CIFAR variant.

    Parameters
    ----------
    in_planes : int
        Input channels.
    planes : int
        Width of the 3×3 conv; the output has ``4 * planes`` channels.
    stride : int (default: 1)
        Stride of the 3×3 conv and of the projection shortcut.
    norm : {"batch", "group"} (default: "batch")
        Normalisation layer.
    groups : int (default: 2)
        Groups of ``GroupNorm``.
    track_running_stats : bool (default: True)
        For ``norm="batch"``: whether ``bn1``–``bn3`` keep running statistics.
        The Δ-SGD code keeps them (True); ``False`` extends R-18's setting to R-50.
    """

    expansion = 4

    def __init__(
        self,
        in_planes: int,
        planes: int,
        stride: int = 1,
        norm: NormKind = "batch",
        groups: int = 2,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__()
        out_planes = self.expansion * planes
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=1, bias=False)
        self.bn1 = _norm(norm, planes, groups, track_running_stats)
        self.conv2 = nn.Conv2d(
            planes, planes, kernel_size=3, stride=stride, padding=1, bias=False
        )
        self.bn2 = _norm(norm, planes, groups, track_running_stats)
        self.conv3 = nn.Conv2d(planes, out_planes, kernel_size=1, bias=False)
        self.bn3 = _norm(norm, out_planes, groups, track_running_stats)
        self.shortcut = _shortcut(in_planes, out_planes, stride, norm, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``relu(bn3(conv3(...)) + shortcut(x))``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class ResNetCIFAR(nn.Module):
    """ResNet for 32×32 inputs, kuangliu's CIFAR variant.

    Used by Δ-SGD (arXiv:2306.11201) §4 and FedDuA §5.1, App. H.2.

    3×3 stem conv (64 channels, stride 1, no bias) → norm → ReLU, no max-pool;
    four stages of widths 64/128/256/512 with strides 1/2/2/2;
    ``avg_pool2d(·, pool_kernel)``; flatten; linear. This is the Δ-SGD code's
    ``src/resnet.py`` and, with ``norm="group"`` and ``pool_kernel=3``, the
    FedExP code's ``util_models.py`` that FedDuA follows.

    Parameters
    ----------
    block : type[BasicBlock] | type[Bottleneck]
        Residual block.
    num_blocks : Sequence[int]
        Blocks per stage (four entries).
    num_classes : int (default: 10)
        Output classes.
    norm : {"batch", "group"} (default: "batch")
        ``BatchNorm2d`` (Δ-SGD code) or ``GroupNorm(groups, C)`` (FedExP code;
        our default for FedDuA, whose paper does not name the norm). Both
        have 2 parameters per channel, so the parameter count does not depend
        on it.
    groups : int (default: 2)
        Groups of ``GroupNorm``.
    track_running_stats : bool (default: True)
        Passed to the blocks' inner BNs only; the stem BN and the
        shortcut BNs always track running statistics, as in the Δ-SGD code.
        No effect with ``norm="group"``.
    pool_kernel : int (default: 4)
        Kernel (and stride) of the final average pool. The 4×4 feature map of a
        32×32 input gives 1×1 either way; 4 (kuangliu, Δ-SGD) averages the whole
        map, 3 (FedExP code) averages only its top-left 3×3 window. The FedExP
        choice is offered for exact reproduction of FedDuA's runs; the default
        is the standard global average.
    in_channels : int (default: 3)
        Input channels.

    Notes
    -----
    Input: ``(N, in_channels, 32, 32)``; output: ``(N, num_classes)`` logits.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        num_blocks: Sequence[int],
        num_classes: int = 10,
        norm: NormKind = "batch",
        groups: int = 2,
        track_running_stats: bool = True,
        pool_kernel: int = 4,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if len(num_blocks) != 4:
            raise ValueError(f"num_blocks needs 4 entries, got {list(num_blocks)}")
        _norm(norm, 64, groups)  # validate `norm` early
        self.pool_kernel = pool_kernel
        self.conv1 = nn.Conv2d(
            in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False
        )
        self.bn1 = _norm(norm, 64, groups)
        in_planes = 64
        stages = []
        for planes, n, stride in zip(
            (64, 128, 256, 512), num_blocks, (1, 2, 2, 2), strict=True
        ):
            layers = []
            for s in [stride] + [1] * (n - 1):
                layers.append(
                    block(in_planes, planes, s, norm, groups, track_running_stats)
                )
                in_planes = planes * block.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.linear = nn.Linear(512 * block.expansion, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Return the pooled, flattened features (the code's MOON output)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.avg_pool2d(out, self.pool_kernel)
        return torch.flatten(out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits of shape ``(N, num_classes)``."""
        return self.linear(self.features(x))


def resnet18_cifar(
    num_classes: int = 10,
    norm: NormKind = "batch",
    track_running_stats: bool = True,
    pool_kernel: int = 4,
    groups: int = 2,
) -> ResNetCIFAR:
    """Return the CIFAR ResNet-18 (BasicBlock, [2, 2, 2, 2]).

    11,173,962 parameters for 10 classes with either norm.

    * Δ-SGD (§4): ``norm="batch"``; ``track_running_stats=False`` reproduces
      the authors' code's BasicBlock BNs (standard BN is the default).
    * FedDuA (§5.1; the paper does not name the norm layer, the FedExP code it
      follows uses GroupNorm): ``norm="group"`` (2 groups); add ``pool_kernel=3``
      for the FedExP code's exact pooling.

    Parameters
    ----------
    num_classes : int (default: 10)
        Output classes (100 for CIFAR-100).
    norm : {"batch", "group"} (default: "batch")
        Normalisation layer.
    track_running_stats : bool (default: True)
        Running statistics of the blocks' inner BNs (see :class:`ResNetCIFAR`).
    pool_kernel : int (default: 4)
        Final average-pool kernel (see :class:`ResNetCIFAR`).
    groups : int (default: 2)
        Groups of ``GroupNorm``.

    Returns
    -------
    ResNetCIFAR
        The model.
    """
    return ResNetCIFAR(
        BasicBlock,
        (2, 2, 2, 2),
        num_classes=num_classes,
        norm=norm,
        groups=groups,
        track_running_stats=track_running_stats,
        pool_kernel=pool_kernel,
    )


def resnet50_cifar(
    num_classes: int = 100,
    norm: NormKind = "batch",
    track_running_stats: bool = True,
    pool_kernel: int = 4,
    groups: int = 2,
) -> ResNetCIFAR:
    """Return the CIFAR ResNet-50 (Bottleneck, [3, 4, 6, 3]; Δ-SGD §4).

    Δ-SGD's CIFAR-100 model: 23,705,252 parameters for 100 classes
    (23,520,842 for 10).

    Parameters
    ----------
    num_classes : int (default: 100)
        Output classes.
    norm : {"batch", "group"} (default: "batch")
        Normalisation layer (the Δ-SGD code uses BN).
    track_running_stats : bool (default: True)
        Running statistics of the bottlenecks' inner BNs (code: True).
    pool_kernel : int (default: 4)
        Final average-pool kernel.
    groups : int (default: 2)
        Groups of ``GroupNorm``.

    Returns
    -------
    ResNetCIFAR
        The model.
    """
    return ResNetCIFAR(
        Bottleneck,
        (3, 4, 6, 3),
        num_classes=num_classes,
        norm=norm,
        groups=groups,
        track_running_stats=track_running_stats,
        pool_kernel=pool_kernel,
    )


# ---------------------------------------------------------------------------
# FedDuA: FEMNIST, Shakespeare, synthetic
# ---------------------------------------------------------------------------


class FemnistCNN(nn.Module):
    """FedDuA's FEMNIST CNN (App. Table 5 = FedExP's ``EMNIST_CNN``).

    conv 1→32 (3×3), ReLU; conv 32→64 (3×3), ReLU; max-pool 2; dropout 0.25;
    flatten (64·12·12 = 9,216); FC 9216→128, ReLU; dropout 0.5; FC 128→62.
    Table 5 omits the max-pool (implied by the 1,179,776 = 9216·128 + 128
    parameters of the first dense layer) and the dropout rates, which are
    taken from the FedExP code. 320 + 18,496 + 1,179,776 + 7,998 = 1,206,590
    parameters.

    Parameters
    ----------
    num_classes : int (default: 62)
        Output classes.
    dropout_conv : float (default: 0.25)
        Dropout after the pooling.
    dropout_fc : float (default: 0.5)
        Dropout after the hidden FC layer.

    Notes
    -----
    Input: ``(N, 1, 28, 28)``; output: ``(N, num_classes)`` logits.
    """

    def __init__(
        self,
        num_classes: int = 62,
        dropout_conv: float = 0.25,
        dropout_fc: float = 0.5,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.dropout1 = nn.Dropout(dropout_conv)
        self.fc1 = nn.Linear(12 * 12 * 64, 128)
        self.dropout2 = nn.Dropout(dropout_fc)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits of shape ``(N, num_classes)``."""
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = torch.flatten(x, 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)


class ShakespeareLSTM(nn.Module):
    """FedDuA's Shakespeare next-character LSTM (FedDuA App. Table 4).

    Embedding ``vocab_size``→``embed_dim``; ``num_layers``-layer LSTM with
    ``hidden`` units (batch first); dropout; dense ``hidden``→``vocab_size``
    applied to the output at the last position. Table 4's counts fix the
    sizes:

    * Embedding 20,224 = 79·256: vocabulary 79 and embedding width 256 (not
      LEAF's 80 characters nor the usual width 8);
    * LSTM 1,052,672 = 2 × 4·256·(256 + 256 + 2): two PyTorch layers of 256
      units (PyTorch keeps two bias vectors per gate; one layer would be half
      that);
    * Dense 20,303 = 256·79 + 79.

    Total 1,093,199. The table's output shape ``[256, 79]`` is
    read as the dense layer's weight shape; the prediction is made from the
    last position (the paper does not say), so the output is
    ``(N, vocab_size)``. The dropout rate is not stated; 0.5 is our choice
    (FedDuA's other model uses 0.5 before its last layer). ``last_only=False``
    returns every position's logits.

    Parameters
    ----------
    vocab_size : int (default: 79)
        Vocabulary (embedding rows and output classes).
    embed_dim : int (default: 256)
        Embedding width.
    hidden : int (default: 256)
        LSTM hidden units.
    num_layers : int (default: 2)
        Stacked LSTM layers.
    dropout : float (default: 0.5)
        Dropout between the LSTM and the dense layer (our choice).
    seq_len : int (default: 80)
        Nominal input length (Table 4's input ``[80]``); informational, any
        length is accepted.
    last_only : bool (default: True)
        Return the logits of the last position only.

    Notes
    -----
    Input: integer ids ``(N, L)``; output: ``(N, vocab_size)`` or
    ``(N, L, vocab_size)``.
    """

    def __init__(
        self,
        vocab_size: int = 79,
        embed_dim: int = 256,
        hidden: int = 256,
        num_layers: int = 2,
        dropout: float = 0.5,
        seq_len: int = 80,
        last_only: bool = True,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.last_only = last_only
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=num_layers, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return next-character logits (see the class notes for the shape)."""
        out, _ = self.lstm(self.embedding(x))
        if self.last_only:
            out = out[:, -1]
        return self.fc(self.dropout(out))


class LinearRegression(nn.Module):
    """FedDuA's synthetic linear model ``x ↦ ⟨w, x⟩`` (FedDuA §5.1).

    The loss (our reading of FedDuA §5.1, App. H.2) is
    ``F(w) = (1/M) Σ_i (1/(2n)) ‖X_i w − y_i‖²``
    with labels ``y = ⟨w_{i,j}, x⟩`` (no intercept) and ``w_0 = 0``: the model
    is a bias-free linear layer, zero-initialised by default. With
    ``nn.MSELoss()`` on a batch, ``0.5 * MSELoss`` is ``(1/(2n))‖Xw − y‖²``.

    Parameters
    ----------
    dim : int (default: 1000)
        Input dimension d.
    zero_init : bool (default: True)
        Start from ``w_0 = 0`` (not stated in the paper); ``False`` keeps
        PyTorch's default init.

    Notes
    -----
    Input: ``(N, dim)``; output: ``(N,)``.
    """

    def __init__(self, dim: int = 1000, zero_init: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 1, bias=False)
        if zero_init:
            nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the predictions ``X w`` of shape ``(N,)``."""
        return self.linear(x).squeeze(-1)


# ---------------------------------------------------------------------------
# Fed-LAMB CIFAR-10 ResNet-9 (our choice of network)
# ---------------------------------------------------------------------------


def _conv_norm(
    in_ch: int, out_ch: int, norm: NormKind, groups: int, pool: bool = False
) -> nn.Sequential:
    """Return conv 3×3 (no bias) → norm → ReLU (→ max-pool 2)."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1, bias=False),
        _norm(norm, out_ch, groups),
        nn.ReLU(),
    ]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    """``x + f(x)``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class ResNet9(nn.Module):
    """DAWNBench-style ResNet-9 (64-128r-256-512r) for Fed-LAMB (our choice).

    Fed-LAMB (arXiv:2110.00532) §4 attributes its CIFAR-10 ResNet-9 to He et al.
    without details; we take the DAWNBench (Myrtle / D. Page) network:

    prep: conv 3→64; layer1: conv 64→128, max-pool 2, residual of two convs
    128→128; layer2: conv 128→256, max-pool 2; layer3: conv 256→512, max-pool
    2, residual of two convs 512→512; global max-pool (4×4 for 32×32 inputs);
    linear 512→``num_classes`` without bias, logits scaled by
    ``output_scale = 0.125``. Each conv is 3×3 without bias, followed by the
    norm and ReLU. 6,573,120 parameters for 10 classes.

    Parameters
    ----------
    num_classes : int (default: 10)
        Output classes.
    norm : {"batch", "group"} (default: "batch")
        Normalisation layer.
    groups : int (default: 2)
        Groups of ``GroupNorm``.
    output_scale : float (default: 0.125)
        Multiplier of the logits (Page's ``Mul(0.125)``); 1.0 disables it.
    in_channels : int (default: 3)
        Input channels.
    """

    def __init__(
        self,
        num_classes: int = 10,
        norm: NormKind = "batch",
        groups: int = 2,
        output_scale: float = 0.125,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.output_scale = output_scale
        self.body = nn.Sequential(
            _conv_norm(in_channels, 64, norm, groups),
            _conv_norm(64, 128, norm, groups, pool=True),
            _Residual(
                nn.Sequential(
                    _conv_norm(128, 128, norm, groups),
                    _conv_norm(128, 128, norm, groups),
                )
            ),
            _conv_norm(128, 256, norm, groups, pool=True),
            _conv_norm(256, 512, norm, groups, pool=True),
            _Residual(
                nn.Sequential(
                    _conv_norm(512, 512, norm, groups),
                    _conv_norm(512, 512, norm, groups),
                )
            ),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
        )
        self.linear = nn.Linear(512, num_classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits of shape ``(N, num_classes)``."""
        return self.linear(self.body(x)) * self.output_scale
