"""Ctrl-C and SIGTERM held back around a checkpoint save (agentrl_jax/uninterrupted.py).

An interrupt inside Orbax's save closed its asyncio loop while tensorstore still wrote into it:
the process printed ``Event loop is closed`` tracebacks, or left a half-made checkpoint (seen in
CI in test_reproduce_pipeline's killed-run test). Checked here: the signal is delivered once
the block ends, to the handler in place; and a save loop interrupted at many moments ends with
a plain KeyboardInterrupt, no traceback on stderr and only complete checkpoints on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentrl_jax.uninterrupted import uninterrupted

ROOT = Path(__file__).resolve().parents[1]


def test_sigint_inside_the_block_is_raised_after_it():
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            signal.raise_signal(signal.SIGINT)
            ran.append("after the signal")  # the block goes on to its end
    assert ran == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_sigterm_goes_to_the_handler_in_place_once():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with uninterrupted():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)  # a second signal while held: ignored
            assert seen == []
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_no_signal_no_effect():
    with uninterrupted():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


SAVE_LOOP = textwrap.dedent(
    """
    import os, signal, sys, threading
    sys.path.insert(0, "tests")
    from train_fakes import tiny_model
    from agentrl_jax.train import Checkpointer, TrainConfig, init_train_state

    config = TrainConfig()
    state = init_train_state(tiny_model(), config)
    saver = Checkpointer(sys.argv[1], every=1, keep=3)
    saver.save(state.replace(step=1), config)  # compiled and warm
    saver.wait()
    step = 1
    for after_s in map(float, sys.argv[2:]):  # one interrupt per round, at another moment
        threading.Timer(after_s, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            while True:
                step += 1
                saver.save(state.replace(step=step), config)
        except KeyboardInterrupt:
            print("interrupted", step)
    saver.close()
    """
)


def test_a_save_loop_interrupted_anywhere_leaves_no_traceback_and_whole_checkpoints(tmp_path):
    directory = tmp_path / "checkpoints"
    done = subprocess.run(
        [sys.executable, "-c", SAVE_LOOP, str(directory), "0.13", "0.31", "0.57", "0.05", "0.22"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0 and done.stdout.count("interrupted") == 5, said[-3000:]
    assert "Traceback" not in said and "Event loop is closed" not in said, said[-3000:]
    left = sorted(p.name for p in directory.iterdir())
    assert left and all(name.isdigit() for name in left), left  # no half-made save
