"""PSANet: point-wise spatial attention network, as a PaddleSeg model component.

Tensor for tensor the model of the PaddlePaddle reproduction (justld/PSANet_paddle),
which semseg and mmsegmentation share: no bias on a convolution followed by
BatchNorm nor on the attention convolution. Its released checkpoint loads
through :mod:`psanet.models.reproduction`.
"""
import dataclasses
import math
import os
from urllib.parse import urlparse

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddleseg.cvlibs import manager
from paddleseg.models import layers
from paddleseg.models.backbones.resnet_vd import ResNet_vd
from paddleseg.utils import logger, utils

from psanet.compat import autocast_dtype
from psanet.errors import ArgumentError, CheckpointError, ConfigError, is_integer
from psanet.models.reproduction import convert_reproduction_state, is_reproduction_state
from psanet.ops import (BI_DIRECTIONAL, COLLECT, DISTRIBUTE, PSA_TYPE_NAMES, PSAMask,
                        current_psa_impl, psa_mask)

__all__ = ['PSANet', 'PSAHead', 'PSABranch', 'AttentionMemory']
_ELEMENT_BYTES = {paddle.float16: 2, paddle.bfloat16: 2, paddle.float32: 4, paddle.float64: 8}


def _check_positive_int(name, value):
    if not is_integer(value, 1):
        raise ArgumentError(name, 'a positive integer', value)


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(name, 'true or false', value)


def _resnet_vd_stride(backbone, index):
    """The stride of paddleseg ResNet_vd's output ``index``, as its output_stride built it.

    ResNet_vd keeps no output_stride; the dilations it sets are what it leaves.
    The stem (a stride-2 convolution and a stride-2 max pool) takes 4; each later
    stage halves the map unless output_stride dilated it (its first block's
    dilation is then above 1). Every halving rounds up (padding 1, or the vd
    shortcut's ceil_mode pool), so the output is ceil(size / stride). None for
    another backbone.
    """
    if not isinstance(backbone, ResNet_vd):
        return None
    stages = backbone.stage_list[1:index % len(backbone.stage_list) + 1]
    return 4 * 2 ** sum(1 for stage in stages if stage[0].dilation == 1)


@dataclasses.dataclass(frozen=True)
class AttentionMemory:
    """What the attention maps of one input size take (:meth:`PSANet.attention_memory`).

    A map of ``cells = h*w`` positions has ``N * cells**2`` elements, and
    ``h = ceil(H / input_unit)``, ``w = ceil(W / input_unit)`` for an H x W input.

    Attributes:
        shapes (list): each branch's map shape [N, h*w, h, w], in the order they run.
        shape (list): the map of the branch with the largest peak.
        dtype (str): its element type ('float16' under fp16 autocast).
        map_bytes (int): its bytes.
        peak_bytes (int): the bytes alive while it is softmaxed: the map, its
            float32 copy under fp16 autocast, and the softmax.
        input_unit (int): input pixels per map position along a side: the feature
            stride times the shrink factor.
    """
    shapes: list
    shape: list
    dtype: str
    map_bytes: int
    peak_bytes: int
    input_unit: int

    @property
    def peak_bytes_per_element(self):
        """``peak_bytes`` per element of the map: the same at every input size."""
        return self.peak_bytes // math.prod(self.shape)


