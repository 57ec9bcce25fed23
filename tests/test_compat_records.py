"""psanet.compat's records: each names places and a test that exist, and every upstream name
with a leading underscore that the project's code uses is in one (read from the code's AST)."""
import ast
import glob
import importlib
import inspect
import os
import re
import types

import pytest

from conftest import ROOT
from psanet import compat
from psanet.compat.workarounds import NO_PUBLIC_API, NONE_FILED

# The project's code that may touch upstream names; tests/ probes them on purpose.
SCANNED = ['psanet/**/*.py', '*.py', 'deploy/**/*.py', 'tools/**/*.py', 'bench/**/*.py',
           'test_tipc/**/*.py']
# Documented names of the standard library that start with an underscore.
STANDARD = {'_exit': 'os._exit', '_asdict': "namedtuple's _asdict"}
RECORDS_FILE = os.path.join('psanet', 'compat', 'workarounds.py')


def _private(name):
    return name.startswith('_') and not name.endswith('__')


def _scanned_files():
    found = set()
    for pattern in SCANNED:
        found.update(glob.glob(os.path.join(ROOT, pattern), recursive=True))
    return sorted(found)


def _names_ours_and_used(tree, path):
    """(our private attribute names, [(upstream-looking private name, 'path:line')]) of a module:
    ours are what its classes define (methods, class attributes) and ``self._x = ...`` /
    ``cls._x = ...`` assign; used are attribute reads and writes, ``getattr``-like calls with a
    literal name, and names imported from other packages."""
    ours, used = set(), []
    where = os.path.relpath(path, ROOT)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    ours.add(statement.name)
                targets = (statement.targets if isinstance(statement, ast.Assign) else
                           [statement.target] if isinstance(statement, ast.AnnAssign) else [])
                ours.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Attribute):
            if isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and \
                    node.value.id in ('self', 'cls'):
                ours.add(node.attr)
            else:
                used.append((node.attr, f'{where}:{node.lineno}'))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ('getattr', 'hasattr', 'setattr', 'delattr') and \
                len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and \
                isinstance(node.args[1].value, str):
            used.append((node.args[1].value, f'{where}:{node.lineno}'))
        elif isinstance(node, ast.ImportFrom) and not node.level and \
                not node.module.startswith('psanet'):
            names = node.module.split('.') + [alias.name for alias in node.names]
            used.extend((name, f'{where}:{node.lineno}') for name in names)
        elif isinstance(node, ast.Import):
            used.extend((part, f'{where}:{node.lineno}') for alias in node.names
                        for part in alias.name.split('.'))
    return ours, [(name, at) for name, at in used if _private(name)]


def unrecorded_private_names(files, records):
    """'name (path:line)' of each private name ``files`` use that is neither theirs, nor the
    standard library's, nor in a record's ``private``."""
    ours, used = set(), []
    for path in files:
        with open(path, encoding='utf-8') as f:
            mine, theirs = _names_ours_and_used(ast.parse(f.read(), path), path)
        ours |= mine
        used += theirs
    recorded = {part for record in records for name in record.private
                for part in name.split('.') if _private(part)}
    return sorted(f'{name} ({at})' for name, at in used
                  if name not in ours | set(STANDARD) | recorded)


def test_every_private_upstream_name_the_code_uses_is_recorded():
    assert not unrecorded_private_names(_scanned_files(), compat.WORKAROUNDS), \
        'record each in psanet/compat/workarounds.py (its private field)'


