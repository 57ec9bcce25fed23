"""Data tools: mini Cityscapes generator, real Cityscapes preparation, dataset checks.

These modules use no Paddle (numpy, OpenCV, PIL and cityscapesscripts only);
what they import of ours is their row of docs/design.md's layering table. A dataset
or file on disk that cannot be used is a :class:`psanet.errors.DatasetError`; a bad
argument is a ValueError (or TypeError), an output path that cannot be written an
OSError such as FileExistsError.
"""
from .mini_cityscapes import generate as generate_mini_cityscapes
from .prepare_cityscapes import (label_ids_to_train_ids, prepare_cityscapes,
                                 train_ids_to_label_ids)
from .validate import check_dataset_config, check_dataset_root, validate_dataset

__all__ = ['generate_mini_cityscapes', 'prepare_cityscapes', 'label_ids_to_train_ids',
           'train_ids_to_label_ids', 'check_dataset_root', 'check_dataset_config',
           'validate_dataset']
