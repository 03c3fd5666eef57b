"""The CPU engine's weights in one shared file (``gpu_engine.models.shared_weights``): the embedded model's greedy
tokens are the same before and after its tensors move into the mapping; a second engine maps the first one's
file instead of writing its own; a file whose bytes are not the loaded weights is not used; the mapping is
read-only (a write into a weight kills the process rather than change the other engine's model); and
``load_cpu_weights`` shares where ``BLINK_CPU_WEIGHTS_DIR`` says. The two engines of ``blink serve`` sharing
one file: ``tests/test_standby_engine.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.ring_engine import RingHarness

from gpu_engine.models.loader import default_model_path
from gpu_engine.models.shared_weights import MIN_BYTES, identity_of, share
from shared.config import EngineConfig
from shared.ring import RingGeometry

ROOT = Path(__file__).resolve().parents[1]
GEO = RingGeometry(4, 64, 48, 1)
PROMPTS = ([1, 504, 3458, 282, 4649, 314], [1, 2107, 2164, 20, 1069], [1, 378, 2165, 284, 253, 1357, 30])


def harness() -> RingHarness:
    return RingHarness(EngineConfig(ring_name="local", geometry=GEO, kv_blocks=64, max_batch=4))


def greedy(h: RingHarness) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        h.submit(i, p, 12, ignore_eos=True)
    h.run()
    return [h.result(i)[0] for i in range(len(PROMPTS))]


def model_of(h: RingHarness) -> torch.nn.Module:
    return h.backend.runner.model  # type: ignore[attr-defined]


def mapped_from(path: Path) -> int:
    """How many of this process's mappings are of ``path``."""
    return sum(line.rstrip().endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines())


def large_storages(model: torch.nn.Module) -> set[int]:
    from gpu_engine.models.shared_weights import _tensors

    return {t.untyped_storage().data_ptr() for t in _tensors(model) if t.untyped_storage().nbytes() >= MIN_BYTES}


def test_tokens_unchanged_and_a_second_engine_maps_the_first_ones_file(tmp_path: Path) -> None:
    want = greedy(harness())  # weights of its own
    first = harness()
    identity = identity_of(default_model_path(), "test")
    got = share(model_of(first), tmp_path, identity)
    assert got.written and got.kept_bytes == 0 and got.shared_bytes > 80 << 20  # the packed model: ~94 MiB
    assert got.path.parent == tmp_path and got.path.stat().st_size == got.shared_bytes
    assert len(large_storages(model_of(first))) == 1  # every large tensor now views the one mapping
    assert greedy(first) == want
    first.check_blocks_returned()

    second = harness()
    assert greedy(second) == want  # a step before the move: its decode stack's plan is made again after it
    again = share(model_of(second), tmp_path, identity)
    assert again.path == got.path and not again.written and again.kept_bytes == 0
    assert mapped_from(got.path) == 2
    assert greedy(second) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == [got.path.name]  # no temporary file left


def test_weights_that_sit_elsewhere_in_their_storage_still_map_the_file(tmp_path: Path) -> None:
    """The huge-page arena puts the buffers at its mapping's first 2 MiB boundary, a different number of bytes in
    from its start in each process: only the bytes the tensors view go into the file, so a second engine still
    maps the first one's."""
    weights = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB

    def holder(pad: int) -> torch.nn.Module:
        base = torch.zeros(pad + weights.numel())
        base[pad:] = weights
        module = torch.nn.Module()
        module.register_buffer("w", base[pad:])
        return module

    one, other = holder(1024), holder(4112)  # 4 KiB and 16,448 bytes into their storages
    first = share(one, tmp_path, "arena")
    again = share(other, tmp_path, "arena")
    assert first.written and not again.written and again.path == first.path
    assert first.shared_bytes == again.shared_bytes == weights.numel() * 4
    assert torch.equal(one.w, weights) and torch.equal(other.w, weights) and mapped_from(first.path) == 2


def test_a_file_that_is_not_the_loaded_weights_is_replaced(tmp_path: Path) -> None:
    want = greedy(harness())
    first = harness()
    identity = identity_of(default_model_path(), "test")
    path = share(model_of(first), tmp_path, identity).path
    del first  # (a process that maps the file would see the change: the file is its user's alone, mode 0600)
    with path.open("r+b") as f:  # another process's file of the same name and size, with other bytes
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    second = harness()
    got = share(model_of(second), tmp_path, identity)
    assert got.written and got.path == path
    assert greedy(second) == want  # its own bytes, in the new file that replaced the other under the name


def test_a_write_into_a_shared_weight_faults(tmp_path: Path) -> None:
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from gpu_engine.models.shared_weights import share, identity_of, _tensors, MIN_BYTES\n"
        "from gpu_engine.models.loader import default_model_path\n"
        "from test_shared_weights import harness, model_of\n"
        "m = model_of(harness())\n"
        "share(m, Path(sys.argv[1]), identity_of(default_model_path(), 'test'))\n"
        "big = [t for t in _tensors(m) if t.untyped_storage().nbytes() >= MIN_BYTES][0]\n"
        "print('writing', flush=True)\n"
        "big.view(-1)[0:1].fill_(0)\n"
        "print('wrote')\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    assert run.returncode == -signal.SIGSEGV, run.stdout + run.stderr
    assert "writing" in run.stdout and "wrote" not in run.stdout


def test_load_cpu_weights_shares_where_the_environment_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_engine import serve
    from shared import env

    tmp_path = tmp_path / "made"  # a folder that does not exist yet
    monkeypatch.setenv("BLINK_CPU_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setattr(env, "_ENV", None)  # read again
    cfg = EngineConfig(ring_name="local", geometry=GEO)
    one, two = serve.load_cpu_weights(cfg), serve.load_cpu_weights(cfg)
    (path,) = tmp_path.glob("weights-*.bin")
    assert mapped_from(path) == 2  # two mappings of the one file, each model's large tensors in one of them
    assert len(large_storages(one.model)) == len(large_storages(two.model)) == 1
    monkeypatch.delenv("BLINK_CPU_WEIGHTS_DIR")
    monkeypatch.setattr(env, "_ENV", None)
    alone = serve.load_cpu_weights(cfg)
    assert mapped_from(path) == 2  # its own weights (on huge pages, where the kernel offers them)
    assert large_storages(alone.model).isdisjoint(large_storages(one.model) | large_storages(two.model))


def test_a_folder_others_can_write_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_engine import serve
    from shared import env

    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        share(model_of(harness()), open_folder, identity_of(default_model_path(), "test"))
    assert list(open_folder.iterdir()) == []
    monkeypatch.setenv("BLINK_CPU_WEIGHTS_DIR", str(open_folder))
    monkeypatch.setattr(env, "_ENV", None)
    w = serve.load_cpu_weights(EngineConfig(ring_name="local", geometry=GEO))  # loads, with its own copy
    assert list(open_folder.iterdir()) == [] and len(large_storages(w.model)) == 1