@manager.MODELS.add_component
class PSANet(nn.Layer):
    """The PSANet implementation based on PaddlePaddle.

    The original article refers to
    Zhao, Hengshuang, et al. "PSANet: Point-wise Spatial Attention Network for
    Scene Parsing" (https://hszhao.github.io/papers/eccv18_psanet.pdf), ECCV 2018.

    Args:
        num_classes (int): The number of target classes.
        backbone (paddle.nn.Layer): Backbone network, e.g. ResNet50_vd with output_stride 8.
        backbone_indices (tuple, optional): Indices of the backbone outputs used by the
            auxiliary head and by the PSA head. Default: (2, 3).
        psa_type (int, optional): 0 collect, 1 distribute, 2 bi-directional (both).
            Default: 2.
        mask_h (int, optional): Height of the attention window on the shrunk map. Default: 59.
        mask_w (int, optional): Width of the attention window on the shrunk map. Default: 59.
        psa_channels (int, optional): Channels of the reduced feature each PSA branch
            attends over. Default: 512.
        shrink_factor (int, optional): The feature is shrunk to ((H-1)//s+1, (W-1)//s+1)
            before attention, to bound the (H*W)^2 attention map. Default: 2.
        normalization_factor (float, optional): The aggregated feature is multiplied by
            1/normalization_factor; None means mask_h*mask_w. Default: 1.0.
        psa_softmax (bool, optional): Softmax the attention map over its H*W axis. Default: True.
        use_psa (bool, optional): False skips the PSA module (the ablation baseline). Default: True.
        compact (bool, optional): The attention predicts one channel per absolute position
            of the shrunk map instead of a window around each position; needs
            (mask_h, mask_w) equal to the shrunk map size. Default: False.
        enable_auxiliary_loss (bool, optional): Add the auxiliary FCN head on
            backbone_indices[0] while training. Default: True.
        align_corners (bool, optional): An argument of F.interpolate for the final resize.
            Default: False.
        pretrained (str, optional): Path or URL of weights of the whole model: this
            model's, loaded as paddleseg loads them, or the reproduction's release,
            converted (see :mod:`psanet.models.reproduction`). Default: None.
    """

    def __init__(self,
                 num_classes,
                 backbone,
                 backbone_indices=(2, 3),
                 psa_type=BI_DIRECTIONAL,
                 mask_h=59,
                 mask_w=59,
                 psa_channels=512,
                 shrink_factor=2,
                 normalization_factor=1.0,
                 psa_softmax=True,
                 use_psa=True,
                 compact=False,
                 enable_auxiliary_loss=True,
                 align_corners=False,
                 pretrained=None):
        super().__init__()
        _check_positive_int('num_classes', num_classes)
        num_outputs = len(backbone.feat_channels)
        if (not isinstance(backbone_indices, (list, tuple)) or len(backbone_indices) != 2 or
                not all(is_integer(i) and -num_outputs <= i < num_outputs
                        for i in backbone_indices)):
            raise ArgumentError('backbone_indices', f'2 indices (auxiliary, main) of the '
                                f'backbone\'s {num_outputs} outputs', backbone_indices)
        _check_bool('align_corners', align_corners)
        if pretrained is not None and not isinstance(pretrained, str):
            raise ArgumentError('pretrained', 'a path or URL of weights, or null', pretrained)
        self.backbone = backbone
        self.backbone_indices = tuple(backbone_indices)
        self.num_classes = num_classes
        backbone_channels = [backbone.feat_channels[i] for i in backbone_indices]
        self.head = PSAHead(num_classes, backbone_channels, psa_type, mask_h, mask_w,
                            psa_channels, shrink_factor, normalization_factor,
                            psa_softmax, use_psa, compact, enable_auxiliary_loss)
        self.align_corners = align_corners
        self.pretrained = pretrained
        # The stride of the feature the PSA head takes: the output is ceil(size / stride).
        self.feature_stride = _resnet_vd_stride(backbone, self.backbone_indices[1])
        self.init_weight()

    def forward(self, x):
        feat_list = self.backbone(x)
        feats = [feat_list[i] for i in self.backbone_indices]
        logit_list = self.head(feats)
        return [
            F.interpolate(logit, paddle.shape(x)[2:], mode='bilinear',
                          align_corners=self.align_corners) for logit in logit_list
        ]

    def attention_layers(self):
        """The PSA branches, in the order they run (collect before distribute); none without
        PSA (``use_psa: false``)."""
        return list(self.head.branches) if self.head.use_psa else []

    def attention_memory(self, height, width, batch=1):
        """Memory of the attention maps for a ``[batch, C, height, width]`` input.

        Each PSA branch builds a dense [N, h*w, h, w] map over the shrunk feature
        map (h, w), which grows with the 4th power of the input side (15.6 GB for
        one 4000x4000 image at output stride 8 and shrink factor 2). Branches run
        one after another; while a branch softmaxes its map, the map and its
        softmax are both alive: that is the peak.

        Returns:
            AttentionMemory | None: None without PSA branches, or with a backbone
            whose feature stride the model cannot tell (:attr:`feature_stride`).
        """
        branches = self.attention_layers()
        if not branches or self.feature_stride is None:
            return None
        feature_h = math.ceil(height / self.feature_stride)
        feature_w = math.ceil(width / self.feature_stride)
        shapes, worst = [], None
        for branch in branches:
            h, w = branch.map_size(feature_h, feature_w)
            shape = [int(batch), h * w, h, w]
            shapes.append(shape)
            map_dtype, map_bytes, peak = branch.attention_bytes(shape)
            if worst is None or peak > worst[3]:
                worst = (shape, map_dtype, map_bytes, peak)
        shape, map_dtype, map_bytes, peak = worst
        return AttentionMemory(shapes, shape, map_dtype, map_bytes, peak,
                               self.feature_stride * self.head.shrink_factor)

    def min_input_size(self):
        """The smallest input side the model runs on in every runtime, or None where the
        backbone's geometry is unknown (a backbone other than ResNet_vd).

        Each stride-2 stage of ResNet_vd opens with a 2x2 average pool (the vd shortcut,
        ceil_mode). Paddle and onnxruntime pool a one-pixel map; OpenVINO refuses it (its kernel
        is larger than the map) or gives no output. The last such pool sees the input at half the
        backbone's stride, so a side needs more pixels than that: 5 at output stride 8, 9 at 16,
        17 at 32.
        """
        stride = _resnet_vd_stride(self.backbone, -1)
        if stride is None:
            return None
        return stride // 2 + 1 if stride > 4 else 1

    def init_weight(self):
        if self.pretrained is None:
            return
        path = self.pretrained
        if urlparse(path).netloc:
            path = utils.download_pretrained_model(path)
        if os.path.isfile(path):
            try:
                state = paddle.load(path)
            except Exception as error:  # paddle.load raises several types for a broken file
                raise CheckpointError(f'model.pretrained {self.pretrained} cannot be read '
                                      f'({type(error).__name__}: {error}): pass a .pdparams '
                                      'file.') from error
            if is_reproduction_state(state):
                self.set_state_dict(convert_reproduction_state(
                    state, self.state_dict(), source=f'model.pretrained {self.pretrained}'))
                logger.info(f'model.pretrained {self.pretrained} is the PaddlePaddle '
                            'reproduction\'s checkpoint: converted to PSANet\'s names in memory.')
                return
        # Without the reproduction's names: paddleseg's loading, which skips what
        # does not fit with a warning each.
        utils.load_entire_model(self, path)


