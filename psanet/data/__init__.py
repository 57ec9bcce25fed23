"""Data tools: mini Cityscapes generator, real Cityscapes preparation, dataset checks.

These modules use no Paddle (numpy, OpenCV, PIL and cityscapesscripts only) and
of ours import only :mod:`psanet.errors`. Their errors are
:class:`psanet.errors.DatasetError`.
"""
from .mini_cityscapes import generate as generate_mini_cityscapes
from .prepare_cityscapes import (label_ids_to_train_ids, prepare_cityscapes,
                                 train_ids_to_label_ids)
from .validate import check_dataset_config, check_dataset_root, validate_dataset

__all__ = ['generate_mini_cityscapes', 'prepare_cityscapes', 'label_ids_to_train_ids',
           'train_ids_to_label_ids', 'check_dataset_root', 'check_dataset_config',
           'validate_dataset']
