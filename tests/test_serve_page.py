"""The attention explorer page in a real browser (Debian's Chromium, driven by Playwright's
Python client): an image uploaded, the prediction drawn over it, two pixels clicked, and the
collect and distribute maps read back from the canvases against the maps this test computes
from its own dygraph model (capture_attention + point_maps); nothing of the figures shown before
an upload; over an export the page says it needs the model; behind a bearer token it takes the
token from its address. The explorer's store keeps exactly its capacity of images and bytes and
evicts the least recently used."""
import importlib.util
import os
import tempfile

import cv2
import numpy as np
import paddle
import pytest

from psanet import Segmenter
from conftest import MINI_CONFIG
from serve_helpers import running_server

CHROMIUM = '/usr/bin/chromium'
CHROMIUM_FLAGS = ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
                  '--disable-background-networking', '--disable-component-update',
                  '--disable-sync']
SIZE = (160, 96)  # width, height: a 10 x 6 attention map


def _browser_missing():
    if importlib.util.find_spec('playwright') is None:
        return 'playwright is not installed (pip install -r requirements-dev.txt)'
    if not os.access(CHROMIUM, os.X_OK):
        return f'no browser at {CHROMIUM} (apt-get install chromium)'
    return ''


@pytest.fixture(scope='module')
def browser():
    missing = _browser_missing()
    if missing:
        if os.environ.get('CI', '').lower() in ('1', 'true', 'yes'):
            pytest.fail(f'CI must run the explorer page test: {missing}')
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright
    with tempfile.TemporaryDirectory(prefix='psanet_chromium_') as profile, \
            sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope='module')
def image_path(tmp_path_factory):
    rng = np.random.RandomState(3)
    small = rng.randint(0, 256, (5, 7, 3)).astype('uint8')
    path = str(tmp_path_factory.mktemp('page') / 'street.png')
    cv2.imwrite(path, cv2.resize(small, SIZE, interpolation=cv2.INTER_CUBIC))
    return path


def _jet(values):
    """JET of 0..255 values, the ramp blue, cyan, yellow, red: [..., 3] RGB uint8."""
    t = values.astype(np.float64)[..., None] / 255
    centres = np.array([3.0, 2.0, 1.0])
    return np.rint(255 * np.clip(1.5 - np.abs(4 * t - centres), 0, 1)).astype(np.int64)


