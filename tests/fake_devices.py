"""The environment of a child process that sees ``count`` fake CPU devices.

JAX fixes its device count when it starts, so multi-device tests run a child process. The
child keeps this process's environment (``XLA_FLAGS`` included) and adds the device count.
"""

from __future__ import annotations

import os


def fake_devices_env(count: int = 8) -> dict[str, str]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
