import subprocess
import sys

import megapipe


def test_every_public_name_resolves():
    for name in megapipe.__all__:
        assert getattr(megapipe, name) is not None, name


def test_importing_schedules_does_not_import_torch():
    code = "import sys, megapipe.schedule; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
