"""What importing the differentiable ops costs: torch, not torch's compiler.

``torch._dynamo`` takes about 2 s of CPU to import, as long as torch itself; a program (and each rank of a job) that
never compiles should not pay it.  The package reads the two pieces of it that it needs without importing it:
compiled autograd's state (``_graph.compiled_autograd``) and the mark that makes ``torch.compile`` take a function's
result as a constant (``_compiled.CONSTANT_MARK``).  These tests check that the import stays lean, and that what the
package reads is still what torch writes, so that a torch upgrade cannot silently turn either off.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from world import SIZE, singleton_env

torch = pytest.importorskip("torch")
from tensorplay_p2p.autograd import _compiled, _graph  # noqa: E402


@pytest.mark.skipif(SIZE != 1, reason="a fresh process of its own: once, in the run at world size 1")
def test_importing_the_differentiable_ops_does_not_import_torch_s_compiler() -> None:
    env = singleton_env()
    code = (
        "import sys, torch\n"
        "import tensorplay_p2p.autograd, tensorplay_p2p.torch\n"
        "print([m for m in ('torch._dynamo', 'torch._dynamo.compiled_autograd') if m in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "[]\n", (done.stdout, done.stderr)


def test_the_constant_mark_is_what_torch_s_decorator_sets() -> None:
    def probe() -> int:
        return 0

    marked = torch.compiler.assume_constant_result(probe)
    assert marked is probe and vars(probe) == {_compiled.CONSTANT_MARK: True}, vars(probe)
    assert getattr(_compiled._number_of, _compiled.CONSTANT_MARK) is True


def test_compiled_autograd_s_state_is_read_where_torch_keeps_it() -> None:
    from torch._dynamo import compiled_autograd

    assert _graph.compiled_autograd() is compiled_autograd
    assert compiled_autograd.compiled_autograd_enabled is False
    assert compiled_autograd.in_compiled_autograd_region is False
    seen = []

    def compiler(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return gm

    x = torch.ones(2, requires_grad=True)
    with compiled_autograd._enable(compiler):
        seen.append(_graph.compiled_autograd().compiled_autograd_enabled)
        (x * 2).sum().backward()
    assert seen == [True] and x.grad is not None and x.grad.tolist() == [2.0, 2.0]
