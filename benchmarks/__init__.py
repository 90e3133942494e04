"""Benchmarks: each module is runnable with ``python -m benchmarks.<name>`` and writes JSON named by device."""


def device_slug() -> str:
    """``<platform>-<device kind>`` of the first JAX device, for result file names (e.g. ``gpu-nvidia-h100-80gb-hbm3``)."""
    import jax

    d = jax.devices()[0]
    return f"{d.platform}-{d.device_kind}".lower().replace(" ", "-")
