"""Running out of memory raises ``MemoryError`` and the process lives on; a plan that can
never be held is refused before anything is allocated. Run in a child process under an
address-space limit (``RLIMIT_AS``), so the allocations really fail."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

resource = pytest.importorskip("resource")

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np
    import fastpack

    def vm_size():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024

    # Start both thread pools first (threads are address space too), then leave 1 GiB.
    fastpack.pack(np.arange(1, 300_000) % 700 + 1, 1024, threads=2)
    fastpack.pack([3, 5], 8)
    ones = np.ones(10**8, dtype=np.uint8)  # 100 MB of input, before the limit
    limit = vm_size() + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = {}

    def attempt(name, call):
        try:
            call()
            out[name] = "ok"
        except MemoryError as e:
            out[name] = "MemoryError: " + str(e)
        except fastpack.FastpackError as e:
            out[name] = "FastpackError: " + str(e)

    # 2.4e11 packs: more than a plan holds, refused before allocating.
    attempt("wrapped_1e15", lambda: fastpack.pack([10**15], 4096, strategy="wrapped"))
    # 2e8 packs of 4096: allowed, but its arrays (about 5 GB) exceed the limit.
    attempt("wrapped_2e8_packs", lambda: fastpack.pack([4096 * 2 * 10**8], 4096,
                                                       strategy="wrapped"))
    # 10^8 sequences: the input fits, the plan (20 bytes a segment) does not.
    for strategy in ("bfd", "next_fit"):
        attempt(strategy + "_1e8", lambda: fastpack.pack(ones, 4096, strategy=strategy,
                                                         threads=2))
    attempt("groups_1e8", lambda: fastpack.pack(ones, 4096, group_tokens=65536, threads=2))
    # The process is fine afterwards.
    out["after"] = fastpack.pack([3, 5, 2, 6], 8).num_packs
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.timeout(120)
def test_out_of_memory_raises_memory_error_and_the_process_lives():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                            timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["wrapped_1e15"].startswith(
        'FastpackError: lengths: strategy "wrapped" would cut 1000000000000000 tokens into '
        "244140625000 packs"), out
    for name in ("wrapped_2e8_packs", "bfd_1e8", "next_fit_1e8", "groups_1e8"):
        assert out[name].startswith("MemoryError: out of memory: could not allocate"), (name, out)
    assert out["after"] == 2
