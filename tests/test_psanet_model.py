"""PSANet model: YAML building, shapes, the PSA branch against numpy, compact mode,
no bias where the reproduction has none, gradients, and that a few steps lower the loss."""
import glob
import os

import numpy as np
import paddle
import pytest
from paddleseg.cvlibs import Config
from paddleseg.models import layers

import psanet.models  # noqa: F401  (registers PSANet)
from psanet.models import PSANet
from psanet.models.psanet import PSABranch
from psanet.ops import psa_impl
from conftest import ROOT
from engine_helpers import build_config_model
from psa_mask_reference import assert_within, branch_reference, reference_forward

CONFIGS = sorted(glob.glob(os.path.join(ROOT, 'configs', 'psanet', '*.yml')))


def small_backbone():
    from paddleseg.models.backbones import ResNet18_vd
    return ResNet18_vd(output_stride=8)


@pytest.mark.parametrize('path', CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_builds_from_yaml_with_train_and_eval_shapes(path):
    cfg, model = build_config_model(path)
    assert isinstance(model, PSANet)
    assert len(cfg.dic['loss']['types']) == 2  # main + auxiliary
    x = paddle.randn([1, 3, 64, 64])
    model.train()
    train_out = model(x)
    assert [list(o.shape) for o in train_out] == [[1, 19, 64, 64]] * 2
    model.eval()
    with paddle.no_grad():
        eval_out = model(x)
    assert [list(o.shape) for o in eval_out] == [[1, 19, 64, 64]]


def test_reproduction_recipe_in_r50_config():
    cfg = Config(os.path.join(ROOT, 'configs', 'psanet',
                              'psanet_resnet50_os8_cityscapes_1024x512_80k.yml'))
    d = cfg.dic
    assert (d['batch_size'], d['iters']) == (8, 80000)
    assert d['loss']['coef'] == [1, 0.4]
    assert d['lr_scheduler'] == {'type': 'PolynomialDecay', 'learning_rate': 0.01,
                                 'end_lr': 1.0e-5, 'power': 0.9}
    assert d['optimizer'] == {'type': 'Momentum', 'momentum': 0.9, 'weight_decay': 4.0e-5}
    m = d['model']
    assert m['num_classes'] == 19
    assert m['backbone'] == {'type': 'ResNet50_vd', 'in_channels': 3, 'output_stride': 8,
                             'pretrained':
                             'https://bj.bcebos.com/paddleseg/dygraph/resnet50_vd_ssld_v2.tar.gz'}
    assert (m['mask_h'], m['mask_w'], m['psa_type'], m['shrink_factor']) == (59, 59, 2, 2)
    assert (m['normalization_factor'], m['psa_softmax'], m['use_psa']) == (1.0, True, True)
    assert (m['align_corners'], m['enable_auxiliary_loss']) == (False, True)
    names = [t['type'] for t in d['train_dataset']['transforms']]
    assert names == ['ResizeStepScaling', 'RandomPaddingCrop', 'RandomHorizontalFlip',
                     'RandomDistort', 'Normalize']
    assert d['train_dataset']['transforms'][1]['crop_size'] == [1024, 512]


@pytest.mark.parametrize('psa_type', [0, 1, 2])
def test_odd_input_size_comes_back_at_input_size(psa_type):
    model = PSANet(19, small_backbone(), psa_type=psa_type, mask_h=7, mask_w=9,
                   psa_channels=16)
    model.eval()
    with paddle.no_grad():
        out = model(paddle.randn([1, 3, 97, 131]))
    assert [list(o.shape) for o in out] == [[1, 19, 97, 131]]


@pytest.mark.parametrize('psa_type', [0, 1])
@pytest.mark.parametrize('softmax', [True, False])
@pytest.mark.parametrize('shrink_factor', [1, 2])
@pytest.mark.parametrize('form', ['dygraph', 'traced custom', 'traced paddle'])
def test_psa_branch_matches_numpy(psa_type, softmax, shrink_factor, form):
    """reduce -> shrink -> attention -> PSA mask -> softmax -> aggregation, in that order;
    'traced' is what an export runs, with either op form (the map never transposed:
    PSABranch._aggregate_exported)."""
    paddle.seed(0)
    mask_h, mask_w = 5, 3
    branch = PSABranch(8, 6, psa_type, mask_h, mask_w, shrink_factor, normalization_factor=2.5,
                       psa_softmax=softmax, compact=False)
    branch.eval()
    # 8x10 shrinks by a non-integer ratio (7/3, 9/4): a real interpolation, which
    # does not commute with reduce's ReLU (7x9 would be plain subsampling).
    x = paddle.randn([2, 8, 8, 10], dtype='float32')
    with paddle.no_grad():
        if form == 'dygraph':
            out = branch(x).numpy()
        else:
            with psa_impl(form.split()[1]):
                out = paddle.jit.to_static(branch.forward, full_graph=True)(x).numpy()
        reduced = branch.reduce(x)
        if shrink_factor > 1:
            size = [(8 - 1) // shrink_factor + 1, (10 - 1) // shrink_factor + 1]
            reduced = paddle.nn.functional.interpolate(reduced, size, mode='bilinear',
                                                       align_corners=True)
        attention = branch.attention(reduced).numpy()
    dense = reference_forward(attention, ['collect', 'distribute'][psa_type], mask_h, mask_w)
    assert_within(out, *branch_reference(reduced.numpy(), dense, 1 / 2.5, softmax))


def test_each_trace_in_a_process_takes_the_op_form_it_is_traced_with():
    """An export made after another in the same process (bench_deploy, the API) must trace
    its own op form, custom or pure-Paddle, with the map never transposed: read from the
    traced program's ops."""
    x = paddle.randn([1, 8, 6, 7])
    for impl in ('custom', 'paddle', 'custom', 'paddle'):
        branch = PSABranch(8, 6, 0, 5, 3, 1, 1.0, True, compact=False)
        branch.eval()
        with psa_impl(impl):
            traced = paddle.jit.to_static(branch.forward, full_graph=True)
            traced(x)
        ops = [op.name().split('.')[-1]
               for op in traced.concrete_program.main_program.global_block().ops]
        # The custom op is one node; the pure form's shear gathers chunks of x transposed
        # once (docs/psa_mask.md), and neither transposes the map.
        assert ops.count('psa_mask') == (impl == 'custom'), (impl, ops)
        assert ops.count('index_select') == (impl == 'paddle'), (impl, ops)
        assert ops.count('transpose') == (impl == 'paddle'), (impl, ops)
        assert ops.count('matmul') == 1, (impl, ops)


@pytest.mark.parametrize('psa_type', [0, 1])
def test_compact_matches_reference(psa_type):
    paddle.seed(1)
    h, w = 3, 4
    branch = PSABranch(8, 6, psa_type, h, w, 1, normalization_factor=1.0, psa_softmax=True,
                       compact=True)
    branch.eval()
    x = paddle.randn([2, 8, h, w])
    with paddle.no_grad():
        out = branch(x).numpy()
        reduced = branch.reduce(x)
        attention = branch.attention(reduced).numpy()  # channel q at position p
    n = attention.shape[0]
    dense = np.zeros((n, h * w, h * w), np.float32)
    for q in range(h * w):
        for p in range(h * w):
            value = attention[:, q, p // w, p % w]
            if psa_type == 0:
                dense[:, q, p] = value   # collect: Y[q, p]
            else:
                dense[:, p, q] = value   # distribute: Y[p, q]
    assert_within(out, *branch_reference(reduced.numpy(), dense.reshape(n, h * w, h, w), 1.0,
                                         True))


def test_compact_equals_full_window_op():
    """A compact branch and a (2h-1)x(2w-1) window see the same positions; the
    two must agree once the attention channels are mapped between the two."""
    h, w = 3, 4
    rng = np.random.default_rng(0)
    absolute = rng.standard_normal((1, h * w, h, w)).astype(np.float32)
    for psa_type in (0, 1):
        relative = np.zeros((1, (2 * h - 1) * (2 * w - 1), h, w), np.float32)
        for q in range(h * w):
            for p in range(h * w):
                i = q // w - p // w + h - 1
                j = q % w - p % w + w - 1
                relative[0, i * (2 * w - 1) + j, p // w, p % w] = absolute[0, q, p // w, p % w]
        from psanet.ops import psa_mask
        full = psa_mask(paddle.to_tensor(relative), psa_type, (2 * h - 1, 2 * w - 1)).numpy()
        branch = PSABranch(4, 4, psa_type, h, w, 1, 1.0, False, compact=True)
        compact = branch._compact_attention(paddle.to_tensor(absolute)).numpy()
        np.testing.assert_array_equal(compact, full)  # both only move values: exact


def test_compact_wrong_map_size_is_a_clear_error():
    branch = PSABranch(8, 6, 0, 3, 4, 1, 1.0, True, compact=True)
    with pytest.raises(ValueError, match=r'model.mask_h: 5 and model.mask_w: 6'):
        branch(paddle.randn([1, 8, 5, 6]))


def test_normalization_factor_none_means_window_area():
    model = PSANet(19, small_backbone(), psa_type=0, mask_h=5, mask_w=7,
                   normalization_factor=None, psa_channels=8)
    assert model.head.branches[0].scale == pytest.approx(1 / 35)  # 1.0 / 35 in float64


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match='psa_type'):
        PSANet(19, small_backbone(), psa_type=3)
    with pytest.raises(ValueError, match='shrink_factor'):
        PSANet(19, small_backbone(), shrink_factor=0)


def test_use_psa_false_is_the_baseline_without_attention():
    model = PSANet(19, small_backbone(), use_psa=False)
    assert not hasattr(model.head, 'branches')
    model.eval()
    with paddle.no_grad():
        assert list(model(paddle.randn([1, 3, 32, 48]))[0].shape) == [1, 19, 32, 48]


def test_the_model_names_its_attention_layers():
    branches = PSANet(19, small_backbone(), psa_type=2, mask_h=5, mask_w=5).attention_layers()
    assert [type(b).__name__ for b in branches] == ['PSABranch', 'PSABranch']
    assert [b.psa_type for b in branches] == [0, 1]  # collect runs first
    assert PSANet(19, small_backbone(), psa_type=1, mask_h=5, mask_w=5).attention_layers()[0] \
        .psa_type == 1
    baseline = PSANet(19, small_backbone(), use_psa=False)
    assert baseline.attention_layers() == [] and baseline.attention_memory(64, 64) is None


@pytest.mark.parametrize('layers', [18, 50])
@pytest.mark.parametrize('output_stride', [8, 16, 32])
@pytest.mark.parametrize('index', [1, 2, 3, -1])
def test_feature_stride_is_what_the_backbone_outputs(layers, output_stride, index):
    """The stride the model tells from its ResNet_vd, against the feature the backbone
    returns on odd sizes: ceil(size / stride) (32: what ResNet_vd builds for any other
    output_stride)."""
    from paddleseg.models.backbones.resnet_vd import ResNet_vd
    backbone = ResNet_vd(layers=layers, output_stride=output_stride)
    model = PSANet(19, backbone, backbone_indices=(0, index), mask_h=5, mask_w=5,
                   psa_channels=8)
    model.eval()
    with paddle.no_grad():
        for height, width in ((64, 96), (65, 97), (33, 250)):
            feature = backbone(paddle.zeros([1, 3, height, width]))[index]
            assert tuple(feature.shape[-2:]) == (-(-height // model.feature_stride),
                                                 -(-width // model.feature_stride))
    assert model.feature_stride == (output_stride if index in (3, -1) else
                                    min(output_stride, [4, 8, 16, 32][index]))


@pytest.mark.parametrize('layers, output_stride', [(18, 8), (18, 16), (18, 32), (50, 8)])
def test_the_smallest_input_leaves_every_average_pool_two_pixels(layers, output_stride):
    """min_input_size against the maps the backbone's average pools receive (forward
    pre-hooks on the 2x2 pools of the vd shortcuts): at the smallest side each gets at least
    2 pixels a side, at one pixel less one gets a single pixel, which OpenVINO cannot pool
    (tests/test_segmenter.py). The backbone runs whole whatever backbone_indices takes."""
    from paddleseg.models.backbones.resnet_vd import ResNet_vd
    backbone = ResNet_vd(layers=layers, output_stride=output_stride)
    model = PSANet(19, backbone, backbone_indices=(0, 1), mask_h=5, mask_w=5, psa_channels=8)
    smallest = model.min_input_size()
    pooled = []
    for layer in backbone.sublayers():
        if isinstance(layer, paddle.nn.AvgPool2D):
            layer.register_forward_pre_hook(
                lambda layer, inputs: pooled.append(min(inputs[0].shape[-2:])))
    backbone.eval()
    with paddle.no_grad():
        for height, width, least in ((smallest, smallest + 7, 2), (smallest - 1, 40, 1),
                                     (40, smallest - 1, 1)):
            pooled.clear()
            backbone(paddle.zeros([1, 3, height, width]))
            assert pooled and min(pooled) == least, (height, width, pooled)
    assert smallest == {8: 5, 16: 9, 32: 17}[output_stride]


def test_another_backbone_has_no_feature_stride_and_no_memory_plan():
    class FourOutputs(paddle.nn.Layer):
        feat_channels = [4, 8, 8, 16]

    model = PSANet(3, FourOutputs(), mask_h=5, mask_w=5, psa_channels=8)
    assert model.feature_stride is None and model.attention_memory(64, 64) is None
    assert model.min_input_size() is None


@pytest.mark.parametrize('psa_type,use_psa', [(0, True), (1, True), (2, True), (2, False)])
def test_no_bias_before_batch_norm_nor_on_the_attention(psa_type, use_psa):
    """As the reproduction, semseg and mmsegmentation, whose checkpoints have none."""
    model = PSANet(19, small_backbone(), psa_type=psa_type, use_psa=use_psa, mask_h=5,
                   mask_w=7, psa_channels=16)
    conv_bn = [layer._conv for layer in model.head.sublayers()
               if isinstance(layer, layers.ConvBNReLU)]
    attention = [branch.attention[1] for branch in getattr(model.head, 'branches', [])]
    # reduce and attention.0 per branch; project, bottleneck, auxlayer
    assert len(conv_bn) == (2 * len(attention) + 3 if use_psa else 2)
    assert [conv.bias for conv in conv_bn + attention] == [None] * len(conv_bn + attention)
    biased = sorted(name for name, _ in model.head.named_parameters()
                    if name.endswith('bias') and '_batch_norm' not in name)
    assert biased == ['auxlayer.conv.bias', 'classifier.bias']


def test_parameters_fixed_and_all_receive_gradients():
    paddle.seed(2)
    model = PSANet(5, small_backbone(), mask_h=5, mask_w=7, psa_channels=16)
    model.train()
    before = [(p.name, tuple(p.shape)) for p in model.parameters()]
    logits = model(paddle.randn([2, 3, 64, 64]))
    after = [(p.name, tuple(p.shape)) for p in model.parameters()]
    assert before == after  # nothing is created in forward
    loss = sum(paddle.nn.functional.cross_entropy(
        logit, paddle.randint(0, 5, [2, 1, 64, 64]), axis=1) for logit in logits)
    loss.backward()
    missing = [p.name for p in model.parameters()
               if not p.stop_gradient and (p.grad is None or float(p.grad.abs().sum()) == 0)]
    assert missing == []


def test_few_steps_lower_the_loss():
    paddle.seed(3)
    np.random.seed(3)
    model = PSANet(3, small_backbone(), mask_h=5, mask_w=7, psa_channels=16)
    model.train()
    opt = paddle.optimizer.Momentum(0.01, momentum=0.9, parameters=model.parameters())
    x = paddle.randn([2, 3, 48, 48])
    # Three horizontal bands: learnable from position alone.
    bands = np.broadcast_to((np.arange(48) * 3 // 48)[None, None, :, None], (2, 1, 48, 48))
    label = paddle.to_tensor(bands.astype('int64'))
    losses = []
    for _ in range(6):
        logits = model(x)
        loss = sum(c * paddle.nn.functional.cross_entropy(lg, label, axis=1)
                   for c, lg in zip([1, 0.4], logits))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses


def test_weights_with_the_old_conv_biases_are_named_as_such(tmp_path):
    # Weights saved before the convs lost their biases: every tensor of the model plus a
    # bias next to some conv weights. Built here from the model's own state_dict.
    from psanet.core.weights import load_model_weights
    from psanet.errors import CheckpointError
    _, model = build_config_model(seed=0)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    convs = [k for k in state if k.endswith('_conv.weight')]
    assert convs
    for key in convs[:3]:
        state[key[:-len('weight')] + 'bias'] = np.zeros(state[key].shape[0], 'float32')
    path = str(tmp_path / 'old.pdparams')
    paddle.save(state, path)
    with pytest.raises(CheckpointError, match='3 convolution biases that PSANet no longer has'):
        load_model_weights(model, path)
    # Anything else that does not fit keeps the general message.
    del state[convs[0]]
    paddle.save(state, path)
    with pytest.raises(CheckpointError, match='do not fit PSANet built from the config'):
        load_model_weights(model, path)
