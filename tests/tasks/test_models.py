"""Models of the tasks: shapes, gradients, parameter counts and init.

Expected parameter counts: the FEMNIST CNN and the LSTM are the sums of
FedDuA App. H.2 Tables 5 and 4; the LAMB MLP follows from Fed-LAMB
(arXiv:2110.00532) §4 (784→200→10); CNNMnist and the CIFAR ResNet-18 are the
models of the Δ-SGD authors' code (``cnn.py``, ``resnet.py``). The ResNet-18,
ResNet-50, ResNet-9, LSTM and FEMNIST counts are also re-derived layer by layer
here, independently of the code under test.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from fedadapt.tasks.models import (
    MLP,
    BasicBlock,
    Bottleneck,
    CNNMnist,
    FemnistCNN,
    LambMLP,
    LinearRegression,
    ResNet9,
    ShakespeareLSTM,
    count_parameters,
    resnet18_cifar,
    resnet50_cifar,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Run single-threaded: small CPU ops are faster and immune to contention."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


IMG_MNIST = (2, 1, 28, 28)
IMG_CIFAR = (2, 3, 32, 32)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 79, (2, 80))


# name -> (model factory, input factory, output shape)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], tuple]] = {
    "mlp": (lambda: MLP(784, 32, 10), lambda: torch.randn(IMG_MNIST), (2, 10)),
    "cnn_mnist": (CNNMnist, lambda: torch.randn(IMG_MNIST), (2, 10)),
    "lamb_mlp": (LambMLP, lambda: torch.randn(IMG_MNIST), (2, 10)),
    "femnist_cnn": (FemnistCNN, lambda: torch.randn(IMG_MNIST), (2, 62)),
    "lstm": (ShakespeareLSTM, _tokens, (2, 79)),
    "linreg": (
        lambda: LinearRegression(1000, zero_init=False),
        lambda: torch.randn(2, 1000),
        (2,),
    ),
    "resnet18_bn": (resnet18_cifar, lambda: torch.randn(IMG_CIFAR), (2, 10)),
    "resnet18_gn": (
        lambda: resnet18_cifar(norm="group"),
        lambda: torch.randn(IMG_CIFAR),
        (2, 10),
    ),
    "resnet18_notrack": (
        lambda: resnet18_cifar(100, track_running_stats=False),
        lambda: torch.randn(IMG_CIFAR),
        (2, 100),
    ),
    "resnet18_fedexp": (
        lambda: resnet18_cifar(norm="group", pool_kernel=3),
        lambda: torch.randn(IMG_CIFAR),
        (2, 10),
    ),
    "resnet50": (resnet50_cifar, lambda: torch.randn(IMG_CIFAR), (2, 100)),
    "resnet9": (ResNet9, lambda: torch.randn(IMG_CIFAR), (2, 10)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_backward(name):
    """Each model: forward, output shape, backward, finite gradients."""
    factory, make_input, shape = CASES[name]
    torch.manual_seed(0)
    model = factory()
    model.train()
    out = model(make_input())
    assert out.shape == shape
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        (CNNMnist, 21_840),
        (LambMLP, 159_010),
        (FemnistCNN, 1_206_590),
        (ShakespeareLSTM, 1_093_199),
        (resnet18_cifar, 11_173_962),
        (lambda: resnet18_cifar(norm="group"), 11_173_962),
        (lambda: resnet18_cifar(track_running_stats=False), 11_173_962),
    ],
    ids=["cnn", "lamb_mlp", "femnist", "lstm", "r18_bn", "r18_gn", "r18_notrack"],
)
def test_parameter_counts_u24(factory, expected):
    """Trainable parameter counts (sources in the module docstring)."""
    model = factory()
    assert count_parameters(model) == expected
    assert sum(p.numel() for p in model.parameters()) == expected


def _conv(cin: int, cout: int, k: int, bias: bool = False) -> int:
    return cin * cout * k * k + (cout if bias else 0)


def test_layerwise_counts_of_paper_tables():
    """DUA App. Tables 4/5 and LAMB §4 re-derived from the layer sizes."""
    # FEMNIST CNN (Table 5): 320, 18,496, 1,179,776, 7,998.
    femnist = [_conv(1, 32, 3, True), _conv(32, 64, 3, True), 9216 * 128 + 128]
    femnist.append(128 * 62 + 62)
    assert femnist == [320, 18_496, 1_179_776, 7_998]
    assert count_parameters(FemnistCNN()) == sum(femnist)
    # LSTM (Table 4): embedding 79x256, two PyTorch layers (two biases), dense.
    emb, h = 79 * 256, 256
    lstm = sum(4 * h * (i + h) + 2 * 4 * h for i in (256, h))
    dense = h * 79 + 79
    assert (emb, lstm, dense) == (20_224, 1_052_672, 20_303)
    assert count_parameters(ShakespeareLSTM()) == emb + lstm + dense
    # CNNMnist and LAMB MLP.
    cnn = _conv(1, 10, 5, True) + _conv(10, 20, 5, True) + 320 * 50 + 50 + 510
    assert count_parameters(CNNMnist()) == cnn
    assert count_parameters(LambMLP()) == 784 * 200 + 200 + 200 * 10 + 10


def _resnet_cifar_count(bottleneck: bool, blocks, num_classes: int) -> int:
    """Independent formula: convs without bias, 2 affine params per norm channel."""
    expansion = 4 if bottleneck else 1
    total = _conv(3, 64, 3) + 2 * 64  # stem conv + norm
    cin = 64
    for planes, n, stride in zip(
        (64, 128, 256, 512), blocks, (1, 2, 2, 2), strict=True
    ):
        for i in range(n):
            s = stride if i == 0 else 1
            cout = planes * expansion
            if bottleneck:
                total += _conv(cin, planes, 1) + 2 * planes
                total += _conv(planes, planes, 3) + 2 * planes
                total += _conv(planes, cout, 1) + 2 * cout
            else:
                total += _conv(cin, planes, 3) + 2 * planes
                total += _conv(planes, planes, 3) + 2 * planes
            if s != 1 or cin != cout:
                total += _conv(cin, cout, 1) + 2 * cout
            cin = cout
    return total + cin * num_classes + num_classes


def test_resnet_counts_by_formula():
    """R-18 formula gives 11,173,962; R-50 (CIFAR-100) derived independently."""
    assert _resnet_cifar_count(False, (2, 2, 2, 2), 10) == 11_173_962
    expected50 = _resnet_cifar_count(True, (3, 4, 6, 3), 100)
    assert expected50 == 23_705_252
    assert count_parameters(resnet50_cifar(100)) == expected50
    assert count_parameters(resnet50_cifar(100, norm="group")) == expected50
    assert count_parameters(resnet50_cifar(10)) == _resnet_cifar_count(
        True, (3, 4, 6, 3), 10
    )
    assert count_parameters(resnet18_cifar(100)) == _resnet_cifar_count(
        False, (2, 2, 2, 2), 100
    )


def test_resnet9_count_by_formula():
    """DAWNBench ResNet-9, our choice: Fed-LAMB §4 leaves its ResNet-9 unspecified.

    3x3 convs without bias, norms, linear.
    """
    convs = [(3, 64), (64, 128), (128, 128), (128, 128), (128, 256), (256, 512)]
    convs += [(512, 512), (512, 512)]
    expected = sum(_conv(a, b, 3) + 2 * b for a, b in convs) + 512 * 10
    assert count_parameters(ResNet9()) == expected == 6_573_120


def test_track_running_stats_false_only_in_basic_blocks():
    """Δ-SGD authors' code (``resnet.py``): BasicBlock bn1/bn2 keep no buffers.

    The Δ-SGD paper does not say; we follow the code's layout.
    """
    model = resnet18_cifar(track_running_stats=False)
    blocks = [m for m in model.modules() if isinstance(m, BasicBlock)]
    assert len(blocks) == 8
    for block in blocks:
        for bn in (block.bn1, block.bn2):
            assert isinstance(bn, nn.BatchNorm2d)
            assert not bn.track_running_stats
            assert bn.running_mean is None and bn.running_var is None
            assert list(bn.buffers()) == []
    # The stem BN and the shortcut BNs keep theirs, as in the Δ-SGD code.
    assert model.bn1.running_mean is not None
    shortcut_bns = [
        m for b in blocks for m in b.shortcut.modules() if isinstance(m, nn.BatchNorm2d)
    ]
    assert len(shortcut_bns) == 3
    assert all(bn.track_running_stats for bn in shortcut_bns)
    # Default: every BN tracks running statistics.
    default = resnet18_cifar()
    assert all(
        m.track_running_stats
        for m in default.modules()
        if isinstance(m, nn.BatchNorm2d)
    )
    # Such a BN normalises with batch statistics even in eval mode.
    bn = model.layer1[0].bn1.eval()
    z = 3.0 + 2.0 * torch.randn(4, 64, 8, 8)
    with torch.no_grad():
        out = bn(z)
    assert torch.allclose(out.mean(dim=(0, 2, 3)), torch.zeros(64), atol=1e-5)


def test_group_norm_has_no_batchnorm_and_two_groups():
    """FedExP code's ResNet-18 (FedDuA §5.1 names no norm): GroupNorm(2, C)."""
    model = resnet18_cifar(norm="group")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    gns = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(gns) == 1 + 8 * 2 + 3
    assert all(gn.num_groups == 2 for gn in gns)
    assert list(model.buffers()) == []
    r50 = resnet50_cifar(norm="group")
    assert sum(isinstance(m, Bottleneck) for m in r50.modules()) == 16
    with pytest.raises(ValueError):
        resnet18_cifar(norm="layer")  # type: ignore[arg-type]


