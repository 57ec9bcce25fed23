"""The start-of-training log line: images per step, and on several cards the config's recipe."""
import re

import pytest

from conftest import MINI_CONFIG
from psanet.core.config import load_config
from psanet.core.train_log import format_batch_size

STEP = re.compile(r'batch_size (\d+) per (card|process) x (\d+) (cards|processes) = (\d+) images '
                  r'per step')
ADVICE = re.compile(r"the config's recipe assumes (\d+) per step on one card: "
                    r'use --batch_size (\d+) for it$')


def test_one_process_line_is_unchanged():
    assert format_batch_size(8, 1) == 'batch_size 8 x 1 process(es)'
    assert format_batch_size(3, 1, recipe_batch_size=8, unit='process') == \
        'batch_size 3 x 1 process(es)'


@pytest.mark.parametrize('batch_size, world_size, recipe', [(8, 4, 8), (4, 2, 16), (3, 2, 2)])
def test_several_cards_say_the_images_per_step_and_the_batch_size_of_the_recipe(
        batch_size, world_size, recipe):
    line = format_batch_size(batch_size, world_size, recipe_batch_size=recipe)
    step = STEP.match(line)
    assert step, line
    assert [int(step.group(i)) for i in (1, 3, 5)] == [batch_size, world_size,
                                                       batch_size * world_size]
    advice = ADVICE.search(line)
    assert advice, line
    assert int(advice.group(1)) == recipe
    assert int(advice.group(2)) * world_size == recipe  # the advice gives the recipe's step


def test_several_cards_at_the_recipe_step_say_so():
    line = format_batch_size(2, 4, recipe_batch_size=8)
    assert STEP.match(line) and '8 images per step' in line
    assert "as the config's recipe (8 per step on one card)" in line and '--batch_size' not in line


def test_a_recipe_the_cards_cannot_split_gets_no_batch_size():
    line = format_batch_size(2, 3, recipe_batch_size=8, unit='process')
    assert line.startswith('batch_size 2 per process x 3 processes = 6 images per step')
    assert 'cannot split evenly' in line and '--batch_size' not in line


def test_without_a_recipe_only_the_step():
    line = format_batch_size(8, 2)
    assert STEP.fullmatch(line)


def test_recipe_is_the_config_files_batch_size(tmp_path):
    """Read with the config, once: the file's batch_size, not the one --opts sets."""
    config = tmp_path / 'recipe.yml'
    config.write_text(f'_base_: {MINI_CONFIG}\nbatch_size: 5\n')
    cfg = load_config(str(config), opts=['batch_size=3'])
    assert (cfg.recipe_batch_size, cfg.dic['batch_size']) == (5, 3)