def test_the_scan_finds_a_private_name_that_no_record_holds(tmp_path):
    """The scan itself: an upstream private read, a getattr of one, a private import; an
    attribute of our own class and a documented one of the standard library pass."""
    code = tmp_path / 'module.py'
    code.write_text('import os\n'
                    'from paddle.base.framework import _dygraph_tracer\n'
                    'class Ours:\n'
                    '    def __init__(self, optimizer):\n'
                    '        self._mine = optimizer._learning_rate\n'
                    '        getattr(optimizer, "_grad_clip")\n'
                    '        self._mine.x = os._exit\n')
    found = unrecorded_private_names([str(code)], [])
    assert [name.split(' ')[0] for name in found] == \
        ['_dygraph_tracer', '_grad_clip', '_learning_rate'], found
    assert unrecorded_private_names([str(code)], [compat.AMP_STATE_API,
                                                  compat.OPTIMIZER_SCHEDULER]) == \
        [f'_grad_clip ({os.path.relpath(code, ROOT)}:6)']


def test_every_recorded_private_name_is_used():
    """A record of a name the code no longer uses is stale."""
    text = ''
    for path in _scanned_files():
        if os.path.relpath(path, ROOT) != RECORDS_FILE:
            with open(path, encoding='utf-8') as f:
                text += f.read()
    unused = [f'{record.name}: {name}' for record in compat.WORKAROUNDS
              for name in record.private
              if not re.search(r'\b%s\b' % re.escape(name.rsplit('.', 1)[1]), text)]
    assert not unused


def _resolve(qualified):
    """The object a qualified name holds, or the class whose instances its last part is
    assigned on (``self._x = ...`` in the source of the class or of a base)."""
    parts = qualified.split('.')
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module('.'.join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:-1]:
            owner = getattr(owner, part)
        if hasattr(owner, parts[-1]):
            return getattr(owner, parts[-1])
        assert isinstance(owner, type), qualified
        assigned = re.compile(r'self\.%s\s*=' % re.escape(parts[-1]))
        for base in owner.__mro__:
            try:
                if assigned.search(inspect.getsource(base)):
                    return base
            except (OSError, TypeError):  # a class without Python source
                continue
        raise AttributeError(qualified)
    raise ImportError(qualified)


@pytest.mark.parametrize('record', [r for r in compat.WORKAROUNDS if r.private],
                         ids=lambda record: record.name)
def test_the_private_names_the_records_use_are_still_there(record):
    """Fails once the installed Paddle or paddleseg renames one (where the record is needed)."""
    if not record.needed():
        pytest.skip(f'{record.name} is not needed on this Paddle')
    for name in record.private:
        _resolve(name)


def test_every_record_is_a_constant_of_compat_under_its_name():
    names = [record.name for record in compat.WORKAROUNDS]
    assert len(names) == len(set(names))
    for record in compat.WORKAROUNDS:
        assert getattr(compat, record.name) is record and record.name in compat.__all__
    # ... and every record of the module is in the registry.
    from psanet.compat import workarounds
    assert {name for name, value in vars(workarounds).items()
            if isinstance(value, compat.Workaround)} == set(names)


def test_all_names_every_public_name_of_compat():
    public = {name for name, value in vars(compat).items()
              if not name.startswith('_') and not isinstance(value, types.ModuleType)}
    assert sorted(compat.__all__) == sorted(public)


@pytest.mark.parametrize('record', compat.WORKAROUNDS, ids=lambda record: record.name)
def test_each_record_names_places_issue_and_test_that_exist(record):
    assert record.what and record.versions
    assert re.fullmatch(r'https://github\.com/PaddlePaddle/\w+/issues/\d+', record.issue) or \
        record.issue in (NONE_FILED, NO_PUBLIC_API), record.issue
    assert record.where
    for place in record.where:
        path, _, name = place.partition(':')
        with open(os.path.join(ROOT, path), encoding='utf-8') as f:
            assert not name or re.search(r'\b%s\b' % re.escape(name), f.read()), place
    if record.first is not None:
        assert record.test, 'a gated record needs the test that says when it is unneeded'
    if record.test:
        path, name = record.test.split('::')
        with open(os.path.join(ROOT, path), encoding='utf-8') as f:
            assert re.search(r'^def %s\(' % name, f.read(), re.M), record.test
    assert all(isinstance(needed, bool) for _, needed in record.measured)
