"""The 'psanet' logger: fetched without side effects, configured once per command.

A command line (:func:`psanet.cli.run_cli`) and training configure it: rank 0 prints INFO
lines to stdout, other ranks stay silent; training adds its ``train.log`` with
:func:`log_file`. This module imports nothing of ours.
"""
import contextlib
import logging
import os
import sys
import tempfile
import time

__all__ = ['LOGGER_NAME', 'get_logger', 'setup_logging', 'log_file', 'line_cut', 'ProgressBar',
           'without_stderr_lines']

LOGGER_NAME = 'psanet'
_FORMATTER = logging.Formatter('%(asctime)s [%(levelname)s]\t%(message)s', '%Y-%m-%d %H:%M:%S')
_SILENT = logging.CRITICAL + 1


def get_logger():
    """The 'psanet' logger, as whoever configured it left it (never changed here)."""
    return logging.getLogger(LOGGER_NAME)


class _StdoutHandler(logging.StreamHandler):
    """Writes to ``sys.stdout`` as it is at each line, so a replaced stdout still gets them.

    (As ``logging.lastResort`` does for stderr.)
    """

    def __init__(self):
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass

    def emit(self, record):
        global _line_cut
        _line_cut = True
        super().emit(record)
        _line_cut = False


# True while a line is being printed, and after one was cut short (by Ctrl-C).
_line_cut = False


def line_cut():
    """Whether the last line printed to stdout was cut short: whoever prints next starts a
    new line first."""
    return _line_cut


# What setup_logging adds and replaces; log_file's handlers are its own to remove.
_CONSOLE_HANDLERS = (_StdoutHandler, logging.NullHandler)


def setup_logging(main_process=None):
    """Sets where the 'psanet' logger prints, replacing what an earlier call set, and returns
    it: ``main_process`` True prints INFO lines to stdout, False silences it; None: rank 0 of
    ``paddle.distributed`` prints. The files of open :func:`log_file` blocks keep their lines."""
    if main_process is None:
        import paddle.distributed
        main_process = paddle.distributed.get_rank() == 0
    logger = get_logger()
    for handler in [h for h in logger.handlers if isinstance(h, _CONSOLE_HANDLERS)]:
        logger.removeHandler(handler)
    logger.propagate = False
    if not main_process:
        logger.addHandler(logging.NullHandler())
        logger.setLevel(_SILENT)
        return logger
    logger.setLevel(logging.INFO)
    handler = _StdoutHandler()
    handler.setFormatter(_FORMATTER)
    logger.addHandler(handler)
    return logger


@contextlib.contextmanager
def log_file(path, main_process=True):
    """Within the block the 'psanet' logger's lines also go to ``path`` (appended; its folder made).

    Nothing is written on a process other than the main one or when :func:`setup_logging`
    silenced the logger. A logger no one configured logs INFO lines for the block. A second
    block for the same file adds nothing (each line is written once).
    """
    logger = get_logger()
    path = os.path.abspath(path)
    if (not main_process or logger.level == _SILENT or
            any(getattr(h, 'baseFilename', None) == path for h in logger.handlers)):
        yield
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(_FORMATTER)
    unconfigured = logger.level == logging.NOTSET
    if unconfigured:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        if unconfigured:
            logger.setLevel(logging.NOTSET)


class ProgressBar:
    """A one-line progress bar on stderr in paddleseg's ``Progbar`` form (``3/10 [=====>...]
    - ETA: 2s``), for the code that must not import paddleseg (the deploy package, weight
    downloads). ``label`` shows a count (e.g. in MiB); ``unit`` names it in the closing rate."""

    def __init__(self, total, unit='step', label=str, interval=0.2):
        self.total, self.unit, self.label, self.interval = int(total), unit, label, interval
        self._start = self._drawn = time.time()
        self._done = 0

    def update(self, done):
        """Redraws the bar at ``done`` (at most every ``interval`` seconds, and at the end)."""
        self._done = int(done)
        now = time.time()
        finished = self._done >= self.total
        if now - self._drawn < self.interval and not finished:
            return
        self._drawn = now
        filled = int(30 * min(self._done, self.total) / max(self.total, 1))
        bar = '=' * max(filled - 1, 0) + ('=' if finished else '>' if filled else '')
        line = f'{self.label(self._done)}/{self.label(self.total)} [{bar.ljust(30, ".")}]'
        elapsed = now - self._start
        if finished:
            rate = elapsed / max(self._done, 1)
            rate = f'{rate:.0f}s' if rate >= 1 else f'{rate * 1e3:.0f}ms'
            line += f' - {elapsed:.0f}s {rate}/{self.unit}\n'
        else:
            eta = elapsed / self._done * (self.total - self._done) if self._done else 0
            line += f' - ETA: {eta:.0f}s'
        sys.stderr.write('\r' + line)
        sys.stderr.flush()

    def close(self):
        """Ends a bar left half-way with a newline, so what follows starts a line of its own."""
        if self._done < self.total:
            sys.stderr.write('\n')
            sys.stderr.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def without_stderr_lines(*patterns):
    """Within the block the process's C-level stderr (file descriptor 2, where C++ libraries
    log) goes to a temporary file; after it, its lines are written back to stderr but those
    holding one of ``patterns`` (the upstream lines psanet.compat lists)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode('utf-8', 'replace').splitlines(keepends=True)
            sys.stderr.write(''.join(l for l in lines if not any(p in l for p in patterns)))
            sys.stderr.flush()
