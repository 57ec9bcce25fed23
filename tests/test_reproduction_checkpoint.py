"""The PaddlePaddle reproduction's released checkpoint: its layout, converted, gives its logits.

The checkpoint itself is not stored; its layout is, in tests/data/ (every
name and shape, in order). These tests fill that layout with random values and
check that PSANet with the converted tensors computes what the reproduction's
head, written here from the reference README with paddle's functional ops,
computes with the tensors as they are. The backbone is paddleseg's
ResNet50_vd in both (the names are the same); the PSA mask is the numpy
reference of tests/psa_mask_reference.py.
"""
import json
import logging
import os
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddleseg.models.backbones import ResNet50_vd

import psanet.models  # noqa: F401  (registers PSANet)
from conftest import ROOT, assert_logits_agree, reordered_sum_rtol, run_process
from psa_mask_reference import reference_forward
from psanet.core.weights import load_model_weights
from psanet.errors import CheckpointError
from psanet.log import LOGGER_NAME
from psanet.models import PSANet
from psanet.models.reproduction import convert_reproduction_state, is_reproduction_state

# The layout (every tensor name and shape of the released checkpoint, no values) is
# kept with the tests, so this runs on every machine.
LAYOUT_FILE = os.path.join(ROOT, 'tests', 'data', 'reproduction_psanet_r50_layout.json')

# The released model: num_classes 19, mask 59x59, psa_type 2, shrink factor 2,
# normalization factor 1, softmax, aligned corners in the final resize False.
NUM_CLASSES, MASK, SHRINK, PSA_CHANNELS = 19, 59, 2, 512
BN_EPSILON = 1e-5  # paddleseg's SyncBatchNorm / BatchNorm2D default, in both
# 64x128 input: 8x16 features at output stride 8, shrunk to 4x8 by a non-integer
# ratio (7/3, 15/7), so the shrink is a real interpolation; quick on a CPU.
INPUT_SIZE = (64, 128)
# Both sides run the same paddle ops on the same tensors; only the order of the
# projection's sum differs (its input halves are swapped). The longest sum is
# the 3x3 bottleneck over 4096 channels.
RTOL = reordered_sum_rtol(3 * 3 * 4096)


def layout():
    with open(LAYOUT_FILE) as f:
        return [(name, tuple(shape)) for name, shape in json.load(f)['entries']]


