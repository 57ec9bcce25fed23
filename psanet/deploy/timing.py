"""Per-image stage times (preprocess, inference, postprocess) and their table."""
import time

import numpy as np

__all__ = ['StageTimer', 'format_table']


class StageTimer:
    """Collects, per batch, the seconds each stage took and the batch size.

    Use ``with timer.stage('inference'): ...`` around each stage and
    ``timer.end_batch(n)`` after the batch; times are reported per image.
    """

    def __init__(self, stages=('preprocess', 'inference', 'postprocess')):
        self.stages = tuple(stages)
        self.samples = {name: [] for name in self.stages}
        self._current = {}

    class _Stage:
        def __init__(self, timer, name):
            self.timer, self.name = timer, name

        def __enter__(self):
            self.start = time.perf_counter()

        def __exit__(self, *exc):
            elapsed = time.perf_counter() - self.start
            self.timer._current[self.name] = self.timer._current.get(self.name, 0.0) + elapsed

    def stage(self, name):
        if name not in self.samples:
            raise KeyError(f'unknown stage {name!r}; stages are {self.stages}.')
        return self._Stage(self, name)

    def end_batch(self, batch_size):
        """Records the stages timed since the last call as ``batch_size`` images."""
        for name in self.stages:
            self.samples[name].append(self._current.get(name, 0.0) / batch_size)
        self._current = {}

    def summary(self):
        """``{stage: (mean, p50, p90)}`` in ms per image, plus ``'total'``."""
        rows = {}
        per_batch = [np.asarray(self.samples[name]) * 1000.0 for name in self.stages]
        for name, values in zip(self.stages + ('total',), per_batch + [sum(per_batch)]):
            if len(values) == 0:
                rows[name] = (float('nan'),) * 3
            else:
                rows[name] = (float(np.mean(values)), float(np.percentile(values, 50)),
                              float(np.percentile(values, 90)))
        return rows


def format_table(rows, title=None):
    """A fixed-width text table of ``{name: (mean, p50, p90)}`` in ms."""
    width = max([len('stage')] + [len(name) for name in rows])
    lines = [title] if title else []
    lines.append(f'{"stage":<{width}}  {"mean ms":>9}  {"p50 ms":>9}  {"p90 ms":>9}')
    for name, (mean, p50, p90) in rows.items():
        lines.append(f'{name:<{width}}  {mean:9.2f}  {p50:9.2f}  {p90:9.2f}')
    return '\n'.join(lines)
