"""Parameter count and FLOPs of PSANet configs at a given input size.

    python bench/bench_psanet_model.py [--config ...] [--size 512 1024]

paddle.flops counts the layers it knows (convolutions, norms, ...); the PSA
aggregation is a batched matmul outside any layer, so its C*(HW)^2 multiply-adds
per branch are computed here and printed beside it. Both columns count one
multiply-add as one operation, as paddle.flops does.
The PSA mask op itself only moves memory.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import paddle  # noqa: E402
from paddleseg.cvlibs import Config, SegBuilder  # noqa: E402

import psanet.models  # noqa: E402,F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIGS = [os.path.join(ROOT, 'configs', 'psanet', name) for name in (
    'psanet_resnet50_os8_cityscapes_1024x512_80k.yml',
    'psanet_resnet101_os8_cityscapes_1024x512_80k.yml')]


def count(layer):
    return sum(int(p.numel()) for p in layer.parameters())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', nargs='+', default=DEFAULT_CONFIGS)
    parser.add_argument('--size', nargs=2, type=int, default=[512, 1024], metavar=('H', 'W'))
    args = parser.parse_args()
    h, w = args.size
    rows = []
    for path in args.config:
        cfg = Config(path)
        cfg.dic['model']['pretrained'] = None
        cfg.dic['model']['backbone']['pretrained'] = None
        model = SegBuilder(cfg).model
        model.eval()
        head = model.head
        flops = paddle.flops(model, [1, 3, h, w], print_detail=False)
        stride = 8 if cfg.dic['model']['backbone'].get('output_stride') == 8 else 32
        fh, fw = -(-h // stride), -(-w // stride)
        s = head.shrink_factor
        positions = ((fh - 1) // s + 1) * ((fw - 1) // s + 1)
        aggregation = 0
        if head.use_psa:
            for branch in head.branches:
                channels = branch.attention[-1].weight.shape[1]  # its input: the reduced map
                aggregation += channels * positions * positions
        rows.append((os.path.basename(path), count(model), count(model.backbone),
                     count(head), flops, aggregation))
    print(f'| config ({h}x{w} input) | params | backbone | head | GMACs (paddle.flops) '
          '| + PSA aggregation |')
    print('|---|---|---|---|---|---|')
    for name, total, backbone, head, flops, aggregation in rows:
        print(f'| {name} | {total / 1e6:.2f} M | {backbone / 1e6:.2f} M | {head / 1e6:.2f} M '
              f'| {flops / 1e9:.1f} | {aggregation / 1e9:.1f} |')


if __name__ == '__main__':
    main()
