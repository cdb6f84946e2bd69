"""Peak memory of the local backends stays within the registered buffers plus 64 MiB."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import resource, sys, tempfile, os
    import numpy as np
    from datamover import Agent, DescList, aligned_empty

    kind = sys.argv[1]
    n = (192 if kind == "memcpy" else 40) << 20
    with Agent("m") as agent:
        src, dst = aligned_empty(n), aligned_empty(n)
        src[:] = 1
        dst[:] = 2
        agent.register_memory(src)
        agent.register_memory(dst)
        if kind == "posix":
            path = os.path.join(tempfile.mkdtemp(), "f.bin")
            reg = agent.register_file(path, size=n + 8192)
        bs = 4096 if kind == "memcpy" else 64 << 10
        count = (n - 8192) // bs
        perm = np.random.default_rng(0).permutation(count)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(2 if kind == "memcpy" else 1):
            if kind == "memcpy":  # both sides scattered: the gather path needs temporaries
                local = DescList.from_columns(src.ctypes.data + perm * bs, bs)
                remote = DescList.from_columns(dst.ctypes.data + np.arange(count)[::-1] * bs, bs)
                agent.transfer("WRITE", local, remote).wait()
            else:  # unaligned rows: every one goes through a bounce buffer
                local = DescList.from_columns(src.ctypes.data + 1 + np.arange(count) * bs, bs - 1)
                remote = DescList.file(reg, 7 + perm * bs, bs - 1)
                agent.transfer("WRITE", local, remote).wait()
                agent.transfer("READ", local, remote).wait()
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(grew // 1024)
    """
)


@pytest.mark.parametrize("kind", ["memcpy", "posix"])
def test_peak_memory_within_budget(kind):
    out = subprocess.run([sys.executable, "-c", SCRIPT, kind], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grew_mib = int(out.stdout.strip().splitlines()[-1])
    assert grew_mib <= 64, f"{kind} grew peak RSS by {grew_mib} MiB beyond the registered buffers"
