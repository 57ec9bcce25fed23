"""The host memory an export's attention maps take, checked before an input runs.

export.py records in deploy.yaml (``attention_memory``) what the maps of an input
take: ``input_unit``, input pixels per map position along a side, and
``bytes_per_element``, the peak bytes per map element; an N x 3 x H x W input's
maps then peak at ``N * (ceil(H / unit) * ceil(W / unit))**2`` elements. The
engine's own check (``psanet.core.memory``) reads the host's memory here too.
"""
import math

from psanet.errors import DeployError

__all__ = ['ATTENTION_MEMORY', 'host_memory_available', 'format_bytes',
           'check_attention_memory']

ATTENTION_MEMORY = 'attention_memory'


def host_memory_available():
    """Bytes new allocations on the host can still take (``MemAvailable`` of /proc/meminfo),
    or None where unknown (not Linux)."""
    try:
        with open('/proc/meminfo') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def format_bytes(size):
    """'1.5 GiB', '12.0 MiB', '300 B'."""
    for unit, scale in (('GiB', 2 ** 30), ('MiB', 2 ** 20), ('KiB', 2 ** 10)):
        if size >= scale:
            return f'{size / scale:.1f} {unit}'
    return f'{int(size)} B'


def check_attention_memory(attention, shape):
    """Raises DeployError when the attention maps of an input of ``shape`` (N, 3, H, W)
    cannot fit in the host's available memory (the runtime would abort or swap), naming a
    window that fits half of it.

    Args:
        attention (tuple): ``(input_unit, bytes_per_element)`` of the export
            (``DeployConfig.attention_memory``).
        shape (tuple): the batch's shape.
    """
    unit, per_element = attention
    count, _, height, width = shape
    cells = math.ceil(height / unit) * math.ceil(width / unit)
    need = count * cells ** 2 * per_element
    available = host_memory_available()
    if available is None or need <= available:
        return
    side = math.isqrt(math.isqrt(available // 2 // per_element)) * unit
    windows = '' if side < unit else (
        ', or run it in windows: Segmenter.from_config(config, weights, backend="dygraph", '
        f'inference={{"is_slide": True, "crop_size": [{side}, {side}], "stride": '
        f'[{side * 2 // 3}, {side * 2 // 3}]}})')
    raise DeployError(f'a {width}x{height} network input{"s" * (count > 1)} (after the '
                      f'transforms{f", batch of {count}" if count > 1 else ""}) needs '
                      f'{format_bytes(need)} for the model\'s attention maps, but only '
                      f'{format_bytes(available)} of host memory is available: use smaller '
                      f'images (or a Resize in deploy.yaml\'s transforms){windows}.')
