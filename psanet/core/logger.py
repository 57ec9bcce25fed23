"""The engine's logger: rank 0 prints to stdout and a log file; other ranks stay silent."""
import logging
import os
import sys

from psanet.core import dist

__all__ = ['get_logger', 'LOGGER_NAME']

LOGGER_NAME = 'psanet'


def get_logger(log_file=None):
    """Returns the 'psanet' logger, (re)configured for this run.

    Args:
        log_file (str, optional): also append rank 0's lines to this file, e.g.
            ``<save_dir>/train.log``. Default: None.

    Returns:
        logging.Logger: INFO level on rank 0, silent on other ranks.
    """
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = False
    if not dist.is_main_process():
        logger.addHandler(logging.NullHandler())
        logger.setLevel(logging.CRITICAL + 1)
        return logger
    logger.setLevel(logging.INFO)
    formatter = logging.Formatter('%(asctime)s [%(levelname)s]\t%(message)s', '%Y-%m-%d %H:%M:%S')
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(formatter)
    logger.addHandler(stream)
    if log_file:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
    return logger
