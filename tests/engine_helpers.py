"""Tiny fixtures for the engine tests: a toy dataset, a two-layer model, and configs for them.

The toy dataset paints each image in bands of a few flat colours, one colour
per class, with a ring of ignore (255) pixels, so a two-layer network learns
it in a few dozen iterations on a CPU.
"""
import os

import cv2
import numpy as np
import paddle.nn as nn
import paddle.nn.functional as F
import yaml
import paddle
from paddleseg.cvlibs import Config, SegBuilder, manager
from paddleseg.models import layers

import psanet.models  # noqa: F401  (compat fixes, PSANet registration)
from conftest import MINI_CONFIG


def build_config_model(path=MINI_CONFIG, seed=None):
    """(cfg, model) built from a YAML through paddleseg's Config/SegBuilder, without
    pretrained weights (no network in tests); ``seed`` fixes the initial weights."""
    cfg = Config(path)
    cfg.dic['model']['pretrained'] = None
    cfg.dic['model']['backbone']['pretrained'] = None
    if seed is not None:
        paddle.seed(seed)
    return cfg, SegBuilder(cfg).model


def mini_psanet_for_eval(seed):
    """The mini config's PSANet with seeded weights, in eval mode."""
    _, model = build_config_model(seed=seed)
    model.eval()
    return model


def dygraph_logits(model, path):
    """The model's [C, H, W] logits of an image file, with the val Normalize written out
    in numpy."""
    rgb = cv2.imread(str(path))[:, :, ::-1].astype('float32')
    x = ((rgb / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None]
    with paddle.no_grad():
        return model(paddle.to_tensor(np.ascontiguousarray(x)))[0].numpy()[0]


def assert_saved_masks_agree(out, image_paths, model, rtol):
    """Each image's pseudo_color_prediction PNG under ``out`` holds the classes of the
    model's dygraph logits (near-ties may flip: another backend or batch adds sums in
    another order)."""
    from PIL import Image
    from conftest import assert_logits_agree
    for path in image_paths:
        name = os.path.splitext(os.path.basename(path))[0] + '.png'
        with Image.open(os.path.join(str(out), 'pseudo_color_prediction', name)) as mask:
            assert_logits_agree(np.asarray(mask), dygraph_logits(model, path), rtol, path,
                                class_axis=0)


# The format of each output extension, as PIL names it.
IMAGE_FORMATS = {'.png': 'PNG', '.jpg': 'JPEG', '.jpeg': 'JPEG', '.bmp': 'BMP'}


def read_prediction_files(pseudo, added, image_path):
    """The class ids of one image's two outputs, read back by PIL (not the OpenCV that wrote
    them), after checking them: the pseudo-colour file is a palette PNG whatever the image's
    extension (class ids stay exact); the overlay is in the format of its name's extension,
    and is the image blended 0.6 / 0.4 with the class colours (numpy here), to within
    rounding where the format is lossless and within JPEG's loss for a .jpg."""
    from PIL import Image
    with Image.open(pseudo) as mask:
        assert (mask.format, mask.mode) == ('PNG', 'P'), (pseudo, mask.format, mask.mode)
        label = np.asarray(mask)
        palette = np.asarray(mask.getpalette()[:768], np.float64).reshape(-1, 3)
    extension = os.path.splitext(str(added))[1].lower()
    with Image.open(added) as overlay:
        assert overlay.format == IMAGE_FORMATS[extension], (added, overlay.format)
        got = np.asarray(overlay.convert('RGB'), np.float64)
    rgb = cv2.imread(str(image_path))[:, :, ::-1].astype(np.float64)
    difference = np.abs(got - (0.6 * rgb + 0.4 * palette[label]))
    if IMAGE_FORMATS[extension] == 'JPEG':
        assert difference.mean() < 8, (added, difference.mean())
    else:
        assert difference.max() <= 1, (added, difference.max())
    return label


# BGR colours of the toy classes (and of class ids beyond, for bad-label tests).
TOY_COLORS = np.array([[40, 40, 200], [40, 200, 40], [200, 40, 40], [200, 200, 40]], np.uint8)


class TinySegNet(nn.Layer):
    """Two ConvBNReLU layers and a 1x1 classifier; an auxiliary logit while training.

    Args:
        num_classes (int): number of classes.
        in_channels (int, optional): Default: 3.
        channels (int, optional): Default: 8.
        enable_auxiliary_loss (bool, optional): Default: True.
        dropout (float, optional): Dropout2D before the classifier. Default: 0.1.
    """

    def __init__(self, num_classes, in_channels=3, channels=8, enable_auxiliary_loss=True,
                 dropout=0.1):
        super().__init__()
        self.num_classes = num_classes
        self.stem = layers.ConvBNReLU(in_channels, channels, 3, stride=2, padding=1)
        self.body = layers.ConvBNReLU(channels, channels, 3, padding=1)
        self.dropout = nn.Dropout2D(dropout)
        self.classifier = nn.Conv2D(channels, num_classes, 1)
        self.aux = nn.Conv2D(channels, num_classes, 1) if enable_auxiliary_loss else None

    def forward(self, x):
        stem = self.stem(x)
        logits = [self.classifier(self.dropout(self.body(stem)))]
        if self.training and self.aux is not None:
            logits.append(self.aux(stem))
        return [F.interpolate(l, x.shape[2:], mode='bilinear') for l in logits]


if 'TinySegNet' not in manager.MODELS.components_dict:
    manager.MODELS.add_component(TinySegNet)


def toy_sample(rng, size=(64, 32), num_classes=3):
    """(BGR image, label) with vertical bands of random classes and an ignore border."""
    width, height = size
    cuts = np.sort(rng.choice(np.arange(8, width - 8), size=2, replace=False))
    classes = rng.integers(0, num_classes, size=3)
    label = np.zeros((height, width), np.uint8)
    label[:, :cuts[0]] = classes[0]
    label[:, cuts[0]:cuts[1]] = classes[1]
    label[:, cuts[1]:] = classes[2]
    image = TOY_COLORS[label].astype(np.int16)
    image += rng.integers(-10, 11, size=image.shape).astype(np.int16)
    label[0, :] = 255
    label[-1, :] = 255
    return np.clip(image, 0, 255).astype(np.uint8), label


def write_toy_dataset(root, num_train=4, num_val=4, size=(64, 32), num_classes=3, seed=0,
                      val_is_train=False):
    """Writes images/, labels/, train.txt and val.txt under ``root``; returns root.

    With ``val_is_train`` val.txt lists the training images (for overfitting checks).
    """
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, 'images'), exist_ok=True)
    os.makedirs(os.path.join(root, 'labels'), exist_ok=True)
    lines = {'train': [], 'val': []}
    for split, count in (('train', num_train), ('val', num_val)):
        for i in range(count):
            image, label = toy_sample(rng, size, num_classes)
            name = f'{split}_{i:03d}'
            cv2.imwrite(os.path.join(root, 'images', name + '.jpg'), image,
                        [cv2.IMWRITE_JPEG_QUALITY, 100])
            cv2.imwrite(os.path.join(root, 'labels', name + '.png'), label)
            lines[split].append(f'images/{name}.jpg labels/{name}.png')
    if val_is_train:
        lines['val'] = list(lines['train'])
    for split, entries in lines.items():
        with open(os.path.join(root, f'{split}.txt'), 'w') as f:
            f.write('\n'.join(entries) + '\n')
    return root


