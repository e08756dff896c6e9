"""An NVML stand-in (the part of nvidia-ml-py's ``pynvml`` that trainer_pkg.hardware calls), for tests
on machines without a GPU: put this directory first on ``sys.path``/``PYTHONPATH`` and ``import pynvml``
finds it. Four GPUs whose figures are functions of their index ``i`` (0-3), so a test can tell which
GPU a rank's series came from:

=========================  ===================================  ==========================
call                       value                                as the sampler stores it
=========================  ===================================  ==========================
utilization.gpu            10 × (i + 1) %                       ``sys/gpu_util_pct``
memory used                1.5e9 × (i + 1) bytes                ``sys/gpu_mem_used_mb`` (1500 × (i + 1))
power usage                100,000 + 1,000 × i mW               ``sys/gpu_power_w`` (100 + i)
temperature                50 + i °C                            ``sys/gpu_temp_c``
SM clock                   1,400 + i MHz                        ``sys/gpu_sm_clock_mhz``
=========================  ===================================  ==========================

GPU 3 reports no power (``NVMLError``, NVML_ERROR_NOT_SUPPORTED on real boards that lack the sensor).
"""

from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
COUNT = 4
UUIDS = [f"GPU-fake-{i}" for i in range(COUNT)]


class NVMLError(Exception):
    pass


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return COUNT


def nvmlDeviceGetHandleByIndex(index):
    if not 0 <= index < COUNT:
        raise NVMLError("Invalid Argument")
    return index


def nvmlDeviceGetHandleByUUID(uuid):
    if uuid not in UUIDS:
        raise NVMLError("Not Found")
    return UUIDS.index(uuid)


def nvmlDeviceGetUtilizationRates(handle):
    return SimpleNamespace(gpu=10 * (handle + 1), memory=5)


def nvmlDeviceGetMemoryInfo(handle):
    return SimpleNamespace(total=80_000_000_000, used=1_500_000_000 * (handle + 1),
                           free=80_000_000_000 - 1_500_000_000 * (handle + 1))


def nvmlDeviceGetPowerUsage(handle):
    if handle == 3:
        raise NVMLError("Not Supported")
    return 100_000 + 1_000 * handle


def nvmlDeviceGetTemperature(handle, sensor):
    return 50 + handle


def nvmlDeviceGetClockInfo(handle, kind):
    return 1_400 + handle
