"""The machine record of a run (report header, phases.json) read from /proc/cpuinfo texts."""

from agentrl_jax.reproduce import machine

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
stepping\t: 8
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_tile

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Another CPU (never read: the first processor is)
"""

ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes crc32 sve
CPU implementer\t: 0x41
"""


def test_x86_cpuinfo_gives_the_model_identity_and_vector_features_of_the_first_processor():
    assert machine._cpuinfo(X86) == {
        "cpu": "Intel(R) Xeon(R) Platinum 8480+",
        "cpu_id": "GenuineIntel family 6 model 143 stepping 8",
        "cpu_flags": ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"],
    }


def test_arm_cpuinfo_without_a_model_name_still_gives_its_features():
    record = machine._cpuinfo(ARM)
    assert record["cpu_id"] == "" and record["cpu_flags"] == ["sve"] and record["cpu"]


def test_the_report_line_names_cpu_features_devices_and_versions():
    record = {
        **machine._cpuinfo(X86),
        "cores": 2,
        "arch": "x86_64",
        "devices": "8 x cpu",
        "processes": 2,
        "jax": "0.10.2",
        "jaxlib": "0.10.2",
    }
    assert machine.describe(record) == (
        "Intel(R) Xeon(R) Platinum 8480+ (GenuineIntel family 6 model 143 stepping 8; "
        "avx2 fma avx512f avx512_bf16 amx_tile; 2 cores, x86_64), 8 x cpu in 2 processes; "
        "jax 0.10.2, jaxlib 0.10.2"
    )
    here = machine.machine()
    assert set(here) >= {"cpu", "cpu_flags", "jax", "jaxlib", "devices"}