class PSAHead(nn.Layer):
    """The PSANet head: bi-directional point-wise spatial attention, then a classifier.

    ``backbone_channels``: the channels of the auxiliary and main backbone features; the other
    arguments are :class:`PSANet`'s (without defaults here).
    """

    def __init__(self, num_classes, backbone_channels, psa_type, mask_h, mask_w,
                 psa_channels, shrink_factor, normalization_factor, psa_softmax,
                 use_psa, compact, enable_auxiliary_loss):
        super().__init__()
        _check_positive_int('num_classes', num_classes)
        if not is_integer(psa_type) or psa_type not in PSA_TYPE_NAMES:
            names = [f'{value} ({name})' for value, name in PSA_TYPE_NAMES.items()]
            raise ArgumentError('psa_type', f'{", ".join(names[:-1])} or {names[-1]}', psa_type)
        for name, value in (('mask_h', mask_h), ('mask_w', mask_w),
                            ('psa_channels', psa_channels), ('shrink_factor', shrink_factor)):
            _check_positive_int(name, value)
        if normalization_factor is None:
            normalization_factor = float(mask_h * mask_w)
        if (not isinstance(normalization_factor, (int, float, np.integer, np.floating)) or
                isinstance(normalization_factor, (bool, np.bool_)) or
                not 0 < normalization_factor < float('inf')):
            raise ArgumentError('normalization_factor', 'a positive number, or null for '
                                'mask_h*mask_w', normalization_factor)
        for name, value in (('psa_softmax', psa_softmax), ('use_psa', use_psa),
                            ('compact', compact),
                            ('enable_auxiliary_loss', enable_auxiliary_loss)):
            _check_bool(name, value)
        in_channels = backbone_channels[1]
        self.use_psa = use_psa
        self.shrink_factor = shrink_factor
        if use_psa:
            directions = [COLLECT, DISTRIBUTE] if psa_type == BI_DIRECTIONAL else [psa_type]
            self.branches = nn.LayerList([
                PSABranch(in_channels, psa_channels, direction, mask_h, mask_w,
                          shrink_factor, normalization_factor, psa_softmax, compact)
                for direction in directions
            ])
            # 1x1 projection back to the backbone width; no padding, unlike
            # mmsegmentation's psa_head, whose padding=1 grows the map by 2.
            self.project = layers.ConvBNReLU(psa_channels * len(directions), in_channels,
                                             kernel_size=1, bias_attr=False)
            bottleneck_in = in_channels * 2
        else:
            bottleneck_in = in_channels
        self.bottleneck = layers.ConvBNReLU(bottleneck_in, 512, kernel_size=3, padding=1,
                                            bias_attr=False)
        self.dropout = nn.Dropout(p=0.1)
        self.classifier = nn.Conv2D(512, num_classes, kernel_size=1)
        self.enable_auxiliary_loss = enable_auxiliary_loss
        if enable_auxiliary_loss:
            self.auxlayer = layers.AuxLayer(backbone_channels[0], backbone_channels[0] // 4,
                                            num_classes, bias_attr=False)

    def forward(self, feats):
        aux_feat, x = feats
        if self.use_psa:
            # [collect, distribute]; the reproduction's checkpoint reads them the other
            # way round, and psanet.models.reproduction swaps its projection's halves.
            attended = paddle.concat([branch(x) for branch in self.branches], axis=1)
            attended = self.project(attended)
            if self.shrink_factor > 1:
                attended = F.interpolate(attended, paddle.shape(x)[2:], mode='bilinear',
                                         align_corners=True)
            x = paddle.concat([x, attended], axis=1)
        logit = self.classifier(self.dropout(self.bottleneck(x)))
        if self.training and self.enable_auxiliary_loss:
            return [logit, self.auxlayer(aux_feat)]
        return [logit]


