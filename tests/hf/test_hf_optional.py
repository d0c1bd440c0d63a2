"""transformers stays optional: adaspan does not import it, and adaspan.hf without it says in
one line how to install it."""

import subprocess
import sys


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_adaspan_does_not_import_transformers():
    done = run("import sys, adaspan, adaspan.cli; print('transformers' in sys.modules)")
    assert done.stdout.strip() == "False", done.stderr


def test_adaspan_hf_without_transformers_says_how_to_install_it():
    done = run("import sys; sys.modules['transformers'] = None\n"
               "from adaspan.errors import UserError\n"
               "try:\n    import adaspan.hf\nexcept UserError as e:\n    print(e)")
    assert done.stdout == "adaspan.hf needs transformers: pip install 'adaspan[hf]'\n", done.stderr


def test_an_older_transformers_is_refused_in_one_line_naming_the_range():
    done = run("import transformers; transformers.__version__ = '4.55.4'\n"
               "from adaspan.errors import UserError\n"
               "try:\n    import adaspan.hf\nexcept UserError as e:\n    print(e)")
    assert done.stdout == ("adaspan.hf needs transformers 4.56 or newer (tested: 4.56 and "
                           "5.24), found 4.55.4: pip install 'transformers>=4.56'\n"), done.stderr


def test_no_submodule_hides_a_name_the_package_exports():
    """A submodule imported under the name of an exported function would replace it."""
    import types

    import adaspan.hf

    hidden = [n for n in adaspan.hf.__all__ if isinstance(getattr(adaspan.hf, n), types.ModuleType)]
    assert not hidden