def test_pool_kernel_option():
    """avg_pool2d(·, 4) averages the 4x4 map; (·, 3) only its top-left 3x3."""
    torch.manual_seed(0)
    m4 = resnet18_cifar(norm="group").eval()
    m3 = resnet18_cifar(norm="group", pool_kernel=3).eval()
    m3.load_state_dict(m4.state_dict())
    x = torch.randn(IMG_CIFAR)
    with torch.no_grad():
        f4, f3 = m4.features(x), m3.features(x)
        assert f4.shape == f3.shape == (2, 512)
        assert not torch.allclose(f4, f3)


def test_cnn_logits_equivalent_to_code_log_softmax():
    """Δ-SGD code's CNN ends in log_softmax: CE on logits = CE on its output."""
    torch.manual_seed(0)
    model = CNNMnist().eval()
    x, y = torch.randn(IMG_MNIST), torch.tensor([3, 7])
    with torch.no_grad():
        logits = model(x)
    ce = nn.CrossEntropyLoss()
    assert torch.allclose(ce(logits, y), ce(torch.log_softmax(logits, 1), y))
    assert torch.allclose(ce(logits, y), nn.NLLLoss()(torch.log_softmax(logits, 1), y))


def test_lstm_options():
    """FedDuA App. H.2 Table 4 LSTM: two layers of 256 units, vocabulary 79.

    The paper does not say which positions predict; our choice is the last by
    default, all positions with last_only=False.
    """
    torch.manual_seed(0)
    model = ShakespeareLSTM().eval()
    x = _tokens()
    with torch.no_grad():
        last = model(x)
        model.last_only = False
        every = model(x)
    assert every.shape == (2, 80, 79)
    assert torch.allclose(every[:, -1], last)
    assert model.lstm.num_layers == 2 and model.lstm.hidden_size == 256
    assert model.embedding.weight.shape == (79, 256)