class PSABranch(nn.Layer):
    """One direction of point-wise spatial attention (``psa_type`` 0 collect, 1 distribute).

    Reduces the feature to ``channels``, shrinks it to ((H-1)//s+1, (W-1)//s+1), predicts a
    mask_h x mask_w attention window per position, spreads it to a dense [H*W, H*W] map with
    the PSA mask op (or reads it directly when compact), optionally softmaxes it over the H*W
    axis, and aggregates the reduced feature with it times 1/normalization_factor. The other
    arguments are :class:`PSANet`'s.
    """

    def __init__(self, in_channels, channels, psa_type, mask_h, mask_w, shrink_factor,
                 normalization_factor, psa_softmax, compact):
        super().__init__()
        self.psa_type = psa_type
        self.shrink_factor = shrink_factor
        self.mask_h, self.mask_w = mask_h, mask_w
        self.scale = 1.0 / normalization_factor
        self.psa_softmax = psa_softmax
        self.compact = compact
        self.reduce = layers.ConvBNReLU(in_channels, channels, kernel_size=1, bias_attr=False)
        self.attention = nn.Sequential(
            layers.ConvBNReLU(channels, channels, kernel_size=1, bias_attr=False),
            nn.Conv2D(channels, mask_h * mask_w, kernel_size=1, bias_attr=False))
        self.psa_mask = None if compact else PSAMask(psa_type, (mask_h, mask_w))
        # A layer of its own, so that a forward post-hook on it sees the attention map
        # this branch aggregates with (psanet.visualize.attention); no parameters.
        self.normalize = nn.Softmax(axis=1) if psa_softmax else nn.Identity()

    def forward(self, x):
        x = self.shrink(self.reduce(x))
        return self.attend(x, self.attention(x)) * self.scale

    def attend(self, x, attention):
        """``x`` aggregated over the dense map of the ``attention`` logits (the op, the
        softmax, the product); traced for an export, as :meth:`_aggregate_exported`."""
        if self.compact:
            attention = self._compact_attention(attention)
        elif not paddle.in_dynamic_mode():
            return self._aggregate_exported(x, attention)
        else:
            attention = self.psa_mask(attention)
        return aggregate(x, self.normalize(attention))

    def _aggregate_exported(self, x, attention):
        """``aggregate(x, normalize(psa_mask(attention)))`` in the form that exports run
        fastest, with the op form ``psa_impl`` sets: a map ``M[n, p, q]`` whose last axis is
        the one the softmax runs over and the product sums, so that the softmax runs over
        contiguous rows and the product takes ``M`` transposed. Collect's map is the op's
        distribute form transposed, and distribute's its collect form transposed: the custom
        op writes either form at the same cost, so each branch asks it for the other's. The
        pure op's shear makes only distribute's form without a transpose over positions:
        with it, distribute's branch takes that form as it is, its softmax over the first
        position axis done as ``exp(Y - max)`` with the sums out of the product (a row of
        ones under the feature). onnxruntime would otherwise transpose the whole map up to
        three times, Paddle Inference softmax it over a strided axis (docs/psa_mask.md)."""
        impl = current_psa_impl(self.psa_mask.impl)
        other = self.psa_type == COLLECT or impl == 'custom'  # the other branch's form
        form = COLLECT if other and self.psa_type == DISTRIBUTE else DISTRIBUTE
        y = psa_mask(attention, form, (self.mask_h, self.mask_w), impl=impl)
        y, features = y.reshape([0, 0, -1]), x.reshape([0, 0, -1])
        if other:
            if self.psa_softmax:
                y = F.softmax(y, axis=-1)
            out = paddle.matmul(features, y, transpose_y=True)
        elif self.psa_softmax:
            y = paddle.exp(y - y.max(axis=1, keepdim=True))
            # A row of ones under the feature: the product's last row is the sums over p.
            out = paddle.bmm(paddle.concat([features, paddle.ones_like(features[:, :1])], 1), y)
            out = out[:, :-1] / out[:, -1:]
        else:
            out = paddle.bmm(features, y)
        return out.reshape(paddle.shape(x))

    def map_size(self, feature_h, feature_w):
        """(h, w) of the map attention runs on, for a (feature_h, feature_w) input (shrink)."""
        return ((feature_h - 1) // self.shrink_factor + 1,
                (feature_w - 1) // self.shrink_factor + 1)

    def attention_bytes(self, shape):
        """(dtype name, bytes of the attention map of ``shape``, peak bytes while softmaxed).

        softmax is on Paddle's fp16 black list: under autocast a half map is cast
        to a float32 copy and softmaxed into another float32 tensor, all alive at once.
        """
        dtype = autocast_dtype() or self.attention[-1].weight.dtype
        if isinstance(dtype, str):
            dtype = getattr(paddle, dtype)
        elements = math.prod(shape)
        element_bytes = _ELEMENT_BYTES.get(dtype, 4)
        map_bytes = elements * element_bytes
        peak = map_bytes
        if self.psa_softmax:
            softmax_bytes = elements * max(element_bytes, 4)
            copy_bytes = softmax_bytes if softmax_bytes > map_bytes else 0
            peak = map_bytes + copy_bytes + softmax_bytes
        return str(dtype).replace('paddle.', ''), map_bytes, peak

    def shrink(self, x):
        """Bilinear resize to ((H-1)//s+1, (W-1)//s+1) (:meth:`map_size`), corners aligned."""
        if self.shrink_factor == 1:
            return x
        size = (paddle.shape(x)[2:] - 1) // self.shrink_factor + 1
        return F.interpolate(x, size, mode='bilinear', align_corners=True)

    def _compact_attention(self, attention):
        """Channel q at position p is the weight between positions q and p."""
        h, w = attention.shape[2], attention.shape[3]
        if h is not None and w is not None and h > 0 and w > 0 and \
                (h, w) != (self.mask_h, self.mask_w):
            raise ConfigError(
                f'model.compact: true needs model.mask_h x model.mask_w equal to the shrunk '
                f'feature map of every input, but a {h}x{w} map met mask '
                f'{self.mask_h}x{self.mask_w}: set model.mask_h: {h} and model.mask_w: {w} '
                '(and feed inputs of that size: crop_size, or --is_slide for evaluation), or '
                'model.compact: false.')
        if self.psa_type == COLLECT:
            return attention  # Y[n, q, p] = channel q at p
        # Distribute: Y[n, p, q] = channel q at p, the transpose over positions.
        dense = attention.reshape([0, 0, -1]).transpose([0, 2, 1])
        return dense.reshape(paddle.shape(attention))


def aggregate(x, attention):
    """out[n, c, p] = sum_a x[n, c, a] * attention[n, a, p] over the H*W positions a."""
    features = x.reshape([0, 0, -1])
    weights = attention.reshape([0, 0, -1])
    return paddle.bmm(features, weights).reshape(paddle.shape(x))
