"""psanet.log: get_logger has no side effects, setup_logging configures, log_file is scoped."""
import logging

import pytest

from psanet.log import get_logger, log_file, setup_logging


@pytest.fixture
def logger():
    """The 'psanet' logger, restored as it was after the test."""
    logger = get_logger()
    saved = list(logger.handlers), logger.level, logger.propagate
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_get_logger_changes_nothing(logger):
    setup_logging(main_process=True)
    handlers, level = list(logger.handlers), logger.level
    assert get_logger() is logger
    assert logger.handlers == handlers and logger.level == level


def test_setup_logging_prints_info_to_the_current_stdout(logger, capsys):
    setup_logging(main_process=True)
    setup_logging(main_process=True)  # again: replaces, does not add a second handler
    logger.info('hello')
    out = capsys.readouterr().out
    assert out.count('hello') == 1 and '[INFO]\thello' in out


def test_setup_logging_keeps_the_log_file(logger, tmp_path):
    path = tmp_path / 'train.log'
    with log_file(str(path)):
        setup_logging(main_process=True)  # as train() does inside train_from_config's block
        logger.info('inside')
    assert 'inside' in path.read_text()


def test_other_ranks_stay_silent_and_write_no_file(logger, capsys, tmp_path):
    setup_logging(main_process=False)
    with log_file(str(tmp_path / 'train.log')):
        logger.warning('not shown')
    assert capsys.readouterr().out == ''
    assert not (tmp_path / 'train.log').exists()


def test_log_file_holds_the_block_lines_only(logger, capsys, tmp_path):
    setup_logging(main_process=True)
    path = tmp_path / 'run' / 'train.log'
    logger.info('before')
    with log_file(str(path)):
        with log_file(str(path)):  # nested, as train_from_config around train()
            logger.info('inside')
    logger.info('after')
    text = path.read_text()
    assert text.count('inside') == 1 and 'before' not in text and 'after' not in text
    assert 'after' in capsys.readouterr().out


def test_log_file_without_setup_still_gets_info_lines(logger, tmp_path):
    logger.handlers[:] = []
    logger.setLevel(logging.NOTSET)
    with log_file(str(tmp_path / 'train.log')):
        logger.info('inside')
    assert 'inside' in (tmp_path / 'train.log').read_text()
    assert logger.level == logging.NOTSET and logger.handlers == []


def test_log_file_on_another_rank_does_nothing(logger, tmp_path):
    setup_logging(main_process=True)
    with log_file(str(tmp_path / 'train.log'), main_process=False):
        logger.info('inside')
    assert not (tmp_path / 'train.log').exists()