def test_linear_regression_matches_spec_loss():
    """FedDuA §5.1 / App. H.2 linear model, with our reading of the loss.

    Bias-free, w_0 = 0, 0.5·MSE = (1/(2n))‖Xw − y‖², gradient X^T r / n.
    """
    model = LinearRegression(5)
    assert [n for n, _ in model.named_parameters()] == ["linear.weight"]
    assert torch.count_nonzero(model.linear.weight) == 0
    x = torch.randn(4, 5, dtype=torch.float64)
    y = torch.randn(4, dtype=torch.float64)
    w = torch.randn(5, dtype=torch.float64)
    model = model.double()
    with torch.no_grad():
        model.linear.weight.copy_(w[None])
    pred = model(x)
    assert pred.shape == (4,)
    assert torch.allclose(pred, x @ w)
    loss = 0.5 * nn.MSELoss()(pred, y)
    loss.backward()
    r = x @ w - y
    assert torch.allclose(loss, r.square().sum() / (2 * 4))
    assert torch.allclose(model.linear.weight.grad[0], x.T @ r / 4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_deterministic_init(name):
    """The same torch.manual_seed gives the same initial state."""
    factory = CASES[name][0]
    torch.manual_seed(123)
    a = factory().state_dict()
    torch.manual_seed(123)
    b = factory().state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    torch.manual_seed(124)
    c = factory().state_dict()
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_eval_mode_is_deterministic():
    """Dropout is off in eval mode: two forward passes agree."""
    torch.manual_seed(0)
    for model, x in [
        (CNNMnist(), torch.randn(IMG_MNIST)),
        (LambMLP(), torch.randn(IMG_MNIST)),
        (FemnistCNN(), torch.randn(IMG_MNIST)),
        (ShakespeareLSTM(), _tokens()),
    ]:
        model.eval()
        with torch.no_grad():
            assert torch.equal(model(x), model(x))