def toy_config(root, iters=20, batch_size=2, num_classes=3, learning_rate=0.1, aux=True,
               dataset_type='Dataset', model=None, train_transforms=None):
    """A config dict for the toy dataset (or a Cityscapes folder with dataset_type='Cityscapes')."""
    if train_transforms is None:
        train_transforms = [{'type': 'RandomHorizontalFlip'}, {'type': 'Normalize'}]

    def dataset(mode, transforms):
        cfg = {'type': dataset_type, 'dataset_root': root, 'transforms': transforms, 'mode': mode}
        if dataset_type == 'Dataset':
            cfg['num_classes'] = num_classes
            cfg[f'{mode}_path'] = os.path.join(root, f'{mode}.txt')
        return cfg

    return {
        'batch_size': batch_size,
        'iters': iters,
        'train_dataset': dataset('train', train_transforms),
        'val_dataset': dataset('val', [{'type': 'Normalize'}]),
        'model': model or {'type': 'TinySegNet', 'num_classes': num_classes,
                           'enable_auxiliary_loss': aux},
        'optimizer': {'type': 'Momentum', 'momentum': 0.9, 'weight_decay': 1.0e-4},
        'lr_scheduler': {'type': 'PolynomialDecay', 'learning_rate': learning_rate,
                         'end_lr': 0.0, 'power': 0.9},
        'loss': {'types': [{'type': 'CrossEntropyLoss'}] * (2 if aux else 1),
                 'coef': [1, 0.4] if aux else [1]},
    }


def window_starts(size, window, step):
    """Offsets of sliding windows along one axis: every ``step``, the last flush with the end."""
    if size <= window:
        return [0]
    starts = list(range(0, size - window + 1, step))
    return starts + ([size - window] if starts[-1] + window < size else [])


def slide_reference(predict, image, crop, stride):
    """Sliding-window output by a plain loop, each pixel the mean of the windows covering it.

    Args:
        predict (callable): numpy [N, C, h, w] window -> numpy [N, K, h, w].
        image (np.ndarray): [N, C, H, W].
        crop (tuple): (w, h) of a window.
        stride (tuple): (w, h) between windows.

    Returns:
        np.ndarray: float64 [N, K, H, W].
    """
    height, width = image.shape[-2:]
    total, count = None, np.zeros((height, width))
    for y in window_starts(height, crop[1], stride[1]):
        for x in window_starts(width, crop[0], stride[0]):
            out = np.asarray(predict(np.ascontiguousarray(image[..., y:y + crop[1],
                                                                 x:x + crop[0]])), np.float64)
            if total is None:
                total = np.zeros(out.shape[:2] + (height, width))
            total[..., y:y + crop[1], x:x + crop[0]] += out
            count[y:y + crop[1], x:x + crop[0]] += 1
    return total / count


def write_config(path, config):
    """Writes a config dict as YAML and returns the path."""
    with open(path, 'w') as f:
        yaml.safe_dump(config, f)
    return str(path)


def train_in_folder(model, dataset, optimizer, losses, options, val_dataset=None):
    """``train()`` in the RunFolder of ``options``, opened as train_from_config opens it."""
    from psanet.core.run_folder import RunFolder
    from psanet.core.train import train
    with RunFolder(options) as folder:
        return train(model, dataset, optimizer, losses, folder, val_dataset)