def _attention(image_path, weights):
    """(model, image, input, records) of this test's own forward with capture_attention."""
    from engine_helpers import build_config_model
    from psanet.visualize.attention import capture_attention
    _, model = build_config_model()
    model.set_state_dict(paddle.load(weights))
    model.eval()
    image = cv2.imread(image_path)
    rgb = image[:, :, ::-1].astype('float32')
    x = np.ascontiguousarray(((rgb / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None])
    with paddle.no_grad(), capture_attention(model) as records:
        model(paddle.to_tensor(x))
    return model, image, x, list(records)


def _expected_maps(image_path, weights, points):
    """For each point, {direction: the RGB the page should draw}, from this test's own forward
    of the dygraph model with capture_attention and the paper's column / row of point_maps."""
    from psanet.visualize.attention import MapGeometry, point_maps
    _, image, _, records = _attention(image_path, weights)
    assert [r.psa_type for r in records] == [0, 1]  # collect, then distribute
    expected = []
    for px, py in points:
        maps = {}
        for record, direction in zip(records, ('collect', 'distribute')):
            geometry = MapGeometry(image.shape[:2], image.shape[:2], (), record.feature_size,
                                   record.map_size, False)
            row, col = geometry.cell(px, py)
            column_p, row_p = point_maps(record, row, col)
            values = geometry.upsample(column_p if direction == 'collect' else row_p)
            spread = (values - values.min()) / (values.max() - values.min())
            maps[direction] = (_jet(np.rint(spread * 255)), float(values.min()),
                               float(values.max()))
        expected.append(maps)
    return expected


def _canvas_rgb(page, selector):
    data = page.evaluate('''(selector) => {
        const canvas = document.querySelector(selector);
        const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height);
        return [canvas.width, canvas.height, Array.from(pixels.data)];
    }''', selector)
    width, height, values = data
    rgba = np.array(values, np.int64).reshape(height, width, 4)
    assert (rgba[..., 3] == 255).all(), selector
    return rgba[..., :3]


def _assert_no_figures(page):
    """Before an upload: no prediction box, no maps on the page."""
    assert page.locator('#figures').bounding_box() is None
    assert not page.is_visible('#prediction') and not page.is_visible('#legend')


def _click_pixel(page, x, y):
    box = page.locator('#prediction').bounding_box()
    page.mouse.click(box['x'] + (x + 0.5) * box['width'] / SIZE[0],
                     box['y'] + (y + 0.5) * box['height'] / SIZE[1])
    page.wait_for_function(f'document.body.dataset.state === "point-shown" && '
                           f'window.explorer.point.x === {x} && window.explorer.point.y === {y}')


def test_the_page_shows_the_prediction_and_each_clicked_pixels_maps(browser, mini_model_server,
                                                                    mini_weights, image_path):
    url, _ = mini_model_server
    points = [(20, 30), (131, 75)]
    expected = _expected_maps(image_path, mini_weights, points)
    label = Segmenter.from_config(MINI_CONFIG, mini_weights, backend='dygraph')(image_path)
    page = browser.new_page()
    page.goto(f'{url}/explorer/')
    page.wait_for_function('document.body.dataset.state === "ready"')
    _assert_no_figures(page)
    page.set_input_files('#file', image_path)
    page.wait_for_function('document.body.dataset.state === "predicted"')
    palette = np.array(page.evaluate('window.explorer.model.palette'), np.int64)
    assert np.array_equal(_canvas_rgb(page, '#label'), palette[label])
    legend = page.inner_text('#legend')
    names = page.evaluate('window.explorer.model.classes.map(c => c.name)')
    for cls in np.unique(label):
        assert names[cls] in legend
    for point, maps in zip(points, expected):
        _click_pixel(page, *point)
        assert page.inner_text('#point') == f'p = ({point[0]}, {point[1]})'
        for direction, (rgb, low, high) in maps.items():
            figure = f'.map[data-direction="{direction}"]'
            drawn = _canvas_rgb(page, f'{figure} .heat')
            assert drawn.shape == rgb.shape
            difference = np.abs(drawn - rgb)
            # One 0..255 step of rounding moves a JET channel by at most 4.
            assert difference.max() <= 4 and difference.mean() < 0.2, (direction, point)
            # The scale's ends, to 2 significant digits.
            assert float(page.inner_text(f'{figure} .low')) == pytest.approx(low, rel=0.06)
            assert float(page.inner_text(f'{figure} .high')) == pytest.approx(high, rel=0.06)
            marker = page.evaluate(f'''() => {{
                const canvas = document.querySelector('{figure} .marker');
                const s = window.explorer.scale;
                return canvas.getContext('2d').getImageData(
                    Math.round(({point[0]} + 0.5) * s), Math.round(({point[1]} + 0.5) * s) - 7,
                    1, 1).data[3];
            }}''')
            assert marker > 0, 'the point is not marked'
    first, second = (expected[i]['collect'][0] for i in range(2))
    assert np.abs(first - second).mean() > 10  # the two points' maps differ: it updated
    page.close()


def test_over_an_export_the_page_says_it_needs_the_model(browser, mini_export, tmp_path):
    with running_server(['--config', mini_export, '--backend', 'paddle', '--cpu_threads', 1],
                        tmp_path / 'serve.log') as (_, url):
        page = browser.new_page()
        page.goto(f'{url}/explorer/')
        page.wait_for_function('document.body.dataset.state === "unavailable"')
        note = page.inner_text('#unavailable')
        assert 'needs the model' in note and '--model_path' in note
        assert page.is_disabled('#file')
        _assert_no_figures(page)
        page.close()


def test_behind_a_token_the_page_takes_it_from_its_address(browser, mini_weights, image_path,
                                                            tmp_path):
    token = tmp_path / 'token'
    token.write_text('page-token')
    label = Segmenter.from_config(MINI_CONFIG, mini_weights, backend='dygraph')(image_path)
    with running_server(['--config', MINI_CONFIG, '--model_path', mini_weights,
                         '--auth_token_file', token], tmp_path / 'serve.log') as (_, url):
        page = browser.new_page()
        page.goto(f'{url}/explorer/')
        page.wait_for_function('document.body.dataset.state === "unauthorized"')
        note = page.inner_text('#unavailable')
        assert 'needs its token' in note and '#token=' in note and 'no token' in note
        _assert_no_figures(page)
        page.goto(f'{url}/explorer/#token=page-token')
        page.reload()
        page.wait_for_function('document.body.dataset.state === "ready"')
        page.set_input_files('#file', image_path)
        page.wait_for_function('document.body.dataset.state === "predicted"')
        palette = np.array(page.evaluate('window.explorer.model.palette'), np.int64)
        assert np.array_equal(_canvas_rgb(page, '#label'), palette[label])
        _click_pixel(page, 20, 30)
        page.close()


@pytest.fixture(scope='module')
def attention(mini_weights, image_path):
    """``(align_corners, add, one)``: the model's align_corners; ``add(kept)`` keeps this
    test's forward in an ExploredImages and returns its id; the bytes of one image's maps."""
    model, image, x, records = _attention(image_path, mini_weights)
    label = np.zeros(image.shape[:2], np.uint8)

    def add(kept):
        return kept.add(image.shape[:2], x, ([], image.shape[:2]), records, label)['id']
    return model.align_corners, add, sum(record.attention.nbytes for record in records)


def _kept(explored, ids):
    kept = []
    for image_id in ids:
        try:
            kept.append(bool(explored.point(image_id, 0, 0)['maps']))
        except KeyError:
            kept.append(False)
    return kept


def test_the_explorer_keeps_its_maps_within_its_bytes(attention):
    from psanet.serve.explore import ExploredImages
    align_corners, add, one = attention
    kept = ExploredImages(align_corners, capacity=8, max_bytes=2 * one)
    ids = [add(kept) for _ in range(3)]
    assert _kept(kept, ids) == [False, True, True]  # the oldest went: two fit, exactly
    alone = ExploredImages(align_corners, max_bytes=one)  # one image's maps exactly at the limit
    assert _kept(alone, [add(alone)]) == [True]
    with pytest.raises(OverflowError, match='over the explorer'):
        add(ExploredImages(align_corners, max_bytes=one - 1))


def test_the_explorer_keeps_its_capacity_and_evicts_the_least_recently_used(attention):
    from psanet.serve.explore import ExploredImages
    align_corners, add, _ = attention
    kept = ExploredImages(align_corners, capacity=3)
    ids = [add(kept) for _ in range(3)]
    assert _kept(kept, ids) == [True, True, True]  # all of its capacity
    kept.point(ids[0], 1, 1)  # the first is now the most recently used
    ids.append(add(kept))
    assert _kept(kept, ids) == [True, False, True, True]  # the second went
