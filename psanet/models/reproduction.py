"""The checkpoint layout of the PaddlePaddle reproduction (justld/PSANet_paddle) -> PSANet's.

The reproduction released a PSANet R50-D8 Cityscapes model (79.94 mIoU). Its
tensors are PSANet's one for one under other names, with one difference of
order: its projection reads the two branches as ``[distribute, collect]``,
ours as ``[collect, distribute]`` (the order of ``head.branches``), so the
halves of the projection's input channels trade places.

==============================  ==============================
the reproduction                PSANet
==============================  ==============================
``backbone.*``                  ``backbone.*`` (paddleseg's ResNet*_vd)
``psa.reduce_layer.*``          ``head.branches.0.reduce.*`` (collect, or the one branch)
``psa.attention.*``             ``head.branches.0.attention.*``
``psa.reduce_p.*``              ``head.branches.1.reduce.*`` (distribute)
``psa.attention_p.*``           ``head.branches.1.attention.*``
``psa.proj.*``                  ``head.project.*`` (input channel halves swapped)
``head.conv_bn_relu.*``         ``head.bottleneck.*``
``head.conv.*``                 ``head.classifier.*``
``aux_head.*``                  ``head.auxlayer.*``
==============================  ==============================

With ``psa_type`` 0 or 1 the reproduction has one branch, under the collect
names whichever its direction, and its projection needs no swap.

This module imports numpy and the error types only.
"""
import numpy as np

from psanet.errors import CheckpointError

__all__ = ['is_reproduction_state', 'convert_reproduction_state']

# (the reproduction's prefix, ours), first match wins: 'psa.attention.' does not
# match 'psa.attention_p.*', nor 'head.conv.' 'head.conv_bn_relu.*'.
_PREFIXES = (
    ('backbone.', 'backbone.'),
    ('psa.reduce_layer.', 'head.branches.0.reduce.'),
    ('psa.attention.', 'head.branches.0.attention.'),
    ('psa.reduce_p.', 'head.branches.1.reduce.'),
    ('psa.attention_p.', 'head.branches.1.attention.'),
    ('psa.proj.', 'head.project.'),
    ('head.conv_bn_relu.', 'head.bottleneck.'),
    ('head.conv.', 'head.classifier.'),
    ('aux_head.', 'head.auxlayer.'),
)
# Names only the reproduction has: none of ours starts with them.
_MARKS = ('psa.', 'aux_head.', 'head.conv_bn_relu.', 'head.conv.')
_DISTRIBUTE_MARK = 'psa.reduce_p.'
_PROJECTION_WEIGHT = 'psa.proj._conv.weight'
# Paddle 1.x's save_dygraph bookkeeping entry, not a tensor.
_NOT_TENSORS = ('StructuredToParameterName@@', )

# The end of every message: no full stop, since the config builder appends its own sentence.
_FIX = ('the reproduction\'s release fits configs/psanet/psanet_resnet50_os8_cityscapes_'
        '1024x512_80k.yml (ResNet50_vd output_stride 8, num_classes 19, psa_type 2, mask 59x59, '
        'psa_channels 512, enable_auxiliary_loss true)')


def is_reproduction_state(state):
    """Whether a loaded .pdparams has names only the reproduction's layout has."""
    return isinstance(state, dict) and any(
        isinstance(name, str) and name.startswith(_MARKS) for name in state)


def _our_name(name):
    for theirs, ours in _PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return None


def _their_name(name):
    for theirs, ours in _PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name


def _shape(value):
    return [int(d) for d in value.shape] if hasattr(value, 'shape') else None


def _swap_projection_halves(value):
    """[distribute, collect] input channels -> [collect, distribute]."""
    weight = np.asarray(value)
    half = weight.shape[1] // 2
    return np.concatenate([weight[:, half:], weight[:, :half]], axis=1)


def convert_reproduction_state(state, model_state=None, source='the checkpoint'):
    """Renames a state_dict of the reproduction's layout to PSANet's, reordering the projection.

    With ``model_state`` (the PSANet's ``state_dict()``) every tensor must have its place there
    with the same shape, and every tensor there must come from ``state``; the result is then in
    its order. Values are ``state``'s own, except the projection weight of a two-branch model.
    A tensor that does not fit is a CheckpointError naming the first and how many more.
    """
    bidirectional = any(str(name).startswith(_DISTRIBUTE_MARK) for name in state)
    converted, problems = {}, []
    for name, value in state.items():
        if name in _NOT_TENSORS:
            continue
        ours = _our_name(name) if isinstance(name, str) else None
        shape = _shape(value)
        if ours is None:
            problems.append(f'tensor {name} is not a name of the reproduction\'s layout '
                            f'({", ".join(t + "*" for t, _ in _PREFIXES)})')
        elif model_state is not None and ours not in model_state:
            problems.append(f'tensor {name} {shape} has no place in the model built from '
                            f'the config (it would be {ours})')
        elif model_state is not None and shape != _shape(model_state[ours]):
            problems.append(f'tensor {name} has shape {shape}, the model built from the '
                            f'config needs {_shape(model_state[ours])} ({ours})')
        elif name == _PROJECTION_WEIGHT and bidirectional and (
                shape is None or len(shape) != 4 or shape[1] % 2):
            problems.append(f'tensor {name} has shape {shape}: the projection of two '
                            'branches needs [out, 2 x psa_channels, 1, 1]')
        else:
            converted[ours] = (_swap_projection_halves(value)
                               if name == _PROJECTION_WEIGHT and bidirectional else value)
    for ours, value in (model_state or {}).items():
        if ours not in converted and _their_name(ours) not in state:
            problems.append(f'tensor {_their_name(ours)} {_shape(value)} is missing (the '
                            f'model\'s {ours})')
    if problems:
        more = (f' (and {len(problems) - 1} more tensor(s) that do not fit)'
                if len(problems) > 1 else '')
        raise CheckpointError(f'{source}, in the layout of the PaddlePaddle reproduction '
                              f'(justld/PSANet_paddle), does not fit: {problems[0]}{more}; '
                              f'{_FIX}')
    if model_state is not None:
        converted = {ours: converted[ours] for ours in model_state}
    return converted
