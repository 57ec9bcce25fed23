"""psanet.files is the one place that renames a temporary into place: an AST scan of psanet/."""
import ast
import os

from conftest import ROOT

PACKAGE = os.path.join(ROOT, 'psanet')
RENAMES = {('os', 'replace'), ('os', 'rename'), ('os', 'renames'), ('shutil', 'move')}
# The modules that rename by hand, each with the reason it cannot use psanet.files.
RENAMING_BY_HAND = {
    'psanet/ops/build.py': 'psanet/ops imports nothing of ours (setup.py and the JIT build '
                           'load it alone): the library is linked in a hidden build folder '
                           'beside its place and renamed in',
}


def _renames(path):
    """``module.function`` of the rename calls in the file ``path``, with their line numbers."""
    with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and \
                (node.func.value.id, node.func.attr) in RENAMES:
            found.append(f'{node.func.value.id}.{node.func.attr} (line {node.lineno})')
        elif isinstance(node, ast.ImportFrom) and node.module in ('os', 'shutil') and any(
                (node.module, alias.name) in RENAMES for alias in node.names):
            found.append(f'from {node.module} import (line {node.lineno})')
    return found


def _package_files():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith('.py'):
                yield os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, '/')


def test_only_psanet_files_renames_a_temporary_into_place():
    by_hand = {path: _renames(os.path.join(ROOT, path)) for path in _package_files()
               if path != 'psanet/files.py'}
    unlisted = {path: calls for path, calls in by_hand.items()
                if calls and path not in RENAMING_BY_HAND}
    assert not unlisted, f'write through psanet.files (write_file_whole, write_folder): {unlisted}'
    # An exception that no longer renames comes off the list.
    assert all(by_hand.get(path) for path in RENAMING_BY_HAND), by_hand


def test_the_scan_sees_each_form_of_a_rename(tmp_path):
    path = tmp_path / 'writer.py'
    path.write_text('import os, shutil\nfrom os import rename\n'
                    'def f(a, b):\n    os.replace(a, b)\n    os.rename(a, b)\n'
                    '    shutil.move(a, b)\n    a.replace("x", "y")\n')
    assert _renames(str(path)) == ['from os import (line 2)', 'os.replace (line 4)',
                                   'os.rename (line 5)', 'shutil.move (line 6)']