def random_state(seed=0):
    """Every tensor of the layout, random. Convolutions are scaled by sqrt(1 / fan_in) and
    BatchNorm scales and variances drawn from [0.5, 1.5], which keep every stage's output
    and the attention logits about 1 (sqrt(2 / fan_in) grows them to 1e4, and the softmax
    over the positions then picks one: a check that would miss its axis)."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in layout():
        if name.endswith('._variance') or (name.endswith('_batch_norm.weight')):
            value = rng.uniform(0.5, 1.5, shape)
        elif len(shape) == 4:
            value = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        else:  # biases and BatchNorm means
            value = 0.1 * rng.standard_normal(shape)
        state[name] = value.astype(np.float32)
    return state


def build_psanet(psa_type=2):
    return PSANet(NUM_CLASSES, ResNet50_vd(output_stride=8), psa_type=psa_type, mask_h=MASK,
                  mask_w=MASK, psa_channels=PSA_CHANNELS, shrink_factor=SHRINK)


@pytest.fixture(scope='module')
def state():
    return random_state()


@pytest.fixture(scope='module')
def model():
    built = build_psanet()
    built.eval()
    return built


@pytest.fixture(scope='module')
def reproduction_file(tmp_path_factory, state):
    """The random state saved as the release is: paddle.save of a dict of Tensors."""
    path = str(tmp_path_factory.mktemp('reproduction') / 'model.pdparams')
    paddle.save({k: paddle.to_tensor(v) for k, v in state.items()}, path)
    return path


@pytest.fixture(scope='module')
def image():
    return paddle.to_tensor(np.random.default_rng(1).standard_normal(
        (1, 3) + INPUT_SIZE).astype(np.float32))


# ---------------------------------------------------------------------------
# The reproduction's head, from the reference notes on its checkpoint (README's
# "The reproduction's checkpoint")
# ---------------------------------------------------------------------------

def _conv_bn_relu(x, state, prefix, padding=0):
    """ConvBNReLU without a convolution bias, BatchNorm in eval mode."""
    t = {k: paddle.to_tensor(state[f'{prefix}.{k}']) for k in (
        '_conv.weight', '_batch_norm.weight', '_batch_norm.bias', '_batch_norm._mean',
        '_batch_norm._variance')}
    x = F.conv2d(x, t['_conv.weight'], padding=padding)
    x = F.batch_norm(x, t['_batch_norm._mean'], t['_batch_norm._variance'],
                     weight=t['_batch_norm.weight'], bias=t['_batch_norm.bias'],
                     training=False, epsilon=BN_EPSILON)
    return F.relu(x)


def _attention_branch(feature, state, reduce, attention, psa_type):
    """reduce, shrink to ((H-1)//s+1, (W-1)//s+1), attention, PSA mask, softmax, bmm."""
    x = _conv_bn_relu(feature, state, reduce)
    h, w = x.shape[2:]
    x = F.interpolate(x, [(h - 1) // SHRINK + 1, (w - 1) // SHRINK + 1], mode='bilinear',
                      align_corners=True)
    n, c, h, w = x.shape
    y = _conv_bn_relu(x, state, attention + '.0')
    y = F.conv2d(y, paddle.to_tensor(state[attention + '.1.weight']))  # no bias
    dense = paddle.to_tensor(reference_forward(y.numpy(), psa_type, MASK, MASK))
    dense = F.softmax(dense, axis=1)
    out = paddle.bmm(x.reshape([n, c, h * w]), dense.reshape([n, h * w, h * w]))
    return out.reshape([n, c, h, w]) / 1.0  # normalization factor 1


# The reproduction's two branches, in the order its projection reads them.
TWO_BRANCHES = (('psa.reduce_p', 'psa.attention_p', 'distribute'),
                ('psa.reduce_layer', 'psa.attention', 'collect'))


def reproduction_logits(state, image, branches=TWO_BRANCHES):
    """Eval mode: (main logits at the input size, auxiliary logits at stage 3's size,
    stage 3's output, the auxiliary head's input). ``branches``: (reduce, attention,
    psa_type) of each branch, in the projection's order; a one-branch model has its
    branch under psa.reduce_layer and psa.attention, whichever its type."""
    backbone = ResNet50_vd(output_stride=8)
    backbone.set_state_dict({k[len('backbone.'):]: v for k, v in state.items()
                             if k.startswith('backbone.')})
    backbone.eval()
    with paddle.no_grad():
        stages = backbone(image)
        feature = stages[3]
        attended = _conv_bn_relu(paddle.concat([
            _attention_branch(feature, state, reduce, attention, psa_type)
            for reduce, attention, psa_type in branches], axis=1), state, 'psa.proj')
        attended = F.interpolate(attended, feature.shape[2:], mode='bilinear',
                                 align_corners=True)
        x = _conv_bn_relu(paddle.concat([feature, attended], axis=1), state,
                          'head.conv_bn_relu', padding=1)
        logit = F.conv2d(x, paddle.to_tensor(state['head.conv.weight']),
                         bias=paddle.to_tensor(state['head.conv.bias']))
        logit = F.interpolate(logit, INPUT_SIZE, mode='bilinear', align_corners=False)
        aux = _conv_bn_relu(stages[2], state, 'aux_head.conv_bn_relu', padding=1)
        aux = F.conv2d(aux, paddle.to_tensor(state['aux_head.conv.weight']),
                       bias=paddle.to_tensor(state['aux_head.conv.bias']))
    return logit.numpy(), aux.numpy(), stages[2]


@pytest.fixture(scope='module')
def expected(state, image):
    return reproduction_logits(state, image)


def _psanet_logits(model, converted, image, stage3):
    model.set_state_dict(converted)
    with paddle.no_grad():
        main, = model(image)
        aux = model.head.auxlayer(stage3)
    return main.numpy(), aux.numpy()


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

def test_the_model_is_the_reproductions_tensor_for_tensor(model, state):
    converted = convert_reproduction_state(state, model.state_dict())
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert {k: list(v.shape) for k, v in converted.items()} == ours
    assert len(ours) == len(layout()) == 316
    assert not [k for k in ours if k.endswith('.bias') and '_batch_norm' not in k
                and not k.startswith(('head.classifier.', 'head.auxlayer.conv.'))]


def test_converted_checkpoint_gives_the_reproductions_logits(model, state, image, expected):
    want_main, want_aux, stage3 = expected
    main, aux = _psanet_logits(model, convert_reproduction_state(state, model.state_dict()),
                               image, stage3)
    assert_logits_agree(main, want_main, RTOL, what='main logits')
    assert_logits_agree(aux, want_aux, reordered_sum_rtol(3 * 3 * 1024), what='aux logits')


def test_projection_read_in_the_wrong_order_fails(model, state, image, expected):
    """The check can fail: collect and distribute swapped into the projection."""
    want_main, _, stage3 = expected
    converted = convert_reproduction_state(state, model.state_dict())
    weight = converted['head.project._conv.weight']
    half = weight.shape[1] // 2
    converted['head.project._conv.weight'] = np.concatenate(
        [weight[:, half:], weight[:, :half]], axis=1)
    main, _ = _psanet_logits(model, converted, image, stage3)
    with pytest.raises(AssertionError, match='differ by more than'):
        assert_logits_agree(main, want_main, RTOL, what='main logits')


@pytest.mark.parametrize('psa_type', ['collect', 'distribute'])
def test_a_one_branch_checkpoint_gives_the_reproductions_logits(state, image, psa_type):
    """A one-branch model keeps its branch under psa.reduce_layer / psa.attention and its
    projection reads it alone: nothing to reorder."""
    one = {k: v for k, v in state.items() if not k.startswith(('psa.reduce_p.',
                                                                 'psa.attention_p.'))}
    one['psa.proj._conv.weight'] = state['psa.proj._conv.weight'][:, :PSA_CHANNELS]
    want_main, _, stage3 = reproduction_logits(
        one, image, branches=(('psa.reduce_layer', 'psa.attention', psa_type),))
    model = build_psanet(psa_type=0 if psa_type == 'collect' else 1)
    model.eval()
    main, _ = _psanet_logits(model, convert_reproduction_state(one, model.state_dict()), image,
                             stage3)
    assert_logits_agree(main, want_main, RTOL, what=f'{psa_type} main logits')


def test_detection_by_names(model, state):
    assert is_reproduction_state(state)
    assert not is_reproduction_state(dict(model.state_dict()))
    assert not is_reproduction_state({'conv1_1._conv.weight': np.zeros(1)})  # a backbone
    assert not is_reproduction_state([1, 2])


def _fits_message(state, model):
    with pytest.raises(CheckpointError) as info:
        convert_reproduction_state(state, model.state_dict(), source='weights w.pdparams')
    return str(info.value)


def test_missing_extra_and_wrong_shape_name_the_tensor(model, state):
    missing = dict(state)
    del missing['psa.attention_p.0._batch_norm._variance']
    message = _fits_message(missing, model)
    assert message.startswith('weights w.pdparams, in the layout of the PaddlePaddle '
                              'reproduction')
    assert ('tensor psa.attention_p.0._batch_norm._variance [512] is missing (the model\'s '
            'head.branches.1.attention.0._batch_norm._variance)') in message
    assert 'more tensor' not in message

    extra = dict(state, **{'psa.extra.weight': np.zeros((2, 2), np.float32)})
    message = _fits_message(extra, model)
    assert 'tensor psa.extra.weight is not a name of the reproduction\'s layout' in message

    wrong = dict(state, **{'psa.attention.1.weight': np.zeros((225, 512, 1, 1), np.float32)})
    message = _fits_message(wrong, model)
    assert ('tensor psa.attention.1.weight has shape [225, 512, 1, 1], the model built from '
            'the config needs [3481, 512, 1, 1] (head.branches.0.attention.1.weight)') in message

    both = dict(wrong)
    del both['head.conv.bias']
    message = _fits_message(both, model)
    assert 'psa.attention.1.weight has shape' in message  # the first, in the file's order
    assert '(and 1 more tensor(s) that do not fit)' in message


def test_a_model_of_another_config_is_named(state):
    one_branch = PSANet(NUM_CLASSES, ResNet50_vd(output_stride=8), psa_type=0)
    message = _fits_message(state, one_branch)
    assert ('tensor psa.reduce_p._conv.weight [512, 2048, 1, 1] has no place in the model '
            'built from the config (it would be head.branches.1.reduce._conv.weight)') in message
    assert 'psanet_resnet50_os8_cityscapes_1024x512_80k.yml' in message


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_val_and_predict_load_the_raw_file_with_a_log_line(model, state, reproduction_file):
    logger = logging.getLogger(LOGGER_NAME)
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        assert load_model_weights(model, reproduction_file) == reproduction_file
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [line for line in handler.lines if 'reproduction' in line] == [
        f'Weights {reproduction_file} are the PaddlePaddle reproduction\'s checkpoint: '
        'converted to PSANet\'s names in memory.']
    loaded = model.state_dict()
    np.testing.assert_array_equal(loaded['head.bottleneck._conv.weight'].numpy(),
                                  state['head.conv_bn_relu._conv.weight'])
    np.testing.assert_array_equal(loaded['head.project._conv.weight'].numpy()[:, :512],
                                  state['psa.proj._conv.weight'][:, 512:])


def test_model_pretrained_takes_the_raw_file(state, reproduction_file, capsys):
    built = PSANet(NUM_CLASSES, ResNet50_vd(output_stride=8), pretrained=reproduction_file)
    assert 'is the PaddlePaddle reproduction\'s checkpoint: converted' in capsys.readouterr().out
    loaded = built.state_dict()
    np.testing.assert_array_equal(loaded['head.branches.1.attention.1.weight'].numpy(),
                                  state['psa.attention_p.1.weight'])
    np.testing.assert_array_equal(loaded['head.project._conv.weight'].numpy()[:, 512:],
                                  state['psa.proj._conv.weight'][:, :512])


def _convert_cli(src, dst):
    return run_process([sys.executable, os.path.join('tools', 'convert_checkpoint.py'),
                        '--src', src, '--dst', dst], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)


def test_converter_cli_round_trip(model, state, reproduction_file, tmp_path):
    dst = str(tmp_path / 'converted' / 'model.pdparams')
    done = _convert_cli(reproduction_file, dst)
    assert done.returncode == 0, done.stderr
    assert 'Converted 316 tensors' in done.stdout
    written = paddle.load(dst)
    expected = convert_reproduction_state(state, model.state_dict())
    assert list(written) == list(model.state_dict())
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(written[name]), value, err_msg=name)
    assert load_model_weights(model, dst) == dst  # as train.py's own files load


def test_converter_cli_names_the_tensor_and_writes_nothing(state, tmp_path):
    broken = {k: paddle.to_tensor(v) for k, v in state.items() if k != 'psa.proj._conv.weight'}
    src = str(tmp_path / 'broken.pdparams')
    paddle.save(broken, src)
    dst = str(tmp_path / 'out' / 'model.pdparams')
    done = _convert_cli(src, dst)
    assert done.returncode == 2
    assert done.stderr.startswith('error: --src ')
    assert 'tensor psa.proj._conv.weight [2048, 1024, 1, 1] is missing' in done.stderr
    assert not os.path.exists(dst)
